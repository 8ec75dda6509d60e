//! awcp-ctl: the AWCP control plane — the Delegator daemon, the Executor service, and the
//! typed client the CLI uses.
//!
//! This crate composes the others and holds no protocol or filesystem logic of its own:
//! wire types come from `awcp-protocol`, leases from `awcp-lease`, the transport from
//! `awcpfs`. The binary (`main.rs`) parses the command line into the config structs here.

pub mod archive;
pub mod client;
pub mod daemon;
pub mod executor;
pub mod sse;
pub mod store;
pub mod watch;

/// Current time as the reference writes it: ISO 8601, milliseconds, `Z`.
pub fn now_iso() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A fresh random token (256 bits, hex).
pub fn random_token() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}
