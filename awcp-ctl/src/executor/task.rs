//! Running one task: mount, agent, flush, report, unmount.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, BufReader};

use awcp_protocol::api::{ErrorInfo, TaskResultResponse, TaskResultStatus};
use awcp_protocol::events::{DoneEvent, ErrorEvent, RoundDoneEvent, RunStatus, StatusEvent};
use awcp_protocol::messages::{AccessMode, ActiveLease, StartMessage, TaskSpec};
use awcp_protocol::{AssignmentEvent, ErrorCode, TaskEvent, TransportHandle};
use awcpfs::mount::{EndReason, MountConfig};

use super::mounts::{MountPlan, MountSet};
use super::{Assignment, Executor};

/// Lines of agent output kept for the summary and error messages.
pub(super) const TAIL_LINES: usize = 20;
/// Agent output lines forwarded as progress events, at most.
pub(super) const MAX_PROGRESS_EVENTS: usize = 500;

pub(super) fn status_event(a: &Assignment, status: RunStatus, message: String) -> TaskEvent {
    TaskEvent::Status(StatusEvent {
        delegation_id: a.invite.delegation_id.clone(),
        timestamp: crate::now_iso(),
        status,
        message: Some(message),
        progress: None,
    })
}

pub(super) fn finish_error(a: &Assignment, code: ErrorCode, message: String, hint: Option<String>) {
    let event = match code {
        ErrorCode::Cancelled => AssignmentEvent::Cancel,
        ErrorCode::Expired => AssignmentEvent::Expire,
        _ => AssignmentEvent::TaskFail,
    };
    {
        let mut st = a.state.lock();
        // A pending assignment cannot "fail a task" it never started: an error received
        // from the Delegator ends it instead.
        if let Ok(next) = st
            .apply(event)
            .or_else(|_| st.apply(AssignmentEvent::ReceiveError))
        {
            *st = next;
        }
    }
    let now = crate::now_iso();
    *a.result.lock() = Some(TaskResultResponse {
        status: TaskResultStatus::Error,
        completed_at: Some(now.clone()),
        summary: None,
        highlights: None,
        snapshot_base64: None,
        error: Some(ErrorInfo {
            code: code.clone(),
            message: message.clone(),
            hint: hint.clone(),
        }),
        reason: None,
    });
    a.emit(TaskEvent::Error(ErrorEvent {
        delegation_id: a.invite.delegation_id.clone(),
        timestamp: now,
        code,
        message,
        hint,
    }));
}

/// A snapshot to report with `done`: its id and the base64 zip.
pub(super) struct DoneSnapshot {
    pub(super) id: String,
    pub(super) base64: String,
}

pub(super) fn finish_done(a: &Assignment, summary: String, snapshot: Option<DoneSnapshot>) {
    {
        let mut st = a.state.lock();
        if let Ok(next) = st.apply(AssignmentEvent::TaskComplete) {
            *st = next;
        }
    }
    let now = crate::now_iso();
    *a.result.lock() = Some(TaskResultResponse {
        status: TaskResultStatus::Completed,
        completed_at: Some(now.clone()),
        summary: Some(summary.clone()),
        highlights: None,
        snapshot_base64: snapshot.as_ref().map(|s| s.base64.clone()),
        error: None,
        reason: None,
    });
    a.emit(TaskEvent::Done(DoneEvent {
        delegation_id: a.invite.delegation_id.clone(),
        timestamp: now,
        summary,
        highlights: None,
        snapshot_ids: snapshot.as_ref().map(|s| vec![s.id.clone()]),
        recommended_snapshot_id: snapshot.map(|s| s.id),
    }));
}

fn lease_error(reason: &EndReason) -> (ErrorCode, String, Option<String>) {
    match reason {
        EndReason::Expired => (
            ErrorCode::Expired,
            "Lease expired during task execution".into(),
            Some("Ask the Delegator for a longer TTL or renew the lease".into()),
        ),
        EndReason::Revoked => (
            ErrorCode::Cancelled,
            "Delegation cancelled: the Delegator revoked the lease".into(),
            None,
        ),
        EndReason::Unmounted => (
            ErrorCode::Cancelled,
            "Delegation cancelled: the Executor stopped, or its mount was unmounted, before the task finished".into(),
            Some("Delegate again; changes closed before the stop were written back".into()),
        ),
    }
}

/// File in a mount's state directory holding its transport handle.
pub(super) const HANDLE_FILE: &str = "handle.json";

fn save_handle(
    state_dir: &std::path::Path,
    h: &awcp_protocol::transport::AwcpfsHandle,
) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(state_dir.join(HANDLE_FILE))?;
    f.write_all(&serde_json::to_vec(h).map_err(std::io::Error::other)?)
}

fn kill_group(pid: Option<u32>) {
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// A running agent: a command and the tasks reading its output, or a round on a remote
/// agent (see [`super::adapter`]).
pub(super) struct Agent {
    runner: Runner,
    /// The last lines of its output.
    pub(super) tail: Arc<Mutex<VecDeque<String>>>,
}

enum Runner {
    Command {
        child: tokio::process::Child,
        pid: Option<u32>,
        readers: Vec<tokio::task::JoinHandle<()>>,
    },
    Remote(super::adapter::RemoteRun),
}

/// How an agent's round ended.
pub(super) enum Exit {
    /// The command exited.
    Command(std::io::Result<std::process::ExitStatus>),
    /// The remote agent finished or failed.
    Remote(super::adapter::RemoteEnd),
}

impl Exit {
    /// Whether the round succeeded.
    pub(super) fn success(&self) -> bool {
        match self {
            Exit::Command(s) => s.as_ref().is_ok_and(|s| s.success()),
            Exit::Remote(e) => matches!(e, super::adapter::RemoteEnd::Done(_)),
        }
    }
}

impl Agent {
    /// Until the round ends. A remote agent's final words become the last line of the
    /// tail (the summary's).
    pub(super) async fn wait(&mut self) -> Exit {
        match &mut self.runner {
            Runner::Command { child, .. } => Exit::Command(child.wait().await),
            Runner::Remote(run) => {
                let end = run.wait().await;
                if let super::adapter::RemoteEnd::Done(summary) = &end {
                    let line = summary.lines().last().unwrap_or("").trim().to_string();
                    let mut t = self.tail.lock();
                    if !line.is_empty() && t.back() != Some(&line) {
                        t.push_back(line);
                        if t.len() > TAIL_LINES {
                            t.pop_front();
                        }
                    }
                }
                Exit::Remote(end)
            }
        }
    }

    /// Why the round failed (message and hint), or `None` if it succeeded.
    pub(super) fn failure(&self, exit: &Exit) -> Option<(String, Option<String>)> {
        match exit {
            Exit::Command(Ok(s)) if s.success() => None,
            Exit::Command(Ok(s)) => Some((
                format!(
                    "the agent exited with {s}; last output:\n{}",
                    self.tail_text()
                ),
                Some("Check task requirements and try again".into()),
            )),
            Exit::Command(Err(e)) => Some((format!("waiting for the agent failed: {e}"), None)),
            Exit::Remote(super::adapter::RemoteEnd::Done(_)) => None,
            Exit::Remote(super::adapter::RemoteEnd::Failed(m)) => Some((
                m.clone(),
                Some("See the remote agent's own log; the task can be delegated again".into()),
            )),
        }
    }

    /// The kept output, joined.
    pub(super) fn tail_text(&self) -> String {
        self.tail
            .lock()
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The last line the agent printed on stdout (a remote agent: its final words).
    pub(super) fn last_line(&self) -> Option<String> {
        self.tail
            .lock()
            .iter()
            .rev()
            .find(|l| !l.starts_with("[stderr]"))
            .cloned()
    }

    /// Stop it: kill a command's whole process group; cancel a remote agent's task.
    pub(super) async fn kill(&mut self) {
        match &mut self.runner {
            Runner::Command { child, pid, .. } => {
                kill_group(*pid);
                let _ = child.kill().await;
            }
            Runner::Remote(run) => run.cancel().await,
        }
    }

    /// Let the output readers drain (bounded).
    pub(super) async fn drain(&mut self) {
        if let Runner::Command { readers, .. } = &mut self.runner {
            for r in readers.drain(..) {
                let _ = tokio::time::timeout(Duration::from_secs(2), r).await;
            }
        }
    }
}

/// A round on the remote agent, told of the workspace at `cwd` (the single resource's
/// directory, else the work directory holding one directory per resource).
fn start_remote(
    ex: &Executor,
    remote: &super::adapter::RemoteAgent,
    a: &Arc<Assignment>,
    cwd: &std::path::Path,
) -> Agent {
    let resources = &a.invite.environment.resources;
    let task = super::adapter::AgentTask {
        delegation_id: a.invite.delegation_id.as_str().to_string(),
        round: a.round.load(std::sync::atomic::Ordering::SeqCst),
        task: a.task.lock().clone(),
        root: a.work_path.clone(),
        cwd: cwd.to_path_buf(),
        resources: resources
            .iter()
            .map(|r| super::adapter::ResourcePath {
                name: r.name.clone(),
                path: if resources.len() == 1 {
                    cwd.to_path_buf()
                } else {
                    a.work_path.join(&r.name)
                },
                mode: r.mode,
            })
            .collect(),
        lease: a.lease.lock().clone(),
        context_id: a.agent_context.lock().clone(),
    };
    let tail: Arc<Mutex<VecDeque<String>>> = Arc::new(Mutex::new(VecDeque::new()));
    let rep = super::adapter::Reporter {
        a: a.clone(),
        tail: tail.clone(),
        forwarded: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
    };
    a.emit(status_event(
        a,
        RunStatus::Progress,
        format!("handing round {} to the {}", task.round, remote.kind()),
    ));
    let run = super::adapter::start(remote, task, rep, ex.cfg.agent_timeout);
    Agent {
        runner: Runner::Remote(run),
        tail,
    }
}

/// Start the agent command in `cwd` (its own process group), forwarding its output lines
/// as `progress` events.
pub(super) fn spawn_agent(
    ex: &Executor,
    a: &Arc<Assignment>,
    cwd: &std::path::Path,
    on_mount: bool,
) -> std::io::Result<Agent> {
    if let Some(remote) = &ex.cfg.remote_agent {
        return Ok(start_remote(ex, remote, a, cwd));
    }
    let id = a.invite.delegation_id.as_str();
    let task = a.task.lock().clone();
    let mut cmd = tokio::process::Command::new("sh");
    // First: it scrubs the inherited environment, which the settings below then fill.
    super::confine::apply(ex, a, cwd, &mut cmd)?;
    cmd.arg("-c")
        .arg(&ex.cfg.agent_cmd)
        .current_dir(cwd)
        .env("AWCP_DELEGATION_ID", id)
        .env("AWCP_TASK_DESCRIPTION", &task.description)
        .env("AWCP_TASK_PROMPT", &task.prompt)
        .env(
            "AWCP_ROUND",
            a.round
                .load(std::sync::atomic::Ordering::SeqCst)
                .to_string(),
        )
        .env("AWCP_WORKSPACE", cwd)
        .env("AECP_SOCKET", super::confine::aecp_socket(ex, id))
        .env("AECP_TOKEN", super::confine::aecp_token(id))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    if on_mount && ex.cfg.git_fsmonitor {
        cmd.envs(super::fsmonitor::agent_git_env(
            ex.cfg.fsmonitor_hook.as_deref(),
        ));
    }
    if let Some(d) = ex.cfg.agent_user.as_ref().and_then(|u| u.blocked_at(cwd)) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the agent user cannot pass through {} to its workspace: start the \
                 Executor with a --dir it can reach (e.g. under /var/lib)",
                d.display()
            ),
        ));
    }
    let mut child = cmd.spawn()?;
    let pid = child.id();
    let tail: Arc<Mutex<VecDeque<String>>> = Arc::new(Mutex::new(VecDeque::new()));
    let forwarded = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut readers = Vec::new();
    for (stream, is_err) in [
        (
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
            false,
        ),
        (
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
            true,
        ),
    ] {
        let Some(stream) = stream else { continue };
        let (a, tail, forwarded) = (a.clone(), tail.clone(), forwarded.clone());
        readers.push(tokio::spawn(async move {
            let mut lines = BufReader::new(stream).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let line = if is_err {
                    format!("[stderr] {line}")
                } else {
                    line
                };
                {
                    let mut t = tail.lock();
                    t.push_back(line.clone());
                    if t.len() > TAIL_LINES {
                        t.pop_front();
                    }
                }
                if forwarded.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    < MAX_PROGRESS_EVENTS
                {
                    a.emit(status_event(&a, RunStatus::Progress, line));
                }
            }
        }));
    }

    Ok(Agent {
        runner: Runner::Command {
            child,
            pid,
            readers,
        },
        tail,
    })
}

/// How an awcpfs task ends once its agent exited (the mount already finished).
fn end_after_exit(
    a: &Assignment,
    mount: &MountSet,
    state_dir: &std::path::Path,
    status: Exit,
    agent: &Agent,
) {
    match mount.ended() {
        Some(reason @ (EndReason::Revoked | EndReason::Expired)) => {
            let (code, msg, hint) = lease_error(&reason);
            finish_error(a, code, msg, hint);
        }
        _ if mount.unsynced() => finish_error(
            a,
            ErrorCode::TransportError,
            format!(
                "some changes could not be written back; they are kept in {}",
                state_dir.display()
            ),
            Some("Collect them from the Executor's state directory".into()),
        ),
        _ => match agent.failure(&status) {
            None => {
                let summary = format!(
                    "agent finished{}; {} file(s) written back",
                    agent
                        .last_line()
                        .map(|l| format!(": {l}"))
                        .unwrap_or_default(),
                    mount.files_written_back()
                );
                finish_done(a, summary, None);
            }
            Some((message, hint)) => finish_error(a, ErrorCode::TaskFailed, message, hint),
        },
    }
}

/// What the Delegator asks of an idle multi-round session.
#[derive(Debug)]
pub(crate) enum RoundCmd {
    /// CONTINUE: run the agent again with this task.
    Continue {
        /// The round's task.
        task: TaskSpec,
        /// Its number.
        round: u32,
        /// The lease renewed for the round, replacing START's (or the last CONTINUE's).
        lease: Option<ActiveLease>,
    },
    /// CLOSE: end the session.
    Close,
}

/// The next command of an idle session (a closed channel counts as CLOSE, and so does
/// `idle_close` passing without one).
pub(super) async fn next_round(
    rx: &mut Option<tokio::sync::mpsc::UnboundedReceiver<RoundCmd>>,
    idle_close: Option<Duration>,
) -> RoundCmd {
    let next = async {
        match rx {
            Some(rx) => rx.recv().await.unwrap_or(RoundCmd::Close),
            None => RoundCmd::Close,
        }
    };
    match idle_close {
        Some(limit) => tokio::time::timeout(limit, next).await.unwrap_or_else(|_| {
            tracing::info!(
                idle = ?limit,
                "closing an idle session the Delegator neither continued nor closed"
            );
            RoundCmd::Close
        }),
        None => next.await,
    }
}

/// A round finished: `round_done`, and the assignment goes `idle`.
pub(super) fn finish_round(a: &Assignment, summary: String, snapshot: Option<DoneSnapshot>) {
    {
        let mut st = a.state.lock();
        if let Ok(next) = st.apply(AssignmentEvent::RoundComplete) {
            *st = next;
        }
    }
    a.emit(TaskEvent::RoundDone(RoundDoneEvent {
        delegation_id: a.invite.delegation_id.clone(),
        timestamp: crate::now_iso(),
        round: a.round.load(std::sync::atomic::Ordering::SeqCst),
        summary,
        highlights: None,
        snapshot_ids: snapshot.as_ref().map(|s| vec![s.id.clone()]),
        recommended_snapshot_id: snapshot.map(|s| s.id),
    }));
}

/// How long the lease a CONTINUE carries has left, at most this Executor's maximum TTL;
/// `None` without a lease or with an unreadable one (the deadline stays as it was).
pub(super) fn continued_lease(ex: &Executor, lease: Option<&ActiveLease>) -> Option<Duration> {
    let lease = lease?;
    let left = super::archive_task::lease_left(&lease.expires_at);
    if left.is_none() {
        tracing::warn!(expires_at = %lease.expires_at, "CONTINUE's lease.expiresAt is not an ISO 8601 time; keeping the deadline");
    }
    left.map(|l| l.min(ex.cfg.max_ttl))
}

/// CONTINUE: the next round starts (the route checked the assignment was idle).
pub(super) fn start_round(a: &Assignment, task: TaskSpec, round: u32, lease: Option<ActiveLease>) {
    if lease.is_some() {
        *a.lease.lock() = lease;
    }
    {
        let mut st = a.state.lock();
        if let Ok(next) = st.apply(AssignmentEvent::ReceiveContinue) {
            *st = next;
        }
    }
    *a.task.lock() = task;
    a.round.store(round, std::sync::atomic::Ordering::SeqCst);
    a.emit(status_event(
        a,
        RunStatus::Running,
        format!("Round {round} execution started"),
    ));
}

/// CLOSE: `idle → completed`, and `done` with the last round's summary (so `/result` keeps
/// what the agent reported; the reference's "Session closed by delegator" only when no round
/// reported anything).
pub(super) fn close_session(a: &Assignment) {
    {
        let mut st = a.state.lock();
        if let Ok(next) = st.apply(AssignmentEvent::ReceiveClose) {
            *st = next;
        }
    }
    let last = a.backlog.lock().iter().rev().find_map(|(_, ev)| match ev {
        TaskEvent::RoundDone(r) => Some(r.summary.clone()),
        _ => None,
    });
    finish_done(
        a,
        last.unwrap_or_else(|| "Session closed by delegator".into()),
        None,
    );
}

/// Run the task of `start` to its end.
pub(super) async fn run(ex: Arc<Executor>, a: Arc<Assignment>, start: StartMessage) {
    let received = std::time::Instant::now();
    {
        let mut st = a.state.lock();
        match st.apply(AssignmentEvent::ReceiveStart) {
            Ok(next) => *st = next,
            Err(e) => {
                tracing::warn!(error = %e, "START in the wrong state");
                return;
            }
        }
    }
    *a.started_at.lock() = Some(crate::now_iso());
    *a.lease.lock() = Some(start.lease.clone());
    let id = a.invite.delegation_id.as_str().to_string();
    let h = match start.transport_handle {
        TransportHandle::Awcpfs(h) => h,
        TransportHandle::Archive(h) => {
            let c = super::archive_task::Carrier::Archive(h);
            return super::archive_task::run(ex, a, start.lease.expires_at, c, received).await;
        }
        TransportHandle::Storage(h) => {
            let c = super::archive_task::Carrier::Storage(h);
            return super::archive_task::run(ex, a, start.lease.expires_at, c, received).await;
        }
        TransportHandle::Git(h) => {
            let c = super::archive_task::Carrier::Git(h);
            return super::archive_task::run(ex, a, start.lease.expires_at, c, received).await;
        }
        TransportHandle::Sshfs(h) => {
            let c = super::archive_task::Carrier::Sshfs(h);
            return super::archive_task::run(ex, a, start.lease.expires_at, c, received).await;
        }
    };
    let state_dir = ex.cfg.state_dir.join(&id);
    let plans = match super::mounts::plan(
        &h,
        &a.work_path,
        &state_dir,
        start.lease.access_mode == AccessMode::Ro,
    ) {
        Ok(p) => p,
        Err(e) => {
            finish_error(
                &a,
                ErrorCode::WorkspaceInvalid,
                format!("the transport handle is unusable: {e}"),
                Some("Give each resource a plain, unique name".into()),
            );
            return;
        }
    };
    for p in &plans {
        if let Err(e) = std::fs::create_dir_all(&a.work_path)
            .and_then(|_| give_to_agent(&ex, &a.work_path))
            .and_then(|_| awcpfs::private::create_dir_all(&p.state_dir))
        {
            finish_error(
                &a,
                ErrorCode::WorkdirDenied,
                format!("cannot create {}: {e}", a.work_path.display()),
                None,
            );
            return;
        }
        // Kept (owner-only) so that, should this process die, the next start can write
        // back what the mount journaled (see `executor::recover_leftovers`).
        if let Err(e) = save_handle(&p.state_dir, &p.handle) {
            tracing::warn!(error = %e, "cannot save the transport handle; a crash would need manual recovery");
        }
    }
    // The agent's own directory holds the socket the mount binds.
    if let Err(e) = super::confine::prepare_agent_dir(&ex, &id) {
        finish_error(
            &a,
            ErrorCode::WorkdirDenied,
            format!("cannot create the agent's directory: {e}"),
            None,
        );
        return;
    }
    let (ex2, id2) = (ex.clone(), id.clone());
    let started = tokio::task::spawn_blocking(move || {
        MountSet::start(&plans, |p| mount_config(&ex2, &id2, p, received))
    })
    .await;
    let mount = match started {
        Ok(Ok(m)) => m,
        Ok(Err((resource, e))) => {
            let msg = format!(
                "{}{}: {}",
                resource
                    .map(|r| format!("resource {r}: "))
                    .unwrap_or_default(),
                e,
                awcpfs::mount::sync::source_chain(&e)
            );
            finish_error(
                &a,
                ErrorCode::SetupFailed,
                msg,
                Some("Check that the Delegator's export is reachable and /dev/fuse exists".into()),
            );
            let _ = std::fs::remove_dir(&a.work_path);
            super::confine::remove_agent_dir(&ex, &id);
            return;
        }
        Err(e) => {
            finish_error(
                &a,
                ErrorCode::SetupFailed,
                format!("mount task failed: {e}"),
                None,
            );
            return;
        }
    };
    *a.mount.lock() = Some(mount.clone());
    tracing::debug!(
        ms = received.elapsed().as_millis() as u64,
        "START to a usable mount"
    );
    let (end_tx, end_rx) = tokio::sync::oneshot::channel();
    mount.on_end(move |r| {
        let _ = end_tx.send(r);
    });
    a.emit(status_event(
        &a,
        RunStatus::Running,
        format!(
            "Task execution started (workspace mounted at {})",
            a.work_path.display()
        ),
    ));

    let mut end_rx = end_rx;
    let mut rounds = a.rounds_rx.lock().take();
    loop {
        let mut agent = match spawn_agent(&ex, &a, &a.work_path, true) {
            Ok(agent) => agent,
            Err(e) => {
                let m = mount.clone();
                let _ = tokio::task::spawn_blocking(move || m.finish()).await;
                finish_error(
                    &a,
                    ErrorCode::SetupFailed,
                    format!("cannot start the agent command: {e}"),
                    None,
                );
                super::confine::remove_agent_dir(&ex, &id);
                return;
            }
        };
        enum Outcome {
            Exited(Exit),
            LeaseEnded(EndReason),
            Cancelled,
        }
        let outcome = tokio::select! {
            s = agent.wait() => Outcome::Exited(s),
            r = &mut end_rx => Outcome::LeaseEnded(r.unwrap_or(EndReason::Unmounted)),
            _ = a.cancel.notified() => Outcome::Cancelled,
        };
        match outcome {
            Outcome::Exited(s) if s.success() && a.multi_round => {
                // A round: write everything back, report, and wait for the next one with
                // the mount (and its warm cache) in place.
                agent.drain().await;
                let m = mount.clone();
                let flushed = tokio::task::spawn_blocking(move || m.flush()).await;
                if !matches!(flushed, Ok(Ok(_))) || mount.ended().is_some() {
                    // Fall through to the end of the task: the mount says why.
                    let m = mount.clone();
                    let _ = tokio::task::spawn_blocking(move || m.finish()).await;
                    end_after_exit(&a, &mount, &state_dir, s, &agent);
                    break;
                }
                let summary = format!(
                    "round {} finished{}; {} file(s) written back so far",
                    a.round.load(std::sync::atomic::Ordering::SeqCst),
                    agent
                        .last_line()
                        .map(|l| format!(": {l}"))
                        .unwrap_or_default(),
                    mount.files_written_back()
                );
                finish_round(&a, summary, None);
                let next = tokio::select! {
                    cmd = next_round(&mut rounds, a.idle_close) => Some(cmd),
                    r = &mut end_rx => {
                        let (code, msg, hint) = lease_error(&r.unwrap_or(EndReason::Unmounted));
                        finish_error(&a, code, msg, hint);
                        None
                    }
                    _ = a.cancel.notified() => {
                        let m = mount.clone();
                        let _ = tokio::task::spawn_blocking(move || {
                            m.end(EndReason::Revoked, Some(Duration::from_secs(5)))
                        })
                        .await;
                        finish_error(&a, ErrorCode::Cancelled, super::routes::cancel_reason(&a), None);
                        None
                    }
                };
                match next {
                    Some(RoundCmd::Continue { task, round, lease }) => {
                        if let Some(left) = continued_lease(&ex, lease.as_ref()) {
                            mount.set_remaining(left);
                        }
                        start_round(&a, task, round, lease);
                        continue;
                    }
                    Some(RoundCmd::Close) => {
                        let m = mount.clone();
                        let _ = tokio::task::spawn_blocking(move || m.finish()).await;
                        close_session(&a);
                    }
                    None => {}
                }
                break;
            }
            Outcome::Exited(status) => {
                agent.drain().await;
                let m = mount.clone();
                let _ = tokio::task::spawn_blocking(move || m.finish()).await;
                end_after_exit(&a, &mount, &state_dir, status, &agent);
            }
            Outcome::LeaseEnded(reason) => {
                agent.kill().await;
                let (code, msg, hint) = lease_error(&reason);
                finish_error(&a, code, msg, hint);
            }
            Outcome::Cancelled => {
                let m = mount.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    m.end(EndReason::Revoked, Some(Duration::from_secs(5)))
                })
                .await;
                agent.kill().await;
                let (code, msg, hint) = match mount.ended().unwrap_or(EndReason::Revoked) {
                    // Ended by the cancel itself: say who asked for it.
                    EndReason::Revoked if a.cancelled_by.lock().is_some() => {
                        (ErrorCode::Cancelled, super::routes::cancel_reason(&a), None)
                    }
                    other => lease_error(&other),
                };
                finish_error(&a, code, msg, hint);
            }
        }
        break;
    }
    ex.ended_mounts.add(&mount.stats_snapshots());
    *a.mount.lock() = None;
    // What was written back needs its handle (a credential) no longer.
    mount.clean_up(&a.work_path, HANDLE_FILE);
    super::confine::remove_agent_dir(&ex, &id);
}

/// Make `path` the agent user's (if there is one), so that it can work there.
pub(super) fn give_to_agent(ex: &Executor, path: &std::path::Path) -> std::io::Result<()> {
    match &ex.cfg.agent_user {
        Some(u) => nix::unistd::chown(
            path,
            Some(nix::unistd::Uid::from_raw(u.uid)),
            Some(nix::unistd::Gid::from_raw(u.gid)),
        )
        .map_err(std::io::Error::from),
        None => Ok(()),
    }
}

/// The mount config of one resource.
fn mount_config(
    ex: &Executor,
    id: &str,
    p: &MountPlan,
    received: std::time::Instant,
) -> MountConfig {
    let h = &p.handle;
    let mut mcfg = MountConfig::new(
        &h.endpoint,
        &h.export_id,
        &h.token,
        &p.mountpoint,
        &p.state_dir,
    );
    mcfg.manifest_digest = Some(h.manifest_digest.clone());
    mcfg.expires_at = Some(h.expires_at.clone());
    // Skew-free: the lease left when START was sent, minus the time since it arrived.
    mcfg.remaining = h
        .remaining_ms
        .map(|ms| Duration::from_millis(ms).saturating_sub(received.elapsed()));
    mcfg.read_only = p.read_only;
    mcfg.keep_cache = ex.cfg.keep_cache;
    mcfg.kernel.passthrough = ex.cfg.passthrough;
    if let Some(policy) = ex.cfg.hydrate {
        mcfg.hydrate = policy;
    }
    mcfg.kernel.no_open = !ex.cfg.track_opens;
    mcfg.kernel.writeback_cache = ex.cfg.writeback_cache;
    mcfg.passthrough_writers = ex.cfg.passthrough_writes.clone();
    mcfg.kernel.transport = ex.cfg.fuse_transport;
    mcfg.renew_margin = ex.cfg.renew_margin;
    mcfg.request_timeout = ex.cfg.read_timeout;
    mcfg.sync_debounce = ex.cfg.sync_debounce;
    mcfg.block_cache = ex.block_cache.clone();
    // The kernel lets only the mounting uid (root) in without allow_other: an agent user,
    // and the agent's processes that change user, need it; the 0700 work directory keeps
    // everyone else out (the mount checks that it does, see awcpfs::mount::access).
    mcfg.access = ex.cfg.mount_access;
    mcfg.owner = ex.cfg.agent_user.as_ref().map(|u| (u.uid, u.gid));
    mcfg.aecp_token = Some(super::confine::aecp_token(id));
    // Each resource's mount is a worker with its own socket, in the agent's own directory
    // (the state directory is closed to the agent): the only (or first) resource's is the
    // one AECP_SOCKET names, the others' are `aecp-<name>.sock` beside it. One agent, one
    // token for all of them.
    mcfg.aecp_socket = Some(match &p.name {
        Some(name) if h.export_id != id => super::confine::aecp_resource_socket(ex, id, name),
        _ => super::confine::aecp_socket(ex, id),
    });
    mcfg
}
