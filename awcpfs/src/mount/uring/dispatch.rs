//! One request in, one call into [`AwcpFs`], one reply out: the io_uring adapter's
//! counterpart of `fuse.rs`, over decoded wire structs instead of fuser's callbacks. The
//! transport (a ring entry or a `/dev/fuse` read) only moves the bytes.

use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use awcp_protocol::rawname;
use fuser::{FileAttr, FileType};

use super::abi::{self, Wire, fattr, fopen, init, op};
use crate::mount::backing::BackingTable;
use crate::mount::changes::InFlight;
use crate::mount::content::{OpenMode, SetAttr};
use crate::mount::fs::{AwcpFs, kind_to_fuse};
use crate::mount::posix::{Caller, XattrReply};
use crate::mount::{FsError, KernelOptions};

/// A request as the transport delivered it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// Its header.
    pub header: abi::InHeader,
    /// Its fixed argument (`op_in` over io_uring), possibly longer than the struct.
    pub arg: &'a [u8],
    /// What follows it: names, written data.
    pub data: &'a [u8],
}

/// What to answer.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// Success, the body is in the output buffer.
    Ok,
    /// This errno (positive).
    Err(i32),
    /// No answer: `FORGET`, `BATCH_FORGET`.
    None,
}

/// A reply, and the change it answers (held until the reply is sent: git's fsmonitor tokens
/// stay before the change until the caller sees it done, as in `fuse.rs`).
pub struct Handled<'a> {
    /// The reply.
    pub reply: Reply,
    /// The change in flight, if the request changes the workspace.
    pub change: Option<InFlight<'a>>,
}

impl std::fmt::Debug for Handled<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handled")
            .field("reply", &self.reply)
            .finish_non_exhaustive()
    }
}

/// A file registered with the kernel for passthrough (`FUSE_DEV_IOC_BACKING_OPEN`), closed
/// again when dropped.
#[derive(Debug)]
struct Backing {
    dev: Arc<OwnedFd>,
    id: u32,
}

#[allow(unsafe_code)]
impl Backing {
    fn open(dev: &Arc<OwnedFd>, file: &std::fs::File) -> std::io::Result<Backing> {
        let map = abi::BackingMap {
            fd: file.as_raw_fd(),
            ..Default::default()
        };
        // SAFETY: the ioctl reads one `fuse_backing_map` from the pointer, which is valid
        // for the call; both descriptors are open.
        let r = unsafe {
            libc::ioctl(
                dev.as_raw_fd(),
                abi::DEV_IOC_BACKING_OPEN as libc::c_ulong,
                &map as *const abi::BackingMap,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Backing {
            dev: dev.clone(),
            id: r as u32,
        })
    }
}

#[allow(unsafe_code)]
impl Drop for Backing {
    fn drop(&mut self) {
        // SAFETY: the ioctl reads one u32 from the pointer, valid for the call.
        let r = unsafe {
            libc::ioctl(
                self.dev.as_raw_fd(),
                abi::DEV_IOC_BACKING_CLOSE as libc::c_ulong,
                &self.id as *const u32,
            )
        };
        if r < 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "closing a passthrough backing id failed");
        }
    }
}

/// What `INIT` settled.
#[derive(Debug, Clone, Copy)]
pub struct Negotiated {
    /// The flags both sides agreed on.
    pub flags: u64,
    /// The largest write the kernel will send (and so the ring payload's floor).
    pub max_write: u32,
    /// Pages per request.
    pub max_pages: u16,
}

/// Largest write asked for: 256 pages, the kernel's default `max_pages` limit.
pub const MAX_WRITE: u32 = 1 << 20;

/// The adapter.
#[derive(Debug)]
pub struct Adapter {
    fs: Arc<AwcpFs>,
    ttl: Duration,
    opts: KernelOptions,
    no_open: bool,
    want_writeback: bool,
    no_opendir: AtomicBool,
    dev: Arc<OwnedFd>,
    /// Passthrough's backing files (`init` turns it on when the kernel accepts it).
    backing: BackingTable<Backing>,
}

/// A name from a request: up to its NUL, which must be there.
fn name(data: &[u8]) -> Result<(&OsStr, &[u8]), i32> {
    let end = data.iter().position(|c| *c == 0).ok_or(libc::EIO)?;
    Ok((OsStr::from_bytes(&data[..end]), &data[end + 1..]))
}

fn arg<T: Wire>(req: &Request<'_>) -> Result<T, i32> {
    T::read(req.arg).ok_or(libc::EIO)
}

fn split_time(t: SystemTime) -> (u64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs(), d.subsec_nanos()),
        // Before 1970: the kernel takes the seconds as signed.
        Err(e) => {
            let d = e.duration();
            let (mut s, mut ns) = (-(d.as_secs() as i64), d.subsec_nanos());
            if ns > 0 {
                s -= 1;
                ns = 1_000_000_000 - ns;
            }
            (s as u64, ns)
        }
    }
}

fn type_bits(kind: FileType) -> u32 {
    match kind {
        FileType::NamedPipe => libc::S_IFIFO,
        FileType::CharDevice => libc::S_IFCHR,
        FileType::BlockDevice => libc::S_IFBLK,
        FileType::Directory => libc::S_IFDIR,
        FileType::RegularFile => libc::S_IFREG,
        FileType::Symlink => libc::S_IFLNK,
        FileType::Socket => libc::S_IFSOCK,
    }
}

/// `fuse_attr` of `a`.
pub fn wire_attr(a: &FileAttr) -> abi::Attr {
    let (atime, atimensec) = split_time(a.atime);
    let (mtime, mtimensec) = split_time(a.mtime);
    let (ctime, ctimensec) = split_time(a.ctime);
    abi::Attr {
        ino: a.ino.0,
        size: a.size,
        blocks: a.blocks,
        atime,
        mtime,
        ctime,
        atimensec,
        mtimensec,
        ctimensec,
        mode: type_bits(a.kind) | u32::from(a.perm),
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: a.blksize,
        flags: 0,
    }
}

fn entry(ttl: Duration, a: &FileAttr) -> abi::EntryOut {
    abi::EntryOut {
        nodeid: a.ino.0,
        generation: 0,
        entry_valid: ttl.as_secs(),
        attr_valid: ttl.as_secs(),
        entry_valid_nsec: ttl.subsec_nanos(),
        attr_valid_nsec: ttl.subsec_nanos(),
        attr: wire_attr(a),
    }
}

/// Append one `fuse_dirent` (and, for readdirplus, its `fuse_entry_out` first) unless it
/// would pass `max`; false when it did not fit.
fn push_dirent(
    out: &mut Vec<u8>,
    max: usize,
    plus: Option<&abi::EntryOut>,
    ino: u64,
    off: u64,
    kind: FileType,
    name: &[u8],
) -> bool {
    let head = plus.map_or(0, |_| std::mem::size_of::<abi::EntryOut>());
    let len = head + (std::mem::size_of::<abi::Dirent>() + name.len()).next_multiple_of(8);
    if out.len() + len > max {
        return false;
    }
    let start = out.len();
    if let Some(e) = plus {
        out.extend_from_slice(e.bytes());
    }
    let d = abi::Dirent {
        ino,
        off,
        namelen: name.len() as u32,
        typ: type_bits(kind) >> 12,
    };
    out.extend_from_slice(d.bytes());
    out.extend_from_slice(name);
    out.resize(start + len, 0);
    true
}

fn errno(e: &FsError) -> i32 {
    let code = e.errno().code();
    if code != libc::ENOENT {
        tracing::debug!(error = %e, "fuse op failed");
    }
    code
}

impl Adapter {
    /// Wrap the filesystem; `dev` is the connection's `/dev/fuse` descriptor (for
    /// passthrough's backing ids).
    pub fn new(fs: Arc<AwcpFs>, opts: KernelOptions, dev: Arc<OwnedFd>) -> Adapter {
        Adapter {
            fs,
            ttl: opts.ttl,
            opts,
            no_open: opts.no_open && !opts.passthrough,
            want_writeback: opts.writeback_cache && !opts.passthrough,
            no_opendir: AtomicBool::new(false),
            dev,
            backing: BackingTable::new(),
        }
    }

    /// Answer the kernel's `INIT`: what `fuse.rs` asks of fuser, plus FUSE over io_uring
    /// when `uring` (and the kernel offers it).
    pub fn init(&self, kernel: &abi::InitIn, uring: bool) -> (abi::InitOut, Negotiated) {
        let mut offered = u64::from(kernel.flags);
        if offered & init::INIT_EXT != 0 {
            offered |= u64::from(kernel.flags2) << 32;
        }
        let mut want = init::ASYNC_READ
            | init::BIG_WRITES
            | init::MAX_PAGES
            | init::INIT_EXT
            | init::DO_READDIRPLUS
            | init::READDIRPLUS_AUTO
            | init::PARALLEL_DIROPS
            | init::CACHE_SYMLINKS
            | init::HANDLE_KILLPRIV_V2;
        // O_TRUNC passed to open, except with no-open (see fuse.rs).
        if !self.no_open {
            want |= init::ATOMIC_O_TRUNC;
        }
        if self.want_writeback {
            want |= init::WRITEBACK_CACHE;
        }
        let passthrough_writes = self.opts.passthrough_writes_apply();
        if self.opts.passthrough || passthrough_writes {
            want |= init::PASSTHROUGH;
        }
        if uring {
            want |= init::OVER_IO_URING;
        }
        let flags = want & offered;
        if self.opts.no_opendir && offered & init::NO_OPENDIR_SUPPORT != 0 {
            self.no_opendir.store(true, Ordering::Relaxed);
        }
        if self.want_writeback {
            if flags & init::WRITEBACK_CACHE != 0 {
                self.fs.set_writeback_cache();
            } else {
                tracing::info!(
                    "the kernel lacks the FUSE writeback cache: every write is a round trip"
                );
            }
        }
        if self.no_open {
            self.fs.set_no_open();
        }
        let passthrough =
            (self.opts.passthrough || passthrough_writes) && flags & init::PASSTHROUGH != 0;
        self.backing.set_enabled(passthrough);
        if (self.opts.passthrough || passthrough_writes) && !passthrough {
            tracing::info!("the kernel lacks FUSE passthrough; serving reads and writes ourselves");
        }
        if passthrough && passthrough_writes {
            self.fs.set_passthrough_creates(true);
        }
        let max_pages = (MAX_WRITE / 4096) as u16;
        let out = abi::InitOut {
            major: abi::KERNEL_VERSION,
            minor: kernel.minor.min(abi::KERNEL_MINOR),
            max_readahead: kernel.max_readahead,
            flags: flags as u32,
            max_background: 64,
            congestion_threshold: 48,
            max_write: MAX_WRITE,
            time_gran: 1,
            max_pages,
            flags2: (flags >> 32) as u32,
            // Depth 2: the state directory may itself be on a stacked fs (overlayfs).
            max_stack_depth: if passthrough { 2 } else { 0 },
            ..Default::default()
        };
        let negotiated = Negotiated {
            flags,
            max_write: MAX_WRITE,
            max_pages,
        };
        (out, negotiated)
    }

    /// Whether answering `req` can wait on something slow (the export, the disk's flush):
    /// those go to the worker pool, so the ring's thread keeps answering the rest.
    pub fn may_block(&self, req: &Request<'_>) -> bool {
        match req.header.opcode {
            // Content not here yet is fetched first; a local file is a `pread`/`pwrite`.
            op::READ | op::WRITE => !self.fs.content_is_local(req.header.nodeid),
            // A truncation of a remote file fetches it first.
            op::SETATTR => abi::SetattrIn::read(req.arg).is_none_or(|s| s.valid & fattr::SIZE != 0),
            op::OPEN | op::FLUSH | op::RELEASE | op::FSYNC | op::FSYNCDIR | op::FALLOCATE => true,
            _ => false,
        }
    }

    /// Answer `req`, its body (if any) written to `out` (cleared first).
    pub fn handle<'a>(&'a self, req: &Request<'_>, out: &mut Vec<u8>) -> Handled<'a> {
        out.clear();
        let mut change = None;
        let reply = match self.dispatch(req, out, &mut change) {
            Ok(r) => r,
            Err(e) => {
                out.clear();
                Reply::Err(e)
            }
        };
        Handled { reply, change }
    }

    fn ttl_of(&self, ino: u64) -> Duration {
        if crate::mount::aecp::MountAecp::is_virtual(ino) {
            Duration::ZERO
        } else {
            self.ttl
        }
    }

    /// The timeout of an entry: zero for `.aecp/` and while an access to it would deliver
    /// an AECP finding (the next `stat` or `open` must reach the mount), as in `fuse.rs`.
    fn entry_ttl(&self, ino: u64) -> Duration {
        if self.fs.aecp().pending_at(&self.fs.table, ino) {
            Duration::ZERO
        } else {
            self.ttl_of(ino)
        }
    }

    /// Count a request of operation `name` and time it until the returned timer drops
    /// (the end of its arm in `Adapter::dispatch`).
    fn count(&self, name: &str) -> crate::mount::stats::OpTimer<'_> {
        self.fs.stats().count_op(name)
    }

    fn put_entry(&self, out: &mut Vec<u8>, r: Result<FileAttr, FsError>) -> Result<Reply, i32> {
        let a = r.map_err(|e| errno(&e))?;
        out.extend_from_slice(entry(self.ttl, &a).bytes());
        Ok(Reply::Ok)
    }

    fn put_attr(&self, out: &mut Vec<u8>, ttl: Duration, a: &FileAttr) -> Reply {
        let o = abi::AttrOut {
            attr_valid: ttl.as_secs(),
            attr_valid_nsec: ttl.subsec_nanos(),
            dummy: 0,
            attr: wire_attr(a),
        };
        out.extend_from_slice(o.bytes());
        Reply::Ok
    }

    fn put_open(out: &mut Vec<u8>, fh: u64, flags: u32, backing_id: i32) -> Reply {
        let o = abi::OpenOut {
            fh,
            open_flags: flags,
            backing_id,
        };
        out.extend_from_slice(o.bytes());
        Reply::Ok
    }

    fn unit(r: Result<(), FsError>) -> Result<Reply, i32> {
        r.map(|()| Reply::Ok).map_err(|e| errno(&e))
    }

    fn caller(req: &Request<'_>) -> Caller {
        Caller {
            uid: req.header.uid,
            gid: req.header.gid,
        }
    }

    fn dispatch<'a>(
        &'a self,
        req: &Request<'_>,
        out: &mut Vec<u8>,
        change: &mut Option<InFlight<'a>>,
    ) -> Result<Reply, i32> {
        let h = &req.header;
        let fs = &*self.fs;
        let ino = h.nodeid;
        match h.opcode {
            op::LOOKUP => {
                let _op = self.count("lookup");
                crate::mount::aecp::set_requester(h.pid);
                let (n, _) = name(req.data)?;
                match fs.lookup(ino, n) {
                    Ok(a) => {
                        out.extend_from_slice(entry(self.entry_ttl(a.ino.0), &a).bytes());
                        Ok(Reply::Ok)
                    }
                    // A negative entry, cached by the kernel for the entry TTL.
                    Err(FsError::NotFound) => {
                        let e = abi::EntryOut {
                            entry_valid: self.ttl.as_secs(),
                            entry_valid_nsec: self.ttl.subsec_nanos(),
                            ..Default::default()
                        };
                        out.extend_from_slice(e.bytes());
                        Ok(Reply::Ok)
                    }
                    Err(e) => Err(errno(&e)),
                }
            }
            op::FORGET => {
                fs.forget(ino);
                Ok(Reply::None)
            }
            op::BATCH_FORGET => {
                let b: abi::BatchForgetIn = arg(req)?;
                for one in req.data.chunks_exact(16).take(b.count as usize) {
                    if let Some(f) = abi::ForgetOne::read(one) {
                        fs.forget(f.nodeid);
                    }
                }
                Ok(Reply::None)
            }
            op::GETATTR => {
                let _op = self.count("getattr");
                let a = fs.getattr(ino).map_err(|e| errno(&e))?;
                Ok(self.put_attr(out, self.ttl_of(ino), &a))
            }
            op::SETATTR => {
                let _op = self.count("setattr");
                let s: abi::SetattrIn = arg(req)?;
                *change = Some(fs.changes().begin());
                let time = |now: u32, bit: u32, secs: u64, nsec: u32| {
                    if s.valid & now != 0 {
                        Some(SystemTime::now())
                    } else if s.valid & bit != 0 {
                        let secs = secs as i64;
                        Some(if secs >= 0 {
                            UNIX_EPOCH + Duration::new(secs as u64, nsec)
                        } else {
                            UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
                                + Duration::from_nanos(u64::from(nsec))
                        })
                    } else {
                        None
                    }
                };
                let set = SetAttr {
                    mode: (s.valid & fattr::MODE != 0).then_some(s.mode),
                    uid: (s.valid & fattr::UID != 0).then_some(s.uid),
                    gid: (s.valid & fattr::GID != 0).then_some(s.gid),
                    size: (s.valid & fattr::SIZE != 0).then_some(s.size),
                    atime: time(fattr::ATIME_NOW, fattr::ATIME, s.atime, s.atimensec),
                    mtime: time(fattr::MTIME_NOW, fattr::MTIME, s.mtime, s.mtimensec),
                    fh: (s.valid & fattr::FH != 0).then_some(s.fh),
                    caller: Some(Self::caller(req)),
                };
                let a = fs.setattr(ino, set).map_err(|e| errno(&e))?;
                Ok(self.put_attr(out, self.ttl, &a))
            }
            op::READLINK => {
                let _op = self.count("readlink");
                let t = fs.readlink(ino).map_err(|e| errno(&e))?;
                out.extend_from_slice(&rawname::to_bytes(&t));
                Ok(Reply::Ok)
            }
            op::MKNOD => {
                let _op = self.count("mknod");
                let m: abi::MknodIn = arg(req)?;
                let (n, _) = name(req.data)?;
                *change = Some(fs.changes().begin());
                let r = fs.mknod_as(Self::caller(req), ino, n, m.mode & !m.umask, m.rdev);
                self.put_entry(out, r)
            }
            op::MKDIR => {
                let _op = self.count("mkdir");
                let m: abi::MkdirIn = arg(req)?;
                let (n, _) = name(req.data)?;
                *change = Some(fs.changes().begin());
                let r = fs.mkdir_as(Self::caller(req), ino, n, m.mode & !m.umask);
                self.put_entry(out, r)
            }
            op::UNLINK => {
                let _op = self.count("unlink");
                let (n, _) = name(req.data)?;
                *change = Some(fs.changes().begin());
                Self::unit(fs.unlink(ino, n))
            }
            op::RMDIR => {
                let _op = self.count("rmdir");
                let (n, _) = name(req.data)?;
                *change = Some(fs.changes().begin());
                Self::unit(fs.rmdir(ino, n))
            }
            op::SYMLINK => {
                let _op = self.count("symlink");
                let (n, rest) = name(req.data)?;
                let (target, _) = name(rest)?;
                *change = Some(fs.changes().begin());
                let r = fs.symlink_as(Self::caller(req), ino, n, target);
                self.put_entry(out, r)
            }
            op::RENAME | op::RENAME2 => {
                let _op = self.count("rename");
                let (newdir, flags) = if h.opcode == op::RENAME {
                    (arg::<abi::RenameIn>(req)?.newdir, 0)
                } else {
                    let r: abi::Rename2In = arg(req)?;
                    (r.newdir, r.flags)
                };
                let (old, rest) = name(req.data)?;
                let (new, _) = name(rest)?;
                *change = Some(fs.changes().begin());
                // RENAME_WHITEOUT would need a whiteout device node (see fuse.rs).
                if flags & abi::RENAME_WHITEOUT != 0 {
                    return Err(libc::EINVAL);
                }
                Self::unit(fs.rename(
                    ino,
                    old,
                    newdir,
                    new,
                    flags & abi::RENAME_NOREPLACE != 0,
                    flags & abi::RENAME_EXCHANGE != 0,
                ))
            }
            op::LINK => {
                let _op = self.count("link");
                let l: abi::LinkIn = arg(req)?;
                let (n, _) = name(req.data)?;
                *change = Some(fs.changes().begin());
                let r = fs.link(l.oldnodeid, ino, n);
                self.put_entry(out, r)
            }
            op::OPEN => self.open(req, out, change),
            op::READ => {
                let _op = self.count("read");
                let r: abi::ReadIn = arg(req)?;
                let data = self
                    .fs
                    .read_at(ino, r.fh, r.offset, r.size)
                    .map_err(|e| errno(&e))?;
                out.extend_from_slice(&data);
                Ok(Reply::Ok)
            }
            op::WRITE => {
                let _op = self.count("write");
                let w: abi::WriteIn = arg(req)?;
                let data = req.data.get(..w.size as usize).ok_or(libc::EIO)?;
                *change = Some(fs.changes().begin());
                if w.write_flags & abi::WRITE_KILL_SUIDGID != 0 {
                    fs.drop_suidgid(ino);
                }
                let n = fs
                    .write_at(ino, w.fh, w.offset, data)
                    .map_err(|e| errno(&e))?;
                out.extend_from_slice(
                    abi::WriteOut {
                        size: n,
                        padding: 0,
                    }
                    .bytes(),
                );
                Ok(Reply::Ok)
            }
            op::FLUSH => {
                let _op = self.count("flush");
                let f: abi::FlushIn = arg(req)?;
                match fs.flush_at(f.fh) {
                    // With no-open, ENOSYS stops further flushes (see fuse.rs).
                    Ok(()) if self.no_open => Err(libc::ENOSYS),
                    r => Self::unit(r),
                }
            }
            op::RELEASE => {
                let _op = self.count("release");
                let r: abi::ReleaseIn = arg(req)?;
                if r.fh == 0 && self.no_open {
                    return Ok(Reply::Ok);
                }
                let result = fs.release(r.fh);
                self.backing.release(r.fh);
                Self::unit(result)
            }
            op::FSYNC => {
                let _op = self.count("fsync");
                let f: abi::FsyncIn = arg(req)?;
                Self::unit(fs.fsync_at(ino, f.fh, f.fsync_flags & abi::FSYNC_FDATASYNC != 0))
            }
            op::OPENDIR => {
                let _op = self.count("opendir");
                if self.no_opendir.load(Ordering::Relaxed) {
                    return Err(libc::ENOSYS);
                }
                let fh = fs.opendir(ino).map_err(|e| errno(&e))?;
                Ok(Self::put_open(
                    out,
                    fh,
                    fopen::CACHE_DIR | fopen::KEEP_CACHE,
                    0,
                ))
            }
            op::READDIR | op::READDIRPLUS => {
                let plus = h.opcode == op::READDIRPLUS;
                let _op = self.count(if plus { "readdirplus" } else { "readdir" });
                crate::mount::aecp::set_requester(h.pid);
                fs.aecp().listed(ino);
                let r: abi::ReadIn = arg(req)?;
                let (entries, generation, start) = if r.fh == 0 {
                    fs.listing_at(ino, r.offset)
                } else {
                    fs.readdir(r.fh).map(|e| (e, 0, r.offset as usize))
                }
                .map_err(|e| errno(&e))?;
                let max = r.size as usize;
                for (i, e) in entries.iter().enumerate().skip(start) {
                    let off = generation << 32 | (i + 1) as u64;
                    let name = rawname::to_bytes(&e.name);
                    let fitted = if plus {
                        let Ok(a) = fs.getattr(e.ino) else { continue };
                        // An entry with a finding pending is not cached: the worker's
                        // first `stat` or `open` of it must reach the observer.
                        let eo = entry(self.entry_ttl(e.ino), &a);
                        push_dirent(out, max, Some(&eo), e.ino, off, a.kind, &name)
                    } else {
                        push_dirent(out, max, None, e.ino, off, kind_to_fuse(e.kind), &name)
                    };
                    if !fitted {
                        break;
                    }
                }
                Ok(Reply::Ok)
            }
            op::RELEASEDIR => {
                let _op = self.count("releasedir");
                let r: abi::ReleaseIn = arg(req)?;
                fs.releasedir(r.fh);
                Ok(Reply::Ok)
            }
            op::FSYNCDIR => {
                let _op = self.count("fsyncdir");
                Self::unit(fs.fsyncdir())
            }
            op::STATFS => {
                let _op = self.count("statfs");
                let s = fs.statfs().map_err(|e| errno(&e))?;
                let o = abi::StatfsOut {
                    blocks: s.blocks(),
                    bfree: s.blocks_free(),
                    bavail: s.blocks_available(),
                    files: s.files(),
                    ffree: s.files_free(),
                    bsize: s.block_size() as u32,
                    namelen: 255,
                    frsize: s.fragment_size() as u32,
                    ..Default::default()
                };
                out.extend_from_slice(o.bytes());
                Ok(Reply::Ok)
            }
            op::ACCESS => {
                let _op = self.count("access");
                let a: abi::AccessIn = arg(req)?;
                Self::unit(fs.access(ino, a.mask & libc::W_OK as u32 != 0))
            }
            op::CREATE => {
                let _op = self.count("create");
                let c: abi::CreateIn = arg(req)?;
                let (n, _) = name(req.data)?;
                *change = Some(fs.changes().begin());
                let (a, fh) = fs
                    .create_as(Self::caller(req), ino, n, c.mode & !c.umask, c.flags as i32)
                    .map_err(|e| errno(&e))?;
                out.extend_from_slice(entry(self.ttl, &a).bytes());
                if fh == 0 && fs.passes_writes_of(req.header.pid) {
                    // Passthrough of a created file (see fuse.rs).
                    let id = fs
                        .upper_for_backing(a.ino.0)
                        .and_then(|f| Backing::open(&self.dev, &f));
                    if let Some(id) = crate::mount::fuse::pass_through(&self.fs, a.ino.0, id) {
                        let raw = id.id as i32;
                        fs.hold_backing(a.ino.0, Box::new(id));
                        return Ok(Self::put_open(
                            out,
                            0,
                            fopen::PASSTHROUGH | fopen::NOFLUSH,
                            raw,
                        ));
                    }
                }
                Ok(Self::put_open(out, fh, fopen::KEEP_CACHE, 0))
            }
            op::GETXATTR | op::LISTXATTR => {
                let list = h.opcode == op::LISTXATTR;
                let _op = self.count(if list { "listxattr" } else { "getxattr" });
                let g: abi::GetxattrIn = arg(req)?;
                let r = if list {
                    fs.listxattr(ino, g.size)
                } else {
                    fs.getxattr(ino, name(req.data)?.0, g.size)
                };
                match r.map_err(|e| errno(&e))? {
                    XattrReply::Size(n) => out.extend_from_slice(
                        abi::GetxattrOut {
                            size: n,
                            padding: 0,
                        }
                        .bytes(),
                    ),
                    XattrReply::Data(d) => out.extend_from_slice(&d),
                }
                Ok(Reply::Ok)
            }
            op::SETXATTR => {
                let _op = self.count("setxattr");
                let s: abi::SetxattrIn = arg(req)?;
                let (n, rest) = name(req.data)?;
                let value = rest.get(..s.size as usize).ok_or(libc::EIO)?;
                Self::unit(fs.setxattr(ino, n, value, s.flags as i32))
            }
            op::REMOVEXATTR => {
                let _op = self.count("removexattr");
                let (n, _) = name(req.data)?;
                Self::unit(fs.removexattr(ino, n))
            }
            op::FALLOCATE => {
                let _op = self.count("fallocate");
                let f: abi::FallocateIn = arg(req)?;
                *change = Some(fs.changes().begin());
                fs.fallocate(ino, f.fh, f.offset, f.length, f.mode as i32)
                    .map(|_| Reply::Ok)
                    .map_err(|e| errno(&e))
            }
            // Requests finish without waiting on anything an interrupt could cut short; the
            // kernel stops sending them once told ENOSYS (as fuser answers).
            op::INTERRUPT => Err(libc::ENOSYS),
            op::DESTROY => Ok(Reply::Ok),
            // A second INIT is a protocol error.
            op::INIT => Err(libc::EIO),
            _ => Err(libc::ENOSYS),
        }
    }

    fn open<'a>(
        &'a self,
        req: &Request<'_>,
        out: &mut Vec<u8>,
        change: &mut Option<InFlight<'a>>,
    ) -> Result<Reply, i32> {
        let _op = self.count("open");
        let fs = &*self.fs;
        let ino = req.header.nodeid;
        let o: abi::OpenIn = arg(req)?;
        let mode = OpenMode::from_flags(o.flags as i32);
        *change = Some(fs.changes().begin());
        if let Some(r) = fs.aecp().open(ino, mode.write) {
            let fh = r.map_err(|e| errno(&e))?;
            return Ok(Self::put_open(out, fh, fopen::DIRECT_IO, 0));
        }
        if self.no_open {
            // "Open files yourself from now on" (see fuse.rs).
            fs.check().map_err(|e| errno(&e))?;
            return Err(libc::ENOSYS);
        }
        let fh = fs.open(ino, mode).map_err(|e| errno(&e))?;
        if !mode.write
            && let Some(id) = self
                .backing
                .backing_for(&self.fs, ino, fh, |f| Backing::open(&self.dev, f))
        {
            return Ok(Self::put_open(out, fh, fopen::PASSTHROUGH, id.id as i32));
        }
        let noflush = if mode.write { 0 } else { fopen::NOFLUSH };
        Ok(Self::put_open(out, fh, fopen::KEEP_CACHE | noflush, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dirent_is_padded_to_eight_bytes_and_refused_past_the_limit() {
        let mut out = Vec::new();
        assert!(push_dirent(
            &mut out,
            64,
            None,
            5,
            1,
            FileType::Directory,
            b"abc"
        ));
        assert_eq!(out.len(), 32);
        let d = abi::Dirent::read(&out).unwrap();
        assert_eq!((d.ino, d.off, d.namelen, d.typ), (5, 1, 3, 4));
        assert_eq!(&out[24..27], b"abc");
        // 32 more would pass 60.
        assert!(!push_dirent(
            &mut out,
            60,
            None,
            6,
            2,
            FileType::RegularFile,
            b"x"
        ));
        assert_eq!(out.len(), 32);
    }

    #[test]
    fn a_name_without_its_nul_is_a_protocol_error() {
        assert_eq!(name(b"abc").unwrap_err(), libc::EIO);
        let (n, rest) = name(b"a\0b\0").unwrap();
        assert_eq!((n.as_bytes(), rest), (&b"a"[..], &b"b\0"[..]));
    }

    #[test]
    fn times_before_1970_keep_their_sign() {
        let t = UNIX_EPOCH - Duration::from_millis(1500);
        let (s, ns) = split_time(t);
        assert_eq!((s as i64, ns), (-2, 500_000_000));
        assert_eq!(split_time(UNIX_EPOCH + Duration::new(3, 7)), (3, 7));
    }
}
