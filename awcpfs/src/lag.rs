//! Write-back lag: how long a write closed on the mount waits until the Delegator has
//! applied it, as a histogram. Both halves keep one: the mount from a file's close (or
//! `fsync`) to the answer of the commit that carried it (`stats.writebackLag` in
//! `status.json`, `awcp_mount_writeback_lag_seconds` on the Executor's `/metrics`), and the
//! export from the same close — the commit says how long its oldest change had waited when
//! it was sent (`ageMs`) — to the commit applied to the workspace
//! (`awcp_export_writeback_lag_seconds` on the daemon's `/metrics`). The export's figure
//! leaves out the time the commit spent on the wire, and needs no clock shared by the two
//! machines.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Upper bounds of the lag buckets, in microseconds (a last bucket, +Inf, follows): from
/// 10 ms (a close the syncer took at once) to 15 min (write-back failing for a while).
pub const LAG_BOUNDS_US: [u64; 14] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    30_000_000,
    60_000_000,
    300_000_000,
    900_000_000,
];
const BUCKETS: usize = LAG_BOUNDS_US.len() + 1;

/// A histogram's values at one moment.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Histogram {
    /// Observations per bucket (not cumulative), then those above the last bound.
    pub counts: Vec<u64>,
    /// The observations summed, in microseconds.
    pub sum_micros: u64,
}

impl Histogram {
    /// No observation yet.
    pub fn is_empty(&self) -> bool {
        self.counts.iter().all(|n| *n == 0)
    }

    /// Add `other`'s observations (bucket by bucket).
    pub fn add(&mut self, other: &Histogram) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum_micros += other.sum_micros;
    }
}

/// The live histogram of write-back lags, bucketed by [`LAG_BOUNDS_US`].
#[derive(Debug, Default)]
pub struct Lag {
    counts: [AtomicU64; BUCKETS],
    sum_us: AtomicU64,
}

impl Lag {
    /// Count one write applied after `lag`.
    pub fn observe(&self, lag: Duration) {
        let us = u64::try_from(lag.as_micros()).unwrap_or(u64::MAX);
        let b = LAG_BOUNDS_US
            .iter()
            .position(|bound| us <= *bound)
            .unwrap_or(BUCKETS - 1);
        self.counts[b].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Copy the histogram.
    pub fn snapshot(&self) -> Histogram {
        Histogram {
            counts: self
                .counts
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect(),
            sum_micros: self.sum_us.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lag_lands_in_its_bucket_and_histograms_add() {
        let lag = Lag::default();
        assert!(lag.snapshot().is_empty());
        lag.observe(Duration::from_millis(120));
        lag.observe(Duration::from_secs(3600));
        let h = lag.snapshot();
        assert_eq!(h.counts.len(), LAG_BOUNDS_US.len() + 1);
        // 120 ms: above 100 ms, within 250 ms.
        let at = LAG_BOUNDS_US.iter().position(|b| *b == 250_000).unwrap();
        assert_eq!(h.counts[at], 1, "{h:?}");
        // An hour: past the last bound.
        assert_eq!(h.counts[LAG_BOUNDS_US.len()], 1, "{h:?}");
        assert_eq!(h.sum_micros, 120_000 + 3_600_000_000);
        let mut sum = h.clone();
        sum.add(&h);
        assert_eq!(sum.counts.iter().sum::<u64>(), 4);
        assert_eq!(sum.sum_micros, 2 * h.sum_micros);
    }
}
