//! The binaries' allocator: mimalloc, with the mount's inode table in huge pages.
//!
//! Every FUSE request that names a path probes the inode table (the node map, a
//! directory's children, the node) at addresses no earlier request touched, right after the
//! kernel switched from the caller to the mount: with 4 KiB pages each probe is a TLB miss,
//! and on a virtual machine a miss is a two-level page walk that now and then stalls for
//! ~100 µs. Measured on a 20,000-file mount over io_uring, a serial `lstat` of every file
//! cost ~2 µs more with the table on 4 KiB pages than with the whole process on transparent
//! huge pages, and 1–2 % of lookups took over 100 µs in the table alone.
//!
//! The whole process on huge pages costs more than it gains elsewhere (every buffer the
//! write-back allocates afresh is a 2 MiB page the kernel zeroes, and the RSS doubles), so
//! only the table goes there: [`enable`] gives mimalloc an exclusive arena of address space
//! advised `MADV_HUGEPAGE`, and allocations made inside a [`scope`] — building the table,
//! and whatever runs under its lock ([`crate::mount`]'s `TableLock`) — come from a heap in
//! that arena. Everything else, and every allocation when [`enable`] was not called (the
//! tests, or a kernel that refuses), goes to mimalloc's default heap as before; frees go to
//! mimalloc whatever the heap.

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use libmimalloc_sys as mi;

/// Address space reserved for the hot arena. Only what is touched is memory; 4 GiB holds
/// the table of millions of files.
const ARENA_BYTES: usize = 4 << 30;
/// mimalloc's arenas start on a slice boundary; 32 MiB also keeps whole huge pages.
const ARENA_ALIGN: usize = 32 << 20;
/// `PR_THP_DISABLE_EXCEPT_ADVISED` (Linux 6.18): transparent huge pages off for this
/// process except where advised.
const PR_THP_DISABLE_EXCEPT_ADVISED: libc::c_ulong = 1 << 1;

/// The heap in the hot arena, once [`enable`] made it.
static HOT: AtomicPtr<mi::mi_heap_t> = AtomicPtr::new(std::ptr::null_mut());
/// Where the hot arena starts (0 until [`enable`] made it).
static START: AtomicUsize = AtomicUsize::new(0);
static ENABLED: OnceLock<Result<(), String>> = OnceLock::new();

thread_local! {
    /// Nesting depth of [`scope`]s on this thread.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// mimalloc, sending allocations made inside a [`scope`] to the hot arena.
pub struct Alloc;

/// The hot heap if this thread is inside a scope and [`enable`] succeeded.
#[inline]
fn hot_heap() -> Option<*mut mi::mi_heap_t> {
    // `try_with`: a thread's TLS may be gone while it exits (a `const` Cell never is, but
    // the allocator must not panic on any thread).
    let inside = DEPTH.try_with(|d| d.get() > 0).unwrap_or(false);
    if !inside {
        return None;
    }
    // Acquire: the heap `enable` made on another thread is seen whole.
    let heap = HOT.load(Ordering::Acquire);
    (!heap.is_null()).then_some(heap)
}

/// A block of `layout` from the hot heap when this thread is in a scope (`hot`), else (or
/// when the arena is full) from mimalloc's default heap (`cold`).
///
/// # Safety
/// `hot` and `cold` must be mimalloc allocation functions taking (heap,) size, alignment.
#[inline]
unsafe fn allocate(
    layout: Layout,
    hot: unsafe extern "C" fn(*mut mi::mi_heap_t, usize, usize) -> *mut c_void,
    cold: unsafe extern "C" fn(usize, usize) -> *mut c_void,
) -> *mut u8 {
    // SAFETY: the caller passes mimalloc's functions; size and alignment are a layout's.
    unsafe {
        if let Some(heap) = hot_heap() {
            let p = hot(heap, layout.size(), layout.align());
            if !p.is_null() {
                return p.cast();
            }
        }
        cold(layout.size(), layout.align()).cast()
    }
}

// SAFETY: every path returns memory from mimalloc with the layout's size and alignment, or
// null; `dealloc` and `realloc` accept any mimalloc block, whichever heap it came from.
unsafe impl GlobalAlloc for Alloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: mimalloc's allocation functions with the layout's size and alignment.
        unsafe { allocate(layout, mi::mi_heap_malloc_aligned, mi::mi_malloc_aligned) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`, zeroed.
        unsafe { allocate(layout, mi::mi_heap_zalloc_aligned, mi::mi_zalloc_aligned) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from one of mimalloc's heaps (the caller's contract).
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` is a live mimalloc block of `layout` (the caller's contract); a
        // failed hot realloc leaves it untouched for the default heap's attempt.
        unsafe {
            if let Some(heap) = hot_heap() {
                let p = mi::mi_heap_realloc_aligned(heap, ptr.cast(), new_size, layout.align());
                if !p.is_null() {
                    return p.cast();
                }
            }
            mi::mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast()
        }
    }
}

/// Allocations on this thread go to the hot arena until the returned guard drops.
/// Nests; free to call when [`enable`] was not called (then it changes nothing).
pub fn scope() -> Scope {
    DEPTH.with(|d| d.set(d.get() + 1));
    Scope(std::marker::PhantomData)
}

/// See [`scope`]. Not `Send`: the depth it undoes is its thread's.
pub struct Scope(std::marker::PhantomData<*const ()>);

impl Drop for Scope {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Make the hot arena: reserve address space, advise it for huge pages, let this process
/// have huge pages where advised, and hand the space to mimalloc as an exclusive arena.
/// Idempotent; only the binaries call it (their global allocator is [`Alloc`]). On a
/// kernel without `PR_THP_DISABLE_EXCEPT_ADVISED`, huge pages stay off (the arena is still
/// used, on small pages) unless the machine's policy only gives them where advised anyway.
pub fn enable() -> Result<(), String> {
    ENABLED.get_or_init(make_arena).clone()
}

fn make_arena() -> Result<(), String> {
    // SAFETY: a fresh private anonymous mapping, no memory arguments.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            ARENA_BYTES + ARENA_ALIGN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(format!(
            "reserving the hot arena: {}",
            std::io::Error::last_os_error()
        ));
    }
    let start = (base as usize).next_multiple_of(ARENA_ALIGN) as *mut c_void;
    // SAFETY: the range lies inside the mapping just made. Advice is best effort.
    unsafe { libc::madvise(start, ARENA_BYTES, libc::MADV_HUGEPAGE) };
    allow_advised_huge_pages();
    let mut id: mi::mi_arena_id_t = std::ptr::null_mut();
    // SAFETY: `start` is aligned, `ARENA_BYTES` of it are mapped, readable and writable,
    // zero, and never unmapped: mimalloc owns them from here on.
    let ok = unsafe {
        mi::mi_manage_os_memory_ex(start, ARENA_BYTES, true, false, true, -1, true, &mut id)
    };
    if !ok {
        return Err("mimalloc refused the hot arena".into());
    }
    // SAFETY: `id` names the arena just made.
    let heap = unsafe { mi::mi_heap_new_in_arena(id) };
    if heap.is_null() {
        return Err("mimalloc made no heap in the hot arena".into());
    }
    START.store(start as usize, Ordering::Relaxed);
    HOT.store(heap, Ordering::Release);
    Ok(())
}

/// mimalloc turns transparent huge pages off for the whole process at start (see the
/// workspace's `no_thp`); turn them back on where advised.
fn allow_advised_huge_pages() {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_THP_DISABLE,
            1 as libc::c_ulong,
            PR_THP_DISABLE_EXCEPT_ADVISED,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if r == 0 {
        return;
    }
    // An older kernel: with the machine's policy at `madvise` (or `never`), turning the
    // process's switch off gives huge pages only where advised, as wanted; under `always`
    // it would give them everywhere, so they stay off.
    let policy = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
    let advised_only = policy.is_ok_and(|p| !p.contains("[always]"));
    if advised_only {
        // SAFETY: as above.
        unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 0, 0, 0, 0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_unwind() {
        assert_eq!(DEPTH.with(Cell::get), 0);
        {
            let _a = scope();
            let _b = scope();
            assert_eq!(DEPTH.with(Cell::get), 2);
        }
        assert_eq!(DEPTH.with(Cell::get), 0);
    }

    /// Several threads at once in the hot heap (an Executor builds the tables of several
    /// mounts at a time, outside any lock): every block stays its own.
    #[test]
    fn threads_allocate_in_the_hot_heap_at_once() {
        enable().expect("the hot arena");
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                std::thread::spawn(move || {
                    let _s = scope();
                    let mut kept = Vec::new();
                    for i in 0..20_000usize {
                        let len = 8 + (i * 7 + usize::from(t)) % 300;
                        let layout = Layout::from_size_align(len, 8).unwrap();
                        // SAFETY: a fresh block of `len` bytes, filled, checked and freed
                        // with its layout below.
                        let p = unsafe { Alloc.alloc(layout) };
                        assert!(hot(p));
                        unsafe { p.write_bytes(t, len) };
                        kept.push((p as usize, layout));
                        if kept.len() > 64 {
                            let (q, l) = kept.swap_remove(i % 64);
                            let q = q as *mut u8;
                            // SAFETY: as above.
                            unsafe {
                                assert!((0..l.size()).all(|k| *q.add(k) == t));
                                Alloc.dealloc(q, l);
                            }
                        }
                    }
                    for (q, l) in kept {
                        // SAFETY: as above.
                        unsafe { Alloc.dealloc(q as *mut u8, l) };
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    /// Whether `p` lies in the hot arena.
    fn hot(p: *mut u8) -> bool {
        let start = START.load(Ordering::Relaxed);
        (start..start + ARENA_BYTES).contains(&(p as usize))
    }

    #[test]
    fn the_hot_heap_serves_a_scope_and_frees_anywhere() {
        enable().expect("the hot arena");
        let a = Alloc;
        let layout = Layout::from_size_align(200, 8).unwrap();
        // SAFETY: allocations of `layout`, each freed once with it.
        unsafe {
            let outside = a.alloc(layout);
            assert!(!hot(outside));
            let inside = {
                let _s = scope();
                let p = a.alloc(layout);
                let q = a.realloc(p, layout, 4000);
                assert!(hot(p) && hot(q));
                q
            };
            // Freed on another thread, outside any scope.
            let addr = inside as usize;
            std::thread::spawn(move || {
                Alloc.dealloc(addr as *mut u8, Layout::from_size_align(4000, 8).unwrap())
            })
            .join()
            .unwrap();
            a.dealloc(outside, layout);
        }
    }
}
