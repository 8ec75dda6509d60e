//! The mount's view of the export: a trait, and its HTTP implementation.
//!
//! The filesystem layer only ever talks to a [`Remote`], so its logic is tested against an
//! in-memory export and fault-injecting wrappers without a network. [`HttpRemote`] is the
//! real client of the data plane described in `awcp_protocol::dataplane`; it is blocking
//! (FUSE callbacks run on plain threads) and bounds every request with a timeout, so a
//! filesystem operation never hangs on a dead network.

use std::io::{BufRead, BufReader, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use awcp_protocol::dataplane::{
    BlockLocations, BlockRequest, ChangeSet, CommitResult, DataPlaneError, ExportEvent,
    LocateRequest, MISSING_BLOCK, Manifest, MissingBlocks, encode_block_frame,
};
use awcp_protocol::manifest_bin;

use crate::blockobj;

mod retry;
mod store;
use store::{StoreJob, decode_verified, is_http, store_jobs};

/// Why a data-plane request failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The token was refused (401).
    #[error("the export refused the capability token: {message}")]
    Unauthorized {
        /// The export's words.
        message: String,
    },
    /// The lease is over (403 EXPIRED/REVOKED).
    #[error("the lease has ended ({code}): {message}")]
    LeaseEnded {
        /// `EXPIRED` or `REVOKED`.
        code: String,
        /// The export's words.
        message: String,
    },
    /// Any other refusal with a data-plane error body.
    #[error("the export answered {status} {code}: {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// Data-plane error code.
        code: String,
        /// The export's words.
        message: String,
    },
    /// The request did not complete (connection refused, reset, timeout).
    #[error("cannot reach the export at {endpoint}")]
    Transport {
        /// Where.
        endpoint: String,
        /// Why.
        #[source]
        source: Box<ureq::Transport>,
    },
    /// The answer was not what the protocol says.
    #[error("malformed answer from the export: {what}")]
    Protocol {
        /// What was wrong.
        what: String,
    },
    /// A block's content did not match its hash, or the export no longer has it.
    #[error("block {hash} is missing or corrupt at the export")]
    BadBlock {
        /// The block.
        hash: String,
    },
    /// Reading the answer failed.
    #[error("reading the export's answer failed")]
    Io {
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl RemoteError {
    /// Whether this error means access is over for good (fence the mount).
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            RemoteError::Unauthorized { .. } | RemoteError::LeaseEnded { .. }
        )
    }
}

/// What the filesystem needs from an export.
pub trait Remote: Send + Sync {
    /// Fetch the manifest; returns it and the blake3 hex digest of its bytes.
    fn manifest(&self) -> Result<(Manifest, String), RemoteError>;
    /// Fetch the manifest as served: compressed, as [`decode_manifest`] reads it. A mount
    /// saves these bytes for recovery as they came, instead of encoding the manifest again
    /// (at 100,000 entries that took longer than the fetch). The default encodes
    /// [`Remote::manifest`]'s answer.
    fn manifest_bytes(&self) -> Result<Vec<u8>, RemoteError> {
        let (manifest, _) = self.manifest()?;
        encode_manifest(&manifest).map_err(|e| RemoteError::Protocol {
            what: format!("manifest: cannot encode: {e}"),
        })
    }
    /// Fetch blocks by hash; every returned block is verified against its hash.
    fn fetch_blocks(&self, hashes: &[String]) -> Result<Vec<Vec<u8>>, RemoteError>;
    /// Fetch blocks by hash, handing each verified block to `each` (with its index in
    /// `hashes`) in order, as it arrives: a caller can write the first blocks while the
    /// rest are on the wire. An error from `each` ends the fetch with that error. The
    /// default fetches them all first.
    fn fetch_blocks_each(
        &self,
        hashes: &[String],
        each: &mut dyn FnMut(usize, Vec<u8>) -> Result<(), RemoteError>,
    ) -> Result<(), RemoteError> {
        for (i, block) in self.fetch_blocks(hashes)?.into_iter().enumerate() {
            each(i, block)?;
        }
        Ok(())
    }
    /// Which of these hashes the export lacks.
    fn missing(&self, hashes: &[String]) -> Result<Vec<String>, RemoteError>;
    /// Upload blocks (hash, bytes).
    fn upload(&self, blocks: &[([u8; 32], &[u8])]) -> Result<(), RemoteError>;
    /// Commit a change set.
    fn commit(&self, changes: &ChangeSet) -> Result<CommitResult, RemoteError>;
    /// The first outcomes of those of `ids` the export applied (`POST /commits/applied`;
    /// at most [`awcp_protocol::dataplane::MAX_APPLIED_QUERY`] ids). The default says the
    /// export cannot answer: crash recovery then proceeds as before the question existed.
    fn applied(&self, ids: &[String]) -> Result<Vec<CommitResult>, RemoteError> {
        let _ = ids;
        Err(RemoteError::Protocol {
            what: "this remote cannot say which commits it applied".into(),
        })
    }
    /// Ask the export to extend the lease; answers the lease as it now stands.
    fn renew(&self) -> Result<ExportEvent, RemoteError>;
    /// Open the lease event stream; the iterator ends when the stream does. It also yields
    /// [`StreamItem::KeepAlive`] for comment lines, so a reader can check for shutdown.
    fn events(&self) -> Result<Box<dyn Iterator<Item = StreamItem> + Send>, RemoteError>;
    /// [`Remote::events`], with the catch-up limited to changes after sequence `since`
    /// (what the mount already has; 0: everything since the export was registered). The
    /// default ignores `since`: the full catch-up is correct, only larger.
    fn events_since(
        &self,
        since: u64,
    ) -> Result<Box<dyn Iterator<Item = StreamItem> + Send>, RemoteError> {
        let _ = since;
        self.events()
    }

    /// Counters of what this remote received from the Delegator: blocks from its export
    /// and from its block tier (an object store). A remote that talks to no Delegator (a
    /// test's) has none; a wrapper answers its inner remote's.
    fn transfer_counters(&self) -> Option<Arc<TransferCounters>> {
        None
    }

    /// AECP: report deliveries made on this mount (`POST /aecp/delivered`). A remote
    /// without AECP accepts and drops them.
    fn aecp_delivered(&self, _report: &serde_json::Value) -> Result<(), RemoteError> {
        Ok(())
    }

    /// git's fsmonitor: tell the export that mount `instance` ended with every change it
    /// made applied as sent (`POST /mounts/ended`); whether the export recorded it. A
    /// remote that cannot records nothing.
    fn mount_ended(&self, _instance: &str) -> Result<bool, RemoteError> {
        Ok(false)
    }

    /// git's fsmonitor: whether mount `instance` ended cleanly on this export (`POST
    /// /mounts/ended/query`). A remote that cannot ask says no: the monitor then answers
    /// that instance's tokens with "everything".
    fn mount_ended_clean(&self, _instance: &str) -> Result<bool, RemoteError> {
        Ok(false)
    }

    /// AECP: the worker's agent asks the daemon (`POST /aecp/request`); the daemon's
    /// status and JSON body. A remote without AECP refuses.
    fn aecp_request(
        &self,
        _request: &serde_json::Value,
    ) -> Result<(u16, serde_json::Value), RemoteError> {
        Err(RemoteError::Protocol {
            what: "this mount's export has no AECP".into(),
        })
    }
}

/// What a remote received from the Delegator, counted where it arrives: each verified
/// block once, when it is handed on, whichever of the export (`POST /blocks`) and the block
/// tier (presigned URLs of an object store, see `POST /locate`) sent it. Two fetches of one
/// block (hydration and a read racing) are two transfers and count twice, in both sums
/// alike; a block the store sent whose fetch then failed as a whole is not handed on and
/// not counted. So `export_bytes + store_bytes` is what the mount's fetches brought, and
/// `export_bytes` is what the export's own `bytesServed` counts for this mount.
#[derive(Debug, Default)]
pub struct TransferCounters {
    /// Blocks the export sent (verified).
    pub export_blocks: AtomicU64,
    /// Their bytes.
    pub export_bytes: AtomicU64,
    /// Blocks the store gave intact and the fetch handed on.
    pub store_blocks: AtomicU64,
    /// Their bytes (as blocks, after decompression).
    pub store_bytes: AtomicU64,
    /// Blocks the store did not give intact (failed fetch, expired URL, wrong content):
    /// fetched from the export instead.
    pub refused: AtomicU64,
    /// Block bytes written back through the store (the export took them from there).
    pub bytes_put: AtomicU64,
    /// `GET`s sent to the store (a ranged read of a pack counts once, however many blocks
    /// it brings).
    pub requests: AtomicU64,
}

/// A block to write back: its hash and its bytes.
type Upload<'a> = ([u8; 32], &'a [u8]);

/// Whether the export has a block tier: not asked yet, yes, no.
const TIER_UNKNOWN: u8 = 0;
const TIER_ON: u8 = 1;
const TIER_OFF: u8 = 2;
/// Store fetches in flight for one batch.
const STORE_FETCHERS: usize = 16;
/// How long a mount reads from the export alone after the block store did not answer.
const STORE_QUIET: Duration = Duration::from_secs(10);
/// Largest `/locate` answer read.
const LOCATE_ANSWER_MAX: u64 = 64 << 20;
/// Largest object a store fetch reads (a block of the largest size, uncompressible).
const STORE_OBJECT_MAX: u64 = (64 << 20) + 4096;
/// One item of the export's event stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamItem {
    /// An event.
    Event(ExportEvent),
    /// A keep-alive comment or an unparseable line.
    KeepAlive,
}

/// Most bytes a compressed manifest may expand to (a decompression bomb stops here).
const MANIFEST_MAX: u64 = 4 << 30;

/// Decompress and decode a served (or saved) binary manifest; returns it and its digest
/// (the blake3 of the uncompressed encoding).
pub fn decode_manifest(compressed: &[u8]) -> Result<(Manifest, String), RemoteError> {
    let bad = |what: String| RemoteError::Protocol {
        what: format!("manifest: {what}"),
    };
    let mut binary = Vec::new();
    zstd::stream::read::Decoder::new(compressed)
        .map_err(|e| bad(e.to_string()))?
        .take(MANIFEST_MAX)
        .read_to_end(&mut binary)
        .map_err(|e| bad(format!("not zstd: {e}")))?;
    let digest = blake3::hash(&binary).to_hex().to_string();
    let manifest = Manifest::from_binary(&binary).map_err(|e| bad(e.to_string()))?;
    Ok((manifest, digest))
}

/// Encode and compress a manifest as [`decode_manifest`] reads it (level 1: fast).
pub fn encode_manifest(m: &Manifest) -> std::io::Result<Vec<u8>> {
    let binary = m.to_binary().map_err(std::io::Error::other)?;
    zstd::bulk::compress(&binary, 1)
}

/// Parse a hex blake3 hash.
pub fn parse_hash(hex_hash: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_hash, &mut out).ok()?;
    Some(out)
}

/// Verify a fetched block against its expected hash.
pub fn verify_block(hash: &str, data: &[u8]) -> Result<(), RemoteError> {
    if blake3::hash(data).to_hex().as_str() == hash {
        Ok(())
    } else {
        Err(RemoteError::BadBlock { hash: hash.into() })
    }
}

/// The real data-plane client.
#[derive(Debug, Clone)]
pub struct HttpRemote {
    base: String,
    endpoint: String,
    auth: String,
    agent: ureq::Agent,
    stream_agent: ureq::Agent,
    /// Fetches from the block tier: no credential of ours is ever sent there.
    store_agent: ureq::Agent,
    tier: Arc<AtomicU8>,
    counters: Arc<TransferCounters>,
    /// The read timeout: the bound on each request, and the time within which transient
    /// faults of the link are retried ([`retry`]).
    timeout: Duration,
    /// How long the store phase of one fetch may take: fetches not started by then are
    /// left to the export.
    store_budget: Duration,
    /// Set when the store stopped answering: until then, blocks come from the export.
    store_quiet_until: Arc<parking_lot::Mutex<Option<std::time::Instant>>>,
}

impl HttpRemote {
    /// A client for export `export_id` at `endpoint` (e.g. `http://127.0.0.1:3101`).
    pub fn new(endpoint: &str, export_id: &str, token: &str, timeout: Duration) -> Self {
        let endpoint = endpoint.trim_end_matches('/').to_string();
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(timeout.min(Duration::from_secs(5)))
            .timeout(timeout)
            .build();
        // The event stream stays open for the life of the lease: no overall timeout.
        // A read timeout well above the export's keep-alive interval notices a dead peer.
        let stream_agent = ureq::AgentBuilder::new()
            .timeout_connect(timeout.min(Duration::from_secs(5)))
            .timeout_read(Duration::from_secs(60))
            .build();
        // One kept-alive connection per fetcher thread (ureq keeps one per host by default:
        // the other threads would open a new connection per block).
        // A store that does not answer costs at most a quarter of the read timeout per
        // request (and the whole store phase about half of it, see `fetch_from_store`)
        // before the blocks are asked of the export.
        let store_agent = ureq::AgentBuilder::new()
            .timeout_connect((timeout / 4).min(Duration::from_secs(2)))
            .timeout(timeout / 4)
            .redirects(0)
            .max_idle_connections_per_host(STORE_FETCHERS)
            .build();
        HttpRemote {
            base: format!("{endpoint}/v1/exports/{export_id}"),
            endpoint,
            auth: format!("Bearer {token}"),
            agent,
            stream_agent,
            store_agent,
            tier: Arc::new(AtomicU8::new(TIER_UNKNOWN)),
            counters: Arc::default(),
            timeout,
            store_budget: timeout / 4,
            store_quiet_until: Arc::default(),
        }
    }

    /// The block store did not answer a fetch (a timeout, a refused or reset connection):
    /// read from the export alone for [`STORE_QUIET`], so that every read does not pay
    /// the store's silence again. Logged once per quiet period.
    fn store_unanswered(&self, e: &ureq::Error) {
        if !matches!(e, ureq::Error::Transport(_)) {
            return;
        }
        let mut quiet = self.store_quiet_until.lock();
        let now = std::time::Instant::now();
        if quiet.is_none_or(|until| until <= now) {
            tracing::warn!(error = %e, quiet = ?STORE_QUIET,
                "the block store did not answer; reading from the export alone for a while");
        }
        *quiet = Some(now + STORE_QUIET);
    }

    fn store_quiet(&self) -> bool {
        self.store_quiet_until
            .lock()
            .is_some_and(|until| until > std::time::Instant::now())
    }

    fn map_err(&self, e: ureq::Error) -> RemoteError {
        match e {
            ureq::Error::Status(status, resp) => {
                let body: Option<DataPlaneError> = resp.into_json().ok();
                let (code, message) = body
                    .map(|b| (b.code, b.message))
                    .unwrap_or_else(|| ("UNKNOWN".into(), format!("HTTP {status}")));
                match (status, code.as_str()) {
                    (401, _) => RemoteError::Unauthorized { message },
                    (403, "EXPIRED" | "REVOKED") => RemoteError::LeaseEnded { code, message },
                    _ => RemoteError::Refused {
                        status,
                        code,
                        message,
                    },
                }
            }
            ureq::Error::Transport(t) => RemoteError::Transport {
                endpoint: self.endpoint.clone(),
                source: Box::new(t),
            },
        }
    }

    fn post_json<T: serde::de::DeserializeOwned>(
        &self,
        route: &str,
        body: &impl serde::Serialize,
    ) -> Result<T, RemoteError> {
        self.post_json_within(route, body, self.timeout)
    }

    /// [`Self::post_json`] bounded by `timeout` instead of the whole read timeout.
    fn post_json_within<T: serde::de::DeserializeOwned>(
        &self,
        route: &str,
        body: &impl serde::Serialize,
        timeout: Duration,
    ) -> Result<T, RemoteError> {
        let resp = self
            .agent
            .post(&format!("{}/{route}", self.base))
            .timeout(timeout)
            .set("Authorization", &self.auth)
            .send_json(body)
            .map_err(|e| self.map_err(e))?;
        resp.into_json().map_err(|e| RemoteError::Protocol {
            what: format!("{route}: {e}"),
        })
    }
}

impl HttpRemote {
    /// The blocks of `hashes` the block tier gives intact, by index (`None`: ask the
    /// export). Asks `POST /locate` (announcing that ranges of packs are understood) unless
    /// the export said it has no tier; reads the blocks of one pack that lie close together
    /// in one ranged `GET`, and blocks stored on their own one `GET` each, a few at a time;
    /// verifies each block against its hash. Only an error that ends access (token refused,
    /// lease over) is returned; anything else falls back.
    fn fetch_from_store(
        &self,
        hashes: &[String],
        timeout: Duration,
    ) -> Result<Vec<Option<Vec<u8>>>, RemoteError> {
        let none = || (0..hashes.len()).map(|_| None).collect();
        if hashes.is_empty() || self.tier.load(Ordering::Relaxed) == TIER_OFF || self.store_quiet()
        {
            return Ok(none());
        }
        let started = std::time::Instant::now();
        let answer = self
            .agent
            .post(&format!("{}/locate", self.base))
            .timeout(timeout)
            .set("Authorization", &self.auth)
            .send_json(LocateRequest {
                hashes: hashes.to_vec(),
                ranges: true,
            });
        let locs: BlockLocations = match answer {
            // At most 65,536 URLs of a few hundred bytes each: 64 MiB bounds the answer.
            Ok(resp) => match read_body(resp, LOCATE_ANSWER_MAX).and_then(|b| {
                serde_json::from_slice(&b).map_err(|e| RemoteError::Protocol {
                    what: format!("locate: {e}"),
                })
            }) {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "malformed /locate answer; fetching from the export");
                    return Ok(none());
                }
            },
            // An export that predates the block tier has no such route.
            Err(ureq::Error::Status(404 | 405, _)) => {
                self.tier.store(TIER_OFF, Ordering::Relaxed);
                return Ok(none());
            }
            Err(e) => {
                let e = self.map_err(e);
                // Access is over, or the export cannot be reached (a timeout): `/blocks`
                // would fail the same way, so do not spend the read timeout twice.
                if e.is_fatal() || matches!(e, RemoteError::Transport { .. }) {
                    return Err(e);
                }
                tracing::warn!(error = %e, "/locate failed; fetching from the export");
                return Ok(none());
            }
        };
        if !locs.block_store {
            self.tier.store(TIER_OFF, Ordering::Relaxed);
            return Ok(none());
        }
        self.tier.store(TIER_ON, Ordering::Relaxed);
        if locs.urls.len() != hashes.len()
            || !(locs.ranges.is_empty() || locs.ranges.len() == hashes.len())
        {
            tracing::warn!(
                asked = hashes.len(),
                got = locs.urls.len(),
                ranges = locs.ranges.len(),
                "/locate answered a different number of places; fetching from the export"
            );
            return Ok(none());
        }
        let waited = started.elapsed();
        if waited > Duration::from_secs(1) {
            tracing::info!(
                ?waited,
                blocks = hashes.len(),
                "a read waited for the export's /locate (the block store is slow?)"
            );
        }
        let jobs = store_jobs(&locs);
        let out: Vec<parking_lot::Mutex<Option<Vec<u8>>>> = (0..hashes.len())
            .map(|_| parking_lot::Mutex::new(None))
            .collect();
        let next = AtomicUsize::new(0);
        // No fetch starts after the budget, nor once the store has stopped answering:
        // what is left comes from the export, within the read timeout.
        let deadline = std::time::Instant::now() + self.store_budget;
        let go_on = || std::time::Instant::now() < deadline && !self.store_quiet();
        std::thread::scope(|s| {
            for _ in 0..STORE_FETCHERS.min(jobs.len()) {
                s.spawn(|| {
                    while go_on()
                        && let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed))
                    {
                        let got = match job {
                            StoreJob::Own(i, url) => {
                                vec![(*i, self.fetch_object(url, &hashes[*i]))]
                            }
                            StoreJob::Range(url, read) => self.fetch_range(url, read, hashes),
                        };
                        // Counted as fetched when handed on (`blocks_from`): the rest of
                        // this fetch may still fail, and a retry hands them on then.
                        for (i, block) in got {
                            match block {
                                Some(block) => *out[i].lock() = Some(block),
                                None => {
                                    self.counters.refused.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    }
                });
            }
        });
        Ok(out.into_iter().map(|m| m.into_inner()).collect())
    }

    /// Write-back through the block tier: ask `POST /upload-urls` for presigned `PUT` URLs,
    /// put the blocks (encoded as `blockobj` says) in the store, and have the export take
    /// them from there (`POST /adopt`). Answers the blocks still to upload to the export
    /// itself: all of them without a tier, or when anything but an ended lease goes wrong.
    fn upload_through_store<'a>(
        &self,
        blocks: &[Upload<'a>],
    ) -> Result<Vec<Upload<'a>>, RemoteError> {
        let all = || blocks.to_vec();
        // Only once a `/locate` said the export has a tier: a mount of an export without
        // one writes back exactly as before, without a request more.
        if blocks.is_empty() || self.tier.load(Ordering::Relaxed) != TIER_ON {
            return Ok(all());
        }
        let hashes: Vec<String> = blocks.iter().map(|(h, _)| hex::encode(h)).collect();
        let fallback = |e: RemoteError| {
            // Access over, or the export unreachable: `/upload` would fail the same way.
            if e.is_fatal() || matches!(e, RemoteError::Transport { .. }) {
                Err(e)
            } else {
                tracing::warn!(error = %e, "write-back through the store failed; uploading to the export");
                Ok(all())
            }
        };
        let locs: BlockLocations = match self
            .agent
            .post(&format!("{}/upload-urls", self.base))
            .set("Authorization", &self.auth)
            .send_json(BlockRequest {
                hashes: hashes.clone(),
            }) {
            Ok(resp) => match read_body(resp, LOCATE_ANSWER_MAX).and_then(|b| {
                serde_json::from_slice(&b).map_err(|e| RemoteError::Protocol {
                    what: format!("upload-urls: {e}"),
                })
            }) {
                Ok(l) => l,
                Err(e) => return fallback(e),
            },
            // An export that predates the block tier has no such route.
            Err(ureq::Error::Status(404 | 405, _)) => {
                self.tier.store(TIER_OFF, Ordering::Relaxed);
                return Ok(all());
            }
            Err(e) => return fallback(self.map_err(e)),
        };
        if !locs.block_store {
            self.tier.store(TIER_OFF, Ordering::Relaxed);
            return Ok(all());
        }
        self.tier.store(TIER_ON, Ordering::Relaxed);
        if locs.urls.len() != blocks.len() {
            return Ok(all());
        }
        // Put what has a URL (`null`: the store has it already).
        let mut put_ok = vec![false; blocks.len()];
        let jobs: Vec<(usize, &str)> = locs
            .urls
            .iter()
            .enumerate()
            .filter_map(|(i, u)| u.as_deref().map(|u| (i, u)))
            .collect();
        let results: Vec<parking_lot::Mutex<bool>> = (0..blocks.len())
            .map(|_| parking_lot::Mutex::new(false))
            .collect();
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..STORE_FETCHERS.min(jobs.len()) {
                s.spawn(|| {
                    while let Some(&(i, url)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                        if !(url.starts_with("http://") || url.starts_with("https://")) {
                            continue;
                        }
                        let object = crate::blockobj::encode(blocks[i].1);
                        match self.store_agent.put(url).send_bytes(&object) {
                            Ok(_) => *results[i].lock() = true,
                            Err(e) => {
                                tracing::debug!(error = %e, "a PUT to the block tier failed; uploading to the export");
                            }
                        }
                    }
                });
            }
        });
        for (i, r) in results.into_iter().enumerate() {
            // A block the store already had (no URL) is adopted from there too.
            put_ok[i] = r.into_inner() || locs.urls[i].is_none();
        }
        let adopt: Vec<String> = hashes
            .iter()
            .zip(&put_ok)
            .filter(|(_, ok)| **ok)
            .map(|(h, _)| h.clone())
            .collect();
        let missing: std::collections::HashSet<String> = if adopt.is_empty() {
            Default::default()
        } else {
            let answer = self
                .agent
                .post(&format!("{}/adopt", self.base))
                .set("Authorization", &self.auth)
                .send_json(BlockRequest { hashes: adopt });
            match answer {
                Ok(resp) => match resp.into_json::<MissingBlocks>() {
                    Ok(m) => m.missing.into_iter().collect(),
                    Err(e) => {
                        return fallback(RemoteError::Protocol {
                            what: format!("adopt: {e}"),
                        });
                    }
                },
                Err(e) => return fallback(self.map_err(e)),
            }
        };
        let mut rest = Vec::new();
        for ((block, ok), hash) in blocks.iter().zip(put_ok).zip(&hashes) {
            if ok && !missing.contains(hash) {
                self.counters
                    .bytes_put
                    .fetch_add(block.1.len() as u64, Ordering::Relaxed);
            } else {
                rest.push(*block);
            }
        }
        Ok(rest)
    }

    /// One block from a presigned URL, decoded and verified; `None` (logged) otherwise.
    fn fetch_object(&self, url: &str, hash: &str) -> Option<Vec<u8>> {
        if !is_http(url) {
            tracing::warn!(hash, "the block tier URL is not http(s); ignoring it");
            return None;
        }
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let object = match self.store_agent.get(url).call() {
            Ok(resp) => read_body(resp, STORE_OBJECT_MAX).ok()?,
            Err(e) => {
                tracing::debug!(hash, error = %e, "block tier fetch failed; asking the export");
                self.store_unanswered(&e);
                return None;
            }
        };
        decode_verified(object, hash)
    }

    /// The blocks of one ranged read of a pack (`Range: bytes=…` on its presigned URL),
    /// each decoded and verified; `None` for each block the answer did not give intact.
    fn fetch_range(
        &self,
        url: &str,
        read: &blockobj::RangeRead,
        hashes: &[String],
    ) -> Vec<(usize, Option<Vec<u8>>)> {
        let failed = || read.blocks.iter().map(|b| (b.0, None)).collect();
        if !is_http(url) {
            tracing::warn!("the block tier URL of a pack is not http(s); ignoring it");
            return failed();
        }
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let resp = match self
            .store_agent
            .get(url)
            .set("Range", &format!("bytes={}-{}", read.start, read.end - 1))
            .call()
        {
            Ok(resp) => resp,
            Err(e) => {
                tracing::debug!(error = %e, "ranged fetch from the block tier failed; asking the export");
                self.store_unanswered(&e);
                return failed();
            }
        };
        // 206: the range. A store that ignores `Range` answers 200 and the whole object:
        // read up to the range's end and skip to its start.
        let whole = resp.status() == 200;
        let Ok(mut body) = read_body(
            resp,
            if whole {
                read.end
            } else {
                read.end - read.start
            },
        ) else {
            return failed();
        };
        if whole {
            body.drain(..(read.start as usize).min(body.len()));
        }
        blockobj::split_range(read, &body)
            .into_iter()
            .map(|(i, object)| {
                let block = object.and_then(|o| decode_verified(o.to_vec(), &hashes[i]));
                (i, block)
            })
            .collect()
    }
}

/// Read one block frame (`decode_block_frames`' format) from `r`: `None` at a clean end of
/// the stream, an error if it ends inside a frame. A length is trusted only as far as bytes
/// actually arrive: the buffer grows with the data, so a lying frame cannot make us allocate.
fn read_block_frame(r: &mut impl Read) -> Result<Option<BlockFrame>, RemoteError> {
    let io = |source| RemoteError::Io { source };
    let truncated = || RemoteError::Protocol {
        what: "truncated block frame".into(),
    };
    let mut head = [0u8; 36];
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(truncated()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
    let mut hash = [0u8; 32];
    hash.copy_from_slice(&head[..32]);
    let len = u32::from_le_bytes([head[32], head[33], head[34], head[35]]);
    if len == MISSING_BLOCK {
        return Ok(Some((hash, None)));
    }
    let mut data = Vec::with_capacity((len as usize).min(FRAME_PREALLOC));
    r.take(u64::from(len)).read_to_end(&mut data).map_err(io)?;
    if data.len() != len as usize {
        return Err(truncated());
    }
    Ok(Some((hash, Some(data))))
}

/// A decoded block frame: the hash it names, and the block (`None`: the export lacks it).
type BlockFrame = ([u8; 32], Option<Vec<u8>>);

/// Most a frame's announced length reserves before its bytes arrive (a block at the
/// default size fits).
const FRAME_PREALLOC: usize = 4 << 20;

fn read_body(resp: ureq::Response, limit: u64) -> Result<Vec<u8>, RemoteError> {
    // Size the buffer once when the length is announced (bounded, in case it lies).
    let announced = resp
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0)
        .min(256 << 20);
    let mut buf = Vec::with_capacity(announced);
    resp.into_reader()
        .take(limit)
        .read_to_end(&mut buf)
        .map_err(|source| RemoteError::Io { source })?;
    Ok(buf)
}

impl HttpRemote {
    /// Hand on the blocks of `hashes` from index `*next` on (advancing it), each from
    /// `from_store` when the block tier gave it, else from one `POST /blocks` bounded by
    /// `timeout`. The outer error is the request's (retried when transient); the inner one
    /// is `each`'s, which ends the fetch.
    fn blocks_from(
        &self,
        hashes: &[String],
        from_store: &mut [Option<Vec<u8>>],
        next: &mut usize,
        timeout: Duration,
        each: &mut dyn FnMut(usize, Vec<u8>) -> Result<(), RemoteError>,
    ) -> Result<Result<(), RemoteError>, RemoteError> {
        let rest: Vec<String> = hashes[*next..]
            .iter()
            .zip(&from_store[*next..])
            .filter(|(_, d)| d.is_none())
            .map(|(h, _)| h.clone())
            .collect();
        let asked = rest.len();
        let mut body = if rest.is_empty() {
            None
        } else {
            let resp = self
                .agent
                .post(&format!("{}/blocks", self.base))
                .timeout(timeout)
                .set("Authorization", &self.auth)
                .send_json(BlockRequest { hashes: rest })
                .map_err(|e| self.map_err(e))?;
            // Frames are decoded straight off the socket, one block buffer each: no buffer
            // for the whole answer, and the first block is handed on before the last one
            // arrives.
            Some(resp.into_reader())
        };
        while *next < hashes.len() {
            let i = *next;
            let want = &hashes[i];
            let data = match (from_store[i].take(), body.as_mut()) {
                (Some(block), _) => {
                    self.counters.store_blocks.fetch_add(1, Ordering::Relaxed);
                    self.counters
                        .store_bytes
                        .fetch_add(block.len() as u64, Ordering::Relaxed);
                    block
                }
                (None, Some(body)) => {
                    let (got, data) =
                        read_block_frame(body)?.ok_or_else(|| RemoteError::Protocol {
                            what: format!("asked for {asked} blocks, got fewer"),
                        })?;
                    if hex::encode(got) != *want {
                        return Err(RemoteError::Protocol {
                            what: "blocks answered out of order".into(),
                        });
                    }
                    let data = data.ok_or_else(|| RemoteError::BadBlock { hash: want.clone() })?;
                    verify_block(want, &data)?;
                    self.counters.export_blocks.fetch_add(1, Ordering::Relaxed);
                    self.counters
                        .export_bytes
                        .fetch_add(data.len() as u64, Ordering::Relaxed);
                    data
                }
                // Cannot happen (such a block is in the request), but no panic on it.
                (None, None) => {
                    return Err(RemoteError::Protocol {
                        what: "a block was neither in the block tier nor asked for".into(),
                    });
                }
            };
            *next += 1;
            if let Err(e) = each(i, data) {
                return Ok(Err(e));
            }
        }
        if let Some(body) = body.as_mut()
            && read_block_frame(body)?.is_some()
        {
            return Err(RemoteError::Protocol {
                what: format!("asked for {asked} blocks, got more"),
            });
        }
        Ok(Ok(()))
    }
}

impl Remote for HttpRemote {
    fn manifest(&self) -> Result<(Manifest, String), RemoteError> {
        decode_manifest(&self.manifest_bytes()?)
    }

    fn manifest_bytes(&self) -> Result<Vec<u8>, RemoteError> {
        retry::within(self.timeout, &self.endpoint, "manifest", |left| {
            let resp = self
                .agent
                .get(&format!("{}/manifest", self.base))
                .timeout(left)
                .set("Authorization", &self.auth)
                .set("Accept", manifest_bin::MEDIA_TYPE)
                .call()
                .map_err(|e| self.map_err(e))?;
            if resp.content_type() != manifest_bin::MEDIA_TYPE {
                return Err(RemoteError::Protocol {
                    what: format!(
                        "manifest: expected {}, got {}",
                        manifest_bin::MEDIA_TYPE,
                        resp.content_type()
                    ),
                });
            }
            read_body(resp, 4 << 30)
        })
    }

    fn fetch_blocks(&self, hashes: &[String]) -> Result<Vec<Vec<u8>>, RemoteError> {
        let mut out = Vec::with_capacity(hashes.len());
        self.fetch_blocks_each(hashes, &mut |_, block| {
            out.push(block);
            Ok(())
        })?;
        Ok(out)
    }

    fn fetch_blocks_each(
        &self,
        hashes: &[String],
        each: &mut dyn FnMut(usize, Vec<u8>) -> Result<(), RemoteError>,
    ) -> Result<(), RemoteError> {
        // The block tier first (if the export has one); the export for the rest. One read
        // timeout for both, within which transient faults of the link are retried.
        let started = std::time::Instant::now();
        let mut from_store =
            retry::since(started, self.timeout, &self.endpoint, "locate", |left| {
                self.fetch_from_store(hashes, left)
            })?;
        // Blocks before `next` are handed on. A transient fault of the link is retried
        // within the read timeout, asking only for the blocks not yet handed on; an error
        // of `each` (the caller's: the inner `Result`) is never retried.
        let mut next = 0;
        retry::since(started, self.timeout, &self.endpoint, "blocks", |left| {
            self.blocks_from(hashes, &mut from_store, &mut next, left, each)
        })?
    }

    fn missing(&self, hashes: &[String]) -> Result<Vec<String>, RemoteError> {
        let body = BlockRequest {
            hashes: hashes.to_vec(),
        };
        let m: MissingBlocks = retry::within(self.timeout, &self.endpoint, "missing", |left| {
            self.post_json_within("missing", &body, left)
        })?;
        Ok(m.missing)
    }

    fn upload(&self, blocks: &[([u8; 32], &[u8])]) -> Result<(), RemoteError> {
        let rest = self.upload_through_store(blocks)?;
        if rest.is_empty() {
            return Ok(());
        }
        // Sized once: grown by doubling, the body was copied and faulted in afresh several
        // times over for a large write-back.
        let len = rest.iter().map(|(_, data)| 36 + data.len()).sum();
        let mut body = Vec::with_capacity(len);
        for (hash, data) in &rest {
            encode_block_frame(&mut body, hash, Some(data));
        }
        self.agent
            .post(&format!("{}/upload", self.base))
            .set("Authorization", &self.auth)
            .set("Content-Type", "application/octet-stream")
            .send_bytes(&body)
            .map_err(|e| self.map_err(e))?;
        Ok(())
    }

    fn commit(&self, changes: &ChangeSet) -> Result<CommitResult, RemoteError> {
        self.post_json("commit", changes)
    }

    fn applied(&self, ids: &[String]) -> Result<Vec<CommitResult>, RemoteError> {
        let body = awcp_protocol::dataplane::AppliedQuery { ids: ids.to_vec() };
        let a: awcp_protocol::dataplane::AppliedCommits =
            retry::within(self.timeout, &self.endpoint, "commits/applied", |left| {
                self.post_json_within("commits/applied", &body, left)
            })?;
        Ok(a.applied)
    }

    fn renew(&self) -> Result<ExportEvent, RemoteError> {
        let resp = self
            .agent
            .post(&format!("{}/renew", self.base))
            .set("Authorization", &self.auth)
            .call()
            .map_err(|e| self.map_err(e))?;
        resp.into_json().map_err(|e| RemoteError::Protocol {
            what: format!("renew: {e}"),
        })
    }

    fn events(&self) -> Result<Box<dyn Iterator<Item = StreamItem> + Send>, RemoteError> {
        self.events_since(0)
    }

    fn events_since(
        &self,
        since: u64,
    ) -> Result<Box<dyn Iterator<Item = StreamItem> + Send>, RemoteError> {
        let url = if since == 0 {
            format!("{}/events", self.base)
        } else {
            format!("{}/events?since={since}", self.base)
        };
        let resp = self
            .stream_agent
            .get(&url)
            .set("Authorization", &self.auth)
            .set("Accept", "text/event-stream")
            .call()
            .map_err(|e| self.map_err(e))?;
        let reader = BufReader::new(resp.into_reader());
        Ok(Box::new(SseEvents { reader }))
    }

    fn transfer_counters(&self) -> Option<Arc<TransferCounters>> {
        Some(self.counters.clone())
    }

    fn mount_ended(&self, instance: &str) -> Result<bool, RemoteError> {
        let body = awcp_protocol::dataplane::MountEnded {
            instance: instance.to_owned(),
            ended: false,
        };
        let a: awcp_protocol::dataplane::MountEnded = self.post_json("mounts/ended", &body)?;
        Ok(a.ended && a.instance == instance)
    }

    fn mount_ended_clean(&self, instance: &str) -> Result<bool, RemoteError> {
        let body = awcp_protocol::dataplane::MountEnded {
            instance: instance.to_owned(),
            ended: false,
        };
        // Asked while git waits on its hook: a dead export costs it seconds, not the
        // whole read timeout.
        let a: awcp_protocol::dataplane::MountEnded = self.post_json_within(
            "mounts/ended/query",
            &body,
            self.timeout.min(Duration::from_secs(2)),
        )?;
        Ok(a.ended && a.instance == instance)
    }

    fn aecp_delivered(&self, report: &serde_json::Value) -> Result<(), RemoteError> {
        self.agent
            .post(&format!("{}/aecp/delivered", self.base))
            .set("Authorization", &self.auth)
            .send_json(report)
            .map_err(|e| self.map_err(e))?;
        Ok(())
    }

    fn aecp_request(
        &self,
        request: &serde_json::Value,
    ) -> Result<(u16, serde_json::Value), RemoteError> {
        // A publication or a flag waits for its witness (at most 10 minutes): its own
        // agent, bounded above that, not by the read timeout.
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(self.timeout.min(Duration::from_secs(5)))
            .timeout(Duration::from_secs(15 * 60))
            .build();
        let answer: serde_json::Value = agent
            .post(&format!("{}/aecp/request", self.base))
            .set("Authorization", &self.auth)
            .send_json(request)
            .map_err(|e| self.map_err(e))?
            .into_json()
            .map_err(|source| RemoteError::Io { source })?;
        let status = answer["status"]
            .as_u64()
            .and_then(|s| u16::try_from(s).ok())
            .ok_or_else(|| RemoteError::Protocol {
                what: "an AECP answer without a status".into(),
            })?;
        Ok((status, answer["body"].clone()))
    }
}

/// Iterator over the `data:` lines of an SSE stream that parse as [`ExportEvent`]s.
struct SseEvents<R> {
    reader: BufReader<R>,
}

impl<R: Read> Iterator for SseEvents<R> {
    type Item = StreamItem;

    fn next(&mut self) -> Option<StreamItem> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
        if let Some(data) = line.trim_end().strip_prefix("data:") {
            match serde_json::from_str(data.trim_start()) {
                Ok(ev) => return Some(StreamItem::Event(ev)),
                Err(e) => tracing::warn!(error = %e, "ignoring unparseable export event"),
            }
        }
        Some(StreamItem::KeepAlive)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_reads_data_lines_only() {
        let text = ": comment\nid: 1\nevent: lease\ndata: {\"type\":\"lease\",\"state\":\"revoked\",\"expiresAt\":\"x\",\"remainingMs\":0}\n\ndata: garbage\n\n";
        let mut it = SseEvents {
            reader: BufReader::new(text.as_bytes()),
        };
        let events: Vec<_> = it
            .by_ref()
            .filter_map(|i| match i {
                StreamItem::Event(e) => Some(e),
                StreamItem::KeepAlive => None,
            })
            .collect();
        assert_eq!(events.len(), 1);
        match &events[0] {
            ExportEvent::Lease { state, .. } => {
                assert_eq!(*state, awcp_protocol::dataplane::LeaseState::Revoked)
            }
            other => panic!("expected a lease event, got {other:?}"),
        }
    }

    /// Every frame `read_block_frame` finds in `bytes`, until the end or an error.
    fn frames(bytes: &[u8]) -> Result<Vec<BlockFrame>, RemoteError> {
        let mut r = bytes;
        let mut out = Vec::new();
        while let Some(f) = read_block_frame(&mut r)? {
            out.push(f);
        }
        Ok(out)
    }

    #[test]
    fn block_frames_are_read_off_a_stream_and_bad_ones_are_errors() {
        let mut wire = Vec::new();
        encode_block_frame(&mut wire, &[1; 32], Some(b"hello"));
        encode_block_frame(&mut wire, &[2; 32], None);
        encode_block_frame(&mut wire, &[3; 32], Some(b""));
        let got = frames(&wire).unwrap();
        assert_eq!(
            got,
            vec![
                ([1; 32], Some(b"hello".to_vec())),
                ([2; 32], None),
                ([3; 32], Some(Vec::new()))
            ]
        );
        // Cut anywhere inside a frame: an error, never a short block.
        for cut in [1, 35, 36, 40] {
            let err = frames(&wire[..cut]).unwrap_err();
            assert!(
                matches!(err, RemoteError::Protocol { .. }),
                "cut {cut}: {err}"
            );
        }
        // A frame announcing 4 GiB - 2 that sends 3 bytes: an error, without reserving
        // gigabytes first.
        let mut lying = vec![9u8; 32];
        lying.extend_from_slice(&(u32::MAX - 1).to_le_bytes());
        lying.extend_from_slice(b"abc");
        assert!(matches!(
            frames(&lying).unwrap_err(),
            RemoteError::Protocol { .. }
        ));
    }

    #[test]
    fn block_verification() {
        let h = blake3::hash(b"abc").to_hex().to_string();
        assert!(verify_block(&h, b"abc").is_ok());
        assert!(verify_block(&h, b"abd").is_err());
        assert!(parse_hash(&h).is_some());
        assert!(parse_hash("zz").is_none());
    }
}
