//! `awcpfs`: serve a directory (`export`) or mount one (`mount`), without the AWCP control
//! plane — for Executors that run their own control flow.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcp_protocol::TransportHandle;
use awcp_protocol::transport::AwcpfsHandle;
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::{Mount, MountAccess, MountConfig};

// Hundreds of thousands of small allocations per export and mount (the manifest's entries,
// the inode table): glibc's malloc and free were a fifth of the Executor's CPU samples over
// 100,000-file delegations. mimalloc, with a mount's inode table in huge pages.
#[global_allocator]
static GLOBAL: awcpfs::alloc::Alloc = awcpfs::alloc::Alloc;

/// Project a directory onto another machine with FUSE: lazy content, live write-back,
/// access bounded by a lease.
#[derive(Debug, Parser)]
#[command(name = "awcpfs", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve one directory and print its transport handle (JSON) on stdout.
    Export {
        /// The directory to serve.
        dir: PathBuf,
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:3101")]
        listen: std::net::SocketAddr,
        /// URL clients use, if not `http://<listen>`.
        #[arg(long)]
        url: Option<String>,
        /// Lease length in seconds; access ends after it.
        #[arg(long, default_value_t = 3600)]
        ttl_secs: u64,
        /// Refuse every change.
        #[arg(long)]
        ro: bool,
        /// Also write the handle to this file.
        #[arg(long)]
        handle_out: Option<PathBuf>,
        /// Scratch directory for uploaded blocks.
        #[arg(long, default_value = ".awcpfs-export")]
        state_dir: PathBuf,
        /// Hand the mounts of this export an AECP artifact index: FILE holds one index
        /// event per line (NDJSON: the `aecp` events `awcp-ctl serve` pushes, e.g.
        /// `{"type":"artifact","artifact":{…}}`; see docs/AECP.md). The mounts then deliver
        /// those findings at the point of use (`.aecp/inbox`, `user.aecp.findings`, the
        /// socket). For executors that run their own control flow, and for
        /// `scripts/bench.sh --only aecp`. Default: no index (AECP costs nothing).
        #[arg(long, value_name = "FILE")]
        aecp_events: Option<PathBuf>,
    },
    /// git's filesystem monitor hook (`core.fsmonitor`, protocol version 2): prints what
    /// changed on the awcpfs mount since TOKEN, so `git status` looks at those paths only.
    /// git runs it in the work tree; `awcpfs mount` prints the settings that enable it
    /// (environment variables: the repository's config is left alone).
    Fsmonitor {
        /// The hook protocol version git asks in (2).
        version: String,
        /// The token of git's last question (empty or unknown: everything changed).
        #[arg(default_value = "")]
        token: String,
    },
    /// Write back what a mount that crashed (or was killed) had journaled but not yet
    /// committed. Give the same handle and --state-dir the mount had.
    Recover {
        /// The mount's transport handle.
        handle: PathBuf,
        /// The mount's state directory (as given to `awcpfs mount`).
        #[arg(long, default_value = ".awcpfs-mount")]
        state_dir: PathBuf,
    },
    /// Mount the export a handle describes, until its lease ends or Ctrl-C.
    Mount {
        /// File holding the transport handle (`awcpfs export` prints it).
        handle: PathBuf,
        /// Empty directory to mount on.
        mountpoint: PathBuf,
        /// Where the journal and local file content live (a subdirectory per export).
        #[arg(long, default_value = ".awcpfs-mount")]
        state_dir: PathBuf,
        /// Mount read-only.
        #[arg(long)]
        ro: bool,
        /// Keep local file content after unmount.
        #[arg(long)]
        keep_cache: bool,
        /// Content-addressed block cache kept across mounts, so that mounting the same
        /// repository again starts warm (default: no cache).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
        /// Bound on the block cache's disk use.
        #[arg(long, default_value = "4GiB", value_parser = awcpfs::cache::parse_size)]
        cache_size: u64,
        /// Serve read-only opens with FUSE passthrough (the kernel reads the local copy
        /// directly): faster, but a revocation cannot stop reads on files opened before it.
        #[arg(long)]
        passthrough: bool,
        /// Ask awcpfs at every open and close of an existing file (two round trips per
        /// file; the default lets the kernel open files itself). A file then is written back
        /// when its last writer closes it, and a Delegator-side change never replaces a
        /// file open for writing; by default a file is written back once no write touched
        /// it for 50 ms. Implied by --passthrough.
        #[arg(long)]
        track_opens: bool,
        /// Let the kernel cache writes and send them to awcpfs in batches (the FUSE
        /// writeback cache): builds that write many small pieces, a linker or compileall,
        /// stop paying a round trip per write (close and fsync still hand the file's data
        /// to awcpfs before they return, a file kept open is written back within about a
        /// second, the end of the lease writes what the kernel holds back within the flush
        /// grace), but every `stat` of a file closed since costs a round trip, so rereading
        /// files is slower: off by default, chosen by the agent-session replay
        /// (docs/BENCHMARKS.md). Under the cache a full disk fails the fsync or close
        /// rather than the write. Ignored with --passthrough.
        #[arg(long, conflicts_with = "no_writeback_cache")]
        writeback_cache: bool,
        /// Whose new files the kernel writes to the local copy directly, with FUSE
        /// passthrough and no round trip per write: `toolchain` (the default: compilers,
        /// assemblers and linkers — gcc's cc1, as, ld, collect2, clang, lld, mold,
        /// Go's compile and link), `off`, or process names separated by commas (as `ps -o
        /// comm` shows them). While such a file is open, every other open of it fails with
        /// EIO (the kernel does not mix passthrough with the opens it makes itself), which
        /// a build's outputs never meet and a log read while it is written would. Ignored
        /// with --track-opens, --passthrough and --writeback-cache.
        #[arg(long, value_name = "toolchain|off|NAMES", default_value = "toolchain")]
        passthrough_writes: awcpfs::mount::PassthroughWriters,
        /// The default (every write reaches awcpfs as it is made); accepted for older
        /// scripts.
        #[arg(long, hide = true)]
        no_writeback_cache: bool,
        /// A read (or open) that needs the network fails with EIO after this many seconds
        /// when the export does not answer; also the bound on each data-plane request.
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
        read_timeout_secs: u64,
        /// Who may use the mount. `path` (default): like a local directory at the
        /// mountpoint — when a directory above it keeps other users out (0700, say), every
        /// process that gets in (a test suite that switches to `nobody` inside, `sudo -u`)
        /// is served by the files' modes; where the path is open to others, only you.
        /// `owner`: only you, always. `all`: every user who can reach the mountpoint, the
        /// files' modes deciding (FUSE allow_other).
        #[arg(long, value_enum, default_value_t = MountAccess::Path)]
        access: MountAccess,
        /// The same as `--access all`.
        #[arg(long, hide = true, conflicts_with = "access")]
        allow_other: bool,
        /// What to fetch before it is read. `none`: nothing — every byte crosses the
        /// network only when read (least traffic; each first read of a file costs a round
        /// trip). `first`: the files the first commands read (git's index, HEAD, config,
        /// refs, pack indexes, .gitignore files) right away; reads of a small file bring its
        /// small neighbours in the same request; a large file is fetched block by block as
        /// it is read. `all[:SIZE]`: like `first`, then every file up to SIZE (default
        /// 256K) in the background, and a large file is streamed whole from its first read
        /// (not a git pack: git reads a pack where its objects are).
        /// The agent's own reads always go before background fetches. Default: `all` when
        /// the export is on this machine (loopback), `first` otherwise (a metered or slow
        /// link carries what is used). Progress: `hydration` in status.json.
        #[arg(long, value_name = "none|first|all[:SIZE]")]
        hydrate: Option<awcpfs::mount::hydrate::HydratePolicy>,
        /// How FUSE requests reach awcpfs. `auto`: over io_uring where the kernel offers
        /// it (Linux 6.14+, run as root, with /sys/module/fuse/parameters/enable_uring set
        /// to Y — awcpfs never sets it), otherwise over /dev/fuse; the log says which.
        /// `uring`: io_uring or fail. `dev`: always /dev/fuse. io_uring answers a request
        /// in about a third of the time (docs/BENCHMARKS.md).
        #[arg(long, value_enum, default_value_t = awcpfs::mount::FuseTransport::Auto)]
        fuse_transport: awcpfs::mount::FuseTransport,
    },
}

fn main() -> ExitCode {
    // Run by git on every `git status`: answered before logging, the runtime or the
    // argument parser is set up.
    if let Some((version, token)) = awcpfs::fsmonitor::hook_args() {
        return awcpfs::fsmonitor::run_hook("awcpfs fsmonitor", &version, &token);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AWCP_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,awcpfs=info,fuser=error")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    awcpfs::raise_fd_limit();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Read an awcpfs transport handle (as `awcpfs export` prints it, or a bare one).
fn read_handle(path: &std::path::Path) -> anyhow::Result<AwcpfsHandle> {
    let bytes =
        std::fs::read(path).with_context(|| format!("reading the handle {}", path.display()))?;
    match awcp_protocol::parse_transport_handle(&bytes) {
        Ok(TransportHandle::Awcpfs(h)) if h.resources.as_ref().is_some_and(|r| r.len() > 1) => {
            anyhow::bail!(
                "{} holds {} resources; `awcpfs mount` mounts one export: keep one entry of \
                 `resources` (its exportId and manifestDigest at the top level) per handle file",
                path.display(),
                h.resources.as_ref().map_or(0, Vec::len)
            )
        }
        Ok(TransportHandle::Awcpfs(h)) => Ok(h),
        Ok(other) => anyhow::bail!(
            "{} holds a {} handle; awcpfs mounts only awcpfs handles",
            path.display(),
            other.transport_type().as_str()
        ),
        Err(e) => serde_json::from_slice::<AwcpfsHandle>(&bytes)
            .map_err(|_| anyhow::anyhow!("{} is not a transport handle: {e}", path.display())),
    }
}

/// `--aecp-events FILE`: one JSON object per line (blank lines skipped). What the events
/// mean is the mount's business (it ignores those it does not understand); here each line
/// must be a JSON object, and a bad one is refused with its line number.
fn read_aecp_events(path: &std::path::Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --aecp-events {}", path.display()))?;
    let mut events = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| {
            format!(
                "--aecp-events {} line {}: not JSON (write one index event per line)",
                path.display(),
                i + 1
            )
        })?;
        anyhow::ensure!(
            v.is_object(),
            "--aecp-events {} line {}: an index event is a JSON object",
            path.display(),
            i + 1
        );
        events.push(v);
    }
    Ok(events)
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Export {
            dir,
            listen,
            url,
            ttl_secs,
            ro,
            handle_out,
            state_dir,
            aecp_events,
        } => {
            let aecp_events = aecp_events.map(|p| read_aecp_events(&p)).transpose()?;
            let root = std::fs::canonicalize(&dir)
                .with_context(|| format!("{} is not a directory I can read", dir.display()))?;
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("binding {listen} (use --listen)"))?;
            let addr = listener.local_addr()?;
            std::fs::create_dir_all(&state_dir)
                .with_context(|| format!("creating --state-dir {}", state_dir.display()))?;
            // A restart with the same directory and state directory serves the same
            // delegation (id, token, lease end), so mounts resume and recovery works.
            let (identity, origin) = awcpfs::export::identity::load_or_create(
                &std::path::absolute(&state_dir)?,
                &root,
                Duration::from_secs(ttl_secs),
            )?;
            use awcpfs::export::identity::Origin;
            let ttl = match &origin {
                Origin::Resumed { remaining } => {
                    eprintln!(
                        "awcpfs: resuming export {} of {} (lease until {}; --ttl-secs applies to a new export only; \
                         move {} away to start a new one)",
                        identity.export_id,
                        root.display(),
                        identity.expires_at,
                        awcpfs::export::identity::identity_path(&state_dir, &root).display()
                    );
                    *remaining
                }
                Origin::Replaced { expired_at } => {
                    eprintln!(
                        "awcpfs: the earlier export of {} ended at {expired_at}; starting a new one (new id and token: \
                         mounts of the old handle cannot resume; `awcpfs recover` their state needs the old export)",
                        root.display()
                    );
                    Duration::from_secs(ttl_secs)
                }
                Origin::New => Duration::from_secs(ttl_secs),
            };
            let lease = Arc::new(Lease::grant(
                Arc::new(SystemClock::new()),
                LeaseTerms {
                    ttl,
                    max_ttl: ttl,
                    flush_grace: Duration::from_secs(10),
                },
            ));
            // A standalone export lives exactly --ttl-secs: renewals cannot extend it.
            lease.limit_renewals(ttl);
            awcpfs::private::create_dir_all(&state_dir)?;
            let registry = ExportRegistry::with_hash_cache(std::sync::Arc::new(
                awcpfs::export::hashcache::HashCache::open(&state_dir.join("hashes.bin")),
            ));
            let export_id = identity.export_id.clone();
            let token = identity.token.clone();
            let cfg = ExportConfig {
                root,
                read_only: ro,
                block_size: awcp_protocol::dataplane::DEFAULT_BLOCK_SIZE,
                staging_dir: std::path::absolute(&state_dir)?.join(&export_id),
            };
            let (r, id, tok, l) = (
                registry.clone(),
                export_id.clone(),
                token.clone(),
                lease.clone(),
            );
            let export = tokio::task::spawn_blocking(move || r.register(id, tok, cfg, l)).await??;
            if let Some(events) = aecp_events {
                eprintln!("awcpfs: {} AECP index events for the mounts", events.len());
                export.aecp().replace(events);
            }
            let handle = TransportHandle::Awcpfs(AwcpfsHandle {
                endpoint: url.unwrap_or_else(|| format!("http://{addr}")),
                token,
                export_id,
                manifest_digest: export.manifest_digest(),
                block_size: export.block_size(),
                expires_at: lease.expires_at_rfc3339(),
                tls_fingerprint: None,
                // A handle file may be used much later: only the wall-clock expiry is honest.
                remaining_ms: None,
                resources: None,
            });
            let json = serde_json::to_string_pretty(&handle)?;
            if let Some(p) = handle_out {
                // 0600: the handle holds the capability token, which opens the workspace.
                awcpfs::private::write(&p, json.as_bytes())
                    .with_context(|| format!("writing {}", p.display()))?;
            }
            println!("{json}");
            eprintln!(
                "awcpfs: serving {} ({} entries) on http://{addr}; Ctrl-C stops",
                dir.display(),
                export.manifest_entries().len()
            );
            axum::serve(
                // Small answers (a manifest, one small file's block) must not wait for a
                // delayed ACK (Nagle): up to 40 ms per request otherwise.
                axum::serve::ListenerExt::tap_io(listener, |s| {
                    let _ = s.set_nodelay(true);
                }),
                registry.router(),
            )
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Fsmonitor { version, token } => {
            let answer = awcpfs::fsmonitor::query(std::path::Path::new("."), &version, &token)
                .context("awcpfs fsmonitor")?;
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            out.write_all(&answer)?;
            out.flush()?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Recover { handle, state_dir } => {
            let h = read_handle(&handle)?;
            let state_dir = std::path::absolute(&state_dir)?.join(&h.export_id);
            let remote = Arc::new(awcpfs::mount::remote::HttpRemote::new(
                &h.endpoint,
                &h.export_id,
                &h.token,
                Duration::from_secs(30),
            ));
            let sd = state_dir.clone();
            let report =
                tokio::task::spawn_blocking(move || awcpfs::mount::recover::recover(&sd, remote))
                    .await??;
            eprintln!(
                "awcpfs: recovered {}: {} journal record(s), {} change(s) committed, {} file(s) written, {} conflict(s)",
                state_dir.display(),
                report.records,
                report.changes,
                report.files_written,
                report.conflicts.len()
            );
            for c in &report.conflicts {
                eprintln!(
                    "  conflict at {}: {} (kept as {})",
                    c.path,
                    c.reason,
                    c.kept_as.as_deref().unwrap_or("-")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Mount {
            handle,
            mountpoint,
            state_dir,
            ro,
            keep_cache,
            cache_dir,
            cache_size,
            passthrough,
            track_opens,
            writeback_cache,
            no_writeback_cache: _,
            passthrough_writes,
            read_timeout_secs,
            access,
            allow_other,
            hydrate,
            fuse_transport,
        } => {
            let h = read_handle(&handle)?;
            let state_dir = std::path::absolute(&state_dir)?.join(&h.export_id);
            let mut cfg =
                MountConfig::new(&h.endpoint, &h.export_id, &h.token, &mountpoint, &state_dir);
            cfg.manifest_digest = Some(h.manifest_digest.clone());
            cfg.expires_at = Some(h.expires_at.clone());
            cfg.read_only = ro;
            cfg.keep_cache = keep_cache;
            cfg.request_timeout = Duration::from_secs(read_timeout_secs);
            if let Some(dir) = cache_dir {
                let mut c = awcpfs::cache::CacheConfig::new(Some(dir));
                c.disk_bytes = cache_size;
                cfg.block_cache = Some(std::sync::Arc::new(awcpfs::cache::BlockCache::open(&c)?));
            }
            cfg.kernel.passthrough = passthrough;
            cfg.kernel.no_open = !track_opens;
            cfg.kernel.writeback_cache = writeback_cache;
            cfg.passthrough_writers = passthrough_writes;
            cfg.kernel.transport = fuse_transport;
            cfg.access = if allow_other {
                MountAccess::All
            } else {
                access
            };
            if let Some(policy) = hydrate {
                cfg.hydrate = policy;
            }
            let access_choice = cfg.access;
            // The inode table in huge pages (`awcpfs::alloc`); without them it still works.
            if let Err(e) = awcpfs::alloc::enable() {
                tracing::debug!(error = %e, "the inode table stays on small pages");
            }
            let mount = tokio::task::spawn_blocking(move || Mount::start(cfg)).await??;
            eprintln!(
                "awcpfs: mounted at {}; Ctrl-C unmounts (after writing changes back)\n\
                 awcpfs: access: {}\n\
                 awcpfs: FUSE transport: {}",
                mountpoint.display(),
                mount.access().describe(access_choice),
                mount.fuse_transport()
            );
            if let Ok(exe) = std::env::current_exe() {
                let hook = awcpfs::fsmonitor::hook_command(&exe, &["fsmonitor"]);
                eprintln!(
                    "awcpfs: `git status` in O(changes) for a repository on this mount (git's \
                     fsmonitor, without touching its config):\n  export {}",
                    awcpfs::fsmonitor::shell_setup(&hook)
                );
            }
            let m = mount.clone();
            let ended = tokio::task::spawn_blocking(move || {
                loop {
                    if let Some(r) = m.wait(Duration::from_secs(3600)) {
                        return r;
                    }
                }
            });
            tokio::select! {
                r = ended => eprintln!("awcpfs: access ended: {}", r?),
                _ = tokio::signal::ctrl_c() => {
                    let m = mount.clone();
                    tokio::task::spawn_blocking(move || m.finish()).await?;
                    eprintln!("awcpfs: unmounted");
                }
            }
            Ok(if mount.unsynced() {
                eprintln!(
                    "awcpfs: some changes could not be written back; they are kept in {}",
                    state_dir.display()
                );
                ExitCode::from(3)
            } else {
                ExitCode::SUCCESS
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::read_aecp_events;

    #[test]
    fn aecp_events_are_json_objects_one_a_line() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("events.ndjson");
        std::fs::write(
            &f,
            "{\"type\":\"forward\",\"id\":1}\n\n{\"type\":\"delivered\",\"id\":1,\"revision\":1}\n",
        )
        .unwrap();
        assert_eq!(read_aecp_events(&f).unwrap().len(), 2);
        std::fs::write(&f, "{\"type\":\"forward\",\"id\":1}\n[1]\n").unwrap();
        let e = format!("{:#}", read_aecp_events(&f).unwrap_err());
        assert!(e.contains("line 2"), "{e}");
        std::fs::write(&f, "{\"type\":\n").unwrap();
        let e = format!("{:#}", read_aecp_events(&f).unwrap_err());
        assert!(e.contains("line 1") && e.contains("not JSON"), "{e}");
        assert!(read_aecp_events(&dir.path().join("absent")).is_err());
    }
}
