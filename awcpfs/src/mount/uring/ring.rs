//! The transports' loops: a ring per CPU (`FUSE_IO_URING_CMD_REGISTER`, then
//! `COMMIT_AND_FETCH`), the `/dev/fuse` reader (`FORGET`, `BATCH_FORGET`, `INTERRUPT`, and
//! every request before the rings are ready or when they are not used), and the worker pool
//! that answers requests which may block (fetches from the export, `fsync`) off the rings'
//! threads: a worker hands its reply back to the ring's thread through an `eventfd` the ring
//! itself waits on, and the ring commits it.

#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use parking_lot::Mutex;

use super::abi::{self, Wire};
use super::dispatch::{Adapter, Reply, Request};

/// A request copied out of its buffer for a worker, and where its reply goes.
pub struct Job {
    header: abi::InHeader,
    arg: Vec<u8>,
    data: Vec<u8>,
    to: ReplyTo,
}

enum ReplyTo {
    /// Written to `/dev/fuse`.
    Dev(Arc<OwnedFd>),
    /// Committed by the ring's thread: entry `idx` of the ring whose mailbox this is.
    Ring { idx: usize, mailbox: Arc<Mailbox> },
}

/// Replies finished by workers for one ring, and the `eventfd` that wakes its thread.
pub struct Mailbox {
    done: Mutex<Vec<(usize, Reply, Vec<u8>)>>,
    wake: OwnedFd,
}

impl Mailbox {
    fn new() -> std::io::Result<Mailbox> {
        // SAFETY: eventfd has no memory arguments; the descriptor is checked and owned here.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mailbox {
            done: Mutex::new(Vec::new()),
            // SAFETY: `fd` is a fresh descriptor nobody else owns.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    fn post(&self, idx: usize, reply: Reply, body: Vec<u8>) {
        self.done.lock().push((idx, reply, body));
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

/// Start `n` workers taking jobs from the returned sender; they end when every sender is
/// dropped (the rings and the reader have ended).
pub fn spawn_workers(
    adapter: &Arc<Adapter>,
    n: usize,
) -> std::io::Result<(Sender<Job>, Vec<std::thread::JoinHandle<()>>)> {
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let rx = Arc::new(Mutex::new(rx));
    let mut threads = Vec::new();
    for i in 0..n.max(1) {
        let adapter = adapter.clone();
        let rx = rx.clone();
        threads.push(
            std::thread::Builder::new()
                .name(format!("awcpfs-fuse-w{i}"))
                .spawn(move || worker(&adapter, &rx))?,
        );
    }
    Ok((tx, threads))
}

fn worker(adapter: &Adapter, rx: &Mutex<Receiver<Job>>) {
    let mut out = Vec::new();
    loop {
        let job = match rx.lock().recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        let req = Request {
            header: job.header,
            arg: &job.arg,
            data: &job.data,
        };
        let handled = adapter.handle(&req, &mut out);
        match job.to {
            ReplyTo::Dev(fd) => write_reply(&fd, job.header.unique, &handled.reply, &out),
            ReplyTo::Ring { idx, mailbox } => {
                mailbox.post(idx, handled.reply, std::mem::take(&mut out));
            }
        }
        // The change counts as in flight until its reply is on its way.
        drop(handled.change);
    }
}

/// Write a reply to `/dev/fuse`; an interrupted or aborted request (`ENOENT`) is not an
/// error worth a line.
pub fn write_reply(fd: &OwnedFd, unique: u64, reply: &Reply, body: &[u8]) {
    let (error, body) = match reply {
        Reply::Ok => (0, body),
        Reply::Err(e) => (-e, &[][..]),
        Reply::None => return,
    };
    let h = abi::OutHeader {
        len: (std::mem::size_of::<abi::OutHeader>() + body.len()) as u32,
        error,
        unique,
    };
    if let Err(e) = writev(fd, &[h.bytes(), body])
        && e.raw_os_error() != Some(libc::ENOENT)
    {
        tracing::debug!(error = %e, "writing a FUSE reply failed");
    }
}

/// One `writev` of `parts` to `fd`.
pub fn writev(fd: &OwnedFd, parts: &[&[u8]]) -> std::io::Result<()> {
    let iov: Vec<libc::iovec> = parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| libc::iovec {
            iov_base: p.as_ptr() as *mut _,
            iov_len: p.len(),
        })
        .collect();
    // SAFETY: every iovec points into a slice that outlives the call.
    let r = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr(), iov.len() as i32) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Read `/dev/fuse` until the connection ends: answer what comes (everything before the
/// rings are ready or without them; afterwards `FORGET`, `BATCH_FORGET`, `INTERRUPT`),
/// handing requests that may block to the workers.
pub fn dev_loop(adapter: &Adapter, fd: &Arc<OwnedFd>, jobs: &Sender<Job>) {
    // The kernel refuses reads into less than a header, a write's argument and max_write.
    let mut buf = vec![0u8; super::dispatch::MAX_WRITE as usize + 4096];
    let mut out = Vec::new();
    loop {
        // SAFETY: reads into a live buffer of the length passed.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR | libc::EAGAIN | libc::ENOENT) => continue,
                // Unmounted or aborted.
                Some(libc::ENODEV) => return,
                _ => {
                    tracing::warn!(error = %e, "reading /dev/fuse failed; the mount stops answering");
                    return;
                }
            }
        }
        let n = n as usize;
        let Some(header) = abi::InHeader::read(&buf[..n]) else {
            tracing::warn!(bytes = n, "a FUSE request shorter than its header; ignored");
            continue;
        };
        let end = (header.len as usize).clamp(std::mem::size_of::<abi::InHeader>(), n);
        let body = &buf[std::mem::size_of::<abi::InHeader>()..end];
        let k = abi::op_in_size(header.opcode).min(body.len());
        let req = Request {
            header,
            arg: &body[..k],
            data: &body[k..],
        };
        if adapter.may_block(&req) {
            let job = Job {
                header,
                arg: req.arg.to_vec(),
                data: req.data.to_vec(),
                to: ReplyTo::Dev(fd.clone()),
            };
            if jobs.send(job).is_err() {
                write_reply(fd, header.unique, &Reply::Err(libc::EIO), &[]);
            }
            continue;
        }
        let handled = adapter.handle(&req, &mut out);
        write_reply(fd, header.unique, &handled.reply, &out);
    }
}

#[repr(C, align(4096))]
struct HeaderBuf([u8; abi::URING_HEADER_SIZE]);

/// One registered entry: the header and payload buffers the kernel writes a request into
/// and reads the reply from, and the iovec that names them.
struct Entry {
    header: Box<HeaderBuf>,
    payload: Vec<u8>,
    iov: Box<[libc::iovec; 2]>,
    commit_id: u64,
}

/// The SQE of a ring command; `iov` (REGISTER) sets `addr` and `len` = 2.
fn cmd_sqe(
    fd: i32,
    cmd_op: u32,
    qid: u16,
    commit_id: u64,
    iov: Option<*const libc::iovec>,
    idx: usize,
) -> squeue::Entry128 {
    let req = abi::UringCmdReq {
        commit_id,
        qid,
        ..Default::default()
    };
    let mut cmd = [0u8; 80];
    cmd[..req.bytes().len()].copy_from_slice(req.bytes());
    let mut b = opcode::UringCmd80::new(types::Fd(fd), cmd_op).cmd(cmd);
    if let Some(p) = iov {
        b = b.addr(Some(p as u64));
    }
    let e = b.build().user_data(idx as u64);
    if iov.is_none() {
        return e;
    }
    // The crate has no setter for `sqe->len`, where the kernel wants the iovec count.
    // SAFETY: `Entry128` is the 128-byte `io_uring_sqe` (repr(C)); `len` is the u32 at byte
    // 24 of the first 64; any bytes are a valid SQE value.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(e) };
    raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
    // SAFETY: as above.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; the call reads it for its length.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::debug!(cpu, error = %std::io::Error::last_os_error(), "cannot pin a FUSE ring's thread");
        }
    }
}

/// The user data of the `eventfd` read.
const WAKE: u64 = u64::MAX;

/// What a ring reports once its entries are registered (or could not be).
pub type Registered = std::result::Result<(), String>;

/// Serve queue `qid` (CPU `qid`) with `depth` entries of `payload` bytes until the
/// connection ends. `ready` gets the registration's outcome.
pub fn ring_loop(
    adapter: &Adapter,
    fd: &Arc<OwnedFd>,
    qid: usize,
    depth: usize,
    payload: usize,
    jobs: &Sender<Job>,
    ready: &Sender<Registered>,
) {
    pin_to_cpu(qid);
    let fail = |what: &str, e: std::io::Error| {
        let _ = ready.send(Err(format!("queue {qid}: {what}: {e}")));
    };
    let mailbox = match Mailbox::new() {
        Ok(m) => Arc::new(m),
        Err(e) => return fail("eventfd", e),
    };
    let sq_size = ((depth + 1) * 2).next_power_of_two() as u32;
    let mut ring: IoUring<squeue::Entry128, cqueue::Entry> = match IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(sq_size)
    {
        Ok(r) => r,
        Err(e) => return fail("io_uring_setup (SQE128)", e),
    };
    let mut ents: Vec<Entry> = (0..depth)
        .map(|_| {
            let mut header = Box::new(HeaderBuf([0u8; abi::URING_HEADER_SIZE]));
            let mut data = vec![0u8; payload];
            let iov = Box::new([
                libc::iovec {
                    iov_base: header.0.as_mut_ptr().cast(),
                    iov_len: abi::URING_HEADER_SIZE,
                },
                libc::iovec {
                    iov_base: data.as_mut_ptr().cast(),
                    iov_len: payload,
                },
            ]);
            Entry {
                header,
                payload: data,
                iov,
                commit_id: 0,
            }
        })
        .collect();
    let raw = fd.as_raw_fd();
    // Leaked: a read the kernel still holds when the ring closes may complete into it.
    let wake_buf: &'static mut [u8; 8] = Box::leak(Box::new([0u8; 8]));
    let wake_sqe = |buf: &mut [u8; 8]| -> squeue::Entry128 {
        opcode::Read::new(types::Fd(mailbox.wake.as_raw_fd()), buf.as_mut_ptr(), 8)
            .build()
            .user_data(WAKE)
            .into()
    };
    {
        let mut sq = ring.submission();
        for (i, e) in ents.iter().enumerate() {
            let sqe = cmd_sqe(
                raw,
                abi::URING_CMD_REGISTER,
                qid as u16,
                0,
                Some(e.iov.as_ptr()),
                i,
            );
            // SAFETY: the iovecs and the buffers they name live in `ents`, which outlives
            // the ring's use of them (leaked below if the kernel may still hold them).
            if unsafe { sq.push(&sqe) }.is_err() {
                drop(sq);
                std::mem::forget(ents);
                return fail("submission queue", std::io::Error::other("full"));
            }
        }
        // SAFETY: `wake_buf` is never freed.
        let _ = unsafe { sq.push(&wake_sqe(wake_buf)) };
    }
    if let Err(e) = ring.submit() {
        std::mem::forget(ents);
        return fail("register", e);
    }
    // A refused registration completes at once; an accepted one only when a request comes.
    let refused: Vec<i32> = ring
        .completion()
        .filter(|c| c.user_data() != WAKE && c.result() < 0)
        .map(|c| -c.result())
        .collect();
    if let Some(e) = refused.first() {
        // Entries the kernel accepted still point at these buffers: keep them.
        std::mem::forget(ents);
        return fail(
            "FUSE_IO_URING_CMD_REGISTER",
            std::io::Error::from_raw_os_error(*e),
        );
    }
    let _ = ready.send(Ok(()));

    let mut live = depth;
    let mut out = Vec::new();
    let mut changes = Vec::new();
    let mut pending: Vec<squeue::Entry128> = Vec::with_capacity(depth + 1);
    let mut done: Vec<(u64, i32)> = Vec::with_capacity(depth + 1);
    while live > 0 {
        // A change is in flight until its commit is submitted.
        let r = ring.submit_and_wait(1);
        changes.clear();
        match r {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => {
                tracing::warn!(qid, error = %e, "io_uring_enter failed; this FUSE ring stops");
                std::mem::forget(ents);
                return;
            }
        }
        done.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        for (ud, res) in done.drain(..) {
            if ud == WAKE {
                if res < 0 {
                    // Cancelled as the ring goes away, or the eventfd is unusable: workers'
                    // replies can no longer be committed here (their requests fail when the
                    // connection ends).
                    if res != -libc::ECANCELED {
                        tracing::warn!(qid, error = %std::io::Error::from_raw_os_error(-res),
                            "a FUSE ring lost its wake-up; replies from workers wait");
                    }
                    continue;
                }
                let replies = std::mem::take(&mut *mailbox.done.lock());
                for (idx, reply, body) in replies {
                    let Some(e) = ents.get_mut(idx) else { continue };
                    pending.push(commit(e, raw, qid, idx, &reply, &body));
                }
                pending.push(wake_sqe(wake_buf));
                continue;
            }
            let idx = ud as usize;
            if res < 0 {
                // The connection ended (ENOTCONN) or the ring is going away.
                live -= 1;
                if !matches!(-res, libc::ENOTCONN | libc::ECANCELED | libc::ENODEV) {
                    tracing::warn!(qid, error = %std::io::Error::from_raw_os_error(-res),
                        "a FUSE ring entry failed");
                }
                continue;
            }
            let Some(e) = ents.get_mut(idx) else { continue };
            let ent =
                abi::UringEntInOut::read(&e.header.0[abi::URING_ENT_IN_OUT..]).unwrap_or_default();
            e.commit_id = ent.commit_id;
            let Some(header) = abi::InHeader::read(&e.header.0) else {
                continue;
            };
            let len = (ent.payload_sz as usize).min(e.payload.len());
            let req = Request {
                header,
                arg: &e.header.0[abi::URING_OP_IN..abi::URING_ENT_IN_OUT],
                data: &e.payload[..len],
            };
            if adapter.may_block(&req) {
                let job = Job {
                    header,
                    arg: req.arg.to_vec(),
                    data: req.data.to_vec(),
                    to: ReplyTo::Ring {
                        idx,
                        mailbox: mailbox.clone(),
                    },
                };
                if jobs.send(job).is_err() {
                    pending.push(commit(e, raw, qid, idx, &Reply::Err(libc::EIO), &[]));
                }
                continue;
            }
            let handled = adapter.handle(&req, &mut out);
            pending.push(commit(e, raw, qid, idx, &handled.reply, &out));
            if let Some(c) = handled.change {
                changes.push(c);
            }
        }
        let mut sq = ring.submission();
        for sqe in pending.drain(..) {
            // SAFETY: commits name no buffers (the entry's were registered); the wake read's
            // buffer lives until the loop ends. The queue holds depth + 1 entries.
            if unsafe { sq.push(&sqe) }.is_err() {
                tracing::error!(qid, "FUSE ring submission queue full; a reply is lost");
            }
        }
    }
    tracing::debug!(qid, "FUSE ring ended");
}

/// Write the reply into entry `e` and make its commit-and-fetch SQE.
fn commit(
    e: &mut Entry,
    fd: i32,
    qid: usize,
    idx: usize,
    reply: &Reply,
    body: &[u8],
) -> squeue::Entry128 {
    let unique = abi::InHeader::read(&e.header.0).map_or(0, |h| h.unique);
    let (error, n) = match reply {
        Reply::Ok if body.len() <= e.payload.len() => (0, body.len()),
        Reply::Ok => (-libc::EIO, 0),
        Reply::Err(code) => (-code, 0),
        Reply::None => (0, 0),
    };
    e.payload[..n].copy_from_slice(&body[..n]);
    let h = abi::OutHeader {
        len: (std::mem::size_of::<abi::OutHeader>() + n) as u32,
        error,
        unique,
    };
    e.header.0[..h.bytes().len()].copy_from_slice(h.bytes());
    let mut ent =
        abi::UringEntInOut::read(&e.header.0[abi::URING_ENT_IN_OUT..]).unwrap_or_default();
    ent.payload_sz = n as u32;
    e.header.0[abi::URING_ENT_IN_OUT..].copy_from_slice(ent.bytes());
    cmd_sqe(
        fd,
        abi::URING_CMD_COMMIT_AND_FETCH,
        qid as u16,
        e.commit_id,
        None,
        idx,
    )
}
