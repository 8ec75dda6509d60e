//! The data-plane HTTP routes (`/v1/exports/{id}/…`).
//!
//! Every route sits behind one gate middleware, which in this order: finds the export (404
//! `NOT_FOUND`), checks `Authorization: Bearer <token>` in constant time (401
//! `AUTH_FAILED`), checks the lease (403 `EXPIRED`/`REVOKED`) and, for writes, the export's
//! mode (403 `READ_ONLY`). Only then is a request body read, so an unauthenticated client
//! cannot make the export buffer anything. The gate also opens the request's tracing span
//! and sets [`LEASE_EXPIRES_HEADER`] on every answer to an authenticated request.
//!
//! | gate | routes | lease check |
//! |---|---|---|
//! | read | `GET /manifest`, `POST /blocks`, `POST /locate`, `GET /events` | [`Lease::check_access`] |
//! | flush | `POST /missing` | [`Lease::check_flush`] |
//! | write | `POST /upload`, `POST /upload-urls`, `POST /adopt`, `POST /commit` | [`Lease::check_flush`], then not read-only |
//!
//! Bodies are read by [`read_body`]: bounded in size (413 `TOO_LARGE`, checked against
//! `Content-Length` first and again while reading) and in idle time (408), and JSON is
//! parsed by hand so a malformed body gets a 400 `BAD_REQUEST` with serde's line/column
//! message instead of axum's plain-text rejection. Blocking filesystem work runs on the
//! blocking pool; `/blocks` answers are streamed block by block, so memory stays bounded by
//! a few blocks whatever the request asks for.
//!
//! [`Lease::check_access`]: awcp_lease::Lease::check_access
//! [`Lease::check_flush`]: awcp_lease::Lease::check_flush

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures::{Stream, StreamExt, TryStreamExt};
use serde::de::DeserializeOwned;
use tracing::Instrument;

use awcp_lease::{LeaseSnapshot, LeaseState, rfc3339_millis};
use awcp_protocol::dataplane::{
    AppliedCommits, AppliedQuery, BlockRequest, ChangeSet, ExportEvent, LEASE_EXPIRES_HEADER,
    MAX_APPLIED_QUERY, MissingBlocks, MountEnded, UploadResult, block_frame_head,
    decode_block_frames,
};
use awcp_protocol::manifest_bin;

use super::error::ApiError;
use super::store::{BlockHash, hash_hex, parse_hash};
use super::{Export, ExportRegistry, MAX_BLOCK_SIZE, Stats, commit};

mod tier;

/// Largest JSON body of `/blocks` and `/missing` (a hash list).
const HASH_LIST_LIMIT: usize = 8 << 20;
/// Largest `/commit` body.
const COMMIT_LIMIT: usize = 64 << 20;
/// Largest `POST /commits/applied` body: 4,096 ids of at most 256 bytes, quoted (JSON
/// escapes may double a few).
const APPLIED_LIMIT: usize = 4 << 20;
/// Largest `/upload` body.
const UPLOAD_LIMIT: usize = 256 << 20;
/// Most hashes in one `/blocks`, `/missing` or `/upload` request.
const MAX_HASHES: usize = 65_536;
/// A body that sends nothing for this long is abandoned.
const BODY_IDLE: Duration = Duration::from_secs(60);
/// Blocks read concurrently while streaming a `/blocks` answer (a cold tree of small files
/// is read from disk: more reads in flight keep the disk busy).
const READ_AHEAD: usize = 8;

/// Which checks the gate applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    Read,
    Flush,
    Write,
}

/// The routes over `reg`.
pub(crate) fn router(reg: ExportRegistry) -> Router {
    let read = Router::new()
        .route("/v1/exports/{id}/manifest", get(manifest))
        .route("/v1/exports/{id}/blocks", post(blocks))
        .route("/v1/exports/{id}/locate", post(tier::locate))
        .route("/v1/exports/{id}/events", get(events))
        .route("/v1/exports/{id}/renew", post(renew))
        .route("/v1/exports/{id}/aecp/delivered", post(aecp_delivered))
        .route("/v1/exports/{id}/aecp/request", post(aecp_request))
        .route("/v1/exports/{id}/mounts/ended", post(mount_ended))
        .route(
            "/v1/exports/{id}/mounts/ended/query",
            post(mount_ended_query),
        )
        .route_layer(from_fn_with_state((reg.clone(), Gate::Read), gate));
    let flush = Router::new()
        .route("/v1/exports/{id}/missing", post(missing))
        .route("/v1/exports/{id}/commits/applied", post(applied))
        .route_layer(from_fn_with_state((reg.clone(), Gate::Flush), gate));
    let write = Router::new()
        .route("/v1/exports/{id}/upload", post(upload))
        .route("/v1/exports/{id}/commit", post(commit))
        .route("/v1/exports/{id}/upload-urls", post(tier::upload_urls))
        .route("/v1/exports/{id}/adopt", post(tier::adopt))
        .route_layer(from_fn_with_state((reg, Gate::Write), gate));
    read.merge(flush).merge(write)
}

/// The gate middleware (see the module docs).
async fn gate(
    State((reg, gate)): State<(ExportRegistry, Gate)>,
    Path(id): Path<String>,
    mut req: Request,
    next: Next,
) -> Response {
    let span = tracing::info_span!("dataplane", export = %id, method = %req.method(), path = %req.uri().path());
    async move {
        let Some(export) = reg.get(&id) else {
            return ApiError::NotFound { export_id: id }.into_response();
        };
        if !authorized(&export, req.headers()) {
            return ApiError::AuthFailed.into_response();
        }
        let mut resp = match admit(&export, gate) {
            Ok(()) => {
                req.extensions_mut().insert(export.clone());
                next.run(req).await
            }
            Err(e) => e.into_response(),
        };
        if let Ok(v) = HeaderValue::from_str(&export.lease().expires_at_rfc3339()) {
            resp.headers_mut().insert(LEASE_EXPIRES_HEADER, v);
        }
        resp
    }
    .instrument(span)
    .await
}

/// Bearer token check.
fn authorized(export: &Export, headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some((scheme, token)) = value.split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && export.token_matches(token.trim())
}

/// Lease and mode checks of a gate.
fn admit(export: &Export, gate: Gate) -> Result<(), ApiError> {
    match gate {
        Gate::Read => export.lease().check_access().map(drop)?,
        Gate::Flush => export.lease().check_flush()?,
        Gate::Write => {
            export.lease().check_flush()?;
            if export.read_only() {
                return Err(ApiError::ReadOnly {
                    export_id: export.id().to_owned(),
                });
            }
        }
    }
    Ok(())
}

/// Read a whole request body within `limit` bytes and [`BODY_IDLE`] between chunks.
async fn read_body(req: Request, limit: usize) -> Result<Vec<u8>, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::TooLarge { limit });
    }
    let mut stream = req.into_body().into_data_stream();
    let mut buf = Vec::with_capacity(declared.map_or(0, |n| n as usize));
    loop {
        let next = tokio::time::timeout(BODY_IDLE, stream.next())
            .await
            .map_err(|_| ApiError::BodyTimeout {
                secs: BODY_IDLE.as_secs(),
            })?;
        match next {
            None => return Ok(buf),
            Some(Err(source)) => return Err(ApiError::BodyRead { source }),
            Some(Ok(chunk)) => {
                if buf.len() + chunk.len() > limit {
                    return Err(ApiError::TooLarge { limit });
                }
                buf.extend_from_slice(&chunk);
            }
        }
    }
}

/// Parse a JSON body, with serde's precise message on failure.
fn parse_json<T: DeserializeOwned>(route: &'static str, body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_body(
            route,
            format!(
                "expected a JSON {}: {e}",
                std::any::type_name::<T>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("object")
            ),
        )
    })
}

/// Parse and bound a list of hashes.
fn parse_hashes(hashes: &[String]) -> Result<Vec<BlockHash>, ApiError> {
    if hashes.len() > MAX_HASHES {
        return Err(ApiError::TooMany {
            what: "block hashes in one request",
            count: hashes.len(),
            max: MAX_HASHES,
        });
    }
    hashes
        .iter()
        .map(|h| parse_hash(h).ok_or_else(|| ApiError::bad_hash(h)))
        .collect()
}

/// Run blocking work on the blocking pool.
async fn blocking<T: Send + 'static>(
    context: &'static str,
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal {
            context,
            source: std::io::Error::other(e),
        })?
}

async fn manifest(Extension(export): Extension<Arc<Export>>, headers: HeaderMap) -> Response {
    Stats::add(&export.stats.manifest_fetches, 1);
    let etag = HeaderValue::from_str(&format!("\"{}\"", export.manifest_digest))
        .unwrap_or(HeaderValue::from_static("\"\""));
    let binary = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains(manifest_bin::MEDIA_TYPE));
    let (media, body) = if binary {
        (manifest_bin::MEDIA_TYPE, export.manifest_zst.clone())
    } else {
        // Serialising 100,000 entries takes a while: not on the async workers.
        let e = export.clone();
        let json = tokio::task::spawn_blocking(move || e.manifest_json())
            .await
            .unwrap_or_default();
        ("application/json", json)
    };
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(media)),
            (header::ETAG, etag),
        ],
        body,
    )
        .into_response()
}

/// `POST /renew`: the Executor extends its lease by the lease's own TTL (capped by the
/// Delegator's maximum per renewal and lifetime); answers the lease event JSON. Only an
/// active lease can be renewed (the gate refuses others).
async fn renew(Extension(export): Extension<Arc<Export>>) -> Response {
    let ttl = export.lease().terms().ttl;
    match export.lease().renew(ttl) {
        Ok(snap) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            lease_event_json(&snap),
        )
            .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

async fn blocks(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Response, ApiError> {
    let body = read_body(req, HASH_LIST_LIMIT).await?;
    let request: BlockRequest = parse_json("POST /blocks", &body)?;
    let hashes = parse_hashes(&request.hashes)?;
    if let Some(tier) = export.tier() {
        // A block the store should hold, asked of the export: the mount could not get it
        // there. Check that the store still has it (in the background).
        for h in &hashes {
            tier.suspect(h);
        }
    }
    let frames = futures::stream::iter(hashes)
        .map(move |hash| {
            let export = export.clone();
            async move {
                let reader = export.clone();
                let data = tokio::task::spawn_blocking(move || reader.read_block(&hash))
                    .await
                    .ok()
                    .flatten();
                // A revoke (or expiry) during a long answer: not one more byte after it.
                // Cutting the stream short makes the client's decode fail, as it should.
                if export.lease().check_access().is_err() {
                    return Err(std::io::Error::other("the lease ended during the answer"));
                }
                // The frame's head, then the block as read: its bytes are not copied again.
                let head = block_frame_head(&hash, data.as_ref().map(Vec::len));
                let head = Bytes::copy_from_slice(&head);
                let parts: Vec<std::io::Result<Bytes>> = match data {
                    Some(d) => {
                        Stats::add(&export.stats.blocks_served, 1);
                        Stats::add(&export.stats.bytes_served, d.len() as u64);
                        vec![Ok(head), Ok(Bytes::from(d))]
                    }
                    None => vec![Ok(head)],
                };
                Ok::<_, std::io::Error>(futures::stream::iter(parts))
            }
        })
        .buffered(READ_AHEAD)
        .try_flatten();
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(frames),
    )
        .into_response())
}

async fn missing(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Json<MissingBlocks>, ApiError> {
    let body = read_body(req, HASH_LIST_LIMIT).await?;
    let request: BlockRequest = parse_json("POST /missing", &body)?;
    let mut hashes = parse_hashes(&request.hashes)?;
    let mut seen = std::collections::HashSet::new();
    hashes.retain(|h| seen.insert(*h));
    let missing = blocking("checking blocks", move || {
        Ok(hashes
            .iter()
            .filter(|h| !export.blocks.has_block(h))
            .map(hash_hex)
            .collect())
    })
    .await?;
    Ok(Json(MissingBlocks { missing }))
}

/// Which of the asked commits the export applied, with their first outcomes (crash
/// recovery of a mount that could not record them).
async fn applied(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Json<AppliedCommits>, ApiError> {
    const WHAT: &str = "POST /commits/applied";
    let body = read_body(req, APPLIED_LIMIT).await?;
    let query: AppliedQuery = parse_json(WHAT, &body)?;
    if query.ids.len() > MAX_APPLIED_QUERY {
        return Err(ApiError::TooMany {
            what: "commit ids in one question",
            count: query.ids.len(),
            max: MAX_APPLIED_QUERY,
        });
    }
    if let Some(bad) = query
        .ids
        .iter()
        .find(|id| id.is_empty() || id.len() > super::commit::MAX_COMMIT_ID)
    {
        return Err(ApiError::bad_body(
            WHAT,
            format!(
                "a commit id must be 1 to {} bytes (got {})",
                super::commit::MAX_COMMIT_ID,
                bad.len()
            ),
        ));
    }
    let log = export.commits.lock().await;
    let applied = query.ids.iter().filter_map(|id| log.find(id)).collect();
    Ok(Json(AppliedCommits { applied }))
}

async fn upload(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Json<UploadResult>, ApiError> {
    let body = read_body(req, UPLOAD_LIMIT).await?;
    let stored = blocking("storing uploaded blocks", move || {
        let frames = decode_block_frames(&body).map_err(|e| {
            ApiError::bad_body("POST /upload", format!("expected block frames: {e}"))
        })?;
        if frames.len() > MAX_HASHES {
            return Err(ApiError::TooMany {
                what: "blocks in one upload",
                count: frames.len(),
                max: MAX_HASHES,
            });
        }
        let mut verified = Vec::with_capacity(frames.len());
        for (hash, data) in &frames {
            let Some(data) = data else {
                return Err(ApiError::bad_body(
                    "POST /upload",
                    format!(
                        "frame for {} is marked missing; upload only blocks you have",
                        hash_hex(hash)
                    ),
                ));
            };
            if data.len() > MAX_BLOCK_SIZE as usize {
                return Err(ApiError::bad_body(
                    "POST /upload",
                    format!(
                        "block {} is {} bytes; the limit is {MAX_BLOCK_SIZE}",
                        hash_hex(hash),
                        data.len()
                    ),
                ));
            }
            let actual = blake3::hash(data);
            if actual.as_bytes() != hash {
                return Err(ApiError::ChecksumMismatch {
                    what: "an uploaded block".to_owned(),
                    expected: hash_hex(hash),
                    actual: actual.to_hex().to_string(),
                });
            }
            verified.push((hash, *data));
        }
        for (hash, data) in &verified {
            export
                .blocks
                .staging
                .store(hash, data)
                .map_err(|source| ApiError::Internal {
                    context: "storing an uploaded block",
                    source,
                })?;
        }
        Ok(verified.len() as u64)
    })
    .await?;
    Ok(Json(UploadResult { stored }))
}

async fn commit(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Json<awcp_protocol::dataplane::CommitResult>, ApiError> {
    let arrived = std::time::Instant::now();
    let body = read_body(req, COMMIT_LIMIT).await?;
    let changes: ChangeSet = parse_json("POST /commit", &body)?;
    // The commit runs in its own task, which holds the per-export commit lock until the
    // result is remembered: a client that disconnects mid-commit cannot release the lock
    // early, and its retry is answered from the log.
    let task = tokio::spawn(async move {
        let log = export.commits.clone().lock_owned().await;
        if let Some(done) = log.find(&changes.commit_id) {
            tracing::info!(export = %export.id, commit = %changes.commit_id,
                "commit retry answered with its first outcome");
            return Ok::<_, ApiError>(done);
        }
        let worker = export.clone();
        // Applied and remembered (durably) before the answer, on the blocking pool.
        blocking("applying a commit", move || {
            let mut log = log;
            let result = commit::run(&worker, &changes)?;
            log.remember(result.clone());
            if worker.stage().is_none() {
                worker.aecp().committed(&written_files(&changes, &result));
                worker.note_applied(changes.age_ms, arrived);
            }
            Ok(result)
        })
        .await
    });
    let result = task.await.map_err(|e| ApiError::Internal {
        context: "applying a commit",
        source: std::io::Error::other(e),
    })??;
    Ok(Json(result))
}

/// The files a live commit wrote: its writes, less the paths answered as conflicts (AECP:
/// a worker owns what it wrote back).
fn written_files(cs: &ChangeSet, result: &awcp_protocol::dataplane::CommitResult) -> Vec<String> {
    let conflicts: std::collections::HashSet<&str> =
        result.conflicts.iter().map(|k| k.path.as_str()).collect();
    cs.changes
        .iter()
        .filter(|c| matches!(c, awcp_protocol::dataplane::Change::Write { .. }))
        .map(|c| c.path())
        .filter(|p| !conflicts.contains(p))
        .map(str::to_owned)
        .collect()
}

async fn events(
    Extension(export): Extension<Arc<Export>>,
    RawQuery(query): RawQuery,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let since = since_of(query.as_deref())?;
    Ok(Sse::new(export_events(export, since)).keep_alive(KeepAlive::default()))
}

/// The `since` of `GET /events?since=<seq>`: the change sequence a mount already has
/// (catch-up sends only what changed after it); 0 when absent. Other parameters are
/// ignored.
fn since_of(query: Option<&str>) -> Result<u64, ApiError> {
    let Some(query) = query else { return Ok(0) };
    for pair in query.split('&') {
        if let Some(v) = pair.strip_prefix("since=") {
            return v.parse().map_err(|_| {
                ApiError::bad_body(
                    "GET /events",
                    format!(
                        "since must be a change sequence number (an unsigned integer), not {:?}",
                        v.chars().take(40).collect::<String>()
                    ),
                )
            });
        }
    }
    Ok(0)
}

/// State of one `GET /events` stream.
struct EventStream {
    export: Arc<Export>,
    lease: tokio::sync::watch::Receiver<LeaseSnapshot>,
    changes: tokio::sync::watch::Receiver<u64>,
    /// AECP index events (see `export/aecp.rs`) and how far this stream sent them.
    aecp: tokio::sync::watch::Receiver<u64>,
    aecp_sent: super::aecp::Cursor,
    /// Events ready to send, as JSON.
    queue: std::collections::VecDeque<String>,
    /// The change feed's sequence number this stream has sent up to.
    sent: u64,
    started: bool,
    /// The lease ended: send what is queued, then end.
    done: bool,
}

impl EventStream {
    fn queue_lease(&mut self) {
        let snap = self.export.lease().snapshot();
        self.queue.push_back(lease_event_json(&snap));
        if snap.state != LeaseState::Active {
            self.done = true;
        }
    }

    fn queue_changes(&mut self) {
        self.changes.mark_unchanged();
        let (events, seq) = self.export.feed.since(self.sent);
        self.sent = seq;
        for e in events {
            match serde_json::to_string(&e) {
                Ok(json) => self.queue.push_back(json),
                Err(e) => tracing::warn!(error = %e, "cannot encode a change event"),
            }
        }
    }

    fn queue_aecp(&mut self) {
        self.aecp.mark_unchanged();
        let (events, cursor) = self.export.aecp().since(self.aecp_sent);
        self.aecp_sent = cursor;
        for event in events {
            if let Ok(json) = serde_json::to_string(&ExportEvent::Aecp { event }) {
                self.queue.push_back(json);
            }
        }
    }
}

/// The body of `POST /mounts/ended` and `/mounts/ended/query`, checked.
async fn mount_instance(what: &'static str, req: Request) -> Result<MountEnded, ApiError> {
    let body = read_body(req, 4096).await?;
    let m: MountEnded = parse_json(what, &body)?;
    if !awcp_protocol::dataplane::valid_mount_instance(&m.instance) {
        return Err(ApiError::bad_body(
            what,
            format!(
                "instance must be 1 to {} lowercase hex digits",
                awcp_protocol::dataplane::MAX_MOUNT_INSTANCE
            ),
        ));
    }
    Ok(m)
}

/// `POST /mounts/ended`: a mount ended with every change it made applied as sent (see
/// `watch::ChangeFeed::note_clean_end`). A staged export's commits never reach the tree
/// its later mounts start from: nothing is recorded there (`ended: false`).
async fn mount_ended(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Json<MountEnded>, ApiError> {
    let mut m = mount_instance("POST /mounts/ended", req).await?;
    m.ended = export.stage().is_none();
    if m.ended {
        export.feed.note_clean_end(&m.instance);
    }
    Ok(Json(m))
}

/// `POST /mounts/ended/query`: whether a mount instance ended cleanly here.
async fn mount_ended_query(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Json<MountEnded>, ApiError> {
    let mut m = mount_instance("POST /mounts/ended/query", req).await?;
    m.ended = export.feed.ended_clean(&m.instance);
    Ok(Json(m))
}

/// `POST /aecp/delivered`: a mount reports the AECP deliveries it made (a JSON array);
/// handed to the daemon's sink. 404 when AECP is off for this export.
async fn aecp_delivered(Extension(export): Extension<Arc<Export>>, req: Request) -> Response {
    let body = match read_body(req, 1 << 20).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let report: serde_json::Value = match parse_json("aecp/delivered", &body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    if export.aecp().delivered(report) {
        axum::http::StatusCode::NO_CONTENT.into_response()
    } else {
        axum::http::StatusCode::NOT_FOUND.into_response()
    }
}

/// `POST /aecp/request`: the worker's agent asks the daemon through its mount (publish,
/// flag, acknowledge, …); the daemon's handler answers as this export's worker. The answer
/// is `{"status": N, "body": …}` (200 whatever the daemon said: the status is the daemon's
/// word, not the data plane's). 404 when AECP is off for this export.
async fn aecp_request(Extension(export): Extension<Arc<Export>>, req: Request) -> Response {
    let body = match read_body(req, 4 << 20).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let request: serde_json::Value = match parse_json("aecp/request", &body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    match export.aecp().request(request) {
        Some(answer) => {
            let (status, body) = answer.await;
            Json(serde_json::json!({ "status": status, "body": body })).into_response()
        }
        None => axum::http::StatusCode::NOT_FOUND.into_response(),
    }
}

/// One `lease` event now, then every change recorded after sequence `since` (`changed`
/// events; 0: since registration); afterwards a `lease` event on every change of the lease and at its deadline and
/// `changed` events as changes are seen. Ends after the first `lease` event whose state is
/// not `Active`.
fn export_events(export: Arc<Export>, since: u64) -> impl Stream<Item = Result<Event, Infallible>> {
    let s = EventStream {
        lease: export.lease().subscribe(),
        changes: export.feed.subscribe(),
        aecp: export.aecp().subscribe(),
        aecp_sent: super::aecp::Cursor::default(),
        export,
        queue: std::collections::VecDeque::new(),
        sent: since,
        started: false,
        done: false,
    };
    futures::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(json) = s.queue.pop_front() {
                return Some((Ok(Event::default().data(json)), s));
            }
            if s.done {
                return None;
            }
            if !s.started {
                s.started = true;
                s.queue_lease();
                if !s.done {
                    s.queue_changes();
                    s.queue_aecp();
                    if let Ok(json) = serde_json::to_string(&ExportEvent::AecpReady) {
                        s.queue.push_back(json);
                    }
                }
                continue;
            }
            let export = s.export.clone();
            tokio::select! {
                () = wait_for_lease_change(&export, &mut s.lease) => s.queue_lease(),
                changed = s.changes.changed() => {
                    if changed.is_ok() {
                        s.queue_changes();
                    }
                }
                changed = s.aecp.changed() => {
                    if s.export.aecp().streams_closed() {
                        s.done = true;
                    } else if changed.is_ok() {
                        s.queue_aecp();
                    }
                }
            }
        }
    })
}

/// Wait until the lease was renewed or revoked, or its deadline passed (expiry is lazy, so
/// the deadline needs a timer of its own).
async fn wait_for_lease_change(
    export: &Export,
    rx: &mut tokio::sync::watch::Receiver<LeaseSnapshot>,
) {
    loop {
        let snap = export.lease().snapshot();
        if snap.state != LeaseState::Active {
            return;
        }
        tokio::select! {
            changed = rx.changed() => {
                rx.mark_unchanged();
                // Err: the lease is gone (cannot happen while the export holds it); report.
                let _ = changed;
                return;
            }
            () = tokio::time::sleep(snap.remaining) => {
                // Loop: either the expiry is now observed, or the timer fired a hair early.
            }
        }
    }
}

fn lease_event_json(snap: &LeaseSnapshot) -> String {
    let event = ExportEvent::Lease {
        state: snap.state,
        expires_at: rfc3339_millis(snap.expires_at),
        remaining_ms: u64::try_from(snap.remaining.as_millis()).unwrap_or(u64::MAX),
        flush_grace_ms: u64::try_from(snap.flush_grace_remaining.as_millis()).unwrap_or(u64::MAX),
    };
    // Serialising a plain enum of strings and integers cannot fail; fall back to a fixed
    // event rather than panic.
    serde_json::to_string(&event).unwrap_or_else(|_| String::from(r#"{"type":"lease"}"#))
}
