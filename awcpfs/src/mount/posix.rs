//! The less common POSIX operations: extended attributes and `fallocate`.
//!
//! Extended attributes live in the inode table (`Node::xattrs`) and in the journal, so they
//! survive a crash of the process like any other namespace change. Only the `user.*`
//! namespace is stored: `trusted.*` and `security.*` need privileges the Executor should
//! not exercise on behalf of an agent, and `system.*` (POSIX ACLs) would change permission
//! checks the kernel makes with `default_permissions`. The syncer writes them back with the
//! file (`xattrs` of a write) or alone (`xattrs` of a chmod). The Delegator's own `user.*`
//! attributes come with the manifest and seed the inode table (see `docs/SEMANTICS.md`).

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::time::SystemTime;

use fuser::FileAttr;

use super::content::mark_dirty;
use super::error::FsError;
use super::fs::AwcpFs;
use super::inode::{Ino, Kind};
use super::journal::Record;

/// The one namespace stored.
const USER_PREFIX: &str = "user.";
/// Longest value, as ext4 with default inode size allows in practice (one block).
pub const MAX_XATTR_VALUE: usize = 64 * 1024;
/// All names and values of one inode together.
pub const MAX_XATTR_TOTAL: usize = 256 * 1024;
/// `XATTR_CREATE`: fail if the attribute exists.
const XATTR_CREATE: i32 = 1;
/// `XATTR_REPLACE`: fail if it does not.
const XATTR_REPLACE: i32 = 2;

/// The answer to a `getxattr`/`listxattr` whose caller may only ask for the size.
#[derive(Debug, PartialEq, Eq)]
pub enum XattrReply {
    /// The size the caller needs (it passed size 0).
    Size(u32),
    /// The bytes.
    Data(Vec<u8>),
}

fn sized(bytes: Vec<u8>, size: u32) -> Result<XattrReply, FsError> {
    if size == 0 {
        return Ok(XattrReply::Size(
            u32::try_from(bytes.len()).unwrap_or(u32::MAX),
        ));
    }
    if bytes.len() > size as usize {
        return Err(FsError::AttrRange);
    }
    Ok(XattrReply::Data(bytes))
}

/// A name in the stored namespace, or why not.
fn user_name(name: &OsStr) -> Result<&str, FsError> {
    if name.len() > 255 {
        return Err(FsError::AttrRange);
    }
    match name.to_str() {
        Some(n) if n.starts_with(USER_PREFIX) && n.len() > USER_PREFIX.len() => Ok(n),
        _ => Err(FsError::Unsupported {
            op: "extended attributes outside user.*",
        }),
    }
}

impl AwcpFs {
    /// `getxattr`.
    pub fn getxattr(&self, ino: Ino, name: &OsStr, size: u32) -> Result<XattrReply, FsError> {
        self.check()?;
        let table = self.table.lock();
        if let Some(r) = self
            .aecp
            .getxattr(&table, ino, &name.to_string_lossy(), size)
        {
            return r;
        }
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        // Any other namespace simply has no attributes (what tools probing for ACLs or
        // SELinux labels expect from a filesystem without them).
        let Ok(name) = user_name(name) else {
            return Err(FsError::NoAttr);
        };
        let value = node.xattrs.get(name).ok_or(FsError::NoAttr)?;
        sized(value.clone(), size)
    }

    /// `listxattr`: the names, each followed by a NUL.
    pub fn listxattr(&self, ino: Ino, size: u32) -> Result<XattrReply, FsError> {
        self.check()?;
        let table = self.table.lock();
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        let mut out = Vec::new();
        for name in node.xattrs.keys() {
            out.extend_from_slice(name.as_bytes());
            out.push(0);
        }
        sized(out, size)
    }

    /// `setxattr` with `XATTR_CREATE`/`XATTR_REPLACE`.
    pub fn setxattr(
        &self,
        ino: Ino,
        name: &OsStr,
        value: &[u8],
        flags: i32,
    ) -> Result<(), FsError> {
        self.check_write()?;
        self.table.lock().refuse_withheld(ino)?;
        let name = user_name(name)?;
        if value.len() > MAX_XATTR_VALUE {
            return Err(FsError::AttrTooBig {
                what: "values are limited to 64 KiB",
            });
        }
        let mut table = self.table.lock();
        let node = table.get_mut(ino).ok_or(FsError::NotFound)?;
        if node.kind == Kind::Symlink {
            // The kernel refuses user.* on symlinks before asking; keep the rule here too.
            return Err(FsError::Unsupported {
                op: "user.* attributes on symlinks",
            });
        }
        let exists = node.xattrs.contains_key(name);
        if flags & XATTR_CREATE != 0 && exists {
            return Err(FsError::Exists);
        }
        if flags & XATTR_REPLACE != 0 && !exists {
            return Err(FsError::NoAttr);
        }
        let total: usize = node
            .xattrs
            .iter()
            .filter(|(n, _)| n.as_str() != name)
            .map(|(n, v)| n.len() + v.len())
            .sum::<usize>()
            + name.len()
            + value.len();
        if total > MAX_XATTR_TOTAL {
            return Err(FsError::AttrTooBig {
                what: "an inode's attributes are limited to 256 KiB together",
            });
        }
        node.xattrs.insert(name.to_string(), value.to_vec());
        node.ctime = SystemTime::now();
        table.mark_node(ino);
        self.journal(&[Record::Xattr {
            ino,
            name: name.to_string(),
            value: Some(hex::encode(value)),
        }])
    }

    /// `removexattr`.
    pub fn removexattr(&self, ino: Ino, name: &OsStr) -> Result<(), FsError> {
        self.check_write()?;
        self.table.lock().refuse_withheld(ino)?;
        let Ok(name) = user_name(name) else {
            return Err(FsError::NoAttr);
        };
        let mut table = self.table.lock();
        let node = table.get_mut(ino).ok_or(FsError::NotFound)?;
        node.xattrs.remove(name).ok_or(FsError::NoAttr)?;
        node.ctime = SystemTime::now();
        table.mark_node(ino);
        self.journal(&[Record::Xattr {
            ino,
            name: name.to_string(),
            value: None,
        }])
    }

    /// Clear set-user-ID and set-group-ID of a file being written by someone without
    /// `CAP_FSETID` (the kernel asks, see `FUSE_HANDLE_KILLPRIV_V2`).
    pub fn drop_suidgid(&self, ino: Ino) {
        let rec = {
            let mut table = self.table.lock();
            let Some(node) = table.get_mut(ino) else {
                return;
            };
            if node.perm & 0o6000 == 0 {
                return;
            }
            node.perm &= !0o6000;
            node.ctime = SystemTime::now();
            let rec = Record::node(node);
            table.mark_node(ino);
            rec
        };
        if let Err(e) = self.journal(&[rec]) {
            tracing::warn!(error = %e, "cannot journal a mode change");
        }
    }

    /// `fallocate` on an open handle (0: a file opened without asking): the same mode on
    /// the upper file (allocate, keep size, punch a hole, zero a range…), after fetching the
    /// content if it is still remote.
    pub fn fallocate(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> Result<FileAttr, FsError> {
        self.check_write()?;
        self.writing(ino, fh, || {
            let h = self.handle_for(ino, fh, true)?;
            if !h.writable {
                return Err(FsError::BadHandle);
            }
            self.ensure_local(h.ino)?;
            let (Ok(off), Ok(len)) = (i64::try_from(offset), i64::try_from(length)) else {
                return Err(FsError::Invalid {
                    what: "offset or length out of range",
                });
            };
            nix::fcntl::fallocate(
                h.file.as_fd(),
                nix::fcntl::FallocateFlags::from_bits_retain(mode),
                off,
                len,
            )
            .map_err(|e| FsError::from(std::io::Error::from(e)))?;
            let size = h.file.metadata()?.len();
            h.wrote.store(true, std::sync::atomic::Ordering::Relaxed);
            let mut table = self.table.lock();
            table.mark_node(h.ino);
            let node = table.get_mut(h.ino).ok_or(FsError::NotFound)?;
            node.size = size;
            // Punching a hole or zeroing a range changes content, growing changes the size:
            // mark it dirty in every case (an unchanged file costs one hash at write-back).
            node.mtime = SystemTime::now();
            node.ctime = node.mtime;
            mark_dirty(node);
            Ok(self.attr_of(node))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_probe_and_range() {
        assert_eq!(sized(b"abc".to_vec(), 0).unwrap(), XattrReply::Size(3));
        assert_eq!(
            sized(b"abc".to_vec(), 3).unwrap(),
            XattrReply::Data(b"abc".to_vec())
        );
        assert!(matches!(sized(b"abc".to_vec(), 2), Err(FsError::AttrRange)));
    }

    #[test]
    fn only_user_names_are_stored() {
        assert_eq!(user_name(OsStr::new("user.x")).unwrap(), "user.x");
        assert!(user_name(OsStr::new("user.")).is_err());
        assert!(matches!(
            user_name(OsStr::new("trusted.x")),
            Err(FsError::Unsupported { .. })
        ));
        assert!(matches!(
            user_name(OsStr::new("security.selinux")),
            Err(FsError::Unsupported { .. })
        ));
    }
}
