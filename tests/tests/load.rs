//! Load: many concurrent delegations from one Delegator to one Executor, each with several
//! threads doing mixed file operations on its mount, one revoked in the middle of it. No
//! deadlock, no acknowledged write lost, the revoked one ends within the bound, the others
//! finish. Sizes come from AWCP_LOAD_DELEGATIONS / AWCP_LOAD_THREADS (defaults 20 and 8).

use std::time::{Duration, Instant};

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available, is_mounted};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_delegations_with_one_revoked_midway() {
    if !fuse_available() {
        return;
    }
    let delegations = env("AWCP_LOAD_DELEGATIONS", 20);
    let threads = env("AWCP_LOAD_THREADS", 8);
    let out = tempfile::tempdir().unwrap();
    // Each agent: `threads` writers doing create / append / rename / unlink / mkdir, each
    // acknowledging a file (outside the mount) once its close returned; then it waits.
    let agent = format!(
        r#"O={o}/$AWCP_DELEGATION_ID; mkdir -p $O
        for t in $(seq 1 {threads}); do
          (
            mkdir -p t$t
            for i in $(seq 1 15); do
              printf 'd %s t %s i %s\n' $AWCP_DELEGATION_ID $t $i > t$t/f$i || exit 0
              echo t$t/f$i >> $O/acked.$t
              echo more >> t$t/f$i && echo t$t/f$i+ >> $O/acked.$t
              mv t$t/f$i t$t/g$i && echo t$t/g$i >> $O/moved.$t
              [ $((i % 4)) -eq 0 ] && rm t$t/g$i && echo t$t/g$i >> $O/removed.$t
            done
          ) &
        done
        wait
        touch $O/done
        while [ ! -e {o}/go ]; do sleep 0.1; done"#,
        o = out.path().display(),
        threads = threads
    );
    let h = Harness::start_with(&agent, |c| c.max_concurrent = delegations + 1).await;
    let mut ids = Vec::new();
    let mut repos = Vec::new();
    for n in 0..delegations {
        let repo = h.path(&format!("repo{n}"));
        std::fs::create_dir_all(&repo).unwrap();
        std::fs::write(repo.join("seed"), format!("seed {n}\n")).unwrap();
        ids.push(h.delegate(&repo, AccessMode::Rw, 600).await);
        repos.push(repo);
    }
    // Revoke one while its writers run.
    let victim = ids[delegations / 2].clone();
    let victim_mnt = h.mountpoint(&victim);
    assert!(
        eventually(Duration::from_secs(60), || {
            std::fs::read_dir(out.path().join(&victim)).is_ok_and(|d| d.count() > 0)
        })
        .await,
        "the victim's agent never started writing"
    );
    let revoked_at = Instant::now();
    h.client.revoke(&victim, false).await.unwrap();
    assert!(
        eventually(Duration::from_secs(2), || !is_mounted(&victim_mnt)).await,
        "the revoked mount is still there after {:?}",
        revoked_at.elapsed()
    );
    // The others finish their writing.
    for id in ids.iter().filter(|i| **i != victim) {
        let done = out.path().join(id).join("done");
        assert!(
            eventually(Duration::from_secs(180), || done.exists()).await,
            "{id}: the agent's writers did not finish (deadlock?)"
        );
    }
    std::fs::write(out.path().join("go"), "").unwrap();
    for id in &ids {
        let state = h.wait_end(id, Duration::from_secs(120)).await;
        let want = if *id == victim {
            DelegationState::Cancelled
        } else {
            DelegationState::Completed
        };
        assert_eq!(state, want, "{id}");
    }
    // Every task has ended on the Executor, final flushes included.
    let status_url = format!("{}/status", h.executor.awcp_url());
    let start = Instant::now();
    loop {
        let st: serde_json::Value = reqwest::get(&status_url)
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if st["activeDelegations"] == 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "tasks still active: {st}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // No acknowledged write lost: every file the agents acknowledged (and did not move or
    // remove afterwards) is at its Delegator with the right content — the revoked one
    // included, for what it acknowledged before the revoke.
    for (id, repo) in ids.iter().zip(&repos) {
        let dir = out.path().join(id);
        for t in 1..=threads {
            let acked = std::fs::read_to_string(dir.join(format!("acked.{t}"))).unwrap_or_default();
            let moved = std::fs::read_to_string(dir.join(format!("moved.{t}"))).unwrap_or_default();
            let removed =
                std::fs::read_to_string(dir.join(format!("removed.{t}"))).unwrap_or_default();
            for line in acked.lines() {
                let (file, appended) = match line.strip_suffix('+') {
                    Some(f) => (f, true),
                    None => (line, false),
                };
                let moved_to = file.replace("/f", "/g");
                let final_path = if moved.lines().any(|m| m == moved_to) {
                    if removed.lines().any(|r| r == moved_to) {
                        continue;
                    }
                    moved_to
                } else {
                    file.to_string()
                };
                let i = file.rsplit('f').next().unwrap();
                let first = format!("d {id} t {t} i {i}\n");
                let content = std::fs::read_to_string(repo.join(&final_path))
                    .unwrap_or_else(|e| panic!("{id}: acknowledged {final_path} lost: {e}"));
                assert!(
                    content.starts_with(&first),
                    "{id}: {final_path} holds {content:?}"
                );
                if appended {
                    assert_eq!(content, format!("{first}more\n"), "{id}: {final_path}");
                }
            }
        }
    }
    h.stop().await;
}
