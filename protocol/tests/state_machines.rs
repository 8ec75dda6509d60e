//! The Delegation and Assignment machines against small reference models.
//!
//! Each model is a table of the legal `(from, event, to)` rows written out here from
//! DESIGN.md §4 and the reference implementation (its `main` and multi-round branches), not
//! derived from the crate's code. Random event sequences, from every start state, must get the
//! same answer from the machine and the model at every step.

use awcp_protocol::{
    AssignmentEvent, AssignmentState, DelegationEvent, DelegationState, ErrorCode,
};
use proptest::prelude::*;

mod delegation_model {
    use awcp_protocol::{DelegationEvent as E, DelegationState as S};

    pub const NON_TERMINAL: [S; 6] = [
        S::Created,
        S::Invited,
        S::Accepted,
        S::Started,
        S::Running,
        S::Idle,
    ];
    pub const TERMINAL: [S; 4] = [S::Completed, S::Error, S::Cancelled, S::Expired];
    /// Where a lease can expire: every state after INVITE that is not terminal.
    const EXPIRABLE: [S; 5] = [S::Invited, S::Accepted, S::Started, S::Running, S::Idle];

    const FORWARD: [(S, E, S); 8] = [
        (S::Created, E::SendInvite, S::Invited),
        (S::Invited, E::ReceiveAccept, S::Accepted),
        (S::Accepted, E::SendStart, S::Started),
        (S::Started, E::SetupComplete, S::Running),
        (S::Running, E::ReceiveDone, S::Completed),
        (S::Running, E::RoundComplete, S::Idle),
        (S::Idle, E::SendContinue, S::Running),
        (S::Idle, E::SendClose, S::Completed),
    ];

    pub fn table() -> Vec<(S, E, S)> {
        let mut rows = FORWARD.to_vec();
        for s in NON_TERMINAL {
            rows.push((s, E::ReceiveError, S::Error));
            rows.push((s, E::SendError, S::Error));
            rows.push((s, E::Cancel, S::Cancelled));
        }
        for s in EXPIRABLE {
            rows.push((s, E::Expire, S::Expired));
        }
        rows
    }

    pub fn next(table: &[(S, E, S)], from: S, event: E) -> Option<S> {
        table
            .iter()
            .find(|(f, e, _)| *f == from && *e == event)
            .map(|(_, _, to)| *to)
    }
}

mod assignment_model {
    use awcp_protocol::{AssignmentEvent as E, AssignmentState as S};

    pub const NON_TERMINAL: [S; 3] = [S::Pending, S::Active, S::Idle];
    pub const TERMINAL: [S; 2] = [S::Completed, S::Error];

    const FORWARD: [(S, E, S); 6] = [
        (S::Pending, E::ReceiveStart, S::Active),
        (S::Active, E::TaskComplete, S::Completed),
        (S::Active, E::TaskFail, S::Error),
        (S::Active, E::RoundComplete, S::Idle),
        (S::Idle, E::ReceiveContinue, S::Active),
        (S::Idle, E::ReceiveClose, S::Completed),
    ];

    pub fn table() -> Vec<(S, E, S)> {
        let mut rows = FORWARD.to_vec();
        for s in NON_TERMINAL {
            rows.push((s, E::ReceiveError, S::Error));
            rows.push((s, E::Cancel, S::Error));
            rows.push((s, E::Expire, S::Error));
        }
        rows
    }

    pub fn next(table: &[(S, E, S)], from: S, event: E) -> Option<S> {
        table
            .iter()
            .find(|(f, e, _)| *f == from && *e == event)
            .map(|(_, _, to)| *to)
    }
}

fn delegation_state() -> impl Strategy<Value = DelegationState> {
    prop::sample::select(DelegationState::ALL.to_vec())
}

fn delegation_events() -> impl Strategy<Value = Vec<DelegationEvent>> {
    prop::collection::vec(prop::sample::select(DelegationEvent::ALL.to_vec()), 0..60)
}

fn assignment_state() -> impl Strategy<Value = AssignmentState> {
    prop::sample::select(AssignmentState::ALL.to_vec())
}

fn assignment_events() -> impl Strategy<Value = Vec<AssignmentEvent>> {
    prop::collection::vec(prop::sample::select(AssignmentEvent::ALL.to_vec()), 0..60)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn delegation_machine_agrees_with_the_model(
        start in delegation_state(),
        events in delegation_events(),
    ) {
        let table = delegation_model::table();
        let mut state = start;
        for event in events {
            let expected = delegation_model::next(&table, state, event);
            match state.apply(event) {
                Ok(next) => {
                    prop_assert_eq!(Some(next), expected, "{:?} + {:?}", state, event);
                    state = next;
                }
                Err(err) => {
                    prop_assert_eq!(expected, None, "{:?} + {:?} refused", state, event);
                    prop_assert_eq!(err.from, state);
                    prop_assert_eq!(err.event, event);
                }
            }
            prop_assert_eq!(
                state.is_terminal(),
                delegation_model::TERMINAL.contains(&state)
            );
        }
    }

    #[test]
    fn assignment_machine_agrees_with_the_model(
        start in assignment_state(),
        events in assignment_events(),
    ) {
        let table = assignment_model::table();
        let mut state = start;
        for event in events {
            let expected = assignment_model::next(&table, state, event);
            match state.apply(event) {
                Ok(next) => {
                    prop_assert_eq!(Some(next), expected, "{:?} + {:?}", state, event);
                    state = next;
                }
                Err(err) => {
                    prop_assert_eq!(expected, None, "{:?} + {:?} refused", state, event);
                    prop_assert_eq!(err.from, state);
                    prop_assert_eq!(err.event, event);
                }
            }
            prop_assert_eq!(
                state.is_terminal(),
                assignment_model::TERMINAL.contains(&state)
            );
        }
    }

    #[test]
    fn a_terminal_delegation_stays_put(events in delegation_events()) {
        for terminal in delegation_model::TERMINAL {
            for &event in &events {
                prop_assert!(terminal.apply(event).is_err(), "{:?} accepted {:?}", terminal, event);
            }
        }
    }

    #[test]
    fn a_terminal_assignment_stays_put(events in assignment_events()) {
        for terminal in assignment_model::TERMINAL {
            for &event in &events {
                prop_assert!(terminal.apply(event).is_err(), "{:?} accepted {:?}", terminal, event);
            }
        }
    }
}

#[test]
fn every_pair_matches_the_model_exhaustively() {
    let table = delegation_model::table();
    for s in DelegationState::ALL {
        for e in DelegationEvent::ALL {
            assert_eq!(
                s.apply(e).ok(),
                delegation_model::next(&table, s, e),
                "{s} + {e}"
            );
        }
    }
    let table = assignment_model::table();
    for s in AssignmentState::ALL {
        for e in AssignmentEvent::ALL {
            assert_eq!(
                s.apply(e).ok(),
                assignment_model::next(&table, s, e),
                "{s} + {e}"
            );
        }
    }
}

#[test]
fn model_tables_have_no_duplicate_rows() {
    // A duplicated (from, event) would make the model ambiguous and the comparison vacuous.
    let table = delegation_model::table();
    for (i, (f, e, _)) in table.iter().enumerate() {
        assert!(
            !table[i + 1..].iter().any(|(f2, e2, _)| f2 == f && e2 == e),
            "{f} + {e} twice"
        );
    }
    let table = assignment_model::table();
    for (i, (f, e, _)) in table.iter().enumerate() {
        assert!(
            !table[i + 1..].iter().any(|(f2, e2, _)| f2 == f && e2 == e),
            "{f} + {e} twice"
        );
    }
}

/// Every state reachable from `start` by breadth-first search over `apply`.
fn reachable<S: Copy + PartialEq, E: Copy>(
    start: S,
    events: &[E],
    apply: impl Fn(S, E) -> Option<S>,
) -> Vec<S> {
    let mut seen = vec![start];
    let mut i = 0;
    while i < seen.len() {
        for &e in events {
            if let Some(next) = apply(seen[i], e)
                && !seen.contains(&next)
            {
                seen.push(next);
            }
        }
        i += 1;
    }
    seen
}

#[test]
fn every_non_terminal_state_has_a_way_out_and_every_state_is_reachable() {
    for s in delegation_model::NON_TERMINAL {
        assert!(
            DelegationEvent::ALL.iter().any(|&e| s.apply(e).is_ok()),
            "{s}"
        );
    }
    for s in assignment_model::NON_TERMINAL {
        assert!(
            AssignmentEvent::ALL.iter().any(|&e| s.apply(e).is_ok()),
            "{s}"
        );
    }
    let seen = reachable(DelegationState::Created, &DelegationEvent::ALL, |s, e| {
        s.apply(e).ok()
    });
    assert_eq!(seen.len(), DelegationState::ALL.len(), "reached {seen:?}");
    let seen = reachable(AssignmentState::Pending, &AssignmentEvent::ALL, |s, e| {
        s.apply(e).ok()
    });
    assert_eq!(seen.len(), AssignmentState::ALL.len(), "reached {seen:?}");
}

#[test]
fn events_ending_an_assignment_in_error_imply_the_reference_codes() {
    assert_eq!(
        AssignmentEvent::Cancel.implied_error_code(),
        Some(ErrorCode::Cancelled)
    );
    assert_eq!(
        AssignmentEvent::TaskFail.implied_error_code(),
        Some(ErrorCode::TaskFailed)
    );
    assert_eq!(
        AssignmentEvent::Expire.implied_error_code(),
        Some(ErrorCode::Expired)
    );
    for e in AssignmentEvent::ALL {
        // An event with an implied code must be one that can end in `error`.
        if e.implied_error_code().is_some() {
            assert!(
                AssignmentState::ALL
                    .iter()
                    .any(|s| s.apply(e) == Ok(AssignmentState::Error)),
                "{e}"
            );
        }
    }
}

#[test]
fn states_round_trip_through_their_wire_names() {
    for s in DelegationState::ALL {
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, format!("\"{s}\""));
        assert_eq!(serde_json::from_str::<DelegationState>(&json).unwrap(), s);
    }
    for s in AssignmentState::ALL {
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, format!("\"{s}\""));
        assert_eq!(serde_json::from_str::<AssignmentState>(&json).unwrap(), s);
    }
    assert!(serde_json::from_str::<DelegationState>("\"RUNNING\"").is_err());
}
