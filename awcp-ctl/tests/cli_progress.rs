//! Progress bars stay off piped and `--json` output: `delegate --wait`, `revoke --wait`
//! and `close --wait` print only their lines (one JSON object per line with `--json`), and
//! nothing of a bar reaches stderr when it is not a terminal.

use std::process::Output;
use std::time::Duration;

use awcpfs::testing::fuse_available;

const BIN: &str = env!("CARGO_BIN_EXE_awcp-ctl");

async fn cli(daemon: &str, args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("--daemon")
        .arg(daemon)
        .args(args)
        .env_remove("AWCP_LOG");
    tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the CLI hung")
        .unwrap()
}

/// No carriage returns, escape sequences or bar glyphs: what a progress bar would leave.
fn assert_no_bar(what: &str, bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    for noise in ["\r", "\x1b[", "hashed", "hydrating", "final sync", "[="] {
        assert!(!text.contains(noise), "{what} has {noise:?}: {text:?}");
    }
}

/// Every stdout line is one JSON object.
fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}"));
            assert!(v.is_object(), "not an object: {l}");
            v
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn json_and_piped_output_carry_no_progress_noise() {
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
    // With two resources the agent runs above them; with one, in it (and does nothing).
    let agent = "set -e; if test -d data; then cat data/in.txt > src/out.txt; fi";
    let mut ecfg =
        awcp_ctl::executor::ExecutorConfig::new(agent.into(), tmp.path().join("executor"));
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    ecfg.token = Some("test-executor-credential".into());
    let executor = awcp_ctl::executor::start(ecfg).await.unwrap();
    let src = tmp.path().join("src");
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("in.txt"), "input\n").unwrap();
    let (url, to) = (daemon.token_url(), executor.awcp_url());
    let data_arg = format!("data={}:ro", data.display());
    let args = [
        "delegate",
        src.to_str().unwrap(),
        "--name",
        "src",
        "--resource",
        &data_arg,
        "--to",
        &to,
        "--task",
        "copy",
        "--wait",
    ];

    // --json: one object per line, the first the id, the rest the history; stderr clean.
    let mut json_args = vec!["--json"];
    json_args.extend(args);
    let out = cli(&url, &json_args).await;
    assert!(out.status.success(), "{out:?}");
    let lines = json_lines(&out);
    let id = lines[0]["delegationId"].as_str().expect("the id first");
    assert!(lines.len() > 2, "{lines:?}");
    assert_no_bar("stdout", &out.stdout);
    assert_no_bar("stderr", &out.stderr);
    assert_eq!(
        std::fs::read_to_string(src.join("out.txt")).unwrap(),
        "input\n"
    );
    // The setup's figures are in the record (two resources, one file between them).
    let status = cli(&url, &["--json", "status", id]).await;
    let v = &json_lines(&status)[0];
    assert_eq!(v["progress"]["manifest"]["filesTotal"], 1, "{v}");
    assert_eq!(v["progress"]["resources"][1]["name"], "data", "{v}");
    assert_eq!(v["progress"]["phase"], "ended", "{v}");

    // Piped text output: plain lines, no bar either.
    let out = cli(&url, &args).await;
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("delegated "));
    assert_no_bar("stderr", &out.stderr);

    // close --wait / revoke --wait with --json: one object with the final sync.
    let one_round = [
        "--json",
        "delegate",
        src.to_str().unwrap(),
        "--to",
        &to,
        "--task",
        "t",
        "--multi-round",
        "--wait",
    ];
    let out = cli(&url, &one_round).await;
    assert!(out.status.success(), "{out:?}");
    let id = json_lines(&out)[0]["delegationId"]
        .as_str()
        .unwrap()
        .to_string();
    let out = cli(&url, &["--json", "close", &id, "--wait", "30s"]).await;
    assert!(out.status.success(), "{out:?}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["finalSync"]["ended"], true, "{lines:?}");
    assert_no_bar("stderr", &out.stderr);
    executor.stop().await;
    daemon.stop().await;
}

/// On a terminal, `delegate` shows the setup bar: run it under `script` (a pseudo-terminal)
/// against an "executor" that never answers INVITE, so the bar is on screen for as long as
/// the test needs to read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_terminal_gets_the_setup_bar() {
    use std::io::Read as _;
    if !std::path::Path::new("/usr/bin/script").exists() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "`script` (util-linux) is needed to give the CLI a terminal"
        );
        awcpfs::testing::skipped("the progress-bar test (script)", "apt-get install bsdutils");
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
    let ws = tmp.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "abc\n").unwrap();
    let hang = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let to = format!("http://{}/awcp", hang.local_addr().unwrap());
    let acceptor = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = hang.accept().await {
            held.push(sock);
        }
    });
    let command = format!(
        "{BIN} --daemon {} delegate {} --to {to} --task t",
        daemon.token_url(),
        ws.display()
    );
    let mut child = std::process::Command::new("/usr/bin/script")
        .args(["-qfec", &command, "/dev/null"])
        .env_remove("AWCP_LOG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
            if String::from_utf8_lossy(&seen).contains("inviting the executor") {
                break;
            }
        }
        String::from_utf8_lossy(&seen).into_owned()
    });
    let screen = tokio::task::spawn_blocking(move || reader.join().unwrap())
        .await
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    acceptor.abort();
    assert!(
        screen.contains("1 file(s) (4 bytes) exported; inviting the executor"),
        "no setup bar on the terminal: {screen:?}"
    );
    assert!(
        screen.contains('\r') || screen.contains("\x1b["),
        "{screen:?}"
    );
    daemon.stop().await;
}
