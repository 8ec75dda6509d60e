//! A mount's life: start, serve, watch the lease, fence, flush, unmount.
//!
//! [`Mount::start`] fetches the manifest, builds the inode table, mounts FUSE and starts
//! three threads: the syncer (write-back), the lease timer (expiry measured on this
//! machine's monotonic clock from the remaining time the export reports, so clock skew
//! cannot extend a lease), and the event reader (revocations and renewals pushed by the
//! export). Whichever learns first that access is over calls [`Mount::end`]:
//!
//! 1. fence — every operation now fails with `EACCES`, so nothing new can be written, and
//!    the kernel's cached pages of open files are dropped;
//! 2. unmount — lazy detach, then abort the FUSE connection through fusectl so processes
//!    that still hold files open get an error instead of hanging;
//! 3. final flush — what was written before the fence is committed, within the export's
//!    flush grace (it needs the inode table and the upper files, not the mount);
//! 4. wipe the upper files, unless the operator keeps the cache or the flush failed (then
//!    the state directory is kept, so nothing is lost).

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::{Condvar, Mutex};
use serde::Serialize;

use awcp_protocol::dataplane::{ExportEvent, LeaseState, ManifestEntry};

use super::error::EndReason;
use super::fs::{AwcpFs, FsOptions};
use super::fuse::KernelOptions;
use super::hydrate::{Batch, HydratePolicy};
use super::inode::InodeTable;
use super::journal::Journal;
use super::remote::{HttpRemote, Remote, RemoteError, StreamItem};
use super::stats::{Stats, StatsSnapshot};
use super::sync::{RoundReport, SyncError, SyncSignal, Syncer};
use super::upstream::{Inval, UpstreamReport};

/// Everything a mount needs.
#[derive(Debug, Clone)]
pub struct MountConfig {
    /// Export base URL, e.g. `http://127.0.0.1:3101`.
    pub endpoint: String,
    /// Export id.
    pub export_id: String,
    /// Capability token.
    pub token: String,
    /// Expected blake3 of the manifest bytes, checked when given.
    pub manifest_digest: Option<String>,
    /// Lease expiry (ISO 8601) from the transport handle, until the export says otherwise.
    pub expires_at: Option<String>,
    /// Lease left, measured on this machine's monotonic clock from when the handle arrived;
    /// preferred over `expires_at` (immune to clock skew between the machines).
    pub remaining: Option<Duration>,
    /// Where to mount (must exist, empty).
    pub mountpoint: PathBuf,
    /// Where upper files, the journal and `status.json` live.
    pub state_dir: PathBuf,
    /// Mount read-only even if the export would accept writes.
    pub read_only: bool,
    /// FUSE worker threads.
    pub fuse_threads: usize,
    /// Bound on every data-plane request.
    pub request_timeout: Duration,
    /// Wait this long after a change before syncing, to batch bursts.
    pub sync_debounce: Duration,
    /// Longest final flush when the mount ends normally.
    pub final_flush_timeout: Duration,
    /// Keep upper files after unmount.
    pub keep_cache: bool,
    /// The block cache shared with other mounts (`None`: every block comes from the export).
    pub block_cache: Option<Arc<crate::cache::BlockCache>>,
    /// Kernel caching and passthrough.
    pub kernel: KernelOptions,
    /// Whose new files the kernel writes directly, with passthrough
    /// ([`KernelOptions::passthrough_writes`]): compilers, assemblers and linkers by default.
    pub passthrough_writers: super::PassthroughWriters,
    /// What to fetch in the background before it is asked for (`mount/hydrate.rs`):
    /// nothing, the files first commands read, or those and every file up to a size, many
    /// per request. On-demand reads always go first. Also decides how a read of a large
    /// file is served: with `all`, the whole file is streamed in the background from its
    /// first read; otherwise each read fetches only the blocks it covers.
    pub hydrate: HydratePolicy,
    /// Renew the lease with the export when less than this is left (`None`: never; the
    /// Delegator then decides alone, with `awcp-ctl renew`).
    pub renew_margin: Option<Duration>,
    /// Who the kernel lets in ([`super::access`]): by default every process that can
    /// reach the mountpoint when a private directory above it keeps other users out (FUSE
    /// `allow_other`, the kernel checking mode bits with `default_permissions`), else only
    /// the mounting user and `owner`.
    pub access: super::MountAccess,
    /// Who owns every file and directory of the mount (uid, gid); default the mounting
    /// process's effective ids.
    pub owner: Option<(u32, u32)>,
    /// Where the worker's AECP delivery socket is bound (default
    /// `<state_dir>/`[`super::aecp::SOCKET_NAME`]); it is made `owner`'s, so that an agent
    /// running as that user can connect.
    pub aecp_socket: Option<PathBuf>,
    /// The secret a request line on the AECP socket must carry (`"token"`), handed to the
    /// agent alone (`$AECP_TOKEN`): agents of one user can reach each other's sockets, and
    /// a request acts as this mount's worker. `None`: requests need none.
    pub aecp_token: Option<String>,
}

impl MountConfig {
    /// A config with the defaults for everything but the essentials.
    pub fn new(
        endpoint: &str,
        export_id: &str,
        token: &str,
        mountpoint: &Path,
        state_dir: &Path,
    ) -> Self {
        MountConfig {
            endpoint: endpoint.into(),
            export_id: export_id.into(),
            token: token.into(),
            manifest_digest: None,
            expires_at: None,
            remaining: None,
            mountpoint: mountpoint.into(),
            state_dir: state_dir.into(),
            read_only: false,
            fuse_threads: 2,
            request_timeout: Duration::from_secs(30),
            // Batches a build's bursts of closes into fewer rounds, well within the 100 ms
            // close-to-visible target.
            sync_debounce: Duration::from_millis(50),
            final_flush_timeout: Duration::from_secs(30),
            keep_cache: false,
            block_cache: None,
            kernel: KernelOptions::default(),
            passthrough_writers: super::PassthroughWriters::default(),
            hydrate: HydratePolicy::default_for(endpoint),
            renew_margin: None,
            access: super::MountAccess::default(),
            owner: None,
            aecp_socket: None,
            aecp_token: None,
        }
    }
}

/// Why a mount could not start.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// The manifest could not be fetched.
    #[error("fetching the manifest from {endpoint} failed")]
    Manifest {
        /// Export URL.
        endpoint: String,
        /// Why.
        #[source]
        source: RemoteError,
    },
    /// Its digest is not the one in the transport handle.
    #[error(
        "the manifest's digest {got} does not match the transport handle's {want}: the export's \
         tree changed since the handle was issued (an export restarted, or a handle of another \
         export); use the handle the export gives now (`awcpfs export` prints it at every start)"
    )]
    DigestMismatch {
        /// Expected.
        want: String,
        /// Received.
        got: String,
    },
    /// The manifest is inconsistent.
    #[error("the manifest is malformed")]
    BadManifest {
        /// Why.
        #[source]
        source: super::inode::ManifestError,
    },
    /// The state directory could not be prepared.
    #[error("preparing the state directory {path} failed")]
    StateDir {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The state directory holds the journal of an earlier mount that did not end cleanly.
    #[error(
        "the state directory {path} holds changes of an earlier mount that were not written back; \
         run `awcpfs recover` with that mount's handle and state directory, or choose another one"
    )]
    StateDirInUse {
        /// Where.
        path: PathBuf,
    },
    /// A live mount, or `awcpfs recover`, is using the state directory.
    #[error(
        "another process (a live `awcpfs mount`, or `awcpfs recover`) is using the state \
         directory {path}: end it first, or choose another state directory"
    )]
    StateDirLocked {
        /// Where.
        path: PathBuf,
    },
    /// The kernel refused the mount.
    #[error("mounting FUSE at {mountpoint} failed (is /dev/fuse there and are you root?)")]
    Fuse {
        /// Where.
        mountpoint: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `--fuse-transport uring` where the kernel does not offer it.
    #[error(
        "--fuse-transport uring: {reason} (or use --fuse-transport auto to fall back to /dev/fuse)"
    )]
    UringUnavailable {
        /// Why not.
        reason: String,
    },
    /// Serving over io_uring failed.
    #[error(
        "serving FUSE over io_uring at {mountpoint} failed (--fuse-transport auto or dev serves over /dev/fuse)"
    )]
    Uring {
        /// Where.
        mountpoint: PathBuf,
        /// Why.
        #[source]
        source: super::uring::UringError,
    },
}

/// What `status.json` holds.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MountStatus {
    /// `mounted`, `fenced` or `ended`.
    pub state: String,
    /// Why it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Mount point.
    pub mountpoint: PathBuf,
    /// Export id.
    pub export_id: String,
    /// Remaining lease, in milliseconds, as this machine measures it.
    pub lease_remaining_ms: u64,
    /// Files open right now.
    pub open_handles: usize,
    /// Changes are not written back: write-back is failing now (the last sync round failed
    /// and is being retried), or the final flush could not deliver them (they are kept in
    /// the state directory).
    pub unsynced: bool,
    /// Why, when `unsynced`: the last write-back error.
    #[serde(default)]
    pub sync_error: Option<String>,
    /// Counters.
    pub stats: StatsSnapshot,
    /// Background hydration: its policy, plan and progress.
    #[serde(default)]
    pub hydration: super::hydrate::ProgressSnapshot,
    /// Whether the kernel's writeback cache is on (asked for and granted): written data
    /// reaches the mount at `close`, `fsync` or within about a second.
    #[serde(default)]
    pub writeback_cache: bool,
    /// The transport FUSE requests come over: `io_uring` or `/dev/fuse`
    /// (`--fuse-transport`).
    #[serde(default)]
    pub fuse_transport: String,
}

/// Callbacks run once the mount has ended.
type EndHook = Box<dyn FnOnce(EndReason) + Send>;

struct Inner {
    cfg: MountConfig,
    fs: Arc<AwcpFs>,
    syncer: Arc<Syncer>,
    signal: Arc<SyncSignal>,
    remote: Arc<dyn Remote>,
    session: Mutex<Option<super::transport::KernelSession>>,
    /// What `session` serves over: `io_uring` or `/dev/fuse`.
    transport: &'static str,
    conn_id: Option<u64>,
    deadline: Mutex<Instant>,
    ending: AtomicBool,
    ended: Mutex<Option<EndReason>>,
    ended_cv: Condvar,
    unsynced: AtomicBool,
    hooks: Mutex<Vec<EndHook>>,
    /// Who the kernel lets in, as decided at start.
    access: super::access::Decision,
    /// The state directory's lock ([`super::recover::lock_state_dir`]), given up once the
    /// mount has ended.
    lock: Mutex<Option<nix::fcntl::Flock<std::fs::File>>>,
}

/// A running mount. Cheap to clone; all clones control the same mount.
#[derive(Clone)]
pub struct Mount {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Mount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mount")
            .field("mountpoint", &self.inner.cfg.mountpoint)
            .finish_non_exhaustive()
    }
}

/// Remaining time until an ISO 8601 instant, measured against this machine's wall clock
/// once, at start; afterwards only the monotonic clock is used.
fn remaining_until(iso: &str) -> Option<Duration> {
    let t = chrono::DateTime::parse_from_rfc3339(iso).ok()?;
    let t: SystemTime = t.with_timezone(&chrono::Utc).into();
    Some(
        t.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// `fsync` the directory `dir`: the names in it reach the disk.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Write `bytes` to `path` whole, and fsync it: recovery after a machine crash needs it.
/// Written beside and renamed into place, so a crash mid-write leaves no torn file for
/// recovery to choke on (the directory is synced once the mount's files are all there).
fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Whether `mountpoint` is mounted now with the FUSE connection `conn` (read from
/// mountinfo, which does not ask the filesystem).
fn still_mounted(mountpoint: &Path, conn: u64) -> bool {
    // Not canonicalize: that would ask the (fenced) filesystem.
    let Ok(mp) = std::path::absolute(mountpoint) else {
        return false;
    };
    let mp = mp.as_os_str().as_bytes();
    let want = format!("{}:{}", conn >> 20, conn & 0xfffff);
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            let mut f = l.split(' ');
            let dev = f.nth(2);
            let point = f.nth(1);
            dev == Some(want.as_str()) && point.is_some_and(|p| unescape_mountinfo(p) == mp)
        })
}

/// A path as mountinfo writes it, with its space, tab, newline and backslash escaped as
/// `\ooo` octal.
fn unescape_mountinfo(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    out
}

/// Make sure fusectl is mounted so connections can be aborted.
fn ensure_fusectl() {
    let dir = Path::new("/sys/fs/fuse/connections");
    let empty = std::fs::read_dir(dir)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false);
    if empty {
        let r = nix::mount::mount(
            Some("fusectl"),
            dir,
            Some("fusectl"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        );
        if let Err(e) = r {
            tracing::debug!(error = %e, "cannot mount fusectl; stuck mounts cannot be aborted");
        }
    }
}

impl Mount {
    /// Who the kernel lets into this mount, and the directory that keeps others out
    /// (decided at start from [`MountConfig::access`]).
    pub fn access(&self) -> &super::access::Decision {
        &self.inner.access
    }

    /// Mount the export described by `cfg` over HTTP.
    pub fn start(cfg: MountConfig) -> Result<Mount, MountError> {
        let remote = Arc::new(HttpRemote::new(
            &cfg.endpoint,
            &cfg.export_id,
            &cfg.token,
            cfg.request_timeout,
        ));
        Self::start_with_remote(cfg, remote)
    }

    /// Mount with a given remote (tests inject in-memory or faulty ones).
    pub fn start_with_remote(
        cfg: MountConfig,
        remote: Arc<dyn Remote>,
    ) -> Result<Mount, MountError> {
        let state_err = |source| MountError::StateDir {
            path: cfg.state_dir.clone(),
            source,
        };
        let upper_dir = cfg.state_dir.join("upper");
        let journal_path = cfg.state_dir.join("journal.log");
        // Private: upper files are workspace content, the journal names every change.
        crate::private::create_dir_all(&cfg.state_dir).map_err(state_err)?;
        // Held for the mount's life: two mounts of one state directory would write one
        // journal and one set of upper files.
        let lock = super::recover::lock_state_dir(&cfg.state_dir).map_err(|e| {
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                MountError::StateDirLocked {
                    path: cfg.state_dir.clone(),
                }
            } else {
                state_err(e)
            }
        })?;
        if std::fs::metadata(&journal_path).is_ok_and(|m| m.len() > 0) {
            return Err(MountError::StateDirInUse {
                path: cfg.state_dir.clone(),
            });
        }
        crate::private::create_dir_all(&upper_dir).map_err(state_err)?;
        // Phase times, logged once mounted: where a slow start goes.
        let t0 = Instant::now();
        let manifest_err = |source| MountError::Manifest {
            endpoint: cfg.endpoint.clone(),
            source,
        };
        // Kept as served: the state directory saves these bytes for recovery.
        let compressed = remote.manifest_bytes().map_err(manifest_err)?;
        let (manifest, digest) =
            super::remote::decode_manifest(&compressed).map_err(manifest_err)?;
        if let Some(want) = &cfg.manifest_digest
            && *want != digest
        {
            return Err(MountError::DigestMismatch {
                want: want.clone(),
                got: digest,
            });
        }
        let (uid, gid) = cfg.owner.unwrap_or((
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        ));
        let t_manifest = t0.elapsed();
        // Three things that need only the manifest, on two CPUs: the inode table here; the
        // syncer's starting point and the saved manifest beside it.
        let manifest_path = cfg.state_dir.join(super::recover::MANIFEST_FILE);
        let (table, base, saved, t_inodes, t_side) = std::thread::scope(|s| {
            let side = s.spawn(|| {
                // What recovery needs to rebuild this mount's tree: the manifest it started
                // from (the export's may be rebuilt meanwhile) and the log of what reached
                // the Delegator.
                let saved = write_durably(&manifest_path, &compressed);
                (Syncer::base_of(&manifest), saved, t0.elapsed())
            });
            let table = InodeTable::from_manifest(&manifest, uid, gid);
            let t_inodes = t0.elapsed();
            let (base, saved, t_side) = side
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (table, base, saved, t_inodes, t_side)
        });
        let table = table.map_err(|source| {
            // Saved beside the table's build: nothing will recover from it.
            let _ = std::fs::remove_file(&manifest_path);
            MountError::BadManifest { source }
        })?;
        saved.map_err(state_err)?;
        drop(compressed);
        let t_table = t0.elapsed();
        let journal = Journal::open(&journal_path).map_err(state_err)?;
        let synced_path = cfg.state_dir.join(super::recover::SYNCED_FILE);
        let _ = std::fs::remove_file(&synced_path);
        let synced_log = super::sync::SyncedLog::open(&synced_path).map_err(state_err)?;
        // The state files named durably: a power loss must not keep the journal's records
        // and lose the manifest they replay over (or the state directory itself).
        sync_dir(&cfg.state_dir)
            .and_then(|()| cfg.state_dir.parent().map_or(Ok(()), sync_dir))
            .map_err(state_err)?;
        let read_only = cfg.read_only || manifest.read_only;
        let signal = Arc::new(SyncSignal::default());
        let stats = Arc::new(Stats::default());
        let remote: Arc<dyn Remote> = match &cfg.block_cache {
            Some(cache) => Arc::new(super::cached::CachedRemote::new(
                remote,
                cache.clone(),
                stats.clone(),
            )),
            None => remote,
        };
        let fs = Arc::new(AwcpFs::new(
            table,
            remote.clone(),
            journal,
            FsOptions {
                read_only,
                uid,
                gid,
                upper_dir,
                block_size: manifest.block_size,
            },
            signal.clone(),
            stats,
        ));
        fs.set_passthrough_writers(cfg.passthrough_writers.clone());
        let syncer = Arc::new(Syncer::with_base(fs.clone(), base, &[], Some(synced_log)));
        // git's index is made ready for the fsmonitor before the kernel sees it
        // (`mount/prime.rs`); operations on it wait until then. Not on a mount that
        // fetches only what is read.
        if let Some(ino) = (cfg.hydrate != HydratePolicy::None)
            .then(|| fs.arm_index_prime(&cfg.mountpoint))
            .flatten()
        {
            let fs = fs.clone();
            std::thread::Builder::new()
                .name("awcpfs-gitindex".into())
                .spawn(move || fs.prime_index(ino))
                .expect("spawning a thread");
        }

        let mut options = vec![
            fuser::MountOption::FSName(format!("awcpfs:{}", cfg.export_id)),
            fuser::MountOption::Subtype("awcpfs".into()),
            fuser::MountOption::DefaultPermissions,
            fuser::MountOption::NoDev,
            fuser::MountOption::NoSuid,
        ];
        if read_only {
            options.push(fuser::MountOption::RO);
        }
        let mut fcfg = fuser::Config::default();
        fcfg.mount_options = options;
        // Without allow_other the kernel (and fuser) let only the mounting uid in: the
        // workspace is not every local user's to read. With it, a private directory above
        // the mountpoint (or the user's explicit --access all) keeps others out.
        let users = [nix::unistd::geteuid().as_raw(), uid];
        let access = super::access::decide(cfg.access, &cfg.mountpoint, &users);
        tracing::info!(
            mountpoint = %cfg.mountpoint.display(),
            "mount access: {}",
            access.describe(cfg.access)
        );
        fcfg.acl = if access.allow_other {
            fuser::SessionACL::All
        } else {
            fuser::SessionACL::Owner
        };
        fcfg.n_threads = Some(cfg.fuse_threads.max(1));
        fcfg.clone_fd = cfg.fuse_threads > 1;
        // A mount is ready only when its findings are: the AECP catch-up is in the replica
        // before the kernel can send the first lookup.
        preload_aecp(&remote, &fs, AECP_PRELOAD_WAIT);
        let t_state = t0.elapsed();
        ensure_fusectl();
        let session =
            super::transport::start(fs.clone(), &cfg, access.allow_other, read_only, fcfg)?;
        let dev = std::fs::metadata(&cfg.mountpoint).ok().map(|m| m.dev());
        let conn_id =
            dev.map(|dev| (u64::from(libc::major(dev)) << 20) | u64::from(libc::minor(dev)));
        if let Some(dev) = dev {
            raise_read_ahead(dev);
        }
        let remaining = cfg
            .remaining
            .or_else(|| cfg.expires_at.as_deref().and_then(remaining_until))
            .unwrap_or(Duration::from_secs(365 * 24 * 3600));
        let inner = Arc::new(Inner {
            cfg,
            fs,
            syncer,
            signal,
            remote,
            transport: session.transport(),
            session: Mutex::new(Some(session)),
            conn_id,
            deadline: Mutex::new(Instant::now() + remaining),
            ending: AtomicBool::new(false),
            ended: Mutex::new(None),
            ended_cv: Condvar::new(),
            unsynced: AtomicBool::new(false),
            hooks: Mutex::new(Vec::new()),
            access,
            lock: Mutex::new(Some(lock)),
        });
        let mount = Mount { inner };
        mount.spawn_threads();
        let entries = manifest.entries.len();
        // Hundreds of thousands of allocations to free: not on the way to a usable mount.
        let dropped = std::thread::Builder::new()
            .name("awcpfs-free".into())
            .spawn(move || drop(manifest));
        if let Err(e) = dropped {
            tracing::debug!(error = %e, "freeing the manifest on this thread");
        }
        let ms = |d: Duration| d.as_millis() as u64;
        tracing::info!(mountpoint = %mount.inner.cfg.mountpoint.display(),
            entries,
            manifest_ms = ms(t_manifest),
            table_ms = ms(t_table - t_manifest),
            inodes_ms = ms(t_inodes.saturating_sub(t_manifest)),
            side_ms = ms(t_side.saturating_sub(t_manifest)),
            state_ms = ms(t_state - t_table),
            fuse_ms = ms(t0.elapsed() - t_state),
            "awcpfs mounted");
        Ok(mount)
    }

    fn spawn_threads(&self) {
        // After each round: show what it learned of the Delegator's state (a weak
        // reference: the syncer belongs to the mount).
        let weak = Arc::downgrade(&self.inner);
        self.inner.syncer.set_after_round(Box::new(move || {
            if let Some(inner) = weak.upgrade() {
                Mount { inner }.apply_settled();
            }
        }));
        let syncer = self.inner.syncer.clone();
        let signal = self.inner.signal.clone();
        let debounce = self.inner.cfg.sync_debounce;
        std::thread::Builder::new()
            .name("awcpfs-sync".into())
            .spawn(move || syncer.run(signal, debounce))
            .expect("spawning a thread");
        let m = self.clone();
        std::thread::Builder::new()
            .name("awcpfs-lease".into())
            .spawn(move || m.lease_timer())
            .expect("spawning a thread");
        if let Some(conn) = self.inner.conn_id {
            let m = self.clone();
            std::thread::Builder::new()
                .name("awcpfs-unmount".into())
                .spawn(move || m.unmount_watch(conn))
                .expect("spawning a thread");
        }
        let m = self.clone();
        std::thread::Builder::new()
            .name("awcpfs-events".into())
            .spawn(move || m.event_reader())
            .expect("spawning a thread");
        if let Some(margin) = self.inner.cfg.renew_margin {
            let m = self.clone();
            std::thread::Builder::new()
                .name("awcpfs-renew".into())
                .spawn(move || m.renewer(margin))
                .expect("spawning a thread");
        }
        let policy = self.inner.cfg.hydrate;
        self.inner.fs.set_hydrate_policy(policy);
        self.inner
            .fs
            .set_export_local(super::hydrate::is_loopback_endpoint(
                &self.inner.cfg.endpoint,
            ));
        if policy == HydratePolicy::None {
            // An empty plan, reported as finished.
            self.inner.fs.hydration_plan(policy);
        } else {
            let m = self.clone();
            std::thread::Builder::new()
                .name("awcpfs-hydrate".into())
                .spawn(move || {
                    // The plan is made here, not before the mount is up: listing the tree
                    // takes the inode table's lock, which the agent's first requests need.
                    let batches = Arc::new(Mutex::new(m.inner.fs.hydration_plan(policy)));
                    let left = Arc::new(std::sync::atomic::AtomicUsize::new(HYDRATE_WORKERS));
                    for _ in 1..HYDRATE_WORKERS {
                        let (m, batches, left) = (m.clone(), batches.clone(), left.clone());
                        std::thread::Builder::new()
                            .name("awcpfs-hydrate".into())
                            .spawn(move || m.hydrate_worker(&batches, &left))
                            .expect("spawning a thread");
                    }
                    m.hydrate_worker(&batches, &left);
                })
                .expect("spawning a thread");
        }
        let m = self.clone();
        std::thread::Builder::new()
            .name("awcpfs-aecp".into())
            .spawn(move || {
                let socket = m
                    .inner
                    .cfg
                    .aecp_socket
                    .clone()
                    .unwrap_or_else(|| m.inner.cfg.state_dir.join(super::aecp::SOCKET_NAME));
                let owner = m.inner.cfg.owner;
                let token = m.inner.cfg.aecp_token.clone();
                let invalidate = || {
                    if let Some(s) = m.inner.session.lock().as_ref() {
                        super::aecp::invalidate(&m.inner.fs, &s.notifier(), None);
                    }
                };
                let ended = || m.wait(super::aecp::REPORT_EVERY).is_some();
                super::aecp::report(
                    &m.inner.fs,
                    &m.inner.remote,
                    &socket,
                    owner,
                    token,
                    invalidate,
                    ended,
                );
            })
            .expect("spawning a thread");
        if self.inner.cfg.kernel.writeback_cache {
            let m = self.clone();
            std::thread::Builder::new()
                .name("awcpfs-wbflush".into())
                .spawn(move || m.kernel_writeback())
                .expect("spawning a thread");
        }
        let m = self.clone();
        std::thread::Builder::new()
            .name("awcpfs-status".into())
            .spawn(move || {
                while m.wait(Duration::from_millis(500)).is_none() {
                    m.write_status();
                }
                m.write_status();
            })
            .expect("spawning a thread");
    }

    /// Background hydration, one of [`HYDRATE_WORKERS`]: takes the plan's requests in
    /// order until none is left, so one worker's request is answered while another's files
    /// are written; each request waits its turn behind the agent's fetches. A batch the
    /// export refuses (a file changed on the Delegator) is skipped; any other failure stops
    /// this worker (on-demand fetches still work then). The last worker to stop marks the
    /// plan finished.
    fn hydrate_worker(
        &self,
        batches: &Mutex<std::collections::VecDeque<Batch>>,
        left: &std::sync::atomic::AtomicUsize,
    ) {
        self.hydrate_batches(batches);
        if left.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.inner.fs.hydration_finished();
        }
    }

    fn hydrate_batches(&self, batches: &Mutex<std::collections::VecDeque<Batch>>) {
        let started = Instant::now();
        let mut done = 0usize;
        loop {
            let Some(batch) = batches.lock().pop_front() else {
                break;
            };
            if self.inner.ending.load(Ordering::SeqCst) {
                return;
            }
            match self.inner.fs.hydrate(&batch) {
                Ok(()) => done += 1,
                // A file of the batch changed on the Delegator (its block is gone): skip the
                // batch; those files fail or conflict when opened, the others are fetched
                // on demand.
                Err(crate::mount::FsError::Remote {
                    source: RemoteError::BadBlock { .. } | RemoteError::Refused { .. },
                }) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "background hydration stopped");
                    return;
                }
            }
        }
        tracing::debug!(requests = done, elapsed = ?started.elapsed(), "hydration requests done by this worker");
    }

    /// Renew the lease whenever less than `margin` is left. Its own thread, so a slow or
    /// unreachable export never delays the lease timer: a partitioned Executor still fences
    /// itself at the deadline it knows.
    fn renewer(&self, margin: Duration) {
        while !self.inner.ending.load(Ordering::SeqCst) {
            let remaining = self
                .inner
                .deadline
                .lock()
                .saturating_duration_since(Instant::now());
            if remaining > margin {
                std::thread::sleep((remaining - margin).min(Duration::from_millis(200)));
                continue;
            }
            match self.inner.remote.renew() {
                Ok(ExportEvent::Lease {
                    state: LeaseState::Active,
                    remaining_ms,
                    ..
                }) => {
                    let granted = Duration::from_millis(remaining_ms);
                    *self.inner.deadline.lock() = Instant::now() + granted;
                    self.inner.fs.stats.add_renewal();
                    if granted <= remaining + Duration::from_millis(100) {
                        // The renewal gained nothing: the Delegator's lifetime limit is
                        // reached. The lease ends at its deadline.
                        tracing::info!(?granted, "the lease cannot be renewed further");
                        return;
                    }
                    if granted <= margin {
                        // A margin at or above the lease's TTL: renewing as soon as allowed
                        // would spin; pace it.
                        std::thread::sleep(Duration::from_millis(500));
                    }
                }
                Ok(_) => return,
                Err(e) if e.is_fatal() => return,
                Err(e) => {
                    tracing::debug!(error = %e, "lease renewal failed; retrying");
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
        }
    }

    /// Under the writeback cache, every [`KERNEL_WRITEBACK_EVERY`] until the mount ends:
    /// have the kernel write back what it holds dirty, so a write to a file that stays open
    /// reaches the mount (and the syncer, which writes it back) within about that long.
    /// The root is opened for each round, so no descriptor of this process keeps the mount
    /// busy.
    fn kernel_writeback(&self) {
        while self.wait(KERNEL_WRITEBACK_EVERY).is_none() {
            if !self.inner.fs.writeback_cache()
                || self.inner.ending.load(Ordering::SeqCst)
                || self.inner.fs.fenced().is_some()
            {
                continue;
            }
            let mountpoint = &self.inner.cfg.mountpoint;
            let Ok(root) = std::fs::File::open(mountpoint) else {
                continue;
            };
            // Unmounted meanwhile, the path is the directory below (on its parent's
            // device): never sync that. `fstat` is answered from the kernel's attributes,
            // where `fstatfs` would be a request to this mount every second.
            let parent_dev = mountpoint
                .parent()
                .and_then(|p| std::fs::metadata(p).ok())
                .map(|m| m.dev());
            if root
                .metadata()
                .map_or(true, |m| Some(m.dev()) == parent_dev)
            {
                continue;
            }
            if let Err(e) = nix::unistd::syncfs(&root) {
                tracing::debug!(error = %e, "periodic write-back of the kernel's dirty pages failed");
            }
        }
    }

    fn lease_timer(&self) {
        loop {
            if self.inner.ending.load(Ordering::SeqCst) {
                return;
            }
            let deadline = *self.inner.deadline.lock();
            if Instant::now() >= deadline {
                tracing::warn!("lease expired without renewal: ending access");
                self.end(EndReason::Expired, Some(Duration::from_secs(5)));
                return;
            }
            let step = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(100));
            std::thread::sleep(step);
        }
    }

    /// End the mount, writing its changes back, once its mount point is unmounted from
    /// outside (`umount`, `fusermount3 -u`): the kernel then sends no more requests, and the
    /// process would otherwise hold the lease and its state directory with nothing to serve.
    /// Woken by the kernel at every change of the mount table (`POLLPRI` on mountinfo), and
    /// once a second to see whether the mount ended otherwise.
    fn unmount_watch(&self, conn: u64) {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let mp = self.inner.cfg.mountpoint.clone();
        if !still_mounted(&mp, conn) {
            // Not found as mounted at the start (a path mountinfo shows otherwise): nothing
            // to compare with later.
            tracing::debug!(mountpoint = %mp.display(), "not in mountinfo: no unmount watch");
            return;
        }
        let info = std::fs::File::open("/proc/self/mountinfo").ok();
        while !self.inner.ending.load(Ordering::SeqCst) {
            match &info {
                Some(f) => {
                    let mut fds = [PollFd::new(f.as_fd(), PollFlags::POLLPRI)];
                    let _ = poll(&mut fds, PollTimeout::from(1000u16));
                }
                None => std::thread::sleep(Duration::from_secs(1)),
            }
            if self.inner.ending.load(Ordering::SeqCst) {
                return;
            }
            if !still_mounted(&mp, conn) {
                tracing::warn!(mountpoint = %mp.display(),
                    "the mount point was unmounted from outside: writing the changes back \
                     and ending access");
                self.finish();
                return;
            }
        }
    }

    fn event_reader(&self) {
        let mut backoff = Duration::from_millis(200);
        // Where a reconnect resumes: the last change sequence whose events all arrived. The
        // events of one catch-up share a sequence and may be cut mid-way, so a sequence
        // counts as complete only once a higher one arrives; resuming from the one before
        // gets the latest batch again, which is harmless.
        let mut latest = 0u64;
        let mut resume = 0u64;
        while !self.inner.ending.load(Ordering::SeqCst) {
            match self.inner.remote.events_since(resume) {
                Ok(items) => {
                    backoff = Duration::from_millis(200);
                    for item in items {
                        if self.inner.ending.load(Ordering::SeqCst) {
                            return;
                        }
                        let (state, remaining_ms, flush_grace_ms) = match item {
                            StreamItem::Event(ExportEvent::Lease {
                                state,
                                remaining_ms,
                                flush_grace_ms,
                                ..
                            }) => (state, remaining_ms, flush_grace_ms),
                            StreamItem::Event(ExportEvent::Changed {
                                seq,
                                entries,
                                removed,
                            }) => {
                                if seq > latest {
                                    resume = latest;
                                    latest = seq;
                                }
                                self.apply_upstream(seq, &entries, &removed);
                                continue;
                            }
                            StreamItem::Event(ExportEvent::Aecp { event }) => {
                                self.apply_aecp(event);
                                continue;
                            }
                            StreamItem::Event(ExportEvent::AecpReady) => {
                                // The catch-up before it is applied (and noted): git's
                                // fsmonitor may answer an earlier mount's tokens.
                                self.inner.fs.changes().mark_caught_up();
                                continue;
                            }
                            StreamItem::KeepAlive => continue,
                        };
                        match state {
                            LeaseState::Active => {
                                *self.inner.deadline.lock() =
                                    Instant::now() + Duration::from_millis(remaining_ms);
                            }
                            LeaseState::Revoked | LeaseState::Expired => {
                                let reason = if state == LeaseState::Revoked {
                                    EndReason::Revoked
                                } else {
                                    EndReason::Expired
                                };
                                tracing::warn!(%reason, "the Delegator ended the lease");
                                self.end(reason, Some(Duration::from_millis(flush_grace_ms)));
                                return;
                            }
                        }
                    }
                }
                Err(e) if e.is_fatal() => {
                    tracing::warn!(error = %e, "the export refuses us: ending access");
                    let reason = match &e {
                        RemoteError::LeaseEnded { code, .. } if code == "EXPIRED" => {
                            EndReason::Expired
                        }
                        _ => EndReason::Revoked,
                    };
                    self.end(reason, Some(Duration::from_secs(2)));
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "lease event stream unavailable; retrying"),
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// The mount point.
    pub fn mountpoint(&self) -> &Path {
        &self.inner.cfg.mountpoint
    }

    /// The filesystem (for tests and status).
    pub fn fs(&self) -> &Arc<AwcpFs> {
        &self.inner.fs
    }

    /// Counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.inner.fs.stats.snapshot()
    }

    /// The transport FUSE requests come over: `io_uring` or `/dev/fuse`.
    pub fn fuse_transport(&self) -> &'static str {
        self.inner.transport
    }

    /// The status, as written to `status.json`.
    pub fn status(&self) -> MountStatus {
        let ended = self.inner.ended.lock().clone();
        let fenced = self.inner.fs.fenced();
        let state = match (&ended, &fenced) {
            (Some(_), _) => "ended",
            (None, Some(_)) => "fenced",
            _ => "mounted",
        };
        let remaining = if ended.is_some() || fenced.is_some() {
            Duration::ZERO
        } else {
            self.inner
                .deadline
                .lock()
                .saturating_duration_since(Instant::now())
        };
        let stats = self.stats();
        let kept = self.inner.unsynced.load(Ordering::Relaxed);
        let unsynced = kept || (ended.is_none() && self.inner.fs.stats.sync_failing());
        let sync_error = unsynced.then(|| {
            let last = stats.last_sync_error.clone();
            if kept {
                format!(
                    "changes could not be written back; they are kept in {} ({})",
                    self.inner.cfg.state_dir.display(),
                    last.as_deref().unwrap_or("the final flush ran out of time")
                )
            } else {
                last.unwrap_or_else(|| "write-back is failing".into())
            }
        });
        MountStatus {
            state: state.into(),
            reason: ended.or(fenced).map(|r| r.to_string()),
            mountpoint: self.inner.cfg.mountpoint.clone(),
            export_id: self.inner.cfg.export_id.clone(),
            lease_remaining_ms: u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX),
            open_handles: self.inner.fs.open_handle_count(),
            unsynced,
            sync_error,
            stats,
            hydration: self.inner.fs.hydration().snapshot(),
            writeback_cache: self.inner.fs.writeback_cache(),
            fuse_transport: self.inner.transport.into(),
        }
    }

    fn write_status(&self) {
        let path = self.inner.cfg.state_dir.join("status.json");
        let tmp = self.inner.cfg.state_dir.join(".status.json.tmp");
        if let Ok(bytes) = serde_json::to_vec_pretty(&self.status())
            && std::fs::write(&tmp, bytes).is_ok()
        {
            let _ = std::fs::rename(&tmp, &path);
        }
    }

    /// Extend the local deadline (after the Delegator renewed the lease).
    pub fn set_remaining(&self, remaining: Duration) {
        *self.inner.deadline.lock() = Instant::now() + remaining;
    }

    /// Commit everything written so far, open files included; returns the round's report.
    pub fn flush(&self) -> Result<RoundReport, SyncError> {
        self.inner.syncer.round(true)
    }

    /// Run `f` once the mount has ended (immediately if it already has).
    pub fn on_end(&self, f: impl FnOnce(EndReason) + Send + 'static) {
        let ended = self.inner.ended.lock().clone();
        match ended {
            Some(r) => f(r),
            None => self.inner.hooks.lock().push(Box::new(f)),
        }
    }

    /// Wait up to `timeout` for the mount to end.
    pub fn wait(&self, timeout: Duration) -> Option<EndReason> {
        let mut ended = self.inner.ended.lock();
        if ended.is_none() {
            self.inner.ended_cv.wait_for(&mut ended, timeout);
        }
        ended.clone()
    }

    /// Why the mount ended, if it has.
    pub fn ended(&self) -> Option<EndReason> {
        self.inner.ended.lock().clone()
    }

    /// Whether the final flush left changes behind (kept in the state directory).
    pub fn unsynced(&self) -> bool {
        self.inner.unsynced.load(Ordering::Relaxed)
    }

    /// End the task normally: fence, flush everything, unmount.
    pub fn finish(&self) {
        let budget = self.inner.cfg.final_flush_timeout;
        self.end(EndReason::Unmounted, Some(budget));
    }

    /// End access for `reason`: fence, flush within `flush_budget` (none: no flush),
    /// unmount even with files open, clean up. Idempotent; blocks until done.
    pub fn end(&self, reason: EndReason, flush_budget: Option<Duration>) {
        if self.inner.ending.swap(true, Ordering::SeqCst) {
            // Someone else is ending it: wait for them.
            while self.wait(Duration::from_secs(1)).is_none() {}
            return;
        }
        // With the writeback cache, writes made before this moment may still be dirty pages
        // in the kernel: have it write them to us (accepted although fenced) within the
        // flush budget, so the final flush carries them to the Delegator. The mount's root
        // is opened before the fence, which refuses the open.
        let root = match flush_budget {
            Some(_) if self.inner.fs.writeback_cache() => self.open_root(),
            _ => None,
        };
        if root.is_some() {
            self.inner.fs.set_draining(true);
        }
        self.inner.fs.fence(reason.clone());
        let started = Instant::now();
        if let (Some(root), Some(budget)) = (root, flush_budget) {
            self.drain_kernel(root, budget);
            self.inner.fs.set_draining(false);
        }
        // The write-back above spent part of the budget.
        let flush_budget = flush_budget.map(|b| b.saturating_sub(started.elapsed()));
        self.drop_kernel_caches();
        self.inner.signal.stop();
        // Unmount first: the final flush reads the inode table and the upper files, not the
        // mount, so access ends at once however long the flush takes.
        self.unmount();
        let flushed = match flush_budget {
            Some(budget) => self.final_flush(budget),
            None => false,
        };
        self.inner.unsynced.store(!flushed, Ordering::Relaxed);
        if !flushed {
            tracing::error!(state_dir = %self.inner.cfg.state_dir.display(),
                "changes could not be written back; they are kept in the state directory");
        } else {
            if reason == EndReason::Unmounted {
                self.note_clean_end();
            }
            // Everything is written back: the journal has served its purpose.
            super::recover::remove_logs(&self.inner.cfg.state_dir);
            if !self.inner.cfg.keep_cache {
                let _ = std::fs::remove_dir_all(self.inner.cfg.state_dir.join("upper"));
            }
        }
        // This mount writes nothing more there: a recovery (of changes not written back)
        // or the next mount may take the state directory.
        self.inner.lock.lock().take();
        *self.inner.ended.lock() = Some(reason.clone());
        self.write_status();
        self.inner.ended_cv.notify_all();
        let hooks = std::mem::take(&mut *self.inner.hooks.lock());
        for h in hooks {
            h(reason.clone());
        }
        tracing::info!(%reason, "awcpfs unmounted");
    }

    /// Everything is written back: unless a change of ours was ever refused (a conflict, a
    /// hidden path), tell the export, so that a later mount of it can answer git's
    /// fsmonitor tokens handed out here (see `mount/changes.rs`).
    fn note_clean_end(&self) {
        if self.inner.fs.stats.had_conflicts() {
            tracing::info!(
                "a write-back conflicted: a later mount's git status looks at every file"
            );
            return;
        }
        let instance = self.inner.fs.changes().instance();
        match self.inner.remote.mount_ended(instance) {
            Ok(true) => tracing::debug!(instance, "clean end recorded by the export"),
            Ok(false) => tracing::debug!(instance, "the export records no clean end"),
            Err(e) => tracing::debug!(error = %e, "cannot record a clean end at the export"),
        }
    }

    /// Commit until nothing is left or the budget runs out; true if everything is written.
    /// Commit until nothing is left or the budget runs out; true if everything is written.
    /// The budget bounds the retries, not a round: a round that committed when the budget
    /// ran out is followed by one more, which finds nothing left unless the tree changed
    /// under it. (Syncing the state disk before a commit can take most of a budget on a
    /// disk busy with other writes; giving up right after a successful round would leave
    /// nothing unsynced yet report the changes as kept.)
    fn final_flush(&self, budget: Duration) -> bool {
        let deadline = Instant::now() + budget;
        let mut last_ok = false;
        loop {
            if last_ok && Instant::now() >= deadline {
                tracing::info!(
                    "the final flush's budget ran out after a round that committed: one more round"
                );
            }
            match self.inner.syncer.round(true) {
                Ok(r) if r.changes == 0 => {
                    // A file the Delegator's commit screen holds is not written back: it
                    // stays in the state directory like any unsynced change.
                    let held = self.inner.syncer.held_paths();
                    if !held.is_empty() {
                        tracing::error!(
                            ?held,
                            "write-backs held by the Delegator's commit screen are kept in the state directory"
                        );
                    }
                    return held.is_empty();
                }
                Ok(_) if last_ok && Instant::now() >= deadline => {
                    tracing::warn!(
                        "the final flush's budget ran out with changes still to write back"
                    );
                    return false;
                }
                Ok(_) => last_ok = true,
                Err(e) => {
                    self.inner.fs.stats.add_sync_error(e.to_string());
                    if e.is_fatal() || Instant::now() >= deadline {
                        tracing::warn!(error = %e, "final flush failed");
                        return false;
                    }
                    last_ok = false;
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            if !last_ok && Instant::now() >= deadline {
                return false;
            }
        }
    }

    /// Show the Delegator's own changes (a `changed` event) where the mount has nothing of
    /// its own, and make the kernel forget what it cached about them.
    /// An AECP index event: update the replica, and make the kernel ask again about the
    /// path it binds (and forget the `.aecp/` contents it read).
    fn apply_aecp(&self, event: serde_json::Value) {
        let path = self.inner.fs.aecp().apply(event);
        self.release_held(self.inner.fs.aecp().take_released());
        if let Some(s) = self.inner.session.lock().as_ref() {
            super::aecp::invalidate(&self.inner.fs, &s.notifier(), path.as_deref());
        }
    }

    /// The export released held write-backs: send them again soon.
    fn release_held(&self, paths: Vec<String>) {
        if !paths.is_empty() {
            self.inner.syncer.release(&paths);
            self.inner.signal.request();
        }
    }

    fn apply_upstream(&self, seq: u64, entries: &[ManifestEntry], removed: &[String]) {
        self.show_upstream(!entries.is_empty(), |s| {
            // Every path the export names, applied here or not: what a later mount's
            // fsmonitor needs to answer this one's tokens, and an earlier one's here.
            self.inner.fs.changes().note_paths(
                entries
                    .iter()
                    .map(|e| e.path.as_str())
                    .chain(removed.iter().map(String::as_str)),
            );
            let (invals, report) = s.apply_upstream(seq, entries, removed);
            tracing::info!(
                seq,
                applied = report.applied,
                kept_local = report.kept_local,
                stale = report.stale,
                "Delegator-side changes"
            );
            (invals, report)
        });
    }

    /// After a round: the Delegator's state that commit answers described where it won
    /// over a change of the mount's, and events refused earlier that may apply now.
    fn apply_settled(&self) {
        self.show_upstream(true, |s| {
            let (invals, report) = s.apply_settled();
            if report != UpstreamReport::default() {
                tracing::info!(
                    applied = report.applied,
                    kept_local = report.kept_local,
                    stale = report.stale,
                    "Delegator-side changes settled after a write-back"
                );
            }
            (invals, report)
        });
    }

    /// Apply Delegator-side changes with `apply` (`entries`: it may change files) and make
    /// the kernel forget what it cached about them.
    fn show_upstream(
        &self,
        entries: bool,
        apply: impl FnOnce(&Syncer) -> (Vec<Inval>, UpstreamReport),
    ) {
        if self.inner.fs.fenced().is_some() {
            return;
        }
        // Until the kernel has been told to forget what it cached: git's fsmonitor tokens
        // stay before these changes (see `mount/changes.rs`).
        let _change = self.inner.fs.changes().begin();
        if self.inner.fs.writeback_cache()
            && entries
            && let Some(root) = self.open_root()
        {
            // Pages the kernel holds dirty are writes the mount has not seen: have them
            // written first, so a file they touch counts as changed here (kept, and met as a
            // conflict) instead of being replaced under them.
            self.sync_kernel(root, UPSTREAM_SYNC_BOUND);
        }
        let (invals, report) = apply(&self.inner.syncer);
        self.inner
            .fs
            .stats
            .add_upstream(report.applied as u64, report.kept_local as u64);
        let notifier = match self.inner.session.lock().as_ref() {
            Some(s) => s.notifier(),
            None => return,
        };
        // A directory whose names changed: the kernel keeps its listing (no-opendir caches
        // it) until its pages are dropped; `inval_entry` alone leaves a new name out of
        // `ls` and `git status`, and a removed one in.
        let dirs: std::collections::BTreeSet<u64> = invals
            .iter()
            .filter_map(|i| match i {
                Inval::Entry(parent, _) | Inval::Delete(parent, _, _) => Some(*parent),
                _ => None,
            })
            .collect();
        let invals = invals.into_iter().chain(dirs.into_iter().map(Inval::Inode));
        for inval in invals {
            // ENOENT: the kernel had nothing cached for it.
            let r = match &inval {
                Inval::Inode(ino) => notifier.inval_inode(*ino, 0, -1),
                Inval::Entry(parent, name) => {
                    notifier.inval_entry(*parent, std::ffi::OsStr::new(name))
                }
                Inval::Delete(parent, child, name) => {
                    notifier.delete(*parent, *child, std::ffi::OsStr::new(name))
                }
                Inval::Content(parent, ino, name) => {
                    let r = notifier.inval_inode(*ino, 0, -1);
                    if self.inner.fs.writeback_cache() {
                        // The kernel keeps a cached file's size and times over ours under
                        // the writeback cache, even after `inval_inode`: drop the name and
                        // the inode's link count, so the inode is forgotten once unused and
                        // the next lookup builds it afresh from the new attributes.
                        notifier.delete(*parent, *ino, std::ffi::OsStr::new(name))
                    } else {
                        r
                    }
                }
            };
            if let Err(e) = r
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::debug!(error = %e, ?inval, "kernel invalidation failed");
            }
        }
    }

    /// The mount's root directory, opened (for `syncfs`).
    fn open_root(&self) -> Option<std::fs::File> {
        match std::fs::File::open(&self.inner.cfg.mountpoint) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(error = %e, "cannot open the mount's root to write back the kernel's dirty pages");
                None
            }
        }
    }

    /// [`Self::sync_kernel`] at the end of the mount (fenced: the kernel's write-back
    /// requests are the only ones served), and then until they are all served.
    fn drain_kernel(&self, root: std::fs::File, budget: Duration) -> bool {
        let started = Instant::now();
        let conn = fuse_connection_dir(&root);
        if !self.sync_kernel(root, budget) {
            return false;
        }
        self.await_kernel_requests(conn.as_deref(), started + budget)
    }

    /// `syncfs` returns once the kernel has *sent* the write-back requests; awcpfs may not
    /// have served them yet (seen in one run of ~15 under load: the final flush then took
    /// the file without the pages). Waits until the kernel counts no request of this
    /// mount as waiting for an answer (`/sys/fs/fuse/connections/<dev>/waiting`; while the
    /// mount is fenced every other request is answered at once) — or, where that file is
    /// not there, until no request has come for [`KERNEL_QUIET`] — or until `deadline`.
    fn await_kernel_requests(&self, conn: Option<&Path>, deadline: Instant) -> bool {
        let stats = &self.inner.fs.stats;
        let mut last = (stats.ops_total(), Instant::now());
        loop {
            let waiting = conn
                .and_then(|c| std::fs::read_to_string(c.join("waiting")).ok())
                .and_then(|w| w.trim().parse::<u64>().ok());
            let now = Instant::now();
            let ops = stats.ops_total();
            if ops != last.0 {
                last = (ops, now);
            }
            match waiting {
                Some(0) => return true,
                None if now.duration_since(last.1) >= KERNEL_QUIET => return true,
                // Something else is waiting (a read stuck on the network): the write-back
                // requests are served once the requests stop coming.
                Some(_) if now.duration_since(last.1) >= KERNEL_QUIET * 4 => return true,
                _ => {}
            }
            if now >= deadline {
                tracing::warn!(
                    ?waiting,
                    "the kernel's write-back requests were not all served in time"
                );
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Have the kernel write every dirty page of this mount to the filesystem (`syncfs` on
    /// `root`), waiting at most `budget`; true if it finished in time. Runs on a thread of
    /// its own: the FUSE threads serve the writes it causes, and a stuck connection cannot
    /// hold the caller past the budget (aborting the connection later ends the call).
    fn sync_kernel(&self, root: std::fs::File, budget: Duration) -> bool {
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("awcpfs-syncfs".into())
            .spawn(move || {
                let _ = tx.send(nix::unistd::syncfs(&root));
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the kernel's write-back");
            return false;
        }
        let started = Instant::now();
        match rx.recv_timeout(budget) {
            Ok(Ok(())) => {
                tracing::debug!(elapsed = ?started.elapsed(), "the kernel wrote its dirty pages back");
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the kernel's write-back of dirty pages failed");
                false
            }
            Err(_) => {
                tracing::warn!(
                    ?budget,
                    "the kernel did not write its dirty pages back in time"
                );
                false
            }
        }
    }

    /// Make the kernel forget cached attributes and pages of every open file, so reads on
    /// files opened before the fence come to the (fenced) filesystem and fail, instead of
    /// being served from the page cache. (New opens reach the filesystem anyway.)
    fn drop_kernel_caches(&self) {
        let notifier = match self.inner.session.lock().as_ref() {
            Some(s) => s.notifier(),
            None => return,
        };
        let inos = self.inner.fs.cached_inodes();
        for ino in inos {
            // ENOENT just means the kernel never cached that inode.
            let _ = notifier.inval_inode(ino, 0, -1);
        }
    }

    fn unmount(&self) {
        let mp = &self.inner.cfg.mountpoint;
        // Abort first, and only while our mount is verifiably still there: once it is gone
        // its connection number can be reused by an unrelated FUSE mount.
        if let Some(id) = self.inner.conn_id
            && still_mounted(mp, id)
        {
            // Aborting the connection fails every pending and future request on it, so a
            // process holding a file open gets an error, and the session thread exits.
            let abort = format!("/sys/fs/fuse/connections/{id}/abort");
            if let Err(e) = std::fs::write(&abort, b"1") {
                tracing::debug!(error = %e, path = %abort, "cannot abort the FUSE connection");
            }
        }
        if let Err(e) = nix::mount::umount2(mp, nix::mount::MntFlags::MNT_DETACH) {
            tracing::debug!(error = %e, "lazy unmount failed (already unmounted?)");
        }
        if let Some(session) = self.inner.session.lock().take() {
            // Join off-thread so a stuck kernel connection cannot hang the caller.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                session.join();
                let _ = tx.send(());
            });
            if rx.recv_timeout(Duration::from_secs(5)).is_err() {
                tracing::warn!("the FUSE session did not stop within 5 s");
            }
        }
    }
}

/// Under the writeback cache, how often the mount has the kernel write back its dirty pages
/// (`syncfs`): the bound on how long a write to a file that stays open (a log, a file a
/// process writes without closing) is the kernel's alone, instead of its 30 s
/// `dirty_expire`. `close` and `fsync` write back at once either way.
pub const KERNEL_WRITEBACK_EVERY: Duration = Duration::from_secs(1);

/// How long a batch of Delegator-side changes waits for the kernel to write back its dirty
/// pages (writeback cache) before it is applied.
const UPSTREAM_SYNC_BOUND: Duration = Duration::from_secs(5);

/// How long no FUSE request may come before the kernel's write-back counts as served, where
/// the kernel's count of waiting requests cannot be read.
const KERNEL_QUIET: Duration = Duration::from_millis(50);

/// The kernel's control directory of the FUSE connection `root` is on
/// (`/sys/fs/fuse/connections/<minor device number>`, where `fusectl` is mounted).
fn fuse_connection_dir(root: &std::fs::File) -> Option<PathBuf> {
    let dev = root.metadata().ok()?.dev();
    let dir = Path::new("/sys/fs/fuse/connections").join(libc::minor(dev).to_string());
    dir.join("waiting").exists().then_some(dir)
}

/// Background hydration workers: two requests in flight, so the export reads the next batch
/// while this side writes the last one.
const HYDRATE_WORKERS: usize = 2;

/// The kernel's read-ahead for this mount, in KiB (its default for FUSE is 128).
const READ_AHEAD_KB: u32 = 1024;

/// Let the kernel read ahead further on this mount: a sequential read then keeps more
/// requests in flight (a large file streams from the Delegator while it is read). Needs
/// root; without it the default stays, which only costs speed.
fn raise_read_ahead(dev: u64) {
    let path = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    if let Err(e) = std::fs::write(&path, READ_AHEAD_KB.to_string()) {
        tracing::debug!(error = %e, path, "cannot raise the mount's read-ahead");
    }
}

/// How long a mount waits for its AECP catch-up before it answers anyway (the event stream
/// keeps applying what arrives later).
pub const AECP_PRELOAD_WAIT: Duration = Duration::from_secs(10);

/// Reads the export's AECP catch-up into the replica before the mount answers: one event
/// stream connection (`since` past every change: only the lease, the `aecp` events and
/// `aecpReady`), read on a helper thread up to `aecpReady`, its end, or `wait`. The
/// long-lived event reader connects afterwards and gets the same events again, which the
/// replica applies idempotently.
fn preload_aecp(remote: &Arc<dyn Remote>, fs: &Arc<AwcpFs>, wait: Duration) {
    let (done_tx, done_rx) = std::sync::mpsc::channel::<usize>();
    let remote = remote.clone();
    let fs = fs.clone();
    let spawned = std::thread::Builder::new()
        .name("awcpfs-aecp-preload".into())
        .spawn(move || {
            let mut applied = 0;
            if let Ok(items) = remote.events_since(u64::MAX) {
                for item in items {
                    match item {
                        StreamItem::Event(ExportEvent::Aecp { event }) => {
                            fs.aecp().apply(event);
                            applied += 1;
                        }
                        StreamItem::Event(ExportEvent::AecpReady) => break,
                        StreamItem::Event(ExportEvent::Lease { state, .. })
                            if state != LeaseState::Active =>
                        {
                            break;
                        }
                        _ => {}
                    }
                }
            }
            let _ = done_tx.send(applied);
        });
    if spawned.is_err() {
        return;
    }
    match done_rx.recv_timeout(wait) {
        Ok(n) => tracing::debug!(events = n, "AECP catch-up read before mounting"),
        Err(_) => tracing::warn!(
            "AECP: the export's catch-up did not complete within {wait:?}; mounting anyway"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::unescape_mountinfo;

    #[test]
    fn mountinfo_paths_are_read_back_with_their_escapes_undone() {
        assert_eq!(unescape_mountinfo("/tmp/a b"), b"/tmp/a b");
        assert_eq!(unescape_mountinfo(r"/tmp/m\040x"), b"/tmp/m x");
        assert_eq!(unescape_mountinfo(r"/t\011a\012b\134c"), b"/t\ta\nb\\c");
        // Not an escape: left as it is, and no panic at the end of the field.
        assert_eq!(unescape_mountinfo(r"/a\9x\04"), br"/a\9x\04");
        assert_eq!(unescape_mountinfo(r"\"), br"\");
    }
}
