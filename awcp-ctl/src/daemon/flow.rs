//! The delegation flow: INVITE → ACCEPT → (open SSE) → START, then following the Executor.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::broadcast;

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcp_protocol::api::{
    DelegateRequest, DelegationRecord, ErrorInfo, SnapshotMode, SnapshotPolicy,
};
use awcp_protocol::dataplane::LeaseState;
use awcp_protocol::messages::{
    AccessMode, ActiveLease, EnvironmentDeclaration, InviteMessage, LeaseConfig, ProtocolVersion,
    Requirements, ResourceDeclaration, SandboxProfile, StartMessage,
};
use awcp_protocol::transport::{ArchiveHandle, AwcpfsHandle};
use awcp_protocol::{
    AwcpMessage, DelegationEvent, DelegationId, DelegationState, ErrorCode, TaskEvent,
    TransportHandle, TransportType,
};
use awcpfs::export::ExportConfig;

use super::{Daemon, Live};
use crate::sse::SseReader;
use crate::store::StoredDelegation;
use crate::watch::WatchEvent;

/// Default lease, as the reference.
const DEFAULT_TTL: u64 = 3600;
/// Default retention, as the reference (7 days).
const DEFAULT_RETENTION_MS: u64 = 7 * 24 * 3600 * 1000;

/// A refused delegation: HTTP status, and the reference's error body fields.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) status: u16,
    pub(crate) message: String,
    pub(crate) code: Option<ErrorCode>,
    pub(crate) hint: Option<String>,
}

impl Refusal {
    pub(crate) fn bad(code: ErrorCode, message: String, hint: &str) -> Self {
        Refusal {
            status: 400,
            message,
            code: Some(code),
            hint: Some(hint.into()),
        }
    }
    pub(crate) fn internal(message: String) -> Self {
        Refusal {
            status: 500,
            message,
            code: None,
            hint: None,
        }
    }
}

/// What START will carry.
pub(crate) enum Handle {
    /// Live exports, one per resource.
    Awcpfs(Vec<awcp_protocol::transport::AwcpfsResource>),
    /// The zipped workspace.
    Archive(ArchiveHandle),
    /// The zipped workspace behind the data plane's storage URLs.
    Storage(awcp_protocol::transport::StorageHandle),
    /// The workspace pushed to a git remote.
    Git(awcp_protocol::transport::GitHandle),
    /// The workspace behind the delegation's own sshd.
    Sshfs(awcp_protocol::transport::SshfsHandle),
}

impl Handle {
    pub(crate) fn transport(&self) -> TransportType {
        match self {
            Handle::Awcpfs(_) => TransportType::Awcpfs,
            Handle::Archive(_) => TransportType::Archive,
            Handle::Storage(_) => TransportType::Storage,
            Handle::Git(_) => TransportType::Git,
            Handle::Sshfs(_) => TransportType::Sshfs,
        }
    }
}

/// A delegation about to be launched.
pub(crate) struct NewDelegation {
    pub(crate) id: DelegationId,
    pub(crate) access: AccessMode,
    pub(crate) ttl: Duration,
    pub(crate) lease: Arc<Lease>,
    pub(crate) token: String,
    pub(crate) source: PathBuf,
    pub(crate) read_only: bool,
    /// The `awcpfs` exports, one per resource (none for `archive`).
    pub(crate) exports: Vec<super::resources::Exported>,
    pub(crate) progress: Arc<super::progress::Progress>,
}

/// The reference's refusals for a resource path that is missing or not a directory.
pub(crate) fn check_dir(source: &std::path::Path) -> Result<(), Refusal> {
    match std::fs::metadata(source) {
        Err(_) => Err(Refusal::bad(
            ErrorCode::WorkspaceNotFound,
            format!("Workspace directory not found: {}", source.display()),
            "Verify the workspace path is correct",
        )),
        Ok(m) if !m.is_dir() => Err(Refusal::bad(
            ErrorCode::WorkspaceInvalid,
            format!(
                "Invalid workspace: path is not a directory ({})",
                source.display()
            ),
            "Provide a valid directory path",
        )),
        Ok(_) => Ok(()),
    }
}

/// Add the Executor's token (the delegation's `auth` credential), if there is one.
pub(crate) fn with_token(
    rb: reqwest::RequestBuilder,
    token: Option<&str>,
) -> reqwest::RequestBuilder {
    match token {
        Some(t) => rb.bearer_auth(t),
        None => rb,
    }
}

/// An Executor that could not be reached: 504 when it did not answer in time, 502 when
/// the connection failed (refused, reset, no route), with the URL tried and the cause.
pub(crate) fn unreachable(url: &str, what: &str, e: &reqwest::Error) -> Refusal {
    use std::error::Error as _;
    let mut cause = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        cause = format!("{cause}: {s}");
        src = s.source();
    }
    let (status, hint) = if e.is_timeout() {
        (
            504,
            "The Executor did not answer in time: check that it is running and not overloaded",
        )
    } else {
        (
            502,
            "Check that `awcp-ctl executor` runs there and that this machine can reach it \
             (the URL, its --listen address, firewalls)",
        )
    };
    Refusal {
        status,
        message: format!("Failed to send {what} to the executor at {url}: {cause}"),
        code: None,
        hint: Some(hint.into()),
    }
}

/// Whether `url` can name an Executor: an absolute `http`/`https` URL with a host.
pub(crate) fn check_executor_url(url: &str) -> Result<(), String> {
    match reqwest::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some() => Ok(()),
        Ok(u) => Err(format!(
            "executorUrl {url:?} is not an http(s) URL with a host (scheme {:?})",
            u.scheme()
        )),
        Err(e) => Err(format!("executorUrl {url:?} is not a URL: {e}")),
    }
}

/// The Executor's AWCP base (`…/awcp`), from the URL the user gave.
pub(crate) fn awcp_base(executor_url: &str) -> String {
    let u = executor_url.trim_end_matches('/');
    let base = u.strip_suffix("/awcp").unwrap_or(u);
    format!("{base}/awcp")
}

impl Daemon {
    /// `POST /delegate`; `progress` counts the manifest builds for a progress bar.
    pub(crate) async fn delegate(
        self: &Arc<Self>,
        mut req: DelegateRequest,
        progress: Arc<super::progress::Progress>,
    ) -> Result<DelegationId, Refusal> {
        if req.auth.is_none()
            && let Some(t) = &self.cfg.executor_token
        {
            req.auth = Some(awcp_protocol::messages::AuthCredential {
                auth_type: awcp_protocol::messages::AuthType::Bearer,
                credential: t.clone(),
                metadata: None,
            });
        }
        if req.transport.is_none() {
            req.transport = Some(self.choose_transport(&req).await);
        }
        if matches!(
            req.transport,
            Some(TransportType::Archive | TransportType::Storage | TransportType::Git)
        ) {
            return self.delegate_archive(req, progress).await;
        }
        if req.transport == Some(TransportType::Sshfs) {
            return self.delegate_sshfs(req, progress).await;
        }
        if matches!(
            req.snapshot_mode,
            Some(SnapshotMode::Staged | SnapshotMode::Discard)
        ) && req.environment.resources.len() != 1
        {
            return Err(Refusal::bad(
                ErrorCode::WorkspaceInvalid,
                format!(
                    "snapshotMode staged/discard with awcpfs keeps one change set for one \
                     resource; {} were given",
                    req.environment.resources.len()
                ),
                "Delegate one resource per staged delegation, use snapshotMode \"auto\", or \
                 the archive transport",
            ));
        }
        // `ro` if asked, or if every resource is; each resource keeps its own mode.
        let read_only = req.access_mode == Some(AccessMode::Ro)
            || req
                .environment
                .resources
                .iter()
                .all(|r| r.mode == AccessMode::Ro);
        let access = if read_only {
            AccessMode::Ro
        } else {
            AccessMode::Rw
        };
        let ttl_s = req.ttl_seconds.unwrap_or(DEFAULT_TTL).max(1);
        let ttl = Duration::from_secs(ttl_s).min(self.cfg.max_ttl);
        let id = DelegationId::from_random_bytes(rand::random());
        let token = crate::random_token();
        let lease = Arc::new(Lease::grant(
            Arc::new(SystemClock::new()),
            LeaseTerms {
                ttl,
                max_ttl: self.cfg.max_ttl,
                flush_grace: self.cfg.flush_grace,
            },
        ));
        lease.limit_renewals(self.cfg.max_lease);
        let t0 = std::time::Instant::now();
        let exported = self
            .export_resources(
                id.as_str(),
                &token,
                &lease,
                &req.environment.resources,
                access,
                &progress,
            )
            .await?;
        tracing::debug!(
            ms = t0.elapsed().as_millis() as u64,
            "delegation's exports registered"
        );
        if let Some(first) = exported.first()
            && let Err(refusal) =
                // Snapshot modes staged/discard: commits go to a change set, not the workspace.
                self.stage_export(&first.export, id.as_str(), req.snapshot_mode)
        {
            for e in &exported {
                self.exports.remove(e.export.id());
            }
            return Err(refusal);
        }
        let handle = Handle::Awcpfs(exported.iter().map(|e| e.handle_entry()).collect());
        self.launch(
            req,
            NewDelegation {
                id,
                access,
                ttl,
                lease,
                token,
                source: exported[0].stored.source.clone(),
                read_only,
                exports: exported,
                progress,
            },
            handle,
        )
        .await
    }

    /// Record a new delegation, then INVITE → ACCEPT → START; on failure, keep it in
    /// `error` and give the refusal back.
    pub(crate) async fn launch(
        self: &Arc<Self>,
        req: DelegateRequest,
        n: NewDelegation,
        handle: Handle,
    ) -> Result<DelegationId, Refusal> {
        let NewDelegation {
            id,
            access,
            ttl,
            lease,
            token,
            source,
            read_only,
            exports,
            progress,
        } = n;
        let now = crate::now_iso();
        let record = DelegationRecord {
            id: id.clone(),
            state: DelegationState::Created,
            peer_url: req.executor_url.clone(),
            environment: req.environment.clone(),
            export_path: Some(source.display().to_string()),
            task: req.task.clone(),
            lease_config: LeaseConfig {
                ttl_seconds: ttl.as_secs(),
                access_mode: access,
            },
            retention_ms: DEFAULT_RETENTION_MS,
            executor_retention_ms: None,
            active_lease: None,
            executor_work_dir: None,
            executor_constraints: None,
            snapshots: None,
            applied_snapshot_id: None,
            snapshot_policy: Some(SnapshotPolicy {
                mode: req.snapshot_mode.unwrap_or(SnapshotMode::Auto),
                retention_ms: None,
                max_snapshots: Some(10),
            }),
            current_round: None,
            rounds: None,
            result: None,
            error: None,
            created_at: now.clone(),
            updated_at: now,
        };
        let (tx, _) = broadcast::channel(256);
        let live = Arc::new(Live {
            d: Mutex::new(StoredDelegation {
                record,
                export_id: id.as_str().to_string(),
                token: token.clone(),
                source: source.clone(),
                read_only,
                events: Vec::new(),
                last_event_id: None,
                transport: handle.transport(),
                executor_token: req.auth.as_ref().map(|a| a.credential.clone()),
                multi_round: req.multi_round.unwrap_or(self.cfg.reference_rounds),
                resources: exports.iter().map(|e| e.stored.clone()).collect(),
            }),
            lease: lease.clone(),
            tx,
            exports: Mutex::new(exports.into_iter().map(|e| e.export).collect()),
            seen_renewals: Default::default(),
            progress,
            owner: Mutex::new(None),
        });
        self.live
            .lock()
            .insert(id.as_str().to_string(), live.clone());
        self.aecp_attach(id.as_str());
        self.record(
            &live,
            WatchEvent::State {
                state: DelegationState::Created,
                at: crate::now_iso(),
                detail: Some(match &handle {
                    Handle::Awcpfs(r) if r.len() > 1 => format!(
                        "exporting {} resources ({})",
                        r.len(),
                        r.iter()
                            .map(|r| r.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    Handle::Awcpfs(_) => format!("exporting {}", source.display()),
                    Handle::Archive(h) => format!(
                        "sending {} as an archive ({} bytes zipped)",
                        source.display(),
                        h.workspace_base64.len() / 4 * 3
                    ),
                    Handle::Storage(_) => format!(
                        "sending {} as a zip behind the data plane's storage URLs",
                        source.display()
                    ),
                    Handle::Git(h) => format!(
                        "pushed {} to {} as {} ({})",
                        source.display(),
                        h.repo_url,
                        h.base_branch,
                        h.base_commit
                    ),
                    Handle::Sshfs(h) => format!(
                        "serving {} over sshfs: sshd on {}:{}, chrooted to the delegation, \
                         certificate for {} until the lease ends",
                        source.display(),
                        h.endpoint.host,
                        h.endpoint.port,
                        h.endpoint.user
                    ),
                }),
            },
        );

        match self
            .invite_and_start(&live, &req, &id, access, ttl, handle)
            .await
        {
            Ok(()) => {
                let d = self.clone();
                let l = live.clone();
                self.spawn(async move { d.watch_expiry(l).await });
                Ok(id)
            }
            Err(refusal) => {
                // Unlike the reference, a delegation that never started is kept (in `error`), so
                // `awcp-ctl status` can say what happened.
                live.lease.revoke(false);
                for e in live.exports.lock().drain(..) {
                    self.exports.remove(e.id());
                }
                live.d.lock().record.error = Some(ErrorInfo {
                    code: refusal.code.clone().unwrap_or(ErrorCode::SetupFailed),
                    message: refusal.message.clone(),
                    hint: refusal.hint.clone(),
                });
                self.transition(
                    &live,
                    DelegationEvent::SendError,
                    Some(refusal.message.clone()),
                );
                Err(refusal)
            }
        }
    }

    async fn invite_and_start(
        self: &Arc<Self>,
        live: &Arc<Live>,
        req: &DelegateRequest,
        id: &DelegationId,
        access: AccessMode,
        ttl: Duration,
        handle: Handle,
    ) -> Result<(), Refusal> {
        let invite = AwcpMessage::Invite(InviteMessage {
            version: ProtocolVersion,
            delegation_id: id.clone(),
            task: req.task.clone(),
            lease: LeaseConfig {
                ttl_seconds: ttl.as_secs(),
                access_mode: access,
            },
            retention_ms: DEFAULT_RETENTION_MS,
            environment: EnvironmentDeclaration {
                resources: req
                    .environment
                    .resources
                    .iter()
                    .map(|r| ResourceDeclaration {
                        name: r.name.clone(),
                        resource_type: r.resource_type,
                        mode: if access == AccessMode::Ro {
                            AccessMode::Ro
                        } else {
                            r.mode
                        },
                    })
                    .collect(),
            },
            requirements: Some(Requirements {
                transport: Some(handle.transport()),
                sandbox_profile: (req.no_network == Some(true)).then_some(SandboxProfile {
                    allow_network: Some(false),
                    ..SandboxProfile::default()
                }),
            }),
            auth: req.auth.clone(),
            multi_round: req
                .multi_round
                .unwrap_or(self.cfg.reference_rounds)
                .then_some(true),
        });
        live.progress.set_phase("invite");
        let t0 = std::time::Instant::now();
        self.transition(live, DelegationEvent::SendInvite, None);
        let token = live.d.lock().executor_token.clone();
        let reply = self
            .post_message(&req.executor_url, token.as_deref(), &invite)
            .await?;
        match reply {
            AwcpMessage::Accept(a) => {
                // Asked for no network: the workspace goes (with START) only to an Executor
                // that says it gives none (the reference's ignores the request).
                let no_network_granted = a
                    .executor_constraints
                    .as_ref()
                    .and_then(|c| c.sandbox_profile)
                    .is_some_and(|s| s.allow_network == Some(false));
                if req.no_network == Some(true) && !no_network_granted {
                    return Err(Refusal::bad(
                        ErrorCode::Declined,
                        "the Executor accepted without confirming that its agent has no \
                         network (ACCEPT's executorConstraints.sandboxProfile.allowNetwork \
                         is not false); the workspace was not sent"
                            .into(),
                        "Delegate to an Executor that isolates agents (awcp-ctl executor), \
                         or without --no-network",
                    ));
                }
                {
                    let mut d = live.d.lock();
                    d.record.executor_work_dir = Some(a.executor_work_dir.clone());
                    d.record.executor_constraints = a.executor_constraints;
                    d.record.executor_retention_ms = Some(a.retention_ms);
                }
                self.transition(
                    live,
                    DelegationEvent::ReceiveAccept,
                    Some(format!("executor work dir {}", a.executor_work_dir.path)),
                );
            }
            AwcpMessage::Error(e) => {
                return Err(Refusal {
                    status: 400,
                    message: e.message,
                    code: Some(e.code),
                    hint: e.hint,
                });
            }
            other => {
                return Err(Refusal::internal(format!(
                    "the executor answered INVITE with {}",
                    other.kind()
                )));
            }
        }
        // Open the event stream before START: the reference keeps no backlog.
        let events_url = format!(
            "{}/tasks/{}/events",
            awcp_base(&req.executor_url),
            id.as_str()
        );
        let token = live.d.lock().executor_credential();
        let resp = with_token(self.http.get(&events_url), token.as_deref())
            .timeout(Duration::from_secs(24 * 3600 * 365))
            .send()
            .await
            .map_err(|e| unreachable(&events_url, "the event stream request", &e))?;
        if !resp.status().is_success() {
            return Err(Refusal::internal(format!(
                "the executor refused its event stream: HTTP {}",
                resp.status()
            )));
        }
        let expires_at = live.lease.expires_at_rfc3339();
        let start = AwcpMessage::Start(StartMessage {
            version: ProtocolVersion,
            delegation_id: id.clone(),
            lease: ActiveLease {
                expires_at: expires_at.clone(),
                access_mode: access,
            },
            transport_handle: match handle {
                Handle::Awcpfs(resources) => TransportHandle::Awcpfs(AwcpfsHandle {
                    endpoint: self.export_url.clone(),
                    token: live.d.lock().token.clone(),
                    export_id: resources[0].export_id.clone(),
                    manifest_digest: resources[0].manifest_digest.clone(),
                    block_size: self.cfg.block_size,
                    expires_at: expires_at.clone(),
                    tls_fingerprint: None,
                    remaining_ms: Some(
                        u64::try_from(live.lease.snapshot().remaining.as_millis())
                            .unwrap_or(u64::MAX),
                    ),
                    resources: (resources.len() > 1).then_some(resources),
                }),
                Handle::Archive(h) => TransportHandle::Archive(h),
                Handle::Storage(h) => TransportHandle::Storage(h),
                Handle::Git(h) => TransportHandle::Git(h),
                Handle::Sshfs(h) => TransportHandle::Sshfs(h),
            },
        });
        live.d.lock().record.active_lease = Some(ActiveLease {
            expires_at: expires_at.clone(),
            access_mode: access,
        });
        let d = self.clone();
        let l = live.clone();
        let executor_url = req.executor_url.clone();
        live.progress.set_phase("start");
        let t_start = t0.elapsed();
        self.post_raw(&req.executor_url, token.as_deref(), &start)
            .await?;
        tracing::debug!(
            invite_ms = t_start.as_millis() as u64,
            start_ms = (t0.elapsed() - t_start).as_millis() as u64,
            "INVITE answered and START sent"
        );
        live.progress.set_phase("started");
        self.first_round(live);
        self.transition(
            live,
            DelegationEvent::SendStart,
            Some(format!("lease until {expires_at}")),
        );
        self.spawn(async move { d.pump(l, executor_url, Some(resp)).await });
        Ok(())
    }

    async fn post_raw(
        &self,
        url: &str,
        token: Option<&str>,
        msg: &AwcpMessage,
    ) -> Result<reqwest::Response, Refusal> {
        let mut rb = with_token(self.http.post(url), token);
        if let AwcpMessage::Start(s) = msg
            && let TransportHandle::Archive(h) = &s.transport_handle
        {
            // The whole workspace travels in this request: allow for a slow link (a minute
            // plus one per 10 MB), not the default 30 s.
            let secs = 60 + (h.workspace_base64.len() as u64 / (10 << 20)) * 60;
            rb = rb.timeout(Duration::from_secs(secs));
        }
        let resp = rb
            .json(msg)
            .send()
            .await
            .map_err(|e| unreachable(url, msg.kind(), &e))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            return Err(Refusal::internal(format!(
                "Failed to send {} to executor: {status} - {body}",
                msg.kind()
            )));
        }
        Ok(resp)
    }

    async fn post_message(
        &self,
        url: &str,
        token: Option<&str>,
        msg: &AwcpMessage,
    ) -> Result<AwcpMessage, Refusal> {
        let resp = self.post_raw(url, token, msg).await?;
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| Refusal::internal(format!("reading the executor's answer: {e}")))?;
        awcp_protocol::parse_message(&bytes)
            .map_err(|e| Refusal::internal(format!("the executor's answer is not AWCP: {e}")))
    }

    /// Follow the Executor's task events until a terminal one, reconnecting with
    /// `Last-Event-ID` if the stream breaks.
    pub(crate) async fn pump(
        self: Arc<Self>,
        live: Arc<Live>,
        executor_url: String,
        first: Option<reqwest::Response>,
    ) {
        let id = live.d.lock().record.id.as_str().to_string();
        let url = format!("{}/tasks/{id}/events", awcp_base(&executor_url));
        let mut resp = first;
        let mut failures = 0u32;
        loop {
            // Over, or taken over by another daemon (which follows the stream now).
            if live.d.lock().record.state.is_terminal() || live.is_foreign() {
                return;
            }
            let r = match resp.take() {
                Some(r) => r,
                None => {
                    let token = live.d.lock().executor_credential();
                    let mut rq = with_token(self.http.get(&url), token.as_deref())
                        .timeout(Duration::from_secs(24 * 3600 * 365));
                    if let Some(last) = live.d.lock().last_event_id.clone() {
                        rq = rq.header("Last-Event-ID", last);
                    }
                    match rq.send().await {
                        Ok(r) if r.status().is_success() => r,
                        other => {
                            failures += 1;
                            tracing::warn!(?other, "executor event stream unavailable");
                            if failures > 5 {
                                break;
                            }
                            tokio::time::sleep(Duration::from_secs(u64::from(failures))).await;
                            continue;
                        }
                    }
                }
            };
            let mut reader = SseReader::new(r);
            loop {
                match reader.next().await {
                    Ok(Some(ev)) => {
                        if live.is_foreign() {
                            return; // Taken over: the new owner follows the stream.
                        }
                        failures = 0;
                        if ev.id.is_some() {
                            live.d.lock().last_event_id = ev.id.clone();
                        }
                        match awcp_protocol::parse_event(ev.data.as_bytes()) {
                            Ok(event) => {
                                if self.on_task_event(&live, &executor_url, event).await {
                                    return;
                                }
                            }
                            Err(e) => tracing::warn!(error = %e, "ignoring a malformed task event"),
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "executor event stream broke");
                        break;
                    }
                }
            }
            failures += 1;
            if failures > 5 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        if !live.d.lock().record.state.is_terminal() && !live.is_foreign() {
            live.d.lock().record.error = Some(ErrorInfo {
                code: ErrorCode::SseFailed,
                message: "the executor's event stream ended before the task did".into(),
                hint: Some(
                    "Check the executor; `awcp-ctl status` shows what was written back".into(),
                ),
            });
            self.transition(
                &live,
                DelegationEvent::ReceiveError,
                Some("event stream lost".into()),
            );
        }
    }

    /// Handle one task event; true when the delegation is over.
    async fn on_task_event(
        self: &Arc<Self>,
        live: &Arc<Live>,
        executor_url: &str,
        event: TaskEvent,
    ) -> bool {
        // The history keeps what happened, not the payload: a snapshot's zip can be large
        // and is kept (or applied) on its own.
        let mut shown = event.clone();
        if let TaskEvent::Snapshot(s) = &mut shown {
            s.snapshot_base64 = String::new();
        }
        self.record(live, WatchEvent::Task { event: shown });
        if matches!(event, TaskEvent::Done(_) | TaskEvent::Error(_)) {
            // The Executor's last word: its final flush is over and it has unmounted.
            live.progress.set_phase("ended");
        }
        let state = live.d.lock().record.state;
        match event {
            TaskEvent::Status(s) => {
                if state == DelegationState::Started {
                    self.transition(live, DelegationEvent::SetupComplete, s.message.clone());
                }
                false
            }
            TaskEvent::Done(done) => {
                if state == DelegationState::Started {
                    self.transition(live, DelegationEvent::SetupComplete, None);
                }
                if state != DelegationState::Completed {
                    self.end_round(live, &done.summary, done.highlights.clone());
                }
                self.fetch_missed_snapshot(live, &done).await;
                let id = live.d.lock().record.id.as_str().to_string();
                let token = live.d.lock().executor_credential();
                let ack = self
                    .http
                    .post(format!("{}/tasks/{id}/ack", awcp_base(executor_url)));
                let _ = with_token(ack, token.as_deref()).send().await;
                self.transition(live, DelegationEvent::ReceiveDone, Some(done.summary));
                true
            }
            TaskEvent::Error(e) => {
                live.d.lock().record.error = Some(ErrorInfo {
                    code: e.code.clone(),
                    message: e.message.clone(),
                    hint: e.hint.clone(),
                });
                // Our own revoke or expiry already ended it; the executor's error confirms.
                if !state.is_terminal() {
                    let ev = if e.code == ErrorCode::Expired {
                        DelegationEvent::Expire
                    } else {
                        DelegationEvent::ReceiveError
                    };
                    self.transition(
                        live,
                        ev,
                        Some(format!("{}: {}", e.code.as_str(), e.message)),
                    );
                }
                true
            }
            TaskEvent::Snapshot(snap) => {
                self.on_snapshot(live, snap).await;
                false
            }
            TaskEvent::RoundDone(r) => {
                if state == DelegationState::Started {
                    self.transition(live, DelegationEvent::SetupComplete, None);
                }
                self.on_round_done(live, r).await;
                false
            }
        }
    }

    /// Revoke: the export refuses the token at once (a final flush may land within the
    /// grace unless `no_flush`), the Executor is told with AWCP cancel.
    pub(crate) async fn revoke(&self, id: &str, no_flush: bool) -> Result<(), Refusal> {
        let live = self.get_live(id).ok_or_else(|| Refusal {
            status: 404,
            message: format!("Unknown delegation: {id}"),
            code: None,
            hint: Some("`awcp-ctl status` lists the delegations this daemon knows".into()),
        })?;
        self.check_owned(&live)?;
        let state = live.d.lock().record.state;
        if state.is_terminal() {
            return Err(Refusal {
                status: 400,
                message: format!(
                    "Cannot transition delegation {id} (CANCEL) in state '{}': \
                     the delegation has already ended",
                    state.as_str()
                ),
                code: None,
                hint: None,
            });
        }
        let snap = live.lease.revoke(!no_flush);
        self.record(
            &live,
            WatchEvent::Lease {
                state: snap.state,
                expires_at: live.lease.expires_at_rfc3339(),
            },
        );
        self.transition(
            &live,
            DelegationEvent::Cancel,
            Some("revoked by the delegator".into()),
        );
        let (executor_url, token) = {
            let d = live.d.lock();
            (d.record.peer_url.clone(), d.executor_credential())
        };
        let url = format!("{}/cancel/{id}", executor_url.trim_end_matches('/'));
        if let Err(e) = with_token(self.http.post(&url), token.as_deref())
            .send()
            .await
        {
            tracing::warn!(error = %e, "telling the executor about the revoke failed; the lease still ends");
        }
        Ok(())
    }

    /// The Executor's mount status for `id`, from its `/awcp/status` (best effort, 1 s).
    pub(crate) async fn executor_mount(
        &self,
        executor_url: &str,
        token: Option<&str>,
        id: &str,
    ) -> Option<serde_json::Value> {
        let rb = self.http.get(format!("{}/status", awcp_base(executor_url)));
        let status: awcp_protocol::api::ExecutorStatus = with_token(rb, token)
            .timeout(Duration::from_secs(1))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        status
            .delegations
            .into_iter()
            .find(|d| d.id.as_str() == id)
            .and_then(|d| d.mount)
    }

    /// The transport for a request that names none: `--default-transport` if set, else
    /// what the Executor's `GET /awcp/status` says it serves. Ours lists `transports`
    /// (`awcpfs` preferred); a reference Executor lists none (or has no such route, 404)
    /// and serves only `archive`. When the Executor cannot be asked (unreachable, 401, a
    /// body that is not a status), `awcpfs`: INVITE then reports the real problem.
    pub(crate) async fn choose_transport(&self, req: &DelegateRequest) -> TransportType {
        if let Some(t) = self.cfg.default_transport {
            return t;
        }
        let token = req.auth.as_ref().map(|a| a.credential.as_str());
        let rb = self
            .http
            .get(format!("{}/status", awcp_base(&req.executor_url)));
        let chosen = match with_token(rb, token)
            .timeout(Duration::from_secs(5))
            .send()
            .await
        {
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => TransportType::Archive,
            Ok(r) if r.status().is_success() => {
                match r.json::<awcp_protocol::api::ExecutorStatus>().await {
                    Ok(st) => match st.transports {
                        Some(t) if t.contains(&TransportType::Awcpfs) => TransportType::Awcpfs,
                        Some(t) if t.contains(&TransportType::Archive) => TransportType::Archive,
                        Some(t) if t.contains(&TransportType::Storage) => TransportType::Storage,
                        Some(t)
                            if t.contains(&TransportType::Git)
                                && (req.git_remote.is_some() || self.cfg.git_remote.is_some()) =>
                        {
                            TransportType::Git
                        }
                        Some(_) => TransportType::Awcpfs,
                        None => TransportType::Archive,
                    },
                    Err(_) => TransportType::Awcpfs,
                }
            }
            _ => TransportType::Awcpfs,
        };
        tracing::info!(
            executor = %req.executor_url,
            transport = chosen.as_str(),
            "no transport requested; chose what the Executor serves"
        );
        chosen
    }

    /// Renew the lease by `ttl`.
    pub(crate) fn renew(&self, id: &str, ttl: Duration) -> Result<String, Refusal> {
        let live = self.get_live(id).ok_or_else(|| Refusal {
            status: 404,
            message: format!("Unknown delegation: {id}"),
            code: None,
            hint: None,
        })?;
        self.check_owned(&live)?;
        live.lease.renew(ttl).map_err(|e| Refusal {
            status: 400,
            message: e.to_string(),
            code: Some(ErrorCode::Expired),
            hint: None,
        })?;
        Ok(self
            .record_renewals(&live)
            .unwrap_or_else(|| live.lease.expires_at_rfc3339()))
    }

    /// Record renewals not yet in the history (ours, or the Executor's through the
    /// export) and keep the stored expiry current, so a restart restores the right one.
    fn record_renewals(&self, live: &Live) -> Option<String> {
        use std::sync::atomic::Ordering;
        let snap = live.lease.snapshot();
        let seen = live.seen_renewals.swap(snap.renewals, Ordering::SeqCst);
        if snap.renewals <= seen || snap.state != LeaseState::Active {
            return None;
        }
        let expires_at = live.lease.expires_at_rfc3339();
        if let Some(l) = live.d.lock().record.active_lease.as_mut() {
            l.expires_at = expires_at.clone();
        }
        self.record(
            live,
            WatchEvent::Lease {
                state: LeaseState::Active,
                expires_at: expires_at.clone(),
            },
        );
        Some(expires_at)
    }

    /// End the delegation when its lease runs out.
    pub(crate) async fn watch_expiry(self: Arc<Self>, live: Arc<Live>) {
        loop {
            // Over, or taken over by another daemon (which watches it now).
            if live.d.lock().record.state.is_terminal() || live.is_foreign() {
                return;
            }
            self.record_renewals(&live);
            let snap = live.lease.snapshot();
            if snap.state == LeaseState::Expired {
                self.record(
                    &live,
                    WatchEvent::Lease {
                        state: LeaseState::Expired,
                        expires_at: live.lease.expires_at_rfc3339(),
                    },
                );
                let executor_url = live.d.lock().record.peer_url.clone();
                let id = live.d.lock().record.id.as_str().to_string();
                live.d.lock().record.error = Some(ErrorInfo {
                    code: ErrorCode::Expired,
                    message: "Lease expired during task execution".into(),
                    hint: Some("Renew with `awcp-ctl renew` before the lease ends".into()),
                });
                self.transition(&live, DelegationEvent::Expire, Some("lease expired".into()));
                let token = live.d.lock().executor_credential();
                let cancel = self.http.post(format!(
                    "{}/cancel/{id}",
                    executor_url.trim_end_matches('/')
                ));
                let _ = with_token(cancel, token.as_deref()).send().await;
                return;
            }
            tokio::time::sleep(
                snap.remaining.min(Duration::from_millis(500)) + Duration::from_millis(5),
            )
            .await;
        }
    }

    /// Register one resource's export again after a restart, with the same filter as when
    /// it was delegated (what was hidden stays hidden).
    async fn restore_export(
        &self,
        d: &StoredDelegation,
        r: &crate::store::StoredResource,
        lease: &Arc<Lease>,
    ) -> anyhow::Result<Arc<awcpfs::export::Export>> {
        let cfg = ExportConfig {
            root: r.source.clone(),
            read_only: r.read_only,
            block_size: self.cfg.block_size,
            staging_dir: self.cfg.state_dir.join("staging").join(&r.export_id),
        };
        let spec = d
            .record
            .environment
            .resources
            .iter()
            .find(|s| s.name == r.name);
        let filter = spec.map(|s| self.resource_filter(s, &r.source));
        let exports = self.exports.clone();
        let (eid, tok, l) = (r.export_id.clone(), d.token.clone(), lease.clone());
        let root = r.source.clone();
        Ok(tokio::task::spawn_blocking(move || {
            // As when it was first registered: what git tracks is withheld, not left out.
            let filter =
                filter.map(|f| super::admission::export_filter_withholding(f, &root, false).0);
            exports.register_filtered(eid, tok, cfg, l, filter)
        })
        .await??)
    }

    /// What was left of a stored delegation's lease (zero when it has run out or none was
    /// granted).
    pub(crate) fn remaining_of(d: &StoredDelegation) -> Duration {
        d.record
            .active_lease
            .as_ref()
            .and_then(|l| chrono::DateTime::parse_from_rfc3339(&l.expires_at).ok())
            .map(|t| {
                (t.with_timezone(&chrono::Utc) - chrono::Utc::now())
                    .to_std()
                    .unwrap_or_default()
            })
            .unwrap_or_default()
    }

    /// A stored delegation's lease, rebuilt: its TTL what was granted (renewals extend by
    /// it), its deadline the stored expiry.
    pub(crate) fn restored_lease(&self, d: &StoredDelegation) -> Arc<Lease> {
        let granted_ttl = Duration::from_secs(d.record.lease_config.ttl_seconds.max(1));
        let lease = Arc::new(Lease::grant(
            Arc::new(SystemClock::new()),
            LeaseTerms {
                ttl: granted_ttl,
                max_ttl: self.cfg.max_ttl,
                flush_grace: self.cfg.flush_grace,
            },
        ));
        let _ = lease.renew(Self::remaining_of(d));
        lease.limit_renewals(self.cfg.max_lease);
        lease
    }

    /// Reload persisted delegations: ended ones for history, live ones with their exports
    /// and lease restored (an expired lease ends them).
    pub(crate) async fn restore(self: &Arc<Self>) {
        let store = self.clone();
        let rows = match tokio::task::spawn_blocking(move || store.store.changed_since(0)).await {
            Ok(Ok(rows)) => rows,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "cannot read persisted delegations");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot read persisted delegations");
                return;
            }
        };
        let mut rows = rows;
        rows.sort_by(|a, b| {
            a.delegation
                .record
                .created_at
                .cmp(&b.delegation.record.created_at)
        });
        for row in rows {
            self.seen_version
                .fetch_max(row.version, std::sync::atomic::Ordering::SeqCst);
            // Another daemon's (on a shared database): a read-only copy, until that daemon
            // lapses and this one takes it over.
            if row
                .owner
                .as_deref()
                .is_some_and(|o| o != self.daemon_id && self.store.shared())
            {
                self.refresh_foreign(row);
                continue;
            }
            let d = row.delegation;
            let id = d.record.id.as_str().to_string();
            let remaining = Self::remaining_of(&d);
            let lease = self.restored_lease(&d);
            let terminal = d.record.state.is_terminal();
            if terminal {
                lease.revoke(false);
            }
            let mut exports = Vec::new();
            if !terminal && !remaining.is_zero() && d.transport == TransportType::Awcpfs {
                for r in d.exported_resources() {
                    match self.restore_export(&d, &r, &lease).await {
                        Ok(e) => exports.push(e),
                        Err(e) => {
                            tracing::warn!(error = %e, %id, resource = %r.name, "cannot restore export")
                        }
                    }
                }
                // Staged commits go on into the change set kept on disk.
                if let Some(e) = exports.first() {
                    let mode = d.record.snapshot_policy.map(|p| p.mode);
                    if let Err(r) = self.stage_export(e, &id, mode) {
                        tracing::warn!(error = %r.message, %id, "cannot restore the change set");
                    }
                }
            }
            let peer = d.record.peer_url.clone();
            let (tx, _) = broadcast::channel(256);
            let live = Arc::new(Live {
                d: Mutex::new(d),
                lease,
                tx,
                exports: Mutex::new(exports),
                seen_renewals: Default::default(),
                progress: {
                    let p = super::progress::Progress::new();
                    p.set_phase(if terminal { "ended" } else { "started" });
                    p
                },
                owner: Mutex::new(None),
            });
            self.live.lock().insert(id.clone(), live.clone());
            self.aecp_attach(&id);
            if !terminal {
                let d = self.clone();
                let l = live.clone();
                self.spawn(async move { d.watch_expiry(l).await });
                let d = self.clone();
                self.spawn(async move { d.pump(live, peer, None).await });
                tracing::info!(%id, "restored a running delegation");
            }
        }
    }
}
