//! How far the long parts of a delegation have got, for progress bars.
//!
//! `POST /delegate` answers only once every manifest is built and START is sent, which on
//! a large tree takes a while. A client that wants to show progress meanwhile sends a key
//! of its choosing in the [`PROGRESS_HEADER`] header and polls
//! `GET /delegate/progress/:key`; afterwards the same figures stay in
//! `GET /delegation/:id` (`progress`, an addition to the reference's record).

use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use awcpfs::export::{BuildProgress, BuildProgressSnapshot};

/// The request header carrying a client's progress key (ours).
pub const PROGRESS_HEADER: &str = "x-awcp-progress-key";

/// Where a delegation is: `admission`, `manifest`, `invite`, `start`, `started`, `ended`.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    phase: Mutex<&'static str>,
    manifests: Mutex<Vec<(String, Arc<BuildProgress>)>>,
}

/// How far a delegation has got at one instant, as the daemon API shows it (camelCase JSON).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProgressView {
    /// `admission`, `manifest` (building manifests), `invite`, `start` (START on its
    /// way), `started` (the Executor has it; the record's `state` says the rest), `ended`
    /// (the Executor sent its last event: its final sync is over and it has unmounted).
    /// A delegation restored after a daemon restart shows `started` or `ended`, with no
    /// manifest figures.
    pub phase: String,
    /// The manifest builds, all resources summed (`awcpfs` only).
    pub manifest: BuildProgressSnapshot,
    /// Per resource, when there are several.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<ResourceProgress>,
}

/// One resource's manifest build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceProgress {
    /// The resource's name.
    pub name: String,
    /// Its manifest build.
    #[serde(flatten)]
    pub manifest: BuildProgressSnapshot,
}

impl Progress {
    pub(crate) fn new() -> Arc<Progress> {
        Arc::new(Progress {
            phase: Mutex::new("admission"),
            manifests: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn set_phase(&self, phase: &'static str) {
        *self.phase.lock() = phase;
    }

    /// Counters for the manifest of resource `name`; the phase becomes `manifest`.
    pub(crate) fn add_manifest(&self, name: &str) -> Arc<BuildProgress> {
        self.set_phase("manifest");
        let p = Arc::new(BuildProgress::default());
        self.manifests.lock().push((name.to_string(), p.clone()));
        p
    }

    pub(crate) fn view(&self) -> ProgressView {
        let per: Vec<ResourceProgress> = self
            .manifests
            .lock()
            .iter()
            .map(|(name, p)| ResourceProgress {
                name: name.clone(),
                manifest: p.snapshot(),
            })
            .collect();
        let mut sum = BuildProgressSnapshot {
            walked: true,
            done: true,
            ..Default::default()
        };
        for r in &per {
            let m = &r.manifest;
            sum.files_total += m.files_total;
            sum.bytes_total += m.bytes_total;
            sum.files_hashed += m.files_hashed;
            sum.bytes_hashed += m.bytes_hashed;
            sum.walked &= m.walked;
            sum.done &= m.done;
        }
        if per.is_empty() {
            sum = BuildProgressSnapshot::default();
        }
        ProgressView {
            phase: (*self.phase.lock()).to_string(),
            manifest: sum,
            resources: if per.len() > 1 { per } else { Vec::new() },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_sums_resources_and_lists_them_when_several() {
        let p = Progress::new();
        assert_eq!(p.view().phase, "admission");
        assert!(!p.view().manifest.done);
        let a = p.add_manifest("a");
        assert_eq!(p.view().phase, "manifest");
        assert!(p.view().resources.is_empty(), "one resource: no list");
        let _b = p.add_manifest("b");
        let v = p.view();
        assert_eq!(v.resources.len(), 2);
        assert_eq!(v.resources[0].name, "a");
        assert!(!v.manifest.done);
        drop(a);
        let json = serde_json::to_value(p.view()).unwrap();
        assert_eq!(json["resources"][1]["name"], "b");
        assert!(json["manifest"]["filesTotal"].is_u64());
    }
}
