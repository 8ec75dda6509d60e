//! Conflicting edits on the Delegator's side, and the Executor's event stream contract.

use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, appears, fuse_available, sample_repo};

// Regression: without atomic O_TRUNC the kernel opened (fetching the old content, which no
// longer matched its hash because the Delegator had changed the file) before truncating,
// and `echo x > f` failed with EIO.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overwriting_a_file_the_delegator_changed_keeps_both_versions() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r#"touch {o}/ready
        while [ ! -e {o}/go ]; do sleep 0.05; done
        echo "executor version" > README.md
        echo $? > {o}/rc"#,
        o = out.path().display()
    );
    // Without the daemon's watch, the mount keeps showing the file as delegated; with it,
    // the Delegator's edit would reach the mount first and the overwrite would simply win
    // (see `upstream.rs`).
    let h = Harness::start_full(&agent, |d| d.watch = false, |_| {}).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(appears(&out.path().join("ready"), Duration::from_secs(30)).await);
    std::fs::write(repo.join("README.md"), "delegator version\n").unwrap();
    std::fs::write(out.path().join("go"), "").unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert_eq!(
        std::fs::read_to_string(out.path().join("rc")).unwrap(),
        "0\n"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("README.md")).unwrap(),
        "delegator version\n",
        "the Delegator's edit was overwritten"
    );
    let kept: Vec<_> = std::fs::read_dir(&repo)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("README.md.awcp-conflict-")
        })
        .collect();
    assert_eq!(kept.len(), 1, "one conflict copy");
    assert_eq!(
        std::fs::read_to_string(kept[0].path()).unwrap(),
        "executor version\n"
    );
    let v = h.client.get(&id).await.unwrap();
    assert_eq!(v.transfer.unwrap()["conflicts"], 1);
    h.stop().await;
}

async fn read_stream(url: &str, last_event_id: Option<&str>) -> String {
    let mut rq = reqwest::Client::new().get(url);
    if let Some(id) = last_event_id {
        rq = rq.header("Last-Event-ID", id);
    }
    let resp = rq.send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    tokio::time::timeout(Duration::from_secs(5), resp.text())
        .await
        .expect("the stream of an ended task must end, not hang")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_event_stream_resumes_with_last_event_id() {
    if !fuse_available() {
        return;
    }
    use futures::StreamExt;
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r#"echo first-line
        while [ ! -e {o}/go ]; do sleep 0.05; done
        echo second-line"#,
        o = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let url = format!("{}/tasks/{id}/events", h.executor.awcp_url());
    // Read until the first line shows up, note the last id, drop the connection.
    // The Delegator's proof: the Executor serves the stream of this delegation to no one else.
    let proof = h.proof(&id).await;
    let resp = reqwest::Client::new()
        .get(&url)
        .bearer_auth(&proof)
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    while !text.contains("first-line") {
        let chunk = tokio::time::timeout(Duration::from_secs(30), body.next())
            .await
            .expect("no event")
            .unwrap()
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(body);
    let last_id: u64 = text
        .lines()
        .filter_map(|l| l.strip_prefix("id:"))
        .map(|v| v.trim().parse().unwrap())
        .max()
        .unwrap();
    let resumed = reqwest::Client::new()
        .get(&url)
        .bearer_auth(&proof)
        .header("Last-Event-ID", last_id.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status().as_u16(), 200);
    std::fs::write(out.path().join("go"), "").unwrap();
    let rest = tokio::time::timeout(Duration::from_secs(30), resumed.text())
        .await
        .expect("the stream must end after done")
        .unwrap();
    assert!(
        !rest.contains("first-line"),
        "replayed an event already seen:\n{rest}"
    );
    assert!(rest.contains("second-line"), "{rest}");
    let ids: Vec<u64> = rest
        .lines()
        .filter_map(|l| l.strip_prefix("id:"))
        .map(|v| v.trim().parse().unwrap())
        .collect();
    assert_eq!(
        ids.first(),
        Some(&(last_id + 1)),
        "resumes right after the last seen id"
    );
    assert!(
        rest.lines()
            .rfind(|l| l.starts_with("data:"))
            .unwrap()
            .contains("\"type\":\"done\"")
    );
    h.wait_end(&id, Duration::from_secs(30)).await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_before_start_ends_the_assignment_visibly() {
    let h = Harness::start("true").await;
    let awcp = h.executor.awcp_url();
    let id = "dlg_00112233445566778899aabbccddeeff";
    let invite = serde_json::json!({
        "version": "1", "type": "INVITE", "delegationId": id,
        "auth": {"type": "bearer", "credential": h.credential()},
        "task": {"description": "d", "prompt": "p"},
        "lease": {"ttlSeconds": 60, "accessMode": "rw"},
        "retentionMs": 1000,
        "environment": {"resources": [{"name": "w", "type": "fs", "mode": "rw"}]}
    });
    let http = reqwest::Client::new();
    let accept: serde_json::Value = http
        .post(&awcp)
        .json(&invite)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(accept["type"], "ACCEPT", "{accept}");
    let r = http
        .post(format!("{awcp}/cancel/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let result: serde_json::Value = http
        .get(format!("{awcp}/tasks/{id}/result"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(result["status"], "error", "{result}");
    assert_eq!(result["error"]["code"], "CANCELLED", "{result}");
    let events_url = format!("{awcp}/tasks/{id}/events");
    let events = read_stream(&events_url, None).await;
    assert!(events.contains("\"code\":\"CANCELLED\""), "{events}");
    assert!(
        events.contains("id: 1") || events.contains("id:1"),
        "{events}"
    );
    // Resuming after the last event of an ended task: nothing more will come, so it ends.
    let none = read_stream(&events_url, Some("1")).await;
    assert_eq!(
        none.lines().filter(|l| l.starts_with("data:")).count(),
        0,
        "{none}"
    );
    // A second cancel is refused (500, as the reference): the assignment has ended.
    let r = http
        .post(format!("{awcp}/cancel/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 500);
    h.stop().await;
}

// Regression: an ERROR from the Delegator before START left the assignment `pending`
// (counting against --max-concurrent, never acked away) although its stream had ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_error_before_start_ends_the_assignment() {
    let h = Harness::start("true").await;
    let awcp = h.executor.awcp_url();
    let id = "dlg_ffeeddccbbaa99887766554433221100";
    let http = reqwest::Client::new();
    let invite = serde_json::json!({
        "version": "1", "type": "INVITE", "delegationId": id,
        "auth": {"type": "bearer", "credential": h.credential()},
        "task": {"description": "d", "prompt": "p"},
        "lease": {"ttlSeconds": 60, "accessMode": "rw"},
        "retentionMs": 1000,
        "environment": {"resources": [{"name": "w", "type": "fs", "mode": "rw"}]}
    });
    let accept: serde_json::Value = http
        .post(&awcp)
        .json(&invite)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(accept["type"], "ACCEPT");
    let error = serde_json::json!({
        "version": "1", "type": "ERROR", "delegationId": id,
        "code": "SETUP_FAILED", "message": "the delegator gave up"
    });
    let r = http.post(&awcp).json(&error).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let status: serde_json::Value = http
        .get(format!("{awcp}/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["pendingInvitations"], 0, "{status}");
    assert_eq!(status["completedDelegations"], 1, "{status}");
    let result: serde_json::Value = http
        .get(format!("{awcp}/tasks/{id}/result"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(result["status"], "error", "{result}");
    assert_eq!(result["error"]["code"], "SETUP_FAILED", "{result}");
    h.stop().await;
}
