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
//! Commits are idempotent and their outcome is learnable: each has an id (this syncer's
//! random instance and a sequence number), and before it is sent it is written, with what
//! it leaves at each path, to `synced.log` as the *pending* commit ([`PendingCommit`]).
//! When its answer comes, the new states and a `resolved` mark are appended. A commit whose
//! answer never came (a reset, a timeout, the mount killed) stays pending, and the next
//! round — or crash recovery, which reads it back from `synced.log` — sends it again,
//! unchanged and under the same id, before comparing anything: the export answers a
//! commit it already applied with its first outcome, and applies one it never received.
//! Only then is the tree compared, against what that commit left. Without this, a commit
//! applied but unanswered would be diffed again from the state before it, and the mount's
//! own change would meet itself at the export as a Delegator-side change: a conflict that
//! keeps the older version, or a deleted file brought back.
//!
//! A file still open for writing is left for a later round (live mode syncs on close and
//! fsync) unless the round is a final flush.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::Read;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use awcp_protocol::dataplane::{
    Change, ChangeSet, CommitResult, Conflict, CurrentState, EntryKind, Held, Manifest,
    ManifestEntry,
};

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
/// Upper files a round flushes one by one before its commit; past this, one `syncfs` of
/// the state disk is cheaper.
const SYNC_ONE_BY_ONE: usize = 64;

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

/// How long the agent's requests must have paused before a write-back round runs (see
/// [`after_pause`]).
pub const SYNC_PAUSE: Duration = Duration::from_millis(20);

/// Longest a round waits for that pause: the changes of an agent whose requests never pause
/// still reach the Delegator about once a second.
pub const SYNC_MAX_WAIT: Duration = Duration::from_secs(1);

/// Sleep at least `min`, then until `ops()` (the mount's count of FUSE requests served) has
/// not moved for `pause`, at most `max` in all or until `stop()`. Returns the time waited.
///
/// A round hashes, uploads and commits beside the agent, on the same CPUs: run while the
/// agent works (a `git add` and `git commit` of 200 files, 400 objects written as it goes),
/// rounds made that command ~15 % slower on two CPUs. Between two of an agent's commands its
/// requests pause, and a round then takes nothing from it.
pub fn after_pause(
    ops: impl Fn() -> u64,
    min: Duration,
    pause: Duration,
    max: Duration,
    stop: impl Fn() -> bool,
) -> Duration {
    const STEP: Duration = Duration::from_millis(5);
    let start = Instant::now();
    let mut seen = ops();
    // The wake-up came from a request: count the agent as active from here.
    let mut moved = start;
    loop {
        let now = Instant::now();
        let waited = now - start;
        if waited >= max || (waited >= min && now - moved >= pause) || stop() {
            return waited;
        }
        let left = if waited < min {
            min - waited
        } else {
            pause - (now - moved)
        };
        std::thread::sleep(left.min(STEP).min(max - waited));
        let n = ops();
        if n != seen {
            seen = n;
            moved = Instant::now();
        }
    }
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

    /// Whether the background loop was told to stop.
    fn stopped(&self) -> bool {
        self.state.lock().1
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

/// A commit sent, or about to be, whose answer the mount has not seen; kept in `synced.log`
/// until it is resolved (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PendingCommit {
    /// The change set, with its id, exactly as sent.
    pub set: ChangeSet,
    /// What the export has at each path once it is applied (conflicts included: the export
    /// keeps our version beside its own, so those changes count as done too).
    pub next: Vec<SyncedRecord>,
}

/// One line of `synced.log`. Lines of a kind a reader does not know are skipped, so older
/// readers see only the records.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum LogLine {
    /// About to send this commit.
    Pending {
        /// The commit.
        pending: PendingCommit,
    },
    /// The pending commit with this id is answered (its records precede the mark) or was
    /// refused without being applied.
    Resolved {
        /// The commit id.
        resolved: String,
    },
    /// A path's state at the export.
    Record(SyncedRecord),
}

/// What `synced.log` holds: the states commits and Delegator-side changes left, and the
/// commit that was sent but never answered, if any.
#[derive(Debug, Default, Clone)]
pub struct SyncedLogContents {
    /// Every state record, in order.
    pub records: Vec<SyncedRecord>,
    /// The last commit written as pending and not resolved.
    pub pending: Option<PendingCommit>,
    /// Earlier commits written as pending and never resolved, though a later one was sent
    /// (their `resolved` line could not be written: a full state disk), each with the
    /// number of `records` before the next commit's pending line — where what it left
    /// belongs, if the export applied it (recovery asks: see [`super::recover`]).
    pub unanswered: Vec<(usize, PendingCommit)>,
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
        let mut buf = Vec::new();
        for r in records {
            serde_json::to_writer(&mut buf, r).map_err(std::io::Error::other)?;
            buf.push(b'\n');
        }
        self.write_synced(&buf)
    }

    /// Record `commit` as about to be sent.
    fn append_pending(&self, commit: &PendingCommit) -> std::io::Result<()> {
        let mut buf = serde_json::to_vec(&LogLine::Pending {
            pending: commit.clone(),
        })
        .map_err(std::io::Error::other)?;
        buf.push(b'\n');
        self.write_synced(&buf)
    }

    /// Record that commit `id` is resolved, after the states it left (`records`). Synced
    /// only when `sync`: the line of an answered commit need not be, as its loss costs
    /// nothing — recovery finds the commit pending, sends it again, and the export (which
    /// synced the outcome before it answered, and remembers thousands) answers with the
    /// first outcome. The next commit's pending line is synced before it is sent, and
    /// with it every earlier line of the file.
    fn append_resolved(
        &self,
        records: &[SyncedRecord],
        id: &str,
        sync: bool,
    ) -> std::io::Result<()> {
        let mut buf = Vec::new();
        for r in records {
            serde_json::to_writer(&mut buf, r).map_err(std::io::Error::other)?;
            buf.push(b'\n');
        }
        serde_json::to_writer(
            &mut buf,
            &LogLine::Resolved {
                resolved: id.to_owned(),
            },
        )
        .map_err(std::io::Error::other)?;
        buf.push(b'\n');
        super::journal::append_whole(&mut self.file.lock(), &buf, sync)
    }

    /// Make every line appended so far durable.
    fn sync(&self) -> std::io::Result<()> {
        self.file.lock().sync_data()
    }

    fn write_synced(&self, buf: &[u8]) -> std::io::Result<()> {
        // Synced to disk: after a machine crash, recovery must not re-send (and turn into
        // conflicts) what the Delegator already has.
        super::journal::append_whole(&mut self.file.lock(), buf, true)
    }

    /// Every complete record at `path` (a torn last line is ignored).
    pub fn read_all(path: &std::path::Path) -> std::io::Result<Vec<SyncedRecord>> {
        Ok(Self::read(path)?.records)
    }

    /// Everything the log at `path` holds (a torn last line is ignored: a pending commit
    /// whose line is torn was never sent).
    pub fn read(path: &std::path::Path) -> std::io::Result<SyncedLogContents> {
        use std::io::BufRead;
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(SyncedLogContents::default());
            }
            Err(e) => return Err(e),
        };
        let mut out = SyncedLogContents::default();
        for line in std::io::BufReader::new(file).split(b'\n') {
            match serde_json::from_slice(&line?) {
                Ok(LogLine::Record(r)) => out.records.push(r),
                Ok(LogLine::Pending { pending }) => {
                    if let Some(earlier) = out.pending.replace(pending) {
                        out.unanswered.push((out.records.len(), earlier));
                    }
                }
                Ok(LogLine::Resolved { resolved }) => {
                    if out
                        .pending
                        .as_ref()
                        .is_some_and(|p| p.set.commit_id == resolved)
                    {
                        out.pending = None;
                    }
                    out.unanswered.retain(|(_, p)| p.set.commit_id != resolved);
                }
                Err(_) => {}
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
    /// The commit could not be recorded in `synced.log` (a full or failing state disk), so
    /// it was not sent.
    #[error("cannot record the commit in synced.log (is the state directory full?)")]
    StateLog {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The changes could not be made durable on the state disk (`fsync` failed), so they
    /// were not sent.
    #[error(
        "cannot make the changes durable in the state directory before writing them back (is its disk failing?)"
    )]
    StateSync {
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
    /// Writes the export's commit screen held (kept on the mount, not applied).
    pub held: Vec<Held>,
    /// Files skipped because they are still open for writing.
    pub pending_open: usize,
    /// Files not sent because the export held exactly their content before.
    pub held_unchanged: usize,
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

/// Hash `f` from where it is, in blocks of `bs` bytes, putting each block in `pending` under
/// its hash.
///
/// Each block's buffer is sized by what the file holds (it grows if the file grew since its
/// size was taken): a block-sized buffer for every small file kept a megabyte per file in
/// `pending` until the round's upload, and the allocator had the kernel fault in and zero a
/// fresh huge page for most of them — a 200-file commit took a mount from 130 MB to over
/// 1 GB resident.
fn hash_blocks(
    f: &mut std::fs::File,
    bs: usize,
    pending: &mut HashMap<String, Vec<u8>>,
) -> std::io::Result<Hashed> {
    let mut whole = blake3::Hasher::new();
    let mut blocks = Vec::new();
    let mut size = 0u64;
    let mut left = f.metadata()?.len();
    loop {
        let mut buf = Vec::with_capacity(usize::try_from(left).unwrap_or(bs).min(bs));
        f.take(bs as u64).read_to_end(&mut buf)?;
        if buf.is_empty() {
            break;
        }
        whole.update(&buf);
        size += buf.len() as u64;
        left = left.saturating_sub(buf.len() as u64);
        let h = blake3::hash(&buf).to_hex().to_string();
        blocks.push(h.clone());
        let short = buf.len() < bs;
        pending.insert(h, buf);
        if short {
            break;
        }
    }
    Ok(Hashed {
        hash: *whole.finalize().as_bytes(),
        size,
        blocks,
    })
}

/// The write-back engine of one mount.
pub struct Syncer {
    fs: Arc<AwcpFs>,
    pub(super) synced: Mutex<BTreeMap<String, Synced>>,
    /// Per path, the highest export change sequence this mount knows of there (its own
    /// commits' and the events it applied): events no newer are stale (see `upstream`).
    /// Taken after `synced`.
    pub(super) seen: Mutex<BTreeMap<String, u64>>,
    /// The commit sent whose answer has not come (also in `synced.log`). Taken after
    /// `synced`.
    pending: Mutex<Option<PendingCommit>>,
    /// Writes the export held (path → the content hash it held): not sent again while the
    /// file keeps that content, sent again once it changes or the export releases the path
    /// ([`Syncer::release`]). The export still has the state in `synced` there.
    held: Mutex<HashMap<String, Hash>>,
    /// Delegator-side changes refused because the mount had a change of its own there (see
    /// `upstream`): per path, the latest one's sequence and entry (`None`: removed). Judged
    /// again after every round, so one whose path turns out clean (the mount's change was
    /// dropped in a conflict, or was no change after all) is not lost. Taken last.
    pub(super) refused: Mutex<BTreeMap<String, (u64, Option<ManifestEntry>)>>,
    /// The Delegator's state described by commit answers (`CommitResult::current`) with
    /// their sequences, shown after the round ([`Syncer::apply_settled`]).
    pub(super) answered: Mutex<Vec<(u64, CurrentState)>>,
    /// Run after every round with the syncer's locks released, to show what the round
    /// learned of the Delegator's state (the mount installs it: it tells the kernel);
    /// without one, the round shows it itself.
    after_round: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    log: Option<SyncedLog>,
    /// Upper files read for the round being built: made durable before its commit is
    /// recorded (see [`Syncer::make_durable`]).
    to_sync: Mutex<Vec<Ino>>,
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
            seen: Mutex::new(BTreeMap::new()),
            pending: Mutex::new(None),
            held: Mutex::new(HashMap::new()),
            refused: Mutex::new(BTreeMap::new()),
            answered: Mutex::new(Vec::new()),
            after_round: std::sync::OnceLock::new(),
            log: None,
            to_sync: Mutex::new(Vec::new()),
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

    /// Take over a commit an earlier process sent and never saw answered (read from its
    /// `synced.log`): the next round sends it again first, under its own id.
    pub fn resume_pending(&self, pending: Option<PendingCommit>) {
        if let Some(p) = &pending {
            tracing::info!(commit = %p.set.commit_id, changes = p.set.changes.len(),
                "a commit was sent but never answered: sending it again before anything else");
        }
        *self.pending.lock() = pending;
    }

    /// The commit sent whose answer has not come, if any.
    pub fn pending(&self) -> Option<PendingCommit> {
        self.pending.lock().clone()
    }

    /// The paths the commit whose answer has not come changes (empty when there is none):
    /// the export may already have applied them without the mount knowing at which
    /// sequence, so an event there cannot be told from the commit's own echo.
    pub(super) fn pending_paths(&self) -> BTreeSet<String> {
        self.pending
            .lock()
            .as_ref()
            .map_or_else(BTreeSet::new, |p| {
                p.set
                    .changes
                    .iter()
                    .map(|c| c.path().to_owned())
                    .chain(p.next.iter().map(|r| r.path.clone()))
                    .collect()
            })
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
        let busy = &self.fs.quiet_writes(&mut table, include_open);
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
        let hashed = hash_blocks(&mut f, bs, pending).map_err(|source| SyncError::Io { source })?;
        // The node's upper file is recycled for another new file only after the node left
        // the table (`super::upper`): if it is still there now, what was read was its own.
        if self.fs.table.lock().get(ino).is_none() {
            return Ok(None);
        }
        self.to_sync.lock().push(ino);
        Ok(Some(hashed))
    }

    /// Run one round: commit every change since the last one. `final_flush` includes files
    /// still open for writing.
    pub fn round(&self, final_flush: bool) -> Result<RoundReport, SyncError> {
        let result = self.round_locked(final_flush);
        // What the round learned of the Delegator's state, and events refused earlier that
        // may apply now: shown with the syncer's locks released.
        if self.has_settled() {
            match self.after_round.get() {
                Some(f) => f(),
                None => {
                    let _ = self.apply_settled();
                }
            }
        }
        result
    }

    /// Install what runs after every round (see `after_round`); only the first is kept.
    pub fn set_after_round(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.after_round.set(f);
    }

    fn round_locked(&self, final_flush: bool) -> Result<RoundReport, SyncError> {
        let mut synced = self.synced.lock();
        // First the commit whose answer never came: what it left is the base of this round.
        let earlier = self.settle_pending(&mut synced)?;
        // The writes closed so far, taken before the tree is read: this round's commits
        // carry each of them, and their write-back lag ends with its answer.
        let closed = self.fs.stats.take_closed_writes();
        let oldest = super::stats::Stats::oldest(&closed);
        let snap = self.snapshot(final_flush);
        let mut again: Vec<String> = Vec::new();
        let result = self.round_over(&mut synced, &snap, &mut again, oldest);
        if final_flush
            && let Some(log) = &self.log
            && let Err(e) = log.sync()
        {
            // Not needed for safety (see `SyncedLog::append_resolved`): recovery would
            // only ask the export again.
            tracing::warn!(error = %e, "cannot sync synced.log after the final flush");
        }
        self.fs.stats.closed_writes_done(closed, result.is_ok());
        match result {
            Ok(mut report) => {
                if let Some((set, r)) = earlier {
                    report.changes += set.changes.len();
                    report.files_written += set
                        .changes
                        .iter()
                        .filter(|c| matches!(c, Change::Write { .. }))
                        .count();
                    report.conflicts.splice(0..0, r.conflicts);
                    report.held.splice(0..0, r.held);
                }
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
        oldest_close: Option<std::time::Instant>,
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
                    let unchanged = matches!(old, Some(Synced::File { hash: h, .. }) if *h == hash);
                    if !unchanged && self.is_held(path, &hash) {
                        // The export held exactly this content: not again until it changes
                        // (or the export releases it).
                        report.held_unchanged += 1;
                        continue;
                    }
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
                                    // Always: an export that finds other content there
                                    // describes it in its answer (the mount shows it).
                                    base: Some(hex::encode(hash)),
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
        // (100,000 changes, 64 MiB): then consecutive commits in the same order, each
        // recording what it left as it is answered. If one fails, the round fails; the
        // next sends that commit again (it is pending) and compares from what it left.
        let all_changes = changes.len();
        let mut chunks: Vec<Vec<Change>> = Vec::new();
        let mut rest = changes;
        while !rest.is_empty() {
            let mut take = 0;
            let mut bytes = 0usize;
            while take < rest.len() && take < COMMIT_CHANGES && bytes < COMMIT_BYTES {
                bytes += approx_size(&rest[take]);
                take += 1;
            }
            let tail = rest.split_off(take);
            chunks.push(rest);
            rest = tail;
        }
        let nexts = split_next(&chunks, next);
        self.make_durable()?;
        let mut files_written = 0;
        let mut conflicts: Vec<Conflict> = Vec::new();
        let mut held: Vec<Held> = Vec::new();
        for (changes, next) in chunks.into_iter().zip(nexts) {
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            let pending = PendingCommit {
                set: ChangeSet {
                    commit_id: format!("{}-{seq}", self.instance),
                    changes,
                    // How long its oldest change has waited: the export's write-back lag
                    // starts from it, with no clock shared between the machines.
                    age_ms: oldest_close
                        .map(|t| u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)),
                },
                next,
            };
            files_written += pending
                .set
                .changes
                .iter()
                .filter(|c| matches!(c, Change::Write { .. }))
                .count();
            let r = self.send_commit(synced, pending)?;
            conflicts.extend(r.conflicts);
            held.extend(r.held);
        }
        for conflict in &conflicts {
            tracing::warn!(path = %conflict.path, reason = %conflict.reason,
                kept_as = ?conflict.kept_as, "write-back conflict: the Delegator's copy changed");
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
        self.fs
            .stats
            .add_commit(report.files_written as u64, uploaded, &conflicts);
        report.conflicts = conflicts;
        report.held = held;
        tracing::debug!(
            changes = report.changes,
            files = report.files_written,
            "committed"
        );
        Ok(report)
    }

    /// Make what the round's commits describe durable on the state disk before they are
    /// recorded and sent: the journal (the tree they were read from), the upper files they
    /// carry and the upper directory's names. Once the export applies a commit, the
    /// Delegator has that content; were the local copy older after a power loss, recovery
    /// would send the older (or torn) copy back over it as the mount's latest change. They
    /// must be durable before the pending line is: recovery sends a pending commit again
    /// without asking, and then its paths' local copies as the latest change.
    ///
    /// Every file still gets its own `fdatasync` (the upper directory an `fsync`): what is
    /// promised does not rest on how one filesystem orders its writes. But they are issued
    /// together from a few threads, not one after another, so the filesystem can commit
    /// them in one journal transaction and one cache flush (ext4 joins concurrent syncs;
    /// one by one, each waits for a commit of its own).
    fn make_durable(&self) -> Result<(), SyncError> {
        let inos = std::mem::take(&mut *self.to_sync.lock());
        if self.log.is_none() {
            // A recovery bundle, or a syncer without state: nothing to protect.
            return Ok(());
        }
        let io = |source| SyncError::StateSync { source };
        let upper = std::fs::File::open(&self.fs.opts.upper_dir).map_err(io)?;
        if inos.len() > SYNC_ONE_BY_ONE {
            // One call instead of a flush per file (each a journal commit on ext4).
            return nix::unistd::syncfs(&upper).map_err(|e| io(e.into()));
        }
        let mut files = Vec::with_capacity(inos.len());
        for ino in inos {
            match std::fs::File::open(self.fs.upper_path(ino)) {
                Ok(f) => files.push(f),
                // Removed since (its node is gone, and so is its change).
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(e)),
            }
        }
        let mut targets: Vec<(&std::fs::File, bool)> = files.iter().map(|f| (f, false)).collect();
        targets.push((self.fs.journal.sync_handle(), false));
        targets.push((&upper, true));
        crate::durable::sync_together(&targets).map_err(io)
    }

    /// Send one commit: recorded as pending first (in memory and, synced, in `synced.log`),
    /// then sent; on an answer, what it left is recorded and it is resolved. A failure
    /// with no answer leaves it pending, for the next round to send again.
    fn send_commit(
        &self,
        synced: &mut BTreeMap<String, Synced>,
        pending: PendingCommit,
    ) -> Result<CommitResult, SyncError> {
        if let Some(log) = &self.log
            && let Err(source) = log.append_pending(&pending)
        {
            // Not sent: a commit the export applied but `synced.log` does not name would
            // look, to crash recovery, like the Delegator's own change at every path it
            // wrote, and be kept as conflict copies of the mount's own work. The changes
            // stay in the journal; the round is retried once the state disk has room.
            tracing::warn!(error = %source,
                "cannot record the pending commit in synced.log: not sending it until the state directory has room");
            return Err(SyncError::StateLog { source });
        }
        *self.pending.lock() = Some(pending.clone());
        match self.fs.remote.commit(&pending.set) {
            Ok(r) => {
                self.finish_commit(synced, &pending, &r);
                Ok(r)
            }
            Err(source) => {
                if never_applied(&source) {
                    self.drop_pending(&pending.set.commit_id);
                }
                Err(SyncError::Remote { source })
            }
        }
    }

    /// Send the pending commit again, if there is one, and record its outcome: the first
    /// one if the export had applied it, or the one it gets now. Returns it, or `None`
    /// when there was none or the export refused it without applying it (then the round
    /// compares from the state before it, which is the export's).
    fn settle_pending(
        &self,
        synced: &mut BTreeMap<String, Synced>,
    ) -> Result<Option<(ChangeSet, CommitResult)>, SyncError> {
        let Some(pending) = self.pending.lock().clone() else {
            return Ok(None);
        };
        tracing::info!(commit = %pending.set.commit_id,
            "sending again a commit whose answer never came");
        match self.fs.remote.commit(&pending.set) {
            Ok(r) => {
                self.finish_commit(synced, &pending, &r);
                let files = pending
                    .set
                    .changes
                    .iter()
                    .filter(|c| matches!(c, Change::Write { .. }))
                    .count();
                self.fs.stats.add_commit(files as u64, 0, &r.conflicts);
                for c in &r.conflicts {
                    tracing::warn!(path = %c.path, reason = %c.reason, kept_as = ?c.kept_as,
                        "write-back conflict: the Delegator's copy changed");
                }
                Ok(Some((pending.set, r)))
            }
            Err(e) if never_applied(&e) => {
                tracing::warn!(commit = %pending.set.commit_id, error = %e,
                    "the export refused a commit sent again without applying it; comparing afresh");
                self.drop_pending(&pending.set.commit_id);
                Ok(None)
            }
            Err(source) => Err(SyncError::Remote { source }),
        }
    }

    /// The answer to `pending` came: record what it left, and where the export's change
    /// sequence stood (events described before it are stale at its paths).
    fn finish_commit(
        &self,
        synced: &mut BTreeMap<String, Synced>,
        pending: &PendingCommit,
        r: &CommitResult,
    ) {
        // A held path keeps the export's state: the records of what the commit would have
        // left there are not applied, so the file stays a local change of the mount.
        let held: HashSet<&str> = r.held.iter().map(|h| h.path.as_str()).collect();
        let next: Vec<SyncedRecord> = pending
            .next
            .iter()
            .filter(|rec| !held.contains(rec.path.as_str()))
            .cloned()
            .collect();
        if let Some(log) = &self.log
            && let Err(e) = log.append_resolved(&next, &pending.set.commit_id, false)
        {
            // Recovery would send the commit again; the export answers it from its log.
            tracing::warn!(error = %e, "cannot append to synced.log");
        }
        self.note_held(pending, r);
        for rec in &next {
            match &rec.state {
                Some(s) => synced.insert(rec.path.clone(), s.clone()),
                None => synced.remove(&rec.path),
            };
        }
        if let Some(current) = &r.current
            && !current.is_empty()
        {
            // Where the Delegator's state won and nothing of ours was kept: shown after the
            // round, at the commit's sequence (an export that gives `current` gives `seq`).
            self.answered
                .lock()
                .push((r.seq.unwrap_or(0), current.clone()));
        }
        {
            // An event refused at a path this commit changed is older than the commit: the
            // mount's change landed (or a write that conflicted keeps the mount's version
            // here, as documented), so it is not shown later. Where another change of the
            // mount's lost to the Delegator's state, it is judged again after the round.
            let mut refused = self.refused.lock();
            for c in &pending.set.changes {
                let lost = !matches!(c, Change::Write { .. })
                    && r.conflicts.iter().any(|k| k.path == c.path());
                if !lost && !held.contains(c.path()) {
                    refused.remove(c.path());
                }
            }
        }
        if let Some(seq) = r.seq {
            // A conflicting path holds the Delegator's version, not ours: its events stay
            // news.
            let conflicted: HashSet<&str> = r.conflicts.iter().map(|c| c.path.as_str()).collect();
            let mut seen = self.seen.lock();
            for c in &pending.set.changes {
                if !conflicted.contains(c.path()) && !held.contains(c.path()) {
                    super::upstream::note_seen(&mut seen, c.path(), seq);
                }
            }
        }
        let mut slot = self.pending.lock();
        if slot
            .as_ref()
            .is_some_and(|p| p.set.commit_id == pending.set.commit_id)
        {
            *slot = None;
        }
    }

    /// Remember what the export held in answer to `pending` (and forget holds on the paths
    /// it wrote), and keep the mount's status in step.
    fn note_held(&self, pending: &PendingCommit, r: &CommitResult) {
        let mut held = self.held.lock();
        for c in &pending.set.changes {
            match c {
                Change::Write { path, hash, .. } if r.held.iter().any(|h| h.path == *path) => {
                    held.insert(path.clone(), super::inode::hash_from_hex(hash));
                }
                // Written, removed or replaced: whatever was held there is not any more.
                other => {
                    held.remove(other.path());
                }
            }
        }
        drop(held);
        for h in &r.held {
            tracing::warn!(path = %h.path, reason = %h.reason,
                "write-back held by the Delegator's commit screen: the file stays on this mount and is sent again when it changes");
        }
        let written: Vec<&str> = pending
            .set
            .changes
            .iter()
            .map(Change::path)
            .filter(|p| !r.held.iter().any(|h| h.path == *p))
            .collect();
        self.fs.stats.note_held(&r.held, &written);
    }

    /// Whether the export held exactly this content at `path`.
    fn is_held(&self, path: &str, hash: &Hash) -> bool {
        self.held.lock().get(path) == Some(hash)
    }

    /// The paths whose last write the export held (nothing of the mount's has been applied
    /// there since): while there are any, the mount's changes are not all written back.
    pub fn held_paths(&self) -> Vec<String> {
        let mut v: Vec<String> = self.held.lock().keys().cloned().collect();
        v.sort();
        v
    }

    /// The export released held `paths` (the reason for holding them is gone): forget the
    /// holds and compare them at the next round, which sends them again.
    pub fn release(&self, paths: &[String]) {
        if paths.is_empty() {
            return;
        }
        let mut held = self.held.lock();
        let mut table = self.fs.table.lock();
        for p in paths {
            if held.remove(p).is_some() {
                tracing::info!(path = %p, "a held write-back was released: sending it again");
            }
            table.mark_path(p);
        }
        drop(table);
        drop(held);
        self.fs.stats.release_held(paths);
    }

    /// Forget the pending commit `id`: the export refused it without applying it.
    fn drop_pending(&self, id: &str) {
        if let Some(log) = &self.log
            && let Err(e) = log.append_resolved(&[], id, true)
        {
            tracing::warn!(error = %e, "cannot append to synced.log");
        }
        let mut slot = self.pending.lock();
        if slot.as_ref().is_some_and(|p| p.set.commit_id == id) {
            *slot = None;
        }
    }

    /// Background loop: a round shortly after each request, once the agent's requests pause
    /// ([`after_pause`]), retrying failures with backoff, until `signal` is stopped or the
    /// lease ends.
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
            let min = match signal.wait(wait) {
                None => return,
                Some(false) if !retry && quiet_in.is_none() => continue,
                Some(true) => debounce,
                Some(false) => Duration::ZERO,
            };
            after_pause(
                || self.fs.stats.ops_total(),
                min,
                SYNC_PAUSE,
                SYNC_MAX_WAIT,
                || signal.stopped(),
            );
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
                    if self.fs.stats.sync_succeeded() {
                        tracing::info!(
                            "write-back works again: the changes kept meanwhile are committed"
                        );
                    }
                }
                Err(e) if e.is_fatal() => {
                    tracing::warn!(error = %e, "write-back stopped: the lease is over");
                    self.fs.stats.add_sync_error(format!("{e:#}"));
                    return;
                }
                Err(e) => {
                    let msg = format!("{}: {}", e, source_chain(&e));
                    if self.fs.stats.add_sync_error(msg.clone()) {
                        // Said once per outage at error level (status.json says
                        // `unsynced: true` until a round succeeds); each retry at warn.
                        tracing::error!(error = %msg,
                            "write-back is failing: changes are kept on this machine and retried");
                    } else {
                        tracing::warn!(error = %msg, "write-back failed; retrying");
                    }
                    retry = true;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }
}

/// Whether a failed commit is known not to have been applied: the export refused it before
/// applying anything (a malformed set, missing blocks, too large, read-only), so it holds
/// no outcome for its id. Anything else — no answer, a server error, a lease that ended,
/// an unknown export — may follow an applied commit, which stays pending.
fn never_applied(e: &RemoteError) -> bool {
    matches!(
        e,
        RemoteError::Refused {
            status: 400 | 403 | 409 | 413,
            ..
        }
    )
}

/// Split a round's `next` states between its commits: each path's final state goes with
/// the last commit that changes it; a commit that changes a path a later one changes again
/// records the state it leaves in between (a removal before a creation, say). Applying
/// each commit's share as it is answered keeps `synced` true to the export even when a
/// later commit of the round fails.
fn split_next(
    chunks: &[Vec<Change>],
    next: Vec<(String, Option<Synced>)>,
) -> Vec<Vec<SyncedRecord>> {
    let mut out: Vec<Vec<SyncedRecord>> = vec![Vec::new(); chunks.len()];
    if chunks.len() <= 1 {
        if let Some(first) = out.first_mut() {
            first.extend(
                next.into_iter()
                    .map(|(path, state)| SyncedRecord { path, state }),
            );
        }
        return out;
    }
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (k, chunk) in chunks.iter().enumerate() {
        for c in chunk {
            last.insert(c.path(), k);
        }
    }
    for (k, chunk) in chunks.iter().enumerate() {
        for c in chunk {
            if last.get(c.path()).is_some_and(|l| *l > k)
                && let Some(state) = state_after(c)
            {
                out[k].push(SyncedRecord {
                    path: c.path().to_owned(),
                    state,
                });
            }
        }
    }
    let final_chunk = chunks.len() - 1;
    for (path, state) in next {
        let k = last.get(path.as_str()).copied().unwrap_or(final_chunk);
        out[k].push(SyncedRecord { path, state });
    }
    out
}

/// What a change leaves at its path, when it says so by itself (not a `chmod`).
fn state_after(c: &Change) -> Option<Option<Synced>> {
    match c {
        Change::Unlink { .. } | Change::Rmdir { .. } => Some(None),
        Change::Mkdir { mode, .. } => Some(Some(Synced::Dir {
            mode: *mode,
            xattrs: BTreeMap::new(),
        })),
        Change::Write {
            mode,
            hash,
            mtime_ns,
            xattrs,
            ..
        } => Some(Some(Synced::File {
            hash: super::inode::hash_from_hex(hash),
            mode: *mode,
            mtime_ns: Some(*mtime_ns),
            xattrs: xattrs.clone().unwrap_or_default(),
        })),
        Change::Symlink { target, .. } => Some(Some(Synced::Symlink {
            target: target.clone(),
        })),
        Change::Chmod { .. } => None,
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
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn a_round_waits_until_the_agents_requests_pause() {
        // The agent serves a request between each of the first 30 polls, then stops.
        let polls = AtomicU64::new(0);
        let ops = || {
            let n = polls.fetch_add(1, Ordering::SeqCst) + 1;
            n.min(30)
        };
        let pause = Duration::from_millis(40);
        let waited = after_pause(
            ops,
            Duration::from_millis(10),
            pause,
            Duration::from_secs(60),
            || false,
        );
        // It looked past the last request and then waited out a whole pause.
        assert!(
            polls.load(Ordering::SeqCst) > 30,
            "returned while requests came"
        );
        assert!(waited >= pause, "{waited:?}");
        assert!(
            waited < Duration::from_secs(60),
            "waited for the longest wait"
        );
    }

    #[test]
    fn a_round_waits_at_least_the_debounce_and_at_most_the_longest_wait() {
        let quiet = after_pause(
            || 7,
            Duration::from_millis(30),
            Duration::from_millis(10),
            Duration::from_secs(60),
            || false,
        );
        assert!(quiet >= Duration::from_millis(30), "{quiet:?}");
        // An agent that never pauses: the round runs at the longest wait.
        let busy = AtomicU64::new(0);
        let max = Duration::from_millis(200);
        let waited = after_pause(
            || busy.fetch_add(1, Ordering::SeqCst),
            Duration::ZERO,
            Duration::from_secs(60),
            max,
            || false,
        );
        assert!(waited >= max, "{waited:?}");
        assert!(waited < Duration::from_secs(60), "{waited:?}");
    }

    #[test]
    fn a_stopped_syncer_does_not_wait_for_a_pause() {
        let waited = after_pause(
            || 0,
            Duration::from_secs(60),
            Duration::from_secs(60),
            Duration::from_secs(120),
            || true,
        );
        assert!(waited < Duration::from_secs(60), "{waited:?}");
    }

    #[test]
    fn a_files_blocks_are_hashed_into_buffers_the_size_of_what_they_hold() {
        let dir = tempfile::tempdir().unwrap();
        let bs = 1 << 20;
        for len in [0usize, 6, 4096, bs, 2 * bs + 100] {
            let content: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let path = dir.path().join(format!("f{len}"));
            std::fs::write(&path, &content).unwrap();
            let mut pending = HashMap::new();
            let h =
                hash_blocks(&mut std::fs::File::open(&path).unwrap(), bs, &mut pending).unwrap();
            assert_eq!(h.hash, *blake3::hash(&content).as_bytes(), "{len}");
            assert_eq!(h.size, len as u64);
            let chunks: Vec<&[u8]> = content.chunks(bs).collect();
            assert_eq!(h.blocks.len(), chunks.len(), "{len}");
            for (hex, chunk) in h.blocks.iter().zip(chunks) {
                let buf = &pending[hex];
                assert_eq!(buf, chunk);
                // Not a block-sized buffer per small file: at most its own bytes (and the
                // standard library's small probe past the end).
                assert!(
                    buf.capacity() <= chunk.len().max(32) * 2,
                    "a {}-byte block held {} bytes",
                    chunk.len(),
                    buf.capacity()
                );
            }
        }
    }

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

    fn file(content: &[u8]) -> Synced {
        Synced::File {
            hash: *blake3::hash(content).as_bytes(),
            mode: 0o644,
            mtime_ns: Some(1),
            xattrs: BTreeMap::new(),
        }
    }

    fn pending(id: &str) -> PendingCommit {
        PendingCommit {
            set: ChangeSet {
                commit_id: id.into(),
                changes: vec![Change::Unlink {
                    path: "gone".into(),
                    base: Some(hex::encode(blake3::hash(b"old").as_bytes())),
                }],
                age_ms: None,
            },
            next: vec![SyncedRecord {
                path: "gone".into(),
                state: None,
            }],
        }
    }

    // A commit sent before a crash must be found again by recovery until its answer is
    // logged; a torn line (the crash came while writing it) means it was never sent.
    #[test]
    fn synced_log_keeps_the_unanswered_commit_until_it_is_resolved() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("synced.log");
        let log = SyncedLog::open(&path).unwrap();
        let rec = SyncedRecord {
            path: "a".into(),
            state: Some(file(b"a")),
        };
        log.append(std::slice::from_ref(&rec)).unwrap();
        log.append_pending(&pending("m-1")).unwrap();
        let read = SyncedLog::read(&path).unwrap();
        assert_eq!(read.records, vec![rec.clone()]);
        assert_eq!(read.pending, Some(pending("m-1")));
        // Older readers see the records only.
        assert_eq!(SyncedLog::read_all(&path).unwrap(), vec![rec.clone()]);

        log.append_resolved(&pending("m-1").next, "m-1", true)
            .unwrap();
        let read = SyncedLog::read(&path).unwrap();
        assert_eq!(read.pending, None);
        assert_eq!(read.records.len(), 2);

        // A resolution of another id leaves the pending commit pending.
        log.append_pending(&pending("m-2")).unwrap();
        log.append_resolved(&[], "m-1", true).unwrap();
        assert_eq!(
            SyncedLog::read(&path).unwrap().pending,
            Some(pending("m-2"))
        );

        // A torn pending line: never sent.
        log.append_resolved(&[], "m-2", true).unwrap();
        let line = serde_json::to_string(&LogLine::Pending {
            pending: pending("m-3"),
        })
        .unwrap();
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(&line.as_bytes()[..line.len() / 2]).unwrap();
        assert_eq!(SyncedLog::read(&path).unwrap().pending, None);
    }

    #[test]
    fn a_round_split_in_commits_records_each_commits_share() {
        let unlink = Change::Unlink {
            path: "p".into(),
            base: Some(hex::encode(blake3::hash(b"old").as_bytes())),
        };
        let mkdir = Change::Mkdir {
            path: "p".into(),
            mode: 0o755,
        };
        let other = Change::Rmdir { path: "q".into() };
        let next = vec![
            (
                "p".to_string(),
                Some(Synced::Dir {
                    mode: 0o755,
                    xattrs: BTreeMap::new(),
                }),
            ),
            ("q".to_string(), None),
        ];
        // One commit: everything in it.
        let one = split_next(
            &[vec![unlink.clone(), other.clone(), mkdir.clone()]],
            next.clone(),
        );
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].len(), 2);
        // Two: the first leaves `p` removed (its creation is in the second) and `q` done.
        let two = split_next(&[vec![unlink, other], vec![mkdir]], next);
        assert_eq!(
            two[0],
            vec![
                SyncedRecord {
                    path: "p".into(),
                    state: None
                },
                SyncedRecord {
                    path: "q".into(),
                    state: None
                },
            ]
        );
        assert_eq!(two[1].len(), 1);
        assert!(matches!(two[1][0].state, Some(Synced::Dir { .. })));
    }

    #[test]
    fn only_refusals_that_applied_nothing_drop_a_pending_commit() {
        let refused = |status| RemoteError::Refused {
            status,
            code: "X".into(),
            message: String::new(),
        };
        for s in [400, 403, 409, 413] {
            assert!(never_applied(&refused(s)), "{s}");
        }
        for s in [404, 408, 500, 502] {
            assert!(!never_applied(&refused(s)), "{s}");
        }
        assert!(!never_applied(&RemoteError::Protocol {
            what: "cut short".into()
        }));
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
