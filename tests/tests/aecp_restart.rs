//! What the commit screen keeps survives a daemon restart (issue 33): a write-back held for
//! breaking its contract stays held — its report and its content are in the daemon's store —
//! and the revision published after the restart, which the held file keeps, screens it again
//! and releases it: the mount sends it at once and it is applied.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use awcp_ctl::daemon::DaemonConfig;
use awcp_ctl::daemon::aecp::DeclareRequest;
use awcp_ctl::executor::ExecutorConfig;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{eventually, fuse_available, request};

const WAIT: Duration = Duration::from_secs(60);

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The lines of `.aecp/violations` (or any NDJSON file).
fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read(path)
        .unwrap_or_default()
        .split(|c| *c == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("one JSON object per line"))
        .collect()
}

fn declare(worker: &str, iface: &str) -> DeclareRequest {
    DeclareRequest {
        worker: worker.to_owned(),
        module: "pkg/acct.py".into(),
        interface: Some(iface.to_owned()),
        contract: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_write_back_survives_a_restart_and_a_revision_releases_it() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    awcp_tests::open_to_agents(tmp.path());
    let ws = tmp.path().join("ws");
    std::fs::create_dir_all(ws.join("pkg")).unwrap();
    std::fs::write(ws.join("pkg/__init__.py"), "").unwrap();
    let mut ecfg = ExecutorConfig::new("sleep 600".into(), tmp.path().join("executor"));
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    let executor = awcp_ctl::executor::start(ecfg).await.unwrap();
    let mut dcfg = DaemonConfig::new(tmp.path().join("delegator"));
    // The same addresses after the restart: the mount reconnects to them.
    dcfg.listen = free_addr();
    dcfg.export_listen = free_addr();
    dcfg.executor_token = executor.executor.credential().map(str::to_owned);
    let daemon = awcp_ctl::daemon::start(dcfg.clone()).await.unwrap();
    let client = daemon.client();
    let id = client
        .delegate(&request(
            executor.awcp_url(),
            &[("workspace", &ws, AccessMode::Rw)],
            600,
        ))
        .await
        .unwrap()
        .delegation_id
        .as_str()
        .to_string();
    let mount = tmp.path().join("executor/work").join(&id);
    assert!(
        eventually(WAIT, || mount.join("pkg/__init__.py").exists()).await,
        "mount not up"
    );
    client
        .aecp_declare(
            &declare(&id, "def open_account(owner: str) -> int: ...\n"),
            false,
        )
        .await
        .expect("declare");
    assert!(
        eventually(WAIT, || mount.join("pkg/acct.py").exists()).await,
        "the stub never reached the mount"
    );

    // A mismatching implementation (`name` where `owner` is declared): held.
    let implementation = "def open_account(name: str) -> int:\n    return len(name)\n";
    std::fs::write(mount.join("pkg/acct.py"), implementation).unwrap();
    let violations = mount.join(".aecp/violations");
    let held =
        |v: &serde_json::Value| v["module"] == "pkg/acct.py" && v["violation"]["held"] == true;
    assert!(
        eventually(WAIT, || json_lines(&violations).iter().any(held)).await,
        "the mismatching write-back was not held: {:?}",
        json_lines(&violations)
    );
    let stub_text = std::fs::read_to_string(ws.join("pkg/acct.py")).unwrap();
    assert!(
        stub_text.contains("__aecp_stub__"),
        "the held file reached the Delegator"
    );

    // The daemon restarts.
    daemon.stop().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let daemon = awcp_ctl::daemon::start(dcfg).await.unwrap();
    let listed = client.aecp_violations(&id, false).await.unwrap();
    assert_eq!(
        listed.len(),
        1,
        "the report survived the restart: {listed:?}"
    );
    assert_eq!(listed[0].report["held"], true);
    // Still held after the restart: the Delegator keeps the stub.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        std::fs::read_to_string(ws.join("pkg/acct.py"))
            .unwrap()
            .contains("__aecp_stub__")
    );

    // The producer revises the contract to what it wrote: the held file now keeps it, is
    // released without being touched, and is applied.
    let r = client
        .aecp_declare(
            &declare(&id, "def open_account(name: str) -> int: ...\n"),
            true,
        )
        .await
        .expect("revise");
    assert_eq!(r.revision, 2);
    assert!(
        eventually(WAIT, || std::fs::read_to_string(ws.join("pkg/acct.py"))
            .is_ok_and(|t| t == implementation))
        .await,
        "the revision did not release the held write-back: the Delegator has {:?}",
        std::fs::read_to_string(ws.join("pkg/acct.py"))
    );
    assert!(
        eventually(WAIT, || !json_lines(&violations).iter().any(held)).await,
        "the mount still shows the file held: {:?}",
        json_lines(&violations)
    );
    assert!(client.aecp_violations(&id, false).await.unwrap().is_empty());
    let verdicts: Vec<_> = client
        .aecp_audit(&id)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "verdict")
        .map(|e| e.detail["verdict"]["on"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(
        verdicts.iter().any(|on| on == "revision"),
        "the re-screen is in the audit log: {verdicts:?}"
    );

    client.revoke(&id, false).await.unwrap();
    executor.stop().await;
    daemon.stop().await;
}
