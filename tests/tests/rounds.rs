//! Multi-round delegations: `round_done` → `idle` with the workspace kept, CONTINUE runs the
//! next round on it, CLOSE completes; and a reference Executor that always works in rounds
//! is closed at once for a single-round delegation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use awcp_protocol::api::DelegateRequest;
use awcp_protocol::messages::{AccessMode, TaskSpec};
use awcp_protocol::{DelegationState, TransportType};
use awcp_tests::reference::RefExecutor;
use awcp_tests::{Harness, fuse_available, is_mounted};

const AGENT: &str = "if [ -d workspace ]; then cd workspace; fi; \
                     echo \"round $AWCP_ROUND: $AWCP_TASK_DESCRIPTION\" >> log.txt";

fn request(
    url: String,
    dir: &std::path::Path,
    transport: TransportType,
    multi: bool,
) -> DelegateRequest {
    DelegateRequest {
        task: TaskSpec {
            description: "first".into(),
            prompt: "first round".into(),
        },
        access_mode: Some(AccessMode::Rw),
        transport: Some(transport),
        multi_round: multi.then_some(true),
        git_remote: None,
        no_network: None,
        ..awcp_tests::request(url, &[("workspace", dir, AccessMode::Rw)], 300)
    }
}

async fn wait_state(h: &Harness, id: &str, want: DelegationState) {
    let start = Instant::now();
    loop {
        let s = h.client.get(id).await.unwrap().record.state;
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

async fn two_rounds(transport: TransportType) {
    let h = Harness::start(AGENT).await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    let id = h
        .client
        .delegate(&request(h.executor.awcp_url(), &dir, transport, true))
        .await
        .unwrap()
        .delegation_id;
    let id = id.as_str().to_string();
    wait_state(&h, &id, DelegationState::Idle).await;
    assert_eq!(
        std::fs::read_to_string(dir.join("log.txt")).unwrap(),
        "round 1: first\n",
        "round 1's changes are back when the delegation is idle"
    );
    if matches!(transport, TransportType::Awcpfs | TransportType::Sshfs) {
        assert!(
            is_mounted(&h.mountpoint(&id)),
            "the mount stays between rounds"
        );
    }
    // Continue is refused unless idle; here it is idle.
    let r = h
        .client
        .continue_round(
            &id,
            &TaskSpec {
                description: "second".into(),
                prompt: "p".into(),
            },
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.round, Some(2));
    wait_state(&h, &id, DelegationState::Idle).await;
    let log = std::fs::read_to_string(dir.join("log.txt")).unwrap();
    assert!(
        log.starts_with("round 1: first\nround 2: second\n"),
        "{log}"
    );
    h.client.close(&id).await.unwrap();
    let v = h.client.get(&id).await.unwrap();
    assert_eq!(v.record.state, DelegationState::Completed);
    assert!(h.client.close(&id).await.is_err(), "closing twice");
    let err = h
        .client
        .continue_round(
            &id,
            &TaskSpec {
                description: "third".into(),
                prompt: "p".into(),
            },
            None,
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("in state 'completed', expected 'idle'"),
        "{err}"
    );
    let rounds = v.record.rounds.unwrap();
    assert_eq!(rounds.len(), 2, "{rounds:?}");
    assert_eq!(rounds[0].task.description, "first");
    assert_eq!(rounds[1].task.description, "second");
    assert!(rounds[1].completed_at.is_some());
    assert!(
        rounds[1]
            .result
            .as_ref()
            .unwrap()
            .summary
            .contains("round 2")
    );
    if transport == TransportType::Archive {
        // Each round's snapshot merged without conflicts (the base moved with it).
        let snaps = v.record.snapshots.unwrap();
        assert_eq!(snaps.len(), 2);
        for s in &snaps {
            let report = &s.metadata.as_ref().unwrap().extra["applyReport"];
            assert_eq!(report["conflicts"], serde_json::json!([]), "{report}");
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while is_mounted(&h.mountpoint(&id)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(!is_mounted(&h.mountpoint(&id)), "unmounted after CLOSE");
    // Symptom: after an explicit close, `result.summary` became "Session closed by
    // delegator" (the `done` answering CLOSE), replacing the last round's summary.
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        let v = h.client.get(&id).await.unwrap();
        if v.progress.as_ref().is_some_and(|p| p.phase == "ended") || Instant::now() > deadline {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(
        v.progress.unwrap().phase,
        "ended",
        "the Executor's done arrived"
    );
    let last = v.record.rounds.unwrap()[1].result.clone().unwrap().summary;
    assert_eq!(v.record.result.unwrap().summary, last);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_rounds_on_one_awcpfs_mount_then_close() {
    if !fuse_available() {
        return;
    }
    two_rounds(TransportType::Awcpfs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_rounds_on_one_sshfs_mount_then_close() {
    // The daemon's sshd (root: chroot, bind mounts) and the Executor's sshfs, for real.
    if !fuse_available() || !awcp_tests::tools_available(&["sshd", "sshfs", "ssh-keygen"]) {
        return;
    }
    if !nix::unistd::geteuid().is_root() {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI runs as root"
        );
        eprintln!("SKIPPED: the sshfs transport's Delegator side needs root");
        return;
    }
    two_rounds(TransportType::Sshfs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_rounds_with_archive_snapshots_then_close() {
    if !fuse_available() {
        return;
    }
    two_rounds(TransportType::Archive).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_round_based_reference_executor_is_closed_for_a_single_round_delegation() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("true").await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.txt"), "a").unwrap();
    let rex = RefExecutor::start(
        &h.path("ref-work"),
        false,
        Arc::new(|w: &std::path::Path| std::fs::write(w.join("workspace/a.txt"), "b").unwrap()),
    )
    .await;
    rex.state
        .rounds
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let id = h
        .client
        .delegate(&request(rex.url(), &dir, TransportType::Archive, false))
        .await
        .unwrap()
        .delegation_id;
    let id = id.as_str().to_string();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    let types: Vec<String> = rex
        .state
        .messages
        .lock()
        .unwrap()
        .iter()
        .map(|m| m["type"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(types, vec!["INVITE", "START", "CLOSE"]);
    assert_eq!(std::fs::read_to_string(dir.join("a.txt")).unwrap(), "b");
    let v = h.client.get(&id).await.unwrap();
    assert_eq!(v.record.result.unwrap().summary, "did the work");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_session_is_closed_after_the_idle_timeout() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_full(
        AGENT,
        |d| d.idle_timeout = Duration::from_millis(300),
        |_| {},
    )
    .await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    let id = h
        .client
        .delegate(&request(
            h.executor.awcp_url(),
            &dir,
            TransportType::Awcpfs,
            true,
        ))
        .await
        .unwrap()
        .delegation_id;
    let id = id.as_str().to_string();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    let v = h.client.get(&id).await.unwrap();
    assert_eq!(v.record.rounds.unwrap().len(), 1, "closed after round 1");
    assert_eq!(
        std::fs::read_to_string(dir.join("log.txt")).unwrap(),
        "round 1: first\n"
    );
    h.stop().await;
}

/// CONTINUE carries a renewed lease: a round that runs past the lease START granted
/// completes when `continue --ttl` renewed it. Before, CONTINUE's `lease` was never sent
/// and ignored on receipt, so the archive Executor fenced round 2 at START's deadline.
async fn continue_renews_the_lease(transport: TransportType) {
    // Round 2 outlives the first lease (4 s).
    let agent = "if [ -d workspace ]; then cd workspace; fi; \
                 if [ \"$AWCP_ROUND\" = 2 ]; then sleep 6; fi; \
                 echo \"round $AWCP_ROUND\" >> log.txt";
    let h = Harness::start(agent).await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    let mut req = request(h.executor.awcp_url(), &dir, transport, true);
    req.ttl_seconds = Some(4);
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    wait_state(&h, &id, DelegationState::Idle).await;
    let before = h
        .client
        .get(&id)
        .await
        .unwrap()
        .record
        .active_lease
        .unwrap();
    let task = TaskSpec {
        description: "second".into(),
        prompt: "p".into(),
    };
    h.client
        .continue_round(&id, &task, Some(120))
        .await
        .unwrap();
    let after = h
        .client
        .get(&id)
        .await
        .unwrap()
        .record
        .active_lease
        .unwrap();
    let t = |s: &str| chrono::DateTime::parse_from_rfc3339(s).unwrap();
    assert!(
        t(&after.expires_at) - t(&before.expires_at) > chrono::TimeDelta::seconds(60),
        "{before:?} → {after:?}"
    );
    wait_state(&h, &id, DelegationState::Idle).await;
    h.client.close(&id).await.unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(30)).await,
        DelegationState::Completed
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("log.txt")).unwrap(),
        "round 1\nround 2\n"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn continue_with_a_ttl_renews_the_archive_lease_for_the_round() {
    if !fuse_available() {
        return;
    }
    continue_renews_the_lease(TransportType::Archive).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn continue_with_a_ttl_renews_the_awcpfs_lease_for_the_round() {
    if !fuse_available() {
        return;
    }
    continue_renews_the_lease(TransportType::Awcpfs).await;
}
