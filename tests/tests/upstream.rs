//! The Delegator's own changes during a lease, shown on the running mount (the export
//! watches the directory; the mount applies what it has no change of its own to).

use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, appears, eventually, fuse_available, sample_repo, sh};

fn read(p: impl AsRef<std::path::Path>) -> String {
    std::fs::read_to_string(p.as_ref()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delegator_edits_creates_and_removals_reach_the_running_mount() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    // The agent holds calc/ops.py open for writing with an edit of its own while the
    // Delegator edits it too: that file must keep the agent's version on the mount and
    // become a conflict at write-back. Everything else takes the Delegator's changes.
    let agent = format!(
        r##"set -e
        exec 3>>calc/ops.py
        echo "# executor edit" >&3
        cat README.md > {o}/readme-before
        touch {o}/ready
        while [ ! -e {o}/go ]; do sleep 0.05; done
        cat README.md > {o}/readme
        cat notes/new.txt > {o}/new
        ls > {o}/ls
        test ! -e tool.sh && echo gone > {o}/gone
        grep -c "executor edit" calc/ops.py > {o}/ops-local
        exec 3>&-
        echo "appended by the executor" >> README.md"##,
        o = out.path().display()
    );
    // The mount must know which files are open for writing: by default (no-open) the
    // kernel opens existing files without telling it.
    let h = Harness::start_with(&agent, |c| c.track_opens = true).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(
        appears(&out.path().join("ready"), Duration::from_secs(30)).await,
        "the agent did not start"
    );
    assert_eq!(read(out.path().join("readme-before")), "# sample\n");

    std::fs::write(repo.join("README.md"), "# changed by the delegator\n").unwrap();
    std::fs::create_dir(repo.join("notes")).unwrap();
    std::fs::write(repo.join("notes/new.txt"), "made on the delegator\n").unwrap();
    std::fs::remove_file(repo.join("tool.sh")).unwrap();
    std::fs::write(repo.join("calc/ops.py"), "# delegator rewrite\n").unwrap();

    // The mount shows it without any action of the agent (seen from outside it too).
    let mnt = h.mountpoint(&id);
    assert!(
        eventually(Duration::from_secs(20), || {
            read(mnt.join("README.md")) == "# changed by the delegator\n"
                && read(mnt.join("notes/new.txt")) == "made on the delegator\n"
                && !mnt.join("tool.sh").exists()
        })
        .await,
        "the Delegator's changes did not reach the mount: README {:?}",
        read(mnt.join("README.md"))
    );
    std::fs::write(out.path().join("go"), "").unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert_eq!(
        read(out.path().join("readme")),
        "# changed by the delegator\n"
    );
    assert_eq!(read(out.path().join("new")), "made on the delegator\n");
    assert_eq!(read(out.path().join("gone")), "gone\n");
    assert!(read(out.path().join("ls")).contains("notes"));
    assert_eq!(
        read(out.path().join("ops-local")),
        "1\n",
        "a file the agent had open for writing took the Delegator's version"
    );
    // The agent's append was made to the Delegator's new version: applied, no conflict.
    assert_eq!(
        read(repo.join("README.md")),
        "# changed by the delegator\nappended by the executor\n"
    );
    // Nothing the Delegator did was undone by the write-back.
    assert_eq!(read(repo.join("notes/new.txt")), "made on the delegator\n");
    assert!(!repo.join("tool.sh").exists(), "the removal was undone");
    // Both edits of calc/ops.py kept: the Delegator's in place, the agent's beside it.
    assert_eq!(read(repo.join("calc/ops.py")), "# delegator rewrite\n");
    let copies: Vec<String> = std::fs::read_dir(repo.join("calc"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ops.py.awcp-conflict-"))
        .collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert!(read(repo.join("calc").join(&copies[0])).contains("# executor edit"));
    let v = h.client.get(&id).await.unwrap();
    assert_eq!(v.transfer.unwrap()["conflicts"], 1);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_on_the_mount_sees_a_commit_made_on_the_delegator() {
    git_sees_a_delegator_commit(false).await;
}

/// The same with the kernel's writeback cache, which keeps its own sizes and times of the
/// files it caches, after the agent read what the Delegator's commit changes. (git and the
/// edit here replace files by `rename`, so the new inodes carry their own sizes; a file
/// changed in place under the cache is `awcpfs/tests/writeback_cache.rs`'s case, which
/// fails without the kernel forgetting the inode.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wbcache_git_on_the_mount_sees_a_delegator_commit_with_the_writeback_cache() {
    git_sees_a_delegator_commit(true).await;
}

async fn git_sees_a_delegator_commit(writeback_cache: bool) {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    // The agent reads what the commit will change first, so the kernel caches it.
    let agent = format!(
        r#"set -e
        G="git -c user.email=e@x -c user.name=executor"
        $G status --porcelain > /dev/null
        cat calc/ops.py .git/HEAD > /dev/null
        touch {o}/ready
        while [ ! -e {o}/go ]; do sleep 0.05; done
        $G log --format=%s -1 > {o}/log
        $G status --porcelain > {o}/status
        cat calc/ops.py > {o}/ops
        echo "print('hi')" > calc/extra.py
        $G add calc/extra.py
        $G commit -qm "executor: extra"
        "#,
        o = out.path().display()
    );
    let h = Harness::start_with(&agent, |c| c.writeback_cache = writeback_cache).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(appears(&out.path().join("ready"), Duration::from_secs(30)).await);
    // The agent's `git status` rewrote the index (its stat data, the fsmonitor extension),
    // and the mount writes that back when its round comes. Were that write-back to cross the
    // Delegator's commit, it would conflict with the Delegator's index, and the mount keeps
    // its own version at a conflicting write (docs/SEMANTICS.md; the crossings are made
    // deterministic in `awcpfs/tests/mount_sync.rs`'s `…_crossing_a_delegator_rewrite_…`).
    // This test is about the Delegator's commit reaching the mount, so the Delegator commits
    // once the agent's index has arrived (with the writeback cache, the kernel sends the
    // pages later than without).
    let mnt = h.mountpoint(&id);
    let landed = eventually(Duration::from_secs(20), || {
        std::fs::read(mnt.join(".git/index")).ok() == std::fs::read(repo.join(".git/index")).ok()
    })
    .await;
    assert!(landed, "the agent's index never reached the Delegator");
    sh(
        &repo,
        "sed -i 's/a + b/b + a/' calc/ops.py && git -c user.email=d@x -c user.name=delegator commit -qam 'delegator: swap'",
    );
    let head = sh(&repo, "git rev-parse HEAD");
    // git renames its new index into place after it moves the branch: wait for both (they
    // can reach the mount in two batches of changes).
    let index = std::fs::read(repo.join(".git/index")).unwrap();
    let reached = || {
        [
            read(mnt.join("calc/ops.py")).contains("b + a"),
            read(mnt.join(".git/refs/heads/main")) == head,
            std::fs::read(mnt.join(".git/index")).is_ok_and(|i| i == index),
        ]
    };
    let done = eventually(Duration::from_secs(20), || reached().iter().all(|r| *r)).await;
    assert!(
        done,
        "the Delegator's commit did not reach the mount (ops.py, the branch, the index): {:?}",
        reached()
    );
    std::fs::write(out.path().join("go"), "").unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert_eq!(read(out.path().join("log")), "delegator: swap\n");
    assert_eq!(
        read(out.path().join("status")),
        "",
        "git status on the mount is not clean"
    );
    assert!(read(out.path().join("ops")).contains("b + a"));
    // The agent's commit sits on top of the Delegator's, in the Delegator's repository.
    assert_eq!(
        sh(&repo, "git log --format=%s -2"),
        "executor: extra\ndelegator: swap\n"
    );
    assert_eq!(sh(&repo, "git status --porcelain"), "");
    sh(&repo, "git fsck --strict");
    h.stop().await;
}

/// With the default no-open mount, small files are read from the mount's pack file (fetched
/// there by the background hydration or by the read itself); a Delegator-side change must
/// replace what the mount shows — shorter content included — and never leave the pack's old
/// copy visible.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_packed_file_changed_on_the_delegator_shows_the_new_content() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r##"set -e
        cat calc/ops.py > {o}/before
        touch {o}/ready
        while [ ! -e {o}/go ]; do sleep 0.05; done
        cat calc/ops.py > {o}/after
        wc -c < calc/ops.py > {o}/size"##,
        o = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let original = read(repo.join("calc/ops.py"));
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(
        appears(&out.path().join("ready"), Duration::from_secs(30)).await,
        "the agent did not start"
    );
    assert_eq!(read(out.path().join("before")), original);
    std::fs::write(repo.join("calc/ops.py"), "x = 1\n").unwrap();
    let mnt = h.mountpoint(&id);
    assert!(
        eventually(Duration::from_secs(20), || read(mnt.join("calc/ops.py"))
            == "x = 1\n")
        .await,
        "the mount still shows {:?}",
        read(mnt.join("calc/ops.py"))
    );
    std::fs::write(out.path().join("go"), "").unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert_eq!(read(out.path().join("after")), "x = 1\n");
    assert_eq!(read(out.path().join("size")).trim(), "6");
    assert_eq!(read(repo.join("calc/ops.py")), "x = 1\n");
    h.stop().await;
}
