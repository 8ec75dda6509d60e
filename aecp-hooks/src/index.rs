//! The path → artifacts index: what a mount's replica holds and what the daemon keeps per
//! workspace. Each artifact is bound to one workspace-relative path at publish time (a file,
//! a directory, or `""` for the workspace); the artifacts for an access to `pkg/sub/a.py` are
//! those bound to `pkg/sub/a.py`, `pkg/sub`, `pkg` and `""` — one hash lookup per level.
//!
//! [`IndexEvent`] is what the export's event stream carries to keep a replica current: an
//! artifact (new or changed: its whole record), a delivery recorded elsewhere, a forward.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::knowledge::{Artifact, ArtifactId};

/// One change to a replica, as sent over the export's event stream (`aecp` events).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum IndexEvent {
    /// An artifact, new or changed (its status, its revision).
    Artifact {
        /// The whole record.
        artifact: Artifact,
    },
    /// This worker already received `id` at `revision` (catch-up after a restart).
    Delivered {
        /// The artifact.
        id: ArtifactId,
        /// The revision it got.
        revision: u32,
    },
    /// Deliver `id` to this worker now: the publication was forwarded to it as an owner of
    /// a related module.
    Forward {
        /// The artifact.
        id: ArtifactId,
    },
    /// The newest revision of a module's contract (its JSON, from the contract library).
    Contract {
        /// The module path (`pkg/acct.py`).
        module: String,
        /// Its revision.
        revision: u32,
        /// The contract.
        body: serde_json::Value,
    },
    /// The commit screen's report on a write-back of this worker: held (a provable contract
    /// mismatch, or an import of a revised module not acknowledged yet), or written back
    /// with a leftover stub. Replaces an earlier report for the same path.
    Violation {
        /// The path written back (the contracted module, or the importing file).
        module: String,
        /// The report (`aecp_hooks::screen::ScreenReport` as JSON).
        detail: serde_json::Value,
    },
    /// The report for `module` no longer holds: a later write-back of it passed.
    ViolationCleared {
        /// The path.
        module: String,
        /// When (milliseconds since the epoch): a reconnect's catch-up sends the event again,
        /// and the mount announces each one once.
        #[serde(default, rename = "atMs")]
        at_ms: u64,
    },
    /// The export no longer holds these paths (the worker acknowledged the revision they
    /// waited for): the mount sends them again.
    Released {
        /// Workspace-relative paths.
        paths: Vec<String>,
    },
}

/// Artifacts by id and by bound path.
#[derive(Debug, Clone, Default)]
pub struct ArtifactIndex {
    artifacts: HashMap<ArtifactId, Artifact>,
    by_path: HashMap<String, Vec<ArtifactId>>,
}

impl ArtifactIndex {
    /// An empty index.
    pub fn new() -> ArtifactIndex {
        ArtifactIndex::default()
    }

    /// Number of artifacts held.
    pub fn len(&self) -> usize {
        self.artifacts.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.artifacts.is_empty()
    }

    /// Adds or replaces an artifact. Returns whether anything changed (an older or equal
    /// revision of a known artifact changes nothing: events may arrive twice).
    pub fn upsert(&mut self, a: Artifact) -> bool {
        if let Some(old) = self.artifacts.get(&a.id) {
            if old.revision >= a.revision && *old == a {
                return false;
            }
            if old.revision > a.revision {
                return false;
            }
            if old.bound != a.bound {
                let old_bound = old.bound.clone();
                self.unbind(a.id, &old_bound);
            }
        }
        let ids = self.by_path.entry(a.bound.clone()).or_default();
        if !ids.contains(&a.id) {
            ids.push(a.id);
        }
        self.artifacts.insert(a.id, a);
        true
    }

    fn unbind(&mut self, id: ArtifactId, path: &str) {
        if let Some(ids) = self.by_path.get_mut(path) {
            ids.retain(|i| *i != id);
            if ids.is_empty() {
                self.by_path.remove(path);
            }
        }
    }

    /// Removes an artifact.
    pub fn remove(&mut self, id: ArtifactId) -> Option<Artifact> {
        let a = self.artifacts.remove(&id)?;
        self.unbind(id, &a.bound);
        Some(a)
    }

    /// An artifact by id.
    pub fn get(&self, id: ArtifactId) -> Option<&Artifact> {
        self.artifacts.get(&id)
    }

    /// Every artifact, in no particular order.
    pub fn all(&self) -> impl Iterator<Item = &Artifact> {
        self.artifacts.values()
    }

    /// Artifacts bound exactly to `path`.
    pub fn at(&self, path: &str) -> impl Iterator<Item = &Artifact> {
        self.by_path
            .get(path)
            .into_iter()
            .flatten()
            .filter_map(|id| self.artifacts.get(id))
    }

    /// Artifacts bound to `path` or any enclosing directory, the workspace (`""`) included.
    /// No allocation: the enclosing directories are prefixes of `path`.
    pub fn bound_to<'a>(&'a self, path: &'a str) -> impl Iterator<Item = &'a Artifact> + 'a {
        let path = path.trim_matches('/');
        let cuts = path.match_indices('/').map(|(i, _)| i);
        let prefixes = std::iter::once(path)
            .chain(cuts.map(move |i| &path[..i]))
            .chain((!path.is_empty()).then_some(""));
        prefixes.flat_map(move |p| self.at(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knowledge::{Scope, WitnessStatus};
    use proptest::prelude::*;

    fn art(id: ArtifactId, bound: &str) -> Artifact {
        Artifact {
            id,
            claim: "c".into(),
            scope: if bound.is_empty() {
                Scope::Workspace
            } else {
                Scope::File(bound.into())
            },
            bound: bound.into(),
            witness: None,
            status: WitnessStatus::Unchecked,
            producer: "w".into(),
            created_ms: id,
            revision: 1,
        }
    }

    #[test]
    fn lookups_see_the_path_and_its_directories() {
        let mut ix = ArtifactIndex::new();
        ix.upsert(art(1, "pkg/sub/a.py"));
        ix.upsert(art(2, "pkg/sub"));
        ix.upsert(art(3, "pkg"));
        ix.upsert(art(4, ""));
        ix.upsert(art(5, "pkg/sub/b.py"));
        ix.upsert(art(6, "pk"));
        let mut ids: Vec<_> = ix.bound_to("pkg/sub/a.py").map(|a| a.id).collect();
        ids.sort();
        assert_eq!(ids, [1, 2, 3, 4]);
        let mut root: Vec<_> = ix.bound_to("").map(|a| a.id).collect();
        root.sort();
        assert_eq!(root, [4]);
        assert_eq!(ix.at("pkg").map(|a| a.id).collect::<Vec<_>>(), [3]);
    }

    #[test]
    fn upsert_keeps_the_newest_revision_and_rebinds() {
        let mut ix = ArtifactIndex::new();
        assert!(ix.upsert(art(1, "a.py")));
        assert!(
            !ix.upsert(art(1, "a.py")),
            "same event twice changes nothing"
        );
        let moved = Artifact {
            revision: 2,
            ..art(1, "b.py")
        };
        assert!(ix.upsert(moved));
        assert_eq!(ix.at("a.py").count(), 0);
        assert_eq!(ix.at("b.py").count(), 1);
        assert!(!ix.upsert(art(1, "a.py")), "an older revision is ignored");
        ix.remove(1);
        assert!(ix.is_empty());
        assert_eq!(ix.bound_to("b.py").count(), 0);
    }

    proptest! {
        /// Against a reference model: `bound_to` finds exactly the artifacts whose bound path
        /// is the path or a directory prefix of it, whatever sequence of upserts and removes.
        #[test]
        fn bound_to_matches_a_model(
            ops in prop::collection::vec((0u64..12, prop::sample::select(vec!["", "a", "a/b", "a/b/c.py", "a/bc", "x.py"]), any::<bool>()), 0..60),
            probe in prop::sample::select(vec!["", "a", "a/b", "a/b/c.py", "a/bc", "x.py", "a/b/zz"]),
        ) {
            let mut ix = ArtifactIndex::new();
            let mut model: HashMap<u64, (String, u32)> = HashMap::new();
            for (id, bound, remove) in ops {
                if remove {
                    ix.remove(id);
                    model.remove(&id);
                } else {
                    let rev = model.get(&id).map_or(1, |(_, r)| r + 1);
                    ix.upsert(Artifact { revision: rev, ..art(id, bound) });
                    model.insert(id, (bound.to_owned(), rev));
                }
            }
            let mut got: Vec<u64> = ix.bound_to(probe).map(|a| a.id).collect();
            got.sort();
            let mut want: Vec<u64> = model.iter().filter(|(_, (b, _))| {
                b.is_empty() || probe == b || probe.starts_with(&format!("{b}/"))
            }).map(|(id, _)| *id).collect();
            want.sort();
            prop_assert_eq!(got, want);
        }
    }
}
