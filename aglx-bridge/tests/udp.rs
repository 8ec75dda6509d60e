//! End-to-end tests of the bridge's UDP side: announces only, bounded, no amplification.

mod common;

use std::time::Duration;

use aglx_bridge::security::{Keys, fresh_nonce, sign, unix_now};
use aglx_bridge::{Frame, Limits, MessageType, Subscribe, Transport, decode_datagram};
use common::*;
use tokio::net::UdpSocket;

async fn socket() -> UdpSocket {
    UdpSocket::bind(loopback()).await.unwrap()
}

fn announce(from: &str) -> Frame {
    Frame::new(Transport::Udp, MessageType::AgentAnnounce)
        .from(agent(from))
        .json(&serde_json::json!({
            "agent_name": "exec-1",
            "awcp_url": "http://127.0.0.1:7200/awcp",
            "transports": ["awcpfs"],
            "max_ttl_seconds": 3600,
            "free_capacity": 2,
            "ttl_seconds": 30
        }))
}

/// Waits until the registry satisfies `pred`, polling (UDP has no answer to wait for).
async fn wait_registry(bridge: &aglx_bridge::Bridge, pred: impl Fn(usize) -> bool) -> bool {
    for _ in 0..200 {
        if pred(bridge.registry().agents.len()) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

#[tokio::test]
async fn announce_over_udp_lands_in_the_registry_and_tcp_can_list_it() {
    let bridge = start(config()).await;
    let udp = bridge.udp_addr().unwrap();
    let s = socket().await;
    s.send_to(&announce("agent://exec-1.local").encode().unwrap(), udp)
        .await
        .unwrap();
    assert!(wait_registry(&bridge, |n| n == 1).await);
    let entry = &bridge.registry().agents[0];
    assert_eq!(entry.agent.to_string(), "agent://exec-1.local");
    assert_eq!(entry.announce.free_capacity, Some(2));
    assert!(entry.expires_in_seconds <= 30);

    let mut c = connect(&bridge, "agent://ctl.local", Subscribe::None).await;
    let list = c
        .request(
            Frame::new(Transport::Tcp, MessageType::RegistryUpdate)
                .json(&serde_json::json!({"op": "list"})),
        )
        .await
        .unwrap();
    let listing: aglx_bridge::registry::Listing = list.body_as().unwrap();
    assert_eq!(listing.agents.len(), 1);
}

#[tokio::test]
async fn credits_and_task_data_are_refused_over_udp_and_never_amplified() {
    let bridge = start(config()).await;
    let udp = bridge.udp_addr().unwrap();
    let s = socket().await;

    let mut with_credits = announce("agent://exec-2.local");
    with_credits.credits = Some(5);
    let mut task = Frame::new(Transport::Udp, MessageType::TaskAssign)
        .from(agent("agent://exec-3.local"))
        .json(&serde_json::json!({"task": "x"}));
    task.credits = None;
    for frame in [with_credits, task] {
        let bytes = frame.encode().unwrap();
        s.send_to(&bytes, udp).await.unwrap();
        let mut buf = [0u8; 2048];
        let (n, _) = tokio::time::timeout(Duration::from_secs(5), s.recv_from(&mut buf))
            .await
            .expect("no refusal")
            .unwrap();
        assert!(n <= bytes.len(), "answered {n} bytes to {}", bytes.len());
        let d = decode_datagram(&buf[..n], &Limits::UDP).unwrap();
        assert_eq!(d.frame.status, Some(aglx_bridge::Status::BadRequest));
    }
    // A tiny bad datagram gets no answer at all: any answer would be larger.
    s.send_to(b"AGLX/9.9 UDP\n\n", udp).await.unwrap();
    let mut buf = [0u8; 2048];
    assert!(
        tokio::time::timeout(Duration::from_millis(500), s.recv_from(&mut buf))
            .await
            .is_err()
    );
    // Oversize datagrams are refused and not registered.
    let mut big = announce("agent://exec-4.local");
    big.body = format!("{{\"agent_name\":\"{}\"}}", "x".repeat(2000));
    s.send_to(&big.encode().unwrap(), udp).await.unwrap();
    // A valid announce after them is processed: the refusals did not stop the listener.
    s.send_to(&announce("agent://exec-5.local").encode().unwrap(), udp)
        .await
        .unwrap();
    assert!(wait_registry(&bridge, |n| n == 1).await);
    assert_eq!(
        bridge.registry().agents[0].agent.to_string(),
        "agent://exec-5.local"
    );
}

#[tokio::test]
async fn signed_announces_verify_and_bad_signatures_are_dropped() {
    let mut cfg = config();
    cfg.policy.keys = Keys::new().with("lab.example", b"k".to_vec());
    let bridge = start(cfg).await;
    let udp = bridge.udp_addr().unwrap();
    let s = socket().await;
    let a = announce("agent://exec-1.lab.example");
    let bad = sign(&a, b"wrong", unix_now(), &fresh_nonce()).unwrap();
    s.send_to(&bad, udp).await.unwrap();
    let good = sign(
        &announce("agent://exec-2.lab.example"),
        b"k",
        unix_now(),
        &fresh_nonce(),
    )
    .unwrap();
    // In a zone with a key, an unsigned announce is refused: registry entries decide where
    // `delegate --to auto` sends a workspace.
    let unsigned = announce("agent://exec-3.lab.example").encode().unwrap();
    s.send_to(&unsigned, udp).await.unwrap();
    let mut buf = [0u8; 2048];
    let (n, _) = tokio::time::timeout(Duration::from_secs(5), s.recv_from(&mut buf))
        .await
        .expect("no refusal")
        .unwrap();
    let d = decode_datagram(&buf[..n], &Limits::UDP).unwrap();
    assert_eq!(d.frame.status, Some(aglx_bridge::Status::Unauthorized));
    s.send_to(&good, udp).await.unwrap();
    assert!(wait_registry(&bridge, |n| n >= 1).await);
    let agents = bridge.registry().agents;
    assert_eq!(agents.len(), 1);
    assert_eq!(agents[0].agent.to_string(), "agent://exec-2.lab.example");
}
