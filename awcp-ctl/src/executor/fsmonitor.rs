//! git's filesystem monitor for agents on an awcpfs mount: the agent's environment names
//! `awcp-ctl fsmonitor` as git's `core.fsmonitor` hook (with the untracked cache), so
//! `git status` in the workspace looks only at what the mount's change log says changed
//! (see `awcpfs::fsmonitor`). The settings travel in `GIT_CONFIG_COUNT`/`KEY`/`VALUE`:
//! the Delegator's `.git/config` is never changed.

use std::process::ExitCode;

/// The environment for an agent on a mount: git's settings, after any the Executor's own
/// environment already gives, with `hook` as the hook command (`None`: this binary's
/// `fsmonitor`). Empty when this binary's path is unknown.
pub(super) fn agent_git_env(hook: Option<&str>) -> Vec<(String, std::ffi::OsString)> {
    let hook = match hook {
        Some(h) => h.to_string(),
        None => match own_binary() {
            Some(exe) => awcpfs::fsmonitor::hook_command(&exe, &["fsmonitor"]),
            None => return Vec::new(),
        },
    };
    let existing = std::env::var("GIT_CONFIG_COUNT").ok();
    let mut env = awcpfs::fsmonitor::git_config_env(&hook, existing.as_deref());
    // The mount shows the agent's user as every file's owner, while the Delegator's index
    // records its own: with git's default stat check every entry would look changed and
    // the first `git status` would read (fetch) the whole workspace. Compare times and
    // sizes only.
    if let Some(pos) = env.iter().position(|(k, _)| k == "GIT_CONFIG_COUNT") {
        let n: usize = env[pos].1.to_string_lossy().parse().unwrap_or(0);
        env[pos].1 = (n + 1).to_string().into();
        env.push((format!("GIT_CONFIG_KEY_{n}"), "core.checkStat".into()));
        env.push((format!("GIT_CONFIG_VALUE_{n}"), "minimal".into()));
    }
    env
}

/// The program the hook runs (`hook`'s first word, else this binary), for the agent's
/// sandbox to let it execute; `None` if it cannot be told.
pub(super) fn hook_binary(hook: Option<&str>) -> Option<std::path::PathBuf> {
    match hook {
        Some(h) => h
            .split_whitespace()
            .next()
            .map(|w| std::path::PathBuf::from(w.trim_matches(['\'', '"'])))
            .filter(|p| p.is_absolute()),
        None => own_binary(),
    }
}

/// This process's binary when it is `awcp-ctl` (the hook is its `fsmonitor` command).
/// Another program embedding the Executor (a test binary) has no such command: run as the
/// hook it would print something git takes for "nothing changed", so the monitor stays off
/// unless [`super::ExecutorConfig::fsmonitor_hook`] names one.
fn own_binary() -> Option<std::path::PathBuf> {
    match std::env::current_exe() {
        Ok(exe) if exe.file_name().is_some_and(|n| n == "awcp-ctl") => Some(exe),
        Ok(exe) => {
            tracing::debug!(exe = %exe.display(), "not awcp-ctl: git's fsmonitor stays off for agents");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot find this binary's path: git's fsmonitor stays off for agents");
            None
        }
    }
}

/// `awcp-ctl fsmonitor VERSION TOKEN`, run by git in the work tree: prints the mount's
/// answer. A failure exits 1, and git then looks at every file itself.
pub fn fsmonitor_hook(version: &str, token: &str) -> ExitCode {
    awcpfs::fsmonitor::run_hook("awcp-ctl fsmonitor", version, token)
}
