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

mod adapter;
mod aecp;
mod archive_task;
mod body;
pub mod credential;
mod git_task;
pub(crate) use git_task::{
    branch_ok as git_branch_ok, remote_allowed as git_remote_allowed, token_env as git_token_env,
};
mod confine;
mod fsmonitor;
mod metrics;
pub use fsmonitor::fsmonitor_hook;
mod mounts;
mod pending;
mod restart;
mod routes;
pub mod sandbox;
pub mod sshfs_task;
mod task;

pub use confine::{DEFAULT_AGENT_USER, ROOT_DEFAULT_DIR, ensure_default_user};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::broadcast;

use awcp_protocol::api::{ErrorInfo, TaskResultResponse};
use awcp_protocol::messages::{AccessMode, InviteMessage};
use awcp_protocol::{AssignmentState, TaskEvent, TransportType};

pub use adapter::RemoteAgent;

/// How the Executor runs.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    /// Listen address (default `127.0.0.1:7200`).
    pub listen: SocketAddr,
    /// Where workspaces are mounted (`<work_dir>/<delegationId>`).
    pub work_dir: PathBuf,
    /// Where mount state (journals, upper files) lives.
    pub state_dir: PathBuf,
    /// The agent command, run with `sh -c` in the mounted workspace (unless
    /// `remote_agent` is set).
    pub agent_cmd: String,
    /// Hand each task to this A2A or HTTP agent instead of running `agent_cmd`
    /// (`executor --agent-a2a`, `--agent-http`).
    pub remote_agent: Option<RemoteAgent>,
    /// Bound on each round of a remote agent (`executor --agent-timeout`; the lease bounds
    /// it anyway).
    pub agent_timeout: Option<Duration>,
    /// Run an INVITE that does not say `multiRound` (every reference Delegator) as a
    /// multi-round session, as the reference's multi-round Executor does (`executor
    /// --reference-rounds`): `round_done`, idle until CONTINUE or CLOSE.
    pub reference_rounds: bool,
    /// Such a session (not one that asked for rounds) is closed here, with `done`, after
    /// this long idle: a Delegator that never closes it does not hold the workspace for
    /// ever.
    pub idle_timeout: Duration,
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
    /// Whose new files the kernel writes directly (see
    /// [`awcpfs::mount::KernelOptions::passthrough_writes`]).
    pub passthrough_writes: awcpfs::mount::PassthroughWriters,
    /// The FUSE transport of each mount (see [`awcpfs::mount::FuseTransport`]).
    pub fuse_transport: awcpfs::mount::FuseTransport,
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
    /// against it; `DEP_MISSING` otherwise). By default all but `sshfs`, which is added
    /// when the `sshfs` and `fusermount` commands are installed.
    pub transports: Vec<TransportType>,
    /// Access modes accepted (`DECLINED` otherwise).
    pub access_modes: Vec<AccessMode>,
    /// What an `archive` workspace may unpack to (checked on the real bytes).
    pub archive_limits: crate::archive::ScanLimits,
    /// Largest HTTP body accepted: only a START for a delegation that an authenticated
    /// INVITE created, while it awaits START, may be this large (an `archive` START
    /// carries the whole workspace), one such body at a time; every other body is held to
    /// [`ExecutorConfig::small_body_bytes`] (413 beyond).
    pub max_body_bytes: usize,
    /// Largest body of any other request (1 MiB by default).
    pub small_body_bytes: usize,
    /// The credential Delegators must present: INVITE carries it as `auth.credential`
    /// (else `AUTH_FAILED`); as `Authorization: Bearer` it opens `GET /awcp/status` in full
    /// and every delegation's routes. `None` at [`start`]: the one in
    /// `<state_dir>/executor-token` (see [`credential::CREDENTIAL_FILE`]), drawn at first
    /// start — unless [`ExecutorConfig::unsafe_open`].
    pub token: Option<String>,
    /// Accept INVITEs from anyone who can reach the endpoint (`executor --unsafe-open`):
    /// no credential at all. Anyone may then run code here as the agent's user.
    pub unsafe_open: bool,
    /// How long an accepted INVITE waits for its START before it expires (its slot is
    /// freed, its id forgotten).
    pub pending_timeout: Duration,
    /// Most INVITEs waiting for START from one peer address that did not carry the
    /// credential (only with `unsafe_open`), so one caller cannot take every slot.
    pub max_pending_per_peer: usize,
    /// Who the kernel lets into the mounts (`executor --mount-access`, see
    /// [`awcpfs::mount::access`]): by default every process that reaches a mount through
    /// the 0700 work directory (the Executor's user, the agent user, and processes of the
    /// agent that change user inside), served by the files' modes.
    pub mount_access: awcpfs::mount::MountAccess,
    /// Run the agent as this (non-root) user; the mounts' files are then its own. `None`:
    /// [`DEFAULT_AGENT_USER`] (created if missing) when the Executor runs as root, else the
    /// Executor's own user — set at [`start`].
    pub agent_user: Option<AgentUser>,
    /// Run the agent as root when the Executor is root (`--unsafe-agent-as-root`).
    pub unsafe_agent_as_root: bool,
    /// Run agents without Landlock (`--unsafe-agent-unconfined`; the Executor refuses to
    /// start on a kernel without Landlock otherwise).
    pub unsafe_agent_unconfined: bool,
    /// More paths agents may read (`--agent-allow-read`), besides the system's.
    pub agent_allow_read: Vec<PathBuf>,
    /// More paths agents may write (`--agent-allow-write`), besides their workspace and
    /// their own directory.
    pub agent_allow_write: Vec<PathBuf>,
    /// No network for any agent (`--agent-no-network`), whatever INVITE asks.
    pub agent_no_network: bool,
    /// Each agent's own directory (`<agents_dir>/<delegationId>`: its `TMPDIR`, `HOME` and
    /// AECP socket), owned by the agent's user.
    pub agents_dir: PathBuf,
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
            remote_agent: None,
            agent_timeout: None,
            reference_rounds: false,
            idle_timeout: Duration::from_secs(600),
            max_ttl: Duration::from_secs(24 * 3600),
            max_concurrent: 8,
            keep_cache: false,
            passthrough: false,
            hydrate: None,
            track_opens: false,
            writeback_cache: false,
            passthrough_writes: awcpfs::mount::PassthroughWriters::Toolchain,
            fuse_transport: awcpfs::mount::FuseTransport::Auto,
            git_fsmonitor: true,
            fsmonitor_hook: None,
            renew_margin: None,
            read_timeout: Duration::from_secs(30),
            sync_debounce: Duration::from_millis(50),
            block_cache: Some(awcpfs::cache::CacheConfig::new(Some(base.join("cache")))),
            // `sshfs` only where the system's sshfs can mount it.
            transports: [
                TransportType::Awcpfs,
                TransportType::Archive,
                TransportType::Storage,
                TransportType::Git,
            ]
            .into_iter()
            .chain(sshfs_task::available().then_some(TransportType::Sshfs))
            .collect(),
            access_modes: vec![AccessMode::Ro, AccessMode::Rw],
            archive_limits: crate::archive::ScanLimits {
                max_total_bytes: 4 << 30,
                max_files: 1_000_000,
                max_file_bytes: 4 << 30,
            },
            max_body_bytes: 512 << 20,
            small_body_bytes: 1 << 20,
            token: None,
            unsafe_open: false,
            pending_timeout: Duration::from_secs(60),
            max_pending_per_peer: 2,
            mount_access: awcpfs::mount::MountAccess::Path,
            agent_user: None,
            unsafe_agent_as_root: false,
            unsafe_agent_unconfined: false,
            agent_allow_read: Vec::new(),
            agent_allow_write: Vec::new(),
            agent_no_network: false,
            agents_dir: base.join("agents"),
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
    /// INVITE asked for a multi-round session (`multiRound`, ours), or said nothing and
    /// the Executor runs such INVITEs in rounds (`--reference-rounds`).
    pub(crate) multi_round: bool,
    /// Close the session after this long idle (the rounds the INVITE did not ask for).
    pub(crate) idle_close: Option<Duration>,
    /// The round running or last finished (1 for START's).
    pub(crate) round: std::sync::atomic::AtomicU32,
    /// The current round's task (INVITE's, then each CONTINUE's).
    pub(crate) task: Mutex<awcp_protocol::messages::TaskSpec>,
    /// The lease as START (then each CONTINUE) gave it, for a remote agent's request.
    pub(crate) lease: Mutex<Option<awcp_protocol::messages::ActiveLease>>,
    /// The A2A context a remote agent put the first round in, so later rounds continue it.
    pub(crate) agent_context: Mutex<Option<String>>,
    /// The Delegator's proof for this delegation: the capability token its START carried
    /// (`awcpfs`); `None` before START and for delegations whose START carries none (a
    /// reference Delegator's `archive`). Once set, the routes that touch the delegation
    /// require it (or the Executor's own token) as `Authorization: Bearer`.
    pub(crate) proof: Mutex<Option<String>>,
    /// Who asked for the cancel that ended the task, for its recorded reason.
    pub(crate) cancelled_by: Mutex<Option<routes::Caller>>,
    /// Where the INVITE came from, and whether it carried this Executor's credential.
    pub(crate) invited_by: pending::Inviter,
    /// CONTINUE and CLOSE, to the task's runner.
    pub(crate) rounds_tx: tokio::sync::mpsc::UnboundedSender<task::RoundCmd>,
    pub(crate) rounds_rx: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<task::RoundCmd>>>,
}

/// The service state.
pub struct Executor {
    pub(crate) cfg: ExecutorConfig,
    pub(crate) tasks: Mutex<HashMap<String, Arc<Assignment>>>,
    pub(crate) block_cache: Option<Arc<awcpfs::cache::BlockCache>>,
    /// One large body (a START carrying a workspace) is read at a time.
    pub(crate) large_body: tokio::sync::Semaphore,
    /// Ids of INVITEs that expired without START, newest last (bounded), so a late START
    /// is told why it is refused.
    pub(crate) expired: Mutex<std::collections::VecDeque<String>>,
    /// Ids whose large START is being received now: they do not expire meanwhile (a
    /// workspace may take longer than the pending timeout to upload).
    pub(crate) receiving: Mutex<std::collections::HashSet<String>>,
    /// Delegations a previous process held when it died, with how each ended (kept until
    /// the Delegator acknowledges it; see `executor/restart.rs`).
    pub(crate) restarted: Mutex<HashMap<String, ErrorInfo>>,
    /// The counters of mounts that have ended (`GET /metrics` adds the live ones).
    pub(crate) ended_mounts: crate::metrics::EndedMounts,
}

impl Executor {
    /// The credential Delegators must present (`None`: open to anyone, `--unsafe-open`).
    pub fn credential(&self) -> Option<&str> {
        self.cfg.token.as_deref()
    }

    /// The secret this Executor gives delegation `id`'s agent as `$AECP_TOKEN`: what a
    /// connection to that worker's AECP socket must show to read its deliveries or act as
    /// it. For the Executor's own user (an embedding harness, a test); never on a wire.
    pub fn aecp_token(&self, id: &str) -> String {
        confine::aecp_token(id)
    }

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
    cfg.agents_dir = std::path::absolute(&cfg.agents_dir)?;
    confine::choose_agent(&mut cfg)?;
    anyhow::ensure!(
        !(cfg.agent_user.is_some() && cfg.mount_access == awcpfs::mount::MountAccess::Owner),
        "--mount-access owner keeps the agents' user ({}) out of its own mounts (root \
         mounts them): use the default --mount-access path, which lets in only who passes \
         the 0700 work directory",
        cfg.agent_user.as_ref().map_or("", |u| u.name.as_str())
    );
    // Private (0700): mount state holds handles (tokens), journals and workspace content;
    // the work directory leads into the mounts; the agents' directories are the agent
    // user's alone.
    confine::prepare_dirs(&cfg)?;
    credential::resolve(&mut cfg)?;
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
    let restarted = recover_leftovers(&cfg).await;
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
        large_body: tokio::sync::Semaphore::new(1),
        expired: Mutex::new(std::collections::VecDeque::new()),
        receiving: Mutex::new(std::collections::HashSet::new()),
        restarted: Mutex::new(restarted),
        ended_mounts: Default::default(),
    });
    let router =
        routes::router(executor.clone()).into_make_service_with_connect_info::<SocketAddr>();
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
/// write back what its mounts journaled but never committed (`awcpfs` recovery, using the
/// handle each mount saved), and decide the outcome of each delegation it held (see
/// `executor/restart.rs`). A mount whose lease is over by now cannot be recovered over
/// the network; its state stays in place and the outcome says so.
pub async fn recover_leftovers(cfg: &ExecutorConfig) -> HashMap<String, ErrorInfo> {
    restart::recover(cfg).await
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
