//! The Executor's `GET /metrics` (see [`crate::metrics`]): assignments by state and the
//! mounts' counters — those of mounts that have ended plus those of the mounts now.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use awcp_protocol::AssignmentState;

use super::Executor;
use crate::metrics::{CONTENT_TYPE, MountTotals, Scrape};

/// Behind the Executor's credential (as the full `GET /awcp/status`): 401 without it.
pub(super) async fn metrics(State(ex): State<Arc<Executor>>, headers: HeaderMap) -> Response {
    if !super::routes::authorized(&ex, &headers) {
        return (
            StatusCode::UNAUTHORIZED,
            "GET /metrics needs the Executor's credential as a bearer token (its state directory's executor-token file)\n",
        )
            .into_response();
    }
    let tasks: Vec<_> = ex.tasks.lock().values().cloned().collect();
    let names = ["pending", "active", "idle", "completed", "error"];
    let mut by_state = [0i64; 5];
    let mut live = MountTotals::default();
    for a in &tasks {
        let i = match *a.state.lock() {
            AssignmentState::Pending => 0,
            AssignmentState::Active => 1,
            AssignmentState::Idle => 2,
            AssignmentState::Completed => 3,
            AssignmentState::Error => 4,
        };
        by_state[i] += 1;
        if let Some(m) = a.mount.lock().as_ref() {
            for s in m.stats_snapshots() {
                live.add(&s);
            }
        }
    }
    let mut s = Scrape::new();
    s.gauges(
        "executor_assignments",
        "delegations this Executor has taken, by state (error: failed, cancelled or expired)",
        "state",
        names.iter().copied().zip(by_state),
    );
    s.gauge(
        "executor_mounts_active",
        "mounts open now",
        live.mounts as i64,
    );
    ex.ended_mounts.get().merged(&live).scrape(&mut s);
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], s.finish()).into_response()
}
