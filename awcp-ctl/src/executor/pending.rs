//! Accepted INVITEs waiting for their START: bounded in time and per caller.
//!
//! An accepted INVITE holds one of the Executor's `--max-concurrent` slots. Left alone,
//! INVITEs without a START would hold them forever, so each expires after
//! `--pending-timeout` (60 s by default): its slot is freed, an open event stream gets an
//! `error` event (`START_EXPIRED`), and a late START is told what happened. The operator
//! sees pending INVITEs in an authenticated `GET /awcp/status` (`pending`) and can cancel
//! one (`POST /awcp/cancel/<id>` with the credential). INVITEs that did not carry the
//! credential (only possible with `--unsafe-open`) are also held to
//! `--max-pending-per-peer` per peer address and, all peers together, to half the slots,
//! so anonymous callers can never take every slot.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use awcp_protocol::{AssignmentState, ErrorCode};

use super::{Assignment, Executor};

/// Who sent an INVITE.
#[derive(Debug, Clone)]
pub(crate) struct Inviter {
    /// The peer's address.
    pub(crate) peer: IpAddr,
    /// It carried this Executor's credential.
    pub(crate) authenticated: bool,
    /// When it was accepted.
    pub(crate) at: Instant,
    /// When it expires without START, ISO 8601.
    pub(crate) expires_at: String,
}

/// How many expired ids are remembered for a late START's refusal.
const REMEMBERED: usize = 256;

/// Whether one more INVITE from `peer` (without the credential) may wait for START; the
/// refusal's message and hint otherwise.
pub(crate) fn room_for_anonymous(ex: &Executor, peer: IpAddr) -> Result<(), (String, String)> {
    let tasks = ex.tasks.lock();
    let waiting: Vec<&Arc<Assignment>> = tasks
        .values()
        .filter(|a| !a.invited_by.authenticated && *a.state.lock() == AssignmentState::Pending)
        .collect();
    let from_peer = waiting.iter().filter(|a| a.invited_by.peer == peer).count();
    let per_peer = ex.cfg.max_pending_per_peer;
    if from_peer >= per_peer {
        return Err((
            format!(
                "{from_peer} INVITE(s) from {peer} already wait for START (at most \
                 {per_peer} per peer without the Executor's credential)"
            ),
            format!(
                "Send START for them or cancel them; each expires {} s after its INVITE",
                ex.cfg.pending_timeout.as_secs()
            ),
        ));
    }
    let overall = (ex.cfg.max_concurrent / 2).max(1);
    if waiting.len() >= overall {
        return Err((
            format!(
                "{} INVITE(s) without the Executor's credential already wait for START (at \
                 most {overall}: half the slots)",
                waiting.len()
            ),
            "Try again shortly, or present the Executor's credential".into(),
        ));
    }
    Ok(())
}

/// The inviter record of an INVITE accepted now.
pub(crate) fn inviter(ex: &Executor, peer: IpAddr, authenticated: bool) -> Inviter {
    let ttl = chrono::Duration::from_std(ex.cfg.pending_timeout).unwrap_or_default();
    Inviter {
        peer,
        authenticated,
        at: Instant::now(),
        expires_at: (chrono::Utc::now() + ttl).to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    }
}

/// End assignment `id` if it still waits for START when its time is up.
pub(crate) fn expire_later(ex: Arc<Executor>, id: String, a: &Arc<Assignment>) {
    let weak = Arc::downgrade(a);
    let deadline = a.invited_by.at + ex.cfg.pending_timeout;
    tokio::spawn(async move {
        tokio::time::sleep_until(deadline.into()).await;
        // A START being received (a large workspace on a slow link) is waited for.
        while ex.receiving.lock().contains(&id) {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
        let Some(a) = weak.upgrade() else {
            return;
        };
        {
            let mut tasks = ex.tasks.lock();
            // Still this INVITE's assignment (not a re-INVITE's), still without START.
            if !tasks.get(&id).is_some_and(|held| Arc::ptr_eq(held, &a))
                || *a.state.lock() != AssignmentState::Pending
                || a.started_at.lock().is_some()
            {
                return;
            }
            tasks.remove(&id);
        }
        tracing::warn!(%id, peer = %a.invited_by.peer,
            timeout_s = ex.cfg.pending_timeout.as_secs(),
            "an INVITE expired without START: its slot is free again");
        super::task::finish_error(
            &a,
            ErrorCode::StartExpired,
            format!(
                "No START arrived within {} s of the INVITE: the Executor forgot it",
                ex.cfg.pending_timeout.as_secs()
            ),
            Some("INVITE again, and send START right after ACCEPT".into()),
        );
        let mut expired = ex.expired.lock();
        if expired.len() >= REMEMBERED {
            expired.pop_front();
        }
        expired.push_back(id);
    });
}

/// Whether `id` is an INVITE that expired without START (recently).
pub(crate) fn expired(ex: &Executor, id: &str) -> bool {
    ex.expired.lock().iter().any(|e| e == id)
}
