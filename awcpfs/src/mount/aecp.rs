//! AECP on the mount: the access observer, the read-only `.aecp/` tree and the
//! `user.aecp.findings` attribute. The logic is in `aecp-hooks` ([`WorkerHook`]); this module
//! only adapts it to inodes, and each call from `fs.rs`/`content.rs`/`posix.rs` is one line.
//!
//! * **Observer.** [`MountAecp::observed_path`] then [`MountAecp::observe_path`] run on
//!   lookup, [`MountAecp::observe_ino`] on open and read of a workspace path (a read or
//!   import of a contracted module also notes the worker as its consumer, once).
//!   With nothing to do (every artifact of the replica received, no contracted module to
//!   watch for) it is one atomic load; otherwise the path of the inode (from the inode
//!   table, under its lock) and, after the lock, a hash lookup per directory level. It
//!   never waits on the network: deliveries go to the in-memory inbox, and a [`Note`] goes
//!   down a channel that the `awcpfs-aecp` thread drains (reporting to the export,
//!   streaming to the worker's socket).
//! * **`.aecp/`.** Virtual inodes from [`AECP_INO`] up (far above any inode the table
//!   allocates), reachable by lookup from the root but absent from the root's listing — so
//!   `git status`, `grep -r` and `find` never see it. `inbox` (this worker's deliveries,
//!   NDJSON), `violations`, `findings/<path>` (what is bound to that path and its
//!   directories), `contracts/<module>`. Everything is read-only (mode 0444/0555); contents
//!   are generated at each read, and the kernel's copy is invalidated when they change.
//! * **xattr.** `getfattr -n user.aecp.findings FILE` answers the findings for that file;
//!   it is not listed by `listxattr`, so copies and archives do not pick it up.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use fuser::{FileAttr, INodeNo};
use parking_lot::Mutex;

use aecp_hooks::hook::{FINDINGS_LIST_MAX, Note, WorkerHook};
use aecp_hooks::index::IndexEvent;
use aecp_hooks::policy::Policy;

use super::FsError;
use super::fs::DirEntry;
use super::inode::{InodeTable, Kind, ROOT_INO};
use super::posix::XattrReply;

/// The inode of `.aecp`; its children are numbered after it.
pub const AECP_INO: u64 = 0xAEC0_0000_0000_0000;

/// The name at the mount root.
pub const AECP_DIR: &str = ".aecp";

/// The attribute on workspace files.
pub const FINDINGS_XATTR: &str = "user.aecp.findings";

/// The mount's side of AECP.
pub struct MountAecp {
    hook: WorkerHook,
    notes: Mutex<Option<mpsc::Receiver<Note>>>,
    /// Virtual paths (relative to `.aecp`, `""` for itself) ↔ inodes.
    virt: Mutex<Virt>,
    uid: u32,
    gid: u32,
    /// Recent directory listings while the observer has work: (process, directory, when).
    listings: Mutex<VecDeque<(u32, u64, Instant)>>,
}

/// A lookup by a process that listed the parent directory this recently is part of a walk
/// of the tree (`ls -l`, `find`, `du`), not a point of use.
pub const WALK_WINDOW: Duration = Duration::from_secs(2);

/// Most listings remembered (the oldest are forgotten first).
const MAX_LISTINGS: usize = 256;

thread_local! {
    /// The process (thread id, as FUSE gives it) whose request this FUSE thread serves.
    static REQUESTER: Cell<u32> = const { Cell::new(0) };
}

/// Sets the requester of the FUSE request this thread is about to serve (`fuse.rs`).
pub fn set_requester(pid: u32) {
    REQUESTER.with(|r| r.set(pid));
}

/// The thread group (process) of thread `pid`: FUSE names the calling thread, and a walker
/// may list and stat from different threads of one process.
fn process_of(pid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Tgid:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(pid)
}

/// Whether the current requester is a `git` process (`/proc/<pid>/comm`).
fn requester_is_git() -> bool {
    let pid = REQUESTER.with(Cell::get);
    pid != 0
        && std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == "git")
}

#[derive(Default)]
struct Virt {
    by_path: HashMap<String, u64>,
    by_ino: HashMap<u64, String>,
    /// The size a lookup last gave for a virtual file's inode.
    sizes: HashMap<u64, u64>,
    /// The next inode number, above [`AECP_INO`].
    next: u64,
}

impl std::fmt::Debug for MountAecp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountAecp").finish_non_exhaustive()
    }
}

/// What a virtual path is.
enum Node {
    Dir(Vec<(String, bool)>),
    File(Vec<u8>),
}

impl MountAecp {
    /// With the default policy, owned by `uid`/`gid` (the mount's owner); the replica's
    /// files (unnamed: the delivery lines and the inbox) go to `dir`, the mount's state
    /// directory.
    pub fn new(uid: u32, gid: u32, dir: Option<std::path::PathBuf>) -> MountAecp {
        let (hook, notes) = WorkerHook::with_dir("mount", Policy::default(), dir);
        let mut virt = Virt::default();
        virt.by_path.insert(String::new(), AECP_INO);
        virt.by_ino.insert(AECP_INO, String::new());
        virt.next = AECP_INO + 1;
        MountAecp {
            hook,
            notes: Mutex::new(Some(notes)),
            virt: Mutex::new(virt),
            uid,
            gid,
            listings: Mutex::new(VecDeque::new()),
        }
    }

    /// `dir` is being listed by the current requester: its lookups of `dir`'s entries for
    /// the next [`WALK_WINDOW`] are a walk, not points of use. Nothing when the observer
    /// has nothing to do.
    pub fn listed(&self, dir: u64) {
        if !self.hook_active() {
            return;
        }
        let process = process_of(REQUESTER.with(Cell::get));
        let now = Instant::now();
        let mut l = self.listings.lock();
        l.retain(|(p, d, _)| (*p, *d) != (process, dir));
        if l.len() >= MAX_LISTINGS {
            l.pop_front();
        }
        l.push_back((process, dir, now));
    }

    /// Whether the current requester's lookup in `parent` is part of a walk: it listed
    /// `parent` within [`WALK_WINDOW`].
    fn in_walk(&self, parent: u64) -> bool {
        let mut l = self.listings.lock();
        let now = Instant::now();
        l.retain(|(_, _, at)| now.duration_since(*at) < WALK_WINDOW);
        if l.is_empty() {
            return false;
        }
        let pid = REQUESTER.with(Cell::get);
        let process = process_of(pid);
        l.iter()
            .any(|(p, d, _)| *d == parent && (*p == process || *p == pid))
    }

    /// Whether an access to `ino` would deliver something now: the kernel must not cache
    /// its entry (`READDIRPLUS` and lookups answer it with a zero timeout), so that the
    /// worker's first `stat` or `open` of it reaches the observer whatever was listed
    /// before. One atomic load when nothing is pending anywhere.
    pub fn pending_at(&self, table: &super::inode::TableLock, ino: u64) -> bool {
        if !self.hook_active() || Self::is_virtual(ino) {
            return false;
        }
        let path = table.lock().path_of(ino);
        path.is_some_and(|p| self.hook.has_pending(&p))
    }

    /// The receiving end of delivery notes (once: for the `awcpfs-aecp` thread).
    pub fn take_notes(&self) -> Option<mpsc::Receiver<Note>> {
        self.notes.lock().take()
    }

    /// Whether `ino` is one of ours.
    pub fn is_virtual(ino: u64) -> bool {
        ino >= AECP_INO
    }

    /// Applies one `aecp` event of the export's stream; returns the workspace path whose
    /// kernel entry must be invalidated.
    pub fn apply(&self, event: serde_json::Value) -> Option<String> {
        let event: IndexEvent = match serde_json::from_value(event) {
            Ok(e) => e,
            Err(e) => {
                tracing::debug!(error = %e, "ignoring an AECP event this mount does not understand");
                return None;
            }
        };
        self.hook.apply(event)
    }

    /// The paths the export released from holding since the last call (the syncer sends
    /// them again).
    pub fn take_released(&self) -> Vec<String> {
        self.hook.take_released()
    }

    /// The virtual inodes handed out (to invalidate their cached content).
    pub fn virtual_inodes(&self) -> Vec<u64> {
        self.virt.lock().by_ino.keys().copied().collect()
    }

    /// The kernel forgot virtual inode `ino`: one that is no longer its path's current
    /// inode (a file whose size changed got a new one at its lookup) is
    /// dropped, so that reading the inbox after each delivery does not keep an inode per
    /// delivery.
    pub fn forget(&self, ino: u64) {
        let mut v = self.virt.lock();
        let superseded = v
            .by_ino
            .get(&ino)
            .is_some_and(|p| v.by_path.get(p) != Some(&ino));
        if superseded {
            v.by_ino.remove(&ino);
            v.sizes.remove(&ino);
        }
    }

    /// The observer, first half: the path of `ino` (looked up) if the observer has
    /// anything to do, for [`MountAecp::observe_path`] once the table is unlocked.
    pub fn observed_path(&self, table: &InodeTable, ino: u64) -> Option<String> {
        if !self.hook_active() {
            return None;
        }
        table.path_of(ino)
    }

    /// The observer, second half: `path` was looked up in `parent`. A point of use unless
    /// the requester is walking `parent` (it listed it within [`WALK_WINDOW`]) or is `git`
    /// (its lookups refresh its index; what it opens still counts).
    pub fn observe_path(&self, parent: u64, path: &str) {
        if !self.hook.has_pending(path) || self.in_walk(parent) || requester_is_git() {
            return;
        }
        self.hook.on_access(path);
    }

    /// The observer on an open or read (`ino` was used): delivers like
    /// [`MountAecp::observe_path`], and notes a read or import of a contracted module (the
    /// daemon registers the worker as its consumer). For callers without the table locked:
    /// it is locked only when AECP has something to do.
    pub fn observe_ino(&self, table: &super::inode::TableLock, ino: u64) {
        if self.hook_active() && !Self::is_virtual(ino) {
            let path = table.lock().path_of(ino);
            if let Some(path) = path {
                self.hook.on_use(&path);
            }
        }
    }

    fn hook_active(&self) -> bool {
        self.hook.active()
    }

    /// The inode of virtual path `vp`. A lookup passes the file's `size`: when it differs
    /// from the one the inode was last looked up with, the path gets a new inode. Under
    /// the writeback cache the kernel keeps a cached regular file's size over ours, even
    /// after `inval_inode` (and with no-open it reads through its page cache up to that
    /// size); a new inode number is a new kernel inode, built with the new size. (Virtual
    /// entries are never cached, so every path walk looks them up.) The old number keeps
    /// answering for the same path, for descriptors open on it.
    fn ino_for(&self, path: &str, size: Option<u64>) -> u64 {
        let mut v = self.virt.lock();
        let current = v.by_path.get(path).copied();
        if let Some(i) = current
            && (size.is_none() || v.sizes.get(&i) == size.as_ref())
        {
            return i;
        }
        // Only the path's current inode is compared: the old one's size is not needed.
        if let Some(old) = current {
            v.sizes.remove(&old);
        }
        let ino = v.next;
        v.next += 1;
        v.by_path.insert(path.to_owned(), ino);
        v.by_ino.insert(ino, path.to_owned());
        if let Some(size) = size {
            v.sizes.insert(ino, size);
        }
        ino
    }

    /// What virtual path `vp` is now, or `None` if it does not exist.
    fn node(&self, table: &InodeTable, vp: &str) -> Option<Node> {
        let (top, rest) = vp.split_once('/').map_or((vp, None), |(a, b)| (a, Some(b)));
        match (top, rest) {
            ("", None) => Some(Node::Dir(vec![
                ("inbox".into(), false),
                ("violations".into(), false),
                ("findings".into(), true),
                ("contracts".into(), true),
            ])),
            ("inbox", None) => Some(Node::File(self.hook.inbox())),
            ("violations", None) => Some(Node::File(self.hook.violations())),
            ("findings", rest) => {
                let p = rest.unwrap_or("");
                match table.resolve(p).and_then(|i| table.get(i)) {
                    Some(n) if n.kind == Kind::Dir => {
                        let names = n
                            .children
                            .iter()
                            .filter_map(|(name, child)| {
                                let c = table.get(*child)?;
                                matches!(c.kind, Kind::Dir | Kind::File)
                                    .then(|| (name.to_string(), c.kind == Kind::Dir))
                            })
                            .collect();
                        Some(Node::Dir(names))
                    }
                    Some(_) => Some(Node::File(self.hook.findings(p, FINDINGS_LIST_MAX))),
                    // Bound but not (yet) in the workspace: still readable by path.
                    None if !p.is_empty() && self.hook.bound_paths().iter().any(|b| b == p) => {
                        Some(Node::File(self.hook.findings(p, FINDINGS_LIST_MAX)))
                    }
                    None => None,
                }
            }
            ("contracts", None) => {
                let mut top: Vec<(String, bool)> = self
                    .hook
                    .contract_modules()
                    .iter()
                    .map(|m| match m.split_once('/') {
                        Some((d, _)) => (d.to_owned(), true),
                        None => (m.clone(), false),
                    })
                    .collect();
                top.sort();
                top.dedup();
                Some(Node::Dir(top))
            }
            ("contracts", Some(m)) => {
                if let Some(c) = self.hook.contract(m) {
                    return Some(Node::File(c));
                }
                let prefix = format!("{m}/");
                let mut names: Vec<(String, bool)> = self
                    .hook
                    .contract_modules()
                    .iter()
                    .filter_map(|x| x.strip_prefix(&prefix))
                    .map(|r| match r.split_once('/') {
                        Some((d, _)) => (d.to_owned(), true),
                        None => (r.to_owned(), false),
                    })
                    .collect();
                names.sort();
                names.dedup();
                (!names.is_empty()).then_some(Node::Dir(names))
            }
            _ => None,
        }
    }

    fn attr(&self, ino: u64, node: &Node) -> FileAttr {
        let (kind, perm, size) = match node {
            Node::Dir(_) => (fuser::FileType::Directory, 0o555, 4096),
            Node::File(b) => (fuser::FileType::RegularFile, 0o444, b.len() as u64),
        };
        let now = SystemTime::now();
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            kind,
            perm,
            nlink: if kind == fuser::FileType::Directory {
                2
            } else {
                1
            },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn path_of(&self, ino: u64) -> Option<String> {
        self.virt.lock().by_ino.get(&ino).cloned()
    }

    /// `lookup` in the root (`.aecp`) or inside the tree; `None`: not ours.
    pub fn lookup(
        &self,
        table: &InodeTable,
        parent: u64,
        name: &str,
    ) -> Option<Result<FileAttr, FsError>> {
        let vp = if parent == ROOT_INO && name == AECP_DIR {
            // A workspace's own `.aecp` wins (then the tree is not reachable on this mount).
            if table.child(ROOT_INO, AECP_DIR).is_some() {
                return None;
            }
            String::new()
        } else if Self::is_virtual(parent) {
            let Some(pp) = self.path_of(parent) else {
                return Some(Err(FsError::NotFound));
            };
            if pp.is_empty() {
                name.to_owned()
            } else {
                format!("{pp}/{name}")
            }
        } else {
            return None;
        };
        Some(match self.node(table, &vp) {
            Some(n) => {
                let size = match &n {
                    Node::File(b) => Some(b.len() as u64),
                    Node::Dir(_) => None,
                };
                Ok(self.attr(self.ino_for(&vp, size), &n))
            }
            None => Err(FsError::NotFound),
        })
    }

    /// `getattr` of a virtual inode; `None`: not ours.
    pub fn getattr(&self, table: &InodeTable, ino: u64) -> Option<Result<FileAttr, FsError>> {
        if !Self::is_virtual(ino) {
            return None;
        }
        let vp = self.path_of(ino)?;
        Some(
            self.node(table, &vp)
                .map(|n| self.attr(ino, &n))
                .ok_or(FsError::NotFound),
        )
    }

    /// The listing of a virtual directory; `None`: not ours.
    pub fn listing(&self, table: &InodeTable, ino: u64) -> Option<Result<Vec<DirEntry>, FsError>> {
        if !Self::is_virtual(ino) {
            return None;
        }
        let Some(vp) = self.path_of(ino) else {
            return Some(Err(FsError::NotFound));
        };
        Some(match self.node(table, &vp) {
            Some(Node::Dir(names)) => {
                let mut out = vec![
                    DirEntry {
                        ino,
                        kind: Kind::Dir,
                        name: ".".into(),
                    },
                    DirEntry {
                        ino: if vp.is_empty() { ROOT_INO } else { AECP_INO },
                        kind: Kind::Dir,
                        name: "..".into(),
                    },
                ];
                for (name, dir) in names {
                    let child = if vp.is_empty() {
                        name.clone()
                    } else {
                        format!("{vp}/{name}")
                    };
                    let kind = if dir { Kind::Dir } else { Kind::File };
                    out.push(DirEntry {
                        ino: self.ino_for(&child, None),
                        kind,
                        name,
                    });
                }
                Ok(out)
            }
            Some(Node::File(_)) => Err(FsError::NotDir),
            None => Err(FsError::NotFound),
        })
    }

    /// `open` of a virtual file: read-only, handle 0; `None`: not ours.
    pub fn open(&self, ino: u64, write: bool) -> Option<Result<u64, FsError>> {
        if !Self::is_virtual(ino) {
            return None;
        }
        Some(if write { Err(FsError::ReadOnly) } else { Ok(0) })
    }

    /// `read` of a virtual file; `None`: not ours.
    pub fn read(
        &self,
        table: &super::inode::TableLock,
        ino: u64,
        offset: u64,
        size: u32,
    ) -> Option<Result<Vec<u8>, FsError>> {
        if !Self::is_virtual(ino) {
            self.observe_ino(table, ino);
            return None;
        }
        let table = &*table.lock();
        let Some(vp) = self.path_of(ino) else {
            return Some(Err(FsError::NotFound));
        };
        let looked_up = self.virt.lock().sizes.get(&ino).copied();
        Some(match self.node(table, &vp) {
            Some(Node::File(b)) => {
                let b = match looked_up {
                    Some(s) => fit_lines(b, s as usize),
                    None => b,
                };
                let start = (offset as usize).min(b.len());
                let end = start.saturating_add(size as usize).min(b.len());
                Ok(b[start..end].to_vec())
            }
            Some(Node::Dir(_)) => Err(FsError::IsDir),
            None => Err(FsError::NotFound),
        })
    }

    /// `getxattr` of `user.aecp.findings` on a workspace file (or any name on a virtual
    /// inode: none); `None`: not ours.
    pub fn getxattr(
        &self,
        table: &InodeTable,
        ino: u64,
        name: &str,
        size: u32,
    ) -> Option<Result<XattrReply, FsError>> {
        if Self::is_virtual(ino) {
            return Some(Err(FsError::NoAttr));
        }
        if name != FINDINGS_XATTR {
            return None;
        }
        let value = table.path_of(ino).and_then(|p| self.hook.xattr(&p));
        Some(match value {
            None => Err(FsError::NoAttr),
            Some(v) if size == 0 => Ok(XattrReply::Size(v.len() as u32)),
            Some(v) if v.len() > size as usize => Err(FsError::AttrRange),
            Some(v) => Ok(XattrReply::Data(v)),
        })
    }
}

/// How long the reporter gathers notes before one report to the export.
pub const REPORT_EVERY: Duration = Duration::from_millis(100);

/// The worker's delivery socket, in the mount's state directory.
pub const SOCKET_NAME: &str = "aecp.sock";

/// Makes the kernel forget `path`'s entry (an artifact was bound there: the next access
/// must reach the observer) and the `.aecp/` contents it may have cached. `ENOENT`
/// answers (nothing cached) are expected and ignored.
pub fn invalidate(
    fs: &super::fs::AwcpFs,
    notifier: &super::transport::Notifier,
    path: Option<&str>,
) {
    if let Some(path) = path {
        let entry = {
            let table = fs.table.lock();
            let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
            table.resolve(dir).map(|parent| (parent, name.to_owned()))
        };
        if let Some((parent, name)) = entry.filter(|(_, n)| !n.is_empty()) {
            let _ = notifier.inval_entry(parent, std::ffi::OsStr::new(&name));
        }
    }
    for ino in fs.aecp().virtual_inodes() {
        let _ = notifier.inval_inode(ino, 0, -1);
    }
}

/// The `awcpfs-aecp` thread: every [`REPORT_EVERY`] (until `ended` says the mount is over)
/// takes the notes, reports deliveries and uses of contracted modules to the export
/// (`POST /aecp/delivered`: `{"id", "revision"}` and `{"uses": module, "revision"}` entries;
/// best effort: a failed report is retried with the next batch, up to a bound), streams each
/// delivery and revision notice line to the clients of the worker's socket, and invalidates
/// the `.aecp/` contents. The socket is made `owner`'s (uid, gid), if given, so that an
/// agent running as that user can connect. Removes the socket at the end.
///
/// The socket is also the worker's credential: a client may send request lines
/// (`{"kind": "request", "id", "method", "path", "query", "body"}`, see [`serve_requests`]);
/// each is forwarded to the export with the mount's own credential and answered on the same
/// connection as an `answer` line. The daemon acts on it as this mount's worker only. With
/// `token`, a request line must carry it (`"token"`): only the worker's agent has it; and a
/// connection receives the delivery stream only once it has shown it (a `hello` line, or a
/// request with it): the agents of one Executor share a user and can reach each other's
/// sockets by path, but not read each other's deliveries.
#[allow(clippy::too_many_arguments)]
pub fn report(
    fs: &super::fs::AwcpFs,
    remote: &std::sync::Arc<dyn super::remote::Remote>,
    socket: &std::path::Path,
    owner: Option<(u32, u32)>,
    token: Option<String>,
    invalidate: impl Fn(),
    mut ended: impl FnMut() -> bool,
) {
    use std::io::Write as _;
    let Some(notes) = fs.aecp().take_notes() else {
        return;
    };
    let _ = std::fs::remove_file(socket);
    let listener = match std::os::unix::net::UnixListener::bind(socket) {
        Ok(l) => {
            let _ = l.set_nonblocking(true);
            if let Some((uid, gid)) = owner
                && let Err(e) = std::os::unix::fs::chown(socket, Some(uid), Some(gid))
            {
                tracing::warn!(error = %e, socket = %socket.display(), "AECP: cannot give the delivery socket to the agent's user");
            }
            Some(l)
        }
        Err(e) => {
            tracing::warn!(error = %e, socket = %socket.display(), "AECP: no delivery socket");
            None
        }
    };
    let over = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let token: Option<std::sync::Arc<str>> = token.map(Into::into);
    let mut clients: Vec<SocketClient> = Vec::new();
    let mut unreported: Vec<serde_json::Value> = Vec::new();
    loop {
        let done = ended();
        if let Some(l) = &listener {
            while let Ok((mut c, _)) = l.accept() {
                let _ = c.set_nonblocking(false);
                // A client that stops reading loses its connection, never stalls the others.
                let _ = c.set_write_timeout(Some(Duration::from_secs(1)));
                if token.is_some() {
                    // Says what this connection must send to receive the deliveries.
                    let _ = c.write_all(HELLO_NEEDED.as_bytes());
                }
                let reader = c.try_clone();
                let client = SocketClient {
                    stream: std::sync::Arc::new(Mutex::new(c)),
                    streaming: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
                        token.is_none(),
                    )),
                    gone: Default::default(),
                };
                if let Ok(reader) = reader {
                    let (client, remote, over) = (client.clone(), remote.clone(), over.clone());
                    let token = token.clone();
                    let _ = std::thread::Builder::new()
                        .name("awcpfs-aecp-req".into())
                        .spawn(move || {
                            serve_requests(
                                reader,
                                &client.stream,
                                &*remote,
                                token.as_deref(),
                                &client.streaming,
                                &over,
                            );
                            client
                                .gone
                                .store(true, std::sync::atomic::Ordering::Relaxed);
                        });
                } else {
                    client
                        .gone
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
                clients.push(client);
            }
        }
        // Violation reports (held write-backs) go to the socket as they are, not as
        // deliveries (nothing to report back).
        let lines = fs.aecp().hook.take_lines();
        for line in &lines {
            clients.retain(|c| c.send(line));
        }
        let batch: Vec<Note> = notes.try_iter().collect();
        if !lines.is_empty() && batch.is_empty() {
            invalidate();
        }
        if !batch.is_empty() {
            for n in &batch {
                let line = match n {
                    Note::Delivery(d) => {
                        unreported.push(
                            serde_json::json!({ "id": d.delivery.id, "revision": d.revision }),
                        );
                        d.delivery.to_line()
                    }
                    Note::Revision(r) => r.to_line(),
                    Note::Uses { module, revision } => {
                        unreported
                            .push(serde_json::json!({ "uses": module, "revision": revision }));
                        continue;
                    }
                };
                clients.retain(|c| c.send(&line));
            }
            invalidate();
        }
        if !unreported.is_empty() {
            let report = serde_json::Value::Array(unreported.clone());
            match remote.aecp_delivered(&report) {
                Ok(()) => unreported.clear(),
                Err(e) => {
                    tracing::debug!(error = %e, "AECP: delivery report failed; retrying");
                    if unreported.len() > 100_000 {
                        unreported.drain(..50_000);
                    }
                }
            }
        }
        if done {
            break;
        }
    }
    over.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = std::fs::remove_file(socket);
}

/// One connection to the worker's socket: deliveries and answers are written whole lines
/// at a time under its lock.
#[derive(Clone)]
struct SocketClient {
    stream: std::sync::Arc<Mutex<std::os::unix::net::UnixStream>>,
    /// Whether it receives the deliveries: it showed the worker's token (at once when the
    /// socket needs none).
    streaming: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Its reader ended (the client hung up).
    gone: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl SocketClient {
    /// Streams `line` to it if it may read the deliveries; whether to keep it.
    fn send(&self, line: &str) -> bool {
        use std::io::Write as _;
        use std::sync::atomic::Ordering::Relaxed;
        if !self.streaming.load(Relaxed) {
            return !self.gone.load(Relaxed);
        }
        self.stream.lock().write_all(line.as_bytes()).is_ok()
    }
}

/// The first line a connection to a socket that needs the worker's token receives.
const HELLO_NEEDED: &str = concat!(
    r#"{"kind":"hello","streaming":false,"hint":"send {\"kind\": \"hello\", \"token\": \"$AECP_TOKEN\"} as one line to receive this worker's deliveries"}"#,
    "\n"
);

/// The longest request line a socket client may send.
pub const MAX_REQUEST_LINE: usize = 4 << 20;

/// Reads a socket client's lines until it hangs up (or the mount ends): each
/// `{"kind": "request", "id": …, "method", "path", "query", "body"}` line is forwarded to
/// the export (`POST /aecp/request`, the mount's credential) and answered on the same
/// connection as `{"kind": "answer", "id": …, "status": N, "body": …}`; a
/// `{"kind": "hello", "token": …}` line is answered `{"kind": "hello", "streaming": true}`
/// (or `false`, with the error, for a wrong token); other lines are ignored. A line longer
/// than [`MAX_REQUEST_LINE`] is answered with 413 and ends the connection; a line that is
/// not JSON is answered with 400; with `token`, a request without it (`"token"`) is
/// answered with 401 and never forwarded. `streaming` is set once the client showed the
/// token (a hello or a request carrying it).
pub fn serve_requests(
    reader: std::os::unix::net::UnixStream,
    client: &Mutex<std::os::unix::net::UnixStream>,
    remote: &dyn super::remote::Remote,
    token: Option<&str>,
    streaming: &std::sync::atomic::AtomicBool,
    over: &std::sync::atomic::AtomicBool,
) {
    use std::io::{BufRead as _, Write as _};
    let _ = reader.set_read_timeout(Some(Duration::from_millis(200)));
    let mut reader = std::io::BufReader::new(reader);
    let mut line = Vec::new();
    let answer = |id: &serde_json::Value, status: u16, body: serde_json::Value| {
        let mut text =
            serde_json::json!({"kind": "answer", "id": id, "status": status, "body": body})
                .to_string();
        text.push('\n');
        client.lock().write_all(text.as_bytes()).is_ok()
    };
    loop {
        if over.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) if line.ends_with(b"\n") => {}
            Ok(_) => return, // the end, without a newline
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if line.len() > MAX_REQUEST_LINE {
                    answer(
                        &serde_json::Value::Null,
                        413,
                        serde_json::json!({"error": format!("a request line is at most {MAX_REQUEST_LINE} bytes")}),
                    );
                    return;
                }
                continue;
            }
            Err(_) => return,
        }
        let text = std::mem::take(&mut line);
        if text.len() > MAX_REQUEST_LINE {
            answer(
                &serde_json::Value::Null,
                413,
                serde_json::json!({"error": format!("a request line is at most {MAX_REQUEST_LINE} bytes")}),
            );
            return;
        }
        let v: serde_json::Value = match serde_json::from_slice(&text) {
            Ok(v) => v,
            Err(e) => {
                if !answer(
                    &serde_json::Value::Null,
                    400,
                    serde_json::json!({"error": format!("a request line is one JSON object: {e}")}),
                ) {
                    return;
                }
                continue;
            }
        };
        let shown = token.is_none_or(|want| {
            let given = v["token"].as_str().unwrap_or("");
            given.len() == want.len()
                && given
                    .bytes()
                    .zip(want.bytes())
                    .fold(0u8, |acc, (x, y)| acc | (x ^ y))
                    == 0
        });
        if v["kind"] == "hello" {
            let mut text = if shown {
                streaming.store(true, std::sync::atomic::Ordering::Relaxed);
                serde_json::json!({"kind": "hello", "streaming": true})
            } else {
                serde_json::json!({
                    "kind": "hello",
                    "streaming": false,
                    "status": 401,
                    "error": "this socket's deliveries and requests need its worker's AECP_TOKEN",
                    "hint": "the Executor gives each agent its own AECP_SOCKET and AECP_TOKEN: \
                             another agent's token does not open this worker's deliveries",
                })
            }
            .to_string();
            text.push('\n');
            if client.lock().write_all(text.as_bytes()).is_err() {
                return;
            }
            continue;
        }
        if v["kind"] != "request" {
            continue;
        }
        if shown {
            streaming.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if !shown {
            let _ = answer(
                &v["id"],
                401,
                serde_json::json!({
                    "error": "this socket's deliveries and requests need its worker's AECP_TOKEN",
                    "hint": "the Executor gives each agent its own AECP_SOCKET and AECP_TOKEN; \
                             awcp-ctl sends them without flags",
                }),
            );
            continue;
        }
        let forward = serde_json::json!({
            "method": v["method"],
            "path": v["path"],
            "query": v["query"],
            "body": v["body"],
        });
        let (status, body) = match remote.aecp_request(&forward) {
            Ok(a) => a,
            Err(e) => (
                502,
                serde_json::json!({
                    "error": format!("the mount could not ask the Delegator: {e}"),
                    "hint": "the worker's requests go through its mount: is the task still running?",
                }),
            ),
        };
        if !answer(&v["id"], status, body) {
            return;
        }
    }
}

/// Answers an `open` of a virtual file: direct I/O (every read reaches [`MountAecp::read`],
/// so a growing inbox is never cut at a cached size), or the error.
pub fn reply_open(r: Result<u64, FsError>, reply: fuser::ReplyOpen) {
    match r {
        Ok(fh) => reply.opened(fuser::FileHandle(fh), fuser::FopenFlags::FOPEN_DIRECT_IO),
        Err(e) => reply.error(e.errno()),
    }
}

/// A virtual file's lines `b` served as exactly `size` bytes, the size its inode was looked
/// up with: the kernel reads a file up to the size it holds, and under the writeback cache
/// it fills a short read with zeros instead of taking the shorter size, so a file that
/// changed between the lookup and the read would show NUL bytes. Whole lines only: longer
/// content is cut after its last newline within `size`, and the rest is newlines, which
/// line-by-line readers skip. The next lookup gives the new content its own inode.
fn fit_lines(mut b: Vec<u8>, size: usize) -> Vec<u8> {
    if b.len() > size {
        let keep = b[..size]
            .iter()
            .rposition(|c| *c == b'\n')
            .map_or(0, |i| i + 1);
        b.truncate(keep);
    }
    b.resize(size, b'\n');
    b
}

#[cfg(test)]
mod tests {
    use super::{MountAecp, fit_lines};

    #[test]
    fn a_superseded_virtual_inode_is_dropped_once_the_kernel_forgets_it() {
        let a = MountAecp::new(0, 0, None);
        let first = a.ino_for("inbox", Some(10));
        assert_eq!(a.ino_for("inbox", Some(10)), first, "same size: same inode");
        let second = a.ino_for("inbox", Some(20));
        assert_ne!(first, second, "a new size: a new inode");
        a.forget(second);
        assert_eq!(a.path_of(second).as_deref(), Some("inbox"), "current: kept");
        assert_eq!(
            a.path_of(first).as_deref(),
            Some("inbox"),
            "the old one still answers while the kernel knows it"
        );
        a.forget(first);
        assert_eq!(a.path_of(first), None);
        // `.aecp` itself and the inbox's current inode: nothing per change kept.
        for size in 21..1_000 {
            let old = a.ino_for("inbox", None);
            a.ino_for("inbox", Some(size));
            a.forget(old);
        }
        assert_eq!(a.virtual_inodes().len(), 2);
    }

    #[test]
    fn a_virtual_file_read_at_its_looked_up_size_shows_whole_lines_and_no_nul() {
        let lines = b"{\"a\":1}\n{\"b\":2}\n".to_vec();
        // Unchanged.
        assert_eq!(fit_lines(lines.clone(), 16), lines);
        // Shrunk since the lookup (a finding refuted): newlines, not zeros, fill it.
        assert_eq!(
            fit_lines(b"{\"a\":1}\n".to_vec(), 16),
            b"{\"a\":1}\n\n\n\n\n\n\n\n\n".to_vec()
        );
        assert_eq!(fit_lines(Vec::new(), 3), b"\n\n\n".to_vec());
        // Grown since (a delivery): no half line.
        assert_eq!(
            fit_lines(lines.clone(), 12),
            b"{\"a\":1}\n\n\n\n\n".to_vec()
        );
        assert_eq!(fit_lines(lines, 5), b"\n\n\n\n\n".to_vec());
    }
}
