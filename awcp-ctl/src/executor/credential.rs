//! The Executor's credential: what a Delegator must present before this Executor runs
//! anything for it.
//!
//! The Executor runs code — the agent's, and whatever the workspace's tests and build
//! scripts do — so it takes INVITEs only from Delegators its operator trusts. At first start
//! it draws a credential (256 random bits, hex) into `<state_dir>/executor-token`, 0600 in
//! the 0700 state directory, and logs where it is; the operator hands the file's content to
//! each Delegator (`awcp-ctl delegate --executor-token-file`, `serve
//! --executor-token-file`, or a reference Delegator's INVITE `auth`). An operator may give
//! one instead (`--token-file`, `AWCP_EXECUTOR_TOKEN`, `--token`), or run open to anyone
//! with `--unsafe-open`, which is warned about at start and by `awcp-ctl doctor`.

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::ExecutorConfig;

/// The file in the Executor's state directory that holds its credential (0600).
pub const CREDENTIAL_FILE: &str = "executor-token";

/// Where the Executor with this state directory keeps its credential.
pub fn credential_path(state_dir: &Path) -> PathBuf {
    state_dir.join(CREDENTIAL_FILE)
}

/// Settle `cfg.token`: the one given, or none with `unsafe_open`, else the one in the
/// state directory (drawn now if there is none yet). Logs how to hand it over.
pub(super) fn resolve(cfg: &mut ExecutorConfig) -> anyhow::Result<()> {
    if cfg.unsafe_open {
        anyhow::ensure!(
            cfg.token.is_none(),
            "--unsafe-open takes no credential, but one was given (--token, --token-file or \
             AWCP_EXECUTOR_TOKEN): drop one of them"
        );
        tracing::warn!(
            "--unsafe-open: this Executor accepts INVITEs from ANYONE who can reach {} and \
             runs their code as the agent's user; do not use it on a machine with other \
             users or a reachable network",
            cfg.listen
        );
        return Ok(());
    }
    if let Some(t) = &cfg.token {
        anyhow::ensure!(
            !t.trim().is_empty(),
            "the Executor's credential is empty: give a non-empty one, or none to use {}",
            credential_path(&cfg.state_dir).display()
        );
        cfg.token = Some(t.trim().to_string());
        tracing::info!("Delegators must present the credential given (INVITE's auth)");
        return Ok(());
    }
    let path = credential_path(&cfg.state_dir);
    cfg.token = Some(load_or_create(&path)?);
    tracing::info!(
        path = %path.display(),
        "Delegators must present this Executor's credential: hand them the file's content \
         (awcp-ctl delegate --executor-token-file FILE, serve --executor-token-file FILE, or \
         a reference Delegator's INVITE auth {{type: bearer, credential}})"
    );
    Ok(())
}

/// The credential in `path`, or a fresh one written there (0600) if there is none yet. A
/// file readable by others is tightened and kept, with a warning.
fn load_or_create(path: &Path) -> anyhow::Result<String> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => {
            let mode = std::fs::metadata(path)?.permissions().mode();
            if awcpfs::private::is_shared(mode) {
                tracing::warn!(path = %path.display(), mode = format!("{:o}", mode & 0o777),
                    "the Executor's credential file was readable by others: made it 0600 \
                     (delete it and restart to draw a new credential)");
                awcpfs::private::restrict(path, awcpfs::private::FILE_MODE)?;
            }
            return Ok(s.trim().to_string());
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(e)
                .with_context(|| format!("reading the Executor's credential {}", path.display()));
        }
    }
    let token = crate::random_token();
    // Written under a temporary name and renamed, so a reader never sees half of it.
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".{CREDENTIAL_FILE}.{}", std::process::id()));
    let mut f = awcpfs::private::file_options()
        .truncate(true)
        .open(&tmp)
        .with_context(|| format!("writing the Executor's credential {}", tmp.display()))?;
    f.write_all(format!("{token}\n").as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("writing the Executor's credential {}", path.display()))?;
    tracing::info!(path = %path.display(), "drew the Executor's credential");
    Ok(token)
}

/// Whether `id` is random enough to stand as a proof. A delegation whose START carries no
/// token (a reference Delegator's `archive`) is proven by its id alone, which only the
/// Delegator that sent the authenticated INVITE knows: an id with few distinct digits or a
/// repeating pattern could be guessed. The reference draws its ids from `randomUUID()`
/// (122 random bits), ours from 128 random bits; either has 7 or more distinct hex digits
/// and no period shorter than its length except with a chance below 1e-9.
pub(crate) fn weak_id(id: &str) -> Option<String> {
    let hex = id
        .strip_prefix(awcp_protocol::DelegationId::PREFIX)?
        .as_bytes();
    let mut seen = [false; 256];
    for b in hex {
        seen[usize::from(*b)] = true;
    }
    let distinct = seen.iter().filter(|s| **s).count();
    if distinct < 7 {
        return Some(format!(
            "delegation id {id} has only {distinct} distinct hex digits: it is guessable"
        ));
    }
    if let Some(p) = (1..=hex.len() / 2).find(|p| hex.iter().zip(&hex[*p..]).all(|(a, b)| a == b)) {
        return Some(format!(
            "delegation id {id} repeats every {p} digits: it is guessable"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_credential_is_drawn_once_and_private() {
        let tmp = tempfile::tempdir().unwrap();
        let path = credential_path(tmp.path());
        let a = load_or_create(&path).unwrap();
        assert_eq!(a.len(), 64);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(load_or_create(&path).unwrap(), a, "a restart keeps it");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(load_or_create(&path).unwrap(), a);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "a loose file is tightened");
    }

    #[test]
    fn open_mode_takes_no_credential() {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = ExecutorConfig::new("true".into(), tmp.path().to_path_buf());
        cfg.unsafe_open = true;
        resolve(&mut cfg).unwrap();
        assert_eq!(cfg.token, None);
        assert!(!credential_path(&cfg.state_dir).exists());
        cfg.token = Some("x".into());
        assert!(resolve(&mut cfg).is_err());
    }

    #[test]
    fn guessable_ids_are_named_and_random_ones_pass() {
        for weak in [
            "dlg_00000000000000000000000000000000",
            "dlg_00000000000000000000000000000001",
            "dlg_abababababababababababababababab",
            "dlg_0123456789abcdef0123456789abcdef",
            "dlg_deadbeefdeadbeefdeadbeefdeadbeef",
        ] {
            assert!(weak_id(weak).is_some(), "{weak}");
        }
        for _ in 0..1000 {
            let id = awcp_protocol::DelegationId::from_random_bytes(rand::random());
            assert_eq!(weak_id(id.as_str()), None, "{id:?}");
        }
        // A reference id (randomUUID without hyphens).
        assert_eq!(weak_id("dlg_3f2a9c1e5b7d4e6f8a0b1c2d3e4f5a6b"), None);
    }
}
