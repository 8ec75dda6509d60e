//! Command-line parsing and the client commands (`delegate`, `status`, `revoke`, `renew`,
//! `watch`). Exit codes: 0 success (delegation completed), 1 error (connection, refusal),
//! 2 usage error (clap), 3 the delegation was cancelled or revoked, 4 its lease expired,
//! 5 it failed.

mod aecp;
mod aglx;
mod bars;
mod fleet;
mod secrets;
mod tokens;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};

use awcp_ctl::client::DaemonClient;
use awcp_ctl::daemon::DaemonConfig;
use awcp_ctl::executor::ExecutorConfig;
use awcp_ctl::watch::WatchEvent;
use awcp_protocol::api::{DelegateRequest, EnvironmentSpec, ResourceSpec, SnapshotMode};
use awcp_protocol::messages::{AccessMode, AuthCredential, AuthType, ResourceType, TaskSpec};
use awcp_protocol::{DelegationState, TransportType};

/// Hand a workspace to another agent under a lease, and take it back.
///
/// Start `awcp-ctl serve` on the machine that owns the workspace (the Delegator) and
/// `awcp-ctl executor --agent-cmd '…'` where the work happens (the Executor). Then
/// `awcp-ctl delegate ./repo --to http://executor:7200/awcp --wait` mounts the workspace on
/// the Executor with awcpfs, runs the agent in it, writes changes back live, and
/// `awcp-ctl revoke <id>` ends access at once.
#[derive(Debug, Parser)]
#[command(name = "awcp-ctl", version, propagate_version = true)]
struct Cli {
    /// Daemon API URL for client commands; several, comma-separated, for daemons sharing
    /// one database (`serve --state postgres://…`): the client uses the first that
    /// answers and moves to the next when it cannot connect (give them a token of
    /// `awcp-ctl token create`, which all of them accept).
    #[arg(
        long,
        global = true,
        env = "AWCP_DAEMON_URL",
        default_value = "http://127.0.0.1:3100"
    )]
    daemon: String,
    /// Print machine-readable JSON (one object per line) instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// The daemon API's token, for callers other than the daemon's own user (who needs none
    /// on its machine: the kernel names it). Prefer AWCP_API_TOKEN or --api-token-file: a
    /// token on the command line is visible to every user in `ps`. Default: `serve` uses
    /// (and at first start writes, 0600) `<state-dir>/api-token`, and client commands of a
    /// daemon on this machine read that file (`$AWCP_STATE_DIR/api-token`, else the default
    /// state directory's).
    #[arg(long, global = true, env = "AWCP_API_TOKEN", hide_env_values = true)]
    api_token: Option<String>,
    /// Read the daemon API's token from this file instead (client commands and `serve`).
    #[arg(long, global = true, env = "AWCP_API_TOKEN_FILE")]
    api_token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the Delegator daemon (daemon API + awcpfs data plane).
    Serve(ServeArgs),
    /// Run the Executor service (AWCP v1 endpoint at /awcp).
    #[command(after_help = aecp::CHANNELS_HELP)]
    Executor(ExecutorArgs),
    /// Delegate a directory to an Executor.
    #[command(after_help = aecp::CHANNELS_HELP)]
    Delegate(DelegateArgs),
    /// AECP: knowledge and contract artifacts between the workers of a workspace
    /// (docs/AECP.md): publish/flag/lookup findings, declare/revise contracts, verify modules.
    #[command(after_help = aecp::CHANNELS_HELP)]
    Aecp {
        #[command(subcommand)]
        cmd: aecp::AecpCommand,
    },
    /// Show delegations: all (no id), one in detail, or several (a fleet: one line each
    /// and the totals).
    Status {
        /// Delegation ids (`dlg_…`); omit to list all.
        ids: Vec<String>,
    },
    /// Wait until every delegation named has ended, printing each end; the exit code is
    /// the worst end's (0 completed, 3 cancelled, 4 expired, 5 error; 1 past --timeout).
    Wait {
        /// Delegation ids (e.g. those a fleet `delegate --to A --to B` printed).
        #[arg(required = true)]
        ids: Vec<String>,
        /// Give up after this long (e.g. `30m`); default: wait as long as it takes.
        #[arg(long, value_parser = parse_duration)]
        timeout: Option<Duration>,
    },
    /// End a delegation's access now: the export refuses its token, the mount is fenced
    /// and unmounted.
    Revoke {
        /// Delegation id.
        id: String,
        /// Refuse even the final flush of files closed before the revoke.
        #[arg(long)]
        no_flush: bool,
        /// Wait (at most this long, e.g. `30s`; default 1m) until the Executor has finished
        /// its final sync and unmounted, showing what is written back.
        #[arg(long, num_args = 0..=1, default_missing_value = "1m", value_parser = parse_duration)]
        wait: Option<Duration>,
    },
    /// Extend a delegation's lease.
    Renew {
        /// Delegation id.
        id: String,
        /// New lease length from now, e.g. `30m`, `2h`, `90s`.
        #[arg(long, default_value = "30m", value_parser = parse_duration)]
        ttl: Duration,
    },
    /// Bring back the changes an Executor kept because it could not write them back before
    /// the lease ended (e.g. after `revoke --no-flush`), applying them with conflict checks.
    Collect {
        /// Delegation id.
        id: String,
        /// Drop the kept changes instead.
        #[arg(long)]
        discard: bool,
    },
    /// Client tokens kept hashed in the daemon's database: one credential that every daemon
    /// of a shared database accepts (create, list, delete).
    Token {
        #[command(subcommand)]
        cmd: tokens::TokenCommand,
    },
    /// Print a one-time link that opens the daemon's live view in a browser: delegations,
    /// leases, events as they come, what each Executor read and wrote back, conflicts, AECP
    /// findings and held write-backs, with revoke / renew / apply. The link works once,
    /// within 2 minutes, and leaves an HttpOnly session cookie (12 h) in that browser.
    Ui,
    /// Follow a delegation's events as they come, until it ends.
    Watch {
        /// Delegation id.
        id: String,
    },
    /// List Executors that announce themselves over AGLX (`executor --announce`): ask an
    /// aglx-bridge (--bridge aglx://host:port) and/or listen for announces (--listen).
    Peers(aglx::PeersArgs),
    /// Check this machine and the peers: FUSE device, mount privileges, kernel passthrough,
    /// the daemon (--daemon: every URL of a list, each reachable, taking the credential,
    /// which daemon it is, and whether they share one database) and any Executors given;
    /// prints a fix for each problem. Exit code 1 if something will make delegations fail.
    Doctor {
        /// An Executor's AWCP endpoint to check (repeatable).
        #[arg(long)]
        executor: Vec<String>,
        #[command(flatten)]
        cred: secrets::ExecutorCredentialArgs,
    },
    /// git's filesystem monitor hook for a workspace on an awcpfs mount (`core.fsmonitor`,
    /// protocol version 2): prints what changed since TOKEN. The Executor sets it in the
    /// agent's environment (GIT_CONFIG_COUNT/KEY/VALUE), so `git status` looks at changed
    /// paths only; the repository's config is never changed.
    Fsmonitor {
        /// The hook protocol version git asks in (2).
        #[arg(id = "hook_version", value_name = "VERSION")]
        version: String,
        /// The token of git's last question (empty or unknown: everything changed).
        #[arg(default_value = "")]
        token: String,
    },
    /// Print a shell completion script, e.g. `awcp-ctl completions bash >
    /// /etc/bash_completion.d/awcp-ctl`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Serve the MCP tools (delegate, delegate_output, delegate_cancel, … delegate_status) on
    /// stdin/stdout for an agent; they drive the daemon at --daemon. Logs go to stderr.
    ///
    /// Inside a task (AECP_SOCKET set, no --daemon or API token given) the aecp_* tools ask
    /// through the worker's own mount and act as that worker only: leave `worker` out;
    /// naming another worker is refused.
    Mcp,
    /// Run the next round of an idle multi-round delegation (`delegate --multi-round`), on
    /// the same workspace.
    Continue {
        /// Delegation id.
        id: String,
        /// What to do in this round.
        #[arg(long)]
        task: String,
        /// A longer prompt, if different from --task.
        #[arg(long)]
        prompt: Option<String>,
        /// Follow the round until the delegation is idle again or ends.
        #[arg(long)]
        wait: bool,
        /// Renew the lease for this round: its length from now, e.g. `30m` (bounded by the
        /// daemon's maximum). Without it the round has what is left of the lease.
        #[arg(long, value_parser = parse_duration)]
        ttl: Option<Duration>,
    },
    /// Fetch the result of a delegation whose event stream was lost (a daemon restart, a
    /// broken connection) from its Executor, apply it, and acknowledge it.
    Recover {
        /// Delegation id.
        id: String,
    },
    /// End an idle multi-round delegation: it completes.
    Close {
        /// Delegation id.
        id: String,
        /// Wait (at most this long, e.g. `30s`; default 1m) until the Executor has finished
        /// its final sync and unmounted, showing what is written back.
        #[arg(long, num_args = 0..=1, default_missing_value = "1m", value_parser = parse_duration)]
        wait: Option<Duration>,
    },
    /// List a delegation's snapshots: those an `archive` Executor sent back, or the change
    /// set an `awcpfs` export kept (snapshot mode `staged`).
    Snapshots {
        /// Delegation id.
        id: String,
    },
    /// Show what a kept snapshot changes (A added, M modified, D deleted, R renamed),
    /// relative to what was delegated; for an `awcpfs` change set, text files as unified
    /// diffs and other changes (binary, mode, symlink, directory) as one line each.
    Diff {
        /// Delegation id.
        id: String,
        /// Snapshot id; default the newest pending one.
        #[arg(long)]
        snapshot: Option<String>,
    },
    /// Apply a kept snapshot to the workspace, file by file: files changed on both sides
    /// stay as they are here, with the Executor's version kept beside them.
    Apply {
        /// Delegation id.
        id: String,
        /// Snapshot id; default the newest pending one.
        #[arg(long)]
        snapshot: Option<String>,
    },
    /// Drop a kept snapshot.
    Discard {
        /// Delegation id.
        id: String,
        /// Snapshot id; default the newest pending one.
        #[arg(long)]
        snapshot: Option<String>,
    },
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// Daemon API address (keep it on loopback: it hands out workspaces).
    #[arg(long, default_value = "127.0.0.1:3100")]
    listen: std::net::SocketAddr,
    /// awcpfs data-plane address (Executors must reach it).
    #[arg(long, default_value = "127.0.0.1:3101")]
    export_listen: std::net::SocketAddr,
    /// URL Executors use for the data plane, if not `http://<export-listen>`.
    #[arg(long)]
    export_url: Option<String>,
    /// State directory (SQLite database, upload staging); keep it outside the workspaces
    /// you delegate. Default: `$XDG_STATE_HOME/awcp/delegator` or
    /// `~/.local/state/awcp/delegator`.
    #[arg(long, env = "AWCP_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Keep delegations in PostgreSQL instead of `delegator.db` in the state directory:
    /// `postgres://user:password@host:port/database` (no TLS: keep the database on loopback
    /// or a private network). Several daemons given the same URL (each with its own
    /// --state-dir and addresses) all list every delegation, and when one dies another
    /// takes over its running delegations: lease expiry, the Executor's events, revoke.
    /// The schema is created and migrated at start. See docs/SCALING.md.
    #[arg(long, env = "AWCP_STATE", hide_env_values = true, value_name = "URL")]
    state: Option<String>,
    /// With --state postgres://…: a daemon whose heartbeat is this old is taken for dead,
    /// and a live daemon takes its running delegations over (daemons beat every fifth of
    /// it). Shorter fails over sooner, but a daemon stalled that long loses its delegations.
    #[arg(long, default_value = "15s", value_parser = parse_duration, requires = "state")]
    failover_after: Duration,
    /// UNSAFE: serve the daemon API without any credential. Any process that can connect
    /// to --listen (every user of this machine, on loopback) can then delegate any
    /// directory this daemon can read to an Executor of its choosing.
    #[arg(long, conflicts_with = "api_token")]
    unsafe_no_auth: bool,
    /// The Executor credential sent in INVITE's `auth` when a delegation request carries
    /// none (the reference's MCP server sends none): to whichever Executor a request names.
    #[command(flatten)]
    executor_cred: secrets::ExecutorCredentialArgs,
    /// Require the API token from every caller, the daemon's own user included. By default
    /// the daemon's user and root need none on this machine: the kernel names them (over
    /// the Unix socket by its peer credentials, over loopback TCP by sock_diag).
    #[arg(long, conflicts_with = "unsafe_no_auth")]
    always_require_token: bool,
    /// The daemon API's Unix socket (default `<state-dir>/api.sock`). It is open to every
    /// user: who may do what is decided per connection, by uid or token.
    #[arg(long, value_name = "PATH", conflicts_with = "no_api_socket")]
    api_socket: Option<PathBuf>,
    /// Serve the daemon API on TCP only, with no Unix socket.
    #[arg(long)]
    no_api_socket: bool,
    /// Longest lease granted (and longest single renewal).
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    max_ttl: Duration,
    /// Longest a lease may live in all, renewals included.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    max_lease: Duration,
    #[command(flatten)]
    aglx: aglx::NotifyArgs,
    /// Close an idle multi-round session after this long without `continue`.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    idle_timeout: Duration,
    /// Run a delegation whose request does not say `multiRound` (every reference client:
    /// its MCP server's `delegate`, its `DelegatorDaemonClient`) as a multi-round session,
    /// as the reference's multi-round daemon does: it goes `idle` after each round, so the
    /// reference MCP's `delegate_continue` and `delegate_close` work, and is closed after
    /// --idle-timeout. Without it such a delegation completes after one round (what the
    /// reference's released `main` expects: its `delegate` waits for `completed`).
    #[arg(long)]
    reference_rounds: bool,
    /// Do not watch delegated directories: running `awcpfs` mounts then keep showing each
    /// directory as it was when it was delegated (changes made here meanwhile still win
    /// over the Executor's, as conflicts, at write-back).
    #[arg(long)]
    no_watch: bool,
    /// AECP: let witnesses run on this machine, in the named sandbox (only `netns`: a new
    /// network namespace, which needs root). Without it they run only on the worker's
    /// Executor, in its mount.
    #[arg(long, value_parser = ["netns"])]
    aecp_local_witness: Option<String>,
    /// AECP: while a worker is stale on a revised contract (it depends on the module and
    /// has not run `awcp-ctl aecp ack` for the newest revision), hold its write-backs of
    /// Python files that import that module: they stay on its mount, are reported in its
    /// `.aecp/violations`, and are written back as soon as it acknowledges. Off by
    /// default: a stale consumer is only told about the revision.
    #[arg(long)]
    aecp_hold_stale: bool,
    /// `awcpfs` delegations: largest workspace (all files delegated).
    #[arg(long, default_value = "1024G", value_parser = parse_size)]
    awcpfs_max_bytes: u64,
    /// `awcpfs` delegations: most files.
    #[arg(long, default_value_t = 10_000_000)]
    awcpfs_max_files: u64,
    /// `awcpfs` delegations: largest single file.
    #[arg(long, default_value = "1024G", value_parser = parse_size)]
    awcpfs_max_file_bytes: u64,
    /// `archive` delegations: largest workspace (all files), e.g. `100M`, `2G`.
    #[arg(long, default_value = "100M", value_parser = parse_size)]
    archive_max_bytes: u64,
    /// `archive` delegations: most files.
    #[arg(long, default_value_t = 10_000)]
    archive_max_files: u64,
    /// `archive` delegations: largest single file.
    #[arg(long, default_value = "50M", value_parser = parse_size)]
    archive_max_file_bytes: u64,
    /// The transport of a delegation that names none (the reference's MCP server and
    /// client never do): `auto` asks the Executor's `/awcp/status` (the first it serves of
    /// `awcpfs`, `archive`, `storage`, and `git` given a --git-remote; a reference
    /// Executor lists none and gets `archive`; `auto` never picks `sshfs`, which must be
    /// named, here or by `delegate --transport`).
    #[arg(long, value_enum, default_value = "auto")]
    default_transport: DefaultTransport,
    /// `git` delegations: the remote the workspace is pushed to when `delegate` names none
    /// (--git-remote there): an `https://…`, `ssh://…`, `git://…` or `user@host:path` URL
    /// that the daemon's `git` can push to and the Executor can reach (Executors refuse
    /// local paths).
    #[arg(long, value_name = "URL")]
    git_remote: Option<String>,
    /// `git` delegations: a file holding an HTTPS token for the remote (given to git
    /// through a credential helper in its environment, never on a command line, and sent
    /// to the Executor in the handle's `auth`, as the reference does: use a token scoped
    /// to that repository). Without it git's own credential helper is asked and the
    /// handle carries no `auth` (the Executor uses its own credentials).
    #[arg(long, value_name = "FILE")]
    git_token_file: Option<PathBuf>,
    /// `sshfs` delegations (the daemon must run as root): the sshd binary run once per
    /// delegation, chrooted to it and SFTP-only (default /usr/sbin/sshd, else sshd on PATH).
    #[arg(long, value_name = "PATH")]
    sshd: Option<PathBuf>,
    /// `sshfs` delegations: the address each delegation's sshd listens on (a free port is
    /// picked per delegation). Executors on other machines need a reachable address.
    #[arg(long, value_name = "IP", default_value = "127.0.0.1")]
    sshfs_listen: std::net::IpAddr,
    /// `sshfs` delegations: the host name Executors are told to connect to (default the
    /// --sshfs-listen address).
    #[arg(long, value_name = "HOST")]
    sshfs_host: Option<String>,
    /// `sshfs` delegations: the user the Executor logs in as, hence the owner of the files
    /// it writes (default the owner of the delegated directory). Not a locked account.
    #[arg(long, value_name = "NAME")]
    sshfs_user: Option<String>,
    /// `sshfs` delegations: where each delegation's chroot is built; every component of
    /// the path must be root-owned and writable by no one else (sshd's rule).
    #[arg(long, value_name = "DIR", default_value = "/run/awcp-sshfs")]
    sshfs_chroot_dir: PathBuf,
    /// Sensitive-file globs that refuse an `archive` delegation (repeatable); replaces the
    /// default list (`.env`, `.env.*`, `*.pem`, `*.key`, `id_rsa`, `credentials.json`, …).
    /// `--sensitive ''` turns the check off.
    #[arg(long)]
    sensitive: Vec<String>,
    /// Block tier: keep every delegated block, once, in an S3-compatible object store
    /// (AWS S3, MinIO, Garage, Ceph RGW, s3s-fs) at `s3://bucket/prefix`, and let Executors
    /// fetch content from there through short-lived presigned URLs instead of from this
    /// process (and write new blocks back through it, verified here before use). Endpoint,
    /// region and credentials come from the usual AWS variables:
    /// AWS_ENDPOINT_URL (a non-AWS store), AWS_REGION, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ALLOW_HTTP=true (an http:// endpoint),
    /// web identity; what they leave unset, from the AWS shared files of profile
    /// AWS_PROFILE (else default), as the AWS CLI reads them: aws_access_key_id,
    /// aws_secret_access_key, aws_session_token of ~/.aws/credentials
    /// (AWS_SHARED_CREDENTIALS_FILE), region and endpoint_url of ~/.aws/config
    /// (AWS_CONFIG_FILE); last, container or instance credentials. Keys come as a group
    /// from one place. The Executors never get these keys. See docs/SCALING.md, "Block
    /// tier".
    #[arg(long, value_name = "s3://BUCKET/PREFIX")]
    blocks: Option<String>,
    /// Block tier: how long a presigned URL stays valid. Never longer than the lease's
    /// flush grace (10 s), so a revoke ends access to the store within the grace.
    #[arg(long, default_value = "10s", value_parser = parse_duration, requires = "blocks")]
    blocks_url_ttl: Duration,
    /// Block tier: the longest one call to the store may take (its retries included), and
    /// the longest a mount's `/locate` waits for the store. A store that does not answer
    /// within it counts as failing; after 3 failures in a row the daemon stops using it
    /// (no URLs, the data plane serves every block) and probes it again after 2 s, then
    /// 4 s, … up to 60 s. Keep it well under the Executors' `--read-timeout`.
    #[arg(long, default_value = "5s", value_parser = parse_duration, requires = "blocks")]
    blocks_timeout: Duration,
}

#[derive(Debug, Args)]
struct ExecutorArgs {
    /// The agent: a shell command run in the mounted workspace. It sees
    /// AWCP_DELEGATION_ID, AWCP_TASK_DESCRIPTION, AWCP_TASK_PROMPT and AWCP_WORKSPACE.
    /// One of --agent-cmd, --agent-a2a and --agent-http is required.
    #[arg(long, required_unless_present_any = ["agent_a2a", "agent_http"],
          conflicts_with_all = ["agent_a2a", "agent_http"])]
    agent_cmd: Option<String>,
    /// Hand each task to an A2A agent instead (A2A 0.3 over JSON-RPC): its base URL, where
    /// its card is found at /.well-known/agent-card.json (or the older agent.json), or the
    /// card's URL. It gets the prompt and an [AWCP Context] text part naming the workspace
    /// on this machine, so it must see this machine's files; its status updates become
    /// progress events, `completed` becomes done, any other final state an error. See
    /// docs/PROTOCOL.md, "Agents behind adapters".
    #[arg(long, value_name = "URL", conflicts_with = "agent_http")]
    agent_a2a: Option<String>,
    /// Hand each task to a plain HTTP agent instead: the task is POSTed to URL as JSON, the
    /// agent answers with progress/done/error updates (NDJSON or SSE stream, or JSON to
    /// poll). The shape is in docs/PROTOCOL.md, "Agents behind adapters".
    #[arg(long, value_name = "URL")]
    agent_http: Option<String>,
    /// Run an INVITE that does not say `multiRound` (every reference Delegator) as a
    /// multi-round session, as the reference's multi-round branch does: each round ends
    /// with `round_done` and the workspace stays for CONTINUE until CLOSE, so a reference
    /// Delegator's `continue` works. Without it such a task ends with `done` (what the
    /// reference's released `main` Delegator waits for; it ignores `round_done`).
    #[arg(long)]
    reference_rounds: bool,
    /// With --reference-rounds: close a session that stays idle this long (with `done`),
    /// longer than the reference Delegator's own 5-minute idle close.
    #[arg(long, default_value = "10m", value_parser = parse_duration, requires = "reference_rounds")]
    idle_timeout: Duration,
    /// Bound on each round of an --agent-a2a or --agent-http agent (e.g. `30m`); past it
    /// the task ends in error and the remote task is abandoned. The lease bounds it anyway.
    #[arg(long, value_parser = parse_duration)]
    agent_timeout: Option<Duration>,
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:7200")]
    listen: std::net::SocketAddr,
    /// Base directory: workspaces are mounted under `<dir>/work/<delegationId>`. Default:
    /// `/var/lib/awcp/executor` for root (its agents' user must reach the work directory),
    /// else `$XDG_STATE_HOME/awcp/executor` or `~/.local/state/awcp/executor`.
    #[arg(long, env = "AWCP_EXECUTOR_DIR")]
    dir: Option<PathBuf>,
    /// Longest lease accepted.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    max_ttl: Duration,
    /// Most delegations at once.
    #[arg(long, default_value_t = 8)]
    max_concurrent: usize,
    /// Keep fetched and written file content after unmount.
    #[arg(long)]
    keep_cache: bool,
    /// The block cache shared by all delegations, kept across leases and restarts so that
    /// the next delegation of the same repository starts warm. Default: `<dir>/cache`.
    #[arg(long, env = "AWCP_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// Bound on the block cache's disk use (least recently used blocks go first).
    #[arg(long, default_value = "4GiB", value_parser = parse_size)]
    cache_size: u64,
    /// No block cache: every block comes from the Delegator, and no content outlives a
    /// lease on this machine.
    #[arg(long, conflicts_with = "cache_dir")]
    no_block_cache: bool,
    /// Serve read-only opens with FUSE passthrough: native read speed, but a revocation
    /// cannot stop reads on files opened before it.
    #[arg(long)]
    passthrough: bool,
    /// What each mount fetches before it is read. `none`: nothing (every byte crosses the
    /// network only when read). `first`: the files first commands read (git's index,
    /// HEAD, config, refs, pack indexes, .gitignore files) at once, a small file's small
    /// neighbours with it, large files block by block as read. `all[:SIZE]`: that, then
    /// every file up to SIZE (default 256K) in the background, and large files streamed
    /// whole from their first read. The agent's reads always go first. Default: `all` for
    /// a Delegator on this machine, `first` for one across a network. Progress shows in
    /// `awcp-ctl status`.
    #[arg(long, value_name = "none|first|all[:SIZE]")]
    hydrate: Option<awcpfs::mount::hydrate::HydratePolicy>,
    /// Have each mount ask at every open and close of an existing file (two round trips
    /// per file): a file is then written back when its last writer closes it, and a
    /// Delegator-side change never replaces a file open for writing. By default the kernel
    /// opens files itself and a file is written back once no write touched it for 50 ms.
    /// Implied by --passthrough.
    #[arg(long)]
    track_opens: bool,
    /// Have each mount let the kernel cache writes and send them in batches (the FUSE
    /// writeback cache): builds that write many small pieces stop paying a round trip per
    /// write (close and fsync still hand the data to the mount before they return, a file
    /// kept open is written back within about a second, a revocation writes back what the
    /// kernel holds within the flush grace), but every `stat` of a file closed since costs
    /// a round trip, so rereading files is slower: off by default, chosen by the
    /// agent-session replay (docs/BENCHMARKS.md). Under the cache a full disk fails the
    /// fsync or close rather than the write. Ignored with --passthrough.
    #[arg(long, conflicts_with = "no_writeback_cache")]
    writeback_cache: bool,
    /// Whose new files each mount's kernel writes to the local copy directly, with FUSE
    /// passthrough and no round trip per write: `toolchain` (the default: compilers,
    /// assemblers and linkers — gcc's cc1, as, ld, collect2, clang, lld, mold, Go's
    /// compile and link), `off`, or process names separated by commas. While such a file
    /// is open every other open of it fails with EIO, which a build's outputs never meet.
    /// Ignored with --track-opens, --passthrough and --writeback-cache.
    #[arg(long, value_name = "toolchain|off|NAMES", default_value = "toolchain")]
    passthrough_writes: awcpfs::mount::PassthroughWriters,
    /// How FUSE requests reach each mount. `auto`: over io_uring where the kernel offers
    /// it (Linux 6.14+ with /sys/module/fuse/parameters/enable_uring set to Y; never set
    /// by awcp-ctl), otherwise over /dev/fuse. `uring`: io_uring or the mount fails.
    /// `dev`: always /dev/fuse. `awcp-ctl doctor` shows which a running mount uses.
    #[arg(long, value_enum, default_value_t = awcpfs::mount::FuseTransport::Auto)]
    fuse_transport: awcpfs::mount::FuseTransport,
    /// Leave git's filesystem monitor off for agents (by default their environment makes
    /// `awcp-ctl fsmonitor` git's `core.fsmonitor` hook, with the untracked cache, so `git
    /// status` on the mount looks only at what changed; the repository's config is never
    /// touched).
    #[arg(long)]
    no_git_fsmonitor: bool,
    /// The default (every write reaches the mount as it is made); accepted for older
    /// scripts.
    #[arg(long, hide = true)]
    no_writeback_cache: bool,
    /// Renew each lease with the Delegator when less than this is left (e.g. `30s`), up to
    /// the Delegator's --max-lease. Without it, a lease ends when its TTL runs out unless
    /// the Delegator renews it.
    #[arg(long, value_parser = parse_duration)]
    renew_margin: Option<Duration>,
    /// A read on a mount that needs the Delegator's network fails with EIO after this long
    /// when the export does not answer (e.g. `10s`); also the bound on each data-plane
    /// request.
    #[arg(long, value_parser = parse_read_timeout, default_value = "30s")]
    read_timeout: Duration,
    #[command(flatten)]
    aglx: aglx::AnnounceArgs,
    /// Transports offered (INVITEs asking for another get DEP_MISSING). Default:
    /// awcpfs,archive,storage,git, and sshfs where the `sshfs` command is installed.
    #[arg(long, value_enum, value_delimiter = ',')]
    transports: Option<Vec<Transport>>,
    /// Access modes accepted (INVITEs asking for another are DECLINED).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "ro,rw")]
    modes: Vec<Mode>,
    /// Largest request body, e.g. `512M`: only a START for a delegation this Executor
    /// accepted, while it awaits START (an `archive` START carries the whole workspace), one
    /// at a time; every other body is held to 1 MiB (413).
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    max_body: u64,
    /// The credential Delegators must present (INVITE's `auth`; AUTH_FAILED otherwise).
    /// Default: the one in `<dir>/state/executor-token`, drawn (0600) at first start —
    /// hand that file's content to your Delegators. A value here is visible in `ps` to
    /// every user: prefer --token-file or the environment variable.
    #[arg(long, env = "AWCP_EXECUTOR_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Read the credential Delegators must present from this file.
    #[arg(long, env = "AWCP_EXECUTOR_TOKEN_FILE", conflicts_with = "token")]
    token_file: Option<PathBuf>,
    /// UNSAFE: accept INVITEs from anyone who can reach --listen, with no credential.
    /// Anyone may then run code on this machine as the agent's user. Only for a machine
    /// and network where every user and peer is trusted.
    #[arg(long, conflicts_with_all = ["token", "token_file"])]
    unsafe_open: bool,
    /// An accepted INVITE whose START has not come after this long expires: its slot is
    /// freed (it shows in `GET /awcp/status` with the credential until then).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pending_timeout: Duration,
    /// With --unsafe-open: most INVITEs waiting for START from one peer address (all
    /// peers together: half of --max-concurrent), so one caller cannot take every slot.
    #[arg(long, default_value_t = 2)]
    max_pending_per_peer: usize,
    /// Who may use the mounted workspaces. `path` (default): every process that gets
    /// through the Executor's 0700 work directory — the Executor's user, --agent-user, and
    /// the agent's own processes that switch user inside (a test suite dropping to
    /// `nobody`) — served by the files' modes, like a local directory; if the work
    /// directory is opened to others, only the Executor's user. `owner`: only the
    /// Executor's user, always (only where agents run as the Executor's user). `all`:
    /// every user who can reach a mount (FUSE allow_other; a 0644 file, `.git` included,
    /// is then readable by all who get there — the work directory itself stays 0700).
    #[arg(long, value_enum, default_value_t = awcpfs::mount::MountAccess::Path)]
    mount_access: awcpfs::mount::MountAccess,
    /// The same as `--mount-access all`.
    #[arg(long, hide = true, conflicts_with = "mount_access")]
    allow_other: bool,
    /// Run the agent as this non-root user (name or uid): the mounts' files are its own,
    /// and it alone (besides root) can enter the work directory. Default, for an Executor
    /// running as root: `awcp-agent`, a system user created on first start (`useradd
    /// --system`); an Executor not running as root runs agents as itself.
    #[arg(long, value_name = "USER", conflicts_with = "unsafe_agent_as_root")]
    agent_user: Option<String>,
    /// Run the agent as root, like the Executor (UNSAFE: whoever delegates runs code as
    /// root; the agent stays under Landlock unless --unsafe-agent-unconfined).
    #[arg(long)]
    unsafe_agent_as_root: bool,
    /// Run agents without Landlock (UNSAFE: they can read and write whatever their user
    /// can). Needed only on kernels without Landlock, where the Executor otherwise
    /// refuses to start.
    #[arg(long)]
    unsafe_agent_unconfined: bool,
    /// Let agents also read (and execute) below PATH (repeatable): by default they read
    /// only the system's directories (/usr, /etc, /opt, /proc, …), their workspace and
    /// their own TMPDIR and HOME.
    #[arg(long, value_name = "PATH")]
    agent_allow_read: Vec<PathBuf>,
    /// Let agents also write below PATH (repeatable): by default they write only in their
    /// workspace and their own TMPDIR and HOME.
    #[arg(long, value_name = "PATH")]
    agent_allow_write: Vec<PathBuf>,
    /// Run every agent with no network (its own network namespace, no TCP), whatever the
    /// Delegator asks.
    #[arg(long)]
    agent_no_network: bool,
}

/// An agent URL must be http(s): said at start rather than at the first delegation.
fn check_agent_url(flag: &str, url: String) -> anyhow::Result<String> {
    anyhow::ensure!(
        url.starts_with("http://") || url.starts_with("https://"),
        "{flag} {url:?}: give the agent's http:// or https:// URL"
    );
    Ok(url)
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    Ro,
    Rw,
}

#[derive(Debug, Args)]
struct DelegateArgs {
    /// The directory to delegate.
    dir: PathBuf,
    /// The Executor's AWCP endpoint, e.g. `http://127.0.0.1:7200/awcp`, or `auto`: the
    /// freest Executor announced over AGLX (needs --peers-bridge or --peers-listen).
    /// Repeatable: `--to A --to B` delegates the workspace to each (a fleet: one delegation
    /// per Executor, their ids printed; `status ID ID …` and `wait ID ID …` show them all).
    #[arg(long, required_unless_present = "to_file")]
    to: Vec<String>,
    /// Also delegate to each Executor listed in this file: one AWCP URL a line, blank lines
    /// and `#` comments ignored.
    #[arg(long, value_name = "FILE")]
    to_file: Option<PathBuf>,
    /// Lease length, e.g. `10m`, `2h`.
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    ttl: Duration,
    /// Access mode.
    #[arg(long, value_enum, default_value = "rw")]
    mode: Mode,
    /// What to do (becomes the task's description and prompt).
    #[arg(long)]
    task: String,
    /// A longer prompt, if different from --task.
    #[arg(long)]
    prompt: Option<String>,
    /// Resource name on the Executor.
    #[arg(long, default_value = "workspace")]
    name: String,
    /// Also delegate another directory in the same delegation, as `NAME=DIR`, optionally
    /// `NAME=DIR:ro` (repeatable). With several resources the Executor mounts each at
    /// `<workDir>/<NAME>` and runs the agent in `<workDir>`; a `ro` one refuses writes.
    /// --include/--exclude/--gitignore apply to every resource.
    #[arg(long = "resource", value_name = "NAME=DIR[:ro|rw]", value_parser = parse_resource)]
    resources: Vec<(String, PathBuf, Option<Mode>)>,
    /// Follow the delegation until it ends; the exit code says how it ended.
    #[arg(long)]
    wait: bool,
    #[command(flatten)]
    auto: aglx::AutoArgs,
    /// How the workspace travels: `awcpfs` (live mount, ours), `archive` (one zip in
    /// START; limited in size), `storage` (a zip behind a download URL on the daemon's
    /// data plane, the result uploaded back), `git` (pushed to a branch of
    /// --git-remote, the result fetched from the Executor's branch) or `sshfs` (the
    /// Executor mounts the directory from a chrooted, SFTP-only sshd of the daemon with a
    /// certificate valid for the lease, and writes into it live; the daemon runs as root;
    /// snapshot mode `auto` only). Default: the
    /// daemon's choice (`serve --default-transport`; unless set there, what the Executor
    /// serves, `awcpfs` preferred).
    #[arg(long, value_enum)]
    transport: Option<Transport>,
    /// With `--transport git`: the remote to push the workspace to (default: the daemon's
    /// `serve --git-remote`).
    #[arg(long, value_name = "URL")]
    git_remote: Option<String>,
    /// What to do with the result the Executor sends back (any transport): apply it at
    /// once (`auto`), keep it until `apply`/`discard` (`staged`), or drop it (`discard`).
    /// Applying merges file by file: a file changed on both sides keeps both versions.
    #[arg(long, value_enum, default_value = "auto")]
    snapshot_mode: SnapshotModeArg,
    /// Only files matching these globs are delegated (`src/**`, `*.py`; repeatable); the
    /// others are invisible on the Executor.
    #[arg(long)]
    include: Vec<String>,
    /// Files matching these globs are never delegated (`target`, `*.log`; repeatable):
    /// invisible on the mount, refused by the export.
    #[arg(long)]
    exclude: Vec<String>,
    /// Also leave out what the directory's `.gitignore` lists.
    #[arg(long)]
    gitignore: bool,
    /// Delegate files matching this glob although they match a sensitive pattern (a
    /// public key in a vendored dependency, say; repeatable). The sensitive-file refusal
    /// names the exact globs.
    #[arg(long, value_name = "GLOB")]
    allow_sensitive: Vec<String>,
    /// A multi-round session: after the task the delegation waits, idle, with the
    /// workspace still mounted, for `awcp-ctl continue <id> --task …` or `awcp-ctl close`.
    #[arg(long)]
    multi_round: bool,
    /// The Executor's credential, sent in INVITE's `auth`. Default: the daemon's own
    /// (`serve --executor-token-file`), else, for an Executor on this machine, its
    /// `executor-token` file if this user can read it.
    #[command(flatten)]
    cred: secrets::ExecutorCredentialArgs,
    /// Run the agent with no network (INVITE's `requirements.sandboxProfile
    /// .allowNetwork: false`): an Executor of ours gives it a network namespace of its own
    /// and no TCP at all; one that cannot declines the delegation.
    #[arg(long)]
    no_network: bool,
    /// AECP: the modules this worker owns, as workspace-relative globs (`pkg/**`,
    /// `pkg/acct.py`; repeatable). Findings about related modules are forwarded to owners.
    /// Default: it owns the files it writes back.
    #[arg(long, value_name = "GLOB")]
    owns: Vec<String>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Transport {
    Awcpfs,
    Archive,
    Storage,
    Git,
    Sshfs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DefaultTransport {
    Auto,
    Awcpfs,
    Archive,
    Storage,
    Git,
    Sshfs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum SnapshotModeArg {
    Auto,
    Staged,
    Discard,
}

/// `$XDG_STATE_HOME/awcp/<what>`, else `~/.local/state/awcp/<what>`, else `./.awcp/<what>`.
fn default_state_dir(what: &str) -> PathBuf {
    // The XDG spec: an empty or relative XDG_STATE_HOME is to be ignored.
    let base = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute())
                .map(|h| h.join(".local/state"))
        });
    match base {
        Some(b) => b.join("awcp").join(what),
        None => PathBuf::from(".awcp").join(what),
    }
}

/// The Executor's base directory: for root `/var/lib/awcp/executor` (its agents run as
/// another user, who must reach the work directory: not under root's 0700 home), else
/// [`default_state_dir`]`("executor")`.
fn default_executor_dir() -> PathBuf {
    if nix::unistd::geteuid().is_root() {
        PathBuf::from(awcp_ctl::executor::ROOT_DEFAULT_DIR)
    } else {
        default_state_dir("executor")
    }
}

/// The token in `path` (trimmed); an error says which file could not be read.
fn read_token_file(path: &std::path::Path) -> anyhow::Result<String> {
    let t = std::fs::read_to_string(path)
        .with_context(|| format!("reading the API token file {}", path.display()))?;
    let t = t.trim();
    anyhow::ensure!(
        !t.is_empty(),
        "the API token file {} is empty",
        path.display()
    );
    Ok(t.to_string())
}

/// The Unix socket of the daemon on this machine (`$AWCP_STATE_DIR/api.sock`, else the
/// default state directory's), when `--daemon` was left at its default and the socket
/// takes connections. Over it the kernel names our uid, so the daemon's user needs no
/// token. An explicit `--daemon` URL is always honoured as given.
fn local_daemon_socket(daemon_is_default: bool) -> Option<PathBuf> {
    if !daemon_is_default {
        return None;
    }
    let dir = std::env::var_os("AWCP_STATE_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| default_state_dir("delegator"));
    let path = dir.join(awcp_ctl::daemon::API_SOCKET_FILE);
    // A socket left by a daemon that is gone refuses: then TCP, as without one.
    std::os::unix::net::UnixStream::connect(&path).ok()?;
    Some(path)
}

/// Secrets given as command-line arguments (visible to every user in `ps`), by flag: a
/// warning each. Their env and file twins are not.
fn secrets_in_argv(m: &clap::ArgMatches) -> Vec<(&'static str, &'static str)> {
    use clap::parser::ValueSource;
    let on_cli = |m: &clap::ArgMatches, id: &str| {
        m.try_get_raw(id).ok().flatten().is_some()
            && m.value_source(id) == Some(ValueSource::CommandLine)
    };
    let mut out = Vec::new();
    if on_cli(m, "api_token")
        || m.subcommand()
            .is_some_and(|(_, sub)| on_cli(sub, "api_token"))
    {
        out.push(("--api-token", "--api-token-file PATH or AWCP_API_TOKEN"));
    }
    if let Some(("serve", sub)) = m.subcommand()
        && on_cli(sub, "state")
        && sub
            .get_one::<String>("state")
            .and_then(|u| reqwest::Url::parse(u).ok())
            .is_some_and(|u| u.password().is_some())
    {
        out.push(("--state (its password)", "AWCP_STATE"));
    }
    out
}

/// The token a daemon on this machine wrote at its first start
/// (`$AWCP_STATE_DIR/api-token`, else the default state directory's), when `--daemon`
/// is a loopback URL and the file is readable by us (it is 0600: only the daemon's user
/// can). A remote daemon's token is never guessed from a local file.
fn local_daemon_token(daemon_url: &str) -> Option<String> {
    let url = reqwest::Url::parse(daemon_url).ok()?;
    if url.path().starts_with(awcp_ctl::daemon::api::TOKEN_PREFIX) {
        return None; // the URL carries its token
    }
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']');
    let local = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !local {
        return None;
    }
    let dir = std::env::var_os("AWCP_STATE_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| default_state_dir("delegator"));
    let t = std::fs::read_to_string(dir.join(awcp_ctl::daemon::API_TOKEN_FILE)).ok()?;
    Some(t.trim().to_string()).filter(|t| !t.is_empty())
}

/// `512`, `100K`, `100M`, `2G`, `4GiB` (powers of 1024): the one size parser.
use awcpfs::cache::parse_size;

fn mode_of(m: Mode) -> AccessMode {
    match m {
        Mode::Ro => AccessMode::Ro,
        Mode::Rw => AccessMode::Rw,
    }
}

fn transport_of(t: Transport) -> TransportType {
    match t {
        Transport::Awcpfs => TransportType::Awcpfs,
        Transport::Archive => TransportType::Archive,
        Transport::Storage => TransportType::Storage,
        Transport::Git => TransportType::Git,
        Transport::Sshfs => TransportType::Sshfs,
    }
}

/// `NAME=DIR`, `NAME=DIR:ro` or `NAME=DIR:rw` (`--resource`).
fn parse_resource(s: &str) -> Result<(String, PathBuf, Option<Mode>), String> {
    let (name, rest) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: write NAME=DIR, e.g. data=../datasets:ro"))?;
    let (dir, mode) = match rest.rsplit_once(':') {
        Some((d, "ro")) => (d, Some(Mode::Ro)),
        Some((d, "rw")) => (d, Some(Mode::Rw)),
        _ => (rest, None),
    };
    if name.is_empty() || dir.is_empty() {
        return Err(format!(
            "`{s}`: both NAME and DIR are needed (NAME=DIR[:ro|rw])"
        ));
    }
    Ok((name.to_string(), PathBuf::from(dir), mode))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .unwrap_or((s, "s"));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration; use e.g. 90s, 10m, 2h"))?;
    let mult = match unit {
        "s" | "" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("unknown unit in `{s}`; use s, m, h or d")),
    };
    Ok(Duration::from_secs(n * mult))
}

/// `--read-timeout`: a duration of at least a second (a zero bound would fail every read).
fn parse_read_timeout(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err("the read timeout must be at least 1s".into()),
        d => Ok(d),
    }
}

/// Exit code for how a delegation ended.
fn exit_for(state: DelegationState) -> ExitCode {
    match state {
        DelegationState::Completed => ExitCode::SUCCESS,
        DelegationState::Cancelled => ExitCode::from(3),
        DelegationState::Expired => ExitCode::from(4),
        _ => ExitCode::from(5),
    }
}

pub fn main() -> ExitCode {
    use clap::{CommandFactory as _, FromArgMatches as _};
    // Run by git on every `git status`: answered before the argument parser is built.
    if let Some((version, token)) = awcpfs::fsmonitor::hook_args() {
        return awcp_ctl::executor::fsmonitor_hook(&version, &token);
    }
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let Command::Fsmonitor { version, token } = &cli.command {
        // Run by git on every `git status`: no runtime, no logging set-up.
        return awcp_ctl::executor::fsmonitor_hook(version, token);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AWCP_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,awcp_ctl=info,awcpfs=info,fuser=error")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    for (flag, instead) in secrets_in_argv(&matches) {
        tracing::warn!(
            "{flag} was given on the command line, where every user of this machine can read \
             it (ps); use {instead} instead"
        );
    }
    let daemon_is_default =
        matches.value_source("daemon") == Some(clap::parser::ValueSource::DefaultValue);
    awcpfs::raise_fd_limit();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let json = cli.json;
    match rt.block_on(run(cli, daemon_is_default)) {
        Ok(code) => code,
        Err(e) => {
            if json {
                // Scripts reading stdout get the failure as a JSON line too.
                println!("{}", serde_json::json!({ "error": format!("{e:#}") }));
            }
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli, daemon_is_default: bool) -> anyhow::Result<ExitCode> {
    let explicit_token = match (&cli.api_token, &cli.api_token_file) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(f)) => Some(read_token_file(f)?),
        (None, None) => None,
    };
    let client_token = explicit_token
        .clone()
        .or_else(|| local_daemon_token(&cli.daemon));
    let mut client = DaemonClient::new(&cli.daemon).with_token(client_token.clone());
    if !matches!(cli.command, Command::Serve(_))
        && let Some(sock) = local_daemon_socket(daemon_is_default)
    {
        client = client.with_unix_socket(&sock);
    }
    // Inside a task: `aecp` commands ask as this worker through its mount, unless a daemon
    // URL or an API token was given (the owner's credential, which may act as any worker).
    // `mcp`'s AECP tools likewise.
    let worker_socket = (daemon_is_default && explicit_token.is_none())
        .then(|| std::env::var_os("AECP_SOCKET").filter(|s| !s.is_empty()))
        .flatten()
        .map(std::path::PathBuf::from);
    if matches!(cli.command, Command::Aecp { .. })
        && let Some(sock) = &worker_socket
    {
        client = client.with_worker_socket(sock);
    }
    match cli.command {
        Command::Serve(a) => {
            let mut cfg = DaemonConfig::new(
                a.state_dir
                    .unwrap_or_else(|| default_state_dir("delegator")),
            );
            cfg.listen = a.listen;
            cfg.export_listen = a.export_listen;
            cfg.export_url = a.export_url;
            cfg.max_ttl = a.max_ttl;
            cfg.max_lease = a.max_lease;
            cfg.aglx = a.aglx.config()?;
            cfg.api_token = explicit_token.clone();
            cfg.unsafe_no_auth = a.unsafe_no_auth;
            cfg.executor_token = a.executor_cred.resolve()?;
            cfg.trust_local_uid = !a.always_require_token;
            cfg.api_socket = a.api_socket;
            cfg.no_api_socket = a.no_api_socket;
            cfg.idle_timeout = a.idle_timeout;
            cfg.reference_rounds = a.reference_rounds;
            cfg.watch = !a.no_watch;
            cfg.default_transport = match a.default_transport {
                DefaultTransport::Auto => None,
                DefaultTransport::Awcpfs => Some(TransportType::Awcpfs),
                DefaultTransport::Archive => Some(TransportType::Archive),
                DefaultTransport::Storage => Some(TransportType::Storage),
                DefaultTransport::Git => Some(TransportType::Git),
                DefaultTransport::Sshfs => Some(TransportType::Sshfs),
            };
            cfg.git_remote = a.git_remote;
            cfg.git_token_file = a.git_token_file;
            cfg.sshfs = awcp_ctl::daemon::SshfsConfig {
                sshd: a.sshd,
                listen: a.sshfs_listen,
                host: a.sshfs_host,
                user: a.sshfs_user,
                chroot_base: a.sshfs_chroot_dir,
            };
            cfg.aecp_local_witness = a.aecp_local_witness;
            cfg.state = a.state;
            cfg.failover_after = a.failover_after;
            cfg.aecp_hold_stale = a.aecp_hold_stale;
            cfg.awcpfs_limits = awcp_ctl::archive::ScanLimits {
                max_total_bytes: a.awcpfs_max_bytes,
                max_files: a.awcpfs_max_files,
                max_file_bytes: a.awcpfs_max_file_bytes,
            };
            cfg.archive_limits = awcp_ctl::archive::ScanLimits {
                max_total_bytes: a.archive_max_bytes,
                max_files: a.archive_max_files,
                max_file_bytes: a.archive_max_file_bytes,
            };
            if !a.sensitive.is_empty() {
                cfg.sensitive = a.sensitive.into_iter().filter(|s| !s.is_empty()).collect();
            }
            cfg.blocks = a.blocks.map(|url| awcpfs::export::tier::BlockTierConfig {
                url,
                url_ttl: a.blocks_url_ttl,
                options: Vec::new(),
                call_timeout: a.blocks_timeout,
            });
            let running = awcp_ctl::daemon::start(cfg).await?;
            if cli.json {
                println!(
                    "{}",
                    serde_json::json!({"service": "daemon", "api": running.url(),
                        "dataPlane": running.daemon.export_url()})
                );
            } else {
                eprintln!(
                    "awcp-ctl serve: daemon API on {}, data plane on {} (Ctrl-C stops)",
                    running.url(),
                    running.daemon.export_url()
                );
            }
            tokio::signal::ctrl_c().await?;
            running.stop().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Executor(a) => {
            hot_arena();
            let base = a.dir.unwrap_or_else(default_executor_dir);
            let mut cfg = ExecutorConfig::new(a.agent_cmd.unwrap_or_default(), base.clone());
            cfg.remote_agent = match (a.agent_a2a, a.agent_http) {
                (Some(u), _) => Some(awcp_ctl::executor::RemoteAgent::A2a(check_agent_url(
                    "--agent-a2a",
                    u,
                )?)),
                (None, Some(u)) => Some(awcp_ctl::executor::RemoteAgent::Http(check_agent_url(
                    "--agent-http",
                    u,
                )?)),
                (None, None) => None,
            };
            cfg.agent_timeout = a.agent_timeout;
            cfg.reference_rounds = a.reference_rounds;
            cfg.idle_timeout = a.idle_timeout;
            cfg.block_cache = (!a.no_block_cache).then(|| {
                let mut c = awcpfs::cache::CacheConfig::new(Some(
                    a.cache_dir.unwrap_or_else(|| base.join("cache")),
                ));
                c.disk_bytes = a.cache_size;
                c
            });
            cfg.listen = a.listen;
            cfg.max_ttl = a.max_ttl;
            cfg.max_concurrent = a.max_concurrent;
            cfg.keep_cache = a.keep_cache;
            cfg.passthrough = a.passthrough;
            cfg.hydrate = a.hydrate;
            cfg.track_opens = a.track_opens;
            cfg.writeback_cache = a.writeback_cache;
            cfg.passthrough_writes = a.passthrough_writes.clone();
            cfg.fuse_transport = a.fuse_transport;
            cfg.git_fsmonitor = !a.no_git_fsmonitor;
            cfg.renew_margin = a.renew_margin;
            cfg.read_timeout = a.read_timeout;
            if let Some(t) = a.transports {
                cfg.transports = t.into_iter().map(transport_of).collect();
            }
            cfg.access_modes = a.modes.into_iter().map(mode_of).collect();
            cfg.max_body_bytes = usize::try_from(a.max_body).unwrap_or(usize::MAX);
            cfg.token = secrets::resolve(
                a.token.as_deref(),
                a.token_file.as_deref(),
                "--token",
                "--token-file",
            )?;
            cfg.unsafe_open = a.unsafe_open;
            cfg.pending_timeout = a.pending_timeout;
            cfg.max_pending_per_peer = a.max_pending_per_peer.max(1);
            cfg.mount_access = if a.allow_other {
                awcpfs::mount::MountAccess::All
            } else {
                a.mount_access
            };
            cfg.agent_user = a
                .agent_user
                .as_deref()
                .map(awcp_ctl::executor::AgentUser::lookup_or_create)
                .transpose()?;
            cfg.unsafe_agent_as_root = a.unsafe_agent_as_root;
            cfg.unsafe_agent_unconfined = a.unsafe_agent_unconfined;
            cfg.agent_allow_read = a.agent_allow_read;
            cfg.agent_allow_write = a.agent_allow_write;
            cfg.agent_no_network = a.agent_no_network;
            let announce = a.aglx.config()?;
            let running = awcp_ctl::executor::start(cfg).await?;
            let announcing = match &announce {
                Some(ac) => Some(awcp_ctl::aglx::announce_executor(&running, ac).await?),
                None => None,
            };
            if let Some(ac) = &announce {
                eprintln!(
                    "awcp-ctl executor: announced as {} to {:?}",
                    ac.me, ac.targets
                );
            }
            if cli.json {
                println!(
                    "{}",
                    serde_json::json!({"service": "executor", "awcp": running.awcp_url()})
                );
            } else {
                eprintln!(
                    "awcp-ctl executor: AWCP endpoint {} (Ctrl-C stops)",
                    running.awcp_url()
                );
            }
            tokio::signal::ctrl_c().await?;
            if let Some((announcer, refresher)) = announcing {
                refresher.abort();
                drop(announcer);
            }
            running.stop().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Aecp { cmd } => aecp::run(cmd, cli.json, &client).await,
        Command::Delegate(a) => {
            let dir = std::path::absolute(&a.dir)
                .with_context(|| format!("resolving {}", a.dir.display()))?;
            let mode = mode_of(a.mode);
            let executors = fleet::executors(&a.to, a.to_file.as_deref())?;
            let to = a.auto.resolve(&executors[0], a.ttl).await?;
            let mut resources = vec![(a.name, dir.clone(), mode)];
            for (name, rdir, rmode) in a.resources {
                let rdir = std::path::absolute(&rdir)
                    .with_context(|| format!("resolving {}", rdir.display()))?;
                resources.push((name, rdir, rmode.map_or(mode, mode_of)));
            }
            let req = DelegateRequest {
                executor_url: to.clone(),
                environment: EnvironmentSpec {
                    resources: resources
                        .into_iter()
                        .map(|(name, dir, mode)| ResourceSpec {
                            name,
                            resource_type: ResourceType::Fs,
                            source: dir.display().to_string(),
                            mode,
                            include: (!a.include.is_empty()).then(|| a.include.clone()),
                            exclude: (!a.exclude.is_empty()).then(|| a.exclude.clone()),
                            gitignore: a.gitignore.then_some(true),
                            allow_sensitive: (!a.allow_sensitive.is_empty())
                                .then(|| a.allow_sensitive.clone()),
                        })
                        .collect(),
                },
                task: TaskSpec {
                    description: a.task.clone(),
                    prompt: a.prompt.unwrap_or(a.task),
                },
                ttl_seconds: Some(a.ttl.as_secs()),
                access_mode: Some(mode),
                snapshot_mode: Some(match a.snapshot_mode {
                    SnapshotModeArg::Auto => SnapshotMode::Auto,
                    SnapshotModeArg::Staged => SnapshotMode::Staged,
                    SnapshotModeArg::Discard => SnapshotMode::Discard,
                }),
                auth: a
                    .cred
                    .resolve()?
                    .or_else(|| secrets::local_executor(&to, default_state_dir("executor")))
                    .map(|t| AuthCredential {
                        auth_type: AuthType::Bearer,
                        credential: t,
                        metadata: None,
                    }),
                transport: a.transport.map(transport_of),
                multi_round: a.multi_round.then_some(true),
                git_remote: a.git_remote.clone(),
                no_network: a.no_network.then_some(true),
            };
            if executors.len() > 1 {
                // A fleet: the same request to each Executor, with its own credential.
                let cred = a.cred.resolve()?;
                let reqs = executors
                    .iter()
                    .map(|e| {
                        let mut r = req.clone();
                        r.executor_url = e.clone();
                        r.auth = cred
                            .clone()
                            .or_else(|| secrets::local_executor(e, default_state_dir("executor")))
                            .map(|t| AuthCredential {
                                auth_type: AuthType::Bearer,
                                credential: t,
                                metadata: None,
                            });
                        r
                    })
                    .collect();
                let (ids, failed) = fleet::delegate_all(&client, reqs, &dir, cli.json).await;
                if !a.owns.is_empty() {
                    for id in &ids {
                        client
                            .aecp_owners(id, &a.owns)
                            .await
                            .with_context(|| format!("recording --owns for {id}"))?;
                    }
                }
                anyhow::ensure!(
                    !ids.is_empty(),
                    "every Executor refused the delegation (see above)"
                );
                if failed > 0 {
                    eprintln!(
                        "{failed} of {} Executor(s) refused; the {} delegation(s) above run                          (`awcp-ctl revoke ID` ends one)",
                        executors.len(),
                        ids.len()
                    );
                }
                let code = if a.wait {
                    fleet::wait(&client, &ids, cli.json, None).await?
                } else {
                    ExitCode::SUCCESS
                };
                return Ok(if failed > 0 { ExitCode::from(1) } else { code });
            }
            // The daemon answers after admission, the manifests (or the zip), INVITE and
            // START: on a large tree that takes a while, so show how far it has got.
            let resp = if bars::wanted(cli.json) {
                let key = format!("{:032x}", rand::random::<u128>());
                let bar = bars::setup(&client, key.clone(), dir.display().to_string());
                let resp = client.delegate_with_progress(&req, &key).await;
                bar.finish();
                resp
            } else {
                client.delegate(&req).await
            };
            let resp = resp?;
            let id = resp.delegation_id.as_str().to_string();
            if !a.owns.is_empty() {
                client
                    .aecp_owners(&id, &a.owns)
                    .await
                    .context("recording --owns")?;
            }
            if cli.json {
                println!("{}", serde_json::json!({"delegationId": id}));
            } else {
                println!("delegated {} to {} as {id}", dir.display(), to);
            }
            if !a.wait {
                return Ok(ExitCode::SUCCESS);
            }
            // Only a multi-round session stops at its first idle state: a single-round one
            // may pass through `idle` (an Executor that always works in rounds), and the
            // daemon closes it at once, so follow it to its end.
            let idle_at = if a.multi_round { 1 } else { usize::MAX };
            follow(&client, &id, cli.json, idle_at).await
        }
        Command::Status { ids } if ids.len() > 1 => fleet::status(&client, &ids, cli.json).await,
        Command::Wait { ids, timeout } => fleet::wait(&client, &ids, cli.json, timeout).await,
        Command::Status { ids } if ids.len() == 1 => {
            let id = &ids[0];
            let v = client.get(id).await?;
            if cli.json {
                println!("{}", serde_json::to_string(&v)?);
            } else {
                let r = &v.record;
                println!("delegation  {}", r.id.as_str());
                println!("state       {}", r.state.as_str());
                println!("executor    {}", r.peer_url);
                println!("transport   {}", v.transport);
                if let Some(n) = r.current_round.filter(|_| {
                    r.rounds.as_ref().is_some_and(|x| x.len() > 1)
                        || r.state == DelegationState::Idle
                }) {
                    println!(
                        "round       {n}{}",
                        if r.state == DelegationState::Idle {
                            " (idle: `awcp-ctl continue` or `awcp-ctl close`)"
                        } else {
                            ""
                        }
                    );
                }
                if let Some(snaps) = r.snapshots.as_ref().filter(|s| !s.is_empty()) {
                    let pending = snaps
                        .iter()
                        .filter(|s| s.status == awcp_protocol::api::SnapshotStatus::Pending)
                        .count();
                    println!(
                        "snapshots   {} ({pending} pending: `awcp-ctl diff|apply|discard`)",
                        snaps.len()
                    );
                }
                if r.environment.resources.len() > 1 {
                    // Several resources: each mounted as <workDir>/<name> on the executor.
                    for (i, res) in r.environment.resources.iter().enumerate() {
                        let mode = if r.lease_config.access_mode == AccessMode::Ro {
                            AccessMode::Ro
                        } else {
                            res.mode
                        };
                        println!(
                            "{}{} = {} ({})",
                            if i == 0 {
                                "resources   "
                            } else {
                                "            "
                            },
                            res.name,
                            res.source,
                            mode.as_str()
                        );
                    }
                } else if let Some(p) = &r.export_path {
                    println!("workspace   {p} ({})", r.lease_config.access_mode.as_str());
                }
                println!("task        {}", r.task.description);
                println!(
                    "lease       {}, until {} ({}s left, {} renewal(s))",
                    format!("{:?}", v.lease.state).to_lowercase(),
                    v.lease.expires_at,
                    v.lease.remaining_ms / 1000,
                    v.lease.renewals
                );
                if let Some(owner) = &v.owner {
                    // A shared database (`serve --state`): which daemon runs it.
                    println!("daemon      {owner}");
                }
                if let Some(t) = &v.transfer {
                    let n = |k: &str| t.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                    println!(
                        "transfer    {} bytes served, {} file(s) written back ({} bytes), {} commit(s), {} conflict(s)",
                        n("bytesServed"),
                        n("filesWritten"),
                        n("bytesWritten"),
                        n("commits"),
                        n("conflicts")
                    );
                }
                if let Some(m) = &v.executor_mount {
                    let s = &m["stats"];
                    let n = |k: &str| s.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                    let ops: u64 = s
                        .get("ops")
                        .and_then(|o| o.as_object())
                        .map(|o| o.values().filter_map(|v| v.as_u64()).sum())
                        .unwrap_or(0);
                    println!(
                        "mount       {} on the executor: {} FUSE request(s), {} bytes fetched, {} open file(s), {} passthrough open(s), {} sync error(s)",
                        m["state"].as_str().unwrap_or("?"),
                        ops,
                        n("bytesFetched"),
                        m["openHandles"].as_u64().unwrap_or(0),
                        n("passthroughOpens"),
                        n("syncErrors")
                    );
                    if m["unsynced"].as_bool() == Some(true) {
                        // Never "all synced" while write-back fails: say so, and why.
                        println!(
                            "sync        NOT SYNCED: {} (the Executor keeps the changes and retries; see TROUBLESHOOTING.md)",
                            m["syncError"]
                                .as_str()
                                .or_else(|| s["lastSyncError"].as_str())
                                .unwrap_or("write-back is failing")
                        );
                    }
                    if let Some(h) = m.get("hydration").filter(|h| h["policy"].is_string()) {
                        let n = |k: &str| h.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                        println!(
                            "hydration   {}: {} of {} file(s) ({} of {} bytes) fetched ahead, {} file(s) ({} bytes) to go{}; yielded to the agent {} time(s)",
                            h["policy"].as_str().unwrap_or("?"),
                            n("filesDone"),
                            n("filesPlanned"),
                            n("bytesDone"),
                            n("bytesPlanned"),
                            n("filesRemaining"),
                            n("bytesRemaining"),
                            if h["finished"].as_bool() == Some(true) {
                                ", finished"
                            } else {
                                ""
                            },
                            n("yielded")
                        );
                    }
                    println!(
                        "cache       {} block(s) from the block cache ({} bytes), {} fetched from the Delegator; {} file(s) in the pack ({} bytes)",
                        n("cacheHits"),
                        n("bytesFromCache"),
                        n("cacheMisses"),
                        n("filesPacked"),
                        n("bytesPacked")
                    );
                }
                if let Some(res) = &r.result {
                    println!("result      {}", res.summary);
                }
                if let Some(e) = &r.error {
                    println!("error       {}: {}", e.code.as_str(), e.message);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { .. } => {
            let list = client.list().await?;
            if cli.json {
                for d in &list.delegations {
                    println!("{}", serde_json::to_string(d)?);
                }
            } else if list.delegations.is_empty() {
                println!("no delegations (start one with `awcp-ctl delegate`)");
            } else {
                println!("{:<37} {:<10} {:<25} WORKSPACE", "ID", "STATE", "CREATED");
                for d in &list.delegations {
                    let res = &d.environment.resources;
                    let ws = match res.as_slice() {
                        [] => String::new(),
                        [one] => one.source.clone(),
                        [first, rest @ ..] => format!("{} (+{} more)", first.source, rest.len()),
                    };
                    println!(
                        "{:<37} {:<10} {:<25} {ws}",
                        d.id.as_str(),
                        d.state.as_str(),
                        d.created_at
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Revoke { id, no_flush, wait } => {
            client.revoke(&id, no_flush).await?;
            let synced = match wait {
                Some(limit) => Some(wait_final_sync(&client, &id, cli.json, limit).await?),
                None => None,
            };
            if cli.json {
                let mut out = serde_json::json!({"ok": true, "delegationId": id});
                if let Some(s) = synced {
                    out["finalSync"] = s;
                }
                println!("{out}");
            } else if let Some(s) = synced {
                println!(
                    "revoked {id}: access has ended; {} file(s) written back in all{}",
                    s["filesWritten"],
                    if s["ended"] == true {
                        ""
                    } else {
                        " (the executor has not confirmed its unmount yet)"
                    }
                );
            } else {
                println!("revoked {id}: the export refuses its token; the executor is unmounting");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Renew { id, ttl } => {
            let r = client.renew(&id, ttl.as_secs()).await?;
            if cli.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("renewed {id}: lease now expires {}", r.expires_at);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Collect { id, discard } => {
            let r = client.collect(&id, discard).await?;
            if cli.json {
                println!("{}", serde_json::to_string(&r)?);
            } else if r.discarded {
                println!("discarded the changes the executor kept for {id}");
            } else {
                println!(
                    "collected {id}: {} change(s) applied, {} conflict(s)",
                    r.applied,
                    r.conflicts.len()
                );
                for c in &r.conflicts {
                    println!(
                        "  conflict at {}: {} (kept as {})",
                        c.path,
                        c.reason,
                        c.kept_as.as_deref().unwrap_or("-")
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Token { cmd } => tokens::run(cmd, cli.json, &client).await,
        Command::Ui => {
            let (url, ttl) = client.ui_login_link().await?;
            if cli.json {
                println!(
                    "{}",
                    serde_json::json!({"url": url, "expiresInSeconds": ttl})
                );
            } else {
                println!("{url}");
                eprintln!(
                    "open this link in a browser within {ttl} s; it works once (run `awcp-ctl ui` \
                     again for another browser). Anyone who opens it first gets the session: do \
                     not paste it where others read."
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Watch { id } => follow(&client, &id, cli.json, usize::MAX).await,
        Command::Continue {
            id,
            task,
            prompt,
            wait,
            ttl,
        } => {
            let spec = TaskSpec {
                description: task.clone(),
                prompt: prompt.unwrap_or(task),
            };
            let r = client
                .continue_round(&id, &spec, ttl.map(|t| t.as_secs()))
                .await?;
            let round = r.round.unwrap_or(0);
            if cli.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("round {round} of {id} started");
            }
            if !wait {
                return Ok(ExitCode::SUCCESS);
            }
            follow(&client, &id, cli.json, round as usize).await
        }
        Command::Doctor { executor, cred } => {
            let executor_token = cred.resolve()?;
            use awcp_ctl::doctor::{self, Status};
            let mut checks = doctor::local();
            checks.extend(doctor::daemons(&cli.daemon, client_token.as_deref()).await);
            let daemon_state = std::env::var_os("AWCP_STATE_DIR")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| default_state_dir("delegator"));
            let executor_dir = std::env::var_os("AWCP_EXECUTOR_DIR")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(default_executor_dir);
            checks.push(doctor::file_modes(&daemon_state, &executor_dir));
            checks.push(doctor::fuse_transport(&executor_dir));
            checks.extend(doctor::agent_sandbox(&doctor::processes()));
            checks.push(doctor::mount_access(
                &std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
                doctor::mount_gate,
            ));
            for e in &executor {
                let token = executor_token
                    .clone()
                    .or_else(|| secrets::local_executor(e, default_state_dir("executor")));
                checks.push(doctor::executor(e, token.as_deref()).await);
            }
            for c in &checks {
                if cli.json {
                    println!("{}", serde_json::to_string(c)?);
                } else {
                    let tag = match c.status {
                        Status::Ok => "ok  ",
                        Status::Warn => "warn",
                        Status::Fail => "FAIL",
                    };
                    println!("{tag}  {:<20} {}", c.check, c.detail);
                    if let Some(f) = &c.fix {
                        println!("      {:<20} fix: {f}", "");
                    }
                }
            }
            Ok(if checks.iter().any(|c| c.status == Status::Fail) {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
        Command::Fsmonitor { version, token } => {
            Ok(awcp_ctl::executor::fsmonitor_hook(&version, &token))
        }
        Command::Completions { shell } => {
            use clap::CommandFactory;
            // Into a buffer first: the generator panics on a closed pipe (`| head`).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "awcp-ctl", &mut script);
            use std::io::Write as _;
            let _ = std::io::stdout().write_all(&script);
            Ok(ExitCode::SUCCESS)
        }
        Command::Mcp => {
            awcp_ctl::mcp::serve(client, worker_socket.as_deref()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Recover { id } => {
            let r = client.recover(&id).await?;
            if cli.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "recovered {id}: now {}{}",
                    r.state.as_str(),
                    if r.snapshot {
                        "; its snapshot was handled per the snapshot mode"
                    } else {
                        ""
                    }
                );
            }
            Ok(exit_for(r.state))
        }
        Command::Close { id, wait } => {
            client.close(&id).await?;
            let synced = match wait {
                Some(limit) => Some(wait_final_sync(&client, &id, cli.json, limit).await?),
                None => None,
            };
            if cli.json {
                let mut out = serde_json::json!({"ok": true, "delegationId": id});
                if let Some(s) = synced {
                    out["finalSync"] = s;
                }
                println!("{out}");
            } else {
                println!("closed {id}: the delegation is completed");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Snapshots { id } => {
            let list = client.snapshots(&id).await?;
            if cli.json {
                for s in &list.snapshots {
                    println!("{}", serde_json::to_string(s)?);
                }
            } else if list.snapshots.is_empty() {
                println!(
                    "{id} has no snapshots (in snapshot mode `auto`, changes are written back \
                     live or applied on arrival)"
                );
            } else {
                for s in &list.snapshots {
                    let n = s
                        .metadata
                        .as_ref()
                        .and_then(|m| m.changed_files.as_ref())
                        .map(Vec::len)
                        .unwrap_or(0);
                    println!(
                        "{}  {:<9} {} changed file(s)  {}",
                        s.id,
                        format!("{:?}", s.status).to_lowercase(),
                        n,
                        s.summary
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Diff { id, snapshot } => {
            let sid = client.pick_snapshot(&id, snapshot).await?;
            let d = client.diff(&id, &sid).await?;
            for f in &d.files {
                if cli.json {
                    println!("{}", serde_json::to_string(f)?);
                } else {
                    let c = match f.change {
                        awcp_ctl::archive::Change::Added => 'A',
                        awcp_ctl::archive::Change::Modified => 'M',
                        awcp_ctl::archive::Change::Deleted => 'D',
                        awcp_ctl::archive::Change::Renamed => 'R',
                    };
                    match f.detail.as_deref().filter(|d| !d.is_empty()) {
                        Some(d) => println!("{c} {}  ({d})", f.path),
                        None => println!("{c} {}", f.path),
                    }
                    if let Some(p) = &f.patch {
                        print!("{p}");
                    }
                }
            }
            if !cli.json && d.files.is_empty() {
                println!("snapshot {sid} changes nothing");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Apply { id, snapshot } => {
            let sid = client.pick_snapshot(&id, snapshot).await?;
            let r = client.apply(&id, &sid).await?;
            if cli.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "applied {sid}: {} file(s) written, {} deleted, {} conflict(s)",
                    r.report.written.len(),
                    r.report.deleted.len(),
                    r.report.conflicts.len()
                );
                for c in &r.report.conflicts {
                    println!(
                        "  conflict at {}: {} (executor's version: {})",
                        c.path,
                        c.reason,
                        c.kept_as.as_deref().unwrap_or("not kept")
                    );
                }
                for h in &r.report.held {
                    println!(
                        "  held at {}: {} (still staged: `awcp-ctl snapshots {id}`)",
                        h.path, h.reason
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Discard { id, snapshot } => {
            let sid = client.pick_snapshot(&id, snapshot).await?;
            client.discard(&id, &sid).await?;
            if cli.json {
                println!("{}", serde_json::json!({"ok": true, "snapshotId": sid}));
            } else {
                println!("discarded {sid}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Peers(a) => {
            aglx::peers(a, cli.json).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Wait until the Executor has sent its last event for `id` (its final sync is over and
/// it has unmounted), at most `limit`; a bar on stderr meanwhile. Returns what was written
/// back: `{"ended": bool, "filesWritten": n, "bytesWritten": n}`.
async fn wait_final_sync(
    client: &DaemonClient,
    id: &str,
    json: bool,
    limit: Duration,
) -> anyhow::Result<serde_json::Value> {
    let bar = bars::wanted(json).then(|| bars::final_sync(client, id.to_string()));
    let start = std::time::Instant::now();
    let v = loop {
        let v = client.get(id).await?;
        let ended = v.progress.as_ref().is_some_and(|p| p.phase == "ended");
        if ended || start.elapsed() >= limit {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    };
    if let Some(b) = bar {
        b.finish();
    }
    let n = |k: &str| {
        v.transfer
            .as_ref()
            .and_then(|t| t.get(k))
            .and_then(|x| x.as_u64())
            .unwrap_or(0)
    };
    Ok(serde_json::json!({
        "ended": v.progress.as_ref().is_some_and(|p| p.phase == "ended"),
        "filesWritten": n("filesWritten"),
        "bytesWritten": n("bytesWritten"),
    }))
}

/// Follow a delegation until it ends, or until it is idle for the `idle_at`-th time (the
/// end of that round of a multi-round session).
async fn follow(
    client: &DaemonClient,
    id: &str,
    json: bool,
    idle_at: usize,
) -> anyhow::Result<ExitCode> {
    let mut idles = 0;
    // On a terminal, a bar on stderr: how much of the workspace the Executor has pulled
    // (hydration) and how many files came back (write-back).
    let bar = bars::wanted(json).then(|| bars::transfer(client, id.to_string()));
    let last = client
        .watch_until(
            id,
            |ev: &WatchEvent| {
                let print = || {
                    if json {
                        if let Ok(s) = serde_json::to_string(ev) {
                            println!("{s}");
                        }
                    } else {
                        println!("{}", ev.describe());
                    }
                };
                match &bar {
                    Some(b) => b.suspend(print),
                    None => print(),
                }
            },
            |ev| {
                if matches!(
                    ev,
                    WatchEvent::State {
                        state: DelegationState::Idle,
                        ..
                    }
                ) {
                    idles += 1;
                }
                ev.is_terminal() || idles >= idle_at
            },
        )
        .await;
    if let Some(b) = bar {
        b.finish();
    }
    let last = last?;
    match last {
        Some(WatchEvent::State {
            state: DelegationState::Idle,
            ..
        }) => {
            if !json {
                println!(
                    "{id} is idle: `awcp-ctl continue {id} --task …` runs the next round, \
                     `awcp-ctl close {id}` ends it"
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Some(WatchEvent::State { state, .. }) => {
            if !json {
                let v = client.get(id).await?;
                if let Some(t) = &v.transfer {
                    let n = |k: &str| t.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                    println!(
                        "{} bytes served, {} file(s) written back",
                        n("bytesServed"),
                        n("filesWritten")
                    );
                }
            }
            Ok(exit_for(state))
        }
        _ => {
            eprintln!(
                "the event stream ended before the delegation did; `awcp-ctl status {id}` shows where it stands"
            );
            Ok(ExitCode::from(1))
        }
    }
}

/// The mounts' inode tables in huge pages (`awcpfs::alloc`); without them they still work.
fn hot_arena() {
    if let Err(e) = awcpfs::alloc::enable() {
        tracing::debug!(error = %e, "inode tables stay on small pages");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(parse_duration("45").unwrap(), Duration::from_secs(45));
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("5y").is_err());
    }

    #[test]
    fn a_zero_read_timeout_is_refused() {
        assert_eq!(parse_read_timeout("10s").unwrap(), Duration::from_secs(10));
        let err = parse_read_timeout("0s").unwrap_err();
        assert!(err.contains("at least 1s"), "{err}");
    }

    #[test]
    fn resources() {
        let (n, d, m) = parse_resource("data=../sets:ro").unwrap();
        assert_eq!(
            (n.as_str(), d, matches!(m, Some(Mode::Ro))),
            ("data", PathBuf::from("../sets"), true)
        );
        let (_, d, m) = parse_resource("src=/a:b").unwrap();
        assert_eq!((d, m.is_none()), (PathBuf::from("/a:b"), true));
        assert!(parse_resource("nodir").is_err());
        assert!(parse_resource("=x").is_err());
        assert!(parse_resource("x=").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("100M").unwrap(), 100 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999G").is_err());
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
