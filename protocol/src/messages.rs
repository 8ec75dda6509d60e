//! AWCP v1 messages.
//!
//! A message is a JSON object with `version` (always `"1"`), `type` and `delegationId`, plus
//! the fields of its type. [`AwcpMessage`] is the union, tagged on `type`; each variant holds a
//! struct that also carries `version` and `delegationId`, so a single message can be built,
//! stored and sent on its own.
//!
//! | type | direction | carried by |
//! |---|---|---|
//! | `INVITE` | Delegator → Executor | `POST <executor>/awcp` |
//! | `ACCEPT` | Executor → Delegator | the 200 body answering INVITE |
//! | `START` | Delegator → Executor | `POST <executor>/awcp` |
//! | `DONE` | Executor → Delegator | never on HTTP: built from the SSE `done` event |
//! | `ERROR` | either | INVITE's 200 body when refused; `POST` otherwise |
//! | `CONTINUE`, `CLOSE` | Delegator → Executor | `POST`, multi-round sessions only |
//!
//! Field names and optionality follow the reference implementation exactly; optional fields
//! are left out of the JSON when absent, as the reference does. Unknown fields are ignored
//! when parsing, so a newer peer's additions do not break us (they are not kept).
//!
//! The `version` field is a [`ProtocolVersion`], which only (de)serializes as `"1"`: a message
//! of any other version fails to parse, and [`parse_message`] says which version it got.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::PROTOCOL_VERSION;
use crate::decode::{check_delegation_id, decode, discriminator};
use crate::error::ProtocolError;
use crate::error_code::ErrorCode;
use crate::ids::DelegationId;
use crate::redact::Redacted;
use crate::transport::{TransportHandle, TransportType};

/// The `version` field of every message: serializes as `"1"`, and deserializes only from `"1"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ProtocolVersion;

impl Serialize for ProtocolVersion {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(PROTOCOL_VERSION)
    }
}

impl<'de> Deserialize<'de> for ProtocolVersion {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        if value.as_str() == Some(PROTOCOL_VERSION) {
            Ok(ProtocolVersion)
        } else {
            Err(serde::de::Error::custom(format_args!(
                "unsupported protocol version {value} (this implementation speaks \"1\")"
            )))
        }
    }
}

/// Read-only or read-write access to the workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessMode {
    /// `ro`.
    Ro,
    /// `rw`.
    Rw,
}

impl AccessMode {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            AccessMode::Ro => "ro",
            AccessMode::Rw => "rw",
        }
    }
}

impl fmt::Display for AccessMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the Executor is asked to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskSpec {
    /// Short description, for logs and listings.
    pub description: String,
    /// Full instructions for the agent.
    pub prompt: String,
}

/// INVITE's requested lease: how long and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseConfig {
    /// Requested duration, counted from START.
    pub ttl_seconds: u64,
    /// Requested access.
    pub access_mode: AccessMode,
}

/// The lease granted by START (and optionally renewed by CONTINUE).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ActiveLease {
    /// Expiry instant, ISO 8601 (the reference writes `2026-03-09T14:38:47.123Z`).
    pub expires_at: String,
    /// Granted access.
    pub access_mode: AccessMode,
}

/// Kind of a delegated resource. The reference knows only directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResourceType {
    /// `fs`: a directory tree.
    Fs,
}

/// One resource as INVITE declares it: no source path leaves the Delegator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceDeclaration {
    /// Name; also the resource's top-level directory in the Executor's work dir.
    pub name: String,
    /// Kind.
    #[serde(rename = "type")]
    pub resource_type: ResourceType,
    /// Access to this resource.
    pub mode: AccessMode,
}

/// INVITE's `environment`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentDeclaration {
    /// The delegated resources.
    pub resources: Vec<ResourceDeclaration>,
}

/// INVITE's `requirements`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Requirements {
    /// The transport START will use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<TransportType>,
    /// Ours (additive, in the shape of ACCEPT's `executorConstraints.sandboxProfile`): the
    /// sandbox the Delegator asks for; `allowNetwork: false` runs the agent with no
    /// network. An Executor that cannot give it declines the INVITE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_profile: Option<SandboxProfile>,
}

impl Requirements {
    /// Whether the Delegator asked for an agent with no network.
    pub fn no_network(&self) -> bool {
        self.sandbox_profile
            .as_ref()
            .is_some_and(|s| s.allow_network == Some(false))
    }
}

/// Kind of credential in INVITE's `auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthType {
    /// `api_key`.
    ApiKey,
    /// `bearer`.
    Bearer,
    /// `oauth2`.
    Oauth2,
    /// `custom`.
    Custom,
}

/// INVITE's `auth`: a credential for a paid or restricted Executor.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthCredential {
    /// Kind of credential.
    #[serde(rename = "type")]
    pub auth_type: AuthType,
    /// The credential itself.
    pub credential: String,
    /// Free-form string pairs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

impl fmt::Debug for AuthCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthCredential")
            .field("auth_type", &self.auth_type)
            .field("credential", &Redacted(&self.credential))
            .field("metadata", &self.metadata)
            .finish()
    }
}

/// ACCEPT's `executorWorkDir`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecutorWorkDir {
    /// Where the workspace will appear on the Executor.
    pub path: String,
}

/// What the Executor lets the agent do (advisory in the reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxProfile {
    /// Confined to the work directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd_only: Option<bool>,
    /// Network access allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_network: Option<bool>,
    /// Running programs allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_exec: Option<bool>,
}

/// ACCEPT's `executorConstraints`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecutorConstraints {
    /// Access mode the Executor accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_access_mode: Option<AccessMode>,
    /// Longest lease the Executor accepts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ttl_seconds: Option<u64>,
    /// Sandbox the agent will run in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_profile: Option<SandboxProfile>,
}

/// INVITE: the Delegator proposes a delegation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InviteMessage {
    /// Always `"1"`.
    pub version: ProtocolVersion,
    /// The delegation.
    pub delegation_id: DelegationId,
    /// What to do.
    pub task: TaskSpec,
    /// Requested lease.
    pub lease: LeaseConfig,
    /// How long the Delegator keeps the delegation's record after it ends, in ms.
    pub retention_ms: u64,
    /// The resources offered.
    pub environment: EnvironmentDeclaration,
    /// Transport requirements (the reference always sends them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requirements: Option<Requirements>,
    /// Credential for the Executor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthCredential>,
    /// Ours (additive; the reference ignores it): the Delegator wants a multi-round session,
    /// so each round ends with `round_done` and the assignment waits, `idle`, for CONTINUE
    /// or CLOSE. Absent or false: the task ends with `done`, as the reference's `main`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multi_round: Option<bool>,
}

/// ACCEPT: the Executor takes the delegation (HTTP 200 body answering INVITE).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AcceptMessage {
    /// Always `"1"`.
    pub version: ProtocolVersion,
    /// The delegation.
    pub delegation_id: DelegationId,
    /// How long the Executor keeps its record after the end, in ms (≤ INVITE's).
    pub retention_ms: u64,
    /// Where the workspace will appear.
    pub executor_work_dir: ExecutorWorkDir,
    /// The Executor's limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_constraints: Option<ExecutorConstraints>,
}

/// START: the Delegator grants the lease and hands over the transport.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartMessage {
    /// Always `"1"`.
    pub version: ProtocolVersion,
    /// The delegation.
    pub delegation_id: DelegationId,
    /// The granted lease.
    pub lease: ActiveLease,
    /// How to reach the workspace.
    pub transport_handle: TransportHandle,
}

/// DONE: the task finished. The reference never sends it over HTTP; its Delegator builds it
/// from the SSE `done` event. Note `finalSummary`, where the event says `summary`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DoneMessage {
    /// Always `"1"`.
    pub version: ProtocolVersion,
    /// The delegation.
    pub delegation_id: DelegationId,
    /// What was done.
    pub final_summary: String,
    /// Notable items (files, findings).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highlights: Option<Vec<String>>,
    /// Free-form notes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notes: Option<String>,
}

/// ERROR: something failed or was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorMessage {
    /// Always `"1"`.
    pub version: ProtocolVersion,
    /// The delegation.
    pub delegation_id: DelegationId,
    /// Machine-readable code.
    pub code: ErrorCode,
    /// What happened, for people.
    pub message: String,
    /// What to do about it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

impl ErrorMessage {
    /// An ERROR without a hint.
    pub fn new(delegation_id: DelegationId, code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorMessage {
            version: ProtocolVersion,
            delegation_id,
            code,
            message: message.into(),
            hint: None,
        }
    }

    /// The same ERROR with a hint.
    pub fn with_hint(self, hint: impl Into<String>) -> Self {
        ErrorMessage {
            hint: Some(hint.into()),
            ..self
        }
    }
}

/// CONTINUE: start another round on the same workspace (multi-round sessions).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContinueMessage {
    /// Always `"1"`.
    pub version: ProtocolVersion,
    /// The delegation.
    pub delegation_id: DelegationId,
    /// The new round's instructions.
    pub task: TaskSpec,
    /// The new round's number; the first round (started by START) is 1.
    pub round: u32,
    /// A renewed lease, replacing START's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<ActiveLease>,
}

/// CLOSE: end a multi-round session; the Executor tears the workspace down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CloseMessage {
    /// Always `"1"`.
    pub version: ProtocolVersion,
    /// The delegation.
    pub delegation_id: DelegationId,
}

impl CloseMessage {
    /// CLOSE for `delegation_id`.
    pub fn new(delegation_id: DelegationId) -> Self {
        CloseMessage {
            version: ProtocolVersion,
            delegation_id,
        }
    }
}

/// Any AWCP v1 message, tagged on `type`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum AwcpMessage {
    /// `INVITE`.
    #[serde(rename = "INVITE")]
    Invite(InviteMessage),
    /// `ACCEPT`.
    #[serde(rename = "ACCEPT")]
    Accept(AcceptMessage),
    /// `START`.
    #[serde(rename = "START")]
    Start(StartMessage),
    /// `DONE`.
    #[serde(rename = "DONE")]
    Done(DoneMessage),
    /// `ERROR`.
    #[serde(rename = "ERROR")]
    Error(ErrorMessage),
    /// `CONTINUE`.
    #[serde(rename = "CONTINUE")]
    Continue(ContinueMessage),
    /// `CLOSE`.
    #[serde(rename = "CLOSE")]
    Close(CloseMessage),
}

impl AwcpMessage {
    /// Every `type` string, in declaration order.
    pub const KINDS: [&'static str; 7] = [
        "INVITE", "ACCEPT", "START", "DONE", "ERROR", "CONTINUE", "CLOSE",
    ];

    /// The delegation the message is about.
    pub fn delegation_id(&self) -> &DelegationId {
        match self {
            AwcpMessage::Invite(m) => &m.delegation_id,
            AwcpMessage::Accept(m) => &m.delegation_id,
            AwcpMessage::Start(m) => &m.delegation_id,
            AwcpMessage::Done(m) => &m.delegation_id,
            AwcpMessage::Error(m) => &m.delegation_id,
            AwcpMessage::Continue(m) => &m.delegation_id,
            AwcpMessage::Close(m) => &m.delegation_id,
        }
    }

    /// The message's `type` string, e.g. `"INVITE"`.
    pub fn kind(&self) -> &'static str {
        match self {
            AwcpMessage::Invite(_) => "INVITE",
            AwcpMessage::Accept(_) => "ACCEPT",
            AwcpMessage::Start(_) => "START",
            AwcpMessage::Done(_) => "DONE",
            AwcpMessage::Error(_) => "ERROR",
            AwcpMessage::Continue(_) => "CONTINUE",
            AwcpMessage::Close(_) => "CLOSE",
        }
    }
}

macro_rules! impl_from_message {
    ($($variant:ident($ty:ty)),* $(,)?) => {$(
        impl From<$ty> for AwcpMessage {
            fn from(m: $ty) -> Self {
                AwcpMessage::$variant(m)
            }
        }
    )*};
}

impl_from_message!(
    Invite(InviteMessage),
    Accept(AcceptMessage),
    Start(StartMessage),
    Done(DoneMessage),
    Error(ErrorMessage),
    Continue(ContinueMessage),
    Close(CloseMessage),
);

/// Parse one message, explaining any failure precisely.
///
/// The checks run in this order, and the first that fails decides the error:
/// not JSON ([`ProtocolError::MalformedJson`]), not an object
/// ([`ProtocolError::NotAnObject`]), no `type` ([`ProtocolError::MissingField`]), unknown
/// `type` ([`ProtocolError::UnknownType`]), no `version` (`MissingField`), a `version` other
/// than `"1"` ([`ProtocolError::UnsupportedVersion`]), a malformed `delegationId`
/// ([`ProtocolError::InvalidDelegationId`]), a missing field (`MissingField`), anything else
/// ([`ProtocolError::InvalidField`]).
pub fn parse_message(bytes: &[u8]) -> Result<AwcpMessage, ProtocolError> {
    decode(bytes, |obj| {
        let kind = discriminator(obj, "type", "message", &AwcpMessage::KINDS)?;
        let context = format!("{kind} message");
        match obj.get("version") {
            None => {
                return Err(ProtocolError::MissingField {
                    context,
                    field: "version".to_owned(),
                });
            }
            Some(v) if v.as_str() != Some(PROTOCOL_VERSION) => {
                return Err(ProtocolError::UnsupportedVersion {
                    received: v.to_string(),
                });
            }
            Some(_) => {}
        }
        check_delegation_id(obj)?;
        Ok(context)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::IdDefect;

    const ID: &str = "dlg_3f2a9c1e5b7d4e6f8a0b1c2d3e4f5a6b";

    fn close_json(version: &str) -> String {
        format!(r#"{{"version":{version},"type":"CLOSE","delegationId":"{ID}"}}"#)
    }

    #[test]
    fn parses_a_minimal_message() {
        let msg = parse_message(close_json("\"1\"").as_bytes()).unwrap();
        assert_eq!(msg.kind(), "CLOSE");
        assert_eq!(msg.delegation_id().as_str(), ID);
    }

    #[test]
    fn version_2_is_rejected_and_named() {
        let err = parse_message(close_json("\"2\"").as_bytes()).unwrap_err();
        match &err {
            ProtocolError::UnsupportedVersion { received } => assert_eq!(received, "\"2\""),
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("\"2\""), "{err}");
        // A number is not the string "1" either.
        let err = parse_message(close_json("1").as_bytes()).unwrap_err();
        assert!(
            matches!(&err, ProtocolError::UnsupportedVersion { received } if received == "1"),
            "{err:?}"
        );
        // Plain serde also refuses it, with the version in the message.
        let err = serde_json::from_str::<AwcpMessage>(&close_json("\"2\"")).unwrap_err();
        assert!(
            err.to_string()
                .contains("unsupported protocol version \"2\""),
            "{err}"
        );
    }

    #[test]
    fn missing_version_is_a_missing_field() {
        let json = format!(r#"{{"type":"CLOSE","delegationId":"{ID}"}}"#);
        match parse_message(json.as_bytes()).unwrap_err() {
            ProtocolError::MissingField { context, field } => {
                assert_eq!(context, "CLOSE message");
                assert_eq!(field, "version");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_type_is_rejected_as_such() {
        let json = format!(r#"{{"version":"1","type":"PING","delegationId":"{ID}"}}"#);
        let err = parse_message(json.as_bytes()).unwrap_err();
        assert!(err.is_unknown_type());
        match err {
            ProtocolError::UnknownType { what, received } => {
                assert_eq!(what, "message");
                assert_eq!(received, "PING");
            }
            other => panic!("{other:?}"),
        }
        // A lowercase known type is unknown: the reference's types are exact strings.
        let json = format!(r#"{{"version":"1","type":"close","delegationId":"{ID}"}}"#);
        assert!(
            parse_message(json.as_bytes())
                .unwrap_err()
                .is_unknown_type()
        );
    }

    #[test]
    fn malformed_json_is_distinct_from_bad_content() {
        for bad in [
            &b"{\"version\":"[..],
            b"not json",
            b"{\"a\":1,}",
            b"",
            b"{} x",
        ] {
            let err = parse_message(bad).unwrap_err();
            assert!(
                matches!(err, ProtocolError::MalformedJson { .. }),
                "{:?} gave {err:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(matches!(
            parse_message(b"[1,2]").unwrap_err(),
            ProtocolError::NotAnObject { found: "an array" }
        ));
        assert!(matches!(
            parse_message(b"{}").unwrap_err(),
            ProtocolError::MissingField { field, .. } if field == "type"
        ));
    }

    #[test]
    fn bad_delegation_id_is_rejected() {
        let json = r#"{"version":"1","type":"CLOSE","delegationId":"dlg_XYZ"}"#;
        match parse_message(json.as_bytes()).unwrap_err() {
            ProtocolError::InvalidDelegationId { value, defect } => {
                assert_eq!(value, "dlg_XYZ");
                assert_eq!(defect, IdDefect::NotLowercaseHex { position: 4 });
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn missing_field_names_the_field_and_the_message() {
        let json =
            format!(r#"{{"version":"1","type":"ERROR","delegationId":"{ID}","code":"DECLINED"}}"#);
        match parse_message(json.as_bytes()).unwrap_err() {
            ProtocolError::MissingField { context, field } => {
                assert_eq!(context, "ERROR message");
                assert_eq!(field, "message");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn wrong_enum_value_is_an_invalid_field() {
        let json = format!(
            r#"{{"version":"1","type":"START","delegationId":"{ID}",
                "lease":{{"expiresAt":"2026-03-09T14:38:47.123Z","accessMode":"rx"}},
                "transportHandle":{{"transport":"archive","workspaceBase64":"","checksum":""}}}}"#
        );
        match parse_message(json.as_bytes()).unwrap_err() {
            ProtocolError::InvalidField { context, source } => {
                assert_eq!(context, "START message");
                assert!(source.to_string().contains("rx"), "{source}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_error_code_is_preserved() {
        let json = format!(
            r#"{{"version":"1","type":"ERROR","delegationId":"{ID}","code":"QUOTA_EXCEEDED","message":"m"}}"#
        );
        let AwcpMessage::Error(err) = parse_message(json.as_bytes()).unwrap() else {
            panic!("not an ERROR");
        };
        assert_eq!(err.code.as_str(), "QUOTA_EXCEEDED");
        assert!(!err.code.is_known());
        let back = serde_json::to_value(AwcpMessage::Error(err)).unwrap();
        assert_eq!(back["code"], "QUOTA_EXCEEDED");
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let json = format!(
            r#"{{"version":"1","type":"CLOSE","delegationId":"{ID}","reason":"newer peer"}}"#
        );
        assert_eq!(parse_message(json.as_bytes()).unwrap().kind(), "CLOSE");
    }

    #[test]
    fn kind_matches_the_serialized_type() {
        let id = DelegationId::parse(ID).unwrap();
        let msg: AwcpMessage = ErrorMessage::new(id, ErrorCode::Declined, "busy")
            .with_hint("later")
            .into();
        let json = serde_json::to_value(&msg).unwrap();
        assert_eq!(json["type"], msg.kind());
        assert_eq!(json["version"], "1");
        assert_eq!(json["hint"], "later");
    }

    #[test]
    fn debug_of_auth_hides_the_credential() {
        let auth = AuthCredential {
            auth_type: AuthType::ApiKey,
            credential: "sk-live-123".into(),
            metadata: None,
        };
        assert!(!format!("{auth:?}").contains("sk-live-123"));
        assert_eq!(
            serde_json::to_value(auth).unwrap()["type"],
            serde_json::json!("api_key")
        );
    }
}
