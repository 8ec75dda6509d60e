//! The reference's `storage` and `git` transports between our daemon and our Executor, end
//! to end: real tools on the workspace (`python3`, `git`), a real git server on loopback
//! (`git daemon`, bare repository in a temp dir), a revoke in the middle of a task (nothing
//! applied, the URLs dead, no result branch), and a conflict (the Delegator changes a file
//! the agent also changed: both versions kept). Then interop on the wire, both ways: our
//! daemon → a reference-shaped Executor ([`awcp_tests::reference::RefExecutor`]), and a
//! reference-shaped Delegator written here → our Executor.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use awcp_protocol::api::{SnapshotMode, SnapshotStatus};
use awcp_protocol::messages::AccessMode;
use awcp_protocol::{DelegationState, TransportType};
use awcp_tests::git_server::GitServer;
use awcp_tests::reference::{read_data_lines, read_zip, sha256_hex, zip_entries};
use awcp_tests::{Harness, appears, eventually, sample_repo, sh, tools_available};

/// Both services, with the daemon pushing `git` delegations to a fresh bare repository on a
/// `git daemon` of the test's own.
async fn start(agent: &str) -> (Harness, GitServer) {
    let server = GitServer::start_temp();
    let remote = server.bare("ws.git");
    let h = Harness::start_full(
        agent,
        |d| {
            d.git_remote = Some(remote);
        },
        // The agents run as the product runs them: as the agents' user, under Landlock; with
        // `git` they use the repository the Executor gives them in the clone.
        |_| {},
    )
    .await;
    (h, server)
}

async fn delegate(h: &Harness, dir: &Path, kind: TransportType, ttl: u64) -> String {
    let mut req = awcp_tests::request(
        h.executor.awcp_url(),
        &[("workspace", dir, AccessMode::Rw)],
        ttl,
    );
    req.transport = Some(kind);
    req.snapshot_mode = Some(SnapshotMode::Auto);
    h.client
        .delegate(&req)
        .await
        .unwrap_or_else(|e| panic!("delegate with {kind}: {e:#}"))
        .delegation_id
        .as_str()
        .to_string()
}

async fn completed(h: &Harness, id: &str) -> awcp_ctl::daemon::api::DelegationView {
    let end = h.wait_end(id, Duration::from_secs(90)).await;
    let view = h.client.get(id).await.unwrap();
    assert_eq!(end, DelegationState::Completed, "{view:#?}");
    view
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The agent: edits the package with Python, proves the tests pass with the edit, adds and
/// deletes a file; with `git`, it first checks that its workspace is a clean clone of the
/// base, and commits its edit (the rest stays uncommitted).
fn python_agent(git_check: bool) -> String {
    let (check, commit) = if git_check {
        (
            "git log --oneline | grep -q 'AWCP: Initial workspace' && \
             test -z \"$(git status --porcelain)\" && ",
            "git commit -qam 'agent: sub' && ",
        )
    } else {
        ("", "")
    };
    format!(
        "{check}python3 -c \"import pathlib; p = pathlib.Path('calc/ops.py'); \
         p.write_text(p.read_text() + '\\n\\ndef sub(a, b):\\n    return a - b\\n')\" && \
         {commit}printf 'from calc.ops import sub\\nassert sub(5, 3) == 2\\nprint(\"sub ok\")\\n' > check_sub.py && \
         python3 check_sub.py > sub.out && \
         python3 -m unittest -q 2> unittest.out && \
         rm README.md"
    )
}

fn assert_python_result(dir: &Path) {
    assert!(
        read(&dir.join("calc/ops.py")).contains("def sub(a, b):"),
        "the agent's edit reached the workspace"
    );
    assert_eq!(read(&dir.join("sub.out")), "sub ok\n");
    assert!(read(&dir.join("unittest.out")).contains("OK"));
    assert!(
        !dir.join("README.md").exists(),
        "the agent's delete applied"
    );
    // The workspace's own repository is intact: one commit, the agent's changes unstaged.
    assert_eq!(sh(dir, "git rev-list --count HEAD").trim(), "1");
    let status = sh(dir, "git status --porcelain");
    assert!(status.contains(" M calc/ops.py"), "{status}");
    assert!(status.contains(" D README.md"), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storage_runs_python_on_the_downloaded_workspace_and_the_upload_is_merged() {
    if !tools_available(&["git", "python3"]) {
        return;
    }
    let (h, _srv) = start(&python_agent(false)).await;
    let dir = h.path("ws");
    sample_repo(&dir);
    let id = delegate(&h, &dir, TransportType::Storage, 300).await;
    let view = completed(&h, &id).await;
    assert_eq!(view.transport, "storage");
    assert_python_result(&dir);
    let snaps = view.record.snapshots.clone().unwrap_or_default();
    assert_eq!(snaps.len(), 1, "{snaps:#?}");
    assert_eq!(snaps[0].status, SnapshotStatus::Applied);

    // The URLs lived as long as the lease: the workspace is no longer served.
    let secret = read(&h.path(&format!("delegator/archive/{id}/storage.secret")));
    let url = format!(
        "http://{}/storage/{id}/{}/workspace.zip",
        h.daemon.export_addr,
        secret.trim()
    );
    let status = reqwest::get(&url).await.unwrap().status();
    assert_eq!(status.as_u16(), 410, "{url}");
    // …and its copies are gone from the daemon's state.
    let kept = h.path(&format!("delegator/archive/{id}"));
    assert!(
        eventually(Duration::from_secs(5), || !kept
            .join("workspace.zip")
            .exists()
            && !kept.join("result.zip").exists())
        .await
    );
    // A wrong secret is not found, whatever the state.
    let wrong = format!(
        "http://{}/storage/{id}/{}/workspace.zip",
        h.daemon.export_addr,
        "0".repeat(32)
    );
    assert_eq!(reqwest::get(&wrong).await.unwrap().status().as_u16(), 404);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_clones_the_pushed_workspace_commits_a_branch_and_the_delegator_applies_it() {
    if !tools_available(&["git", "python3"]) {
        return;
    }
    let (h, srv) = start(&python_agent(true)).await;
    let dir = h.path("ws");
    sample_repo(&dir);
    let id = delegate(&h, &dir, TransportType::Git, 300).await;
    let view = completed(&h, &id).await;
    assert_eq!(view.transport, "git");
    assert_python_result(&dir);

    // The base went to the delegation's own branch (never `main`), the result to the
    // reference's `awcp/<id>`, laid out `<resource>/…` as the archive zip is.
    let mut branches = srv.branches("ws.git");
    branches.sort();
    assert_eq!(
        branches,
        vec![format!("awcp-base/{id}"), format!("awcp/{id}")],
        "branches on the remote"
    );
    let ops = srv
        .show("ws.git", &format!("awcp/{id}:workspace/calc/ops.py"))
        .expect("the result branch holds the edit");
    assert!(ops.contains("def sub"), "{ops}");
    let log = srv
        .show("ws.git", &format!("awcp/{id}"))
        .expect("the result commit");
    assert!(
        log.contains(&format!("AWCP: Task completed for {id}")),
        "{log}"
    );
    // The agent's own commit, made confined in its repository, is the Executor's parent.
    let parent = srv
        .show("ws.git", &format!("awcp/{id}~1"))
        .expect("the agent's commit");
    assert!(parent.contains("agent: sub"), "{parent}");
    assert!(parent.contains("AWCP Agent"), "{parent}");
    // The workspace's own `.git` never travelled.
    assert!(
        srv.show("ws.git", &format!("awcp-base/{id}:workspace/.git/HEAD"))
            .is_none()
    );
    // The Executor's clone and git directory are gone.
    let work = h.path(&format!("executor/work/{id}"));
    assert!(eventually(Duration::from_secs(10), || !work.exists()).await);
    assert!(!h.path(&format!("executor/state/{id}/git")).exists());
    // …and the daemon's local repository of the base.
    let local = h.path(&format!("delegator/git/{id}"));
    assert!(eventually(Duration::from_secs(5), || !local.exists()).await);
    h.stop().await;
}

/// A conflict: the agent and the Delegator both change `both.txt` while the task runs.
async fn conflict_keeps_both(kind: TransportType) {
    let marks = tempfile::tempdir().unwrap();
    let (started, go) = (marks.path().join("started"), marks.path().join("go"));
    let agent = format!(
        "echo agent > both.txt && echo agent-only > mine.txt && touch {} && \
         while [ ! -e {} ]; do sleep 0.05; done",
        started.display(),
        go.display()
    );
    let (h, _srv) = start(&agent).await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("both.txt"), "base\n").unwrap();
    std::fs::write(dir.join("quiet.txt"), "untouched\n").unwrap();
    let id = delegate(&h, &dir, kind, 300).await;
    assert!(
        appears(&started, Duration::from_secs(60)).await,
        "agent never started"
    );
    std::fs::write(dir.join("both.txt"), "delegator\n").unwrap();
    std::fs::write(&go, "").unwrap();
    let view = completed(&h, &id).await;
    let sid = view.record.snapshots.as_ref().unwrap()[0].id.clone();
    assert_eq!(
        read(&dir.join("both.txt")),
        "delegator\n",
        "never overwritten"
    );
    assert_eq!(
        read(&dir.join(format!("both.txt.awcp-conflict-{sid}"))),
        "agent\n",
        "the Executor's version kept beside it"
    );
    assert_eq!(read(&dir.join("mine.txt")), "agent-only\n");
    assert_eq!(read(&dir.join("quiet.txt")), "untouched\n");
    let report = serde_json::to_value(&view.record.snapshots.as_ref().unwrap()[0]).unwrap();
    assert_eq!(
        report["metadata"]["applyReport"]["conflicts"][0]["path"], "workspace/both.txt",
        "{report:#}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storage_conflict_keeps_the_delegators_file_and_the_agents_beside_it() {
    if !tools_available(&["git"]) {
        return;
    }
    conflict_keeps_both(TransportType::Storage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_conflict_keeps_the_delegators_file_and_the_agents_beside_it() {
    if !tools_available(&["git"]) {
        return;
    }
    conflict_keeps_both(TransportType::Git).await;
}

/// A revoke while the agent runs: it is stopped, nothing it changed is applied.
async fn revoke_applies_nothing(kind: TransportType) -> (Harness, GitServer, String, PathBuf) {
    let marks = tempfile::tempdir().unwrap();
    let started = marks.path().join("started");
    let agent = format!(
        "echo changed > a.txt && touch {} && sleep 60",
        started.display()
    );
    let (h, srv) = start(&agent).await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.txt"), "original\n").unwrap();
    let id = delegate(&h, &dir, kind, 300).await;
    assert!(
        appears(&started, Duration::from_secs(60)).await,
        "agent never started"
    );
    h.client.revoke(&id, true).await.unwrap();
    let end = h.wait_end(&id, Duration::from_secs(30)).await;
    assert_eq!(end, DelegationState::Cancelled);
    // The Executor stopped the agent and removed its copy.
    let work = h.path(&format!("executor/work/{id}"));
    assert!(
        eventually(Duration::from_secs(20), || !work.exists()).await,
        "{} still there",
        work.display()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(read(&dir.join("a.txt")), "original\n", "nothing applied");
    let view = h.client.get(&id).await.unwrap();
    assert!(
        view.record
            .snapshots
            .unwrap_or_default()
            .iter()
            .all(|s| s.status != SnapshotStatus::Applied),
        "no snapshot applied after the revoke"
    );
    (h, srv, id, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storage_revoke_stops_the_agent_and_kills_the_urls() {
    if !tools_available(&["git"]) {
        return;
    }
    let (h, _srv, id, _dir) = revoke_applies_nothing(TransportType::Storage).await;
    let secret = read(&h.path(&format!("delegator/archive/{id}/storage.secret")));
    let base = format!(
        "http://{}/storage/{id}/{}",
        h.daemon.export_addr,
        secret.trim()
    );
    let get = reqwest::get(format!("{base}/workspace.zip")).await.unwrap();
    assert_eq!(get.status().as_u16(), 410, "download after revoke");
    let put = reqwest::Client::new()
        .put(format!("{base}/result.zip"))
        .body(b"PK late".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(put.status().as_u16(), 410, "upload after revoke");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_revoke_stops_the_agent_and_pushes_no_result() {
    if !tools_available(&["git"]) {
        return;
    }
    let (h, srv, id, _dir) = revoke_applies_nothing(TransportType::Git).await;
    assert_eq!(
        srv.branches("ws.git"),
        vec![format!("awcp-base/{id}")],
        "no result branch after a revoke"
    );
    h.stop().await;
}

/// The agent's repository is the agent's: hooks, `core.fsmonitor` and alternates it plants
/// there never run or count when the Executor brings its commits over and pushes (the
/// Executor runs nothing of that repository), yet its commit arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_an_agent_planting_hooks_and_config_runs_nothing_as_the_executor() {
    if !tools_available(&["git"]) {
        return;
    }
    let secret = tempfile::tempdir().unwrap();
    let mark = secret.path().join("pwned");
    let agent = format!(
        "echo agent > README.md && git commit -qam 'agent: readme' && \
         printf '#!/bin/sh\\ntouch {m}\\n' > ../.git/hooks/post-commit && \
         chmod +x ../.git/hooks/post-commit && cp ../.git/hooks/post-commit ../.git/hooks/pre-push && \
         git config core.fsmonitor 'touch {m}' && git config core.hooksPath .git/hooks && \
         echo /nonexistent/objects > ../.git/objects/info/alternates && \
         echo more > more.txt",
        m = mark.display()
    );
    let (h, srv) = start(&agent).await;
    let dir = h.path("ws");
    sample_repo(&dir);
    let id = delegate(&h, &dir, TransportType::Git, 300).await;
    completed(&h, &id).await;
    assert!(
        !mark.exists(),
        "something of the agent's repository ran as the Executor"
    );
    assert_eq!(read(&dir.join("README.md")), "agent\n");
    assert_eq!(read(&dir.join("more.txt")), "more\n");
    let parent = srv
        .show("ws.git", &format!("awcp/{id}~1"))
        .expect("the agent's commit");
    assert!(parent.contains("agent: readme"), "{parent}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_without_a_remote_is_refused_with_what_to_do() {
    let h = Harness::start("true").await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    let mut req = awcp_tests::request(
        h.executor.awcp_url(),
        &[("workspace", &dir, AccessMode::Rw)],
        60,
    );
    req.transport = Some(TransportType::Git);
    let err = h.client.delegate(&req).await.unwrap_err().to_string();
    assert!(err.contains("--git-remote"), "{err}");
    // A remote the Executor would refuse to clone (a local path) is refused up front.
    req.git_remote = Some("/etc".into());
    let err = h.client.delegate(&req).await.unwrap_err().to_string();
    assert!(err.contains("not one an Executor will clone"), "{err}");
    h.stop().await;
}

/// Our daemon → a reference-shaped Executor (`tests/src/reference.rs`, written from the
/// reference's wire shapes) with `storage` and with `git`: what went over the wire, and
/// the result merged file by file.
async fn to_a_reference_executor(kind: TransportType) {
    let (h, srv) = start("true").await;
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "original\n").unwrap();
    std::fs::write(ws.join("gone.txt"), "bye\n").unwrap();
    let work: awcp_tests::reference::Work = std::sync::Arc::new(|dir: &Path| {
        std::fs::write(dir.join("workspace/a.txt"), "executor\n").unwrap();
        std::fs::write(dir.join("workspace/new.txt"), "new\n").unwrap();
        std::fs::remove_file(dir.join("workspace/gone.txt")).unwrap();
    });
    let rex = awcp_tests::reference::RefExecutor::start(&h.path("ref-work"), false, work).await;
    let mut req = awcp_tests::request(rex.url(), &[("workspace", &ws, AccessMode::Rw)], 300);
    req.transport = Some(kind);
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    completed(&h, &id).await;
    let msgs = rex.state.messages.lock().unwrap().clone();
    assert_eq!(msgs[0]["requirements"]["transport"], kind.as_str());
    let handle = &msgs[1]["transportHandle"];
    assert_eq!(handle["transport"], kind.as_str());
    match kind {
        TransportType::Storage => {
            for k in ["downloadUrl", "uploadUrl", "checksum", "expiresAt"] {
                assert!(handle[k].is_string(), "{k}: {handle}");
            }
            assert_eq!(handle["expiresAt"], msgs[1]["lease"]["expiresAt"]);
        }
        _ => {
            assert_eq!(handle["repoUrl"], srv.url("ws.git"));
            assert_eq!(handle["baseBranch"], format!("awcp-base/{id}"));
            assert_eq!(handle["baseCommit"].as_str().unwrap().len(), 40);
            assert!(srv.branches("ws.git").contains(&format!("awcp/{id}")));
        }
    }
    assert_eq!(read(&ws.join("a.txt")), "executor\n");
    assert_eq!(read(&ws.join("new.txt")), "new\n");
    assert!(!ws.join("gone.txt").exists());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn our_daemon_delegates_to_a_reference_executor_with_storage() {
    if !tools_available(&["git"]) {
        return;
    }
    to_a_reference_executor(TransportType::Storage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn our_daemon_delegates_to_a_reference_executor_with_git() {
    if !tools_available(&["git"]) {
        return;
    }
    to_a_reference_executor(TransportType::Git).await;
}

/// A reference-shaped Delegator (the reference's JSON, reading only `data:` SSE lines)
/// drives our Executor: INVITE, open the stream, START; returns the events.
async fn reference_delegator(
    awcp: &str,
    credential: &str,
    id: &str,
    transport: &str,
    handle: Value,
) -> Vec<Value> {
    let client = reqwest::Client::new();
    let invite = json!({
        "version": "1", "type": "INVITE", "delegationId": id,
        "auth": {"type": "bearer", "credential": credential},
        "task": {"description": "Fix it", "prompt": "Fix the bug"},
        "lease": {"ttlSeconds": 600, "accessMode": "rw"},
        "retentionMs": 604800000,
        "environment": {"resources": [{"name": "workspace", "type": "fs", "mode": "rw"}]},
        "requirements": {"transport": transport}
    });
    let accept: Value = client
        .post(awcp)
        .json(&invite)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(accept["type"], "ACCEPT", "{accept}");
    let events = reqwest::get(format!("{awcp}/tasks/{id}/events"))
        .await
        .unwrap();
    let start = json!({
        "version": "1", "type": "START", "delegationId": id,
        "lease": {"expiresAt": "2099-01-01T00:00:00.000Z", "accessMode": "rw"},
        "transportHandle": handle
    });
    let ok: Value = client
        .post(awcp)
        .json(&start)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ok, json!({"ok": true}));
    tokio::time::timeout(Duration::from_secs(60), read_data_lines(events))
        .await
        .expect("the task did not end")
}

fn new_id() -> String {
    awcp_protocol::DelegationId::from_random_bytes(rand::random())
        .as_str()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reference_delegator_drives_our_executor_with_storage() {
    if !tools_available(&["python3"]) {
        return;
    }
    // The reference's local storage provider: `<key>.zip` to download, `<key>-result.zip`
    // to upload, served here by a file server of the test's own.
    let h = Harness::start("python3 -c \"open('a.txt','w').write('agent\\n')\"").await;
    let zip = zip_entries(
        &[
            ("workspace/a.txt", b"original\n"),
            ("workspace/b.txt", b"b\n"),
        ],
        zip::CompressionMethod::Deflated,
    );
    let checksum = sha256_hex(&zip);
    let uploaded: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
    let up = uploaded.clone();
    let served = zip.clone();
    let app = axum::Router::new()
        .route(
            "/workspaces/ws.zip",
            axum::routing::get(move || {
                let z = served.clone();
                async move { z }
            }),
        )
        .route(
            "/workspaces/ws-result.zip",
            axum::routing::put(move |body: axum::body::Bytes| {
                let up = up.clone();
                async move {
                    *up.lock().unwrap() = Some(body.to_vec());
                    "ok"
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/workspaces", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let id = new_id();
    let events = reference_delegator(
        &h.executor.awcp_url(),
        &h.credential(),
        &id,
        "storage",
        json!({"transport": "storage", "downloadUrl": format!("{base}/ws.zip"),
               "uploadUrl": format!("{base}/ws-result.zip"), "checksum": checksum,
               "expiresAt": "2099-01-01T00:00:00.000Z"}),
    )
    .await;
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(kinds.last(), Some(&"done"), "{events:#?}");
    let snap = events.iter().find(|e| e["type"] == "snapshot").unwrap();
    // As the reference's storage Executor: the upload URL, as JSON text.
    assert_eq!(
        snap["snapshotBase64"],
        json!({"resultUrl": format!("{base}/ws-result.zip")}).to_string()
    );
    let result = uploaded.lock().unwrap().clone().expect("uploaded");
    let files = read_zip(&result);
    assert_eq!(files["workspace/a.txt"], b"agent\n");
    assert_eq!(files["workspace/b.txt"], b"b\n");

    // A corrupted download is refused with the reference's code.
    let id = new_id();
    let events = reference_delegator(
        &h.executor.awcp_url(),
        &h.credential(),
        &id,
        "storage",
        json!({"transport": "storage", "downloadUrl": format!("{base}/ws.zip"),
               "uploadUrl": format!("{base}/ws-result.zip"), "checksum": "00".repeat(32),
               "expiresAt": "2099-01-01T00:00:00.000Z"}),
    )
    .await;
    let last = events.last().unwrap();
    assert_eq!(last["type"], "error");
    assert_eq!(last["code"], "CHECKSUM_MISMATCH", "{last}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reference_delegator_drives_our_executor_with_git() {
    if !tools_available(&["git"]) {
        return;
    }
    // The reference's git Delegator: the workspace committed and force-pushed as `main`.
    let srv = GitServer::start_temp();
    let url = srv.bare("ref.git");
    // The agent, confined, runs git in its own repository of the clone.
    let h = Harness::start(
        "git log --oneline | grep -q initial && echo agent > a.txt && git status --porcelain | grep -q 'a.txt'",
    )
    .await;
    let src = h.path("src");
    std::fs::create_dir_all(src.join("workspace")).unwrap();
    std::fs::write(src.join("workspace/a.txt"), "original\n").unwrap();
    sh(
        &src,
        &format!(
            "git init -q -b main && git add -A && git -c user.name=d -c user.email=d@x \
             commit -qm initial && git push -q --force {url} main"
        ),
    );
    let base = sh(&src, "git rev-parse HEAD").trim().to_string();
    let id = new_id();
    let events = reference_delegator(
        &h.executor.awcp_url(),
        &h.credential(),
        &id,
        "git",
        json!({"transport": "git", "repoUrl": url, "baseBranch": "main",
               "baseCommit": base, "auth": {"type": "none"}}),
    )
    .await;
    assert_eq!(events.last().unwrap()["type"], "done", "{events:#?}");
    let snap = events.iter().find(|e| e["type"] == "snapshot").unwrap();
    let info: Value = serde_json::from_str(snap["snapshotBase64"].as_str().unwrap()).unwrap();
    assert_eq!(info["branch"], format!("awcp/{id}"));
    assert_eq!(info["baseCommit"], base);
    assert_eq!(info["changedFiles"], json!(["workspace/a.txt"]));
    let head = info["commitHash"].as_str().unwrap();
    assert_eq!(
        srv.show("ref.git", &format!("{head}:workspace/a.txt"))
            .as_deref(),
        Some("agent\n")
    );
    // A remote that is a local path (the Executor's own disk) is refused.
    let id = new_id();
    let events = reference_delegator(
        &h.executor.awcp_url(),
        &h.credential(),
        &id,
        "git",
        json!({"transport": "git", "repoUrl": src.display().to_string(), "baseBranch": "main",
               "baseCommit": base}),
    )
    .await;
    let last = events.last().unwrap();
    assert_eq!(last["type"], "error");
    assert_eq!(last["code"], "WORKSPACE_INVALID", "{last}");
    h.stop().await;
}

async fn wait_state(h: &Harness, id: &str, want: DelegationState) {
    let start = std::time::Instant::now();
    loop {
        let s = h.client.get(id).await.unwrap().record.state;
        if s == want {
            return;
        }
        if s.is_terminal() || start.elapsed() > Duration::from_secs(60) {
            let v = h.client.get(id).await.unwrap();
            panic!(
                "{id} is {} while waiting for {}: {:?}",
                s.as_str(),
                want.as_str(),
                v.record.error
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Two rounds on one copy: each round's result merged (the base moving with it), then
/// CLOSE.
async fn two_rounds(kind: TransportType) {
    let (h, _srv) = start("echo \"round $AWCP_ROUND: $AWCP_TASK_DESCRIPTION\" >> log.txt").await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    let mut req = awcp_tests::request(
        h.executor.awcp_url(),
        &[("workspace", &dir, AccessMode::Rw)],
        300,
    );
    req.transport = Some(kind);
    req.multi_round = Some(true);
    req.task.description = "first".into();
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    wait_state(&h, &id, DelegationState::Idle).await;
    assert_eq!(read(&dir.join("log.txt")), "round 1: first\n");
    let task = awcp_protocol::messages::TaskSpec {
        description: "second".into(),
        prompt: "p".into(),
    };
    h.client.continue_round(&id, &task, None).await.unwrap();
    wait_state(&h, &id, DelegationState::Idle).await;
    assert_eq!(
        read(&dir.join("log.txt")),
        "round 1: first\nround 2: second\n"
    );
    h.client.close(&id).await.unwrap();
    let v = completed(&h, &id).await;
    let snaps = v.record.snapshots.unwrap();
    assert_eq!(snaps.len(), 2, "{snaps:#?}");
    for s in &snaps {
        let report = &s.metadata.as_ref().unwrap().extra["applyReport"];
        assert_eq!(report["conflicts"], json!([]), "{report}");
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_rounds_with_storage_then_close() {
    if !tools_available(&["git"]) {
        return;
    }
    two_rounds(TransportType::Storage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_rounds_with_git_then_close() {
    if !tools_available(&["git"]) {
        return;
    }
    two_rounds(TransportType::Git).await;
}

/// Snapshot mode `staged`: nothing changes until the snapshot is applied.
async fn staged_waits_for_apply(kind: TransportType) {
    let (h, _srv) = start("echo agent > a.txt").await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.txt"), "original\n").unwrap();
    let mut req = awcp_tests::request(
        h.executor.awcp_url(),
        &[("workspace", &dir, AccessMode::Rw)],
        300,
    );
    req.transport = Some(kind);
    req.snapshot_mode = Some(SnapshotMode::Staged);
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    completed(&h, &id).await;
    assert_eq!(
        read(&dir.join("a.txt")),
        "original\n",
        "staged: not applied"
    );
    let snaps = h.client.snapshots(&id).await.unwrap().snapshots;
    assert_eq!(snaps.len(), 1, "{snaps:#?}");
    assert_eq!(snaps[0].status, SnapshotStatus::Pending);
    h.client.apply(&id, &snaps[0].id).await.unwrap();
    assert_eq!(read(&dir.join("a.txt")), "agent\n");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storage_staged_snapshot_waits_for_apply() {
    if !tools_available(&["git"]) {
        return;
    }
    staged_waits_for_apply(TransportType::Storage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_staged_snapshot_waits_for_apply() {
    if !tools_available(&["git"]) {
        return;
    }
    staged_waits_for_apply(TransportType::Git).await;
}
