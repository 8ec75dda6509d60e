//! Content hashes remembered between manifest builds, so that delegating the same tree again
//! reads only the files that changed.
//!
//! An entry is keyed by the file's device and inode number and is valid only while the
//! file's size, mtime and ctime (all to the nanosecond) are what they were when it was
//! hashed — the test git's index uses. ctime cannot be set by a program and changes with
//! every write, rename into place or metadata change, so a modified file never matches.
//!
//! Each entry also keeps the file's `user.*` extended attributes: setting or removing one
//! changes the ctime, so the same test covers them, and a repeated delegation reads no
//! attributes of unchanged files either.
//!
//! The "racy" case is kept out as git does: a file whose ctime or mtime is within
//! [`RACY_WINDOW`] of when it was hashed could still change within the same timestamp tick
//! without its times changing, so it is hashed again next time rather than remembered.
//!
//! Persisted as one zstd-compressed binary file, written to a temporary name and renamed;
//! a file that does not decode is ignored (everything is hashed again), never trusted.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::stat::FileStat;
use parking_lot::Mutex;

use super::manifest::FileHashes;
use super::rootfs::{ctime_ns, mtime_ns};

/// Files changed this recently are not remembered (their times may not yet reflect a write
/// in the same tick).
pub const RACY_WINDOW: Duration = Duration::from_secs(2);
/// Most entries kept; beyond it, entries unused since the cache was loaded are dropped.
const MAX_ENTRIES: usize = 4_000_000;
/// Version 2 added the attributes; a version 1 file is ignored (everything hashed again once).
const MAGIC: &[u8; 8] = b"AWHC0002";

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    size: u64,
    mtime_ns: i64,
    ctime_ns: i64,
    block_size: u32,
    hash: [u8; 32],
    blocks: Vec<([u8; 32], u32)>,
    /// `user.*` attributes, name → hex value.
    xattrs: std::collections::BTreeMap<String, String>,
    used: bool,
}

/// The remembered hashes of every file some export has hashed.
#[derive(Debug, Default)]
pub struct HashCache {
    path: Option<PathBuf>,
    map: Mutex<HashMap<(u64, u64), Entry>>,
    /// One save at a time (they share the temporary file).
    saving: Mutex<()>,
    racy_window: Option<Duration>,
    hits: std::sync::atomic::AtomicU64,
    misses: std::sync::atomic::AtomicU64,
    /// Whether the map holds something its file does not (set under the map's lock).
    unsaved: std::sync::atomic::AtomicBool,
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

/// Whether a file described by `st` changed so recently (within `window`) that a write in
/// the same timestamp tick could still leave its times as they are.
pub(crate) fn is_racy(st: &FileStat, window: Duration) -> bool {
    let racy_after = now_ns() - window.as_nanos() as i64;
    ctime_ns(st) >= racy_after || mtime_ns(st) >= racy_after
}

impl HashCache {
    /// A cache that lives only in memory.
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// Load the cache kept at `path` (an absent or unreadable file gives an empty cache).
    pub fn open(path: &Path) -> Self {
        let map = match std::fs::File::open(path) {
            Ok(f) => decode(f).unwrap_or_else(|e| {
                tracing::warn!(path = %path.display(), error = %e,
                    "ignoring an unreadable hash cache; files will be hashed again");
                HashMap::new()
            }),
            Err(_) => HashMap::new(),
        };
        HashCache {
            path: Some(path.to_path_buf()),
            map: Mutex::new(map),
            ..Default::default()
        }
    }

    /// Trust files changed more than `window` ago (default [`RACY_WINDOW`]). Tests use a
    /// zero window to cache files they just wrote; anything else should keep the default.
    pub fn with_racy_window(mut self, window: Duration) -> Self {
        self.racy_window = Some(window);
        self
    }

    /// Lookups answered, and lookups that found nothing usable, since it was opened.
    pub fn hits_and_misses(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.hits.load(Relaxed), self.misses.load(Relaxed))
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The hashes of the file `st` describes, if they were taken with this block size and
    /// the file has not changed since.
    pub(crate) fn lookup(&self, st: &FileStat, block_size: u32) -> Option<FileHashes> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut map = self.map.lock();
        let valid = |e: &Entry| {
            e.size == st.st_size as u64
                && e.mtime_ns == mtime_ns(st)
                && e.ctime_ns == ctime_ns(st)
                && e.block_size == block_size
        };
        let Some(e) = map.get_mut(&(st.st_dev, st.st_ino)).filter(|e| valid(e)) else {
            self.misses.fetch_add(1, Relaxed);
            return None;
        };
        self.hits.fetch_add(1, Relaxed);
        e.used = true;
        Some(FileHashes {
            hash: blake3::Hash::from_bytes(e.hash),
            blocks: e
                .blocks
                .iter()
                .map(|(h, l)| (blake3::Hash::from_bytes(*h), *l))
                .collect(),
            size: e.size,
            xattrs: e.xattrs.clone(),
        })
    }

    /// Remember `hashes` for the file `st` describes (taken after hashing, from the same
    /// descriptor), unless the file changed too recently to be trusted.
    pub(crate) fn insert(&self, st: &FileStat, block_size: u32, hashes: &FileHashes) {
        if is_racy(st, self.racy_window.unwrap_or(RACY_WINDOW)) {
            return;
        }
        if hashes.size != st.st_size as u64 {
            return;
        }
        let mut map = self.map.lock();
        self.unsaved
            .store(true, std::sync::atomic::Ordering::Relaxed);
        map.insert(
            (st.st_dev, st.st_ino),
            Entry {
                size: hashes.size,
                mtime_ns: mtime_ns(st),
                ctime_ns: ctime_ns(st),
                block_size,
                hash: *hashes.hash.as_bytes(),
                blocks: hashes
                    .blocks
                    .iter()
                    .map(|(h, l)| (*h.as_bytes(), *l))
                    .collect(),
                xattrs: hashes.xattrs.clone(),
                used: true,
            },
        );
    }

    /// Write the cache to its file, if it learnt anything since it was opened or last saved
    /// (no-op for an in-memory cache). A repeated delegation of an unchanged tree only looks
    /// hashes up: rewriting 100,000 entries then would take a CPU from the mount starting.
    pub fn save(&self) -> io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(path) = &self.path else {
            return Ok(());
        };
        let _one = self.saving.lock();
        let bytes = {
            let mut map = self.map.lock();
            if !self.unsaved.swap(false, Relaxed) {
                return Ok(());
            }
            if map.len() > MAX_ENTRIES {
                map.retain(|_, e| e.used);
            }
            encode(&map)
        };
        let written = bytes.and_then(|bytes| {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            let mut f = crate::private::file_options().truncate(true).open(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_data()?;
            drop(f);
            std::fs::rename(&tmp, path)
        });
        if written.is_err() {
            // Try again at the next save.
            self.unsaved.store(true, Relaxed);
        }
        written
    }
}

fn encode(map: &HashMap<(u64, u64), Entry>) -> io::Result<Vec<u8>> {
    let mut raw = Vec::with_capacity(map.len() * 100);
    raw.extend_from_slice(&(map.len() as u64).to_le_bytes());
    for ((dev, ino), e) in map {
        for v in [*dev, *ino, e.size] {
            raw.extend_from_slice(&v.to_le_bytes());
        }
        raw.extend_from_slice(&e.mtime_ns.to_le_bytes());
        raw.extend_from_slice(&e.ctime_ns.to_le_bytes());
        raw.extend_from_slice(&e.block_size.to_le_bytes());
        raw.extend_from_slice(&e.hash);
        raw.extend_from_slice(&(e.blocks.len() as u32).to_le_bytes());
        for (h, l) in &e.blocks {
            raw.extend_from_slice(h);
            raw.extend_from_slice(&l.to_le_bytes());
        }
        raw.extend_from_slice(&(e.xattrs.len() as u32).to_le_bytes());
        for (k, v) in &e.xattrs {
            for s in [k, v] {
                raw.extend_from_slice(&(s.len() as u32).to_le_bytes());
                raw.extend_from_slice(s.as_bytes());
            }
        }
    }
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&zstd::bulk::compress(&raw, 1)?);
    Ok(out)
}

/// A bounds-checked reader over the decompressed bytes.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        if self.0.len() < N {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "truncated"));
        }
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        Ok(head.try_into().expect("length checked"))
    }
    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn i64(&mut self) -> io::Result<i64> {
        Ok(i64::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn string(&mut self) -> io::Result<String> {
        let n = self.u32()? as usize;
        if n > self.0.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "truncated"));
        }
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8(s.to_vec())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8"))
    }
}

fn decode(mut f: impl Read) -> io::Result<HashMap<(u64, u64), Entry>> {
    let mut magic = [0u8; 8];
    f.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a hash cache",
        ));
    }
    let raw = zstd::stream::decode_all(f)?;
    let mut c = Cursor(&raw);
    let n = c.u64()?;
    let mut map = HashMap::with_capacity((n as usize).min(MAX_ENTRIES));
    for _ in 0..n {
        let dev = c.u64()?;
        let ino = c.u64()?;
        let size = c.u64()?;
        let mtime_ns = c.i64()?;
        let ctime_ns = c.i64()?;
        let block_size = c.u32()?;
        let hash = c.take::<32>()?;
        let nblocks = c.u32()?;
        // Each block record is 36 bytes: a count beyond what is left is corrupt.
        if nblocks as usize > c.0.len() / 36 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad block count",
            ));
        }
        let mut blocks = Vec::with_capacity(nblocks as usize);
        for _ in 0..nblocks {
            let h = c.take::<32>()?;
            blocks.push((h, c.u32()?));
        }
        let nx = c.u32()?;
        // Each attribute takes at least 8 bytes.
        if nx as usize > c.0.len() / 8 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad attribute count",
            ));
        }
        let mut xattrs = std::collections::BTreeMap::new();
        for _ in 0..nx {
            let k = c.string()?;
            xattrs.insert(k, c.string()?);
        }
        map.insert(
            (dev, ino),
            Entry {
                size,
                mtime_ns,
                ctime_ns,
                block_size,
                hash,
                blocks,
                xattrs,
                used: false,
            },
        );
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::manifest::hash_blocks;

    fn stat_of(p: &Path) -> FileStat {
        nix::sys::stat::stat(p).unwrap()
    }

    /// Set a file's times an hour back, so that it is not racy.
    fn age(p: &Path) {
        let t = SystemTime::now() - Duration::from_secs(3600);
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(t).unwrap();
    }

    #[test]
    fn hit_until_the_file_changes_and_survives_a_reload() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"hello world").unwrap();
        age(&file);
        let cache = HashCache::open(&dir.path().join("hashes.bin"));
        let st = stat_of(&file);
        let mut hashes = hash_blocks(std::fs::File::open(&file).unwrap(), 4).unwrap();
        // The attributes are remembered with the hashes.
        hashes.xattrs.insert("user.k".into(), "6869".into());
        // Recently changed (ctime is now): not remembered.
        cache.insert(&st, 4, &hashes);
        assert!(cache.lookup(&st, 4).is_none());
        // Pretend it was hashed well after its last change.
        let mut old = st;
        old.st_ctime -= 3600;
        cache.insert(&old, 4, &hashes);
        assert_eq!(cache.lookup(&old, 4), Some(hashes.clone()));
        assert!(cache.lookup(&old, 8).is_none(), "other block size");
        cache.save().unwrap();
        let reloaded = HashCache::open(&dir.path().join("hashes.bin"));
        assert_eq!(reloaded.lookup(&old, 4), Some(hashes.clone()));
        // Nothing learnt since: a save leaves the file alone; something new: written.
        std::fs::remove_file(dir.path().join("hashes.bin")).unwrap();
        assert_eq!(cache.lookup(&old, 4), Some(hashes.clone()));
        cache.save().unwrap();
        reloaded.save().unwrap();
        assert!(
            !dir.path().join("hashes.bin").exists(),
            "rewritten unchanged"
        );
        let mut other = old;
        other.st_ino += 1;
        reloaded.insert(&other, 4, &hashes);
        reloaded.save().unwrap();
        assert_eq!(
            HashCache::open(&dir.path().join("hashes.bin")).lookup(&other, 4),
            Some(hashes.clone())
        );
        // Any change of size, mtime or ctime misses.
        let mut changed = old;
        changed.st_mtime_nsec += 1;
        assert!(reloaded.lookup(&changed, 4).is_none());
        let mut changed = old;
        changed.st_ctime_nsec += 1;
        assert!(reloaded.lookup(&changed, 4).is_none());
        let mut changed = old;
        changed.st_size += 1;
        assert!(reloaded.lookup(&changed, 4).is_none());
    }

    #[test]
    fn a_corrupt_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hashes.bin");
        std::fs::write(&path, b"AWHC0001 garbage").unwrap();
        assert!(HashCache::open(&path).is_empty());
        // A valid header over a truncated body.
        let mut map = HashMap::new();
        map.insert(
            (1, 2),
            Entry {
                size: 3,
                mtime_ns: 4,
                ctime_ns: 5,
                block_size: 6,
                hash: [7; 32],
                blocks: vec![([8; 32], 3)],
                xattrs: [("user.a".to_string(), "00ff".to_string())].into(),
                used: false,
            },
        );
        let good = encode(&map).unwrap();
        assert_eq!(decode(&good[..]).unwrap(), map);
        let raw = zstd::stream::decode_all(&good[8..]).unwrap();
        let mut cut = MAGIC.to_vec();
        cut.extend_from_slice(&zstd::bulk::compress(&raw[..raw.len() - 5], 1).unwrap());
        assert!(decode(&cut[..]).is_err());
        std::fs::write(&path, &cut).unwrap();
        assert!(HashCache::open(&path).is_empty());
    }
}
