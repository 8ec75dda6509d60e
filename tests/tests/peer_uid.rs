//! The daemon's own user needs no token on its machine, and no one else gets one by
//! looking (issue 29: the documented way to let the reference's MCP server drive our daemon
//! put `/t/<token>` in its argv, and `nobody` read it from `ps -eo args`).
//!
//! The kernel names each caller — over loopback TCP by sock_diag, over the Unix socket by
//! `SO_PEERCRED` — and the plain daemon URL works for the daemon's uid (the test's, root)
//! while `nobody` (through `setpriv`) gets 401 on both.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use awcp_ctl::daemon::{DaemonConfig, RunningDaemon};
use awcp_tests::fleet::awcp_ctl_bin;
use awcp_tests::hostile::{NOBODY, as_user, curl_as};
use serde_json::{Value, json};

/// A daemon alone (no Executor, no FUSE needed), its Unix socket in a directory every user
/// can reach so that `nobody` is refused by the daemon, not by a directory's mode.
async fn daemon(tmp: &Path, adjust: impl FnOnce(&mut DaemonConfig)) -> RunningDaemon {
    std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    let open = tmp.join("open");
    std::fs::create_dir_all(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = DaemonConfig::new(tmp.join("delegator"));
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.export_listen = "127.0.0.1:0".parse().unwrap();
    cfg.api_socket = Some(open.join("api.sock"));
    adjust(&mut cfg);
    awcp_ctl::daemon::start(cfg).await.unwrap()
}

/// A delegation request for `/etc` to an Executor of the caller's choosing.
fn steal() -> String {
    json!({"executorUrl": "http://127.0.0.1:9/awcp",
        "environment": {"resources": [{"name": "w", "type": "fs", "source": "/etc", "mode": "ro"}]},
        "task": {"description": "steal", "prompt": "steal"}})
    .to_string()
}

fn token_of(d: &RunningDaemon) -> String {
    d.api_token().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plain_url_works_for_the_daemons_user_and_gives_nobody_401() {
    let tmp = tempfile::tempdir().unwrap();
    let d = daemon(tmp.path(), |_| {}).await;
    let api = d.url();
    let sock = d
        .api_socket
        .clone()
        .expect("the daemon serves its Unix socket");
    let sock_s = sock.to_str().unwrap();
    let token = token_of(&d);

    // The daemon's user (this test's uid), plain URL, no token: over TCP loopback...
    let http = reqwest::Client::new();
    let r = http.get(format!("{api}/delegations")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        r.headers()[awcp_ctl::daemon::api::AUTH_HEADER],
        awcp_ctl::daemon::api::AUTH_PEER_UID
    );
    // ...through curl, a process of its own, as the reference's clients are...
    let (s, body) = curl_as(0, &[&format!("{api}/delegations")]);
    assert_eq!(s, 200, "{body}");
    // ...and over the Unix socket.
    let list = d.socket_client().unwrap().list().await.unwrap();
    assert_eq!(list.delegations.len(), 0);
    let (s, body) = curl_as(
        0,
        &["--unix-socket", sock_s, "http://localhost/delegations"],
    );
    assert_eq!(s, 200, "{body}");
    // A wrong token is refused even from the daemon's user: a misconfigured client learns it.
    let r = http
        .get(format!("{api}/delegations"))
        .bearer_auth("not-the-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);

    // nobody: 401 on every route but /health, over TCP and over the socket.
    for base in [vec![api.clone()], vec![]] {
        let over = |path: &str| -> Vec<String> {
            match base.first() {
                Some(b) => vec![format!("{b}{path}")],
                None => vec![
                    "--unix-socket".into(),
                    sock_s.to_string(),
                    format!("http://localhost{path}"),
                ],
            }
        };
        let args = |extra: &[&str], path: &str| -> Vec<String> {
            extra
                .iter()
                .map(|s| s.to_string())
                .chain(over(path))
                .collect()
        };
        let run = |a: Vec<String>| {
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            curl_as(NOBODY, &a)
        };
        let via = if base.is_empty() { "socket" } else { "tcp" };
        let (s, body) = run(args(&[], "/delegations"));
        assert_eq!(s, 401, "{via}: {body}");
        let b: Value = serde_json::from_str(&body).unwrap();
        assert!(
            b["hint"].as_str().unwrap().contains("need no token"),
            "the refusal says who needs none: {b}"
        );
        let (s, body) = run(args(
            &[
                "-X",
                "POST",
                "-H",
                "content-type: application/json",
                "-d",
                &steal(),
            ],
            "/delegate",
        ));
        assert_eq!(s, 401, "{via}: nobody may delegate /etc: {body}");
        let (s, _) = run(args(&[], "/health"));
        assert_eq!(s, 200, "{via}: /health stays open");
        // Another user with the token is let in (the token is for other users and
        // machines)...
        let bearer = format!("Authorization: Bearer {token}");
        let (s, body) = run(args(&["-H", &bearer], "/delegations"));
        assert_eq!(s, 200, "{via}: {body}");
        // ...and so is a client on another machine with it in the path (kept out of argv
        // there: this test only checks that the daemon still takes it).
        let (s, body) = run(args(&[], &format!("/t/{token}/delegations")));
        assert_eq!(s, 200, "{via}: {body}");
    }
    d.stop().await;
    assert!(
        !sock.exists(),
        "the socket is removed when the daemon stops"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_require_token_asks_the_daemons_user_too() {
    let tmp = tempfile::tempdir().unwrap();
    let d = daemon(tmp.path(), |c| c.trust_local_uid = false).await;
    let sock = d.api_socket.clone().unwrap();
    let (s, _) = curl_as(0, &[&format!("{}/delegations", d.url())]);
    assert_eq!(s, 401);
    let (s, _) = curl_as(
        0,
        &[
            "--unix-socket",
            sock.to_str().unwrap(),
            "http://localhost/delegations",
        ],
    );
    assert_eq!(s, 401);
    let (s, _) = curl_as(
        0,
        &[
            "-H",
            &format!("Authorization: Bearer {}", token_of(&d)),
            &format!("{}/delegations", d.url()),
        ],
    );
    assert_eq!(s, 200);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_socket_sits_in_the_private_state_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let d = daemon(tmp.path(), |c| c.api_socket = None).await;
    let sock = d.api_socket.clone().unwrap();
    assert_eq!(sock, tmp.path().join("delegator").join("api.sock"));
    // nobody cannot even reach it: the state directory is 0700.
    let out = as_user(
        NOBODY,
        &[
            "curl",
            "-s",
            "--unix-socket",
            sock.to_str().unwrap(),
            "http://localhost/delegations",
        ],
    );
    assert!(!out.status.success(), "nobody connected to {sock:?}");
    assert!(String::from_utf8_lossy(&out.stdout).is_empty());
    d.stop().await;
}

/// Every `ps -eo args` line `uid` can see.
fn ps_args_as(uid: u32) -> String {
    let out = as_user(uid, &["ps", "-eo", "args"]);
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One JSON-RPC request to an MCP server on stdio, its answer.
async fn mcp_call(
    stdin: &mut tokio::process::ChildStdin,
    stdout: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    id: u64,
    method: &str,
    params: Value,
) -> Value {
    use tokio::io::AsyncWriteExt as _;
    let msg = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
    stdin
        .write_all(format!("{msg}\n").as_bytes())
        .await
        .unwrap();
    stdin.flush().await.unwrap();
    loop {
        let line = tokio::time::timeout(Duration::from_secs(30), stdout.next_line())
            .await
            .expect("no answer from the MCP server")
            .unwrap()
            .expect("the MCP server closed stdout");
        let v: Value = serde_json::from_str(&line).unwrap();
        if v["id"] == id {
            return v;
        }
    }
}

// Issue 29: `nobody` took the daemon's token from the MCP server's argv in `ps`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_in_ps_for_the_documented_mcp_configurations() {
    let Some(bin) = awcp_ctl_bin() else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "this test needs the awcp-ctl binary beside the tests (cargo nextest run --workspace builds it)"
        );
        eprintln!(
            "\n!!!!!!!! SKIPPING the ps test: no awcp-ctl binary beside the tests (cargo build -p awcp-ctl) !!!!!!!!\n"
        );
        return;
    };
    use tokio::io::AsyncBufReadExt as _;
    let tmp = tempfile::tempdir().unwrap();
    let d = daemon(tmp.path(), |_| {}).await;
    let token = token_of(&d);
    // Ours, as CONFIGURATION.md documents it: `awcp-ctl mcp --daemon <plain URL>`, no token
    // anywhere (no token file either: another state directory).
    let mut mcp = tokio::process::Command::new(&bin)
        .args(["mcp", "--daemon", &d.url()])
        .env_remove("AWCP_API_TOKEN")
        .env("AWCP_STATE_DIR", tmp.path().join("elsewhere"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = mcp.stdin.take().unwrap();
    let mut stdout = tokio::io::BufReader::new(mcp.stdout.take().unwrap()).lines();
    let init = mcp_call(
        &mut stdin,
        &mut stdout,
        1,
        "initialize",
        json!({"protocolVersion": "2024-11-05", "capabilities": {},
               "clientInfo": {"name": "peer-uid-test", "version": "0"}}),
    )
    .await;
    assert!(init["result"].is_object(), "{init}");
    {
        use tokio::io::AsyncWriteExt as _;
        stdin
            .write_all(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}\n")
            .await
            .unwrap();
    }
    // It drives the daemon: a tool that asks the daemon for its delegations.
    let r = mcp_call(
        &mut stdin,
        &mut stdout,
        2,
        "tools/call",
        json!({"name": "delegate_cancel", "arguments": {"all": true}}),
    )
    .await;
    assert_ne!(r["result"]["isError"], true, "{r}");
    let text = r["result"]["content"][0]["text"].as_str().unwrap_or("");
    assert!(!text.contains("Unauthorized"), "{r}");
    // The reference's MCP server, as SECURITY.md documents it: `awcp-mcp --daemon-url
    // <plain URL>`; its `DelegatorDaemonClient` sends `GET <daemonUrl><path>` with no header.
    // Stood in for by a process with that argv making that request.
    let ref_client = std::process::Command::new("sh")
        .args([
            "-c",
            "exec curl -s -o /dev/null -w '%{http_code}' \"$1/delegations\"; : awcp-mcp",
            "awcp-mcp",
            &d.url(),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&ref_client.stdout), "200");
    let mut held = {
        use std::os::unix::process::CommandExt as _;
        std::process::Command::new("sh")
            .args(["-c", "sleep 30; :", "awcp-mcp", "--daemon-url", &d.url()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap()
    };

    // What nobody sees: both processes, and no token.
    let seen = ps_args_as(NOBODY);
    assert!(
        seen.contains(&format!("mcp --daemon {}", d.url())),
        "ps shows the MCP server: {seen}"
    );
    assert!(seen.contains("--daemon-url"), "{seen}");
    assert!(
        !seen.contains(&token),
        "the daemon's token is in ps:\n{seen}"
    );
    // The shell and its sleep, by the group this test made for them.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(held.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = held.wait();
    drop(stdin);
    let _ = mcp.kill().await;
    d.stop().await;
}
