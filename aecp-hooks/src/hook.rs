//! The narrow interface a mount calls: [`WorkerHook`], one per worker (mount).
//!
//! * [`WorkerHook::on_access`] — called on lookup, open and read of a path. It must never
//!   block on I/O: with no artifacts it is one atomic load; otherwise one short lock and a
//!   hash lookup per directory level of the path. What it delivers is appended to the
//!   in-memory inbox and sent, as a [`Note`], down an unbounded channel (a send never
//!   blocks) that the mount drains on its own thread: it records deliveries back to the
//!   daemon and streams them to the worker's socket.
//! * [`WorkerHook::apply`] — an [`IndexEvent`] from the export's event stream; returns the
//!   path whose kernel entry the mount must invalidate so the next access reaches it.
//! * The read-only views behind `.aecp/…` and the `user.aecp.findings` attribute:
//!   [`WorkerHook::inbox`], [`WorkerHook::findings`], [`WorkerHook::contract`],
//!   [`WorkerHook::violations`]. Every line is a [`crate::knowledge::Delivery`] (or a
//!   contract/violation record), one JSON object per line: quoted data, never prose.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::index::{ArtifactIndex, IndexEvent};
use crate::knowledge::{Artifact, Delivery};
use crate::policy::{Delivered, Policy};

/// Most findings listed by `.aecp/findings/<path>` (the xattr lists [`Policy::per_lookup`]).
pub const FINDINGS_LIST_MAX: usize = 50;

/// One delivery made, for the mount's background thread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Note {
    /// What the worker received (the fixed template).
    pub delivery: Delivery,
    /// The artifact's revision it received.
    pub revision: u32,
    /// The access that triggered it (`None`: forwarded on publication).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

#[derive(Default)]
struct State {
    index: ArtifactIndex,
    delivered: Delivered,
    inbox: Vec<u8>,
    contracts: BTreeMap<String, Vec<u8>>,
    /// The current report per path, one NDJSON line each.
    violations: BTreeMap<String, Vec<u8>>,
    /// Lines for the worker's socket that are not deliveries (violation reports).
    lines: Vec<String>,
    /// Paths the export released, for the mount's syncer.
    released: Vec<String>,
    /// Violation events already announced in the inbox and on the socket (a reconnect's
    /// catch-up sends them all again).
    announced: std::collections::HashSet<String>,
}

/// One worker's replica of its workspace's artifact index and what it has received.
pub struct WorkerHook {
    worker: String,
    policy: Policy,
    /// Whether the index holds anything: the hot path's only cost when it does not.
    active: AtomicBool,
    state: Mutex<State>,
    notes: mpsc::Sender<Note>,
}

impl std::fmt::Debug for WorkerHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHook")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

impl WorkerHook {
    /// A hook for `worker` and the receiving end of its delivery notes.
    pub fn new(worker: &str, policy: Policy) -> (WorkerHook, mpsc::Receiver<Note>) {
        let (tx, rx) = mpsc::channel();
        let hook = WorkerHook {
            worker: worker.to_owned(),
            policy,
            active: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            notes: tx,
        };
        (hook, rx)
    }

    /// Whether the replica holds any artifact (the observer does nothing otherwise).
    pub fn active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// The worker this hook serves.
    pub fn worker(&self) -> &str {
        &self.worker
    }

    /// The point of use: delivers what is bound to `path` (workspace-relative) or its
    /// directories and has not reached this worker yet, by the policy. Returns how many.
    pub fn on_access(&self, path: &str) -> usize {
        if !self.active.load(Ordering::Acquire) {
            return 0;
        }
        let notes: Vec<Note> = {
            let mut guard = self.state.lock();
            let State {
                index,
                delivered,
                inbox,
                ..
            } = &mut *guard;
            let picked = self.policy.select(index.bound_to(path), delivered);
            if picked.is_empty() {
                return 0;
            }
            picked
                .into_iter()
                .map(|a| {
                    delivered.insert(a.id, a.revision);
                    let delivery = self.policy.delivery(a);
                    inbox.extend_from_slice(delivery.to_line().as_bytes());
                    Note {
                        delivery,
                        revision: a.revision,
                        path: Some(path.to_owned()),
                    }
                })
                .collect()
        };
        let n = notes.len();
        for note in notes {
            // The receiver gone (mount ending) loses only the record-back, not the delivery.
            let _ = self.notes.send(note);
        }
        n
    }

    /// Applies one event of the export's stream. Returns the workspace-relative path whose
    /// kernel entry should be invalidated (an artifact newly bound or changed there).
    pub fn apply(&self, event: IndexEvent) -> Option<String> {
        let mut forwarded = None;
        let out = {
            let mut st = self.state.lock();
            match event {
                IndexEvent::Artifact { artifact } => {
                    let bound = artifact.bound.clone();
                    let deliverable = self.policy.deliverable(&artifact, &st.delivered);
                    let changed = st.index.upsert(artifact);
                    self.active.store(!st.index.is_empty(), Ordering::Release);
                    (changed && deliverable).then_some(bound)
                }
                IndexEvent::Delivered { id, revision } => {
                    let r = st.delivered.entry(id).or_insert(revision);
                    *r = (*r).max(revision);
                    None
                }
                IndexEvent::Forward { id } => {
                    let State {
                        index,
                        delivered,
                        inbox,
                        ..
                    } = &mut *st;
                    if let Some(a) = index
                        .get(id)
                        .filter(|a| self.policy.deliverable(a, delivered))
                    {
                        delivered.insert(a.id, a.revision);
                        let delivery = self.policy.delivery(a);
                        inbox.extend_from_slice(delivery.to_line().as_bytes());
                        forwarded = Some(Note {
                            delivery,
                            revision: a.revision,
                            path: None,
                        });
                    }
                    None
                }
                IndexEvent::Contract {
                    module,
                    revision,
                    body,
                } => {
                    let line = serde_json::json!({ "module": module, "revision": revision, "contract": body });
                    st.contracts
                        .insert(module, format!("{line}\n").into_bytes());
                    None
                }
                IndexEvent::Violation { module, detail } => {
                    let line = format!(
                        "{}\n",
                        serde_json::json!({ "module": module, "violation": detail })
                    );
                    // A reconnect's catch-up sends the same report again: said once (each
                    // report carries its time, so a new one is never taken for a replay).
                    if st.announced.insert(line.clone()) {
                        st.inbox.extend_from_slice(line.as_bytes());
                        st.lines.push(line.clone());
                    }
                    st.violations.insert(module, line.into_bytes());
                    None
                }
                IndexEvent::ViolationCleared { module, at_ms } => {
                    let replay = !st.announced.insert(format!("cleared {at_ms} {module}"));
                    if st.violations.remove(&module).is_some() && !replay {
                        let line = format!(
                            "{}\n",
                            serde_json::json!({ "module": module, "violation": null })
                        );
                        st.inbox.extend_from_slice(line.as_bytes());
                        st.lines.push(line);
                    }
                    None
                }
                IndexEvent::Released { paths } => {
                    st.released.extend(paths);
                    None
                }
            }
        };
        if let Some(note) = forwarded {
            let _ = self.notes.send(note);
        }
        out
    }

    /// This worker's deliveries so far, NDJSON (`.aecp/inbox`).
    pub fn inbox(&self) -> Vec<u8> {
        self.state.lock().inbox.clone()
    }

    /// The deliverable artifacts bound to `path` or its directories, newest first, at most
    /// `limit`, NDJSON; reading them is not a delivery (`.aecp/findings/<path>`, and with
    /// [`Policy::per_lookup`] the `user.aecp.findings` attribute).
    pub fn findings(&self, path: &str, limit: usize) -> Vec<u8> {
        let st = self.state.lock();
        let mut all: Vec<&Artifact> = st
            .index
            .bound_to(path)
            .filter(|a| self.policy.deliverable(a, &Delivered::new()))
            .collect();
        all.sort_by_key(|a| std::cmp::Reverse((a.created_ms, a.id)));
        all.into_iter()
            .take(limit)
            .flat_map(|a| self.policy.delivery(a).to_line().into_bytes())
            .collect()
    }

    /// The attribute value of `user.aecp.findings` for `path`, `None` when nothing is bound
    /// there (the attribute then does not exist: `ENODATA`).
    pub fn xattr(&self, path: &str) -> Option<Vec<u8>> {
        if !self.active.load(Ordering::Acquire) {
            return None;
        }
        let v = self.findings(path, self.policy.per_lookup);
        (!v.is_empty()).then_some(v)
    }

    /// `.aecp/contracts/<module>`: the newest contract the stream carried for `module`.
    pub fn contract(&self, module: &str) -> Option<Vec<u8>> {
        self.state.lock().contracts.get(module).cloned()
    }

    /// `.aecp/contracts/`: the modules with a contract.
    pub fn contract_modules(&self) -> Vec<String> {
        self.state.lock().contracts.keys().cloned().collect()
    }

    /// `.aecp/violations`: the current report of each path, NDJSON, by path.
    pub fn violations(&self) -> Vec<u8> {
        self.state
            .lock()
            .violations
            .values()
            .flatten()
            .copied()
            .collect()
    }

    /// The socket lines that are not deliveries (violation reports and their clearing),
    /// since the last call.
    pub fn take_lines(&self) -> Vec<String> {
        std::mem::take(&mut self.state.lock().lines)
    }

    /// The paths the export released since the last call.
    pub fn take_released(&self) -> Vec<String> {
        std::mem::take(&mut self.state.lock().released)
    }

    /// Paths with artifacts bound (for listing `.aecp/findings/`).
    pub fn bound_paths(&self) -> Vec<String> {
        let st = self.state.lock();
        let mut v: Vec<String> = st
            .index
            .all()
            .filter(|a| self.policy.deliverable(a, &Delivered::new()))
            .map(|a| a.bound.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knowledge::{Scope, WitnessStatus};

    fn art(id: u64, bound: &str, created_ms: u64) -> Artifact {
        Artifact {
            id,
            claim: format!("claim {id}"),
            scope: Scope::File(bound.into()),
            bound: bound.into(),
            witness: None,
            status: WitnessStatus::Checked,
            producer: "A".into(),
            created_ms,
            revision: 1,
        }
    }

    fn lines(b: &[u8]) -> Vec<Delivery> {
        b.split(|c| *c == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect()
    }

    #[test]
    fn first_access_delivers_once_and_notes_it() {
        let (hook, notes) = WorkerHook::new("B", Policy::default());
        assert_eq!(hook.on_access("pkg/a.py"), 0, "empty index");
        let inval = hook.apply(IndexEvent::Artifact {
            artifact: art(1, "pkg/a.py", 5),
        });
        assert_eq!(inval.as_deref(), Some("pkg/a.py"));
        assert_eq!(hook.on_access("pkg/b.py"), 0, "not bound there");
        assert_eq!(hook.on_access("pkg/a.py"), 1);
        assert_eq!(hook.on_access("pkg/a.py"), 0, "once per worker");
        let got = lines(&hook.inbox());
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].id, 1);
        let note = notes.try_recv().unwrap();
        assert_eq!(
            (note.delivery.id, note.revision, note.path.as_deref()),
            (1, 1, Some("pkg/a.py"))
        );
        assert!(notes.try_recv().is_err());
    }

    #[test]
    fn at_most_five_per_access_newest_first_then_the_rest() {
        let (hook, _notes) = WorkerHook::new("B", Policy::default());
        for i in 1..=7 {
            hook.apply(IndexEvent::Artifact {
                artifact: art(i, if i % 2 == 0 { "pkg" } else { "pkg/a.py" }, i * 10),
            });
        }
        assert_eq!(hook.on_access("pkg/a.py"), 5);
        let first: Vec<u64> = lines(&hook.inbox()).iter().map(|d| d.id).collect();
        assert_eq!(first, [7, 6, 5, 4, 3]);
        assert_eq!(hook.on_access("pkg/a.py"), 2);
        assert_eq!(hook.on_access("pkg/a.py"), 0);
    }

    #[test]
    fn refuted_is_never_delivered_and_a_change_is_delivered_again() {
        let (hook, _n) = WorkerHook::new("B", Policy::default());
        hook.apply(IndexEvent::Artifact {
            artifact: art(1, "a.py", 1),
        });
        assert_eq!(hook.on_access("a.py"), 1);
        let changed = Artifact {
            revision: 2,
            claim: "changed".into(),
            ..art(1, "a.py", 1)
        };
        assert!(
            hook.apply(IndexEvent::Artifact { artifact: changed })
                .is_some()
        );
        assert_eq!(hook.on_access("a.py"), 1, "changed: delivered again");
        let refuted = Artifact {
            revision: 3,
            status: WitnessStatus::Refuted,
            ..art(1, "a.py", 1)
        };
        assert_eq!(
            hook.apply(IndexEvent::Artifact { artifact: refuted }),
            None,
            "no invalidation"
        );
        assert_eq!(hook.on_access("a.py"), 0);
        assert_eq!(hook.xattr("a.py"), None);
        assert!(hook.findings("a.py", 50).is_empty());
    }

    #[test]
    fn catch_up_of_deliveries_and_forwards() {
        let (hook, notes) = WorkerHook::new("B", Policy::default());
        hook.apply(IndexEvent::Artifact {
            artifact: art(1, "a.py", 1),
        });
        hook.apply(IndexEvent::Artifact {
            artifact: art(2, "b.py", 2),
        });
        hook.apply(IndexEvent::Delivered { id: 1, revision: 1 });
        assert_eq!(hook.on_access("a.py"), 0, "delivered before a restart");
        hook.apply(IndexEvent::Forward { id: 2 });
        let n = notes.try_recv().unwrap();
        assert_eq!((n.delivery.id, n.path), (2, None));
        assert_eq!(hook.on_access("b.py"), 0, "forwarded counts as delivered");
    }

    #[test]
    fn views_for_the_aecp_tree_and_xattr() {
        let (hook, _n) = WorkerHook::new("B", Policy::default());
        for i in 1..=8 {
            hook.apply(IndexEvent::Artifact {
                artifact: art(i, "pkg/a.py", i),
            });
        }
        assert_eq!(lines(&hook.xattr("pkg/a.py").unwrap()).len(), 5);
        assert_eq!(
            lines(&hook.findings("pkg/a.py", FINDINGS_LIST_MAX)).len(),
            8
        );
        assert!(hook.inbox().is_empty(), "looking is not a delivery");
        assert_eq!(hook.bound_paths(), ["pkg/a.py"]);
        hook.apply(IndexEvent::Contract {
            module: "pkg/acct.py".into(),
            revision: 2,
            body: serde_json::json!({"x": 1}),
        });
        assert!(
            String::from_utf8(hook.contract("pkg/acct.py").unwrap())
                .unwrap()
                .contains("\"revision\":2")
        );
        assert_eq!(hook.contract_modules(), ["pkg/acct.py"]);
        hook.apply(IndexEvent::Violation {
            module: "pkg/acct.py".into(),
            detail: serde_json::json!({"symbol": "f"}),
        });
        assert_eq!(
            hook.violations()
                .split(|c| *c == b'\n')
                .filter(|l| !l.is_empty())
                .count(),
            1
        );
    }

    #[test]
    fn a_violation_replaces_the_last_for_its_path_and_clears() {
        let (hook, _n) = WorkerHook::new("B", Policy::default());
        let count = |b: Vec<u8>| b.split(|c| *c == b'\n').filter(|l| !l.is_empty()).count();
        for sym in ["f", "g"] {
            hook.apply(IndexEvent::Violation {
                module: "pkg/acct.py".into(),
                detail: serde_json::json!({"symbol": sym}),
            });
        }
        hook.apply(IndexEvent::Violation {
            module: "pkg/b.py".into(),
            detail: serde_json::json!({"symbol": "h"}),
        });
        let v = String::from_utf8(hook.violations()).unwrap();
        assert_eq!(count(v.clone().into_bytes()), 2, "{v}");
        assert!(v.contains("\"g\"") && !v.contains("\"f\""), "{v}");
        assert_eq!(hook.take_lines().len(), 3, "each report reaches the socket");
        assert_eq!(count(hook.inbox()), 3, "and the inbox");
        hook.apply(IndexEvent::ViolationCleared {
            module: "pkg/acct.py".into(),
            at_ms: 7,
        });
        let v = String::from_utf8(hook.violations()).unwrap();
        assert!(!v.contains("pkg/acct.py") && v.contains("pkg/b.py"), "{v}");
        let cleared = hook.take_lines();
        assert_eq!(cleared.len(), 1);
        assert!(cleared[0].contains("\"violation\":null"), "{cleared:?}");
        hook.apply(IndexEvent::ViolationCleared {
            module: "pkg/acct.py".into(),
            at_ms: 7,
        });
        assert!(hook.take_lines().is_empty(), "clearing twice says nothing");
        // A reconnect's catch-up replays every event: nothing is announced twice, and
        // the views end as they were; a new report (a new time) is announced.
        let events = [
            IndexEvent::Violation {
                module: "pkg/b.py".into(),
                detail: serde_json::json!({"symbol": "h"}),
            },
            IndexEvent::ViolationCleared {
                module: "pkg/acct.py".into(),
                at_ms: 7,
            },
        ];
        let before = (hook.violations(), hook.inbox());
        for e in events {
            hook.apply(e);
        }
        assert!(hook.take_lines().is_empty(), "a replay was announced");
        assert_eq!((hook.violations(), hook.inbox()), before);
        hook.apply(IndexEvent::Violation {
            module: "pkg/b.py".into(),
            detail: serde_json::json!({"symbol": "h", "atMs": 9}),
        });
        assert_eq!(hook.take_lines().len(), 1);
        hook.apply(IndexEvent::Released {
            paths: vec!["pkg/c.py".into()],
        });
        assert_eq!(hook.take_released(), ["pkg/c.py"]);
        assert!(hook.take_released().is_empty());
    }
}
