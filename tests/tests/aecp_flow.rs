//! The two-worker AECP scenario of issue 19, end to end: real FUSE, a real daemon, two
//! Executor mounts of one workspace.
//!
//! 1. Worker A (its Executor runs agents as `nobody`) publishes a witnessed finding about
//!    `pkg/a.py`; the witness runs in A's mount as the agent's user.
//! 2. Worker B opens `pkg/a.py` and receives it through `.aecp/inbox`, the
//!    `user.aecp.findings` attribute and its delivery socket.
//! 3. B changes the code so the witness fails and flags the finding: refuted, never delivered
//!    again. B wrote `pkg/a.py` back, so it now owns it: A's next finding about that file is
//!    forwarded to B without any `--owns`.
//! 4. A declares a contract; B imports the stub and runs its code, and is registered as a
//!    consumer automatically (`"auto": true` in the audit log).
//! 5. A writes back a mismatching implementation: the commit screen holds it and reports it
//!    to A (`.aecp/violations`); the Delegator keeps the stub.
//! 6. A revises the contract: B is stale and receives the revision (inbox, socket,
//!    `.aecp/contracts/pkg/acct.py` with the diff), then acknowledges.

use std::io::BufRead;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aecp_hooks::knowledge::{Delivery, Witness, WitnessStatus};
use aecp_hooks::revision::RevisionNotice;
use awcp_ctl::daemon::aecp::{ConsumerRequest, DeclareRequest, FlagRequest, PublishRequest};
use awcp_ctl::executor::{AgentUser, ExecutorConfig};
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available, request};

const WAIT: Duration = Duration::from_secs(60);
const NOBODY: u32 = 65534;

const IFACE_V1: &str = "\
class Account:
    balance: int
    def deposit(self, amount: int) -> int: ...

def open_account(owner: str) -> Account: ...
";

const IFACE_V2: &str = "\
class Account:
    balance: int
    def deposit(self, amount: int, *, note: str = '') -> int: ...

def open_account(owner: str, currency: str) -> Account: ...
";

/// The NDJSON lines of a file, as JSON values (the inbox mixes knowledge deliveries and
/// revision notices).
fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read(path)
        .unwrap_or_default()
        .split(|c| *c == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("every line is one JSON object"))
        .collect()
}

/// The knowledge deliveries among them.
fn deliveries(path: &Path) -> Vec<Delivery> {
    json_lines(path)
        .into_iter()
        .filter(|v| v.get("id").is_some())
        .map(|v| serde_json::from_value(v).expect("the delivery template"))
        .collect()
}

/// The revision notices among them.
fn notices(path: &Path) -> Vec<RevisionNotice> {
    json_lines(path)
        .into_iter()
        .filter(|v| v["kind"] == RevisionNotice::KIND)
        .map(|v| serde_json::from_value(v).expect("the revision template"))
        .collect()
}

fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 64 * 1024];
    match rustix::fs::getxattr(path, name, &mut buf[..]) {
        Ok(n) => Some(buf[..n].to_vec()),
        Err(e) => {
            assert_eq!(e, rustix::io::Errno::NODATA, "getxattr {name}: {e}");
            None
        }
    }
}

/// A JSON value read from a file, `Null` while it is absent or unreadable.
fn json_file(path: &Path) -> serde_json::Value {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// Reads socket lines in the background; `next` waits for one that `want` accepts.
struct SocketLines(std::sync::mpsc::Receiver<String>);

impl SocketLines {
    fn connect(socket: &Path, token: &str) -> SocketLines {
        let stream = awcp_tests::aecp_subscribe(socket, token);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stream.lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        SocketLines(rx)
    }

    async fn next(&self, want: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let deadline = std::time::Instant::now() + WAIT;
        while std::time::Instant::now() < deadline {
            match self.0.try_recv() {
                Ok(line) => {
                    let v: serde_json::Value = serde_json::from_str(&line).expect("NDJSON");
                    if want(&v) {
                        return v;
                    }
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        panic!("nothing wanted arrived on the socket within {WAIT:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_workers_share_a_finding_a_contract_and_its_revision() {
    if !fuse_available() {
        return;
    }
    // Worker A's Executor runs its agents (and so its witnesses) as `nobody`.
    let h = Harness::start_with("sleep 600", |c| {
        c.agent_user = Some(AgentUser::lookup("nobody").unwrap())
    })
    .await;
    // `nobody` must pass through the temp dir to its work directory.
    std::fs::set_permissions(h.tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg_b = ExecutorConfig::new("sleep 600".into(), h.path("executor-b"));
    cfg_b.listen = "127.0.0.1:0".parse().unwrap();
    // One operator's two Executors, one credential (the daemon presents it to both).
    cfg_b.token = Some(h.credential());
    let executor_b = awcp_ctl::executor::start(cfg_b).await.unwrap();

    let ws = h.path("ws");
    std::fs::create_dir_all(ws.join("pkg")).unwrap();
    std::fs::write(ws.join("pkg/__init__.py"), "").unwrap();
    std::fs::write(
        ws.join("pkg/a.py"),
        "LIMIT = 10\n\ndef parse(s):\n    return s[:LIMIT]\n",
    )
    .unwrap();
    std::fs::write(ws.join("pkg/b.py"), "from pkg.a import parse\n").unwrap();

    let a = h.delegate(&ws, AccessMode::Rw, 600).await;
    let b = h
        .client
        .delegate(&request(
            executor_b.awcp_url(),
            &[("workspace", &ws, AccessMode::Rw)],
            600,
        ))
        .await
        .expect("a second rw delegation of the same directory")
        .delegation_id
        .as_str()
        .to_string();
    let mount_a = h.mountpoint(&a);
    let mount_b: PathBuf = h.path("executor-b/work").join(&b);
    assert!(
        eventually(WAIT, || mount_a.join("pkg/a.py").exists()
            && mount_b.join("pkg/a.py").exists())
        .await,
        "both mounts up: {:?}",
        h.client.get(&a).await.unwrap().record.error
    );

    // ── 1. A publishes a witnessed finding; the witness runs in A's mount, as nobody. ──
    let witness = Witness {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "echo AECP-READY; grep -q 'LIMIT = 10' pkg/a.py && echo \"uid=$(id -u) dir=$(pwd)\""
                .into(),
        ],
        marker: "AECP-READY".into(),
        timeout_ms: 30_000,
    };
    let published = h
        .client
        .aecp_publish(&PublishRequest {
            worker: a.clone(),
            claim: "parse() cuts its input to LIMIT (10) characters".into(),
            scope: "symbol:pkg.a.parse".into(),
            witness: Some(witness),
        })
        .await
        .expect("publish");
    let art = published.artifact;
    assert_eq!(art.status, WitnessStatus::Checked);
    assert_eq!(art.bound, "pkg/a.py");
    let run = published.witness.expect("the witness ran");
    assert!(
        run.output_tail
            .contains(&format!("uid={NOBODY} dir={}", mount_a.display())),
        "the witness ran in A's mount as the agent's user: {run:?}"
    );

    // ── 2. B opens pkg/a.py: inbox, attribute, socket. ──
    let findings_b = mount_b.join(".aecp/findings/pkg/a.py");
    assert!(
        eventually(WAIT, || deliveries(&findings_b)
            .iter()
            .any(|d| d.id == art.id))
        .await,
        "B's replica never learned of the finding"
    );
    let inbox_b = mount_b.join(".aecp/inbox");
    assert!(json_lines(&inbox_b).is_empty(), "looking is not a delivery");
    let socket = h.path("executor-b/agents").join(&b).join("aecp.sock");
    assert!(eventually(WAIT, || socket.exists()).await, "no socket");
    let from_socket = SocketLines::connect(&socket, &executor_b.executor.aecp_token(&b));
    // Let the reporter accept the connection before the delivery happens.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = std::fs::read_to_string(mount_b.join("pkg/a.py")).unwrap();
    assert!(text.contains("LIMIT = 10"));
    let got = deliveries(&inbox_b);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(
        (got[0].id, got[0].status, got[0].producer.as_str()),
        (art.id, WitnessStatus::Checked, a.as_str())
    );
    let attr = xattr(&mount_b.join("pkg/a.py"), "user.aecp.findings").expect("the attribute");
    assert!(String::from_utf8_lossy(&attr).contains(&format!("\"id\":{}", art.id)));
    let line = from_socket.next(|v| v.get("id").is_some()).await;
    assert_eq!(
        serde_json::from_value::<Delivery>(line).unwrap(),
        got[0],
        "the socket streams the same record"
    );

    // ── 3. The code changes so the witness fails; B flags the finding → refuted. ──
    std::fs::write(
        mount_b.join("pkg/a.py"),
        "LIMIT = 20\n\ndef parse(s):\n    return s[:LIMIT]\n",
    )
    .unwrap();
    assert!(
        eventually(WAIT, || std::fs::read_to_string(ws.join("pkg/a.py"))
            .is_ok_and(|t| t.contains("LIMIT = 20")))
        .await,
        "B's change was not written back"
    );
    let flagged = h
        .client
        .aecp_flag(&FlagRequest {
            worker: b.clone(),
            id: art.id,
            reason: "LIMIT is 20 now".into(),
        })
        .await
        .expect("flag");
    assert_eq!(
        flagged.artifact.status,
        WitnessStatus::Refuted,
        "{:?}",
        flagged.witness
    );
    assert!(
        eventually(WAIT, || deliveries(&findings_b).is_empty()).await,
        "a refuted finding is still listed for B"
    );
    assert!(
        eventually(WAIT, || xattr(
            &mount_a.join("pkg/a.py"),
            "user.aecp.findings"
        )
        .is_none())
        .await
    );
    std::fs::read(mount_a.join("pkg/a.py")).unwrap();
    let to_a = deliveries(&mount_a.join(".aecp/inbox"));
    assert!(to_a.is_empty(), "refuted, yet delivered to A: {to_a:?}");

    // B wrote pkg/a.py back, so B owns it (no --owns given): A's next finding about that
    // file is forwarded to B at once, before B touches the file again.
    let mut forwarded = Vec::new();
    for _ in 0..300 {
        let r = h
            .client
            .aecp_publish(&PublishRequest {
                worker: a.clone(),
                claim: format!("LIMIT was raised to 20 (try {})", forwarded.len()),
                scope: "file:pkg/a.py".into(),
                witness: None,
            })
            .await
            .expect("publish");
        if r.forwarded_to.contains(&b) {
            forwarded.push(r.artifact.id);
            break;
        }
        forwarded.push(0);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fwd = *forwarded.last().unwrap();
    assert_ne!(
        fwd, 0,
        "never forwarded to the worker that wrote pkg/a.py back"
    );
    assert!(
        eventually(WAIT, || deliveries(&inbox_b).iter().any(|d| d.id == fwd)).await,
        "the forwarded finding did not reach B's inbox"
    );
    from_socket.next(|v| v["id"].as_u64() == Some(fwd)).await;

    // ── 4. A declares a contract; B imports the stub and runs its code. ──
    let declare = |worker: &str, iface: &str| DeclareRequest {
        worker: worker.to_owned(),
        module: "pkg/acct.py".into(),
        interface: Some(iface.to_owned()),
        contract: None,
    };
    let d = h
        .client
        .aecp_declare(&declare(&a, IFACE_V1), false)
        .await
        .expect("declare");
    assert_eq!(d.revision, 1);
    let contract_b = mount_b.join(".aecp/contracts/pkg/acct.py");
    assert!(
        eventually(WAIT, || mount_b.join("pkg/acct.py").exists()
            && json_file(&contract_b)["revision"] == 1)
        .await,
        "B never saw the stub and the contract: {}",
        json_file(&contract_b)
    );
    assert!(
        json_file(&contract_b)["consumer"].is_null(),
        "not a consumer yet"
    );
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import pkg.acct as m\n\
             try:\n    m.open_account('b')\nexcept NotImplementedError as e:\n    print('stub:', m.__aecp_stub__)",
        ])
        .current_dir(&mount_b)
        .output()
        .expect("python3");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "stub: pkg/acct.py",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Registered as a consumer by what the mount saw, once, and the mount shows it.
    assert!(
        eventually(WAIT, || json_file(&contract_b)["consumer"]["ackedRevision"]
            == 1)
        .await,
        "B's mount does not show it as a consumer: {}",
        json_file(&contract_b)
    );
    let shown = h.client.aecp_contract(&a, "pkg/acct.py").await.unwrap();
    let consumers: Vec<&str> = shown.consumers.iter().map(|c| c.worker.as_str()).collect();
    assert_eq!(consumers, [b.as_str()], "only B read the module");
    let autos: Vec<_> = h
        .client
        .aecp_audit(&a)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "dependency")
        .collect();
    assert_eq!(autos.len(), 1, "registered once: {autos:?}");
    assert_eq!(autos[0].worker.as_deref(), Some(b.as_str()));
    assert_eq!(autos[0].detail["auto"], true);

    // ── 5. A writes back a mismatching implementation (`amt` where `amount` is declared):
    //       the commit screen holds it and reports it to A; the Delegator keeps the stub. ──
    let bad_impl = "class Account:\n    def __init__(self):\n        self.balance = 0\n\n    \
                    def deposit(self, amt: int) -> int:\n        self.balance += amt\n        \
                    return self.balance\n\n\ndef open_account(owner: str) -> Account:\n    \
                    return Account()\n";
    assert!(
        eventually(WAIT, || mount_a.join("pkg/acct.py").exists()).await,
        "A never saw the stub"
    );
    std::fs::write(mount_a.join("pkg/acct.py"), bad_impl).unwrap();
    let violations_a = mount_a.join(".aecp/violations");
    let held =
        |v: &serde_json::Value| v["module"] == "pkg/acct.py" && v["violation"]["held"] == true;
    assert!(
        eventually(WAIT, || json_lines(&violations_a).iter().any(held)).await,
        "the mismatching write-back was not held and reported to A: {:?}",
        json_lines(&violations_a)
    );
    let report = json_lines(&violations_a).into_iter().find(held).unwrap();
    assert_eq!(report["violation"]["verdict"], "mismatch", "{report}");
    assert_eq!(
        report["violation"]["violations"][0]["symbol"], "Account.deposit",
        "{report}"
    );
    assert!(
        std::fs::read_to_string(ws.join("pkg/acct.py"))
            .unwrap()
            .contains("__aecp_stub__"),
        "the held implementation reached the Delegator"
    );
    assert!(
        json_lines(&mount_b.join(".aecp/violations")).is_empty(),
        "the report is A's, not B's"
    );

    // ── 6. A revises the contract → B is stale, receives the revision, acknowledges. ──
    let r = h
        .client
        .aecp_declare(&declare(&a, IFACE_V2), true)
        .await
        .expect("revise");
    assert_eq!(r.revision, 2);
    assert_eq!(r.stale, std::slice::from_ref(&b));
    assert!(
        eventually(WAIT, || !notices(&inbox_b).is_empty()).await,
        "no revision notice in B's inbox"
    );
    let n = &notices(&inbox_b)[0];
    assert_eq!(
        (
            n.module.as_str(),
            n.revision,
            n.acked_revision,
            n.by.as_str()
        ),
        ("pkg/acct.py", 2, 1, a.as_str())
    );
    assert!(
        n.diff
            .contains("+def open_account(owner: str, currency: str)"),
        "{}",
        n.diff
    );
    let line = from_socket
        .next(|v| v["kind"] == RevisionNotice::KIND)
        .await;
    assert_eq!(&serde_json::from_value::<RevisionNotice>(line).unwrap(), n);
    let view = json_file(&contract_b);
    assert_eq!(view["revision"], 2);
    assert_eq!(view["consumer"]["stale"], true, "{view}");
    assert!(view["diff"].as_str().unwrap_or("").contains("currency"));
    // A is not a consumer: nothing for it.
    assert!(notices(&mount_a.join(".aecp/inbox")).is_empty());

    let acked = h
        .client
        .aecp_ack(&ConsumerRequest {
            worker: b.clone(),
            module: "pkg/acct.py".into(),
            symbols: vec![],
        })
        .await
        .unwrap();
    assert_eq!(acked, 2);
    assert!(
        eventually(WAIT, || {
            let v = json_file(&contract_b);
            v["consumer"]["stale"] == false && v["consumer"]["ackedRevision"] == 2
        })
        .await,
        "the acknowledgement does not show on B's mount: {}",
        json_file(&contract_b)
    );
    assert_eq!(notices(&inbox_b).len(), 1, "a revision is delivered once");
    let kinds: Vec<String> = h
        .client
        .aecp_audit(&a)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    for k in [
        "publish",
        "witness",
        "delivery",
        "flag",
        "refutation",
        "declaration",
        "dependency",
        "revision",
        "acknowledgement",
    ] {
        assert!(kinds.iter().any(|x| x == k), "{k} missing from {kinds:?}");
    }

    h.client.revoke(&a, false).await.unwrap();
    h.client.revoke(&b, false).await.unwrap();
    executor_b.stop().await;
    h.stop().await;
}
