//! Applying a change set from the Executor to the exported tree.
//!
//! A commit runs in four phases; the first three change nothing visible, so a refusal in
//! any of them leaves the tree exactly as it was:
//!
//! 1. **Validate** every path ([`validate_rel_path`], no `.awcp-tmp-*` component) and every
//!    hash, and refuse (400 `INVALID_PATH`) any change whose parent chain holds a symlink or a
//!    non-directory. The check runs against the tree *as the change set will have left it*
//!    so far (a small overlay of the kinds earlier changes create or remove), so
//!    `[symlink a → /etc, write a/passwd]` is refused as a whole, not half-applied.
//! 2. **Stage** every write: assemble its content from blocks (staging store, or verified
//!    reads from the tree) into `.awcp-tmp-<random>` in the target's directory (the root if
//!    that directory does not exist yet), check its size and hash, set mode and mtime; then
//!    make them durable before any is renamed into place (an `fsync` of each, all issued
//!    together, or for a commit of many files one `syncfs` per filesystem: see
//!    `Durability`). A missing block fails the commit with 409
//!    `MISSING_BLOCKS` listing all of them.
//! 3. **Check and apply** each change in the given order. The precondition of each change is
//!    checked right before it is applied, against the real tree, so earlier changes of the
//!    same set count. A failed precondition is a [`Conflict`], not an error: the change is
//!    skipped (a write's content is kept beside as `<name>.awcp-conflict-<tag>`, the tag being
//!    12 hex digits of the commit id's hash) and the rest
//!    of the set is still applied. An IO failure while applying is reported as a conflict
//!    too, so a commit never stops half-way with an error.
//! 4. **Index** the written files' blocks so they can be served.
//!
//! Safety does not rest on phase 1: every operation goes through [`RootDir`] and `*at`
//! calls that never follow a symlink, so even a tree that changes between phases cannot
//! redirect a write outside the root — at worst the change becomes a conflict.
//!
//! Modes from the Executor are masked with `0o1777`: permission bits and the sticky bit, but
//! never set-uid or set-gid, so an Executor cannot plant a privileged executable on the
//! Delegator's machine.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Seek, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use std::sync::Arc;

use awcp_protocol::dataplane::{
    Change, ChangeSet, CommitResult, Conflict, CurrentState, EntryKind, Held, validate_rel_path,
};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, readlinkat, renameat};
use nix::sys::stat::{
    FchmodatFlags, Mode, UtimensatFlags, fchmod, fchmodat, fstatat, futimens, mkdirat, utimensat,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{UnlinkatFlags, linkat, symlinkat, syncfs, unlinkat};

use super::Export;
use super::error::ApiError;
use super::manifest;
use super::rootfs::{FsError, NodeKind, RootDir, hash_file_at, kind_at, open_file_at, os};
use super::screen::{CommitScreen, MAX_SCREENED_BYTES, Screening, Watched};
use super::store::{BlockHash, BlockLoc, Stamp, TMP_PREFIX, hash_hex, parse_hash, tmp_name};

/// How many commit results are remembered for idempotent retries. A mount re-sends only
/// its last unanswered commit, so this is far more than one mount needs; it bounds what
/// several mounts (recoveries included) of one export can interleave.
const REMEMBERED_COMMITS: usize = 4096;
/// The file in an export's staging directory that keeps the remembered results, one JSON
/// line each, so a restarted export still answers a retry with the first outcome.
pub(crate) const COMMITS_FILE: &str = "commits.log";
/// Most changes in one commit.
pub(crate) const MAX_CHANGES: usize = 100_000;
/// Longest commit id accepted.
pub(crate) const MAX_COMMIT_ID: usize = 256;
/// Longest symlink target accepted (Linux `PATH_MAX` minus the NUL).
const MAX_TARGET: usize = 4095;
/// The conflict reason of a change to a path the export hides.
pub(crate) const HIDDEN_REASON: &str =
    "hidden by the export (excluded or sensitive): not written to the Delegator";
/// Mode bits an Executor may set: permissions and sticky, never set-uid/set-gid.
pub(crate) const MODE_MASK: u32 = 0o1777;

/// Results of recent commits, for answering retries without applying twice: in memory,
/// and appended to [`COMMITS_FILE`] when the log has one.
#[derive(Debug)]
pub(crate) struct CommitLog {
    recent: VecDeque<CommitResult>,
    file: Option<CommitFile>,
    /// How many results are kept ([`REMEMBERED_COMMITS`]).
    cap: usize,
}

impl Default for CommitLog {
    fn default() -> Self {
        CommitLog {
            recent: VecDeque::new(),
            file: None,
            cap: REMEMBERED_COMMITS,
        }
    }
}

/// The durable side of a [`CommitLog`].
#[derive(Debug)]
struct CommitFile {
    path: std::path::PathBuf,
    file: File,
    /// Lines in the file (rewritten with only the remembered ones when it doubles).
    lines: usize,
}

impl CommitLog {
    /// The log kept in `dir` (an export's staging directory): the results it remembers
    /// from before (an export registered again after a restart), and appended to from now
    /// on. A torn last line (a crash mid-append) is ignored. When the file cannot be
    /// opened the log lives in memory only, with a warning.
    pub(crate) fn open(dir: &std::path::Path) -> CommitLog {
        Self::open_capped(dir, REMEMBERED_COMMITS)
    }

    fn open_capped(dir: &std::path::Path, cap: usize) -> CommitLog {
        let path = dir.join(COMMITS_FILE);
        let mut log = CommitLog {
            cap,
            ..CommitLog::default()
        };
        let mut lines = 0;
        match std::fs::read(&path) {
            Ok(bytes) => {
                for line in bytes.split(|b| *b == b'\n') {
                    if let Ok(r) = serde_json::from_slice::<CommitResult>(line) {
                        log.push(r);
                        lines += 1;
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e,
                    "cannot read the commit log: retries of earlier commits will be judged again");
            }
        }
        // Private: the outcomes name the workspace's paths.
        match crate::private::file_options().append(true).open(&path) {
            Ok(file) => log.file = Some(CommitFile { path, file, lines }),
            Err(e) => tracing::warn!(path = %path.display(), error = %e,
                "cannot open the commit log: commit outcomes are remembered in memory only"),
        }
        log
    }

    /// The highest change sequence among the remembered results.
    pub(crate) fn max_seq(&self) -> Option<u64> {
        self.recent.iter().filter_map(|r| r.seq).max()
    }

    fn push(&mut self, result: CommitResult) {
        if self.recent.len() >= self.cap {
            self.recent.pop_front();
        }
        self.recent.push_back(result);
    }

    /// Append `result` to the file (synced before the commit is answered, so an answer a
    /// client saw is never forgotten), compacting it once it holds twice what is kept.
    fn persist(&mut self, result: &CommitResult) -> io::Result<()> {
        let Some(f) = &mut self.file else {
            return Ok(());
        };
        if f.lines >= 2 * self.cap {
            let tmp = f.path.with_extension("log.tmp");
            let mut buf = Vec::new();
            for r in &self.recent {
                serde_json::to_writer(&mut buf, r).map_err(io::Error::other)?;
                buf.push(b'\n');
            }
            let mut out = crate::private::file_options().truncate(true).open(&tmp)?;
            out.write_all(&buf)?;
            out.sync_data()?;
            std::fs::rename(&tmp, &f.path)?;
            f.file = std::fs::OpenOptions::new().append(true).open(&f.path)?;
            f.lines = self.recent.len();
            // `result` is already among the remembered ones: written above.
            return Ok(());
        }
        let mut line = serde_json::to_vec(result).map_err(io::Error::other)?;
        line.push(b'\n');
        f.file.write_all(&line)?;
        f.file.sync_data()?;
        f.lines += 1;
        Ok(())
    }

    /// The result of an earlier commit with this id.
    pub(crate) fn find(&self, commit_id: &str) -> Option<CommitResult> {
        self.recent
            .iter()
            .find(|r| r.commit_id == commit_id)
            .cloned()
    }

    /// Remember a result (in memory, and durably when the log has a file).
    pub(crate) fn remember(&mut self, result: CommitResult) {
        self.push(result.clone());
        if let Err(e) = self.persist(&result) {
            // The commit is applied either way; a retry after a restart is then judged
            // again (its changes mostly as no-ops), which is what happened before the log.
            tracing::warn!(commit = %result.commit_id, error = %e,
                "cannot append to the commit log");
        }
    }
}

/// Commit `cs` to the export's sink (blocking IO): the tree itself, or, for an export that
/// stages its commits, the change set kept beside it (see `stage`). The caller serialises
/// commits.
pub(crate) fn run(export: &Export, cs: &ChangeSet) -> Result<CommitResult, ApiError> {
    match export.stage.get() {
        Some(stage) => {
            check_set(cs)?;
            stage.record(export, cs)
        }
        None => run_live(export, cs),
    }
}

/// The limits of any change set: a usable commit id and at most [`MAX_CHANGES`] changes.
fn check_set(cs: &ChangeSet) -> Result<(), ApiError> {
    if cs.commit_id.is_empty() || cs.commit_id.len() > MAX_COMMIT_ID {
        return Err(ApiError::bad_body(
            "POST /commit",
            format!("commitId must be 1 to {MAX_COMMIT_ID} bytes"),
        ));
    }
    if cs.changes.len() > MAX_CHANGES {
        return Err(ApiError::TooMany {
            what: "changes in one commit",
            count: cs.changes.len(),
            max: MAX_CHANGES,
        });
    }
    Ok(())
}

/// Apply `cs` to the export's tree (blocking IO). The caller serialises commits.
pub(crate) fn run_live(export: &Export, cs: &ChangeSet) -> Result<CommitResult, ApiError> {
    check_set(cs)?;
    let root = &export.blocks.root;
    // The watcher waits while a commit writes, and finds its files noted as ours after.
    let _quiet = export.feed.quiet.lock();
    // Paths the export hides (excluded or sensitive) are never written: such a change is
    // answered as a conflict, kept nowhere, and the rest of the set applies. Refusing the
    // whole set would leave every other change of the round unsynced because a tool wrote,
    // say, a `*.pem` inside a virtualenv; writing it could clobber a file the Executor was
    // never shown.
    let (cs, hidden) = split_hidden(export, cs);
    let cs = &cs;
    let writes = validate(root, &cs.changes)?;
    let mut durable = Durability::new(writes.len());
    durable.note(root.fd());
    let mut staged = stage(export, &cs.changes, &writes, &mut durable)?;
    // Every staged file's data reaches the disk before any rename makes it visible (each
    // staged file is fsynced now, all together, or with one syncfs per filesystem).
    durable
        .sync_staged()
        .map_err(|e| internal("syncing staged files", e))?;

    let tag = conflict_tag(&cs.commit_id);
    let mut applied = 0u64;
    let mut conflicts = Vec::new();
    let mut held: Vec<Held> = Vec::new();
    let mut written: Vec<Written> = Vec::new();
    // Changes other than writes that were not applied (the Delegator's state stays there
    // and nothing of the change is kept), and `chmod`s applied to content other than their
    // base: the answer describes what is there now.
    let mut lost: Vec<&Change> = Vec::new();
    let screen = screening(export, &cs.changes);
    for (i, change) in cs.changes.iter().enumerate() {
        if let (Some(sc), Some(s)) = (&screen, staged.get(&i))
            && let Some(h) = screen_write(export, sc, change, s)
        {
            tracing::warn!(export = %export.id, commit = %cs.commit_id, path = %h.path, reason = %h.reason, "write held by the commit screen");
            held.push(h);
            continue;
        }
        let outcome = match change {
            Change::Write { .. } => match staged.get_mut(&i) {
                Some(s) => apply_write(root, change, s, &tag, &mut written, &mut durable),
                // Unreachable: every write was staged; refuse rather than panic.
                None => Err(FsError::BadComponent {
                    path: change.path().to_owned(),
                }),
            },
            other => apply_other(root, other, &mut durable),
        };
        match outcome {
            Ok(Outcome::Applied) => {
                applied += 1;
                if let Change::Chmod {
                    path,
                    base: Some(base),
                    mtime_ns: None,
                    ..
                } = change
                    && content_moved(export, path, base)
                {
                    // The mode landed on content the mount did not base it on (the
                    // Delegator rewrote the file): the answer describes what is there.
                    lost.push(change);
                }
            }
            Ok(Outcome::Conflict { reason, kept_as }) => {
                if !matches!(change, Change::Write { .. }) {
                    lost.push(change);
                }
                let c = Conflict {
                    path: change.path().to_owned(),
                    reason,
                    kept_as,
                };
                tracing::warn!(export = %export.id, commit = %cs.commit_id, path = %c.path, reason = %c.reason, kept_as = ?c.kept_as, "commit conflict");
                export.stats.record_conflict(&c);
                conflicts.push(c);
            }
            Err(e) => {
                if !matches!(change, Change::Write { .. }) {
                    lost.push(change);
                }
                let c = Conflict {
                    path: change.path().to_owned(),
                    reason: format!("not applied: {}", chain(&e)),
                    kept_as: None,
                };
                tracing::warn!(export = %export.id, commit = %cs.commit_id, path = %c.path, reason = %c.reason, "change failed");
                export.stats.record_conflict(&c);
                conflicts.push(c);
            }
        }
    }
    drop(staged); // unlinks any temp file not consumed
    // The renames, links, removals and new directories reach the disk before the answer.
    // Should this fail, the client retries and the export answers what was applied as
    // no-ops.
    durable
        .sync_applied()
        .map_err(|e| internal("syncing the applied changes", e))?;

    let mut index = export.blocks.index.write();
    for Written { path, blocks, size } in &written {
        let path: std::sync::Arc<str> = std::sync::Arc::from(path.as_str());
        let mut offset = 0u64;
        for (hash, len) in blocks {
            index.insert(
                *hash,
                BlockLoc {
                    path: path.clone(),
                    offset,
                    len: *len,
                },
            );
            offset += u64::from(*len);
        }
        super::Stats::add(&export.stats.files_written, 1);
        super::Stats::add(&export.stats.bytes_written, *size);
    }
    drop(index);
    let current = describe_current(export, &lost);
    // Held paths are unchanged on the export: nothing to describe to mounts there. A mode
    // set on content the Delegator rewrote is left to the watcher too, which then describes
    // that content (with the new mode) to every mount, instead of taking the file as the
    // commit's own.
    let unchanged: Vec<Conflict> = conflicts
        .iter()
        .cloned()
        .chain(held.iter().map(|h| Conflict {
            path: h.path.clone(),
            reason: h.reason.clone(),
            kept_as: None,
        }))
        .chain(lost.iter().map(|c| Conflict {
            path: c.path().to_owned(),
            reason: String::new(),
            kept_as: None,
        }))
        .collect();
    let seq = export
        .feed
        .note_commit(root, &cs.changes, &unchanged, |p| export.manifest_entry(p));
    for h in &hidden {
        tracing::warn!(export = %export.id, path = %h.path, "a change to a hidden path was not written");
    }
    conflicts.extend(hidden);
    super::Stats::add(&export.stats.commits, 1);
    tracing::info!(export = %export.id, commit = %cs.commit_id, applied, conflicts = conflicts.len(), held = held.len(), "commit applied");
    Ok(CommitResult {
        commit_id: cs.commit_id.clone(),
        applied,
        conflicts,
        seq: Some(seq),
        held,
        current,
    })
}

/// Most entries [`describe_current`] gives one path (a directory with a larger subtree is
/// not described: the mount waits for its `changed` events instead).
const MAX_CURRENT_ENTRIES: usize = super::watch::MAX_EVENT_ENTRIES;

/// What the tree holds now at the paths of `lost` changes (not applied, nothing of them
/// kept), for the commit's answer ([`CommitResult::current`]): each path's entry as the
/// manifest lists it — with its subtree for a refused `rmdir` —, or its removal. A path
/// that cannot be described is left out; so is a directory found where the change was not
/// an `rmdir` (it is described only with its subtree, which may be large), and one whose
/// subtree has more than [`MAX_CURRENT_ENTRIES`] entries.
fn describe_current(export: &Export, lost: &[&Change]) -> Option<CurrentState> {
    if lost.is_empty() {
        return None;
    }
    let root = &export.blocks.root;
    let params = super::watch::params_of(export);
    let mut out = CurrentState::default();
    for change in lost {
        let path = change.path();
        let deep = matches!(change, Change::Rmdir { .. });
        let built = match manifest::describe(root, &params, None, &[(path.to_owned(), deep)]) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(path, error = %e, "cannot describe a conflicting path");
                continue;
            }
        };
        let entries = built.manifest.entries;
        match entries.first() {
            Some(e) if e.path == path => {
                if (e.kind == EntryKind::Dir && !deep) || entries.len() > MAX_CURRENT_ENTRIES {
                    continue;
                }
                // Its blocks are served from now on (the watcher would add them later).
                export.blocks.index.write().merge(built.index);
                out.entries.extend(entries);
            }
            // Not described: absent, or there but hidden or unreadable (only a path that
            // is really gone counts as removed).
            _ => {
                if is_absent(root, path) {
                    out.removed.push(path.to_owned());
                }
            }
        }
    }
    // Parents before children, each path once (a file whose removal was refused may also
    // lie in a directory whose removal was).
    out.entries.sort_by(|a, b| a.path.cmp(&b.path));
    out.entries.dedup_by(|a, b| a.path == b.path);
    out.removed.sort();
    out.removed.dedup();
    (!out.is_empty()).then_some(out)
}

/// Whether the regular file at `path` holds content other than `base` (hex): the feed's
/// record answers when it knows the file with that content and the file's size and
/// modification time still match it; otherwise the file is hashed.
fn content_moved(export: &Export, path: &str, base: &str) -> bool {
    let Ok((dir, name)) = export.blocks.root.open_parent(path) else {
        return false;
    };
    let name = os(name);
    let Ok(st) = fstatat(&dir, &*name, AtFlags::AT_SYMLINK_NOFOLLOW) else {
        return false;
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return false;
    }
    let stamp = Stamp::of(&st);
    if export.feed.known_file(path) == Some((base.to_owned(), stamp.size, stamp.mtime_ns)) {
        return false;
    }
    hash_file_at(dir.as_fd(), &name, path).is_ok_and(|h| h.to_hex().as_str() != base)
}

/// Whether nothing is at `path` (nor at one of its parents).
fn is_absent(root: &RootDir, path: &str) -> bool {
    match root.open_parent(path) {
        Ok((dir, name)) => matches!(kind_at(dir.as_fd(), &os(name), path), Ok(NodeKind::Absent)),
        Err(e) => e.is_not_found(),
    }
}

/// The export's screen, its worker and what it watches in this commit; `None` when there is
/// no screen, the commit writes nothing, or the screen watches nothing.
fn screening(export: &Export, changes: &[Change]) -> Option<ScreenRound> {
    if !changes.iter().any(|c| matches!(c, Change::Write { .. })) {
        return None;
    }
    let (worker, screen) = export.screen()?;
    let watched = screen.watched(&worker);
    (!watched.is_empty()).then_some((worker, screen, watched))
}

/// A screen's state for one commit: its worker, itself, what it watches.
type ScreenRound = (String, Arc<dyn CommitScreen>, Watched);

/// Asks the screen about one staged write it watches; `Some` when it holds it. A staged file
/// that cannot be read, or is larger than [`MAX_SCREENED_BYTES`], passes (with a warning):
/// the screen checks modules, it never loses a write.
fn screen_write(
    export: &Export,
    (worker, screen, watched): &ScreenRound,
    change: &Change,
    staged: &Staged,
) -> Option<Held> {
    let Change::Write { path, .. } = change else {
        return None;
    };
    if !watched.covers(path) {
        return None;
    }
    if staged.size > MAX_SCREENED_BYTES {
        tracing::warn!(export = %export.id, path = %path, size = staged.size, "a screened file is too large to check: applied unscreened");
        return None;
    }
    let read = open_file_at(staged.dir.as_fd(), &os(&staged.name), path).and_then(|mut f| {
        let mut buf = Vec::with_capacity(staged.size as usize);
        io::Read::read_to_end(&mut f, &mut buf)
            .map(|_| buf)
            .map_err(|e| FsError::Io {
                op: "read",
                path: path.clone(),
                source: e,
            })
    });
    let content = match read {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(export = %export.id, path = %path, error = %e, "cannot read a staged file for the screen: applied unscreened");
            return None;
        }
    };
    match screen.screen(worker, path, &content) {
        Screening::Pass => None,
        Screening::Hold { reason, report } => Some(Held {
            path: path.clone(),
            reason,
            report,
        }),
    }
}

/// The changes of `cs` the export shows, and a conflict for each one it hides.
pub(crate) fn split_hidden(export: &Export, cs: &ChangeSet) -> (ChangeSet, Vec<Conflict>) {
    let Some(f) = &export.filter else {
        return (cs.clone(), Vec::new());
    };
    let mut shown = Vec::with_capacity(cs.changes.len());
    let mut hidden = Vec::new();
    for c in &cs.changes {
        let is_dir = matches!(c, Change::Mkdir { .. } | Change::Rmdir { .. });
        if f.shows(c.path(), is_dir) {
            shown.push(c.clone());
        } else {
            hidden.push(Conflict {
                path: c.path().to_owned(),
                reason: HIDDEN_REASON.into(),
                kept_as: None,
            });
        }
    }
    let visible = ChangeSet {
        commit_id: cs.commit_id.clone(),
        changes: shown,
        age_ms: cs.age_ms,
    };
    (visible, hidden)
}

/// A file a commit wrote, for the block index and the counters.
struct Written {
    path: String,
    blocks: Vec<(BlockHash, u32)>,
    size: u64,
}

impl Written {
    fn of(path: String, staged: &Staged) -> Written {
        Written {
            path,
            blocks: staged.blocks.clone(),
            size: staged.size,
        }
    }
}

/// A write's content, parsed.
#[derive(Debug)]
pub(crate) struct WritePlan {
    pub(crate) hash: BlockHash,
    pub(crate) blocks: Vec<BlockHash>,
}

/// The kinds the change set will have left along its way, over the real tree.
struct Overlay<'r> {
    root: &'r RootDir,
    known: HashMap<String, NodeKind>,
    /// Directories this commit creates (empty until it fills them).
    created: std::collections::HashSet<String>,
}

impl Overlay<'_> {
    fn kind(&mut self, rel: &str) -> Result<NodeKind, ApiError> {
        if let Some(k) = self.known.get(rel) {
            return Ok(*k);
        }
        // Below a directory this commit creates or removes, nothing exists yet: the real
        // tree may still hold a file at that prefix, which an earlier change replaces.
        for (end, _) in rel.match_indices('/') {
            let prefix = &rel[..end];
            if self.created.contains(prefix) || self.known.get(prefix) == Some(&NodeKind::Absent) {
                return Ok(NodeKind::Absent);
            }
        }
        let k = match self.root.kind(rel) {
            Ok(k) => k,
            Err(e @ (FsError::SymlinkInPath { .. } | FsError::NotDir { .. })) => {
                return Err(ApiError::InvalidPath {
                    reason: e.to_string(),
                });
            }
            Err(source) => {
                return Err(ApiError::Fs {
                    context: "checking the commit's paths",
                    source,
                });
            }
        };
        self.known.insert(rel.to_owned(), k);
        Ok(k)
    }
}

/// Most extended attributes in one change.
const MAX_XATTRS: usize = 1024;
/// Longest extended attribute value (the kernel's `XATTR_SIZE_MAX`).
const MAX_XATTR_VALUE: usize = 64 * 1024;

/// Extended attributes from the Executor: `user.*` names of at most 255 bytes without NUL,
/// hex values of at most 64 KiB, at most 1,024 per change.
fn check_xattrs<'a>(
    path: &str,
    attrs: impl ExactSizeIterator<Item = (&'a String, Option<&'a String>)>,
) -> Result<(), ApiError> {
    let bad = |why: String| ApiError::bad_body("POST /commit", format!("{path:?}: {why}"));
    if attrs.len() > MAX_XATTRS {
        return Err(bad(format!("more than {MAX_XATTRS} extended attributes")));
    }
    for (name, value) in attrs {
        if !name.starts_with("user.") || name.len() <= 5 || name.len() > 255 || name.contains('\0')
        {
            return Err(bad(format!(
                "extended attribute {name:?}: only user.* names of at most 255 bytes"
            )));
        }
        if let Some(v) = value
            && (v.len() > 2 * MAX_XATTR_VALUE || hex::decode(v).is_err())
        {
            return Err(bad(format!(
                "extended attribute {name:?}: the value must be hex of at most 64 KiB"
            )));
        }
    }
    Ok(())
}

/// Set (or with `None`, remove) extended attributes on an open file or directory. Failures
/// (a Delegator filesystem without user xattrs, a full inode) are logged, not fatal: the
/// content matters more than its attributes.
fn apply_xattrs<'a>(
    fd: BorrowedFd<'_>,
    path: &str,
    attrs: impl Iterator<Item = (&'a String, Option<&'a String>)>,
) {
    for (name, value) in attrs {
        let result = match value.map(hex::decode) {
            Some(Ok(v)) => {
                rustix::fs::fsetxattr(fd, name.as_str(), &v, rustix::fs::XattrFlags::empty())
            }
            Some(Err(_)) => continue, // refused in phase 1
            None => match rustix::fs::fremovexattr(fd, name.as_str()) {
                Err(rustix::io::Errno::NODATA) => Ok(()),
                other => other,
            },
        };
        if let Err(e) = result {
            tracing::warn!(path, name = %name, error = %e, "cannot set an extended attribute on the export");
        }
    }
}

/// The checks of one change that need no tree: its path and `linkTo` (well-formed, no
/// reserved `.awcp-tmp-*` component), extended attributes, a symlink's target, and a
/// write's hashes (returned parsed). Shared by the live and the staged commit.
pub(crate) fn check_change(change: &Change) -> Result<Option<WritePlan>, ApiError> {
    let path = change.path();
    validate_rel_path(path).map_err(|e| ApiError::InvalidPath {
        reason: e.to_string(),
    })?;
    if path.split('/').any(|c| c.starts_with(TMP_PREFIX)) {
        return Err(ApiError::InvalidPath {
            reason: format!("{path:?} uses the reserved name prefix `{TMP_PREFIX}`"),
        });
    }
    match change {
        Change::Write {
            xattrs: Some(x), ..
        } => check_xattrs(path, x.iter().map(|(k, v)| (k, Some(v))))?,
        Change::Chmod {
            xattrs: Some(x), ..
        } => check_xattrs(path, x.iter().map(|(k, v)| (k, v.as_ref())))?,
        _ => {}
    }
    match change {
        // Checked on the bytes it stands for (a target that is not UTF-8 is held escaped:
        // see `awcp_protocol::rawname`).
        Change::Symlink { target, .. }
            if awcp_protocol::rawname::decode(target)
                .as_deref()
                .map_or(true, |t| {
                    t.is_empty() || t.contains(&0) || t.len() > MAX_TARGET
                }) =>
        {
            Err(ApiError::bad_body(
                "POST /commit",
                format!("symlink {path:?}: target must be 1 to {MAX_TARGET} bytes without NUL"),
            ))
        }
        Change::Write {
            base,
            hash,
            blocks,
            link_to,
            ..
        } => {
            if let Some(src) = link_to {
                validate_rel_path(src).map_err(|e| ApiError::InvalidPath {
                    reason: format!("linkTo of {path:?}: {e}"),
                })?;
                if src.split('/').any(|c| c.starts_with(TMP_PREFIX)) {
                    return Err(ApiError::InvalidPath {
                        reason: format!(
                            "linkTo {src:?} uses the reserved name prefix `{TMP_PREFIX}`"
                        ),
                    });
                }
            }
            if let Some(b) = base {
                parse_hash(b).ok_or_else(|| ApiError::bad_hash(b))?;
            }
            Ok(Some(WritePlan {
                hash: parse_hash(hash).ok_or_else(|| ApiError::bad_hash(hash))?,
                blocks: blocks
                    .iter()
                    .map(|b| parse_hash(b).ok_or_else(|| ApiError::bad_hash(b)))
                    .collect::<Result<_, _>>()?,
            }))
        }
        _ => Ok(None),
    }
}

/// Phase 1: paths, hashes, and parent chains; returns the parsed writes by change index.
fn validate(root: &RootDir, changes: &[Change]) -> Result<HashMap<usize, WritePlan>, ApiError> {
    let mut overlay = Overlay {
        root,
        known: HashMap::new(),
        created: Default::default(),
    };
    let mut writes = HashMap::new();
    for (i, change) in changes.iter().enumerate() {
        let path = change.path();
        let plan = check_change(change)?;
        // Parent chain: each existing prefix must be a real directory.
        for (end, _) in path.match_indices('/') {
            let prefix = &path[..end];
            match overlay.kind(prefix)? {
                NodeKind::Dir => {}
                NodeKind::Absent => break,
                NodeKind::Symlink => {
                    return Err(ApiError::InvalidPath {
                        reason: format!(
                            "{path:?} escapes the export: `{prefix}` is a symlink, and the export never writes through symlinks"
                        ),
                    });
                }
                found @ (NodeKind::File | NodeKind::Special) => {
                    return Err(ApiError::InvalidPath {
                        reason: format!(
                            "{path:?}: `{prefix}` is {}, not a directory",
                            found.describe()
                        ),
                    });
                }
            }
        }
        let current = overlay.kind(path)?;
        let after =
            match change {
                Change::Mkdir { .. } => (current == NodeKind::Absent).then_some(NodeKind::Dir),
                Change::Rmdir { .. } => (current == NodeKind::Dir).then_some(NodeKind::Absent),
                Change::Unlink { .. } => matches!(current, NodeKind::File | NodeKind::Symlink)
                    .then_some(NodeKind::Absent),
                Change::Symlink { .. } => matches!(current, NodeKind::Absent | NodeKind::Symlink)
                    .then_some(NodeKind::Symlink),
                Change::Chmod { .. } => None,
                Change::Write { .. } => {
                    if let Some(plan) = plan {
                        writes.insert(i, plan);
                    }
                    matches!(current, NodeKind::Absent | NodeKind::File).then_some(NodeKind::File)
                }
            };
        if let Some(k) = after {
            if matches!(change, Change::Mkdir { .. }) {
                overlay.created.insert(path.to_owned());
            }
            overlay.known.insert(path.to_owned(), k);
        }
    }
    Ok(writes)
}

/// A write's content in a temp file, unlinked on drop unless moved into place.
struct Staged {
    dir: OwnedFd,
    name: String,
    blocks: Vec<(BlockHash, u32)>,
    size: u64,
    mode: u32,
    mtime_ns: i64,
    consumed: bool,
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.consumed {
            let _ = unlinkat(&self.dir, self.name.as_str(), UnlinkatFlags::NoRemoveDir);
        }
    }
}

/// Whether block `h` of `len` bytes is all zeros, by its (verified) hash: no scan of the
/// data. `cache` keeps the hash of a zero block per length.
fn is_zero_block(cache: &mut HashMap<usize, BlockHash>, h: &BlockHash, len: usize) -> bool {
    let zero = cache
        .entry(len)
        .or_insert_with(|| *blake3::hash(&vec![0u8; len]).as_bytes());
    zero == h
}

/// Phase 2: assemble every write's content.
fn stage(
    export: &Export,
    changes: &[Change],
    writes: &HashMap<usize, WritePlan>,
    durable: &mut Durability,
) -> Result<HashMap<usize, Staged>, ApiError> {
    let root = &export.blocks.root;
    let mut staged = HashMap::new();
    let mut missing: Vec<String> = Vec::new();
    let mut zero_hashes: HashMap<usize, BlockHash> = HashMap::new();
    for (i, change) in changes.iter().enumerate() {
        let (
            Change::Write {
                path,
                mode,
                size,
                mtime_ns,
                ..
            },
            Some(plan),
        ) = (change, writes.get(&i))
        else {
            continue;
        };
        let dir = match root.open_parent(path) {
            Ok((dir, _)) => dir,
            // The parent does not exist yet, or is a file an earlier change of this commit
            // replaces with a directory (validation checked the whole set): stage in the
            // root and move the file into place when its turn comes.
            Err(e) if e.is_not_found() => dup_root(root)?,
            Err(FsError::NotDir { .. }) => dup_root(root)?,
            Err(e @ FsError::SymlinkInPath { .. }) => {
                return Err(ApiError::InvalidPath {
                    reason: e.to_string(),
                });
            }
            Err(source) => {
                return Err(ApiError::Fs {
                    context: "staging a write",
                    source,
                });
            }
        };
        durable.note(dir.as_fd());
        let name = tmp_name();
        let fd = openat(
            &dir,
            name.as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| internal("creating a temp file", e.into()))?;
        let mut s = Staged {
            dir,
            name,
            blocks: Vec::with_capacity(plan.blocks.len()),
            size: 0,
            mode: mode & MODE_MASK,
            mtime_ns: *mtime_ns,
            consumed: false,
        };
        let mut file = File::from(fd);
        let mut hasher = blake3::Hasher::new();
        let mut complete = true;
        for h in &plan.blocks {
            match export.read_block(h) {
                Some(data) => {
                    // A block of zeros becomes a hole: a sparse file on the Executor stays
                    // sparse here (the length is fixed after the last block).
                    if is_zero_block(&mut zero_hashes, h, data.len()) {
                        file.seek(io::SeekFrom::Current(data.len() as i64))
                            .map_err(|e| internal("writing a staged file", e))?;
                    } else {
                        file.write_all(&data)
                            .map_err(|e| internal("writing a staged file", e))?;
                    }
                    hasher.update(&data);
                    // Blocks are at most MAX_BLOCK_SIZE or an upload frame (u32 length).
                    s.blocks
                        .push((*h, u32::try_from(data.len()).unwrap_or(u32::MAX)));
                    s.size += data.len() as u64;
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
        if complete {
            file.set_len(s.size)
                .map_err(|e| internal("writing a staged file", e))?;
            let actual = hasher.finalize();
            if actual.as_bytes() != &plan.hash || s.size != *size {
                return Err(ApiError::ChecksumMismatch {
                    what: format!(
                        "file {path:?} ({} bytes announced, {} assembled)",
                        size, s.size
                    ),
                    expected: hash_hex(&plan.hash),
                    actual: actual.to_hex().to_string(),
                });
            }
            finish_temp(&file, s.mode, s.mtime_ns)
                .map_err(|e| internal("finishing a staged file", e))?;
            if let Change::Write {
                xattrs: Some(x), ..
            } = change
            {
                apply_xattrs(file.as_fd(), path, x.iter().map(|(k, v)| (k, Some(v))));
            }
            durable.staged(file);
        }
        staged.insert(i, s);
    }
    if !missing.is_empty() {
        return Err(ApiError::MissingBlocks { hashes: missing });
    }
    Ok(staged)
}

/// Mode, mtime and durability of a staged file, before it is renamed into place.
fn finish_temp(file: &File, mode: u32, mtime_ns: i64) -> io::Result<()> {
    fchmod(file, Mode::from_bits_truncate(mode))?;
    let mtime = TimeSpec::new(
        mtime_ns.div_euclid(1_000_000_000),
        mtime_ns.rem_euclid(1_000_000_000),
    );
    futimens(file, &TimeSpec::UTIME_OMIT, &mtime)?;
    Ok(())
}

/// Commits with more written files than this sync whole filesystems instead of each file.
const BULK_WRITES: usize = 128;

/// How a commit makes its changes durable. A commit of a few files fsyncs each file it
/// staged and each directory it changed: its cost does not depend on what else is written
/// to the Delegator's filesystem. The files are synced together once all are staged, and
/// the directories together once all changes are applied (`crate::durable::sync_together`:
/// one journal commit for all of them, not one each). A bulk commit (over [`BULK_WRITES`]
/// files) uses one `syncfs(2)` per filesystem after staging and one after applying: two
/// `fsync`s per file cost about 27 ms each on a virtual disk, which made write-backs of
/// thousands of files miss their deadline.
struct Durability {
    /// Whether this commit syncs whole filesystems.
    bulk: bool,
    /// Each directory changed, by (`st_dev`, `st_ino`).
    dirs: HashMap<(u64, u64), File>,
    /// The files staged, to sync before any is renamed into place (not for a bulk commit).
    staged: Vec<File>,
}

impl Durability {
    fn new(writes: usize) -> Durability {
        Durability {
            bulk: writes > BULK_WRITES,
            dirs: HashMap::new(),
            staged: Vec::new(),
        }
    }

    /// Remember a directory the commit changes.
    fn note(&mut self, dir: BorrowedFd<'_>) {
        let Ok(st) = nix::sys::stat::fstat(dir) else {
            return;
        };
        if let std::collections::hash_map::Entry::Vacant(v) =
            self.dirs.entry((st.st_dev, st.st_ino))
            && let Ok(fd) = dir.try_clone_to_owned()
        {
            v.insert(File::from(fd));
        }
    }

    /// Remember a file staged (complete, mode and times set), to sync in
    /// [`Durability::sync_staged`].
    fn staged(&mut self, file: File) {
        if !self.bulk {
            self.staged.push(file);
        }
    }

    /// After staging: the staged data is on disk.
    fn sync_staged(&mut self) -> io::Result<()> {
        if self.bulk {
            return self.syncfs();
        }
        let files = std::mem::take(&mut self.staged);
        let targets: Vec<(&File, bool)> = files.iter().map(|f| (f, true)).collect();
        crate::durable::sync_together(&targets)
    }

    /// After applying: the directories (renames, links, removals) are on disk.
    fn sync_applied(&self) -> io::Result<()> {
        if self.bulk {
            return self.syncfs();
        }
        let targets: Vec<(&File, bool)> = self.dirs.values().map(|d| (d, true)).collect();
        crate::durable::sync_together(&targets)
    }

    /// One `syncfs` per filesystem noted.
    fn syncfs(&self) -> io::Result<()> {
        let mut done = std::collections::HashSet::new();
        for ((dev, _), fd) in &self.dirs {
            if done.insert(*dev) {
                syncfs(fd).map_err(io::Error::from)?;
            }
        }
        Ok(())
    }
}

fn internal(context: &'static str, source: io::Error) -> ApiError {
    ApiError::Internal { context, source }
}

fn dup_root(root: &RootDir) -> Result<OwnedFd, ApiError> {
    root.fd()
        .try_clone_to_owned()
        .map_err(|e| internal("opening the root", e))
}

/// What became of one change.
enum Outcome {
    Applied,
    Conflict {
        reason: String,
        kept_as: Option<String>,
    },
}

fn conflict(reason: impl Into<String>) -> Outcome {
    Outcome::Conflict {
        reason: reason.into(),
        kept_as: None,
    }
}

/// The tag in conflict copy names: 12 hex digits of the commit id's hash, filename-safe.
fn conflict_tag(commit_id: &str) -> String {
    // A hash, not a prefix: one Executor's commit ids share their prefix, and every
    // conflict must keep its own copy.
    blake3::hash(commit_id.as_bytes()).to_hex()[..12].to_string()
}

fn fs_io(op: &'static str, path: &str, e: Errno) -> FsError {
    FsError::Io {
        op,
        path: path.to_owned(),
        source: e.into(),
    }
}

/// Open the parent of `path`, or say why the change cannot be applied there.
enum Parent<'p> {
    Open(OwnedFd, &'p str),
    Missing(FsError),
}

fn parent<'p>(root: &RootDir, path: &'p str) -> Result<Parent<'p>, FsError> {
    match root.open_parent(path) {
        Ok((dir, name)) => Ok(Parent::Open(dir, name)),
        Err(e) if e.is_not_found() => Ok(Parent::Missing(e)),
        Err(e) => Err(e),
    }
}

/// Phase 3 for a write.
fn apply_write(
    root: &RootDir,
    change: &Change,
    staged: &mut Staged,
    tag: &str,
    written: &mut Vec<Written>,
    durable: &mut Durability,
) -> Result<Outcome, FsError> {
    let Change::Write {
        path, base, hash, ..
    } = change
    else {
        return Ok(conflict("internal: not a write"));
    };
    let (dir, name) = match parent(root, path)? {
        Parent::Open(d, n) => (d, n),
        Parent::Missing(e) => {
            return Ok(conflict(format!(
                "{e}; the Executor's version was not kept on the export"
            )));
        }
    };
    durable.note(dir.as_fd());
    let new = parse_hash(hash);
    let base = base.as_deref().and_then(parse_hash);
    let os_name = os(name);
    let precondition = match kind_at(dir.as_fd(), &os_name, path)? {
        NodeKind::Absent if base.is_none() => Ok(()),
        NodeKind::Absent => Err("the file was deleted on the export since the base".to_owned()),
        NodeKind::File => {
            let current = *hash_file_at(dir.as_fd(), &os_name, path)?.as_bytes();
            if Some(current) == new {
                // Already the content we would write: an idempotent retry.
                written.push(Written::of(path.clone(), staged));
                return Ok(Outcome::Applied);
            }
            match base {
                Some(b) if b == current => Ok(()),
                Some(_) => Err(format!(
                    "the file changed on the export since the base (now {})",
                    &hash_hex(&current)[..16]
                )),
                None => Err("a file was created on the export at this path".to_owned()),
            }
        }
        other => Err(format!(
            "{} exists on the export at this path",
            other.describe()
        )),
    };
    match precondition {
        Ok(()) => {
            if let Change::Write {
                link_to: Some(src), ..
            } = change
                && let Some(new) = new
                && link_into(root, src, &new, dir.as_fd(), &os_name, path)
            {
                // The staged copy is not needed: dropping it removes the temp file.
                written.push(Written::of(path.clone(), staged));
                return Ok(Outcome::Applied);
            }
            move_into(staged, dir.as_fd(), &os_name, path)?;
            written.push(Written::of(path.clone(), staged));
            Ok(Outcome::Applied)
        }
        Err(reason) => {
            let kept_name = format!("{name}.awcp-conflict-{tag}");
            let kept_rel = match path.rsplit_once('/') {
                Some((p, _)) => format!("{p}/{kept_name}"),
                None => kept_name.clone(),
            };
            match move_into(staged, dir.as_fd(), &os(&kept_name), &kept_rel) {
                Ok(()) => {
                    written.push(Written::of(kept_rel.clone(), staged));
                    Ok(Outcome::Conflict {
                        reason,
                        kept_as: Some(kept_rel),
                    })
                }
                Err(e) => Ok(conflict(format!(
                    "{reason}; keeping the Executor's version beside failed: {}",
                    chain(&e)
                ))),
            }
        }
    }
}

/// Make `name` in `dir` a hard link to the file at `src`, if that is a regular file with
/// content `hash`: link it under a temp name, then rename that over `name`, so the path is
/// replaced atomically as by a write. False (nothing changed) when the source does not
/// qualify or linking fails (another filesystem, a link limit…): the caller writes the
/// content instead.
fn link_into(
    root: &RootDir,
    src: &str,
    hash: &BlockHash,
    dir: BorrowedFd<'_>,
    name: &OsStr,
    rel: &str,
) -> bool {
    let Ok((sdir, sname)) = root.open_parent(src) else {
        return false;
    };
    let sname = os(sname);
    let sname: &OsStr = &sname;
    if !matches!(kind_at(sdir.as_fd(), sname, src), Ok(NodeKind::File)) {
        return false;
    }
    if !hash_file_at(sdir.as_fd(), sname, src).is_ok_and(|h| h.as_bytes() == hash) {
        return false;
    }
    let tmp = tmp_name();
    // linkat without AT_SYMLINK_FOLLOW never follows a symlink at `sname`.
    if let Err(e) = linkat(sdir.as_fd(), sname, dir, tmp.as_str(), AtFlags::empty()) {
        tracing::debug!(path = rel, src, error = %e, "hard link failed; writing a copy");
        return false;
    }
    if let Err(e) = renameat(dir, tmp.as_str(), dir, name) {
        tracing::debug!(path = rel, src, error = %e, "hard link rename failed; writing a copy");
        let _ = unlinkat(dir, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
        return false;
    }
    true
}

/// Rename a staged file to `name` in `dir` (copying when the temp is on another filesystem).
fn move_into(
    staged: &mut Staged,
    dir: BorrowedFd<'_>,
    name: &OsStr,
    rel: &str,
) -> Result<(), FsError> {
    match renameat(&staged.dir, staged.name.as_str(), dir, name) {
        Ok(()) => {}
        Err(Errno::EXDEV) => {
            // The temp was staged in an ancestor on another mount: copy into `dir` first.
            let src = open_file_at(staged.dir.as_fd(), OsStr::new(&staged.name), rel)?;
            let tmp = tmp_name();
            let fd = openat(
                dir,
                tmp.as_str(),
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(0o600),
            )
            .map_err(|e| fs_io("create temp", rel, e))?;
            let mut dst = File::from(fd);
            let copied = io::copy(&mut &src, &mut dst)
                .and_then(|_| finish_temp(&dst, staged.mode, staged.mtime_ns))
                // This copy was made after the commit's syncfs of staged data: it must be
                // on disk before the rename makes it the file.
                .and_then(|_| dst.sync_all());
            if let Err(source) = copied {
                let _ = unlinkat(dir, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
                return Err(FsError::Io {
                    op: "copy across filesystems",
                    path: rel.to_owned(),
                    source,
                });
            }
            if let Err(e) = renameat(dir, tmp.as_str(), dir, name) {
                let _ = unlinkat(dir, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
                return Err(fs_io("rename", rel, e));
            }
        }
        Err(e) => return Err(fs_io("rename", rel, e)),
    }
    staged.consumed = true;
    // If the temp was copied, the original is removed here (already gone after a rename).
    let _ = unlinkat(
        &staged.dir,
        staged.name.as_str(),
        UnlinkatFlags::NoRemoveDir,
    );
    Ok(())
}

/// Phase 3 for everything but writes.
fn apply_other(
    root: &RootDir,
    change: &Change,
    durable: &mut Durability,
) -> Result<Outcome, FsError> {
    let path = change.path();
    let (dir, name) = match parent(root, path)? {
        Parent::Open(d, n) => {
            durable.note(d.as_fd());
            (d, n)
        }
        // Removing something whose directory is gone: already done.
        Parent::Missing(_) if matches!(change, Change::Unlink { .. } | Change::Rmdir { .. }) => {
            return Ok(Outcome::Applied);
        }
        Parent::Missing(e) => return Ok(conflict(e.to_string())),
    };
    let dir = dir.as_fd();
    let name = os(name);
    let name: &OsStr = &name;
    let current = kind_at(dir, name, path)?;
    match change {
        Change::Mkdir { mode, .. } => match current {
            NodeKind::Dir => Ok(Outcome::Applied),
            NodeKind::Absent => {
                let mode = mode & MODE_MASK;
                mkdirat(dir, name, Mode::from_bits_truncate(mode))
                    .map_err(|e| fs_io("mkdir", path, e))?;
                // mkdir applies the umask; set the exact bits asked for.
                chmod_at(dir, name, mode, path)?;
                Ok(Outcome::Applied)
            }
            other => Ok(conflict(format!(
                "{} exists on the export at this path",
                other.describe()
            ))),
        },
        Change::Rmdir { .. } => match current {
            NodeKind::Absent => Ok(Outcome::Applied),
            NodeKind::Dir => match unlinkat(dir, name, UnlinkatFlags::RemoveDir) {
                Ok(()) => Ok(Outcome::Applied),
                Err(Errno::ENOTEMPTY | Errno::EEXIST) => {
                    Ok(conflict("the directory is not empty on the export"))
                }
                Err(e) => Err(fs_io("rmdir", path, e)),
            },
            other => Ok(conflict(format!(
                "{} is on the export at this path, not a directory",
                other.describe()
            ))),
        },
        Change::Unlink { base, .. } => {
            let matches_base = match current {
                NodeKind::Absent => return Ok(Outcome::Applied),
                NodeKind::File => {
                    let h = *hash_file_at(dir, name, path)?.as_bytes();
                    base.as_deref().and_then(parse_hash) == Some(h)
                }
                NodeKind::Symlink => {
                    let target = readlinkat(dir, name).map_err(|e| fs_io("readlink", path, e))?;
                    base.as_deref().is_some_and(|b| *os(b) == *target)
                }
                other => {
                    return Ok(conflict(format!(
                        "{} is on the export at this path",
                        other.describe()
                    )));
                }
            };
            if !matches_base {
                return Ok(conflict(if base.is_none() {
                    "the path exists on the export but the removal was based on nothing there"
                } else {
                    "it changed on the export since the base; not removed"
                }));
            }
            unlinkat(dir, name, UnlinkatFlags::NoRemoveDir)
                .map_err(|e| fs_io("unlink", path, e))?;
            Ok(Outcome::Applied)
        }
        Change::Symlink { target, .. } => match current {
            NodeKind::Absent => {
                symlinkat(&*os(target), dir, name).map_err(|e| fs_io("symlink", path, e))?;
                Ok(Outcome::Applied)
            }
            NodeKind::Symlink => {
                let existing = readlinkat(dir, name).map_err(|e| fs_io("readlink", path, e))?;
                if *existing == *os(target) {
                    return Ok(Outcome::Applied);
                }
                // Replace atomically: a new link under a temp name, renamed over the old one.
                let tmp = tmp_name();
                symlinkat(&*os(target), dir, tmp.as_str())
                    .map_err(|e| fs_io("symlink", path, e))?;
                if let Err(e) = renameat(dir, tmp.as_str(), dir, name) {
                    let _ = unlinkat(dir, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
                    return Err(fs_io("rename", path, e));
                }
                Ok(Outcome::Applied)
            }
            other => Ok(conflict(format!(
                "{} exists on the export at this path; a symlink never replaces it",
                other.describe()
            ))),
        },
        Change::Chmod {
            mode,
            mtime_ns,
            base,
            ..
        } => match current {
            NodeKind::Absent => Ok(conflict("it does not exist on the export")),
            // Linux ignores a symlink's own mode: nothing to do.
            NodeKind::Symlink => Ok(Outcome::Applied),
            NodeKind::File | NodeKind::Dir => {
                chmod_at(dir, name, mode & MODE_MASK, path)?;
                if let Change::Chmod {
                    xattrs: Some(x), ..
                } = change
                {
                    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
                    let flags = if current == NodeKind::Dir {
                        flags | OFlag::O_DIRECTORY
                    } else {
                        flags | OFlag::O_NONBLOCK
                    };
                    match openat(dir, name, flags, Mode::empty()) {
                        Ok(fd) => {
                            apply_xattrs(fd.as_fd(), path, x.iter().map(|(k, v)| (k, v.as_ref())))
                        }
                        Err(e) => {
                            tracing::warn!(path, error = %e, "cannot open to set extended attributes")
                        }
                    }
                }
                if let (NodeKind::File, Some(ns)) = (current, mtime_ns) {
                    // The time belongs to the content it was set on: not on content the
                    // Delegator changed meanwhile.
                    if let Some(b) = base
                        && hash_file_at(dir.as_fd(), name, path)?.to_hex().as_str() != b.as_str()
                    {
                        return Ok(conflict(
                            "the file changed on the export since the base; mode set, mtime not",
                        ));
                    }
                    let mtime =
                        TimeSpec::new(ns.div_euclid(1_000_000_000), ns.rem_euclid(1_000_000_000));
                    utimensat(
                        dir,
                        name,
                        &TimeSpec::UTIME_OMIT,
                        &mtime,
                        UtimensatFlags::NoFollowSymlink,
                    )
                    .map_err(|e| fs_io("set mtime", path, e))?;
                }
                Ok(Outcome::Applied)
            }
            NodeKind::Special => Ok(conflict("a special file is on the export at this path")),
        },
        Change::Write { .. } => Ok(conflict("internal: write outside the write path")),
    }
}

/// `chmod` of `name` in `dir` without following a symlink there.
fn chmod_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32, rel: &str) -> Result<(), FsError> {
    let mode = Mode::from_bits_truncate(mode);
    match fchmodat(dir, name, mode, FchmodatFlags::NoFollowSymlink) {
        Ok(()) => Ok(()),
        // Older C libraries cannot do AT_SYMLINK_NOFOLLOW: open without following instead.
        Err(Errno::EOPNOTSUPP | Errno::ENOSYS | Errno::EINVAL) => {
            let fd = openat(
                dir,
                name,
                OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| fs_io("open for chmod", rel, e))?;
            fchmod(&fd, mode).map_err(|e| fs_io("chmod", rel, e))
        }
        Err(e) => Err(fs_io("chmod", rel, e)),
    }
}

/// An error and its causes, for a conflict reason.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflict_tags_are_filename_safe() {
        for id in ["c0ffee-1234-5678", "../../x", "ab", "a/b\0c"] {
            let tag = conflict_tag(id);
            assert_eq!(tag.len(), 12);
            assert!(tag.chars().all(|c| c.is_ascii_hexdigit()), "{tag}");
        }
        // Commits of one Executor share a prefix; their tags must differ.
        assert_ne!(
            conflict_tag("0123456789abcdef-1"),
            conflict_tag("0123456789abcdef-2")
        );
    }

    #[test]
    fn commit_log_answers_retries_and_forgets_the_oldest() {
        let mut log = CommitLog::default();
        for i in 0..(REMEMBERED_COMMITS + 1) {
            log.remember(CommitResult {
                commit_id: format!("c{i}"),
                applied: i as u64,
                conflicts: vec![],
                seq: None,
                held: Vec::new(),
                current: None,
            });
        }
        assert!(log.find("c0").is_none());
        assert_eq!(log.find("c5").map(|r| r.applied), Some(5));
    }

    // A restarted export (the daemon re-registers it over the same staging directory)
    // still knows what it answered; a torn last line is ignored; the file is compacted.
    #[test]
    fn commit_log_survives_a_reopen_and_stays_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let result = |i: usize| CommitResult {
            commit_id: format!("c{i}"),
            applied: i as u64,
            conflicts: vec![],
            seq: Some(i as u64),
            held: Vec::new(),
            current: None,
        };
        // Bounded at 8 here (4,096 in use): each result is synced to disk.
        let cap = 8;
        {
            let mut log = CommitLog::open_capped(dir.path(), cap);
            log.remember(result(1));
            log.remember(result(2));
        }
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join(COMMITS_FILE))
            .unwrap();
        f.write_all(br#"{"commitId":"c3","appl"#).unwrap();
        drop(f);
        let mut log = CommitLog::open_capped(dir.path(), cap);
        assert_eq!(log.find("c2"), Some(result(2)));
        assert_eq!(log.find("c3"), None);
        for i in 3..(2 * cap + 10) {
            log.remember(result(i));
        }
        let lines = std::fs::read_to_string(dir.path().join(COMMITS_FILE))
            .unwrap()
            .lines()
            .count();
        assert!(lines <= 2 * cap + 1, "{lines} lines");
        let log = CommitLog::open_capped(dir.path(), cap);
        assert_eq!(log.find("c1"), None);
        let last = 2 * cap + 9;
        assert_eq!(log.find(&format!("c{last}")), Some(result(last)));
    }
}
