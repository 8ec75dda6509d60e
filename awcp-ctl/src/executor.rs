//! The Executor service: accepts AWCP v1 invitations, mounts `awcpfs`, runs the agent.
//!
//! Routes under `/awcp` (the reference's delegator assumes that suffix): `POST /` for
//! messages, `GET /tasks/:id/events` (SSE, with `id:` lines and a replay buffer so a
//! dropped stream resumes with `Last-Event-ID`), `GET /tasks/:id/result`,
//! `POST /tasks/:id/ack`, `POST /cancel/:id`, `GET /status`.
//!
//! A task: mount the workspace at `<work-dir>/<delegationId>/`, report `running`, run the
//! agent command there (`sh -c`, its own process group), then flush, report `done` or
//! `error`, and unmount. If the lease ends first (revoke, expiry, AWCP cancel), the mount
//! fences itself, the agent's process group is killed, and the task ends in `error`.

mod aecp;
mod archive_task;
mod fsmonitor;
pub use fsmonitor::fsmonitor_hook;
mod mounts;
mod routes;
mod task;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::broadcast;

use awcp_protocol::api::TaskResultResponse;
use awcp_protocol::messages::{AccessMode, InviteMessage};
use awcp_protocol::{AssignmentState, TaskEvent, TransportType};

/// How the Executor runs.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    /// Listen address (default `127.0.0.1:7200`).
    pub listen: SocketAddr,
    /// Where workspaces are mounted (`<work_dir>/<delegationId>`).
    pub work_dir: PathBuf,
    /// Where mount state (journals, upper files) lives.
    pub state_dir: PathBuf,
    /// The agent command, run with `sh -c` in the mounted workspace.
    pub agent_cmd: String,
    /// Longest lease accepted.
    pub max_ttl: Duration,
    /// Most tasks at once.
    pub max_concurrent: usize,
    /// Keep upper files after unmount.
    pub keep_cache: bool,
    /// Serve read-only opens with FUSE passthrough (faster; a revocation cannot stop reads
    /// on files opened before it).
    pub passthrough: bool,
    /// Each mount's hydration policy (`None`: the mount's default for where the export
    /// is, see [`awcpfs::mount::hydrate::HydratePolicy::default_for`]).
    pub hydrate: Option<awcpfs::mount::hydrate::HydratePolicy>,
    /// Ask the mount at every open and close of an existing file (see
    /// [`awcpfs::mount::KernelOptions::no_open`]).
    pub track_opens: bool,
    /// Let the kernel cache writes (off by default; see
    /// [`awcpfs::mount::KernelOptions::writeback_cache`]).
    pub writeback_cache: bool,
    /// Give agents on a mount git's filesystem monitor (`awcp-ctl fsmonitor`, through
    /// their environment): `git status` costs O(changes). On by default.
    pub git_fsmonitor: bool,
    /// The hook command git runs for it (`None`: this binary, `awcp-ctl fsmonitor`).
    pub fsmonitor_hook: Option<String>,
    /// Renew each lease with the Delegator's export when less than this is left (`None`:
    /// leases end when the Delegator's TTL runs out unless it renews them).
    pub renew_margin: Option<Duration>,
    /// A mount's read timeout: a read that needs the network fails with `EIO` after it;
    /// also the bound on each data-plane request.
    pub read_timeout: Duration,
    /// How long a mount waits after a change before writing back (batching bursts).
    pub sync_debounce: Duration,
    /// The block cache shared by all mounts (`None`: no cache, content never outlives a
    /// lease on this machine).
    pub block_cache: Option<awcpfs::cache::CacheConfig>,
    /// Transports this Executor accepts (INVITE's `requirements.transport` is checked
    /// against it; `DEP_MISSING` otherwise).
    pub transports: Vec<TransportType>,
    /// Access modes accepted (`DECLINED` otherwise).
    pub access_modes: Vec<AccessMode>,
    /// What an `archive` workspace may unpack to (checked on the real bytes).
    pub archive_limits: crate::archive::ScanLimits,
    /// Largest HTTP body accepted (an `archive` START carries the whole workspace).
    pub max_body_bytes: usize,
    /// When set, INVITE must carry it as `auth.credential` (else `AUTH_FAILED`), and every
    /// other request to `/awcp` as `Authorization: Bearer <token>` (else 401).
    pub token: Option<String>,
    /// Who the kernel lets into the mounts (`executor --mount-access`, see
    /// [`awcpfs::mount::access`]): by default every process that reaches a mount through
    /// the 0700 work directory (the Executor's user, the agent user, and processes of the
    /// agent that change user inside), served by the files' modes.
    pub mount_access: awcpfs::mount::MountAccess,
    /// Run the agent as this (non-root) user; the mounts' files are then its own.
    pub agent_user: Option<AgentUser>,
}

/// The user the agent runs as (`executor --agent-user`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentUser {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Home directory (the agent's `HOME`).
    pub home: PathBuf,
}

impl AgentUser {
    /// Look `name` (or a numeric uid) up in the user database; refuses root, which is
    /// what the option exists to avoid.
    pub fn lookup(name: &str) -> anyhow::Result<AgentUser> {
        use nix::unistd::{Uid, User};
        let user = match name.parse::<u32>() {
            Ok(uid) => User::from_uid(Uid::from_raw(uid))?,
            Err(_) => User::from_name(name)?,
        }
        .ok_or_else(|| {
            anyhow::anyhow!(
                "no user {name:?} on this machine: create it (`useradd --create-home \
                 {name}`) or name an existing one"
            )
        })?;
        anyhow::ensure!(
            !user.uid.is_root(),
            "--agent-user must not be root: it exists to run the agent without root's rights"
        );
        Ok(AgentUser {
            name: user.name,
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
            home: user.dir,
        })
    }
}

impl AgentUser {
    /// The first directory on the way to `path` (its ancestors, then itself) that this
    /// user may not search, judged by owner, group and mode bits; `None` if it can get
    /// there.
    pub fn blocked_at(&self, path: &std::path::Path) -> Option<PathBuf> {
        use std::os::unix::fs::MetadataExt as _;
        let mut dirs: Vec<&std::path::Path> = path.ancestors().collect();
        dirs.reverse();
        dirs.into_iter()
            .find(|d| {
                let Ok(m) = std::fs::metadata(d) else {
                    return false; // not made yet: judged when it is
                };
                let bits = if m.uid() == self.uid {
                    m.mode() >> 6
                } else if m.gid() == self.gid {
                    m.mode() >> 3
                } else {
                    m.mode()
                };
                bits & 0o1 == 0
            })
            .map(std::path::Path::to_path_buf)
    }
}

impl ExecutorConfig {
    /// Defaults around `agent_cmd`, with directories under `base`.
    pub fn new(agent_cmd: String, base: PathBuf) -> Self {
        ExecutorConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7200)),
            work_dir: base.join("work"),
            state_dir: base.join("state"),
            agent_cmd,
            max_ttl: Duration::from_secs(24 * 3600),
            max_concurrent: 8,
            keep_cache: false,
            passthrough: false,
            hydrate: None,
            track_opens: false,
            writeback_cache: false,
            git_fsmonitor: true,
            fsmonitor_hook: None,
            renew_margin: None,
            read_timeout: Duration::from_secs(30),
            sync_debounce: Duration::from_millis(50),
            block_cache: Some(awcpfs::cache::CacheConfig::new(Some(base.join("cache")))),
            transports: vec![TransportType::Awcpfs, TransportType::Archive],
            access_modes: vec![AccessMode::Ro, AccessMode::Rw],
            archive_limits: crate::archive::ScanLimits {
                max_total_bytes: 4 << 30,
                max_files: 1_000_000,
                max_file_bytes: 4 << 30,
            },
            max_body_bytes: 512 << 20,
            token: None,
            mount_access: awcpfs::mount::MountAccess::Path,
            agent_user: None,
        }
    }
}

/// One delegation on this Executor.
pub(crate) struct Assignment {
    pub(crate) invite: InviteMessage,
    pub(crate) state: Mutex<AssignmentState>,
    pub(crate) work_path: PathBuf,
    pub(crate) started_at: Mutex<Option<String>>,
    /// Events with their ids (1-based), for replay.
    pub(crate) backlog: Mutex<Vec<(u64, TaskEvent)>>,
    pub(crate) tx: broadcast::Sender<(u64, TaskEvent)>,
    pub(crate) result: Mutex<Option<TaskResultResponse>>,
    pub(crate) cancel: tokio::sync::Notify,
    /// The task's mounts (one per resource), while they run.
    pub(crate) mount: Mutex<Option<mounts::MountSet>>,
    /// INVITE asked for a multi-round session (`multiRound`, ours).
    pub(crate) multi_round: bool,
    /// The round running or last finished (1 for START's).
    pub(crate) round: std::sync::atomic::AtomicU32,
    /// The current round's task (INVITE's, then each CONTINUE's).
    pub(crate) task: Mutex<awcp_protocol::messages::TaskSpec>,
    /// The Delegator's proof for this delegation: the capability token its START carried
    /// (`awcpfs`); `None` before START and for delegations whose START carries none (a
    /// reference Delegator's `archive`). Once set, the routes that touch the delegation
    /// require it (or the Executor's own token) as `Authorization: Bearer`.
    pub(crate) proof: Mutex<Option<String>>,
    /// Who asked for the cancel that ended the task, for its recorded reason.
    pub(crate) cancelled_by: Mutex<Option<routes::Caller>>,
    /// CONTINUE and CLOSE, to the task's runner.
    pub(crate) rounds_tx: tokio::sync::mpsc::UnboundedSender<task::RoundCmd>,
    pub(crate) rounds_rx: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<task::RoundCmd>>>,
}

/// The service state.
pub struct Executor {
    pub(crate) cfg: ExecutorConfig,
    pub(crate) tasks: Mutex<HashMap<String, Arc<Assignment>>>,
    pub(crate) block_cache: Option<Arc<awcpfs::cache::BlockCache>>,
}

impl Executor {
    /// The block cache shared by this Executor's mounts, if it has one.
    pub fn block_cache(&self) -> Option<&Arc<awcpfs::cache::BlockCache>> {
        self.block_cache.as_ref()
    }
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// A started Executor.
#[derive(Debug)]
pub struct RunningExecutor {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The service.
    pub executor: Arc<Executor>,
    shutdown: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningExecutor {
    /// The AWCP endpoint URL (`http://addr/awcp`).
    pub fn awcp_url(&self) -> String {
        format!("http://{}/awcp", self.addr)
    }

    /// Stop: end every running task (fence, flush, unmount), then stop serving.
    pub async fn stop(self) {
        let mounts: Vec<_> = self
            .executor
            .tasks
            .lock()
            .values()
            .filter_map(|a| a.mount.lock().clone())
            .collect();
        for m in mounts {
            let _ = tokio::task::spawn_blocking(move || m.finish()).await;
        }
        let _ = self.shutdown.send(true);
        let mut task = self.task;
        // Open event streams would hold a graceful shutdown forever: cut them after a grace.
        if tokio::time::timeout(Duration::from_secs(2), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }
}

impl Assignment {
    /// Append an event to the backlog and send it to subscribers.
    pub(crate) fn emit(&self, ev: TaskEvent) {
        let mut backlog = self.backlog.lock();
        let id = backlog.len() as u64 + 1;
        backlog.push((id, ev.clone()));
        let _ = self.tx.send((id, ev));
    }
}

/// Bind and serve in the background.
pub async fn start(mut cfg: ExecutorConfig) -> anyhow::Result<RunningExecutor> {
    use anyhow::Context as _;
    // Absolute, so ACCEPT's executorWorkDir and the agent's AWCP_WORKSPACE are usable anywhere.
    cfg.work_dir = std::path::absolute(&cfg.work_dir)?;
    cfg.state_dir = std::path::absolute(&cfg.state_dir)?;
    anyhow::ensure!(
        !(cfg.agent_user.is_some() && cfg.mount_access == awcpfs::mount::MountAccess::Owner),
        "--mount-access owner keeps --agent-user out of its own mounts (root mounts them): \
         use the default --mount-access path, which lets in only who passes the 0700 work \
         directory"
    );
    // Private (0700): mount state holds handles (tokens), journals and workspace content;
    // the work directory leads into the mounts.
    for dir in [&cfg.work_dir, &cfg.state_dir] {
        awcpfs::private::create_dir_all(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    if let Some(u) = &cfg.agent_user {
        // The agent user must reach its workspace, and it alone besides root: the work
        // directory is its own, still 0700 (see docs/SECURITY.md).
        nix::unistd::chown(
            &cfg.work_dir,
            Some(nix::unistd::Uid::from_raw(u.uid)),
            Some(nix::unistd::Gid::from_raw(u.gid)),
        )
        .with_context(|| {
            format!(
                "giving {} to --agent-user {} (the Executor must run as root for it)",
                cfg.work_dir.display(),
                u.name
            )
        })?;
        // Its parent (the Executor's base directory, 0700 when made here) lets it pass
        // through, without listing: 0711. state/ and cache/ beside stay 0700.
        if let Some(parent) = cfg.work_dir.parent()
            && u.blocked_at(parent).as_deref() == Some(parent)
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(parent)?.permissions().mode() & 0o7777;
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(mode | 0o011))
                .with_context(|| format!("letting --agent-user through {}", parent.display()))?;
        }
        if let Some(d) = u.blocked_at(&cfg.work_dir) {
            tracing::warn!(dir = %d.display(), user = %u.name,
                "--agent-user cannot pass through this directory to its workspace: its \
                 agents will fail to start; use a --dir it can reach (e.g. under /var/lib)");
        }
    }
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding the executor to {} (use --listen)", cfg.listen))?;
    let addr = listener.local_addr()?;
    // Every task mounts FUSE: say so now rather than failing each delegation later.
    if !std::path::Path::new("/dev/fuse").exists() {
        anyhow::bail!(
            "/dev/fuse is missing: the Executor mounts workspaces with FUSE \
             (load the module with `modprobe fuse`; in a container, pass --device /dev/fuse)"
        );
    }
    if !nix::unistd::geteuid().is_root() {
        tracing::warn!(
            "not running as root: mounting FUSE directly needs CAP_SYS_ADMIN; delegations may fail with SETUP_FAILED"
        );
    }
    recover_leftovers(&cfg).await;
    let block_cache = match &cfg.block_cache {
        Some(c) => {
            let c = c.clone();
            let cache =
                tokio::task::spawn_blocking(move || awcpfs::cache::BlockCache::open(&c)).await??;
            tracing::info!(dir = ?cache.dir(), blocks = cache.stats().disk_blocks, "block cache open");
            Some(Arc::new(cache))
        }
        None => None,
    };
    let executor = Arc::new(Executor {
        cfg,
        tasks: Mutex::new(HashMap::new()),
        block_cache,
    });
    let router = routes::router(executor.clone());
    let (shutdown, mut rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        let r = axum::serve(
            // Small answers (a manifest, one small file's block) must not wait for a
            // delayed ACK (Nagle): up to 40 ms per request otherwise.
            axum::serve::ListenerExt::tap_io(listener, |s| {
                let _ = s.set_nodelay(true);
            }),
            router,
        )
        .with_graceful_shutdown(async move {
            let _ = rx.wait_for(|s| *s).await;
        })
        .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "executor listener failed");
        }
    });
    tracing::info!(%addr, "executor listening");
    Ok(RunningExecutor {
        addr,
        executor,
        shutdown,
        task,
    })
}

/// After a crash: unmount what the previous process left mounted under the work directory,
/// and write back what its mounts journaled but never committed (`awcpfs` recovery, using
/// the handle each mount saved). A mount whose lease is over by now cannot be recovered
/// over the network; its state stays in place and is reported.
pub async fn recover_leftovers(cfg: &ExecutorConfig) {
    let work = cfg.work_dir.display().to_string();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for mp in mounts.lines().filter_map(|l| l.split(' ').nth(4)) {
        if mp.starts_with(&format!("{work}/")) {
            tracing::warn!(
                mountpoint = mp,
                "unmounting a mount left by a previous executor"
            );
            let _ = nix::mount::umount2(mp, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    let Ok(dirs) = std::fs::read_dir(&cfg.state_dir) else {
        return;
    };
    // A task's state directory, or with several resources one per resource below it.
    let states = dirs.flatten().flat_map(|d| {
        let top = d.path();
        let nested = std::fs::read_dir(top.join(mounts::RESOURCES_DIR))
            .into_iter()
            .flatten()
            .flatten()
            .map(|r| r.path());
        std::iter::once(top.clone())
            .chain(nested)
            .collect::<Vec<_>>()
    });
    for state in states {
        let journal = state.join(awcpfs::mount::recover::JOURNAL_FILE);
        if !std::fs::metadata(&journal).is_ok_and(|m| m.len() > 0) {
            continue;
        }
        let handle: Option<awcp_protocol::transport::AwcpfsHandle> =
            std::fs::read(state.join(task::HANDLE_FILE))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
        let Some(h) = handle else {
            tracing::error!(state = %state.display(), "unsynced changes but no saved handle: recover by hand with `awcpfs recover`");
            continue;
        };
        let remote = Arc::new(awcpfs::mount::remote::HttpRemote::new(
            &h.endpoint,
            &h.export_id,
            &h.token,
            Duration::from_secs(30),
        ));
        let st = state.clone();
        match tokio::task::spawn_blocking(move || awcpfs::mount::recover::recover(&st, remote))
            .await
        {
            Ok(Ok(r)) => {
                tracing::info!(state = %state.display(), changes = r.changes, files = r.files_written,
                    conflicts = r.conflicts.len(), "recovered a crashed mount's changes");
                let _ = std::fs::remove_file(state.join(task::HANDLE_FILE));
            }
            Ok(Err(e)) => tracing::error!(state = %state.display(), error = %e,
                "could not recover a crashed mount's changes; they stay in its state directory"),
            Err(e) => tracing::error!(error = %e, "recovery task failed"),
        }
    }
}

/// Run until Ctrl-C.
pub async fn serve(cfg: ExecutorConfig) -> anyhow::Result<()> {
    let running = start(cfg).await?;
    eprintln!(
        "awcp-ctl executor: AWCP endpoint {} (Ctrl-C stops)",
        running.awcp_url()
    );
    tokio::signal::ctrl_c().await?;
    running.stop().await;
    Ok(())
}
