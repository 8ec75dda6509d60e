//! `aglx-bridge`: the AGLX bridge daemon. Parses the command line into a [`BridgeConfig`]
//! and runs it; everything else lives in the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use aglx_bridge::security::{Keys, Policy};
use aglx_bridge::{AgentUri, Bridge, BridgeConfig, Limits};
use anyhow::{Context, bail};
use clap::Parser;

/// AGLX bridge: agents connect over TCP (or TLS), say `handshake`, and exchange frames
/// (task.assign, task.result, status.report, credit.transfer, …); the bridge forwards each frame
/// to the subscribers it is addressed to and answers every frame with a STATUS. Executors
/// announce themselves over UDP (agent.announce) or TCP (registry.update) and land in a
/// registry with a TTL that anyone can list.
///
/// Examples:
///
///   aglx-bridge                                  # TCP and UDP on 127.0.0.1:7400
///
///   aglx-bridge --listen 0.0.0.0:7400 --udp 0.0.0.0:7400 \
///       --tls-cert cert.pem --tls-key key.pem --key-file lab.example=zone.key
///
/// A subscriber picks what it receives in its handshake body: {"subscribe":"own"} (frames whose
/// TO is its FROM, and broadcasts; the default), "all" (every frame: a monitor) or "none".
/// The framing, the registry and the signature scheme are in docs/PROTOCOL.md, section AGLX.
///
/// Logs go to stderr (filter: AWCP_LOG). Once listening, one line on stdout gives the bound
/// addresses: `aglx-bridge listening tcp=<addr> udp=<addr|off> tls=<on|off>`.
#[derive(Debug, Parser)]
#[command(name = "aglx-bridge", version, verbatim_doc_comment)]
struct Cli {
    /// TCP address to listen on (TLS too, when --tls-cert is given). Port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:7400", env = "AGLX_LISTEN")]
    listen: SocketAddr,

    /// UDP address for agent.announce datagrams.
    #[arg(long, default_value = "127.0.0.1:7400", env = "AGLX_UDP")]
    udp: SocketAddr,

    /// Do not listen on UDP.
    #[arg(long, conflicts_with = "udp")]
    no_udp: bool,

    /// The bridge's own agent address: FROM of its answers.
    #[arg(long, default_value = "agent://bridge.local")]
    name: String,

    /// Signature key of a trust zone, as ZONE=PATH (repeatable). The file holds the key
    /// (its bytes, a trailing newline dropped). ZONE is a domain (`lab.example` covers
    /// agent://x.lab.example) or `*` for every zone. With a key, frames from that zone that
    /// carry credits or task data must be signed.
    #[arg(long = "key-file", value_name = "ZONE=PATH")]
    key_files: Vec<String>,

    /// Require a signature on every frame from a zone that has a key, not only on credits and
    /// task data.
    #[arg(long)]
    require_signatures: bool,

    /// How far a signed frame's TIMESTAMP may be from this clock, in seconds.
    #[arg(long, default_value_t = 300)]
    replay_window: u64,

    /// PEM certificate chain: serve TLS instead of plain TCP (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,

    /// PEM private key for --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,

    /// Most concurrent TCP connections; more are answered with STATUS 500 and closed.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,

    /// Largest frame body accepted over TCP, in bytes.
    #[arg(long, default_value_t = 1024 * 1024)]
    max_body: usize,

    /// Seconds a frame may take from its first byte to its last (against slow senders).
    #[arg(long, default_value_t = 10)]
    frame_timeout: u64,

    /// Seconds a connection may stay silent between frames.
    #[arg(long, default_value_t = 300)]
    idle_timeout: u64,
}

fn config(cli: Cli) -> anyhow::Result<BridgeConfig> {
    let me: AgentUri = cli
        .name
        .parse()
        .with_context(|| format!("--name {:?}: use agent://name.domain", cli.name))?;
    let mut keys = Keys::new();
    for spec in &cli.key_files {
        let Some((zone, path)) = spec.split_once('=') else {
            bail!("--key-file {spec:?}: expected ZONE=PATH, e.g. lab.example=/etc/aglx/lab.key");
        };
        let mut key = std::fs::read(path).with_context(|| format!("reading key file {path}"))?;
        while key.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            key.pop();
        }
        if key.len() < 16 {
            bail!(
                "key file {path} holds {} bytes; use at least 16 random bytes (e.g. `head -c 32 /dev/urandom | base64 > {path}`)",
                key.len()
            );
        }
        keys.insert(zone, key);
    }
    let mut cfg = BridgeConfig::new(cli.listen, (!cli.no_udp).then_some(cli.udp));
    cfg.me = me;
    cfg.policy = Policy {
        keys,
        window_secs: cli.replay_window,
        require_all: cli.require_signatures,
        ..Policy::default()
    };
    cfg.limits = Limits {
        max_body: cli.max_body,
        ..Limits::TCP
    };
    cfg.max_connections = cli.max_connections;
    cfg.frame_timeout = Duration::from_secs(cli.frame_timeout.max(1));
    cfg.idle_timeout = Duration::from_secs(cli.idle_timeout.max(1));
    if let (Some(cert), Some(key)) = (&cli.tls_cert, &cli.tls_key) {
        let cert = aglx_bridge::tls::read_pem(cert)?;
        let key = aglx_bridge::tls::read_pem(key)?;
        cfg.tls = Some(aglx_bridge::tls::server_config(&cert, &key)?);
    }
    Ok(cfg)
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let cfg = config(cli)?;
    let tls = cfg.tls.is_some();
    let (tcp, udp) = (cfg.tcp, cfg.udp);
    let bridge = Bridge::start(cfg).await.with_context(|| {
        format!("cannot listen on {tcp} / {udp:?}: is another bridge running? choose another --listen/--udp")
    })?;
    println!(
        "aglx-bridge listening tcp={} udp={} tls={}",
        bridge.tcp_addr(),
        bridge
            .udp_addr()
            .map_or_else(|| "off".to_string(), |a| a.to_string()),
        if tls { "on" } else { "off" }
    );
    tokio::select! {
        _ = bridge.wait() => bail!("the bridge stopped unexpectedly"),
        _ = tokio::signal::ctrl_c() => {
            tracing::info!("interrupted, stopping");
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AWCP_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,aglx_bridge=info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aglx-bridge: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aglx-bridge: {e:#}");
            ExitCode::from(1)
        }
    }
}
