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
//!
//! **Packs.** Small blocks are stored many to an object instead ([`PackBuilder`]): a pack is
//! the concatenation of its blocks' objects (each encoded as above, so each decodes alone),
//! named by the blake3 of the pack's bytes, and a reader fetches a block by its byte range.
//! Beside each pack, a small **index** object ([`encode_pack_index`]) lists every block's
//! hash, offset and length, so that whoever lists the store (a restarted Delegator, another
//! one sharing the prefix) learns where blocks live. Readers coalesce the ranges of one pack
//! that lie close together into one ranged `GET` ([`coalesce`]) and split the answer
//! ([`split_range`]); every block is still checked against its hash.

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

/// Blocks of at most this many bytes go into packs; larger ones stay objects of their own
/// (one `GET` of a large block costs little beside its bytes).
pub const PACK_BLOCK_MAX: usize = 256 << 10;

/// A pack is closed once its objects reach this many bytes.
pub const PACK_TARGET: usize = 8 << 20;

/// The magic number an index object starts with.
pub const PACK_INDEX_MAGIC: [u8; 8] = *b"AWCPPX1\n";

/// Bytes of one index entry: hash, offset (u64 LE), length (u32 LE).
const INDEX_ENTRY: usize = 32 + 8 + 4;

/// Where one block's object sits in a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackEntry {
    /// The block's blake3 hash.
    pub hash: [u8; 32],
    /// Offset of its object in the pack.
    pub offset: u64,
    /// Length of its object (encoded as [`encode`] does).
    pub len: u32,
}

/// Builds one pack: blocks appended in order, each encoded as [`encode`] does.
#[derive(Debug, Default)]
pub struct PackBuilder {
    body: Vec<u8>,
    entries: Vec<PackEntry>,
}

impl PackBuilder {
    /// Append `block`, whose hash is `hash` (the caller has checked it).
    pub fn push(&mut self, hash: [u8; 32], block: &[u8]) {
        self.push_encoded(hash, &encode(block));
    }

    /// Append a block already encoded by [`encode`] (`obj`), whose hash is `hash`.
    pub fn push_encoded(&mut self, hash: [u8; 32], obj: &[u8]) {
        self.entries.push(PackEntry {
            hash,
            offset: self.body.len() as u64,
            len: obj.len() as u32,
        });
        self.body.extend_from_slice(obj);
    }

    /// Bytes so far.
    pub fn len(&self) -> usize {
        self.body.len()
    }

    /// Whether no block was appended.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The pack's name (the blake3 of its bytes), its bytes, and its entries.
    pub fn finish(self) -> ([u8; 32], Vec<u8>, Vec<PackEntry>) {
        (
            *blake3::hash(&self.body).as_bytes(),
            self.body,
            self.entries,
        )
    }
}

/// The index object of pack `pack`: the magic, the pack's name, the number of entries
/// (u32 LE), then each entry (hash, offset u64 LE, length u32 LE).
pub fn encode_pack_index(pack: &[u8; 32], entries: &[PackEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(44 + entries.len() * INDEX_ENTRY);
    out.extend_from_slice(&PACK_INDEX_MAGIC);
    out.extend_from_slice(pack);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for e in entries {
        out.extend_from_slice(&e.hash);
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.len.to_le_bytes());
    }
    out
}

/// Read an index object written by [`encode_pack_index`], for pack `pack` of `pack_size`
/// bytes: `None` unless it is well formed, names that pack, and every entry lies inside it.
pub fn decode_pack_index(data: &[u8], pack: &[u8; 32], pack_size: u64) -> Option<Vec<PackEntry>> {
    let rest = data.strip_prefix(&PACK_INDEX_MAGIC)?;
    let (name, rest) = rest.split_first_chunk::<32>()?;
    let (count, rest) = rest.split_first_chunk::<4>()?;
    if name != pack || rest.len() != u32::from_le_bytes(*count) as usize * INDEX_ENTRY {
        return None;
    }
    rest.chunks_exact(INDEX_ENTRY)
        .map(|c| {
            let hash: [u8; 32] = c[..32].try_into().ok()?;
            let offset = u64::from_le_bytes(c[32..40].try_into().ok()?);
            let len = u32::from_le_bytes(c[40..44].try_into().ok()?);
            (offset.checked_add(u64::from(len))? <= pack_size).then_some(PackEntry {
                hash,
                offset,
                len,
            })
        })
        .collect()
}

/// One ranged `GET` of a pack: bytes `start..end`, holding the listed blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeRead {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    /// The blocks it holds: (the caller's index, offset in the pack, length).
    pub blocks: Vec<(usize, u64, u32)>,
}

/// Group block ranges of one pack (`(caller's index, offset, length)`) into as few reads as
/// keep waste small: two ranges go into one read when the gap between them is at most
/// `max_gap` bytes and the read stays within `max_span` bytes (a block longer than that is
/// a read of its own).
pub fn coalesce(mut ranges: Vec<(usize, u64, u32)>, max_gap: u64, max_span: u64) -> Vec<RangeRead> {
    ranges.sort_by_key(|r| (r.1, r.2));
    let mut out: Vec<RangeRead> = Vec::new();
    for (i, off, len) in ranges {
        let end = off + u64::from(len);
        if let Some(last) = out.last_mut()
            && off <= last.end.saturating_add(max_gap)
            && end.max(last.end) - last.start <= max_span
        {
            last.end = last.end.max(end);
            last.blocks.push((i, off, len));
            continue;
        }
        out.push(RangeRead {
            start: off,
            end,
            blocks: vec![(i, off, len)],
        });
    }
    out
}

/// The objects of `read`'s blocks out of the bytes a ranged `GET` returned for it (`body`
/// starts at `read.start`); a block the body does not cover is `None`. Each object still
/// needs [`decode`] and a hash check.
pub fn split_range<'a>(read: &RangeRead, body: &'a [u8]) -> Vec<(usize, Option<&'a [u8]>)> {
    read.blocks
        .iter()
        .map(|&(i, off, len)| {
            let from = (off - read.start) as usize;
            (i, body.get(from..from + len as usize))
        })
        .collect()
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

    fn noise(n: usize, seed: &str) -> Vec<u8> {
        let mut v = vec![0u8; n];
        blake3::Hasher::new()
            .update(seed.as_bytes())
            .finalize_xof()
            .fill(&mut v);
        v
    }

    #[test]
    fn packs_hold_blocks_at_their_indexed_ranges() {
        let blocks = [
            noise(4096, "a"),
            b"text ".repeat(1000),
            noise(10, "c"),
            noise(70_000, "d"),
        ];
        let mut b = PackBuilder::default();
        for blk in &blocks {
            b.push(*blake3::hash(blk).as_bytes(), blk);
        }
        let (name, body, entries) = b.finish();
        assert_eq!(&name, blake3::hash(&body).as_bytes());
        let index = encode_pack_index(&name, &entries);
        let back = decode_pack_index(&index, &name, body.len() as u64).unwrap();
        assert_eq!(back, entries);
        // The compressible block was framed, the others stored as they are.
        assert!(entries[1].len < 1000);
        for (e, blk) in back.iter().zip(&blocks) {
            let obj = &body[e.offset as usize..(e.offset + u64::from(e.len)) as usize];
            assert_eq!(&decode(obj.to_vec(), 1 << 20).unwrap(), blk);
        }
        // An index for another pack, one that points past the end, or a truncated one is
        // refused.
        assert!(decode_pack_index(&index, &[0; 32], body.len() as u64).is_none());
        assert!(decode_pack_index(&index, &name, body.len() as u64 - 1).is_none());
        assert!(decode_pack_index(&index[..index.len() - 1], &name, body.len() as u64).is_none());
        assert!(decode_pack_index(b"garbage", &name, 1 << 30).is_none());
    }

    #[test]
    fn near_ranges_are_read_together_and_split_back() {
        // Out of order on purpose; block 3 is far away, block 4 too long for one read.
        let ranges = vec![
            (1, 5000, 1000),
            (0, 0, 4096),
            (2, 6000 + 60_000, 100),
            (3, 1 << 20, 10),
            (4, 2 << 20, 9 << 20),
        ];
        let reads = coalesce(ranges, 64 << 10, 8 << 20);
        assert_eq!(reads.len(), 3, "{reads:?}");
        assert_eq!((reads[0].start, reads[0].end), (0, 66_100));
        assert_eq!(
            reads[0].blocks.iter().map(|b| b.0).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!((reads[1].start, reads[1].end), (1 << 20, (1 << 20) + 10));
        assert_eq!(reads[2].blocks.len(), 1);
        let body: Vec<u8> = (0..66_100u32).map(|i| i as u8).collect();
        let parts = split_range(&reads[0], &body);
        assert_eq!(parts[1], (1, Some(&body[5000..6000])));
        // A short answer leaves the blocks it does not cover out.
        let parts = split_range(&reads[0], &body[..6000]);
        assert_eq!(parts[1].1.map(<[u8]>::len), Some(1000));
        assert_eq!(parts[2].1, None);
    }
}
