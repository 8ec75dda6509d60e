//! The upper files: the local content of the mount's files, one file per inode in the
//! state directory's `upper/`, named by inode number.
//!
//! A build creates and removes files by the thousand (compileall writes each `.pyc` under a
//! temporary name and renames it; a rebuild replaces its object files). Each new upper
//! file costs the disk's filesystem an inode allocation, and each removal frees one; on
//! ext4, an allocation walks past the inodes freed in the last seconds
//! (`recently_deleted`, reading their inode table blocks), so under that churn the walk
//! grew to a third of the mount's and the export's CPU time in a compileall (perf, see
//! docs/BENCHMARKS.md). The upper files of removed nodes are therefore kept, emptied, in
//! a small pool and renamed into place for the next new file: no allocation, no free.
//!
//! A pooled file is recycled only once its node has left the inode table and nothing can
//! reach it through a descriptor of the mount's own (no handle is open; the kernel has
//! forgotten the inode when the mount serves opens without asking). A reader that opens
//! an upper file by path outside the table's lock (the syncer) checks afterwards that the
//! node is still there, see [`super::sync`].
//!
//! Once the kernel opens files without asking (no-open), every `read` and `write` comes
//! without a handle; a linker's output is thousands of small writes. The upper files of the
//! files lately read or written that way stay open here ([`UpperFiles::loose`]), so such a
//! request costs no `open` and `close` of its own. Whatever replaces or removes an upper file
//! closes the descriptor kept for it: [`UpperFiles::create`] and [`UpperFiles::remove`] do,
//! and code that renames over one or removes it calls [`UpperFiles::forget`] right after.
//! A descriptor is opened under the same lock, so it names either the file from before
//! (and is closed by that call) or the one after.

use std::io;
use std::num::NonZeroUsize;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

use super::fs::Handle;
use super::inode::Ino;

/// Emptied files kept for reuse, at most: each costs an inode and no data.
pub const POOL_MAX: usize = 4096;

/// Upper files kept open for requests without a handle, at most.
pub const LOOSE_MAX: usize = 64;

/// The upper files of one mount, with the pool of emptied ones.
#[derive(Debug)]
pub struct UpperFiles {
    dir: PathBuf,
    /// Names (`free-<n>`) of emptied files ready for reuse.
    free: Mutex<Vec<u64>>,
    next: AtomicU64,
    /// Upper files open for reading and writing, for requests without a handle (the least
    /// recently used closed first).
    loose: Mutex<lru::LruCache<Ino, Arc<Handle>>>,
}

impl UpperFiles {
    /// The upper files in `dir` (which exists).
    pub fn new(dir: PathBuf) -> UpperFiles {
        UpperFiles {
            dir,
            free: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
            loose: Mutex::new(lru::LruCache::new(
                NonZeroUsize::new(LOOSE_MAX).expect("not zero"),
            )),
        }
    }

    /// `ino`'s upper file open for reading and writing, for a request without a handle:
    /// the one kept open, or opened now and kept. The caller has made sure the file is
    /// there ([`AwcpFs::ensure_local`](super::fs::AwcpFs)).
    pub fn loose(&self, ino: Ino) -> io::Result<Arc<Handle>> {
        let mut loose = self.loose.lock();
        if let Some(h) = loose.get(&ino) {
            return Ok(h.clone());
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(self.path(ino))?;
        let h = Arc::new(Handle {
            ino,
            file,
            writable: true,
            append: false,
            wrote: AtomicBool::new(false),
        });
        loose.put(ino, h.clone());
        Ok(h)
    }

    /// `ino`'s upper file was just replaced or removed: close the descriptor kept open for
    /// it, so no later request reaches the file it named.
    pub fn forget(&self, ino: Ino) {
        self.loose.lock().pop(&ino);
    }

    /// Where `ino`'s content lives.
    pub fn path(&self, ino: Ino) -> PathBuf {
        self.dir.join(ino.to_string())
    }

    fn slot(&self, n: u64) -> PathBuf {
        // Not a number: never an inode's name. A pool file left by an earlier run of the
        // mount (it was empty) is simply replaced when its name comes round again.
        self.dir.join(format!("free-{n}"))
    }

    /// An empty upper file for the new node `ino`: a pooled one renamed into place, or a
    /// new one.
    pub fn create(&self, ino: Ino) -> io::Result<()> {
        let reused = self.free.lock().pop();
        let made = match reused {
            Some(n) if std::fs::rename(self.slot(n), self.path(ino)).is_ok() => Ok(()),
            _ => std::fs::File::create(self.path(ino)).map(drop),
        };
        self.forget(ino);
        made
    }

    /// `ino` left the inode table and no descriptor of the mount holds its upper file:
    /// empty the file into the pool, or remove it when the pool is full (or the file is
    /// not there: never fetched).
    pub fn remove(&self, ino: Ino) {
        self.forget(ino);
        let path = self.path(ino);
        if self.free.lock().len() < POOL_MAX && self.pool(&path).is_ok() {
            return;
        }
        let _ = std::fs::remove_file(&path);
    }

    fn pool(&self, path: &Path) -> io::Result<()> {
        // Renamed first, then emptied (a pooled file holds no workspace content). Not the
        // other way round: the node's removal may not be durable in the journal yet, and
        // a power loss that kept the truncation but not the rename would leave a file the
        // journal still names, emptied — content a caller's `fsync` had made durable, lost.
        // A filesystem that journals metadata keeps these two in order.
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let slot = self.slot(n);
        std::fs::rename(path, &slot)?;
        let emptied = std::fs::OpenOptions::new()
            .write(true)
            .open(&slot)
            .and_then(|f| f.set_len(0));
        if let Err(e) = emptied {
            let _ = std::fs::remove_file(&slot);
            return Err(e);
        }
        self.free.lock().push(n);
        Ok(())
    }

    /// Emptied files in the pool now.
    pub fn pooled(&self) -> usize {
        self.free.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt as _;
    use std::os::unix::fs::MetadataExt as _;

    #[test]
    fn a_removed_file_is_emptied_and_reused_for_the_next_new_one() {
        let tmp = tempfile::tempdir().unwrap();
        let up = UpperFiles::new(tmp.path().to_path_buf());
        up.create(5).unwrap();
        std::fs::write(up.path(5), b"content of five").unwrap();
        let inode = std::fs::metadata(up.path(5)).unwrap().ino();
        up.remove(5);
        assert!(!up.path(5).exists());
        assert_eq!(up.pooled(), 1);
        up.create(9).unwrap();
        let m = std::fs::metadata(up.path(9)).unwrap();
        assert_eq!(m.ino(), inode, "the same file, renamed");
        assert_eq!(m.len(), 0, "emptied");
        assert_eq!(up.pooled(), 0);
        // An empty pool makes a new file.
        up.create(10).unwrap();
        assert_eq!(std::fs::metadata(up.path(10)).unwrap().len(), 0);
    }

    #[test]
    fn a_missing_file_is_not_pooled_and_a_full_pool_removes() {
        let tmp = tempfile::tempdir().unwrap();
        let up = UpperFiles::new(tmp.path().to_path_buf());
        up.remove(3);
        assert_eq!(up.pooled(), 0);
        for ino in 0..(POOL_MAX as u64 + 2) {
            up.create(ino).unwrap();
        }
        for ino in 0..(POOL_MAX as u64 + 2) {
            up.remove(ino);
        }
        assert_eq!(up.pooled(), POOL_MAX);
        let files = std::fs::read_dir(tmp.path()).unwrap().count();
        assert_eq!(files, POOL_MAX, "the two beyond the pool were removed");
    }

    #[test]
    fn a_kept_descriptor_is_reused_until_its_file_is_replaced_or_pooled() {
        let tmp = tempfile::tempdir().unwrap();
        let up = UpperFiles::new(tmp.path().to_path_buf());
        up.create(5).unwrap();
        let first = up.loose(5).unwrap();
        assert!(Arc::ptr_eq(&first, &up.loose(5).unwrap()), "kept open");
        let ino_of = |h: &Handle| h.file.metadata().unwrap().ino();
        // Replaced by a rename (a fetch storing its result): the next request gets the
        // new file once the rename is followed by `forget`.
        let tmp_file = tmp.path().join("next");
        std::fs::write(&tmp_file, b"new").unwrap();
        std::fs::rename(&tmp_file, up.path(5)).unwrap();
        up.forget(5);
        let second = up.loose(5).unwrap();
        assert_ne!(ino_of(&first), ino_of(&second));
        assert_eq!(
            ino_of(&second),
            std::fs::metadata(up.path(5)).unwrap().ino()
        );
        // Pooled and handed to another node: the old node's descriptor is gone with it,
        // and a write through the new node's reaches the new node's file only.
        up.remove(5);
        up.create(9).unwrap();
        up.loose(9).unwrap().file.write_all_at(b"nine", 0).unwrap();
        assert_eq!(std::fs::read(up.path(9)).unwrap(), b"nine");
        assert!(
            up.loose(5).is_err(),
            "no file, no descriptor kept from before"
        );
        // At most LOOSE_MAX stay open.
        for ino in 100..(100 + 2 * LOOSE_MAX as u64) {
            up.create(ino).unwrap();
            up.loose(ino).unwrap();
        }
        assert_eq!(up.loose.lock().len(), LOOSE_MAX);
    }
}
