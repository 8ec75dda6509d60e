//! Changes that could not be written back before the lease ended (a revoke with
//! `--no-flush`) are kept on the Executor, never silently dropped; the Delegator collects
//! them later with the usual conflict checks, or discards them.

use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, appears, eventually, fuse_available, is_mounted, sample_repo};

async fn revoked_with_unwritten_changes() -> (Harness, std::path::PathBuf, String, tempfile::TempDir)
{
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r#"echo kept > kept.txt
        echo edited >> README.md
        mkdir -p new/dir && echo deep > new/dir/f
        touch {o}/ready
        exec sleep 600"#,
        o = out.path().display()
    );
    // Write-back waits ten minutes after each change: nothing reaches the Delegator live.
    let h = Harness::start_with(&agent, |c| c.sync_debounce = Duration::from_secs(600)).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(appears(&out.path().join("ready"), Duration::from_secs(30)).await);
    h.client.revoke(&id, true).await.unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(30)).await,
        DelegationState::Cancelled
    );
    assert!(eventually(Duration::from_secs(5), || !is_mounted(&h.mountpoint(&id))).await);
    assert!(
        !repo.join("kept.txt").exists(),
        "written back despite --no-flush"
    );
    (h, repo, id, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changes_kept_after_a_no_flush_revoke_are_collected() {
    if !fuse_available() {
        return;
    }
    let (h, repo, id, _out) = revoked_with_unwritten_changes().await;
    // The Delegator edits README.md meanwhile: collecting must not overwrite that.
    std::fs::write(repo.join("README.md"), "delegator's own edit\n").unwrap();
    let r = h.client.collect(&id, false).await.unwrap();
    assert!(r.applied >= 3, "{r:?}");
    assert_eq!(
        std::fs::read_to_string(repo.join("kept.txt")).unwrap(),
        "kept\n"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("new/dir/f")).unwrap(),
        "deep\n"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("README.md")).unwrap(),
        "delegator's own edit\n"
    );
    assert_eq!(r.conflicts.len(), 1, "{r:?}");
    let kept = r.conflicts[0].kept_as.clone().unwrap();
    assert!(
        std::fs::read_to_string(repo.join(kept))
            .unwrap()
            .ends_with("edited\n")
    );
    // Collected once: nothing is left to collect.
    let again = h.client.collect(&id, false).await.unwrap_err();
    assert!(
        again.to_string().contains("no unwritten changes"),
        "{again}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kept_changes_can_be_discarded() {
    if !fuse_available() {
        return;
    }
    let (h, repo, id, _out) = revoked_with_unwritten_changes().await;
    let r = h.client.collect(&id, true).await.unwrap();
    assert!(r.discarded);
    assert!(!repo.join("kept.txt").exists());
    let again = h.client.collect(&id, false).await.unwrap_err();
    assert!(
        again.to_string().contains("no unwritten changes"),
        "{again}"
    );
    h.stop().await;
}
