//! Outages between the mount and the export (issue #17), through the test's own proxy
//! ([`FaultProxy`]): a read that needs the network fails with `EIO` within the read timeout
//! however the kernel retries it; a mount that cannot write back says so in `status.json`
//! until it can again; and a standalone `awcpfs export` restarted with the same state
//! directory keeps serving its delegation, so the mount resumes and `awcpfs recover` works.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::{Mount, MountConfig};
use awcpfs::testing::fuse_available;
use awcpfs::testing::proxy::FaultProxy;

const BIN: &str = env!("CARGO_BIN_EXE_awcpfs");

struct Setup {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    mnt: PathBuf,
    state: PathBuf,
    mount: Mount,
    proxy: FaultProxy,
    _rt: tokio::runtime::Runtime,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.proxy.heal();
        self.mount.end(awcpfs::mount::EndReason::Unmounted, None);
    }
}

/// An export with cold files of three sizes (a small one read through the pack, a
/// medium one fetched whole, a large one streamed), a proxy, and a mount through it with
/// read timeout `timeout` and no background hydration (everything stays cold).
fn setup(timeout: Duration) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    std::fs::write(src.join("small"), vec![1u8; 100_000]).unwrap();
    std::fs::write(src.join("medium"), vec![2u8; 400_000]).unwrap();
    std::fs::write(src.join("large"), vec![3u8; 5 << 20]).unwrap();
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
            "outage".into(),
            "tok".into(),
            ExportConfig {
                root: src.clone(),
                read_only: false,
                block_size: 1 << 20,
                staging_dir: tmp.path().join("staging"),
            },
            lease,
        )
        .unwrap();
    let export_addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        let router = registry.router();
        tokio::spawn(async move { axum::serve(l, router).await });
        a
    });
    let proxy = FaultProxy::start(export_addr).unwrap();
    let state = tmp.path().join("state");
    let mut cfg = MountConfig::new(&proxy.url(), "outage", "tok", &mnt, &state);
    cfg.manifest_digest = Some(export.manifest_digest());
    cfg.request_timeout = timeout;
    // No background hydration (everything stays cold), large files streamed whole.
    cfg.hydrate = awcpfs::mount::hydrate::HydratePolicy::All { max_size: 0 };
    let mount = Mount::start(cfg).unwrap();
    Setup {
        _tmp: tmp,
        src,
        mnt,
        state,
        mount,
        proxy,
        _rt: rt,
    }
}

// Regression: a cold read during a blackhole blocked for the whole outage, or failed only
// after several request deadlines (EIO at 62 s with a 30 s deadline): the kernel reads a
// page again at once after a failed read-ahead, and each attempt waited a deadline of its
// own.
#[test]
fn a_cold_read_in_a_blackhole_fails_with_eio_within_the_read_timeout() {
    if !fuse_available() {
        return;
    }
    let timeout = Duration::from_secs(3);
    let s = setup(timeout);
    s.proxy.set_blackhole(true);
    // One after another: the mount serves FUSE requests with two threads, and a read
    // waiting on the network holds one.
    for name in ["small", "medium", "large"] {
        let started = Instant::now();
        let r = std::fs::read(s.mnt.join(name));
        let took = started.elapsed();
        match r {
            Ok(data) => panic!("{name}: read {} bytes through a blackhole", data.len()),
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{name}: {e}"),
        }
        // One read timeout, plus slack for a loaded machine; a second attempt's deadline
        // would double it.
        assert!(
            took < timeout.mul_f64(1.8),
            "{name}: EIO only after {took:?} with a read timeout of {timeout:?}"
        );
    }
    // The network returns: the same reads work.
    s.proxy.set_blackhole(false);
    std::thread::sleep(awcpfs::mount::content::FAILED_FETCH_MEMO);
    assert_eq!(
        std::fs::read(s.mnt.join("small")).unwrap(),
        vec![1u8; 100_000]
    );
    assert_eq!(
        std::fs::read(s.mnt.join("medium")).unwrap(),
        vec![2u8; 400_000]
    );
    assert_eq!(
        std::fs::read(s.mnt.join("large")).unwrap(),
        vec![3u8; 5 << 20]
    );
}

// Regression (issue 30): a cold read started during a TCP reset failed with EIO after
// 2–54 ms, even when the outage lasted 0.3 s, while a 20 s blackhole was waited out.
#[test]
fn a_cold_read_during_a_short_reset_outage_succeeds() {
    if !fuse_available() {
        return;
    }
    let timeout = Duration::from_secs(5);
    let s = setup(timeout);
    for (name, byte, len) in [
        ("small", 1u8, 100_000),
        ("medium", 2, 400_000),
        ("large", 3, 5 << 20),
    ] {
        let resets_before = s.proxy.resets();
        // Every connection is reset for 0.3 s: the one the read opens, and the ones it
        // opens again at once.
        s.proxy.set_resetting(true);
        let started = Instant::now();
        let reader = {
            let path = s.mnt.join(name);
            std::thread::spawn(move || std::fs::read(path))
        };
        std::thread::sleep(Duration::from_millis(300));
        s.proxy.set_resetting(false);
        let r = reader.join().unwrap();
        let took = started.elapsed();
        let data = r.unwrap_or_else(|e| {
            panic!("{name}: a 0.3 s reset outage failed the read after {took:?}: {e}")
        });
        assert_eq!(data.len(), len, "{name}");
        assert!(data.iter().all(|b| *b == byte), "{name}: wrong bytes");
        assert!(
            s.proxy.resets() > resets_before,
            "{name}: the read never met a reset (the test tested nothing)"
        );
        assert!(took < timeout, "{name}: took {took:?}");
    }
}

// A reset outage longer than the read timeout still ends in EIO, within it (plus slack),
// and not at once.
#[test]
fn a_reset_outage_longer_than_the_read_timeout_fails_the_read_within_it() {
    if !fuse_available() {
        return;
    }
    let timeout = Duration::from_secs(2);
    let s = setup(timeout);
    s.proxy.set_resetting(true);
    let started = Instant::now();
    match std::fs::read(s.mnt.join("medium")) {
        Ok(data) => panic!("read {} bytes through reset connections", data.len()),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}"),
    }
    let took = started.elapsed();
    assert!(
        took >= timeout.mul_f64(0.7) && took < timeout.mul_f64(1.8),
        "EIO after {took:?} with a read timeout of {timeout:?}"
    );
    s.proxy.set_resetting(false);
    std::thread::sleep(awcpfs::mount::content::FAILED_FETCH_MEMO);
    assert_eq!(
        std::fs::read(s.mnt.join("medium")).unwrap(),
        vec![2u8; 400_000]
    );
}

fn status_json(state: &Path) -> serde_json::Value {
    std::fs::read(state.join("status.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

// Regression: while 68–100 sync errors were logged, status.json said `unsynced: false`.
#[test]
fn a_mount_that_cannot_write_back_says_unsynced_until_it_can() {
    if !fuse_available() {
        return;
    }
    let s = setup(Duration::from_secs(2));
    wait_until("status.json", Duration::from_secs(10), || {
        status_json(&s.state)["unsynced"] == false
    });
    s.proxy.set_blackhole(true);
    std::fs::write(s.mnt.join("during.txt"), "written during the outage\n").unwrap();
    wait_until(
        "status.json to say unsynced",
        Duration::from_secs(30),
        || status_json(&s.state)["unsynced"] == true,
    );
    let st = status_json(&s.state);
    let err = st["syncError"].as_str().unwrap_or_default().to_string();
    assert!(
        err.contains("cannot reach the export"),
        "no useful error in status.json: {st}"
    );
    assert!(s.mount.status().unsynced);
    assert!(!s.src.join("during.txt").exists());
    // The network returns: the change goes through and the status says so.
    s.proxy.set_blackhole(false);
    wait_until(
        "the change at the Delegator",
        Duration::from_secs(30),
        || s.src.join("during.txt").exists(),
    );
    wait_until("status.json to say synced", Duration::from_secs(10), || {
        status_json(&s.state)["unsynced"] == false
    });
    assert_eq!(status_json(&s.state)["syncError"], serde_json::Value::Null);
    assert_eq!(
        std::fs::read_to_string(s.src.join("during.txt")).unwrap(),
        "written during the outage\n"
    );
}

struct Proc(Option<Child>);
impl Proc {
    fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn is_mounted(p: &Path) -> bool {
    let s = p.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(s.as_str()))
}

fn handle_of(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

// Regression: a restarted `awcpfs export` drew a new export id and token, so the mount
// could not resume and `awcpfs recover` with its handle failed with 404.
#[test]
fn a_restarted_export_keeps_its_delegation_so_the_mount_resumes_and_recover_works() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mnt = tmp.path().join("mnt");
    let export_state = tmp.path().join("export-state");
    let mount_state = tmp.path().join("mount-state");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    std::fs::write(src.join("existing.txt"), "from the Delegator\n").unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start_export = |handle: &Path| {
        let p = Proc(Some(
            Command::new(BIN)
                .arg("export")
                .arg(&src)
                .args(["--listen", &format!("127.0.0.1:{port}"), "--handle-out"])
                .arg(handle)
                .arg("--state-dir")
                .arg(&export_state)
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        ));
        wait_until("the export's handle", Duration::from_secs(30), || {
            std::fs::read(handle)
                .is_ok_and(|b| serde_json::from_slice::<serde_json::Value>(&b).is_ok())
        });
        p
    };
    let first = tmp.path().join("first.json");
    let mut export = start_export(&first);
    let mut mount = Proc(Some(
        Command::new(BIN)
            .arg("mount")
            .arg(&first)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(&mount_state)
            .args(["--read-timeout-secs", "3"])
            .spawn()
            .unwrap(),
    ));
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            if is_mounted(self.0) {
                let _ = Command::new("umount").arg("-l").arg(self.0).status();
            }
        }
    }
    let _unmount = Unmount(&mnt);
    wait_until("the mount", Duration::from_secs(30), || is_mounted(&mnt));
    std::fs::write(mnt.join("a.txt"), "before the restart\n").unwrap();
    wait_until("a.txt at the Delegator", Duration::from_secs(20), || {
        src.join("a.txt").exists()
    });

    // The export dies; the mount writes on.
    export.kill();
    std::fs::write(mnt.join("b.txt"), "while the export was down\n").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(!src.join("b.txt").exists());

    // Restarted with the same directory and state directory: the same delegation.
    let second = tmp.path().join("second.json");
    let mut export = start_export(&second);
    let (h1, h2) = (handle_of(&first), handle_of(&second));
    assert_eq!(h1["exportId"], h2["exportId"], "a new export id");
    assert_eq!(h1["token"], h2["token"], "a new token");
    let end = |h: &serde_json::Value| {
        chrono::DateTime::parse_from_rfc3339(h["expiresAt"].as_str().unwrap()).unwrap()
    };
    let drift = (end(&h2) - end(&h1)).num_milliseconds().abs();
    assert!(
        drift < 2_000,
        "a new lease: {} then {}",
        h1["expiresAt"],
        h2["expiresAt"]
    );
    // The identity holds the token: owner only.
    for e in std::fs::read_dir(&export_state).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("export-") && name.ends_with(".json") {
            use std::os::unix::fs::PermissionsExt;
            let mode = e.metadata().unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{name} has mode {mode:o}");
        }
    }
    // The running mount resumes: what it wrote meanwhile arrives.
    wait_until("b.txt at the Delegator", Duration::from_secs(30), || {
        src.join("b.txt").exists()
    });
    assert_eq!(
        std::fs::read_to_string(src.join("b.txt")).unwrap(),
        "while the export was down\n"
    );

    // Now the export dies again, the mount writes and is killed: recovery with the first
    // handle, against the restarted export, writes it back.
    export.kill();
    std::fs::write(mnt.join("c.txt"), "written, then the mount was killed\n").unwrap();
    std::fs::remove_file(mnt.join("existing.txt")).unwrap();
    mount.kill();
    let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    let third = tmp.path().join("third.json");
    let _export = start_export(&third);
    assert_eq!(handle_of(&third)["exportId"], h1["exportId"]);
    let out = Command::new(BIN)
        .arg("recover")
        .arg(&first)
        .arg("--state-dir")
        .arg(&mount_state)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "recover failed: {said}");
    assert_eq!(
        std::fs::read_to_string(src.join("c.txt")).unwrap(),
        "written, then the mount was killed\n"
    );
    assert!(
        !src.join("existing.txt").exists(),
        "a removed file came back"
    );
    assert_eq!(
        std::fs::read_to_string(src.join("a.txt")).unwrap(),
        "before the restart\n"
    );
}
