//! `awcp-ctl delegate --wait` against an Executor that always works in rounds (as the
//! reference's multi-round branch does): a single-round delegation passes through `idle`,
//! the daemon closes it itself, and the CLI follows it to its end.

use std::collections::HashMap;
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::mpsc;

const BIN: &str = env!("CARGO_BIN_EXE_awcp-ctl");

/// Per delegation: the sender of its event stream, and the receiver until a stream takes it.
type Streams = Arc<
    Mutex<
        HashMap<
            String,
            (
                mpsc::UnboundedSender<Value>,
                Option<mpsc::UnboundedReceiver<Value>>,
            ),
        >,
    >,
>;

fn event(id: &str, kind: &str, extra: Value) -> Value {
    let mut ev = json!({"delegationId": id, "type": kind, "timestamp": "2026-01-01T00:00:00.000Z"});
    if let (Some(o), Value::Object(e)) = (ev.as_object_mut(), extra) {
        o.extend(e);
    }
    ev
}

async fn message(State(st): State<Streams>, Json(body): Json<Value>) -> Response {
    let id = body["delegationId"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let send = |ev: Value| {
        if let Some((tx, _)) = st.lock().unwrap().get(&id) {
            let _ = tx.send(ev);
        }
    };
    match body["type"].as_str().unwrap_or_default() {
        "INVITE" => {
            let (tx, rx) = mpsc::unbounded_channel();
            st.lock().unwrap().insert(id.clone(), (tx, Some(rx)));
            Json(json!({
                "version": "1", "type": "ACCEPT", "delegationId": id,
                "retentionMs": body["retentionMs"],
                "executorWorkDir": {"path": "/tmp/rounds"},
                "executorConstraints": {"acceptedAccessMode": "rw", "maxTtlSeconds": 3600,
                    "sandboxProfile": {"cwdOnly": true, "allowNetwork": true, "allowExec": true}}
            }))
            .into_response()
        }
        "START" => {
            send(event(
                &id,
                "status",
                json!({"status": "running", "message": "started"}),
            ));
            send(event(
                &id,
                "round_done",
                json!({"round": 1, "summary": "did the work"}),
            ));
            Json(json!({"ok": true})).into_response()
        }
        "CLOSE" => {
            send(event(
                &id,
                "done",
                json!({"summary": "Session closed by delegator"}),
            ));
            Json(json!({"ok": true})).into_response()
        }
        _ => Json(json!({"ok": true})).into_response(),
    }
}

async fn events(State(st): State<Streams>, Path(id): Path<String>) -> Response {
    let rx = st
        .lock()
        .unwrap()
        .get_mut(&id)
        .and_then(|(_, rx)| rx.take());
    let Some(rx) = rx else {
        return axum::http::StatusCode::NOT_FOUND.into_response();
    };
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let ev = rx.recv().await?;
        Some((
            Ok::<_, std::convert::Infallible>(format!("data: {ev}\n\n")),
            rx,
        ))
    });
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn cli(daemon: &str, args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("--daemon").arg(daemon).args(args);
    tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("the CLI hung")
        .unwrap()
}

// Symptom: `delegate --wait` without `--multi-round` exited at the first `idle` state and
// printed the "`awcp-ctl continue`" hint, although the daemon closes the session itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wait_follows_a_single_round_delegation_through_idle_to_its_end() {
    let streams: Streams = Arc::default();
    let app = axum::Router::new()
        .route("/awcp", post(message))
        .route("/awcp/tasks/{id}/events", get(events))
        .route(
            "/awcp/tasks/{id}/ack",
            post(|| async { Json(json!({"ok": true})) }),
        )
        .with_state(streams);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let executor = format!("http://{}/awcp", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    let tmp = tempfile::tempdir().unwrap();
    let mut dcfg = awcp_ctl::daemon::DaemonConfig::new(tmp.path().join("delegator"));
    dcfg.listen = "127.0.0.1:0".parse().unwrap();
    dcfg.export_listen = "127.0.0.1:0".parse().unwrap();
    // The Executor's credential, handed to the daemon (`serve --executor-token-file`).
    dcfg.executor_token = Some("test-executor-credential".into());
    let daemon = awcp_ctl::daemon::start(dcfg).await.unwrap();
    let ws = tmp.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "a\n").unwrap();

    let out = cli(
        &daemon.token_url(),
        &[
            "delegate",
            ws.to_str().unwrap(),
            "--to",
            &executor,
            "--transport",
            "archive",
            "--task",
            "one round",
            "--wait",
        ],
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        !stdout.contains("awcp-ctl continue"),
        "no continue hint for a single-round delegation: {stdout}"
    );
    let id = stdout
        .split_whitespace()
        .find(|w| w.starts_with("dlg_"))
        .expect("the delegation id");
    let client = daemon.client();
    let v = client.get(id).await.unwrap();
    assert_eq!(
        v.record.state,
        awcp_protocol::DelegationState::Completed,
        "--wait returned before the end: {stdout}"
    );
    assert_eq!(v.record.result.unwrap().summary, "did the work");
    daemon.stop().await;
}
