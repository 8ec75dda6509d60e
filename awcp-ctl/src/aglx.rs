//! AGLX for `awcp-ctl`: lifecycle notifications from the Delegator daemon
//! (`serve --notify aglx://host:port`), announces from the Executor (`executor --announce`),
//! and discovery of announced Executors (`awcp-ctl peers`).
//!
//! The protocol, the mapping of lifecycle events to messages and the pricing live in
//! `aglx-bridge`; this module only feeds it the daemon's events. Notifications are best effort
//! by construction (`aglx_bridge::Notifier` never blocks and never fails the caller): an
//! unreachable bridge never slows or fails a delegation.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use aglx_bridge::awcp::{Lifecycle, Pricing, frames};
use aglx_bridge::notify::AnnouncerConfig;
use aglx_bridge::registry::{Announce, Entry};
use aglx_bridge::security::{Keys, Policy};
use aglx_bridge::{AgentUri, Announcer, Discovery, Endpoint, Notifier, NotifierConfig};
use anyhow::Context as _;
use awcp_protocol::DelegationState;
use awcp_protocol::dataplane::LeaseState;
use parking_lot::Mutex;

use crate::daemon::Live;
use crate::executor::{ExecutorConfig, RunningExecutor};
use crate::store::StoredDelegation;
use crate::watch::WatchEvent;

/// Where and how the Delegator daemon sends AGLX notifications.
#[derive(Debug, Clone)]
pub struct NotifyConfig {
    /// The bridge, `aglx://host:port` or `aglxs://host:port`.
    pub endpoint: Endpoint,
    /// The daemon's agent address (`FROM`).
    pub me: AgentUri,
    /// A file holding the signing key of `me`'s trust zone.
    pub key_file: Option<PathBuf>,
    /// PEM file of the CA (or self-signed certificate) to trust for `aglxs://`.
    pub tls_ca: Option<PathBuf>,
    /// What a delegation costs; all zero sends no credits.
    pub pricing: Pricing,
}

/// Reads a key file: its bytes, trailing newline dropped, at least 16 bytes.
pub fn read_key(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    let mut key =
        std::fs::read(path).with_context(|| format!("reading key file {}", path.display()))?;
    while key.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        key.pop();
    }
    anyhow::ensure!(
        key.len() >= 16,
        "key file {} holds {} bytes; use at least 16 random bytes",
        path.display(),
        key.len()
    );
    Ok(key)
}

fn notifier_config(
    endpoint: &Endpoint,
    me: &AgentUri,
    key_file: Option<&PathBuf>,
    tls_ca: Option<&PathBuf>,
) -> anyhow::Result<NotifierConfig> {
    let mut n = NotifierConfig::new(endpoint.clone(), me.clone());
    n.key = key_file.map(|p| read_key(p)).transpose()?;
    if endpoint.tls {
        let ca =
            tls_ca.context("aglxs:// needs the CA certificate to trust (--notify-ca / --ca)")?;
        n.tls = Some(aglx_bridge::tls::client_config(
            &aglx_bridge::tls::read_pem(ca)?,
        )?);
    }
    Ok(n)
}

/// The daemon's notifier: turns recorded events into AGLX frames.
pub(crate) struct DaemonNotifier {
    notifier: Notifier,
    pricing: Pricing,
    /// When each delegation's lease began to be used (START sent), for pricing.
    started: Mutex<HashMap<String, Instant>>,
}

impl std::fmt::Debug for DaemonNotifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonNotifier")
            .field("notifier", &self.notifier)
            .finish()
    }
}

impl DaemonNotifier {
    /// Starts the background notifier (needs a Tokio runtime).
    pub(crate) fn start(cfg: &NotifyConfig) -> anyhow::Result<Self> {
        let n = notifier_config(
            &cfg.endpoint,
            &cfg.me,
            cfg.key_file.as_ref(),
            cfg.tls_ca.as_ref(),
        )?;
        tracing::info!(bridge = %cfg.endpoint.addr, me = %cfg.me, "AGLX notifications on");
        Ok(DaemonNotifier {
            notifier: Notifier::start(n),
            pricing: cfg.pricing,
            started: Mutex::new(HashMap::new()),
        })
    }

    /// Called for every event the daemon records.
    pub(crate) fn on_event(&self, live: &Live, d: &StoredDelegation, ev: &WatchEvent) {
        let id = d.record.id.as_str().to_string();
        let event = match ev {
            // Nothing has left the daemon yet; task.assign follows with INVITE.
            WatchEvent::State {
                state: DelegationState::Created,
                ..
            } => return,
            WatchEvent::State {
                state: DelegationState::Invited,
                ..
            } => Lifecycle::Delegated {
                delegation_id: id,
                executor_url: d.record.peer_url.clone(),
                description: d.record.task.description.clone(),
                ttl_seconds: d.record.lease_config.ttl_seconds,
                access_mode: d.record.lease_config.access_mode.as_str().into(),
            },
            WatchEvent::State { state, detail, .. } if state.is_terminal() => {
                let since = self.started.lock().remove(&id);
                let bytes = live.exports.lock().iter().fold(0u64, |n, e| {
                    let s = e.stats();
                    n.saturating_add(s.bytes_served.saturating_add(s.bytes_written))
                });
                Lifecycle::Finished {
                    delegation_id: id,
                    state: *state,
                    detail: detail.clone(),
                    // Started seconds: any use of a lease costs at least its first unit.
                    lease_seconds: since.map_or(0, |t| t.elapsed().as_secs_f64().ceil() as u64),
                    bytes,
                }
            }
            WatchEvent::State { state, detail, .. } => {
                if *state == DelegationState::Started {
                    self.started.lock().insert(id.clone(), Instant::now());
                }
                Lifecycle::State {
                    delegation_id: id,
                    state: *state,
                    detail: detail.clone(),
                }
            }
            WatchEvent::Lease {
                state: LeaseState::Active,
                expires_at,
            } => Lifecycle::LeaseRenewed {
                delegation_id: id,
                expires_at: expires_at.clone(),
            },
            // Revocation and expiry arrive as terminal states; executor events as state
            // changes.
            WatchEvent::Lease { .. } | WatchEvent::Task { .. } | WatchEvent::Owner { .. } => {
                return;
            }
        };
        for frame in frames(&event, Some(&self.pricing)) {
            self.notifier.notify(frame);
        }
    }
}

/// How the Executor announces itself.
#[derive(Debug, Clone)]
pub struct AnnounceConfig {
    /// Where announces go (a bridge's UDP address, `awcp-ctl peers --listen` addresses, or a
    /// broadcast address).
    pub targets: Vec<SocketAddr>,
    /// The Executor's agent address.
    pub me: AgentUri,
    /// The AWCP URL to announce; default `http://<listen>/awcp`.
    pub awcp_url: Option<String>,
    /// How often.
    pub interval: Duration,
    /// A file holding the signing key of `me`'s zone.
    pub key_file: Option<PathBuf>,
}

/// Starts announcing a running Executor: its AWCP URL, `awcpfs`, its max TTL and its free
/// capacity (refreshed every interval). Announces live three intervals.
pub async fn announce_executor(
    running: &RunningExecutor,
    cfg: &AnnounceConfig,
) -> anyhow::Result<(std::sync::Arc<Announcer>, tokio::task::JoinHandle<()>)> {
    let ex = running.executor.clone();
    let free = move || {
        let active = ex
            .tasks
            .lock()
            .values()
            .filter(|a| !a.state.lock().is_terminal())
            .count();
        u32::try_from(ex.cfg.max_concurrent.saturating_sub(active)).unwrap_or(u32::MAX)
    };
    let announce = Announce {
        agent_name: Some(cfg.me.name().to_string()),
        awcp_url: Some(cfg.awcp_url.clone().unwrap_or_else(|| running.awcp_url())),
        transports: vec!["awcpfs".into()],
        max_ttl_seconds: Some(running.executor.cfg.max_ttl.as_secs()),
        free_capacity: Some(free()),
        ttl_seconds: Some((cfg.interval * 3).as_secs().max(1)),
    };
    announce
        .validate()
        .context("the announce is invalid (is --announce-url an http(s) URL?)")?;
    let announcer = Announcer::start(AnnouncerConfig {
        targets: cfg.targets.clone(),
        me: cfg.me.clone(),
        announce,
        interval: cfg.interval,
        key: cfg.key_file.as_ref().map(|p| read_key(p)).transpose()?,
    })
    .await
    .context("opening the UDP socket for announces")?;
    let announcer = std::sync::Arc::new(announcer);
    let updater = announcer.clone();
    let interval = cfg.interval;
    let refresher = tokio::spawn(async move {
        let mut last = None;
        loop {
            tokio::time::sleep(interval.min(Duration::from_secs(1))).await;
            let now = free();
            if last != Some(now) {
                last = Some(now);
                updater.update(|a| a.free_capacity = Some(now));
            }
        }
    });
    Ok((announcer, refresher))
}

/// Runs the Executor until Ctrl-C, announcing it when `announce` is set.
pub async fn serve_executor(
    cfg: ExecutorConfig,
    announce: Option<AnnounceConfig>,
) -> anyhow::Result<()> {
    let Some(announce) = announce else {
        return crate::executor::serve(cfg).await;
    };
    let running = crate::executor::start(cfg).await?;
    let (announcer, refresher) = announce_executor(&running, &announce).await?;
    eprintln!(
        "awcp-ctl executor: AWCP endpoint {}, announced as {} to {:?} (Ctrl-C stops)",
        running.awcp_url(),
        announce.me,
        announce.targets
    );
    tokio::signal::ctrl_c().await?;
    refresher.abort();
    drop(announcer);
    running.stop().await;
    Ok(())
}

/// Where `awcp-ctl peers` looks.
#[derive(Debug, Clone)]
pub struct PeersQuery {
    /// Ask this bridge for its registry.
    pub bridge: Option<Endpoint>,
    /// Listen for announces on this UDP address.
    pub listen: Option<SocketAddr>,
    /// How long to listen.
    pub wait: Duration,
    /// Our agent address, for the bridge handshake.
    pub me: AgentUri,
    /// Key file: signs the bridge handshake, and verifies signed announces heard on `listen`.
    pub key_file: Option<PathBuf>,
    /// CA for `aglxs://`.
    pub tls_ca: Option<PathBuf>,
}

/// Lists announced agents: the bridge's registry and/or what arrives on the UDP address
/// within the wait, merged by agent (the bridge's entry wins), sorted by agent.
pub async fn peers(q: &PeersQuery) -> anyhow::Result<Vec<Entry>> {
    anyhow::ensure!(
        q.bridge.is_some() || q.listen.is_some(),
        "say where to look: --bridge aglx://host:port (ask a bridge) or --listen <udp addr> (hear announces)"
    );
    let mut by_agent: HashMap<String, Entry> = HashMap::new();
    if let Some(addr) = q.listen {
        // With a key, it is every zone's key: only announces signed with it count.
        let mut policy = Policy::default();
        if let Some(p) = &q.key_file {
            policy.keys = Keys::new().with("*", read_key(p)?);
        }
        let d = Discovery::bind(addr, policy)
            .await
            .with_context(|| format!("listening for announces on {addr}"))?;
        tokio::time::sleep(q.wait).await;
        for e in d.peers() {
            by_agent.insert(e.agent.to_string(), e);
        }
    }
    if let Some(bridge) = &q.bridge {
        let n = notifier_config(bridge, &q.me, q.key_file.as_ref(), q.tls_ca.as_ref())?;
        let listing = aglx_bridge::notify::list_registry(&n)
            .await
            .with_context(|| format!("asking the bridge at {} for its registry", bridge.addr))?;
        for e in listing.agents {
            by_agent.insert(e.agent.to_string(), e);
        }
    }
    let mut out: Vec<Entry> = by_agent.into_values().collect();
    out.sort_by(|a, b| a.agent.cmp(&b.agent));
    Ok(out)
}

/// How far the Delegator trusts an announce it read from a registry (a bridge's, or heard
/// itself): only [`Trust::Signed`] peers are ever sent a workspace by `delegate --to auto`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Trust {
    /// Signed with the key we hold for the agent's zone: its announce is the agent's.
    Signed,
    /// No signature: anyone could have sent it, in any agent's name.
    Unsigned,
    /// Signed, but we hold no key for the agent's zone.
    UnknownKey,
    /// Signed, but the signature does not match under our key (forged, or altered on the
    /// way), or the frame does not say what the registry lists.
    BadSignature,
    /// Signed and matching, but older than its own TTL allows: a replay.
    Stale,
}

impl Trust {
    /// A word for tables.
    pub fn as_str(&self) -> &'static str {
        match self {
            Trust::Signed => "signed",
            Trust::Unsigned => "UNSIGNED",
            Trust::UnknownKey => "unknown-key",
            Trust::BadSignature => "BAD-SIG",
            Trust::Stale => "stale",
        }
    }
}

/// The keys a Delegator trusts announces by (`--peers-key-file [ZONE=]PATH`, repeatable;
/// without a zone, a key for every zone).
pub fn trusted_keys(files: &[(Option<String>, PathBuf)]) -> anyhow::Result<Keys> {
    let mut keys = Keys::new();
    for (zone, path) in files {
        keys.insert(zone.as_deref().unwrap_or("*"), read_key(path)?);
    }
    Ok(keys)
}

/// Checks an entry's announce frame against `keys` at `now` (Unix seconds): how far it is
/// trusted, and the announce as the *frame* says it (never the registry's copy of it, which a
/// registry could have altered). Only a [`Trust::Signed`] entry's announce is returned.
pub fn check_entry(e: &Entry, keys: &Keys, now: u64) -> (Trust, Option<Announce>) {
    use base64::Engine as _;
    let Some(raw) = e
        .frame
        .as_deref()
        .and_then(|f| base64::engine::general_purpose::STANDARD.decode(f).ok())
    else {
        return (Trust::Unsigned, None);
    };
    // Announces come over UDP (to a bridge or a listener) or TCP (registered with a bridge).
    let decoded = aglx_bridge::decode_datagram(&raw, &aglx_bridge::Limits::UDP)
        .ok()
        .or_else(|| {
            aglx_bridge::decode_stream(&raw, &aglx_bridge::Limits::TCP)
                .ok()
                .flatten()
        });
    let Some(decoded) = decoded else {
        return (Trust::BadSignature, None);
    };
    let f = &decoded.frame;
    if f.signature.is_none() {
        return (Trust::Unsigned, None);
    }
    if f.from.as_ref() != Some(&e.agent)
        || f.msg_type != Some(aglx_bridge::MessageType::AgentAnnounce)
    {
        return (Trust::BadSignature, None);
    }
    let Some(key) = keys.lookup(e.agent.domain()) else {
        return (Trust::UnknownKey, None);
    };
    if !aglx_bridge::security::mac_matches(&raw, &decoded, key) {
        return (Trust::BadSignature, None);
    }
    let announce: Announce = if f.body.is_empty() {
        Announce::default()
    } else {
        match f.body_as::<Announce>() {
            Some(a) if a.validate().is_ok() => a,
            _ => return (Trust::BadSignature, None),
        }
    };
    // An announce lives its own TTL; a registry relays it that long at most. Older is a
    // replay of an announce the agent no longer makes (clocks may differ by the signature
    // window, as for every signed AGLX frame).
    const SKEW: u64 = 300;
    let Some(ts) = f.timestamp else {
        return (Trust::BadSignature, None);
    };
    if ts > now + SKEW || now > ts + announce.ttl().as_secs() + SKEW {
        return (Trust::Stale, None);
    }
    (Trust::Signed, Some(announce))
}

/// The peers `--to auto` may choose from: those whose announce is signed with a key we
/// trust, each with the announce its frame carries; all of them, as listed, with
/// `allow_unsigned`.
pub fn trusted_peers(peers: &[Entry], keys: &Keys, allow_unsigned: bool) -> Vec<Entry> {
    let now = aglx_bridge::security::unix_now();
    peers
        .iter()
        .filter_map(|e| match check_entry(e, keys, now) {
            (Trust::Signed, Some(a)) => Some(Entry {
                announce: a,
                ..e.clone()
            }),
            _ if allow_unsigned => Some(e.clone()),
            _ => None,
        })
        .collect()
}

/// Picks the Executor for `delegate --to auto`: among peers with an AWCP URL that take
/// `awcpfs` (or do not say), accept a lease of `ttl_seconds` (or do not say) and have free
/// capacity (or do not say), the one with the most free capacity; ties go to the freshest
/// announce, then to the agent address. `None` when no peer fits.
pub fn pick_executor(peers: &[Entry], ttl_seconds: u64) -> Option<&Entry> {
    peers
        .iter()
        .filter(|e| {
            let a = &e.announce;
            a.awcp_url.is_some()
                && (a.transports.is_empty() || a.transports.iter().any(|t| t == "awcpfs"))
                && a.max_ttl_seconds.is_none_or(|m| m >= ttl_seconds)
                && a.free_capacity.is_none_or(|f| f > 0)
        })
        .max_by(|x, y| {
            let free = |e: &Entry| e.announce.free_capacity.unwrap_or(1);
            free(x)
                .cmp(&free(y))
                .then(x.expires_in_seconds.cmp(&y.expires_in_seconds))
                .then(y.agent.cmp(&x.agent))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, url: Option<&str>, free: Option<u32>, max_ttl: Option<u64>) -> Entry {
        Entry {
            agent: format!("agent://{name}.lab").parse().unwrap(),
            expires_in_seconds: 30,
            announce: Announce {
                awcp_url: url.map(str::to_string),
                transports: vec!["awcpfs".into()],
                free_capacity: free,
                max_ttl_seconds: max_ttl,
                ..Announce::default()
            },
            signed: false,
            frame: None,
        }
    }

    /// An entry as a registry lists it, its frame signed with `key` at `ts` (if any).
    fn framed(agent: &str, announce: &Announce, key: Option<&[u8]>, ts: u64) -> Entry {
        use base64::Engine as _;
        let frame = aglx_bridge::Frame::new(
            aglx_bridge::Transport::Udp,
            aglx_bridge::MessageType::AgentAnnounce,
        )
        .from(agent.parse().unwrap())
        .json(announce);
        let bytes = match key {
            Some(k) => aglx_bridge::security::sign(&frame, k, ts, &"n".repeat(32)).unwrap(),
            None => frame.encode().unwrap(),
        };
        Entry {
            agent: agent.parse().unwrap(),
            expires_in_seconds: 30,
            announce: announce.clone(),
            signed: key.is_some(),
            frame: Some(base64::engine::general_purpose::STANDARD.encode(bytes)),
        }
    }

    #[test]
    fn only_announces_signed_with_a_trusted_key_are_trusted() {
        let key = b"executor-zone-key-0123456789".as_slice();
        let keys = Keys::new().with("lab", key.to_vec());
        let now = aglx_bridge::security::unix_now();
        let good = Announce {
            awcp_url: Some("http://good/awcp".into()),
            free_capacity: Some(2),
            ttl_seconds: Some(30),
            ..Announce::default()
        };
        let e = framed("agent://exec.lab", &good, Some(key), now);
        assert_eq!(
            check_entry(&e, &keys, now),
            (Trust::Signed, Some(good.clone()))
        );
        // The registry's copy is ignored: the frame's announce is what counts.
        let mut altered = e.clone();
        altered.announce.awcp_url = Some("http://evil/awcp".into());
        assert_eq!(
            trusted_peers(&[altered], &keys, false)[0]
                .announce
                .awcp_url
                .as_deref(),
            Some("http://good/awcp")
        );
        // Unsigned, another key, another zone, another agent, a replay.
        let evil = Announce {
            awcp_url: Some("http://evil/awcp".into()),
            free_capacity: Some(1000),
            ..Announce::default()
        };
        let unsigned = framed("agent://evil.local", &evil, None, now);
        assert_eq!(check_entry(&unsigned, &keys, now).0, Trust::Unsigned);
        assert_eq!(
            check_entry(&entry("x", None, None, None), &keys, now).0,
            Trust::Unsigned
        );
        let forged = framed(
            "agent://evil.lab",
            &evil,
            Some(b"guessed-key-0123456789"),
            now,
        );
        assert_eq!(check_entry(&forged, &keys, now).0, Trust::BadSignature);
        let elsewhere = framed("agent://evil.local", &evil, Some(key), now);
        assert_eq!(check_entry(&elsewhere, &keys, now).0, Trust::UnknownKey);
        let mut renamed = e.clone();
        renamed.agent = "agent://evil.lab".parse().unwrap();
        assert_eq!(check_entry(&renamed, &keys, now).0, Trust::BadSignature);
        assert_eq!(check_entry(&e, &keys, now + 30 + 301).0, Trust::Stale);
        // --to auto: the freest *trusted* peer, however free the untrusted ones say they are.
        let all = vec![unsigned, forged, elsewhere, e];
        let trusted = trusted_peers(&all, &keys, false);
        assert_eq!(trusted.len(), 1);
        assert_eq!(pick_executor(&trusted, 10).unwrap().agent.name(), "exec");
        let anyone = trusted_peers(&all, &keys, true);
        assert_eq!(
            pick_executor(&anyone, 10).unwrap().announce.free_capacity,
            Some(1000)
        );
    }

    #[test]
    fn auto_picks_the_freest_executor_that_fits() {
        let peers = vec![
            entry("full", Some("http://a/awcp"), Some(0), None),
            entry("short", Some("http://b/awcp"), Some(9), Some(60)),
            entry("nourl", None, Some(9), None),
            entry("one", Some("http://c/awcp"), Some(1), None),
            entry("four", Some("http://d/awcp"), Some(4), Some(7200)),
        ];
        let got = pick_executor(&peers, 600).unwrap();
        assert_eq!(got.agent.name(), "four");
        assert_eq!(pick_executor(&peers, 10).unwrap().agent.name(), "short");
        assert!(pick_executor(&peers[..3], 600).is_none());
        let mut archive_only = entry("arch", Some("http://e/awcp"), Some(5), None);
        archive_only.announce.transports = vec!["archive".into()];
        assert!(pick_executor(&[archive_only], 1).is_none());
    }
}
