//! The Executor's credential on the command line: a value, a file, or the environment.
//!
//! A value given on the command line is visible to every user of the machine (`ps`,
//! `/proc/<pid>/cmdline`), so it is warned about; the file (`--…-token-file`,
//! `AWCP_EXECUTOR_TOKEN_FILE`) and the environment (`AWCP_EXECUTOR_TOKEN`, whose value only
//! the process's user can read) are the ways to give it.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Args;

/// The environment variable that carries the Executor's credential.
pub(super) const ENV: &str = "AWCP_EXECUTOR_TOKEN";

/// The Executor's credential, for `delegate`, `serve` and `doctor` (the Delegator's side).
#[derive(Debug, Args)]
pub(super) struct ExecutorCredentialArgs {
    /// The Executor's credential (the content of its `<dir>/state/executor-token`), sent as
    /// INVITE's `auth`. Visible in `ps` to every user: prefer --executor-token-file or the
    /// environment variable.
    #[arg(long, env = "AWCP_EXECUTOR_TOKEN", hide_env_values = true)]
    pub(super) executor_token: Option<String>,
    /// Read the Executor's credential from this file (e.g. a copy of the Executor's
    /// `<dir>/state/executor-token`, kept 0600).
    #[arg(
        long,
        env = "AWCP_EXECUTOR_TOKEN_FILE",
        conflicts_with = "executor_token"
    )]
    pub(super) executor_token_file: Option<PathBuf>,
}

impl ExecutorCredentialArgs {
    /// The credential given, if any (warned about when it came as a value in argv).
    pub(super) fn resolve(&self) -> anyhow::Result<Option<String>> {
        resolve(
            self.executor_token.as_deref(),
            self.executor_token_file.as_deref(),
            "--executor-token",
            "--executor-token-file",
        )
    }
}

/// A token given as `value` (from argv or `AWCP_EXECUTOR_TOKEN`) or in `file`.
pub(super) fn resolve(
    value: Option<&str>,
    file: Option<&Path>,
    flag: &str,
    file_flag: &str,
) -> anyhow::Result<Option<String>> {
    if let Some(v) = value {
        if std::env::var(ENV).ok().as_deref() != Some(v) {
            tracing::warn!(
                "{flag} puts the Executor's credential on the command line, where every user \
                 of this machine can read it (ps): use {file_flag} FILE or {ENV} instead"
            );
        }
        anyhow::ensure!(!v.trim().is_empty(), "{flag} is empty");
        return Ok(Some(v.trim().to_string()));
    }
    match file {
        Some(f) => read(f).map(Some),
        None => Ok(None),
    }
}

/// The credential in `path` (trimmed).
pub(super) fn read(path: &Path) -> anyhow::Result<String> {
    let t = std::fs::read_to_string(path)
        .with_context(|| format!("reading the Executor's credential file {}", path.display()))?;
    let t = t.trim();
    anyhow::ensure!(
        !t.is_empty(),
        "the Executor's credential file {} is empty",
        path.display()
    );
    Ok(t.to_string())
}

/// The credential of an Executor on this machine that we can read (its file is 0600:
/// only its user can), when `executor_url` is a loopback URL: `$AWCP_EXECUTOR_DIR`'s, else
/// the default directory's. A remote Executor's credential is never guessed from a file.
pub(super) fn local_executor(executor_url: &str, default_dir: PathBuf) -> Option<String> {
    let url = reqwest::Url::parse(executor_url).ok()?;
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']');
    let local = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !local {
        return None;
    }
    let dir = std::env::var_os("AWCP_EXECUTOR_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or(default_dir);
    let path = awcp_ctl::executor::credential::credential_path(&dir.join("state"));
    read(&path).ok()
}
