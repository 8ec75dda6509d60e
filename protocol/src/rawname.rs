//! File names that are not UTF-8.
//!
//! Linux names are bytes: anything but `/` and NUL. Almost every name is UTF-8, and the
//! whole code base handles paths as `String`. To carry the rest without a second path type
//! everywhere, a name that is not UTF-8 is held in a `String` in an *escaped form*: every
//! byte that is not part of a valid UTF-8 sequence (and every NUL byte) becomes a NUL
//! character followed by two lowercase hex digits; valid UTF-8 runs stay as they are. So
//! `b"caf\xe9.txt"` is held as `"caf\0e9.txt"`.
//!
//! Why this can never collide with a real name: no file name contains NUL, so a `String`
//! without NUL is exactly the UTF-8 name it spells (nothing changes for the common case),
//! and one with NUL is always an escaped name. The escaped form is canonical — only bytes
//! that cannot be decoded are escaped — so one byte string has exactly one form
//! ([`decode`] refuses any other), and [`from_bytes`]/[`to_bytes`] are inverse bijections.
//!
//! The escaped form never leaves a process on the wire: JSON carries a non-UTF-8 path as
//! `{"b64": "<standard base64 of the raw bytes>"}` instead of a string ([`wire`],
//! [`wire_opt`]), and the binary manifest carries raw bytes. A path that is UTF-8 is a plain
//! JSON string, byte for byte as before. Decoding refuses a plain string containing NUL, a
//! `b64` form whose bytes are UTF-8 (one path, one encoding) or contain NUL, and bad base64.
//! The escaped form does reach local state that is only read back by the same code (the
//! Executor's journal).

use std::borrow::Cow;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;

/// The character that starts an escaped byte.
pub const ESCAPE: char = '\0';

/// Why an escaped name is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// A NUL not followed by two lowercase hex digits.
    #[error("malformed escape at byte {offset}")]
    BadEscape {
        /// Where.
        offset: usize,
    },
    /// An escape of a byte that is part of valid UTF-8 (not the canonical form).
    #[error("escaped bytes that are valid UTF-8 (not the canonical form)")]
    NotCanonical,
}

/// Whether `s` is in the escaped form (holds a name that is not UTF-8).
pub fn is_escaped(s: &str) -> bool {
    s.contains(ESCAPE)
}

/// The `String` form of raw name or path bytes: borrowed when they are UTF-8 without NUL.
pub fn from_bytes(raw: &[u8]) -> Cow<'_, str> {
    match std::str::from_utf8(raw) {
        Ok(s) if !s.contains('\0') => Cow::Borrowed(s),
        _ => Cow::Owned(escape(raw)),
    }
}

fn escape(raw: &[u8]) -> String {
    fn push_byte(out: &mut String, b: u8) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        out.push(ESCAPE);
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
    let mut out = String::with_capacity(raw.len() + 8);
    for chunk in raw.utf8_chunks() {
        // NUL is valid UTF-8 but never part of a name: escaped too, so it stays unambiguous.
        let mut parts = chunk.valid().split('\0');
        if let Some(first) = parts.next() {
            out.push_str(first);
        }
        for part in parts {
            push_byte(&mut out, 0);
            out.push_str(part);
        }
        for &b in chunk.invalid() {
            push_byte(&mut out, b);
        }
    }
    out
}

/// The `OsStr` form of raw name bytes: borrowed when they are UTF-8 without NUL.
pub fn from_os(name: &OsStr) -> Cow<'_, str> {
    from_bytes(name.as_bytes())
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

/// The raw bytes of a `String`-form name, checked: every escape well formed and the whole
/// in canonical form.
pub fn decode(s: &str) -> Result<Cow<'_, [u8]>, NameError> {
    if !is_escaped(s) {
        return Ok(Cow::Borrowed(s.as_bytes()));
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == 0 {
            let (Some(hi), Some(lo)) = (
                b.get(i + 1).copied().and_then(hex_val),
                b.get(i + 2).copied().and_then(hex_val),
            ) else {
                return Err(NameError::BadEscape { offset: i });
            };
            out.push(hi << 4 | lo);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    if from_bytes(&out) != s {
        return Err(NameError::NotCanonical);
    }
    Ok(Cow::Owned(out))
}

/// The raw bytes of a `String`-form name, for a system call. A malformed escape is passed
/// through as it is (its NUL then makes the call fail): callers validate paths first.
pub fn to_bytes(s: &str) -> Cow<'_, [u8]> {
    decode(s).unwrap_or(Cow::Borrowed(s.as_bytes()))
}

/// [`to_bytes`] as an `OsStr`.
pub fn to_os(s: &str) -> Cow<'_, OsStr> {
    match to_bytes(s) {
        Cow::Borrowed(b) => Cow::Borrowed(OsStr::from_bytes(b)),
        Cow::Owned(v) => Cow::Owned(std::os::unix::ffi::OsStringExt::from_vec(v)),
    }
}

/// The name with each undecodable byte shown as U+FFFD: for matching against patterns and
/// for people, never for a name that is written anywhere.
pub fn lossy(s: &str) -> Cow<'_, str> {
    if !is_escaped(s) {
        return Cow::Borrowed(s);
    }
    Cow::Owned(String::from_utf8_lossy(&to_bytes(s)).into_owned())
}

/// The JSON encoding of a path held as a `String`: a plain string when UTF-8, else
/// `{"b64": "..."}`. Use with `#[serde(with = "awcp_protocol::rawname::wire")]`.
pub mod wire {
    use serde::de::{self, MapAccess, Visitor};
    use serde::ser::SerializeMap;
    use serde::{Deserializer, Serializer};

    use super::{B64, Engine, from_bytes, is_escaped, to_bytes};

    /// The one key of the object form.
    pub const KEY: &str = "b64";

    /// Serialize a `String`-form path.
    pub fn serialize<S: Serializer>(path: &str, ser: S) -> Result<S::Ok, S::Error> {
        if !is_escaped(path) {
            return ser.serialize_str(path);
        }
        let mut m = ser.serialize_map(Some(1))?;
        m.serialize_entry(KEY, &B64.encode(to_bytes(path)))?;
        m.end()
    }

    /// Deserialize into the `String` form, refusing anything ambiguous.
    pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<String, D::Error> {
        de.deserialize_any(PathVisitor)
    }

    pub(super) struct PathVisitor;

    impl<'de> Visitor<'de> for PathVisitor {
        type Value = String;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(r#"a path: a UTF-8 string, or {"b64": "..."} for one that is not UTF-8"#)
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
            if v.contains('\0') {
                return Err(E::custom(format!("path {v:?} contains NUL")));
            }
            Ok(v.to_owned())
        }

        fn visit_string<E: de::Error>(self, v: String) -> Result<String, E> {
            if v.contains('\0') {
                return Err(E::custom(format!("path {v:?} contains NUL")));
            }
            Ok(v)
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<String, A::Error> {
            let mut b64: Option<String> = None;
            while let Some(k) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if k != KEY || b64.is_some() {
                    return Err(de::Error::custom(format!(
                        "a non-UTF-8 path is an object with one key, {KEY:?}; found {k:?}"
                    )));
                }
                b64 = Some(map.next_value()?);
            }
            let b64 = b64.ok_or_else(|| de::Error::missing_field(KEY))?;
            let raw = B64
                .decode(b64.as_bytes())
                .map_err(|e| de::Error::custom(format!("path {b64:?} is not base64: {e}")))?;
            if raw.contains(&0) {
                return Err(de::Error::custom(format!(
                    "path (base64 {b64:?}) contains NUL"
                )));
            }
            if std::str::from_utf8(&raw).is_ok() {
                return Err(de::Error::custom(format!(
                    "path (base64 {b64:?}) is UTF-8: send it as a string"
                )));
            }
            Ok(from_bytes(&raw).into_owned())
        }
    }
}

/// [`wire`] for an optional path (`null` or absent is `None`).
pub mod wire_opt {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    struct Wrap<'a>(&'a str);

    impl Serialize for Wrap<'_> {
        fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
            super::wire::serialize(self.0, ser)
        }
    }

    struct Owned(String);

    impl<'de> Deserialize<'de> for Owned {
        fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
            super::wire::deserialize(de).map(Owned)
        }
    }

    /// Serialize an optional `String`-form path.
    pub fn serialize<S: Serializer>(path: &Option<String>, ser: S) -> Result<S::Ok, S::Error> {
        path.as_deref().map(Wrap).serialize(ser)
    }

    /// Deserialize an optional path.
    pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<Option<String>, D::Error> {
        Ok(Option::<Owned>::deserialize(de)?.map(|o| o.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_is_unchanged_and_other_bytes_are_escaped() {
        assert!(matches!(
            from_bytes(b"caf\xc3\xa9.txt"),
            Cow::Borrowed("café.txt")
        ));
        assert_eq!(from_bytes(b"caf\xe9.txt"), "caf\0e9.txt");
        assert_eq!(from_bytes(b"\xff"), "\0ff");
        assert_eq!(from_bytes(b"a\0b"), "a\u{0}00b");
        assert_eq!(from_bytes(b"\0"), "\u{0}00");
        assert_eq!(from_bytes(b""), "");
        assert_eq!(&*to_bytes("caf\0e9.txt"), b"caf\xe9.txt");
        assert_eq!(&*to_bytes("a\u{0}00b"), b"a\0b");
        assert_eq!(lossy("caf\0e9.txt"), "caf\u{fffd}.txt");
    }

    #[test]
    fn only_the_canonical_form_decodes() {
        // "é" escaped byte by byte is UTF-8: not the canonical form.
        assert_eq!(decode("\0c3\0a9"), Err(NameError::NotCanonical));
        assert_eq!(decode("\0E9"), Err(NameError::BadEscape { offset: 0 }));
        assert_eq!(decode("a\0e"), Err(NameError::BadEscape { offset: 1 }));
        assert_eq!(
            decode("\u{0}2f"),
            Err(NameError::NotCanonical),
            "no `/` by escape"
        );
        assert_eq!(&*decode("x\0e9").unwrap(), b"x\xe9");
    }

    #[test]
    fn lone_and_truncated_sequences_round_trip() {
        for raw in [
            &b"\xc3"[..],
            b"\xc3a",
            b"\xe2\x82",
            b"a\xf0\x9f\x98",
            b"\x80\x80",
            b"ok\xed\xa0\x80", // a UTF-16 surrogate in UTF-8 form is invalid
        ] {
            let s = from_bytes(raw);
            assert!(is_escaped(&s), "{raw:?}");
            assert_eq!(&*decode(&s).unwrap(), raw);
        }
    }
}
