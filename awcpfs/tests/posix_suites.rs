//! The field's standard suites against a real, standalone mount (`awcpfs export` of a
//! directory, `awcpfs mount` of its handle):
//!
//! * pjdfstest (the Rust port, crate `pjdfstest`), as root, with the expected failures kept
//!   in `tests/fixtures/pjdfstest-expected-failures.txt` (each with its reason): a failure
//!   not listed fails the test, a listed one that now passes is reported, and at most 1 % of
//!   the test cases may fail at all;
//! * fsx (crate `fsx`) with every operation enabled, a fixed seed, 10,000 operations
//!   (`AWCP_FSX_OPS` sets the number, `AWCP_FSX_SEED` the seed; `scripts/soak.sh` runs
//!   100,000 with a fresh seed).
//!
//! Both binaries are installed by `.ci/run` (`cargo install --locked`, pinned versions).
//! Where one is missing the test skips loudly, except under `CI=true`, where it fails.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use awcpfs::testing::{fuse_available, uring_available};

const BIN: &str = env!("CARGO_BIN_EXE_awcpfs");

/// The expected failures of pjdfstest on awcpfs: `test::name  # reason`, one a line.
const EXPECTED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/pjdfstest-expected-failures.txt"
);

/// A standalone export and mount in a temp dir; unmounted (changes written back) and
/// stopped when dropped.
struct Standalone {
    export: Child,
    mount: Option<Child>,
    mnt: PathBuf,
    src: PathBuf,
    tmp: tempfile::TempDir,
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
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Standalone {
    /// Export and mount, with `extra` options for `awcpfs mount`, in a temp dir open to
    /// every user (0755).
    fn start(extra: &[&str]) -> Standalone {
        Standalone::start_in(0o755, extra)
    }

    /// [`Standalone::start`] with the temp dir's mode set to `tmp_mode` before mounting.
    fn start_in(tmp_mode: u32, extra: &[&str]) -> Standalone {
        Standalone::start_env(tmp_mode, extra, &[])
    }

    /// [`Standalone::start_in`] with `env` set for `awcpfs mount`.
    fn start_env(tmp_mode: u32, extra: &[&str], env: &[(&str, &Path)]) -> Standalone {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(tmp_mode)).unwrap();
        let src = tmp.path().join("src");
        let mnt = tmp.path().join("mnt");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir_all(&mnt).unwrap();
        let handle = tmp.path().join("h.json");
        let export = Command::new(BIN)
            .arg("export")
            .arg(&src)
            .args(["--listen", "127.0.0.1:0", "--handle-out"])
            .arg(&handle)
            .arg("--state-dir")
            .arg(tmp.path().join("export-state"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let mut s = Standalone {
            export,
            mount: None,
            mnt,
            src,
            tmp,
        };
        wait_for("the handle", || handle.exists());
        s.mount = Some(
            Command::new(BIN)
                .arg("mount")
                .arg(&handle)
                .arg(&s.mnt)
                .args(extra)
                .arg("--state-dir")
                .arg(s.tmp.path().join("mount-state"))
                .envs(env.iter().map(|(k, v)| (k, v)))
                .spawn()
                .unwrap(),
        );
        wait_for("the mount", || is_mounted(&s.mnt));
        s
    }

    /// Unmount the way Ctrl-C does (final write-back), within a minute.
    fn unmount(&mut self) -> Option<std::process::ExitStatus> {
        let mut m = self.mount.take()?;
        let pid = nix::unistd::Pid::from_raw(m.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let start = Instant::now();
        let status = loop {
            if let Ok(Some(st)) = m.try_wait() {
                break Some(st);
            }
            if start.elapsed() > Duration::from_secs(60) {
                let _ = m.kill();
                let _ = m.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if is_mounted(&self.mnt) {
            let _ = nix::mount::umount2(&self.mnt, nix::mount::MntFlags::MNT_DETACH);
        }
        status
    }
}

impl Drop for Standalone {
    fn drop(&mut self) {
        self.unmount();
        let _ = self.export.kill();
        let _ = self.export.wait();
    }
}

/// The installed binary `name` (on `PATH` or in cargo's `bin`), or `None` after a loud
/// skip message; under `CI=true` a missing one fails.
fn suite_binary(name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Some(c) = cargo_home {
        dirs.push(c.join("bin"));
    }
    if let Some(found) = dirs.iter().map(|d| d.join(name)).find(|p| p.is_file()) {
        return Some(found);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{name} is not installed; .ci/run installs it (cargo install --locked {name})");
    }
    let pin = match name {
        "pjdfstest" => " --version 0.2.2",
        "fsx" => " --version 0.3.2",
        _ => "",
    };
    awcpfs::testing::skipped(name, &format!("cargo install --locked {name}{pin}"));
    None
}

/// Wait for `child` at most `limit`; kill it past that.
fn wait_output(child: Child, limit: Duration, what: &str) -> std::process::Output {
    let pid = child.id();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if start.elapsed() > limit {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                    return true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            false
        })
    };
    let out = child.wait_with_output().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(!watchdog.join().unwrap(), "{what} took over {limit:?}");
    out
}

/// Drop terminal colour sequences (`ESC [ ... m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The result of each pjdfstest case: name → `ok`, `FAILED` or `skipped`.
fn pjdfstest_results(stdout: &str) -> BTreeMap<String, String> {
    strip_ansi(stdout)
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let name = words.next()?;
            let verdict = words.collect::<Vec<_>>().join(" ");
            (name.contains("::") && matches!(verdict.as_str(), "ok" | "FAILED" | "skipped"))
                .then(|| (name.to_string(), verdict))
        })
        .collect()
}

/// The listed expected failures: name → reason.
fn expected_failures(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| match l.split_once('#') {
            Some((name, reason)) => (name.trim().to_string(), reason.trim().to_string()),
            None => (l.to_string(), String::new()),
        })
        .collect()
}

/// Without the kernel's writeback cache: every write and time is the mount's.
#[test]
fn pjdfstest_passes_but_for_the_listed_failures() {
    pjdfstest_on(&["--no-writeback-cache", "--fuse-transport", "dev"]);
}

/// The same with the kernel's writeback cache on: its own sizes and times, batched writes.
#[test]
fn wbcache_pjdfstest_passes_with_the_writeback_cache() {
    pjdfstest_on(&["--writeback-cache", "--fuse-transport", "dev"]);
}

/// The same over FUSE-over-io_uring (the second adapter, `mount/uring`).
#[test]
fn uring_pjdfstest_passes_but_for_the_listed_failures() {
    if uring_available() {
        pjdfstest_on(&["--no-writeback-cache", "--fuse-transport", "uring"]);
    }
}

/// io_uring with the kernel's writeback cache.
#[test]
fn uring_wbcache_pjdfstest_passes_with_the_writeback_cache() {
    if uring_available() {
        pjdfstest_on(&["--writeback-cache", "--fuse-transport", "uring"]);
    }
}

fn pjdfstest_on(extra: &[&str]) {
    if !fuse_available() {
        return;
    }
    let Some(pjdfstest) = suite_binary("pjdfstest") else {
        return;
    };
    let expected = expected_failures(&std::fs::read_to_string(EXPECTED).unwrap());
    assert!(
        expected.values().all(|why| !why.is_empty()),
        "every expected failure in {EXPECTED} needs its reason after `#`"
    );
    // The Rust port acts as `nobody` and `daemon` by absolute paths, through the temp dir
    // above the mount: that needs the path open (the temp dir is 0755) and the mount open
    // to every user who gets there (`--access all`). The default access (served behind a
    // private directory only) is tested on its own below; the C suite, which acts from its
    // working directory inside the mount, passes on the default (docs/SEMANTICS.md).
    let mut fs = Standalone::start(&[extra, &["--access", "all"]].concat());
    // Every feature Linux has (not FreeBSD's chflags, birth time or NFSv4 ACLs); the
    // cross-device rename goes to a directory outside the mount. Users to switch to: ones
    // every Debian system has (the suite's default `tests` user does not exist there).
    // The read-only cases (they remount the mount `ro` and back) run on their own
    // afterwards: in the same process, a remount can find the mount busy.
    let second = fs.tmp.path().join("second-fs");
    std::fs::create_dir_all(&second).unwrap();
    // The read-only cases remount with `mount -o remount,ro MNT`. Where the `fuse3` package
    // is installed (sshfs pulls it in), mount(8) hands a FUSE remount to its
    // `/sbin/mount.fuse` helper, which takes the mount's source (`awcpfs:exp_…`) for a
    // program to run and fails. A `mount` first on the suite's PATH that passes `-i`
    // (`--internal-only`: no helper) remounts with mount(2) itself, as without `fuse3`.
    let bin = fs.tmp.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let real_mount = ["/usr/bin/mount", "/bin/mount"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("mount(8) is needed for pjdfstest's read-only cases");
    let wrapper = bin.join("mount");
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\nexec {real_mount} -i \"$@\"\n"),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // pjdfstest naps between the two `stat`s of a "did this time change" case; the nap must
    // be longer than the timestamps' granularity. awcpfs stamps times with the fine clock,
    // so 1 ms is enough. Under the writeback cache the kernel stamps a cached regular file's
    // ctime and mtime itself, from its coarse clock (one scheduler tick: 4 ms at HZ=250,
    // 10 ms at HZ=100), and the time before may be awcpfs's, up to a tick ahead of it: the
    // nap must cover two ticks (docs/SEMANTICS.md, The writeback cache).
    let naptime = if extra.contains(&"--writeback-cache") {
        "0.025"
    } else {
        "0.001"
    };
    let run = |remount: bool, patterns: &[&str]| {
        let config = fs.tmp.path().join(format!("pjdfstest-{remount}.toml"));
        std::fs::write(
            &config,
            format!(
                "[features]\nposix_fallocate = {{}}\nrename_ctime = {{}}\nutimensat = {{}}\n\
                 utime_now = {{}}\n\n[settings]\nnaptime = {naptime}\nallow_remount = {remount}\n\n\
                 [dummy_auth]\nentries = [[\"nobody\", \"nogroup\"], [\"daemon\", \"daemon\"]]\n"
            ),
        )
        .unwrap();
        let child = Command::new(&pjdfstest)
            .arg("-c")
            .arg(&config)
            .arg("-p")
            .arg(&fs.mnt)
            .arg("-s")
            .arg(&second)
            .args(patterns)
            .env("NO_COLOR", "1")
            .env("RUST_BACKTRACE", "0")
            .env("PATH", &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_output(child, Duration::from_secs(1200), "pjdfstest")
    };
    let out = run(false, &[]);
    let erofs = run(true, &["erofs"]);
    let mut stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut results = pjdfstest_results(&stdout);
    let erofs_stdout = String::from_utf8_lossy(&erofs.stdout).into_owned();
    let erofs_results = pjdfstest_results(&erofs_stdout);
    assert!(
        erofs_results.len() >= 10,
        "the read-only cases did not run:\n{erofs_stdout}"
    );
    results.extend(erofs_results);
    stdout.push_str(&erofs_stdout);
    let ran: Vec<&String> = results
        .iter()
        .filter(|(_, v)| v.as_str() != "skipped")
        .map(|(k, _)| k)
        .collect();
    assert!(
        ran.len() > 100,
        "pjdfstest ran only {} cases:\n{stdout}\n{}",
        ran.len(),
        String::from_utf8_lossy(&out.stderr)
    );
    let failed: Vec<&String> = results
        .iter()
        .filter(|(_, v)| v.as_str() == "FAILED")
        .map(|(k, _)| k)
        .collect();
    let unexpected: Vec<&&String> = failed
        .iter()
        .filter(|k| !expected.contains_key(k.as_str()))
        .collect();
    let fixed: Vec<&String> = expected
        .keys()
        .filter(|k| results.get(*k).map(String::as_str) == Some("ok"))
        .collect();
    if !fixed.is_empty() {
        eprintln!(
            "\n!!!!!!!! pjdfstest cases listed as expected failures now PASS; remove them from \
             {EXPECTED} and docs/SEMANTICS.md: {fixed:?} !!!!!!!!\n"
        );
    }
    eprintln!(
        "pjdfstest on awcpfs: {} cases run, {} failed ({} expected), {} skipped",
        ran.len(),
        failed.len(),
        failed.len() - unexpected.len(),
        results.len() - ran.len()
    );
    assert!(
        unexpected.is_empty(),
        "pjdfstest cases failing on awcpfs that {EXPECTED} does not list: {unexpected:?}\n\n{stdout}"
    );
    assert!(
        failed.len() * 100 <= ran.len(),
        "more than 1 % of pjdfstest cases fail: {} of {}",
        failed.len(),
        ran.len()
    );
    // The suite removes what it made: nothing may be left, on the mount or, once written
    // back, at the Delegator (the C suite used to leave empty directories behind).
    let left: Vec<_> = std::fs::read_dir(&fs.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left on the mount: {left:?}");
    let status = fs.unmount();
    assert!(
        status.is_some_and(|s| s.success()),
        "awcpfs mount did not end cleanly: {status:?}"
    );
    let left: Vec<_> = std::fs::read_dir(&fs.src)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left at the Delegator: {left:?}");
}

/// Run `argv` as `nobody` from `cwd` (entered as root first, as a test suite that drops
/// privileges does), returning whether it succeeded and its stderr.
fn as_nobody_in(cwd: &Path, argv: &[&str]) -> (bool, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(argv)
        .current_dir(cwd)
        .output()
        .expect("running setpriv (util-linux)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The default access serves a mount like a local directory only behind a private path;
/// on an open path, and always with `--access owner`, another uid is refused even where
/// the files' modes would let it in.
#[test]
fn mount_access_follows_the_path_by_default_and_owner_keeps_everyone_else_out() {
    if !fuse_available() {
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "setpriv (util-linux) is needed under CI=true"
        );
        awcpfs::testing::skipped(
            "the unprivileged-access check (setpriv)",
            "apt-get install util-linux",
        );
        return;
    }
    let readable = |fs: &Standalone| {
        std::fs::write(fs.mnt.join("f"), "open to all\n").unwrap();
        std::fs::set_permissions(fs.mnt.join("f"), std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(&fs.mnt, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    // Private path (the default temp dir, 0700): a process let in that became `nobody`
    // reads a 0644 file and is refused a write, as on a local disk.
    let fs = Standalone::start_in(0o700, &[]);
    readable(&fs);
    let (ok, err) = as_nobody_in(&fs.mnt, &["cat", "f"]);
    assert!(ok, "nobody inside a privately mounted workspace: {err}");
    let (ok, err) = as_nobody_in(&fs.mnt, &["touch", "g"]);
    assert!(!ok && err.contains("Permission denied"), "{err}");
    // ...but not by name from outside: the temp dir keeps it out.
    let (ok, _) = as_nobody_in(Path::new("/"), &["cat", fs.mnt.join("f").to_str().unwrap()]);
    assert!(!ok);
    drop(fs);
    // The same with --access owner: refused inside too.
    let fs = Standalone::start_in(0o700, &["--access", "owner"]);
    readable(&fs);
    let (ok, err) = as_nobody_in(&fs.mnt, &["cat", "f"]);
    assert!(!ok && err.contains("Permission denied"), "{err}");
    drop(fs);
    // Open path (temp dir 0755, and nothing above it private): only the mounting user,
    // even by name with every mode open.
    let fs = Standalone::start_in(0o755, &[]);
    readable(&fs);
    let path = fs.mnt.join("f");
    let gated = awcpfs::mount::access::gate(&fs.mnt, &[0]);
    let (ok, err) = as_nobody_in(Path::new("/"), &["cat", path.to_str().unwrap()]);
    match gated {
        // A machine whose temp dir lies below a private directory (TMPDIR in /root).
        Some(g) => eprintln!(
            "note: {} is private, so the open temp dir has a gate",
            g.display()
        ),
        None => assert!(!ok && err.contains("Permission denied"), "{err}"),
    }
}

/// Without the kernel's writeback cache: every write reaches the mount as it is made.
#[test]
fn fsx_with_every_operation_finds_no_difference() {
    fsx_on(&["--no-writeback-cache", "--fuse-transport", "dev"]);
}

/// The same with the kernel's writeback cache on (fsx checks sizes after every operation,
/// through `mmap` as well).
#[test]
fn wbcache_fsx_finds_no_difference_with_the_writeback_cache() {
    fsx_on(&["--writeback-cache", "--fuse-transport", "dev"]);
}

/// fsx listed as a writer whose new files the kernel writes directly (FUSE passthrough,
/// `--passthrough-writes`): every operation on the one descriptor it created the file with
/// (no close and reopen, which would make it an ordinary file), the mount learning of the
/// kernel's writes from inotify — mapped writes, truncations, `fallocate` and hole punching
/// through the mount's own descriptor among them — and the Delegator's copy checked at the
/// end.
#[test]
fn passthrough_fsx_finds_no_difference_when_the_kernel_writes_the_file() {
    fsx_with(
        &["--passthrough-writes", "fsx", "--fuse-transport", "dev"],
        false,
    );
}

/// The same over FUSE-over-io_uring.
#[test]
fn uring_passthrough_fsx_finds_no_difference_when_the_kernel_writes_the_file() {
    if uring_available() {
        fsx_with(
            &["--passthrough-writes", "fsx", "--fuse-transport", "uring"],
            false,
        );
    }
}

/// The same over FUSE-over-io_uring.
#[test]
fn uring_fsx_with_every_operation_finds_no_difference() {
    if uring_available() {
        fsx_on(&["--no-writeback-cache", "--fuse-transport", "uring"]);
    }
}

/// io_uring with the kernel's writeback cache.
#[test]
fn uring_wbcache_fsx_finds_no_difference_with_the_writeback_cache() {
    if uring_available() {
        fsx_on(&["--writeback-cache", "--fuse-transport", "uring"]);
    }
}

fn fsx_on(extra: &[&str]) {
    fsx_with(extra, true);
}

/// fsx on a standalone mount with `extra` options; `close_open`: with its operation that
/// closes and reopens the file.
fn fsx_with(extra: &[&str], close_open: bool) {
    if !fuse_available() {
        return;
    }
    let Some(fsx) = suite_binary("fsx") else {
        return;
    };
    let ops: u64 = std::env::var("AWCP_FSX_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        // 100,000 take minutes on a loaded CI machine: `scripts/soak.sh` runs those.
        .unwrap_or(10_000);
    let seed: u64 = std::env::var("AWCP_FSX_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_261_202);
    let mut fs = Standalone::start(extra);
    let config = fs.tmp.path().join("fsx.toml");
    // Every operation fsx has, each with some weight.
    std::fs::write(
        &config,
        format!(
            "flen = 262144\n\n[weights]\nclose_open = {}\nread = 10\nwrite = 10\n\
             mapread = 10\nmapwrite = 10\ninvalidate = 1\ntruncate = 2\nfsync = 1\n\
             fdatasync = 1\nposix_fallocate = 1\npunch_hole = 1\nsendfile = 1\n\
             posix_fadvise = 1\ncopy_file_range = 1\n",
            u8::from(close_open)
        ),
    )
    .unwrap();
    let artifacts = fs.tmp.path().join("fsx-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let child = Command::new(&fsx)
        .arg("-f")
        .arg(&config)
        .arg("-N")
        .arg(ops.to_string())
        .arg("-S")
        .arg(seed.to_string())
        .arg("-P")
        .arg(&artifacts)
        .arg(fs.mnt.join("fsx.data"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_output(child, Duration::from_secs(900), "fsx");
    assert!(
        out.status.success(),
        "fsx (seed {seed}, {ops} operations) found a difference:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !close_open && extra.contains(&"--passthrough-writes") {
        // The kernel wrote the file: fsx's writes came as no request.
        let v = status_when(&fs, "fsx.data handed to the kernel", |v| {
            v["stats"]["passthroughOpens"].as_u64() >= Some(1)
        });
        assert_eq!(v["stats"]["ops"]["write"].as_u64().unwrap_or(0), 0, "{v}");
    }
    // The file fsx verified on the mount is what reaches the Delegator.
    let on_mount = std::fs::read(fs.mnt.join("fsx.data")).unwrap();
    let status = fs.unmount();
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert_eq!(
        std::fs::read(fs.src.join("fsx.data")).unwrap(),
        on_mount,
        "the Delegator's copy differs from the mount's"
    );
}

/// The transport a standalone mount reports in its `status.json`.
fn transport_of(fs: &Standalone) -> String {
    let v = status_when(fs, "status.json", |v| v["fuseTransport"].is_string());
    v["fuseTransport"].as_str().unwrap_or_default().to_owned()
}

/// A standalone mount's `status.json` once `ready` holds of it (waiting for `what`).
fn status_when(
    fs: &Standalone,
    what: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let states = fs.tmp.path().join("mount-state");
    let mut found = serde_json::Value::Null;
    wait_for(what, || {
        let Ok(dirs) = std::fs::read_dir(&states) else {
            return false;
        };
        for d in dirs.flatten() {
            let Ok(text) = std::fs::read_to_string(d.path().join("status.json")) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            if ready(&v) {
                found = v;
                return true;
            }
        }
        false
    });
    found
}

/// A tree written and read back through the mount, then unmounted: what the Delegator got.
fn round_trip(fs: &mut Standalone) {
    std::fs::create_dir(fs.mnt.join("d")).unwrap();
    std::fs::write(fs.mnt.join("d/f"), b"over the wire\n").unwrap();
    std::os::unix::fs::symlink("d/f", fs.mnt.join("l")).unwrap();
    assert_eq!(std::fs::read(fs.mnt.join("l")).unwrap(), b"over the wire\n");
    let status = fs.unmount();
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert_eq!(
        std::fs::read(fs.src.join("d/f")).unwrap(),
        b"over the wire\n"
    );
}

/// The mount's inode table lives in an arena of its own, advised for huge pages
/// (`awcpfs/src/alloc.rs`): the mount process has a mapping of the arena's size, the table's
/// memory is in it, and the kernel may back it with huge pages (unless the machine's policy
/// is `never`; under `always` that needs Linux 6.18's `PR_THP_DISABLE_EXCEPT_ADVISED`).
#[test]
fn a_mount_keeps_its_inode_table_in_an_arena_advised_for_huge_pages() {
    if !fuse_available() {
        return;
    }
    let mut fs = Standalone::start(&[]);
    for i in 0..2_000 {
        std::fs::write(fs.mnt.join(format!("f{i}")), b"x").unwrap();
    }
    let pid = fs.mount.as_ref().unwrap().id();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    // (size in MiB, Rss kB, THPeligible) of each mapping.
    let mut maps: Vec<(u64, u64, bool)> = Vec::new();
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            maps.push(((b - a) >> 20, 0, false));
        } else if first == "Rss:"
            && let Some(m) = maps.last_mut()
        {
            m.1 = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
        } else if first == "THPeligible:"
            && let Some(m) = maps.last_mut()
        {
            m.2 = words.next() == Some("1");
        }
    }
    let arena = maps.iter().find(|m| m.0 >= 4096);
    let Some(&(_, rss, eligible)) = arena else {
        panic!("no 4 GiB arena among the mount's mappings: {maps:?}");
    };
    assert!(rss > 0, "the arena holds nothing: the table is elsewhere");
    let policy =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if !policy.contains("[never]") {
        assert!(
            eligible,
            "the arena may not have huge pages (policy {policy:?})"
        );
    }
    let status = fs.unmount();
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert_eq!(std::fs::read(fs.src.join("f1999")).unwrap(), b"x");
}

/// `--fuse-transport auto` where the kernel does not offer io_uring (`enable_uring` read as
/// N, from a file standing in for the parameter): the mount serves over /dev/fuse.
#[test]
fn auto_falls_back_to_dev_fuse_when_enable_uring_is_n() {
    if !fuse_available() {
        return;
    }
    let param = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(param.path(), "N\n").unwrap();
    let env = [(awcpfs::mount::uring::ENABLE_URING_VAR, param.path())];
    let mut fs = Standalone::start_env(0o755, &["--fuse-transport", "auto"], &env);
    assert_eq!(transport_of(&fs), "/dev/fuse");
    round_trip(&mut fs);
}

/// `--fuse-transport uring` where the kernel does not offer it fails, saying how to enable
/// it, instead of mounting over something else.
#[test]
fn uring_refuses_to_mount_when_enable_uring_is_n() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (src, mnt, handle) = (
        tmp.path().join("src"),
        tmp.path().join("mnt"),
        tmp.path().join("h"),
    );
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let param = tmp.path().join("enable_uring");
    std::fs::write(&param, "N\n").unwrap();
    let mut export = Command::new(BIN)
        .arg("export")
        .arg(&src)
        .args(["--listen", "127.0.0.1:0", "--handle-out"])
        .arg(&handle)
        .arg("--state-dir")
        .arg(tmp.path().join("export-state"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the handle", || handle.exists());
    let out = Command::new(BIN)
        .arg("mount")
        .arg(&handle)
        .arg(&mnt)
        .args(["--fuse-transport", "uring", "--state-dir"])
        .arg(tmp.path().join("mount-state"))
        .env(awcpfs::mount::uring::ENABLE_URING_VAR, &param)
        .output()
        .unwrap();
    let _ = export.kill();
    let _ = export.wait();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mounted anyway: {err}");
    assert!(!is_mounted(&mnt));
    assert!(
        err.contains("--fuse-transport uring") && err.contains("is N (as root: echo Y >"),
        "the error does not say how to enable io_uring: {err}"
    );
}

/// `auto` where the kernel offers io_uring: the mount uses it, and says so.
#[test]
fn auto_uses_io_uring_when_the_kernel_offers_it() {
    if !uring_available() {
        return;
    }
    let mut fs = Standalone::start(&["--fuse-transport", "auto"]);
    assert_eq!(transport_of(&fs), "io_uring");
    round_trip(&mut fs);
}

/// Told io_uring is on (the stand-in file says Y) where the kernel does not offer it in
/// INIT: `auto` still mounts, served over /dev/fuse by the io_uring adapter itself.
#[test]
fn auto_serves_over_dev_fuse_when_init_does_not_offer_io_uring() {
    if !fuse_available() || awcpfs::mount::uring::kernel_enables_uring() == Some(true) {
        // With the kernel's parameter Y, INIT offers io_uring: covered above.
        return;
    }
    let param = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(param.path(), "Y\n").unwrap();
    let env = [(awcpfs::mount::uring::ENABLE_URING_VAR, param.path())];
    let mut fs = Standalone::start_env(0o755, &["--fuse-transport", "auto"], &env);
    assert_eq!(transport_of(&fs), "/dev/fuse");
    round_trip(&mut fs);
}

#[test]
fn the_pjdfstest_output_parser_reads_each_verdict() {
    let out = "\u{1b}[34mchmod::basic\u{1b}[0m    \u{1b}[32mok\u{1b}[0m\n\
               mkfifo::x   FAILED\n\tpanicked at ...\nrename::y    skipped\n\
               \trequires root\n\nSummary: 1 failed, 1 skipped, 1 passed\n";
    let r = pjdfstest_results(out);
    assert_eq!(r.len(), 3, "{r:?}");
    assert_eq!(r["chmod::basic"], "ok");
    assert_eq!(r["mkfifo::x"], "FAILED");
    assert_eq!(r["rename::y"], "skipped");
    let e = expected_failures("# comment\n\na::b  # why not\nc::d\n");
    assert_eq!(e["a::b"], "why not");
    assert_eq!(e["c::d"], "");
}
