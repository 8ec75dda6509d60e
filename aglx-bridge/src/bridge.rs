//! The bridge: a TCP (or TLS) server with handshake, a UDP announce listener, a registry of
//! announced agents, and forwarding of frames to subscribers.
//!
//! Each TCP connection runs two tasks: a reader that decodes, checks and handles frames, and a
//! writer fed by a bounded queue. Answers to the peer's own frames wait for room in that queue
//! (backpressure on the peer itself); frames forwarded from other peers are offered without
//! waiting and dropped for that subscriber when its queue is full, so one slow subscriber never
//! holds up anyone else. Every write has a deadline.
//!
//! Bad input ends a connection: the reader queues one error frame (`status.report` with
//! `STATUS: 400`/`401`/`500`), the writer flushes it, and the connection closes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout};

use crate::codec::{Limits, decode_datagram};
use crate::frame::{Frame, MessageType, Status, Transport};
use crate::io::{BoxIo, Deadlines, FrameReader, RawFrame, ReadError, write_within};
use crate::registry::{Announce, Listing, Registry};
use crate::security::{Policy, Verifier, unix_now};
use crate::uri::{AgentUri, Recipient};

/// Frames queued per connection before forwarded frames are dropped for it.
pub const QUEUE_FRAMES: usize = 256;
/// Bytes queued per connection before forwarded frames are dropped for it: with frames shared
/// between subscribers, this bounds what a subscriber that stops reading can pin in memory.
pub const QUEUE_BYTES: usize = 4 * 1024 * 1024;

/// How the bridge runs.
#[derive(Debug, Clone)]
pub struct BridgeConfig {
    /// TCP (or TLS) listen address.
    pub tcp: SocketAddr,
    /// UDP listen address for announces; `None` for no UDP.
    pub udp: Option<SocketAddr>,
    /// The bridge's own address (`FROM` of its answers).
    pub me: AgentUri,
    /// Limits for TCP frames.
    pub limits: Limits,
    /// Limits for datagrams.
    pub udp_limits: Limits,
    /// Signature keys and replay settings.
    pub policy: Policy,
    /// How long a new connection has to complete TLS and send its handshake.
    pub handshake_timeout: Duration,
    /// How long one frame may take from first to last byte.
    pub frame_timeout: Duration,
    /// How long a connection may be silent between frames.
    pub idle_timeout: Duration,
    /// How long one write may take.
    pub write_timeout: Duration,
    /// Most concurrent connections; more are answered with 500 and closed.
    pub max_connections: usize,
    /// TLS on the TCP port, if set.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl BridgeConfig {
    /// Defaults: `agent://bridge.local`, TCP limits, 10 s handshake and frame timeouts,
    /// 300 s idle, 256 connections, no TLS, no keys.
    pub fn new(tcp: SocketAddr, udp: Option<SocketAddr>) -> Self {
        BridgeConfig {
            tcp,
            udp,
            me: AgentUri::new("bridge", "local").unwrap_or_else(|_| unreachable!()),
            limits: Limits::TCP,
            udp_limits: Limits::UDP,
            policy: Policy::default(),
            handshake_timeout: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            write_timeout: Duration::from_secs(10),
            max_connections: 256,
            tls: None,
        }
    }
}

/// What a connection receives besides the answers to its own frames (handshake body
/// `{"subscribe": …}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Subscribe {
    /// Frames addressed to the handshake's `FROM`, and broadcasts.
    #[default]
    Own,
    /// Every frame from every other peer.
    All,
    /// Nothing.
    None,
}

/// The handshake body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HandshakeBody {
    /// What to receive.
    #[serde(default)]
    pub subscribe: Subscribe,
}

/// The body of an answer or error frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusBody {
    /// The numeric status (same as the `STATUS` header).
    pub status: u16,
    /// The seed's meaning of the status.
    pub reason: String,
    /// What went wrong, for errors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// How many subscribers a forwarded frame reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered: Option<usize>,
}

/// The body of a registry query.
#[derive(Debug, Clone, Deserialize)]
struct RegistryOp {
    op: String,
}

struct Subscriber {
    agent: AgentUri,
    mode: Subscribe,
    tx: mpsc::Sender<Arc<Vec<u8>>>,
    /// Bytes in `tx`'s queue, not yet written.
    queued: Arc<AtomicUsize>,
}

struct Shared {
    cfg: BridgeConfig,
    verifier: Verifier,
    subscribers: Mutex<HashMap<u64, Subscriber>>,
    registry: Mutex<Registry>,
    next_id: AtomicU64,
    conns: Arc<Semaphore>,
}

/// A running bridge. Dropping it stops it.
pub struct Bridge {
    tcp_addr: SocketAddr,
    udp_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    tasks: JoinSet<()>,
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge")
            .field("tcp", &self.tcp_addr)
            .field("udp", &self.udp_addr)
            .finish()
    }
}

impl Bridge {
    /// Binds the sockets and starts serving.
    pub async fn start(cfg: BridgeConfig) -> std::io::Result<Bridge> {
        let tcp = TcpListener::bind(cfg.tcp).await?;
        let udp = match cfg.udp {
            Some(a) => Some(UdpSocket::bind(a).await?),
            None => None,
        };
        let tcp_addr = tcp.local_addr()?;
        let udp_addr = udp.as_ref().map(UdpSocket::local_addr).transpose()?;
        let shared = Arc::new(Shared {
            verifier: Verifier::new(cfg.policy.clone()),
            conns: Arc::new(Semaphore::new(cfg.max_connections)),
            cfg,
            subscribers: Mutex::new(HashMap::new()),
            registry: Mutex::new(Registry::new()),
            next_id: AtomicU64::new(1),
        });
        let mut tasks = JoinSet::new();
        tasks.spawn(accept_loop(shared.clone(), tcp));
        if let Some(udp) = udp {
            tasks.spawn(udp_loop(shared.clone(), udp));
        }
        tracing::info!(%tcp_addr, ?udp_addr, tls = shared.cfg.tls.is_some(), "AGLX bridge listening");
        Ok(Bridge {
            tcp_addr,
            udp_addr,
            shared,
            tasks,
        })
    }

    /// The bound TCP address.
    pub fn tcp_addr(&self) -> SocketAddr {
        self.tcp_addr
    }

    /// The bound UDP address, if UDP is on.
    pub fn udp_addr(&self) -> Option<SocketAddr> {
        self.udp_addr
    }

    /// The live registry entries.
    pub fn registry(&self) -> Listing {
        Listing::of(lock(&self.shared.registry).list(Instant::now()))
    }

    /// Serves until one of the listeners fails (it normally never returns).
    pub async fn wait(mut self) {
        while let Some(r) = self.tasks.join_next().await {
            if let Err(e) = r {
                tracing::error!(error = %e, "bridge task ended");
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A `status.report` answer or error frame from the bridge.
pub(crate) fn status_frame(
    me: &AgentUri,
    to: Option<&AgentUri>,
    status: Status,
    detail: Option<String>,
    delivered: Option<usize>,
) -> Vec<u8> {
    let mut f = Frame::new(Transport::Tcp, MessageType::StatusReport)
        .from(me.clone())
        .status(status)
        .json(&StatusBody {
            status: status.code(),
            reason: status.reason().into(),
            detail,
            delivered,
        });
    f.to = to.cloned().map(Recipient::Agent);
    // Our own fields and a JSON body: encoding cannot fail.
    f.encode().unwrap_or_default()
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut conns = JoinSet::new();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        let shared = shared.clone();
        conns.spawn(async move {
            let Ok(permit) = shared.conns.clone().try_acquire_owned() else {
                tracing::warn!(%peer, "connection limit reached");
                refuse(&shared, stream).await;
                return;
            };
            let span = tracing::info_span!("aglx_conn", %peer);
            let _ = tracing::Instrument::instrument(serve(shared.clone(), stream), span).await;
            drop(permit);
        });
    }
}

/// Answers a connection over the limit with 500 and closes it (plain TCP only: a TLS
/// handshake would cost what the limit is there to save).
async fn refuse(shared: &Shared, mut stream: TcpStream) {
    let bytes = status_frame(
        &shared.cfg.me,
        None,
        Status::InternalError,
        Some("connection limit reached, try again later".into()),
        None,
    );
    if shared.cfg.tls.is_none() {
        let _ = write_within(&mut stream, &bytes, shared.cfg.write_timeout).await;
    }
    let _ = stream.shutdown().await;
}

async fn serve(shared: Arc<Shared>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let io: BoxIo = match &shared.cfg.tls {
        None => Box::new(stream),
        Some(tls) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.clone());
            match timeout(shared.cfg.handshake_timeout, acceptor.accept(stream)).await {
                Ok(Ok(s)) => Box::new(s),
                Ok(Err(e)) => {
                    tracing::info!(error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::info!("TLS handshake timed out");
                    return;
                }
            }
        }
    };
    let (mut rd, mut wr) = tokio::io::split(io);
    let (tx, mut rx) = mpsc::channel::<Arc<Vec<u8>>>(QUEUE_FRAMES);
    let queued = Arc::new(AtomicUsize::new(0));
    let write_timeout = shared.cfg.write_timeout;
    let written = queued.clone();
    let writer = tokio::spawn(async move {
        while let Some(bytes) = rx.recv().await {
            let r = write_within(&mut wr, &bytes, write_timeout).await;
            written.fetch_sub(bytes.len(), Ordering::Relaxed);
            if let Err(e) = r {
                tracing::info!(error = %e, "write to peer failed");
                break;
            }
        }
        let _ = timeout(write_timeout, wr.shutdown()).await;
    });
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let mut session = Session {
        shared: shared.clone(),
        id,
        agent: None,
        tx,
        queued,
    };
    let mut reader = FrameReader::new(shared.cfg.limits);
    if let Err((status, detail)) = session.run(&mut reader, &mut rd).await {
        tracing::info!(status = status.code(), %detail, "closing connection");
        let bytes = status_frame(
            &shared.cfg.me,
            session.agent.as_ref(),
            status,
            Some(detail),
            None,
        );
        let _ = session.send(bytes).await;
    }
    lock(&shared.subscribers).remove(&id);
    drop(session);
    let _ = timeout(write_timeout * 2, writer).await;
}

struct Session {
    shared: Arc<Shared>,
    id: u64,
    agent: Option<AgentUri>,
    tx: mpsc::Sender<Arc<Vec<u8>>>,
    queued: Arc<AtomicUsize>,
}

type Refusal = (Status, String);

fn read_refusal(e: ReadError) -> Refusal {
    let status = match &e {
        ReadError::Frame(fe) => fe.status(),
        _ => Status::BadRequest,
    };
    (status, e.to_string())
}

impl Session {
    async fn send(&self, bytes: Vec<u8>) -> Result<(), Refusal> {
        self.queued.fetch_add(bytes.len(), Ordering::Relaxed);
        self.tx
            .send(Arc::new(bytes))
            .await
            .map_err(|_| (Status::InternalError, "writer gone".to_string()))
    }

    fn check_auth(&self, raw: &RawFrame) -> Result<(), Refusal> {
        self.shared
            .verifier
            .check(&raw.raw, &raw.decoded, unix_now())
            .map_err(|e| (e.status(), e.to_string()))
    }

    /// Runs the connection; `Err` is the error frame to send before closing. `Ok` is a clean
    /// close by the peer.
    async fn run(
        &mut self,
        reader: &mut FrameReader,
        rd: &mut (impl tokio::io::AsyncRead + Unpin),
    ) -> Result<(), Refusal> {
        let cfg = &self.shared.cfg;
        let hs_deadlines = Deadlines {
            idle: cfg.handshake_timeout,
            frame: cfg.handshake_timeout,
        };
        let Some(hello) = reader.next(rd, hs_deadlines).await.map_err(read_refusal)? else {
            return Ok(());
        };
        let f = &hello.decoded.frame;
        if f.msg_type != Some(MessageType::Handshake) {
            return Err((
                Status::BadRequest,
                "the first frame must be TYPE: handshake".into(),
            ));
        }
        let Some(agent) = f.from.clone() else {
            return Err((Status::BadRequest, "handshake needs FROM".into()));
        };
        if agent == cfg.me {
            return Err((
                Status::BadRequest,
                "FROM is the bridge's own address".into(),
            ));
        }
        let body: HandshakeBody = if f.body.is_empty() {
            HandshakeBody::default()
        } else {
            f.body_as().ok_or((
                Status::BadRequest,
                r#"handshake body must be {"subscribe":"own"|"all"|"none"}"#.to_string(),
            ))?
        };
        self.check_auth(&hello)?;
        self.agent = Some(agent.clone());
        lock(&self.shared.subscribers).insert(
            self.id,
            Subscriber {
                agent: agent.clone(),
                mode: body.subscribe,
                tx: self.tx.clone(),
                queued: self.queued.clone(),
            },
        );
        tracing::info!(%agent, subscribe = ?body.subscribe, "handshake");
        let ack = Frame::new(Transport::Tcp, MessageType::HandshakeAck)
            .from(cfg.me.clone())
            .to(Recipient::Agent(agent.clone()))
            .status(Status::Continue);
        self.send(ack.encode().unwrap_or_default()).await?;

        let deadlines = Deadlines {
            idle: cfg.idle_timeout,
            frame: cfg.frame_timeout,
        };
        while let Some(raw) = reader.next(rd, deadlines).await.map_err(read_refusal)? {
            let answer = self.handle(&agent, raw)?;
            self.send(answer).await?;
        }
        Ok(())
    }

    /// Handles one frame in the READY state and returns the answer.
    fn handle(&self, agent: &AgentUri, raw: RawFrame) -> Result<Vec<u8>, Refusal> {
        let cfg = &self.shared.cfg;
        let f = &raw.decoded.frame;
        let Some(msg_type) = &f.msg_type else {
            return Err((Status::BadRequest, "frame has no TYPE".into()));
        };
        if f.from.as_ref() != Some(agent) {
            return Err((
                Status::BadRequest,
                "FROM must be the address given in the handshake".into(),
            ));
        }
        self.check_auth(&raw)?;
        let ok = |delivered| status_frame(&cfg.me, Some(agent), Status::Ok, None, delivered);
        match msg_type {
            MessageType::Handshake | MessageType::HandshakeAck => Err((
                Status::BadRequest,
                "handshake after the connection is ready".into(),
            )),
            MessageType::RegistryUpdate
                if f.body_as::<RegistryOp>().is_some_and(|o| o.op == "list") =>
            {
                let listing = Listing::of(lock(&self.shared.registry).list(Instant::now()));
                let reply = Frame::new(Transport::Tcp, MessageType::RegistryUpdate)
                    .from(cfg.me.clone())
                    .to(Recipient::Agent(agent.clone()))
                    .status(Status::Ok)
                    .json(&listing);
                Ok(reply.encode().unwrap_or_default())
            }
            MessageType::AgentAnnounce | MessageType::RegistryUpdate => {
                register(&self.shared, agent, f, &raw.raw[..raw.decoded.len])?;
                let delivered = self.forward(agent, &raw);
                Ok(ok(Some(delivered)))
            }
            _ => {
                let delivered = self.forward(agent, &raw);
                if let Some(Recipient::Agent(to)) = &f.to
                    && to == &cfg.me
                {
                    // Addressed to the bridge itself (the `FROM` of its `handshake.ack`): the
                    // bridge is the recipient, so it is delivered (and counted) here.
                    tracing::debug!(%agent, msg_type = %msg_type, "frame for the bridge itself");
                    return Ok(ok(Some(delivered + 1)));
                }
                if let Some(Recipient::Agent(to)) = &f.to
                    && delivered == 0
                    && !self.is_subscribed(to)
                    && !lock(&self.shared.registry).contains(to, Instant::now())
                {
                    return Ok(status_frame(
                        &cfg.me,
                        Some(agent),
                        Status::AgentNotFound,
                        Some(format!("{to} is not connected and not registered")),
                        Some(0),
                    ));
                }
                Ok(ok(Some(delivered)))
            }
        }
    }

    fn is_subscribed(&self, to: &AgentUri) -> bool {
        lock(&self.shared.subscribers)
            .values()
            .any(|s| &s.agent == to)
    }

    /// Offers the frame's exact bytes to every matching subscriber but the sender; returns how
    /// many took it.
    fn forward(&self, from: &AgentUri, raw: &RawFrame) -> usize {
        let to = &raw.decoded.frame.to;
        let bytes = Arc::new(raw.raw.clone());
        let subs = lock(&self.shared.subscribers);
        let mut delivered = 0;
        for (id, s) in subs.iter() {
            if *id == self.id {
                continue;
            }
            let wanted = match s.mode {
                Subscribe::All => true,
                Subscribe::None => false,
                Subscribe::Own => match to {
                    Some(Recipient::Broadcast) => true,
                    Some(Recipient::Agent(a)) => a == &s.agent,
                    None => false,
                },
            };
            if !wanted {
                continue;
            }
            // Reserve the bytes first, so concurrent senders cannot overshoot the budget.
            let before = s.queued.fetch_add(bytes.len(), Ordering::Relaxed);
            let fits = before + bytes.len() <= QUEUE_BYTES;
            if fits && s.tx.try_send(bytes.clone()).is_ok() {
                delivered += 1;
            } else {
                s.queued.fetch_sub(bytes.len(), Ordering::Relaxed);
                tracing::warn!(%from, to = %s.agent, "subscriber queue full, frame dropped");
            }
        }
        delivered
    }
}

fn register(shared: &Shared, agent: &AgentUri, f: &Frame, raw: &[u8]) -> Result<(), Refusal> {
    require_signed_registration(&shared.verifier, agent, f)?;
    let announce = parse_announce(f)?;
    let signed = f.signature.is_some();
    tracing::debug!(%agent, ?announce, signed, "registered");
    if !lock(&shared.registry).upsert_frame(
        agent.clone(),
        announce,
        Instant::now(),
        Some(raw),
        signed,
    ) {
        return Err(unsigned_over_signed(agent));
    }
    Ok(())
}

/// An unsigned announce for an agent whose live entry is signed.
fn unsigned_over_signed(agent: &AgentUri) -> Refusal {
    (
        Status::Unauthorized,
        format!("{agent} has a signed entry; only a signed announce replaces it"),
    )
}

async fn udp_loop(shared: Arc<Shared>, sock: UdpSocket) {
    // One byte more than the limit, so an oversize datagram is seen as such, not truncated.
    let mut buf = vec![0u8; shared.cfg.udp_limits.max_header_block + 1];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "udp receive failed");
                continue;
            }
        };
        let dgram = &buf[..n];
        if let Err((status, detail)) = handle_datagram(&shared, dgram) {
            tracing::info!(%peer, status = status.code(), %detail, "datagram refused");
            let reply = Frame::new(Transport::Udp, MessageType::StatusReport)
                .status(status)
                .encode()
                .unwrap_or_default();
            // Never answer with more bytes than were received: no amplification.
            if !reply.is_empty() && reply.len() <= n {
                let _ = sock.send_to(&reply, peer).await;
            }
        }
    }
}

fn handle_datagram(shared: &Shared, dgram: &[u8]) -> Result<(), Refusal> {
    let (agent, announce, signed) =
        accept_announce(dgram, &shared.cfg.udp_limits, &shared.verifier)?;
    if signed {
        tracing::debug!(%agent, ?announce, "registered over UDP (signed)");
    } else {
        // Kept, and listed as unsigned: `delegate --to auto` never chooses such an entry.
        tracing::info!(%agent, "unsigned announce registered, marked unsigned");
    }
    if !lock(&shared.registry).upsert_frame(
        agent.clone(),
        announce,
        Instant::now(),
        Some(dgram),
        signed,
    ) {
        return Err(unsigned_over_signed(&agent));
    }
    Ok(())
}

/// Checks one datagram: a size-capped, UDP, `agent.announce` frame without credits, from an
/// agent, signed if signed at all, with a valid announce body. Returns the announcer, its
/// announce and whether it was signed, or the status and reason of the refusal.
///
/// A signed announce from a zone this receiver holds no key for is kept, not refused: the
/// receiver cannot vouch for it, but the Delegator that reads the registry holds the key and
/// checks the frame itself (`Entry::frame`).
pub(crate) fn accept_announce(
    dgram: &[u8],
    limits: &Limits,
    verifier: &Verifier,
) -> Result<(AgentUri, Announce, bool), (Status, String)> {
    if dgram.len() > limits.max_header_block {
        return Err((Status::BadRequest, "datagram too large".into()));
    }
    let decoded = decode_datagram(dgram, limits).map_err(|e| (e.status(), e.to_string()))?;
    let f = &decoded.frame;
    if f.msg_type != Some(MessageType::AgentAnnounce) {
        return Err((
            Status::BadRequest,
            "UDP carries agent.announce only; use TCP".into(),
        ));
    }
    if f.credits.is_some() {
        return Err((Status::BadRequest, "credits never travel over UDP".into()));
    }
    let Some(agent) = f.from.clone() else {
        return Err((Status::BadRequest, "announce needs FROM".into()));
    };
    match verifier.check(dgram, &decoded, unix_now()) {
        Ok(()) | Err(crate::error::AuthError::UnknownZone { .. }) => {}
        Err(e) => return Err((e.status(), e.to_string())),
    }
    require_signed_registration(verifier, &agent, f)?;
    let announce = parse_announce(f)?;
    Ok((agent, announce, f.signature.is_some()))
}

/// Registry entries decide where `delegate --to auto` sends a workspace, so in a zone with a
/// key only signed announces may create or refresh one (the signature itself was checked by
/// the verifier already).
fn require_signed_registration(
    verifier: &Verifier,
    agent: &AgentUri,
    f: &Frame,
) -> Result<(), Refusal> {
    if f.signature.is_none() && verifier.policy().keys.lookup(agent.domain()).is_some() {
        return Err((
            Status::Unauthorized,
            format!(
                "announces from trust zone {} must be signed",
                agent.domain()
            ),
        ));
    }
    Ok(())
}

fn parse_announce(f: &Frame) -> Result<Announce, Refusal> {
    let announce: Announce = if f.body.is_empty() {
        Announce::default()
    } else {
        f.body_as()
            .ok_or((Status::BadRequest, "announce body is not an object".into()))?
    };
    announce
        .validate()
        .map_err(|e| (Status::BadRequest, e.to_string()))?;
    Ok(announce)
}
