//! The filesystem operations, as plain `Result`-returning functions.
//!
//! [`AwcpFs`] holds the inode table, the open file handles, the journal and the remote. The
//! FUSE adapter (`fuse.rs`) calls one method per request and turns the error into an errno;
//! everything here can be exercised without a kernel.
//!
//! Locking: one mutex guards the inode table. File I/O runs outside it, on the upper file
//! the handle holds open. Fetching a file's content runs outside it too, with a per-inode
//! lock so two opens of a cold file fetch it once.
//!
//! Fencing: once the lease has ended, [`AwcpFs::fence`] is called and every operation —
//! including those on handles opened before — fails with [`FsError::Fenced`].

use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Instant, SystemTime};

use awcp_protocol::rawname;
use fuser::{FileAttr, FileType, INodeNo};
use parking_lot::{Mutex, RwLock};

use super::error::{EndReason, FsError};
use super::inode::{Data, Ino, InodeTable, Kind, Node, ROOT_INO};
use super::journal::{Journal, Record};
pub use super::posix::Caller;
use super::remote::Remote;
use super::stats::Stats;
use super::sync::SyncSignal;

/// Block size reported in `st_blksize`.
const BLKSIZE: u32 = 4096;

/// An open file.
#[derive(Debug)]
pub struct Handle {
    /// The inode.
    pub ino: Ino,
    /// The upper file.
    pub file: File,
    /// Opened for writing.
    pub writable: bool,
    /// Opened with `O_APPEND`.
    pub append: bool,
    /// Written through since the last flush.
    pub wrote: AtomicBool,
}

/// Directory listings kept for readdir without opendir (least recently listed go first).
const DIR_SNAPS: usize = 512;

/// Blocks kept for reads of large files that are not streamed whole (16 MiB at the default
/// block size): the kernel reads a block in pieces (its read-ahead is at most 1 MiB).
pub(super) const RECENT_BLOCKS: usize = 16;

/// A directory's listing as last read, and its generation.
#[derive(Debug)]
struct DirSnap {
    generation: u32,
    /// The directory's generation in the inode table when it was read: while it is the
    /// same, the listing is too.
    table_generation: u64,
    entries: Arc<Vec<DirEntry>>,
}

/// One entry of an open directory's listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// The entry's inode.
    pub ino: Ino,
    /// Its kind.
    pub kind: Kind,
    /// Its name.
    pub name: String,
}

/// What the filesystem layer needs to know at start.
#[derive(Debug, Clone)]
pub struct FsOptions {
    /// Refuse every change (EROFS).
    pub read_only: bool,
    /// Owner reported for every node.
    pub uid: u32,
    /// Group reported for every node.
    pub gid: u32,
    /// Directory of upper files.
    pub upper_dir: PathBuf,
    /// Block size of the export.
    pub block_size: u32,
}

/// The filesystem.
pub struct AwcpFs {
    pub(super) table: super::inode::TableLock,
    pub(super) handles: Mutex<HashMap<u64, Arc<Handle>>>,
    pub(super) dirs: Mutex<HashMap<u64, Arc<Vec<DirEntry>>>>,
    /// Listings by directory, for a kernel that opens directories without asking
    /// (no-opendir): readdir offsets carry the listing's generation (see [`AwcpFs::listing_at`]).
    dir_snaps: Mutex<lru::LruCache<Ino, DirSnap>>,
    pub(super) next_fh: AtomicU64,
    /// Bounds fetched content held in memory by all fetches together.
    pub(super) fetch_budget: Arc<super::budget::Budget>,
    pub(super) remote: Arc<dyn Remote>,
    pub(super) journal: Journal,
    pub(super) opts: FsOptions,
    pub(super) fenced: RwLock<Option<EndReason>>,
    pub(super) hydrating: Mutex<HashMap<Ino, Arc<Mutex<()>>>>,
    /// Small files a batch fetch has asked the export (or the store) for and not stored
    /// yet: another batch leaves them out instead of fetching them a second time.
    pub(super) fetching: Mutex<std::collections::HashSet<Ino>>,
    /// When an on-demand fetch of a file last failed on the network (see
    /// [`FAILED_FETCH_MEMO`](super::content::FAILED_FETCH_MEMO)).
    pub(super) failed_fetches: Mutex<HashMap<Ino, Instant>>,
    pub(super) sync: Arc<SyncSignal>,
    pub(super) stats: Arc<Stats>,
    /// Set once the kernel opens files without asking (no-open, see
    /// [`KernelOptions::no_open`](super::fuse::KernelOptions)): reads and writes then come
    /// with handle 0, and an unlinked file is kept until the kernel forgets its inode.
    no_open: AtomicBool,
    /// Set once the kernel keeps written data in its page cache (`FUSE_WRITEBACK_CACHE`,
    /// see [`KernelOptions::writeback_cache`](super::fuse::KernelOptions)).
    writeback_cache: AtomicBool,
    /// New files of the processes `writers` admits are handed to the kernel with FUSE
    /// passthrough (set in `init` when the kernel accepts it under no-open; see
    /// [`KernelOptions::passthrough_writes`](super::fuse::KernelOptions)).
    passthrough_creates: AtomicBool,
    /// Upper files the kernel writes directly (`mount/bypass.rs`).
    pub(super) bypass: super::bypass::Watcher,
    /// Whose new files the kernel writes directly.
    writers: super::bypass::Writers,
    /// While the mount ends: the kernel's write-back of dirty pages is still taken although
    /// the mount is fenced (see [`AwcpFs::set_draining`]).
    draining: AtomicBool,
    /// Files written without a handle (no-open) and when, until the syncer takes them: a
    /// file is written back once no write has touched it for [`WRITE_QUIET`].
    pub(super) recent_writes: Mutex<HashMap<Ino, RecentWrite>>,
    /// Large files being fetched in the background for reads without a handle.
    pub(super) streams: Mutex<HashMap<Ino, Arc<super::content::Stream>>>,
    /// Copies of remote files fetched for reading (`upper/.pack`).
    pub(super) pack: super::pack::Pack,
    /// The upper files, with the pool of emptied ones ([`super::upper`]).
    pub(super) upper: super::upper::UpperFiles,
    /// AECP: the access observer and the `.aecp/` tree (`mount/aecp.rs`).
    pub(super) aecp: super::aecp::MountAecp,
    /// Every change, for git's fsmonitor (`mount/changes.rs`).
    pub(super) changes: super::changes::ChangeLog,
    /// Operations on git's index wait here while it is made ready (`mount/prime.rs`).
    pub(super) prime: super::prime::PrimeGate,
    /// The agent's fetches before background ones (`mount/hydrate.rs`).
    pub(super) priority: super::hydrate::Priority,
    /// Background hydration's plan and progress (`mount/hydrate.rs`).
    pub(super) hydration: super::hydrate::Progress,
    /// A large file read from one end to the other is streamed whole once its reads are
    /// seen to be sequential (hydration `all`); otherwise each read fetches the blocks it
    /// covers.
    pub(super) streams_whole: AtomicBool,
    /// Where the reads of large remote files not streamed (yet) have got to
    /// ([`super::content::ReadRun`]), the files read most lately.
    pub(super) read_runs: Mutex<lru::LruCache<Ino, super::content::ReadRun>>,
    /// An on-demand fetch of a small file brings its small neighbours along.
    pub(super) neighbours: AtomicBool,
    /// The export is on this machine: background hydration runs beside the agent's reads
    /// (`mount/hydrate.rs`).
    pub(super) export_local: AtomicBool,
    /// Blocks fetched lately for reads of large files that are not streamed whole, so the
    /// kernel's reads of one block in pieces cost one request.
    pub(super) recent_blocks: Mutex<lru::LruCache<[u8; 32], Arc<Vec<u8>>>>,
    /// Blocks such reads are fetching now: a read that needs one waits for it instead of
    /// asking again (the kernel has several reads of one file in flight, its read-ahead).
    pub(super) blocks_in_flight: Mutex<HashMap<[u8; 32], Arc<super::content::Flight>>>,
    /// Where the sequential readers of those files have got to, for the blocks fetched
    /// ahead of them ([`super::content::READ_AHEAD_MAX`]).
    pub(super) read_ahead: Mutex<lru::LruCache<Ino, super::content::AheadRun>>,
}

/// Writes without a handle (no-open) to one file: how many are under way, and when the
/// last one started or ended.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct RecentWrite {
    pub(super) at: Option<Instant>,
    pub(super) writing: u32,
    /// Created and not written yet: most such files are written a moment later, so they
    /// wait [`CREATED_QUIET`] (an empty intermediate version committed just before a
    /// crash would meet the real one as a conflict at recovery).
    pub(super) created: bool,
    /// The first finished write of this run of writes was journaled: the record names the
    /// file as changed locally, and recovery reads its content from the upper file, so the
    /// later writes need no record of their own until the run ends.
    pub(super) journaled: bool,
    /// A write finished after that record: the node (its size and times) is journaled again
    /// when the run ends.
    pub(super) unjournaled: bool,
    /// The writes were the kernel's, straight to the upper file (`mount/bypass.rs`): when
    /// the run ends the node takes its size and times from there.
    pub(super) bypassed: bool,
}

impl RecentWrite {
    fn quiet(&self) -> std::time::Duration {
        if self.created {
            CREATED_QUIET
        } else {
            WRITE_QUIET
        }
    }
}

/// How long a file created without a handle and not written since waits before it is
/// written back (empty).
pub const CREATED_QUIET: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a file written without an open handle must stay untouched before it is
/// written back (the kernel does not tell when such a file is closed).
pub const WRITE_QUIET: std::time::Duration = std::time::Duration::from_millis(50);

impl std::fmt::Debug for AwcpFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwcpFs")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

pub(super) fn kind_to_fuse(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDev(_) => FileType::CharDevice,
        Kind::BlockDev(_) => FileType::BlockDevice,
    }
}

/// Longest name in bytes (`NAME_MAX`, what `statfs` reports).
pub const MAX_NAME: usize = 255;

/// Names the export reserves for its own temporary files; it never shows or accepts them.
pub const RESERVED_PREFIX: &str = ".awcp-tmp-";

/// Validate a name from the kernel for a new entry and make it a `String` (a name that is
/// not UTF-8 in its escaped form: see [`awcp_protocol::rawname`]).
pub(super) fn name_str(name: &OsStr) -> Result<Cow<'_, str>, FsError> {
    if name.len() > MAX_NAME {
        return Err(FsError::NameTooLong);
    }
    let name = rawname::from_os(name);
    if name.starts_with(RESERVED_PREFIX) {
        return Err(FsError::Invalid {
            what: "names starting with .awcp-tmp- are reserved by awcpfs",
        });
    }
    Ok(name)
}

impl AwcpFs {
    /// A filesystem over `table`, content from `remote`.
    pub fn new(
        table: InodeTable,
        remote: Arc<dyn Remote>,
        journal: Journal,
        opts: FsOptions,
        sync: Arc<SyncSignal>,
        stats: Arc<Stats>,
    ) -> AwcpFs {
        let small_bytes: u64 = table
            .iter()
            .filter(|n| n.kind == Kind::File && n.size <= super::pack::PACK_MAX)
            .map(|n| n.size)
            .sum();
        let pack_limit = super::pack::pack_limit(small_bytes);
        // Fetches are counted where their bytes arrive (the remote), not by the callers:
        // a block fetched twice (hydration racing a read) counts twice, in every sum alike.
        if let Some(c) = remote.transfer_counters() {
            stats.set_transfer(c);
        }
        AwcpFs {
            table: super::inode::TableLock::new(table),
            handles: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            dir_snaps: Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new(DIR_SNAPS).expect("nonzero"),
            )),
            next_fh: AtomicU64::new(1),
            fetch_budget: super::budget::Budget::new(super::budget::DEFAULT_FETCH_BUDGET),
            remote,
            journal,
            fenced: RwLock::new(None),
            hydrating: Mutex::new(HashMap::new()),
            fetching: Mutex::new(std::collections::HashSet::new()),
            failed_fetches: Mutex::new(HashMap::new()),
            sync,
            stats,
            no_open: AtomicBool::new(false),
            writeback_cache: AtomicBool::new(false),
            passthrough_creates: AtomicBool::new(false),
            bypass: super::bypass::Watcher::default(),
            writers: super::bypass::Writers::default(),
            draining: AtomicBool::new(false),
            recent_writes: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            pack: super::pack::Pack::new(opts.upper_dir.join(".pack"), pack_limit),
            upper: super::upper::UpperFiles::new(opts.upper_dir.clone()),
            aecp: super::aecp::MountAecp::new(opts.uid, opts.gid, Some(opts.upper_dir.clone())),
            changes: Default::default(),
            prime: Default::default(),
            priority: Default::default(),
            hydration: Default::default(),
            streams_whole: AtomicBool::new(true),
            read_runs: Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new(super::content::READ_RUNS).expect("nonzero"),
            )),
            neighbours: AtomicBool::new(false),
            export_local: AtomicBool::new(false),
            blocks_in_flight: Mutex::new(HashMap::new()),
            read_ahead: Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new(super::content::READ_RUNS).expect("nonzero"),
            )),
            recent_blocks: Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new(RECENT_BLOCKS).expect("nonzero"),
            )),
            opts,
        }
    }

    /// AECP's side of this mount.
    pub fn aecp(&self) -> &super::aecp::MountAecp {
        &self.aecp
    }

    /// The mount's change log (git's fsmonitor).
    pub fn changes(&self) -> &super::changes::ChangeLog {
        &self.changes
    }

    /// The kernel opens files without asking from now on (it was answered `ENOSYS`).
    pub fn set_no_open(&self) {
        self.no_open.store(true, Ordering::Relaxed);
    }

    /// Whether the kernel opens files without asking.
    pub fn no_open(&self) -> bool {
        self.no_open.load(Ordering::Relaxed)
    }

    /// Whether the adapter hands created files to the kernel with passthrough (on: it
    /// registers the upper file as the new file's backing file; off again, for the rest of
    /// the mount, when the kernel refuses one).
    pub fn set_passthrough_creates(&self, on: bool) {
        self.passthrough_creates.store(on, Ordering::Relaxed);
    }

    /// See [`AwcpFs::set_passthrough_creates`].
    pub fn passthrough_creates(&self) -> bool {
        self.passthrough_creates.load(Ordering::Relaxed)
    }

    /// Whose new files are handed to the kernel with passthrough.
    pub fn set_passthrough_writers(&self, policy: super::bypass::PassthroughWriters) {
        self.writers.set(policy);
    }

    /// Whether the file thread `tid` creates now is handed to the kernel with passthrough.
    pub fn passes_writes_of(&self, tid: u32) -> bool {
        self.passthrough_creates() && self.writers.admits(tid)
    }

    /// The watches on upper files the kernel writes directly.
    pub(super) fn bypass(&self) -> &super::bypass::Watcher {
        &self.bypass
    }

    /// The kernel keeps written data in its page cache from now on.
    pub fn set_writeback_cache(&self) {
        self.writeback_cache.store(true, Ordering::Relaxed);
    }

    /// Whether the kernel keeps written data in its page cache (writes reach the
    /// filesystem when it writes them back).
    pub fn writeback_cache(&self) -> bool {
        self.writeback_cache.load(Ordering::Relaxed)
    }

    /// While `on`, `write` requests are served even when the mount is fenced: with the
    /// writeback cache they are the kernel writing back pages that writes made before the
    /// end of the lease left dirty, which the final flush must carry to the Delegator.
    /// Every other operation fails as fenced.
    pub fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::SeqCst);
    }

    /// `check` for a `write` request: also passes while the mount drains the kernel's
    /// dirty pages at its end.
    pub(super) fn check_write_back(&self) -> Result<(), FsError> {
        if self.draining.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.check()
    }

    /// `forget`: the kernel dropped `ino`. An unlinked file kept for descriptors the kernel
    /// did not tell about (no-open) goes now, and so does a superseded `.aecp/` inode.
    pub fn forget(&self, ino: Ino) {
        if super::aecp::MountAecp::is_virtual(ino) {
            return self.aecp.forget(ino);
        }
        let mut table = self.table.lock();
        let Some(node) = table.get(ino) else { return };
        if node.bypassed {
            // Nothing has the file open any more: the kernel's writes are all in its upper
            // file, their events perhaps not read yet. One last write, then no watch.
            drop(table);
            self.bypassed_write(ino);
            self.bypass.unwatch(ino);
            table = self.table.lock();
            if let Some(node) = table.get_mut(ino) {
                node.bypassed = false;
            }
        }
        let Some(node) = table.get(ino) else { return };
        if node.unlinked && node.open_handles == 0 {
            let kind = node.kind;
            table.remove(ino);
            drop(table);
            self.recent_writes.lock().remove(&ino);
            if kind == Kind::File {
                self.upper.remove(ino);
            }
        }
    }

    /// Files written without a handle (no-open) that no write touched for
    /// [`WRITE_QUIET`] (all of them with `all`) are handed to the syncer (forgotten here),
    /// each journaled as it is now if a write came after the record of its run's first.
    /// Returns the ones still being written. Called under the table's lock (`table`).
    pub(super) fn quiet_writes(
        &self,
        table: &mut InodeTable,
        all: bool,
    ) -> std::collections::HashSet<Ino> {
        let now = Instant::now();
        let mut busy = std::collections::HashSet::new();
        let mut ended = Vec::new();
        let mut bypassed = Vec::new();
        self.recent_writes.lock().retain(|ino, w| {
            let writing =
                !all && (w.writing > 0 || w.at.is_some_and(|t| now.duration_since(t) < w.quiet()));
            if writing {
                busy.insert(*ino);
            } else if w.bypassed {
                bypassed.push(*ino);
            } else if w.unjournaled {
                ended.push(*ino);
            }
            writing
        });
        if all {
            // The last round: whatever the kernel wrote directly that no event told of yet.
            let pending: std::collections::HashSet<Ino> = bypassed.iter().copied().collect();
            bypassed.extend(
                self.bypass
                    .watched()
                    .into_iter()
                    .filter(|ino| !busy.contains(ino) && !pending.contains(ino)),
            );
        }
        for ino in bypassed {
            if table.get(ino).is_some_and(|n| !n.unlinked) {
                self.take_bypassed(table, ino);
                ended.push(ino);
            }
        }
        // The runs of writes that ended: their nodes as they are now, before the syncer
        // takes them.
        let records: Vec<Record> = ended
            .iter()
            .filter_map(|&ino| table.get(ino).filter(|n| !n.unlinked).map(Record::node))
            .collect();
        if !records.is_empty()
            && let Err(e) = self.journal(&records)
        {
            tracing::warn!(error = %e, "cannot journal a write");
        }
        busy
    }

    /// How long until the next file written without a handle is quiet (zero if one is
    /// already); `None` if there is none.
    pub(super) fn next_quiet_in(&self) -> Option<std::time::Duration> {
        let now = Instant::now();
        self.recent_writes
            .lock()
            .values()
            .map(|w| match w.at {
                // A write still under way: look again a quiet period later.
                _ if w.writing > 0 => WRITE_QUIET,
                Some(t) => w.quiet().saturating_sub(now.duration_since(t)),
                None => std::time::Duration::ZERO,
            })
            .min()
    }

    /// Whether `ino` was written without a handle and is not handed to the syncer yet.
    pub(super) fn recently_written(&self, ino: Ino) -> bool {
        self.recent_writes.lock().contains_key(&ino)
    }

    /// Files whose pages the kernel may cache: those with open handles, or, once the
    /// kernel opens files without asking, every file with local content (an upper file or a
    /// copy in the pack).
    pub fn cached_inodes(&self) -> Vec<Ino> {
        if !self.no_open() {
            return self.open_inodes();
        }
        let table = self.table.lock();
        table
            .iter()
            .filter(|n| {
                n.kind == Kind::File
                    && (matches!(n.data, Data::Local { .. }) || n.data.packed().is_some())
            })
            .map(|n| n.ino)
            .collect()
    }

    /// Inodes with open files (the unlinked-but-open included).
    pub fn open_inodes(&self) -> Vec<Ino> {
        let mut inos: Vec<Ino> = self.handles.lock().values().map(|h| h.ino).collect();
        inos.sort_unstable();
        inos.dedup();
        inos
    }

    /// How many handles are open on `ino`.
    pub fn open_handles_of(&self, ino: Ino) -> u32 {
        self.table.lock().get(ino).map_or(0, |n| n.open_handles)
    }

    /// Its counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// The options it runs with.
    pub fn options(&self) -> &FsOptions {
        &self.opts
    }

    /// End access: every later operation fails with `EACCES`. Returns false if already fenced.
    pub fn fence(&self, reason: EndReason) -> bool {
        let mut f = self.fenced.write();
        if f.is_some() {
            return false;
        }
        tracing::info!(%reason, "fencing the mount");
        *f = Some(reason);
        true
    }

    /// Why access ended, if it has.
    pub fn fenced(&self) -> Option<EndReason> {
        self.fenced.read().clone()
    }

    pub(super) fn check(&self) -> Result<(), FsError> {
        match &*self.fenced.read() {
            Some(reason) => Err(FsError::Fenced {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(super) fn check_write(&self) -> Result<(), FsError> {
        self.check()?;
        if self.opts.read_only {
            return Err(FsError::ReadOnly);
        }
        Ok(())
    }

    pub(super) fn attr_of(&self, node: &Node) -> FileAttr {
        let (mut mtime, mut ctime) = (node.mtime, node.ctime);
        let mut size = match node.kind {
            Kind::Dir => 4096,
            _ => node.size,
        };
        // Content changed here: the upper file's own allocation, so sparse files look sparse
        // (`du`, `cp --sparse=auto` and `tar -S` rely on it). Remote content, and content
        // fetched and never changed (written out whole): what it takes, without a `stat`
        // per lookup.
        let blocks = match (node.kind, &node.data) {
            (
                Kind::File,
                Data::Local {
                    dirty: false,
                    generation: 0,
                    ..
                },
            ) => size.div_ceil(512),
            (Kind::File, Data::Local { .. }) => {
                match std::fs::metadata(self.upper_path(node.ino)) {
                    Ok(m) => {
                        if node.open_writers > 0 || node.bypassed {
                            // Open for writing, or written by the kernel directly: writes
                            // it passes through to the upper file (or makes through a
                            // shared mapping) are not in the table until the handle is
                            // flushed or the writes go quiet; the upper file has them (and
                            // keeps the times `setattr` sets, see there).
                            (size, mtime) = (m.len(), m.modified().unwrap_or(mtime));
                            ctime = ctime.max(mtime);
                        }
                        std::os::unix::fs::MetadataExt::blocks(&m)
                    }
                    Err(_) => size.div_ceil(512),
                }
            }
            _ => size.div_ceil(512),
        };
        FileAttr {
            ino: INodeNo(node.ino),
            size,
            blocks,
            atime: node.atime,
            mtime,
            ctime,
            crtime: node.ctime,
            kind: kind_to_fuse(node.kind),
            perm: node.perm,
            nlink: node.nlink(),
            uid: node.uid,
            gid: node.gid,
            rdev: match node.kind {
                Kind::CharDev(rdev) | Kind::BlockDev(rdev) => rdev,
                _ => 0,
            },
            blksize: BLKSIZE,
            flags: 0,
        }
    }

    /// Journal `records` and note them in the change log (even when the journal fails:
    /// the change is made, and git must see it).
    pub(super) fn journal(&self, records: &[Record]) -> Result<(), FsError> {
        self.changes.note_records(records);
        self.journal.append(records).map_err(FsError::from)
    }

    pub(super) fn upper_path(&self, ino: Ino) -> PathBuf {
        self.upper.path(ino)
    }

    fn dir_mut(table: &mut InodeTable, ino: Ino) -> Result<&mut Node, FsError> {
        let n = table.get_mut(ino).ok_or(FsError::NotFound)?;
        if n.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        Ok(n)
    }

    /// The mount's own owner (who started it, or `--uid`/`--gid`): what nodes from the
    /// manifest belong to, and new nodes made without a caller (tests).
    pub(super) fn owner(&self) -> Caller {
        Caller {
            uid: self.opts.uid,
            gid: self.opts.gid,
        }
    }

    /// A new node `ino` made by `caller` as `name` in `parent` (which `table` holds): owned by the
    /// caller's uid, and by its gid or, in a set-group-ID directory, by the directory's
    /// group (a new directory there is set-group-ID too), as on a local filesystem.
    pub(super) fn new_node(
        &self,
        table: &InodeTable,
        caller: Caller,
        ino: Ino,
        (parent, name): (Ino, &str),
        kind: Kind,
        perm: u16,
    ) -> Node {
        let dir = table.get(parent).map(|d| (d.perm, d.gid));
        let (gid, perm) = super::posix::new_owner(caller, dir, kind, perm);
        let now = SystemTime::now();
        Node {
            ino,
            parent,
            name: name.to_string(),
            kind,
            perm,
            uid: caller.uid,
            gid,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            children: Default::default(),
            subdirs: 0,
            target: None,
            data: match kind {
                Kind::File => Data::Local {
                    dirty: true,
                    hash: None,
                    generation: 1,
                },
                _ => Data::None,
            },
            open_handles: 0,
            open_writers: 0,
            bypassed: false,
            unlinked: false,
            links: Vec::new(),
            xattrs: Default::default(),
        }
    }

    pub(super) fn add_child_node(
        &self,
        table: &mut InodeTable,
        node: Node,
    ) -> Result<FileAttr, FsError> {
        self.add_node(table, node)
    }

    /// Journal a new node, then add it under `parent` and return its attributes. Journaled
    /// first: a node whose record cannot be written (`ENOSPC`) is not added.
    fn add_node(&self, table: &mut InodeTable, node: Node) -> Result<FileAttr, FsError> {
        let now = node.ctime;
        Self::dir_mut(table, node.parent)?;
        let attr = self.attr_of(&node);
        self.journal(&[Record::node(&node)])?;
        let parent = Self::dir_mut(table, node.parent)?;
        parent.mtime = now;
        parent.ctime = now;
        let (parent, name, ino) = (node.parent, node.name.clone(), node.ino);
        table.insert(node);
        table.insert_child(parent, name, ino);
        self.sync.request();
        Ok(attr)
    }

    /// `lookup`: the attributes of `name` in `parent`.
    pub fn lookup(&self, parent: Ino, name: &OsStr) -> Result<FileAttr, FsError> {
        self.check()?;
        // Every operation on a name starts with its lookup: an over-long one fails here,
        // as on a local filesystem, not with "no such file".
        if name.len() > MAX_NAME {
            return Err(FsError::NameTooLong);
        }
        let name = rawname::from_os(name);
        let table = self.table.lock();
        if let Some(r) = self.aecp.lookup(&table, parent, &name) {
            return r;
        }
        let dir = table.get(parent).ok_or(FsError::NotFound)?;
        if dir.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        let ino = table.child(parent, &name).ok_or(FsError::NotFound)?;
        if self.prime.holds(ino) {
            drop(table);
            self.wait_primed(ino);
            return self.lookup(parent, rawname::to_os(&name).as_ref());
        }
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        let attr = self.attr_of(node);
        // The observer's path is taken under the table's lock; its lookup and delivery run
        // after it is released, so the other FUSE threads do not wait for them.
        let observed = self.aecp.observed_path(&table, ino);
        drop(table);
        if let Some(path) = observed {
            self.aecp.observe_path(parent, &path);
        }
        Ok(attr)
    }

    /// `getattr`. A file open for writing may be written by the kernel directly (FUSE
    /// passthrough), so its size and mtime come from the upper file.
    pub fn getattr(&self, ino: Ino) -> Result<FileAttr, FsError> {
        self.check()?;
        self.wait_primed(ino);
        let table = self.table.lock();
        if let Some(r) = self.aecp.getattr(&table, ino) {
            return r;
        }
        // (A file open for writing: its size and times from the upper file, see `attr_of`.)
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        Ok(self.attr_of(node))
    }

    /// `readlink`.
    pub fn readlink(&self, ino: Ino) -> Result<String, FsError> {
        self.check()?;
        let table = self.table.lock();
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        node.target.clone().ok_or(FsError::Invalid {
            what: "not a symlink",
        })
    }

    /// `mkdir`, owned by the mount's owner.
    pub fn mkdir(&self, parent: Ino, name: &OsStr, mode: u32) -> Result<FileAttr, FsError> {
        self.mkdir_as(self.owner(), parent, name, mode)
    }

    /// `mkdir` by `caller`.
    pub fn mkdir_as(
        &self,
        caller: Caller,
        parent: Ino,
        name: &OsStr,
        mode: u32,
    ) -> Result<FileAttr, FsError> {
        self.check_write()?;
        let name = name_str(name)?;
        let name = &*name;
        let mut table = self.table.lock();
        Self::dir_mut(&mut table, parent)?;
        if table.child(parent, name).is_some() {
            return Err(FsError::Exists);
        }
        let ino = table.alloc_ino();
        let node = self.new_node(
            &table,
            caller,
            ino,
            (parent, name),
            Kind::Dir,
            (mode & 0o7777) as u16,
        );
        self.add_node(&mut table, node)
    }

    /// `symlink`, owned by the mount's owner.
    pub fn symlink(&self, parent: Ino, name: &OsStr, target: &OsStr) -> Result<FileAttr, FsError> {
        self.symlink_as(self.owner(), parent, name, target)
    }

    /// `symlink` by `caller`.
    pub fn symlink_as(
        &self,
        caller: Caller,
        parent: Ino,
        name: &OsStr,
        target: &OsStr,
    ) -> Result<FileAttr, FsError> {
        self.check_write()?;
        let name = name_str(name)?;
        let name = &*name;
        let target = rawname::from_os(target);
        let mut table = self.table.lock();
        Self::dir_mut(&mut table, parent)?;
        if table.child(parent, name).is_some() {
            return Err(FsError::Exists);
        }
        let ino = table.alloc_ino();
        let mut node = self.new_node(&table, caller, ino, (parent, name), Kind::Symlink, 0o777);
        node.size = rawname::to_bytes(&target).len() as u64;
        node.target = Some(target.into_owned());
        self.add_node(&mut table, node)
    }

    /// Remove `ino` from the namespace (its dentry is already gone): keep it while open.
    fn drop_node(&self, table: &mut InodeTable, ino: Ino) {
        let Some(node) = table.get_mut(ino) else {
            return;
        };
        node.unlinked = true;
        node.ctime = SystemTime::now();
        // Without open/release (no-open) a descriptor may still read or write it: it goes
        // at `forget`.
        if node.open_handles == 0 && !(node.kind == Kind::File && self.no_open()) {
            let kind = node.kind;
            table.remove(ino);
            if kind == Kind::File {
                // The upper file may not exist (never fetched): nothing to remove then.
                self.upper.remove(ino);
            }
        }
    }

    /// Remove the dentry `parent`/`name`; drop its node if that was its last name.
    pub(super) fn remove_dentry(&self, table: &mut InodeTable, parent: Ino, name: &str) {
        match table.unlink_dentry(parent, name) {
            Some((ino, true)) => self.drop_node(table, ino),
            Some((ino, false)) => {
                if let Some(n) = table.get_mut(ino) {
                    n.ctime = SystemTime::now();
                }
            }
            None => {}
        }
    }

    fn touch_dir(table: &mut InodeTable, ino: Ino) {
        if let Some(d) = table.get_mut(ino) {
            let now = SystemTime::now();
            d.mtime = now;
            d.ctime = now;
        }
    }

    /// `unlink`.
    pub fn unlink(&self, parent: Ino, name: &OsStr) -> Result<(), FsError> {
        self.check_write()?;
        let name = name_str(name)?;
        let name = &*name;
        let mut table = self.table.lock();
        Self::dir_mut(&mut table, parent)?;
        let ino = table.child(parent, name).ok_or(FsError::NotFound)?;
        if table.get(ino).map(|n| n.kind) == Some(Kind::Dir) {
            return Err(FsError::IsDir);
        }
        table.refuse_withheld(ino)?;
        // Journaled first: an unlink whose record cannot be written has not happened.
        self.journal(&[Record::Unlink {
            parent,
            name: name.to_string(),
        }])?;
        Self::touch_dir(&mut table, parent);
        self.remove_dentry(&mut table, parent, name);
        self.sync.request();
        Ok(())
    }

    /// `rmdir`.
    pub fn rmdir(&self, parent: Ino, name: &OsStr) -> Result<(), FsError> {
        self.check_write()?;
        let name = name_str(name)?;
        let name = &*name;
        let mut table = self.table.lock();
        Self::dir_mut(&mut table, parent)?;
        let ino = table.child(parent, name).ok_or(FsError::NotFound)?;
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        if node.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        if !node.children.is_empty() {
            return Err(FsError::NotEmpty);
        }
        self.journal(&[Record::Unlink {
            parent,
            name: name.to_string(),
        }])?;
        table.remove_child(parent, name);
        Self::touch_dir(&mut table, parent);
        table.remove(ino);
        self.sync.request();
        Ok(())
    }

    /// `rename`, with `RENAME_NOREPLACE` and `RENAME_EXCHANGE`.
    pub fn rename(
        &self,
        parent: Ino,
        name: &OsStr,
        newparent: Ino,
        newname: &OsStr,
        noreplace: bool,
        exchange: bool,
    ) -> Result<(), FsError> {
        self.check_write()?;
        let name = name_str(name)?;
        let name = &*name;
        let newname = name_str(newname)?;
        let newname = &*newname;
        let mut table = self.table.lock();
        Self::dir_mut(&mut table, parent)?;
        Self::dir_mut(&mut table, newparent)?;
        let src = table.child(parent, name).ok_or(FsError::NotFound)?;
        let src_kind = table.get(src).ok_or(FsError::NotFound)?.kind;
        if src_kind == Kind::Dir && table.is_ancestor(src, newparent) {
            return Err(FsError::Invalid {
                what: "cannot move a directory into itself",
            });
        }
        let dst = table.child(newparent, newname);
        if dst == Some(src) {
            return Ok(());
        }
        // A withheld file stays where the Delegator has it: not moved (nor a directory
        // holding one), not replaced.
        for ino in [Some(src), dst].into_iter().flatten() {
            table.refuse_withheld(ino)?;
            if table.get(ino).map(|n| n.kind) == Some(Kind::Dir) && table.holds_withheld(ino) {
                return Err(FsError::Withheld);
            }
        }
        let moved = |ino, from: (Ino, &str), to: (Ino, &str)| Record::Move {
            ino,
            from_parent: from.0,
            from_name: from.1.to_string(),
            parent: to.0,
            name: to.1.to_string(),
        };
        // Checked and journaled before anything changes: a rename whose records cannot be
        // written (`ENOSPC`) fails without having happened.
        if exchange {
            let dst = dst.ok_or(FsError::NotFound)?;
            if table.get(dst).map(|n| n.kind) == Some(Kind::Dir) && table.is_ancestor(dst, parent) {
                return Err(FsError::Invalid {
                    what: "cannot move a directory into itself",
                });
            }
            self.journal(&[
                moved(src, (parent, name), (newparent, newname)),
                moved(dst, (newparent, newname), (parent, name)),
            ])?;
            table.insert_child(parent, name.to_string(), dst);
            table.insert_child(newparent, newname.to_string(), src);
            table.move_dentry(dst, (newparent, newname), (parent, name));
            table.move_dentry(src, (parent, name), (newparent, newname));
            let now = SystemTime::now();
            for ino in [src, dst] {
                if let Some(node) = table.get_mut(ino) {
                    node.ctime = now;
                }
            }
        } else {
            let mut records = Vec::new();
            if let Some(dst) = dst {
                if noreplace {
                    return Err(FsError::Exists);
                }
                let dst_node = table.get(dst).ok_or(FsError::NotFound)?;
                match (src_kind == Kind::Dir, dst_node.kind == Kind::Dir) {
                    (true, false) => return Err(FsError::NotDir),
                    (false, true) => return Err(FsError::IsDir),
                    (true, true) if !dst_node.children.is_empty() => {
                        return Err(FsError::NotEmpty);
                    }
                    _ => {}
                }
                records.push(Record::Unlink {
                    parent: newparent,
                    name: newname.to_string(),
                });
            }
            records.push(moved(src, (parent, name), (newparent, newname)));
            self.journal(&records)?;
            if dst.is_some() {
                self.remove_dentry(&mut table, newparent, newname);
            }
            table.remove_child(parent, name);
            table.insert_child(newparent, newname.to_string(), src);
            table.move_dentry(src, (parent, name), (newparent, newname));
            if let Some(node) = table.get_mut(src) {
                node.ctime = SystemTime::now();
            }
        }
        Self::touch_dir(&mut table, parent);
        Self::touch_dir(&mut table, newparent);
        self.sync.request();
        Ok(())
    }

    /// `link`: another name for a file or symlink (`EPERM` for a directory, as POSIX says).
    pub fn link(&self, ino: Ino, newparent: Ino, newname: &OsStr) -> Result<FileAttr, FsError> {
        self.check_write()?;
        let newname = name_str(newname)?;
        let newname = &*newname;
        let mut table = self.table.lock();
        Self::dir_mut(&mut table, newparent)?;
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        if node.kind == Kind::Dir {
            return Err(FsError::NoHardLinks);
        }
        table.refuse_withheld(ino)?;
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        if node.unlinked {
            // linkat(2) of an unlinked file (AT_EMPTY_PATH of an O_TMPFILE excepted): ENOENT.
            return Err(FsError::NotFound);
        }
        if table.child(newparent, newname).is_some() {
            return Err(FsError::Exists);
        }
        self.journal(&[Record::Link {
            ino,
            parent: newparent,
            name: newname.to_string(),
        }])?;
        table.add_link(ino, newparent, newname);
        Self::touch_dir(&mut table, newparent);
        let node = table.get_mut(ino).ok_or(FsError::NotFound)?;
        node.ctime = SystemTime::now();
        let attr = self.attr_of(node);
        self.sync.request();
        Ok(attr)
    }

    /// `opendir`: snapshot the listing so offsets stay stable while it is read.
    pub fn opendir(&self, ino: Ino) -> Result<u64, FsError> {
        let entries = self.build_listing(ino)?;
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.dirs.lock().insert(fh, Arc::new(entries));
        Ok(fh)
    }

    /// The listing of directory `ino` for a `readdir` at `offset` when the kernel opened the
    /// directory without asking (no-opendir): the entries and the index to start at.
    ///
    /// Offsets handed out are `generation << 32 | index + 1`. A readdir at 0 reuses the
    /// listing kept for the directory when the directory's generation in the inode table
    /// is still the one it was read at (no name added, removed or moved since); otherwise it
    /// reads the directory afresh, and the new listing gets the next generation. A readdir at a later offset continues in the listing of its own
    /// generation when it is still kept, so a listing read in several calls sees one
    /// consistent snapshot even while the directory changes; only if that snapshot was
    /// replaced (the directory changed and was listed again from the start meanwhile) or
    /// evicted does it continue at the same index in the current one.
    pub fn listing_at(
        &self,
        ino: Ino,
        offset: u64,
    ) -> Result<(Arc<Vec<DirEntry>>, u64, usize), FsError> {
        let (want_gen, index) = ((offset >> 32) as u32, (offset & 0xffff_ffff) as usize);
        if let Some(r) = self.aecp.listing(&self.table.lock(), ino) {
            return r.map(|e| (Arc::new(e), 0, index));
        }
        if offset != 0 {
            self.check()?;
            if let Some(s) = self.dir_snaps.lock().get(&ino)
                && s.generation == want_gen
            {
                return Ok((s.entries.clone(), u64::from(s.generation), index));
            }
        }
        self.check()?;
        // Lock order: the table, then the listings.
        let table = self.table.lock();
        match table.get(ino) {
            None => return Err(FsError::NotFound),
            Some(n) if n.kind != Kind::Dir => return Err(FsError::NotDir),
            Some(_) => {}
        }
        let table_generation = table.dir_generation(ino);
        let mut snaps = self.dir_snaps.lock();
        let (generation, entries) = match snaps.get(&ino) {
            Some(s) if s.table_generation == table_generation => (s.generation, s.entries.clone()),
            old => {
                // Generation 0 is never used, so no offset handed out is 0.
                let g = old.map_or(1, |s| s.generation.wrapping_add(1).max(1));
                let e = Arc::new(Self::listing_of(&table, ino)?);
                snaps.put(
                    ino,
                    DirSnap {
                        generation: g,
                        table_generation,
                        entries: e.clone(),
                    },
                );
                (g, e)
            }
        };
        Ok((entries, u64::from(generation), index))
    }

    /// Read directory `ino`: `.`, `..`, then its children.
    fn build_listing(&self, ino: Ino) -> Result<Vec<DirEntry>, FsError> {
        self.check()?;
        if let Some(r) = self.aecp.listing(&self.table.lock(), ino) {
            return r;
        }
        Self::listing_of(&self.table.lock(), ino)
    }

    fn listing_of(table: &InodeTable, ino: Ino) -> Result<Vec<DirEntry>, FsError> {
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        if node.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        let mut entries = Vec::with_capacity(node.children.len() + 2);
        entries.push(DirEntry {
            ino,
            kind: Kind::Dir,
            name: ".".into(),
        });
        entries.push(DirEntry {
            ino: if ino == ROOT_INO {
                ROOT_INO
            } else {
                node.parent
            },
            kind: Kind::Dir,
            name: "..".into(),
        });
        for (name, child) in &node.children {
            if let Some(c) = table.get(*child) {
                entries.push(DirEntry {
                    ino: *child,
                    kind: c.kind,
                    name: name.to_string(),
                });
            }
        }
        Ok(entries)
    }

    /// `readdir`: the listing from `offset` on.
    pub fn readdir(&self, fh: u64) -> Result<Arc<Vec<DirEntry>>, FsError> {
        self.check()?;
        self.dirs.lock().get(&fh).cloned().ok_or(FsError::BadHandle)
    }

    /// `releasedir`.
    pub fn releasedir(&self, fh: u64) {
        self.dirs.lock().remove(&fh);
    }

    /// `fsync` of a directory: every name change so far (the journal) and the names of the
    /// upper files reach the disk, so a rename or unlink followed by a directory sync
    /// survives a power loss, as on a local filesystem.
    pub fn fsyncdir(&self) -> Result<(), FsError> {
        self.check()?;
        self.sync_namespace()
    }

    /// Make the journal durable, and the upper directory's names (a new file's upper file
    /// must not vanish while its journal record survives).
    pub(super) fn sync_namespace(&self) -> Result<(), FsError> {
        self.journal.sync()?;
        std::fs::File::open(&self.opts.upper_dir)?.sync_all()?;
        Ok(())
    }

    /// `statfs`: the space of the state directory, where new data lands.
    pub fn statfs(&self) -> Result<nix::sys::statvfs::Statvfs, FsError> {
        self.check()?;
        nix::sys::statvfs::statvfs(&self.opts.upper_dir)
            .map_err(|e| FsError::from(std::io::Error::from(e)))
    }

    /// `access`: permission bits are checked by the kernel (`default_permissions`); this
    /// adds the fence and the read-only delegation.
    pub fn access(&self, ino: Ino, write: bool) -> Result<(), FsError> {
        if let Some(r) = self.aecp.open(ino, write) {
            return r.map(drop);
        }
        if write {
            self.check_write()?;
        } else {
            self.check()?;
        }
        let table = self.table.lock();
        table.get(ino).ok_or(FsError::NotFound)?;
        table.refuse_withheld(ino)
    }
}
