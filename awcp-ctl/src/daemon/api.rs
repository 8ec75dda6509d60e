//! The daemon API: the reference's routes (same shapes) plus ours (revoke, renew, events).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use tokio_stream::wrappers::BroadcastStream;

use awcp_protocol::api::{
    ApiError, ContinueResponse, DelegateRequest, DelegateResponse, DelegationList,
    DelegationRecord, DelegationSummary, HealthResponse, OkResponse, SnapshotList,
};
use awcp_protocol::dataplane::LeaseState;
use awcp_protocol::messages::TaskSpec;

use super::Daemon;
use super::flow::Refusal;
use crate::watch::WatchEvent;

/// Our additions to `GET /delegation/:id` (never renames of the reference's fields).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DelegationView {
    /// The reference's record.
    #[serde(flatten)]
    pub record: DelegationRecord,
    /// `awcpfs`, `archive`, `storage` or `git`.
    pub transport: String,
    /// The lease as the daemon enforces it.
    pub lease: LeaseView,
    /// Data-plane counters of the export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<serde_json::Value>,
    /// The Executor's view of its mount while the task runs (its `/awcp/status`); with
    /// several resources, their counters summed and each in `resources`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_mount: Option<serde_json::Value>,
    /// How far the setup got: the manifest builds (files and bytes hashed of the total).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<super::progress::ProgressView>,
    /// On a shared database (`serve --state postgres://…`): the daemon that runs the
    /// delegation (enforces its lease, follows its Executor). Another daemon's delegations
    /// are shown here read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// Lease state in [`DelegationView`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseView {
    /// Active, revoked or expired.
    pub state: LeaseState,
    /// Expiry, ISO 8601.
    pub expires_at: String,
    /// Milliseconds left.
    pub remaining_ms: u64,
    /// Renewals so far.
    pub renewals: u64,
}

/// `POST /delegation/:id/revoke` body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RevokeRequest {
    /// Refuse even the final flush.
    #[serde(default)]
    pub no_flush: bool,
}

/// `POST /delegation/:id/renew` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RenewRequest {
    /// New lease length from now.
    pub ttl_seconds: u64,
}

/// `POST /delegation/:id/renew` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RenewResponse {
    /// Always true.
    pub ok: bool,
    /// New expiry.
    pub expires_at: String,
}

pub(crate) struct ApiFailure(pub(crate) StatusCode, pub(crate) ApiError);

impl IntoResponse for ApiFailure {
    fn into_response(self) -> Response {
        (self.0, Json(self.1)).into_response()
    }
}

impl From<Refusal> for ApiFailure {
    fn from(r: Refusal) -> Self {
        let mut e = ApiError::new(r.message);
        e.code = r.code;
        e.hint = r.hint;
        ApiFailure(
            StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            e,
        )
    }
}

pub(crate) fn bad_json(rej: JsonRejection) -> ApiFailure {
    if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
        let mut e = ApiError::new(format!(
            "request body too large: the daemon accepts at most {} MiB",
            MAX_BODY_BYTES >> 20
        ));
        e.hint = Some(
            "A delegation request names its workspace by path; the files themselves are \
             never sent in the body"
                .into(),
        );
        return ApiFailure(StatusCode::PAYLOAD_TOO_LARGE, e);
    }
    let mut e = ApiError::new(format!("malformed request body: {}", rej.body_text()));
    e.hint = Some("Send a JSON body with the fields documented in docs/PROTOCOL.md".into());
    ApiFailure(StatusCode::BAD_REQUEST, e)
}

fn not_found(d: &Daemon, id: &str) -> ApiFailure {
    let mut e = ApiError::new(format!(
        "Delegation not found in daemon: no delegation with id {id}"
    ));
    e.hint = Some("`awcp-ctl status` lists the delegations this daemon knows".into());
    e.known_delegations = Some(d.live.lock().len() as u64);
    ApiFailure(StatusCode::NOT_FOUND, e)
}

/// Every request but `GET /health` needs a credential (unless the daemon runs with
/// `--unsafe-no-auth`): the kernel's word that the caller is the daemon's own user or root
/// (see [`crate::peer`]), or the daemon's API token. A layer over the whole router, so a
/// route added later is covered without a check of its own.
async fn require_token(
    State(d): State<Arc<Daemon>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    // A client that cannot send headers (the reference's `DelegatorDaemonClient`, hence its
    // MCP server) on another machine is given the daemon URL `http://host:port/t/<token>`
    // instead: the token is taken out of the path before the request is routed.
    let in_path = match strip_token(req.uri()) {
        Some((token, uri)) => {
            *req.uri_mut() = uri;
            Some(token)
        }
        None => None,
    };
    let path = req.uri().path();
    // `/ui/login` checks its one-time code itself (it is how a browser gets a session).
    let open = in_path.is_none()
        && req.method() == axum::http::Method::GET
        && (path == "/health" || path == super::ui::LOGIN_PATH);
    if super::ui::cross_site(req.headers()) {
        // A page of another site, in a browser the daemon's own user runs, would otherwise
        // be let in by that user's uid (or its live-view cookie, were SameSite ignored).
        let mut e = ApiError::new("Forbidden: a request sent by a page of another site");
        e.hint = Some(
            "The daemon API answers its own live view (`awcp-ctl ui`) and clients that are \
             not browsers"
                .into(),
        );
        return ApiFailure(StatusCode::FORBIDDEN, e).into_response();
    }
    let cookie = if in_path.is_none() {
        d.ui.check(req.headers(), req.method())
    } else {
        super::ui::CookieAuth::None
    };
    if cookie == super::ui::CookieAuth::NoCsrf && crate::bearer(req.headers()).is_none() {
        let mut e = ApiError::new("Forbidden: a change from the live view without its CSRF token");
        e.hint = Some(format!(
            "the live view sends its session's token in {}; reload the page",
            super::ui::CSRF_HEADER
        ));
        return ApiFailure(StatusCode::FORBIDDEN, e).into_response();
    }
    let header = crate::bearer(req.headers());
    let given = header.or(in_path.as_deref());
    let caller = req
        .extensions()
        .get::<axum::extract::ConnectInfo<crate::peer::Caller>>()
        .map(|c| c.0);
    // A client token of the state database (`awcp-ctl token create`): every daemon of a
    // shared database takes it.
    let mut stored = false;
    if !open && d.cfg.api_token.is_some() {
        for b in [header, in_path.as_deref()].into_iter().flatten() {
            if d.client_token_ok(b).await {
                stored = true;
                break;
            }
        }
    }
    let how = match &d.cfg.api_token {
        _ if open => Some(AUTH_OPEN),
        None => Some(AUTH_NONE),
        Some(_) if stored => Some(AUTH_CLIENT_TOKEN),
        // A token sent is checked even from a recognised caller: a wrong one is a
        // misconfigured client, told so.
        Some(t) if given.is_some() => [header, in_path.as_deref()]
            .into_iter()
            .flatten()
            .any(|b| crate::same_secret(b, t))
            .then_some(AUTH_TOKEN),
        Some(_) if cookie == super::ui::CookieAuth::Ok => Some(AUTH_UI_SESSION),
        Some(_) => (d.cfg.trust_local_uid && caller.is_some_and(|c| local_user(c.uid)))
            .then_some(AUTH_PEER_UID),
    };
    if let Some(how) = how {
        let mut resp = next.run(req).await;
        resp.headers_mut()
            .insert(AUTH_HEADER, axum::http::HeaderValue::from_static(how));
        return resp;
    }
    tracing::debug!(
        ?caller,
        token_sent = given.is_some(),
        "daemon API request refused"
    );
    let mut e = ApiError::new(if given.is_some() {
        "Unauthorized: the API token sent is not this daemon's"
    } else {
        "Unauthorized: this daemon requires its API token"
    });
    e.hint = Some(format!(
        "the daemon's own user (uid {}) and root need no token on this machine; any other \
         user or machine sends `Authorization: Bearer <token>` with the token of {} \
         (awcp-ctl: --api-token-file or AWCP_API_TOKEN)",
        daemon_uid(),
        d.cfg.state_dir.join(super::API_TOKEN_FILE).display()
    ));
    ApiFailure(StatusCode::UNAUTHORIZED, e).into_response()
}

/// Response header saying how the request was let in: [`AUTH_TOKEN`], [`AUTH_PEER_UID`],
/// [`AUTH_NONE`] (`--unsafe-no-auth`) or [`AUTH_OPEN`] (`GET /health`). `doctor` reads it.
pub const AUTH_HEADER: &str = "x-awcp-auth";
/// [`AUTH_HEADER`]: the API token was sent.
pub const AUTH_TOKEN: &str = "token";
/// [`AUTH_HEADER`]: the kernel named the caller as the daemon's user or root.
pub const AUTH_PEER_UID: &str = "peer-uid";
/// [`AUTH_HEADER`]: the daemon takes no credential (`serve --unsafe-no-auth`).
pub const AUTH_NONE: &str = "none";
/// [`AUTH_HEADER`]: a route open to all (`GET /health`).
pub const AUTH_OPEN: &str = "open";
/// [`AUTH_HEADER`]: a client token of the state database (`awcp-ctl token create`).
pub const AUTH_CLIENT_TOKEN: &str = "client-token";
/// [`AUTH_HEADER`]: the live view's session cookie (see [`super::ui`]).
pub const AUTH_UI_SESSION: &str = "ui-session";

/// The daemon's effective uid.
fn daemon_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Whether a caller the kernel names as `uid` may use the API without a token: the
/// daemon's own user, or root (which can read the token file and trace the daemon anyway).
fn local_user(uid: Option<u32>) -> bool {
    uid.is_some_and(|u| u == daemon_uid() || u == 0)
}

/// The largest request body the daemon API reads (larger: 413).
const MAX_BODY_BYTES: usize = 16 << 20;

/// Path prefix carrying the API token, for clients on another machine that cannot send an
/// `Authorization` header: `/t/<token>/delegate` is `/delegate` with that token. (On the
/// daemon's machine its own user needs no token at all.)
pub const TOKEN_PREFIX: &str = "/t/";

/// `/t/<token>/rest?query` → (`<token>`, `/rest?query`).
fn strip_token(uri: &axum::http::Uri) -> Option<(String, axum::http::Uri)> {
    let rest = uri.path().strip_prefix(TOKEN_PREFIX)?;
    let (token, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    Some((token.to_owned(), pq.parse().ok()?))
}

pub(crate) fn router(d: Arc<Daemon>) -> Router {
    use tower_layer::Layer as _;
    let routes = routes()
        .with_state(d.clone())
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES));
    // The token check wraps the whole router, before routing: every route and the
    // fallback are behind it, so a route added to `routes` needs no check of its own, and
    // a token in the path is removed before the route is chosen.
    let guarded = axum::middleware::from_fn_with_state(d, require_token).layer(routes);
    Router::new().fallback_service(guarded)
}

fn routes() -> Router<Arc<Daemon>> {
    Router::new()
        .route("/delegate", post(delegate))
        .route("/delegate/progress/{key}", get(setup_progress))
        .route("/delegations", get(list))
        .route("/delegation/{id}", get(show).delete(cancel))
        .route("/delegation/{id}/snapshots", get(snapshots))
        .route(
            "/delegation/{id}/snapshots/{sid}/apply",
            post(apply_snapshot),
        )
        .route(
            "/delegation/{id}/snapshots/{sid}/discard",
            post(discard_snapshot),
        )
        .route("/delegation/{id}/snapshots/{sid}/diff", get(diff_snapshot))
        .route("/delegation/{id}/continue", post(continue_round))
        .route("/delegation/{id}/close", post(close))
        .route("/delegation/{id}/recover", post(recover))
        .route("/delegation/{id}/revoke", post(revoke))
        .route("/delegation/{id}/renew", post(renew))
        .route("/delegation/{id}/events", get(events))
        .route("/delegation/{id}/collect", post(collect))
        .merge(super::aecp::routes())
        .merge(super::ui::routes())
        .merge(super::tokens::routes())
        .route("/health", get(health))
        .route("/metrics", get(super::metrics::metrics))
        .fallback(|| async { ApiFailure(StatusCode::NOT_FOUND, ApiError::new("no such route")) })
}

/// `GET /health` (no credential needed): `ok`, and on a shared database which daemon
/// this is (what `doctor` reports for each URL of a list).
async fn health(State(d): State<Arc<Daemon>>) -> Json<HealthResponse> {
    Json(HealthResponse {
        daemon: d.store.shared().then(|| d.daemon_id.clone()),
        ..HealthResponse::ok()
    })
}

async fn delegate(
    State(d): State<Arc<Daemon>>,
    headers: axum::http::HeaderMap,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<Json<DelegateResponse>, ApiFailure> {
    let Json(value) = body.map_err(|rej| {
        let mut f = bad_json(rej);
        if f.0 == StatusCode::BAD_REQUEST {
            f.1.error = format!(
                "{} (required fields: executorUrl, environment, task)",
                f.1.error
            );
        }
        f
    })?;
    // The reference's check and message, first.
    if ["executorUrl", "environment", "task"]
        .iter()
        .any(|k| value.get(k).is_none_or(|v| v.is_null()))
    {
        let mut e = ApiError::new("Missing required fields: executorUrl, environment, task");
        e.hint = Some("Send a JSON body with the fields documented in docs/PROTOCOL.md".into());
        return Err(ApiFailure(StatusCode::BAD_REQUEST, e));
    }
    let req: DelegateRequest = serde_json::from_value(value).map_err(|e| {
        let mut err = ApiError::new(format!("malformed request body: {e}"));
        err.hint = Some("Send a JSON body with the fields documented in docs/PROTOCOL.md".into());
        ApiFailure(StatusCode::BAD_REQUEST, err)
    })?;
    // Not a URL: the client's mistake, before anything is recorded (the reference: 500).
    if let Err(msg) = super::flow::check_executor_url(&req.executor_url) {
        let mut e = ApiError::new(msg);
        e.hint = Some("Give the Executor's AWCP endpoint, e.g. http://127.0.0.1:7200/awcp".into());
        return Err(ApiFailure(StatusCode::BAD_REQUEST, e));
    }
    // A client that shows progress names this setup with a key of its choosing.
    let progress = super::progress::Progress::new();
    let key = headers
        .get(super::progress::PROGRESS_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty() && k.len() <= 128)
        .map(str::to_string);
    if let Some(k) = &key {
        d.preparing.lock().insert(k.clone(), progress.clone());
    }
    let r = d.delegate(req, progress).await;
    if let Some(k) = &key {
        d.preparing.lock().remove(k);
    }
    Ok(Json(DelegateResponse { delegation_id: r? }))
}

/// Ours: `GET /delegate/progress/:key`: how far the `POST /delegate` that sent this
/// progress key has got (404 before it starts and once it has answered).
async fn setup_progress(
    State(d): State<Arc<Daemon>>,
    Path(key): Path<String>,
) -> Result<Json<super::progress::ProgressView>, ApiFailure> {
    let p = d.preparing.lock().get(&key).cloned();
    match p {
        Some(p) => Ok(Json(p.view())),
        None => {
            let mut e = ApiError::new(format!("no delegation is being set up with key {key}"));
            e.hint = Some("The delegation has been answered (or never started)".into());
            Err(ApiFailure(StatusCode::NOT_FOUND, e))
        }
    }
}

async fn list(State(d): State<Arc<Daemon>>) -> Json<DelegationList> {
    let live: Vec<_> = d.live.lock().values().cloned().collect();
    let mut delegations: Vec<DelegationSummary> = live
        .iter()
        .map(|l| {
            let r = &l.d.lock().record;
            DelegationSummary {
                id: r.id.clone(),
                state: r.state,
                executor_url: r.peer_url.clone(),
                environment: r.environment.clone(),
                created_at: r.created_at.clone(),
            }
        })
        .collect();
    delegations.sort_by(|a, b| a.created_at.cmp(&b.created_at));
    Json(DelegationList {
        active_delegations: delegations.len() as u64,
        delegations,
    })
}

async fn show(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
) -> Result<Json<DelegationView>, ApiFailure> {
    let live = d.get_live(&id).ok_or_else(|| not_found(&d, &id))?;
    let snap = live.lease.snapshot();
    let transfer = transfer_of(&live);
    let (record, transport) = {
        let d = live.d.lock();
        (d.record.clone(), d.transport.as_str().to_string())
    };
    let executor_mount = if record.state.is_terminal() {
        None
    } else {
        let token = live.d.lock().executor_token.clone();
        d.executor_mount(&record.peer_url, token.as_deref(), &id)
            .await
    };
    Ok(Json(DelegationView {
        record,
        executor_mount,
        transport,
        lease: LeaseView {
            state: snap.state,
            expires_at: live.lease.expires_at_rfc3339(),
            remaining_ms: u64::try_from(snap.remaining.as_millis()).unwrap_or(u64::MAX),
            renewals: snap.renewals,
        },
        transfer,
        progress: Some(live.progress.view()),
        owner: live
            .foreign_owner()
            .or_else(|| d.store.shared().then(|| d.daemon_id.clone())),
    }))
}

/// The exports' counters: one export's as they are; several summed, each also under
/// `resources` with its name.
fn transfer_of(live: &super::Live) -> Option<serde_json::Value> {
    let exports = live.exports.lock().clone();
    let names: Vec<String> = live
        .d
        .lock()
        .exported_resources()
        .into_iter()
        .map(|r| r.name)
        .collect();
    let each: Vec<serde_json::Value> = exports
        .iter()
        .filter_map(|e| serde_json::to_value(e.stats()).ok())
        .collect();
    match each.as_slice() {
        [] => None,
        [one] => Some(one.clone()),
        _ => {
            let mut sum = crate::jsonsum::sum(&each);
            let named = each
                .into_iter()
                .zip(names)
                .map(|(mut v, name)| {
                    if let Some(o) = v.as_object_mut() {
                        o.insert("name".into(), name.into());
                    }
                    v
                })
                .collect();
            if let Some(o) = sum.as_object_mut() {
                o.insert("resources".into(), serde_json::Value::Array(named));
            }
            Some(sum)
        }
    }
}

/// The reference's `DELETE /delegation/:id`: our revoke (with the final flush), answering an
/// unknown id with 400 as the reference does.
async fn cancel(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
) -> Result<Json<OkResponse>, ApiFailure> {
    d.revoke(&id, false).await.map_err(|mut r| {
        if r.status == 404 {
            r.status = 400;
        }
        r
    })?;
    Ok(Json(OkResponse::OK))
}

async fn revoke(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
    body: Option<Json<RevokeRequest>>,
) -> Result<Json<OkResponse>, ApiFailure> {
    let no_flush = body.map(|b| b.0.no_flush).unwrap_or(false);
    d.revoke(&id, no_flush).await?;
    Ok(Json(OkResponse::OK))
}

async fn renew(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
    body: Result<Json<RenewRequest>, JsonRejection>,
) -> Result<Json<RenewResponse>, ApiFailure> {
    let Json(req) = body.map_err(bad_json)?;
    let expires_at = d.renew(&id, Duration::from_secs(req.ttl_seconds))?;
    Ok(Json(RenewResponse {
        ok: true,
        expires_at,
    }))
}

/// `POST /delegation/:id/collect` body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CollectRequest {
    /// Drop the Executor's kept changes instead of applying them.
    #[serde(default)]
    pub discard: bool,
}

/// `POST /delegation/:id/collect` answer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CollectResponse {
    /// Changes applied.
    pub applied: u64,
    /// Changes kept beside instead (the Delegator's copy had changed).
    pub conflicts: Vec<awcp_protocol::dataplane::Conflict>,
    /// True when the kept changes were discarded.
    pub discarded: bool,
}

async fn collect(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
    body: Option<Json<CollectRequest>>,
) -> Result<Json<CollectResponse>, ApiFailure> {
    let discard = body.map(|b| b.0.discard).unwrap_or(false);
    Ok(Json(d.collect(&id, discard).await?))
}

async fn snapshots(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
) -> Result<Json<SnapshotList>, ApiFailure> {
    let live = d.get_live(&id).ok_or_else(|| {
        ApiFailure(
            StatusCode::NOT_FOUND,
            ApiError::new(format!("Unknown delegation: {id}")),
        )
    })?;
    d.refresh_staged(&live);
    let snapshots = live.d.lock().record.snapshots.clone().unwrap_or_default();
    Ok(Json(SnapshotList { snapshots }))
}

/// `POST /delegation/:id/snapshots/:sid/apply` answer: the reference's `{"ok":true}` plus
/// what the merge did (ours, additive).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApplyResponse {
    /// Always true.
    pub ok: bool,
    /// Files written, deleted, and conflicts.
    #[serde(flatten)]
    pub report: crate::archive::ApplyReport,
}

async fn apply_snapshot(
    State(d): State<Arc<Daemon>>,
    Path((id, sid)): Path<(String, String)>,
) -> Result<Json<ApplyResponse>, ApiFailure> {
    let report = d.apply_snapshot(&id, &sid).await?;
    Ok(Json(ApplyResponse { ok: true, report }))
}

/// `GET /delegation/:id/snapshots/:sid/diff` answer (ours).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiffResponse {
    /// Changed files, by path.
    pub files: Vec<crate::archive::FileChange>,
}

async fn diff_snapshot(
    State(d): State<Arc<Daemon>>,
    Path((id, sid)): Path<(String, String)>,
) -> Result<Json<DiffResponse>, ApiFailure> {
    let files = d.diff_snapshot(&id, &sid).await?;
    Ok(Json(DiffResponse { files }))
}

async fn continue_round(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
    body: Option<Json<serde_json::Value>>,
) -> Result<Json<ContinueResponse>, ApiFailure> {
    let body = body.map(|Json(v)| v);
    // Ours: a new lease for the round, as `ttlSeconds` or `lease.ttlSeconds`.
    let ttl = body.as_ref().and_then(|v| {
        v.get("ttlSeconds")
            .or_else(|| v.get("lease").and_then(|l| l.get("ttlSeconds")))
            .and_then(serde_json::Value::as_u64)
    });
    let task = body
        .and_then(|v| v.get("task").cloned())
        .and_then(|t| serde_json::from_value::<TaskSpec>(t).ok())
        .ok_or_else(|| {
            ApiFailure(
                StatusCode::BAD_REQUEST,
                ApiError::new("Missing required field: task"),
            )
        })?;
    let round = d
        .continue_round(&id, task, ttl.map(Duration::from_secs))
        .await?;
    Ok(Json(ContinueResponse {
        ok: true,
        round: Some(round),
    }))
}

async fn recover(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
) -> Result<Json<super::recover::RecoverResponse>, ApiFailure> {
    Ok(Json(d.recover(&id).await?))
}

async fn close(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
) -> Result<Json<OkResponse>, ApiFailure> {
    d.close(&id).await?;
    Ok(Json(OkResponse::OK))
}

async fn discard_snapshot(
    State(d): State<Arc<Daemon>>,
    Path((id, sid)): Path<(String, String)>,
) -> Result<Json<OkResponse>, ApiFailure> {
    d.discard_snapshot(&id, &sid)?;
    Ok(Json(OkResponse::OK))
}

async fn events(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiFailure> {
    let live = d.get_live(&id).ok_or_else(|| not_found(&d, &id))?;
    // Subscribe before copying the backlog so nothing falls between them.
    let rx = live.tx.subscribe();
    let backlog = live.d.lock().events.clone();
    let done = backlog.iter().any(WatchEvent::is_terminal);
    let live_events = BroadcastStream::new(rx)
        .filter_map(|r| std::future::ready(r.ok()))
        .take(if done { 0 } else { usize::MAX });
    let stream = futures::stream::iter(backlog)
        .chain(live_events)
        .scan(false, |ended, ev| {
            if *ended {
                return std::future::ready(None);
            }
            *ended = ev.is_terminal();
            std::future::ready(Some(ev))
        })
        .map(|ev| Ok(Event::default().json_data(&ev).unwrap_or_default()));
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
