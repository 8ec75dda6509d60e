//! Interoperability with the reference implementation, on the wire, both ways, with the
//! `archive` transport:
//! * a minimal delegator written here (reqwest, the reference's JSON shapes, reading only
//!   `data:` SSE lines) drives our Executor;
//! * our daemon delegates to a minimal executor written here
//!   ([`awcp_tests::reference::RefExecutor`]).

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};

use awcp_protocol::DelegationState;
use awcp_protocol::api::{DelegateRequest, EnvironmentSpec, ResourceSpec, SnapshotMode};
use awcp_protocol::messages::{AccessMode, ResourceType, TaskSpec};
use awcp_protocol::{DelegationId, TransportType};
use awcp_tests::reference::{RefExecutor, read_data_lines, read_zip, sha256_hex, zip_entries};
use awcp_tests::{Harness, fuse_available};

const TIMEOUT: Duration = Duration::from_secs(60);

fn new_id() -> String {
    DelegationId::from_random_bytes(rand::random())
        .as_str()
        .to_string()
}

/// The reference's INVITE, with the SDK's `auth` option set to the Executor's credential
/// (`{type: "bearer", credential}`), as its documented secure configuration sends it.
fn invite(credential: &str, id: &str, ttl: u64, transport: &str) -> Value {
    json!({
        "version": "1", "type": "INVITE", "delegationId": id,
        "auth": {"type": "bearer", "credential": credential},
        "task": {"description": "Fix it", "prompt": "Fix the bug"},
        "lease": {"ttlSeconds": ttl, "accessMode": "rw"},
        "retentionMs": 604800000,
        "environment": {"resources": [{"name": "workspace", "type": "fs", "mode": "rw"}]},
        "requirements": {"transport": transport}
    })
}

fn start(id: &str, zip: &[u8], checksum: &str) -> Value {
    json!({
        "version": "1", "type": "START", "delegationId": id,
        "lease": {"expiresAt": "2099-01-01T00:00:00.000Z", "accessMode": "rw"},
        "transportHandle": {
            "transport": "archive",
            "workspaceBase64": base64::engine::general_purpose::STANDARD.encode(zip),
            "checksum": checksum
        }
    })
}

async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// INVITE, open the stream, START: what the reference's delegator does. Returns the events.
async fn delegate_archive(
    awcp: &str,
    credential: &str,
    id: &str,
    zip: &[u8],
    checksum: &str,
) -> Vec<Value> {
    let (s, accept) = post(awcp, &invite(credential, id, 600, "archive")).await;
    assert_eq!(s, 200);
    assert_eq!(accept["type"], "ACCEPT", "{accept}");
    let events = reqwest::get(format!("{awcp}/tasks/{id}/events"))
        .await
        .unwrap();
    assert_eq!(events.status().as_u16(), 200);
    let (s, ok) = post(awcp, &start(id, zip, checksum)).await;
    assert_eq!((s, ok), (200, json!({"ok": true})));
    tokio::time::timeout(TIMEOUT, read_data_lines(events))
        .await
        .expect("the task did not end")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reference_delegator_drives_our_executor_with_archive() {
    if !fuse_available() {
        return;
    }
    // Symptom: the agent ran in the work directory with the resource under `./workspace/`,
    // so writing `a.txt` in its working directory silently changed nothing. With one
    // resource its working directory is the resource (`<workPath>/<name>`), as with awcpfs.
    let agent = r#"set -e
        test "$(basename "$PWD")" = workspace
        test "$AWCP_WORKSPACE" = "$PWD"
        test -f sub/b.txt
        echo changed > a.txt
        rm gone.txt
        mkdir -p new && echo n > new/f.txt
        echo finished-the-work"#;
    let h = Harness::start(agent).await;
    let awcp = h.executor.awcp_url();
    let id = new_id();
    let (s, accept) = post(&awcp, &invite(&h.credential(), &id, 600, "archive")).await;
    assert_eq!(s, 200);
    // The reference's ACCEPT, field for field.
    assert_eq!(accept["version"], "1");
    assert_eq!(accept["delegationId"], id);
    assert_eq!(accept["retentionMs"], 604800000);
    assert!(
        accept["executorWorkDir"]["path"]
            .as_str()
            .unwrap()
            .ends_with(&id),
        "{accept}"
    );
    assert_eq!(accept["executorConstraints"]["acceptedAccessMode"], "rw");
    assert_eq!(accept["executorConstraints"]["maxTtlSeconds"], 600);
    assert_eq!(
        accept["executorConstraints"]["sandboxProfile"],
        json!({"cwdOnly": true, "allowNetwork": true, "allowExec": true})
    );
    let zip = zip_entries(
        &[
            ("workspace/a.txt", b"original\n"),
            ("workspace/gone.txt", b"bye\n"),
            ("workspace/sub/b.txt", b"b\n"),
        ],
        zip::CompressionMethod::Deflated,
    );
    // A second INVITE for the same id resets it, as the reference's does.
    let (_, again) = post(&awcp, &invite(&h.credential(), &id, 600, "archive")).await;
    assert_eq!(again["type"], "ACCEPT");
    let events = reqwest::get(format!("{awcp}/tasks/{id}/events"))
        .await
        .unwrap();
    let (s, ok) = post(&awcp, &start(&id, &zip, &sha256_hex(&zip))).await;
    assert_eq!((s, ok), (200, json!({"ok": true})));
    let events = tokio::time::timeout(TIMEOUT, read_data_lines(events))
        .await
        .unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds.first(), Some(&"status"), "{events:?}");
    assert_eq!(events[0]["status"], "running");
    assert_eq!(&kinds[kinds.len() - 2..], ["snapshot", "done"], "{kinds:?}");
    for e in &events {
        assert_eq!(e["delegationId"], id);
        assert!(e["timestamp"].as_str().unwrap().ends_with('Z'), "{e}");
    }
    let snap = &events[kinds.len() - 2];
    let done = &events[kinds.len() - 1];
    let sid = snap["snapshotId"].as_str().unwrap();
    assert!(sid.starts_with("snap_") && sid.len() == 17, "{sid}");
    assert_eq!(snap["recommended"], true);
    assert_eq!(done["snapshotIds"], json!([sid]));
    assert_eq!(done["recommendedSnapshotId"], sid);
    assert!(
        done["summary"]
            .as_str()
            .unwrap()
            .contains("finished-the-work"),
        "{done}"
    );
    // The snapshot is a zip of the whole work directory, `<resource>/…`.
    let result = base64::engine::general_purpose::STANDARD
        .decode(snap["snapshotBase64"].as_str().unwrap())
        .unwrap();
    let files = read_zip(&result);
    assert_eq!(files["workspace/a.txt"], b"changed\n");
    assert_eq!(files["workspace/new/f.txt"], b"n\n");
    assert_eq!(files["workspace/sub/b.txt"], b"b\n");
    assert!(
        !files.contains_key("workspace/gone.txt"),
        "{:?}",
        files.keys()
    );
    // The result is kept for a delegator whose stream dropped, until it acknowledges.
    let r: Value = reqwest::get(format!("{awcp}/tasks/{id}/result"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["status"], "completed");
    assert_eq!(r["snapshotBase64"], snap["snapshotBase64"]);
    assert!(r["completedAt"].is_string());
    let status: Value = reqwest::get(format!("{awcp}/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["completedDelegations"], 1, "{status}");
    assert_eq!(status["activeDelegations"], 0, "{status}");
    assert_eq!(status["pendingInvitations"], 0, "{status}");
    assert_eq!(status["delegations"], json!([]));
    // Ending it again is refused as the reference does (500 {error}).
    let (s, b) = post(&format!("{awcp}/cancel/{id}"), &json!({})).await;
    assert_eq!(s, 500, "{b}");
    assert!(b["error"].is_string());
    let (s, b) = post(&format!("{awcp}/tasks/{id}/ack"), &json!({})).await;
    assert_eq!((s, b), (200, json!({"ok": true})));
    let r = reqwest::get(format!("{awcp}/tasks/{id}/result"))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"status": "not_found"})
    );
    // The unpacked copy is gone.
    assert!(!h.mountpoint(&id).exists());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn our_executor_answers_refusals_and_bad_archives_as_the_reference() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_with("echo should-not-run > ran.txt", |c| {
        c.max_ttl = Duration::from_secs(3600);
        // An Executor without sshfs installed (it serves sshfs only where it is).
        c.transports.retain(|t| *t != TransportType::Sshfs);
    })
    .await;
    let awcp = h.executor.awcp_url();
    // Refusals are HTTP 200 with an ERROR body.
    let id = new_id();
    let (s, b) = post(&awcp, &invite(&h.credential(), &id, 7200, "archive")).await;
    assert_eq!(s, 200);
    assert_eq!(b["type"], "ERROR");
    assert_eq!(b["code"], "DECLINED");
    assert_eq!(
        b["message"],
        "Requested TTL (7200s) exceeds maximum (3600s)"
    );
    assert_eq!(b["hint"], "Request a shorter TTL (max: 3600s)");
    let (s, b) = post(&awcp, &invite(&h.credential(), &id, 60, "sshfs")).await;
    assert_eq!(
        (s, b["type"].as_str(), b["code"].as_str()),
        (200, Some("ERROR"), Some("DEP_MISSING"))
    );
    // Unknown id: 404 {error}; unknown or misdirected type: 400 {error} (the reference
    // answers both with 500; the message is the reference's).
    let zip = zip_entries(&[("workspace/a", b"a")], zip::CompressionMethod::Deflated);
    let (s, b) = post(&awcp, &start(&new_id(), &zip, &sha256_hex(&zip))).await;
    assert_eq!(s, 404);
    assert!(
        b["error"].as_str().unwrap().contains("Unknown delegation"),
        "{b}"
    );
    let done =
        json!({"version": "1", "type": "DONE", "delegationId": new_id(), "finalSummary": "x"});
    let (s, b) = post(&awcp, &done).await;
    assert_eq!(
        (s, b),
        (400, json!({"error": "Unexpected message type: DONE"}))
    );
    let bogus = json!({"version": "1", "type": "BOGUS", "delegationId": new_id()});
    let (s, b) = post(&awcp, &bogus).await;
    assert_eq!(
        (s, b),
        (400, json!({"error": "Unexpected message type: BOGUS"}))
    );
    // Unknown ids elsewhere.
    let unknown = new_id();
    let r = reqwest::get(format!("{awcp}/tasks/{unknown}/events"))
        .await
        .unwrap();
    assert_eq!(
        r.status().as_u16(),
        200,
        "the reference answers with a stream"
    );
    let evs = read_data_lines(r).await;
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0]["type"], "error");
    assert_eq!(evs[0]["code"], "NOT_FOUND");
    let (s, b) = post(&format!("{awcp}/cancel/{unknown}"), &json!({})).await;
    assert_eq!(s, 404);
    assert!(b["error"].as_str().unwrap().contains("not found"), "{b}");
    // A wrong checksum.
    let id = new_id();
    let evs = delegate_archive(&awcp, &h.credential(), &id, &zip, &"0".repeat(64)).await;
    let last = evs.last().unwrap();
    assert_eq!(last["code"], "CHECKSUM_MISMATCH", "{evs:?}");
    assert!(
        last["message"]
            .as_str()
            .unwrap()
            .contains(&sha256_hex(&zip))
    );
    // Entries that would escape the work directory: refused before anything is written.
    for (i, name) in ["workspace/../../escaped.txt", "/tmp/escaped-abs.txt"]
        .iter()
        .enumerate()
    {
        let evil = zip_with_raw_name(name, b"evil");
        let id = new_id();
        let evs = delegate_archive(&awcp, &h.credential(), &id, &evil, &sha256_hex(&evil)).await;
        let last = evs.last().unwrap();
        assert_eq!(last["type"], "error", "{i}: {evs:?}");
        assert_eq!(last["code"], "WORKSPACE_INVALID", "{evs:?}");
        assert!(
            last["message"]
                .as_str()
                .unwrap()
                .contains("unsafe zip entry"),
            "{last}"
        );
    }
    assert!(!h.path("executor/escaped.txt").exists());
    assert!(!h.path("escaped.txt").exists());
    assert!(!std::path::Path::new("/tmp/escaped-abs.txt").exists());
    // A START whose lease is already over.
    let id = new_id();
    let (_, accept) = post(&awcp, &invite(&h.credential(), &id, 60, "archive")).await;
    assert_eq!(accept["type"], "ACCEPT");
    let events = reqwest::get(format!("{awcp}/tasks/{id}/events"))
        .await
        .unwrap();
    let mut late = start(&id, &zip, &sha256_hex(&zip));
    late["lease"]["expiresAt"] = json!("2001-01-01T00:00:00.000Z");
    let (s, _) = post(&awcp, &late).await;
    assert_eq!(s, 200);
    let evs = read_data_lines(events).await;
    assert_eq!(evs.last().unwrap()["code"], "START_EXPIRED", "{evs:?}");
    // START twice.
    let (s, b) = post(&awcp, &late).await;
    assert_eq!(s, 500, "{b}");
    h.stop().await;
}

/// A zip holding one entry whose name the zip writer would refuse (written under a
/// placeholder of the same length, then renamed in the raw bytes).
fn zip_with_raw_name(name: &str, data: &[u8]) -> Vec<u8> {
    let placeholder = "p".repeat(name.len());
    let mut z = zip_entries(&[(&placeholder, data)], zip::CompressionMethod::Stored);
    let (from, to) = (placeholder.as_bytes(), name.as_bytes());
    let mut i = 0;
    while i + from.len() <= z.len() {
        if &z[i..i + from.len()] == from {
            z[i..i + from.len()].copy_from_slice(to);
            i += from.len();
        } else {
            i += 1;
        }
    }
    z
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_archive_start_of_more_than_200_mb_is_accepted() {
    if !fuse_available() {
        return;
    }
    // Building a 200 MB JSON body in a debug build on a loaded machine can take longer than
    // the default pending timeout (60 s) between ACCEPT and START.
    let h = Harness::start_with(
        "set -e; test $(stat -c %s big.bin) = 157286400; rm big.bin; echo ok > small.txt",
        |c| c.pending_timeout = Duration::from_secs(900),
    )
    .await;
    let awcp = h.executor.awcp_url();
    // 150 MiB stored (uncompressed): the JSON body is over 200 MB once in base64.
    let big = vec![7u8; 150 << 20];
    let zip = zip_entries(
        &[("workspace/big.bin", &big)],
        zip::CompressionMethod::Stored,
    );
    drop(big);
    let body = start("dlg_00000000000000000000000000000000", &zip, "x");
    let size = serde_json::to_vec(&body).unwrap().len();
    assert!(size > 200_000_000, "body is only {size} bytes");
    drop(body);
    let id = new_id();
    let evs = delegate_archive(&awcp, &h.credential(), &id, &zip, &sha256_hex(&zip)).await;
    let done = evs.last().unwrap();
    assert_eq!(done["type"], "done", "{evs:?}");
    let snap = evs.iter().find(|e| e["type"] == "snapshot").unwrap();
    let files = read_zip(
        &base64::engine::general_purpose::STANDARD
            .decode(snap["snapshotBase64"].as_str().unwrap())
            .unwrap(),
    );
    assert_eq!(
        files.keys().collect::<Vec<_>>(),
        vec!["workspace/small.txt"]
    );
    h.stop().await;
}

fn archive_request(
    executor_url: String,
    resources: Vec<ResourceSpec>,
    snapshot_mode: SnapshotMode,
) -> DelegateRequest {
    DelegateRequest {
        executor_url,
        environment: EnvironmentSpec { resources },
        task: TaskSpec {
            description: "interop".into(),
            prompt: "change things".into(),
        },
        ttl_seconds: Some(600),
        access_mode: Some(AccessMode::Rw),
        snapshot_mode: Some(snapshot_mode),
        auth: None,
        transport: Some(TransportType::Archive),
        multi_round: None,
        git_remote: None,
        no_network: None,
    }
}

fn resource(name: &str, dir: &std::path::Path, mode: AccessMode) -> ResourceSpec {
    ResourceSpec {
        name: name.into(),
        resource_type: ResourceType::Fs,
        source: dir.display().to_string(),
        mode,
        include: None,
        exclude: None,
        gitignore: None,
        allow_sensitive: None,
    }
}

/// The reference executor's changes: edit, create, delete, and touch the read-only one.
fn executor_work() -> awcp_tests::reference::Work {
    Arc::new(|dir: &std::path::Path| {
        std::fs::write(dir.join("workspace/a.txt"), "executor\n").unwrap();
        std::fs::write(dir.join("workspace/both.txt"), "executor\n").unwrap();
        std::fs::create_dir_all(dir.join("workspace/new")).unwrap();
        std::fs::write(dir.join("workspace/new/f.txt"), "new\n").unwrap();
        std::fs::remove_file(dir.join("workspace/gone.txt")).unwrap();
        std::fs::write(dir.join("docs/readme.md"), "tampered\n").unwrap();
    })
}

fn sample(h: &Harness) -> (std::path::PathBuf, std::path::PathBuf) {
    let ws = h.path("ws");
    let docs = h.path("docs");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::create_dir_all(&docs).unwrap();
    std::fs::write(ws.join("a.txt"), "original\n").unwrap();
    std::fs::write(ws.join("both.txt"), "original\n").unwrap();
    std::fs::write(ws.join("gone.txt"), "bye\n").unwrap();
    std::fs::write(docs.join("readme.md"), "docs\n").unwrap();
    (ws, docs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn our_daemon_delegates_to_a_reference_executor_with_archive() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("true").await;
    let (ws, docs) = sample(&h);
    let rex = RefExecutor::start(&h.path("ref-work"), true, executor_work()).await;
    let req = archive_request(
        rex.url(),
        vec![
            resource("workspace", &ws, AccessMode::Rw),
            resource("docs", &docs, AccessMode::Ro),
        ],
        SnapshotMode::Auto,
    );
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    // While the executor works, the Delegator changes one file it also changes.
    std::fs::write(ws.join("both.txt"), "delegator\n").unwrap();
    rex.state.proceed.notify_one();
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
    // What went over the wire has the reference's shapes.
    let msgs = rex.state.messages.lock().unwrap().clone();
    assert_eq!(msgs[0]["type"], "INVITE");
    assert_eq!(msgs[0]["requirements"], json!({"transport": "archive"}));
    assert_eq!(
        msgs[0]["environment"]["resources"],
        json!([{"name": "workspace", "type": "fs", "mode": "rw"},
               {"name": "docs", "type": "fs", "mode": "ro"}])
    );
    assert_eq!(msgs[1]["type"], "START");
    assert!(
        msgs[1]["lease"]["expiresAt"]
            .as_str()
            .unwrap()
            .ends_with('Z')
    );
    assert_eq!(rex.state.acks.lock().unwrap().clone(), vec![id.clone()]);
    // Merged file by file.
    let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap();
    assert_eq!(read(&ws.join("a.txt")), "executor\n");
    assert_eq!(read(&ws.join("new/f.txt")), "new\n");
    assert!(!ws.join("gone.txt").exists());
    // A conflict keeps the Delegator's version and the Executor's beside it.
    assert_eq!(read(&ws.join("both.txt")), "delegator\n");
    assert_eq!(
        read(&ws.join("both.txt.awcp-conflict-snap_1a2b3c4d5e6f")),
        "executor\n"
    );
    // A read-only resource is never written.
    assert_eq!(read(&docs.join("readme.md")), "docs\n");
    let v = h.client.get(&id).await.unwrap();
    assert_eq!(v.transport, "archive");
    let r = &v.record;
    assert_eq!(r.result.as_ref().unwrap().summary, "did the work");
    assert_eq!(r.applied_snapshot_id.as_deref(), Some("snap_1a2b3c4d5e6f"));
    let snaps: Value = reqwest::get(format!("{}/delegation/{id}/snapshots", h.daemon.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let s = &snaps["snapshots"][0];
    assert_eq!(s["id"], "snap_1a2b3c4d5e6f");
    assert_eq!(s["status"], "applied");
    assert_eq!(s["recommended"], true);
    assert!(s["appliedAt"].is_string());
    let report = &s["metadata"]["applyReport"];
    assert_eq!(report["conflicts"][0]["path"], "workspace/both.txt", "{s}");
    assert_eq!(
        s["metadata"]["changedFiles"],
        json!([
            "docs/readme.md",
            "workspace/a.txt",
            "workspace/both.txt",
            "workspace/gone.txt",
            "workspace/new/f.txt"
        ])
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn staged_snapshots_wait_for_apply_or_discard() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("true").await;
    let (ws, docs) = sample(&h);
    let rex = RefExecutor::start(&h.path("ref-work"), false, executor_work()).await;
    let api = h.daemon.url();
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let req = archive_request(
            rex.url(),
            vec![
                resource("workspace", &ws, AccessMode::Rw),
                resource("docs", &docs, AccessMode::Ro),
            ],
            SnapshotMode::Staged,
        );
        let id = h.client.delegate(&req).await.unwrap().delegation_id;
        let id = id.as_str().to_string();
        assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
        ids.push(id);
    }
    // Nothing applied yet.
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "original\n"
    );
    let snaps: Value = http
        .get(format!("{api}/delegation/{}/snapshots", ids[0]))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(snaps["snapshots"][0]["status"], "pending", "{snaps}");
    assert!(snaps["snapshots"][0]["localPath"].is_string());
    let sid = "snap_1a2b3c4d5e6f";
    // Discard the second, apply the first.
    let (s, b) = post(
        &format!("{api}/delegation/{}/snapshots/{sid}/discard", ids[1]),
        &json!({}),
    )
    .await;
    assert_eq!((s, b), (200, json!({"ok": true})));
    let (s, b) = post(
        &format!("{api}/delegation/{}/snapshots/{sid}/apply", ids[1]),
        &json!({}),
    )
    .await;
    assert_eq!(s, 400, "a discarded snapshot cannot be applied: {b}");
    let (s, b) = post(
        &format!("{api}/delegation/{}/snapshots/{sid}/apply", ids[0]),
        &json!({}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["ok"], true);
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "executor\n"
    );
    assert!(!ws.join("gone.txt").exists());
    let (s, b) = post(
        &format!("{api}/delegation/{}/snapshots/{sid}/apply", ids[0]),
        &json!({}),
    )
    .await;
    assert_eq!(
        (s, b),
        (
            400,
            json!({"error": format!("Snapshot already applied: {sid}")})
        )
    );
    let (s, b) = post(
        &format!("{api}/delegation/{}/snapshots/snap_nope/apply", ids[0]),
        &json!({}),
    )
    .await;
    assert_eq!(
        (s, b),
        (400, json!({"error": "Snapshot not found: snap_nope"}))
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn archive_admission_refuses_sensitive_files_and_oversized_workspaces() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_full(
        "true",
        |d| {
            d.archive_limits.max_total_bytes = 1000;
        },
        |_| {},
    )
    .await;
    let rex = RefExecutor::start(
        &h.path("ref-work"),
        false,
        Arc::new(|_: &std::path::Path| {}),
    )
    .await;
    let ws = h.path("ws");
    std::fs::create_dir_all(ws.join("conf")).unwrap();
    std::fs::write(ws.join("main.py"), "print(1)\n").unwrap();
    std::fs::write(ws.join("conf/.env"), "TOKEN=secret\n").unwrap();
    let api = h.daemon.url();
    let mut body = serde_json::to_value(archive_request(
        rex.url(),
        vec![resource("workspace", &ws, AccessMode::Rw)],
        SnapshotMode::Auto,
    ))
    .unwrap();
    let (s, b) = post(&format!("{api}/delegate"), &body).await;
    assert_eq!(s, 400);
    assert_eq!(b["code"], "SENSITIVE_FILES");
    assert_eq!(b["error"], "Sensitive files detected: workspace/conf/.env");
    // The hint names the exact flags that would pass.
    let hint = b["hint"].as_str().unwrap();
    assert!(
        hint.contains("--exclude '.env'") && hint.contains("--allow-sensitive '.env'"),
        "{hint}"
    );
    assert!(
        rex.state.messages.lock().unwrap().is_empty(),
        "nothing sent"
    );
    // Excluded, the rest goes; the excluded file never leaves.
    body["environment"]["resources"][0]["exclude"] = json!([".env"]);
    let (s, b) = post(&format!("{api}/delegate"), &body).await;
    assert_eq!(s, 200, "{b}");
    let start = rex.state.messages.lock().unwrap()[1].clone();
    let zip = base64::engine::general_purpose::STANDARD
        .decode(
            start["transportHandle"]["workspaceBase64"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
    assert_eq!(
        start["transportHandle"]["checksum"].as_str().unwrap(),
        sha256_hex(&zip)
    );
    let files = read_zip(&zip);
    assert_eq!(files.keys().collect::<Vec<_>>(), vec!["workspace/main.py"]);
    // Over the size limit.
    std::fs::write(ws.join("big.txt"), vec![b'x'; 2000]).unwrap();
    let (s, b) = post(&format!("{api}/delegate"), &body).await;
    assert_eq!(s, 400);
    assert_eq!(b["code"], "WORKSPACE_TOO_LARGE", "{b}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn recover_fetches_the_result_of_a_delegation_whose_stream_was_lost() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("true").await;
    let (ws, docs) = sample(&h);
    let rex = RefExecutor::start(&h.path("ref-work"), true, executor_work()).await;
    rex.state
        .drop_stream
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let req = archive_request(
        rex.url(),
        vec![
            resource("workspace", &ws, AccessMode::Rw),
            resource("docs", &docs, AccessMode::Ro),
        ],
        SnapshotMode::Auto,
    );
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    // The stream is gone before the result; the daemon gives up on it.
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Error);
    let v = h.client.get(&id).await.unwrap();
    assert_eq!(v.record.error.unwrap().code.as_str(), "SSE_FAILED");
    // Nothing came back yet; the executor finishes meanwhile.
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "original\n"
    );
    rex.state.proceed.notify_one();
    let start = std::time::Instant::now();
    let r = loop {
        match h.client.recover(&id).await {
            Ok(r) => break r,
            Err(e) => {
                // 404 until the executor has a result.
                assert!(start.elapsed() < TIMEOUT, "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(r.state, DelegationState::Completed);
    assert!(r.snapshot);
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "executor\n"
    );
    assert!(!ws.join("gone.txt").exists());
    assert_eq!(rex.state.acks.lock().unwrap().clone(), vec![id.clone()]);
    // Only once.
    assert!(h.client.recover(&id).await.is_err());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_named_by_done_but_never_streamed_is_fetched_from_the_result() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("true").await;
    let (ws, docs) = sample(&h);
    let rex = RefExecutor::start(&h.path("ref-work"), false, executor_work()).await;
    rex.state
        .omit_snapshot
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let req = archive_request(
        rex.url(),
        vec![
            resource("workspace", &ws, AccessMode::Rw),
            resource("docs", &docs, AccessMode::Ro),
        ],
        SnapshotMode::Auto,
    );
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "executor\n"
    );
    let v = h.client.get(&id).await.unwrap();
    let snaps = v.record.snapshots.unwrap();
    assert_eq!(snaps.len(), 1);
    assert_eq!(snaps[0].id, "snap_1a2b3c4d5e6f");
    assert_eq!(rex.state.acks.lock().unwrap().clone(), vec![id.clone()]);
    h.stop().await;
}

// Regression: a second INVITE (and an archive START) for the id of a running awcpfs
// delegation would have reset it, and unpacking would have emptied the live mount — deleting
// the Delegator's files through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reinvite_cannot_take_over_a_running_delegation() {
    if !fuse_available() {
        return;
    }
    let flags = tempfile::tempdir().unwrap();
    let flag = flags.path().join("release");
    let agent = format!("while [ ! -e {} ]; do sleep 0.05; done", flag.display());
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::write(repo.join("precious.txt"), "keep me\n").unwrap();
    let id = h.delegate(&repo, AccessMode::Rw, 120).await;
    let awcp = h.executor.awcp_url();
    let start_wait = std::time::Instant::now();
    while !awcp_tests::is_mounted(&h.mountpoint(&id)) {
        assert!(start_wait.elapsed() < TIMEOUT, "never mounted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (s, b) = post(&awcp, &invite(&h.credential(), &id, 60, "archive")).await;
    assert_eq!(s, 200);
    assert_eq!(b["type"], "ERROR", "{b}");
    assert_eq!(b["code"], "DECLINED");
    let zip = zip_entries(&[("workspace/x", b"x")], zip::CompressionMethod::Deflated);
    let (s, _) = post(&awcp, &start(&id, &zip, &sha256_hex(&zip))).await;
    // Refused before its state is even looked at: the running delegation has a proof
    // (our daemon's START token), and this START does not carry it.
    assert_eq!(s, 401, "START for a running assignment is refused");
    std::fs::write(&flag, "").unwrap();
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
    assert_eq!(
        std::fs::read_to_string(repo.join("precious.txt")).unwrap(),
        "keep me\n"
    );
    h.stop().await;
}

/// The `data:` events of an SSE response one by one; `None` once the stream has ended.
struct DataLines {
    stream: futures::stream::BoxStream<'static, reqwest::Result<axum::body::Bytes>>,
    buf: Vec<u8>,
}

impl DataLines {
    fn new(resp: reqwest::Response) -> Self {
        use futures::StreamExt;
        DataLines {
            stream: resp.bytes_stream().boxed(),
            buf: Vec::new(),
        }
    }

    async fn next(&mut self) -> Option<Value> {
        use futures::StreamExt;
        loop {
            while let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                let line = String::from_utf8_lossy(&line).trim_end().to_string();
                if let Some(data) = line.strip_prefix("data: ")
                    && let Ok(v) = serde_json::from_str::<Value>(data)
                {
                    return Some(v);
                }
            }
            match self.stream.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                _ => return None,
            }
        }
    }

    /// The next event of type `kind`, skipping others.
    async fn until(&mut self, kind: &str) -> Value {
        tokio::time::timeout(TIMEOUT, async {
            loop {
                let ev = self.next().await.expect("the stream ended early");
                if ev["type"] == kind {
                    return ev;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no {kind} event"))
    }
}

// Symptoms: the Executor's event stream stayed open after `done` until the Delegator's ack
// (PROTOCOL.md says it ends there), and after an explicit CLOSE the `done` and `/result`
// said "Session closed by delegator" instead of the last round's summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_stream_ends_at_done_and_close_keeps_the_last_rounds_summary() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("echo \"did round $AWCP_ROUND\"").await;
    let awcp = h.executor.awcp_url();
    let id = new_id();
    let mut inv = invite(&h.credential(), &id, 600, "archive");
    inv["multiRound"] = json!(true);
    let (_, accept) = post(&awcp, &inv).await;
    assert_eq!(accept["type"], "ACCEPT", "{accept}");
    let mut events = DataLines::new(
        reqwest::get(format!("{awcp}/tasks/{id}/events"))
            .await
            .unwrap(),
    );
    let zip = zip_entries(
        &[("workspace/a.txt", b"a")],
        zip::CompressionMethod::Deflated,
    );
    let (s, _) = post(&awcp, &start(&id, &zip, &sha256_hex(&zip))).await;
    assert_eq!(s, 200);
    let round = events.until("round_done").await;
    let summary = round["summary"].as_str().unwrap().to_string();
    assert!(summary.contains("did round 1"), "{round}");
    let close = json!({"version": "1", "type": "CLOSE", "delegationId": id});
    let (s, b) = post(&awcp, &close).await;
    assert_eq!(s, 200, "{b}");
    let done = events.until("done").await;
    assert_eq!(done["summary"], summary.as_str(), "{done}");
    // No ack sent: the stream ends anyway, right after `done`.
    let end = tokio::time::timeout(TIMEOUT, events.next()).await;
    assert!(
        matches!(end, Ok(None)),
        "the stream is still open after done: {end:?}"
    );
    let r: Value = reqwest::get(format!("{awcp}/tasks/{id}/result"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["summary"], summary.as_str(), "{r}");
    h.stop().await;
}

// Symptom: the reference's MCP server and `DelegatorDaemonClient` never send `transport`, so
// our daemon picked `awcpfs`; a reference Executor accepted the INVITE, then failed START
// with "unexpected transport type".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_without_transport_works_against_both_kinds_of_executor() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("echo ours > ours.txt").await;
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "original\n").unwrap();
    let rex = RefExecutor::start(
        &h.path("ref-work"),
        false,
        Arc::new(|d: &std::path::Path| {
            std::fs::write(d.join("workspace/a.txt"), "executor\n").unwrap()
        }),
    )
    .await;
    let req = awcp_tests::request(rex.url(), &[("workspace", &ws, AccessMode::Rw)], 600);
    assert_eq!(req.transport, None);
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
    let msgs = rex.state.messages.lock().unwrap().clone();
    assert_eq!(msgs[0]["requirements"], json!({"transport": "archive"}));
    assert_eq!(msgs[1]["transportHandle"]["transport"], "archive");
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "executor\n"
    );
    assert_eq!(h.client.get(&id).await.unwrap().transport, "archive");
    // Our Executor lists what it serves, and gets awcpfs.
    let ws2 = h.path("ws2");
    std::fs::create_dir_all(&ws2).unwrap();
    let req = h.request(&[("workspace", &ws2, AccessMode::Rw)], 600);
    assert_eq!(req.transport, None);
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
    assert_eq!(h.client.get(&id).await.unwrap().transport, "awcpfs");
    assert_eq!(
        std::fs::read_to_string(ws2.join("ours.txt")).unwrap(),
        "ours\n"
    );
    h.stop().await;
}

/// The zip in a `snapshot` event, by path.
fn snapshot_files(ev: &Value) -> std::collections::BTreeMap<String, Vec<u8>> {
    let zip = base64::engine::general_purpose::STANDARD
        .decode(ev["snapshotBase64"].as_str().unwrap())
        .unwrap();
    read_zip(&zip)
}

// Symptom: a reference Delegator of the multi-round branch never sends INVITE `multiRound`,
// so our Executor ended the task with `done`, and the Delegator's later CONTINUE failed
// ("Cannot continue delegation … in state 'completed'"). With `--reference-rounds` it
// works in rounds, as the reference's multi-round Executor does on the wire.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reference_delegator_continues_our_executor_with_reference_rounds() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_with(
        "echo \"round $AWCP_ROUND: $AWCP_TASK_DESCRIPTION\" >> log.txt",
        |c| c.reference_rounds = true,
    )
    .await;
    let awcp = h.executor.awcp_url();
    let id = new_id();
    // The reference's INVITE: no multiRound.
    let inv = invite(&h.credential(), &id, 600, "archive");
    assert!(inv.get("multiRound").is_none());
    let (_, accept) = post(&awcp, &inv).await;
    assert_eq!(accept["type"], "ACCEPT", "{accept}");
    let mut events = DataLines::new(
        reqwest::get(format!("{awcp}/tasks/{id}/events"))
            .await
            .unwrap(),
    );
    let zip = zip_entries(
        &[("workspace/a.txt", b"a")],
        zip::CompressionMethod::Deflated,
    );
    let (s, _) = post(&awcp, &start(&id, &zip, &sha256_hex(&zip))).await;
    assert_eq!(s, 200);
    let snap = events.until("snapshot").await;
    let round = events.until("round_done").await;
    assert_eq!(round["round"], 1, "{round}");
    assert_eq!(round["snapshotIds"], json!([snap["snapshotId"]]), "{round}");
    // CONTINUE exactly as the reference's Delegator sends it (no lease).
    let cont = json!({"version": "1", "type": "CONTINUE", "delegationId": id,
                      "task": {"description": "second", "prompt": "now the second part"},
                      "round": 2});
    let (s, b) = post(&awcp, &cont).await;
    assert_eq!((s, b), (200, json!({"ok": true})));
    let started = events.until("status").await;
    assert_eq!(started["message"], "Round 2 execution started", "{started}");
    let snap = events.until("snapshot").await;
    let round = events.until("round_done").await;
    assert_eq!(round["round"], 2, "{round}");
    // Round 2 ran in round 1's workspace.
    let log = snapshot_files(&snap)
        .remove("workspace/log.txt")
        .map(|b| String::from_utf8(b).unwrap());
    assert_eq!(
        log.as_deref(),
        Some("round 1: Fix it\nround 2: second\n"),
        "{snap}"
    );
    let close = json!({"version": "1", "type": "CLOSE", "delegationId": id});
    let (s, _) = post(&awcp, &close).await;
    assert_eq!(s, 200);
    let done = events.until("done").await;
    assert!(done["summary"].is_string(), "{done}");
    h.stop().await;
}

// A reference Delegator that neither continues nor closes does not hold the workspace for
// ever: the Executor closes such a session after its idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_reference_session_is_closed_by_our_executor() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_with("true", |c| {
        c.reference_rounds = true;
        c.idle_timeout = Duration::from_millis(500);
    })
    .await;
    let awcp = h.executor.awcp_url();
    let id = new_id();
    let zip = zip_entries(
        &[("workspace/a.txt", b"a")],
        zip::CompressionMethod::Deflated,
    );
    let evs = delegate_archive(&awcp, &h.credential(), &id, &zip, &sha256_hex(&zip)).await;
    let kinds: Vec<&str> = evs.iter().filter_map(|e| e["type"].as_str()).collect();
    assert!(kinds.contains(&"round_done"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"done"), "{kinds:?}");
    assert!(
        !h.mountpoint(&id).exists(),
        "the work directory is cleaned up"
    );
    h.stop().await;
}

/// A delegation request as the reference's `DelegatorDaemonClient` sends it: no
/// `multiRound`, no `transport`.
fn reference_client_request(executor_url: &str, ws: &std::path::Path) -> Value {
    json!({
        "executorUrl": executor_url,
        "environment": {"resources": [{"name": "workspace", "type": "fs",
                                        "source": ws.display().to_string(), "mode": "rw"}]},
        "task": {"description": "first", "prompt": "first round"},
        "ttlSeconds": 600,
    })
}

async fn wait_daemon_state(base: &str, id: &str, want: &str) -> Value {
    let last = std::sync::Mutex::new(Value::Null);
    tokio::time::timeout(TIMEOUT, async {
        loop {
            let v: Value = reqwest::get(format!("{base}/delegation/{id}"))
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if v["state"] == want {
                return v;
            }
            *last.lock().unwrap() = v.clone();
            assert!(
                !["completed", "error", "cancelled", "expired"]
                    .contains(&v["state"].as_str().unwrap_or("")),
                "{id} ended while waiting for {want}: {v}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{id} never reached {want}: {}", last.lock().unwrap()))
}

// Symptom: the reference MCP's `delegate_continue` through our daemon failed: our daemon
// closed the session at `round_done` (or completed at `done`) because the request did not
// say `multiRound`. With `serve --reference-rounds`, it stays idle for CONTINUE, against
// our Executor and against a reference multi-round Executor.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_reference_clients_continue_works_through_our_daemon_with_reference_rounds() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_full(
        "echo \"round $AWCP_ROUND: $AWCP_TASK_DESCRIPTION\" >> log.txt",
        |d| d.reference_rounds = true,
        |_| {},
    )
    .await;
    let base = h.daemon.token_url();
    // Against our Executor (awcpfs): idle after each round, continue, close.
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let (s, b) = post(
        &format!("{base}/delegate"),
        &reference_client_request(&h.executor.awcp_url(), &ws),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let id = b["delegationId"].as_str().unwrap().to_string();
    wait_daemon_state(&base, &id, "idle").await;
    // The reference client's continue body: {task}.
    let (s, b) = post(
        &format!("{base}/delegation/{id}/continue"),
        &json!({"task": {"description": "second", "prompt": "second round"}}),
    )
    .await;
    assert_eq!(
        (s, &b["ok"], &b["round"]),
        (200, &json!(true), &json!(2)),
        "{b}"
    );
    let v = wait_daemon_state(&base, &id, "idle").await;
    assert_eq!(v["currentRound"], 2, "{v}");
    let (s, b) = post(&format!("{base}/delegation/{id}/close"), &json!({})).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
    assert_eq!(
        std::fs::read_to_string(ws.join("log.txt")).unwrap(),
        "round 1: first\nround 2: second\n"
    );

    // Against a reference Executor that works in rounds: idle instead of CLOSE at once.
    let ws2 = h.path("ws2");
    std::fs::create_dir_all(&ws2).unwrap();
    std::fs::write(ws2.join("a.txt"), "a").unwrap();
    let rex = RefExecutor::start(
        &h.path("ref-work"),
        false,
        Arc::new(|w: &std::path::Path| std::fs::write(w.join("workspace/a.txt"), "b").unwrap()),
    )
    .await;
    rex.state
        .rounds
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (s, b) = post(
        &format!("{base}/delegate"),
        &reference_client_request(&rex.url(), &ws2),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let id = b["delegationId"].as_str().unwrap().to_string();
    wait_daemon_state(&base, &id, "idle").await;
    let (s, b) = post(
        &format!("{base}/delegation/{id}/continue"),
        &json!({"task": {"description": "second", "prompt": "second round"}}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let v = wait_daemon_state(&base, &id, "idle").await;
    assert_eq!(v["result"]["summary"], "did round 2", "{v}");
    let (s, _) = post(&format!("{base}/delegation/{id}/close"), &json!({})).await;
    assert_eq!(s, 200);
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
    let msgs = rex.state.messages.lock().unwrap().clone();
    let types: Vec<&str> = msgs.iter().filter_map(|m| m["type"].as_str()).collect();
    assert_eq!(types, vec!["INVITE", "START", "CONTINUE", "CLOSE"]);
    // What we sent has the reference's CONTINUE shape (plus our lease).
    assert_eq!(msgs[2]["round"], 2);
    assert_eq!(msgs[2]["task"]["description"], "second");
    assert_eq!(std::fs::read_to_string(ws2.join("a.txt")).unwrap(), "b");
    h.stop().await;
}
