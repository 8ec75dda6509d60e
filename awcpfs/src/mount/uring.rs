//! The second FUSE adapter: awcpfs's requests served over FUSE-over-io_uring (Linux 6.14+)
//! instead of fuser's `/dev/fuse` read/write loop. Same core ([`AwcpFs`]), same answers
//! as `fuse.rs`; only the transport differs.
//!
//! * [`abi`] — the kernel's wire structs, written out (`repr(C)`, size-tested);
//! * `dispatch` — decode a request, call [`AwcpFs`], encode the reply (transport-free);
//! * `ring` — a ring per possible CPU (`IORING_SETUP_SQE128`, `FUSE_IO_URING_CMD_REGISTER`
//!   then `COMMIT_AND_FETCH`), the `/dev/fuse` reader (`FORGET`, `BATCH_FORGET`,
//!   `INTERRUPT`, and everything until the rings are ready), and a worker pool for requests
//!   that may block (fetches, `fsync`): the ring's thread never waits on the network.
//!
//! This adapter mounts itself (`mount(2)` with `fd=`), so it needs root; fuser's path
//! serves every other case. The kernel offers io_uring only when the `fuse` module's
//! `enable_uring` parameter is `Y` (`/sys/module/fuse/parameters/enable_uring`).

pub mod abi;
mod dispatch;
mod ring;

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use abi::Wire;

use super::KernelOptions;
use super::fs::AwcpFs;

/// The kernel parameter that lets FUSE servers use io_uring.
pub const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Which FUSE transport a mount serves its requests over (`--fuse-transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FuseTransport {
    /// io_uring where the kernel offers it (`enable_uring` is Y, and awcpfs runs as root),
    /// `/dev/fuse` otherwise; the log says which.
    #[default]
    Auto,
    /// FUSE over io_uring, or the mount fails saying why.
    Uring,
    /// The classic `/dev/fuse` read/write loop (fuser).
    Dev,
}

impl std::fmt::Display for FuseTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FuseTransport::Auto => "auto",
            FuseTransport::Uring => "uring",
            FuseTransport::Dev => "dev",
        })
    }
}

/// The environment variable naming another file to read `enable_uring` from (containers
/// that see the host's `/sys` elsewhere; tests of the fallback).
pub const ENABLE_URING_VAR: &str = "AWCPFS_ENABLE_URING_PARAM";

/// Where the `enable_uring` parameter is read.
fn enable_uring_path() -> PathBuf {
    std::env::var_os(ENABLE_URING_VAR)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(ENABLE_URING), PathBuf::from)
}

/// Whether the kernel offers FUSE over io_uring: `None` when this kernel has no such
/// parameter (built without `CONFIG_FUSE_IO_URING`, or older than 6.14).
pub fn kernel_enables_uring() -> Option<bool> {
    std::fs::read_to_string(enable_uring_path())
        .ok()
        .map(|s| s.trim() == "Y" || s.trim() == "1")
}

/// Why io_uring cannot be used here, or `None` when it can be tried.
pub fn uring_unavailable() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some(
            "awcpfs mounts over io_uring only as root (it mounts with mount(2) itself)".into(),
        );
    }
    let param = enable_uring_path();
    let param = param.display();
    match kernel_enables_uring() {
        None => Some(format!(
            "this kernel has no FUSE over io_uring ({param} is missing: Linux 6.14+ built with CONFIG_FUSE_IO_URING)"
        )),
        Some(false) => Some(format!(
            "the kernel does not offer FUSE over io_uring: {param} is N (as root: echo Y > {param})"
        )),
        Some(true) => None,
    }
}

/// How to mount.
#[derive(Debug, Clone)]
pub struct UringOptions {
    /// The source shown in mountinfo (`awcpfs:<export id>`).
    pub fsname: String,
    /// Mount read-only.
    pub read_only: bool,
    /// Mount with `allow_other`.
    pub allow_other: bool,
    /// What to ask of the kernel.
    pub kernel: KernelOptions,
    /// Threads answering requests that may block.
    pub workers: usize,
    /// Ring entries per CPU queue.
    pub depth: usize,
    /// Fail instead of serving over `/dev/fuse` when the rings cannot be set up.
    pub required: bool,
}

/// Ring entries per CPU queue: several, so a request on a CPU is taken while others of the
/// same CPU wait on workers.
pub const DEFAULT_DEPTH: usize = 8;

/// A mount served by this adapter.
#[derive(Debug)]
pub struct UringSession {
    dev: Arc<OwnedFd>,
    threads: Vec<JoinHandle<()>>,
    rings: usize,
}

/// What went wrong setting up the adapter.
#[derive(Debug, thiserror::Error)]
pub enum UringError {
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// Which.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel's first message was not a usable `INIT`.
    #[error("the kernel's FUSE INIT was not understood: {0}")]
    Init(String),
    /// io_uring was required and could not be used.
    #[error("FUSE over io_uring could not be set up: {0}")]
    Refused(String),
}

fn sys(what: &'static str) -> impl FnOnce(std::io::Error) -> UringError {
    move |source| UringError::Sys { what, source }
}

/// The CPUs the kernel may run a caller on: it wants a queue for each.
fn possible_cpus() -> usize {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    s.trim()
        .split(',')
        .filter_map(|part| part.rsplit('-').next()?.parse::<usize>().ok())
        .max()
        .map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            |m| m + 1,
        )
}

impl UringSession {
    /// Mount `fs` at `mountpoint` and serve it: over io_uring when the kernel agrees (or,
    /// unless `required`, over `/dev/fuse` by this same adapter when it does not).
    #[allow(unsafe_code)]
    pub fn start(
        fs: Arc<AwcpFs>,
        mountpoint: &Path,
        opts: &UringOptions,
    ) -> Result<UringSession, UringError> {
        // SAFETY: a plain open of a constant path; the descriptor is checked and owned.
        let raw = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(UringError::Sys {
                what: "open /dev/fuse",
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let dev = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let mut data = format!(
            "fd={},rootmode=40000,user_id={},group_id={},default_permissions",
            raw,
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw()
        );
        if opts.allow_other {
            data.push_str(",allow_other");
        }
        let mut flags = nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV;
        if opts.read_only {
            flags |= nix::mount::MsFlags::MS_RDONLY;
        }
        nix::mount::mount(
            Some(opts.fsname.as_str()),
            mountpoint,
            Some("fuse.awcpfs"),
            flags,
            Some(data.as_str()),
        )
        .map_err(|e| UringError::Sys {
            what: "mount(2)",
            source: e.into(),
        })?;
        let cleanup = scopeguard::guard(mountpoint.to_path_buf(), |mp| abort_mount(&mp));
        let adapter = Arc::new(dispatch::Adapter::new(fs, opts.kernel, dev.clone()));
        let negotiated = init(&adapter, &dev)?;
        let uring = negotiated.flags & abi::init::OVER_IO_URING != 0;
        let (jobs, mut threads) =
            ring::spawn_workers(&adapter, opts.workers).map_err(sys("starting FUSE workers"))?;
        let mut rings = 0;
        let mut refused = None;
        if !uring {
            refused = Some("the kernel did not accept FUSE_OVER_IO_URING in INIT".to_string());
        } else {
            let cpus = possible_cpus();
            // A payload holds the largest request and reply: max(8 KiB, max_write, max_pages).
            let payload = (negotiated.max_write as usize)
                .max(8192)
                .max(usize::from(negotiated.max_pages) * 4096);
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            for q in 0..cpus {
                let (adapter, dev, jobs, ready) =
                    (adapter.clone(), dev.clone(), jobs.clone(), ready_tx.clone());
                let depth = opts.depth.max(1);
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("awcpfs-ring{q}"))
                        .spawn(move || {
                            ring::ring_loop(&adapter, &dev, q, depth, payload, &jobs, &ready)
                        })
                        .map_err(sys("starting a FUSE ring"))?,
                );
            }
            drop(ready_tx);
            for _ in 0..cpus {
                match ready_rx.recv_timeout(Duration::from_secs(10)) {
                    Ok(Ok(())) => rings += 1,
                    Ok(Err(e)) => {
                        refused.get_or_insert(e);
                    }
                    Err(_) => {
                        refused.get_or_insert("a ring did not register within 10 s".into());
                    }
                }
            }
            if refused.is_none() {
                tracing::info!(
                    queues = cpus,
                    depth = opts.depth,
                    payload,
                    "FUSE requests are served over io_uring"
                );
            }
        }
        if let Some(why) = &refused {
            if opts.required {
                // The guard unmounts and aborts the connection; the rings end with it.
                return Err(UringError::Refused(why.clone()));
            }
            tracing::warn!("FUSE over io_uring not used ({why}); serving requests over /dev/fuse");
        }
        // The reader: FORGET and INTERRUPT always come here, and every request before the
        // kernel switches to the rings (or when it never does).
        {
            let (adapter, dev) = (adapter.clone(), dev.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("awcpfs-fuse-dev".into())
                    .spawn(move || ring::dev_loop(&adapter, &dev, &jobs))
                    .map_err(sys("starting the /dev/fuse reader"))?,
            );
        }
        scopeguard::ScopeGuard::into_inner(cleanup);
        Ok(UringSession {
            dev,
            threads,
            rings: if refused.is_none() { rings } else { 0 },
        })
    }

    /// Whether requests come over io_uring (else over `/dev/fuse`).
    pub fn uses_rings(&self) -> bool {
        self.rings > 0
    }

    /// A handle that sends the kernel cache invalidations.
    pub fn notifier(&self) -> DevNotifier {
        DevNotifier(self.dev.clone())
    }

    /// Wait for every thread to end (after unmount and abort of the connection).
    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// Read the kernel's `INIT`, answer it.
fn init(adapter: &dispatch::Adapter, dev: &OwnedFd) -> Result<dispatch::Negotiated, UringError> {
    let mut buf = vec![0u8; dispatch::MAX_WRITE as usize + 4096];
    let n = loop {
        match nix::unistd::read(dev, &mut buf) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                return Err(UringError::Sys {
                    what: "reading FUSE INIT",
                    source: e.into(),
                });
            }
        }
    };
    let h = abi::InHeader::read(&buf[..n]).ok_or_else(|| UringError::Init("short".into()))?;
    if h.opcode != abi::op::INIT {
        return Err(UringError::Init(format!("opcode {} first", h.opcode)));
    }
    let body = &buf[std::mem::size_of::<abi::InHeader>()..n];
    let init = abi::InitIn::read(body)
        .or_else(|| {
            // Kernels before 7.36 send the 16-byte form.
            let mut b = [0u8; 64];
            b[..body.len().min(64)].copy_from_slice(&body[..body.len().min(64)]);
            abi::InitIn::read(&b)
        })
        .ok_or_else(|| UringError::Init("short INIT".into()))?;
    if init.major != abi::KERNEL_VERSION {
        return Err(UringError::Init(format!(
            "protocol {}.{}",
            init.major, init.minor
        )));
    }
    let (out, negotiated) = adapter.init(&init, true);
    let hdr = abi::OutHeader {
        len: (std::mem::size_of::<abi::OutHeader>() + std::mem::size_of::<abi::InitOut>()) as u32,
        error: 0,
        unique: h.unique,
    };
    ring::writev(dev, &[hdr.bytes(), out.bytes()]).map_err(sys("answering FUSE INIT"))?;
    tracing::debug!(
        minor = init.minor,
        flags = format!("{:#x}", negotiated.flags),
        "FUSE INIT answered"
    );
    Ok(negotiated)
}

/// Detach a mount that failed to start and abort its connection.
fn abort_mount(mountpoint: &PathBuf) {
    if let Ok(m) = std::fs::metadata(mountpoint) {
        let abort = format!("/sys/fs/fuse/connections/{}/abort", libc::minor(m.dev()));
        let _ = std::fs::write(abort, b"1");
    }
    let _ = nix::mount::umount2(mountpoint, nix::mount::MntFlags::MNT_DETACH);
}

/// Sends the kernel cache invalidations on `/dev/fuse` (they never go over the rings).
#[derive(Debug, Clone)]
pub struct DevNotifier(Arc<OwnedFd>);

impl DevNotifier {
    fn send(&self, code: i32, parts: &[&[u8]]) -> std::io::Result<()> {
        let len =
            std::mem::size_of::<abi::OutHeader>() + parts.iter().map(|p| p.len()).sum::<usize>();
        let h = abi::OutHeader {
            len: len as u32,
            error: code,
            unique: 0,
        };
        let mut all = vec![h.bytes()];
        all.extend_from_slice(parts);
        ring::writev(&self.0, &all)
    }

    /// Forget cached attributes and pages of `ino` (`FUSE_NOTIFY_INVAL_INODE`).
    pub fn inval_inode(&self, ino: u64, off: i64, len: i64) -> std::io::Result<()> {
        let m = abi::NotifyInvalInode { ino, off, len };
        self.send(abi::NOTIFY_INVAL_INODE, &[m.bytes()])
    }

    /// Forget the name `name` in `parent` (`FUSE_NOTIFY_INVAL_ENTRY`).
    pub fn inval_entry(&self, parent: u64, name: &[u8]) -> std::io::Result<()> {
        let m = abi::NotifyInvalEntry {
            parent,
            namelen: name.len() as u32,
            flags: 0,
        };
        self.send(abi::NOTIFY_INVAL_ENTRY, &[m.bytes(), name, b"\0"])
    }

    /// `name` in `parent` (inode `child`) is gone (`FUSE_NOTIFY_DELETE`).
    pub fn delete(&self, parent: u64, child: u64, name: &[u8]) -> std::io::Result<()> {
        let m = abi::NotifyDelete {
            parent,
            child,
            namelen: name.len() as u32,
            padding: 0,
        };
        self.send(abi::NOTIFY_DELETE, &[m.bytes(), name, b"\0"])
    }
}
