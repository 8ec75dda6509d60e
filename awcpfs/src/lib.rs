//! awcpfs: the transport that projects a delegated workspace onto an Executor.
//!
//! Two halves: [`export`] serves a directory on the Delegator (manifest, blocks, commits),
//! and [`mount`] is the FUSE filesystem on the Executor that consumes it.

pub mod cache;
pub mod export;
pub mod mount;
