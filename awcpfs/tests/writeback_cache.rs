//! The kernel's writeback cache (`awcpfs mount --writeback-cache`) keeps the mount's
//! promises, on a real FUSE mount of an in-process export:
//!
//! * many small writes reach the mount as a few large ones, and `close` still hands them
//!   over (written back to the Delegator);
//! * sizes and times the kernel keeps for a written file agree with the mount's;
//! * a revocation writes back what the kernel still held as dirty pages, within the flush
//!   grace, although the file was never closed nor synced;
//! * a Delegator-side change under a file the kernel caches (its pages, its size) shows on
//!   the mount, shrinking and growing, for a file fetched from the Delegator and for one
//!   written on the mount.
//!
//! (`kill -9` of the mount with the writeback cache is in `crash_recovery.rs`, fsx and
//! pjdfstest with it in `posix_suites.rs`.)

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::{EndReason, Mount, MountConfig};
use awcpfs::testing::fuse_available;

struct Setup {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    mnt: PathBuf,
    mount: Mount,
    lease: Arc<Lease>,
    _rt: tokio::runtime::Runtime,
}

// Unmount at the end of every test, passed or failed: a mount left behind outlives the
// test process as a dead FUSE mount.
impl Drop for Setup {
    fn drop(&mut self) {
        self.mount.end(awcpfs::mount::EndReason::Unmounted, None);
    }
}

/// An export of a small tree and a mount of it with the writeback cache on.
fn setup() -> Setup {
    setup_with(|_| {})
}

/// [`setup`], with the mount's configuration adjusted by `adjust`.
fn setup_with(adjust: impl FnOnce(&mut MountConfig)) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    std::fs::write(
        src.join("theirs.txt"),
        "the Delegator's first version, long enough to shrink\n",
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let registry = ExportRegistry::new();
    let lease = Arc::new(Lease::grant(
        Arc::new(SystemClock::new()),
        LeaseTerms {
            ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(600),
            flush_grace: Duration::from_secs(10),
        },
    ));
    let export = registry
        .register(
            "wb".into(),
            "tok".into(),
            ExportConfig {
                root: src.clone(),
                read_only: false,
                block_size: 1 << 20,
                staging_dir: tmp.path().join("staging"),
            },
            lease.clone(),
        )
        .unwrap();
    let addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        let router = registry.router();
        tokio::spawn(async move { axum::serve(l, router).await });
        a
    });
    let state = tmp.path().join("state");
    let mut cfg = MountConfig::new(&format!("http://{addr}"), "wb", "tok", &mnt, &state);
    cfg.manifest_digest = Some(export.manifest_digest());
    cfg.remaining = Some(Duration::from_secs(600));
    cfg.kernel.writeback_cache = true;
    adjust(&mut cfg);
    let mount = Mount::start(cfg).unwrap();
    assert!(
        mount.fs().writeback_cache(),
        "the kernel refused FUSE_WRITEBACK_CACHE"
    );
    assert!(
        mount.status().writeback_cache,
        "status.json does not say so"
    );
    Setup {
        _tmp: tmp,
        src,
        mnt,
        mount,
        lease,
        _rt: rt,
    }
}

fn writes(m: &Mount) -> u64 {
    m.stats().ops.get("write").copied().unwrap_or(0)
}

/// Wait up to 10 s for `f` to hold.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read(p: &Path) -> Option<Vec<u8>> {
    std::fs::read(p).ok()
}

#[test]
fn wbcache_small_writes_reach_the_mount_batched_and_close_writes_them_back() {
    if !fuse_available() {
        return;
    }
    let s = setup();
    let line = b"0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqr\n";
    let mut f = std::fs::File::create(s.mnt.join("many.txt")).unwrap();
    for _ in 0..2000 {
        // One `write(2)` each (`File` does not buffer): 2,000 round trips without the cache.
        f.write_all(line).unwrap();
    }
    // The kernel knows the size while the data is still its own.
    assert_eq!(
        std::fs::metadata(s.mnt.join("many.txt")).unwrap().len(),
        2000 * line.len() as u64
    );
    nix::unistd::close(f).unwrap();
    let n = writes(&s.mount);
    assert!(
        (1..=20).contains(&n),
        "2,000 small writes reached the mount as {n} write requests"
    );
    let want = line.repeat(2000);
    eventually("the Delegator has many.txt", || {
        read(&s.src.join("many.txt")).as_ref() == Some(&want)
    });
}

#[test]
fn wbcache_sizes_and_times_the_kernel_keeps_agree_with_the_mount() {
    if !fuse_available() {
        return;
    }
    let s = setup();
    let p = s.mnt.join("times.txt");
    let mut f = std::fs::File::create(&p).unwrap();
    f.write_all(b"first\n").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    f.write_all(b"and a second line\n").unwrap();
    nix::unistd::close(f).unwrap();
    // An append to an existing file, through another descriptor.
    let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
    f.write_all(b"appended\n").unwrap();
    nix::unistd::close(f).unwrap();
    let kernel = std::fs::metadata(&p).unwrap();
    let ours = s.mount.fs().getattr(kernel.ino()).unwrap();
    assert_eq!(kernel.len(), 33);
    assert_eq!(ours.size, kernel.len(), "the mount's size differs");
    // `close` wrote the kernel's times back with the data.
    assert_eq!(
        ours.mtime,
        kernel.modified().unwrap(),
        "the mount's mtime differs from the one the kernel shows"
    );
    // A truncation through the kernel reaches the mount as such.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(4)
        .unwrap();
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 4);
    assert_eq!(s.mount.fs().getattr(kernel.ino()).unwrap().size, 4);
    assert_eq!(std::fs::read(&p).unwrap(), b"firs");
}

#[test]
fn wbcache_a_revoke_writes_back_pages_the_kernel_held_dirty() {
    if !fuse_available() {
        return;
    }
    let s = setup();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let mut f = std::fs::File::create(s.mnt.join("dirty.bin")).unwrap();
    f.write_all(&data).unwrap();
    // Neither closed nor synced: the data is dirty pages in the kernel (it writes them back
    // on its own only after 30 s), the mount has not seen it.
    assert_eq!(writes(&s.mount), 0, "the kernel wrote back early");
    assert_eq!(
        std::fs::metadata(s.src.join("dirty.bin"))
            .map(|m| m.len())
            .ok(),
        None
    );
    s.lease.revoke(true);
    assert_eq!(
        s.mount.wait(Duration::from_secs(20)),
        Some(EndReason::Revoked)
    );
    assert!(!s.mount.unsynced(), "the final flush left changes behind");
    assert_eq!(
        read(&s.src.join("dirty.bin")).map(|d| d.len()),
        Some(data.len()),
        "the dirty pages did not reach the Delegator"
    );
    assert!(read(&s.src.join("dirty.bin")).unwrap() == data);
    // And access has ended for the descriptor still open.
    assert!(f.write_all(b"more").and_then(|_| f.sync_all()).is_err());
}

#[test]
fn wbcache_a_delegator_change_under_a_cached_file_shows_on_the_mount() {
    if !fuse_available() {
        return;
    }
    let s = setup();
    let on_mount = |name: &str, want: &[u8]| {
        let p = s.mnt.join(name);
        eventually(&format!("the mount shows the Delegator's {name}"), || {
            std::fs::metadata(&p).is_ok_and(|m| m.len() == want.len() as u64)
                && read(&p).as_deref() == Some(want)
        });
    };
    // A file from the Delegator, read (pages and size cached), then shrunk and grown there.
    let theirs = std::fs::read(s.mnt.join("theirs.txt")).unwrap();
    assert!(theirs.starts_with(b"the Delegator's first version"));
    std::fs::write(s.src.join("theirs.txt"), "shorter\n").unwrap();
    on_mount("theirs.txt", b"shorter\n");
    std::fs::write(
        s.src.join("theirs.txt"),
        "a third version, longer than the two before it\n",
    )
    .unwrap();
    on_mount(
        "theirs.txt",
        b"a third version, longer than the two before it\n",
    );
    // A file written on the mount (size and times kept by the kernel), written back, then
    // changed on the Delegator, to a shorter content.
    let mut f = std::fs::File::create(s.mnt.join("mine.txt")).unwrap();
    f.write_all(b"written on the Executor, then edited by the Delegator\n")
        .unwrap();
    nix::unistd::close(f).unwrap();
    eventually("the Delegator has mine.txt", || {
        read(&s.src.join("mine.txt")).as_deref()
            == Some(b"written on the Executor, then edited by the Delegator\n".as_slice())
    });
    // Past the write-back's own echo before the Delegator edits it.
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(s.src.join("mine.txt"), "edited\n").unwrap();
    on_mount("mine.txt", b"edited\n");
    // The mount keeps working on the file afterwards.
    std::fs::write(s.mnt.join("mine.txt"), "written again on the Executor\n").unwrap();
    eventually("the Delegator has the Executor's new mine.txt", || {
        read(&s.src.join("mine.txt")).as_deref()
            == Some(b"written again on the Executor\n".as_slice())
    });
}

#[test]
fn wbcache_appends_land_once_when_the_kernel_writes_a_page_back_twice() {
    if !fuse_available() {
        return;
    }
    // Opens reach the mount (`--track-opens`), which opens its upper file for each. The
    // kernel places appends itself under the cache and writes the page back from offset
    // 0, once at the fsync and again at the close.
    let s = setup_with(|c| c.kernel.no_open = false);
    let p = s.mnt.join("log.txt");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&p)
        .unwrap();
    f.write_all(b"first line\n").unwrap();
    f.sync_all().unwrap();
    f.write_all(b"second line\n").unwrap();
    nix::unistd::close(f).unwrap();
    let want = b"first line\nsecond line\n".to_vec();
    let ino = std::fs::metadata(&p).unwrap().ino();
    assert_eq!(s.mount.fs().getattr(ino).unwrap().size, want.len() as u64);
    // What the mount serves, past the kernel's pages.
    nix::fcntl::posix_fadvise(
        std::fs::File::open(&p).unwrap(),
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .unwrap();
    assert_eq!(read(&p), Some(want.clone()));
    eventually("the Delegator has log.txt once", || {
        read(&s.src.join("log.txt")).as_ref() == Some(&want)
    });
}

#[test]
fn wbcache_a_file_kept_open_reaches_the_delegator_without_a_close() {
    if !fuse_available() {
        return;
    }
    let s = setup();
    // A log a process keeps writing without closing or syncing: the kernel would keep the
    // pages 30 s (`dirty_expire`); the mount has it write them back every second.
    let mut f = std::fs::File::create(s.mnt.join("app.log")).unwrap();
    f.write_all(b"started\n").unwrap();
    let start = Instant::now();
    eventually("the Delegator has the open file's first line", || {
        read(&s.src.join("app.log")).as_deref() == Some(b"started\n".as_slice())
    });
    f.write_all(b"still running\n").unwrap();
    eventually("the Delegator has the open file's second line", || {
        read(&s.src.join("app.log")).as_deref() == Some(b"started\nstill running\n".as_slice())
    });
    let took = start.elapsed();
    // Still open: nothing but the periodic write-back can have sent it.
    nix::unistd::close(f).unwrap();
    assert!(
        took < Duration::from_secs(10),
        "the open file took {took:?} to reach the Delegator"
    );
}
