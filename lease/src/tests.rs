//! Every lease rule on virtual time, plus a model-based property test.

use super::*;
use proptest::prelude::*;

const S: Duration = Duration::from_secs(1);

fn terms(ttl: u64, max_ttl: u64, grace: u64) -> LeaseTerms {
    LeaseTerms {
        ttl: S * ttl as u32,
        max_ttl: S * max_ttl as u32,
        flush_grace: S * grace as u32,
    }
}

fn lease(t: LeaseTerms) -> (Arc<ManualClock>, Lease) {
    let clock = Arc::new(ManualClock::new());
    let lease = Lease::grant(clock.clone(), t);
    (clock, lease)
}

fn start_wall() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(ManualClock::DEFAULT_START_UNIX_SECS)
}

#[test]
fn active_until_just_before_the_deadline_expired_exactly_at_it() {
    let (clock, l) = lease(terms(10, 60, 5));
    assert_eq!(l.check_access(), Ok(10 * S));
    clock.advance(10 * S - Duration::from_nanos(1));
    assert_eq!(l.check_access(), Ok(Duration::from_nanos(1)));
    clock.advance(Duration::from_nanos(1));
    let err = l.check_access().unwrap_err();
    assert_eq!(
        err,
        LeaseError::Expired {
            at: start_wall() + 10 * S
        }
    );
    assert_eq!(err.state(), LeaseState::Expired);
    let snap = l.snapshot();
    assert_eq!(snap.state, LeaseState::Expired);
    assert_eq!(snap.remaining, Duration::ZERO);
    assert_eq!(snap.expires_at, start_wall() + 10 * S);
}

#[test]
fn expiry_is_recorded_at_the_deadline_not_when_observed() {
    let (clock, l) = lease(terms(10, 60, 5));
    // Nobody looks until well after the deadline; the grace still counts from the deadline.
    clock.advance(14 * S);
    assert_eq!(l.check_flush(), Ok(()));
    assert_eq!(l.snapshot().flush_grace_remaining, S);
    clock.advance(S);
    assert!(matches!(
        l.check_flush(),
        Err(LeaseError::FlushWindowClosed {
            state: LeaseState::Expired,
            ..
        })
    ));
}

#[test]
fn ttl_is_capped_at_max_ttl_on_grant() {
    let (_clock, l) = lease(terms(100, 30, 0));
    assert_eq!(l.terms().ttl, 30 * S);
    assert_eq!(l.check_access(), Ok(30 * S));
}

#[test]
fn renew_moves_the_deadline_and_caps_at_max_ttl() {
    let (clock, l) = lease(terms(10, 30, 5));
    clock.advance(8 * S);
    let snap = l.renew(20 * S).unwrap();
    assert_eq!(snap.remaining, 20 * S);
    assert_eq!(snap.renewals, 1);
    assert_eq!(snap.expires_at, start_wall() + 28 * S);
    let snap = l.renew(1000 * S).unwrap();
    assert_eq!(snap.remaining, 30 * S, "renewal capped at max_ttl");
    assert_eq!(snap.renewals, 2);
    clock.advance(30 * S);
    assert!(matches!(l.check_access(), Err(LeaseError::Expired { .. })));
}

#[test]
fn renew_can_shorten_and_zero_ttl_expires_now() {
    let (clock, l) = lease(terms(10, 30, 5));
    clock.advance(S);
    assert_eq!(l.renew(2 * S).unwrap().remaining, 2 * S);
    let snap = l.renew(Duration::ZERO).unwrap();
    assert_eq!(snap.state, LeaseState::Expired);
    assert_eq!(snap.flush_grace_remaining, 5 * S);
    assert!(l.check_access().is_err());
    assert!(l.check_flush().is_ok());
}

#[test]
fn renew_after_expiry_is_refused() {
    let (clock, l) = lease(terms(10, 30, 5));
    clock.advance(10 * S);
    let err = l.renew(10 * S).unwrap_err();
    assert!(matches!(err, LeaseError::Expired { .. }));
    assert!(
        err.to_string()
            .contains("ask the Delegator for a new delegation"),
        "message tells what to do: {err}"
    );
    assert_eq!(l.snapshot().renewals, 0);
}

#[test]
fn renew_after_revoke_is_refused() {
    let (_clock, l) = lease(terms(10, 30, 5));
    l.revoke(true);
    assert!(matches!(l.renew(S), Err(LeaseError::Revoked { .. })));
}

#[test]
fn revoke_is_idempotent_and_keeps_the_first_revocation() {
    let (clock, l) = lease(terms(10, 30, 5));
    clock.advance(2 * S);
    let first = l.revoke(true);
    assert_eq!(first.state, LeaseState::Revoked);
    assert_eq!(first.expires_at, start_wall() + 2 * S);
    clock.advance(S);
    let second = l.revoke(false);
    assert_eq!(second.state, LeaseState::Revoked);
    assert_eq!(second.expires_at, first.expires_at);
    // The second (no-flush) revoke does not take away the grace of the first.
    assert_eq!(second.flush_grace_remaining, 4 * S);
    assert_eq!(l.check_flush(), Ok(()));
    assert_eq!(
        l.check_access(),
        Err(LeaseError::Revoked {
            at: start_wall() + 2 * S
        })
    );
}

#[test]
fn revoke_of_an_expired_lease_stays_expired() {
    let (clock, l) = lease(terms(10, 30, 5));
    clock.advance(11 * S);
    let snap = l.revoke(false);
    assert_eq!(snap.state, LeaseState::Expired);
    assert_eq!(snap.flush_grace_remaining, 4 * S);
    assert!(matches!(l.check_access(), Err(LeaseError::Expired { .. })));
}

#[test]
fn flushing_revoke_has_a_grace_window() {
    let (clock, l) = lease(terms(10, 30, 5));
    l.revoke(true);
    assert!(l.check_access().is_err());
    clock.advance(5 * S - Duration::from_nanos(1));
    assert_eq!(l.check_flush(), Ok(()));
    clock.advance(Duration::from_nanos(1));
    let err = l.check_flush().unwrap_err();
    assert_eq!(
        err,
        LeaseError::FlushWindowClosed {
            state: LeaseState::Revoked,
            ended_at: start_wall(),
            grace: 5 * S
        }
    );
    assert_eq!(err.state(), LeaseState::Revoked);
}

#[test]
fn revoke_without_flush_has_no_grace() {
    let (_clock, l) = lease(terms(10, 30, 5));
    let snap = l.revoke(false);
    assert_eq!(snap.flush_grace_remaining, Duration::ZERO);
    assert!(matches!(l.check_flush(), Err(LeaseError::Revoked { .. })));
}

#[test]
fn zero_ttl_grant_is_expired_at_once() {
    let (_clock, l) = lease(terms(0, 30, 5));
    assert!(matches!(l.check_access(), Err(LeaseError::Expired { .. })));
    assert_eq!(l.check_flush(), Ok(()));
}

#[test]
fn huge_durations_do_not_overflow() {
    let clock = Arc::new(ManualClock::new());
    let l = Lease::grant(
        clock.clone(),
        LeaseTerms {
            ttl: Duration::MAX,
            max_ttl: Duration::MAX,
            flush_grace: Duration::MAX,
        },
    );
    assert_eq!(l.check_access(), Ok(TTL_CEILING));
    assert!(l.renew(Duration::MAX).is_ok());
    clock.advance(Duration::MAX);
    assert!(l.check_access().is_err());
    assert!(l.expires_at_rfc3339().ends_with('Z'));
}

#[test]
fn rfc3339_is_like_to_iso_string() {
    let (clock, l) = lease(terms(90, 90, 0));
    assert_eq!(l.expires_at_rfc3339(), "2025-01-01T00:01:30.000Z");
    clock.advance(Duration::from_millis(1234));
    l.renew(S).unwrap();
    assert_eq!(l.expires_at_rfc3339(), "2025-01-01T00:00:02.234Z");
    assert_eq!(
        rfc3339_millis(SystemTime::UNIX_EPOCH - Duration::from_millis(1)),
        "1969-12-31T23:59:59.999Z"
    );
}

#[test]
fn watchers_see_renew_and_revoke() {
    let (_clock, l) = lease(terms(10, 30, 5));
    let mut rx = l.subscribe();
    assert!(!rx.has_changed().unwrap());
    l.renew(20 * S).unwrap();
    assert!(rx.has_changed().unwrap());
    assert_eq!(rx.borrow_and_update().renewals, 1);
    l.revoke(true);
    assert!(rx.has_changed().unwrap());
    assert_eq!(rx.borrow_and_update().state, LeaseState::Revoked);
}

#[test]
fn expiry_is_published_when_first_observed() {
    let (clock, l) = lease(terms(1, 30, 5));
    let mut rx = l.subscribe();
    clock.advance(2 * S);
    assert!(!rx.has_changed().unwrap(), "nothing runs at the deadline");
    assert_eq!(l.snapshot().state, LeaseState::Expired);
    assert!(rx.has_changed().unwrap());
    assert_eq!(rx.borrow_and_update().state, LeaseState::Expired);
}

// ---------------------------------------------------------------------------------------
// Model-based property test: random operations against a tiny reference model in integer
// milliseconds.

#[derive(Debug, Clone)]
enum Op {
    Advance(u64),
    Renew(u64),
    Revoke(bool),
    Access,
    Flush,
    Snapshot,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..4000).prop_map(Op::Advance),
        2 => (0u64..6000).prop_map(Op::Renew),
        1 => any::<bool>().prop_map(Op::Revoke),
        2 => Just(Op::Access),
        2 => Just(Op::Flush),
        1 => Just(Op::Snapshot),
    ]
}

/// The reference model: absolute milliseconds, no clocks, no locks.
#[derive(Debug)]
struct Model {
    now: u64,
    deadline: u64,
    max_ttl: u64,
    grace: u64,
    /// (ended at, revoked?, grace applies?)
    ended: Option<(u64, bool, bool)>,
    renewals: u64,
}

impl Model {
    fn settle(&mut self) {
        if self.ended.is_none() && self.now >= self.deadline {
            self.ended = Some((self.deadline, false, true));
        }
    }
    fn state(&self) -> LeaseState {
        match self.ended {
            None => LeaseState::Active,
            Some((_, true, _)) => LeaseState::Revoked,
            Some((_, false, _)) => LeaseState::Expired,
        }
    }
    fn flush_ok(&self) -> bool {
        match self.ended {
            None => true,
            Some((at, _, grace)) => grace && self.now < at + self.grace,
        }
    }
}

proptest! {
    #[test]
    fn lease_matches_model(
        ttl in 0u64..5000,
        max_ttl in 1u64..5000,
        grace in 0u64..3000,
        ops in proptest::collection::vec(op(), 0..40),
    ) {
        let ms = Duration::from_millis;
        let clock = Arc::new(ManualClock::new());
        let l = Lease::grant(clock.clone(), LeaseTerms { ttl: ms(ttl), max_ttl: ms(max_ttl), flush_grace: ms(grace) });
        let mut m = Model { now: 0, deadline: ttl.min(max_ttl), max_ttl, grace, ended: None, renewals: 0 };
        for op in ops {
            match op {
                Op::Advance(d) => { clock.advance(ms(d)); m.now += d; }
                Op::Renew(t) => {
                    m.settle();
                    let got = l.renew(ms(t));
                    if m.ended.is_none() {
                        m.deadline = m.now + t.min(m.max_ttl);
                        m.renewals += 1;
                        m.settle();
                        prop_assert!(got.is_ok());
                    } else {
                        prop_assert!(got.is_err());
                    }
                }
                Op::Revoke(flush) => {
                    m.settle();
                    if m.ended.is_none() { m.ended = Some((m.now, true, flush)); }
                    prop_assert_eq!(l.revoke(flush).state, m.state());
                }
                Op::Access => {
                    m.settle();
                    let got = l.check_access();
                    match m.ended {
                        None => prop_assert_eq!(got, Ok(ms(m.deadline - m.now))),
                        Some(_) => prop_assert_eq!(got.map_err(|e| e.state()), Err(m.state())),
                    }
                }
                Op::Flush => {
                    m.settle();
                    prop_assert_eq!(l.check_flush().is_ok(), m.flush_ok());
                }
                Op::Snapshot => {
                    m.settle();
                    let s = l.snapshot();
                    prop_assert_eq!(s.state, m.state());
                    prop_assert_eq!(s.renewals, m.renewals);
                    let remaining = if m.ended.is_none() { m.deadline - m.now } else { 0 };
                    prop_assert_eq!(s.remaining, ms(remaining));
                    let grace_left = match m.ended {
                        None => m.grace,
                        Some((at, _, true)) => (at + m.grace).saturating_sub(m.now),
                        Some((_, _, false)) => 0,
                    };
                    prop_assert_eq!(s.flush_grace_remaining, ms(grace_left));
                }
            }
        }
    }
}

#[test]
fn renewals_stop_at_the_lifetime_the_delegator_allows() {
    let (clock, l) = lease(terms(10, 60, 0));
    l.limit_renewals(25 * S);
    clock.advance(8 * S);
    // Renewing at 8 s for 10 s: deadline 18 s, within the 25 s lifetime.
    assert_eq!(l.renew(10 * S).unwrap().remaining, 10 * S);
    clock.advance(8 * S);
    // At 16 s: a 10 s renewal would reach 26 s; it is cut to the lifetime, 25 s.
    assert_eq!(l.renew(10 * S).unwrap().remaining, 9 * S);
    clock.advance(9 * S);
    assert_eq!(l.check_access().unwrap_err().state(), LeaseState::Expired);
    assert!(l.renew(10 * S).is_err(), "no renewal after expiry");
}

#[test]
fn a_renewal_near_the_limit_never_shortens_the_lease() {
    let (clock, l) = lease(terms(10, 60, 0));
    l.limit_renewals(5 * S);
    clock.advance(S);
    // The grant already runs to 10 s, past the 5 s renewal limit: renewing keeps 10 s.
    assert_eq!(l.renew(10 * S).unwrap().remaining, 9 * S);
}
