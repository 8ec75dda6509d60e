//! Two Delegator daemons on one PostgreSQL database (`serve --state postgres://…`): both list
//! every delegation; when daemon A is killed (SIGKILL) mid-delegation, daemon B takes over —
//! it enforces the lease expiry of one delegation (whose Executor died with A, so B is the
//! only one left to enforce it) and revokes another, which fences the real `awcpfs` mount
//! on a live Executor.
//!
//! Needs PostgreSQL (`eval "$(scripts/pg-test-server.sh start)"`): skips loudly without it,
//! fails under `CI=true`. Needs FUSE likewise.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use awcp_ctl::client::{ClientError, DaemonClient};
use awcp_ctl::executor::ExecutorConfig;
use awcp_ctl::store::postgres::testing::{fresh_database, off_runtime};
use awcp_ctl::watch::WatchEvent;
use awcp_protocol::api::{DelegateRequest, EnvironmentSpec, ResourceSpec};
use awcp_protocol::dataplane::LeaseState;
use awcp_protocol::messages::{AccessMode, ResourceType, TaskSpec};
use awcp_protocol::{DelegationState, TransportType};

const BIN: &str = env!("CARGO_BIN_EXE_awcp-ctl");

/// A child process, killed (SIGKILL) when dropped.
struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The Executors' credential (they require one by default).
const CREDENTIAL: &str = "test-executor-credential";

/// A daemon process on the shared database; its log goes to `<state_dir>.log`.
struct Daemon {
    proc: Proc,
    url: String,
    data_url: String,
    state_dir: PathBuf,
}

impl Daemon {
    fn start(state_dir: &Path, db: &str) -> Daemon {
        let (api, data) = (free_port(), free_port());
        let log = std::fs::File::create(state_dir.with_extension("log")).unwrap();
        let child = Command::new(BIN)
            .args(["serve", "--listen", &format!("127.0.0.1:{api}")])
            .args(["--export-listen", &format!("127.0.0.1:{data}")])
            .arg("--state-dir")
            .arg(state_dir)
            .args(["--state", db, "--failover-after", "2s"])
            .env("AWCP_LOG", "info")
            // The Executors' credential, presented in every INVITE.
            .env("AWCP_EXECUTOR_TOKEN", CREDENTIAL)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Daemon {
            proc: Proc(child),
            url: format!("http://127.0.0.1:{api}"),
            data_url: format!("http://127.0.0.1:{data}"),
            state_dir: state_dir.to_path_buf(),
        }
    }

    fn log_path(&self) -> PathBuf {
        self.state_dir.with_extension("log")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn id(&self) -> String {
        std::fs::read_to_string(self.state_dir.join("daemon-id"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// Wait for it to answer, then a client with its token.
    async fn client(&self) -> DaemonClient {
        let start = Instant::now();
        loop {
            if let Ok(t) = std::fs::read_to_string(self.state_dir.join("api-token")) {
                let c = DaemonClient::new(&self.url).with_token(Some(t.trim().to_string()));
                if c.list().await.is_ok() {
                    return c;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "daemon at {} did not start:\n{}",
                self.url,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `awcp-ctl --daemon <daemons> --json doctor` with `token`: its checks by name.
fn doctor(daemons: &str, token: &str) -> serde_json::Map<String, serde_json::Value> {
    let out = Command::new(BIN)
        .args(["--daemon", daemons, "--json", "doctor"])
        .env("AWCP_API_TOKEN", token)
        // No token file of another daemon on this machine is found instead.
        .env("AWCP_STATE_DIR", "/nonexistent/awcp-doctor-test")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["check"].as_str().unwrap().to_string(), v)
        })
        .collect()
}

fn request(executor: &str, dir: &Path, ttl: u64, transport: TransportType) -> DelegateRequest {
    DelegateRequest {
        executor_url: executor.to_string(),
        environment: EnvironmentSpec {
            resources: vec![ResourceSpec {
                name: "workspace".into(),
                resource_type: ResourceType::Fs,
                source: dir.display().to_string(),
                mode: AccessMode::Rw,
                include: None,
                exclude: None,
                gitignore: None,
                allow_sensitive: None,
            }],
        },
        task: TaskSpec {
            description: "failover test".into(),
            prompt: "wait".into(),
        },
        ttl_seconds: Some(ttl),
        access_mode: Some(AccessMode::Rw),
        snapshot_mode: None,
        auth: None,
        transport: Some(transport),
        multi_round: None,
        git_remote: None,
        no_network: None,
    }
}

async fn until<T>(
    what: &str,
    timeout: Duration,
    mut f: impl AsyncFnMut() -> Option<T>,
    logs: impl Fn() -> String,
) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn is_mounted(path: &Path) -> bool {
    let want = path.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn daemon_b_takes_over_when_daemon_a_is_killed() {
    let Some(db) = fresh_database() else { return };
    if !awcpfs::testing::fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // The agents' user passes through to the Executor's work directory (0711).
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .unwrap();
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::write(repo.join("README.md"), "# failover\n").unwrap();
    let small = tmp.path().join("small");
    std::fs::create_dir_all(&small).unwrap();
    std::fs::write(small.join("a.txt"), "a\n").unwrap();

    // E1: a live Executor in this process (a real awcpfs mount). E2: an Executor process
    // that dies with daemon A.
    let mut ecfg = ExecutorConfig::new("sleep 120".into(), tmp.path().join("e1"));
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    ecfg.token = Some(CREDENTIAL.into());
    let e1 = awcp_ctl::executor::start(ecfg).await.unwrap();
    let e2_port = free_port();
    let e2 = Proc(
        Command::new(BIN)
            .args(["executor", "--listen", &format!("127.0.0.1:{e2_port}")])
            .args(["--agent-cmd", "sleep 120", "--dir"])
            .arg(tmp.path().join("e2"))
            .env("AWCP_EXECUTOR_TOKEN", CREDENTIAL)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let e2_url = format!("http://127.0.0.1:{e2_port}/awcp");

    let a = Daemon::start(&tmp.path().join("a"), &db.url);
    let b = Daemon::start(&tmp.path().join("b"), &db.url);
    let (ca, cb) = (a.client().await, b.client().await);
    let (a_id, b_id) = (a.id(), b.id());
    assert_ne!(a_id, b_id);
    let (a_log, b_log) = (a.log_path(), b.log_path());
    let logs = || {
        let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
        format!(
            "--- daemon A ---\n{}\n--- daemon B ---\n{}",
            read(&a_log),
            read(&b_log)
        )
    };

    // On A: d1 mounted on E1 with a long lease; d2 on E2 with a short one.
    let d1 = ca
        .delegate(&request(&e1.awcp_url(), &repo, 600, TransportType::Awcpfs))
        .await
        .unwrap()
        .delegation_id
        .as_str()
        .to_string();
    let d2 = until(
        "E2 to accept",
        Duration::from_secs(20),
        async || {
            ca.delegate(&request(&e2_url, &small, 10, TransportType::Archive))
                .await
                .ok()
        },
        &logs,
    )
    .await
    .delegation_id
    .as_str()
    .to_string();
    for id in [&d1, &d2] {
        until(
            "the delegation to run on A",
            Duration::from_secs(30),
            async || {
                (ca.get(id).await.ok()?.record.state == DelegationState::Running).then_some(())
            },
            &logs,
        )
        .await;
    }
    let mount = tmp.path().join("e1/work").join(&d1);
    assert!(
        is_mounted(&mount),
        "d1 is mounted on E1 at {}",
        mount.display()
    );

    // B lists both, as A's, read-only.
    until(
        "B to list A's delegations",
        Duration::from_secs(10),
        async || {
            let ids: Vec<String> = cb
                .list()
                .await
                .ok()?
                .delegations
                .iter()
                .map(|d| d.id.as_str().to_string())
                .collect();
            (ids.contains(&d1) && ids.contains(&d2)).then_some(())
        },
        &logs,
    )
    .await;
    let v = cb.get(&d1).await.unwrap();
    assert_eq!(v.owner.as_deref(), Some(a_id.as_str()));
    assert_eq!(v.record.state, DelegationState::Running);
    match cb.revoke(&d1, false).await {
        Err(ClientError::Refused { status: 409, body }) => {
            assert!(
                body.error.contains(&a_id),
                "the refusal names the owner: {body:?}"
            )
        }
        other => panic!("B must not revoke A's live delegation: {other:?}"),
    }
    // The CLI on B shows them too.
    let out = Command::new(BIN)
        .args(["--daemon", &b.url, "--api-token-file"])
        .arg(b.state_dir.join("api-token"))
        .arg("status")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&d1) && text.contains(&d2), "{text}");
    let out = Command::new(BIN)
        .args(["--daemon", &b.url, "--api-token-file"])
        .arg(b.state_dir.join("api-token"))
        .args(["status", &d1])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("daemon      {a_id}")),
        "status on B names A as the daemon that runs it: {text}"
    );

    // A dies (with E2). B takes both over once A's heartbeat is 2 s old.
    let d2_expires = ca.get(&d2).await.unwrap().lease.expires_at;
    drop(a.proc);
    drop(e2);
    let killed = Instant::now();
    for id in [&d1, &d2] {
        until(
            "B to take over",
            Duration::from_secs(15),
            async || (cb.get(id).await.ok()?.owner.as_deref() == Some(b_id.as_str())).then_some(()),
            &logs,
        )
        .await;
    }
    let took = killed.elapsed();
    assert!(
        took >= Duration::from_millis(1500),
        "took over after {took:?}: before A's heartbeat lapsed"
    );

    // d2: nobody but B is left to end it; B ends it at its lease expiry.
    let state = until(
        "B to expire d2",
        Duration::from_secs(30),
        async || {
            let v = cb.get(&d2).await.ok()?;
            v.record.state.is_terminal().then_some(v.record.state)
        },
        &logs,
    )
    .await;
    assert_eq!(state, DelegationState::Expired, "{}", logs());
    let expires = chrono::DateTime::parse_from_rfc3339(&d2_expires).unwrap();
    assert!(chrono::Utc::now() >= expires, "expired before {d2_expires}");
    let mut history: Vec<WatchEvent> = Vec::new();
    cb.watch(&d2, |e| history.push(e.clone())).await.unwrap();
    let owner_at = history
        .iter()
        .position(|e| {
            matches!(e, WatchEvent::Owner { daemon, previous, .. }
            if *daemon == b_id && previous.as_deref() == Some(a_id.as_str()))
        })
        .unwrap_or_else(|| panic!("B recorded its takeover: {history:#?}"));
    let expired_at = history
        .iter()
        .position(|e| {
            matches!(
                e,
                WatchEvent::Lease {
                    state: LeaseState::Expired,
                    ..
                }
            )
        })
        .unwrap_or_else(|| panic!("B's lease watch recorded the expiry: {history:#?}"));
    assert!(owner_at < expired_at, "{history:#?}");

    // d1: B revokes it; E1 fences and unmounts.
    assert_eq!(
        cb.get(&d1).await.unwrap().record.state,
        DelegationState::Running
    );
    cb.revoke(&d1, false).await.unwrap();
    assert_eq!(
        cb.get(&d1).await.unwrap().record.state,
        DelegationState::Cancelled
    );
    until(
        "E1 to unmount d1",
        Duration::from_secs(30),
        async || (!is_mounted(&mount)).then_some(()),
        &logs,
    )
    .await;
    // The record in the database says so too (what any other daemon would read).
    let (url, id) = (db.url.clone(), d1.clone());
    let (owner, terminal) = off_runtime(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let row = c
            .query_one(
                "SELECT owner, terminal FROM delegations WHERE id = $1",
                &[&id],
            )
            .unwrap();
        (row.get::<_, Option<String>>(0), row.get::<_, bool>(1))
    });
    assert_eq!(owner.as_deref(), Some(b_id.as_str()));
    assert!(terminal);
    e1.stop().await;
}

/// The export's identity of a delegation, as stored (what any daemon reads).
fn stored_export(db: &str, id: &str) -> (String, String) {
    let (url, id) = (db.to_string(), id.to_string());
    off_runtime(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let body: String = c
            .query_one("SELECT body FROM delegations WHERE id = $1", &[&id])
            .unwrap()
            .get(0);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        (
            v["exportId"].as_str().unwrap().to_string(),
            v["token"].as_str().unwrap().to_string(),
        )
    })
}

/// Daemon A stalls (SIGSTOP) past the lapse and B takes its delegation over. When A wakes
/// up (SIGCONT) it must not go on running it: its copy turns read-only (a revoke there is
/// refused, naming B) and its export refuses the delegation's token — B could not revoke
/// access through A's data plane, so A must not serve it. B then ends the delegation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_daemon_that_wakes_up_stops_serving_what_was_taken_over() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let Some(db) = fresh_database() else { return };
    if !awcpfs::testing::fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // The agents' user passes through to the Executor's work directory (0711).
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .unwrap();
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::write(repo.join("README.md"), "# stall\n").unwrap();
    let mut ecfg = ExecutorConfig::new("sleep 120".into(), tmp.path().join("e1"));
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    ecfg.token = Some(CREDENTIAL.into());
    let e1 = awcp_ctl::executor::start(ecfg).await.unwrap();

    let a = Daemon::start(&tmp.path().join("a"), &db.url);
    let b = Daemon::start(&tmp.path().join("b"), &db.url);
    let (ca, cb) = (a.client().await, b.client().await);
    let b_id = b.id();
    let (a_log, b_log) = (a.log_path(), b.log_path());
    let logs = || {
        let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
        format!(
            "--- daemon A ---\n{}\n--- daemon B ---\n{}",
            read(&a_log),
            read(&b_log)
        )
    };
    let d = ca
        .delegate(&request(&e1.awcp_url(), &repo, 600, TransportType::Awcpfs))
        .await
        .unwrap()
        .delegation_id
        .as_str()
        .to_string();
    until(
        "the delegation to run on A",
        Duration::from_secs(30),
        async || (ca.get(&d).await.ok()?.record.state == DelegationState::Running).then_some(()),
        &logs,
    )
    .await;
    let (export_id, token) = stored_export(&db.url, &d);
    let a_export = format!("{}/v1/exports/{export_id}/manifest", a.data_url);
    let http = reqwest::Client::new();
    let manifest = async || {
        http.get(&a_export)
            .bearer_auth(&token)
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    assert_eq!(manifest().await, 200, "A's export serves the delegation");

    let pid = Pid::from_raw(a.proc.0.id() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    until(
        "B to take over from the stalled A",
        Duration::from_secs(15),
        async || (cb.get(&d).await.ok()?.owner.as_deref() == Some(b_id.as_str())).then_some(()),
        &logs,
    )
    .await;
    kill(pid, Signal::SIGCONT).unwrap();

    until(
        "A to see that B runs the delegation now",
        Duration::from_secs(10),
        async || (ca.get(&d).await.ok()?.owner.as_deref() == Some(b_id.as_str())).then_some(()),
        &logs,
    )
    .await;
    match ca.revoke(&d, false).await {
        Err(ClientError::Refused { status: 409, body }) => {
            assert!(body.error.contains(&b_id), "{body:?}")
        }
        other => panic!("A must not act on a delegation B took over: {other:?}"),
    }
    until(
        "A's export to refuse the token",
        Duration::from_secs(10),
        async || {
            let s = manifest().await;
            (s == 401 || s == 403 || s == 404).then_some(s)
        },
        &logs,
    )
    .await;
    // The mount, refused by A's export, ends; B records how (or B revokes it first).
    let _ = cb.revoke(&d, false).await;
    until(
        "the delegation to end on B",
        Duration::from_secs(30),
        async || {
            cb.get(&d)
                .await
                .ok()?
                .record
                .state
                .is_terminal()
                .then_some(())
        },
        &logs,
    )
    .await;
    let mount = tmp.path().join("e1/work").join(&d);
    until(
        "E1 to unmount",
        Duration::from_secs(30),
        async || (!is_mounted(&mount)).then_some(()),
        &logs,
    )
    .await;
    e1.stop().await;
}

/// After a database outage every heartbeat is stale. A daemon that has only just reached the
/// database (here: just started) must give the others a full lapse to beat before it takes
/// anything over; then it takes a silent daemon's running delegation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_claims_nothing_before_it_has_beaten_for_a_full_lapse() {
    use awcp_ctl::store::StateStore as _;
    use awcp_ctl::store::StoredDelegation;
    use awcp_ctl::store::postgres::PgStore;
    let Some(db) = fresh_database() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // The agents' user passes through to the Executor's work directory (0711).
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .unwrap();
    let expires = (chrono::Utc::now() + chrono::Duration::seconds(120))
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let ghost: StoredDelegation = serde_json::from_value(serde_json::json!({
        "record": {
            "id": format!("dlg_{}", "ab".repeat(16)),
            "state": "running",
            // Nothing listens there: the pump's retries outlast the test.
            "peerUrl": "http://127.0.0.1:9/awcp",
            "environment": {"resources": []},
            "task": {"description": "ghost", "prompt": "p"},
            "leaseConfig": {"ttlSeconds": 120, "accessMode": "rw"},
            "retentionMs": 1000,
            "activeLease": {"expiresAt": expires, "accessMode": "rw"},
            "createdAt": awcp_ctl::now_iso(),
            "updatedAt": awcp_ctl::now_iso(),
        },
        "exportId": "exp_ghost",
        "token": "tok_ghost",
        "source": tmp.path(),
        "readOnly": false,
        "events": [],
    }))
    .unwrap();
    let id = ghost.record.id.as_str().to_string();
    // The ghost daemon beat once, long enough ago to have lapsed by the time B looks.
    let url = db.url.clone();
    off_runtime(move || {
        let s = PgStore::connect(&url).unwrap();
        s.heartbeat("dmn_ghost", "http://127.0.0.1:9").unwrap();
        s.put("dmn_ghost", &ghost).unwrap();
    });
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let mut cfg = awcp_ctl::daemon::DaemonConfig::new(tmp.path().join("b"));
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.export_listen = "127.0.0.1:0".parse().unwrap();
    cfg.state = Some(db.url.clone());
    cfg.failover_after = Duration::from_secs(1);
    cfg.executor_token = Some(CREDENTIAL.into());
    let b = awcp_ctl::daemon::start(cfg).await.unwrap();
    let started = Instant::now();
    let client = b.client();
    let owner = async || client.get(&id).await.ok().and_then(|v| v.owner);
    // Listed at once, as the ghost's.
    assert_eq!(owner().await.as_deref(), Some("dmn_ghost"));
    let mut claimed = None;
    while started.elapsed() < Duration::from_secs(10) {
        if owner().await.as_deref() == Some(b.daemon.daemon_id()) {
            claimed = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let claimed = claimed.expect("B takes the ghost's delegation over");
    assert!(
        claimed >= Duration::from_millis(900),
        "B claimed after {claimed:?}, before beating for a full lapse (1 s)"
    );
    let v = client.get(&id).await.unwrap();
    assert_eq!(v.record.state, DelegationState::Running);
    assert!(
        v.lease.remaining_ms > 100_000,
        "the stored expiry: {:?}",
        v.lease
    );
    b.stop().await;
}

/// Issue 34: after a failover, clients had to find the new daemon's URL and its own API
/// token. Here a client is given both daemons' URLs and one client token (kept hashed in the
/// database); when the first daemon is killed it keeps working — `status` and `revoke` — on
/// the second, without being told anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_with_both_urls_and_one_token_survives_the_first_daemons_death() {
    let Some(db) = fresh_database() else { return };
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .unwrap();
    let small = tmp.path().join("small");
    std::fs::create_dir_all(&small).unwrap();
    std::fs::write(small.join("a.txt"), "a\n").unwrap();
    let mut ecfg = ExecutorConfig::new("sleep 120".into(), tmp.path().join("e1"));
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    ecfg.token = Some(CREDENTIAL.into());
    let e1 = awcp_ctl::executor::start(ecfg).await.unwrap();

    let a = Daemon::start(&tmp.path().join("a"), &db.url);
    let b = Daemon::start(&tmp.path().join("b"), &db.url);
    let (ca, cb) = (a.client().await, b.client().await);
    let b_id = b.id();
    let (a_log, b_log) = (a.log_path(), b.log_path());
    let logs = || {
        let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
        format!(
            "--- daemon A ---\n{}\n--- daemon B ---\n{}",
            read(&a_log),
            read(&b_log)
        )
    };

    // One client token, made on A: the database keeps a salted hash, B accepts it too.
    let made = ca.create_token("failover test").await.unwrap();
    assert!(made.shared, "{made:?}");
    let token = made.token.clone();
    let (url, tok) = (db.url.clone(), token.clone());
    let rows: Vec<(String, String, String)> = off_runtime(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        c.query("SELECT id, salt, hash FROM client_tokens", &[])
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    });
    assert_eq!(rows.len(), 1);
    let secret = tok.split_once('.').unwrap().1;
    assert!(
        rows.iter()
            .all(|(_, salt, hash)| !hash.contains(secret) && !salt.contains(secret)),
        "the token is not in the database"
    );
    let on_b = DaemonClient::new(&b.url).with_token(Some(token.clone()));
    on_b.list().await.expect("B accepts the token made on A");
    let forged = format!("{}.{}", made.id, "0".repeat(64));
    match DaemonClient::new(&b.url)
        .with_token(Some(forged))
        .list()
        .await
    {
        Err(ClientError::Refused { status: 401, .. }) => {}
        other => panic!("a forged secret under a real id: {other:?}"),
    }

    // The client: both URLs, that token.
    let both = format!("{},{}", a.url, b.url);
    let client = DaemonClient::new(&both).with_token(Some(token.clone()));
    let id = client
        .delegate(&request(
            &e1.awcp_url(),
            &small,
            600,
            TransportType::Archive,
        ))
        .await
        .unwrap()
        .delegation_id
        .as_str()
        .to_string();
    until(
        "the delegation to run",
        Duration::from_secs(30),
        async || {
            (client.get(&id).await.ok()?.record.state == DelegationState::Running).then_some(())
        },
        &logs,
    )
    .await;
    assert_eq!(client.base(), a.url, "the first daemon answers first");
    let a_id = a.id();
    // `doctor` checks each daemon of the list: both answer, take the token, and say
    // which daemon they are; together they are one fleet.
    let checks = doctor(&both, &token);
    for (url, id) in [(&a.url, &a_id), (&b.url, &b_id)] {
        let c = &checks[&format!("daemon {url}")];
        assert_eq!(c["status"], "ok", "{checks:#?}");
        assert!(c["detail"].as_str().unwrap().contains(id.as_str()), "{c}");
        assert!(
            checks.contains_key(&format!("daemon credential {url}")),
            "{checks:#?}"
        );
    }
    assert_eq!(checks["daemons"]["status"], "ok", "{checks:#?}");
    assert_eq!(
        client.get(&id).await.unwrap().owner.as_deref(),
        Some(a_id.as_str())
    );

    // A dies. The same client, unchanged, reaches B, which takes the delegation over.
    drop(a.proc);
    until(
        "B to take the delegation over",
        Duration::from_secs(20),
        async || {
            (client.get(&id).await.ok()?.owner.as_deref() == Some(b_id.as_str())).then_some(())
        },
        &logs,
    )
    .await;
    assert_eq!(client.base(), b.url, "the client moved to B");
    // `doctor` now: A does not answer (a warning: clients use B), B does.
    let checks = doctor(&both, &token);
    assert_eq!(
        checks[&format!("daemon {}", a.url)]["status"],
        "warn",
        "{checks:#?}"
    );
    assert_eq!(
        checks[&format!("daemon {}", b.url)]["status"],
        "ok",
        "{checks:#?}"
    );
    let fleet = &checks["daemons"];
    assert_eq!(fleet["status"], "warn", "{checks:#?}");
    assert!(
        fleet["detail"].as_str().unwrap().contains("1 of 2"),
        "{fleet}"
    );
    // The CLI too, given the list and the token (status: text and --json name the owner).
    let out = Command::new(BIN)
        .args(["--daemon", &both, "status", &id])
        .env("AWCP_API_TOKEN", &token)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&format!("daemon      {b_id}")), "{text}");
    let out = Command::new(BIN)
        .args(["--json", "--daemon", &both, "status", &id])
        .env("AWCP_API_TOKEN", &token)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["owner"], b_id.as_str(), "{v}");
    // And revoke, through the client that was never told about B.
    client.revoke(&id, false).await.unwrap();
    assert_eq!(
        client.get(&id).await.unwrap().record.state,
        DelegationState::Cancelled,
        "{}",
        logs()
    );

    // Deleted, the token stops working on every daemon (within the 5 s the rows are kept).
    cb.delete_token(&made.id).await.unwrap();
    until(
        "B to refuse the deleted token",
        Duration::from_secs(10),
        async || {
            matches!(
                on_b.list().await,
                Err(ClientError::Refused { status: 401, .. })
            )
            .then_some(())
        },
        &logs,
    )
    .await;
    e1.stop().await;
    drop(b);
}
