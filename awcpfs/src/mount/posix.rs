//! The less common POSIX operations: extended attributes and `fallocate`, and the
//! ownership rules of a local filesystem.
//!
//! Ownership: permission checks are the kernel's (`default_permissions`): it decides who
//! may chmod, chown, truncate, or remove and rename in a sticky directory, from the
//! owners this layer reports. So a new node belongs to the process that made it (FUSE
//! passes its uid and gid with each request), or to the directory's group in a
//! set-group-ID directory; and because the mount takes `FUSE_HANDLE_KILLPRIV_V2`, the
//! clearing of set-user-ID and set-group-ID on write, truncate and chown is done here
//! (`kill_on_chown`, `kill_on_truncate`, [`AwcpFs::drop_suidgid`]). Owners are local to
//! the Executor: they are never written back (see `docs/SEMANTICS.md`).
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

/// Who makes a request: the calling process's uid and gid, as FUSE passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// Effective (filesystem) user id.
    pub uid: u32,
    /// Effective (filesystem) group id.
    pub gid: u32,
}

/// `S_ISUID`.
const SUID: u16 = 0o4000;
/// `S_ISGID`.
const SGID: u16 = 0o2000;
/// `S_IXGRP`.
const XGRP: u16 = 0o0010;

/// The group and permission bits of a node `caller` makes with `perm` in a directory of
/// mode and group `dir` (`None` if unknown): the caller's group, or in a set-group-ID
/// directory the directory's, a new directory there being set-group-ID too (what ext4
/// does; the kernel has already removed set-group-ID from a file's `perm` when the caller
/// is not in the group it would get).
pub(super) fn new_owner(
    caller: Caller,
    dir: Option<(u16, u32)>,
    kind: Kind,
    perm: u16,
) -> (u32, u16) {
    match dir {
        Some((dir_perm, dir_gid)) if dir_perm & SGID != 0 => {
            let perm = if kind == Kind::Dir { perm | SGID } else { perm };
            (dir_gid, perm)
        }
        _ => (caller.gid, perm),
    }
}

/// The permission bits after a chown (`uid`/`gid` given) of a node of `kind` by `caller`.
/// As the kernel does on a local filesystem (`chown_common`, `setattr_should_drop_sgid`):
/// set-user-ID goes on any chown of a non-directory; set-group-ID too when the group may
/// execute (without that bit it marks mandatory locking, kept), or when the caller is not
/// root (a non-root caller may only give the file to one of its own groups, so the
/// kernel's "not in the group" case reduces to that).
pub(super) fn kill_on_chown(perm: u16, kind: Kind, caller: Caller) -> u16 {
    if kind == Kind::Dir {
        return perm;
    }
    let mut perm = perm & !SUID;
    if perm & SGID != 0 && (perm & XGRP != 0 || caller.uid != 0) {
        perm &= !SGID;
    }
    perm
}

/// The permission bits after `caller` truncates a file (the kernel leaves this to us with
/// `FUSE_HANDLE_KILLPRIV_V2`): a caller without `CAP_FSETID` (taken as: not root) clears
/// set-user-ID, and set-group-ID when the group may execute.
pub(super) fn kill_on_truncate(perm: u16, caller: Caller) -> u16 {
    if caller.uid == 0 {
        return perm;
    }
    let mut perm = perm & !SUID;
    if perm & XGRP != 0 {
        perm &= !SGID;
    }
    perm
}

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
        // git's fsmonitor hook asking what changed since a token (`mount/changes.rs`).
        if let Some(token) = name
            .to_str()
            .and_then(|n| n.strip_prefix(super::changes::FSMONITOR_XATTR))
        {
            if let Some(instance) = self.changes.foreign_instance(token) {
                // An earlier mount's token: answerable if it ended cleanly (the export
                // says), asked before the table is locked.
                self.changes
                    .vouch(instance, |i| match self.remote.mount_ended_clean(i) {
                        Ok(ended) => ended,
                        Err(e) => {
                            tracing::debug!(error = %e, instance = i,
                                "cannot ask the export how an earlier mount ended");
                            false
                        }
                    });
            }
            let table = self.table.lock();
            if table.get(ino).map(|n| n.kind) != Some(Kind::Dir) {
                return Err(FsError::NoAttr);
            }
            return sized(self.changes.answer(&table, ino, token).to_bytes(), size);
        }
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
        // Journaled first: an attribute whose record cannot be written is not set.
        self.journal(&[Record::Xattr {
            ino,
            name: name.to_string(),
            value: Some(hex::encode(value)),
        }])?;
        let node = table.get_mut(ino).ok_or(FsError::NotFound)?;
        node.xattrs.insert(name.to_string(), value.to_vec());
        node.ctime = SystemTime::now();
        table.mark_node(ino);
        Ok(())
    }

    /// `removexattr`.
    pub fn removexattr(&self, ino: Ino, name: &OsStr) -> Result<(), FsError> {
        self.check_write()?;
        self.table.lock().refuse_withheld(ino)?;
        let Ok(name) = user_name(name) else {
            return Err(FsError::NoAttr);
        };
        let mut table = self.table.lock();
        let node = table.get(ino).ok_or(FsError::NotFound)?;
        if !node.xattrs.contains_key(name) {
            return Err(FsError::NoAttr);
        }
        self.journal(&[Record::Xattr {
            ino,
            name: name.to_string(),
            value: None,
        }])?;
        let node = table.get_mut(ino).ok_or(FsError::NotFound)?;
        node.xattrs.remove(name);
        node.ctime = SystemTime::now();
        table.mark_node(ino);
        Ok(())
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

    const ROOT: Caller = Caller { uid: 0, gid: 0 };
    const USER: Caller = Caller {
        uid: 1000,
        gid: 1000,
    };

    #[test]
    fn new_nodes_take_the_callers_group_or_a_setgid_directorys() {
        assert_eq!(
            new_owner(USER, Some((0o755, 50)), Kind::File, 0o644),
            (1000, 0o644)
        );
        assert_eq!(new_owner(USER, None, Kind::File, 0o644), (1000, 0o644));
        // Set-group-ID directory: its group; a subdirectory inherits the bit, a file not.
        assert_eq!(
            new_owner(USER, Some((0o2775, 50)), Kind::File, 0o644),
            (50, 0o644)
        );
        assert_eq!(
            new_owner(USER, Some((0o2775, 50)), Kind::Dir, 0o755),
            (50, 0o2755)
        );
        assert_eq!(
            new_owner(ROOT, Some((0o2775, 50)), Kind::Fifo, 0o600),
            (50, 0o600)
        );
    }

    #[test]
    fn chown_clears_setuid_and_setgid_like_ext4() {
        // Symptom (pjdfstest chown/00.t): a non-root owner's chown kept set-user-ID.
        assert_eq!(kill_on_chown(0o6555, Kind::File, USER), 0o0555);
        assert_eq!(kill_on_chown(0o6555, Kind::File, ROOT), 0o0555);
        // Set-group-ID without group execute is kept for root.
        assert_eq!(kill_on_chown(0o6545, Kind::File, ROOT), 0o2545);
        assert_eq!(kill_on_chown(0o6545, Kind::File, USER), 0o0545);
        // Directories keep both.
        assert_eq!(kill_on_chown(0o6755, Kind::Dir, USER), 0o6755);
    }

    #[test]
    fn truncate_by_non_root_clears_setuid() {
        assert_eq!(kill_on_truncate(0o6755, USER), 0o0755);
        assert_eq!(kill_on_truncate(0o6745, USER), 0o2745);
        assert_eq!(kill_on_truncate(0o6755, ROOT), 0o6755);
    }

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
