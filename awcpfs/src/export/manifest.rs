//! Building the manifest: one walk of the exported tree at register time.
//!
//! The manifest is a snapshot. It lists every directory, regular file and symlink below the
//! root, parents before children (a depth-first pre-order walk with names sorted bytewise,
//! so the same tree always gives the same bytes and the same digest). Files carry the blake3
//! hash of their whole content and the hashes of their fixed, offset-aligned blocks of
//! `block_size` bytes (the last block may be shorter; an empty file has no blocks and the
//! hash of the empty string). Symlinks carry their target as stored: shown, never followed.
//!
//! The walk uses the same descriptor-relative, no-follow discipline as
//! [`super::rootfs`]: every directory is opened with `openat(O_DIRECTORY | O_NOFOLLOW)`
//! relative to its parent's descriptor and every file with `openat(O_NOFOLLOW | O_NONBLOCK)`,
//! so the walk cannot be led outside the root even if the tree changes while it runs.
//!
//! Skipped, each with a `warn`: special files (FIFOs, sockets, devices), names and symlink
//! targets that are not UTF-8, our own temporary names (`.awcp-tmp-*`), entries that
//! vanish or cannot be read during the walk, and directories deeper than [`MAX_DEPTH`].
//! Only a failure at the root itself fails the build.

use std::io::{self, Read};
use std::os::fd::AsFd;
use std::sync::Arc;

use awcp_protocol::dataplane::{DATA_PLANE_VERSION, EntryKind, Manifest, ManifestEntry};
use nix::dir::Dir;
use nix::fcntl::{AtFlags, OFlag, readlinkat};
use nix::sys::stat::{FileStat, Mode, fstat, fstatat};

use super::rootfs::{NodeKind, RootDir, ctime_ns, mtime_ns, open_file_at};
use super::store::{BlockIndex, BlockLoc, TMP_PREFIX};

/// Deepest directory level walked. Each level holds one open descriptor and one stack frame;
/// real workspaces are far shallower.
pub(crate) const MAX_DEPTH: usize = 256;

/// What one walk produces.
#[derive(Debug)]
pub(crate) struct Built {
    pub(crate) manifest: Manifest,
    pub(crate) index: BlockIndex,
}

/// Parameters of the manifest that do not come from the tree.
#[derive(Debug, Clone)]
pub(crate) struct ManifestParams {
    pub(crate) export_id: String,
    pub(crate) block_size: u32,
    pub(crate) read_only: bool,
    pub(crate) filter: Option<super::PathFilter>,
}

/// Walk the tree below `root` and build its manifest and block index (blocking IO).
pub(crate) fn build(root: &RootDir, params: &ManifestParams) -> io::Result<Built> {
    let root_stat = fstat(root.fd())?;
    let mut walker = Walker {
        block_size: params.block_size,
        entries: Vec::new(),
        index: BlockIndex::default(),
        filter: params.filter.clone(),
    };
    let dir = Dir::openat(root.fd(), ".", dir_flags(), Mode::empty())?;
    walker.walk_dir(dir, "", 0)?;
    Ok(Built {
        manifest: Manifest {
            version: DATA_PLANE_VERSION,
            export_id: params.export_id.clone(),
            block_size: params.block_size,
            read_only: params.read_only,
            root_mode: perm(&root_stat),
            root_mtime_ns: mtime_ns(&root_stat),
            entries: walker.entries,
        },
        index: walker.index,
    })
}

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

fn perm(st: &FileStat) -> u32 {
    st.st_mode & 0o7777
}

/// Content hashes of a file, cut into blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileHashes {
    /// blake3 of the whole content.
    pub(crate) hash: blake3::Hash,
    /// blake3 and length of each block, in order.
    pub(crate) blocks: Vec<(blake3::Hash, u32)>,
    /// Bytes read.
    pub(crate) size: u64,
}

/// Hash `reader` whole and in blocks of `block_size` bytes (offset-aligned; the last block
/// may be shorter; empty input has no blocks).
pub(crate) fn hash_blocks(mut reader: impl Read, block_size: u32) -> io::Result<FileHashes> {
    let mut whole = blake3::Hasher::new();
    let mut blocks = Vec::new();
    let mut buf = vec![0u8; block_size as usize];
    let mut size = 0u64;
    loop {
        // Fill a whole block unless the input ends: short reads must not shift block edges.
        let mut filled = 0;
        while filled < buf.len() {
            match reader.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if filled == 0 {
            break;
        }
        let block = &buf[..filled];
        whole.update(block);
        // `filled` is at most `block_size`, a u32.
        blocks.push((blake3::hash(block), filled as u32));
        size += filled as u64;
        if filled < buf.len() {
            break;
        }
    }
    Ok(FileHashes {
        hash: whole.finalize(),
        blocks,
        size,
    })
}

struct Walker {
    filter: Option<super::PathFilter>,
    block_size: u32,
    entries: Vec<ManifestEntry>,
    index: BlockIndex,
}

impl Walker {
    /// List `dir` (whose path is `prefix`), emit its entries, recurse into subdirectories.
    fn walk_dir(&mut self, mut dir: Dir, prefix: &str, depth: usize) -> io::Result<()> {
        let mut names = Vec::new();
        for entry in dir.iter() {
            let entry = entry?;
            let raw = entry.file_name().to_bytes();
            if raw == b"." || raw == b".." {
                continue;
            }
            match std::str::from_utf8(raw) {
                Ok(name) => names.push(name.to_owned()),
                Err(_) => tracing::warn!(
                    dir = prefix,
                    name = %String::from_utf8_lossy(raw),
                    "skipping a name that is not UTF-8"
                ),
            }
        }
        names.sort_unstable();
        for name in names {
            if name.starts_with(TMP_PREFIX) {
                continue;
            }
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            if let Err(e) = self.visit(&dir, &name, &rel, depth) {
                tracing::warn!(path = %rel, error = %e, "skipping an entry that cannot be read");
            }
        }
        Ok(())
    }

    fn visit(&mut self, dir: &Dir, name: &str, rel: &str, depth: usize) -> io::Result<()> {
        let st = fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        // Hidden paths are left out (parents were checked on the way down).
        let is_dir = NodeKind::of(&st) == NodeKind::Dir;
        if self.filter.as_ref().is_some_and(|f| !(f.0)(rel, is_dir)) {
            return Ok(());
        }
        match NodeKind::of(&st) {
            NodeKind::Dir => {
                if depth + 1 >= MAX_DEPTH {
                    tracing::warn!(path = %rel, max = MAX_DEPTH, "skipping a directory nested too deep");
                    return Ok(());
                }
                let sub = Dir::openat(dir.as_fd(), name, dir_flags(), Mode::empty())?;
                self.entries.push(ManifestEntry {
                    path: rel.to_owned(),
                    kind: EntryKind::Dir,
                    mode: perm(&st),
                    size: 0,
                    mtime_ns: mtime_ns(&st),
                    hash: None,
                    blocks: Vec::new(),
                    target: None,
                    ino: Some(st.st_ino),
                    ctime_ns: Some(ctime_ns(&st)),
                });
                self.walk_dir(sub, rel, depth + 1)
            }
            NodeKind::File => {
                let file = open_file_at(dir.as_fd(), name, rel).map_err(io::Error::other)?;
                // Metadata from the opened file, so size, mode and content belong together.
                let st = fstat(&file)?;
                let hashes = hash_blocks(&file, self.block_size)?;
                let path: Arc<str> = Arc::from(rel);
                let mut offset = 0u64;
                let mut blocks = Vec::with_capacity(hashes.blocks.len());
                for (h, len) in &hashes.blocks {
                    self.index.insert(
                        *h.as_bytes(),
                        BlockLoc {
                            path: path.clone(),
                            offset,
                            len: *len,
                        },
                    );
                    offset += u64::from(*len);
                    blocks.push(h.to_hex().to_string());
                }
                self.entries.push(ManifestEntry {
                    path: rel.to_owned(),
                    kind: EntryKind::File,
                    mode: perm(&st),
                    size: hashes.size,
                    mtime_ns: mtime_ns(&st),
                    hash: Some(hashes.hash.to_hex().to_string()),
                    blocks,
                    target: None,
                    ino: Some(st.st_ino),
                    ctime_ns: Some(ctime_ns(&st)),
                });
                Ok(())
            }
            NodeKind::Symlink => {
                let target = readlinkat(dir.as_fd(), name)?;
                let Some(target) = target.to_str() else {
                    tracing::warn!(path = %rel, "skipping a symlink whose target is not UTF-8");
                    return Ok(());
                };
                self.entries.push(ManifestEntry {
                    path: rel.to_owned(),
                    kind: EntryKind::Symlink,
                    mode: perm(&st),
                    size: target.len() as u64,
                    mtime_ns: mtime_ns(&st),
                    hash: None,
                    blocks: Vec::new(),
                    target: Some(target.to_owned()),
                    ino: Some(st.st_ino),
                    ctime_ns: Some(ctime_ns(&st)),
                });
                Ok(())
            }
            NodeKind::Special | NodeKind::Absent => {
                tracing::warn!(path = %rel, "skipping a special file (fifo, socket or device)");
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_offset_aligned_even_with_short_reads() {
        /// A reader that returns at most 3 bytes per call.
        struct Dribble<'a>(&'a [u8]);
        impl Read for Dribble<'_> {
            fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
                let n = out.len().min(3).min(self.0.len());
                out[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let data = b"0123456789abcdefghij"; // 20 bytes, block 8 → 8, 8, 4
        let h = hash_blocks(Dribble(data), 8).unwrap();
        assert_eq!(h.size, 20);
        assert_eq!(h.hash, blake3::hash(data));
        let expect: Vec<_> = data
            .chunks(8)
            .map(|c| (blake3::hash(c), c.len() as u32))
            .collect();
        assert_eq!(h.blocks, expect);
    }

    #[test]
    fn empty_input_has_no_blocks() {
        let h = hash_blocks(&b""[..], 8).unwrap();
        assert_eq!(h.size, 0);
        assert!(h.blocks.is_empty());
        assert_eq!(h.hash, blake3::hash(b""));
    }

    #[test]
    fn exact_multiple_has_no_empty_tail_block() {
        let h = hash_blocks(&[1u8; 16][..], 8).unwrap();
        assert_eq!(h.blocks.len(), 2);
    }
}
