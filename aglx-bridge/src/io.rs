//! Reading and writing frames on byte streams, with deadlines.
//!
//! [`FrameReader`] owns the receive buffer of one connection. Between frames the peer may be
//! silent for the idle timeout; once the first byte of a frame has arrived, the whole frame
//! must arrive within the frame timeout, so a sender that dribbles bytes (a slowloris) is cut
//! off after a bounded time however it paces them. The buffer never grows past what the
//! [`Limits`] allow plus one read, because the decoder refuses a frame as soon as it crosses a
//! limit.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, timeout, timeout_at};

use crate::codec::{Decoded, Limits, decode_stream};
use crate::error::FrameError;

/// A byte stream frames travel on: plain TCP or TLS.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A boxed [`Io`].
pub type BoxIo = Box<dyn Io>;

/// Why no frame could be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The bytes are not a valid frame.
    #[error("bad frame: {0}")]
    Frame(FrameError),
    /// Nothing arrived within the idle timeout.
    #[error("peer idle for {0:?}")]
    Idle(Duration),
    /// A frame began but did not complete within the frame timeout.
    #[error("frame not complete within {0:?} (slow sender)")]
    Slow(Duration),
    /// The peer closed the stream in the middle of a frame.
    #[error("peer closed the connection in the middle of a frame")]
    Truncated,
    /// The stream failed.
    #[error("read failed")]
    Io(#[source] io::Error),
}

/// A frame and the exact bytes it was decoded from.
#[derive(Debug, Clone)]
pub struct RawFrame {
    /// The decoded frame (ranges in it refer to `raw`).
    pub decoded: Decoded,
    /// The frame's bytes as received.
    pub raw: Vec<u8>,
}

/// Deadlines for reading.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// How long the peer may be silent between frames.
    pub idle: Duration,
    /// How long one frame may take from its first byte to its last.
    pub frame: Duration,
}

/// The receive side of one connection.
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    limits: Limits,
}

impl FrameReader {
    /// A reader with the given limits.
    pub fn new(limits: Limits) -> Self {
        FrameReader {
            buf: Vec::new(),
            limits,
        }
    }

    /// Reads the next frame. `Ok(None)` is a clean close between frames.
    pub async fn next<R: AsyncRead + Unpin + ?Sized>(
        &mut self,
        r: &mut R,
        deadlines: Deadlines,
    ) -> Result<Option<RawFrame>, ReadError> {
        let idle_deadline = Instant::now() + deadlines.idle;
        let mut frame_deadline = (!self.buf.is_empty()).then(|| Instant::now() + deadlines.frame);
        let mut chunk = [0u8; 8192];
        loop {
            if !self.buf.is_empty() {
                match decode_stream(&self.buf, &self.limits) {
                    Ok(Some(decoded)) => {
                        let raw: Vec<u8> = self.buf.drain(..decoded.len).collect();
                        return Ok(Some(RawFrame { decoded, raw }));
                    }
                    Ok(None) => {}
                    Err(e) => return Err(ReadError::Frame(e)),
                }
            }
            let (deadline, on_timeout) = match frame_deadline {
                Some(d) => (d, ReadError::Slow(deadlines.frame)),
                None => (idle_deadline, ReadError::Idle(deadlines.idle)),
            };
            let n = match timeout_at(deadline, r.read(&mut chunk)).await {
                Err(_) => return Err(on_timeout),
                Ok(Err(e)) => return Err(ReadError::Io(e)),
                Ok(Ok(n)) => n,
            };
            if n == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(ReadError::Truncated)
                };
            }
            if self.buf.is_empty() {
                frame_deadline = Some(Instant::now() + deadlines.frame);
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// Writes bytes within a deadline, so a peer that stops reading cannot hold a writer forever.
pub async fn write_within<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    bytes: &[u8],
    limit: Duration,
) -> io::Result<()> {
    match timeout(limit, async {
        w.write_all(bytes).await?;
        w.flush().await
    })
    .await
    {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "write timed out")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Deadlines = Deadlines {
        idle: Duration::from_secs(5),
        frame: Duration::from_secs(5),
    };

    #[tokio::test]
    async fn reads_back_to_back_frames_split_anywhere() {
        let one = b"AGLX/1.0 TCP\nTYPE: handshake\nCONTENT-LENGTH: 2\n\n{}";
        let mut all = one.to_vec();
        all.extend_from_slice(one);
        let (mut a, mut b) = tokio::io::duplex(7);
        let writer = tokio::spawn(async move {
            for piece in all.chunks(5) {
                a.write_all(piece).await.unwrap();
            }
        });
        let mut r = FrameReader::new(Limits::TCP);
        for _ in 0..2 {
            let f = r.next(&mut b, D).await.unwrap().unwrap();
            assert_eq!(f.raw, one);
        }
        writer.await.unwrap();
        assert!(r.next(&mut b, D).await.unwrap().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn slow_sender_is_cut_off_after_the_frame_timeout() {
        let (mut a, mut b) = tokio::io::duplex(64);
        let _writer = tokio::spawn(async move {
            for byte in b"AGLX/1.0 TCP\nTYPE: handshake\n\n" {
                a.write_all(&[*byte]).await.unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        let mut r = FrameReader::new(Limits::TCP);
        let err = r.next(&mut b, D).await.unwrap_err();
        assert!(matches!(err, ReadError::Slow(_)), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn idle_peer_times_out_and_truncation_is_reported() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut r = FrameReader::new(Limits::TCP);
        assert!(matches!(
            r.next(&mut b, D).await.unwrap_err(),
            ReadError::Idle(_)
        ));
        drop(a);
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(b"AGLX/1.0 TCP\n").await.unwrap();
        drop(a);
        assert!(matches!(
            r.next(&mut b, D).await.unwrap_err(),
            ReadError::Truncated
        ));
    }
}
