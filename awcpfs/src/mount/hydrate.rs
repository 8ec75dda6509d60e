//! What a mount pulls before it is asked, and how the agent's own reads go first.
//!
//! **Policies** ([`HydratePolicy`]): `none` fetches nothing unasked; `first` fetches the
//! files the agent's first commands read (git's index, `HEAD`, config, refs, `packed-refs`,
//! pack indexes, `info/`, and every `.gitignore`/`.gitattributes`: [`is_first_command_file`])
//! in a few requests right after the mount starts; `all[:MAX]` does that, then every other
//! file of at most `MAX` bytes (256 KiB by default). Large files are never hydrated: they are
//! read block by block, streamed to their readers once those read in order (`all`; never a
//! git pack, see `is_git_pack`, and [`SEQUENTIAL_AFTER`](super::content::SEQUENTIAL_AFTER)),
//! or fetched whole on an open; the head of a large git pack is fetched ahead.
//!
//! **Priority** ([`Priority`]): every fetch made for a request of the agent (an open, a read,
//! a read far into a large file) holds a [`Foreground`] guard around its request to the
//! export. Background work — hydration batches, and the blocks of a large file's stream
//! that no reader waits for yet — asks [`Priority::wait_turn`] before each request it sends,
//! and waits while a foreground fetch is in flight and for [`QUIET`] after the last one
//! ended (a first command makes its fetches one after another, with a little local work in
//! between). A background request already on the wire is not cut short: batches are kept
//! small (at most 1 MiB) so that is a bounded delay. The guard is only taken after the
//! fetch's own locks (the per-file fetch lock, the fetch budget), and a background fetch
//! never holds such a lock while it waits its turn, so the two cannot wait on each other.
//!
//! Background work that is not what the agent's first commands need — hydration of the
//! other small files (`all`), and a large file's stream blocks that no reader waits for —
//! also waits while the agent is **active** at all: while the mount served any FUSE request
//! in the last [`QUIET`] (a cold `git status` is some 20,000 lookups and a dozen reads; the
//! lookups are served locally, but hydration's work — the export reading and hashing, the
//! mount writing the pack — takes the same CPUs). So that a busy agent does not stop
//! hydration for good, such a request waits at most [`ACTIVITY_MAX_WAIT`]. With the export
//! on this machine (loopback), where a background request takes no link time from the
//! agent's, that work waits — once the mount has served for [`LOCAL_GRACE`], so that the
//! agent's first command runs alone — only for the agent's requests other than reads, and
//! runs beside its reads and fetches: a read of the whole tree then gets hydration's help
//! instead of fetching every file itself, one window after another
//! ([`Priority::background_turn`]).
//!
//! **Progress** ([`Progress`]): the plan's files and bytes, what was hydrated, and how often
//! hydration yielded to the agent, in `status.json` as `hydration`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use super::fs::AwcpFs;
use super::inode::{Data, Ino, Kind};

/// The default largest file `all` hydrates.
pub const DEFAULT_ALL_MAX: u64 = 256 << 10;

/// How long background fetches keep waiting after the last foreground fetch ended.
pub const QUIET: Duration = Duration::from_millis(30);

/// Longest a background request waits for the agent's requests to pause (see the module
/// docs); foreground fetches in flight are always waited for.
pub const ACTIVITY_MAX_WAIT: Duration = Duration::from_secs(1);

/// With the export on this machine, how long after the mount starts serving background work
/// the agent's first commands do not need still waits for every request of the agent to
/// pause, as over a network (see [`Priority::background_turn`]): a first `git status`, `ls`
/// or `git log` then runs alone on the CPUs.
pub const LOCAL_GRACE: Duration = Duration::from_secs(1);

/// Most bytes one hydration request asks for (its answer delays a foreground fetch that
/// starts meanwhile by at most this much on the wire).
const BATCH_BYTES: u64 = 1 << 20;

/// Most files one hydration request asks for.
const BATCH_FILES: usize = 256;

/// What a mount fetches before it is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HydratePolicy {
    /// Nothing: every byte is fetched when read.
    None,
    /// The files first commands need ([`is_first_command_file`]), nothing else.
    First,
    /// Those, then every file of at most `max_size` bytes.
    All {
        /// Largest file hydrated.
        max_size: u64,
    },
}

impl Default for HydratePolicy {
    fn default() -> Self {
        HydratePolicy::All {
            max_size: DEFAULT_ALL_MAX,
        }
    }
}

/// Whether the export at `endpoint` is on this machine (`localhost`, `127.0.0.1`, `[::1]`,
/// with or without a scheme, port and path).
pub fn is_loopback_endpoint(endpoint: &str) -> bool {
    let host = endpoint
        .split("://")
        .nth(1)
        .unwrap_or(endpoint)
        .split('/')
        .next()
        .unwrap_or("");
    // `[::1]:3101`, `127.0.0.1:3101`, `localhost:3101`
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl HydratePolicy {
    /// The default for an export at `endpoint`: `all` (small files up to 256 KiB) when the
    /// export is on this machine (loopback: fetching costs no link time and the agent's
    /// reads go first anyway), `first` otherwise (a metered or slow link carries only what
    /// the agent reads, the files its first commands need, and a window of neighbours
    /// around each small file it reads; see `docs/CONFIGURATION.md`).
    pub fn default_for(endpoint: &str) -> HydratePolicy {
        if is_loopback_endpoint(endpoint) {
            HydratePolicy::default()
        } else {
            HydratePolicy::First
        }
    }

    /// Whether a large file read in order is streamed whole in the background (`all`),
    /// rather than fetching only the blocks each read covers.
    pub fn streams_large_files(self) -> bool {
        matches!(self, HydratePolicy::All { .. })
    }

    /// Whether an on-demand fetch of a small file also fetches its small neighbours in the
    /// same directory, in the same request (everything but `none`).
    pub fn fetches_neighbours(self) -> bool {
        self != HydratePolicy::None
    }
}

/// A policy that does not parse.
#[derive(Debug, thiserror::Error)]
#[error(
    "`{given}` is not a hydration policy: use `none`, `first`, `all` or `all:SIZE` \
     (SIZE in bytes, or with K, M or G: `all:1M`)"
)]
pub struct BadPolicy {
    /// What was given.
    pub given: String,
}

impl std::str::FromStr for HydratePolicy {
    type Err = BadPolicy;

    fn from_str(s: &str) -> Result<Self, BadPolicy> {
        let bad = || BadPolicy { given: s.into() };
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(HydratePolicy::None),
            "first" => Ok(HydratePolicy::First),
            "all" => Ok(HydratePolicy::default()),
            other => {
                let size = other.strip_prefix("all:").ok_or_else(bad)?;
                let (digits, mult) = match size.as_bytes().last() {
                    Some(b'k') => (&size[..size.len() - 1], 1u64 << 10),
                    Some(b'm') => (&size[..size.len() - 1], 1 << 20),
                    Some(b'g') => (&size[..size.len() - 1], 1 << 30),
                    _ => (size, 1),
                };
                let n: u64 = digits.parse().map_err(|_| bad())?;
                let max_size = n.checked_mul(mult).ok_or_else(bad)?;
                Ok(HydratePolicy::All { max_size })
            }
        }
    }
}

impl std::fmt::Display for HydratePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HydratePolicy::None => f.write_str("none"),
            HydratePolicy::First => f.write_str("first"),
            HydratePolicy::All { max_size } => write!(f, "all:{max_size}"),
        }
    }
}

/// Whether the file at `path` (relative to the mount's root) is one that the agent's first
/// commands read: what `git status`, `git log` or `git diff` open before anything else, and
/// the ignore and attribute files of every directory.
pub fn is_first_command_file(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    if name == ".gitignore" || name == ".gitattributes" {
        return true;
    }
    let Some(rest) = path.strip_prefix(".git/") else {
        return false;
    };
    matches!(
        rest,
        "HEAD" | "index" | "config" | "packed-refs" | "FETCH_HEAD" | "ORIG_HEAD" | "shallow"
    ) || rest.starts_with("refs/")
        || rest.starts_with("info/")
        || rest.starts_with("objects/info/")
        || (rest.starts_with("objects/pack/") && rest.ends_with(".idx"))
}

/// Whether `n` is a git pack (`…/objects/pack/*.pack`, in `.git`, a submodule's or a bare
/// repository's object store). git reads a pack where its objects are, not from end to
/// end: `git status` the commits and trees near its start, `git show` one object. So a
/// pack is never streamed whole, whatever the policy: its reads fetch the blocks they
/// cover, and hydration fetches its head ([`Batch::PackHead`]).
pub(super) fn is_git_pack(table: &super::inode::InodeTable, n: &super::inode::Node) -> bool {
    if n.kind != Kind::File || !n.name.ends_with(".pack") {
        return false;
    }
    let Some(dir) = table.get(n.parent) else {
        return false;
    };
    dir.name == "pack" && table.get(dir.parent).is_some_and(|o| o.name == "objects")
}

/// Hydration's plan and progress, as `status.json` shows it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ProgressSnapshot {
    /// The policy (`none`, `first`, `all:MAX`).
    pub policy: String,
    /// Files the plan holds.
    pub files_planned: u64,
    /// Their bytes.
    pub bytes_planned: u64,
    /// Files of the plan fetched so far (by hydration, or by a read that came first).
    pub files_done: u64,
    /// Their bytes.
    pub bytes_done: u64,
    /// Files of the plan not fetched yet.
    pub files_remaining: u64,
    /// Their bytes.
    pub bytes_remaining: u64,
    /// Times a background request waited for the agent's fetches.
    pub yielded: u64,
    /// The plan is through (or stopped).
    pub finished: bool,
}

/// Live hydration counters.
#[derive(Debug, Default)]
pub struct Progress {
    policy: Mutex<String>,
    files_planned: AtomicU64,
    bytes_planned: AtomicU64,
    files_done: AtomicU64,
    bytes_done: AtomicU64,
    yielded: AtomicU64,
    finished: std::sync::atomic::AtomicBool,
    /// Files of requests already made that were still remote right after them: another
    /// fetch of theirs was under way (the index the mount shows git, fetched as it starts;
    /// an agent's read). Counted when the plan ends if they are local by then.
    uncounted: Mutex<Vec<Ino>>,
}

impl Progress {
    /// Copy the counters.
    pub fn snapshot(&self) -> ProgressSnapshot {
        let files_planned = self.files_planned.load(Ordering::Relaxed);
        let bytes_planned = self.bytes_planned.load(Ordering::Relaxed);
        let files_done = self.files_done.load(Ordering::Relaxed).min(files_planned);
        let bytes_done = self.bytes_done.load(Ordering::Relaxed).min(bytes_planned);
        ProgressSnapshot {
            policy: self.policy.lock().clone(),
            files_planned,
            bytes_planned,
            files_done,
            bytes_done,
            files_remaining: files_planned - files_done,
            bytes_remaining: bytes_planned - bytes_done,
            yielded: self.yielded.load(Ordering::Relaxed),
            finished: self.finished.load(Ordering::Relaxed),
        }
    }
}

/// Who goes first on the data plane: see the module docs.
#[derive(Debug, Default)]
pub struct Priority {
    state: Mutex<PrioState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct PrioState {
    /// Foreground fetches in flight.
    active: usize,
    /// When the last one ended.
    last_end: Option<Instant>,
    /// Per [`Activity`], the count of the agent's requests when background work last
    /// looked, and when it last saw it change.
    ops_seen: [(u64, Option<Instant>); 2],
    /// When the mount was told where its export is (just before it serves).
    serving_since: Option<Instant>,
}

/// Which of the agent's requests background work waits to pause ([`Priority::wait_quiet`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    /// Every FUSE request.
    All = 0,
    /// Every FUSE request but reads.
    NotReads = 1,
}

/// A foreground fetch in flight; ends when dropped.
#[derive(Debug)]
pub struct Foreground<'a> {
    prio: &'a Priority,
}

impl Drop for Foreground<'_> {
    fn drop(&mut self) {
        let mut st = self.prio.state.lock();
        st.active -= 1;
        st.last_end = Some(Instant::now());
        drop(st);
        self.prio.cv.notify_all();
    }
}

impl Priority {
    /// Mark a foreground fetch in flight until the guard drops. Take it only after the
    /// fetch's own locks and budget (see the module docs).
    pub fn foreground(&self) -> Foreground<'_> {
        self.state.lock().active += 1;
        Foreground { prio: self }
    }

    /// Whether a foreground fetch is in flight now.
    pub fn busy(&self) -> bool {
        self.state.lock().active > 0
    }

    /// Wait until no foreground fetch is in flight and none ended in the last [`QUIET`].
    /// Returns whether it waited at all.
    pub fn wait_turn(&self) -> bool {
        self.wait_turn_while(|| true)
    }

    /// Wait until the agent's requests pause: `ops()` (the mount's FUSE request count)
    /// unchanged for [`QUIET`], or [`ACTIVITY_MAX_WAIT`] spent. Returns whether it waited.
    pub fn wait_quiet(
        &self,
        activity: Activity,
        ops: impl Fn() -> u64,
        still_background: impl Fn() -> bool,
    ) -> bool {
        let started = Instant::now();
        let mut st = self.state.lock();
        let mut waited = false;
        loop {
            if !still_background() || started.elapsed() >= ACTIVITY_MAX_WAIT {
                return waited;
            }
            let now_ops = ops();
            let (seen, changed) = &mut st.ops_seen[activity as usize];
            if now_ops != *seen {
                *seen = now_ops;
                *changed = Some(Instant::now());
            }
            let left = match *changed {
                Some(t) if t.elapsed() < QUIET => QUIET - t.elapsed(),
                _ => return waited,
            };
            waited = true;
            self.cv
                .wait_for(&mut st, left.min(Duration::from_millis(10)));
        }
    }

    /// Wait before a background request that the agent's first commands do not need:
    /// while a foreground fetch is in flight, and until the agent's requests (counted in
    /// `stats`) pause, at most [`ACTIVITY_MAX_WAIT`]. Stops waiting once
    /// `still_background()` is false. Returns whether it waited.
    ///
    /// With the export on this machine (`export_local`), a background request takes no link
    /// time from the agent's, and its cost is CPU: it then waits only until the agent's
    /// requests other than reads pause (lookups and attribute requests, served from memory,
    /// are what the hydration's work would slow), and runs beside the agent's reads and
    /// fetches — a read of the whole tree never pauses, and would otherwise get every file by
    /// its own on-demand fetches, one after another. Except in the mount's first
    /// [`LOCAL_GRACE`]: the agent's first command is short (a `git status` reads the index
    /// and a few objects), and on two CPUs hydration beside it made it up to twice as slow.
    pub fn background_turn(
        &self,
        stats: &super::stats::Stats,
        export_local: bool,
        still_background: impl Fn() -> bool,
    ) -> bool {
        let settled = || {
            self.state
                .lock()
                .serving_since
                .is_none_or(|t| t.elapsed() >= LOCAL_GRACE)
        };
        if export_local && settled() {
            return self.wait_quiet(
                Activity::NotReads,
                || stats.ops_except_reads(),
                &still_background,
            );
        }
        let a = self.wait_turn_while(&still_background);
        let b = self.wait_quiet(Activity::All, || stats.ops_total(), &still_background);
        let c = self.wait_turn_while(&still_background);
        a || b || c
    }

    /// [`Priority::wait_turn`], ending early once `still_background()` is false (a reader
    /// started waiting for this request: it is the agent's now).
    pub fn wait_turn_while(&self, still_background: impl Fn() -> bool) -> bool {
        let mut st = self.state.lock();
        let mut waited = false;
        loop {
            if !still_background() {
                return waited;
            }
            let left = if st.active > 0 {
                QUIET
            } else {
                match st.last_end {
                    Some(t) if t.elapsed() < QUIET => QUIET - t.elapsed(),
                    _ => return waited,
                }
            };
            waited = true;
            // In short steps: `still_background` can change without a notification.
            self.cv
                .wait_for(&mut st, left.min(Duration::from_millis(10)));
        }
    }
}

/// One hydration request: files fetched into the pack, or one file too large for the pack
/// fetched into its upper file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Batch {
    /// Small first-command files, fetched together into the pack.
    Packed(Vec<Ino>),
    /// Other small files (`all`), fetched together into the pack once the agent pauses.
    Rest(Vec<Ino>),
    /// A first-command file too large for the pack (git's index of a large tree).
    Whole(Ino),
    /// The first [`PACK_HEAD_BLOCKS`] blocks of a large git pack (where git puts
    /// the commits and trees that `git status` and `git log` read), kept with the blocks
    /// of ranged reads.
    PackHead(Ino),
}

/// Blocks of a large git pack fetched ahead (2 MiB at the default size).
pub const PACK_HEAD_BLOCKS: u64 = 2;

impl AwcpFs {
    /// Serve reads as `policy` says: stream large files read in order whole, or fetch only
    /// what is read;
    /// fetch a small file's neighbours with it or not. Set before the mount serves.
    pub fn set_hydrate_policy(&self, policy: HydratePolicy) {
        self.streams_whole
            .store(policy.streams_large_files(), Ordering::Relaxed);
        self.neighbours
            .store(policy.fetches_neighbours(), Ordering::Relaxed);
    }

    /// Tell background work whether the export is on this machine (see
    /// [`Priority::background_turn`]). Set before the mount serves.
    pub fn set_export_local(&self, local: bool) {
        self.export_local.store(local, Ordering::Relaxed);
        self.priority.state.lock().serving_since = Some(Instant::now());
    }

    /// Hydration's progress counters.
    pub fn hydration(&self) -> &Progress {
        &self.hydration
    }

    /// The requests `policy` makes, in order: the first-command files first (the ones the
    /// pack takes, in one or a few requests; larger ones each on their own), then, for
    /// `all`, the other small files in tree order. Records the plan's totals.
    pub fn hydration_plan(&self, policy: HydratePolicy) -> VecDeque<Batch> {
        let mut first: Vec<(Ino, u64)> = Vec::new();
        let mut rest: Vec<(Ino, u64)> = Vec::new();
        let mut heads: Vec<Ino> = Vec::new();
        {
            let table = self.table.lock();
            let max = match policy {
                HydratePolicy::None => {
                    drop(table);
                    self.set_plan(policy, 0, 0);
                    return VecDeque::new();
                }
                HydratePolicy::First => None,
                HydratePolicy::All { max_size } => Some(max_size),
            };
            let remote_file = |n: &super::inode::Node| {
                n.kind == Kind::File
                    && matches!(n.data, Data::Remote { packed: None, .. })
                    && !table.is_withheld(n.ino)
            };
            // The first-command files live in `.git` and next to the sources (ignore
            // files): paths are built only below `.git`, not for the whole tree (this runs
            // under the inode table's lock, which the agent's first requests wait for).
            let mut in_first = std::collections::HashSet::new();
            if let Some(git) = table.resolve(".git") {
                table.walk_from(git, ".git", |path, n| {
                    if remote_file(n) && is_first_command_file(path) {
                        first.push((n.ino, n.size));
                        in_first.insert(n.ino);
                    } else if remote_file(n)
                        && n.size >= super::content::STREAM_MIN
                        && is_git_pack(&table, n)
                    {
                        heads.push(n.ino);
                    }
                });
            }
            table.walk_nodes(|n| {
                if !remote_file(n) || in_first.contains(&n.ino) {
                    return;
                }
                if n.name == ".gitignore" || n.name == ".gitattributes" {
                    first.push((n.ino, n.size));
                } else if max.is_some_and(|m| n.size <= m) {
                    rest.push((n.ino, n.size));
                }
            });
        }
        let mut plan = VecDeque::new();
        let (mut files, mut bytes) = (0u64, 0u64);
        // Not in the totals: only part of each file is fetched.
        let heads: Vec<Batch> = heads.into_iter().map(Batch::PackHead).collect();
        for (list, is_first) in [(&first, true), (&rest, false)] {
            let mut batch: Vec<Ino> = Vec::new();
            let mut batch_bytes = 0u64;
            for &(ino, size) in list.iter() {
                files += 1;
                bytes += size;
                if is_first && size > super::pack::PACK_MAX {
                    plan.push_back(Batch::Whole(ino));
                    continue;
                }
                batch.push(ino);
                batch_bytes += size;
                if batch_bytes >= BATCH_BYTES || batch.len() >= BATCH_FILES {
                    let files = std::mem::take(&mut batch);
                    plan.push_back(if is_first {
                        Batch::Packed(files)
                    } else {
                        Batch::Rest(files)
                    });
                    batch_bytes = 0;
                }
            }
            if !batch.is_empty() {
                plan.push_back(if is_first {
                    Batch::Packed(batch)
                } else {
                    Batch::Rest(batch)
                });
            }
            if is_first {
                plan.extend(heads.iter().cloned());
            }
        }
        self.set_plan(policy, files, bytes);
        plan
    }

    fn set_plan(&self, policy: HydratePolicy, files: u64, bytes: u64) {
        let p = &self.hydration;
        *p.policy.lock() = policy.to_string();
        p.files_planned.store(files, Ordering::Relaxed);
        p.bytes_planned.store(bytes, Ordering::Relaxed);
        p.files_done.store(0, Ordering::Relaxed);
        p.bytes_done.store(0, Ordering::Relaxed);
        p.uncounted.lock().clear();
        p.finished.store(files == 0, Ordering::Relaxed);
    }

    /// Wait before a background request that the agent's first commands do not need (see
    /// [`Priority::background_turn`]).
    pub(super) fn background_turn(&self, still_background: impl Fn() -> bool) -> bool {
        self.priority.background_turn(
            &self.stats,
            self.export_local.load(Ordering::Relaxed),
            still_background,
        )
    }

    /// Mark the plan through.
    pub fn hydration_finished(&self) {
        let uncounted = std::mem::take(&mut *self.hydration.uncounted.lock());
        self.count_hydrated(&uncounted, false);
        self.hydration.finished.store(true, Ordering::Relaxed);
    }

    /// Count the files of `inos` that are no longer remote as done; with `keep`, remember
    /// the others for the end of the plan.
    fn count_hydrated(&self, inos: &[Ino], keep: bool) {
        let mut still_remote = Vec::new();
        let table = self.table.lock();
        for ino in inos {
            match table.get(*ino) {
                Some(n) if !matches!(n.data, Data::Remote { packed: None, .. }) => {
                    self.hydration.files_done.fetch_add(1, Ordering::Relaxed);
                    self.hydration
                        .bytes_done
                        .fetch_add(n.size, Ordering::Relaxed);
                }
                Some(_) if keep => still_remote.push(*ino),
                _ => {}
            }
        }
        drop(table);
        if !still_remote.is_empty() {
            self.hydration.uncounted.lock().extend(still_remote);
        }
    }

    /// Run one hydration request, after the agent's fetches (see [`Priority`]). Counts the
    /// batch's files that are no longer remote afterwards as done, whoever fetched them.
    pub fn hydrate(&self, batch: &Batch) -> Result<(), super::FsError> {
        let waited = match batch {
            Batch::Rest(_) => self.background_turn(|| true),
            _ => self.priority.wait_turn(),
        };
        if waited {
            self.hydration.yielded.fetch_add(1, Ordering::Relaxed);
        }
        let r = match batch {
            Batch::Packed(files) | Batch::Rest(files) => self.prefetch(files).map(|_| ()),
            Batch::Whole(ino) => self.fetch_whole_in_background(*ino),
            Batch::PackHead(ino) => {
                let size = self.table.lock().get(*ino).map_or(0, |n| n.size);
                let want = (PACK_HEAD_BLOCKS * u64::from(self.opts.block_size.max(1))).min(size);
                self.read_remote_blocks(*ino, 0, want).map(|_| ())
            }
        };
        let inos: &[Ino] = match batch {
            Batch::Packed(files) | Batch::Rest(files) => files,
            Batch::Whole(ino) => std::slice::from_ref(ino),
            Batch::PackHead(_) => &[],
        };
        self.count_hydrated(inos, true);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_and_print() {
        assert_eq!(
            "none".parse::<HydratePolicy>().unwrap(),
            HydratePolicy::None
        );
        assert_eq!(
            "First".parse::<HydratePolicy>().unwrap(),
            HydratePolicy::First
        );
        assert_eq!(
            "all".parse::<HydratePolicy>().unwrap(),
            HydratePolicy::All {
                max_size: DEFAULT_ALL_MAX
            }
        );
        assert_eq!(
            "all:1M".parse::<HydratePolicy>().unwrap(),
            HydratePolicy::All { max_size: 1 << 20 }
        );
        assert_eq!(
            "all:4096".parse::<HydratePolicy>().unwrap(),
            HydratePolicy::All { max_size: 4096 }
        );
        for bad in [
            "",
            "some",
            "all:",
            "all:x",
            "all:99999999999999999999G",
            "first:1",
        ] {
            assert!(bad.parse::<HydratePolicy>().is_err(), "{bad}");
        }
        let p: HydratePolicy = "all:2k".parse().unwrap();
        assert_eq!(p.to_string().parse::<HydratePolicy>().unwrap(), p);
    }

    #[test]
    fn the_default_policy_depends_on_where_the_export_is() {
        let all = HydratePolicy::default();
        for local in [
            "http://127.0.0.1:3101",
            "http://localhost:80/",
            "https://[::1]:3101",
            "http://127.0.0.2",
        ] {
            assert_eq!(HydratePolicy::default_for(local), all, "{local}");
        }
        for remote in [
            "http://10.0.0.5:3101",
            "https://delegator.example:443",
            "http://[2001:db8::1]:3101",
        ] {
            assert_eq!(
                HydratePolicy::default_for(remote),
                HydratePolicy::First,
                "{remote}"
            );
        }
    }

    #[test]
    fn first_command_files_are_gits_entry_points_and_ignore_files() {
        for yes in [
            ".git/HEAD",
            ".git/index",
            ".git/config",
            ".git/packed-refs",
            ".git/refs/heads/main",
            ".git/info/exclude",
            ".git/objects/pack/pack-1.idx",
            ".gitignore",
            "src/deep/.gitignore",
            "a/.gitattributes",
        ] {
            assert!(is_first_command_file(yes), "{yes}");
        }
        for no in [
            ".git/objects/pack/pack-1.pack",
            ".git/objects/ab/cdef",
            "src/HEAD",
            "index",
            ".git/hooks/pre-commit.sample",
            "src/main.rs",
        ] {
            assert!(!is_first_command_file(no), "{no}");
        }
    }

    #[test]
    fn background_waits_while_the_agent_is_active_but_not_for_ever() {
        use std::sync::atomic::AtomicBool;
        let p = Priority::default();
        let ops = AtomicU64::new(7);
        // Idle (the count does not move after its first reading): no wait.
        p.wait_quiet(Activity::All, || ops.load(Ordering::Relaxed), || true);
        std::thread::sleep(QUIET);
        assert!(!p.wait_quiet(Activity::All, || ops.load(Ordering::Relaxed), || true));
        // An agent that keeps making requests: it waits, and still returns (bounded by
        // ACTIVITY_MAX_WAIT, however long the agent goes on).
        let stop = AtomicBool::new(false);
        let (waited, waited_when_foreground) = std::thread::scope(|s| {
            // A request just now, then one every 2 ms until told to stop.
            ops.fetch_add(1, Ordering::Relaxed);
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    ops.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(2));
                }
            });
            let waited = p.wait_quiet(Activity::All, || ops.load(Ordering::Relaxed), || true);
            // Once it is no longer background work, it stops waiting.
            let fg = p.wait_quiet(Activity::All, || ops.load(Ordering::Relaxed), || false);
            stop.store(true, Ordering::Relaxed);
            (waited, fg)
        });
        assert!(waited);
        assert!(!waited_when_foreground);
    }

    #[test]
    fn on_a_local_export_background_runs_beside_the_agents_reads_but_not_its_lookups() {
        use std::sync::atomic::AtomicBool;
        let p = Priority::default();
        let stats = crate::mount::stats::Stats::default();
        // The agent keeps making requests of one kind, every 2 ms, while background work
        // asks for its turn.
        let turn = |op: &str, local: bool| {
            let stop = AtomicBool::new(false);
            std::thread::scope(|s| {
                stats.count_op(op);
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        stats.count_op(op);
                        std::thread::sleep(Duration::from_millis(2));
                    }
                });
                // A foreground fetch in flight too: a read that missed. (Bounded: without
                // the local rule it would wait for as long as the guard is held.)
                let g = p.foreground();
                let t0 = Instant::now();
                let waited =
                    p.background_turn(&stats, local, || t0.elapsed() < Duration::from_millis(300));
                drop(g);
                stop.store(true, Ordering::Relaxed);
                waited
            })
        };
        assert!(
            !turn("read", true),
            "local export: reads and fetches do not hold it"
        );
        assert!(turn("lookup", true), "local export: the agent's lookups do");
        std::thread::sleep(QUIET);
        // Over a link it waits for the fetch in flight (the guard is dropped only after
        // `background_turn` returns here, so give it a timeout through still_background).
        let started = Instant::now();
        let stop = AtomicBool::new(false);
        let waited = std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    stats.count_op("read");
                    std::thread::sleep(Duration::from_millis(2));
                }
            });
            let g = p.foreground();
            let w = p.background_turn(&stats, false, || {
                started.elapsed() < Duration::from_millis(200)
            });
            drop(g);
            stop.store(true, Ordering::Relaxed);
            w
        });
        assert!(
            waited,
            "over a link: the agent's fetch in flight and its reads hold it"
        );
    }

    #[test]
    fn on_a_local_export_the_agents_first_command_runs_alone() {
        use std::sync::atomic::AtomicBool;
        let p = Priority::default();
        let stats = crate::mount::stats::Stats::default();
        // The agent reads, every 2 ms, while background work asks for its turn.
        let turn = || {
            let stop = AtomicBool::new(false);
            std::thread::scope(|s| {
                stats.count_op("read");
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        stats.count_op("read");
                        std::thread::sleep(Duration::from_millis(2));
                    }
                });
                let t0 = Instant::now();
                let waited =
                    p.background_turn(&stats, true, || t0.elapsed() < Duration::from_millis(200));
                stop.store(true, Ordering::Relaxed);
                waited
            })
        };
        // The mount has just started serving: its reads hold background work too.
        p.state.lock().serving_since = Some(Instant::now());
        assert!(
            turn(),
            "in the mount's first moments the agent's reads hold it"
        );
        std::thread::sleep(QUIET);
        // Past the grace, reads no longer do.
        p.state.lock().serving_since = Instant::now().checked_sub(LOCAL_GRACE);
        assert!(!turn(), "once the mount has settled, reads do not hold it");
    }

    #[test]
    fn background_waits_for_foreground_then_quiet() {
        let p = std::sync::Arc::new(Priority::default());
        assert!(!p.wait_turn(), "nothing in flight: no wait");
        let g = p.foreground();
        assert!(p.busy());
        let (tx, rx) = std::sync::mpsc::channel();
        let p2 = p.clone();
        let t = std::thread::spawn(move || {
            let waited = p2.wait_turn();
            tx.send(()).unwrap();
            waited
        });
        // Ordering, not timing: while the guard is held the background side cannot pass.
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        drop(g);
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(t.join().unwrap(), "it waited");
        assert!(!p.busy());
    }
}
