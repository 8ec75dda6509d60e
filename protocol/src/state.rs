//! The Delegation (Delegator side) and Assignment (Executor side) state machines.
//!
//! Both are plain values: `state.apply(event)` returns the next state or an
//! [`IllegalTransition`] naming the state and the event, and changes nothing else. Storing the
//! state, sending messages and choosing the error code are the caller's business; the machine
//! only says whether an event may happen now and where it leads.
//!
//! ## Delegation
//!
//! ```text
//! created ─SendInvite→ invited ─ReceiveAccept→ accepted ─SendStart→ started ─SetupComplete→ running ─ReceiveDone→ completed
//!                                                                    running ─RoundComplete→ idle
//!                                                                       idle ─SendContinue→ running
//!                                                                       idle ─SendClose→ completed
//! any non-terminal ─ReceiveError | SendError→ error,  ─Cancel→ cancelled
//! invited | accepted | started | running | idle ─Expire→ expired
//! ```
//!
//! These are the reference's rules (including its multi-round branch) with one deliberate
//! difference: the reference refuses `Expire` from `started` and (through an inconsistency in
//! its tables) from `idle`. It never fires `Expire` at all; we do, and a lease can run out in
//! any state after INVITE, so we accept it there.
//!
//! The reference's Delegator fires `SetupComplete` on the first `status` event, and, if `done`
//! arrives while still `started`, fires `SetupComplete` and then `ReceiveDone`. A multi-round
//! Executor sends `done` after CLOSE, when the Delegator is already `completed`; callers ignore
//! it rather than feed it to the machine.
//!
//! ## Assignment
//!
//! ```text
//! pending ─ReceiveStart→ active ─TaskComplete→ completed
//!                         active ─RoundComplete→ idle ─ReceiveContinue→ active
//!                                                idle ─ReceiveClose→ completed
//! active ─TaskFail→ error
//! any non-terminal ─ReceiveError | Cancel | Expire→ error
//! ```
//!
//! An assignment has no `cancelled` or `expired` state: it ends in `error`, and the record
//! keeps the code ([`AssignmentEvent::implied_error_code`]). `Expire` is ours; the reference's
//! Executor has no lease watcher.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error_code::ErrorCode;

/// An event that is not allowed in the current state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal transition: {event} in state `{from}`")]
pub struct IllegalTransition<S, E> {
    /// The state the machine was in (and stays in).
    pub from: S,
    /// The refused event.
    pub event: E,
}

/// State of a delegation, as the Delegator tracks it. Lowercase on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DelegationState {
    /// Recorded, nothing sent yet.
    Created,
    /// INVITE sent.
    Invited,
    /// ACCEPT received.
    Accepted,
    /// START sent.
    Started,
    /// The Executor reported it is running.
    Running,
    /// A round finished; waiting for CONTINUE or CLOSE (multi-round).
    Idle,
    /// Finished (DONE, or CLOSE of a multi-round session). Terminal.
    Completed,
    /// Failed. Terminal.
    Error,
    /// Cancelled by the Delegator. Terminal.
    Cancelled,
    /// The lease ran out. Terminal.
    Expired,
}

/// What happens to a delegation. Displayed in the reference's spelling (`SEND_INVITE`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DelegationEvent {
    /// INVITE was sent.
    SendInvite,
    /// ACCEPT was received.
    ReceiveAccept,
    /// START was sent.
    SendStart,
    /// The Executor reported it is running (first `status` event).
    SetupComplete,
    /// A `round_done` event arrived.
    RoundComplete,
    /// CONTINUE was sent.
    SendContinue,
    /// CLOSE was sent.
    SendClose,
    /// A `done` event arrived.
    ReceiveDone,
    /// An ERROR (message or `error` event) arrived.
    ReceiveError,
    /// We sent an ERROR, or failed on our side.
    SendError,
    /// The delegation was cancelled.
    Cancel,
    /// The lease ran out.
    Expire,
}

impl DelegationState {
    /// Every state.
    pub const ALL: [DelegationState; 10] = [
        DelegationState::Created,
        DelegationState::Invited,
        DelegationState::Accepted,
        DelegationState::Started,
        DelegationState::Running,
        DelegationState::Idle,
        DelegationState::Completed,
        DelegationState::Error,
        DelegationState::Cancelled,
        DelegationState::Expired,
    ];

    /// Whether no event is accepted any more.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            DelegationState::Completed
                | DelegationState::Error
                | DelegationState::Cancelled
                | DelegationState::Expired
        )
    }

    /// The state after `event`, or why it cannot happen now.
    pub fn apply(
        self,
        event: DelegationEvent,
    ) -> Result<DelegationState, IllegalTransition<DelegationState, DelegationEvent>> {
        use DelegationEvent as E;
        use DelegationState as S;
        let next = match (self, event) {
            (s, _) if s.is_terminal() => None,
            (S::Created, E::SendInvite) => Some(S::Invited),
            (S::Invited, E::ReceiveAccept) => Some(S::Accepted),
            (S::Accepted, E::SendStart) => Some(S::Started),
            (S::Started, E::SetupComplete) => Some(S::Running),
            (S::Running, E::ReceiveDone) => Some(S::Completed),
            (S::Running, E::RoundComplete) => Some(S::Idle),
            (S::Idle, E::SendContinue) => Some(S::Running),
            (S::Idle, E::SendClose) => Some(S::Completed),
            (_, E::ReceiveError | E::SendError) => Some(S::Error),
            (_, E::Cancel) => Some(S::Cancelled),
            (S::Created, E::Expire) => None,
            (_, E::Expire) => Some(S::Expired),
            _ => None,
        };
        next.ok_or(IllegalTransition { from: self, event })
    }

    /// The wire name, e.g. `"running"`.
    pub fn as_str(self) -> &'static str {
        match self {
            DelegationState::Created => "created",
            DelegationState::Invited => "invited",
            DelegationState::Accepted => "accepted",
            DelegationState::Started => "started",
            DelegationState::Running => "running",
            DelegationState::Idle => "idle",
            DelegationState::Completed => "completed",
            DelegationState::Error => "error",
            DelegationState::Cancelled => "cancelled",
            DelegationState::Expired => "expired",
        }
    }
}

impl DelegationEvent {
    /// Every event.
    pub const ALL: [DelegationEvent; 12] = [
        DelegationEvent::SendInvite,
        DelegationEvent::ReceiveAccept,
        DelegationEvent::SendStart,
        DelegationEvent::SetupComplete,
        DelegationEvent::RoundComplete,
        DelegationEvent::SendContinue,
        DelegationEvent::SendClose,
        DelegationEvent::ReceiveDone,
        DelegationEvent::ReceiveError,
        DelegationEvent::SendError,
        DelegationEvent::Cancel,
        DelegationEvent::Expire,
    ];

    /// The reference's name for the event, e.g. `"SEND_INVITE"`.
    pub fn as_str(self) -> &'static str {
        match self {
            DelegationEvent::SendInvite => "SEND_INVITE",
            DelegationEvent::ReceiveAccept => "RECEIVE_ACCEPT",
            DelegationEvent::SendStart => "SEND_START",
            DelegationEvent::SetupComplete => "SETUP_COMPLETE",
            DelegationEvent::RoundComplete => "ROUND_COMPLETE",
            DelegationEvent::SendContinue => "SEND_CONTINUE",
            DelegationEvent::SendClose => "SEND_CLOSE",
            DelegationEvent::ReceiveDone => "RECEIVE_DONE",
            DelegationEvent::ReceiveError => "RECEIVE_ERROR",
            DelegationEvent::SendError => "SEND_ERROR",
            DelegationEvent::Cancel => "CANCEL",
            DelegationEvent::Expire => "EXPIRE",
        }
    }
}

/// State of an assignment, as the Executor tracks it. Lowercase on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AssignmentState {
    /// Accepted, waiting for START.
    Pending,
    /// The task (or a round) is running.
    Active,
    /// A round finished; waiting for CONTINUE or CLOSE (multi-round).
    Idle,
    /// Finished. Terminal.
    Completed,
    /// Failed, cancelled or expired (the record says which). Terminal.
    Error,
}

/// What happens to an assignment. Displayed in the reference's spelling (`RECEIVE_START`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AssignmentEvent {
    /// START arrived.
    ReceiveStart,
    /// The task finished (single-round).
    TaskComplete,
    /// A round finished (multi-round).
    RoundComplete,
    /// CONTINUE arrived.
    ReceiveContinue,
    /// CLOSE arrived.
    ReceiveClose,
    /// The task failed.
    TaskFail,
    /// An ERROR arrived from the Delegator.
    ReceiveError,
    /// The Delegator cancelled (`POST /cancel/:id`).
    Cancel,
    /// The lease ran out (ours).
    Expire,
}

impl AssignmentState {
    /// Every state.
    pub const ALL: [AssignmentState; 5] = [
        AssignmentState::Pending,
        AssignmentState::Active,
        AssignmentState::Idle,
        AssignmentState::Completed,
        AssignmentState::Error,
    ];

    /// Whether no event is accepted any more.
    pub fn is_terminal(self) -> bool {
        matches!(self, AssignmentState::Completed | AssignmentState::Error)
    }

    /// The state after `event`, or why it cannot happen now.
    pub fn apply(
        self,
        event: AssignmentEvent,
    ) -> Result<AssignmentState, IllegalTransition<AssignmentState, AssignmentEvent>> {
        use AssignmentEvent as E;
        use AssignmentState as S;
        let next = match (self, event) {
            (s, _) if s.is_terminal() => None,
            (S::Pending, E::ReceiveStart) => Some(S::Active),
            (S::Active, E::TaskComplete) => Some(S::Completed),
            (S::Active, E::RoundComplete) => Some(S::Idle),
            (S::Active, E::TaskFail) => Some(S::Error),
            (S::Idle, E::ReceiveContinue) => Some(S::Active),
            (S::Idle, E::ReceiveClose) => Some(S::Completed),
            (_, E::ReceiveError | E::Cancel | E::Expire) => Some(S::Error),
            _ => None,
        };
        next.ok_or(IllegalTransition { from: self, event })
    }

    /// The wire name, e.g. `"active"`.
    pub fn as_str(self) -> &'static str {
        match self {
            AssignmentState::Pending => "pending",
            AssignmentState::Active => "active",
            AssignmentState::Idle => "idle",
            AssignmentState::Completed => "completed",
            AssignmentState::Error => "error",
        }
    }
}

impl AssignmentEvent {
    /// Every event.
    pub const ALL: [AssignmentEvent; 9] = [
        AssignmentEvent::ReceiveStart,
        AssignmentEvent::TaskComplete,
        AssignmentEvent::RoundComplete,
        AssignmentEvent::ReceiveContinue,
        AssignmentEvent::ReceiveClose,
        AssignmentEvent::TaskFail,
        AssignmentEvent::ReceiveError,
        AssignmentEvent::Cancel,
        AssignmentEvent::Expire,
    ];

    /// The reference's name for the event, e.g. `"RECEIVE_START"`.
    pub fn as_str(self) -> &'static str {
        match self {
            AssignmentEvent::ReceiveStart => "RECEIVE_START",
            AssignmentEvent::TaskComplete => "TASK_COMPLETE",
            AssignmentEvent::RoundComplete => "ROUND_COMPLETE",
            AssignmentEvent::ReceiveContinue => "RECEIVE_CONTINUE",
            AssignmentEvent::ReceiveClose => "RECEIVE_CLOSE",
            AssignmentEvent::TaskFail => "TASK_FAIL",
            AssignmentEvent::ReceiveError => "RECEIVE_ERROR",
            AssignmentEvent::Cancel => "CANCEL",
            AssignmentEvent::Expire => "EXPIRE",
        }
    }

    /// The error code an assignment ended by this event records, when the event decides it:
    /// `CANCELLED` for [`Cancel`](Self::Cancel), `TASK_FAILED` for
    /// [`TaskFail`](Self::TaskFail), `EXPIRED` for [`Expire`](Self::Expire). `None` for
    /// [`ReceiveError`](Self::ReceiveError) (the code comes with the ERROR) and for events
    /// that do not end in `error`.
    ///
    /// An Executor whose lease ran out while still `pending` reports `START_EXPIRED` instead,
    /// as the reference's `LeaseExpiredError(duringStart)` does.
    pub fn implied_error_code(self) -> Option<ErrorCode> {
        match self {
            AssignmentEvent::Cancel => Some(ErrorCode::Cancelled),
            AssignmentEvent::TaskFail => Some(ErrorCode::TaskFailed),
            AssignmentEvent::Expire => Some(ErrorCode::Expired),
            AssignmentEvent::ReceiveStart
            | AssignmentEvent::TaskComplete
            | AssignmentEvent::RoundComplete
            | AssignmentEvent::ReceiveContinue
            | AssignmentEvent::ReceiveClose
            | AssignmentEvent::ReceiveError => None,
        }
    }
}

macro_rules! display_as_str {
    ($($ty:ty),*) => {$(
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    )*};
}

display_as_str!(
    DelegationState,
    DelegationEvent,
    AssignmentState,
    AssignmentEvent
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn happy_paths() {
        use DelegationEvent as E;
        let mut s = DelegationState::Created;
        for e in [
            E::SendInvite,
            E::ReceiveAccept,
            E::SendStart,
            E::SetupComplete,
            E::RoundComplete,
            E::SendContinue,
            E::RoundComplete,
            E::SendClose,
        ] {
            s = s.apply(e).unwrap();
        }
        assert_eq!(s, DelegationState::Completed);

        use AssignmentEvent as A;
        let mut a = AssignmentState::Pending;
        for e in [
            A::ReceiveStart,
            A::RoundComplete,
            A::ReceiveContinue,
            A::TaskComplete,
        ] {
            a = a.apply(e).unwrap();
        }
        assert_eq!(a, AssignmentState::Completed);
    }

    #[test]
    fn illegal_transition_names_state_and_event() {
        let err = DelegationState::Completed
            .apply(DelegationEvent::Cancel)
            .unwrap_err();
        assert_eq!(err.from, DelegationState::Completed);
        assert_eq!(err.event, DelegationEvent::Cancel);
        assert_eq!(
            err.to_string(),
            "illegal transition: CANCEL in state `completed`"
        );
    }

    #[test]
    fn expiry_rules() {
        assert!(
            DelegationState::Created
                .apply(DelegationEvent::Expire)
                .is_err()
        );
        for s in ["invited", "accepted", "started", "running", "idle"] {
            let s: DelegationState = serde_json::from_value(s.into()).unwrap();
            assert_eq!(
                s.apply(DelegationEvent::Expire),
                Ok(DelegationState::Expired)
            );
        }
    }

    #[test]
    fn cancel_of_an_assignment_is_an_error_with_cancelled() {
        assert_eq!(
            AssignmentState::Active.apply(AssignmentEvent::Cancel),
            Ok(AssignmentState::Error)
        );
        assert_eq!(
            AssignmentEvent::Cancel.implied_error_code(),
            Some(ErrorCode::Cancelled)
        );
    }

    #[test]
    fn wire_names_are_lowercase_and_match_as_str() {
        for s in DelegationState::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        for s in AssignmentState::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
    }
}
