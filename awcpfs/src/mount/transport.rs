//! The running FUSE session, whichever adapter serves it: fuser's over `/dev/fuse`
//! (`fuse.rs`) or ours over io_uring (`uring.rs`). The mount's life (`session.rs`) sees
//! only this: send the kernel invalidations, wait for the end.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use super::uring::{DevNotifier, UringSession};

/// A running FUSE session.
#[derive(Debug)]
pub enum KernelSession {
    /// fuser's loop over `/dev/fuse`.
    Fuser(fuser::BackgroundSession),
    /// The io_uring adapter (which may serve over `/dev/fuse` when the rings were refused).
    Uring(UringSession),
}

impl KernelSession {
    /// A handle that sends the kernel cache invalidations.
    pub fn notifier(&self) -> Notifier {
        match self {
            KernelSession::Fuser(s) => Notifier::Fuser(s.notifier()),
            KernelSession::Uring(s) => Notifier::Dev(s.notifier()),
        }
    }

    /// Which transport the requests come over: `io_uring` or `/dev/fuse`.
    pub fn transport(&self) -> &'static str {
        match self {
            KernelSession::Uring(s) if s.uses_rings() => "io_uring",
            _ => "/dev/fuse",
        }
    }

    /// Wait for the session's threads to end (after unmount and abort).
    pub fn join(self) {
        match self {
            KernelSession::Fuser(s) => {
                if let Err(e) = s.join() {
                    tracing::debug!(error = %e, "the FUSE session ended with an error");
                }
            }
            KernelSession::Uring(s) => s.join(),
        }
    }
}

/// Sends the kernel cache invalidations. `ENOENT` (nothing cached) counts as done.
#[derive(Debug, Clone)]
pub enum Notifier {
    /// fuser's.
    Fuser(fuser::Notifier),
    /// The io_uring adapter's (on its `/dev/fuse` descriptor).
    Dev(DevNotifier),
}

fn absent_is_ok(r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

impl Notifier {
    /// Forget cached attributes and pages of `ino` in `[off, off + len)` (`len` -1: all).
    pub fn inval_inode(&self, ino: u64, off: i64, len: i64) -> std::io::Result<()> {
        absent_is_ok(match self {
            Notifier::Fuser(n) => n.inval_inode(fuser::INodeNo(ino), off, len),
            Notifier::Dev(n) => n.inval_inode(ino, off, len),
        })
    }

    /// Forget the name `name` in `parent`.
    pub fn inval_entry(&self, parent: u64, name: &OsStr) -> std::io::Result<()> {
        absent_is_ok(match self {
            Notifier::Fuser(n) => n.inval_entry(fuser::INodeNo(parent), name),
            Notifier::Dev(n) => n.inval_entry(parent, name.as_bytes()),
        })
    }

    /// `name` in `parent`, inode `child`, is gone.
    pub fn delete(&self, parent: u64, child: u64, name: &OsStr) -> std::io::Result<()> {
        absent_is_ok(match self {
            Notifier::Fuser(n) => n.delete(fuser::INodeNo(parent), fuser::INodeNo(child), name),
            Notifier::Dev(n) => n.delete(parent, child, name.as_bytes()),
        })
    }
}

/// Mount `fs` as `cfg` says, over the transport `cfg.kernel.transport` chooses.
pub fn start(
    fs: std::sync::Arc<super::fs::AwcpFs>,
    cfg: &super::MountConfig,
    allow_other: bool,
    read_only: bool,
    fuser_cfg: fuser::Config,
) -> Result<KernelSession, super::MountError> {
    use super::uring::{FuseTransport, UringOptions, uring_unavailable};
    let choice = cfg.kernel.transport;
    let uring = match choice {
        FuseTransport::Dev => false,
        FuseTransport::Uring => {
            if let Some(reason) = uring_unavailable() {
                return Err(super::MountError::UringUnavailable { reason });
            }
            true
        }
        FuseTransport::Auto => match uring_unavailable() {
            None => true,
            Some(why) => {
                tracing::info!("FUSE transport: /dev/fuse ({why})");
                false
            }
        },
    };
    if uring {
        let opts = UringOptions {
            fsname: format!("awcpfs:{}", cfg.export_id),
            read_only,
            allow_other,
            kernel: cfg.kernel,
            workers: cfg.fuse_threads.max(4),
            depth: super::uring::DEFAULT_DEPTH,
            required: choice == FuseTransport::Uring,
        };
        let s = UringSession::start(fs, &cfg.mountpoint, &opts).map_err(|source| {
            super::MountError::Uring {
                mountpoint: cfg.mountpoint.clone(),
                source,
            }
        })?;
        tracing::info!(
            "FUSE transport: {} (--fuse-transport {choice})",
            if s.uses_rings() {
                "io_uring"
            } else {
                "/dev/fuse"
            }
        );
        return Ok(KernelSession::Uring(s));
    }
    let session = fuser::Session::new(
        super::fuse::FuseAdapter::new(fs, cfg.kernel),
        &cfg.mountpoint,
        &fuser_cfg,
    )
    .and_then(|s| s.spawn())
    .map_err(|source| super::MountError::Fuse {
        mountpoint: cfg.mountpoint.clone(),
        source,
    })?;
    Ok(KernelSession::Fuser(session))
}
