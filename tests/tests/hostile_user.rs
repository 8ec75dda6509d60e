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
