//! Stand-ins for the reference implementation, written from its wire shapes only (plain
//! JSON over HTTP, `data:` SSE lines, the `archive` transport), to test that our services
//! interoperate with it in both directions.
//!
//! [`RefExecutor`] is a minimal Executor: INVITE → ACCEPT, START → unpack, run a closure
//! over the work directory, send `status`, `snapshot` (zip of the whole work directory)
//! and `done` on the task's SSE stream. It keeps every message it received. Besides
//! `archive` it takes the reference's `storage` (GET `downloadUrl`, PUT the result zip to
//! `uploadUrl`, `snapshotBase64` = `{"resultUrl": …}`) and `git` (clone `baseBranch`,
//! commit and push `awcp/<id>`, `snapshotBase64` = `{branch, commitHash, baseCommit,
//! changedFiles}`), as its transport packages behave on the wire, and `sshfs` (mount the
//! handle with the system's `sshfs` and the reference's options, work on the mount,
//! unmount, `done` with no snapshot: the writes were live).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use serde_json::{Value, json};
use sha2::Digest as _;
use tokio::sync::{Notify, mpsc};

/// What the stand-in does to the unpacked work directory before answering.
pub type Work = Arc<dyn Fn(&Path) + Send + Sync>;

struct Task {
    events: Option<mpsc::UnboundedReceiver<String>>,
    tx: mpsc::UnboundedSender<String>,
}

/// The state of the stand-in Executor.
pub struct RefState {
    work_dir: PathBuf,
    work: Work,
    tasks: Mutex<HashMap<String, Task>>,
    /// Every body posted to the message endpoint, in order.
    pub messages: Mutex<Vec<Value>>,
    /// Ids acknowledged with `POST /tasks/:id/ack`.
    pub acks: Mutex<Vec<String>>,
    /// Ids cancelled with `POST /cancel/:id`.
    pub cancels: Mutex<Vec<String>>,
    /// The task waits for this before packing its snapshot (a test changes the
    /// Delegator's copy meanwhile).
    pub proceed: Notify,
    /// Whether to wait for [`RefState::proceed`].
    pub hold: bool,
    /// Behave as the reference's multi-round branch: end the task with `round_done` and
    /// send `done` only after CLOSE.
    pub rounds: std::sync::atomic::AtomicBool,
    /// Lose the event stream right after `status` (reconnects get an empty stream), as a
    /// broken connection would; the result stays available at `/tasks/:id/result`.
    pub drop_stream: std::sync::atomic::AtomicBool,
    /// Leave the `snapshot` event out of the stream (as a stream reopened after a
    /// Delegator restart would: the reference replays only the final event); `done` still
    /// names it and `/tasks/:id/result` has it.
    pub omit_snapshot: std::sync::atomic::AtomicBool,
    /// Results by id, as `GET /tasks/:id/result` serves them.
    pub results: Mutex<HashMap<String, Value>>,
}

/// A running stand-in Executor.
pub struct RefExecutor {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its state.
    pub state: Arc<RefState>,
}

impl RefExecutor {
    /// Serve on loopback; unpack under `work_dir`, then run `work` on the work directory.
    pub async fn start(work_dir: &Path, hold: bool, work: Work) -> RefExecutor {
        let state = Arc::new(RefState {
            work_dir: work_dir.to_path_buf(),
            work,
            tasks: Mutex::new(HashMap::new()),
            messages: Mutex::new(Vec::new()),
            acks: Mutex::new(Vec::new()),
            cancels: Mutex::new(Vec::new()),
            proceed: Notify::new(),
            hold,
            rounds: Default::default(),
            drop_stream: Default::default(),
            omit_snapshot: Default::default(),
            results: Mutex::new(HashMap::new()),
        });
        let app = axum::Router::new()
            .route("/awcp", post(message))
            .route("/awcp/tasks/{id}/events", get(events))
            .route("/awcp/tasks/{id}/ack", post(ack))
            .route("/awcp/tasks/{id}/result", get(result))
            .route("/awcp/cancel/{id}", post(cancel))
            .route("/awcp/status", get(status))
            .with_state(state.clone())
            .layer(axum::extract::DefaultBodyLimit::max(64 << 20));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        RefExecutor { addr, state }
    }

    /// The AWCP endpoint URL.
    pub fn url(&self) -> String {
        format!("http://{}/awcp", self.addr)
    }
}

fn now() -> String {
    // The reference's `toISOString()` shape; the exact time does not matter here.
    "2026-03-09T13:38:47.123Z".to_string()
}

async fn message(State(st): State<Arc<RefState>>, Json(body): Json<Value>) -> Response {
    st.messages.lock().unwrap().push(body.clone());
    let id = body["delegationId"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    match body["type"].as_str().unwrap_or_default() {
        "INVITE" => {
            let (tx, rx) = mpsc::unbounded_channel();
            st.tasks.lock().unwrap().insert(
                id.clone(),
                Task {
                    events: Some(rx),
                    tx,
                },
            );
            Json(json!({
                "version": "1", "type": "ACCEPT", "delegationId": id,
                "retentionMs": body["retentionMs"],
                "executorWorkDir": {"path": st.work_dir.join(&id).display().to_string()},
                "executorConstraints": {
                    "acceptedAccessMode": body["lease"]["accessMode"],
                    "maxTtlSeconds": body["lease"]["ttlSeconds"],
                    "sandboxProfile": {"cwdOnly": true, "allowNetwork": true, "allowExec": true}
                }
            }))
            .into_response()
        }
        "START" => {
            let Some(tx) = st.tasks.lock().unwrap().get(&id).map(|t| t.tx.clone()) else {
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Json(json!({"error": format!("Unknown delegation for START: {id}")})),
                )
                    .into_response();
            };
            let handle = body["transportHandle"].clone();
            let st2 = st.clone();
            tokio::spawn(async move { run(st2, id, handle, tx).await });
            Json(json!({"ok": true})).into_response()
        }
        // As the reference's multi-round Executor: `status` "Round N execution started",
        // then `round_done` for the round.
        "CONTINUE" if st.rounds.load(std::sync::atomic::Ordering::SeqCst) => {
            let round = body["round"].as_u64().unwrap_or(0);
            if let Some(t) = st.tasks.lock().unwrap().get(&id) {
                let _ = t.tx.send(event(
                    &id,
                    "status",
                    json!({"status": "running", "message": format!("Round {round} execution started")}),
                ));
                let _ = t.tx.send(event(
                    &id,
                    "round_done",
                    json!({"round": round, "summary": format!("did round {round}")}),
                ));
            }
            Json(json!({"ok": true})).into_response()
        }
        "CLOSE" if st.rounds.load(std::sync::atomic::Ordering::SeqCst) => {
            if let Some(t) = st.tasks.lock().unwrap().get(&id) {
                let _ = t.tx.send(event(
                    &id,
                    "done",
                    json!({"summary": "Session closed by delegator"}),
                ));
            }
            Json(json!({"ok": true})).into_response()
        }
        other => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": format!("Unexpected message type: {other}")})),
        )
            .into_response(),
    }
}

fn event(id: &str, kind: &str, mut fields: Value) -> String {
    let mut ev = json!({"delegationId": id, "type": kind, "timestamp": now()});
    ev.as_object_mut()
        .unwrap()
        .append(fields.as_object_mut().unwrap());
    ev.to_string()
}

async fn run(st: Arc<RefState>, id: String, handle: Value, tx: mpsc::UnboundedSender<String>) {
    let fail = |msg: String| {
        let _ = tx.send(event(
            &id,
            "error",
            json!({"code": "TASK_FAILED", "message": msg}),
        ));
    };
    let dir = st.work_dir.join(&id);
    let kind = handle["transport"].as_str().unwrap_or_default().to_string();
    if kind == "sshfs" {
        let keys = st.work_dir.join(format!("{id}-keys"));
        if let Err(e) = sshfs_mount(&handle, &dir, &keys) {
            return fail(e);
        }
        let _ = tx.send(event(
            &id,
            "status",
            json!({"status": "running", "message": "Task execution started"}),
        ));
        if st.hold {
            st.proceed.notified().await;
        }
        (st.work)(&dir);
        // Lazily, as the reference's forced unmount ends a mount whose server is gone.
        let _ = std::process::Command::new("fusermount")
            .arg("-uz")
            .arg(&dir)
            .status();
        let _ = std::fs::remove_dir_all(&keys);
        let _ = tx.send(event(&id, "done", json!({"summary": "did the work"})));
        return;
    }
    if kind == "git" {
        if let Err(e) = git_clone(&handle, &id, &dir) {
            return fail(e);
        }
        let _ = tx.send(event(
            &id,
            "status",
            json!({"status": "running", "message": "Task execution started"}),
        ));
        (st.work)(&dir);
        let info = match git_push(&handle, &id, &dir) {
            Ok(info) => info,
            Err(e) => return fail(e),
        };
        let _ = tx.send(event(
            &id,
            "snapshot",
            json!({"snapshotId": "snap_1a2b3c4d5e6f", "summary": "did the work",
                   "snapshotBase64": info, "recommended": true}),
        ));
        let _ = tx.send(event(&id, "done", json!({"summary": "did the work"})));
        return;
    }
    let zip = match kind.as_str() {
        "archive" => base64::engine::general_purpose::STANDARD
            .decode(handle["workspaceBase64"].as_str().unwrap_or_default())
            .unwrap_or_default(),
        "storage" => {
            let url = handle["downloadUrl"].as_str().unwrap_or_default();
            match reqwest::get(url).await {
                Ok(r) if r.status().is_success() => r.bytes().await.unwrap_or_default().to_vec(),
                Ok(r) => return fail(format!("Failed to download workspace: {}", r.status())),
                Err(e) => return fail(format!("Failed to download workspace: {e}")),
            }
        }
        _ => return fail("unexpected transport type".into()),
    };
    let sum = hex::encode(sha2::Sha256::digest(&zip));
    if Some(sum.as_str()) != handle["checksum"].as_str() {
        let _ = tx.send(event(
            &id,
            "error",
            json!({"code": "CHECKSUM_MISMATCH", "message": "Checksum mismatch"}),
        ));
        return;
    }
    unzip(&zip, &dir);
    let _ = tx.send(event(
        &id,
        "status",
        json!({"status": "running", "message": "Task execution started"}),
    ));
    if st.hold {
        st.proceed.notified().await;
    }
    (st.work)(&dir);
    let snapshot = if kind == "storage" {
        let url = handle["uploadUrl"].as_str().unwrap_or_default().to_string();
        let put = reqwest::Client::new()
            .put(&url)
            .header("Content-Type", "application/zip")
            .body(zip_dir(&dir))
            .send()
            .await;
        if !put.is_ok_and(|r| r.status().is_success()) {
            return fail("Failed to upload snapshot".into());
        }
        json!({ "resultUrl": url }).to_string()
    } else {
        base64::engine::general_purpose::STANDARD.encode(zip_dir(&dir))
    };
    let omit = st.omit_snapshot.load(std::sync::atomic::Ordering::SeqCst);
    let _ = (!omit).then(|| {
        tx.send(event(
            &id,
            "snapshot",
            json!({"snapshotId": "snap_1a2b3c4d5e6f", "summary": "did the work",
               "snapshotBase64": snapshot, "recommended": true}),
        ))
    });
    let end = if st.rounds.load(std::sync::atomic::Ordering::SeqCst) {
        json!({"round": 1, "summary": "did the work", "snapshotIds": ["snap_1a2b3c4d5e6f"],
               "recommendedSnapshotId": "snap_1a2b3c4d5e6f"})
    } else {
        json!({"summary": "did the work", "highlights": ["workspace/a.txt"],
               "snapshotIds": ["snap_1a2b3c4d5e6f"], "recommendedSnapshotId": "snap_1a2b3c4d5e6f"})
    };
    st.results.lock().unwrap().insert(
        id.clone(),
        json!({"status": "completed", "completedAt": now(), "summary": "did the work",
               "snapshotBase64": snapshot}),
    );
    let kind = if st.rounds.load(std::sync::atomic::Ordering::SeqCst) {
        "round_done"
    } else {
        "done"
    };
    let _ = tx.send(event(&id, kind, end));
}

/// Mount an `sshfs` handle at `dir` as the reference's Executor does: key and certificate
/// written beside it, host key unchecked, its fixed options plus the handle's.
fn sshfs_mount(handle: &Value, dir: &Path, keys: &Path) -> Result<(), String> {
    std::fs::create_dir_all(keys).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let key = keys.join("key");
    let cert = keys.join("key-cert.pub");
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    std::fs::write(&key, text(&handle["credential"]["privateKey"])).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .map_err(|e| e.to_string())?;
    std::fs::write(&cert, text(&handle["credential"]["certificate"])).map_err(|e| e.to_string())?;
    let ep = &handle["endpoint"];
    let mut args = vec![
        format!(
            "{}@{}:{}",
            text(&ep["user"]),
            text(&ep["host"]),
            text(&handle["exportLocator"])
        ),
        dir.display().to_string(),
    ];
    for o in [
        format!("IdentityFile={}", key.display()),
        format!("CertificateFile={}", cert.display()),
        format!("Port={}", ep["port"]),
        "StrictHostKeyChecking=no".into(),
        "UserKnownHostsFile=/dev/null".into(),
        "reconnect".into(),
        "ServerAliveInterval=15".into(),
        "ServerAliveCountMax=3".into(),
        "follow_symlinks".into(),
    ] {
        args.push("-o".into());
        args.push(o);
    }
    if let Some(opts) = handle["options"].as_object() {
        for (k, v) in opts {
            args.push("-o".into());
            args.push(format!("{k}={}", text(v)));
        }
    }
    let out = std::process::Command::new("sshfs")
        .args(&args)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn git(dir: Option<&Path>, args: &[&str]) -> Result<String, String> {
    let mut c = std::process::Command::new("git");
    if let Some(d) = dir {
        c.current_dir(d);
    }
    let out = c
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "git {} failed: {}",
            args[0],
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The reference's git Executor setup: clone the base branch, check out `awcp/<id>`.
fn git_clone(handle: &Value, id: &str, dir: &Path) -> Result<(), String> {
    let (url, branch) = (
        handle["repoUrl"].as_str().unwrap_or_default(),
        handle["baseBranch"].as_str().unwrap_or_default(),
    );
    let d = dir.display().to_string();
    git(
        None,
        &["clone", "--branch", branch, "--single-branch", url, &d],
    )?;
    git(Some(dir), &["checkout", "-b", &format!("awcp/{id}")])?;
    git(Some(dir), &["config", "user.name", "AWCP Executor"])?;
    git(Some(dir), &["config", "user.email", "executor@awcp.local"])?;
    Ok(())
}

/// The reference's git Executor capture: commit everything, push `awcp/<id>`, report it.
fn git_push(handle: &Value, id: &str, dir: &Path) -> Result<String, String> {
    let base = handle["baseCommit"].as_str().unwrap_or_default();
    if !git(Some(dir), &["status", "--porcelain"])?
        .trim()
        .is_empty()
    {
        git(Some(dir), &["add", "-A"])?;
        git(
            Some(dir),
            &["commit", "-m", &format!("AWCP: Task completed for {id}")],
        )?;
    }
    let branch = format!("awcp/{id}");
    git(Some(dir), &["push", "-u", "origin", &branch])?;
    let commit = git(Some(dir), &["rev-parse", "HEAD"])?.trim().to_string();
    let changed: Vec<String> = git(Some(dir), &["diff", "--name-only", base, "HEAD"])?
        .lines()
        .map(str::to_string)
        .collect();
    Ok(
        json!({"branch": branch, "commitHash": commit, "baseCommit": base,
              "changedFiles": changed})
        .to_string(),
    )
}

async fn events(State(st): State<Arc<RefState>>, UrlPath(id): UrlPath<String>) -> Response {
    let rx = st
        .tasks
        .lock()
        .unwrap()
        .get_mut(&id)
        .and_then(|t| t.events.take());
    let drop_stream = st.drop_stream.load(std::sync::atomic::Ordering::SeqCst);
    if rx.is_none() && drop_stream {
        return ([("content-type", "text/event-stream")], "").into_response();
    }
    let Some(mut rx) = rx else {
        let one = format!(
            "data: {}\n\n",
            event(
                &id,
                "error",
                json!({"code": "NOT_FOUND", "message": "Delegation not found on executor"})
            )
        );
        return ([("content-type", "text/event-stream")], one).into_response();
    };
    let stream = async_stream(move |out| async move {
        while let Some(ev) = rx.recv().await {
            let last = ev.contains("\"type\":\"done\"") || ev.contains("\"type\":\"error\"");
            if out.send(format!("data: {ev}\n\n")).is_err() || last {
                break;
            }
            if drop_stream && ev.contains("\"type\":\"status\"") {
                break;
            }
        }
    });
    (
        [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// A stream of strings fed by a task.
fn async_stream<F, Fut>(
    f: F,
) -> impl futures::Stream<Item = Result<String, std::convert::Infallible>>
where
    F: FnOnce(mpsc::UnboundedSender<String>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(f(tx));
    futures::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|s| (Ok(s), rx)) },
    )
}

async fn result(State(st): State<Arc<RefState>>, UrlPath(id): UrlPath<String>) -> Response {
    match st.results.lock().unwrap().get(&id) {
        Some(r) => Json(r.clone()).into_response(),
        None => (StatusCode::NOT_FOUND, Json(json!({"status": "not_found"}))).into_response(),
    }
}

/// The reference's status: counts and running tasks, no list of transports.
async fn status(State(st): State<Arc<RefState>>) -> Json<Value> {
    let n = st.tasks.lock().unwrap().len();
    Json(json!({"pendingInvitations": 0, "activeDelegations": n,
                "completedDelegations": 0, "delegations": []}))
}

async fn ack(State(st): State<Arc<RefState>>, UrlPath(id): UrlPath<String>) -> Json<Value> {
    st.acks.lock().unwrap().push(id);
    Json(json!({"ok": true}))
}

async fn cancel(State(st): State<Arc<RefState>>, UrlPath(id): UrlPath<String>) -> Json<Value> {
    st.cancels.lock().unwrap().push(id);
    Json(json!({"ok": true, "cancelled": true}))
}

/// Unpack a zip (trusted: made by the code under test) into `dir`.
pub fn unzip(zip: &[u8], dir: &Path) {
    let mut a = zip::ZipArchive::new(std::io::Cursor::new(zip)).unwrap();
    for i in 0..a.len() {
        let mut f = a.by_index(i).unwrap();
        let rel = f.enclosed_name().expect("entry escapes the directory");
        let p = dir.join(rel);
        if f.is_dir() {
            std::fs::create_dir_all(&p).unwrap();
        } else {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            let mut data = Vec::new();
            f.read_to_end(&mut data).unwrap();
            std::fs::write(&p, data).unwrap();
        }
    }
}

/// Zip `dir`'s files as `<relative path>` entries (stored, or deflated).
pub fn zip_dir(dir: &Path) -> Vec<u8> {
    let mut files = Vec::new();
    collect(dir, dir, &mut files);
    zip_entries(
        &files
            .iter()
            .map(|(n, d)| (n.as_str(), d.as_slice()))
            .collect::<Vec<_>>(),
        zip::CompressionMethod::Deflated,
    )
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        if p.is_dir() {
            collect(root, &p, out);
        } else {
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            out.push((rel, std::fs::read(&p).unwrap()));
        }
    }
}

/// A zip of these entries.
pub fn zip_entries(entries: &[(&str, &[u8])], method: zip::CompressionMethod) -> Vec<u8> {
    let mut zw = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(method)
        .large_file(entries.iter().any(|(_, d)| d.len() >= u32::MAX as usize));
    for (name, data) in entries {
        zw.start_file(name.to_string(), opts).unwrap();
        zw.write_all(data).unwrap();
    }
    zw.finish().unwrap().into_inner()
}

/// The entries of a zip: name → content.
pub fn read_zip(zip: &[u8]) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut a = zip::ZipArchive::new(std::io::Cursor::new(zip)).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for i in 0..a.len() {
        let mut f = a.by_index(i).unwrap();
        if f.is_dir() {
            continue;
        }
        let name = f.name().unwrap().to_string();
        let mut data = Vec::new();
        f.read_to_end(&mut data).unwrap();
        out.insert(name, data);
    }
    out
}

/// sha256 hex of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Read an SSE response the way the reference's client does: only `data:` lines, each one
/// JSON event; stop after `done` or `error`.
pub async fn read_data_lines(resp: reqwest::Response) -> Vec<Value> {
    use futures::StreamExt;
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line).trim_end().to_string();
            if let Some(data) = line.strip_prefix("data: ")
                && let Ok(v) = serde_json::from_str::<Value>(data)
            {
                let end = v["type"] == "done" || v["type"] == "error";
                out.push(v);
                if end {
                    return out;
                }
            }
        }
    }
    out
}
