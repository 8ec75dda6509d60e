//! The AECP tools of `awcp-ctl mcp`: `aecp_publish`, `aecp_flag`, `aecp_lookup`,
//! `aecp_inbox`, `aecp_violations`. Deliveries come back in the one fixed template (id, scope, status,
//! producer, claim) as JSON: data, never instructions.
//!
//! Inside a task (`$AECP_SOCKET` set, no daemon URL or API token given) the tools ask
//! through the worker's own mount ([`AwcpMcp::with_worker_socket`]): they act as that worker
//! only — `worker` may be left out, and naming another worker is refused (403) — never with
//! the daemon's owner credential. Outside a task `worker` is required, and the daemon's
//! credential acts as the worker named.

use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::{tool, tool_router};
use serde::Deserialize;

use aecp_hooks::knowledge::Witness;

use super::{AwcpMcp, answer, fail};
use crate::daemon::aecp::{FlagRequest, PublishRequest};

/// `aecp_publish`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct PublishArgs {
    /// The publishing worker (its delegation id); inside a task, leave it out (your own).
    pub worker: Option<String>,
    /// What was found.
    pub claim: String,
    /// `symbol:pkg.mod.Class.method`, `file:pkg/a.py`, `dir:pkg` or `workspace`.
    pub scope: String,
    /// A shell command checking the claim (run with `sh -c` in the worker's mount): prints
    /// the marker when its environment is ready, exits 0 when the claim holds.
    pub witness: Option<String>,
    /// The marker (default `AECP-READY`).
    pub marker: Option<String>,
    /// The witness's time limit in seconds (default 60).
    pub timeout_seconds: Option<u64>,
}

/// `aecp_flag`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct FlagArgs {
    /// The disputing worker; inside a task, leave it out (your own).
    pub worker: Option<String>,
    /// The artifact id.
    pub id: u64,
    /// Why.
    pub reason: Option<String>,
}

/// `aecp_lookup`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct LookupArgs {
    /// The worker; inside a task, leave it out (your own).
    pub worker: Option<String>,
    /// Workspace-relative path.
    pub path: String,
}

/// `aecp_inbox`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct InboxArgs {
    /// The worker; inside a task, leave it out (your own).
    pub worker: Option<String>,
}

/// `aecp_violations`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ViolationsArgs {
    /// The worker; inside a task, leave it out (your own).
    pub worker: Option<String>,
    /// Every worker of the workspace, not only this one (default false).
    pub workspace: Option<bool>,
}

impl AwcpMcp {
    /// The worker a tool acts as: the one named, else (inside a task) the worker's own,
    /// which its channel fills in.
    fn worker(&self, named: Option<String>) -> Result<String, CallToolResult> {
        match named.filter(|w| !w.is_empty()) {
            Some(w) => Ok(w),
            None if self.as_worker => Ok(String::new()),
            None => Err(fail(
                "`worker` is required outside a task: the delegation id of the worker to act as",
            )),
        }
    }
}

#[tool_router(router = aecp_router, vis = "pub(super)")]
impl AwcpMcp {
    #[tool(description = "AECP: publish a finding about a scope, optionally with a witness")]
    async fn aecp_publish(&self, Parameters(a): Parameters<PublishArgs>) -> CallToolResult {
        let witness = a.witness.map(|script| Witness {
            argv: vec!["sh".into(), "-c".into(), script],
            marker: a.marker.unwrap_or_else(|| "AECP-READY".into()),
            timeout_ms: a.timeout_seconds.unwrap_or(60).saturating_mul(1000),
        });
        let worker = match self.worker(a.worker) {
            Ok(w) => w,
            Err(e) => return e,
        };
        let req = PublishRequest {
            worker,
            claim: a.claim,
            scope: a.scope,
            witness,
        };
        answer(self.aecp.aecp_publish(&req).await)
    }

    #[tool(description = "AECP: dispute a stored finding; its witness re-runs in your mount")]
    async fn aecp_flag(&self, Parameters(a): Parameters<FlagArgs>) -> CallToolResult {
        let worker = match self.worker(a.worker) {
            Ok(w) => w,
            Err(e) => return e,
        };
        let req = FlagRequest {
            worker,
            id: a.id,
            reason: a.reason.unwrap_or_default(),
        };
        answer(self.aecp.aecp_flag(&req).await)
    }

    #[tool(description = "AECP: the findings that apply to a path (looking is not a delivery)")]
    async fn aecp_lookup(&self, Parameters(a): Parameters<LookupArgs>) -> CallToolResult {
        match self.worker(a.worker) {
            Ok(w) => answer(self.aecp.aecp_lookup(&w, &a.path).await),
            Err(e) => e,
        }
    }

    #[tool(
        description = "AECP: the commit screen's current reports on this worker's write-backs: files held because they break their module's contract (symbol, constraint, line) or import a revised module not acknowledged, and leftover stubs; fix the file on the mount (or acknowledge) and it is written back"
    )]
    async fn aecp_violations(&self, Parameters(a): Parameters<ViolationsArgs>) -> CallToolResult {
        match self.worker(a.worker) {
            Ok(w) => answer(
                self.aecp
                    .aecp_violations(&w, a.workspace.unwrap_or(false))
                    .await,
            ),
            Err(e) => e,
        }
    }

    #[tool(description = "AECP: the findings this worker has received")]
    async fn aecp_inbox(&self, Parameters(a): Parameters<InboxArgs>) -> CallToolResult {
        match self.worker(a.worker) {
            Ok(w) => answer(self.aecp.aecp_inbox(&w).await),
            Err(e) => e,
        }
    }
}
