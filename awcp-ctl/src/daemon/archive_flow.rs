//! Delegations with the reference's `archive` transport, for Executors that speak only the
//! reference protocol: admission and packing, then the snapshots that come back, applied,
//! staged or discarded per the delegation's snapshot mode.
//!
//! What was sent is remembered (`<state>/archive/<id>/base.json`: the hash of every file),
//! so a snapshot is merged file by file with conflict detection
//! ([`archive::apply`](crate::archive::apply)) instead of replacing whole directories.
//! Staged snapshots are kept as `<state>/archive/<id>/<snapshotId>.zip`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcp_protocol::api::{DelegateRequest, EnvironmentSnapshot, SnapshotMode, SnapshotStatus};
use awcp_protocol::events::{SnapshotEvent, SnapshotMetadata};
use awcp_protocol::messages::AccessMode;
use awcp_protocol::transport::ArchiveHandle;
use awcp_protocol::{DelegationId, ErrorCode, TransportType};

use super::flow::{Handle, NewDelegation, Refusal};
use super::{Daemon, Live};
use crate::archive::{self, ApplyReport, ApplyTarget, BaseManifest, SourceResource};
use crate::watch::WatchEvent;

const BASE_FILE: &str = "base.json";

fn not_found(id: &str) -> Refusal {
    Refusal {
        status: 400,
        message: format!("Unknown delegation: {id}"),
        code: None,
        hint: None,
    }
}

fn plain(status: u16, message: String) -> Refusal {
    Refusal {
        status,
        message,
        code: None,
        hint: None,
    }
}

impl Daemon {
    fn archive_dir(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join("archive").join(id)
    }

    /// `POST /delegate` with `transport: "archive"`, `"storage"` or `"git"`: the
    /// workspace is admitted and zipped the same way for all three; it then travels inside
    /// START, behind the data plane's storage URLs, or pushed to a git remote.
    pub(crate) async fn delegate_archive(
        self: &Arc<Self>,
        req: DelegateRequest,
        progress: Arc<super::progress::Progress>,
    ) -> Result<DelegationId, Refusal> {
        let kind = req.transport.unwrap_or(TransportType::Archive);
        let git_remote = req
            .git_remote
            .clone()
            .or_else(|| self.cfg.git_remote.clone());
        if kind == TransportType::Git && git_remote.is_none() {
            return Err(Refusal::bad(
                ErrorCode::WorkspaceInvalid,
                "the git transport needs a remote to push the workspace to".into(),
                "Name one: `awcp-ctl delegate --transport git --git-remote URL`, or \
                 `awcp-ctl serve --git-remote URL`",
            ));
        }
        super::resources::check_names(req.environment.resources.iter().map(|r| r.name.as_str()))?;
        let mut sources = Vec::new();
        for r in &req.environment.resources {
            let root = std::path::absolute(&r.source).unwrap_or_else(|_| PathBuf::from(&r.source));
            super::flow::check_dir(&root)?;
            let mut filter = self.resource_filter(r, &root);
            if kind == TransportType::Git {
                // The workspace's own repository (if any) stays home: the transport
                // commits its files in a repository of its own.
                filter.exclude.push(".git".into());
            }
            sources.push(SourceResource {
                name: r.name.clone(),
                filter,
                root,
            });
        }
        // `archive` carries the zip in one JSON body (the reference's 100 MB cap); the
        // other two move it out of band.
        let limits = match kind {
            TransportType::Archive => self.cfg.archive_limits,
            _ => self.cfg.snapshot_limits,
        };
        let built = tokio::task::spawn_blocking(move || archive::build(&sources, &limits))
            .await
            .map_err(|e| Refusal::internal(format!("packing panicked: {e}")))?
            .map_err(|e| match &e {
                archive::ArchiveError::TooLarge { detail } => Refusal {
                    status: 400,
                    message: "Workspace exceeds size limits".into(),
                    code: Some(ErrorCode::WorkspaceTooLarge),
                    hint: Some(format!(
                        "{detail}. Consider selecting a smaller subdirectory, excluding files, \
                         or the awcpfs transport."
                    )),
                },
                archive::ArchiveError::Sensitive { files } => {
                    super::admission::sensitive(files, &self.cfg.sensitive)
                }
                _ => Refusal::bad(
                    ErrorCode::WorkspaceInvalid,
                    format!("cannot pack the workspace: {e}"),
                    "Check that every resource is a readable directory",
                ),
            })?;
        let access = req.access_mode.unwrap_or(AccessMode::Rw);
        let ttl_s = req.ttl_seconds.unwrap_or(3600).max(1);
        let ttl = Duration::from_secs(ttl_s).min(self.cfg.max_ttl);
        let id = DelegationId::from_random_bytes(rand::random());
        let lease = Arc::new(Lease::grant(
            Arc::new(SystemClock::new()),
            LeaseTerms {
                ttl,
                max_ttl: self.cfg.max_ttl,
                flush_grace: self.cfg.flush_grace,
            },
        ));
        lease.limit_renewals(self.cfg.max_lease);
        let dir = self.archive_dir(id.as_str());
        // Private (0700/0600): the base lists the workspace's files and hashes.
        awcpfs::private::create_dir_all(&dir)
            .and_then(|_| {
                awcpfs::private::write(
                    &dir.join(BASE_FILE),
                    &serde_json::to_vec(&built.base).map_err(std::io::Error::other)?,
                )
            })
            .map_err(|e| Refusal::internal(format!("saving {}: {e}", dir.display())))?;
        if !built.skipped.is_empty() {
            tracing::info!(skipped = ?built.skipped, "left out of the archive (links out of the resource, special files)");
        }
        let source = std::path::absolute(&req.environment.resources[0].source)
            .unwrap_or_else(|_| PathBuf::from(&req.environment.resources[0].source));
        let handle = match (kind, git_remote) {
            (TransportType::Storage, _) => Handle::Storage(self.storage_handle(
                id.as_str(),
                &built.bytes,
                built.checksum,
                lease.expires_at_rfc3339(),
            )?),
            (TransportType::Git, Some(remote)) => {
                Handle::Git(self.git_handle(id.as_str(), remote, built.bytes).await?)
            }
            _ => Handle::Archive(ArchiveHandle {
                workspace_base64: base64::engine::general_purpose::STANDARD.encode(&built.bytes),
                checksum: built.checksum,
            }),
        };
        self.launch(
            req,
            NewDelegation {
                id,
                access,
                ttl,
                lease,
                token: String::new(),
                source,
                read_only: access == AccessMode::Ro,
                exports: Vec::new(),
                progress,
            },
            handle,
        )
        .await
    }

    /// Where each resource of a delegation lives, and whether a snapshot may change it.
    fn targets(live: &Live) -> Vec<ApplyTarget> {
        let d = live.d.lock();
        let rw = d.record.lease_config.access_mode == AccessMode::Rw;
        d.record
            .environment
            .resources
            .iter()
            .map(|r| ApplyTarget {
                name: r.name.clone(),
                root: std::path::absolute(&r.source).unwrap_or_else(|_| PathBuf::from(&r.source)),
                writable: rw && r.mode == AccessMode::Rw,
            })
            .collect()
    }

    /// Merge a snapshot zip into the delegation's resources (blocking work off the runtime).
    async fn merge(
        &self,
        live: &Live,
        id: &str,
        sid: &str,
        zip: Arc<Vec<u8>>,
    ) -> Result<ApplyReport, Refusal> {
        let dir = self.archive_dir(id);
        let targets = Self::targets(live);
        let limits = self.cfg.snapshot_limits;
        let sid = sid.to_string();
        tokio::task::spawn_blocking(move || {
            let mut base: BaseManifest = std::fs::read(dir.join(BASE_FILE))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            let report = archive::apply(
                &zip,
                &mut base,
                &targets,
                &dir.join("scratch"),
                &sid,
                &limits,
            )?;
            // The next snapshot (multi-round) is compared with what this one held.
            if let Ok(json) = serde_json::to_vec(&base) {
                let _ = awcpfs::private::write(&dir.join(BASE_FILE), &json);
            }
            Ok::<_, archive::ArchiveError>(report)
        })
        .await
        .map_err(|e| Refusal::internal(format!("applying panicked: {e}")))?
        .map_err(|e| Refusal::internal(format!("applying the snapshot failed: {e}")))
    }

    fn note(&self, live: &Live, detail: String) {
        let state = live.d.lock().record.state;
        self.record(
            live,
            WatchEvent::State {
                state,
                at: crate::now_iso(),
                detail: Some(detail),
            },
        );
    }

    /// A `snapshot` event arrived: apply, stage or discard it per the snapshot mode.
    pub(crate) async fn on_snapshot(&self, live: &Arc<Live>, ev: SnapshotEvent) {
        let (id, mode, transport) = {
            let d = live.d.lock();
            (
                d.record.id.as_str().to_string(),
                d.record
                    .snapshot_policy
                    .map(|p| p.mode)
                    .unwrap_or(SnapshotMode::Auto),
                d.transport,
            )
        };
        if transport == TransportType::Awcpfs {
            return;
        }
        let state = live.d.lock().record.state;
        if matches!(
            state,
            awcp_protocol::DelegationState::Cancelled | awcp_protocol::DelegationState::Expired
        ) {
            // Revoked or expired: whatever the Executor still sends is not applied.
            self.note(
                live,
                format!(
                    "snapshot {} arrived after the delegation was {}; ignored",
                    ev.snapshot_id,
                    state.as_str()
                ),
            );
            return;
        }
        let sid = if super::resources::plain_name(&ev.snapshot_id) {
            ev.snapshot_id.clone()
        } else {
            format!("snap_{}", hex::encode(rand::random::<[u8; 6]>()))
        };
        let fetched = match transport {
            TransportType::Storage if ev.snapshot_base64.trim_start().starts_with('{') => {
                self.storage_result(&id, &ev.snapshot_base64).await
            }
            TransportType::Git => match self.git_result(&id, &ev.snapshot_base64).await {
                Ok((zip, how)) => {
                    self.note(live, format!("snapshot {sid}: {how}"));
                    Ok(zip)
                }
                Err(e) => Err(e),
            },
            // `archive`, and a `storage` Executor that had no upload URL (the reference's
            // then sends the zip itself).
            _ => base64::engine::general_purpose::STANDARD
                .decode(ev.snapshot_base64.as_bytes())
                .map_err(|e| format!("not valid base64 ({e})")),
        };
        let zip = match fetched {
            Ok(z) => Arc::new(z),
            Err(e) => {
                self.note(live, format!("snapshot {sid} cannot be read: {e}; ignored"));
                return;
            }
        };
        let dir = self.archive_dir(&id);
        let (z2, d2, limits) = (zip.clone(), dir.clone(), self.cfg.snapshot_limits);
        let changed = tokio::task::spawn_blocking(move || {
            let base: BaseManifest = std::fs::read(d2.join(BASE_FILE))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            archive::changed_files(&z2, &base, &d2.join("scratch"), &limits)
        })
        .await
        .ok()
        .and_then(Result::ok);
        let mut metadata = ev.metadata.clone().unwrap_or_default();
        if metadata.changed_files.is_none() {
            metadata.changed_files = changed;
        }
        let mut snap = EnvironmentSnapshot {
            id: sid.clone(),
            delegation_id: live.d.lock().record.id.clone(),
            summary: ev.summary.clone(),
            highlights: ev.highlights.clone(),
            status: SnapshotStatus::Pending,
            local_path: None,
            metadata: Some(metadata),
            recommended: ev.recommended,
            created_at: crate::now_iso(),
            applied_at: None,
        };
        let detail = match mode {
            SnapshotMode::Auto => match self.merge(live, &id, &sid, zip.clone()).await {
                Ok(report) => {
                    snap.status = SnapshotStatus::Applied;
                    snap.applied_at = Some(crate::now_iso());
                    let detail = describe(&sid, &report);
                    attach_report(&mut snap, &report);
                    live.d.lock().record.applied_snapshot_id = Some(sid.clone());
                    detail
                }
                Err(e) => {
                    // Kept staged, so nothing is lost: apply it by hand after fixing the cause.
                    let path = dir.join(format!("{sid}.zip"));
                    let _ = awcpfs::private::write(&path, zip.as_slice());
                    snap.local_path = Some(path.display().to_string());
                    format!(
                        "snapshot {sid} could not be applied ({}); kept staged",
                        e.message
                    )
                }
            },
            SnapshotMode::Staged => {
                let path = dir.join(format!("{sid}.zip"));
                let (p, z) = (path.clone(), zip.clone());
                match tokio::task::spawn_blocking(move || awcpfs::private::write(&p, z.as_slice()))
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e)))
                {
                    Ok(()) => {
                        snap.local_path = Some(path.display().to_string());
                        format!("snapshot {sid} staged: `awcp-ctl diff {id}` shows it")
                    }
                    Err(e) => format!("snapshot {sid} could not be saved: {e}"),
                }
            }
            SnapshotMode::Discard => {
                snap.status = SnapshotStatus::Discarded;
                format!("snapshot {sid} discarded (snapshot mode `discard`)")
            }
        };
        live.d
            .lock()
            .record
            .snapshots
            .get_or_insert_with(Vec::new)
            .push(snap);
        self.note(live, detail);
    }

    fn snapshot_of(live: &Live, sid: &str) -> Option<EnvironmentSnapshot> {
        live.d
            .lock()
            .record
            .snapshots
            .as_ref()
            .and_then(|s| s.iter().find(|s| s.id == sid).cloned())
    }

    fn update_snapshot(live: &Live, sid: &str, f: impl FnOnce(&mut EnvironmentSnapshot)) {
        let mut d = live.d.lock();
        if let Some(s) = d
            .record
            .snapshots
            .as_mut()
            .and_then(|s| s.iter_mut().find(|s| s.id == sid))
        {
            f(s);
        }
    }

    /// `POST /delegation/:id/snapshots/:sid/apply`.
    pub(crate) async fn apply_snapshot(&self, id: &str, sid: &str) -> Result<ApplyReport, Refusal> {
        let live = self.get_live(id).ok_or_else(|| not_found(id))?;
        self.check_owned(&live)?;
        if live.d.lock().transport == TransportType::Awcpfs {
            let report = self.apply_staged(&live, sid).await?;
            Self::update_snapshot(&live, sid, |s| {
                s.status = SnapshotStatus::Applied;
                s.applied_at = Some(crate::now_iso());
                s.local_path = None;
                attach_report(s, &report);
            });
            live.d.lock().record.applied_snapshot_id = Some(sid.to_string());
            self.note(&live, describe(sid, &report));
            return Ok(report);
        }
        let snap = Self::snapshot_of(&live, sid)
            .ok_or_else(|| plain(400, format!("Snapshot not found: {sid}")))?;
        if snap.status == SnapshotStatus::Applied {
            return Err(plain(400, format!("Snapshot already applied: {sid}")));
        }
        let path = snap.local_path.clone().ok_or_else(|| {
            plain(
                400,
                format!("Snapshot {sid} was discarded; nothing is kept to apply"),
            )
        })?;
        let zip = std::fs::read(&path).map_err(|e| plain(400, format!("reading {path}: {e}")))?;
        let report = self.merge(&live, id, sid, Arc::new(zip)).await?;
        Self::update_snapshot(&live, sid, |s| {
            s.status = SnapshotStatus::Applied;
            s.applied_at = Some(crate::now_iso());
            attach_report(s, &report);
        });
        live.d.lock().record.applied_snapshot_id = Some(sid.to_string());
        self.note(&live, describe(sid, &report));
        Ok(report)
    }

    /// Ours: `GET /delegation/:id/snapshots/:sid/diff`: what a kept snapshot changes
    /// relative to what was sent.
    pub(crate) async fn diff_snapshot(
        &self,
        id: &str,
        sid: &str,
    ) -> Result<Vec<archive::FileChange>, Refusal> {
        let live = self
            .get_live(id)
            .ok_or_else(|| plain(404, format!("Unknown delegation: {id}")))?;
        if live.d.lock().transport == TransportType::Awcpfs {
            return self.diff_staged(&live, sid).await;
        }
        let snap = Self::snapshot_of(&live, sid)
            .ok_or_else(|| plain(404, format!("Snapshot not found: {sid}")))?;
        let path = snap.local_path.ok_or_else(|| {
            plain(
                404,
                format!("Snapshot {sid} is not kept (it was applied at once, or discarded)"),
            )
        })?;
        let dir = self.archive_dir(id);
        let limits = self.cfg.snapshot_limits;
        tokio::task::spawn_blocking(move || {
            let zip =
                std::fs::read(&path).map_err(|e| plain(500, format!("reading {path}: {e}")))?;
            let base: BaseManifest = std::fs::read(dir.join(BASE_FILE))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            archive::diff(&zip, &base, &dir.join("scratch"), &limits)
                .map_err(|e| plain(500, format!("reading the snapshot: {e}")))
        })
        .await
        .map_err(|e| Refusal::internal(format!("diff panicked: {e}")))?
    }

    /// `POST /delegation/:id/snapshots/:sid/discard`.
    pub(crate) fn discard_snapshot(&self, id: &str, sid: &str) -> Result<(), Refusal> {
        let live = self.get_live(id).ok_or_else(|| not_found(id))?;
        self.check_owned(&live)?;
        if live.d.lock().transport == TransportType::Awcpfs {
            self.discard_staged(&live, sid)?;
        }
        let snap = Self::snapshot_of(&live, sid)
            .ok_or_else(|| plain(400, format!("Snapshot not found: {sid}")))?;
        if let Some(p) = &snap.local_path {
            let _ = std::fs::remove_file(p);
        }
        Self::update_snapshot(&live, sid, |s| {
            s.status = SnapshotStatus::Discarded;
            s.local_path = None;
        });
        self.note(&live, format!("snapshot {sid} discarded"));
        Ok(())
    }
}

/// One line about an applied snapshot.
fn describe(sid: &str, r: &ApplyReport) -> String {
    let mut s = format!(
        "snapshot {sid} applied: {} file(s) written, {} deleted, {} conflict(s)",
        r.written.len(),
        r.deleted.len(),
        r.conflicts.len()
    );
    for c in &r.conflicts {
        s.push_str(&format!(
            "; {}: {}{}",
            c.path,
            c.reason,
            c.kept_as
                .as_ref()
                .map(|k| format!(" (executor's version kept as {k})"))
                .unwrap_or_default()
        ));
    }
    for h in &r.held {
        s.push_str(&format!("; {} held: {}", h.path, h.reason));
    }
    s
}

/// Ours (additive): the merge's outcome in the snapshot's metadata, under `applyReport`.
fn attach_report(s: &mut EnvironmentSnapshot, r: &ApplyReport) {
    let m = s.metadata.get_or_insert_with(SnapshotMetadata::default);
    if let Ok(v) = serde_json::to_value(r) {
        m.extra.insert("applyReport".into(), v);
    }
}
