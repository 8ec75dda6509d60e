//! FUSE passthrough's backing files, shared by both transports (`/dev/fuse` through fuser,
//! and io_uring): which inode has a backing id registered with the kernel, how many open
//! handles use it, and whether passthrough is on at all.
//!
//! One backing id per inode: the kernel refuses (with `EIO`) a second open of an inode with
//! a different backing file, and does not mix passthrough and cached opens of one inode, so
//! only an inode nobody else has open starts passthrough. The id is closed (its `Drop`) with
//! the last handle that used it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::fs::AwcpFs;

/// Passthrough state of one mount; `Id` is the transport's backing id, closed on drop.
#[derive(Debug)]
pub(crate) struct BackingTable<Id> {
    /// Set in `init` when the kernel accepted passthrough; cleared for the rest of the mount
    /// the first time the kernel refuses a file.
    on: AtomicBool,
    /// Backing ids by inode, and how many handles use each.
    by_ino: Mutex<HashMap<u64, (Arc<Id>, usize)>>,
    /// Passthrough handles and their inodes.
    handles: Mutex<HashMap<u64, u64>>,
}

impl<Id> BackingTable<Id> {
    pub(crate) fn new() -> Self {
        BackingTable {
            on: AtomicBool::new(false),
            by_ino: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
        }
    }

    /// Whether files are opened with passthrough.
    pub(crate) fn enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// What `init` settled.
    pub(crate) fn set_enabled(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// The backing id to open `fh` (of inode `ino`) with, registering the upper file with
    /// the kernel through `open` if this inode has none yet; `None` serves the open without
    /// passthrough.
    pub(crate) fn backing_for(
        &self,
        fs: &AwcpFs,
        ino: u64,
        fh: u64,
        open: impl FnOnce(&std::fs::File) -> std::io::Result<Id>,
    ) -> Option<Arc<Id>> {
        if !self.enabled() {
            return None;
        }
        let mut by_ino = self.by_ino.lock();
        let id = match by_ino.get_mut(&ino) {
            Some((id, users)) => {
                *users += 1;
                id.clone()
            }
            None => {
                if fs.open_handles_of(ino) != 1 {
                    return None;
                }
                let handle = fs.handle(fh).ok()?;
                match open(&handle.file) {
                    Ok(id) => {
                        let id = Arc::new(id);
                        by_ino.insert(ino, (id.clone(), 1));
                        id
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "FUSE passthrough refused; serving reads ourselves");
                        self.set_enabled(false);
                        return None;
                    }
                }
            }
        };
        self.handles.lock().insert(fh, ino);
        fs.stats().add_passthrough_open();
        Some(id)
    }

    /// Handle `fh` is released: drop its inode's backing id with its last user.
    pub(crate) fn release(&self, fh: u64) {
        let Some(ino) = self.handles.lock().remove(&fh) else {
            return;
        };
        let mut by_ino = self.by_ino.lock();
        if let Some((_, users)) = by_ino.get_mut(&ino) {
            *users -= 1;
            if *users == 0 {
                by_ino.remove(&ino);
            }
        }
    }
}
