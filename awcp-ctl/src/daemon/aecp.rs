//! AECP on the Delegator: the artifact store, publication (scope resolution, witness,
//! forwarding), flags, and the index events pushed to every worker's mount.
//!
//! A worker is one delegation; the workers of a workspace are the delegations of the same
//! source directory (its canonical path is the workspace's key). The store lives in the
//! daemon's database (`aecp-hooks::store`, its own connection to `delegator.db`).
//!
//! **Where a witness runs.** Never here by default: the daemon asks the worker's Executor
//! (`POST <executor>/awcp/tasks/<id>/aecp/witness`), which runs it inside that worker's
//! mount, as the agent's user, with a timeout and in a new network namespace where the
//! machine allows. Only with `awcp-ctl serve --aecp-local-witness netns` does the daemon run
//! witnesses itself, in the workspace directory, in a new network namespace (refused if the
//! machine cannot make one) — the flag names the sandbox it uses.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use aecp_hooks::index::IndexEvent;
use aecp_hooks::knowledge::{Artifact, Delivery, Draft, Scope, Witness, WitnessStatus};
use aecp_hooks::policy::Policy;
use aecp_hooks::store::{AuditEntry, Store as AecpStore};
use aecp_hooks::witness::WitnessRun;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Query, State};
use axum::routing::{get, post};

mod contracts;
mod screen;
mod worker;

pub use contracts::{
    ConsumerRequest, DeclareRequest, DeclareResponse, ShowResponse, StubOutcome, VerifyRequest,
};

use super::Daemon;
use super::api::{ApiFailure, bad_json};
use super::flow::{Refusal, awcp_base, with_token};

/// The daemon's AECP state.
pub(crate) struct Aecp {
    pub(crate) store: std::sync::Arc<AecpStore>,
    pub(crate) policy: Policy,
    /// `Some("netns")`: witnesses may run on this machine (opted in, named sandbox).
    pub(crate) local_witness: Option<String>,
    /// The daemon itself, for the worker channel's handlers (set once it is built).
    pub(crate) me: std::sync::OnceLock<std::sync::Weak<Daemon>>,
}

/// `POST /aecp/publish` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishRequest {
    /// The publishing worker (delegation id).
    pub worker: String,
    /// What it found.
    pub claim: String,
    /// `symbol:pkg.mod.f`, `file:pkg/a.py`, `dir:pkg` or `workspace`.
    pub scope: String,
    /// An optional check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub witness: Option<Witness>,
}

/// `POST /aecp/publish` answer (200; a refuted witness is a 422 with the reason).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishResponse {
    /// The stored artifact.
    pub artifact: Artifact,
    /// The witness run, if there was a witness.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub witness: Option<WitnessRun>,
    /// Workers it was forwarded to (owners of related modules), in order.
    pub forwarded_to: Vec<String>,
}

/// `POST /aecp/flag` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FlagRequest {
    /// The disputing worker.
    pub worker: String,
    /// The artifact.
    pub id: u64,
    /// Why.
    #[serde(default)]
    pub reason: String,
}

/// `POST /aecp/flag` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FlagResponse {
    /// The artifact after the re-run.
    pub artifact: Artifact,
    /// The re-run (none when the artifact has no witness).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub witness: Option<WitnessRun>,
}

/// `GET /aecp/...?worker=` query.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct WorkerQuery {
    pub(crate) worker: String,
    #[serde(default)]
    pub(crate) path: Option<String>,
    /// `GET /aecp/violations`: every worker of the workspace, not only this one.
    #[serde(default)]
    pub(crate) workspace: bool,
}

fn refuse(status: u16, message: impl Into<String>, hint: &str) -> Refusal {
    Refusal {
        status,
        message: message.into(),
        code: None,
        hint: (!hint.is_empty()).then(|| hint.to_owned()),
    }
}

fn store_err(e: aecp_hooks::store::StoreError) -> Refusal {
    let status = match e {
        aecp_hooks::store::StoreError::UnknownArtifact { .. }
        | aecp_hooks::store::StoreError::UnknownContract { .. } => 404,
        _ => 500,
    };
    refuse(status, format!("{e:#}"), "")
}

/// One entry of a mount's report.
#[derive(Deserialize)]
#[serde(untagged)]
enum ReportEntry {
    /// A knowledge artifact delivered.
    Delivery { id: u64, revision: u32 },
    /// The worker read or imported a contracted module, seen at `revision`.
    Uses { uses: String, revision: u32 },
}

/// A mount's report: `[{"id": 1, "revision": 1}, {"uses": "pkg/acct.py", "revision": 1}, …]`
/// — deliveries it made, and contracted modules its worker read or imported (registered as
/// a consumer once, `"auto": true` in the audit log). Malformed entries are skipped (the
/// report is network input); at most 10,000 per report. Returns the modules this report
/// newly made the worker a consumer of.
fn record_report(
    store: &AecpStore,
    workspace: &str,
    worker: &str,
    report: serde_json::Value,
) -> Vec<String> {
    let entries: Vec<serde_json::Value> = match report {
        serde_json::Value::Array(v) => v,
        _ => Vec::new(),
    };
    let mut registered = Vec::new();
    for e in entries.into_iter().take(10_000) {
        match serde_json::from_value::<ReportEntry>(e) {
            Ok(ReportEntry::Delivery { id, revision }) => {
                if let Err(err) = store.record_delivery(worker, id, revision) {
                    tracing::debug!(error = %err, "AECP: a delivery report names an unknown artifact");
                }
            }
            Ok(ReportEntry::Uses { uses, revision }) => {
                match store.add_consumer_auto(workspace, &uses, worker, revision) {
                    Ok(true) => registered.push(uses),
                    Ok(false) => {}
                    Err(err) => {
                        tracing::debug!(error = %err, "AECP: a use report names a module without a contract");
                    }
                }
            }
            Err(_) => tracing::debug!("AECP: skipping a malformed report entry"),
        }
    }
    registered
}

/// `POST /aecp/owners` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwnersRequest {
    /// The worker.
    pub worker: String,
    /// Globs of what it owns (replacing earlier ones; empty: what it writes back).
    pub owns: Vec<String>,
}

/// What the daemon knows of a worker.
struct WorkerInfo {
    workspace: String,
    root: PathBuf,
    executor_url: String,
    executor_token: Option<String>,
    /// The delegation whose mount the worker is.
    delegation: String,
    /// The resource's name when the delegation has several (the Executor mounts it at
    /// `<workDir>/<name>`); `None` for the only one (mounted at the work directory).
    resource: Option<String>,
}

/// The delegation a worker id names: a worker is one mount, i.e. one resource's export of
/// a delegation, and its id is that export's id — the delegation id for the first (or
/// only) resource, `<id>.<n>` for resource n of several, counting from 0 (delegation ids
/// hold no `.`).
pub(crate) fn delegation_of(worker: &str) -> &str {
    match worker.rsplit_once('.') {
        Some((id, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => id,
        _ => worker,
    }
}

/// A directory's key as a workspace (its canonical path).
fn workspace_key(source: &std::path::Path) -> PathBuf {
    source
        .canonicalize()
        .unwrap_or_else(|_| source.to_path_buf())
}

impl Daemon {
    fn aecp_worker(&self, worker: &str) -> Result<WorkerInfo, Refusal> {
        let unknown = || {
            refuse(
                404,
                format!("unknown worker {worker}"),
                "A worker is a delegation id (`<id>.<n>` for its resource n, from 0, when it has \
                 several): see `awcp-ctl list` (inside a task, $AWCP_DELEGATION_ID)",
            )
        };
        let delegation = delegation_of(worker);
        let d = match self.get_live(delegation) {
            Some(l) => l.d.lock().clone(),
            None => self
                .store
                .get(delegation)
                .ok()
                .flatten()
                .map(|r| r.delegation)
                .ok_or_else(unknown)?,
        };
        let resources = d.exported_resources();
        let (source, resource) = match resources.iter().find(|r| r.export_id == worker) {
            Some(r) => (
                r.source.clone(),
                (resources.len() > 1).then(|| r.name.clone()),
            ),
            // A delegation of another transport (no export per resource): its directory.
            None if delegation == worker => (d.source.clone(), None),
            None => return Err(unknown()),
        };
        let root = workspace_key(&source);
        Ok(WorkerInfo {
            workspace: root.display().to_string(),
            root,
            executor_url: d.record.peer_url.clone(),
            // The Executor's token, else the delegation's proof (its START capability):
            // the witness route runs commands in the worker's mount, so it needs one.
            executor_token: d.executor_credential(),
            delegation: delegation.to_owned(),
            resource,
        })
    }

    /// The workers of a workspace now: every export of a running delegation whose
    /// resource is that directory, by worker id (the export's id).
    fn aecp_live_workers(&self, workspace: &str) -> Vec<(String, Arc<awcpfs::export::Export>)> {
        let lives: Vec<Arc<super::Live>> = self.live.lock().values().cloned().collect();
        let mut out = Vec::new();
        for l in lives {
            let resources = {
                let d = l.d.lock();
                if d.record.state.is_terminal() {
                    continue;
                }
                d.exported_resources()
            };
            for e in l.exports.lock().iter() {
                if resources.iter().any(|r| {
                    r.export_id == e.id()
                        && workspace_key(&r.source).display().to_string() == workspace
                }) {
                    out.push((e.id().to_string(), e.clone()));
                }
            }
        }
        out
    }

    /// The export whose mount is `worker`, while the daemon has it.
    fn aecp_export_of(&self, worker: &str) -> Option<Arc<awcpfs::export::Export>> {
        let live = self.get_live(delegation_of(worker))?;
        let exports = live.exports.lock();
        exports.iter().find(|e| e.id() == worker).cloned()
    }

    /// Pushes `event` to `worker`'s mount (its export's event stream).
    pub(crate) fn aecp_push_worker(&self, worker: &str, event: &IndexEvent) {
        if let Some(export) = self.aecp_export_of(worker) {
            export
                .aecp()
                .push(serde_json::to_value(event).unwrap_or_default());
        }
    }

    /// Pushes an artifact (new or changed) to every worker of its workspace.
    fn aecp_broadcast(&self, workspace: &str, artifact: &Artifact) {
        self.aecp_broadcast_event(
            workspace,
            &IndexEvent::Artifact {
                artifact: artifact.clone(),
            },
        );
    }

    /// Pushes `event` to every worker of a workspace.
    fn aecp_broadcast_event(&self, workspace: &str, event: &IndexEvent) {
        let value = serde_json::to_value(event).unwrap_or_default();
        for (_, export) in self.aecp_live_workers(workspace) {
            export.aecp().push(value.clone());
        }
    }

    /// Called when a delegation's exports exist (created or restored): registers the worker
    /// (owning what it writes back until `--owns` says otherwise), seeds its mount's replica
    /// (every artifact of the workspace and what it already received, every contract and
    /// this worker's standing as a consumer of each), and installs the sinks for its
    /// reports (deliveries, uses of contracted modules) and for the files its commits write.
    ///
    /// Every resource's export of the delegation is a worker of its own directory's
    /// workspace (its worker id is the export's id: see [`delegation_of`]).
    pub(crate) fn aecp_attach(&self, id: &str) {
        let Some(live) = self.get_live(id) else {
            return;
        };
        let exports: Vec<Arc<awcpfs::export::Export>> = live.exports.lock().clone();
        for export in exports {
            let worker = export.id().to_string();
            if let Ok(info) = self.aecp_worker(&worker) {
                self.aecp_attach_export(&worker, &info, &export);
            }
        }
    }

    /// [`Daemon::aecp_attach`] for one export, the mount of worker `id`.
    fn aecp_attach_export(
        &self,
        id: &str,
        info: &WorkerInfo,
        export: &Arc<awcpfs::export::Export>,
    ) {
        if let Err(e) = self.aecp.store.add_written(&info.workspace, id, &[]) {
            tracing::warn!(error = %e, "AECP: registering the worker failed");
        }
        let mut events: Vec<serde_json::Value> = Vec::new();
        for a in self
            .aecp
            .store
            .artifacts(&info.workspace)
            .unwrap_or_default()
        {
            events.push(
                serde_json::to_value(IndexEvent::Artifact { artifact: a }).unwrap_or_default(),
            );
        }
        for (aid, revision) in self.aecp.store.delivered(id).unwrap_or_default() {
            events.push(
                serde_json::to_value(IndexEvent::Delivered { id: aid, revision })
                    .unwrap_or_default(),
            );
        }
        for c in self
            .aecp
            .store
            .contracts(&info.workspace)
            .unwrap_or_default()
        {
            let standing =
                contracts::standing_event(&self.aecp.store, &info.workspace, &c.module, id);
            events.push(
                serde_json::to_value(IndexEvent::Contract {
                    module: c.module,
                    revision: c.revision,
                    body: c.body,
                    by: c.by,
                })
                .unwrap_or_default(),
            );
            events.extend(standing.map(|e| serde_json::to_value(e).unwrap_or_default()));
        }
        events.extend(self.aecp_install_screen(id, &info.workspace, export));
        export.aecp().replace(events);
        // The worker channel: the agent asks through its mount, as this worker only.
        if let Some(me) = self.aecp.me.get() {
            export
                .aecp()
                .set_request_handler(worker::handler(me.clone(), id.to_owned()));
        }
        let store = self.aecp.store.clone();
        let worker = id.to_owned();
        let workspace = info.workspace.clone();
        // Weak: the export owns this sink; a strong reference would keep it alive forever.
        let feed_of = std::sync::Arc::downgrade(export);
        export.aecp().set_sink(std::sync::Arc::new(move |report| {
            for module in record_report(&store, &workspace, &worker, report) {
                if let (Some(export), Some(event)) = (
                    feed_of.upgrade(),
                    contracts::standing_event(&store, &workspace, &module, &worker),
                ) {
                    export
                        .aecp()
                        .push(serde_json::to_value(event).unwrap_or_default());
                }
            }
        }));
        let store = self.aecp.store.clone();
        let worker = id.to_owned();
        let workspace = info.workspace.clone();
        export.aecp().set_commit_sink(std::sync::Arc::new(move |files| {
            if let Err(e) = store.add_written(&workspace, &worker, files) {
                tracing::warn!(error = %e, "AECP: recording the files a worker wrote back failed");
            }
        }));
    }

    /// `POST /aecp/owners`: what a worker owns (`awcp-ctl delegate --owns`, repeatable).
    pub(crate) fn aecp_set_owner(&self, req: OwnersRequest) -> Result<(), Refusal> {
        let info = self.aecp_worker(&req.worker)?;
        for g in &req.owns {
            if g.is_empty() || g.starts_with('/') || g.split('/').any(|c| c == "..") {
                return Err(refuse(
                    400,
                    format!("--owns `{g}` is not a workspace-relative glob"),
                    "Write globs such as `pkg/**` or `pkg/acct.py`",
                ));
            }
        }
        self.aecp
            .store
            .set_owner(&info.workspace, &req.worker, &req.owns)
            .map_err(store_err)
    }

    /// Runs a witness for `worker`: on its Executor, in its mount; or here, when opted in.
    async fn aecp_witness(
        &self,
        info: &WorkerInfo,
        worker: &str,
        w: &Witness,
    ) -> Result<WitnessRun, Refusal> {
        if let Some(sandbox) = &self.aecp.local_witness {
            let spec = aecp_hooks::witness::RunSpec {
                dir: info.root.clone(),
                user: None,
                isolate_network: true,
            };
            let w = w.clone();
            let sandbox = sandbox.clone();
            let run = tokio::task::spawn_blocking(move || aecp_hooks::witness::run(&w, &spec))
                .await
                .map_err(|e| refuse(500, format!("witness task failed: {e}"), ""))?
                .map_err(|e| refuse(500, format!("{e:#}"), ""))?;
            if run.network != "isolated" {
                return Err(refuse(
                    500,
                    format!(
                        "--aecp-local-witness {sandbox}: this machine refused a network namespace; the witness result is discarded"
                    ),
                    "Run the daemon as root, or let the Executor run witnesses (drop --aecp-local-witness)",
                ));
            }
            return Ok(run);
        }
        // The task is the delegation's; with several resources, the mount is the
        // resource's directory in its work directory.
        let url = format!(
            "{}/tasks/{}/aecp/witness{}",
            awcp_base(&info.executor_url),
            info.delegation,
            info.resource
                .as_deref()
                .map(|r| format!("?resource={}", worker::encode(r)))
                .unwrap_or_default()
        );
        let rb = self
            .http
            .post(url)
            .json(w)
            .timeout(Duration::from_millis(w.timeout_ms) + Duration::from_secs(30));
        let resp = with_token(rb, info.executor_token.as_deref())
            .send()
            .await
            .map_err(|e| {
                refuse(
                    502,
                    format!("asking worker {worker}'s Executor to run the witness: {e}"),
                    "Witnesses run on the worker's Executor, in its mount, while the task runs",
                )
            })?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            return Err(refuse(
                502,
                format!("worker {worker}'s Executor did not run the witness ({status}): {body}"),
                "The worker's task must be running (its mount is where the witness runs)",
            ));
        }
        resp.json::<WitnessRun>()
            .await
            .map_err(|e| refuse(502, format!("the Executor's witness answer: {e}"), ""))
    }

    /// `POST /aecp/publish`.
    pub(crate) async fn aecp_publish(
        &self,
        req: PublishRequest,
    ) -> Result<PublishResponse, Refusal> {
        let info = self.aecp_worker(&req.worker)?;
        let scope: Scope = req
            .scope
            .parse()
            .map_err(|e| refuse(400, format!("{e}"), ""))?;
        let draft = Draft {
            claim: req.claim,
            scope,
            witness: req.witness,
        };
        draft
            .validate()
            .map_err(|e| refuse(400, format!("{e}"), ""))?;
        // Scope resolution and the import graph read the workspace: off the async threads.
        let (root, scope2) = (info.root.clone(), draft.scope.clone());
        let bound = tokio::task::spawn_blocking(move || aecp_hooks::scope::resolve(&root, &scope2))
            .await
            .map_err(|e| refuse(500, format!("{e}"), ""))?
            .map_err(|e| refuse(400, format!("{e}"), ""))?;
        let run = match &draft.witness {
            Some(w) => Some(self.aecp_witness(&info, &req.worker, w).await?),
            None => None,
        };
        let status = run.as_ref().map_or(WitnessStatus::Unchecked, |r| r.status);
        if status == WitnessStatus::Refuted {
            let run = run.expect("refuted implies a run");
            self.aecp
                .store
                .reject(&info.workspace, &draft, &req.worker, &run)
                .map_err(store_err)?;
            return Err(refuse(
                422,
                format!(
                    "publication rejected: {} (output: {})",
                    run.reason,
                    run.output_tail.trim()
                ),
                "Fix the claim or the witness; a claim its own witness refutes is not published",
            ));
        }
        let artifact = self
            .aecp
            .store
            .publish(
                &info.workspace,
                &draft,
                &bound,
                &req.worker,
                status,
                run.as_ref(),
            )
            .map_err(store_err)?;
        self.aecp_broadcast(&info.workspace, &artifact);
        let forwarded_to = self.aecp_forward(&info, &artifact).await;
        Ok(PublishResponse {
            artifact,
            witness: run,
            forwarded_to,
        })
    }

    /// Forwards a new artifact to at most `forward_to` owners of related modules.
    async fn aecp_forward(&self, info: &WorkerInfo, a: &Artifact) -> Vec<String> {
        let owners = self.aecp.store.owners(&info.workspace).unwrap_or_default();
        let live = self.aecp_live_workers(&info.workspace);
        let owners: Vec<_> = owners
            .into_iter()
            .filter(|o| live.iter().any(|(id, _)| *id == o.worker))
            .collect();
        if owners.is_empty() {
            return Vec::new();
        }
        let root = info.root.clone();
        let graph =
            tokio::task::spawn_blocking(move || aecp_hooks::scope::ImportGraph::build(&root))
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
        let targets = self
            .aecp
            .policy
            .forward_targets(&a.producer, &a.bound, &owners, &graph);
        for t in &targets {
            if let Some((_, export)) = live.iter().find(|(id, _)| id == t) {
                export.aecp().push(
                    serde_json::to_value(IndexEvent::Forward { id: a.id }).unwrap_or_default(),
                );
            }
        }
        targets
    }

    /// `POST /aecp/flag`: records the dispute and re-runs the witness in the flagging
    /// worker's mount; a refuted artifact is never delivered again.
    pub(crate) async fn aecp_flag(&self, req: FlagRequest) -> Result<FlagResponse, Refusal> {
        let info = self.aecp_worker(&req.worker)?;
        let (ws, artifact) = self.aecp.store.artifact(req.id).map_err(store_err)?;
        if ws != info.workspace {
            return Err(refuse(
                404,
                format!(
                    "no artifact {} in worker {}'s workspace",
                    req.id, req.worker
                ),
                "",
            ));
        }
        self.aecp
            .store
            .flag(req.id, &req.worker, &req.reason)
            .map_err(store_err)?;
        let Some(w) = &artifact.witness else {
            return Ok(FlagResponse {
                artifact,
                witness: None,
            });
        };
        let run = self.aecp_witness(&info, &req.worker, w).await?;
        let after = self
            .aecp
            .store
            .rerun(req.id, &req.worker, &run)
            .map_err(store_err)?;
        if after.revision != artifact.revision {
            self.aecp_broadcast(&ws, &after);
        }
        Ok(FlagResponse {
            artifact: after,
            witness: Some(run),
        })
    }

    /// `GET /aecp/artifacts?worker=`: every artifact of the worker's workspace.
    pub(crate) fn aecp_list(&self, worker: &str) -> Result<Vec<Artifact>, Refusal> {
        let info = self.aecp_worker(worker)?;
        self.aecp
            .store
            .artifacts(&info.workspace)
            .map_err(store_err)
    }

    /// `GET /aecp/inbox?worker=`: what the worker received, in the delivery template.
    pub(crate) fn aecp_inbox(&self, worker: &str) -> Result<Vec<Delivery>, Refusal> {
        self.aecp_worker(worker)?;
        let mut out = Vec::new();
        for (id, _) in self.aecp.store.delivered(worker).map_err(store_err)? {
            if let Ok((_, a)) = self.aecp.store.artifact(id) {
                out.push(self.aecp.policy.delivery(&a));
            }
        }
        Ok(out)
    }

    /// `GET /aecp/lookup?worker=&path=`: the deliverable findings for a path (not a delivery).
    pub(crate) fn aecp_lookup(&self, worker: &str, path: &str) -> Result<Vec<Delivery>, Refusal> {
        let info = self.aecp_worker(worker)?;
        let mut index = aecp_hooks::index::ArtifactIndex::new();
        for a in self
            .aecp
            .store
            .artifacts(&info.workspace)
            .map_err(store_err)?
        {
            index.upsert(a);
        }
        let picked = self.aecp.policy.select(
            index.bound_to(path.trim_start_matches("./")),
            &Default::default(),
        );
        Ok(picked
            .into_iter()
            .map(|a| self.aecp.policy.delivery(a))
            .collect())
    }

    /// `GET /aecp/audit?worker=`: the workspace's audit log.
    pub(crate) fn aecp_audit(&self, worker: &str) -> Result<Vec<AuditEntry>, Refusal> {
        let info = self.aecp_worker(worker)?;
        self.aecp
            .store
            .audit_log(&info.workspace, 0)
            .map_err(store_err)
    }
}

/// The AECP routes of the daemon API (behind the same credential layer as the others).
pub(crate) fn routes() -> Router<Arc<Daemon>> {
    Router::new()
        .route("/aecp/publish", post(publish))
        .route("/aecp/flag", post(flag))
        .route("/aecp/owners", post(owners))
        .route("/aecp/artifacts", get(list))
        .route("/aecp/inbox", get(inbox))
        .route("/aecp/lookup", get(lookup))
        .route("/aecp/audit", get(audit))
        .route("/aecp/violations", get(violations))
        .merge(contracts::routes())
}

async fn publish(
    State(d): State<Arc<Daemon>>,
    body: Result<Json<PublishRequest>, JsonRejection>,
) -> Result<Json<PublishResponse>, ApiFailure> {
    let Json(req) = body.map_err(bad_json)?;
    Ok(Json(d.aecp_publish(req).await?))
}

async fn flag(
    State(d): State<Arc<Daemon>>,
    body: Result<Json<FlagRequest>, JsonRejection>,
) -> Result<Json<FlagResponse>, ApiFailure> {
    let Json(req) = body.map_err(bad_json)?;
    Ok(Json(d.aecp_flag(req).await?))
}

async fn owners(
    State(d): State<Arc<Daemon>>,
    body: Result<Json<OwnersRequest>, JsonRejection>,
) -> Result<Json<awcp_protocol::api::OkResponse>, ApiFailure> {
    let Json(req) = body.map_err(bad_json)?;
    d.aecp_set_owner(req)?;
    Ok(Json(awcp_protocol::api::OkResponse { ok: true }))
}

async fn list(
    State(d): State<Arc<Daemon>>,
    Query(q): Query<WorkerQuery>,
) -> Result<Json<Vec<Artifact>>, ApiFailure> {
    Ok(Json(d.aecp_list(&q.worker)?))
}

async fn inbox(
    State(d): State<Arc<Daemon>>,
    Query(q): Query<WorkerQuery>,
) -> Result<Json<Vec<Delivery>>, ApiFailure> {
    Ok(Json(d.aecp_inbox(&q.worker)?))
}

async fn lookup(
    State(d): State<Arc<Daemon>>,
    Query(q): Query<WorkerQuery>,
) -> Result<Json<Vec<Delivery>>, ApiFailure> {
    let path = q.path.as_deref().unwrap_or("");
    Ok(Json(d.aecp_lookup(&q.worker, path)?))
}

async fn violations(
    State(d): State<Arc<Daemon>>,
    Query(q): Query<WorkerQuery>,
) -> Result<Json<Vec<aecp_hooks::store::StoredViolation>>, ApiFailure> {
    Ok(Json(d.aecp_violations(&q.worker, q.workspace)?))
}

async fn audit(
    State(d): State<Arc<Daemon>>,
    Query(q): Query<WorkerQuery>,
) -> Result<Json<Vec<AuditEntry>>, ApiFailure> {
    Ok(Json(d.aecp_audit(&q.worker)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_registers_uses_once_and_survives_bad_entries() {
        let store = AecpStore::in_memory().unwrap();
        let body = serde_json::json!({"version": 1, "module": "pkg/acct.py", "symbols": []});
        store
            .put_contract("/ws", "pkg/acct.py", &body, "A")
            .unwrap();
        // Network input: anything that is not an array of known entries is skipped.
        for junk in [
            serde_json::json!({"uses": "pkg/acct.py"}),
            serde_json::json!("x"),
            serde_json::json!([1, null, {"uses": 5, "revision": 1}, {"id": "x"}]),
            serde_json::json!([{"uses": "pkg/none.py", "revision": 1}, {"id": 99, "revision": 1}]),
        ] {
            assert!(record_report(&store, "/ws", "B", junk).is_empty());
        }
        assert!(store.consumers("/ws", "pkg/acct.py").unwrap().is_empty());
        let report = serde_json::json!([
            {"uses": "pkg/acct.py", "revision": 1},
            {"uses": "pkg/acct.py", "revision": 1},
        ]);
        assert_eq!(
            record_report(&store, "/ws", "B", report.clone()),
            ["pkg/acct.py"]
        );
        assert!(record_report(&store, "/ws", "B", report).is_empty(), "once");
        // Its standing, as its mount receives it: stale with the diff after a revision.
        let Some(IndexEvent::Consumer { stale, .. }) =
            contracts::standing_event(&store, "/ws", "pkg/acct.py", "B")
        else {
            panic!("B is a consumer")
        };
        assert!(!stale);
        let v2 = serde_json::json!({"version": 1, "module": "pkg/acct.py", "symbols": [
            {"name": "f", "kind": "function"}
        ]});
        store.put_contract("/ws", "pkg/acct.py", &v2, "A").unwrap();
        let Some(IndexEvent::Consumer {
            revision,
            acked_revision,
            stale,
            diff,
            ..
        }) = contracts::standing_event(&store, "/ws", "pkg/acct.py", "B")
        else {
            panic!("B is a consumer")
        };
        assert_eq!((revision, acked_revision, stale), (2, 1, true));
        assert!(
            diff.unwrap().contains("+def f("),
            "the diff shows the new symbol"
        );
        assert!(contracts::standing_event(&store, "/ws", "pkg/acct.py", "C").is_none());
    }
}
