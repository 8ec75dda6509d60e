//! The commit screen's decision: whether a worker's write-back of one file is held.
//!
//! The daemon calls [`judge`] for each written file the export's screen watches, with the
//! contract of that path (if it is a contracted module) and the revised modules the worker
//! has not acknowledged (only when the policy switch `hold_stale` is on). Static only: the
//! file is parsed with tree-sitter, never run.
//!
//! * **Contract.** The file is verified against the newest revision
//!   ([`crate::contract::verify::verify`]). A provable violation — verdict `mismatch` or
//!   `syntax` — **holds** the write-back. A leftover stub (verdict `stub`: no violation, but
//!   the marker or a contracted body that is only `...`/`raise NotImplementedError`) is
//!   **reported, not held**: a partial implementation is strictly more than the stub
//!   consumers already import, and holding it would keep the producer's progress from
//!   them. `ok` passes (and clears an earlier report).
//! * **Stale consumer.** The file imports (any `import`/`from … import`, also inside
//!   functions) a module whose contract was revised after this worker last acknowledged it:
//!   **held** until the worker acknowledges (`awcp-ctl aecp ack`).
//!
//! The [`ScreenReport`] is what reaches the worker (`.aecp/violations`, inbox, socket) and
//! what `awcp-ctl aecp violations` lists: quoted data, one fixed shape.

use serde::{Deserialize, Serialize};

use crate::contract::Contract;
use crate::contract::verify::{Report, Verdict, Violation, verify};

/// Why a write-back is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// The contracted module breaks its contract (or is a leftover stub).
    Contract,
    /// The file imports a revised module the worker has not acknowledged.
    Stale,
}

/// A revised module a consumer has not acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StaleModule {
    /// The contracted module (`pkg/acct.py`).
    pub module: String,
    /// Its newest revision.
    pub revision: u32,
    /// The revision the worker acknowledged last.
    pub acked_revision: u32,
}

/// What the screen reports about one write-back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScreenReport {
    /// The file written back.
    pub path: String,
    /// Whether its write-back is held (else: applied, and reported).
    pub held: bool,
    /// Why.
    pub cause: Cause,
    /// [`Cause::Contract`]: the contract revision checked against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u32>,
    /// [`Cause::Contract`]: the verdict (`mismatch`, `syntax`, `stub`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<String>,
    /// [`Cause::Contract`]: each symbol and constraint broken, with its line.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub violations: Vec<Violation>,
    /// [`Cause::Stale`]: the revised modules it imports that the worker has not
    /// acknowledged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stale: Vec<StaleModule>,
    /// When the write-back was judged (milliseconds since the epoch; 0 when not stamped).
    #[serde(default)]
    pub at_ms: u64,
}

impl ScreenReport {
    /// One sentence for the commit answer's `reason`.
    pub fn sentence(&self) -> String {
        match self.cause {
            Cause::Contract => {
                let broken: Vec<String> = self
                    .violations
                    .iter()
                    .take(3)
                    .map(|v| {
                        let c = serde_json::to_value(v.constraint)
                            .ok()
                            .and_then(|c| c.as_str().map(str::to_owned))
                            .unwrap_or_default();
                        match v.line {
                            Some(l) => format!("{} ({c}, line {l})", v.symbol),
                            None => format!("{} ({c})", v.symbol),
                        }
                    })
                    .collect();
                format!(
                    "held by the AECP contract of {} (revision {}): verdict {}: {}{}; fix the module on the mount and it is written back",
                    self.path,
                    self.revision.unwrap_or(0),
                    self.verdict.as_deref().unwrap_or("?"),
                    broken.join(", "),
                    if self.violations.len() > 3 {
                        ", …"
                    } else {
                        ""
                    },
                )
            }
            Cause::Stale => {
                let mods: Vec<String> = self
                    .stale
                    .iter()
                    .map(|s| format!("{} (revision {})", s.module, s.revision))
                    .collect();
                format!(
                    "held until this worker acknowledges the revised contract of {} that it imports (`awcp-ctl aecp ack --module …`)",
                    mods.join(", ")
                )
            }
        }
    }
}

/// The screen's judgement of one write-back.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    /// The verifier's report, when the path is a contracted module (for the audit log).
    pub verified: Option<Report>,
    /// What to tell the worker; `None`: nothing wrong (an earlier report clears).
    pub report: Option<ScreenReport>,
}

impl Judgement {
    /// Whether the write-back is held.
    pub fn holds(&self) -> bool {
        self.report.as_ref().is_some_and(|r| r.held)
    }
}

/// Whether a verdict holds a write-back: only a provable violation does.
pub fn verdict_holds(v: Verdict) -> bool {
    match v {
        Verdict::Mismatch | Verdict::Syntax => true,
        // A leftover stub is reported, not held (see the module docs).
        Verdict::Stub | Verdict::Ok => false,
    }
}

/// Judge the write-back of `source` at `path`: against `contract` (its newest revision)
/// when `path` is a contracted module, and against `stale` (the revised modules this
/// worker has not acknowledged; empty when the policy switch is off).
pub fn judge(
    path: &str,
    source: &str,
    contract: Option<(&Contract, u32)>,
    stale: &[StaleModule],
) -> Judgement {
    let mut verified = None;
    if let Some((c, revision)) = contract {
        let report = verify(c, source);
        let verdict = report.verdict;
        verified = Some(report.clone());
        if verdict != Verdict::Ok {
            return Judgement {
                verified,
                report: Some(ScreenReport {
                    path: path.to_owned(),
                    held: verdict_holds(verdict),
                    cause: Cause::Contract,
                    revision: Some(revision),
                    verdict: Some(verdict.as_str().to_owned()),
                    violations: report.violations,
                    stale: Vec::new(),
                    at_ms: 0,
                }),
            };
        }
    }
    let stale_imports = stale_imports(path, source, stale);
    let report = (!stale_imports.is_empty()).then(|| ScreenReport {
        path: path.to_owned(),
        held: true,
        cause: Cause::Stale,
        revision: None,
        verdict: None,
        violations: Vec::new(),
        stale: stale_imports,
        at_ms: 0,
    });
    Judgement { verified, report }
}

/// The modules of `stale` that `source` (the file at `path`) imports. A module does not
/// import itself.
pub fn stale_imports(path: &str, source: &str, stale: &[StaleModule]) -> Vec<StaleModule> {
    if stale.is_empty() || !path.ends_with(".py") {
        return Vec::new();
    }
    let files = crate::scope::imported_files(source, path);
    stale
        .iter()
        .filter(|s| s.module != path && files.binary_search(&s.module).is_ok())
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::interface;

    const IFACE: &str = "\
class Account:
    balance: int
    def deposit(self, amount: int) -> int: ...

def open_account(owner: str) -> Account: ...
";

    const GOOD: &str = "\
class Account:
    def __init__(self):
        self.balance = 0

    def deposit(self, amount: int) -> int:
        self.balance += amount
        return self.balance


def open_account(owner: str) -> Account:
    return Account()
";

    fn contract() -> Contract {
        interface::parse("pkg/acct.py", IFACE).unwrap()
    }

    fn stale(module: &str) -> StaleModule {
        StaleModule {
            module: module.into(),
            revision: 2,
            acked_revision: 1,
        }
    }

    #[test]
    fn a_conforming_module_passes() {
        let j = judge("pkg/acct.py", GOOD, Some((&contract(), 1)), &[]);
        assert!(!j.holds());
        assert_eq!(j.report, None);
        assert_eq!(j.verified.unwrap().verdict, Verdict::Ok);
    }

    #[test]
    fn a_provable_mismatch_holds_and_names_symbol_constraint_and_line() {
        let bad = GOOD.replace("amount: int) -> int", "amt: int) -> int");
        let j = judge("pkg/acct.py", &bad, Some((&contract(), 3)), &[]);
        assert!(j.holds());
        let r = j.report.unwrap();
        assert_eq!(r.cause, Cause::Contract);
        assert_eq!(r.verdict.as_deref(), Some("mismatch"));
        assert_eq!(r.revision, Some(3));
        let v = &r.violations[0];
        assert_eq!(v.symbol, "Account.deposit");
        assert_eq!(
            serde_json::to_value(v.constraint).unwrap(),
            serde_json::json!("parameters")
        );
        assert_eq!(v.line, Some(5));
        let s = r.sentence();
        assert!(s.contains("Account.deposit (parameters, line 5)"), "{s}");
    }

    #[test]
    fn a_syntax_error_holds() {
        let j = judge(
            "pkg/acct.py",
            "def open_account(owner:\n",
            Some((&contract(), 1)),
            &[],
        );
        assert!(j.holds());
        assert_eq!(j.report.unwrap().verdict.as_deref(), Some("syntax"));
    }

    #[test]
    fn a_leftover_stub_is_reported_not_held() {
        let partial = GOOD.replace(
            "        self.balance += amount\n        return self.balance\n",
            "        raise NotImplementedError\n",
        );
        let j = judge("pkg/acct.py", &partial, Some((&contract(), 1)), &[]);
        assert!(!j.holds());
        let r = j.report.expect("a leftover stub is reported");
        assert_eq!(r.verdict.as_deref(), Some("stub"));
        assert!(!r.held);
        let generated = crate::contract::stub::generate(&contract());
        let j = judge("pkg/acct.py", &generated, Some((&contract(), 1)), &[]);
        assert!(!j.holds(), "the generated stub itself is written back");
        assert_eq!(j.report.unwrap().verdict.as_deref(), Some("stub"));
    }

    #[test]
    fn an_import_of_a_module_the_worker_has_not_acknowledged_holds() {
        let s = [stale("pkg/acct.py")];
        for src in [
            "import pkg.acct\n",
            "from pkg.acct import open_account\n",
            "from pkg import acct\n",
            "from . import acct\n",
            "def f():\n    from .acct import Account\n    return Account\n",
        ] {
            let j = judge("pkg/use.py", src, None, &s);
            assert!(j.holds(), "{src:?} not held");
            let r = j.report.unwrap();
            assert_eq!(r.cause, Cause::Stale);
            assert_eq!(r.stale, s);
            assert!(r.sentence().contains("pkg/acct.py (revision 2)"));
        }
        for src in [
            "import pkg.other\n",
            "from pkg.accounts import x\n",
            "# import pkg.acct\n",
        ] {
            assert!(!judge("pkg/use.py", src, None, &s).holds(), "{src:?} held");
        }
        assert!(
            !judge("pkg/use.py", "import pkg.acct\n", None, &[]).holds(),
            "policy off: nothing stale"
        );
        assert!(
            !judge("pkg/acct.py", "import pkg.acct\n", None, &s).holds(),
            "a module is not its own consumer"
        );
        assert!(!judge("notes.txt", "import pkg.acct\n", None, &s).holds());
    }

    #[test]
    fn a_contract_violation_wins_over_staleness_and_a_pass_checks_imports() {
        let s = [stale("pkg/base.py")];
        let importing = format!("from pkg.base import Base\n{GOOD}");
        let j = judge("pkg/acct.py", &importing, Some((&contract(), 1)), &s);
        assert!(j.holds());
        assert_eq!(j.report.as_ref().unwrap().cause, Cause::Stale);
        assert_eq!(j.verified.unwrap().verdict, Verdict::Ok);
        let bad = importing.replace("amount: int) -> int", "amt: int) -> int");
        let j = judge("pkg/acct.py", &bad, Some((&contract(), 1)), &s);
        assert_eq!(j.report.unwrap().cause, Cause::Contract);
    }
}
