//! `awcp-ctl aecp …`: AECP artifacts from the command line. Knowledge artifacts
//! (`publish`, `flag`, `list`, `inbox`, `lookup`, `audit`) are in [`knowledge`]. `verify` and `stub` work on
//! files alone, without a daemon: a contract given as an interface (`--interface acct.pyi`)
//! or as JSON (`--contract contract.json`). `verify --module pkg/acct.py` checks against the
//! contract stored in the daemon; `contract declare|revise|show`, `depend` and `ack` use the
//! daemon too (`--worker`, default `$AWCP_DELEGATION_ID`).
//!
//! Exit codes of `verify`: 0 `ok`, 3 `mismatch`, 4 `stub`, 5 `syntax`; 1 when the contract
//! or the file cannot be read (a contract that does not validate says where), 2 usage.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{ArgGroup, Args, Subcommand};

use aecp_hooks::contract::verify::{Report, Verdict, verify};
use aecp_hooks::contract::{Contract, interface, stub};

use awcp_ctl::client::DaemonClient;
use awcp_ctl::daemon::aecp::{ConsumerRequest, DeclareRequest, StubOutcome, VerifyRequest};

mod knowledge;

/// The channels an agent reads AECP through, named in the `--help` of `executor`,
/// `delegate` and `aecp` (docs/AECP.md, *Channels*).
pub(super) const CHANNELS_HELP: &str = "\
AECP channels (docs/AECP.md), inside a task's mount; every line is one JSON object whose \
first field, `kind`, says what it is (finding, contract_revision, violation, \
violation_cleared, contract):
  .aecp/inbox                  this worker's deliveries, NDJSON
  .aecp/findings/<path>        the findings for a path (reading is not a delivery)
  .aecp/contracts/<module>     a contract, this worker's standing and, while stale, the diff
  .aecp/violations             the commit screen's reports on this worker's files
  getfattr -n user.aecp.findings FILE   the findings for FILE (xattr, at most 5)
  $AECP_SOCKET                 a Unix socket streaming each line as it happens, once the
                               connection sent {\"kind\": \"hello\", \"token\": \"$AECP_TOKEN\"}
The Executor sets AWCP_DELEGATION_ID (the worker), AECP_SOCKET and AECP_TOKEN in the agent's \
environment; `awcp-ctl aecp …` and `awcp-ctl mcp` use them to act as that worker only.";

#[derive(Debug, Subcommand)]
pub(super) enum AecpCommand {
    /// Check a Python module against a contract without running it (tree-sitter): symbols,
    /// kinds, async-ness, decorators, parameters, return annotations, attributes, leftover
    /// stubs. Exit 0 only for `ok`; 3 mismatch, 4 leftover stub, 5 syntax error.
    Verify(VerifyArgs),
    /// Print the stub module of a contract: the declared symbols and signatures, no
    /// behaviour, marked `__aecp_stub__`, importable while the producer works.
    Stub(StubArgs),
    /// Declare, revise or show a module's contract in the daemon (declaring or revising
    /// writes the stub module at the module's path in the workspace, never over an
    /// implementation).
    Contract {
        #[command(subcommand)]
        command: ContractCommand,
    },
    /// Register this worker as a consumer of a contracted module (a revision marks it stale).
    Depend(DependArgs),
    /// Acknowledge the newest revision of a contracted module (clears the stale flag, and
    /// releases the write-backs held until you did).
    Ack(ModuleArgs),
    /// The commit screen's current reports on your write-backs: files held because they
    /// break their module's contract (symbol, constraint, line) or import a revised module
    /// you have not acknowledged, and leftover stubs written back. A held file stays on
    /// your mount; fix it there (or acknowledge) and it is written back, clearing its
    /// report. Also in `.aecp/violations` on the mount.
    Violations(ViolationsArgs),
    /// Knowledge artifacts: publish, flag, list, inbox, lookup, audit.
    #[command(flatten)]
    Knowledge(knowledge::KnowledgeCommand),
}

#[derive(Debug, Subcommand)]
pub(super) enum ContractCommand {
    /// Declare a module's contract (refused if it has one: revise it).
    Declare(DeclareArgs),
    /// Revise a module's contract: consumers become stale until they acknowledge.
    Revise(DeclareArgs),
    /// Print the newest revision and its consumers.
    Show(ModuleArgs),
}

/// The worker and the module.
#[derive(Debug, Args)]
pub(super) struct ModuleArgs {
    /// The module path in the workspace (`pkg/acct.py`).
    #[arg(long)]
    module: String,
    /// The worker (delegation id).
    #[arg(long, env = "AWCP_DELEGATION_ID")]
    worker: String,
}

#[derive(Debug, Args)]
pub(super) struct DeclareArgs {
    #[command(flatten)]
    target: ModuleArgs,
    #[command(flatten)]
    source: ContractSource,
}

#[derive(Debug, Args)]
pub(super) struct ViolationsArgs {
    /// The worker (delegation id); inside a task, `$AWCP_DELEGATION_ID`.
    #[arg(long, env = "AWCP_DELEGATION_ID")]
    worker: String,
    /// List the reports of every worker of the workspace, not only this one.
    #[arg(long)]
    workspace: bool,
}

#[derive(Debug, Args)]
pub(super) struct DependArgs {
    #[command(flatten)]
    target: ModuleArgs,
    /// A symbol depended on (repeatable; none: the whole module).
    #[arg(long = "symbol")]
    symbols: Vec<String>,
}

/// Where the contract comes from.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("source").required(true).args(["interface", "contract"])))]
pub(super) struct ContractSource {
    /// The contract as a Python interface in stub syntax (`.pyi`, bodies `...`).
    #[arg(long, value_name = "PYI")]
    interface: Option<PathBuf>,
    /// The contract in its JSON form (see docs/AECP.md).
    #[arg(long, value_name = "JSON")]
    contract: Option<PathBuf>,
}

/// Where `verify` takes the contract from: a file, or the daemon (`--module`).
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("vsource").required(true).args(["interface", "contract", "module"])))]
pub(super) struct VerifySource {
    /// The contract as a Python interface in stub syntax (`.pyi`, bodies `...`).
    #[arg(long, value_name = "PYI")]
    interface: Option<PathBuf>,
    /// The contract in its JSON form (see docs/AECP.md).
    #[arg(long, value_name = "JSON")]
    contract: Option<PathBuf>,
    /// The contracted module in the daemon's store (`pkg/acct.py`).
    #[arg(long)]
    module: Option<String>,
    /// The worker asking, with `--module` (delegation id).
    #[arg(long, env = "AWCP_DELEGATION_ID")]
    worker: Option<String>,
}

#[derive(Debug, Args)]
pub(super) struct VerifyArgs {
    #[command(flatten)]
    source: VerifySource,
    /// The Python module to check.
    file: PathBuf,
}

#[derive(Debug, Args)]
pub(super) struct StubArgs {
    #[command(flatten)]
    source: ContractSource,
}

/// The module path an interface's contract is given: `<name>.py` after the file's name.
fn module_for(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty() && !s.starts_with('.'))
        .unwrap_or_else(|| "module".to_string());
    format!("{stem}.py")
}

impl ContractSource {
    /// Read and validate the contract; `module` names the module for an interface.
    fn load(&self, module: &str) -> anyhow::Result<Contract> {
        let (path, is_interface) = match (&self.interface, &self.contract) {
            (Some(p), _) => (p, true),
            (None, Some(p)) => (p, false),
            (None, None) => anyhow::bail!("give --interface FILE.pyi or --contract FILE.json"),
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the contract {}", path.display()))?;
        let c = if is_interface {
            interface::parse(module, &text)
        } else {
            Contract::from_json(&text)
        };
        c.with_context(|| {
            format!(
                "{} is not a valid contract; fix it where shown and run again",
                path.display()
            )
        })
    }
}

impl ContractSource {
    /// The contract's body for the daemon: the interface text or the JSON value.
    fn request(&self, worker: &str, module: &str) -> anyhow::Result<DeclareRequest> {
        let (interface, contract) = match (&self.interface, &self.contract) {
            (Some(p), _) => (
                Some(
                    std::fs::read_to_string(p)
                        .with_context(|| format!("reading the interface {}", p.display()))?,
                ),
                None,
            ),
            (None, Some(p)) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading the contract {}", p.display()))?;
                let v: serde_json::Value = serde_json::from_str(&text).with_context(|| {
                    format!("{} is not JSON; fix it and run again", p.display())
                })?;
                (None, Some(v))
            }
            (None, None) => anyhow::bail!("give --interface FILE.pyi or --contract FILE.json"),
        };
        Ok(DeclareRequest {
            worker: worker.to_owned(),
            module: module.to_owned(),
            interface,
            contract,
        })
    }
}

pub(super) async fn run(
    cmd: AecpCommand,
    json: bool,
    client: &DaemonClient,
) -> anyhow::Result<ExitCode> {
    match cmd {
        AecpCommand::Knowledge(k) => {
            knowledge::run(client, json, k).await?;
            Ok(ExitCode::SUCCESS)
        }
        AecpCommand::Verify(a) => {
            let source =
                std::fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
            let source = String::from_utf8_lossy(&source).into_owned();
            let report = match (&a.source.module, &a.source.interface, &a.source.contract) {
                (Some(module), _, _) => {
                    let Some(worker) = a.source.worker.clone() else {
                        anyhow::bail!(
                            "--module asks the daemon on behalf of a worker: give --worker ID (or set AWCP_DELEGATION_ID)"
                        );
                    };
                    client
                        .aecp_verify(&VerifyRequest {
                            worker,
                            module: module.clone(),
                            source,
                        })
                        .await?
                }
                _ => {
                    let file_source = ContractSource {
                        interface: a.source.interface.clone(),
                        contract: a.source.contract.clone(),
                    };
                    let contract = file_source.load(&module_for(&a.file))?;
                    verify(&contract, &source)
                }
            };
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print_report(&a.file, &report);
            }
            Ok(exit_for(report.verdict))
        }
        AecpCommand::Stub(a) => {
            let module = a
                .source
                .interface
                .as_deref()
                .map_or_else(|| "module.py".to_string(), module_for);
            let contract = a.source.load(&module)?;
            print!("{}", stub::generate(&contract));
            Ok(ExitCode::SUCCESS)
        }
        AecpCommand::Contract { command } => match command {
            ContractCommand::Declare(a) => declare(client, a, false, json).await,
            ContractCommand::Revise(a) => declare(client, a, true, json).await,
            ContractCommand::Show(a) => {
                let shown = client.aecp_contract(&a.worker, &a.module).await?;
                if json {
                    println!("{}", serde_json::to_string(&shown)?);
                } else {
                    let c = &shown.contract;
                    println!("{}: revision {} by {}", c.module, c.revision, c.by);
                    match serde_json::from_value::<Contract>(c.body.clone()) {
                        Ok(contract) => print!("{}", stub::generate(&contract)),
                        Err(_) => println!("{}", c.body),
                    }
                    for k in &shown.consumers {
                        println!(
                            "consumer {}: acknowledged revision {}{}",
                            k.worker,
                            k.acked_revision,
                            if k.stale { " (stale)" } else { "" }
                        );
                    }
                }
                Ok(ExitCode::SUCCESS)
            }
        },
        AecpCommand::Depend(a) => {
            client
                .aecp_depend(&ConsumerRequest {
                    worker: a.target.worker.clone(),
                    module: a.target.module.clone(),
                    symbols: a.symbols,
                })
                .await?;
            if json {
                println!("{}", serde_json::json!({"ok": true}));
            } else {
                println!(
                    "{} is a consumer of {}: a revision marks it stale until `awcp-ctl aecp ack`",
                    a.target.worker, a.target.module
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        AecpCommand::Violations(a) => {
            let list = client.aecp_violations(&a.worker, a.workspace).await?;
            for v in &list {
                if json {
                    println!("{}", serde_json::to_string(v)?);
                } else {
                    print_violation(v);
                }
            }
            if !json && list.is_empty() {
                println!("no violations");
            }
            Ok(ExitCode::SUCCESS)
        }
        AecpCommand::Ack(a) => {
            let revision = client
                .aecp_ack(&ConsumerRequest {
                    worker: a.worker.clone(),
                    module: a.module.clone(),
                    symbols: Vec::new(),
                })
                .await?;
            if json {
                println!("{}", serde_json::json!({"ok": true, "revision": revision}));
            } else {
                println!("{}: acknowledged revision {revision}", a.module);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// One screen report, for people: the file, whether it is held and why, then each broken
/// constraint.
fn print_violation(v: &aecp_hooks::store::StoredViolation) {
    let r = &v.report;
    let held = if r["held"].as_bool().unwrap_or(false) {
        "held"
    } else {
        "written back, reported"
    };
    let cause = r["cause"].as_str().unwrap_or("?");
    let what = match (cause, r["verdict"].as_str()) {
        ("contract", Some(verdict)) => format!(
            "contract revision {}: {verdict}",
            r["revision"].as_u64().unwrap_or(0)
        ),
        _ => "imports a revised module not acknowledged".to_string(),
    };
    println!("{} {} ({held}): {what}", v.worker, v.path);
    for x in r["violations"].as_array().into_iter().flatten() {
        let line = x["line"]
            .as_u64()
            .map_or(String::new(), |l| format!(", line {l}"));
        println!(
            "  {} ({}{line}): {}",
            x["symbol"].as_str().unwrap_or("?"),
            x["constraint"].as_str().unwrap_or("?"),
            x["detail"].as_str().unwrap_or("")
        );
    }
    for s in r["stale"].as_array().into_iter().flatten() {
        println!(
            "  {} is at revision {}; you acknowledged {}: `awcp-ctl aecp ack --module {}`",
            s["module"].as_str().unwrap_or("?"),
            s["revision"].as_u64().unwrap_or(0),
            s["ackedRevision"].as_u64().unwrap_or(0),
            s["module"].as_str().unwrap_or("?"),
        );
    }
}

async fn declare(
    client: &DaemonClient,
    a: DeclareArgs,
    revise: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let req = a.source.request(&a.target.worker, &a.target.module)?;
    let r = client.aecp_declare(&req, revise).await?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{}: revision {} {}",
            r.module,
            r.revision,
            if revise { "revised" } else { "declared" }
        );
        match r.stub {
            StubOutcome::Written => {
                println!("stub module written at {} in the workspace", r.module)
            }
            StubOutcome::ReleasedImplementation => println!(
                "{} held a write-back that keeps this revision: released in place of the stub",
                r.module
            ),
            StubOutcome::KeptImplementation => println!(
                "{} already holds an implementation: no stub written (it is verified against this contract when written back)",
                r.module
            ),
        }
        if let Some(diff) = &r.diff {
            print!("{diff}");
        }
        if !r.stale.is_empty() {
            println!(
                "stale consumers (until they run `awcp-ctl aecp ack`): {}",
                r.stale.join(", ")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn exit_for(v: Verdict) -> ExitCode {
    match v {
        Verdict::Ok => ExitCode::SUCCESS,
        Verdict::Mismatch => ExitCode::from(3),
        Verdict::Stub => ExitCode::from(4),
        Verdict::Syntax => ExitCode::from(5),
    }
}

fn print_report(file: &Path, r: &Report) {
    let n = r.violations.len();
    match r.verdict {
        Verdict::Ok => println!("{}: ok", file.display()),
        v => println!(
            "{}: {} ({n} violation{})",
            file.display(),
            v.as_str(),
            if n == 1 { "" } else { "s" }
        ),
    }
    for v in &r.violations {
        let at = match (v.line, v.column) {
            (Some(l), Some(c)) => format!("line {l}:{c}"),
            (Some(l), None) => format!("line {l}"),
            (None, _) => "not found".to_string(),
        };
        let constraint = serde_json::to_value(v.constraint)
            .ok()
            .and_then(|c| c.as_str().map(str::to_string))
            .unwrap_or_default();
        println!("  {at}: {} [{constraint}] {}", v.symbol, v.detail);
    }
    for note in &r.notes {
        println!("  note: {note}");
    }
    match r.verdict {
        Verdict::Ok => {}
        Verdict::Mismatch => {
            println!("fix the implementation, or revise the contract if the interface changed")
        }
        Verdict::Stub => println!(
            "a stub is left: implement the bodies shown and remove `{}`",
            stub::MARKER
        ),
        Verdict::Syntax => println!("the file does not parse: fix the syntax error shown"),
    }
}
