//! What a warm read costs in FUSE requests, on a real mount of an in-process export: with
//! the mount's default options, reading a file the kernel already holds — `open`, `fstat`,
//! `read`, `close`, as `cat`, an editor or an import does — asks the mount nothing. With
//! the kernel's writeback cache it costs a `getattr` every time: the kernel's `close` of a
//! file under the cache marks its block count stale (`fuse_flush`), and the next `stat`
//! asks. That cost is why the cache is not the default (docs/BENCHMARKS.md).

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use awcpfs::mount::{Mount, MountConfig};
use awcpfs::testing::fuse_available;

mod common;
use common::InProcess;

const FILES: usize = 40;

/// Requests by kind, from the mount's counters.
fn ops(m: &Mount) -> std::collections::BTreeMap<String, u64> {
    m.stats().ops.into_iter().collect()
}

/// Read every file the way `cat` does: open, fstat, read to the end, close.
fn read_all(mnt: &Path) {
    for i in 0..FILES {
        let p = mnt.join(format!("f{i}.txt"));
        let f = std::fs::File::open(&p).unwrap();
        assert!(f.metadata().unwrap().size() > 0);
        let mut s = String::new();
        std::io::Read::read_to_string(&mut &f, &mut s).unwrap();
        assert_eq!(s, format!("file {i}\n"));
    }
}

/// The requests one more warm pass makes, on a mount with `adjust` applied.
fn requests_of_a_warm_pass(adjust: impl FnOnce(&mut MountConfig)) -> (u64, u64) {
    let mut s = InProcess::start(
        |src| {
            for i in 0..FILES {
                std::fs::write(src.join(format!("f{i}.txt")), format!("file {i}\n")).unwrap();
            }
        },
        adjust,
    );
    // Twice: the first pass fetches and caches, the second settles what the first left.
    read_all(&s.mnt);
    read_all(&s.mnt);
    let before = ops(s.mount());
    read_all(&s.mnt);
    let after = ops(s.mount());
    s.end();
    let delta = |k: &str| after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0);
    let total: u64 = after.values().sum::<u64>() - before.values().sum::<u64>();
    (total, delta("getattr"))
}

#[test]
fn a_warm_read_asks_the_default_mount_nothing() {
    if !fuse_available() {
        return;
    }
    let (total, getattr) = requests_of_a_warm_pass(|_| {});
    assert_eq!(
        (total, getattr),
        (0, 0),
        "a warm pass over {FILES} files reached the default mount"
    );
}

#[test]
fn wbcache_a_warm_read_costs_a_getattr_under_the_writeback_cache() {
    if !fuse_available() {
        return;
    }
    let (_, getattr) = requests_of_a_warm_pass(|c| c.kernel.writeback_cache = true);
    assert_eq!(
        getattr, FILES as u64,
        "under the writeback cache each close should leave the next fstat a getattr"
    );
}
