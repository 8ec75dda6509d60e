//! The compact replica a worker's hook keeps: what each artifact of the workspace needs on the
//! hot path in a few fixed-size words, and everything else in append-only files.
//!
//! A mount held about 3 KB per delivered finding (issue 33): each artifact as a whole record
//! (claim, scope, producer, witness: one heap string each), a `String` key per bound path, a
//! hash map of deliveries, and the inbox's lines in memory. What the observer needs to decide
//! a delivery is small — the id, the publication time (for the order), the revision, the
//! status, where it is bound and which revision this worker received — and that is all that
//! stays in memory here: one 48-byte [`Slot`] per artifact in chunks of 1,024 (no growth by
//! doubling), a 4-byte entry per artifact in an id table, and each bound path once, its
//! bytes in a chunked arena with a 4-byte entry in a path table. The delivery line of each
//! artifact revision (the fixed template, claim already cut) is written once to an
//! append-only file ([`Spill`]) and read back when it is delivered or listed; the inbox is
//! another such file. Measured in `tests/memory.rs`: at 10,000 delivered findings, about
//! 100 bytes per finding (the bound is 300).
//!
//! A [`Spill`] gathers up to 16 KiB before writing, so most appends cost a copy; a read of a
//! line already written is one `pread` (served by the page cache). Its file is unnamed
//! (`O_TMPFILE`, or created and unlinked at once) in the directory the hook was given — the
//! mount's state directory — or the system's temporary directory; it disappears with the
//! process. Where no file can be made or written, the spill keeps its bytes in memory (as
//! before) and logs it once.

use std::collections::HashMap;
use std::fs::File;
use std::hash::{BuildHasher, RandomState};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use hashbrown::HashTable;

use crate::knowledge::{ArtifactId, WitnessStatus};

/// Bytes a [`Spill`] gathers in memory before it writes them out.
const SPILL_BUFFER: usize = 16 * 1024;

/// Elements per chunk of a [`Chunked`] vector.
const CHUNK: usize = 1024;

/// Bytes per chunk of the path arena.
const ARENA_CHUNK: usize = 64 * 1024;

/// "None" in a `u32` field.
const NONE: u32 = u32::MAX;

/// The longest line a slot can point at (24 bits of length).
const MAX_LINE: usize = (1 << 24) - 1;

/// An append-only byte file, with its newest bytes in a small buffer.
#[derive(Debug)]
pub(crate) struct Spill {
    /// Where the file is made (`None`: the system's temporary directory).
    dir: Option<PathBuf>,
    /// Made at the first write.
    file: Option<File>,
    /// Writing failed (or no file could be made): the bytes stay in `buf`.
    in_memory: bool,
    /// Bytes in the file.
    flushed: u64,
    /// Bytes after them.
    buf: Vec<u8>,
    /// What this file holds, for the log.
    what: &'static str,
}

impl Spill {
    /// An empty spill whose file, once needed, is made in `dir`.
    pub(crate) fn new(dir: Option<PathBuf>, what: &'static str) -> Spill {
        Spill {
            dir,
            file: None,
            in_memory: false,
            flushed: 0,
            buf: Vec::new(),
            what,
        }
    }

    /// Bytes held.
    pub(crate) fn len(&self) -> u64 {
        self.flushed + self.buf.len() as u64
    }

    /// Appends `bytes`; returns where they start.
    pub(crate) fn append(&mut self, bytes: &[u8]) -> u64 {
        let at = self.len();
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= SPILL_BUFFER {
            self.flush();
        }
        at
    }

    /// Writes the buffer to the file (made now if it is the first write).
    fn flush(&mut self) {
        if self.in_memory || self.buf.is_empty() {
            return;
        }
        if self.file.is_none() {
            // The given directory, else the system's temporary one.
            let made = match &self.dir {
                Some(d) => tempfile::tempfile_in(d).or_else(|_| tempfile::tempfile()),
                None => tempfile::tempfile(),
            };
            match made {
                Ok(f) => self.file = Some(f),
                Err(e) => {
                    tracing::warn!(error = %e, dir = ?self.dir, what = self.what,
                        "AECP: cannot make a file for the replica; keeping it in memory");
                    self.in_memory = true;
                    return;
                }
            }
        }
        let Some(file) = &self.file else { return };
        match file.write_all_at(&self.buf, self.flushed) {
            Ok(()) => {
                self.flushed += self.buf.len() as u64;
                self.buf.clear();
                if self.buf.capacity() > 2 * SPILL_BUFFER {
                    self.buf.shrink_to(SPILL_BUFFER);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, what = self.what,
                    "AECP: cannot write the replica's file; keeping the rest in memory");
                self.in_memory = true;
            }
        }
    }

    /// Appends the `len` bytes at `at` to `out`; false (and `out` unchanged) when they
    /// cannot be read.
    pub(crate) fn read_into(&self, at: u64, len: usize, out: &mut Vec<u8>) -> bool {
        if at >= self.flushed {
            let start = (at - self.flushed) as usize;
            return match self.buf.get(start..start.saturating_add(len)) {
                Some(b) => {
                    out.extend_from_slice(b);
                    true
                }
                None => false,
            };
        }
        let Some(file) = &self.file else { return false };
        let start = out.len();
        out.resize(start + len, 0);
        match file.read_exact_at(&mut out[start..], at) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, what = self.what, "AECP: cannot read the replica's file");
                out.truncate(start);
                false
            }
        }
    }

    /// Everything held.
    pub(crate) fn read_all(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len() as usize);
        if self.flushed > 0 && !self.read_into(0, self.flushed as usize, &mut out) {
            // The file is unreadable: what is still buffered is all there is to show.
            out.clear();
        }
        out.extend_from_slice(&self.buf);
        out
    }
}

/// A vector grown by chunks of [`CHUNK`] elements: never more than one chunk of slack, and
/// no copy of everything when it grows.
#[derive(Debug)]
struct Chunked<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Chunked {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Chunked<T> {
    fn push(&mut self, v: T) -> u32 {
        if self.len.is_multiple_of(CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        if let Some(last) = self.chunks.last_mut() {
            last.push(v);
        }
        self.len += 1;
        (self.len - 1) as u32
    }

    fn get(&self, i: u32) -> &T {
        let i = i as usize;
        &self.chunks[i / CHUNK][i % CHUNK]
    }

    fn get_mut(&mut self, i: u32) -> &mut T {
        let i = i as usize;
        &mut self.chunks[i / CHUNK][i % CHUNK]
    }

    fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }
}

/// What the observer keeps of one artifact.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    /// The store's id.
    pub(crate) id: ArtifactId,
    /// Publication time (the delivery order: newest first).
    pub(crate) created_ms: u64,
    /// Where its delivery line is in the lines file: offset << 24 | length.
    line: u64,
    /// Its revision.
    pub(crate) revision: u32,
    /// The revision this worker received ([`NONE`]: none).
    got: u32,
    /// Where it is bound (a path entry).
    path: u32,
    /// The next slot bound to the same path ([`NONE`]: the last).
    next: u32,
    /// A digest of the delivery line: an event that repeats what the replica holds changes
    /// nothing.
    digest: u32,
    /// Its status.
    pub(crate) status: WitnessStatus,
}

impl Slot {
    /// The revision this worker received, if any.
    pub(crate) fn got(&self) -> Option<u32> {
        (self.got != NONE).then_some(self.got)
    }
}

/// One bound path: where its bytes are in the arena, and its first slot.
#[derive(Debug, Clone, Copy)]
struct PathEntry {
    chunk: u32,
    start: u32,
    len: u32,
    first: u32,
}

/// The artifacts of a workspace as one worker's hook keeps them.
#[derive(Debug)]
pub(crate) struct Replica {
    slots: Chunked<Slot>,
    /// Slot indices, by artifact id.
    ids: HashTable<u32>,
    paths: Chunked<PathEntry>,
    /// Path entries, by path.
    names: HashTable<u32>,
    arena: Vec<Vec<u8>>,
    /// Deliveries recorded for artifacts not (yet) in the replica.
    early: HashMap<ArtifactId, u32>,
    hasher: RandomState,
    /// The delivery lines, one per artifact revision.
    lines: Spill,
}

/// The bytes of path entry `p`.
fn name_of<'a>(paths: &Chunked<PathEntry>, arena: &'a [Vec<u8>], p: u32) -> &'a [u8] {
    let e = paths.get(p);
    &arena[e.chunk as usize][e.start as usize..(e.start + e.len) as usize]
}

impl Replica {
    /// An empty replica whose lines file, once needed, is made in `dir`.
    pub(crate) fn new(dir: Option<PathBuf>) -> Replica {
        Replica {
            slots: Chunked::default(),
            ids: HashTable::new(),
            paths: Chunked::default(),
            names: HashTable::new(),
            arena: Vec::new(),
            early: HashMap::new(),
            hasher: RandomState::new(),
            lines: Spill::new(dir, "delivery lines"),
        }
    }

    /// Whether it holds no artifact.
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.len == 0
    }

    fn hash_id(&self, id: ArtifactId) -> u64 {
        self.hasher.hash_one(id)
    }

    fn hash_name(&self, name: &[u8]) -> u64 {
        self.hasher.hash_one(name)
    }

    /// The slot of artifact `id`.
    pub(crate) fn find(&self, id: ArtifactId) -> Option<u32> {
        let slots = &self.slots;
        self.ids
            .find(self.hash_id(id), |s| slots.get(*s).id == id)
            .copied()
    }

    /// Slot `i`.
    pub(crate) fn slot(&self, i: u32) -> &Slot {
        self.slots.get(i)
    }

    /// The revision of `id` this worker received, if any (also before the artifact came).
    pub(crate) fn got(&self, id: ArtifactId) -> Option<u32> {
        match self.find(id) {
            Some(i) => self.slot(i).got(),
            None => self.early.get(&id).copied(),
        }
    }

    /// The path entry of `path`.
    fn find_path(&self, path: &str) -> Option<u32> {
        let (paths, arena) = (&self.paths, &self.arena);
        self.names
            .find(self.hash_name(path.as_bytes()), |p| {
                name_of(paths, arena, *p) == path.as_bytes()
            })
            .copied()
    }

    /// The path entry of `path`, made if new.
    fn intern(&mut self, path: &str) -> u32 {
        if let Some(p) = self.find_path(path) {
            return p;
        }
        let bytes = path.as_bytes();
        let fits = self
            .arena
            .last()
            .is_some_and(|c| c.capacity() - c.len() >= bytes.len());
        if !fits {
            self.arena
                .push(Vec::with_capacity(ARENA_CHUNK.max(bytes.len())));
        }
        let chunk = self.arena.len() - 1;
        let start = self.arena[chunk].len();
        self.arena[chunk].extend_from_slice(bytes);
        let p = self.paths.push(PathEntry {
            chunk: chunk as u32,
            start: start as u32,
            len: bytes.len() as u32,
            first: NONE,
        });
        let hash = self.hash_name(bytes);
        let Replica {
            names,
            paths,
            arena,
            hasher,
            ..
        } = self;
        names.insert_unique(hash, p, |q| hasher.hash_one(name_of(paths, arena, *q)));
        p
    }

    fn link(&mut self, i: u32, p: u32) {
        let first = self.paths.get(p).first;
        let s = self.slots.get_mut(i);
        s.path = p;
        s.next = first;
        self.paths.get_mut(p).first = i;
    }

    fn unlink(&mut self, i: u32) {
        let Slot { path, next, .. } = *self.slot(i);
        if self.paths.get(path).first == i {
            self.paths.get_mut(path).first = next;
            return;
        }
        let mut at = self.paths.get(path).first;
        while at != NONE {
            let after = self.slot(at).next;
            if after == i {
                self.slots.get_mut(at).next = next;
                return;
            }
            at = after;
        }
    }

    /// Adds or replaces artifact `id` (`line`: its delivery line). Returns whether anything
    /// changed: an older revision of a known artifact, or the same one again (events may
    /// arrive twice), changes nothing.
    pub(crate) fn upsert(
        &mut self,
        id: ArtifactId,
        revision: u32,
        status: WitnessStatus,
        created_ms: u64,
        bound: &str,
        line: &[u8],
    ) -> bool {
        if line.len() > MAX_LINE {
            tracing::warn!(
                id,
                len = line.len(),
                "AECP: a delivery line too long to keep; ignored"
            );
            return false;
        }
        let digest = self.hasher.hash_one(line) as u32;
        let existing = self.find(id);
        if let Some(i) = existing {
            let old = *self.slot(i);
            if old.revision > revision {
                return false;
            }
            let same = old.revision == revision
                && old.status == status
                && old.created_ms == created_ms
                && old.digest == digest
                && name_of(&self.paths, &self.arena, old.path) == bound.as_bytes();
            if same {
                return false;
            }
        }
        let at = self.lines.append(line);
        let packed = (at << 24) | line.len() as u64;
        let p = self.intern(bound);
        match existing {
            Some(i) => {
                let rebind = self.slot(i).path != p;
                if rebind {
                    self.unlink(i);
                }
                let s = self.slots.get_mut(i);
                s.line = packed;
                s.revision = revision;
                s.status = status;
                s.created_ms = created_ms;
                s.digest = digest;
                if rebind {
                    self.link(i, p);
                }
            }
            None => {
                let got = self.early.remove(&id).unwrap_or(NONE);
                let i = self.slots.push(Slot {
                    id,
                    created_ms,
                    line: packed,
                    revision,
                    got,
                    path: p,
                    next: NONE,
                    digest,
                    status,
                });
                self.link(i, p);
                let Replica {
                    ids, slots, hasher, ..
                } = self;
                ids.insert_unique(hasher.hash_one(id), i, |s| {
                    hasher.hash_one(slots.get(*s).id)
                });
            }
        }
        true
    }

    /// This worker received `id` at `revision` (kept at the highest revision received).
    pub(crate) fn record(&mut self, id: ArtifactId, revision: u32) {
        match self.find(id) {
            Some(i) => {
                let s = self.slots.get_mut(i);
                s.got = if s.got == NONE {
                    revision
                } else {
                    s.got.max(revision)
                };
            }
            None => {
                let r = self.early.entry(id).or_insert(revision);
                *r = (*r).max(revision);
            }
        }
    }

    /// Appends slot `i`'s delivery line to `out`; false when it cannot be read.
    pub(crate) fn line_into(&self, i: u32, out: &mut Vec<u8>) -> bool {
        let packed = self.slot(i).line;
        self.lines
            .read_into(packed >> 24, (packed & MAX_LINE as u64) as usize, out)
    }

    /// The slots bound to `path` or any enclosing directory, the workspace (`""`) included.
    pub(crate) fn bound_to<'a>(&'a self, path: &'a str) -> impl Iterator<Item = u32> + 'a {
        let path = path.trim_matches('/');
        let cuts = path.match_indices('/').map(|(i, _)| i);
        let prefixes = std::iter::once(path)
            .chain(cuts.map(move |i| &path[..i]))
            .chain((!path.is_empty()).then_some(""));
        prefixes.flat_map(move |p| {
            self.chain(self.find_path(p).map_or(NONE, |e| self.paths.get(e).first))
        })
    }

    /// The slots of one path's chain, from slot `first`.
    fn chain(&self, first: u32) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors((first != NONE).then_some(first), move |i| {
            let next = self.slot(*i).next;
            (next != NONE).then_some(next)
        })
    }

    /// The bound paths with at least one slot for which `keep` holds.
    pub(crate) fn paths_where(&self, keep: impl Fn(&Slot) -> bool) -> Vec<String> {
        self.paths
            .iter()
            .filter(|e| self.chain(e.first).any(|i| keep(self.slot(i))))
            .filter_map(|e| {
                let bytes =
                    &self.arena[e.chunk as usize][e.start as usize..(e.start + e.len) as usize];
                std::str::from_utf8(bytes).ok().map(str::to_owned)
            })
            .collect()
    }

    /// Every slot, in no particular order.
    #[cfg(test)]
    pub(crate) fn slots(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spill_reads_back_what_it_buffered_and_what_it_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Spill::new(Some(dir.path().to_owned()), "test");
        let mut at = Vec::new();
        for i in 0..5_000u32 {
            let line = format!("{{\"n\":{i}}}\n");
            at.push((s.append(line.as_bytes()), line));
        }
        assert!(s.flushed > 0, "written out past the buffer");
        assert!(s.buf.len() < SPILL_BUFFER);
        for (off, line) in at.iter().step_by(97) {
            let mut out = Vec::new();
            assert!(s.read_into(*off, line.len(), &mut out));
            assert_eq!(out, line.as_bytes());
        }
        let all = s.read_all();
        let want: Vec<u8> = at.iter().flat_map(|(_, l)| l.bytes()).collect();
        assert_eq!(all, want);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "the file has no name"
        );
    }

    #[test]
    fn a_spill_falls_back_to_the_temporary_directory_then_to_memory() {
        let lines: Vec<String> = (0..3_000).map(|i| format!("line {i}\n")).collect();
        // No such directory: the system's temporary one.
        let mut s = Spill::new(Some("/nonexistent/aecp-spill".into()), "test");
        let offs: Vec<u64> = lines.iter().map(|l| s.append(l.as_bytes())).collect();
        assert!(s.flushed > 0 && !s.in_memory);
        let mut out = Vec::new();
        assert!(s.read_into(offs[100], lines[100].len(), &mut out));
        assert_eq!(out, lines[100].as_bytes());
        // Writing failed: the rest stays in memory, and everything still reads back.
        s.in_memory = true;
        let more: Vec<u64> = lines.iter().map(|l| s.append(l.as_bytes())).collect();
        let mut out = Vec::new();
        assert!(s.read_into(more[2_500], lines[2_500].len(), &mut out));
        assert_eq!(out, lines[2_500].as_bytes());
        assert_eq!(s.read_all(), lines.concat().repeat(2).into_bytes());
    }

    #[test]
    fn paths_are_interned_once_and_chains_follow_rebinding() {
        let mut r = Replica::new(None);
        assert!(r.upsert(1, 1, WitnessStatus::Checked, 10, "a/b.py", b"one\n"));
        assert!(r.upsert(2, 1, WitnessStatus::Checked, 11, "a/b.py", b"two\n"));
        assert!(r.upsert(3, 1, WitnessStatus::Checked, 12, "a", b"three\n"));
        assert!(
            !r.upsert(3, 1, WitnessStatus::Checked, 12, "a", b"three\n"),
            "again"
        );
        assert_eq!(r.paths.len, 2);
        let mut ids: Vec<u64> = r.bound_to("a/b.py").map(|i| r.slot(i).id).collect();
        ids.sort();
        assert_eq!(ids, [1, 2, 3]);
        // Rebound by a new revision: gone from the old path's chain.
        assert!(r.upsert(1, 2, WitnessStatus::Checked, 10, "c.py", b"one again\n"));
        let mut ids: Vec<u64> = r.bound_to("a/b.py").map(|i| r.slot(i).id).collect();
        ids.sort();
        assert_eq!(ids, [2, 3]);
        let at_c: Vec<u64> = r.bound_to("c.py").map(|i| r.slot(i).id).collect();
        assert_eq!(at_c, [1]);
        let mut out = Vec::new();
        assert!(r.line_into(r.find(1).unwrap(), &mut out));
        assert_eq!(out, b"one again\n");
        assert!(
            !r.upsert(1, 1, WitnessStatus::Checked, 10, "a/b.py", b"old\n"),
            "older"
        );
        // A delivery recorded before its artifact came.
        r.record(9, 2);
        assert_eq!(r.got(9), Some(2));
        assert!(r.upsert(9, 2, WitnessStatus::Unchecked, 1, "", b"nine\n"));
        assert_eq!(r.slot(r.find(9).unwrap()).got(), Some(2));
        assert_eq!(
            r.bound_to("x/y").map(|i| r.slot(i).id).collect::<Vec<_>>(),
            [9]
        );
    }
}
