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
//!
//! Every few rounds the mount is replaced by a fresh mount of the same export, which
//! finds the index written under the old one: after a clean end it answers the old token
//! from its log (the export's changes since registration, Delegator-side ones made while
//! no mount was up included), after an end the export was not told of with "everything";
//! and a mount of another export of the same directory never answers it from its log.

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
    tmp: tempfile::TempDir,
    src: PathBuf,
    mnt: PathBuf,
    mount: Mount,
    addr: std::net::SocketAddr,
    registry: ExportRegistry,
    /// The export mounted (id, manifest digest).
    export: (String, String),
    /// Mounts started so far (each gets its own state directory).
    mounts: usize,
    adjust: fn(&mut MountConfig),
    _rt: tokio::runtime::Runtime,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.mount.end(awcpfs::mount::EndReason::Unmounted, None);
    }
}

impl Setup {
    /// A new mount of export `id` (digest `digest`) at the mount point, with a fresh state
    /// directory.
    fn start_mount(&mut self, id: &str, digest: &str) -> Mount {
        self.mounts += 1;
        let state = self.tmp.path().join(format!("state{}", self.mounts));
        let mut cfg = MountConfig::new(
            &format!("http://{}", self.addr),
            id,
            "tok",
            &self.mnt,
            &state,
        );
        cfg.manifest_digest = Some(digest.to_string());
        cfg.remaining = Some(Duration::from_secs(900));
        (self.adjust)(&mut cfg);
        Mount::start(cfg).unwrap()
    }

    /// Register another export of the same directory (another registration: its mounts
    /// must never take this one's word for what changed).
    fn another_export(&self, id: &str) -> (String, String) {
        let export = self
            .registry
            .register(
                id.into(),
                "tok".into(),
                ExportConfig {
                    root: self.src.clone(),
                    read_only: false,
                    block_size: 1 << 20,
                    staging_dir: self.tmp.path().join(format!("staging-{id}")),
                },
                lease(),
            )
            .unwrap();
        (id.to_string(), export.manifest_digest())
    }
}

fn lease() -> Arc<Lease> {
    Arc::new(Lease::grant(
        Arc::new(SystemClock::new()),
        LeaseTerms {
            ttl: Duration::from_secs(900),
            max_ttl: Duration::from_secs(900),
            flush_grace: Duration::from_secs(10),
        },
    ))
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
        "git {args:?} failed ({}): {}\n.git/HEAD: {:?}; .git/objects: {:?}; .git/refs: {:?}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        std::fs::read(dir.join(".git/HEAD")).map(String::from_utf8),
        std::fs::metadata(dir.join(".git/objects")).map(|m| m.permissions()),
        std::fs::metadata(dir.join(".git/refs")).map(|m| m.permissions()),
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

/// The fsmonitor token the index of the repository at `dir` holds (its `FSMN` extension:
/// signature, size, version, then the token up to a NUL).
fn index_token(dir: &Path) -> String {
    let index = std::fs::read(dir.join(".git/index")).unwrap();
    let at = index
        .windows(4)
        .rposition(|w| w == b"FSMN")
        .expect("the index has no fsmonitor extension");
    let rest = &index[at + 12..];
    let end = rest.iter().position(|&b| b == 0).unwrap();
    String::from_utf8(rest[..end].to_vec()).unwrap()
}

/// Whether the mount answers the hook's question for `token` with "everything".
fn answers_everything(dir: &Path, token: &str) -> bool {
    let answer = awcpfs::fsmonitor::query(dir, "2", token).expect("the hook's question");
    let body = &answer[answer.iter().position(|&b| b == 0).unwrap() + 1..];
    body == b"/\0"
}

/// A git repository of a few directories, exported and mounted (kernel options adjusted
/// by `adjust`).
fn setup(adjust: fn(&mut MountConfig)) -> Setup {
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
            lease(),
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
        tmp,
        src,
        mnt,
        mount,
        addr,
        registry,
        export: ("fsm".into(), export.manifest_digest()),
        mounts: 0,
        adjust,
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

/// Rounds of random changes (see the module docs). Every `remount_every` rounds (0:
/// never) the mount ends — cleanly, telling the export, or (every third time) written back
/// in full but without telling it — sometimes with Delegator-side changes while no mount is
/// up, and a new mount of the same export takes over the index written under the old one:
/// it must answer the old mount's token from its log after a clean end, and with
/// "everything" otherwise. At the end a mount of another export of the same directory
/// must answer the last token with "everything".
fn random_rounds(seed: u64, rounds: usize, remount_every: usize, adjust: fn(&mut MountConfig)) {
    // `RUST_LOG=awcpfs=info` shows the mounts' and exports' logs beside a failure.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let mut s = setup(adjust);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0;
    // The first monitored run writes the index with the monitor's marks.
    assert_eq!(status_monitored(&s.mnt), status_reference(&s.mnt));
    let mut history = Vec::new();
    let mut remounts = 0;
    let mut from_log = 0;
    for round in 0..rounds {
        if remount_every > 0 && round > 0 && round % remount_every == 0 {
            remounts += 1;
            let clean = remounts % 3 != 0;
            let token = index_token(&s.mnt);
            if clean {
                s.mount.finish();
            } else {
                s.mount
                    .flush()
                    .expect("the write-back before an unannounced end");
                s.mount.end(awcpfs::mount::EndReason::Unmounted, None);
            }
            let mut ops = Vec::new();
            if rng.random_bool(0.5) {
                for _ in 0..rng.random_range(1..=3) {
                    ops.push(change(&mut rng, &s.src, &mut n, false));
                }
            }
            let export = s.export.clone();
            s.mount = s.start_mount(&export.0, &export.1);
            let how = if clean { "clean" } else { "unannounced" };
            history.push(format!(
                "round {round}: {how} remount, Delegator while unmounted: {}",
                ops.join("; ")
            ));
            settle(&s, history.last().unwrap());
            let everything = answers_everything(&s.mnt, &token);
            assert_eq!(
                everything,
                !clean,
                "seed {seed}: after a {how} end, a new mount of the same export answered the \
                 old mount's token {token} with{} \"everything\"",
                if everything { "" } else { "out" }
            );
            from_log += usize::from(!everything);
            let monitored = status_monitored(&s.mnt);
            let reference = status_reference(&s.mnt);
            assert_eq!(
                monitored,
                reference,
                "seed {seed}: git status with the monitor differs from a full scan on a new \
                 mount after:\n{}",
                history.join("\n")
            );
        }
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
    if remount_every > 0 && rounds > remount_every {
        assert!(
            from_log > 0,
            "no new mount answered an earlier mount's token"
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
    if remount_every > 0 {
        // Another registration never takes this one's word, whatever its mounts did.
        let token = index_token(&s.mnt);
        let other = s.another_export("fsm-other");
        s.mount.finish();
        s.mount = s.start_mount(&other.0, &other.1);
        s.export = other;
        assert!(
            answers_everything(&s.mnt, &token),
            "a mount of another export answered {token} from its log"
        );
        assert_eq!(status_monitored(&s.mnt), status_reference(&s.mnt));
    }
}

#[test]
fn git_status_with_the_monitor_matches_a_full_scan_over_random_changes() {
    if !fuse_available() || !awcpfs_git_available() {
        return;
    }
    random_rounds(0xA11CE, 60, 10, |_| {});
}

#[test]
fn wbcache_git_status_with_the_monitor_matches_with_the_writeback_cache() {
    if !fuse_available() || !awcpfs_git_available() {
        return;
    }
    // Written pages reach the mount late under the cache: the hook's syncfs brings them.
    random_rounds(0xB0B, 30, 10, |c| c.kernel.writeback_cache = true);
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

// git runs the hook on every `git status`, so `awcpfs fsmonitor VERSION TOKEN` answers
// before the argument parser is built; anything else (help, options) still reaches it.
#[test]
fn the_hook_command_answers_without_the_parser_and_help_still_works() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_awcpfs"))
            .args(args)
            .current_dir(dir.path())
            .output()
            .expect("awcpfs runs")
    };
    let out = run(&["fsmonitor", "2", "awcpfs:00ff:1"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("awcpfs fsmonitor: ") && err.contains("is not on an awcpfs mount"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "git would take it for an answer");
    let out = run(&["fsmonitor", "1", ""]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("protocol version 1"));
    let out = run(&["fsmonitor", "--help"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));
}

/// A new delegation's mount shows git the Delegator's index with a monitor extension of its
/// own (`mount/prime.rs`): the first `git status` trusts every entry whose stat data the
/// mount shows as recorded and looks at the rest — files the Delegator changed after its
/// index was written (same size and a new size), removed, made executable, only touched —
/// and says exactly what a full scan says. Until git writes the index itself, nothing goes
/// back to the Delegator.
#[test]
fn a_new_export_s_first_git_status_trusts_the_entries_the_mount_shows_unchanged() {
    if !fuse_available() || !awcpfs_git_available() {
        return;
    }
    let mut s = setup(|_| {});
    // git writes the index under the monitor: with its extension and an untracked cache.
    status_monitored(&s.mnt);
    assert_eq!(status_monitored(&s.mnt), status_reference(&s.mnt));
    s.mount.finish();
    // The Delegator works on without git: its index is stale for these.
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(s.src.join("a/f0.txt"), "FILE 0\n").unwrap(); // same size
    std::fs::write(s.src.join("a/deep/f1.txt"), "file 1, longer\n").unwrap();
    std::fs::remove_file(s.src.join("b/f2.txt")).unwrap();
    std::fs::set_permissions(
        s.src.join("c/f3.txt"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    Command::new("touch")
        .arg(s.src.join("f4.txt"))
        .status()
        .unwrap();
    std::fs::write(s.src.join("b/untracked.txt"), "new\n").unwrap();
    let delegators_index = std::fs::read(s.src.join(".git/index")).unwrap();

    let other = s.another_export("fsm-new");
    s.mount = s.start_mount(&other.0, &other.1);
    let shown = std::fs::read(s.mnt.join(".git/index")).unwrap();
    assert_ne!(shown, delegators_index, "the index is shown as it came");
    let token = index_token(&s.mnt);
    assert!(
        !answers_everything(&s.mnt, &token),
        "the mount does not answer the token {token} it put in the index"
    );
    // Shown, not written back.
    s.mount.finish();
    assert_eq!(
        std::fs::read(s.src.join(".git/index")).unwrap(),
        delegators_index,
        "showing the index wrote it back"
    );
    s.mount = s.start_mount(&other.0, &other.1);

    let tags = git_monitored(&s.mnt, &["ls-files", "-f"]);
    let changed = [
        "a/f0.txt",
        "a/deep/f1.txt",
        "b/f2.txt",
        "c/f3.txt",
        "f4.txt",
    ];
    let mut trusted = 0;
    for line in tags.lines() {
        let (tag, path) = line.split_once(' ').unwrap();
        let lower = tag.chars().all(|c| c.is_ascii_lowercase());
        if changed.contains(&path) {
            assert!(!lower, "git trusts {path}, which changed: {tags}");
        }
        trusted += usize::from(lower);
    }
    assert!(
        trusted >= 24 - changed.len() - 2,
        "git trusts only {trusted} entries: {tags}"
    );
    // The untracked cache was kept for the directories whose listing did not change: git
    // reads b/ (a file removed, one created) and not every directory.
    let hook =
        awcpfs::fsmonitor::hook_command(Path::new(env!("CARGO_BIN_EXE_awcpfs")), &["fsmonitor"]);
    let traced = Command::new("git")
        .args(["-c", &format!("core.fsmonitor={hook}")])
        .args([
            "-c",
            "core.fsmonitorHookVersion=2",
            "-c",
            "core.untrackedCache=true",
        ])
        .args(["status", "--porcelain"])
        .current_dir(&s.mnt)
        .env_remove("GIT_CONFIG_COUNT")
        .env("GIT_TRACE2_EVENT", s.tmp.path().join("trace2.json"))
        .env("GIT_TRACE2_EVENT_NESTING", "10")
        .output()
        .unwrap();
    assert!(traced.status.success());
    let trace = std::fs::read_to_string(s.tmp.path().join("trace2.json")).unwrap();
    let opened: Vec<u64> = trace
        .lines()
        .filter(|l| l.contains(r#""key":"opendir""#))
        .filter_map(|l| {
            let v = l.split(r#""value":""#).nth(1)?;
            v.split('"').next()?.parse().ok()
        })
        .collect();
    assert!(
        opened.len() == 1 && opened[0] <= 2,
        "git read {opened:?} directories of 5 (the untracked cache was not kept)"
    );
    assert_eq!(
        String::from_utf8_lossy(&traced.stdout),
        status_reference(&s.mnt)
    );
}
