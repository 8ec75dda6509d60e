//! A TCP (or TLS) client: connect, handshake, then send frames and read what arrives.
//!
//! The bridge answers every frame with exactly one frame carrying a `STATUS`, from its own
//! address. [`Client::request`] sends a frame and returns that answer; frames forwarded from
//! other peers that arrive meanwhile are kept for [`Client::recv`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::bridge::{HandshakeBody, StatusBody, Subscribe};
use crate::codec::Limits;
use crate::error::FrameError;
use crate::frame::{Frame, MessageType, Status, Transport};
use crate::io::{BoxIo, Deadlines, FrameReader, RawFrame, ReadError, write_within};
use crate::security::{fresh_nonce, sign, unix_now};
use crate::uri::AgentUri;

/// How a client connects.
#[derive(Clone)]
pub struct ClientConfig {
    /// This side's address (`FROM` of everything it sends).
    pub me: AgentUri,
    /// What the connection receives from other peers.
    pub subscribe: Subscribe,
    /// Signs every frame with this key (the key of `me`'s zone) when set.
    pub key: Option<Vec<u8>>,
    /// TLS: the client configuration and the server name to verify.
    pub tls: Option<(Arc<rustls::ClientConfig>, String)>,
    /// Limits for frames received.
    pub limits: Limits,
    /// Deadline for connecting, for each write, and for each answer.
    pub timeout: Duration,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("me", &self.me)
            .field("subscribe", &self.subscribe)
            .field("signed", &self.key.is_some())
            .field("tls", &self.tls.as_ref().map(|(_, n)| n))
            .finish()
    }
}

impl ClientConfig {
    /// Plain TCP, unsigned, subscribed to its own frames, 10 s timeout.
    pub fn new(me: AgentUri) -> Self {
        ClientConfig {
            me,
            subscribe: Subscribe::Own,
            key: None,
            tls: None,
            limits: Limits::TCP,
            timeout: Duration::from_secs(10),
        }
    }
}

/// A client operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, or the TLS handshake, failed.
    #[error("cannot connect to {addr}")]
    Connect {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The server name is not valid for TLS.
    #[error("invalid TLS server name {0}")]
    ServerName(String),
    /// A frame could not be encoded.
    #[error("cannot encode frame")]
    Encode(#[source] FrameError),
    /// Writing failed.
    #[error("write failed")]
    Write(#[source] std::io::Error),
    /// Reading failed.
    #[error("read failed")]
    Read(#[source] ReadError),
    /// The bridge closed the connection.
    #[error("connection closed by the bridge")]
    Closed,
    /// The bridge answered with an error status.
    #[error("bridge answered {code} {reason}: {detail}", code = status.code(), reason = status.reason())]
    Refused {
        /// The status.
        status: Status,
        /// The bridge's explanation.
        detail: String,
    },
    /// The bridge answered something other than `handshake.ack` with `STATUS: 100`.
    #[error("unexpected answer to the handshake")]
    BadHandshake,
}

/// A connected client.
pub struct Client {
    rd: ReadHalf<BoxIo>,
    wr: WriteHalf<BoxIo>,
    reader: FrameReader,
    cfg: ClientConfig,
    bridge: Option<AgentUri>,
    inbox: VecDeque<RawFrame>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("cfg", &self.cfg)
            .field("bridge", &self.bridge)
            .finish()
    }
}

impl Client {
    /// Connects to `addr` (`host:port`) and completes the handshake.
    pub async fn connect(addr: &str, cfg: ClientConfig) -> Result<Client, ClientError> {
        let conn_err = |source| ClientError::Connect {
            addr: addr.to_string(),
            source,
        };
        let tcp = timeout(cfg.timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| conn_err(std::io::ErrorKind::TimedOut.into()))?
            .map_err(conn_err)?;
        let _ = tcp.set_nodelay(true);
        let io: BoxIo = match &cfg.tls {
            None => Box::new(tcp),
            Some((tls, name)) => {
                let server_name = rustls_pki_types::ServerName::try_from(name.clone())
                    .map_err(|_| ClientError::ServerName(name.clone()))?;
                let connector = tokio_rustls::TlsConnector::from(tls.clone());
                let s = timeout(cfg.timeout, connector.connect(server_name, tcp))
                    .await
                    .map_err(|_| conn_err(std::io::ErrorKind::TimedOut.into()))?
                    .map_err(conn_err)?;
                Box::new(s)
            }
        };
        let (rd, wr) = tokio::io::split(io);
        let mut client = Client {
            rd,
            wr,
            reader: FrameReader::new(cfg.limits),
            cfg,
            bridge: None,
            inbox: VecDeque::new(),
        };
        let hello = Frame::new(Transport::Tcp, MessageType::Handshake).json(&HandshakeBody {
            subscribe: client.cfg.subscribe,
        });
        client.send(hello).await?;
        let ack = client.read_one().await?;
        let f = &ack.decoded.frame;
        if f.status.is_some_and(|s| s != Status::Continue) {
            return Err(refusal(f));
        }
        if f.msg_type != Some(MessageType::HandshakeAck) || f.status != Some(Status::Continue) {
            return Err(ClientError::BadHandshake);
        }
        client.bridge = f.from.clone();
        Ok(client)
    }

    /// The bridge's address, from its `handshake.ack`.
    pub fn bridge(&self) -> Option<&AgentUri> {
        self.bridge.as_ref()
    }

    /// Sends a frame: `FROM` is set to this side's address, and the frame is signed when a
    /// key is configured.
    pub async fn send(&mut self, mut frame: Frame) -> Result<(), ClientError> {
        frame.from = Some(self.cfg.me.clone());
        let bytes = match &self.cfg.key {
            Some(key) => sign(&frame, key, unix_now(), &fresh_nonce()),
            None => frame.encode(),
        }
        .map_err(ClientError::Encode)?;
        self.send_raw(&bytes).await
    }

    /// Sends bytes as they are (for tests and tools).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        write_within(&mut self.wr, bytes, self.cfg.timeout)
            .await
            .map_err(ClientError::Write)
    }

    async fn read_one(&mut self) -> Result<RawFrame, ClientError> {
        let d = Deadlines {
            idle: self.cfg.timeout,
            frame: self.cfg.timeout,
        };
        self.reader
            .next(&mut self.rd, d)
            .await
            .map_err(ClientError::Read)?
            .ok_or(ClientError::Closed)
    }

    fn is_answer(&self, f: &Frame) -> bool {
        f.status.is_some() && f.from.is_some() && f.from == self.bridge
    }

    /// Sends a frame and waits for the bridge's answer to it. Error statuses become
    /// [`ClientError::Refused`].
    pub async fn request(&mut self, frame: Frame) -> Result<Frame, ClientError> {
        self.send(frame).await?;
        loop {
            let raw = self.read_one().await?;
            if self.is_answer(&raw.decoded.frame) {
                let f = raw.decoded.frame;
                return match f.status {
                    Some(Status::Ok | Status::Continue) => Ok(f),
                    _ => Err(refusal(&f)),
                };
            }
            self.inbox.push_back(raw);
        }
    }

    /// The next frame from the bridge (forwarded frames first, in order of arrival), or
    /// [`ClientError::Closed`].
    pub async fn recv(&mut self) -> Result<RawFrame, ClientError> {
        if let Some(f) = self.inbox.pop_front() {
            return Ok(f);
        }
        self.read_one().await
    }
}

fn refusal(f: &Frame) -> ClientError {
    let detail = f
        .body_as::<StatusBody>()
        .and_then(|b| b.detail)
        .unwrap_or_default();
    ClientError::Refused {
        status: f.status.unwrap_or(Status::InternalError),
        detail,
    }
}
