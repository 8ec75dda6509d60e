//! How a block is stored as an object of the block tier (an S3-compatible store), shared by
//! the export that writes objects and the mount that reads them through presigned URLs.
//!
//! An object holds one block, named by the block's blake3 hash, either as it is or as one
//! zstd frame. The rule that tells them apart needs no metadata: an object that starts with
//! the zstd magic number is a zstd frame. The writer compresses when that saves at least an
//! eighth of the block, and *always* when the block itself starts with the zstd magic (so a
//! raw block is never mistaken for a frame). The reader decompresses what starts with the
//! magic, bounded by the largest block, and the caller checks the result against the hash
//! whatever the store sent.

use std::io::Read;

/// The zstd frame magic number, as it appears at the start of a frame.
pub const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

/// zstd level of stored blocks (written once per block, read by every Executor).
const LEVEL: i32 = 3;

/// The object to store for `block`: a zstd frame where that pays (or where the block starts
/// with the magic number), else the block itself.
pub fn encode(block: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let must = block.starts_with(&ZSTD_MAGIC);
    if block.len() < 64 && !must {
        return block.into();
    }
    match zstd::bulk::compress(block, LEVEL) {
        Ok(z) if must || z.len() + block.len() / 8 <= block.len() => z.into(),
        _ => block.into(),
    }
}

/// The block an object holds: decompressed if it is a zstd frame (at most `max` bytes: a
/// frame that expands further is refused), else the object itself. `None` for a frame that
/// does not decode. The caller verifies the hash.
pub fn decode(object: Vec<u8>, max: usize) -> Option<Vec<u8>> {
    if !object.starts_with(&ZSTD_MAGIC) {
        return Some(object);
    }
    let mut out = Vec::new();
    let mut dec = zstd::stream::read::Decoder::new(object.as_slice()).ok()?;
    (&mut dec).take(max as u64 + 1).read_to_end(&mut out).ok()?;
    (out.len() <= max).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_round_trip_and_compress_where_it_pays() {
        let text = b"fn main() { println!(\"hello\"); }\n".repeat(100);
        let obj = encode(&text);
        assert!(obj.starts_with(&ZSTD_MAGIC) && obj.len() < text.len() / 4);
        assert_eq!(decode(obj.into_owned(), 1 << 20).unwrap(), text);
        // Incompressible: stored as it is.
        let mut noise = vec![0u8; 4096];
        blake3::Hasher::new()
            .update(b"noise")
            .finalize_xof()
            .fill(&mut noise);
        let obj = encode(&noise);
        assert_eq!(&*obj, &noise[..]);
        assert_eq!(decode(obj.into_owned(), 1 << 20).unwrap(), noise);
        // A block that starts with the magic number is always a frame, so it reads back as
        // itself, not as a failed decompression.
        let mut tricky = ZSTD_MAGIC.to_vec();
        tricky.extend_from_slice(&noise[..100]);
        let obj = encode(&tricky);
        assert_ne!(&*obj, &tricky[..]);
        assert_eq!(decode(obj.into_owned(), 1 << 20).unwrap(), tricky);
        // Tiny blocks stay raw.
        assert_eq!(&*encode(b"abc"), b"abc");
    }

    #[test]
    fn bombs_and_garbage_frames_are_refused() {
        let zeros = vec![0u8; 1 << 20];
        let obj = encode(&zeros).into_owned();
        assert!(obj.len() < 1000);
        assert!(
            decode(obj.clone(), 4096).is_none(),
            "expands past the bound"
        );
        assert_eq!(decode(obj, 1 << 20).unwrap().len(), 1 << 20);
        let mut garbage = ZSTD_MAGIC.to_vec();
        garbage.extend_from_slice(b"definitely not a frame");
        assert!(decode(garbage, 1 << 20).is_none());
    }
}
