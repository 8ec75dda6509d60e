//! The block tier's health: every call to the store has a deadline, and a circuit breaker
//! stops using a store that has stopped answering.
//!
//! A store can fail in ways that cost time rather than an error: it accepts connections and
//! answers nothing (a stopped process, a full disk behind a proxy), answers slowly, or
//! refuses. The mounts read through the store only as a shortcut — everything it holds the
//! export can serve itself — so the tier must never make a mount wait on it for long:
//!
//! * **Deadlines.** Each call ([`Health::call`]) is bounded by the tier's call timeout, and
//!   the object-store client's own retries by the same figure; a call that runs out counts as
//!   a failure.
//! * **The breaker.** [`TRIP_AFTER`] failures in a row open it: for a back-off period (from
//!   [`FIRST_BACKOFF`], doubling up to [`MAX_BACKOFF`]) the tier makes no call and signs no
//!   URL, so `/locate` answers `null` for every block and the mounts ask the export. When the
//!   period ends, the next call goes through as a probe: an answer closes the breaker, a
//!   failure opens it again for twice as long.
//! * **Answers count, not their content.** A `NotFound` is the store answering: it closes the
//!   breaker like any success. Wrong content is caught elsewhere (every block is verified
//!   against its hash).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;

/// Failures in a row that open the breaker.
pub(crate) const TRIP_AFTER: u32 = 3;
/// How long the breaker first stays open.
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_secs(2);
/// The longest it stays open before the next probe.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// The breaker's state, as status endpoints and metrics report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum BreakerState {
    /// The store answers: calls go through.
    #[default]
    Closed,
    /// The store stopped answering: no call, no URL, until the back-off ends.
    Open,
    /// The back-off ended: one call is going through to see whether the store is back.
    HalfOpen,
}

impl BreakerState {
    /// The name used in logs, status and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half-open",
        }
    }
}

/// Why a call did not reach the store's answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// The breaker is open: the call was not made.
    #[error("the block store is not used for now (it stopped answering)")]
    Unavailable,
    /// The store did not answer within the call timeout.
    #[error("the block store did not answer {what} within {timeout:?}")]
    TimedOut {
        /// The call.
        what: &'static str,
        /// The deadline it ran out of.
        timeout: Duration,
    },
    /// The store answered with an error other than `NotFound`.
    #[error("the block store refused {what}")]
    Store {
        /// The call.
        what: &'static str,
        /// The client's error.
        #[source]
        source: object_store::Error,
    },
    /// The store answered that there is no such object.
    #[error("no such object in the block store")]
    NotFound,
}

#[derive(Debug, Default)]
struct State {
    /// Failures since the last answer.
    failures_in_a_row: u32,
    /// Set while open: when the next probe may go.
    open_until: Option<Instant>,
    /// How long the breaker stays open the next time it opens.
    backoff: Duration,
    /// A probe is out.
    probing: bool,
}

/// Deadlines and the breaker for one tier.
#[derive(Debug)]
pub(crate) struct Health {
    timeout: Duration,
    state: Mutex<State>,
    /// Calls that failed or ran out of time.
    pub(crate) errors: AtomicU64,
    /// Times the breaker opened.
    pub(crate) trips: AtomicU64,
}

impl Health {
    pub(crate) fn new(timeout: Duration) -> Health {
        Health {
            timeout,
            state: Mutex::new(State {
                backoff: FIRST_BACKOFF,
                ..State::default()
            }),
            errors: AtomicU64::new(0),
            trips: AtomicU64::new(0),
        }
    }

    /// Each call's deadline.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Where the breaker stands now.
    pub(crate) fn state(&self) -> BreakerState {
        self.state_at(Instant::now())
    }

    fn state_at(&self, now: Instant) -> BreakerState {
        let s = self.state.lock();
        match s.open_until {
            None => BreakerState::Closed,
            Some(_) if s.probing => BreakerState::HalfOpen,
            Some(until) if now >= until => BreakerState::HalfOpen,
            Some(_) => BreakerState::Open,
        }
    }

    /// Whether a call may go now: always while closed; while open, only the one probe once
    /// the back-off has ended. A caller that was let in must report with
    /// [`Health::answered`] or [`Health::failed`].
    pub(crate) fn admit(&self) -> bool {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> bool {
        let mut s = self.state.lock();
        match s.open_until {
            None => true,
            Some(until) if now >= until && !s.probing => {
                s.probing = true;
                true
            }
            Some(_) => false,
        }
    }

    /// The store answered (an object, a listing, a `NotFound`).
    pub(crate) fn answered(&self) {
        let mut s = self.state.lock();
        if s.open_until.is_some() {
            tracing::info!("block tier: the store answers again; signing URLs again");
        }
        *s = State {
            backoff: FIRST_BACKOFF,
            ..State::default()
        };
    }

    /// A call failed or ran out of time.
    pub(crate) fn failed(&self, why: &CallError) {
        self.failed_at(why, Instant::now());
    }

    fn failed_at(&self, why: &CallError, now: Instant) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut s = self.state.lock();
        s.failures_in_a_row = s.failures_in_a_row.saturating_add(1);
        let was_probe = std::mem::take(&mut s.probing);
        if was_probe || (s.open_until.is_none() && s.failures_in_a_row >= TRIP_AFTER) {
            let backoff = s.backoff;
            s.open_until = Some(now + backoff);
            s.backoff = (backoff * 2).min(MAX_BACKOFF);
            self.trips.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                error = %why,
                failures = s.failures_in_a_row,
                retry_in = ?backoff,
                "block tier: the store stopped answering; no URLs are signed until it answers \
                 again, and the export serves every block itself"
            );
        }
    }

    /// Run one call to the store under the deadline and the breaker. `NotFound` is an
    /// answer ([`CallError::NotFound`], and the breaker closes); an open breaker, a timeout
    /// or any other error is a failure.
    pub(crate) async fn call<T, F>(&self, what: &'static str, call: F) -> Result<T, CallError>
    where
        F: Future<Output = Result<T, object_store::Error>>,
    {
        if !self.admit() {
            return Err(CallError::Unavailable);
        }
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(v)) => {
                self.answered();
                Ok(v)
            }
            Ok(Err(object_store::Error::NotFound { .. })) => {
                self.answered();
                Err(CallError::NotFound)
            }
            Ok(Err(source)) => {
                let e = CallError::Store { what, source };
                self.failed(&e);
                Err(e)
            }
            Err(_) => {
                let e = CallError::TimedOut {
                    what,
                    timeout: self.timeout,
                };
                self.failed(&e);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed_out() -> CallError {
        CallError::TimedOut {
            what: "GET",
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn opens_after_failures_in_a_row_and_probes_once_the_backoff_ends() {
        let h = Health::new(Duration::from_secs(1));
        let t0 = Instant::now();
        for _ in 0..TRIP_AFTER - 1 {
            h.failed_at(&timed_out(), t0);
            assert_eq!(h.state_at(t0), BreakerState::Closed);
        }
        h.failed_at(&timed_out(), t0);
        assert_eq!(h.state_at(t0), BreakerState::Open);
        assert!(!h.admit_at(t0), "no call while open");
        let later = t0 + FIRST_BACKOFF;
        assert!(h.admit_at(later), "one probe once the back-off ended");
        assert!(!h.admit_at(later), "only one probe at a time");
        assert_eq!(h.state_at(later), BreakerState::HalfOpen);
        // The probe fails: open again, for twice as long.
        h.failed_at(&timed_out(), later);
        assert!(!h.admit_at(later + FIRST_BACKOFF));
        assert!(h.admit_at(later + FIRST_BACKOFF * 2));
        h.answered();
        assert_eq!(h.state(), BreakerState::Closed);
        assert!(h.admit());
        assert_eq!(h.trips.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn an_answer_between_failures_keeps_it_closed() {
        let h = Health::new(Duration::from_secs(1));
        for _ in 0..10 {
            h.failed(&timed_out());
            h.answered();
        }
        assert_eq!(h.state(), BreakerState::Closed);
        assert_eq!(h.trips.load(Ordering::Relaxed), 0);
        assert_eq!(h.errors.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn the_backoff_stops_growing() {
        let h = Health::new(Duration::from_secs(1));
        let mut now = Instant::now();
        for _ in 0..TRIP_AFTER {
            h.failed_at(&timed_out(), now);
        }
        for _ in 0..20 {
            now += MAX_BACKOFF;
            assert!(h.admit_at(now));
            h.failed_at(&timed_out(), now);
        }
        assert!(h.admit_at(now + MAX_BACKOFF));
    }

    #[tokio::test]
    async fn a_call_that_does_not_answer_runs_out_of_time() {
        let h = Health::new(Duration::from_millis(50));
        let started = Instant::now();
        let r: Result<(), _> = h
            .call("GET", async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok(())
            })
            .await;
        assert!(matches!(r, Err(CallError::TimedOut { .. })), "{r:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        let nf: Result<(), _> = h
            .call("HEAD", async {
                Err(object_store::Error::NotFound {
                    path: "x".into(),
                    source: "gone".into(),
                })
            })
            .await;
        assert!(matches!(nf, Err(CallError::NotFound)));
        assert_eq!(h.errors.load(Ordering::Relaxed), 1);
    }
}
