//! A worker's delivery stream is its own (issue 33): the agents of one Executor share a user,
//! so each can connect to another's AECP socket by its path; what streams the deliveries is
//! the worker's token, not the path. Worker A's socket, opened with B's token — or with
//! none — carries none of A's deliveries; opened with A's token it carries them.

use std::io::{BufRead as _, Write as _};
use std::time::Duration;

use awcp_ctl::daemon::aecp::PublishRequest;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, aecp_subscribe, eventually, fuse_available};

const WAIT: Duration = Duration::from_secs(60);

/// Every line a connection receives until it has been quiet for `quiet`.
fn lines_until_quiet(
    r: &mut std::io::BufReader<std::os::unix::net::UnixStream>,
    quiet: Duration,
) -> Vec<serde_json::Value> {
    r.get_ref().set_read_timeout(Some(quiet)).unwrap();
    let mut out = Vec::new();
    loop {
        let mut line = String::new();
        match r.read_line(&mut line) {
            Ok(0) | Err(_) => return out,
            Ok(_) => out.push(serde_json::from_str(&line).expect("one JSON object per line")),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_workers_token_does_not_open_a_workers_delivery_stream() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("sleep 600").await;
    let ws = h.path("ws");
    std::fs::create_dir_all(ws.join("pkg")).unwrap();
    std::fs::write(ws.join("pkg/__init__.py"), "").unwrap();
    std::fs::write(ws.join("pkg/a.py"), "def parse(s):\n    return s\n").unwrap();
    let a = h.delegate(&ws, AccessMode::Rw, 600).await;
    let b = h.delegate(&ws, AccessMode::Rw, 600).await;
    for id in [&a, &b] {
        assert!(
            eventually(WAIT, || h.mountpoint(id).join("pkg/a.py").exists()).await,
            "mount of {id} not up"
        );
    }
    let socket_a = h.path("executor/agents").join(&a).join("aecp.sock");
    assert!(
        eventually(WAIT, || socket_a.exists()).await,
        "no socket at {}",
        socket_a.display()
    );
    let (token_a, token_b) = (
        h.executor.executor.aecp_token(&a),
        h.executor.executor.aecp_token(&b),
    );
    assert_ne!(token_a, token_b, "each worker has its own token");

    // B's agent on A's socket, with its own (B's) token: told no.
    let mut with_b =
        std::io::BufReader::new(std::os::unix::net::UnixStream::connect(&socket_a).unwrap());
    with_b
        .get_ref()
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut greeting = String::new();
    with_b.read_line(&mut greeting).unwrap();
    let greeting: serde_json::Value = serde_json::from_str(&greeting).unwrap();
    assert_eq!(greeting["kind"], "hello", "{greeting}");
    assert_eq!(greeting["streaming"], false, "{greeting}");
    let hello = serde_json::json!({"kind": "hello", "token": token_b});
    with_b
        .get_mut()
        .write_all(format!("{hello}\n").as_bytes())
        .unwrap();
    let mut refusal = String::new();
    with_b.read_line(&mut refusal).unwrap();
    let refusal: serde_json::Value = serde_json::from_str(&refusal).unwrap();
    assert_eq!(refusal["kind"], "hello", "{refusal}");
    assert_eq!(refusal["streaming"], false, "{refusal}");
    assert_eq!(refusal["status"], 401, "{refusal}");
    assert!(
        refusal["error"]
            .as_str()
            .unwrap_or("")
            .contains("need its worker's AECP_TOKEN"),
        "{refusal}"
    );
    // A connection that never says who it is.
    let mut silent =
        std::io::BufReader::new(std::os::unix::net::UnixStream::connect(&socket_a).unwrap());
    // A's own agent.
    let mut with_a = aecp_subscribe(&socket_a, &token_a);

    // A finding about pkg/a.py, delivered to A at its point of use.
    let art = h
        .client
        .aecp_publish(&PublishRequest {
            worker: b.clone(),
            claim: "parse() returns its input unchanged".into(),
            scope: "file:pkg/a.py".into(),
            witness: None,
        })
        .await
        .expect("publish")
        .artifact;
    let mount_a = h.mountpoint(&a);
    assert!(
        eventually(WAIT, || std::fs::read_to_string(mount_a.join("pkg/a.py"))
            .is_ok()
            && std::fs::read_to_string(mount_a.join(".aecp/inbox"))
                .is_ok_and(|t| t.contains(&format!("\"id\":{}", art.id))))
        .await,
        "A never received the finding in its inbox"
    );

    // A's agent reads it on the socket...
    let got = tokio::task::spawn_blocking(move || {
        let lines = lines_until_quiet(&mut with_a, Duration::from_secs(3));
        (lines, with_a)
    })
    .await
    .unwrap()
    .0;
    assert!(
        got.iter()
            .any(|v| v["kind"] == "finding" && v["id"] == art.id),
        "A's own stream lacks the finding: {got:?}"
    );
    // ...and neither B's token nor no token reads any of it.
    let (seen_b, seen_silent) = tokio::task::spawn_blocking(move || {
        (
            lines_until_quiet(&mut with_b, Duration::from_secs(2)),
            lines_until_quiet(&mut silent, Duration::from_secs(2)),
        )
    })
    .await
    .unwrap();
    for (who, seen) in [("B's token", &seen_b), ("no token", &seen_silent)] {
        assert!(
            seen.iter()
                .all(|v| v["kind"] == "hello" && v["streaming"] == false),
            "a connection with {who} read A's stream: {seen:?}"
        );
    }

    h.client.revoke(&a, false).await.unwrap();
    h.client.revoke(&b, false).await.unwrap();
    h.stop().await;
}
