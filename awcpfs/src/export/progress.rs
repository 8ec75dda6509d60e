//! How far a manifest build has got, for a progress bar.
//!
//! The walk and the hashing run at the same time (the walk hands files to hashing
//! threads), so the totals grow until the walk is over: `walked` says when they are final.
//! Files whose hashes come from the hash cache count as hashed as soon as they are seen.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// Live counters of one manifest build; share it (`Arc`) with whoever shows progress.
#[derive(Debug, Default)]
pub struct BuildProgress {
    files_seen: AtomicU64,
    bytes_seen: AtomicU64,
    files_hashed: AtomicU64,
    bytes_hashed: AtomicU64,
    walked: AtomicBool,
    done: AtomicBool,
}

/// A copy of [`BuildProgress`] at one instant (camelCase JSON).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildProgressSnapshot {
    /// Regular files found so far (final once `walked`).
    pub files_total: u64,
    /// Their bytes.
    pub bytes_total: u64,
    /// Files whose hashes are known (hashed now, or from the hash cache).
    pub files_hashed: u64,
    /// Their bytes.
    pub bytes_hashed: u64,
    /// The walk is over: the totals are final.
    pub walked: bool,
    /// The manifest is built.
    pub done: bool,
}

impl BuildProgress {
    pub(crate) fn saw_file(&self, bytes: u64, hashed: bool) {
        self.files_seen.fetch_add(1, Ordering::Relaxed);
        self.bytes_seen.fetch_add(bytes, Ordering::Relaxed);
        if hashed {
            self.hashed_file(bytes);
        }
    }

    pub(crate) fn hashed_file(&self, bytes: u64) {
        self.files_hashed.fetch_add(1, Ordering::Relaxed);
        self.bytes_hashed.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn set_walked(&self) {
        self.walked.store(true, Ordering::Release);
    }

    pub(crate) fn set_done(&self) {
        self.done.store(true, Ordering::Release);
    }

    /// The counters now.
    pub fn snapshot(&self) -> BuildProgressSnapshot {
        BuildProgressSnapshot {
            files_total: self.files_seen.load(Ordering::Relaxed),
            bytes_total: self.bytes_seen.load(Ordering::Relaxed),
            files_hashed: self.files_hashed.load(Ordering::Relaxed),
            bytes_hashed: self.bytes_hashed.load(Ordering::Relaxed),
            walked: self.walked.load(Ordering::Acquire),
            done: self.done.load(Ordering::Acquire),
        }
    }
}
