//! The Executor renews its leases before they run out, up to the Delegator's lifetime limit;
//! a partitioned or limited lease still ends on time.

use std::time::{Duration, Instant};

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available, is_mounted, sample_repo};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_executor_renews_a_short_lease_while_it_works() {
    if !fuse_available() {
        return;
    }
    // A 3 s lease, and an agent that needs 5 s.
    let agent = "sleep 5; echo done-after-renewals > renewed.txt";
    let h = Harness::start_with(agent, |c| c.renew_margin = Some(Duration::from_secs(2))).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 3).await;
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(30)).await,
        DelegationState::Completed
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("renewed.txt")).unwrap(),
        "done-after-renewals\n"
    );
    let v = h.client.get(&id).await.unwrap();
    assert!(v.lease.renewals >= 1, "no renewal recorded: {:?}", v.lease);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renewals_stop_at_the_delegators_maximum_lease() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_full(
        "exec sleep 60",
        |d| d.max_lease = Duration::from_secs(5),
        |c| c.renew_margin = Some(Duration::from_millis(1500)),
    )
    .await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let started = Instant::now();
    let id = h.delegate(&repo, AccessMode::Rw, 2).await;
    let mnt = h.mountpoint(&id);
    assert!(eventually(Duration::from_secs(10), || is_mounted(&mnt)).await);
    // Past the first TTL thanks to renewals...
    tokio::time::sleep(Duration::from_millis(3500).saturating_sub(started.elapsed())).await;
    assert!(is_mounted(&mnt), "the lease was not renewed");
    // ...but not past the 5 s maximum.
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(20)).await,
        DelegationState::Expired
    );
    assert!(
        eventually(Duration::from_secs(3), || !is_mounted(&mnt)).await,
        "still mounted after the maximum lease"
    );
    assert!(
        started.elapsed() < Duration::from_secs(12),
        "{:?}",
        started.elapsed()
    );
    h.stop().await;
}
