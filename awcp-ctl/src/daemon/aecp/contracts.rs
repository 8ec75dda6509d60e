//! AECP contracts on the Delegator: declare and revise a module's contract (validated,
//! stored with its audit entry), write the stub module at the module's path in the
//! workspace, show the stored contract, verify a module against it, and register or
//! acknowledge consumers.
//!
//! **The stub in the workspace.** Declaring or revising writes the contract's stub module
//! (`aecp_hooks::contract::stub`) at the module's path in the Delegator's workspace, so every
//! worker's mount sees it through the export's change events and can import it. It is
//! written only where no implementation exists: an absent file, or a file that is itself a
//! stub (it carries `__aecp_stub__`). A file without the marker is the producer's code and is
//! never overwritten; the answer says the stub was kept out. The write never leaves the
//! workspace: the module path is relative with no `..`, and a symlink on the way (or at the
//! path) is refused.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Query, State};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use aecp_hooks::contract::verify::{Report, verify};
use aecp_hooks::contract::{Contract, interface, stub};
use aecp_hooks::index::IndexEvent;
use aecp_hooks::store::{Consumer, StoredContract};

use super::super::Daemon;
use super::super::api::{ApiFailure, bad_json};
use super::super::flow::Refusal;
use super::{refuse, store_err};

/// `POST /aecp/contracts/declare` and `/aecp/contracts/revise` body: exactly one of
/// `interface` (Python stub syntax) and `contract` (the JSON form).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeclareRequest {
    /// The declaring worker (delegation id).
    pub worker: String,
    /// The module path, workspace-relative (`pkg/acct.py`).
    pub module: String,
    /// The interface text (`.pyi` syntax, bodies `...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// The contract's JSON form.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contract: Option<serde_json::Value>,
}

/// What happened to the stub module in the workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StubOutcome {
    /// Written (the path was absent or held an earlier stub).
    Written,
    /// Not written: an implementation (a file without the stub marker) is at the path.
    KeptImplementation,
    /// Not written: a write-back held against the previous revision keeps this one, and is
    /// released in its place (its mount sends it again; the stub stays as it was until then).
    ReleasedImplementation,
}

/// The answer to a declaration or revision.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeclareResponse {
    /// The module.
    pub module: String,
    /// 1 for the declaration, +1 per revision.
    pub revision: u32,
    /// What happened to the stub at the module's path.
    pub stub: StubOutcome,
    /// Consumers this revision made stale.
    pub stale: Vec<String>,
    /// For a revision: a unified diff of the previous revision's interface (as its stub
    /// text) against this one's — what a stale consumer must look at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff: Option<String>,
}

/// `GET /aecp/contracts?worker=&module=` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShowResponse {
    /// The newest revision.
    pub contract: StoredContract,
    /// Its consumers.
    pub consumers: Vec<Consumer>,
}

/// `POST /aecp/contracts/verify` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyRequest {
    /// The asking worker.
    pub worker: String,
    /// The contracted module.
    pub module: String,
    /// The module's source text to check.
    pub source: String,
}

/// `POST /aecp/contracts/depend` and `/aecp/contracts/ack` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerRequest {
    /// The consuming worker.
    pub worker: String,
    /// The contracted module.
    pub module: String,
    /// The symbols it depends on (`depend` only; empty: the whole module).
    #[serde(default)]
    pub symbols: Vec<String>,
}

/// `GET /aecp/contracts` query.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ModuleQuery {
    worker: String,
    module: String,
}

/// The largest interface or contract accepted (network input).
const MAX_CONTRACT_BYTES: usize = 1 << 20;

/// A module path as the store keys it: relative, `/`-separated, no `.`/`..`/empty
/// components, ending in `.py`.
fn module_path(module: &str) -> Result<String, Refusal> {
    let m = module.trim_start_matches("./");
    let bad = m.is_empty()
        || m.starts_with('/')
        || m.contains('\0')
        || m.contains('\\')
        || !m.ends_with(".py")
        || m.split('/').any(|c| c.is_empty() || c == "." || c == "..");
    if bad {
        return Err(refuse(
            400,
            format!("--module `{module}` is not a workspace-relative Python module path"),
            "Give the module's path inside the workspace, e.g. `pkg/acct.py`",
        ));
    }
    Ok(m.to_owned())
}

/// Parse and validate a declaration's contract for `module`.
fn contract_of(req: &DeclareRequest, module: &str) -> Result<Contract, Refusal> {
    let invalid = |e: &dyn std::fmt::Display| {
        refuse(
            422,
            format!("the contract for {module} is not valid: {e}"),
            "Fix the interface or contract where shown and declare again",
        )
    };
    let c = match (&req.interface, &req.contract) {
        (Some(text), None) => {
            if text.len() > MAX_CONTRACT_BYTES {
                return Err(refuse(413, "the interface is larger than 1 MiB", ""));
            }
            interface::parse(module, text).map_err(|e| invalid(&e))?
        }
        (None, Some(json)) => {
            let text = json.to_string();
            if text.len() > MAX_CONTRACT_BYTES {
                return Err(refuse(413, "the contract is larger than 1 MiB", ""));
            }
            let mut c = Contract::from_json(&text).map_err(|e| invalid(&e))?;
            c.module = module.to_owned();
            c.validate().map_err(|e| invalid(&e))?;
            c
        }
        _ => {
            return Err(refuse(
                400,
                "give exactly one of `interface` and `contract`",
                "awcp-ctl aecp contract declare --module pkg/acct.py --interface acct.pyi",
            ));
        }
    };
    Ok(c)
}

/// Writes `text` at `module` under `root` unless an implementation is there. Never follows a
/// symlink; never leaves `root`.
pub(crate) fn write_stub(root: &Path, module: &str, text: &str) -> std::io::Result<StubOutcome> {
    let mut dir = root.to_path_buf();
    let parts: Vec<&str> = module.split('/').collect();
    let (name, dirs) = parts
        .split_last()
        .expect("module_path checked it is non-empty");
    for d in dirs {
        dir.push(d);
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(std::io::Error::other(format!(
                    "{} is not a directory",
                    dir.display()
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir(&dir)?,
            Err(e) => return Err(e),
        }
    }
    let target: PathBuf = dir.join(name);
    match std::fs::symlink_metadata(&target) {
        Ok(m) if m.is_file() => {
            let current = std::fs::read(&target)?;
            if !String::from_utf8_lossy(&current).contains(stub::MARKER) {
                return Ok(StubOutcome::KeptImplementation);
            }
            if current == text.as_bytes() {
                return Ok(StubOutcome::Written);
            }
        }
        Ok(_) => return Ok(StubOutcome::KeptImplementation),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    // Write beside, then rename: a reader sees the old stub or the new one, never half.
    let tmp = dir.join(format!(".{name}.aecp-stub-{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)?;
    let written = f
        .write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, &target));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(StubOutcome::Written)
}

impl Daemon {
    /// Declares (`revise == false`, refused if one exists) or revises (refused if none
    /// exists) a module's contract, then writes its stub in the workspace.
    pub(crate) fn aecp_declare(
        &self,
        req: DeclareRequest,
        revise: bool,
    ) -> Result<DeclareResponse, Refusal> {
        let info = self.aecp_worker(&req.worker)?;
        let module = module_path(&req.module)?;
        let contract = contract_of(&req, &module)?;
        let existing = self
            .aecp
            .store
            .contract(&info.workspace, &module)
            .map_err(store_err)?;
        match (&existing, revise) {
            (Some(c), false) => {
                return Err(refuse(
                    409,
                    format!("{module} already has a contract (revision {})", c.revision),
                    "Change it with `awcp-ctl aecp contract revise`",
                ));
            }
            (None, true) => {
                return Err(refuse(
                    404,
                    format!("{module} has no contract to revise"),
                    "Declare it first with `awcp-ctl aecp contract declare`",
                ));
            }
            _ => {}
        }
        let body = serde_json::to_value(&contract).unwrap_or_default();
        let diff = existing
            .as_ref()
            .map(|old| interface_diff(&module, &old.body, old.revision, &body, old.revision + 1));
        let (revision, stale) = self
            .aecp
            .store
            .put_contract(&info.workspace, &module, &body, &req.worker)
            .map_err(store_err)?;
        // Write-backs held against the previous revision are screened against this one;
        // one that passes is released in place of the new stub (rewriting the stub first
        // would change the base it was written on, and make its release a conflict).
        let released = self.aecp_rescreen_held(&info.workspace, &module);
        let stub = if released {
            Ok(StubOutcome::ReleasedImplementation)
        } else {
            write_stub(&info.root, &module, &stub::generate(&contract))
        };
        let stub = stub.map_err(|e| {
            refuse(
                500,
                format!("the contract for {module} is stored (revision {revision}), but writing its stub in the workspace failed: {e}"),
                "Fix the path in the Delegator's workspace and revise the contract to write the stub again",
            )
        })?;
        tracing::info!(worker = %req.worker, module = %module, revision, stub = ?stub, "AECP contract stored");
        // Every mount of the workspace learns the contract (its `.aecp/contracts/` and the
        // observer that registers consumers); each consumer this made stale gets the diff.
        self.aecp_broadcast_event(
            &info.workspace,
            &IndexEvent::Contract {
                module: module.clone(),
                revision,
                body,
                by: req.worker.clone(),
            },
        );
        for worker in &stale {
            self.aecp_push_standing(&info.workspace, &module, worker);
        }
        Ok(DeclareResponse {
            module,
            revision,
            stub,
            stale,
            diff,
        })
    }

    /// The newest contract of a module in the worker's workspace.
    fn aecp_contract(
        &self,
        worker: &str,
        module: &str,
    ) -> Result<(String, Contract, StoredContract), Refusal> {
        let info = self.aecp_worker(worker)?;
        let module = module_path(module)?;
        let stored = self
            .aecp
            .store
            .contract(&info.workspace, &module)
            .map_err(store_err)?
            .ok_or_else(|| {
                refuse(
                    404,
                    format!("{module} has no contract"),
                    "Declare one with `awcp-ctl aecp contract declare`",
                )
            })?;
        let contract: Contract = serde_json::from_value(stored.body.clone()).map_err(|e| {
            refuse(
                500,
                format!("the stored contract of {module} is unreadable: {e}"),
                "",
            )
        })?;
        Ok((info.workspace, contract, stored))
    }

    /// `GET /aecp/contracts`: the newest revision and its consumers.
    pub(crate) fn aecp_show(&self, worker: &str, module: &str) -> Result<ShowResponse, Refusal> {
        let (workspace, _, stored) = self.aecp_contract(worker, module)?;
        let consumers = self
            .aecp
            .store
            .consumers(&workspace, &stored.module)
            .map_err(store_err)?;
        Ok(ShowResponse {
            contract: stored,
            consumers,
        })
    }

    /// `POST /aecp/contracts/verify`: check a module's text against the stored contract
    /// (tree-sitter, never run). Recorded as a `verdict` in the audit log.
    pub(crate) fn aecp_verify(&self, req: VerifyRequest) -> Result<Report, Refusal> {
        if req.source.len() > 16 * MAX_CONTRACT_BYTES {
            return Err(refuse(413, "the module is larger than 16 MiB", ""));
        }
        let (workspace, contract, stored) = self.aecp_contract(&req.worker, &req.module)?;
        let report = verify(&contract, &req.source);
        let verdict = serde_json::json!({
            "revision": stored.revision,
            "verdict": report.verdict.as_str(),
            "violations": report.violations,
            "on": "demand",
        });
        if let Err(e) =
            self.aecp
                .store
                .record_verdict(&workspace, &stored.module, &req.worker, &verdict)
        {
            tracing::warn!(error = %e, "AECP: recording a verdict failed");
        }
        Ok(report)
    }

    /// `POST /aecp/contracts/depend`: register a consumer (explicitly).
    pub(crate) fn aecp_depend(&self, req: ConsumerRequest) -> Result<(), Refusal> {
        let (workspace, _, stored) = self.aecp_contract(&req.worker, &req.module)?;
        self.aecp
            .store
            .add_consumer(&workspace, &stored.module, &req.worker, &req.symbols)
            .map_err(store_err)?;
        self.aecp_push_standing(&workspace, &stored.module, &req.worker);
        Ok(())
    }

    /// `POST /aecp/contracts/ack`: a consumer acknowledges the newest revision (its mount's
    /// `.aecp/contracts/<module>` shows it no longer stale).
    pub(crate) fn aecp_ack(&self, req: ConsumerRequest) -> Result<u32, Refusal> {
        let (workspace, _, stored) = self.aecp_contract(&req.worker, &req.module)?;
        let revision = self
            .aecp
            .store
            .ack(&workspace, &stored.module, &req.worker)
            .map_err(store_err)?;
        self.aecp_push_standing(&workspace, &stored.module, &req.worker);
        self.aecp_after_ack(&workspace, &req.worker);
        Ok(revision)
    }

    /// Sends `worker`'s standing as a consumer of `module` to its mount.
    fn aecp_push_standing(&self, workspace: &str, module: &str, worker: &str) {
        if let Some(event) = standing_event(&self.aecp.store, workspace, module, worker) {
            self.aecp_push_worker(worker, &event);
        }
    }
}

/// A unified diff of two revisions' interfaces, each as its stub text (what a stale
/// consumer must look at). A body that does not decode counts as empty.
pub(crate) fn interface_diff(
    module: &str,
    old: &serde_json::Value,
    old_revision: u32,
    new: &serde_json::Value,
    new_revision: u32,
) -> String {
    let text = |body: &serde_json::Value| {
        serde_json::from_value::<Contract>(body.clone())
            .map(|c| stub::generate(&c))
            .unwrap_or_default()
    };
    let (before, after) = (text(old), text(new));
    similar::TextDiff::from_lines(&before, &after)
        .unified_diff()
        .header(
            &format!("{module} (revision {old_revision})"),
            &format!("{module} (revision {new_revision})"),
        )
        .to_string()
}

/// `worker`'s standing as a consumer of `module`, as the event its mount applies: the
/// newest revision, the acknowledged one, the stale flag and, while stale, the diff from the
/// acknowledged revision to the newest. `None` when it is not a consumer.
pub(crate) fn standing_event(
    store: &aecp_hooks::store::Store,
    workspace: &str,
    module: &str,
    worker: &str,
) -> Option<IndexEvent> {
    let current = store.contract(workspace, module).ok().flatten()?;
    let c = store.consumer(workspace, module, worker).ok().flatten()?;
    let diff = if c.stale {
        store
            .contract_at(workspace, module, c.acked_revision)
            .ok()
            .flatten()
            .map(|old| {
                interface_diff(
                    module,
                    &old.body,
                    old.revision,
                    &current.body,
                    current.revision,
                )
            })
    } else {
        None
    };
    Some(IndexEvent::Consumer {
        module: module.to_owned(),
        revision: current.revision,
        acked_revision: c.acked_revision,
        stale: c.stale,
        by: current.by,
        diff,
    })
}

/// The contract routes (merged into the AECP routes).
pub(crate) fn routes() -> Router<Arc<Daemon>> {
    Router::new()
        .route("/aecp/contracts", get(show))
        .route("/aecp/contracts/declare", post(declare))
        .route("/aecp/contracts/revise", post(revise))
        .route("/aecp/contracts/verify", post(verify_route))
        .route("/aecp/contracts/depend", post(depend))
        .route("/aecp/contracts/ack", post(ack))
}

async fn declare(
    State(d): State<Arc<Daemon>>,
    body: Result<Json<DeclareRequest>, JsonRejection>,
) -> Result<Json<DeclareResponse>, ApiFailure> {
    let Json(req) = body.map_err(bad_json)?;
    Ok(Json(d.aecp_declare(req, false)?))
}

async fn revise(
    State(d): State<Arc<Daemon>>,
    body: Result<Json<DeclareRequest>, JsonRejection>,
) -> Result<Json<DeclareResponse>, ApiFailure> {
    let Json(req) = body.map_err(bad_json)?;
    Ok(Json(d.aecp_declare(req, true)?))
}

async fn show(
    State(d): State<Arc<Daemon>>,
    Query(q): Query<ModuleQuery>,
) -> Result<Json<ShowResponse>, ApiFailure> {
    Ok(Json(d.aecp_show(&q.worker, &q.module)?))
}

async fn verify_route(
    State(d): State<Arc<Daemon>>,
    body: Result<Json<VerifyRequest>, JsonRejection>,
) -> Result<Json<Report>, ApiFailure> {
    let Json(req) = body.map_err(bad_json)?;
    Ok(Json(d.aecp_verify(req)?))
}

async fn depend(
    State(d): State<Arc<Daemon>>,
    body: Result<Json<ConsumerRequest>, JsonRejection>,
) -> Result<Json<awcp_protocol::api::OkResponse>, ApiFailure> {
    let Json(req) = body.map_err(bad_json)?;
    d.aecp_depend(req)?;
    Ok(Json(awcp_protocol::api::OkResponse { ok: true }))
}

async fn ack(
    State(d): State<Arc<Daemon>>,
    body: Result<Json<ConsumerRequest>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiFailure> {
    let Json(req) = body.map_err(bad_json)?;
    let revision = d.aecp_ack(req)?;
    Ok(Json(
        serde_json::json!({ "ok": true, "revision": revision }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_paths_stay_inside_the_workspace() {
        for bad in [
            "",
            "/etc/x.py",
            "../x.py",
            "a/../../x.py",
            "a//b.py",
            "a/b.txt",
            "a\\b.py",
        ] {
            assert!(module_path(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(module_path("./pkg/acct.py").unwrap(), "pkg/acct.py");
    }

    #[test]
    fn stub_never_overwrites_an_implementation() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let stub1 = format!("{} = 'pkg/a.py'\ndef f(): ...\n", stub::MARKER);
        assert_eq!(
            write_stub(root, "pkg/a.py", &stub1).unwrap(),
            StubOutcome::Written
        );
        assert_eq!(
            std::fs::read_to_string(root.join("pkg/a.py")).unwrap(),
            stub1
        );
        // An earlier stub is replaced.
        let stub2 = format!("{} = 'pkg/a.py'\ndef g(): ...\n", stub::MARKER);
        assert_eq!(
            write_stub(root, "pkg/a.py", &stub2).unwrap(),
            StubOutcome::Written
        );
        assert_eq!(
            std::fs::read_to_string(root.join("pkg/a.py")).unwrap(),
            stub2
        );
        // The producer's code is kept.
        std::fs::write(root.join("pkg/a.py"), "def g():\n    return 1\n").unwrap();
        assert_eq!(
            write_stub(root, "pkg/a.py", &stub1).unwrap(),
            StubOutcome::KeptImplementation
        );
        assert_eq!(
            std::fs::read_to_string(root.join("pkg/a.py")).unwrap(),
            "def g():\n    return 1\n"
        );
    }

    #[test]
    fn stub_refuses_a_symlinked_directory() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("pkg")).unwrap();
        assert!(write_stub(dir.path(), "pkg/a.py", "x").is_err());
        assert!(!outside.path().join("a.py").exists());
    }
}
