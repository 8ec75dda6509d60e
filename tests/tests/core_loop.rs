//! The core loop of issue 2, end to end: real daemons on loopback, a real FUSE mount, real
//! tools on it, write-back, revocation and expiry.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available, is_mounted, sample_repo, sh};

const TASK_TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_workflow_on_the_mount_lands_in_the_delegators_repo() {
    git_workflow(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_workflow_with_fuse_passthrough() {
    git_workflow(true).await;
}

async fn git_workflow(passthrough: bool) {
    if !fuse_available() {
        return;
    }
    let agent = r#"set -e
        git status --porcelain > /dev/null
        echo "agent line" >> README.md
        mkdir -p docs && echo "notes" > docs/notes.md
        git add -A
        git -c user.email=agent@x -c user.name=agent commit -qm "agent: add notes"
        git diff HEAD~1 --stat | grep -q notes.md
        git log --oneline | grep -q "agent: add notes"
        test -z "$(git status --porcelain)"
        echo "git ok""#;
    let h = Harness::start_with(agent, |c| c.passthrough = passthrough).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert_eq!(
        h.wait_end(&id, TASK_TIMEOUT).await,
        DelegationState::Completed
    );
    let log = sh(&repo, "git log --format=%s");
    assert!(
        log.starts_with("agent: add notes\n"),
        "delegator log: {log}"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("docs/notes.md")).unwrap(),
        "notes\n"
    );
    // The index came back too: the Delegator's working tree is clean at the new commit.
    assert_eq!(sh(&repo, "git status --porcelain"), "");
    assert!(sh(&repo, "git diff HEAD~1 --stat").contains("README.md"));
    // Status reports transfer and write-back.
    let v = h.client.get(&id).await.unwrap();
    let t = v.transfer.expect("transfer counters");
    assert!(t["bytesServed"].as_u64().unwrap() > 0, "{t}");
    assert!(t["filesWritten"].as_u64().unwrap() >= 3, "{t}");
    assert!(!is_mounted(&h.mountpoint(&id)), "mount left behind");
    // The mount's own status file says how it served files.
    let status: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(h.path(&format!("executor/state/{id}/status.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(status["state"], "ended", "{status}");
    assert!(
        status["stats"]["ops"]["lookup"].as_u64().unwrap() > 0,
        "{status}"
    );
    let pt_opens = status["stats"]["passthroughOpens"].as_u64().unwrap();
    assert_eq!(pt_opens > 0, passthrough, "passthrough opens: {pt_opens}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_tests_run_and_a_chmod_x_script_runs() {
    if !fuse_available() {
        return;
    }
    let agent = r#"set -e
        python3 -m unittest discover -q -s tests -t . 2> unittest.log
        grep -q "OK" unittest.log
        printf '#!/bin/sh\necho ran-script\n' > run.sh
        chmod +x run.sh
        ./run.sh > ran.txt"#;
    let h = Harness::start(agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert_eq!(
        h.wait_end(&id, TASK_TIMEOUT).await,
        DelegationState::Completed
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("ran.txt")).unwrap(),
        "ran-script\n"
    );
    let mode = std::fs::metadata(repo.join("run.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o111, 0o111, "exec bits lost: {mode:o}");
    assert!(
        std::fs::read_to_string(repo.join("unittest.log"))
            .unwrap()
            .contains("Ran 2 tests")
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn editor_save_and_sed_keep_content_and_mode() {
    if !fuse_available() {
        return;
    }
    // An editor's save: write a temp file, fsync it, rename it over the original; and
    // sed -i, which does the same through its own temp file and keeps the mode.
    let agent = r#"set -e
        python3 - <<'PY'
import os
fd = os.open(".ops.py.swp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, b"def add(a, b):\n    return b + a\n")
os.fsync(fd)
os.close(fd)
os.rename(".ops.py.swp", "calc/ops.py")
PY
        sed -i 's/old/new/' tool.sh
        ./tool.sh > tool.out
        mv tool.out moved.out
        cp moved.out copied.out
        mkdir -p a/b/c && echo deep > a/b/c/f && rm -r a/b"#;
    let h = Harness::start(agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert_eq!(
        h.wait_end(&id, TASK_TIMEOUT).await,
        DelegationState::Completed
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("calc/ops.py")).unwrap(),
        "def add(a, b):\n    return b + a\n"
    );
    assert!(!repo.join(".ops.py.swp").exists());
    assert_eq!(
        std::fs::read_to_string(repo.join("tool.sh")).unwrap(),
        "#!/bin/sh\necho new\n"
    );
    let mode = std::fs::metadata(repo.join("tool.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755, "sed -i lost the mode: {mode:o}");
    assert_eq!(
        std::fs::read_to_string(repo.join("moved.out")).unwrap(),
        "new\n"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("copied.out")).unwrap(),
        "new\n"
    );
    assert!(!repo.join("tool.out").exists());
    assert!(repo.join("a").is_dir() && !repo.join("a/b").exists());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn read_only_delegation_refuses_every_write_in_the_mount_and_at_the_export() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r#"O={out}
        cat calc/ops.py > /dev/null && echo read-ok > $O/read
        touch new.txt 2> $O/touch; echo $? >> $O/touch
        sh -c 'echo x >> README.md' 2> $O/append; echo $? >> $O/append
        mkdir d 2> $O/mkdir; echo $? >> $O/mkdir
        rm tool.sh 2> $O/rm; echo $? >> $O/rm
        chmod 600 tool.sh 2> $O/chmod; echo $? >> $O/chmod
        touch $O/ready
        while [ ! -e $O/go ]; do sleep 0.05; done"#,
        out = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let before = sh(&repo, "ls -la; md5sum README.md tool.sh");
    let id = h.delegate(&repo, AccessMode::Ro, 600).await;
    let ready = out.path().join("ready");
    assert!(
        eventually(TASK_TIMEOUT, || ready.exists()).await,
        "agent never got ready"
    );
    assert_eq!(
        std::fs::read_to_string(out.path().join("read")).unwrap(),
        "read-ok\n"
    );
    for op in ["touch", "append", "mkdir", "rm", "chmod"] {
        let text = std::fs::read_to_string(out.path().join(op)).unwrap();
        assert!(
            text.contains("Read-only file system"),
            "{op} did not fail with EROFS: {text}"
        );
    }
    // A forged commit with the real token is refused by the export too.
    let token = h.daemon.daemon.export_token(&id).unwrap();
    let url = format!("{}/v1/exports/{id}/commit", h.daemon.daemon.export_url());
    let body = serde_json::json!({"commitId": "forged-1", "changes": [
        {"op": "unlink", "path": "README.md", "base": null}
    ]});
    let resp = reqwest::Client::new()
        .post(&url)
        .bearer_auth(&token)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 403);
    let err: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(err["code"], "READ_ONLY", "{err}");
    std::fs::write(out.path().join("go"), "").unwrap();
    assert_eq!(
        h.wait_end(&id, TASK_TIMEOUT).await,
        DelegationState::Completed
    );
    assert_eq!(
        sh(&repo, "ls -la; md5sum README.md tool.sh"),
        before,
        "ro workspace changed"
    );
    h.stop().await;
}

/// Read from a file on a revoked mount in a thread; an error must come back, not a hang.
fn read_fails_without_hanging(mut f: std::fs::File) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 16];
        let _ = tx.send(f.read(&mut buf).map(|_| ()));
    });
    match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(Err(_)) => {}
        Ok(Ok(())) => panic!("a read on a revoked mount succeeded"),
        Err(_) => panic!("a read on a revoked mount hung"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revoke_ends_access_while_a_file_is_open_and_keeps_closed_files() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r#"for i in 1 2 3 4 5; do echo "closed $i" > closed$i.txt; done
        echo edited >> README.md
        touch {out}/ready
        exec sleep 600"#,
        out = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let ready = out.path().join("ready");
    assert!(
        eventually(TASK_TIMEOUT, || ready.exists()).await,
        "agent never got ready"
    );
    let mnt = h.mountpoint(&id);
    // This process holds a file open on the mount across the revoke.
    let held = std::fs::File::open(mnt.join("calc/ops.py")).unwrap();
    let token = h.daemon.daemon.export_token(&id).unwrap();
    let revoked_at = Instant::now();
    h.client.revoke(&id, false).await.unwrap();
    // The export refuses the old token at once.
    let manifest = format!("{}/v1/exports/{id}/manifest", h.daemon.daemon.export_url());
    let status = reqwest::Client::new()
        .get(&manifest)
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    assert!(
        status == 401 || status == 403,
        "export answered {status} after revoke"
    );
    assert!(
        eventually(Duration::from_secs(2), || !is_mounted(&mnt)).await,
        "still mounted {:?} after revoke",
        revoked_at.elapsed()
    );
    read_fails_without_hanging(held);
    assert_eq!(
        h.wait_end(&id, TASK_TIMEOUT).await,
        DelegationState::Cancelled
    );
    // The final flush runs after the unmount, within the flush grace (5 s here).
    let all_closed_files_back = || {
        (1..=5).all(|i| {
            std::fs::read_to_string(repo.join(format!("closed{i}.txt")))
                .is_ok_and(|c| c == format!("closed {i}\n"))
        })
    };
    assert!(
        eventually(Duration::from_secs(6), all_closed_files_back).await,
        "a file closed before the revoke was lost"
    );
    assert!(
        std::fs::read_to_string(repo.join("README.md"))
            .unwrap()
            .ends_with("edited\n")
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unrenewed_lease_expires_like_a_revoke() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r#"echo before-expiry > kept.txt
        touch {out}/ready
        exec sleep 600"#,
        out = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let started = Instant::now();
    let id = h.delegate(&repo, AccessMode::Rw, 3).await;
    let ready = out.path().join("ready");
    assert!(
        eventually(TASK_TIMEOUT, || ready.exists()).await,
        "agent never got ready"
    );
    let mnt = h.mountpoint(&id);
    let held = std::fs::File::open(mnt.join("README.md")).unwrap();
    assert!(
        eventually(Duration::from_secs(8), || !is_mounted(&mnt)).await,
        "still mounted {:?} after a 3 s lease",
        started.elapsed()
    );
    read_fails_without_hanging(held);
    assert_eq!(
        h.wait_end(&id, TASK_TIMEOUT).await,
        DelegationState::Expired
    );
    assert!(
        eventually(Duration::from_secs(6), || {
            std::fs::read_to_string(repo.join("kept.txt")).is_ok_and(|c| c == "before-expiry\n")
        })
        .await,
        "a file closed before the expiry was lost"
    );
    let token = h.daemon.daemon.export_token(&id).unwrap();
    let manifest = format!("{}/v1/exports/{id}/manifest", h.daemon.daemon.export_url());
    let status = reqwest::Client::new()
        .get(&manifest)
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    assert!(
        status == 401 || status == 403 || status == 404,
        "export answered {status} after expiry"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_renewed_lease_outlives_its_first_ttl() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r#"touch {out}/ready
        while [ ! -e {out}/go ]; do sleep 0.05; done
        echo after-renew > renewed.txt"#,
        out = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 3).await;
    let ready = out.path().join("ready");
    assert!(
        eventually(TASK_TIMEOUT, || ready.exists()).await,
        "agent never got ready"
    );
    h.client.renew(&id, 120).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        is_mounted(&h.mountpoint(&id)),
        "the mount ended despite the renewal"
    );
    std::fs::write(out.path().join("go"), "").unwrap();
    assert_eq!(
        h.wait_end(&id, TASK_TIMEOUT).await,
        DelegationState::Completed
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("renewed.txt")).unwrap(),
        "after-renew\n"
    );
    h.stop().await;
}
