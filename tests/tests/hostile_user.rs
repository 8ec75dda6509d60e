//! Secure by default, checked the way a hostile local user would try it: a second uid
//! (`nobody`, through `setpriv`) and plain HTTP clients without credentials, against the
//! daemon API, the Executor's routes of a running delegation, the state files on disk and
//! the mount. (Issue 18: the daemon took any local caller, anyone could fetch, delete or
//! cancel a delegation on the Executor, the state directory was 0755 with tokens in a 0644
//! WAL, and the mount was opened with `allow_other` where every user could reach it.)

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::hostile::curl_as;
use awcp_tests::{Harness, appears, eventually, fuse_available, is_mounted, sample_repo};

/// The uid a hostile local user has here.
const NOBODY: u32 = 65534;

/// Run `argv` as `uid` (primary group the same number, no supplementary groups).
fn as_user(uid: u32, argv: &[&str]) -> std::process::Output {
    Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .args(argv)
        .output()
        .expect("running setpriv (util-linux)")
}

/// `path` cannot be read (file) or listed (directory) by `nobody`; says what it got.
fn nobody_cannot_read(path: &Path) {
    let p = path.to_str().unwrap();
    let argv: &[&str] = if path.is_dir() {
        &["ls", "-a", p]
    } else {
        &["cat", p]
    };
    let out = as_user(NOBODY, argv);
    assert!(
        !out.status.success(),
        "nobody read {p}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Permission denied"), "{p}: {err}");
}

/// Make every directory from the temp dir down to `path` traversable by all, so that the
/// checks below test the modes of the state itself, not the temp dir's 0700.
fn open_the_way(tmp: &Path) {
    std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// Every file and directory that holds tokens, handles, journals or content is private.
fn assert_private(path: &Path) {
    let m = mode(path);
    let want = if path.is_dir() { 0o700 } else { 0o600 };
    assert_eq!(m & 0o077, 0, "{} is {m:o}, want {want:o}", path.display());
}

/// An agent that writes a file, says so, and waits to be stopped.
fn waiting_agent(out: &Path) -> String {
    format!(
        "echo kept > kept.txt && touch {o}/ready && exec sleep 600",
        o = out.display()
    )
}

fn status(r: &reqwest::Response) -> u16 {
    r.status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_local_user_gets_nothing_from_the_daemon_the_executor_the_disk_or_the_mount() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    open_the_way(out.path());
    // Changes are written back only after ten minutes: the state directory keeps them.
    let h = Harness::start_with(&waiting_agent(out.path()), |c| {
        c.sync_debounce = Duration::from_secs(600)
    })
    .await;
    open_the_way(h.tmp.path());
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(appears(&out.path().join("ready"), Duration::from_secs(30)).await);
    let http = reqwest::Client::new();

    // The daemon API, asked by nobody (the test's own uid is the daemon's, which the
    // kernel vouches for): 401 without the token, /health open, the token file unreadable.
    let api = h.daemon.url();
    for path in ["/delegations", &format!("/delegation/{id}")] {
        let (s, _) = curl_as(NOBODY, &[&format!("{api}{path}")]);
        assert_eq!(s, 401, "{path}");
    }
    let (s, _) = curl_as(
        NOBODY,
        &[
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            "{}",
            &format!("{api}/delegation/{id}/revoke"),
        ],
    );
    assert_eq!(s, 401);
    let steal = serde_json::json!({"executorUrl": "http://127.0.0.1:9/awcp",
        "environment": {"resources": [{"name": "w", "type": "fs", "source": "/etc", "mode": "ro"}]},
        "task": {"description": "steal", "prompt": "steal"}})
    .to_string();
    let (s, _) = curl_as(
        NOBODY,
        &[
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            &steal,
            &format!("{api}/delegate"),
        ],
    );
    assert_eq!(s, 401, "anyone may delegate /etc");
    let (s, _) = curl_as(NOBODY, &[&format!("{api}/health")]);
    assert_eq!(s, 200);
    let wrong = http
        .get(format!("{api}/t/{}/delegations", "0".repeat(64)))
        .send()
        .await
        .unwrap();
    assert_eq!(status(&wrong), 401, "a wrong token in the path");
    let token_file = h.path("delegator").join(awcp_ctl::daemon::API_TOKEN_FILE);
    assert_private(&token_file);
    nobody_cannot_read(&token_file);
    let token = std::fs::read_to_string(&token_file).unwrap();
    let ok = http
        .get(format!("{api}/delegations"))
        .bearer_auth(token.trim())
        .send()
        .await
        .unwrap();
    assert_eq!(status(&ok), 200, "the token file's token opens the API");
    let ok = http
        .get(format!("{}/delegations", h.daemon.token_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(status(&ok), 200, "so does the token in the path");

    // The Executor's routes of the running delegation: nothing without its proof.
    let awcp = h.executor.awcp_url();
    for (method, path) in [
        ("GET", format!("{awcp}/tasks/{id}/bundle")),
        ("DELETE", format!("{awcp}/tasks/{id}/bundle")),
        ("GET", format!("{awcp}/tasks/{id}/result")),
        ("GET", format!("{awcp}/tasks/{id}/events")),
        ("POST", format!("{awcp}/tasks/{id}/ack")),
        ("POST", format!("{awcp}/cancel/{id}")),
        // Symptom: the AECP witness route ran any command in the mount for anyone.
        ("POST", format!("{awcp}/tasks/{id}/aecp/witness")),
    ] {
        let rb = match method {
            "GET" => http.get(&path),
            "DELETE" => http.delete(&path),
            _ => http.post(&path),
        };
        let r = rb.try_clone().unwrap().send().await.unwrap();
        assert_eq!(status(&r), 401, "{method} {path}");
        let r = rb.bearer_auth("not-the-proof").send().await.unwrap();
        assert_eq!(status(&r), 403, "{method} {path} with a wrong token");
    }
    for kind in ["CLOSE", "ERROR"] {
        let msg = serde_json::json!({"version": "1", "type": kind, "delegationId": id,
            "code": "CANCELLED", "message": "hostile"});
        let r = http.post(&awcp).json(&msg).send().await.unwrap();
        assert_eq!(status(&r), 401, "{kind} without the proof");
    }
    // The task still runs, mounted.
    let view = h.client.get(&id).await.unwrap();
    assert_eq!(view.record.state, DelegationState::Running);
    assert!(is_mounted(&h.mountpoint(&id)));

    // The state on disk: private, and unreadable by nobody.
    let daemon_state = h.path("delegator");
    let exec = h.path("executor");
    let state = exec.join("state").join(&id);
    let mut secrets: Vec<PathBuf> = vec![
        daemon_state.clone(),
        daemon_state.join("delegator.db"),
        daemon_state.join("delegator.db-wal"),
        exec.join("state"),
        exec.join("work"),
        exec.join("cache"),
        state.clone(),
        state.join("handle.json"),
        state.join("journal.log"),
        state.join("upper"),
    ];
    secrets.retain(|p| p.exists() || panic!("{} is missing", p.display()));
    for p in &secrets {
        assert_private(p);
    }
    // Opened one level at a time: each is refused by its own mode.
    std::fs::set_permissions(&exec, std::fs::Permissions::from_mode(0o755)).unwrap();
    for p in [
        &daemon_state,
        &exec.join("state"),
        &exec.join("work"),
        &exec.join("cache"),
    ] {
        nobody_cannot_read(p);
    }
    std::fs::set_permissions(&daemon_state, std::fs::Permissions::from_mode(0o711)).unwrap();
    nobody_cannot_read(&daemon_state.join("delegator.db"));
    nobody_cannot_read(&daemon_state.join("delegator.db-wal"));
    nobody_cannot_read(&token_file);

    // The mount: the 0700 work directory keeps another uid out of it, by name...
    let mp = h.mountpoint(&id);
    nobody_cannot_read(&mp);
    nobody_cannot_read(&mp.join("README.md"));
    // ...while a process of the agent that drops to another uid inside the workspace (a
    // test suite run as root does) is served by the files' modes, as in a local directory
    // behind the same 0700 directory: it reads a 0644 file and may not write.
    let inside = Command::new("setpriv")
        .args([
            format!("--reuid={NOBODY}"),
            format!("--regid={NOBODY}"),
            "--clear-groups".into(),
        ])
        .args(["sh", "-c", "cat README.md && ! touch nobodys 2>/dev/null"])
        .current_dir(&mp)
        .output()
        .unwrap();
    assert!(
        inside.status.success() && !inside.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&inside.stderr)
    );
    assert!(!mp.join("nobodys").exists());
    // Root, the mounting user, still works there.
    assert_eq!(
        std::fs::read_to_string(mp.join("kept.txt")).unwrap(),
        "kept\n"
    );

    // The Delegator's own daemon cancels with the proof, and the reason says it was it.
    h.client.revoke(&id, true).await.unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(30)).await,
        DelegationState::Cancelled
    );
    assert!(eventually(Duration::from_secs(10), || !is_mounted(&mp)).await);
    // Kept changes: still nothing for a caller without the proof, even with no task held.
    let r = http
        .get(format!("{awcp}/tasks/{id}/bundle"))
        .send()
        .await
        .unwrap();
    assert_eq!(status(&r), 401);
    let r = http
        .delete(format!("{awcp}/tasks/{id}/bundle"))
        .send()
        .await
        .unwrap();
    assert_eq!(status(&r), 401);
    let collected = h.client.collect(&id, false).await.unwrap();
    assert!(collected.applied >= 1, "nothing collected");
    assert_eq!(
        std::fs::read_to_string(repo.join("kept.txt")).unwrap(),
        "kept\n"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_records_who_asked_for_it() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let h = Harness::start(&waiting_agent(out.path())).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(appears(&out.path().join("ready"), Duration::from_secs(30)).await);
    // The proof, as the Delegator holds it (the Executor kept it in the handle).
    let handle: awcp_protocol::transport::AwcpfsHandle = serde_json::from_slice(
        &std::fs::read(h.path("executor/state").join(&id).join("handle.json")).unwrap(),
    )
    .unwrap();
    let http = reqwest::Client::new();
    let awcp = h.executor.awcp_url();
    let r = http
        .post(format!("{awcp}/cancel/{id}"))
        .bearer_auth(&handle.token)
        .send()
        .await
        .unwrap();
    assert_eq!(status(&r), 200);
    assert!(
        eventually(Duration::from_secs(30), || !is_mounted(&h.mountpoint(&id))).await,
        "the cancel did not end the mount"
    );
    h.wait_end(&id, Duration::from_secs(30)).await;
    let error = h.client.get(&id).await.unwrap().record.error;
    let msg = error.map(|e| e.message).unwrap_or_default();
    assert!(
        msg.contains("cancelled by the Delegator"),
        "the recorded reason does not say who cancelled: {msg:?}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_user_runs_the_agent_and_owns_the_mount_others_stay_out() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    // The agent (nobody) says it is ready there.
    std::fs::set_permissions(out.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let agent = format!(
        "id -u > uid.txt && stat -c %u README.md > owner.txt && echo made > made.txt \
         && touch {o}/ready && sleep 600",
        o = out.path().display()
    );
    let h = Harness::start_with(&agent, |c| {
        c.agent_user = Some(awcp_ctl::executor::AgentUser::lookup("nobody").unwrap())
    })
    .await;
    // The agent user must pass through the temp dir (an Executor's --dir would be
    // somewhere it can reach).
    open_the_way(h.tmp.path());
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(
        appears(&out.path().join("ready"), Duration::from_secs(30)).await,
        "the agent did not get to work: {:?}",
        h.client.get(&id).await.unwrap().record.error
    );
    let mp = h.mountpoint(&id);
    // The work directory is the agent's and private: a third uid cannot enter it.
    let work = h.path("executor/work");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&work).unwrap()),
        NOBODY
    );
    assert_private(&work);
    let other = as_user(12345, &["ls", mp.to_str().unwrap()]);
    assert!(!other.status.success(), "a third user listed the mount");
    // Root (the Executor's user) still works there.
    assert_eq!(
        std::fs::read_to_string(mp.join("made.txt")).unwrap(),
        "made\n"
    );
    // Written back live, as any agent's changes.
    let view = h.client.get(&id).await.unwrap();
    assert!(
        appears(&repo.join("owner.txt"), Duration::from_secs(30)).await,
        "not written back: {:?}",
        view.executor_mount
    );
    h.client.revoke(&id, false).await.unwrap();
    h.wait_end(&id, Duration::from_secs(30)).await;
    for (f, want) in [("uid.txt", "65534\n"), ("owner.txt", "65534\n")] {
        assert_eq!(std::fs::read_to_string(repo.join(f)).unwrap(), want, "{f}");
    }
    h.stop().await;
}

// ---- The Executor trusts no one (issue 29) ----

/// `curl` as `nobody`: the HTTP status (0 when none came) and the body.
fn curl_as_nobody(args: &[&str]) -> (u16, String) {
    let mut argv = vec!["curl", "-s", "-o", "-", "-w", "\n%{http_code}"];
    argv.extend_from_slice(args);
    let out = as_user(NOBODY, &argv);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", text.as_str()));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// POST `body` (JSON) to `url` as `nobody`, without any credential.
fn post_as_nobody(url: &str, body: &serde_json::Value) -> (u16, String) {
    curl_as_nobody(&[
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        &body.to_string(),
        url,
    ])
}

fn new_id() -> String {
    awcp_protocol::DelegationId::from_random_bytes(rand::random())
        .as_str()
        .to_string()
}

/// A reference Delegator's INVITE (`archive`), with its SDK's `auth` when given.
fn ref_invite(id: &str, credential: Option<&str>) -> serde_json::Value {
    let mut v = serde_json::json!({
        "version": "1", "type": "INVITE", "delegationId": id,
        "task": {"description": "run the tests", "prompt": "run the tests"},
        "lease": {"ttlSeconds": 600, "accessMode": "rw"}, "retentionMs": 1000,
        "environment": {"resources": [{"name": "workspace", "type": "fs", "mode": "rw"}]},
        "requirements": {"transport": "archive"}
    });
    if let Some(c) = credential {
        v["auth"] = serde_json::json!({"type": "bearer", "credential": c});
    }
    v
}

/// A reference Delegator's START carrying `files` as the `workspace` resource.
fn ref_start(id: &str, files: &[(&str, &[u8])]) -> serde_json::Value {
    use base64::Engine as _;
    let entries: Vec<(String, &[u8])> = files
        .iter()
        .map(|(n, d)| (format!("workspace/{n}"), *d))
        .collect();
    let refs: Vec<(&str, &[u8])> = entries.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    let zip = awcp_tests::reference::zip_entries(&refs, zip::CompressionMethod::Deflated);
    serde_json::json!({
        "version": "1", "type": "START", "delegationId": id,
        "lease": {"expiresAt": "2099-01-01T00:00:00.000Z", "accessMode": "rw"},
        "transportHandle": {"transport": "archive",
            "workspaceBase64": base64::engine::general_purpose::STANDARD.encode(&zip),
            "checksum": awcp_tests::reference::sha256_hex(&zip)}
    })
}

async fn post_json(url: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(serde_json::Value::Null))
}

// Symptom: `nobody` sent INVITE + START to a default Executor whose agent runs the
// workspace's tests, and its test file ran as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn anonymous_invite_and_start_are_refused_and_the_attackers_code_never_runs() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    // The confined agent may write its proof there (the positive control below).
    std::fs::set_permissions(out.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let shared = out.path().to_path_buf();
    // The agent runs what the workspace holds (as an agent running its tests does).
    let h = Harness::start_with("sh attack.sh", move |c| c.agent_allow_write.push(shared)).await;
    let awcp = h.executor.awcp_url();
    let pwned = out.path().join("pwned");
    let attack = format!("id -u > {}", pwned.display());
    let id = new_id();
    for body in [
        ref_invite(&id, None),
        ref_invite(&id, Some("a-guessed-credential")),
    ] {
        let (s, b) = post_as_nobody(&awcp, &body);
        assert_eq!(s, 200, "{b}");
        assert!(
            b.contains("\"AUTH_FAILED\""),
            "anonymous INVITE accepted: {b}"
        );
    }
    let (s, b) = post_as_nobody(&awcp, &ref_start(&id, &[("attack.sh", attack.as_bytes())]));
    assert_eq!(s, 404, "anonymous START: {b}");
    let (s, st) = curl_as_nobody(&[&format!("{awcp}/status")]);
    assert_eq!(s, 200);
    assert!(st.contains("\"pendingInvitations\":0"), "{st}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!pwned.exists(), "the attacker's code ran");
    // The same work from a Delegator holding the credential does run: the refusal above is
    // what kept the attacker out.
    let id = new_id();
    let (_, accept) = post_json(&awcp, &ref_invite(&id, Some(&h.credential()))).await;
    assert_eq!(accept["type"], "ACCEPT", "{accept}");
    let (s, _) = post_json(&awcp, &ref_start(&id, &[("attack.sh", attack.as_bytes())])).await;
    assert_eq!(s, 200);
    assert!(appears(&pwned, Duration::from_secs(30)).await);
    h.stop().await;
}

// Symptom: `nobody` read a reference Delegator's delegation ids from `GET /awcp/status`,
// then its snapshot (the workspace's content) from the event stream, and could cancel it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_archive_delegation_is_unreadable_and_uncancellable_without_its_proof() {
    if !fuse_available() {
        return;
    }
    let flags = tempfile::tempdir().unwrap();
    let go = flags.path().join("go");
    let agent = format!("while [ ! -e {} ]; do sleep 0.05; done", go.display());
    let h = Harness::start(&agent).await;
    let awcp = h.executor.awcp_url();
    // A reference Delegator with the credential in its SDK's `auth`; like the reference,
    // it sends no header on any later request: its id is its proof.
    let id = new_id();
    let (_, accept) = post_json(&awcp, &ref_invite(&id, Some(&h.credential()))).await;
    assert_eq!(accept["type"], "ACCEPT", "{accept}");
    let events = reqwest::get(format!("{awcp}/tasks/{id}/events"))
        .await
        .unwrap();
    assert_eq!(events.status().as_u16(), 200);
    let (s, _) = post_json(&awcp, &ref_start(&id, &[("secret.txt", b"TOP-SECRET\n")])).await;
    assert_eq!(s, 200);
    assert!(
        eventually(Duration::from_secs(30), || h
            .mountpoint(&id)
            .join("workspace/secret.txt")
            .exists())
        .await
    );
    // nobody: the status names no delegation, no path; nothing public holds the id.
    let (s, st) = curl_as_nobody(&[&format!("{awcp}/status")]);
    assert_eq!(s, 200);
    assert!(st.contains("\"activeDelegations\":1"), "{st}");
    assert!(!st.contains(&id) && !st.contains("workPath"), "{st}");
    let mounts = as_user(NOBODY, &["cat", "/proc/self/mountinfo"]);
    assert!(!String::from_utf8_lossy(&mounts.stdout).contains(&id));
    // Guessing: another id finds nothing, reads nothing, cancels nothing.
    let guess = new_id();
    let (_, stream) = curl_as_nobody(&["-m", "5", &format!("{awcp}/tasks/{guess}/events")]);
    assert!(
        !stream.contains("TOP-SECRET") && !stream.contains("snapshot"),
        "{stream}"
    );
    let (s, _) = curl_as_nobody(&["-X", "POST", &format!("{awcp}/cancel/{guess}")]);
    assert_eq!(s, 404);
    let (s, _) = curl_as_nobody(&[&format!("{awcp}/tasks/{guess}/result")]);
    assert_eq!(s, 404);
    // A weak id cannot be used to make such a delegation: it could be guessed.
    let (_, refused) = post_json(
        &awcp,
        &ref_invite(
            "dlg_00000000000000000000000000000001",
            Some(&h.credential()),
        ),
    )
    .await;
    assert_eq!(refused["type"], "ERROR", "{refused}");
    assert!(
        refused["message"].as_str().unwrap().contains("guessable"),
        "{refused}"
    );
    // Still running; its Delegator (naming its id) cancels it, as the reference does.
    let r: serde_json::Value = reqwest::get(format!("{awcp}/tasks/{id}/result"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["status"], "running", "{r}");
    let (s, b) = post_json(&format!("{awcp}/cancel/{id}"), &serde_json::json!({})).await;
    assert_eq!(s, 200, "{b}");
    let evs = tokio::time::timeout(
        Duration::from_secs(60),
        awcp_tests::reference::read_data_lines(events),
    )
    .await
    .unwrap();
    assert_eq!(evs.last().unwrap()["code"], "CANCELLED", "{evs:?}");
    std::fs::write(&go, "").unwrap();
    h.stop().await;
}

// Symptom: 8 anonymous INVITEs filled every slot for minutes; pending INVITEs were not
// listed, could not be cancelled and never expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pending_invites_expire_and_anonymous_ones_cannot_fill_the_slots() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_with("true", |c| {
        c.pending_timeout = Duration::from_secs(2);
        c.max_concurrent = 2;
    })
    .await;
    let awcp = h.executor.awcp_url();
    let cred = h.credential();
    for _ in 0..10 {
        let (_, b) = post_as_nobody(&awcp, &ref_invite(&new_id(), None));
        assert!(b.contains("\"AUTH_FAILED\""), "{b}");
    }
    let (a, b) = (new_id(), new_id());
    for id in [&a, &b] {
        let (_, r) = post_json(&awcp, &ref_invite(id, Some(&cred))).await;
        assert_eq!(r["type"], "ACCEPT", "{r}");
    }
    let (_, full) = post_json(&awcp, &ref_invite(&new_id(), Some(&cred))).await;
    assert_eq!(full["type"], "ERROR", "{full}");
    let status = |bearer: Option<String>| {
        let awcp = awcp.clone();
        async move {
            let mut rq = reqwest::Client::new().get(format!("{awcp}/status"));
            if let Some(b) = bearer {
                rq = rq.bearer_auth(b);
            }
            rq.send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        }
    };
    // The operator sees them (with the credential), anonymous callers only count them.
    let st = status(Some(cred.clone())).await;
    let listed: Vec<&str> = st["pending"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap())
        .collect();
    assert!(
        listed.contains(&a.as_str()) && listed.contains(&b.as_str()),
        "{st}"
    );
    assert!(st["pending"][0]["expiresAt"].is_string(), "{st}");
    let anon = status(None).await;
    assert_eq!(anon["pendingInvitations"], 2, "{anon}");
    assert!(anon.get("pending").is_none(), "{anon}");
    // ...and cancels one.
    let r = reqwest::Client::new()
        .post(format!("{awcp}/cancel/{b}"))
        .bearer_auth(&cred)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // The other expires: its stream says so, its slot is free, a late START is told why.
    let events = reqwest::get(format!("{awcp}/tasks/{a}/events"))
        .await
        .unwrap();
    let evs = tokio::time::timeout(
        Duration::from_secs(30),
        awcp_tests::reference::read_data_lines(events),
    )
    .await
    .expect("the pending INVITE never expired");
    assert_eq!(evs.last().unwrap()["code"], "START_EXPIRED", "{evs:?}");
    assert_eq!(status(None).await["pendingInvitations"], 0);
    let (s, late) = post_json(&awcp, &ref_start(&a, &[("a.txt", b"a")])).await;
    assert_eq!(s, 404, "{late}");
    assert!(
        late["error"].as_str().unwrap().contains("expired"),
        "{late}"
    );
    let (_, again) = post_json(&awcp, &ref_invite(&new_id(), Some(&cred))).await;
    assert_eq!(again["type"], "ACCEPT", "{again}");
    h.stop().await;

    // Open to anyone (--unsafe-open): one peer still cannot take every slot.
    let h = Harness::start_with("true", |c| c.unsafe_open = true).await;
    let awcp = h.executor.awcp_url();
    let accepted = (0..8)
        .filter(|_| {
            post_as_nobody(&awcp, &ref_invite(&new_id(), None))
                .1
                .contains("ACCEPT")
        })
        .count();
    assert_eq!(accepted, 2, "one peer's pending INVITEs are limited");
    h.stop().await;
}

/// The resident set of this process (the Executor runs in it), in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

// Symptom: the Executor buffered anonymous bodies up to 512 MiB; three concurrent 300 MB
// junk requests took its RSS to ~1.36 GB.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_300_mb_anonymous_body_is_refused_early() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("true").await;
    let awcp = h.executor.awcp_url();
    // Declared: refused from the header, before a byte of it is read.
    {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut s = tokio::net::TcpStream::connect(h.executor.addr)
            .await
            .unwrap();
        s.write_all(
            b"POST /awcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 314572800\r\n\r\n",
        )
        .await
        .unwrap();
        let mut answer = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut answer))
            .await
            .expect("no early answer")
            .unwrap();
        let head = String::from_utf8_lossy(&answer[..n]);
        assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    }
    // Streamed (chunked, no length), three at once, by nobody. Without `Expect:
    // 100-continue`: curl reports an interim 100 as the answer when the connection closes
    // right after it, which says nothing about the limit.
    let baseline = rss_kib();
    let script = format!(
        "head -c 314572800 /dev/zero | curl -s -o /dev/null -w '%{{http_code}}' -X POST \
         -H 'Content-Type: application/json' -H 'Expect:' -T - {awcp}"
    );
    let senders: Vec<_> = (0..3)
        .map(|_| {
            let script = script.clone();
            std::thread::spawn(move || as_user(NOBODY, &["sh", "-c", &script]))
        })
        .collect();
    let started = std::time::Instant::now();
    let mut peak = baseline;
    while !senders.iter().all(|s| s.is_finished()) {
        peak = peak.max(rss_kib());
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the uploads were not cut short"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for s in senders {
        let out = s.join().unwrap();
        let code = String::from_utf8_lossy(&out.stdout).to_string();
        // 413, or the connection closed under the sender once the limit was passed.
        assert!(code == "413" || code == "000", "answered {code}");
    }
    let grew_mib = peak.saturating_sub(baseline) / 1024;
    assert!(grew_mib < 100, "the Executor's RSS grew by {grew_mib} MiB");
    h.stop().await;
}

// Symptom: `awcpfs export --handle-out` wrote the handle, capability token included, 0644:
// `nobody` read it and fetched the manifest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_handle_out_file_is_private() {
    let Some(bin) = awcp_tests::fleet::awcp_ctl_bin()
        .and_then(|b| b.parent().map(|d| d.join("awcpfs")))
        .filter(|b| b.is_file())
    else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the awcpfs binary must be built in CI"
        );
        eprintln!(
            "\n!!!!!!!! SKIPPING: no awcpfs binary beside the tests (cargo build -p awcpfs) !!!!!!!!\n"
        );
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    open_the_way(tmp.path());
    let dir = tmp.path().join("ws");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.txt"), "a").unwrap();
    let handle = tmp.path().join("handle.json");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _export = Kill(
        Command::new(bin)
            .arg("export")
            .arg(&dir)
            .args(["--listen", "127.0.0.1:0", "--handle-out"])
            .arg(&handle)
            .arg("--state-dir")
            .arg(tmp.path().join("state"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(appears(&handle, Duration::from_secs(30)).await);
    assert!(
        eventually(Duration::from_secs(10), || std::fs::read(&handle)
            .is_ok_and(|b| b.ends_with(b"}")))
        .await
    );
    assert_eq!(mode(&handle), 0o600);
    nobody_cannot_read(&handle);
}
