//! AGLX: the agent protocol over TCP and UDP, and its bridge to AWCP lifecycle events.
//!
//! * [`awcp`]: AWCP lifecycle events as AGLX messages, and their price in credits;
//! * [`frame`] and [`codec`]: the frame model and a strict decoder with limits;
//! * [`security`]: HMAC-SHA256 signatures over the exact frame bytes, replay window, nonce
//!   cache, keys per trust zone;
//! * [`uri`]: agent addresses `agent://name.domain`;
//! * [`bridge`]: the bridge (TCP/TLS server with handshake, UDP announces, registry,
//!   forwarding to subscribers) and [`client`]: a client for it;
//! * [`notify`]: what `awcp-ctl` uses — a best-effort `Notifier`, an `Announcer` and a
//!   `Discovery` listener;
//! * [`registry`]: announced agents with TTLs; [`tls`]: rustls configuration helpers.
//!
//! The wire format is documented in `docs/PROTOCOL.md` (section AGLX).

pub mod awcp;
pub mod bridge;
pub mod client;
pub mod codec;
pub mod error;
pub mod frame;
pub mod io;
pub mod notify;
pub mod registry;
pub mod security;
pub mod tls;
pub mod uri;

pub use bridge::{Bridge, BridgeConfig, Subscribe};
pub use client::{Client, ClientConfig, ClientError};
pub use codec::{Decoded, Limits, decode_datagram, decode_stream};
pub use error::{AuthError, FrameError};
pub use frame::{Frame, MessageType, Status, Transport};
pub use notify::{Announcer, Discovery, Endpoint, Notifier, NotifierConfig};
pub use uri::{AgentUri, Recipient};
