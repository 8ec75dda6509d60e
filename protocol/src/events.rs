//! SSE task events: what the Executor reports while a task runs.
//!
//! The Executor serves `GET <base>/awcp/tasks/{delegationId}/events` as Server-Sent Events;
//! each event is one `data: <json>` line holding a [`TaskEvent`], a JSON object tagged on
//! `type` with `delegationId` and `timestamp` (ISO 8601). The reference writes no `event:` or
//! `id:` lines and its client reads only `data:` lines, so `id:` lines we add for resumption
//! are harmless to it.
//!
//! The stream ends after a terminal event ([`TaskEvent::is_terminal`]: `done` or `error`).
//! `round_done` (multi-round sessions) ends a round, not the stream.
//!
//! A client should skip an event whose `type` it does not know ([`parse_event`] returns
//! [`ProtocolError::UnknownType`] for it) rather than drop the stream: that is how a newer
//! Executor adds event kinds without breaking older Delegators.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::decode::{check_delegation_id, decode, discriminator};
use crate::error::ProtocolError;
use crate::error_code::ErrorCode;
use crate::ids::DelegationId;
use crate::redact::Redacted;

/// Value of a `status` event's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    /// The task (or a round) started running.
    Running,
    /// An intermediate progress report.
    Progress,
}

/// `status`: the task is running, or made progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusEvent {
    /// The delegation.
    pub delegation_id: DelegationId,
    /// When, ISO 8601.
    pub timestamp: String,
    /// Running or progress.
    pub status: RunStatus,
    /// Human-readable detail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Progress indicator (the reference defines it but never sets it; no scale is specified).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<f64>,
}

/// Optional description of a snapshot's content. Unknown keys are kept in `extra`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotMetadata {
    /// Number of files in the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_count: Option<u64>,
    /// Total size of the files, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<u64>,
    /// Paths changed relative to the delegated workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed_files: Option<Vec<String>>,
    /// Any other keys, as received (the reference allows arbitrary ones).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `snapshot`: a result of the task, to apply, stage or discard on the Delegator.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotEvent {
    /// The delegation.
    pub delegation_id: DelegationId,
    /// When, ISO 8601.
    pub timestamp: String,
    /// The snapshot's id (the reference uses `snap_` + 12 hex digits).
    pub snapshot_id: String,
    /// What the snapshot contains.
    pub summary: String,
    /// Notable items.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highlights: Option<Vec<String>>,
    /// The payload: for `archive`, a base64 zip of the work dir. Other reference transports
    /// put a JSON string here (`storage`: `{"resultUrl"}`, `git`: branch and commit).
    pub snapshot_base64: String,
    /// Whether the Executor recommends applying it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommended: Option<bool>,
    /// Description of the content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<SnapshotMetadata>,
}

impl fmt::Debug for SnapshotEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SnapshotEvent")
            .field("delegation_id", &self.delegation_id)
            .field("timestamp", &self.timestamp)
            .field("snapshot_id", &self.snapshot_id)
            .field("summary", &self.summary)
            .field("highlights", &self.highlights)
            .field("snapshot_base64", &Redacted(&self.snapshot_base64))
            .field("recommended", &self.recommended)
            .field("metadata", &self.metadata)
            .finish()
    }
}

/// `done`: the task finished; terminal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DoneEvent {
    /// The delegation.
    pub delegation_id: DelegationId,
    /// When, ISO 8601.
    pub timestamp: String,
    /// What was done.
    pub summary: String,
    /// Notable items.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highlights: Option<Vec<String>>,
    /// Snapshots sent before this event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_ids: Option<Vec<String>>,
    /// The one to apply, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommended_snapshot_id: Option<String>,
}

/// `error`: the task failed or was cancelled; terminal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorEvent {
    /// The delegation.
    pub delegation_id: DelegationId,
    /// When, ISO 8601.
    pub timestamp: String,
    /// Machine-readable code.
    pub code: ErrorCode,
    /// What happened.
    pub message: String,
    /// What to do about it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

/// `round_done`: one round of a multi-round session finished; the session goes idle and
/// waits for CONTINUE or CLOSE. Not terminal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoundDoneEvent {
    /// The delegation.
    pub delegation_id: DelegationId,
    /// When, ISO 8601.
    pub timestamp: String,
    /// The round that finished (1 for the round started by START).
    pub round: u32,
    /// What the round did.
    pub summary: String,
    /// Notable items.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highlights: Option<Vec<String>>,
    /// Snapshots sent during the round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_ids: Option<Vec<String>>,
    /// The one to apply, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommended_snapshot_id: Option<String>,
}

/// Any task event, tagged on `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TaskEvent {
    /// `status`.
    Status(StatusEvent),
    /// `snapshot`.
    Snapshot(SnapshotEvent),
    /// `done`.
    Done(DoneEvent),
    /// `error`.
    Error(ErrorEvent),
    /// `round_done`.
    RoundDone(RoundDoneEvent),
}

impl TaskEvent {
    /// Every `type` string, in declaration order.
    pub const KINDS: [&'static str; 5] = ["status", "snapshot", "done", "error", "round_done"];

    /// Whether the stream ends after this event: `done` and `error`.
    pub fn is_terminal(&self) -> bool {
        matches!(self, TaskEvent::Done(_) | TaskEvent::Error(_))
    }

    /// The event's `type` string, e.g. `"round_done"`.
    pub fn kind(&self) -> &'static str {
        match self {
            TaskEvent::Status(_) => "status",
            TaskEvent::Snapshot(_) => "snapshot",
            TaskEvent::Done(_) => "done",
            TaskEvent::Error(_) => "error",
            TaskEvent::RoundDone(_) => "round_done",
        }
    }

    /// The delegation the event is about.
    pub fn delegation_id(&self) -> &DelegationId {
        match self {
            TaskEvent::Status(e) => &e.delegation_id,
            TaskEvent::Snapshot(e) => &e.delegation_id,
            TaskEvent::Done(e) => &e.delegation_id,
            TaskEvent::Error(e) => &e.delegation_id,
            TaskEvent::RoundDone(e) => &e.delegation_id,
        }
    }

    /// When the event happened, ISO 8601.
    pub fn timestamp(&self) -> &str {
        match self {
            TaskEvent::Status(e) => &e.timestamp,
            TaskEvent::Snapshot(e) => &e.timestamp,
            TaskEvent::Done(e) => &e.timestamp,
            TaskEvent::Error(e) => &e.timestamp,
            TaskEvent::RoundDone(e) => &e.timestamp,
        }
    }
}

/// Parse one event (the JSON after `data: `), explaining any failure precisely.
///
/// Same order of checks as [`parse_message`](crate::parse_message), without the version:
/// not JSON, not an object, no or unknown `type`, malformed `delegationId`, missing field,
/// anything else.
pub fn parse_event(bytes: &[u8]) -> Result<TaskEvent, ProtocolError> {
    decode(bytes, |obj| {
        let kind = discriminator(obj, "type", "event", &TaskEvent::KINDS)?;
        check_delegation_id(obj)?;
        Ok(format!("{kind} event"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "dlg_3f2a9c1e5b7d4e6f8a0b1c2d3e4f5a6b";

    fn id() -> DelegationId {
        DelegationId::parse(ID).unwrap()
    }

    #[test]
    fn only_done_and_error_are_terminal() {
        let ts = "2026-03-09T13:40:00.000Z".to_string();
        let done = TaskEvent::Done(DoneEvent {
            delegation_id: id(),
            timestamp: ts.clone(),
            summary: "s".into(),
            highlights: None,
            snapshot_ids: None,
            recommended_snapshot_id: None,
        });
        let error = TaskEvent::Error(ErrorEvent {
            delegation_id: id(),
            timestamp: ts.clone(),
            code: ErrorCode::Cancelled,
            message: "Delegation cancelled".into(),
            hint: None,
        });
        let round = TaskEvent::RoundDone(RoundDoneEvent {
            delegation_id: id(),
            timestamp: ts.clone(),
            round: 1,
            summary: "s".into(),
            highlights: None,
            snapshot_ids: None,
            recommended_snapshot_id: None,
        });
        let status = TaskEvent::Status(StatusEvent {
            delegation_id: id(),
            timestamp: ts,
            status: RunStatus::Running,
            message: None,
            progress: None,
        });
        assert!(done.is_terminal());
        assert!(error.is_terminal());
        assert!(!round.is_terminal());
        assert!(!status.is_terminal());
        for e in [&done, &error, &round, &status] {
            let json = serde_json::to_value(e).unwrap();
            assert_eq!(json["type"], e.kind());
            assert_eq!(json["delegationId"], ID);
            assert_eq!(json["timestamp"], e.timestamp());
        }
    }

    #[test]
    fn reference_not_found_event_parses() {
        // What the reference Executor sends for an unknown delegation.
        let json = format!(
            r#"{{"delegationId":"{ID}","type":"error","timestamp":"2026-03-09T13:40:00.000Z","code":"NOT_FOUND","message":"Delegation not found on executor"}}"#
        );
        let TaskEvent::Error(e) = parse_event(json.as_bytes()).unwrap() else {
            panic!("not an error event");
        };
        assert_eq!(e.code, ErrorCode::NotFound);
    }

    #[test]
    fn unknown_event_type_is_skippable() {
        let json = format!(r#"{{"delegationId":"{ID}","type":"heartbeat","timestamp":"t"}}"#);
        let err = parse_event(json.as_bytes()).unwrap_err();
        assert!(err.is_unknown_type(), "{err:?}");
    }

    #[test]
    fn missing_timestamp_is_reported() {
        let json = format!(r#"{{"delegationId":"{ID}","type":"done","summary":"s"}}"#);
        match parse_event(json.as_bytes()).unwrap_err() {
            ProtocolError::MissingField { context, field } => {
                assert_eq!(context, "done event");
                assert_eq!(field, "timestamp");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn snapshot_metadata_keeps_unknown_keys() {
        let json = format!(
            r#"{{"delegationId":"{ID}","type":"snapshot","timestamp":"t","snapshotId":"snap_1","summary":"s","snapshotBase64":"UEs=","metadata":{{"fileCount":2,"tool":"pytest"}}}}"#
        );
        let TaskEvent::Snapshot(e) = parse_event(json.as_bytes()).unwrap() else {
            panic!("not a snapshot");
        };
        let meta = e.metadata.as_ref().unwrap();
        assert_eq!(meta.file_count, Some(2));
        assert_eq!(meta.extra["tool"], "pytest");
        assert!(!format!("{e:?}").contains("UEs="));
        let back = serde_json::to_value(TaskEvent::Snapshot(e)).unwrap();
        assert_eq!(back["metadata"]["tool"], "pytest");
    }
}
