//! git's fsmonitor served by the mount (`awcpfs fsmonitor`): on a real FUSE mount of an
//! in-process export, rounds of random changes — made by the agent on the mount and by the
//! Delegator in the exported directory (create, modify in place or growing, delete, rename,
//! chmod, new directories, directory renames and removals, commits), some while a
//! `git status` runs — and after each round `git status --porcelain` with the monitor (and
//! the untracked cache) must say exactly what it says without them.
//!
//! The reference run neither uses nor writes the index's monitor state
//! (`--no-optional-locks`), so the monitored runs keep their marks and tokens across
//! rounds: every round but the first is answered from the change log, not by a full scan
//! (checked at the end with `git ls-files -f`).

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::{Mount, MountConfig};
use awcpfs::testing::fuse_available;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Setup {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    mnt: PathBuf,
    mount: Mount,
    _rt: tokio::runtime::Runtime,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.mount.end(awcpfs::mount::EndReason::Unmounted, None);
    }
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(["-c", "user.email=t@x", "-c", "user.name=t"])
        .args(args)
        .current_dir(dir)
        .env_remove("GIT_CONFIG_COUNT")
        .output()
        .expect("git runs");
    assert!(
        out.status.success(),
        "git {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// git with the monitor and the untracked cache (what the Executor configures).
fn git_monitored(dir: &Path, cmd: &[&str]) -> String {
    let hook =
        awcpfs::fsmonitor::hook_command(Path::new(env!("CARGO_BIN_EXE_awcpfs")), &["fsmonitor"]);
    let mut args: Vec<String> = Vec::new();
    for (k, v) in awcpfs::fsmonitor::git_config(&hook) {
        args.push("-c".into());
        args.push(format!("{k}={v}"));
    }
    args.extend(cmd.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    git(dir, &args)
}

/// `git status` with the monitor.
fn status_monitored(dir: &Path) -> String {
    git_monitored(dir, &["status", "--porcelain"])
}

/// `git status` looking at every file, leaving the index alone.
fn status_reference(dir: &Path) -> String {
    git(
        dir,
        &[
            "--no-optional-locks",
            "-c",
            "core.fsmonitor=",
            "-c",
            "core.untrackedCache=false",
            "status",
            "--porcelain",
        ],
    )
}

/// A git repository of a few directories, exported and mounted (kernel options adjusted
/// by `adjust`).
fn setup(adjust: impl FnOnce(&mut MountConfig)) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    for d in ["a", "a/deep", "b", "c"] {
        std::fs::create_dir_all(src.join(d)).unwrap();
    }
    for i in 0..24 {
        let dir = ["a", "a/deep", "b", "c", ""][i % 5];
        std::fs::write(
            src.join(dir).join(format!("f{i}.txt")),
            format!("file {i}\n"),
        )
        .unwrap();
    }
    git(&src, &["init", "-q", "-b", "main"]);
    git(&src, &["add", "-A"]);
    git(&src, &["commit", "-qm", "init"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let registry = ExportRegistry::new();
    let lease = Arc::new(Lease::grant(
        Arc::new(SystemClock::new()),
        LeaseTerms {
            ttl: Duration::from_secs(900),
            max_ttl: Duration::from_secs(900),
            flush_grace: Duration::from_secs(10),
        },
    ));
    let export = registry
        .register(
            "fsm".into(),
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
    let addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        let router = registry.router();
        tokio::spawn(async move { axum::serve(l, router).await });
        a
    });
    let state = tmp.path().join("state");
    let mut cfg = MountConfig::new(&format!("http://{addr}"), "fsm", "tok", &mnt, &state);
    cfg.manifest_digest = Some(export.manifest_digest());
    cfg.remaining = Some(Duration::from_secs(900));
    adjust(&mut cfg);
    let mount = Mount::start(cfg).unwrap();
    Setup {
        _tmp: tmp,
        src,
        mnt,
        mount,
        _rt: rt,
    }
}

/// Every path below `root` but `.git`: kind, executable bit, content.
fn snapshot(root: &Path) -> BTreeMap<String, (bool, bool, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel == ".git" {
                continue;
            }
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if m.is_dir() {
                out.insert(rel, (true, false, Vec::new()));
                stack.push(p);
            } else {
                let content = std::fs::read(&p).unwrap_or_default();
                out.insert(rel, (false, m.permissions().mode() & 0o100 != 0, content));
            }
        }
    }
    out
}

/// The files and directories (relative, `.git` left out) of `root`.
fn listing(root: &Path) -> (Vec<String>, Vec<String>) {
    let snap = snapshot(root);
    let files = snap
        .iter()
        .filter(|(_, v)| !v.0)
        .map(|(k, _)| k.clone())
        .collect();
    let dirs = snap
        .iter()
        .filter(|(_, v)| v.0)
        .map(|(k, _)| k.clone())
        .collect();
    (files, dirs)
}

/// One random change under `root`; says what it did.
fn change(rng: &mut StdRng, root: &Path, n: &mut u32, agent: bool) -> String {
    let (files, dirs) = listing(root);
    let pick = |rng: &mut StdRng, v: &[String]| v[rng.random_range(0..v.len())].clone();
    let any_dir = |rng: &mut StdRng| {
        if dirs.is_empty() || rng.random_bool(0.3) {
            String::new()
        } else {
            pick(rng, &dirs)
        }
    };
    *n += 1;
    let kind = if files.len() < 12 {
        0
    } else {
        rng.random_range(0..if agent { 10 } else { 9 })
    };
    match kind {
        0 => {
            let p = Path::new(&any_dir(rng)).join(format!("new{n}.txt"));
            std::fs::write(root.join(&p), format!("new {n}\n")).unwrap();
            format!("create {}", p.display())
        }
        1 => {
            let p = pick(rng, &files);
            let mut c = std::fs::read(root.join(&p)).unwrap();
            c.extend_from_slice(format!("more {n}\n").as_bytes());
            std::fs::write(root.join(&p), c).unwrap();
            format!("append {p}")
        }
        2 => {
            // Same size, new content: only the times tell.
            let p = pick(rng, &files);
            let mut c = std::fs::read(root.join(&p)).unwrap();
            if let Some(b) = c.first_mut() {
                *b = if *b == b'X' { b'Y' } else { b'X' };
            }
            std::fs::write(root.join(&p), c).unwrap();
            format!("rewrite in place {p}")
        }
        3 => {
            let p = pick(rng, &files);
            std::fs::remove_file(root.join(&p)).unwrap();
            format!("delete {p}")
        }
        4 => {
            let p = pick(rng, &files);
            let to = Path::new(&any_dir(rng)).join(format!("moved{n}.txt"));
            std::fs::rename(root.join(&p), root.join(&to)).unwrap();
            format!("rename {p} -> {}", to.display())
        }
        5 => {
            let p = pick(rng, &files);
            let m = std::fs::metadata(root.join(&p))
                .unwrap()
                .permissions()
                .mode();
            let mode = if m & 0o100 != 0 { 0o644 } else { 0o755 };
            std::fs::set_permissions(root.join(&p), std::fs::Permissions::from_mode(mode)).unwrap();
            format!("chmod {mode:o} {p}")
        }
        6 => {
            let d = Path::new(&any_dir(rng)).join(format!("dir{n}"));
            std::fs::create_dir(root.join(&d)).unwrap();
            std::fs::write(root.join(&d).join("inside.txt"), "inside\n").unwrap();
            format!("mkdir {} with a file", d.display())
        }
        7 if !dirs.is_empty() => {
            let d = pick(rng, &dirs);
            let to = format!("renamed{n}");
            std::fs::rename(root.join(&d), root.join(&to)).unwrap();
            format!("rename directory {d} -> {to}")
        }
        8 if !dirs.is_empty() => {
            let d = pick(rng, &dirs);
            std::fs::remove_dir_all(root.join(&d)).unwrap();
            format!("remove directory {d}")
        }
        9 => {
            git(root, &["add", "-A"]);
            git(
                root,
                &["commit", "-qm", &format!("round {n}"), "--allow-empty"],
            );
            "commit everything".to_string()
        }
        _ => {
            let p = Path::new(&any_dir(rng)).join(format!("late{n}.txt"));
            std::fs::write(root.join(&p), "late\n").unwrap();
            format!("create {}", p.display())
        }
    }
}

/// Wait until the mount and the exported directory agree (both ways of write-back done).
fn settle(s: &Setup, what: &str) {
    let start = Instant::now();
    loop {
        let (a, b) = (snapshot(&s.mnt), snapshot(&s.src));
        if a == b {
            return;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let only_mnt: Vec<_> = a.keys().filter(|k| b.get(*k) != a.get(*k)).collect();
            let only_src: Vec<_> = b.keys().filter(|k| a.get(*k) != b.get(*k)).collect();
            panic!(
                "mount and Delegator never agreed after {what}: differing on the mount \
                 {only_mnt:?}, in the Delegator's tree {only_src:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn random_rounds(seed: u64, rounds: usize, adjust: impl FnOnce(&mut MountConfig)) {
    let s = setup(adjust);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0;
    // The first monitored run writes the index with the monitor's marks.
    assert_eq!(status_monitored(&s.mnt), status_reference(&s.mnt));
    let mut history = Vec::new();
    for round in 0..rounds {
        let agent = rng.random_bool(0.5);
        let root = if agent { &s.mnt } else { &s.src };
        let concurrent = agent && rng.random_bool(0.3);
        let mnt = s.mnt.clone();
        let during = concurrent.then(|| std::thread::spawn(move || status_monitored(&mnt)));
        let mut ops = Vec::new();
        for _ in 0..rng.random_range(1..=3) {
            ops.push(change(&mut rng, root, &mut n, agent));
        }
        if let Some(t) = during {
            t.join().expect("the concurrent git status");
        }
        let side = if agent { "agent" } else { "Delegator" };
        history.push(format!("round {round} ({side}): {}", ops.join("; ")));
        settle(&s, history.last().unwrap());
        let monitored = status_monitored(&s.mnt);
        let reference = status_reference(&s.mnt);
        assert_eq!(
            monitored,
            reference,
            "seed {seed}: git status with the monitor differs from a full scan after:\n{}",
            history.join("\n")
        );
    }
    // The monitor was used: the index marks every tracked file that is unchanged as
    // unchanged since its token (lowercase tags in `git ls-files -f`), so git lstats none
    // of them.
    let changed = status_monitored(&s.mnt);
    let tags = git_monitored(&s.mnt, &["ls-files", "-f"]);
    let clean: Vec<&str> = tags
        .lines()
        .filter(|l| !changed.lines().any(|c| c.get(3..) == l.get(2..)))
        .collect();
    assert!(
        // Most, not all: an entry git finds racily clean (its mtime at the index's) stays
        // unmarked until a later write of the index.
        !clean.is_empty() && clean.iter().filter(|l| l.starts_with('h')).count() * 2 >= clean.len(),
        "the index does not mark the unchanged files as the monitor's (status {changed:?}): {tags}"
    );
}

#[test]
fn git_status_with_the_monitor_matches_a_full_scan_over_random_changes() {
    if !fuse_available() || !awcpfs_git_available() {
        return;
    }
    random_rounds(0xA11CE, 60, |_| {});
}

#[test]
fn wbcache_git_status_with_the_monitor_matches_with_the_writeback_cache() {
    if !fuse_available() || !awcpfs_git_available() {
        return;
    }
    // Written pages reach the mount late under the cache: the hook's syncfs brings them.
    random_rounds(0xB0B, 30, |c| c.kernel.writeback_cache = true);
}

/// git is needed; skipping without it is loud, and fails in CI.
fn awcpfs_git_available() -> bool {
    let ok = Command::new("git").arg("--version").output().is_ok();
    if !ok {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "git must be installed in CI"
        );
        eprintln!("\n!!!!!!!! SKIPPING an fsmonitor test: git is not installed !!!!!!!!\n");
    }
    ok
}
