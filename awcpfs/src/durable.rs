//! Making several files durable at once.
//!
//! Both halves sync many files before a step that must not run before they are durable: a
//! mount's write-back round (its upper files, journal and upper directory before the
//! commit is recorded and sent), an export's commit (its staged files before they are
//! renamed into place, the directories it changed before it answers). One `fdatasync`
//! after another waits for one filesystem journal commit each (ext4); issued together,
//! they join the same commit and cache flush. Every file still gets its own call, so what
//! is promised does not depend on how a filesystem orders its writes.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

/// Threads [`sync_together`] syncs from at most.
const SYNC_THREADS: usize = 8;

/// `fdatasync` (`fsync` where the flag is set) every file, several at once, and wait for
/// all; the first error, if any, after all have returned.
pub(crate) fn sync_together(files: &[(&std::fs::File, bool)]) -> std::io::Result<()> {
    let one = |(f, all): &(&std::fs::File, bool)| if *all { f.sync_all() } else { f.sync_data() };
    if files.len() <= 1 {
        return files.iter().try_for_each(one);
    }
    let next = AtomicUsize::new(0);
    let first_error: Mutex<Option<std::io::Error>> = Mutex::new(None);
    let worker = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(t) = files.get(i) else { break };
            if let Err(e) = one(t) {
                first_error.lock().get_or_insert(e);
            }
        }
    };
    std::thread::scope(|scope| {
        let mut spawned = 0;
        for _ in 1..files.len().min(SYNC_THREADS) {
            // A thread that cannot be started leaves its share to the others.
            if std::thread::Builder::new()
                .name("awcpfs-fsync".into())
                .spawn_scoped(scope, worker)
                .is_ok()
            {
                spawned += 1;
            }
        }
        tracing::trace!(
            files = files.len(),
            threads = spawned + 1,
            "syncing together"
        );
        worker();
    });
    first_error.into_inner().map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Every file given to `sync_together` is synced (more files than threads, through a
    /// recording filesystem that logs each `fsync` it is sent), directories with `fsync`;
    /// a file that cannot be synced fails the whole call, after the others were synced.
    #[test]
    fn sync_together_syncs_every_file_and_reports_a_failure() {
        use crate::testing::recordfs::{Op, Recorder};
        if !crate::testing::fuse_available() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let (backing, mnt) = (tmp.path().join("backing"), tmp.path().join("mnt"));
        std::fs::create_dir_all(&backing).unwrap();
        std::fs::create_dir_all(&mnt).unwrap();
        let recorder = Recorder::mount(&backing, &mnt).unwrap();
        let n = 3 * SYNC_THREADS + 1;
        let files: Vec<std::fs::File> = (0..n)
            .map(|i| {
                let p = mnt.join(format!("f{i}"));
                std::fs::write(&p, format!("content {i}")).unwrap();
                std::fs::File::open(&p).unwrap()
            })
            .collect();
        let dir = std::fs::File::open(&mnt).unwrap();
        let before = recorder.len();
        let mut targets: Vec<(&std::fs::File, bool)> = files.iter().map(|f| (f, false)).collect();
        targets.push((&dir, true));
        sync_together(&targets).unwrap();
        let ops = recorder.ops();
        let created: HashMap<u64, String> = ops
            .iter()
            .filter_map(|op| match op {
                Op::Create { fid, name, .. } => Some((*fid, name.to_string_lossy().into_owned())),
                _ => None,
            })
            .collect();
        let mut synced: Vec<String> = ops[before..]
            .iter()
            .filter_map(|op| match op {
                Op::Fsync { fid } => created.get(fid).cloned(),
                _ => None,
            })
            .collect();
        synced.sort();
        let mut want: Vec<String> = (0..n).map(|i| format!("f{i}")).collect();
        want.sort();
        assert_eq!(synced, want, "each file synced exactly once");
        assert_eq!(
            ops[before..]
                .iter()
                .filter(|op| matches!(op, Op::FsyncDir { .. }))
                .count(),
            1,
            "the directory synced with fsync"
        );

        // A pipe cannot be synced (EINVAL): the call fails, and still syncs the rest.
        let (r, _w) = std::io::pipe().unwrap();
        let pipe = std::fs::File::from(std::os::fd::OwnedFd::from(r));
        let before = recorder.len();
        let targets = [(&files[0], false), (&pipe, false), (&files[1], false)];
        let e = sync_together(&targets).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
        let after = recorder.ops()[before..]
            .iter()
            .filter(|op| matches!(op, Op::Fsync { .. }))
            .count();
        assert_eq!(after, 2, "the files beside the failing one were synced");
        drop(recorder);
    }
}
