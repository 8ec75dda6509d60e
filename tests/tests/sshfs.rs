//! The reference's `sshfs` transport, end to end, with the real tools: the daemon starts a
//! real `sshd` (Debian `openssh-server`) per delegation, chrooted and SFTP-only, and the
//! Executor mounts it with the real `sshfs`, both on loopback. An agent edits the workspace
//! with `python3` and commits with `git` on the mount, and the Delegator has the result; a
//! revoke mid-task unmounts the Executor and ends the sshd with its sessions; a
//! reference-shaped Executor ([`awcp_tests::reference::RefExecutor`]) mounts our handle as
//! the reference's does, and the handle's certificate logs in while the delegation runs and
//! is refused once it was revoked or its lease expired; and a reference Delegator's handle
//! (no `hostKey`) drives our Executor, which refuses handle options that could run a command.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use awcp_protocol::api::SnapshotMode;
use awcp_protocol::messages::AccessMode;
use awcp_protocol::{DelegationState, TransportType};
use awcp_tests::reference::RefExecutor;
use awcp_tests::{Harness, appears, eventually, fuse_available, sample_repo, sh, tools_available};

/// Whether this machine can run these tests: FUSE, root (sshd chroots), sshd, sshfs and
/// the agents' tools. Elsewhere they are skipped loudly; under `CI=true` they fail.
fn ready() -> bool {
    if !fuse_available()
        || !tools_available(&["sshd", "sshfs", "ssh-keygen", "sftp", "git", "python3"])
    {
        return false;
    }
    if !nix::unistd::geteuid().is_root() {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "the sshfs tests must run under CI, which is root"
        );
        eprintln!("SKIPPED: the sshfs transport's Delegator side needs root (chroot, bind mounts)");
        return false;
    }
    true
}

async fn delegate(h: &Harness, dir: &Path, ttl: u64) -> String {
    let mut req = awcp_tests::request(
        h.executor.awcp_url(),
        &[("workspace", dir, AccessMode::Rw)],
        ttl,
    );
    req.transport = Some(TransportType::Sshfs);
    h.client
        .delegate(&req)
        .await
        .unwrap_or_else(|e| panic!("delegate with sshfs: {e:#}"))
        .delegation_id
        .as_str()
        .to_string()
}

/// Whether anything is mounted at `path` (per the kernel's mount table).
fn mounted(path: &Path) -> bool {
    let p = path.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(p.as_str()))
}

/// Whether a process runs with `needle` in its command line.
fn process_with(needle: &str) -> bool {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .any(|c| String::from_utf8_lossy(&c).contains(needle))
}

/// The delegation's server is gone: its chroot, its bind mount, its sshd.
async fn server_gone(h: &Harness, id: &str) {
    let chroot = PathBuf::from("/run/awcp-sshfs").join(id);
    let cfg = h.path(&format!("delegator/sshfs/{id}/sshd_config"));
    assert!(
        eventually(Duration::from_secs(10), || !chroot.exists()
            && !process_with(&cfg.display().to_string()))
        .await,
        "the delegation's sshd or chroot outlived it"
    );
    assert!(!mounted(&chroot.join("root/workspace")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_edits_and_commits_over_sshfs_and_the_delegator_has_it() {
    if !ready() {
        return;
    }
    // The agent runs as the product runs it (its own user, under Landlock), in the mount.
    let agent = "python3 -c \"import pathlib; p = pathlib.Path('README.md'); \
                 p.write_text(p.read_text() + 'edited over sshfs\\n')\" && \
                 python3 -c \"open('notes.txt', 'w').write('new file\\n')\" && \
                 rm tool.sh && \
                 git -c user.email=e@x -c user.name=executor add -A && \
                 git -c user.email=e@x -c user.name=executor commit -qm 'executor edit' && \
                 git status --porcelain | wc -l > status-lines.txt && echo finished";
    let h = Harness::start(agent).await;
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    sample_repo(&ws);
    // The Executor offers sshfs (it is installed here).
    let id = delegate(&h, &ws, 300).await;
    let end = h.wait_end(&id, Duration::from_secs(90)).await;
    let view = h.client.get(&id).await.unwrap();
    assert_eq!(end, DelegationState::Completed, "{view:#?}");
    // Written live into the Delegator's workspace, owned as the workspace is.
    assert_eq!(
        std::fs::read_to_string(ws.join("README.md")).unwrap(),
        "# sample\nedited over sshfs\n"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("notes.txt")).unwrap(),
        "new file\n"
    );
    assert!(!ws.join("tool.sh").exists());
    // The agent's commit is in the Delegator's repository, whole.
    let log = sh(&ws, "git log --format=%s");
    assert_eq!(
        log.lines().collect::<Vec<_>>(),
        ["executor edit", "initial"],
        "{log}"
    );
    sh(&ws, "git fsck --strict");
    assert_eq!(sh(&ws, "git status --porcelain"), "?? status-lines.txt\n");
    // Nothing left behind: the mount, the credential, the server.
    let mp = h.mountpoint(&id);
    assert!(!mounted(&mp), "the Executor left {} mounted", mp.display());
    assert!(
        eventually(Duration::from_secs(5), || !mp.exists()).await,
        "{} left behind",
        mp.display()
    );
    assert!(
        !h.path(&format!("executor/state/{id}/sshfs")).exists(),
        "the credential is removed"
    );
    server_gone(&h, &id).await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoke_mid_task_unmounts_and_ends_the_sessions() {
    if !ready() {
        return;
    }
    let marks = tempfile::tempdir().unwrap();
    let started = marks.path().join("started");
    // Appends to a file of the workspace ten times a second, live over SFTP.
    let agent = format!(
        "touch {} && i=0; while true; do echo $i >> progress.txt || exit 3; i=$((i+1)); sleep 0.1; done",
        started.display()
    );
    let h = Harness::start(&agent).await;
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "original\n").unwrap();
    let id = delegate(&h, &ws, 300).await;
    assert!(
        appears(&started, Duration::from_secs(60)).await,
        "agent never started"
    );
    let progress = ws.join("progress.txt");
    assert!(
        eventually(Duration::from_secs(10), || std::fs::read_to_string(
            &progress
        )
        .is_ok_and(|s| s.lines().count() >= 3))
        .await,
        "the agent's writes do not reach the Delegator live"
    );
    let mp = h.mountpoint(&id);
    assert!(mounted(&mp), "mounted while the task runs");
    h.client.revoke(&id, true).await.unwrap();
    let end = h.wait_end(&id, Duration::from_secs(30)).await;
    assert_eq!(end, DelegationState::Cancelled);
    assert!(
        eventually(Duration::from_secs(20), || !mounted(&mp)).await,
        "{} still mounted after the revoke",
        mp.display()
    );
    // Access has ended: the writes stopped and the mount's path leads nowhere.
    server_gone(&h, &id).await;
    let len = std::fs::metadata(&progress).unwrap().len();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        std::fs::metadata(&progress).unwrap().len(),
        len,
        "writes still arrive after the revoke"
    );
    assert!(std::fs::read(mp.join("workspace/a.txt")).is_err());
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "original\n"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn staged_snapshots_are_refused_with_what_to_do() {
    if !ready() {
        return;
    }
    let h = Harness::start("true").await;
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let mut req = awcp_tests::request(
        h.executor.awcp_url(),
        &[("workspace", &ws, AccessMode::Rw)],
        60,
    );
    req.transport = Some(TransportType::Sshfs);
    req.snapshot_mode = Some(SnapshotMode::Staged);
    let err = h.client.delegate(&req).await.unwrap_err().to_string();
    assert!(err.contains("no snapshot to stage"), "{err}");
    assert!(err.contains("awcpfs or archive"), "{err}");
    // Files that cannot be hidden from sshfs: a sensitive one refuses the delegation.
    std::fs::write(ws.join(".env"), "SECRET=1\n").unwrap();
    req.snapshot_mode = None;
    let err = h.client.delegate(&req).await.unwrap_err().to_string();
    assert!(err.contains(".env"), "{err}");
    h.stop().await;
}

/// Log in with the handle's credential and list the export's root.
fn sftp_with(handle: &Value, dir: &Path) -> Result<String, String> {
    let key = dir.join("key");
    let cert = dir.join("key-cert.pub");
    let _ = std::fs::remove_file(&key);
    std::fs::write(&key, handle["credential"]["privateKey"].as_str().unwrap()).unwrap();
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::write(&cert, handle["credential"]["certificate"].as_str().unwrap()).unwrap();
    let ep = &handle["endpoint"];
    let out = Command::new("sftp")
        .args(["-b", "-", "-P", &ep["port"].to_string()])
        .arg("-o")
        .arg(format!("IdentityFile={}", key.display()))
        .arg("-o")
        .arg(format!("CertificateFile={}", cert.display()))
        .args(["-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes"])
        .args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
        ])
        .arg(format!(
            "{}@{}",
            ep["user"].as_str().unwrap(),
            ep["host"].as_str().unwrap()
        ))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write as _;
            c.stdin.take().unwrap().write_all(b"ls /\n")?;
            c.wait_with_output()
        })
        .unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Wait until the Executor reported `running` (the reference-shaped one: once mounted, so
/// that it then waits for `proceed`).
async fn running(h: &Harness, id: &str) {
    let start = std::time::Instant::now();
    loop {
        let s = h.client.get(id).await.unwrap().record.state;
        if s == DelegationState::Running {
            return;
        }
        assert!(
            !s.is_terminal() && start.elapsed() < Duration::from_secs(30),
            "{id} is {} while waiting for running",
            s.as_str()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The START a reference-shaped Executor received for `id`.
fn start_handle(ex: &RefExecutor, id: &str) -> Value {
    ex.state
        .messages
        .lock()
        .unwrap()
        .iter()
        .find(|m| m["type"] == "START" && m["delegationId"] == id)
        .map(|m| m["transportHandle"].clone())
        .expect("START received")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reference_executor_mounts_our_handle_and_the_certificate_ends_with_the_lease() {
    if !ready() {
        return;
    }
    let h = Harness::start("true").await;
    let ref_work = h.path("ref-work");
    std::fs::create_dir_all(&ref_work).unwrap();
    let ex = RefExecutor::start(
        &ref_work,
        true,
        Arc::new(|dir: &Path| {
            // Not once the delegation was revoked or expired: the mount is dead then.
            let _ = std::fs::write(
                dir.join("workspace/from-ref.txt"),
                "written by the reference\n",
            );
        }),
    )
    .await;
    let creds = tempfile::tempdir().unwrap();
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "a\n").unwrap();
    let send = |ttl: u64| {
        let mut req = awcp_tests::request(
            ex.url(),
            &[("workspace", ws.as_path(), AccessMode::Rw)],
            ttl,
        );
        req.transport = Some(TransportType::Sshfs);
        req.auth = None;
        let client = h.client.clone();
        async move {
            client
                .delegate(&req)
                .await
                .unwrap()
                .delegation_id
                .as_str()
                .to_string()
        }
    };

    // 1. Completed: the wire shape, a live login, the reference's write, then refused.
    let id = send(300).await;
    let handle = start_handle(&ex, &id);
    running(&h, &id).await;
    assert_eq!(handle["transport"], "sshfs");
    assert_eq!(handle["exportLocator"], "/");
    assert_eq!(handle["endpoint"]["host"], "127.0.0.1");
    assert!(handle["endpoint"]["port"].as_u64().is_some_and(|p| p > 0));
    assert!(handle["endpoint"]["user"].is_string());
    assert!(
        handle["credential"]["privateKey"]
            .as_str()
            .unwrap()
            .starts_with("-----BEGIN OPENSSH PRIVATE KEY-----")
    );
    assert!(
        handle["credential"]["certificate"]
            .as_str()
            .unwrap()
            .starts_with("ssh-ed25519-cert-v01@openssh.com ")
    );
    assert!(
        handle["hostKey"]
            .as_str()
            .unwrap()
            .starts_with("ssh-ed25519 ")
    );
    let listing = sftp_with(&handle, creds.path()).expect("the certificate logs in while running");
    assert!(listing.contains("workspace"), "{listing}");
    // The certificate itself says what it is for: this delegation, SFTP only.
    std::fs::write(
        creds.path().join("c.pub"),
        handle["credential"]["certificate"].as_str().unwrap(),
    )
    .unwrap();
    let info = sh(creds.path(), "ssh-keygen -L -f c.pub");
    assert!(info.contains(&format!("awcp-{id}")), "{info}");
    assert!(info.contains("force-command internal-sftp"), "{info}");
    assert!(!info.contains("permit-pty"), "{info}");
    ex.state.proceed.notify_one();
    let end = h.wait_end(&id, Duration::from_secs(60)).await;
    assert_eq!(end, DelegationState::Completed);
    assert_eq!(
        std::fs::read_to_string(ws.join("from-ref.txt")).unwrap(),
        "written by the reference\n"
    );
    server_gone(&h, &id).await;
    let refused = sftp_with(&handle, creds.path());
    assert!(
        refused.is_err(),
        "the certificate still logs in after the delegation: {refused:?}"
    );

    // 2. Revoked while running: refused from then on.
    let id = send(300).await;
    let handle = start_handle(&ex, &id);
    running(&h, &id).await;
    sftp_with(&handle, creds.path()).expect("logs in while running");
    h.client.revoke(&id, true).await.unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(30)).await,
        DelegationState::Cancelled
    );
    server_gone(&h, &id).await;
    assert!(
        sftp_with(&handle, creds.path()).is_err(),
        "logs in after the revoke"
    );
    ex.state.proceed.notify_one();

    // 3. The lease expires (8 s): refused from then on.
    let id = send(8).await;
    let handle = start_handle(&ex, &id);
    running(&h, &id).await;
    sftp_with(&handle, creds.path()).expect("logs in while the lease lasts");
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(30)).await,
        DelegationState::Expired
    );
    server_gone(&h, &id).await;
    assert!(
        sftp_with(&handle, creds.path()).is_err(),
        "logs in after the lease expired"
    );
    ex.state.proceed.notify_one();
    assert!(
        eventually(Duration::from_secs(30), || !std::fs::read_dir(&ref_work)
            .unwrap()
            .flatten()
            .any(|e| mounted(&e.path())))
        .await,
        "a mount was left behind"
    );
    h.stop().await;
}

/// A reference Delegator's handle (no `hostKey`: the first key is pinned per delegation;
/// `follow_symlinks`, as its export root links to the resources) drives our Executor: the
/// agent writes through the mount, `done` names no snapshot, nothing stays mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reference_delegator_drives_our_executor_with_sshfs() {
    if !ready() {
        return;
    }
    let h = Harness::start("python3 -c \"open('from-agent.txt', 'w').write('agent\\n')\"").await;
    // A live sshd and a handle for it: our daemon's, for a delegation held by a
    // reference-shaped Executor that only mounts and waits.
    let ref_work = h.path("ref-work");
    std::fs::create_dir_all(&ref_work).unwrap();
    let ex = RefExecutor::start(&ref_work, true, Arc::new(|_: &Path| {})).await;
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "a\n").unwrap();
    let mut req = awcp_tests::request(
        ex.url(),
        &[("workspace", ws.as_path(), AccessMode::Rw)],
        300,
    );
    req.transport = Some(TransportType::Sshfs);
    let held = h.client.delegate(&req).await.unwrap().delegation_id;
    let held = held.as_str().to_string();
    running(&h, &held).await;
    let mut handle = start_handle(&ex, &held);
    handle.as_object_mut().unwrap().remove("hostKey");
    handle["options"] = serde_json::json!({"ServerAliveInterval": "15"});

    let awcp = h.executor.awcp_url();
    let id = awcp_protocol::DelegationId::from_random_bytes(rand::random())
        .as_str()
        .to_string();
    let client = reqwest::Client::new();
    let invite = serde_json::json!({
        "version": "1", "type": "INVITE", "delegationId": id,
        "auth": {"type": "bearer", "credential": h.credential()},
        "task": {"description": "Write", "prompt": "Write a file"},
        "lease": {"ttlSeconds": 600, "accessMode": "rw"},
        "retentionMs": 604800000,
        "environment": {"resources": [{"name": "workspace", "type": "fs", "mode": "rw"}]},
        "requirements": {"transport": "sshfs"}
    });
    let accept: Value = client
        .post(&awcp)
        .json(&invite)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(accept["type"], "ACCEPT", "{accept}");
    let events = reqwest::get(format!("{awcp}/tasks/{id}/events"))
        .await
        .unwrap();
    let start = serde_json::json!({
        "version": "1", "type": "START", "delegationId": id,
        "lease": {"expiresAt": "2099-01-01T00:00:00.000Z", "accessMode": "rw"},
        "transportHandle": handle
    });
    let ok: Value = client
        .post(&awcp)
        .json(&start)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ok, serde_json::json!({"ok": true}));
    let events = tokio::time::timeout(
        Duration::from_secs(60),
        awcp_tests::reference::read_data_lines(events),
    )
    .await
    .expect("the task did not end");
    let last = events.last().unwrap();
    assert_eq!(last["type"], "done", "{events:#?}");
    assert!(last.get("snapshotIds").is_none(), "{last}");
    assert!(
        !events.iter().any(|e| e["type"] == "snapshot"),
        "{events:#?}"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("from-agent.txt")).unwrap(),
        "agent\n"
    );
    let mp = h.mountpoint(&id);
    assert!(!mounted(&mp));
    assert!(!h.path(&format!("executor/state/{id}/sshfs")).exists());
    // A handle asking for an option that would run a command is refused before mounting.
    let mut bad = start_handle(&ex, &held);
    bad["options"] = serde_json::json!({"ssh_command": "touch /tmp/owned"});
    let id2 = awcp_protocol::DelegationId::from_random_bytes(rand::random())
        .as_str()
        .to_string();
    let mut invite2 = invite.clone();
    invite2["delegationId"] = id2.clone().into();
    let accept: Value = client
        .post(&awcp)
        .json(&invite2)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(accept["type"], "ACCEPT", "{accept}");
    let events = reqwest::get(format!("{awcp}/tasks/{id2}/events"))
        .await
        .unwrap();
    let mut start2 = start.clone();
    start2["delegationId"] = id2.clone().into();
    start2["transportHandle"] = bad;
    client.post(&awcp).json(&start2).send().await.unwrap();
    let events = tokio::time::timeout(
        Duration::from_secs(60),
        awcp_tests::reference::read_data_lines(events),
    )
    .await
    .expect("the task did not end");
    let last = events.last().unwrap();
    assert_eq!(last["type"], "error", "{events:#?}");
    assert_eq!(last["code"], "WORKSPACE_INVALID", "{last}");
    assert!(
        last["message"].as_str().unwrap().contains("ssh_command"),
        "{last}"
    );
    assert!(!mounted(&h.mountpoint(&id2)));
    ex.state.proceed.notify_one();
    assert_eq!(
        h.wait_end(&held, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    // A daemon stopped right after a delegation ended still takes its server down whole
    // (the stop waits for it): no bind mount outlives the daemon.
    h.stop().await;
    let chroot = PathBuf::from("/run/awcp-sshfs").join(&held);
    assert!(
        !mounted(&chroot.join("root/workspace")),
        "a bind mount outlived the daemon"
    );
    assert!(!chroot.exists(), "a chroot outlived the daemon");
}
