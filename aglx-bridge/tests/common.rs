//! Shared helpers for the bridge's end-to-end tests.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use aglx_bridge::{AgentUri, Bridge, BridgeConfig, Client, ClientConfig, Subscribe};

pub fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

pub fn agent(s: &str) -> AgentUri {
    s.parse().unwrap()
}

pub fn config() -> BridgeConfig {
    let mut cfg = BridgeConfig::new(loopback(), Some(loopback()));
    cfg.handshake_timeout = Duration::from_secs(5);
    cfg.frame_timeout = Duration::from_secs(1);
    cfg
}

pub async fn start(cfg: BridgeConfig) -> Bridge {
    Bridge::start(cfg).await.unwrap()
}

pub fn client_cfg(me: &str, subscribe: Subscribe) -> ClientConfig {
    let mut c = ClientConfig::new(agent(me));
    c.subscribe = subscribe;
    c.timeout = Duration::from_secs(10);
    c
}

pub async fn connect(bridge: &Bridge, me: &str, subscribe: Subscribe) -> Client {
    Client::connect(&bridge.tcp_addr().to_string(), client_cfg(me, subscribe))
        .await
        .unwrap()
}

/// Reads everything until the peer closes, with a deadline.
pub async fn read_to_close(s: &mut tokio::net::TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("bridge did not close the connection")
        .ok();
    out
}
