//! Building the manifest: one walk of the exported tree at register time.
//!
//! The manifest is a snapshot. It lists every directory, regular file and symlink below the
//! root, parents before children (a depth-first pre-order walk with names sorted bytewise,
//! so the same tree always gives the same bytes and the same digest). Files carry the blake3
//! hash of their whole content and the hashes of their fixed, offset-aligned blocks of
//! `block_size` bytes (the last block may be shorter; an empty file has no blocks and the
//! hash of the empty string). Symlinks carry their target as stored: shown, never followed.
//!
//! The walk uses the same descriptor-relative, no-follow discipline as
//! `super::rootfs`: every directory is opened with `openat(O_DIRECTORY | O_NOFOLLOW)`
//! relative to its parent's descriptor and every file with `openat(O_NOFOLLOW | O_NONBLOCK)`,
//! so the walk cannot be led outside the root even if the tree changes while it runs.
//!
//! Names and symlink targets are bytes; those that are not UTF-8 are held in their escaped
//! `String` form (see `awcp_protocol::rawname`) and travel as raw bytes or base64.
//!
//! Skipped, each with a `warn`: special files (FIFOs, sockets, devices), our own temporary
//! names (`.awcp-tmp-*`), entries that
//! vanish or cannot be read during the walk, and directories deeper than `MAX_DEPTH`.
//! Only a failure at the root itself fails the build.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use awcp_protocol::dataplane::{
    DATA_PLANE_VERSION, EntryKind, MAX_MANIFEST_XATTR_VALUE, Manifest, ManifestEntry,
};
use awcp_protocol::rawname;
use nix::dir::Dir;
use nix::fcntl::{AtFlags, OFlag, readlinkat};
use nix::sys::stat::{FileStat, Mode, fstat, fstatat};

use std::sync::mpsc::{Receiver, SyncSender};

use parking_lot::Mutex;

use super::hashcache::{HashCache, RACY_WINDOW, is_racy};
use super::rootfs::{NodeKind, RootDir, ctime_ns, mtime_ns, open_file_at};
use super::store::{BlockIndex, BlockLoc, Stamp, TMP_PREFIX};

/// Deepest directory level walked. Each level holds one open descriptor and one stack frame;
/// real workspaces are far shallower.
pub(crate) const MAX_DEPTH: usize = 256;

/// What one walk produces.
#[derive(Debug)]
pub(crate) struct Built {
    pub(crate) manifest: Manifest,
    pub(crate) index: BlockIndex,
    /// Entries left out because they could not be read, are special files or lie too deep
    /// (each logged): the manifest is then not the whole tree's picture.
    pub(crate) skipped: usize,
    /// Files listed with hashes that may not match their content for as long as their
    /// stamp holds (changed while hashed, or too recently to tell).
    pub(crate) untrusted: usize,
}

/// Parameters of the manifest that do not come from the tree.
#[derive(Debug, Clone)]
pub(crate) struct ManifestParams {
    pub(crate) export_id: String,
    pub(crate) block_size: u32,
    pub(crate) read_only: bool,
    pub(crate) filter: Option<super::PathFilter>,
    /// Counters for a progress bar, if someone shows one.
    pub(crate) progress: Option<Arc<super::BuildProgress>>,
}

/// A file the walk opened, for a hashing thread.
struct Job {
    /// Which walker listed it (see [`Walker::part`]) and where in that walker's entries.
    part: usize,
    idx: usize,
    file: std::fs::File,
    rel: String,
}

/// The file's metadata, its hashes, and whether they can be trusted while its stamp holds.
type JobResult = (usize, usize, io::Result<(FileStat, FileHashes, bool)>);

/// Hash files handed over by the walk; remember the hashes of files that did not change
/// while they were read.
fn hash_worker(
    jobs: &Mutex<Receiver<Job>>,
    results: &Mutex<Vec<JobResult>>,
    block_size: u32,
    cache: Option<&HashCache>,
    progress: Option<&super::BuildProgress>,
) {
    loop {
        let job = jobs.lock().recv();
        let Ok(job) = job else { return };
        let r = (|| {
            // Metadata from the opened file, so size, mode and content belong together.
            let before = fstat(&job.file)?;
            let mut hashes = hash_blocks(&job.file, block_size)?;
            // Between the two stats: a change of an attribute changes the ctime too.
            hashes.xattrs = fd_user_xattrs(job.file.as_fd(), &job.rel);
            let after = fstat(&job.file)?;
            let same = Stamp::of(&after) == Stamp::of(&before);
            if !same {
                tracing::debug!(path = %job.rel, "file changed while hashed; not remembered");
            }
            let trusted = same && !is_racy(&after, RACY_WINDOW);
            if same && let Some(cache) = cache {
                cache.insert(&after, block_size, &hashes);
            }
            if let Some(p) = progress {
                p.hashed_file(hashes.size);
            }
            Ok((before, hashes, trusted))
        })();
        results.lock().push((job.part, job.idx, r));
    }
}

/// Walk the tree below `root` and build its manifest and block index (blocking IO).
///
/// The top levels are listed on this thread and the subtrees below them are walked by a few
/// threads (at most [`HASH_THREADS`], one subtree at a time each, every subtree into a list
/// of its own, spliced back after its directory's entry: the order is a single walk's; a
/// thread left idle is handed the next directory another one reaches, at any depth); files
/// whose hashes `cache` does not hold are opened by the walking threads and hashed by a
/// few more meanwhile (at most [`HASH_THREADS`]). At 100,000 files with a warm hash cache
/// the walk is mostly `fstatat` and `getdents`: two threads took it from ~470 to ~380 ms.
pub(crate) fn build(
    root: &RootDir,
    params: &ManifestParams,
    cache: Option<&HashCache>,
) -> io::Result<Built> {
    let root_stat = fstat(root.fd())?;
    let walker = walk_with(params, cache, |walker| {
        // Subtrees are walked by several threads (see `walk_with`).
        walker.may_defer = true;
        Dir::openat(root.fd(), ".", dir_flags(), Mode::empty())
            .map_err(io::Error::from)
            .and_then(|dir| walker.walk_dir(dir, "", 0))
    })?;
    tracing::debug!(
        entries = walker.entries.len(),
        walkers = walker.parts,
        skipped = walker.skipped,
        "manifest walked"
    );
    Ok(Built {
        skipped: walker.skipped,
        untrusted: walker.untrusted,
        manifest: Manifest {
            version: DATA_PLANE_VERSION,
            export_id: params.export_id.clone(),
            block_size: params.block_size,
            read_only: params.read_only,
            root_mode: perm(&root_stat),
            root_mtime_ns: mtime_ns(&root_stat),
            entries: walker.entries,
        },
        index: walker.index,
    })
}

/// The entries of `paths` as they are now, for the change watcher: each path's own entry
/// (none if it is absent, hidden or unreadable) and, for a path given with `deep` that is a
/// directory, its whole subtree. Files are hashed as in [`build`] (the cache is used).
/// The returned manifest carries only these entries, in the order found.
pub(crate) fn describe(
    root: &RootDir,
    params: &ManifestParams,
    cache: Option<&HashCache>,
    paths: &[(String, bool)],
) -> io::Result<Built> {
    let walked = walk_with(params, cache, |walker| {
        for (rel, deep) in paths {
            let (dir, name) = match root.open_parent(rel) {
                Ok(x) => x,
                Err(e) if e.is_not_found() => continue,
                Err(e) => {
                    tracing::debug!(path = %rel, error = %e, "cannot describe a changed path");
                    continue;
                }
            };
            let dir = match Dir::from_fd(dir) {
                Ok(d) => d,
                Err(e) => {
                    tracing::debug!(path = %rel, error = %e, "cannot describe a changed path");
                    continue;
                }
            };
            walker.recurse = *deep;
            let depth = rel.matches('/').count();
            match walker.visit(&dir, &awcp_protocol::rawname::to_os(name), rel, depth) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::debug!(path = %rel, error = %e, "cannot describe a changed path")
                }
            }
        }
        Ok(())
    })?;
    Ok(Built {
        skipped: walked.skipped,
        untrusted: walked.untrusted,
        manifest: Manifest {
            version: DATA_PLANE_VERSION,
            export_id: params.export_id.clone(),
            block_size: params.block_size,
            read_only: params.read_only,
            root_mode: 0,
            root_mtime_ns: 0,
            entries: walked.entries,
        },
        index: walked.index,
    })
}

/// Run `walk` with a [`Walker`] whose files are hashed by a few threads meanwhile, then
/// put the hashes into the entries and build the block index (dropping files that failed).
fn walk_with(
    params: &ManifestParams,
    cache: Option<&HashCache>,
    walk: impl FnOnce(&mut Walker<'_>) -> io::Result<()>,
) -> io::Result<Walked> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, HASH_THREADS);
    let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(256);
    let rx = Mutex::new(rx);
    let results: Mutex<Vec<JobResult>> = Mutex::new(Vec::new());
    let parts = &Parts::default();
    let walker_for = |part: usize, jobs: SyncSender<Job>| Walker {
        part,
        may_defer: false,
        parts,
        block_size: params.block_size,
        out: WalkerOut::default(),
        cache,
        jobs: Some(jobs),
        filter: params.filter.clone(),
        recurse: true,
        progress: params.progress.clone(),
    };
    let mut walker = walker_for(0, tx.clone());
    let walked = std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                hash_worker(
                    &rx,
                    &results,
                    params.block_size,
                    cache,
                    params.progress.as_deref(),
                )
            });
        }
        let r = walk(&mut walker);
        parts.finish(0, walker.out);
        // The subtrees left for later (when building a whole manifest): a few threads walk
        // them, each into a walker of its own, which may leave subtrees of its own.
        let walkers = if parts.queue.lock().waiting.is_empty() {
            0
        } else {
            threads
        };
        std::thread::scope(|w| {
            for _ in 0..walkers {
                let (tx, walker_for) = (tx.clone(), &walker_for);
                w.spawn(move || {
                    while let Some((part, d)) = parts.next() {
                        // Counted out however this walk ends (a panic included: the
                        // others would wait for it forever).
                        let _walking = scopeguard::guard((), |()| parts.walked());
                        let mut sub = walker_for(part, tx.clone());
                        sub.may_defer = true;
                        if let Err(e) = sub.walk_dir(d.dir, &d.rel, d.depth) {
                            parts.skipped.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(path = %d.rel, error = %e,
                                "skipping an entry that cannot be read");
                        }
                        sub.jobs = None;
                        parts.finish(part, sub.out);
                    }
                });
            }
        });
        // Closing the queue ends the workers once it is drained.
        drop(tx);
        if let Some(p) = &params.progress {
            p.set_walked();
        }
        r
    });
    walked?;
    let mut skipped = parts.skipped.load(Ordering::Relaxed);
    let mut untrusted = 0;
    let PartLists { outs, children } = std::mem::take(&mut *parts.lists.lock());
    let mut parts: Vec<WalkerOut> = outs.into_iter().map(Option::unwrap_or_default).collect();
    let walkers = parts.len();
    for (part, idx, r) in results.into_inner() {
        let out = &mut parts[part];
        match r {
            Ok((st, h, trusted)) => {
                let e = &mut out.entries[idx];
                e.mode = perm(&st);
                e.mtime_ns = mtime_ns(&st);
                e.ino = Some(st.st_ino);
                e.ctime_ns = Some(ctime_ns(&st));
                out.hashes[idx] = Some(h);
                if trusted {
                    out.stamps[idx] = Some(Stamp::of(&st));
                }
            }
            Err(e) => {
                let path = &out.entries[idx].path;
                tracing::warn!(path = %path, error = %e, "skipping an entry that cannot be read");
            }
        }
    }
    // Each subtree goes right after its directory's own entry: the order a single walk
    // gives (parents first, names sorted).
    let total = parts.iter().map(|p| p.entries.len()).sum();
    let mut all = WalkerOut {
        entries: Vec::with_capacity(total),
        hashes: Vec::with_capacity(total),
        stamps: Vec::with_capacity(total),
    };
    splice(0, &mut parts, &children, &mut all);
    // Fill in content, build the index in manifest order, and drop files that failed.
    let mut index = BlockIndex::default();
    let mut entries = Vec::with_capacity(all.entries.len());
    for ((mut e, h), stamp) in all.entries.into_iter().zip(all.hashes).zip(all.stamps) {
        if e.kind == EntryKind::File {
            let Some(mut h) = h else {
                // Withheld files have no hashes by design; other files without them failed.
                if params
                    .filter
                    .as_ref()
                    .is_some_and(|f| f.withholds(&rawname::lossy(&e.path), false))
                {
                    entries.push(e);
                } else {
                    skipped += 1;
                }
                continue;
            };
            e.xattrs = std::mem::take(&mut h.xattrs);
            let path: Arc<str> = Arc::from(e.path.as_str());
            match stamp {
                Some(stamp) => index.set_stamp(path.clone(), stamp),
                None => untrusted += 1,
            }
            let mut offset = 0u64;
            e.blocks = Vec::with_capacity(h.blocks.len());
            for (bh, len) in &h.blocks {
                index.insert(
                    *bh.as_bytes(),
                    BlockLoc {
                        path: path.clone(),
                        offset,
                        len: *len,
                    },
                );
                offset += u64::from(*len);
                e.blocks.push(bh.to_hex().to_string());
            }
            e.size = h.size;
            e.hash = Some(h.hash.to_hex().to_string());
        }
        entries.push(e);
    }
    Ok(Walked {
        entries,
        index,
        parts: walkers,
        skipped,
        untrusted,
    })
}

/// Append part `part`'s entries to `all`, each of its deferred subtrees (recursively) right
/// after the entry that precedes it.
fn splice(
    part: usize,
    parts: &mut [WalkerOut],
    children: &[Vec<(usize, usize)>],
    all: &mut WalkerOut,
) {
    let out = std::mem::take(&mut parts[part]);
    let mut kids = children[part].iter().peekable();
    for (i, ((e, h), s)) in out
        .entries
        .into_iter()
        .zip(out.hashes)
        .zip(out.stamps)
        .enumerate()
    {
        all.push(e, h, s);
        while let Some((_, child)) = kids.next_if(|(at, _)| *at == i + 1) {
            splice(*child, parts, children, all);
        }
    }
}

/// Most subtrees left for the walking threads at once (each holds its directory open).
const MAX_QUEUED: usize = 256;

/// Directories down to this many levels below the root are each walked by a walker of its
/// own (the walking threads take them one at a time): the root's children and
/// grandchildren, so a tree with one big top-level directory (`src/`) is shared out too.
/// Deeper, a directory is left to another walker when a walking thread has nothing to do
/// (see [`Parts::hungry`]), so a tree whose bulk sits under a chain of single directories
/// (`src/main/java/org/…`) is shared out as well.
const DEFER_DEPTH: usize = 2;

/// The walk's parts, shared by its walkers: what each walker listed, where the subtrees it
/// left go, and the subtrees waiting for a walking thread.
#[derive(Default)]
struct Parts {
    lists: Mutex<PartLists>,
    queue: Mutex<WalkQueue>,
    queue_cv: parking_lot::Condvar,
    /// Deferred subtrees not yet taken by a walking thread: each holds an open descriptor,
    /// so there are at most [`MAX_QUEUED`] (beyond, a walker walks on).
    queued: AtomicUsize,
    /// Walking threads waiting for a subtree.
    idle: AtomicUsize,
    /// Entries left out (see [`Built::skipped`]).
    skipped: AtomicUsize,
}

/// Every walker's output by part number (0: the first walker), and per part the parts to
/// splice in after its entries: (how many of its entries precede, part).
struct PartLists {
    outs: Vec<Option<WalkerOut>>,
    children: Vec<Vec<(usize, usize)>>,
}

impl Default for PartLists {
    /// Part 0, the first walker's; every other part is made when it is left.
    fn default() -> Self {
        PartLists {
            outs: vec![None],
            children: vec![Vec::new()],
        }
    }
}

/// Subtrees waiting for a walking thread, and how many threads are walking one (they may
/// leave more): a thread that finds nothing waits until none is.
#[derive(Default)]
struct WalkQueue {
    waiting: std::collections::VecDeque<(usize, Deferred)>,
    walking: usize,
}

impl Parts {
    /// Leave `d`, found by part `part`, to a walker of its own: number it as a new part and
    /// queue it at once.
    fn defer(&self, part: usize, d: Deferred) {
        {
            let mut lists = self.lists.lock();
            let child = lists.outs.len();
            lists.outs.push(None);
            lists.children.push(Vec::new());
            lists.children[part].push((d.at, child));
            self.queue.lock().waiting.push_back((child, d));
        }
        self.queue_cv.notify_one();
    }

    /// Keep part `part`'s output.
    fn finish(&self, part: usize, out: WalkerOut) {
        self.lists.lock().outs[part] = Some(out);
    }

    /// Count one more queued subtree, unless [`MAX_QUEUED`] are.
    fn take_slot(&self) -> bool {
        self.queued
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < MAX_QUEUED).then_some(n + 1)
            })
            .is_ok()
    }

    /// A walking thread would take a subtree now, and none is waiting for one.
    fn hungry(&self) -> bool {
        self.idle.load(Ordering::Relaxed) > self.queued.load(Ordering::Relaxed)
    }

    /// The next subtree to walk, counted as walking; `None` once none is queued and none is
    /// being walked (so none can be left any more).
    fn next(&self) -> Option<(usize, Deferred)> {
        let mut q = self.queue.lock();
        loop {
            if let Some(next) = q.waiting.pop_front() {
                q.walking += 1;
                self.queued.fetch_sub(1, Ordering::Relaxed);
                return Some(next);
            }
            if q.walking == 0 {
                drop(q);
                self.queue_cv.notify_all();
                return None;
            }
            self.idle.fetch_add(1, Ordering::Relaxed);
            self.queue_cv.wait(&mut q);
            self.idle.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// A walking thread is done with its subtree.
    fn walked(&self) {
        self.queue.lock().walking -= 1;
        self.queue_cv.notify_all();
    }
}

/// Most threads hashing at once during a build.
pub(crate) const HASH_THREADS: usize = 4;

struct Walked {
    entries: Vec<ManifestEntry>,
    index: BlockIndex,
    /// How many walkers shared the walk (the first one and one per subtree left).
    parts: usize,
    /// See [`Built::skipped`].
    skipped: usize,
    /// See [`Built::untrusted`].
    untrusted: usize,
}

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

fn perm(st: &FileStat) -> u32 {
    st.st_mode & 0o7777
}

/// Content hashes of a file, cut into blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHashes {
    /// blake3 of the whole content.
    pub hash: blake3::Hash,
    /// blake3 and length of each block, in order.
    pub blocks: Vec<(blake3::Hash, u32)>,
    /// Bytes read.
    pub size: u64,
    /// The file's `user.*` extended attributes, name → value in hex (not part of the
    /// content hash: carried with it because the hash cache's validity test, which includes
    /// the ctime, covers both).
    pub xattrs: BTreeMap<String, String>,
}

/// Hash `reader` whole and in blocks of `block_size` bytes (offset-aligned; the last block
/// may be shorter; empty input has no blocks).
pub fn hash_blocks(reader: impl Read, block_size: u32) -> io::Result<FileHashes> {
    thread_local! {
        // One block buffer per thread, not one allocation per file.
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with_borrow_mut(|buf| {
        buf.resize(block_size as usize, 0);
        hash_blocks_with(reader, buf)
    })
}

fn hash_blocks_with(mut reader: impl Read, buf: &mut [u8]) -> io::Result<FileHashes> {
    // Fed only once a file turns out to have more than one block: a one-block file's hash
    // is its block's hash, computed once.
    let mut whole = blake3::Hasher::new();
    let mut blocks = Vec::new();
    let mut size = 0u64;
    loop {
        // Fill a whole block unless the input ends: short reads must not shift block edges.
        let mut filled = 0;
        while filled < buf.len() {
            match reader.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if filled == 0 {
            break;
        }
        let block = &buf[..filled];
        let h = blake3::hash(block);
        let full = filled == buf.len();
        if full || !blocks.is_empty() {
            whole.update(block);
        }
        // `filled` is at most `block_size`, a u32.
        blocks.push((h, filled as u32));
        size += filled as u64;
        if !full {
            break;
        }
    }
    let hash = match blocks.as_slice() {
        [] => blake3::hash(b""),
        [(only, _)] => *only,
        _ => whole.finalize(),
    };
    Ok(FileHashes {
        hash,
        blocks,
        size,
        xattrs: BTreeMap::new(),
    })
}

/// A subdirectory whose walk was left for later, and where its entries go: right after
/// the directory's own entry, the walker's `at`-th.
struct Deferred {
    dir: Dir,
    rel: String,
    depth: usize,
    at: usize,
}

/// What a walker listed: entries, and per entry the hashes and stamp known so far.
#[derive(Debug, Default)]
struct WalkerOut {
    entries: Vec<ManifestEntry>,
    /// Content hashes per entry (files only), filled from the cache or by the workers.
    hashes: Vec<Option<FileHashes>>,
    /// Per entry: the file's stamp, when its blocks can be served without re-hashing.
    stamps: Vec<Option<Stamp>>,
}

impl WalkerOut {
    fn push(&mut self, e: ManifestEntry, h: Option<FileHashes>, s: Option<Stamp>) {
        self.entries.push(e);
        self.hashes.push(h);
        self.stamps.push(s);
    }
}

struct Walker<'a> {
    /// Which walker this is, for the hashing threads' answers: 0 walks first, then one per
    /// deferred subtree.
    part: usize,
    /// When set, directories down to [`DEFER_DEPTH`] levels below the root, and deeper
    /// ones while a walking thread is idle, are not entered but left to walkers of their
    /// own.
    may_defer: bool,
    filter: Option<super::PathFilter>,
    block_size: u32,
    /// What it listed so far.
    out: WalkerOut,
    cache: Option<&'a HashCache>,
    /// The walk's parts, shared by its walkers.
    parts: &'a Parts,
    jobs: Option<SyncSender<Job>>,
    /// Enter directories (a shallow [`describe`] lists a known directory's own entry only).
    recurse: bool,
    progress: Option<Arc<super::BuildProgress>>,
}

impl Walker<'_> {
    /// List `dir` (whose path is `prefix`), emit its entries, recurse into subdirectories.
    fn walk_dir(&mut self, mut dir: Dir, prefix: &str, depth: usize) -> io::Result<()> {
        let mut names = Vec::new();
        for entry in dir.iter() {
            let entry = entry?;
            let raw = entry.file_name().to_bytes();
            if raw == b"." || raw == b".." {
                continue;
            }
            names.push(raw.to_vec());
        }
        // Sorted by raw bytes: names that are not UTF-8 among the rest, as `ls` sorts in C.
        names.sort_unstable();
        for raw in names {
            if raw.starts_with(TMP_PREFIX.as_bytes()) {
                continue;
            }
            // Names that are not UTF-8 are held escaped (see `awcp_protocol::rawname`).
            let name = rawname::from_bytes(&raw);
            let rel = if prefix.is_empty() {
                name.into_owned()
            } else {
                format!("{prefix}/{name}")
            };
            if let Err(e) = self.visit(&dir, OsStr::from_bytes(&raw), &rel, depth) {
                self.parts.skipped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(path = %rel, error = %e, "skipping an entry that cannot be read");
            }
        }
        Ok(())
    }

    fn visit(&mut self, dir: &Dir, name: &OsStr, rel: &str, depth: usize) -> io::Result<()> {
        let st = fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        // Hidden paths are left out (parents were checked on the way down), unless the
        // filter withholds them: listed, content left out (see `PathFilter`).
        let is_dir = NodeKind::of(&st) == NodeKind::Dir;
        let withheld = match &self.filter {
            Some(f) if !f.shows_entry(&rawname::lossy(rel), is_dir) => {
                if !f.withholds(&rawname::lossy(rel), is_dir) {
                    return Ok(());
                }
                true
            }
            _ => false,
        };
        if withheld && !matches!(NodeKind::of(&st), NodeKind::File | NodeKind::Dir) {
            // Only files and directories are withheld; anything else stays left out.
            return Ok(());
        }
        match NodeKind::of(&st) {
            NodeKind::Dir => {
                if depth + 1 >= MAX_DEPTH {
                    self.parts.skipped.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(path = %rel, max = MAX_DEPTH, "skipping a directory nested too deep");
                    return Ok(());
                }
                let sub = Dir::openat(dir.as_fd(), name, dir_flags(), Mode::empty())?;
                let xattrs = fd_user_xattrs(sub.as_fd(), rel);
                let entry = ManifestEntry {
                    path: rel.to_owned(),
                    kind: EntryKind::Dir,
                    mode: perm(&st),
                    size: 0,
                    mtime_ns: mtime_ns(&st),
                    hash: None,
                    blocks: Vec::new(),
                    target: None,
                    ino: Some(st.st_ino),
                    ctime_ns: Some(ctime_ns(&st)),
                    xattrs,
                };
                self.out.push(entry, None, None);
                if !self.recurse {
                    return Ok(());
                }
                if self.may_defer
                    && (depth < DEFER_DEPTH || self.parts.hungry())
                    && self.parts.take_slot()
                {
                    let d = Deferred {
                        dir: sub,
                        rel: rel.to_owned(),
                        depth: depth + 1,
                        at: self.out.entries.len(),
                    };
                    self.parts.defer(self.part, d);
                    return Ok(());
                }
                self.walk_dir(sub, rel, depth + 1)
            }
            NodeKind::File if withheld => {
                // Metadata as the Delegator has it, no content: never opened or hashed.
                let entry = ManifestEntry {
                    path: rel.to_owned(),
                    kind: EntryKind::File,
                    mode: perm(&st),
                    size: st.st_size.max(0) as u64,
                    mtime_ns: mtime_ns(&st),
                    hash: None,
                    blocks: Vec::new(),
                    target: None,
                    ino: Some(st.st_ino),
                    ctime_ns: Some(ctime_ns(&st)),
                    xattrs: BTreeMap::new(),
                };
                self.out.push(entry, None, None);
                Ok(())
            }
            NodeKind::File => {
                let cached = self.cache.and_then(|c| c.lookup(&st, self.block_size));
                // Content (size, hash, blocks) is filled in when the hashes are known.
                let entry = ManifestEntry {
                    path: rel.to_owned(),
                    kind: EntryKind::File,
                    mode: perm(&st),
                    size: 0,
                    mtime_ns: mtime_ns(&st),
                    hash: None,
                    blocks: Vec::new(),
                    target: None,
                    ino: Some(st.st_ino),
                    ctime_ns: Some(ctime_ns(&st)),
                    // With the content, from the hashing thread or the hash cache.
                    xattrs: BTreeMap::new(),
                };
                if let Some(p) = &self.progress {
                    p.saw_file(st.st_size.max(0) as u64, cached.is_some());
                }
                if cached.is_some() {
                    // Unchanged since a quiescent hashing: its blocks need no re-hash.
                    self.out.push(entry, cached, Some(Stamp::of(&st)));
                    return Ok(());
                }
                let file = open_file_at(dir.as_fd(), name, rel).map_err(io::Error::other)?;
                let idx = self.out.entries.len();
                self.out.push(entry, None, None);
                let job = Job {
                    part: self.part,
                    idx,
                    file,
                    rel: rel.to_owned(),
                };
                if let Some(tx) = &self.jobs {
                    tx.send(job)
                        .map_err(|_| io::Error::other("hashing threads stopped"))?;
                }
                Ok(())
            }
            NodeKind::Symlink => {
                let target = readlinkat(dir.as_fd(), name)?;
                let size = target.len() as u64;
                let target = rawname::from_os(&target);
                let entry = ManifestEntry {
                    path: rel.to_owned(),
                    kind: EntryKind::Symlink,
                    mode: perm(&st),
                    size,
                    mtime_ns: mtime_ns(&st),
                    hash: None,
                    blocks: Vec::new(),
                    target: Some(target.into_owned()),
                    ino: Some(st.st_ino),
                    ctime_ns: Some(ctime_ns(&st)),
                    // Linux allows no user.* attributes on a symlink.
                    xattrs: BTreeMap::new(),
                };
                self.out.push(entry, None, None);
                Ok(())
            }
            NodeKind::Special | NodeKind::Absent => {
                self.parts.skipped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(path = %rel, "skipping a special file (fifo, socket or device)");
                Ok(())
            }
        }
    }
}

/// The `user.*` extended attributes of the file or directory open as `fd`, name → value in
/// hex. Left out, each with a `warn`: names that are not UTF-8 and values over
/// [`MAX_MANIFEST_XATTR_VALUE`] bytes (Linux's own limit, so none in practice). A filesystem
/// without extended attributes has none. Read from a descriptor the walk or a hashing
/// thread holds anyway: one `flistxattr` per entry (and a `fgetxattr` per attribute), no
/// path lookup.
pub(crate) fn fd_user_xattrs(fd: BorrowedFd<'_>, rel: &str) -> BTreeMap<String, String> {
    thread_local! {
        // XATTR_LIST_MAX and the largest value carried: one buffer each per thread.
        static BUFS: std::cell::RefCell<(Vec<u8>, Vec<u8>)> =
            const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    let mut out = BTreeMap::new();
    BUFS.with_borrow_mut(|(list, value)| {
        list.resize(64 * 1024, 0);
        let n = match rustix::fs::flistxattr(fd, &mut list[..]) {
            Ok(n) => n,
            Err(rustix::io::Errno::NOTSUP) => return,
            Err(e) => {
                tracing::warn!(path = %rel, error = %e, "cannot list extended attributes");
                return;
            }
        };
        for attr in list[..n].split(|&b| b == 0) {
            if !attr.starts_with(b"user.") {
                continue;
            }
            let Ok(attr) = std::str::from_utf8(attr) else {
                tracing::warn!(path = %rel, "skipping an extended attribute whose name is not UTF-8");
                continue;
            };
            value.resize(MAX_MANIFEST_XATTR_VALUE, 0);
            match rustix::fs::fgetxattr(fd, attr, &mut value[..]) {
                Ok(len) => {
                    out.insert(attr.to_owned(), hex::encode(&value[..len]));
                }
                Err(rustix::io::Errno::RANGE) => tracing::warn!(
                    path = %rel,
                    name = attr,
                    max = MAX_MANIFEST_XATTR_VALUE,
                    "skipping an extended attribute whose value is too large for the manifest"
                ),
                // Removed since it was listed.
                Err(rustix::io::Errno::NODATA) => {}
                Err(e) => {
                    tracing::warn!(path = %rel, name = attr, error = %e, "cannot read an extended attribute")
                }
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_offset_aligned_even_with_short_reads() {
        /// A reader that returns at most 3 bytes per call.
        struct Dribble<'a>(&'a [u8]);
        impl Read for Dribble<'_> {
            fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
                let n = out.len().min(3).min(self.0.len());
                out[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let data = b"0123456789abcdefghij"; // 20 bytes, block 8 → 8, 8, 4
        let h = hash_blocks(Dribble(data), 8).unwrap();
        assert_eq!(h.size, 20);
        assert_eq!(h.hash, blake3::hash(data));
        let expect: Vec<_> = data
            .chunks(8)
            .map(|c| (blake3::hash(c), c.len() as u32))
            .collect();
        assert_eq!(h.blocks, expect);
    }

    #[test]
    fn empty_input_has_no_blocks() {
        let h = hash_blocks(&b""[..], 8).unwrap();
        assert_eq!(h.size, 0);
        assert!(h.blocks.is_empty());
        assert_eq!(h.hash, blake3::hash(b""));
    }

    #[test]
    fn exact_multiple_has_no_empty_tail_block() {
        let h = hash_blocks(&[1u8; 16][..], 8).unwrap();
        assert_eq!(h.blocks.len(), 2);
    }
}

#[cfg(test)]
mod walk_tests {
    use super::*;
    use std::path::Path;

    /// Paths below `dir` in the manifest's order (parents first, names sorted bytewise),
    /// walked the plain way.
    fn reference(dir: &Path, prefix: &str, out: &mut Vec<String>) {
        let mut names: Vec<Vec<u8>> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().as_bytes().to_vec())
            .collect();
        names.sort_unstable();
        for raw in names {
            let name = String::from_utf8(raw).unwrap();
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            out.push(rel.clone());
            let path = dir.join(&name);
            if std::fs::symlink_metadata(&path).unwrap().is_dir() {
                reference(&path, &rel, out);
            }
        }
    }

    fn reference_paths(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        reference(dir, "", &mut out);
        out
    }

    /// Blocks of 16 bytes, no filter.
    fn params() -> ManifestParams {
        ManifestParams {
            export_id: "x".into(),
            block_size: 16,
            read_only: false,
            filter: None,
            progress: None,
        }
    }

    /// The manifest of `dir` (blocks of 16 bytes, no hash cache).
    fn build_at(dir: &Path) -> io::Result<Built> {
        build(&RootDir::open(dir)?, &params(), None)
    }

    fn paths(built: &Built) -> Vec<&str> {
        built
            .manifest
            .entries
            .iter()
            .map(|e| e.path.as_str())
            .collect()
    }

    #[test]
    fn a_wide_tree_is_walked_whole_within_a_few_hundred_descriptors() {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        // More directories at the split levels than descriptors allowed: holding one open
        // for each until a thread takes it would run out (and drop entries unseen).
        for i in 0..1500 {
            std::fs::create_dir_all(r.join(format!("d{i:04}/s"))).unwrap();
            std::fs::write(r.join(format!("d{i:04}/s/f")), format!("{i}")).unwrap();
        }
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        setrlimit(Resource::RLIMIT_NOFILE, 1024, hard).unwrap();
        let built = build_at(r);
        setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
        let built = built.unwrap();
        let (got, want) = (paths(&built), reference_paths(r));
        assert_eq!(got.len(), 4500);
        assert_eq!(got, want);
        assert!(
            built
                .manifest
                .entries
                .iter()
                .all(|e| e.kind != EntryKind::File || e.hash.is_some() && e.size > 0)
        );
    }

    #[test]
    fn subtrees_walked_apart_come_back_in_walk_order_with_their_hashes() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        // Files between the root's directories, empty and deep directories, and a file
        // hashed by the workers in every subtree (no hash cache).
        for d in ["a/b/c", "a/e", "m", "z/y/x/w", "empty", "n/o"] {
            std::fs::create_dir_all(r.join(d)).unwrap();
        }
        for (i, f) in [
            "0.txt",
            "a/1",
            "a/b/2",
            "a/b/c/3",
            "a/e/4",
            "b.txt",
            "m/5",
            "n.txt",
            "n/o/6",
            "z/7",
            "z/y/x/w/8",
            "zz",
        ]
        .iter()
        .enumerate()
        {
            std::fs::write(r.join(f), format!("content {i} of {f}").repeat(i + 1)).unwrap();
        }
        std::os::unix::fs::symlink("0.txt", r.join("a/link")).unwrap();
        let built = build_at(r).unwrap();
        let (got, want) = (paths(&built), reference_paths(r));
        assert_eq!(got, want);
        for e in &built.manifest.entries {
            if e.kind != EntryKind::File {
                continue;
            }
            let data = std::fs::read(r.join(&e.path)).unwrap();
            assert_eq!(e.size, data.len() as u64, "{}", e.path);
            assert_eq!(
                e.hash,
                Some(blake3::hash(&data).to_hex().to_string()),
                "{}",
                e.path
            );
            let blocks: Vec<String> = data
                .chunks(16)
                .map(|c| blake3::hash(c).to_hex().to_string())
                .collect();
            assert_eq!(e.blocks, blocks, "{}", e.path);
            for (i, c) in data.chunks(16).enumerate() {
                let locs = built.index.locations(blake3::hash(c).as_bytes());
                // One place per file and content (a repeated block is indexed once).
                assert!(
                    locs.iter().any(|l| &*l.path == e.path.as_str()
                        && data[l.offset as usize..][..l.len as usize] == *c),
                    "block {i} of {} not indexed: {locs:?}",
                    e.path
                );
            }
        }
    }

    #[test]
    fn a_tree_under_a_chain_of_single_directories_is_shared_out_below_it() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        // Everything below five single directories, as in `src/main/java/org/project/`:
        // the split by depth alone (two levels) leaves all of it to one walker.
        let chain = r.join("src/main/java/org/project");
        for d in 0..300 {
            let dir = chain.join(format!("pkg{d:03}"));
            std::fs::create_dir_all(&dir).unwrap();
            for f in 0..10 {
                std::fs::write(dir.join(format!("F{f}.java")), format!("{d} {f}")).unwrap();
            }
        }
        let walked = walk_with(&params(), None, |walker| {
            walker.may_defer = true;
            let dir = Dir::open(r, dir_flags(), Mode::empty())?;
            walker.walk_dir(dir, "", 0)
        })
        .unwrap();
        let got: Vec<&str> = walked.entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(got, reference_paths(r));
        assert_eq!(got.len(), 5 + 300 * 11);
        assert!(
            walked
                .entries
                .iter()
                .all(|e| e.kind != EntryKind::File || e.hash.is_some())
        );
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        if threads >= 2 {
            // The root's, `src`'s and `main`'s walkers, and more: directories below the
            // depth split were handed to walking threads that had nothing to do.
            assert!(
                walked.parts > 3,
                "the walk was not shared out below the depth split: {} walkers",
                walked.parts
            );
        } else {
            eprintln!("one CPU: no walking thread is ever idle; only the order is checked");
        }
    }
}
