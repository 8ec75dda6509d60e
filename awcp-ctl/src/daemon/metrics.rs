//! The daemon's `GET /metrics` (see [`crate::metrics`]): delegations by state, what the
//! exports served and took back, and the block tier's health, summed over every delegation
//! this daemon has run.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use awcp_protocol::DelegationState;
use awcpfs::export::ExportStats;

use super::Daemon;
use crate::metrics::{Bucketed, CONTENT_TYPE, Scrape};

/// Every state, so that a state with no delegation reads 0 rather than missing.
const STATES: [DelegationState; 10] = [
    DelegationState::Created,
    DelegationState::Invited,
    DelegationState::Accepted,
    DelegationState::Started,
    DelegationState::Running,
    DelegationState::Idle,
    DelegationState::Completed,
    DelegationState::Error,
    DelegationState::Cancelled,
    DelegationState::Expired,
];

/// The exports' counters summed.
#[derive(Debug, Default)]
struct Exports {
    bytes_served: u64,
    blocks_served: u64,
    manifest_fetches: u64,
    commits: u64,
    files_written: u64,
    bytes_written: u64,
    conflicts: u64,
    upstream_changes: u64,
    store_bytes_uploaded: u64,
    store_urls: u64,
    store_bytes_adopted: u64,
}

impl Exports {
    fn add(&mut self, s: &ExportStats) {
        self.bytes_served += s.bytes_served;
        self.blocks_served += s.blocks_served;
        self.manifest_fetches += s.manifest_fetches;
        self.commits += s.commits;
        self.files_written += s.files_written;
        self.bytes_written += s.bytes_written;
        self.conflicts += s.conflicts;
        self.upstream_changes += s.upstream_changes;
        self.store_bytes_uploaded += s.store_bytes_uploaded;
        self.store_urls += s.store_urls;
        self.store_bytes_adopted += s.store_bytes_adopted;
    }
}

pub(super) async fn metrics(State(d): State<Arc<Daemon>>) -> impl IntoResponse {
    let live: Vec<_> = d.live.lock().values().cloned().collect();
    let mut by_state = [0i64; STATES.len()];
    let mut exports = Exports::default();
    let mut renewals = 0u64;
    let mut lag = awcpfs::lag::Histogram::default();
    // AECP: what each worker (a delegation) has been delivered, from the artifact store.
    let deliveries: u64 = live
        .iter()
        .map(|l| {
            let id = l.d.lock().record.id.as_str().to_string();
            d.aecp.store.delivered(&id).map_or(0, |v| v.len() as u64)
        })
        .sum();
    for l in &live {
        let state = l.d.lock().record.state;
        if let Some(i) = STATES.iter().position(|s| *s == state) {
            by_state[i] += 1;
        }
        renewals += l.lease.snapshot().renewals;
        for e in l.exports.lock().iter() {
            exports.add(&e.stats());
            lag.add(&e.writeback_lag());
        }
    }
    let mut s = Scrape::new();
    s.gauges(
        "delegations",
        "delegations this daemon has run, by state (cancelled: revoked; expired: the lease ran out)",
        "state",
        STATES.iter().zip(by_state).map(|(st, n)| (st.as_str(), n)),
    );
    s.counter("lease_renewals", "lease renewals granted", renewals);
    s.counter(
        "aecp_deliveries",
        "AECP findings delivered to workers (one per finding and worker that received it)",
        deliveries,
    );
    s.counter(
        "export_bytes_served",
        "block bytes the exports served to mounts (POST /blocks)",
        exports.bytes_served,
    );
    s.counter(
        "export_blocks_served",
        "blocks the exports served to mounts",
        exports.blocks_served,
    );
    s.counter(
        "export_manifest_fetches",
        "manifests the exports served",
        exports.manifest_fetches,
    );
    s.counter(
        "export_commits",
        "write-back commits applied to the workspaces",
        exports.commits,
    );
    s.counter(
        "export_files_written",
        "files written into the workspaces by commits (conflict copies included)",
        exports.files_written,
    );
    s.counter(
        "export_bytes_written",
        "bytes of those files",
        exports.bytes_written,
    );
    s.counter(
        "export_conflicts",
        "changes kept beside instead of applied (the Delegator had changed the file)",
        exports.conflicts,
    );
    s.histogram(
        "export_writeback_lag_seconds",
        "how long the writes of applied commits had waited since the mount closed them (the \
         mount's wait, as its commit says, plus the time until applied; time on the wire \
         not included)",
        Bucketed::from_lag(&lag),
    );
    s.counter(
        "export_upstream_changes",
        "Delegator-side changes recorded for mounts",
        exports.upstream_changes,
    );
    s.counter(
        "export_store_bytes_uploaded",
        "bytes the exports uploaded to the block tier",
        exports.store_bytes_uploaded,
    );
    s.counter(
        "export_store_urls",
        "presigned block tier URLs handed to mounts",
        exports.store_urls,
    );
    s.counter(
        "export_store_bytes_adopted",
        "write-back bytes the exports took from the block tier instead of /upload",
        exports.store_bytes_adopted,
    );
    if let Some(t) = d.block_tier_stats() {
        s.gauge(
            "block_store_blocks",
            "blocks the block tier knows the store holds",
            t.blocks_in_store as i64,
        );
        s.counter(
            "block_store_bytes_uploaded",
            "bytes this daemon uploaded to the block store",
            t.bytes_uploaded,
        );
        s.counter(
            "block_store_urls",
            "presigned URLs this daemon signed",
            t.urls_issued,
        );
        s.counter(
            "block_store_upload_errors",
            "uploads to the block store that failed (the export serves those blocks)",
            t.upload_errors,
        );
        s.counter(
            "block_store_errors",
            "calls to the block store that failed or ran out of time",
            t.store_errors,
        );
        s.counter(
            "block_store_breaker_trips",
            "times the block store's circuit breaker opened",
            t.breaker_trips,
        );
        s.counter(
            "block_store_objects_forgotten",
            "objects found gone from the block store and forgotten",
            t.objects_forgotten,
        );
        let state = t.breaker.as_str();
        s.gauges(
            "block_store_breaker",
            "the block store's circuit breaker: 1 for the state it is in",
            "state",
            ["closed", "open", "half-open"]
                .into_iter()
                .map(|st| (st, i64::from(st == state))),
        );
    }
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], s.finish())
}
