//! The Delegator daemon: delegations, leases, and the export that serves each workspace.
//!
//! Two listeners: the daemon API (the reference's routes plus ours; loopback by default,
//! since it can hand out workspaces) and the data plane of `awcpfs` exports (which remote
//! Executors must reach). A delegation's life:
//!
//! 1. `POST /delegate` checks the workspace, grants a lease, registers an export with a
//!    fresh capability token, and sends INVITE; on ACCEPT it opens the Executor's SSE
//!    stream, then sends START with the `awcpfs` transport handle, and answers with the id.
//! 2. A pump task follows the Executor's events and drives the Delegation state machine;
//!    every change is persisted (SQLite) and broadcast to watchers.
//! 3. Revocation (`POST /delegation/:id/revoke`, or the reference's `DELETE`) revokes the
//!    lease — the export refuses the token at once, but for a final flush within the grace —
//!    and tells the Executor with AWCP cancel. Expiry is watched per delegation and handled
//!    the same way.
//!
//! The state lives in SQLite by default, or in PostgreSQL shared by several daemons, which
//! then take over each other's delegations when one dies: see [`shared`].

mod admission;
pub mod aecp;
pub mod api;
mod archive_flow;
mod collect;
mod flow;
mod git_flow;
mod metrics;
pub mod progress;
pub mod recover;
mod resources;
mod rounds;
pub mod shared;
mod sshfs_flow;
mod staged;
mod storage_flow;
pub mod tokens;
pub mod ui;

pub use sshfs_flow::SshfsConfig;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::broadcast;

use awcp_lease::Lease;
use awcp_protocol::{DelegationEvent, DelegationState};
use awcpfs::export::{Export, ExportRegistry};

use crate::store::{StateLocation, StateStore, StoredDelegation};
use crate::watch::WatchEvent;

/// How the daemon runs.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Daemon API address (default `127.0.0.1:3100`).
    pub listen: SocketAddr,
    /// Data-plane address (default `127.0.0.1:3101`).
    pub export_listen: SocketAddr,
    /// URL Executors use to reach the data plane; default `http://<export_listen>`.
    pub export_url: Option<String>,
    /// Where the database and export scratch space live.
    pub state_dir: PathBuf,
    /// Longest lease the daemon grants.
    pub max_ttl: Duration,
    /// How long after a revoke or expiry a final flush is still accepted.
    pub flush_grace: Duration,
    /// Block size of exports.
    pub block_size: u32,
    /// Longest a lease may live in all, however often it is renewed (by the Executor on
    /// its own, or with `awcp-ctl renew`).
    pub max_lease: Duration,
    /// AGLX lifecycle notifications (`serve --notify`), if any.
    pub aglx: Option<crate::aglx::NotifyConfig>,
    /// Admission limits of `awcpfs` delegations (nothing is copied up front, so these are
    /// far larger than the `archive` ones).
    pub awcpfs_limits: crate::archive::ScanLimits,
    /// Admission limits of `archive` delegations (the whole workspace travels in one
    /// message; default the reference's 100 MB / 10,000 files / 50 MB per file).
    pub archive_limits: crate::archive::ScanLimits,
    /// What an arriving `archive` snapshot may unpack to.
    pub snapshot_limits: crate::archive::ScanLimits,
    /// Sensitive-file patterns (basename or path globs) that refuse an `archive`
    /// delegation; default the reference's list.
    pub sensitive: Vec<String>,
    /// An idle multi-round session is closed after this long without CONTINUE (the
    /// reference's default: 5 minutes).
    pub idle_timeout: Duration,
    /// Run a `POST /delegate` that does not say `multiRound` (every reference client: its
    /// MCP server, `DelegatorDaemonClient`) as a multi-round session, as the reference's
    /// multi-round daemon does, so its `delegate_continue` works (`serve
    /// --reference-rounds`); otherwise such a delegation completes after one round.
    pub reference_rounds: bool,
    /// The token every daemon API route but `GET /health` requires as
    /// `Authorization: Bearer <token>` (401 otherwise). When `None` (and not
    /// `unsafe_no_auth`), the daemon uses the one in `<state_dir>/api-token`, creating it
    /// (0600) at first start: see [`API_TOKEN_FILE`].
    pub api_token: Option<String>,
    /// Serve the API without any credential (`serve --unsafe-no-auth`): anyone who can
    /// connect may delegate any directory the daemon can read.
    pub unsafe_no_auth: bool,
    /// The Executor credential sent as INVITE's `auth` (and as the bearer token of the
    /// delegation's later requests) when a delegation request carries no `auth` of its own
    /// (`serve --executor-token-file`): clients that cannot send one (the reference's MCP
    /// server) then reach Executors that require it. Sent to whichever Executor a request
    /// names: every API client is trusted with it.
    pub executor_token: Option<String>,
    /// Let in without a token the callers the kernel names as the daemon's own uid or root
    /// (over the Unix socket by `SO_PEERCRED`, over loopback TCP by sock_diag): see
    /// [`crate::peer`]. Off (`serve --always-require-token`): every caller needs the token.
    pub trust_local_uid: bool,
    /// The daemon API's Unix socket: `None` for `<state_dir>/api.sock`.
    pub api_socket: Option<PathBuf>,
    /// Serve no Unix socket (`serve --no-api-socket`).
    pub no_api_socket: bool,
    /// Watch delegated directories and show the Delegator's own changes on running mounts
    /// (`awcpfs` transport). Off: a mount sees the directory as it was when delegated.
    pub watch: bool,
    /// The transport of a request that names none (the reference's MCP server and
    /// `DelegatorDaemonClient` never do). `None` (the default): ask the Executor's
    /// `GET /awcp/status` which transports it serves — ours lists them (`transports`), a
    /// reference Executor does not and gets `archive`, the only one it serves.
    pub default_transport: Option<awcp_protocol::TransportType>,
    /// AECP witnesses may run on this machine, in the named sandbox (only `netns`: a new
    /// network namespace). `None`: they run on the worker's Executor only.
    pub aecp_local_witness: Option<String>,
    /// The block tier (`serve --blocks s3://…`): blocks in an object store, fetched by
    /// Executors through presigned URLs. `None`: the export serves every block itself.
    pub blocks: Option<awcpfs::export::tier::BlockTierConfig>,
    /// Where delegations are kept: `None` for `delegator.db` (SQLite) in `state_dir`, or a
    /// `postgres://user:pass@host:port/db` URL shared with other daemons.
    pub state: Option<String>,
    /// On a shared database: a daemon whose heartbeat is this old is taken for dead, and
    /// its running delegations are taken over. Daemons beat every fifth of it.
    pub failover_after: Duration,
    /// AECP policy switch: hold a stale consumer's write-backs of files that import a
    /// revised module until it acknowledges the revision (off by default).
    pub aecp_hold_stale: bool,
    /// `git` delegations: the remote used when a request names none (`serve --git-remote`).
    pub git_remote: Option<String>,
    /// `git` delegations: a file holding an HTTPS token for the remote.
    pub git_token_file: Option<PathBuf>,
    /// `sshfs` delegations: the per-delegation sshd (see [`SshfsConfig`]).
    pub sshfs: SshfsConfig,
}

impl DaemonConfig {
    /// Defaults, with state in `state_dir`.
    pub fn new(state_dir: PathBuf) -> Self {
        DaemonConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 3100)),
            export_listen: SocketAddr::from(([127, 0, 0, 1], 3101)),
            export_url: None,
            state_dir,
            max_ttl: Duration::from_secs(24 * 3600),
            flush_grace: Duration::from_secs(10),
            block_size: awcp_protocol::dataplane::DEFAULT_BLOCK_SIZE,
            max_lease: Duration::from_secs(24 * 3600),
            aglx: None,
            awcpfs_limits: crate::archive::ScanLimits {
                max_total_bytes: 1 << 40,
                max_files: 10_000_000,
                max_file_bytes: 1 << 40,
            },
            archive_limits: crate::archive::ScanLimits::REFERENCE,
            snapshot_limits: crate::archive::ScanLimits {
                max_total_bytes: 4 << 30,
                max_files: 1_000_000,
                max_file_bytes: 4 << 30,
            },
            sensitive: crate::archive::DEFAULT_SENSITIVE
                .iter()
                .map(|s| s.to_string())
                .collect(),
            api_token: None,
            unsafe_no_auth: false,
            executor_token: None,
            trust_local_uid: true,
            api_socket: None,
            no_api_socket: false,
            watch: true,
            aecp_local_witness: None,
            aecp_hold_stale: false,
            idle_timeout: Duration::from_secs(300),
            reference_rounds: false,
            default_transport: None,
            blocks: None,
            state: None,
            failover_after: Duration::from_secs(15),
            git_remote: None,
            git_token_file: None,
            sshfs: SshfsConfig::default(),
        }
    }
}

/// One delegation held in memory.
pub(crate) struct Live {
    pub(crate) d: Mutex<StoredDelegation>,
    pub(crate) lease: Arc<Lease>,
    pub(crate) tx: broadcast::Sender<WatchEvent>,
    /// The `awcpfs` exports, one per resource (empty for `archive`, and once retired).
    pub(crate) exports: Mutex<Vec<Arc<Export>>>,
    /// Renewals already recorded in the history (the Executor renews through the export).
    pub(crate) seen_renewals: std::sync::atomic::AtomicU64,
    /// How far its setup got (manifest builds), for progress bars.
    pub(crate) progress: Arc<progress::Progress>,
    /// The daemon that owns it when that is another one (a read-only copy); `None`: this
    /// daemon runs it.
    pub(crate) owner: Mutex<Option<String>>,
}

/// The daemon's shared state.
pub struct Daemon {
    pub(crate) cfg: DaemonConfig,
    pub(crate) store: Box<dyn StateStore>,
    /// This daemon's name as an owner of delegations ([`shared::LOCAL_OWNER`] on SQLite).
    pub(crate) daemon_id: String,
    /// The newest row version read from a shared store.
    pub(crate) seen_version: std::sync::atomic::AtomicI64,
    /// Where the daemon API listens (the heartbeat names it).
    pub(crate) api_addr: SocketAddr,
    /// Since when this daemon's heartbeats have all reached the shared database (`None`
    /// while they fail): it claims nothing until that is `failover_after` ago.
    pub(crate) beating_since: Mutex<Option<std::time::Instant>>,
    pub(crate) exports: ExportRegistry,
    pub(crate) live: Mutex<HashMap<String, Arc<Live>>>,
    /// Delegations being set up, by the progress key their client chose.
    pub(crate) preparing: Mutex<HashMap<String, Arc<progress::Progress>>>,
    pub(crate) http: reqwest::Client,
    pub(crate) export_url: String,
    /// Background tasks (event pumps, expiry watchers), aborted when the daemon stops.
    pub(crate) tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// AGLX notifications, best effort.
    pub(crate) aglx: Option<crate::aglx::DaemonNotifier>,
    /// AECP: the artifact store and policy.
    pub(crate) aecp: aecp::Aecp,
    /// The live view's login codes and browser sessions (`GET /ui`).
    pub(crate) ui: ui::UiSessions,
    /// The client tokens of the state database, as last read.
    pub(crate) tokens: tokens::TokenCache,
    /// The sshd of each running `sshfs` delegation.
    pub(crate) sshfs: sshfs_flow::Servers,
    /// What `git ls-files` said of each root, while its index is unchanged.
    pub(crate) withheld: Arc<admission::WithheldCache>,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// A started daemon: its addresses, and a handle that stops it.
#[derive(Debug)]
pub struct RunningDaemon {
    /// Where the daemon API listens.
    pub api_addr: SocketAddr,
    /// Where the data plane listens.
    pub export_addr: SocketAddr,
    /// The daemon API's Unix socket, if it serves one.
    pub api_socket: Option<PathBuf>,
    /// The daemon.
    pub daemon: Arc<Daemon>,
    shutdown: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningDaemon {
    /// The daemon API's base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.api_addr)
    }

    /// The token the daemon API requires (`None` with `unsafe_no_auth`).
    pub fn api_token(&self) -> Option<&str> {
        self.daemon.cfg.api_token.as_deref()
    }

    /// The daemon API's base URL with its token in the path (`http://host:port/t/<token>`),
    /// for clients that cannot send an `Authorization` header (the reference's
    /// `DelegatorDaemonClient` and MCP server); the plain URL with `unsafe_no_auth`.
    pub fn token_url(&self) -> String {
        match self.api_token() {
            Some(t) => format!("{}{}{t}", self.url(), api::TOKEN_PREFIX),
            None => self.url(),
        }
    }

    /// A client of this daemon over its Unix socket, with no token (`None` without one).
    pub fn socket_client(&self) -> Option<crate::client::DaemonClient> {
        let path = self.api_socket.as_ref()?;
        Some(crate::client::DaemonClient::new("http://localhost").with_unix_socket(path))
    }

    /// A client of this daemon, with its token.
    pub fn client(&self) -> crate::client::DaemonClient {
        crate::client::DaemonClient::new(&self.url())
            .with_token(self.api_token().map(str::to_owned))
    }

    /// Stop serving: end background tasks, close the listeners (open event streams are
    /// cut after a short grace).
    pub async fn stop(self) {
        // Mounts listening to this daemon's event streams reconnect to the next one.
        self.daemon.exports.close_streams();
        for t in self.daemon.tasks.lock().drain(..) {
            t.abort();
        }
        let d = self.daemon.clone();
        let _ = tokio::task::spawn_blocking(move || d.sshfs_stop_all()).await;
        let _ = self.shutdown.send(true);
        for mut t in self.tasks {
            if tokio::time::timeout(Duration::from_secs(2), &mut t)
                .await
                .is_err()
            {
                t.abort();
            }
        }
        if let Some(p) = &self.api_socket {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The daemon API's Unix socket in the state directory (unless `serve --api-socket` puts it
/// elsewhere): `awcp-ctl` run by the daemon's user talks to the daemon through it, with no
/// token.
pub const API_SOCKET_FILE: &str = "api.sock";

/// The file in the state directory holding the daemon API's token (0600): `awcp-ctl`
/// run by the daemon's user reads it, so local use needs no flag.
pub const API_TOKEN_FILE: &str = "api-token";

/// The token in `<state_dir>/api-token`, or a fresh one written there (0600) if there is
/// none yet. A token file readable by others is tightened and kept, with a warning.
pub fn load_or_create_api_token(state_dir: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context as _;
    use std::io::Write as _;
    use std::os::unix::fs::PermissionsExt as _;
    let path = state_dir.join(API_TOKEN_FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => {
            let mode = std::fs::metadata(&path)?.permissions().mode();
            if awcpfs::private::is_shared(mode) {
                tracing::warn!(path = %path.display(), mode = format!("{:o}", mode & 0o777),
                    "the API token file was readable by others: made it 0600 (consider \
                     deleting it to draw a new token)");
                awcpfs::private::restrict(&path, awcpfs::private::FILE_MODE)?;
            }
            return Ok(s.trim().to_string());
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(e).with_context(|| format!("reading the API token {}", path.display()));
        }
    }
    let token = crate::random_token();
    // Written under a temporary name and renamed, so a reader never sees half a token.
    let tmp = state_dir.join(format!(".{API_TOKEN_FILE}.{}", std::process::id()));
    let mut f = awcpfs::private::file_options()
        .truncate(true)
        .open(&tmp)
        .with_context(|| format!("writing the API token {}", tmp.display()))?;
    f.write_all(format!("{token}\n").as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)
        .with_context(|| format!("writing the API token {}", path.display()))?;
    tracing::info!(path = %path.display(), "drew the daemon API token");
    Ok(token)
}

/// Bind both listeners, restore persisted delegations, and serve in the background.
pub async fn start(mut cfg: DaemonConfig) -> anyhow::Result<RunningDaemon> {
    use anyhow::Context as _;
    cfg.state_dir = std::path::absolute(&cfg.state_dir)?;
    // Private (0700): the database holds every delegation's capability token in clear.
    awcpfs::private::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating the state directory {}", cfg.state_dir.display()))?;
    if cfg.api_token.is_none() && !cfg.unsafe_no_auth {
        cfg.api_token = Some(load_or_create_api_token(&cfg.state_dir)?);
    }
    // A daemon that died left its sshfs servers running: they end now (their delegations'
    // Executors see the mount go, and report it).
    {
        let (state, base) = (cfg.state_dir.clone(), cfg.sshfs.chroot_base.clone());
        tokio::task::spawn_blocking(move || sshfs_flow::sweep_leftovers(&state, &base)).await?;
    }
    let location = StateLocation::parse(cfg.state.as_deref(), &cfg.state_dir)?;
    let store = {
        let location = location.clone();
        tokio::task::spawn_blocking(move || location.open()).await??
    };
    let daemon_id = if store.shared() {
        shared::load_or_create_daemon_id(&cfg.state_dir)?
    } else {
        shared::LOCAL_OWNER.to_string()
    };
    tracing::info!(state = %store.describe(), daemon = %daemon_id, "delegation state");
    let aecp = aecp::Aecp {
        store: Arc::new(aecp_hooks::store::Store::open(
            &cfg.state_dir.join("delegator.db"),
        )?),
        policy: aecp_hooks::policy::Policy {
            hold_stale_writebacks: cfg.aecp_hold_stale,
            ..aecp_hooks::policy::Policy::default()
        },
        local_witness: cfg.aecp_local_witness.clone(),
        me: std::sync::OnceLock::new(),
    };
    // Hashes of files unchanged since an earlier delegation are reused, not recomputed.
    let hash_path = cfg.state_dir.join("hashes.bin");
    let hashes =
        tokio::task::spawn_blocking(move || awcpfs::export::hashcache::HashCache::open(&hash_path))
            .await?;
    let api_listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| {
            format!(
                "binding the daemon API to {} (is another daemon running? use --listen)",
                cfg.listen
            )
        })?;
    let export_listener = tokio::net::TcpListener::bind(cfg.export_listen)
        .await
        .with_context(|| {
            format!(
                "binding the data plane to {} (use --export-listen)",
                cfg.export_listen
            )
        })?;
    let api_addr = api_listener.local_addr()?;
    if cfg.api_token.is_none() {
        tracing::warn!(
            %api_addr,
            "--unsafe-no-auth: the daemon API takes no credential; any process that can \
             connect to {api_addr} can delegate any directory this daemon can read"
        );
    }
    let export_addr = export_listener.local_addr()?;
    let api_socket = if cfg.no_api_socket {
        None
    } else {
        let path = cfg
            .api_socket
            .clone()
            .unwrap_or_else(|| cfg.state_dir.join(API_SOCKET_FILE));
        // Without the socket the API still works over TCP: a path too long for a socket
        // address, or a read-only directory, is worth a warning, not a refusal to start.
        match crate::peer::UnixCallers::bind(path.clone()) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e,
                    "the daemon API's Unix socket could not be created; local clients use TCP \
                     (--api-socket PATH to put it elsewhere)");
                None
            }
        }
    };
    let api_socket_path = api_socket.as_ref().map(|l| l.path().to_path_buf());
    let export_url = cfg
        .export_url
        .clone()
        .unwrap_or_else(|| format!("http://{export_addr}"));
    let aglx = cfg
        .aglx
        .as_ref()
        .map(crate::aglx::DaemonNotifier::start)
        .transpose()?;
    let exports = ExportRegistry::with_hash_cache(Arc::new(hashes));
    let exports = if cfg.watch {
        exports
    } else {
        exports.without_watch()
    };
    let exports = match &cfg.blocks {
        Some(tier) => {
            let tier = awcpfs::export::tier::BlockTier::open(tier.clone())
                .await
                .context("opening the block tier (--blocks)")?;
            exports.with_block_tier(tier)
        }
        None => exports,
    };
    let daemon = Arc::new(Daemon {
        aglx,
        aecp,
        sshfs: Default::default(),
        withheld: Default::default(),
        cfg,
        store,
        daemon_id,
        seen_version: Default::default(),
        api_addr,
        beating_since: Mutex::new(None),
        exports,
        live: Mutex::new(HashMap::new()),
        preparing: Mutex::new(HashMap::new()),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?,
        export_url,
        tasks: Mutex::new(Vec::new()),
        ui: Default::default(),
        tokens: Default::default(),
    });
    let _ = daemon.aecp.me.set(Arc::downgrade(&daemon));
    if daemon.store.shared() {
        // Beat before anything else, so no other daemon takes this one's delegations
        // while it restores them.
        let d = daemon.clone();
        tokio::task::spawn_blocking(move || {
            d.store
                .heartbeat(&d.daemon_id, &format!("http://{}", d.api_addr))
        })
        .await??;
    }
    daemon.restore().await;
    if daemon.store.shared() {
        let d = daemon.clone();
        daemon.spawn(async move { d.share_loop().await });
    }
    let (shutdown, rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    // The daemon API: every connection is named by the kernel when it is accepted.
    let api =
        api::router(daemon.clone()).into_make_service_with_connect_info::<crate::peer::Caller>();
    {
        let mut rx = rx.clone();
        let api = api.clone();
        let listener = crate::peer::TcpCallers(api_listener);
        tasks.push(tokio::spawn(async move {
            let r = axum::serve(listener, api)
                .with_graceful_shutdown(async move {
                    let _ = rx.wait_for(|stop| *stop).await;
                })
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "daemon API listener failed");
            }
        }));
    }
    if let Some(listener) = api_socket {
        let mut rx = rx.clone();
        tasks.push(tokio::spawn(async move {
            let r = axum::serve(listener, api)
                .with_graceful_shutdown(async move {
                    let _ = rx.wait_for(|stop| *stop).await;
                })
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "daemon API socket failed");
            }
        }));
    }
    {
        let mut rx = rx.clone();
        let router = daemon
            .exports
            .router()
            .merge(storage_flow::router(daemon.clone()));
        tasks.push(tokio::spawn(async move {
            let r = axum::serve(
                // Small answers (a manifest, one small file's block) must not wait for a
                // delayed ACK (Nagle): up to 40 ms per request otherwise.
                axum::serve::ListenerExt::tap_io(export_listener, |s| {
                    let _ = s.set_nodelay(true);
                }),
                router,
            )
            .with_graceful_shutdown(async move {
                let _ = rx.wait_for(|stop| *stop).await;
            })
            .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "data plane listener failed");
            }
        }));
    }
    tracing::info!(%api_addr, %export_addr, api_socket = ?api_socket_path,
        "delegator daemon listening");
    Ok(RunningDaemon {
        api_addr,
        export_addr,
        api_socket: api_socket_path,
        daemon,
        shutdown,
        tasks,
    })
}

/// Run until Ctrl-C.
pub async fn serve(cfg: DaemonConfig) -> anyhow::Result<()> {
    let running = start(cfg).await?;
    eprintln!(
        "awcp-ctl serve: daemon API on http://{}, data plane on http://{} (Ctrl-C stops)",
        running.api_addr, running.export_addr
    );
    tokio::signal::ctrl_c().await?;
    running.stop().await;
    Ok(())
}

impl Daemon {
    /// The block tier's counters, when `serve --blocks` configured one.
    pub fn block_tier_stats(&self) -> Option<awcpfs::export::tier::TierStats> {
        self.exports.block_tier().map(|t| t.stats())
    }
}

impl Daemon {
    /// Run `fut` in the background until it ends or the daemon stops.
    pub(crate) fn spawn(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        let handle = tokio::spawn(fut);
        let mut tasks = self.tasks.lock();
        tasks.retain(|t| !t.is_finished());
        tasks.push(handle.abort_handle());
    }

    /// The capability token of a delegation's export (for operators and tests: it is never
    /// served by the daemon API).
    pub fn export_token(&self, id: &str) -> Option<String> {
        self.get_live(id).map(|l| l.d.lock().token.clone())
    }

    /// The data-plane URL Executors are given.
    pub fn export_url(&self) -> &str {
        &self.export_url
    }

    /// This daemon's name as the owner of delegations on a shared database.
    pub fn daemon_id(&self) -> &str {
        &self.daemon_id
    }

    pub(crate) fn get_live(&self, id: &str) -> Option<Arc<Live>> {
        self.live.lock().get(id).cloned()
    }

    /// Record an event in a delegation's history, persist, and broadcast it.
    pub(crate) fn record(&self, live: &Live, ev: WatchEvent) {
        let snapshot = {
            let mut d = live.d.lock();
            d.events.push(ev.clone());
            d.record.updated_at = crate::now_iso();
            d.clone()
        };
        self.persist(live, &snapshot);
        if let Some(n) = &self.aglx {
            n.on_event(live, &snapshot, &ev);
        }
        let _ = live.tx.send(ev);
    }

    /// Drive the state machine; illegal transitions are logged and ignored.
    pub(crate) fn transition(
        &self,
        live: &Live,
        event: DelegationEvent,
        detail: Option<String>,
    ) -> Option<DelegationState> {
        let next = {
            let mut d = live.d.lock();
            match d.record.state.apply(event) {
                Ok(next) => {
                    d.record.state = next;
                    next
                }
                Err(e) => {
                    tracing::debug!(error = %e, "ignoring transition");
                    return None;
                }
            }
        };
        self.record(
            live,
            WatchEvent::State {
                state: next,
                at: crate::now_iso(),
                detail,
            },
        );
        if next.is_terminal() {
            self.retire(live);
        }
        Some(next)
    }

    /// The delegation is over: end the lease (a final flush may still land within the
    /// grace), then drop the export.
    fn retire(&self, live: &Live) {
        live.lease.revoke(true);
        self.sshfs_release(live);
        self.release_copies(live);
        // Snapshot mode `discard`: the change set the export kept is dropped with it.
        let discarded = self.drop_discarded(live);
        let ids: Vec<String> = live
            .exports
            .lock()
            .iter()
            .map(|e| e.id().to_string())
            .collect();
        if !ids.is_empty() {
            let grace = self.cfg.flush_grace + Duration::from_secs(1);
            let exports = self.exports.clone();
            let aecp = self.aecp.store.clone();
            let worker = live.d.lock().record.id.as_str().to_string();
            self.spawn(async move {
                tokio::time::sleep(grace).await;
                for id in ids {
                    exports.remove(&id);
                }
                if let Some(stage) = discarded {
                    stage.remove();
                    // A final flush within the grace was screened too: its reports go
                    // with the discarded change set.
                    if let Err(e) = aecp.forget_worker_reports(&worker) {
                        tracing::warn!(%worker, error = %e, "AECP: forgetting a discarded change set's reports failed");
                    }
                }
            });
        }
    }
}
