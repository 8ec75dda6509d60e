//! Reading frames: a strict decoder for byte streams (TCP) and datagrams (UDP).
//!
//! The rules, in the order they are checked:
//!
//! * Lines end in `\n` or `\r\n`; a `\r` anywhere else in the header block is refused.
//! * Every line, the whole header block (start line through blank line), the number of header
//!   lines and the body are bounded by [`Limits`]. A stream decoder refuses as soon as a limit
//!   is crossed, without waiting for the rest of the frame.
//! * The start line is exactly `AGLX/<major>.<minor> TCP|UDP` (one space, digits without
//!   leading zeros); a major other than 1 is refused, and the transport must be the one the
//!   frame arrived on.
//! * Header lines are `NAME: value`: the name is `[A-Za-z0-9-]+` directly followed by `:`
//!   (no whitespace before it, no folded lines), names are case-insensitive, every header may
//!   appear once. Values are UTF-8 with no control characters other than tab; spaces and tabs
//!   around the value are dropped.
//! * `CONTENT-LENGTH` is digits only, no leading zeros. A TCP frame with a body must carry it
//!   (the frame ends at the blank line otherwise); a datagram's body is the rest of the
//!   datagram and a `CONTENT-LENGTH`, if present, must match it exactly.
//! * The body, if any, is UTF-8 JSON; `CONTENT-TYPE`, if present, is `application/json`.

use std::ops::Range;

use crate::error::FrameError;
use crate::frame::{
    self, Frame, KNOWN, MAJOR, MessageType, Status, Transport, bad_value, check_nonce,
    check_plain_value, check_signature_value, valid_header_name,
};
use crate::uri::{AgentUri, Recipient};

/// Bounds on what a decoder accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest line, in bytes, without its terminator.
    pub max_line: usize,
    /// Most header lines (not counting the start line).
    pub max_headers: usize,
    /// Largest header block, start line through blank line, in bytes.
    pub max_header_block: usize,
    /// Largest body, in bytes.
    pub max_body: usize,
}

impl Limits {
    /// Defaults for TCP: 1 KiB lines, 32 headers, 8 KiB header block, 1 MiB body.
    pub const TCP: Limits = Limits {
        max_line: 1024,
        max_headers: 32,
        max_header_block: 8 * 1024,
        max_body: 1024 * 1024,
    };

    /// Defaults for UDP: the whole datagram fits in 1400 bytes (one Ethernet frame).
    pub const UDP: Limits = Limits {
        max_line: 512,
        max_headers: 16,
        max_header_block: 1400,
        max_body: 1400,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::TCP
    }
}

/// A decoded frame, with where it lay in the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// The frame.
    pub frame: Frame,
    /// How many bytes of the input the frame took.
    pub len: usize,
    /// Where the `SIGNATURE` line (with its terminator) lay, if the frame is signed. The MAC
    /// covers the frame's bytes without this range.
    pub signature_line: Option<Range<usize>>,
}

/// Decodes one frame from the front of a TCP byte stream. `Ok(None)` means the input holds
/// the beginning of a valid frame and more bytes are needed; errors are reported as soon as
/// the bytes so far cannot start a valid frame.
pub fn decode_stream(buf: &[u8], limits: &Limits) -> Result<Option<Decoded>, FrameError> {
    decode(buf, limits, Transport::Tcp)
}

/// Decodes a datagram, which must hold exactly one frame.
pub fn decode_datagram(buf: &[u8], limits: &Limits) -> Result<Decoded, FrameError> {
    decode(buf, limits, Transport::Udp)?.ok_or(FrameError::Truncated)
}

fn decode(buf: &[u8], limits: &Limits, on: Transport) -> Result<Option<Decoded>, FrameError> {
    let mut pos = 0;
    let mut line_no = 0;
    let mut head = Head::default();
    let mut frame: Option<Frame> = None;
    let mut signature_line = None;
    loop {
        // Find the next line within the limits.
        let window_end = buf.len().min(pos + limits.max_line + 2);
        let Some(nl) = buf[pos..window_end].iter().position(|&b| b == b'\n') else {
            if buf.len() - pos > limits.max_line + 1 {
                return Err(FrameError::LineTooLong {
                    limit: limits.max_line,
                });
            }
            if buf.len() > limits.max_header_block {
                return Err(FrameError::HeaderBlockTooLarge {
                    limit: limits.max_header_block,
                });
            }
            check_partial_line(&buf[pos..])?;
            return match on {
                Transport::Tcp => Ok(None),
                Transport::Udp => Err(FrameError::Truncated),
            };
        };
        let line_start = pos;
        let mut line = &buf[pos..pos + nl];
        pos += nl + 1;
        if let Some(stripped) = line.strip_suffix(b"\r") {
            line = stripped;
        }
        if line.len() > limits.max_line {
            return Err(FrameError::LineTooLong {
                limit: limits.max_line,
            });
        }
        if pos > limits.max_header_block {
            return Err(FrameError::HeaderBlockTooLarge {
                limit: limits.max_header_block,
            });
        }
        if line.contains(&b'\r') {
            return Err(FrameError::BareCarriageReturn);
        }
        line_no += 1;
        let Some(f) = frame.as_mut() else {
            frame = Some(parse_start_line(line, on)?);
            continue;
        };
        if line.is_empty() {
            break;
        }
        if signature_line.is_some() {
            // SIGNATURE must be the last header: the MAC covers everything but its line.
            return Err(FrameError::BadHeaderLine { line: line_no });
        }
        if line_no - 1 > limits.max_headers {
            return Err(FrameError::TooManyHeaders {
                limit: limits.max_headers,
            });
        }
        let is_sig = parse_header(line, line_no, f, &mut head)?;
        if is_sig {
            signature_line = Some(line_start..pos);
        }
    }
    let mut frame = frame.ok_or(FrameError::BadStartLine)?;
    let body_start = pos;
    let body_len = match (on, head.content_length) {
        (_, Some(n)) if n > limits.max_body as u64 => {
            return Err(FrameError::BodyTooLarge {
                size: n,
                limit: limits.max_body,
            });
        }
        (Transport::Tcp, Some(n)) => n as usize,
        (Transport::Tcp, None) => 0,
        (Transport::Udp, declared) => {
            let rest = buf.len() - body_start;
            if rest > limits.max_body {
                return Err(FrameError::BodyTooLarge {
                    size: rest as u64,
                    limit: limits.max_body,
                });
            }
            if declared.is_some_and(|n| n != rest as u64) {
                return Err(FrameError::ContentLength);
            }
            rest
        }
    };
    if buf.len() - body_start < body_len {
        return Ok(None);
    }
    let body = &buf[body_start..body_start + body_len];
    if !body.is_empty() {
        let text = std::str::from_utf8(body).map_err(|_| FrameError::BadBody)?;
        if !frame::is_json(text) {
            return Err(FrameError::BadBody);
        }
        frame.body = text.to_string();
    }
    Ok(Some(Decoded {
        frame,
        len: body_start + body_len,
        signature_line,
    }))
}

/// Checks that an unterminated line could still become valid, so garbage is refused early.
fn check_partial_line(partial: &[u8]) -> Result<(), FrameError> {
    match partial.iter().position(|&b| b == b'\r') {
        Some(i) if i + 1 < partial.len() => Err(FrameError::BareCarriageReturn),
        _ => Ok(()),
    }
}

#[derive(Default)]
struct Head {
    seen: Vec<String>,
    content_length: Option<u64>,
}

fn parse_start_line(line: &[u8], on: Transport) -> Result<Frame, FrameError> {
    let rest = line
        .strip_prefix(b"AGLX/")
        .ok_or(FrameError::BadStartLine)?;
    let rest = std::str::from_utf8(rest).map_err(|_| FrameError::BadStartLine)?;
    let (version, transport) = rest.split_once(' ').ok_or(FrameError::BadStartLine)?;
    let (major, minor) = version.split_once('.').ok_or(FrameError::BadStartLine)?;
    let major = parse_version_number(major)?;
    let minor = parse_version_number(minor)?;
    let transport = match transport {
        "TCP" => Transport::Tcp,
        "UDP" => Transport::Udp,
        _ => return Err(FrameError::BadStartLine),
    };
    if major != MAJOR {
        return Err(FrameError::UnsupportedVersion { major, minor });
    }
    if transport != on {
        return Err(FrameError::WrongTransport {
            expected: on.as_str(),
            found: transport.as_str(),
        });
    }
    let mut f = Frame::new(transport, MessageType::Handshake);
    f.msg_type = None;
    f.minor = minor;
    Ok(f)
}

fn parse_version_number(s: &str) -> Result<u16, FrameError> {
    if s.is_empty() || s.len() > 3 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(FrameError::BadStartLine);
    }
    if s.len() > 1 && s.starts_with('0') {
        return Err(FrameError::BadStartLine);
    }
    s.parse().map_err(|_| FrameError::BadStartLine)
}

/// Digits only, no sign, no leading zeros, at most 19 digits (fits in u64).
fn parse_number(name: &str, s: &str) -> Result<u64, FrameError> {
    let ok = !s.is_empty()
        && s.len() <= 19
        && s.bytes().all(|b| b.is_ascii_digit())
        && !(s.len() > 1 && s.starts_with('0'));
    if !ok {
        return Err(bad_value(name));
    }
    s.parse().map_err(|_| bad_value(name))
}

/// Parses one header line into the frame. Returns whether it was `SIGNATURE`.
fn parse_header(
    line: &[u8],
    line_no: usize,
    f: &mut Frame,
    head: &mut Head,
) -> Result<bool, FrameError> {
    let bad_line = || FrameError::BadHeaderLine { line: line_no };
    let colon = line.iter().position(|&b| b == b':').ok_or_else(bad_line)?;
    let name = std::str::from_utf8(&line[..colon]).map_err(|_| bad_line())?;
    if !valid_header_name(name) {
        return Err(bad_line());
    }
    let name = name.to_ascii_uppercase();
    let value = std::str::from_utf8(&line[colon + 1..]).map_err(|_| bad_value(&name))?;
    let value = value.trim_matches([' ', '\t']);
    check_plain_value(&name, value)?;
    if head.seen.contains(&name) {
        return Err(FrameError::DuplicateHeader { name });
    }
    head.seen.push(name.clone());
    let n = name.as_str();
    match n {
        "FROM" => f.from = Some(value.parse::<AgentUri>().map_err(|_| bad_value(n))?),
        "TO" => f.to = Some(value.parse::<Recipient>().map_err(|_| bad_value(n))?),
        "TYPE" => f.msg_type = Some(value.parse::<MessageType>().map_err(|_| bad_value(n))?),
        "CREDITS" => f.credits = Some(parse_number(n, value)?),
        "CONTENT-TYPE" => {
            if !value.eq_ignore_ascii_case(frame::JSON) {
                return Err(FrameError::UnsupportedContentType);
            }
            f.content_type_json = true;
        }
        "CONTENT-LENGTH" => {
            head.content_length =
                Some(parse_number(n, value).map_err(|_| FrameError::ContentLength)?);
        }
        "STATUS" => {
            let code = parse_number(n, value)?;
            let status = u16::try_from(code)
                .ok()
                .and_then(Status::from_code)
                .ok_or_else(|| bad_value(n))?;
            f.status = Some(status);
        }
        "TIMESTAMP" => f.timestamp = Some(parse_number(n, value)?),
        "NONCE" => {
            check_nonce(value)?;
            f.nonce = Some(value.to_string());
        }
        "SIGNATURE" => {
            check_signature_value(value)?;
            f.signature = Some(value.to_string());
            return Ok(true);
        }
        _ => {
            debug_assert!(!KNOWN.contains(&n));
            f.extensions.push((name.clone(), value.to_string()));
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests;
