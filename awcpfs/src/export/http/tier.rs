//! The block tier's routes: `POST /locate` (read gate), `POST /upload-urls` and
//! `POST /adopt` (write gate). See [`crate::export::tier`] for the store's layout and
//! `docs/PROTOCOL.md` for the wire.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::{Extension, Json};
use futures::StreamExt;

use awcp_protocol::dataplane::{BlockLocations, BlockRequest, LocateRequest, MissingBlocks};

use super::super::tier::{BlockReader, BlockTier, LOCATE_CONCURRENCY};
use super::{ApiError, BlockHash, Export, HASH_LIST_LIMIT, Stats, hash_hex, parse_hashes};
use super::{parse_json, read_body};

/// `POST /locate`: where the asked blocks are in the block tier (see [`BlockLocations`]).
/// Blocks the store lacks are stored first (once, however many mounts ask): packed for a
/// mount that reads ranges (`ranges: true`), which gets one URL per pack and each block's
/// range; as objects of their own for any other mount, which gets one URL per block. A
/// block that cannot be stored gets `null`, and the mount asks `/blocks`. URLs live for the
/// tier's URL lifetime capped at the lease's flush grace, so a revoke ends store access
/// within the grace; none is handed out once the lease has ended.
pub(super) async fn locate(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Json<BlockLocations>, ApiError> {
    let body = read_body(req, HASH_LIST_LIMIT).await?;
    let request: LocateRequest = parse_json("POST /locate", &body)?;
    let hashes = parse_hashes(&request.hashes)?;
    if let Some(tier) = export.tier() {
        tier.probe_if_due().await;
    }
    // The store may be slow or silent: answer within the tier's call timeout whatever it
    // does. What is not stored by then gets `null` (the mount asks `/blocks`); uploads
    // already started go on in the background.
    let deadline = export
        .tier()
        .map(|t| t.call_timeout())
        .unwrap_or(Duration::from_secs(5));
    let asked = hashes.len();
    let work = async {
        if request.ranges {
            locate_ranges(&export, hashes).await
        } else {
            tier_urls(&export, hashes, |tier, hash, ttl| {
                let export = export.clone();
                async move {
                    let reader = export.clone();
                    let (present, uploaded) =
                        tier.ensure(hash, move || reader.read_block(&hash)).await;
                    export.note_store_upload(uploaded);
                    if !present {
                        return None;
                    }
                    tier.presign(&hash, ttl).await
                }
            })
            .await
        }
    };
    let answer = match tokio::time::timeout(deadline, work).await {
        Ok(a) => a,
        Err(_) => {
            tracing::warn!(blocks = asked, waited = ?deadline,
                "block tier: the store did not answer in time; the mount fetches these blocks from the export");
            nothing_stored(asked)
        }
    };
    if answer.block_store {
        // A revoke while this answer was prepared: hand out nothing.
        export.lease().check_access()?;
        let signed = answer.urls.iter().filter(|u| u.is_some()).count() + answer.packs.len();
        Stats::add(&export.stats.store_urls, signed as u64);
    }
    Ok(Json(answer))
}

/// `/locate` for a mount that reads ranges: pack what the store lacks, then answer each
/// packed block's range in one URL per pack, and a URL for each block stored on its own.
async fn locate_ranges(export: &Arc<Export>, hashes: Vec<BlockHash>) -> BlockLocations {
    let Some((tier, ttl, expires_at)) = terms(export) else {
        return no_tier();
    };
    let reader = export.clone();
    let read: BlockReader = Arc::new(move |h: &BlockHash| reader.read_block(h));
    export.note_store_upload(tier.ensure_packed(&hashes, read).await);
    // Each pack once, in order of first use.
    let mut pack_pos: HashMap<u32, usize> = HashMap::new();
    let mut packs: Vec<u32> = Vec::new();
    let mut ranges: Vec<Option<(usize, u64, u32)>> = vec![None; hashes.len()];
    let mut own: Vec<(usize, BlockHash)> = Vec::new();
    for (i, h) in hashes.iter().enumerate() {
        if let Some(slot) = tier.slot(h) {
            let pos = *pack_pos.entry(slot.pack).or_insert_with(|| {
                packs.push(slot.pack);
                packs.len() - 1
            });
            ranges[i] = Some((pos, slot.offset, slot.len));
        } else if tier.has_object(h) {
            own.push((i, *h));
        }
    }
    let pack_urls: Vec<Option<String>> = futures::stream::iter(packs)
        .map(|p| {
            let tier = tier.clone();
            async move { tier.presign_pack(p, ttl).await }
        })
        .buffered(LOCATE_CONCURRENCY)
        .collect()
        .await;
    let own_urls: Vec<(usize, Option<String>)> = futures::stream::iter(own)
        .map(|(i, h)| {
            let tier = tier.clone();
            async move { (i, tier.presign(&h, ttl).await) }
        })
        .buffered(LOCATE_CONCURRENCY)
        .collect()
        .await;
    let mut urls = vec![None; hashes.len()];
    for (i, u) in own_urls {
        urls[i] = u;
    }
    // A pack whose URL could not be signed leaves its blocks to `/blocks`.
    let mut renumber = vec![None; pack_urls.len()];
    let mut signed = Vec::new();
    for (pos, u) in pack_urls.into_iter().enumerate() {
        if let Some(u) = u {
            renumber[pos] = Some(signed.len() as u64);
            signed.push(u);
        }
    }
    let ranges: Vec<Option<[u64; 3]>> = ranges
        .into_iter()
        .map(|r| {
            let (pos, offset, len) = r?;
            Some([renumber[pos]?, offset, u64::from(len)])
        })
        .collect();
    let any = ranges.iter().any(Option::is_some);
    BlockLocations {
        block_store: true,
        expires_at: Some(expires_at),
        urls,
        packs: signed,
        ranges: if any { ranges } else { Vec::new() },
    }
}

/// `POST /upload-urls` (write gate): presigned `PUT` URLs for blocks the Executor is about
/// to write back, so their bytes go to the block tier instead of this process; `null` for a
/// block the store already has (then `/adopt` finds it) or without a tier.
pub(super) async fn upload_urls(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Json<BlockLocations>, ApiError> {
    let body = read_body(req, HASH_LIST_LIMIT).await?;
    let request: BlockRequest = parse_json("POST /upload-urls", &body)?;
    let hashes = parse_hashes(&request.hashes)?;
    let answer = tier_urls(&export, hashes, |tier, hash, ttl| async move {
        tier.presign_put(&hash, ttl).await
    })
    .await;
    Ok(Json(answer))
}

/// The answer of an export whose tier holds none of `n` blocks (for now).
fn nothing_stored(n: usize) -> BlockLocations {
    BlockLocations {
        block_store: true,
        expires_at: None,
        urls: vec![None; n],
        packs: Vec::new(),
        ranges: Vec::new(),
    }
}

/// The answer of an export without a tier.
fn no_tier() -> BlockLocations {
    BlockLocations {
        block_store: false,
        expires_at: None,
        urls: Vec::new(),
        packs: Vec::new(),
        ranges: Vec::new(),
    }
}

/// The tier, the URLs' lifetime ([`url_ttl`]) and when they expire (RFC 3339), if the
/// export has a tier.
fn terms(export: &Export) -> Option<(Arc<BlockTier>, Duration, String)> {
    let tier = export.tier().cloned()?;
    let ttl = url_ttl(export, &tier);
    let expires = chrono::Utc::now()
        + chrono::Duration::from_std(ttl).unwrap_or(chrono::Duration::seconds(1));
    Some((
        tier,
        ttl,
        expires.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    ))
}

/// What `/locate` (for a mount that does not read ranges) and `/upload-urls` share: "no
/// tier" (`blockStore: false`) without one, else one URL or `null` per hash from `url`
/// (given the tier, the hash and the URLs' lifetime), a few hashes at a time, in the asked
/// order.
async fn tier_urls<F, Fut>(export: &Export, hashes: Vec<BlockHash>, url: F) -> BlockLocations
where
    F: Fn(Arc<BlockTier>, BlockHash, Duration) -> Fut,
    Fut: std::future::Future<Output = Option<String>>,
{
    let Some((tier, ttl, expires_at)) = terms(export) else {
        return no_tier();
    };
    let urls = futures::stream::iter(hashes)
        .map(|hash| url(tier.clone(), hash, ttl))
        .buffered(LOCATE_CONCURRENCY)
        .collect()
        .await;
    BlockLocations {
        block_store: true,
        expires_at: Some(expires_at),
        urls,
        packs: Vec::new(),
        ranges: Vec::new(),
    }
}

/// `POST /adopt` (write gate): take blocks the Executor put in the block tier — fetched
/// with the Delegator's credentials, verified, staged as `/upload` would — and answer those
/// still missing (`MissingBlocks`), which the Executor then uploads here.
pub(super) async fn adopt(
    Extension(export): Extension<Arc<Export>>,
    req: Request,
) -> Result<Json<MissingBlocks>, ApiError> {
    let body = read_body(req, HASH_LIST_LIMIT).await?;
    let request: BlockRequest = parse_json("POST /adopt", &body)?;
    let mut hashes = parse_hashes(&request.hashes)?;
    let mut seen = std::collections::HashSet::new();
    hashes.retain(|h| seen.insert(*h));
    let Some(tier) = export.tier().cloned() else {
        return Ok(Json(MissingBlocks {
            missing: hashes.iter().map(hash_hex).collect(),
        }));
    };
    let missing: Vec<Option<String>> = futures::stream::iter(hashes)
        .map(|hash| {
            let tier = tier.clone();
            let export = export.clone();
            async move {
                let e = export.clone();
                let have = tokio::task::spawn_blocking(move || e.blocks.has_block(&hash))
                    .await
                    .unwrap_or(false);
                if have {
                    return None;
                }
                let Some(block) = tier.adopt(&hash).await else {
                    return Some(hash_hex(&hash));
                };
                let n = block.len() as u64;
                let e = export.clone();
                let stored =
                    tokio::task::spawn_blocking(move || e.blocks.staging.store(&hash, &block))
                        .await
                        .map(|r| r.is_ok())
                        .unwrap_or(false);
                if !stored {
                    return Some(hash_hex(&hash));
                }
                Stats::add(&export.stats.store_bytes_adopted, n);
                None
            }
        })
        .buffered(LOCATE_CONCURRENCY)
        .collect()
        .await;
    Ok(Json(MissingBlocks {
        missing: missing.into_iter().flatten().collect(),
    }))
}

/// How long a URL of the block tier lives: the tier's lifetime, capped at the lease's flush
/// grace, at least 1 s.
fn url_ttl(export: &Export, tier: &BlockTier) -> Duration {
    let grace = export.lease().terms().flush_grace;
    tier.url_ttl()
        .min(grace.max(Duration::from_secs(1)))
        .max(Duration::from_secs(1))
}
