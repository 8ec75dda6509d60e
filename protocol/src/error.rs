//! The crate's error type.
//!
//! Parsing a peer's JSON can fail in a handful of ways that a server answers differently
//! (or at least explains differently): the bytes are not JSON, the JSON is not an object, the
//! `type` is one we do not know, the `version` is not ours, a required field is missing, or a
//! field has the wrong shape. [`ProtocolError`] keeps those apart so an HTTP handler can turn
//! any of them into a `400` whose message says exactly what was wrong, and so a client reading
//! an SSE stream can skip an event of an unknown `type` from a newer peer instead of giving up.

use std::fmt;

use thiserror::Error;

/// Everything that can go wrong turning bytes from a peer into AWCP types.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The input is not JSON: a syntax error, or the input ended early.
    #[error("malformed JSON at line {line}, column {column}")]
    MalformedJson {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// The JSON parser's own description.
        #[source]
        source: serde_json::Error,
    },

    /// The input is JSON, but not an object.
    #[error("expected a JSON object, found {found}")]
    NotAnObject {
        /// The JSON kind that was found instead (`array`, `string`, ...).
        found: &'static str,
    },

    /// The discriminating field (`type` or `transport`) names something we do not know.
    #[error("unknown {what} type `{received}`")]
    UnknownType {
        /// What was being parsed: `message`, `event` or `transport handle`.
        what: &'static str,
        /// The value of the discriminating field, as received (JSON text if not a string).
        received: String,
    },

    /// The message's `version` is not [`PROTOCOL_VERSION`](crate::PROTOCOL_VERSION).
    #[error("unsupported protocol version {received} (this implementation speaks \"1\")")]
    UnsupportedVersion {
        /// The `version` value as received, as JSON text (so `"2"` and `2` stay distinct).
        received: String,
    },

    /// A required field is absent.
    #[error("missing field `{field}` in {context}")]
    MissingField {
        /// What was being parsed, e.g. `INVITE message` or `snapshot event`.
        context: String,
        /// The missing field's wire name (camelCase). For a nested object, the innermost name.
        field: String,
    },

    /// A field is present but has the wrong type or an unknown value.
    #[error("invalid {context}")]
    InvalidField {
        /// What was being parsed, e.g. `START message`.
        context: String,
        /// The deserializer's description of the offending value.
        #[source]
        source: serde_json::Error,
    },

    /// A delegation id does not have the form `dlg_` + 32 lowercase hex digits.
    #[error("invalid delegation id {value:?}: {defect}")]
    InvalidDelegationId {
        /// The rejected value.
        value: String,
        /// What is wrong with it.
        defect: IdDefect,
    },
}

/// What is wrong with a rejected delegation id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdDefect {
    /// It does not start with `dlg_`.
    MissingPrefix,
    /// The part after `dlg_` is not 32 characters long.
    WrongLength {
        /// Length of the part after the prefix, in bytes.
        found: usize,
    },
    /// A character after `dlg_` is not one of `0-9a-f`.
    NotLowercaseHex {
        /// Byte offset of the first bad character, counted from the start of the id.
        position: usize,
    },
}

impl fmt::Display for IdDefect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdDefect::MissingPrefix => f.write_str("it does not start with `dlg_`"),
            IdDefect::WrongLength { found } => {
                write!(
                    f,
                    "expected 32 hex digits after `dlg_`, found {found} characters"
                )
            }
            IdDefect::NotLowercaseHex { position } => {
                write!(
                    f,
                    "character at offset {position} is not a lowercase hex digit"
                )
            }
        }
    }
}

impl ProtocolError {
    /// Whether a client should skip the offending item rather than fail: true only for an
    /// unknown `type`, which is what a newer peer sends when it adds a message or event kind.
    pub fn is_unknown_type(&self) -> bool {
        matches!(self, ProtocolError::UnknownType { .. })
    }
}
