//! AECP contracts through a real daemon and a real mount: declare → the stub module appears
//! in the Delegator's workspace and a worker imports it on its mount; declaring twice is
//! refused; verification against the stored contract; depend → revise → stale → ack; a
//! revision never overwrites an implementation; everything in the audit log.

use std::time::Duration;

use awcp_ctl::daemon::aecp::{ConsumerRequest, DeclareRequest, StubOutcome, VerifyRequest};
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, appears, fuse_available, sample_repo};

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
        python3 -c 'import pkg.acct as m; print(m.__aecp_stub__, m.open_account.__name__)' > {o}/imported.tmp 2>&1
        mv {o}/imported.tmp {o}/imported
        while [ ! -e {o}/go ]; do sleep 0.05; done"#,
        o = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    std::fs::create_dir_all(repo.join("pkg")).unwrap();
    std::fs::write(repo.join("pkg/__init__.py"), "").unwrap();
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;

    let declare = |interface: &str| DeclareRequest {
        worker: id.clone(),
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
        appears(&out.path().join("imported"), Duration::from_secs(60)).await,
        "the worker never imported the stub"
    );
    let imported = std::fs::read_to_string(out.path().join("imported")).unwrap();
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
