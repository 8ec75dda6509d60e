//! File content: fetching on first use, open handles, reads, writes, truncation.
//!
//! A file starts remote. Read without a handle (the kernel opens files itself), a small one
//! is fetched — by background hydration, or by the read — into the mount's pack file and
//! read from there ([`super::pack`]). Otherwise the first `open` (or write, or truncation to
//! a non-zero size) fetches all its blocks, verifies each against its blake3 hash, and
//! writes them to the upper file `upper/<ino>` (a packed copy is copied out instead); from
//! then on every read and write goes to that local file. Opening with `O_TRUNC`, or
//! creating a file, needs no fetch at all.

use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use fuser::FileAttr;
use parking_lot::Mutex;

use super::error::FsError;
use super::fs::{AwcpFs, Handle, name_str};
use super::inode::{Data, Hash, Ino, Kind};
use super::journal::Record;
use super::pack::PACK_MAX;
use super::remote::RemoteError;

/// Blocks per fetch request (16 MiB at the default block size). With [`FETCH_LANES`]
/// requests in flight a fetch holds about two batches of the fetch budget.
const FETCH_BATCH: usize = 16;

/// Fetch requests in flight for one file: the export reads and sends the next batch while
/// this one is on the wire and being written.
const FETCH_LANES: usize = 2;

/// Blocks a fetch lane may have received and not yet handed to the writer.
const LANE_QUEUE: usize = 4;

/// Most bytes of neighbours an on-demand fetch of a small file brings along (about 8 ms
/// at 1 Gbit/s, 40 ms at 200 Mbit/s: less than one more round trip on such links).
const NEIGHBOUR_BYTES: u64 = 1 << 20;

/// Most neighbours an on-demand fetch of a small file brings along.
const NEIGHBOUR_FILES: usize = 255;

/// Most entries looked at to find a small file's neighbours.
const NEIGHBOUR_VISIT: usize = 4096;

/// Attribute changes requested by `setattr`.
#[derive(Debug, Default, Clone)]
pub struct SetAttr {
    /// New permission bits (the file-type bits are ignored).
    pub mode: Option<u32>,
    /// New owner.
    pub uid: Option<u32>,
    /// New group.
    pub gid: Option<u32>,
    /// New size.
    pub size: Option<u64>,
    /// New access time.
    pub atime: Option<SystemTime>,
    /// New modification time.
    pub mtime: Option<SystemTime>,
    /// The handle the change came through, if any.
    pub fh: Option<u64>,
    /// Who asks (`None`: the mount itself): set-user-ID and set-group-ID are cleared on
    /// chown, and on truncation by someone other than root.
    pub caller: Option<super::posix::Caller>,
}

/// How `open` was asked to open a file.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenMode {
    /// Reading allowed.
    pub read: bool,
    /// Writing allowed.
    pub write: bool,
    /// `O_APPEND`.
    pub append: bool,
    /// `O_TRUNC`.
    pub truncate: bool,
}

impl OpenMode {
    /// Decode `open(2)` flags.
    pub fn from_flags(flags: i32) -> OpenMode {
        let acc = flags & libc::O_ACCMODE;
        OpenMode {
            read: acc == libc::O_RDONLY || acc == libc::O_RDWR,
            write: acc == libc::O_WRONLY || acc == libc::O_RDWR,
            append: flags & libc::O_APPEND != 0,
            truncate: flags & libc::O_TRUNC != 0,
        }
    }
}

/// Remote files at least this large are streamed to readers without a handle (no-open)
/// once their reads are sequential ([`SEQUENTIAL_AFTER`]): a background thread fetches the
/// file, and a read waits only for the bytes it asks for.
pub const STREAM_MIN: u64 = 4 << 20;

/// Bytes of a large remote file read in one run (each read starting at or near where the run
/// has got to) after which its reads count as sequential and the rest of the file is
/// streamed. A reader that jumps about — SQLite, a pack's objects, the tail of a log — keeps
/// fetching only the blocks it reads; `cat`, `cp` or a checksum pay one ranged fetch of a
/// block or so and then read at the stream's speed.
pub const SEQUENTIAL_AFTER: u64 = 1 << 20;

/// Large files whose read runs are remembered ([`ReadRun`]).
pub(super) const READ_RUNS: usize = 64;

/// Blocks fetched ahead of a sequential reader of a large remote file that is not streamed
/// whole (hydration `first` and `none`, a git pack), at most. The window opens once the
/// reader has gone on into two blocks after the one it started in, and doubles at each
/// further block (2, 4, 8); each request for it brings half a window or more, several in
/// flight at a time. Over a link with a round trip of 20 ms a block a round trip caps a
/// sequential reader at 50 MB/s; blocks fetched ahead arrive while it reads.
pub const READ_AHEAD_MAX: u64 = 8;

/// Where a sequential reader of a large remote file has got to, in blocks, and how far
/// ahead of it blocks were asked for ([`READ_AHEAD_MAX`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct AheadRun {
    /// The last block read.
    last: u64,
    /// Blocks gone on into, one after another.
    crossings: u32,
    /// Blocks before this one were read or asked for ahead.
    until: u64,
}

/// The bytes `start..end` of a large remote file covered by its latest reads, one after
/// another, each starting within a block of the run (the kernel's readahead sends a
/// sequential reader's reads slightly out of order).
#[derive(Debug, Clone, Copy)]
pub(super) struct ReadRun {
    start: u64,
    end: u64,
}

/// An on-demand fetch of a file that starts less than this long after a fetch of the same
/// file failed on the network after waiting on it (at least [`FAILED_FETCH_SLOW`]), or
/// that waited for such a fetch, fails at once with `EIO`. The kernel answers a failed
/// read-ahead by reading the page again at once, and the reads of one `read(2)` may queue
/// behind one fetch: without this, one read during an outage would wait a request deadline
/// per attempt (the issue saw EIO only after 62 s with a 30 s deadline). A later read tries
/// the network again; so does any retry after a failure that came fast (a reset, a
/// refusal), which costs no waiting.
pub const FAILED_FETCH_MEMO: Duration = Duration::from_millis(250);

/// How long a failed fetch must have waited for [`FAILED_FETCH_MEMO`] to apply.
pub const FAILED_FETCH_SLOW: Duration = Duration::from_secs(1);

/// A large file being fetched in the background, readable as its blocks arrive.
#[derive(Debug, Default)]
pub(super) struct Stream {
    /// The fetch's temporary file, opened for reading once the fetch created it (it is
    /// renamed to the upper file at the end; this descriptor stays valid).
    file: std::sync::OnceLock<std::fs::File>,
    state: Mutex<StreamState>,
    cv: parking_lot::Condvar,
}

#[derive(Debug, Default)]
struct StreamState {
    /// Bytes written to the temporary file so far, from offset 0.
    written: u64,
    /// Readers waiting for bytes not written yet: while there are any, the stream's
    /// requests are the agent's and do not yield to other foreground fetches.
    waiting: usize,
    /// The fetch ended (with `failed` set if it failed).
    done: bool,
    failed: bool,
}

impl Stream {
    /// Whether no reader waits on the stream now (its next request is background work).
    fn unwaited(&self) -> bool {
        self.state.lock().waiting == 0
    }

    fn advance(&self, written: u64) {
        self.state.lock().written = written;
        self.cv.notify_all();
    }

    fn finish(&self, failed: bool) {
        let mut st = self.state.lock();
        st.done = true;
        st.failed = failed;
        drop(st);
        self.cv.notify_all();
    }
}

impl AwcpFs {
    /// Make sure `ino`'s content is in its upper file, fetching it if needed.
    pub(super) fn ensure_local(&self, ino: Ino) -> Result<(), FsError> {
        self.fetch_local(ino, None)
    }

    /// A read of a large remote file without a handle: the blocks it covers, until the
    /// file's reads are seen to be sequential (under a policy that streams, and never for a
    /// git pack); then, and for every later read, served from a background fetch of the
    /// whole file as soon as the blocks it covers are written (started here if none runs).
    /// `None` when the file is not a large remote one (any more): read it as usual.
    pub fn read_streamed(
        self: &Arc<Self>,
        ino: Ino,
        offset: u64,
        size: u32,
    ) -> Result<Option<Vec<u8>>, FsError> {
        let (file_size, git_pack) = {
            let table = self.table.lock();
            match table.get(ino) {
                Some(n)
                    if n.size >= STREAM_MIN
                        && matches!(n.data, Data::Remote { packed: None, .. }) =>
                {
                    (n.size, super::hydrate::is_git_pack(&table, n))
                }
                _ => return Ok(None),
            }
        };
        // Only a policy that streams, and never a git pack, has streams: otherwise there is
        // neither a stream to look for nor a run of reads to note.
        let may_stream = !git_pack && self.streams_whole.load(Ordering::Relaxed);
        if !may_stream
            || (!self.streams.lock().contains_key(&ino)
                && !self.reads_sequentially(ino, offset, size))
        {
            // Ranged: only the blocks this read covers (a block is the window around the
            // miss), each verified against its hash, kept a while for the kernel's next
            // piece of the same block. Nothing is stored as the file's content: an open for
            // writing still fetches the whole file first, so write-back is unchanged.
            let want = offset.saturating_add(u64::from(size)).min(file_size);
            let started = Instant::now();
            self.check_failed_fetch(ino, started)?;
            self.read_ahead(ino, offset, want);
            let r = self.read_remote_blocks(ino, offset, want);
            self.note_fetch(ino, started, &r);
            return r;
        }
        let stream = {
            let mut streams = self.streams.lock();
            match streams.get(&ino) {
                Some(s) => s.clone(),
                None => {
                    let s = Arc::new(Stream::default());
                    let (fs, bg) = (self.clone(), s.clone());
                    let spawned = std::thread::Builder::new()
                        .name("awcpfs-stream".into())
                        .spawn(move || {
                            let r = fs.fetch_local(ino, Some(&bg));
                            if let Err(e) = &r {
                                tracing::debug!(ino, error = %e, "streamed fetch failed");
                            }
                            fs.streams.lock().remove(&ino);
                            bg.finish(r.is_err());
                        });
                    if spawned.is_err() {
                        return Ok(None);
                    }
                    streams.insert(ino, s.clone());
                    s
                }
            }
        };
        let want = offset.saturating_add(u64::from(size)).min(file_size);
        // A read further ahead than the requests the stream has in flight (a random read
        // far into the file: the tail of a log, a pack's objects) fetches its own blocks
        // instead of waiting for every block before them; the stream goes on meanwhile.
        let ahead = (FETCH_LANES * FETCH_BATCH) as u64 * self.block_size();
        let far = {
            let st = stream.state.lock();
            !st.done && offset > st.written.saturating_add(ahead)
        };
        if far {
            let started = Instant::now();
            self.check_failed_fetch(ino, started)?;
            let r = self.read_remote_blocks(ino, offset, want);
            self.note_fetch(ino, started, &r);
            if let Some(data) = r? {
                return Ok(Some(data));
            }
        }
        let mut st = stream.state.lock();
        st.waiting += 1;
        while st.written < want && !st.done {
            stream.cv.wait(&mut st);
        }
        st.waiting -= 1;
        let (reached, failed) = (st.written >= want, st.failed);
        drop(st);
        self.check()?;
        if failed && !reached {
            return Err(FsError::from(std::io::Error::other(
                "fetching the file from the Delegator failed",
            )));
        }
        match stream.file.get() {
            // Fetched by someone else meanwhile (an open, a write): it is local now.
            Some(file) if reached => read_file(file, offset, size).map(Some),
            _ => Ok(None),
        }
    }

    /// Note a read of `size` bytes at `offset` of the large remote file `ino`: whether its
    /// run of reads has now covered [`SEQUENTIAL_AFTER`] bytes (then the run is forgotten:
    /// the file is about to be streamed). A read that does not continue the run starts a
    /// new one.
    fn reads_sequentially(&self, ino: Ino, offset: u64, size: u32) -> bool {
        let end = offset.saturating_add(u64::from(size));
        let slack = self.block_size();
        let mut runs = self.read_runs.lock();
        let run = match runs.get_mut(&ino) {
            Some(r)
                if offset <= r.end.saturating_add(slack)
                    && end >= r.start.saturating_sub(slack) =>
            {
                r.start = r.start.min(offset);
                r.end = r.end.max(end);
                *r
            }
            _ => {
                let r = ReadRun { start: offset, end };
                runs.put(ino, r);
                r
            }
        };
        let sequential = run.end - run.start >= SEQUENTIAL_AFTER;
        if sequential {
            runs.pop(&ino);
        }
        sequential
    }

    /// The export's block size in bytes (never 0).
    fn block_size(&self) -> u64 {
        u64::from(self.opts.block_size.max(1))
    }

    /// Bytes `offset..want` of remote file `ino`, from the blocks that hold them (the block
    /// cache first, then one request; every block verified). `None` if the file is no
    /// longer remote content.
    pub(super) fn read_remote_blocks(
        &self,
        ino: Ino,
        offset: u64,
        want: u64,
    ) -> Result<Option<Vec<u8>>, FsError> {
        if want <= offset {
            return Ok(Some(Vec::new()));
        }
        let block_size = self.block_size();
        let (first, last) = (offset / block_size, (want - 1) / block_size);
        let wanted: Vec<Hash> = {
            let table = self.table.lock();
            let range = match table.get(ino).map(|n| &n.data) {
                Some(d @ Data::Remote { packed: None, .. }) => {
                    d.remote_block_hashes().get(first as usize..=last as usize)
                }
                _ => None,
            };
            match range {
                Some(range) => range.to_vec(),
                None => return Ok(None),
            }
        };
        // Blocks fetched lately (verified then) are not asked for again, nor are blocks
        // another read is fetching now: this one waits for them, and asks for them itself
        // in a next round if that fetch failed.
        let mut blocks: Vec<Option<Arc<Vec<u8>>>> = vec![None; wanted.len()];
        loop {
            let mut waits: Vec<(usize, Arc<Flight>)> = Vec::new();
            let mut mine: Vec<(usize, Arc<Flight>)> = Vec::new();
            {
                let mut recent = self.recent_blocks.lock();
                let mut flying = self.blocks_in_flight.lock();
                for (i, h) in wanted.iter().enumerate() {
                    if blocks[i].is_some() {
                        continue;
                    }
                    blocks[i] = recent.get(h).cloned();
                    if blocks[i].is_none() {
                        match flying.get(h) {
                            Some(f) => waits.push((i, f.clone())),
                            None => {
                                let f = Arc::new(Flight::default());
                                flying.insert(*h, f.clone());
                                mine.push((i, f));
                            }
                        }
                    }
                }
            }
            if !mine.is_empty() {
                self.fetch_claimed(&wanted, &mine, &mut blocks)?;
            }
            let mut again = false;
            for (i, flight) in waits {
                blocks[i] = flight.wait();
                again |= blocks[i].is_none();
            }
            if !again {
                break;
            }
        }
        let blocks: Vec<Arc<Vec<u8>>> = blocks.into_iter().flatten().collect();
        let mut out = Vec::with_capacity((want - offset) as usize);
        for (i, block) in blocks.iter().enumerate() {
            let start = (first + i as u64) * block_size;
            let from = offset.saturating_sub(start).min(block.len() as u64) as usize;
            let to = (want - start).min(block.len() as u64) as usize;
            out.extend_from_slice(&block[from..to.max(from)]);
        }
        self.check()?;
        Ok(Some(out))
    }

    /// Note a ranged read of `offset..want` of the large remote file `ino` and, when its
    /// reads go on from block to block, fetch the next blocks in the background
    /// ([`READ_AHEAD_MAX`]): claimed as in flight first, so the reads that come to them
    /// wait for that fetch instead of asking again; a failed fetch leaves them to ask.
    fn read_ahead(self: &Arc<Self>, ino: Ino, offset: u64, want: u64) {
        if want <= offset {
            return;
        }
        let bs = self.block_size();
        let (first, last) = (offset / bs, (want - 1) / bs);
        let (from, to) = {
            let mut runs = self.read_ahead.lock();
            let fresh = AheadRun {
                last,
                crossings: 0,
                until: last + 1,
            };
            let Some(run) = runs.get_mut(&ino) else {
                runs.put(ino, fresh);
                return;
            };
            // The kernel's read-ahead sends a sequential reader's reads slightly out of
            // order: a read of the block before is part of the run; a jump is a new one.
            if first > run.last + 1 || last + 1 < run.last {
                *run = fresh;
                return;
            }
            if last <= run.last {
                return;
            }
            run.crossings = run
                .crossings
                .saturating_add(u32::try_from(last - run.last).unwrap_or(u32::MAX));
            run.last = last;
            if run.crossings < 2 {
                run.until = run.until.max(last + 1);
                return;
            }
            let window = (1u64 << (run.crossings - 1).min(3)).min(READ_AHEAD_MAX);
            // A reader asking for more than the window at a time fetches as much itself:
            // blocks ahead would only split its next request in two.
            if last - first + 1 > window {
                run.until = run.until.max(last + 1);
                return;
            }
            // Kept a window ahead; each request brings half a window or more (several in
            // flight fill a link whose round trip is longer than a block's transfer).
            let lead = run.until.saturating_sub(last + 1);
            if lead >= window {
                return;
            }
            let from = run.until.max(last + 1);
            // Never more than the recent blocks hold beside the reader's own: a block
            // pushed out before it is read would be fetched again.
            let to = (from + (window - lead).max(window.div_ceil(2)))
                .min(first + super::fs::RECENT_BLOCKS as u64);
            if from >= to {
                return;
            }
            run.until = to;
            (from, to)
        };
        let ahead: Vec<Hash> = {
            let table = self.table.lock();
            match table.get(ino).map(|n| &n.data) {
                Some(d @ Data::Remote { packed: None, .. }) => {
                    let hashes = d.remote_block_hashes();
                    let to = (to as usize).min(hashes.len());
                    hashes.get(from as usize..to).unwrap_or_default().to_vec()
                }
                _ => return,
            }
        };
        let mut mine: Vec<(usize, Arc<Flight>)> = Vec::new();
        {
            let recent = self.recent_blocks.lock();
            let mut flying = self.blocks_in_flight.lock();
            for (i, h) in ahead.iter().enumerate() {
                if !recent.contains(h) && !flying.contains_key(h) {
                    let f = Arc::new(Flight::default());
                    flying.insert(*h, f.clone());
                    mine.push((i, f));
                }
            }
        }
        if mine.is_empty() {
            return;
        }
        // Landed empty if the thread never runs the fetch (it could not be started): no
        // reader waits for these blocks forever.
        let mut unfetched = Unfetched {
            fs: self.clone(),
            flights: mine.iter().map(|(i, f)| (ahead[*i], f.clone())).collect(),
        };
        let spawned = std::thread::Builder::new()
            .name("awcpfs-ahead".into())
            .spawn(move || {
                let mut blocks = vec![None; ahead.len()];
                // From here `fetch_claimed` lands every flight, whatever happens.
                unfetched.flights.clear();
                if let Err(e) = unfetched.fs.fetch_claimed(&ahead, &mine, &mut blocks) {
                    tracing::debug!(ino, error = %e, "fetching blocks ahead of a reader failed");
                }
            });
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "cannot start a read-ahead fetch");
        }
    }

    /// Fetch the blocks of `wanted` this read claimed (`mine`: their indexes and flights),
    /// into `blocks` and the recent blocks, and land every flight, with its block or, if
    /// the fetch failed, empty (the readers waiting for it then ask themselves).
    fn fetch_claimed(
        &self,
        wanted: &[Hash],
        mine: &[(usize, Arc<Flight>)],
        blocks: &mut [Option<Arc<Vec<u8>>>],
    ) -> Result<(), FsError> {
        // Landed with nothing if this read ends without an answer (a panic): no reader
        // waits for it forever.
        let mut claim = Claim {
            fs: self,
            flights: mine.iter().map(|(i, f)| (wanted[*i], f.clone())).collect(),
        };
        let missing: Vec<String> = mine.iter().map(|(i, _)| hex::encode(wanted[*i])).collect();
        let fetched = {
            let _fg = self.priority.foreground();
            self.remote.fetch_blocks(&missing)
        };
        let (mut data, failed) = match fetched {
            Ok(f) if f.len() == mine.len() => (Some(f.into_iter()), None),
            Ok(_) => (
                None,
                Some(RemoteError::Protocol {
                    what: "fewer blocks than asked for".into(),
                }),
            ),
            Err(e) => (None, Some(e)),
        };
        let mut recent = self.recent_blocks.lock();
        let mut flying = self.blocks_in_flight.lock();
        for (i, flight) in mine {
            flying.remove(&wanted[*i]);
            let block = data.as_mut().and_then(|d| d.next()).map(Arc::new);
            if let Some(b) = &block {
                recent.put(wanted[*i], b.clone());
                blocks[*i] = Some(b.clone());
            }
            flight.land(block);
        }
        claim.flights.clear();
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// The leading blocks of `hashes` that recent ranged reads keep (the last 16 they
    /// fetched, verified then), up to the first one they do not.
    fn recent_lead(&self, hashes: &[Hash]) -> Vec<Arc<Vec<u8>>> {
        let mut recent = self.recent_blocks.lock();
        hashes
            .iter()
            .map_while(|h| recent.get(h).cloned())
            .collect()
    }

    /// Fetch `ino`'s content into its upper file unless it is local, publishing progress
    /// to `stream`.
    pub(super) fn fetch_local(&self, ino: Ino, stream: Option<&Stream>) -> Result<(), FsError> {
        let started = Instant::now();
        let r = self.fetch_local_inner(ino, stream, false, started);
        self.note_fetch(ino, started, &r);
        r
    }

    /// Fetch `ino` whole into its upper file as background work (hydration of a
    /// first-command file too large for the pack): every request yields to the agent's.
    pub(super) fn fetch_whole_in_background(&self, ino: Ino) -> Result<(), FsError> {
        self.fetch_local_inner(ino, None, true, Instant::now())
    }

    /// Remember when an on-demand fetch of `ino` that began at `started` failed on the
    /// network after waiting at least [`FAILED_FETCH_SLOW`] (forget it once one succeeds).
    fn note_fetch<T>(&self, ino: Ino, started: Instant, r: &Result<T, FsError>) {
        match r {
            Ok(_) => {
                let mut failed = self.failed_fetches.lock();
                if !failed.is_empty() {
                    failed.remove(&ino);
                }
            }
            Err(FsError::Remote { source })
                if !source.is_fatal() && started.elapsed() >= FAILED_FETCH_SLOW =>
            {
                self.failed_fetches.lock().insert(ino, Instant::now());
            }
            Err(_) => {}
        }
    }

    /// Fail an on-demand fetch of `ino` that began at `started` at once if a fetch of it
    /// failed on the network since, or less than [`FAILED_FETCH_MEMO`] before.
    fn check_failed_fetch(&self, ino: Ino, started: Instant) -> Result<(), FsError> {
        match self.failed_fetches.lock().get(&ino) {
            Some(at) if *at + FAILED_FETCH_MEMO >= started => Err(FsError::FetchFailedRecently),
            _ => Ok(()),
        }
    }

    fn fetch_local_inner(
        &self,
        ino: Ino,
        stream: Option<&Stream>,
        background: bool,
        started: Instant,
    ) -> Result<(), FsError> {
        let lock = {
            let mut h = self.hydrating.lock();
            h.entry(ino)
                .or_insert_with(|| Arc::new(Mutex::new(())))
                .clone()
        };
        let _guard = lock.lock();
        let (hash, blocks, packed, size, lead) = {
            let table = self.table.lock();
            let node = table.get(ino).ok_or(FsError::NotFound)?;
            table.refuse_withheld(ino)?;
            match &node.data {
                Data::Local { .. } => return Ok(()),
                Data::None => return Err(FsError::IsDir),
                d @ Data::Remote { hash, packed, .. } => (
                    *hash,
                    d.remote_blocks(),
                    *packed,
                    node.size,
                    self.recent_lead(d.remote_block_hashes()),
                ),
            }
        };
        if packed.is_none() {
            self.check_failed_fetch(ino, started)?;
        }
        let tmp = self.opts.upper_dir.join(format!(".fetch-{ino}"));
        let mut out = std::fs::File::create(&tmp)?;
        if let Some(s) = stream {
            let _ = s.file.set(std::fs::File::open(&tmp)?);
        }
        let mut fetched = 0u64;
        let mut publish = |bytes: &[u8]| -> Result<(), FsError> {
            out.write_all(bytes)?;
            fetched += bytes.len() as u64;
            if let Some(s) = stream {
                s.advance(fetched);
            }
            Ok(())
        };
        let written = match packed {
            // A copy is in the pack: no fetch.
            Some(off) => self.pack.copy_out(off, size, &mut publish),
            // Every block is verified against its hash as it arrives (the remote does it),
            // and the blocks are the manifest's for this content: no second pass over it.
            // The file's first blocks, fetched lately by ranged reads of it (and verified
            // then), are not asked for again: a stream starts once the reads have been in
            // order for a while, from the file's start.
            None => lead.iter().try_for_each(|b| publish(b)).and_then(|()| {
                let rest = blocks.get(lead.len()..).unwrap_or_default();
                let chunks: Vec<&[String]> = rest.chunks(FETCH_BATCH).collect();
                // Whose requests these are: the agent's (an open, a write), or background
                // work (hydration; a stream's blocks that no reader waits for yet).
                let yields = |_: usize| match stream {
                    Some(s) => s.unwaited(),
                    None => background,
                };
                // A stream's unwaited blocks also wait for the agent to pause; a first-command
                // file fetched whole in the background (git's index) only for its fetches.
                let quiet = stream.is_some();
                self.fetch_chunks(&chunks, yields, quiet, |block| publish(&block))
            }),
        };
        drop(out);
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, self.upper_path(ino))?;
        self.upper.forget(ino);
        let mut table = self.table.lock();
        if let Some(node) = table.get_mut(ino)
            && matches!(&node.data, Data::Remote { hash: now, .. } if *now == hash)
        {
            node.size = fetched;
            node.data = Data::Local {
                dirty: false,
                hash: Some(hash),
                generation: 0,
            };
        }
        // The lock stays in the map: replacing it while someone holds a clone would let two
        // writers of this upper file proceed at once.
        drop(table);
        Ok(())
    }

    /// Fetch `chunks` of blocks, one request per chunk and [`FETCH_LANES`] requests in
    /// flight, handing every block to `write` in order as soon as the blocks before it were
    /// written. Each lane streams its answer into a small queue; the mount-wide fetch budget
    /// is taken per chunk, in file order, so the chunk being written always holds its grant
    /// and a fetch never waits on budget its own later chunks hold.
    ///
    /// `yields(chunk)` says whether a chunk's request is background work: it then waits its
    /// turn behind the agent's fetches ([`super::hydrate::Priority`]) before taking its
    /// turn and budget; otherwise the request counts as a foreground fetch while on the
    /// wire. With `quiet`, a background request also waits for the agent's requests to
    /// pause ([`AwcpFs::background_turn`]).
    fn fetch_chunks(
        &self,
        chunks: &[&[String]],
        yields: impl Fn(usize) -> bool + Sync,
        quiet: bool,
        mut write: impl FnMut(Vec<u8>) -> Result<(), FsError>,
    ) -> Result<(), FsError> {
        /// The turn counter's value once a lane gave up: every lane stops.
        const ABORTED: usize = usize::MAX;
        type Item = Result<(Vec<u8>, Option<super::budget::Grant>), FsError>;
        let block_size = self.block_size();
        let lanes = FETCH_LANES.min(chunks.len()).max(1);
        // The next chunk whose grant may be taken.
        let turn = (Mutex::new(0usize), parking_lot::Condvar::new());
        let abort = || {
            *turn.0.lock() = ABORTED;
            turn.1.notify_all();
        };
        std::thread::scope(|scope| {
            let mut queues = Vec::with_capacity(lanes);
            for lane in 0..lanes {
                let (tx, rx) = std::sync::mpsc::sync_channel::<Item>(LANE_QUEUE);
                queues.push(rx);
                let (turn, abort, yields) = (&turn, &abort, &yields);
                scope.spawn(move || {
                    for (c, chunk) in chunks.iter().enumerate().skip(lane).step_by(lanes) {
                        // Before the turn and the budget: a waiting background lane holds
                        // nothing a foreground fetch could need.
                        if yields(c) {
                            if quiet {
                                self.background_turn(|| yields(c));
                            } else {
                                self.priority.wait_turn_while(|| yields(c));
                            }
                        }
                        let background = yields(c);
                        let mut grant = {
                            let mut next = turn.0.lock();
                            while *next != c && *next != ABORTED {
                                turn.1.wait(&mut next);
                            }
                            if *next == ABORTED {
                                return;
                            }
                            let g = self.fetch_budget.acquire(chunk.len() as u64 * block_size);
                            *next += 1;
                            turn.1.notify_all();
                            Some(g)
                        };
                        let last = chunk.len().saturating_sub(1);
                        let _fg = (!background).then(|| self.priority.foreground());
                        let fetched = self.check().and_then(|()| {
                            self.remote
                                .fetch_blocks_each(chunk, &mut |i, block| {
                                    // The grant goes with the chunk's last block: returned
                                    // once the whole chunk is written.
                                    let g = if i == last { grant.take() } else { None };
                                    tx.send(Ok((block, g))).map_err(|_| RemoteError::Io {
                                        source: std::io::Error::other("the fetch was abandoned"),
                                    })
                                })
                                .map_err(FsError::from)
                        });
                        if let Err(e) = fetched {
                            abort();
                            let _ = tx.send(Err(e));
                            return;
                        }
                    }
                });
            }
            let result = (|| {
                for (c, chunk) in chunks.iter().enumerate() {
                    for _ in 0..chunk.len() {
                        let (block, _grant) = queues[c % lanes].recv().map_err(|_| {
                            FsError::from(std::io::Error::other("a fetch lane ended early"))
                        })??;
                        write(block)?;
                    }
                }
                Ok(())
            })();
            // Dropping the queues (and the grants in them) makes any lane still sending give
            // up; then no lane waits for its turn any more.
            drop(queues);
            if result.is_err() {
                abort();
            }
            result
        })
    }

    /// Fetch several small files in one request into the pack (background hydration).
    /// Files someone else is fetching right now, or that became local or packed meanwhile,
    /// are skipped. Returns the number of files packed.
    pub fn prefetch(&self, files: &[Ino]) -> Result<usize, FsError> {
        self.fetch_packed(files, None)
    }

    /// The small remote files near `ino`, at most [`NEIGHBOUR_BYTES`] / [`NEIGHBOUR_FILES`]
    /// in all: first its own directory's (after it in name order, then before it), then
    /// those of the directories below that one, breadth first, then outwards (the parent's
    /// other subtrees, and so on up). A test run, an import or a
    /// build reads a directory's files together and then goes down into its subdirectories
    /// (`os.walk`, a package's subpackages), so one request brings what the next reads will
    /// want. At most [`NEIGHBOUR_VISIT`] entries are looked at (under the inode table's
    /// lock).
    fn small_neighbours(&self, ino: Ino) -> Vec<Ino> {
        let table = self.table.lock();
        let Some(parent) = table.get(ino).and_then(|n| table.get(n.parent)) else {
            return Vec::new();
        };
        let names: Vec<Ino> = parent.children.values().copied().collect();
        let at = names.iter().position(|i| *i == ino).unwrap_or(0);
        let mut out = Vec::new();
        let mut bytes = 0u64;
        let visited = std::cell::Cell::new(0usize);
        let mut dirs: std::collections::VecDeque<Ino> = std::collections::VecDeque::new();
        // Returns false once the budget is spent.
        let mut take = |i: Ino, dirs: &mut std::collections::VecDeque<Ino>| -> bool {
            visited.set(visited.get() + 1);
            let Some(n) = table.get(i) else { return true };
            if n.kind == Kind::Dir {
                // Git's internals are not what a test run or a build reads (hydration
                // fetches what git needs first).
                if n.name != ".git" {
                    dirs.push_back(i);
                }
                return true;
            }
            if n.kind != Kind::File
                || n.size > PACK_MAX
                || !matches!(n.data, Data::Remote { packed: None, .. })
                || table.is_withheld(i)
            {
                return true;
            }
            if bytes + n.size > NEIGHBOUR_BYTES || out.len() >= NEIGHBOUR_FILES {
                return false;
            }
            bytes += n.size;
            out.push(i);
            true
        };
        for i in names[at + 1..].iter().chain(names[..at].iter()) {
            if !take(*i, &mut dirs) {
                return out;
            }
        }
        // A first command's file (git's, an ignore file) is read on that command's critical
        // path, before hydration has it: its window stays in its own directory.
        if table
            .path_of(ino)
            .is_some_and(|p| super::hydrate::is_first_command_file(&p) || p.starts_with(".git/"))
        {
            return out;
        }
        // Then outwards: once the directories below are exhausted, those below the parent
        // (the siblings' subtrees), and so on up — a walk that reached a leaf goes on with
        // the next directory nearby, not with one request per leaf.
        let mut seen: std::collections::HashSet<Ino> = std::collections::HashSet::new();
        seen.insert(parent.ino);
        let mut up = parent.ino;
        loop {
            while let Some(d) = dirs.pop_front() {
                if visited.get() >= NEIGHBOUR_VISIT {
                    return out;
                }
                if !seen.insert(d) {
                    continue;
                }
                let Some(dir) = table.get(d) else { continue };
                for i in dir.children.values() {
                    if !take(*i, &mut dirs) {
                        return out;
                    }
                }
            }
            let Some(next) = table.get(up).map(|n| n.parent).filter(|p| *p != up) else {
                return out;
            };
            up = next;
            if !seen.insert(up) {
                return out;
            }
            let Some(dir) = table.get(up) else {
                return out;
            };
            for i in dir.children.values() {
                if !seen.contains(i) && !take(*i, &mut dirs) {
                    return out;
                }
            }
        }
    }

    /// Whether reading or writing `ino` needs nothing from the export (not a regular file
    /// whose content is still remote): the io_uring adapter answers those on the ring's
    /// own thread.
    pub fn content_is_local(&self, ino: Ino) -> bool {
        self.remote_of(ino).is_none()
    }

    /// Size and pack offset of `ino` if it is a regular file whose content is remote.
    fn remote_of(&self, ino: Ino) -> Option<(u64, Option<u64>)> {
        let table = self.table.lock();
        let n = table.get(ino).filter(|n| n.kind == Kind::File)?;
        match &n.data {
            Data::Remote { packed, .. } => Some((n.size, *packed)),
            _ => None,
        }
    }

    /// A read without a handle of a remote file (`len` bytes, at `packed` in the pack if it
    /// has a copy) that has a copy in the pack, or is small enough to get one now (see
    /// [`PACK_MAX`]). `None`: read it some other way.
    fn read_packed(
        &self,
        ino: Ino,
        (len, packed): (u64, Option<u64>),
        offset: u64,
        size: u32,
    ) -> Result<Option<Vec<u8>>, FsError> {
        let (len, off) = match packed {
            Some(off) => (len, off),
            None if len <= PACK_MAX && self.pack.has_room(len) => {
                let started = Instant::now();
                self.check_failed_fetch(ino, started)?;
                let mut files = vec![ino];
                if self.neighbours.load(Ordering::Relaxed) {
                    files.extend(self.small_neighbours(ino));
                }
                let r = self.fetch_packed(&files, Some(ino));
                self.note_fetch(ino, started, &r);
                r?;
                match self.remote_of(ino) {
                    Some((len, Some(off))) => (len, off),
                    _ => return Ok(None),
                }
            }
            None => return Ok(None),
        };
        // Copies never change: if the node changed since, this is the content it had when
        // the read began.
        Ok(Some(self.pack.read(off, len, offset, size)?))
    }

    /// Fetch `files` (those still remote without a copy) in one request and store each in
    /// the pack. A file someone else is fetching is skipped, except `wait_for`, which is
    /// waited for (a read needs it; the request is then a foreground one).
    fn fetch_packed(&self, files: &[Ino], wait_for: Option<Ino>) -> Result<usize, FsError> {
        self.check()?;
        let mut wanted: Vec<(Ino, Hash, Vec<String>)> = Vec::with_capacity(files.len());
        {
            let table = self.table.lock();
            for ino in files {
                if let Some(n) = table.get(*ino)
                    && let Data::Remote {
                        hash, packed: None, ..
                    } = &n.data
                {
                    wanted.push((*ino, *hash, n.data.remote_blocks()));
                }
            }
        }
        // What another batch is fetching right now is left to it (hydration and a read's
        // neighbours often ask for the same files at once); the file a read waits for is
        // fetched regardless — it never waits behind a background batch.
        let _claim = {
            let mut fetching = self.fetching.lock();
            wanted.retain(|w| Some(w.0) == wait_for || !fetching.contains(&w.0));
            FetchClaim {
                set: &self.fetching,
                inos: wanted
                    .iter()
                    .map(|w| w.0)
                    .filter(|i| fetching.insert(*i))
                    .collect(),
            }
        };
        // In tree order, each block once: the export then reads the files in the order they
        // sit in their directories (and mostly on its disk), not in hash order.
        let mut seen = std::collections::HashSet::new();
        let hashes: Vec<String> = wanted
            .iter()
            .flat_map(|w| w.2.iter())
            .filter(|h| seen.insert(h.as_str()))
            .cloned()
            .collect();
        if hashes.is_empty() {
            return Ok(0);
        }
        let bytes: u64 = {
            let table = self.table.lock();
            wanted
                .iter()
                .filter_map(|w| table.get(w.0).map(|n| n.size))
                .sum()
        };
        let _grant = self.fetch_budget.acquire(bytes);
        // `wait_for`: a read is waiting for this (foreground); otherwise it is hydration,
        // which waited its turn before it was called.
        let data = {
            let _fg = wait_for.map(|_| self.priority.foreground());
            match (self.remote.fetch_blocks(&hashes), wait_for) {
                (Ok(data), _) => data,
                // A remote answers all or fails, and a neighbour's blocks may be gone (its
                // file changed at the Delegator since the manifest, the change not here
                // yet): a neighbour never fails the read, which asks for its own file alone.
                (Err(e), Some(ino)) if wanted.len() > 1 && !e.is_fatal() => {
                    tracing::debug!(error = %e, ino, "fetching a file with its neighbours failed: the file alone");
                    drop(_grant);
                    return self.fetch_packed(&[ino], Some(ino));
                }
                (Err(e), _) => return Err(e.into()),
            }
        };
        let by_hash: std::collections::HashMap<&str, &[u8]> = hashes
            .iter()
            .map(String::as_str)
            .zip(data.iter().map(Vec::as_slice))
            .collect();
        let mut done = 0;
        for (ino, hash, blocks) in wanted {
            let lock = self.fetch_lock(ino);
            // An on-demand open is fetching it: leave it to that (or wait for it).
            let guard = if wait_for == Some(ino) {
                Some(lock.lock())
            } else {
                lock.try_lock()
            };
            let Some(_guard) = guard else {
                continue;
            };
            let still_remote = matches!(
                self.table.lock().get(ino).map(|n| &n.data),
                Some(Data::Remote { hash: h, packed: None, .. }) if *h == hash
            );
            if !still_remote {
                continue;
            }
            // Every block of the file came back (a remote answers all or fails; never
            // store a copy with a block missing).
            let Some(parts) = blocks
                .iter()
                .map(|b| by_hash.get(b.as_str()).copied())
                .collect::<Option<Vec<&[u8]>>>()
            else {
                continue;
            };
            // A full pack takes no more: the file stays remote, and is read from an upper
            // file of its own.
            let Some(off) = self.pack.store(parts.iter().copied())? else {
                continue;
            };
            let size: u64 = parts.iter().map(|p| p.len() as u64).sum();
            let mut table = self.table.lock();
            if let Some(node) = table.get_mut(ino)
                && let Data::Remote {
                    hash: h,
                    packed: p @ None,
                    ..
                } = &mut node.data
                && *h == hash
            {
                *p = Some(off);
                self.stats.add_packed(size);
                done += 1;
            }
        }
        Ok(done)
    }

    /// Files still remote, with no copy in the pack, whose size is at most `max_size`, in
    /// tree order.
    pub fn remote_small_files(&self, max_size: u64) -> Vec<(Ino, u64)> {
        let table = self.table.lock();
        let mut out = Vec::new();
        table.walk_nodes(|n| {
            if n.size <= max_size
                && matches!(n.data, Data::Remote { packed: None, .. })
                && !table.is_withheld(n.ino)
            {
                out.push((n.ino, n.size));
            }
        });
        out
    }

    /// The per-inode fetch lock: whoever holds it may replace the inode's upper file.
    fn fetch_lock(&self, ino: Ino) -> Arc<Mutex<()>> {
        self.hydrating
            .lock()
            .entry(ino)
            .or_insert_with(|| Arc::new(Mutex::new(())))
            .clone()
    }

    /// Replace `ino`'s content with an empty local file (no fetch needed).
    fn make_local_empty(&self, ino: Ino) -> Result<(), FsError> {
        // Wait for a background fetch of this file, which would otherwise rename its result
        // over the emptied upper file.
        let lock = self.fetch_lock(ino);
        let _guard = lock.lock();
        let mut table = self.table.lock();
        let node = table.get_mut(ino).ok_or(FsError::NotFound)?;
        if node.kind != Kind::File {
            return Err(FsError::IsDir);
        }
        match self.bypass.file(ino) {
            // Written by the kernel directly: emptied through the mount's own descriptor
            // (see `mount/bypass.rs`).
            Some(f) => f?.set_len(0)?,
            None => {
                std::fs::File::create(self.upper_path(ino))?;
                // (A new file if there was none: no descriptor kept from before may reach
                // it.)
                self.upper.forget(ino);
            }
        }
        mark_dirty(node);
        node.size = 0;
        table.mark_node(ino);
        Ok(())
    }

    /// `setattr`.
    pub fn setattr(&self, ino: Ino, set: SetAttr) -> Result<FileAttr, FsError> {
        self.check_write()?;
        self.table.lock().refuse_withheld(ino)?;
        if let Some(size) = set.size {
            let is_file = self.table.lock().get(ino).map(|n| n.kind) == Some(Kind::File);
            if !is_file {
                return Err(FsError::IsDir);
            }
            if size == 0 {
                self.make_local_empty(ino)?;
            } else {
                self.ensure_local(ino)?;
                self.upper_writer(ino)?.set_len(size)?;
            }
        }
        let mut table = self.table.lock();
        table.mark_node(ino);
        let node = table.get_mut(ino).ok_or(FsError::NotFound)?;
        // Put back if the record cannot be journaled: a chmod, chown or utimes that fails
        // (`ENOSPC`) has not happened. (A size change has already reached the upper file.)
        let before = (
            node.perm, node.uid, node.gid, node.atime, node.mtime, node.ctime,
        );
        let now = SystemTime::now();
        if let Some(size) = set.size {
            node.size = size;
            node.mtime = now;
            mark_dirty(node);
        }
        if let Some(mode) = set.mode {
            node.perm = (mode & 0o7777) as u16;
        } else if let Some(caller) = set.caller {
            if set.uid.is_some() || set.gid.is_some() {
                node.perm = super::posix::kill_on_chown(node.perm, node.kind, caller);
            } else if set.size.is_some() {
                node.perm = super::posix::kill_on_truncate(node.perm, caller);
            }
        }
        if let Some(uid) = set.uid {
            node.uid = uid;
        }
        if let Some(gid) = set.gid {
            node.gid = gid;
        }
        if let Some(t) = set.atime {
            node.atime = t;
        }
        if let Some(t) = set.mtime {
            node.mtime = t;
            // Keep the upper file's mtime in step: open handles compare it to notice changes
            // made by the kernel directly (passthrough).
            if matches!(node.data, Data::Local { .. })
                && let Ok(f) = self.upper_writer(ino)
            {
                let _ = f.set_modified(t);
            }
        }
        node.ctime = now;
        let attr = self.attr_of(node);
        // An unlinked file is never written back, and its record would name the path it
        // had: replayed after a crash, it would put the old file back over whatever took
        // that name (with the writeback cache the kernel sends the times of a file replaced
        // by `rename` after the rename).
        let rec = (!node.unlinked).then(|| Record::node(node));
        if let Some(rec) = rec
            && let Err(e) = self.journal(&[rec])
        {
            if set.size.is_none()
                && let Some(node) = table.get_mut(ino)
            {
                (
                    node.perm, node.uid, node.gid, node.atime, node.mtime, node.ctime,
                ) = before;
            }
            return Err(e);
        }
        drop(table);
        self.sync.request();
        Ok(attr)
    }

    fn open_upper(&self, ino: Ino, mut mode: OpenMode) -> Result<u64, FsError> {
        // Under the writeback cache the kernel places appends itself and writes whole
        // pages back at their offsets: an upper file opened `O_APPEND` would append each
        // page again (Linux `pwrite` ignores the offset then).
        if self.writeback_cache() {
            mode.append = false;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(mode.write)
            .append(mode.append)
            .custom_flags(libc::O_CLOEXEC)
            .open(self.upper_path(ino))?;
        {
            let mut table = self.table.lock();
            let node = table.get_mut(ino).ok_or(FsError::NotFound)?;
            node.open_handles += 1;
            if mode.write {
                node.open_writers += 1;
            }
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(
            fh,
            Arc::new(Handle {
                ino,
                file,
                writable: mode.write,
                append: mode.append,
                wrote: AtomicBool::new(false),
            }),
        );
        Ok(fh)
    }

    /// `open`: fetch the content if needed and open the upper file.
    pub fn open(&self, ino: Ino, mode: OpenMode) -> Result<u64, FsError> {
        self.wait_primed(ino);
        if let Some(r) = self.aecp.open(ino, mode.write || mode.truncate) {
            return r;
        }
        self.aecp.observe_ino(&self.table, ino);
        if mode.write || mode.truncate {
            self.check_write()?;
        } else {
            self.check()?;
        }
        let kind = {
            let table = self.table.lock();
            table.refuse_withheld(ino)?;
            table.get(ino).ok_or(FsError::NotFound)?.kind
        };
        if kind != Kind::File {
            return Err(FsError::IsDir);
        }
        if mode.truncate && mode.write {
            self.make_local_empty(ino)?;
            let rec = {
                let mut table = self.table.lock();
                let node = table.get_mut(ino).ok_or(FsError::NotFound)?;
                node.mtime = SystemTime::now();
                node.ctime = node.mtime;
                Record::node(node)
            };
            self.journal(&[rec])?;
        } else {
            self.ensure_local(ino)?;
        }
        let fh = self.open_upper(ino, mode)?;
        if mode.truncate && mode.write {
            self.mark_wrote(fh);
        }
        Ok(fh)
    }

    fn mark_wrote(&self, fh: u64) {
        if let Some(h) = self.handles.lock().get(&fh) {
            h.wrote.store(true, Ordering::Relaxed);
        }
    }

    /// `create`, owned by the mount's owner.
    pub fn create(
        &self,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        flags: i32,
    ) -> Result<(FileAttr, u64), FsError> {
        self.create_as(self.owner(), parent, name, mode, flags)
    }

    /// `create` by `caller`: a new, empty, local file, opened (handle 0 once the kernel
    /// opens files itself).
    pub fn create_as(
        &self,
        caller: super::posix::Caller,
        parent: Ino,
        name: &OsStr,
        mode: u32,
        flags: i32,
    ) -> Result<(FileAttr, u64), FsError> {
        self.check_write()?;
        let name = name_str(name)?;
        let name = &*name;
        let ino = {
            let mut table = self.table.lock();
            let dir = table.get(parent).ok_or(FsError::NotFound)?;
            if dir.kind != Kind::Dir {
                return Err(FsError::NotDir);
            }
            if table.child(parent, name).is_some() {
                return Err(FsError::Exists);
            }
            let ino = table.alloc_ino();
            self.upper.create(ino)?;
            let node = self.new_node(
                &table,
                caller,
                ino,
                (parent, name),
                Kind::File,
                (mode & 0o7777) as u16,
            );
            if self.no_open() {
                // Before the syncer can see the node (we hold the table's lock): it must
                // not take the empty file its writer is about to fill.
                self.recent_writes.lock().insert(
                    ino,
                    super::fs::RecentWrite {
                        at: Some(std::time::Instant::now()),
                        writing: 0,
                        created: true,
                        // Its creation's record names it as a local file already.
                        journaled: true,
                        unjournaled: false,
                        bypassed: false,
                    },
                );
            }
            if let Err(e) = self.add_child_node(&mut table, node) {
                // Not created (its record could not be journaled): nothing is left of it.
                self.recent_writes.lock().remove(&ino);
                self.upper.remove(ino);
                return Err(e);
            }
            ino
        };
        if self.no_open() {
            // The kernel sends no `release` at all once it opens files itself, not even
            // for created files: no handle to keep, the new file is written like any other
            // file opened without asking.
            let attr = self.getattr(ino)?;
            return Ok((attr, 0));
        }
        let mut om = OpenMode::from_flags(flags);
        om.write = true;
        let fh = self.open_upper(ino, om)?;
        self.mark_wrote(fh);
        let attr = self.getattr(ino)?;
        Ok((attr, fh))
    }

    /// The open file behind `fh` (the FUSE adapter hands its upper file to the kernel for
    /// passthrough).
    pub fn handle(&self, fh: u64) -> Result<Arc<Handle>, FsError> {
        self.handles
            .lock()
            .get(&fh)
            .cloned()
            .ok_or(FsError::BadHandle)
    }

    /// The handle a request names. Handle 0 is a file the kernel opened without asking
    /// (no-open): a handle for this one request on the upper file, the content fetched
    /// first. Handles of `open` and `create` start at 1.
    pub fn handle_for(&self, ino: Ino, fh: u64, write: bool) -> Result<Arc<Handle>, FsError> {
        if fh != 0 || !self.no_open() {
            return self.handle(fh);
        }
        if write {
            // (A write while the mount drains the kernel's dirty pages at its end is the
            // kernel writing back, see `AwcpFs::set_draining`.)
            self.check_write_back()?;
            if self.opts.read_only {
                return Err(FsError::ReadOnly);
            }
        }
        // Refuses what is not a file (`IsDir`).
        self.ensure_local(ino)?;
        if let Some(f) = self.bypass.file(ino) {
            // Written by the kernel directly: through the mount's own descriptor, not one
            // kept open whose close would look like the kernel's (see `mount/bypass.rs`).
            return Ok(Arc::new(Handle {
                ino,
                file: f?,
                writable: true,
                append: false,
                wrote: AtomicBool::new(false),
            }));
        }
        Ok(self.upper.loose(ino)?)
    }

    /// A descriptor to change `ino`'s upper file through (see [`AwcpFs::handle_for`]).
    fn upper_writer(&self, ino: Ino) -> std::io::Result<std::fs::File> {
        match self.bypass.file(ino) {
            Some(f) => f,
            None => OpenOptions::new().write(true).open(self.upper_path(ino)),
        }
    }

    /// A write without a handle (no-open) starts on `ino`: until it ends and no write has
    /// touched the file for [`WRITE_QUIET`](super::fs::WRITE_QUIET) (the kernel does not
    /// say when it is closed), the syncer leaves the file alone and a Delegator-side change
    /// does not replace it. Noted under the table's lock, which a Delegator-side change
    /// holds from its check to replacing the file, before the upper file is opened.
    fn begin_handleless_write(&self, ino: Ino) {
        let _table = self.table.lock();
        let mut recent = self.recent_writes.lock();
        let e = recent.entry(ino).or_default();
        e.at = Some(std::time::Instant::now());
        e.writing += 1;
    }

    /// The write [`begun`](Self::begin_handleless_write) on `ino` ended. The kernel does
    /// not say when the writer closes the file, so each write is acknowledged as if it were
    /// the last: the first one that happened (`done`) in a run of writes is journaled before
    /// it is answered, naming the file as changed here (recovery sends what its upper file
    /// holds then, every answered write included); the node as the run leaves it is
    /// journaled when the run ends ([`AwcpFs::quiet_writes`]) or at an `fsync`. A linker's
    /// thousands of small writes cost one record, not one each.
    fn end_handleless_write(&self, ino: Ino, done: bool) {
        let first = {
            let _table = self.table.lock();
            let mut recent = self.recent_writes.lock();
            let e = recent.entry(ino).or_default();
            e.at = Some(std::time::Instant::now());
            e.writing = e.writing.saturating_sub(1);
            e.created &= !done;
            let first = done && !e.journaled;
            e.journaled |= done;
            e.unjournaled |= done && !first;
            first
        };
        if done {
            if first && let Err(e) = self.journal_node(ino) {
                tracing::warn!(error = %e, "cannot journal a write");
                // The next write tries again.
                if let Some(e) = self.recent_writes.lock().get_mut(&ino) {
                    e.journaled = false;
                }
            }
            self.stats.note_closed_write(ino);
        }
        self.sync.request();
    }

    /// The upper file of `ino`, opened read-only, to register with the kernel as the backing
    /// file of a created file (see [`AwcpFs::pass_writes_through`]).
    pub fn upper_for_backing(&self, ino: Ino) -> std::io::Result<std::fs::File> {
        let f = std::fs::File::open(self.upper_path(ino))?;
        // The times `stat` shows of such a file are the upper file's: from the start, the
        // ones `create` answered.
        if let Some(t) = self.table.lock().get(ino).map(|n| n.mtime) {
            f.set_modified(t)?;
        }
        Ok(f)
    }

    /// The kernel will write `ino`, just created, directly (FUSE passthrough, see
    /// `mount/bypass.rs`): watch its upper file for those writes from now until the kernel
    /// forgets the inode. An error (no inotify, or no watch left) means the file must not be
    /// handed over.
    pub fn pass_writes_through(self: &Arc<Self>, ino: Ino) -> std::io::Result<()> {
        self.bypass.watch(self, ino, &self.upper_path(ino))?;
        if let Some(node) = self.table.lock().get_mut(ino) {
            node.bypassed = true;
        }
        self.stats.add_passthrough_open();
        Ok(())
    }

    /// The kernel wrote `ino`'s upper file directly (an event of `mount/bypass.rs`): a write
    /// without a handle that ended now (see [`AwcpFs::end_handleless_write`]). The first of
    /// a run takes the node's size and times from the upper file and journals it, naming
    /// the file as changed here; the run's end does that again.
    pub(super) fn bypassed_write(&self, ino: Ino) {
        let first = {
            let table = self.table.lock();
            // (An unlinked file is never written back.)
            if table.get(ino).is_none_or(|n| n.unlinked) {
                return;
            }
            let mut recent = self.recent_writes.lock();
            let e = recent.entry(ino).or_default();
            e.at = Some(std::time::Instant::now());
            e.created = false;
            e.bypassed = true;
            let first = !e.journaled;
            e.journaled = true;
            e.unjournaled |= !first;
            first
        };
        if first {
            self.take_bypassed(&mut self.table.lock(), ino);
            if let Err(e) = self.journal_node(ino) {
                tracing::warn!(error = %e, "cannot journal a write");
                if let Some(e) = self.recent_writes.lock().get_mut(&ino) {
                    e.journaled = false;
                }
            }
        }
        self.stats.note_closed_write(ino);
        self.sync.request();
    }

    /// Keep `id`, the backing id the `create` reply for `ino` named, until the kernel has
    /// opened its backing file (see `mount/bypass.rs`).
    pub fn hold_backing(&self, ino: Ino, id: super::bypass::HeldId) {
        self.bypass.hold(ino, id);
    }

    /// Nothing has `ino`'s upper file open any more (`mount/bypass.rs`): the kernel writes it
    /// no more. Its last writes are taken, and it is an ordinary file from now on.
    pub(super) fn bypass_closed(&self, ino: Ino) {
        self.bypassed_write(ino);
        let mut table = self.table.lock();
        if table.get(ino).is_some_and(|n| n.bypassed) {
            self.take_bypassed(&mut table, ino);
            if let Some(node) = table.get_mut(ino) {
                node.bypassed = false;
            }
        }
    }

    /// Take `ino`'s size and times from its upper file, which the kernel writes directly,
    /// and count its content as changed.
    pub(super) fn take_bypassed(&self, table: &mut super::inode::InodeTable, ino: Ino) {
        let meta = std::fs::metadata(self.upper_path(ino));
        let Some(node) = table.get_mut(ino) else {
            return;
        };
        if let Ok(m) = meta {
            node.size = m.len();
            if let Ok(t) = m.modified() {
                node.mtime = t;
                node.ctime = node.ctime.max(t);
            }
        }
        mark_dirty(node);
        table.mark_node(ino);
        self.changes.note_write(ino);
    }

    /// Run `write`, a change to `ino`'s content through `fh`, bracketed as a write without a
    /// handle when `fh` is 0 (see [`AwcpFs::begin_handleless_write`]).
    pub(super) fn writing<T>(
        &self,
        ino: Ino,
        fh: u64,
        write: impl FnOnce() -> Result<T, FsError>,
    ) -> Result<T, FsError> {
        if fh != 0 || !self.no_open() {
            return write();
        }
        self.begin_handleless_write(ino);
        let r = write();
        self.end_handleless_write(ino, r.is_ok());
        r
    }

    /// `read` of `ino` through `fh` (0: opened without asking; a large remote file is then
    /// streamed, see [`AwcpFs::read_streamed`]).
    pub fn read_at(
        self: &Arc<Self>,
        ino: Ino,
        fh: u64,
        offset: u64,
        size: u32,
    ) -> Result<Vec<u8>, FsError> {
        self.check()?;
        if let Some(r) = self.aecp.read(&self.table, ino, offset, size) {
            return r;
        }
        self.table.lock().refuse_withheld(ino)?;
        // One look at the node first: a local file, the usual case, needs neither path.
        if fh == 0
            && self.no_open()
            && let Some(remote) = self.remote_of(ino)
        {
            if let Some(data) = self.read_packed(ino, remote, offset, size)? {
                return Ok(data);
            }
            if let Some(data) = self.read_streamed(ino, offset, size)? {
                return Ok(data);
            }
        }
        let h = self.handle_for(ino, fh, false)?;
        read_file(&h.file, offset, size)
    }

    /// `write` to `ino` through `fh` (0: opened without asking).
    pub fn write_at(&self, ino: Ino, fh: u64, offset: u64, data: &[u8]) -> Result<u32, FsError> {
        self.check_write_back()?;
        self.writing(ino, fh, || {
            let h = self.handle_for(ino, fh, true)?;
            self.write_handle(&h, offset, data)
        })
    }

    /// `flush` through `fh`: nothing to do for a file opened without asking (its writes are
    /// journaled as they come).
    pub fn flush_at(&self, fh: u64) -> Result<(), FsError> {
        if fh == 0 && self.no_open() {
            return self.check();
        }
        self.flush(fh)
    }

    /// `fsync` of `ino` through `fh` (0: opened without asking): the upper file and the
    /// journal reach the disk.
    pub fn fsync_at(&self, ino: Ino, fh: u64, datasync: bool) -> Result<(), FsError> {
        self.check()?;
        let h = self.handle_for(ino, fh, false)?;
        if datasync {
            h.file.sync_data()?;
        } else {
            h.file.sync_all()?;
        }
        if fh == 0 {
            // Written by the kernel directly: what it wrote is in the upper file, not yet in
            // the table.
            let mut table = self.table.lock();
            if table.get(ino).is_some_and(|n| n.bypassed) {
                self.take_bypassed(&mut table, ino);
            }
            drop(table);
            // Its writes were journaled as they came; this records the node as it is now.
            self.journal_node(ino)?;
        } else {
            self.settle(&h)?;
        }
        self.sync_namespace()?;
        Ok(())
    }

    /// `read`.
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>, FsError> {
        self.check()?;
        let h = self.handle(fh)?;
        read_file(&h.file, offset, size)
    }

    /// `write`.
    pub fn write(&self, fh: u64, offset: u64, data: &[u8]) -> Result<u32, FsError> {
        self.check()?;
        let h = self.handle(fh)?;
        self.write_handle(&h, offset, data)
    }

    fn write_handle(&self, h: &Handle, offset: u64, data: &[u8]) -> Result<u32, FsError> {
        if !h.writable {
            return Err(FsError::BadHandle);
        }
        // With O_APPEND the upper file is opened O_APPEND too, and Linux pwrite appends.
        h.file.write_all_at(data, offset)?;
        let end = if h.append {
            h.file.metadata()?.len()
        } else {
            offset + data.len() as u64
        };
        h.wrote.store(true, Ordering::Relaxed);
        let mut table = self.table.lock();
        table.mark_node(h.ino);
        self.changes.note_write(h.ino);
        if let Some(node) = table.get_mut(h.ino) {
            node.size = node.size.max(end);
            // Under the writeback cache the kernel stamps the times at the `write(2)` and
            // sends them as a `setattr` when it writes the inode back, which may reach us
            // before these pages do: ours would be later than the ones it shows.
            if !self.writeback_cache() {
                node.mtime = SystemTime::now();
                node.ctime = node.mtime;
            }
            mark_dirty(node);
        }
        Ok(data.len() as u32)
    }

    /// Journal a handle's node after writes and ask the syncer to run.
    fn settle(&self, h: &Handle) -> Result<(), FsError> {
        if !h.wrote.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        self.journal_node(h.ino)?;
        self.stats.note_closed_write(h.ino);
        self.sync.request();
        Ok(())
    }

    /// Journal `ino`'s node as it stands (nothing for an unlinked file: it is never
    /// written back).
    fn journal_node(&self, ino: Ino) -> Result<(), FsError> {
        let rec = self
            .table
            .lock()
            .get(ino)
            .filter(|n| !n.unlinked)
            .map(Record::node);
        match rec {
            Some(rec) => self.journal(&[rec]),
            None => Ok(()),
        }
    }

    /// `flush` (every `close` of a descriptor).
    pub fn flush(&self, fh: u64) -> Result<(), FsError> {
        self.check()?;
        let h = self.handle(fh)?;
        self.settle(&h)
    }

    /// `release`: the last descriptor of an open file is closed. Never fails because of the
    /// fence, so handles are always accounted for.
    pub fn release(&self, fh: u64) -> Result<(), FsError> {
        let Some(h) = self.handles.lock().remove(&fh) else {
            return Err(FsError::BadHandle);
        };
        if self.fenced().is_none() {
            self.settle(&h)?;
        }
        let mut table = self.table.lock();
        if let Some(node) = table.get_mut(h.ino) {
            node.open_handles = node.open_handles.saturating_sub(1);
            if h.writable {
                node.open_writers = node.open_writers.saturating_sub(1);
            }
            if node.unlinked && node.open_handles == 0 {
                table.remove(h.ino);
                self.upper.remove(h.ino);
            }
        }
        drop(table);
        // The last writer closing makes a file the syncer skipped syncable again. A
        // read-only close changes nothing to write back: waking the syncer for it would
        // make every file of a tree walk cost a sync round.
        if h.writable {
            self.sync.request();
        }
        Ok(())
    }

    /// Number of open file handles.
    pub fn open_handle_count(&self) -> usize {
        self.handles.lock().len()
    }
}

/// The blocks one read claimed to fetch; any still claimed when it is dropped land empty.
struct Claim<'a> {
    fs: &'a AwcpFs,
    flights: Vec<(Hash, Arc<Flight>)>,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        land_empty(self.fs, &mut self.flights);
    }
}

/// Land `flights` with nothing (their readers then ask for the blocks themselves) and take
/// them out of the blocks in flight, unless another fetch has claimed a block since.
fn land_empty(fs: &AwcpFs, flights: &mut Vec<(Hash, Arc<Flight>)>) {
    if flights.is_empty() {
        return;
    }
    let mut flying = fs.blocks_in_flight.lock();
    for (h, f) in flights.drain(..) {
        if flying.get(&h).is_some_and(|g| Arc::ptr_eq(g, &f)) {
            flying.remove(&h);
        }
        f.land(None);
    }
}

/// Blocks claimed for a fetch ahead of a reader that has not started: landed empty (their
/// readers then ask themselves) if it is dropped before it is cleared.
struct Unfetched {
    fs: Arc<AwcpFs>,
    flights: Vec<(Hash, Arc<Flight>)>,
}

impl Drop for Unfetched {
    fn drop(&mut self) {
        land_empty(&self.fs, &mut self.flights);
    }
}

/// A block a ranged read is fetching (`AwcpFs::blocks_in_flight`): other reads of it wait
/// until it lands, or until the fetch fails (`None`: they ask for it themselves).
#[derive(Debug, Default)]
pub(crate) struct Flight {
    landed: Mutex<Option<Option<Arc<Vec<u8>>>>>,
    cv: parking_lot::Condvar,
}

impl Flight {
    fn land(&self, block: Option<Arc<Vec<u8>>>) {
        *self.landed.lock() = Some(block);
        self.cv.notify_all();
    }

    fn wait(&self) -> Option<Arc<Vec<u8>>> {
        let mut landed = self.landed.lock();
        loop {
            if let Some(b) = &*landed {
                return b.clone();
            }
            self.cv.wait(&mut landed);
        }
    }
}

/// Mark a file's content changed.
pub(super) fn mark_dirty(node: &mut super::inode::Node) {
    let generation = match &node.data {
        Data::Local { generation, .. } => generation + 1,
        _ => 1,
    };
    node.data = Data::Local {
        dirty: true,
        hash: None,
        generation,
    };
}

/// Files a batch fetch claimed in [`AwcpFs::fetching`](super::fs::AwcpFs), given back
/// when it ends (stored, skipped or failed).
struct FetchClaim<'a> {
    set: &'a parking_lot::Mutex<std::collections::HashSet<Ino>>,
    inos: Vec<Ino>,
}

impl Drop for FetchClaim<'_> {
    fn drop(&mut self) {
        let mut set = self.set.lock();
        for i in &self.inos {
            set.remove(i);
        }
    }
}

/// Read up to `size` bytes at `offset` from `file` (short only at its end).
fn read_file(file: &std::fs::File, offset: u64, size: u32) -> Result<Vec<u8>, FsError> {
    let mut buf = vec![0u8; size as usize];
    let mut done = 0;
    while done < buf.len() {
        let n = file.read_at(&mut buf[done..], offset + done as u64)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    buf.truncate(done);
    Ok(buf)
}
