//! What `awcp-ctl watch` and `delegate --wait` show: the daemon's per-delegation event
//! stream (`GET /delegation/:id/events`, ours), replayed from the start on every connect.

use serde::{Deserialize, Serialize};

use awcp_protocol::{DelegationState, TaskEvent};

/// One entry of a delegation's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum WatchEvent {
    /// The delegation changed state.
    #[serde(rename_all = "camelCase")]
    State {
        /// New state.
        state: DelegationState,
        /// When.
        at: String,
        /// Why, for people.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    /// The Executor reported a task event.
    Task {
        /// The event as the Executor sent it.
        event: TaskEvent,
    },
    /// The lease changed.
    #[serde(rename_all = "camelCase")]
    Lease {
        /// `active`, `revoked` or `expired`.
        state: awcp_protocol::dataplane::LeaseState,
        /// Expiry, ISO 8601.
        expires_at: String,
    },
    /// Another daemon took the delegation over (a shared database; the previous owner
    /// stopped beating): it enforces the lease and follows the Executor from here on.
    #[serde(rename_all = "camelCase")]
    Owner {
        /// The daemon that runs it now.
        daemon: String,
        /// The one that ran it before, if known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        previous: Option<String>,
        /// When.
        at: String,
    },
}

impl WatchEvent {
    /// One line for people.
    pub fn describe(&self) -> String {
        match self {
            WatchEvent::State { state, at, detail } => match detail {
                Some(d) => format!("{at}  state {}: {d}", state.as_str()),
                None => format!("{at}  state {}", state.as_str()),
            },
            WatchEvent::Task { event } => {
                let at = event.timestamp();
                match event {
                    TaskEvent::Status(s) => format!(
                        "{at}  executor: {}",
                        s.message.clone().unwrap_or_else(|| "running".into())
                    ),
                    TaskEvent::Snapshot(s) => {
                        format!("{at}  snapshot {}: {}", s.snapshot_id, s.summary)
                    }
                    TaskEvent::Done(d) => format!("{at}  done: {}", d.summary),
                    TaskEvent::Error(e) => {
                        format!("{at}  error {}: {}", e.code.as_str(), e.message)
                    }
                    TaskEvent::RoundDone(r) => {
                        format!("{at}  round {} done: {}", r.round, r.summary)
                    }
                }
            }
            WatchEvent::Lease { state, expires_at } => {
                let state = format!("{state:?}").to_lowercase();
                format!("lease {state} (until {expires_at})")
            }
            WatchEvent::Owner {
                daemon,
                previous,
                at,
            } => match previous {
                Some(p) => format!("{at}  taken over by daemon {daemon} (daemon {p} stopped)"),
                None => format!("{at}  taken over by daemon {daemon}"),
            },
        }
    }

    /// Whether this event ends the delegation.
    pub fn is_terminal(&self) -> bool {
        matches!(self, WatchEvent::State { state, .. } if state.is_terminal())
    }
}
