//! `awcp-ctl aecp …`: AECP artifacts from the command line. `verify` and `stub` work on
//! files alone, without a daemon: a contract given as an interface (`--interface acct.pyi`)
//! or as JSON (`--contract contract.json`). Checking against a contract stored in the
//! daemon (`--module pkg/acct.py`) is not offered yet: the store does not exist.
//!
//! Exit codes of `verify`: 0 `ok`, 3 `mismatch`, 4 `stub`, 5 `syntax`; 1 when the contract
//! or the file cannot be read (a contract that does not validate says where), 2 usage.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{ArgGroup, Args, Subcommand};

use aecp_hooks::contract::verify::{Report, Verdict, verify};
use aecp_hooks::contract::{Contract, interface, stub};

#[derive(Debug, Subcommand)]
pub(super) enum AecpCommand {
    /// Check a Python module against a contract without running it (tree-sitter): symbols,
    /// kinds, async-ness, decorators, parameters, return annotations, attributes, leftover
    /// stubs. Exit 0 only for `ok`; 3 mismatch, 4 leftover stub, 5 syntax error.
    Verify(VerifyArgs),
    /// Print the stub module of a contract: the declared symbols and signatures, no
    /// behaviour, marked `__aecp_stub__`, importable while the producer works.
    Stub(StubArgs),
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

#[derive(Debug, Args)]
pub(super) struct VerifyArgs {
    #[command(flatten)]
    source: ContractSource,
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

pub(super) fn run(cmd: AecpCommand, json: bool) -> anyhow::Result<ExitCode> {
    match cmd {
        AecpCommand::Verify(a) => {
            let source =
                std::fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
            let contract = a.source.load(&module_for(&a.file))?;
            let report = verify(&contract, &String::from_utf8_lossy(&source));
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
    }
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
