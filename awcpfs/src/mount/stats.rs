//! Counters of one mount. Names are defined once here; `awcp-ctl status` reads them from
//! the status file the mount writes (`status.json` in its state directory).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::Serialize;

use awcp_protocol::dataplane::{Conflict, Held};

/// The FUSE operations counted, by name (the `fuser::Filesystem` method names).
pub const OPS: [&str; 30] = [
    "lookup",
    "getattr",
    "setattr",
    "readlink",
    "mknod",
    "mkdir",
    "unlink",
    "rmdir",
    "symlink",
    "rename",
    "link",
    "open",
    "read",
    "write",
    "flush",
    "release",
    "fsync",
    "opendir",
    "readdir",
    "readdirplus",
    "releasedir",
    "fsyncdir",
    "statfs",
    "access",
    "create",
    "getxattr",
    "listxattr",
    "setxattr",
    "removexattr",
    "fallocate",
];

/// Upper bounds of the FUSE request latency buckets, in microseconds (a last bucket, +Inf,
/// follows): from 100 µs (a lookup served from memory) to 30 s (the read timeout).
pub const LATENCY_BOUNDS_US: [u64; 17] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000, 30_000_000,
];
const BUCKETS: usize = LATENCY_BOUNDS_US.len() + 1;

/// How long one operation's requests took: a histogram.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct OpLatency {
    /// Requests per bucket of [`LATENCY_BOUNDS_US`] (not cumulative), then those slower
    /// than the last bound.
    pub counts: Vec<u64>,
    /// Their durations summed, in microseconds.
    pub sum_micros: u64,
}

/// Times one FUSE request from [`Stats::count_op`] until it is dropped (the end of the
/// `fuser` callback, after the reply).
#[derive(Debug)]
pub struct OpTimer<'a> {
    stats: &'a Stats,
    op: Option<usize>,
    start: std::time::Instant,
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        let Some(i) = self.op else { return };
        let us = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        let b = LATENCY_BOUNDS_US
            .iter()
            .position(|bound| us <= *bound)
            .unwrap_or(BUCKETS - 1);
        self.stats.latency[i][b].fetch_add(1, Ordering::Relaxed);
        self.stats.latency_sum_us[i].fetch_add(us, Ordering::Relaxed);
    }
}

/// Live counters, updated lock-free on the hot path.
#[derive(Debug, Default)]
pub struct Stats {
    ops: [AtomicU64; OPS.len()],
    /// Per operation, requests per latency bucket.
    latency: [[AtomicU64; BUCKETS]; OPS.len()],
    /// Per operation, the requests' durations summed (µs).
    latency_sum_us: [AtomicU64; OPS.len()],
    files_written_back: AtomicU64,
    bytes_uploaded: AtomicU64,
    commits: AtomicU64,
    sync_errors: AtomicU64,
    passthrough_opens: AtomicU64,
    renewals: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    bytes_from_cache: AtomicU64,
    upstream_applied: AtomicU64,
    upstream_kept_local: AtomicU64,
    files_packed: AtomicU64,
    bytes_packed: AtomicU64,
    conflicts: Mutex<Vec<Conflict>>,
    /// Writes held by the export's commit screen, by path (the latest answer for each).
    held: Mutex<BTreeMap<String, Held>>,
    last_sync_error: Mutex<Option<String>>,
    /// Set while write-back fails: from a failed sync round until one succeeds.
    sync_failing: std::sync::atomic::AtomicBool,
    /// Files whose write was closed (or fsynced) and not yet written back, with when the
    /// oldest such close was: the start of their write-back lag.
    closed_writes: Mutex<std::collections::HashMap<u64, std::time::Instant>>,
    /// How long closed writes waited until the Delegator answered their commit.
    writeback_lag: crate::lag::Lag,
    /// What the remote received from the Delegator (export and block tier): the source of
    /// `bytesFetched` and its parts, counted where the bytes arrive.
    transfer: std::sync::OnceLock<std::sync::Arc<super::remote::TransferCounters>>,
}

/// A point-in-time copy of [`Stats`], as written to `status.json`.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StatsSnapshot {
    /// Content bytes fetched from the Delegator: sent by its export or its block tier,
    /// each block counted once per transfer (`bytesFromStore` are included; the block
    /// cache's `bytesFromCache` are not: they were not fetched).
    pub bytes_fetched: u64,
    /// Blocks fetched from the Delegator (export or block tier).
    pub blocks_fetched: u64,
    /// Files written back to the Delegator.
    pub files_written_back: u64,
    /// Block bytes uploaded.
    pub bytes_uploaded: u64,
    /// Successful commits.
    pub commits: u64,
    /// Failed sync rounds.
    pub sync_errors: u64,
    /// Files handed to the kernel with FUSE passthrough: read-only opens (`--passthrough`)
    /// and a toolchain's new files (`--passthrough-writes`).
    pub passthrough_opens: u64,
    /// Lease renewals this mount obtained.
    pub renewals: u64,
    /// Blocks found in the block cache (no request to the export).
    #[serde(default)]
    pub cache_hits: u64,
    /// Blocks not in the block cache, fetched from the export.
    #[serde(default)]
    pub cache_misses: u64,
    /// Content bytes served by the block cache (not fetched: not in `bytesFetched`).
    #[serde(default)]
    pub bytes_from_cache: u64,
    /// Delegator-side changes shown on the mount (paths updated, created or removed).
    #[serde(default)]
    pub upstream_applied: u64,
    /// Delegator-side changes not shown because the mount has its own change there.
    #[serde(default)]
    pub upstream_kept_local: u64,
    /// Files whose content was stored in the pack file for reading (background hydration,
    /// reads without a handle), and their bytes.
    #[serde(default)]
    pub files_packed: u64,
    /// Bytes of those files.
    #[serde(default)]
    pub bytes_packed: u64,
    /// Blocks fetched from the Delegator's block tier (an object store, through presigned
    /// URLs) instead of its export (included in `blocksFetched`).
    #[serde(default)]
    pub blocks_from_store: u64,
    /// Their bytes (included in `bytesFetched`).
    #[serde(default)]
    pub bytes_from_store: u64,
    /// Blocks the block tier did not give intact (failed fetch, expired URL, content not
    /// matching its hash), fetched from the export instead.
    #[serde(default)]
    pub store_refused: u64,
    /// `GET`s sent to the block tier (a ranged read of a pack counts once, however many
    /// blocks it brought).
    #[serde(default)]
    pub store_requests: u64,
    /// Block bytes written back through the block tier (put in the store, taken from there
    /// by the export; included in `bytesUploaded`).
    #[serde(default)]
    pub bytes_to_store: u64,
    /// FUSE requests served, by operation (operations never requested are left out).
    pub ops: BTreeMap<String, u64>,
    /// How long the FUSE requests took, by operation (operations never requested are left
    /// out).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub op_latency: BTreeMap<String, OpLatency>,
    /// How long writes closed (or fsynced) on the mount waited until the Delegator answered
    /// the commit that carried them (applied, kept beside as a conflict, or held), bucketed
    /// by [`crate::lag::LAG_BOUNDS_US`]; absent before the first.
    #[serde(default, skip_serializing_if = "crate::lag::Histogram::is_empty")]
    pub writeback_lag: crate::lag::Histogram,
    /// Changes the export kept beside instead of applying.
    pub conflicts: Vec<Conflict>,
    /// Files whose write-back the export's commit screen holds now (an AECP contract they
    /// break, or a revised module they import that this worker has not acknowledged): they
    /// stay on the mount and are sent again when they change.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<Held>,
    /// The last sync failure, if the last round failed.
    pub last_sync_error: Option<String>,
}

impl Stats {
    /// Whether any write-back met a conflict (or a hidden path) in this mount's life.
    pub fn had_conflicts(&self) -> bool {
        !self.conflicts.lock().is_empty()
    }

    /// Count a successful commit.
    pub fn add_commit(&self, files: u64, uploaded: u64, conflicts: &[Conflict]) {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.files_written_back.fetch_add(files, Ordering::Relaxed);
        self.bytes_uploaded.fetch_add(uploaded, Ordering::Relaxed);
        self.conflicts.lock().extend_from_slice(conflicts);
        *self.last_sync_error.lock() = None;
        self.sync_failing.store(false, Ordering::Relaxed);
    }

    /// A commit's answer: `held` are held now; `written` (paths the commit changed and the
    /// export did not hold) are not any more.
    pub fn note_held(&self, held: &[Held], written: &[&str]) {
        let mut h = self.held.lock();
        for p in written {
            h.remove(*p);
        }
        for x in held {
            h.insert(x.path.clone(), x.clone());
        }
    }

    /// Forget holds on `paths` (released by the export).
    pub fn release_held(&self, paths: &[String]) {
        let mut h = self.held.lock();
        for p in paths {
            h.remove(p);
        }
    }

    /// A sync round succeeded: write-back works (again). True if it was failing.
    pub fn sync_succeeded(&self) -> bool {
        let was = self.sync_failing.swap(false, Ordering::Relaxed);
        if was {
            *self.last_sync_error.lock() = None;
        }
        was
    }

    /// Whether write-back is failing now: the last sync round failed and none has
    /// succeeded since.
    pub fn sync_failing(&self) -> bool {
        self.sync_failing.load(Ordering::Relaxed)
    }

    /// Count one FUSE request of operation `name` (one of [`OPS`]; others are ignored),
    /// and time it until the returned timer is dropped.
    pub fn count_op(&self, name: &str) -> OpTimer<'_> {
        let op = OPS.iter().position(|o| *o == name);
        if let Some(i) = op {
            self.ops[i].fetch_add(1, Ordering::Relaxed);
        }
        OpTimer {
            stats: self,
            op,
            start: std::time::Instant::now(),
        }
    }

    /// FUSE requests served so far, all operations together (background work compares two
    /// readings to tell whether the agent is active).
    pub fn ops_total(&self) -> u64 {
        self.ops.iter().map(|n| n.load(Ordering::Relaxed)).sum()
    }

    /// FUSE requests served so far other than `read`s: the agent's metadata work, which
    /// is served from memory and so competes with background work for the CPUs.
    pub fn ops_except_reads(&self) -> u64 {
        let read = OPS.iter().position(|o| *o == "read");
        self.ops
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != read)
            .map(|(_, n)| n.load(Ordering::Relaxed))
            .sum()
    }

    /// Count a block-cache lookup: a hit of `bytes`, or a miss.
    pub fn add_cache(&self, hit: bool, bytes: u64) {
        if hit {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
            self.bytes_from_cache.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.cache_misses.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A write to `ino` was closed (or fsynced): its write-back lag starts now, unless an
    /// earlier close of the file still waits.
    pub fn note_closed_write(&self, ino: u64) {
        self.closed_writes
            .lock()
            .entry(ino)
            .or_insert_with(std::time::Instant::now);
    }

    /// Take the closed writes waiting now: a sync round takes them before it reads the
    /// tree, so its commits carry every one of them.
    pub fn take_closed_writes(&self) -> Vec<(u64, std::time::Instant)> {
        self.closed_writes.lock().drain().collect()
    }

    /// When the oldest of `taken` was closed.
    pub fn oldest(taken: &[(u64, std::time::Instant)]) -> Option<std::time::Instant> {
        taken.iter().map(|(_, at)| *at).min()
    }

    /// The round that took `taken` ended: with its commits answered (`applied`), each
    /// write's lag is observed; otherwise they wait for the next round (an earlier close
    /// of the same file kept).
    pub fn closed_writes_done(&self, taken: Vec<(u64, std::time::Instant)>, applied: bool) {
        if applied {
            for (_, at) in taken {
                self.writeback_lag.observe(at.elapsed());
            }
            return;
        }
        let mut waiting = self.closed_writes.lock();
        for (ino, at) in taken {
            let e = waiting.entry(ino).or_insert(at);
            *e = (*e).min(at);
        }
    }

    /// Count a lease renewal.
    pub fn add_renewal(&self) {
        self.renewals.fetch_add(1, Ordering::Relaxed);
    }

    /// Count Delegator-side changes: shown, and kept local.
    pub fn add_upstream(&self, applied: u64, kept_local: u64) {
        self.upstream_applied.fetch_add(applied, Ordering::Relaxed);
        self.upstream_kept_local
            .fetch_add(kept_local, Ordering::Relaxed);
    }

    /// Count a file stored in the pack.
    pub fn add_packed(&self, bytes: u64) {
        self.files_packed.fetch_add(1, Ordering::Relaxed);
        self.bytes_packed.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Count a file handed to the kernel with FUSE passthrough (an open, or a `create`).
    pub fn add_passthrough_open(&self) {
        self.passthrough_opens.fetch_add(1, Ordering::Relaxed);
    }

    /// Count a failed sync round (write-back is failing until a round succeeds). True if
    /// it is the first failure since write-back last worked.
    pub fn add_sync_error(&self, message: String) -> bool {
        self.sync_errors.fetch_add(1, Ordering::Relaxed);
        *self.last_sync_error.lock() = Some(message);
        !self.sync_failing.swap(true, Ordering::Relaxed)
    }

    /// Count fetches with the remote's own counters (the first remote's only).
    pub fn set_transfer(&self, counters: std::sync::Arc<super::remote::TransferCounters>) {
        let _ = self.transfer.set(counters);
    }

    /// Copy the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let load = |f: fn(&super::remote::TransferCounters) -> &AtomicU64| {
            self.transfer
                .get()
                .map_or(0, |c| f(c).load(Ordering::Relaxed))
        };
        // `bytesFetched` is the sum of the two sources: never less than `bytesFromStore`.
        let blocks_from_store = load(|c| &c.store_blocks);
        let bytes_from_store = load(|c| &c.store_bytes);
        StatsSnapshot {
            blocks_from_store,
            bytes_from_store,
            store_refused: load(|c| &c.refused),
            store_requests: load(|c| &c.requests),
            bytes_to_store: load(|c| &c.bytes_put),
            bytes_fetched: bytes_from_store + load(|c| &c.export_bytes),
            blocks_fetched: blocks_from_store + load(|c| &c.export_blocks),
            files_written_back: self.files_written_back.load(Ordering::Relaxed),
            bytes_uploaded: self.bytes_uploaded.load(Ordering::Relaxed),
            commits: self.commits.load(Ordering::Relaxed),
            sync_errors: self.sync_errors.load(Ordering::Relaxed),
            passthrough_opens: self.passthrough_opens.load(Ordering::Relaxed),
            renewals: self.renewals.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            cache_misses: self.cache_misses.load(Ordering::Relaxed),
            bytes_from_cache: self.bytes_from_cache.load(Ordering::Relaxed),
            upstream_applied: self.upstream_applied.load(Ordering::Relaxed),
            files_packed: self.files_packed.load(Ordering::Relaxed),
            bytes_packed: self.bytes_packed.load(Ordering::Relaxed),
            upstream_kept_local: self.upstream_kept_local.load(Ordering::Relaxed),
            ops: OPS
                .iter()
                .zip(&self.ops)
                .map(|(name, n)| (name.to_string(), n.load(Ordering::Relaxed)))
                .filter(|(_, n)| *n > 0)
                .collect(),
            op_latency: OPS
                .iter()
                .enumerate()
                .filter_map(|(i, name)| {
                    let counts: Vec<u64> = self.latency[i]
                        .iter()
                        .map(|n| n.load(Ordering::Relaxed))
                        .collect();
                    (counts.iter().sum::<u64>() > 0).then(|| {
                        (
                            name.to_string(),
                            OpLatency {
                                counts,
                                sum_micros: self.latency_sum_us[i].load(Ordering::Relaxed),
                            },
                        )
                    })
                })
                .collect(),
            writeback_lag: self.writeback_lag.snapshot(),
            conflicts: self.conflicts.lock().clone(),
            held: self.held.lock().values().cloned().collect(),
            last_sync_error: self.last_sync_error.lock().clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_counters_count_known_operations_only() {
        let s = Stats::default();
        s.count_op("lookup");
        s.count_op("lookup");
        s.count_op("read");
        s.count_op("no-such-op");
        let snap = s.snapshot();
        assert_eq!(snap.ops.get("lookup"), Some(&2));
        assert_eq!(snap.ops.get("read"), Some(&1));
        assert_eq!(snap.ops.len(), 2, "{:?}", snap.ops);
        // Each timed request fell in one bucket.
        let lookups = &snap.op_latency["lookup"];
        assert_eq!(lookups.counts.len(), LATENCY_BOUNDS_US.len() + 1);
        assert_eq!(lookups.counts.iter().sum::<u64>(), 2);
        assert_eq!(snap.op_latency.len(), 2, "{:?}", snap.op_latency);
        assert_eq!(s.ops_total(), 3);
        // What background work on a local export watches: everything but reads.
        assert_eq!(s.ops_except_reads(), 2);
    }

    #[test]
    fn a_slow_request_lands_in_its_bucket() {
        let s = Stats::default();
        {
            let _op = s.count_op("read");
            std::thread::sleep(std::time::Duration::from_millis(30));
        }
        let l = &s.snapshot().op_latency["read"];
        // 30 ms: above the 25 ms bound, within 50 ms (a loaded machine may take longer).
        let at = l.counts.iter().position(|n| *n == 1).unwrap();
        assert!(LATENCY_BOUNDS_US[at] >= 50_000, "{l:?}");
        assert!(l.sum_micros >= 30_000, "{l:?}");
    }
}
