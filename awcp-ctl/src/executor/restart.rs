//! An Executor that starts again after its process died keeps the delegations it held.
//!
//! Each delegation's mount state lives in `<state>/<delegationId>/` (with several
//! resources, one directory per resource under `resources/`), with the transport handle
//! saved while its mount runs. On start, every such directory whose handle or journal is
//! still there belonged to a delegation this Executor held when it died: the leftover FUSE
//! mount is unmounted, what its mount journaled but never committed is written back (the
//! `awcpfs` recovery), and the delegation's outcome is decided: it ended in `error` with
//! `TASK_FAILED` and a message saying that the Executor restarted, that the agent was
//! stopped, and what became of its changes. The agent process is gone with its mount, so
//! the task cannot resume.
//!
//! That outcome is kept in `<state>/<delegationId>/restarted.json` until the Delegator
//! acknowledges it, and is what the Executor answers for that delegation: its event stream
//! (`GET /tasks/:id/events`) sends it as an `error` event (the Delegator's stream reconnects
//! to a restarted Executor), and `GET /tasks/:id/result` gives it (for `awcp-ctl recover`
//! when the Delegator's stream gave up before the restart) — never "not found".

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use awcp_protocol::ErrorCode;
use awcp_protocol::api::ErrorInfo;

use super::{ExecutorConfig, mounts, task};

/// The file holding a restarted delegation's outcome until it is acknowledged.
pub(crate) const RESTARTED_FILE: &str = "restarted.json";

/// What a mount's state directory held, and what recovery made of it.
enum Leftover {
    /// Recovered: this many changes (and conflicts) written back.
    Recovered { changes: usize, conflicts: usize },
    /// A live mount with nothing journaled: nothing to write back.
    Clean,
    /// Changes that could not be written back (why); they stay in the state directory.
    Failed(String),
}

/// Unmount what the previous process left mounted under the work directory, write back
/// what its mounts journaled, and return the outcome of every delegation it held, by id
/// (also the ones an earlier restart decided and no Delegator has acknowledged yet).
pub(crate) async fn recover(cfg: &ExecutorConfig) -> HashMap<String, ErrorInfo> {
    let work = cfg.work_dir.display().to_string();
    let mounted = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for mp in mounted.lines().filter_map(|l| l.split(' ').nth(4)) {
        if mp.starts_with(&format!("{work}/")) {
            tracing::warn!(
                mountpoint = mp,
                "unmounting a mount left by a previous executor"
            );
            let _ = nix::mount::umount2(mp, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    let mut out = HashMap::new();
    let Ok(dirs) = std::fs::read_dir(&cfg.state_dir) else {
        return out;
    };
    for top in dirs.flatten().map(|d| d.path()) {
        let Some(id) = top
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| awcp_protocol::DelegationId::parse(n).is_ok())
            .map(str::to_owned)
        else {
            continue;
        };
        if let Some(kept) = read_kept(&top) {
            out.insert(id, kept);
            continue;
        }
        // The task's state directory, or with several resources one per resource below it.
        let states: Vec<PathBuf> = std::iter::once(top.clone())
            .chain(
                std::fs::read_dir(top.join(mounts::RESOURCES_DIR))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|r| r.path()),
            )
            .collect();
        let mut leftovers = Vec::new();
        for state in &states {
            if let Some(l) = recover_one(state).await {
                leftovers.push(l);
            }
        }
        if leftovers.is_empty() {
            continue; // Not held when the process died (ended cleanly, or never mounted).
        }
        let info = outcome(&leftovers);
        tracing::warn!(delegation = %id, message = %info.message,
            "a delegation held when the executor died ends now");
        if let Err(e) = std::fs::write(
            top.join(RESTARTED_FILE),
            serde_json::to_vec(&info).unwrap_or_default(),
        ) {
            tracing::warn!(error = %e, "cannot keep a restarted delegation's outcome on disk");
        }
        out.insert(id, info);
    }
    out
}

/// The outcome an earlier start decided for the delegation at `top`, if not acknowledged.
fn read_kept(top: &Path) -> Option<ErrorInfo> {
    let bytes = std::fs::read(top.join(RESTARTED_FILE)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Forget delegation `id`'s restart outcome: its Delegator acknowledged it.
pub(crate) fn forget(cfg: &ExecutorConfig, id: &str) {
    if awcp_protocol::DelegationId::parse(id).is_ok() {
        let _ = std::fs::remove_file(cfg.state_dir.join(id).join(RESTARTED_FILE));
    }
}

/// Recover one mount's state directory; `None` when it held no live mount.
async fn recover_one(state: &Path) -> Option<Leftover> {
    let journal = state.join(awcpfs::mount::recover::JOURNAL_FILE);
    let journaled = std::fs::metadata(&journal).is_ok_and(|m| m.len() > 0);
    let handle_path = state.join(task::HANDLE_FILE);
    let handle: Option<awcp_protocol::transport::AwcpfsHandle> = std::fs::read(&handle_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    if !journaled {
        // A mount that was live (its handle is removed when it ends) with nothing to
        // write back.
        return handle_path.exists().then(|| {
            let _ = std::fs::remove_file(&handle_path);
            Leftover::Clean
        });
    }
    let Some(h) = handle else {
        tracing::error!(state = %state.display(),
            "unsynced changes but no saved handle: recover by hand with `awcpfs recover`");
        return Some(Leftover::Failed(
            "the mount's saved transport handle is missing".into(),
        ));
    };
    let remote = Arc::new(awcpfs::mount::remote::HttpRemote::new(
        &h.endpoint,
        &h.export_id,
        &h.token,
        Duration::from_secs(30),
    ));
    let st = state.to_path_buf();
    match tokio::task::spawn_blocking(move || awcpfs::mount::recover::recover(&st, remote)).await {
        Ok(Ok(r)) => {
            tracing::info!(state = %state.display(), changes = r.changes, files = r.files_written,
                conflicts = r.conflicts.len(), "recovered a crashed mount's changes");
            let _ = std::fs::remove_file(&handle_path);
            Some(Leftover::Recovered {
                changes: r.changes,
                conflicts: r.conflicts.len(),
            })
        }
        Ok(Err(e)) => {
            let why = format!("{:#}", anyhow::Error::from(e));
            tracing::error!(state = %state.display(), error = %why,
                "could not recover a crashed mount's changes; they stay in its state directory");
            Some(Leftover::Failed(why))
        }
        Err(e) => {
            tracing::error!(error = %e, "recovery task failed");
            Some(Leftover::Failed(format!("the recovery task failed: {e}")))
        }
    }
}

/// The delegation's outcome, from what recovery made of each of its mounts.
fn outcome(leftovers: &[Leftover]) -> ErrorInfo {
    let (mut changes, mut conflicts, mut failed) = (0, 0, Vec::new());
    for l in leftovers {
        match l {
            Leftover::Recovered {
                changes: c,
                conflicts: k,
            } => {
                changes += c;
                conflicts += k;
            }
            Leftover::Clean => {}
            Leftover::Failed(why) => failed.push(why.as_str()),
        }
    }
    let written = if failed.is_empty() {
        format!(
            "every change the agent made before was written back ({changes} change(s), \
             {conflicts} conflict(s))"
        )
    } else {
        format!(
            "{changes} change(s) were written back, but not all: {}; the rest stay in the \
             Executor's state directory for `awcpfs recover`",
            failed.join("; ")
        )
    };
    ErrorInfo {
        code: ErrorCode::TaskFailed,
        message: format!(
            "the Executor restarted while the task ran (its process was killed or crashed), \
             which stopped the agent; {written}"
        ),
        hint: Some(
            "Delegate again to finish the task; `awcp-ctl status` shows what was written back"
                .into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outcome_says_what_became_of_the_changes() {
        let ok = outcome(&[
            Leftover::Recovered {
                changes: 3,
                conflicts: 0,
            },
            Leftover::Clean,
        ]);
        assert_eq!(ok.code, ErrorCode::TaskFailed);
        assert!(ok.message.contains("Executor restarted"), "{}", ok.message);
        assert!(ok.message.contains("3 change(s)"), "{}", ok.message);
        let bad = outcome(&[Leftover::Failed("the lease has ended".into())]);
        assert!(bad.message.contains("not all"), "{}", bad.message);
        assert!(
            bad.message.contains("the lease has ended"),
            "{}",
            bad.message
        );
    }
}
