//! Where block content comes from: the block index over the exported tree, and the staging
//! store of uploaded blocks.
//!
//! Blocks are named by their blake3 hash. The **index** maps a hash to the places in the tree
//! where that content was seen (path, offset, length): built from the manifest at register,
//! extended by every commit. The tree can change under the index at any time (the Delegator
//! keeps working in it), so an index entry is only a hint: a block read from the tree is
//! always re-hashed, and served only if the hash still matches. The **staging store** holds
//! blocks the Executor uploaded ahead of a commit, one file per block named by its hex hash
//! in the export's `staging_dir` (outside the root, so it never shows up in the tree). They
//! are written atomically (temp file + rename) and re-verified on read as well.
//!
//! [`BlockSource::read_block`] tries the index first (the common case when serving the
//! workspace), then the staging store.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;

use super::rootfs::RootDir;

/// A block's name: its blake3 hash.
pub(crate) type BlockHash = [u8; 32];

/// How many places (files) the index remembers per hash: the newest ones, and the oldest
/// (for content found by the walk at register, the file it came from). Identical blocks in
/// more files than this are still served as long as one of the remembered files holds the
/// content.
const MAX_LOCATIONS: usize = 6;

/// Prefix of every temporary name the export creates (in the tree and in staging).
pub(crate) const TMP_PREFIX: &str = ".awcp-tmp-";

/// Parse a hex block hash from the wire.
pub(crate) fn parse_hash(hex_str: &str) -> Option<BlockHash> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_str, &mut out).ok()?;
    Some(out)
}

/// Hex of a block hash, as on the wire.
pub(crate) fn hash_hex(h: &BlockHash) -> String {
    hex::encode(h)
}

/// A fresh temporary file name.
pub(crate) fn tmp_name() -> String {
    format!("{TMP_PREFIX}{:016x}", rand::random::<u64>())
}

/// What a file looked like when its blocks were hashed: while `fstat` still says this,
/// its blocks need not be hashed again to be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub(crate) ino: u64,
    pub(crate) size: u64,
    pub(crate) mtime_ns: i64,
    pub(crate) ctime_ns: i64,
}

impl Stamp {
    pub(crate) fn of(st: &nix::sys::stat::FileStat) -> Stamp {
        Stamp {
            ino: st.st_ino,
            size: st.st_size as u64,
            mtime_ns: super::rootfs::mtime_ns(st),
            ctime_ns: super::rootfs::ctime_ns(st),
        }
    }
}

/// One place a block was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BlockLoc {
    /// Path relative to the root.
    pub(crate) path: Arc<str>,
    /// Byte offset in the file.
    pub(crate) offset: u64,
    /// Length of the block.
    pub(crate) len: u32,
}

/// Hash → places in the tree.
///
/// Cloned in constant time: a kept walk's index and the exports that take the walk share
/// their maps until one of them changes (copied then: ~30 ms at 100,000 files, paid by the
/// first commit or Delegator-side change, not by the delegation).
#[derive(Debug, Default, Clone)]
pub(crate) struct BlockIndex {
    map: Arc<HashMap<BlockHash, Vec<BlockLoc>>>,
    /// Files hashed while quiescent (see [`Stamp`]); others are always re-hashed.
    stamps: Arc<HashMap<Arc<str>, Stamp>>,
}

impl BlockIndex {
    /// Remember that `hash` was seen at `loc`; the newest place is tried first. One place per
    /// file (a block repeated within a file must not crowd other files out), and the oldest
    /// place is kept when the list is full: hard links or copies made and removed again
    /// must not push out the file the content lives in.
    pub(crate) fn insert(&mut self, hash: BlockHash, loc: BlockLoc) {
        let locs = Arc::make_mut(&mut self.map).entry(hash).or_default();
        locs.retain(|l| l.path != loc.path);
        locs.insert(0, loc);
        if locs.len() > MAX_LOCATIONS {
            locs.remove(MAX_LOCATIONS - 1);
        }
    }

    /// Record that `path` was hashed as `stamp` describes, not racily.
    pub(crate) fn set_stamp(&mut self, path: Arc<str>, stamp: Stamp) {
        Arc::make_mut(&mut self.stamps).insert(path, stamp);
    }

    /// The stamp of `path`, if it has one.
    pub(crate) fn stamp(&self, path: &str) -> Option<Stamp> {
        self.stamps.get(path).copied()
    }

    /// The places `hash` was seen, newest first.
    pub(crate) fn locations(&self, hash: &BlockHash) -> Vec<BlockLoc> {
        self.map.get(hash).cloned().unwrap_or_default()
    }

    /// Add everything `other` knows (its places go first, as the newest).
    pub(crate) fn merge(&mut self, other: BlockIndex) {
        for (hash, locs) in Arc::unwrap_or_clone(other.map) {
            for loc in locs.into_iter().rev() {
                self.insert(hash, loc);
            }
        }
        Arc::make_mut(&mut self.stamps).extend(Arc::unwrap_or_clone(other.stamps));
    }

    /// How many distinct blocks are indexed.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

/// Uploaded blocks, one file per block in a directory outside the root.
#[derive(Debug)]
pub(crate) struct Staging {
    dir: PathBuf,
}

impl Staging {
    /// Use (and create) `dir`.
    pub(crate) fn open(dir: &Path) -> io::Result<Staging> {
        crate::private::create_dir_all(dir)?;
        Ok(Staging {
            dir: dir.to_owned(),
        })
    }

    fn path_of(&self, hash: &BlockHash) -> PathBuf {
        self.dir.join(hash_hex(hash))
    }

    /// Whether a block with this name was stored (content is verified on read).
    pub(crate) fn contains(&self, hash: &BlockHash) -> bool {
        self.path_of(hash).is_file()
    }

    /// The block's content, if stored and intact. A corrupt block is removed.
    pub(crate) fn read(&self, hash: &BlockHash) -> io::Result<Option<Vec<u8>>> {
        let path = self.path_of(hash);
        let data = match fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if blake3::hash(&data).as_bytes() != hash {
            tracing::warn!(path = %path.display(), "staged block is corrupt; removing it");
            let _ = fs::remove_file(&path);
            return Ok(None);
        }
        Ok(Some(data))
    }

    /// Store a block whose hash the caller verified. Atomic: temp file, fsync, rename.
    pub(crate) fn store(&self, hash: &BlockHash, data: &[u8]) -> io::Result<()> {
        let final_path = self.path_of(hash);
        if final_path.is_file() {
            return Ok(());
        }
        let tmp = self.dir.join(tmp_name());
        let result = (|| {
            let mut f = crate::private::file_options().create_new(true).open(&tmp)?;
            f.write_all(data)?;
            f.sync_all()?;
            fs::rename(&tmp, &final_path)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }
}

/// Everything needed to find a block's content.
#[derive(Debug)]
pub(crate) struct BlockSource {
    pub(crate) root: RootDir,
    pub(crate) index: RwLock<BlockIndex>,
    pub(crate) staging: Staging,
}

impl BlockSource {
    /// The content of block `hash`, verified, from the tree (index) or the staging store.
    /// `None` when neither has it any more.
    pub(crate) fn read_block(&self, hash: &BlockHash) -> Option<Vec<u8>> {
        if let Some(data) = self.read_indexed(hash) {
            return Some(data);
        }
        match self.staging.read(hash) {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(hash = %hash_hex(hash), error = %e, "cannot read staged block");
                None
            }
        }
    }

    /// Whether the block can be had without an upload (staging presence, or a verified read
    /// from the tree).
    pub(crate) fn has_block(&self, hash: &BlockHash) -> bool {
        self.staging.contains(hash) || self.read_indexed(hash).is_some()
    }

    /// Read `hash` from the first of `places` (not indexed: found elsewhere) that holds it,
    /// verified, and index that place again, newest.
    pub(crate) fn read_unindexed(
        &self,
        hash: &BlockHash,
        places: Vec<BlockLoc>,
    ) -> Option<Vec<u8>> {
        let (buf, loc) = self.read_first(hash, places.into_iter().map(|l| (l, None)))?;
        self.index.write().insert(*hash, loc);
        Some(buf)
    }

    /// Read `hash` from the first indexed place that still holds it.
    fn read_indexed(&self, hash: &BlockHash) -> Option<Vec<u8>> {
        let (locations, stamps): (Vec<BlockLoc>, Vec<Option<Stamp>>) = {
            let index = self.index.read();
            let locs = index.locations(hash);
            let stamps = locs.iter().map(|l| index.stamp(&l.path)).collect();
            (locs, stamps)
        };
        self.read_first(hash, locations.into_iter().zip(stamps))
            .map(|(buf, _)| buf)
    }

    /// The content of `hash` from the first of `places` that holds it, and that place.
    fn read_first(
        &self,
        hash: &BlockHash,
        places: impl IntoIterator<Item = (BlockLoc, Option<Stamp>)>,
    ) -> Option<(Vec<u8>, BlockLoc)> {
        for (loc, stamp) in places {
            let Ok(file) = self.root.open_file(&loc.path) else {
                continue;
            };
            // Unchanged since it was hashed (same inode, size, mtime and ctime, checked
            // before and after the read): no need to hash again. The mount verifies every
            // block it receives either way.
            let unchanged = || {
                stamp.is_some_and(|s| {
                    nix::sys::stat::fstat(&file).is_ok_and(|st| Stamp::of(&st) == s)
                })
            };
            let trusted = unchanged();
            let Some(buf) = read_range(&file, loc.offset, u64::from(loc.len)) else {
                continue;
            };
            if (trusted && unchanged()) || blake3::hash(&buf).as_bytes() == hash {
                return Some((buf, loc));
            }
        }
        None
    }
}

/// Exactly `len` bytes of `file` from `offset`, read into fresh memory without zeroing it
/// first (this descriptor is ours alone, so seeking it is safe); `None` if the file is
/// shorter now or the read fails.
fn read_range(file: &std::fs::File, offset: u64, len: u64) -> Option<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = file;
    f.seek(SeekFrom::Start(offset)).ok()?;
    let mut buf = Vec::with_capacity(usize::try_from(len).ok()?);
    f.take(len).read_to_end(&mut buf).ok()?;
    (buf.len() as u64 == len).then_some(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_keeps_newest_places_first_and_bounded() {
        let mut idx = BlockIndex::default();
        for i in 0..10u64 {
            idx.insert(
                [7; 32],
                BlockLoc {
                    path: Arc::from(format!("f{i}")),
                    offset: 0,
                    len: 1,
                },
            );
        }
        let locs = idx.locations(&[7; 32]);
        assert_eq!(locs.len(), MAX_LOCATIONS);
        assert_eq!(&*locs[0].path, "f9");
        assert_eq!(&*locs[MAX_LOCATIONS - 2].path, "f5");
        assert_eq!(
            &*locs[MAX_LOCATIONS - 1].path,
            "f0",
            "the oldest place is kept"
        );
        assert!(idx.locations(&[8; 32]).is_empty());
        // One place per file: the same block again in f9 replaces f9's place.
        idx.insert(
            [7; 32],
            BlockLoc {
                path: Arc::from("f9"),
                offset: 4096,
                len: 1,
            },
        );
        let locs = idx.locations(&[7; 32]);
        assert_eq!(locs.len(), MAX_LOCATIONS);
        assert_eq!((&*locs[0].path, locs[0].offset), ("f9", 4096));
        assert_eq!(locs.iter().filter(|l| &*l.path == "f9").count(), 1);
    }

    #[test]
    fn stale_index_entries_are_not_served_and_staging_is_verified() {
        let root = tempfile::tempdir().unwrap();
        let staging = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("f"), b"abcdef").unwrap();
        let src = BlockSource {
            root: RootDir::open(root.path()).unwrap(),
            index: RwLock::new(BlockIndex::default()),
            staging: Staging::open(staging.path()).unwrap(),
        };
        let h = *blake3::hash(b"abc").as_bytes();
        src.index.write().insert(
            h,
            BlockLoc {
                path: Arc::from("f"),
                offset: 0,
                len: 3,
            },
        );
        assert_eq!(src.read_block(&h).as_deref(), Some(&b"abc"[..]));
        std::fs::write(root.path().join("f"), b"xyzdef").unwrap();
        assert_eq!(src.read_block(&h), None, "changed file must not be served");
        assert!(!src.has_block(&h));
        src.staging.store(&h, b"abc").unwrap();
        assert_eq!(src.read_block(&h).as_deref(), Some(&b"abc"[..]));
        // Corrupt the staged copy: it is dropped instead of served.
        std::fs::write(staging.path().join(hash_hex(&h)), b"evil").unwrap();
        assert_eq!(src.read_block(&h), None);
        assert!(!staging.path().join(hash_hex(&h)).exists());
    }

    #[test]
    fn stamped_files_are_served_unhashed_until_they_change() {
        let root = tempfile::tempdir().unwrap();
        let staging = tempfile::tempdir().unwrap();
        let f = root.path().join("f");
        std::fs::write(&f, b"abcdef").unwrap();
        let src = BlockSource {
            root: RootDir::open(root.path()).unwrap(),
            index: RwLock::new(BlockIndex::default()),
            staging: Staging::open(staging.path()).unwrap(),
        };
        // Index a hash that is NOT the content, and stamp the file as it is now: the export
        // trusts the stamp and skips the hash (the mount's own check would catch this).
        let claimed = *blake3::hash(b"zzz").as_bytes();
        let path: Arc<str> = Arc::from("f");
        let loc = BlockLoc {
            path: path.clone(),
            offset: 0,
            len: 3,
        };
        src.index.write().insert(claimed, loc);
        let st = nix::sys::stat::stat(&f).unwrap();
        src.index.write().set_stamp(path, Stamp::of(&st));
        assert_eq!(src.read_block(&claimed).as_deref(), Some(&b"abc"[..]));
        // Any write changes ctime: the stamp no longer holds, the block is hashed and refused.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&f, b"abcdef").unwrap();
        assert_eq!(src.read_block(&claimed), None);
    }

    #[test]
    fn hashes_parse_strictly() {
        let h = [0xab; 32];
        assert_eq!(parse_hash(&hash_hex(&h)), Some(h));
        assert_eq!(parse_hash("abc"), None);
        assert_eq!(parse_hash(&"zz".repeat(32)), None);
    }
}
