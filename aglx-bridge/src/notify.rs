//! What `awcp-ctl` uses: a best-effort [`Notifier`] that sends frames to a bridge, an
//! [`Announcer`] that announces an Executor over UDP, and a [`Discovery`] listener that
//! collects announces.
//!
//! The Notifier never blocks and never fails the caller: frames go into a bounded queue and a
//! background task delivers them, reconnecting with backoff. When the queue is full, or the
//! bridge refuses a frame, the frame is dropped and counted ([`NotifierStats`]) — AWCP work
//! must not wait for, or fail because of, a notification.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::bridge::{Subscribe, accept_announce};
use crate::client::{Client, ClientConfig, ClientError};
use crate::codec::Limits;
use crate::frame::{Frame, MessageType, Transport};
use crate::registry::{Announce, Entry, Listing, Registry};
use crate::security::{Policy, Verifier, fresh_nonce, sign, unix_now};
use crate::uri::AgentUri;

/// Where a bridge listens: `aglx://host:port` (TCP) or `aglxs://host:port` (TLS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `host:port`.
    pub addr: String,
    /// The host, for TLS server-name verification.
    pub host: String,
    /// Whether to speak TLS.
    pub tls: bool,
}

/// An endpoint URL could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an AGLX address: use aglx://host:port or aglxs://host:port")]
pub struct BadEndpoint(pub String);

impl std::str::FromStr for Endpoint {
    type Err = BadEndpoint;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadEndpoint(s.to_string());
        let (tls, rest) = if let Some(r) = s.strip_prefix("aglxs://") {
            (true, r)
        } else if let Some(r) = s.strip_prefix("aglx://") {
            (false, r)
        } else {
            return Err(bad());
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || port == 0 || host.contains(['/', '@', ' ']) {
            return Err(bad());
        }
        let addr = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Ok(Endpoint {
            addr,
            host: host.to_string(),
            tls,
        })
    }
}

/// How a [`Notifier`] connects.
#[derive(Clone)]
pub struct NotifierConfig {
    /// The bridge.
    pub endpoint: Endpoint,
    /// This side's address.
    pub me: AgentUri,
    /// Signing key for `me`'s zone (credits and task data must be signed where the bridge has
    /// a key for it).
    pub key: Option<Vec<u8>>,
    /// TLS client configuration, required for `aglxs://`.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Frames queued while the bridge is slow or away (default 1024).
    pub queue: usize,
    /// Longest wait between reconnection attempts (default 10 s).
    pub max_backoff: Duration,
    /// Deadline for connecting and for each answer (default 5 s).
    pub timeout: Duration,
}

impl std::fmt::Debug for NotifierConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifierConfig")
            .field("endpoint", &self.endpoint)
            .field("me", &self.me)
            .field("signed", &self.key.is_some())
            .finish()
    }
}

impl NotifierConfig {
    /// Defaults for an endpoint and address.
    pub fn new(endpoint: Endpoint, me: AgentUri) -> Self {
        NotifierConfig {
            endpoint,
            me,
            key: None,
            tls: None,
            queue: 1024,
            max_backoff: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
        }
    }
}

/// Counters of a [`Notifier`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotifierStats {
    /// Frames the bridge accepted.
    pub sent: u64,
    /// Frames dropped: queue full, refused by the bridge, or undeliverable.
    pub dropped: u64,
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    dropped: AtomicU64,
}

/// Sends frames to a bridge in the background; see the module docs.
pub struct Notifier {
    tx: mpsc::Sender<Frame>,
    counters: Arc<Counters>,
    task: JoinHandle<()>,
    me: AgentUri,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("me", &self.me)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Notifier {
    /// Starts the background task (needs a Tokio runtime). Returns at once: connecting happens
    /// in the background.
    pub fn start(cfg: NotifierConfig) -> Notifier {
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        let counters = Arc::new(Counters::default());
        let me = cfg.me.clone();
        let task = tokio::spawn(deliver(cfg, rx, counters.clone()));
        Notifier {
            tx,
            counters,
            task,
            me,
        }
    }

    /// Queues a frame; drops (and counts) it when the queue is full. Never blocks.
    pub fn notify(&self, frame: Frame) {
        if self.tx.try_send(frame).is_err() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!("AGLX notification dropped: queue full");
        }
    }

    /// Queues a frame of `msg_type` to `to` (or to nobody in particular) with a JSON body.
    pub fn send<T: serde::Serialize>(
        &self,
        msg_type: MessageType,
        to: Option<&AgentUri>,
        credits: Option<u64>,
        body: &T,
    ) {
        let mut f = Frame::new(Transport::Tcp, msg_type).json(body);
        f.to = to.cloned().map(crate::uri::Recipient::Agent);
        f.credits = credits;
        self.notify(f);
    }

    /// The counters so far.
    pub fn stats(&self) -> NotifierStats {
        NotifierStats {
            sent: self.counters.sent.load(Ordering::Relaxed),
            dropped: self.counters.dropped.load(Ordering::Relaxed),
        }
    }

    /// Stops accepting frames and gives the background task up to `grace` to deliver what is
    /// queued.
    pub async fn close(self, grace: Duration) -> NotifierStats {
        let Notifier {
            tx, counters, task, ..
        } = self;
        drop(tx);
        let abort = task.abort_handle();
        if tokio::time::timeout(grace, task).await.is_err() {
            abort.abort();
        }
        NotifierStats {
            sent: counters.sent.load(Ordering::Relaxed),
            dropped: counters.dropped.load(Ordering::Relaxed),
        }
    }
}

async fn connect(cfg: &NotifierConfig) -> Result<Client, ClientError> {
    let mut c = ClientConfig::new(cfg.me.clone());
    c.subscribe = Subscribe::None;
    c.key = cfg.key.clone();
    c.timeout = cfg.timeout;
    if cfg.endpoint.tls {
        let tls = cfg
            .tls
            .clone()
            .ok_or_else(|| ClientError::ServerName("aglxs:// needs a TLS configuration".into()))?;
        c.tls = Some((tls, cfg.endpoint.host.clone()));
    }
    Client::connect(&cfg.endpoint.addr, c).await
}

async fn deliver(cfg: NotifierConfig, mut rx: mpsc::Receiver<Frame>, counters: Arc<Counters>) {
    let mut client: Option<Client> = None;
    let mut backoff = Duration::from_millis(100);
    let mut retry_at = Instant::now();
    while let Some(frame) = rx.recv().await {
        // One retry after a reconnect, then the frame is dropped.
        let mut attempts = 0;
        loop {
            attempts += 1;
            if client.is_none() {
                // Wait out the backoff: frames queue meanwhile (bounded; the excess is
                // dropped by `notify`), so a bridge restart loses nothing that fits.
                tokio::time::sleep_until(retry_at).await;
                match connect(&cfg).await {
                    Ok(c) => {
                        tracing::info!(bridge = %cfg.endpoint.addr, "AGLX notifier connected");
                        client = Some(c);
                        backoff = Duration::from_millis(100);
                    }
                    Err(e) => {
                        tracing::warn!(bridge = %cfg.endpoint.addr, error = %e, "AGLX bridge unreachable; notifications are dropped until it is back");
                        retry_at = Instant::now() + backoff;
                        backoff = (backoff * 2).min(cfg.max_backoff);
                    }
                }
            }
            let Some(c) = client.as_mut() else {
                counters.dropped.fetch_add(1, Ordering::Relaxed);
                break;
            };
            match c.request(frame.clone()).await {
                Ok(_) => {
                    counters.sent.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(ClientError::Refused { status, detail }) => {
                    tracing::warn!(status = status.code(), %detail, "AGLX bridge refused a notification");
                    counters.dropped.fetch_add(1, Ordering::Relaxed);
                    // 400 and 401 close the connection on the bridge's side; 404 does not.
                    if status != crate::frame::Status::AgentNotFound {
                        client = None;
                    }
                    break;
                }
                Err(e) => {
                    tracing::info!(error = %e, "AGLX connection lost");
                    client = None;
                    if attempts >= 2 {
                        counters.dropped.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
        }
    }
}

/// Asks a bridge for its registry (`registry.update` with `{"op":"list"}`).
pub async fn list_registry(cfg: &NotifierConfig) -> Result<Listing, ClientError> {
    let mut c = connect(cfg).await?;
    let answer = c
        .request(
            Frame::new(Transport::Tcp, MessageType::RegistryUpdate)
                .json(&serde_json::json!({"op": "list"})),
        )
        .await?;
    Ok(answer.body_as().unwrap_or_default())
}

/// How an [`Announcer`] announces.
#[derive(Clone)]
pub struct AnnouncerConfig {
    /// Where to send: the bridge's UDP address, Discovery listeners, or a broadcast address.
    pub targets: Vec<SocketAddr>,
    /// This agent.
    pub me: AgentUri,
    /// What to say (its `ttl_seconds` should exceed the interval, e.g. three intervals).
    pub announce: Announce,
    /// How often.
    pub interval: Duration,
    /// Signs announces with this key when set.
    pub key: Option<Vec<u8>>,
}

impl std::fmt::Debug for AnnouncerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnnouncerConfig")
            .field("targets", &self.targets)
            .field("me", &self.me)
            .field("announce", &self.announce)
            .field("interval", &self.interval)
            .finish()
    }
}

/// Announces an agent over UDP periodically until dropped.
#[derive(Debug)]
pub struct Announcer {
    update: watch::Sender<Announce>,
    task: JoinHandle<()>,
}

impl Drop for Announcer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Announcer {
    /// Binds a UDP socket and starts announcing (the first announce goes out at once).
    pub async fn start(cfg: AnnouncerConfig) -> std::io::Result<Announcer> {
        let any: SocketAddr = match cfg.targets.first() {
            Some(SocketAddr::V6(_)) => "[::]:0".parse().unwrap_or_else(|_| unreachable!()),
            _ => "0.0.0.0:0".parse().unwrap_or_else(|_| unreachable!()),
        };
        let sock = UdpSocket::bind(any).await?;
        sock.set_broadcast(true)?;
        let (update, mut rx) = watch::channel(cfg.announce.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(cfg.interval.max(Duration::from_millis(10)));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    changed = rx.changed() => if changed.is_err() { return },
                }
                let announce = rx.borrow_and_update().clone();
                let frame = Frame::new(Transport::Udp, MessageType::AgentAnnounce)
                    .from(cfg.me.clone())
                    .json(&announce);
                let bytes = match &cfg.key {
                    Some(k) => sign(&frame, k, unix_now(), &fresh_nonce()),
                    None => frame.encode(),
                };
                let Ok(bytes) = bytes else {
                    tracing::warn!("announce could not be encoded");
                    continue;
                };
                if bytes.len() > Limits::UDP.max_header_block {
                    tracing::warn!(
                        len = bytes.len(),
                        "announce larger than a datagram may be; not sent"
                    );
                    continue;
                }
                for t in &cfg.targets {
                    if let Err(e) = sock.send_to(&bytes, t).await {
                        tracing::debug!(target = %t, error = %e, "announce not sent");
                    }
                }
            }
        });
        Ok(Announcer { update, task })
    }

    /// Changes what is announced (e.g. free capacity); the change goes out at once.
    pub fn update(&self, f: impl FnOnce(&mut Announce)) {
        self.update.send_modify(f);
    }
}

/// Listens for UDP announces and keeps what it hears in a registry with TTLs. Never answers.
pub struct Discovery {
    addr: SocketAddr,
    registry: Arc<Mutex<Registry>>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Discovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discovery")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Discovery {
    /// Binds `addr` and starts listening. Announces are checked as the bridge checks them
    /// (signatures per `policy`).
    pub async fn bind(addr: SocketAddr, policy: Policy) -> std::io::Result<Discovery> {
        let sock = UdpSocket::bind(addr).await?;
        let addr = sock.local_addr()?;
        let registry = Arc::new(Mutex::new(Registry::new()));
        let reg = registry.clone();
        let verifier = Verifier::new(policy);
        let task = tokio::spawn(async move {
            let limits = Limits::UDP;
            let mut buf = vec![0u8; limits.max_header_block + 1];
            loop {
                let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
                    continue;
                };
                match accept_announce(&buf[..n], &limits, &verifier) {
                    Ok((agent, announce, signed)) => {
                        reg.lock().unwrap_or_else(|e| e.into_inner()).upsert_frame(
                            agent,
                            announce,
                            Instant::now(),
                            Some(&buf[..n]),
                            signed,
                        );
                    }
                    Err((_, why)) => tracing::debug!(%peer, %why, "announce ignored"),
                }
            }
        });
        Ok(Discovery {
            addr,
            registry,
            task,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The agents heard from whose announces have not expired, sorted by address.
    pub fn peers(&self) -> Vec<Entry> {
        self.registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .list(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        let e: Endpoint = "aglx://127.0.0.1:7400".parse().unwrap();
        assert_eq!(e.addr, "127.0.0.1:7400");
        assert!(!e.tls);
        let e: Endpoint = "aglxs://bridge.example:7401/".parse().unwrap();
        assert_eq!((e.host.as_str(), e.tls), ("bridge.example", true));
        let e: Endpoint = "aglx://[::1]:7400".parse().unwrap();
        assert_eq!(e.addr, "[::1]:7400");
        for bad in [
            "http://x:1",
            "aglx://x",
            "aglx://:7400",
            "aglx://x:0",
            "aglx://x:99999",
            "aglx://u@x:1",
        ] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad}");
        }
    }
}
