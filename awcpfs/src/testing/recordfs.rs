//! A recording filesystem for crash-point tests (in the manner of CrashMonkey and ALICE).
//!
//! [`Recorder::mount`] serves a directory through FUSE and passes every operation through
//! to it, recording each one that changes what a disk would hold — creations, writes,
//! truncations, renames, removals — and each durability barrier (`fsync`/`fdatasync` of a
//! file, `fsync` of a directory) in one ordered log ([`Op`]). Files are opened with
//! `FOPEN_DIRECT_IO`, so the kernel keeps no page cache of its own: every `write(2)` of the
//! program under test arrives here, in order, as it is made.
//!
//! [`crash_image`] then rebuilds, from a prefix of the log, a directory as a power loss at
//! that point could have left it: metadata changes (names and sizes set by truncation)
//! kept only where a sync made them durable (a directory's for its names, a file's for its
//! size) or where they fall before a random cut — the journal of a metadata-journaling
//! filesystem such as ext4 or XFS keeps them in order — and writes after a file's last
//! sync each kept or dropped (a dropped one leaves a hole of zeros under a later kept one:
//! the kernel writes pages back in any order) or torn; writes after a lost truncation of
//! their file are lost with it (they went to blocks allocated after it).
//!
//! Faults can be injected too ([`Recorder::fail_writes`]): writes to files of one name then
//! fail with an errno (a full disk for one file).

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;
use rand::Rng;

/// A file's identity in the log: each creation makes a new one (inode numbers of the
/// directory underneath are reused, these are not). The root is 0.
pub type Fid = u64;

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `name` created in directory `parent` (a file, a directory or a socket).
    Create {
        /// Directory.
        parent: Fid,
        /// Name.
        name: OsString,
        /// The new node.
        fid: Fid,
        /// A directory.
        dir: bool,
        /// A regular file (not a socket or other special node).
        file: bool,
    },
    /// `data` written at `offset`.
    Write {
        /// The file.
        fid: Fid,
        /// Where.
        offset: u64,
        /// What.
        data: Vec<u8>,
    },
    /// The file's size set.
    Truncate {
        /// The file.
        fid: Fid,
        /// New size.
        size: u64,
    },
    /// A rename (replacing whatever the new name named).
    Rename {
        /// Old directory.
        parent: Fid,
        /// Old name.
        name: OsString,
        /// New directory.
        newparent: Fid,
        /// New name.
        newname: OsString,
    },
    /// A name removed (`unlink` or `rmdir`).
    Remove {
        /// Directory.
        parent: Fid,
        /// Name.
        name: OsString,
    },
    /// `fsync`/`fdatasync` of a file: its data is durable.
    Fsync {
        /// The file.
        fid: Fid,
    },
    /// `fsync` of a directory: the changes of its entries are durable.
    FsyncDir {
        /// The directory.
        fid: Fid,
    },
}

struct Node {
    path: PathBuf,
    fid: Fid,
}

struct State {
    /// FUSE inode (the backing inode number; the root is 1) → node.
    nodes: HashMap<u64, Node>,
    next_fid: Fid,
    handles: HashMap<u64, Arc<File>>,
    next_fh: u64,
}

struct Shared {
    root: PathBuf,
    root_ino: u64,
    ops: Mutex<Vec<Op>>,
    state: Mutex<State>,
    fail: Mutex<Option<Fault>>,
}

/// Writes that fail.
struct Fault {
    name: OsString,
    containing: Vec<u8>,
    errno: i32,
}

struct RecordFs(Arc<Shared>);

/// A mounted recording filesystem; unmounted when dropped.
pub struct Recorder {
    shared: Arc<Shared>,
    mountpoint: PathBuf,
    session: Option<fuser::BackgroundSession>,
}

impl Recorder {
    /// Serve `backing` (an existing, empty directory) at `mountpoint`, recording.
    pub fn mount(backing: &Path, mountpoint: &Path) -> std::io::Result<Recorder> {
        let root_ino = std::fs::metadata(backing)?.ino();
        let mut nodes = HashMap::new();
        nodes.insert(
            1,
            Node {
                path: backing.to_path_buf(),
                fid: 0,
            },
        );
        let shared = Arc::new(Shared {
            root: backing.to_path_buf(),
            root_ino,
            ops: Mutex::new(Vec::new()),
            state: Mutex::new(State {
                nodes,
                next_fid: 1,
                handles: HashMap::new(),
                next_fh: 1,
            }),
            fail: Mutex::new(None),
        });
        let mut cfg = fuser::Config::default();
        cfg.mount_options = vec![
            fuser::MountOption::FSName("awcp-recordfs".into()),
            fuser::MountOption::Subtype("recordfs".into()),
        ];
        cfg.acl = fuser::SessionACL::All;
        cfg.n_threads = Some(2);
        let session = fuser::Session::new(RecordFs(shared.clone()), mountpoint, &cfg)
            .and_then(|s| s.spawn())?;
        Ok(Recorder {
            shared,
            mountpoint: mountpoint.to_path_buf(),
            session: Some(session),
        })
    }

    /// Operations recorded so far.
    pub fn len(&self) -> usize {
        self.shared.ops.lock().len()
    }

    /// Whether nothing was recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the log.
    pub fn ops(&self) -> Vec<Op> {
        self.shared.ops.lock().clone()
    }

    /// From now on, writes to files named `name` whose data contains `containing` (every
    /// write when empty) fail with `errno`; `None`: no more.
    pub fn fail_writes(&self, fault: Option<(&str, &str, i32)>) {
        *self.shared.fail.lock() = fault.map(|(name, containing, errno)| Fault {
            name: name.into(),
            containing: containing.as_bytes().to_vec(),
            errno,
        });
    }

    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        // Lazily: a killed process may still hold files open here.
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.mountpoint)
            .status();
        drop(self.session.take());
    }
}

const TTL: Duration = Duration::ZERO;

fn kind_of(m: &std::fs::Metadata) -> FileType {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        FileType::Directory
    } else if t.is_symlink() {
        FileType::Symlink
    } else if t.is_socket() {
        FileType::Socket
    } else if t.is_fifo() {
        FileType::NamedPipe
    } else {
        FileType::RegularFile
    }
}

fn time(s: i64, ns: i64) -> SystemTime {
    if s >= 0 {
        UNIX_EPOCH + Duration::new(s as u64, ns as u32)
    } else {
        UNIX_EPOCH
    }
}

fn io_err(e: std::io::Error) -> Errno {
    Errno::from(e)
}

impl Shared {
    fn ino_of(&self, m: &std::fs::Metadata) -> u64 {
        if m.ino() == self.root_ino { 1 } else { m.ino() }
    }

    fn attr(&self, m: &std::fs::Metadata) -> FileAttr {
        FileAttr {
            ino: INodeNo(self.ino_of(m)),
            size: m.size(),
            blocks: m.blocks(),
            atime: time(m.atime(), m.atime_nsec()),
            mtime: time(m.mtime(), m.mtime_nsec()),
            ctime: time(m.ctime(), m.ctime_nsec()),
            crtime: UNIX_EPOCH,
            kind: kind_of(m),
            perm: (m.mode() & 0o7777) as u16,
            nlink: m.nlink() as u32,
            uid: m.uid(),
            gid: m.gid(),
            rdev: m.rdev() as u32,
            blksize: 4096,
            flags: 0,
        }
    }

    fn path(&self, ino: INodeNo) -> Result<(PathBuf, Fid), Errno> {
        let st = self.state.lock();
        st.nodes
            .get(&ino.0)
            .map(|n| (n.path.clone(), n.fid))
            .ok_or(Errno::ESTALE)
    }

    /// Register the node at `path` (found by lookup, or just created: `created` gives it a
    /// new identity) and answer its attributes.
    fn enter(&self, path: PathBuf, created: bool) -> Result<(FileAttr, Fid), Errno> {
        let m = std::fs::symlink_metadata(&path).map_err(io_err)?;
        let ino = self.ino_of(&m);
        let mut st = self.state.lock();
        let known = st.nodes.get(&ino).filter(|n| n.path == path).map(|n| n.fid);
        let fid = match (created, known) {
            (false, Some(fid)) => fid,
            _ => {
                // New here (or the backing inode number was reused by a new file).
                let fid = st.next_fid;
                st.next_fid += 1;
                fid
            }
        };
        st.nodes.insert(ino, Node { path, fid });
        Ok((self.attr(&m), fid))
    }

    fn record(&self, op: Op) {
        self.ops.lock().push(op);
    }

    fn failing(&self, path: &Path, data: &[u8]) -> Option<i32> {
        let fail = self.fail.lock();
        let f = fail.as_ref()?;
        let contains = f.containing.is_empty()
            || data
                .windows(f.containing.len())
                .any(|w| w == f.containing.as_slice());
        (path.file_name() == Some(f.name.as_os_str()) && contains).then_some(f.errno)
    }

    fn handle(&self, fh: FileHandle) -> Result<Arc<File>, Errno> {
        self.state
            .lock()
            .handles
            .get(&fh.0)
            .cloned()
            .ok_or(Errno::EBADF)
    }

    fn open_handle(&self, path: &Path) -> Result<u64, Errno> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io_err)?;
        let mut st = self.state.lock();
        let fh = st.next_fh;
        st.next_fh += 1;
        st.handles.insert(fh, Arc::new(f));
        Ok(fh)
    }

    /// A name was renamed: every node at or below the old path moves with it.
    fn moved(&self, from: &Path, to: &Path) {
        let mut st = self.state.lock();
        for n in st.nodes.values_mut() {
            if let Ok(rest) = n.path.strip_prefix(from) {
                n.path = if rest.as_os_str().is_empty() {
                    to.to_path_buf()
                } else {
                    to.join(rest)
                };
            }
        }
    }
}

impl Filesystem for RecordFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = self
            .0
            .path(parent)
            .and_then(|(p, _)| self.0.enter(p.join(name), false));
        match r {
            Ok((attr, _)) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self
            .0
            .path(ino)
            .and_then(|(p, _)| std::fs::symlink_metadata(p).map_err(io_err))
        {
            Ok(m) => reply.attr(&TTL, &self.0.attr(&m)),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let r = (|| {
            let (path, fid) = self.0.path(ino)?;
            if let Some(mode) = mode {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & 0o7777))
                    .map_err(io_err)?;
            }
            if let Some(size) = size {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(io_err)?;
                // Recorded under the lock that orders the log, then done.
                let mut ops = self.0.ops.lock();
                f.set_len(size).map_err(io_err)?;
                ops.push(Op::Truncate { fid, size });
            }
            std::fs::symlink_metadata(&path).map_err(io_err)
        })();
        match r {
            Ok(m) => reply.attr(&TTL, &self.0.attr(&m)),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let r = (|| {
            let (dir, pfid) = self.0.path(parent)?;
            let path = dir.join(name);
            let kind = nix::sys::stat::SFlag::from_bits_truncate(mode & libc::S_IFMT);
            let perm = nix::sys::stat::Mode::from_bits_truncate(mode & !umask & 0o7777);
            nix::sys::stat::mknod(&path, kind, perm, u64::from(rdev))
                .map_err(|e| Errno::from_i32(e as i32))?;
            let (attr, fid) = self.0.enter(path, true)?;
            self.0.record(Op::Create {
                parent: pfid,
                name: name.to_owned(),
                fid,
                dir: false,
                file: mode & libc::S_IFMT == libc::S_IFREG,
            });
            Ok(attr)
        })();
        match r {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let r = (|| {
            let (dir, pfid) = self.0.path(parent)?;
            let path = dir.join(name);
            std::fs::DirBuilder::new()
                .mode(mode & !umask & 0o7777)
                .create(&path)
                .map_err(io_err)?;
            let (attr, fid) = self.0.enter(path, true)?;
            self.0.record(Op::Create {
                parent: pfid,
                name: name.to_owned(),
                fid,
                dir: true,
                file: false,
            });
            Ok(attr)
        })();
        match r {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let (dir, pfid) = self.0.path(parent)?;
            std::fs::remove_file(dir.join(name)).map_err(io_err)?;
            self.0.record(Op::Remove {
                parent: pfid,
                name: name.to_owned(),
            });
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            let (dir, pfid) = self.0.path(parent)?;
            std::fs::remove_dir(dir.join(name)).map_err(io_err)?;
            self.0.record(Op::Remove {
                parent: pfid,
                name: name.to_owned(),
            });
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
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
        let r = (|| {
            if flags.contains(RenameFlags::RENAME_EXCHANGE) {
                return Err(Errno::EINVAL);
            }
            let (dir, pfid) = self.0.path(parent)?;
            let (newdir, npfid) = self.0.path(newparent)?;
            let (from, to) = (dir.join(name), newdir.join(newname));
            if flags.contains(RenameFlags::RENAME_NOREPLACE)
                && std::fs::symlink_metadata(&to).is_ok()
            {
                return Err(Errno::EEXIST);
            }
            std::fs::rename(&from, &to).map_err(io_err)?;
            self.0.moved(&from, &to);
            self.0.record(Op::Rename {
                parent: pfid,
                name: name.to_owned(),
                newparent: npfid,
                newname: newname.to_owned(),
            });
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let r = (|| {
            let (path, fid) = self.0.path(ino)?;
            let fh = self.0.open_handle(&path)?;
            if flags.0 & libc::O_TRUNC != 0 {
                let f = self.0.handle(FileHandle(fh))?;
                let mut ops = self.0.ops.lock();
                f.set_len(0).map_err(io_err)?;
                ops.push(Op::Truncate { fid, size: 0 });
            }
            Ok(fh)
        })();
        match r {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let r = (|| {
            let (dir, pfid) = self.0.path(parent)?;
            let path = dir.join(name);
            let existed = std::fs::symlink_metadata(&path).is_ok();
            if existed && flags & libc::O_EXCL != 0 {
                return Err(Errno::EEXIST);
            }
            if !existed {
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(mode & !umask & 0o7777)
                    .open(&path)
                    .map_err(io_err)?;
            }
            let (attr, fid) = self.0.enter(path.clone(), !existed)?;
            if !existed {
                self.0.record(Op::Create {
                    parent: pfid,
                    name: name.to_owned(),
                    fid,
                    dir: false,
                    file: true,
                });
            }
            let fh = self.0.open_handle(&path)?;
            if existed && flags & libc::O_TRUNC != 0 {
                let f = self.0.handle(FileHandle(fh))?;
                let mut ops = self.0.ops.lock();
                f.set_len(0).map_err(io_err)?;
                ops.push(Op::Truncate { fid, size: 0 });
            }
            Ok((attr, fh))
        })();
        match r {
            Ok((attr, fh)) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(fh),
                FopenFlags::FOPEN_DIRECT_IO,
            ),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let r = (|| {
            let f = self.0.handle(fh)?;
            let mut buf = vec![0u8; size as usize];
            let mut got = 0;
            while got < buf.len() {
                match f.read_at(&mut buf[got..], offset + got as u64) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(e) => return Err(io_err(e)),
                }
            }
            buf.truncate(got);
            Ok(buf)
        })();
        match r {
            Ok(b) => reply.data(&b),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let r = (|| {
            let (path, fid) = self.0.path(ino)?;
            if let Some(errno) = self.0.failing(&path, data) {
                return Err(Errno::from_i32(errno));
            }
            let f = self.0.handle(fh)?;
            let mut ops = self.0.ops.lock();
            f.write_all_at(data, offset).map_err(io_err)?;
            ops.push(Op::Write {
                fid,
                offset,
                data: data.to_vec(),
            });
            Ok(data.len() as u32)
        })();
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
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
        self.0.state.lock().handles.remove(&fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.0.path(ino) {
            Ok((_, fid)) => {
                self.0.record(Op::Fsync { fid });
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.0.path(ino) {
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let r = (|| {
            let (dir, _) = self.0.path(ino)?;
            let mut entries = vec![
                (ino.0, FileType::Directory, OsString::from(".")),
                (1, FileType::Directory, OsString::from("..")),
            ];
            for e in std::fs::read_dir(&dir).map_err(io_err)?.flatten() {
                if let Ok(m) = e.metadata() {
                    entries.push((self.0.ino_of(&m), kind_of(&m), e.file_name()));
                }
            }
            Ok(entries)
        })();
        match r {
            Ok(entries) => {
                for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(*ino), (i + 1) as u64, *kind, name) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.0.path(ino) {
            Ok((_, fid)) => {
                self.0.record(Op::FsyncDir { fid });
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match nix::sys::statvfs::statvfs(&self.0.root) {
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
            Err(e) => reply.error(Errno::from_i32(e as i32)),
        }
    }
}

/// How a crash image keeps what was not made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// The process was killed: everything it did reached the kernel and is kept.
    Process,
    /// The power failed: only what a sync made durable is sure to be kept, the rest is
    /// kept, dropped or torn at random (as described in the module docs).
    Power,
}

/// A file or directory of a crash image.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Built {
    Dir(BTreeMap<OsString, Fid>),
    File(Vec<u8>),
    Other,
}

/// Write into `out` (an empty directory) the directory the first `at` operations of `ops`
/// leave after a crash of kind `loss`, with randomness from `rng`.
pub fn crash_image(
    ops: &[Op],
    at: usize,
    loss: Loss,
    rng: &mut impl Rng,
    out: &Path,
) -> std::io::Result<()> {
    let ops = &ops[..at];
    // The last sync of each file and each directory within the prefix.
    let mut synced: HashMap<Fid, usize> = HashMap::new();
    let mut dir_synced: HashMap<Fid, usize> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Fsync { fid } => {
                synced.insert(*fid, i);
            }
            Op::FsyncDir { fid } => {
                dir_synced.insert(*fid, i);
            }
            _ => {}
        }
    }
    // Namespace changes: kept before a random cut (an ordered journal), and wherever a
    // later sync of the directory they change made them durable.
    let cut = match loss {
        Loss::Process => at,
        Loss::Power => rng.random_range(0..=at),
    };
    let durable_in = |dir: Fid, i: usize| dir_synced.get(&dir).is_some_and(|s| *s > i);
    let mut nodes: HashMap<Fid, Built> = HashMap::new();
    nodes.insert(0, Built::Dir(BTreeMap::new()));
    let mut cut_off: std::collections::HashSet<Fid> = std::collections::HashSet::new();
    // Data, per file: each change kept when synced later, else at random.
    let keep_data = |fid: Fid, i: usize, rng: &mut dyn rand::RngCore| {
        loss == Loss::Process || synced.get(&fid).is_some_and(|s| *s > i) || rng.random_bool(0.5)
    };
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Create {
                parent,
                name,
                fid,
                dir,
                file,
            } => {
                nodes.insert(
                    *fid,
                    if *dir {
                        Built::Dir(BTreeMap::new())
                    } else if *file {
                        Built::File(Vec::new())
                    } else {
                        Built::Other
                    },
                );
                if (i < cut || durable_in(*parent, i))
                    && let Some(Built::Dir(entries)) = nodes.get_mut(parent)
                {
                    entries.insert(name.clone(), *fid);
                }
            }
            Op::Rename {
                parent,
                name,
                newparent,
                newname,
            } => {
                if i < cut || durable_in(*newparent, i) || durable_in(*parent, i) {
                    let moved = match nodes.get_mut(parent) {
                        Some(Built::Dir(entries)) => entries.remove(name),
                        _ => None,
                    };
                    if let (Some(fid), Some(Built::Dir(entries))) =
                        (moved, nodes.get_mut(newparent))
                    {
                        entries.insert(newname.clone(), fid);
                    }
                }
            }
            Op::Remove { parent, name } => {
                if (i < cut || durable_in(*parent, i))
                    && let Some(Built::Dir(entries)) = nodes.get_mut(parent)
                {
                    entries.remove(name);
                }
            }
            Op::Write { fid, offset, data } => {
                if cut_off.contains(fid) || !keep_data(*fid, i, rng) {
                    continue;
                }
                let mut data = &data[..];
                if loss == Loss::Power
                    && synced.get(fid).is_none_or(|s| *s <= i)
                    && data.len() > 1
                    && rng.random_bool(0.2)
                {
                    // Torn: only the first part reached the disk.
                    data = &data[..rng.random_range(1..data.len())];
                }
                if let Some(Built::File(content)) = nodes.get_mut(fid) {
                    let end = *offset as usize + data.len();
                    if content.len() < end {
                        content.resize(end, 0);
                    }
                    content[*offset as usize..end].copy_from_slice(data);
                }
            }
            Op::Truncate { fid, size } => {
                // A size change is metadata: journaled in order with the namespace.
                if i < cut || synced.get(fid).is_some_and(|s| *s > i) {
                    if let Some(Built::File(content)) = nodes.get_mut(fid) {
                        content.resize(*size as usize, 0);
                    }
                } else {
                    // Writes after a lost truncation are lost with it: they went to blocks
                    // allocated after it, in metadata journaled after it.
                    cut_off.insert(*fid);
                }
            }
            Op::Fsync { .. } | Op::FsyncDir { .. } => {}
        }
    }
    write_tree(&nodes, 0, out)
}

fn write_tree(nodes: &HashMap<Fid, Built>, dir: Fid, out: &Path) -> std::io::Result<()> {
    let Some(Built::Dir(entries)) = nodes.get(&dir) else {
        return Ok(());
    };
    for (name, fid) in entries {
        let path = out.join(name);
        match nodes.get(fid) {
            Some(Built::Dir(_)) => {
                std::fs::create_dir(&path)?;
                write_tree(nodes, *fid, &path)?;
            }
            Some(Built::File(content)) => std::fs::write(&path, content)?,
            // Sockets are not state.
            _ => {}
        }
    }
    Ok(())
}

/// The names in `path` relative to the recorder's root, for messages: `fid` → path.
pub fn describe(ops: &[Op], fid: Fid) -> String {
    let mut names: HashMap<Fid, (Fid, OsString)> = HashMap::new();
    for op in ops {
        match op {
            Op::Create {
                parent, name, fid, ..
            } => {
                names.insert(*fid, (*parent, name.clone()));
            }
            Op::Rename {
                parent,
                name,
                newparent,
                newname,
            } => {
                if let Some(f) = names
                    .iter()
                    .find(|(_, (p, n))| p == parent && n == name)
                    .map(|(f, _)| *f)
                {
                    names.insert(f, (*newparent, newname.clone()));
                }
            }
            _ => {}
        }
    }
    let mut parts = Vec::new();
    let mut at = fid;
    while let Some((p, n)) = names.get(&at) {
        parts.push(String::from_utf8_lossy(n.as_bytes()).into_owned());
        at = *p;
    }
    parts.reverse();
    parts.join("/")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn image(ops: &[Op], loss: Loss, seed: u64) -> BTreeMap<String, Vec<u8>> {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        crash_image(ops, ops.len(), loss, &mut rng, dir.path()).unwrap();
        std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn a_crash_image_keeps_what_was_synced_and_loses_only_what_was_not() {
        let create = |name: &str, fid| Op::Create {
            parent: 0,
            name: name.into(),
            fid,
            dir: false,
            file: true,
        };
        let write = |fid, offset, data: &[u8]| Op::Write {
            fid,
            offset,
            data: data.to_vec(),
        };
        let ops = vec![
            create("a", 1),
            write(1, 0, b"synced"),
            Op::Fsync { fid: 1 },
            Op::FsyncDir { fid: 0 },
            write(1, 6, b" later"),
            create("b", 2),
            write(2, 0, b"never synced"),
            Op::Rename {
                parent: 0,
                name: "b".into(),
                newparent: 0,
                newname: "c".into(),
            },
        ];
        // A killed process loses nothing.
        let all = image(&ops, Loss::Process, 0);
        assert_eq!(all.get("a").map(Vec::as_slice), Some(&b"synced later"[..]));
        assert_eq!(all.get("c").map(Vec::as_slice), Some(&b"never synced"[..]));
        assert!(!all.contains_key("b"));
        // A power loss keeps the synced part always, and loses the rest in every way.
        let (mut lost_later, mut kept_later, mut no_b_or_c, mut torn) = (0, 0, 0, 0);
        for seed in 0..200 {
            let img = image(&ops, Loss::Power, seed);
            let a = img.get("a").expect("a synced file and name are kept");
            assert!(a.starts_with(b"synced"), "{a:?}");
            match a.as_slice() {
                b"synced" => lost_later += 1,
                b"synced later" => kept_later += 1,
                _ => torn += 1,
            }
            assert!(!(img.contains_key("b") && img.contains_key("c")));
            if !img.contains_key("b") && !img.contains_key("c") {
                no_b_or_c += 1;
            }
        }
        assert!(lost_later > 0 && kept_later > 0 && torn > 0 && no_b_or_c > 0);
    }
}
