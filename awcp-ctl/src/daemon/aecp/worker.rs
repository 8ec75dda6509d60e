//! The worker channel: a worker's agent asks the daemon through its own mount.
//!
//! The agent connects to `$AECP_SOCKET` (its mount's socket, in its private directory) and
//! sends a request line; the mount forwards it to its export with the mount's own
//! credential (the export token of this delegation, which the agent never sees), and the
//! export hands it to the handler installed here for that export's worker. So the
//! credential is the worker's, scoped to its delegation: the request acts as that worker and
//! no other. A `worker` it names (in the JSON body or the query) must be that worker —
//! anything else is refused with 403 — and one it leaves out (or empty) is filled in. Only
//! the AECP routes (`/aecp/…`) are reachable this way; they run exactly as on the daemon
//! API.
//!
//! The daemon API's owner credential (its API token, or the daemon's own user) keeps full
//! power: it may act as any worker (that is how an operator or a test drives workers).

use std::sync::{Arc, Weak};

use awcpfs::export::aecp::{RequestAnswer, RequestHandler};
use serde_json::{Value, json};

use super::super::Daemon;

/// The handler for `worker`'s export.
pub(crate) fn handler(daemon: Weak<Daemon>, worker: String) -> RequestHandler {
    Arc::new(move |request: Value| -> RequestAnswer {
        let daemon = daemon.clone();
        let worker = worker.clone();
        Box::pin(async move {
            let Some(d) = daemon.upgrade() else {
                return (503, error("the daemon is stopping", ""));
            };
            answer(d, &worker, request).await
        })
    })
}

fn error(message: impl Into<String>, hint: &str) -> Value {
    let mut v = json!({ "error": message.into() });
    if !hint.is_empty() {
        v["hint"] = json!(hint);
    }
    v
}

fn impersonation(worker: &str, named: &str) -> (u16, Value) {
    (
        403,
        error(
            format!("this credential is worker {worker}'s: acting as worker {named} is refused"),
            "Leave --worker out (your own is used), or act as another worker with the daemon's \
             API token (the Delegator's owner)",
        ),
    )
}

/// Checks the request, fills in the worker, and runs it through the AECP routes.
async fn answer(d: Arc<Daemon>, worker: &str, request: Value) -> (u16, Value) {
    use tower::ServiceExt as _;
    let method = match request["method"].as_str() {
        Some("GET") => axum::http::Method::GET,
        Some("POST") => axum::http::Method::POST,
        other => {
            return (
                400,
                error(
                    format!("a worker request's method is GET or POST, not {other:?}"),
                    "",
                ),
            );
        }
    };
    let path = request["path"].as_str().unwrap_or("");
    if !path.starts_with("/aecp/") || path.contains(['?', '#']) || path.contains("..") {
        return (
            403,
            error(
                format!("a worker's channel reaches the AECP routes (/aecp/…) only, not {path:?}"),
                "Everything else needs the daemon's API token",
            ),
        );
    }
    // The query: `worker` checked or added.
    let mut pairs: Vec<(String, String)> = match request["query"].as_str() {
        None | Some("") => Vec::new(),
        Some(q) => {
            let uri: axum::http::Uri = match format!("/?{q}").parse() {
                Ok(u) => u,
                Err(e) => return (400, error(format!("a malformed query: {e}"), "")),
            };
            match axum::extract::Query::<Vec<(String, String)>>::try_from_uri(&uri) {
                Ok(axum::extract::Query(p)) => p,
                Err(e) => return (400, error(format!("a malformed query: {e}"), "")),
            }
        }
    };
    // An empty `worker` is one left out.
    pairs.retain(|(k, v)| !(k == "worker" && v.is_empty()));
    for (k, v) in &pairs {
        if k == "worker" && v != worker {
            return impersonation(worker, v);
        }
    }
    if !pairs.iter().any(|(k, _)| k == "worker") {
        pairs.push(("worker".into(), worker.to_owned()));
    }
    let query = pairs
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&");
    // The body: `worker` checked or added.
    let body = if method == axum::http::Method::POST {
        let mut body = request["body"].clone();
        let Some(obj) = body.as_object_mut() else {
            return (400, error("a worker request's body is one JSON object", ""));
        };
        match obj.get("worker") {
            None | Some(Value::Null) => {
                obj.insert("worker".into(), json!(worker));
            }
            // An empty `worker` is one left out.
            Some(Value::String(named)) if named.is_empty() => {
                obj.insert("worker".into(), json!(worker));
            }
            Some(Value::String(named)) if named == worker => {}
            Some(Value::String(named)) => return impersonation(worker, named),
            Some(other) => {
                return (
                    400,
                    error(format!("`worker` is a delegation id, not {other}"), ""),
                );
            }
        }
        serde_json::to_vec(&body).unwrap_or_default()
    } else {
        Vec::new()
    };
    let req = match axum::http::Request::builder()
        .method(method)
        .uri(format!("{path}?{query}"))
        .header(axum::http::header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(body))
    {
        Ok(r) => r,
        Err(e) => return (400, error(format!("a malformed request: {e}"), "")),
    };
    let router = super::routes()
        .with_state(d)
        .fallback(|| async { (axum::http::StatusCode::NOT_FOUND, "no such AECP route") });
    let resp = match router.oneshot(req).await {
        Ok(r) => r,
        Err(e) => match e {},
    };
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20)
        .await
        .unwrap_or_default();
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
        if status < 300 {
            Value::Null
        } else {
            error(String::from_utf8_lossy(&bytes).into_owned(), "")
        }
    });
    (status, body)
}

/// Percent-encodes a query component (everything but unreserved characters).
pub(super) fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn query_components_round_trip() {
        let raw = "pkg/a b&c=d%é";
        let uri: axum::http::Uri = format!("/?k={}", super::encode(raw)).parse().unwrap();
        let axum::extract::Query(p) =
            axum::extract::Query::<Vec<(String, String)>>::try_from_uri(&uri).unwrap();
        assert_eq!(p, [("k".to_string(), raw.to_string())]);
    }
}
