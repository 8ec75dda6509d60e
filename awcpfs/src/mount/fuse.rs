//! The `fuser::Filesystem` adapter: one span, one call into [`AwcpFs`], one reply.
//!
//! Nothing here is worth a unit test: all logic is in `fs.rs` and `content.rs`, and the
//! errno of every failure comes from [`FsError::errno`](super::error::FsError::errno).

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use awcp_protocol::rawname;

use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use super::backing::BackingTable;
use super::content::{OpenMode, SetAttr};
use super::fs::{AwcpFs, kind_to_fuse};
use super::posix::XattrReply;

/// How the adapter talks to the kernel.
#[derive(Debug, Clone, Copy)]
pub struct KernelOptions {
    /// How long the kernel may cache entries (positive and negative) and attributes. The
    /// mount's namespace changes only through the kernel itself during a lease (changes on
    /// the Delegator's side are not shown to a running mount), so long is safe.
    pub ttl: Duration,
    /// Hand files opened read-only to the kernel with FUSE passthrough where it supports it.
    /// Off by default: the kernel then reads the local copy without asking the filesystem,
    /// so a revocation cannot stop reads on files that were opened before it.
    pub passthrough: bool,
    /// Hand the files some processes create (`MountConfig::passthrough_writers`: compilers,
    /// assemblers and linkers by default) to the kernel with FUSE passthrough, where the
    /// kernel supports it and files are opened without asking (`no_open`): the new file's
    /// writes then go to its upper file without a request (a linker's thousands of small
    /// `write`s, a compiler's object files), and the mount learns of them from inotify
    /// (`mount/bypass.rs`). While such a file is open, the kernel refuses every other open
    /// of it (`EIO`), hence the short list of processes. Ignored with `passthrough` or
    /// `writeback_cache` (the kernel accepts passthrough only without the writeback cache).
    pub passthrough_writes: bool,
    /// Let the kernel open directories without a round trip (it then keeps their listings,
    /// and `opendir`/`releasedir` never reach the filesystem) where it supports that.
    pub no_opendir: bool,
    /// Let the kernel open existing files without a round trip (no-open): `open`,
    /// `flush` and `release` of such files never reach the filesystem, reads and writes
    /// come with handle 0, pages stay cached across opens. A file written that way is
    /// written back once no write touched it for
    /// [`WRITE_QUIET`](super::fs::WRITE_QUIET), not at its last `close` (which the
    /// filesystem is not told about; the kernel then sends no `release` even for files
    /// made with `create`, so those get handle 0 too). Ignored with `passthrough`, which
    /// needs an `open` to hand the file over.
    pub no_open: bool,
    /// Let the kernel keep written data in its page cache and write it to the filesystem
    /// in batches (`FUSE_WRITEBACK_CACHE`), keeping sizes and times itself meanwhile: a
    /// `write` no longer costs a round trip, nor do the attribute refreshes and
    /// `security.capability` lookups that follow one. `close` and `fsync` still write the
    /// file's dirty pages to the filesystem before they return; a Delegator-side change
    /// makes the kernel forget the inode; the end of the lease writes dirty pages back
    /// (`syncfs`, within the flush grace) before the mount is fenced, and the mount has the
    /// kernel write back every [`KERNEL_WRITEBACK_EVERY`](super::session::KERNEL_WRITEBACK_EVERY)
    /// meanwhile. The cost: the kernel marks a file's block count stale at every `close`
    /// under the cache, so the next `stat` of a file closed since is a round trip. Off by
    /// default (chosen by the agent-session replay, docs/BENCHMARKS.md); ignored with
    /// `passthrough`.
    pub writeback_cache: bool,
    /// The transport requests come over (`--fuse-transport`): io_uring where the kernel
    /// offers it (`auto`), or one of the two by name.
    pub transport: super::uring::FuseTransport,
}

impl KernelOptions {
    /// Whether created files are handed over with passthrough (see
    /// [`KernelOptions::passthrough_writes`]): asked for, with no-open, without the options
    /// that exclude it.
    pub fn passthrough_writes_apply(&self) -> bool {
        self.passthrough_writes && self.no_open && !self.passthrough && !self.writeback_cache
    }
}

impl Default for KernelOptions {
    fn default() -> Self {
        KernelOptions {
            ttl: Duration::from_secs(3600),
            passthrough: false,
            passthrough_writes: true,
            no_opendir: true,
            no_open: true,
            writeback_cache: false,
            transport: super::uring::FuseTransport::Auto,
        }
    }
}

/// The adapter.
#[derive(Debug)]
pub struct FuseAdapter {
    fs: Arc<AwcpFs>,
    ttl: Duration,
    want_passthrough: bool,
    /// Passthrough's backing files (`init` turns it on when the kernel accepts it).
    backing: BackingTable<BackingId>,
    want_no_opendir: bool,
    /// Set in `init` when the kernel opens directories without asking once told `ENOSYS`.
    no_opendir: AtomicBool,
    /// Files are opened without asking once the kernel is told `ENOSYS` (see
    /// [`KernelOptions::no_open`]).
    no_open: bool,
    /// Ask for the kernel's writeback cache (see [`KernelOptions::writeback_cache`]).
    want_writeback: bool,
    /// Ask for passthrough of created files (see [`KernelOptions::passthrough_writes`]).
    want_passthrough_writes: bool,
}

impl FuseAdapter {
    /// Wrap the filesystem.
    pub fn new(fs: Arc<AwcpFs>, opts: KernelOptions) -> Self {
        FuseAdapter {
            fs,
            ttl: opts.ttl,
            want_passthrough: opts.passthrough,
            backing: BackingTable::new(),
            want_no_opendir: opts.no_opendir,
            no_opendir: AtomicBool::new(false),
            no_open: opts.no_open && !opts.passthrough,
            want_writeback: opts.writeback_cache && !opts.passthrough,
            want_passthrough_writes: opts.passthrough_writes_apply(),
        }
    }

    /// The listing a readdir at `offset` continues: the one `opendir` took for handle `fh`
    /// (generation 0, offsets are indexes), or, when the kernel opened the directory
    /// without asking (handle 0), the directory's own (see `AwcpFs::listing_at`).
    fn listing(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
    ) -> Result<(Arc<Vec<crate::mount::fs::DirEntry>>, u64, usize), crate::mount::FsError> {
        if fh == 0 {
            self.fs.listing_at(ino, offset)
        } else {
            self.fs.readdir(fh).map(|e| (e, 0, offset as usize))
        }
    }

    /// The kernel's cache time for `ino`: none for AECP's virtual files, whose content
    /// changes without a write.
    /// The timeout of an entry: zero for `.aecp/` and while an access to it would deliver
    /// an AECP finding (the next `stat` or `open` must reach the mount).
    fn entry_ttl(&self, ino: u64) -> Duration {
        if self.fs.aecp().pending_at(&self.fs.table, ino) {
            Duration::ZERO
        } else {
            Self::ttl_of(self.ttl, ino)
        }
    }

    fn ttl_of(ttl: Duration, ino: u64) -> Duration {
        if crate::mount::aecp::MountAecp::is_virtual(ino) {
            Duration::ZERO
        } else {
            ttl
        }
    }

    /// A negative entry: `lookup` of a missing name answered with inode 0 is cached by the
    /// kernel for the entry TTL (git probes many names that do not exist).
    fn negative_attr() -> FileAttr {
        FileAttr {
            ino: INodeNo(0),
            size: 0,
            blocks: 0,
            atime: SystemTime::UNIX_EPOCH,
            mtime: SystemTime::UNIX_EPOCH,
            ctime: SystemTime::UNIX_EPOCH,
            crtime: SystemTime::UNIX_EPOCH,
            kind: FileType::RegularFile,
            perm: 0,
            nlink: 0,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

/// Who sent a request: new nodes belong to it, and chown and truncate clear set-user-ID
/// and set-group-ID by its rights (see `posix.rs`).
fn caller(req: &Request) -> super::posix::Caller {
    super::posix::Caller {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

macro_rules! reply_err {
    ($reply:expr, $op:literal, $e:expr) => {{
        let e = $e;
        let errno = e.errno();
        if errno != Errno::ENOENT {
            tracing::debug!(op = $op, error = %e, "fuse op failed");
        }
        $reply.error(errno)
    }};
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // O_TRUNC passed to open: without it the kernel opens (fetching the whole file)
        // and then truncates, and `echo x > f` fails if the Delegator changed `f`. Not with
        // no-open, where the kernel would take an unanswered open as done truncating: it
        // then truncates with `setattr`, and opening fetches nothing anyway.
        if !self.no_open
            && config
                .add_capabilities(InitFlags::FUSE_ATOMIC_O_TRUNC)
                .is_err()
        {
            tracing::debug!("kernel lacks atomic O_TRUNC: O_TRUNC opens fetch first");
        }
        for (flag, why) in [
            // Listing a directory returns attributes too: no lookup per entry.
            (
                InitFlags::FUSE_DO_READDIRPLUS,
                "listings need a lookup per entry",
            ),
            (InitFlags::FUSE_READDIRPLUS_AUTO, "readdirplus always on"),
            // Lookups in one directory run in parallel.
            (
                InitFlags::FUSE_PARALLEL_DIROPS,
                "directory operations are serialised",
            ),
            (
                InitFlags::FUSE_CACHE_SYMLINKS,
                "symlinks are read on every traversal",
            ),
            // We clear set-user-ID/set-group-ID on writes ourselves, so the kernel marks the
            // filesystem SB_NOSEC: a write no longer asks for `security.capability` first
            // (a `getxattr` round trip per `write`).
            (
                InitFlags::FUSE_HANDLE_KILLPRIV_V2,
                "every write asks for security.capability first",
            ),
        ] {
            if config.add_capabilities(flag).is_err() {
                tracing::debug!(?flag, "kernel lacks this FUSE feature: {why}");
            }
        }
        // Not FUSE_AUTO_INVAL_DATA: every change to a file's content is made through this
        // kernel, except the Delegator's, for which `inval_inode` is sent once the new
        // content is in place (a read already under way holds its page locked, so the
        // invalidation waits for it and drops what it read). With it, the kernel would drop
        // a file's pages after each of our own writes (its mtime moved), and a linker reading
        // back the objects a compiler just wrote would read them all through the mount.
        if self.want_no_opendir
            && config
                .capabilities()
                .contains(InitFlags::FUSE_NO_OPENDIR_SUPPORT)
        {
            self.no_opendir.store(true, Ordering::Relaxed);
        }
        if self.want_writeback {
            // Writes land in the kernel's page cache and reach us in batches when it writes
            // them back (at the latest at `close`/`fsync`, and at the end of the lease: see
            // `Mount::end`). The kernel then trusts its own size and times of a regular file
            // over ours, so a Delegator-side change must make it forget the inode (see
            // `Mount::apply_upstream`).
            if config
                .add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE)
                .is_ok()
            {
                self.fs.set_writeback_cache();
            } else {
                tracing::info!(
                    "the kernel lacks the FUSE writeback cache: every write is a round trip"
                );
            }
        }
        if self.no_open {
            // From the start, not at the first `open`: a file created before it would
            // otherwise get a handle whose `release` the kernel never sends.
            self.fs.set_no_open();
        }
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        if self.want_passthrough || self.want_passthrough_writes {
            let ok = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                // Depth 2: the state directory may itself be on a stacked fs (overlayfs).
                && config.set_max_stack_depth(2).is_ok();
            self.backing.set_enabled(ok);
            if !ok {
                tracing::info!(
                    "the kernel lacks FUSE passthrough; serving reads and writes ourselves"
                );
            } else if self.want_passthrough_writes {
                self.fs.set_passthrough_creates(true);
            }
        }
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _op = self.fs.stats().count_op("lookup");
        crate::mount::aecp::set_requester(req.pid());
        match self.fs.lookup(parent.0, name) {
            Ok(attr) => reply.entry(&self.entry_ttl(attr.ino.0), &attr, Generation(0)),
            Err(crate::mount::FsError::NotFound) => {
                reply.entry(&self.ttl, &Self::negative_attr(), Generation(0))
            }
            Err(e) => reply_err!(reply, "lookup", e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _op = self.fs.stats().count_op("getattr");
        match self.fs.getattr(ino.0) {
            Ok(attr) => reply.attr(&Self::ttl_of(self.ttl, ino.0), &attr),
            Err(e) => reply_err!(reply, "getattr", e),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _op = self.fs.stats().count_op("setattr");
        // Until the reply is sent: git's fsmonitor tokens stay before this change.
        let _change = self.fs.changes().begin();
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(time),
            mtime: mtime.map(time),
            fh: fh.map(|f| f.0),
            caller: Some(caller(req)),
        };
        match self.fs.setattr(ino.0, set) {
            Ok(attr) => reply.attr(&self.ttl, &attr),
            Err(e) => reply_err!(reply, "setattr", e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let _op = self.fs.stats().count_op("readlink");
        match self.fs.readlink(ino.0) {
            Ok(t) => reply.data(&rawname::to_bytes(&t)),
            Err(e) => reply_err!(reply, "readlink", e),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _op = self.fs.stats().count_op("mknod");
        let _change = self.fs.changes().begin();
        match self
            .fs
            .mknod_as(caller(req), parent.0, name, mode & !umask, rdev)
        {
            Ok(attr) => reply.entry(&self.ttl, &attr, Generation(0)),
            Err(e) => reply_err!(reply, "mknod", e),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _op = self.fs.stats().count_op("mkdir");
        let _change = self.fs.changes().begin();
        match self.fs.mkdir_as(caller(req), parent.0, name, mode & !umask) {
            Ok(attr) => reply.entry(&self.ttl, &attr, Generation(0)),
            Err(e) => reply_err!(reply, "mkdir", e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _op = self.fs.stats().count_op("unlink");
        let _change = self.fs.changes().begin();
        match self.fs.unlink(parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "unlink", e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _op = self.fs.stats().count_op("rmdir");
        let _change = self.fs.changes().begin();
        match self.fs.rmdir(parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "rmdir", e),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let _op = self.fs.stats().count_op("symlink");
        let _change = self.fs.changes().begin();
        match self
            .fs
            .symlink_as(caller(req), parent.0, link_name, target.as_os_str())
        {
            Ok(attr) => reply.entry(&self.ttl, &attr, Generation(0)),
            Err(e) => reply_err!(reply, "symlink", e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _op = self.fs.stats().count_op("rename");
        let _change = self.fs.changes().begin();
        // RENAME_WHITEOUT (overlayfs on top of the mount) would need a whiteout device node,
        // which awcpfs cannot store: refuse it as filesystems without support do, instead of
        // renaming without the whiteout.
        if flags.contains(RenameFlags::RENAME_WHITEOUT) {
            return reply_err!(
                reply,
                "rename",
                super::error::FsError::Invalid {
                    what: "RENAME_WHITEOUT is not supported",
                }
            );
        }
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
        match self
            .fs
            .rename(parent.0, name, newparent.0, newname, noreplace, exchange)
        {
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "rename", e),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _op = self.fs.stats().count_op("link");
        let _change = self.fs.changes().begin();
        match self.fs.link(ino.0, newparent.0, newname) {
            Ok(attr) => reply.entry(&self.ttl, &attr, Generation(0)),
            Err(e) => reply_err!(reply, "link", e),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, _nlookup: u64) {
        self.fs.forget(ino.0);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _op = self.fs.stats().count_op("open");
        let _change = self.fs.changes().begin();
        if let Some(r) = self
            .fs
            .aecp()
            .open(ino.0, OpenMode::from_flags(flags.0).write)
        {
            return crate::mount::aecp::reply_open(r, reply);
        }
        if self.no_open {
            // "Open files yourself from now on": this open succeeds with handle 0, and no
            // further open, flush or release of an existing file is sent.
            if let Err(e) = self.fs.check() {
                return reply_err!(reply, "open", e);
            }
            return reply.error(Errno::ENOSYS);
        }
        let mode = OpenMode::from_flags(flags.0);
        match self.fs.open(ino.0, mode) {
            Ok(fh) => {
                // Passthrough for read-only opens only: the kernel does not keep the FUSE
                // inode's size in step with writes it passes through, so writers stay on the
                // ordinary path, where every write is seen.
                if !mode.write
                    && let Some(id) = self
                        .backing
                        .backing_for(&self.fs, ino.0, fh, |f| reply.open_backing(f))
                {
                    return reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
                }
                // Every change to the content goes through this kernel, so its page cache
                // stays valid across opens. (Passthrough cannot be combined with it.)
                // A descriptor that cannot write has nothing to flush at close: spare the
                // round trip.
                let noflush = if mode.write {
                    FopenFlags::empty()
                } else {
                    FopenFlags::FOPEN_NOFLUSH
                };
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE | noflush)
            }
            Err(e) => reply_err!(reply, "open", e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _op = self.fs.stats().count_op("read");
        match self.fs.read_at(ino.0, fh.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply_err!(reply, "read", e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _op = self.fs.stats().count_op("write");
        let _change = self.fs.changes().begin();
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            // We told the kernel we clear set-user-ID and set-group-ID on writes
            // (FUSE_HANDLE_KILLPRIV_V2).
            self.fs.drop_suidgid(ino.0);
        }
        match self.fs.write_at(ino.0, fh.0, offset, data) {
            Ok(n) => reply.written(n),
            Err(e) => reply_err!(reply, "write", e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let _op = self.fs.stats().count_op("flush");
        match self.fs.flush_at(fh.0) {
            // With no-open, writes are noted as they come: no `close` needs a round
            // trip, and `ENOSYS` tells the kernel to stop sending `flush`.
            Ok(()) if self.no_open => reply.error(Errno::ENOSYS),
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "flush", e),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _op = self.fs.stats().count_op("release");
        if fh.0 == 0 && self.no_open {
            // A file made with `create` under no-open has handle 0; the kernel sends its
            // `release` under the writeback cache. Nothing was opened for it.
            return reply.ok();
        }
        let result = self.fs.release(fh.0);
        // Closing the backing id after the inode's last passthrough release.
        self.backing.release(fh.0);
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "release", e),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _op = self.fs.stats().count_op("fsync");
        match self.fs.fsync_at(ino.0, fh.0, datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "fsync", e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _op = self.fs.stats().count_op("opendir");
        if self.no_opendir.load(Ordering::Relaxed) {
            // The kernel takes this as "open directories yourself from now on": the open
            // succeeds, no further opendir or releasedir is sent, and listings are cached
            // (FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE) — git opens every directory.
            return reply.error(Errno::ENOSYS);
        }
        match self.fs.opendir(ino.0) {
            // The kernel may keep the listing: every change to this directory goes through
            // it, and it drops the cached listing when the directory changes.
            Ok(fh) => reply.opened(
                FileHandle(fh),
                FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE,
            ),
            Err(e) => reply_err!(reply, "opendir", e),
        }
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _op = self.fs.stats().count_op("readdir");
        crate::mount::aecp::set_requester(req.pid());
        self.fs.aecp().listed(ino.0);
        match self.listing(ino.0, fh.0, offset) {
            Ok((entries, generation, start)) => {
                for (i, e) in entries.iter().enumerate().skip(start) {
                    if reply.add(
                        INodeNo(e.ino),
                        generation << 32 | (i + 1) as u64,
                        kind_to_fuse(e.kind),
                        rawname::to_os(&e.name),
                    ) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply_err!(reply, "readdir", e),
        }
    }

    fn readdirplus(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let _op = self.fs.stats().count_op("readdirplus");
        crate::mount::aecp::set_requester(req.pid());
        self.fs.aecp().listed(ino.0);
        match self.listing(ino.0, fh.0, offset) {
            Ok((entries, generation, start)) => {
                for (i, e) in entries.iter().enumerate().skip(start) {
                    let Ok(attr) = self.fs.getattr(e.ino) else {
                        continue;
                    };
                    // An entry with a finding pending is not cached: the worker's first
                    // `stat` or `open` of it must reach the observer (docs/AECP.md).
                    let ttl = self.entry_ttl(e.ino);
                    if reply.add(
                        INodeNo(e.ino),
                        generation << 32 | (i + 1) as u64,
                        rawname::to_os(&e.name),
                        &ttl,
                        &attr,
                        Generation(0),
                    ) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply_err!(reply, "readdirplus", e),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        let _op = self.fs.stats().count_op("releasedir");
        self.fs.releasedir(fh.0);
        reply.ok()
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _op = self.fs.stats().count_op("fsyncdir");
        match self.fs.fsyncdir() {
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "fsyncdir", e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _op = self.fs.stats().count_op("statfs");
        match self.fs.statfs() {
            Ok(s) => reply.statfs(
                s.blocks(),
                s.blocks_free(),
                s.blocks_available(),
                s.files(),
                s.files_free(),
                s.block_size() as u32,
                255,
                s.fragment_size() as u32,
            ),
            Err(e) => reply_err!(reply, "statfs", e),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let _op = self.fs.stats().count_op("access");
        match self.fs.access(ino.0, mask.contains(AccessFlags::W_OK)) {
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "access", e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _op = self.fs.stats().count_op("create");
        let _change = self.fs.changes().begin();
        match self
            .fs
            .create_as(caller(req), parent.0, name, mode & !umask, flags)
        {
            Ok((attr, 0)) if self.fs.passes_writes_of(req.pid()) => {
                // Passthrough of a toolchain's new file (see
                // `KernelOptions::passthrough_writes`).
                let ino = attr.ino.0;
                let id = self
                    .fs
                    .upper_for_backing(ino)
                    .and_then(|f| reply.open_backing(&f));
                match pass_through(&self.fs, ino, id) {
                    Some(id) => {
                        reply.created_passthrough(
                            &self.ttl,
                            &attr,
                            Generation(0),
                            FileHandle(0),
                            FopenFlags::FOPEN_NOFLUSH,
                            &id,
                        );
                        self.fs.hold_backing(ino, Box::new(id));
                    }
                    None => reply.created(
                        &self.ttl,
                        &attr,
                        Generation(0),
                        FileHandle(0),
                        FopenFlags::FOPEN_KEEP_CACHE,
                    ),
                }
            }
            Ok((attr, fh)) => reply.created(
                &self.ttl,
                &attr,
                Generation(0),
                FileHandle(fh),
                FopenFlags::FOPEN_KEEP_CACHE,
            ),
            Err(e) => reply_err!(reply, "create", e),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _op = self.fs.stats().count_op("getxattr");
        match self.fs.getxattr(ino.0, name, size) {
            Ok(XattrReply::Size(n)) => reply.size(n),
            Ok(XattrReply::Data(d)) => reply.data(&d),
            Err(e) => reply_err!(reply, "getxattr", e),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _op = self.fs.stats().count_op("listxattr");
        match self.fs.listxattr(ino.0, size) {
            Ok(XattrReply::Size(n)) => reply.size(n),
            Ok(XattrReply::Data(d)) => reply.data(&d),
            Err(e) => reply_err!(reply, "listxattr", e),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _op = self.fs.stats().count_op("setxattr");
        match self.fs.setxattr(ino.0, name, value, flags) {
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "setxattr", e),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _op = self.fs.stats().count_op("removexattr");
        match self.fs.removexattr(ino.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply_err!(reply, "removexattr", e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _op = self.fs.stats().count_op("fallocate");
        let _change = self.fs.changes().begin();
        match self.fs.fallocate(ino.0, fh.0, offset, length, mode) {
            Ok(_) => reply.ok(),
            Err(e) => reply_err!(reply, "fallocate", e),
        }
    }
}

/// Hand the created file `ino` to the kernel with its backing id `id` (the upper file
/// registered, or the error that refused it): `Some` once its upper file is watched for the
/// kernel's writes (`AwcpFs::pass_writes_through`). A refused registration turns passthrough
/// of created files off for the rest of the mount; a watch that cannot be added (inotify's
/// limit) leaves this one file to ordinary writes.
pub(super) fn pass_through<Id>(fs: &Arc<AwcpFs>, ino: u64, id: std::io::Result<Id>) -> Option<Id> {
    let id = match id {
        Ok(id) => id,
        Err(e) => {
            tracing::warn!(error = %e, "FUSE passthrough refused; the mount's requests carry created files' writes");
            fs.set_passthrough_creates(false);
            return None;
        }
    };
    match fs.pass_writes_through(ino) {
        Ok(()) => Some(id),
        Err(e) => {
            tracing::debug!(error = %e, "cannot watch a created file; its writes come as requests");
            None
        }
    }
}
