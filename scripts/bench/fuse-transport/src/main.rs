//! protofs: a minimal, self-mounting FUSE server used to measure the cost of the
//! classic /dev/fuse read/write transport against FUSE-over-io_uring.
//!
//! Usage:
//!   protofs MNT --transport legacy --threads N [--dirs D --files F]
//!   protofs MNT --transport uring  --depth K   [--dirs D --files F]
//!
//! The tree is synthetic: /d<i>/f<j> (100-byte files of zeros) plus /sink (writes
//! are accepted and discarded). SIGINT/SIGTERM unmount and exit; SIGUSR1 prints
//! per-opcode request counters to stderr.

use std::ffi::CString;
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

// ---------------------------------------------------------------- protocol

const FUSE_LOOKUP: u32 = 1;
const FUSE_FORGET: u32 = 2;
const FUSE_GETATTR: u32 = 3;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_WRITE: u32 = 16;
const FUSE_STATFS: u32 = 17;
const FUSE_RELEASE: u32 = 18;
const FUSE_GETXATTR: u32 = 22;
const FUSE_FLUSH: u32 = 25;
const FUSE_INIT: u32 = 26;
const FUSE_OPENDIR: u32 = 27;
const FUSE_READDIR: u32 = 28;
const FUSE_RELEASEDIR: u32 = 29;
const FUSE_ACCESS: u32 = 34;
const FUSE_INTERRUPT: u32 = 36;
const FUSE_DESTROY: u32 = 38;
const FUSE_BATCH_FORGET: u32 = 42;

const FUSE_ASYNC_READ: u64 = 1 << 0;
const FUSE_BIG_WRITES: u64 = 1 << 5;
const FUSE_PARALLEL_DIROPS: u64 = 1 << 18;
const FUSE_MAX_PAGES: u64 = 1 << 22;
const FUSE_HANDLE_KILLPRIV_V2: u64 = 1 << 28;
const FUSE_INIT_EXT: u64 = 1 << 30;
const FUSE_OVER_IO_URING: u64 = 1 << 41;

const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;

// _IOR(229, 0, uint32_t)
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

const IN_HDR: usize = 40; // struct fuse_in_header
const OUT_HDR: usize = 16; // struct fuse_out_header
const ATTR_SZ: usize = 88; // struct fuse_attr
const ENTRY_OUT: usize = 40 + ATTR_SZ; // struct fuse_entry_out = 128
const ATTR_OUT: usize = 16 + ATTR_SZ; // struct fuse_attr_out = 104

// io_uring header buffer: in_out[128] op_in[128] ring_ent_in_out{flags, commit_id, payload_sz, padding, reserved}
const URING_HDR_SZ: usize = 288;
const URING_OP_IN: usize = 128;
const URING_ENT_IN_OUT: usize = 256;

const MAX_WRITE: usize = 1 << 20;
const MAX_PAGES: u16 = 256;
const FILE_SIZE: u64 = 100;
const TTL: u64 = 3600;

#[derive(Clone, Copy, Debug)]
struct InHeader {
    len: u32,
    opcode: u32,
    unique: u64,
    nodeid: u64,
}

fn rd_u32(b: &[u8], o: usize) -> u32 {
    u32::from_ne_bytes(b[o..o + 4].try_into().unwrap())
}
fn rd_u64(b: &[u8], o: usize) -> u64 {
    u64::from_ne_bytes(b[o..o + 8].try_into().unwrap())
}
fn wr_u32(b: &mut [u8], o: usize, v: u32) {
    b[o..o + 4].copy_from_slice(&v.to_ne_bytes())
}
fn wr_u64(b: &mut [u8], o: usize, v: u64) {
    b[o..o + 8].copy_from_slice(&v.to_ne_bytes())
}
fn wr_i32(b: &mut [u8], o: usize, v: i32) {
    b[o..o + 4].copy_from_slice(&v.to_ne_bytes())
}

fn parse_in_header(b: &[u8]) -> InHeader {
    InHeader {
        len: rd_u32(b, 0),
        opcode: rd_u32(b, 4),
        unique: rd_u64(b, 8),
        nodeid: rd_u64(b, 16),
    }
}

/// Size of the fixed per-opcode input struct (in_args[0]). Over io_uring it is
/// delivered in op_in, everything after it in the payload buffer; over /dev/fuse
/// the two are contiguous after the fuse_in_header.
fn op_in_size(opcode: u32) -> usize {
    match opcode {
        FUSE_GETATTR => 16,
        FUSE_OPEN | FUSE_OPENDIR => 8,
        FUSE_READ | FUSE_READDIR | FUSE_WRITE => 40,
        FUSE_RELEASE | FUSE_RELEASEDIR => 24,
        FUSE_FLUSH => 24,
        FUSE_GETXATTR => 8,
        FUSE_ACCESS => 8,
        FUSE_FORGET => 8,
        FUSE_BATCH_FORGET => 8,
        FUSE_INTERRUPT => 8,
        _ => 0, // LOOKUP (name only), STATFS, DESTROY, ...
    }
}

// ---------------------------------------------------------------- stats

struct Stats {
    ops: [AtomicU64; 64],
}
impl Stats {
    fn new() -> Arc<Stats> {
        Arc::new(Stats {
            ops: std::array::from_fn(|_| AtomicU64::new(0)),
        })
    }
    fn count(&self, op: u32) {
        let i = if (op as usize) < 63 { op as usize } else { 63 };
        // single writer per Stats: a plain load+store avoids a locked op
        let a = &self.ops[i];
        a.store(a.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}
/// Every thread's counters, by name, for SIGUSR1.
type NamedStats = Vec<(String, Arc<Stats>)>;
static STATS: OnceLock<Mutex<NamedStats>> = OnceLock::new();
fn new_stats(name: &str) -> Arc<Stats> {
    let s = Stats::new();
    STATS
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .unwrap()
        .push((name.to_string(), s.clone()));
    s
}
fn op_name(op: usize) -> &'static str {
    match op as u32 {
        FUSE_LOOKUP => "LOOKUP",
        FUSE_FORGET => "FORGET",
        FUSE_GETATTR => "GETATTR",
        FUSE_OPEN => "OPEN",
        FUSE_READ => "READ",
        FUSE_WRITE => "WRITE",
        FUSE_STATFS => "STATFS",
        FUSE_RELEASE => "RELEASE",
        FUSE_GETXATTR => "GETXATTR",
        FUSE_FLUSH => "FLUSH",
        FUSE_INIT => "INIT",
        FUSE_OPENDIR => "OPENDIR",
        FUSE_READDIR => "READDIR",
        FUSE_RELEASEDIR => "RELEASEDIR",
        FUSE_ACCESS => "ACCESS",
        FUSE_INTERRUPT => "INTERRUPT",
        FUSE_DESTROY => "DESTROY",
        FUSE_BATCH_FORGET => "BATCH_FORGET",
        _ => "other",
    }
}
fn dump_stats() {
    let Some(m) = STATS.get() else { return };
    let v = m.lock().unwrap();
    let mut line = String::from("stats:");
    for (name, s) in v.iter() {
        let mut parts = Vec::new();
        for (i, a) in s.ops.iter().enumerate() {
            let n = a.load(Ordering::Relaxed);
            if n > 0 {
                parts.push(format!("{}={}", op_name(i), n));
            }
        }
        line.push_str(&format!(" [{}: {}]", name, parts.join(" ")));
    }
    eprintln!("{}", line);
}

// ---------------------------------------------------------------- filesystem

struct Fs {
    dirs: u64,
    files: u64,
}

enum Node {
    Root,
    Dir(u64),
    File(u64, u64),
    Sink,
}

enum Res {
    /// reply body of n bytes written to `out`
    Ok(usize),
    Err(i32),
    NoReply,
}

impl Fs {
    fn dir_ino(&self, d: u64) -> u64 {
        2 + d * (self.files + 1)
    }
    fn file_ino(&self, d: u64, f: u64) -> u64 {
        self.dir_ino(d) + 1 + f
    }
    fn sink_ino(&self) -> u64 {
        2 + self.dirs * (self.files + 1)
    }
    fn node(&self, ino: u64) -> Option<Node> {
        if ino == 1 {
            return Some(Node::Root);
        }
        if ino == self.sink_ino() {
            return Some(Node::Sink);
        }
        if ino < 2 || ino > self.sink_ino() {
            return None;
        }
        let x = ino - 2;
        let d = x / (self.files + 1);
        let r = x % (self.files + 1);
        if r == 0 {
            Some(Node::Dir(d))
        } else {
            Some(Node::File(d, r - 1))
        }
    }
    fn ino_of(&self, n: &Node) -> u64 {
        match *n {
            Node::Root => 1,
            Node::Dir(d) => self.dir_ino(d),
            Node::File(d, f) => self.file_ino(d, f),
            Node::Sink => self.sink_ino(),
        }
    }

    fn write_attr(&self, n: &Node, b: &mut [u8]) {
        b[..ATTR_SZ].fill(0);
        let (mode, nlink, size) = match n {
            Node::Root => (0o040755u32, 2 + self.dirs as u32, 4096u64),
            Node::Dir(_) => (0o040755, 2, 4096),
            Node::File(..) => (0o100644, 1, FILE_SIZE),
            Node::Sink => (0o100666, 1, 0),
        };
        wr_u64(b, 0, self.ino_of(n)); // ino
        wr_u64(b, 8, size);
        wr_u64(b, 16, size.div_ceil(512)); // blocks
        let t = 1_700_000_000u64;
        wr_u64(b, 24, t);
        wr_u64(b, 32, t);
        wr_u64(b, 40, t);
        wr_u32(b, 60, mode);
        wr_u32(b, 64, nlink);
        // uid, gid, rdev = 0
        wr_u32(b, 80, 4096); // blksize
    }

    fn parse_idx(name: &[u8], prefix: u8, limit: u64) -> Option<u64> {
        if name.len() < 2 || name[0] != prefix {
            return None;
        }
        let digits = &name[1..];
        if digits.len() > 1 && digits[0] == b'0' {
            return None;
        }
        let mut v: u64 = 0;
        for &c in digits {
            if !c.is_ascii_digit() {
                return None;
            }
            v = v.checked_mul(10)?.checked_add((c - b'0') as u64)?;
        }
        (v < limit).then_some(v)
    }

    fn lookup(&self, parent: u64, name: &[u8]) -> Option<Node> {
        match self.node(parent)? {
            Node::Root => {
                if name == b"sink" {
                    Some(Node::Sink)
                } else {
                    Self::parse_idx(name, b'd', self.dirs).map(Node::Dir)
                }
            }
            Node::Dir(d) => Self::parse_idx(name, b'f', self.files).map(|f| Node::File(d, f)),
            _ => None,
        }
    }

    /// Handle one request. `op_in` is the fixed per-opcode struct, `rest` what follows it
    /// (name, write data), `out` receives the reply body.
    fn handle(&self, h: &InHeader, op_in: &[u8], rest: &[u8], out: &mut [u8]) -> Res {
        match h.opcode {
            FUSE_LOOKUP => {
                let name = rest.split(|&c| c == 0).next().unwrap_or(&[]);
                match self.lookup(h.nodeid, name) {
                    Some(n) => {
                        let o = &mut out[..ENTRY_OUT];
                        wr_u64(o, 0, self.ino_of(&n));
                        wr_u64(o, 8, 0); // generation
                        wr_u64(o, 16, TTL);
                        wr_u64(o, 24, TTL);
                        wr_u32(o, 32, 0);
                        wr_u32(o, 36, 0);
                        self.write_attr(&n, &mut o[40..]);
                        Res::Ok(ENTRY_OUT)
                    }
                    None => Res::Err(libc::ENOENT),
                }
            }
            FUSE_FORGET | FUSE_BATCH_FORGET => Res::NoReply,
            FUSE_INTERRUPT => Res::NoReply, // all our requests complete immediately
            FUSE_GETATTR => match self.node(h.nodeid) {
                Some(n) => {
                    let o = &mut out[..ATTR_OUT];
                    wr_u64(o, 0, TTL);
                    wr_u32(o, 8, 0);
                    wr_u32(o, 12, 0);
                    self.write_attr(&n, &mut o[16..]);
                    Res::Ok(ATTR_OUT)
                }
                None => Res::Err(libc::ENOENT),
            },
            FUSE_OPEN | FUSE_OPENDIR => {
                // fuse_open_out { fh, open_flags, padding }
                out[..16].fill(0);
                Res::Ok(16)
            }
            FUSE_RELEASE | FUSE_RELEASEDIR | FUSE_FLUSH => Res::Ok(0),
            FUSE_READ => {
                let off = rd_u64(op_in, 8);
                let size = rd_u32(op_in, 16) as u64;
                let fsize = match self.node(h.nodeid) {
                    Some(Node::File(..)) => FILE_SIZE,
                    _ => 0,
                };
                let n = fsize.saturating_sub(off).min(size) as usize;
                let n = n.min(out.len());
                out[..n].fill(0);
                Res::Ok(n)
            }
            FUSE_WRITE => {
                if !matches!(self.node(h.nodeid), Some(Node::Sink)) {
                    return Res::Err(libc::EACCES);
                }
                let size = rd_u32(op_in, 16);
                wr_u32(out, 0, size);
                wr_u32(out, 4, 0);
                Res::Ok(8)
            }
            FUSE_READDIR => {
                self.readdir(h.nodeid, rd_u64(op_in, 8), rd_u32(op_in, 16) as usize, out)
            }
            FUSE_GETXATTR => Res::Err(libc::ENODATA),
            FUSE_STATFS => {
                let o = &mut out[..80];
                o.fill(0);
                wr_u64(o, 0, 1 << 20); // blocks
                wr_u64(o, 8, 1 << 19); // bfree
                wr_u64(o, 16, 1 << 19); // bavail
                wr_u64(o, 24, self.sink_ino()); // files
                wr_u64(o, 32, 0); // ffree
                wr_u32(o, 40, 4096); // bsize
                wr_u32(o, 44, 255); // namelen
                wr_u32(o, 48, 4096); // frsize
                Res::Ok(80)
            }
            FUSE_ACCESS => Res::Ok(0),
            FUSE_DESTROY => Res::Ok(0),
            _ => Res::Err(libc::ENOSYS),
        }
    }

    fn readdir(&self, ino: u64, off: u64, size: usize, out: &mut [u8]) -> Res {
        let size = size.min(out.len());
        let (count, is_root, d) = match self.node(ino) {
            Some(Node::Root) => (self.dirs + 1, true, 0),
            Some(Node::Dir(d)) => (self.files, false, d),
            _ => return Res::Err(libc::ENOTDIR),
        };
        let mut pos = 0usize;
        let mut i = off;
        let mut name = [0u8; 24];
        while i < count {
            let (node, typ) = if is_root {
                if i < self.dirs {
                    (Node::Dir(i), 4u32)
                } else {
                    (Node::Sink, 8u32)
                }
            } else {
                (Node::File(d, i), 8u32)
            };
            let nlen = {
                let mut c = std::io::Cursor::new(&mut name[..]);
                match node {
                    Node::Dir(x) => write!(c, "d{}", x).unwrap(),
                    Node::File(_, x) => write!(c, "f{}", x).unwrap(),
                    Node::Sink => write!(c, "sink").unwrap(),
                    Node::Root => unreachable!(),
                }
                c.position() as usize
            };
            let reclen = (24 + nlen + 7) & !7;
            if pos + reclen > size {
                break;
            }
            let e = &mut out[pos..pos + reclen];
            e.fill(0);
            wr_u64(e, 0, self.ino_of(&node));
            wr_u64(e, 8, i + 1);
            wr_u32(e, 16, nlen as u32);
            wr_u32(e, 20, typ);
            e[24..24 + nlen].copy_from_slice(&name[..nlen]);
            pos += reclen;
            i += 1;
        }
        Res::Ok(pos)
    }
}

// ---------------------------------------------------------------- legacy transport

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn write_reply(fd: i32, unique: u64, res: &Res, body: &[u8]) {
    let (err, n) = match *res {
        Res::Ok(n) => (0, n),
        Res::Err(e) => (-e, 0),
        Res::NoReply => return,
    };
    let mut hdr = [0u8; OUT_HDR];
    wr_u32(&mut hdr, 0, (OUT_HDR + n) as u32);
    wr_i32(&mut hdr, 4, err);
    wr_u64(&mut hdr, 8, unique);
    let iov = [
        libc::iovec {
            iov_base: hdr.as_ptr() as *mut _,
            iov_len: OUT_HDR,
        },
        libc::iovec {
            iov_base: body.as_ptr() as *mut _,
            iov_len: n,
        },
    ];
    let r = unsafe { libc::writev(fd, iov.as_ptr(), if n > 0 { 2 } else { 1 }) };
    if r < 0 {
        let e = errno();
        if e != libc::ENOENT {
            eprintln!(
                "writev reply failed: {}",
                std::io::Error::from_raw_os_error(e)
            );
        }
    }
}

/// read(/dev/fuse) -> handle -> writev loop. Returns when the connection is gone.
fn legacy_loop(fs: &Fs, fd: i32, stats: &Stats) {
    let mut buf = vec![0u8; MAX_WRITE + 64 * 1024];
    let mut out = vec![0u8; 128 * 1024];
    loop {
        let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut _, buf.len()) };
        if n < 0 {
            match errno() {
                libc::EINTR | libc::EAGAIN | libc::ENOENT => continue,
                libc::ENODEV => return,
                e => {
                    eprintln!("read /dev/fuse: {}", std::io::Error::from_raw_os_error(e));
                    return;
                }
            }
        }
        let n = n as usize;
        if n < IN_HDR {
            continue;
        }
        let h = parse_in_header(&buf);
        stats.count(h.opcode);
        let body = &buf[IN_HDR..n.min(h.len as usize)];
        let k = op_in_size(h.opcode).min(body.len());
        let (op_in, rest) = body.split_at(k);
        let res = fs.handle(&h, op_in, rest, &mut out);
        write_reply(fd, h.unique, &res, &out);
    }
}

fn clone_fd(fd: i32) -> i32 {
    let path = CString::new("/dev/fuse").unwrap();
    let nfd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    assert!(nfd >= 0, "open /dev/fuse for clone");
    let mut src: u32 = fd as u32;
    let r = unsafe { libc::ioctl(nfd, FUSE_DEV_IOC_CLONE, &mut src) };
    assert!(
        r == 0,
        "FUSE_DEV_IOC_CLONE: {}",
        std::io::Error::last_os_error()
    );
    nfd
}

// ---------------------------------------------------------------- io_uring transport

#[repr(C, align(4096))]
struct HdrBuf([u8; 4096]);

struct RingEnt {
    hdr: Box<HdrBuf>,
    payload: Vec<u8>,
    iov: Box<[libc::iovec; 2]>,
}

fn uring_cmd_sqe(
    fd: i32,
    cmd_op: u32,
    qid: u16,
    commit_id: u64,
    iov: Option<*const libc::iovec>,
    ud: u64,
) -> squeue::Entry128 {
    // struct fuse_uring_cmd_req { u64 flags; u64 commit_id; u16 qid; u8 padding[6]; }
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    let mut b = opcode::UringCmd80::new(types::Fd(fd), cmd_op).cmd(cmd);
    if let Some(p) = iov {
        b = b.addr(Some(p as u64));
    }
    let e = b.build().user_data(ud);
    if iov.is_some() {
        // the io-uring crate has no setter for sqe->len, the kernel wants the iovec count (2) there
        let mut raw: [u8; 128] = unsafe { std::mem::transmute(e) };
        raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
        unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
    } else {
        e
    }
}

fn pin_to_cpu(cpu: usize) {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            eprintln!(
                "pin to cpu {} failed: {}",
                cpu,
                std::io::Error::last_os_error()
            );
        }
    }
}

fn uring_queue(fs: &Fs, fd: i32, qid: usize, depth: usize, payload_sz: usize, stats: &Stats) {
    pin_to_cpu(qid);
    let entries = (depth * 2).next_power_of_two().max(8) as u32;
    let mut ring: IoUring<squeue::Entry128, cqueue::Entry> = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
        .expect("io_uring_setup (SQE128)");
    let mut ents: Vec<RingEnt> = (0..depth)
        .map(|_| {
            let mut hdr = Box::new(HdrBuf([0u8; 4096]));
            let mut payload = vec![0u8; payload_sz];
            let iov = Box::new([
                libc::iovec {
                    iov_base: hdr.0.as_mut_ptr() as *mut _,
                    iov_len: URING_HDR_SZ,
                },
                libc::iovec {
                    iov_base: payload.as_mut_ptr() as *mut _,
                    iov_len: payload_sz,
                },
            ]);
            RingEnt { hdr, payload, iov }
        })
        .collect();
    for (i, e) in ents.iter().enumerate() {
        let sqe = uring_cmd_sqe(
            fd,
            FUSE_IO_URING_CMD_REGISTER,
            qid as u16,
            0,
            Some(e.iov.as_ptr()),
            i as u64,
        );
        unsafe { ring.submission().push(&sqe).expect("sq full") };
    }
    let mut scratch = vec![0u8; 64 * 1024];
    let mut live = depth;
    let mut pending: Vec<squeue::Entry128> = Vec::with_capacity(depth);
    while live > 0 {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => {
                eprintln!("q{}: io_uring_enter: {}", qid, e);
                return;
            }
        }
        for cqe in ring.completion() {
            let idx = cqe.user_data() as usize;
            if cqe.result() < 0 {
                let e = -cqe.result();
                if e != libc::ENOTCONN && e != libc::ECANCELED {
                    eprintln!(
                        "q{}: ent {} completed with {}",
                        qid,
                        idx,
                        std::io::Error::from_raw_os_error(e)
                    );
                }
                live -= 1;
                continue;
            }
            let ent = &mut ents[idx];
            let hb = &mut ent.hdr.0;
            let h = parse_in_header(&hb[..IN_HDR]);
            stats.count(h.opcode);
            let commit_id = rd_u64(hb, URING_ENT_IN_OUT + 8);
            let in_payload = rd_u32(hb, URING_ENT_IN_OUT + 16) as usize;
            let k = op_in_size(h.opcode);
            let mut op_in = [0u8; URING_OP_IN];
            op_in[..k].copy_from_slice(&hb[URING_OP_IN..URING_OP_IN + k]);
            // the payload buffer is both input and output: copy small inputs (names) away first
            let rest_len = if h.opcode == FUSE_WRITE {
                0
            } else {
                in_payload.min(scratch.len())
            };
            scratch[..rest_len].copy_from_slice(&ent.payload[..rest_len]);
            let res = fs.handle(&h, &op_in[..k], &scratch[..rest_len], &mut ent.payload);
            let (err, n) = match res {
                Res::Ok(n) => (0, n),
                Res::Err(e) => (-e, 0),
                Res::NoReply => (0, 0), // cannot happen: FORGET/INTERRUPT use /dev/fuse
            };
            wr_u32(hb, 0, (OUT_HDR + n) as u32);
            wr_i32(hb, 4, err);
            wr_u64(hb, 8, h.unique);
            wr_u32(hb, URING_ENT_IN_OUT + 16, n as u32);
            pending.push(uring_cmd_sqe(
                fd,
                FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
                qid as u16,
                commit_id,
                None,
                idx as u64,
            ));
        }
        if !pending.is_empty() {
            let mut sq = ring.submission();
            for sqe in pending.drain(..) {
                unsafe { sq.push(&sqe).expect("sq full") };
            }
        }
    }
}

fn possible_cpus() -> usize {
    let s =
        std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_else(|_| "0".into());
    let mut max = 0usize;
    for part in s.trim().split(',') {
        let hi = part.split('-').next_back().unwrap();
        max = max.max(hi.parse::<usize>().unwrap_or(0));
    }
    max + 1
}

// ---------------------------------------------------------------- main

struct Args {
    mnt: String,
    uring: bool,
    threads: usize,
    depth: usize,
    dirs: u64,
    files: u64,
}

fn parse_args() -> Args {
    let mut a = Args {
        mnt: String::new(),
        uring: false,
        threads: 1,
        depth: 2,
        dirs: 200,
        files: 100,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if !arg.starts_with("--") && a.mnt.is_empty() {
            a.mnt = arg;
            continue;
        }
        let value = args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        let number = || -> usize {
            value
                .parse()
                .unwrap_or_else(|_| panic!("{arg}: not a number: {value}"))
        };
        match arg.as_str() {
            "--transport" => {
                a.uring = match value.as_str() {
                    "uring" => true,
                    "legacy" => false,
                    t => panic!("unknown transport {t}"),
                }
            }
            "--threads" => a.threads = number(),
            "--depth" => a.depth = number(),
            "--dirs" => a.dirs = number() as u64,
            "--files" => a.files = number() as u64,
            s => panic!("unknown argument {s}"),
        }
    }
    assert!(
        !a.mnt.is_empty(),
        "usage: protofs MNT --transport legacy|uring [--threads N] [--depth K]"
    );
    a
}

fn main() {
    let args = parse_args();
    let fs: &'static Fs = Box::leak(Box::new(Fs {
        dirs: args.dirs,
        files: args.files,
    }));

    // Block the signals in every thread; main waits for them with sigwait.
    let mut sigs: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe {
        libc::sigemptyset(&mut sigs);
        libc::sigaddset(&mut sigs, libc::SIGINT);
        libc::sigaddset(&mut sigs, libc::SIGTERM);
        libc::sigaddset(&mut sigs, libc::SIGUSR1);
        libc::pthread_sigmask(libc::SIG_BLOCK, &sigs, std::ptr::null_mut());
    }

    let dev = CString::new("/dev/fuse").unwrap();
    let fd = unsafe { libc::open(dev.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    assert!(
        fd >= 0,
        "open /dev/fuse: {}",
        std::io::Error::last_os_error()
    );
    let opts = CString::new(format!(
        "fd={fd},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other"
    ))
    .unwrap();
    let mnt = CString::new(args.mnt.clone()).unwrap();
    let src = CString::new("proto").unwrap();
    let fstype = CString::new("fuse.proto").unwrap();
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            mnt.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr() as *const _,
        )
    };
    assert!(r == 0, "mount: {}", std::io::Error::last_os_error());

    // FUSE_INIT
    let mut buf = vec![0u8; MAX_WRITE + 64 * 1024];
    let n = loop {
        let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut _, buf.len()) };
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        assert!(n > 0, "read INIT: {}", std::io::Error::last_os_error());
        break n as usize;
    };
    let h = parse_in_header(&buf);
    assert_eq!(h.opcode, FUSE_INIT, "first request is not INIT");
    let body = &buf[IN_HDR..n];
    let kmajor = rd_u32(body, 0);
    let kminor = rd_u32(body, 4);
    let max_readahead = rd_u32(body, 8);
    let mut kflags = rd_u32(body, 12) as u64;
    if kflags & FUSE_INIT_EXT != 0 {
        kflags |= (rd_u32(body, 16) as u64) << 32;
    }
    assert_eq!(kmajor, 7);
    let mut want = FUSE_ASYNC_READ
        | FUSE_BIG_WRITES
        | FUSE_PARALLEL_DIROPS
        | FUSE_MAX_PAGES
        | FUSE_HANDLE_KILLPRIV_V2
        | FUSE_INIT_EXT;
    if args.uring {
        want |= FUSE_OVER_IO_URING;
        if kflags & FUSE_OVER_IO_URING == 0 {
            eprintln!("kernel does not offer FUSE_OVER_IO_URING (is /sys/module/fuse/parameters/enable_uring Y?)");
        }
    }
    let flags = want & kflags;
    eprintln!("INIT: kernel 7.{kminor} flags {kflags:#x}; replying flags {flags:#x}");
    let mut out = [0u8; 64];
    wr_u32(&mut out, 0, 7);
    wr_u32(&mut out, 4, kminor.min(45));
    wr_u32(&mut out, 8, max_readahead);
    wr_u32(&mut out, 12, flags as u32);
    out[16..18].copy_from_slice(&64u16.to_ne_bytes()); // max_background
    out[18..20].copy_from_slice(&48u16.to_ne_bytes()); // congestion_threshold
    wr_u32(&mut out, 20, MAX_WRITE as u32);
    wr_u32(&mut out, 24, 1); // time_gran
    out[28..30].copy_from_slice(&MAX_PAGES.to_ne_bytes());
    wr_u32(&mut out, 32, (flags >> 32) as u32); // flags2
    write_reply(fd, h.unique, &Res::Ok(64), &out);
    drop(buf);

    if args.uring && flags & FUSE_OVER_IO_URING != 0 {
        let ncpu = possible_cpus();
        let payload_sz = MAX_WRITE.max(8192).max(MAX_PAGES as usize * 4096);
        eprintln!(
            "uring: {ncpu} queues x depth {}, payload {payload_sz} B",
            args.depth
        );
        for q in 0..ncpu {
            let st = new_stats(&format!("ring{q}"));
            let depth = args.depth;
            std::thread::Builder::new()
                .name(format!("ring{q}"))
                .spawn(move || {
                    uring_queue(fs, fd, q, depth, payload_sz, &st);
                    eprintln!("ring{q} done");
                })
                .unwrap();
        }
        // FORGET / BATCH_FORGET / INTERRUPT still come through read(/dev/fuse).
        let st = new_stats("dev");
        std::thread::Builder::new()
            .name("devread".into())
            .spawn(move || {
                legacy_loop(fs, fd, &st);
                unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
            })
            .unwrap();
    } else {
        assert!(!args.uring, "uring requested but not negotiated");
        eprintln!("legacy: {} threads", args.threads);
        for t in 0..args.threads {
            let tfd = if t == 0 { fd } else { clone_fd(fd) };
            let st = new_stats(&format!("t{t}"));
            std::thread::Builder::new()
                .name(format!("fuse{t}"))
                .spawn(move || {
                    legacy_loop(fs, tfd, &st);
                    unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
                })
                .unwrap();
        }
    }
    eprintln!("ready");

    loop {
        let mut sig: libc::c_int = 0;
        unsafe { libc::sigwait(&sigs, &mut sig) };
        if sig == libc::SIGUSR1 {
            dump_stats();
            continue;
        }
        break;
    }
    dump_stats();
    let r = unsafe { libc::umount2(mnt.as_ptr(), 0) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            eprintln!("umount: {e}; detaching");
            unsafe { libc::umount2(mnt.as_ptr(), libc::MNT_DETACH) };
        }
    }
    let _ = std::io::stderr().flush();
    std::process::exit(0);
}
