//! Remote agents for the adapter tests: a plain HTTP agent in the shape `executor
//! --agent-http` speaks (docs/PROTOCOL.md, "Agents behind adapters"), and the A2A agent
//! of `tests/fixtures/a2a_agent` (the official `a2a-sdk`) started as a process.
//!
//! Both run the commands of the task's prompt in the working directory the request names:
//! `write PATH TEXT`, `fail MESSAGE`, `sleep SECONDS`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

/// How the HTTP agent answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpMode {
    /// One `application/x-ndjson` stream of updates.
    Ndjson,
    /// `text/event-stream`, one update per `data:` event.
    Sse,
    /// `accepted` with a `pollUrl` and a `cancelUrl`; the work runs in the background.
    Poll,
    /// A 200 answer that is not an update (a misbehaving agent).
    Garbage,
}

/// The HTTP agent's state.
pub struct HttpAgentState {
    mode: HttpMode,
    /// Every task body received.
    pub requests: Mutex<Vec<Value>>,
    /// Task numbers cancelled through `cancelUrl`.
    pub cancels: Mutex<Vec<usize>>,
    /// Each polled task's current update.
    status: Mutex<Vec<Value>>,
}

/// A running HTTP agent.
pub struct HttpAgent {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its state.
    pub state: Arc<HttpAgentState>,
}

impl HttpAgent {
    /// Serve on loopback.
    pub async fn start(mode: HttpMode) -> HttpAgent {
        let state = Arc::new(HttpAgentState {
            mode,
            requests: Mutex::new(Vec::new()),
            cancels: Mutex::new(Vec::new()),
            status: Mutex::new(Vec::new()),
        });
        let app = axum::Router::new()
            .route("/agent", post(task))
            .route("/tasks/{n}", get(poll))
            .route("/tasks/{n}/cancel", post(cancel))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        HttpAgent { addr, state }
    }

    /// The URL tasks are POSTed to.
    pub fn url(&self) -> String {
        format!("http://{}/agent", self.addr)
    }
}

/// Run the prompt's commands in `cwd`, sending each update; stops early on `fail` or when
/// `cancelled` says so.
async fn work(
    prompt: &str,
    cwd: &Path,
    cancelled: impl Fn() -> bool,
    send: impl Fn(Value) -> bool,
) {
    let mut written = 0;
    for line in prompt.lines() {
        let (verb, rest) = line.trim().split_once(' ').unwrap_or((line.trim(), ""));
        match verb {
            "write" => {
                let (path, body) = rest.split_once(' ').unwrap_or((rest, ""));
                let target = cwd.join(path);
                if let Some(parent) = target.parent() {
                    let _ = std::fs::create_dir_all(parent);
                }
                if let Err(e) = std::fs::write(&target, format!("{body}\n")) {
                    send(json!({"type": "error", "message": format!("writing {path}: {e}")}));
                    return;
                }
                written += 1;
                if !send(json!({"type": "progress", "message": format!("wrote {path}")})) {
                    return;
                }
            }
            "fail" => {
                send(json!({"type": "error", "message": rest}));
                return;
            }
            "sleep" => {
                send(json!({"type": "progress", "message": format!("sleeping {rest}s")}));
                let secs: f64 = rest.parse().unwrap_or(1.0);
                let end = std::time::Instant::now() + Duration::from_secs_f64(secs);
                while std::time::Instant::now() < end {
                    if cancelled() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            _ => {}
        }
        if cancelled() {
            return;
        }
    }
    send(
        json!({"type": "done", "summary": format!("edited {written} file(s) in {}", cwd.display())}),
    );
}

async fn task(State(st): State<Arc<HttpAgentState>>, Json(body): Json<Value>) -> Response {
    st.requests.lock().unwrap().push(body.clone());
    let prompt = body["task"]["prompt"].as_str().unwrap_or("").to_string();
    let cwd = PathBuf::from(
        body["workspace"]["workingDirectory"]
            .as_str()
            .unwrap_or("/nonexistent"),
    );
    match st.mode {
        HttpMode::Garbage => (
            [("content-type", "application/json")],
            r#"{"status":"ok but not an update"}"#,
        )
            .into_response(),
        HttpMode::Poll => {
            let n = {
                let mut s = st.status.lock().unwrap();
                s.push(json!({"type": "progress", "message": "queued"}));
                s.len() - 1
            };
            let st2 = st.clone();
            tokio::spawn(async move {
                let st3 = st2.clone();
                work(
                    &prompt,
                    &cwd,
                    || st3.cancels.lock().unwrap().contains(&n),
                    |u| {
                        st2.status.lock().unwrap()[n] = u;
                        true
                    },
                )
                .await;
            });
            Json(json!({"type": "accepted", "pollUrl": format!("/tasks/{n}"),
                        "cancelUrl": format!("/tasks/{n}/cancel")}))
            .into_response()
        }
        HttpMode::Ndjson | HttpMode::Sse => {
            let sse = st.mode == HttpMode::Sse;
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Result<String, std::io::Error>>();
            tokio::spawn(async move {
                let tx2 = tx.clone();
                work(
                    &prompt,
                    &cwd,
                    move || tx2.is_closed(),
                    |u| {
                        let line = if sse {
                            format!("data: {u}\n\n")
                        } else {
                            format!("{u}\n")
                        };
                        tx.send(Ok(line)).is_ok()
                    },
                )
                .await;
            });
            let stream = tokio_stream_from(rx);
            let ctype = if sse {
                "text/event-stream"
            } else {
                "application/x-ndjson"
            };
            ([("content-type", ctype)], Body::from_stream(stream)).into_response()
        }
    }
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Result<String, std::io::Error>>,
) -> impl futures::Stream<Item = Result<String, std::io::Error>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn poll(State(st): State<Arc<HttpAgentState>>, UrlPath(n): UrlPath<usize>) -> Response {
    match st.status.lock().unwrap().get(n) {
        Some(u) => Json(u.clone()).into_response(),
        None => (axum::http::StatusCode::NOT_FOUND, "no such task").into_response(),
    }
}

async fn cancel(State(st): State<Arc<HttpAgentState>>, UrlPath(n): UrlPath<usize>) -> Response {
    st.cancels.lock().unwrap().push(n);
    Json(json!({"ok": true})).into_response()
}

/// The Python that has the pinned `a2a-sdk` (`.ci/run` makes the venv): `AWCP_A2A_PYTHON`,
/// else `/opt/awcp-a2a-venv/bin/python`. `None` (loudly) when it is missing outside CI;
/// under `CI=true` a missing one fails the test.
pub fn a2a_python() -> Option<PathBuf> {
    let py = std::env::var_os("AWCP_A2A_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/awcp-a2a-venv/bin/python"));
    let ok = std::process::Command::new(&py)
        .args(["-c", "import a2a.server.apps, uvicorn"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!(
            "the A2A adapter tests must run in CI, but {} has no a2a-sdk (.ci/run installs it)",
            py.display()
        );
    }
    eprintln!(
        "\n!!!!!!!! SKIPPING an A2A test: no a2a-sdk at {} (run the venv lines of .ci/run, or set AWCP_A2A_PYTHON) !!!!!!!!\n",
        py.display()
    );
    None
}

/// The A2A agent of `tests/fixtures/a2a_agent`, as a process; killed on drop.
pub struct A2aAgent {
    child: std::process::Child,
    /// Its base URL (the card is under it).
    pub url: String,
    /// The log of what it received (JSON lines).
    pub log: PathBuf,
}

impl A2aAgent {
    /// Start it with `python`; `streaming` sets its card's `capabilities.streaming`.
    pub fn start(python: &Path, log: &Path, streaming: bool) -> A2aAgent {
        use std::io::BufRead as _;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/a2a_agent/agent.py");
        let mut cmd = std::process::Command::new(python);
        cmd.arg(script).arg("--log").arg(log);
        if !streaming {
            cmd.arg("--no-streaming");
        }
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("starting the A2A agent");
        let out = child.stdout.take().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(out)
            .read_line(&mut line)
            .expect("reading the A2A agent's port");
        let port = line
            .trim()
            .strip_prefix("LISTENING ")
            .unwrap_or_else(|| panic!("the A2A agent said {line:?}"))
            .to_string();
        A2aAgent {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log: log.to_path_buf(),
        }
    }

    /// The JSON lines it logged.
    pub fn logged(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for A2aAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
