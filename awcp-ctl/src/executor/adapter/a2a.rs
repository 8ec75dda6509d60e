//! The A2A adapter (A2A protocol 0.3, JSON-RPC binding).
//!
//! 1. The agent card: `<url>/.well-known/agent-card.json`, else the older
//!    `<url>/.well-known/agent.json` (or `url` itself when it names a `.json` file). Its
//!    `url` is the JSON-RPC endpoint; `capabilities.streaming` chooses the method.
//! 2. One user message per round: a text part with the task's prompt and a text part with
//!    the AWCP context ([`AgentTask::context_text`]); from the second round on, the
//!    `contextId` the agent gave the first, so it sees one conversation.
//! 3. Streaming agents: `message/stream`; every `status-update` and `artifact-update` with
//!    text becomes a `progress` event, until a final state. Others: `message/send` with
//!    `blocking: false`, then `tasks/get` every half second, reporting each new status
//!    message.
//! 4. `completed` → `done` with the final status message (else the artifacts' text);
//!    `failed`, `rejected`, `canceled` → `error`; `input-required` and `auth-required` →
//!    `error` too (an AWCP task has nobody to answer; the question is in the message).
//!    A `message` answer (no task) is a finished task whose summary is its text.
//! 5. A cancel sends `tasks/cancel` for the task, when its id is known.

use serde::Deserialize;
use serde_json::{Value, json};

use super::{AgentTask, REQUEST_TIMEOUT, RemoteEnd, Reporter, excerpt, read_body};

/// The parts of an agent card this adapter reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Card {
    #[serde(default)]
    name: Option<String>,
    url: String,
    #[serde(default)]
    capabilities: Capabilities,
    #[serde(default)]
    preferred_transport: Option<String>,
    #[serde(default)]
    additional_interfaces: Vec<Interface>,
}

#[derive(Debug, Default, Deserialize)]
struct Capabilities {
    #[serde(default)]
    streaming: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct Interface {
    url: String,
    transport: String,
}

/// Fetch and read the agent card; the JSON-RPC endpoint and whether to stream.
async fn discover(client: &reqwest::Client, url: &str) -> Result<(String, bool, String), String> {
    let base = url.trim_end_matches('/');
    let candidates: Vec<String> = if base.ends_with(".json") {
        vec![base.to_string()]
    } else {
        vec![
            format!("{base}/.well-known/agent-card.json"),
            format!("{base}/.well-known/agent.json"),
        ]
    };
    let mut last = String::new();
    for card_url in &candidates {
        let resp = client
            .get(card_url)
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .map_err(|e| {
                format!("cannot reach the A2A agent at {card_url}: {e} (is it running? check --agent-a2a)")
            })?;
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            last = format!("{card_url}: 404");
            continue;
        }
        let body = read_body(resp).await?;
        if !status.is_success() {
            return Err(format!(
                "the A2A agent's card at {card_url} answered HTTP {status}: {}",
                excerpt(&body)
            ));
        }
        let card: Card = serde_json::from_str(&body).map_err(|e| {
            format!(
                "the A2A agent card at {card_url} is not a usable agent card ({e}): {}",
                excerpt(&body)
            )
        })?;
        let endpoint = jsonrpc_endpoint(&card).ok_or_else(|| {
            format!(
                "the A2A agent {} offers no JSON-RPC interface (preferredTransport {:?}); \
                 this Executor speaks A2A over JSON-RPC",
                card.name.as_deref().unwrap_or("?"),
                card.preferred_transport.as_deref().unwrap_or("")
            )
        })?;
        let endpoint = reqwest::Url::parse(card_url)
            .and_then(|u| u.join(&endpoint))
            .map_err(|e| format!("the agent card's url {endpoint:?} is not a URL: {e}"))?;
        return Ok((
            endpoint.to_string(),
            card.capabilities.streaming == Some(true),
            card.name.unwrap_or_else(|| "A2A agent".into()),
        ));
    }
    Err(format!(
        "no A2A agent card under {base} ({last}; also tried the older agent.json): give \
         --agent-a2a the agent's base URL or its card's URL"
    ))
}

fn jsonrpc_endpoint(card: &Card) -> Option<String> {
    match card.preferred_transport.as_deref() {
        None | Some("JSONRPC") => Some(card.url.clone()),
        Some(_) => card
            .additional_interfaces
            .iter()
            .find(|i| i.transport == "JSONRPC")
            .map(|i| i.url.clone()),
    }
}

/// The round's message.
fn message(task: &AgentTask) -> Value {
    let mut m = json!({
        "kind": "message",
        "messageId": super::random_id(),
        "role": "user",
        "parts": [
            {"kind": "text", "text": task.task.prompt},
            {"kind": "text", "text": task.context_text()},
        ],
        "metadata": {
            "awcp": {
                "delegationId": task.delegation_id,
                "round": task.round,
                "workspace": task.root,
                "workingDirectory": task.cwd,
            }
        }
    });
    if let Some(c) = &task.context_id {
        m["contextId"] = json!(c);
    }
    m
}

fn request(method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": super::random_id(), "method": method, "params": params})
}

/// The `result` of a JSON-RPC answer, or why there is none.
fn result_of(method: &str, body: &str) -> Result<Value, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| {
        format!(
            "the A2A agent's answer to {method} is not JSON ({e}): {}",
            excerpt(body)
        )
    })?;
    if let Some(err) = v.get("error") {
        return Err(format!(
            "the A2A agent answered {method} with error {}: {}",
            err.get("code").map(|c| c.to_string()).unwrap_or_default(),
            err.get("message")
                .and_then(Value::as_str)
                .unwrap_or("(no message)")
        ));
    }
    v.get("result").cloned().ok_or_else(|| {
        format!(
            "the A2A agent's answer to {method} has neither result nor error: {}",
            excerpt(body)
        )
    })
}

async fn call(
    client: &reqwest::Client,
    endpoint: &str,
    method: &str,
    params: Value,
) -> Result<Value, String> {
    let resp = client
        .post(endpoint)
        .timeout(super::REQUEST_TIMEOUT)
        .json(&request(method, params))
        .send()
        .await
        .map_err(|e| format!("the A2A agent did not answer {method}: {e}"))?;
    let status = resp.status();
    let body = read_body(resp).await?;
    if !status.is_success() {
        return Err(format!(
            "the A2A agent answered {method} with HTTP {status}: {}",
            excerpt(&body)
        ));
    }
    result_of(method, &body)
}

/// The text parts of a message (or of an artifact), joined.
fn text_of(parts_holder: &Value) -> String {
    parts_holder
        .get("parts")
        .and_then(Value::as_array)
        .map(|parts| {
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

/// What the adapter knows of the remote task.
#[derive(Default)]
struct Tracked {
    /// Shared with [`run`], which needs it to cancel the task.
    task_id: std::sync::Arc<parking_lot::Mutex<Option<String>>>,
    /// The last status message reported (not repeated when polled again).
    last_status: Option<String>,
    /// Text of the artifacts seen.
    artifacts: Vec<String>,
}

/// Whether an A2A state ends the task, and how.
fn end_for(state: &str, text: &str, artifacts: &[String]) -> Option<RemoteEnd> {
    let said = if text.is_empty() {
        String::new()
    } else {
        format!(": {text}")
    };
    match state {
        "completed" => Some(RemoteEnd::Done(if !text.is_empty() {
            text.to_string()
        } else if !artifacts.is_empty() {
            artifacts.join("\n")
        } else {
            "A2A task completed".to_string()
        })),
        "failed" | "rejected" => Some(RemoteEnd::Failed(format!(
            "the A2A agent's task ended {state}{said}"
        ))),
        "canceled" => Some(RemoteEnd::Failed(format!(
            "the A2A agent canceled the task{said}"
        ))),
        "input-required" | "auth-required" => Some(RemoteEnd::Failed(format!(
            "the A2A agent stopped in state {state}{said}; an AWCP task has nobody to \
             answer it: put what it asks for in the task's prompt"
        ))),
        "submitted" | "working" => None,
        other => Some(RemoteEnd::Failed(format!(
            "the A2A agent's task is in an unknown state {other:?}{said}"
        ))),
    }
}

impl Tracked {
    /// Take in a `task`, `status-update`, `artifact-update` or `message` result; the end,
    /// if this was it.
    fn take(&mut self, v: &Value, rep: &Reporter) -> Option<RemoteEnd> {
        match v.get("kind").and_then(Value::as_str) {
            Some("message") => Some(RemoteEnd::Done({
                let t = text_of(v);
                if t.is_empty() {
                    "A2A agent answered".into()
                } else {
                    t
                }
            })),
            Some("task") => {
                if let Some(id) = v.get("id").and_then(Value::as_str) {
                    *self.task_id.lock() = Some(id.to_string());
                }
                if let Some(c) = v.get("contextId").and_then(Value::as_str) {
                    rep.context_id(c);
                }
                for art in v
                    .get("artifacts")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let t = text_of(art);
                    if !t.is_empty() && !self.artifacts.contains(&t) {
                        rep.progress(&t);
                        self.artifacts.push(t);
                    }
                }
                self.status(v.get("status"), rep)
            }
            Some("status-update") => {
                let mut id = self.task_id.lock();
                if id.is_none() {
                    *id = v.get("taskId").and_then(Value::as_str).map(str::to_string);
                }
                drop(id);
                if let Some(c) = v.get("contextId").and_then(Value::as_str) {
                    rep.context_id(c);
                }
                let end = self.status(v.get("status"), rep);
                if end.is_none() && v.get("final").and_then(Value::as_bool) == Some(true) {
                    let state = v
                        .pointer("/status/state")
                        .and_then(Value::as_str)
                        .unwrap_or("?");
                    return Some(RemoteEnd::Failed(format!(
                        "the A2A agent ended its stream in state {state}"
                    )));
                }
                end
            }
            Some("artifact-update") => {
                if let Some(art) = v.get("artifact") {
                    let t = text_of(art);
                    if !t.is_empty() {
                        rep.progress(&t);
                        self.artifacts.push(t);
                    }
                }
                None
            }
            other => Some(RemoteEnd::Failed(format!(
                "the A2A agent sent a result of unknown kind {other:?}: {}",
                excerpt(&v.to_string())
            ))),
        }
    }

    fn status(&mut self, status: Option<&Value>, rep: &Reporter) -> Option<RemoteEnd> {
        let Some(status) = status else {
            return Some(RemoteEnd::Failed(
                "the A2A agent sent a task without a status".into(),
            ));
        };
        let state = status.get("state").and_then(Value::as_str).unwrap_or("");
        let text = status.get("message").map(text_of).unwrap_or_default();
        let end = end_for(state, &text, &self.artifacts);
        if end.is_none() && !text.is_empty() && self.last_status.as_deref() != Some(&text) {
            rep.progress(&text);
        }
        if !text.is_empty() {
            self.last_status = Some(text);
        }
        end
    }
}

/// One round on the A2A agent at `url`.
pub(super) async fn run(
    client: &reqwest::Client,
    url: &str,
    task: &AgentTask,
    rep: &Reporter,
    mut cancel: tokio::sync::oneshot::Receiver<()>,
) -> RemoteEnd {
    let (endpoint, streaming, name) = match discover(client, url).await {
        Ok(d) => d,
        Err(e) => return RemoteEnd::Failed(e),
    };
    tracing::info!(%endpoint, streaming, agent = %name, "handing the task to an A2A agent");
    let mut tracked = Tracked::default();
    let task_id = tracked.task_id.clone();
    let work = async {
        if streaming {
            stream(client, &endpoint, task, rep, &mut tracked).await
        } else {
            poll(client, &endpoint, task, rep, &mut tracked).await
        }
    };
    tokio::pin!(work);
    tokio::select! {
        end = &mut work => return end,
        _ = &mut cancel => {}
    }
    // Cancelled before the agent named its task (it may be working already): listen a
    // moment longer for the id, so that the cancel reaches it.
    let learn = tokio::time::sleep(std::time::Duration::from_secs(2));
    tokio::pin!(learn);
    while task_id.lock().is_none() {
        tokio::select! {
            _ = &mut work => break,
            _ = &mut learn => break,
            _ = tokio::time::sleep(std::time::Duration::from_millis(20)) => {}
        }
    }
    let id = task_id.lock().clone();
    match id {
        Some(id) => {
            let cancelled = tokio::time::timeout(
                std::time::Duration::from_secs(2),
                call(client, &endpoint, "tasks/cancel", json!({"id": id})),
            )
            .await;
            match cancelled {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "tasks/cancel failed"),
                Err(_) => tracing::warn!("tasks/cancel got no answer within 2 s"),
            }
        }
        None => tracing::warn!("cancelled before the A2A agent named its task; it cannot be told"),
    }
    RemoteEnd::Failed("cancelled".into())
}

async fn poll(
    client: &reqwest::Client,
    endpoint: &str,
    task: &AgentTask,
    rep: &Reporter,
    tracked: &mut Tracked,
) -> RemoteEnd {
    let first = match call(
        client,
        endpoint,
        "message/send",
        json!({"message": message(task), "configuration": {"blocking": false}}),
    )
    .await
    {
        Ok(v) => v,
        Err(e) => return RemoteEnd::Failed(e),
    };
    if let Some(end) = tracked.take(&first, rep) {
        return end;
    }
    let Some(id) = tracked.task_id.lock().clone() else {
        return RemoteEnd::Failed("the A2A agent's task has no id".into());
    };
    loop {
        tokio::time::sleep(super::POLL_EVERY).await;
        match call(client, endpoint, "tasks/get", json!({"id": id})).await {
            Ok(v) => {
                if let Some(end) = tracked.take(&v, rep) {
                    return end;
                }
            }
            Err(e) => return RemoteEnd::Failed(e),
        }
    }
}

async fn stream(
    client: &reqwest::Client,
    endpoint: &str,
    task: &AgentTask,
    rep: &Reporter,
    tracked: &mut Tracked,
) -> RemoteEnd {
    let resp = match client
        .post(endpoint)
        .header(reqwest::header::ACCEPT, "text/event-stream")
        .json(&request(
            "message/stream",
            json!({"message": message(task)}),
        ))
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => {
            return RemoteEnd::Failed(format!("the A2A agent did not answer message/stream: {e}"));
        }
    };
    let status = resp.status();
    let is_sse = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !status.is_success() || !is_sse {
        let body = read_body(resp).await.unwrap_or_default();
        // A JSON-RPC error comes as a plain JSON answer.
        return RemoteEnd::Failed(match result_of("message/stream", &body) {
            Err(e) => e,
            Ok(_) => format!(
                "the A2A agent answered message/stream with HTTP {status} and no event \
                 stream: {}",
                excerpt(&body)
            ),
        });
    }
    let mut events = crate::sse::SseReader::new(resp);
    loop {
        match events.next().await {
            Ok(Some(ev)) => {
                let v = match result_of("message/stream", &ev.data) {
                    Ok(v) => v,
                    Err(e) => return RemoteEnd::Failed(e),
                };
                if let Some(end) = tracked.take(&v, rep) {
                    return end;
                }
            }
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(error = %e, "the A2A event stream broke; polling the task");
                break;
            }
        }
    }
    // The stream ended before a final state: ask for the task.
    let Some(id) = tracked.task_id.lock().clone() else {
        return RemoteEnd::Failed(
            "the A2A agent's event stream ended before it named a task".into(),
        );
    };
    loop {
        match call(client, endpoint, "tasks/get", json!({"id": id})).await {
            Ok(v) => {
                if let Some(end) = tracked.take(&v, rep) {
                    return end;
                }
            }
            Err(e) => return RemoteEnd::Failed(e),
        }
        tokio::time::sleep(super::POLL_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_states_map_to_done_or_error() {
        assert_eq!(
            end_for("completed", "ok", &[]),
            Some(RemoteEnd::Done("ok".into()))
        );
        assert_eq!(
            end_for("completed", "", &["art".into()]),
            Some(RemoteEnd::Done("art".into()))
        );
        assert!(end_for("working", "x", &[]).is_none());
        assert!(end_for("submitted", "", &[]).is_none());
        for s in [
            "failed",
            "rejected",
            "canceled",
            "input-required",
            "auth-required",
            "bogus",
        ] {
            assert!(
                matches!(end_for(s, "why", &[]), Some(RemoteEnd::Failed(m)) if m.contains("why")),
                "{s}"
            );
        }
    }

    #[test]
    fn json_rpc_errors_and_garbage_are_reported() {
        let e = result_of(
            "message/send",
            r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32601,"message":"Method not found"}}"#,
        )
        .unwrap_err();
        assert!(
            e.contains("-32601") && e.contains("Method not found"),
            "{e}"
        );
        assert!(result_of("m", "<html>").unwrap_err().contains("not JSON"));
        assert!(
            result_of("m", r#"{"jsonrpc":"2.0"}"#)
                .unwrap_err()
                .contains("neither result nor error")
        );
    }

    #[test]
    fn the_card_names_the_json_rpc_endpoint() {
        let card: Card = serde_json::from_str(
            r#"{"name":"x","url":"http://h/grpc","preferredTransport":"GRPC",
                "additionalInterfaces":[{"url":"http://h/rpc","transport":"JSONRPC"}]}"#,
        )
        .unwrap();
        assert_eq!(jsonrpc_endpoint(&card).as_deref(), Some("http://h/rpc"));
        let card: Card =
            serde_json::from_str(r#"{"url":"http://h/","preferredTransport":"GRPC"}"#).unwrap();
        assert_eq!(jsonrpc_endpoint(&card), None);
    }
}
