//! Every crash point of the mount's whole state directory is safe, through the real
//! recovery (in the manner of ALICE and CrashMonkey).
//!
//! A real `awcpfs mount` (the binary) keeps its state directory on a recording filesystem
//! ([`awcpfs::testing::recordfs`]), which passes everything through and records each write,
//! truncation, creation, rename, removal, file sync and directory sync the mount makes —
//! to `journal.log`, the upper files, `synced.log`, `manifest.bin`, the pack file and
//! anything else it writes there. A workload runs on the mount through the kernel (files
//! created, overwritten and appended to, some with `fsync`; renames, some over another
//! name; unlinks; directory syncs), while the mount writes back to an export in this
//! process, whose tree is copied after every commit it applies.
//!
//! Then, for many crash points, the state directory is rebuilt as a crash there could have
//! left it — the process killed (everything it did kept), or the power lost (namespace
//! changes kept up to a random cut and wherever a directory sync made them durable, each
//! write after its file's last sync kept, dropped or torn) — and the export as it was then
//! (every commit answered before the crash applied, one in flight either applied or not).
//! `awcpfs::mount::recover::recover`, the function `awcpfs recover` calls, runs on it
//! against a real export of that tree, and must
//!
//! * succeed (never panic, never refuse a state a crash can produce);
//! * make no conflict copy and report no conflict (only this mount wrote);
//! * lose nothing acknowledged: at every path the export ends with the content the
//!   workload last had acknowledged there — synced by the caller (`fsync` of the file, or
//!   of the directory for a rename or unlink), committed to the export, or, for a killed
//!   process, returned — or with a later one; never an older one, never one never written.
//!
//! `AWCP_CRASH_OPS` and `AWCP_CRASH_STATES` set the size (CI: 40 operations, 120 crash
//! states; `scripts/soak.sh` runs more), `AWCP_SEED` the seed.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcp_protocol::TransportHandle;
use awcp_protocol::transport::AwcpfsHandle;
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::remote::HttpRemote;
use awcpfs::testing::fuse_available;
use awcpfs::testing::recordfs::{self, Loss, Op, Recorder};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BIN: &str = env!("CARGO_BIN_EXE_awcpfs");
const EXPORT_ID: &str = "crash";
const TOKEN: &str = "tok";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

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
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn lease() -> Arc<Lease> {
    Arc::new(Lease::grant(
        Arc::new(SystemClock::new()),
        LeaseTerms {
            ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(600),
            flush_grace: Duration::from_secs(5),
        },
    ))
}

/// Copy the files of `from` (one level of directories) into `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_tree(&p, &to.join(e.file_name()));
        } else if p.is_file() {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

/// The regular files under `dir`, path → content.
fn files(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.insert(
                    rel,
                    String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into_owned(),
                );
            }
        }
    }
    out
}

/// One state of one path in the workload's history.
#[derive(Debug, Clone)]
struct Version {
    /// The content (`None`: absent).
    content: Option<String>,
    /// Recorded operations before the workload operation that made it started.
    start: usize,
    /// … and when it returned (`usize::MAX`: a state inside an operation, never returned).
    end: usize,
    /// When a sync the caller asked for made it durable.
    durable: Option<usize>,
}

/// A copy of the export after a commit: its tree and staging directory, and the recorded
/// operations when the commit arrived and when it was applied.
struct Snapshot {
    dir: PathBuf,
    arrived: usize,
    applied: usize,
}

struct Tracker {
    recorder: Arc<Recorder>,
    root: PathBuf,
    staging: PathBuf,
    snaps_dir: PathBuf,
    snaps: parking_lot::Mutex<Vec<Snapshot>>,
    serial: tokio::sync::Mutex<()>,
    /// Every block ever uploaded (kept by the export in its staging directory).
    blocks: PathBuf,
}

impl Tracker {
    /// Keep every block uploaded so far: the export keeps them whether or not the commit
    /// that needs them arrives.
    fn keep_blocks(&self) {
        for e in std::fs::read_dir(&self.staging).unwrap().flatten() {
            let name = e.file_name();
            if name.len() == 64 && !self.blocks.join(&name).exists() {
                let _ = std::fs::copy(e.path(), self.blocks.join(&name));
            }
        }
    }

    fn snapshot(&self, arrived: usize) {
        let applied = self.recorder.len();
        let mut snaps = self.snaps.lock();
        let dir = self.snaps_dir.join(snaps.len().to_string());
        copy_tree(&self.root, &dir.join("root"));
        copy_tree(&self.staging, &dir.join("staging"));
        snaps.push(Snapshot {
            dir,
            arrived,
            applied,
        });
    }
}

#[test]
fn every_crash_point_of_the_state_directory_recovers_everything_acknowledged() {
    if !fuse_available() {
        return;
    }
    let seed = env_or("AWCP_SEED", rand::random::<u32>() as u64);
    let n_ops = env_or("AWCP_CRASH_OPS", 40) as usize;
    let n_states = env_or("AWCP_CRASH_STATES", 120) as usize;
    eprintln!("crash states: AWCP_SEED={seed} AWCP_CRASH_OPS={n_ops} AWCP_CRASH_STATES={n_states}");
    let mut rng = StdRng::seed_from_u64(seed);

    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let staging = tmp.path().join("staging");
    let backing = tmp.path().join("backing");
    let recmnt = tmp.path().join("state");
    let mnt = tmp.path().join("mnt");
    for d in [&src, &staging, &backing, &recmnt, &mnt] {
        std::fs::create_dir_all(d).unwrap();
    }
    let mut history: BTreeMap<String, Vec<Version>> = BTreeMap::new();
    for i in 0..12 {
        let c = format!("orig {i}\n");
        std::fs::write(src.join(format!("f{i}")), &c).unwrap();
        history.insert(
            format!("f{i}"),
            vec![Version {
                content: Some(c),
                start: 0,
                end: 0,
                durable: Some(0),
            }],
        );
    }
    let recorder = Arc::new(Recorder::mount(&backing, &recmnt).unwrap());

    // The export, in this process, copied after each commit it applies.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let registry = ExportRegistry::new();
    let export = registry
        .register(
            EXPORT_ID.into(),
            TOKEN.into(),
            ExportConfig {
                root: src.clone(),
                read_only: false,
                block_size: 4096,
                staging_dir: staging.clone(),
            },
            lease(),
        )
        .unwrap();
    let tracker = Arc::new(Tracker {
        recorder: recorder.clone(),
        root: src.clone(),
        staging: staging.clone(),
        snaps_dir: tmp.path().join("snaps"),
        snaps: Default::default(),
        serial: Default::default(),
        blocks: tmp.path().join("blocks"),
    });
    std::fs::create_dir_all(&tracker.blocks).unwrap();
    tracker.snapshot(0);
    let t = tracker.clone();
    let router = registry.router().layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let t = t.clone();
            async move {
                let commit = req.method() == axum::http::Method::POST
                    && req.uri().path().ends_with("/commit");
                if !commit {
                    return next.run(req).await;
                }
                let _one = t.serial.lock().await;
                let arrived = t.recorder.len();
                t.keep_blocks();
                let resp = next.run(req).await;
                if resp.status().is_success() {
                    t.snapshot(arrived);
                }
                resp
            }
        },
    ));
    let addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, router).await });
        a
    });
    let handle = tmp.path().join("h.json");
    std::fs::write(
        &handle,
        serde_json::to_vec(&TransportHandle::Awcpfs(AwcpfsHandle {
            endpoint: format!("http://{addr}"),
            token: TOKEN.into(),
            export_id: EXPORT_ID.into(),
            manifest_digest: export.manifest_digest(),
            block_size: 4096,
            expires_at: "2099-01-01T00:00:00.000Z".into(),
            tls_fingerprint: None,
            remaining_ms: None,
            resources: None,
        }))
        .unwrap(),
    )
    .unwrap();
    let mut mount = Killed(
        Command::new(BIN)
            .arg("mount")
            .arg(&handle)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(&recmnt)
            .env("AWCP_LOG", "warn")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the mount", || is_mounted(&mnt));

    // The workload, each operation's versions noted with where the record stood.
    let at = |p: &str| mnt.join(p);
    let mut names: Vec<String> = history.keys().cloned().collect();
    let note = |history: &mut BTreeMap<String, Vec<Version>>,
                path: &str,
                content: Option<String>,
                start: usize,
                end: usize,
                durable: bool| {
        history.entry(path.to_string()).or_default().push(Version {
            content,
            start,
            end,
            durable: durable.then_some(end),
        });
    };
    let sync_dir = |mnt: &Path| {
        let d = std::fs::File::open(mnt).unwrap();
        d.sync_all().unwrap();
    };
    for i in 0..n_ops {
        let pick = names[rng.random_range(0..names.len())].clone();
        let exists = at(&pick).exists();
        let start = recorder.len();
        match rng.random_range(0..8) {
            0 | 1 => {
                // A new file, written whole.
                let name = format!("n{i}");
                let c = format!("new {i}\n").repeat(1 + i % 5);
                let fsync = rng.random_bool(0.4);
                let mut f = std::fs::File::create(at(&name)).unwrap();
                f.write_all(c.as_bytes()).unwrap();
                if fsync {
                    f.sync_all().unwrap();
                }
                drop(f);
                note(
                    &mut history,
                    &name,
                    Some(String::new()),
                    start,
                    usize::MAX,
                    false,
                );
                note(&mut history, &name, Some(c), start, recorder.len(), fsync);
                names.push(name);
            }
            2 if exists => {
                // An existing file overwritten.
                let c = format!("overwritten {i}\n");
                let fsync = rng.random_bool(0.4);
                let mut f = std::fs::File::create(at(&pick)).unwrap();
                f.write_all(c.as_bytes()).unwrap();
                if fsync {
                    f.sync_all().unwrap();
                }
                drop(f);
                note(
                    &mut history,
                    &pick,
                    Some(String::new()),
                    start,
                    usize::MAX,
                    false,
                );
                note(&mut history, &pick, Some(c), start, recorder.len(), fsync);
            }
            3 if exists => {
                // Appended to.
                let before = std::fs::read_to_string(at(&pick)).unwrap();
                let add = format!("appended {i}\n");
                let fsync = rng.random_bool(0.4);
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(at(&pick))
                    .unwrap();
                f.write_all(add.as_bytes()).unwrap();
                if fsync {
                    f.sync_all().unwrap();
                }
                drop(f);
                note(
                    &mut history,
                    &pick,
                    Some(before + &add),
                    start,
                    recorder.len(),
                    fsync,
                );
            }
            4 | 5 if exists => {
                // Renamed to a new name, or over another one; sometimes made durable.
                let to = if rng.random_bool(0.5) {
                    format!("r{i}")
                } else {
                    names[rng.random_range(0..names.len())].clone()
                };
                if to == pick {
                    continue;
                }
                let content = std::fs::read_to_string(at(&pick)).unwrap();
                std::fs::rename(at(&pick), at(&to)).unwrap();
                let durable = rng.random_bool(0.4);
                if durable {
                    sync_dir(&mnt);
                }
                let end = recorder.len();
                // The file's earlier contents may surface under the new name after a power
                // loss (a write after its last sync lost, the rename kept), and the new name
                // holds its content durably only where the content itself was synced.
                let moved = history.get(&pick).cloned().unwrap_or_default();
                for v in moved.iter().filter(|v| v.content.is_some()) {
                    note(
                        &mut history,
                        &to,
                        v.content.clone(),
                        start,
                        usize::MAX,
                        false,
                    );
                }
                let content_durable = moved.last().is_some_and(|v| v.durable.is_some());
                note(&mut history, &pick, None, start, end, durable);
                note(
                    &mut history,
                    &to,
                    Some(content),
                    start,
                    end,
                    durable && content_durable,
                );
                if !names.contains(&to) {
                    names.push(to);
                }
            }
            6 if exists => {
                std::fs::remove_file(at(&pick)).unwrap();
                let durable = rng.random_bool(0.4);
                if durable {
                    sync_dir(&mnt);
                }
                note(&mut history, &pick, None, start, recorder.len(), durable);
            }
            _ => {
                // Time for the mount to write back.
                std::thread::sleep(Duration::from_millis(rng.random_range(20..120)));
            }
        }
        if rng.random_bool(0.2) {
            std::thread::sleep(Duration::from_millis(rng.random_range(0..80)));
        }
    }
    // Everything written back at least once more, then the end of the record.
    std::thread::sleep(Duration::from_millis(400));
    mount.0.kill().unwrap();
    mount.0.wait().unwrap();
    let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    let ops = recorder.ops();
    drop(mount);
    tracker.keep_blocks();
    let snaps = std::mem::take(&mut *tracker.snaps.lock());
    let total = ops.len();
    let barriers: Vec<usize> = ops
        .iter()
        .enumerate()
        .filter(|(_, op)| matches!(op, Op::Fsync { .. } | Op::FsyncDir { .. }))
        .map(|(i, _)| i + 1)
        .collect();
    eprintln!(
        "crash states: {total} recorded operations ({} syncs), {} commits",
        barriers.len(),
        snaps.len() - 1
    );
    assert!(snaps.len() > 2, "the mount committed too little to test");

    // One export server for the recoveries, an export per crash state.
    let rec_registry = ExportRegistry::new().without_watch();
    let router = rec_registry.router();
    let rec_addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, router).await });
        a
    });
    let mut failures = Vec::new();
    let mut recovered = 0;
    for n in 0..n_states {
        // Half at sync and commit boundaries (where bugs hide), half anywhere.
        let k = match n % 4 {
            0 if !barriers.is_empty() => barriers[rng.random_range(0..barriers.len())],
            1 => {
                let s = &snaps[rng.random_range(0..snaps.len())];
                rng.random_range(s.arrived.saturating_sub(2)..=(s.applied + 2).min(total))
            }
            _ => rng.random_range(0..=total),
        };
        let loss = if n % 3 == 0 {
            Loss::Process
        } else {
            Loss::Power
        };
        // The export then: every commit applied before k, one arriving before k either.
        let mut snap = snaps.iter().rposition(|s| s.applied <= k).unwrap_or(0);
        if let Some(next) = snaps.get(snap + 1)
            && next.arrived <= k
            && rng.random_bool(0.5)
        {
            snap += 1;
        }
        let case = tmp.path().join(format!("case{n}"));
        let image = case.join("state");
        std::fs::create_dir_all(&image).unwrap();
        recordfs::crash_image(&ops, k, loss, &mut rng, &image).unwrap();
        let root = case.join("root");
        copy_tree(&snaps[snap].dir.join("root"), &root);
        // The blocks uploaded by then (a superset does no harm), and the commit log then.
        copy_tree(&tracker.blocks, &case.join("staging"));
        copy_tree(&snaps[snap].dir.join("staging"), &case.join("staging"));
        let id = format!("c{n}");
        rec_registry
            .register(
                id.clone(),
                TOKEN.into(),
                ExportConfig {
                    root: root.clone(),
                    read_only: false,
                    block_size: 4096,
                    staging_dir: case.join("staging"),
                },
                lease(),
            )
            .unwrap();
        let remote = Arc::new(HttpRemote::new(
            &format!("http://{rec_addr}"),
            &id,
            TOKEN,
            Duration::from_secs(10),
        ));
        let what = format!("crash state {n} ({loss:?} at {k}/{total}, export after commit {snap})");
        let state_dir = image.join(EXPORT_ID);
        // Kept as it was for a failure's report (recovery removes what it wrote back).
        copy_tree(&image, &case.join("state-before"));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            awcpfs::mount::recover::recover(&state_dir, remote)
        }));
        let problem = match r {
            Err(_) => Some("recovery panicked".to_string()),
            Ok(Err(awcpfs::mount::recover::RecoverError::NothingHere { .. })) => None,
            Ok(Err(e)) => Some(format!("recovery failed: {}", chain(&e))),
            Ok(Ok(report)) if !report.conflicts.is_empty() => Some(format!(
                "recovery reported conflicts: {:?}",
                report.conflicts
            )),
            Ok(Ok(_)) => None,
        };
        rec_registry.remove(&id);
        let got = files(&root);
        let mut wrong: Vec<String> = problem.into_iter().collect();
        wrong.extend(check(
            &history,
            &snaps[snap],
            &files(&snaps[snap].dir.join("root")),
            &got,
            k,
            loss,
        ));
        if wrong.is_empty() {
            recovered += 1;
            let _ = std::fs::remove_dir_all(&case);
        } else {
            failures.push(format!("{what}:\n  {}", wrong.join("\n  ")));
            if failures.len() >= 5 {
                break;
            }
        }
    }
    assert!(
        failures.is_empty(),
        "seed {seed}: {} crash state(s) recovered wrongly (kept in {}):\n{}",
        failures.len(),
        tmp.keep().display(),
        failures.join("\n")
    );
    eprintln!("crash states: {recovered} crash states recovered safely");
    assert_eq!(recovered, n_states);
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// What is wrong with `got` (the export after recovery) for a crash at `k`.
fn check(
    history: &BTreeMap<String, Vec<Version>>,
    snap: &Snapshot,
    exported: &BTreeMap<String, String>,
    got: &BTreeMap<String, String>,
    k: usize,
    loss: Loss,
) -> Vec<String> {
    let mut wrong = Vec::new();
    let paths: BTreeSet<&String> = history.keys().chain(got.keys()).collect();
    for path in paths {
        if path.contains(".awcp-conflict-") {
            wrong.push(format!("{path}: a conflict copy"));
            continue;
        }
        let Some(versions) = history.get(path) else {
            wrong.push(format!(
                "{path}: at the export, never written by the workload"
            ));
            continue;
        };
        // Versions are in workload order; before the path's first, it was absent.
        let started: Vec<&Version> = versions.iter().filter(|v| v.start < k.max(1)).collect();
        let mut floor: Option<usize> = None;
        for (i, v) in started.iter().enumerate() {
            let acked = match loss {
                Loss::Process => v.end <= k,
                Loss::Power => v.durable.is_some_and(|d| d <= k),
            };
            if acked {
                floor = Some(i);
            }
        }
        // What the export held after the commits applied before the crash.
        let at_export = exported.get(path.as_str());
        if let Some(i) = started
            .iter()
            .rposition(|v| v.content.as_ref() == at_export && v.start < snap.applied.max(1))
        {
            floor = Some(floor.map_or(i, |f| f.max(i)));
        } else if at_export.is_some() {
            wrong.push(format!(
                "{path}: the export held {at_export:?} after a commit, no version of the workload"
            ));
        }
        let g = got.get(path.as_str());
        let allowed: Vec<&Version> = match floor {
            Some(f) => started[f..].to_vec(),
            None => started.clone(),
        };
        let ok = allowed.iter().any(|v| v.content.as_ref() == g)
            || (floor.is_none() && g.is_none())
            // After a power loss, a write after the last acknowledged version may be torn.
            || (loss == Loss::Power
                && g.is_some()
                && allowed
                    .iter()
                    .skip(usize::from(floor.is_some()))
                    .any(|v| v.content.is_some() && v.durable.is_none_or(|d| d > k)));
        if !ok {
            wrong.push(format!(
                "{path}: recovered {g:?}; acknowledged {:?}, allowed {:?}; history {versions:?}",
                floor.map(|f| &started[f].content),
                allowed.iter().map(|v| &v.content).collect::<Vec<_>>()
            ));
        }
    }
    wrong
}

/// The export in this process over `src`, and a handle to it in `handle`; the runtime
/// serving it must live as long as it is used.
fn serve_export(
    src: &Path,
    staging: &Path,
    handle: &Path,
) -> (tokio::runtime::Runtime, Arc<awcpfs::export::Export>) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let registry = ExportRegistry::new();
    let export = registry
        .register(
            EXPORT_ID.into(),
            TOKEN.into(),
            ExportConfig {
                root: src.to_path_buf(),
                read_only: false,
                block_size: 4096,
                staging_dir: staging.to_path_buf(),
            },
            lease(),
        )
        .unwrap();
    let router = registry.router();
    let addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, router).await });
        a
    });
    std::fs::write(
        handle,
        serde_json::to_vec(&TransportHandle::Awcpfs(AwcpfsHandle {
            endpoint: format!("http://{addr}"),
            token: TOKEN.into(),
            export_id: EXPORT_ID.into(),
            manifest_digest: export.manifest_digest(),
            block_size: 4096,
            expires_at: "2099-01-01T00:00:00.000Z".into(),
            tls_fingerprint: None,
            remaining_ms: None,
            resources: None,
        }))
        .unwrap(),
    )
    .unwrap();
    (rt, export)
}

// Regression (issue 30): a commit the export applied but whose outcome synced.log could not
// record (ENOSPC on the `resolved` line) was forgotten once a later commit went through;
// after `kill -9`, recovery compared the mount's next change at that path with the state
// before the forgotten commit and kept the mount's own work as a conflict copy ("changed
// on the export since the base"). Recovery now asks the export which of the commits it
// never saw resolved were applied, and counts those as written back.
#[test]
fn enospc_on_a_commits_outcome_then_kill_9_and_recover_makes_no_conflict_with_itself() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let backing = tmp.path().join("backing");
    let recmnt = tmp.path().join("state");
    let mnt = tmp.path().join("mnt");
    for d in [&src, &backing, &recmnt, &mnt] {
        std::fs::create_dir_all(d).unwrap();
    }
    for f in ["a", "b"] {
        std::fs::write(src.join(f), format!("orig {f}\n")).unwrap();
    }
    let recorder = Recorder::mount(&backing, &recmnt).unwrap();
    let handle = tmp.path().join("h.json");
    let (_rt, _export) = serve_export(&src, &tmp.path().join("staging"), &handle);
    let mut mount = Killed(
        Command::new(BIN)
            .arg("mount")
            .arg(&handle)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(&recmnt)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the mount", || is_mounted(&mnt));
    let at_export = |f: &str| std::fs::read_to_string(src.join(f)).ok();

    // 1. a and b written back; the line that records the outcome fails: the state disk
    //    is full just then.
    recorder.fail_writes(Some(("synced.log", "{\"resolved\"", libc::ENOSPC)));
    std::fs::write(mnt.join("a"), "a 1\n").unwrap();
    std::fs::write(mnt.join("b"), "b 1\n").unwrap();
    wait_for("the first commit", || {
        at_export("a").as_deref() == Some("a 1\n") && at_export("b").as_deref() == Some("b 1\n")
    });
    // 2. Space again: a later commit (of c only) is recorded whole.
    recorder.fail_writes(None);
    std::fs::write(mnt.join("c"), "c 1\n").unwrap();
    wait_for("the second commit", || {
        at_export("c").as_deref() == Some("c 1\n")
    });
    std::thread::sleep(Duration::from_millis(200));
    // 3. Full again: b changes once more, journaled but never sent (its commit cannot be
    //    recorded); then the mount is killed.
    recorder.fail_writes(Some(("synced.log", "", libc::ENOSPC)));
    std::fs::write(mnt.join("b"), "b 2\n").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(at_export("b").as_deref(), Some("b 1\n"), "sent unrecorded");
    mount.0.kill().unwrap();
    mount.0.wait().unwrap();
    let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    recorder.fail_writes(None);

    let out = Command::new(BIN)
        .arg("recover")
        .arg(&handle)
        .arg("--state-dir")
        .arg(&recmnt)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "recover failed: {said}");
    let now = files(&src);
    let conflicts: Vec<&String> = now
        .keys()
        .filter(|p| p.contains(".awcp-conflict-"))
        .collect();
    assert!(
        conflicts.is_empty(),
        "recovery made conflict copies of the mount's own commit: {conflicts:?}\n{said}"
    );
    assert!(said.contains(" 0 conflict(s)"), "{said}");
    let want: BTreeMap<String, String> = [("a", "a 1\n"), ("b", "b 2\n"), ("c", "c 1\n")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(now, want, "{said}");
}

/// Names of the files the recorded operations touch: fid → path in the state directory.
fn names_of(ops: &[Op]) -> std::collections::HashMap<u64, String> {
    let mut out = std::collections::HashMap::new();
    for op in ops {
        if let Op::Create { fid, .. } = op {
            out.insert(*fid, recordfs::describe(ops, *fid));
        }
    }
    out
}

// Regressions (issue 30), found by the crash-point test above, checked here on the order of
// the mount's own writes to its state directory, deterministically:
// * a commit was recorded (and sent) before the journal and the committed upper files were
//   synced: after a power loss, recovery sent the older or torn local copy back over the
//   committed content;
// * `fsync` of a directory on the mount was a no-op: a rename or unlink followed by it was
//   lost with a power loss;
// * the state directory (manifest.bin, journal.log, synced.log) and the upper directory
//   were never synced: the manifest could vanish under a journal that survived;
// * manifest.bin was written in place: a crash mid-write left a torn manifest, and
//   recovery refused the state directory;
// * an unlinked file's upper file was emptied before it was renamed into the pool: a power
//   loss that kept the truncation but not the (unsynced) unlink left an fsynced file empty.
#[test]
fn the_mounts_state_writes_are_ordered_so_a_power_loss_keeps_what_was_acknowledged() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let backing = tmp.path().join("backing");
    let recmnt = tmp.path().join("state");
    let mnt = tmp.path().join("mnt");
    for d in [&src, &backing, &recmnt, &mnt] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(src.join("old"), "old\n").unwrap();
    let recorder = Recorder::mount(&backing, &recmnt).unwrap();
    let handle = tmp.path().join("h.json");
    let (_rt, _export) = serve_export(&src, &tmp.path().join("staging"), &handle);
    let mut mount = Killed(
        Command::new(BIN)
            .arg("mount")
            .arg(&handle)
            .arg(&mnt)
            .arg("--state-dir")
            .arg(&recmnt)
            .args(["--hydrate", "none"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the mount", || is_mounted(&mnt));
    let started = recorder.len();

    // A new file, synced by its writer.
    let mut f = std::fs::File::create(mnt.join("x")).unwrap();
    f.write_all(b"x content\n").unwrap();
    f.sync_all().unwrap();
    drop(f);
    let fsynced = recorder.len();
    // Renamed, and the directory synced.
    std::fs::rename(mnt.join("x"), mnt.join("y")).unwrap();
    let renamed = recorder.len();
    std::fs::File::open(&mnt).unwrap().sync_all().unwrap();
    let dir_synced = recorder.len();
    // Written back.
    wait_for("the write-back", || src.join("y").exists());
    std::thread::sleep(Duration::from_millis(200));
    // Removed (its upper file goes to the pool).
    std::fs::remove_file(mnt.join("y")).unwrap();
    wait_for("the write-back of the removal", || !src.join("y").exists());
    std::thread::sleep(Duration::from_millis(200));
    mount.0.kill().unwrap();
    mount.0.wait().unwrap();
    let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    let ops = recorder.ops();
    let names = names_of(&ops);
    let name = |fid: &u64| names.get(fid).cloned().unwrap_or_default();
    let fid_of = |n: &str| {
        *names
            .iter()
            .find(|(_, v)| v.as_str() == n)
            .unwrap_or_else(|| panic!("{n} never created; names: {names:?}"))
            .0
    };
    let state = fid_of(EXPORT_ID);
    let journal = fid_of(&format!("{EXPORT_ID}/journal.log"));
    let upper_dir = fid_of(&format!("{EXPORT_ID}/upper"));
    let synced_log = fid_of(&format!("{EXPORT_ID}/synced.log"));
    let synced_after = |fid: u64, from: usize, to: usize| {
        ops[from..to]
            .iter()
            .any(|op| matches!(op, Op::Fsync { fid: f } | Op::FsyncDir { fid: f } if *f == fid))
    };

    // The state files' names synced before the mount served anything.
    let created_last = ops[..started]
        .iter()
        .rposition(|op| {
            matches!(op, Op::Create { parent, name, .. } if *parent == state
                && ["manifest.bin", "journal.log", "synced.log", "upper"]
                    .contains(&name.to_string_lossy().as_ref()))
        })
        .unwrap();
    assert!(
        synced_after(state, created_last, started),
        "the state directory was never synced after its files were created"
    );
    // The manifest never written in place (a crash mid-write left a torn one that recovery
    // refused): written beside, synced, renamed.
    assert!(
        ops[..started]
            .iter()
            .any(|op| matches!(op, Op::Rename { newname, .. } if newname == "manifest.bin")),
        "manifest.bin was written in place"
    );
    // The caller's fsync: the upper directory (the new file's name) and the journal.
    assert!(
        synced_after(upper_dir, started, fsynced) && synced_after(journal, started, fsynced),
        "fsync of a new file left its upper file's name or its journal record unsynced"
    );
    // The directory sync after a rename: the journal, after the rename's record.
    let rename_record = ops[fsynced..renamed]
        .iter()
        .rposition(|op| matches!(op, Op::Write { fid, .. } if *fid == journal))
        .map(|i| i + fsynced)
        .expect("the rename was not journaled");
    assert!(
        synced_after(journal, rename_record, dir_synced),
        "fsync of the directory did not sync the journal after a rename"
    );
    // Every commit recorded only once the journal and the files it carries were synced.
    let mut commits = 0;
    for (i, op) in ops.iter().enumerate() {
        let Op::Write { fid, data, .. } = op else {
            continue;
        };
        if *fid != synced_log || !String::from_utf8_lossy(data).contains("\"pending\"") {
            continue;
        }
        commits += 1;
        for (j, earlier) in ops[..i].iter().enumerate().rev() {
            let Op::Write { fid: w, .. } = earlier else {
                continue;
            };
            let upper = name(w).starts_with(&format!("{EXPORT_ID}/upper/"));
            if (*w == journal || upper) && !synced_after(*w, j, i) {
                // An upper file written and never synced before this commit is only
                // allowed if the commit does not carry it (here: every file it carries).
                assert!(
                    !upper || name(w).contains("free-") || name(w).contains(".pack"),
                    "a commit was recorded while {} held writes not yet synced",
                    name(w)
                );
                assert_ne!(
                    *w, journal,
                    "a commit was recorded before the journal was synced"
                );
            }
        }
    }
    assert!(commits >= 2, "{commits} commits recorded");
    // The removed file's upper file: renamed into the pool before it was emptied.
    let pooled = ops
        .iter()
        .position(|op| matches!(op, Op::Rename { newname, .. } if newname.to_string_lossy().starts_with("free-")))
        .expect("the removed file's upper file was not pooled");
    let emptied = ops
        .iter()
        .rposition(|op| matches!(op, Op::Truncate { size: 0, .. }))
        .expect("the pooled file was not emptied");
    assert!(
        pooled < emptied,
        "the upper file was emptied (op {emptied}) before it was renamed into the pool (op {pooled})"
    );
}
