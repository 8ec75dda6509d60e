//! The AGLX parts of the command line: `serve --notify …`, `executor --announce …`, and
//! `awcp-ctl peers`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use aglx_bridge::awcp::Pricing;
use aglx_bridge::{AgentUri, Endpoint};
use awcp_ctl::aglx::{AnnounceConfig, NotifyConfig, PeersQuery};

use super::parse_duration;

fn parse_agent(s: &str) -> Result<AgentUri, String> {
    s.parse()
        .map_err(|_| format!("`{s}` is not an agent address; use agent://name.domain"))
}

/// `[ZONE=]PATH`: a key file, for one zone (a domain such as `lab.example`) or every zone.
fn parse_zone_key(s: &str) -> Result<(Option<String>, PathBuf), String> {
    match s.split_once('=') {
        Some((zone, path)) if !zone.is_empty() && !path.is_empty() && !zone.contains('/') => {
            Ok((Some(zone.to_string()), PathBuf::from(path)))
        }
        _ if s.is_empty() => Err("give a key file: [ZONE=]PATH".into()),
        _ => Ok((None, PathBuf::from(s))),
    }
}

fn parse_endpoint(s: &str) -> Result<Endpoint, String> {
    s.parse()
        .map_err(|e: aglx_bridge::notify::BadEndpoint| e.to_string())
}

/// `awcp-ctl serve` options for AGLX notifications.
#[derive(Debug, Args)]
pub(super) struct NotifyArgs {
    /// Send AGLX notifications of every delegation's life to this bridge
    /// (`aglx://host:port`, or `aglxs://host:port` for TLS): task.assign when it is sent,
    /// status.report on state changes and lease renewals, task.result at the end (and
    /// credit.transfer when priced). Best effort: an unreachable bridge never delays or fails
    /// a delegation.
    #[arg(long, value_name = "URL", value_parser = parse_endpoint)]
    notify: Option<Endpoint>,
    /// The daemon's AGLX address (FROM of its notifications).
    #[arg(long, value_name = "AGENT", default_value = "agent://delegator.local", value_parser = parse_agent)]
    notify_as: AgentUri,
    /// Sign notifications with the key in this file (the key of --notify-as's zone).
    #[arg(long, value_name = "PATH")]
    notify_key_file: Option<PathBuf>,
    /// PEM certificate (CA or the bridge's own) to trust for aglxs://.
    #[arg(long, value_name = "PATH")]
    notify_ca: Option<PathBuf>,
    /// Credits a delegation costs per started minute of lease (0: free).
    #[arg(long, default_value_t = 0)]
    credits_per_lease_minute: u64,
    /// Credits a delegation costs per started MiB served or written back (0: free).
    #[arg(long, default_value_t = 0)]
    credits_per_mib: u64,
}

impl NotifyArgs {
    pub(super) fn config(self) -> anyhow::Result<Option<NotifyConfig>> {
        let Some(endpoint) = self.notify else {
            anyhow::ensure!(
                self.notify_key_file.is_none() && self.notify_ca.is_none(),
                "--notify-key-file and --notify-ca need --notify aglx://host:port"
            );
            return Ok(None);
        };
        Ok(Some(NotifyConfig {
            endpoint,
            me: self.notify_as,
            key_file: self.notify_key_file,
            tls_ca: self.notify_ca,
            pricing: Pricing {
                per_lease_minute: self.credits_per_lease_minute,
                per_mib: self.credits_per_mib,
            },
        }))
    }
}

/// `awcp-ctl executor` options for AGLX announces.
#[derive(Debug, Args)]
pub(super) struct AnnounceArgs {
    /// Announce this Executor over UDP (agent.announce) to this address: an aglx-bridge's UDP
    /// port, an `awcp-ctl peers --listen` address, or a broadcast address. Repeatable.
    #[arg(long, value_name = "HOST:PORT")]
    announce: Vec<SocketAddr>,
    /// The Executor's AGLX address.
    #[arg(long, value_name = "AGENT", default_value = "agent://executor.local", value_parser = parse_agent)]
    announce_as: AgentUri,
    /// The AWCP URL to announce, if not http://<listen>/awcp (e.g. when listening on 0.0.0.0).
    #[arg(long, value_name = "URL")]
    announce_url: Option<String>,
    /// How often to announce; each announce lives three intervals.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    announce_interval: Duration,
    /// Sign announces with the key in this file (the key of --announce-as's zone). A
    /// Delegator's `delegate --to auto` only chooses Executors whose announces are signed
    /// with a key it trusts (its --peers-key-file).
    #[arg(long, value_name = "PATH")]
    announce_key_file: Option<PathBuf>,
}

impl AnnounceArgs {
    pub(super) fn config(self) -> anyhow::Result<Option<AnnounceConfig>> {
        if self.announce.is_empty() {
            anyhow::ensure!(
                self.announce_url.is_none() && self.announce_key_file.is_none(),
                "--announce-url and --announce-key-file need --announce <host:port>"
            );
            return Ok(None);
        }
        anyhow::ensure!(
            !self.announce_interval.is_zero(),
            "--announce-interval must be at least 1s"
        );
        Ok(Some(AnnounceConfig {
            targets: self.announce,
            me: self.announce_as,
            awcp_url: self.announce_url,
            interval: self.announce_interval,
            key_file: self.announce_key_file,
        }))
    }
}

/// `awcp-ctl peers`: list Executors that announced themselves.
#[derive(Debug, Args)]
pub(super) struct PeersArgs {
    /// Ask this AGLX bridge for its registry (`aglx://host:port` or `aglxs://…`).
    #[arg(long, value_name = "URL", value_parser = parse_endpoint)]
    bridge: Option<Endpoint>,
    /// Listen for announces on this UDP address (what executors pass to --announce).
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<SocketAddr>,
    /// How long to listen with --listen.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    wait: Duration,
    /// Our AGLX address for the bridge handshake.
    #[arg(long = "as", value_name = "AGENT", default_value = "agent://awcp-ctl.local", value_parser = parse_agent)]
    me: AgentUri,
    /// Key file: signs our frames to the bridge (if it requires signatures from our zone), and
    /// verifies announces heard with --listen (with it, only announces signed with this key
    /// count).
    #[arg(long, value_name = "PATH")]
    key_file: Option<PathBuf>,
    /// PEM certificate to trust for aglxs://.
    #[arg(long, value_name = "PATH")]
    ca: Option<PathBuf>,
    /// Check announces against the key in this file (`ZONE=PATH`: for that zone and its
    /// subdomains; `PATH`: for every zone); the TRUST column says which are signed with a
    /// key you trust. Repeatable. --key-file counts as one for every zone.
    #[arg(long, value_name = "[ZONE=]PATH", value_parser = parse_zone_key)]
    trust_key_file: Vec<(Option<String>, PathBuf)>,
}

/// Prints the peers, as a table or one JSON object per line.
pub(super) async fn peers(a: PeersArgs, json: bool) -> anyhow::Result<()> {
    let mut trusted = a.trust_key_file.clone();
    if let Some(k) = &a.key_file {
        trusted.push((None, k.clone()));
    }
    let keys = awcp_ctl::aglx::trusted_keys(&trusted)?;
    let now = aglx_bridge::security::unix_now();
    let list = awcp_ctl::aglx::peers(&PeersQuery {
        bridge: a.bridge,
        listen: a.listen,
        wait: a.wait,
        me: a.me,
        key_file: a.key_file,
        tls_ca: a.ca,
    })
    .await?;
    if json {
        for e in &list {
            let mut v = serde_json::to_value(e)?;
            if let Some(o) = v.as_object_mut() {
                let (trust, _) = awcp_ctl::aglx::check_entry(e, &keys, now);
                o.insert("trust".into(), serde_json::to_value(trust)?);
            }
            println!("{v}");
        }
        return Ok(());
    }
    if list.is_empty() {
        eprintln!("no peers found (executors announce with `awcp-ctl executor --announce <addr>`)");
        return Ok(());
    }
    println!(
        "{:<36} {:<40} {:<12} {:>8} {:>5} {:>8}  TRUST",
        "AGENT", "AWCP URL", "TRANSPORTS", "MAX TTL", "FREE", "EXPIRES"
    );
    let mut untrusted = 0;
    for e in &list {
        let (trust, _) = awcp_ctl::aglx::check_entry(e, &keys, now);
        untrusted += usize::from(trust != awcp_ctl::aglx::Trust::Signed);
        let a = &e.announce;
        let opt = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
        println!(
            "{:<36} {:<40} {:<12} {:>8} {:>5} {:>7}s  {}",
            e.agent.to_string(),
            a.awcp_url.as_deref().unwrap_or("-"),
            if a.transports.is_empty() {
                "-".to_string()
            } else {
                a.transports.join(",")
            },
            opt(a.max_ttl_seconds),
            opt(a.free_capacity.map(u64::from)),
            e.expires_in_seconds,
            trust.as_str()
        );
    }
    if untrusted > 0 {
        eprintln!(
            "{untrusted} of {} announces are not signed with a key you trust: `delegate --to auto` \
             never chooses them (check with --trust-key-file [ZONE=]PATH, the key the Executors \
             sign with: `executor --announce-key-file`)",
            list.len()
        );
    }
    Ok(())
}

/// `awcp-ctl delegate` options for `--to auto`.
#[derive(Debug, Args)]
pub(super) struct AutoArgs {
    /// With `--to auto`: find Executors in this AGLX bridge's registry.
    #[arg(long, value_name = "URL", value_parser = parse_endpoint)]
    peers_bridge: Option<Endpoint>,
    /// With `--to auto`: listen for Executor announces on this UDP address.
    #[arg(long, value_name = "HOST:PORT")]
    peers_listen: Option<SocketAddr>,
    /// With `--to auto` and --peers-listen: how long to listen.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    peers_wait: Duration,
    /// With `--to auto`: trust announces signed with the key in this file (`ZONE=PATH`: for
    /// that zone and its subdomains; `PATH`: for every zone), the key the Executors give
    /// `executor --announce-key-file`. Only such Executors are chosen. Repeatable.
    #[arg(long, value_name = "[ZONE=]PATH", value_parser = parse_zone_key)]
    peers_key_file: Vec<(Option<String>, PathBuf)>,
    /// UNSAFE: with `--to auto`, also choose Executors whose announces are unsigned or not
    /// signed with a key you trust. Anyone who can send a UDP datagram to the bridge can
    /// announce itself, with any capacity, and be sent the workspace.
    #[arg(long)]
    unsafe_unsigned_peers: bool,
}

impl AutoArgs {
    /// Resolves `--to`: `auto` becomes the AWCP URL of the freest announced Executor that
    /// takes awcpfs and a lease of `ttl`; anything else is returned as is.
    pub(super) async fn resolve(&self, to: &str, ttl: Duration) -> anyhow::Result<String> {
        if to != "auto" {
            return Ok(to.to_string());
        }
        anyhow::ensure!(
            self.peers_bridge.is_some() || self.peers_listen.is_some(),
            "--to auto needs --peers-bridge aglx://host:port or --peers-listen <udp addr> to find Executors"
        );
        let peers = awcp_ctl::aglx::peers(&PeersQuery {
            bridge: self.peers_bridge.clone(),
            listen: self.peers_listen,
            wait: self.peers_wait,
            me: "agent://awcp-ctl.local"
                .parse()
                .map_err(|_| anyhow::anyhow!("built-in agent address"))?,
            key_file: None,
            tls_ca: None,
        })
        .await?;
        let keys = awcp_ctl::aglx::trusted_keys(&self.peers_key_file)?;
        if self.unsafe_unsigned_peers {
            tracing::warn!(
                "--unsafe-unsigned-peers: an Executor that anyone announced may be sent the \
                 workspace"
            );
        }
        let candidates = awcp_ctl::aglx::trusted_peers(&peers, &keys, self.unsafe_unsigned_peers);
        if candidates.is_empty() && !peers.is_empty() {
            anyhow::bail!(
                "--to auto: none of the {} announced Executors is signed with a key you trust \
                 (an unsigned announce can come from anyone, in any name); give the key their \
                 announces are signed with (`executor --announce-key-file`) with \
                 --peers-key-file [ZONE=]PATH, or name the Executor with --to http://host:port/awcp \
                 (`awcp-ctl peers` shows each one's TRUST)",
                peers.len()
            );
        }
        let peers = candidates;
        let chosen = awcp_ctl::aglx::pick_executor(&peers, ttl.as_secs()).ok_or_else(|| {
            anyhow::anyhow!(
                "--to auto: none of the {} announced Executors takes awcpfs with a {}s lease and has free capacity (see `awcp-ctl peers`)",
                peers.len(),
                ttl.as_secs()
            )
        })?;
        let url = chosen.announce.awcp_url.clone().unwrap_or_default();
        eprintln!("--to auto: chose {} at {url}", chosen.agent);
        Ok(url)
    }
}
