//! The AECP observer on the FUSE hot path (issue 19's target: a lookup that makes a delivery
//! under 20 µs), with 10,000 artifacts in the mount's replica.
//!
//! * `deliver` — the first access of a path with an undelivered artifact: the hash lookups
//!   per directory level, the policy's pick, the inbox line and the note for the reporter.
//! * `nothing_new` — an access of a path whose artifacts this worker already received (what
//!   almost every lookup of a busy tree is).
//! * `unbound` — a path nothing is bound to, 5 levels deep.
//! * `empty_replica` — AECP on but nothing published: one atomic load.
//! * `use_contracted` — an open of a contracted module not yet noted (the consumer note).
//!
//! `cargo bench -p aecp-hooks --bench lookup` (criterion; reports in `target/criterion`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use aecp_hooks::hook::WorkerHook;
use aecp_hooks::index::IndexEvent;
use aecp_hooks::knowledge::{Artifact, Scope, WitnessStatus};
use aecp_hooks::policy::Policy;
use criterion::{Criterion, criterion_group, criterion_main};

/// Artifacts in the replica.
const ARTIFACTS: usize = 10_000;

/// A path like the benchmark repository's: `src/mod3/sub5/file123.py`.
fn path(i: usize) -> String {
    format!("src/mod{}/sub{}/file{i}.py", i % 40, (i / 40) % 8)
}

fn artifact(id: usize, bound: String) -> Artifact {
    Artifact {
        id: id as u64,
        claim: format!(
            "finding {id}: parse() cuts its input to LIMIT characters, so longer names are truncated"
        ),
        scope: Scope::File(bound.clone()),
        bound,
        witness: None,
        status: WitnessStatus::Checked,
        producer: "dlg_0123456789abcdef0123456789abcdef".into(),
        created_ms: 1_700_000_000_000 + id as u64,
        revision: 1,
    }
}

/// A hook whose replica holds [`ARTIFACTS`] artifacts, one per file (plus a few on
/// directories), and the receiving end of its notes (kept, as the mount's thread would).
fn replica() -> (
    WorkerHook,
    std::sync::mpsc::Receiver<aecp_hooks::hook::Note>,
) {
    let (hook, notes) = WorkerHook::new("bench", Policy::default());
    for i in 0..ARTIFACTS - 40 {
        hook.apply(IndexEvent::Artifact {
            artifact: artifact(i + 1, path(i)),
        });
    }
    for d in 0..40 {
        hook.apply(IndexEvent::Artifact {
            artifact: artifact(ARTIFACTS - 40 + d + 1, format!("src/mod{d}")),
        });
    }
    (hook, notes)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("aecp_lookup_10k");
    g.measurement_time(Duration::from_secs(3));

    // Each iteration is the first access of a new path; a fresh replica (built outside the
    // timing) once every path of one has been used.
    g.bench_function("deliver", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let (hook, notes) = replica();
                // The directory-bound artifacts go on the first access of each directory;
                // deliver those first, untimed, so every timed access delivers one artifact.
                for d in 0..40 {
                    hook.on_access(&format!("src/mod{d}"));
                }
                let n = left.min(ARTIFACTS - 40);
                let paths: Vec<String> = (0..n).map(path).collect();
                let start = Instant::now();
                for p in &paths {
                    black_box(hook.on_access(black_box(p)));
                }
                total += start.elapsed();
                left -= n;
                drop(notes);
            }
            total
        })
    });

    let (hook, _notes) = replica();
    for i in 0..ARTIFACTS {
        hook.on_access(&path(i));
    }
    let seen = path(1234);
    g.bench_function("nothing_new", |b| {
        b.iter(|| black_box(hook.on_access(black_box(&seen))))
    });
    let unbound = "lib/vendor/deep/er/x.py".to_owned();
    g.bench_function("unbound", |b| {
        b.iter(|| black_box(hook.on_access(black_box(&unbound))))
    });

    let (empty, _n) = WorkerHook::new("bench", Policy::default());
    g.bench_function("empty_replica", |b| {
        b.iter(|| black_box(empty.on_access(black_box(&seen))))
    });

    g.bench_function("use_contracted", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let (hook, notes) = WorkerHook::new("bench", Policy::default());
                let n = left.min(ARTIFACTS);
                let modules: Vec<String> = (0..n).map(|i| format!("pkg/m{i}.py")).collect();
                for m in &modules {
                    hook.apply(IndexEvent::Contract {
                        module: m.clone(),
                        revision: 1,
                        body: serde_json::json!({}),
                        by: "A".into(),
                    });
                }
                let start = Instant::now();
                for m in &modules {
                    black_box(hook.on_use(black_box(m)));
                }
                total += start.elapsed();
                left -= n;
                drop(notes);
            }
            total
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
