//! AECP contracts through a real daemon and a real mount: declare → the stub module appears
//! in the Delegator's workspace and a worker imports it on its mount; declaring twice is
//! refused; verification against the stored contract; depend → revise → stale → ack; a
//! revision never overwrites an implementation; everything in the audit log.

use std::time::Duration;

use awcp_ctl::daemon::aecp::{ConsumerRequest, DeclareRequest, StubOutcome, VerifyRequest};
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, appears, eventually, fuse_available, sample_repo};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn declare_writes_a_stub_the_mount_imports_and_revise_marks_consumers_stale() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    // The worker waits for the stub on its mount, imports it, then waits to be let go.
    let agent = format!(
        r#"i=0; while [ ! -e pkg/acct.py ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
        python3 -c 'import pkg.acct as m; print(m.__aecp_stub__, m.open_account.__name__)' > {o}/imported.$AWCP_DELEGATION_ID.tmp 2>&1
        mv {o}/imported.$AWCP_DELEGATION_ID.tmp {o}/imported.$AWCP_DELEGATION_ID
        while [ ! -e {o}/go ]; do sleep 0.05; done"#,
        o = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    std::fs::create_dir_all(repo.join("pkg")).unwrap();
    std::fs::write(repo.join("pkg/__init__.py"), "").unwrap();
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    // The contract's producer: another worker of the workspace (a worker is never made
    // stale by its own revision).
    let producer = h.delegate(&repo, AccessMode::Rw, 600).await;

    let declare = |interface: &str| DeclareRequest {
        worker: producer.clone(),
        module: "pkg/acct.py".into(),
        interface: Some(interface.to_owned()),
        contract: None,
    };
    let r = h.client.aecp_declare(&declare(IFACE), false).await.unwrap();
    assert_eq!(r.revision, 1);
    assert_eq!(r.stub, StubOutcome::Written);
    let stub = std::fs::read_to_string(repo.join("pkg/acct.py")).unwrap();
    assert!(stub.contains("__aecp_stub__"), "{stub}");
    assert!(
        stub.contains("def deposit(self, amount: int) -> int"),
        "{stub}"
    );

    // The worker's mount sees the stub and imports the declared interface.
    assert!(
        appears(
            &out.path().join(format!("imported.{id}")),
            Duration::from_secs(60)
        )
        .await,
        "the worker never imported the stub"
    );
    let imported = std::fs::read_to_string(out.path().join(format!("imported.{id}"))).unwrap();
    assert_eq!(imported.trim(), "pkg/acct.py open_account", "{imported}");

    // Declaring again is refused (revise instead); a bad module path is refused.
    let again = h.client.aecp_declare(&declare(IFACE), false).await;
    assert!(format!("{:?}", again.unwrap_err()).contains("409"));
    let mut outside = declare(IFACE);
    outside.module = "../evil.py".into();
    assert!(h.client.aecp_declare(&outside, false).await.is_err());
    assert!(!h.path("evil.py").exists());
    let mut invalid = declare("def f(x, x): ...\n");
    invalid.module = "pkg/other.py".into();
    assert!(h.client.aecp_declare(&invalid, false).await.is_err());
    assert!(!repo.join("pkg/other.py").exists());

    // Verification against the stored contract.
    let verify = |source: &str| VerifyRequest {
        worker: id.clone(),
        module: "pkg/acct.py".into(),
        source: source.to_owned(),
    };
    let ok = h.client.aecp_verify(&verify(GOOD)).await.unwrap();
    assert_eq!(ok.verdict.as_str(), "ok", "{ok:?}");
    let bad = h
        .client
        .aecp_verify(&verify(
            &GOOD.replace("amount: int) -> int", "amt: int) -> int"),
        ))
        .await
        .unwrap();
    assert_eq!(bad.verdict.as_str(), "mismatch", "{bad:?}");
    let leftover = h.client.aecp_verify(&verify(&stub)).await.unwrap();
    assert_eq!(leftover.verdict.as_str(), "stub", "{leftover:?}");

    // depend → revise → stale → ack.
    let consumer = ConsumerRequest {
        worker: id.clone(),
        module: "pkg/acct.py".into(),
        symbols: vec!["Account.deposit".into()],
    };
    h.client.aecp_depend(&consumer).await.unwrap();
    let revised = IFACE.replace(
        "def open_account(owner: str)",
        "def open_account(owner: str, *, limit: int = 0)",
    );
    let r = h
        .client
        .aecp_declare(&declare(&revised), true)
        .await
        .unwrap();
    assert_eq!(r.revision, 2);
    assert_eq!(r.stale, vec![id.clone()]);
    assert_eq!(r.stub, StubOutcome::Written, "an earlier stub is replaced");
    let diff = r.diff.expect("a revision carries the diff");
    assert!(
        diff.lines()
            .any(|l| l.starts_with('+') && l.contains("limit: int = ...")),
        "{diff}"
    );
    assert!(
        diff.lines()
            .any(|l| l.starts_with('-') && l.contains("def open_account(owner: str)")),
        "{diff}"
    );
    assert!(
        std::fs::read_to_string(repo.join("pkg/acct.py"))
            .unwrap()
            .contains("limit: int = ..."),
        "the revised stub replaced the first"
    );
    let shown = h.client.aecp_contract(&id, "pkg/acct.py").await.unwrap();
    assert_eq!(shown.contract.revision, 2);
    assert!(shown.consumers.iter().any(|c| c.worker == id && c.stale));
    assert_eq!(h.client.aecp_ack(&consumer).await.unwrap(), 2);
    let shown = h.client.aecp_contract(&id, "pkg/acct.py").await.unwrap();
    assert!(shown.consumers.iter().all(|c| !c.stale), "{shown:?}");

    // An implementation at the path is never overwritten by a revision's stub.
    std::fs::write(repo.join("pkg/acct.py"), GOOD).unwrap();
    let r = h.client.aecp_declare(&declare(IFACE), true).await.unwrap();
    assert_eq!(r.revision, 3);
    assert_eq!(r.stub, StubOutcome::KeptImplementation);
    assert_eq!(
        std::fs::read_to_string(repo.join("pkg/acct.py")).unwrap(),
        GOOD
    );

    // The audit log has every step.
    let audit: serde_json::Value =
        reqwest::get(format!("{}/aecp/audit?worker={id}", h.daemon.token_url()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    let kinds: Vec<&str> = audit
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    for k in ["declaration", "verdict", "revision", "acknowledgement"] {
        assert!(kinds.contains(&k), "no {k} in {kinds:?}");
    }

    std::fs::write(out.path().join("go"), "").unwrap();
    h.wait_end(&id, Duration::from_secs(60)).await;
    h.stop().await;
}

/// The text of `.aecp/violations` on a mount (empty when unreadable).
fn violations_on(mount: &std::path::Path) -> String {
    std::fs::read_to_string(mount.join(".aecp/violations")).unwrap_or_default()
}

/// The next NDJSON line of a socket, parsed.
async fn next_line(
    mut r: std::io::BufReader<std::os::unix::net::UnixStream>,
) -> (
    serde_json::Value,
    std::io::BufReader<std::os::unix::net::UnixStream>,
) {
    tokio::task::spawn_blocking(move || {
        let mut l = String::new();
        std::io::BufRead::read_line(&mut r, &mut l).unwrap();
        (serde_json::from_str(&l).expect("one JSON line"), r)
    })
    .await
    .unwrap()
}

/// How many `verdict` entries with `"on": "write-back"` the audit log has for `module`.
async fn write_back_verdicts(h: &Harness, worker: &str, module: &str) -> usize {
    h.client
        .aecp_audit(worker)
        .await
        .unwrap()
        .iter()
        .filter(|e| {
            e.kind == "verdict"
                && e.detail["module"] == module
                && e.detail["verdict"]["on"] == "write-back"
        })
        .count()
}

/// Issue 19: a write-back that provably breaks its module's contract is held — the
/// Delegator keeps the stub, the file stays on the mount — and its report (symbol,
/// constraint, line) reaches the worker through `.aecp/violations`, the inbox and
/// `awcp-ctl aecp violations`; it is not sent again while unchanged; fixed on the mount,
/// it is written back and the report clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn screen_holds_a_mismatching_implementation_until_it_is_fixed() {
    if !fuse_available() {
        return;
    }
    // The agent only keeps the mount alive; the test plays it.
    let h = Harness::start("sleep 600").await;
    let repo = h.path("repo");
    std::fs::create_dir_all(repo.join("pkg")).unwrap();
    std::fs::write(repo.join("pkg/__init__.py"), "").unwrap();
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let mount = h.mountpoint(&id);
    let wait = Duration::from_secs(60);
    assert!(eventually(wait, || mount.join("pkg/__init__.py").exists()).await);

    let r = h
        .client
        .aecp_declare(
            &DeclareRequest {
                worker: id.clone(),
                module: "pkg/acct.py".into(),
                interface: Some(IFACE.into()),
                contract: None,
            },
            false,
        )
        .await
        .unwrap();
    assert_eq!(r.stub, StubOutcome::Written);
    let stub = std::fs::read_to_string(repo.join("pkg/acct.py")).unwrap();
    assert!(
        eventually(wait, || std::fs::read_to_string(mount.join("pkg/acct.py"))
            .is_ok_and(|t| t == stub))
        .await,
        "the mount never saw the stub"
    );

    // The worker's harness listens on its delivery socket.
    let socket = h.path("executor/agents").join(&id).join("aecp.sock");
    assert!(eventually(wait, || socket.exists()).await, "no socket");
    // As the worker's agent does: with its token.
    let socket_lines = awcp_tests::aecp_subscribe(&socket, &h.executor.executor.aecp_token(&id));

    // The worker writes a mismatching implementation (`amt` where `amount` is declared),
    // and an unrelated file.
    let bad = GOOD.replace("amount: int) -> int", "amt: int) -> int");
    std::fs::write(mount.join("pkg/acct.py"), &bad).unwrap();
    std::fs::write(mount.join("notes.txt"), "unrelated\n").unwrap();
    assert!(
        eventually(wait, || violations_on(&mount).contains("Account.deposit")).await,
        "no report in .aecp/violations: {:?}",
        violations_on(&mount)
    );
    let line: serde_json::Value = serde_json::from_str(violations_on(&mount).trim()).unwrap();
    assert_eq!(line["module"], "pkg/acct.py", "{line}");
    let report = &line["violation"];
    assert_eq!(report["held"], true, "{line}");
    assert_eq!(report["verdict"], "mismatch", "{line}");
    assert_eq!(
        report["violations"][0]["symbol"], "Account.deposit",
        "{line}"
    );
    assert_eq!(
        report["violations"][0]["constraint"], "parameters",
        "{line}"
    );
    assert_eq!(report["violations"][0]["line"], 5, "{line}");
    // The Delegator still has the stub; the rest of the worker's changes landed.
    assert!(eventually(wait, || repo.join("notes.txt").exists()).await);
    assert_eq!(
        std::fs::read_to_string(repo.join("pkg/acct.py")).unwrap(),
        stub
    );
    // The mount keeps the worker's version.
    assert_eq!(
        std::fs::read_to_string(mount.join("pkg/acct.py")).unwrap(),
        bad
    );
    // The daemon lists it (`awcp-ctl aecp violations`), and the inbox carries it.
    let listed = h.client.aecp_violations(&id, false).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].path, "pkg/acct.py");
    assert_eq!(
        listed[0].report["violations"][0]["constraint"],
        "parameters"
    );
    let inbox = std::fs::read_to_string(mount.join(".aecp/inbox")).unwrap();
    assert!(inbox.contains("Account.deposit"), "{inbox}");
    let (from_socket, socket_lines) = next_line(socket_lines).await;
    assert_eq!(from_socket, line, "the socket carries the same report");
    // Held once, not retried in a loop while unchanged.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(write_back_verdicts(&h, &id, "pkg/acct.py").await, 1);
    assert_eq!(
        std::fs::read_to_string(repo.join("pkg/acct.py")).unwrap(),
        stub
    );

    // Fixed on the mount: written back, the report clears everywhere.
    std::fs::write(mount.join("pkg/acct.py"), GOOD).unwrap();
    assert!(
        eventually(wait, || std::fs::read_to_string(repo.join("pkg/acct.py"))
            .is_ok_and(|t| t == GOOD))
        .await,
        "the fixed module never reached the Delegator"
    );
    assert!(
        eventually(wait, || !violations_on(&mount).contains("pkg/acct.py")).await,
        "the report did not clear: {:?}",
        violations_on(&mount)
    );
    assert!(
        h.client
            .aecp_violations(&id, false)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(write_back_verdicts(&h, &id, "pkg/acct.py").await, 2);
    let (cleared, _) = next_line(socket_lines).await;
    assert_eq!(
        cleared,
        serde_json::json!({"kind": "violation_cleared", "module": "pkg/acct.py", "violation": null})
    );

    // Broken again when the task ends: not written back, and not lost — the Executor keeps
    // it with its unsynced changes, and the Delegator's explicit `collect` applies it.
    let bad2 = GOOD.replace("def open_account(owner: str)", "def open_account()");
    std::fs::write(mount.join("pkg/acct.py"), &bad2).unwrap();
    assert!(
        eventually(wait, || violations_on(&mount).contains("open_account")).await,
        "not held again: {:?}",
        violations_on(&mount)
    );
    h.client.revoke(&id, false).await.unwrap();
    h.wait_end(&id, wait).await;
    assert_eq!(
        std::fs::read_to_string(repo.join("pkg/acct.py")).unwrap(),
        GOOD,
        "the final flush wrote a held module back"
    );
    let mut collected = None;
    for _ in 0..100 {
        match h.client.collect(&id, false).await {
            Ok(r) => {
                collected = Some(r);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let collected = collected.expect("the Executor kept the held module");
    assert!(collected.applied >= 1, "{collected:?}");
    assert_eq!(
        std::fs::read_to_string(repo.join("pkg/acct.py")).unwrap(),
        bad2
    );
    h.stop().await;
}

/// The policy switch (`awcp-ctl serve --aecp-hold-stale`): while a worker is stale on a
/// revised module, its write-back of a file that imports that module is held (a file that
/// does not is written back); acknowledging the revision releases it, and it is written
/// back without being touched again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn screen_holds_a_stale_consumers_importing_file_until_it_acknowledges() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_full("sleep 600", |d| d.aecp_hold_stale = true, |_| {}).await;
    let repo = h.path("repo");
    std::fs::create_dir_all(repo.join("pkg")).unwrap();
    std::fs::write(repo.join("pkg/__init__.py"), "").unwrap();
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let mount = h.mountpoint(&id);
    let wait = Duration::from_secs(60);
    assert!(eventually(wait, || mount.join("pkg/__init__.py").exists()).await);
    // The contract's producer: another worker of the workspace (a worker is never made
    // stale by its own revision).
    let producer = h.delegate(&repo, AccessMode::Rw, 600).await;

    let declare = |interface: &str| DeclareRequest {
        worker: producer.clone(),
        module: "pkg/acct.py".into(),
        interface: Some(interface.to_owned()),
        contract: None,
    };
    h.client.aecp_declare(&declare(IFACE), false).await.unwrap();
    let consumer = ConsumerRequest {
        worker: id.clone(),
        module: "pkg/acct.py".into(),
        symbols: vec!["open_account".into()],
    };
    h.client.aecp_depend(&consumer).await.unwrap();
    // Not stale yet: an importing file is written back.
    std::fs::write(mount.join("pkg/early.py"), "import pkg.acct\n").unwrap();
    assert!(eventually(wait, || repo.join("pkg/early.py").exists()).await);

    let revised = IFACE.replace(
        "def open_account(owner: str)",
        "def open_account(owner: str, *, limit: int = 0)",
    );
    let r = h
        .client
        .aecp_declare(&declare(&revised), true)
        .await
        .unwrap();
    assert_eq!(r.stale, vec![id.clone()]);

    let user = "from pkg.acct import open_account\n\nACCOUNT = open_account('x')\n";
    std::fs::write(mount.join("pkg/use.py"), user).unwrap();
    std::fs::write(mount.join("pkg/free.py"), "X = 1\n").unwrap();
    assert!(
        eventually(wait, || violations_on(&mount).contains("pkg/use.py")).await,
        "no report in .aecp/violations: {:?}",
        violations_on(&mount)
    );
    let line: serde_json::Value = serde_json::from_str(violations_on(&mount).trim()).unwrap();
    assert_eq!(line["violation"]["held"], true, "{line}");
    assert_eq!(line["violation"]["cause"], "stale", "{line}");
    assert_eq!(
        line["violation"]["stale"][0]["module"], "pkg/acct.py",
        "{line}"
    );
    assert_eq!(line["violation"]["stale"][0]["revision"], 2, "{line}");
    assert!(eventually(wait, || repo.join("pkg/free.py").exists()).await);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !repo.join("pkg/use.py").exists(),
        "a stale consumer's importing file reached the Delegator"
    );
    let listed = h.client.aecp_violations(&id, true).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");

    // Acknowledged: released and written back with no further change on the mount.
    assert_eq!(h.client.aecp_ack(&consumer).await.unwrap(), 2);
    assert!(
        eventually(wait, || std::fs::read_to_string(repo.join("pkg/use.py"))
            .is_ok_and(|t| t == user))
        .await,
        "the released file never reached the Delegator"
    );
    assert!(
        eventually(wait, || !violations_on(&mount).contains("pkg/use.py")).await,
        "the report did not clear: {:?}",
        violations_on(&mount)
    );
    assert!(
        h.client
            .aecp_violations(&id, true)
            .await
            .unwrap()
            .is_empty()
    );

    h.client.revoke(&id, false).await.unwrap();
    h.stop().await;
}
