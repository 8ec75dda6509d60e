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
    // The test runs as the daemon's user, whom the kernel would vouch for: the token path
    // is what this checks.
    cfg.trust_local_uid = false;
    let d = awcp_ctl::daemon::start(cfg).await.unwrap();
    let run = |token: Option<&'static str>| {
        let url = d.url();
        async move {
            let mut c = tokio::process::Command::new(BIN);
            c.args(["--daemon", &url, "--json", "doctor"])
                .env_remove("AWCP_API_TOKEN")
                // No token file of another daemon on this machine is found instead.
                .env("AWCP_STATE_DIR", "/nonexistent/awcp-doctor-test");
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

/// Run `doctor --json` against `url` with `env`, return its checks by name.
async fn doctor_checks(url: &str, env: &[(&str, &std::path::Path)]) -> serde_json::Value {
    let mut c = tokio::process::Command::new(BIN);
    c.args(["--daemon", url, "--json", "doctor"])
        .env_remove("AWCP_API_TOKEN");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().await.unwrap();
    let mut by_name = serde_json::Map::new();
    for l in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        by_name.insert(v["check"].as_str().unwrap().to_string(), v);
    }
    serde_json::Value::Object(by_name)
}

// Issue 18: doctor said nothing of an open daemon API or world-readable state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_reports_the_credential_mode_and_the_state_file_modes() {
    use std::os::unix::fs::PermissionsExt as _;
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("d");
    let mut cfg = awcp_ctl::daemon::DaemonConfig::new(state.clone());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.export_listen = "127.0.0.1:0".parse().unwrap();
    let d = awcp_ctl::daemon::start(cfg).await.unwrap();
    let exec = tmp.path().join("e");
    let env = [
        ("AWCP_STATE_DIR", state.as_path()),
        ("AWCP_EXECUTOR_DIR", exec.as_path()),
    ];
    let checks = doctor_checks(&d.url(), &env).await;
    // It found the token file by itself, through AWCP_STATE_DIR.
    assert_eq!(checks["daemon"]["status"], "ok", "{checks}");
    assert_eq!(checks["daemon credential"]["status"], "ok", "{checks}");
    assert_eq!(checks["file modes"]["status"], "ok", "{checks}");
    assert!(checks["mount access"]["status"].is_string(), "{checks}");
    // A state directory someone opened up is a warning that names it.
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    let checks = doctor_checks(&d.url(), &env).await;
    assert_eq!(checks["file modes"]["status"], "warn", "{checks}");
    assert!(
        checks["file modes"]["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("{} (755)", state.display())),
        "{checks}"
    );
    d.stop().await;

    // A daemon without any credential is a warning.
    let mut cfg = awcp_ctl::daemon::DaemonConfig::new(tmp.path().join("open"));
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.export_listen = "127.0.0.1:0".parse().unwrap();
    cfg.unsafe_no_auth = true;
    let open = awcp_ctl::daemon::start(cfg).await.unwrap();
    assert!(open.api_token().is_none());
    let checks = doctor_checks(&open.url(), &env).await;
    assert_eq!(checks["daemon credential"]["status"], "warn", "{checks}");
    assert!(
        checks["daemon credential"]["fix"]
            .as_str()
            .unwrap()
            .contains("--unsafe-no-auth"),
        "{checks}"
    );
    open.stop().await;
}

// Issue 34: with a list of daemons, doctor checked only the first URL (and read the list
// as one URL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_checks_every_daemon_of_a_list() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = awcp_ctl::daemon::DaemonConfig::new(tmp.path().join("d"));
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.export_listen = "127.0.0.1:0".parse().unwrap();
    cfg.api_token = Some("tok".into());
    cfg.trust_local_uid = false;
    let d = awcp_ctl::daemon::start(cfg).await.unwrap();
    let dead = format!("http://127.0.0.1:{}", free_port());
    let run = |list: String, token: &'static str| async move {
        let out = tokio::process::Command::new(BIN)
            .args(["--daemon", &list, "--json", "doctor"])
            .env("AWCP_API_TOKEN", token)
            .env("AWCP_STATE_DIR", "/nonexistent/awcp-doctor-test")
            .output()
            .await
            .unwrap();
        let mut by_name = serde_json::Map::new();
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            by_name.insert(v["check"].as_str().unwrap().to_string(), v);
        }
        serde_json::Value::Object(by_name)
    };
    let list = format!("{},{dead}", d.url());
    let checks = run(list.clone(), "tok").await;
    // Each URL has its own check: the live one answers and takes the token, and says it
    // keeps state of its own; the dead one is a warning, since the client uses the other.
    let live = &checks[format!("daemon {}", d.url())];
    assert_eq!(live["status"], "ok", "{checks:#}");
    assert!(
        live["detail"]
            .as_str()
            .unwrap()
            .contains("state of its own"),
        "{live}"
    );
    assert_eq!(
        checks[format!("daemon credential {}", d.url())]["status"],
        "ok",
        "{checks:#}"
    );
    let down = &checks[format!("daemon {dead}")];
    assert_eq!(down["status"], "warn", "{checks:#}");
    assert!(
        down["detail"].as_str().unwrap().contains("cannot reach"),
        "{down}"
    );
    // Together: not a fleet — a client failing over to a daemon with its own state would
    // find other delegations.
    let fleet = &checks["daemons"];
    assert_eq!(fleet["status"], "warn", "{checks:#}");
    assert!(
        fleet["detail"]
            .as_str()
            .unwrap()
            .contains("state of its own"),
        "{fleet}"
    );
    assert!(
        fleet["fix"].as_str().unwrap().contains("postgres"),
        "{fleet}"
    );
    // A wrong token fails at every daemon that answers.
    let checks = run(list, "wrong").await;
    assert_eq!(
        checks[format!("daemon {}", d.url())]["status"],
        "fail",
        "{checks:#}"
    );
    // Nothing answers: each URL fails, and so does the list.
    let checks = run(format!("{dead},{dead}/"), "tok").await;
    assert_eq!(checks["daemons"]["status"], "fail", "{checks:#}");
    assert_eq!(checks[format!("daemon {dead}")]["status"], "fail");
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

// Issue 29: `doctor` said "ok" of an Executor that ran agents for anyone, and "all
// private" of 0644 staging files and archive bases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_warns_of_an_open_executor_and_checks_the_credential_and_staging_files() {
    use std::os::unix::fs::PermissionsExt as _;
    if !std::path::Path::new("/dev/fuse").exists() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI needs /dev/fuse"
        );
        eprintln!("\n!!!!!!!! SKIPPING: no /dev/fuse (an Executor needs it to start) !!!!!!!!\n");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("d");
    let mut cfg = awcp_ctl::daemon::DaemonConfig::new(state.clone());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.export_listen = "127.0.0.1:0".parse().unwrap();
    let d = awcp_ctl::daemon::start(cfg).await.unwrap();
    let start = |open: bool, dir: std::path::PathBuf| async move {
        let mut c = awcp_ctl::executor::ExecutorConfig::new("true".into(), dir);
        c.listen = "127.0.0.1:0".parse().unwrap();
        c.unsafe_open = open;
        awcp_ctl::executor::start(c).await.unwrap()
    };
    let run = |url: String, exec_dir: std::path::PathBuf, executor: String| {
        let state = state.clone();
        async move {
            let mut c = tokio::process::Command::new(BIN);
            c.args([
                "--daemon",
                &url,
                "--json",
                "doctor",
                "--executor",
                &executor,
            ])
            .env_remove("AWCP_API_TOKEN")
            .env_remove("AWCP_EXECUTOR_TOKEN")
            .env("AWCP_STATE_DIR", &state)
            .env("AWCP_EXECUTOR_DIR", &exec_dir);
            let out = c.output().await.unwrap();
            let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            let get = |name: &str| {
                lines
                    .iter()
                    .find(|c| c["check"].as_str().unwrap().starts_with(name))
                    .cloned()
                    .unwrap()
            };
            (get("executor "), get("file modes"))
        }
    };
    let open = start(true, tmp.path().join("open")).await;
    let (e, _) = run(d.url(), tmp.path().join("open"), open.awcp_url()).await;
    assert_eq!(e["status"], "warn", "{e}");
    assert!(
        e["detail"].as_str().unwrap().contains("--unsafe-open"),
        "{e}"
    );
    open.stop().await;
    // A default Executor: its credential, found in its directory, is taken.
    let dir = tmp.path().join("e");
    let secure = start(false, dir.clone()).await;
    let (e, modes) = run(d.url(), dir.clone(), secure.awcp_url()).await;
    assert_eq!(e["status"], "ok", "{e}");
    assert_eq!(modes["status"], "ok", "{modes}");
    // A credential file or a staged file someone opened up is named.
    let cred = dir.join("state/executor-token");
    std::fs::set_permissions(&cred, std::fs::Permissions::from_mode(0o644)).unwrap();
    let staged = state.join("staging/exp_1");
    std::fs::create_dir_all(&staged).unwrap();
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(staged.join("block"), "x").unwrap();
    std::fs::set_permissions(staged.join("block"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let (_, modes) = run(d.url(), dir.clone(), secure.awcp_url()).await;
    assert_eq!(modes["status"], "warn", "{modes}");
    let detail = modes["detail"].as_str().unwrap();
    assert!(detail.contains("executor-token (644)"), "{detail}");
    assert!(detail.contains("block (644)"), "{detail}");
    secure.stop().await;
    d.stop().await;
}
