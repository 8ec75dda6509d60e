//! Snapshot modes `staged` and `discard` with the `awcpfs` transport: the export keeps the
//! Executor's commits as a change set instead of writing them to the workspace; the
//! Delegator lists it, diffs it, applies it file by file (a file it changed meanwhile is a
//! conflict, kept as it is) or discards it; in `discard` mode nothing is ever applied.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use awcp_ctl::archive::Change;
use awcp_ctl::client::DaemonClient;
use awcp_ctl::daemon::DaemonConfig;
use awcp_ctl::executor::ExecutorConfig;
use awcp_protocol::DelegationState;
use awcp_protocol::api::{DelegateRequest, SnapshotMode, SnapshotStatus};
use awcp_protocol::messages::{AccessMode, TaskSpec};
use awcp_tests::{Harness, appears, eventually, fuse_available, is_mounted};

/// What the Executor's agent does on the mount: change, add, delete, rename, chmod, a new
/// directory, a binary file; and it must read back its own writes.
const AGENT: &str = "printf 'one\\nTWO\\nthree\\n' > a.txt && \
                     grep -q TWO a.txt && \
                     echo new > added.txt && \
                     rm gone.txt && \
                     mv keep.txt moved.txt && \
                     chmod 755 run.sh && \
                     mkdir newdir && echo n > newdir/n.txt && \
                     printf 'B\\000\\001' > data.bin && \
                     echo changed > other.txt";

fn request(url: String, dir: &Path, mode: SnapshotMode, multi: bool) -> DelegateRequest {
    DelegateRequest {
        task: TaskSpec {
            description: "staged".into(),
            prompt: "change things".into(),
        },
        access_mode: Some(AccessMode::Rw),
        snapshot_mode: Some(mode),
        multi_round: multi.then_some(true),
        git_remote: None,
        no_network: None,
        ..awcp_tests::request(url, &[("workspace", dir, AccessMode::Rw)], 300)
    }
}

/// The Delegator's workspace before the delegation.
fn workspace(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("a.txt"), "one\ntwo\nthree\n").unwrap();
    std::fs::write(dir.join("gone.txt"), "bye\n").unwrap();
    std::fs::write(dir.join("keep.txt"), "kept content\n").unwrap();
    std::fs::write(dir.join("other.txt"), "other\n").unwrap();
    std::fs::write(dir.join("run.sh"), "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(dir.join("run.sh"), std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// Every file under `dir` with its content and mode, for "unchanged" checks.
fn tree(dir: &Path) -> Vec<(String, Vec<u8>, u32)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
            if m.is_dir() {
                out.push((rel, Vec::new(), m.permissions().mode()));
                stack.push(e.path());
            } else {
                out.push((
                    rel,
                    std::fs::read(e.path()).unwrap(),
                    m.permissions().mode(),
                ));
            }
        }
    }
    out.sort();
    out
}

async fn delegate_and_end(h: &Harness, dir: &Path, mode: SnapshotMode) -> String {
    let id = h
        .client
        .delegate(&request(h.executor.awcp_url(), dir, mode, false))
        .await
        .unwrap()
        .delegation_id
        .as_str()
        .to_string();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed,
        "{:#?}",
        h.client.get(&id).await.unwrap()
    );
    id
}

async fn pending_snapshot(client: &DaemonClient, id: &str) -> String {
    let list = client.snapshots(id).await.unwrap().snapshots;
    let pending: Vec<_> = list
        .iter()
        .filter(|s| s.status == SnapshotStatus::Pending)
        .collect();
    assert_eq!(pending.len(), 1, "{list:#?}");
    pending[0].id.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn staged_awcpfs_changes_are_listed_diffed_and_applied_file_by_file() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start(AGENT).await;
    let dir = h.path("ws");
    workspace(&dir);
    let before = tree(&dir);
    let id = delegate_and_end(&h, &dir, SnapshotMode::Staged).await;
    assert_eq!(
        tree(&dir),
        before,
        "a staged delegation changes nothing by itself"
    );

    // The change set is a pending snapshot, with the reference's shapes.
    let list = h.client.snapshots(&id).await.unwrap().snapshots;
    assert_eq!(list.len(), 1, "{list:#?}");
    let snap = &list[0];
    assert_eq!(snap.status, SnapshotStatus::Pending);
    assert!(snap.id.starts_with("snap_"), "{}", snap.id);
    assert_eq!(snap.delegation_id.as_str(), id);
    let mut changed = snap
        .metadata
        .as_ref()
        .unwrap()
        .changed_files
        .clone()
        .unwrap();
    changed.sort();
    assert_eq!(
        changed,
        [
            "a.txt",
            "added.txt",
            "data.bin",
            "gone.txt",
            "keep.txt",
            "moved.txt",
            "newdir",
            "newdir/n.txt",
            "other.txt",
            "run.sh"
        ]
    );
    let raw: serde_json::Value = reqwest::get(format!(
        "{}/delegation/{id}/snapshots",
        h.daemon.token_url()
    ))
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    assert_eq!(raw["snapshots"][0]["status"], "pending", "{raw}");
    assert!(raw["snapshots"][0]["createdAt"].is_string(), "{raw}");

    // The diff: a unified diff for text, one line for the rest.
    let files = h.client.diff(&id, &snap.id).await.unwrap().files;
    let find = |p: &str| {
        files
            .iter()
            .find(|f| f.path == format!("workspace/{p}"))
            .unwrap_or_else(|| panic!("{p} not in {files:#?}"))
    };
    let a = find("a.txt");
    assert_eq!(a.change, Change::Modified);
    let patch = a.patch.as_deref().unwrap();
    assert!(patch.contains("--- a/a.txt"), "{patch}");
    assert!(patch.contains("-two\n+TWO\n"), "{patch}");
    assert_eq!(find("added.txt").change, Change::Added);
    assert!(find("added.txt").patch.as_deref().unwrap().contains("+new"));
    assert_eq!(find("gone.txt").change, Change::Deleted);
    let moved = find("moved.txt");
    assert_eq!(moved.change, Change::Renamed);
    assert_eq!(moved.from.as_deref(), Some("workspace/keep.txt"));
    assert!(
        !files.iter().any(|f| f.path == "workspace/keep.txt"),
        "a rename's old path is shown by the new one: {files:#?}"
    );
    let run = find("run.sh");
    assert_eq!(run.change, Change::Modified);
    assert_eq!(run.detail.as_deref(), Some("mode 644 → 755"));
    assert!(run.patch.is_none());
    let bin = find("data.bin");
    assert_eq!(bin.change, Change::Added);
    assert!(bin.patch.is_none());
    assert!(bin.detail.as_deref().unwrap().contains("binary"), "{bin:?}");
    assert!(
        find("newdir")
            .detail
            .as_deref()
            .unwrap()
            .contains("directory")
    );

    // Apply: every file changed, nothing replaced wholesale.
    let r = h.client.apply(&id, &snap.id).await.unwrap();
    assert!(r.report.conflicts.is_empty(), "{:#?}", r.report);
    assert!(r.report.written.contains(&"workspace/a.txt".to_string()));
    assert!(r.report.deleted.contains(&"workspace/gone.txt".to_string()));
    assert_eq!(
        std::fs::read_to_string(dir.join("a.txt")).unwrap(),
        "one\nTWO\nthree\n"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("added.txt")).unwrap(),
        "new\n"
    );
    assert!(!dir.join("gone.txt").exists());
    assert!(!dir.join("keep.txt").exists());
    assert_eq!(
        std::fs::read_to_string(dir.join("moved.txt")).unwrap(),
        "kept content\n"
    );
    assert_eq!(
        std::fs::metadata(dir.join("run.sh"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("newdir/n.txt")).unwrap(),
        "n\n"
    );
    assert_eq!(std::fs::read(dir.join("data.bin")).unwrap(), b"B\0\x01");

    let list = h.client.snapshots(&id).await.unwrap().snapshots;
    assert_eq!(list.len(), 1, "{list:#?}");
    assert_eq!(list[0].status, SnapshotStatus::Applied);
    assert!(list[0].applied_at.is_some());
    assert!(
        h.client.apply(&id, &snap.id).await.is_err(),
        "applied twice"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn applying_keeps_a_file_the_delegator_changed_and_applies_the_others() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start(AGENT).await;
    let dir = h.path("ws");
    workspace(&dir);
    let id = delegate_and_end(&h, &dir, SnapshotMode::Staged).await;
    // The Delegator edits a file the Executor changed too, before applying.
    std::fs::write(dir.join("a.txt"), "the delegator's edit\n").unwrap();
    let sid = pending_snapshot(&h.client, &id).await;
    let files = h.client.diff(&id, &sid).await.unwrap().files;
    let a = files.iter().find(|f| f.path == "workspace/a.txt").unwrap();
    assert!(
        a.detail.as_deref().unwrap().contains("changed since"),
        "the diff warns of the coming conflict: {a:?}"
    );
    let r = h.client.apply(&id, &sid).await.unwrap();
    assert_eq!(r.report.conflicts.len(), 1, "{:#?}", r.report);
    let c = &r.report.conflicts[0];
    assert_eq!(c.path, "workspace/a.txt");
    assert_eq!(
        std::fs::read_to_string(dir.join("a.txt")).unwrap(),
        "the delegator's edit\n",
        "the Delegator's version is kept"
    );
    let kept = c
        .kept_as
        .as_deref()
        .expect("the Executor's version kept beside");
    let kept = dir.join(kept.strip_prefix("workspace/").unwrap());
    assert_eq!(std::fs::read_to_string(kept).unwrap(), "one\nTWO\nthree\n");
    // Everything else was applied.
    assert_eq!(
        std::fs::read_to_string(dir.join("other.txt")).unwrap(),
        "changed\n"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("added.txt")).unwrap(),
        "new\n"
    );
    assert!(!dir.join("gone.txt").exists());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_discarded_change_set_leaves_the_workspace_untouched() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start(AGENT).await;
    let dir = h.path("ws");
    workspace(&dir);
    let before = tree(&dir);
    let id = delegate_and_end(&h, &dir, SnapshotMode::Staged).await;
    let sid = pending_snapshot(&h.client, &id).await;
    h.client.discard(&id, &sid).await.unwrap();
    assert_eq!(tree(&dir), before);
    let list = h.client.snapshots(&id).await.unwrap().snapshots;
    assert_eq!(list.len(), 1, "{list:#?}");
    assert_eq!(list[0].status, SnapshotStatus::Discarded);
    assert!(
        h.client.apply(&id, &sid).await.is_err(),
        "a discarded set cannot be applied"
    );
    assert_eq!(tree(&dir), before);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn snapshot_mode_discard_never_applies_awcpfs_changes() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start(AGENT).await;
    let dir = h.path("ws");
    workspace(&dir);
    let before = tree(&dir);
    let id = delegate_and_end(&h, &dir, SnapshotMode::Discard).await;
    assert_eq!(tree(&dir), before);
    let list = h.client.snapshots(&id).await.unwrap().snapshots;
    assert_eq!(list.len(), 1, "{list:#?}");
    assert_eq!(list[0].status, SnapshotStatus::Discarded);
    assert!(h.client.apply(&id, &list[0].id).await.is_err());
    // The kept change set goes with the export, after the flush grace.
    let stage = h.path("delegator/staged").join(&id);
    assert!(
        eventually(Duration::from_secs(30), || !stage.exists()).await,
        "{} still there",
        stage.display()
    );
    assert_eq!(tree(&dir), before);
    h.stop().await;
}

async fn wait_state(client: &DaemonClient, id: &str, want: DelegationState) {
    let start = Instant::now();
    loop {
        let s = client.get(id).await.unwrap().record.state;
        if s == want {
            return;
        }
        assert!(
            !s.is_terminal() && start.elapsed() < Duration::from_secs(60),
            "{id} is {} while waiting for {}",
            s.as_str(),
            want.as_str()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn staged_rounds_accumulate_on_the_mount_and_apply_as_one_change_set() {
    if !fuse_available() {
        return;
    }
    // Each round appends to log.txt and checks that the earlier rounds' lines are there:
    // the mount reads back what only the change set holds.
    let agent = "n=$(cat log.txt 2>/dev/null | wc -l); \
                 [ \"$n\" = $((AWCP_ROUND - 1)) ] || exit 7; \
                 echo \"round $AWCP_ROUND\" >> log.txt";
    let h = Harness::start(agent).await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    let id = h
        .client
        .delegate(&request(
            h.executor.awcp_url(),
            &dir,
            SnapshotMode::Staged,
            true,
        ))
        .await
        .unwrap()
        .delegation_id
        .as_str()
        .to_string();
    wait_state(&h.client, &id, DelegationState::Idle).await;
    assert!(!dir.join("log.txt").exists(), "staged: nothing applied");
    let sid = pending_snapshot(&h.client, &id).await;
    assert!(
        is_mounted(&h.mountpoint(&id)),
        "the mount stays between rounds"
    );
    let task = TaskSpec {
        description: "second".into(),
        prompt: "p".into(),
    };
    h.client.continue_round(&id, &task, None).await.unwrap();
    wait_state(&h.client, &id, DelegationState::Idle).await;
    assert_eq!(
        pending_snapshot(&h.client, &id).await,
        sid,
        "one change set until it is applied"
    );
    // Applied while idle: round 2's content lands; round 3 starts a new change set.
    let r = h.client.apply(&id, &sid).await.unwrap();
    assert!(r.report.conflicts.is_empty(), "{:#?}", r.report);
    assert_eq!(
        std::fs::read_to_string(dir.join("log.txt")).unwrap(),
        "round 1\nround 2\n"
    );
    h.client.continue_round(&id, &task, None).await.unwrap();
    wait_state(&h.client, &id, DelegationState::Idle).await;
    h.client.close(&id).await.unwrap();
    let sid3 = pending_snapshot(&h.client, &id).await;
    assert_ne!(sid3, sid);
    let files = h.client.diff(&id, &sid3).await.unwrap().files;
    assert_eq!(files.len(), 1, "{files:#?}");
    assert!(
        files[0].patch.as_deref().unwrap().contains("+round 3"),
        "{files:#?}"
    );
    let r = h.client.apply(&id, &sid3).await.unwrap();
    assert!(r.report.conflicts.is_empty(), "{:#?}", r.report);
    assert_eq!(
        std::fs::read_to_string(dir.join("log.txt")).unwrap(),
        "round 1\nround 2\nround 3\n"
    );
    h.stop().await;
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_set_survives_a_daemon_restart() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    awcp_tests::open_to_agents(tmp.path());
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let dir = tmp.path().join("ws");
    workspace(&dir);
    let before = tree(&dir);
    let mut dcfg = DaemonConfig::new(tmp.path().join("delegator"));
    dcfg.listen = free_addr();
    dcfg.export_listen = free_addr();
    let agent = format!(
        r#"echo before > before.txt
        while [ ! -e {o}/go ]; do sleep 0.05; done
        echo after > after.txt
        grep -q before before.txt"#,
        o = out.display()
    );
    let mut ecfg = ExecutorConfig::new(agent, tmp.path().join("executor"));
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    awcp_tests::share_named_paths(&mut ecfg);
    let executor = awcp_ctl::executor::start(ecfg).await.unwrap();
    dcfg.executor_token = executor.executor.credential().map(str::to_owned);
    let daemon = awcp_ctl::daemon::start(dcfg.clone()).await.unwrap();
    let client = daemon.client();
    let id = client
        .delegate(&request(
            executor.awcp_url(),
            &dir,
            SnapshotMode::Staged,
            false,
        ))
        .await
        .unwrap()
        .delegation_id
        .as_str()
        .to_string();
    // before.txt reaches the change set while the first daemon runs.
    let changes = tmp
        .path()
        .join("delegator/staged")
        .join(&id)
        .join("changes.json");
    assert!(
        eventually(Duration::from_secs(30), || std::fs::read_to_string(
            &changes
        )
        .is_ok_and(|c| c.contains("before.txt")))
        .await,
        "before.txt never staged"
    );
    daemon.stop().await;
    std::fs::write(out.join("go"), "").unwrap();
    let daemon = awcp_ctl::daemon::start(dcfg).await.unwrap();
    let start = Instant::now();
    loop {
        let v = client.get(&id).await.unwrap();
        if v.record.state.is_terminal() {
            assert_eq!(v.record.state, DelegationState::Completed, "{v:#?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "never completed: {v:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(tree(&dir), before, "nothing applied across the restart");
    let sid = pending_snapshot(&client, &id).await;
    let r = client.apply(&id, &sid).await.unwrap();
    assert!(r.report.conflicts.is_empty(), "{:#?}", r.report);
    assert_eq!(
        std::fs::read_to_string(dir.join("before.txt")).unwrap(),
        "before\n"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("after.txt")).unwrap(),
        "after\n"
    );
    executor.stop().await;
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changes_collected_after_a_no_flush_revoke_join_the_change_set() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        "echo kept > kept.txt && touch {o}/ready && exec sleep 600",
        o = out.path().display()
    );
    // Write-back waits ten minutes: the change stays on the Executor until collected.
    let h = Harness::start_with(&agent, |c| c.sync_debounce = Duration::from_secs(600)).await;
    let dir = h.path("ws");
    workspace(&dir);
    let before = tree(&dir);
    let id = h
        .client
        .delegate(&request(
            h.executor.awcp_url(),
            &dir,
            SnapshotMode::Staged,
            false,
        ))
        .await
        .unwrap()
        .delegation_id
        .as_str()
        .to_string();
    assert!(appears(&out.path().join("ready"), Duration::from_secs(30)).await);
    h.client.revoke(&id, true).await.unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(30)).await,
        DelegationState::Cancelled
    );
    assert!(eventually(Duration::from_secs(10), || !is_mounted(&h.mountpoint(&id))).await);
    let r = h.client.collect(&id, false).await.unwrap();
    assert!(r.applied >= 1, "{r:?}");
    assert_eq!(
        tree(&dir),
        before,
        "collected into the change set, not the workspace"
    );
    let sid = pending_snapshot(&h.client, &id).await;
    h.client.apply(&id, &sid).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("kept.txt")).unwrap(),
        "kept\n"
    );
    h.stop().await;
}
