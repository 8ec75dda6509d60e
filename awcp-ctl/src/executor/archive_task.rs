//! Running a task delivered with one of the reference's copying transports — `archive`,
//! `storage` or `git`: put the workspace in `<work-dir>/<delegationId>/` (one directory per
//! resource), run the agent there, then send the result back and end with `done`:
//! * `archive`: verify and unpack the zip from START; the result is the work directory
//!   zipped into the `snapshot` event;
//! * `storage`: download the zip from `downloadUrl` (with the handle's `headers`), verify
//!   and unpack it; the result is zipped and PUT to `uploadUrl`, and the `snapshot` event
//!   carries `{"resultUrl": uploadUrl}` as the reference's does;
//! * `git`: clone the base branch ([`super::git_task`]); the result is committed and pushed
//!   as `awcp/<delegationId>`, and the `snapshot` event carries the branch and commit;
//! * `sshfs`: mount the Delegator's export with the system's `sshfs`
//!   ([`super::sshfs_task`]); the agent writes into the Delegator's workspace as it works,
//!   so there is no snapshot (as the reference's), and the mount goes before `done`.
//!
//! The lease is enforced here too (the reference never does): a START whose lease has
//! already run out fails with `START_EXPIRED`, and a task still running at `expiresAt` is
//! killed and ends with `EXPIRED`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;

use awcp_protocol::events::{SnapshotEvent, SnapshotMetadata};
use awcp_protocol::transport::{
    ArchiveHandle, GitHandle, SshfsHandle, StorageHandle, StorageSnapshotInfo,
};
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

use super::sshfs_task::is_mount_point;

/// How the workspace arrives, per transport.
pub(super) enum Carrier {
    /// Inline in START.
    Archive(ArchiveHandle),
    /// Behind URLs.
    Storage(StorageHandle),
    /// On a git remote.
    Git(GitHandle),
    /// Behind the Delegator's sshd, mounted live.
    Sshfs(SshfsHandle),
}

/// Where the result goes, once the workspace is in place.
enum Out {
    /// Zipped into the `snapshot` event.
    Inline,
    /// Zipped and uploaded to this URL.
    Upload(String),
    /// Committed and pushed.
    Git(Arc<super::git_task::GitWork>),
    /// Already there: written live over SFTP.
    Sshfs(Arc<super::sshfs_task::SshfsMount>),
}

/// Decode the inline workspace (blocking).
fn decode_inline(h: &ArchiveHandle) -> Result<Vec<u8>, Failure> {
    base64::engine::general_purpose::STANDARD
        .decode(h.workspace_base64.as_bytes())
        .map_err(|e| {
            (
                ErrorCode::WorkspaceInvalid,
                format!("workspaceBase64 is not valid base64: {e}"),
                None,
            )
        })
}

/// Download a `storage` workspace, no larger than the Executor's `--max-body`.
async fn download(ex: &Executor, h: &StorageHandle) -> Result<Vec<u8>, Failure> {
    let transport = |msg: String| {
        (
            ErrorCode::TransportError,
            msg,
            Some("Check that the Executor can reach the Delegator's storage URL".into()),
        )
    };
    let mut rb = reqwest::Client::new().get(&h.download_url);
    for (k, v) in h.headers.iter().flatten() {
        rb = rb.header(k, v);
    }
    let mut resp = rb
        .send()
        .await
        .map_err(|e| transport(format!("Failed to download workspace: {e}")))?;
    if !resp.status().is_success() {
        return Err(transport(format!(
            "Failed to download workspace: {}",
            resp.status().as_u16()
        )));
    }
    let cap = ex.cfg.max_body_bytes;
    let mut zip = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| transport(format!("Failed to download workspace: {e}")))?
    {
        if zip.len() + chunk.len() > cap {
            return Err((
                ErrorCode::WorkspaceTooLarge,
                format!("the workspace download exceeds this Executor's limit ({cap} bytes)"),
                Some("Delegate a smaller workspace, or use the awcpfs transport".into()),
            ));
        }
        zip.extend_from_slice(&chunk);
    }
    Ok(zip)
}

/// Verify and unpack the workspace zip (blocking).
fn unpack(
    ex: &Executor,
    a: &Assignment,
    zip: &[u8],
    checksum: &str,
) -> Result<archive::ExtractStats, Failure> {
    let actual = archive::sha256_hex(zip);
    if !actual.eq_ignore_ascii_case(checksum.trim()) {
        return Err((
            ErrorCode::ChecksumMismatch,
            format!("Checksum mismatch: expected {checksum}, got {actual}"),
            Some("The downloaded file may be corrupted, try again".into()),
        ));
    }
    clear_work_dir(a)?;
    let stats = archive::extract(zip, &a.work_path, &ex.cfg.archive_limits).map_err(|e| {
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

/// A re-INVITE may leave an earlier attempt's directory: it is ours, start afresh —
/// unless something is mounted there (a live awcpfs workspace must never be emptied).
fn clear_work_dir(a: &Assignment) -> Result<(), Failure> {
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
    Ok(())
}

/// Clone a `git` workspace into the work directory (blocking).
fn clone_git(ex: &Executor, a: &Assignment, h: &GitHandle) -> Result<Out, Failure> {
    clear_work_dir(a)?;
    let id = a.invite.delegation_id.as_str();
    let state = ex.cfg.state_dir.join(id);
    let w = super::git_task::setup(
        h,
        id,
        &a.work_path,
        &state.join("git"),
        &state.join("git-key"),
    )
    .map_err(|e| {
        let _ = std::fs::remove_dir_all(&a.work_path);
        let code = match e.step {
            "setup" => ErrorCode::WorkspaceInvalid,
            _ => ErrorCode::TransportError,
        };
        (
            code,
            e.to_string(),
            Some("Check that the Executor can reach and read the Delegator's git remote".into()),
        )
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
    Ok(Out::Git(Arc::new(w)))
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
        let ft = entry.file_type()?;
        if ft.is_dir() {
            give_tree_to_agent(ex, &entry.path())?;
        } else if !ft.is_symlink() {
            super::task::give_to_agent(ex, &entry.path())?;
        }
    }
    Ok(())
}

/// Put the workspace in place; what to say when the agent starts, and where the result
/// goes.
async fn setup(
    ex: &Arc<Executor>,
    a: &Arc<Assignment>,
    c: Carrier,
) -> Result<(String, Out), Failure> {
    let (ex2, a2) = (ex.clone(), a.clone());
    let unpacked = |stats: archive::ExtractStats, a: &Assignment| {
        format!(
            "Task execution started ({} file(s) unpacked in {})",
            stats.files,
            a.work_path.display()
        )
    };
    let job = match c {
        Carrier::Archive(h) => tokio::task::spawn_blocking(move || {
            let zip = decode_inline(&h)?;
            let stats = unpack(&ex2, &a2, &zip, &h.checksum)?;
            Ok((unpacked(stats, &a2), Out::Inline))
        }),
        Carrier::Storage(h) => {
            let zip = download(ex, &h).await?;
            tokio::task::spawn_blocking(move || {
                let stats = unpack(&ex2, &a2, &zip, &h.checksum)?;
                Ok((unpacked(stats, &a2), Out::Upload(h.upload_url)))
            })
        }
        Carrier::Git(h) => tokio::task::spawn_blocking(move || {
            let out = clone_git(&ex2, &a2, &h)?;
            Ok((
                format!(
                    "Task execution started ({} at {} cloned into {})",
                    h.base_branch,
                    h.base_commit,
                    a2.work_path.display()
                ),
                out,
            ))
        }),
        Carrier::Sshfs(h) => tokio::task::spawn_blocking(move || {
            clear_work_dir(&a2)?;
            std::fs::create_dir_all(&a2.work_path)
                .and_then(|_| super::task::give_to_agent(&ex2, &a2.work_path))
                .map_err(|e| {
                    (
                        ErrorCode::WorkdirDenied,
                        format!("cannot create {}: {e}", a2.work_path.display()),
                        None,
                    )
                })?;
            let keys = ex2
                .cfg
                .state_dir
                .join(a2.invite.delegation_id.as_str())
                .join("sshfs");
            let m = super::sshfs_task::mount(
                &h,
                &a2.work_path,
                &keys,
                ex2.cfg.agent_user.as_ref().map(|u| (u.uid, u.gid)),
            )
            .inspect_err(|_| {
                let _ = std::fs::remove_dir(&a2.work_path);
            })?;
            Ok((
                format!(
                    "Task execution started ({}@{}:{} mounted at {} with sshfs)",
                    h.endpoint.user,
                    h.endpoint.host,
                    h.endpoint.port,
                    a2.work_path.display()
                ),
                Out::Sshfs(Arc::new(m)),
            ))
        }),
    };
    job.await.map_err(|e| {
        (
            ErrorCode::SetupFailed,
            format!("setting up the workspace failed: {e}"),
            None,
        )
    })?
}

/// Run an `archive`, `storage` or `git` task to its end.
pub(super) async fn run(
    ex: Arc<Executor>,
    a: Arc<Assignment>,
    expires_at: String,
    carrier: Carrier,
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
    let live = matches!(carrier, Carrier::Sshfs(_));
    // A revoke or the lease's end during a download or clone stops it too. A mount is
    // never abandoned half-way (one finishing after its cleanup would outlive the task):
    // `sshfs` has its own timeout, and a revoke meanwhile is seen by the first round.
    let ready = tokio::select! {
        r = setup(&ex, &a, carrier) => r,
        _ = a.cancel.notified(), if !live => Err((ErrorCode::Cancelled, super::routes::cancel_reason(&a), None)),
        _ = tokio::time::sleep_until(deadline), if !live => Err((
            ErrorCode::Expired,
            "Lease expired while the workspace was being set up".into(),
            Some("Ask the Delegator for a longer TTL".into()),
        )),
    };
    let out = match ready {
        Ok((message, out)) => {
            a.emit(status_event(
                &a,
                awcp_protocol::events::RunStatus::Running,
                message,
            ));
            out
        }
        Err((code, msg, hint)) => {
            cleanup(&a, None).await;
            return finish_error(&a, code, msg, hint);
        }
    };
    let mut rounds = a.rounds_rx.lock().take();
    let end = run_rounds(&ex, &a, deadline, &mut rounds, &out).await;
    // The unpacked copy goes before the final event, so whoever sees `done` or `error`
    // finds it gone; the result stays in memory for `/tasks/:id/result`.
    cleanup(&a, Some(&out)).await;
    super::confine::remove_agent_dir(&ex, a.invite.delegation_id.as_str());
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
fn agent_dir(ex: &Executor, a: &Assignment) -> std::path::PathBuf {
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
            // A resource with no files has no entries in the zip (nor in a git tree), hence
            // no directory yet; made here, it is the agent's like the rest of the tree.
            let made = !dir.exists();
            if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| {
                if made {
                    super::task::give_to_agent(ex, &dir)
                } else {
                    Ok(())
                }
            }) {
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
    out: &Out,
) -> End {
    let expired = || {
        End::Error(
            ErrorCode::Expired,
            "Lease expired during task execution".into(),
            Some("Ask the Delegator for a longer TTL".into()),
        )
    };
    let cancelled = || End::Error(ErrorCode::Cancelled, super::routes::cancel_reason(a), None);
    let cwd = agent_dir(ex, a);
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
            Exited(super::task::Exit),
            Cancelled,
            Expired,
        }
        let outcome = tokio::select! {
            s = agent.wait() => Outcome::Exited(s),
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
        if let Some((message, hint)) = agent.failure(&status) {
            return End::Error(ErrorCode::TaskFailed, message, hint);
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
        let snapshot = if let Out::Sshfs(_) = out {
            // Written live: nothing to send back.
            None
        } else {
            match send_snapshot(a, &summary, out).await {
                Ok(s) => Some(s),
                Err(e) => return e,
            }
        };
        if !a.multi_round {
            return End::Done(summary, snapshot);
        }
        finish_round(a, summary, snapshot);
        tokio::select! {
            cmd = next_round(rounds, a.idle_close) => match cmd {
                RoundCmd::Continue { task, round, lease } => {
                    // The round runs until the lease CONTINUE carries ends.
                    if let Some(left) = super::task::continued_lease(ex, lease.as_ref()) {
                        deadline = tokio::time::Instant::now() + left;
                    }
                    start_round(a, task, round, lease)
                }
                RoundCmd::Close => return End::Closed,
            },
            _ = a.cancel.notified() => return cancelled(),
            _ = tokio::time::sleep_until(deadline) => return expired(),
        }
    }
}

/// The result, as a `snapshot` event's `snapshotBase64` says it: the zip itself
/// (`archive`), or the JSON text naming where it was put (`storage`, `git`), as the
/// reference's Executors do; with the number of files and bytes when they are known.
async fn capture(a: &Assignment, out: &Out) -> Result<(String, Option<(u64, u64)>), End> {
    let failed = |msg: String| End::Error(ErrorCode::TaskFailed, msg, None);
    if let Out::Git(w) = out {
        let w = w.clone();
        let info = tokio::task::spawn_blocking(move || super::git_task::capture(&w))
            .await
            .map_err(|e| failed(format!("{e}")))?
            .map_err(|e| {
                End::Error(
                    ErrorCode::TransportError,
                    format!("pushing the result failed: {e}"),
                    Some("Check that the Executor may push to the Delegator's git remote".into()),
                )
            })?;
        let json = serde_json::to_string(&info).map_err(|e| failed(format!("{e}")))?;
        return Ok((json, None));
    }
    let dir = a.work_path.clone();
    let (zip, files, bytes) = tokio::task::spawn_blocking(move || archive::pack_dir(&dir))
        .await
        .map_err(|e| failed(format!("{e}")))?
        .map_err(|e| failed(format!("packing the result failed: {e}")))?;
    match out {
        Out::Upload(url) => {
            let resp = reqwest::Client::new()
                .put(url)
                .header("Content-Type", "application/zip")
                .body(zip)
                .send()
                .await;
            match resp {
                Ok(r) if r.status().is_success() => {}
                Ok(r) => {
                    return Err(End::Error(
                        ErrorCode::TransportError,
                        format!("Failed to upload snapshot: {}", r.status().as_u16()),
                        Some("The Delegator's upload URL may have expired with the lease".into()),
                    ));
                }
                Err(e) => {
                    return Err(End::Error(
                        ErrorCode::TransportError,
                        format!("Failed to upload snapshot: {e}"),
                        None,
                    ));
                }
            }
            let info = StorageSnapshotInfo {
                result_url: url.clone(),
            };
            let json = serde_json::to_string(&info).map_err(|e| failed(format!("{e}")))?;
            Ok((json, Some((files, bytes))))
        }
        _ => Ok((
            base64::engine::general_purpose::STANDARD.encode(&zip),
            Some((files, bytes)),
        )),
    }
}

/// Capture the result and send it as a `snapshot` event.
async fn send_snapshot(a: &Assignment, summary: &str, out: &Out) -> Result<DoneSnapshot, End> {
    match capture(a, out).await {
        Ok((base64, counts)) => {
            let id = format!("snap_{}", hex::encode(rand::random::<[u8; 6]>()));
            a.emit(TaskEvent::Snapshot(SnapshotEvent {
                delegation_id: a.invite.delegation_id.clone(),
                timestamp: crate::now_iso(),
                snapshot_id: id.clone(),
                summary: summary.to_string(),
                highlights: None,
                snapshot_base64: base64.clone(),
                recommended: Some(true),
                metadata: counts.map(|(files, bytes)| SnapshotMetadata {
                    file_count: Some(files),
                    total_bytes: Some(bytes),
                    ..Default::default()
                }),
            }));
            Ok(DoneSnapshot { id, base64 })
        }
        Err(e) => Err(e),
    }
}

/// The result is kept in memory for `/tasks/:id/result`; the unpacked copy goes, and a
/// `git` clone's git directory and key with it; an `sshfs` mount is unmounted (and its
/// credential removed). Nothing is ever removed through a mount: a work directory that
/// is still mounted on is left alone.
async fn cleanup(a: &Assignment, out: Option<&Out>) {
    let dir = a.work_path.clone();
    let (git, sshfs) = match out {
        Some(Out::Git(w)) => (Some(w.clone()), None),
        Some(Out::Sshfs(m)) => (None, Some(m.clone())),
        _ => (None, None),
    };
    let _ = tokio::task::spawn_blocking(move || {
        if let Some(w) = git {
            w.remove();
        }
        if let Some(m) = sshfs {
            m.finish();
        }
        if is_mount_point(&dir) && !super::sshfs_task::unmount(&dir) {
            tracing::error!(dir = %dir.display(), "the work directory is still mounted on; left in place");
            return Ok(());
        }
        std::fs::remove_dir_all(dir)
    })
    .await;
}
