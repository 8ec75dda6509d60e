//! Writing changes back: diff the mount's tree against what the export is known to have,
//! and commit the difference.
//!
//! The syncer is state-based, not operation-based: each round compares paths of the inode
//! table with the last state it committed (`synced`, which starts as the manifest), and
//! sends one change set. Only paths that may have changed are compared: the table records
//! which dentries changed (a path and everything below it: a renamed directory is compared
//! at its old and its new path) and which nodes changed (compared at each of their names),
//! so a round costs what changed since the last one, not the size of the tree (see
//! [`Dirty`]). A journal replay marks everything, so the first round
//! after a crash compares the whole tree. A burst of operations on one file becomes one
//! write; a rename becomes a write at the new path plus an unlink at the old one, and costs
//! no upload because the export already has every block of the old content. Rounds are
//! idempotent: a retried round after a failure re-sends changes whose base hashes the
//! export already satisfies, and the export accepts those as no-ops.
//!
//! A file still open for writing is left for a later round (live mode syncs on close and
//! fsync) unless the round is a final flush.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use awcp_protocol::dataplane::{Change, ChangeSet, CommitResult, Conflict, EntryKind, Manifest};

use super::fs::AwcpFs;
use super::inode::{Data, Dirty, Hash, Ino, Kind, Node, time_to_ns};
use super::remote::{RemoteError, parse_hash};

/// Upload at most this many bytes per request.
const UPLOAD_BATCH_BYTES: usize = 32 << 20;
/// Hashes per `/missing` question (the export answers at most 65,536).
const MISSING_BATCH: usize = 32_768;
/// Changes per commit (the export takes at most 100,000).
const COMMIT_CHANGES: usize = 50_000;
/// Rough bytes of JSON per commit (the export reads at most 64 MiB).
const COMMIT_BYTES: usize = 32 << 20;

/// A node's `user.*` attributes with hex values, as the wire carries them.
pub(super) fn hex_xattrs(n: &super::inode::Node) -> BTreeMap<String, String> {
    hex_map(&n.xattrs)
}

/// Attribute values in hex (the wire's and the logs' form).
pub(super) fn hex_map(x: &BTreeMap<String, Vec<u8>>) -> BTreeMap<String, String> {
    x.iter().map(|(k, v)| (k.clone(), hex::encode(v))).collect()
}

/// What changed between two attribute sets: new values, and `None` for removed names;
/// `None` when nothing did.
fn xattr_delta(
    old: &BTreeMap<String, String>,
    new: &BTreeMap<String, String>,
) -> Option<BTreeMap<String, Option<String>>> {
    let mut delta: BTreeMap<String, Option<String>> = new
        .iter()
        .filter(|(k, v)| old.get(*k) != Some(*v))
        .map(|(k, v)| (k.clone(), Some(v.clone())))
        .collect();
    for k in old.keys().filter(|k| !new.contains_key(*k)) {
        delta.insert(k.clone(), None);
    }
    (!delta.is_empty()).then_some(delta)
}

/// A generous estimate of a change's JSON size.
fn approx_size(c: &Change) -> usize {
    // Strings may need escaping: up to 6 bytes per byte for control characters.
    let extra = match c {
        Change::Write {
            blocks,
            link_to,
            xattrs,
            ..
        } => {
            blocks.len() * 67
                + 6 * link_to.as_ref().map_or(0, String::len)
                + xattrs.as_ref().map_or(0, |x| {
                    x.iter().map(|(k, v)| 6 * k.len() + v.len() + 8).sum()
                })
        }
        Change::Symlink { target, .. } => 6 * target.len(),
        Change::Chmod {
            xattrs: Some(x), ..
        } => x
            .iter()
            .map(|(k, v)| 6 * k.len() + v.as_ref().map_or(4, String::len) + 8)
            .sum(),
        _ => 0,
    };
    256 + 6 * c.path().len() + extra
}

/// Wakes the syncer.
#[derive(Debug, Default)]
pub struct SyncSignal {
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl SyncSignal {
    /// Ask for a sync round soon.
    pub fn request(&self) {
        self.state.lock().0 = true;
        self.cv.notify_all();
    }

    /// Stop the background loop.
    pub fn stop(&self) {
        self.state.lock().1 = true;
        self.cv.notify_all();
    }

    /// Wait up to `timeout` for a request; `Some(true)` if one came, `None` once stopped.
    fn wait(&self, timeout: Duration) -> Option<bool> {
        let mut st = self.state.lock();
        if !st.0 && !st.1 {
            self.cv.wait_for(&mut st, timeout);
        }
        if st.1 {
            return None;
        }
        let requested = st.0;
        st.0 = false;
        Some(requested)
    }
}

/// What the export has at every path when a mount starts: [`Syncer::base_of`] computes it,
/// [`Syncer::with_base`] starts from it.
#[derive(Debug, Default)]
pub struct SyncedBase(BTreeMap<String, Synced>);

/// What the export has at a path, as far as this mount knows.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Synced {
    /// A directory.
    Dir {
        /// Permission bits.
        mode: u32,
        /// `user.*` extended attributes this mount set (name → hex value).
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        xattrs: BTreeMap<String, String>,
    },
    /// A file.
    File {
        /// Content hash (hex in `synced.log`).
        #[serde(with = "hex_hash")]
        hash: Hash,
        /// Permission bits.
        mode: u32,
        /// Modification time, when known (absent in `synced.log` lines of older versions).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mtime_ns: Option<i64>,
        /// `user.*` extended attributes this mount gave it (name → hex value).
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        xattrs: BTreeMap<String, String>,
    },
    /// A symlink.
    Symlink {
        /// Target.
        target: String,
    },
}

/// A raw hash as hex in `synced.log` (a malformed one reads as all zeros: recovery then
/// re-sends that path, which the export answers as a no-op or a conflict, never a loss).
mod hex_hash {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(h: &super::Hash, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(h))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<super::Hash, D::Error> {
        let s = String::deserialize(d)?;
        Ok(super::super::inode::hash_from_hex(&s))
    }
}

/// One line of `synced.log`: what a successful commit left at a path (`None`: nothing).
/// Replayed over the manifest on recovery, it tells which changes already reached the
/// Delegator, so recovery sends only the rest.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SyncedRecord {
    /// The path.
    pub path: String,
    /// Its state at the export after the commit.
    pub state: Option<Synced>,
}

/// Append-only log of committed state (see [`SyncedRecord`]).
#[derive(Debug)]
pub struct SyncedLog {
    file: Mutex<std::fs::File>,
}

impl SyncedLog {
    /// Open (or create) the log at `path`.
    pub fn open(path: &std::path::Path) -> std::io::Result<SyncedLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(SyncedLog {
            file: Mutex::new(file),
        })
    }

    fn append(&self, records: &[SyncedRecord]) -> std::io::Result<()> {
        use std::io::Write;
        let mut buf = Vec::new();
        for r in records {
            serde_json::to_writer(&mut buf, r).map_err(std::io::Error::other)?;
            buf.push(b'\n');
        }
        // Synced to disk: after a machine crash, recovery must not re-send (and turn into
        // conflicts) what the Delegator already has.
        let mut f = self.file.lock();
        f.write_all(&buf)?;
        f.sync_data()
    }

    /// Every complete record at `path` (a torn last line is ignored).
    pub fn read_all(path: &std::path::Path) -> std::io::Result<Vec<SyncedRecord>> {
        use std::io::BufRead;
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for line in std::io::BufReader::new(file).split(b'\n') {
            if let Ok(r) = serde_json::from_slice(&line?) {
                out.push(r);
            }
        }
        Ok(out)
    }
}

/// Why a round failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The data plane failed.
    #[error("writing back to the Delegator failed")]
    Remote {
        /// Why.
        #[source]
        source: RemoteError,
    },
    /// Reading an upper file failed.
    #[error("reading local changes failed")]
    Io {
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl SyncError {
    /// The lease is over: retrying is pointless.
    pub fn is_fatal(&self) -> bool {
        matches!(self, SyncError::Remote { source } if source.is_fatal())
    }
}

/// Outcome of one round.
#[derive(Debug, Default, Clone)]
pub struct RoundReport {
    /// Changes committed.
    pub changes: usize,
    /// Files written.
    pub files_written: usize,
    /// Conflicts the export reported.
    pub conflicts: Vec<Conflict>,
    /// Files skipped because they are still open for writing.
    pub pending_open: usize,
    /// Paths compared with what the export has (what changed since the last round, or
    /// the whole tree after a journal replay).
    pub compared: usize,
}

enum Cur {
    Dir {
        mode: u32,
        xattrs: BTreeMap<String, String>,
    },
    Symlink {
        target: String,
    },
    File(CurFile),
    /// Open for writing; left alone this round.
    Skip,
    /// A FIFO, socket or device node: never written back (`special.rs`); the Delegator
    /// loses whatever it had at this path.
    MountOnly,
}

struct CurFile {
    /// `user.*` attributes, values in hex.
    xattrs: BTreeMap<String, String>,
    ino: Ino,
    /// Names of the inode (hard links).
    nlink: u32,
    mode: u32,
    mtime_ns: i64,
    size: u64,
    /// Known hash (clean), or the generation to hash now (dirty).
    known: Option<Hash>,
    /// Block list, when known without reading (remote content).
    blocks: Option<Vec<String>>,
    generation: u64,
}

/// What one round compares.
struct Snapshot {
    /// Current state of the paths compared.
    entries: Vec<(String, Cur)>,
    /// Where paths the export has may have disappeared.
    scope: Scope,
    /// The changes these entries cover (given back to the table if the round fails).
    taken: Dirty,
}

/// Where a round looks for paths that are gone.
enum Scope {
    /// Everywhere.
    All,
    /// At and below these paths (sorted; none below another).
    Subtrees(Vec<String>),
}

/// Whether `path` is strictly below one of `roots`.
fn below_any(roots: &HashSet<String>, path: &str) -> bool {
    path.match_indices('/')
        .any(|(i, _)| roots.contains(&path[..i]))
}

/// Whether `path` is one of `roots` or below one.
fn covered(roots: &HashSet<String>, path: &str) -> bool {
    roots.contains(path) || below_any(roots, path)
}

/// A node's state as a round compares it.
fn cur_of(n: &Node, include_open: bool, busy: &HashSet<Ino>) -> Cur {
    match n.kind {
        Kind::Fifo | Kind::Socket | Kind::CharDev(_) | Kind::BlockDev(_) => Cur::MountOnly,
        Kind::Dir => Cur::Dir {
            mode: u32::from(n.perm),
            xattrs: hex_xattrs(n),
        },
        Kind::Symlink => Cur::Symlink {
            target: n.target.clone().unwrap_or_default(),
        },
        Kind::File => {
            let (known, blocks, generation) = match &n.data {
                d @ Data::Remote { hash, .. } => (Some(*hash), Some(d.remote_blocks()), 0),
                Data::Local {
                    dirty: false,
                    hash: Some(h),
                    generation,
                } => (Some(*h), None, *generation),
                Data::Local { generation, .. } => {
                    if (n.open_writers > 0 || busy.contains(&n.ino)) && !include_open {
                        return Cur::Skip;
                    }
                    (None, None, *generation)
                }
                Data::None => (None, None, 0),
            };
            Cur::File(CurFile {
                xattrs: hex_xattrs(n),
                ino: n.ino,
                nlink: n.nlink(),
                mode: u32::from(n.perm),
                mtime_ns: time_to_ns(n.mtime),
                size: n.size,
                known,
                blocks,
                generation,
            })
        }
    }
}

struct Hashed {
    hash: Hash,
    size: u64,
    blocks: Vec<String>,
}

/// The write-back engine of one mount.
pub struct Syncer {
    fs: Arc<AwcpFs>,
    pub(super) synced: Mutex<BTreeMap<String, Synced>>,
    log: Option<SyncedLog>,
    seq: AtomicU64,
    instance: String,
}

impl std::fmt::Debug for Syncer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Syncer")
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl Syncer {
    /// A syncer whose starting point is the manifest the mount was built from, plus what
    /// `log_records` say later commits left; new commits are appended to `log`.
    pub fn with_log(
        fs: Arc<AwcpFs>,
        manifest: &Manifest,
        log_records: &[SyncedRecord],
        log: Option<SyncedLog>,
    ) -> Syncer {
        Self::with_base(fs, Self::base_of(manifest), log_records, log)
    }

    /// [`Syncer::with_log`] from a starting point already computed by
    /// [`Syncer::base_of`] (a mount computes it while it builds its inode table).
    pub fn with_base(
        fs: Arc<AwcpFs>,
        base: SyncedBase,
        log_records: &[SyncedRecord],
        log: Option<SyncedLog>,
    ) -> Syncer {
        let mut s = Syncer {
            fs,
            synced: Mutex::new(base.0),
            log: None,
            seq: AtomicU64::new(0),
            instance: hex::encode(rand::random::<[u8; 8]>()),
        };
        if !log_records.is_empty() {
            // What the export has differs from the manifest: compare everything once.
            s.fs.table.lock().mark_all();
        }
        {
            let mut synced = s.synced.lock();
            for r in log_records {
                match &r.state {
                    Some(st) => synced.insert(r.path.clone(), st.clone()),
                    None => synced.remove(&r.path),
                };
            }
        }
        s.log = log;
        s
    }

    /// A syncer whose starting point is the manifest the mount was built from.
    pub fn new(fs: Arc<AwcpFs>, manifest: &Manifest) -> Syncer {
        Self::with_base(fs, Self::base_of(manifest), &[], None)
    }

    /// What the Delegator holds according to `manifest`, as a syncer compares it.
    pub fn base_of(manifest: &Manifest) -> SyncedBase {
        let synced = manifest
            .entries
            .iter()
            .map(|e| {
                let s = match e.kind {
                    EntryKind::Dir => Synced::Dir {
                        mode: e.mode & 0o7777,
                        xattrs: e.xattrs.clone(),
                    },
                    EntryKind::File => Synced::File {
                        hash: e
                            .hash
                            .as_deref()
                            .map_or([0; 32], super::inode::hash_from_hex),
                        mode: e.mode & 0o7777,
                        mtime_ns: Some(e.mtime_ns),
                        xattrs: e.xattrs.clone(),
                    },
                    EntryKind::Symlink => Synced::Symlink {
                        target: e.target.clone().unwrap_or_default(),
                    },
                };
                (e.path.clone(), s)
            })
            .collect();
        SyncedBase(synced)
    }

    /// The filesystem this syncer writes back.
    pub(super) fn fs(&self) -> &AwcpFs {
        &self.fs
    }

    /// Append to `synced.log` (if this syncer keeps one).
    pub(super) fn log_synced(&self, records: &[SyncedRecord]) {
        if records.is_empty() {
            return;
        }
        if let Some(log) = &self.log
            && let Err(e) = log.append(records)
        {
            tracing::warn!(error = %e, "cannot append to synced.log");
        }
    }

    /// What a round compares, taken under the table's lock with the set of changes it
    /// covers (given back if the round fails).
    fn snapshot(&self, include_open: bool) -> Snapshot {
        let mut table = self.fs.table.lock();
        // Under the table's lock, like the marks themselves (a file created without a
        // handle is marked before it joins the table): asked before taking the lock, a
        // file created in between would join the dirty set unmarked and be taken empty,
        // just before its writer fills it.
        let busy = &self.fs.quiet_writes(include_open);
        let taken = table.take_dirty();
        let mut entries = Vec::new();
        if taken.all {
            entries.reserve(table.len());
            table.walk(|path, n| entries.push((path.to_string(), cur_of(n, include_open, busy))));
            return Snapshot {
                entries,
                scope: Scope::All,
                taken,
            };
        }
        let roots: Vec<String> = {
            let mut r: Vec<String> = taken
                .subtrees
                .iter()
                .filter(|p| !below_any(&taken.subtrees, p))
                .cloned()
                .collect();
            r.sort_unstable();
            r
        };
        // Every name of a hard-linked file is compared when one is: a new name is sent as
        // a link to one the export already has.
        let mut linked: Vec<Ino> = Vec::new();
        for root in &roots {
            if let Some(ino) = table.resolve(root) {
                table.walk_from(ino, root, |path, n| {
                    if n.kind == Kind::File && !n.links.is_empty() {
                        linked.push(n.ino);
                    }
                    entries.push((path.to_string(), cur_of(n, include_open, busy)));
                });
            }
        }
        let mut nodes: Vec<Ino> = taken.inos.iter().copied().chain(linked).collect();
        nodes.sort_unstable();
        nodes.dedup();
        let mut exact: HashSet<String> = HashSet::new();
        for ino in nodes {
            let Some(n) = table.get(ino) else { continue };
            for path in table.paths_of(ino) {
                if covered(&taken.subtrees, &path) || exact.contains(&path) {
                    continue;
                }
                exact.insert(path.clone());
                entries.push((path, cur_of(n, include_open, busy)));
            }
        }
        Snapshot {
            entries,
            scope: Scope::Subtrees(roots),
            taken,
        }
    }

    fn hash_upper(
        &self,
        ino: Ino,
        pending: &mut HashMap<String, Vec<u8>>,
    ) -> Result<Option<Hashed>, SyncError> {
        let bs = self.fs.opts.block_size.max(4096) as usize;
        let mut f = match std::fs::File::open(self.fs.upper_path(ino)) {
            Ok(f) => f,
            // Unlinked since the snapshot: the next round sees the new tree.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(SyncError::Io { source }),
        };
        let mut whole = blake3::Hasher::new();
        let mut blocks = Vec::new();
        let mut size = 0u64;
        loop {
            let mut buf = Vec::with_capacity(bs);
            (&mut f)
                .take(bs as u64)
                .read_to_end(&mut buf)
                .map_err(|source| SyncError::Io { source })?;
            if buf.is_empty() {
                break;
            }
            whole.update(&buf);
            size += buf.len() as u64;
            let h = blake3::hash(&buf).to_hex().to_string();
            blocks.push(h.clone());
            let short = buf.len() < bs;
            pending.insert(h, buf);
            if short {
                break;
            }
        }
        Ok(Some(Hashed {
            hash: *whole.finalize().as_bytes(),
            size,
            blocks,
        }))
    }

    /// Run one round: commit every change since the last one. `final_flush` includes files
    /// still open for writing.
    pub fn round(&self, final_flush: bool) -> Result<RoundReport, SyncError> {
        let mut synced = self.synced.lock();
        let snap = self.snapshot(final_flush);
        let mut again: Vec<String> = Vec::new();
        match self.round_over(&mut synced, &snap, &mut again) {
            Ok(report) => {
                // Skipped (open for writing) or vanished under the round: compare them again.
                if !again.is_empty() {
                    let mut table = self.fs.table.lock();
                    for p in &again {
                        table.mark_path(p);
                    }
                }
                Ok(report)
            }
            Err(e) => {
                self.fs.table.lock().restore_dirty(snap.taken);
                Err(e)
            }
        }
    }

    /// Make the next round compare the whole tree, not only what changed (a safety net,
    /// and how tests check that change tracking missed nothing).
    pub fn compare_everything_next(&self) {
        self.fs.table.lock().mark_all();
    }

    fn round_over(
        &self,
        synced: &mut BTreeMap<String, Synced>,
        snap: &Snapshot,
        again: &mut Vec<String>,
    ) -> Result<RoundReport, SyncError> {
        let snapshot = &snap.entries;
        let mut report = RoundReport {
            compared: snapshot.len(),
            ..Default::default()
        };
        let mut pending_blocks: HashMap<String, Vec<u8>> = HashMap::new();
        let mut seen: HashSet<&str> = HashSet::with_capacity(snapshot.len());
        let mut deletes: Vec<Change> = Vec::new();
        let mut rmdirs: Vec<String> = Vec::new();
        let mut mkdirs: Vec<Change> = Vec::new();
        let mut writes: Vec<Change> = Vec::new();
        let mut chmods: Vec<Change> = Vec::new();
        // (ino, generation, hash) of dirty files to mark clean after the commit.
        let mut cleaned: Vec<(Ino, u64, Hash)> = Vec::new();
        let mut next: Vec<(String, Option<Synced>)> = Vec::new();
        // First path and hash of each hard-linked inode, in walk (= write) order: later
        // names with the same content are sent as links to it.
        let mut first_name: HashMap<Ino, (String, Hash)> = HashMap::new();
        // A name of a hard-linked inode that the export already has with its current
        // content (unchanged this round), and the writes of such inodes that found no
        // earlier name to link to: they link to the unchanged name instead (a renamed
        // first name, say), so the Delegator keeps one inode.
        let mut unchanged_name: HashMap<Ino, (String, Hash)> = HashMap::new();
        let mut unlinked_writes: Vec<(usize, Ino, Hash)> = Vec::new();

        let remove_old = |path: &str,
                          old: &Synced,
                          deletes: &mut Vec<Change>,
                          rmdirs: &mut Vec<String>| match old {
            Synced::Dir { .. } => rmdirs.push(path.to_string()),
            Synced::File { hash, .. } => deletes.push(Change::Unlink {
                path: path.to_string(),
                base: Some(hex::encode(hash)),
            }),
            Synced::Symlink { target } => deletes.push(Change::Unlink {
                path: path.to_string(),
                base: Some(target.clone()),
            }),
        };

        for (path, cur) in snapshot {
            seen.insert(path.as_str());
            let old = synced.get(path.as_str());
            match cur {
                Cur::Skip => {
                    report.pending_open += 1;
                    again.push(path.clone());
                }
                Cur::MountOnly => {
                    if let Some(old) = old {
                        remove_old(path, old, &mut deletes, &mut rmdirs);
                        next.push((path.clone(), None));
                    }
                }
                Cur::Dir { mode, xattrs } => match old {
                    Some(Synced::Dir { mode: m, xattrs: x }) if m == mode && x == xattrs => {}
                    Some(Synced::Dir { xattrs: x, .. }) => {
                        chmods.push(Change::Chmod {
                            path: path.clone(),
                            mode: *mode,
                            mtime_ns: None,
                            base: None,
                            xattrs: xattr_delta(x, xattrs),
                        });
                        next.push((
                            path.clone(),
                            Some(Synced::Dir {
                                mode: *mode,
                                xattrs: xattrs.clone(),
                            }),
                        ));
                    }
                    _ => {
                        if let Some(old) = old {
                            remove_old(path, old, &mut deletes, &mut rmdirs);
                        }
                        mkdirs.push(Change::Mkdir {
                            path: path.clone(),
                            mode: *mode,
                        });
                        if let Some(delta) = xattr_delta(&BTreeMap::new(), xattrs) {
                            chmods.push(Change::Chmod {
                                path: path.clone(),
                                mode: *mode,
                                mtime_ns: None,
                                base: None,
                                xattrs: Some(delta),
                            });
                        }
                        next.push((
                            path.clone(),
                            Some(Synced::Dir {
                                mode: *mode,
                                xattrs: xattrs.clone(),
                            }),
                        ));
                    }
                },
                Cur::Symlink { target } => match old {
                    Some(Synced::Symlink { target: t }) if t == target => {}
                    _ => {
                        if let Some(old @ (Synced::Dir { .. } | Synced::File { .. })) = old {
                            remove_old(path, old, &mut deletes, &mut rmdirs);
                        }
                        writes.push(Change::Symlink {
                            path: path.clone(),
                            target: target.clone(),
                        });
                        next.push((
                            path.clone(),
                            Some(Synced::Symlink {
                                target: target.clone(),
                            }),
                        ));
                    }
                },
                Cur::File(f) => {
                    let (hash, hashed) = match &f.known {
                        Some(h) => (*h, None),
                        None => match self.hash_upper(f.ino, &mut pending_blocks)? {
                            Some(hd) => (hd.hash, Some(hd)),
                            None => {
                                again.push(path.clone());
                                continue;
                            }
                        },
                    };
                    if hashed.is_some() {
                        cleaned.push((f.ino, f.generation, hash));
                    }
                    let link_to = if f.nlink > 1 {
                        match first_name.get(&f.ino) {
                            Some((p, h)) if *h == hash => Some(p.clone()),
                            Some(_) => None,
                            None => {
                                first_name.insert(f.ino, (path.clone(), hash));
                                None
                            }
                        }
                    } else {
                        None
                    };
                    let base = match old {
                        Some(Synced::File {
                            hash: h,
                            mode: m,
                            mtime_ns: t,
                            xattrs: x,
                        }) if *h == hash => {
                            if f.nlink > 1 {
                                unchanged_name
                                    .entry(f.ino)
                                    .or_insert_with(|| (path.clone(), hash));
                            }
                            // Same content: send a new mode, mtime (`touch`) or extended
                            // attributes alone.
                            let new_time = t.is_some_and(|t| t != f.mtime_ns);
                            let delta = xattr_delta(x, &f.xattrs);
                            if *m != f.mode || new_time || delta.is_some() {
                                chmods.push(Change::Chmod {
                                    path: path.clone(),
                                    mode: f.mode,
                                    mtime_ns: new_time.then_some(f.mtime_ns),
                                    base: new_time.then(|| hex::encode(hash)),
                                    xattrs: delta,
                                });
                                next.push((
                                    path.clone(),
                                    Some(Synced::File {
                                        hash,
                                        mode: f.mode,
                                        mtime_ns: Some(f.mtime_ns),
                                        xattrs: f.xattrs.clone(),
                                    }),
                                ));
                            }
                            continue;
                        }
                        Some(Synced::File { hash: h, .. }) => Some(hex::encode(h)),
                        Some(other) => {
                            remove_old(path, other, &mut deletes, &mut rmdirs);
                            None
                        }
                        None => None,
                    };
                    // A clean file whose content differs from what the export has at this
                    // path (it was renamed here): its blocks are in the manifest (remote
                    // content) or must be read from the upper file. The export already has
                    // them either way, so nothing is uploaded.
                    let hd = match (hashed, &f.blocks) {
                        (Some(hd), _) => hd,
                        (None, Some(blocks)) => Hashed {
                            hash,
                            size: f.size,
                            blocks: blocks.clone(),
                        },
                        (None, None) => match self.hash_upper(f.ino, &mut pending_blocks)? {
                            Some(hd) => hd,
                            None => {
                                again.push(path.clone());
                                continue;
                            }
                        },
                    };
                    let hash = hd.hash;
                    if f.nlink > 1 && link_to.is_none() {
                        unlinked_writes.push((writes.len(), f.ino, hash));
                    }
                    writes.push(Change::Write {
                        path: path.clone(),
                        mode: f.mode,
                        base,
                        hash: hex::encode(hash),
                        size: hd.size,
                        blocks: hd.blocks,
                        mtime_ns: f.mtime_ns,
                        link_to,
                        xattrs: (!f.xattrs.is_empty()).then(|| f.xattrs.clone()),
                    });
                    next.push((
                        path.clone(),
                        Some(Synced::File {
                            hash,
                            mode: f.mode,
                            mtime_ns: Some(f.mtime_ns),
                            xattrs: f.xattrs.clone(),
                        }),
                    ));
                }
            }
        }
        for (i, ino, hash) in unlinked_writes {
            if let Some((anchor, h)) = unchanged_name.get(&ino)
                && *h == hash
                && let Some(Change::Write { link_to, .. }) = writes.get_mut(i)
            {
                *link_to = Some(anchor.clone());
            }
        }
        // Paths that are gone: anywhere (a full round) or at and below the changed paths.
        // Paths skipped as open keep their synced state.
        let mut gone = |path: &String, old: &Synced| {
            if !seen.contains(path.as_str()) {
                remove_old(path, old, &mut deletes, &mut rmdirs);
                next.push((path.clone(), None));
            }
        };
        match &snap.scope {
            Scope::All => synced.iter().for_each(|(p, o)| gone(p, o)),
            Scope::Subtrees(roots) => {
                for root in roots {
                    if let Some((p, o)) = synced.get_key_value(root.as_str()) {
                        gone(p, o);
                    }
                    let prefix = format!("{root}/");
                    synced
                        .range::<str, _>((Bound::Included(prefix.as_str()), Bound::Unbounded))
                        .take_while(|(p, _)| p.starts_with(&prefix))
                        .for_each(|(p, o)| gone(p, o));
                }
            }
        }
        // Removed-then-recreated paths already queued their removal above.
        rmdirs.sort_by_key(|p| std::cmp::Reverse(p.matches('/').count()));
        rmdirs.dedup();
        mkdirs.sort_by_key(|c| c.path().matches('/').count());

        let mut changes = deletes;
        changes.extend(rmdirs.into_iter().map(|path| Change::Rmdir { path }));
        changes.extend(mkdirs);
        changes.extend(writes);
        changes.extend(chmods);
        if changes.is_empty() {
            return Ok(report);
        }

        // Upload what the export lacks.
        let mut wanted: Vec<String> = Vec::new();
        let mut wanted_set = HashSet::new();
        for c in &changes {
            if let Change::Write { blocks, .. } = c {
                for b in blocks {
                    if wanted_set.insert(b.clone()) {
                        wanted.push(b.clone());
                    }
                }
            }
        }
        let mut uploaded = 0u64;
        if !wanted.is_empty() {
            // The export answers at most 65,536 hashes per question.
            let mut missing = Vec::new();
            for chunk in wanted.chunks(MISSING_BATCH) {
                missing.extend(
                    self.fs
                        .remote
                        .missing(chunk)
                        .map_err(|source| SyncError::Remote { source })?,
                );
            }
            let mut batch: Vec<([u8; 32], &[u8])> = Vec::new();
            let mut batch_bytes = 0usize;
            for h in &missing {
                let (Some(bytes), Some(raw)) = (pending_blocks.get(h), parse_hash(h)) else {
                    continue;
                };
                batch.push((raw, bytes));
                batch_bytes += bytes.len();
                uploaded += bytes.len() as u64;
                if batch_bytes >= UPLOAD_BATCH_BYTES {
                    self.fs
                        .remote
                        .upload(&batch)
                        .map_err(|source| SyncError::Remote { source })?;
                    batch.clear();
                    batch_bytes = 0;
                }
            }
            if !batch.is_empty() {
                self.fs
                    .remote
                    .upload(&batch)
                    .map_err(|source| SyncError::Remote { source })?;
            }
        }

        if tracing::enabled!(tracing::Level::TRACE) {
            for c in &changes {
                tracing::trace!(change = ?c, "sync change");
            }
        }
        // One commit per round, unless the round is larger than the export takes in one
        // (100,000 changes, 64 MiB): then consecutive commits in the same order. If a later
        // one fails, the round is retried whole; the export answers what the earlier ones
        // already applied as no-ops (same content, directory exists, path already gone).
        let all_changes = changes.len();
        let mut files_written = 0;
        let mut result = CommitResult {
            commit_id: String::new(),
            applied: 0,
            conflicts: Vec::new(),
        };
        let mut rest = changes;
        while !rest.is_empty() {
            let mut take = 0;
            let mut bytes = 0usize;
            while take < rest.len() && take < COMMIT_CHANGES && bytes < COMMIT_BYTES {
                bytes += approx_size(&rest[take]);
                take += 1;
            }
            let tail = rest.split_off(take);
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            let cs = ChangeSet {
                commit_id: format!("{}-{seq}", self.instance),
                changes: rest,
            };
            rest = tail;
            files_written += cs
                .changes
                .iter()
                .filter(|c| matches!(c, Change::Write { .. }))
                .count();
            let r = self
                .fs
                .remote
                .commit(&cs)
                .map_err(|source| SyncError::Remote { source })?;
            result.commit_id = r.commit_id;
            result.applied += r.applied;
            result.conflicts.extend(r.conflicts);
        }
        for conflict in &result.conflicts {
            tracing::warn!(path = %conflict.path, reason = %conflict.reason,
                kept_as = ?conflict.kept_as, "write-back conflict: the Delegator's copy changed");
        }
        // Conflicting changes count as done too: the export kept our version beside its own,
        // and re-sending would only make more copies.
        if let Some(log) = &self.log {
            let records: Vec<SyncedRecord> = next
                .iter()
                .map(|(path, state)| SyncedRecord {
                    path: path.clone(),
                    state: state.clone(),
                })
                .collect();
            if let Err(e) = log.append(&records) {
                // Recovery would re-send these changes; the export treats them as no-ops.
                tracing::warn!(error = %e, "cannot append to synced.log");
            }
        }
        for (path, s) in next {
            match s {
                Some(s) => synced.insert(path, s),
                None => synced.remove(&path),
            };
        }
        {
            let mut table = self.fs.table.lock();
            for (ino, generation, hash) in cleaned {
                if let Some(node) = table.get_mut(ino)
                    && let Data::Local {
                        generation: g,
                        dirty: true,
                        ..
                    } = node.data
                    && g == generation
                {
                    node.data = Data::Local {
                        dirty: false,
                        hash: Some(hash),
                        generation: g,
                    };
                }
            }
        }
        report.files_written = files_written;
        report.changes = all_changes;
        report.conflicts = result.conflicts.clone();
        self.fs
            .stats
            .add_commit(report.files_written as u64, uploaded, &result.conflicts);
        tracing::debug!(
            changes = report.changes,
            files = report.files_written,
            "committed"
        );
        Ok(report)
    }

    /// Background loop: a round shortly after each request, retrying failures with backoff,
    /// until `signal` is stopped or the lease ends.
    pub fn run(self: Arc<Self>, signal: Arc<SyncSignal>, debounce: Duration) {
        let mut backoff = Duration::from_millis(100);
        let mut retry = false;
        loop {
            // Files written without a handle are taken once quiet: come back for them.
            let quiet_in = self.fs.next_quiet_in();
            let wait = if retry {
                backoff
            } else {
                quiet_in.unwrap_or(Duration::from_secs(1))
            };
            match signal.wait(wait) {
                None => return,
                Some(false) if !retry && quiet_in.is_none() => continue,
                Some(true) => std::thread::sleep(debounce),
                Some(false) => {}
            }
            // A file written without a handle a moment ago: wait until it is quiet rather
            // than run a round that leaves it out (at most WRITE_QUIET; a created, unwritten
            // file waits longer, in a later round).
            if let Some(d) = self.fs.next_quiet_in()
                && d <= super::fs::WRITE_QUIET
            {
                std::thread::sleep(d);
            }
            match self.round(false) {
                Ok(_) => {
                    retry = false;
                    backoff = Duration::from_millis(100);
                }
                Err(e) if e.is_fatal() => {
                    tracing::warn!(error = %e, "write-back stopped: the lease is over");
                    self.fs.stats.add_sync_error(format!("{e:#}"));
                    return;
                }
                Err(e) => {
                    let msg = format!("{}: {}", e, source_chain(&e));
                    tracing::warn!(error = %msg, "write-back failed; retrying");
                    self.fs.stats.add_sync_error(msg);
                    retry = true;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }
}

/// Render an error's sources after the top-level message.
pub fn source_chain(e: &dyn std::error::Error) -> String {
    let mut parts = Vec::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        parts.push(s.to_string());
        cur = s.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synced_log_lines_keep_hex_hashes() {
        let h = *blake3::hash(b"content").as_bytes();
        let rec = SyncedRecord {
            path: "a".into(),
            state: Some(Synced::File {
                hash: h,
                mode: 0o644,
                mtime_ns: Some(5),
                xattrs: BTreeMap::new(),
            }),
        };
        let line = serde_json::to_string(&rec).unwrap();
        assert!(line.contains(&hex::encode(h)), "{line}");
        assert_eq!(serde_json::from_str::<SyncedRecord>(&line).unwrap(), rec);
        // A line written before hashes were raw (an empty hash for a file without one).
        let old = r#"{"path":"b","state":{"kind":"file","hash":"","mode":420}}"#;
        let r: SyncedRecord = serde_json::from_str(old).unwrap();
        assert!(matches!(r.state, Some(Synced::File { hash, .. }) if hash == [0; 32]));
    }

    #[test]
    fn coverage_of_changed_subtrees() {
        let roots: HashSet<String> = ["a/b".to_string()].into();
        assert!(covered(&roots, "a/b"));
        assert!(covered(&roots, "a/b/c/d"));
        assert!(!covered(&roots, "a/bc"));
        assert!(!covered(&roots, "a"));
        assert!(below_any(&roots, "a/b/c"));
        assert!(!below_any(&roots, "a/b"));
    }
}
