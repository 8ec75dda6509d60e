//! The kernel's FUSE wire structures (`include/uapi/linux/fuse.h`), written out for the
//! io_uring adapter: fuser keeps its own private. Every struct is `repr(C)`, made of plain
//! integers with no implicit padding (the size tests below pin each to the kernel's), so any
//! byte pattern is a valid value and a value's bytes are exactly what the kernel reads.

#![allow(unsafe_code)]

/// Plain-integer wire structs: read from and written as bytes.
///
/// # Safety
/// Only for `repr(C)` structs of integers without padding: every bit pattern is a value.
pub unsafe trait Wire: Copy + Default {
    /// The struct at the start of `b`, or `None` when `b` is shorter.
    fn read(b: &[u8]) -> Option<Self> {
        if b.len() < std::mem::size_of::<Self>() {
            return None;
        }
        // SAFETY: the length is checked above; `Self` is plain integers (the trait's
        // contract), so any bytes are a valid value; `read_unaligned` needs no alignment.
        Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<Self>()) })
    }
    /// The struct's bytes.
    fn bytes(&self) -> &[u8] {
        // SAFETY: `Self` has no padding (the trait's contract), so every byte is initialised.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const Self).cast::<u8>(),
                std::mem::size_of::<Self>(),
            )
        }
    }
}

macro_rules! wire {
    ($($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident: $t:ty,)* })*) => {$(
        $(#[$m])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct $name { $($(#[$fm])* pub $f: $t,)* }
        // SAFETY: repr(C), integers only; the size tests show there is no padding.
        unsafe impl Wire for $name {}
    )*};
}

wire! {
    /// `fuse_in_header`.
    pub struct InHeader {
        pub len: u32, pub opcode: u32, pub unique: u64, pub nodeid: u64,
        pub uid: u32, pub gid: u32, pub pid: u32, pub total_extlen: u16, pub padding: u16,
    }
    /// `fuse_out_header`.
    pub struct OutHeader { pub len: u32, pub error: i32, pub unique: u64, }
    /// `fuse_init_in` (7.36+).
    pub struct InitIn {
        pub major: u32, pub minor: u32, pub max_readahead: u32, pub flags: u32, pub flags2: u32,
        pub unused: [u32; 11],
    }
    /// `fuse_init_out`.
    pub struct InitOut {
        pub major: u32, pub minor: u32, pub max_readahead: u32, pub flags: u32,
        pub max_background: u16, pub congestion_threshold: u16, pub max_write: u32,
        pub time_gran: u32, pub max_pages: u16, pub map_alignment: u16, pub flags2: u32,
        pub max_stack_depth: u32, pub request_timeout: u16, pub unused: [u16; 11],
    }
    /// `fuse_attr`.
    pub struct Attr {
        pub ino: u64, pub size: u64, pub blocks: u64, pub atime: u64, pub mtime: u64,
        pub ctime: u64, pub atimensec: u32, pub mtimensec: u32, pub ctimensec: u32,
        pub mode: u32, pub nlink: u32, pub uid: u32, pub gid: u32, pub rdev: u32,
        pub blksize: u32, pub flags: u32,
    }
    /// `fuse_entry_out`.
    pub struct EntryOut {
        pub nodeid: u64, pub generation: u64, pub entry_valid: u64, pub attr_valid: u64,
        pub entry_valid_nsec: u32, pub attr_valid_nsec: u32, pub attr: Attr,
    }
    /// `fuse_attr_out`.
    pub struct AttrOut { pub attr_valid: u64, pub attr_valid_nsec: u32, pub dummy: u32, pub attr: Attr, }
    /// `fuse_getattr_in`.
    pub struct GetattrIn { pub getattr_flags: u32, pub dummy: u32, pub fh: u64, }
    /// `fuse_setattr_in`.
    pub struct SetattrIn {
        pub valid: u32, pub padding: u32, pub fh: u64, pub size: u64, pub lock_owner: u64,
        pub atime: u64, pub mtime: u64, pub ctime: u64, pub atimensec: u32, pub mtimensec: u32,
        pub ctimensec: u32, pub mode: u32, pub unused4: u32, pub uid: u32, pub gid: u32,
        pub unused5: u32,
    }
    /// `fuse_mknod_in`.
    pub struct MknodIn { pub mode: u32, pub rdev: u32, pub umask: u32, pub padding: u32, }
    /// `fuse_mkdir_in`.
    pub struct MkdirIn { pub mode: u32, pub umask: u32, }
    /// `fuse_rename_in`.
    pub struct RenameIn { pub newdir: u64, }
    /// `fuse_rename2_in`.
    pub struct Rename2In { pub newdir: u64, pub flags: u32, pub padding: u32, }
    /// `fuse_link_in`.
    pub struct LinkIn { pub oldnodeid: u64, }
    /// `fuse_open_in`.
    pub struct OpenIn { pub flags: u32, pub open_flags: u32, }
    /// `fuse_open_out`.
    pub struct OpenOut { pub fh: u64, pub open_flags: u32, pub backing_id: i32, }
    /// `fuse_create_in`.
    pub struct CreateIn { pub flags: u32, pub mode: u32, pub umask: u32, pub open_flags: u32, }
    /// `fuse_read_in` (also `readdir`, `readdirplus`).
    pub struct ReadIn {
        pub fh: u64, pub offset: u64, pub size: u32, pub read_flags: u32, pub lock_owner: u64,
        pub flags: u32, pub padding: u32,
    }
    /// `fuse_write_in`.
    pub struct WriteIn {
        pub fh: u64, pub offset: u64, pub size: u32, pub write_flags: u32, pub lock_owner: u64,
        pub flags: u32, pub padding: u32,
    }
    /// `fuse_write_out`.
    pub struct WriteOut { pub size: u32, pub padding: u32, }
    /// `fuse_kstatfs` (`fuse_statfs_out`).
    pub struct StatfsOut {
        pub blocks: u64, pub bfree: u64, pub bavail: u64, pub files: u64, pub ffree: u64,
        pub bsize: u32, pub namelen: u32, pub frsize: u32, pub padding: u32, pub spare: [u32; 6],
    }
    /// `fuse_release_in` (also `releasedir`).
    pub struct ReleaseIn { pub fh: u64, pub flags: u32, pub release_flags: u32, pub lock_owner: u64, }
    /// `fuse_flush_in`.
    pub struct FlushIn { pub fh: u64, pub unused: u32, pub padding: u32, pub lock_owner: u64, }
    /// `fuse_fsync_in` (also `fsyncdir`).
    pub struct FsyncIn { pub fh: u64, pub fsync_flags: u32, pub padding: u32, }
    /// `fuse_setxattr_in` without `FUSE_SETXATTR_EXT` (not negotiated).
    pub struct SetxattrIn { pub size: u32, pub flags: u32, }
    /// `fuse_getxattr_in` (also `listxattr`).
    pub struct GetxattrIn { pub size: u32, pub padding: u32, }
    /// `fuse_getxattr_out`.
    pub struct GetxattrOut { pub size: u32, pub padding: u32, }
    /// `fuse_access_in`.
    pub struct AccessIn { pub mask: u32, pub padding: u32, }
    /// `fuse_forget_in`.
    pub struct ForgetIn { pub nlookup: u64, }
    /// `fuse_batch_forget_in`.
    pub struct BatchForgetIn { pub count: u32, pub dummy: u32, }
    /// `fuse_forget_one`.
    pub struct ForgetOne { pub nodeid: u64, pub nlookup: u64, }
    /// `fuse_interrupt_in`.
    pub struct InterruptIn { pub unique: u64, }
    /// `fuse_fallocate_in`.
    pub struct FallocateIn { pub fh: u64, pub offset: u64, pub length: u64, pub mode: u32, pub padding: u32, }
    /// `fuse_dirent` without its name.
    pub struct Dirent { pub ino: u64, pub off: u64, pub namelen: u32, pub typ: u32, }
    /// `fuse_notify_inval_inode_out`.
    pub struct NotifyInvalInode { pub ino: u64, pub off: i64, pub len: i64, }
    /// `fuse_notify_inval_entry_out` (the name follows).
    pub struct NotifyInvalEntry { pub parent: u64, pub namelen: u32, pub flags: u32, }
    /// `fuse_notify_delete_out` (the name follows).
    pub struct NotifyDelete { pub parent: u64, pub child: u64, pub namelen: u32, pub padding: u32, }
    /// `fuse_backing_map` (`FUSE_DEV_IOC_BACKING_OPEN`).
    pub struct BackingMap { pub fd: i32, pub flags: u32, pub padding: u64, }
    /// `fuse_uring_ent_in_out`: the third part of a ring entry's header.
    pub struct UringEntInOut { pub flags: u64, pub commit_id: u64, pub payload_sz: u32, pub padding: u32, pub reserved: u64, }
    /// `fuse_uring_cmd_req`: the command of a ring SQE (its 80-byte `cmd` area).
    pub struct UringCmdReq { pub flags: u64, pub commit_id: u64, pub qid: u16, pub padding: [u8; 6], }
}

/// `FUSE_KERNEL_VERSION`.
pub const KERNEL_VERSION: u32 = 7;
/// The newest minor version whose structures this module knows.
pub const KERNEL_MINOR: u32 = 45;

/// Opcodes (`enum fuse_opcode`).
pub mod op {
    #![allow(missing_docs)]
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
}

/// `INIT` flags (`flags | flags2 << 32`).
pub mod init {
    #![allow(missing_docs)]
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const ATOMIC_O_TRUNC: u64 = 1 << 3;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const READDIRPLUS_AUTO: u64 = 1 << 14;
    pub const WRITEBACK_CACHE: u64 = 1 << 16;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const NO_OPENDIR_SUPPORT: u64 = 1 << 24;
    pub const HANDLE_KILLPRIV_V2: u64 = 1 << 28;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const PASSTHROUGH: u64 = 1 << 37;
    pub const OVER_IO_URING: u64 = 1 << 41;
}

/// `FOPEN_*` flags of an open reply.
pub mod fopen {
    #![allow(missing_docs)]
    pub const DIRECT_IO: u32 = 1 << 0;
    pub const KEEP_CACHE: u32 = 1 << 1;
    pub const CACHE_DIR: u32 = 1 << 3;
    pub const NOFLUSH: u32 = 1 << 5;
    pub const PASSTHROUGH: u32 = 1 << 7;
}

/// `FATTR_*` bits of `fuse_setattr_in.valid`.
pub mod fattr {
    #![allow(missing_docs)]
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const FH: u32 = 1 << 6;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
}

/// `FUSE_WRITE_KILL_SUIDGID`.
pub const WRITE_KILL_SUIDGID: u32 = 1 << 2;
/// `FUSE_FSYNC_FDATASYNC`.
pub const FSYNC_FDATASYNC: u32 = 1 << 0;
/// `RENAME_NOREPLACE`, `RENAME_EXCHANGE`, `RENAME_WHITEOUT`.
pub const RENAME_NOREPLACE: u32 = 1 << 0;
/// See [`RENAME_NOREPLACE`].
pub const RENAME_EXCHANGE: u32 = 1 << 1;
/// See [`RENAME_NOREPLACE`].
pub const RENAME_WHITEOUT: u32 = 1 << 2;
/// `FUSE_NOTIFY_INVAL_INODE`, `_INVAL_ENTRY`, `_DELETE` (sent as the error field).
pub const NOTIFY_INVAL_INODE: i32 = 2;
/// See [`NOTIFY_INVAL_INODE`].
pub const NOTIFY_INVAL_ENTRY: i32 = 3;
/// See [`NOTIFY_INVAL_INODE`].
pub const NOTIFY_DELETE: i32 = 6;

/// `FUSE_IO_URING_CMD_REGISTER`.
pub const URING_CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`.
pub const URING_CMD_COMMIT_AND_FETCH: u32 = 2;
/// A ring entry's header: `in_out[128]` (the in/out header), `op_in[128]` (the request's
/// fixed argument), then [`UringEntInOut`].
pub const URING_HEADER_SIZE: usize = 288;
/// Where `op_in` starts in a ring entry's header.
pub const URING_OP_IN: usize = 128;
/// Where [`UringEntInOut`] starts in a ring entry's header.
pub const URING_ENT_IN_OUT: usize = 256;

/// `_IOR(229, 0, uint32_t)`.
pub const DEV_IOC_CLONE: u64 = 0x8004_e500;
/// `_IOW(229, 1, struct fuse_backing_map)`.
pub const DEV_IOC_BACKING_OPEN: u64 = 0x4010_e501;
/// `_IOW(229, 2, uint32_t)`.
pub const DEV_IOC_BACKING_CLOSE: u64 = 0x4004_e502;

/// The size of the fixed argument that comes first in a request of `opcode` (over io_uring
/// it arrives in `op_in`, the rest in the payload; over `/dev/fuse` both follow the header).
/// Zero for requests whose arguments are only names or nothing.
pub fn op_in_size(opcode: u32) -> usize {
    use std::mem::size_of;
    match opcode {
        op::GETATTR => size_of::<GetattrIn>(),
        op::SETATTR => size_of::<SetattrIn>(),
        op::MKNOD => size_of::<MknodIn>(),
        op::MKDIR => size_of::<MkdirIn>(),
        op::RENAME => size_of::<RenameIn>(),
        op::RENAME2 => size_of::<Rename2In>(),
        op::LINK => size_of::<LinkIn>(),
        op::OPEN | op::OPENDIR => size_of::<OpenIn>(),
        op::CREATE => size_of::<CreateIn>(),
        op::READ | op::READDIR | op::READDIRPLUS => size_of::<ReadIn>(),
        op::WRITE => size_of::<WriteIn>(),
        op::RELEASE | op::RELEASEDIR => size_of::<ReleaseIn>(),
        op::FLUSH => size_of::<FlushIn>(),
        op::FSYNC | op::FSYNCDIR => size_of::<FsyncIn>(),
        op::SETXATTR => size_of::<SetxattrIn>(),
        op::GETXATTR | op::LISTXATTR => size_of::<GetxattrIn>(),
        op::ACCESS => size_of::<AccessIn>(),
        op::FORGET => size_of::<ForgetIn>(),
        op::BATCH_FORGET => size_of::<BatchForgetIn>(),
        op::INTERRUPT => size_of::<InterruptIn>(),
        op::FALLOCATE => size_of::<FallocateIn>(),
        op::INIT => size_of::<InitIn>(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn every_struct_has_the_kernel_headers_size() {
        // Sizes from include/uapi/linux/fuse.h (7.45) and the probe's notes.
        assert_eq!(size_of::<InHeader>(), 40);
        assert_eq!(size_of::<OutHeader>(), 16);
        assert_eq!(size_of::<InitIn>(), 64);
        assert_eq!(size_of::<InitOut>(), 64);
        assert_eq!(size_of::<Attr>(), 88);
        assert_eq!(size_of::<EntryOut>(), 128);
        assert_eq!(size_of::<AttrOut>(), 104);
        assert_eq!(size_of::<GetattrIn>(), 16);
        assert_eq!(size_of::<SetattrIn>(), 88);
        assert_eq!(size_of::<MknodIn>(), 16);
        assert_eq!(size_of::<MkdirIn>(), 8);
        assert_eq!(size_of::<Rename2In>(), 16);
        assert_eq!(size_of::<OpenOut>(), 16);
        assert_eq!(size_of::<CreateIn>(), 16);
        assert_eq!(size_of::<ReadIn>(), 40);
        assert_eq!(size_of::<WriteIn>(), 40);
        assert_eq!(size_of::<StatfsOut>(), 80);
        assert_eq!(size_of::<ReleaseIn>(), 24);
        assert_eq!(size_of::<FlushIn>(), 24);
        assert_eq!(size_of::<FsyncIn>(), 16);
        assert_eq!(size_of::<ForgetOne>(), 16);
        assert_eq!(size_of::<FallocateIn>(), 32);
        assert_eq!(size_of::<Dirent>(), 24);
        assert_eq!(size_of::<NotifyInvalInode>(), 24);
        assert_eq!(size_of::<NotifyInvalEntry>(), 16);
        assert_eq!(size_of::<NotifyDelete>(), 24);
        assert_eq!(size_of::<BackingMap>(), 16);
        assert_eq!(size_of::<UringEntInOut>(), 32);
        assert_eq!(size_of::<UringCmdReq>(), 24);
        assert_eq!(
            URING_ENT_IN_OUT + size_of::<UringEntInOut>(),
            URING_HEADER_SIZE
        );
    }

    #[test]
    fn fields_sit_at_the_kernel_headers_offsets() {
        assert_eq!(offset_of!(InHeader, unique), 8);
        assert_eq!(offset_of!(InHeader, nodeid), 16);
        assert_eq!(offset_of!(InHeader, uid), 24);
        assert_eq!(offset_of!(InHeader, pid), 32);
        assert_eq!(offset_of!(InitOut, max_background), 16);
        assert_eq!(offset_of!(InitOut, max_write), 20);
        assert_eq!(offset_of!(InitOut, max_pages), 28);
        assert_eq!(offset_of!(InitOut, flags2), 32);
        assert_eq!(offset_of!(InitOut, max_stack_depth), 36);
        assert_eq!(offset_of!(Attr, atimensec), 48);
        assert_eq!(offset_of!(Attr, mode), 60);
        assert_eq!(offset_of!(Attr, blksize), 80);
        assert_eq!(offset_of!(EntryOut, attr), 40);
        assert_eq!(offset_of!(AttrOut, attr), 16);
        assert_eq!(offset_of!(SetattrIn, atimensec), 56);
        assert_eq!(offset_of!(SetattrIn, mode), 68);
        assert_eq!(offset_of!(SetattrIn, uid), 76);
        assert_eq!(offset_of!(ReadIn, size), 16);
        assert_eq!(offset_of!(WriteIn, write_flags), 20);
        assert_eq!(offset_of!(OpenOut, backing_id), 12);
        assert_eq!(offset_of!(UringEntInOut, commit_id), 8);
        assert_eq!(offset_of!(UringEntInOut, payload_sz), 16);
        assert_eq!(offset_of!(UringCmdReq, qid), 16);
    }

    #[test]
    fn a_short_buffer_reads_as_none_never_a_panic() {
        assert_eq!(InHeader::read(&[0u8; 39]), None);
        let h = InHeader {
            len: 41,
            opcode: op::LOOKUP,
            unique: 7,
            nodeid: 1,
            ..Default::default()
        };
        assert_eq!(InHeader::read(h.bytes()), Some(h));
        // Unaligned input reads as well.
        let mut b = [0u8; 41];
        b[1..].copy_from_slice(h.bytes());
        assert_eq!(InHeader::read(&b[1..]), Some(h));
    }

    #[test]
    fn the_ioctl_numbers_encode_their_argument_sizes() {
        // _IOC(dir, 229, nr, size): dir in bits 30-31, size in 16-29.
        let ioc = |dir: u64, nr: u64, size: usize| dir << 30 | (size as u64) << 16 | 229 << 8 | nr;
        assert_eq!(DEV_IOC_CLONE, ioc(2, 0, 4));
        assert_eq!(DEV_IOC_BACKING_OPEN, ioc(1, 1, size_of::<BackingMap>()));
        assert_eq!(DEV_IOC_BACKING_CLOSE, ioc(1, 2, 4));
    }
}
