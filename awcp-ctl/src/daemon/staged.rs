//! `awcpfs` delegations in the `staged` and `discard` snapshot modes.
//!
//! The export of such a delegation keeps every commit in a change set
//! ([`ChangeStage`], `<state>/staged/<id>/changes.json`, blocks in the export's staging
//! directory `<state>/staging/<id>/`) instead of writing it to the workspace. In `staged`
//! mode the change set is listed with the delegation's snapshots (one entry per
//! generation: an apply or a discard starts the next), shown by `awcp-ctl diff`, applied
//! file by file with the live commit's conflict checks, or discarded. In `discard` mode it
//! is dropped when the delegation ends.

use std::path::PathBuf;
use std::sync::Arc;

use awcp_protocol::api::{EnvironmentSnapshot, SnapshotMode, SnapshotStatus};
use awcp_protocol::dataplane::Change as Op;
use awcp_protocol::events::SnapshotMetadata;
use awcp_protocol::{DelegationState, TransportType};
use awcpfs::export::Export;
use awcpfs::export::stage::{ChangeStage, Node, StagedPath, read_tree_file};

use super::flow::Refusal;
use super::{Daemon, Live};
use crate::archive::{ApplyReport, Change, FileChange};

/// Largest file shown as a text diff.
const DIFF_LIMIT: u64 = 1 << 20;

fn plain(status: u16, message: String) -> Refusal {
    Refusal {
        status,
        message,
        code: None,
        hint: None,
    }
}

/// The snapshot id of a delegation's change set, generation `generation`: `snap_` and 12
/// hex digits, as the reference's ids.
fn snapshot_id(id: &str, generation: u32) -> String {
    let h = blake3::hash(format!("{id}/staged/{generation}").as_bytes());
    format!("snap_{}", &h.to_hex()[..12])
}

/// Whether a delegation's commits go to a change set (`awcpfs`, snapshot mode `staged` or
/// `discard`).
pub(crate) fn stages_commits(live: &Live) -> bool {
    staged_mode(live).is_some()
}

/// Whether a delegation keeps its changes in a change set, and in which mode.
fn staged_mode(live: &Live) -> Option<SnapshotMode> {
    let d = live.d.lock();
    let mode = d.record.snapshot_policy.map(|p| p.mode)?;
    (d.transport == TransportType::Awcpfs
        && matches!(mode, SnapshotMode::Staged | SnapshotMode::Discard))
    .then_some(mode)
}

impl Daemon {
    fn stage_dirs(&self, id: &str) -> (PathBuf, PathBuf) {
        (
            self.cfg.state_dir.join("staged").join(id),
            self.cfg.state_dir.join("staging").join(id),
        )
    }

    /// Make a new (or restored) export of delegation `id` keep its commits in the
    /// delegation's change set, when `mode` asks for that.
    pub(crate) fn stage_export(
        &self,
        export: &Export,
        id: &str,
        mode: Option<SnapshotMode>,
    ) -> Result<(), Refusal> {
        if !matches!(mode, Some(SnapshotMode::Staged | SnapshotMode::Discard)) {
            return Ok(());
        }
        let (dir, blocks) = self.stage_dirs(id);
        let stage = ChangeStage::open(&dir, &blocks)
            .map_err(|e| Refusal::internal(format!("cannot keep a change set: {e}")))?;
        export.stage_commits(Arc::new(stage));
        Ok(())
    }

    /// The change set of a staged delegation: its export's, or (after a restart, the
    /// export gone) opened from disk with a detached export to apply it through.
    fn stage_of(&self, live: &Live) -> Result<(Arc<Export>, Arc<ChangeStage>), Refusal> {
        if let Some(e) = live.exports.lock().first().cloned()
            && let Some(s) = e.stage()
        {
            return Ok((e.clone(), s.clone()));
        }
        let (id, source, resource) = {
            let d = live.d.lock();
            (
                d.record.id.as_str().to_string(),
                d.source.clone(),
                d.record.environment.resources.first().cloned(),
            )
        };
        let (dir, blocks) = self.stage_dirs(&id);
        if !ChangeStage::exists(&dir) {
            return Err(plain(
                404,
                format!("delegation {id} keeps no change set (nothing was committed)"),
            ));
        }
        let stage = ChangeStage::open(&dir, &blocks)
            .map_err(|e| Refusal::internal(format!("reading the change set: {e}")))?;
        let filter = resource
            .map(|r| super::admission::export_filter(self.resource_filter(&r, &source), false).0);
        let export = Export::detached(&source, &blocks, filter)
            .map_err(|e| Refusal::internal(format!("opening {}: {e}", source.display())))?;
        let stage = Arc::new(stage);
        export.stage_commits(stage.clone());
        let export = Arc::new(export);
        // Applying through it is screened like a live write-back (AECP contracts).
        let workspace = source
            .canonicalize()
            .unwrap_or_else(|_| source.clone())
            .display()
            .to_string();
        self.aecp_install_screen(&id, &workspace, &export);
        {
            // Staged delegations carry one resource: its export is the first.
            let mut exports = live.exports.lock();
            exports.clear();
            exports.push(export.clone());
        }
        Ok((export, stage))
    }

    /// A recovery bundle (`awcp-ctl collect`) of a delegation whose changes are staged
    /// ([`stages_commits`]): recorded into its change set like any commit, never written
    /// to the workspace.
    pub(crate) async fn stage_bundle(
        &self,
        live: &Live,
        changes: awcp_protocol::dataplane::ChangeSet,
        blocks: Vec<([u8; 32], Vec<u8>)>,
    ) -> Result<awcp_protocol::dataplane::CommitResult, Refusal> {
        let (export, _) = self.stage_of(live)?;
        tokio::task::spawn_blocking(move || export.apply_bundle(&changes, &blocks))
            .await
            .map_err(|e| Refusal::internal(format!("staging the bundle panicked: {e}")))?
            .map_err(|e| Refusal::internal(format!("staging the bundle: {e}")))
    }

    /// Bring the delegation's snapshot list up to date with its change set (staged mode):
    /// the current generation appears as a pending snapshot once it changes anything.
    pub(crate) fn refresh_staged(&self, live: &Live) {
        if staged_mode(live) != Some(SnapshotMode::Staged) {
            return;
        }
        let Ok((_, stage)) = self.stage_of(live) else {
            return;
        };
        let changes = stage.changes();
        let mut d = live.d.lock();
        let sid = snapshot_id(d.record.id.as_str(), stage.generation());
        let list = d.record.snapshots.get_or_insert_with(Vec::new);
        let files: Vec<String> = changes.iter().map(|(p, _)| p.clone()).collect();
        let pos = list.iter().position(|s| s.id == sid);
        if pos.is_none() && files.is_empty() {
            return;
        }
        let summary = format!(
            "{} path(s) changed by the Executor, kept by the export (awcpfs, staged)",
            files.len()
        );
        let metadata = SnapshotMetadata {
            file_count: Some(
                changes
                    .iter()
                    .filter(|(_, p)| matches!(p.now, Node::File { .. }))
                    .count() as u64,
            ),
            total_bytes: Some(
                changes
                    .iter()
                    .map(|(_, p)| match p.now {
                        Node::File { size, .. } => size,
                        _ => 0,
                    })
                    .sum(),
            ),
            changed_files: Some(files),
            extra: Default::default(),
        };
        let updated = match pos {
            Some(i) if list[i].status == SnapshotStatus::Pending => {
                let s = &mut list[i];
                let same = s.metadata.as_ref() == Some(&metadata);
                s.summary = summary;
                s.metadata = Some(metadata);
                !same
            }
            Some(_) => false,
            None => {
                let delegation_id = d.record.id.clone();
                let list = d.record.snapshots.get_or_insert_with(Vec::new);
                list.push(EnvironmentSnapshot {
                    id: sid,
                    delegation_id,
                    summary,
                    highlights: None,
                    status: SnapshotStatus::Pending,
                    local_path: Some(stage.dir().display().to_string()),
                    metadata: Some(metadata),
                    recommended: Some(true),
                    created_at: crate::now_iso(),
                    applied_at: None,
                });
                true
            }
        };
        if updated {
            let snapshot = d.clone();
            drop(d);
            self.persist(live, &snapshot);
        }
    }

    /// Discard mode, at the end: the change set is dropped (after the flush grace, with
    /// the export) and listed as a discarded snapshot.
    pub(crate) fn drop_discarded(&self, live: &Live) -> Option<Arc<ChangeStage>> {
        if staged_mode(live) != Some(SnapshotMode::Discard) {
            return None;
        }
        let (_, stage) = self.stage_of(live).ok()?;
        let files: Vec<String> = stage.changes().into_iter().map(|(p, _)| p).collect();
        // The screen's reports on the discarded files go with them (and those of a final
        // flush within the grace, when the stage is removed: see `retire`).
        let id = live.d.lock().record.id.as_str().to_string();
        self.aecp_forget_worker_reports(&id);
        let mut d = live.d.lock();
        let sid = snapshot_id(d.record.id.as_str(), stage.generation());
        let delegation_id = d.record.id.clone();
        let list = d.record.snapshots.get_or_insert_with(Vec::new);
        if !list.iter().any(|s| s.id == sid) {
            list.push(EnvironmentSnapshot {
                id: sid,
                delegation_id,
                summary: format!(
                    "{} path(s) changed by the Executor, discarded (snapshot mode `discard`)",
                    files.len()
                ),
                highlights: None,
                status: SnapshotStatus::Discarded,
                local_path: None,
                metadata: Some(SnapshotMetadata {
                    changed_files: Some(files),
                    ..Default::default()
                }),
                recommended: None,
                created_at: crate::now_iso(),
                applied_at: None,
            });
            let snapshot = d.clone();
            drop(d);
            self.persist(live, &snapshot);
        }
        Some(stage)
    }

    /// The pending change-set snapshot `sid` of a staged delegation, checked for apply or
    /// discard.
    fn pending_stage(
        &self,
        live: &Live,
        sid: &str,
        what: &str,
    ) -> Result<(Arc<Export>, Arc<ChangeStage>), Refusal> {
        self.refresh_staged(live);
        let (id, state, status) = {
            let d = live.d.lock();
            let status = d
                .record
                .snapshots
                .as_ref()
                .and_then(|s| s.iter().find(|s| s.id == sid))
                .map(|s| s.status);
            (d.record.id.as_str().to_string(), d.record.state, status)
        };
        match status {
            None => return Err(plain(400, format!("Snapshot not found: {sid}"))),
            Some(SnapshotStatus::Applied) => {
                return Err(plain(400, format!("Snapshot already applied: {sid}")));
            }
            Some(SnapshotStatus::Discarded) => {
                return Err(plain(400, format!("Snapshot {sid} was discarded")));
            }
            Some(SnapshotStatus::Pending) => {}
        }
        if !state.is_terminal() && state != DelegationState::Idle {
            return Err(Refusal {
                status: 409,
                message: format!(
                    "cannot {what} snapshot {sid}: delegation {id} is {} and the Executor may \
                     still change it",
                    state.as_str()
                ),
                code: None,
                hint: Some(
                    "Wait until the delegation has ended (or is idle between rounds)".into(),
                ),
            });
        }
        self.stage_of(live)
    }

    /// Apply a staged delegation's change set (`POST …/snapshots/:sid/apply`).
    pub(crate) async fn apply_staged(
        &self,
        live: &Live,
        sid: &str,
    ) -> Result<ApplyReport, Refusal> {
        let (export, stage) = self.pending_stage(live, sid, "apply")?;
        let prefix = resource_prefix(live);
        let (plan, result) = tokio::task::spawn_blocking(move || stage.apply(&export))
            .await
            .map_err(|e| Refusal::internal(format!("applying panicked: {e}")))?
            .map_err(|e| Refusal::internal(format!("applying the change set failed: {e}")))?;
        let conflicted: std::collections::HashSet<&str> = result
            .conflicts
            .iter()
            .map(|c| c.path.as_str())
            .chain(result.held.iter().map(|h| h.path.as_str()))
            .collect();
        let mut report = ApplyReport::default();
        for c in &plan.changes {
            if conflicted.contains(c.path()) {
                continue;
            }
            let p = format!("{prefix}{}", c.path());
            match c {
                Op::Write { .. } | Op::Symlink { .. } => report.written.push(p),
                Op::Unlink { .. } | Op::Rmdir { .. } => report.deleted.push(p),
                Op::Mkdir { .. } | Op::Chmod { .. } => {}
            }
        }
        report.written.dedup();
        report.conflicts = result
            .conflicts
            .into_iter()
            .map(|mut c| {
                c.path = format!("{prefix}{}", c.path);
                c.kept_as = c.kept_as.map(|k| format!("{prefix}{k}"));
                c
            })
            .collect();
        report.held = result
            .held
            .into_iter()
            .map(|mut h| {
                h.path = format!("{prefix}{}", h.path);
                h
            })
            .collect();
        if !report.held.is_empty() {
            tracing::warn!(id = %live.d.lock().record.id.as_str(), held = ?report.held.iter().map(|h| &h.path).collect::<Vec<_>>(),
                "applying a staged change set: the AECP screen held these files; they stay staged");
        }
        Ok(report)
    }

    /// Discard a staged delegation's change set (`POST …/snapshots/:sid/discard`): nothing
    /// of it is left behind, the AECP screen's reports and held content on its files
    /// included.
    pub(crate) fn discard_staged(&self, live: &Live, sid: &str) -> Result<(), Refusal> {
        let (_, stage) = self.pending_stage(live, sid, "discard")?;
        stage
            .discard()
            .map_err(|e| Refusal::internal(format!("discarding the change set failed: {e}")))?;
        let id = live.d.lock().record.id.as_str().to_string();
        self.aecp_forget_worker_reports(&id);
        Ok(())
    }

    /// What a staged delegation's change set would change (`GET …/snapshots/:sid/diff`).
    pub(crate) async fn diff_staged(
        &self,
        live: &Live,
        sid: &str,
    ) -> Result<Vec<FileChange>, Refusal> {
        self.refresh_staged(live);
        let (id, status) = {
            let d = live.d.lock();
            let status = d
                .record
                .snapshots
                .as_ref()
                .and_then(|s| s.iter().find(|s| s.id == sid))
                .map(|s| s.status);
            (d.record.id.as_str().to_string(), status)
        };
        match status {
            Some(SnapshotStatus::Pending) => {}
            Some(_) => {
                return Err(plain(
                    404,
                    format!("Snapshot {sid} is not kept (it was applied or discarded)"),
                ));
            }
            None => return Err(plain(404, format!("Snapshot not found: {sid}"))),
        }
        let (_, stage) = self.stage_of(live)?;
        let root = live.d.lock().source.clone();
        let prefix = resource_prefix(live);
        tokio::task::spawn_blocking(move || diff(&stage, &root, &prefix))
            .await
            .map_err(|e| Refusal::internal(format!("diff panicked: {e}")))?
            .map_err(|e| Refusal::internal(format!("reading the change set of {id}: {e}")))
    }
}

/// `<resource>/`, the prefix of a delegation's paths in reports (as for `archive`).
fn resource_prefix(live: &Live) -> String {
    live.d
        .lock()
        .record
        .environment
        .resources
        .first()
        .map(|r| format!("{}/", r.name))
        .unwrap_or_default()
}

fn octal(mode: u32) -> String {
    format!("{:o}", mode & 0o7777)
}

/// The change set as file changes: renames paired up (a new file with the content of one
/// removed), text files as unified diffs, everything else as one line.
fn diff(
    stage: &ChangeStage,
    root: &std::path::Path,
    prefix: &str,
) -> Result<Vec<FileChange>, awcpfs::export::stage::StageError> {
    let changes = stage.changes();
    // Removed files by content, for pairing renames.
    let mut removed: std::collections::HashMap<&str, &str> = Default::default();
    for (path, p) in &changes {
        if let (Node::File { hash, .. }, Node::Absent) = (&p.base, &p.now) {
            removed.entry(hash.as_str()).or_insert(path.as_str());
        }
    }
    let mut renamed_from: std::collections::HashSet<&str> = Default::default();
    let mut out = Vec::new();
    for (path, p) in &changes {
        let shown = format!("{prefix}{path}");
        let mut fc = FileChange {
            path: shown,
            change: Change::Modified,
            from: None,
            detail: None,
            patch: None,
        };
        match (&p.base, &p.now) {
            (Node::Absent, Node::File { hash, .. }) => {
                if let Some(old) = removed.get(hash.as_str())
                    && renamed_from.insert(old)
                {
                    fc.change = Change::Renamed;
                    fc.from = Some(format!("{prefix}{old}"));
                    fc.detail = Some(format!("renamed from {prefix}{old}"));
                } else {
                    fc.change = Change::Added;
                    text_patch(stage, root, path, p, &mut fc)?;
                }
            }
            (_, Node::Absent) => {
                fc.change = Change::Deleted;
                fc.detail = Some(describe(&p.base).to_string() + " deleted");
            }
            (Node::File { .. }, Node::File { .. }) => text_patch(stage, root, path, p, &mut fc)?,
            (_, now) => {
                if matches!(p.base, Node::Absent) {
                    fc.change = Change::Added;
                }
                fc.detail = Some(match (&p.base, now) {
                    (Node::Dir { mode: a }, Node::Dir { mode: b }) => {
                        format!("directory mode {} → {}", octal(*a), octal(*b))
                    }
                    (_, Node::Symlink { target }) => format!("symlink → {target}"),
                    (_, Node::Dir { mode }) => format!("directory (mode {})", octal(*mode)),
                    (base, _) => format!("{} replaced", describe(base)),
                });
            }
        }
        if !p.xattrs.is_empty() {
            let names: Vec<&str> = p.xattrs.keys().map(String::as_str).collect();
            let x = format!("extended attributes changed: {}", names.join(", "));
            fc.detail = Some(match fc.detail.take() {
                Some(d) => format!("{d}; {x}"),
                None => x,
            });
        }
        out.push(fc);
    }
    // A rename's old path is shown by the new one.
    out.retain(|f| {
        !(f.change == Change::Deleted
            && renamed_from.contains(f.path.strip_prefix(prefix).unwrap_or(&f.path)))
    });
    Ok(out)
}

fn describe(n: &Node) -> &'static str {
    match n {
        Node::Absent => "nothing",
        Node::File { .. } => "file",
        Node::Symlink { .. } => "symlink",
        Node::Dir { .. } => "directory",
    }
}

/// A file added or changed: a unified diff when both sides are text, else a summary.
fn text_patch(
    stage: &ChangeStage,
    root: &std::path::Path,
    path: &str,
    p: &StagedPath,
    fc: &mut FileChange,
) -> Result<(), awcpfs::export::stage::StageError> {
    let Node::File {
        hash, size, mode, ..
    } = &p.now
    else {
        return Ok(());
    };
    let mut notes = Vec::new();
    let (old, old_label) = match &p.base {
        Node::File {
            hash: base_hash,
            mode: base_mode,
            ..
        } => {
            if base_mode != mode {
                notes.push(format!("mode {} → {}", octal(*base_mode), octal(*mode)));
            }
            if base_hash == hash {
                fc.detail = Some(notes.join("; "));
                return Ok(());
            }
            let current = read_tree_file(root, path, DIFF_LIMIT).ok().flatten();
            let still_base = current
                .as_ref()
                .is_some_and(|c| blake3::hash(c).to_hex().as_str() == base_hash.as_str());
            if current.is_some() && !still_base {
                notes.push(
                    "the Delegator's copy changed since it was delegated: applying will keep \
                     it and report a conflict (diff against it)"
                        .into(),
                );
            }
            (current, format!("a/{path}"))
        }
        _ => (Some(Vec::new()), "/dev/null".to_string()),
    };
    let new = stage.content(&p.now, DIFF_LIMIT)?;
    let text = |b: &Option<Vec<u8>>| {
        b.as_ref()
            .filter(|b| !b.contains(&0))
            .and_then(|b| std::str::from_utf8(b).ok().map(str::to_owned))
    };
    match (text(&old), text(&new)) {
        (Some(o), Some(n)) => {
            let patch = similar::TextDiff::from_lines(&o, &n)
                .unified_diff()
                .context_radius(3)
                .header(&old_label, &format!("b/{path}"))
                .to_string();
            fc.patch = Some(patch);
        }
        _ => notes.push(format!("binary or large file ({size} bytes)")),
    }
    if !notes.is_empty() {
        fc.detail = Some(notes.join("; "));
    }
    Ok(())
}
