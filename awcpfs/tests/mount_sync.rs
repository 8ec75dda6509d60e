//! The mount's filesystem layer and write-back, without a kernel: real export on loopback,
//! real HTTP client, operations called directly on `AwcpFs`, then a sync round, then the
//! exported directory is checked.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::content::OpenMode;
use awcpfs::mount::fs::{AwcpFs, FsOptions};
use awcpfs::mount::inode::{InodeTable, ROOT_INO};
use awcpfs::mount::journal::{self, Journal};
use awcpfs::mount::remote::{HttpRemote, Remote};
use awcpfs::mount::stats::Stats;
use awcpfs::mount::sync::{SyncSignal, Syncer};
use awcpfs::mount::{EndReason, FsError};

struct Fixture {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    state: PathBuf,
    fs: Arc<AwcpFs>,
    syncer: Syncer,
    manifest: awcp_protocol::dataplane::Manifest,
    _rt: tokio::runtime::Runtime,
}

fn fixture(read_only: bool, build: impl FnOnce(&Path)) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let state = tmp.path().join("state");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(state.join("upper")).unwrap();
    build(&root);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let registry = ExportRegistry::new();
    let lease = Arc::new(Lease::grant(
        Arc::new(SystemClock::new()),
        LeaseTerms {
            ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(600),
            flush_grace: Duration::from_secs(5),
        },
    ));
    registry
        .register(
            "e1".into(),
            "tok".into(),
            ExportConfig {
                root: root.clone(),
                read_only,
                block_size: 4096,
                staging_dir: tmp.path().join("staging"),
            },
            lease,
        )
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let router = registry.router();
    rt.spawn(async move { axum::serve(listener, router).await });
    let remote = Arc::new(HttpRemote::new(
        &format!("http://{addr}"),
        "e1",
        "tok",
        Duration::from_secs(10),
    ));
    let (manifest, _) = remote.manifest().unwrap();
    let table = InodeTable::from_manifest(&manifest, 0, 0).unwrap();
    let fs = Arc::new(AwcpFs::new(
        table,
        remote,
        Journal::open(&state.join("journal.log")).unwrap(),
        FsOptions {
            read_only,
            uid: 0,
            gid: 0,
            upper_dir: state.join("upper"),
            block_size: manifest.block_size,
        },
        Arc::new(SyncSignal::default()),
        Arc::new(Stats::default()),
    ));
    let syncer = Syncer::new(fs.clone(), &manifest);
    Fixture {
        _tmp: tmp,
        root,
        state,
        fs,
        syncer,
        manifest,
        _rt: rt,
    }
}

fn o(s: &str) -> &OsStr {
    OsStr::new(s)
}

impl Fixture {
    fn ino(&self, path: &str) -> u64 {
        let mut ino = ROOT_INO;
        for part in path.split('/') {
            ino = self.fs.lookup(ino, o(part)).unwrap().ino.0;
        }
        ino
    }

    fn write_new(&self, parent: &str, name: &str, data: &[u8]) {
        let p = if parent.is_empty() {
            ROOT_INO
        } else {
            self.ino(parent)
        };
        let (_, fh) = self
            .fs
            .create(p, o(name), 0o644, libc::O_WRONLY | libc::O_CREAT)
            .unwrap();
        self.fs.write(fh, 0, data).unwrap();
        self.fs.flush(fh).unwrap();
        self.fs.release(fh).unwrap();
    }

    fn read(&self, path: &str) -> Vec<u8> {
        let fh = self
            .fs
            .open(
                self.ino(path),
                OpenMode {
                    read: true,
                    ..Default::default()
                },
            )
            .unwrap();
        let data = self.fs.read(fh, 0, 1 << 20).unwrap();
        self.fs.release(fh).unwrap();
        data
    }

    fn sync(&self) -> awcpfs::mount::sync::RoundReport {
        self.syncer.round(false).unwrap()
    }
}

fn tree(root: &Path) {
    std::fs::create_dir_all(root.join("src/deep")).unwrap();
    std::fs::write(root.join("src/a.txt"), "alpha\n").unwrap();
    std::fs::write(root.join("src/deep/b.txt"), "beta\n").unwrap();
    std::fs::write(root.join("ref"), "old-ref\n").unwrap();
    std::fs::write(root.join("big"), vec![7u8; 10_000]).unwrap();
    std::os::unix::fs::symlink("src/a.txt", root.join("link")).unwrap();
}

#[test]
fn content_is_fetched_on_first_open_and_verified() {
    let f = fixture(false, tree);
    assert_eq!(f.read("src/a.txt"), b"alpha\n");
    assert_eq!(f.read("big"), vec![7u8; 10_000]);
    assert_eq!(f.fs.readlink(f.ino("link")).unwrap(), "src/a.txt");
    assert_eq!(f.sync().changes, 0, "reading must not write anything back");
}

// Regression: git writes refs/heads/main.lock, which got synced as a new file, then renamed
// it over refs/heads/main; the clean, already-synced content at the new path was skipped
// and the Delegator's branch never moved.
#[test]
fn renaming_a_synced_file_over_another_writes_the_target() {
    let f = fixture(false, tree);
    f.write_new("", "ref.lock", b"new-ref\n");
    assert_eq!(f.sync().files_written, 1);
    assert_eq!(
        std::fs::read(f.root.join("ref.lock")).unwrap(),
        b"new-ref\n"
    );
    f.fs.rename(ROOT_INO, o("ref.lock"), ROOT_INO, o("ref"), false, false)
        .unwrap();
    f.sync();
    assert_eq!(std::fs::read(f.root.join("ref")).unwrap(), b"new-ref\n");
    assert!(!f.root.join("ref.lock").exists());
}

#[test]
fn renaming_unfetched_files_and_directories_moves_them_without_reading() {
    let f = fixture(false, tree);
    f.fs.rename(ROOT_INO, o("big"), ROOT_INO, o("big2"), false, false)
        .unwrap();
    f.fs.rename(ROOT_INO, o("src"), ROOT_INO, o("lib"), false, false)
        .unwrap();
    f.sync();
    assert_eq!(
        std::fs::read(f.root.join("big2")).unwrap(),
        vec![7u8; 10_000]
    );
    assert!(!f.root.join("big").exists());
    assert_eq!(
        std::fs::read(f.root.join("lib/deep/b.txt")).unwrap(),
        b"beta\n"
    );
    assert!(!f.root.join("src").exists());
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, 0, "nothing was read");
}

#[test]
fn a_file_open_for_writing_waits_for_close_unless_flushing() {
    let f = fixture(false, tree);
    let (_, fh) =
        f.fs.create(ROOT_INO, o("open.txt"), 0o600, libc::O_WRONLY)
            .unwrap();
    f.fs.write(fh, 0, b"partial").unwrap();
    let r = f.sync();
    assert_eq!(r.pending_open, 1);
    assert!(!f.root.join("open.txt").exists());
    let r = f.syncer.round(true).unwrap();
    assert_eq!(r.files_written, 1);
    assert_eq!(std::fs::read(f.root.join("open.txt")).unwrap(), b"partial");
    let mode = std::fs::metadata(f.root.join("open.txt"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    f.fs.release(fh).unwrap();
}

#[test]
fn kind_changes_deletes_and_chmods_are_written_back() {
    let f = fixture(false, tree);
    // file -> directory at the same path
    f.fs.unlink(f.ino("src"), o("a.txt")).unwrap();
    f.fs.mkdir(f.ino("src"), o("a.txt"), 0o755).unwrap();
    f.write_new("src/a.txt", "inner", b"in\n");
    // delete a whole subtree
    f.fs.unlink(f.ino("src/deep"), o("b.txt")).unwrap();
    f.fs.rmdir(f.ino("src"), o("deep")).unwrap();
    // chmod only
    f.fs.setattr(
        f.ino("ref"),
        awcpfs::mount::content::SetAttr {
            mode: Some(0o755),
            ..Default::default()
        },
    )
    .unwrap();
    // symlink retarget
    f.fs.unlink(ROOT_INO, o("link")).unwrap();
    f.fs.symlink(ROOT_INO, o("link"), o("ref")).unwrap();
    f.sync();
    assert_eq!(
        std::fs::read(f.root.join("src/a.txt/inner")).unwrap(),
        b"in\n"
    );
    assert!(!f.root.join("src/deep").exists());
    let mode = std::fs::metadata(f.root.join("ref"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);
    assert_eq!(
        std::fs::read_link(f.root.join("link")).unwrap(),
        Path::new("ref")
    );
    assert_eq!(f.sync().changes, 0, "a second round has nothing left to do");
}

#[test]
fn a_delegator_side_edit_is_never_overwritten() {
    let f = fixture(false, tree);
    let ino = f.ino("src/a.txt");
    std::fs::write(f.root.join("src/a.txt"), "delegator\n").unwrap();
    let fh = f.fs.open(
        ino,
        OpenMode {
            read: true,
            write: true,
            truncate: true,
            ..Default::default()
        },
    );
    // The manifest still says "alpha"; O_TRUNC needs no fetch, so this succeeds.
    let fh = fh.unwrap();
    f.fs.write(fh, 0, b"executor\n").unwrap();
    f.fs.release(fh).unwrap();
    let r = f.sync();
    assert_eq!(r.conflicts.len(), 1, "{r:?}");
    assert_eq!(
        std::fs::read(f.root.join("src/a.txt")).unwrap(),
        b"delegator\n"
    );
    let kept = r.conflicts[0].kept_as.clone().unwrap();
    assert_eq!(std::fs::read(f.root.join(&kept)).unwrap(), b"executor\n");
    assert_eq!(f.fs.stats().snapshot().conflicts.len(), 1);
}

#[test]
fn read_only_and_fenced_mounts_refuse_with_the_right_errors() {
    let f = fixture(true, tree);
    let e = f.fs.mkdir(ROOT_INO, o("x"), 0o755).unwrap_err();
    assert!(matches!(e, FsError::ReadOnly), "{e:?}");
    assert_eq!(e.errno(), fuser::Errno::EROFS);
    assert_eq!(f.read("src/a.txt"), b"alpha\n");
    assert!(f.fs.fence(EndReason::Revoked));
    let e = f.fs.lookup(ROOT_INO, o("src")).unwrap_err();
    assert_eq!(e.errno(), fuser::Errno::EACCES);
    assert!(!f.fs.fence(EndReason::Expired), "fencing twice is a no-op");
}

#[test]
fn the_journal_replays_to_the_same_tree() {
    let f = fixture(false, tree);
    f.write_new("", "new.txt", b"n\n");
    f.fs.mkdir(ROOT_INO, o("d"), 0o700).unwrap();
    f.fs.rename(
        ROOT_INO,
        o("new.txt"),
        f.ino("d"),
        o("moved.txt"),
        false,
        false,
    )
    .unwrap();
    f.fs.unlink(f.ino("src/deep"), o("b.txt")).unwrap();
    f.fs.symlink(ROOT_INO, o("l2"), o("d/moved.txt")).unwrap();
    let records = Journal::read_all(&f.state.join("journal.log")).unwrap();
    assert!(!records.is_empty());
    let mut replayed = InodeTable::from_manifest(&f.manifest, 0, 0).unwrap();
    journal::replay(&mut replayed, &records, 0, 0);
    let listing = |t: &InodeTable| {
        let mut v = Vec::new();
        t.walk(|p, n| v.push((p.to_string(), n.kind, n.perm, n.size, n.ino)));
        v
    };
    let live = {
        let mut v = Vec::new();
        // Walk the live tree through lookups of every path the replay found.
        for (p, kind, perm, size, ino) in listing(&replayed) {
            let attr = f.fs.getattr(f.ino(&p)).unwrap();
            v.push((p, kind, attr.perm, attr.size, attr.ino.0));
            let _ = (perm, size, ino);
        }
        v
    };
    let rep: Vec<_> = listing(&replayed)
        .into_iter()
        .map(|(p, k, perm, size, ino)| {
            (
                p,
                k,
                perm,
                if k == awcpfs::mount::inode::Kind::Dir {
                    4096
                } else {
                    size
                },
                ino,
            )
        })
        .collect();
    assert_eq!(rep, live);
    assert!(rep.iter().any(|(p, ..)| p == "d/moved.txt"));
    assert!(!rep.iter().any(|(p, ..)| p == "src/deep/b.txt"));
    // Replaying twice changes nothing: records are states, not operations.
    journal::replay(&mut replayed, &records, 0, 0);
    assert_eq!(listing(&replayed).len(), rep.len());
}

#[test]
fn reserved_names_are_refused_on_the_mount() {
    let f = fixture(false, tree);
    // The export never accepts them; letting one in would block every later commit.
    let e =
        f.fs.create(ROOT_INO, o(".awcp-tmp-x"), 0o644, libc::O_WRONLY)
            .unwrap_err();
    assert_eq!(e.errno(), fuser::Errno::EINVAL);
    let e = f.fs.mkdir(ROOT_INO, o(".awcp-tmp-d"), 0o755).unwrap_err();
    assert_eq!(e.errno(), fuser::Errno::EINVAL);
    f.write_new("", "ok.txt", b"fine");
    assert_eq!(f.sync().files_written, 1);
}

#[test]
fn a_state_directory_with_an_unfinished_journal_is_not_reused() {
    let f = fixture(false, tree);
    f.write_new("", "pending.txt", b"not yet written back");
    // A second mount on the same state directory would overwrite this mount's upper files.
    let remote: Arc<dyn Remote> = Arc::new(HttpRemote::new(
        "http://127.0.0.1:1",
        "e1",
        "tok",
        Duration::from_secs(1),
    ));
    let cfg = awcpfs::mount::MountConfig::new(
        "http://127.0.0.1:1",
        "e1",
        "tok",
        &f.state.join("mnt"),
        &f.state,
    );
    match awcpfs::mount::Mount::start_with_remote(cfg, remote) {
        Err(awcpfs::mount::MountError::StateDirInUse { path }) => assert_eq!(path, f.state),
        other => panic!("expected StateDirInUse, got {other:?}"),
    }
}

#[test]
fn background_hydration_fetches_small_files_in_one_request() {
    let f = fixture(false, tree);
    let small = f.fs.remote_small_files(64 << 10);
    // src/a.txt, src/deep/b.txt, ref, big (10 kB): all small; the symlink is not a file.
    assert_eq!(small.len(), 4, "{small:?}");
    let inos: Vec<u64> = small.iter().map(|(i, _)| *i).collect();
    assert_eq!(f.fs.prefetch(&inos).unwrap(), 4);
    let fetched = f.fs.stats().snapshot();
    assert_eq!(fetched.bytes_fetched, 6 + 5 + 8 + 10_000);
    // Everything is local now: reading fetches nothing more.
    assert_eq!(f.read("src/deep/b.txt"), b"beta\n");
    assert_eq!(f.read("big"), vec![7u8; 10_000]);
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, fetched.bytes_fetched);
    assert!(f.fs.remote_small_files(64 << 10).is_empty());
    assert_eq!(f.fs.prefetch(&inos).unwrap(), 0, "nothing left to fetch");
    assert_eq!(f.sync().changes, 0, "hydration is not a change");
}

/// Hard links (made on the mount and found on the Delegator), renames of one of their
/// names, an exchange and extended attributes: the journal replays to the same names, link
/// counts and attributes, and the write-back makes hard links on the Delegator.
#[test]
fn hard_links_and_xattrs_replay_and_write_back_as_links() {
    use std::os::unix::fs::MetadataExt;
    let f = fixture(false, |root| {
        tree(root);
        std::fs::hard_link(root.join("src/a.txt"), root.join("a-link")).unwrap();
    });
    // The Delegator's hard link is one inode on the mount.
    assert_eq!(f.ino("a-link"), f.ino("src/a.txt"));
    assert_eq!(f.fs.getattr(f.ino("a-link")).unwrap().nlink, 2);
    // New links to a new file and to a file not fetched yet.
    f.write_new("", "n1", b"shared\n");
    let n1 = f.ino("n1");
    f.fs.link(n1, ROOT_INO, o("n2")).unwrap();
    f.fs.link(n1, f.ino("src"), o("n3")).unwrap();
    f.fs.link(f.ino("big"), ROOT_INO, o("big2")).unwrap();
    assert!(matches!(
        f.fs.link(f.ino("src"), ROOT_INO, o("dirlink")),
        Err(FsError::NoHardLinks)
    ));
    assert!(matches!(
        f.fs.link(n1, ROOT_INO, o("ref")),
        Err(FsError::Exists)
    ));
    assert_eq!(f.fs.getattr(n1).unwrap().nlink, 3);
    // Remove the first name, rename another, exchange one with a plain file.
    f.fs.unlink(ROOT_INO, o("n1")).unwrap();
    f.fs.rename(ROOT_INO, o("n2"), f.ino("src/deep"), o("n2"), false, false)
        .unwrap();
    f.fs.rename(f.ino("src"), o("n3"), ROOT_INO, o("ref"), false, true)
        .unwrap();
    assert_eq!(f.fs.getattr(n1).unwrap().nlink, 2);
    assert_eq!(f.read("ref"), b"shared\n");
    assert_eq!(f.read("src/n3"), b"old-ref\n");
    f.fs.setxattr(n1, o("user.k"), b"v\0bytes", 0).unwrap();
    f.fs.setxattr(n1, o("user.gone"), b"x", 0).unwrap();
    f.fs.removexattr(n1, o("user.gone")).unwrap();
    assert!(matches!(
        f.fs.setxattr(n1, o("trusted.k"), b"v", 0),
        Err(FsError::Unsupported { .. })
    ));

    // Replay gives the same names, inodes, link counts and attributes.
    let records = Journal::read_all(&f.state.join("journal.log")).unwrap();
    let mut replayed = InodeTable::from_manifest(&f.manifest, 0, 0).unwrap();
    journal::replay(&mut replayed, &records, 0, 0);
    let mut rep = Vec::new();
    replayed.walk(|p, n| rep.push((p.to_string(), n.ino, n.nlink(), n.xattrs.clone())));
    let live: Vec<_> = rep
        .iter()
        .map(|(p, ..)| {
            let ino = f.ino(p);
            let mut xattrs = std::collections::BTreeMap::new();
            if let Ok(awcpfs::mount::posix::XattrReply::Data(v)) =
                f.fs.getxattr(ino, o("user.k"), 1024)
            {
                xattrs.insert("user.k".to_string(), v);
            }
            (p.clone(), ino, f.fs.getattr(ino).unwrap().nlink, xattrs)
        })
        .collect();
    assert_eq!(rep, live);
    assert!(rep.iter().any(|(p, ..)| p == "src/deep/n2"));

    // Write-back: names of one inode are hard links on the Delegator, with the attributes.
    f.fs.setxattr(f.ino("src"), o("user.dir"), b"d", 0).unwrap();
    f.sync();
    let xattr = |p: &str, n: &str| {
        let file = std::fs::File::open(f.root.join(p)).unwrap();
        let mut buf = vec![0u8; 256];
        rustix::fs::fgetxattr(&file, n, &mut buf[..])
            .ok()
            .map(|len| buf[..len].to_vec())
    };
    assert_eq!(xattr("ref", "user.k").as_deref(), Some(&b"v\0bytes"[..]));
    assert_eq!(xattr("src", "user.dir").as_deref(), Some(&b"d"[..]));
    // An attribute change alone: set one, remove another, content untouched.
    let ino_before = std::fs::metadata(f.root.join("ref")).unwrap().ino();
    f.fs.setxattr(n1, o("user.new"), b"1", 0).unwrap();
    f.fs.removexattr(n1, o("user.k")).unwrap();
    f.sync();
    assert_eq!(xattr("ref", "user.new").as_deref(), Some(&b"1"[..]));
    assert_eq!(xattr("ref", "user.k"), None);
    assert_eq!(
        std::fs::metadata(f.root.join("ref")).unwrap().ino(),
        ino_before
    );
    let meta = |p: &str| std::fs::metadata(f.root.join(p)).unwrap();
    assert_eq!(meta("ref").ino(), meta("src/deep/n2").ino());
    assert_eq!(meta("ref").nlink(), 2);
    assert_eq!(std::fs::read(f.root.join("ref")).unwrap(), b"shared\n");
    assert_eq!(std::fs::read(f.root.join("src/n3")).unwrap(), b"old-ref\n");
    assert_eq!(meta("big").ino(), meta("big2").ino());
    assert!(!f.root.join("n1").exists());
    // A write through one name re-links the other after the rewrite.
    let fh =
        f.fs.open(
            f.ino("ref"),
            OpenMode {
                write: true,
                ..Default::default()
            },
        )
        .unwrap();
    f.fs.write(fh, 0, b"SHARED").unwrap();
    f.fs.flush(fh).unwrap();
    f.fs.release(fh).unwrap();
    f.sync();
    assert_eq!(meta("ref").ino(), meta("src/deep/n2").ino());
    assert_eq!(
        std::fs::read(f.root.join("src/deep/n2")).unwrap(),
        b"SHARED\n"
    );
}

/// `touch -d` of a file whose content did not change reaches the Delegator as a new mtime
/// (to the nanosecond), with a chmod in the same change, and never rewrites the content.
#[test]
fn a_new_mtime_alone_is_written_back() {
    use std::os::unix::fs::MetadataExt;
    let f = fixture(false, tree);
    let before_ino = std::fs::metadata(f.root.join("big")).unwrap().ino();
    let t = std::time::UNIX_EPOCH + Duration::new(1_300_000_000, 123_456_789);
    f.fs.setattr(
        f.ino("big"),
        awcpfs::mount::content::SetAttr {
            mtime: Some(t),
            mode: Some(0o600),
            ..Default::default()
        },
    )
    .unwrap();
    let report = f.sync();
    assert_eq!((report.changes, report.files_written), (1, 0), "{report:?}");
    let m = std::fs::metadata(f.root.join("big")).unwrap();
    assert_eq!((m.mtime(), m.mtime_nsec()), (1_300_000_000, 123_456_789));
    assert_eq!(m.mode() & 0o7777, 0o600);
    assert_eq!(m.ino(), before_ino, "the content must not be rewritten");
    assert_eq!(f.sync().changes, 0, "nothing left to send");
    // The Delegator changed a file meanwhile: an older time from the mount must not land on
    // its new content.
    std::fs::write(f.root.join("src/a.txt"), "changed on the Delegator\n").unwrap();
    let delegator_mtime = std::fs::metadata(f.root.join("src/a.txt")).unwrap().mtime();
    f.fs.setattr(
        f.ino("src/a.txt"),
        awcpfs::mount::content::SetAttr {
            mtime: Some(std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000)),
            ..Default::default()
        },
    )
    .unwrap();
    let report = f.sync();
    assert_eq!(report.conflicts.len(), 1, "{report:?}");
    assert_eq!(
        std::fs::metadata(f.root.join("src/a.txt")).unwrap().mtime(),
        delegator_mtime
    );
}

/// `b` as an `OsStr` (names that are not UTF-8).
fn ob(b: &[u8]) -> &OsStr {
    use std::os::unix::ffi::OsStrExt;
    OsStr::from_bytes(b)
}

fn raw_names_tree(root: &Path) {
    std::fs::create_dir(root.join(ob(b"d\xff"))).unwrap();
    std::fs::write(root.join(ob(b"d\xff/caf\xe9")), "latin1\n").unwrap();
    std::fs::write(root.join(ob(b"edit\xe9")), "old\n").unwrap();
    std::fs::write(root.join("tagged"), "t\n").unwrap();
    for (n, v) in [
        ("user.keep", &b"k"[..]),
        ("user.change", b"1"),
        ("user.drop", b"x"),
    ] {
        rustix::fs::setxattr(root.join("tagged"), n, v, rustix::fs::XattrFlags::empty()).unwrap();
    }
}

#[test]
fn non_utf8_names_and_delegator_xattrs_through_the_filesystem_layer() {
    use std::os::unix::ffi::OsStrExt;
    let f = fixture(false, raw_names_tree);
    let d = f.fs.lookup(ROOT_INO, ob(b"d\xff")).unwrap().ino.0;
    let cafe = f.fs.lookup(d, ob(b"caf\xe9")).unwrap().ino.0;
    assert!(
        matches!(f.fs.lookup(d, ob(b"caf\xc3\xa9")), Err(FsError::NotFound)),
        "the UTF-8 é is another name"
    );
    // readdir gives the bytes back (what the FUSE layer hands the kernel).
    let fh = f.fs.opendir(d).unwrap();
    let names: Vec<Vec<u8>> =
        f.fs.readdir(fh)
            .unwrap()
            .iter()
            .map(|e| awcp_protocol::rawname::to_bytes(&e.name).into_owned())
            .collect();
    f.fs.releasedir(fh);
    assert_eq!(names, [&b"."[..], b"..", b"caf\xe9"]);
    let fh =
        f.fs.open(
            cafe,
            OpenMode {
                read: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(f.fs.read(fh, 0, 100).unwrap(), b"latin1\n");
    f.fs.release(fh).unwrap();
    // The Delegator's attributes are there.
    let tagged = f.ino("tagged");
    let get = |n: &str| match f.fs.getxattr(tagged, o(n), 100) {
        Ok(awcpfs::mount::posix::XattrReply::Data(v)) => Some(v),
        _ => None,
    };
    assert_eq!(get("user.change").as_deref(), Some(&b"1"[..]));

    // Create, rename, symlink with raw names; change attributes.
    let (_, fh) =
        f.fs.create(d, ob(b"n\xfe"), 0o644, libc::O_WRONLY | libc::O_CREAT)
            .unwrap();
    f.fs.write(fh, 0, b"\x00new\xff").unwrap();
    f.fs.release(fh).unwrap();
    f.fs.rename(d, ob(b"caf\xe9"), ROOT_INO, ob(b"moved\xe8"), false, false)
        .unwrap();
    f.fs.symlink(ROOT_INO, ob(b"l\xfa"), ob(b"moved\xe8"))
        .unwrap();
    let l = f.fs.lookup(ROOT_INO, ob(b"l\xfa")).unwrap();
    assert_eq!(
        l.size, 6,
        "a symlink's size is its target's length in bytes"
    );
    assert_eq!(
        awcp_protocol::rawname::to_bytes(&f.fs.readlink(l.ino.0).unwrap()).as_ref(),
        b"moved\xe8"
    );
    f.fs.setxattr(tagged, o("user.change"), b"2", 0).unwrap();
    f.fs.removexattr(tagged, o("user.drop")).unwrap();
    // The Delegator edits a raw-named file the mount then rewrites: a conflict.
    std::fs::write(f.root.join(ob(b"edit\xe9")), "delegator\n").unwrap();
    let edit = f.fs.lookup(ROOT_INO, ob(b"edit\xe9")).unwrap().ino.0;
    let fh =
        f.fs.open(
            edit,
            OpenMode {
                read: true,
                write: true,
                truncate: true,
                ..Default::default()
            },
        )
        .unwrap();
    f.fs.write(fh, 0, b"executor\n").unwrap();
    f.fs.release(fh).unwrap();

    // The journal replays to the same names.
    let records = Journal::read_all(&f.state.join("journal.log")).unwrap();
    let mut replayed = InodeTable::from_manifest(&f.manifest, 0, 0).unwrap();
    journal::replay(&mut replayed, &records, 0, 0);
    let mut paths = Vec::new();
    replayed.walk(|p, _| paths.push(awcp_protocol::rawname::to_bytes(p).into_owned()));
    for want in [&b"d\xff/n\xfe"[..], b"moved\xe8", b"l\xfa"] {
        assert!(
            paths.iter().any(|p| p == want),
            "{want:?} not replayed: {paths:?}"
        );
    }
    assert!(!paths.iter().any(|p| p == b"d\xff/caf\xe9"));

    let r = f.sync();
    assert_eq!(r.conflicts.len(), 1, "{r:?}");
    let root = &f.root;
    assert_eq!(
        std::fs::read(root.join(ob(b"d\xff/n\xfe"))).unwrap(),
        b"\x00new\xff"
    );
    assert_eq!(
        std::fs::read(root.join(ob(b"moved\xe8"))).unwrap(),
        b"latin1\n"
    );
    assert!(!root.join(ob(b"d\xff/caf\xe9")).exists());
    assert_eq!(
        std::fs::read_link(root.join(ob(b"l\xfa")))
            .unwrap()
            .as_os_str()
            .as_bytes(),
        b"moved\xe8"
    );
    assert_eq!(
        std::fs::read(root.join(ob(b"edit\xe9"))).unwrap(),
        b"delegator\n"
    );
    let kept =
        awcp_protocol::rawname::to_bytes(r.conflicts[0].kept_as.as_deref().unwrap()).into_owned();
    assert!(kept.starts_with(b"edit\xe9.awcp-conflict-"), "{kept:?}");
    assert_eq!(std::fs::read(root.join(ob(&kept))).unwrap(), b"executor\n");
    let at = |n: &str| {
        let mut buf = [0u8; 16];
        rustix::fs::getxattr(root.join("tagged"), n, &mut buf[..])
            .ok()
            .map(|len| buf[..len].to_vec())
    };
    assert_eq!(at("user.change").as_deref(), Some(&b"2"[..]));
    assert_eq!(at("user.drop"), None);
    assert_eq!(at("user.keep").as_deref(), Some(&b"k"[..]), "untouched");
}
