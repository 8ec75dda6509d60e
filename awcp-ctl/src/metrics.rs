//! `GET /metrics`: the daemon's and the Executor's counters in the Prometheus text format
//! ([`prometheus_client`]), for the monitoring systems operators already run.
//!
//! Every metric name is defined here, once. Values are read at scrape time from the same
//! state that `status` shows (the daemon's delegations and their exports, the block tier;
//! the Executor's assignments and mounts), so a scrape and a `status` taken together agree.
//! Counters of delegations and mounts that have ended are kept: the daemon keeps every
//! delegation it ran in memory, and the Executor adds a mount's final counters to its totals
//! when the mount ends ([`MountTotals`]), so the `_total` series never go down while the
//! process lives.

use std::collections::BTreeMap;

use parking_lot::Mutex;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use awcpfs::lag::{Histogram, LAG_BOUNDS_US};
use awcpfs::mount::stats::{LATENCY_BOUNDS_US, OpLatency, StatsSnapshot};
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// The content type of the text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;

/// One scrape's registry, filled with values read now.
pub(crate) struct Scrape {
    registry: Registry,
}

impl Scrape {
    pub(crate) fn new() -> Scrape {
        Scrape {
            registry: Registry::with_prefix("awcp"),
        }
    }

    /// A counter (its name without `_total`, which the format adds).
    pub(crate) fn counter(&mut self, name: &str, help: &str, value: u64) {
        let c: Counter = Counter::default();
        c.inc_by(value);
        self.registry.register(name, help, c);
    }

    /// A gauge.
    pub(crate) fn gauge(&mut self, name: &str, help: &str, value: i64) {
        let g: Gauge = Gauge::default();
        g.set(value);
        self.registry.register(name, help, g);
    }

    /// A counter per label set.
    pub(crate) fn counters<'a>(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        values: impl IntoIterator<Item = (&'a str, u64)>,
    ) {
        let family = Family::<Labels, Counter>::default();
        for (v, n) in values {
            family
                .get_or_create(&vec![(label.to_owned(), v.to_owned())])
                .inc_by(n);
        }
        self.registry.register(name, help, family);
    }

    /// A gauge per label set.
    pub(crate) fn gauges<'a>(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        values: impl IntoIterator<Item = (&'a str, i64)>,
    ) {
        let family = Family::<Labels, Gauge>::default();
        for (v, n) in values {
            family
                .get_or_create(&vec![(label.to_owned(), v.to_owned())])
                .set(n);
        }
        self.registry.register(name, help, family);
    }

    /// A histogram per label set, from counts already bucketed (bounds in seconds).
    pub(crate) fn histograms<'a>(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        values: impl IntoIterator<Item = (&'a str, Bucketed)>,
    ) {
        let family = Family::<Labels, Bucketed>::default();
        for (v, h) in values {
            *family
                .get_or_create(&vec![(label.to_owned(), v.to_owned())])
                .0
                .lock() = h.0.into_inner();
        }
        self.registry.register(name, help, family);
    }

    /// A histogram without labels, from counts already bucketed (bounds in seconds).
    pub(crate) fn histogram(&mut self, name: &str, help: &str, value: Bucketed) {
        self.registry.register(name, help, value);
    }

    /// The text exposition.
    pub(crate) fn finish(self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// A histogram's values: sum, count, and per-bucket counts with their upper bounds (the
/// last +Inf).
type HistogramValues = (f64, u64, Vec<(f64, u64)>);

/// A histogram whose observations were bucketed elsewhere (the mounts count them).
#[derive(Debug, Default)]
pub(crate) struct Bucketed(Mutex<HistogramValues>);

impl Bucketed {
    /// From a mount's latency counts (µs bounds [`LATENCY_BOUNDS_US`]) to seconds.
    pub(crate) fn from_latency(l: &OpLatency) -> Bucketed {
        Bucketed::from_counts(&LATENCY_BOUNDS_US, &l.counts, l.sum_micros)
    }

    /// From write-back lag counts (µs bounds [`LAG_BOUNDS_US`]) to seconds.
    pub(crate) fn from_lag(h: &Histogram) -> Bucketed {
        Bucketed::from_counts(&LAG_BOUNDS_US, &h.counts, h.sum_micros)
    }

    /// From counts per bucket of `bounds_us` (then +Inf) and their sum (µs) to seconds.
    fn from_counts(bounds_us: &[u64], counts: &[u64], sum_micros: u64) -> Bucketed {
        let buckets = bounds_us
            .iter()
            .map(|us| *us as f64 / 1e6)
            .chain([f64::INFINITY])
            .zip(counts.iter().copied().chain(std::iter::repeat(0)))
            .collect();
        Bucketed(Mutex::new((
            sum_micros as f64 / 1e6,
            counts.iter().sum(),
            buckets,
        )))
    }
}

impl TypedMetric for Bucketed {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Bucketed {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = &*self.0.lock();
        encoder.encode_histogram::<NoLabelSet>(*sum, *count, buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// `a` plus `b`, bucket by bucket.
fn add_latency(a: &mut OpLatency, b: &OpLatency) {
    if a.counts.len() < b.counts.len() {
        a.counts.resize(b.counts.len(), 0);
    }
    for (x, y) in a.counts.iter_mut().zip(&b.counts) {
        *x += y;
    }
    a.sum_micros += b.sum_micros;
}

/// The counters of mounts summed: what the Executor reports as its mounts' totals.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MountTotals {
    /// FUSE requests served, by operation.
    pub ops: BTreeMap<String, u64>,
    /// How long they took, by operation.
    pub op_latency: BTreeMap<String, OpLatency>,
    /// Content bytes fetched from the Delegator (its export and its block tier).
    pub bytes_fetched: u64,
    /// Of those, from the Delegator's block tier.
    pub bytes_from_store: u64,
    /// Content bytes the block cache served instead (not fetched).
    pub bytes_from_cache: u64,
    /// Blocks the block tier did not give intact.
    pub store_refused: u64,
    /// Files written back to the Delegator.
    pub files_written_back: u64,
    /// Block bytes uploaded to the Delegator.
    pub bytes_uploaded: u64,
    /// Commits the Delegator applied.
    pub commits: u64,
    /// Failed write-back rounds.
    pub sync_errors: u64,
    /// Changes the export kept beside instead of applying.
    pub conflicts: u64,
    /// Delegator-side changes shown on the mounts.
    pub upstream_applied: u64,
    /// Files handed to the kernel with FUSE passthrough (opens and toolchain creates).
    pub passthrough_opens: u64,
    /// How long closed writes waited until the Delegator answered their commit.
    pub writeback_lag: Histogram,
    /// Mounts counted.
    pub mounts: u64,
}

impl MountTotals {
    /// Add one mount's counters.
    pub fn add(&mut self, s: &StatsSnapshot) {
        for (op, n) in &s.ops {
            *self.ops.entry(op.clone()).or_default() += n;
        }
        for (op, l) in &s.op_latency {
            add_latency(self.op_latency.entry(op.clone()).or_default(), l);
        }
        self.bytes_fetched += s.bytes_fetched;
        self.bytes_from_store += s.bytes_from_store;
        self.bytes_from_cache += s.bytes_from_cache;
        self.store_refused += s.store_refused;
        self.files_written_back += s.files_written_back;
        self.bytes_uploaded += s.bytes_uploaded;
        self.commits += s.commits;
        self.sync_errors += s.sync_errors;
        self.conflicts += s.conflicts.len() as u64;
        self.upstream_applied += s.upstream_applied;
        self.passthrough_opens += s.passthrough_opens;
        self.writeback_lag.add(&s.writeback_lag);
        self.mounts += 1;
    }

    /// `self` and `other` together.
    pub fn merged(&self, other: &MountTotals) -> MountTotals {
        let mut m = self.clone();
        for (op, n) in &other.ops {
            *m.ops.entry(op.clone()).or_default() += n;
        }
        for (op, l) in &other.op_latency {
            add_latency(m.op_latency.entry(op.clone()).or_default(), l);
        }
        m.bytes_fetched += other.bytes_fetched;
        m.bytes_from_store += other.bytes_from_store;
        m.bytes_from_cache += other.bytes_from_cache;
        m.store_refused += other.store_refused;
        m.files_written_back += other.files_written_back;
        m.bytes_uploaded += other.bytes_uploaded;
        m.commits += other.commits;
        m.sync_errors += other.sync_errors;
        m.conflicts += other.conflicts;
        m.upstream_applied += other.upstream_applied;
        m.passthrough_opens += other.passthrough_opens;
        m.writeback_lag.add(&other.writeback_lag);
        m.mounts += other.mounts;
        m
    }

    /// Write these totals into a scrape.
    pub(crate) fn scrape(&self, s: &mut Scrape) {
        s.counters(
            "mount_fuse_requests",
            "FUSE requests the mounts served, by operation",
            "op",
            self.ops.iter().map(|(k, v)| (k.as_str(), *v)),
        );
        s.histograms(
            "mount_fuse_request_duration_seconds",
            "how long the mounts took to serve FUSE requests, by operation (until the reply)",
            "op",
            self.op_latency
                .iter()
                .map(|(k, l)| (k.as_str(), Bucketed::from_latency(l))),
        );
        s.counter(
            "mount_bytes_fetched",
            "content bytes the mounts fetched from the Delegator (its export and its block tier), \
             as they arrived: a block fetched twice counts twice",
            self.bytes_fetched,
        );
        s.counter(
            "mount_bytes_from_store",
            "of the bytes fetched, those from the Delegator's block tier",
            self.bytes_from_store,
        );
        s.counter(
            "mount_bytes_from_cache",
            "content bytes the block cache served instead of a fetch",
            self.bytes_from_cache,
        );
        s.counter(
            "mount_store_refused_blocks",
            "blocks the block tier did not give intact (fetched from the export instead)",
            self.store_refused,
        );
        s.counter(
            "mount_files_written_back",
            "files the mounts wrote back to the Delegator",
            self.files_written_back,
        );
        s.counter(
            "mount_bytes_uploaded",
            "block bytes the mounts uploaded to the Delegator",
            self.bytes_uploaded,
        );
        s.counter(
            "mount_commits",
            "write-back commits the Delegator applied",
            self.commits,
        );
        s.histogram(
            "mount_writeback_lag_seconds",
            "how long writes closed (or fsynced) on the mounts waited until the Delegator \
             answered the commit that carried them",
            Bucketed::from_lag(&self.writeback_lag),
        );
        s.counter(
            "mount_sync_errors",
            "write-back rounds that failed (retried)",
            self.sync_errors,
        );
        s.counter(
            "mount_conflicts",
            "changes the Delegator kept beside instead of applying (conflicts)",
            self.conflicts,
        );
        s.counter(
            "mount_upstream_applied",
            "Delegator-side changes shown on the mounts",
            self.upstream_applied,
        );
        s.counter(
            "mount_passthrough_opens",
            "files handed to the kernel with FUSE passthrough (read-only opens, a toolchain's new files)",
            self.passthrough_opens,
        );
        s.counter("mounts", "mounts made", self.mounts);
    }
}

/// The Executor's totals of mounts that have ended.
#[derive(Debug, Default)]
pub(crate) struct EndedMounts(Mutex<MountTotals>);

impl EndedMounts {
    pub(crate) fn add(&self, stats: &[StatsSnapshot]) {
        let mut t = self.0.lock();
        for s in stats {
            t.add(s);
        }
    }

    pub(crate) fn get(&self) -> MountTotals {
        self.0.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_is_the_text_format_with_every_value() {
        let mut s = Scrape::new();
        s.counter("bytes_served", "bytes served", 42);
        s.gauges(
            "delegations",
            "delegations by state",
            "state",
            [("running", 2), ("completed", 5)],
        );
        let text = s.finish();
        assert!(text.contains("# TYPE awcp_bytes_served counter"), "{text}");
        assert!(text.contains("awcp_bytes_served_total 42"), "{text}");
        assert!(
            text.contains("awcp_delegations{state=\"running\"} 2"),
            "{text}"
        );
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
    }

    #[test]
    fn totals_add_up_ops_and_conflicts() {
        let mut a = StatsSnapshot::default();
        a.ops.insert("read".into(), 3);
        a.bytes_fetched = 10;
        let mut b = StatsSnapshot::default();
        b.ops.insert("read".into(), 4);
        b.ops.insert("lookup".into(), 1);
        b.bytes_fetched = 5;
        let mut t = MountTotals::default();
        t.add(&a);
        let mut u = MountTotals::default();
        u.add(&b);
        let m = t.merged(&u);
        assert_eq!(m.ops["read"], 7);
        assert_eq!(m.ops["lookup"], 1);
        assert_eq!(m.bytes_fetched, 15);
        assert_eq!(m.mounts, 2);
    }

    #[test]
    fn write_back_lags_add_up_and_are_a_histogram_in_seconds() {
        let lag = awcpfs::lag::Lag::default();
        lag.observe(std::time::Duration::from_millis(40));
        let a = StatsSnapshot {
            writeback_lag: lag.snapshot(),
            ..Default::default()
        };
        lag.observe(std::time::Duration::from_secs(2));
        let b = StatsSnapshot {
            writeback_lag: lag.snapshot(),
            ..Default::default()
        };
        let mut t = MountTotals::default();
        t.add(&a);
        t.add(&b);
        // Three observations: one in a, two in b.
        assert_eq!(t.writeback_lag.counts.iter().sum::<u64>(), 3);
        let mut s = Scrape::new();
        t.scrape(&mut s);
        let text = s.finish();
        assert!(
            text.contains("# TYPE awcp_mount_writeback_lag_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains("awcp_mount_writeback_lag_seconds_count 3"),
            "{text}"
        );
        // Both 40 ms lags within 50 ms, the 2 s one by 2.5 s (cumulative buckets).
        assert!(
            text.contains("awcp_mount_writeback_lag_seconds_bucket{le=\"0.05\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("awcp_mount_writeback_lag_seconds_bucket{le=\"2.5\"} 3"),
            "{text}"
        );
    }
}
