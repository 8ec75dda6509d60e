//! The manifest's compact binary encoding (what `GET /manifest` serves, zstd-compressed,
//! when asked for `application/vnd.awcp.manifest`). About a third of the JSON's size before
//! compression: hashes are raw bytes, a one-block file's block list is a flag, numbers are
//! LEB128 varints, and each path stores only what differs from the previous one.
//!
//! ```text
//! manifest := "AWMF" u8:format varint:version str:exportId varint:blockSize u8:readOnly
//!             varint:rootMode zigzag:rootMtimeNs varint:count entry*count
//! entry    := varint:sharedPrefix str:suffix u8:flags varint:mode varint:size zigzag:mtimeNs
//!             [varint:ino] [zigzag:ctimeNs] [hash:32] [varint:n hash:32*n] [str:target]
//!             xattrs                                       (format 2 only)
//! xattrs   := varint:n (str:name bytes:value)*n               (names ascending, no repeats)
//! flags    := kind (bits 0-1: 0 file, 1 dir, 2 symlink) | 0x04 ino | 0x08 ctimeNs
//!             | 0x10 hash | 0x20 the only block is the hash | 0x40 blocks | 0x80 target
//! str      := varint:len bytes (UTF-8)
//! bytes    := varint:len bytes
//! ```
//!
//! Format 1 requires paths and targets to be UTF-8, and the shared prefix to end on a
//! character boundary. Format 2 stores paths and targets as raw bytes (a name that is not
//! UTF-8 is carried as it is on disk; see [`crate::rawname`]), shares prefixes bytewise, and
//! adds each entry's extended attributes. The encoder writes format 1 whenever the manifest
//! needs nothing of format 2 (every name UTF-8, no attributes), so such a manifest's bytes
//! and digest are what they always were and an older mount reads it; the decoder reads both.
//!
//! The encoding of a manifest is canonical (one manifest, one byte string), so its blake3 is
//! the manifest digest. Decoding checks every length against what is left, so a hostile
//! input gives an error, never a panic or a huge allocation.

use crate::dataplane::{EntryKind, Manifest, ManifestEntry};
use crate::rawname;

/// The media type of the zstd-compressed binary manifest (ask for it with `Accept`).
pub const MEDIA_TYPE: &str = "application/vnd.awcp.manifest+zstd";

const MAGIC: &[u8; 4] = b"AWMF";
/// UTF-8 paths, no extended attributes.
const FORMAT_V1: u8 = 1;
/// Raw-byte paths and targets, extended attributes.
const FORMAT_V2: u8 = 2;

const KIND_MASK: u8 = 0x03;
const HAS_INO: u8 = 0x04;
const HAS_CTIME: u8 = 0x08;
const HAS_HASH: u8 = 0x10;
const SOLE_BLOCK: u8 = 0x20;
const HAS_BLOCKS: u8 = 0x40;
const HAS_TARGET: u8 = 0x80;

/// Why a manifest could not be encoded or decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestCodecError {
    /// A hash in the manifest is not 64 hex digits.
    #[error("entry {path}: {what} is not a blake3 hex hash")]
    BadHash {
        /// The entry.
        path: String,
        /// Which hash.
        what: &'static str,
    },
    /// An extended attribute value in the manifest is not hex.
    #[error("entry {path}: the value of extended attribute {name} is not hex")]
    BadXattr {
        /// The entry.
        path: String,
        /// The attribute.
        name: String,
    },
    /// The bytes are not a binary manifest, or are cut short or malformed.
    #[error("malformed binary manifest at byte {offset}: {what}")]
    Malformed {
        /// Where decoding stopped.
        offset: usize,
        /// What was wrong.
        what: &'static str,
    },
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_zigzag(out: &mut Vec<u8>, v: i64) {
    put_varint(out, ((v << 1) ^ (v >> 63)) as u64);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_bytes(out, s.as_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn put_hash(
    out: &mut Vec<u8>,
    hex_hash: &str,
    path: &str,
    what: &'static str,
) -> Result<(), ManifestCodecError> {
    let mut raw = [0u8; 32];
    hex::decode_to_slice(hex_hash, &mut raw).map_err(|_| ManifestCodecError::BadHash {
        path: path.to_owned(),
        what,
    })?;
    out.extend_from_slice(&raw);
    Ok(())
}

fn shared_prefix(a: &[u8], b: &[u8], utf8: bool) -> usize {
    let n = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    if !utf8 {
        return n;
    }
    // Format 1 never splits a character: the suffix must be valid UTF-8 on its own.
    let is_boundary = |i: usize| i == b.len() || (b[i] as i8) >= -0x40;
    (0..=n).rev().find(|&i| is_boundary(i)).unwrap_or(0)
}

/// The entries of a manifest, encoded: everything of [`Manifest::to_binary`]'s output from
/// the entry count on. It depends on the entries alone, so a registration that lists the same
/// entries as an earlier one under another export id reuses it and encodes only the header
/// ([`Manifest::encode_header`]); the two together are the canonical encoding, byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedEntries {
    /// Whether the entries need format 2 (see the module docs).
    v2: bool,
    bytes: Vec<u8>,
}

impl EncodedEntries {
    /// Encode `entries` (the count and every entry).
    pub fn encode(entries: &[ManifestEntry]) -> Result<EncodedEntries, ManifestCodecError> {
        let v2 = entries.iter().any(|e| {
            !e.xattrs.is_empty()
                || rawname::is_escaped(&e.path)
                || e.target.as_deref().is_some_and(rawname::is_escaped)
        });
        let mut out = Vec::with_capacity(16 + entries.len() * 64);
        put_varint(&mut out, entries.len() as u64);
        let mut prev: std::borrow::Cow<'_, [u8]> = Default::default();
        for e in entries {
            put_entry(&mut out, e, &mut prev, v2)?;
        }
        Ok(EncodedEntries { v2, bytes: out })
    }

    /// The encoded bytes: the tail of the manifest's encoding.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Append one entry; `prev` is the previous entry's raw path (its shared prefix is left out).
fn put_entry<'e>(
    out: &mut Vec<u8>,
    e: &'e ManifestEntry,
    prev: &mut std::borrow::Cow<'e, [u8]>,
    v2: bool,
) -> Result<(), ManifestCodecError> {
    // Every field, so a new one cannot be forgotten here.
    let ManifestEntry {
        path,
        kind,
        mode,
        size,
        mtime_ns,
        hash,
        blocks,
        target,
        ino,
        ctime_ns,
        xattrs,
    } = e;
    let raw = rawname::to_bytes(path);
    let shared = shared_prefix(prev, &raw, !v2);
    put_varint(out, shared as u64);
    put_bytes(out, &raw[shared..]);
    *prev = raw;
    let sole = matches!((hash, blocks.as_slice()), (Some(h), [b]) if h == b);
    let mut flags = match kind {
        EntryKind::File => 0,
        EntryKind::Dir => 1,
        EntryKind::Symlink => 2,
    };
    for (set, bit) in [
        (ino.is_some(), HAS_INO),
        (ctime_ns.is_some(), HAS_CTIME),
        (hash.is_some(), HAS_HASH),
        (sole, SOLE_BLOCK),
        (!sole && !blocks.is_empty(), HAS_BLOCKS),
        (target.is_some(), HAS_TARGET),
    ] {
        if set {
            flags |= bit;
        }
    }
    out.push(flags);
    put_varint(out, u64::from(*mode));
    put_varint(out, *size);
    put_zigzag(out, *mtime_ns);
    if let Some(i) = ino {
        put_varint(out, *i);
    }
    if let Some(c) = ctime_ns {
        put_zigzag(out, *c);
    }
    if let Some(h) = hash {
        put_hash(out, h, path, "hash")?;
    }
    if flags & HAS_BLOCKS != 0 {
        put_varint(out, blocks.len() as u64);
        for b in blocks {
            put_hash(out, b, path, "block hash")?;
        }
    }
    if let Some(t) = target {
        put_bytes(out, &rawname::to_bytes(t));
    }
    if v2 {
        put_varint(out, xattrs.len() as u64);
        for (name, value) in xattrs {
            put_str(out, name);
            let v = hex::decode(value).map_err(|_| ManifestCodecError::BadXattr {
                path: path.clone(),
                name: name.clone(),
            })?;
            put_bytes(out, &v);
        }
    }
    Ok(())
}

impl Manifest {
    /// The canonical binary encoding.
    pub fn to_binary(&self) -> Result<Vec<u8>, ManifestCodecError> {
        let entries = EncodedEntries::encode(&self.entries)?;
        let mut out = self.encode_header(&entries);
        out.extend_from_slice(entries.as_bytes());
        Ok(out)
    }

    /// The head of the canonical encoding, up to the entry count: what comes before
    /// `entries` (which must be this manifest's entries, encoded) in [`Manifest::to_binary`].
    pub fn encode_header(&self, entries: &EncodedEntries) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.export_id.len());
        out.extend_from_slice(MAGIC);
        out.push(if entries.v2 { FORMAT_V2 } else { FORMAT_V1 });
        put_varint(&mut out, u64::from(self.version));
        put_str(&mut out, &self.export_id);
        put_varint(&mut out, u64::from(self.block_size));
        out.push(u8::from(self.read_only));
        put_varint(&mut out, u64::from(self.root_mode));
        put_zigzag(&mut out, self.root_mtime_ns);
        out
    }

    /// Decode [`Manifest::to_binary`]'s output.
    pub fn from_binary(bytes: &[u8]) -> Result<Manifest, ManifestCodecError> {
        let mut r = Reader { bytes, pos: 0 };
        if r.take(4)? != MAGIC {
            return Err(r.err("not a binary manifest"));
        }
        let v2 = match r.u8()? {
            FORMAT_V1 => false,
            FORMAT_V2 => true,
            _ => return Err(r.err("unknown format version")),
        };
        let version = r.u32()?;
        let export_id = r.string()?;
        let block_size = r.u32()?;
        let read_only = match r.u8()? {
            0 => false,
            1 => true,
            _ => return Err(r.err("bad readOnly flag")),
        };
        let root_mode = r.u32()?;
        let root_mtime_ns = r.zigzag()?;
        let count = r.varint()?;
        // Every entry takes at least 6 bytes: a count beyond that is a lie.
        if count > (r.left() / 6) as u64 {
            return Err(r.err("entry count exceeds the data"));
        }
        let mut entries = Vec::with_capacity(count as usize);
        let mut prev: Vec<u8> = Vec::new();
        for _ in 0..count {
            let shared = r.varint()? as usize;
            if shared > prev.len() {
                return Err(r.err("bad shared path prefix"));
            }
            let suffix = if v2 { r.bytes()? } else { r.str()?.as_bytes() };
            if suffix.contains(&0) {
                return Err(r.err("NUL in a path"));
            }
            prev.truncate(shared);
            prev.extend_from_slice(suffix);
            if !v2 && std::str::from_utf8(&prev).is_err() {
                return Err(r.err("bad shared path prefix"));
            }
            let path = rawname::from_bytes(&prev).into_owned();
            let flags = r.u8()?;
            let kind = match flags & KIND_MASK {
                0 => EntryKind::File,
                1 => EntryKind::Dir,
                2 => EntryKind::Symlink,
                _ => return Err(r.err("bad entry kind")),
            };
            let mode = r.u32()?;
            let size = r.varint()?;
            let mtime_ns = r.zigzag()?;
            let ino = (flags & HAS_INO != 0).then(|| r.varint()).transpose()?;
            let ctime_ns = (flags & HAS_CTIME != 0).then(|| r.zigzag()).transpose()?;
            let hash = (flags & HAS_HASH != 0).then(|| r.hash()).transpose()?;
            let blocks = if flags & SOLE_BLOCK != 0 {
                if flags & HAS_BLOCKS != 0 {
                    return Err(r.err("both a sole block and a block list"));
                }
                vec![
                    hash.clone()
                        .ok_or_else(|| r.err("sole block without a hash"))?,
                ]
            } else if flags & HAS_BLOCKS != 0 {
                let n = r.varint()?;
                if n > (r.left() / 32) as u64 {
                    return Err(r.err("block count exceeds the data"));
                }
                (0..n).map(|_| r.hash()).collect::<Result<_, _>>()?
            } else {
                Vec::new()
            };
            let target = if flags & HAS_TARGET == 0 {
                None
            } else if v2 {
                let t = r.bytes()?;
                if t.contains(&0) {
                    return Err(r.err("NUL in a symlink target"));
                }
                Some(rawname::from_bytes(t).into_owned())
            } else {
                Some(r.string()?)
            };
            let mut xattrs = std::collections::BTreeMap::new();
            if v2 {
                let n = r.varint()?;
                if n > (r.left() / 2) as u64 {
                    return Err(r.err("attribute count exceeds the data"));
                }
                for _ in 0..n {
                    let name = r.string()?;
                    let value = hex::encode(r.bytes()?);
                    if xattrs.insert(name, value).is_some() {
                        return Err(r.err("an extended attribute is listed twice"));
                    }
                }
            }
            entries.push(ManifestEntry {
                path,
                kind,
                mode,
                size,
                mtime_ns,
                hash,
                blocks,
                target,
                ino,
                ctime_ns,
                xattrs,
            });
        }
        if r.left() != 0 {
            return Err(r.err("trailing bytes"));
        }
        Ok(Manifest {
            version,
            export_id,
            block_size,
            read_only,
            root_mode,
            root_mtime_ns,
            entries,
        })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn err(&self, what: &'static str) -> ManifestCodecError {
        ManifestCodecError::Malformed {
            offset: self.pos,
            what,
        }
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ManifestCodecError> {
        if n > self.left() {
            return Err(self.err("cut short"));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, ManifestCodecError> {
        Ok(self.take(1)?[0])
    }

    fn varint(&mut self) -> Result<u64, ManifestCodecError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(self.err("varint overflows 64 bits"));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint too long"))
    }

    fn u32(&mut self) -> Result<u32, ManifestCodecError> {
        let v = self.varint()?;
        u32::try_from(v).map_err(|_| self.err("value exceeds 32 bits"))
    }

    fn zigzag(&mut self) -> Result<i64, ManifestCodecError> {
        let v = self.varint()?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }

    fn bytes(&mut self) -> Result<&'a [u8], ManifestCodecError> {
        let n = self.varint()?;
        if n > self.left() as u64 {
            return Err(self.err("string length exceeds the data"));
        }
        self.take(n as usize)
    }

    fn str(&mut self) -> Result<&'a str, ManifestCodecError> {
        let raw = self.bytes()?;
        std::str::from_utf8(raw).map_err(|_| self.err("string is not UTF-8"))
    }

    fn string(&mut self) -> Result<String, ManifestCodecError> {
        self.str().map(str::to_owned)
    }

    fn hash(&mut self) -> Result<String, ManifestCodecError> {
        Ok(hex::encode(self.take(32)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(s: &str) -> String {
        hex::encode(std::iter::repeat_n(s.as_bytes()[0], 32).collect::<Vec<u8>>())
    }

    fn sample() -> Manifest {
        Manifest {
            version: 1,
            export_id: "exp_1".into(),
            block_size: 1 << 20,
            read_only: true,
            root_mode: 0o755,
            root_mtime_ns: -5,
            entries: vec![
                ManifestEntry {
                    path: "src".into(),
                    kind: EntryKind::Dir,
                    mode: 0o755,
                    size: 0,
                    mtime_ns: 1_700_000_000_000_000_000,
                    hash: None,
                    blocks: vec![],
                    target: None,
                    ino: Some(12),
                    ctime_ns: Some(1_700_000_000_000_000_001),
                    xattrs: Default::default(),
                },
                ManifestEntry {
                    path: "src/é.rs".into(),
                    kind: EntryKind::File,
                    mode: 0o644,
                    size: 3,
                    mtime_ns: 7,
                    hash: Some(h("a")),
                    blocks: vec![h("a")],
                    target: None,
                    ino: None,
                    ctime_ns: None,
                    xattrs: Default::default(),
                },
                ManifestEntry {
                    path: "src/ê.rs".into(),
                    kind: EntryKind::File,
                    mode: 0o600,
                    size: 3 << 20,
                    mtime_ns: 7,
                    hash: Some(h("b")),
                    blocks: vec![h("c"), h("d"), h("c")],
                    target: None,
                    ino: Some(u64::MAX),
                    ctime_ns: Some(i64::MIN),
                    xattrs: Default::default(),
                },
                ManifestEntry {
                    path: "src/link".into(),
                    kind: EntryKind::Symlink,
                    mode: 0o777,
                    size: 6,
                    mtime_ns: 0,
                    hash: None,
                    blocks: vec![],
                    target: Some("../out".into()),
                    ino: Some(3),
                    ctime_ns: Some(0),
                    xattrs: Default::default(),
                },
                ManifestEntry {
                    path: "src/empty".into(),
                    kind: EntryKind::File,
                    mode: 0o644,
                    size: 0,
                    mtime_ns: 0,
                    hash: Some(h("e")),
                    blocks: vec![],
                    target: None,
                    ino: None,
                    ctime_ns: None,
                    xattrs: Default::default(),
                },
            ],
        }
    }

    #[test]
    fn round_trips_and_is_smaller_than_json() {
        let m = sample();
        let bin = m.to_binary().unwrap();
        assert_eq!(Manifest::from_binary(&bin).unwrap(), m);
        assert!(bin.len() * 2 < serde_json::to_vec(&m).unwrap().len());
    }

    #[test]
    fn format_1_unless_a_name_is_not_utf8_or_there_are_attributes() {
        let m = sample();
        let bin = m.to_binary().unwrap();
        assert_eq!(bin[4], FORMAT_V1, "an older mount must still read it");
        let mut raw = m.clone();
        raw.entries[1].path = crate::rawname::from_bytes(b"src/\xe9.rs").into_owned();
        raw.entries[3].target = Some(crate::rawname::from_bytes(b"../\xff").into_owned());
        let bin = raw.to_binary().unwrap();
        assert_eq!(bin[4], FORMAT_V2);
        let back = Manifest::from_binary(&bin).unwrap();
        assert_eq!(back, raw);
        assert_eq!(
            &*crate::rawname::to_bytes(&back.entries[1].path),
            b"src/\xe9.rs"
        );
        let mut xa = m.clone();
        xa.entries[1]
            .xattrs
            .insert("user.k".into(), hex::encode(b"\0v"));
        let bin = xa.to_binary().unwrap();
        assert_eq!(bin[4], FORMAT_V2);
        assert_eq!(Manifest::from_binary(&bin).unwrap(), xa);
        xa.entries[1].xattrs.insert("user.bad".into(), "zz".into());
        assert!(matches!(
            xa.to_binary(),
            Err(ManifestCodecError::BadXattr { .. })
        ));
    }

    #[test]
    fn bad_hashes_are_refused_when_encoding() {
        let mut m = sample();
        m.entries[1].blocks = vec!["xyz".into()];
        m.entries[1].hash = Some("xyz".into());
        assert!(matches!(
            m.to_binary(),
            Err(ManifestCodecError::BadHash { .. })
        ));
    }

    #[test]
    fn every_truncation_and_single_byte_change_is_an_error_or_a_manifest() {
        let mut v2 = sample();
        v2.entries[2].xattrs.insert("user.a".into(), "00ff".into());
        v2.entries[4].path = crate::rawname::from_bytes(b"src/\x80").into_owned();
        for bin in [sample().to_binary().unwrap(), v2.to_binary().unwrap()] {
            check_mutations(&bin);
        }
    }

    fn check_mutations(bin: &[u8]) {
        for cut in 0..bin.len() {
            assert!(Manifest::from_binary(&bin[..cut]).is_err(), "cut at {cut}");
        }
        for i in 0..bin.len() {
            for v in [0u8, 0x7f, 0x80, 0xff] {
                let mut b = bin.to_vec();
                b[i] = v;
                // Must not panic; either outcome is fine.
                let _ = Manifest::from_binary(&b);
            }
        }
        let mut trailing = bin.to_vec();
        trailing.push(0);
        assert!(Manifest::from_binary(&trailing).is_err());
    }

    #[test]
    fn huge_counts_are_refused_without_allocating() {
        let mut b = b"AWMF\x01\x01\x00\x01\x00\x00\x00".to_vec();
        // count = u64::MAX
        b.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
        assert!(matches!(
            Manifest::from_binary(&b),
            Err(ManifestCodecError::Malformed { .. })
        ));
    }
}
