//! `awcp-ctl mcp`: an MCP server on stdio (rmcp) that drives the daemon API, with the
//! reference's tools and parameters (`delegate`, `delegate_output`, `delegate_cancel`,
//! `delegate_snapshots`, `delegate_apply_snapshot`, `delegate_discard_snapshot`,
//! `delegate_recover`, `delegate_continue`, `delegate_close`) plus ours (`delegate_revoke`,
//! `delegate_renew`, `delegate_status`, and AECP's `aecp_publish`, `aecp_flag`,
//! `aecp_lookup`, `aecp_inbox`, `aecp_violations`: `mcp/aecp.rs`).
//!
//! stdout carries the protocol only: logs go to stderr. Every tool answers with one text
//! block holding JSON (the daemon's answer, or `{"error", "hint"?}` with `isError`).

mod aecp;

use std::time::Duration;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, ServerCapabilities, ServerConfig};
use rmcp::{ServerHandler, ServiceExt, tool, tool_handler, tool_router};
use serde::Deserialize;

use awcp_protocol::api::{DelegateRequest, EnvironmentSpec, ResourceSpec, SnapshotMode};
use awcp_protocol::messages::{AccessMode, AuthCredential, AuthType, ResourceType, TaskSpec};
use awcp_protocol::{DelegationState, TransportType};

use crate::client::{ClientError, DaemonClient};

/// A resource of `delegate`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ResourceArg {
    /// Name on the Executor.
    pub name: String,
    /// Local directory.
    pub path: String,
    /// `ro` or `rw` (default `rw`).
    pub mode: Option<String>,
}

/// `delegate`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct DelegateArgs {
    /// Short description of the task.
    pub description: String,
    /// Full instructions for the remote agent.
    pub prompt: String,
    /// The directory to delegate (as resource `workspace`), unless `resources` is given.
    pub workspace_dir: Option<String>,
    /// Several directories, each under its name.
    pub resources: Option<Vec<ResourceArg>>,
    /// Base for relative paths (default: this process's directory).
    pub cwd: Option<String>,
    /// The Executor's AWCP endpoint, e.g. `http://host:7200/awcp`.
    pub peer_url: String,
    /// Lease length (default 3600).
    pub ttl_seconds: Option<u64>,
    /// `ro` or `rw` (default `rw`).
    pub access_mode: Option<String>,
    /// `auto`, `staged` or `discard` (archive only for the last two).
    pub snapshot_mode: Option<String>,
    /// `api_key`, `bearer` or `oauth2`.
    pub auth_type: Option<String>,
    /// The Executor's token.
    pub auth_credential: Option<String>,
    /// Return at once instead of waiting for the end.
    pub background: Option<bool>,
    /// Ours: `awcpfs` (default), `archive`, `storage` or `git`.
    pub transport: Option<String>,
    /// Ours: with `git`, the remote to push the workspace to (default: the daemon's
    /// `--git-remote`).
    pub git_remote: Option<String>,
    /// Ours: a multi-round session.
    pub multi_round: Option<bool>,
}

/// A delegation id.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct IdArg {
    /// `dlg_…`.
    pub delegation_id: String,
}

/// `delegate_output`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct OutputArgs {
    /// `dlg_…`.
    pub delegation_id: String,
    /// Wait until it ends (or is idle).
    pub block: Option<bool>,
    /// Longest wait in seconds (default 60).
    pub timeout: Option<u64>,
}

/// `delegate_cancel`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct CancelArgs {
    /// `dlg_…`.
    pub delegation_id: Option<String>,
    /// Cancel every running delegation.
    pub all: Option<bool>,
}

/// A snapshot of a delegation.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SnapshotArgs {
    /// `dlg_…`.
    pub delegation_id: String,
    /// `snap_…`.
    pub snapshot_id: String,
}

/// `delegate_recover`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RecoverArgs {
    /// `dlg_…`.
    pub delegation_id: String,
    /// The Executor (accepted for compatibility; the daemon knows it).
    pub peer_url: Option<String>,
}

/// `delegate_continue`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ContinueArgs {
    /// `dlg_…`.
    pub delegation_id: String,
    /// Short description of the next round.
    pub description: String,
    /// Its instructions.
    pub prompt: String,
    /// Return at once instead of waiting for the round to end.
    pub background: Option<bool>,
    /// Ours: renew the lease for this round, in seconds from now (bounded by the daemon's
    /// maximum).
    pub ttl_seconds: Option<u64>,
}

/// `delegate_revoke`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RevokeArgs {
    /// `dlg_…`.
    pub delegation_id: String,
    /// Refuse even the final flush.
    pub no_flush: Option<bool>,
}

/// `delegate_renew`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RenewArgs {
    /// `dlg_…`.
    pub delegation_id: String,
    /// New lease length from now.
    pub ttl_seconds: u64,
}

/// `delegate_status`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct StatusArgs {
    /// `dlg_…`; omit to list all.
    pub delegation_id: Option<String>,
}

/// The MCP server.
#[derive(Debug, Clone)]
pub struct AwcpMcp {
    client: DaemonClient,
    /// The client of the `aecp_*` tools: inside a task, the worker's own channel (its
    /// mount's `$AECP_SOCKET`), which acts as that worker only; else `client`.
    aecp: DaemonClient,
    /// Whether `aecp` is the worker's channel (a tool may then leave `worker` out).
    as_worker: bool,
    #[allow(dead_code, reason = "read by the tool_handler macro")]
    tool_router: ToolRouter<Self>,
}

fn ok(v: impl serde::Serialize) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(
        serde_json::to_string(&v).unwrap_or_default(),
    )])
}

fn fail(e: impl std::fmt::Display) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(
        serde_json::json!({ "error": e.to_string() }).to_string(),
    )])
}

fn answer<T: serde::Serialize>(r: Result<T, ClientError>) -> CallToolResult {
    match r {
        Ok(v) => ok(v),
        Err(e) => fail(e),
    }
}

fn mode(s: Option<&str>) -> Result<AccessMode, String> {
    match s.unwrap_or("rw") {
        "rw" => Ok(AccessMode::Rw),
        "ro" => Ok(AccessMode::Ro),
        other => Err(format!("access mode `{other}`: use ro or rw")),
    }
}

impl AwcpMcp {
    /// A server driving the daemon at `client`.
    pub fn new(client: DaemonClient) -> Self {
        AwcpMcp {
            aecp: client.clone(),
            as_worker: false,
            client,
            tool_router: Self::tool_router() + Self::aecp_router(),
        }
    }

    /// Its `aecp_*` tools ask through the worker's AECP socket at `socket` (inside a task:
    /// `$AECP_SOCKET`), with the worker's own credential: they act as that worker and no
    /// other, whatever `worker` a tool call names.
    pub fn with_worker_socket(mut self, socket: &std::path::Path) -> Self {
        self.aecp = self.aecp.with_worker_socket(socket);
        self.as_worker = true;
        self
    }

    /// Poll until the delegation ends or is idle, or `timeout` passes.
    async fn wait(&self, id: &str, timeout: Option<Duration>) -> CallToolResult {
        let start = std::time::Instant::now();
        loop {
            match self.client.get(id).await {
                Ok(v) => {
                    let s = v.record.state;
                    if s.is_terminal()
                        || s == DelegationState::Idle
                        || timeout.is_some_and(|t| start.elapsed() >= t)
                    {
                        return ok(v);
                    }
                }
                Err(e) => return fail(e),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn request(a: &DelegateArgs) -> Result<DelegateRequest, String> {
        let base = a
            .cwd
            .as_ref()
            .map(std::path::PathBuf::from)
            .or_else(|| std::env::current_dir().ok())
            .unwrap_or_default();
        let abs = |p: &str| base.join(p).display().to_string();
        let resources = match (&a.resources, &a.workspace_dir) {
            (Some(rs), _) if !rs.is_empty() => rs
                .iter()
                .map(|r| {
                    Ok(ResourceSpec {
                        name: r.name.clone(),
                        resource_type: ResourceType::Fs,
                        source: abs(&r.path),
                        mode: mode(r.mode.as_deref())?,
                        include: None,
                        exclude: None,
                        gitignore: None,
                        allow_sensitive: None,
                    })
                })
                .collect::<Result<Vec<_>, String>>()?,
            (_, Some(dir)) => vec![ResourceSpec {
                name: "workspace".into(),
                resource_type: ResourceType::Fs,
                source: abs(dir),
                mode: mode(a.access_mode.as_deref())?,
                include: None,
                exclude: None,
                gitignore: None,
                allow_sensitive: None,
            }],
            _ => return Err("give workspace_dir or resources".into()),
        };
        let snapshot_mode = match a.snapshot_mode.as_deref() {
            None => None,
            Some("auto") => Some(SnapshotMode::Auto),
            Some("staged") => Some(SnapshotMode::Staged),
            Some("discard") => Some(SnapshotMode::Discard),
            Some(o) => return Err(format!("snapshot_mode `{o}`: use auto, staged or discard")),
        };
        let transport = match a.transport.as_deref() {
            None | Some("awcpfs") => None,
            Some("archive") => Some(TransportType::Archive),
            Some("storage") => Some(TransportType::Storage),
            Some("git") => Some(TransportType::Git),
            Some(o) => {
                return Err(format!(
                    "transport `{o}`: use awcpfs, archive, storage or git"
                ));
            }
        };
        let auth = match (&a.auth_credential, a.auth_type.as_deref()) {
            (Some(c), t) => Some(AuthCredential {
                auth_type: match t {
                    Some("api_key") => AuthType::ApiKey,
                    Some("oauth2") => AuthType::Oauth2,
                    _ => AuthType::Bearer,
                },
                credential: c.clone(),
                metadata: None,
            }),
            (None, _) => None,
        };
        Ok(DelegateRequest {
            executor_url: a.peer_url.clone(),
            environment: EnvironmentSpec { resources },
            task: TaskSpec {
                description: a.description.clone(),
                prompt: a.prompt.clone(),
            },
            ttl_seconds: a.ttl_seconds,
            access_mode: Some(mode(a.access_mode.as_deref())?),
            snapshot_mode,
            auth,
            transport,
            multi_round: a.multi_round,
            git_remote: a.git_remote.clone(),
            no_network: None,
        })
    }
}

#[tool_router]
impl AwcpMcp {
    #[tool(
        description = "Delegate a workspace to a remote Executor and (unless background) wait for the result"
    )]
    async fn delegate(&self, Parameters(a): Parameters<DelegateArgs>) -> CallToolResult {
        let req = match Self::request(&a) {
            Ok(r) => r,
            Err(e) => return fail(e),
        };
        let id = match self.client.delegate(&req).await {
            Ok(r) => r.delegation_id.as_str().to_string(),
            Err(e) => return fail(e),
        };
        if a.background == Some(true) {
            return ok(serde_json::json!({"delegationId": id, "state": "started"}));
        }
        self.wait(&id, None).await
    }

    #[tool(description = "Get a delegation's state and result; with block, wait for it to end")]
    async fn delegate_output(&self, Parameters(a): Parameters<OutputArgs>) -> CallToolResult {
        let timeout = Duration::from_secs(a.timeout.unwrap_or(60));
        if a.block == Some(true) {
            return self.wait(&a.delegation_id, Some(timeout)).await;
        }
        answer(self.client.get(&a.delegation_id).await)
    }

    #[tool(description = "Cancel a delegation (or all running ones)")]
    async fn delegate_cancel(&self, Parameters(a): Parameters<CancelArgs>) -> CallToolResult {
        let ids = match (a.delegation_id, a.all) {
            (Some(id), _) => vec![id],
            (None, Some(true)) => match self.client.list().await {
                Ok(l) => l
                    .delegations
                    .into_iter()
                    .filter(|d| !d.state.is_terminal())
                    .map(|d| d.id.as_str().to_string())
                    .collect(),
                Err(e) => return fail(e),
            },
            _ => return fail("give delegation_id or all: true"),
        };
        let mut cancelled = Vec::new();
        for id in ids {
            if let Err(e) = self.client.revoke(&id, false).await {
                return fail(e);
            }
            cancelled.push(id);
        }
        ok(serde_json::json!({"ok": true, "cancelled": cancelled}))
    }

    #[tool(description = "List a delegation's snapshots")]
    async fn delegate_snapshots(&self, Parameters(a): Parameters<IdArg>) -> CallToolResult {
        answer(self.client.snapshots(&a.delegation_id).await)
    }

    #[tool(
        description = "Apply a staged snapshot to the workspace (file by file, conflicts kept beside)"
    )]
    async fn delegate_apply_snapshot(
        &self,
        Parameters(a): Parameters<SnapshotArgs>,
    ) -> CallToolResult {
        answer(self.client.apply(&a.delegation_id, &a.snapshot_id).await)
    }

    #[tool(description = "Discard a staged snapshot")]
    async fn delegate_discard_snapshot(
        &self,
        Parameters(a): Parameters<SnapshotArgs>,
    ) -> CallToolResult {
        answer(self.client.discard(&a.delegation_id, &a.snapshot_id).await)
    }

    #[tool(description = "Fetch and apply the result of a delegation whose event stream was lost")]
    async fn delegate_recover(&self, Parameters(a): Parameters<RecoverArgs>) -> CallToolResult {
        answer(self.client.recover(&a.delegation_id).await)
    }

    #[tool(description = "Run the next round of an idle multi-round delegation")]
    async fn delegate_continue(&self, Parameters(a): Parameters<ContinueArgs>) -> CallToolResult {
        let task = TaskSpec {
            description: a.description,
            prompt: a.prompt,
        };
        match self
            .client
            .continue_round(&a.delegation_id, &task, a.ttl_seconds)
            .await
        {
            Ok(r) if a.background == Some(true) => ok(r),
            Ok(_) => {
                // Wait for the round to start before waiting for idle again.
                tokio::time::sleep(Duration::from_millis(200)).await;
                self.wait(&a.delegation_id, None).await
            }
            Err(e) => fail(e),
        }
    }

    #[tool(description = "Close an idle multi-round delegation")]
    async fn delegate_close(&self, Parameters(a): Parameters<IdArg>) -> CallToolResult {
        answer(self.client.close(&a.delegation_id).await)
    }

    #[tool(
        description = "Revoke a delegation's lease now: the export refuses its token, the mount is unmounted"
    )]
    async fn delegate_revoke(&self, Parameters(a): Parameters<RevokeArgs>) -> CallToolResult {
        answer(
            self.client
                .revoke(&a.delegation_id, a.no_flush.unwrap_or(false))
                .await,
        )
    }

    #[tool(description = "Extend a delegation's lease")]
    async fn delegate_renew(&self, Parameters(a): Parameters<RenewArgs>) -> CallToolResult {
        answer(self.client.renew(&a.delegation_id, a.ttl_seconds).await)
    }

    #[tool(description = "Show one delegation in detail, or list all")]
    async fn delegate_status(&self, Parameters(a): Parameters<StatusArgs>) -> CallToolResult {
        match a.delegation_id {
            Some(id) => answer(self.client.get(&id).await),
            None => answer(self.client.list().await),
        }
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for AwcpMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_instructions(
            "Delegate a workspace to a remote agent under a lease (AWCP), follow it, take \
             its result back, and revoke it.",
        )
    }
}

/// Serve MCP on stdin/stdout until the client goes away.
///
/// With `worker_socket` (inside a task: `$AECP_SOCKET`), the `aecp_*` tools act as that
/// worker through its mount; the other tools still use `client`.
pub async fn serve(
    client: DaemonClient,
    worker_socket: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let mut server = AwcpMcp::new(client);
    if let Some(socket) = worker_socket {
        server = server.with_worker_socket(socket);
    }
    let service = server.serve(rmcp::transport::stdio()).await?;
    service.waiting().await?;
    Ok(())
}
