//! Files the kernel writes without asking. A file a toolchain process creates (a compiler,
//! an assembler, a linker: [`PassthroughWriters`]) is handed to the kernel with FUSE
//! passthrough ([`KernelOptions::passthrough_writes`]): its writes go straight to its upper
//! file, with no `write` request, and since the kernel opens files itself
//! (no-open) it sends no `release` for it either. The mount learns of those writes from
//! inotify on the upper file (`IN_MODIFY`, `IN_CLOSE_WRITE`, which the kernel's writes
//! through the backing file raise like any other write), watched from the file's creation
//! until the kernel forgets its inode. Each event counts as a write without a handle
//! ([`AwcpFs::bypassed_write`]): the file is written back once the events stop for
//! [`WRITE_QUIET`](super::fs::WRITE_QUIET), its size and times taken from the upper file.
//!
//! The end of the kernel's writes is the close of its backing file: the first
//! `IN_CLOSE_WRITE` on the upper file. The backing file lives as long as the agent's
//! descriptors and mappings of the new file (the kernel refuses any other open of it
//! meanwhile), and nothing else closes a writable descriptor of the upper file meanwhile: the
//! mount's own writes to it (`fsync`, `fallocate`, a truncation, new times) go through
//! duplicates of one descriptor opened before the watch and closed after it
//! ([`Watcher::file`]). Merged or lost events cannot make that close appear early, only
//! late. Then the file is taken one last time and becomes an ordinary file
//! (`Node::bypassed` cleared, the watch removed). The backing id is closed once the kernel
//! has opened its backing file (the first `IN_OPEN` after the watch), or after [`HOLD`] at
//! the latest.
//!
//! Only files made by the processes [`PassthroughWriters`] names: while a passthrough file is
//! open, the kernel refuses (`EIO`) every open of the same file that it makes itself, which
//! with no-open is every other open. A build tool's output is opened by nothing else while it
//! is written; a log a test run writes is.
//!
//! Events are triggers, not the record: a lost one (queue overflow) counts as a write to
//! every watched file; a file whose close was lost stays watched until the kernel forgets its
//! inode, which counts as a last write too; the mount's last round takes every watched file
//! as it is.
//!
//! [`KernelOptions::passthrough_writes`]: super::fuse::KernelOptions::passthrough_writes

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use parking_lot::Mutex;

use super::fs::AwcpFs;
use super::inode::Ino;

/// How long the event thread waits for events before it closes old backing ids and looks
/// whether the mount is gone.
const POLL: Duration = Duration::from_secs(1);

/// The longest a backing id stays registered after the `create` reply that named it: the
/// kernel looks it up when the creating thread runs again, right after reading the reply
/// (and its backing file's open closes the id sooner).
const HOLD: Duration = Duration::from_secs(5);

/// Which processes' new files are handed to the kernel with passthrough, by the name the
/// kernel knows the creating thread by (`/proc/<tid>/comm`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PassthroughWriters {
    /// Compilers, assemblers and linkers ([`TOOLCHAIN`]).
    #[default]
    Toolchain,
    /// These names.
    Named(Vec<String>),
    /// None.
    Off,
}

/// The processes whose new files nothing else opens while they write them: GCC's and
/// Clang's compilers, assemblers and linkers, and Go's. Not rustc: cargo starts the crates
/// that depend on a crate while its rustc still writes (pipelined metadata), and the
/// linker rustc runs is on the list anyway.
pub const TOOLCHAIN: &[&str] = &[
    "as", "ld", "ld.bfd", "ld.gold", "ld.lld", "lld", "mold", "collect2", "cc1", "cc1plus",
    "cc1obj", "clang", "clang++", "compile", "link",
];

impl std::str::FromStr for PassthroughWriters {
    type Err = String;

    /// `toolchain`, `off`, or a comma-separated list of process names.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "toolchain" => Ok(PassthroughWriters::Toolchain),
            "off" | "none" => Ok(PassthroughWriters::Off),
            _ => {
                let names: Vec<String> = s
                    .split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned)
                    .collect();
                if names.is_empty() || names.iter().any(|n| n.len() > 15) {
                    return Err(format!(
                        "{s:?}: expected toolchain, off, or process names separated by commas \
                         (each at most 15 characters, as the kernel keeps them)"
                    ));
                }
                Ok(PassthroughWriters::Named(names))
            }
        }
    }
}

/// How long a process's verdict is kept (a build creates many files from few processes).
const VERDICT_FOR: Duration = Duration::from_secs(1);

/// [`PassthroughWriters`] with the verdicts of recent creating threads.
#[derive(Debug, Default)]
pub(crate) struct Writers {
    policy: Mutex<PassthroughWriters>,
    verdicts: Mutex<HashMap<u32, (Instant, bool)>>,
}

impl Writers {
    pub(crate) fn set(&self, policy: PassthroughWriters) {
        *self.policy.lock() = policy;
        self.verdicts.lock().clear();
    }

    /// Whether the thread `tid` is one of the policy's processes.
    pub(crate) fn admits(&self, tid: u32) -> bool {
        let now = Instant::now();
        if let Some((at, v)) = self.verdicts.lock().get(&tid)
            && now.duration_since(*at) < VERDICT_FOR
        {
            return *v;
        }
        let v = {
            let policy = self.policy.lock();
            let names: &[String] = match &*policy {
                PassthroughWriters::Off => &[],
                PassthroughWriters::Named(n) => n,
                PassthroughWriters::Toolchain => {
                    return self.note(
                        tid,
                        now,
                        comm(tid).is_some_and(|c| TOOLCHAIN.contains(&c.as_str())),
                    );
                }
            };
            !names.is_empty() && comm(tid).is_some_and(|c| names.contains(&c))
        };
        self.note(tid, now, v)
    }

    fn note(&self, tid: u32, now: Instant, v: bool) -> bool {
        let mut verdicts = self.verdicts.lock();
        if verdicts.len() > 1024 {
            verdicts.retain(|_, (at, _)| now.duration_since(*at) < VERDICT_FOR);
        }
        verdicts.insert(tid, (now, v));
        v
    }
}

/// The name the kernel knows thread `tid` by.
fn comm(tid: u32) -> Option<String> {
    if tid == 0 {
        return None;
    }
    let s = std::fs::read_to_string(format!("/proc/{tid}/comm")).ok()?;
    Some(s.trim_end_matches('\n').to_owned())
}

/// A backing id, closed when dropped (each transport has its own type).
pub(crate) type HeldId = Box<dyn Any + Send>;

/// The watches on upper files the kernel writes directly.
#[derive(Debug, Default)]
pub(crate) struct Watcher {
    /// Made, and the event thread started, with the first watch.
    inotify: OnceLock<Arc<Inotify>>,
    maps: Mutex<Maps>,
    /// How many files are watched (kept with `maps`): with none, a request asking
    /// [`Watcher::file`] takes no lock (every read or write without a handle asks).
    watching: AtomicUsize,
}

#[derive(Default)]
struct Maps {
    by_wd: HashMap<WatchDescriptor, Ino>,
    by_ino: HashMap<Ino, Watched>,
}

impl std::fmt::Debug for Maps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maps")
            .field("watched", &self.by_ino.len())
            .finish_non_exhaustive()
    }
}

/// One watched upper file.
struct Watched {
    wd: WatchDescriptor,
    /// A read-write descriptor of the upper file, opened before the watch: the mount's own
    /// writes go through duplicates of it, so no close of the mount's is taken for the
    /// kernel's (the last duplicate closes after the watch is gone).
    file: Arc<std::fs::File>,
    /// The kernel has opened its backing file: the id is no longer needed.
    opened: bool,
    /// The backing id, until `opened` or [`HOLD`].
    id: Option<(Instant, HeldId)>,
}

/// What a batch of events says.
#[derive(Debug, Default)]
pub(crate) struct Batch {
    /// Inodes written (or possibly written: after an overflow, every one).
    pub(crate) written: Vec<Ino>,
    /// Inodes nothing has open any more: the kernel writes them no more.
    pub(crate) closed: Vec<Ino>,
}

impl Watcher {
    /// Watch `path`, the upper file of `ino`, for writes, opens and closes; the first watch
    /// starts the thread that hands events to `fs`.
    pub(crate) fn watch(&self, fs: &Arc<AwcpFs>, ino: Ino, path: &Path) -> std::io::Result<()> {
        let inotify = match self.inotify.get() {
            Some(i) => i.clone(),
            None => {
                let made = Arc::new(Inotify::init(
                    InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK,
                )?);
                if self.inotify.set(made.clone()).is_ok() {
                    let weak = Arc::downgrade(fs);
                    std::thread::Builder::new()
                        .name("awcpfs-bypass".into())
                        .spawn(move || run(&made, &weak))?;
                }
                self.inotify.get().expect("set above").clone()
            }
        };
        let file = Arc::new(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)?,
        );
        // Under the maps' lock: the thread maps no event of this watch before it is noted.
        let mut maps = self.maps.lock();
        let wd = inotify.add_watch(
            path,
            AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_OPEN,
        )?;
        maps.by_wd.insert(wd, ino);
        let old = maps.by_ino.insert(
            ino,
            Watched {
                wd,
                file,
                opened: false,
                id: None,
            },
        );
        if let Some(old) = old
            && old.wd != wd
        {
            maps.by_wd.remove(&old.wd);
        }
        self.watching.store(maps.by_ino.len(), Ordering::Relaxed);
        Ok(())
    }

    /// A descriptor for the mount's own writes to `ino`'s upper file while it is watched (a
    /// duplicate of [`Watched::file`]); `None` when it is not.
    pub(crate) fn file(&self, ino: Ino) -> Option<std::io::Result<std::fs::File>> {
        if self.watching.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let file = self.maps.lock().by_ino.get(&ino)?.file.clone();
        Some(file.try_clone())
    }

    /// Keep `id`, the backing id the `create` reply for `ino` named, until the kernel has
    /// opened its backing file (closed at once if it has already).
    pub(crate) fn hold(&self, ino: Ino, id: HeldId) {
        let mut maps = self.maps.lock();
        if let Some(w) = maps.by_ino.get_mut(&ino)
            && !w.opened
        {
            w.id = Some((Instant::now(), id));
            return;
        }
        drop(maps);
        drop(id);
    }

    /// Stop watching `ino`'s upper file (the kernel forgot the inode).
    pub(crate) fn unwatch(&self, ino: Ino) {
        let mut maps = self.maps.lock();
        if let Some(w) = maps.by_ino.remove(&ino) {
            self.watching.store(maps.by_ino.len(), Ordering::Relaxed);
            maps.by_wd.remove(&w.wd);
            if let Some(i) = self.inotify.get() {
                // (Fails if the upper file is gone already, which ended the watch.)
                let _ = i.rm_watch(w.wd);
            }
        }
    }

    /// Every watched inode.
    pub(crate) fn watched(&self) -> Vec<Ino> {
        self.maps.lock().by_ino.keys().copied().collect()
    }

    /// Read `events` in order: what was written, what the kernel writes no more (its watch
    /// removed). Backing ids no longer needed are closed.
    fn take(&self, events: &[InotifyEvent]) -> Batch {
        let mut ids = Vec::new();
        let mut gone = Vec::new();
        let mut written = HashSet::new();
        let mut closed = Vec::new();
        let mut maps = self.maps.lock();
        for ev in events {
            if ev.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                // Lost events: every file possibly written.
                written.extend(maps.by_ino.keys().copied());
                continue;
            }
            let Some(&ino) = maps.by_wd.get(&ev.wd) else {
                continue;
            };
            if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
                // The upper file is gone (removed with its unlinked node).
                maps.by_wd.remove(&ev.wd);
                gone.extend(maps.by_ino.remove(&ino));
                continue;
            }
            let Some(w) = maps.by_ino.get_mut(&ino) else {
                continue;
            };
            if ev
                .mask
                .intersects(AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE)
            {
                written.insert(ino);
            }
            if ev.mask.contains(AddWatchFlags::IN_OPEN) && !w.opened {
                w.opened = true;
                ids.extend(w.id.take());
            }
            if ev.mask.contains(AddWatchFlags::IN_CLOSE_WRITE) {
                // The kernel's backing file: no other writable descriptor of the file closes
                // while it is watched.
                let wd = w.wd;
                maps.by_wd.remove(&wd);
                if let Some(i) = self.inotify.get() {
                    let _ = i.rm_watch(wd);
                }
                gone.extend(maps.by_ino.remove(&ino));
                closed.push(ino);
            }
        }
        self.watching.store(maps.by_ino.len(), Ordering::Relaxed);
        drop(maps);
        // Closing an id closes the descriptor it was registered from (read-only: no event
        // that counts); the watched descriptors close after their watches are gone.
        drop(ids);
        drop(gone);
        Batch {
            written: written.into_iter().collect(),
            closed,
        }
    }

    /// Close the backing ids held longer than [`HOLD`].
    fn expire(&self) {
        let now = Instant::now();
        let mut ids = Vec::new();
        for w in self.maps.lock().by_ino.values_mut() {
            if w.id
                .as_ref()
                .is_some_and(|(t, _)| now.duration_since(*t) > HOLD)
            {
                w.opened = true;
                ids.extend(w.id.take());
            }
        }
        drop(ids);
    }
}

/// The event thread: until the filesystem is gone, hand each batch of events to it.
fn run(inotify: &Inotify, fs: &Weak<AwcpFs>) {
    loop {
        let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
        let ready = poll(
            &mut fds,
            PollTimeout::try_from(POLL).unwrap_or(PollTimeout::MAX),
        );
        let Some(fs) = fs.upgrade() else { return };
        fs.bypass().expire();
        if matches!(ready, Ok(0)) {
            continue;
        }
        match inotify.read_events() {
            Ok(events) => {
                let batch = fs.bypass().take(&events);
                for ino in batch.written {
                    fs.bypassed_write(ino);
                }
                for ino in batch.closed {
                    fs.bypass_closed(ino);
                }
            }
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
            Err(e) => {
                tracing::warn!(error = %e, "reading the upper files' write events failed");
                std::thread::sleep(POLL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_writers_option_reads_toolchain_off_or_names() {
        assert_eq!("toolchain".parse(), Ok(PassthroughWriters::Toolchain));
        assert_eq!("off".parse(), Ok(PassthroughWriters::Off));
        assert_eq!(
            "as, ld,,my-linker".parse(),
            Ok(PassthroughWriters::Named(vec![
                "as".into(),
                "ld".into(),
                "my-linker".into()
            ]))
        );
        assert!(",".parse::<PassthroughWriters>().is_err());
        // The kernel keeps 15 characters of a name: a longer one would never match.
        assert!(
            "a-name-longer-than-15"
                .parse::<PassthroughWriters>()
                .unwrap_err()
                .contains("15 characters")
        );
    }

    #[test]
    fn only_the_listed_threads_are_admitted() {
        let w = Writers::default();
        let me = nix::unistd::gettid().as_raw() as u32;
        let name = comm(me).unwrap();
        w.set(PassthroughWriters::Named(vec![name.clone()]));
        assert!(w.admits(me));
        w.set(PassthroughWriters::Named(vec![format!("{name}x")]));
        assert!(!w.admits(me));
        w.set(PassthroughWriters::Off);
        assert!(!w.admits(me));
        // This test's thread is no compiler.
        w.set(PassthroughWriters::Toolchain);
        assert!(!w.admits(me));
        assert!(!w.admits(0));
    }
}
