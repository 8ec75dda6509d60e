//! Agents are confined by default (issue 29: a Delegator's code ran as root on the
//! Executor). Real Executor, real FUSE, the default configuration: the agent runs as the
//! agents' user under Landlock, and tries what a hostile task would — read `/root`, the
//! Executor's state directory and block cache, another delegation's mount and directory, a
//! world-readable file elsewhere; write in `/tmp`, `/etc` and the work directory; reach a
//! TCP listener on loopback when the Delegator asked for no network. Every try must fail
//! with EACCES/EPERM (the agent writes what it got into its workspace, which comes back to
//! the Delegator), while its workspace, `TMPDIR`, `HOME`, devices and tools keep working.

use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_protocol::transport::TransportType;
use awcp_tests::{Harness, appears, fuse_available, sample_repo};

/// One agent for every role, chosen by the task prompt (shell assignments it evaluates):
/// `role=victim` connects to `$port`, records the result and waits; `role=probe` tries
/// everything and writes one line per try into `report.txt`.
const AGENT: &str = r#"eval "$AWCP_TASK_PROMPT"
if [ "$role" = victim ]; then
  python3 -c 'import socket,sys
socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
print("connected")' "$port" > net.txt 2>&1
  exec sleep 600
fi
r=report.txt
: > $r
probe() {
  n=$1; shift
  if o=$("$@" 2>&1); then v=ALLOWED; else v=; fi
  echo "$n: $v$(echo "$o" | tail -n 1)" >> $r
}
echo "uid: $(id -u)" >> $r
echo "thp: $(awk '/^THP_enabled:/ {print $2}' /proc/self/status)" >> $r
probe root cat "$rootfile"
probe state ls "$state"
probe cache ls "$cache"
probe other_mount cat "$victim_ws/secret.txt"
probe other_agent ls "$victim_agent"
probe world cat "$world"
probe write_tmp touch /tmp/awcp-confine-probe
probe write_etc touch /etc/awcp-confine-probe
probe write_workdir touch "$workdir/awcp-confine-probe"
probe net python3 -c 'import socket,sys
socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)' "$port"
echo x > "$TMPDIR/t" && echo "tmpdir: ok" >> $r
echo x > "$HOME/h" && echo "home: ok" >> $r
echo x > /dev/null && head -c 8 /dev/urandom > /dev/null && echo "devices: ok" >> $r
git log --oneline > /dev/null && echo "git: ok" >> $r
python3 -m unittest -q 2> unittest.log && echo "unittest: ok" >> $r
true"#;

/// The probes that must be refused, by name.
const REFUSED: &[&str] = &[
    "root",
    "state",
    "cache",
    "other_mount",
    "other_agent",
    "world",
    "write_tmp",
    "write_etc",
    "write_workdir",
    "net",
];

/// What must keep working.
const WORKS: &[&str] = &["tmpdir", "home", "devices", "git", "unittest"];

/// A file outside every path an agent may read, readable by every user: only Landlock
/// keeps the agent from it.
fn world_readable(dir: &Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let f = dir.join("world.txt");
    std::fs::write(&f, "world-readable-secret\n").unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    f
}

/// Removes a file when dropped (the probe file under /root, even when the test fails).
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn check_report(report: &str) {
    let line = |name: &str| {
        report
            .lines()
            .find(|l| l.starts_with(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("no `{name}` line in the agent's report:\n{report}"))
    };
    let uid: u32 = line("uid")["uid: ".len()..].trim().parse().unwrap();
    assert_ne!(uid, 0, "the agent ran as root");
    assert_eq!(
        line("thp"),
        "thp: 1",
        "the agent inherited the Executor's transparent huge pages setting"
    );
    for name in REFUSED {
        let l = line(name);
        assert!(
            l.contains("Permission denied") || l.contains("Operation not permitted"),
            "{name} was not refused with EACCES/EPERM: {l}\n{report}"
        );
    }
    for name in WORKS {
        assert_eq!(line(name), format!("{name}: ok"), "{report}");
    }
    for secret in ["victim-secret", "world-readable-secret", "root-secret"] {
        assert!(
            !report.contains(secret),
            "the agent read {secret}:\n{report}"
        );
    }
}

/// Both transports: the victim is always an awcpfs mount; the probe is `transport`.
async fn agent_is_confined(transport: TransportType) {
    if !fuse_available() {
        return;
    }
    // As in the Executor's binary, whose allocator turns transparent huge pages off for its
    // process (a flag children inherit): the agent must get the machine's setting back.
    nix::sys::prctl::set_thp_disable(true).unwrap();
    let h = Harness::start_confined(AGENT).await;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let rootfile = Path::new("/root").join(format!(".awcp-confine-{}", std::process::id()));
    std::fs::write(&rootfile, "root-secret\n").unwrap();
    let _rm = RemoveOnDrop(rootfile.clone());
    let world = world_readable(&h.path("elsewhere"));

    // The victim: a delegation with the network (the default), holding a secret.
    let victim_src = h.path("victim");
    sample_repo(&victim_src);
    std::fs::write(victim_src.join("secret.txt"), "victim-secret\n").unwrap();
    let mut req = h.request(&[("workspace", &victim_src, AccessMode::Rw)], 120);
    req.task.prompt = format!("role=victim port={port}");
    let victim = h
        .client
        .delegate(&req)
        .await
        .expect("delegate the victim")
        .delegation_id
        .as_str()
        .to_string();
    assert!(
        appears(&victim_src.join("net.txt"), Duration::from_secs(30)).await,
        "the victim's agent did not report its network try"
    );
    // A delegation that did not ask for isolation has the network (the check below can fail).
    assert!(
        awcp_tests::eventually(Duration::from_secs(5), || {
            std::fs::read_to_string(victim_src.join("net.txt"))
                .is_ok_and(|s| s.contains("connected"))
        })
        .await,
        "the victim could not connect: {:?}",
        std::fs::read_to_string(victim_src.join("net.txt"))
    );
    while listener.accept().is_ok() {}

    // The probe: no network, asked for by the Delegator.
    let src = h.path("src");
    sample_repo(&src);
    let mut req = h.request(&[("workspace", &src, AccessMode::Rw)], 120);
    req.transport = Some(transport);
    req.no_network = Some(true);
    req.task.prompt = format!(
        "role=probe port={port} rootfile={root} state={state} cache={cache} \
         victim_ws={vws} victim_agent={vagent} world={world} workdir={work}",
        root = rootfile.display(),
        state = h.path("executor/state").display(),
        cache = h.path("executor/cache").display(),
        vws = h.mountpoint(&victim).display(),
        vagent = h.path("executor/agents").join(&victim).display(),
        world = world.display(),
        work = h.path("executor/work").display(),
    );
    let id = h
        .client
        .delegate(&req)
        .await
        .expect("delegate the probe")
        .delegation_id
        .as_str()
        .to_string();
    let v = h.client.get(&id).await.unwrap();
    let sandbox = v
        .record
        .executor_constraints
        .and_then(|c| c.sandbox_profile)
        .expect("ACCEPT's sandboxProfile");
    assert_eq!(sandbox.allow_network, Some(false), "{sandbox:?}");
    assert_eq!(sandbox.cwd_only, Some(true), "{sandbox:?}");
    let state = h.wait_end(&id, Duration::from_secs(120)).await;
    let report = std::fs::read_to_string(src.join("report.txt")).unwrap_or_default();
    assert_eq!(state, DelegationState::Completed, "{report}");
    check_report(&report);
    assert!(
        listener.accept().is_err(),
        "the agent without network reached the listener"
    );
    for outside in ["/tmp/awcp-confine-probe", "/etc/awcp-confine-probe"] {
        assert!(!Path::new(outside).exists(), "{outside} was written");
    }
    // Its own directory (TMPDIR, HOME) went with the delegation.
    assert!(!h.path("executor/agents").join(&id).exists());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_awcpfs_agent_is_confined_to_its_workspace() {
    agent_is_confined(TransportType::Awcpfs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_archive_agent_is_confined_to_its_workspace() {
    agent_is_confined(TransportType::Archive).await;
}

/// An Executor that accepts everything and confirms no sandbox, as the reference's does
/// (its ACCEPT says `allowNetwork: true` whatever INVITE asked); it records the message
/// types it receives.
async fn careless_executor() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::routing::post;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let app = axum::Router::new().route(
        "/awcp",
        post(move |body: axum::Json<serde_json::Value>| {
            let log = log.clone();
            async move {
                let kind = body["type"].as_str().unwrap_or("").to_string();
                log.lock().unwrap().push(kind.clone());
                axum::Json(if kind == "INVITE" {
                    serde_json::json!({
                        "type": "ACCEPT", "version": "1",
                        "delegationId": body["delegationId"],
                        "retentionMs": 60000,
                        "executorWorkDir": { "path": "/srv/work" },
                        "executorConstraints": { "sandboxProfile": {
                            "cwdOnly": true, "allowNetwork": true, "allowExec": true } }
                    })
                } else {
                    serde_json::json!({ "ok": true })
                })
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/awcp", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

// The Delegator asked for no network; an Executor that does not confirm it must not get the
// workspace (START carries it, or the token to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_network_is_never_sent_to_an_executor_that_does_not_confirm_it() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("true").await;
    let (url, seen) = careless_executor().await;
    let src = h.path("src");
    sample_repo(&src);
    let mut req = h.request(&[("workspace", &src, AccessMode::Rw)], 120);
    req.executor_url = url;
    req.no_network = Some(true);
    let err = h.client.delegate(&req).await.expect_err("delegated");
    let text = format!("{err:?}");
    assert!(
        text.contains("Declined") && text.contains("allowNetwork"),
        "{text}"
    );
    let kinds = seen.lock().unwrap().clone();
    assert!(kinds.contains(&"INVITE".to_string()), "{kinds:?}");
    assert!(
        !kinds.contains(&"START".to_string()),
        "START was sent: {kinds:?}"
    );
    h.stop().await;
}
