//! The block tier (`serve --blocks s3://…`) against a real S3-compatible server (`s3s-fs`,
//! started by the harness): fleet hydration with the bytes of both tiers and the store's
//! `GET`s counted, small blocks packed and read by range, a corrupted object or pack region
//! refused by hash and fetched from the Delegator, a restarted daemon that finds the packs,
//! a revoke that ends store access, a second delegation of a workspace already in the
//! store, mounts that do not read ranges still served a URL per block, and an `awcp-ctl
//! serve --blocks` whose only credentials, region and endpoint are in the AWS shared files.
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
        awcpfs::testing::skipped(
            "the fleet test (no awcp-ctl binary beside the tests)",
            "cargo build -p awcp-ctl",
        );
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let ws = work.path().join("ws");
    // 2,000 files of 4 KiB and one of 2.5 MiB: small files (packed) and multi-block ones
    // (large blocks stay objects of their own).
    fleet::make_workspace(&ws, 2000, 4 << 10, (5 << 20) / 2);
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
    // Every block is in the store exactly once, the small ones in packs.
    let blocks = block_hashes(&ws, BLOCK);
    assert_stored_once(&s3, "fleet", &blocks);
    assert_eq!(
        s3.block_count("fleet"),
        3,
        "big.bin's three blocks on their own"
    );
    // Packs are read by range, near blocks together: the store saw a small fraction of
    // a GET per block (one per block before packing).
    assert!(
        r.blocks_from_store >= n as u64 * 2000,
        "only {} blocks came from the store",
        r.blocks_from_store
    );
    assert!(
        r.store_requests * 20 <= r.blocks_from_store,
        "{} GETs for {} blocks from the store",
        r.store_requests,
        r.blocks_from_store
    );
    // One URL per pack in an answer, not one per block.
    assert!(
        r.urls * 20 <= r.blocks_from_store,
        "{} URLs signed for {} blocks",
        r.urls,
        r.blocks_from_store
    );
    daemon.stop().await;
}

/// The store under `prefix` holds each of `blocks` exactly once (on its own or in a pack)
/// and nothing else.
fn assert_stored_once(s3: &S3Server, prefix: &str, blocks: &std::collections::BTreeSet<String>) {
    let mut stored = s3.stored_blocks(prefix);
    stored.sort();
    assert_eq!(
        stored,
        blocks.iter().cloned().collect::<Vec<_>>(),
        "the store does not hold each block once"
    );
    assert!(!s3.packs(prefix).is_empty(), "no pack was written");
}

/// What to do to the store between the two delegations of [`second_delegation`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Between {
    /// Nothing.
    Nothing,
    /// Corrupt `big.bin`'s second block (an object of its own).
    CorruptObject,
    /// Corrupt the region of one small file's block in its pack.
    CorruptPackRegion,
    /// Stop the daemon and start a new one on the same prefix.
    Restart,
}

/// The small file whose packed block [`Between::CorruptPackRegion`] corrupts.
const CORRUPTED_FILE: &str = "d000/f00007.bin";

/// Delegate a workspace once (its agent reads everything, which puts every block in the
/// store), do `between`, then delegate it again and return the second delegation's view,
/// what its agent read of `big.bin` and [`CORRUPTED_FILE`], and the originals.
async fn second_delegation(
    s3: &S3Server,
    prefix: &str,
    between: Between,
) -> (awcp_ctl::daemon::api::DelegationView, Vec<u8>, Vec<u8>) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let agent = format!(
        "find . -type f -exec cat {{}} + > /dev/null && \
         cat big.bin {CORRUPTED_FILE} > {}/$AWCP_DELEGATION_ID",
        out.display()
    );
    let mut h = harness(s3, prefix, Duration::from_secs(10), &agent).await;
    let ws = tmp.path().join("ws");
    fleet::make_workspace(&ws, 40, 8 << 10, 3 * BLOCK + 1000);
    let mut original = std::fs::read(ws.join("big.bin")).unwrap();
    let big = original.clone();
    original.extend(std::fs::read(ws.join(CORRUPTED_FILE)).unwrap());
    let first = h.delegate(&ws, AccessMode::Ro, 300).await;
    assert_eq!(
        h.wait_end(&first, Duration::from_secs(120)).await,
        DelegationState::Completed
    );
    let blocks = block_hashes(&ws, BLOCK);
    assert!(
        awcp_tests::eventually(Duration::from_secs(30), || s3.stored_blocks(prefix).len()
            >= blocks.len())
        .await,
        "the store holds {} of {} blocks",
        s3.stored_blocks(prefix).len(),
        blocks.len()
    );
    assert_stored_once(s3, prefix, &blocks);
    match between {
        Between::Nothing => {}
        Between::CorruptObject => {
            let second_block = blake3::hash(&big[BLOCK..2 * BLOCK]).to_hex().to_string();
            let obj = s3.block_object(prefix, &second_block);
            let len = std::fs::metadata(&obj).unwrap().len() as usize;
            std::fs::write(&obj, vec![0x5a; len]).unwrap();
        }
        Between::CorruptPackRegion => {
            let data = std::fs::read(ws.join(CORRUPTED_FILE)).unwrap();
            let hash = blake3::hash(&data).to_hex().to_string();
            let (pack, offset, len) = s3
                .packed_block(prefix, &hash)
                .expect("the small file's block is in a pack");
            let mut bytes = std::fs::read(&pack).unwrap();
            bytes[offset as usize..(offset + u64::from(len)) as usize].fill(0x5a);
            std::fs::write(&pack, bytes).unwrap();
        }
        Between::Restart => {
            h.stop().await;
            // What the new daemon's tier learns from one listing and the indexes.
            let tier =
                awcpfs::export::tier::BlockTier::open(s3.tier(prefix, Duration::from_secs(10)))
                    .await
                    .unwrap();
            let stats = tier.stats();
            let packed: usize = s3.packs(prefix).iter().map(|(_, e)| e.len()).sum();
            assert_eq!(stats.blocks_in_store, blocks.len() as u64, "{stats:?}");
            assert_eq!(stats.blocks_in_packs, packed as u64, "{stats:?}");
            assert_eq!(stats.packs, s3.packs(prefix).len() as u64, "{stats:?}");
            assert!(
                blocks
                    .iter()
                    .all(|b| tier.contains(&awcpfs::mount::remote::parse_hash(b).unwrap()))
            );
            h = harness(s3, prefix, Duration::from_secs(10), &agent).await;
        }
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

/// The Delegator served no block and uploaded nothing: everything came from the store.
fn assert_all_from_store(view: &awcp_ctl::daemon::api::DelegationView) {
    assert_eq!(
        transfer(view, "bytesServed"),
        0,
        "the Delegator served blocks: {:?}",
        view.transfer
    );
    assert_eq!(transfer(view, "storeBytesUploaded"), 0);
    assert!(transfer(view, "manifestFetches") >= 1);
    assert!(
        transfer(view, "storeUrls") >= 4,
        "the mount did not use the store: {:?}",
        view.transfer
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_second_delegation_serves_only_the_manifest() {
    let Some(s3) = setup() else { return };
    let (view, copy, original) = second_delegation(&s3, "again", Between::Nothing).await;
    assert!(copy == original, "big.bin read back wrong");
    assert_all_from_store(&view);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_restarted_daemon_finds_the_packs() {
    let Some(s3) = setup() else { return };
    let (view, copy, original) = second_delegation(&s3, "restart", Between::Restart).await;
    assert!(copy == original, "big.bin read back wrong");
    // The new daemon knew every block was stored (packs included): nothing uploaded again,
    // nothing served.
    assert_all_from_store(&view);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_corrupted_object_is_refused_and_fetched_from_the_delegator() {
    let Some(s3) = setup() else { return };
    let (view, copy, original) = second_delegation(&s3, "corrupt", Between::CorruptObject).await;
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
async fn s3blocks_corrupted_pack_region_falls_back_for_that_block_only() {
    let Some(s3) = setup() else { return };
    let (view, copy, original) =
        second_delegation(&s3, "corruptpack", Between::CorruptPackRegion).await;
    assert!(
        copy == original,
        "the corrupted block reached the agent, or the read failed"
    );
    // Only the block whose region was corrupted came from the Delegator — the rest of the
    // ranged read that brought it was good.
    assert_eq!(
        transfer(&view, "bytesServed"),
        8 << 10,
        "{:?}",
        view.transfer
    );
    assert_eq!(transfer(&view, "blocksServed"), 1, "{:?}", view.transfer);
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

/// `/locate` answers ranges of packs (one URL per pack) only to a mount that asks for them;
/// a presigned pack URL serves a block's range; a mount that does not ask (one that predates
/// packs) gets a URL of each block's own object, which the export puts for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_locate_answers_ranges_only_to_mounts_that_ask() {
    let Some(s3) = setup() else { return };
    let h = harness(&s3, "ranges", Duration::from_secs(10), "sleep 120").await;
    let ws = h.path("ws");
    fleet::make_workspace(&ws, 30, 4096, BLOCK + 10);
    let id = h.delegate(&ws, AccessMode::Ro, 300).await;
    let token = h.proof(&id).await;
    let hashes: Vec<String> = block_hashes(&ws, BLOCK).into_iter().collect();
    // The background upload packs the workspace.
    assert!(
        awcp_tests::eventually(Duration::from_secs(30), || s3.stored_blocks("ranges").len()
            >= hashes.len())
        .await,
        "the background upload did not store the workspace"
    );
    let big_block = blake3::hash(&std::fs::read(ws.join("big.bin")).unwrap()[..BLOCK])
        .to_hex()
        .to_string();
    let locate = format!("{}/v1/exports/{id}/locate", h.daemon.daemon.export_url());
    let http = reqwest::Client::new();
    let ask = |body: serde_json::Value| {
        let req = http.post(&locate).bearer_auth(&token).json(&body).send();
        async move {
            req.await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        }
    };
    let fetch = |url: String, range: Option<(u64, u64)>| {
        let mut req = http.get(url);
        if let Some((a, len)) = range {
            req = req.header("Range", format!("bytes={a}-{}", a + len - 1));
        }
        async move {
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            (status, resp.bytes().await.unwrap().to_vec())
        }
    };

    // A mount that reads ranges.
    let answer = ask(serde_json::json!({ "hashes": hashes, "ranges": true })).await;
    assert_eq!(answer["blockStore"], true, "{answer}");
    let packs = answer["packs"].as_array().expect("pack URLs");
    let ranges = answer["ranges"].as_array().expect("ranges");
    let urls = answer["urls"].as_array().unwrap();
    assert_eq!(ranges.len(), hashes.len());
    assert_eq!(packs.len(), s3.packs("ranges").len(), "one URL per pack");
    for (i, hash) in hashes.iter().enumerate() {
        if *hash == big_block {
            // A large block is an object of its own.
            assert!(ranges[i].is_null() && urls[i].is_string(), "{answer}");
            continue;
        }
        assert!(urls[i].is_null(), "a packed block got a URL of its own");
        let r: Vec<u64> = serde_json::from_value(ranges[i].clone()).unwrap();
        let pack = packs[r[0] as usize].as_str().unwrap().to_owned();
        let (status, object) = fetch(pack, Some((r[1], r[2]))).await;
        assert_eq!(status, 206, "a ranged GET of a presigned pack URL");
        assert_eq!(object.len() as u64, r[2]);
        let block = awcpfs::blockobj::decode(object, BLOCK).unwrap();
        assert_eq!(blake3::hash(&block).to_hex().as_str(), hash);
    }
    assert_eq!(s3.block_count("ranges"), 1, "big.bin's first block only");

    // A mount that does not: a URL per block, each an object of its own.
    let answer = ask(serde_json::json!({ "hashes": hashes })).await;
    assert!(
        answer.get("packs").is_none() && answer.get("ranges").is_none(),
        "{answer}"
    );
    let urls = answer["urls"].as_array().unwrap();
    assert_eq!(urls.len(), hashes.len());
    for (url, hash) in urls.iter().zip(&hashes) {
        let url = url.as_str().expect("a URL for every block").to_owned();
        let (status, object) = fetch(url, None).await;
        assert_eq!(status, 200);
        let block = awcpfs::blockobj::decode(object, BLOCK).unwrap();
        assert_eq!(blake3::hash(&block).to_hex().as_str(), hash);
    }
    assert_eq!(s3.block_count("ranges"), hashes.len());
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

/// A Delegator whose only word on the store is in the AWS shared files: `awcp-ctl serve
/// --blocks` with no `AWS_*` credentials, region or endpoint in its environment, but a
/// profile (`AWS_PROFILE`) with the keys in `$HOME/.aws/credentials` and the region and
/// the `http://` endpoint in `$HOME/.aws/config`, opens the tier and the Executor reads the
/// workspace from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3blocks_credentials_from_the_aws_shared_files() {
    let Some(s3) = setup() else { return };
    let Some(bin) = fleet::awcp_ctl_bin() else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "this test needs the awcp-ctl binary beside the tests (cargo nextest run --workspace builds it)"
        );
        awcpfs::testing::skipped(
            "the shared-files test (no awcp-ctl binary beside the tests)",
            "cargo build -p awcp-ctl",
        );
        return;
    };
    let prefix = "sharedfiles";
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    std::fs::create_dir_all(home.join(".aws")).unwrap();
    std::fs::write(
        home.join(".aws/credentials"),
        format!(
            "[default]\naws_access_key_id = WRONG\naws_secret_access_key = WRONG\n\n\
             # the Delegator's keys\n[awcp-tier]\naws_access_key_id = {}\naws_secret_access_key = {}\n",
            awcp_tests::s3::ACCESS_KEY,
            awcp_tests::s3::SECRET_KEY
        ),
    )
    .unwrap();
    std::fs::write(
        home.join(".aws/config"),
        format!(
            "[profile awcp-tier]\nregion = {}\nendpoint_url = {}\n",
            awcp_tests::s3::REGION,
            s3.endpoint
        ),
    )
    .unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    // The Executor (in this process; its daemon idles) keeps no block cache.
    let agent = format!("cat big.bin > {}/$AWCP_DELEGATION_ID", out.display());
    let h = Harness::start_full(&agent, |_| {}, |e| e.block_cache = None).await;

    let port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (api, export) = (port(), port());
    let state = tmp.path().join("delegator");
    let log = tmp.path().join("serve.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut cmd = std::process::Command::new(&bin);
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{api}")])
        .args(["--export-listen", &format!("127.0.0.1:{export}")])
        .arg("--state-dir")
        .arg(&state)
        .args([
            "--blocks",
            &format!("s3://{}/{prefix}", awcp_tests::s3::BUCKET),
        ])
        .env("HOME", &home)
        .env("AWS_PROFILE", "awcp-tier")
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file);
    for (k, _) in std::env::vars_os() {
        if k.to_str()
            .is_some_and(|k| k.starts_with("AWS_") && k != "AWS_PROFILE")
        {
            cmd.env_remove(k);
        }
    }
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut serve = Kill(cmd.spawn().unwrap());
    let token_file = state.join("api-token");
    let health = format!("http://127.0.0.1:{api}/health");
    let up = awcp_tests::eventually(Duration::from_secs(30), || {
        serve.0.try_wait().unwrap().is_some()
            || (token_file.is_file() && std::net::TcpStream::connect(("127.0.0.1", api)).is_ok())
    })
    .await
        && serve.0.try_wait().unwrap().is_none();
    assert!(
        up && reqwest::get(&health)
            .await
            .is_ok_and(|r| r.status().is_success()),
        "the daemon did not start with the tier from the shared files: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let token = std::fs::read_to_string(&token_file).unwrap();
    let client = awcp_ctl::client::DaemonClient::new(&format!("http://127.0.0.1:{api}"))
        .with_token(Some(token.trim().to_owned()));

    let ws = tmp.path().join("ws");
    fleet::make_workspace(&ws, 1, 100, 3 * BLOCK + 1000);
    let mut req = awcp_tests::request(
        h.executor.awcp_url(),
        &[("workspace", &ws, AccessMode::Ro)],
        300,
    );
    req.auth = Some(awcp_protocol::messages::AuthCredential {
        auth_type: awcp_protocol::messages::AuthType::Bearer,
        credential: h.credential(),
        metadata: None,
    });
    let id = client
        .delegate(&req)
        .await
        .expect("delegate")
        .delegation_id
        .as_str()
        .to_string();
    let view = loop {
        let v = client.get(&id).await.expect("status");
        if v.record.state.is_terminal() {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(view.record.state, DelegationState::Completed, "{view:?}");
    assert!(
        std::fs::read(out.join(&id)).unwrap() == std::fs::read(ws.join("big.bin")).unwrap(),
        "big.bin read back wrong"
    );
    // The mount read through the store the daemon reached with the files' keys.
    assert!(
        transfer(&view, "storeUrls") >= 1,
        "the mount did not use the store: {:?}",
        view.transfer
    );
    let blocks = block_hashes(&ws, BLOCK);
    assert!(
        awcp_tests::eventually(Duration::from_secs(30), || s3.stored_blocks(prefix).len()
            >= blocks.len())
        .await,
        "the store holds {} of {} blocks",
        s3.stored_blocks(prefix).len(),
        blocks.len()
    );
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !log_text.contains(awcp_tests::s3::SECRET_KEY),
        "the daemon logged the secret"
    );
    drop(serve);
    h.stop().await;
}
