//! Fleet as a command: `awcp-ctl delegate DIR --to A --to-file FILE --wait` delegates one
//! workspace to two Executors and waits for both; `status ID ID` shows them with totals that
//! add up to each one's, and `wait ID ID` returns the worst end. (Issue 34: a fleet was N
//! separate `delegate` calls, documented only through the benchmark harness.)
//!
//! Skipped loudly where FUSE is missing, failed under `CI=true`.

use std::process::Command;

use awcp_ctl::executor::ExecutorConfig;
use awcp_tests::fleet::awcp_ctl_bin;
use awcp_tests::{Harness, fuse_available, sample_repo};

const AGENT: &str = "cat README.md > /dev/null && sleep 1";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delegate_to_two_executors_with_one_status_and_wait() {
    if !fuse_available() {
        return;
    }
    let bin =
        awcp_ctl_bin().expect("the awcp-ctl binary beside the tests (cargo build -p awcp-ctl)");
    let h = Harness::start(AGENT).await;
    // A second Executor with the same credential (the daemon holds one for both, as
    // `serve --executor-token-file` does).
    let mut cfg = ExecutorConfig::new(AGENT.to_string(), h.path("executor2"));
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.token = Some(h.credential());
    let second = awcp_ctl::executor::start(cfg).await.unwrap();
    let (e1, e2) = (h.executor.awcp_url(), second.awcp_url());

    let repo = h.path("repo");
    sample_repo(&repo);
    let token_file = h.path("api-token");
    std::fs::write(&token_file, h.daemon.api_token().unwrap()).unwrap();
    let list = h.path("fleet.txt");
    std::fs::write(&list, format!("# the second Executor\n{e2}\n")).unwrap();
    let ctl = |args: &[&str]| {
        let out = Command::new(&bin)
            .arg("--daemon")
            .arg(h.daemon.url())
            .arg("--api-token-file")
            .arg(&token_file)
            .args(args)
            .env_remove("AWCP_DAEMON_URL")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    let repo_s = repo.display().to_string();
    let list_s = list.display().to_string();
    let (code, stdout, stderr) = tokio::task::block_in_place(|| {
        ctl(&[
            "--json",
            "delegate",
            &repo_s,
            "--to",
            &e1,
            "--to-file",
            &list_s,
            "--task",
            "read",
            "--wait",
        ])
    });
    assert_eq!(code, Some(0), "stdout: {stdout}\nstderr: {stderr}");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let delegated: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["delegationId"].is_string() && l["executorUrl"].is_string())
        .collect();
    assert_eq!(delegated.len(), 2, "{stdout}");
    assert_eq!(delegated[0]["executorUrl"], e1.as_str());
    assert_eq!(delegated[1]["executorUrl"], e2.as_str());
    let ids: Vec<String> = delegated
        .iter()
        .map(|l| l["delegationId"].as_str().unwrap().to_string())
        .collect();
    assert_ne!(ids[0], ids[1]);
    let ended: Vec<&serde_json::Value> = lines.iter().filter(|l| l["state"].is_string()).collect();
    assert_eq!(ended.len(), 2, "--wait reports each end: {stdout}");
    assert!(ended.iter().all(|l| l["state"] == "completed"), "{stdout}");
    // Each ran on its own Executor.
    for (id, url) in ids.iter().zip([&e1, &e2]) {
        let v = h.client.get(id).await.unwrap();
        assert_eq!(&v.record.peer_url, url);
    }

    // One status view: each delegation, and totals that are their sums.
    let (code, stdout, stderr) =
        tokio::task::block_in_place(|| ctl(&["--json", "status", &ids[0], &ids[1]]));
    assert_eq!(code, Some(0), "{stderr}");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    let served: u64 = lines[..2]
        .iter()
        .map(|v| v["transfer"]["bytesServed"].as_u64().unwrap_or(0))
        .sum();
    assert!(served > 0, "both agents read README.md: {stdout}");
    let fleet = &lines[2]["fleet"];
    assert_eq!(fleet["delegations"], 2);
    assert_eq!(fleet["states"]["completed"], 2);
    assert_eq!(fleet["bytesServed"].as_u64(), Some(served));
    let (code, text, _) = tokio::task::block_in_place(|| ctl(&["status", &ids[0], &ids[1]]));
    assert_eq!(code, Some(0));
    assert!(text.contains(&ids[0]) && text.contains(&ids[1]), "{text}");
    assert!(
        text.contains("total: 2 delegation(s): 2 completed"),
        "{text}"
    );

    // `wait` across them: both ended, completed: 0.
    let (code, text, stderr) = tokio::task::block_in_place(|| ctl(&["wait", &ids[0], &ids[1]]));
    assert_eq!(code, Some(0), "{text}{stderr}");
    assert_eq!(text.matches(" completed (").count(), 2, "{text}");

    // An Executor named twice is refused before anything is delegated.
    let before = h.client.list().await.unwrap().delegations.len();
    let (code, _, stderr) = tokio::task::block_in_place(|| {
        ctl(&[
            "delegate",
            &repo_s,
            "--to",
            &e2,
            "--to-file",
            &list_s,
            "--task",
            "x",
        ])
    });
    assert_eq!(code, Some(1));
    assert!(stderr.contains("named twice"), "{stderr}");
    assert_eq!(h.client.list().await.unwrap().delegations.len(), before);
    // An unknown id in a fleet view: said, and exit 1.
    let (code, text, _) = tokio::task::block_in_place(|| {
        ctl(&["status", &ids[0], "dlg_00000000000000000000000000000000"])
    });
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("1 unknown"), "{text}");

    second.stop().await;
    h.stop().await;
}
