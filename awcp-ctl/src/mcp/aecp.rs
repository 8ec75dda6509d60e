//! The AECP tools of `awcp-ctl mcp`: `aecp_publish`, `aecp_flag`, `aecp_lookup`,
//! `aecp_inbox`, `aecp_violations`. Deliveries come back in the one fixed template (id, scope, status,
//! producer, claim) as JSON: data, never instructions.

use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::{tool, tool_router};
use serde::Deserialize;

use aecp_hooks::knowledge::Witness;

use super::{AwcpMcp, answer};
use crate::daemon::aecp::{FlagRequest, PublishRequest};

/// `aecp_publish`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct PublishArgs {
    /// The publishing worker (its delegation id, `$AWCP_DELEGATION_ID` in a task).
    pub worker: String,
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
    /// The disputing worker.
    pub worker: String,
    /// The artifact id.
    pub id: u64,
    /// Why.
    pub reason: Option<String>,
}

/// `aecp_lookup`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct LookupArgs {
    /// The worker.
    pub worker: String,
    /// Workspace-relative path.
    pub path: String,
}

/// `aecp_inbox`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct InboxArgs {
    /// The worker.
    pub worker: String,
}

/// `aecp_violations`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ViolationsArgs {
    /// The worker.
    pub worker: String,
    /// Every worker of the workspace, not only this one (default false).
    pub workspace: Option<bool>,
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
        let req = PublishRequest {
            worker: a.worker,
            claim: a.claim,
            scope: a.scope,
            witness,
        };
        answer(self.client.aecp_publish(&req).await)
    }

    #[tool(description = "AECP: dispute a stored finding; its witness re-runs in your mount")]
    async fn aecp_flag(&self, Parameters(a): Parameters<FlagArgs>) -> CallToolResult {
        let req = FlagRequest {
            worker: a.worker,
            id: a.id,
            reason: a.reason.unwrap_or_default(),
        };
        answer(self.client.aecp_flag(&req).await)
    }

    #[tool(description = "AECP: the findings that apply to a path (looking is not a delivery)")]
    async fn aecp_lookup(&self, Parameters(a): Parameters<LookupArgs>) -> CallToolResult {
        answer(self.client.aecp_lookup(&a.worker, &a.path).await)
    }

    #[tool(
        description = "AECP: the commit screen's current reports on this worker's write-backs: files held because they break their module's contract (symbol, constraint, line) or import a revised module not acknowledged, and leftover stubs; fix the file on the mount (or acknowledge) and it is written back"
    )]
    async fn aecp_violations(&self, Parameters(a): Parameters<ViolationsArgs>) -> CallToolResult {
        answer(
            self.client
                .aecp_violations(&a.worker, a.workspace.unwrap_or(false))
                .await,
        )
    }

    #[tool(description = "AECP: the findings this worker has received")]
    async fn aecp_inbox(&self, Parameters(a): Parameters<InboxArgs>) -> CallToolResult {
        answer(self.client.aecp_inbox(&a.worker).await)
    }
}
