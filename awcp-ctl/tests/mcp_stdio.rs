//! `awcp-ctl mcp`, driven as an MCP client would: newline-delimited JSON-RPC over the
//! process's stdin/stdout. Lists the reference's tools plus ours, delegates with
//! `delegate` (waiting for the result), and reads it back with the other tools.

use std::process::Stdio;
use std::time::Duration;

use awcpfs::testing::fuse_available;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const BIN: &str = env!("CARGO_BIN_EXE_awcp-ctl");

struct Client {
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    next: u64,
}

impl Client {
    async fn send(&mut self, msg: Value) {
        let mut line = msg.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        self.stdin.flush().await.unwrap();
    }

    /// A request; its response (every stdout line must be JSON-RPC).
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        loop {
            let line = tokio::time::timeout(Duration::from_secs(60), self.stdout.next_line())
                .await
                .expect("no answer from the MCP server")
                .unwrap()
                .expect("the MCP server closed stdout");
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("stdout carries a non-JSON line {line:?}: {e}"));
            assert_eq!(v["jsonrpc"], "2.0", "{v}");
            if v["id"] == id {
                return v;
            }
        }
    }

    /// `tools/call`; the JSON inside its one text block, and whether it is an error.
    async fn tool(&mut self, name: &str, args: Value) -> (Value, bool) {
        let r = self
            .call("tools/call", json!({"name": name, "arguments": args}))
            .await;
        let result = &r["result"];
        let text = result["content"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("{r}"));
        (
            serde_json::from_str(text).unwrap(),
            result["isError"] == true,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_mcp_client_delegates_and_reads_the_result_over_stdio() {
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
    let mut ecfg = awcp_ctl::executor::ExecutorConfig::new(
        "echo done-by-agent > result.txt; echo finished".into(),
        tmp.path().join("executor"),
    );
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    ecfg.token = Some("test-executor-credential".into());
    let executor = awcp_ctl::executor::start(ecfg).await.unwrap();
    let ws = tmp.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "a").unwrap();

    let mut child = tokio::process::Command::new(BIN)
        // The token in the daemon URL: how the reference's MCP server passes it too.
        .args(["--daemon", &daemon.token_url(), "mcp"])
        .env("AWCP_LOG", "debug")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut c = Client {
        stdin: child.stdin.take().unwrap(),
        stdout: BufReader::new(child.stdout.take().unwrap()).lines(),
        next: 0,
    };
    let init = c
        .call(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "test", "version": "0"}}),
        )
        .await;
    assert!(
        init["result"]["capabilities"]["tools"].is_object(),
        "{init}"
    );
    c.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        .await;
    let tools = c.call("tools/list", json!({})).await;
    let mut names: Vec<&str> = tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            "aecp_flag",
            "aecp_inbox",
            "aecp_lookup",
            "aecp_publish",
            "aecp_violations",
            "delegate",
            "delegate_apply_snapshot",
            "delegate_cancel",
            "delegate_close",
            "delegate_continue",
            "delegate_discard_snapshot",
            "delegate_output",
            "delegate_recover",
            "delegate_renew",
            "delegate_revoke",
            "delegate_snapshots",
            "delegate_status",
        ]
    );
    // The reference's parameter names.
    let delegate = tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "delegate")
        .unwrap();
    let props = &delegate["inputSchema"]["properties"];
    for p in [
        "description",
        "prompt",
        "workspace_dir",
        "resources",
        "cwd",
        "peer_url",
        "ttl_seconds",
        "access_mode",
        "snapshot_mode",
        "auth_type",
        "auth_credential",
        "background",
    ] {
        assert!(props.get(p).is_some(), "delegate lacks {p}: {props}");
    }
    // Delegate and wait for the result.
    let (v, err) = c
        .tool(
            "delegate",
            json!({"description": "write a result", "prompt": "please",
                   "workspace_dir": ws.display().to_string(), "peer_url": executor.awcp_url(),
                   "ttl_seconds": 120}),
        )
        .await;
    assert!(!err, "{v}");
    assert_eq!(v["state"], "completed", "{v}");
    assert!(
        v["result"]["summary"]
            .as_str()
            .unwrap()
            .contains("finished"),
        "{v}"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("result.txt")).unwrap(),
        "done-by-agent\n"
    );
    let id = v["id"].as_str().unwrap().to_string();
    let (v, err) = c
        .tool(
            "delegate_output",
            json!({"delegation_id": id, "block": true, "timeout": 5}),
        )
        .await;
    assert!(!err);
    assert_eq!(v["state"], "completed");
    let (v, _) = c.tool("delegate_status", json!({})).await;
    assert_eq!(v["delegations"][0]["id"], id);
    // AECP's tools reach the daemon: the delegation is a worker with an empty inbox and no
    // findings; an unknown worker is an error that says what a worker is.
    let (v, err) = c.tool("aecp_inbox", json!({"worker": id})).await;
    assert!(!err, "{v}");
    assert_eq!(v, json!([]));
    let (v, err) = c
        .tool("aecp_lookup", json!({"worker": id, "path": "a.txt"}))
        .await;
    assert!(!err, "{v}");
    assert_eq!(v, json!([]));
    let (v, err) = c.tool("aecp_violations", json!({"worker": id})).await;
    assert!(!err, "{v}");
    assert_eq!(v, json!([]), "nothing screened: no violations");
    let (v, err) = c.tool("aecp_inbox", json!({"worker": "dlg_nope"})).await;
    assert!(err);
    assert!(
        v["error"].as_str().unwrap().contains("unknown worker"),
        "{v}"
    );
    let (v, _) = c
        .tool("delegate_snapshots", json!({"delegation_id": id}))
        .await;
    assert_eq!(v, json!({"snapshots": []}));
    // Errors come back as tool errors, with the daemon's message.
    let (v, err) = c
        .tool("delegate_revoke", json!({"delegation_id": id}))
        .await;
    assert!(err);
    assert!(
        v["error"].as_str().unwrap().contains("already ended"),
        "{v}"
    );
    let (v, err) = c
        .tool(
            "delegate",
            json!({"description": "d", "prompt": "p", "peer_url": executor.awcp_url()}),
        )
        .await;
    assert!(err, "{v}");
    drop(c);
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    executor.stop().await;
    daemon.stop().await;
}
