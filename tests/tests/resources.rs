//! Several resources in one `awcpfs` delegation (issue 6): each mounted under its name on
//! the Executor, each with its own access mode; revoke ends them all; names are checked.

use std::io::Write;
use std::time::Duration;

use awcp_ctl::client::ClientError;
use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available, is_mounted};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_resources_mount_by_name_ro_refuses_writes_and_revoke_unmounts_both() {
    if !fuse_available() {
        return;
    }
    // The agent stays until revoked; the test works on the mounts meanwhile.
    let h = Harness::start("sleep 120").await;
    let src = h.path("src");
    let data = h.path("data");
    std::fs::create_dir_all(src.join("lib")).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(src.join("lib/main.rs"), "fn main() {}\n").unwrap();
    std::fs::write(data.join("table.csv"), "a,b\n1,2\n").unwrap();
    let id = h
        .delegate_resources(
            &[
                ("src", &src, AccessMode::Rw),
                ("data", &data, AccessMode::Ro),
            ],
            600,
        )
        .await;
    let work = h.mountpoint(&id);
    let (msrc, mdata) = (work.join("src"), work.join("data"));
    assert!(
        eventually(WAIT, || is_mounted(&msrc) && is_mounted(&mdata)).await,
        "both resources should be mounted under their names in {}",
        work.display()
    );
    assert!(!is_mounted(&work), "the work dir itself holds the mounts");
    assert_eq!(
        std::fs::read_to_string(msrc.join("lib/main.rs")).unwrap(),
        "fn main() {}\n"
    );
    assert_eq!(
        std::fs::read_to_string(mdata.join("table.csv")).unwrap(),
        "a,b\n1,2\n"
    );

    // rw: a write reaches the Delegator.
    {
        let mut f = std::fs::File::create(msrc.join("lib/new.rs")).unwrap();
        f.write_all(b"pub fn f() {}\n").unwrap();
        f.sync_all().unwrap();
    }
    assert!(
        eventually(WAIT, || std::fs::read_to_string(src.join("lib/new.rs"))
            .ok()
            .as_deref()
            == Some("pub fn f() {}\n"))
        .await,
        "the write to the rw resource should reach the Delegator"
    );

    // ro: every kind of write is EROFS, and nothing reaches the Delegator.
    let err = std::fs::File::create(mdata.join("new.csv")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(nix::libc::EROFS), "create: {err}");
    let err = std::fs::OpenOptions::new()
        .append(true)
        .open(mdata.join("table.csv"))
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(nix::libc::EROFS), "append: {err}");
    let err = std::fs::remove_file(mdata.join("table.csv")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(nix::libc::EROFS), "unlink: {err}");
    assert!(!data.join("new.csv").exists());

    // Status: per resource and summed (the export counts a commit once it has applied it:
    // the file can be on disk a moment before).
    let start = std::time::Instant::now();
    let v = loop {
        let v = h.client.get(&id).await.unwrap();
        let written = v.transfer.as_ref().and_then(|t| t["filesWritten"].as_u64());
        if written.unwrap_or(0) >= 1 || start.elapsed() > WAIT {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let m = v.executor_mount.expect("the executor reports its mounts");
    let per = m["resources"].as_array().expect("per-resource mounts");
    let names: Vec<&str> = per.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, ["src", "data"], "{m}");
    let t = v.transfer.expect("transfer counters");
    assert_eq!(t["resources"].as_array().map(Vec::len), Some(2), "{t}");
    assert!(t["filesWritten"].as_u64().unwrap() >= 1, "{t}");
    let p = v.progress.expect("setup progress");
    assert_eq!(p.manifest.files_total, 2, "{p:?}");
    assert_eq!(p.resources.len(), 2, "{p:?}");

    // Revoke: both are fenced and unmounted.
    h.client.revoke(&id, false).await.unwrap();
    assert_eq!(h.wait_end(&id, WAIT).await, DelegationState::Cancelled);
    assert!(
        eventually(WAIT, || !is_mounted(&msrc) && !is_mounted(&mdata)).await,
        "revoke should unmount every resource"
    );
    assert!(
        eventually(WAIT, || !work.exists()).await,
        "the work dir and its mount points should be removed"
    );
    assert_eq!(
        std::fs::read_to_string(data.join("table.csv")).unwrap(),
        "a,b\n1,2\n"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_resources_run_the_agent_over_rounds_and_write_back_on_finish() {
    if !fuse_available() {
        return;
    }
    // The agent sees `<workDir>/<name>/…` and writes into the rw resource each round.
    let agent = r#"set -e
        test -f docs/guide.md
        echo "round $AWCP_ROUND" >> code/log.txt
        ! echo x > docs/guide.md 2>/dev/null"#;
    let h = Harness::start(agent).await;
    let code = h.path("code");
    let docs = h.path("docs");
    std::fs::create_dir_all(&code).unwrap();
    std::fs::create_dir_all(&docs).unwrap();
    std::fs::write(docs.join("guide.md"), "# guide\n").unwrap();
    let mut req = h.request(
        &[
            ("code", &code, AccessMode::Rw),
            ("docs", &docs, AccessMode::Ro),
        ],
        600,
    );
    req.multi_round = Some(true);
    let id = h
        .client
        .delegate(&req)
        .await
        .unwrap()
        .delegation_id
        .as_str()
        .to_string();
    let idle = || async {
        let start = std::time::Instant::now();
        loop {
            let s = h.client.get(&id).await.unwrap().record.state;
            if s == DelegationState::Idle || s.is_terminal() {
                return s;
            }
            assert!(start.elapsed() < WAIT, "still {}", s.as_str());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    assert_eq!(idle().await, DelegationState::Idle);
    let work = h.mountpoint(&id);
    assert!(
        is_mounted(&work.join("code")) && is_mounted(&work.join("docs")),
        "an idle session keeps every resource mounted"
    );
    h.client
        .continue_round(
            &id,
            &awcp_protocol::messages::TaskSpec {
                description: "again".into(),
                prompt: "again".into(),
            },
            None,
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(idle().await, DelegationState::Idle);
    assert_eq!(
        std::fs::read_to_string(code.join("log.txt")).unwrap(),
        "round 1\nround 2\n"
    );
    h.client.close(&id).await.unwrap();
    assert_eq!(h.wait_end(&id, WAIT).await, DelegationState::Completed);
    assert!(
        eventually(WAIT, || !is_mounted(&work.join("code"))
            && !is_mounted(&work.join("docs")))
        .await
    );
    assert_eq!(
        std::fs::read_to_string(docs.join("guide.md")).unwrap(),
        "# guide\n"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_resource_names_are_refused_before_anything_is_exported() {
    let h = Harness::start("true").await;
    let a = h.path("a");
    let b = h.path("b");
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    for (names, what) in [
        (["ok", "../escape"], "resource name"),
        (["ok", "a/b"], "resource name"),
        (["ok", ""], "resource name"),
        (["same", "same"], "given twice"),
    ] {
        let req = h.request(
            &[
                (names[0], &a, AccessMode::Rw),
                (names[1], &b, AccessMode::Ro),
            ],
            60,
        );
        match h.client.delegate(&req).await {
            Err(ClientError::Refused { status, body }) => {
                assert_eq!(status, 400, "{names:?}: {body:?}");
                assert!(body.error.contains(what), "{names:?}: {}", body.error);
                assert!(body.hint.is_some(), "{names:?}: a refusal says what to do");
            }
            other => panic!("{names:?} should be refused, got {other:?}"),
        }
    }
    // Nothing was started.
    assert!(h.client.list().await.unwrap().delegations.is_empty());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_staged_awcpfs_delegation_of_several_resources_is_refused_with_a_way_out() {
    let h = Harness::start("true").await;
    let a = h.path("a");
    let b = h.path("b");
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let mut req = h.request(&[("a", &a, AccessMode::Rw), ("b", &b, AccessMode::Rw)], 60);
    req.snapshot_mode = Some(awcp_protocol::api::SnapshotMode::Staged);
    match h.client.delegate(&req).await {
        Err(ClientError::Refused { status, body }) => {
            assert_eq!(status, 400, "{body:?}");
            assert!(body.error.contains("one resource"), "{}", body.error);
            assert!(body.hint.is_some());
        }
        other => panic!("should be refused, got {other:?}"),
    }
    assert!(h.client.list().await.unwrap().delegations.is_empty());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn setup_progress_is_served_during_delegate_and_kept_in_the_record() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("true").await;
    let ws = h.path("ws");
    std::fs::create_dir_all(ws.join("sub")).unwrap();
    std::fs::write(ws.join("a.bin"), vec![7u8; 300_000]).unwrap();
    std::fs::write(ws.join("sub/b.txt"), "hello\n").unwrap();
    std::fs::write(ws.join("sub/c.txt"), "").unwrap();
    let bytes = 300_000 + 6;

    // An "executor" that takes the connection and never answers: the delegation stays in
    // its invitation, so its setup progress can be read without racing it.
    let hang = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hang_url = format!("http://{}/awcp", hang.local_addr().unwrap());
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = held.clone();
    let acceptor = tokio::spawn(async move {
        while let Ok((sock, _)) = hang.accept().await {
            keep.lock().unwrap().push(sock);
        }
    });
    let mut req = h.request(&[("ws", &ws, AccessMode::Rw)], 600);
    req.executor_url = hang_url;
    let key = "test-progress-key-1";
    let client = h.client.clone();
    let pending = tokio::spawn(async move { client.delegate_with_progress(&req, key).await });
    let start = std::time::Instant::now();
    let seen = loop {
        if let Ok(p) = h.client.setup_progress(key).await
            && p.phase == "invite"
        {
            break p;
        }
        assert!(
            start.elapsed() < WAIT,
            "the setup never reached the invitation"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let m = seen.manifest;
    assert!(m.done && m.walked, "{m:?}");
    assert_eq!((m.files_total, m.files_hashed), (3, 3), "{m:?}");
    assert_eq!((m.bytes_total, m.bytes_hashed), (bytes, bytes), "{m:?}");
    // Cut the hanging executor off: the delegation fails, and its key is forgotten.
    acceptor.abort();
    held.lock().unwrap().clear();
    let r = pending.await.unwrap();
    assert!(r.is_err(), "{r:?}");
    assert!(h.client.setup_progress(key).await.is_err());

    // A delegation that runs keeps its figures in `GET /delegation/:id`.
    let id = h.delegate(&ws, AccessMode::Rw, 600).await;
    assert_eq!(h.wait_end(&id, WAIT).await, DelegationState::Completed);
    let v = h.client.get(&id).await.unwrap();
    let p = v.progress.expect("progress");
    assert_eq!(p.manifest.files_total, 3, "{p:?}");
    assert_eq!(p.manifest.bytes_hashed, bytes, "{p:?}");
    assert!(p.resources.is_empty(), "one resource: no per-resource list");
    // The Executor's `done` (after its final sync and unmount) came before `completed`.
    assert_eq!(p.phase, "ended", "{p:?}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_expiry_fences_and_unmounts_every_resource() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("sleep 120").await;
    let one = h.path("one");
    let two = h.path("two");
    std::fs::create_dir_all(&one).unwrap();
    std::fs::create_dir_all(&two).unwrap();
    std::fs::write(one.join("x"), "1").unwrap();
    std::fs::write(two.join("y"), "2").unwrap();
    let id = h
        .delegate_resources(
            &[("one", &one, AccessMode::Rw), ("two", &two, AccessMode::Rw)],
            3,
        )
        .await;
    let work = h.mountpoint(&id);
    assert!(
        eventually(WAIT, || is_mounted(&work.join("one"))
            && is_mounted(&work.join("two")))
        .await
    );
    assert_eq!(h.wait_end(&id, WAIT).await, DelegationState::Expired);
    assert!(
        eventually(WAIT, || !is_mounted(&work.join("one"))
            && !is_mounted(&work.join("two")))
        .await,
        "expiry should unmount every resource"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kept_changes_of_every_resource_are_collected_after_a_no_flush_revoke() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r#"echo one > a/kept-a.txt
        echo two > b/kept-b.txt
        touch {o}/ready
        exec sleep 600"#,
        o = out.path().display()
    );
    // Write-back waits ten minutes after each change: nothing reaches the Delegator live.
    let h = Harness::start_with(&agent, |c| c.sync_debounce = Duration::from_secs(600)).await;
    let (a, b) = (h.path("a"), h.path("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let id = h
        .delegate_resources(&[("a", &a, AccessMode::Rw), ("b", &b, AccessMode::Rw)], 600)
        .await;
    assert!(eventually(WAIT, || out.path().join("ready").exists()).await);
    h.client.revoke(&id, true).await.unwrap();
    assert_eq!(h.wait_end(&id, WAIT).await, DelegationState::Cancelled);
    assert!(!a.join("kept-a.txt").exists() && !b.join("kept-b.txt").exists());
    let r = h.client.collect(&id, false).await.unwrap();
    assert!(r.applied >= 2, "{r:?}");
    assert_eq!(
        std::fs::read_to_string(a.join("kept-a.txt")).unwrap(),
        "one\n"
    );
    assert_eq!(
        std::fs::read_to_string(b.join("kept-b.txt")).unwrap(),
        "two\n"
    );
    assert!(
        !a.join("kept-b.txt").exists(),
        "a resource's changes landed in another"
    );
    let again = h.client.collect(&id, false).await.unwrap_err();
    assert!(
        again.to_string().contains("no unwritten changes"),
        "{again}"
    );
    h.stop().await;
}
