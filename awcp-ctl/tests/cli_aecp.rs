//! `awcp-ctl aecp verify` and `awcp-ctl aecp stub` with the real binary and no daemon: exit
//! codes per verdict, the `--json` shape, human output naming symbol, constraint and line,
//! and clear errors for a bad contract.

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_awcp-ctl");

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

fn run(dir: &Path, args: &[&str]) -> Output {
    // No daemon: point --daemon at a closed port so that any attempt to use it would fail.
    Command::new(BIN)
        .args(["--daemon", "http://127.0.0.1:9"])
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("acct.pyi"), IFACE).unwrap();
    std::fs::write(dir.path().join("good.py"), GOOD).unwrap();
    std::fs::write(
        dir.path().join("renamed.py"),
        GOOD.replace("amount: int) -> int", "amt: int) -> int")
            .replace("+= amount", "+= amt"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("stubbed.py"),
        GOOD.replace(
            "        self.balance += amount\n        return self.balance",
            "        ...",
        ),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("broken.py"),
        "def open_account(owner:\n    pass\n",
    )
    .unwrap();
    dir
}

fn json(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 1, "one JSON line: {text}");
    serde_json::from_str(&text).unwrap()
}

#[test]
fn verify_exit_codes_follow_the_verdict() {
    let dir = setup();
    let d = dir.path();
    let cases = [
        ("good.py", 0, "ok"),
        ("renamed.py", 3, "mismatch"),
        ("stubbed.py", 4, "stub"),
        ("broken.py", 5, "syntax"),
    ];
    for (file, code, verdict) in cases {
        let out = run(
            d,
            &["aecp", "verify", "--interface", "acct.pyi", file, "--json"],
        );
        assert_eq!(out.status.code(), Some(code), "{file}: {out:?}");
        let v = json(&out);
        assert_eq!(v["verdict"], verdict, "{file}: {v}");
        assert!(v["violations"].is_array() && v["notes"].is_array(), "{v}");
        assert_eq!(
            v["violations"].as_array().unwrap().is_empty(),
            code == 0,
            "{v}"
        );
    }
}

#[test]
fn verify_json_names_symbol_constraint_and_line() {
    let dir = setup();
    let out = run(
        dir.path(),
        &[
            "--json",
            "aecp",
            "verify",
            "--interface",
            "acct.pyi",
            "renamed.py",
        ],
    );
    let v = json(&out);
    let viol = &v["violations"][0];
    assert_eq!(viol["symbol"], "Account.deposit", "{v}");
    assert_eq!(viol["constraint"], "parameters", "{v}");
    assert_eq!(viol["line"], 5, "{v}");

    let out = run(
        dir.path(),
        &[
            "aecp",
            "verify",
            "--interface",
            "acct.pyi",
            "broken.py",
            "--json",
        ],
    );
    let v = json(&out);
    assert_eq!(v["violations"][0]["constraint"], "syntax", "{v}");
    assert_eq!(v["violations"][0]["line"], 1, "{v}");
    assert!(v["violations"][0]["column"].as_u64().is_some(), "{v}");
}

#[test]
fn verify_human_output_names_symbol_constraint_and_line() {
    let dir = setup();
    let out = run(
        dir.path(),
        &["aecp", "verify", "--interface", "acct.pyi", "renamed.py"],
    );
    assert_eq!(out.status.code(), Some(3));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("mismatch"), "{text}");
    assert!(
        text.contains("line 5: Account.deposit [parameters]"),
        "{text}"
    );
    assert!(text.contains("`amt`"), "{text}");
}

#[test]
fn verify_takes_a_json_contract() {
    let dir = setup();
    let contract = serde_json::json!({
        "version": 1,
        "module": "pkg/acct.py",
        "symbols": [{"name": "open_account", "kind": "function",
                     "params": [{"name": "owner", "kind": "positional_or_keyword", "annotation": "str"}],
                     "returns": "Account"}]
    });
    std::fs::write(dir.path().join("c.json"), contract.to_string()).unwrap();
    let out = run(
        dir.path(),
        &["aecp", "verify", "--contract", "c.json", "good.py"],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = run(
        dir.path(),
        &[
            "aecp",
            "verify",
            "--contract",
            "c.json",
            "renamed.py",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");

    // A typo in the contract is refused with its position and what to do.
    std::fs::write(
        dir.path().join("typo.json"),
        r#"{"version": 1, "module": "a.py", "symbols": [], "simbols": []}"#,
    )
    .unwrap();
    let out = run(
        dir.path(),
        &["aecp", "verify", "--contract", "typo.json", "good.py"],
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("simbols") && err.contains("line 1"), "{err}");
    assert!(err.contains("not a valid contract"), "{err}");
}

#[test]
fn bad_interface_and_usage_errors() {
    let dir = setup();
    std::fs::write(dir.path().join("bad.pyi"), "def f(x):\n    return x\n").unwrap();
    let out = run(
        dir.path(),
        &["aecp", "verify", "--interface", "bad.pyi", "good.py"],
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2 column 5"), "{err}");

    // Neither --interface nor --contract: a usage error.
    let out = run(dir.path(), &["aecp", "verify", "good.py"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    // Both: a usage error too.
    let out = run(
        dir.path(),
        &[
            "aecp",
            "verify",
            "--interface",
            "acct.pyi",
            "--contract",
            "c.json",
            "good.py",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    // A missing file says which.
    let out = run(
        dir.path(),
        &["aecp", "verify", "--interface", "acct.pyi", "nope.py"],
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope.py"));
}

#[test]
fn stub_prints_a_module_the_verifier_calls_a_stub() {
    let dir = setup();
    let out = run(dir.path(), &["aecp", "stub", "--interface", "acct.pyi"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let stub = String::from_utf8_lossy(&out.stdout);
    assert!(stub.contains("__aecp_stub__ = \"acct.py\""), "{stub}");
    assert!(
        stub.contains("def deposit(self, amount: int) -> int:"),
        "{stub}"
    );
    std::fs::write(dir.path().join("stub.py"), stub.as_bytes()).unwrap();
    let out = run(
        dir.path(),
        &[
            "aecp",
            "verify",
            "--interface",
            "acct.pyi",
            "stub.py",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let v = json(&out);
    assert!(
        v["violations"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["constraint"] == "stub"),
        "{v}"
    );
}

#[test]
fn daemon_commands_say_what_is_missing() {
    let dir = setup();
    let d = dir.path();
    // --module asks the daemon for a worker: without one, say how to give it.
    let out = Command::new(BIN)
        .args([
            "--daemon",
            "http://127.0.0.1:9",
            "aecp",
            "verify",
            "--module",
            "pkg/acct.py",
            "good.py",
        ])
        .env_remove("AWCP_DELEGATION_ID")
        .current_dir(d)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--worker"));
    // With a worker, an unreachable daemon is an error (exit 1), not a verdict.
    let out = Command::new(BIN)
        .args([
            "--daemon",
            "http://127.0.0.1:9",
            "aecp",
            "verify",
            "--module",
            "pkg/acct.py",
            "--worker",
            "dlg_x",
            "good.py",
        ])
        .current_dir(d)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    // declare needs a source.
    let out = run(
        d,
        &[
            "aecp",
            "contract",
            "declare",
            "--module",
            "pkg/acct.py",
            "--worker",
            "dlg_x",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

// `--help` never mentioned the channels; only the docs did.
#[test]
fn help_names_the_channels() {
    let dir = tempfile::tempdir().unwrap();
    for cmd in ["executor", "delegate", "aecp"] {
        for flag in ["-h", "--help"] {
            let out = run(dir.path(), &[cmd, flag]);
            assert!(out.status.success(), "{cmd} {flag}");
            let text = String::from_utf8_lossy(&out.stdout);
            for name in [
                ".aecp/inbox",
                ".aecp/findings",
                "AECP_SOCKET",
                "user.aecp.findings",
                "kind",
            ] {
                assert!(
                    text.contains(name),
                    "`{cmd} {flag}` does not name {name}:\n{text}"
                );
            }
        }
    }
}
