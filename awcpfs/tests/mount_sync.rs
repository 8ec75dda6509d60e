//! The mount's filesystem layer and write-back, without a kernel: real export on loopback,
//! real HTTP client, operations called directly on `AwcpFs`, then a sync round, then the
//! exported directory is checked.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::content::{OpenMode, SEQUENTIAL_AFTER, SetAttr};
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
    /// The mount's remote (as wrapped).
    remote: Arc<dyn Remote>,
    _rt: tokio::runtime::Runtime,
}

fn fixture(read_only: bool, build: impl FnOnce(&Path)) -> Fixture {
    fixture_with(read_only, build, |r| r)
}

/// A fixture whose remote is `wrap`ped (to hold fetches back, say).
fn fixture_with(
    read_only: bool,
    build: impl FnOnce(&Path),
    wrap: impl FnOnce(Arc<dyn Remote>) -> Arc<dyn Remote>,
) -> Fixture {
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
    // As the export's own server: no delayed ACK (Nagle) on small answers.
    let listener = axum::serve::ListenerExt::tap_io(listener, |s| {
        let _ = s.set_nodelay(true);
    });
    rt.spawn(async move { axum::serve(listener, router).await });
    let remote = Arc::new(HttpRemote::new(
        &format!("http://{addr}"),
        "e1",
        "tok",
        Duration::from_secs(10),
    ));
    let (manifest, _) = remote.manifest().unwrap();
    let remote = wrap(remote);
    let mount_remote = remote.clone();
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
        remote: mount_remote,
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

/// What fetching `tree`'s `big` in one batch transfers: its first two 4 KiB blocks are one
/// block (all 7s), sent once; then the last 1,808 bytes. (A fetch counts the bytes that
/// came over the wire, not the file's size.)
const BIG_FETCHED: u64 = 4096 + 1808;

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

/// A remote whose manifest lists `a/b` without `a`; nothing else answers.
struct OrphanManifest;

impl Remote for OrphanManifest {
    fn manifest(
        &self,
    ) -> Result<(awcp_protocol::dataplane::Manifest, String), awcpfs::mount::remote::RemoteError>
    {
        use awcp_protocol::dataplane::{DATA_PLANE_VERSION, EntryKind, Manifest, ManifestEntry};
        let orphan = ManifestEntry {
            path: "a/b".into(),
            kind: EntryKind::File,
            mode: 0o644,
            size: 0,
            mtime_ns: 0,
            hash: Some(blake3::hash(b"").to_hex().to_string()),
            blocks: Vec::new(),
            target: None,
            ino: None,
            ctime_ns: None,
            xattrs: Default::default(),
        };
        let m = Manifest {
            version: DATA_PLANE_VERSION,
            export_id: "e1".into(),
            block_size: 1 << 20,
            read_only: false,
            root_mode: 0o755,
            root_mtime_ns: 0,
            entries: vec![orphan],
        };
        Ok((m, "digest".into()))
    }
    fn fetch_blocks(
        &self,
        _: &[String],
    ) -> Result<Vec<Vec<u8>>, awcpfs::mount::remote::RemoteError> {
        Err(offline())
    }
    fn missing(&self, _: &[String]) -> Result<Vec<String>, awcpfs::mount::remote::RemoteError> {
        Err(offline())
    }
    fn upload(&self, _: &[([u8; 32], &[u8])]) -> Result<(), awcpfs::mount::remote::RemoteError> {
        Err(offline())
    }
    fn commit(
        &self,
        _: &awcp_protocol::dataplane::ChangeSet,
    ) -> Result<awcp_protocol::dataplane::CommitResult, awcpfs::mount::remote::RemoteError> {
        Err(offline())
    }
    fn renew(
        &self,
    ) -> Result<awcp_protocol::dataplane::ExportEvent, awcpfs::mount::remote::RemoteError> {
        Err(offline())
    }
    fn events(
        &self,
    ) -> Result<
        Box<dyn Iterator<Item = awcpfs::mount::remote::StreamItem> + Send>,
        awcpfs::mount::remote::RemoteError,
    > {
        Err(offline())
    }
}

fn offline() -> awcpfs::mount::remote::RemoteError {
    awcpfs::mount::remote::RemoteError::Protocol {
        what: "offline".into(),
    }
}

#[test]
fn a_manifest_the_mount_cannot_build_is_refused_and_leaves_no_state() {
    let state = tempfile::tempdir().unwrap();
    let cfg = awcpfs::mount::MountConfig::new(
        "http://127.0.0.1:1",
        "e1",
        "tok",
        &state.path().join("mnt"),
        state.path(),
    );
    match awcpfs::mount::Mount::start_with_remote(cfg, Arc::new(OrphanManifest)) {
        Err(awcpfs::mount::MountError::BadManifest { .. }) => {}
        other => panic!("expected BadManifest, got {other:?}"),
    }
    // A saved manifest is what recovery starts from: none may be left for this one.
    assert!(!state.path().join("manifest.bin").exists());
}

#[test]
fn a_batch_leaves_out_the_files_another_batch_is_fetching() {
    use std::sync::atomic::Ordering::SeqCst;
    let (f, gated) = gated_fixture(tree, false);
    // Every fetch is held until released (none asks for this block).
    *gated.pass.lock() = Some("no such block".into());
    let inos: Vec<u64> =
        f.fs.remote_small_files(64 << 10)
            .iter()
            .map(|(i, _)| *i)
            .collect();
    assert_eq!(inos.len(), 4);
    // Background hydration asks for the four files and waits at the gate.
    let first = {
        let (fs, inos) = (f.fs.clone(), inos.clone());
        std::thread::spawn(move || fs.prefetch(&inos))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while gated.fetches.load(SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the first batch never fetched"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // A second batch of the same files (a read's neighbours) leaves all four to it.
    assert_eq!(f.fs.prefetch(&inos).unwrap(), 0);
    assert_eq!(
        gated.fetches.load(SeqCst),
        1,
        "the files were fetched twice"
    );
    gated.release();
    assert_eq!(first.join().unwrap().unwrap(), 4);
    // Given back once stored: nothing is claimed any more, and every file reads right.
    assert_eq!(f.read("src/deep/b.txt"), b"beta\n");
    assert_eq!(
        f.fs.stats().snapshot().bytes_fetched,
        6 + 5 + 8 + BIG_FETCHED
    );
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
    assert_eq!(fetched.bytes_fetched, 6 + 5 + 8 + BIG_FETCHED);
    // Everything is local now: reading fetches nothing more.
    assert_eq!(f.read("src/deep/b.txt"), b"beta\n");
    assert_eq!(f.read("big"), vec![7u8; 10_000]);
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, fetched.bytes_fetched);
    assert!(f.fs.remote_small_files(64 << 10).is_empty());
    assert_eq!(f.fs.prefetch(&inos).unwrap(), 0, "nothing left to fetch");
    assert_eq!(f.sync().changes, 0, "hydration is not a change");
}

/// Names in the upper directory, sorted.
fn upper_names(f: &Fixture) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(f.state.join("upper"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

/// Hydration stores copies in the pack, not in upper files: a leftover upper file (left by
/// a crash, say) is neither read nor changed by it. A write copies the packed content out
/// to an upper file, replacing the leftover whole (a descriptor on it keeps what it had),
/// without fetching it again.
#[test]
fn hydration_packs_files_and_a_write_copies_one_out_whole() {
    let f = fixture(false, tree);
    f.fs.set_no_open();
    let a = f.ino("src/a.txt");
    let b = f.ino("src/deep/b.txt");
    let upper = f.state.join("upper");
    std::fs::write(
        upper.join(a.to_string()),
        b"stale bytes left by a crash, longer",
    )
    .unwrap();
    let held = std::fs::File::open(upper.join(a.to_string())).unwrap();
    assert_eq!(f.fs.prefetch(&[a, b]).unwrap(), 2);
    assert_eq!(upper_names(&f), [".pack".to_string(), a.to_string()]);
    let snap = f.fs.stats().snapshot();
    let fetched = snap.bytes_fetched;
    assert_eq!(fetched, 6 + 5);
    assert_eq!((snap.files_packed, snap.bytes_packed), (2, 6 + 5));
    // Reads without a handle come from the pack, whole or in part.
    assert_eq!(f.fs.read_at(a, 0, 0, 4096).unwrap(), b"alpha\n");
    assert_eq!(f.fs.read_at(b, 0, 1, 3).unwrap(), b"eta");
    assert_eq!(f.fs.read_at(b, 0, 5, 10).unwrap(), b"");
    // A write needs the file: copied out of the pack, then written.
    assert_eq!(f.fs.write_at(a, 0, 6, b"omega\n").unwrap(), 6);
    assert_eq!(f.fs.read_at(a, 0, 0, 4096).unwrap(), b"alpha\nomega\n");
    assert_eq!(
        std::fs::read(upper.join(a.to_string())).unwrap(),
        b"alpha\nomega\n"
    );
    let mut old = String::new();
    std::io::Read::read_to_string(&mut &held, &mut old).unwrap();
    assert_eq!(old, "stale bytes left by a crash, longer");
    assert_eq!(
        f.fs.stats().snapshot().bytes_fetched,
        fetched,
        "fetched again"
    );
    assert_eq!(upper_names(&f), [".pack".to_string(), a.to_string()]);
    // b was never written: still packed, and written back as nothing.
    let report = f.syncer.round(true).unwrap();
    assert_eq!(report.changes, 1, "{report:?}");
    assert_eq!(
        std::fs::read(f.root.join("src/a.txt")).unwrap(),
        b"alpha\nomega\n"
    );
    assert_eq!(
        std::fs::read(f.root.join("src/deep/b.txt")).unwrap(),
        b"beta\n"
    );
}

/// A read without a handle fetches a small remote file into the pack (once); a truncation
/// and an open with a handle copy it out, and what they change is written back.
#[test]
fn a_read_without_a_handle_packs_a_small_file_and_changes_copy_it_out() {
    let f = fixture(false, tree);
    f.fs.set_no_open();
    let big = f.ino("big");
    let r = f.ino("ref");
    assert_eq!(f.fs.read_at(big, 0, 9_990, 4096).unwrap(), vec![7u8; 10]);
    assert_eq!(f.fs.read_at(big, 0, 0, 3).unwrap(), vec![7u8; 3]);
    assert_eq!(f.fs.read_at(r, 0, 0, 4096).unwrap(), b"old-ref\n");
    let snap = f.fs.stats().snapshot();
    assert_eq!(snap.bytes_fetched, BIG_FETCHED + 8);
    assert_eq!((snap.files_packed, snap.bytes_packed), (2, 10_000 + 8));
    assert_eq!(upper_names(&f), [".pack".to_string()]);
    assert!(
        f.fs.remote_small_files(1 << 20)
            .iter()
            .all(|(i, _)| *i != big && *i != r),
        "packed files are not hydrated again"
    );
    // Truncation keeps the first bytes.
    f.fs.setattr(
        r,
        SetAttr {
            size: Some(4),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(f.fs.read_at(r, 0, 0, 4096).unwrap(), b"old-");
    // An open with a handle (as with --track-opens or passthrough) gets the whole content.
    assert_eq!(f.read("big"), vec![7u8; 10_000]);
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, BIG_FETCHED + 8);
    assert_eq!(f.sync().changes, 1);
    assert_eq!(std::fs::read(f.root.join("ref")).unwrap(), b"old-");
    assert_eq!(
        std::fs::read(f.root.join("big")).unwrap(),
        vec![7u8; 10_000]
    );
}

/// A file whose content is still remote stays readable after hard links to it were written
/// back and removed again: the export's block index must not have traded the file's own
/// place for the links' (found by `tracked_rounds`; the file's two identical blocks and
/// two links filled the index's places for that block).
#[test]
fn a_remote_file_stays_readable_after_links_to_it_come_and_go() {
    let f = fixture(false, tree);
    let big = f.ino("big");
    f.fs.link(big, ROOT_INO, o("n2")).unwrap();
    f.fs.link(big, ROOT_INO, o("n3")).unwrap();
    f.fs.link(big, ROOT_INO, o("n4")).unwrap();
    f.sync();
    for n in ["n2", "n3", "n4"] {
        f.fs.unlink(ROOT_INO, o(n)).unwrap();
    }
    f.sync();
    assert_eq!(f.read("big"), vec![7u8; 10_000]);
}

/// Content in more files than the block index keeps places for, with every remembered place
/// removed: the export still finds it in a file it knows holds it (one-block files).
#[test]
fn a_remote_file_stays_readable_when_every_indexed_copy_is_gone() {
    let f = fixture(false, tree);
    let r = f.ino("ref");
    let links: Vec<String> = (1..=7).map(|i| format!("l{i}")).collect();
    for l in &links {
        f.fs.link(r, ROOT_INO, o(l)).unwrap();
    }
    f.sync();
    // The index remembers ref (the oldest) and the five newest links; l1 and l2 only the
    // change feed knows.
    for n in ["ref", "l3", "l4", "l5", "l6", "l7"] {
        f.fs.unlink(ROOT_INO, o(n)).unwrap();
    }
    f.sync();
    assert_eq!(f.read("l1"), b"old-ref\n");
    assert_eq!(std::fs::read(f.root.join("l2")).unwrap(), b"old-ref\n");
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

/// A tree of `n` files in directories of 20, for rounds whose cost must not grow with it.
fn wide_tree(n: usize) -> impl FnOnce(&Path) {
    move |root: &Path| {
        for i in 0..n {
            let dir = root.join(format!("d{}", i / 20));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(format!("f{i}")), format!("{i}\n")).unwrap();
        }
    }
}

#[test]
fn a_round_after_n_changes_commits_exactly_those_and_compares_only_them() {
    let f = fixture(false, wide_tree(400));
    // Nothing changed: nothing compared.
    let r = f.sync();
    assert_eq!((r.changes, r.compared), (0, 0));
    // Five changes of five kinds in five directories.
    f.write_new("d1", "new", b"n\n");
    let fh =
        f.fs.open(
            f.ino("d2/f40"),
            OpenMode {
                write: true,
                ..Default::default()
            },
        )
        .unwrap();
    f.fs.write(fh, 0, b"changed").unwrap();
    f.fs.release(fh).unwrap();
    f.fs.unlink(f.ino("d3"), o("f60")).unwrap();
    f.fs.rename(f.ino("d4"), o("f80"), f.ino("d5"), o("moved"), false, false)
        .unwrap();
    f.fs.setattr(
        f.ino("d6/f120"),
        awcpfs::mount::content::SetAttr {
            mode: Some(0o600),
            ..Default::default()
        },
    )
    .unwrap();
    let r = f.sync();
    // The rename is two changes (a write at the new path, an unlink at the old one).
    assert_eq!(r.changes, 6, "{r:?}");
    assert!(
        r.compared <= 6,
        "compared {} paths for 5 changes",
        r.compared
    );
    assert_eq!(std::fs::read(f.root.join("d1/new")).unwrap(), b"n\n");
    assert_eq!(std::fs::read(f.root.join("d2/f40")).unwrap(), b"changed");
    assert!(!f.root.join("d3/f60").exists());
    assert_eq!(std::fs::read(f.root.join("d5/moved")).unwrap(), b"80\n");
    assert!(!f.root.join("d4/f80").exists());
    let mode = std::fs::metadata(f.root.join("d6/f120"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // Everything was written: the next round has nothing to compare, and comparing the
    // whole tree finds nothing either.
    let r = f.sync();
    assert_eq!((r.changes, r.compared), (0, 0));
    f.syncer.compare_everything_next();
    let r = f.sync();
    assert_eq!(r.changes, 0);
    assert!(r.compared > 400);
}

#[test]
fn a_renamed_directory_is_compared_at_both_paths_and_moves_whole() {
    let f = fixture(false, wide_tree(60));
    f.write_new("d1", "inside", b"i\n");
    f.fs.rename(ROOT_INO, o("d1"), f.ino("d2"), o("sub"), false, false)
        .unwrap();
    let r = f.sync();
    assert!(r.compared <= 23, "compared {}", r.compared);
    assert!(!f.root.join("d1").exists());
    assert_eq!(std::fs::read(f.root.join("d2/sub/inside")).unwrap(), b"i\n");
    assert_eq!(std::fs::read(f.root.join("d2/sub/f20")).unwrap(), b"20\n");
    f.syncer.compare_everything_next();
    assert_eq!(f.sync().changes, 0);
}

#[test]
fn a_file_skipped_while_open_is_written_by_a_later_round_without_new_changes() {
    let f = fixture(false, tree);
    let (_, fh) =
        f.fs.create(ROOT_INO, o("held.txt"), 0o644, libc::O_WRONLY)
            .unwrap();
    f.fs.write(fh, 0, b"held").unwrap();
    assert_eq!(f.sync().pending_open, 1);
    // The close itself changes nothing the table records: the skipped path was kept.
    f.fs.release(fh).unwrap();
    let r = f.sync();
    assert_eq!(r.files_written, 1, "{r:?}");
    assert_eq!(std::fs::read(f.root.join("held.txt")).unwrap(), b"held");
}

#[test]
fn a_failed_round_keeps_its_changes_for_the_next() {
    let f = fixture(false, tree);
    f.write_new("src", "kept", b"k\n");
    // Unlinked under the export: the commit of a change based on it conflicts, not fails;
    // a fence makes nothing fail either. Break the upper directory instead: hashing fails.
    let ino = f.ino("src/kept");
    let upper = f.state.join("upper").join(ino.to_string());
    let saved = std::fs::read(&upper).unwrap();
    std::fs::remove_file(&upper).unwrap();
    std::fs::create_dir(&upper).unwrap();
    assert!(f.syncer.round(false).is_err());
    std::fs::remove_dir(&upper).unwrap();
    std::fs::write(&upper, saved).unwrap();
    let r = f.sync();
    assert_eq!(r.files_written, 1, "{r:?}");
    assert_eq!(std::fs::read(f.root.join("src/kept")).unwrap(), b"k\n");
}

// Listings kept for no-opendir readdir are reused while the directory's generation holds;
// any change to its names, or a move of the directory (its `..`), shows at the next readdir.
#[test]
fn readdir_reuses_an_unchanged_listing_and_sees_every_change() {
    let f = fixture(false, tree);
    let src = f.ino("src");
    let names = |l: &[awcpfs::mount::fs::DirEntry]| -> Vec<String> {
        l.iter().map(|e| e.name.clone()).collect()
    };
    let (first, g1, _) = f.fs.listing_at(src, 0).unwrap();
    assert_eq!(names(&first), vec![".", "..", "a.txt", "deep"]);
    let (again, g2, _) = f.fs.listing_at(src, 0).unwrap();
    assert!(
        Arc::ptr_eq(&first, &again),
        "an unchanged directory is not listed again"
    );
    assert_eq!(g1, g2);
    // A new name.
    f.write_new("src", "new.txt", b"n");
    let (l, g3, _) = f.fs.listing_at(src, 0).unwrap();
    assert_eq!(names(&l), vec![".", "..", "a.txt", "deep", "new.txt"]);
    assert_ne!(g3, g1);
    // A name moved out of it, and one renamed inside it.
    f.fs.rename(src, o("new.txt"), ROOT_INO, o("out.txt"), false, false)
        .unwrap();
    f.fs.rename(src, o("a.txt"), src, o("b.txt"), false, false)
        .unwrap();
    let (l, _, _) = f.fs.listing_at(src, 0).unwrap();
    assert_eq!(names(&l), vec![".", "..", "b.txt", "deep"]);
    // An offset of a replaced listing continues at its index in the current one.
    let (old, _, i) = f.fs.listing_at(src, (g1 << 32) | 3).unwrap();
    assert_eq!((old[i].name.as_str(), i), ("deep", 3));
    // A directory moved to another parent lists its new `..`.
    let deep = f.ino("src/deep");
    let (l, _, _) = f.fs.listing_at(deep, 0).unwrap();
    assert_eq!(l[1].ino, src);
    f.fs.rename(src, o("deep"), ROOT_INO, o("deep"), false, false)
        .unwrap();
    let (l, _, _) = f.fs.listing_at(deep, 0).unwrap();
    assert_eq!(l[1].ino, ROOT_INO);
    // A removed directory is not listed from its kept snapshot.
    f.fs.unlink(deep, o("b.txt")).unwrap();
    f.fs.rmdir(ROOT_INO, o("deep")).unwrap();
    assert!(matches!(f.fs.listing_at(deep, 0), Err(FsError::NotFound)));
}

mod tracked_rounds {
    //! Random operation sequences: after every round, comparing the whole tree finds
    //! nothing the tracked round missed, and at the end the export holds the mount's tree.
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Create(usize, u8, u8),
        Write(usize, u8),
        Mkdir(usize, u8),
        Rename(usize, usize, u8),
        Unlink(usize),
        Rmdir(usize),
        Link(usize, usize, u8),
        Chmod(usize, bool),
        Xattr(usize, u8),
        Symlink(usize, u8),
        WriteWhileRound(usize, u8),
        Round,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<usize>(), 0..6u8, any::<u8>()).prop_map(|(d, n, c)| Op::Create(d, n, c)),
            (any::<usize>(), any::<u8>()).prop_map(|(i, c)| Op::Write(i, c)),
            (any::<usize>(), 0..6u8).prop_map(|(d, n)| Op::Mkdir(d, n)),
            (any::<usize>(), any::<usize>(), 0..6u8).prop_map(|(s, d, n)| Op::Rename(s, d, n)),
            any::<usize>().prop_map(Op::Unlink),
            any::<usize>().prop_map(Op::Rmdir),
            (any::<usize>(), any::<usize>(), 0..6u8).prop_map(|(s, d, n)| Op::Link(s, d, n)),
            (any::<usize>(), any::<bool>()).prop_map(|(i, x)| Op::Chmod(i, x)),
            (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Op::Xattr(i, v)),
            (any::<usize>(), 0..6u8).prop_map(|(d, n)| Op::Symlink(d, n)),
            (any::<usize>(), any::<u8>()).prop_map(|(i, c)| Op::WriteWhileRound(i, c)),
            Just(Op::Round),
            Just(Op::Round),
        ]
    }

    /// Every entry of the mount as (path, inode, is a directory), parents first.
    fn entries(f: &Fixture) -> Vec<(String, u64, bool)> {
        let mut out = Vec::new();
        let mut stack = vec![(String::new(), ROOT_INO)];
        while let Some((path, ino)) = stack.pop() {
            let (list, _, _) = f.fs.listing_at(ino, 0).unwrap();
            for e in list.iter().skip(2) {
                let p = if path.is_empty() {
                    e.name.clone()
                } else {
                    format!("{path}/{}", e.name)
                };
                let dir = e.kind == awcpfs::mount::inode::Kind::Dir;
                out.push((p.clone(), e.ino, dir));
                if dir {
                    stack.push((p, e.ino));
                }
            }
        }
        out
    }

    fn pick<T: Clone>(v: &[T], i: usize) -> Option<T> {
        (!v.is_empty()).then(|| v[i % v.len()].clone())
    }

    fn split(path: &str) -> (String, String) {
        match path.rsplit_once('/') {
            Some((p, n)) => (p.to_string(), n.to_string()),
            None => (String::new(), path.to_string()),
        }
    }

    fn write_at(f: &Fixture, ino: u64, c: u8) -> Option<u64> {
        let fh =
            f.fs.open(
                ino,
                OpenMode {
                    write: true,
                    ..Default::default()
                },
            )
            .ok()?;
        f.fs.write(fh, 0, &[c; 3]).unwrap();
        Some(fh)
    }

    /// One round, then a round over the whole tree that must find nothing left.
    fn round_then_check(f: &Fixture) {
        f.syncer.round(false).unwrap();
        f.syncer.compare_everything_next();
        let full = f.syncer.round(false).unwrap();
        assert_eq!(full.changes, 0, "a tracked round missed changes: {full:?}");
    }

    fn apply(f: &Fixture, op: &Op) {
        let all = entries(f);
        let dirs: Vec<(String, u64)> = std::iter::once((String::new(), ROOT_INO))
            .chain(all.iter().filter(|e| e.2).map(|e| (e.0.clone(), e.1)))
            .collect();
        let files: Vec<(String, u64)> = all
            .iter()
            .filter(|e| !e.2 && f.fs.readlink(e.1).is_err())
            .map(|e| (e.0.clone(), e.1))
            .collect();
        let any: Vec<(String, u64)> = all.iter().map(|e| (e.0.clone(), e.1)).collect();
        let name = |n: u8| format!("n{n}");
        match *op {
            Op::Create(d, n, c) => {
                let (_, dino) = pick(&dirs, d).unwrap();
                if let Ok((_, fh)) = f.fs.create(dino, o(&name(n)), 0o644, libc::O_WRONLY) {
                    f.fs.write(fh, 0, &[c; 5]).unwrap();
                    f.fs.release(fh).unwrap();
                }
            }
            Op::Write(i, c) => {
                if let Some((_, ino)) = pick(&files, i)
                    && let Some(fh) = write_at(f, ino, c)
                {
                    f.fs.release(fh).unwrap();
                }
            }
            Op::WriteWhileRound(i, c) => {
                if let Some((_, ino)) = pick(&files, i)
                    && let Some(fh) = write_at(f, ino, c)
                {
                    // Skipped while open; the full round skips it too.
                    round_then_check(f);
                    f.fs.release(fh).unwrap();
                }
            }
            Op::Mkdir(d, n) => {
                let (_, dino) = pick(&dirs, d).unwrap();
                let _ = f.fs.mkdir(dino, o(&name(n)), 0o755);
            }
            Op::Rename(s, d, n) => {
                if let Some((path, _)) = pick(&any, s) {
                    let (parent, old) = split(&path);
                    let (_, dino) = pick(&dirs, d).unwrap();
                    let pino = if parent.is_empty() {
                        ROOT_INO
                    } else {
                        f.ino(&parent)
                    };
                    let _ = f.fs.rename(pino, o(&old), dino, o(&name(n)), false, false);
                }
            }
            Op::Unlink(i) => {
                if let Some((path, _)) = pick(&files, i) {
                    let (parent, n) = split(&path);
                    let pino = if parent.is_empty() {
                        ROOT_INO
                    } else {
                        f.ino(&parent)
                    };
                    f.fs.unlink(pino, o(&n)).unwrap();
                }
            }
            Op::Rmdir(i) => {
                if let Some((path, _)) = pick(&dirs[1..], i) {
                    let (parent, n) = split(&path);
                    let pino = if parent.is_empty() {
                        ROOT_INO
                    } else {
                        f.ino(&parent)
                    };
                    let _ = f.fs.rmdir(pino, o(&n));
                }
            }
            Op::Link(s, d, n) => {
                if let Some((_, ino)) = pick(&files, s) {
                    let (_, dino) = pick(&dirs, d).unwrap();
                    let _ = f.fs.link(ino, dino, o(&name(n)));
                }
            }
            Op::Chmod(i, x) => {
                if let Some((_, ino)) = pick(&any, i)
                    && f.fs.readlink(ino).is_err()
                {
                    let mode = if x { 0o700 } else { 0o755 };
                    f.fs.setattr(
                        ino,
                        awcpfs::mount::content::SetAttr {
                            mode: Some(mode),
                            ..Default::default()
                        },
                    )
                    .unwrap();
                }
            }
            Op::Xattr(i, v) => {
                if let Some((_, ino)) = pick(&any, i)
                    && f.fs.readlink(ino).is_err()
                {
                    f.fs.setxattr(ino, o("user.t"), &[v], 0).unwrap();
                }
            }
            Op::Symlink(d, n) => {
                let (_, dino) = pick(&dirs, d).unwrap();
                let _ = f.fs.symlink(dino, o(&name(n)), o("target"));
            }
            Op::Round => round_then_check(f),
        }
    }

    /// The export's tree, as (path, content or target or "dir", mode).
    fn export_tree(root: &Path) -> Vec<(String, Vec<u8>, u32)> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let e = e.unwrap();
                let p = e.path();
                let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_string();
                let m = std::fs::symlink_metadata(&p).unwrap();
                let what = if m.file_type().is_symlink() {
                    std::fs::read_link(&p)
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .as_bytes()
                        .to_vec()
                } else if m.is_dir() {
                    stack.push(p.clone());
                    b"dir".to_vec()
                } else {
                    std::fs::read(&p).unwrap()
                };
                let mode = if m.file_type().is_symlink() {
                    0
                } else {
                    m.permissions().mode() & 0o777
                };
                out.push((rel, what, mode));
            }
        }
        out.sort();
        out
    }

    fn mount_tree(f: &Fixture) -> Vec<(String, Vec<u8>, u32)> {
        let mut out: Vec<(String, Vec<u8>, u32)> = entries(f)
            .into_iter()
            .map(|(p, ino, dir)| {
                if dir {
                    (
                        p,
                        b"dir".to_vec(),
                        u32::from(f.fs.getattr(ino).unwrap().perm),
                    )
                } else if let Ok(t) = f.fs.readlink(ino) {
                    (p, t.into_bytes(), 0)
                } else {
                    let perm = u32::from(f.fs.getattr(ino).unwrap().perm);
                    (p.clone(), f.read(&p), perm)
                }
            })
            .collect();
        out.sort();
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        #[test]
        fn tracked_rounds_miss_nothing(ops in proptest::collection::vec(op(), 1..40)) {
            let f = fixture(false, tree);
            for op in &ops {
                apply(&f, op);
            }
            round_then_check(&f);
            prop_assert_eq!(export_tree(&f.root), mount_tree(&f));
        }
    }
}

/// A remote whose block fetches after the first wait until the gate opens (at most 20 s).
struct Gated {
    inner: Arc<dyn Remote>,
    fetches: std::sync::atomic::AtomicUsize,
    open: parking_lot::Mutex<bool>,
    cv: parking_lot::Condvar,
    /// The fetch (counted from 1) that fails, once; 0: none.
    fail_nth: std::sync::atomic::AtomicUsize,
    /// Every change set committed through it.
    commits: parking_lot::Mutex<Vec<awcp_protocol::dataplane::ChangeSet>>,
    /// When set, the gate lets through the fetches asking for this block, and holds every
    /// other one (instead of holding all but the first: with two fetches of a file in
    /// flight, which one comes first is a race).
    pass: parking_lot::Mutex<Option<String>>,
}

/// A fixture whose remote is behind a [`Gated`] gate, `open` or held shut (see
/// [`Gated::new`]), and the gate.
fn gated_fixture(build: impl FnOnce(&Path), open: bool) -> (Fixture, Arc<Gated>) {
    let gate: Arc<parking_lot::Mutex<Option<Arc<Gated>>>> = Arc::default();
    let g2 = gate.clone();
    let f = fixture_with(false, build, move |inner| {
        let g = Gated::new(inner, open, 0);
        *g2.lock() = Some(g.clone());
        g
    });
    let gated = gate.lock().clone().unwrap();
    (f, gated)
}

impl Gated {
    /// `inner` behind a gate, `open` or held shut after the first fetch, failing fetch
    /// number `fail_nth` (from 1; 0: none).
    fn new(inner: Arc<dyn Remote>, open: bool, fail_nth: usize) -> Arc<Gated> {
        Arc::new(Gated {
            inner,
            fetches: Default::default(),
            open: parking_lot::Mutex::new(open),
            cv: parking_lot::Condvar::new(),
            fail_nth: fail_nth.into(),
            commits: Default::default(),
            pass: Default::default(),
        })
    }

    fn release(&self) {
        *self.open.lock() = true;
        self.cv.notify_all();
    }

    /// Hold every fetch from now on but those asking for block `pass`.
    fn shut(&self, pass: &[u8]) {
        *self.pass.lock() = Some(blake3::hash(pass).to_hex().to_string());
        *self.open.lock() = false;
    }
}

impl Remote for Gated {
    fn manifest(
        &self,
    ) -> Result<(awcp_protocol::dataplane::Manifest, String), awcpfs::mount::remote::RemoteError>
    {
        self.inner.manifest()
    }
    fn fetch_blocks(
        &self,
        hashes: &[String],
    ) -> Result<Vec<Vec<u8>>, awcpfs::mount::remote::RemoteError> {
        use std::sync::atomic::Ordering::SeqCst;
        let n = self.fetches.fetch_add(1, SeqCst) + 1;
        if self.fail_nth.compare_exchange(n, 0, SeqCst, SeqCst).is_ok() {
            return Err(awcpfs::mount::remote::RemoteError::Protocol {
                what: "injected: this fetch fails".into(),
            });
        }
        let held = match &*self.pass.lock() {
            Some(p) => !hashes.contains(p),
            None => n > 1,
        };
        if held {
            let mut open = self.open.lock();
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !*open && std::time::Instant::now() < deadline {
                self.cv.wait_until(&mut open, deadline);
            }
        }
        self.inner.fetch_blocks(hashes)
    }
    fn missing(
        &self,
        hashes: &[String],
    ) -> Result<Vec<String>, awcpfs::mount::remote::RemoteError> {
        self.inner.missing(hashes)
    }
    fn transfer_counters(&self) -> Option<Arc<awcpfs::mount::remote::TransferCounters>> {
        self.inner.transfer_counters()
    }
    fn upload(
        &self,
        blocks: &[([u8; 32], &[u8])],
    ) -> Result<(), awcpfs::mount::remote::RemoteError> {
        self.inner.upload(blocks)
    }
    fn commit(
        &self,
        changes: &awcp_protocol::dataplane::ChangeSet,
    ) -> Result<awcp_protocol::dataplane::CommitResult, awcpfs::mount::remote::RemoteError> {
        self.commits.lock().push(changes.clone());
        self.inner.commit(changes)
    }
    fn renew(
        &self,
    ) -> Result<awcp_protocol::dataplane::ExportEvent, awcpfs::mount::remote::RemoteError> {
        self.inner.renew()
    }
    fn events(
        &self,
    ) -> Result<
        Box<dyn Iterator<Item = awcpfs::mount::remote::StreamItem> + Send>,
        awcpfs::mount::remote::RemoteError,
    > {
        self.inner.events()
    }
}

/// A 5 MiB file (4 KiB blocks; its bytes depend on `shift`) on a no-open mount whose fetches
/// are held behind a gate, shut: the fixture, the content, the gate and the file's inode.
fn gated_big_file(shift: u32) -> (Fixture, Vec<u8>, Arc<Gated>, u64) {
    let big: Vec<u8> = (0..5u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> shift) as u8)
        .collect();
    let (f, gated) = gated_fixture(|r| std::fs::write(r.join("big.bin"), &big).unwrap(), false);
    f.fs.set_no_open();
    let ino = f.fs.lookup(ROOT_INO, o("big.bin")).unwrap().ino.0;
    (f, big, gated, ino)
}

/// The first `len` bytes of `ino`, read 1 MiB at a time through handle `fh` (0: none).
fn read_whole(f: &Fixture, ino: u64, fh: u64, len: usize) -> Vec<u8> {
    let mut all = Vec::new();
    while all.len() < len {
        let chunk = f.fs.read_at(ino, fh, all.len() as u64, 1 << 20).unwrap();
        assert!(!chunk.is_empty());
        all.extend_from_slice(&chunk);
    }
    all
}

/// Read `big`'s bytes `from..to` of `ino` in 64 KiB reads without a handle, checking each.
fn read_run(f: &Fixture, ino: u64, big: &[u8], from: usize, to: usize) {
    let mut off = from;
    while off < to {
        let len = (64 << 10).min(to - off);
        let got = f.fs.read_at(ino, 0, off as u64, len as u32).unwrap();
        assert_eq!(got, &big[off..off + len], "read of {len} at {off}");
        off += len;
    }
}

/// `ino`, 5 MiB in 4 KiB blocks, read from 64 KiB to `SEQUENTIAL_AFTER` with the gate open
/// (block by block: not sequential yet), then the gate shut but for the block starting at
/// `pass`: the read of its first 64 KiB that follows completes a sequential run and starts
/// the stream, whose requests are held but the one asking for that block.
fn nearly_sequential(f: &Fixture, ino: u64, big: &[u8], gated: &Gated, pass: usize) {
    let fetched = || f.fs.stats().snapshot().bytes_fetched;
    gated.release();
    read_run(f, ino, big, 64 << 10, SEQUENTIAL_AFTER as usize);
    let before = fetched();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        fetched(),
        before,
        "a stream started before the reads were sequential"
    );
    assert!(
        before <= SEQUENTIAL_AFTER,
        "{before} bytes fetched for 960 KiB of reads"
    );
    gated.shut(&big[pass..pass + 4096]);
}

#[test]
fn a_large_file_read_in_order_streams_before_the_whole_file_arrives() {
    // 5 MiB in 4 KiB blocks: the stream asks for 16 blocks per request; once the reads are
    // sequential, all but the stream's first request are held.
    let (f, big, gated, ino) = gated_big_file(13);
    nearly_sequential(&f, ino, &big, &gated, 0);
    // The first 64 KiB complete the run: the stream starts, and the read returns with the
    // stream's first batch while the rest of the file is still held back.
    let (tx, rx) = std::sync::mpsc::channel();
    let fs = f.fs.clone();
    std::thread::spawn(move || {
        let _ = tx.send(fs.read_at(ino, 0, 0, 65536));
    });
    let first = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the read waited for the whole file")
        .unwrap();
    assert_eq!(first, &big[..65536]);
    gated.release();
    // Out of order, across block edges, past the end.
    for (off, len) in [
        (3u64 << 20, 131_072u32),
        ((1 << 20) + 7, 65536),
        ((5 << 20) - 100, 4096),
        (5 << 20, 4096),
    ] {
        let got = f.fs.read_at(ino, 0, off, len).unwrap();
        let start = (off as usize).min(big.len());
        let end = (off as usize + len as usize).min(big.len());
        assert_eq!(got, &big[start..end], "read of {len} at {off}");
    }
    // Once the stream is done, the file is local and reads the same.
    assert_eq!(read_whole(&f, ino, 0, big.len()), big);
}

#[test]
fn a_large_file_read_here_and_there_is_fetched_block_by_block_and_one_read_in_order_streams_whole()
{
    // Two 5 MiB files in 4 KiB blocks on a no-open mount that streams large files read in
    // order (the `all` policy): a file read in order, a database read here and there, and
    // a git pack; no two blocks alike.
    let bytes = |shift: u32| -> Vec<u8> {
        (0..5u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> shift) as u8)
            .collect()
    };
    let (big, db_bytes, pack_bytes) = (bytes(9), bytes(10), bytes(12));
    let (f, _gated) = gated_fixture(
        |r| {
            std::fs::create_dir_all(r.join(".git/objects/pack")).unwrap();
            std::fs::write(r.join(".git/objects/pack/pack-1.pack"), &pack_bytes).unwrap();
            std::fs::write(r.join("big.bin"), &big).unwrap();
            std::fs::write(r.join("db.sqlite"), &db_bytes).unwrap();
        },
        true,
    );
    f.fs.set_no_open();
    let fetched = || f.fs.stats().snapshot().bytes_fetched;
    // Read in order: past the first MiB, the rest of the file follows in the background.
    let other = f.ino("big.bin");
    let (t0, before) = (Instant::now(), fetched());
    read_run(&f, other, &big, 0, (SEQUENTIAL_AFTER as usize) + 4096);
    // (The stream fetches the file from its start: the first MiB comes twice here, where
    // no block cache keeps it and the ranged reads keep only their last 16 blocks of 4 KiB,
    // not the file's first ones.)
    let mut last = 0;
    loop {
        let now = fetched() - before;
        if now >= big.len() as u64 && now == last {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the stream did not bring the file ({now} bytes fetched)"
        );
        last = now;
        std::thread::sleep(Duration::from_millis(50));
    }
    // Long enough for a stream, had one started, to fetch far more than the reads below.
    let quiet = Duration::from_secs(1);
    // Read here and there (a database's pages: 4 KiB at offsets far apart, 40 of them,
    // revisiting some): only the blocks read are fetched, and nothing follows them.
    let db = f.ino("db.sqlite");
    let before = fetched();
    for i in 0..40usize {
        let off = (i * 2_654_435_761) % (big.len() - 4096) / 4096 * 4096;
        assert_eq!(
            f.fs.read_at(db, 0, off as u64, 4096).unwrap(),
            &db_bytes[off..off + 4096]
        );
    }
    std::thread::sleep(quiet);
    let db_fetched = fetched() - before;
    assert!(
        db_fetched <= 40 * 4096,
        "{db_fetched} bytes of the database fetched for 40 reads of 4 KiB"
    );
    // A git pack is never streamed, even read in order: git reads its objects where they
    // are, and the head it needs first is fetched ahead.
    let pack = f.ino(".git/objects/pack/pack-1.pack");
    let before = fetched();
    let run = 3 * SEQUENTIAL_AFTER as usize / 2;
    read_run(&f, pack, &pack_bytes, 0, run);
    let far = 3usize << 20;
    assert_eq!(
        f.fs.read_at(pack, 0, far as u64, 4096).unwrap(),
        &pack_bytes[far..far + 4096]
    );
    std::thread::sleep(quiet);
    let pack_fetched = fetched() - before;
    assert!(
        pack_fetched <= run as u64 + 4096,
        "{pack_fetched} bytes of the pack fetched for {} bytes of reads",
        run + 4096
    );
}

#[test]
fn a_read_far_into_a_large_file_fetches_its_own_blocks_without_waiting_for_the_rest() {
    // 5 MiB in 4 KiB blocks. Once the reads are sequential, the stream's requests (from the
    // start of the file) are held; only requests for the block holding the last 4 KiB get
    // through.
    let (f, big, gated, ino) = gated_big_file(11);
    let tail = big.len() - 4096;
    nearly_sequential(&f, ino, &big, &gated, tail);
    let read = |off: u64, len: u32| {
        let (tx, rx) = std::sync::mpsc::channel();
        let fs = f.fs.clone();
        std::thread::spawn(move || {
            let _ = tx.send(fs.read_at(ino, 0, off, len));
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the read waited for the blocks before it")
            .unwrap()
    };
    // The read completing the run starts the stream (held); the tail is read past it, and
    // a read across the end returns what there is.
    let (tx, rx) = std::sync::mpsc::channel();
    let fs = f.fs.clone();
    std::thread::spawn(move || {
        let _ = tx.send(fs.read_at(ino, 0, 0, 4096));
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "the start of the file was read although its blocks are held back"
    );
    assert_eq!(read(tail as u64, 4096), &big[tail..]);
    assert_eq!(read(tail as u64 + 1000, 65536), &big[tail + 1000..]);
    gated.release();
    let head = rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    assert_eq!(head, &big[..4096]);
    // Everything else reads the same once the stream is through.
    assert_eq!(read_whole(&f, ino, 0, big.len()), big);
}

#[test]
fn a_fetch_failing_in_a_later_batch_fails_the_open_cleanly_and_a_retry_succeeds() {
    // 2 MiB in 4 KiB blocks: 32 batches, fetched two at a time; the fifth request fails.
    let big: Vec<u8> = (0..2u32 << 20)
        .map(|i| (i.wrapping_mul(2_246_822_519) >> 11) as u8)
        .collect();
    let f = fixture_with(
        false,
        |r| std::fs::write(r.join("big.bin"), &big).unwrap(),
        |inner| Gated::new(inner, true, 5),
    );
    let ino = f.ino("big.bin");
    let read = OpenMode {
        read: true,
        ..Default::default()
    };
    let open = |fs: Arc<AwcpFs>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(fs.open(ino, read));
        });
        rx.recv_timeout(Duration::from_secs(20))
            .expect("the open hung after a failed fetch")
    };
    let err = open(f.fs.clone()).unwrap_err();
    assert!(err.to_string().contains("fail"), "{err}");
    let leftovers: Vec<_> = std::fs::read_dir(f.state.join("upper"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    // Nothing is stuck: the next open fetches the whole file, in order.
    let fh = open(f.fs.clone()).unwrap();
    let all = read_whole(&f, ino, fh, big.len());
    assert!(all == big, "the content differs from the Delegator's");
    f.fs.release(fh).unwrap();
}

/// Files created and then written without a handle (no-open) while the syncer runs round
/// after round: no round may take a file between its creation and its first write (the
/// empty version would meet the real one as a conflict if the mount crashed before logging
/// the commit). Creation marks the file under the table's lock; a round must ask which
/// files are being written under that lock too, or a file created just before it takes
/// the lock joins its dirty set unmarked.
#[test]
fn rounds_never_take_a_file_created_but_not_yet_written() {
    let (f, gated) = gated_fixture(|r| std::fs::create_dir_all(r.join("w")).unwrap(), true);
    f.fs.set_no_open();
    let dir = f.ino("w");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let n = std::thread::scope(|s| {
        let rounds = s.spawn(|| {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                f.syncer.round(false).unwrap();
                n += 1;
            }
            n
        });
        for i in 0..400 {
            let name = format!("f{i:04}");
            let (attr, fh) = f.fs.create(dir, o(&name), 0o644, libc::O_WRONLY).unwrap();
            assert_eq!(fh, 0);
            f.fs.write_at(attr.ino.0, 0, 0, format!("content {i}\n").as_bytes())
                .unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        rounds.join().unwrap()
    });
    // Each round syncs what it commits to the state disk first, so on a loaded machine
    // fewer rounds fit beside the 400 creations; a handful interleave all the same.
    assert!(n > 4, "only {n} rounds ran alongside the writer");
    let empty = blake3::hash(b"").to_hex().to_string();
    let taken_empty: Vec<String> = gated
        .commits
        .lock()
        .iter()
        .flat_map(|c| c.changes.iter())
        .filter_map(|c| match c {
            awcp_protocol::dataplane::Change::Write { path, hash, .. } if *hash == empty => {
                Some(path.clone())
            }
            _ => None,
        })
        .collect();
    assert!(
        taken_empty.is_empty(),
        "files committed between their creation and their first write: {taken_empty:?}"
    );
}

// ---------------------------------------------------------------------------------------
// The first command on a cold mount: hydration policies, the agent's fetches first, ranged
// reads of large files (issue 21).

use awcpfs::mount::hydrate::{Batch, HydratePolicy};

/// A workspace with a git directory (made by hand: only its shape matters), sources in two
/// directories, ignore files and a large pack.
fn git_tree(root: &Path) {
    for d in [
        ".git/refs/heads",
        ".git/objects/pack",
        ".git/info",
        "src",
        "docs",
    ] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join(".git/HEAD"), "ref: refs/heads/main\n").unwrap();
    std::fs::write(root.join(".git/config"), "[core]\n\tbare = false\n").unwrap();
    std::fs::write(root.join(".git/refs/heads/main"), "0123456789\n").unwrap();
    std::fs::write(root.join(".git/info/exclude"), "# nothing\n").unwrap();
    // An index larger than the pack file takes (fetched whole, into its upper file).
    std::fs::write(root.join(".git/index"), vec![b'i'; 300 << 10]).unwrap();
    std::fs::write(root.join(".git/objects/pack/p.idx"), vec![b'x'; 2000]).unwrap();
    std::fs::write(root.join(".git/objects/pack/p.pack"), vec![b'p'; 600 << 10]).unwrap();
    std::fs::write(root.join(".gitignore"), "*.o\n").unwrap();
    std::fs::write(root.join("src/.gitignore"), "*.tmp\n").unwrap();
    for i in 0..5 {
        std::fs::write(root.join(format!("src/m{i}.py")), format!("x = {i}\n")).unwrap();
        std::fs::write(root.join(format!("docs/d{i}.md")), format!("# doc {i}\n")).unwrap();
    }
}

/// Every regular file below `root`, relative path -> size.
fn file_sizes(root: &Path) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                let rel = e.path().strip_prefix(root).unwrap().display().to_string();
                out.insert(rel, e.metadata().unwrap().len());
            }
        }
    }
    out
}

/// Run a policy's whole plan, in order, on this thread.
fn hydrate_all(f: &Fixture, policy: HydratePolicy) -> Vec<Batch> {
    f.fs.set_hydrate_policy(policy);
    let plan: Vec<Batch> = f.fs.hydration_plan(policy).into_iter().collect();
    for b in &plan {
        f.fs.hydrate(b).unwrap();
    }
    f.fs.hydration_finished();
    plan
}

#[test]
fn a_planned_file_fetched_by_another_hand_while_its_request_ran_counts_as_done() {
    // One small file; the hydration request for it fails (fetch 1), as if another fetch of
    // it were under way, and a read brings it before the plan ends.
    let f = fixture_with(
        false,
        |r| std::fs::write(r.join("a.txt"), b"content").unwrap(),
        |inner| Gated::new(inner, true, 1),
    );
    f.fs.set_no_open();
    let policy = HydratePolicy::default();
    f.fs.set_hydrate_policy(policy);
    let plan: Vec<Batch> = f.fs.hydration_plan(policy).into_iter().collect();
    assert_eq!(f.fs.hydration().snapshot().files_planned, 1, "{plan:?}");
    for b in &plan {
        assert!(f.fs.hydrate(b).is_err(), "the gate fails the first fetch");
    }
    assert_eq!(f.fs.hydration().snapshot().files_remaining, 1);
    let ino = f.ino("a.txt");
    assert_eq!(f.fs.read_at(ino, 0, 0, 100).unwrap(), b"content");
    f.fs.hydration_finished();
    let h = f.fs.hydration().snapshot();
    assert!(h.finished);
    assert_eq!((h.files_remaining, h.bytes_remaining), (0, 0), "{h:?}");
}

#[test]
fn cold_policy_none_fetches_nothing_first_the_git_entry_points_all_every_small_file() {
    let sizes = {
        let t = tempfile::tempdir().unwrap();
        git_tree(t.path());
        file_sizes(t.path())
    };
    let sum = |pred: &dyn Fn(&str, u64) -> bool| -> u64 {
        sizes
            .iter()
            .filter(|(p, s)| pred(p, **s))
            .map(|(_, s)| *s)
            .sum()
    };
    let first_bytes = sum(&|p, _| awcpfs::mount::hydrate::is_first_command_file(p));
    let all_bytes = sum(&|p, s| awcpfs::mount::hydrate::is_first_command_file(p) || s <= 256 << 10);

    // none: nothing unasked; a read fetches that file and nothing else (no neighbours).
    let f = fixture(false, git_tree);
    f.fs.set_no_open();
    assert!(hydrate_all(&f, HydratePolicy::None).is_empty());
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, 0);
    assert_eq!(
        f.fs.read_at(f.ino("src/m1.py"), 0, 0, 4096).unwrap(),
        b"x = 1\n"
    );
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, 6);
    let p = f.fs.hydration().snapshot();
    assert_eq!(
        (p.policy.as_str(), p.files_planned, p.finished),
        ("none", 0, true)
    );

    // first: git's entry points and the ignore files, the index (too large for the pack)
    // whole, and no source file, no pack.
    let f = fixture(false, git_tree);
    let plan = hydrate_all(&f, HydratePolicy::First);
    assert!(
        plan.contains(&Batch::Whole(f.ino(".git/index"))),
        "{plan:?}"
    );
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, first_bytes);
    let p = f.fs.hydration().snapshot();
    assert_eq!(p.files_planned, 8, "{p:?}");
    assert_eq!((p.files_done, p.bytes_done), (8, first_bytes));
    assert_eq!(
        (p.files_remaining, p.bytes_remaining, p.finished),
        (0, 0, true)
    );
    // They read without another fetch.
    f.fs.set_no_open();
    assert_eq!(
        f.fs.read_at(f.ino(".git/HEAD"), 0, 0, 4096).unwrap(),
        b"ref: refs/heads/main\n"
    );
    assert_eq!(f.read(".git/index"), vec![b'i'; 300 << 10]);
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, first_bytes);

    // all: every small file too, but never the large pack.
    let f = fixture(false, git_tree);
    hydrate_all(&f, HydratePolicy::default());
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, all_bytes);
    assert!(all_bytes > first_bytes);
    assert!(
        all_bytes < sizes.values().sum::<u64>(),
        "the pack stays remote"
    );
    f.fs.set_no_open();
    assert_eq!(
        f.fs.read_at(f.ino("docs/d3.md"), 0, 0, 4096).unwrap(),
        b"# doc 3\n"
    );
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, all_bytes);
    assert_eq!(f.sync().changes, 0, "hydration is not a change");
}

#[test]
fn cold_reading_a_small_file_brings_its_small_neighbours_in_the_same_request() {
    let f = fixture(false, git_tree);
    f.fs.set_no_open();
    f.fs.set_hydrate_policy(HydratePolicy::First);
    assert_eq!(
        f.fs.read_at(f.ino("src/m0.py"), 0, 0, 4096).unwrap(),
        b"x = 0\n"
    );
    let snap = f.fs.stats().snapshot();
    // src/ (five modules, its .gitignore), then outwards: docs/ and the root's .gitignore;
    // not git's internals.
    assert_eq!(snap.files_packed, 12, "{snap:?}");
    assert_eq!(snap.bytes_fetched, 5 * 6 + 6 + 5 * 8 + 4);
    for i in 1..5 {
        let want = format!("x = {i}\n");
        assert_eq!(
            f.fs.read_at(f.ino(&format!("src/m{i}.py")), 0, 0, 4096)
                .unwrap(),
            want.as_bytes()
        );
    }
    assert_eq!(
        f.fs.read_at(f.ino("docs/d0.md"), 0, 0, 4096).unwrap(),
        b"# doc 0\n"
    );
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, snap.bytes_fetched);
    assert_eq!(
        f.fs.read_at(f.ino(".git/HEAD"), 0, 0, 4096).unwrap(),
        b"ref: refs/heads/main\n"
    );
    assert!(f.fs.stats().snapshot().bytes_fetched > snap.bytes_fetched);

    // A first command's file brings only its own directory's neighbours: reading the
    // root's .gitignore on a fresh mount fetches nothing from src/ or docs/.
    let f = fixture(false, git_tree);
    f.fs.set_no_open();
    f.fs.set_hydrate_policy(HydratePolicy::First);
    assert_eq!(
        f.fs.read_at(f.ino(".gitignore"), 0, 0, 64).unwrap(),
        b"*.o\n"
    );
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, 4);
}

/// A neighbour whose file changed at the Delegator (its blocks gone from the export, the
/// change not at the mount yet) never fails the read it came along with.
#[test]
fn cold_a_neighbour_changed_at_the_delegator_does_not_fail_the_read() {
    let f = fixture(false, git_tree);
    f.fs.set_no_open();
    f.fs.set_hydrate_policy(HydratePolicy::First);
    std::fs::write(f.root.join("src/m3.py"), "changed = True\n").unwrap();
    assert_eq!(
        f.fs.read_at(f.ino("src/m0.py"), 0, 0, 4096).unwrap(),
        b"x = 0\n"
    );
    assert_eq!(
        f.fs.read_at(f.ino("src/m1.py"), 0, 0, 4096).unwrap(),
        b"x = 1\n"
    );
    // The changed one itself fails until the mount learns of the change.
    assert!(f.fs.read_at(f.ino("src/m3.py"), 0, 0, 4096).is_err());
}

#[test]
fn cold_a_large_file_read_fetches_only_the_blocks_it_covers_and_a_write_still_fetches_it_whole() {
    // Large enough to be streamed under `all` (the fixture's export uses 4 KiB blocks).
    let big: Vec<u8> = (0..(5u32 << 20)).map(|i| (i % 251) as u8).collect();
    let f = fixture(false, |r| {
        git_tree(r);
        std::fs::write(r.join(".git/objects/pack/p.pack"), &big).unwrap();
    });
    f.fs.set_no_open();
    f.fs.set_hydrate_policy(HydratePolicy::First);
    let pack = f.ino(".git/objects/pack/p.pack");
    let at = 3 << 20;
    assert_eq!(
        f.fs.read_at(pack, 0, at + 100, 5000).unwrap(),
        &big[(at + 100) as usize..(at + 5100) as usize]
    );
    // Two 4 KiB blocks cover it: that is all that was fetched.
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, 8192);
    // The kernel's next piece of the same blocks costs no request.
    assert_eq!(
        f.fs.read_at(pack, 0, at + 4096, 100).unwrap(),
        &big[(at + 4096) as usize..(at + 4196) as usize]
    );
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, 8192);
    // A write needs the whole file first: fetched whole, changed, written back whole.
    f.fs.write_at(pack, 0, 10, b"CHANGED").unwrap();
    let mut want = big.clone();
    want[10..17].copy_from_slice(b"CHANGED");
    assert_eq!(f.fs.read_at(pack, 0, 0, 64).unwrap(), &want[..64]);
    f.fs.flush_at(0).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        f.sync();
        if std::fs::read(f.root.join(".git/objects/pack/p.pack")).unwrap() == want {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not written back");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn cold_an_on_demand_read_is_served_while_a_hydration_request_is_held() {
    let (f, gated) = gated_fixture(git_tree, false);
    let f = Arc::new(f);
    f.fs.set_no_open();
    f.fs.set_hydrate_policy(HydratePolicy::None);
    // Pass the agent's file through the gate, hold everything else (hydration).
    let wanted = f
        .manifest
        .entries
        .iter()
        .find(|e| e.path == "docs/d2.md")
        .unwrap();
    *gated.pass.lock() = Some(wanted.blocks[0].clone());
    let plan: Vec<Batch> =
        f.fs.hydration_plan(HydratePolicy::default())
            .into_iter()
            .collect();
    let hydrating = {
        let f = f.clone();
        std::thread::spawn(move || {
            for b in &plan {
                f.fs.hydrate(b).unwrap();
            }
        })
    };
    // Wait until hydration's request is at the export (held there).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while gated.fetches.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    // The agent's read is answered while hydration's request is still held.
    assert_eq!(
        f.fs.read_at(f.ino("docs/d2.md"), 0, 0, 4096).unwrap(),
        b"# doc 2\n"
    );
    assert!(
        !hydrating.is_finished(),
        "hydration was held the whole time"
    );
    gated.release();
    hydrating.join().unwrap();
    // Everything reads correct content afterwards.
    for i in 0..5 {
        let want = format!("x = {i}\n");
        assert_eq!(f.read(&format!("src/m{i}.py")), want.as_bytes());
    }
    assert_eq!(f.read(".git/HEAD"), b"ref: refs/heads/main\n");
}

#[test]
fn cold_hydration_waits_while_an_on_demand_fetch_is_in_flight() {
    use std::sync::atomic::Ordering::SeqCst;
    let (f, gated) = gated_fixture(git_tree, false);
    let f = Arc::new(f);
    f.fs.set_no_open();
    f.fs.set_hydrate_policy(HydratePolicy::None);
    // Hold the agent's fetch (docs/d2.md); let anything asking for src/m0.py through.
    let pass = f
        .manifest
        .entries
        .iter()
        .find(|e| e.path == "src/m0.py")
        .unwrap();
    *gated.pass.lock() = Some(pass.blocks[0].clone());
    let ino = f.ino("docs/d2.md");
    let reader = {
        let f = f.clone();
        std::thread::spawn(move || f.fs.read_at(ino, 0, 0, 4096).unwrap())
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while gated.fetches.load(SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    // A hydration request (which the gate would let through) waits for the agent's.
    let m0 = f.ino("src/m0.py");
    let hydrating = {
        let f = f.clone();
        std::thread::spawn(move || f.fs.hydrate(&Batch::Packed(vec![m0])).unwrap())
    };
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(gated.fetches.load(SeqCst), 1, "hydration did not go first");
    assert!(!hydrating.is_finished());
    gated.release();
    assert_eq!(reader.join().unwrap(), b"# doc 2\n");
    hydrating.join().unwrap();
    assert_eq!(gated.fetches.load(SeqCst), 2);
    assert_eq!(f.fs.hydration().snapshot().yielded, 1);
    assert_eq!(f.fs.read_at(m0, 0, 0, 4096).unwrap(), b"x = 0\n");
}

#[test]
fn cold_a_small_files_window_goes_down_first_then_outwards_within_its_budget() {
    let f = fixture(false, |r| {
        std::fs::create_dir_all(r.join("pkg/sub/deeper")).unwrap();
        std::fs::create_dir_all(r.join("other")).unwrap();
        std::fs::write(r.join("pkg/__init__.py"), "a\n").unwrap();
        std::fs::write(r.join("pkg/sub/mod.py"), "bb\n").unwrap();
        std::fs::write(r.join("pkg/sub/deeper/leaf.py"), "ccc\n").unwrap();
        // Six files of 200 KiB beside pkg/: five fit in the 1 MiB window, the sixth not.
        // Each of its own content (no block shared, so each costs its size to fetch),
        // starting with "wwww".
        for i in 0..6u8 {
            let mut data = vec![0u8; 200 << 10];
            blake3::Hasher::new()
                .update(&[i])
                .finalize_xof()
                .fill(&mut data);
            data[..4].copy_from_slice(b"wwww");
            std::fs::write(r.join(format!("other/w{i}.py")), data).unwrap();
        }
    });
    f.fs.set_no_open();
    f.fs.set_hydrate_policy(HydratePolicy::First);
    assert_eq!(
        f.fs.read_at(f.ino("pkg/__init__.py"), 0, 0, 64).unwrap(),
        b"a\n"
    );
    let snap = f.fs.stats().snapshot();
    assert_eq!(snap.files_packed, 3 + 5, "{snap:?}");
    assert_eq!(snap.bytes_fetched, 2 + 3 + 4 + 5 * (200 << 10));
    assert_eq!(
        f.fs.read_at(f.ino("pkg/sub/deeper/leaf.py"), 0, 0, 64)
            .unwrap(),
        b"ccc\n"
    );
    assert_eq!(
        f.fs.read_at(f.ino("other/w4.py"), 0, 0, 4).unwrap(),
        b"wwww"
    );
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, snap.bytes_fetched);
    assert_eq!(
        f.fs.read_at(f.ino("other/w5.py"), 0, 0, 4).unwrap(),
        b"wwww"
    );
    assert_eq!(
        f.fs.stats().snapshot().bytes_fetched,
        snap.bytes_fetched + (200 << 10)
    );
}

#[test]
fn cold_first_fetches_the_head_of_a_large_pack_and_reads_there_cost_no_request() {
    let big: Vec<u8> = (0..(5u32 << 20)).map(|i| (i % 253) as u8).collect();
    let f = fixture(false, |r| {
        git_tree(r);
        std::fs::write(r.join(".git/objects/pack/p.pack"), &big).unwrap();
    });
    f.fs.set_no_open();
    let plan = hydrate_all(&f, HydratePolicy::First);
    let pack = f.ino(".git/objects/pack/p.pack");
    assert!(plan.contains(&Batch::PackHead(pack)), "{plan:?}");
    let fetched = f.fs.stats().snapshot().bytes_fetched;
    // The fixture's export has 4 KiB blocks: the first two are here.
    assert_eq!(f.fs.read_at(pack, 0, 12, 8000).unwrap(), &big[12..8012]);
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, fetched);
    // Past them, a read fetches its own block.
    assert_eq!(f.fs.read_at(pack, 0, 8192, 10).unwrap(), &big[8192..8202]);
    assert_eq!(f.fs.stats().snapshot().bytes_fetched, fetched + 4096);
    // `all` streams other large files whole, never a pack: its head is planned too.
    let f = fixture(false, |r| {
        git_tree(r);
        std::fs::write(r.join(".git/objects/pack/p.pack"), &big).unwrap();
    });
    let plan = f.fs.hydration_plan(HydratePolicy::default());
    let pack = f.ino(".git/objects/pack/p.pack");
    assert!(plan.contains(&Batch::PackHead(pack)), "{plan:?}");
}

/// The export's `changed` events, as they come: a thread reads the event stream.
fn changed_events(
    remote: Arc<dyn Remote>,
) -> std::sync::mpsc::Receiver<(
    u64,
    Vec<awcp_protocol::dataplane::ManifestEntry>,
    Vec<String>,
)> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let Ok(items) = remote.events() else { return };
        for item in items {
            if let awcpfs::mount::remote::StreamItem::Event(
                awcp_protocol::dataplane::ExportEvent::Changed {
                    seq,
                    entries,
                    removed,
                },
            ) = item
                && tx.send((seq, entries, removed)).is_err()
            {
                return;
            }
        }
    });
    rx
}

/// The first `changed` event that lists `path`, applied to the mount: how it was judged.
fn apply_event_for(
    f: &Fixture,
    events: &std::sync::mpsc::Receiver<(
        u64,
        Vec<awcp_protocol::dataplane::ManifestEntry>,
        Vec<String>,
    )>,
    path: &str,
) -> awcpfs::mount::upstream::UpstreamReport {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let (seq, entries, removed) = events
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no changed event for {path}"));
        let lists = entries.iter().any(|e| e.path == path) || removed.iter().any(|p| p == path);
        let (_, report) = f.syncer.apply_upstream(seq, &entries, &removed);
        if lists {
            return report;
        }
    }
}

/// A remote that answers commits as an export from before `current` did (the refused
/// event is then what the mount has to go on).
struct WithoutCurrent(Arc<dyn Remote>);

impl Remote for WithoutCurrent {
    fn manifest(
        &self,
    ) -> Result<(awcp_protocol::dataplane::Manifest, String), awcpfs::mount::remote::RemoteError>
    {
        self.0.manifest()
    }
    fn fetch_blocks(
        &self,
        hashes: &[String],
    ) -> Result<Vec<Vec<u8>>, awcpfs::mount::remote::RemoteError> {
        self.0.fetch_blocks(hashes)
    }
    fn missing(
        &self,
        hashes: &[String],
    ) -> Result<Vec<String>, awcpfs::mount::remote::RemoteError> {
        self.0.missing(hashes)
    }
    fn transfer_counters(&self) -> Option<Arc<awcpfs::mount::remote::TransferCounters>> {
        self.0.transfer_counters()
    }
    fn upload(
        &self,
        blocks: &[([u8; 32], &[u8])],
    ) -> Result<(), awcpfs::mount::remote::RemoteError> {
        self.0.upload(blocks)
    }
    fn commit(
        &self,
        changes: &awcp_protocol::dataplane::ChangeSet,
    ) -> Result<awcp_protocol::dataplane::CommitResult, awcpfs::mount::remote::RemoteError> {
        let mut r = self.0.commit(changes)?;
        r.current = None;
        Ok(r)
    }
    fn renew(
        &self,
    ) -> Result<awcp_protocol::dataplane::ExportEvent, awcpfs::mount::remote::RemoteError> {
        self.0.renew()
    }
    fn events(
        &self,
    ) -> Result<
        Box<dyn Iterator<Item = awcpfs::mount::remote::StreamItem> + Send>,
        awcpfs::mount::remote::RemoteError,
    > {
        self.0.events()
    }
}

/// How the mount's own change to `src/a.txt` crosses the Delegator's rewrite of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crossing {
    /// `chmod` only (sent without a time: applied, on content it was not based on).
    Mode,
    /// `chmod` and a new modification time (`git status` refreshing `.git/index`): a
    /// conflict, the Delegator's version kept, nothing of the mount's.
    ModeAndTime,
    /// A new modification time alone, through an export that does not describe its state
    /// in the answer: the refused event is all the mount has (no later event comes, as
    /// the mode does not change on the Delegator).
    TimeOldExport,
    /// Removed on the mount: a conflict, the Delegator's file kept.
    Unlink,
}

/// The race `tests/tests/upstream.rs` once slept to dodge, made deterministic: the mount
/// changes a file (metadata only, or removes it), the Delegator rewrites it, and the
/// Delegator's `changed` event reaches the mount before the write-back, so it is refused
/// (the mount has a change of its own there). The write-back then loses to the Delegator's
/// version, and the mount must show that version — content and mode — journaled, with
/// nothing left to send. Regression: the mount kept showing its own older content.
fn a_local_change_crossing_a_delegator_rewrite(crossing: Crossing) {
    use std::os::unix::fs::MetadataExt;
    let f = if crossing == Crossing::TimeOldExport {
        fixture_with(false, tree, |r| Arc::new(WithoutCurrent(r)))
    } else {
        fixture(false, tree)
    };
    let events = changed_events(f.remote.clone());
    // The mount has the old content locally.
    assert_eq!(f.read("src/a.txt"), b"alpha\n");
    let ino = f.ino("src/a.txt");
    let t = std::time::UNIX_EPOCH + Duration::from_secs(1_500_000_000);
    match crossing {
        Crossing::Mode => {
            f.fs.setattr(
                ino,
                SetAttr {
                    mode: Some(0o600),
                    ..Default::default()
                },
            )
            .unwrap();
        }
        Crossing::ModeAndTime => {
            f.fs.setattr(
                ino,
                SetAttr {
                    mode: Some(0o600),
                    mtime: Some(t),
                    ..Default::default()
                },
            )
            .unwrap();
        }
        Crossing::TimeOldExport => {
            f.fs.setattr(
                ino,
                SetAttr {
                    mtime: Some(t),
                    ..Default::default()
                },
            )
            .unwrap();
        }
        Crossing::Unlink => f.fs.unlink(f.ino("src"), o("a.txt")).unwrap(),
    }
    std::fs::write(f.root.join("src/a.txt"), "the Delegator's\n").unwrap();
    let delegator_mtime = std::fs::metadata(f.root.join("src/a.txt")).unwrap().mtime();
    let judged = apply_event_for(&f, &events, "src/a.txt");
    assert_eq!(
        (judged.applied, judged.kept_local),
        (0, 1),
        "the event must meet the mount's own change: {judged:?}"
    );

    let report = f.sync();
    let expect_conflict = crossing != Crossing::Mode;
    assert_eq!(
        report.conflicts.len(),
        usize::from(expect_conflict),
        "{report:?}"
    );
    // The Delegator keeps its content.
    assert_eq!(
        std::fs::read(f.root.join("src/a.txt")).unwrap(),
        b"the Delegator's\n"
    );
    let on_delegator = std::fs::metadata(f.root.join("src/a.txt")).unwrap();
    assert_eq!(on_delegator.mtime(), delegator_mtime, "{crossing:?}");
    let mode = match crossing {
        Crossing::Mode | Crossing::ModeAndTime => 0o600,
        Crossing::TimeOldExport | Crossing::Unlink => 0o644,
    };
    assert_eq!(on_delegator.mode() & 0o7777, mode, "{crossing:?}");
    // The mount shows it: content, size, mode and time.
    assert_eq!(f.read("src/a.txt"), b"the Delegator's\n", "{crossing:?}");
    let ino = f.ino("src/a.txt");
    let attr = f.fs.getattr(ino).unwrap();
    assert_eq!(attr.size, 16);
    assert_eq!(attr.perm, mode as u16);
    assert_eq!(
        attr.mtime,
        std::time::UNIX_EPOCH
            + Duration::new(
                on_delegator.mtime() as u64,
                on_delegator.mtime_nsec() as u32
            )
    );
    // Nothing of the mount's is left to write back, and the Delegator's file stays.
    let again = f.sync();
    assert_eq!((again.changes, again.conflicts.len()), (0, 0), "{again:?}");
    assert_eq!(
        std::fs::read(f.root.join("src/a.txt")).unwrap(),
        b"the Delegator's\n"
    );
    // Journaled: a replay (crash recovery) rebuilds the Delegator's version, not the old one.
    let records = Journal::read_all(&f.state.join("journal.log")).unwrap();
    let mut replayed = InodeTable::from_manifest(&f.manifest, 0, 0).unwrap();
    journal::replay(&mut replayed, &records, 0, 0);
    let node = replayed
        .get(replayed.resolve("src/a.txt").expect("replayed"))
        .unwrap();
    assert_eq!((node.size, node.perm), (16, mode as u16), "{crossing:?}");
    assert!(
        matches!(&node.data, awcpfs::mount::inode::Data::Remote { hash, .. }
            if *hash == *blake3::hash(b"the Delegator's\n").as_bytes()),
        "{crossing:?}: {:?}",
        node.data
    );
}

#[test]
fn a_mode_change_crossing_a_delegator_rewrite_shows_the_delegators_content() {
    a_local_change_crossing_a_delegator_rewrite(Crossing::Mode);
}

#[test]
fn a_mode_and_time_change_crossing_a_delegator_rewrite_shows_the_delegators_content() {
    a_local_change_crossing_a_delegator_rewrite(Crossing::ModeAndTime);
}

#[test]
fn with_an_older_export_the_refused_event_is_shown_once_the_mounts_change_loses() {
    a_local_change_crossing_a_delegator_rewrite(Crossing::TimeOldExport);
}

#[test]
fn a_removal_crossing_a_delegator_rewrite_brings_the_delegators_file_back() {
    a_local_change_crossing_a_delegator_rewrite(Crossing::Unlink);
}

// Issue 34: nothing said how long a closed write waited before the Delegator had it.
#[test]
fn a_closed_write_is_timed_until_its_commit_is_answered() {
    let (f, gated) = gated_fixture(tree, true);
    f.write_new("", "lag.txt", b"lagging\n");
    std::thread::sleep(Duration::from_millis(30));
    assert!(
        f.fs.stats().snapshot().writeback_lag.is_empty(),
        "not written back yet"
    );
    assert_eq!(f.sync().files_written, 1);
    let lag = f.fs.stats().snapshot().writeback_lag;
    assert_eq!(lag.counts.iter().sum::<u64>(), 1, "{lag:?}");
    assert!(
        (30_000..10_000_000).contains(&lag.sum_micros),
        "one write closed 30 ms before its round: {lag:?}"
    );
    // The commit told the export how long its oldest change had waited.
    let age = gated.commits.lock().last().and_then(|c| c.age_ms);
    assert!(age.is_some_and(|a| (30..10_000).contains(&a)), "{age:?}");
    // A round with nothing closed since observes nothing more; a second close does.
    f.sync();
    assert_eq!(
        f.fs.stats()
            .snapshot()
            .writeback_lag
            .counts
            .iter()
            .sum::<u64>(),
        1
    );
    f.write_new("", "lag2.txt", b"again\n");
    f.sync();
    assert_eq!(
        f.fs.stats()
            .snapshot()
            .writeback_lag
            .counts
            .iter()
            .sum::<u64>(),
        2
    );
}

/// The journal's `Node` records of `ino`, in order: (size, local).
fn node_records(f: &Fixture, ino: u64) -> Vec<(u64, bool)> {
    fn walk(records: &[journal::Record], ino: u64, out: &mut Vec<(u64, bool)>) {
        for r in records {
            match r {
                journal::Record::Batch { records } => walk(records, ino, out),
                journal::Record::Node {
                    ino: i,
                    size,
                    local,
                    ..
                } if *i == ino => out.push((*size, *local)),
                _ => {}
            }
        }
    }
    let records = Journal::read_all(&f.state.join("journal.log")).unwrap();
    let mut out = Vec::new();
    walk(&records, ino, &mut out);
    out
}

/// Writes without a handle (no-open: a linker's output, thousands of small writes) are
/// journaled once per run of writes: the first, before it is answered, names the file as
/// changed here (recovery then sends whatever its upper file holds), and the node as the
/// run leaves it is journaled when the run ends, before the round that writes it back.
#[test]
fn a_run_of_writes_without_a_handle_is_journaled_at_its_start_and_its_end() {
    let f = fixture(false, tree);
    f.fs.set_no_open();
    let r = f.ino("ref");
    for i in 0..500u64 {
        f.fs.write_at(r, 0, i * 4, b"abcd").unwrap();
    }
    assert_eq!(
        node_records(&f, r),
        [(8, true)],
        "one record, from the first write (the file had 8 bytes)"
    );
    // The run ends once no write touched the file for WRITE_QUIET; the round takes it.
    std::thread::sleep(awcpfs::mount::fs::WRITE_QUIET * 3);
    assert_eq!(f.sync().changes, 1);
    assert_eq!(node_records(&f, r), [(8, true), (2000, true)]);
    assert_eq!(
        std::fs::read(f.root.join("ref")).unwrap(),
        b"abcd".repeat(500)
    );
    // A new run journals its start again.
    f.fs.write_at(r, 0, 2000, b"!").unwrap();
    assert_eq!(node_records(&f, r).len(), 3);
    // What recovery would rebuild from the journal names the file as local: the content
    // it sends is the upper file's, every answered write in it.
    let records = Journal::read_all(&f.state.join("journal.log")).unwrap();
    let mut replayed = InodeTable::from_manifest(&f.manifest, 0, 0).unwrap();
    journal::replay(&mut replayed, &records, 0, 0);
    assert!(matches!(
        replayed.get(r).unwrap().data,
        awcpfs::mount::inode::Data::Local { dirty: true, .. }
    ));
}

/// Requests without a handle reuse a descriptor of the upper file. When the Delegator
/// replaces the file's content, the mount's next write lands in the new upper file and is
/// written back, and its reads show it: nothing goes to the replaced file through a
/// descriptor kept from before.
#[test]
fn a_write_without_a_handle_after_the_delegator_replaced_the_file_is_written_back() {
    let f = fixture(false, tree);
    f.fs.set_no_open();
    let events = changed_events(f.remote.clone());
    let r = f.ino("ref");
    f.fs.write_at(r, 0, 0, b"mount-ref\n").unwrap();
    assert_eq!(f.fs.read_at(r, 0, 0, 4096).unwrap(), b"mount-ref\n");
    std::thread::sleep(awcpfs::mount::fs::WRITE_QUIET * 3);
    assert_eq!(f.sync().changes, 1);
    assert_eq!(std::fs::read(f.root.join("ref")).unwrap(), b"mount-ref\n");
    std::fs::write(f.root.join("ref"), b"delegator-ref, longer\n").unwrap();
    apply_event_for(&f, &events, "ref");
    assert_eq!(
        f.fs.read_at(r, 0, 0, 4096).unwrap(),
        b"delegator-ref, longer\n"
    );
    f.fs.write_at(r, 0, 0, b"D").unwrap();
    assert_eq!(
        f.fs.read_at(r, 0, 0, 4096).unwrap(),
        b"Delegator-ref, longer\n"
    );
    std::thread::sleep(awcpfs::mount::fs::WRITE_QUIET * 3);
    assert_eq!(f.sync().changes, 1);
    assert_eq!(
        std::fs::read(f.root.join("ref")).unwrap(),
        b"Delegator-ref, longer\n"
    );
}

#[test]
fn a_fetch_after_reads_of_a_files_first_blocks_does_not_ask_for_them_again() {
    // 5 MiB in 4 KiB blocks. Its first 64 KiB are read without a handle (16 blocks, fetched
    // in one ranged read and kept), then the file is opened: the fetch that makes it local
    // takes those blocks from memory and asks only for the rest.
    let big = distinct_blocks(5 << 20, 11);
    let (f, _gated) = gated_fixture(|r| std::fs::write(r.join("big.bin"), &big).unwrap(), true);
    f.fs.set_no_open();
    let ino = f.ino("big.bin");
    let fetched = || f.fs.stats().snapshot().bytes_fetched;
    let before = fetched();
    read_run(&f, ino, &big, 0, 64 << 10);
    assert_eq!(fetched() - before, 64 << 10);
    let fh =
        f.fs.open(ino, OpenMode::from_flags(libc::O_RDONLY))
            .unwrap();
    assert_eq!(read_whole(&f, ino, fh, big.len()), big);
    assert_eq!(
        fetched() - before,
        big.len() as u64,
        "bytes fetched for a 5 MiB file whose first 64 KiB had been read"
    );
}

#[test]
fn two_reads_of_one_block_in_flight_fetch_it_once() {
    // A 5 MiB file in 4 KiB blocks, never streamed here: the kernel's read-ahead has
    // several reads of a file in flight, and two that cover the same block while it is
    // being fetched must not both ask for it.
    let big = distinct_blocks(5 << 20, 7);
    let (f, gated) = gated_fixture(|r| std::fs::write(r.join("big.bin"), &big).unwrap(), true);
    f.fs.set_no_open();
    let ino = f.ino("big.bin");
    // Hold every fetch but those asking for the first block (which nothing reads here).
    gated.shut(&big[..4096]);
    let fetches = || gated.fetches.load(std::sync::atomic::Ordering::SeqCst);
    let before = fetches();
    let read = |off: u64, len: u32| {
        let fs = f.fs.clone();
        std::thread::spawn(move || fs.read_at(ino, 0, off, len))
    };
    let (a_off, b_off) = (3u64 << 20, (3u64 << 20) + 1000);
    let a = read(a_off, 8192);
    std::thread::sleep(Duration::from_millis(200));
    let b = read(b_off, 2000);
    std::thread::sleep(Duration::from_millis(200));
    gated.release();
    let a = a.join().unwrap().unwrap();
    let b = b.join().unwrap().unwrap();
    assert_eq!(a, &big[a_off as usize..a_off as usize + 8192]);
    assert_eq!(b, &big[b_off as usize..b_off as usize + 2000]);
    assert_eq!(
        fetches() - before,
        1,
        "the second read asked again for a block the first was fetching"
    );
}

#[test]
fn a_sequential_reader_of_a_large_file_gets_blocks_fetched_ahead_and_none_twice() {
    // 5 MiB in 4 KiB blocks, not streamed (`first`): read from one end to the other in
    // 4 KiB reads, as the kernel reads a file in pieces of a block, it costs a fraction of
    // a request per block, and every block is fetched once.
    let big = distinct_blocks(5 << 20, 13);
    let (f, gated) = gated_fixture(|r| std::fs::write(r.join("big.bin"), &big).unwrap(), true);
    f.fs.set_no_open();
    f.fs.set_hydrate_policy(HydratePolicy::First);
    let ino = f.ino("big.bin");
    let fetched = || f.fs.stats().snapshot().bytes_fetched;
    let fetches = || gated.fetches.load(std::sync::atomic::Ordering::SeqCst);
    let (bytes0, requests0) = (fetched(), fetches());
    let blocks = big.len() / 4096;
    for b in 0..blocks {
        let got = f.fs.read_at(ino, 0, (b * 4096) as u64, 4096).unwrap();
        assert_eq!(got, &big[b * 4096..(b + 1) * 4096], "block {b}");
    }
    assert_eq!(
        fetched() - bytes0,
        big.len() as u64,
        "a block was fetched twice"
    );
    // Each request for blocks ahead brings half a window (4) or more: about one request
    // per 4 blocks; one per block without read-ahead.
    let requests = fetches() - requests0;
    assert!(
        requests <= blocks / 3,
        "{requests} fetch requests for {blocks} blocks read in order"
    );

    // A reader that jumps about (397 blocks on each time) gets nothing it does not read.
    let (f, _gated) = gated_fixture(|r| std::fs::write(r.join("big.bin"), &big).unwrap(), true);
    f.fs.set_no_open();
    f.fs.set_hydrate_policy(HydratePolicy::First);
    let ino = f.ino("big.bin");
    let fetched = || f.fs.stats().snapshot().bytes_fetched;
    let before = fetched();
    for i in 0..200 {
        let b = (i * 397) % blocks;
        let got = f.fs.read_at(ino, 0, (b * 4096) as u64, 4096).unwrap();
        assert_eq!(got, &big[b * 4096..(b + 1) * 4096], "block {b}");
    }
    assert_eq!(
        fetched() - before,
        200 * 4096,
        "blocks fetched that no read asked for"
    );
}

/// `len` pseudo-random bytes (xorshift from `seed`): no two 4 KiB blocks alike, unlike a
/// multiplicative pattern, whose bytes repeat every few blocks.
fn distinct_blocks(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
