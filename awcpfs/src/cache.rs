//! The Executor's block cache: content-addressed, shared by every mount of a process, and
//! kept on disk across mounts and restarts so that a second delegation of the same
//! repository starts warm.
//!
//! Two tiers, both keyed by a block's blake3 hash:
//! * memory — a byte-bounded LRU of decompressed blocks, for blocks read again soon (the
//!   same content in many files, a file opened by two mounts);
//! * disk — one file per block under `<dir>/v1/<first two hex digits>/<hash>`, zstd-compressed
//!   where that saves at least 1/16 of the size and raw where it does not, written to a
//!   temporary name and renamed into place, verified against its hash every time it is
//!   loaded (a torn or tampered file is deleted and counted, never served), and bounded in
//!   bytes with least-recently-used eviction.
//!
//! Disk writes happen on a background thread behind a bounded queue, so a cold read never
//! waits for compression; when the queue is full a block is simply not cached.
//!
//! Only clean content from the Delegator's export enters the cache. A mount's open and
//! dirty files live in its own upper files and its journal, never only here, so evicting
//! any block at any time loses nothing: the next miss fetches it again.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};

use lru::LruCache;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// A block's blake3 hash.
pub type BlockHash = [u8; 32];

const MAGIC: &[u8; 4] = b"AWB1";
const HEADER: usize = 4 + 1 + 8;
const CODEC_RAW: u8 = 0;
const CODEC_ZSTD: u8 = 1;
/// zstd level: fast enough to keep up with the network on one core.
const ZSTD_LEVEL: i32 = 1;
/// Blocks waiting for the disk writer; beyond this, new blocks are not cached.
const WRITE_QUEUE: usize = 64;

/// Where and how much to cache.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Directory of the on-disk tier (`None`: memory only).
    pub dir: Option<PathBuf>,
    /// Bound on the on-disk tier, in bytes of files.
    pub disk_bytes: u64,
    /// Bound on the in-memory tier, in bytes of decompressed blocks.
    pub memory_bytes: u64,
}

impl CacheConfig {
    /// Defaults: 4 GiB on disk, 32 MiB in memory.
    pub fn new(dir: Option<PathBuf>) -> Self {
        CacheConfig {
            dir,
            disk_bytes: 4 << 30,
            memory_bytes: 32 << 20,
        }
    }
}

/// Parse a byte size as people write it: `4GiB`, `512M`, `100k`, `1000` (binary units;
/// `B`, `iB` suffixes optional).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size; use e.g. 4GiB, 512M, 100k"))?;
    let unit = unit.trim().to_ascii_lowercase();
    let shift = match unit.trim_end_matches('b').trim_end_matches('i') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(format!("unknown unit in `{s}`; use k, M, G or T")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// Why the cache could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("cannot use {path} as the block cache directory")]
pub struct CacheError {
    /// The directory.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

/// Counters of a cache, as shown in status files.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CacheStats {
    /// Lookups answered from memory.
    pub memory_hits: u64,
    /// Lookups answered from disk.
    pub disk_hits: u64,
    /// Lookups that found nothing.
    pub misses: u64,
    /// Blocks written to disk.
    pub stored: u64,
    /// Blocks dropped from disk to stay under the bound.
    pub evicted: u64,
    /// Disk blocks that failed verification (deleted, fetched again).
    pub corrupt: u64,
    /// Bytes of files on disk now.
    pub disk_bytes: u64,
    /// Blocks on disk now.
    pub disk_blocks: u64,
}

struct MemTier {
    lru: LruCache<BlockHash, Arc<[u8]>>,
    bytes: u64,
    limit: u64,
}

struct DiskTier {
    /// Hash → file size, least recently used first out.
    lru: LruCache<BlockHash, u64>,
    bytes: u64,
    limit: u64,
}

enum WriteJob {
    Put(BlockHash, Arc<[u8]>),
    Barrier(SyncSender<()>),
}

#[derive(Default)]
struct Counters {
    memory_hits: AtomicU64,
    disk_hits: AtomicU64,
    misses: AtomicU64,
    stored: AtomicU64,
    evicted: AtomicU64,
    corrupt: AtomicU64,
}

struct Shared {
    dir: Option<PathBuf>,
    mem: Mutex<MemTier>,
    disk: Mutex<DiskTier>,
    counters: Counters,
}

/// A two-tier content-addressed block cache. Cheap to share: wrap it in an `Arc`.
pub struct BlockCache {
    shared: Arc<Shared>,
    writer: Option<Mutex<SyncSender<WriteJob>>>,
}

impl std::fmt::Debug for BlockCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache")
            .field("dir", &self.shared.dir)
            .field("stats", &self.stats())
            .finish()
    }
}

fn hex_of(hash: &BlockHash) -> String {
    hex::encode(hash)
}

fn block_path(root: &Path, hash: &BlockHash) -> PathBuf {
    let h = hex_of(hash);
    root.join(&h[..2]).join(h)
}

/// Encode a block for disk: header, then raw or zstd bytes, whichever is worth it.
fn encode(data: &[u8]) -> Vec<u8> {
    let compressed = zstd::bulk::compress(data, ZSTD_LEVEL).ok();
    let (codec, body): (u8, &[u8]) = match &compressed {
        Some(c) if (c.len() as u64) * 16 <= (data.len() as u64) * 15 => (CODEC_ZSTD, c),
        _ => (CODEC_RAW, data),
    };
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(MAGIC);
    out.push(codec);
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Decode a block file and check it against its hash.
fn decode(bytes: &[u8], hash: &BlockHash) -> Option<Vec<u8>> {
    if bytes.len() < HEADER || &bytes[..4] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(bytes[5..13].try_into().ok()?);
    // Blocks are at most a few MiB; a header claiming more is corrupt.
    if len > 1 << 30 {
        return None;
    }
    let body = &bytes[HEADER..];
    let data = match bytes[4] {
        CODEC_RAW => body.to_vec(),
        CODEC_ZSTD => zstd::bulk::decompress(body, len as usize).ok()?,
        _ => return None,
    };
    (data.len() as u64 == len && blake3::hash(&data).as_bytes() == hash).then_some(data)
}

impl BlockCache {
    /// Open (creating if needed) a cache. The on-disk tier is scanned once to learn what it
    /// holds; leftovers of interrupted writes are removed.
    pub fn open(cfg: &CacheConfig) -> Result<BlockCache, CacheError> {
        let root = cfg.dir.as_ref().map(|d| d.join("v1"));
        let mut disk = DiskTier {
            lru: LruCache::unbounded(),
            bytes: 0,
            limit: cfg.disk_bytes,
        };
        if let Some(root) = &root {
            let err = |source| CacheError {
                path: root.clone(),
                source,
            };
            // Private: the blocks are Delegator content kept after the lease.
            if let Some(dir) = &cfg.dir {
                crate::private::create_dir_all(dir).map_err(err)?;
            }
            crate::private::create_dir_all(&root.join("tmp")).map_err(err)?;
            for e in std::fs::read_dir(root.join("tmp")).map_err(err)?.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
            let mut found: Vec<(std::time::SystemTime, BlockHash, u64)> = Vec::new();
            for sub in std::fs::read_dir(root).map_err(err)?.flatten() {
                if sub.file_name() == "tmp" || !sub.path().is_dir() {
                    continue;
                }
                for f in std::fs::read_dir(sub.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    let mut hash = [0u8; 32];
                    let name = f.file_name();
                    let ok = name
                        .to_str()
                        .is_some_and(|n| hex::decode_to_slice(n, &mut hash).is_ok());
                    let Ok(meta) = f.metadata() else { continue };
                    if !ok || !meta.is_file() {
                        continue;
                    }
                    let t = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                    found.push((t, hash, meta.len()));
                }
            }
            // Oldest first, so the most recently written are the last to go.
            found.sort_unstable_by_key(|f| f.0);
            for (_, hash, size) in found {
                disk.lru.put(hash, size);
                disk.bytes += size;
            }
        }
        let shared = Arc::new(Shared {
            dir: root.clone(),
            mem: Mutex::new(MemTier {
                lru: LruCache::unbounded(),
                bytes: 0,
                limit: cfg.memory_bytes,
            }),
            disk: Mutex::new(disk),
            counters: Counters::default(),
        });
        shared.evict_disk();
        let writer = match root {
            Some(_) => {
                let (tx, rx) = std::sync::mpsc::sync_channel(WRITE_QUEUE);
                let s = shared.clone();
                std::thread::Builder::new()
                    .name("awcpfs-cache".into())
                    .spawn(move || s.write_loop(rx))
                    .map_err(|source| CacheError {
                        path: cfg.dir.clone().unwrap_or_default(),
                        source,
                    })?;
                Some(Mutex::new(tx))
            }
            None => None,
        };
        Ok(BlockCache { shared, writer })
    }

    /// A block, if cached; disk hits are verified and promoted to memory.
    pub fn get(&self, hash: &BlockHash) -> Option<Arc<[u8]>> {
        let s = &self.shared;
        if let Some(d) = s.mem.lock().lru.get(hash).cloned() {
            s.counters.memory_hits.fetch_add(1, Ordering::Relaxed);
            return Some(d);
        }
        let found = s.load(hash);
        match &found {
            Some(d) => {
                s.counters.disk_hits.fetch_add(1, Ordering::Relaxed);
                s.remember(*hash, d.clone());
            }
            None => {
                s.counters.misses.fetch_add(1, Ordering::Relaxed);
            }
        }
        found
    }

    /// Whether a block is cached (no load, no counters).
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.shared.mem.lock().lru.contains(hash) || self.shared.disk.lock().lru.contains(hash)
    }

    /// Cache a block the caller has verified against `hash`.
    pub fn put(&self, hash: BlockHash, data: Arc<[u8]>) {
        self.shared.remember(hash, data.clone());
        let Some(tx) = &self.writer else { return };
        if self.shared.disk.lock().lru.contains(&hash) {
            return;
        }
        if let Err(TrySendError::Full(_)) = tx.lock().try_send(WriteJob::Put(hash, data)) {
            tracing::trace!("block cache writer busy; block not cached on disk");
        }
    }

    /// Wait until every block handed to [`BlockCache::put`] so far is on disk (or dropped).
    pub fn flush(&self) {
        let Some(tx) = &self.writer else { return };
        let (done_tx, done_rx) = std::sync::mpsc::sync_channel(1);
        if tx.lock().send(WriteJob::Barrier(done_tx)).is_ok() {
            let _ = done_rx.recv();
        }
    }

    /// Counters and sizes.
    pub fn stats(&self) -> CacheStats {
        let c = &self.shared.counters;
        let (disk_bytes, disk_blocks) = {
            let d = self.shared.disk.lock();
            (d.bytes, d.lru.len() as u64)
        };
        CacheStats {
            memory_hits: c.memory_hits.load(Ordering::Relaxed),
            disk_hits: c.disk_hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            stored: c.stored.load(Ordering::Relaxed),
            evicted: c.evicted.load(Ordering::Relaxed),
            corrupt: c.corrupt.load(Ordering::Relaxed),
            disk_bytes,
            disk_blocks,
        }
    }

    /// The on-disk tier's directory, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.shared.dir.as_deref()
    }
}

impl Shared {
    fn remember(&self, hash: BlockHash, data: Arc<[u8]>) {
        let mut m = self.mem.lock();
        let len = data.len() as u64;
        if len > m.limit {
            return;
        }
        if let Some(old) = m.lru.put(hash, data) {
            m.bytes -= old.len() as u64;
        }
        m.bytes += len;
        while m.bytes > m.limit {
            match m.lru.pop_lru() {
                Some((_, d)) => m.bytes -= d.len() as u64,
                None => break,
            }
        }
    }

    fn load(&self, hash: &BlockHash) -> Option<Arc<[u8]>> {
        let root = self.dir.as_ref()?;
        // Not indexed: not on disk (and the LRU order is refreshed when it is).
        self.disk.lock().lru.get(hash)?;
        let path = block_path(root, hash);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(_) => {
                // Evicted by another process sharing the directory.
                self.forget(hash);
                return None;
            }
        };
        match decode(&bytes, hash) {
            Some(d) => Some(d.into()),
            None => {
                tracing::warn!(path = %path.display(), "cached block failed verification; deleted");
                self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                let _ = std::fs::remove_file(&path);
                self.forget(hash);
                None
            }
        }
    }

    fn forget(&self, hash: &BlockHash) {
        let mut d = self.disk.lock();
        if let Some(size) = d.lru.pop(hash) {
            d.bytes -= size;
        }
    }

    fn write_loop(&self, rx: Receiver<WriteJob>) {
        let Some(root) = &self.dir else { return };
        for job in rx {
            match job {
                WriteJob::Barrier(done) => {
                    let _ = done.send(());
                }
                WriteJob::Put(hash, data) => {
                    if self.disk.lock().lru.contains(&hash) {
                        continue;
                    }
                    match store(root, &hash, &data) {
                        Ok(size) => {
                            self.counters.stored.fetch_add(1, Ordering::Relaxed);
                            let mut d = self.disk.lock();
                            if d.lru.put(hash, size).is_none() {
                                d.bytes += size;
                            }
                            drop(d);
                            self.evict_disk();
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "block not cached on disk");
                        }
                    }
                }
            }
        }
    }

    fn evict_disk(&self) {
        let Some(root) = &self.dir else { return };
        loop {
            let victim = {
                let mut d = self.disk.lock();
                if d.bytes <= d.limit {
                    return;
                }
                match d.lru.pop_lru() {
                    Some((hash, size)) => {
                        d.bytes -= size;
                        hash
                    }
                    None => return,
                }
            };
            let _ = std::fs::remove_file(block_path(root, &victim));
            self.counters.evicted.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Write one block file atomically; returns its size.
fn store(root: &Path, hash: &BlockHash, data: &[u8]) -> std::io::Result<u64> {
    let bytes = encode(data);
    let final_path = block_path(root, hash);
    let tmp = root.join("tmp").join(format!(
        "{}.{}.{}",
        hex_of(hash),
        std::process::id(),
        rand::random::<u32>()
    ));
    let mut f = crate::private::file_options().truncate(true).open(&tmp)?;
    f.write_all(&bytes)?;
    drop(f);
    if let Some(parent) = final_path.parent() {
        crate::private::create_dir_all(parent)?;
    }
    if let Err(e) = std::fs::rename(&tmp, &final_path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(bytes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(data: &[u8]) -> BlockHash {
        *blake3::hash(data).as_bytes()
    }

    fn cfg(dir: &Path) -> CacheConfig {
        CacheConfig::new(Some(dir.to_path_buf()))
    }

    #[test]
    fn survives_reopen_and_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let text = b"hello hello hello hello hello hello hello".repeat(100);
        let c = BlockCache::open(&cfg(dir.path())).unwrap();
        c.put(h(&text), text.clone().into());
        c.flush();
        assert_eq!(c.stats().stored, 1);
        drop(c);
        let c = BlockCache::open(&cfg(dir.path())).unwrap();
        assert_eq!(c.stats().disk_blocks, 1);
        // Compressible text is stored compressed.
        assert!(c.stats().disk_bytes < text.len() as u64 / 4);
        assert_eq!(&*c.get(&h(&text)).unwrap(), &text[..]);
        assert_eq!(c.stats().disk_hits, 1);
        // Second read comes from memory.
        c.get(&h(&text)).unwrap();
        assert_eq!(c.stats().memory_hits, 1);
        assert!(c.get(&h(b"absent")).is_none());
        assert_eq!(c.stats().misses, 1);
    }

    #[test]
    fn incompressible_blocks_are_stored_raw() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..65536).map(|_| rand::random::<u8>()).collect();
        let c = BlockCache::open(&cfg(dir.path())).unwrap();
        c.put(h(&data), data.clone().into());
        c.flush();
        let file = block_path(&dir.path().join("v1"), &h(&data));
        let bytes = std::fs::read(file).unwrap();
        assert_eq!(bytes[4], CODEC_RAW);
        assert_eq!(bytes.len(), HEADER + data.len());
    }

    #[test]
    fn corrupt_files_are_deleted_not_served() {
        let dir = tempfile::tempdir().unwrap();
        let data = b"some block".to_vec();
        let c = BlockCache::open(&cfg(dir.path())).unwrap();
        c.put(h(&data), data.clone().into());
        c.flush();
        drop(c);
        let file = block_path(&dir.path().join("v1"), &h(&data));
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&file, bytes).unwrap();
        let c = BlockCache::open(&cfg(dir.path())).unwrap();
        assert!(c.get(&h(&data)).is_none());
        assert_eq!(c.stats().corrupt, 1);
        assert!(!file.exists());
        // A truncated header is corrupt too, never a panic.
        assert!(decode(b"AWB", &h(&data)).is_none());
        assert!(decode(b"AWB1\x09\0\0\0\0\0\0\0\0", &h(&data)).is_none());
    }

    #[test]
    fn disk_tier_is_bounded_least_recently_used_first() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = cfg(dir.path());
        config.memory_bytes = 0;
        let blocks: Vec<Vec<u8>> = (0..10u8)
            .map(|i| (0..4096).map(|_| rand::random::<u8>() ^ i).collect())
            .collect();
        // Room for about four blocks.
        config.disk_bytes = 4 * (4096 + HEADER as u64) + 100;
        let c = BlockCache::open(&config).unwrap();
        for b in &blocks[..4] {
            c.put(h(b), b.clone().into());
        }
        c.flush();
        // Touch the first so the second is the oldest.
        assert!(c.get(&h(&blocks[0])).is_some());
        c.put(h(&blocks[4]), blocks[4].clone().into());
        c.flush();
        let s = c.stats();
        assert_eq!(s.disk_blocks, 4);
        assert!(s.disk_bytes <= config.disk_bytes);
        assert_eq!(s.evicted, 1);
        assert!(c.contains(&h(&blocks[0])));
        assert!(!c.contains(&h(&blocks[1])));
        let files = walk_files(&dir.path().join("v1"));
        assert_eq!(files, 4, "evicted files are deleted");
    }

    #[test]
    fn sizes_parse_like_people_write_them() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("100k"), Ok(100 << 10));
        assert_eq!(parse_size("7"), Ok(7));
        assert_eq!(parse_size("2 gb"), Ok(2 << 30));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3X").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn memory_tier_is_bounded() {
        let c = BlockCache::open(&CacheConfig {
            dir: None,
            disk_bytes: 0,
            memory_bytes: 10_000,
        })
        .unwrap();
        for i in 0..10u32 {
            let b = vec![i as u8; 3000];
            c.put(h(&b), b.into());
        }
        let m = c.shared.mem.lock();
        assert!(m.bytes <= 10_000);
        assert_eq!(m.lru.len(), 3);
    }

    fn walk_files(root: &Path) -> usize {
        let mut n = 0;
        for sub in std::fs::read_dir(root).unwrap().flatten() {
            if sub.file_name() != "tmp" {
                n += std::fs::read_dir(sub.path()).unwrap().count();
            }
        }
        n
    }
}
