//! Faults between the mount and the export, injected by a TCP proxy in the test: a blackholed
//! network makes reads fail with EIO after the request deadline (never a hang), and
//! everything works again once the network returns; writes made meanwhile are committed
//! exactly once. And a full disk under the mount's state gives the writer ENOSPC without
//! corrupting anything.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::{Mount, MountConfig};
use awcpfs::testing::fuse_available;

const PASS: u8 = 0;
const BLACKHOLE: u8 = 1;
/// Connections are cut (reset) as soon as they carry anything.
const RESET: u8 = 2;
/// Every chunk is held back 150 ms.
const DELAY: u8 = 3;

/// A TCP proxy whose mode can be switched: pass bytes through, or swallow them (blackhole:
/// connections are accepted and then nothing ever comes back).
async fn proxy(target: std::net::SocketAddr, mode: Arc<AtomicU8>) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            let mode = mode.clone();
            tokio::spawn(async move {
                if mode.load(Ordering::SeqCst) == RESET {
                    // Linger 0: closing sends RST.
                    let _ = nix::sys::socket::setsockopt(
                        &inbound,
                        nix::sys::socket::sockopt::Linger,
                        &libc::linger {
                            l_onoff: 1,
                            l_linger: 0,
                        },
                    );
                    return;
                }
                if mode.load(Ordering::SeqCst) == BLACKHOLE {
                    // Hold the connection open and say nothing.
                    let mut sink = [0u8; 4096];
                    use tokio::io::AsyncReadExt;
                    while let Ok(n) = inbound.read(&mut sink).await {
                        if n == 0 {
                            break;
                        }
                    }
                    return;
                }
                let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                // Forward chunk by chunk, swallowing everything while the mode is blackhole,
                // so pooled connections go dark too.
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                let m2 = mode.clone();
                tokio::spawn(pump(ri, wo, mode));
                tokio::spawn(pump(ro, wi, m2));
            });
        }
    });
    addr
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: Arc<AtomicU8>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        match mode.load(Ordering::SeqCst) {
            BLACKHOLE => continue,
            // Cut the connection: dropping both halves closes it.
            RESET => return,
            DELAY => tokio::time::sleep(Duration::from_millis(150)).await,
            _ => {}
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

struct Setup {
    _tmp: tempfile::TempDir,
    src: std::path::PathBuf,
    mnt: std::path::PathBuf,
    mount: Mount,
    mode: Arc<AtomicU8>,
    lease: Arc<Lease>,
    /// Direct address of the export (not through the proxy).
    export_addr: std::net::SocketAddr,
    _rt: tokio::runtime::Runtime,
}

fn setup(state_dir: Option<&Path>) -> Setup {
    setup_with(state_dir, Duration::from_secs(600))
}

fn setup_with(state_dir: Option<&Path>, ttl: Duration) -> Setup {
    setup_full(state_dir, ttl, false)
}

/// [`setup_with`], with the kernel's writeback cache on (`writeback_cache`).
fn setup_full(state_dir: Option<&Path>, ttl: Duration, writeback_cache: bool) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(src.join("cold")).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    // Over the background hydration threshold, so they stay remote until opened.
    for i in 0..4 {
        std::fs::write(src.join(format!("cold/big{i}")), vec![i as u8; 400_000]).unwrap();
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let registry = ExportRegistry::new();
    let lease = Arc::new(Lease::grant(
        Arc::new(SystemClock::new()),
        LeaseTerms {
            ttl,
            max_ttl: Duration::from_secs(600),
            flush_grace: Duration::from_secs(5),
        },
    ));
    let export = registry
        .register(
            "faults".into(),
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
    let mode = Arc::new(AtomicU8::new(PASS));
    let (addr, export_addr) = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        let router = registry.router();
        tokio::spawn(async move { axum::serve(l, router).await });
        (proxy(a, mode.clone()).await, a)
    });
    let state = state_dir
        .map(Path::to_path_buf)
        .unwrap_or_else(|| tmp.path().join("state"));
    let mut cfg = MountConfig::new(&format!("http://{addr}"), "faults", "tok", &mnt, &state);
    cfg.manifest_digest = Some(export.manifest_digest());
    // As if the Executor's wall clock ran years behind: the handle's expiresAt looks far
    // away, and only the remaining time (counted on the monotonic clock) bounds the lease.
    cfg.expires_at = Some("2099-01-01T00:00:00.000Z".into());
    cfg.remaining = Some(ttl);
    cfg.request_timeout = Duration::from_secs(2);
    cfg.kernel.writeback_cache = writeback_cache;
    let mount = Mount::start(cfg).unwrap();
    let s = Setup {
        _tmp: tmp,
        src,
        mnt,
        mount,
        mode,
        lease,
        export_addr,
        _rt: rt,
    };
    assert_eq!(s.mount.fs().writeback_cache(), writeback_cache);
    assert_eq!(s.mount.status().writeback_cache, writeback_cache);
    s
}

// Unmount at the end of every test, passed or failed (after a test's own end this waits
// for nothing): a mount left behind outlives the test process as a dead FUSE mount.
impl Drop for Setup {
    fn drop(&mut self) {
        self.mount.end(awcpfs::mount::EndReason::Unmounted, None);
    }
}

#[test]
fn a_partitioned_executor_fences_itself_when_its_lease_runs_out() {
    // The Executor's wall clock is skewed (see `setup_with`): the lease still ends on time.
    if !fuse_available() {
        return;
    }
    let s = setup_with(None, Duration::from_secs(3));
    std::fs::write(s.mnt.join("before.txt"), "before\n").unwrap();
    // The network goes dark: the export cannot tell the mount that the lease ended.
    s.mode.store(BLACKHOLE, Ordering::SeqCst);
    let started = Instant::now();
    let mountinfo = |p: &Path| {
        let p = p.display().to_string();
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(p.as_str()))
    };
    while mountinfo(&s.mnt) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a partitioned mount outlived its 3 s lease: {:?}",
            started.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        std::fs::metadata(s.mnt.join("before.txt")).is_err(),
        "still reachable"
    );
    // The final flush then tries within its budget and gives up; what it could not write
    // is kept (unsynced), never dropped.
    let reason = s.mount.wait(Duration::from_secs(15));
    assert_eq!(reason, Some(awcpfs::mount::EndReason::Expired));
}

// Regression guard for "served before the revoke or refused after it, never after": a long
// /blocks answer stops at the revoke instead of streaming the rest.
#[test]
fn a_revoke_cuts_a_long_block_answer_short() {
    if !fuse_available() {
        return;
    }
    let s = setup(None);
    let blocks: Vec<String> = (0..4)
        .map(|i| blake3::hash(&vec![i as u8; 400_000]).to_hex().to_string())
        .collect();
    // Ask for the same blocks many times over: a long answer (about 800 MB).
    let hashes: Vec<String> = blocks.iter().cycle().take(2000).cloned().collect();
    let url = format!("http://{}/v1/exports/faults/blocks", s.export_addr);
    let mut resp = ureq::post(&url)
        .set("Authorization", "Bearer tok")
        .send_json(serde_json::json!({ "hashes": hashes }))
        .unwrap()
        .into_reader();
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0usize;
    while got < 4 << 20 {
        let n = std::io::Read::read(&mut resp, &mut buf).unwrap();
        assert!(n > 0, "answer ended early");
        got += n;
    }
    s.lease.revoke(false);
    loop {
        match std::io::Read::read(&mut resp, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    let full = 2000 * (36 + 400_000);
    assert!(
        got < full / 2,
        "{got} of {full} bytes served, most after the revoke"
    );
}

#[test]
fn a_blackholed_network_fails_reads_in_bounded_time_and_recovers() {
    if !fuse_available() {
        return;
    }
    let s = setup(None);
    s.mode.store(BLACKHOLE, Ordering::SeqCst);
    let started = Instant::now();
    let err = match std::fs::read(s.mnt.join("cold/big0")) {
        Ok(data) => panic!("read {} bytes through a blackholed network", data.len()),
        Err(e) => e,
    };
    let took = started.elapsed();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(
        took < Duration::from_secs(10),
        "a read waited {took:?} on a dead network"
    );
    // Writes while the network is down are journaled and retried.
    std::fs::write(s.mnt.join("written-offline.txt"), "offline\n").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(!s.src.join("written-offline.txt").exists());

    s.mode.store(PASS, Ordering::SeqCst);
    assert_eq!(
        std::fs::read(s.mnt.join("cold/big0")).unwrap(),
        vec![0u8; 400_000]
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    while !s.src.join("written-offline.txt").exists() {
        assert!(
            Instant::now() < deadline,
            "the offline write never reached the Delegator"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        std::fs::read_to_string(s.src.join("written-offline.txt")).unwrap(),
        "offline\n"
    );
    s.mount.finish();
    let names: Vec<_> = std::fs::read_dir(&s.src)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        !names
            .iter()
            .any(|n| n.to_string_lossy().contains("awcp-conflict")),
        "a retried commit was applied twice: {names:?}"
    );
    assert!(
        s.mount.stats().sync_errors > 0,
        "the outage was not noticed"
    );
    assert!(!s.mount.unsynced());
}

#[test]
fn resets_outlasting_the_read_timeout_fail_and_a_slow_network_only_slows_things_down() {
    if !fuse_available() {
        return;
    }
    let s = setup(None);
    // Connections reset for longer than the read timeout (2 s): the read retries them
    // within it, then fails with EIO (not at once, never later than a deadline and slack).
    s.mode.store(RESET, Ordering::SeqCst);
    let started = Instant::now();
    match std::fs::read(s.mnt.join("cold/big1")) {
        Ok(data) => panic!("read {} bytes through reset connections", data.len()),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}"),
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(4),
        "{took:?}"
    );
    std::fs::write(s.mnt.join("during-resets.txt"), "reset\n").unwrap();
    // A slow network: everything works, just later.
    s.mode.store(DELAY, Ordering::SeqCst);
    assert_eq!(
        std::fs::read(s.mnt.join("cold/big2")).unwrap(),
        vec![2u8; 400_000]
    );
    std::fs::write(s.mnt.join("while-slow.txt"), "slow\n").unwrap();
    s.mode.store(PASS, Ordering::SeqCst);
    s.mount.finish();
    assert!(!s.mount.unsynced());
    assert_eq!(
        std::fs::read_to_string(s.src.join("during-resets.txt")).unwrap(),
        "reset\n"
    );
    assert_eq!(
        std::fs::read_to_string(s.src.join("while-slow.txt")).unwrap(),
        "slow\n"
    );
    let names: Vec<_> = std::fs::read_dir(&s.src)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        !names
            .iter()
            .any(|n| n.to_string_lossy().contains("awcp-conflict")),
        "a retried commit was applied twice: {names:?}"
    );
}

#[test]
fn a_full_disk_gives_the_writer_enospc_and_nothing_breaks() {
    full_disk(false);
}

/// Under the writeback cache `write(2)` only fills the kernel's pages: the mount's
/// `ENOSPC` comes back from `fsync` (and `close`), the calls that promise the data.
#[test]
fn wbcache_a_full_disk_gives_the_writer_enospc_at_fsync_and_nothing_breaks() {
    full_disk(true);
}

fn full_disk(writeback_cache: bool) {
    if !fuse_available() {
        return;
    }
    let small = tempfile::tempdir().unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
        .arg(small.path())
        .status()
        .unwrap();
    assert!(mounted.success());
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(self.0)
                .status();
        }
    }
    let _guard = Unmount(small.path());
    let s = setup_full(
        Some(&small.path().join("state")),
        Duration::from_secs(600),
        writeback_cache,
    );
    std::fs::write(s.mnt.join("small.txt"), "fits\n").unwrap();
    let mut huge = std::fs::File::create(s.mnt.join("huge.bin")).unwrap();
    let err = match std::io::Write::write_all(&mut huge, &vec![7u8; 4 << 20]) {
        Ok(()) if writeback_cache => huge
            .sync_all()
            .expect_err("fsync of 4 MiB on a 2 MiB disk succeeded"),
        Ok(()) => panic!("4 MiB written to a 2 MiB disk"),
        Err(e) => e,
    };
    drop(huge);
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    // Space comes back: writing works again, and what fit is intact. The kernel opens
    // files itself (no-open), so the mount keeps an unlinked file for descriptors it is not
    // told about until the kernel forgets the inode, which it does right after the unlink.
    std::fs::remove_file(s.mnt.join("huge.bin")).unwrap();
    // Checked through `fsync`: under the writeback cache a failed write-back shows there
    // (and at `close`, whose answer `std::fs::write` drops), not in `write(2)`.
    let write_synced = |path: &Path, data: &[u8]| -> std::io::Result<()> {
        let mut f = std::fs::File::create(path)?;
        std::io::Write::write_all(&mut f, data)?;
        f.sync_all()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Err(e) = write_synced(&s.mnt.join("after.txt"), b"after\n") {
        assert!(
            Instant::now() < deadline,
            "no space after removing the file that filled the disk: {e}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        std::fs::read_to_string(s.mnt.join("small.txt")).unwrap(),
        "fits\n"
    );
    s.mount.finish();
    assert!(!s.mount.unsynced());
    assert_eq!(
        std::fs::read_to_string(s.src.join("small.txt")).unwrap(),
        "fits\n"
    );
    assert_eq!(
        std::fs::read_to_string(s.src.join("after.txt")).unwrap(),
        "after\n"
    );
    assert!(!s.src.join("huge.bin").exists());
}
