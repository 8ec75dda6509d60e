//! The errors of the frame codec and of the security checks.
//!
//! Every error maps to one AGLX status code ([`FrameError::status`], [`AuthError::status`]),
//! which is what a peer sees in the error frame before the connection closes.

use crate::frame::Status;

/// A frame could not be decoded, or a frame could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A line (start line or header line) is longer than the configured limit.
    #[error("line longer than {limit} bytes")]
    LineTooLong {
        /// The configured maximum, in bytes, without the line terminator.
        limit: usize,
    },
    /// The header block (start line through blank line) is larger than the limit.
    #[error("header block larger than {limit} bytes")]
    HeaderBlockTooLarge {
        /// The configured maximum, in bytes.
        limit: usize,
    },
    /// More header lines than the limit.
    #[error("more than {limit} header lines")]
    TooManyHeaders {
        /// The configured maximum number of header lines.
        limit: usize,
    },
    /// The body is larger than the limit (declared or actual).
    #[error("body of {size} bytes is larger than the limit of {limit} bytes")]
    BodyTooLarge {
        /// The declared or actual size of the body.
        size: u64,
        /// The configured maximum, in bytes.
        limit: usize,
    },
    /// The start line is not `AGLX/<major>.<minor> TCP|UDP`.
    #[error("malformed start line (expected `AGLX/1.0 TCP` or `AGLX/1.0 UDP`)")]
    BadStartLine,
    /// The major version is not one this implementation speaks.
    #[error("unsupported protocol version {major}.{minor} (this side speaks 1.x)")]
    UnsupportedVersion {
        /// The major version the peer sent.
        major: u16,
        /// The minor version the peer sent.
        minor: u16,
    },
    /// The start line names a different transport than the one the frame arrived on.
    #[error("frame says {found} but arrived over {expected}")]
    WrongTransport {
        /// The transport the frame arrived on.
        expected: &'static str,
        /// The transport named in the start line.
        found: &'static str,
    },
    /// A header line is not `NAME: value`.
    #[error("malformed header line {line}")]
    BadHeaderLine {
        /// The 1-based line number within the frame.
        line: usize,
    },
    /// A header appears twice.
    #[error("duplicate header {name}")]
    DuplicateHeader {
        /// The (upper-cased) header name.
        name: String,
    },
    /// A header value contains a forbidden byte (CR, LF, NUL or another control character),
    /// is empty, or is not valid for its header.
    #[error("invalid value for header {name}")]
    BadHeaderValue {
        /// The (upper-cased) header name.
        name: String,
    },
    /// A TCP frame carries a body but no `CONTENT-LENGTH`, or the declared length does not
    /// match the body of a datagram.
    #[error("CONTENT-LENGTH missing or does not match the body")]
    ContentLength,
    /// A carriage return appears somewhere other than right before a line feed.
    #[error("bare carriage return in the header block")]
    BareCarriageReturn,
    /// The body is not UTF-8 JSON.
    #[error("body is not UTF-8 JSON")]
    BadBody,
    /// `CONTENT-TYPE` is something other than `application/json`.
    #[error("unsupported CONTENT-TYPE (only application/json)")]
    UnsupportedContentType,
    /// A datagram ended before the blank line that closes the header block.
    #[error("datagram ends inside the header block")]
    Truncated,
}

impl FrameError {
    /// The status code a peer receives for this error.
    pub fn status(&self) -> Status {
        // Every decoding problem is the peer's fault: 400. Kept exhaustive so a new variant
        // has to decide.
        match self {
            FrameError::LineTooLong { .. }
            | FrameError::HeaderBlockTooLarge { .. }
            | FrameError::TooManyHeaders { .. }
            | FrameError::BodyTooLarge { .. }
            | FrameError::BadStartLine
            | FrameError::UnsupportedVersion { .. }
            | FrameError::WrongTransport { .. }
            | FrameError::BadHeaderLine { .. }
            | FrameError::DuplicateHeader { .. }
            | FrameError::BadHeaderValue { .. }
            | FrameError::ContentLength
            | FrameError::BareCarriageReturn
            | FrameError::BadBody
            | FrameError::UnsupportedContentType
            | FrameError::Truncated => Status::BadRequest,
        }
    }
}

/// A frame failed the signature or replay checks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The frame must be signed (a key is configured for the sender's zone and the frame
    /// carries credits or task data) but has no `SIGNATURE`.
    #[error("{msg_type} frames must be signed in trust zone {zone}")]
    SignatureRequired {
        /// The frame's TYPE.
        msg_type: String,
        /// The sender's trust zone.
        zone: String,
    },
    /// The frame is signed but no key is configured for the sender's zone.
    #[error("no key for trust zone {zone}")]
    UnknownZone {
        /// The sender's trust zone (the domain of `FROM`).
        zone: String,
    },
    /// The signature does not match the frame.
    #[error("signature does not match")]
    BadSignature,
    /// A signed frame without `FROM`, `TIMESTAMP` or `NONCE`.
    #[error("signed frames need FROM, TIMESTAMP and NONCE")]
    MissingFields,
    /// `TIMESTAMP` is outside the accepted window around the receiver's clock.
    #[error("timestamp {timestamp} is outside the replay window")]
    Stale {
        /// The frame's timestamp (Unix seconds).
        timestamp: u64,
    },
    /// The nonce was seen before within the window.
    #[error("nonce was already used (replayed frame)")]
    Replayed,
}

impl AuthError {
    /// The status code a peer receives for this error.
    pub fn status(&self) -> Status {
        match self {
            AuthError::SignatureRequired { .. }
            | AuthError::UnknownZone { .. }
            | AuthError::BadSignature
            | AuthError::MissingFields
            | AuthError::Stale { .. }
            | AuthError::Replayed => Status::Unauthorized,
        }
    }
}
