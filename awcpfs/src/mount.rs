//! Executor side: the FUSE filesystem that projects an export onto a local directory.
//!
//! Layers, top to bottom:
//! * [`session`] — a mount's life: start, lease watching, fencing, final flush, unmount;
//! * [`access`] — who the kernel lets in (`allow_other` only behind a private path);
//! * [`transport`] — the running FUSE session, whichever adapter serves it:
//!   * `fuse` — the thin `fuser::Filesystem` adapter over `/dev/fuse` (no logic);
//!   * [`uring`] — the second adapter, over FUSE-over-io_uring (Linux 6.14+);
//! * [`fs`] and [`content`] — the operations as plain functions over the inode table;
//! * [`posix`] — extended attributes and `fallocate`;
//! * [`inode`], [`journal`], [`sync`] — the namespace, its durable log, and write-back;
//! * [`remote`] — the data-plane client behind a trait.

pub mod access;
pub mod aecp;
mod backing;
pub mod budget;
mod bypass;
pub mod cached;
pub mod changes;
pub mod content;
pub mod error;
pub mod fs;
mod fuse;
pub mod hydrate;
pub use bypass::{PassthroughWriters, TOOLCHAIN};
pub use fuse::KernelOptions;
pub mod inode;
pub mod journal;
pub mod pack;
pub mod posix;
mod prime;
pub mod recover;
pub mod remote;
pub mod session;
pub mod special;
pub mod stats;
pub mod sync;
pub mod transport;
pub mod upper;
pub mod uring;
pub use uring::FuseTransport;
pub mod upstream;

pub use access::MountAccess;
pub use error::{EndReason, FsError};
pub use session::{Mount, MountConfig, MountError, MountStatus};
