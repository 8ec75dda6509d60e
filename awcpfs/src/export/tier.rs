//! The block tier: the Delegator's blocks in an S3-compatible object store, so Executors
//! fetch content from the store instead of from the Delegator's process.
//!
//! * **What the store holds**: one object per distinct block, under
//!   `<prefix>/b3/<blake3 hex>`, encoded by [`crate::blockobj`] (zstd where it pays). Content
//!   addressing makes every object immutable and shared: by every export (delegation) of this
//!   Delegator, and by any Delegator writing to the same prefix.
//! * **Who writes**: the export, with the Delegator's credentials, which never leave it. A
//!   block is uploaded in the background after its export is registered, or at once when a
//!   mount asks where it is (`POST /locate`) before the background upload got to it. The
//!   tier knows which blocks the store has (a listing at start, then every upload and every
//!   `HEAD` that found one); a block is uploaded once however many mounts ask at the same
//!   time (uploads in flight are shared).
//! * **Who reads**: mounts, through presigned `GET` URLs the export hands out on
//!   `POST /locate` — behind the export's lease gate, valid for at most the URL lifetime
//!   ([`BlockTierConfig::url_ttl`], capped by the lease's flush grace). A revoke stops the
//!   handing out at once; URLs already handed out expire within the flush grace.
//! * **Trust**: none in the store. The mount verifies every block against its hash and asks
//!   the export (`POST /blocks`) for anything the store did not give it intact.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use object_store::ObjectStore;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::signer::Signer;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use super::store::{BlockHash, hash_hex, parse_hash};

/// Concurrent uploads of one export's background upload.
const WARM_CONCURRENCY: usize = 8;
/// Concurrent uploads and signatures while answering one `POST /locate`.
pub(crate) const LOCATE_CONCURRENCY: usize = 16;

/// Where the block tier is and how it behaves.
#[derive(Debug, Clone)]
pub struct BlockTierConfig {
    /// `s3://bucket` or `s3://bucket/prefix`. Endpoint, region and credentials come from the
    /// usual AWS environment variables (`AWS_ENDPOINT_URL`, `AWS_REGION`,
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_ALLOW_HTTP`,
    /// web identity, container and instance credentials), unless `options` sets them.
    pub url: String,
    /// How long a presigned URL stays valid (at least 1 s); the export caps it further at
    /// the lease's flush grace.
    pub url_ttl: Duration,
    /// Settings applied over the environment, as `object_store` S3 configuration keys
    /// (`aws_endpoint`, `aws_access_key_id`, `aws_allow_http`, …).
    pub options: Vec<(String, String)>,
}

/// Why the block tier could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The URL is not `s3://bucket[/prefix]`.
    #[error(
        "block tier URL {url:?} is not s3://bucket[/prefix]; give the bucket (and an optional key prefix)"
    )]
    BadUrl {
        /// The URL given.
        url: String,
    },
    /// The store client could not be configured.
    #[error("cannot configure the S3 client for {url}: {message}")]
    Config {
        /// The URL given.
        url: String,
        /// The client's words.
        message: String,
    },
    /// The store did not answer a listing of the prefix.
    #[error(
        "cannot list {url} (check AWS_ENDPOINT_URL, AWS_REGION and the credentials in the environment): {message}"
    )]
    Unreachable {
        /// The URL given.
        url: String,
        /// The client's words.
        message: String,
    },
}

/// Counters of the block tier (the whole Delegator), as reported by status endpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TierStats {
    /// Blocks the tier knows the store holds.
    pub blocks_in_store: u64,
    /// Objects this process uploaded.
    pub objects_uploaded: u64,
    /// Bytes of those objects (compressed where it paid).
    pub bytes_uploaded: u64,
    /// Presigned URLs handed out.
    pub urls_issued: u64,
    /// Uploads that failed (the export serves those blocks itself).
    pub upload_errors: u64,
}

/// The block tier of one Delegator process.
pub struct BlockTier {
    s3: Arc<AmazonS3>,
    url: String,
    prefix: String,
    url_ttl: Duration,
    present: RwLock<HashSet<BlockHash>>,
    inflight: Mutex<HashMap<BlockHash, Arc<tokio::sync::OnceCell<bool>>>>,
    objects_uploaded: AtomicU64,
    bytes_uploaded: AtomicU64,
    urls_issued: AtomicU64,
    upload_errors: AtomicU64,
}

impl std::fmt::Debug for BlockTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockTier")
            .field("url", &self.url)
            .field("url_ttl", &self.url_ttl)
            .finish_non_exhaustive()
    }
}

/// Split `s3://bucket/prefix` into the bucket and the prefix (without slashes at its ends).
fn parse_url(url: &str) -> Option<(String, String)> {
    let rest = url.strip_prefix("s3://")?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    let prefix = prefix.trim_matches('/');
    let ok_bucket = !bucket.is_empty()
        && bucket
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    let ok_prefix = prefix.split('/').all(|c| {
        prefix.is_empty() || (!c.is_empty() && c != "." && c != ".." && !c.contains('\0'))
    });
    (ok_bucket && ok_prefix).then(|| (bucket.to_owned(), prefix.to_owned()))
}

impl BlockTier {
    /// Connect to the store and learn which blocks it already holds (one listing of the
    /// prefix: at 1,000,000 blocks, 1,000 requests).
    pub async fn open(cfg: BlockTierConfig) -> Result<Arc<BlockTier>, TierError> {
        let (bucket, prefix) = parse_url(&cfg.url).ok_or_else(|| TierError::BadUrl {
            url: cfg.url.clone(),
        })?;
        let mut builder = AmazonS3Builder::from_env().with_bucket_name(&bucket);
        for (k, v) in &cfg.options {
            let key = k
                .parse()
                .map_err(|e: object_store::Error| TierError::Config {
                    url: cfg.url.clone(),
                    message: e.to_string(),
                })?;
            builder = builder.with_config(key, v);
        }
        let s3 = builder.build().map_err(|e| TierError::Config {
            url: cfg.url.clone(),
            message: e.to_string(),
        })?;
        let tier = BlockTier {
            s3: Arc::new(s3),
            url: cfg.url.clone(),
            prefix,
            url_ttl: cfg.url_ttl.max(Duration::from_secs(1)),
            present: RwLock::default(),
            inflight: Mutex::default(),
            objects_uploaded: AtomicU64::new(0),
            bytes_uploaded: AtomicU64::new(0),
            urls_issued: AtomicU64::new(0),
            upload_errors: AtomicU64::new(0),
        };
        let dir = ObjPath::from(tier.key_prefix());
        let mut listing = tier.s3.list(Some(&dir));
        let mut found = HashSet::new();
        while let Some(item) = listing.next().await {
            let meta = item.map_err(|e| TierError::Unreachable {
                url: cfg.url.clone(),
                message: e.to_string(),
            })?;
            if let Some(h) = meta.location.filename().and_then(parse_hash) {
                found.insert(h);
            }
        }
        drop(listing);
        tracing::info!(url = %cfg.url, blocks = found.len(), "block tier opened");
        *tier.present.write() = found;
        Ok(Arc::new(tier))
    }

    /// The key prefix of block objects.
    fn key_prefix(&self) -> String {
        if self.prefix.is_empty() {
            "b3".to_owned()
        } else {
            format!("{}/b3", self.prefix)
        }
    }

    /// The object key of a block.
    pub fn key(&self, hash: &[u8; 32]) -> String {
        format!("{}/{}", self.key_prefix(), hash_hex(hash))
    }

    /// How long a URL stays valid at most.
    pub fn url_ttl(&self) -> Duration {
        self.url_ttl
    }

    /// Whether the tier knows the store holds this block.
    pub fn contains(&self, hash: &[u8; 32]) -> bool {
        self.present.read().contains(hash)
    }

    /// Current counters.
    pub fn stats(&self) -> TierStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TierStats {
            blocks_in_store: self.present.read().len() as u64,
            objects_uploaded: get(&self.objects_uploaded),
            bytes_uploaded: get(&self.bytes_uploaded),
            urls_issued: get(&self.urls_issued),
            upload_errors: get(&self.upload_errors),
        }
    }

    /// Make sure the store holds `hash`, uploading what `read` gives (on the blocking
    /// pool) if it does not; one upload however many callers ask at once. Returns whether
    /// the store holds it now, and the bytes this call uploaded (0 when it was there or
    /// another caller uploaded it).
    pub(crate) async fn ensure(
        self: &Arc<Self>,
        hash: BlockHash,
        read: impl FnOnce() -> Option<Vec<u8>> + Send + 'static,
    ) -> (bool, u64) {
        if self.contains(&hash) {
            return (true, 0);
        }
        let cell = self.inflight.lock().entry(hash).or_default().clone();
        let uploaded = AtomicU64::new(0);
        let ok = *cell
            .get_or_init(|| async {
                let r = self.upload(hash, read).await;
                if let Ok(n) = r {
                    uploaded.store(n, Ordering::Relaxed);
                }
                r.is_ok()
            })
            .await;
        self.inflight.lock().remove(&hash);
        (ok, uploaded.load(Ordering::Relaxed))
    }

    /// `HEAD`, then read and `PUT` if absent. The bytes put (0 if it was there).
    async fn upload(
        &self,
        hash: BlockHash,
        read: impl FnOnce() -> Option<Vec<u8>> + Send + 'static,
    ) -> Result<u64, ()> {
        if self.contains(&hash) {
            return Ok(0);
        }
        let key = ObjPath::from(self.key(&hash));
        match self.s3.head(&key).await {
            Ok(_) => {
                self.present.write().insert(hash);
                return Ok(0);
            }
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "block tier: HEAD failed");
                self.upload_errors.fetch_add(1, Ordering::Relaxed);
                return Err(());
            }
        }
        let block = tokio::task::spawn_blocking(move || {
            let data = read()?;
            (blake3::hash(&data).as_bytes() == &hash)
                .then(|| crate::blockobj::encode(&data).into_owned())
        })
        .await
        .ok()
        .flatten()
        .ok_or(())?;
        let n = block.len() as u64;
        match self.s3.put(&key, bytes::Bytes::from(block).into()).await {
            Ok(_) => {
                self.present.write().insert(hash);
                self.objects_uploaded.fetch_add(1, Ordering::Relaxed);
                self.bytes_uploaded.fetch_add(n, Ordering::Relaxed);
                Ok(n)
            }
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "block tier: PUT failed");
                self.upload_errors.fetch_add(1, Ordering::Relaxed);
                Err(())
            }
        }
    }

    /// A presigned `GET` URL of a block's object, valid for `ttl` (1 s at least).
    pub(crate) async fn presign(&self, hash: &BlockHash, ttl: Duration) -> Option<String> {
        let key = ObjPath::from(self.key(hash));
        match self
            .s3
            .signed_url(reqwest_method_get(), &key, ttl.max(Duration::from_secs(1)))
            .await
        {
            Ok(url) => {
                self.urls_issued.fetch_add(1, Ordering::Relaxed);
                Some(url.to_string())
            }
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "block tier: cannot sign a URL");
                None
            }
        }
    }

    /// A presigned `PUT` URL for a block's object, valid for `ttl` (1 s at least), for an
    /// Executor writing back through the store. `None` when the store already holds the
    /// block (an object that is there is never handed out for overwriting).
    pub(crate) async fn presign_put(&self, hash: &BlockHash, ttl: Duration) -> Option<String> {
        if self.contains(hash) {
            return None;
        }
        let key = ObjPath::from(self.key(hash));
        match self
            .s3
            .signed_url(
                axum::http::Method::PUT,
                &key,
                ttl.max(Duration::from_secs(1)),
            )
            .await
        {
            Ok(url) => {
                self.urls_issued.fetch_add(1, Ordering::Relaxed);
                Some(url.to_string())
            }
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "block tier: cannot sign a PUT URL");
                None
            }
        }
    }

    /// A block an Executor put in the store: fetched with the Delegator's credentials,
    /// decoded and verified against its hash. An object that does not verify is deleted
    /// (an Executor must not leave garbage under a block's name for the others); `None`
    /// then, and when there is no such object.
    pub(crate) async fn adopt(&self, hash: &BlockHash) -> Option<Vec<u8>> {
        let key = ObjPath::from(self.key(hash));
        let got = match self.s3.get(&key).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => return None,
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "block tier: GET failed");
                return None;
            }
        };
        if got.meta.size > u64::from(super::MAX_BLOCK_SIZE) + 4096 {
            tracing::warn!(key = %key, size = got.meta.size, "block tier: object too large for a block; deleting it");
            let _ = self.s3.delete(&key).await;
            return None;
        }
        let object = got.bytes().await.ok()?.to_vec();
        let hash_owned = *hash;
        let block = tokio::task::spawn_blocking(move || {
            crate::blockobj::decode(object, super::MAX_BLOCK_SIZE as usize)
                .filter(|b| blake3::hash(b).as_bytes() == &hash_owned)
        })
        .await
        .ok()
        .flatten();
        match block {
            Some(b) => {
                self.present.write().insert(*hash);
                Some(b)
            }
            None => {
                tracing::warn!(key = %key, "block tier: an uploaded object does not match its hash; deleting it");
                self.present.write().remove(hash);
                let _ = self.s3.delete(&key).await;
                None
            }
        }
    }

    /// Upload every block of `export` the store lacks, in the background, while its lease
    /// is active. Needs a tokio runtime (registration runs on the blocking pool of one).
    pub(crate) fn warm(self: &Arc<Self>, export: &Arc<super::Export>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(export = %export.id, "block tier: no runtime for the background upload; blocks are uploaded as they are asked for");
            return;
        };
        let tier = self.clone();
        let export = export.clone();
        rt.spawn(async move {
            let mut seen = HashSet::new();
            let hashes: Vec<BlockHash> = export
                .manifest
                .entries
                .iter()
                .flat_map(|e| e.blocks.iter())
                .filter_map(|h| parse_hash(h))
                .filter(|h| seen.insert(*h) && !tier.contains(h))
                .collect();
            let total = hashes.len();
            let started = std::time::Instant::now();
            futures::stream::iter(hashes)
                .take_while(|_| {
                    let active = export.lease().check_access().is_ok();
                    async move { active }
                })
                .for_each_concurrent(WARM_CONCURRENCY, |h| {
                    let tier = tier.clone();
                    let export = export.clone();
                    async move {
                        let reader = export.clone();
                        let (_, n) = tier.ensure(h, move || reader.read_block(&h)).await;
                        export.note_store_upload(n);
                    }
                })
                .await;
            tracing::info!(export = %export.id, blocks = total, elapsed = ?started.elapsed(),
                "block tier: background upload done");
        });
    }
}

/// `GET`, as the signer's HTTP library (the `http` crate) spells it.
fn reqwest_method_get() -> axum::http::Method {
    axum::http::Method::GET
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_bucket_and_a_clean_prefix() {
        assert_eq!(parse_url("s3://b"), Some(("b".into(), "".into())));
        assert_eq!(parse_url("s3://b/"), Some(("b".into(), "".into())));
        assert_eq!(
            parse_url("s3://my-bucket/team/awcp/"),
            Some(("my-bucket".into(), "team/awcp".into()))
        );
        for bad in [
            "b",
            "http://b/x",
            "s3://",
            "s3:///x",
            "s3://b/../x",
            "s3://b/a//c",
        ] {
            assert_eq!(parse_url(bad), None, "{bad:?} accepted");
        }
    }
}
