//! Write-back under reordering: deterministic regressions for the two ways a connection
//! reset between `awcpfs mount` and the export used to roll back or lose what `close` had
//! acknowledged. A TCP proxy owned by the test sits between the two (the real wire) and can
//! hold one answer, then forward it late or reset its connection.
//!
//! 1. The event stream's catch-up after a reconnect, held past a newer commit of the same
//!    file, must not roll the file back on the mount (nor make a conflict copy later).
//! 2. A commit applied at the export whose answer never reached the mount (reset, or the
//!    mount killed with `kill -9`, then `awcpfs recover`) must not be judged again as a
//!    conflict with the mount's own later changes: the newest content lands, a deleted file
//!    stays deleted.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcp_protocol::TransportHandle;
use awcp_protocol::transport::AwcpfsHandle;
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::testing::fuse_available;
use parking_lot::{Condvar, Mutex};

const BIN: &str = env!("CARGO_BIN_EXE_awcpfs");
const EXPORT_ID: &str = "integrity";
const TOKEN: &str = "tok";
/// Generous: the machine running the tests may be loaded.
const PATIENCE: Duration = Duration::from_secs(30);

/// What the request a connection carries now is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Req {
    Other,
    Commit,
    Events,
}

/// What to do with a held answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    /// Send it on, late.
    Forward,
    /// Reset its connection (RST both ways): the answer never arrives.
    Reset,
}

#[derive(Default)]
struct ProxyState {
    /// Hold the next answer to this kind of request.
    armed: Option<Req>,
    /// The answer held so far.
    held: Option<Vec<u8>>,
    release: Option<Release>,
    /// Commit answers passed on to the mount.
    commits_answered: usize,
    /// The request line of every event-stream connect.
    event_requests: Vec<String>,
    /// Everything the event streams passed on to the mount.
    event_data: Vec<u8>,
    /// Live connections: the request kind, and both sockets (to reset them).
    conns: Vec<(Arc<Mutex<Req>>, TcpStream, TcpStream)>,
}

/// A TCP proxy that can hold one answer (to a commit, or to an event stream's connect)
/// until told to forward it or reset its connection.
struct Proxy {
    addr: SocketAddr,
    ctl: Arc<(Mutex<ProxyState>, Condvar)>,
    stop: Arc<AtomicBool>,
}

fn reset(s: &TcpStream) {
    // Linger 0: closing sends RST instead of FIN.
    let _ = nix::sys::socket::setsockopt(
        s,
        nix::sys::socket::sockopt::Linger,
        &libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    );
    let _ = s.shutdown(std::net::Shutdown::Both);
}

impl Proxy {
    fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let ctl: Arc<(Mutex<ProxyState>, Condvar)> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s) = (ctl.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        if let Ok(up) = TcpStream::connect(target) {
                            Self::serve(client, up, c.clone());
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Proxy { addr, ctl, stop }
    }

    fn serve(client: TcpStream, up: TcpStream, ctl: Arc<(Mutex<ProxyState>, Condvar)>) {
        let _ = client.set_nodelay(true);
        let _ = up.set_nodelay(true);
        // Short reads upstream, so a held answer can be released while nothing arrives.
        let _ = up.set_read_timeout(Some(Duration::from_millis(20)));
        let kind = Arc::new(Mutex::new(Req::Other));
        ctl.0.lock().conns.push((
            kind.clone(),
            client.try_clone().unwrap(),
            up.try_clone().unwrap(),
        ));
        // Client to export: note what each request is, then pass it on.
        let (mut from, mut to, k, ctl_in) = (
            client.try_clone().unwrap(),
            up.try_clone().unwrap(),
            kind.clone(),
            ctl.clone(),
        );
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let chunk = &buf[..n];
                if chunk.starts_with(b"GET ") || chunk.starts_with(b"POST ") {
                    let line_end = chunk.iter().position(|b| *b == b'\n').unwrap_or(n);
                    let line = String::from_utf8_lossy(&chunk[..line_end]);
                    *k.lock() = if line.contains("/commit ") {
                        Req::Commit
                    } else if line.contains("/events") {
                        let (st, cv) = &*ctl_in;
                        st.lock().event_requests.push(line.trim_end().to_owned());
                        cv.notify_all();
                        Req::Events
                    } else {
                        Req::Other
                    };
                }
                if to.write_all(chunk).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(std::net::Shutdown::Write);
        });
        // Export to client: pass on, or hold the armed answer until released.
        let (mut from, mut to) = (up, client);
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            let mut holding: Option<Vec<u8>> = None;
            loop {
                match from.read(&mut buf) {
                    Ok(0) => {
                        if holding.is_none() {
                            let _ = to.shutdown(std::net::Shutdown::Write);
                            return;
                        }
                    }
                    Ok(n) => {
                        let chunk = &buf[..n];
                        let mut st = ctl.0.lock();
                        if let Some(h) = holding.as_mut() {
                            h.extend_from_slice(chunk);
                            st.held = Some(h.clone());
                            ctl.1.notify_all();
                        } else if st.armed.is_some() && st.armed == Some(*kind.lock()) {
                            st.armed = None;
                            holding = Some(chunk.to_vec());
                            st.held = holding.clone();
                            ctl.1.notify_all();
                        } else {
                            drop(st);
                            if to.write_all(chunk).is_err() {
                                return;
                            }
                            if *kind.lock() == Req::Commit && chunk.ends_with(b"}") {
                                ctl.0.lock().commits_answered += 1;
                                ctl.1.notify_all();
                            }
                            if *kind.lock() == Req::Events {
                                ctl.0.lock().event_data.extend_from_slice(chunk);
                                ctl.1.notify_all();
                            }
                        }
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => {
                        if holding.is_none() {
                            let _ = to.shutdown(std::net::Shutdown::Write);
                            return;
                        }
                    }
                }
                if let Some(h) = &holding {
                    let mut st = ctl.0.lock();
                    match st.release.take() {
                        None => {
                            drop(st);
                            // The answer is complete or the export closed: wait for the
                            // release without spinning on reads.
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Some(Release::Forward) => {
                            st.held = None;
                            ctl.1.notify_all();
                            drop(st);
                            if to.write_all(h).is_err() {
                                return;
                            }
                            holding = None;
                        }
                        Some(Release::Reset) => {
                            st.held = None;
                            ctl.1.notify_all();
                            drop(st);
                            reset(&to);
                            reset(&from);
                            return;
                        }
                    }
                }
            }
        });
    }

    /// Commit answers passed on so far.
    fn commits_answered(&self) -> usize {
        self.ctl.0.lock().commits_answered
    }

    /// Wait until more than `n` commit answers were passed on.
    fn wait_commits_answered(&self, n: usize) {
        let deadline = Instant::now() + PATIENCE;
        let mut st = self.ctl.0.lock();
        while st.commits_answered <= n {
            assert!(
                !self.ctl.1.wait_until(&mut st, deadline).timed_out(),
                "timed out waiting for a commit's answer to reach the mount"
            );
        }
    }

    /// Wait until `n` event-stream connects were seen; returns their request lines. The
    /// mount's one-shot read of the AECP findings at start (`since=` the largest sequence:
    /// no changes, only the findings and their end marker) is not an event stream of the
    /// mount's and is left out.
    fn wait_event_requests(&self, n: usize) -> Vec<String> {
        let streams = |all: &[String]| -> Vec<String> {
            let preload = format!("since={}", u64::MAX);
            all.iter()
                .filter(|r| !r.contains(&preload))
                .cloned()
                .collect()
        };
        let deadline = Instant::now() + PATIENCE;
        let mut st = self.ctl.0.lock();
        while streams(&st.event_requests).len() < n {
            assert!(
                !self.ctl.1.wait_until(&mut st, deadline).timed_out(),
                "timed out waiting for event-stream connect {n}"
            );
        }
        streams(&st.event_requests)
    }

    /// Wait until what the event streams passed on to the mount contains `needle`.
    fn wait_event_data(&self, needle: &str) {
        let deadline = Instant::now() + PATIENCE;
        let mut st = self.ctl.0.lock();
        while !String::from_utf8_lossy(&st.event_data).contains(needle) {
            assert!(
                !self.ctl.1.wait_until(&mut st, deadline).timed_out(),
                "timed out waiting for an event mentioning {needle}"
            );
        }
    }

    /// Hold the next answer to a request of this kind.
    fn arm(&self, kind: Req) {
        self.ctl.0.lock().armed = Some(kind);
    }

    /// Wait until an answer is held and `ready` says it has all that is wanted.
    fn wait_held(&self, what: &str, ready: impl Fn(&[u8]) -> bool) {
        let deadline = Instant::now() + PATIENCE;
        let mut st = self.ctl.0.lock();
        while !st.held.as_deref().is_some_and(&ready) {
            assert!(
                !self.ctl.1.wait_until(&mut st, deadline).timed_out(),
                "timed out waiting for the proxy to hold {what}"
            );
        }
    }

    /// Let the held answer go (late), or reset its connection; returns once it is done.
    fn release(&self, how: Release) {
        let deadline = Instant::now() + PATIENCE;
        let mut st = self.ctl.0.lock();
        st.release = Some(how);
        while st.held.is_some() {
            assert!(
                !self.ctl.1.wait_until(&mut st, deadline).timed_out(),
                "timed out releasing the held answer"
            );
        }
    }

    /// Reset every event-stream connection.
    fn reset_event_streams(&self) {
        for (kind, client, up) in &self.ctl.0.lock().conns {
            if *kind.lock() == Req::Events {
                reset(client);
                reset(up);
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let mut st = self.ctl.0.lock();
        st.release = Some(Release::Reset);
        for (_, client, up) in &st.conns {
            let _ = client.shutdown(std::net::Shutdown::Both);
            let _ = up.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn is_mounted(p: &Path) -> bool {
    let s = p.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(s.as_str()))
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An `awcpfs mount` process: unmounted (after its final flush) when dropped, killed and
/// lazily unmounted if it does not go.
struct MountProc {
    child: Option<Child>,
    mnt: PathBuf,
}

impl MountProc {
    fn kill_9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
    }
}

impl Drop for MountProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGINT,
            );
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(15) {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if is_mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
    }
}

/// An export of `src` in this process, a proxy in front of it, and `awcpfs mount` through
/// the proxy. Dropped in this order: the mount (its final flush needs the proxy and the
/// export), the proxy, the export, the directories.
struct Setup {
    mount: MountProc,
    proxy: Proxy,
    _rt: tokio::runtime::Runtime,
    src: PathBuf,
    mnt: PathBuf,
    /// A handle with the export's own address (not through the proxy), for recovery.
    direct_handle: PathBuf,
    tmp: tempfile::TempDir,
}

fn write_handle(path: &Path, endpoint: String, digest: String) {
    let handle = TransportHandle::Awcpfs(AwcpfsHandle {
        endpoint,
        token: TOKEN.into(),
        export_id: EXPORT_ID.into(),
        manifest_digest: digest,
        block_size: 1 << 20,
        expires_at: "2099-01-01T00:00:00.000Z".into(),
        tls_fingerprint: None,
        remaining_ms: None,
        resources: None,
    });
    std::fs::write(path, serde_json::to_vec(&handle).unwrap()).unwrap();
}

fn setup(files: &[(&str, &str)]) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    for (name, content) in files {
        std::fs::write(src.join(name), content).unwrap();
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let registry = ExportRegistry::new();
    let lease = Arc::new(Lease::grant(
        Arc::new(SystemClock::new()),
        LeaseTerms {
            ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(600),
            flush_grace: Duration::from_secs(10),
        },
    ));
    let export = registry
        .register(
            EXPORT_ID.into(),
            TOKEN.into(),
            ExportConfig {
                root: src.clone(),
                read_only: false,
                block_size: 1 << 20,
                staging_dir: tmp.path().join("staging"),
            },
            lease,
        )
        .unwrap();
    let export_addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        let router = registry.router();
        tokio::spawn(async move { axum::serve(l, router).await });
        a
    });
    let proxy = Proxy::start(export_addr);
    let handle = tmp.path().join("handle.json");
    write_handle(
        &handle,
        format!("http://{}", proxy.addr),
        export.manifest_digest(),
    );
    let direct_handle = tmp.path().join("direct-handle.json");
    write_handle(
        &direct_handle,
        format!("http://{export_addr}"),
        export.manifest_digest(),
    );
    let child = Command::new(BIN)
        .arg("mount")
        .arg(&handle)
        .arg(&mnt)
        .arg("--state-dir")
        .arg(tmp.path().join("mount-state"))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mount = MountProc {
        child: Some(child),
        mnt: mnt.clone(),
    };
    wait_for("the mount", || is_mounted(&mnt));
    Setup {
        tmp,
        src,
        mnt,
        proxy,
        direct_handle,
        mount,
        _rt: rt,
    }
}

impl Setup {
    /// `awcpfs recover` of the killed mount's state, straight to the export.
    fn recover(&self) -> String {
        let out = Command::new(BIN)
            .arg("recover")
            .arg(&self.direct_handle)
            .arg("--state-dir")
            .arg(self.tmp.path().join("mount-state"))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "recover failed: {said}");
        said
    }

    /// Conflict copies at the Delegator.
    fn conflict_copies(&self) -> Vec<String> {
        std::fs::read_dir(&self.src)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".awcp-conflict-"))
            .collect()
    }

    fn at_delegator(&self, name: &str) -> Option<String> {
        std::fs::read_to_string(self.src.join(name)).ok()
    }
}

fn write_file(path: &Path, content: &str) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(content.as_bytes()).unwrap();
    f.sync_all().unwrap();
}

// Mechanism 1: after `printf v1 > x`, the event stream is reset and its reconnect answer
// (a catch-up listing x as v1, the mount's own commit) held while the mount writes v2;
// released late, it rolled x back to v1 on the mount, and the next append made the
// Delegator keep v2 and put "v1 more" in a conflict copy.
#[test]
fn a_late_catch_up_does_not_roll_back_a_newer_commit() {
    if !fuse_available() {
        return;
    }
    let s = setup(&[("README", "hello\n")]);
    write_file(&s.mnt.join("x"), "v1\n");
    wait_for("v1 at the Delegator", || {
        s.at_delegator("x").as_deref() == Some("v1\n")
    });

    s.proxy.arm(Req::Events);
    s.proxy.reset_event_streams();
    // The reconnect's first answer, with the catch-up that lists x (as v1), is held.
    s.proxy.wait_held("the catch-up", |b| {
        String::from_utf8_lossy(b).contains("\"changed\"")
    });

    write_file(&s.mnt.join("x"), "v2\n");
    wait_for("v2 at the Delegator", || {
        s.at_delegator("x").as_deref() == Some("v2\n")
    });

    s.proxy.release(Release::Forward);
    // A Delegator-side change after the catch-up, on the same stream: once it shows on the
    // mount, the catch-up before it was handled.
    std::fs::write(s.src.join("marker"), "m\n").unwrap();
    wait_for("the marker on the mount", || s.mnt.join("marker").exists());

    assert_eq!(
        std::fs::read_to_string(s.mnt.join("x")).unwrap(),
        "v2\n",
        "the late catch-up rolled x back on the mount"
    );
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(s.mnt.join("x"))
        .unwrap();
    f.write_all(b"more\n").unwrap();
    f.sync_all().unwrap();
    drop(f);
    wait_for("the append at the Delegator, or a conflict", || {
        s.at_delegator("x").as_deref() == Some("v2\nmore\n") || !s.conflict_copies().is_empty()
    });
    assert_eq!(s.at_delegator("x").as_deref(), Some("v2\nmore\n"));
    assert!(s.conflict_copies().is_empty(), "{:?}", s.conflict_copies());
}

/// What the application does after the commit whose answer is held.
#[derive(Debug, Clone, Copy)]
enum Then {
    /// Writes the file again (v3).
    Rewrite,
    /// Deletes it.
    Delete,
}

/// How the held answer is lost.
#[derive(Debug, Clone, Copy)]
enum Lost {
    /// The connection is reset; the mount retries.
    Reset,
    /// The mount is killed (`kill -9`); `awcpfs recover` follows.
    Kill,
}

/// Mechanism 2: x goes from v1 to v2 in a commit the export applies but whose answer is
/// held; the application then writes v3 (or deletes x); the answer is lost. The retry (or
/// the recovery) used to compare from v1 and meet the mount's own v2 at the export as a
/// Delegator-side change: a conflict keeping v2 at the path, or x brought back.
fn commit_answer_lost(then: Then, lost: Lost) {
    if !fuse_available() {
        return;
    }
    let mut s = setup(&[("README", "hello\n")]);
    let answered = s.proxy.commits_answered();
    write_file(&s.mnt.join("x"), "v1\n");
    // Not only applied: answered, so the next answer held is the next commit's.
    s.proxy.wait_commits_answered(answered);
    assert_eq!(s.at_delegator("x").as_deref(), Some("v1\n"));

    s.proxy.arm(Req::Commit);
    write_file(&s.mnt.join("x"), "v2\n");
    // The commit is applied, its answer (a complete JSON body) held.
    s.proxy
        .wait_held("the commit's answer", |b| b.ends_with(b"}"));
    assert_eq!(s.at_delegator("x").as_deref(), Some("v2\n"));

    match then {
        Then::Rewrite => write_file(&s.mnt.join("x"), "v3\n"),
        Then::Delete => std::fs::remove_file(s.mnt.join("x")).unwrap(),
    }
    let expected = match then {
        Then::Rewrite => Some("v3\n".to_string()),
        Then::Delete => None,
    };
    match lost {
        Lost::Reset => {
            s.proxy.release(Release::Reset);
            wait_for("the newest state at the Delegator, or a conflict", || {
                s.at_delegator("x") == expected || !s.conflict_copies().is_empty()
            });
        }
        Lost::Kill => {
            s.mount.kill_9();
            s.proxy.release(Release::Reset);
            let said = s.recover();
            eprintln!("{said}");
        }
    }
    assert_eq!(
        s.at_delegator("x"),
        expected,
        "the Delegator does not have the newest state of x"
    );
    assert!(
        s.conflict_copies().is_empty(),
        "the mount's own change became a conflict: {:?}",
        s.conflict_copies()
    );
    if let Lost::Reset = lost {
        // And it stays so: the mount agrees, and a later change goes through cleanly.
        write_file(&s.mnt.join("after"), "after\n");
        wait_for("a later commit", || {
            s.at_delegator("after").as_deref() == Some("after\n")
        });
        assert_eq!(s.at_delegator("x"), expected);
        assert_eq!(std::fs::read_to_string(s.mnt.join("x")).ok(), expected);
        assert!(s.conflict_copies().is_empty(), "{:?}", s.conflict_copies());
    }
}

#[test]
fn a_commit_answer_lost_to_a_reset_is_retried_without_conflict_then_rewrite() {
    commit_answer_lost(Then::Rewrite, Lost::Reset);
}

#[test]
fn a_commit_answer_lost_to_a_reset_is_retried_without_conflict_then_delete() {
    commit_answer_lost(Then::Delete, Lost::Reset);
}

#[test]
fn a_commit_answer_lost_to_kill_9_is_recovered_without_conflict_then_rewrite() {
    commit_answer_lost(Then::Rewrite, Lost::Kill);
}

#[test]
fn a_commit_answer_lost_to_kill_9_is_recovered_without_conflict_then_delete() {
    commit_answer_lost(Then::Delete, Lost::Kill);
}

// The fault matrix's "came back after its acknowledged removal": a file created on the
// mount goes out in a commit the export applies but whose answer is lost (held, then
// reset); the application removes the file meanwhile. The catch-up of a reconnected event
// stream, listing that commit's change, reached the mount while the commit was still
// pending, and because the file was
// neither on the mount nor in what the syncer knew the export to have, the mount took it
// for a Delegator-side creation and brought the file back, on the mount and (the retry then
// finding nothing to remove) at the Delegator.
#[test]
fn an_event_of_a_pending_commit_does_not_bring_back_a_file_removed_since() {
    if !fuse_available() {
        return;
    }
    let s = setup(&[("README", "hello\n")]);
    assert_eq!(s.proxy.wait_event_requests(1).len(), 1);
    s.proxy.arm(Req::Commit);
    write_file(&s.mnt.join("born"), "v1\n");
    // Applied at the export, its answer held.
    s.proxy
        .wait_held("the commit's answer", |b| b.ends_with(b"}"));
    assert_eq!(s.at_delegator("born").as_deref(), Some("v1\n"));
    // Removed on the mount (acknowledged). The event stream is reset: its reconnect's
    // catch-up lists the commit's change (a live stream does not hand a mount its own
    // commits back; a catch-up does) while the commit is still pending.
    std::fs::remove_file(s.mnt.join("born")).unwrap();
    s.proxy.reset_event_streams();
    s.proxy.wait_event_data("\"born\"");
    // The answer is lost; the syncer sends the commit again, then the removal.
    s.proxy.release(Release::Reset);
    // Written after the removal: once it lands, the removal was sent before it or with it.
    write_file(&s.mnt.join("after"), "after\n");
    wait_for("a later commit", || {
        s.at_delegator("after").as_deref() == Some("after\n")
    });
    assert!(
        !s.mnt.join("born").exists(),
        "the removed file came back on the mount"
    );
    assert_eq!(s.at_delegator("born"), None);
    assert!(s.conflict_copies().is_empty(), "{:?}", s.conflict_copies());
}

// A reconnect of the event stream used to replay every change since the export started
// (the mount's own commits included); it must resume after the changes the mount has.
#[test]
fn a_reconnect_resumes_the_catch_up_after_what_the_mount_has() {
    if !fuse_available() {
        return;
    }
    let s = setup(&[("README", "hello\n")]);
    assert_eq!(s.proxy.wait_event_requests(1).len(), 1);
    // Two Delegator-side changes, each seen on the mount: the first one's sequence is
    // known complete once the second arrives.
    std::fs::write(s.src.join("d1"), "one\n").unwrap();
    wait_for("d1 on the mount", || s.mnt.join("d1").exists());
    std::fs::write(s.src.join("d2"), "two\n").unwrap();
    wait_for("d2 on the mount", || s.mnt.join("d2").exists());

    s.proxy.reset_event_streams();
    let requests = s.proxy.wait_event_requests(2);
    let since: u64 = requests[1]
        .split("since=")
        .nth(1)
        .and_then(|rest| rest.split([' ', '&']).next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("the reconnect did not resume: {}", requests[1]));
    assert!(since > 0, "{}", requests[1]);
    // And the resumed stream carries what comes next.
    std::fs::write(s.src.join("d3"), "three\n").unwrap();
    wait_for("d3 on the mount", || s.mnt.join("d3").exists());
    assert_eq!(std::fs::read_to_string(s.mnt.join("d2")).unwrap(), "two\n");
}
