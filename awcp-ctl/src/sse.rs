//! A small Server-Sent Events reader over a `reqwest` byte stream.
//!
//! Reads `id:` and `data:` lines, one event per blank line, and ignores comments and
//! unknown fields, as the SSE specification says. Lines are bounded so a misbehaving peer
//! cannot grow memory without limit.

use futures::StreamExt;

/// Longest accepted line (a snapshot event can be large, so this is generous).
const MAX_LINE: usize = 512 << 20;

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `id:` field, if any.
    pub id: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
}

/// Why the stream could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SseError {
    /// The connection failed.
    #[error("the event stream broke")]
    Http {
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// A line was longer than allowed.
    #[error("an event stream line exceeded {MAX_LINE} bytes")]
    LineTooLong,
}

/// Incremental reader.
pub struct SseReader {
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: Vec<u8>,
    id: Option<String>,
    data: Vec<String>,
}

impl std::fmt::Debug for SseReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseReader").finish_non_exhaustive()
    }
}

impl SseReader {
    /// Read events from a response body.
    pub fn new(resp: reqwest::Response) -> Self {
        SseReader {
            stream: resp.bytes_stream().boxed(),
            buf: Vec::new(),
            id: None,
            data: Vec::new(),
        }
    }

    /// The next event, or `None` at the end of the stream.
    pub async fn next(&mut self) -> Result<Option<SseEvent>, SseError> {
        loop {
            while let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=pos).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                let line = String::from_utf8_lossy(&line).into_owned();
                if line.is_empty() {
                    if !self.data.is_empty() {
                        let ev = SseEvent {
                            id: self.id.clone(),
                            data: self.data.join("\n"),
                        };
                        self.data.clear();
                        return Ok(Some(ev));
                    }
                    continue;
                }
                if line.starts_with(':') {
                    continue;
                }
                let (field, value) = match line.split_once(':') {
                    Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                    None => (line.as_str(), ""),
                };
                match field {
                    "data" => self.data.push(value.to_string()),
                    "id" => self.id = Some(value.to_string()),
                    _ => {}
                }
            }
            if self.buf.len() > MAX_LINE {
                return Err(SseError::LineTooLong);
            }
            match self.stream.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(source)) => return Err(SseError::Http { source }),
                None => {
                    if !self.data.is_empty() {
                        let ev = SseEvent {
                            id: self.id.clone(),
                            data: self.data.join("\n"),
                        };
                        self.data.clear();
                        return Ok(Some(ev));
                    }
                    return Ok(None);
                }
            }
        }
    }
}
