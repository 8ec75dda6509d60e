//! The narrow interface a mount calls: [`WorkerHook`], one per worker (mount).
//!
//! * [`WorkerHook::on_access`] — called on lookup of a path; [`WorkerHook::on_use`] on open
//!   and read (which also register the worker as a consumer of a contracted module it
//!   reads or imports: a [`Note::Uses`], once per module). Neither ever
//!   waits on the network: when this worker has received every artifact of the index (or
//!   there is none) and watches for no contracted module, it is one atomic load; otherwise
//!   one short lock and a hash lookup per directory level of the path. What it delivers is
//!   appended to the inbox and sent, as a [`Note`], down an unbounded channel (a send never
//!   blocks) that the mount drains on its own thread: it records deliveries back to the
//!   daemon and streams them to the worker's socket.
//! * **Memory.** The replica keeps a few fixed-size words per artifact in memory, and the
//!   delivery lines and the inbox in two unnamed append-only files (`crate::replica`): a
//!   delivery reads its line back with one `pread` (from the page cache), and a delivered
//!   finding costs the mount about 100 bytes of heap at 10,000 (`tests/memory.rs` holds it
//!   to 300).
//! * [`WorkerHook::apply`] — an [`IndexEvent`] from the export's event stream; returns the
//!   path whose kernel entry the mount must invalidate so the next access reaches it.
//! * The read-only views behind `.aecp/…` and the `user.aecp.findings` attribute:
//!   [`WorkerHook::inbox`], [`WorkerHook::findings`], [`WorkerHook::contract`],
//!   [`WorkerHook::violations`]. Every line is a [`crate::knowledge::Delivery`] (or a
//!   [`RevisionNotice`], a contract view or a violation record), one JSON object per line:
//!   quoted data, never prose.
//! * **Revisions.** An [`IndexEvent::Consumer`] that says this worker is stale at a revision
//!   it has not been told of appends a [`RevisionNotice`] (with the diff) to the inbox and
//!   sends it as a [`Note::Revision`] for the socket; `.aecp/contracts/<module>` shows the
//!   contract, its revision, this worker's acknowledged revision and stale flag, and the diff.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::index::IndexEvent;
use crate::knowledge::{ArtifactId, Delivery, LineKind};
use crate::policy::Policy;
use crate::replica::{Replica, Slot, Spill};
use crate::revision::{ContractView, RevisionNotice, Standing, module_of_cached};

/// Most findings listed by `.aecp/findings/<path>` (the xattr lists [`Policy::per_lookup`]).
pub const FINDINGS_LIST_MAX: usize = 50;

/// What the mount's background thread reports and streams.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "note", rename_all = "camelCase")]
pub enum Note {
    /// A knowledge artifact delivered (stream it, report it).
    Delivery(DeliveryNote),
    /// A contract revision delivered to this stale consumer (stream it).
    Revision(RevisionNotice),
    /// This worker read or imported a contracted module (report it: the daemon registers
    /// it as a consumer, once).
    Uses {
        /// The module path.
        module: String,
        /// The contract revision the replica held.
        revision: u32,
    },
}

/// One delivery made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryNote {
    /// What the worker received (the fixed template).
    pub delivery: Delivery,
    /// The artifact's revision it received.
    pub revision: u32,
    /// The access that triggered it (`None`: forwarded on publication).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

struct State {
    /// The artifacts, and which revision of each this worker received.
    replica: Replica,
    /// `.aecp/inbox`.
    inbox: Spill,
    contracts: BTreeMap<String, ContractView>,
    /// Contracted modules this worker is not known to consume: the observer watches for them.
    unused: HashSet<String>,
    /// The newest revision a notice was delivered for, per module.
    notified: HashMap<String, u32>,
    /// The current report per path, one NDJSON line each.
    violations: BTreeMap<String, Vec<u8>>,
    /// Lines for the worker's socket that are not deliveries (violation reports).
    lines: Vec<String>,
    /// Paths the export released, for the mount's syncer.
    released: Vec<String>,
    /// Violation events already announced in the inbox and on the socket (a reconnect's
    /// catch-up sends them all again).
    announced: std::collections::HashSet<String>,
    /// How many artifacts of the index this worker could still receive (deliverable by
    /// the policy): once it has received all of them, an access costs one atomic load.
    pending: usize,
}

impl State {
    /// Whether the observer has anything to do: an artifact left to deliver, or a
    /// contracted module to watch for.
    fn active(&self) -> bool {
        self.pending > 0 || !self.unused.is_empty()
    }

    fn new(dir: Option<PathBuf>) -> State {
        State {
            replica: Replica::new(dir.clone()),
            inbox: Spill::new(dir, "inbox"),
            contracts: BTreeMap::new(),
            unused: HashSet::new(),
            notified: HashMap::new(),
            violations: BTreeMap::new(),
            lines: Vec::new(),
            released: Vec::new(),
            announced: HashSet::new(),
            pending: 0,
        }
    }

    fn is_pending(&self, policy: &Policy, id: ArtifactId) -> bool {
        self.replica
            .find(id)
            .is_some_and(|i| deliverable(policy, self.replica.slot(i)))
    }

    /// Delivers slot `i` (its line read back): marks it received and appends it to the
    /// inbox. `None` when its line cannot be read (logged): it then stays pending.
    fn deliver(&mut self, policy: &Policy, i: u32, path: Option<&str>) -> Option<Note> {
        let mut line = Vec::new();
        if !self.replica.line_into(i, &mut line) {
            return None;
        }
        let delivery: Delivery = serde_json::from_slice(&line).ok()?;
        let Slot { id, revision, .. } = *self.replica.slot(i);
        self.change(policy, id, |st| st.replica.record(id, revision));
        self.inbox.append(&line);
        Some(Note::Delivery(DeliveryNote {
            delivery,
            revision,
            path: path.map(str::to_owned),
        }))
    }

    /// What one access of `path` delivers, as [`Policy::select`] picks it: the deliverable
    /// slots bound to the path or its directories, newest first (ties: higher id first),
    /// at most [`Policy::per_lookup`].
    fn select(&self, policy: &Policy, path: &str) -> Vec<u32> {
        let r = &self.replica;
        let mut out: Vec<u32> = r
            .bound_to(path)
            .filter(|i| deliverable(policy, r.slot(*i)))
            .collect();
        out.sort_by_key(|i| std::cmp::Reverse((r.slot(*i).created_ms, r.slot(*i).id)));
        out.truncate(policy.per_lookup);
        out
    }

    /// Runs `change` (of the index or of what was delivered) on artifact `id`, keeping
    /// [`State::pending`] right.
    fn change<T>(
        &mut self,
        policy: &Policy,
        id: ArtifactId,
        change: impl FnOnce(&mut Self) -> T,
    ) -> T {
        let before = self.is_pending(policy, id);
        let out = change(self);
        match (before, self.is_pending(policy, id)) {
            (false, true) => self.pending += 1,
            (true, false) => self.pending -= 1,
            _ => {}
        }
        out
    }
}

/// Whether slot `s` may reach this worker now ([`Policy::deliverable`]).
fn deliverable(policy: &Policy, s: &Slot) -> bool {
    policy.admits(s.status, s.revision, s.got())
}

/// One worker's replica of its workspace's artifact index and what it has received.
pub struct WorkerHook {
    worker: String,
    policy: Policy,
    /// Whether the observer has anything to do ([`State::active`]): the hot path's only
    /// cost when it does not.
    active: AtomicBool,
    /// Whether the index holds any artifact (`user.aecp.findings` exists only then).
    populated: AtomicBool,
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
    /// A hook for `worker` and the receiving end of its delivery notes; its files (the
    /// delivery lines and the inbox) go to the system's temporary directory.
    pub fn new(worker: &str, policy: Policy) -> (WorkerHook, mpsc::Receiver<Note>) {
        Self::with_dir(worker, policy, None)
    }

    /// [`WorkerHook::new`], with its files in `dir` (the mount's state directory). They
    /// have no name and disappear with the process; none is made before there is
    /// something to write.
    pub fn with_dir(
        worker: &str,
        policy: Policy,
        dir: Option<PathBuf>,
    ) -> (WorkerHook, mpsc::Receiver<Note>) {
        let (tx, rx) = mpsc::channel();
        let hook = WorkerHook {
            worker: worker.to_owned(),
            policy,
            active: AtomicBool::new(false),
            populated: AtomicBool::new(false),
            state: Mutex::new(State::new(dir)),
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

    /// The point of use on a lookup: delivers what is bound to `path` (workspace-relative)
    /// or its directories and has not reached this worker yet, by the policy. Returns how
    /// many.
    pub fn on_access(&self, path: &str) -> usize {
        self.observe(path, false)
    }

    /// The point of use on an open or read: [`WorkerHook::on_access`], and when `path` is a
    /// contracted module this worker is not known to consume (or its compiled copy in
    /// `__pycache__`), a [`Note::Uses`] — once per module. A lookup alone (`ls -l`,
    /// `git status`) is not a use.
    pub fn on_use(&self, path: &str) -> usize {
        self.observe(path, true)
    }

    /// Whether an access to `path` now would deliver something (an artifact bound to it or
    /// to one of its directories that this worker has not received). One atomic load when
    /// nothing is left to deliver anywhere.
    pub fn has_pending(&self, path: &str) -> bool {
        if !self.active.load(Ordering::Acquire) {
            return false;
        }
        let st = self.state.lock();
        st.pending > 0
            && st
                .replica
                .bound_to(path)
                .any(|i| deliverable(&self.policy, st.replica.slot(i)))
    }

    fn observe(&self, path: &str, used: bool) -> usize {
        if !self.active.load(Ordering::Acquire) {
            return 0;
        }
        let mut notes: Vec<Note> = Vec::new();
        {
            let mut guard = self.state.lock();
            let st = &mut *guard;
            if used && !st.unused.is_empty() {
                let module = if st.unused.contains(path) {
                    Some(path.to_owned())
                } else if path.ends_with(".pyc") {
                    module_of_cached(path).filter(|m| st.unused.contains(m))
                } else {
                    None
                };
                if let Some(module) = module {
                    st.unused.remove(&module);
                    let revision = st.contracts.get(&module).map_or(0, |c| c.revision);
                    notes.push(Note::Uses { module, revision });
                    self.active.store(st.active(), Ordering::Release);
                }
            }
            for i in st.select(&self.policy, path) {
                notes.extend(st.deliver(&self.policy, i, Some(path)));
            }
            self.active.store(st.active(), Ordering::Release);
        }
        let n = notes
            .iter()
            .filter(|n| matches!(n, Note::Delivery(_)))
            .count();
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
                    let deliverable = self.policy.admits(
                        artifact.status,
                        artifact.revision,
                        st.replica.got(artifact.id),
                    );
                    let line = self.policy.delivery(&artifact).to_line();
                    let changed = st.change(&self.policy, artifact.id, |st| {
                        st.replica.upsert(
                            artifact.id,
                            artifact.revision,
                            artifact.status,
                            artifact.created_ms,
                            &artifact.bound,
                            line.as_bytes(),
                        )
                    });
                    self.active.store(st.active(), Ordering::Release);
                    self.populated
                        .store(!st.replica.is_empty(), Ordering::Release);
                    (changed && deliverable).then_some(artifact.bound)
                }
                IndexEvent::Delivered { id, revision } => {
                    st.change(&self.policy, id, |st| st.replica.record(id, revision));
                    self.active.store(st.active(), Ordering::Release);
                    None
                }
                IndexEvent::Forward { id } => {
                    let chosen = st
                        .replica
                        .find(id)
                        .filter(|i| deliverable(&self.policy, st.replica.slot(*i)));
                    if let Some(i) = chosen {
                        forwarded = st.deliver(&self.policy, i, None);
                        self.active.store(st.active(), Ordering::Release);
                    }
                    None
                }
                IndexEvent::Contract {
                    module,
                    revision,
                    body,
                    by,
                } => {
                    let view = st.contracts.entry(module.clone()).or_default();
                    if revision >= view.revision {
                        view.module.clone_from(&module);
                        view.revision = revision;
                        view.contract = body;
                        view.by = by;
                        if view.consumer.is_none() {
                            st.unused.insert(module);
                        }
                        self.active.store(st.active(), Ordering::Release);
                    }
                    None
                }
                IndexEvent::Consumer {
                    module,
                    revision,
                    acked_revision,
                    stale,
                    by,
                    diff,
                } => {
                    st.unused.remove(&module);
                    self.active.store(st.active(), Ordering::Release);
                    let State {
                        contracts,
                        notified,
                        inbox,
                        ..
                    } = &mut *st;
                    let view = contracts.entry(module.clone()).or_default();
                    if revision < view.revision {
                        // Older than the contract this replica holds: a newer standing follows.
                        return None;
                    }
                    view.module.clone_from(&module);
                    view.revision = revision;
                    view.consumer = Some(Standing {
                        acked_revision,
                        stale,
                    });
                    view.diff = if stale { diff.clone() } else { None };
                    if !by.is_empty() {
                        view.by.clone_from(&by);
                    }
                    let told = notified.get(&module).copied().unwrap_or(0);
                    if stale && revision > told {
                        notified.insert(module.clone(), revision);
                        let notice = RevisionNotice::new(
                            &module,
                            revision,
                            acked_revision,
                            &by,
                            diff.as_deref().unwrap_or(""),
                        );
                        inbox.append(notice.to_line().as_bytes());
                        forwarded = Some(Note::Revision(notice));
                    }
                    None
                }
                IndexEvent::Violation { module, detail } => {
                    let line = format!(
                        "{}\n",
                        serde_json::json!({ "kind": LineKind::Violation, "module": module, "violation": detail })
                    );
                    // A reconnect's catch-up sends the same report again: said once (each
                    // report carries its time, so a new one is never taken for a replay).
                    if st.announced.insert(line.clone()) {
                        st.inbox.append(line.as_bytes());
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
                            serde_json::json!({ "kind": LineKind::ViolationCleared, "module": module, "violation": null })
                        );
                        st.inbox.append(line.as_bytes());
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
        self.state.lock().inbox.read_all()
    }

    /// The deliverable artifacts bound to `path` or its directories, newest first, at most
    /// `limit`, NDJSON; reading them is not a delivery (`.aecp/findings/<path>`, and with
    /// [`Policy::per_lookup`] the `user.aecp.findings` attribute).
    pub fn findings(&self, path: &str, limit: usize) -> Vec<u8> {
        let st = self.state.lock();
        let r = &st.replica;
        let mut all: Vec<u32> = r
            .bound_to(path)
            .filter(|i| {
                self.policy
                    .admits(r.slot(*i).status, r.slot(*i).revision, None)
            })
            .collect();
        all.sort_by_key(|i| std::cmp::Reverse((r.slot(*i).created_ms, r.slot(*i).id)));
        let mut out = Vec::new();
        for i in all.into_iter().take(limit) {
            r.line_into(i, &mut out);
        }
        out
    }

    /// The attribute value of `user.aecp.findings` for `path`, `None` when nothing is bound
    /// there (the attribute then does not exist: `ENODATA`).
    pub fn xattr(&self, path: &str) -> Option<Vec<u8>> {
        if !self.populated.load(Ordering::Acquire) {
            return None;
        }
        let v = self.findings(path, self.policy.per_lookup);
        (!v.is_empty()).then_some(v)
    }

    /// `.aecp/contracts/<module>`: the newest contract the stream carried for `module`, its
    /// revision, this worker's standing as a consumer and, while stale, the diff.
    pub fn contract(&self, module: &str) -> Option<Vec<u8>> {
        self.state
            .lock()
            .contracts
            .get(module)
            .filter(|v| v.revision > 0)
            .map(ContractView::render)
    }

    /// `.aecp/contracts/`: the modules with a contract.
    pub fn contract_modules(&self) -> Vec<String> {
        self.state
            .lock()
            .contracts
            .iter()
            .filter(|(_, v)| v.revision > 0)
            .map(|(m, _)| m.clone())
            .collect()
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
        let mut v = st
            .replica
            .paths_where(|s| self.policy.admits(s.status, s.revision, None));
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::ArtifactIndex;
    use crate::knowledge::{Artifact, Scope, WitnessStatus};
    use crate::policy::Delivered;

    /// The replica as it was before it was made compact: whole artifacts in an
    /// [`ArtifactIndex`], deliveries in a map and the inbox in memory. The compact one must
    /// answer every access exactly as it does.
    #[derive(Default)]
    struct Model {
        index: ArtifactIndex,
        delivered: Delivered,
        inbox: Vec<u8>,
        policy: Policy,
    }

    impl Model {
        fn artifact(&mut self, a: Artifact) -> Option<String> {
            let deliverable = self.policy.deliverable(&a, &self.delivered);
            let bound = a.bound.clone();
            (self.index.upsert(a) && deliverable).then_some(bound)
        }

        fn delivered(&mut self, id: ArtifactId, revision: u32) {
            let r = self.delivered.entry(id).or_insert(revision);
            *r = (*r).max(revision);
        }

        fn give(&mut self, picked: Vec<(ArtifactId, u32, Delivery)>) -> Vec<ArtifactId> {
            picked
                .into_iter()
                .map(|(id, revision, d)| {
                    self.delivered.insert(id, revision);
                    self.inbox.extend_from_slice(d.to_line().as_bytes());
                    id
                })
                .collect()
        }

        fn forward(&mut self, id: ArtifactId) -> Vec<ArtifactId> {
            let picked = self
                .index
                .get(id)
                .filter(|a| self.policy.deliverable(a, &self.delivered))
                .map(|a| (a.id, a.revision, self.policy.delivery(a)));
            self.give(picked.into_iter().collect())
        }

        fn access(&mut self, path: &str) -> Vec<ArtifactId> {
            let picked = self
                .policy
                .select(self.index.bound_to(path), &self.delivered)
                .into_iter()
                .map(|a| (a.id, a.revision, self.policy.delivery(a)))
                .collect();
            self.give(picked)
        }

        fn findings(&self, path: &str, limit: usize) -> Vec<u8> {
            let mut all: Vec<&Artifact> = self
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

        fn has_pending(&self, path: &str) -> bool {
            self.index
                .bound_to(path)
                .any(|a| self.policy.deliverable(a, &self.delivered))
        }

        fn bound_paths(&self) -> Vec<String> {
            let mut v: Vec<String> = self
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

    /// The ids of the deliveries among `notes`.
    fn delivered_ids(notes: &mpsc::Receiver<Note>) -> Vec<ArtifactId> {
        notes
            .try_iter()
            .filter_map(|n| match n {
                Note::Delivery(d) => Some(d.delivery.id),
                _ => None,
            })
            .collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Whatever the events and accesses, the compact replica delivers exactly what the
        /// whole-record one did, in the same order, and shows the same inbox, findings,
        /// pending paths and bound paths; with its files written out (a small spill buffer
        /// is not needed: 300 artifacts with long claims pass the 16 KiB buffer).
        #[test]
        fn the_compact_replica_answers_as_the_whole_one(
            ops in proptest::collection::vec(
                (0u8..6, 0u64..40, 1u32..4, 0u8..3, 0usize..7, 0u64..5, proptest::bool::ANY),
                1..300,
            ),
        ) {
            let paths = ["", "a", "a/b", "a/b/c.py", "a/bc", "x.py", "a/b/zz"];
            let dir = tempfile::tempdir().unwrap();
            let (hook, notes) = WorkerHook::with_dir("B", Policy::default(), Some(dir.path().into()));
            let mut model = Model::default();
            for (op, id, revision, status, p, created, variant) in ops {
                let path = paths[p];
                match op {
                    0 | 1 => {
                        let status = [WitnessStatus::Unchecked, WitnessStatus::Checked, WitnessStatus::Refuted][status as usize];
                        let claim = format!(
                            "claim {id} r{revision}{} {}",
                            if variant { " (changed)" } else { "" },
                            "long ".repeat((id % 5) as usize * 30),
                        );
                        let a = Artifact {
                            id,
                            claim,
                            scope: Scope::File(path.into()),
                            bound: path.into(),
                            witness: None,
                            status,
                            producer: format!("w{}", id % 3),
                            created_ms: created,
                            revision,
                        };
                        proptest::prop_assert_eq!(
                            hook.apply(IndexEvent::Artifact { artifact: a.clone() }),
                            model.artifact(a)
                        );
                    }
                    2 => {
                        hook.apply(IndexEvent::Delivered { id, revision });
                        model.delivered(id, revision);
                    }
                    3 => {
                        hook.apply(IndexEvent::Forward { id });
                        proptest::prop_assert_eq!(delivered_ids(&notes), model.forward(id));
                    }
                    _ => {
                        proptest::prop_assert_eq!(hook.has_pending(path), model.has_pending(path));
                        let n = hook.on_access(path);
                        let got = delivered_ids(&notes);
                        proptest::prop_assert_eq!(n, got.len());
                        proptest::prop_assert_eq!(got, model.access(path));
                    }
                }
                proptest::prop_assert_eq!(hook.findings(path, FINDINGS_LIST_MAX), model.findings(path, FINDINGS_LIST_MAX));
            }
            proptest::prop_assert_eq!(hook.inbox(), model.inbox.clone());
            proptest::prop_assert_eq!(hook.bound_paths(), model.bound_paths());
            for path in paths {
                proptest::prop_assert_eq!(hook.findings(path, 5), model.findings(path, 5));
                proptest::prop_assert_eq!(hook.has_pending(path), model.has_pending(path));
            }
        }
    }

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
        let Note::Delivery(note) = notes.try_recv().unwrap() else {
            panic!("a delivery note")
        };
        assert_eq!(
            (note.delivery.id, note.revision, note.path.as_deref()),
            (1, 1, Some("pkg/a.py"))
        );
        assert!(notes.try_recv().is_err());
    }

    #[test]
    fn the_observer_goes_quiet_once_everything_is_delivered_and_wakes_for_a_change() {
        let (hook, _notes) = WorkerHook::new("B", Policy::default());
        hook.apply(IndexEvent::Artifact {
            artifact: art(1, "pkg/a.py", 5),
        });
        hook.apply(IndexEvent::Artifact {
            artifact: art(2, "pkg/b.py", 6),
        });
        let refuted = Artifact {
            status: WitnessStatus::Refuted,
            ..art(3, "pkg/c.py", 7)
        };
        hook.apply(IndexEvent::Artifact { artifact: refuted });
        assert!(hook.active());
        assert_eq!(hook.on_access("pkg/a.py"), 1);
        assert!(hook.active(), "pkg/b.py's artifact is still to come");
        // The export's record of a delivery made before (a reconnect's catch-up).
        hook.apply(IndexEvent::Delivered { id: 2, revision: 1 });
        assert!(
            !hook.active(),
            "everything received (a refuted one never is): one atomic load per access"
        );
        assert_eq!(hook.on_access("pkg/b.py"), 0);
        assert!(
            hook.xattr("pkg/a.py").is_some(),
            "the findings attribute still reads the index"
        );
        // A new revision is delivered again.
        hook.apply(IndexEvent::Artifact {
            artifact: Artifact {
                revision: 2,
                ..art(1, "pkg/a.py", 5)
            },
        });
        assert!(hook.active());
        hook.apply(IndexEvent::Forward { id: 1 });
        assert!(!hook.active(), "forwarded: received");
        assert_eq!(hook.on_access("pkg/a.py"), 0);
        // An older revision of what was received changes nothing.
        hook.apply(IndexEvent::Artifact {
            artifact: art(2, "pkg/b.py", 6),
        });
        assert!(!hook.active());
    }

    proptest::proptest! {
        /// The observer's "anything to do" flag, kept incrementally, always equals what a
        /// count over the whole index says.
        #[test]
        fn the_pending_count_matches_a_recount(
            ops in proptest::collection::vec((0u8..4, 0u64..6, 1u32..4, proptest::bool::ANY), 0..60),
        ) {
            let (hook, _notes) = WorkerHook::new("B", Policy::default());
            let paths = ["a", "a/b.py", "c.py"];
            for (op, id, rev, refuted) in ops {
                let path = paths[(id % 3) as usize];
                match op {
                    0 => {
                        let status = if refuted { WitnessStatus::Refuted } else { WitnessStatus::Checked };
                        hook.apply(IndexEvent::Artifact {
                            artifact: Artifact { revision: rev, status, ..art(id, path, id) },
                        });
                    }
                    1 => { hook.apply(IndexEvent::Delivered { id, revision: rev }); }
                    2 => { hook.apply(IndexEvent::Forward { id }); }
                    _ => { hook.on_access(path); }
                }
                let st = hook.state.lock();
                let recount = st
                    .replica
                    .slots()
                    .filter(|s| deliverable(&hook.policy, s))
                    .count();
                proptest::prop_assert_eq!(st.pending, recount);
                proptest::prop_assert_eq!(hook.active(), recount > 0);
            }
        }
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
        let Note::Delivery(n) = notes.try_recv().unwrap() else {
            panic!("a delivery note")
        };
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
            by: "A".into(),
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
    fn contract_event(module: &str, revision: u32) -> IndexEvent {
        IndexEvent::Contract {
            module: module.into(),
            revision,
            body: serde_json::json!({"module": module, "symbols": []}),
            by: "A".into(),
        }
    }

    #[test]
    fn reading_a_contracted_module_notes_a_use_once_and_a_lookup_does_not() {
        let (hook, notes) = WorkerHook::new("B", Policy::default());
        assert!(!hook.active());
        hook.apply(contract_event("pkg/acct.py", 1));
        assert!(hook.active(), "the observer watches contracted modules");
        hook.on_access("pkg/acct.py");
        assert!(notes.try_recv().is_err(), "a lookup is not a use");
        hook.on_use("pkg/other.py");
        assert!(notes.try_recv().is_err());
        hook.on_use("pkg/acct.py");
        assert_eq!(
            notes.try_recv().unwrap(),
            Note::Uses {
                module: "pkg/acct.py".into(),
                revision: 1
            }
        );
        hook.on_use("pkg/acct.py");
        assert!(notes.try_recv().is_err(), "once");
        assert!(
            !hook.active(),
            "nothing left to watch: back to one atomic load"
        );

        // Python opening only the compiled copy is an import too.
        hook.apply(contract_event("lib/db.py", 1));
        hook.on_use("lib/__pycache__/db.cpython-312.pyc");
        assert!(
            matches!(notes.try_recv().unwrap(), Note::Uses { module, .. } if module == "lib/db.py")
        );

        // A worker the daemon already knows as a consumer is not watched for.
        hook.apply(contract_event("lib/net.py", 1));
        hook.apply(IndexEvent::Consumer {
            module: "lib/net.py".into(),
            revision: 1,
            acked_revision: 1,
            stale: false,
            by: "A".into(),
            diff: None,
        });
        hook.on_use("lib/net.py");
        assert!(notes.try_recv().is_err());
    }

    #[test]
    fn a_revision_reaches_a_stale_consumer_once_and_ack_clears_it() {
        let (hook, notes) = WorkerHook::new("B", Policy::default());
        hook.apply(contract_event("pkg/acct.py", 1));
        let standing = |revision, acked_revision, stale, diff: Option<&str>| IndexEvent::Consumer {
            module: "pkg/acct.py".into(),
            revision,
            acked_revision,
            stale,
            by: "A".into(),
            diff: diff.map(str::to_owned),
        };
        hook.apply(standing(1, 1, false, None));
        assert!(hook.inbox().is_empty(), "registration is not a revision");
        hook.apply(contract_event("pkg/acct.py", 2));
        hook.apply(standing(
            2,
            1,
            true,
            Some("-def f(): ...\n+def f(x): ...\n"),
        ));
        let Note::Revision(notice) = notes.try_recv().unwrap() else {
            panic!("a revision note")
        };
        assert_eq!(
            (
                notice.module.as_str(),
                notice.revision,
                notice.acked_revision
            ),
            ("pkg/acct.py", 2, 1)
        );
        assert!(notice.diff.contains("+def f(x)"));
        let inbox = String::from_utf8(hook.inbox()).unwrap();
        assert_eq!(inbox, notice.to_line());
        let view: serde_json::Value =
            serde_json::from_slice(&hook.contract("pkg/acct.py").unwrap()).unwrap();
        assert_eq!(view["revision"], 2);
        assert_eq!(view["consumer"]["ackedRevision"], 1);
        assert_eq!(view["consumer"]["stale"], true);
        assert!(view["diff"].as_str().unwrap().contains("+def f(x)"));

        // The same standing again (a catch-up) tells nothing new.
        hook.apply(standing(2, 1, true, Some("d")));
        assert!(notes.try_recv().is_err());
        assert_eq!(hook.inbox().len(), inbox.len());

        hook.apply(standing(2, 2, false, None));
        let view: serde_json::Value =
            serde_json::from_slice(&hook.contract("pkg/acct.py").unwrap()).unwrap();
        assert_eq!(view["consumer"]["stale"], false);
        assert_eq!(view["consumer"]["ackedRevision"], 2);
        assert!(view["diff"].is_null());
        assert!(notes.try_recv().is_err());
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

    /// The kind of every line of `bytes` (NDJSON), in order.
    fn kinds(bytes: &[u8]) -> Vec<String> {
        String::from_utf8_lossy(bytes)
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                let kind = v["kind"].as_str().unwrap_or_else(|| panic!("no kind: {l}"));
                kind.to_string()
            })
            .collect()
    }

    // The inbox mixed deliveries (with `id`), revision notices (with `kind`) and violation
    // reports (with `module` and no `kind`): a harness told them apart by which keys were
    // there.
    #[test]
    fn every_line_of_every_channel_says_its_kind() {
        let (hook, _n) = WorkerHook::new("B", Policy::default());
        hook.apply(IndexEvent::Artifact {
            artifact: art(1, "pkg/a.py", 10),
        });
        hook.on_access("pkg/a.py");
        let standing = |revision, stale, diff: Option<&str>| IndexEvent::Consumer {
            module: "pkg/acct.py".into(),
            revision,
            acked_revision: 1,
            stale,
            by: "A".into(),
            diff: diff.map(str::to_owned),
        };
        hook.apply(contract_event("pkg/acct.py", 1));
        hook.apply(standing(1, false, None));
        hook.apply(contract_event("pkg/acct.py", 2));
        hook.apply(standing(2, true, Some("-a\n+b\n")));
        hook.apply(IndexEvent::Violation {
            module: "pkg/b.py".into(),
            detail: serde_json::json!({"symbol": "h"}),
        });
        hook.apply(IndexEvent::ViolationCleared {
            module: "pkg/b.py".into(),
            at_ms: 3,
        });
        assert_eq!(
            kinds(&hook.inbox()),
            [
                "finding",
                "contract_revision",
                "violation",
                "violation_cleared"
            ]
        );
        assert_eq!(kinds(&hook.findings("pkg/a.py", 5)), ["finding"]);
        assert_eq!(kinds(&hook.xattr("pkg/a.py").unwrap()), ["finding"]);
        assert_eq!(kinds(&hook.contract("pkg/acct.py").unwrap()), ["contract"]);
        hook.apply(IndexEvent::Violation {
            module: "pkg/c.py".into(),
            detail: serde_json::json!({"symbol": "k"}),
        });
        assert_eq!(kinds(&hook.violations()), ["violation"]);
        let socket: Vec<u8> = hook.take_lines().concat().into_bytes();
        assert_eq!(
            kinds(&socket),
            ["violation", "violation_cleared", "violation"]
        );
    }
}
