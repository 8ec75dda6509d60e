//! The kernel opens directories itself (no-opendir): listing a tree twice costs no
//! `opendir`/`releasedir` round trips, and the listing is still right.

use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, fuse_available, sample_repo, sh};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn directories_open_without_round_trips_and_list_correctly() {
    if !fuse_available() {
        return;
    }
    let agent = "ls -R > /dev/null && ls -R > /dev/null && \
                 mkdir -p new/deeper && touch new/deeper/f && rm -f new/deeper/f && touch new/g && \
                 find . -path ./.git -prune -o -print | LC_ALL=C sort > /tmp/awcp-listing-$AWCP_DELEGATION_ID";
    let h = Harness::start(agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    for i in 0..30 {
        std::fs::create_dir_all(repo.join(format!("d{}/e{}", i % 5, i))).unwrap();
        std::fs::write(repo.join(format!("d{}/e{}/f.txt", i % 5, i)), "x").unwrap();
    }
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    let listing_path = format!("/tmp/awcp-listing-{id}");
    let on_mount = std::fs::read_to_string(&listing_path).unwrap();
    let _ = std::fs::remove_file(&listing_path);
    let native = sh(
        &repo,
        "find . -path ./.git -prune -o -print | LC_ALL=C sort",
    );
    assert_eq!(on_mount, native, "the mount listed a different tree");
    let status: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(h.path(&format!("executor/state/{id}/status.json"))).unwrap(),
    )
    .unwrap();
    let ops = &status["stats"]["ops"];
    let n = |op: &str| ops.get(op).and_then(|v| v.as_u64()).unwrap_or(0);
    // One opendir answered ENOSYS switches the kernel to opening directories itself.
    assert!(n("opendir") <= 1, "{ops}");
    assert_eq!(n("releasedir"), 0, "{ops}");
    assert!(n("readdir") + n("readdirplus") > 0, "{ops}");
    h.stop().await;
}
