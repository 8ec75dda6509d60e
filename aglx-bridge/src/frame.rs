//! The AGLX frame: what it holds, and how it is written.
//!
//! A frame is a start line, header lines, a blank line and an optional UTF-8 JSON body:
//!
//! ```text
//! AGLX/1.0 TCP\r\n
//! FROM: agent://alpha.local\r\n
//! TYPE: status.report\r\n
//! CONTENT-LENGTH: 2\r\n
//! \r\n
//! {}
//! ```
//!
//! [`Frame::encode`] writes headers in a fixed order with `\r\n` line ends and computes
//! `CONTENT-LENGTH` itself, so an encoded frame always decodes to the same [`Frame`]
//! (`decode(encode(f)) == f`). Header values are validated on the way out as strictly as on
//! the way in: a value with CR, LF, NUL or another control character cannot be written, so
//! nothing a peer sent can be smuggled into a frame we write.

use std::fmt;
use std::str::FromStr;

use crate::error::FrameError;
use crate::uri::{AgentUri, Recipient};

/// The protocol major version this implementation speaks.
pub const MAJOR: u16 = 1;
/// The minor version this implementation writes.
pub const MINOR: u16 = 0;
/// The only content type accepted.
pub const JSON: &str = "application/json";

/// The transport named in the start line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Connection-oriented, for everything.
    Tcp,
    /// Datagrams, for `agent.announce` only.
    Udp,
}

impl Transport {
    /// The token in the start line.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "TCP",
            Transport::Udp => "UDP",
        }
    }
}

/// The message type (`TYPE` header).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MessageType {
    /// Assigns a task to an agent.
    TaskAssign,
    /// A task's result or final status.
    TaskResult,
    /// Periodic state report; also carries `STATUS` answers from the bridge.
    StatusReport,
    /// Moves credits between agents.
    CreditTransfer,
    /// An agent describes itself (UDP or TCP).
    AgentAnnounce,
    /// Registry synchronisation (register over TCP, or list the registry).
    RegistryUpdate,
    /// Mentoring or rating.
    MentorFeedback,
    /// The first frame of a TCP connection.
    Handshake,
    /// The answer to `handshake` (`STATUS: 100`).
    HandshakeAck,
    /// A type this side does not know (lowercase letters, digits, `.`, `-`, `_`).
    Other(String),
}

impl MessageType {
    /// The wire name.
    pub fn as_str(&self) -> &str {
        match self {
            MessageType::TaskAssign => "task.assign",
            MessageType::TaskResult => "task.result",
            MessageType::StatusReport => "status.report",
            MessageType::CreditTransfer => "credit.transfer",
            MessageType::AgentAnnounce => "agent.announce",
            MessageType::RegistryUpdate => "registry.update",
            MessageType::MentorFeedback => "mentor.feedback",
            MessageType::Handshake => "handshake",
            MessageType::HandshakeAck => "handshake.ack",
            MessageType::Other(s) => s,
        }
    }

    /// Whether frames of this type carry task data or credits, which must travel over TCP
    /// and must be signed when the sender's zone has a key.
    pub fn is_sensitive(&self) -> bool {
        matches!(
            self,
            MessageType::TaskAssign | MessageType::TaskResult | MessageType::CreditTransfer
        )
    }
}

impl FromStr for MessageType {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        Ok(match s {
            "task.assign" => MessageType::TaskAssign,
            "task.result" => MessageType::TaskResult,
            "status.report" => MessageType::StatusReport,
            "credit.transfer" => MessageType::CreditTransfer,
            "agent.announce" => MessageType::AgentAnnounce,
            "registry.update" => MessageType::RegistryUpdate,
            "mentor.feedback" => MessageType::MentorFeedback,
            "handshake" => MessageType::Handshake,
            "handshake.ack" => MessageType::HandshakeAck,
            other
                if !other.is_empty()
                    && other.len() <= 64
                    && other.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b)
                    }) =>
            {
                MessageType::Other(other.to_string())
            }
            _ => return Err(()),
        })
    }
}

impl fmt::Display for MessageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Status codes (`STATUS` header), with the seed's meanings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// 100: connection established, ready to receive (answers `handshake`).
    Continue,
    /// 200: task accepted or done; frame delivered.
    Ok,
    /// 400: malformed message.
    BadRequest,
    /// 401: authentication required (or failed).
    Unauthorized,
    /// 404: target agent not reachable.
    AgentNotFound,
    /// 500: internal processing error (also: the bridge is full).
    InternalError,
}

impl Status {
    /// The numeric code.
    pub fn code(self) -> u16 {
        match self {
            Status::Continue => 100,
            Status::Ok => 200,
            Status::BadRequest => 400,
            Status::Unauthorized => 401,
            Status::AgentNotFound => 404,
            Status::InternalError => 500,
        }
    }

    /// The code for a number, if it is one of the six.
    pub fn from_code(code: u16) -> Option<Self> {
        Some(match code {
            100 => Status::Continue,
            200 => Status::Ok,
            400 => Status::BadRequest,
            401 => Status::Unauthorized,
            404 => Status::AgentNotFound,
            500 => Status::InternalError,
            _ => return None,
        })
    }

    /// The seed's short meaning.
    pub fn reason(self) -> &'static str {
        match self {
            Status::Continue => "Continue",
            Status::Ok => "OK",
            Status::BadRequest => "Bad Request",
            Status::Unauthorized => "Unauthorized",
            Status::AgentNotFound => "Agent Not Found",
            Status::InternalError => "Internal Error",
        }
    }
}

/// One AGLX frame. `CONTENT-LENGTH` is not a field: it is computed on encode and checked on
/// decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The minor version from the start line (the major is always [`MAJOR`]).
    pub minor: u16,
    /// `TCP` or `UDP`.
    pub transport: Transport,
    /// `FROM`.
    pub from: Option<AgentUri>,
    /// `TO`.
    pub to: Option<Recipient>,
    /// `TYPE`.
    pub msg_type: Option<MessageType>,
    /// `CREDITS`: a non-negative integer.
    pub credits: Option<u64>,
    /// Whether `CONTENT-TYPE: application/json` is written (the only value accepted).
    pub content_type_json: bool,
    /// `STATUS`.
    pub status: Option<Status>,
    /// `TIMESTAMP`: Unix seconds.
    pub timestamp: Option<u64>,
    /// `NONCE`: 16 to 64 characters of `[A-Za-z0-9_-]`.
    pub nonce: Option<String>,
    /// `SIGNATURE`: 64 lowercase hex digits (HMAC-SHA256), always the last header.
    pub signature: Option<String>,
    /// Headers this side does not know, in order, names upper-cased.
    pub extensions: Vec<(String, String)>,
    /// The body: empty, or UTF-8 JSON.
    pub body: String,
}

impl Frame {
    /// A frame of the given transport and type, with nothing else set.
    pub fn new(transport: Transport, msg_type: MessageType) -> Self {
        Frame {
            minor: MINOR,
            transport,
            from: None,
            to: None,
            msg_type: Some(msg_type),
            credits: None,
            content_type_json: false,
            status: None,
            timestamp: None,
            nonce: None,
            signature: None,
            extensions: Vec::new(),
            body: String::new(),
        }
    }

    /// Sets `FROM`.
    pub fn from(mut self, from: AgentUri) -> Self {
        self.from = Some(from);
        self
    }

    /// Sets `TO`.
    pub fn to(mut self, to: Recipient) -> Self {
        self.to = Some(to);
        self
    }

    /// Sets `STATUS`.
    pub fn status(mut self, status: Status) -> Self {
        self.status = Some(status);
        self
    }

    /// Sets `CREDITS`.
    pub fn credits(mut self, credits: u64) -> Self {
        self.credits = Some(credits);
        self
    }

    /// Sets the body to the JSON of `value` and `CONTENT-TYPE` to JSON.
    pub fn json<T: serde::Serialize>(mut self, value: &T) -> Self {
        // Serialising our own plain data types to a string cannot fail.
        self.body = serde_json::to_string(value).unwrap_or_else(|_| "null".into());
        self.content_type_json = true;
        self
    }

    /// The body parsed as `T`, if it is.
    pub fn body_as<T: serde::de::DeserializeOwned>(&self) -> Option<T> {
        serde_json::from_str(&self.body).ok()
    }

    /// Writes the frame. Fails if a header value could not be read back (CR, LF, NUL, other
    /// control characters, or a value its header does not allow), or if the body is not JSON.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        let mut out = self.encode_unsigned_head()?;
        if let Some(sig) = &self.signature {
            check_signature_value(sig)?;
            push_header(&mut out, "SIGNATURE", sig);
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(self.body.as_bytes());
        Ok(out)
    }

    /// The header lines up to, not including, `SIGNATURE` and the blank line. Signing appends
    /// the blank line and the body to this to get the bytes the MAC covers.
    pub(crate) fn encode_unsigned_head(&self) -> Result<Vec<u8>, FrameError> {
        if !self.body.is_empty() && !is_json(&self.body) {
            return Err(FrameError::BadBody);
        }
        let mut out = Vec::with_capacity(128 + self.body.len());
        out.extend_from_slice(
            format!(
                "AGLX/{MAJOR}.{} {}\r\n",
                self.minor,
                self.transport.as_str()
            )
            .as_bytes(),
        );
        if let Some(v) = &self.from {
            push_header(&mut out, "FROM", &v.to_string());
        }
        if let Some(v) = &self.to {
            push_header(&mut out, "TO", &v.to_string());
        }
        if let Some(v) = &self.msg_type {
            if v.as_str().parse::<MessageType>().is_err() {
                return Err(bad_value("TYPE"));
            }
            push_header(&mut out, "TYPE", v.as_str());
        }
        if let Some(v) = self.credits {
            push_header(&mut out, "CREDITS", &v.to_string());
        }
        if self.content_type_json {
            push_header(&mut out, "CONTENT-TYPE", JSON);
        }
        if !self.body.is_empty() {
            push_header(&mut out, "CONTENT-LENGTH", &self.body.len().to_string());
        }
        if let Some(v) = self.status {
            push_header(&mut out, "STATUS", &v.code().to_string());
        }
        if let Some(v) = self.timestamp {
            push_header(&mut out, "TIMESTAMP", &v.to_string());
        }
        if let Some(v) = &self.nonce {
            check_nonce(v)?;
            push_header(&mut out, "NONCE", v);
        }
        for (name, value) in &self.extensions {
            let upper = name.to_ascii_uppercase();
            if !valid_header_name(name) || KNOWN.contains(&upper.as_str()) {
                return Err(FrameError::BadHeaderLine { line: 0 });
            }
            check_plain_value(&upper, value)?;
            push_header(&mut out, &upper, value);
        }
        Ok(out)
    }
}

/// The header names this side knows (everything else is an extension).
pub(crate) const KNOWN: [&str; 10] = [
    "FROM",
    "TO",
    "TYPE",
    "CREDITS",
    "CONTENT-TYPE",
    "CONTENT-LENGTH",
    "STATUS",
    "TIMESTAMP",
    "NONCE",
    "SIGNATURE",
];

fn push_header(out: &mut Vec<u8>, name: &str, value: &str) {
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\r\n");
}

pub(crate) fn bad_value(name: &str) -> FrameError {
    FrameError::BadHeaderValue {
        name: name.to_string(),
    }
}

/// Header names: 1 to 64 of `[A-Za-z0-9-]`.
pub(crate) fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// A free-text header value: non-empty, no control characters other than tab, no leading or
/// trailing whitespace (it would not survive a round trip).
pub(crate) fn check_plain_value(name: &str, value: &str) -> Result<(), FrameError> {
    let ok = !value.is_empty()
        && value.trim_matches([' ', '\t']) == value
        && !value.chars().any(|c| c.is_control() && c != '\t');
    if ok { Ok(()) } else { Err(bad_value(name)) }
}

pub(crate) fn check_nonce(v: &str) -> Result<(), FrameError> {
    let ok = (16..=64).contains(&v.len())
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok { Ok(()) } else { Err(bad_value("NONCE")) }
}

pub(crate) fn check_signature_value(v: &str) -> Result<(), FrameError> {
    let ok = v.len() == 64
        && v.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if ok {
        Ok(())
    } else {
        Err(bad_value("SIGNATURE"))
    }
}

pub(crate) fn is_json(body: &str) -> bool {
    serde_json::from_str::<serde::de::IgnoredAny>(body).is_ok()
}
