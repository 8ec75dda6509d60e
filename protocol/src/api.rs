//! HTTP API bodies of the reference's Delegator daemon and Executor endpoint.
//!
//! AWCP tooling (the reference's MCP server and CLI) drives a Delegator daemon over a small
//! JSON API, by default on port 3100; an Executor serves a few routes beside its message
//! endpoint. Offering the same routes with the same bodies lets that tooling drive our
//! services. Each type below names its route. Shapes are the reference's; where we add a
//! field it is optional and says so.
//!
//! Delegator daemon:
//!
//! | route | request | 200 body | error bodies |
//! |---|---|---|---|
//! | `POST /delegate` | [`DelegateRequest`] | [`DelegateResponse`] | 400/500 [`ApiError`] |
//! | `GET /delegations` | — | [`DelegationList`] | — |
//! | `GET /delegation/:id` | — | [`DelegationRecord`] | 404 [`ApiError`] |
//! | `DELETE /delegation/:id` | — | [`OkResponse`] | 400 [`ApiError`] |
//! | `GET /delegation/:id/snapshots` | — | [`SnapshotList`] | 404 [`ApiError`] |
//! | `POST /delegation/:id/snapshots/:sid/apply` | — | [`OkResponse`] | 400 [`ApiError`] |
//! | `POST /delegation/:id/snapshots/:sid/discard` | — | [`OkResponse`] | 400 [`ApiError`] |
//! | `POST /delegation/:id/continue` | [`ContinueRequest`] | [`ContinueResponse`] | 400 [`ApiError`] |
//! | `POST /delegation/:id/close` | — | [`OkResponse`] | 400 [`ApiError`] |
//! | `GET /health` | — | [`HealthResponse`] | — |
//!
//! Executor, under `<base>/awcp`:
//!
//! | route | request | 200 body | error bodies |
//! |---|---|---|---|
//! | `POST /` | INVITE | [`InviteReply`] | 500 [`ApiError`] |
//! | `POST /` | START, CONTINUE, CLOSE, ERROR | [`OkResponse`] | 500 [`ApiError`] |
//! | `GET /tasks/:id/result` | — | [`TaskResultResponse`] | 404 `{"status":"not_found"}` |
//! | `POST /tasks/:id/ack` | — | [`OkResponse`] | — |
//! | `POST /cancel/:id` | — | [`CancelResponse`] | 404/500 [`ApiError`] |
//! | `GET /status` | — | [`ExecutorStatus`] | — |

use serde::{Deserialize, Serialize};

use crate::error_code::ErrorCode;
use crate::events::SnapshotMetadata;
use crate::ids::DelegationId;
use crate::messages::{
    AcceptMessage, AccessMode, ActiveLease, AuthCredential, AwcpMessage, ErrorMessage,
    ExecutorConstraints, ExecutorWorkDir, LeaseConfig, ResourceType, TaskSpec,
};
use crate::state::DelegationState;

/// One resource as the Delegator knows it, with its local source path (never sent to an
/// Executor; INVITE carries a [`ResourceDeclaration`](crate::messages::ResourceDeclaration)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceSpec {
    /// Name; the resource's top-level directory on the Executor.
    pub name: String,
    /// Kind.
    #[serde(rename = "type")]
    pub resource_type: ResourceType,
    /// Local directory (the reference resolves a relative one against the daemon's cwd).
    pub source: String,
    /// Access to this resource.
    pub mode: AccessMode,
    /// Globs to include (accepted but ignored by the reference).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include: Option<Vec<String>>,
    /// Globs to exclude (accepted but ignored by the reference).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude: Option<Vec<String>>,
    /// Ours (additive): also exclude what the resource's root `.gitignore` lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gitignore: Option<bool>,
    /// Ours (additive): globs of files delegated although they match a sensitive pattern
    /// (the user has looked at them, e.g. a public key in a vendored dependency).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_sensitive: Option<Vec<String>>,
}

/// The resources of a delegation, with source paths.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentSpec {
    /// The resources.
    pub resources: Vec<ResourceSpec>,
}

/// What the Delegator does with arriving snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotMode {
    /// Apply on arrival.
    Auto,
    /// Keep until applied or discarded.
    Staged,
    /// Drop.
    Discard,
}

/// `POST /delegate` request body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DelegateRequest {
    /// The Executor's AWCP endpoint, e.g. `http://exec:4001/awcp`.
    pub executor_url: String,
    /// What to delegate.
    pub environment: EnvironmentSpec,
    /// What to do.
    pub task: TaskSpec,
    /// Lease length (reference default 3600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// Access (reference default `rw`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_mode: Option<AccessMode>,
    /// Snapshot handling (reference default `auto`; its `main` branch ignores this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_mode: Option<SnapshotMode>,
    /// Credential for the Executor (sent by the reference client, ignored by its daemon).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthCredential>,
    /// Ours (additive): the transport, `awcpfs` (default) or `archive` (for an Executor
    /// that speaks only the reference protocol).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<crate::transport::TransportType>,
    /// Ours (additive): a multi-round session; after each round the delegation is `idle`
    /// until `POST /delegation/:id/continue` or `…/close`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multi_round: Option<bool>,
    /// Ours (additive): with `transport: "git"`, the git remote the workspace is pushed to
    /// (else the daemon's `--git-remote`). Credentials never travel here: the daemon uses
    /// git's credential helper or its `--git-token-file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git_remote: Option<String>,
    /// Ours (additive): run the agent with no network (INVITE's
    /// `requirements.sandboxProfile.allowNetwork: false`); an Executor that cannot
    /// declines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_network: Option<bool>,
}

/// `POST /delegate` 200 body. The reference answers only after INVITE, ACCEPT and START.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DelegateResponse {
    /// The new delegation.
    pub delegation_id: DelegationId,
}

/// Error body of every daemon and Executor route that fails (`400`, `404`, `500`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApiError {
    /// What went wrong.
    pub error: String,
    /// AWCP code, when an AWCP error caused it (`POST /delegate` 400).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
    /// What to do about it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// Number of delegations the daemon holds (`GET /delegation/:id` 404).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub known_delegations: Option<u64>,
}

impl ApiError {
    /// An error body with only a message.
    pub fn new(error: impl Into<String>) -> Self {
        ApiError {
            error: error.into(),
            code: None,
            hint: None,
            known_delegations: None,
        }
    }
}

/// `GET /delegations` 200 body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DelegationList {
    /// Number of delegations held — all of them, terminal ones included, despite the name.
    pub active_delegations: u64,
    /// One line per delegation.
    pub delegations: Vec<DelegationSummary>,
}

/// An item of [`DelegationList`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DelegationSummary {
    /// The delegation.
    pub id: DelegationId,
    /// Its state.
    pub state: DelegationState,
    /// The Executor's AWCP endpoint.
    pub executor_url: String,
    /// What was delegated.
    pub environment: EnvironmentSpec,
    /// When it was created, ISO 8601.
    pub created_at: String,
}

/// A delegation's snapshot policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotPolicy {
    /// What to do with arriving snapshots.
    pub mode: SnapshotMode,
    /// How long staged snapshots are kept, in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_ms: Option<u64>,
    /// How many snapshots are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_snapshots: Option<u32>,
}

/// Where a snapshot stands on the Delegator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotStatus {
    /// Staged, not yet applied or discarded.
    Pending,
    /// Applied to the workspace.
    Applied,
    /// Dropped.
    Discarded,
}

/// A snapshot as the Delegator keeps it (`GET /delegation/:id/snapshots` items).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentSnapshot {
    /// The snapshot's id (`snap_…`).
    pub id: String,
    /// The delegation it belongs to.
    pub delegation_id: DelegationId,
    /// What it contains.
    pub summary: String,
    /// Notable items.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highlights: Option<Vec<String>>,
    /// Where it stands.
    pub status: SnapshotStatus,
    /// Where a staged snapshot is stored on the Delegator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_path: Option<String>,
    /// Description of the content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<SnapshotMetadata>,
    /// Whether the Executor recommended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommended: Option<bool>,
    /// When it arrived, ISO 8601.
    pub created_at: String,
    /// When it was applied, ISO 8601.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_at: Option<String>,
}

/// `GET /delegation/:id/snapshots` 200 body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotList {
    /// The delegation's snapshots, oldest first.
    pub snapshots: Vec<EnvironmentSnapshot>,
}

/// A summary and highlights: a task's or a round's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResultSummary {
    /// What was done.
    pub summary: String,
    /// Notable items.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highlights: Option<Vec<String>>,
}

/// An error as records keep it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorInfo {
    /// Machine-readable code.
    pub code: ErrorCode,
    /// What happened.
    pub message: String,
    /// What to do about it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

/// One round of a multi-round delegation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Round {
    /// 1 for the round started by START.
    pub number: u32,
    /// The round's instructions.
    pub task: TaskSpec,
    /// Its result, once finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ResultSummary>,
    /// Snapshots of this round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<Vec<EnvironmentSnapshot>>,
    /// When it started, ISO 8601.
    pub started_at: String,
    /// When it finished, ISO 8601.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<String>,
}

/// `GET /delegation/:id` 200 body: the Delegator's whole record of a delegation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DelegationRecord {
    /// The delegation.
    pub id: DelegationId,
    /// Its state.
    pub state: DelegationState,
    /// The Executor's AWCP endpoint.
    pub peer_url: String,
    /// What was delegated, with source paths.
    pub environment: EnvironmentSpec,
    /// The directory served to the transport.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export_path: Option<String>,
    /// The task (of the first round).
    pub task: TaskSpec,
    /// The requested lease.
    pub lease_config: LeaseConfig,
    /// How long the record is kept after the end, in ms.
    pub retention_ms: u64,
    /// The Executor's retention, from ACCEPT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_retention_ms: Option<u64>,
    /// The granted lease, from START.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_lease: Option<ActiveLease>,
    /// From ACCEPT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_work_dir: Option<ExecutorWorkDir>,
    /// From ACCEPT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_constraints: Option<ExecutorConstraints>,
    /// Snapshots received.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<Vec<EnvironmentSnapshot>>,
    /// The last applied snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_snapshot_id: Option<String>,
    /// Snapshot handling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_policy: Option<SnapshotPolicy>,
    /// Current round (multi-round reference branch; required there, absent on `main`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_round: Option<u32>,
    /// All rounds so far (multi-round reference branch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounds: Option<Vec<Round>>,
    /// The result, once done (or after each round).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ResultSummary>,
    /// The failure, if it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
    /// Created, ISO 8601.
    pub created_at: String,
    /// Last changed, ISO 8601.
    pub updated_at: String,
}

/// `{"ok":true}`: the 200 body of DELETE, apply, discard, close, ack, and of START /
/// CONTINUE / CLOSE / ERROR posted to an Executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OkResponse {
    /// Always `true` in a 200.
    pub ok: bool,
}

impl OkResponse {
    /// `{"ok":true}`.
    pub const OK: OkResponse = OkResponse { ok: true };
}

/// `POST /delegation/:id/continue` request body (multi-round reference branch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContinueRequest {
    /// The next round's instructions.
    pub task: TaskSpec,
}

/// `POST /delegation/:id/continue` 200 body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContinueResponse {
    /// Always `true` in a 200.
    pub ok: bool,
    /// The round just started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
}

/// `GET /health` 200 body: `{"status":"ok"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthResponse {
    /// `"ok"`.
    pub status: String,
    /// Ours: the daemon's id (`dmn_…`) when it shares its database with other daemons
    /// (`serve --state postgres://…`): the name `owner` fields and events give it. Absent
    /// for a daemon with state of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon: Option<String>,
}

impl HealthResponse {
    /// `{"status":"ok"}`.
    pub fn ok() -> Self {
        HealthResponse {
            status: "ok".to_owned(),
            daemon: None,
        }
    }
}

/// The Executor's 200 answer to INVITE: ACCEPT, or ERROR when it refuses (still HTTP 200).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum InviteReply {
    /// `ACCEPT`.
    #[serde(rename = "ACCEPT")]
    Accept(AcceptMessage),
    /// `ERROR`.
    #[serde(rename = "ERROR")]
    Error(ErrorMessage),
}

impl From<InviteReply> for AwcpMessage {
    fn from(reply: InviteReply) -> Self {
        match reply {
            InviteReply::Accept(m) => AwcpMessage::Accept(m),
            InviteReply::Error(m) => AwcpMessage::Error(m),
        }
    }
}

impl TryFrom<AwcpMessage> for InviteReply {
    type Error = AwcpMessage;

    /// Keep ACCEPT and ERROR; give any other message back.
    fn try_from(msg: AwcpMessage) -> Result<Self, AwcpMessage> {
        match msg {
            AwcpMessage::Accept(m) => Ok(InviteReply::Accept(m)),
            AwcpMessage::Error(m) => Ok(InviteReply::Error(m)),
            other => Err(other),
        }
    }
}

/// `POST /cancel/:id` 200 body: `{"ok":true,"cancelled":true}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CancelResponse {
    /// Always `true` in a 200.
    pub ok: bool,
    /// Always `true` in a 200.
    pub cancelled: bool,
}

/// `status` of a [`TaskResultResponse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskResultStatus {
    /// Not finished.
    Running,
    /// Finished; the result is in the body.
    Completed,
    /// Failed; `error` is in the body.
    Error,
    /// The transport writes directly to the source (sshfs); nothing to fetch.
    NotApplicable,
    /// Unknown delegation (HTTP 404).
    NotFound,
}

/// `GET /tasks/:id/result` body: the result kept for a Delegator whose stream dropped.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskResultResponse {
    /// Where the task stands.
    pub status: TaskResultStatus,
    /// When it ended, ISO 8601.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<String>,
    /// What was done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Notable items.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highlights: Option<Vec<String>>,
    /// The final snapshot, as in the `snapshot` event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_base64: Option<String>,
    /// The failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
    /// Why `not_applicable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl std::fmt::Debug for TaskResultResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskResultResponse")
            .field("status", &self.status)
            .field("completed_at", &self.completed_at)
            .field("summary", &self.summary)
            .field("highlights", &self.highlights)
            .field(
                "snapshot_base64",
                &self.snapshot_base64.as_deref().map(crate::redact::Redacted),
            )
            .field("error", &self.error)
            .field("reason", &self.reason)
            .finish()
    }
}

/// `GET /status` 200 body of an Executor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecutorStatus {
    /// Assignments waiting for START.
    pub pending_invitations: u64,
    /// Assignments running (or idle between rounds).
    pub active_delegations: u64,
    /// Assignments completed or failed, still held.
    pub completed_delegations: u64,
    /// The running (and idle) assignments.
    pub delegations: Vec<ExecutorDelegationInfo>,
    /// Ours (additive): the transports this Executor serves, so a Delegator asked for no
    /// particular one can choose (a reference Executor sends none and serves `archive`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transports: Option<Vec<crate::TransportType>>,
    /// Ours (additive): how this Executor admits Delegators: `credential` (INVITE must
    /// carry its credential) or `open` (anyone: `--unsafe-open`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<String>,
    /// Ours (additive), only for a caller that presented the Executor's credential: the
    /// accepted INVITEs still waiting for START. Anonymous callers see no ids and no paths
    /// (`delegations` is empty for them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<Vec<PendingInvitation>>,
}

/// An accepted INVITE waiting for its START (ours, in [`ExecutorStatus`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingInvitation {
    /// The delegation.
    pub id: DelegationId,
    /// The peer address the INVITE came from.
    pub peer: String,
    /// Whether it carried the Executor's credential.
    pub authenticated: bool,
    /// When it expires without START, ISO 8601.
    pub expires_at: String,
}

/// An item of [`ExecutorStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecutorDelegationInfo {
    /// The delegation.
    pub id: DelegationId,
    /// Its work directory.
    pub work_path: String,
    /// When START arrived, ISO 8601.
    pub started_at: String,
    /// Ours (additive): the `awcpfs` mount's status (state, lease left, open files,
    /// counters), as its `status.json` holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount: Option<serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ok_and_health_bodies() {
        assert_eq!(
            serde_json::to_string(&OkResponse::OK).unwrap(),
            r#"{"ok":true}"#
        );
        assert_eq!(
            serde_json::to_string(&HealthResponse::ok()).unwrap(),
            r#"{"status":"ok"}"#
        );
        assert_eq!(
            serde_json::to_string(&ApiError::new("Unknown delegation: x")).unwrap(),
            r#"{"error":"Unknown delegation: x"}"#
        );
    }

    #[test]
    fn task_result_status_is_snake_case() {
        let body: TaskResultResponse = serde_json::from_str(r#"{"status":"not_found"}"#).unwrap();
        assert_eq!(body.status, TaskResultStatus::NotFound);
        assert_eq!(
            serde_json::to_value(TaskResultStatus::NotApplicable).unwrap(),
            "not_applicable"
        );
    }

    #[test]
    fn invite_reply_accepts_only_accept_and_error() {
        let json = r#"{"version":"1","type":"ERROR","delegationId":"dlg_3f2a9c1e5b7d4e6f8a0b1c2d3e4f5a6b","code":"DECLINED","message":"busy"}"#;
        let reply: InviteReply = serde_json::from_str(json).unwrap();
        assert!(matches!(&reply, InviteReply::Error(e) if e.code == ErrorCode::Declined));
        let close = r#"{"version":"1","type":"CLOSE","delegationId":"dlg_3f2a9c1e5b7d4e6f8a0b1c2d3e4f5a6b"}"#;
        assert!(serde_json::from_str::<InviteReply>(close).is_err());
        let msg: AwcpMessage = reply.into();
        assert_eq!(msg.kind(), "ERROR");
        assert!(InviteReply::try_from(msg).is_ok());
    }
}
