//! Reading the block tier's answer to `POST /locate`: which fetches it calls for (ranged
//! reads of packs, each gathering the near blocks of one pack, and `GET`s of blocks stored
//! on their own), and how a fetched object becomes a verified block.

use awcp_protocol::dataplane::BlockLocations;

use super::{STORE_OBJECT_MAX, verify_block};
use crate::blockobj;

/// Blocks of one pack at most this far apart are read in one ranged `GET` (the bytes
/// between them are read and dropped: cheaper than a request of their own).
const RANGE_GAP: u64 = 64 << 10;
/// Most bytes one ranged `GET` reads.
const RANGE_SPAN: u64 = 16 << 20;

/// One fetch from the block tier: a block's own object, or a ranged read of a pack.
pub(super) enum StoreJob<'a> {
    Own(usize, &'a str),
    Range(&'a str, blockobj::RangeRead),
}

/// The fetches a `/locate` answer calls for: the packed blocks of each pack grouped into
/// ranged reads ([`blockobj::coalesce`]), largest first, then the blocks stored on their
/// own. Places that make no sense (a pack that is not listed, an oversized range) are left
/// out: those blocks come from the export.
pub(super) fn store_jobs(locs: &BlockLocations) -> Vec<StoreJob<'_>> {
    let mut by_pack: std::collections::BTreeMap<usize, Vec<(usize, u64, u32)>> = Default::default();
    let mut own = Vec::new();
    for (i, url) in locs.urls.iter().enumerate() {
        match locs.ranges.get(i).copied().flatten() {
            Some([pack, offset, len])
                if (pack as usize) < locs.packs.len()
                    && len <= STORE_OBJECT_MAX
                    && offset.checked_add(len).is_some() =>
            {
                by_pack
                    .entry(pack as usize)
                    .or_default()
                    .push((i, offset, len as u32));
            }
            Some(_) => {}
            None => {
                if let Some(u) = url {
                    own.push(StoreJob::Own(i, u.as_str()));
                }
            }
        }
    }
    let mut jobs: Vec<StoreJob<'_>> = by_pack
        .into_iter()
        .flat_map(|(pack, ranges)| {
            let url = locs.packs[pack].as_str();
            blockobj::coalesce(ranges, RANGE_GAP, RANGE_SPAN)
                .into_iter()
                .map(move |r| StoreJob::Range(url, r))
        })
        .collect();
    jobs.sort_by_key(|j| match j {
        StoreJob::Range(_, r) => std::cmp::Reverse(r.end - r.start),
        StoreJob::Own(..) => std::cmp::Reverse(0),
    });
    jobs.extend(own);
    jobs
}

pub(super) fn is_http(url: &str) -> bool {
    url.starts_with("http://") || url.starts_with("https://")
}

/// A block out of its stored object, if it decodes and matches `hash` (logged if not).
pub(super) fn decode_verified(object: Vec<u8>, hash: &str) -> Option<Vec<u8>> {
    let block = blockobj::decode(object, crate::export::MAX_BLOCK_SIZE as usize)?;
    if verify_block(hash, &block).is_err() {
        tracing::warn!(
            hash,
            "the block tier gave content that does not match its hash; asking the export"
        );
        return None;
    }
    Some(block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locate_answers_become_ranged_reads_and_own_gets() {
        let locs = BlockLocations {
            block_store: true,
            expires_at: None,
            urls: vec![
                None,
                Some("http://s/b3/x".into()),
                None,
                None,
                None,
                None,
                None,
            ],
            packs: vec!["http://s/p3/a".into(), "http://s/p3/b".into()],
            ranges: vec![
                Some([0, 0, 100]),
                None,
                Some([0, 100, 100]),
                Some([1, 0, 50]),
                // Not a listed pack, an oversized range: left to the export.
                Some([7, 0, 10]),
                Some([1, 0, STORE_OBJECT_MAX + 1]),
                // Far from the others in pack 0: a read of its own.
                Some([0, 1 << 20, 10]),
            ],
        };
        let jobs = store_jobs(&locs);
        let mut reads: Vec<(&str, Vec<usize>)> = jobs
            .iter()
            .filter_map(|j| match j {
                StoreJob::Range(url, r) => Some((*url, r.blocks.iter().map(|b| b.0).collect())),
                StoreJob::Own(..) => None,
            })
            .collect();
        reads.sort();
        assert_eq!(
            reads,
            vec![
                ("http://s/p3/a", vec![0, 2]),
                ("http://s/p3/a", vec![6]),
                ("http://s/p3/b", vec![3]),
            ]
        );
        let own: Vec<usize> = jobs
            .iter()
            .filter_map(|j| match j {
                StoreJob::Own(i, _) => Some(*i),
                StoreJob::Range(..) => None,
            })
            .collect();
        assert_eq!(own, vec![1]);
        // Largest reads first, own objects last.
        assert!(matches!(&jobs[0], StoreJob::Range(_, r) if r.blocks.len() == 2));
        assert!(matches!(jobs.last(), Some(StoreJob::Own(1, _))));
    }
}
