//! `awcp-ctl aecp publish|flag|list|inbox|lookup|audit`: knowledge artifacts (AECP, docs/AECP.md).
//!
//! Every command names a worker (a delegation id); inside a task the Executor sets
//! `AWCP_DELEGATION_ID`, so agents need not. Deliveries are printed in the one fixed
//! template (id, scope, status, producer, claim), one JSON object per line with `--json`.

use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};

use aecp_hooks::knowledge::{Delivery, Witness};
use awcp_ctl::client::DaemonClient;
use awcp_ctl::daemon::aecp::{FlagRequest, PublishRequest};

/// The worker an `aecp` command acts as.
#[derive(Debug, Args)]
pub(crate) struct WorkerArg {
    /// The worker (delegation id); inside a task, `$AWCP_DELEGATION_ID`.
    #[arg(long, env = "AWCP_DELEGATION_ID")]
    worker: String,
}

/// `awcp-ctl aecp` subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum KnowledgeCommand {
    /// Publish a finding: a claim about a scope, optionally with a witness that checks it.
    Publish {
        #[command(flatten)]
        worker: WorkerArg,
        /// What you found (delivered cut to 280 characters).
        #[arg(long)]
        claim: String,
        /// `symbol:pkg.mod.Class.method`, `file:pkg/a.py`, `dir:pkg` or `workspace`.
        #[arg(long)]
        scope: String,
        /// A shell command that checks the claim (run with `sh -c` in your mount on your
        /// Executor): it prints the marker once its environment is ready, then exits 0 if
        /// the claim holds.
        #[arg(long)]
        witness: Option<String>,
        /// The witness's marker.
        #[arg(long, default_value = "AECP-READY")]
        marker: String,
        /// The witness's time limit.
        #[arg(long, default_value = "60s", value_parser = crate::cli::parse_duration)]
        timeout: Duration,
    },
    /// Dispute a stored finding: its witness re-runs in your mount; refuted, it is never
    /// delivered again.
    Flag {
        #[command(flatten)]
        worker: WorkerArg,
        /// The artifact id (from a delivery).
        id: u64,
        /// Why you dispute it.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Every artifact of your workspace, refuted ones included.
    List {
        #[command(flatten)]
        worker: WorkerArg,
    },
    /// What you have received.
    Inbox {
        #[command(flatten)]
        worker: WorkerArg,
    },
    /// The findings that apply to a path (looking is not a delivery).
    Lookup {
        #[command(flatten)]
        worker: WorkerArg,
        /// Workspace-relative path.
        path: String,
    },
    /// The workspace's audit log.
    Audit {
        #[command(flatten)]
        worker: WorkerArg,
    },
}

fn print_deliveries(list: &[Delivery], json: bool) {
    for d in list {
        if json {
            print!("{}", d.to_line());
        } else {
            println!(
                "#{} [{}] {} by {}: {:?}",
                d.id, d.status, d.scope, d.producer, d.claim
            );
        }
    }
}

/// Runs one `aecp` command.
pub(super) async fn run(
    client: &DaemonClient,
    json: bool,
    cmd: KnowledgeCommand,
) -> anyhow::Result<()> {
    match cmd {
        KnowledgeCommand::Publish {
            worker,
            claim,
            scope,
            witness,
            marker,
            timeout,
        } => {
            let witness = witness.map(|script| Witness {
                argv: vec!["sh".into(), "-c".into(), script],
                marker,
                timeout_ms: timeout.as_millis() as u64,
            });
            let req = PublishRequest {
                worker: worker.worker,
                claim,
                scope,
                witness,
            };
            let r = client
                .aecp_publish(&req)
                .await
                .context("publishing the finding")?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "published #{} ({}, bound to `{}`){}",
                    r.artifact.id,
                    r.artifact.status,
                    r.artifact.bound,
                    if r.forwarded_to.is_empty() {
                        String::new()
                    } else {
                        format!(", forwarded to {}", r.forwarded_to.join(", "))
                    }
                );
            }
        }
        KnowledgeCommand::Flag { worker, id, reason } => {
            let r = client
                .aecp_flag(&FlagRequest {
                    worker: worker.worker,
                    id,
                    reason,
                })
                .await
                .context("flagging the finding")?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                let why = r
                    .witness
                    .as_ref()
                    .map_or("it has no witness".to_owned(), |w| w.reason.clone());
                println!("#{} is {} ({why})", r.artifact.id, r.artifact.status);
            }
        }
        KnowledgeCommand::List { worker } => {
            let list = client.aecp_list(&worker.worker).await?;
            for a in list {
                if json {
                    println!("{}", serde_json::to_string(&a)?);
                } else {
                    println!(
                        "#{} [{}] {} → {} by {}: {:?}",
                        a.id, a.status, a.scope, a.bound, a.producer, a.claim
                    );
                }
            }
        }
        KnowledgeCommand::Inbox { worker } => {
            print_deliveries(&client.aecp_inbox(&worker.worker).await?, json)
        }
        KnowledgeCommand::Lookup { worker, path } => {
            print_deliveries(&client.aecp_lookup(&worker.worker, &path).await?, json)
        }
        KnowledgeCommand::Audit { worker } => {
            for e in client.aecp_audit(&worker.worker).await? {
                if json {
                    println!("{}", serde_json::to_string(&e)?);
                } else {
                    println!(
                        "{:>6} {} {:<15} {} {} {}",
                        e.seq,
                        e.at_ms,
                        e.kind,
                        e.artifact.map(|a| format!("#{a}")).unwrap_or_default(),
                        e.worker.unwrap_or_default(),
                        e.detail
                    );
                }
            }
        }
    }
    Ok(())
}
