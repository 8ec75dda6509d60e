//! What a mount's AECP replica holds per finding (issue 33: ~3 KB per delivered finding,
//! 61 MB with 10,000 against 29 MB without). The bound: **at most 300 bytes of heap per
//! delivered finding with 10,000 findings**, everything the worker's hook keeps counted —
//! the replica of the index, what it delivered, the inbox — after the mount's reporter has
//! taken the notes.
//!
//! Measured with a counting global allocator (this test binary's own), not the process's
//! RSS: the live heap before the hook exists and after 10,000 findings were published to it
//! and each delivered by a first access, divided by 10,000. Each live allocation also
//! counts [`MALLOC_OVERHEAD`] bytes (the allocator's header and rounding), so a design that
//! keeps one small allocation per finding pays for it here as it does in RSS. One test in
//! this file: the counter sees every thread of the binary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use aecp_hooks::hook::WorkerHook;
use aecp_hooks::index::IndexEvent;
use aecp_hooks::knowledge::{Artifact, Scope, WitnessStatus};
use aecp_hooks::policy::Policy;

/// Live heap bytes, as requested.
static LIVE: AtomicIsize = AtomicIsize::new(0);
/// Live allocations.
static BLOCKS: AtomicIsize = AtomicIsize::new(0);

/// What glibc's malloc adds to each live block (its 8-byte header, rounded to 16).
const MALLOC_OVERHEAD: isize = 16;

struct Counting;

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are
// only arithmetic on the sizes it was given.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as the caller's contract for `GlobalAlloc::alloc`.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
            BLOCKS.fetch_add(1, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as the caller's contract for `GlobalAlloc::alloc_zeroed`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
            BLOCKS.fetch_add(1, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as the caller's contract for `GlobalAlloc::dealloc`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        BLOCKS.fetch_sub(1, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as the caller's contract for `GlobalAlloc::realloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The heap in use now, each block with its overhead.
fn heap() -> isize {
    LIVE.load(Ordering::Relaxed) + BLOCKS.load(Ordering::Relaxed) * MALLOC_OVERHEAD
}

const FINDINGS: usize = 10_000;

/// The most heap one delivered finding may keep.
const BOUND: isize = 300;

/// A path like a real repository's, one file per finding: `src/mod3/sub5/file123.py`.
fn path(i: usize) -> String {
    format!("src/mod{}/sub{}/file{i}.py", i % 40, (i / 40) % 8)
}

/// A finding as workers write them: a claim of 80 to 400 characters (the delivery cuts it
/// to 280), a symbol scope, a delegation id as producer, some with a witness.
fn finding(i: usize) -> Artifact {
    let p = path(i);
    let module = p.trim_end_matches(".py").replace('/', ".");
    let mut claim = format!(
        "finding {i}: parse() in {module} cuts its input to LIMIT characters, so longer names are truncated"
    );
    for _ in 0..(i % 4) {
        claim.push_str(" and the caller in the next module relies on the full name when it builds the cache key");
    }
    Artifact {
        id: 1_000_000 + i as u64,
        claim,
        scope: Scope::Symbol(format!("{module}.parse")),
        bound: p,
        witness: i.is_multiple_of(3).then(|| aecp_hooks::knowledge::Witness {
            argv: vec![
                "python3".into(),
                "-c".into(),
                format!("import {module} as m; assert len(m.parse('x' * 50)) == 10"),
            ],
            marker: "AECP-READY".into(),
            timeout_ms: 30_000,
        }),
        status: if i.is_multiple_of(2) {
            WitnessStatus::Checked
        } else {
            WitnessStatus::Unchecked
        },
        producer: format!("dlg_{:032x}", i % 7),
        created_ms: 1_700_000_000_000 + i as u64,
        revision: 1,
    }
}

#[test]
fn a_delivered_finding_keeps_at_most_300_bytes_at_10000() {
    // Warm up what is allocated once per process (thread locals, the channel's first
    // block, lazily built statics), so it is not counted as the findings'.
    {
        let (hook, notes) = WorkerHook::new("warm", Policy::default());
        hook.apply(IndexEvent::Artifact {
            artifact: finding(0),
        });
        hook.on_access(&path(0));
        let _ = hook.inbox();
        notes.try_iter().for_each(drop);
    }

    let before = heap();
    let (hook, notes) = WorkerHook::new("dlg_worker", Policy::default());
    for i in 0..FINDINGS {
        hook.apply(IndexEvent::Artifact {
            artifact: finding(i),
        });
    }
    let replica = heap() - before;

    let mut delivered = 0;
    for i in 0..FINDINGS {
        delivered += hook.on_access(&path(i));
        // The mount's reporter takes the notes every 100 ms.
        if i % 500 == 0 {
            notes.try_iter().for_each(drop);
        }
    }
    notes.try_iter().for_each(drop);
    assert_eq!(delivered, FINDINGS, "every finding delivered once");
    let inbox = hook.inbox();
    assert_eq!(
        inbox.iter().filter(|b| **b == b'\n').count(),
        FINDINGS,
        "the inbox holds every delivery"
    );
    let inbox_bytes = inbox.len();
    drop(inbox);
    let total = heap() - before;
    let per = total / FINDINGS as isize;
    eprintln!(
        "AECP replica with {FINDINGS} findings: {} bytes per finding before delivery, \
         {per} bytes per finding with all delivered (live heap, {MALLOC_OVERHEAD} bytes per \
         allocation included; the inbox itself is {} bytes per finding)",
        replica / FINDINGS as isize,
        inbox_bytes / FINDINGS,
    );
    assert!(
        per <= BOUND,
        "{per} bytes per delivered finding at {FINDINGS} findings (at most {BOUND})"
    );

    // The hook still answers from what it kept.
    assert_eq!(hook.on_access(&path(7)), 0, "delivered once");
    let xattr = String::from_utf8(hook.xattr(&path(7)).expect("bound")).unwrap();
    assert!(xattr.contains("\"id\":1000007"), "{xattr}");
}
