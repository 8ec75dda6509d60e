//! AWCP v1 wire types, the Delegation and Assignment state machines, and the data-plane API
//! types of the `awcpfs` transport.
//!
//! This crate is the bottom of the workspace: plain data and pure functions, no I/O. It
//! describes what goes over the wire between a Delegator and an Executor so that both of our
//! services and the reference implementation (`SII-Holos/awcp`, protocol version `"1"`)
//! understand each other:
//!
//! * [`messages`] — INVITE, ACCEPT, START, DONE, ERROR, CONTINUE, CLOSE ([`AwcpMessage`]) and
//!   [`parse_message`], which says precisely why a body was refused;
//! * [`transport`] — the transport handle START carries ([`TransportHandle`]), including ours,
//!   `awcpfs`;
//! * [`events`] — the SSE task events ([`TaskEvent`]) and [`parse_event`];
//! * [`error_code`] — [`ErrorCode`], open to codes a newer peer invents;
//! * [`state`] — the [`DelegationState`] and [`AssignmentState`] machines;
//! * [`api`] — the JSON bodies of the Delegator daemon's and the Executor's HTTP routes;
//! * [`ids`] — [`DelegationId`];
//! * [`dataplane`] — the `awcpfs` data-plane API;
//! * [`rawname`] — file names that are not UTF-8, held in a `String` and sent as base64.
//!
//! Wire conventions, all the reference's: JSON objects with camelCase keys; optional fields
//! are omitted rather than `null`; timestamps are ISO 8601 strings, kept as `String` (this
//! crate neither parses nor produces times); enumerations are lowercase strings except
//! message types and error codes, which are `SCREAMING_SNAKE_CASE`. Unknown fields are
//! ignored when parsing.

pub mod api;
pub mod dataplane;
mod decode;
pub mod error;
pub mod error_code;
pub mod events;
pub mod ids;
pub mod manifest_bin;
pub mod messages;
pub mod rawname;
mod redact;
pub mod state;
pub mod transport;

/// The AWCP protocol version this crate speaks: the `version` of every message.
pub const PROTOCOL_VERSION: &str = "1";

pub use error::{IdDefect, ProtocolError};
pub use error_code::ErrorCode;
pub use events::{TaskEvent, parse_event};
pub use ids::DelegationId;
pub use messages::{AwcpMessage, ProtocolVersion, parse_message};
pub use state::{
    AssignmentEvent, AssignmentState, DelegationEvent, DelegationState, IllegalTransition,
};
pub use transport::{TransportHandle, TransportType, parse_transport_handle};
