//! The block tier: the Delegator's blocks in an S3-compatible object store, so Executors
//! fetch content from the store instead of from the Delegator's process.
//!
//! * **What the store holds**: every distinct block once, encoded by [`crate::blockobj`]
//!   (zstd where it pays). Small blocks (at most [`blockobj::PACK_BLOCK_MAX`]) go many to a
//!   **pack** object, `<prefix>/p3/<blake3 of the pack>` (up to [`blockobj::PACK_TARGET`]),
//!   beside its index object `<prefix>/p3/<same>.idx` (hash → offset, length), put after
//!   the pack; larger blocks are objects of their own, `<prefix>/b3/<blake3 hex>`, and so
//!   is a block a mount that does not read packs asks for. Content addressing makes every
//!   object immutable and shared: by every export (delegation) of this Delegator, and by any
//!   Delegator writing to the same prefix.
//! * **Who writes**: the export, with the Delegator's credentials, which never leave it.
//!   After its export is registered, the background upload packs the blocks the store lacks
//!   in manifest order (so a directory's files sit side by side in a pack); a mount asking
//!   where blocks are (`POST /locate`) before the upload got to them has them packed (or
//!   put) at once. The tier knows which blocks the store has (a listing of the prefix and
//!   every pack index at start, then every upload and every `HEAD` that found one); a block
//!   is uploaded once however many mounts ask at the same time (uploads in flight are
//!   shared, and a block being packed is waited for, not packed again).
//! * **Who reads**: mounts, through presigned `GET` URLs the export hands out on
//!   `POST /locate` — one per pack in the answer, with each block's byte range, for a mount
//!   that reads ranges; one per block otherwise — behind the export's lease gate, valid for
//!   at most the URL lifetime ([`BlockTierConfig::url_ttl`], capped by the lease's flush
//!   grace). A revoke stops the handing out at once; URLs already handed out expire within
//!   the flush grace.
//! * **Trust**: none in the store. The mount verifies every block against its hash and asks
//!   the export (`POST /blocks`) for anything the store did not give it intact.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjPath;
use object_store::signer::Signer;
use object_store::{ClientConfigKey, ObjectStore};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use super::store::{BlockHash, hash_hex, parse_hash};
use crate::blockobj::{self, PackBuilder, PackEntry};

pub mod awsfiles;
mod health;

pub use health::BreakerState;
use health::{CallError, Health};

/// Concurrent uploads of one export's background upload.
const WARM_CONCURRENCY: usize = 8;
/// Concurrent uploads and signatures while answering one `POST /locate`.
pub(crate) const LOCATE_CONCURRENCY: usize = 16;
/// Packs one export's background upload builds and puts at once (one is read while the
/// other is on the wire).
const WARM_PACKS: usize = 2;
/// The background upload's first pack (it doubles up to [`blockobj::PACK_TARGET`]): the
/// mounts that start with the export wait for the first blocks, so those come soonest.
const WARM_FIRST_PACK: u64 = 1 << 20;

/// How long one call to the store may take by default ([`BlockTierConfig::call_timeout`]).
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Most verifications of blocks the mounts could not get from the store that run at once
/// ([`BlockTier::suspect`]); more are dropped (the next fallback asks again).
const VERIFY_CONCURRENCY: usize = 32;

/// Reads a block of the export (blocking; on the blocking pool).
pub(crate) type BlockReader = Arc<dyn Fn(&BlockHash) -> Option<Vec<u8>> + Send + Sync>;

/// Where a packed block is: its pack (an index into the tier's pack names), offset and
/// length of its object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PackSlot {
    pub pack: u32,
    pub offset: u64,
    pub len: u32,
}

/// The packs the tier knows of, and where each packed block is.
#[derive(Debug, Default)]
struct PackTable {
    names: Vec<BlockHash>,
    at: HashMap<BlockHash, PackSlot>,
}

impl PackTable {
    /// Record a pack; a block already known in another pack keeps its first place.
    fn add(&mut self, name: BlockHash, entries: &[PackEntry]) {
        let pack = self.names.len() as u32;
        self.names.push(name);
        for e in entries {
            self.at.entry(e.hash).or_insert(PackSlot {
                pack,
                offset: e.offset,
                len: e.len,
            });
        }
    }

    /// Forget pack `name` (gone from the store): its blocks are no longer packed anywhere
    /// (a block is known at its first place only). Pack numbers stay as they are. The
    /// blocks forgotten.
    fn forget(&mut self, name: &BlockHash) -> usize {
        let packs: HashSet<u32> = (0..self.names.len() as u32)
            .filter(|&i| &self.names[i as usize] == name)
            .collect();
        let before = self.at.len();
        self.at.retain(|_, slot| !packs.contains(&slot.pack));
        before - self.at.len()
    }
}

/// A pack upload in flight, shared by every block it holds: resolves to the bytes put.
type PackingFuture = Shared<BoxFuture<'static, u64>>;

/// Where the block tier is and how it behaves.
#[derive(Debug, Clone)]
pub struct BlockTierConfig {
    /// `s3://bucket` or `s3://bucket/prefix`. Endpoint, region and credentials come, first
    /// found first, from `options`, from the usual AWS environment variables
    /// (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    /// `AWS_SESSION_TOKEN`, `AWS_ALLOW_HTTP`, web identity), from the AWS shared files of
    /// profile `AWS_PROFILE` (else `default`) — `aws_access_key_id`,
    /// `aws_secret_access_key`, `aws_session_token` of `~/.aws/credentials` (or
    /// `AWS_SHARED_CREDENTIALS_FILE`), else of the config file; `region` and `endpoint_url`
    /// of `~/.aws/config` (or `AWS_CONFIG_FILE`), an `http://` one allowing plain HTTP; see
    /// [`awsfiles`] — and last from the container or instance metadata service. Credentials
    /// are taken as a group, from one place only.
    pub url: String,
    /// How long a presigned URL stays valid (at least 1 s); the export caps it further at
    /// the lease's flush grace.
    pub url_ttl: Duration,
    /// Settings applied over the environment, as `object_store` S3 configuration keys
    /// (`aws_endpoint`, `aws_access_key_id`, `aws_allow_http`, …).
    pub options: Vec<(String, String)>,
    /// The longest one call to the store may take, its client's retries included; also the
    /// longest `POST /locate` waits for the store before it answers `null` for what is not
    /// stored yet (see `tier/health.rs`, and [`BreakerState`]).
    pub call_timeout: Duration,
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
        "cannot list {url} (check the endpoint, region and credentials: AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID… in the environment, or the profile in ~/.aws/config and ~/.aws/credentials): {message}"
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
    /// Blocks the tier knows the store holds (as objects of their own or in packs).
    pub blocks_in_store: u64,
    /// Of those, blocks in packs.
    pub blocks_in_packs: u64,
    /// Packs the tier knows of.
    pub packs: u64,
    /// Objects this process uploaded (packs and their indexes included).
    pub objects_uploaded: u64,
    /// Packs this process uploaded.
    pub packs_uploaded: u64,
    /// Bytes of those objects (compressed where it paid).
    pub bytes_uploaded: u64,
    /// Presigned URLs handed out.
    pub urls_issued: u64,
    /// Uploads that failed (the export serves those blocks itself).
    pub upload_errors: u64,
    /// Calls to the store that failed or ran out of time (uploads, reads, probes).
    pub store_errors: u64,
    /// The circuit breaker over the store: `closed` (in use), `open` (not used: no URL is
    /// signed, the export serves every block), `half-open` (a probe is due or out).
    pub breaker: BreakerState,
    /// Times the breaker opened.
    pub breaker_trips: u64,
    /// Objects the tier believed stored and found gone (a store that lost data): forgotten,
    /// and stored again when next asked for.
    pub objects_forgotten: u64,
}

/// The block tier of one Delegator process.
pub struct BlockTier {
    s3: Arc<AmazonS3>,
    url: String,
    prefix: String,
    url_ttl: Duration,
    /// Blocks stored as objects of their own.
    present: RwLock<HashSet<BlockHash>>,
    packed: RwLock<PackTable>,
    inflight: Mutex<HashMap<BlockHash, Arc<tokio::sync::OnceCell<bool>>>>,
    /// Blocks being packed, and the upload that will store them.
    packing: Mutex<HashMap<BlockHash, PackingFuture>>,
    objects_uploaded: AtomicU64,
    packs_uploaded: AtomicU64,
    bytes_uploaded: AtomicU64,
    urls_issued: AtomicU64,
    upload_errors: AtomicU64,
    health: Health,
    /// Blocks (or packs) being checked after a mount could not get them from the store.
    verifying: Mutex<HashSet<BlockHash>>,
    objects_forgotten: AtomicU64,
}

impl std::fmt::Debug for BlockTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockTier")
            .field("url", &self.url)
            .field("url_ttl", &self.url_ttl)
            .finish_non_exhaustive()
    }
}

/// The settings from the AWS shared files that `options` (explicit settings) leave to them:
/// none of the credentials when `options` has any (a key and a secret from two places never
/// meet), no endpoint (nor the plain HTTP that came with it) when `options` has one, and no
/// key `options` has.
fn files_under_options(
    files: Vec<(AmazonS3ConfigKey, String)>,
    options: impl Iterator<Item = AmazonS3ConfigKey>,
) -> Vec<(AmazonS3ConfigKey, String)> {
    use AmazonS3ConfigKey::{AccessKeyId, Endpoint, SecretAccessKey, Token};
    let explicit: HashSet<AmazonS3ConfigKey> = options.collect();
    let credentials = [AccessKeyId, SecretAccessKey, Token]
        .iter()
        .any(|k| explicit.contains(k));
    let endpoint = explicit.contains(&Endpoint);
    files
        .into_iter()
        .filter(|(k, _)| {
            let dropped = explicit.contains(k)
                || (credentials && matches!(k, AccessKeyId | SecretAccessKey | Token))
                || (endpoint && matches!(k, AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp)));
            !dropped
        })
        .collect()
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
        let config_error = |message: String| TierError::Config {
            url: cfg.url.clone(),
            message,
        };
        let options = cfg
            .options
            .iter()
            .map(|(k, v)| Ok((k.parse::<AmazonS3ConfigKey>()?, v)))
            .collect::<Result<Vec<_>, object_store::Error>>()
            .map_err(|e| config_error(e.to_string()))?;
        // Precedence: `options`, then the environment, then the AWS shared files.
        let files =
            awsfiles::shared_config(|k| std::env::var(k).ok(), |p| std::fs::read_to_string(p))
                .map_err(|e| config_error(e.to_string()))?;
        let files = files_under_options(files, options.iter().map(|(k, _)| *k));
        if !files.is_empty() {
            // The key names only: the values hold secrets.
            let keys: Vec<&str> = files.iter().map(|(k, _)| k.as_ref()).collect();
            tracing::info!(?keys, "block tier: settings from the AWS shared files");
        }
        // Every request is bounded, retries included: a store that stops answering must
        // cost a mount seconds, not the client's default of minutes.
        let call_timeout = cfg.call_timeout.max(Duration::from_millis(100));
        let per_request = call_timeout / 2;
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(&bucket)
            .with_retry(object_store::RetryConfig {
                backoff: object_store::BackoffConfig {
                    init_backoff: Duration::from_millis(50),
                    max_backoff: per_request / 4,
                    base: 2.0,
                },
                max_retries: 2,
                retry_timeout: call_timeout,
            })
            .with_config(
                AmazonS3ConfigKey::Client(ClientConfigKey::Timeout),
                format!("{}ms", per_request.as_millis()),
            )
            .with_config(
                AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
                format!("{}ms", per_request.min(Duration::from_secs(2)).as_millis()),
            );
        for (key, v) in files {
            builder = builder.with_config(key, v);
        }
        for (key, v) in options {
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
            packed: RwLock::default(),
            inflight: Mutex::default(),
            packing: Mutex::default(),
            objects_uploaded: AtomicU64::new(0),
            packs_uploaded: AtomicU64::new(0),
            bytes_uploaded: AtomicU64::new(0),
            urls_issued: AtomicU64::new(0),
            upload_errors: AtomicU64::new(0),
            health: Health::new(call_timeout),
            verifying: Mutex::default(),
            objects_forgotten: AtomicU64::new(0),
        };
        let unreachable = |e: object_store::Error| TierError::Unreachable {
            url: cfg.url.clone(),
            message: e.to_string(),
        };
        let mut found = HashSet::new();
        let mut listing = tier.s3.list(Some(&ObjPath::from(tier.key_prefix("b3"))));
        while let Some(item) = listing.next().await {
            let meta = item.map_err(unreachable)?;
            if let Some(h) = meta.location.filename().and_then(parse_hash) {
                found.insert(h);
            }
        }
        drop(listing);
        // Packs, and their indexes (an index is put after its pack: one without its pack
        // is left over from a failed upload and ignored).
        let mut pack_sizes = HashMap::new();
        let mut indexes = Vec::new();
        let mut listing = tier.s3.list(Some(&ObjPath::from(tier.key_prefix("p3"))));
        while let Some(item) = listing.next().await {
            let meta = item.map_err(unreachable)?;
            let Some(name) = meta.location.filename() else {
                continue;
            };
            if let Some(h) = name.strip_suffix(".idx").and_then(parse_hash) {
                indexes.push(h);
            } else if let Some(h) = parse_hash(name) {
                pack_sizes.insert(h, meta.size);
            }
        }
        drop(listing);
        let tier = Arc::new(tier);
        let read: Vec<_> = futures::stream::iter(indexes)
            .filter_map(|name| {
                let size = pack_sizes.get(&name).copied();
                async move { size.map(|s| (name, s)) }
            })
            .map(|(name, size)| {
                let tier = tier.clone();
                async move { (name, tier.read_index(&name, size).await) }
            })
            .buffer_unordered(LOCATE_CONCURRENCY)
            .collect()
            .await;
        {
            let mut table = tier.packed.write();
            for (name, entries) in read {
                if let Some(entries) = entries {
                    table.add(name, &entries);
                }
            }
        }
        let (packs, packed) = {
            let t = tier.packed.read();
            (t.names.len(), t.at.len())
        };
        tracing::info!(url = %cfg.url, blocks = found.len(), packs, packed, "block tier opened");
        *tier.present.write() = found;
        tier.keep_probing();
        Ok(tier)
    }

    /// A pack's index from the store, checked against the pack's size; `None` (logged) if
    /// it cannot be read or is malformed.
    async fn read_index(&self, name: &BlockHash, pack_size: u64) -> Option<Vec<PackEntry>> {
        let key = ObjPath::from(format!("{}.idx", self.pack_key(name)));
        let data = match self.s3.get(&key).await {
            Ok(g) => g.bytes().await.ok()?,
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "block tier: cannot read a pack index");
                return None;
            }
        };
        let entries = blockobj::decode_pack_index(&data, name, pack_size);
        if entries.is_none() {
            tracing::warn!(key = %key, "block tier: a malformed pack index; ignoring its pack");
        }
        entries
    }

    /// The key prefix of block objects (`b3`) or packs (`p3`).
    fn key_prefix(&self, kind: &str) -> String {
        if self.prefix.is_empty() {
            kind.to_owned()
        } else {
            format!("{}/{kind}", self.prefix)
        }
    }

    /// The object key of a block stored on its own.
    pub fn key(&self, hash: &[u8; 32]) -> String {
        format!("{}/{}", self.key_prefix("b3"), hash_hex(hash))
    }

    /// The object key of a pack (its index is the same with `.idx`).
    pub fn pack_key(&self, name: &[u8; 32]) -> String {
        format!("{}/{}", self.key_prefix("p3"), hash_hex(name))
    }

    /// How long a URL stays valid at most.
    pub fn url_ttl(&self) -> Duration {
        self.url_ttl
    }

    /// Whether the tier knows the store holds this block (on its own or in a pack).
    pub fn contains(&self, hash: &[u8; 32]) -> bool {
        self.present.read().contains(hash) || self.packed.read().at.contains_key(hash)
    }

    /// Whether the store holds this block as an object of its own.
    pub(crate) fn has_object(&self, hash: &[u8; 32]) -> bool {
        self.present.read().contains(hash)
    }

    /// Where this block is packed, if it is.
    pub(crate) fn slot(&self, hash: &[u8; 32]) -> Option<PackSlot> {
        self.packed.read().at.get(hash).copied()
    }

    /// The longest one call to the store may take ([`BlockTierConfig::call_timeout`]).
    pub fn call_timeout(&self) -> Duration {
        self.health.timeout()
    }

    /// Whether the store is in use: the breaker is closed. While it is not, no URL is
    /// signed and nothing is uploaded; the export serves every block.
    pub fn in_use(&self) -> bool {
        self.health.state() == BreakerState::Closed
    }

    /// While the breaker is open and its back-off has ended, send the probe that tells
    /// whether the store answers again (a `HEAD` of a name no block has: `NotFound` is an
    /// answer). Bounded by the call timeout; nothing while the breaker is closed, or while
    /// the back-off runs or another probe is out.
    pub(crate) async fn probe_if_due(&self) {
        if self.health.state() == BreakerState::HalfOpen {
            let key = ObjPath::from(format!("{}/probe", self.key_prefix("b3")));
            let _ = self.health.call("probe", self.s3.head(&key)).await;
        }
    }

    /// Probe the store whenever the breaker's back-off has ended, traffic or not, so that
    /// a store that answers again is used again without waiting for a mount to ask. Stops
    /// with the tier.
    fn keep_probing(self: &Arc<Self>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let tier = Arc::downgrade(self);
        rt.spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let Some(tier) = tier.upgrade() else { return };
                tier.probe_if_due().await;
            }
        });
    }

    /// A mount asked the export for a block this tier believes the store holds: it could
    /// not get it from the store. Check in the background (a `HEAD` of its object, or of
    /// its pack) and forget what is gone, so that no more URLs are signed for it and it is
    /// stored again when next asked for — a store restarted without its data costs each
    /// object one fallback, not every read until the daemon restarts.
    pub(crate) fn suspect(self: &Arc<Self>, hash: &BlockHash) {
        if !self.in_use() || !self.contains(hash) {
            return;
        }
        let pack = self
            .slot(hash)
            .and_then(|s| self.packed.read().names.get(s.pack as usize).copied());
        let (id, key) = match pack {
            Some(name) => (name, self.pack_key(&name)),
            None => (*hash, self.key(hash)),
        };
        {
            let mut v = self.verifying.lock();
            if v.len() >= VERIFY_CONCURRENCY || !v.insert(id) {
                return;
            }
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.verifying.lock().remove(&id);
            return;
        };
        let tier = self.clone();
        let hash = *hash;
        rt.spawn(async move {
            let key = ObjPath::from(key);
            if let Err(CallError::NotFound) = tier.health.call("HEAD", tier.s3.head(&key)).await {
                let blocks = match pack {
                    Some(name) => tier.packed.write().forget(&name),
                    None => usize::from(tier.present.write().remove(&hash)),
                };
                tier.objects_forgotten.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key = %key, blocks,
                    "block tier: an object the store held is gone (a store restarted without \
                     its data?); forgetting it, it is stored again when next asked for");
            }
            tier.verifying.lock().remove(&id);
        });
    }

    /// Current counters.
    pub fn stats(&self) -> TierStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let (packs, in_packs, both) = {
            let p = self.packed.read();
            let present = self.present.read();
            let both = p.at.keys().filter(|h| present.contains(*h)).count();
            (p.names.len(), p.at.len(), both)
        };
        TierStats {
            blocks_in_store: (self.present.read().len() + in_packs - both) as u64,
            blocks_in_packs: in_packs as u64,
            packs: packs as u64,
            objects_uploaded: get(&self.objects_uploaded),
            packs_uploaded: get(&self.packs_uploaded),
            bytes_uploaded: get(&self.bytes_uploaded),
            urls_issued: get(&self.urls_issued),
            upload_errors: get(&self.upload_errors),
            store_errors: get(&self.health.errors),
            breaker: self.health.state(),
            breaker_trips: get(&self.health.trips),
            objects_forgotten: get(&self.objects_forgotten),
        }
    }

    /// Make sure the store holds `hash` as an object of its own (what a mount that does not
    /// read packs fetches), uploading what `read` gives (on the blocking pool) if it does
    /// not; one upload however many callers ask at once. Returns whether the store holds it
    /// now, and the bytes this call uploaded (0 when it was there or another caller
    /// uploaded it).
    pub(crate) async fn ensure(
        self: &Arc<Self>,
        hash: BlockHash,
        read: impl FnOnce() -> Option<Vec<u8>> + Send + 'static,
    ) -> (bool, u64) {
        if self.has_object(&hash) {
            return (true, 0);
        }
        if !self.in_use() {
            return (false, 0);
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
        if self.has_object(&hash) {
            return Ok(0);
        }
        let key = ObjPath::from(self.key(&hash));
        match self.health.call("HEAD", self.s3.head(&key)).await {
            Ok(_) => {
                self.present.write().insert(hash);
                return Ok(0);
            }
            Err(CallError::NotFound) => {}
            Err(CallError::Unavailable) => return Err(()),
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
        let put = self.s3.put(&key, bytes::Bytes::from(block).into());
        match self.health.call("PUT", put).await {
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
        self.presign_get(ObjPath::from(self.key(hash)), ttl).await
    }

    /// A presigned `GET` URL of pack number `pack`, valid for `ttl` (1 s at least); a mount
    /// reads its blocks by range.
    pub(crate) async fn presign_pack(&self, pack: u32, ttl: Duration) -> Option<String> {
        let name = *self.packed.read().names.get(pack as usize)?;
        self.presign_get(ObjPath::from(self.pack_key(&name)), ttl)
            .await
    }

    async fn presign_get(&self, key: ObjPath, ttl: Duration) -> Option<String> {
        if !self.in_use() {
            return None;
        }
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
        if self.contains(hash) || !self.in_use() {
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
        if !self.has_object(hash)
            && let Some(block) = self.read_packed(hash).await
        {
            return Some(block);
        }
        let key = ObjPath::from(self.key(hash));
        let get = async { self.s3.get(&key).await?.bytes().await };
        let object = match self.health.call("GET", get).await {
            Ok(b) => b,
            Err(CallError::NotFound | CallError::Unavailable) => return None,
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "block tier: GET failed");
                return None;
            }
        };
        if object.len() as u64 > u64::from(super::MAX_BLOCK_SIZE) + 4096 {
            tracing::warn!(key = %key, size = object.len(), "block tier: object too large for a block; deleting it");
            let _ = self.health.call("DELETE", self.s3.delete(&key)).await;
            return None;
        }
        let object = object.to_vec();
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
                let _ = self.health.call("DELETE", self.s3.delete(&key)).await;
                None
            }
        }
    }

    /// A packed block read back with the Delegator's credentials (a ranged `GET`),
    /// decoded and verified; `None` if it is not packed or does not verify (the pack is
    /// left alone: other blocks live in it).
    async fn read_packed(&self, hash: &BlockHash) -> Option<Vec<u8>> {
        let slot = self.slot(hash)?;
        let name = *self.packed.read().names.get(slot.pack as usize)?;
        let key = ObjPath::from(self.pack_key(&name));
        let range = slot.offset..slot.offset + u64::from(slot.len);
        let object = match self
            .health
            .call("ranged GET", self.s3.get_range(&key, range))
            .await
        {
            Ok(b) => b.to_vec(),
            Err(CallError::Unavailable) => return None,
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "block tier: ranged GET of a pack failed");
                return None;
            }
        };
        let hash = *hash;
        let block = tokio::task::spawn_blocking(move || {
            blockobj::decode(object, super::MAX_BLOCK_SIZE as usize)
                .filter(|b| blake3::hash(b).as_bytes() == &hash)
        })
        .await
        .ok()
        .flatten();
        if block.is_none() {
            tracing::warn!(key = %key, "block tier: a packed block does not match its hash");
        }
        block
    }

    /// Make sure the store holds every block of `hashes`, packing the small ones it lacks
    /// (read with `read` on the blocking pool) and putting the large ones on their own. A
    /// block another caller is already uploading is waited for, not uploaded again. Returns
    /// the bytes this call put; afterwards [`BlockTier::contains`] says which blocks the
    /// store holds (not those that could not be read or put).
    pub(crate) async fn ensure_packed(
        self: &Arc<Self>,
        hashes: &[BlockHash],
        read: BlockReader,
    ) -> u64 {
        if !self.in_use() {
            return 0;
        }
        let mut waits: Vec<PackingFuture> = Vec::new();
        let mine = {
            let mut packing = self.packing.lock();
            let mut claim = Vec::new();
            let mut seen = HashSet::new();
            for h in hashes {
                if !seen.insert(*h) || self.contains(h) {
                    continue;
                }
                match packing.get(h) {
                    // Many blocks share one upload: wait for each upload once.
                    Some(f) if !waits.iter().any(|w| w.ptr_eq(f)) => waits.push(f.clone()),
                    Some(_) => {}
                    None => claim.push(*h),
                }
            }
            if claim.is_empty() {
                None
            } else {
                // The upload runs as a task of its own: it finishes (and resolves every
                // waiter) even if this caller goes away.
                let task = tokio::spawn(self.clone().upload_packs(claim.clone(), read));
                let fut: PackingFuture = async move { task.await.unwrap_or(0) }.boxed().shared();
                for h in claim {
                    packing.insert(h, fut.clone());
                }
                Some(fut)
            }
        };
        futures::future::join_all(waits).await;
        match mine {
            Some(f) => f.await,
            None => 0,
        }
    }

    /// Read `claim` in order, put its large blocks on their own and pack the small ones
    /// (packs of up to [`blockobj::PACK_TARGET`]); then release the claim. The bytes put.
    async fn upload_packs(self: Arc<Self>, claim: Vec<BlockHash>, read: BlockReader) -> u64 {
        enum Item {
            Small(BlockHash, Vec<u8>),
            Put(u64),
        }
        let mut items = futures::stream::iter(claim.clone())
            .map(|hash| {
                let read = read.clone();
                let tier = self.clone();
                async move {
                    // Read, check and encode off the runtime.
                    let got = tokio::task::spawn_blocking(move || {
                        let data = read(&hash)?;
                        if blake3::hash(&data).as_bytes() != &hash {
                            return None;
                        }
                        Some(if data.len() > blockobj::PACK_BLOCK_MAX {
                            (false, data)
                        } else {
                            (true, blockobj::encode(&data).into_owned())
                        })
                    })
                    .await
                    .ok()
                    .flatten();
                    // A block that cannot be read (changed since the manifest) is left
                    // out, as `upload` does; a failed upload is counted by `upload`.
                    match got {
                        Some((true, object)) => Item::Small(hash, object),
                        Some((false, block)) => {
                            Item::Put(tier.upload(hash, move || Some(block)).await.unwrap_or(0))
                        }
                        None => Item::Put(0),
                    }
                }
            })
            .buffered(WARM_CONCURRENCY);
        let mut put = 0;
        let mut pack = PackBuilder::default();
        while let Some(item) = items.next().await {
            match item {
                Item::Small(hash, object) => {
                    pack.push_encoded(hash, &object);
                    if pack.len() >= blockobj::PACK_TARGET {
                        put += self.put_pack(std::mem::take(&mut pack)).await;
                    }
                }
                Item::Put(n) => put += n,
            }
        }
        drop(items);
        if !pack.is_empty() {
            put += self.put_pack(pack).await;
        }
        // Recorded as stored (or not) before the claim goes: a caller that finds neither
        // asks again.
        let mut packing = self.packing.lock();
        for h in &claim {
            packing.remove(h);
        }
        put
    }

    /// Put a pack, then its index; record where its blocks are. The bytes put (0 if
    /// either failed: its blocks are then not in the store).
    async fn put_pack(&self, pack: PackBuilder) -> u64 {
        let (name, body, entries) = pack.finish();
        let index = blockobj::encode_pack_index(&name, &entries);
        let n = (body.len() + index.len()) as u64;
        let key = ObjPath::from(self.pack_key(&name));
        let index_key = ObjPath::from(format!("{}.idx", self.pack_key(&name)));
        let put = async {
            self.s3.put(&key, bytes::Bytes::from(body).into()).await?;
            self.s3
                .put(&index_key, bytes::Bytes::from(index).into())
                .await
        };
        match self.health.call("PUT of a pack", put).await {
            Ok(_) => {
                self.packed.write().add(name, &entries);
                self.objects_uploaded.fetch_add(2, Ordering::Relaxed);
                self.packs_uploaded.fetch_add(1, Ordering::Relaxed);
                self.bytes_uploaded.fetch_add(n, Ordering::Relaxed);
                n
            }
            Err(e) => {
                tracing::warn!(key = %key, blocks = entries.len(), error = %e, "block tier: PUT of a pack failed");
                self.upload_errors.fetch_add(1, Ordering::Relaxed);
                0
            }
        }
    }

    /// Upload every block of `export` the store lacks, in the background, while its lease
    /// is active: in manifest order, packed (large blocks on their own), a few packs at a
    /// time, the first ones smaller so the blocks mounts want first are stored soonest.
    /// Needs a tokio runtime (registration runs on the blocking pool of one).
    pub(crate) fn warm(self: &Arc<Self>, export: &Arc<super::Export>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(export = %export.id, "block tier: no runtime for the background upload; blocks are uploaded as they are asked for");
            return;
        };
        let tier = self.clone();
        let export = export.clone();
        rt.spawn(async move {
            let bs = u64::from(export.block_size()).max(1);
            let mut seen = HashSet::new();
            let mut chunks: Vec<Vec<BlockHash>> = Vec::new();
            let (mut chunk, mut bytes, mut target) = (Vec::new(), 0u64, WARM_FIRST_PACK);
            for e in export.manifest_entries.iter() {
                let n = e.blocks.len() as u64;
                for (i, h) in e.blocks.iter().enumerate() {
                    let Some(h) = parse_hash(h) else { continue };
                    if !seen.insert(h) || tier.contains(&h) {
                        continue;
                    }
                    let i = i as u64;
                    bytes += if i + 1 < n { bs } else { e.size - bs * i };
                    chunk.push(h);
                    if bytes >= target {
                        chunks.push(std::mem::take(&mut chunk));
                        bytes = 0;
                        target = (target * 2).min(blockobj::PACK_TARGET as u64);
                    }
                }
            }
            if !chunk.is_empty() {
                chunks.push(chunk);
            }
            let total: usize = chunks.iter().map(Vec::len).sum();
            let started = std::time::Instant::now();
            let reader = export.clone();
            let read: BlockReader = Arc::new(move |h: &BlockHash| reader.read_block(h));
            futures::stream::iter(chunks)
                .take_while(|_| {
                    let active = export.lease().check_access().is_ok();
                    async move { active }
                })
                .for_each_concurrent(WARM_PACKS, |chunk| {
                    let tier = tier.clone();
                    let export = export.clone();
                    let read = read.clone();
                    async move {
                        let n = tier.ensure_packed(&chunk, read).await;
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
    fn a_block_in_two_packs_keeps_its_first_place() {
        let e = |h: u8, offset| PackEntry {
            hash: [h; 32],
            offset,
            len: 10,
        };
        let mut t = PackTable::default();
        t.add([1; 32], &[e(1, 0), e(2, 10)]);
        t.add([2; 32], &[e(2, 0), e(3, 10)]);
        assert_eq!(t.names, vec![[1; 32], [2; 32]]);
        let slot = |h: u8| t.at[&[h; 32]];
        assert_eq!((slot(2).pack, slot(2).offset), (0, 10));
        assert_eq!((slot(3).pack, slot(3).offset), (1, 10));
    }

    #[test]
    fn explicit_options_win_over_the_shared_files_without_mixing() {
        use AmazonS3ConfigKey::{AccessKeyId, Endpoint, Region, SecretAccessKey, Token};
        let http = AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp);
        let files = || {
            [
                (AccessKeyId, "AKIA1"),
                (SecretAccessKey, "s1"),
                (Token, "t1"),
                (Region, "eu-west-1"),
                (Endpoint, "http://files.example"),
                (http, "true"),
            ]
            .map(|(k, v)| (k, v.to_owned()))
            .to_vec()
        };
        let kept = |options: &[AmazonS3ConfigKey]| -> Vec<AmazonS3ConfigKey> {
            files_under_options(files(), options.iter().copied())
                .into_iter()
                .map(|(k, _)| k)
                .collect()
        };
        assert_eq!(kept(&[]).len(), 6);
        // A secret alone in the options: no key id (nor token) from the files.
        assert_eq!(kept(&[SecretAccessKey]), vec![Region, Endpoint, http]);
        // An endpoint in the options: the file's, and its plain HTTP, are not used.
        assert_eq!(
            kept(&[Endpoint, Region]),
            vec![AccessKeyId, SecretAccessKey, Token]
        );
    }

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
