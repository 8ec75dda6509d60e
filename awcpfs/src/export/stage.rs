//! Staged commits: an Executor's changes kept as a change set beside the tree, for the
//! Delegator to inspect, apply or discard, instead of written to the tree as they arrive.
//!
//! An export in staged mode ([`Export::stage_commits`]) sends every commit here instead of
//! to the tree. The change set is a map from path to its **base** (what the Executor's first
//! change to the path was based on: the export's manifest entry, unless the change names
//! other content, as after a daemon restart rebuilt the manifest) and its state **now**
//! (what the Executor's commits have made of it). Recording a commit changes nothing in the tree:
//!
//! * its changes pass the same checks as a live commit (paths, reserved names, hashes,
//!   extended attributes; hidden paths become conflicts), and every written file's blocks
//!   are copied into the stage's block store and checked against the file's hash, so the
//!   change set never depends on what the tree still holds;
//! * the new states are merged into the map, which is written to `changes.json` (temp file,
//!   `fsync`, rename) before the commit is answered: a restart of the Delegator loses no
//!   answered commit.
//!
//! The mount sees its own writes from its journal and manifest; a block of a staged file it
//! fetches again is served from the block store (the export's staging directory), since the
//! tree never had it.
//!
//! **Applying** turns the map into one net change set against the bases (removals, then
//! directories, then writes and symlinks, then modes), and commits it to the tree with the
//! live commit (`commit::run_live`): each change carries its base, so a path the Delegator
//! changed since is a conflict, reported and left as the Delegator has it (a written file's
//! other version kept beside it), while the other paths are applied. Afterwards every path's
//! base becomes its state now and the generation moves on, so a later round's changes form a
//! new change set on top. **Discarding** does the same without touching the tree.
//!
//! Not kept: hard links (a staged file with several names is written as separate copies)
//! and a change of a file's time alone (its content and mode are what a change set shows).

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use awcp_protocol::dataplane::{Change, ChangeSet, CommitResult, EntryKind, ManifestEntry};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::Export;
use super::commit::{self, MODE_MASK};
use super::error::ApiError;
use super::rootfs::RootDir;
use super::store::{Staging, hash_hex, parse_hash, tmp_name};

/// The change set's file in the stage directory.
const CHANGES_FILE: &str = "changes.json";

/// What a path is, on one side of a staged change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Node {
    /// Nothing there.
    Absent,
    /// A regular file.
    #[serde(rename_all = "camelCase")]
    File {
        /// blake3 (hex) of the content.
        hash: String,
        /// Size in bytes.
        size: u64,
        /// Permission bits.
        mode: u32,
        /// Modification time, nanoseconds since the epoch.
        mtime_ns: i64,
        /// Block hashes (hex) of the content, in order.
        blocks: Vec<String>,
        /// The file's `user.*` extended attributes (hex values), when the Executor wrote it
        /// with some.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        xattrs: Option<BTreeMap<String, String>>,
    },
    /// A symbolic link.
    Symlink {
        /// Its target.
        target: String,
    },
    /// A directory.
    Dir {
        /// Permission bits.
        mode: u32,
    },
}

impl Node {
    /// The permission bits of a file or directory.
    pub fn mode(&self) -> Option<u32> {
        match self {
            Node::File { mode, .. } | Node::Dir { mode } => Some(*mode),
            Node::Absent | Node::Symlink { .. } => None,
        }
    }
}

/// One path of a change set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StagedPath {
    /// What the Delegator had, as far as the Executor knew.
    pub base: Node,
    /// What the Executor made of it.
    pub now: Node,
    /// Extended attributes the Executor changed without rewriting the file (name → hex
    /// value, `None` for removed).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, Option<String>>,
}

impl StagedPath {
    /// Whether applying would change anything (a file's time alone does not count).
    pub fn changed(&self) -> bool {
        if !self.xattrs.is_empty() {
            return true;
        }
        match (&self.base, &self.now) {
            (
                Node::File {
                    hash: a, mode: ma, ..
                },
                Node::File {
                    hash: b,
                    mode: mb,
                    xattrs,
                    ..
                },
            ) => a != b || ma != mb || xattrs.as_ref().is_some_and(|x| !x.is_empty()),
            (a, b) => a != b,
        }
    }
}

/// What is kept on disk.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StageState {
    /// Bumped by every apply or discard: names the change set in snapshot lists.
    generation: u32,
    paths: BTreeMap<String, StagedPath>,
}

/// Why a change set could not be kept, applied or read.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// Reading or writing the stage failed.
    #[error("{context} in {}", dir.display())]
    Io {
        /// What was being done.
        context: &'static str,
        /// The stage directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The commit to the tree was refused as a whole (bad paths, missing blocks).
    #[error("the change set was refused: {message}")]
    Commit {
        /// The export's words.
        message: String,
    },
}

/// A per-delegation change set, durable in its own directory.
#[derive(Debug)]
pub struct ChangeStage {
    dir: PathBuf,
    blocks_dir: PathBuf,
    blocks: Staging,
    state: Mutex<StageState>,
    /// Manifest path → entry index, built on the first commit.
    manifest_paths: OnceLock<HashMap<String, usize>>,
}

impl ChangeStage {
    /// Open (creating if needed) the change set kept in `dir`, whose blocks live in
    /// `blocks_dir` — the staging directory of the export that records into it, so the
    /// export serves staged content from there.
    pub fn open(dir: &Path, blocks_dir: &Path) -> Result<ChangeStage, StageError> {
        let io_err = |context| {
            move |source| StageError::Io {
                context,
                dir: dir.to_owned(),
                source,
            }
        };
        crate::private::create_dir_all(dir).map_err(io_err("creating the stage directory"))?;
        let blocks = Staging::open(blocks_dir).map_err(io_err("creating the block store"))?;
        let state = match std::fs::read(dir.join(CHANGES_FILE)) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| io_err("reading the change set")(io::Error::other(e)))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => StageState::default(),
            Err(e) => return Err(io_err("reading the change set")(e)),
        };
        Ok(ChangeStage {
            dir: dir.to_owned(),
            blocks_dir: blocks_dir.to_owned(),
            blocks,
            state: Mutex::new(state),
            manifest_paths: OnceLock::new(),
        })
    }

    /// Whether `dir` holds a change set.
    pub fn exists(dir: &Path) -> bool {
        dir.join(CHANGES_FILE).is_file()
    }

    /// The stage directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the change set's blocks are kept.
    pub fn blocks_dir(&self) -> &Path {
        &self.blocks_dir
    }

    /// Bumped by each apply or discard.
    pub fn generation(&self) -> u32 {
        self.state.lock().generation
    }

    /// The paths that applying would change, sorted.
    pub fn changes(&self) -> Vec<(String, StagedPath)> {
        self.state
            .lock()
            .paths
            .iter()
            .filter(|(_, p)| p.changed())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The content of a staged file (`None` for anything else), at most `limit` bytes
    /// (`None` when larger).
    pub fn content(&self, node: &Node, limit: u64) -> Result<Option<Vec<u8>>, StageError> {
        let Node::File { blocks, size, .. } = node else {
            return Ok(None);
        };
        if *size > limit {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(*size as usize);
        for b in blocks {
            let data = parse_hash(b)
                .map(|h| self.blocks.read(&h))
                .transpose()
                .map_err(|source| self.io("reading a staged block", source))?
                .flatten();
            match data {
                Some(d) => out.extend_from_slice(&d),
                None => {
                    return Err(self.io(
                        "reading a staged block",
                        io::Error::new(io::ErrorKind::NotFound, format!("block {b} is missing")),
                    ));
                }
            }
        }
        Ok(Some(out))
    }

    /// The net change set applying would commit, in an order the tree accepts.
    pub fn plan(&self) -> ChangeSet {
        let st = self.state.lock();
        plan_of(&st)
    }

    /// Commit the change set to `export`'s tree, file by file with the live commit's conflict
    /// checks; then start a new generation on top of what was staged. Returns the net change
    /// set committed and the commit's result. Blocking IO.
    ///
    /// With a commit screen on `export`, the watched files are screened as a live
    /// write-back's are: a file the screen holds is not applied, is listed in the result's
    /// `held`, and stays in the change set — its base unchanged — so the next generation
    /// holds it again until it is fixed (or its contract changes) and applied.
    pub fn apply(&self, export: &Export) -> Result<(ChangeSet, CommitResult), StageError> {
        let mut st = self.state.lock();
        let plan = plan_of(&st);
        let result = if plan.changes.is_empty() {
            CommitResult {
                commit_id: plan.commit_id.clone(),
                applied: 0,
                conflicts: Vec::new(),
                seq: None,
                held: Vec::new(),
                current: None,
            }
        } else {
            commit::run_live(export, &plan).map_err(|e| StageError::Commit {
                message: e.to_string(),
            })?
        };
        let held: std::collections::HashSet<&str> =
            result.held.iter().map(|h| h.path.as_str()).collect();
        rebase_except(&mut st, &held);
        self.save(&st)?;
        Ok((plan, result))
    }

    /// Drop the change set's content; a later round's changes start a new one.
    pub fn discard(&self) -> Result<(), StageError> {
        let mut st = self.state.lock();
        rebase(&mut st);
        self.save(&st)
    }

    /// Remove the stage and its blocks from disk (the export must be gone).
    pub fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(&self.blocks_dir);
    }

    fn io(&self, context: &'static str, source: io::Error) -> StageError {
        StageError::Io {
            context,
            dir: self.dir.clone(),
            source,
        }
    }

    /// Record a commit (already checked for size): see the module docs.
    pub(crate) fn record(&self, export: &Export, cs: &ChangeSet) -> Result<CommitResult, ApiError> {
        let (cs, hidden) = commit::split_hidden(export, cs);
        // The commit screen, when the export has one: the watched files written are checked
        // like a live write-back's and reported, but never held here — nothing reaches the
        // tree until the change set is applied, which screens them again (see `apply`).
        let screen = if cs.changes.iter().any(|c| matches!(c, Change::Write { .. })) {
            export
                .screen()
                .map(|(worker, sc)| {
                    let watched = sc.watched(&worker);
                    (worker, sc, watched)
                })
                .filter(|(_, _, w)| !w.is_empty())
        } else {
            None
        };
        let mut screened: Vec<(String, Vec<u8>)> = Vec::new();
        let mut missing: Vec<String> = Vec::new();
        for change in &cs.changes {
            let Some(plan) = commit::check_change(change)? else {
                continue;
            };
            let Change::Write { path, size, .. } = change else {
                continue;
            };
            let mut content = screen
                .as_ref()
                .filter(|(_, _, w)| w.covers(path) && *size <= super::screen::MAX_SCREENED_BYTES)
                .map(|_| Vec::with_capacity(*size as usize));
            let mut hasher = blake3::Hasher::new();
            let mut total = 0u64;
            let mut complete = true;
            for h in &plan.blocks {
                let kept = self
                    .blocks
                    .read(h)
                    .map_err(|e| internal("reading a staged block", e))?;
                let data = match kept {
                    Some(d) => Some(d),
                    None => match export.read_block(h) {
                        Some(d) => {
                            self.blocks
                                .store(h, &d)
                                .map_err(|e| internal("keeping a staged block", e))?;
                            Some(d)
                        }
                        None => None,
                    },
                };
                match data {
                    Some(d) => {
                        hasher.update(&d);
                        total += d.len() as u64;
                        if let Some(c) = &mut content {
                            c.extend_from_slice(&d);
                        }
                    }
                    None => {
                        complete = false;
                        let hex = hash_hex(h);
                        if !missing.contains(&hex) {
                            missing.push(hex);
                        }
                    }
                }
            }
            let actual = hasher.finalize();
            if complete && (actual.as_bytes() != &plan.hash || total != *size) {
                return Err(ApiError::ChecksumMismatch {
                    what: format!("file {path:?} ({size} bytes announced, {total} assembled)"),
                    expected: hash_hex(&plan.hash),
                    actual: actual.to_hex().to_string(),
                });
            }
            if let (true, Some(c)) = (complete, content) {
                screened.push((path.clone(), c));
            }
        }
        if !missing.is_empty() {
            return Err(ApiError::MissingBlocks { hashes: missing });
        }
        let mut st = self.state.lock();
        for change in &cs.changes {
            self.merge(&mut st, export.manifest_entries(), change);
        }
        self.save(&st)
            .map_err(|e| internal("saving the change set", io::Error::other(e)))?;
        drop(st);
        if let Some((worker, sc, _)) = &screen {
            for (path, content) in &screened {
                // Reported to the worker either way; a hold is decided when applying.
                if let super::screen::Screening::Hold { reason, .. } =
                    sc.screen(worker, path, content)
                {
                    tracing::info!(export = %export.id, commit = %cs.commit_id, path = %path, reason = %reason, "a staged write would be held when applied");
                }
            }
        }
        super::Stats::add(&export.stats.commits, 1);
        for h in &hidden {
            export.stats.record_conflict(h);
        }
        tracing::info!(export = %export.id, commit = %cs.commit_id, changes = cs.changes.len(), hidden = hidden.len(), "commit staged");
        Ok(CommitResult {
            commit_id: cs.commit_id.clone(),
            applied: cs.changes.len() as u64,
            conflicts: hidden,
            // Nothing reached the tree: staged changes leave the change feed alone.
            seq: Some(export.feed.seq()),
            held: Vec::new(),
            current: None,
        })
    }

    /// What the manifest says of `path`.
    fn base_of(&self, manifest: &[ManifestEntry], path: &str) -> Node {
        let index = self.manifest_paths.get_or_init(|| {
            manifest
                .iter()
                .enumerate()
                .map(|(i, e)| (e.path.clone(), i))
                .collect()
        });
        let Some(e) = index.get(path).and_then(|i| manifest.get(*i)) else {
            return Node::Absent;
        };
        match e.kind {
            EntryKind::File => Node::File {
                hash: e.hash.clone().unwrap_or_default(),
                size: e.size,
                mode: e.mode & MODE_MASK,
                mtime_ns: e.mtime_ns,
                blocks: e.blocks.clone(),
                xattrs: None,
            },
            EntryKind::Dir => Node::Dir {
                mode: e.mode & MODE_MASK,
            },
            EntryKind::Symlink => Node::Symlink {
                target: e.target.clone().unwrap_or_default(),
            },
        }
    }

    /// Merge one change into the map: the path's state becomes what the change leaves.
    fn merge(&self, st: &mut StageState, manifest: &[ManifestEntry], change: &Change) {
        let path = change.path();
        let entry = st.paths.entry(path.to_owned()).or_insert_with(|| {
            let base = declared_base(self.base_of(manifest, path), change);
            StagedPath {
                now: base.clone(),
                base,
                xattrs: BTreeMap::new(),
            }
        });
        match change {
            Change::Mkdir { mode, .. } => {
                if !matches!(entry.now, Node::Dir { .. }) {
                    entry.now = Node::Dir {
                        mode: mode & MODE_MASK,
                    };
                }
            }
            Change::Rmdir { .. } | Change::Unlink { .. } => {
                entry.now = Node::Absent;
                entry.xattrs.clear();
            }
            Change::Write {
                mode,
                hash,
                size,
                blocks,
                mtime_ns,
                xattrs,
                ..
            } => {
                entry.now = Node::File {
                    hash: hash.clone(),
                    size: *size,
                    mode: mode & MODE_MASK,
                    mtime_ns: *mtime_ns,
                    blocks: blocks.clone(),
                    xattrs: xattrs.clone(),
                };
                entry.xattrs.clear();
            }
            Change::Symlink { target, .. } => {
                entry.now = Node::Symlink {
                    target: target.clone(),
                };
            }
            Change::Chmod {
                mode,
                mtime_ns,
                xattrs,
                ..
            } => {
                match &mut entry.now {
                    Node::File {
                        mode: m,
                        mtime_ns: t,
                        ..
                    } => {
                        *m = mode & MODE_MASK;
                        if let Some(ns) = mtime_ns {
                            *t = *ns;
                        }
                    }
                    Node::Dir { mode: m } => *m = mode & MODE_MASK,
                    Node::Absent | Node::Symlink { .. } => return,
                }
                if let Some(x) = xattrs {
                    entry
                        .xattrs
                        .extend(x.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
            }
        }
    }

    /// Write the map durably: temp file, fsync, rename, fsync of the directory.
    fn save(&self, st: &StageState) -> Result<(), StageError> {
        let bytes = serde_json::to_vec(st).map_err(|e| self.io("encoding", io::Error::other(e)))?;
        let tmp = self.dir.join(tmp_name());
        let written = (|| {
            let mut f = crate::private::file_options().truncate(true).open(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, self.dir.join(CHANGES_FILE))?;
            std::fs::File::open(&self.dir)?.sync_all()
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written.map_err(|e| self.io("saving the change set", e))
    }
}

/// A path's base, from the manifest, corrected by what the first change to it says the
/// Executor saw. They differ when the manifest was rebuilt (a restored export, after a
/// daemon restart) and the Delegator changed the path meanwhile: the Executor's view is
/// what its change is based on, so applying must find that there, or report a conflict.
fn declared_base(manifest: Node, change: &Change) -> Node {
    let file = |hash: &str, mode: u32| Node::File {
        hash: hash.to_owned(),
        size: 0,
        mode,
        mtime_ns: 0,
        blocks: Vec::new(),
        xattrs: None,
    };
    match (manifest, change) {
        // The Executor saw no file here.
        (_, Change::Write { base: None, .. }) => Node::Absent,
        (
            Node::File { hash, mode, .. },
            Change::Write { base: Some(b), .. } | Change::Unlink { base: Some(b), .. },
        ) if hash != *b => file(b, mode),
        (Node::Symlink { target }, Change::Unlink { base: Some(b), .. }) if target != *b => {
            Node::Symlink { target: b.clone() }
        }
        (
            Node::Absent | Node::Dir { .. } | Node::Symlink { .. },
            Change::Write { base: Some(b), .. },
        ) => file(b, 0o644),
        (Node::Absent | Node::Dir { .. }, Change::Unlink { base: Some(b), .. }) => {
            // A removal's base is a content hash for a file, a target for a symlink.
            if parse_hash(b).is_some() {
                file(b, 0o644)
            } else {
                Node::Symlink { target: b.clone() }
            }
        }
        (m, _) => m,
    }
}

fn internal(context: &'static str, source: io::Error) -> ApiError {
    ApiError::Internal { context, source }
}

/// After an apply or a discard: what was staged is the new base; a new generation begins.
fn rebase(st: &mut StageState) {
    rebase_except(st, &Default::default());
}

/// [`rebase`], but the paths in `kept` (writes the screen held) keep their base and state
/// now: they are still changes in the next generation.
fn rebase_except(st: &mut StageState, kept: &std::collections::HashSet<&str>) {
    st.paths
        .retain(|_, p| p.now != Node::Absent || p.base != Node::Absent);
    for (path, p) in st.paths.iter_mut() {
        if kept.contains(path.as_str()) {
            continue;
        }
        p.base = p.now.clone();
        p.xattrs.clear();
        if let Node::File { xattrs, .. } = &mut p.base {
            *xattrs = None;
        }
        p.now = p.base.clone();
    }
    st.generation += 1;
}

/// The net change set of `st`: removals of files and links, removals of directories
/// (deepest first), new directories (parents first), writes and links, then modes and
/// extended attributes.
fn plan_of(st: &StageState) -> ChangeSet {
    let changed: Vec<(&String, &StagedPath)> =
        st.paths.iter().filter(|(_, p)| p.changed()).collect();
    let mut changes = Vec::new();
    let same_kind = |a: &Node, b: &Node| std::mem::discriminant(a) == std::mem::discriminant(b);
    // 1. Files and links that go away or become something else.
    for (path, p) in &changed {
        let base = match &p.base {
            Node::File { hash, .. } => hash.clone(),
            Node::Symlink { target } => target.clone(),
            Node::Absent | Node::Dir { .. } => continue,
        };
        if !same_kind(&p.base, &p.now) {
            changes.push(Change::Unlink {
                path: (*path).clone(),
                base: Some(base),
            });
        }
    }
    // 2. Directories that go away, children first (a child sorts after its parent).
    for (path, p) in changed.iter().rev() {
        if matches!(p.base, Node::Dir { .. }) && !matches!(p.now, Node::Dir { .. }) {
            changes.push(Change::Rmdir {
                path: (*path).clone(),
            });
        }
    }
    // 3. New directories, parents first.
    for (path, p) in &changed {
        if let Node::Dir { mode } = p.now
            && !matches!(p.base, Node::Dir { .. })
        {
            changes.push(Change::Mkdir {
                path: (*path).clone(),
                mode,
            });
        }
    }
    // 4. Content.
    for (path, p) in &changed {
        match (&p.base, &p.now) {
            (
                base,
                Node::File {
                    hash,
                    size,
                    mode,
                    mtime_ns,
                    blocks,
                    xattrs,
                },
            ) => {
                let base_hash = match base {
                    Node::File { hash, .. } => Some(hash),
                    _ => None,
                };
                if base_hash == Some(hash) && xattrs.as_ref().is_none_or(|x| x.is_empty()) {
                    continue; // a mode change only: step 5
                }
                changes.push(Change::Write {
                    path: (*path).clone(),
                    mode: *mode,
                    base: base_hash.cloned(),
                    hash: hash.clone(),
                    size: *size,
                    blocks: blocks.clone(),
                    mtime_ns: *mtime_ns,
                    link_to: None,
                    xattrs: xattrs.clone(),
                });
            }
            (base, Node::Symlink { target }) if base != &p.now => {
                changes.push(Change::Symlink {
                    path: (*path).clone(),
                    target: target.clone(),
                });
            }
            _ => {}
        }
    }
    // 5. Modes of files and directories that stay what they were, and attributes.
    for (path, p) in &changed {
        let Some(mode) = p.now.mode() else { continue };
        // A rewritten file gets its mode with the write (step 4).
        let rewritten = matches!(
            (&p.base, &p.now),
            (Node::File { hash: a, .. }, Node::File { hash: b, .. }) if a != b
        );
        let mode_changed = same_kind(&p.base, &p.now) && !rewritten && p.base.mode() != Some(mode);
        if !mode_changed && p.xattrs.is_empty() {
            continue;
        }
        let (mtime_ns, base) = match (&p.base, &p.now) {
            (
                Node::File { hash: a, .. },
                Node::File {
                    hash: b, mtime_ns, ..
                },
            ) if a == b => (Some(*mtime_ns), Some(b.clone())),
            _ => (None, None),
        };
        changes.push(Change::Chmod {
            path: (*path).clone(),
            mode,
            mtime_ns,
            base,
            xattrs: (!p.xattrs.is_empty()).then(|| p.xattrs.clone()),
        });
    }
    ChangeSet {
        commit_id: format!("staged-{}", st.generation),
        changes,
        age_ms: None,
    }
}

/// The Delegator's file at `path` under `root`, if it is a regular file reached without
/// following a symlink, at most `limit` bytes; for showing a change set's diff.
pub fn read_tree_file(root: &Path, path: &str, limit: u64) -> io::Result<Option<Vec<u8>>> {
    let root = RootDir::open(root)?;
    let Ok(file) = root.open_file(path) else {
        return Ok(None);
    };
    if file.metadata()?.len() > limit {
        return Ok(None);
    }
    let mut out = Vec::new();
    (&file).take(limit + 1).read_to_end(&mut out)?;
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(hash: &str, mode: u32) -> Node {
        Node::File {
            hash: hash.into(),
            size: 1,
            mode,
            mtime_ns: 0,
            blocks: vec![hash.into()],
            xattrs: None,
        }
    }

    fn state(paths: &[(&str, Node, Node)]) -> StageState {
        StageState {
            generation: 0,
            paths: paths
                .iter()
                .map(|(p, b, n)| {
                    (
                        p.to_string(),
                        StagedPath {
                            base: b.clone(),
                            now: n.clone(),
                            xattrs: BTreeMap::new(),
                        },
                    )
                })
                .collect(),
        }
    }

    fn kinds(cs: &ChangeSet) -> Vec<String> {
        cs.changes
            .iter()
            .map(|c| {
                let k = match c {
                    Change::Mkdir { .. } => "mkdir",
                    Change::Rmdir { .. } => "rmdir",
                    Change::Write { .. } => "write",
                    Change::Unlink { .. } => "unlink",
                    Change::Symlink { .. } => "symlink",
                    Change::Chmod { .. } => "chmod",
                };
                format!("{k} {}", c.path())
            })
            .collect()
    }

    #[test]
    fn the_plan_orders_removals_before_creations_and_parents_first() {
        let st = state(&[
            ("a", Node::Dir { mode: 0o755 }, Node::Absent),
            ("a/f", file("1", 0o644), Node::Absent),
            ("b", Node::Absent, Node::Dir { mode: 0o755 }),
            ("b/c", Node::Absent, Node::Dir { mode: 0o700 }),
            ("b/c/g", Node::Absent, file("2", 0o600)),
            ("h", file("3", 0o644), file("4", 0o600)),
            ("m", file("5", 0o644), file("5", 0o755)),
            ("same", file("6", 0o644), file("6", 0o644)),
            ("l", file("7", 0o644), Node::Symlink { target: "h".into() }),
        ]);
        let plan = plan_of(&st);
        assert_eq!(
            kinds(&plan),
            [
                "unlink a/f",
                "unlink l",
                "rmdir a",
                "mkdir b",
                "mkdir b/c",
                "write b/c/g",
                "write h",
                "symlink l",
                "chmod m",
            ]
        );
        // A write carries the manifest's hash as its base, so a Delegator-side change is
        // a conflict; a new file carries none.
        let bases: Vec<_> = plan
            .changes
            .iter()
            .filter_map(|c| match c {
                Change::Write { path, base, .. } => Some((path.as_str(), base.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(bases, [("b/c/g", None), ("h", Some("3".to_string()))]);
    }

    #[test]
    fn the_base_is_what_the_executor_says_it_saw() {
        // The manifest was rebuilt after the Delegator changed `f` (a restored export): the
        // Executor's write is based on the old content, so that is the base to apply on.
        let m = file("new", 0o600);
        let w = |base: Option<&str>| Change::Write {
            path: "f".into(),
            mode: 0o644,
            base: base.map(str::to_owned),
            hash: "x".into(),
            size: 1,
            blocks: vec![],
            mtime_ns: 0,
            link_to: None,
            xattrs: None,
        };
        assert_eq!(declared_base(m.clone(), &w(Some("new"))), m);
        assert_eq!(
            declared_base(m.clone(), &w(Some("old"))),
            Node::File {
                hash: "old".into(),
                size: 0,
                mode: 0o600,
                mtime_ns: 0,
                blocks: vec![],
                xattrs: None
            }
        );
        assert_eq!(declared_base(m.clone(), &w(None)), Node::Absent);
        let unlink = |b: &str| Change::Unlink {
            path: "f".into(),
            base: Some(b.into()),
        };
        assert_eq!(
            declared_base(Node::Absent, &unlink("target")),
            Node::Symlink {
                target: "target".into()
            }
        );
        let hash = "ab".repeat(32);
        assert!(matches!(
            declared_base(Node::Absent, &unlink(&hash)),
            Node::File { .. }
        ));
        let mkdir = Change::Mkdir {
            path: "f".into(),
            mode: 0o755,
        };
        assert_eq!(declared_base(m.clone(), &mkdir), m);
    }

    #[test]
    fn after_a_rebase_nothing_is_left_to_apply() {
        let mut st = state(&[
            ("n", Node::Absent, file("1", 0o644)),
            ("gone", Node::Absent, Node::Absent),
        ]);
        rebase(&mut st);
        assert!(plan_of(&st).changes.is_empty());
        assert_eq!(st.generation, 1);
        assert!(!st.paths.contains_key("gone"));
        assert_eq!(st.paths["n"].base, file("1", 0o644));
    }
}
