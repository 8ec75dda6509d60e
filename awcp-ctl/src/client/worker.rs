//! The worker channel of the client: a daemon request sent as one line on the worker's
//! AECP socket (`$AECP_SOCKET`), answered on the same connection (see
//! `awcpfs::mount::aecp::serve_requests`). Delivery lines the socket streams meanwhile are
//! skipped.

use std::path::Path;

use awcp_protocol::api::ApiError;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

use super::ClientError;

/// Sends `rq` over `socket` and decodes the answer like an HTTP one.
pub(super) async fn send<T: serde::de::DeserializeOwned>(
    socket: &Path,
    rq: reqwest::RequestBuilder,
) -> Result<T, ClientError> {
    let fail = |message: String| ClientError::WorkerSocket {
        socket: socket.display().to_string(),
        message,
    };
    let req = rq
        .build()
        .map_err(|e| fail(format!("building the request: {e}")))?;
    let body = match req.body().and_then(|b| b.as_bytes()) {
        Some(b) if !b.is_empty() => serde_json::from_slice(b)
            .map_err(|e| fail(format!("the request body is not JSON: {e}")))?,
        _ => serde_json::Value::Null,
    };
    let id = std::process::id();
    let mut line = serde_json::json!({
        "kind": "request",
        "id": id,
        "method": req.method().as_str(),
        "path": req.url().path(),
        "query": req.url().query().unwrap_or(""),
        "body": body,
        // The worker's secret for its socket (set by the Executor, like the socket).
        "token": std::env::var("AECP_TOKEN").unwrap_or_default(),
    })
    .to_string();
    line.push('\n');
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| {
        fail(format!(
            "{e} (inside a task the Executor sets AECP_SOCKET to the mount's socket; \
             outside one, unset it and use --daemon with the daemon's API token)"
        ))
    })?;
    let (read, mut write) = stream.into_split();
    write
        .write_all(line.as_bytes())
        .await
        .map_err(|e| fail(format!("sending: {e}")))?;
    let mut lines = BufReader::new(read).lines();
    loop {
        let Some(l) = lines
            .next_line()
            .await
            .map_err(|e| fail(format!("reading the answer: {e}")))?
        else {
            return Err(fail(
                "the mount closed the connection without answering (did the task end?)".into(),
            ));
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&l) else {
            continue;
        };
        if v["kind"] != "answer" || (v["id"] != id && !v["id"].is_null()) {
            continue;
        }
        let status = v["status"].as_u64().unwrap_or(502) as u16;
        let body = v["body"].clone();
        if !(200..300).contains(&status) {
            let err = serde_json::from_value::<ApiError>(body.clone())
                .unwrap_or_else(|_| ApiError::new(format!("status {status}: {body}")));
            return Err(ClientError::Refused { status, body: err });
        }
        return serde_json::from_value(body).map_err(|e| fail(format!("unexpected answer: {e}")));
    }
}
