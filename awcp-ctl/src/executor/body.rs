//! Reading a message body without letting an unknown caller make the Executor buffer it.
//!
//! Every body is held to `small_body_bytes` (1 MiB) — enough for any INVITE, CONTINUE,
//! CLOSE, ERROR, or an `awcpfs` START. Only a START that carries a workspace (`archive`)
//! is larger, so a larger body is read on only when
//!
//! * it carries the Executor's credential as `Authorization: Bearer` (our daemon sends it),
//!   or
//! * its first bytes name (`"delegationId"`) a delegation that an INVITE created and that
//!   is waiting for its START — the id, unguessable and known only to the Delegator whose
//!   INVITE was accepted, is the proof a reference Delegator's START can give;
//!
//! and then only one at a time, up to `max_body_bytes`. The message must then turn out to
//! be that delegation's START. Anything else gets 413 as soon as it is known: from
//! `Content-Length` before a byte is read, else once the small limit is passed.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use futures::StreamExt as _;

use awcp_protocol::AssignmentState;

use super::Executor;
use super::routes::fail;

/// How long a large body waits for the one being read before it.
const LARGE_WAIT: Duration = Duration::from_secs(60);

/// A body read whole.
pub(crate) struct Read {
    /// The bytes.
    pub(crate) bytes: Bytes,
    /// Larger than the small limit, let in because it named this waiting delegation
    /// (`None`: small, or let in by the credential).
    pub(crate) large_for: Option<String>,
}

/// Read `body` within the limits above.
pub(crate) async fn read(
    ex: &Arc<Executor>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Read, Response> {
    let small = ex.cfg.small_body_bytes;
    let max = ex.cfg.max_body_bytes.max(small);
    let credential = ex
        .cfg
        .token
        .as_deref()
        .zip(crate::bearer(headers))
        .is_some_and(|(t, b)| crate::same_secret(b, t));
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared
        && n > max as u64
    {
        return Err(too_large(max, "--max-body"));
    }
    // Larger than small, without the credential, and no START awaited at all: no such
    // body can be let in, so it is refused before a byte of it is read.
    if declared.is_some_and(|n| n > small as u64) && !credential && !any_awaits_start(ex) {
        return Err(too_large(small, "the small-body limit"));
    }
    let mut stream = body.into_data_stream();
    let mut buf: Vec<u8> = Vec::with_capacity(declared.map_or(0, |n| n.min(small as u64) as usize));
    let mut limit = small;
    let mut large_for = None;
    let mut _permit = None;
    let mut _receiving = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            fail(
                StatusCode::BAD_REQUEST,
                format!("reading the request body failed: {e}"),
            )
        })?;
        if buf.len() + chunk.len() > limit {
            if limit == max {
                return Err(too_large(max, "--max-body"));
            }
            // Past the small limit: only a START for a waiting delegation goes on.
            let take = limit - buf.len();
            buf.extend_from_slice(&chunk[..take]);
            let rest = chunk.slice(take..);
            let named = named_id(&buf).filter(|id| awaits_start(ex, id));
            if let Some(id) = &named {
                _receiving = Some(Receiving::new(ex, id));
            }
            if !credential && named.is_none() {
                tracing::warn!(
                    bytes = buf.len(),
                    "refused a large body that is no START awaited"
                );
                return Err(too_large(small, "the small-body limit"));
            }
            let permit = tokio::time::timeout(LARGE_WAIT, ex.large_body.acquire())
                .await
                .ok()
                .and_then(Result::ok)
                .ok_or_else(|| {
                    fail(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "another large START is being received; send this one again shortly",
                    )
                })?;
            _permit = Some(permit);
            if !credential {
                large_for = named;
            }
            limit = max;
            if buf.len() + rest.len() > limit {
                return Err(too_large(max, "--max-body"));
            }
            buf.extend_from_slice(&rest);
            continue;
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Read {
        bytes: Bytes::from(buf),
        large_for,
    })
}

/// While alive, delegation `id` is receiving its START and does not expire.
struct Receiving {
    ex: Arc<Executor>,
    id: String,
}

impl Receiving {
    fn new(ex: &Arc<Executor>, id: &str) -> Receiving {
        ex.receiving.lock().insert(id.to_owned());
        Receiving {
            ex: ex.clone(),
            id: id.to_owned(),
        }
    }
}

impl Drop for Receiving {
    fn drop(&mut self) {
        self.ex.receiving.lock().remove(&self.id);
    }
}

/// 413, saying what may be larger.
fn too_large(limit: usize, which: &str) -> Response {
    fail(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "request body larger than {limit} bytes ({which}): only a START for a delegation \
             this Executor accepted and that awaits its START may be larger (up to the \
             Executor's --max-body); see TROUBLESHOOTING.md"
        ),
    )
}

/// Whether any accepted INVITE waits for its START.
fn any_awaits_start(ex: &Executor) -> bool {
    ex.tasks
        .lock()
        .values()
        .any(|a| *a.state.lock() == AssignmentState::Pending)
}

/// Whether `id` names an accepted INVITE waiting for START.
fn awaits_start(ex: &Executor, id: &str) -> bool {
    ex.tasks
        .lock()
        .get(id)
        .is_some_and(|a| *a.state.lock() == AssignmentState::Pending)
}

/// The value of the first `"delegationId"` member in the first bytes of a JSON message
/// (the reference and our daemon write it third, after `version` and `type`).
fn named_id(prefix: &[u8]) -> Option<String> {
    const KEY: &[u8] = b"\"delegationId\"";
    let at = prefix.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    let rest = &prefix[at..];
    let rest = rest
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let rest = rest.strip_prefix(b"\"")?;
    let end = rest.iter().position(|b| *b == b'"')?;
    let id = std::str::from_utf8(&rest[..end]).ok()?;
    awcp_protocol::DelegationId::parse(id).ok()?;
    Some(id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_named_id_is_found_in_the_first_bytes() {
        let id = "dlg_3f2a9c1e5b7d4e6f8a0b1c2d3e4f5a6b";
        let msg =
            format!(r#"{{"version":"1","type":"START","delegationId" : "{id}","lease":{{}}}}"#);
        assert_eq!(named_id(msg.as_bytes()).as_deref(), Some(id));
        assert_eq!(named_id(br#"{"delegationId":"dlg_x"}"#), None);
        assert_eq!(named_id(br#"{"type":"START"}"#), None);
        assert_eq!(named_id(b"\x00\xff junk"), None);
    }
}
