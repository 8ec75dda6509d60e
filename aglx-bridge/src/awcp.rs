//! AWCP lifecycle events as AGLX messages, and the credits they cost.
//!
//! | AWCP event (Delegator) | AGLX frame |
//! |---|---|
//! | delegation sent (INVITE) | `task.assign`, `CREDITS` = the full lease's price when priced |
//! | any other state change | `status.report` `{"delegation_id","state","detail"?}` |
//! | lease renewed | `status.report` `{"delegation_id","lease":"active","expires_at"}` |
//! | terminal state | `task.result` `{"delegation_id","outcome","detail"?}`, then `credit.transfer` when priced |
//!
//! Bodies are snake_case JSON like the seed's examples. The task's prompt is never sent: only
//! its description, cut to 280 characters.

use awcp_protocol::DelegationState;
use serde::{Deserialize, Serialize};

use crate::frame::{Frame, MessageType, Transport};

/// Longest task description carried, in characters.
pub const MAX_DESCRIPTION: usize = 280;

/// What a delegation costs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pricing {
    /// Credits per started minute of lease.
    pub per_lease_minute: u64,
    /// Credits per started MiB moved through the export (served and written back).
    pub per_mib: u64,
}

impl Pricing {
    /// The price of `lease_seconds` of lease and `bytes` moved (saturating).
    pub fn price(&self, lease_seconds: u64, bytes: u64) -> u64 {
        let minutes = lease_seconds.div_ceil(60);
        let mib = bytes.div_ceil(1024 * 1024);
        self.per_lease_minute
            .saturating_mul(minutes)
            .saturating_add(self.per_mib.saturating_mul(mib))
    }

    /// Whether anything costs anything.
    pub fn is_free(&self) -> bool {
        self.per_lease_minute == 0 && self.per_mib == 0
    }
}

/// A Delegator-side lifecycle event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lifecycle {
    /// INVITE was sent.
    Delegated {
        /// `dlg_…`.
        delegation_id: String,
        /// The Executor's AWCP URL.
        executor_url: String,
        /// The task's description.
        description: String,
        /// Requested lease, seconds.
        ttl_seconds: u64,
        /// `ro` or `rw`.
        access_mode: String,
    },
    /// A non-terminal state change (other than the one to `invited`).
    State {
        /// `dlg_…`.
        delegation_id: String,
        /// The new state.
        state: DelegationState,
        /// Why, for people.
        detail: Option<String>,
    },
    /// The lease was renewed.
    LeaseRenewed {
        /// `dlg_…`.
        delegation_id: String,
        /// New expiry, ISO 8601.
        expires_at: String,
    },
    /// A terminal state was reached.
    Finished {
        /// `dlg_…`.
        delegation_id: String,
        /// `completed`, `error`, `cancelled` or `expired`.
        state: DelegationState,
        /// Summary or reason.
        detail: Option<String>,
        /// Seconds the lease was in use.
        lease_seconds: u64,
        /// Bytes moved through the export.
        bytes: u64,
    },
}

/// `task.assign` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskAssign {
    /// Always `awcp.delegation`.
    pub task: String,
    /// `dlg_…`.
    pub delegation_id: String,
    /// The Executor's AWCP URL.
    pub executor_url: String,
    /// Task description (capped).
    pub description: String,
    /// Requested lease, seconds.
    pub ttl_seconds: u64,
    /// `ro` or `rw`.
    pub access_mode: String,
}

/// `status.report` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    /// `dlg_…`.
    pub delegation_id: String,
    /// New state, for state changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// `active`, for renewals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
    /// New expiry, for renewals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// `task.result` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskResult {
    /// `dlg_…`.
    pub delegation_id: String,
    /// The terminal state.
    pub outcome: String,
    /// Summary or reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// `credit.transfer` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreditTransfer {
    /// `dlg_…`.
    pub delegation_id: String,
    /// Credits owed (same as the `CREDITS` header).
    pub credits: u64,
    /// Lease seconds used.
    pub lease_seconds: u64,
    /// Bytes moved.
    pub bytes: u64,
}

fn cap(s: &str) -> String {
    s.chars().take(MAX_DESCRIPTION).collect()
}

/// The frames for one event (empty for none), without `FROM`/`TO`: the sender sets those.
pub fn frames(event: &Lifecycle, pricing: Option<&Pricing>) -> Vec<Frame> {
    let pricing = pricing.filter(|p| !p.is_free());
    let frame = |t| Frame::new(Transport::Tcp, t);
    match event {
        Lifecycle::Delegated {
            delegation_id,
            executor_url,
            description,
            ttl_seconds,
            access_mode,
        } => {
            let mut f = frame(MessageType::TaskAssign).json(&TaskAssign {
                task: "awcp.delegation".into(),
                delegation_id: delegation_id.clone(),
                executor_url: executor_url.clone(),
                description: cap(description),
                ttl_seconds: *ttl_seconds,
                access_mode: access_mode.clone(),
            });
            f.credits = pricing.map(|p| p.price(*ttl_seconds, 0));
            vec![f]
        }
        Lifecycle::State {
            delegation_id,
            state,
            detail,
        } => vec![frame(MessageType::StatusReport).json(&StatusReport {
            delegation_id: delegation_id.clone(),
            state: Some(state.as_str().into()),
            lease: None,
            expires_at: None,
            detail: detail.as_deref().map(cap),
        })],
        Lifecycle::LeaseRenewed {
            delegation_id,
            expires_at,
        } => vec![frame(MessageType::StatusReport).json(&StatusReport {
            delegation_id: delegation_id.clone(),
            state: None,
            lease: Some("active".into()),
            expires_at: Some(expires_at.clone()),
            detail: None,
        })],
        Lifecycle::Finished {
            delegation_id,
            state,
            detail,
            lease_seconds,
            bytes,
        } => {
            let mut out = vec![frame(MessageType::TaskResult).json(&TaskResult {
                delegation_id: delegation_id.clone(),
                outcome: state.as_str().into(),
                detail: detail.as_deref().map(cap),
            })];
            if let Some(p) = pricing {
                let credits = p.price(*lease_seconds, *bytes);
                out.push(frame(MessageType::CreditTransfer).credits(credits).json(
                    &CreditTransfer {
                        delegation_id: delegation_id.clone(),
                        credits,
                        lease_seconds: *lease_seconds,
                        bytes: *bytes,
                    },
                ));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "dlg_0123456789abcdef0123456789abcdef";

    #[test]
    fn pricing_rounds_up_started_units() {
        let p = Pricing {
            per_lease_minute: 2,
            per_mib: 1,
        };
        assert_eq!(p.price(0, 0), 0);
        assert_eq!(p.price(1, 1), 3);
        assert_eq!(p.price(60, 1024 * 1024), 3);
        assert_eq!(p.price(61, 1024 * 1024 + 1), 6);
        assert_eq!(
            Pricing {
                per_lease_minute: u64::MAX,
                per_mib: 1
            }
            .price(120, 1),
            u64::MAX
        );
    }

    #[test]
    fn delegation_maps_to_task_assign_with_the_lease_price() {
        let ev = Lifecycle::Delegated {
            delegation_id: ID.into(),
            executor_url: "http://e:7200/awcp".into(),
            description: "x".repeat(1000),
            ttl_seconds: 600,
            access_mode: "rw".into(),
        };
        let p = Pricing {
            per_lease_minute: 1,
            per_mib: 0,
        };
        let fs = frames(&ev, Some(&p));
        assert_eq!(fs.len(), 1);
        assert_eq!(fs[0].msg_type, Some(MessageType::TaskAssign));
        assert_eq!(fs[0].credits, Some(10));
        let body: TaskAssign = fs[0].body_as().unwrap();
        assert_eq!(body.description.chars().count(), MAX_DESCRIPTION);
        assert_eq!(frames(&ev, None)[0].credits, None);
    }

    #[test]
    fn finish_maps_to_result_then_credit_transfer() {
        let ev = Lifecycle::Finished {
            delegation_id: ID.into(),
            state: DelegationState::Completed,
            detail: Some("all tests pass".into()),
            lease_seconds: 90,
            bytes: 0,
        };
        let p = Pricing {
            per_lease_minute: 5,
            per_mib: 0,
        };
        let fs = frames(&ev, Some(&p));
        let types: Vec<_> = fs.iter().map(|f| f.msg_type.clone().unwrap()).collect();
        assert_eq!(
            types,
            [MessageType::TaskResult, MessageType::CreditTransfer]
        );
        assert_eq!(fs[1].credits, Some(10));
        let r: TaskResult = fs[0].body_as().unwrap();
        assert_eq!(r.outcome, "completed");
        // Free: no credit.transfer.
        assert_eq!(frames(&ev, Some(&Pricing::default())).len(), 1);
        for f in fs {
            assert!(f.encode().is_ok());
        }
    }

    #[test]
    fn renewal_is_a_status_report() {
        let fs = frames(
            &Lifecycle::LeaseRenewed {
                delegation_id: ID.into(),
                expires_at: "2026-11-30T14:08:14.227Z".into(),
            },
            None,
        );
        let r: StatusReport = fs[0].body_as().unwrap();
        assert_eq!(r.lease.as_deref(), Some("active"));
        assert_eq!(r.state, None);
    }
}
