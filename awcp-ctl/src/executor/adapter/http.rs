//! The plain HTTP adapter (ours; docs/PROTOCOL.md "HTTP agents").
//!
//! One `POST <url>` per round, JSON: `delegationId`, `round`, `task{description,prompt}`,
//! `workspace{root,workingDirectory,resources:[{name,path,mode}]}`, `lease{expiresAt,
//! accessMode}` (when known) and `context` (the AWCP context text the A2A adapter sends).
//! The agent answers with updates — `{"type":"progress","message"}`,
//! `{"type":"done","summary"}`, `{"type":"error","message"}`, `{"type":"accepted",
//! "pollUrl"?, "cancelUrl"?}` — as a stream (`application/x-ndjson`: one per line;
//! `text/event-stream`: one per `data:` event) or as one JSON object. After `accepted`
//! (or a stream that ends early) the adapter GETs `pollUrl` every half second, each answer
//! one update. A cancel POSTs to `cancelUrl`.

use serde::Deserialize;
use serde_json::json;

use super::{AgentTask, RemoteEnd, Reporter, excerpt, read_body};

/// One update from the agent.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum Update {
    Progress {
        #[serde(default)]
        message: String,
    },
    Done {
        #[serde(default)]
        summary: String,
    },
    Error {
        #[serde(default)]
        message: String,
    },
    #[serde(rename_all = "camelCase")]
    Accepted {
        #[serde(default)]
        poll_url: Option<String>,
        #[serde(default)]
        cancel_url: Option<String>,
    },
}

fn body(task: &AgentTask) -> serde_json::Value {
    let mut b = json!({
        "delegationId": task.delegation_id,
        "round": task.round,
        "task": task.task,
        "workspace": {
            "root": task.root,
            "workingDirectory": task.cwd,
            "resources": task.resources.iter().map(|r| json!({
                "name": r.name, "path": r.path, "mode": r.mode,
            })).collect::<Vec<_>>(),
        },
        "context": task.context_text(),
    });
    if let Some(l) = &task.lease {
        b["lease"] = json!(l);
    }
    b
}

/// What the adapter learned from `accepted`.
#[derive(Default)]
struct Urls {
    poll: Option<reqwest::Url>,
    cancel: Option<reqwest::Url>,
    last_progress: Option<String>,
}

impl Urls {
    /// Take in an update; the end if it was one.
    fn take(&mut self, base: &reqwest::Url, u: Update, rep: &Reporter) -> Option<RemoteEnd> {
        match u {
            Update::Progress { message } => {
                if self.last_progress.as_deref() != Some(&message) {
                    rep.progress(&message);
                    self.last_progress = Some(message);
                }
                None
            }
            Update::Done { summary } => Some(RemoteEnd::Done(if summary.is_empty() {
                "HTTP agent finished".into()
            } else {
                summary
            })),
            Update::Error { message } => Some(RemoteEnd::Failed(format!(
                "the HTTP agent reported an error: {}",
                if message.is_empty() {
                    "(no message)"
                } else {
                    &message
                }
            ))),
            Update::Accepted {
                poll_url,
                cancel_url,
            } => {
                self.poll = poll_url
                    .and_then(|u| base.join(&u).ok())
                    .or(self.poll.take());
                self.cancel = cancel_url
                    .and_then(|u| base.join(&u).ok())
                    .or(self.cancel.take());
                None
            }
        }
    }
}

fn parse(text: &str) -> Result<Update, String> {
    serde_json::from_str(text).map_err(|e| {
        format!(
            "the HTTP agent sent an update this Executor cannot read ({e}): {}; expected \
             {{\"type\":\"progress\"|\"done\"|\"error\"|\"accepted\", …}}",
            excerpt(text)
        )
    })
}

/// One round on the HTTP agent at `url`.
pub(super) async fn run(
    client: &reqwest::Client,
    url: &str,
    task: &AgentTask,
    rep: &Reporter,
    mut cancel: tokio::sync::oneshot::Receiver<()>,
) -> RemoteEnd {
    let base = match reqwest::Url::parse(url) {
        Ok(u) => u,
        Err(e) => return RemoteEnd::Failed(format!("--agent-http {url:?} is not a URL: {e}")),
    };
    let mut urls = Urls::default();
    let work = work(client, &base, task, rep, &mut urls);
    tokio::select! {
        end = work => return end,
        _ = &mut cancel => {}
    }
    if let Some(c) = urls.cancel.clone() {
        let r = client
            .post(c.clone())
            .timeout(std::time::Duration::from_secs(2))
            .json(&json!({"delegationId": task.delegation_id}))
            .send()
            .await;
        if let Err(e) = r {
            tracing::warn!(url = %c, error = %e, "cancelling the HTTP agent's task failed");
        }
    }
    RemoteEnd::Failed("cancelled".into())
}

async fn work(
    client: &reqwest::Client,
    base: &reqwest::Url,
    task: &AgentTask,
    rep: &Reporter,
    urls: &mut Urls,
) -> RemoteEnd {
    let resp = match client
        .post(base.clone())
        .header(
            reqwest::header::ACCEPT,
            "application/x-ndjson, text/event-stream, application/json",
        )
        .json(&body(task))
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => {
            return RemoteEnd::Failed(format!(
                "cannot reach the HTTP agent at {base}: {e} (is it running? check --agent-http)"
            ));
        }
    };
    let status = resp.status();
    let ctype = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if !status.is_success() {
        let b = read_body(resp).await.unwrap_or_default();
        return RemoteEnd::Failed(format!(
            "the HTTP agent refused the task with HTTP {status}: {}",
            excerpt(&b)
        ));
    }
    if ctype.starts_with("text/event-stream") {
        let mut events = crate::sse::SseReader::new(resp);
        loop {
            match events.next().await {
                Ok(Some(ev)) => match parse(&ev.data) {
                    Ok(u) => {
                        if let Some(end) = urls.take(base, u, rep) {
                            return end;
                        }
                    }
                    Err(e) => return RemoteEnd::Failed(e),
                },
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "the HTTP agent's event stream broke");
                    break;
                }
            }
        }
    } else if ctype.starts_with("application/x-ndjson") || ctype.starts_with("application/jsonl") {
        let mut resp = resp;
        let mut buf: Vec<u8> = Vec::new();
        loop {
            while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=pos).collect();
                let line = String::from_utf8_lossy(&line);
                if line.trim().is_empty() {
                    continue;
                }
                match parse(line.trim()) {
                    Ok(u) => {
                        if let Some(end) = urls.take(base, u, rep) {
                            return end;
                        }
                    }
                    Err(e) => return RemoteEnd::Failed(e),
                }
            }
            if buf.len() > super::MAX_ANSWER {
                return RemoteEnd::Failed(format!(
                    "the HTTP agent sent a line longer than {} bytes",
                    super::MAX_ANSWER
                ));
            }
            match resp.chunk().await {
                Ok(Some(c)) => buf.extend_from_slice(&c),
                Ok(None) => {
                    let rest = String::from_utf8_lossy(&buf).trim().to_string();
                    if !rest.is_empty() {
                        match parse(&rest) {
                            Ok(u) => {
                                if let Some(end) = urls.take(base, u, rep) {
                                    return end;
                                }
                            }
                            Err(e) => return RemoteEnd::Failed(e),
                        }
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the HTTP agent's stream broke");
                    break;
                }
            }
        }
    } else {
        let b = match read_body(resp).await {
            Ok(b) => b,
            Err(e) => return RemoteEnd::Failed(format!("reading the HTTP agent's answer: {e}")),
        };
        match parse(&b) {
            Ok(u) => {
                if let Some(end) = urls.take(base, u, rep) {
                    return end;
                }
            }
            Err(e) => return RemoteEnd::Failed(e),
        }
    }
    // No final update yet: poll, if the agent said where.
    let Some(poll) = urls.poll.clone() else {
        return RemoteEnd::Failed(
            "the HTTP agent's answer ended without a done or error update, and it gave no \
             pollUrl to ask later"
                .into(),
        );
    };
    loop {
        tokio::time::sleep(super::POLL_EVERY).await;
        let resp = match client
            .get(poll.clone())
            .timeout(super::REQUEST_TIMEOUT)
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => return RemoteEnd::Failed(format!("polling the HTTP agent failed: {e}")),
        };
        let status = resp.status();
        let b = read_body(resp).await.unwrap_or_default();
        if !status.is_success() {
            return RemoteEnd::Failed(format!(
                "polling the HTTP agent at {poll} answered HTTP {status}: {}",
                excerpt(&b)
            ));
        }
        match parse(&b) {
            Ok(u) => {
                if let Some(end) = urls.take(&poll, u, rep) {
                    return end;
                }
            }
            Err(e) => return RemoteEnd::Failed(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn updates_parse_and_bad_ones_say_what_was_expected() {
        assert!(matches!(
            parse(r#"{"type":"accepted","pollUrl":"/t/1","cancelUrl":"/t/1/cancel"}"#),
            Ok(Update::Accepted {
                poll_url: Some(_),
                cancel_url: Some(_)
            })
        ));
        assert!(matches!(
            parse(r#"{"type":"done","summary":"ok"}"#),
            Ok(Update::Done { summary }) if summary == "ok"
        ));
        let e = parse(r#"{"type":"finished"}"#).unwrap_err();
        assert!(e.contains("expected"), "{e}");
        assert!(parse("not json").is_err());
    }
}
