//! AGLX: the agent protocol over TCP and UDP, and its bridge to AWCP lifecycle events.
//!
//! * [`frame`] and [`codec`]: the frame model and a strict decoder with limits;
//! * [`security`]: HMAC-SHA256 signatures over the exact frame bytes, replay window, nonce
//!   cache, keys per trust zone;
//! * [`uri`]: agent addresses `agent://name.domain`.
//!
//! The wire format is documented in `docs/PROTOCOL.md` (section AGLX).

pub mod codec;
pub mod error;
pub mod frame;
pub mod security;
pub mod uri;

pub use codec::{Decoded, Limits, decode_datagram, decode_stream};
pub use error::{AuthError, FrameError};
pub use frame::{Frame, MessageType, Status, Transport};
pub use uri::{AgentUri, Recipient};
