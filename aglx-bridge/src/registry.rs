//! The registry of announced agents, each entry alive for a TTL after its last announce.
//!
//! Announces come from the network, so everything in them is bounded and validated before it
//! is stored: short names, an `http(s)` AWCP URL, a handful of transport tokens. The registry
//! itself is bounded too; when full, the entry closest to expiry makes room.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::uri::AgentUri;

/// TTL of an entry whose announce names none.
pub const DEFAULT_TTL: Duration = Duration::from_secs(90);
/// Longest TTL an announce can ask for.
pub const MAX_TTL: Duration = Duration::from_secs(3600);
/// Most entries kept.
pub const MAX_ENTRIES: usize = 10_000;

/// What an agent says about itself (`agent.announce`, `registry.update` bodies). Every field
/// is optional; unknown fields are ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announce {
    /// A display name (at most 64 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_name: Option<String>,
    /// Where the agent takes AWCP invitations (`http://host:port/awcp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub awcp_url: Option<String>,
    /// AWCP transports it accepts (`awcpfs`, `archive`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transports: Vec<String>,
    /// The longest lease it accepts, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ttl_seconds: Option<u64>,
    /// How many more delegations it takes now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_capacity: Option<u32>,
    /// How long this announce stays valid, in seconds (default 90, at most 3600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
}

/// An announce is out of bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("announce field {field} is invalid")]
pub struct BadAnnounce {
    /// The offending field.
    pub field: &'static str,
}

impl Announce {
    /// Checks the bounds described on the fields.
    pub fn validate(&self) -> Result<(), BadAnnounce> {
        let printable = |s: &str| !s.chars().any(char::is_control);
        if let Some(n) = &self.agent_name
            && (n.chars().count() > 64 || !printable(n))
        {
            return Err(BadAnnounce {
                field: "agent_name",
            });
        }
        if let Some(u) = &self.awcp_url
            && (u.len() > 512
                || !(u.starts_with("http://") || u.starts_with("https://"))
                || u.bytes().any(|b| b <= b' ' || b == 0x7f))
        {
            return Err(BadAnnounce { field: "awcp_url" });
        }
        if self.transports.len() > 8
            || !self.transports.iter().all(|t| {
                !t.is_empty()
                    && t.len() <= 32
                    && t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            })
        {
            return Err(BadAnnounce {
                field: "transports",
            });
        }
        Ok(())
    }

    /// The TTL this announce asks for, clamped to [1 s, [`MAX_TTL`]].
    pub fn ttl(&self) -> Duration {
        self.ttl_seconds
            .map_or(DEFAULT_TTL, Duration::from_secs)
            .clamp(Duration::from_secs(1), MAX_TTL)
    }
}

/// One registry entry as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The agent.
    pub agent: AgentUri,
    /// Seconds until the entry expires (rounded up).
    pub expires_in_seconds: u64,
    /// Its last announce.
    pub announce: Announce,
    /// Whether that announce carried a `SIGNATURE`. Says nothing of whose: a receiver that
    /// holds the zone's key checks [`Entry::frame`] itself.
    #[serde(default)]
    pub signed: bool,
    /// The announce frame exactly as it arrived, base64: what a Delegator verifies with the
    /// key it trusts before it sends a workspace to the agent (`delegate --to auto`), so that
    /// it need not trust the registry that relays it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame: Option<String>,
}

/// The body of a registry listing (`registry.update` answering `{"op":"list"}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listing {
    /// The live entries, sorted by agent (at most [`MAX_LISTED`]).
    pub agents: Vec<Entry>,
    /// Whether entries were left out to keep the answer within a frame.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// Most entries in one listing: keeps the answer well under the 1 MiB body limit.
pub const MAX_LISTED: usize = 2000;

impl Listing {
    /// A listing of `entries`, cut to [`MAX_LISTED`].
    pub fn of(mut entries: Vec<Entry>) -> Self {
        let truncated = entries.len() > MAX_LISTED;
        entries.truncate(MAX_LISTED);
        Listing {
            agents: entries,
            truncated,
        }
    }
}

/// One agent's slot: its announce, expiry, and the frame it came in.
#[derive(Debug)]
struct Slot {
    announce: Announce,
    expires: Instant,
    signed: bool,
    frame: Option<Vec<u8>>,
}

/// Agents by address, with expiry.
#[derive(Debug, Default)]
pub struct Registry {
    entries: HashMap<AgentUri, Slot>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Records an announce (already validated) at `now`, without its frame.
    pub fn upsert(&mut self, agent: AgentUri, announce: Announce, now: Instant) {
        self.upsert_frame(agent, announce, now, None, false);
    }

    /// Records an announce (already validated) at `now`, with the frame it came in and
    /// whether it was signed. An unsigned announce never replaces a live signed one of the
    /// same agent (anyone can send one in its name); it is dropped and `false` returned.
    pub fn upsert_frame(
        &mut self,
        agent: AgentUri,
        announce: Announce,
        now: Instant,
        frame: Option<&[u8]>,
        signed: bool,
    ) -> bool {
        self.purge(now);
        if !signed && self.entries.get(&agent).is_some_and(|s| s.signed) {
            return false;
        }
        if self.entries.len() >= MAX_ENTRIES && !self.entries.contains_key(&agent) {
            let soonest = self
                .entries
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(a, _)| a.clone());
            if let Some(a) = soonest {
                self.entries.remove(&a);
            }
        }
        let expires = now + announce.ttl();
        self.entries.insert(
            agent,
            Slot {
                announce,
                expires,
                signed,
                frame: frame.map(<[u8]>::to_vec),
            },
        );
        true
    }

    /// Whether an agent has a live entry.
    pub fn contains(&self, agent: &AgentUri, now: Instant) -> bool {
        self.entries.get(agent).is_some_and(|s| s.expires > now)
    }

    /// The live entries, sorted by agent.
    pub fn list(&self, now: Instant) -> Vec<Entry> {
        let mut out: Vec<Entry> = self
            .entries
            .iter()
            .filter(|(_, s)| s.expires > now)
            .map(|(agent, s)| Entry {
                agent: agent.clone(),
                expires_in_seconds: (s.expires - now).as_secs_f64().ceil() as u64,
                announce: s.announce.clone(),
                signed: s.signed,
                frame: s.frame.as_deref().map(|f| {
                    use base64::Engine as _;
                    base64::engine::general_purpose::STANDARD.encode(f)
                }),
            })
            .collect();
        out.sort_by(|a, b| a.agent.cmp(&b.agent));
        out
    }

    /// Drops expired entries.
    pub fn purge(&mut self, now: Instant) {
        self.entries.retain(|_, s| s.expires > now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_expire_after_their_ttl() {
        let now = Instant::now();
        let mut r = Registry::new();
        let a: AgentUri = "agent://a.x".parse().unwrap();
        let ann = Announce {
            ttl_seconds: Some(10),
            ..Announce::default()
        };
        r.upsert(a.clone(), ann, now);
        assert!(r.contains(&a, now + Duration::from_secs(9)));
        assert_eq!(r.list(now)[0].expires_in_seconds, 10);
        assert!(!r.contains(&a, now + Duration::from_secs(10)));
        assert!(r.list(now + Duration::from_secs(11)).is_empty());
    }

    #[test]
    fn an_unsigned_announce_never_replaces_a_signed_one() {
        let now = Instant::now();
        let mut r = Registry::new();
        let a: AgentUri = "agent://exec.lab".parse().unwrap();
        let good = Announce {
            awcp_url: Some("http://good/awcp".into()),
            ..Announce::default()
        };
        assert!(r.upsert_frame(a.clone(), good.clone(), now, Some(b"signed"), true));
        let evil = Announce {
            awcp_url: Some("http://evil/awcp".into()),
            free_capacity: Some(1000),
            ..Announce::default()
        };
        assert!(!r.upsert_frame(a.clone(), evil.clone(), now, Some(b"forged"), false));
        let l = r.list(now);
        assert_eq!(l[0].announce, good);
        assert!(l[0].signed);
        assert_eq!(l[0].frame.as_deref(), Some("c2lnbmVk"));
        // Once the signed entry has expired, an unsigned one may take the name (marked).
        let later = now + DEFAULT_TTL + Duration::from_secs(1);
        assert!(r.upsert_frame(a, evil.clone(), later, None, false));
        assert!(!r.list(later)[0].signed);
    }

    #[test]
    fn listings_are_capped() {
        let now = Instant::now();
        let mut r = Registry::new();
        for i in 0..MAX_LISTED + 5 {
            r.upsert(
                format!("agent://a{i}.x").parse().unwrap(),
                Announce::default(),
                now,
            );
        }
        let l = Listing::of(r.list(now));
        assert_eq!(l.agents.len(), MAX_LISTED);
        assert!(l.truncated);
        let json = serde_json::to_string(&l).unwrap();
        assert!(json.len() < 1024 * 1024, "{} bytes", json.len());
        assert!(!Listing::of(Vec::new()).truncated);
    }

    #[test]
    fn ttl_is_clamped_and_fields_are_bounded() {
        let huge = Announce {
            ttl_seconds: Some(u64::MAX),
            ..Announce::default()
        };
        assert_eq!(huge.ttl(), MAX_TTL);
        assert_eq!(Announce::default().ttl(), DEFAULT_TTL);
        for bad in [
            Announce {
                awcp_url: Some("file:///etc/passwd".into()),
                ..Announce::default()
            },
            Announce {
                awcp_url: Some("http://a b".into()),
                ..Announce::default()
            },
            Announce {
                agent_name: Some("x\u{1b}[2J".into()),
                ..Announce::default()
            },
            Announce {
                transports: vec!["a b".into()],
                ..Announce::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let seed: Announce =
            serde_json::from_str(r#"{"agent_name":"Gamma","uptime":3921}"#).unwrap();
        assert_eq!(seed.agent_name.as_deref(), Some("Gamma"));
        assert!(seed.validate().is_ok());
    }
}
