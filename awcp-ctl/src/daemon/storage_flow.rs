//! The Delegator's half of the reference's `storage` transport, with the daemon's data
//! plane as the store: the workspace zip (built and admitted as for `archive`) is served at
//! an unguessable per-delegation URL, and the Executor PUTs its result zip beside it.
//!
//! URLs: `<export-url>/storage/<delegationId>/<secret>/workspace.zip` (GET) and
//! `…/result.zip` (PUT), the secret 128 random bits kept in
//! `<state>/archive/<id>/storage.secret` (0600). Both answer only while the delegation's
//! lease is active: a revoked, expired or finished delegation's URLs are dead (`410`).
//! The reference's Executor reports the upload with `snapshotBase64` =
//! `{"resultUrl": uploadUrl}`; the daemon then reads the result from its own disk (it never
//! fetches a URL an Executor names) and merges it like an `archive` snapshot.

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use awcp_lease::LeaseState;
use awcp_protocol::transport::{StorageHandle, StorageSnapshotInfo};

use super::flow::Refusal;
use super::{Daemon, Live};

const SECRET_FILE: &str = "storage.secret";
const WORKSPACE: &str = "workspace.zip";
const RESULT: &str = "result.zip";

impl Daemon {
    fn storage_dir(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join("archive").join(id)
    }

    fn storage_urls(&self, id: &str, secret: &str) -> (String, String) {
        let base = format!(
            "{}/storage/{id}/{secret}",
            self.export_url.trim_end_matches('/')
        );
        (format!("{base}/{WORKSPACE}"), format!("{base}/{RESULT}"))
    }

    /// Keep the zip for download and make the handle: URLs valid until `expires_at`.
    pub(crate) fn storage_handle(
        &self,
        id: &str,
        zip: &[u8],
        checksum: String,
        expires_at: String,
    ) -> Result<StorageHandle, Refusal> {
        let dir = self.storage_dir(id);
        let secret = hex::encode(rand::random::<[u8; 16]>());
        awcpfs::private::create_dir_all(&dir)
            .and_then(|_| awcpfs::private::write(&dir.join(WORKSPACE), zip))
            .and_then(|_| awcpfs::private::write(&dir.join(SECRET_FILE), secret.as_bytes()))
            .map_err(|e| Refusal::internal(format!("saving {}: {e}", dir.display())))?;
        let (download_url, upload_url) = self.storage_urls(id, &secret);
        Ok(StorageHandle {
            download_url,
            upload_url,
            checksum,
            expires_at,
            headers: None,
        })
    }

    /// The result zip a `storage` snapshot event points to: `snapshotBase64` is
    /// `{"resultUrl": …}` naming this delegation's own upload URL, read from disk.
    pub(crate) async fn storage_result(&self, id: &str, snapshot: &str) -> Result<Vec<u8>, String> {
        let info: StorageSnapshotInfo = serde_json::from_str(snapshot).map_err(|e| {
            format!("the snapshot is not the storage transport's {{\"resultUrl\": …}} ({e})")
        })?;
        let dir = self.storage_dir(id);
        let secret = std::fs::read_to_string(dir.join(SECRET_FILE))
            .map_err(|e| format!("this delegation has no storage URLs ({e})"))?;
        let (_, upload) = self.storage_urls(id, secret.trim());
        if info.result_url != upload {
            return Err(format!(
                "resultUrl {} is not this delegation's upload URL; not fetched",
                info.result_url
            ));
        }
        tokio::fs::read(dir.join(RESULT))
            .await
            .map_err(|e| format!("nothing was uploaded to the result URL ({e})"))
    }

    /// The delegation is over: the copies made for `storage` (the zips behind its URLs) and
    /// `git` (the local repository the base was committed in) go. Snapshots kept staged
    /// stay; so do the branches on the git remote (the record of what was exchanged).
    pub(crate) fn release_copies(&self, live: &Live) {
        let (id, transport) = {
            let d = live.d.lock();
            (d.record.id.as_str().to_string(), d.transport)
        };
        let dir = self.storage_dir(&id);
        let git = self.cfg.state_dir.join("git").join(&id);
        match transport {
            awcp_protocol::TransportType::Storage => {
                // The secret stays, so a late request is told `410 Gone`, not `404`.
                for f in [WORKSPACE, RESULT] {
                    let _ = std::fs::remove_file(dir.join(f));
                }
            }
            awcp_protocol::TransportType::Git => {
                let _ = std::fs::remove_dir_all(git);
            }
            _ => {}
        }
    }

    /// The live delegation whose storage URL this is, if the URL is right and its lease
    /// is active.
    fn storage_slot(&self, id: &str, secret: &str) -> Result<Arc<Live>, StatusCode> {
        let live = self.get_live(id).ok_or(StatusCode::NOT_FOUND)?;
        let known = std::fs::read_to_string(self.storage_dir(id).join(SECRET_FILE))
            .map_err(|_| StatusCode::NOT_FOUND)?;
        if !constant_time_eq(known.trim().as_bytes(), secret.as_bytes()) {
            return Err(StatusCode::NOT_FOUND);
        }
        let state = live.d.lock().record.state;
        if state.is_terminal() || live.lease.snapshot().state != LeaseState::Active {
            return Err(StatusCode::GONE);
        }
        Ok(live)
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn status(code: StatusCode, msg: &str) -> Response {
    (code, msg.to_string()).into_response()
}

async fn download(
    State(d): State<Arc<Daemon>>,
    Path((id, secret, file)): Path<(String, String, String)>,
) -> Response {
    if file != WORKSPACE {
        return status(StatusCode::NOT_FOUND, "no such file");
    }
    if let Err(code) = d.storage_slot(&id, &secret) {
        return status(code, "this storage URL is unknown or its lease is over");
    }
    match tokio::fs::File::open(d.storage_dir(&id).join(WORKSPACE)).await {
        Ok(f) => {
            let len = f.metadata().await.map(|m| m.len()).ok();
            let stream = tokio_util::io::ReaderStream::new(f);
            let mut resp = Response::new(Body::from_stream(stream));
            resp.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/zip"),
            );
            if let Some(len) = len {
                resp.headers_mut()
                    .insert(axum::http::header::CONTENT_LENGTH, len.into());
            }
            resp
        }
        Err(_) => status(StatusCode::NOT_FOUND, "the workspace zip is gone"),
    }
}

async fn upload(
    State(d): State<Arc<Daemon>>,
    Path((id, secret, file)): Path<(String, String, String)>,
    body: Body,
) -> Response {
    if file != RESULT {
        return status(StatusCode::NOT_FOUND, "no such file");
    }
    if let Err(code) = d.storage_slot(&id, &secret) {
        return status(code, "this storage URL is unknown or its lease is over");
    }
    let dir = d.storage_dir(&id);
    let tmp = dir.join(format!("{RESULT}.part"));
    let cap = d.cfg.snapshot_limits.max_total_bytes;
    let written = async {
        let mut f = tokio::fs::OpenOptions::from(awcpfs::private::file_options())
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .await
            .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        let mut n = 0u64;
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
            n += chunk.len() as u64;
            if n > cap {
                return Err((
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("the result exceeds {cap} bytes"),
                ));
            }
            f.write_all(&chunk)
                .await
                .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        }
        f.flush()
            .await
            .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        tokio::fs::rename(&tmp, dir.join(RESULT))
            .await
            .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
    }
    .await;
    match written {
        Ok(()) => StatusCode::OK.into_response(),
        Err((code, msg)) => {
            let _ = tokio::fs::remove_file(&tmp).await;
            status(code, &msg)
        }
    }
}

/// The `storage` URLs, served beside the `awcpfs` data plane.
pub(crate) fn router(d: Arc<Daemon>) -> Router {
    Router::new()
        .route("/storage/{id}/{secret}/{file}", get(download).put(upload))
        .layer(DefaultBodyLimit::disable())
        .with_state(d)
}
