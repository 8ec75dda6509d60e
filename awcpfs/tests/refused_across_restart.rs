//! Refused events survive a restart of the export (issue 33: "held marks and refused events
//! survive a daemon restart").
//!
//! A *refused event* is a Delegator-side change the mount left alone because it had a change
//! of its own at that path (`Syncer::refused`, see `mount/upstream.rs`): it is remembered and
//! judged again after each write-back round, so that when the mount's change loses to the
//! Delegator's, the mount shows the Delegator's version. Here the export that described the
//! change is stopped — its runtime, listener and connections gone, as when the daemon stops —
//! and registered again on the same address from the same staging directory, as a restarted
//! daemon does. The restarted export has no event for that path (its change feed starts from
//! the tree as it finds it), and it answers commits as an export from before
//! `CommitResult::current` (so the refused event is all the mount has to go on): the mount
//! must still show the Delegator's version after its write-back loses. The refused event
//! lives in the mount, which a daemon restart does not touch; this test keeps it so.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcp_protocol::dataplane::{ChangeSet, CommitResult, ExportEvent, Manifest, ManifestEntry};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::content::{OpenMode, SetAttr};
use awcpfs::mount::fs::{AwcpFs, FsOptions};
use awcpfs::mount::inode::ROOT_INO;
use awcpfs::mount::journal::Journal;
use awcpfs::mount::remote::{HttpRemote, Remote, RemoteError, StreamItem};
use awcpfs::mount::stats::Stats;
use awcpfs::mount::sync::{SyncSignal, Syncer};

/// The export's side: its runtime serves one registry on `addr`.
struct Server {
    rt: tokio::runtime::Runtime,
}

impl Server {
    /// Stops serving: every task of the runtime — the listener, each connection, each
    /// event stream — ends.
    fn stop(self) {
        self.rt.shutdown_timeout(Duration::from_secs(5));
    }
}

/// Registers export `e1` of `root` (staging in `staging`) and serves it on `addr` (`None`:
/// a free port). Returns the server and its address.
fn serve(root: &Path, staging: &Path, addr: Option<std::net::SocketAddr>) -> (Server, String) {
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
                root: root.to_owned(),
                read_only: false,
                block_size: 4096,
                staging_dir: staging.to_owned(),
            },
            lease,
        )
        .unwrap();
    let bind = addr.unwrap_or_else(|| "127.0.0.1:0".parse().unwrap());
    // The old listener's port may take a moment to be free again.
    let listener = (0..100)
        .find_map(|_| {
            rt.block_on(tokio::net::TcpListener::bind(bind))
                .map_err(|_| std::thread::sleep(Duration::from_millis(50)))
                .ok()
        })
        .expect("the export's address is free again");
    let local = listener.local_addr().unwrap();
    let router = registry.router();
    rt.spawn(async move { axum::serve(listener, router).await });
    (Server { rt }, format!("http://{local}"))
}

/// A remote that answers commits as an export from before `current` did.
struct WithoutCurrent(Arc<dyn Remote>);

impl Remote for WithoutCurrent {
    fn manifest(&self) -> Result<(Manifest, String), RemoteError> {
        self.0.manifest()
    }
    fn fetch_blocks(&self, hashes: &[String]) -> Result<Vec<Vec<u8>>, RemoteError> {
        self.0.fetch_blocks(hashes)
    }
    fn missing(&self, hashes: &[String]) -> Result<Vec<String>, RemoteError> {
        self.0.missing(hashes)
    }
    fn upload(&self, blocks: &[([u8; 32], &[u8])]) -> Result<(), RemoteError> {
        self.0.upload(blocks)
    }
    fn commit(&self, changes: &ChangeSet) -> Result<CommitResult, RemoteError> {
        let mut r = self.0.commit(changes)?;
        r.current = None;
        Ok(r)
    }
    fn renew(&self) -> Result<ExportEvent, RemoteError> {
        self.0.renew()
    }
    fn events(&self) -> Result<Box<dyn Iterator<Item = StreamItem> + Send>, RemoteError> {
        self.0.events()
    }
}

fn read(fs: &AwcpFs, ino: u64) -> Vec<u8> {
    let fh = fs
        .open(
            ino,
            OpenMode {
                read: true,
                ..Default::default()
            },
        )
        .unwrap();
    let data = fs.read(fh, 0, 1 << 20).unwrap();
    fs.release(fh).unwrap();
    data
}

fn lookup(fs: &AwcpFs, path: &str) -> u64 {
    path.split('/').fold(ROOT_INO, |ino, part| {
        fs.lookup(ino, std::ffi::OsStr::new(part)).unwrap().ino.0
    })
}

/// The first `changed` event of `remote`'s stream listing `path`, with those before it.
fn events_until(remote: &dyn Remote, path: &str) -> Vec<(u64, Vec<ManifestEntry>, Vec<String>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let items = remote.events().expect("the event stream");
    let want = path.to_owned();
    std::thread::spawn(move || {
        for item in items {
            if let StreamItem::Event(ExportEvent::Changed {
                seq,
                entries,
                removed,
            }) = item
            {
                let done = entries.iter().any(|e| e.path == want) || removed.contains(&want);
                if tx.send((seq, entries, removed)).is_err() || done {
                    return;
                }
            }
        }
    });
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let ev = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no changed event for {path}"));
        let done = ev.1.iter().any(|e| e.path == path) || ev.2.iter().any(|p| p == path);
        out.push(ev);
        if done {
            return out;
        }
    }
}

#[test]
fn a_refused_event_is_shown_after_the_export_restarts_and_the_mounts_change_loses() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let staging = tmp.path().join("staging");
    let state: PathBuf = tmp.path().join("state");
    std::fs::create_dir_all(root.join("src")).unwrap();
    std::fs::create_dir_all(state.join("upper")).unwrap();
    std::fs::write(root.join("src/a.txt"), "alpha\n").unwrap();

    let (server, url) = serve(&root, &staging, None);
    let http: Arc<dyn Remote> =
        Arc::new(HttpRemote::new(&url, "e1", "tok", Duration::from_secs(10)));
    let (manifest, _) = http.manifest().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(WithoutCurrent(http.clone()));
    let table = awcpfs::mount::inode::InodeTable::from_manifest(&manifest, 0, 0).unwrap();
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
    assert_eq!(read(&fs, lookup(&fs, "src/a.txt")), b"alpha\n");

    // The mount's own change (a new modification time, as `touch` makes), then the
    // Delegator's rewrite: its event meets the mount's change and is refused.
    let t = std::time::UNIX_EPOCH + Duration::from_secs(1_500_000_000);
    fs.setattr(
        lookup(&fs, "src/a.txt"),
        SetAttr {
            mtime: Some(t),
            ..Default::default()
        },
    )
    .unwrap();
    std::fs::write(root.join("src/a.txt"), "the Delegator's\n").unwrap();
    let mut kept_local = 0;
    for (seq, entries, removed) in events_until(&*http, "src/a.txt") {
        let (_, report) = syncer.apply_upstream(seq, &entries, &removed);
        kept_local += report.kept_local;
    }
    assert_eq!(kept_local, 1, "the event met the mount's own change");
    assert_eq!(read(&fs, lookup(&fs, "src/a.txt")), b"alpha\n");

    // The export stops (its runtime, listener and connections end with it) and is
    // registered again, on the same address, from the same staging directory.
    server.stop();
    let addr = url.trim_start_matches("http://").parse().unwrap();
    let (_server, again) = serve(&root, &staging, Some(addr));
    assert_eq!(again, url);

    // The write-back goes to the restarted export and loses to the Delegator's version
    // (the base it names is gone): the mount shows the Delegator's version, which only
    // the refused event described.
    let report = syncer.round(false).unwrap();
    assert_eq!(report.conflicts.len(), 1, "{report:?}");
    assert_eq!(
        std::fs::read(root.join("src/a.txt")).unwrap(),
        b"the Delegator's\n"
    );
    assert_eq!(
        read(&fs, lookup(&fs, "src/a.txt")),
        b"the Delegator's\n",
        "the mount shows what the refused event described"
    );
    let next = syncer.round(false).unwrap();
    assert_eq!((next.changes, next.conflicts.len()), (0, 0), "{next:?}");
}
