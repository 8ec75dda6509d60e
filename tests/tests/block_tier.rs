//! The block tier (`serve --blocks s3://…`) against a real S3-compatible server (`s3s-fs`,
//! started by the harness): fleet hydration with the bytes of both tiers counted, a corrupted
//! object refused by hash and fetched from the Delegator, a revoke that ends store access,
//! and a second delegation of a workspace already in the store.
//!
//! Skipped loudly where FUSE or `s3s-fs` is missing, failed under `CI=true`.

use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::s3::{S3Server, block_hashes};
use awcp_tests::{Harness, fleet, fuse_available};

const BLOCK: usize = awcp_protocol::dataplane::DEFAULT_BLOCK_SIZE as usize;

/// FUSE and s3s-fs, or a loud skip.
fn setup() -> Option<S3Server> {
    if !fuse_available() {
        return None;
    }
    S3Server::start()
}

/// A harness whose daemon has the block tier under `prefix` (URLs valid `url_ttl`), whose
/// Executor keeps no block cache (every block comes from one of the tiers), and whose agent
/// copies `big.bin` out of the mount to `<tmp>/out/<id>` after a `cat` of everything.
async fn harness(s3: &S3Server, prefix: &str, url_ttl: Duration, agent: &str) -> Harness {
    let tier = s3.tier(prefix, url_ttl);
    Harness::start_full(
        agent,
        move |d| d.blocks = Some(tier),
        |e| e.block_cache = None,
    )
    .await
}

fn transfer(v: &awcp_ctl::daemon::api::DelegationView, key: &str) -> u64 {
    v.transfer
        .as_ref()
        .map_or(0, |t| t[key].as_u64().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_fleet_hydration_counts_both_tiers() {
    let Some(s3) = setup() else { return };
    let Some(bin) = fleet::awcp_ctl_bin() else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the fleet test needs the awcp-ctl binary beside the tests (cargo nextest run --workspace builds it)"
        );
        eprintln!(
            "\n!!!!!!!! SKIPPING the fleet test: no awcp-ctl binary beside the tests (cargo build -p awcp-ctl) !!!!!!!!\n"
        );
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let ws = work.path().join("ws");
    // 300 files of 16 KiB and one of 2.5 MiB: small files and multi-block ones.
    fleet::make_workspace(&ws, 300, 16 << 10, (5 << 20) / 2);
    let daemon = fleet::start_delegator(
        &work.path().join("delegator"),
        Some((&s3, "fleet")),
        Duration::from_secs(10),
    )
    .await;
    let n = 4;
    let r = fleet::run(&daemon, &bin, work.path(), &ws, n).await;
    eprintln!("fleet of {n}: {r:?}");
    let size = r.workspace_bytes;
    // Every Executor read the whole workspace, from one tier or the other.
    assert!(
        r.fetched >= size * n as u64,
        "executors fetched {} bytes in all, the workspace is {size} x {n}",
        r.fetched
    );
    // The Delegator's process sent at most 1.1x the workspace: each block once, to the
    // store, instead of once per Executor.
    assert!(
        r.delegator_total() as f64 <= 1.1 * size as f64,
        "the Delegator sent {} bytes (served {}, uploaded {}) for a {size}-byte workspace",
        r.delegator_total(),
        r.delegator_served,
        r.delegator_uploaded
    );
    // The rest came from the store, through URLs, intact.
    assert!(
        r.from_store + r.delegator_served >= size * n as u64,
        "store {} + delegator {} < {size} x {n}",
        r.from_store,
        r.delegator_served
    );
    assert!(r.urls > 0);
    assert_eq!(r.store_refused, 0, "no object should have been refused");
    // Every block is in the store exactly once.
    let blocks = block_hashes(&ws, BLOCK);
    assert_eq!(s3.block_count("fleet"), blocks.len());
    daemon.stop().await;
}

/// Delegate `ws` once (its agent reads everything, which puts every block in the store),
/// optionally corrupt the store's copy of `big.bin`'s second block, then delegate again
/// and return the second delegation's view and what its agent read of `big.bin`.
async fn second_delegation(
    s3: &S3Server,
    prefix: &str,
    corrupt: bool,
) -> (awcp_ctl::daemon::api::DelegationView, Vec<u8>, Vec<u8>) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let agent = format!(
        "find . -type f -exec cat {{}} + > /dev/null && cat big.bin > {}/$AWCP_DELEGATION_ID",
        out.display()
    );
    let h = harness(s3, prefix, Duration::from_secs(10), &agent).await;
    let ws = h.path("ws");
    fleet::make_workspace(&ws, 40, 8 << 10, 3 * BLOCK + 1000);
    let original = std::fs::read(ws.join("big.bin")).unwrap();
    let first = h.delegate(&ws, AccessMode::Ro, 300).await;
    assert_eq!(
        h.wait_end(&first, Duration::from_secs(120)).await,
        DelegationState::Completed
    );
    let blocks = block_hashes(&ws, BLOCK);
    assert!(
        awcp_tests::eventually(Duration::from_secs(30), || s3.block_count(prefix)
            == blocks.len())
        .await,
        "the store holds {} of {} blocks",
        s3.block_count(prefix),
        blocks.len()
    );
    if corrupt {
        let second_block = blake3::hash(&original[BLOCK..2 * BLOCK])
            .to_hex()
            .to_string();
        let obj = s3.block_object(prefix, &second_block);
        let len = std::fs::metadata(&obj).unwrap().len() as usize;
        std::fs::write(&obj, vec![0x5a; len]).unwrap();
    }
    let id = h.delegate(&ws, AccessMode::Ro, 300).await;
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(120)).await,
        DelegationState::Completed
    );
    let view = h.client.get(&id).await.unwrap();
    let copy = std::fs::read(out.join(&id)).unwrap();
    h.stop().await;
    (view, copy, original)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_second_delegation_serves_only_the_manifest() {
    let Some(s3) = setup() else { return };
    let (view, copy, original) = second_delegation(&s3, "again", false).await;
    assert!(copy == original, "big.bin read back wrong");
    assert_eq!(
        transfer(&view, "bytesServed"),
        0,
        "the Delegator served blocks: {:?}",
        view.transfer
    );
    assert_eq!(transfer(&view, "storeBytesUploaded"), 0);
    assert!(transfer(&view, "manifestFetches") >= 1);
    assert!(
        transfer(&view, "storeUrls") >= 4,
        "the mount did not use the store: {:?}",
        view.transfer
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_corrupted_object_is_refused_and_fetched_from_the_delegator() {
    let Some(s3) = setup() else { return };
    let (view, copy, original) = second_delegation(&s3, "corrupt", true).await;
    assert!(
        copy == original,
        "the corrupted block reached the agent, or the read failed"
    );
    // Exactly the corrupted block came from the Delegator; everything else from the store.
    assert_eq!(
        transfer(&view, "bytesServed"),
        BLOCK as u64,
        "{:?}",
        view.transfer
    );
    assert_eq!(transfer(&view, "blocksServed"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_revoke_ends_store_access() {
    let Some(s3) = setup() else { return };
    let url_ttl = Duration::from_secs(2);
    let h = harness(&s3, "revoke", url_ttl, "sleep 120").await;
    let ws = h.path("ws");
    fleet::make_workspace(&ws, 3, 4096, 0);
    let id = h.delegate(&ws, AccessMode::Ro, 300).await;
    let token = h.proof(&id).await;
    let locate = format!("{}/v1/exports/{id}/locate", h.daemon.daemon.export_url());
    let hashes: Vec<String> = block_hashes(&ws, BLOCK).into_iter().collect();
    let http = reqwest::Client::new();
    let ask = || {
        http.post(&locate)
            .bearer_auth(&token)
            .json(&serde_json::json!({ "hashes": hashes }))
            .send()
    };
    let answer: serde_json::Value = ask().await.unwrap().json().await.unwrap();
    assert_eq!(answer["blockStore"], true, "{answer}");
    let urls: Vec<String> = answer["urls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u.as_str().expect("a URL for every block").to_owned())
        .collect();
    assert_eq!(urls.len(), hashes.len());
    // A URL is valid for the tier's lifetime, never longer than the flush grace.
    assert!(urls[0].contains("X-Amz-Expires=2"), "{}", urls[0]);
    // It works before the revoke, and needs no credential of the Delegator's.
    let object = reqwest::get(&urls[0]).await.unwrap();
    assert_eq!(object.status(), 200);
    let block = awcpfs::blockobj::decode(object.bytes().await.unwrap().to_vec(), BLOCK).unwrap();
    assert_eq!(blake3::hash(&block).to_hex().as_str(), hashes[0]);
    h.client.revoke(&id, false).await.unwrap();
    // No URL is handed out after the revoke.
    let refused = ask().await.unwrap();
    assert_eq!(refused.status(), 403, "locate after revoke");
    // URLs handed out before it expire within their lifetime.
    tokio::time::sleep(url_ttl + Duration::from_secs(2)).await;
    let expired = reqwest::get(&urls[0]).await.unwrap();
    assert_eq!(
        expired.status(),
        403,
        "a URL from before the revoke still works"
    );
    h.stop().await;
}

/// An export without a block tier says so (and a mount stops asking): AWCP v1 peers
/// without the tier see the data plane unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_export_without_a_tier_says_so() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("sleep 120").await;
    let ws = h.path("ws");
    fleet::make_workspace(&ws, 1, 100, 0);
    let id = h.delegate(&ws, AccessMode::Ro, 300).await;
    let token = h.proof(&id).await;
    let v: serde_json::Value = reqwest::Client::new()
        .post(format!(
            "{}/v1/exports/{id}/locate",
            h.daemon.daemon.export_url()
        ))
        .bearer_auth(&token)
        .json(&serde_json::json!({ "hashes": [ "00".repeat(32) ] }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        v,
        serde_json::json!({ "blockStore": false, "urls": [] }),
        "{v}"
    );
    h.stop().await;
}

/// Write-back through the store: the Executor puts the blocks it wrote in the store
/// (presigned PUT URLs), the export takes them from there (verified) and commits; the
/// Delegator's workspace gets the content, and the store holds the new blocks for the next
/// delegation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_write_back_goes_through_the_store() {
    let Some(s3) = setup() else { return };
    // The agent reads a file first (the mount learns the export has a block tier), then
    // writes a new multi-block file and changes a small one.
    let agent = "cat f.txt > /dev/null && head -c 2621440 /dev/urandom > new.bin && \
                 echo changed > f.txt && echo written";
    let h = harness(&s3, "writeback", Duration::from_secs(10), agent).await;
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("f.txt"), b"original\n").unwrap();
    let id = h.delegate(&ws, AccessMode::Rw, 300).await;
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(120)).await,
        DelegationState::Completed
    );
    let new = std::fs::read(ws.join("new.bin")).unwrap();
    assert_eq!(new.len(), 2_621_440);
    assert_eq!(std::fs::read(ws.join("f.txt")).unwrap(), b"changed\n");
    let view = h.client.get(&id).await.unwrap();
    // Every block of the new content came through the store, none on /upload.
    let adopted = transfer(&view, "storeBytesAdopted");
    assert!(
        adopted >= new.len() as u64,
        "only {adopted} bytes came through the store: {:?}",
        view.transfer
    );
    // The store holds the new file's blocks, verified, for the next delegation.
    for chunk in new.chunks(BLOCK) {
        let hash = blake3::hash(chunk).to_hex().to_string();
        assert!(
            s3.block_object("writeback", &hash).is_file(),
            "block {hash} of new.bin is not in the store"
        );
    }
    h.stop().await;
}
