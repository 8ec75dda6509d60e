//! The Executor's block cache: a second delegation of the same repository, even after an
//! Executor restart, is served from the cache and asks the Delegator for no content.

use std::time::Duration;

use awcp_ctl::executor::ExecutorConfig;
use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, fuse_available, sample_repo, sh};

const READ_ALL: &str = "find . -type f -exec cat {} + > /dev/null && echo read > /dev/null";

async fn bytes_served(h: &Harness, id: &str) -> u64 {
    let v = h.client.get(id).await.unwrap();
    v.transfer.expect("transfer counters")["bytesServed"]
        .as_u64()
        .unwrap()
}

fn mount_stats(h: &Harness, id: &str) -> serde_json::Value {
    let status: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(h.path(&format!("executor/state/{id}/status.json"))).unwrap(),
    )
    .unwrap();
    status["stats"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_delegation_after_an_executor_restart_starts_warm() {
    if !fuse_available() {
        return;
    }
    let mut h = Harness::start(READ_ALL).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    // Some content shared between files: fetched once even in the first delegation.
    sh(&repo, "seq 1 20000 > big.txt && cp big.txt big-copy.txt");

    let first = h.delegate(&repo, AccessMode::Ro, 600).await;
    assert_eq!(
        h.wait_end(&first, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    let served_first = bytes_served(&h, &first).await;
    let big = std::fs::metadata(repo.join("big.txt")).unwrap().len();
    assert!(
        served_first >= big,
        "first delegation served {served_first}"
    );
    let s = mount_stats(&h, &first);
    assert!(s["cacheMisses"].as_u64().unwrap() > 0, "{s}");

    // A new Executor process on the same directory: the memory tier is gone, only the disk
    // tier can make this warm.
    let cache = h
        .executor
        .executor
        .block_cache()
        .expect("a block cache by default");
    cache.flush();
    assert!(cache.stats().disk_blocks > 0, "{:?}", cache.stats());
    let mut c = ExecutorConfig::new(READ_ALL.into(), h.path("executor"));
    c.listen = "127.0.0.1:0".parse().unwrap();
    let restarted = awcp_ctl::executor::start(c).await.unwrap();
    std::mem::replace(&mut h.executor, restarted).stop().await;

    let second = h.delegate(&repo, AccessMode::Ro, 600).await;
    assert_eq!(
        h.wait_end(&second, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    let s = mount_stats(&h, &second);
    assert_eq!(
        bytes_served(&h, &second).await,
        0,
        "the second delegation fetched content again: {s}"
    );
    assert!(s["cacheHits"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["cacheMisses"].as_u64().unwrap(), 0, "{s}");
    assert!(s["bytesFromCache"].as_u64().unwrap() >= big, "{s}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_block_cache_every_delegation_fetches_and_nothing_is_kept() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_with(READ_ALL, |c| c.block_cache = None).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    for _ in 0..2 {
        let id = h.delegate(&repo, AccessMode::Ro, 600).await;
        assert_eq!(
            h.wait_end(&id, Duration::from_secs(60)).await,
            DelegationState::Completed
        );
        assert!(bytes_served(&h, &id).await > 0);
        assert_eq!(mount_stats(&h, &id)["cacheHits"].as_u64().unwrap(), 0);
    }
    assert!(!h.path("executor/cache").exists());
    h.stop().await;
}
