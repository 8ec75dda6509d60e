//! AECP's point of use on a real mount (`awcpfs export --aecp-events`, `awcpfs mount`):
//!
//! * what the worker's process does to a path decides, not what the kernel cached: after
//!   `ls -l dir` (whose READDIRPLUS used to fill the kernel's entries for an hour), an
//!   explicit `stat dir/x.py` still delivers `dir/x.py`'s finding, and the listing itself
//!   delivers nothing;
//! * `git status` delivers nothing for the files it does not open;
//! * a mount is ready only when its findings are: a walk opening every file right after the
//!   mount answers receives every one of 10,000 findings.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use awcpfs::testing::fuse_available;

const BIN: &str = env!("CARGO_BIN_EXE_awcpfs");

fn is_mounted(p: &Path) -> bool {
    let Ok(m) = std::fs::read_to_string("/proc/self/mounts") else {
        return false;
    };
    let p = p.to_string_lossy();
    m.lines().any(|l| l.split(' ').nth(1) == Some(&*p))
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out: {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An artifact event bound to `path` (file scope).
fn finding(id: u64, path: &str) -> String {
    serde_json::json!({"type": "artifact", "artifact": {
        "id": id,
        "claim": format!("finding {id} about {path}"),
        "scope": {"kind": "file", "target": path},
        "bound": path,
        "status": "checked",
        "producer": "other-worker",
        "createdMs": 1_700_000_000_000u64 + id,
        "revision": 1,
    }})
    .to_string()
}

/// A standalone export of `src` with an AECP index, and its mount.
struct Mounted {
    export: Child,
    mount: Option<Child>,
    mnt: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Mounted {
    fn start(fill: impl FnOnce(&Path), events: &[String]) -> Mounted {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        let mnt = tmp.path().join("mnt");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir_all(&mnt).unwrap();
        fill(&src);
        let index = tmp.path().join("events.ndjson");
        std::fs::write(&index, events.join("\n")).unwrap();
        let handle = tmp.path().join("h.json");
        let export = Command::new(BIN)
            .arg("export")
            .arg(&src)
            .args(["--listen", "127.0.0.1:0", "--handle-out"])
            .arg(&handle)
            .arg("--state-dir")
            .arg(tmp.path().join("export-state"))
            .arg("--aecp-events")
            .arg(&index)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        wait_for("the handle", || handle.exists());
        let mount = Command::new(BIN)
            .arg("mount")
            .arg(&handle)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(tmp.path().join("mount-state"))
            .spawn()
            .unwrap();
        let m = Mounted {
            export,
            mount: Some(mount),
            mnt,
            _tmp: tmp,
        };
        wait_for("the mount", || is_mounted(&m.mnt));
        m
    }

    /// The ids in `.aecp/inbox`, checking that every line is a finding.
    fn inbox(&self) -> Vec<u64> {
        let text = std::fs::read_to_string(self.mnt.join(".aecp/inbox")).unwrap();
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                assert_eq!(v["kind"], "finding", "{l}");
                v["id"].as_u64().unwrap()
            })
            .collect()
    }

    fn run(&self, argv: &[&str]) -> String {
        let out = Command::new(argv[0])
            .args(&argv[1..])
            .current_dir(&self.mnt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{argv:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(mut m) = self.mount.take() {
            let pid = nix::unistd::Pid::from_raw(m.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
            let start = Instant::now();
            while !matches!(m.try_wait(), Ok(Some(_))) && start.elapsed() < Duration::from_secs(30)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = m.kill();
            let _ = m.wait();
        }
        if is_mounted(&self.mnt) {
            let _ = nix::mount::umount2(&self.mnt, nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = self.export.kill();
        let _ = self.export.wait();
    }
}

// `ls -l dir/; stat dir/x.py` delivered nothing for `dir/x.py`: the listing's READDIRPLUS
// filled the kernel's entries, so the `stat` never reached the mount.
#[test]
fn ls_then_stat_delivers_on_the_stat() {
    if !fuse_available() {
        return;
    }
    let m = Mounted::start(
        |src| {
            std::fs::create_dir_all(src.join("dir")).unwrap();
            for f in ["x.py", "y.py", "z.py"] {
                std::fs::write(src.join("dir").join(f), "X = 1\n").unwrap();
            }
        },
        &[finding(1, "dir/x.py"), finding(2, "dir/y.py")],
    );
    let listing = m.run(&["ls", "-l", "dir"]);
    assert!(listing.contains("x.py"), "{listing}");
    assert_eq!(
        m.inbox(),
        Vec::<u64>::new(),
        "a listing is not a point of use"
    );
    m.run(&["stat", "dir/x.py"]);
    assert_eq!(m.inbox(), [1], "the explicit stat is");
    // Again after the finding was delivered: nothing new; an open delivers the other one.
    m.run(&["stat", "dir/x.py"]);
    m.run(&["cat", "dir/y.py"]);
    assert_eq!(m.inbox(), [1, 2]);
}

// A plain `git status` delivered six pending findings for files the worker never opened.
#[test]
fn git_status_delivers_nothing_for_files_it_does_not_open() {
    if !fuse_available() {
        return;
    }
    if Command::new("git").arg("--version").output().is_err() {
        eprintln!("SKIPPED git_status_delivers_nothing_for_files_it_does_not_open: no git");
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "git is missing in CI"
        );
        return;
    }
    let m = Mounted::start(
        |src| {
            std::fs::create_dir_all(src.join("pkg")).unwrap();
            // Old modification times: files as new as the index are "racily clean", and git
            // re-reads them to be sure.
            let past = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_600_000_000);
            for i in 0..6 {
                let path = src.join(format!("pkg/m{i}.py"));
                std::fs::write(&path, format!("X = {i}\n")).unwrap();
                std::fs::File::options()
                    .write(true)
                    .open(&path)
                    .unwrap()
                    .set_modified(past)
                    .unwrap();
            }
            let git = |args: &[&str]| {
                let ok = Command::new("git")
                    .args(args)
                    .current_dir(src)
                    .env("GIT_AUTHOR_NAME", "t")
                    .env("GIT_AUTHOR_EMAIL", "t@t")
                    .env("GIT_COMMITTER_NAME", "t")
                    .env("GIT_COMMITTER_EMAIL", "t@t")
                    .output()
                    .unwrap();
                assert!(ok.status.success(), "git {args:?}");
            };
            git(&["init", "-q"]);
            // The mount gives other inode numbers and ctimes than the directory: compare
            // what the mount keeps (mtime and size), so git need not re-read the files.
            git(&["config", "core.checkStat", "minimal"]);
            git(&["config", "core.trustctime", "false"]);
            git(&["add", "-A"]);
            git(&["commit", "-qm", "init"]);
        },
        &(0..6)
            .map(|i| finding(i + 1, &format!("pkg/m{i}.py")))
            .collect::<Vec<_>>(),
    );
    let status = m.run(&["git", "status", "--porcelain"]);
    assert_eq!(status.trim(), "", "the tree is clean on the mount");
    assert_eq!(m.inbox(), Vec::<u64>::new(), "git status opened nothing");
    m.run(&["cat", "pkg/m3.py"]);
    assert_eq!(m.inbox(), [4], "opening one file delivers its finding");
}

// A walk right after mounting delivered 49 of 10,000 findings; after a 1 s wait, all.
#[test]
fn a_walk_right_after_mounting_sees_all_of_10000_findings() {
    if !fuse_available() {
        return;
    }
    const N: u64 = 10_000;
    let m = Mounted::start(
        |src| {
            for d in 0..100 {
                let dir = src.join(format!("d{d:03}"));
                std::fs::create_dir_all(&dir).unwrap();
                for f in 0..100 {
                    std::fs::write(dir.join(format!("f{f:03}.py")), "X = 1\n").unwrap();
                }
            }
        },
        &(0..N)
            .map(|i| finding(i + 1, &format!("d{:03}/f{:03}.py", i / 100, i % 100)))
            .collect::<Vec<_>>(),
    );
    // At once: open every file.
    for d in 0..100 {
        for f in 0..100 {
            std::fs::read(m.mnt.join(format!("d{d:03}/f{f:03}.py"))).unwrap();
        }
    }
    let mut got = m.inbox();
    got.sort_unstable();
    assert_eq!(
        got.len() as u64,
        N,
        "every finding delivered on the first walk"
    );
    assert_eq!(got, (1..=N).collect::<Vec<_>>());
}
