//! An earlier walk taken again instead of walking the tree anew.
//!
//! Registering an export walks the whole tree: every directory listed, every entry
//! described, every file's hashes looked up, the block index built. When the same root is
//! registered again with the same filter settings (a key the caller gives, see
//! [`super::ExportRegistry::register_reusing`]) and nothing in the tree changed since an
//! earlier walk that the caller kept ([`super::ExportRegistry::keep_walk`]), that walk's
//! entries and block index stand: one `fstatat` per entry checks them. The registration
//! then shares what the walk holds rather than copying it (its entries; their encoding,
//! compressed, see `super::served`; its block index and the change feed's map, both copied
//! on their first change): at 100,000 files the check is all that is left of it.
//!
//! "Nothing changed" is decided from what the manifest itself records of each entry: its
//! inode number, modification and status-change times, mode, and (files and symlinks) size.
//! A name added to, removed from or renamed within a directory changes that directory's
//! times; a write, truncate, `chmod`, `chown`, extended-attribute change or new hard link
//! changes the entry's status-change time, which no one can set back. Hidden entries are
//! not in the manifest, but one appearing changes its directory's times too.
//!
//! A walk is kept only when nothing in it could still change without its times changing,
//! and when it is the whole picture:
//! * every entry's (and the root's) status change lies at least [`RACY_WINDOW`] before
//!   the walk began (a change within the same timestamp tick could otherwise go unseen);
//! * every file's hashes were trusted (read while the file did not change);
//! * the walk skipped nothing (an entry that could not be read, a special file, a
//!   directory too deep is not in the manifest to be checked).
//!
//! The check fails at the first difference, and the tree is then walked as always.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use awcp_protocol::dataplane::{EntryKind, ManifestEntry};
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, fstat, fstatat};

use super::hashcache::RACY_WINDOW;
use super::rootfs::{NodeKind, RootDir, ctime_ns, mtime_ns, os};
use super::served::EncodedBody;
use super::store::BlockIndex;
use super::watch::Known;

/// Most walks kept at once (one per root and key; the oldest goes first).
const MAX_KEPT: usize = 4;
/// Most entries over all kept walks (about 450 bytes each in memory, their encoding included).
const MAX_KEPT_ENTRIES: usize = 2_000_000;
/// Most threads checking a kept walk.
const CHECK_THREADS: usize = 4;

/// What decides a walk besides the tree: a registration may take a kept walk only if
/// these are equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WalkKey {
    pub(crate) root: PathBuf,
    pub(crate) block_size: u32,
    /// The caller's name for its filter's settings.
    pub(crate) filter: String,
}

/// The root directory's own stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RootStamp {
    ino: u64,
    mode: u32,
    mtime_ns: i64,
    ctime_ns: i64,
}

impl RootStamp {
    pub(crate) fn of(st: &FileStat) -> RootStamp {
        RootStamp {
            ino: st.st_ino,
            mode: st.st_mode & 0o7777,
            mtime_ns: mtime_ns(st),
            ctime_ns: ctime_ns(st),
        }
    }

    pub(crate) fn mode(&self) -> u32 {
        self.mode
    }

    pub(crate) fn mtime_ns(&self) -> i64 {
        self.mtime_ns
    }
}

/// A walk's result, kept for the next registration of the same root and key.
#[derive(Debug)]
pub(crate) struct KeptWalk {
    pub(crate) key: WalkKey,
    pub(crate) root: RootStamp,
    pub(crate) entries: Arc<Vec<ManifestEntry>>,
    pub(crate) index: BlockIndex,
    /// The entries, encoded as served (see `super::served`).
    pub(crate) body: Arc<EncodedBody>,
    /// The change feed's starting point for the entries (see `super::watch`).
    pub(crate) known: Arc<Known>,
}

/// What a fresh walk tells about whether it may be kept (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct WalkFacts {
    pub(crate) key: WalkKey,
    pub(crate) root: RootStamp,
    /// Whether it may be kept.
    pub(crate) keepable: bool,
}

impl WalkFacts {
    /// The facts of a walk that began at `started`, found `root` as the root and
    /// `entries` below it, and skipped or distrusted what it says.
    pub(crate) fn of(
        key: WalkKey,
        root: RootStamp,
        started: SystemTime,
        entries: &[ManifestEntry],
        skipped: usize,
        untrusted: usize,
    ) -> WalkFacts {
        let racy_after = started.checked_sub(RACY_WINDOW).unwrap_or(UNIX_EPOCH);
        let racy_after = ns_since_epoch(racy_after);
        let settled = root.ctime_ns < racy_after
            && entries
                .iter()
                .all(|e| e.ctime_ns.is_some_and(|c| c < racy_after) && e.ino.is_some());
        WalkFacts {
            key,
            root,
            keepable: skipped == 0 && untrusted == 0 && settled,
        }
    }
}

fn ns_since_epoch(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos()
        .try_into()
        .unwrap_or(i64::MAX)
}

/// The kept walks of a registry.
#[derive(Debug, Default)]
pub(crate) struct Kept {
    /// Oldest first.
    walks: Vec<Arc<KeptWalk>>,
}

impl Kept {
    /// The walk kept for `key`, if any.
    pub(crate) fn get(&self, key: &WalkKey) -> Option<Arc<KeptWalk>> {
        self.walks.iter().find(|w| w.key == *key).cloned()
    }

    /// Keep `walk`, in place of any earlier one of its key; the oldest go beyond the limits.
    pub(crate) fn put(&mut self, walk: Arc<KeptWalk>) {
        self.walks.retain(|w| w.key != walk.key);
        self.walks.push(walk);
        while self.walks.len() > MAX_KEPT
            || (self.walks.len() > 1
                && self.walks.iter().map(|w| w.entries.len()).sum::<usize>() > MAX_KEPT_ENTRIES)
        {
            self.walks.remove(0);
        }
    }

    /// Forget the walk kept for `key` (it no longer holds).
    pub(crate) fn forget(&mut self, key: &WalkKey) {
        self.walks.retain(|w| w.key != *key);
    }
}

/// Whether the tree below `root` is still what `kept` found: the root's stamp and every
/// entry's (see the module docs). Stops at the first difference.
pub(crate) fn still_holds(root: &RootDir, kept: &KeptWalk) -> bool {
    match fstat(root.fd()) {
        Ok(st) if RootStamp::of(&st) == kept.root => {}
        _ => return false,
    }
    let entries = &kept.entries;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, CHECK_THREADS);
    // Below ~10,000 entries a thread costs more than it saves.
    let threads = threads.min(entries.len() / 10_000 + 1);
    let chunk = entries.len().div_ceil(threads).max(1);
    let changed = AtomicBool::new(false);
    std::thread::scope(|s| {
        for part in entries.chunks(chunk) {
            let changed = &changed;
            s.spawn(move || {
                let mut dirs = DirStack::new(root);
                for e in part {
                    if changed.load(Ordering::Relaxed) {
                        return;
                    }
                    if !dirs.entry_holds(e) {
                        tracing::debug!(path = %e.path, "the tree changed since the kept walk");
                        changed.store(true, Ordering::Relaxed);
                        return;
                    }
                }
            });
        }
    });
    !changed.into_inner()
}

/// The directories open on the way to the entry being checked, from the root down.
struct DirStack<'r> {
    root: &'r RootDir,
    /// Each directory's path (relative to the root) and descriptor.
    open: Vec<(String, OwnedFd)>,
}

impl<'r> DirStack<'r> {
    fn new(root: &'r RootDir) -> Self {
        DirStack {
            root,
            open: Vec::new(),
        }
    }

    /// Whether `e` is what the tree holds at its path now.
    fn entry_holds(&mut self, e: &ManifestEntry) -> bool {
        let (parent, name) = e.path.rsplit_once('/').unwrap_or(("", e.path.as_str()));
        let Ok(dir) = self.dir(parent) else {
            return false;
        };
        let name: &OsStr = &os(name);
        match fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => same(e, &st),
            Err(_) => false,
        }
    }

    /// The directory at `path` (`""`: the root), opened component by component without
    /// following symlinks, from the deepest directory already open on its way.
    fn dir(&mut self, path: &str) -> io::Result<BorrowedFd<'_>> {
        while let Some((open, _)) = self.open.last() {
            if is_same_or_below(path, open) {
                break;
            }
            self.open.pop();
        }
        let done = self.open.last().map_or(0, |(p, _)| p.len());
        let rest = path[done..].trim_start_matches('/');
        if !rest.is_empty() {
            for comp in rest.split('/') {
                let parent = self
                    .open
                    .last()
                    .map_or(self.root.fd(), |(_, fd)| fd.as_fd());
                let name: &OsStr = &os(comp);
                let fd = openat(parent, name, dir_flags(), Mode::empty())?;
                let p = match self.open.last() {
                    Some((p, _)) => format!("{p}/{comp}"),
                    None => comp.to_owned(),
                };
                self.open.push((p, fd));
            }
        }
        Ok(self
            .open
            .last()
            .map_or(self.root.fd(), |(_, fd)| fd.as_fd()))
    }
}

/// Whether `path` is `dir` or lies below it.
fn is_same_or_below(path: &str, dir: &str) -> bool {
    path.strip_prefix(dir)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// Whether `st` is what entry `e` recorded.
fn same(e: &ManifestEntry, st: &FileStat) -> bool {
    let kind = match NodeKind::of(st) {
        NodeKind::Dir => EntryKind::Dir,
        NodeKind::File => EntryKind::File,
        NodeKind::Symlink => EntryKind::Symlink,
        NodeKind::Special | NodeKind::Absent => return false,
    };
    kind == e.kind
        && e.ino == Some(st.st_ino)
        && e.ctime_ns == Some(ctime_ns(st))
        && e.mtime_ns == mtime_ns(st)
        && e.mode == st.st_mode & 0o7777
        && (kind == EntryKind::Dir || e.size == st.st_size.max(0) as u64)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;
    use std::time::Duration;

    use awcp_lease::{Lease, LeaseTerms, ManualClock};

    use super::*;
    use crate::export::manifest::{self, ManifestParams};
    use crate::export::{ExportConfig, ExportRegistry};

    fn tree(root: &Path) {
        std::fs::create_dir_all(root.join("src/deep")).unwrap();
        std::fs::write(root.join("README"), "read me").unwrap();
        std::fs::write(root.join("src/a.rs"), "fn a() {}").unwrap();
        std::fs::write(root.join("src/deep/b.rs"), vec![7u8; 10_000]).unwrap();
        std::os::unix::fs::symlink("a.rs", root.join("src/link")).unwrap();
    }

    /// Long enough after the trees were made for their walks to be kept.
    fn settle() {
        std::thread::sleep(RACY_WINDOW + Duration::from_millis(200));
    }

    fn walk(root: &Path) -> (RootDir, KeptWalk, WalkFacts) {
        let dir = RootDir::open(root).unwrap();
        let started = SystemTime::now();
        let root_stamp = RootStamp::of(&fstat(dir.fd()).unwrap());
        let params = ManifestParams {
            export_id: "t".into(),
            block_size: 4096,
            read_only: false,
            filter: None,
            progress: None,
        };
        let built = manifest::build(&dir, &params, None).unwrap();
        let key = WalkKey {
            root: root.to_owned(),
            block_size: 4096,
            filter: "k".into(),
        };
        let facts = WalkFacts::of(
            key.clone(),
            root_stamp,
            started,
            &built.manifest.entries,
            built.skipped,
            built.untrusted,
        );
        let kept = KeptWalk {
            key,
            root: root_stamp,
            body: Arc::new(EncodedBody::of(&built.manifest.entries).unwrap()),
            known: crate::export::watch::known_of(&built.manifest.entries),
            entries: Arc::new(built.manifest.entries),
            index: built.index,
        };
        (dir, kept, facts)
    }

    // Every kind of change a tree can undergo must make a kept walk stale; an untouched
    // tree must not (or the kept walk would never be taken).
    #[test]
    fn every_kind_of_change_makes_a_kept_walk_stale() {
        type Change = fn(&Path);
        let changes: &[(&str, Change)] = &[
            ("nothing", |_| {}),
            ("rewrite, same size", |r| {
                std::fs::write(r.join("src/a.rs"), "fn b() {}").unwrap()
            }),
            ("append", |r| {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(r.join("src/deep/b.rs"))
                    .unwrap();
                f.write_all(b"x").unwrap();
            }),
            ("chmod a file", |r| {
                std::fs::set_permissions(r.join("README"), std::fs::Permissions::from_mode(0o600))
                    .unwrap()
            }),
            ("chmod the root", |r| {
                std::fs::set_permissions(r, std::fs::Permissions::from_mode(0o700)).unwrap()
            }),
            ("new file deep down", |r| {
                std::fs::write(r.join("src/deep/new"), "").unwrap()
            }),
            ("remove a file", |r| {
                std::fs::remove_file(r.join("README")).unwrap()
            }),
            ("rename within a directory", |r| {
                std::fs::rename(r.join("src/a.rs"), r.join("src/c.rs")).unwrap()
            }),
            ("a hidden temporary name appears", |r| {
                std::fs::write(r.join("src/.awcp-tmp-x"), "").unwrap()
            }),
            ("replace a symlink", |r| {
                std::fs::remove_file(r.join("src/link")).unwrap();
                std::os::unix::fs::symlink("deep/b.rs", r.join("src/link")).unwrap();
            }),
            ("new hard link elsewhere", |r| {
                std::fs::hard_link(r.join("src/deep/b.rs"), r.join("b2")).unwrap()
            }),
            ("extended attribute", |r| {
                // Filesystems without user xattrs (tmpfs before 6.6) refuse it: then the
                // file's mode changes instead, so the case still checks something.
                if rustix::fs::setxattr(
                    r.join("src/a.rs").as_path(),
                    "user.test",
                    b"v",
                    rustix::fs::XattrFlags::empty(),
                )
                .is_err()
                {
                    std::fs::set_permissions(
                        r.join("src/a.rs"),
                        std::fs::Permissions::from_mode(0o640),
                    )
                    .unwrap();
                }
            }),
        ];
        let tmp = tempfile::tempdir().unwrap();
        for (i, _) in changes.iter().enumerate() {
            tree(&tmp.path().join(i.to_string()));
        }
        settle();
        for (i, (what, change)) in changes.iter().enumerate() {
            let root = tmp.path().join(i.to_string());
            let (dir, kept, facts) = walk(&root);
            assert!(facts.keepable, "{what}: a settled walk is keepable");
            assert!(still_holds(&dir, &kept), "{what}: before the change");
            change(&root);
            let dir = RootDir::open(&root).unwrap();
            assert_eq!(
                still_holds(&dir, &kept),
                *what == "nothing",
                "{what}: after the change"
            );
        }
    }

    // A walk that left something out, or that saw entries too fresh to trust their
    // times, is not the whole picture: it must not be kept.
    #[test]
    fn walks_that_skipped_or_saw_fresh_entries_are_not_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let fresh = tmp.path().join("fresh");
        tree(&fresh);
        let (_, _, facts) = walk(&fresh);
        assert!(!facts.keepable, "entries changed within the racy window");

        let special = tmp.path().join("special");
        tree(&special);
        nix::unistd::mkfifo(&special.join("fifo"), Mode::from_bits_truncate(0o644)).unwrap();
        settle();
        let (_, kept, facts) = walk(&special);
        assert!(!facts.keepable, "the FIFO was skipped");
        assert!(kept.entries.iter().all(|e| e.path != "fifo"));
        let (_, _, facts) = walk(&fresh);
        assert!(facts.keepable, "the same tree, settled");
    }

    fn lease() -> Arc<Lease> {
        Arc::new(Lease::grant(
            Arc::new(ManualClock::new()),
            LeaseTerms {
                ttl: Duration::from_secs(60),
                max_ttl: Duration::from_secs(60),
                flush_grace: Duration::ZERO,
            },
        ))
    }

    fn register(
        reg: &ExportRegistry,
        root: &Path,
        staging: &Path,
        key: &str,
    ) -> Arc<super::super::Export> {
        reg.remove("exp_r");
        reg.register_reusing(
            "exp_r".into(),
            "tok".into(),
            ExportConfig {
                root: root.to_owned(),
                read_only: false,
                block_size: 4096,
                staging_dir: staging.to_owned(),
            },
            lease(),
            None,
            None,
            key.into(),
        )
        .unwrap()
    }

    fn wait_kept(reg: &ExportRegistry, root: &Path, key: &str) {
        let key = WalkKey {
            root: root.to_owned(),
            block_size: 4096,
            filter: key.into(),
        };
        for _ in 0..500 {
            if reg.kept.lock().get(&key).is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the walk was not kept");
    }

    // The registry takes a kept walk only for the same root and key, only after the
    // caller kept it, and only while the tree is unchanged; what it serves then is what a
    // walk would have given, digest included.
    #[test]
    fn a_registry_takes_a_kept_walk_only_while_it_holds() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ws");
        tree(&root);
        settle();
        let reg = ExportRegistry::new().without_watch();
        let first = register(&reg, &root, staging.path(), "k");
        assert!(!first.took_kept_walk());
        let again = register(&reg, &root, staging.path(), "k");
        assert!(!again.took_kept_walk(), "nothing was kept yet");
        reg.keep_walk(&again);
        wait_kept(&reg, &root, "k");
        let other_key = register(&reg, &root, staging.path(), "other filter");
        assert!(!other_key.took_kept_walk(), "another key is another walk");
        let kept = register(&reg, &root, staging.path(), "k");
        assert!(kept.took_kept_walk());
        assert_eq!(kept.manifest(), first.manifest());
        assert_eq!(kept.manifest_digest(), first.manifest_digest());
        assert_eq!(
            kept.blocks.index.read().len(),
            first.blocks.index.read().len()
        );

        // A change: walked again, and the new content is in the manifest.
        std::fs::write(root.join("src/a.rs"), "fn z() {}").unwrap();
        let changed = register(&reg, &root, staging.path(), "k");
        assert!(!changed.took_kept_walk());
        assert_ne!(changed.manifest_digest(), first.manifest_digest());
        let a = |m: &awcp_protocol::dataplane::Manifest| {
            m.entries
                .iter()
                .find(|e| e.path == "src/a.rs")
                .and_then(|e| e.hash.clone())
        };
        assert_eq!(
            a(&changed.manifest()),
            Some(blake3::hash(b"fn z() {}").to_hex().to_string())
        );
        // The stale walk is forgotten: not taken even with the old content back.
        let next = register(&reg, &root, staging.path(), "k");
        assert!(!next.took_kept_walk());
    }

    /// What a mount gets from `export`: the served bytes decoded, digest checked.
    fn served(export: &super::super::Export) -> awcp_protocol::dataplane::Manifest {
        let (m, digest) = crate::mount::remote::decode_manifest(&export.manifest_zst).unwrap();
        assert_eq!(
            digest,
            export.manifest_digest(),
            "the served bytes match the digest"
        );
        assert_eq!(m, export.manifest());
        m
    }

    // A kept walk brings its entries encoded (only the header is encoded per registration):
    // the served manifest must still be the tree's, under the new registration's header,
    // and after any change the tree's new state, never the kept encoding.
    #[test]
    fn a_kept_encoding_is_never_served_for_a_changed_tree() {
        type Change = fn(&Path);
        let changes: &[(&str, Change)] = &[
            ("edit, same size", |r| {
                std::fs::write(r.join("src/a.rs"), "fn q() {}").unwrap()
            }),
            ("add a file", |r| {
                std::fs::write(r.join("src/deep/added.rs"), "new").unwrap()
            }),
            ("delete a file", |r| {
                std::fs::remove_file(r.join("src/deep/b.rs")).unwrap()
            }),
            ("chmod a file", |r| {
                std::fs::set_permissions(r.join("README"), std::fs::Permissions::from_mode(0o755))
                    .unwrap()
            }),
        ];
        let tmp = tempfile::tempdir().unwrap();
        let staging = tempfile::tempdir().unwrap();
        for (i, _) in changes.iter().enumerate() {
            tree(&tmp.path().join(i.to_string()));
        }
        settle();
        let reg = ExportRegistry::new().without_watch();
        for (i, (what, change)) in changes.iter().enumerate() {
            let root = tmp.path().join(i.to_string());
            let first = register(&reg, &root, staging.path(), "k");
            let first_view = served(&first);
            reg.keep_walk(&first);
            wait_kept(&reg, &root, "k");
            let kept = register(&reg, &root, staging.path(), "k");
            assert!(
                kept.took_kept_walk(),
                "{what}: the unchanged tree takes the kept walk"
            );
            assert_eq!(served(&kept).entries, first_view.entries, "{what}");

            change(&root);
            let after = register(&reg, &root, staging.path(), "k");
            assert!(
                !after.took_kept_walk(),
                "{what}: a changed tree is walked again"
            );
            let view = served(&after);
            assert_ne!(
                view.entries, first_view.entries,
                "{what}: the change is served"
            );
            assert_ne!(after.manifest_digest(), kept.manifest_digest(), "{what}");
            let (dir, fresh, _) = walk(&root);
            drop(dir);
            assert_eq!(
                view.entries, *fresh.entries,
                "{what}: what a fresh walk finds"
            );
        }
    }
}
