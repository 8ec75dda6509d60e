//! A TCP proxy the tests own, put between a mount and its export to inject network faults.
//!
//! [`FaultProxy`] listens on `127.0.0.1:0` and forwards every connection to one target. The
//! test switches faults on and off from its own (blocking) thread:
//!
//! * [`FaultProxy::reset_all`]: reset (RST, `SO_LINGER` 0) every connection open now — one
//!   reset, as when a NAT or a load balancer drops its state;
//! * [`FaultProxy::set_resetting`]: while on, every new connection is reset as soon as it is
//!   accepted and every open one at its next byte (a few seconds of resets);
//! * [`FaultProxy::set_blackhole`]: while on, connections are accepted but nothing is
//!   forwarded in either direction; what was sent waits (TCP retransmits it) and goes through
//!   once the blackhole ends, unless the client gave up first;
//! * [`FaultProxy::set_delay`]: every chunk waits this long before it is forwarded;
//! * [`FaultProxy::hold`]: hold the answer to the next request whose bytes contain a pattern
//!   (`"POST /v1/exports/x/commit"`, `"GET /v1/exports/x/events"`): the request reaches the
//!   export, the answer does not reach the client until the test releases it — or resets the
//!   connection instead, so the client never learns what happened;
//! * [`FaultProxy::reset_matching`]: reset the connections whose last request contained a
//!   pattern (the event stream, say), and no other.
//!
//! It also counts, for the side it stands in for: [`FaultProxy::count_answers_to`] counts
//! the requests whose head contains a pattern and the bytes answered to them (headers
//! included), so a test can check what a client says it received against what was sent.
//!
//! Requests are told apart by their bytes only: a connection's "last request" is the last
//! chunk from the client that starts with an HTTP method. That is enough for the data
//! plane's clients, which never pipeline.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

/// The faults switched on now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Faults {
    blackhole: bool,
    resetting: bool,
    delay: Duration,
}

/// One open connection, as the proxy's control side sees it.
struct ConnEntry {
    /// The head of the last request the client sent on it.
    last_request: Arc<Mutex<String>>,
    /// Notified to reset it.
    kill: Arc<Notify>,
}

#[derive(Default)]
struct Shared {
    conns: Mutex<HashMap<u64, ConnEntry>>,
    holds: Mutex<Vec<Arc<HoldInner>>>,
    next_id: AtomicU64,
    accepted: AtomicU64,
    resets: AtomicU64,
    /// What [`FaultProxy::count_answers_to`] counts.
    count_pattern: Mutex<Option<String>>,
    counted_requests: AtomicU64,
    counted_bytes: AtomicU64,
}

impl Shared {
    /// Whether a request whose head is `head` is counted.
    fn counts(&self, head: &str) -> bool {
        self.count_pattern
            .lock()
            .as_deref()
            .is_some_and(|p| head.contains(p))
    }
}

/// A fault-injecting TCP proxy with its own runtime; dropping it stops it and closes every
/// connection.
pub struct FaultProxy {
    addr: SocketAddr,
    target: SocketAddr,
    faults: watch::Sender<Faults>,
    shared: Arc<Shared>,
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("target", &self.target)
            .field("faults", &*self.faults.borrow())
            .finish_non_exhaustive()
    }
}

impl FaultProxy {
    /// Listen on a free loopback port and forward to `target`.
    pub fn start(target: SocketAddr) -> std::io::Result<FaultProxy> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fault-proxy")
            .enable_all()
            .build()?;
        // Bound without blocking on the runtime: a test may start the proxy from inside
        // its own runtime.
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let listener = {
            let _in_rt = rt.enter();
            TcpListener::from_std(std_listener)?
        };
        let (faults, _) = watch::channel(Faults::default());
        let shared = Arc::new(Shared::default());
        let (rx, sh) = (faults.subscribe(), shared.clone());
        rt.spawn(accept_loop(listener, target, rx, sh));
        Ok(FaultProxy {
            addr,
            target,
            faults,
            shared,
            rt: Some(rt),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`, for a mount's endpoint.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Reset every connection open now.
    pub fn reset_all(&self) -> usize {
        self.reset_where(|_| true)
    }

    /// Reset the connections whose last request contains `pattern`; returns how many.
    pub fn reset_matching(&self, pattern: &str) -> usize {
        self.reset_where(|req| req.contains(pattern))
    }

    fn reset_where(&self, f: impl Fn(&str) -> bool) -> usize {
        let conns = self.shared.conns.lock();
        let mut n = 0;
        for c in conns.values() {
            if f(&c.last_request.lock()) {
                c.kill.notify_one();
                n += 1;
            }
        }
        n
    }

    /// Switch "reset everything" on or off.
    pub fn set_resetting(&self, on: bool) {
        self.faults.send_modify(|f| f.resetting = on);
        if on {
            self.reset_all();
        }
    }

    /// Switch the blackhole on or off.
    pub fn set_blackhole(&self, on: bool) {
        self.faults.send_modify(|f| f.blackhole = on);
    }

    /// Delay every forwarded chunk by `delay` (zero: no delay).
    pub fn set_delay(&self, delay: Duration) {
        self.faults.send_modify(|f| f.delay = delay);
    }

    /// Switch every fault off (held answers stay held until released).
    pub fn heal(&self) {
        self.faults.send_replace(Faults::default());
    }

    /// Hold the answer to the next request containing `pattern`.
    pub fn hold(&self, pattern: &str) -> Hold {
        let inner = Arc::new(HoldInner {
            pattern: pattern.as_bytes().to_vec(),
            state: Mutex::new(HoldState::Armed),
            cv: Condvar::new(),
            wake: Notify::new(),
        });
        self.shared.holds.lock().push(inner.clone());
        Hold { inner }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Connections reset so far.
    pub fn resets(&self) -> u64 {
        self.shared.resets.load(Ordering::Relaxed)
    }

    /// From now on, count the requests whose head (the request line) contains `pattern`
    /// and the bytes answered to them ([`FaultProxy::counted`]).
    pub fn count_answers_to(&self, pattern: &str) {
        *self.shared.count_pattern.lock() = Some(pattern.to_owned());
    }

    /// The requests counted so far, and the bytes (headers and bodies) forwarded in
    /// answer to them.
    pub fn counted(&self) -> (u64, u64) {
        (
            self.shared.counted_requests.load(Ordering::Relaxed),
            self.shared.counted_bytes.load(Ordering::Relaxed),
        )
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        for h in self.shared.holds.lock().drain(..) {
            h.set(HoldState::Reset);
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HoldState {
    /// Waiting for a request that matches.
    Armed,
    /// A matching request went through; its answer is held.
    Holding {
        /// Bytes of the answer that arrived and are held.
        answered: bool,
    },
    /// Forward the held answer and everything after it.
    Released,
    /// Reset the connection instead of answering.
    Reset,
}

struct HoldInner {
    pattern: Vec<u8>,
    state: Mutex<HoldState>,
    cv: Condvar,
    wake: Notify,
}

impl HoldInner {
    fn set(&self, s: HoldState) {
        *self.state.lock() = s;
        self.cv.notify_all();
        self.wake.notify_one();
    }
}

/// One held answer (see [`FaultProxy::hold`]). Dropping it releases the answer.
pub struct Hold {
    inner: Arc<HoldInner>,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold")
            .field("pattern", &String::from_utf8_lossy(&self.inner.pattern))
            .field("state", &*self.inner.state.lock())
            .finish()
    }
}

impl Hold {
    /// Wait until a matching request went through and the export's answer (its first
    /// bytes) arrived and is held: the request was handled. False after `timeout`.
    pub fn wait_answered(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.inner.state.lock();
        loop {
            match *st {
                HoldState::Holding { answered: true } => return true,
                HoldState::Released | HoldState::Reset => return false,
                _ => {}
            }
            if self.inner.cv.wait_until(&mut st, deadline).timed_out() {
                return matches!(*st, HoldState::Holding { answered: true });
            }
        }
    }

    /// Wait until a matching request went through (answered or not).
    pub fn wait_matched(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.inner.state.lock();
        while *st == HoldState::Armed {
            if self.inner.cv.wait_until(&mut st, deadline).timed_out() {
                break;
            }
        }
        matches!(*st, HoldState::Holding { .. })
    }

    /// Deliver the held answer.
    pub fn release(self) {
        // Drop releases.
    }

    /// Reset the connection: the client never gets the answer.
    pub fn reset(self) {
        self.inner.set(HoldState::Reset);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut st = self.inner.state.lock();
        if *st != HoldState::Reset {
            *st = HoldState::Released;
        }
        drop(st);
        self.inner.cv.notify_all();
        self.inner.wake.notify_one();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    faults: watch::Receiver<Faults>,
    shared: Arc<Shared>,
) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            return;
        };
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        let _ = inbound.set_nodelay(true);
        if faults.borrow().resetting {
            shared.resets.fetch_add(1, Ordering::Relaxed);
            rst(inbound);
            continue;
        }
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = ConnEntry {
            last_request: Arc::new(Mutex::new(String::new())),
            kill: Arc::new(Notify::new()),
        };
        let (req, kill) = (entry.last_request.clone(), entry.kill.clone());
        shared.conns.lock().insert(id, entry);
        let (faults, shared) = (faults.clone(), shared.clone());
        tokio::spawn(async move {
            let conn = Conn {
                faults,
                shared: shared.clone(),
                last_request: req,
                kill,
                hold: None,
            };
            conn.run(inbound, target).await;
            shared.conns.lock().remove(&id);
        });
    }
}

/// Close `s` with a reset (linger 0), not a FIN.
fn rst(s: TcpStream) {
    let _ = nix::sys::socket::setsockopt(
        &s,
        nix::sys::socket::sockopt::Linger,
        &libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    );
    drop(s);
}

const METHODS: [&[u8]; 5] = [b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD "];

struct Conn {
    faults: watch::Receiver<Faults>,
    shared: Arc<Shared>,
    last_request: Arc<Mutex<String>>,
    kill: Arc<Notify>,
    /// The hold this connection's answers are subject to.
    hold: Option<Arc<HoldInner>>,
}

/// What ended a wait for the faults to allow forwarding.
enum Gate {
    Go,
    Reset,
}

impl Conn {
    async fn run(mut self, mut inbound: TcpStream, target: SocketAddr) {
        // A connection accepted during a blackhole waits for it to end before it reaches
        // the target, as a SYN would be retransmitted.
        if let Gate::Reset = self.gate().await {
            self.shared.resets.fetch_add(1, Ordering::Relaxed);
            rst(inbound);
            return;
        }
        let Ok(mut outbound) = TcpStream::connect(target).await else {
            rst(inbound);
            return;
        };
        let _ = outbound.set_nodelay(true);
        let mut up = vec![0u8; 64 << 10];
        let mut down = vec![0u8; 64 << 10];
        let mut held: Vec<u8> = Vec::new();
        let reset = 'conn: loop {
            let hold = self.hold.clone();
            let settle = {
                let (mut ci, mut co) = inbound.split();
                let (mut si, mut so) = outbound.split();
                tokio::select! {
                    // A reset asked for before the next request arrived wins over
                    // forwarding it (an unbiased select picks at random among ready
                    // branches, and the test that resets then asks saw the answer).
                    biased;
                    _ = self.kill.notified() => break 'conn true,
                    // The hold changed: deliver or reset below.
                    _ = async {
                        match &hold {
                            Some(h) => h.wake.notified().await,
                            None => std::future::pending().await,
                        }
                    } => true,
                    r = ci.read(&mut up) => {
                        let n = match r {
                            Ok(0) | Err(_) => break 'conn false,
                            Ok(n) => n,
                        };
                        let chunk = &up[..n];
                        if METHODS.iter().any(|m| chunk.starts_with(m)) {
                            let head = chunk.split(|b| *b == b'\n').next().unwrap_or_default();
                            let head = String::from_utf8_lossy(head).trim_end().to_string();
                            if self.shared.counts(&head) {
                                self.shared.counted_requests.fetch_add(1, Ordering::Relaxed);
                            }
                            *self.last_request.lock() = head;
                            self.arm_hold(chunk);
                        }
                        if let Gate::Reset = self.gate().await {
                            break 'conn true;
                        }
                        if so.write_all(chunk).await.is_err() {
                            break 'conn false;
                        }
                        false
                    }
                    r = si.read(&mut down) => {
                        let n = match r {
                            Ok(0) | Err(_) => break 'conn false,
                            Ok(n) => n,
                        };
                        let state = hold.as_ref().map(|h| *h.state.lock());
                        match state {
                            Some(HoldState::Holding { .. }) => {
                                let h = hold.as_ref().expect("a hold");
                                *h.state.lock() = HoldState::Holding { answered: true };
                                h.cv.notify_all();
                                held.extend_from_slice(&down[..n]);
                                continue;
                            }
                            Some(HoldState::Reset) => break 'conn true,
                            // Released: what was held goes first.
                            Some(_) => {
                                self.hold = None;
                                if co.write_all(&held).await.is_err() {
                                    break 'conn false;
                                }
                                held.clear();
                            }
                            None => {}
                        }
                        if let Gate::Reset = self.gate().await {
                            break 'conn true;
                        }
                        if co.write_all(&down[..n]).await.is_err() {
                            break 'conn false;
                        }
                        if self.shared.counts(&self.last_request.lock()) {
                            self.shared
                                .counted_bytes
                                .fetch_add(n as u64, Ordering::Relaxed);
                        }
                        false
                    }
                }
            };
            // Settle the hold: released → deliver what was held; reset → cut.
            if settle && let Some(h) = &hold {
                let st = *h.state.lock();
                match st {
                    HoldState::Released => {
                        self.hold = None;
                        if inbound.write_all(&held).await.is_err() {
                            break 'conn false;
                        }
                        held.clear();
                    }
                    HoldState::Reset => break 'conn true,
                    _ => {}
                }
            }
        };
        if reset {
            self.shared.resets.fetch_add(1, Ordering::Relaxed);
            rst(inbound);
            rst(outbound);
        }
    }

    /// Attach the first armed hold whose pattern `chunk` contains to this connection.
    fn arm_hold(&mut self, chunk: &[u8]) {
        if self.hold.is_some() {
            return;
        }
        let holds = self.shared.holds.lock();
        for h in holds.iter() {
            let mut st = h.state.lock();
            if *st == HoldState::Armed
                && chunk
                    .windows(h.pattern.len())
                    .any(|w| w == h.pattern.as_slice())
            {
                *st = HoldState::Holding { answered: false };
                drop(st);
                h.cv.notify_all();
                self.hold = Some(h.clone());
                return;
            }
        }
    }

    /// Wait until the faults let a chunk through: no blackhole, the delay slept. `Reset`
    /// when the connection is to be reset instead.
    async fn gate(&mut self) -> Gate {
        loop {
            let f = *self.faults.borrow_and_update();
            if f.resetting {
                return Gate::Reset;
            }
            if !f.blackhole {
                if !f.delay.is_zero() {
                    tokio::select! {
                        biased;
                        _ = self.kill.notified() => return Gate::Reset,
                        _ = tokio::time::sleep(f.delay) => {}
                    }
                }
                return Gate::Go;
            }
            tokio::select! {
                changed = self.faults.changed() => {
                    if changed.is_err() {
                        return Gate::Reset;
                    }
                }
                _ = self.kill.notified() => return Gate::Reset,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// An echo server: answers each chunk with "re:" + the chunk.
    fn echo_server() -> (SocketAddr, std::thread::JoinHandle<()>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 {
                            return;
                        }
                        let mut out = b"re:".to_vec();
                        out.extend_from_slice(&buf[..n]);
                        if s.write_all(&out).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, h)
    }

    fn ask(s: &mut std::net::TcpStream, what: &str) -> std::io::Result<String> {
        s.write_all(what.as_bytes())?;
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    fn connect(p: &FaultProxy) -> std::net::TcpStream {
        let s = std::net::TcpStream::connect(p.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s
    }

    #[test]
    fn forwards_resets_and_blackholes() {
        let (target, _h) = echo_server();
        let p = FaultProxy::start(target).unwrap();
        let mut a = connect(&p);
        assert_eq!(ask(&mut a, "GET /a").unwrap(), "re:GET /a");
        // One reset: the open connection is cut with RST.
        assert_eq!(p.reset_all(), 1);
        let err = ask(&mut a, "GET /b").unwrap_err();
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
            ),
            "{err}"
        );
        // Resetting: new connections are cut too.
        p.set_resetting(true);
        let mut b = connect(&p);
        assert!(ask(&mut b, "GET /c").is_err());
        p.set_resetting(false);
        // Blackhole: nothing comes back while it lasts; the answer arrives after it.
        let mut c = connect(&p);
        assert_eq!(ask(&mut c, "GET /d").unwrap(), "re:GET /d");
        p.set_blackhole(true);
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let err = ask(&mut c, "GET /e").unwrap_err();
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "{err}"
        );
        p.set_blackhole(false);
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut buf = [0u8; 64];
        let n = c.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"re:GET /e");
    }

    #[test]
    fn holds_one_answer_past_a_newer_request() {
        let (target, _h) = echo_server();
        let p = FaultProxy::start(target).unwrap();
        let hold = p.hold("POST /commit");
        let mut a = connect(&p);
        a.write_all(b"POST /commit 1").unwrap();
        assert!(hold.wait_answered(Duration::from_secs(20)));
        // A newer request on another connection is answered first.
        let mut b = connect(&p);
        assert_eq!(ask(&mut b, "POST /commit 2").unwrap(), "re:POST /commit 2");
        hold.release();
        let mut buf = [0u8; 64];
        let n = a.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"re:POST /commit 1");
        // A held answer that is reset never arrives.
        let hold = p.hold("GET /events");
        let mut c = connect(&p);
        c.write_all(b"GET /events").unwrap();
        assert!(hold.wait_answered(Duration::from_secs(20)));
        hold.reset();
        assert!(matches!(c.read(&mut buf), Ok(0) | Err(_)));
        // Only the matching connection is reset.
        let mut d = connect(&p);
        assert_eq!(ask(&mut d, "GET /events").unwrap(), "re:GET /events");
        let mut e = connect(&p);
        assert_eq!(ask(&mut e, "GET /blocks").unwrap(), "re:GET /blocks");
        assert_eq!(p.reset_matching("GET /events"), 1);
        assert!(ask(&mut d, "GET /events").is_err());
        assert_eq!(ask(&mut e, "GET /blocks").unwrap(), "re:GET /blocks");
    }
}
