//! Agents behind adapters (`executor --agent-a2a`, `--agent-http`): a real A2A agent built
//! with the official `a2a-sdk` (tests/fixtures/a2a_agent) and a small HTTP agent
//! (awcp_tests::agents) receive delegations from our daemon, edit the workspace they are
//! told of, and their results reach the Delegator; failures, bad answers and cancels end
//! in `error` with a message that says what happened.

use std::time::Duration;

use awcp_ctl::executor::RemoteAgent;
use awcp_protocol::DelegationState;
use awcp_protocol::messages::{AccessMode, TaskSpec};
use awcp_protocol::transport::TransportType;
use awcp_tests::agents::{A2aAgent, HttpAgent, HttpMode, a2a_python};
use awcp_tests::{Harness, fuse_available};

const TIMEOUT: Duration = Duration::from_secs(60);

/// Both services, the Executor handing tasks to `agent`.
async fn harness(agent: RemoteAgent) -> Harness {
    Harness::start_with("false", move |c| {
        c.remote_agent = Some(agent);
        c.agent_timeout = Some(Duration::from_secs(45));
    })
    .await
}

/// Delegate a one-file workspace with `prompt` over `transport`; the id and the workspace.
async fn delegate(
    h: &Harness,
    prompt: &str,
    transport: TransportType,
) -> (String, std::path::PathBuf) {
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("README"), "hello\n").unwrap();
    let mut req = h.request(&[("workspace", &ws, AccessMode::Rw)], 120);
    req.task = TaskSpec {
        description: "adapter test".into(),
        prompt: prompt.into(),
    };
    req.transport = Some(transport);
    let id = h
        .client
        .delegate(&req)
        .await
        .expect("delegate")
        .delegation_id
        .as_str()
        .to_string();
    (id, ws)
}

async fn error_of(h: &Harness, id: &str) -> String {
    let v = h.client.get(id).await.unwrap();
    let e = v.record.error.expect("an error");
    format!("{}: {}", e.code.as_str(), e.message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_a2a_agent_edits_the_mounted_workspace_over_message_stream() {
    let Some(py) = a2a_python() else { return };
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let agent = A2aAgent::start(&py, &tmp.path().join("a2a.log"), true);
    let h = harness(RemoteAgent::A2a(agent.url.clone())).await;
    let (id, ws) = delegate(
        &h,
        "write out.txt from-a2a\nwrite sub/two.txt second",
        TransportType::Awcpfs,
    )
    .await;
    assert_eq!(
        h.wait_end(&id, TIMEOUT).await,
        DelegationState::Completed,
        "{:?}",
        h.client.get(&id).await.unwrap().record.error
    );
    // The agent's edits reached the Delegator's directory.
    assert_eq!(
        std::fs::read_to_string(ws.join("out.txt")).unwrap(),
        "from-a2a\n"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("sub/two.txt")).unwrap(),
        "second\n"
    );
    let v = h.client.get(&id).await.unwrap();
    let summary = v.record.result.unwrap().summary;
    assert!(summary.contains("edited 2 file(s)"), "{summary}");
    // On the wire: the prompt, then the AWCP context part with the reference adapter's lines.
    let logged = agent.logged();
    let texts = logged[0]["texts"].as_array().unwrap();
    assert_eq!(texts[0], "write out.txt from-a2a\nwrite sub/two.txt second");
    let mount = h.mountpoint(&id);
    assert_eq!(
        texts[1].as_str().unwrap(),
        format!(
            "\n[AWCP Context]\nTask: adapter test\nRoot: {m}\n\nResources:\n  - workspace: {m} (rw)\n\nWorking directory: {m}",
            m = mount.display()
        )
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_a2a_agent_without_streaming_is_polled_and_works_on_an_archive() {
    let Some(py) = a2a_python() else { return };
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let agent = A2aAgent::start(&py, &tmp.path().join("a2a.log"), false);
    let h = harness(RemoteAgent::A2a(format!(
        "{}/.well-known/agent-card.json",
        agent.url
    )))
    .await;
    let (id, ws) = delegate(&h, "write polled.txt via-send", TransportType::Archive).await;
    assert_eq!(
        h.wait_end(&id, TIMEOUT).await,
        DelegationState::Completed,
        "{:?}",
        h.client.get(&id).await.unwrap().record.error
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("polled.txt")).unwrap(),
        "via-send\n"
    );
    // The archive's single resource is unpacked into <work>/<name>, as the reference does.
    let texts = agent.logged()[0]["texts"].clone();
    let work = h.mountpoint(&id);
    assert!(
        texts[1]
            .as_str()
            .unwrap()
            .ends_with(&format!("Working directory: {}/workspace", work.display())),
        "{texts}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_a2a_agent_ends_the_delegation_in_error() {
    let Some(py) = a2a_python() else { return };
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let agent = A2aAgent::start(&py, &tmp.path().join("a2a.log"), true);
    let h = harness(RemoteAgent::A2a(agent.url.clone())).await;
    let (id, _) = delegate(&h, "fail the build is broken", TransportType::Awcpfs).await;
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Error);
    let e = error_of(&h, &id).await;
    assert!(e.starts_with("TASK_FAILED"), "{e}");
    assert!(
        e.contains("ended failed") && e.contains("the build is broken"),
        "{e}"
    );
    // A question it cannot have answered ends the task too, saying so.
    let (id, _) = delegate(&h, "ask which branch?", TransportType::Awcpfs).await;
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Error);
    let e = error_of(&h, &id).await;
    assert!(
        e.contains("input-required") && e.contains("which branch?"),
        "{e}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revoking_cancels_the_a2a_task() {
    let Some(py) = a2a_python() else { return };
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let agent = A2aAgent::start(&py, &tmp.path().join("a2a.log"), true);
    let h = harness(RemoteAgent::A2a(agent.url.clone())).await;
    let (id, _) = delegate(&h, "sleep 30", TransportType::Awcpfs).await;
    // Wait until the agent has the task, then revoke.
    assert!(
        awcp_tests::eventually(TIMEOUT, || !agent.logged().is_empty()).await,
        "the agent never got the task"
    );
    h.client.revoke(&id, false).await.unwrap();
    let ended = h.wait_end(&id, TIMEOUT).await;
    assert!(
        matches!(ended, DelegationState::Cancelled | DelegationState::Error),
        "{ended:?}"
    );
    // The agent was told: tasks/cancel reached it.
    assert!(
        awcp_tests::eventually(Duration::from_secs(10), || agent
            .logged()
            .iter()
            .any(|l| l.get("cancel").is_some()))
        .await,
        "no tasks/cancel: {:?}",
        agent.logged()
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_address_without_an_agent_card_is_a_clear_error() {
    if !fuse_available() {
        return;
    }
    // An HTTP server that is no A2A agent: no card.
    let not_agent = HttpAgent::start(HttpMode::Ndjson).await;
    let h = harness(RemoteAgent::A2a(format!("http://{}", not_agent.addr))).await;
    let (id, _) = delegate(&h, "write x y", TransportType::Awcpfs).await;
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Error);
    let e = error_of(&h, &id).await;
    assert!(e.contains("no A2A agent card"), "{e}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_http_agent_streams_or_is_polled_and_its_edits_come_back() {
    if !fuse_available() {
        return;
    }
    for mode in [HttpMode::Ndjson, HttpMode::Sse, HttpMode::Poll] {
        let agent = HttpAgent::start(mode).await;
        let h = harness(RemoteAgent::Http(agent.url())).await;
        let (id, ws) = delegate(&h, "write http.txt via-http", TransportType::Awcpfs).await;
        assert_eq!(
            h.wait_end(&id, TIMEOUT).await,
            DelegationState::Completed,
            "{mode:?}: {:?}",
            h.client.get(&id).await.unwrap().record.error
        );
        assert_eq!(
            std::fs::read_to_string(ws.join("http.txt")).unwrap(),
            "via-http\n"
        );
        let summary = h
            .client
            .get(&id)
            .await
            .unwrap()
            .record
            .result
            .unwrap()
            .summary;
        assert!(summary.contains("edited 1 file(s)"), "{mode:?}: {summary}");
        // The request has the documented shape.
        let req = agent.state.requests.lock().unwrap()[0].clone();
        let mount = h.mountpoint(&id).display().to_string();
        assert_eq!(req["delegationId"], id.as_str());
        assert_eq!(req["round"], 1);
        assert_eq!(req["task"]["prompt"], "write http.txt via-http");
        assert_eq!(req["workspace"]["root"], mount.as_str());
        assert_eq!(req["workspace"]["workingDirectory"], mount.as_str());
        assert_eq!(
            req["workspace"]["resources"],
            serde_json::json!([{"name": "workspace", "path": mount, "mode": "rw"}])
        );
        assert!(req["lease"]["expiresAt"].is_string(), "{req}");
        assert!(req["context"].as_str().unwrap().contains("[AWCP Context]"));
        h.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_http_agent_that_fails_answers_garbage_or_is_cancelled_ends_in_error() {
    if !fuse_available() {
        return;
    }
    let agent = HttpAgent::start(HttpMode::Ndjson).await;
    let h = harness(RemoteAgent::Http(agent.url())).await;
    let (id, _) = delegate(&h, "fail no compiler here", TransportType::Awcpfs).await;
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Error);
    let e = error_of(&h, &id).await;
    assert!(
        e.contains("TASK_FAILED") && e.contains("no compiler here"),
        "{e}"
    );
    h.stop().await;

    let agent = HttpAgent::start(HttpMode::Garbage).await;
    let h = harness(RemoteAgent::Http(agent.url())).await;
    let (id, _) = delegate(&h, "write x y", TransportType::Awcpfs).await;
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Error);
    let e = error_of(&h, &id).await;
    assert!(e.contains("cannot read") && e.contains("expected"), "{e}");
    h.stop().await;

    // Polled: a revoke reaches the agent's cancelUrl.
    let agent = HttpAgent::start(HttpMode::Poll).await;
    let h = harness(RemoteAgent::Http(agent.url())).await;
    let (id, _) = delegate(&h, "sleep 30", TransportType::Awcpfs).await;
    assert!(
        awcp_tests::eventually(TIMEOUT, || !agent.state.requests.lock().unwrap().is_empty()).await
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.client.revoke(&id, false).await.unwrap();
    let ended = h.wait_end(&id, TIMEOUT).await;
    assert!(
        matches!(ended, DelegationState::Cancelled | DelegationState::Error),
        "{ended:?}"
    );
    assert!(
        awcp_tests::eventually(Duration::from_secs(10), || agent
            .state
            .cancels
            .lock()
            .unwrap()
            .contains(&0))
        .await,
        "the agent's cancelUrl was not called"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_round_past_agent_timeout_ends_in_error_and_cancels_the_agents_task() {
    if !fuse_available() {
        return;
    }
    let agent = HttpAgent::start(HttpMode::Poll).await;
    let url = agent.url();
    let h = Harness::start_with("false", move |c| {
        c.remote_agent = Some(RemoteAgent::Http(url));
        c.agent_timeout = Some(Duration::from_secs(1));
    })
    .await;
    let (id, _) = delegate(&h, "sleep 30", TransportType::Awcpfs).await;
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Error);
    let e = error_of(&h, &id).await;
    assert!(e.contains("did not finish within 1s"), "{e}");
    assert!(
        agent.state.cancels.lock().unwrap().contains(&0),
        "the timed-out task was not cancelled"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn later_rounds_continue_the_a2a_agents_context() {
    let Some(py) = a2a_python() else { return };
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let agent = A2aAgent::start(&py, &tmp.path().join("a2a.log"), true);
    let h = harness(RemoteAgent::A2a(agent.url.clone())).await;
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let mut req = h.request(&[("workspace", &ws, AccessMode::Rw)], 120);
    req.task = TaskSpec {
        description: "round one".into(),
        prompt: "write one.txt 1".into(),
    };
    req.multi_round = Some(true);
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    let idle = || async {
        assert!(
            awcp_tests::eventually(TIMEOUT, || {
                std::fs::read_to_string(&agent.log).is_ok_and(|l| l.lines().count() >= 1)
            })
            .await
        );
        for _ in 0..600 {
            if h.client.get(&id).await.unwrap().record.state == DelegationState::Idle {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("never idle");
    };
    idle().await;
    h.client
        .continue_round(
            &id,
            &TaskSpec {
                description: "round two".into(),
                prompt: "write two.txt 2".into(),
            },
            None,
        )
        .await
        .unwrap();
    assert!(awcp_tests::appears(&ws.join("two.txt"), TIMEOUT).await);
    idle().await;
    h.client.close(&id).await.unwrap();
    assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
    assert_eq!(std::fs::read_to_string(ws.join("one.txt")).unwrap(), "1\n");
    let logged = agent.logged();
    assert_eq!(logged.len(), 2, "{logged:?}");
    assert_eq!(
        logged[0]["contextId"], logged[1]["contextId"],
        "round 2 continues round 1's A2A context"
    );
    assert_eq!(logged[1]["texts"][0], "write two.txt 2");
    h.stop().await;
}
