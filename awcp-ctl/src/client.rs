//! A typed client of the daemon API, used by the CLI and the tests.

mod aecp;

use std::time::Duration;

use awcp_protocol::api::{
    ApiError, DelegateRequest, DelegateResponse, DelegationList, OkResponse, SnapshotList,
};

use crate::daemon::api::{DelegationView, RenewRequest, RenewResponse, RevokeRequest};
use crate::sse::SseReader;
use crate::watch::WatchEvent;

mod contracts;
mod worker;

/// Why a daemon call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon could not be reached.
    #[error(
        "cannot reach the daemon at {url} (is `awcp-ctl serve` running? set --daemon or AWCP_DAEMON_URL)"
    )]
    Unreachable {
        /// Where.
        url: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// The daemon refused.
    #[error("{}{}", .body.error, .body.hint.as_ref().map(|h| format!(" (hint: {h})")).unwrap_or_default())]
    Refused {
        /// HTTP status.
        status: u16,
        /// The daemon's error body.
        body: ApiError,
    },
    /// The answer did not parse.
    #[error("unexpected answer from the daemon")]
    Protocol {
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// The worker channel (`$AECP_SOCKET`) failed.
    #[error("asking through the worker's AECP socket {socket}: {message}")]
    WorkerSocket {
        /// The socket.
        socket: String,
        /// What went wrong.
        message: String,
    },
    /// The event stream broke.
    #[error("the event stream broke")]
    Stream {
        /// Why.
        #[source]
        source: crate::sse::SseError,
    },
}

/// The client.
///
/// It may be given several daemons (`http://a:3100,http://b:3100`: daemons sharing one
/// PostgreSQL database, which all show every delegation): it talks to one, and when that
/// one cannot be connected to, it moves to the next that can, and stays there. Only a
/// request that never reached a daemon is sent again (a connection refused or timed out),
/// so nothing is done twice.
#[derive(Debug, Clone)]
pub struct DaemonClient {
    bases: Vec<String>,
    /// The index in `bases` of the daemon in use.
    current: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    http: reqwest::Client,
    token: Option<String>,
    /// The worker channel (`$AECP_SOCKET`): requests go through the worker's mount.
    worker_socket: Option<std::path::PathBuf>,
}

impl DaemonClient {
    /// A client of the daemon at `base` (e.g. `http://127.0.0.1:3100`), or of the first
    /// of a comma-separated list that answers.
    pub fn new(base: &str) -> Self {
        let mut bases: Vec<String> = base
            .split(',')
            .map(|b| b.trim().trim_end_matches('/').to_string())
            .filter(|b| !b.is_empty())
            .collect();
        if bases.is_empty() {
            bases.push(base.to_string());
        }
        DaemonClient {
            bases,
            current: Default::default(),
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .build()
                .expect("building an HTTP client"),
            token: None,
            worker_socket: None,
        }
    }

    /// Ask as a worker, through its mount's AECP socket (`$AECP_SOCKET` inside a task):
    /// the mount forwards each request with its own credential, and the daemon acts as
    /// that worker only. No URL or token is needed; only the AECP routes answer.
    pub fn with_worker_socket(mut self, path: &std::path::Path) -> Self {
        self.worker_socket = Some(path.to_path_buf());
        self
    }

    /// Talk to the daemon over its Unix socket at `path` (`<state-dir>/api.sock`), where
    /// the kernel names our uid: the daemon's own user needs no token there. The base URL
    /// then only gives the `Host` header.
    pub fn with_unix_socket(mut self, path: &std::path::Path) -> Self {
        self.http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .unix_socket(path)
            .build()
            .expect("building an HTTP client");
        self
    }

    /// Send `token` as a bearer token (a daemon started with an API token needs it).
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    fn get_(&self, path: &str) -> reqwest::RequestBuilder {
        self.auth(self.http.get(format!("{}{path}", self.base())))
    }

    fn post_(&self, path: &str) -> reqwest::RequestBuilder {
        self.auth(self.http.post(format!("{}{path}", self.base())))
    }

    /// Send `rq` to the daemon in use; if it cannot be connected to, to the next of the
    /// list that can (which is then the one in use).
    async fn execute(&self, rq: reqwest::RequestBuilder) -> Result<reqwest::Response, ClientError> {
        let first = self.current.load(std::sync::atomic::Ordering::Relaxed) % self.bases.len();
        let req = rq.build().map_err(|source| ClientError::Unreachable {
            url: self.bases[first].clone(),
            source,
        })?;
        let url = req.url().to_string();
        let rest = url
            .strip_prefix(self.bases[first].as_str())
            .unwrap_or("")
            .to_string();
        let mut failure = None;
        for k in 0..self.bases.len() {
            let i = (first + k) % self.bases.len();
            let mut attempt = match req.try_clone() {
                Some(r) => r,
                None => break,
            };
            if i != first {
                let Ok(u) = format!("{}{rest}", self.bases[i]).parse() else {
                    continue;
                };
                *attempt.url_mut() = u;
            }
            match self.http.execute(attempt).await {
                Ok(resp) => {
                    if i != first {
                        tracing::warn!(from = %self.bases[first], to = %self.bases[i],
                            "the daemon could not be reached; using the next one");
                        self.current.store(i, std::sync::atomic::Ordering::Relaxed);
                    }
                    return Ok(resp);
                }
                // Only a request that never reached a daemon goes to the next one.
                Err(e) if self.bases.len() > 1 && e.is_connect() => {
                    failure = Some((i, e));
                }
                Err(source) => {
                    return Err(ClientError::Unreachable {
                        url: self.bases[i].clone(),
                        source,
                    });
                }
            }
        }
        match failure {
            Some((i, source)) => Err(ClientError::Unreachable {
                url: if self.bases.len() > 1 {
                    self.bases.join(",")
                } else {
                    self.bases[i].clone()
                },
                source,
            }),
            // A body that cannot be sent twice: once, as built.
            None => self
                .http
                .execute(req)
                .await
                .map_err(|source| ClientError::Unreachable {
                    url: self.bases[first].clone(),
                    source,
                }),
        }
    }

    fn auth(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    async fn send<T: serde::de::DeserializeOwned>(
        &self,
        rq: reqwest::RequestBuilder,
    ) -> Result<T, ClientError> {
        if let Some(socket) = &self.worker_socket {
            return worker::send(socket, rq).await;
        }
        let resp = self.execute(rq).await?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp
                .json::<ApiError>()
                .await
                .unwrap_or_else(|_| ApiError::new(format!("HTTP {status}")));
            return Err(ClientError::Refused {
                status: status.as_u16(),
                body,
            });
        }
        resp.json()
            .await
            .map_err(|source| ClientError::Protocol { source })
    }

    /// The daemon's base URL, as given.
    pub fn base(&self) -> &str {
        &self.bases[self.current.load(std::sync::atomic::Ordering::Relaxed) % self.bases.len()]
    }

    /// Ours: `POST /ui/login-link`: a one-time link that opens the live view in a browser.
    /// The returned URL is on this client's daemon address, without any token it carries.
    pub async fn ui_login_link(&self) -> Result<(String, u64), ClientError> {
        let link: crate::daemon::ui::LoginLink = self.send(self.post_("/ui/login-link")).await?;
        let origin = match reqwest::Url::parse(self.base()) {
            Ok(u) => u.origin().ascii_serialization(),
            Err(_) => self.base().to_string(),
        };
        Ok((format!("{origin}{}", link.path), link.expires_in_seconds))
    }

    /// Ours: `POST /api-tokens`: a client token every daemon of the database accepts.
    pub async fn create_token(
        &self,
        label: &str,
    ) -> Result<crate::daemon::tokens::CreateTokenResponse, ClientError> {
        self.send(
            self.post_("/api-tokens")
                .json(&crate::daemon::tokens::CreateTokenRequest {
                    label: label.to_string(),
                }),
        )
        .await
    }

    /// Ours: `GET /api-tokens`.
    pub async fn tokens(&self) -> Result<crate::daemon::tokens::TokenList, ClientError> {
        self.send(self.get_("/api-tokens")).await
    }

    /// Ours: `DELETE /api-tokens/:id`.
    pub async fn delete_token(&self, id: &str) -> Result<OkResponse, ClientError> {
        self.send(self.auth(self.http.delete(format!("{}/api-tokens/{id}", self.base()))))
            .await
    }

    /// `POST /delegate`.
    pub async fn delegate(&self, req: &DelegateRequest) -> Result<DelegateResponse, ClientError> {
        self.send(self.post_("/delegate").json(req)).await
    }

    /// `POST /delegate`, naming the setup `key` so that [`setup_progress`](Self::setup_progress)
    /// can follow it meanwhile.
    pub async fn delegate_with_progress(
        &self,
        req: &DelegateRequest,
        key: &str,
    ) -> Result<DelegateResponse, ClientError> {
        let rb = self
            .post_("/delegate")
            .header(crate::daemon::progress::PROGRESS_HEADER, key)
            .json(req);
        self.send(rb).await
    }

    /// Ours: `GET /delegate/progress/:key`: how far the delegation being set up under
    /// `key` has got.
    pub async fn setup_progress(
        &self,
        key: &str,
    ) -> Result<crate::daemon::progress::ProgressView, ClientError> {
        self.send(self.get_(&format!("/delegate/progress/{key}")))
            .await
    }

    /// `GET /delegations`.
    pub async fn list(&self) -> Result<DelegationList, ClientError> {
        self.send(self.get_("/delegations")).await
    }

    /// `GET /delegation/:id`.
    pub async fn get(&self, id: &str) -> Result<DelegationView, ClientError> {
        self.send(self.get_(&format!("/delegation/{id}"))).await
    }

    /// `POST /delegation/:id/revoke`.
    pub async fn revoke(&self, id: &str, no_flush: bool) -> Result<OkResponse, ClientError> {
        self.send(
            self.post_(&format!("/delegation/{id}/revoke"))
                .json(&RevokeRequest { no_flush }),
        )
        .await
    }

    /// `POST /delegation/:id/collect`.
    pub async fn collect(
        &self,
        id: &str,
        discard: bool,
    ) -> Result<crate::daemon::api::CollectResponse, ClientError> {
        self.send(
            self.post_(&format!("/delegation/{id}/collect"))
                .json(&crate::daemon::api::CollectRequest { discard }),
        )
        .await
    }

    /// `POST /delegation/:id/renew`.
    pub async fn renew(&self, id: &str, ttl_seconds: u64) -> Result<RenewResponse, ClientError> {
        self.send(
            self.post_(&format!("/delegation/{id}/renew"))
                .json(&RenewRequest { ttl_seconds }),
        )
        .await
    }

    /// `POST /delegation/:id/continue`; with `ttl_seconds` (ours), the lease is renewed
    /// for the round.
    pub async fn continue_round(
        &self,
        id: &str,
        task: &awcp_protocol::messages::TaskSpec,
        ttl_seconds: Option<u64>,
    ) -> Result<awcp_protocol::api::ContinueResponse, ClientError> {
        let mut body = serde_json::json!({ "task": task });
        if let Some(t) = ttl_seconds {
            body["ttlSeconds"] = t.into();
        }
        self.send(
            self.post_(&format!("/delegation/{id}/continue"))
                .json(&body),
        )
        .await
    }

    /// Ours: `POST /delegation/:id/recover`.
    pub async fn recover(
        &self,
        id: &str,
    ) -> Result<crate::daemon::recover::RecoverResponse, ClientError> {
        self.send(self.post_(&format!("/delegation/{id}/recover")))
            .await
    }

    /// `POST /delegation/:id/close`.
    pub async fn close(&self, id: &str) -> Result<OkResponse, ClientError> {
        self.send(self.post_(&format!("/delegation/{id}/close")))
            .await
    }

    /// `GET /delegation/:id/snapshots`.
    pub async fn snapshots(&self, id: &str) -> Result<SnapshotList, ClientError> {
        self.send(self.get_(&format!("/delegation/{id}/snapshots")))
            .await
    }

    /// Ours: `GET /delegation/:id/snapshots/:sid/diff`.
    pub async fn diff(
        &self,
        id: &str,
        sid: &str,
    ) -> Result<crate::daemon::api::DiffResponse, ClientError> {
        self.send(self.get_(&format!("/delegation/{id}/snapshots/{sid}/diff")))
            .await
    }

    /// `POST /delegation/:id/snapshots/:sid/apply`.
    pub async fn apply(
        &self,
        id: &str,
        sid: &str,
    ) -> Result<crate::daemon::api::ApplyResponse, ClientError> {
        self.send(self.post_(&format!("/delegation/{id}/snapshots/{sid}/apply")))
            .await
    }

    /// `POST /delegation/:id/snapshots/:sid/discard`.
    pub async fn discard(&self, id: &str, sid: &str) -> Result<OkResponse, ClientError> {
        self.send(self.post_(&format!("/delegation/{id}/snapshots/{sid}/discard")))
            .await
    }

    /// The snapshot `sid`, or the newest pending one of `id`.
    pub async fn pick_snapshot(
        &self,
        id: &str,
        sid: Option<String>,
    ) -> Result<String, ClientError> {
        if let Some(s) = sid {
            return Ok(s);
        }
        let list = self.snapshots(id).await?;
        list.snapshots
            .iter()
            .rev()
            .find(|s| s.status == awcp_protocol::api::SnapshotStatus::Pending)
            .map(|s| s.id.clone())
            .ok_or_else(|| ClientError::Refused {
                status: 404,
                body: ApiError {
                    error: format!("delegation {id} has no pending snapshot"),
                    code: None,
                    hint: Some(
                        "Only delegations with --snapshot-mode staged keep snapshots; \
                         `awcp-ctl snapshots <id>` lists them"
                            .into(),
                    ),
                    known_delegations: None,
                },
            })
    }

    /// Follow `GET /delegation/:id/events`, calling `f` for each event until a terminal one
    /// (returned) or the end of the stream (`None`).
    pub async fn watch(
        &self,
        id: &str,
        f: impl FnMut(&WatchEvent),
    ) -> Result<Option<WatchEvent>, ClientError> {
        self.watch_until(id, f, |ev| ev.is_terminal()).await
    }

    /// Like [`watch`](Self::watch), stopping at the first event `stop` accepts (returned).
    pub async fn watch_until(
        &self,
        id: &str,
        mut f: impl FnMut(&WatchEvent),
        mut stop: impl FnMut(&WatchEvent) -> bool,
    ) -> Result<Option<WatchEvent>, ClientError> {
        let resp = self
            .execute(self.get_(&format!("/delegation/{id}/events")))
            .await?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp
                .json::<ApiError>()
                .await
                .unwrap_or_else(|_| ApiError::new(format!("HTTP {status}")));
            return Err(ClientError::Refused {
                status: status.as_u16(),
                body,
            });
        }
        let mut reader = SseReader::new(resp);
        while let Some(ev) = reader
            .next()
            .await
            .map_err(|source| ClientError::Stream { source })?
        {
            let Ok(ev) = serde_json::from_str::<WatchEvent>(&ev.data) else {
                continue;
            };
            f(&ev);
            if stop(&ev) {
                return Ok(Some(ev));
            }
        }
        Ok(None)
    }
}
