//! Who is on the other end of a daemon API connection, as the kernel says.
//!
//! The daemon's own user needs no token on its machine, and no one else gets one by looking
//! (`ps` shows every process's argv to every user). So each connection to the daemon API is
//! named by the kernel, once, when it is accepted:
//!
//! * over the Unix socket (`<state-dir>/api.sock`): the peer's credentials
//!   (`SO_PEERCRED`), taken by the kernel at `connect()`;
//! * over loopback TCP: the owner uid of the *peer's* socket, which the kernel reports
//!   through sock_diag (`NETLINK_SOCK_DIAG`, an `inet_diag_req_v2` for the exact 4-tuple,
//!   seen from the peer's side: its source is our peer address, its destination our local
//!   address). Only a socket that is still `ESTABLISHED` and has an inode counts: a socket
//!   that has been closed lingers as a time-wait entry, which the kernel reports as uid 0
//!   with inode 0, and must never pass for root.
//!
//! Nothing is cached: a port reused by another user is another connection, looked up when it
//! is accepted. A caller the kernel cannot name (a remote host, a lookup that fails) is
//! simply not recognised and needs the token, as before.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use netlink_packet_core::{NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP, TCP_ESTABLISHED};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_SOCK_DIAG};

/// A connection to the daemon API, as accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// The peer's address (`None` over the Unix socket).
    pub addr: Option<SocketAddr>,
    /// The uid the kernel names for the peer, if it names one.
    pub uid: Option<u32>,
}

impl Connected<IncomingStream<'_, TcpCallers>> for Caller {
    fn connect_info(stream: IncomingStream<'_, TcpCallers>) -> Self {
        *stream.remote_addr()
    }
}

impl Connected<IncomingStream<'_, UnixCallers>> for Caller {
    fn connect_info(stream: IncomingStream<'_, UnixCallers>) -> Self {
        *stream.remote_addr()
    }
}

/// Why sock_diag gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The netlink socket could not be opened, bound or written to.
    #[error("sock_diag: {0}")]
    Io(#[from] std::io::Error),
    /// The kernel answered with an error (e.g. `ENOENT`: no such socket any more).
    #[error("sock_diag answered errno {errno}")]
    Kernel {
        /// The errno, positive.
        errno: i32,
    },
    /// The answer could not be parsed.
    #[error("sock_diag answer unreadable: {detail}")]
    Malformed {
        /// What was wrong.
        detail: String,
    },
}

/// `::ffff:a.b.c.d` as `a.b.c.d`: a v4 client of a dual-stack listener holds an IPv4 socket.
fn canonical(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        IpAddr::V4(_) => a,
    }
}

/// Whether `a` is a loopback address (IPv4-mapped ones included).
pub fn is_loopback(a: SocketAddr) -> bool {
    canonical(a).ip().is_loopback()
}

/// The owner uid of the TCP socket on this machine whose local address is `peer` and whose
/// remote address is `local` — the client end of a connection we accepted on `local` from
/// `peer`. `Ok(None)` when the kernel knows that socket but it is not a live, established
/// one (closed, time-wait).
pub fn tcp_peer_uid(local: SocketAddr, peer: SocketAddr) -> Result<Option<u32>, PeerError> {
    let (local, peer) = (canonical(local), canonical(peer));
    let family = match (local.ip(), peer.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => AF_INET6,
        _ => return Ok(None),
    };
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    let mut header = NetlinkHeader::default();
    // An exact lookup, not a dump: the kernel finds the one socket with this 4-tuple.
    header.flags = NLM_F_REQUEST;
    let mut packet = NetlinkMessage::new(
        header,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::ESTABLISHED,
            socket_id: SocketId {
                // The client's socket: its source is our peer, its destination is us.
                source_port: peer.port(),
                destination_port: local.port(),
                source_address: peer.ip(),
                destination_address: local.ip(),
                interface_id: 0,
                // INET_DIAG_NOCOOKIE: match by address, not by a socket cookie.
                cookie: [0xff; 8],
            },
        })
        .into(),
    );
    packet.finalize();
    let mut buf = vec![0u8; packet.buffer_len()];
    packet.serialize(&mut buf);
    socket.send(&buf, 0)?;
    // The kernel answers an exact sock_diag lookup within the send; never wait for more.
    socket.set_non_blocking(true)?;
    let mut answer = vec![0u8; 8192];
    let n = socket.recv(&mut &mut answer[..], 0)?;
    parse_answer(&answer[..n], peer, local)
}

/// The uid in a sock_diag answer for the socket `src` → `dst`.
fn parse_answer(bytes: &[u8], src: SocketAddr, dst: SocketAddr) -> Result<Option<u32>, PeerError> {
    let msg = <NetlinkMessage<SockDiagMessage>>::deserialize(bytes).map_err(|e| {
        PeerError::Malformed {
            detail: e.to_string(),
        }
    })?;
    match msg.payload {
        NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
            let h = &r.header;
            let id = &h.socket_id;
            let same = canonical(SocketAddr::new(id.source_address, id.source_port)) == src
                && canonical(SocketAddr::new(id.destination_address, id.destination_port)) == dst;
            if !same {
                return Err(PeerError::Malformed {
                    detail: "the answer names another socket".into(),
                });
            }
            // A time-wait entry reports uid 0 and inode 0: it is not a live peer.
            Ok((h.state == TCP_ESTABLISHED && h.inode != 0).then_some(h.uid))
        }
        NetlinkPayload::Error(e) => Err(PeerError::Kernel {
            errno: e.code.map_or(0, |c| c.get().abs()),
        }),
        other => Err(PeerError::Malformed {
            detail: format!("unexpected message type {}", other.message_type()),
        }),
    }
}

/// The daemon API's TCP listener: every accepted connection comes with its [`Caller`], the
/// uid looked up at once for a loopback peer.
#[derive(Debug)]
pub struct TcpCallers(pub tokio::net::TcpListener);

impl Listener for TcpCallers {
    type Io = tokio::net::TcpStream;
    type Addr = Caller;

    async fn accept(&mut self) -> (Self::Io, Caller) {
        loop {
            match self.0.accept().await {
                Ok((stream, peer)) => {
                    // Small answers must not wait for a delayed ACK (Nagle).
                    let _ = stream.set_nodelay(true);
                    let uid = match stream.local_addr() {
                        Ok(local) if is_loopback(peer) => match tcp_peer_uid(local, peer) {
                            Ok(uid) => uid,
                            Err(e) => {
                                tracing::debug!(%peer, error = %e, "peer uid unknown");
                                None
                            }
                        },
                        _ => None,
                    };
                    return (
                        stream,
                        Caller {
                            addr: Some(peer),
                            uid,
                        },
                    );
                }
                Err(e) => accept_error(e).await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Caller> {
        Ok(Caller {
            addr: Some(self.0.local_addr()?),
            uid: None,
        })
    }
}

/// The daemon API's Unix socket listener: every connection comes with its peer's uid
/// (`SO_PEERCRED`).
#[derive(Debug)]
pub struct UnixCallers {
    listener: tokio::net::UnixListener,
    path: PathBuf,
}

impl UnixCallers {
    /// Listen on `path`, replacing a socket left there by an earlier run. The socket is
    /// open to every user (0666): who may do what is decided per connection, by uid or
    /// token, as over TCP; the directory it sits in may restrict it further.
    pub fn bind(path: PathBuf) -> std::io::Result<Self> {
        use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(&path)?,
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            Err(_) => {}
        }
        let listener = tokio::net::UnixListener::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
        Ok(UnixCallers { listener, path })
    }

    /// Where it listens.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl Listener for UnixCallers {
    type Io = tokio::net::UnixStream;
    type Addr = Caller;

    async fn accept(&mut self) -> (Self::Io, Caller) {
        loop {
            match self.listener.accept().await {
                Ok((stream, _)) => {
                    let uid = stream.peer_cred().ok().map(|c| c.uid());
                    return (stream, Caller { addr: None, uid });
                }
                Err(e) => accept_error(e).await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Caller> {
        Ok(Caller {
            addr: None,
            uid: None,
        })
    }
}

/// As axum's own listeners do: a connection error is the peer's, anything else (out of
/// file descriptors) is waited out.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind::*;
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "accepting a daemon API connection");
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_client_socket_is_named_with_its_owner() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let local = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(local).unwrap();
        let (_server, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(tcp_peer_uid(local, peer).unwrap(), Some(me));
        // Asked the other way round, the lookup would name the server's own socket: the
        // query must be the client's 4-tuple, which a wrong port does not match.
        let wrong = SocketAddr::new(peer.ip(), peer.port().wrapping_add(1).max(1));
        assert!(!matches!(tcp_peer_uid(local, wrong), Ok(Some(_))));
    }

    #[test]
    fn a_closed_client_is_not_named() {
        // Symptom guarded: a client that sent its request and closed leaves a time-wait (or
        // orphaned FIN-WAIT-2) entry that the kernel reports as uid 0.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let local = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(local).unwrap();
        let (server, peer) = listener.accept().unwrap();
        drop(client);
        drop(server);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!matches!(tcp_peer_uid(local, peer), Ok(Some(_))));
    }

    #[test]
    fn v4_mapped_addresses_are_looked_up_as_v4() {
        let a: SocketAddr = "[::ffff:127.0.0.1]:80".parse().unwrap();
        assert_eq!(canonical(a), "127.0.0.1:80".parse().unwrap());
        assert!(is_loopback(a));
        assert!(!is_loopback("10.0.0.1:80".parse().unwrap()));
    }
}
