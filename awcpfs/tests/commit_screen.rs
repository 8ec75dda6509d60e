//! The export's commit screen with the mount's write-back, without a kernel: a real export
//! on loopback with a test screen installed, operations called on `AwcpFs`, sync rounds.
//! A held write is not applied (the rest of the commit is), is not sent again while the
//! file is unchanged (even when the whole tree is compared), is sent again once the file
//! changes or the path is released, and shows in the mount's status while held.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::screen::{CommitScreen, Screening, Watched};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::content::OpenMode;
use awcpfs::mount::fs::{AwcpFs, FsOptions};
use awcpfs::mount::inode::{InodeTable, ROOT_INO};
use awcpfs::mount::journal::Journal;
use awcpfs::mount::remote::{HttpRemote, Remote};
use awcpfs::mount::stats::Stats;
use awcpfs::mount::sync::{SyncSignal, Syncer};

/// Holds writes of `m.py` whose content contains `BAD`, or any write of it while `block`
/// is set; counts what it was asked.
#[derive(Debug, Default)]
struct TestScreen {
    asked: AtomicUsize,
    block: AtomicBool,
}

impl CommitScreen for TestScreen {
    fn watched(&self, worker: &str) -> Watched {
        assert_eq!(worker, "w1");
        Watched {
            paths: ["m.py".to_owned()].into_iter().collect(),
            suffixes: vec![],
        }
    }

    fn screen(&self, worker: &str, path: &str, content: &[u8]) -> Screening {
        assert_eq!(
            (worker, path),
            ("w1", "m.py"),
            "only watched paths are asked"
        );
        self.asked.fetch_add(1, Ordering::SeqCst);
        let bad = content.windows(3).any(|w| w == b"BAD");
        if bad || self.block.load(Ordering::SeqCst) {
            Screening::Hold {
                reason: "breaks its contract".into(),
                report: Some(serde_json::json!({"symbol": "f", "constraint": "parameters"})),
            }
        } else {
            Screening::Pass
        }
    }
}

struct Fixture {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    fs: Arc<AwcpFs>,
    syncer: Syncer,
    screen: Arc<TestScreen>,
    _rt: tokio::runtime::Runtime,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let state = tmp.path().join("state");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(state.join("upper")).unwrap();
    std::fs::write(root.join("m.py"), "STUB\n").unwrap();
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
    let export = registry
        .register(
            "e1".into(),
            "tok".into(),
            ExportConfig {
                root: root.clone(),
                read_only: false,
                block_size: 4096,
                staging_dir: tmp.path().join("staging"),
            },
            lease,
        )
        .unwrap();
    let screen = Arc::new(TestScreen::default());
    export.set_screen("w1", screen.clone());
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let router = registry.router();
    rt.spawn(async move { axum::serve(listener, router).await });
    let remote: Arc<dyn Remote> = Arc::new(HttpRemote::new(
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
            read_only: false,
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
        fs,
        syncer,
        screen,
        _rt: rt,
    }
}

fn o(s: &str) -> &OsStr {
    OsStr::new(s)
}

impl Fixture {
    /// Replace the content of a file at the root (created if absent).
    fn put(&self, name: &str, data: &[u8]) {
        let fh = match self.fs.lookup(ROOT_INO, o(name)) {
            Ok(attr) => self
                .fs
                .open(
                    attr.ino.0,
                    OpenMode {
                        write: true,
                        truncate: true,
                        ..Default::default()
                    },
                )
                .unwrap(),
            Err(_) => {
                self.fs
                    .create(ROOT_INO, o(name), 0o644, libc::O_WRONLY | libc::O_CREAT)
                    .unwrap()
                    .1
            }
        };
        self.fs.write(fh, 0, data).unwrap();
        self.fs.flush(fh).unwrap();
        self.fs.release(fh).unwrap();
    }

    fn on_export(&self, name: &str) -> String {
        std::fs::read_to_string(self.root.join(name)).unwrap_or_default()
    }

    fn asked(&self) -> usize {
        self.screen.asked.load(Ordering::SeqCst)
    }
}

#[test]
fn a_held_write_stays_on_the_mount_is_not_resent_unchanged_and_goes_once_fixed() {
    let f = fixture();
    f.put("m.py", b"def f(BAD): ...\n");
    f.put("other.txt", b"other\n");
    let r = f.syncer.round(false).unwrap();
    assert_eq!(r.held.len(), 1, "{r:?}");
    assert_eq!(r.held[0].path, "m.py");
    assert_eq!(r.held[0].reason, "breaks its contract");
    assert_eq!(
        r.held[0].report.as_ref().unwrap()["constraint"],
        "parameters"
    );
    assert!(r.conflicts.is_empty(), "a hold is not a conflict: {r:?}");
    assert_eq!(f.on_export("m.py"), "STUB\n", "the held write was applied");
    assert!(
        !f.root.read_dir().unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains("conflict")),
        "a held write is not kept beside"
    );
    assert_eq!(
        f.on_export("other.txt"),
        "other\n",
        "the rest of the commit"
    );
    assert_eq!(f.asked(), 1);
    let status = f.fs.stats().snapshot();
    assert_eq!(status.held.len(), 1);
    assert_eq!(status.held[0].path, "m.py");
    assert_eq!(f.syncer.held_paths(), ["m.py"]);

    // Unchanged: not sent again, even when the whole tree is compared.
    f.syncer.compare_everything_next();
    let r = f.syncer.round(false).unwrap();
    assert_eq!(r.changes, 0, "{r:?}");
    assert_eq!(r.held_unchanged, 1);
    assert_eq!(f.asked(), 1, "sent again unchanged");
    assert_eq!(f.fs.stats().snapshot().held.len(), 1, "still held");

    // Changed but still bad: sent once more, held again.
    f.put("m.py", b"def f(BAD, x): ...\n");
    let r = f.syncer.round(false).unwrap();
    assert_eq!(r.held.len(), 1);
    assert_eq!(f.asked(), 2);
    assert_eq!(f.on_export("m.py"), "STUB\n");

    // Fixed: written back (its base is still the export's content), no longer held.
    f.put("m.py", b"def f(a): return a\n");
    let r = f.syncer.round(false).unwrap();
    assert!(r.held.is_empty() && r.conflicts.is_empty(), "{r:?}");
    assert_eq!(f.on_export("m.py"), "def f(a): return a\n");
    assert!(f.fs.stats().snapshot().held.is_empty());
    assert!(f.syncer.held_paths().is_empty());
    assert_eq!(f.syncer.round(false).unwrap().changes, 0);
}

#[test]
fn removing_a_held_file_removes_it_at_the_export_and_ends_the_hold() {
    let f = fixture();
    f.put("m.py", b"BAD\n");
    assert_eq!(f.syncer.round(false).unwrap().held.len(), 1);
    f.fs.unlink(ROOT_INO, o("m.py")).unwrap();
    let r = f.syncer.round(false).unwrap();
    assert!(r.held.is_empty() && r.conflicts.is_empty(), "{r:?}");
    assert!(
        !f.root.join("m.py").exists(),
        "the removal was not written back"
    );
    assert!(
        f.syncer.held_paths().is_empty(),
        "a removed file is still held: the mount would never count as written back"
    );
    assert!(f.fs.stats().snapshot().held.is_empty());
}

#[test]
fn a_released_path_is_sent_again_without_a_change() {
    let f = fixture();
    f.screen.block.store(true, Ordering::SeqCst);
    f.put("m.py", b"def f(a): return a\n");
    assert_eq!(f.syncer.round(false).unwrap().held.len(), 1);
    assert_eq!(f.syncer.round(false).unwrap().changes, 0);
    assert_eq!(f.on_export("m.py"), "STUB\n");
    // The reason is gone (the worker acknowledged): the export releases the path.
    f.screen.block.store(false, Ordering::SeqCst);
    f.syncer.release(&["m.py".to_owned()]);
    assert!(f.fs.stats().snapshot().held.is_empty());
    let r = f.syncer.round(false).unwrap();
    assert_eq!(r.files_written, 1, "{r:?}");
    assert_eq!(f.on_export("m.py"), "def f(a): return a\n");
    assert_eq!(f.asked(), 2);
}
