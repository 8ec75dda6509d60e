//! The kernel opens directories itself (no-opendir): listing a tree twice costs no
//! `opendir`/`releasedir` round trips, and the listing is still right. It opens existing
//! files itself too (no-open): reading a file again costs no round trip, and what is
//! written through such a descriptor is still written back, unlinked files stay readable.

use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, appears, eventually, fuse_available, sample_repo, sh};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn directories_open_without_round_trips_and_list_correctly() {
    if !fuse_available() {
        return;
    }
    let agent = "ls -R > /dev/null && ls -R > /dev/null && \
                 mkdir -p new/deeper && touch new/deeper/f && rm -f new/deeper/f && touch new/g && \
                 find . -path ./.git -prune -o -print | LC_ALL=C sort > ../../../listing-$AWCP_DELEGATION_ID";
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
    let listing_path = h.path(&format!("listing-{id}"));
    let on_mount = std::fs::read_to_string(&listing_path).unwrap();
    let _ = std::fs::remove_file(&listing_path);
    let native = sh(
        &repo,
        "find . -path ./.git -prune -o -print | LC_ALL=C sort",
    );
    assert_eq!(on_mount, native, "the mount listed a different tree");
    let ops = ops_of(&h, &id);
    let n = |op: &str| ops.get(op).and_then(|v| v.as_u64()).unwrap_or(0);
    // One opendir answered ENOSYS switches the kernel to opening directories itself.
    assert!(n("opendir") <= 1, "{ops}");
    assert_eq!(n("releasedir"), 0, "{ops}");
    assert!(n("readdir") + n("readdirplus") > 0, "{ops}");
    h.stop().await;
}

fn ops_of(h: &Harness, id: &str) -> serde_json::Value {
    let status: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(h.path(&format!("executor/state/{id}/status.json"))).unwrap(),
    )
    .unwrap();
    status["stats"]["ops"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn files_open_without_round_trips_and_their_writes_are_written_back() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    // Existing files are read many times, one is written through a descriptor held open
    // across the Delegator's check, one is unlinked while open and read afterwards, one
    // is truncated by `>`, and a new file is created (created files keep their handles).
    let agent = format!(
        r##"set -e
        for i in $(seq 50); do cat README.md calc/ops.py > /dev/null; done
        exec 3>>calc/ops.py
        echo "# held open" >&3
        exec 4<tool.sh
        rm tool.sh
        touch {o}/ready
        while [ ! -e {o}/go ]; do sleep 0.05; done
        cat <&4 > {o}/unlinked
        exec 4<&-
        echo "# after" >&3
        exec 3>&-
        echo new > fresh.txt
        printf "%s" "truncated" > README.md"##,
        o = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(
        appears(&out.path().join("ready"), Duration::from_secs(30)).await,
        "the agent did not start"
    );
    // Written back while the descriptor is still open: the kernel does not say when it is
    // closed, so the mount writes a file back once no write touched it for a while.
    assert!(
        eventually(Duration::from_secs(20), || std::fs::read_to_string(
            repo.join("calc/ops.py")
        )
        .unwrap_or_default()
        .ends_with("# held open\n"))
        .await,
        "a write through a descriptor held open was not written back"
    );
    assert!(
        eventually(Duration::from_secs(20), || !repo.join("tool.sh").exists()).await,
        "the removal of a file held open was not written back"
    );
    std::fs::write(out.path().join("go"), "").unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert_eq!(
        std::fs::read_to_string(out.path().join("unlinked")).unwrap(),
        "#!/bin/sh\necho old\n",
        "a file unlinked while open could not be read through its descriptor"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("calc/ops.py")).unwrap(),
        "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n# held open\n# after\n"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("fresh.txt")).unwrap(),
        "new\n"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("README.md")).unwrap(),
        "truncated"
    );
    let ops = ops_of(&h, &id);
    let n = |op: &str| ops.get(op).and_then(|v| v.as_u64()).unwrap_or(0);
    // One open answered ENOSYS switches the kernel to opening files itself; one flush
    // answered ENOSYS stops flushes.
    assert!(n("open") <= 1, "{ops}");
    assert!(n("flush") <= 1, "{ops}");
    assert!(n("read") > 0, "{ops}");
    h.stop().await;
}

/// A file written on the mount and read back stays in the kernel's page cache: its own
/// writes do not make the kernel drop its pages (no `FUSE_AUTO_INVAL_DATA`), so a linker
/// reading back what a compiler just wrote reads no page through the mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_file_written_on_the_mount_is_read_back_from_the_page_cache() {
    written_file_read_back(false).await;
}

/// The same with the kernel's writeback cache (the default): the writes reach the mount
/// batched, and the pages are still the kernel's to read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wbcache_a_file_written_on_the_mount_is_read_back_from_the_page_cache() {
    written_file_read_back(true).await;
}

async fn written_file_read_back(writeback_cache: bool) {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let src = out.path().join("src.bin");
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 7 + i / 251) as u8).collect();
    std::fs::write(&src, &data).unwrap();
    // Whole pages written (4 KiB at a time), the attributes asked for again (the writes
    // moved the mtime), then read back many times and compared.
    let agent = format!(
        r#"set -e
        dd if={src} of=blob bs=4096 status=none
        stat blob > /dev/null
        for i in $(seq 20); do cmp blob {src}; done"#,
        src = src.display()
    );
    let h = Harness::start_with(&agent, |c| c.writeback_cache = writeback_cache).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert_eq!(std::fs::read(repo.join("blob")).unwrap(), data);
    let ops = ops_of(&h, &id);
    let n = |op: &str| ops.get(op).and_then(|v| v.as_u64()).unwrap_or(0);
    if writeback_cache {
        // One request can carry up to 1 MiB of pages: 64 KiB is one or a few.
        assert!((1..=4).contains(&n("write")), "{ops}");
    } else {
        assert_eq!(n("write"), 16, "{ops}");
        assert!(n("getattr") > 0, "{ops}");
    }
    assert_eq!(
        n("read"),
        0,
        "pages written on the mount were read again: {ops}"
    );
    h.stop().await;
}
