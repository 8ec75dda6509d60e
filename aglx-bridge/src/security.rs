//! Signatures and replay protection.
//!
//! A signed frame carries `TIMESTAMP` (Unix seconds), `NONCE` (16–64 of `[A-Za-z0-9_-]`) and,
//! as its last header, `SIGNATURE`: the lowercase hex HMAC-SHA256 of the frame's exact bytes
//! without the `SIGNATURE` line — start line, the other header lines with their own line ends,
//! the blank line and the body, as they travelled. The receiver therefore verifies what it
//! received, never a re-encoding of it.
//!
//! Keys belong to trust zones. A sender's zone is the domain of its `FROM` address
//! (`agent://alpha.lab.example` is in `lab.example`); a key configured for a zone also
//! covers its subdomains, the most specific key wins, and a key for `*` covers everyone else.
//!
//! The receiver accepts a signed frame if the MAC matches (compared in constant time), its
//! timestamp lies within the replay window of the receiver's clock, and its nonce has not been
//! seen within the window. The nonce cache is bounded: when it is full, the oldest entry is
//! dropped and frames as old as the dropped one are refused from then on, so a replay can
//! never slip through an eviction.
//!
//! Unsigned frames are accepted unless they carry credits (`CREDITS`) or task data
//! (`task.assign`, `task.result`, `credit.transfer`) and the sender's zone has a key — or the
//! policy requires signatures on everything.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::codec::Decoded;
use crate::error::{AuthError, FrameError};
use crate::frame::Frame;

type HmacSha256 = Hmac<Sha256>;

/// The current time in Unix seconds.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh random nonce: 32 lowercase hex digits (128 bits).
pub fn fresh_nonce() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

/// Signing keys by trust zone.
#[derive(Clone, Default)]
pub struct Keys {
    zones: HashMap<String, Vec<u8>>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("Keys")
            .field("zones", &self.zones.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Keys {
    /// No keys: nothing is required to be signed, and signed frames are refused (401).
    pub fn new() -> Self {
        Keys::default()
    }

    /// Adds the key of a zone (a domain such as `lab.example`, or `*` for every zone).
    pub fn insert(&mut self, zone: &str, key: impl Into<Vec<u8>>) {
        self.zones.insert(zone.to_ascii_lowercase(), key.into());
    }

    /// Builder form of [`Keys::insert`].
    pub fn with(mut self, zone: &str, key: impl Into<Vec<u8>>) -> Self {
        self.insert(zone, key);
        self
    }

    /// Whether no key is configured.
    pub fn is_empty(&self) -> bool {
        self.zones.is_empty()
    }

    /// The key for a zone: the zone's own, else its closest parent domain's, else `*`'s.
    pub fn lookup(&self, zone: &str) -> Option<&[u8]> {
        let mut z = zone;
        loop {
            if let Some(k) = self.zones.get(z) {
                return Some(k);
            }
            match z.split_once('.') {
                Some((_, parent)) => z = parent,
                None => return self.zones.get("*").map(Vec::as_slice),
            }
        }
    }
}

/// Signs a frame: sets `TIMESTAMP` and `NONCE`, and returns the encoded frame with its
/// `SIGNATURE`.
pub fn sign(frame: &Frame, key: &[u8], now: u64, nonce: &str) -> Result<Vec<u8>, FrameError> {
    let mut f = frame.clone();
    f.timestamp = Some(now);
    f.nonce = Some(nonce.to_string());
    f.signature = None;
    let head = f.encode_unsigned_head()?;
    let mut mac = mac_for(key);
    mac.update(&head);
    mac.update(b"\r\n");
    mac.update(f.body.as_bytes());
    let sig = hex::encode(mac.finalize().into_bytes());
    f.signature = Some(sig);
    f.encode()
}

fn mac_for(key: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; new_from_slice cannot fail for it.
    <HmacSha256 as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!())
}

/// Checks the MAC of a decoded frame against the bytes it was decoded from (constant time).
pub fn mac_matches(raw: &[u8], decoded: &Decoded, key: &[u8]) -> bool {
    let (Some(range), Some(sig)) = (&decoded.signature_line, &decoded.frame.signature) else {
        return false;
    };
    let Ok(expected) = hex::decode(sig) else {
        return false;
    };
    let mut mac = mac_for(key);
    mac.update(&raw[..range.start]);
    mac.update(&raw[range.end..decoded.len]);
    mac.verify_slice(&expected).is_ok()
}

/// What a receiver requires.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Keys by zone.
    pub keys: Keys,
    /// How far a `TIMESTAMP` may lie from the receiver's clock, in seconds (default 300).
    pub window_secs: u64,
    /// How many nonces are remembered (default 65 536).
    pub nonce_capacity: usize,
    /// Require a signature on every frame from a zone with a key, not only on credits and
    /// task data.
    pub require_all: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            keys: Keys::new(),
            window_secs: 300,
            nonce_capacity: 65_536,
            require_all: false,
        }
    }
}

/// The receiving side's checks: signature, timestamp window and nonce cache.
#[derive(Debug)]
pub struct Verifier {
    policy: Policy,
    nonces: Mutex<NonceCache>,
}

impl Verifier {
    /// A verifier for a policy.
    pub fn new(policy: Policy) -> Self {
        let cap = policy.nonce_capacity.max(1);
        Verifier {
            policy,
            nonces: Mutex::new(NonceCache::new(cap)),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Checks a frame decoded from `raw` at time `now` (Unix seconds).
    pub fn check(&self, raw: &[u8], decoded: &Decoded, now: u64) -> Result<(), AuthError> {
        let f = &decoded.frame;
        let zone = f.from.as_ref().map(|a| a.domain().to_string());
        let key = match &zone {
            Some(z) => self.policy.keys.lookup(z),
            None => self.policy.keys.lookup("*"),
        };
        let Some(_) = &f.signature else {
            let sensitive = f.credits.is_some()
                || f.msg_type.as_ref().is_some_and(|t| t.is_sensitive())
                || self.policy.require_all;
            if key.is_some() && sensitive {
                return Err(AuthError::SignatureRequired {
                    msg_type: f
                        .msg_type
                        .as_ref()
                        .map_or_else(|| "untyped".into(), |t| t.to_string()),
                    zone: zone.unwrap_or_else(|| "*".into()),
                });
            }
            return Ok(());
        };
        let (Some(zone), Some(ts), Some(nonce)) = (zone, f.timestamp, &f.nonce) else {
            return Err(AuthError::MissingFields);
        };
        let key = key.ok_or_else(|| AuthError::UnknownZone { zone: zone.clone() })?;
        if !mac_matches(raw, decoded, key) {
            return Err(AuthError::BadSignature);
        }
        if ts.abs_diff(now) > self.policy.window_secs {
            return Err(AuthError::Stale { timestamp: ts });
        }
        let mut cache = self.nonces.lock().unwrap_or_else(|e| e.into_inner());
        cache.insert(
            format!("{zone} {nonce}"),
            ts,
            now.saturating_sub(self.policy.window_secs),
        )
    }
}

/// Nonces seen within the window, bounded.
#[derive(Debug)]
struct NonceCache {
    cap: usize,
    by_nonce: HashMap<String, u64>,
    by_time: BTreeSet<(u64, String)>,
    /// Frames with a timestamp at or below this are refused: a nonce this old may have been
    /// evicted.
    floor: Option<u64>,
}

impl NonceCache {
    fn new(cap: usize) -> Self {
        NonceCache {
            cap,
            by_nonce: HashMap::new(),
            by_time: BTreeSet::new(),
            floor: None,
        }
    }

    fn insert(&mut self, key: String, ts: u64, expired_before: u64) -> Result<(), AuthError> {
        // Forget nonces whose frames the window refuses anyway.
        while let Some((t, _)) = self.by_time.first() {
            if *t >= expired_before {
                break;
            }
            if let Some((_, k)) = self.by_time.pop_first() {
                self.by_nonce.remove(&k);
            }
        }
        if self.floor.is_some_and(|floor| ts <= floor) {
            return Err(AuthError::Stale { timestamp: ts });
        }
        if self.by_nonce.contains_key(&key) {
            return Err(AuthError::Replayed);
        }
        if self.by_nonce.len() >= self.cap {
            if let Some((t, k)) = self.by_time.pop_first() {
                self.by_nonce.remove(&k);
                self.floor = Some(self.floor.map_or(t, |f| f.max(t)));
            }
            if self.floor.is_some_and(|floor| ts <= floor) {
                return Err(AuthError::Stale { timestamp: ts });
            }
        }
        self.by_time.insert((ts, key.clone()));
        self.by_nonce.insert(key, ts);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{Limits, decode_stream};
    use crate::frame::{MessageType, Transport};

    fn task() -> Frame {
        Frame::new(Transport::Tcp, MessageType::TaskAssign)
            .from("agent://alpha.lab.example".parse().unwrap())
            .json(&serde_json::json!({"task": "x"}))
    }

    fn policy(keys: Keys) -> Policy {
        Policy {
            keys,
            ..Policy::default()
        }
    }

    fn decode(raw: &[u8]) -> Decoded {
        decode_stream(raw, &Limits::TCP).unwrap().unwrap()
    }

    #[test]
    fn signed_frame_verifies_once_and_replay_is_refused() {
        let keys = Keys::new().with("lab.example", b"k1".to_vec());
        let v = Verifier::new(policy(keys));
        let raw = sign(&task(), b"k1", 1000, "nonce-0123456789ab").unwrap();
        let d = decode(&raw);
        assert_eq!(v.check(&raw, &d, 1000), Ok(()));
        assert_eq!(v.check(&raw, &d, 1001), Err(AuthError::Replayed));
    }

    #[test]
    fn any_changed_byte_breaks_the_signature() {
        let keys = Keys::new().with("*", b"k".to_vec());
        let raw = sign(&task(), b"k", 1000, "nonce-0123456789ab").unwrap();
        let d = decode(&raw);
        assert!(mac_matches(&raw, &d, b"k"));
        assert!(!mac_matches(&raw, &d, b"other"));
        // Flip one byte of the body (keeping it valid JSON and the same length).
        let mut tampered = raw.clone();
        let i = tampered.len() - 3;
        tampered[i] = b'y';
        let d2 = decode(&tampered);
        let v = Verifier::new(policy(keys));
        assert_eq!(v.check(&tampered, &d2, 1000), Err(AuthError::BadSignature));
    }

    #[test]
    fn unsigned_task_refused_only_where_a_key_is_configured() {
        let raw = task().encode().unwrap();
        let d = decode(&raw);
        let open = Verifier::new(policy(Keys::new()));
        assert_eq!(open.check(&raw, &d, 0), Ok(()));
        let other_zone = Verifier::new(policy(Keys::new().with("elsewhere", b"k".to_vec())));
        assert_eq!(other_zone.check(&raw, &d, 0), Ok(()));
        let parent = Verifier::new(policy(Keys::new().with("example", b"k".to_vec())));
        assert!(matches!(
            parent.check(&raw, &d, 0),
            Err(AuthError::SignatureRequired { .. })
        ));
        // An unsigned status report is fine even with a key.
        let report = Frame::new(Transport::Tcp, MessageType::StatusReport)
            .from("agent://alpha.lab.example".parse().unwrap());
        let raw = report.encode().unwrap();
        assert_eq!(parent.check(&raw, &decode(&raw), 0), Ok(()));
        // ... but not when it carries credits.
        let raw = report.credits(3).encode().unwrap();
        assert!(parent.check(&raw, &decode(&raw), 0).is_err());
    }

    #[test]
    fn stale_and_unknown_zone_and_missing_fields() {
        let v = Verifier::new(policy(Keys::new().with("lab.example", b"k".to_vec())));
        let raw = sign(&task(), b"k", 1000, "nonce-0123456789ab").unwrap();
        let d = decode(&raw);
        assert_eq!(
            v.check(&raw, &d, 1000 + 301),
            Err(AuthError::Stale { timestamp: 1000 })
        );
        let other = Verifier::new(policy(Keys::new().with("zzz", b"k".to_vec())));
        assert!(matches!(
            other.check(&raw, &d, 1000),
            Err(AuthError::UnknownZone { .. })
        ));
    }

    #[test]
    fn full_nonce_cache_raises_the_floor_instead_of_forgetting() {
        let mut c = NonceCache::new(2);
        assert!(c.insert("a".into(), 10, 0).is_ok());
        assert!(c.insert("b".into(), 11, 0).is_ok());
        assert!(c.insert("c".into(), 12, 0).is_ok()); // evicts a@10, floor 10
        assert_eq!(
            c.insert("a".into(), 10, 0),
            Err(AuthError::Stale { timestamp: 10 })
        );
        assert_eq!(c.insert("b".into(), 11, 0), Err(AuthError::Replayed));
        assert!(c.insert("d".into(), 13, 0).is_ok());
        assert!(c.by_nonce.len() <= 2);
    }

    #[test]
    fn keys_debug_hides_material() {
        let k = Keys::new().with("z", b"secret-key".to_vec());
        assert!(!format!("{k:?}").contains("secret"));
    }
}
