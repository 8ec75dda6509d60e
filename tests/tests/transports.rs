//! The reference's `storage` and `git` transports between our daemon and our Executor, end
//! to end: real tools on the workspace (`python3`, `git`), a real git server on loopback
//! (`git daemon`, bare repository in a temp dir), a revoke in the middle of a task (nothing
//! applied, the URLs dead, no result branch), and a conflict (the Delegator changes a file
//! the agent also changed: both versions kept).

use std::path::{Path, PathBuf};
use std::time::Duration;

use awcp_protocol::api::{SnapshotMode, SnapshotStatus};
use awcp_protocol::messages::AccessMode;
use awcp_protocol::{DelegationState, TransportType};
use awcp_tests::git_server::GitServer;
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
/// deletes a file; with `git`, it first checks that its workspace is a clone of the base.
fn python_agent(git_check: bool) -> String {
    let check = if git_check {
        "git log --oneline | grep -q 'AWCP: Initial workspace' && \
         test -z \"$(git status --porcelain)\" && "
    } else {
        ""
    };
    format!(
        "{check}python3 -c \"import pathlib; p = pathlib.Path('calc/ops.py'); \
         p.write_text(p.read_text() + '\\n\\ndef sub(a, b):\\n    return a - b\\n')\" && \
         printf 'from calc.ops import sub\\nassert sub(5, 3) == 2\\nprint(\"sub ok\")\\n' > check_sub.py && \
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
    // The workspace's own `.git` never travelled.
    assert!(
        srv.show("ws.git", &format!("awcp-base/{id}:workspace/.git/HEAD"))
            .is_none()
    );
    // The Executor's clone and git directory are gone.
    let work = h.path(&format!("executor/work/{id}"));
    assert!(eventually(Duration::from_secs(10), || !work.exists()).await);
    assert!(!h.path(&format!("executor/state/{id}/git")).exists());
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
