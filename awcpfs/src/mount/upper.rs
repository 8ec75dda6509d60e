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

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::inode::Ino;

/// Emptied files kept for reuse, at most: each costs an inode and no data.
pub const POOL_MAX: usize = 4096;

/// The upper files of one mount, with the pool of emptied ones.
#[derive(Debug)]
pub struct UpperFiles {
    dir: PathBuf,
    /// Names (`free-<n>`) of emptied files ready for reuse.
    free: Mutex<Vec<u64>>,
    next: AtomicU64,
}

impl UpperFiles {
    /// The upper files in `dir` (which exists).
    pub fn new(dir: PathBuf) -> UpperFiles {
        UpperFiles {
            dir,
            free: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
        }
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
        if let Some(n) = reused
            && std::fs::rename(self.slot(n), self.path(ino)).is_ok()
        {
            return Ok(());
        }
        std::fs::File::create(self.path(ino)).map(drop)
    }

    /// `ino` left the inode table and no descriptor of the mount holds its upper file:
    /// empty the file into the pool, or remove it when the pool is full (or the file is
    /// not there: never fetched).
    pub fn remove(&self, ino: Ino) {
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
}
