//! `POST /delegation/:id/recover` (ours; the reference's `delegate_recover` is a stub):
//! fetch the result of a delegation whose event stream was lost — after a daemon restart,
//! or a broken connection — from the Executor's `GET /tasks/:id/result`, apply it as its
//! events would have been, and acknowledge it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use awcp_protocol::api::{ErrorInfo, TaskResultResponse, TaskResultStatus};
use awcp_protocol::events::SnapshotEvent;
use awcp_protocol::{DelegationEvent, DelegationState, ErrorCode};

use super::Daemon;
use super::flow::{Refusal, awcp_base, with_token};
use crate::watch::WatchEvent;

/// `POST /delegation/:id/recover` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecoverResponse {
    /// Always true.
    pub ok: bool,
    /// The delegation's state afterwards.
    pub state: DelegationState,
    /// Whether a snapshot came with the result (and was handled per the snapshot mode).
    pub snapshot: bool,
}

fn refuse(status: u16, message: String, hint: Option<&str>) -> Refusal {
    Refusal {
        status,
        message,
        code: None,
        hint: hint.map(str::to_owned),
    }
}

impl Daemon {
    /// Recover delegation `id` from its Executor's kept result.
    pub(crate) async fn recover(self: &Arc<Self>, id: &str) -> Result<RecoverResponse, Refusal> {
        let live = self
            .get_live(id)
            .ok_or_else(|| refuse(404, format!("Unknown delegation: {id}"), None))?;
        self.check_owned(&live)?;
        let (state, lost, peer, token, had_snapshot) = {
            let d = live.d.lock();
            let lost = d.record.state == DelegationState::Error
                && d.record
                    .error
                    .as_ref()
                    .is_some_and(|e| matches!(e.code, ErrorCode::SseFailed | ErrorCode::NotFound));
            (
                d.record.state,
                lost,
                d.record.peer_url.clone(),
                d.executor_credential(),
                d.record.snapshots.as_ref().is_some_and(|s| !s.is_empty()),
            )
        };
        if state.is_terminal() && !lost {
            return Err(refuse(
                400,
                format!(
                    "delegation {id} has already ended ({}); there is nothing to recover",
                    state.as_str()
                ),
                Some("Recovery is for delegations whose event stream was lost"),
            ));
        }
        let url = format!("{}/tasks/{id}/result", awcp_base(&peer));
        let resp = with_token(self.http.get(&url), token.as_deref())
            .send()
            .await
            .map_err(|e| Refusal::internal(format!("asking the executor for the result: {e}")))?;
        let result: TaskResultResponse = resp
            .json()
            .await
            .map_err(|e| Refusal::internal(format!("the executor's result is unreadable: {e}")))?;
        let mut snapshot = false;
        match result.status {
            TaskResultStatus::NotFound => {
                return Err(refuse(
                    404,
                    format!("the executor holds no result for {id}"),
                    Some("It was acknowledged already, or the executor forgot it (a restart)"),
                ));
            }
            TaskResultStatus::NotApplicable => {
                return Err(refuse(
                    400,
                    format!(
                        "the executor has no result to fetch for {id}: {}",
                        result.reason.unwrap_or_default()
                    ),
                    None,
                ));
            }
            TaskResultStatus::Running => {
                return Err(refuse(
                    409,
                    format!("delegation {id} is still running on the executor"),
                    Some("Wait for it; `awcp-ctl watch` follows it"),
                ));
            }
            TaskResultStatus::Completed => {
                let summary = result
                    .summary
                    .clone()
                    .unwrap_or_else(|| "Task completed".into());
                if let Some(b64) = result.snapshot_base64.filter(|_| !had_snapshot) {
                    snapshot = true;
                    let did = live.d.lock().record.id.clone();
                    self.on_snapshot(
                        &live,
                        SnapshotEvent {
                            delegation_id: did,
                            timestamp: crate::now_iso(),
                            snapshot_id: format!("snap_{}", hex::encode(rand::random::<[u8; 6]>())),
                            summary: summary.clone(),
                            highlights: result.highlights.clone(),
                            snapshot_base64: b64,
                            recommended: Some(true),
                            metadata: None,
                        },
                    )
                    .await;
                }
                self.end_round(&live, &summary, result.highlights.clone());
                if lost {
                    // The stream failure ended it in `error`; the Executor says it completed.
                    self.force(&live, DelegationState::Completed, "recovered: completed");
                } else {
                    if live.d.lock().record.state == DelegationState::Started {
                        self.transition(&live, DelegationEvent::SetupComplete, None);
                    }
                    self.transition(
                        &live,
                        DelegationEvent::ReceiveDone,
                        Some("recovered".into()),
                    );
                }
            }
            TaskResultStatus::Error => {
                let e = result.error.unwrap_or(ErrorInfo {
                    code: ErrorCode::TaskFailed,
                    message: "the task failed".into(),
                    hint: None,
                });
                let detail = format!("recovered: {}: {}", e.code.as_str(), e.message);
                live.d.lock().record.error = Some(e);
                if lost {
                    self.record(
                        &live,
                        WatchEvent::State {
                            state: DelegationState::Error,
                            at: crate::now_iso(),
                            detail: Some(detail),
                        },
                    );
                } else {
                    self.transition(&live, DelegationEvent::ReceiveError, Some(detail));
                }
            }
        }
        let ack = self
            .http
            .post(format!("{}/tasks/{id}/ack", awcp_base(&peer)));
        let _ = with_token(ack, token.as_deref()).send().await;
        let state = live.d.lock().record.state;
        Ok(RecoverResponse {
            ok: true,
            state,
            snapshot,
        })
    }

    /// `done` names snapshots this daemon never received (the stream was reopened after a
    /// restart, and a reference Executor replays only the final event): fetch the result's
    /// snapshot before acknowledging it, so it is not lost.
    pub(crate) async fn fetch_missed_snapshot(
        &self,
        live: &Arc<super::Live>,
        done: &awcp_protocol::events::DoneEvent,
    ) {
        let (missed, peer, token, id, transport) = {
            let d = live.d.lock();
            let have: Vec<&str> = d
                .record
                .snapshots
                .iter()
                .flatten()
                .map(|s| s.id.as_str())
                .collect();
            let missed = done.snapshot_ids.as_ref().is_some_and(|ids| {
                !ids.is_empty() && ids.iter().all(|i| !have.contains(&i.as_str()))
            });
            (
                missed,
                d.record.peer_url.clone(),
                d.executor_credential(),
                d.record.id.clone(),
                d.transport,
            )
        };
        if !missed || transport != awcp_protocol::TransportType::Archive {
            return;
        }
        let url = format!("{}/tasks/{}/result", awcp_base(&peer), id.as_str());
        let result: Option<TaskResultResponse> =
            match with_token(self.http.get(&url), token.as_deref())
                .send()
                .await
            {
                Ok(r) => r.json().await.ok(),
                Err(_) => None,
            };
        let Some(b64) = result.and_then(|r| r.snapshot_base64) else {
            tracing::warn!(
                id = id.as_str(),
                "a snapshot was announced but cannot be fetched"
            );
            return;
        };
        let sid = done
            .recommended_snapshot_id
            .clone()
            .or_else(|| done.snapshot_ids.as_ref().and_then(|i| i.last().cloned()))
            .unwrap_or_default();
        self.on_snapshot(
            live,
            SnapshotEvent {
                delegation_id: id,
                timestamp: crate::now_iso(),
                snapshot_id: sid,
                summary: done.summary.clone(),
                highlights: done.highlights.clone(),
                snapshot_base64: b64,
                recommended: Some(true),
                metadata: None,
            },
        )
        .await;
    }

    /// Set a state outside the machine (the reference does so for a lost stream too).
    fn force(&self, live: &super::Live, state: DelegationState, detail: &str) {
        {
            let mut d = live.d.lock();
            d.record.state = state;
            d.record.error = None;
        }
        self.record(
            live,
            WatchEvent::State {
                state,
                at: crate::now_iso(),
                detail: Some(detail.into()),
            },
        );
    }
}
