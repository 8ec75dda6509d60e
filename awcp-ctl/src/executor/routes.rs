//! The Executor's HTTP routes under `/awcp`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde::Serialize;
use tokio_stream::wrappers::BroadcastStream;

use awcp_protocol::api::{
    CancelResponse, ExecutorDelegationInfo, ExecutorStatus, OkResponse, TaskResultResponse,
    TaskResultStatus,
};
use awcp_protocol::messages::{
    AcceptMessage, ExecutorConstraints, ExecutorWorkDir, InviteMessage, ProtocolVersion,
    SandboxProfile,
};
use awcp_protocol::{AssignmentState, AwcpMessage, ErrorCode, TaskEvent};

use super::{Assignment, Executor};

/// `{"error": "..."}`, the reference's error body.
#[derive(Debug, Serialize)]
struct ErrorBody {
    error: String,
}

pub(super) fn fail(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(ErrorBody { error: msg.into() })).into_response()
}

/// Whether the request carries this Executor's credential as a bearer token (always, for
/// an Executor open to anyone).
pub(super) fn authorized(ex: &Executor, headers: &HeaderMap) -> bool {
    match &ex.cfg.token {
        None => true,
        Some(t) => crate::bearer(headers).is_some_and(|b| crate::same_secret(b, t)),
    }
}

/// Who is asking to touch a delegation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Caller {
    /// Sent the delegation's proof: the capability token of its START, which only the
    /// Delegator that issued it holds.
    Delegator,
    /// Sent this Executor's own credential.
    TokenHolder,
    /// Sent neither, but named the delegation, which has no proof but its id: its START
    /// carried no token (a reference Delegator's `archive`), and the id — unguessable,
    /// accepted only from an INVITE that carried the credential, never shown to anyone
    /// else — is known only to the Delegator that sent it.
    IdHolder,
    /// Sent neither, on an Executor open to anyone (`--unsafe-open`), for a delegation
    /// without proof.
    Unauthenticated,
}

impl Caller {
    /// For recorded reasons: who it was.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Caller::Delegator => "the Delegator (it sent the delegation's proof)",
            Caller::TokenHolder => "a holder of this Executor's credential",
            Caller::IdHolder => {
                "the Delegator (it named the delegation's id, its only proof: its START \
                 carries none)"
            }
            Caller::Unauthenticated => {
                "an unauthenticated request (the delegation carries no proof: its \
                 Delegator sends none)"
            }
        }
    }
}

/// Whether a request bearing `given` may touch a delegation whose proof is `proof`: the
/// proof itself, or the Executor's credential, or — for a delegation whose proof is its id
/// alone — whoever names it.
fn caller_of(
    ex: &Executor,
    proof: Option<&str>,
    given: Option<&str>,
) -> Result<Caller, Box<Response>> {
    if let (Some(p), Some(g)) = (proof, given)
        && crate::same_secret(g, p)
    {
        return Ok(Caller::Delegator);
    }
    if let (Some(t), Some(g)) = (&ex.cfg.token, given)
        && crate::same_secret(g, t)
    {
        return Ok(Caller::TokenHolder);
    }
    if proof.is_none() {
        return Ok(if ex.cfg.token.is_some() {
            Caller::IdHolder
        } else {
            Caller::Unauthenticated
        });
    }
    let (status, what) = if given.is_some() {
        (
            StatusCode::FORBIDDEN,
            "the token sent is not this delegation's proof",
        )
    } else {
        (
            StatusCode::UNAUTHORIZED,
            "this delegation requires its Delegator's proof",
        )
    };
    Err(Box::new(fail(
        status,
        format!(
            "{what}: send `Authorization: Bearer <token>` with the capability token of its \
             START (the Delegator's awcp-ctl daemon does)"
        ),
    )))
}

/// The proof of delegation `id`: its START's token, from the assignment while it is
/// held, else from a handle a mount kept on disk (its kept changes outlive the
/// assignment: `collect` fetches them later).
fn proof_of(ex: &Executor, id: &str) -> Option<String> {
    if let Some(a) = ex.tasks.lock().get(id) {
        let p = a.proof.lock().clone();
        if p.is_some() {
            return p;
        }
    }
    awcp_protocol::DelegationId::parse(id).ok()?;
    let dir = ex.cfg.state_dir.join(id);
    let nested = std::fs::read_dir(dir.join(super::mounts::RESOURCES_DIR))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path());
    std::iter::once(dir.clone()).chain(nested).find_map(|d| {
        let bytes = std::fs::read(d.join(super::task::HANDLE_FILE)).ok()?;
        serde_json::from_slice::<awcp_protocol::transport::AwcpfsHandle>(&bytes)
            .ok()
            .map(|h| h.token)
    })
}

/// The routes under `/awcp/tasks/{id}/…` and `/awcp/cancel/{id}` touch one delegation:
/// they need its proof (see [`caller_of`]). The caller is left in the request's
/// extensions for the handler.
async fn require_proof(
    State(ex): State<Arc<Executor>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path().to_owned();
    let id = path
        .strip_prefix("/awcp/tasks/")
        .or_else(|| path.strip_prefix("/awcp/cancel/"))
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default()
        .to_owned();
    let proof = proof_of(&ex, &id);
    match caller_of(&ex, proof.as_deref(), crate::bearer(req.headers())) {
        Ok(c) => {
            req.extensions_mut().insert(c);
            next.run(req).await
        }
        Err(r) => {
            tracing::warn!(%id, path, "refused a request without the delegation's proof");
            *r
        }
    }
}

/// Why a cancelled task ended, naming who cancelled it.
pub(super) fn cancel_reason(a: &Assignment) -> String {
    match *a.cancelled_by.lock() {
        Some(c) => format!("Delegation cancelled by {}", c.describe()),
        None => "Delegation cancelled".into(),
    }
}

pub(super) fn router(ex: Arc<Executor>) -> Router {
    // The message endpoint reads its body itself (see `body`): a large START only when
    // awaited. Every other route's body is small.
    let limit = ex.cfg.small_body_bytes;
    let per_delegation = Router::new()
        .route("/awcp/tasks/{id}/events", get(events))
        .route("/awcp/tasks/{id}/result", get(result))
        .route("/awcp/tasks/{id}/ack", post(ack))
        .route(
            "/awcp/tasks/{id}/bundle",
            get(bundle).delete(discard_bundle),
        )
        .route("/awcp/cancel/{id}", post(cancel))
        .route("/awcp/tasks/{id}/aecp/witness", post(super::aecp::witness))
        .route_layer(axum::middleware::from_fn_with_state(
            ex.clone(),
            require_proof,
        ));
    Router::new()
        .route("/awcp", post(message))
        .route("/awcp/", post(message))
        .route("/awcp/status", get(status))
        .route("/metrics", get(super::metrics::metrics))
        .merge(per_delegation)
        .with_state(ex)
        .fallback(|| async {
            fail(
                StatusCode::NOT_FOUND,
                "no such route; the AWCP endpoint is /awcp",
            )
        })
        .layer(axum::extract::DefaultBodyLimit::max(limit))
}

async fn message(
    State(ex): State<Arc<Executor>>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let read = match super::body::read(&ex, &headers, body).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let body = read.bytes;
    let msg = match awcp_protocol::parse_message(&body) {
        Ok(m) => m,
        Err(e) if e.is_unknown_type() => {
            // An unknown `type` is the client's mistake: 400 (the reference throws, 500),
            // with the reference's message.
            let kind = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
                .unwrap_or_default();
            return fail(
                StatusCode::BAD_REQUEST,
                format!("Unexpected message type: {kind}"),
            );
        }
        Err(e) => {
            return fail(
                StatusCode::BAD_REQUEST,
                format!("invalid AWCP message: {e}"),
            );
        }
    };
    let id = msg.delegation_id().as_str().to_string();
    // A large body was read on because it named this waiting delegation: it must be its
    // START.
    if let Some(named) = &read.large_for
        && (named != &id || !matches!(msg, AwcpMessage::Start(_)))
    {
        return fail(
            StatusCode::PAYLOAD_TOO_LARGE,
            "a large body must be the START of the delegation it names",
        );
    }
    // INVITE checks its `auth` itself; START, CONTINUE, CLOSE and ERROR touch a
    // delegation: once its START has given it a proof, they need it.
    let caller = if matches!(msg, AwcpMessage::Invite(_)) {
        None
    } else {
        let proof = ex
            .tasks
            .lock()
            .get(&id)
            .and_then(|a| a.proof.lock().clone());
        match caller_of(&ex, proof.as_deref(), crate::bearer(&headers)) {
            Ok(c) => Some(c),
            Err(r) => return *r,
        }
    };
    match msg {
        AwcpMessage::Invite(inv) => Json(invite(&ex, inv, &headers, peer.ip())).into_response(),
        AwcpMessage::Start(start) => {
            // An unknown id: 404 (the reference: 500). A START in the wrong state: 500,
            // with the reference's message.
            let Some(a) = ex.tasks.lock().get(&id).cloned() else {
                if super::pending::expired(&ex, &id) {
                    return fail(
                        StatusCode::NOT_FOUND,
                        format!(
                            "Unknown delegation for START: {id}: its INVITE expired, no START \
                             came within {} s; INVITE again",
                            ex.cfg.pending_timeout.as_secs()
                        ),
                    );
                }
                return fail(
                    StatusCode::NOT_FOUND,
                    format!("Unknown delegation for START: {id}"),
                );
            };
            let state = *a.state.lock();
            if state != AssignmentState::Pending {
                return fail(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!(
                        "Cannot transition assignment {id} (RECEIVE_START) in state '{}': \
                         it was already started",
                        state.as_str()
                    ),
                );
            }
            // From now on the routes of this delegation need START's token.
            if let awcp_protocol::TransportHandle::Awcpfs(h) = &start.transport_handle {
                *a.proof.lock() = Some(h.token.clone());
            }
            // Started: no longer pending expiry (the runner moves the state on).
            *a.started_at.lock() = Some(crate::now_iso());
            tokio::spawn(super::task::run(ex.clone(), a, start));
            Json(OkResponse::OK).into_response()
        }
        AwcpMessage::Error(e) => {
            let Some(a) = ex.tasks.lock().get(&id).cloned() else {
                return fail(StatusCode::NOT_FOUND, format!("Unknown delegation: {id}"));
            };
            tracing::warn!(%id, code = e.code.as_str(), message = %e.message, "the delegator sent ERROR");
            if *a.state.lock() == AssignmentState::Pending {
                // Never started: end it here, so streams and /result say so.
                super::task::finish_error(
                    &a,
                    e.code.clone(),
                    format!("the Delegator ended the delegation: {}", e.message),
                    e.hint.clone(),
                );
            } else {
                // A running task: its runner ends the mount and reports.
                *a.cancelled_by.lock() = caller;
                a.cancel.notify_one();
            }
            Json(OkResponse::OK).into_response()
        }
        AwcpMessage::Continue(c) => round_cmd(
            &ex,
            &id,
            "RECEIVE_CONTINUE",
            super::task::RoundCmd::Continue {
                task: c.task,
                round: c.round,
                lease: c.lease,
            },
        ),
        AwcpMessage::Close(_) => round_cmd(&ex, &id, "RECEIVE_CLOSE", super::task::RoundCmd::Close),
        // ACCEPT, DONE: valid messages, but never sent to an Executor.
        other => fail(
            StatusCode::BAD_REQUEST,
            format!("Unexpected message type: {}", other.kind()),
        ),
    }
}

/// CONTINUE or CLOSE: only an `idle` assignment takes them (500 otherwise, as the
/// reference's multi-round branch).
fn round_cmd(ex: &Executor, id: &str, event: &str, cmd: super::task::RoundCmd) -> Response {
    let Some(a) = ex.tasks.lock().get(id).cloned() else {
        return fail(StatusCode::NOT_FOUND, format!("Unknown delegation: {id}"));
    };
    {
        // Checked and moved on under the lock, so two CONTINUEs cannot both pass.
        let mut state = a.state.lock();
        let ev = match cmd {
            super::task::RoundCmd::Continue { .. } => {
                awcp_protocol::AssignmentEvent::ReceiveContinue
            }
            super::task::RoundCmd::Close => awcp_protocol::AssignmentEvent::ReceiveClose,
        };
        match state.apply(ev) {
            Ok(next) if *state == AssignmentState::Idle => *state = next,
            _ => {
                return fail(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!(
                        "Cannot transition assignment {id} ({event}) in state '{}': expected 'idle'",
                        state.as_str()
                    ),
                );
            }
        }
    }
    if a.rounds_tx.send(cmd).is_err() {
        return fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("assignment {id} has no runner any more"),
        );
    }
    Json(OkResponse::OK).into_response()
}

fn invite(
    ex: &Arc<Executor>,
    inv: InviteMessage,
    headers: &HeaderMap,
    peer: std::net::IpAddr,
) -> AwcpMessage {
    let id = inv.delegation_id.clone();
    let refuse = |code: ErrorCode, message: String, hint: &str| {
        AwcpMessage::Error(
            awcp_protocol::messages::ErrorMessage::new(id.clone(), code, message).with_hint(hint),
        )
    };
    if let Some(token) = &ex.cfg.token {
        let given = inv
            .auth
            .as_ref()
            .map(|a| a.credential.as_str())
            .or_else(|| crate::bearer(headers));
        if !given.is_some_and(|g| crate::same_secret(g, token)) {
            tracing::warn!(%peer, id = id.as_str(), "refused an INVITE without this Executor's credential");
            return refuse(
                ErrorCode::AuthFailed,
                format!(
                    "Authentication failed: this Executor accepts INVITEs only with its \
                     credential ({} the one given)",
                    if given.is_some() {
                        "not"
                    } else {
                        "none was given, need"
                    }
                ),
                "Give the Executor's credential (its state directory's executor-token file) \
                 as INVITE's auth {type: bearer, credential}: awcp-ctl delegate \
                 --executor-token-file FILE, or serve --executor-token-file FILE",
            );
        }
    }
    // A delegation whose START carries no token is proven by its id alone: refuse one
    // that could be guessed.
    if let Some(why) = super::credential::weak_id(id.as_str()) {
        return refuse(
            ErrorCode::Declined,
            format!("{why}; this Executor takes an id as proof of its delegation"),
            "Draw delegation ids from a cryptographic random source: dlg_ + 32 hex digits \
             (128 random bits, or a random UUID without hyphens)",
        );
    }
    let authenticated = ex.cfg.token.is_some();
    if !authenticated
        && !ex.tasks.lock().contains_key(id.as_str())
        && let Err((message, hint)) = super::pending::room_for_anonymous(ex, peer)
    {
        return refuse(ErrorCode::Declined, message, &hint);
    }
    let max_ttl = ex.cfg.max_ttl.as_secs();
    if inv.lease.ttl_seconds > max_ttl {
        return refuse(
            ErrorCode::Declined,
            format!(
                "Requested TTL ({}s) exceeds maximum ({max_ttl}s)",
                inv.lease.ttl_seconds
            ),
            &format!("Request a shorter TTL (max: {max_ttl}s)"),
        );
    }
    if let Some(t) = inv.requirements.as_ref().and_then(|r| r.transport)
        && !ex.cfg.transports.contains(&t)
    {
        let offered: Vec<&str> = ex.cfg.transports.iter().map(|t| t.as_str()).collect();
        return refuse(
            ErrorCode::DepMissing,
            format!("Transport {} is not available", t.as_str()),
            &format!("Delegate with one of: {}", offered.join(", ")),
        );
    }
    if inv.requirements.as_ref().and_then(|r| r.transport)
        == Some(awcp_protocol::TransportType::Git)
        && !super::git_task::git_available()
    {
        return refuse(
            ErrorCode::DepMissing,
            "Git is not installed or not in PATH".into(),
            "Install git on the Executor, or delegate with another transport",
        );
    }
    if inv.requirements.as_ref().and_then(|r| r.transport)
        == Some(awcp_protocol::TransportType::Sshfs)
        && !super::sshfs_task::available()
    {
        return refuse(
            ErrorCode::DepMissing,
            "sshfs is not installed or not in PATH".into(),
            "Install sshfs on the Executor (Debian: apt-get install sshfs), or delegate with \
             another transport",
        );
    }
    if inv.requirements.as_ref().is_some_and(|r| r.no_network())
        && !super::confine::can_isolate_network(&ex.cfg)
    {
        return refuse(
            ErrorCode::Declined,
            "This Executor cannot run an agent without network".into(),
            "Delegate to an Executor that runs as root or has Landlock's network rules, \
             or allow the network",
        );
    }
    if !ex.cfg.access_modes.contains(&inv.lease.access_mode) {
        return refuse(
            ErrorCode::Declined,
            format!(
                "Access mode '{}' is not allowed",
                inv.lease.access_mode.as_str()
            ),
            "Request an allowed access mode",
        );
    }
    let active = ex
        .tasks
        .lock()
        .values()
        .filter(|a| !a.state.lock().is_terminal())
        .count();
    if active >= ex.cfg.max_concurrent && !ex.tasks.lock().contains_key(id.as_str()) {
        return refuse(
            ErrorCode::Declined,
            format!(
                "Maximum concurrent delegations ({}) reached",
                ex.cfg.max_concurrent
            ),
            "Try again when a running delegation has finished",
        );
    }
    // A re-INVITE resets a pending or ended assignment, as the reference's does — but never
    // one that is running here: its workspace is in use.
    if ex.tasks.lock().get(id.as_str()).is_some_and(|a| {
        matches!(
            *a.state.lock(),
            AssignmentState::Active | AssignmentState::Idle
        )
    }) {
        return refuse(
            ErrorCode::Declined,
            format!("Delegation {} is running on this executor", id.as_str()),
            "Cancel it first, or delegate with a new id",
        );
    }
    let work_path = ex.cfg.work_dir.join(id.as_str());
    let (tx, _) = tokio::sync::broadcast::channel(256);
    let (rounds_tx, rounds_rx) = tokio::sync::mpsc::unbounded_channel();
    let a = Arc::new(Assignment {
        multi_round: inv.multi_round.unwrap_or(ex.cfg.reference_rounds),
        idle_close: (inv.multi_round.is_none() && ex.cfg.reference_rounds)
            .then_some(ex.cfg.idle_timeout),
        round: std::sync::atomic::AtomicU32::new(1),
        task: parking_lot::Mutex::new(inv.task.clone()),
        lease: parking_lot::Mutex::new(None),
        agent_context: parking_lot::Mutex::new(None),
        rounds_tx,
        rounds_rx: parking_lot::Mutex::new(Some(rounds_rx)),
        invite: inv.clone(),
        state: parking_lot::Mutex::new(AssignmentState::Pending),
        work_path: work_path.clone(),
        started_at: parking_lot::Mutex::new(None),
        backlog: parking_lot::Mutex::new(Vec::new()),
        tx,
        result: parking_lot::Mutex::new(None),
        cancel: tokio::sync::Notify::new(),
        mount: parking_lot::Mutex::new(None),
        proof: parking_lot::Mutex::new(None),
        cancelled_by: parking_lot::Mutex::new(None),
        invited_by: super::pending::inviter(ex, peer, authenticated),
    });
    ex.tasks.lock().insert(id.as_str().to_string(), a.clone());
    super::pending::expire_later(ex.clone(), id.as_str().to_string(), &a);
    AwcpMessage::Accept(AcceptMessage {
        version: ProtocolVersion,
        delegation_id: id,
        retention_ms: inv.retention_ms.min(7 * 24 * 3600 * 1000),
        executor_work_dir: ExecutorWorkDir {
            path: work_path.display().to_string(),
        },
        executor_constraints: Some(ExecutorConstraints {
            accepted_access_mode: Some(inv.lease.access_mode),
            max_ttl_seconds: Some(inv.lease.ttl_seconds.min(max_ttl)),
            // What the agent will get (see executor/confine.rs).
            sandbox_profile: Some(SandboxProfile {
                cwd_only: Some(!ex.cfg.unsafe_agent_unconfined),
                allow_network: Some(
                    !(ex.cfg.agent_no_network
                        || inv.requirements.as_ref().is_some_and(|r| r.no_network())),
                ),
                allow_exec: Some(true),
            }),
        }),
    })
}

/// The assignment `id`, or the 404 the reference answers.
fn lookup(ex: &Executor, id: &str) -> Result<Arc<Assignment>, Box<Response>> {
    ex.tasks.lock().get(id).cloned().ok_or_else(|| {
        Box::new(fail(
            StatusCode::NOT_FOUND,
            format!("Delegation not found: {id}"),
        ))
    })
}

async fn events(
    State(ex): State<Arc<Executor>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Some(a) = ex.tasks.lock().get(&id).cloned() else {
        // As the reference: a 200 stream with one `error` event, then the end.
        let Ok(did) = awcp_protocol::DelegationId::parse(&id) else {
            return fail(
                StatusCode::BAD_REQUEST,
                format!("invalid delegation id: {id}"),
            );
        };
        // Held by this Executor before it restarted: how it ended, not "not found".
        let (code, message, hint) = match ex.restarted.lock().get(&id).cloned() {
            Some(e) => (e.code, e.message, e.hint),
            None => (
                ErrorCode::NotFound,
                "Delegation not found on executor".into(),
                None,
            ),
        };
        let ev = TaskEvent::Error(awcp_protocol::events::ErrorEvent {
            delegation_id: did,
            timestamp: crate::now_iso(),
            code,
            message,
            hint,
        });
        let one = futures::stream::iter([Ok::<_, Infallible>(
            Event::default().json_data(&ev).unwrap_or_default(),
        )]);
        return sse_response(one.boxed());
    };
    let after: u64 = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // Subscribe and copy under the backlog's lock, so no event falls between the two.
    let (rx, backlog, done) = {
        let full = a.backlog.lock();
        let rx = a.tx.subscribe();
        let backlog: Vec<_> = full.iter().filter(|(i, _)| *i > after).cloned().collect();
        // Ended already, whether or not the client saw the end: nothing more will come.
        let done = full.iter().any(|(_, e)| e.is_terminal());
        (rx, backlog, done)
    };
    let last = backlog.last().map(|(i, _)| *i).unwrap_or(after);
    // A stream opened before START (the Delegator opens it first) had no proof to show
    // yet: once START has given the delegation one, only a stream opened with it (or the
    // Executor's token) goes on.
    let given = crate::bearer(&headers).map(str::to_owned);
    // Weak: the stream must not keep the assignment (and its event sender) alive, or it
    // would not end when the assignment is acked away.
    let (ex2, a2) = (ex.clone(), Arc::downgrade(&a));
    let allowed = move || {
        let Some(a) = a2.upgrade() else {
            return true;
        };
        let proof = a.proof.lock().clone();
        caller_of(&ex2, proof.as_deref(), given.as_deref()).is_ok()
    };
    let live = BroadcastStream::new(rx)
        .filter_map(move |r| std::future::ready(r.ok().filter(|(i, _)| *i > last)))
        .take(if done { 0 } else { usize::MAX });
    // End right after `done`/`error`, without waiting for another item: the live part has
    // no next item until the ack drops the assignment, which kept the stream open until then.
    // Each item is let through only while the caller may see it (`allowed`, above).
    let events = futures::stream::iter(backlog).chain(live).boxed();
    let allowed = std::sync::Arc::new(allowed);
    let stream = futures::stream::unfold((events, false), move |(mut events, ended)| {
        let allowed = allowed.clone();
        async move {
            if ended {
                return None;
            }
            let item = events.next().await?;
            if !allowed() {
                return None;
            }
            let end = item.1.is_terminal();
            Some((item, (events, end)))
        }
    })
    .map(|(i, ev)| {
        Ok(Event::default()
            .id(i.to_string())
            .json_data(&ev)
            .unwrap_or_default())
    });
    sse_response(stream.boxed())
}

fn sse_response(
    stream: futures::stream::BoxStream<'static, Result<Event, Infallible>>,
) -> Response {
    (
        [("x-accel-buffering", "no")],
        Sse::new(stream).keep_alive(
            KeepAlive::new()
                .interval(Duration::from_secs(15))
                .text("keepalive"),
        ),
    )
        .into_response()
}

async fn result(State(ex): State<Arc<Executor>>, Path(id): Path<String>) -> Response {
    let Some(a) = ex.tasks.lock().get(&id).cloned() else {
        if let Some(e) = ex.restarted.lock().get(&id).cloned() {
            // Held before this Executor restarted: it ended then (see `restart`).
            return Json(TaskResultResponse {
                status: TaskResultStatus::Error,
                completed_at: None,
                summary: None,
                highlights: None,
                snapshot_base64: None,
                error: Some(e),
                reason: None,
            })
            .into_response();
        }
        let body = TaskResultResponse {
            status: TaskResultStatus::NotFound,
            completed_at: None,
            summary: None,
            highlights: None,
            snapshot_base64: None,
            error: None,
            reason: None,
        };
        return (StatusCode::NOT_FOUND, Json(body)).into_response();
    };
    let r = a.result.lock().clone().unwrap_or(TaskResultResponse {
        status: TaskResultStatus::Running,
        completed_at: None,
        summary: None,
        highlights: None,
        snapshot_base64: None,
        error: None,
        reason: None,
    });
    Json(r).into_response()
}

/// `?resource=<name>` of the bundle routes: which resource of a several-resource task.
#[derive(Debug, Default, serde::Deserialize)]
struct ResourceQuery {
    resource: Option<String>,
}

/// The state directory of delegation `id`, or of its `resource` (both validated first:
/// they become a path).
fn state_dir_of(
    ex: &Executor,
    id: &str,
    resource: Option<&str>,
) -> Result<std::path::PathBuf, Box<Response>> {
    let dir = awcp_protocol::DelegationId::parse(id)
        .map(|_| ex.cfg.state_dir.join(id))
        .map_err(|e| {
            Box::new(fail(
                StatusCode::BAD_REQUEST,
                format!("invalid delegation id: {e}"),
            ))
        })?;
    match resource {
        None => Ok(dir),
        Some(r) if !r.is_empty() && r != "." && r != ".." && !r.contains(['/', '\\', '\0']) => {
            Ok(dir.join(super::mounts::RESOURCES_DIR).join(r))
        }
        Some(r) => Err(Box::new(fail(
            StatusCode::BAD_REQUEST,
            format!("invalid resource name {r:?}"),
        ))),
    }
}

/// Ours: `GET /tasks/:id/bundle`: the changes a mount could not write back in time, as a
/// recovery bundle (`awcp-ctl collect`). 404 when nothing is kept.
async fn bundle(
    State(ex): State<Arc<Executor>>,
    Path(id): Path<String>,
    Query(q): Query<ResourceQuery>,
) -> Response {
    let dir = match state_dir_of(&ex, &id, q.resource.as_deref()) {
        Ok(d) => d,
        Err(r) => return *r,
    };
    let running = ex
        .tasks
        .lock()
        .get(&id)
        .is_some_and(|a| a.mount.lock().is_some());
    if running {
        return fail(
            StatusCode::CONFLICT,
            format!("delegation {id} is still mounted; its changes are being written back"),
        );
    }
    match tokio::task::spawn_blocking(move || awcpfs::mount::recover::bundle(&dir)).await {
        Ok(Ok(Some(bytes))) => (
            [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
            bytes,
        )
            .into_response(),
        Ok(Ok(None)) => fail(
            StatusCode::NOT_FOUND,
            format!("no unsynced changes are kept for {id}"),
        ),
        Ok(Err(e)) => fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("building the recovery bundle failed: {e}"),
        ),
        Err(e) => fail(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}")),
    }
}

/// Ours: `DELETE /tasks/:id/bundle`: drop the kept changes (after a collect, or to discard).
async fn discard_bundle(
    State(ex): State<Arc<Executor>>,
    Path(id): Path<String>,
    Query(q): Query<ResourceQuery>,
) -> Response {
    let dir = match state_dir_of(&ex, &id, q.resource.as_deref()) {
        Ok(d) => d,
        Err(r) => return *r,
    };
    if !awcpfs::mount::recover::has_unsynced(&dir) {
        return fail(
            StatusCode::NOT_FOUND,
            format!("no unsynced changes are kept for {id}"),
        );
    }
    awcpfs::mount::recover::remove_logs(&dir);
    let _ = std::fs::remove_dir_all(dir.join("upper"));
    let _ = std::fs::remove_file(dir.join(super::task::HANDLE_FILE));
    Json(OkResponse::OK).into_response()
}

async fn ack(State(ex): State<Arc<Executor>>, Path(id): Path<String>) -> Json<OkResponse> {
    {
        let mut tasks = ex.tasks.lock();
        if tasks.get(&id).is_some_and(|a| a.state.lock().is_terminal()) {
            tasks.remove(&id);
        }
    }
    if ex.restarted.lock().remove(&id).is_some() {
        super::restart::forget(&ex.cfg, &id);
    }
    Json(OkResponse::OK)
}

async fn cancel(
    State(ex): State<Arc<Executor>>,
    Path(id): Path<String>,
    axum::Extension(caller): axum::Extension<Caller>,
) -> Response {
    let a = match lookup(&ex, &id) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let state = *a.state.lock();
    if state.is_terminal() {
        return fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "Cannot transition assignment {id} (CANCEL) in state '{}': it has already ended",
                state.as_str()
            ),
        );
    }
    tracing::info!(%id, by = caller.describe(), "cancel");
    *a.cancelled_by.lock() = Some(caller);
    a.cancel.notify_one();
    if *a.state.lock() == AssignmentState::Pending {
        // Never started: nothing to unmount; end it here so streams and /result say so.
        super::task::finish_error(
            &a,
            ErrorCode::Cancelled,
            format!("{} before it started", cancel_reason(&a)),
            None,
        );
    }
    Json(CancelResponse {
        ok: true,
        cancelled: true,
    })
    .into_response()
}

/// `GET /status`. Anyone sees the counts, the transports and how Delegators are admitted;
/// only a holder of the credential sees ids, work paths, mounts and pending INVITEs.
async fn status(State(ex): State<Arc<Executor>>, headers: HeaderMap) -> Json<ExecutorStatus> {
    let full = ex.cfg.token.is_some() && authorized(&ex, &headers);
    let tasks: Vec<_> = ex
        .tasks
        .lock()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut st = ExecutorStatus {
        pending_invitations: 0,
        active_delegations: 0,
        completed_delegations: 0,
        delegations: Vec::new(),
        transports: Some(ex.cfg.transports.clone()),
        auth: Some(
            if ex.cfg.token.is_some() {
                "credential"
            } else {
                "open"
            }
            .into(),
        ),
        pending: full.then(Vec::new),
    };
    for (_, a) in tasks {
        match *a.state.lock() {
            AssignmentState::Pending => {
                st.pending_invitations += 1;
                if let Some(p) = st.pending.as_mut() {
                    p.push(awcp_protocol::api::PendingInvitation {
                        id: a.invite.delegation_id.clone(),
                        peer: a.invited_by.peer.to_string(),
                        authenticated: a.invited_by.authenticated,
                        expires_at: a.invited_by.expires_at.clone(),
                    });
                }
            }
            AssignmentState::Active | AssignmentState::Idle => {
                st.active_delegations += 1;
                // Its own Delegator (bearing the delegation's proof) sees its entry too.
                let own = crate::bearer(&headers).is_some_and(|g| {
                    a.proof
                        .lock()
                        .as_deref()
                        .is_some_and(|p| crate::same_secret(g, p))
                });
                if !full && !own {
                    continue;
                }
                st.delegations.push(ExecutorDelegationInfo {
                    id: a.invite.delegation_id.clone(),
                    work_path: a.work_path.display().to_string(),
                    started_at: a.started_at.lock().clone().unwrap_or_default(),
                    mount: a.mount.lock().as_ref().and_then(|m| m.status_json()),
                });
            }
            AssignmentState::Completed | AssignmentState::Error => st.completed_delegations += 1,
        }
    }
    Json(st)
}
