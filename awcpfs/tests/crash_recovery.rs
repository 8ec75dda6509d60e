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

/// `awcpfs export SRC`, its handle written to `handle` (waited for), killed when dropped.
fn export(src: &Path, handle: &Path, state: &Path) -> Killed {
    let export = Killed(
        Command::new(BIN)
            .arg("export")
            .arg(src)
            .args(["--listen", "127.0.0.1:0", "--handle-out"])
            .arg(handle)
            .arg("--state-dir")
            .arg(state)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the handle", || handle.exists());
    export
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

/// A live mount holds its state directory: a second mount of it, or a recovery, is refused
/// with a message that says why (two processes would write one journal); once the mount is
/// killed, recovery takes the directory.
#[test]
fn a_live_mounts_state_directory_is_refused_to_a_second_mount_and_to_recovery() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let (mnt, mnt2) = (tmp.path().join("mnt"), tmp.path().join("mnt2"));
    let state = tmp.path().join("mount-state");
    for d in [&src, &mnt, &mnt2] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(src.join("a.txt"), "a\n").unwrap();
    let handle = tmp.path().join("h.json");
    let _export = export(&src, &handle, &tmp.path().join("export-state"));
    let mount = |at: &Path| {
        Command::new(BIN)
            .arg("mount")
            .arg(&handle)
            .arg(at)
            .arg("--state-dir")
            .arg(&state)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut first = Killed(mount(&mnt));
    wait_for("the mount", || is_mounted(&mnt));
    std::fs::write(mnt.join("b.txt"), "b\n").unwrap();

    let second = mount(&mnt2).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(
        !second.status.success(),
        "a second mount of one state directory ran"
    );
    assert!(err.contains("is using the state directory"), "{err}");
    assert!(!is_mounted(&mnt2));
    let out = recover(&handle, &state);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "recovery ran beside the live mount");
    assert!(err.contains("is using the state directory"), "{err}");
    // The first mount was not disturbed.
    assert_eq!(std::fs::read_to_string(mnt.join("b.txt")).unwrap(), "b\n");

    // Killed: the kernel lets go of its lock, and recovery writes its change back.
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    let out = recover(&handle, &state);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(src.join("b.txt")).unwrap(), "b\n");
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
    let _export = export(&src, &handle, &tmp.path().join("export-state"));
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

/// Unmounts a tmpfs when dropped.
struct Tmpfs(PathBuf);
impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fill the filesystem at `dir` with `dir/ballast`, leaving about `leave` bytes free.
fn fill_leaving(dir: &Path, leave: usize) {
    let margin = dir.join("margin");
    std::fs::write(&margin, vec![0u8; leave]).unwrap();
    let mut f = std::fs::File::create(dir.join("ballast")).unwrap();
    let chunk = vec![1u8; 4096];
    while f.write_all(&chunk).is_ok() {}
    drop(f);
    std::fs::remove_file(&margin).unwrap();
}

// Regression (issue 30): with the mount's state on a full disk, renames and unlinks that
// returned ENOSPC had been applied (and written back), commits went out that synced.log
// could not record, and after `kill -9` recovery made conflict copies of the mount's own
// changes ("changed on the export since the base"), some holding the only acknowledged
// content. Now an operation that fails has not happened, and a commit that cannot be
// recorded is not sent: recovery ends with the last acknowledged state and no conflict copy.
#[test]
fn enospc_on_renames_unlinks_and_commit_records_then_kill_9_and_recover_makes_no_conflict() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mnt = tmp.path().join("mnt");
    let disk = tmp.path().join("disk");
    let state = disk.join("state");
    for d in [&src, &mnt, &disk] {
        std::fs::create_dir_all(d).unwrap();
    }
    const N: usize = 400;
    // What the caller was told, per path: `Some(content)`, or `None` (absent).
    let mut model: std::collections::BTreeMap<String, Option<String>> = Default::default();
    for i in 0..N {
        let c = format!("orig {i}\n");
        std::fs::write(src.join(format!("f{i}")), &c).unwrap();
        model.insert(format!("f{i}"), Some(c));
    }
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&disk)
        .status()
        .unwrap();
    assert!(st.success());
    let _disk = Tmpfs(disk.clone());
    let handle = tmp.path().join("h.json");
    let _export = export(&src, &handle, &tmp.path().join("export-state"));
    let mut mount = Killed(
        Command::new(BIN)
            .arg("mount")
            .arg(&handle)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(&state)
            // Each operation's own answer; nothing fetched into the state dir behind it.
            .args(["--no-writeback-cache", "--hydrate", "none"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the mount", || is_mounted(&mnt));
    std::thread::sleep(Duration::from_millis(300));
    // A few dozen operations' worth of journal and commit records fit; then ENOSPC.
    fill_leaving(&disk, 24 << 10);

    let (mut failed, mut ok) = (0, 0);
    let mut uncertain = std::collections::BTreeSet::new();
    let at = |p: &str| mnt.join(p);
    for i in 0..N {
        let f = format!("f{i}");
        match i % 4 {
            0 => match std::fs::rename(at(&f), at(&format!("r{i}"))) {
                Ok(()) => {
                    let c = model.insert(f, None).unwrap();
                    model.insert(format!("r{i}"), c);
                    ok += 1;
                }
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "rename {f}: {e}");
                    failed += 1;
                }
            },
            1 => match std::fs::remove_file(at(&f)) {
                Ok(()) => {
                    model.insert(f, None);
                    ok += 1;
                }
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "unlink {f}: {e}");
                    failed += 1;
                }
            },
            2 => {
                // Over an existing name (f{i+1} is left alone by its own turn).
                let over = format!("f{}", i + 1);
                match std::fs::rename(at(&f), at(&over)) {
                    Ok(()) => {
                        let c = model.insert(f, None).unwrap();
                        model.insert(over, c);
                        ok += 1;
                    }
                    Err(e) => {
                        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "rename {f}: {e}");
                        failed += 1;
                    }
                }
            }
            _ => {
                let n = format!("n{i}");
                let c = format!("new {i}\n");
                let r = (|| -> std::io::Result<()> {
                    let mut fh = std::fs::File::create(at(&n))?;
                    fh.write_all(c.as_bytes())?;
                    nix::unistd::close(fh)?;
                    Ok(())
                })();
                match r {
                    Ok(()) => {
                        model.insert(n, Some(c));
                    }
                    // Created but not written, or not created: either may be found.
                    Err(_) => {
                        uncertain.insert(n);
                    }
                }
            }
        }
        if i % 16 == 0 {
            // Let the syncer commit (and record, or fail to record) what came so far.
            std::thread::sleep(Duration::from_millis(30));
        }
    }
    assert!(
        ok > 10 && failed > 10,
        "the disk did not fill part-way ({ok} renames/unlinks succeeded, {failed} failed)"
    );
    std::thread::sleep(Duration::from_millis(500));
    mount.0.kill().unwrap();
    mount.0.wait().unwrap();
    let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    // Space comes back, and the mount's changes are recovered.
    std::fs::remove_file(disk.join("ballast")).unwrap();
    let out = recover(&handle, &state);
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "recover failed: {said}");

    let conflicts: Vec<_> = walk(&src)
        .into_iter()
        .filter(|p| p.contains(".awcp-conflict-"))
        .collect();
    assert!(
        conflicts.is_empty(),
        "recovery made conflict copies of the mount's own changes: {conflicts:?}\n{said}"
    );
    let mut wrong = Vec::new();
    for (p, want) in &model {
        let got = std::fs::read_to_string(src.join(p)).ok();
        if &got != want {
            wrong.push(format!("{p}: want {want:?}, got {got:?}"));
        }
    }
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        let p = e.file_name().to_string_lossy().into_owned();
        if !model.contains_key(&p) && !uncertain.contains(&p) {
            wrong.push(format!("{p}: at the Delegator, but never acknowledged"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} path(s) differ from what their callers were told ({ok} ops succeeded, \
         {failed} failed):\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}
