//! Workers are who their credential says (issue 33): an agent's `awcp-ctl aecp …` goes
//! through its own mount (`$AECP_SOCKET`, set by the Executor) and acts as its own worker
//! only. Two workers on one workspace; worker A's agent — a script that exports nothing —
//! publishes, flags and acknowledges as itself (accepted) and as B (refused with 403) — with
//! `awcp-ctl aecp …` and through the MCP server it runs (`awcp-ctl mcp`) alike — and its
//! environment holds no daemon URL and no token. The daemon's owner credential still
//! acts as any worker.

use std::path::Path;
use std::time::Duration;

use awcp_ctl::daemon::aecp::{ConsumerRequest, DeclareRequest, PublishRequest};
use awcp_protocol::messages::AccessMode;
use awcp_tests::fleet::awcp_ctl_bin;
use awcp_tests::{Harness, eventually, fuse_available};

const WAIT: Duration = Duration::from_secs(90);

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_default()
}

/// The exit code a script step recorded.
fn rc(dir: &Path, step: &str) -> i32 {
    read(dir, &format!("{step}.rc"))
        .trim()
        .parse()
        .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_acts_as_its_own_worker_only_and_needs_nothing_exported() {
    if !fuse_available() {
        return;
    }
    let Some(bin) = awcp_ctl_bin() else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the identity test needs the awcp-ctl binary beside the tests (cargo nextest run --workspace builds it)"
        );
        awcpfs::testing::skipped(
            "the worker-identity test (no awcp-ctl binary beside the tests)",
            "cargo build -p awcp-ctl",
        );
        return;
    };
    // Where the test hands each agent its script and the agents leave their results.
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().display().to_string();
    // Each agent waits for its own script, then runs it. Nothing is exported. (The binary
    // is named so that the harness lets the confined agent run it, as an operator would
    // with `--agent-allow-read`.)
    let agent = format!(
        ": {bin}; while [ ! -f {dir}/go-$AWCP_DELEGATION_ID ]; do sleep 0.1; done; . {dir}/go-$AWCP_DELEGATION_ID",
        bin = bin.display()
    );
    let h = Harness::start(&agent).await;
    let ws = h.path("ws");
    std::fs::create_dir_all(ws.join("pkg")).unwrap();
    std::fs::write(ws.join("pkg/__init__.py"), "").unwrap();
    std::fs::write(ws.join("pkg/a.py"), "def parse(s):\n    return s\n").unwrap();
    let a = h.delegate(&ws, AccessMode::Rw, 600).await;
    let b = h.delegate(&ws, AccessMode::Rw, 600).await;
    for id in [&a, &b] {
        assert!(
            eventually(WAIT, || h.mountpoint(id).join("pkg/a.py").exists()).await,
            "mount of {id} not up"
        );
    }

    // The owner's credential (the daemon's API token) acts as any worker: B's finding, a
    // contract A declares, and both as its consumers.
    let of_b = h
        .client
        .aecp_publish(&PublishRequest {
            worker: b.clone(),
            claim: "parse() returns its input".into(),
            scope: "file:pkg/a.py".into(),
            witness: None,
        })
        .await
        .expect("the owner publishes as B")
        .artifact;
    h.client
        .aecp_declare(
            &DeclareRequest {
                worker: a.clone(),
                module: "pkg/acct.py".into(),
                interface: Some("def open_account(owner: str) -> int: ...\n".into()),
                contract: None,
            },
            false,
        )
        .await
        .expect("declare");
    for w in [&a, &b] {
        h.client
            .aecp_depend(&ConsumerRequest {
                worker: w.clone(),
                module: "pkg/acct.py".into(),
                symbols: vec![],
            })
            .await
            .expect("depend");
    }

    // A's agent: each step's output and exit code into the shared directory.
    let ctl = bin.display();
    let step = |name: &str, args: &str| {
        format!(
            "{ctl} --json aecp {args} > {dir}/{name}.out 2> {dir}/{name}.err; echo $? > {dir}/{name}.rc\n"
        )
    };
    let mut script = String::new();
    script += &step(
        "publish-self",
        "publish --claim 'mine' --scope file:pkg/a.py",
    );
    script += &step(
        "publish-as-b",
        &format!("publish --worker {b} --claim 'forged' --scope file:pkg/a.py"),
    );
    script += &step(
        "flag-as-b",
        &format!("flag {} --worker {b} --reason forged", of_b.id),
    );
    script += &step("flag-self", &format!("flag {} --reason 'not so'", of_b.id));
    script += &step(
        "ack-as-b",
        &format!("ack --module pkg/acct.py --worker {b}"),
    );
    script += &step("ack-self", "ack --module pkg/acct.py");
    // B's socket is reachable by path (the agents share a user), but A's token is not B's.
    let socket_b = h.path("executor/agents").join(&b).join("aecp.sock");
    script += &format!("AECP_SOCKET={} ", socket_b.display());
    script += &step(
        "publish-on-b-socket",
        "publish --claim 'forged' --scope file:pkg/a.py",
    );
    // The MCP server run by the agent (`awcp-ctl mcp`): its AECP tools act as A only.
    let rpc = |id: u32, name: &str, args: serde_json::Value| {
        serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": name, "arguments": args}})
        .to_string()
    };
    let mcp_in = [
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2024-11-05", "capabilities": {},
            "clientInfo": {"name": "agent", "version": "1"}}})
        .to_string(),
        serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string(),
        rpc(
            2,
            "aecp_publish",
            serde_json::json!({"claim": "mine over mcp", "scope": "file:pkg/a.py"}),
        ),
        rpc(
            3,
            "aecp_publish",
            serde_json::json!({"worker": &b, "claim": "forged over mcp", "scope": "file:pkg/a.py"}),
        ),
        rpc(
            4,
            "aecp_flag",
            serde_json::json!({"worker": &b, "id": of_b.id}),
        ),
        rpc(5, "aecp_inbox", serde_json::json!({"worker": &b})),
    ];
    script += &format!(
        ": > {dir}/mcp.out\n{{ printf '%s\\n' {lines}; i=0; while [ $i -lt 300 ] && [ \"$(wc -l < {dir}/mcp.out)\" -lt 5 ]; do sleep 0.1; i=$((i+1)); done; }} | {ctl} mcp > {dir}/mcp.out 2> {dir}/mcp.err\n",
        lines = mcp_in
            .iter()
            .map(|l| format!("'{l}'"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    script += &format!("env > {dir}/env\ntouch {dir}/done\nsleep 600\n");
    std::fs::write(out.path().join(format!("go-{a}")), script).unwrap();
    assert!(
        eventually(WAIT, || out.path().join("done").exists()).await,
        "A's agent did not finish its script: {:?}",
        std::fs::read_dir(out.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect::<Vec<_>>()
    );
    let show = |name: &str| {
        format!(
            "{name}: rc {} out {} err {}",
            rc(out.path(), name),
            read(out.path(), &format!("{name}.out")),
            read(out.path(), &format!("{name}.err"))
        )
    };

    // As itself: accepted, and the store names A.
    assert_eq!(
        rc(out.path(), "publish-self"),
        0,
        "{}",
        show("publish-self")
    );
    let published: serde_json::Value =
        serde_json::from_str(read(out.path(), "publish-self.out").trim()).expect("JSON");
    assert_eq!(published["artifact"]["producer"], a.as_str());
    assert_eq!(rc(out.path(), "flag-self"), 0, "{}", show("flag-self"));
    assert_eq!(rc(out.path(), "ack-self"), 0, "{}", show("ack-self"));
    let acked: serde_json::Value =
        serde_json::from_str(read(out.path(), "ack-self.out").trim()).expect("JSON");
    assert_eq!(acked["revision"], 1);

    // As B: refused, saying why.
    for name in ["publish-as-b", "flag-as-b", "ack-as-b"] {
        assert_ne!(rc(out.path(), name), 0, "{}", show(name));
        let text = read(out.path(), &format!("{name}.err"));
        assert!(
            text.contains(&format!(
                "this credential is worker {a}'s: acting as worker {b} is refused"
            )),
            "{}",
            show(name)
        );
    }
    let name = "publish-on-b-socket";
    assert_ne!(rc(out.path(), name), 0, "{}", show(name));
    assert!(
        read(out.path(), &format!("{name}.err")).contains("need its worker's AECP_TOKEN"),
        "{}",
        show(name)
    );
    // Over MCP: as itself accepted, as B refused, saying why.
    let mcp: Vec<serde_json::Value> = read(out.path(), "mcp.out")
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let tool = |id: u32| -> (serde_json::Value, bool) {
        let r = mcp.iter().find(|v| v["id"] == id).unwrap_or_else(|| {
            panic!(
                "no MCP answer {id}: {mcp:?}; stderr: {}",
                read(out.path(), "mcp.err")
            )
        });
        let text = r["result"]["content"][0]["text"].as_str().unwrap_or("null");
        (
            serde_json::from_str(text).unwrap_or(serde_json::Value::Null),
            r["result"]["isError"] == true,
        )
    };
    let (own, failed) = tool(2);
    assert!(!failed, "{own}");
    assert_eq!(own["artifact"]["producer"], a.as_str(), "{own}");
    for id in [3, 4, 5] {
        let (v, failed) = tool(id);
        assert!(failed, "MCP call {id} acted as B: {v}");
        assert!(
            v["error"].as_str().unwrap_or("").contains(&format!(
                "this credential is worker {a}'s: acting as worker {b} is refused"
            )),
            "MCP call {id}: {v}"
        );
    }
    let artifacts = h.client.aecp_list(&a).await.unwrap();
    assert!(
        artifacts
            .iter()
            .all(|x| x.claim != "forged" && x.claim != "forged over mcp"),
        "a forged publication reached the store: {artifacts:?}"
    );
    assert!(artifacts.iter().any(|x| x.claim == "mine"));
    assert!(artifacts.iter().any(|x| x.claim == "mine over mcp"));
    let flags: Vec<_> = h
        .client
        .aecp_audit(&a)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "flag" || e.kind == "acknowledgement")
        .map(|e| (e.kind, e.worker))
        .collect();
    assert_eq!(
        flags,
        [
            ("flag".to_string(), Some(a.clone())),
            ("acknowledgement".to_string(), Some(a.clone()))
        ],
        "only A's own flag and acknowledgement are recorded"
    );

    // Nothing was exported by hand, and nothing of the daemon's reached the agent.
    let env = read(out.path(), "env");
    assert!(
        env.contains("AECP_SOCKET=") && env.contains("AECP_TOKEN="),
        "{env}"
    );
    for name in ["AWCP_DAEMON_URL", "AWCP_API_TOKEN", "AWCP_API_TOKEN_FILE"] {
        assert!(!env.contains(&format!("{name}=")), "{name} in {env}");
    }
    let token = std::fs::read_to_string(h.path("delegator/api-token")).unwrap_or_default();
    assert!(
        token.trim().is_empty() || !env.contains(token.trim()),
        "the daemon's API token reached the agent"
    );

    h.client.revoke(&a, false).await.unwrap();
    h.client.revoke(&b, false).await.unwrap();
    h.stop().await;
}
