//! Lease grants: the time-bounded right of one Executor to access one export.
//!
//! A [`Lease`] is granted with [`LeaseTerms`] (a TTL, a ceiling for renewals, and a flush
//! grace) and is in one of three states ([`LeaseState`]): `Active`, then at most once either
//! `Revoked` (the Delegator said stop) or `Expired` (the deadline passed without renewal).
//! Both end states are final.
//!
//! # Rules
//!
//! * **Deadlines are monotonic.** They are kept on [`Clock::now`], so a wall-clock step never
//!   changes how long access lasts. Wall time is only used to *report* the deadline
//!   ([`LeaseSnapshot::expires_at`], [`Lease::expires_at_rfc3339`]).
//! * **Expiry is lazy.** Nothing runs at the deadline. Every query (`check_*`, `snapshot`,
//!   `renew`, `revoke`) first settles the state: a query made *at or after* the deadline
//!   sees `Expired`, and the lease is recorded as having ended *at the deadline*, not at the
//!   moment somebody happened to look. So the answer never depends on who asked first.
//! * **Access** ([`Lease::check_access`]) is allowed only while `Active`.
//! * **Flush** ([`Lease::check_flush`]) is allowed while `Active`, and for `flush_grace`
//!   after the lease ended by expiry or by `revoke(flush = true)`, so the Executor can push
//!   its final changes. `revoke(flush = false)` ends everything at once: no grace.
//! * **Renewal** ([`Lease::renew`]) is allowed only while `Active` and sets the deadline to
//!   `now + min(ttl, max_ttl)`. A renewal can shorten a lease (a smaller TTL).
//! * **Revocation** is idempotent. Revoking an already expired lease changes nothing (it
//!   stays `Expired`, with its grace); revoking twice keeps the first revocation.
//!
//! # Watching
//!
//! [`Lease::subscribe`] hands out a [`tokio::sync::watch::Receiver`] that gets a new
//! [`LeaseSnapshot`] on every renewal and revocation. Because expiry is lazy, **no value is
//! sent at the deadline by itself**: a watcher must also wake at `snapshot().remaining` on its
//! own timer and call [`Lease::snapshot`] (which settles the expiry and, the first time it
//! is observed, also publishes it to every watcher). Do not call any `Lease` method while
//! holding a `watch::Ref` from [`tokio::sync::watch::Receiver::borrow`]: publishing takes the
//! channel's write lock, which a held `Ref` blocks.

mod clock;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use tokio::sync::watch;

pub use awcp_protocol::dataplane::LeaseState;
pub use clock::{Clock, ManualClock, SystemClock};

/// Hard ceiling on any TTL (ten years). Keeps every deadline far from `Duration`/`SystemTime`
/// overflow, so deadline arithmetic can never panic whatever a caller passes.
pub const TTL_CEILING: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The terms a lease is granted with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTerms {
    /// Initial time to live (capped at `max_ttl`).
    pub ttl: Duration,
    /// Ceiling for the initial TTL and for every renewal.
    pub max_ttl: Duration,
    /// How long after the lease ended (by expiry or by a flushing revoke) a final flush commit
    /// is still accepted.
    pub flush_grace: Duration,
}

/// A point-in-time view of a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSnapshot {
    /// Current state.
    pub state: LeaseState,
    /// Wall-clock time at which access ends (`Active`) or ended (`Revoked`: the revocation
    /// time; `Expired`: the deadline).
    pub expires_at: SystemTime,
    /// Time left while `Active`; zero otherwise.
    pub remaining: Duration,
    /// How long a final flush is still accepted: the full grace while `Active` (it starts
    /// when the lease ends), what is left of it after an expiry or a flushing revoke, zero
    /// after a revoke without flush.
    pub flush_grace_remaining: Duration,
    /// How many renewals succeeded.
    pub renewals: u64,
}

/// Why a lease refused an operation. Every message says what to do next.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The Delegator revoked the lease.
    #[error(
        "lease was revoked by the Delegator at {}; access has ended, ask the Delegator for a new delegation",
        rfc3339_millis(*.at)
    )]
    Revoked {
        /// When it was revoked (wall clock).
        at: SystemTime,
    },
    /// The lease ran out without renewal.
    #[error(
        "lease expired at {}; ask the Delegator for a new delegation (renew before the deadline to keep access)",
        rfc3339_millis(*.at)
    )]
    Expired {
        /// The deadline that passed (wall clock).
        at: SystemTime,
    },
    /// The lease ended and its flush grace is over too.
    #[error(
        "lease {} at {} and its flush grace of {} ms is over; changes not flushed by then stay in the Executor's journal, hand them over another way",
        state_word(*.state),
        rfc3339_millis(*.ended_at),
        .grace.as_millis()
    )]
    FlushWindowClosed {
        /// How the lease ended (`Revoked` or `Expired`).
        state: LeaseState,
        /// When it ended (wall clock).
        ended_at: SystemTime,
        /// The grace that applied.
        grace: Duration,
    },
}

impl LeaseError {
    /// The lease state behind the refusal (`Revoked` or `Expired`).
    pub fn state(&self) -> LeaseState {
        match self {
            LeaseError::Revoked { .. } => LeaseState::Revoked,
            LeaseError::Expired { .. } => LeaseState::Expired,
            LeaseError::FlushWindowClosed { state, .. } => *state,
        }
    }
}

fn state_word(state: LeaseState) -> &'static str {
    match state {
        LeaseState::Active => "is active",
        LeaseState::Revoked => "was revoked",
        LeaseState::Expired => "expired",
    }
}

/// Format a wall time as ISO 8601 UTC with millisecond precision and a `Z` suffix, like
/// JavaScript's `Date.prototype.toISOString()` (`2025-01-01T00:00:00.000Z`).
pub fn rfc3339_millis(t: SystemTime) -> String {
    let (secs, nanos) = match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => (
            i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            d.subsec_nanos(),
        ),
        Err(before) => {
            // Before the epoch: floor to whole seconds the way a negative timestamp needs.
            let d = before.duration();
            let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            if d.subsec_nanos() == 0 {
                (-secs, 0)
            } else {
                (-secs - 1, 1_000_000_000 - d.subsec_nanos())
            }
        }
    };
    chrono::DateTime::<chrono::Utc>::from_timestamp(secs, nanos)
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC)
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// How a lease ended.
#[derive(Debug, Clone, Copy)]
struct Ended {
    state: LeaseState,
    /// Monotonic time it ended.
    at: Duration,
    /// Wall time it ended.
    wall_at: SystemTime,
    /// Whether the flush grace applies.
    grace: bool,
}

#[derive(Debug, Clone, Copy)]
struct State {
    /// Monotonic deadline.
    deadline: Duration,
    /// Wall-clock deadline, computed when the deadline was set.
    wall_deadline: SystemTime,
    ended: Option<Ended>,
    renewals: u64,
    /// Monotonic instant no renewal may extend the lease past (`None`: no limit).
    renew_limit: Option<Duration>,
}

/// A lease: the time-bounded right of one Executor to access one export.
///
/// Share it as `Arc<Lease>`; every method takes `&self`.
#[derive(Debug)]
pub struct Lease {
    clock: Arc<dyn Clock>,
    terms: LeaseTerms,
    state: Mutex<State>,
    tx: watch::Sender<LeaseSnapshot>,
}

impl Lease {
    /// Grant a lease now. `terms.ttl` is capped at `terms.max_ttl` (and every duration at
    /// [`TTL_CEILING`]). A zero TTL grants a lease that is already expired (with its grace).
    pub fn grant(clock: Arc<dyn Clock>, terms: LeaseTerms) -> Lease {
        let max_ttl = terms.max_ttl.min(TTL_CEILING);
        let terms = LeaseTerms {
            ttl: terms.ttl.min(max_ttl),
            max_ttl,
            flush_grace: terms.flush_grace.min(TTL_CEILING),
        };
        let now = clock.now();
        let state = State {
            deadline: now.saturating_add(terms.ttl),
            wall_deadline: wall_after(clock.wall_now(), terms.ttl),
            ended: None,
            renewals: 0,
            renew_limit: None,
        };
        let (tx, _) = watch::channel(snapshot_of(&state, &terms, now));
        let lease = Lease {
            clock,
            terms,
            state: Mutex::new(state),
            tx,
        };
        // Settle a zero-TTL grant at once so the first published value is already right.
        lease.snapshot();
        lease
    }

    /// The terms in force (after capping).
    pub fn terms(&self) -> LeaseTerms {
        self.terms
    }

    /// `Ok(remaining)` while the lease is `Active`.
    pub fn check_access(&self) -> Result<Duration, LeaseError> {
        let (now, st) = self.settled();
        match st.ended {
            None => Ok(st.deadline.saturating_sub(now)),
            Some(e) => Err(end_error(&e)),
        }
    }

    /// `Ok` while `Active`, or within the flush grace after an expiry or a flushing revoke.
    pub fn check_flush(&self) -> Result<(), LeaseError> {
        let (now, st) = self.settled();
        match st.ended {
            None => Ok(()),
            Some(e) if !e.grace => Err(end_error(&e)),
            Some(e) if now < e.at.saturating_add(self.terms.flush_grace) => Ok(()),
            Some(e) => Err(LeaseError::FlushWindowClosed {
                state: e.state,
                ended_at: e.wall_at,
                grace: self.terms.flush_grace,
            }),
        }
    }

    /// Extend an `Active` lease: the new deadline is `now + min(ttl, max_ttl)`.
    pub fn renew(&self, ttl: Duration) -> Result<LeaseSnapshot, LeaseError> {
        let mut st = self.state.lock();
        let now = self.settle(&mut st);
        if let Some(e) = st.ended {
            return Err(end_error(&e));
        }
        let mut ttl = ttl.min(self.terms.max_ttl);
        if let Some(limit) = st.renew_limit {
            // Never past the lifetime the Delegator allows; never shorter than it already is.
            let current = st.deadline.saturating_sub(now);
            ttl = ttl.min(limit.saturating_sub(now)).max(current);
        }
        st.deadline = now.saturating_add(ttl);
        st.wall_deadline = wall_after(self.clock.wall_now(), ttl);
        st.renewals += 1;
        // A zero TTL ends the lease right here, as an expiry.
        self.settle_at(&mut st, now);
        let snap = snapshot_of(&st, &self.terms, now);
        self.tx.send_replace(snap);
        Ok(snap)
    }

    /// Cap the lease's whole life: no renewal extends it beyond `lifetime` after now (the
    /// Delegator's maximum when the Executor renews on its own).
    pub fn limit_renewals(&self, lifetime: Duration) {
        let mut st = self.state.lock();
        let now = self.clock.now();
        st.renew_limit = Some(now.saturating_add(lifetime));
    }

    /// End the lease now. With `flush`, a final flush is still accepted for the flush grace.
    /// Idempotent: a lease that already ended keeps how and when it ended.
    pub fn revoke(&self, flush: bool) -> LeaseSnapshot {
        let mut st = self.state.lock();
        let now = self.settle(&mut st);
        if st.ended.is_none() {
            st.ended = Some(Ended {
                state: LeaseState::Revoked,
                at: now,
                wall_at: self.clock.wall_now(),
                grace: flush,
            });
        }
        let snap = snapshot_of(&st, &self.terms, now);
        self.tx.send_replace(snap);
        snap
    }

    /// The lease as of now.
    pub fn snapshot(&self) -> LeaseSnapshot {
        let (now, st) = self.settled();
        snapshot_of(&st, &self.terms, now)
    }

    /// [`LeaseSnapshot::expires_at`] formatted by [`rfc3339_millis`].
    pub fn expires_at_rfc3339(&self) -> String {
        rfc3339_millis(self.snapshot().expires_at)
    }

    /// A receiver of every renewal and revocation (see the module docs: expiry is lazy, so
    /// also wake at the deadline yourself).
    pub fn subscribe(&self) -> watch::Receiver<LeaseSnapshot> {
        self.tx.subscribe()
    }

    /// Settle the state and hand back a copy of it with the time it was settled at.
    fn settled(&self) -> (Duration, State) {
        let mut st = self.state.lock();
        let now = self.settle(&mut st);
        (now, *st)
    }

    /// Read the clock and record an expiry if the deadline has passed.
    fn settle(&self, st: &mut State) -> Duration {
        let now = self.clock.now();
        self.settle_at(st, now);
        now
    }

    fn settle_at(&self, st: &mut State, now: Duration) {
        if st.ended.is_none() && now >= st.deadline {
            st.ended = Some(Ended {
                state: LeaseState::Expired,
                at: st.deadline,
                wall_at: st.wall_deadline,
                grace: true,
            });
            // First observation of the expiry: tell the watchers (late, but better than never).
            self.tx.send_replace(snapshot_of(st, &self.terms, now));
        }
    }
}

fn wall_after(wall: SystemTime, d: Duration) -> SystemTime {
    // Only fails beyond the platform's SystemTime range; `d` is capped at TTL_CEILING.
    wall.checked_add(d).unwrap_or(wall)
}

fn end_error(e: &Ended) -> LeaseError {
    match e.state {
        LeaseState::Revoked => LeaseError::Revoked { at: e.wall_at },
        // `Active` never appears in an `Ended`; treat it like an expiry rather than panic.
        LeaseState::Expired | LeaseState::Active => LeaseError::Expired { at: e.wall_at },
    }
}

fn snapshot_of(st: &State, terms: &LeaseTerms, now: Duration) -> LeaseSnapshot {
    match st.ended {
        None => LeaseSnapshot {
            state: LeaseState::Active,
            expires_at: st.wall_deadline,
            remaining: st.deadline.saturating_sub(now),
            flush_grace_remaining: terms.flush_grace,
            renewals: st.renewals,
        },
        Some(e) => LeaseSnapshot {
            state: e.state,
            expires_at: e.wall_at,
            remaining: Duration::ZERO,
            flush_grace_remaining: if e.grace {
                e.at.saturating_add(terms.flush_grace).saturating_sub(now)
            } else {
                Duration::ZERO
            },
            renewals: st.renewals,
        },
    }
}

#[cfg(test)]
mod tests;
