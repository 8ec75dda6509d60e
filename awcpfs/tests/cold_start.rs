//! The first command on a fresh mount (issue 21), through the kernel: a hydration policy is
//! obeyed (what a `none` mount fetches against an `all` mount), `git status` on a `first`
//! mount is right and fetches a fraction of the tree, and `status.json` reports the plan.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::hydrate::HydratePolicy;
use awcpfs::mount::{Mount, MountConfig};
use awcpfs::testing::fuse_available;

struct Setup {
    _tmp: tempfile::TempDir,
    /// Bytes of files whose content an earlier file of the tree already has (git's logs
    /// of one commit, say): a batch fetches such content once.
    duplicate_bytes: u64,
    mnt: PathBuf,
    state: PathBuf,
    mount: Mount,
    _rt: tokio::runtime::Runtime,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.mount.end(awcpfs::mount::EndReason::Unmounted, None);
    }
}

/// Whether git is here; without it the test skips loudly, except under `CI=true`.
fn git_available() -> bool {
    let ok = Command::new("git")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "git is needed in CI (apt-get install git)"
        );
        awcpfs::testing::skipped("the git cold-start test", "apt-get install git");
    }
    ok
}

fn sh(dir: &Path, script: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("HOME", dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "`{script}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A git repository of 3 packages x 40 modules (plus a 6 MiB data file), committed and
/// packed, its index refreshed: the Delegator's working tree.
fn repo(root: &Path) -> u64 {
    for p in 0..3 {
        let d = root.join(format!("pkg{p}"));
        std::fs::create_dir_all(&d).unwrap();
        for m in 0..40 {
            let body = format!("def f{m}():\n    return {}\n", p * 1000 + m).repeat(40);
            std::fs::write(d.join(format!("mod{m:02}.py")), body).unwrap();
        }
    }
    let data: Vec<u8> = (0..6u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(root.join("data.bin"), data).unwrap();
    std::fs::write(root.join(".gitignore"), "*.pyc\n").unwrap();
    sh(
        root,
        "git init -q -b main && git add -A && git -c user.name=d -c user.email=d@x commit -qm init \
         && git gc -q && git status --porcelain",
    );
    let mut total = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                total += e.metadata().unwrap().len();
            }
        }
    }
    total
}

/// Bytes of the files below `root` whose content an earlier file (in walk order) has.
fn duplicate_bytes(root: &Path) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let mut dup = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else if e.file_type().unwrap().is_file() {
                let data = std::fs::read(e.path()).unwrap();
                if !seen.insert(blake3::hash(&data)) {
                    dup += data.len() as u64;
                }
            }
        }
    }
    dup
}

/// Export `repo()` and mount it with `policy`. Returns the setup and the tree's bytes.
fn setup(policy: HydratePolicy) -> (Setup, u64) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let total = repo(&src);
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
            "cold".into(),
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
    let mut cfg = MountConfig::new(&format!("http://{addr}"), "cold", "tok", &mnt, &state);
    cfg.manifest_digest = Some(export.manifest_digest());
    cfg.hydrate = policy;
    let mount = Mount::start(cfg).unwrap();
    (
        Setup {
            duplicate_bytes: duplicate_bytes(&src),
            _tmp: tmp,
            mnt,
            state,
            mount,
            _rt: rt,
        },
        total,
    )
}

/// Wait (at most 60 s) until the mount's hydration plan is through.
fn hydrated(s: &Setup) -> awcpfs::mount::hydrate::ProgressSnapshot {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let h = s.mount.status().hydration;
        if h.finished {
            return h;
        }
        assert!(Instant::now() < deadline, "hydration never finished: {h:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn cold_a_none_mount_fetches_only_what_is_read_and_an_all_mount_every_small_file() {
    if !fuse_available() || !git_available() {
        return;
    }
    let (none, total) = setup(HydratePolicy::None);
    let h = hydrated(&none);
    assert_eq!((h.policy.as_str(), h.files_planned), ("none", 0));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        none.mount.stats().bytes_fetched,
        0,
        "nothing fetched unasked"
    );
    let m = std::fs::read_to_string(none.mnt.join("pkg1/mod07.py")).unwrap();
    assert_eq!(m, "def f7():\n    return 1007\n".repeat(40));
    assert_eq!(none.mount.stats().bytes_fetched, m.len() as u64);

    let (all, _) = setup(HydratePolicy::default());
    let h = hydrated(&all);
    assert!(h.files_planned > 120, "{h:?}");
    assert_eq!((h.files_remaining, h.bytes_remaining), (0, 0), "{h:?}");
    let fetched = all.mount.stats().bytes_fetched;
    // Every planned file came over the wire, content shared by several files once.
    assert!(
        fetched + all.duplicate_bytes >= h.bytes_planned && fetched < total,
        "fetched {fetched} of {total}; planned {}, {} bytes of files with the content of \
         another",
        h.bytes_planned,
        all.duplicate_bytes
    );
    // What status.json says is what the mount counted.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = walk_find(&all.state, "status.json")
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
            && v["hydration"]["finished"] == true
        {
            assert_eq!(v["hydration"]["filesPlanned"], h.files_planned);
            assert_eq!(v["hydration"]["filesRemaining"], 0);
            break;
        }
        assert!(Instant::now() < deadline, "status.json: {text}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn walk_find(dir: &Path, name: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir(dir).ok()? {
        let e = e.ok()?;
        if e.file_name() == name {
            return Some(e.path());
        }
        if e.file_type().ok()?.is_dir()
            && let Some(p) = walk_find(&e.path(), name)
        {
            return Some(p);
        }
    }
    None
}

#[test]
fn cold_git_status_and_a_test_run_on_a_first_mount_are_right_and_fetch_a_fraction() {
    if !fuse_available() || !git_available() {
        return;
    }
    let (s, total) = setup(HydratePolicy::First);
    // The Delegator's index matches this tree: nothing to report, and no file's content
    // is needed to know it.
    assert_eq!(sh(&s.mnt, "git status --porcelain"), "");
    assert_eq!(
        sh(&s.mnt, "git log --format=%s"),
        "init\n",
        "the commit is read from the pack"
    );
    hydrated(&s);
    let after_git = s.mount.stats().bytes_fetched;
    assert!(
        after_git < total / 2,
        "git status fetched {after_git} of {total} bytes"
    );
    // A test run's reads of one package: every module right.
    for m in 0..40 {
        let got = std::fs::read_to_string(s.mnt.join(format!("pkg2/mod{m:02}.py"))).unwrap();
        assert_eq!(
            got,
            format!("def f{m}():\n    return {}\n", 2000 + m).repeat(40)
        );
    }
    // And a ranged read far into the large file.
    let data = std::fs::read(s.mnt.join("data.bin")).unwrap();
    assert_eq!(data.len(), 6 << 20);
    assert!(
        data.iter()
            .enumerate()
            .all(|(i, b)| *b == ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8)
    );
    assert!(
        s.mount.stats().bytes_fetched < total,
        "pkg0 and pkg1 were never read"
    );
}
