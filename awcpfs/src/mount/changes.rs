//! The mount's change log, and git's filesystem monitor served from it.
//!
//! Every change the mount makes to its namespace or content — its own (create, write,
//! truncate, chmod, unlink, rename, mkdir, …) and the Delegator's that it applies — is
//! journaled ([`Record`]), and each journaled record is also noted here with a sequence
//! number; so is every write of file content (which the journal records only when a file
//! settles). An entry names what changed without a path (an inode, or a name in a
//! directory, both by inode number): paths are resolved when a question is answered, so a
//! rename costs two entries, not one per file below it.
//!
//! **git's fsmonitor (hook protocol version 2).** git asks "what changed since token T?"
//! and lstats only those paths (with `core.untrackedCache`, it reads only those
//! directories). [`ChangeLog::answer`] gives `<new token> NUL <path> NUL …` — exactly what
//! the hook prints — relative to the directory asked about (git runs its hook in the
//! work tree, which may be below the mount's root). The `awcpfs fsmonitor` hook reaches
//! it by `getxattr` of [`FSMONITOR_XATTR`]`<token>` on its working directory: no socket,
//! no state directory, nothing but the mount itself, so it works for an agent confined to
//! its workspace.
//!
//! What keeps the answer from ever saying "nothing changed" wrongly:
//! * A token names this mount instance (a random id) and a sequence number. One older
//!   than the oldest entry kept ([`MAX_ENTRIES`]), or anything unreadable answers `/`
//!   ("everything": git then lstats every path), as does an answer too large for an
//!   attribute value.
//! * A token of another instance (the index was written under an earlier mount) answers
//!   `/` too, unless that instance was a mount of the same export registration that ended
//!   with every change it made applied as sent — no conflict, nothing held, nothing left
//!   behind — and says so to the export at its end (`POST /mounts/ended`; the export
//!   remembers it only for as long as this registration lives, and never for a staged
//!   one). Then everything that mount showed is the registration's tree with the export's
//!   changes since, and this mount's log holds every path the export's event stream named
//!   since registration (`Change::Path`, noted whether applied or not, the catch-up
//!   first) and every change of its own: answering with the whole log is a superset of
//!   what changed since that token. Until the catch-up is in ([`ChangeLog::mark_caught_up`],
//!   waited for up to [`CATCH_UP_WAIT`]), or if the export cannot say, it is `/`.
//! * The new token never passes a change still being made: operations that change the
//!   tree bracket themselves with [`ChangeLog::begin`] (the FUSE adapter until its reply is
//!   sent, a Delegator-side change until the kernel has been told to forget what it
//!   cached), and the token stays below the sequence at which the oldest of them began.
//!   Entries younger than [`SETTLE`] are left after the token too: the kernel updates its
//!   cached attributes after reading the reply, and a concurrent `lstat` may still see the
//!   old ones for that moment. Reporting a path twice only costs git one `lstat`.
//! * With the kernel's writeback cache, written pages reach the mount later than the
//!   writer's `write(2)` returned: the hook first runs `syncfs` on the mount, so every write
//!   made before it asked is here before the answer is built.
//! * A name that changed is reported both as a file and as a directory (`name` and
//!   `name/`): a directory removed or renamed invalidates everything git had below it.
//!
//! Repeated entries for the same thing are folded into the newest (an older entry of the
//! same inode or name is dropped when a new one comes): for any token, the newest entry is
//! after it whenever the older one was.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::inode::{Ino, InodeTable, Kind};
use super::journal::Record;

/// The extended attribute the hook reads: this prefix, then the token git gave it. It is
/// answered on any directory of the mount (paths come relative to it) and never listed.
pub const FSMONITOR_XATTR: &str = "user.awcpfs.fsmonitor.v2:";

/// Entries kept; a token older than the oldest answers "everything".
pub const MAX_ENTRIES: usize = 1 << 18;

/// Largest answer: the kernel's limit on an attribute value (`XATTR_SIZE_MAX`). A larger
/// one is replaced by "everything".
pub const MAX_ANSWER: usize = 64 * 1024;

/// How long an entry stays after the tokens handed out (see the module docs).
pub const SETTLE: Duration = Duration::from_millis(250);

/// How long a question with another mount's token waits for this mount's catch-up of the
/// export's changes (see the module docs) before answering "everything".
pub const CATCH_UP_WAIT: Duration = Duration::from_secs(2);

/// What changed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Change {
    /// An inode's content or attributes, at every name it has.
    Ino(Ino),
    /// The name `.1` in directory `.0`: made, removed, replaced or changed.
    Name(Ino, String),
    /// A path the export said changed since its registration (relative to the mount's
    /// root; whatever is there now, or nothing).
    Path(String),
}

#[derive(Debug, Default)]
struct Inner {
    /// The sequence of the newest entry (0: none yet).
    head: u64,
    /// Entries by sequence, with when they were noted.
    log: BTreeMap<u64, (Instant, Change)>,
    /// The sequence of each change's entry.
    latest: HashMap<Change, u64>,
    /// Entries up to this sequence were dropped for room.
    dropped: u64,
    /// Changes being made: the head when each began, and how many began there.
    in_flight: BTreeMap<u64, usize>,
    /// Every change the export made since its registration, up to this mount's start, is
    /// in the log (the event stream's catch-up was applied).
    caught_up: bool,
    /// Other mount instances of this export that ended cleanly (the export said so).
    vouched: BTreeSet<String>,
}

/// The log of one mount instance.
#[derive(Debug)]
pub struct ChangeLog {
    instance: String,
    inner: Mutex<Inner>,
    /// Signalled when the catch-up is in.
    caught_up: Condvar,
}

impl Default for ChangeLog {
    fn default() -> Self {
        ChangeLog::new()
    }
}

/// A change being made (see [`ChangeLog::begin`]); ends when dropped.
#[derive(Debug)]
#[must_use = "the change ends when this is dropped"]
pub struct InFlight<'a> {
    log: &'a ChangeLog,
    began: u64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut inner = self.log.inner.lock();
        if let Some(n) = inner.in_flight.get_mut(&self.began) {
            *n -= 1;
            if *n == 0 {
                inner.in_flight.remove(&self.began);
            }
        }
    }
}

/// The answer to an fsmonitor question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Everything may have changed.
    All {
        /// The token for the next question.
        token: String,
    },
    /// These paths (relative to the directory asked about; a directory ends in `/`).
    Paths {
        /// The token for the next question.
        token: String,
        /// The paths, raw bytes.
        paths: BTreeSet<Vec<u8>>,
    },
}

impl Answer {
    /// The hook's output: the token, NUL, then each path followed by NUL (`/` for all).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Answer::All { token } => {
                out.extend_from_slice(token.as_bytes());
                out.extend_from_slice(b"\0/\0");
            }
            Answer::Paths { token, paths } => {
                out.extend_from_slice(token.as_bytes());
                out.push(0);
                for p in paths {
                    out.extend_from_slice(p);
                    out.push(0);
                }
            }
        }
        out
    }
}

impl ChangeLog {
    /// An empty log with a fresh instance id.
    pub fn new() -> ChangeLog {
        ChangeLog {
            instance: format!("{:016x}", rand::random::<u64>()),
            inner: Mutex::new(Inner::default()),
            caught_up: Condvar::new(),
        }
    }

    /// This mount instance's id (in every token it hands out).
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The export's changes since its registration, as far as this mount's start, are all
    /// noted ([`ChangeLog::note_paths`]): another mount's tokens can be answered.
    pub fn mark_caught_up(&self) {
        self.inner.lock().caught_up = true;
        self.caught_up.notify_all();
    }

    /// The instance named by `token` when it is another mount's whose tokens this log
    /// could answer (if that mount ended cleanly): `None` for this instance's own tokens,
    /// for anything unreadable, and once entries were dropped for room.
    pub fn foreign_instance<'t>(&self, token: &'t str) -> Option<&'t str> {
        let (instance, seq) = split_token(token)?;
        if instance == self.instance || self.inner.lock().dropped > 0 {
            return None;
        }
        let _: u64 = seq.parse().ok()?;
        Some(instance)
    }

    /// Make another mount instance's tokens answerable once `ended_clean` (asked only if
    /// not known yet) says it ended with every change it made applied as sent; then wait
    /// (up to [`CATCH_UP_WAIT`]) for this mount's catch-up, without which they are not.
    pub fn vouch(&self, instance: &str, ended_clean: impl FnOnce(&str) -> bool) {
        if !self.inner.lock().vouched.contains(instance) {
            // Asked without the lock: a round trip to the export.
            if !ended_clean(instance) {
                return;
            }
            self.inner.lock().vouched.insert(instance.to_owned());
        }
        self.wait_caught_up(CATCH_UP_WAIT);
    }

    /// Wait up to `timeout` for the catch-up ([`ChangeLog::mark_caught_up`]); whether it
    /// is in.
    pub fn wait_caught_up(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut inner = self.inner.lock();
        while !inner.caught_up {
            if self.caught_up.wait_until(&mut inner, deadline).timed_out() {
                return inner.caught_up;
            }
        }
        true
    }

    /// Paths the export said changed (its event stream: the catch-up and every later
    /// change), applied or not.
    pub fn note_paths<'a>(&self, paths: impl IntoIterator<Item = &'a str>) {
        self.note(paths.into_iter().map(|p| Change::Path(p.to_owned())));
    }

    /// A change starts: no token handed out until it ends passes it.
    pub fn begin(&self) -> InFlight<'_> {
        let mut inner = self.inner.lock();
        let began = inner.head;
        *inner.in_flight.entry(began).or_default() += 1;
        InFlight { log: self, began }
    }

    fn note(&self, changes: impl IntoIterator<Item = Change>) {
        let now = Instant::now();
        let mut inner = self.inner.lock();
        for c in changes {
            inner.head += 1;
            let seq = inner.head;
            if let Some(old) = inner.latest.insert(c.clone(), seq) {
                inner.log.remove(&old);
            }
            inner.log.insert(seq, (now, c));
        }
        while inner.log.len() > MAX_ENTRIES {
            let Some((seq, (_, c))) = inner.log.pop_first() else {
                break;
            };
            inner.dropped = seq;
            if inner.latest.get(&c) == Some(&seq) {
                inner.latest.remove(&c);
            }
        }
    }

    /// A write changed `ino`'s content.
    pub fn note_write(&self, ino: Ino) {
        self.note([Change::Ino(ino)]);
    }

    /// Journaled records (the mount's own changes and the Delegator's it applied).
    pub fn note_records(&self, records: &[Record]) {
        let mut changes = Vec::with_capacity(records.len() * 2);
        Self::collect(records, &mut changes);
        self.note(changes);
    }

    /// The changes `records` name, into `changes` (a batch's records in order).
    fn collect(records: &[Record], changes: &mut Vec<Change>) {
        for r in records {
            match r {
                Record::Batch { records } => Self::collect(records, changes),
                Record::Node {
                    ino, parent, name, ..
                }
                | Record::Upstream {
                    ino, parent, name, ..
                } => {
                    changes.push(Change::Name(*parent, name.clone()));
                    changes.push(Change::Ino(*ino));
                }
                Record::Unlink { parent, name } | Record::Link { parent, name, .. } => {
                    changes.push(Change::Name(*parent, name.clone()))
                }
                Record::Move {
                    from_parent,
                    from_name,
                    parent,
                    name,
                    ..
                } => {
                    changes.push(Change::Name(*from_parent, from_name.clone()));
                    changes.push(Change::Name(*parent, name.clone()));
                }
                // git looks at no extended attribute.
                Record::Xattr { .. } => {}
            }
        }
    }

    fn token(&self, seq: u64) -> String {
        format!("awcpfs:{}:{seq}", self.instance)
    }

    /// The sequence after which changes answer `token`: its own for one of this instance's,
    /// 0 (everything since this mount started) for one of a vouched instance's (see the
    /// module docs), `None` when the answer must be "everything".
    fn parse(&self, inner: &Inner, token: &str) -> Option<u64> {
        let (instance, seq) = split_token(token)?;
        let seq: u64 = seq.parse().ok()?;
        if instance == self.instance {
            return Some(seq);
        }
        (inner.caught_up && inner.dropped == 0 && inner.vouched.contains(instance)).then_some(0)
    }

    /// The sequence a token handed out now stands at: not past a change still being made,
    /// nor past one that just settled.
    fn stable(inner: &Inner) -> u64 {
        let mut stable = inner.head;
        if let Some((&began, _)) = inner.in_flight.first_key_value() {
            stable = stable.min(began);
        }
        let cutoff = Instant::now().checked_sub(SETTLE);
        for (&seq, (at, _)) in inner.log.iter().rev() {
            if cutoff.is_some_and(|c| *at <= c) {
                break;
            }
            stable = stable.min(seq - 1);
        }
        stable
    }

    /// A token for "now": every change not visible in the inode table at this moment is
    /// answered to a question with it (`mount/prime.rs` writes one into git's index).
    pub fn current_token(&self) -> String {
        self.token(Self::stable(&self.inner.lock()))
    }

    /// What changed since `token`, for the directory `base` (the hook's working directory),
    /// resolved in `table` (held by the caller, which also keeps the tree still).
    pub fn answer(&self, table: &InodeTable, base: Ino, token: &str) -> Answer {
        let (new_token, since) = {
            let inner = self.inner.lock();
            let stable = Self::stable(&inner);
            let since = self
                .parse(&inner, token)
                .filter(|&t| t >= inner.dropped && t <= inner.head)
                .map(|t| {
                    inner
                        .log
                        .range(t + 1..)
                        .map(|(_, (_, c))| c.clone())
                        .collect::<Vec<_>>()
                });
            (self.token(stable), since)
        };
        let all = || Answer::All {
            token: new_token.clone(),
        };
        let Some(changes) = since else {
            return all();
        };
        let Some(base_path) = table.path_of(base) else {
            return all();
        };
        let mut paths = BTreeSet::new();
        let mut size = new_token.len() + 1;
        for c in changes {
            match &c {
                Change::Ino(ino) => {
                    let Some(node) = table.get(*ino) else {
                        continue;
                    };
                    let dir = node.kind == Kind::Dir;
                    for p in table.paths_of(*ino) {
                        match relative(&base_path, &p) {
                            Rel::Outside => {}
                            Rel::Covers => return all(),
                            Rel::Inside(r) => {
                                if !add(&mut paths, &mut size, r, dir) {
                                    return all();
                                }
                            }
                        }
                    }
                }
                Change::Path(p) => match relative(&base_path, p) {
                    Rel::Outside => {}
                    Rel::Covers => return all(),
                    Rel::Inside(r) => {
                        if !add(&mut paths, &mut size, r, false)
                            || !add(&mut paths, &mut size, r, true)
                        {
                            return all();
                        }
                    }
                },
                Change::Name(parent, name) => {
                    // A name in a directory that is gone was covered by that directory's
                    // own removal or move, noted after it.
                    let Some(pp) = table.path_of(*parent) else {
                        continue;
                    };
                    let p = if pp.is_empty() {
                        name.clone()
                    } else {
                        format!("{pp}/{name}")
                    };
                    match relative(&base_path, &p) {
                        Rel::Outside => {}
                        Rel::Covers => return all(),
                        Rel::Inside(r) => {
                            if !add(&mut paths, &mut size, r, false)
                                || !add(&mut paths, &mut size, r, true)
                            {
                                return all();
                            }
                        }
                    }
                }
            }
        }
        Answer::Paths {
            token: new_token,
            paths,
        }
    }
}

/// The instance and sequence of an `awcpfs:<instance>:<seq>` token.
fn split_token(token: &str) -> Option<(&str, &str)> {
    let (instance, seq) = token.strip_prefix("awcpfs:")?.split_once(':')?;
    awcp_protocol::dataplane::valid_mount_instance(instance).then_some((instance, seq))
}

/// Where a path lies from the directory asked about.
enum Rel<'a> {
    /// Below it: the path relative to it.
    Inside(&'a str),
    /// It, or a directory above it: everything there may have changed.
    Covers,
    /// Elsewhere in the mount.
    Outside,
}

fn relative<'a>(base: &str, path: &'a str) -> Rel<'a> {
    if base.is_empty() {
        return Rel::Inside(path);
    }
    if path == base || base.strip_prefix(path).is_some_and(|r| r.starts_with('/')) {
        return Rel::Covers;
    }
    match path.strip_prefix(base).and_then(|r| r.strip_prefix('/')) {
        Some(r) => Rel::Inside(r),
        None => Rel::Outside,
    }
}

/// Add `path` (with a `/` as a directory); false when the answer grew too large.
fn add(paths: &mut BTreeSet<Vec<u8>>, size: &mut usize, path: &str, dir: bool) -> bool {
    let mut p = awcp_protocol::rawname::to_bytes(path).into_owned();
    if dir {
        p.push(b'/');
    }
    let len = p.len() + 1;
    if paths.insert(p) {
        *size += len;
    }
    // Room for "/\0" in place of the paths, within the kernel's limit.
    *size <= MAX_ANSWER
}

#[cfg(test)]
mod tests;
