//! The one policy struct: how many artifacts a lookup delivers, in what order, how long a
//! claim may be, and to how many owners a publication is forwarded.
//!
//! Defaults are the seed's numbers: 5 per lookup, newest first, claims cut to 280
//! characters, refuted never, once per worker unless changed, forwarded to at most 4 owners
//! (same file, then the import graph, then the same package). 5 × 280 keeps one access's
//! addition near 1,400 characters.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::knowledge::{Artifact, ArtifactId, Delivery, WitnessStatus};
use crate::scope::ImportGraph;

/// What the framework does with artifacts. One struct, one set of defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Policy {
    /// At most this many artifacts reach a worker per access.
    pub per_lookup: usize,
    /// Each delivered claim is cut to this many characters (Unicode scalar values).
    pub claim_chars: usize,
    /// A publication is forwarded to at most this many owning workers.
    pub forward_to: usize,
    /// A worker gets an artifact once, and again only when it changes (its revision).
    pub once_per_worker: bool,
    /// Hold a stale consumer's write-backs of files importing a revised module until it
    /// acknowledges (revision tracking; off by default).
    pub hold_stale_writebacks: bool,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            per_lookup: 5,
            claim_chars: 280,
            forward_to: 4,
            once_per_worker: true,
            hold_stale_writebacks: false,
        }
    }
}

/// What a worker has already received: artifact id → the revision it got.
pub type Delivered = HashMap<ArtifactId, u32>;

impl Policy {
    /// Cuts a claim to [`Policy::claim_chars`] characters; a cut claim ends with `…` (which
    /// counts toward the limit).
    pub fn cut_claim(&self, claim: &str) -> String {
        if claim.chars().count() <= self.claim_chars {
            return claim.to_owned();
        }
        if self.claim_chars == 0 {
            return String::new();
        }
        let mut out: String = claim.chars().take(self.claim_chars - 1).collect();
        out.push('…');
        out
    }

    /// Whether `a` may reach a worker that has `delivered`: never refuted, and once per
    /// revision when [`Policy::once_per_worker`].
    pub fn deliverable(&self, a: &Artifact, delivered: &Delivered) -> bool {
        self.admits(a.status, a.revision, delivered.get(&a.id).copied())
    }

    /// [`Policy::deliverable`] from the parts it looks at: an artifact's status and revision,
    /// and the revision of it the worker received (`got`, if any).
    pub fn admits(&self, status: WitnessStatus, revision: u32, got: Option<u32>) -> bool {
        status != WitnessStatus::Refuted
            && !(self.once_per_worker && got.is_some_and(|r| r >= revision))
    }

    /// Picks what one access delivers out of the artifacts bound to the path: deliverable
    /// ones, newest first (ties: higher id first), each once, at most
    /// [`Policy::per_lookup`].
    pub fn select<'a>(
        &self,
        candidates: impl IntoIterator<Item = &'a Artifact>,
        delivered: &Delivered,
    ) -> Vec<&'a Artifact> {
        let mut seen = HashSet::new();
        let mut out: Vec<&Artifact> = candidates
            .into_iter()
            .filter(|a| self.deliverable(a, delivered) && seen.insert(a.id))
            .collect();
        out.sort_by_key(|a| std::cmp::Reverse((a.created_ms, a.id)));
        out.truncate(self.per_lookup);
        out
    }

    /// The fixed delivery template for `a`.
    pub fn delivery(&self, a: &Artifact) -> Delivery {
        Delivery {
            kind: crate::knowledge::LineKind::Finding,
            id: a.id,
            scope: a.scope.to_string(),
            status: a.status,
            producer: a.producer.clone(),
            claim: self.cut_claim(&a.claim),
        }
    }

    /// The workers a publication bound to `file` is forwarded to, in order: owners of the
    /// same file, then owners of modules connected to it in the import graph (either
    /// direction), then owners of a file in the same package (directory); the producer
    /// excluded, each worker once, at most [`Policy::forward_to`].
    pub fn forward_targets(
        &self,
        producer: &str,
        file: &str,
        owners: &[Owner],
        graph: &ImportGraph,
    ) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let push = |w: &str, out: &mut Vec<String>| {
            if w != producer && !out.iter().any(|o| o == w) && out.len() < self.forward_to {
                out.push(w.to_owned());
            }
        };
        // 1. the same file
        for o in owners.iter().filter(|o| o.owns(file)) {
            push(&o.worker, &mut out);
        }
        // 2. connected in the import graph (sorted: deterministic order)
        let mut related: Vec<&str> = graph.neighbours(file).into_iter().collect();
        related.sort_unstable();
        for r in related {
            for o in owners.iter().filter(|o| o.owns(r)) {
                push(&o.worker, &mut out);
            }
        }
        // 3. the same package: an owner of anything in the file's directory
        let dir = parent(file);
        for o in owners.iter().filter(|o| o.owns_in_dir(dir)) {
            push(&o.worker, &mut out);
        }
        out
    }
}

fn parent(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(d, _)| d)
}

/// A worker and what it owns: `--owns` globs, or (none given) the files it wrote back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Owner {
    /// The worker (delegation id).
    pub worker: String,
    /// Globs over workspace-relative paths (`*`, `?` within a name, `**` any depth). A
    /// pattern naming a directory owns what is under it.
    pub globs: Vec<String>,
    /// Files it wrote back (used when `globs` is empty).
    pub written: Vec<String>,
}

impl Owner {
    /// Whether this worker owns `path`.
    pub fn owns(&self, path: &str) -> bool {
        if self.globs.is_empty() {
            self.written.iter().any(|w| w == path)
        } else {
            self.globs.iter().any(|g| glob_owns(g, path))
        }
    }

    /// Whether this worker owns something directly in directory `dir` (`""`: the root).
    fn owns_in_dir(&self, dir: &str) -> bool {
        if self.globs.is_empty() {
            return self.written.iter().any(|w| parent(w) == dir);
        }
        self.globs.iter().any(|g| {
            let g = g.trim_start_matches("./").trim_end_matches('/');
            // A glob owning the directory itself, or a glob whose own directory part is
            // `dir` (e.g. `pkg/*.py` for `pkg`).
            glob_owns(g, dir) && !dir.is_empty() || parent(g) == dir
        })
    }
}

/// `pattern` owns `path` if it matches it or one of its ancestor directories.
pub fn glob_owns(pattern: &str, path: &str) -> bool {
    let pattern = pattern.trim_start_matches("./").trim_end_matches('/');
    let pat: Vec<&str> = pattern.split('/').collect();
    let parts: Vec<&str> = path.split('/').collect();
    (1..=parts.len()).any(|n| glob_parts(&pat, &parts[..n]))
}

fn glob_parts(pat: &[&str], path: &[&str]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((&"**", rest)) => (0..=path.len()).any(|i| glob_parts(rest, &path[i..])),
        Some((p, rest)) => match path.split_first() {
            Some((c, tail)) => glob_name(p, c) && glob_parts(rest, tail),
            None => false,
        },
    }
}

/// `*` and `?` within one name (characters, not bytes).
fn glob_name(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knowledge::Scope;
    use proptest::prelude::*;

    fn art(id: u64, created_ms: u64, status: WitnessStatus) -> Artifact {
        Artifact {
            id,
            claim: format!("claim {id}"),
            scope: Scope::File("pkg/a.py".into()),
            bound: "pkg/a.py".into(),
            witness: None,
            status,
            producer: "w1".into(),
            created_ms,
            revision: 1,
        }
    }

    #[test]
    fn defaults_are_the_seeds_numbers() {
        let p = Policy::default();
        assert_eq!((p.per_lookup, p.claim_chars, p.forward_to), (5, 280, 4));
        assert!(p.once_per_worker);
    }

    #[test]
    fn claims_are_cut_to_280_characters_not_bytes() {
        let p = Policy::default();
        let long = "é".repeat(1000);
        let cut = p.cut_claim(&long);
        assert_eq!(cut.chars().count(), 280);
        assert!(cut.ends_with('…'));
        assert_eq!(p.cut_claim("short"), "short");
        let exact = "x".repeat(280);
        assert_eq!(p.cut_claim(&exact), exact);
    }

    #[test]
    fn refuted_never_and_changed_again() {
        let p = Policy::default();
        let mut delivered = Delivered::new();
        let refuted = art(1, 10, WitnessStatus::Refuted);
        assert!(!p.deliverable(&refuted, &delivered));
        let mut a = art(2, 10, WitnessStatus::Checked);
        assert!(p.deliverable(&a, &delivered));
        delivered.insert(2, 1);
        assert!(!p.deliverable(&a, &delivered), "delivered twice");
        a.revision = 2;
        assert!(
            p.deliverable(&a, &delivered),
            "a changed artifact is delivered again"
        );
    }

    proptest! {
        /// Whatever the candidates: at most 5, none refuted, none already delivered at its
        /// revision, no duplicates, newest first.
        #[test]
        fn select_keeps_limits_and_order(
            arts in prop::collection::vec((0u64..20, 0u64..1000, 0u8..3, 1u32..3), 0..40),
            delivered in prop::collection::hash_map(0u64..20, 1u32..3, 0..10),
        ) {
            let p = Policy::default();
            let arts: Vec<Artifact> = arts.into_iter().map(|(id, t, s, r)| {
                let status = [WitnessStatus::Unchecked, WitnessStatus::Checked, WitnessStatus::Refuted][s as usize];
                Artifact { revision: r, ..art(id, t, status) }
            }).collect();
            let picked = p.select(&arts, &delivered);
            prop_assert!(picked.len() <= 5);
            let mut ids = HashSet::new();
            for w in picked.windows(2) {
                prop_assert!((w[0].created_ms, w[0].id) >= (w[1].created_ms, w[1].id));
            }
            for a in &picked {
                prop_assert!(a.status != WitnessStatus::Refuted);
                prop_assert!(delivered.get(&a.id).is_none_or(|r| *r < a.revision));
                prop_assert!(ids.insert(a.id));
            }
            // Nothing newer that was deliverable was left out.
            let eligible = arts.iter().filter(|a| p.deliverable(a, &delivered)).map(|a| a.id).collect::<HashSet<_>>();
            prop_assert_eq!(picked.len(), eligible.len().min(5));
        }

        #[test]
        fn cut_claim_never_exceeds_the_limit(s in ".{0,600}", n in 0usize..400) {
            let p = Policy { claim_chars: n, ..Policy::default() };
            prop_assert!(p.cut_claim(&s).chars().count() <= n);
        }
    }

    #[test]
    fn globs_own_files_and_directories() {
        assert!(glob_owns("pkg/a.py", "pkg/a.py"));
        assert!(glob_owns("pkg", "pkg/a.py"));
        assert!(glob_owns("pkg/", "pkg/sub/b.py"));
        assert!(glob_owns("pkg/*.py", "pkg/a.py"));
        assert!(!glob_owns("pkg/*.py", "pkg/sub/b.py"));
        assert!(glob_owns("**/b.py", "pkg/sub/b.py"));
        assert!(!glob_owns("pkg/a.py", "pkg/ab.py"));
        assert!(!glob_owns("lib", "pkg/lib"));
    }

    #[test]
    fn forwarding_order_same_file_then_imports_then_package() {
        let owner = |w: &str, globs: &[&str]| Owner {
            worker: w.into(),
            globs: globs.iter().map(|s| s.to_string()).collect(),
            written: vec![],
        };
        let owners = vec![
            owner("pkgmate", &["pkg/c.py"]),
            owner("importer", &["app/main.py"]),
            owner("same", &["pkg/a.py"]),
            owner("producer", &["pkg/a.py"]),
            owner("far", &["other/x.py"]),
            owner("imported", &["pkg/util.py"]),
            owner("pkgmate2", &["pkg/*.py"]),
        ];
        let mut graph = ImportGraph::default();
        graph.add_edge("app/main.py", "pkg/a.py");
        graph.add_edge("pkg/a.py", "pkg/util.py");
        let p = Policy::default();
        let got = p.forward_targets("producer", "pkg/a.py", &owners, &graph);
        // pkgmate2 owns pkg/a.py through its glob, so it counts as "same file".
        assert_eq!(got, ["same", "pkgmate2", "importer", "imported"]);
        let p2 = Policy {
            forward_to: 10,
            ..p
        };
        let all = p2.forward_targets("producer", "pkg/a.py", &owners, &graph);
        assert_eq!(all, ["same", "pkgmate2", "importer", "imported", "pkgmate"]);
    }

    #[test]
    fn without_globs_a_worker_owns_what_it_wrote_back() {
        let o = Owner {
            worker: "w".into(),
            globs: vec![],
            written: vec!["pkg/b.py".into()],
        };
        assert!(o.owns("pkg/b.py"));
        assert!(!o.owns("pkg/a.py"));
        let p = Policy::default();
        let got = p.forward_targets("x", "pkg/a.py", &[o], &ImportGraph::default());
        assert_eq!(got, ["w"], "same package");
    }
}
