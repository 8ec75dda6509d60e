//! Running a task delivered with the reference's `archive` transport: verify and unpack the
//! zip into `<work-dir>/<delegationId>/` (one directory per resource), run the agent there,
//! then send the whole work directory back as a `snapshot` event and end with `done`.
//!
//! The lease is enforced here too (the reference never does): a START whose lease has
//! already run out fails with `START_EXPIRED`, and a task still running at `expiresAt` is
//! killed and ends with `EXPIRED`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;

use awcp_protocol::events::{SnapshotEvent, SnapshotMetadata};
use awcp_protocol::transport::ArchiveHandle;
use awcp_protocol::{ErrorCode, TaskEvent};

use super::task::{
    DoneSnapshot, RoundCmd, close_session, finish_done, finish_error, finish_round, next_round,
    spawn_agent, start_round, status_event,
};
use super::{Assignment, Executor};
use crate::archive;

type Failure = (ErrorCode, String, Option<String>);

/// How long until `expires_at` (ISO 8601), from now; `None` if it does not parse.
pub(super) fn lease_left(expires_at: &str) -> Option<Duration> {
    let t = chrono::DateTime::parse_from_rfc3339(expires_at).ok()?;
    Some(
        (t.with_timezone(&chrono::Utc) - chrono::Utc::now())
            .to_std()
            .unwrap_or(Duration::ZERO),
    )
}

/// Whether `path` is mounted on (it sits on another device than its parent).
fn is_mount_point(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(m), Some(parent)) = (std::fs::symlink_metadata(path), path.parent()) else {
        return false;
    };
    std::fs::metadata(parent).is_ok_and(|p| p.dev() != m.dev())
}

/// Decode, verify and unpack the workspace (blocking).
fn unpack(
    ex: &Executor,
    a: &Assignment,
    h: &ArchiveHandle,
) -> Result<archive::ExtractStats, Failure> {
    let zip = base64::engine::general_purpose::STANDARD
        .decode(h.workspace_base64.as_bytes())
        .map_err(|e| {
            (
                ErrorCode::WorkspaceInvalid,
                format!("workspaceBase64 is not valid base64: {e}"),
                None,
            )
        })?;
    let actual = archive::sha256_hex(&zip);
    if !actual.eq_ignore_ascii_case(h.checksum.trim()) {
        return Err((
            ErrorCode::ChecksumMismatch,
            format!("Checksum mismatch: expected {}, got {actual}", h.checksum),
            Some("The downloaded file may be corrupted, try again".into()),
        ));
    }
    // A re-INVITE may leave an earlier attempt's directory: it is ours, start afresh —
    // unless something is mounted there (a live awcpfs workspace must never be emptied).
    if is_mount_point(&a.work_path) {
        return Err((
            ErrorCode::WorkdirDenied,
            format!("{} is a mount point in use", a.work_path.display()),
            Some("Wait for the delegation using it to end".into()),
        ));
    }
    if a.work_path.exists() {
        std::fs::remove_dir_all(&a.work_path).map_err(|e| {
            (
                ErrorCode::WorkdirDenied,
                format!("cannot clear {}: {e}", a.work_path.display()),
                None,
            )
        })?;
    }
    let stats = archive::extract(&zip, &a.work_path, &ex.cfg.archive_limits).map_err(|e| {
        let _ = std::fs::remove_dir_all(&a.work_path);
        match e {
            archive::ArchiveError::TooLarge { .. } => (
                ErrorCode::WorkspaceTooLarge,
                e.to_string(),
                Some("Delegate a smaller workspace, or use the awcpfs transport".into()),
            ),
            archive::ArchiveError::Io { .. } => (ErrorCode::WorkdirDenied, e.to_string(), None),
            _ => (
                ErrorCode::WorkspaceInvalid,
                e.to_string(),
                Some("The archive must hold <resource>/<path> entries, no links".into()),
            ),
        }
    })?;
    give_tree_to_agent(ex, &a.work_path).map_err(|e| {
        (
            ErrorCode::WorkdirDenied,
            format!(
                "cannot give {} to the agent user: {e}",
                a.work_path.display()
            ),
            None,
        )
    })?;
    Ok(stats)
}

/// With `--agent-user`, the unpacked workspace is the agent's to change (unpacked by root,
/// it would be read-only to it). Links are not followed: extraction refuses them anyway.
fn give_tree_to_agent(ex: &Executor, dir: &std::path::Path) -> std::io::Result<()> {
    if ex.cfg.agent_user.is_none() {
        return Ok(());
    }
    super::task::give_to_agent(ex, dir)?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            give_tree_to_agent(ex, &entry.path())?;
        } else {
            super::task::give_to_agent(ex, &entry.path())?;
        }
    }
    Ok(())
}

/// Run an `archive` task to its end.
pub(super) async fn run(
    ex: Arc<Executor>,
    a: Arc<Assignment>,
    expires_at: String,
    h: ArchiveHandle,
    received: Instant,
) {
    let Some(left) = lease_left(&expires_at) else {
        finish_error(
            &a,
            ErrorCode::WorkspaceInvalid,
            format!("lease.expiresAt is not an ISO 8601 time: {expires_at}"),
            None,
        );
        return;
    };
    if left.is_zero() {
        finish_error(
            &a,
            ErrorCode::StartExpired,
            "Lease expired before START message was received".into(),
            None,
        );
        return;
    }
    let deadline = tokio::time::Instant::from_std(received) + left;
    let (ex2, a2) = (ex.clone(), a.clone());
    let unpacked = tokio::task::spawn_blocking(move || unpack(&ex2, &a2, &h)).await;
    let stats = match unpacked {
        Ok(Ok(stats)) => stats,
        Ok(Err((code, msg, hint))) => return finish_error(&a, code, msg, hint),
        Err(e) => {
            return finish_error(
                &a,
                ErrorCode::SetupFailed,
                format!("unpacking failed: {e}"),
                None,
            );
        }
    };
    a.emit(status_event(
        &a,
        awcp_protocol::events::RunStatus::Running,
        format!(
            "Task execution started ({} file(s) unpacked in {})",
            stats.files,
            a.work_path.display()
        ),
    ));
    let mut rounds = a.rounds_rx.lock().take();
    let end = run_rounds(&ex, &a, deadline, &mut rounds).await;
    // The unpacked copy goes before the final event, so whoever sees `done` or `error`
    // finds it gone; the result stays in memory for `/tasks/:id/result`.
    cleanup(&a).await;
    match end {
        End::Done(summary, snapshot) => finish_done(&a, summary, snapshot),
        End::Closed => close_session(&a),
        End::Error(code, msg, hint) => finish_error(&a, code, msg, hint),
    }
}

/// Where the agent runs: with one resource, that resource's directory
/// (`<workPath>/<name>`, the reference's layout), so the agent's working directory is the
/// workspace, as with `awcpfs`; with several, the work directory holding one directory per
/// resource.
fn agent_dir(a: &Assignment) -> std::path::PathBuf {
    // Only a plain name (one normal path component) may choose a directory below the work
    // directory; anything else (`..`, `a/b`) keeps the agent in the work directory.
    let plain = |name: &str| {
        let mut c = std::path::Path::new(name).components();
        matches!(
            (c.next(), c.next()),
            (Some(std::path::Component::Normal(_)), None)
        ) && !name.contains('/')
    };
    match a.invite.environment.resources.as_slice() {
        [one] if plain(&one.name) => {
            let dir = a.work_path.join(&one.name);
            // A resource with no files has no entries in the zip, hence no directory yet.
            if let Err(e) = std::fs::create_dir_all(&dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot create the resource directory; the agent runs in the work directory");
                return a.work_path.clone();
            }
            dir
        }
        _ => a.work_path.clone(),
    }
}

/// How an archive task ends.
enum End {
    Done(String, Option<DoneSnapshot>),
    Closed,
    Error(ErrorCode, String, Option<String>),
}

/// Run the agent, round after round in a multi-round session, until the task ends.
async fn run_rounds(
    ex: &Arc<Executor>,
    a: &Arc<Assignment>,
    mut deadline: tokio::time::Instant,
    rounds: &mut Option<tokio::sync::mpsc::UnboundedReceiver<RoundCmd>>,
) -> End {
    let expired = || {
        End::Error(
            ErrorCode::Expired,
            "Lease expired during task execution".into(),
            Some("Ask the Delegator for a longer TTL".into()),
        )
    };
    let cancelled = || End::Error(ErrorCode::Cancelled, super::routes::cancel_reason(a), None);
    let cwd = agent_dir(a);
    loop {
        let mut agent = match spawn_agent(ex, a, &cwd, false) {
            Ok(agent) => agent,
            Err(e) => {
                return End::Error(
                    ErrorCode::SetupFailed,
                    format!("cannot start the agent command: {e}"),
                    None,
                );
            }
        };
        enum Outcome {
            Exited(std::io::Result<std::process::ExitStatus>),
            Cancelled,
            Expired,
        }
        let outcome = tokio::select! {
            s = agent.child.wait() => Outcome::Exited(s),
            _ = a.cancel.notified() => Outcome::Cancelled,
            _ = tokio::time::sleep_until(deadline) => Outcome::Expired,
        };
        let status = match outcome {
            Outcome::Exited(s) => s,
            Outcome::Cancelled => {
                agent.kill().await;
                return cancelled();
            }
            Outcome::Expired => {
                agent.kill().await;
                return expired();
            }
        };
        agent.drain().await;
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => {
                return End::Error(
                    ErrorCode::TaskFailed,
                    format!(
                        "the agent exited with {s}; last output:\n{}",
                        agent.tail_text()
                    ),
                    Some("Check task requirements and try again".into()),
                );
            }
            Err(e) => {
                return End::Error(
                    ErrorCode::TaskFailed,
                    format!("waiting for the agent failed: {e}"),
                    None,
                );
            }
        }
        let last = agent
            .last_line()
            .map(|l| format!(": {l}"))
            .unwrap_or_default();
        let summary = if a.multi_round {
            format!(
                "round {} finished{last}",
                a.round.load(std::sync::atomic::Ordering::SeqCst)
            )
        } else {
            format!("agent finished{last}")
        };
        let snapshot = match send_snapshot(a, &summary).await {
            Ok(s) => s,
            Err(e) => return e,
        };
        if !a.multi_round {
            return End::Done(summary, Some(snapshot));
        }
        finish_round(a, summary, Some(snapshot));
        tokio::select! {
            cmd = next_round(rounds) => match cmd {
                RoundCmd::Continue { task, round, lease } => {
                    // The round runs until the lease CONTINUE carries ends.
                    if let Some(left) = super::task::continued_lease(ex, lease.as_ref()) {
                        deadline = tokio::time::Instant::now() + left;
                    }
                    start_round(a, task, round)
                }
                RoundCmd::Close => return End::Closed,
            },
            _ = a.cancel.notified() => return cancelled(),
            _ = tokio::time::sleep_until(deadline) => return expired(),
        }
    }
}

/// Zip the work directory and send it as a `snapshot` event.
async fn send_snapshot(a: &Assignment, summary: &str) -> Result<DoneSnapshot, End> {
    let dir = a.work_path.clone();
    match tokio::task::spawn_blocking(move || archive::pack_dir(&dir)).await {
        Ok(Ok((zip, files, bytes))) => {
            let id = format!("snap_{}", hex::encode(rand::random::<[u8; 6]>()));
            let base64 = base64::engine::general_purpose::STANDARD.encode(&zip);
            a.emit(TaskEvent::Snapshot(SnapshotEvent {
                delegation_id: a.invite.delegation_id.clone(),
                timestamp: crate::now_iso(),
                snapshot_id: id.clone(),
                summary: summary.to_string(),
                highlights: None,
                snapshot_base64: base64.clone(),
                recommended: Some(true),
                metadata: Some(SnapshotMetadata {
                    file_count: Some(files),
                    total_bytes: Some(bytes),
                    ..Default::default()
                }),
            }));
            Ok(DoneSnapshot { id, base64 })
        }
        Ok(Err(e)) => Err(End::Error(
            ErrorCode::TaskFailed,
            format!("packing the result failed: {e}"),
            None,
        )),
        Err(e) => Err(End::Error(ErrorCode::TaskFailed, format!("{e}"), None)),
    }
}

/// The result is kept in memory for `/tasks/:id/result`; the unpacked copy goes.
async fn cleanup(a: &Assignment) {
    let dir = a.work_path.clone();
    let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
}
