//! `awcp-ctl status` of a delegation whose mount cannot write back: it says so, with the
//! error, while the Delegator's data plane is blackholed, and stops saying so once the
//! change went through. (Regression: the status said nothing while every sync round failed.)

use std::process::Output;
use std::time::{Duration, Instant};

use awcpfs::testing::fuse_available;
use awcpfs::testing::proxy::FaultProxy;

const BIN: &str = env!("CARGO_BIN_EXE_awcp-ctl");

async fn cli(daemon: &str, args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("--daemon").arg(daemon).args(args);
    tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the CLI hung")
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn is_mounted(p: &std::path::Path) -> bool {
    let s = p.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(s.as_str()))
}

async fn wait_until(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn status_says_not_synced_while_write_back_fails() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // The agents' user passes through to the Executor's work directory (0711).
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .unwrap();
    // The data plane listens on a port of its own; mounts reach it through the proxy.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into()).unwrap();
    let mut dcfg = awcp_ctl::daemon::DaemonConfig::new(tmp.path().join("delegator"));
    dcfg.listen = "127.0.0.1:0".parse().unwrap();
    dcfg.export_listen = ([127, 0, 0, 1], port).into();
    dcfg.export_url = Some(proxy.url());
    // The Executor's credential, handed to the daemon (`serve --executor-token-file`).
    dcfg.executor_token = Some("test-executor-credential".into());
    let daemon = awcp_ctl::daemon::start(dcfg).await.unwrap();
    let mut ecfg = awcp_ctl::executor::ExecutorConfig::new(
        "echo before > before.txt; sleep 120".into(),
        tmp.path().join("executor"),
    );
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    ecfg.read_timeout = Duration::from_secs(2);
    ecfg.token = Some("test-executor-credential".into());
    let executor = awcp_ctl::executor::start(ecfg).await.unwrap();
    let ws = tmp.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let url = daemon.token_url();
    let out = cli(
        &url,
        &[
            "--json",
            "delegate",
            ws.to_str().unwrap(),
            "--to",
            &executor.awcp_url(),
            "--task",
            "write while the network is down",
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let first: serde_json::Value =
        serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    let id = first["delegationId"].as_str().unwrap().to_string();
    let mnt = tmp.path().join("executor/work").join(&id);
    wait_until(
        "the agent's first write",
        Duration::from_secs(30),
        async || ws.join("before.txt").exists(),
    )
    .await;
    assert!(is_mounted(&mnt));

    proxy.set_blackhole(true);
    std::fs::write(mnt.join("during.txt"), "written during the outage\n").unwrap();
    let mut said = String::new();
    wait_until(
        "status to say NOT SYNCED",
        Duration::from_secs(30),
        async || {
            said = stdout(&cli(&url, &["status", &id]).await);
            said.contains("NOT SYNCED")
        },
    )
    .await;
    assert!(said.contains("cannot reach the export"), "{said}");
    assert!(!ws.join("during.txt").exists());

    proxy.set_blackhole(false);
    wait_until(
        "the change at the Delegator",
        Duration::from_secs(30),
        async || ws.join("during.txt").exists(),
    )
    .await;
    wait_until(
        "status to stop saying NOT SYNCED",
        Duration::from_secs(15),
        async || {
            said = stdout(&cli(&url, &["status", &id]).await);
            said.contains("mount ") && !said.contains("NOT SYNCED")
        },
    )
    .await;
    let out = cli(&url, &["revoke", &id]).await;
    assert!(out.status.success(), "{out:?}");
    executor.stop().await;
    daemon.stop().await;
}
