//! The CLI around staged snapshots: `delegate --transport archive --snapshot-mode staged
//! --wait`, then `snapshots`, `diff`, `apply`, `discard`, with and without `--json`.

use std::process::Output;
use std::time::Duration;

use awcpfs::testing::fuse_available;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn staged_snapshots_are_listed_diffed_applied_and_discarded_from_the_cli() {
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
    let mut dcfg = awcp_ctl::daemon::DaemonConfig::new(tmp.path().join("delegator"));
    dcfg.listen = "127.0.0.1:0".parse().unwrap();
    dcfg.export_listen = "127.0.0.1:0".parse().unwrap();
    // The Executor's credential, handed to the daemon (`serve --executor-token-file`).
    dcfg.executor_token = Some("test-executor-credential".into());
    let daemon = awcp_ctl::daemon::start(dcfg).await.unwrap();
    // With one resource the agent's working directory is that resource.
    let agent = "set -e; echo changed > a.txt; echo new > b.txt; rm gone.txt";
    let mut ecfg =
        awcp_ctl::executor::ExecutorConfig::new(agent.into(), tmp.path().join("executor"));
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    ecfg.token = Some("test-executor-credential".into());
    let executor = awcp_ctl::executor::start(ecfg).await.unwrap();
    let ws = tmp.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "original\n").unwrap();
    std::fs::write(ws.join("gone.txt"), "bye\n").unwrap();
    // Its token in the path, as a client that sends no headers would have it.
    let url = daemon.token_url();
    let to = executor.awcp_url();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let out = cli(
            &url,
            &[
                "--json",
                "delegate",
                ws.to_str().unwrap(),
                "--to",
                &to,
                "--transport",
                "archive",
                "--snapshot-mode",
                "staged",
                "--task",
                "change things",
                "--wait",
            ],
        )
        .await;
        assert!(out.status.success(), "{out:?}");
        let first: serde_json::Value =
            serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
        ids.push(first["delegationId"].as_str().unwrap().to_string());
    }
    // Nothing applied yet.
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "original\n"
    );
    let out = cli(&url, &["snapshots", &ids[0], "--json"]).await;
    assert!(out.status.success(), "{out:?}");
    let snap: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(snap["status"], "pending");
    let out = cli(&url, &["diff", &ids[0]]).await;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout(&out),
        "M workspace/a.txt\nA workspace/b.txt\nD workspace/gone.txt\n"
    );
    let out = cli(&url, &["apply", &ids[0]]).await;
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout(&out).contains("2 file(s) written, 1 deleted, 0 conflict(s)"),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "changed\n"
    );
    assert_eq!(std::fs::read_to_string(ws.join("b.txt")).unwrap(), "new\n");
    assert!(!ws.join("gone.txt").exists());
    // Nothing pending any more: a clear error, exit 1.
    let out = cli(&url, &["apply", &ids[0]]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no pending snapshot"));
    // The second delegation's snapshot is discarded, unapplied.
    let out = cli(&url, &["--json", "discard", &ids[1]]).await;
    assert!(out.status.success(), "{out:?}");
    let out = cli(&url, &["snapshots", &ids[1]]).await;
    assert!(stdout(&out).contains("discarded"), "{}", stdout(&out));
    executor.stop().await;
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_awcpfs_change_set_is_diffed_as_patches_from_the_cli() {
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
    let mut dcfg = awcp_ctl::daemon::DaemonConfig::new(tmp.path().join("delegator"));
    dcfg.listen = "127.0.0.1:0".parse().unwrap();
    dcfg.export_listen = "127.0.0.1:0".parse().unwrap();
    // The Executor's credential, handed to the daemon (`serve --executor-token-file`).
    dcfg.executor_token = Some("test-executor-credential".into());
    let daemon = awcp_ctl::daemon::start(dcfg).await.unwrap();
    let agent = "set -e; printf 'one\\nTWO\\n' > a.txt; chmod 755 run.sh; printf 'x\\000' > b.bin";
    let mut ecfg =
        awcp_ctl::executor::ExecutorConfig::new(agent.into(), tmp.path().join("executor"));
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    ecfg.token = Some("test-executor-credential".into());
    let executor = awcp_ctl::executor::start(ecfg).await.unwrap();
    let ws = tmp.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "one\ntwo\n").unwrap();
    std::fs::write(ws.join("run.sh"), "#!/bin/sh\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(ws.join("run.sh"), std::fs::Permissions::from_mode(0o644)).unwrap();
    // Its token in the path, as a client that sends no headers would have it.
    let url = daemon.token_url();
    let out = cli(
        &url,
        &[
            "--json",
            "delegate",
            ws.to_str().unwrap(),
            "--to",
            &executor.awcp_url(),
            "--snapshot-mode",
            "staged",
            "--task",
            "change things",
            "--wait",
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let first: serde_json::Value =
        serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    let id = first["delegationId"].as_str().unwrap().to_string();
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "one\ntwo\n"
    );
    let out = cli(&url, &["diff", &id]).await;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout(&out),
        "M workspace/a.txt\n\
         --- a/a.txt\n\
         +++ b/a.txt\n\
         @@ -1,2 +1,2 @@\n \
         one\n\
         -two\n\
         +TWO\n\
         A workspace/b.bin  (binary or large file (2 bytes))\n\
         M workspace/run.sh  (mode 644 → 755)\n"
    );
    let out = cli(&url, &["apply", &id]).await;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "one\nTWO\n"
    );
    executor.stop().await;
    daemon.stop().await;
}
