//! `kill -9` of the mount process in the middle of a stream of writes: after
//! `awcpfs recover`, every write acknowledged by `close` or `fsync` is at the Delegator,
//! and recovering again changes nothing.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use awcpfs::testing::fuse_available;

const BIN: &str = env!("CARGO_BIN_EXE_awcpfs");

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn is_mounted(p: &Path) -> bool {
    let s = p.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(s.as_str()))
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn recover(handle: &Path, state: &Path) -> std::process::Output {
    Command::new(BIN)
        .args(["recover"])
        .arg(handle)
        .arg("--state-dir")
        .arg(state)
        .output()
        .unwrap()
}

/// Without the kernel's writeback cache, a `write(2)` that returned is the mount's.
#[test]
fn kill_9_mid_stream_then_recover_loses_no_acknowledged_write() {
    kill_9_mid_stream(&["--no-writeback-cache"]);
}

/// The same with the kernel's writeback cache (the default): written data sits in the kernel's page cache
/// until `close` or `fsync` hands it to the mount, and what they returned for must survive.
#[test]
fn wbcache_kill_9_mid_stream_loses_no_write_close_or_fsync_returned_for() {
    kill_9_mid_stream(&["--writeback-cache"]);
}

fn kill_9_mid_stream(extra: &[&str]) {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mnt = tmp.path().join("mnt");
    let state = tmp.path().join("mount-state");
    std::fs::create_dir_all(src.join("w")).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    std::fs::write(src.join("existing.txt"), "original\n").unwrap();
    let handle = tmp.path().join("h.json");
    let _export = Killed(
        Command::new(BIN)
            .arg("export")
            .arg(&src)
            .args(["--listen", "127.0.0.1:0", "--handle-out"])
            .arg(&handle)
            .arg("--state-dir")
            .arg(tmp.path().join("export-state"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the handle", || handle.exists());
    let mut mount = Killed(
        Command::new(BIN)
            .arg("mount")
            .arg(&handle)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(&state)
            .args(extra)
            .spawn()
            .unwrap(),
    );
    wait_for("the mount", || is_mounted(&mnt));

    // A writer acknowledging each file once close (or fsync) returned.
    let acked: Arc<parking_lot::Mutex<Vec<(PathBuf, String)>>> = Default::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (acked, stop, mnt) = (acked.clone(), stop.clone(), mnt.clone());
        std::thread::spawn(move || {
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let rel = PathBuf::from(format!("w/file{i:05}.txt"));
                let content = format!("content of file {i}\n").repeat(1 + i % 50);
                let r = (|| -> std::io::Result<()> {
                    let mut f = std::fs::File::create(mnt.join(&rel))?;
                    f.write_all(content.as_bytes())?;
                    if i % 3 == 0 {
                        f.sync_all()?;
                    }
                    // `close` is checked, not left to `drop`: with the writeback cache it
                    // is where the data reaches the mount, and where a kill shows.
                    nix::unistd::close(f)?;
                    Ok(())
                })();
                match r {
                    Ok(()) => acked.lock().push((rel, content)),
                    Err(_) => break,
                }
                if i == 40 {
                    // An edit of a file that came from the Delegator, via rename over it.
                    let ok = std::fs::write(mnt.join("tmp-edit"), "edited\n").and_then(|_| {
                        std::fs::rename(mnt.join("tmp-edit"), mnt.join("existing.txt"))
                    });
                    if ok.is_ok() {
                        acked
                            .lock()
                            .push(("existing.txt".into(), "edited\n".into()));
                    }
                }
            }
        })
    };
    wait_for("writes", || acked.lock().len() >= 150);
    // SIGKILL: no flush, no unmount, no goodbye.
    mount.0.kill().unwrap();
    mount.0.wait().unwrap();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    let acked = acked.lock().clone();
    assert!(acked.len() >= 150);

    // Copy the state so recovery can be run a second time afterwards.
    let copy = tmp.path().join("state-copy");
    let cp = Command::new("cp")
        .arg("-a")
        .arg(&state)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(cp.success());

    let out = recover(&handle, &state);
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "recover failed: {said}");
    eprintln!("{said}");
    // The kill came mid-stream: there was journaled work to replay.
    assert!(!said.contains(" 0 journal record(s)"), "{said}");
    for (rel, content) in &acked {
        let got = std::fs::read_to_string(src.join(rel))
            .unwrap_or_else(|e| panic!("acknowledged write {} lost: {e}", rel.display()));
        assert_eq!(&got, content, "{} has the wrong content", rel.display());
    }
    let conflicts: Vec<_> = walk(&src)
        .into_iter()
        .filter(|p| p.contains(".awcp-conflict-"))
        .collect();
    assert!(
        conflicts.is_empty(),
        "recovery made conflict copies: {conflicts:?}"
    );
    let before = walk(&src);

    // Recovering from the same state again writes nothing new: each change lands once.
    let out = recover(&handle, &copy);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(walk(&src), before, "a second recovery changed the tree");
    // And a state directory with nothing left says so.
    let out = recover(&handle, &state);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no mount state"));
}

fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(format!(
                    "{} {}",
                    p.strip_prefix(dir).unwrap().display(),
                    std::fs::read(&p).map(|b| b.len()).unwrap_or(0)
                ));
            }
        }
    }
    out.sort();
    out
}
