//! The end-to-end tests: real daemons and Executors on loopback, real FUSE mounts, real tools.
//!
//! One test binary for all of them (each file here is a module): one link instead of one per
//! file keeps a cold build small and quick. nextest still runs every test in its own process;
//! pick a file's tests with `cargo nextest run -E 'test(/^hostile_user::/)'`.

mod adapters;
mod admission;
mod aecp;
mod aecp_contracts;
mod aecp_flow;
mod aecp_identity;
mod aecp_resources;
mod aecp_restart;
mod aecp_staged;
mod aecp_streams;
mod aglx;
mod auth;
mod bad_input;
mod block_cache;
mod block_tier;
mod collect;
mod confinement;
mod conflicts_and_events;
mod conformance;
mod core_loop;
mod exerciser;
mod fleet_cli;
mod git_fsmonitor;
mod hostile_user;
mod interop;
mod kernel_caching;
mod live_view;
mod load;
mod metrics;
mod peer_uid;
mod raw_names;
mod readme;
mod redelegate;
mod renewal;
mod resources;
mod restart;
mod rounds;
mod semantics;
mod skill;
mod sshfs;
mod staged;
mod store_faults;
mod toolchains;
mod transports;
mod upstream;
