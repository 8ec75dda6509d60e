//! The AGLX command-line paths, end to end with the real binary: `serve --notify`,
//! `executor --announce`, `awcp-ctl peers`, and `delegate --to auto`, against an in-process
//! bridge that a monitor watches.

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use aglx_bridge::awcp::TaskAssign;
use aglx_bridge::{Bridge, BridgeConfig, Client, ClientConfig, MessageType, Subscribe};
use awcpfs::testing::fuse_available;

const BIN: &str = env!("CARGO_BIN_EXE_awcp-ctl");

/// Kills the process, then lazily unmounts whatever is left under the directory.
struct Proc(Child, PathBuf);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let prefix = format!("{}/", self.1.display());
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for mp in mounts.lines().filter_map(|l| l.split(' ').nth(4)) {
            if mp.starts_with(&prefix) {
                let _ = nix::mount::umount2(mp, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn run(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || Command::new(BIN).args(&args).output().unwrap())
        .await
        .unwrap()
}

async fn wait_http(url: &str) {
    let start = Instant::now();
    while reqwest::get(url).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{url} never came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn notify_announce_peers_and_delegate_to_auto_from_the_cli() {
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
    let bridge = Bridge::start(BridgeConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        Some("127.0.0.1:0".parse().unwrap()),
    ))
    .await
    .unwrap();
    let bridge_url = format!("aglx://{}", bridge.tcp_addr());
    let mut mc = ClientConfig::new("agent://monitor.ops".parse().unwrap());
    mc.subscribe = Subscribe::All;
    mc.timeout = Duration::from_secs(60);
    let mut monitor = Client::connect(&bridge.tcp_addr().to_string(), mc)
        .await
        .unwrap();

    // The key the Executor signs its announces with, and the Delegator trusts them by.
    let key_file = tmp.path().join("exec.key");
    std::fs::write(&key_file, "executor-zone-key-0123456789abcdef\n").unwrap();
    let (api, export, exec) = (free_port(), free_port(), free_port());
    let daemon = format!("http://127.0.0.1:{api}");
    // The daemon writes its API token there at start.
    let token_file = tmp.path().join("delegator/api-token");
    let _serve = Proc(
        Command::new(BIN)
            .args(["serve", "--listen", &format!("127.0.0.1:{api}")])
            .args(["--export-listen", &format!("127.0.0.1:{export}")])
            .arg("--state-dir")
            .arg(tmp.path().join("delegator"))
            .args(["--notify", &bridge_url, "--credits-per-lease-minute", "1"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
        tmp.path().to_path_buf(),
    );
    let _executor = Proc(
        Command::new(BIN)
            .args(["executor", "--listen", &format!("127.0.0.1:{exec}")])
            .arg("--dir")
            .arg(tmp.path().join("executor"))
            .args(["--agent-cmd", "echo auto > picked.txt"])
            .args(["--announce", &bridge.udp_addr().unwrap().to_string()])
            .arg("--announce-key-file")
            .arg(&key_file)
            .args([
                "--announce-as",
                "agent://exec-9.lab",
                "--announce-interval",
                "1s",
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
        tmp.path().to_path_buf(),
    );
    wait_http(&format!("{daemon}/health")).await;
    wait_http(&format!("http://127.0.0.1:{exec}/awcp/status")).await;

    // peers, through the bridge's registry, once the first announce has landed.
    let start = Instant::now();
    let line = loop {
        let out = run(&["peers", "--bridge", &bridge_url, "--json"]).await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        if let Some(l) = text.lines().next() {
            break l.to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no announce arrived"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let entry: aglx_bridge::registry::Entry = serde_json::from_str(&line).unwrap();
    let awcp_url = format!("http://127.0.0.1:{exec}/awcp");
    assert_eq!(entry.agent.to_string(), "agent://exec-9.lab");
    assert_eq!(entry.announce.awcp_url.as_deref(), Some(awcp_url.as_str()));
    assert_eq!(entry.announce.free_capacity, Some(8));

    assert!(entry.signed, "{line}");

    // Issue 29: nobody announces itself unsigned, with a huge capacity, at an address that
    // would receive the workspace.
    let evil = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    evil.set_nonblocking(true).unwrap();
    let evil_url = format!("http://{}/awcp", evil.local_addr().unwrap());
    let forged = aglx_bridge::Frame::new(aglx_bridge::Transport::Udp, MessageType::AgentAnnounce)
        .from("agent://evil.local".parse().unwrap())
        .json(&aglx_bridge::registry::Announce {
            awcp_url: Some(evil_url.clone()),
            transports: vec!["awcpfs".into()],
            free_capacity: Some(100_000),
            ttl_seconds: Some(600),
            ..Default::default()
        })
        .encode()
        .unwrap();
    let udp = bridge.udp_addr().unwrap();
    let mut send = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "bash",
            "-c",
        ])
        .arg(format!("cat > /dev/udp/{}/{}", udp.ip(), udp.port()))
        .stdin(Stdio::piped())
        .spawn()
        .expect("setpriv (util-linux)");
    {
        use std::io::Write as _;
        send.stdin.take().unwrap().write_all(&forged).unwrap();
    }
    assert!(send.wait().unwrap().success());
    // peers lists it, marked: unsigned; the Executor's is signed with the key we trust.
    let start = Instant::now();
    let listed = loop {
        let out = run(&[
            "peers",
            "--bridge",
            &bridge_url,
            "--json",
            "--trust-key-file",
            key_file.to_str().unwrap(),
        ])
        .await;
        let text = String::from_utf8(out.stdout).unwrap();
        let all: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        if all.len() == 2 {
            break all;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let trust_of = |agent: &str| {
        listed
            .iter()
            .find(|e| e["agent"] == agent)
            .map(|e| e["trust"].clone())
            .unwrap()
    };
    assert_eq!(trust_of("agent://evil.local"), "unsigned");
    assert_eq!(trust_of("agent://exec-9.lab"), "signed");

    let repo = tmp.path().join("repo");
    // The Executor drew its credential there at start; the Delegator presents it.
    let credential = tmp.path().join("executor/state/executor-token");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::write(repo.join("README"), "hi\n").unwrap();
    let delegate_auto = |extra: Vec<String>| {
        let mut args: Vec<String> = [
            "--daemon",
            &daemon,
            "--api-token-file",
            token_file.to_str().unwrap(),
            "delegate",
            repo.to_str().unwrap(),
            "--executor-token-file",
            credential.to_str().unwrap(),
            "--to",
            "auto",
            "--peers-bridge",
            &bridge_url,
            "--ttl",
            "5m",
            "--task",
            "pick me",
            "--wait",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra);
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(&args).await
        }
    };
    // Without a key it trusts, --to auto chooses no one, and says how to fix it.
    let out = delegate_auto(vec![]).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--peers-key-file"), "{err}");
    assert!(!repo.join("picked.txt").exists());

    // delegate --to auto picks the signed one, and the daemon tells the bridge.
    let out = delegate_auto(vec![
        "--peers-key-file".into(),
        key_file.to_str().unwrap().into(),
    ])
    .await;
    assert!(
        evil.accept().is_err(),
        "the unsigned announcer at {evil_url} was contacted"
    );
    assert!(
        out.status.success(),
        "delegate --to auto failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("picked.txt")).unwrap(),
        "auto\n"
    );
    let assign = loop {
        let f = monitor.recv().await.unwrap().decoded.frame;
        if f.msg_type == Some(MessageType::TaskAssign) {
            break f;
        }
    };
    assert_eq!(assign.credits, Some(5));
    let body: TaskAssign = assign.body_as().unwrap();
    assert_eq!(body.executor_url, awcp_url);
    assert_eq!(body.description, "pick me");
    loop {
        let f = monitor.recv().await.unwrap().decoded.frame;
        if f.msg_type == Some(MessageType::CreditTransfer) {
            assert!(f.credits.unwrap() >= 1);
            break;
        }
    }

    // Without a place to look, --to auto says what to do.
    let out = run(&[
        "--daemon",
        &daemon,
        "--api-token-file",
        token_file.to_str().unwrap(),
        "delegate",
        repo.to_str().unwrap(),
        "--executor-token-file",
        credential.to_str().unwrap(),
        "--to",
        "auto",
        "--task",
        "x",
    ])
    .await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--peers-bridge"));
}
