//! Special files: FIFOs, Unix sockets and device nodes (`mknod`).
//!
//! They work on the mount as on a local filesystem because the kernel does the work: once
//! an inode says `S_IFIFO` the kernel runs the pipe between the processes that open it
//! (FUSE never sees the opens, reads or writes); `bind` of a Unix socket creates a node
//! with `S_IFSOCK`, and `connect` finds the socket through the kernel's own table, keyed by
//! that inode. A device node is created and listed like on ext4, but the mount is `nodev`,
//! so opening one fails with `EACCES`.
//!
//! None of them is written back: a socket is process state on the Executor, a FIFO carries
//! no content, and a device node made by an Executor must never appear in the Delegator's
//! tree. They live in the inode table and the journal (so a crash recovery replays them
//! like any node) and the syncer leaves them out (a path where the Delegator had a file
//! and the mount now has a FIFO is removed on the Delegator, as if the name were gone).
//! The wire has no way to say "FIFO" at all: a change set can only create files,
//! directories and symlinks.

use std::ffi::OsStr;

use fuser::FileAttr;

use super::error::FsError;
use super::fs::{AwcpFs, Caller, name_str};
use super::inode::{Ino, Kind};

/// The node kind `mknod` is asked for, from the file-type bits of `mode` and `rdev`.
pub(super) fn kind_of(mode: u32, rdev: u32) -> Result<Kind, FsError> {
    match mode & libc::S_IFMT {
        0 | libc::S_IFREG => Ok(Kind::File),
        libc::S_IFIFO => Ok(Kind::Fifo),
        libc::S_IFSOCK => Ok(Kind::Socket),
        libc::S_IFCHR => Ok(Kind::CharDev(rdev)),
        libc::S_IFBLK => Ok(Kind::BlockDev(rdev)),
        _ => Err(FsError::Invalid {
            what: "mknod of an unknown file type",
        }),
    }
}

impl AwcpFs {
    /// `mknod`, owned by the mount's owner.
    pub fn mknod(&self, parent: Ino, name: &OsStr, mode: u32) -> Result<FileAttr, FsError> {
        self.mknod_as(self.owner(), parent, name, mode, 0)
    }

    /// `mknod` by `caller`: a regular file (empty and local), a FIFO, a socket or a
    /// device node (the kernel has checked `CAP_MKNOD` for devices).
    pub fn mknod_as(
        &self,
        caller: Caller,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        rdev: u32,
    ) -> Result<FileAttr, FsError> {
        self.check_write()?;
        let kind = kind_of(mode, rdev)?;
        let name = name_str(name)?;
        let name = &*name;
        let mut table = self.table.lock();
        match table.get(parent) {
            None => return Err(FsError::NotFound),
            Some(d) if d.kind != Kind::Dir => return Err(FsError::NotDir),
            Some(_) => {}
        }
        if table.child(parent, name).is_some() {
            return Err(FsError::Exists);
        }
        let ino = table.alloc_ino();
        if kind == Kind::File {
            self.upper.create(ino)?;
        }
        let node = self.new_node(
            &table,
            caller,
            ino,
            (parent, name),
            kind,
            (mode & 0o7777) as u16,
        );
        self.add_child_node(&mut table, node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mknod_kinds_from_the_mode() {
        assert_eq!(kind_of(0o644, 0).unwrap(), Kind::File);
        assert_eq!(kind_of(libc::S_IFREG | 0o644, 0).unwrap(), Kind::File);
        assert_eq!(kind_of(libc::S_IFIFO | 0o644, 0).unwrap(), Kind::Fifo);
        assert_eq!(kind_of(libc::S_IFSOCK | 0o755, 0).unwrap(), Kind::Socket);
        assert_eq!(
            kind_of(libc::S_IFCHR | 0o600, 0x0103).unwrap(),
            Kind::CharDev(0x0103)
        );
        assert_eq!(
            kind_of(libc::S_IFBLK | 0o600, 0x0801).unwrap(),
            Kind::BlockDev(0x0801)
        );
        assert!(kind_of(libc::S_IFDIR | 0o755, 0).is_err());
    }

    #[test]
    fn special_kinds_are_special() {
        assert!(Kind::Fifo.is_special() && Kind::Socket.is_special());
        assert!(Kind::CharDev(1).is_special() && Kind::BlockDev(1).is_special());
        assert!(!Kind::File.is_special() && !Kind::Dir.is_special());
        assert!(!Kind::Symlink.is_special());
    }
}
