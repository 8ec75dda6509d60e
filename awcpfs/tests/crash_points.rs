//! Every crash point of the journal is safe (in the manner of ALICE and CrashMonkey).
//!
//! A workload runs on the filesystem layer (creates with and without `fsync`, renames,
//! renames over another name, unlinks, directories), and every write the mount makes to its
//! journal is recorded: each operation appends its records with one `write(2)`, and each
//! `fsync` makes everything appended so far durable. Then, for every crash point, the
//! journal is rebuilt as a crash could leave it —
//!
//! * the process killed between two operations (every write so far kept);
//! * the process killed inside a write (the last record torn at a random byte);
//! * the power lost: everything up to the last `fsync` kept, and of the writes after it a
//!   random subset, each one kept or dropped, a dropped one leaving a hole of zeros when a
//!   later one was kept (the kernel writes back pages in any order) —
//!
//! and replayed over the manifest as recovery does. The replayed tree must be the tree
//! after some prefix of the operations: at least every operation an `fsync` covered (for a
//! process crash, every operation that returned), never one that was not issued, never a
//! mix. Recovery never panics. `AWCP_CRASH_OPS` and `AWCP_CRASH_STATES` set the size
//! (CI: 60 operations, 6 power-loss states per point; `scripts/soak.sh` runs more), and
//! `AWCP_SEED` the seed.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::fs::{AwcpFs, FsOptions};
use awcpfs::mount::inode::{Data, InodeTable, Kind, ROOT_INO};
use awcpfs::mount::journal::{self, Journal};
use awcpfs::mount::remote::{HttpRemote, Remote};
use awcpfs::mount::stats::Stats;
use awcpfs::mount::sync::SyncSignal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn o(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A tree as a replay of the journal gives it: path → (kind, size, content of a local
/// file, from `contents`: each file of the workload is written once, by its creator).
type Listing = BTreeMap<String, (String, u64, Option<Vec<u8>>)>;

fn listing(t: &InodeTable, contents: &HashMap<u64, Vec<u8>>) -> Listing {
    let mut out = Listing::new();
    t.walk(|p, n| {
        let content = match (&n.data, n.kind) {
            (Data::Local { .. }, Kind::File) => contents.get(&n.ino).map(|b| {
                let mut b = b.clone();
                b.truncate(n.size as usize);
                b
            }),
            _ => None,
        };
        let size = if n.kind == Kind::Dir { 0 } else { n.size };
        out.insert(p.to_string(), (format!("{:?}", n.kind), size, content));
    });
    out
}

/// The journal's bytes replayed over the manifest, as recovery does.
fn replayed(
    manifest: &awcp_protocol::dataplane::Manifest,
    journal: &[u8],
    scratch: &Path,
    contents: &HashMap<u64, Vec<u8>>,
) -> Listing {
    let path = scratch.join("journal.log");
    std::fs::write(&path, journal).unwrap();
    let records = Journal::read_all(&path).unwrap();
    let mut t = InodeTable::from_manifest(manifest, 0, 0).unwrap();
    journal::replay(&mut t, &records, 0, 0);
    listing(&t, contents)
}

#[test]
fn every_crash_point_of_the_journal_recovers_a_prefix_with_every_fsynced_operation() {
    let seed = env_or("AWCP_SEED", rand::random::<u32>() as u64);
    let ops = env_or("AWCP_CRASH_OPS", 60) as usize;
    let states = env_or("AWCP_CRASH_STATES", 6) as usize;
    eprintln!("crash points: AWCP_SEED={seed} AWCP_CRASH_OPS={ops} AWCP_CRASH_STATES={states}");
    let mut rng = StdRng::seed_from_u64(seed);

    // An export of a small tree, and the filesystem layer over it.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let state = tmp.path().join("state");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(state.join("upper")).unwrap();
    for i in 0..20 {
        std::fs::write(root.join(format!("f{i}")), format!("orig {i}\n")).unwrap();
    }
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
    registry
        .register(
            "e1".into(),
            "tok".into(),
            ExportConfig {
                root: root.clone(),
                read_only: false,
                block_size: 4096,
                staging_dir: tmp.path().join("staging"),
            },
            lease,
        )
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let router = registry.router();
    rt.spawn(async move { axum::serve(listener, router).await });
    let remote = Arc::new(HttpRemote::new(
        &format!("http://{addr}"),
        "e1",
        "tok",
        Duration::from_secs(10),
    ));
    let (manifest, _) = remote.manifest().unwrap();
    let journal_path = state.join("journal.log");
    let upper = state.join("upper");
    let fs = AwcpFs::new(
        InodeTable::from_manifest(&manifest, 0, 0).unwrap(),
        remote as Arc<dyn Remote>,
        Journal::open(&journal_path).unwrap(),
        FsOptions {
            read_only: false,
            uid: 0,
            gid: 0,
            upper_dir: upper.clone(),
            block_size: manifest.block_size,
        },
        Arc::new(SyncSignal::default()),
        Arc::new(Stats::default()),
    );
    let crash_dir = tmp.path().join("crash");
    std::fs::create_dir_all(&crash_dir).unwrap();
    let mut contents: HashMap<u64, Vec<u8>> = HashMap::new();
    // The live mount's names and sizes (everything the workload makes is at the top).
    let live = |fs: &AwcpFs| -> BTreeMap<String, u64> {
        let fh = fs.opendir(ROOT_INO).unwrap();
        let entries = fs.readdir(fh).unwrap();
        fs.releasedir(fh);
        entries
            .iter()
            .filter(|e| e.name != "." && e.name != "..")
            .map(|e| {
                let a = fs.getattr(e.ino).unwrap();
                let size = if e.kind == Kind::Dir { 0 } else { a.size };
                (e.name.clone(), size)
            })
            .collect()
    };

    // The workload, recording after each operation the journal's length (its writes) and
    // whether an fsync made everything so far durable.
    let lookup = |fs: &AwcpFs, name: &str| fs.lookup(ROOT_INO, o(name)).ok().map(|a| a.ino.0);
    // One step per call that writes the journal: its end offset, whether an fsync made it
    // durable, and the tree its journal prefix replays to.
    let mut models = vec![replayed(&manifest, &[], &crash_dir, &contents)];
    let mut ends = vec![0u64];
    let mut synced_at = vec![0u64];
    let mut durable = 0u64;
    let mut step = |fsynced: bool, contents: &mut HashMap<u64, Vec<u8>>| {
        let journal_now = std::fs::read(&journal_path).unwrap();
        if fsynced {
            durable = journal_now.len() as u64;
        }
        for e in std::fs::read_dir(&upper).unwrap().flatten() {
            if let Ok(ino) = e.file_name().to_string_lossy().parse::<u64>() {
                contents.insert(ino, std::fs::read(e.path()).unwrap_or_default());
            }
        }
        models.push(replayed(&manifest, &journal_now, &crash_dir, contents));
        ends.push(journal_now.len() as u64);
        synced_at.push(durable);
        models.last().unwrap().clone()
    };
    let mut files: Vec<String> = (0..20).map(|i| format!("f{i}")).collect();
    for i in 0..ops {
        let pick = files[rng.random_range(0..files.len())].clone();
        let last = match rng.random_range(0..6) {
            0 | 1 => {
                let name = format!("n{i}");
                let (_, fh) = fs
                    .create(ROOT_INO, o(&name), 0o644, libc::O_WRONLY | libc::O_CREAT)
                    .unwrap();
                step(false, &mut contents);
                fs.write(fh, 0, format!("new {i}\n").repeat(1 + i % 7).as_bytes())
                    .unwrap();
                if rng.random_bool(0.4) {
                    let ino = lookup(&fs, &name).unwrap();
                    fs.fsync_at(ino, fh, false).unwrap();
                    step(true, &mut contents);
                }
                fs.flush(fh).unwrap();
                fs.release(fh).unwrap();
                files.push(name);
                step(false, &mut contents)
            }
            2 => {
                let _ = fs.rename(
                    ROOT_INO,
                    o(&pick),
                    ROOT_INO,
                    o(&format!("r{i}")),
                    false,
                    false,
                );
                step(false, &mut contents)
            }
            3 => {
                let other = files[rng.random_range(0..files.len())].clone();
                let _ = fs.rename(ROOT_INO, o(&pick), ROOT_INO, o(&other), false, false);
                step(false, &mut contents)
            }
            4 => {
                if lookup(&fs, &pick).is_some() {
                    fs.unlink(ROOT_INO, o(&pick)).unwrap();
                }
                step(false, &mut contents)
            }
            _ => {
                fs.mkdir(ROOT_INO, o(&format!("d{i}")), 0o755).unwrap();
                step(false, &mut contents)
            }
        };
        // Every call returned: the journal replays to the mount's own tree.
        let names: BTreeMap<String, u64> = last.iter().map(|(p, v)| (p.clone(), v.1)).collect();
        assert_eq!(
            names,
            live(&fs),
            "seed {seed}: the journal after op {i} does not replay to the mount's tree"
        );
    }
    let steps = ends.len() - 1;
    let bytes = std::fs::read(&journal_path).unwrap();
    assert!(ends.windows(2).filter(|w| w[1] > w[0]).count() > ops / 2);
    let ops = steps;

    // Whether `journal`, replayed, is the state after d operations for some d in the range.
    let replay_is_prefix = |journal: &[u8], at_least: usize, at_most: usize, what: &str| {
        let got = replayed(&manifest, journal, &crash_dir, &contents);
        let found = (at_least..=at_most).rev().find(|d| models[*d] == got);
        assert!(
            found.is_some(),
            "seed {seed}: {what}: the replayed tree is no state after {at_least}..={at_most} \
             operations (an fsynced operation lost, or a mix)\nreplayed: {got:?}\n\
             expected at least: {:?}",
            models[at_least]
        );
    };

    let mut checked = 0;
    for k in 0..=ops {
        let end = ends[k] as usize;
        // The process killed after operation k: every operation that returned is kept.
        replay_is_prefix(&bytes[..end], k, k, &format!("kill after op {k}"));
        checked += 1;
        if k < ops && ends[k + 1] > ends[k] {
            // Killed inside operation k+1's write: torn at a random byte.
            let cut = rng.random_range(end + 1..ends[k + 1] as usize);
            // The operation in flight may have happened, whole, or not at all.
            replay_is_prefix(
                &bytes[..cut],
                k,
                k + 1,
                &format!("torn inside op {}", k + 1),
            );
            checked += 1;
        }
        // Power lost after operation k: what an fsync covered is kept; of each later write
        // (one per operation), a random subset survives, the others leave zeros.
        let durable = synced_at[k] as usize;
        let at_least = (0..=k)
            .rev()
            .find(|d| ends[*d] as usize <= durable)
            .unwrap_or(0);
        for s in 0..states {
            let mut img = bytes[..end].to_vec();
            for w in 0..k {
                let (a, b) = (ends[w] as usize, ends[w + 1] as usize);
                if a >= durable && rng.random_bool(0.5) {
                    img[a..b].fill(0);
                }
            }
            // A trailing run of dropped writes is no hole: the file ends before it.
            while img.last() == Some(&0) {
                img.pop();
            }
            replay_is_prefix(
                &img,
                at_least,
                k,
                &format!("power lost after op {k} (state {s}, durable to byte {durable})"),
            );
            checked += 1;
        }
    }
    eprintln!("crash points: {checked} crash states of {ops} operations recovered safely");
}
