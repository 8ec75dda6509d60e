//! The Delegator's own changes during a lease: seen, described, and told to mounts.
//!
//! A watcher thread per export (inotify through the `notify` crate: one watch per directory
//! the manifest lists, and a recursive one on each directory that appears later) collects
//! the paths that changed, waits [`DEBOUNCE`] for a burst to settle, then describes each path as
//! the manifest would (a new directory with its whole subtree; files hashed, the hash cache
//! used) and compares it with what the export last told its mounts ([`ChangeFeed`]'s
//! `known` state: the manifest, plus every change since). What differs becomes an
//! [`ExportEvent::Changed`] on `GET /events`, and the new blocks join the block index so a
//! mount can fetch the new content.
//!
//! The export's own commits are not reported back as Delegator changes: a commit records
//! what it wrote (its state, and the `stat` stamp of the file it left) before the watcher
//! sees the event, and a path whose stamp still matches is skipped without being read.
//! Conflict copies (`kept_as`) are new to the mount and are reported.
//!
//! Directory modification times are not compared (every create in a directory changes
//! them); a directory is reported when it appears, disappears or changes mode.
//!
//! Limits: changes made between the manifest walk and the start of the watch are not seen;
//! if the kernel's event queue overflows, the whole tree is walked again and compared.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use awcp_protocol::dataplane::{Change, Conflict, EntryKind, ExportEvent, Manifest, ManifestEntry};
use nix::fcntl::AtFlags;
use nix::sys::stat::fstatat;
use parking_lot::Mutex;

use super::Export;
use super::hashcache::HashCache;
use super::manifest::{self, ManifestParams};
use super::rootfs::RootDir;
use super::store::{Stamp, TMP_PREFIX};

/// How long a burst of changes may go on before it is described.
pub(crate) const DEBOUNCE: Duration = Duration::from_millis(50);
/// Most entries in one `changed` event (larger changes are split).
pub(crate) const MAX_EVENT_ENTRIES: usize = 1024;

/// What a mount needs to know changed about a path (no inode number, no ctime, and no
/// modification time for directories).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sig {
    kind: EntryKind,
    mode: u32,
    size: u64,
    mtime_ns: i64,
    /// Content hash (files) or target (symlinks).
    content: Option<String>,
    /// `user.*` extended attributes (files and directories).
    xattrs: std::collections::BTreeMap<String, String>,
}

impl Sig {
    fn of(e: &ManifestEntry) -> Sig {
        match e.kind {
            EntryKind::Dir => Sig {
                kind: e.kind,
                mode: e.mode & 0o7777,
                size: 0,
                mtime_ns: 0,
                content: None,
                xattrs: e.xattrs.clone(),
            },
            EntryKind::File => Sig {
                kind: e.kind,
                mode: e.mode & 0o7777,
                size: e.size,
                mtime_ns: e.mtime_ns,
                content: e.hash.clone(),
                xattrs: e.xattrs.clone(),
            },
            EntryKind::Symlink => Sig {
                kind: e.kind,
                mode: 0,
                size: 0,
                mtime_ns: 0,
                content: e.target.clone(),
                xattrs: Default::default(),
            },
        }
    }
}

#[derive(Debug, Default)]
struct FeedState {
    /// Bumped once per batch of recorded changes.
    seq: u64,
    /// What mounts were told each path is (the manifest, then every change since). Shared
    /// with a kept walk until the first change (copied then).
    known: Arc<Known>,
    /// Files the export's own commits left, by the stamp they had right after.
    own: HashMap<String, Stamp>,
    /// Every path changed since registration: the batch it changed in and what it is now
    /// (`None`: removed, with its subtree).
    changed: HashMap<String, (u64, Option<ManifestEntry>)>,
    /// Mount instances that ended with every change they made applied as sent (newest
    /// last, at most [`MAX_ENDED`]): what each of them showed is this registration's tree
    /// and its changes since, so a later mount can answer their fsmonitor tokens.
    ended: std::collections::VecDeque<String>,
}

/// What a feed knows of every path.
pub(crate) type Known = HashMap<String, Sig>;

/// The feed's starting point for a manifest's `entries` (~50 ms at 100,000).
pub(crate) fn known_of(entries: &[ManifestEntry]) -> Arc<Known> {
    Arc::new(
        entries
            .iter()
            .map(|e| (e.path.clone(), Sig::of(e)))
            .collect(),
    )
}

/// Clean mount ends remembered; an older one forgotten only costs a later mount's first
/// `git status` a full look.
const MAX_ENDED: usize = 1024;

impl FeedState {
    /// Forget everything below the directory `path` (it was removed or replaced): one scan
    /// of both maps, so only for directories.
    fn forget_below(&mut self, path: &str) {
        let prefix = format!("{path}/");
        Arc::make_mut(&mut self.known).retain(|p, _| !p.starts_with(&prefix));
        self.changed.retain(|p, _| !p.starts_with(&prefix));
    }
}

/// The record of one export's changes since registration, and the signal that there are
/// new ones.
#[derive(Debug)]
pub(crate) struct ChangeFeed {
    /// Held by a commit while it writes and by the watcher while it describes, so the
    /// watcher sees a commit's files only once they are noted as the export's own.
    pub(crate) quiet: Mutex<()>,
    state: Mutex<FeedState>,
    tx: tokio::sync::watch::Sender<u64>,
}

impl ChangeFeed {
    /// A feed whose starting point is `manifest`.
    pub(crate) fn new(manifest: &Manifest) -> ChangeFeed {
        Self::starting_from(known_of(&manifest.entries))
    }

    /// A feed whose starting point is `known` ([`known_of`] the manifest's entries): a
    /// registration that takes a kept walk shares the walk's map instead of building one.
    pub(crate) fn starting_from(known: Arc<Known>) -> ChangeFeed {
        ChangeFeed {
            quiet: Mutex::new(()),
            // Above 0, so that a stream starting from 0 gets even the commits recorded
            // before the first Delegator-side change (see `note_commit`); and the time of
            // registration in microseconds, so that an export registered again (a daemon
            // restart) starts above every sequence it handed out before: a mount's record
            // of what it saw never looks newer than what the export now describes.
            state: Mutex::new(FeedState {
                seq: first_seq(),
                known,
                ..FeedState::default()
            }),
            tx: tokio::sync::watch::channel(0).0,
        }
    }

    /// Make the sequence at least `seq + 1` (a feed of an export registered again, whose
    /// earlier commits answered up to `seq`).
    pub(crate) fn start_above(&self, seq: u64) {
        let mut st = self.state.lock();
        st.seq = st.seq.max(seq.saturating_add(1));
    }

    /// Remember that mount `instance` ended with every change it made applied as sent.
    pub(crate) fn note_clean_end(&self, instance: &str) {
        let mut st = self.state.lock();
        if st.ended.iter().any(|i| i == instance) {
            return;
        }
        if st.ended.len() >= MAX_ENDED {
            st.ended.pop_front();
        }
        st.ended.push_back(instance.to_owned());
    }

    /// Whether mount `instance` ended cleanly on this registration.
    pub(crate) fn ended_clean(&self, instance: &str) -> bool {
        self.state.lock().ended.iter().any(|i| i == instance)
    }

    /// The latest sequence number.
    pub(crate) fn seq(&self) -> u64 {
        self.state.lock().seq
    }

    /// Woken with the latest sequence number whenever changes are recorded.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.tx.subscribe()
    }

    /// Every change recorded after batch `since` (the latest per path), as events of at
    /// most [`MAX_EVENT_ENTRIES`] entries, and the sequence number they reach.
    pub(crate) fn since(&self, since: u64) -> (Vec<ExportEvent>, u64) {
        let st = self.state.lock();
        let mut entries: Vec<ManifestEntry> = Vec::new();
        let mut removed: Vec<String> = Vec::new();
        for (path, (seq, e)) in &st.changed {
            if *seq <= since {
                continue;
            }
            match e {
                Some(e) => entries.push(e.clone()),
                None => removed.push(path.clone()),
            }
        }
        let seq = st.seq;
        drop(st);
        // Parents before children, and removals (deepest first) before anything new.
        entries.sort_unstable_by(|a, b| a.path.cmp(&b.path));
        removed.sort_unstable_by(|a, b| b.cmp(a));
        let mut events = Vec::new();
        let mut removed = removed.into_iter().peekable();
        let mut entries = entries.into_iter().peekable();
        while removed.peek().is_some() || entries.peek().is_some() {
            let r: Vec<String> = removed.by_ref().take(MAX_EVENT_ENTRIES).collect();
            let room = MAX_EVENT_ENTRIES - r.len();
            let e: Vec<ManifestEntry> = entries.by_ref().take(room).collect();
            events.push(ExportEvent::Changed {
                seq,
                entries: e,
                removed: r,
            });
        }
        (events, seq)
    }

    /// What a file is known as: its content hash (hex), size and modification time.
    pub(crate) fn known_file(&self, path: &str) -> Option<(String, u64, i64)> {
        let st = self.state.lock();
        let s = st.known.get(path).filter(|s| s.kind == EntryKind::File)?;
        Some((s.content.clone()?, s.size, s.mtime_ns))
    }

    /// What a path is known as, if anything.
    fn known_kind(&self, path: &str) -> Option<EntryKind> {
        self.state.lock().known.get(path).map(|s| s.kind)
    }

    /// Whether `path` is still exactly as a commit of ours left it (and forget that).
    fn take_own(&self, path: &str, stamp: Option<Stamp>) -> bool {
        let mut st = self.state.lock();
        match (st.own.remove(path), stamp) {
            (Some(own), Some(now)) => own == now,
            _ => false,
        }
    }

    /// Compare what was found with what is known; record and announce the differences.
    /// `absent` paths that are known are removed with their subtrees.
    fn record(&self, present: Vec<ManifestEntry>, absent: &[String]) -> usize {
        let mut st = self.state.lock();
        let seq = st.seq + 1;
        let mut n = 0;
        for path in absent {
            match Arc::make_mut(&mut st.known).remove(path) {
                None => continue,
                Some(s) if s.kind == EntryKind::Dir => st.forget_below(path),
                Some(_) => {}
            }
            st.changed.insert(path.clone(), (seq, None));
            n += 1;
        }
        for e in present {
            let sig = Sig::of(&e);
            if st.known.get(&e.path) == Some(&sig) {
                continue;
            }
            if st.known.get(&e.path).map(|s| s.kind) == Some(EntryKind::Dir)
                && e.kind != EntryKind::Dir
            {
                // A directory replaced by a file: its old subtree is gone.
                st.forget_below(&e.path);
            }
            Arc::make_mut(&mut st.known).insert(e.path.clone(), sig);
            st.changed.insert(e.path.clone(), (seq, Some(e)));
            n += 1;
        }
        if n > 0 {
            st.seq = seq;
            drop(st);
            self.tx.send_replace(seq);
        }
        n
    }

    /// Up to `max` files that, as far as the feed knows, hold exactly the content whose
    /// blake3 is `content` (hex) in at most `max_size` bytes, with their sizes: for a
    /// one-block lookup the block index missed.
    pub(crate) fn files_with_content(
        &self,
        content: &str,
        max_size: u64,
        max: usize,
    ) -> Vec<(String, u64)> {
        self.state
            .lock()
            .known
            .iter()
            .filter(|(_, s)| {
                s.kind == EntryKind::File
                    && s.size <= max_size
                    && s.content.as_deref() == Some(content)
            })
            .map(|(p, s)| (p.clone(), s.size))
            .take(max)
            .collect()
    }

    /// A commit applied `changes` (except the conflicting ones) to the tree: remember what
    /// it left so the watcher does not report it back, and so a mount that reconnects is
    /// not handed an older Delegator-side state of those paths. Returns the sequence the
    /// commit is recorded at (the commit result's `seq`): every event described before the
    /// commit has a `seq` no higher, every Delegator-side change after it a higher one.
    ///
    /// `registered` gives the registration manifest's entry at a path: a `chmod` of a path
    /// unchanged since then is recorded as that entry with the new mode, so that a mount
    /// started later shows the mode (and git's fsmonitor there reports the path).
    pub(crate) fn note_commit(
        &self,
        root: &RootDir,
        changes: &[Change],
        conflicts: &[Conflict],
        registered: impl Fn(&str) -> Option<ManifestEntry>,
    ) -> u64 {
        let stamp_of = |path: &str| {
            let (dir, name) = root.open_parent(path).ok()?;
            fstatat(
                &dir,
                &*awcp_protocol::rawname::to_os(name),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .ok()
            .map(|st| Stamp::of(&st))
        };
        let mut st = self.state.lock();
        // Recorded in the current batch, not a new one: streams already past it (the
        // committing mount's) do not get their own changes back; a stream that connects
        // later does.
        let seq = st.seq;
        for c in changes {
            let path = c.path();
            if conflicts.iter().any(|k| k.path == path) {
                continue;
            }
            let stamp = stamp_of(path);
            if let (Change::Chmod { mtime_ns, .. }, Some(now)) = (c, stamp)
                && !chmod_left(st.known.get(path), *mtime_ns, now)
            {
                // Not what the `chmod` left: the Delegator replaced the file right after
                // it (git renaming its new index into place, say). The watcher describes
                // it; taking it as the commit's own would hide that change from mounts.
                continue;
            }
            // What the commit left at `path`, as the manifest would list it.
            let left = |kind, mode: u32| ManifestEntry {
                path: path.to_owned(),
                kind,
                mode: mode & 0o7777,
                size: 0,
                mtime_ns: stamp.map_or(0, |s| s.mtime_ns),
                hash: None,
                blocks: Vec::new(),
                target: None,
                ino: stamp.map(|s| s.ino),
                ctime_ns: stamp.map(|s| s.ctime_ns),
                xattrs: Default::default(),
            };
            let entry = match c {
                Change::Mkdir { mode, .. } => Some(left(EntryKind::Dir, *mode)),
                Change::Write {
                    mode,
                    hash,
                    size,
                    blocks,
                    mtime_ns,
                    xattrs,
                    ..
                } => Some(ManifestEntry {
                    size: *size,
                    mtime_ns: *mtime_ns,
                    hash: Some(hash.clone()),
                    blocks: blocks.clone(),
                    xattrs: xattrs.clone().unwrap_or_default(),
                    ..left(EntryKind::File, *mode)
                }),
                Change::Symlink { target, .. } => Some(ManifestEntry {
                    size: target.len() as u64,
                    target: Some(target.clone()),
                    ..left(EntryKind::Symlink, 0o777)
                }),
                Change::Chmod { mode, mtime_ns, .. } => {
                    let before = match st.changed.get(path) {
                        Some((_, e)) => e.clone().map(|e| (e, true)),
                        None if st.known.contains_key(path) => registered(path).map(|e| (e, false)),
                        None => None,
                    };
                    match before {
                        Some((mut e, true)) => {
                            e.mode = *mode & 0o7777;
                            if let Some(t) = mtime_ns {
                                e.mtime_ns = *t;
                            }
                            Some(e)
                        }
                        Some((mut e, false)) => {
                            // Unchanged since registration: the manifest's entry, with the
                            // new mode (and time), and the file's stamp now.
                            e.mode = *mode & 0o7777;
                            if let (Some(t), EntryKind::File) = (mtime_ns, e.kind) {
                                e.mtime_ns = *t;
                            }
                            if let Some(s) = stamp {
                                e.ino = Some(s.ino);
                                e.ctime_ns = Some(s.ctime_ns);
                            }
                            Some(e)
                        }
                        None => {
                            // Not known as it was registered: only the known state moves
                            // (the watcher describes whatever is there).
                            if let Some(k) = Arc::make_mut(&mut st.known).get_mut(path) {
                                k.mode = *mode & 0o7777;
                                if let (Some(t), EntryKind::File) = (mtime_ns, k.kind) {
                                    k.mtime_ns = *t;
                                }
                            }
                            if let Some(s) = stamp {
                                st.own.insert(path.to_owned(), s);
                            }
                            continue;
                        }
                    }
                }
                Change::Unlink { .. } | Change::Rmdir { .. } => None,
            };
            match entry {
                Some(e) => {
                    Arc::make_mut(&mut st.known).insert(path.to_owned(), Sig::of(&e));
                    st.changed.insert(path.to_owned(), (seq, Some(e)));
                    if let Some(s) = stamp {
                        st.own.insert(path.to_owned(), s);
                    }
                }
                None => {
                    if Arc::make_mut(&mut st.known).remove(path).map(|s| s.kind)
                        == Some(EntryKind::Dir)
                    {
                        st.forget_below(path);
                    }
                    st.changed.insert(path.to_owned(), (seq, None));
                    st.own.remove(path);
                }
            }
        }
        seq
    }
}

/// Whether a file found with stamp `now` after a `chmod` (setting `mtime_ns`, if given) is
/// the one the `chmod` changed, as far as the feed can tell: its modification time is the
/// one set, or, with none set, the size and time of the file the feed `known` there.
/// Directories and symlinks always are.
fn chmod_left(known: Option<&Sig>, mtime_ns: Option<i64>, now: Stamp) -> bool {
    let Some(k) = known.filter(|k| k.kind == EntryKind::File) else {
        return true;
    };
    match mtime_ns {
        Some(t) => now.mtime_ns == t,
        None => now.size == k.size && now.mtime_ns == k.mtime_ns,
    }
}

/// The first sequence number of a feed: microseconds since the epoch (at least 1). Batches
/// come at most one per [`DEBOUNCE`], so a feed registered later always starts above the
/// last sequence an earlier one of the same export reached.
fn first_seq() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2))
        .max(1)
}

/// Start watching `export`'s tree on a thread of its own; it stops when the export is
/// dropped or its lease is no longer active.
pub(crate) fn spawn(export: &Arc<Export>, cache: Option<Arc<HashCache>>) {
    let weak = Arc::downgrade(export);
    let root = export.root().to_path_buf();
    let id = export.id().to_owned();
    let spawned = std::thread::Builder::new()
        .name("awcpfs-watch".into())
        .spawn(move || {
            // The manifest's walk already found every directory: watch each of those,
            // rather than have `notify` walk the tree again (its recursive mode stats every
            // entry: 100,000 `statx` on a 100,000-file tree, just as a mount starts).
            let dirs: Vec<PathBuf> = match weak.upgrade() {
                Some(export) => export
                    .manifest_entries()
                    .iter()
                    .filter(|e| e.kind == EntryKind::Dir)
                    .map(|e| root.join(awcp_protocol::rawname::to_os(&e.path)))
                    .collect(),
                None => return,
            };
            if let Err(e) = watch(&weak, &root, dirs, cache.as_deref()) {
                tracing::warn!(export = %id, error = %e,
                    "cannot watch the exported tree: Delegator-side changes will not reach mounts");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the export's watcher thread");
    }
}

/// Paths collected from the kernel's events, and whether the whole tree must be walked.
#[derive(Debug, Default)]
struct Pending {
    paths: Vec<String>,
    rescan: bool,
}

impl Pending {
    fn add(&mut self, root: &Path, event: notify::Result<notify::Event>) {
        let event = match event {
            Ok(ev) => ev,
            Err(e) => {
                tracing::debug!(error = %e, "watch error: walking the tree again");
                self.rescan = true;
                return;
            }
        };
        if event.need_rescan() {
            self.rescan = true;
        }
        if says_nothing(&event) {
            return;
        }
        for p in event.paths {
            let Ok(rel) = p.strip_prefix(root) else {
                continue;
            };
            // Names that are not UTF-8 are held escaped, as in the manifest.
            let rel = awcp_protocol::rawname::from_os(rel.as_os_str());
            if rel.is_empty() || rel.split('/').any(|c| c.starts_with(TMP_PREFIX)) {
                continue;
            }
            self.paths.push(rel.into_owned());
        }
    }
}

/// An event that says nothing changed. inotify (as `notify` asks it) also reports opens and
/// reads, and the export opens every file it serves: describing those would hash every
/// served file again. Only a close after writing says something changed (writes themselves
/// come as modifications).
fn says_nothing(event: &notify::Event) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    matches!(event.kind, EventKind::Access(kind) if kind != AccessKind::Close(AccessMode::Write))
}

/// Watch a directory that appeared after the manifest was built (created, or moved in),
/// with everything below it: what it holds already is described with it (a path not known
/// as a directory is described with its whole subtree).
fn follow_new_dir(watcher: &mut impl notify::Watcher, event: &notify::Result<notify::Event>) {
    use notify::event::{CreateKind, EventKind, ModifyKind, RenameMode};
    let Ok(event) = event else { return };
    let path = match event.kind {
        EventKind::Create(CreateKind::Folder) => event.paths.first(),
        // A rename within the tree keeps its watches (inotify watches inodes): only one
        // from outside needs a new one, but telling them apart costs more than a watch.
        EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both)) => event
            .paths
            .last()
            .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir())),
        _ => None,
    };
    if let Some(path) = path
        && let Err(e) = watcher.watch(path, notify::RecursiveMode::Recursive)
    {
        tracing::debug!(path = %path.display(), error = %e, "cannot watch a new directory");
    }
}

fn watch(
    weak: &Weak<Export>,
    root: &Path,
    dirs: Vec<PathBuf>,
    cache: Option<&HashCache>,
) -> notify::Result<()> {
    use notify::Watcher;
    let (tx, rx) = std::sync::mpsc::channel();
    // Symlinks are never followed: one pointing at `/` would otherwise put the whole
    // machine under watch (the export never follows them either).
    let mut watcher = notify::RecommendedWatcher::new(
        move |ev: notify::Result<notify::Event>| {
            // Dropped where they are read: a mount's hydration opens every file it serves,
            // and each open would otherwise wake this thread and start a debounce round.
            if ev.as_ref().is_ok_and(says_nothing) {
                return;
            }
            let _ = tx.send(ev);
        },
        notify::Config::default().with_follow_symlinks(false),
    )?;
    watcher.watch(root, notify::RecursiveMode::NonRecursive)?;
    let (total, mut failed, mut first_error) = (dirs.len(), 0usize, None);
    for dir in dirs {
        if let Err(e) = watcher.watch(&dir, notify::RecursiveMode::NonRecursive) {
            // Gone since the walk (its removal is an event of its parent), or out of
            // watches.
            if std::fs::symlink_metadata(&dir).is_ok() {
                failed += 1;
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_error {
        tracing::warn!(failed, directories = total, error = %e,
            "cannot watch some of the exported tree's directories: Delegator-side changes \
             in them will not reach mounts (raise fs.inotify.max_user_watches)");
    }
    tracing::debug!(root = %root.display(), "watching the exported tree");
    loop {
        let first = match rx.recv_timeout(Duration::from_millis(500)) {
            Ok(ev) => Some(ev),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
        };
        let Some(export) = weak.upgrade() else {
            return Ok(());
        };
        if export.lease().check_access().is_err() {
            return Ok(());
        }
        if export.stage().is_some() {
            // Staged snapshot mode: the Executor works on the tree as delegated, and its
            // changes are merged file by file later; showing the Delegator's changes on the
            // mount meanwhile would hide its own staged work from it.
            return Ok(());
        }
        let Some(first) = first else { continue };
        let mut pending = Pending::default();
        follow_new_dir(&mut watcher, &first);
        pending.add(root, first);
        let until = Instant::now() + DEBOUNCE;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match rx.recv_timeout(left) {
                Ok(ev) => {
                    follow_new_dir(&mut watcher, &ev);
                    pending.add(root, ev);
                }
                Err(_) => break,
            }
        }
        let n = {
            let _quiet = export.feed.quiet.lock();
            process(&export, cache, pending)
        };
        super::Stats::add(&export.stats.upstream_changes, n as u64);
        if n > 0 {
            tracing::debug!(export = %export.id(), changes = n, "Delegator-side changes");
        }
    }
}

pub(crate) fn params_of(export: &Export) -> ManifestParams {
    ManifestParams {
        export_id: export.id().to_owned(),
        block_size: export.block_size(),
        read_only: export.read_only(),
        filter: export.filter.clone(),
        progress: None,
    }
}

/// Describe what changed and record it; returns how many paths changed.
fn process(export: &Export, cache: Option<&HashCache>, mut pending: Pending) -> usize {
    let root = &export.blocks.root;
    let params = params_of(export);
    let feed = &export.feed;
    if pending.rescan {
        let built = match manifest::build(root, &params, cache) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "cannot walk the exported tree again");
                return 0;
            }
        };
        let present: std::collections::HashSet<&str> = built
            .manifest
            .entries
            .iter()
            .map(|e| e.path.as_str())
            .collect();
        let absent: Vec<String> = feed
            .state
            .lock()
            .known
            .keys()
            .filter(|p| !present.contains(p.as_str()))
            .cloned()
            .collect();
        drop(present);
        export.blocks.index.write().merge(built.index);
        return feed.record(built.manifest.entries, &absent);
    }
    pending.paths.sort_unstable();
    pending.paths.dedup();
    let mut ask: Vec<(String, bool)> = Vec::with_capacity(pending.paths.len());
    for rel in pending.paths {
        if awcp_protocol::dataplane::validate_rel_path(&rel).is_err() {
            continue;
        }
        if let Some(filter) = &export.filter
            && !rel
                .match_indices('/')
                .all(|(end, _)| filter.shows_entry(&rel[..end], true))
        {
            continue;
        }
        let stamp = root.open_parent(&rel).ok().and_then(|(dir, name)| {
            fstatat(
                &dir,
                &*awcp_protocol::rawname::to_os(name),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .ok()
            .map(|st| Stamp::of(&st))
        });
        if feed.take_own(&rel, stamp) {
            continue;
        }
        let deep = feed.known_kind(&rel) != Some(EntryKind::Dir);
        ask.push((rel, deep));
    }
    if ask.is_empty() {
        return 0;
    }
    super::Stats::add(&export.stats.paths_described, ask.len() as u64);
    let built = match manifest::describe(root, &params, cache, &ask) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "cannot describe changed paths");
            return 0;
        }
    };
    let found: std::collections::HashSet<&str> = built
        .manifest
        .entries
        .iter()
        .map(|e| e.path.as_str())
        .collect();
    let absent: Vec<String> = ask
        .iter()
        .filter(|(p, _)| !found.contains(p.as_str()))
        .map(|(p, _)| p.clone())
        .collect();
    drop(found);
    export.blocks.index.write().merge(built.index);
    feed.record(built.manifest.entries, &absent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty() -> Manifest {
        Manifest {
            version: awcp_protocol::dataplane::DATA_PLANE_VERSION,
            export_id: "t".into(),
            block_size: 4096,
            read_only: false,
            root_mode: 0o755,
            root_mtime_ns: 0,
            entries: Vec::new(),
        }
    }

    #[test]
    fn opens_and_reads_say_nothing_and_a_close_after_writing_does() {
        use notify::event::{
            AccessKind, AccessMode, CreateKind, DataChange, EventKind, ModifyKind,
        };
        let ev = |kind| notify::Event::new(kind).add_path("/t/f".into());
        for quiet in [
            AccessKind::Open(AccessMode::Any),
            AccessKind::Read,
            AccessKind::Close(AccessMode::Read),
            AccessKind::Any,
        ] {
            assert!(says_nothing(&ev(EventKind::Access(quiet))), "{quiet:?}");
        }
        for change in [
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            EventKind::Modify(ModifyKind::Data(DataChange::Any)),
            EventKind::Create(CreateKind::File),
            EventKind::Remove(notify::event::RemoveKind::File),
        ] {
            assert!(!says_nothing(&ev(change)), "{change:?}");
        }
        // And a change still reaches the pending set.
        let mut p = Pending::default();
        p.add(
            Path::new("/t"),
            Ok(ev(EventKind::Access(AccessKind::Close(AccessMode::Write)))),
        );
        p.add(
            Path::new("/t"),
            Ok(ev(EventKind::Access(AccessKind::Open(AccessMode::Any)))),
        );
        assert_eq!(p.paths, ["f"]);
    }

    // A `chmod` from a mount, and the Delegator replacing the file right after it (git
    // renaming its new index into place) before the commit notes what it left: the new file
    // must not be taken as the commit's own, or the watcher skips it and no mount learns
    // of it (the mount then kept its old index).
    #[test]
    fn a_file_replaced_right_after_a_chmod_is_not_the_commits_own() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("index"), "old index").unwrap();
        std::fs::write(dir.path().join("other"), "other").unwrap();
        let root = RootDir::open(dir.path()).unwrap();
        let params = ManifestParams {
            export_id: "t".into(),
            block_size: 4096,
            read_only: false,
            filter: None,
            progress: None,
        };
        let built = manifest::build(&root, &params, None).unwrap();
        let feed = ChangeFeed::new(&built.manifest);
        let chmod = |path: &str, mtime_ns| Change::Chmod {
            path: path.into(),
            mode: 0o600,
            mtime_ns,
            base: None,
            xattrs: None,
        };
        let stamp = |name: &str| {
            let st = fstatat(
                std::fs::File::open(dir.path()).unwrap(),
                name,
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .unwrap();
            Some(Stamp::of(&st))
        };
        // The mode landed on `index`; then the Delegator renamed a new one over it.
        std::fs::write(dir.path().join("index.lock"), "the Delegator's new index").unwrap();
        std::fs::rename(dir.path().join("index.lock"), dir.path().join("index")).unwrap();
        feed.note_commit(&root, &[chmod("index", None)], &[], |_| None);
        assert!(!feed.take_own("index", stamp("index")));
        assert_eq!(
            feed.known_file("index").map(|(_, size, _)| size),
            Some(9),
            "the feed still knows the old file: the watcher reports the new one"
        );
        // With a time set: the same, told by the time.
        feed.note_commit(&root, &[chmod("index", Some(1_000_000_000))], &[], |_| None);
        assert!(!feed.take_own("index", stamp("index")));
        // A file the `chmod` did change is the commit's own.
        feed.note_commit(&root, &[chmod("other", None)], &[], |_| None);
        assert!(feed.take_own("other", stamp("other")));
    }

    // A mount's `chmod` of a file unchanged since registration left the feed's record of
    // changes alone: a mount started later showed the registered mode, and git's fsmonitor
    // there could not know the path changed.
    #[test]
    fn a_chmod_of_a_registered_file_reaches_later_mounts() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tool.sh"), "echo hi").unwrap();
        let root = RootDir::open(dir.path()).unwrap();
        let params = ManifestParams {
            export_id: "t".into(),
            block_size: 4096,
            read_only: false,
            filter: None,
            progress: None,
        };
        let built = manifest::build(&root, &params, None).unwrap();
        let feed = ChangeFeed::new(&built.manifest);
        let registered = |p: &str| built.manifest.entries.iter().find(|e| e.path == p).cloned();
        let (events, _) = feed.since(0);
        assert!(events.is_empty());
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(
            dir.path().join("tool.sh"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        let chmod = Change::Chmod {
            path: "tool.sh".into(),
            mode: 0o755,
            mtime_ns: None,
            base: None,
            xattrs: None,
        };
        feed.note_commit(&root, &[chmod], &[], registered);
        let (events, _) = feed.since(0);
        let entries: Vec<&ManifestEntry> = events
            .iter()
            .flat_map(|e| match e {
                ExportEvent::Changed { entries, .. } => entries.iter().collect::<Vec<_>>(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(entries.len(), 1, "{events:?}");
        assert_eq!(entries[0].path, "tool.sh");
        assert_eq!(entries[0].mode, 0o755);
        assert_eq!(
            entries[0].hash, built.manifest.entries[0].hash,
            "the content is the registered one"
        );
        // The commit's own: the watcher does not describe it again.
        assert!(feed.take_own("tool.sh", {
            let st = fstatat(
                std::fs::File::open(dir.path()).unwrap(),
                "tool.sh",
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .unwrap();
            Some(Stamp::of(&st))
        }));
    }

    // A mount keeps the sequences an export handed out; the same export registered again
    // (a restart) must start above them, or its new changes would look stale.
    #[test]
    fn a_feed_starts_above_the_time_before_and_above_earlier_commits() {
        let before = first_seq();
        let feed = ChangeFeed::new(&empty());
        assert!(feed.seq() >= before);
        let far = feed.seq() + 1_000_000;
        feed.start_above(far);
        assert_eq!(feed.seq(), far + 1);
        feed.start_above(5);
        assert_eq!(feed.seq(), far + 1, "never lowered");
    }
}
