//! The pack file: copies of remote files fetched for reading, all in one file.
//!
//! Background hydration makes every small file readable without a round trip to the
//! Delegator. Giving each its own upper file costs a file creation per file — on ext4 an
//! inode allocation, a directory insertion under the directory's lock, and, right after a
//! cold start, a read of inode-table blocks from disk — which made file creation, not the
//! network, the pace of a first read of the whole tree. The pack appends each copy instead;
//! a node records where its copy starts ([`Data::Remote`](super::inode::Data)'s `packed`).
//!
//! Copies are never changed in place and never freed while the mount runs (a copy whose
//! file is written, truncated or replaced by the Delegator is simply no longer used); the
//! pack starts empty with every mount, as nothing in the journal points into it. So that a
//! long lease over a tree the Delegator keeps changing cannot grow it without bound, it
//! takes no more copies once it holds its limit ([`pack_limit`]); files are then read from
//! upper files of their own, as larger files are.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;

/// Files at most this large that are read without a handle are fetched into the pack (a
/// larger one gets an upper file of its own, or is streamed).
pub const PACK_MAX: u64 = 256 << 10;

/// The limit for a tree whose files of at most [`PACK_MAX`] bytes add up to `small_bytes`:
/// room for every one of them twice (each changed once by the Delegator and read again),
/// and 64 MiB more.
pub fn pack_limit(small_bytes: u64) -> u64 {
    small_bytes.saturating_mul(2).saturating_add(64 << 20)
}

/// The pack file of one mount.
#[derive(Debug)]
pub struct Pack {
    path: PathBuf,
    limit: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Created (emptied) on first use.
    file: Option<Arc<File>>,
    /// Bytes handed out so far.
    end: u64,
}

impl Pack {
    /// The pack at `path`, holding at most `limit` bytes; nothing is created until
    /// something is stored.
    pub fn new(path: PathBuf, limit: u64) -> Pack {
        Pack {
            path,
            limit,
            state: Mutex::new(State::default()),
        }
    }

    /// Whether a copy of `len` bytes would still be taken.
    pub fn has_room(&self, len: u64) -> bool {
        self.state.lock().end.saturating_add(len) <= self.limit
    }

    /// Store `parts`, one after the other, as one copy; returns where it starts, or `None`
    /// when the pack is full. The space is taken under a short lock and written outside
    /// it, so several writers store at once.
    pub fn store<'a>(
        &self,
        parts: impl IntoIterator<Item = &'a [u8]> + Clone,
    ) -> std::io::Result<Option<u64>> {
        let len: u64 = parts.clone().into_iter().map(|p| p.len() as u64).sum();
        let (file, off) = {
            let mut st = self.state.lock();
            if st.end.saturating_add(len) > self.limit {
                return Ok(None);
            }
            let file = match &st.file {
                Some(f) => f.clone(),
                None => {
                    let f = Arc::new(
                        OpenOptions::new()
                            .read(true)
                            .write(true)
                            .create(true)
                            .truncate(true)
                            .custom_flags(libc::O_CLOEXEC)
                            .open(&self.path)?,
                    );
                    st.file = Some(f.clone());
                    f
                }
            };
            let off = st.end;
            st.end += len;
            (file, off)
        };
        let mut at = off;
        for p in parts {
            file.write_all_at(p, at)?;
            at += p.len() as u64;
        }
        Ok(Some(off))
    }

    /// Up to `size` bytes from `offset` of the `len`-byte copy at `off` (short at its end).
    pub fn read(&self, off: u64, len: u64, offset: u64, size: u32) -> std::io::Result<Vec<u8>> {
        let file = self
            .state
            .lock()
            .file
            .clone()
            .ok_or_else(|| std::io::Error::other("the pack file holds nothing yet"))?;
        let want = len.saturating_sub(offset).min(u64::from(size));
        let mut buf = vec![0u8; want as usize];
        file.read_exact_at(&mut buf, off + offset)?;
        Ok(buf)
    }

    /// Hand the `len`-byte copy at `off` to `out`, in pieces of at most 1 MiB.
    pub fn copy_out<E: From<std::io::Error>>(
        &self,
        off: u64,
        len: u64,
        mut out: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut at = 0;
        while at < len {
            let part = self.read(off, len, at, 1 << 20)?;
            if part.is_empty() {
                break;
            }
            at += part.len() as u64;
            out(&part)?;
        }
        Ok(())
    }

    /// Bytes stored so far.
    pub fn bytes(&self) -> u64 {
        self.state.lock().end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_read_back_where_they_were_stored_and_never_past_their_end() {
        let dir = tempfile::tempdir().unwrap();
        let pack = Pack::new(dir.path().join(".pack"), 1 << 20);
        assert!(pack.read(0, 1, 0, 1).is_err(), "nothing stored yet");
        let a = pack
            .store([b"hello ".as_slice(), b"world".as_slice()])
            .unwrap()
            .unwrap();
        let b = pack.store([b"second".as_slice()]).unwrap().unwrap();
        let empty = pack.store([b"".as_slice()]).unwrap().unwrap();
        assert_eq!((a, b, empty), (0, 11, 17));
        assert_eq!(pack.bytes(), 17);
        assert_eq!(pack.read(a, 11, 0, 4096).unwrap(), b"hello world");
        assert_eq!(pack.read(a, 11, 6, 3).unwrap(), b"wor");
        assert_eq!(pack.read(b, 6, 0, 100).unwrap(), b"second");
        assert_eq!(pack.read(b, 6, 6, 100).unwrap(), b"");
        assert_eq!(pack.read(b, 6, 60, 100).unwrap(), b"");
        assert_eq!(pack.read(empty, 0, 0, 100).unwrap(), b"");
    }

    #[test]
    fn a_copy_is_copied_out_whole_in_pieces() {
        let dir = tempfile::tempdir().unwrap();
        let pack = Pack::new(dir.path().join(".pack"), 8 << 20);
        pack.store([b"before".as_slice()]).unwrap();
        let body: Vec<u8> = (0..(5u32 << 19)).map(|i| (i % 251) as u8).collect();
        let off = pack.store([body.as_slice()]).unwrap().unwrap();
        pack.store([b"after".as_slice()]).unwrap();
        let (mut out, mut pieces) = (Vec::new(), 0);
        pack.copy_out(off, body.len() as u64, |p: &[u8]| {
            pieces += 1;
            out.extend_from_slice(p);
            Ok::<(), std::io::Error>(())
        })
        .unwrap();
        assert_eq!(out, body);
        assert_eq!(pieces, 3, "2.5 MiB in pieces of at most 1 MiB");
    }

    #[test]
    fn a_new_pack_starts_empty_over_an_old_one() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(".pack"), b"left by an earlier mount").unwrap();
        let pack = Pack::new(dir.path().join(".pack"), 1 << 20);
        assert_eq!(pack.store([b"new".as_slice()]).unwrap(), Some(0));
        assert_eq!(std::fs::read(dir.path().join(".pack")).unwrap(), b"new");
    }

    #[test]
    fn a_full_pack_takes_no_more_copies_and_keeps_the_ones_it_has() {
        let dir = tempfile::tempdir().unwrap();
        let pack = Pack::new(dir.path().join(".pack"), 10);
        assert!(pack.has_room(10) && !pack.has_room(11));
        assert_eq!(pack.store([b"1234567".as_slice()]).unwrap(), Some(0));
        assert!(!pack.has_room(4));
        assert_eq!(pack.store([b"89ab".as_slice()]).unwrap(), None);
        assert_eq!(pack.store([b"89a".as_slice()]).unwrap(), Some(7));
        assert_eq!(pack.store([b"".as_slice()]).unwrap(), Some(10));
        assert_eq!(pack.store([b"c".as_slice()]).unwrap(), None);
        assert_eq!(pack.bytes(), 10);
        assert_eq!(pack.read(0, 7, 0, 100).unwrap(), b"1234567");
        assert_eq!(pack.read(7, 3, 0, 100).unwrap(), b"89a");
        assert_eq!(pack_limit(100), 200 + (64 << 20));
        assert_eq!(pack_limit(u64::MAX), u64::MAX);
    }

    #[test]
    fn concurrent_stores_never_overlap() {
        let dir = tempfile::tempdir().unwrap();
        let pack = Arc::new(Pack::new(dir.path().join(".pack"), 1 << 20));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let pack = pack.clone();
                std::thread::spawn(move || {
                    (0..200u32)
                        .map(|i| {
                            let body = vec![t; 1 + (i as usize * 7) % 300];
                            (pack.store([body.as_slice()]).unwrap().unwrap(), body)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for t in threads {
            for (off, body) in t.join().unwrap() {
                let len = body.len() as u64;
                assert_eq!(pack.read(off, len, 0, len as u32).unwrap(), body);
            }
        }
    }
}
