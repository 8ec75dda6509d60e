//! awcp-ctl: the AWCP control plane — the Delegator daemon, the Executor service, and the
//! typed client the CLI uses.
//!
//! This crate composes the others and holds no protocol or filesystem logic of its own:
//! wire types come from `awcp-protocol`, leases from `awcp-lease`, the transport from
//! `awcpfs`. The binary (`main.rs`) parses the command line into the config structs here.

pub mod aglx;
pub mod archive;
pub mod client;
pub mod daemon;
pub mod doctor;
pub mod executor;
mod jsonsum;
pub mod mcp;
pub mod metrics;
pub mod peer;
pub mod sse;
pub mod store;
pub mod watch;

/// Current time as the reference writes it: ISO 8601, milliseconds, `Z`.
pub fn now_iso() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Compare two secrets in time that does not depend on where they differ.
pub fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The bearer token of a request, if any.
pub fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// A fresh random token (256 bits, hex).
pub fn random_token() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}
