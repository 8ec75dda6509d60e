//! Delegation identifiers.
//!
//! The reference implementation names a delegation `dlg_` followed by a UUID v4 without its
//! dashes: 32 lowercase hex digits. [`DelegationId`] only ever holds a string of exactly that
//! form. It is checked once, when the id enters the process (parsing, deserializing), so code
//! that holds a `DelegationId` can use it as a path component or a map key without
//! re-validating it: it cannot contain `/`, `..` or anything else surprising.
//!
//! The crate has no random-number dependency; [`DelegationId::from_random_bytes`] takes the 16
//! random bytes from the caller.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{IdDefect, ProtocolError};

/// The identifier of one delegation: `dlg_` + 32 lowercase hex digits.
///
/// On the wire it is a plain JSON string; deserializing validates it.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DelegationId(String);

impl DelegationId {
    /// The prefix every delegation id starts with.
    pub const PREFIX: &'static str = "dlg_";
    /// Number of hex digits after the prefix.
    pub const HEX_DIGITS: usize = 32;

    /// Validate `s` as a delegation id.
    ///
    /// Uppercase hex is refused: the reference only produces lowercase, and one canonical
    /// spelling means one id maps to one directory and one map key.
    pub fn parse(s: &str) -> Result<Self, ProtocolError> {
        let reject = |defect| ProtocolError::InvalidDelegationId {
            value: s.to_owned(),
            defect,
        };
        let Some(hex) = s.strip_prefix(Self::PREFIX) else {
            return Err(reject(IdDefect::MissingPrefix));
        };
        if let Some(i) = hex
            .bytes()
            .position(|b| !matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(reject(IdDefect::NotLowercaseHex {
                position: Self::PREFIX.len() + i,
            }));
        }
        if hex.len() != Self::HEX_DIGITS {
            return Err(reject(IdDefect::WrongLength { found: hex.len() }));
        }
        Ok(DelegationId(s.to_owned()))
    }

    /// Build an id from 16 bytes the caller drew from a cryptographic random source.
    ///
    /// The bytes are written as 32 lowercase hex digits, so any input gives a valid id; the
    /// id is only as unguessable as the bytes are random.
    pub fn from_random_bytes(bytes: [u8; 16]) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(Self::PREFIX.len() + Self::HEX_DIGITS);
        s.push_str(Self::PREFIX);
        for b in bytes {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
        DelegationId(s)
    }

    /// The id as a string slice, e.g. for a path component or a URL segment.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DelegationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for DelegationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DelegationId").field(&self.0).finish()
    }
}

impl FromStr for DelegationId {
    type Err = ProtocolError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DelegationId::parse(s)
    }
}

impl TryFrom<String> for DelegationId {
    type Error = ProtocolError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        DelegationId::parse(&s)
    }
}

impl From<DelegationId> for String {
    fn from(id: DelegationId) -> String {
        id.0
    }
}

impl AsRef<str> for DelegationId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Serialize for DelegationId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for DelegationId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        DelegationId::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "dlg_0123456789abcdef0123456789abcdef";

    #[test]
    fn parses_a_reference_style_id() {
        let id = DelegationId::parse(GOOD).unwrap();
        assert_eq!(id.as_str(), GOOD);
        assert_eq!(id.to_string(), GOOD);
    }

    #[test]
    fn rejects_bad_ids_with_the_right_defect() {
        let defect = |s: &str| match DelegationId::parse(s) {
            Err(ProtocolError::InvalidDelegationId { value, defect }) => {
                assert_eq!(value, s);
                defect
            }
            other => panic!("{s:?} gave {other:?}"),
        };
        assert_eq!(
            defect("task_0123456789abcdef0123456789abcdef"),
            IdDefect::MissingPrefix
        );
        assert_eq!(defect("dlg_abc123"), IdDefect::WrongLength { found: 6 });
        assert_eq!(defect("dlg_"), IdDefect::WrongLength { found: 0 });
        assert_eq!(
            defect("dlg_0123456789ABCDEF0123456789abcdef"),
            IdDefect::NotLowercaseHex { position: 14 }
        );
        assert_eq!(
            defect("dlg_../../etc/passwd0123456789abcdef"),
            IdDefect::NotLowercaseHex { position: 4 }
        );
        // 32 characters, but one of them is multi-byte: reported as not hex, never sliced.
        assert_eq!(
            defect("dlg_0123456789abcdef0123456789abcdeé"),
            IdDefect::NotLowercaseHex { position: 35 }
        );
    }

    #[test]
    fn from_random_bytes_is_valid_and_deterministic() {
        let id = DelegationId::from_random_bytes([0xab; 16]);
        assert_eq!(id.as_str(), format!("dlg_{}", "ab".repeat(16)));
        let id = DelegationId::from_random_bytes([
            0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d,
            0x0e, 0xff,
        ]);
        assert_eq!(id.as_str(), "dlg_000102030405060708090a0b0c0d0eff");
        assert_eq!(DelegationId::parse(id.as_str()).unwrap(), id);
    }

    #[test]
    fn serde_is_a_plain_validated_string() {
        let id = DelegationId::parse(GOOD).unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), format!("\"{GOOD}\""));
        let back: DelegationId = serde_json::from_str(&format!("\"{GOOD}\"")).unwrap();
        assert_eq!(back, id);
        let err = serde_json::from_str::<DelegationId>("\"dlg_nothex\"").unwrap_err();
        assert!(err.to_string().contains("invalid delegation id"), "{err}");
        assert!(serde_json::from_str::<DelegationId>("42").is_err());
    }
}
