//! The manifest as `GET /manifest` serves it: encoded, digested and compressed in two parts.
//!
//! The canonical encoding ([`Manifest::to_binary`]) is a short header — the export's id, its
//! flags, the root's mode and time — followed by the entries, which are nearly all of it
//! (about 6 MB at 100,000 files). The entries part depends on the entries alone, so it is
//! encoded and compressed once per walk ([`EncodedBody`]) and kept with a kept walk
//! (`reuse`): a registration that takes a kept walk encodes only its own header.
//!
//! What is served is the header's zstd frame followed by the body's: two frames that any
//! zstd decoder reads as one stream, giving the canonical encoding byte for byte. The
//! digest is still the blake3 of those whole uncompressed bytes, hashed anew for every
//! registration (a few milliseconds), so a mount checks exactly what it checked before.

use awcp_protocol::dataplane::{Manifest, ManifestEntry};
use awcp_protocol::manifest_bin::{EncodedEntries, ManifestCodecError};

/// zstd level of the served manifest (done once per walk).
const ZSTD_LEVEL: i32 = 3;
/// zstd level of the header frame (a few dozen bytes).
const HEADER_ZSTD_LEVEL: i32 = 1;

/// Why a manifest could not be encoded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EncodeError {
    /// An entry cannot be encoded.
    #[error("cannot encode the manifest")]
    Codec(#[source] ManifestCodecError),
    /// zstd failed.
    #[error("cannot compress the manifest")]
    Compress(#[source] std::io::Error),
}

/// A walk's entries, encoded and compressed: the part of the served manifest that
/// registrations of the same walk share.
#[derive(Debug)]
pub(crate) struct EncodedBody {
    entries: EncodedEntries,
    /// `entries` as one zstd frame.
    zst: Vec<u8>,
}

impl EncodedBody {
    /// Encode and compress `entries`.
    pub(crate) fn of(entries: &[ManifestEntry]) -> Result<EncodedBody, EncodeError> {
        let entries = EncodedEntries::encode(entries).map_err(EncodeError::Codec)?;
        let zst =
            zstd::bulk::compress(entries.as_bytes(), ZSTD_LEVEL).map_err(EncodeError::Compress)?;
        Ok(EncodedBody { entries, zst })
    }
}

/// The manifest as served, and its digest.
#[derive(Debug)]
pub(crate) struct Served {
    /// blake3 (hex) of the canonical encoding.
    pub(crate) digest: String,
    /// The canonical encoding as two zstd frames (header, entries).
    pub(crate) zst: Vec<u8>,
}

/// Serve the manifest whose header fields `manifest` holds (its `entries` are not read) and
/// whose entries `body` holds encoded.
pub(crate) fn serve(manifest: &Manifest, body: &EncodedBody) -> Result<Served, EncodeError> {
    let header = manifest.encode_header(&body.entries);
    let mut hasher = blake3::Hasher::new();
    hasher.update(&header);
    hasher.update(body.entries.as_bytes());
    let digest = hasher.finalize().to_hex().to_string();
    let mut zst =
        zstd::bulk::compress(&header, HEADER_ZSTD_LEVEL).map_err(EncodeError::Compress)?;
    zst.extend_from_slice(&body.zst);
    Ok(Served { digest, zst })
}

#[cfg(test)]
mod tests {
    use awcp_protocol::dataplane::{DATA_PLANE_VERSION, EntryKind};

    use super::*;

    fn manifest(export_id: &str, n: usize) -> Manifest {
        Manifest {
            version: DATA_PLANE_VERSION,
            export_id: export_id.into(),
            block_size: 4096,
            read_only: false,
            root_mode: 0o755,
            root_mtime_ns: 42,
            entries: (0..n)
                .map(|i| ManifestEntry {
                    path: format!("dir/file-{i:05}"),
                    kind: EntryKind::File,
                    mode: 0o644,
                    size: i as u64,
                    mtime_ns: i as i64,
                    hash: Some(blake3::hash(&i.to_le_bytes()).to_hex().to_string()),
                    blocks: vec![blake3::hash(&i.to_le_bytes()).to_hex().to_string()],
                    target: None,
                    ino: Some(i as u64 + 100),
                    ctime_ns: Some(i as i64 + 7),
                    xattrs: Default::default(),
                })
                .collect(),
        }
    }

    // The two-frame form must decode to the canonical encoding and carry its digest, for
    // any export id the shared body is served under: a mount checks the digest over what it
    // decoded, so a body reused under another header must still match.
    #[test]
    fn a_body_shared_by_two_exports_serves_each_its_canonical_encoding() {
        let first = manifest("exp_first", 2_000);
        let body = EncodedBody::of(&first.entries).unwrap();
        for m in [first.clone(), manifest("exp_other_id", 2_000)] {
            let served = serve(&m, &body).unwrap();
            let (decoded, digest) = crate::mount::remote::decode_manifest(&served.zst).unwrap();
            let canonical = m.to_binary().unwrap();
            assert_eq!(digest, blake3::hash(&canonical).to_hex().to_string());
            assert_eq!(served.digest, digest);
            assert_eq!(decoded, m);
        }
        let a = serve(&first, &body).unwrap();
        let b = serve(&manifest("exp_other_id", 2_000), &body).unwrap();
        assert_ne!(a.digest, b.digest, "the export id is part of the digest");
    }
}
