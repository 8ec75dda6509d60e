//! The Delegator daemon restarts in the middle of a delegation: delegations, leases and
//! exports come back from SQLite (or from PostgreSQL, `serve --state`: the daemon finds its
//! own delegations by the `daemon-id` in its state directory), the Executor's pending
//! write-back goes through once the data plane is back, and the delegation completes.

use std::net::SocketAddr;
use std::time::Duration;

use awcp_ctl::daemon::DaemonConfig;
use awcp_ctl::executor::ExecutorConfig;
use awcp_protocol::DelegationState;
use awcp_protocol::api::{DelegateRequest, EnvironmentSpec, ResourceSpec};
use awcp_protocol::messages::{AccessMode, ResourceType, TaskSpec};
use awcp_tests::{eventually, fuse_available, sample_repo};

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_daemon_restart_loses_nothing() {
    restart(false, false).await;
}

/// With two resources, both exports come back and both write-backs go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_daemon_restart_restores_every_resources_export() {
    restart(true, false).await;
}

/// The same with the state in PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_daemon_restart_on_postgres_loses_nothing() {
    restart(false, true).await;
}

async fn restart(several: bool, postgres: bool) {
    let db = if postgres {
        match awcp_ctl::store::postgres::testing::fresh_database() {
            Some(db) => Some(db),
            None => return,
        }
    } else {
        None
    };
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    awcp_tests::open_to_agents(tmp.path());
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let repo = tmp.path().join("repo");
    sample_repo(&repo);
    let mut dcfg = DaemonConfig::new(tmp.path().join("delegator"));
    dcfg.listen = free_addr();
    dcfg.export_listen = free_addr();
    dcfg.state = db.as_ref().map(|d| d.url.clone());
    let notes = tmp.path().join("notes");
    std::fs::create_dir_all(&notes).unwrap();
    // With two resources the agent runs above them: `workspace/` and `notes/`.
    let (w, n) = if several {
        ("workspace/", "notes/")
    } else {
        ("", "")
    };
    let agent = format!(
        r#"echo before > {w}before.txt
        {notes_before}
        touch {o}/ready
        while [ ! -e {o}/go ]; do sleep 0.05; done
        echo after > {w}after.txt
        {notes_after}"#,
        o = out.display(),
        notes_before = if several {
            format!("echo n1 > {n}n1.txt")
        } else {
            String::new()
        },
        notes_after = if several {
            format!("echo n2 > {n}n2.txt")
        } else {
            String::new()
        },
    );
    let mut ecfg = ExecutorConfig::new(agent, tmp.path().join("executor"));
    ecfg.listen = "127.0.0.1:0".parse().unwrap();
    awcp_tests::share_named_paths(&mut ecfg);
    let executor = awcp_ctl::executor::start(ecfg).await.unwrap();
    dcfg.executor_token = executor.executor.credential().map(str::to_owned);
    let daemon = awcp_ctl::daemon::start(dcfg.clone()).await.unwrap();
    let client = daemon.client();
    let req = DelegateRequest {
        executor_url: executor.awcp_url(),
        environment: EnvironmentSpec {
            resources: [("workspace", &repo), ("notes", &notes)]
                .iter()
                .take(if several { 2 } else { 1 })
                .map(|(name, dir)| ResourceSpec {
                    name: (*name).into(),
                    resource_type: ResourceType::Fs,
                    source: dir.display().to_string(),
                    mode: AccessMode::Rw,
                    include: None,
                    exclude: None,
                    gitignore: None,
                    allow_sensitive: None,
                })
                .collect(),
        },
        task: TaskSpec {
            description: "restart".into(),
            prompt: "restart".into(),
        },
        ttl_seconds: Some(600),
        access_mode: None,
        snapshot_mode: None,
        auth: None,
        transport: None,
        multi_round: None,
        git_remote: None,
        no_network: None,
    };
    let id = client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    assert!(eventually(Duration::from_secs(30), || out.join("ready").exists()).await);
    assert!(
        eventually(Duration::from_secs(5), || repo.join("before.txt").exists()).await,
        "write-back before the restart"
    );

    daemon.stop().await;
    // While the daemon is down the agent writes; the syncer keeps retrying.
    std::fs::write(out.join("go"), "").unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let daemon = awcp_ctl::daemon::start(dcfg).await.unwrap();
    let v = client.get(&id).await.unwrap();
    assert!(
        !v.record.state.is_terminal(),
        "state after restart: {:?}",
        v.record.state
    );

    let start = std::time::Instant::now();
    loop {
        let v = client.get(&id).await.unwrap();
        if v.record.state.is_terminal() {
            assert_eq!(v.record.state, DelegationState::Completed, "{v:#?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "never completed: {v:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        std::fs::read_to_string(repo.join("after.txt")).unwrap(),
        "after\n"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("before.txt")).unwrap(),
        "before\n"
    );
    if several {
        for f in ["n1", "n2"] {
            assert_eq!(
                std::fs::read_to_string(notes.join(format!("{f}.txt"))).unwrap(),
                format!("{f}\n")
            );
        }
    }
    executor.stop().await;
    daemon.stop().await;
}
