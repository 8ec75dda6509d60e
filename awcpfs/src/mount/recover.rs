//! Recovery after a crash: write back what a mount journaled but never committed.
//!
//! A mount keeps in its state directory everything needed to rebuild its tree without the
//! kernel: the manifest it started from (`manifest.json`), the journal of namespace changes
//! (`journal.log`), the content of changed files (`upper/<ino>`), and the log of what its
//! commits left at the export (`synced.log`). Recovery replays the journal over the
//! manifest, starts the syncer from the manifest plus `synced.log`, and runs final-flush
//! rounds until nothing is left. Every record describes state, not an operation, so running
//! recovery twice — or after a partly successful commit — writes each change exactly once:
//! the export accepts a change it already has as a no-op. A commit the mount sent but never
//! saw answered (the pending commit in `synced.log`) is sent again first, under its own id,
//! so the export answers it with its first outcome instead of judging the mount's later
//! changes against the state before it.

use std::path::Path;
use std::sync::Arc;

use awcp_protocol::dataplane::{Conflict, Manifest};

use super::fs::{AwcpFs, FsOptions};
use super::inode::InodeTable;
use super::journal::{self, Journal};
use super::remote::Remote;
use super::stats::Stats;
use super::sync::{PendingCommit, SyncError, SyncSignal, SyncedLog, SyncedRecord, Syncer};
use awcp_protocol::dataplane::MAX_APPLIED_QUERY;

/// The manifest a mount started from.
pub const MANIFEST_FILE: &str = "manifest.bin";
/// Where mounts before the binary manifest saved it (still read by recovery).
pub const LEGACY_MANIFEST_FILE: &str = "manifest.json";
/// What the mount's commits left at the export.
pub const SYNCED_FILE: &str = "synced.log";
/// The namespace journal.
pub const JOURNAL_FILE: &str = "journal.log";

/// The file a live mount (or a recovery) holds locked (`flock`) in its state directory.
pub const LOCK_FILE: &str = "lock";

/// Take the state directory's lock, or fail with `EWOULDBLOCK` when another process (a live
/// mount, a recovery) holds it. The kernel releases it when the holder exits, however it
/// ends: a mount killed with `-9` leaves nothing that would stop its recovery.
pub fn lock_state_dir(state_dir: &Path) -> std::io::Result<nix::fcntl::Flock<std::fs::File>> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(state_dir.join(LOCK_FILE))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|(_, errno)| std::io::Error::from(errno))
}

/// Remove the logs of a mount whose changes are all written back.
pub fn remove_logs(state_dir: &Path) {
    for f in [
        JOURNAL_FILE,
        SYNCED_FILE,
        MANIFEST_FILE,
        LEGACY_MANIFEST_FILE,
    ] {
        let _ = std::fs::remove_file(state_dir.join(f));
    }
}

/// Why recovery failed.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    /// No mount state to recover there.
    #[error("{path} holds no mount state to recover (no {MANIFEST_FILE})")]
    NothingHere {
        /// The state directory.
        path: std::path::PathBuf,
    },
    /// The state files are unreadable.
    #[error("reading the mount state in {path} failed")]
    State {
        /// The state directory.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The saved manifest is malformed.
    #[error("the saved manifest is malformed")]
    Manifest {
        /// Why.
        #[source]
        source: super::inode::ManifestError,
    },
    /// A live mount, or another recovery, is using the state directory.
    #[error(
        "another process (a live `awcpfs mount`, or `awcpfs recover`) is using the state \
         directory {path}: end it first — a mount's own end writes its changes back"
    )]
    InUse {
        /// The state directory.
        path: std::path::PathBuf,
    },
    /// Changes kept appearing round after round; the state is kept.
    #[error("recovery did not converge after {rounds} rounds; the state is kept, run it again")]
    Incomplete {
        /// Rounds run.
        rounds: usize,
    },
    /// Writing back failed; the state is kept, so recovery can run again.
    #[error("writing the recovered changes back failed; the state is kept, run recovery again")]
    Sync {
        /// Why.
        #[source]
        source: SyncError,
    },
}

/// What recovery did.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    /// Journal records replayed.
    pub records: usize,
    /// Changes committed.
    pub changes: usize,
    /// Files written back.
    pub files_written: usize,
    /// Conflicts the export reported (both versions kept there).
    pub conflicts: Vec<Conflict>,
    /// Writes the export's commit screen held: not written back, so the state directory
    /// is kept (a later recovery sends them again).
    pub held: Vec<awcp_protocol::dataplane::Held>,
}

/// A mount rebuilt from its state directory: the saved manifest with the journal replayed
/// over it, and what its commits are known to have left at the export.
struct SavedMount {
    manifest: Manifest,
    table: InodeTable,
    records: usize,
    synced: Vec<super::sync::SyncedRecord>,
    /// The commit the mount sent and never saw answered.
    pending: Option<super::sync::PendingCommit>,
    /// Earlier commits whose outcome `synced.log` could not record.
    unanswered: Vec<(usize, super::sync::PendingCommit)>,
    state_dir: std::path::PathBuf,
    uid: u32,
    gid: u32,
}

impl SavedMount {
    /// Load it; `None` when the directory holds no mount state.
    fn load(state_dir: &Path) -> Result<Option<SavedMount>, RecoverError> {
        let state_err = |source| RecoverError::State {
            path: state_dir.to_path_buf(),
            source,
        };
        let read = |name: &str| match std::fs::read(state_dir.join(name)) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(state_err(e)),
        };
        let manifest: Manifest = if let Some(b) = read(MANIFEST_FILE)? {
            super::remote::decode_manifest(&b)
                .map_err(|e| state_err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?
                .0
        } else if let Some(b) = read(LEGACY_MANIFEST_FILE)? {
            serde_json::from_slice(&b).map_err(|e| state_err(e.into()))?
        } else {
            return Ok(None);
        };
        let uid = nix::unistd::geteuid().as_raw();
        let gid = nix::unistd::getegid().as_raw();
        let mut table = InodeTable::from_manifest(&manifest, uid, gid)
            .map_err(|source| RecoverError::Manifest { source })?;
        let records = Journal::read_all(&state_dir.join(JOURNAL_FILE)).map_err(state_err)?;
        journal::replay(&mut table, &records, uid, gid);
        let logged = SyncedLog::read(&state_dir.join(SYNCED_FILE)).map_err(state_err)?;
        crate::private::create_dir_all(&state_dir.join("upper")).map_err(state_err)?;
        Ok(Some(SavedMount {
            manifest,
            table,
            records: records.len(),
            synced: logged.records,
            pending: logged.pending,
            unanswered: logged.unanswered,
            state_dir: state_dir.to_path_buf(),
            uid,
            gid,
        }))
    }

    /// The filesystem over the rebuilt table (no kernel), writing through `remote`.
    fn into_fs(self, remote: Arc<dyn Remote>, journal: Journal) -> Arc<AwcpFs> {
        Arc::new(AwcpFs::new(
            self.table,
            remote,
            journal,
            FsOptions {
                read_only: self.manifest.read_only,
                uid: self.uid,
                gid: self.gid,
                upper_dir: self.state_dir.join("upper"),
                block_size: self.manifest.block_size,
            },
            Arc::new(SyncSignal::default()),
            Arc::new(Stats::default()),
        ))
    }
}

/// Recover the mount state in `state_dir`, writing to the export behind `remote`. On
/// success the logs and upper files are removed.
pub fn recover(state_dir: &Path, remote: Arc<dyn Remote>) -> Result<RecoveryReport, RecoverError> {
    let state_err = |source| RecoverError::State {
        path: state_dir.to_path_buf(),
        source,
    };
    // Held until recovery returns: a mount started meanwhile on this directory is refused.
    let _lock = match lock_state_dir(state_dir) {
        Ok(lock) => Some(lock),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
            return Err(RecoverError::InUse {
                path: state_dir.to_path_buf(),
            });
        }
        // No directory (nothing to recover, said below) or a read-only one: no lock.
        Err(_) => None,
    };
    let Some(saved) = SavedMount::load(state_dir)? else {
        return Err(RecoverError::NothingHere {
            path: state_dir.to_path_buf(),
        });
    };
    let records = saved.records;
    let manifest = saved.manifest.clone();
    let synced = own_commits(remote.as_ref(), &saved.synced, &saved.unanswered);
    let pending = saved.pending.clone();
    let fs = saved.into_fs(
        remote,
        Journal::open(&state_dir.join(JOURNAL_FILE)).map_err(state_err)?,
    );
    let upper_dir = state_dir.join("upper");
    let log = SyncedLog::open(&state_dir.join(SYNCED_FILE)).map_err(state_err)?;
    let syncer = Syncer::with_log(fs, &manifest, &synced, Some(log));
    // A commit whose answer the mount never saw goes first, under its own id: the export
    // answers it with its first outcome if it applied it (never a conflict with itself).
    syncer.resume_pending(pending);
    let mut report = RecoveryReport {
        records,
        ..Default::default()
    };
    // Each round commits everything it sees; a second finds nothing unless the first
    // was cut short.
    for _ in 0..4 {
        let r = syncer
            .round(true)
            .map_err(|source| RecoverError::Sync { source })?;
        report.held.extend(r.held);
        if r.changes == 0 {
            let held = syncer.held_paths();
            if !held.is_empty() {
                // Held by the Delegator's commit screen: not written back, so the state
                // directory keeps them (never removed with the logs).
                report.held.retain(|h| held.contains(&h.path));
                return Ok(report);
            }
            remove_logs(state_dir);
            let _ = std::fs::remove_dir_all(&upper_dir);
            return Ok(report);
        }
        report.changes += r.changes;
        report.files_written += r.files_written;
        report.conflicts.extend(r.conflicts);
    }
    Err(RecoverError::Incomplete { rounds: 4 })
}

/// What the mount's commits left at the export, counting the commits whose outcome
/// `synced.log` could not record (a full state disk) but the export applied: the export is
/// asked which of them it applied, and what each left is placed where its outcome would
/// have been logged. Without this, the mount's own change would meet itself at the export
/// as a Delegator-side change at every path it wrote, and be kept as a conflict copy.
fn own_commits(
    remote: &dyn Remote,
    records: &[SyncedRecord],
    unanswered: &[(usize, PendingCommit)],
) -> Vec<SyncedRecord> {
    if unanswered.is_empty() {
        return records.to_vec();
    }
    // The export remembers at most this many outcomes: older ones are forgotten there too.
    let asked = &unanswered[unanswered.len().saturating_sub(MAX_APPLIED_QUERY)..];
    let ids: Vec<String> = asked.iter().map(|(_, p)| p.set.commit_id.clone()).collect();
    let applied = match remote.applied(&ids) {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %super::sync::source_chain(&e), commits = ids.len(),
                "cannot ask the export which of the commits synced.log could not record it applied: their paths are compared afresh (a conflict copy may result)");
            return records.to_vec();
        }
    };
    let mut out = Vec::with_capacity(records.len());
    let mut at = 0;
    for (pos, p) in asked {
        let pos = (*pos).clamp(at, records.len());
        out.extend_from_slice(&records[at..pos]);
        at = pos;
        let Some(r) = applied.iter().find(|r| r.commit_id == p.set.commit_id) else {
            continue;
        };
        tracing::info!(commit = %p.set.commit_id,
            "the export applied a commit whose outcome synced.log could not record: counted as written back");
        // A held write left the export's state there.
        let held: std::collections::HashSet<&str> =
            r.held.iter().map(|h| h.path.as_str()).collect();
        out.extend(
            p.next
                .iter()
                .filter(|rec| !held.contains(rec.path.as_str()))
                .cloned(),
        );
    }
    out.extend_from_slice(&records[at..]);
    out
}

/// A [`Remote`] that records instead of sending: what a final flush would upload and
/// commit becomes a recovery bundle.
#[derive(Default)]
struct Capture {
    blocks: parking_lot::Mutex<Vec<([u8; 32], Vec<u8>)>>,
    changes: parking_lot::Mutex<Option<awcp_protocol::dataplane::ChangeSet>>,
}

impl Remote for Capture {
    fn manifest(&self) -> Result<(Manifest, String), super::remote::RemoteError> {
        Err(offline())
    }
    fn fetch_blocks(&self, _: &[String]) -> Result<Vec<Vec<u8>>, super::remote::RemoteError> {
        Err(offline())
    }
    fn missing(&self, hashes: &[String]) -> Result<Vec<String>, super::remote::RemoteError> {
        // Everything the bundle has, it carries: the Delegator may no longer have any of it.
        Ok(hashes.to_vec())
    }
    fn upload(&self, blocks: &[([u8; 32], &[u8])]) -> Result<(), super::remote::RemoteError> {
        self.blocks
            .lock()
            .extend(blocks.iter().map(|(h, d)| (*h, d.to_vec())));
        Ok(())
    }
    fn commit(
        &self,
        changes: &awcp_protocol::dataplane::ChangeSet,
    ) -> Result<awcp_protocol::dataplane::CommitResult, super::remote::RemoteError> {
        *self.changes.lock() = Some(changes.clone());
        Ok(awcp_protocol::dataplane::CommitResult {
            commit_id: changes.commit_id.clone(),
            applied: changes.changes.len() as u64,
            conflicts: Vec::new(),
            seq: None,
            held: Vec::new(),
            current: None,
        })
    }
    fn events(
        &self,
    ) -> Result<
        Box<dyn Iterator<Item = super::remote::StreamItem> + Send>,
        super::remote::RemoteError,
    > {
        Err(offline())
    }
    fn renew(&self) -> Result<awcp_protocol::dataplane::ExportEvent, super::remote::RemoteError> {
        Err(offline())
    }
}

fn offline() -> super::remote::RemoteError {
    super::remote::RemoteError::Protocol {
        what: "building a recovery bundle needs no export".into(),
    }
}

/// Whether `state_dir` holds changes that were never written back.
pub fn has_unsynced(state_dir: &Path) -> bool {
    std::fs::metadata(state_dir.join(JOURNAL_FILE)).is_ok_and(|m| m.len() > 0)
        && state_dir.join(MANIFEST_FILE).exists()
}

/// Package what the mount in `state_dir` never wrote back as a recovery bundle (see
/// [`awcp_protocol::dataplane::encode_bundle`]), without contacting the export and
/// without changing the state. `None` when there is nothing to write back.
pub fn bundle(state_dir: &Path) -> Result<Option<Vec<u8>>, RecoverError> {
    let state_err = |source| RecoverError::State {
        path: state_dir.to_path_buf(),
        source,
    };
    let Some(saved) = SavedMount::load(state_dir)? else {
        return Ok(None);
    };
    let manifest = saved.manifest.clone();
    let synced = saved.synced.clone();
    let capture = Arc::new(Capture::default());
    // A scratch journal: building the bundle must not touch the real one.
    let scratch = tempfile_in(state_dir).map_err(state_err)?;
    let fs = saved.into_fs(capture.clone(), Journal::open(&scratch).map_err(state_err)?);
    let syncer = Syncer::with_log(fs, &manifest, &synced, None);
    let round = syncer.round(true);
    let _ = std::fs::remove_file(&scratch);
    round.map_err(|source| RecoverError::Sync { source })?;
    let Some(changes) = capture.changes.lock().take() else {
        return Ok(None);
    };
    let blocks = std::mem::take(&mut *capture.blocks.lock());
    Ok(Some(awcp_protocol::dataplane::encode_bundle(
        &changes, &blocks,
    )))
}

fn tempfile_in(dir: &Path) -> std::io::Result<std::path::PathBuf> {
    let p = dir.join(format!(".bundle-journal-{}", std::process::id()));
    std::fs::File::create(&p)?;
    Ok(p)
}
