//! AGLX from awcp-ctl, end to end: the Delegator daemon notifies a real aglx-bridge of a real
//! delegation's life (signed, priced), an unreachable bridge delays nothing, and an Executor's
//! announces reach the bridge's registry and `peers`.

use std::time::Duration;

use aglx_bridge::awcp::{CreditTransfer, StatusReport, TaskAssign, TaskResult};
use aglx_bridge::security::Keys;
use aglx_bridge::{Bridge, BridgeConfig, Client, ClientConfig, Frame, MessageType, Subscribe};
use awcp_ctl::aglx::{AnnounceConfig, NotifyConfig, PeersQuery};
use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available, sample_repo};

const KEY: &str = "delegator-zone-key-0123456789";

async fn bridge() -> Bridge {
    let mut cfg = BridgeConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        Some("127.0.0.1:0".parse().unwrap()),
    );
    cfg.policy.keys = Keys::new().with("awcp.test", KEY.as_bytes().to_vec());
    Bridge::start(cfg).await.unwrap()
}

async fn monitor(bridge: &Bridge) -> Client {
    let mut c = ClientConfig::new("agent://monitor.ops.test".parse().unwrap());
    c.subscribe = Subscribe::All;
    c.timeout = Duration::from_secs(30);
    Client::connect(&bridge.tcp_addr().to_string(), c)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delegations_life_reaches_the_bridge_signed_and_priced() {
    if !fuse_available() {
        return;
    }
    let bridge = bridge().await;
    let mut mon = monitor(&bridge).await;
    let tmp = tempfile::tempdir().unwrap();
    let key_file = tmp.path().join("zone.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let endpoint = format!("aglx://{}", bridge.tcp_addr()).parse().unwrap();
    let h = Harness::start_full(
        "echo hello > from-agent.txt",
        |d| {
            d.aglx = Some(NotifyConfig {
                endpoint,
                me: "agent://delegator.awcp.test".parse().unwrap(),
                key_file: Some(key_file.clone()),
                tls_ca: None,
                pricing: aglx_bridge::awcp::Pricing {
                    per_lease_minute: 2,
                    per_mib: 0,
                },
            })
        },
        |_| {},
    )
    .await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );

    let mut frames: Vec<Frame> = Vec::new();
    while !frames
        .iter()
        .any(|f| f.msg_type == Some(MessageType::CreditTransfer))
    {
        let f = mon.recv().await.expect("notification").decoded.frame;
        assert!(f.signature.is_some(), "unsigned notification {f:?}");
        assert_eq!(
            f.from.as_ref().unwrap().to_string(),
            "agent://delegator.awcp.test"
        );
        frames.push(f);
    }
    let types: Vec<_> = frames.iter().map(|f| f.msg_type.clone().unwrap()).collect();
    assert_eq!(types.first(), Some(&MessageType::TaskAssign), "{types:?}");
    let assign: TaskAssign = frames[0].body_as().unwrap();
    assert_eq!(assign.delegation_id, id);
    assert_eq!(assign.ttl_seconds, 600);
    assert_eq!(frames[0].credits, Some(20), "10 minutes at 2 credits");
    let states: Vec<String> = frames
        .iter()
        .filter_map(|f| f.body_as::<StatusReport>())
        .filter_map(|r| r.state)
        .collect();
    for s in ["accepted", "started", "running"] {
        assert!(states.iter().any(|x| x == s), "no {s} in {states:?}");
    }
    let n = frames.len();
    assert_eq!(types[n - 2], MessageType::TaskResult, "{types:?}");
    let result: TaskResult = frames[n - 2].body_as().unwrap();
    assert_eq!(result.outcome, "completed");
    let credit: CreditTransfer = frames[n - 1].body_as().unwrap();
    assert!(credit.lease_seconds >= 1);
    assert_eq!(credit.credits, 2 * credit.lease_seconds.div_ceil(60));
    assert_eq!(frames[n - 1].credits, Some(credit.credits));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_bridge_delays_nothing() {
    if !fuse_available() {
        return;
    }
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = probe.local_addr().unwrap();
    drop(probe);
    let h = Harness::start_full(
        "echo ok > ok.txt",
        |d| {
            d.aglx = Some(NotifyConfig {
                endpoint: format!("aglx://{dead}").parse().unwrap(),
                me: "agent://delegator.local".parse().unwrap(),
                key_file: None,
                tls_ca: None,
                pricing: Default::default(),
            })
        },
        |_| {},
    )
    .await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("ok.txt")).unwrap(),
        "ok\n"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn executor_announces_reach_the_bridge_and_peers() {
    if !fuse_available() {
        return;
    }
    let bridge = bridge().await;
    let h = Harness::start_with("true", |e| e.max_concurrent = 3).await;
    let (_announcer, refresher) = awcp_ctl::aglx::announce_executor(
        &h.executor,
        &AnnounceConfig {
            targets: vec![bridge.udp_addr().unwrap()],
            me: "agent://exec-1.lab.test".parse().unwrap(),
            awcp_url: None,
            interval: Duration::from_millis(200),
            key_file: None,
        },
    )
    .await
    .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || !bridge
            .registry()
            .agents
            .is_empty())
        .await
    );
    let peers = awcp_ctl::aglx::peers(&PeersQuery {
        bridge: Some(format!("aglx://{}", bridge.tcp_addr()).parse().unwrap()),
        listen: None,
        wait: Duration::ZERO,
        me: "agent://ctl.local".parse().unwrap(),
        key_file: None,
        tls_ca: None,
    })
    .await
    .unwrap();
    assert_eq!(peers.len(), 1);
    let a = &peers[0].announce;
    assert_eq!(peers[0].agent.to_string(), "agent://exec-1.lab.test");
    assert_eq!(a.awcp_url.as_deref(), Some(h.executor.awcp_url().as_str()));
    assert_eq!(a.transports, ["awcpfs"]);
    assert_eq!(a.free_capacity, Some(3));
    assert_eq!(a.max_ttl_seconds, Some(24 * 3600));
    refresher.abort();
    h.stop().await;
}
