//! Agents behind adapters: instead of running a local command, the Executor hands each
//! round of a task to a remote agent — an A2A agent (`executor --agent-a2a URL`, JSON-RPC
//! `message/send` or `message/stream`, see [`a2a`]) or a plain HTTP agent (`executor
//! --agent-http URL`, our shape, see [`http`] and docs/PROTOCOL.md "Agents behind
//! adapters").
//!
//! The workspace is prepared as for a command (the `awcpfs` mount or the unpacked
//! `archive`), and the agent is told where it is: the task's prompt, and an AWCP context
//! naming the workspace root, each resource's path and mode, and the working directory —
//! the same text, line for line, as the reference's A2A adapter puts in its second text
//! part. The agent must therefore see this machine's files (it runs here, or shares the
//! work directory). What it reports while it works becomes the delegation's `progress`
//! events; its final state becomes `done` or `error` (`TASK_FAILED`). A cancel, a revoke or
//! the lease's end cancels the remote task (A2A `tasks/cancel`, the HTTP agent's
//! `cancelUrl`).

mod a2a;
mod http;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use awcp_protocol::events::RunStatus;
use awcp_protocol::messages::{AccessMode, ActiveLease, TaskSpec};

use super::Assignment;

/// A remote agent the Executor hands each task to instead of running a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteAgent {
    /// An A2A agent: its base URL (the card is looked up at
    /// `/.well-known/agent-card.json`, then the older `/.well-known/agent.json`) or the
    /// URL of its card (ending in `.json`).
    A2a(String),
    /// A plain HTTP agent: the URL tasks are POSTed to.
    Http(String),
}

impl RemoteAgent {
    /// How the agent is named in messages.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            RemoteAgent::A2a(_) => "A2A agent",
            RemoteAgent::Http(_) => "HTTP agent",
        }
    }
}

/// One resource as the agent is told of it.
#[derive(Debug, Clone)]
pub(super) struct ResourcePath {
    pub(super) name: String,
    pub(super) path: PathBuf,
    pub(super) mode: AccessMode,
}

/// What an adapter is given for one round.
#[derive(Debug, Clone)]
pub(super) struct AgentTask {
    pub(super) delegation_id: String,
    pub(super) round: u32,
    pub(super) task: TaskSpec,
    /// The work directory (`<work-dir>/<delegationId>`).
    pub(super) root: PathBuf,
    /// Where the agent should work: the single resource's directory, else the root.
    pub(super) cwd: PathBuf,
    pub(super) resources: Vec<ResourcePath>,
    pub(super) lease: Option<ActiveLease>,
    /// The A2A context of the earlier rounds, so a later round continues the conversation.
    pub(super) context_id: Option<String>,
}

impl AgentTask {
    /// The AWCP context text: the lines the reference's A2A adapter sends (`[AWCP
    /// Context]`, `Task:`, `Root:`, `Resources:` with one `  - name: path (mode)` line
    /// each, and `Working directory:` when there is a single resource).
    pub(super) fn context_text(&self) -> String {
        let mut lines = vec![
            String::new(),
            "[AWCP Context]".to_string(),
            format!("Task: {}", self.task.description),
            format!("Root: {}", self.root.display()),
            String::new(),
            "Resources:".to_string(),
        ];
        for r in &self.resources {
            lines.push(format!("  - {}: {} ({})", r.name, r.path.display(), r.mode));
        }
        if self.resources.len() == 1 {
            lines.push(String::new());
            lines.push(format!("Working directory: {}", self.cwd.display()));
        }
        lines.join("\n")
    }
}

/// How a remote run ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RemoteEnd {
    /// The agent finished; its final words.
    Done(String),
    /// It failed, was cancelled, timed out, or answered something unusable: what to tell
    /// the Delegator.
    Failed(String),
}

/// Where an adapter reports to: the delegation's events and the kept tail of output.
#[derive(Clone)]
pub(super) struct Reporter {
    pub(super) a: Arc<Assignment>,
    pub(super) tail: Arc<Mutex<VecDeque<String>>>,
    pub(super) forwarded: Arc<std::sync::atomic::AtomicUsize>,
}

impl Reporter {
    /// One line of what the agent said while working: a `progress` event (bounded in
    /// number, as a command's output lines are) and the tail.
    pub(super) fn progress(&self, text: &str) {
        let text = text.trim();
        if text.is_empty() {
            return;
        }
        {
            let mut t = self.tail.lock();
            t.push_back(text.to_string());
            if t.len() > super::task::TAIL_LINES {
                t.pop_front();
            }
        }
        if self
            .forwarded
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            < super::task::MAX_PROGRESS_EVENTS
        {
            self.a.emit(super::task::status_event(
                &self.a,
                RunStatus::Progress,
                text.to_string(),
            ));
        }
    }

    /// The A2A context the agent put the task in, for the next round.
    pub(super) fn context_id(&self, id: &str) {
        *self.a.agent_context.lock() = Some(id.to_string());
    }
}

/// A remote run in progress.
pub(super) struct RemoteRun {
    handle: tokio::task::JoinHandle<RemoteEnd>,
    cancel: Option<tokio::sync::oneshot::Sender<()>>,
    ended: Option<RemoteEnd>,
}

impl RemoteRun {
    /// Until the run ends.
    pub(super) async fn wait(&mut self) -> RemoteEnd {
        if let Some(end) = &self.ended {
            return end.clone();
        }
        let end = match (&mut self.handle).await {
            Ok(end) => end,
            Err(e) => RemoteEnd::Failed(format!("the adapter task failed: {e}")),
        };
        self.ended = Some(end.clone());
        end
    }

    /// Cancel the remote task (the adapter tells the agent, bounded), then stop.
    pub(super) async fn cancel(&mut self) {
        if self.ended.is_some() {
            return;
        }
        if let Some(tx) = self.cancel.take() {
            let _ = tx.send(());
        }
        if tokio::time::timeout(CANCEL_GRACE, &mut self.handle)
            .await
            .is_err()
        {
            self.handle.abort();
        }
        self.ended = Some(RemoteEnd::Failed("cancelled".into()));
    }
}

/// How long a cancel may take to reach the agent.
const CANCEL_GRACE: Duration = Duration::from_secs(5);
/// Bound on connecting to the agent and on each short request (card, poll, cancel).
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a task that is not streamed is polled.
pub(super) const POLL_EVERY: Duration = Duration::from_millis(500);
/// Longest answer read from an agent (a poll, a card, one streamed event).
pub(super) const MAX_ANSWER: usize = 4 << 20;

/// Start the round of `task` on `agent`; `timeout` bounds the whole round.
pub(super) fn start(
    agent: &RemoteAgent,
    task: AgentTask,
    rep: Reporter,
    timeout: Option<Duration>,
) -> RemoteRun {
    let (tx, mut cancelled) = tokio::sync::oneshot::channel::<()>();
    let agent = agent.clone();
    let handle = tokio::spawn(async move {
        let client = match reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
        {
            Ok(c) => c,
            Err(e) => return RemoteEnd::Failed(format!("cannot build an HTTP client: {e}")),
        };
        let kind = agent.kind();
        // The adapter's own cancel: fired by a cancel from outside, or by the timeout, so
        // that either way the agent is told to stop.
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        let run = async {
            match &agent {
                RemoteAgent::A2a(url) => a2a::run(&client, url, &task, &rep, stop_rx).await,
                RemoteAgent::Http(url) => http::run(&client, url, &task, &rep, stop_rx).await,
            }
        };
        tokio::pin!(run);
        let limit = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        let end = tokio::select! {
            end = &mut run => end,
            _ = &mut cancelled => {
                let _ = stop.send(());
                run.await
            }
            _ = limit => {
                let _ = stop.send(());
                let _ = tokio::time::timeout(CANCEL_GRACE, run).await;
                RemoteEnd::Failed(format!(
                    "the {kind} did not finish within {} (executor --agent-timeout); its \
                     task was cancelled",
                    humantime(timeout.unwrap_or_default())
                ))
            }
        };
        if let RemoteEnd::Failed(m) = &end {
            tracing::warn!(delegation = %task.delegation_id, error = %m, "remote agent failed");
        }
        end
    });
    RemoteRun {
        handle,
        cancel: Some(tx),
        ended: None,
    }
}

fn humantime(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 && s.is_multiple_of(60) {
        format!("{}m", s / 60)
    } else if s > 0 {
        format!("{s}s")
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// A short, single-line excerpt of a body for an error message.
pub(super) fn excerpt(body: &str) -> String {
    let one: String = body.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() > 300 {
        format!("{}…", one.chars().take(300).collect::<String>())
    } else {
        one
    }
}

/// Read a whole answer, at most [`MAX_ANSWER`] bytes.
pub(super) async fn read_body(resp: reqwest::Response) -> Result<String, String> {
    let mut resp = resp;
    let mut buf = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| format!("reading: {e}"))? {
        buf.extend_from_slice(&chunk);
        if buf.len() > MAX_ANSWER {
            return Err(format!("the answer exceeds {MAX_ANSWER} bytes"));
        }
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// A random id (A2A `messageId`s).
pub(super) fn random_id() -> String {
    let b: [u8; 16] = rand::random();
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(resources: &[&str]) -> AgentTask {
        let root = PathBuf::from("/w/dlg_1");
        AgentTask {
            delegation_id: "dlg_1".into(),
            round: 1,
            task: TaskSpec {
                description: "fix it".into(),
                prompt: "fix the bug".into(),
            },
            cwd: if resources.len() == 1 {
                root.join(resources[0])
            } else {
                root.clone()
            },
            resources: resources
                .iter()
                .map(|n| ResourcePath {
                    name: n.to_string(),
                    path: root.join(n),
                    mode: AccessMode::Rw,
                })
                .collect(),
            root,
            lease: None,
            context_id: None,
        }
    }

    #[test]
    fn the_context_text_has_the_reference_adapters_lines() {
        assert_eq!(
            task(&["src"]).context_text(),
            "\n[AWCP Context]\nTask: fix it\nRoot: /w/dlg_1\n\nResources:\n  - src: /w/dlg_1/src (rw)\n\nWorking directory: /w/dlg_1/src"
        );
        // Several resources: no working directory line, as the reference.
        assert_eq!(
            task(&["a", "b"]).context_text(),
            "\n[AWCP Context]\nTask: fix it\nRoot: /w/dlg_1\n\nResources:\n  - a: /w/dlg_1/a (rw)\n  - b: /w/dlg_1/b (rw)"
        );
    }

    #[test]
    fn excerpts_are_one_short_line() {
        assert_eq!(excerpt("a\n  b\tc"), "a b c");
        let long = "x".repeat(1000);
        assert_eq!(excerpt(&long).chars().count(), 301);
    }

    #[test]
    fn random_ids_look_like_uuids() {
        let id = random_id();
        assert_eq!(id.len(), 36);
        assert_eq!(id.matches('-').count(), 4);
        assert_ne!(id, random_id());
    }
}
