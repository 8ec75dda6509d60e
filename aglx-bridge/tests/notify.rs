//! The library API awcp-ctl uses: Notifier, Announcer, Discovery, against a real bridge.

mod common;

use std::time::Duration;

use aglx_bridge::notify::{AnnouncerConfig, list_registry};
use aglx_bridge::registry::Announce;
use aglx_bridge::security::{Keys, Policy};
use aglx_bridge::{
    Announcer, Discovery, Endpoint, MessageType, Notifier, NotifierConfig, Subscribe,
};
use common::*;

fn endpoint(bridge: &aglx_bridge::Bridge) -> Endpoint {
    format!("aglx://{}", bridge.tcp_addr()).parse().unwrap()
}

async fn wait_for(mut pred: impl FnMut() -> bool) -> bool {
    for _ in 0..400 {
        if pred() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

#[tokio::test]
async fn notifier_delivers_lifecycle_frames_in_order_signed() {
    let mut cfg = config();
    cfg.policy.keys = Keys::new().with("awcp.test", b"delegator-key".to_vec());
    let bridge = start(cfg).await;
    let mut monitor = connect(&bridge, "agent://monitor.ops.test", Subscribe::All).await;

    let mut ncfg = NotifierConfig::new(endpoint(&bridge), agent("agent://delegator.awcp.test"));
    ncfg.key = Some(b"delegator-key".to_vec());
    let n = Notifier::start(ncfg);
    let exec = agent("agent://executor.awcp.test");
    let id = serde_json::json!({"delegationId": "dlg_0123456789abcdef0123456789abcdef"});
    n.send(MessageType::TaskAssign, Some(&exec), Some(3), &id);
    n.send(MessageType::StatusReport, Some(&exec), None, &id);
    n.send(MessageType::TaskResult, Some(&exec), None, &id);
    n.send(MessageType::CreditTransfer, Some(&exec), Some(3), &id);
    let mut types = Vec::new();
    for _ in 0..4 {
        let f = monitor.recv().await.unwrap().decoded.frame;
        assert!(f.signature.is_some(), "notifier frames are signed");
        assert_eq!(
            f.from.as_ref().unwrap().to_string(),
            "agent://delegator.awcp.test"
        );
        types.push(f.msg_type.unwrap());
    }
    assert_eq!(
        types,
        [
            MessageType::TaskAssign,
            MessageType::StatusReport,
            MessageType::TaskResult,
            MessageType::CreditTransfer
        ]
    );
    let stats = n.close(Duration::from_secs(5)).await;
    assert_eq!((stats.sent, stats.dropped), (4, 0));
}

#[tokio::test]
async fn notifier_never_blocks_without_a_bridge_and_reconnects_when_one_appears() {
    // Reserve a port, then free it: nothing listens there yet.
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = probe.local_addr().unwrap();
    drop(probe);
    let mut ncfg = NotifierConfig::new(
        format!("aglx://{addr}").parse().unwrap(),
        agent("agent://delegator.local"),
    );
    ncfg.queue = 4;
    ncfg.max_backoff = Duration::from_millis(200);
    ncfg.timeout = Duration::from_secs(2);
    let n = Notifier::start(ncfg);
    let started = std::time::Instant::now();
    for _ in 0..100 {
        n.send(
            MessageType::StatusReport,
            None,
            None,
            &serde_json::json!({}),
        );
    }
    // 100 sends into a queue of 4 with no bridge: returned at once, most dropped.
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(n.stats().dropped >= 90, "{:?}", n.stats());

    // Now a bridge appears on that port; later notifications get through.
    let mut cfg = config();
    cfg.tcp = addr;
    cfg.udp = None;
    let bridge = start(cfg).await;
    let mut monitor = connect(&bridge, "agent://monitor.local", Subscribe::All).await;
    let before = n.stats().sent;
    let delivered = wait_for(|| {
        n.send(
            MessageType::StatusReport,
            None,
            None,
            &serde_json::json!({"ping": 1}),
        );
        n.stats().sent > before
    })
    .await;
    assert!(delivered, "notifier never reconnected: {:?}", n.stats());
    let f = monitor.recv().await.unwrap().decoded.frame;
    assert_eq!(f.msg_type, Some(MessageType::StatusReport));
}

#[tokio::test]
async fn announcer_feeds_discovery_and_the_bridge_registry() {
    let bridge = start(config()).await;
    let discovery = Discovery::bind(loopback(), Policy::default())
        .await
        .unwrap();
    let announcer = Announcer::start(AnnouncerConfig {
        targets: vec![bridge.udp_addr().unwrap(), discovery.local_addr()],
        me: agent("agent://exec-1.lab.test"),
        announce: Announce {
            awcp_url: Some("http://127.0.0.1:7200/awcp".into()),
            transports: vec!["awcpfs".into()],
            max_ttl_seconds: Some(3600),
            free_capacity: Some(2),
            ttl_seconds: Some(30),
            ..Announce::default()
        },
        interval: Duration::from_millis(100),
        key: None,
    })
    .await
    .unwrap();
    assert!(wait_for(|| discovery.peers().len() == 1).await);
    assert!(wait_for(|| bridge.registry().agents.len() == 1).await);
    let peer = &discovery.peers()[0];
    assert_eq!(peer.agent.to_string(), "agent://exec-1.lab.test");
    assert_eq!(peer.announce.transports, ["awcpfs"]);

    announcer.update(|a| a.free_capacity = Some(0));
    assert!(
        wait_for(|| discovery.peers()[0].announce.free_capacity == Some(0)).await,
        "capacity update never arrived"
    );

    // awcp-ctl peers asks the bridge over TCP.
    let listing = list_registry(&NotifierConfig::new(
        endpoint(&bridge),
        agent("agent://ctl.local"),
    ))
    .await
    .unwrap();
    assert_eq!(listing.agents.len(), 1);
    assert_eq!(
        listing.agents[0].announce.awcp_url.as_deref(),
        Some("http://127.0.0.1:7200/awcp")
    );
}

#[tokio::test]
async fn discovery_ignores_what_is_not_an_announce() {
    let discovery = Discovery::bind(loopback(), Policy::default())
        .await
        .unwrap();
    let s = tokio::net::UdpSocket::bind(loopback()).await.unwrap();
    let target = discovery.local_addr();
    for junk in [
        &b"hello"[..],
        b"AGLX/1.0 UDP\nFROM: agent://x.y\nTYPE: task.assign\n\n",
        b"AGLX/1.0 UDP\nFROM: agent://x.y\nTYPE: agent.announce\nCREDITS: 1\n\n",
        b"AGLX/1.0 UDP\nTYPE: agent.announce\n\n",
        b"AGLX/1.0 UDP\nFROM: agent://x.y\nTYPE: agent.announce\n\n{\"awcp_url\":\"file:///etc\"}",
    ] {
        s.send_to(junk, target).await.unwrap();
    }
    s.send_to(
        b"AGLX/1.0 UDP\nFROM: agent://ok.y\nTYPE: agent.announce\n\n{}",
        target,
    )
    .await
    .unwrap();
    assert!(wait_for(|| !discovery.peers().is_empty()).await);
    let peers = discovery.peers();
    assert_eq!(peers.len(), 1);
    assert_eq!(peers[0].agent.to_string(), "agent://ok.y");
}
