//! The first `git status` on a new mount in O(changes): git's index, shown with a monitor
//! extension of this mount's own.
//!
//! git skips the `lstat` of an entry only when the index says the monitor vouched for it
//! (an `FSMN` extension whose token the monitor answers: `mount/changes.rs`). The index a
//! delegation brings was written by the Delegator's git, or by an earlier mount's whose
//! token this one cannot answer, so the first `git status` of every delegation would look
//! at every file — a FUSE round trip each, the one cost of a fresh mount that grows with
//! the tree. Instead, when a mount starts, it fetches the work tree's `.git/index` and
//! shows git that index with the extension rewritten ([`crate::gitindex`]): this mount's
//! token, taken first, and as dirty every entry git could not trust by its own rule — the
//! mtime (seconds and nanoseconds) and size it recorded differ from what the mount shows,
//! the type or executable bit differs, the entry is racily clean (recorded no earlier than
//! the index itself was written), in a conflict, assume-unchanged, skip-worktree or
//! intent-to-add, or its path is not a regular file here. That is the comparison git's
//! `lstat` of each entry would make, made against the inode table instead; any change
//! after the token is in the mount's change log and answered to git as usual. The
//! untracked cache (git trusts its directories wholesale once a monitor answers) is kept
//! only for the directories whose recorded modification time is still the one the mount
//! shows (and older than the index), marked for this work tree's location; git reads the
//! others again. Without one, the first `git status` reads every directory once and
//! writes one.
//!
//! Only the content shown changes: the node keeps the export's hash as the one it is
//! known to match, so the syncer sees nothing to write back until git itself writes the
//! index (when the Delegator receives git's own index, with its own extension, as before).
//! An index an earlier mount of the same export wrote and vouched for (it ended cleanly:
//! `mount/changes.rs`) is left as it is — its token is answerable and its untracked cache
//! still good. So is anything that is not a plain index this reader knows (a split or
//! sparse index, another version, a bad checksum).
//!
//! A mount that fetches only what is read (`--hydrate none`) shows the index as it came.
//!
//! Until the index is ready — typically one fetch — a `lookup`, `getattr` or `open` of it
//! waits ([`PRIME_WAIT`] at most): the kernel must never hold the original's size or pages
//! while the new content is shown.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

use super::FsError;
use super::changes::CATCH_UP_WAIT;
use super::fs::AwcpFs;
use super::inode::{Data, Ino, InodeTable, Kind};
use crate::gitindex::{self, Entry, Index};

/// The longest a `lookup`, `getattr` or `open` of the index waits for it to be made ready;
/// past it the index is shown as it came.
pub const PRIME_WAIT: Duration = Duration::from_secs(30);

/// The largest index made ready (a larger one is shown as it came).
const MAX_INDEX: u64 = 1 << 30;

/// Where the work tree's index is.
const INDEX_PATH: &str = ".git/index";

/// The gate operations on the index wait at while it is made ready.
#[derive(Debug, Default)]
pub struct PrimeGate {
    /// The index's inode while it is being made ready; 0 otherwise.
    ino: AtomicU64,
    /// Still being made ready (false also once a waiter gave up).
    priming: Mutex<bool>,
    /// The work tree's path as git names it (the mountpoint, symlinks resolved).
    worktree: Mutex<Option<String>>,
    cv: Condvar,
}

impl PrimeGate {
    /// Whether operations on `ino` must wait (one atomic load).
    #[inline]
    pub(super) fn holds(&self, ino: Ino) -> bool {
        self.ino.load(Ordering::Acquire) == ino
    }
}

/// Why the index was left as it came.
#[derive(Debug, thiserror::Error)]
enum PrimeError {
    #[error(transparent)]
    Fs(#[from] FsError),
    #[error("reading the index's upper file: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Index(#[from] gitindex::IndexError),
}

/// What making the index ready did.
#[derive(Debug, PartialEq, Eq)]
enum Primed {
    /// Shown with this mount's extension: entries, and how many git must look at.
    Done { entries: usize, dirty: usize },
    /// Left as it came (the reason, for the log).
    Left(&'static str),
}

impl AwcpFs {
    /// Hold operations on the work tree's `.git/index` until [`AwcpFs::prime_index`] has
    /// made it ready; called before the kernel can see the tree. The index's inode, or
    /// `None` when there is nothing to make ready.
    pub fn arm_index_prime(&self, mountpoint: &std::path::Path) -> Option<Ino> {
        let worktree = std::fs::canonicalize(mountpoint).unwrap_or_else(|_| mountpoint.into());
        *self.prime.worktree.lock() = worktree.to_str().map(str::to_owned);
        let table = self.table.lock();
        let ino = table.resolve(INDEX_PATH)?;
        let node = table.get(ino)?;
        if node.kind != Kind::File
            || !matches!(node.data, Data::Remote { .. })
            || !(32..=MAX_INDEX).contains(&node.size)
        {
            return None;
        }
        *self.prime.priming.lock() = true;
        self.prime.ino.store(ino, Ordering::Release);
        Some(ino)
    }

    /// Wait while `ino` is the index being made ready (one atomic load otherwise).
    #[inline]
    pub(super) fn wait_primed(&self, ino: Ino) {
        if self.prime.holds(ino) {
            self.wait_primed_slow();
        }
    }

    #[cold]
    fn wait_primed_slow(&self) {
        let deadline = Instant::now() + PRIME_WAIT;
        let mut priming = self.prime.priming.lock();
        while *priming {
            if self.prime.cv.wait_until(&mut priming, deadline).timed_out() && *priming {
                tracing::warn!(
                    "git's index was not ready for the fsmonitor within {PRIME_WAIT:?}: \
                     shown as it came (the first git status looks at every file)"
                );
                self.open_gate(&mut priming);
            }
        }
    }

    fn open_gate(&self, priming: &mut bool) {
        *priming = false;
        self.prime.ino.store(0, Ordering::Release);
        self.prime.cv.notify_all();
    }

    /// Make the index `ino` ([`AwcpFs::arm_index_prime`]) ready for git's fsmonitor (see
    /// the module docs), then let the operations waiting for it through.
    pub fn prime_index(&self, ino: Ino) {
        let started = Instant::now();
        match self.prime_index_inner(ino) {
            Ok(Primed::Done { entries, dirty }) => tracing::info!(
                entries,
                dirty,
                ms = started.elapsed().as_millis() as u64,
                "git's index shown with this mount's fsmonitor extension"
            ),
            Ok(Primed::Left(why)) => {
                tracing::debug!(why, "git's index shown as it came")
            }
            Err(e) => tracing::info!(error = %e,
                "git's index shown as it came (the first git status looks at every file)"),
        }
        self.open_gate(&mut self.prime.priming.lock());
    }

    fn prime_index_inner(&self, ino: Ino) -> Result<Primed, PrimeError> {
        // The export's changes since its registration first: the index (or the files it
        // describes) may have changed after the manifest was made.
        if !self.changes.wait_caught_up(CATCH_UP_WAIT) {
            return Ok(Primed::Left(
                "the export's changes since registration did not come",
            ));
        }
        let hash = match self.table.lock().get(ino).map(|n| &n.data) {
            Some(Data::Remote { hash, .. }) => *hash,
            _ => return Ok(Primed::Left("not the export's content")),
        };
        self.fetch_local(ino, None)?;
        let path = self.upper_path(ino);
        let data = std::fs::read(&path)?;
        let index = gitindex::parse(&data)?;
        if let Some(token) = index.fsmonitor_token(&data)
            && let Some(instance) = self.changes.foreign_instance(token)
            && self.remote.mount_ended_clean(instance).unwrap_or(false)
        {
            return Ok(Primed::Left("an earlier mount's index, vouched for"));
        }
        // The token first: whatever changes after it is in the log, whatever changed
        // before it is in the table the entries are compared with.
        let token = self.changes.current_token();
        let worktree = self.prime.worktree.lock().clone();
        let (dirty, untracked) = {
            let table = self.table.lock();
            let Some(node) = table.get(ino) else {
                return Ok(Primed::Left("gone"));
            };
            let written = since_epoch(node.mtime);
            let untracked = index.untracked(&data).zip(worktree).and_then(|(body, wt)| {
                let ident = format!("Location {wt}, system {}", sysname());
                gitindex::rewrite_untracked(body, index.hash_len, &ident, |path, mtime| {
                    dir_unchanged(&table, path, mtime, written)
                })
                .map_err(|e| tracing::debug!(error = %e, "git's untracked cache dropped"))
                .ok()
            });
            (index_dirty(&table, &index, written), untracked)
        };
        let primed =
            gitindex::with_fsmonitor(&data, &index, &token, |i| dirty[i], untracked.as_deref());
        let tmp = self.opts.upper_dir.join(format!(".prime-{ino}"));
        std::fs::write(&tmp, &primed)?;
        let priming = self.prime.priming.lock();
        let mut table = self.table.lock();
        let unchanged = *priming
            && table.get(ino).is_some_and(|n| {
                n.size == data.len() as u64
                    && n.open_handles == 0
                    && matches!(n.data, Data::Local { dirty: false, hash: Some(h), generation: 0 } if h == hash)
            });
        if !unchanged {
            drop(table);
            let _ = std::fs::remove_file(&tmp);
            return Ok(Primed::Left("changed or waited for too long meanwhile"));
        }
        std::fs::rename(&tmp, &path)?;
        self.upper.forget(ino);
        if let Some(n) = table.get_mut(ino) {
            n.size = primed.len() as u64;
        }
        Ok(Primed::Done {
            entries: index.entries.len(),
            dirty: dirty.iter().filter(|d| **d).count(),
        })
    }
}

/// (seconds, nanoseconds) since the epoch; the epoch for anything before it.
fn since_epoch(t: std::time::SystemTime) -> (u64, u32) {
    t.duration_since(UNIX_EPOCH)
        .map(|d| (d.as_secs(), d.subsec_nanos()))
        .unwrap_or((0, 0))
}

/// For each entry of `index` (written at `written`), whether git must look at it itself:
/// see the module docs for the rule. The work tree is the mount's root.
fn index_dirty(table: &InodeTable, index: &Index, written: (u64, u32)) -> Vec<bool> {
    // Entries come sorted by path: one directory's run resolves its directory once.
    let mut dir_path: Option<&[u8]> = None;
    let mut dir_ino: Option<Ino> = None;
    index
        .entries
        .iter()
        .map(|e| {
            let path = index.path(e);
            let (dir, name) = match path.iter().rposition(|&b| b == b'/') {
                Some(i) => (&path[..i], &path[i + 1..]),
                None => (&path[..0], path),
            };
            if dir_path != Some(dir) {
                dir_path = Some(dir);
                dir_ino = resolve_dir(table, dir);
            }
            !dir_ino.is_some_and(|d| entry_clean(table, d, name, e, written))
        })
        .collect()
}

/// Whether the directory at `path` (with a trailing `/`; empty for the root) still has the
/// modification time the untracked cache recorded, older than the index (`written`).
fn dir_unchanged(
    table: &InodeTable,
    path: &[u8],
    recorded: (u32, u32),
    written: (u64, u32),
) -> bool {
    let recorded = (u64::from(recorded.0), recorded.1);
    recorded < written
        && resolve_dir(table, path.strip_suffix(b"/").unwrap_or(path))
            .and_then(|d| table.get(d))
            .is_some_and(|d| since_epoch(d.mtime) == recorded)
}

/// The kernel's name as git's untracked cache records it (`uname -s`).
fn sysname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/ostype")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "Linux".into())
}

/// The directory at `dir` (raw path bytes, empty for the root), if it is one.
fn resolve_dir(table: &InodeTable, dir: &[u8]) -> Option<Ino> {
    table
        .resolve(&awcp_protocol::rawname::from_bytes(dir))
        .filter(|&d| table.get(d).is_some_and(|n| n.kind == Kind::Dir))
}

fn entry_clean(table: &InodeTable, dir: Ino, name: &[u8], e: &Entry, written: (u64, u32)) -> bool {
    if e.stage != 0 || e.special || e.mode & 0o170000 != 0o100000 || e.size == 0 {
        return false;
    }
    let recorded = (u64::from(e.mtime.0), e.mtime.1);
    // Racily clean: git itself would read the content.
    if recorded >= written {
        return false;
    }
    let Some(ino) = table.child(dir, &awcp_protocol::rawname::from_bytes(name)) else {
        return false;
    };
    let Some(n) = table.get(ino) else {
        return false;
    };
    n.kind == Kind::File
        && !table.is_withheld(ino)
        && (u32::from(n.perm) ^ e.mode) & 0o100 == 0
        && n.size as u32 == e.size
        && since_epoch(n.mtime) == recorded
}

#[cfg(test)]
mod tests;
