//! `awcp-ctl doctor` finds what is wrong and says how to fix it; `awcp-ctl completions`
//! prints a script for each shell.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_awcp-ctl");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_reports_an_unreachable_daemon_with_a_fix_and_a_reachable_one_as_ok() {
    // Nothing listens here.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let out = tokio::process::Command::new(BIN)
        .args([
            "--daemon",
            &dead,
            "--json",
            "doctor",
            "--executor",
            &format!("{dead}/awcp"),
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let checks: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let daemon = checks.iter().find(|c| c["check"] == "daemon").unwrap();
    assert_eq!(daemon["status"], "fail");
    assert!(
        daemon["fix"].as_str().unwrap().contains("awcp-ctl serve"),
        "{daemon}"
    );
    let exec = checks
        .iter()
        .find(|c| c["check"].as_str().unwrap().starts_with("executor "))
        .unwrap();
    assert_eq!(exec["status"], "fail");
    assert!(checks.iter().any(|c| c["check"] == "fuse device"));
    // A daemon that is there, with a token.
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = awcp_ctl::daemon::DaemonConfig::new(tmp.path().join("d"));
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.export_listen = "127.0.0.1:0".parse().unwrap();
    cfg.api_token = Some("tok".into());
    let d = awcp_ctl::daemon::start(cfg).await.unwrap();
    let run = |token: Option<&'static str>| {
        let url = d.url();
        async move {
            let mut c = tokio::process::Command::new(BIN);
            c.args(["--daemon", &url, "--json", "doctor"])
                .env_remove("AWCP_API_TOKEN");
            if let Some(t) = token {
                c.env("AWCP_API_TOKEN", t);
            }
            let out = c.output().await.unwrap();
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                .find(|c| c["check"] == "daemon")
                .unwrap()
        }
    };
    let without = run(None).await;
    assert_eq!(without["status"], "fail");
    assert!(
        without["fix"].as_str().unwrap().contains("--api-token"),
        "{without}"
    );
    let with = run(Some("tok")).await;
    assert_eq!(with["status"], "ok", "{with}");
    d.stop().await;
}

#[test]
fn completions_are_printed_for_every_shell() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = Command::new(BIN)
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("awcp-ctl") && text.contains("delegate"),
            "{shell}"
        );
    }
}
