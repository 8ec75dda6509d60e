//! Multi-round delegations: rounds in the record, `round_done` → `idle`, and CONTINUE /
//! CLOSE (`POST /delegation/:id/continue`, `…/close`).
//!
//! A delegation asks for rounds with `multiRound: true` (ours, sent on in INVITE); with
//! `serve --reference-rounds`, a request that does not say (every reference client) is
//! one too. Otherwise a `round_done` from an Executor that always works in rounds (the
//! reference's multi-round branch) is answered with CLOSE at once, so the delegation
//! completes as a single-round one would.

use std::sync::Arc;
use std::time::Duration;

use awcp_protocol::api::{ResultSummary, Round};
use awcp_protocol::events::RoundDoneEvent;
use awcp_protocol::messages::{
    ActiveLease, CloseMessage, ContinueMessage, ProtocolVersion, TaskSpec,
};
use awcp_protocol::{AwcpMessage, DelegationEvent, DelegationState};

use super::flow::{Refusal, with_token};
use super::{Daemon, Live};

fn plain(message: String) -> Refusal {
    Refusal {
        status: 400,
        message,
        code: None,
        hint: None,
    }
}

impl Daemon {
    /// Round 1 starts with START.
    pub(crate) fn first_round(&self, live: &Live) {
        let mut d = live.d.lock();
        let task = d.record.task.clone();
        d.record.current_round = Some(1);
        d.record.rounds = Some(vec![Round {
            number: 1,
            task,
            result: None,
            snapshots: None,
            started_at: crate::now_iso(),
            completed_at: None,
        }]);
    }

    /// Close the current round in the record with its result. When every round has already
    /// ended (a `done` answering CLOSE), the delegation's result stays the last round's: the
    /// reference Executor's "Session closed by delegator" says nothing the agent did.
    pub(crate) fn end_round(&self, live: &Live, summary: &str, highlights: Option<Vec<String>>) {
        let mut d = live.d.lock();
        let result = ResultSummary {
            summary: summary.to_string(),
            highlights,
        };
        let rounds_ended = match d.record.rounds.as_mut().and_then(|r| r.last_mut()) {
            Some(r) if r.completed_at.is_none() => {
                r.completed_at = Some(crate::now_iso());
                r.result = Some(result.clone());
                false
            }
            Some(r) => r.result.is_some(),
            None => false,
        };
        if !rounds_ended || d.record.result.is_none() {
            d.record.result = Some(result);
        }
        drop(d);
        // Staged mode: the round's changes show up as a pending snapshot.
        self.refresh_staged(live);
    }

    /// `round_done`: the delegation goes idle; without `multiRound`, CLOSE at once.
    pub(crate) async fn on_round_done(self: &Arc<Self>, live: &Arc<Live>, r: RoundDoneEvent) {
        self.end_round(live, &r.summary, r.highlights.clone());
        self.transition(
            live,
            DelegationEvent::RoundComplete,
            Some(format!("round {} done: {}", r.round, r.summary)),
        );
        let (multi, id, round) = {
            let d = live.d.lock();
            (
                d.multi_round,
                d.record.id.as_str().to_string(),
                d.record.current_round,
            )
        };
        if !multi {
            if let Err(e) = self.close(&id).await {
                tracing::warn!(%id, error = %e.message, "closing a single-round session failed");
            }
            return;
        }
        // Close it if it stays idle (same round) for the idle timeout, as the reference does.
        let d = self.clone();
        let (l, timeout) = (live.clone(), self.cfg.idle_timeout);
        self.spawn(async move {
            tokio::time::sleep(timeout).await;
            let still = {
                let x = l.d.lock();
                x.record.state == DelegationState::Idle && x.record.current_round == round
            };
            if still {
                tracing::info!(%id, "closing an idle session after the idle timeout");
                if let Err(e) = d.close(&id).await {
                    tracing::warn!(%id, error = %e.message, "closing an idle session failed");
                }
            }
        });
    }

    async fn send(&self, live: &Live, msg: &AwcpMessage) -> Result<(), Refusal> {
        let (url, token) = {
            let d = live.d.lock();
            (d.record.peer_url.clone(), d.executor_credential())
        };
        let resp = with_token(self.http.post(&url), token.as_deref())
            .json(msg)
            .send()
            .await
            .map_err(|e| {
                Refusal::internal(format!("Failed to send {} to executor: {e}", msg.kind()))
            })?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            return Err(Refusal::internal(format!(
                "Failed to send {} to executor: {status} - {body}",
                msg.kind()
            )));
        }
        Ok(())
    }

    fn idle(&self, id: &str, what: &str) -> Result<Arc<Live>, Refusal> {
        let live = self
            .get_live(id)
            .ok_or_else(|| plain(format!("Unknown delegation: {id}")))?;
        self.check_owned(&live)?;
        let state = live.d.lock().record.state;
        if state != DelegationState::Idle {
            return Err(plain(format!(
                "Cannot {what} delegation {id} in state '{}', expected 'idle'",
                state.as_str()
            )));
        }
        Ok(live)
    }

    /// `POST /delegation/:id/continue`: the next round, on the same workspace. With `ttl`,
    /// the lease is renewed first (bounded by the maximum TTL and lifetime); either way
    /// CONTINUE carries the lease as it stands, so the Executor's deadline matches ours
    /// (renewals made during the last round included).
    pub(crate) async fn continue_round(
        &self,
        id: &str,
        task: TaskSpec,
        ttl: Option<Duration>,
    ) -> Result<u32, Refusal> {
        let live = self.idle(id, "continue")?;
        if let Some(ttl) = ttl {
            self.renew(id, ttl)?;
        }
        let (did, round, access) = {
            let d = live.d.lock();
            (
                d.record.id.clone(),
                d.record.current_round.unwrap_or(1) + 1,
                d.record.lease_config.access_mode,
            )
        };
        let msg = AwcpMessage::Continue(ContinueMessage {
            version: ProtocolVersion,
            delegation_id: did,
            task: task.clone(),
            round,
            lease: Some(ActiveLease {
                expires_at: live.lease.expires_at_rfc3339(),
                access_mode: access,
            }),
        });
        // The round starts before CONTINUE leaves, as the reference's Delegator does: a fast
        // Executor's `round_done` can arrive before its answer to CONTINUE, and must find
        // the delegation running (it was dropped as "ROUND_COMPLETE in state idle").
        let previous = {
            let mut d = live.d.lock();
            let previous = d.record.current_round;
            d.record.current_round = Some(round);
            d.record.rounds.get_or_insert_with(Vec::new).push(Round {
                number: round,
                task: task.clone(),
                result: None,
                snapshots: None,
                started_at: crate::now_iso(),
                completed_at: None,
            });
            previous
        };
        let unround = |live: &Live| {
            let mut d = live.d.lock();
            d.record.current_round = previous;
            if let Some(r) = d.record.rounds.as_mut() {
                r.pop();
            }
        };
        if self
            .transition(
                &live,
                DelegationEvent::SendContinue,
                Some(format!("round {round}: {}", task.description)),
            )
            .is_none()
        {
            // Another continue (or an end) got there first.
            unround(&live);
            let state = live.d.lock().record.state;
            return Err(plain(format!(
                "Cannot continue delegation {id} in state '{}', expected 'idle'",
                state.as_str()
            )));
        }
        if let Err(e) = self.send(&live, &msg).await {
            // Not sent: the session is idle as before, without the round.
            unround(&live);
            live.d.lock().record.state = DelegationState::Idle;
            self.record(
                &live,
                crate::watch::WatchEvent::State {
                    state: DelegationState::Idle,
                    at: crate::now_iso(),
                    detail: Some(format!("round {round} not started: {}", e.message)),
                },
            );
            return Err(e);
        }
        Ok(round)
    }

    /// `POST /delegation/:id/close`: end an idle session; the delegation completes.
    pub(crate) async fn close(&self, id: &str) -> Result<(), Refusal> {
        let live = self.idle(id, "close")?;
        let did = live.d.lock().record.id.clone();
        self.send(&live, &AwcpMessage::Close(CloseMessage::new(did)))
            .await?;
        self.transition(
            &live,
            DelegationEvent::SendClose,
            Some("session closed".into()),
        );
        Ok(())
    }
}
