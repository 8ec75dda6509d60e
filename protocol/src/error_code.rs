//! AWCP error codes.
//!
//! On the wire an error code is a `SCREAMING_SNAKE_CASE` string, typed `string` in the
//! reference. [`ErrorCode`] names the codes we know and keeps any other as
//! [`ErrorCode::Other`], so a message from a newer peer with a new code still parses: refusing
//! a whole ERROR or SSE `error` event because of its code would turn a clear failure into an
//! unexplained one.
//!
//! [`ErrorCode::Other`] holds an [`UnknownErrorCode`], which can only be made by parsing a
//! string that is *not* a known code. So every code has exactly one representation, and a
//! code survives a JSON round trip unchanged.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An AWCP error code.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// `DECLINED`: the Executor refused the invitation (capacity, TTL, access mode, policy).
    Declined,
    /// `DEP_MISSING`: a dependency of the transport is missing on the Executor.
    DepMissing,
    /// `WORKSPACE_TOO_LARGE`: admission refused the workspace's size or file count.
    WorkspaceTooLarge,
    /// `WORKSPACE_NOT_FOUND`: the workspace directory does not exist.
    WorkspaceNotFound,
    /// `WORKSPACE_INVALID`: the workspace path is not a usable directory.
    WorkspaceInvalid,
    /// `SENSITIVE_FILES`: admission found files that look like secrets.
    SensitiveFiles,
    /// `WORKDIR_DENIED`: the Executor's policy refuses the work directory.
    WorkdirDenied,
    /// `START_EXPIRED`: the lease expired before START arrived.
    StartExpired,
    /// `EXPIRED`: the lease expired while the task ran.
    Expired,
    /// `AUTH_FAILED`: the credential was refused.
    AuthFailed,
    /// `SETUP_FAILED`: the transport could not be set up.
    SetupFailed,
    /// `TASK_FAILED`: the agent's task failed.
    TaskFailed,
    /// `CANCELLED`: the delegation was cancelled.
    Cancelled,
    /// `TRANSPORT_ERROR`: the transport failed after setup.
    TransportError,
    /// `CHECKSUM_MISMATCH`: a transferred archive does not match its checksum.
    ChecksumMismatch,
    /// `NOT_FOUND`: not in the reference's code table, but its Executor sends it as an SSE
    /// `error` event when the stream of an unknown delegation is requested.
    NotFound,
    /// `SSE_FAILED`: not in the reference's code table, but its Delegator records it on a
    /// delegation whose SSE stream broke before a terminal event.
    SseFailed,
    /// Any other code, preserved as received.
    Other(UnknownErrorCode),
}

/// An error code this crate does not know, as received from a peer.
///
/// Only [`ErrorCode::from_wire`] makes one, and only for strings that are not a known code.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UnknownErrorCode(String);

impl UnknownErrorCode {
    /// The code as received.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl ErrorCode {
    /// Every known code (everything but [`ErrorCode::Other`]).
    pub const KNOWN: &'static [ErrorCode] = &[
        ErrorCode::Declined,
        ErrorCode::DepMissing,
        ErrorCode::WorkspaceTooLarge,
        ErrorCode::WorkspaceNotFound,
        ErrorCode::WorkspaceInvalid,
        ErrorCode::SensitiveFiles,
        ErrorCode::WorkdirDenied,
        ErrorCode::StartExpired,
        ErrorCode::Expired,
        ErrorCode::AuthFailed,
        ErrorCode::SetupFailed,
        ErrorCode::TaskFailed,
        ErrorCode::Cancelled,
        ErrorCode::TransportError,
        ErrorCode::ChecksumMismatch,
        ErrorCode::NotFound,
        ErrorCode::SseFailed,
    ];

    /// The code's wire string.
    pub fn as_str(&self) -> &str {
        match self {
            ErrorCode::Declined => "DECLINED",
            ErrorCode::DepMissing => "DEP_MISSING",
            ErrorCode::WorkspaceTooLarge => "WORKSPACE_TOO_LARGE",
            ErrorCode::WorkspaceNotFound => "WORKSPACE_NOT_FOUND",
            ErrorCode::WorkspaceInvalid => "WORKSPACE_INVALID",
            ErrorCode::SensitiveFiles => "SENSITIVE_FILES",
            ErrorCode::WorkdirDenied => "WORKDIR_DENIED",
            ErrorCode::StartExpired => "START_EXPIRED",
            ErrorCode::Expired => "EXPIRED",
            ErrorCode::AuthFailed => "AUTH_FAILED",
            ErrorCode::SetupFailed => "SETUP_FAILED",
            ErrorCode::TaskFailed => "TASK_FAILED",
            ErrorCode::Cancelled => "CANCELLED",
            ErrorCode::TransportError => "TRANSPORT_ERROR",
            ErrorCode::ChecksumMismatch => "CHECKSUM_MISMATCH",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::SseFailed => "SSE_FAILED",
            ErrorCode::Other(code) => code.as_str(),
        }
    }

    /// Interpret a wire string: a known code, or [`ErrorCode::Other`] holding it verbatim.
    /// Matching is exact (case-sensitive), as in the reference.
    pub fn from_wire(s: &str) -> ErrorCode {
        match s {
            "DECLINED" => ErrorCode::Declined,
            "DEP_MISSING" => ErrorCode::DepMissing,
            "WORKSPACE_TOO_LARGE" => ErrorCode::WorkspaceTooLarge,
            "WORKSPACE_NOT_FOUND" => ErrorCode::WorkspaceNotFound,
            "WORKSPACE_INVALID" => ErrorCode::WorkspaceInvalid,
            "SENSITIVE_FILES" => ErrorCode::SensitiveFiles,
            "WORKDIR_DENIED" => ErrorCode::WorkdirDenied,
            "START_EXPIRED" => ErrorCode::StartExpired,
            "EXPIRED" => ErrorCode::Expired,
            "AUTH_FAILED" => ErrorCode::AuthFailed,
            "SETUP_FAILED" => ErrorCode::SetupFailed,
            "TASK_FAILED" => ErrorCode::TaskFailed,
            "CANCELLED" => ErrorCode::Cancelled,
            "TRANSPORT_ERROR" => ErrorCode::TransportError,
            "CHECKSUM_MISMATCH" => ErrorCode::ChecksumMismatch,
            "NOT_FOUND" => ErrorCode::NotFound,
            "SSE_FAILED" => ErrorCode::SseFailed,
            other => ErrorCode::Other(UnknownErrorCode(other.to_owned())),
        }
    }

    /// Whether this is one of the [`KNOWN`](Self::KNOWN) codes.
    pub fn is_known(&self) -> bool {
        !matches!(self, ErrorCode::Other(_))
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for ErrorCode {
    fn from(s: &str) -> Self {
        ErrorCode::from_wire(s)
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        Ok(ErrorCode::from_wire(&s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_code_round_trips_through_its_string() {
        for code in ErrorCode::KNOWN {
            assert!(code.is_known());
            assert_eq!(&ErrorCode::from_wire(code.as_str()), code, "{code}");
            let json = serde_json::to_string(code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            assert_eq!(&serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
        }
    }

    #[test]
    fn wire_strings_are_screaming_snake_case() {
        for code in ErrorCode::KNOWN {
            assert!(
                code.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b == b'_'),
                "{code}"
            );
        }
        assert_eq!(ErrorCode::WorkdirDenied.as_str(), "WORKDIR_DENIED");
        assert_eq!(ErrorCode::DepMissing.as_str(), "DEP_MISSING");
    }

    #[test]
    fn unknown_code_is_preserved() {
        let code: ErrorCode = serde_json::from_str("\"QUOTA_EXCEEDED\"").unwrap();
        assert!(!code.is_known());
        assert_eq!(code.as_str(), "QUOTA_EXCEEDED");
        assert_eq!(serde_json::to_string(&code).unwrap(), "\"QUOTA_EXCEEDED\"");
        // Case matters, as in the reference: a lowercase known code is just another code.
        assert!(!ErrorCode::from_wire("cancelled").is_known());
    }

    #[test]
    fn code_must_be_a_string() {
        assert!(serde_json::from_str::<ErrorCode>("404").is_err());
    }
}
