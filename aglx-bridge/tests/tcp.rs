//! End-to-end tests of the bridge over loopback TCP and TLS.

mod common;

use std::time::Duration;

use aglx_bridge::bridge::StatusBody;
use aglx_bridge::security::{Keys, fresh_nonce, sign, unix_now};
use aglx_bridge::{
    Client, ClientError, Frame, Limits, MessageType, Recipient, Status, Subscribe, Transport,
    decode_stream,
};
use common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn task(to: &str) -> Frame {
    Frame::new(Transport::Tcp, MessageType::TaskAssign)
        .to(Recipient::Agent(agent(to)))
        .credits(2)
        .json(&serde_json::json!({"task": "analyze.dataset", "priority": 3}))
}

fn error_status(bytes: &[u8]) -> (Status, String) {
    let d = decode_stream(bytes, &Limits::TCP).unwrap().unwrap();
    let body: StatusBody = d.frame.body_as().unwrap();
    assert_eq!(d.frame.msg_type, Some(MessageType::StatusReport));
    assert_eq!(Some(body.status), d.frame.status.map(Status::code));
    (d.frame.status.unwrap(), body.detail.unwrap_or_default())
}

#[tokio::test]
async fn handshake_then_frames_are_forwarded_to_the_addressed_subscriber() {
    let bridge = start(config()).await;
    let mut beta = connect(&bridge, "agent://beta.local", Subscribe::Own).await;
    assert_eq!(beta.bridge().unwrap().to_string(), "agent://bridge.local");
    let mut monitor = connect(&bridge, "agent://monitor.local", Subscribe::All).await;
    let mut alpha = connect(&bridge, "agent://alpha.local", Subscribe::None).await;

    let answer = alpha.request(task("agent://beta.local")).await.unwrap();
    assert_eq!(answer.status, Some(Status::Ok));
    let body: StatusBody = answer.body_as().unwrap();
    assert_eq!(body.delivered, Some(2));

    for c in [&mut beta, &mut monitor] {
        let got = c.recv().await.unwrap();
        let f = got.decoded.frame;
        assert_eq!(f.msg_type, Some(MessageType::TaskAssign));
        assert_eq!(f.from.unwrap().to_string(), "agent://alpha.local");
        assert_eq!(f.credits, Some(2));
    }
    // A frame to someone else reaches only the monitor (so it counts as delivered); a
    // broadcast reaches both.
    let answer = alpha.request(task("agent://gamma.local")).await.unwrap();
    assert_eq!(answer.body_as::<StatusBody>().unwrap().delivered, Some(1));
    let to_gamma = monitor.recv().await.unwrap().decoded.frame;
    assert_eq!(
        to_gamma.to,
        Some(Recipient::Agent(agent("agent://gamma.local")))
    );
    let b = Frame::new(Transport::Tcp, MessageType::StatusReport)
        .to(Recipient::Broadcast)
        .json(&serde_json::json!({"state": "running"}));
    alpha.request(b).await.unwrap();
    let got = beta.recv().await.unwrap().decoded.frame;
    assert_eq!(
        got.msg_type,
        Some(MessageType::StatusReport),
        "beta got {got:?}"
    );
}

#[tokio::test]
async fn unknown_recipient_is_404_and_the_connection_stays_up() {
    let bridge = start(config()).await;
    let mut alpha = connect(&bridge, "agent://alpha.local", Subscribe::None).await;
    match alpha.request(task("agent://nobody.local")).await {
        Err(ClientError::Refused { status, detail }) => {
            assert_eq!(status, Status::AgentNotFound);
            assert!(detail.contains("agent://nobody.local"), "{detail}");
        }
        other => panic!("expected 404, got {other:?}"),
    }
    // Still usable, and registered agents are found even when not connected.
    let ann = Frame::new(Transport::Tcp, MessageType::RegistryUpdate).json(
        &serde_json::json!({"awcp_url": "http://127.0.0.1:7200/awcp", "transports": ["awcpfs"]}),
    );
    alpha.request(ann).await.unwrap();
    assert!(alpha.request(task("agent://alpha.local")).await.is_ok());
    let list = alpha
        .request(
            Frame::new(Transport::Tcp, MessageType::RegistryUpdate)
                .json(&serde_json::json!({"op": "list"})),
        )
        .await
        .unwrap();
    assert_eq!(list.msg_type, Some(MessageType::RegistryUpdate));
    let listing: aglx_bridge::registry::Listing = list.body_as().unwrap();
    assert_eq!(listing.agents.len(), 1);
    assert_eq!(
        listing.agents[0].announce.awcp_url.as_deref(),
        Some("http://127.0.0.1:7200/awcp")
    );
}

// Symptom: a frame to the bridge's own name (the FROM of its handshake.ack) was answered
// 404 "not connected and not registered", although that peer had just acknowledged us.
#[tokio::test]
async fn frame_to_the_bridge_itself_is_delivered_not_404() {
    let bridge = start(config()).await;
    let mut alpha = connect(&bridge, "agent://alpha.local", Subscribe::None).await;
    let me = alpha.bridge().unwrap().to_string();
    let answer = alpha.request(task(&me)).await.unwrap();
    assert_eq!(answer.status, Some(Status::Ok));
    assert_eq!(answer.body_as::<StatusBody>().unwrap().delivered, Some(1));
    // A monitor sees it as well, and is counted besides the bridge.
    let mut monitor = connect(&bridge, "agent://monitor.local", Subscribe::All).await;
    let answer = alpha.request(task(&me)).await.unwrap();
    assert_eq!(answer.body_as::<StatusBody>().unwrap().delivered, Some(2));
    let got = monitor.recv().await.unwrap().decoded.frame;
    assert_eq!(got.to, Some(Recipient::Agent(agent(&me))));
}

#[tokio::test]
async fn first_frame_must_be_a_handshake() {
    let bridge = start(config()).await;
    let mut s = TcpStream::connect(bridge.tcp_addr()).await.unwrap();
    let bytes = task("agent://beta.local")
        .from(agent("agent://alpha.local"))
        .encode()
        .unwrap();
    s.write_all(&bytes).await.unwrap();
    let (status, detail) = error_status(&read_to_close(&mut s).await);
    assert_eq!(status, Status::BadRequest);
    assert!(detail.contains("handshake"), "{detail}");
}

#[tokio::test]
async fn malformed_frame_gets_400_then_close() {
    let bridge = start(config()).await;
    let mut s = TcpStream::connect(bridge.tcp_addr()).await.unwrap();
    s.write_all(b"AGLX/1.0 TCP\nFROM: agent://a.local\nFROM: agent://b.local\n\n")
        .await
        .unwrap();
    let (status, detail) = error_status(&read_to_close(&mut s).await);
    assert_eq!(status, Status::BadRequest);
    assert!(detail.contains("duplicate header FROM"), "{detail}");
}

#[tokio::test]
async fn oversize_frame_is_refused_with_400_before_it_arrives() {
    let bridge = start(config()).await;
    let mut c = connect(&bridge, "agent://alpha.local", Subscribe::None).await;
    // Declare a body over the 1 MiB limit and send only the header block: the refusal must
    // come without the body ever being sent.
    c.send_raw(
        b"AGLX/1.0 TCP\nFROM: agent://alpha.local\nTYPE: status.report\nCONTENT-LENGTH: 5000000\n\n",
    )
    .await
    .unwrap();
    match c.recv().await {
        Ok(raw) => {
            assert_eq!(raw.decoded.frame.status, Some(Status::BadRequest));
            let body: StatusBody = raw.decoded.frame.body_as().unwrap();
            assert!(body.detail.unwrap().contains("larger than the limit"));
        }
        Err(e) => panic!("no 400: {e}"),
    }
    assert!(matches!(c.recv().await, Err(ClientError::Closed)));
    // A header line over the line limit, no newline ever sent: refused too.
    let mut s = TcpStream::connect(bridge.tcp_addr()).await.unwrap();
    s.write_all(b"AGLX/1.0 TCP\nX-A: ").await.unwrap();
    s.write_all(&vec![b'a'; 4096]).await.unwrap();
    let (status, _) = error_status(&read_to_close(&mut s).await);
    assert_eq!(status, Status::BadRequest);
}

#[tokio::test]
async fn slow_sender_is_cut_off() {
    let bridge = start(config()).await; // frame timeout 1 s
    let mut s = TcpStream::connect(bridge.tcp_addr()).await.unwrap();
    let hello = b"AGLX/1.0 TCP\nFROM: agent://slow.local\nTYPE: handshake\n\n";
    let started = tokio::time::Instant::now();
    let dribble = async {
        for b in hello.iter() {
            if s.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    // The dribble would take 16 s; the bridge must close long before it ends.
    let _ = tokio::time::timeout(Duration::from_secs(8), dribble).await;
    let out = read_to_close(&mut s).await;
    let (status, detail) = error_status(&out);
    assert_eq!(status, Status::BadRequest);
    assert!(detail.contains("slow sender"), "{detail}");
    assert!(started.elapsed() < Duration::from_secs(15));
}

#[tokio::test]
async fn connection_limit_answers_500() {
    let mut cfg = config();
    cfg.max_connections = 1;
    let bridge = start(cfg).await;
    let _first = connect(&bridge, "agent://one.local", Subscribe::Own).await;
    let mut s = TcpStream::connect(bridge.tcp_addr()).await.unwrap();
    let (status, detail) = error_status(&read_to_close(&mut s).await);
    assert_eq!(status, Status::InternalError);
    assert!(detail.contains("connection limit"), "{detail}");
}

fn keyed_config() -> aglx_bridge::BridgeConfig {
    let mut cfg = config();
    cfg.policy.keys = Keys::new().with("lab.example", b"zone-key".to_vec());
    cfg
}

#[tokio::test]
async fn signed_frames_pass_and_unsigned_task_frames_are_refused_401() {
    let bridge = start(keyed_config()).await;
    let _beta = connect(&bridge, "agent://beta.lab.example", Subscribe::Own).await;

    let mut signed_cfg = client_cfg("agent://alpha.lab.example", Subscribe::None);
    signed_cfg.key = Some(b"zone-key".to_vec());
    let mut alpha = Client::connect(&bridge.tcp_addr().to_string(), signed_cfg)
        .await
        .unwrap();
    alpha
        .request(task("agent://beta.lab.example"))
        .await
        .unwrap();

    // Unsigned status reports are fine; unsigned tasks are not.
    let mut plain = connect(&bridge, "agent://gamma.lab.example", Subscribe::None).await;
    plain
        .request(Frame::new(Transport::Tcp, MessageType::StatusReport))
        .await
        .unwrap();
    match plain.request(task("agent://beta.lab.example")).await {
        Err(ClientError::Refused { status, detail }) => {
            assert_eq!(status, Status::Unauthorized);
            assert!(detail.contains("must be signed"), "{detail}");
        }
        other => panic!("expected 401, got {other:?}"),
    }

    // A wrong key is refused.
    let mut wrong_cfg = client_cfg("agent://delta.lab.example", Subscribe::None);
    wrong_cfg.key = Some(b"not-the-key".to_vec());
    match Client::connect(&bridge.tcp_addr().to_string(), wrong_cfg).await {
        Err(ClientError::Refused { status, .. }) => assert_eq!(status, Status::Unauthorized),
        other => panic!("expected 401 on a wrongly signed handshake, got {other:?}"),
    }
}

#[tokio::test]
async fn unsigned_registration_is_refused_in_a_keyed_zone() {
    let bridge = start(keyed_config()).await;
    let mut plain = connect(&bridge, "agent://exec.lab.example", Subscribe::None).await;
    let reg = Frame::new(Transport::Tcp, MessageType::RegistryUpdate)
        .json(&serde_json::json!({"awcp_url": "http://10.0.0.66:7200/awcp"}));
    match plain.request(reg.clone()).await {
        Err(ClientError::Refused { status, detail }) => {
            assert_eq!(status, Status::Unauthorized);
            assert!(detail.contains("must be signed"), "{detail}");
        }
        other => panic!("expected 401, got {other:?}"),
    }
    assert!(bridge.registry().agents.is_empty());
    let mut cfg = client_cfg("agent://exec.lab.example", Subscribe::None);
    cfg.key = Some(b"zone-key".to_vec());
    let mut signed = Client::connect(&bridge.tcp_addr().to_string(), cfg)
        .await
        .unwrap();
    signed.request(reg).await.unwrap();
    assert_eq!(bridge.registry().agents.len(), 1);
}

#[tokio::test]
async fn a_subscriber_that_stops_reading_costs_a_bounded_queue_and_blocks_nobody() {
    let bridge = start(config()).await;
    // A monitor that handshakes and then never reads.
    let mut stuck = TcpStream::connect(bridge.tcp_addr()).await.unwrap();
    stuck
        .write_all(
            b"AGLX/1.0 TCP\nFROM: agent://stuck.local\nTYPE: handshake\nCONTENT-LENGTH: 19\n\n{\"subscribe\":\"all\"}",
        )
        .await
        .unwrap();
    // Read its handshake.ack (so it is subscribed), then nothing more.
    let d = aglx_bridge::io::Deadlines {
        idle: Duration::from_secs(10),
        frame: Duration::from_secs(10),
    };
    let ack = aglx_bridge::io::FrameReader::new(Limits::TCP)
        .next(&mut stuck, d)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ack.decoded.frame.status, Some(Status::Continue));
    let mut sender = connect(&bridge, "agent://sender.local", Subscribe::None).await;
    let probe = || {
        Frame::new(Transport::Tcp, MessageType::StatusReport)
            .json(&serde_json::json!({"pad": "x".repeat(900 * 1024)}))
    };
    let mut delivered = Vec::new();
    for _ in 0..40 {
        let answer = sender.request(probe()).await.unwrap();
        delivered.push(answer.body_as::<StatusBody>().unwrap().delivered.unwrap());
    }
    // 40 frames of 900 KiB = 36 MiB: far more than the 4 MiB queue plus socket buffers, so the
    // bridge starts dropping for the stuck monitor, and the sender is never held up.
    assert_eq!(delivered.last(), Some(&0), "{delivered:?}");
    assert!(delivered.contains(&1), "{delivered:?}");
}

#[tokio::test]
async fn replayed_frame_is_refused() {
    let bridge = start(keyed_config()).await;
    let _beta = connect(&bridge, "agent://beta.lab.example", Subscribe::Own).await;
    let mut alpha = connect(&bridge, "agent://alpha.lab.example", Subscribe::None).await;
    let frame = task("agent://beta.lab.example").from(agent("agent://alpha.lab.example"));
    let bytes = sign(&frame, b"zone-key", unix_now(), &fresh_nonce()).unwrap();
    alpha.send_raw(&bytes).await.unwrap();
    assert_eq!(
        alpha.recv().await.unwrap().decoded.frame.status,
        Some(Status::Ok)
    );
    alpha.send_raw(&bytes).await.unwrap();
    let answer = alpha.recv().await.unwrap().decoded.frame;
    assert_eq!(answer.status, Some(Status::Unauthorized));
    let body: StatusBody = answer.body_as().unwrap();
    assert!(body.detail.unwrap().contains("replayed"));
    assert!(matches!(alpha.recv().await, Err(ClientError::Closed)));
    // A stale timestamp is refused as well.
    let mut again = connect(&bridge, "agent://alpha.lab.example", Subscribe::None).await;
    let old = sign(&frame, b"zone-key", unix_now() - 3600, &fresh_nonce()).unwrap();
    again.send_raw(&old).await.unwrap();
    assert_eq!(
        again.recv().await.unwrap().decoded.frame.status,
        Some(Status::Unauthorized)
    );
}

#[tokio::test]
async fn from_must_match_the_handshake() {
    let bridge = start(config()).await;
    let mut alpha = connect(&bridge, "agent://alpha.local", Subscribe::None).await;
    let spoof = task("agent://beta.local")
        .from(agent("agent://mallory.local"))
        .encode()
        .unwrap();
    alpha.send_raw(&spoof).await.unwrap();
    assert_eq!(
        alpha.recv().await.unwrap().decoded.frame.status,
        Some(Status::BadRequest)
    );
}

#[tokio::test]
async fn tls_handshake_and_frames() {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert_pem = cert.cert.pem();
    let key_pem = cert.signing_key.serialize_pem();
    let mut cfg = config();
    cfg.tls =
        Some(aglx_bridge::tls::server_config(cert_pem.as_bytes(), key_pem.as_bytes()).unwrap());
    let bridge = start(cfg).await;
    let client_tls = aglx_bridge::tls::client_config(cert_pem.as_bytes()).unwrap();
    let mut ccfg = client_cfg("agent://beta.local", Subscribe::Own);
    ccfg.tls = Some((client_tls.clone(), "localhost".into()));
    let mut beta = Client::connect(&bridge.tcp_addr().to_string(), ccfg)
        .await
        .unwrap();
    let mut acfg = client_cfg("agent://alpha.local", Subscribe::None);
    acfg.tls = Some((client_tls, "localhost".into()));
    let mut alpha = Client::connect(&bridge.tcp_addr().to_string(), acfg)
        .await
        .unwrap();
    alpha.request(task("agent://beta.local")).await.unwrap();
    let got = beta.recv().await.unwrap().decoded.frame;
    assert_eq!(got.msg_type, Some(MessageType::TaskAssign));

    // Plain text on the TLS port gets nowhere, and a client that does not trust the
    // certificate cannot connect.
    let mut s = TcpStream::connect(bridge.tcp_addr()).await.unwrap();
    s.write_all(b"AGLX/1.0 TCP\nFROM: agent://x.local\nTYPE: handshake\n\n")
        .await
        .unwrap();
    let out = read_to_close(&mut s).await;
    assert!(!out.starts_with(b"AGLX"));
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let mut bad = client_cfg("agent://eve.local", Subscribe::Own);
    bad.tls = Some((
        aglx_bridge::tls::client_config(other.cert.pem().as_bytes()).unwrap(),
        "localhost".into(),
    ));
    assert!(matches!(
        Client::connect(&bridge.tcp_addr().to_string(), bad).await,
        Err(ClientError::Connect { .. })
    ));
}
