//! Agent addresses: `agent://name.domain`.
//!
//! `name` is the agent, `domain` (one or more dot-separated labels) is where it lives and
//! doubles as its trust zone: signature keys are configured per domain. Both parts are
//! lower-cased on parse, so addresses compare case-insensitively. The seed's table writes
//! `agent:alpha.local`; its examples (and we) use `agent://alpha.local`.

use std::fmt;
use std::str::FromStr;

/// Longest address accepted, in bytes (the DNS limit plus the scheme).
pub const MAX_URI_LEN: usize = 8 + 253;

/// An agent's address, `agent://name.domain`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AgentUri {
    name: String,
    domain: String,
}

/// An address could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an agent address (expected agent://name.domain, lowercase letters, digits, '-')")]
pub struct BadAgentUri;

impl AgentUri {
    /// Builds an address from its parts, validating both.
    pub fn new(name: &str, domain: &str) -> Result<Self, BadAgentUri> {
        format!("agent://{name}.{domain}").parse()
    }

    /// The agent's name (the first label).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The agent's domain (the remaining labels), which is also its trust zone.
    pub fn domain(&self) -> &str {
        &self.domain
    }
}

fn valid_label(label: &str) -> bool {
    !label.is_empty()
        && label.len() <= 63
        && !label.starts_with('-')
        && !label.ends_with('-')
        && label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl FromStr for AgentUri {
    type Err = BadAgentUri;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() > MAX_URI_LEN {
            return Err(BadAgentUri);
        }
        let rest = s
            .get(..8)
            .filter(|scheme| scheme.eq_ignore_ascii_case("agent://"))
            .map(|_| &s[8..])
            .ok_or(BadAgentUri)?;
        let rest = rest.to_ascii_lowercase();
        let (name, domain) = rest.split_once('.').ok_or(BadAgentUri)?;
        if !valid_label(name) || !domain.split('.').all(valid_label) {
            return Err(BadAgentUri);
        }
        Ok(AgentUri {
            name: name.to_string(),
            domain: domain.to_string(),
        })
    }
}

impl fmt::Display for AgentUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "agent://{}.{}", self.name, self.domain)
    }
}

impl serde::Serialize for AgentUri {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for AgentUri {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The recipient of a frame: one agent, or everyone (`*`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Recipient {
    /// One agent.
    Agent(AgentUri),
    /// Every subscriber (written `*`).
    Broadcast,
}

impl FromStr for Recipient {
    type Err = BadAgentUri;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "*" {
            Ok(Recipient::Broadcast)
        } else {
            s.parse().map(Recipient::Agent)
        }
    }
}

impl fmt::Display for Recipient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recipient::Agent(a) => a.fmt(f),
            Recipient::Broadcast => f.write_str("*"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_agent_uris() {
        let a: AgentUri = "agent://alpha.local".parse().unwrap();
        assert_eq!(a.name(), "alpha");
        assert_eq!(a.domain(), "local");
        assert_eq!(a.to_string(), "agent://alpha.local");
        let b: AgentUri = "AGENT://Exec-1.Lab.Example".parse().unwrap();
        assert_eq!(b.to_string(), "agent://exec-1.lab.example");
        assert_eq!(b.domain(), "lab.example");
    }

    #[test]
    fn rejects_malformed_agent_uris() {
        for bad in [
            "",
            "agent:alpha.local",
            "agent://alpha",
            "agent://.local",
            "agent://alpha.",
            "agent://al pha.local",
            "agent://alpha..local",
            "agent://-a.local",
            "http://alpha.local",
            "agent://alpha.local/x",
            "agent://alpha.local\r\nX: y",
            "agent://ä.local",
        ] {
            assert!(bad.parse::<AgentUri>().is_err(), "{bad:?} parsed");
        }
        let long = format!("agent://a.{}", "b".repeat(300));
        assert!(long.parse::<AgentUri>().is_err());
    }

    #[test]
    fn recipient_star_is_broadcast() {
        assert_eq!("*".parse::<Recipient>().unwrap(), Recipient::Broadcast);
        assert_eq!(
            "agent://b.x".parse::<Recipient>().unwrap().to_string(),
            "agent://b.x"
        );
    }
}
