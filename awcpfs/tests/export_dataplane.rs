//! The export's data plane over real HTTP: a router bound to 127.0.0.1:0, a reqwest client.

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use awcp_lease::{Lease, LeaseTerms, ManualClock};
use awcp_protocol::dataplane::{
    AppliedCommits, AppliedQuery, BlockRequest, Change, ChangeSet, CommitResult, DataPlaneError,
    EntryKind, ExportEvent, LEASE_EXPIRES_HEADER, LeaseState, MAX_APPLIED_QUERY, Manifest,
    MissingBlocks, UploadResult, decode_block_frames, encode_block_frame,
};
use awcpfs::export::{Export, ExportConfig, ExportRegistry};
use futures::StreamExt;
use reqwest::StatusCode;

const TOKEN: &str = "s3cret-token";
const BLOCK: u32 = 8;

/// One export served on loopback, with virtual lease time.
struct Fixture {
    root: tempfile::TempDir,
    outside: tempfile::TempDir,
    staging: tempfile::TempDir,
    clock: Arc<ManualClock>,
    export: Arc<Export>,
    registry: ExportRegistry,
    server: String,
    client: reqwest::Client,
}

struct Opts {
    read_only: bool,
    flush_grace: Duration,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            read_only: false,
            flush_grace: Duration::from_secs(30),
        }
    }
}

async fn fixture(build: impl FnOnce(&Path, &Path)) -> Fixture {
    fixture_with(Opts::default(), build).await
}

async fn fixture_with(opts: Opts, build: impl FnOnce(&Path, &Path)) -> Fixture {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let staging = tempfile::tempdir().unwrap();
    build(root.path(), outside.path());
    let clock = Arc::new(ManualClock::new());
    let lease = Arc::new(Lease::grant(
        clock.clone(),
        LeaseTerms {
            ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(3600),
            flush_grace: opts.flush_grace,
        },
    ));
    let registry = ExportRegistry::new();
    let export = registry
        .register(
            "exp_test".into(),
            TOKEN.into(),
            ExportConfig {
                root: root.path().to_owned(),
                read_only: opts.read_only,
                block_size: BLOCK,
                staging_dir: staging.path().join("blocks"),
            },
            lease,
        )
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = registry.router();
    tokio::spawn(async move { axum::serve(listener, router).await });
    Fixture {
        root,
        outside,
        staging,
        clock,
        export,
        registry,
        server: format!("http://{addr}"),
        client: reqwest::Client::new(),
    }
}

impl Fixture {
    fn url(&self, route: &str) -> String {
        format!("{}/v1/exports/exp_test/{route}", self.server)
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.path().join(rel)
    }

    fn post(&self, route: &str) -> reqwest::RequestBuilder {
        self.client.post(self.url(route)).bearer_auth(TOKEN)
    }

    async fn manifest(&self) -> (Manifest, Vec<u8>) {
        let resp = self
            .client
            .get(self.url("manifest"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let body = resp.bytes().await.unwrap().to_vec();
        (serde_json::from_slice(&body).unwrap(), body)
    }

    async fn blocks(&self, hashes: &[String]) -> Vec<([u8; 32], Option<Vec<u8>>)> {
        let resp = self
            .post("blocks")
            .json(&BlockRequest {
                hashes: hashes.to_vec(),
            })
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let body = resp.bytes().await.unwrap();
        decode_block_frames(&body)
            .unwrap()
            .into_iter()
            .map(|(h, d)| (h, d.map(<[u8]>::to_vec)))
            .collect()
    }

    async fn missing(&self, hashes: &[String]) -> Vec<String> {
        let resp = self
            .post("missing")
            .json(&BlockRequest {
                hashes: hashes.to_vec(),
            })
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.json::<MissingBlocks>().await.unwrap().missing
    }

    /// Upload the blocks of `content`.
    async fn upload(&self, content: &[u8]) -> reqwest::Response {
        let mut body = Vec::new();
        for chunk in content.chunks(BLOCK as usize) {
            encode_block_frame(&mut body, blake3::hash(chunk).as_bytes(), Some(chunk));
        }
        self.post("upload").body(body).send().await.unwrap()
    }

    async fn commit_raw(&self, cs: &ChangeSet) -> reqwest::Response {
        self.post("commit").json(cs).send().await.unwrap()
    }

    async fn commit(&self, cs: &ChangeSet) -> CommitResult {
        let resp = self.commit_raw(cs).await;
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, StatusCode::OK, "commit refused: {text}");
        serde_json::from_str(&text).unwrap()
    }
}

async fn refusal(resp: reqwest::Response) -> (StatusCode, DataPlaneError) {
    let status = resp.status();
    let text = resp.text().await.unwrap();
    let body: DataPlaneError = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("refusal body is not a DataPlaneError ({e}): {text}"));
    (status, body)
}

fn hex(data: &[u8]) -> String {
    blake3::hash(data).to_hex().to_string()
}

fn block_hashes(data: &[u8]) -> Vec<String> {
    data.chunks(BLOCK as usize).map(hex).collect()
}

/// A write of `content` to `path` based on `base` (the old content), with mtime 1.5 s.
fn write(path: &str, base: Option<&[u8]>, content: &[u8], mode: u32) -> Change {
    Change::Write {
        path: path.into(),
        mode,
        base: base.map(hex),
        hash: hex(content),
        size: content.len() as u64,
        blocks: block_hashes(content),
        mtime_ns: 1_500_000_000,
        link_to: None,
        xattrs: None,
    }
}

fn cs(id: &str, changes: Vec<Change>) -> ChangeSet {
    ChangeSet {
        commit_id: id.into(),
        changes,
        age_ms: None,
    }
}

fn mode_of(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

/// Everything below `dir`: (relative path, content or symlink target or "<dir>").
fn snapshot_tree(dir: &Path) -> Vec<(String, String)> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let p = e.path();
            let rel = p.strip_prefix(base).unwrap().to_string_lossy().into_owned();
            let ft = e.file_type().unwrap();
            if ft.is_symlink() {
                out.push((
                    rel,
                    std::fs::read_link(&p)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned(),
                ));
            } else if ft.is_dir() {
                out.push((rel, "<dir>".into()));
                walk(base, &p, out);
            } else if !ft.is_file() {
                out.push((rel, "<special>".into())); // never read a FIFO: it would block
            } else {
                let mode = mode_of(&p);
                out.push((
                    rel,
                    format!(
                        "{mode:o}:{}",
                        String::from_utf8_lossy(&std::fs::read(&p).unwrap())
                    ),
                ));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out
}

const BIG: &[u8] = b"0123456789abcdefghij"; // 20 bytes: 2.5 blocks of 8

fn small_tree(root: &Path, _outside: &Path) {
    std::fs::write(root.join("a.txt"), b"hello").unwrap();
    std::fs::create_dir_all(root.join("src/deep")).unwrap();
    std::fs::write(root.join("src/lib.rs"), b"fn main() {}").unwrap();
    std::fs::write(root.join("src/deep/x"), b"x").unwrap();
    std::fs::write(root.join("run.sh"), b"#!/bin/sh\n").unwrap();
    std::fs::set_permissions(root.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(root.join("empty"), b"").unwrap();
    std::fs::write(root.join("big.bin"), BIG).unwrap();
    symlink("a.txt", root.join("link")).unwrap();
    symlink("/etc/passwd", root.join("outlink")).unwrap();
    std::fs::write(root.join(".awcp-tmp-leftover"), b"junk").unwrap();
    nix::unistd::mkfifo(
        &root.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .unwrap();
}

// ---------------------------------------------------------------------------------------
// Manifest and blocks

#[tokio::test]
async fn manifest_describes_the_tree() {
    let f = fixture(small_tree).await;
    let resp = f
        .client
        .get(f.url("manifest"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "application/json");
    let expires = resp.headers()[LEASE_EXPIRES_HEADER]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(expires, "2025-01-01T00:10:00.000Z");
    let body = resp.bytes().await.unwrap();
    let m: Manifest = serde_json::from_slice(&body).unwrap();
    // Mounts ask for the binary form: zstd over the canonical encoding the digest covers.
    let resp = f
        .client
        .get(f.url("manifest"))
        .bearer_auth(TOKEN)
        .header("accept", awcp_protocol::manifest_bin::MEDIA_TYPE)
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.headers()["content-type"],
        awcp_protocol::manifest_bin::MEDIA_TYPE
    );
    let compressed = resp.bytes().await.unwrap();
    let (decoded, digest) = awcpfs::mount::remote::decode_manifest(&compressed).unwrap();
    assert_eq!(
        digest,
        f.export.manifest_digest(),
        "digest covers the encoding"
    );
    let binary = zstd::stream::decode_all(&compressed[..]).unwrap();
    assert_eq!(hex(&binary), f.export.manifest_digest());
    assert_eq!(decoded, m, "both forms say the same");
    assert_eq!(m.export_id, "exp_test");
    assert_eq!(m.block_size, BLOCK);
    assert!(!m.read_only);

    let paths: Vec<&str> = m.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "a.txt",
            "big.bin",
            "empty",
            "link",
            "outlink",
            "run.sh",
            "src",
            "src/deep",
            "src/deep/x",
            "src/lib.rs"
        ],
        "sorted, parents before children, fifo and temp names skipped"
    );
    let get = |p: &str| m.entries.iter().find(|e| e.path == p).unwrap();

    let a = get("a.txt");
    assert_eq!((a.kind, a.size), (EntryKind::File, 5));
    assert_eq!(a.hash.as_deref(), Some(hex(b"hello").as_str()));
    assert_eq!(
        a.blocks,
        vec![hex(b"hello")],
        "a small file is one block of its real size"
    );

    let big = get("big.bin");
    assert_eq!(big.size, 20);
    assert_eq!(big.hash.as_deref(), Some(hex(BIG).as_str()));
    assert_eq!(
        big.blocks,
        vec![hex(b"01234567"), hex(b"89abcdef"), hex(b"ghij")]
    );

    let empty = get("empty");
    assert_eq!(empty.size, 0);
    assert!(empty.blocks.is_empty());
    assert_eq!(empty.hash.as_deref(), Some(hex(b"").as_str()));

    assert_eq!(get("run.sh").mode, 0o755);
    assert_eq!(get("src").kind, EntryKind::Dir);
    let link = get("link");
    assert_eq!(
        (link.kind, link.target.as_deref(), link.size),
        (EntryKind::Symlink, Some("a.txt"), 5)
    );
    assert_eq!(
        get("outlink").target.as_deref(),
        Some("/etc/passwd"),
        "shown, not followed"
    );
    assert_eq!(f.export.stats().manifest_fetches, 2);
}

#[tokio::test]
async fn blocks_are_served_verified_and_missing_when_changed() {
    let f = fixture(small_tree).await;
    let mut asked = block_hashes(BIG);
    asked.push(hex(b"hello"));
    asked.push(hex(b"never seen"));
    let frames = f.blocks(&asked).await;
    assert_eq!(frames.len(), 5);
    let got: Vec<Option<&[u8]>> = frames.iter().map(|(_, d)| d.as_deref()).collect();
    assert_eq!(
        got,
        [
            Some(&b"01234567"[..]),
            Some(b"89abcdef"),
            Some(b"ghij"),
            Some(b"hello"),
            None
        ]
    );
    for ((h, d), want) in frames.iter().zip(&asked) {
        assert_eq!(&hex::encode(h), want);
        if let Some(d) = d {
            assert_eq!(&hex(d), want, "served content matches its hash");
        }
    }
    let stats = f.export.stats();
    assert_eq!((stats.blocks_served, stats.bytes_served), (4, 25));

    // The Delegator edits the file: its old blocks are no longer served.
    std::fs::write(f.path("big.bin"), b"XXXXXXXX89abcdefghij").unwrap();
    let frames = f.blocks(&block_hashes(BIG)).await;
    assert_eq!(frames[0].1, None, "changed block answered as missing");
    assert_eq!(
        frames[1].1.as_deref(),
        Some(&b"89abcdef"[..]),
        "unchanged block still served"
    );
}

#[tokio::test]
async fn blocks_refuse_bad_hashes_and_oversized_bodies() {
    let f = fixture(small_tree).await;
    let resp = f
        .post("blocks")
        .json(&BlockRequest {
            hashes: vec!["not-hex".into()],
        })
        .send()
        .await
        .unwrap();
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::BAD_REQUEST, "BAD_REQUEST")
    );
    assert!(err.message.contains("not-hex"), "{}", err.message);

    let resp = f
        .post("missing")
        .body(vec![b' '; 9 << 20])
        .send()
        .await
        .unwrap();
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, "TOO_LARGE")
    );
}

// ---------------------------------------------------------------------------------------
// Gates: auth, not found, lease, read-only

#[tokio::test]
async fn requests_without_the_token_are_refused() {
    let f = fixture(small_tree).await;
    let no_header = f.client.get(f.url("manifest")).send().await.unwrap();
    assert_eq!(no_header.headers()["www-authenticate"], "Bearer");
    assert!(no_header.headers().get(LEASE_EXPIRES_HEADER).is_none());
    let wrong = f
        .client
        .get(f.url("manifest"))
        .bearer_auth("s3cret-tokeN")
        .send()
        .await
        .unwrap();
    let basic = f
        .client
        .get(f.url("manifest"))
        .basic_auth("u", Some(TOKEN))
        .send()
        .await
        .unwrap();
    let commit = f
        .client
        .post(f.url("commit"))
        .body("{}")
        .send()
        .await
        .unwrap();
    for resp in [no_header, wrong, basic, commit] {
        let (status, err) = refusal(resp).await;
        assert_eq!(
            (status, err.code.as_str()),
            (StatusCode::UNAUTHORIZED, "AUTH_FAILED")
        );
        assert!(
            err.message.contains("Bearer"),
            "says what to send: {}",
            err.message
        );
    }
}

#[tokio::test]
async fn unknown_and_removed_exports_are_not_found() {
    let f = fixture(small_tree).await;
    let resp = f
        .client
        .get(format!("{}/v1/exports/nope/manifest", f.server))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::NOT_FOUND, "NOT_FOUND")
    );

    assert!(f.registry.remove("exp_test").is_some());
    let resp = f
        .client
        .get(f.url("manifest"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn revoked_lease_refuses_reads_but_takes_a_final_flush_within_the_grace() {
    let f = fixture(small_tree).await;
    f.export.lease().revoke(true);
    for resp in [
        f.client
            .get(f.url("manifest"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap(),
        f.post("blocks")
            .json(&BlockRequest { hashes: vec![] })
            .send()
            .await
            .unwrap(),
        f.client
            .get(f.url("events"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap(),
    ] {
        assert_eq!(
            resp.headers()[LEASE_EXPIRES_HEADER],
            "2025-01-01T00:00:00.000Z",
            "header carries the revocation time"
        );
        let (status, err) = refusal(resp).await;
        assert_eq!(
            (status, err.code.as_str()),
            (StatusCode::FORBIDDEN, "REVOKED")
        );
        assert!(err.message.contains("new delegation"), "{}", err.message);
    }

    // Within the grace: upload, missing and commit still work.
    f.clock.advance(Duration::from_secs(29));
    assert_eq!(f.upload(b"flushed").await.status(), StatusCode::OK);
    assert!(f.missing(&[hex(b"flushed")]).await.is_empty());
    let r = f
        .commit(&cs("c1", vec![write("late.txt", None, b"flushed", 0o644)]))
        .await;
    assert_eq!(r.applied, 1);
    assert_eq!(std::fs::read(f.path("late.txt")).unwrap(), b"flushed");

    // After the grace: refused.
    f.clock.advance(Duration::from_secs(1));
    let resp = f
        .commit_raw(&cs("c2", vec![write("later.txt", None, b"x", 0o644)]))
        .await;
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::FORBIDDEN, "REVOKED")
    );
    assert!(err.message.contains("grace"), "{}", err.message);
    assert!(!f.path("later.txt").exists());
}

#[tokio::test]
async fn revoke_without_flush_refuses_commits_at_once() {
    let f = fixture(small_tree).await;
    f.export.lease().revoke(false);
    let resp = f
        .commit_raw(&cs("c1", vec![write("x", None, b"x", 0o644)]))
        .await;
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::FORBIDDEN, "REVOKED")
    );
}

#[tokio::test]
async fn expired_lease_is_refused_with_expired() {
    let f = fixture_with(
        Opts {
            flush_grace: Duration::ZERO,
            ..Opts::default()
        },
        small_tree,
    )
    .await;
    f.clock.advance(Duration::from_secs(600));
    let resp = f
        .client
        .get(f.url("manifest"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::FORBIDDEN, "EXPIRED")
    );
    let resp = f.commit_raw(&cs("c1", vec![])).await;
    assert_eq!(refusal(resp).await.1.code, "EXPIRED");
}

#[tokio::test]
async fn read_only_export_refuses_writes() {
    let f = fixture_with(
        Opts {
            read_only: true,
            ..Opts::default()
        },
        small_tree,
    )
    .await;
    let (m, _) = f.manifest().await;
    assert!(m.read_only);
    let before = snapshot_tree(f.root.path());
    let resp = f
        .commit_raw(&cs("c1", vec![write("new", None, b"x", 0o644)]))
        .await;
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::FORBIDDEN, "READ_ONLY")
    );
    let (status, err) = refusal(f.upload(b"data").await).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::FORBIDDEN, "READ_ONLY")
    );
    assert_eq!(snapshot_tree(f.root.path()), before);
}

// ---------------------------------------------------------------------------------------
// Upload and malformed bodies

#[tokio::test]
async fn upload_verifies_every_block() {
    let f = fixture(small_tree).await;
    let mut body = Vec::new();
    encode_block_frame(&mut body, blake3::hash(b"good").as_bytes(), Some(b"good"));
    encode_block_frame(
        &mut body,
        blake3::hash(b"what was announced").as_bytes(),
        Some(b"tampered"),
    );
    let resp = f.post("upload").body(body).send().await.unwrap();
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::BAD_REQUEST, "CHECKSUM_MISMATCH")
    );
    assert_eq!(
        f.missing(&[hex(b"good")]).await,
        vec![hex(b"good")],
        "nothing of a refused upload is kept"
    );

    let resp = f.post("upload").body(vec![1u8; 40]).send().await.unwrap();
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::BAD_REQUEST, "BAD_REQUEST")
    );
    assert!(err.message.contains("truncated"), "{}", err.message);

    let resp = f.upload(b"good").await;
    assert_eq!(resp.json::<UploadResult>().await.unwrap().stored, 1);
    assert!(f.missing(&[hex(b"good")]).await.is_empty());
}

#[tokio::test]
async fn malformed_json_gets_a_readable_400() {
    let f = fixture(small_tree).await;
    for (route, body, needle) in [
        ("commit", r#"{"changes": []}"#, "commitId"),
        (
            "commit",
            r#"{"commitId": "c", "changes": [{"op": "explode", "path": "a"}]}"#,
            "explode",
        ),
        ("commit", "not json at all", "line 1 column"),
        ("blocks", r#"{"hashes": 42}"#, "expected a sequence"),
        ("missing", "", "EOF"),
    ] {
        let resp = f.post(route).body(body).send().await.unwrap();
        let (status, err) = refusal(resp).await;
        assert_eq!(
            (status, err.code.as_str()),
            (StatusCode::BAD_REQUEST, "BAD_REQUEST"),
            "{route}: {body}"
        );
        assert!(
            err.message.contains(needle),
            "{route} {body}: message {:?} lacks {needle:?}",
            err.message
        );
        assert!(
            err.message.contains(&format!("POST /{route}")),
            "{}",
            err.message
        );
    }
}

// ---------------------------------------------------------------------------------------
// Commits

#[tokio::test]
async fn commit_round_trip_of_every_operation() {
    let f = fixture(|root, outside| {
        small_tree(root, outside);
        std::fs::write(root.join("old-name"), b"moving").unwrap();
        std::fs::create_dir(root.join("gone")).unwrap();
        std::fs::write(root.join("doomed"), b"bye").unwrap();
    })
    .await;
    let new_content = b"a brand new file, several blocks long";
    let edited = b"hello, edited";
    let inner = b"inside a new dir";
    let want: Vec<String> = [&new_content[..], edited, inner]
        .iter()
        .flat_map(|c| block_hashes(c))
        .collect();
    // `moving` needs no upload: the export has it in its tree.
    let mut ask = want.clone();
    ask.extend(block_hashes(b"moving"));
    let missing = f.missing(&ask).await;
    assert_eq!(missing.len(), want.len(), "only the new content is missing");
    for c in [&new_content[..], edited, inner] {
        assert_eq!(f.upload(c).await.status(), StatusCode::OK);
    }
    assert!(f.missing(&ask).await.is_empty());

    let result = f
        .commit(&cs(
            "commit-1",
            vec![
                write("new.txt", None, new_content, 0o640),
                write("a.txt", Some(b"hello"), edited, 0o600),
                write("new-name", None, b"moving", 0o644),
                Change::Unlink {
                    path: "old-name".into(),
                    base: Some(hex(b"moving")),
                },
                Change::Mkdir {
                    path: "newdir".into(),
                    mode: 0o750,
                },
                write("newdir/inner.txt", None, inner, 0o644),
                Change::Rmdir {
                    path: "gone".into(),
                },
                Change::Symlink {
                    path: "newlink".into(),
                    target: "new.txt".into(),
                },
                Change::Symlink {
                    path: "link".into(),
                    target: "run.sh".into(),
                },
                Change::Chmod {
                    path: "run.sh".into(),
                    mode: 0o700,
                    mtime_ns: None,
                    base: None,
                    xattrs: None,
                },
                Change::Unlink {
                    path: "outlink".into(),
                    base: Some("/etc/passwd".into()),
                },
                Change::Unlink {
                    path: "doomed".into(),
                    base: Some(hex(b"bye")),
                },
                Change::Unlink {
                    path: "already-gone".into(),
                    base: None,
                },
            ],
        ))
        .await;
    assert!(result.conflicts.is_empty(), "{:?}", result.conflicts);
    assert_eq!(result.applied, 13);
    assert_eq!(result.commit_id, "commit-1");

    assert_eq!(std::fs::read(f.path("new.txt")).unwrap(), new_content);
    assert_eq!(mode_of(&f.path("new.txt")), 0o640);
    let mtime = std::fs::metadata(f.path("new.txt"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(mtime, std::time::UNIX_EPOCH + Duration::from_millis(1500));
    assert_eq!(std::fs::read(f.path("a.txt")).unwrap(), edited);
    assert_eq!(mode_of(&f.path("a.txt")), 0o600);
    assert_eq!(std::fs::read(f.path("new-name")).unwrap(), b"moving");
    assert!(!f.path("old-name").exists());
    assert_eq!(
        mode_of(&f.path("newdir")),
        0o750,
        "exact mode despite the umask"
    );
    assert_eq!(std::fs::read(f.path("newdir/inner.txt")).unwrap(), inner);
    assert!(!f.path("gone").exists());
    assert_eq!(
        std::fs::read_link(f.path("newlink")).unwrap(),
        Path::new("new.txt")
    );
    assert_eq!(
        std::fs::read_link(f.path("link")).unwrap(),
        Path::new("run.sh")
    );
    assert_eq!(mode_of(&f.path("run.sh")), 0o700);
    assert!(std::fs::symlink_metadata(f.path("outlink")).is_err());
    assert!(!f.path("doomed").exists());
    let leftovers: Vec<_> = std::fs::read_dir(f.root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".awcp-tmp-") && n != ".awcp-tmp-leftover")
        .collect();
    assert!(leftovers.is_empty(), "temp files left: {leftovers:?}");

    // The written files are served from the tree now (index updated), even after the staged
    // copies are gone.
    for entry in std::fs::read_dir(f.staging.path().join("blocks")).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    let frames = f.blocks(&block_hashes(new_content)).await;
    let served: Vec<u8> = frames.into_iter().flat_map(|(_, d)| d.unwrap()).collect();
    assert_eq!(served, new_content);

    let stats = f.export.stats();
    assert_eq!(stats.commits, 1);
    assert_eq!(stats.files_written, 4);
    assert_eq!(
        stats.bytes_written,
        (new_content.len() + edited.len() + b"moving".len() + inner.len()) as u64
    );
    assert_eq!(stats.conflicts, 0);
}

#[tokio::test]
async fn missing_blocks_fail_the_commit_and_nothing_is_applied() {
    let f = fixture(small_tree).await;
    let before = snapshot_tree(f.root.path());
    let resp = f
        .commit_raw(&cs(
            "c1",
            vec![
                Change::Mkdir {
                    path: "made".into(),
                    mode: 0o755,
                },
                write("made/file", None, b"never uploaded content", 0o644),
            ],
        ))
        .await;
    let (status, err) = refusal(resp).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::CONFLICT, "MISSING_BLOCKS")
    );
    for h in block_hashes(b"never uploaded content") {
        assert!(
            err.message.contains(&h),
            "message lists {h}: {}",
            err.message
        );
    }
    assert_eq!(
        snapshot_tree(f.root.path()),
        before,
        "nothing applied, no temp left"
    );

    // Upload and retry with the same id: now it applies.
    f.upload(b"never uploaded content").await;
    let r = f
        .commit(&cs(
            "c1",
            vec![
                Change::Mkdir {
                    path: "made".into(),
                    mode: 0o755,
                },
                write("made/file", None, b"never uploaded content", 0o644),
            ],
        ))
        .await;
    assert_eq!(r.applied, 2);
}

#[tokio::test]
async fn wrong_content_hash_is_refused() {
    let f = fixture(small_tree).await;
    f.upload(b"content").await;
    let mut change = write("f", None, b"content", 0o644);
    if let Change::Write { hash, .. } = &mut change {
        *hash = hex(b"something else");
    }
    let (status, err) = refusal(f.commit_raw(&cs("c1", vec![change])).await).await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::BAD_REQUEST, "CHECKSUM_MISMATCH")
    );
    assert!(!f.path("f").exists());
}

#[tokio::test]
async fn conflicting_write_keeps_both_versions() {
    let f = fixture(small_tree).await;
    // The Delegator edits a.txt after the Executor read it.
    std::fs::write(f.path("a.txt"), b"delegator's edit").unwrap();
    f.upload(b"executor's edit").await;
    f.upload(b"unrelated").await;
    let r = f
        .commit(&cs(
            "deadbeef-0001",
            vec![
                write("a.txt", Some(b"hello"), b"executor's edit", 0o644),
                write("src/other.rs", None, b"unrelated", 0o644),
                Change::Unlink {
                    path: "src/lib.rs".into(),
                    base: Some(hex(b"not what is there")),
                },
                Change::Rmdir { path: "src".into() },
                write("src/deep/x", None, b"executor's edit", 0o644),
            ],
        ))
        .await;
    assert_eq!(r.applied, 1, "{r:?}");
    assert_eq!(r.conflicts.len(), 4, "{r:?}");
    assert_eq!(r.conflicts[0].path, "a.txt");
    let kept = r.conflicts[0].kept_as.clone().unwrap();
    assert!(kept.starts_with("a.txt.awcp-conflict-"), "{kept}");
    assert!(
        r.conflicts[0].reason.contains("changed on the export"),
        "{}",
        r.conflicts[0].reason
    );
    assert_eq!(std::fs::read(f.path("a.txt")).unwrap(), b"delegator's edit");
    assert_eq!(std::fs::read(f.path(&kept)).unwrap(), b"executor's edit");
    assert_eq!(
        std::fs::read(f.path("src/other.rs")).unwrap(),
        b"unrelated",
        "rest applied"
    );
    assert_eq!(r.conflicts[1].path, "src/lib.rs");
    assert!(r.conflicts[1].kept_as.is_none());
    assert!(f.path("src/lib.rs").exists());
    assert!(
        r.conflicts[2].reason.contains("not empty"),
        "{}",
        r.conflicts[2].reason
    );
    assert_eq!(
        r.conflicts[3].path, "src/deep/x",
        "base None but a file exists"
    );
    let tag = kept.strip_prefix("a.txt.").unwrap();
    assert_eq!(
        r.conflicts[3].kept_as.as_deref(),
        Some(format!("src/deep/x.{tag}").as_str())
    );
    assert_eq!(std::fs::read(f.path("src/deep/x")).unwrap(), b"x");

    let stats = f.export.stats();
    assert_eq!(stats.conflicts, 4);
    assert_eq!(stats.recent_conflicts.len(), 4);
    assert_eq!(stats.recent_conflicts[0].path, "a.txt");
    let json = serde_json::to_value(&stats).unwrap();
    assert_eq!(json["recentConflicts"][0]["keptAs"], kept.as_str());
    assert_eq!(json["filesWritten"], 3);
}

#[tokio::test]
async fn retried_commit_is_answered_without_applying_twice() {
    let f = fixture(small_tree).await;
    f.upload(b"once").await;
    let set = cs(
        "retry-me",
        vec![
            write("once.txt", None, b"once", 0o644),
            Change::Unlink {
                path: "empty".into(),
                base: Some(hex(b"")),
            },
        ],
    );
    let first = f.commit(&set).await;
    assert_eq!(first.applied, 2);
    // Someone removes the file in between: a re-application would bring it back.
    std::fs::remove_file(f.path("once.txt")).unwrap();
    let second = f.commit(&set).await;
    assert_eq!(second, first);
    assert!(!f.path("once.txt").exists(), "retry was not applied again");
    assert_eq!(f.export.stats().commits, 1);

    // A different id writing content that is already there counts as applied.
    std::fs::write(f.path("once.txt"), b"once").unwrap();
    let third = f
        .commit(&cs(
            "another",
            vec![write("once.txt", None, b"once", 0o644)],
        ))
        .await;
    assert_eq!((third.applied, third.conflicts.len()), (1, 0));
}

#[tokio::test]
async fn concurrent_commits_are_serialised() {
    let f = Arc::new(fixture(small_tree).await);
    f.upload(b"v1").await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let f = f.clone();
        tasks.push(tokio::spawn(async move {
            f.commit(&cs(
                &format!("c{i}"),
                vec![write("race.txt", None, b"v1", 0o644)],
            ))
            .await
        }));
    }
    for t in tasks {
        let r = t.await.unwrap();
        // Each sees either nothing (creates) or exactly this content (idempotent): never a
        // half-written file or a conflict.
        assert_eq!((r.applied, r.conflicts.len()), (1, 0), "{r:?}");
    }
    assert_eq!(std::fs::read(f.path("race.txt")).unwrap(), b"v1");
}

// ---------------------------------------------------------------------------------------
// Confinement

fn escape_tree(root: &Path, outside: &Path) {
    small_tree(root, outside);
    std::fs::write(outside.join("secret"), b"outside content").unwrap();
    std::fs::set_permissions(
        outside.join("secret"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    symlink(outside, root.join("out")).unwrap();
    symlink(outside.join("secret"), root.join("secret-link")).unwrap();
}

#[tokio::test]
async fn path_escapes_are_refused_and_nothing_outside_changes() {
    let f = fixture(escape_tree).await;
    f.upload(b"pwned").await;
    let outside_before = snapshot_tree(f.outside.path());
    let inside_before = snapshot_tree(f.root.path());

    let escapes: Vec<Vec<Change>> = vec![
        vec![write("../escaped", None, b"pwned", 0o644)],
        vec![write("/tmp/escaped", None, b"pwned", 0o644)],
        vec![write("src/../../escaped", None, b"pwned", 0o644)],
        vec![write("./a.txt", None, b"pwned", 0o644)],
        // Through a symlinked parent that points outside.
        vec![write(
            "out/secret",
            Some(b"outside content"),
            b"pwned",
            0o644,
        )],
        vec![write("out/new", None, b"pwned", 0o644)],
        vec![Change::Mkdir {
            path: "out/dir".into(),
            mode: 0o755,
        }],
        vec![Change::Unlink {
            path: "out/secret".into(),
            base: Some(hex(b"outside content")),
        }],
        vec![Change::Chmod {
            path: "out/secret".into(),
            mode: 0o777,
            mtime_ns: None,
            base: None,
            xattrs: None,
        }],
        vec![Change::Symlink {
            path: "out/l".into(),
            target: "/".into(),
        }],
        // A symlink made earlier in the same set, then written through: refused as a whole.
        vec![
            Change::Symlink {
                path: "fresh".into(),
                target: f.outside.path().to_string_lossy().into_owned(),
            },
            write("fresh/planted", None, b"pwned", 0o644),
        ],
        // A file used as a directory.
        vec![write("a.txt/x", None, b"pwned", 0o644)],
        // Our own temp names are reserved.
        vec![write(".awcp-tmp-x", None, b"pwned", 0o644)],
    ];
    for changes in escapes {
        let desc = format!("{changes:?}");
        let (status, err) = refusal(f.commit_raw(&cs("esc", changes)).await).await;
        assert_eq!(
            (status, err.code.as_str()),
            (StatusCode::BAD_REQUEST, "INVALID_PATH"),
            "{desc}"
        );
        if desc.contains("out/") || desc.contains("fresh") {
            assert!(err.message.contains("escapes"), "{desc}: {}", err.message);
        }
    }

    // Writing to, unlinking or chmodding a symlink that points outside acts on the link,
    // never on its target.
    let r = f
        .commit(&cs(
            "links",
            vec![
                write("secret-link", Some(b"outside content"), b"pwned", 0o644),
                Change::Chmod {
                    path: "secret-link".into(),
                    mode: 0o777,
                    mtime_ns: None,
                    base: None,
                    xattrs: None,
                },
                Change::Unlink {
                    path: "secret-link".into(),
                    base: Some(hex(b"outside content")),
                },
            ],
        ))
        .await;
    assert_eq!(
        r.applied, 1,
        "only the chmod (a no-op on a symlink) applies: {r:?}"
    );
    assert_eq!(r.conflicts.len(), 2, "{r:?}");
    assert!(
        r.conflicts[0].reason.contains("symlink"),
        "{}",
        r.conflicts[0].reason
    );

    assert_eq!(
        snapshot_tree(f.outside.path()),
        outside_before,
        "outside untouched"
    );
    let mut inside_after = snapshot_tree(f.root.path());
    inside_after.retain(|(p, _)| !p.starts_with("secret-link.awcp-conflict-"));
    assert_eq!(
        inside_after, inside_before,
        "nothing of the refused commits applied"
    );
    assert_eq!(mode_of(&f.outside.path().join("secret")), 0o600);
}

#[tokio::test]
async fn blocks_are_never_read_through_a_symlink() {
    // Regression guard: a file replaced by a symlink to a file outside with the same content
    // must not be served from outside.
    let f = fixture(escape_tree).await;
    std::fs::remove_file(f.path("a.txt")).unwrap();
    std::fs::write(f.outside.path().join("hello"), b"hello").unwrap();
    symlink(f.outside.path().join("hello"), f.path("a.txt")).unwrap();
    let frames = f.blocks(&[hex(b"hello")]).await;
    assert_eq!(frames[0].1, None);
}

#[tokio::test]
async fn setuid_bits_are_never_set_by_a_commit() {
    let f = fixture(small_tree).await;
    f.upload(b"#!/bin/sh\n").await;
    let r = f
        .commit(&cs(
            "suid",
            vec![
                write("tool", None, b"#!/bin/sh\n", 0o6755),
                Change::Chmod {
                    path: "run.sh".into(),
                    mode: 0o4755,
                    mtime_ns: None,
                    base: None,
                    xattrs: None,
                },
            ],
        ))
        .await;
    assert_eq!(r.applied, 2);
    assert_eq!(mode_of(&f.path("tool")), 0o755);
    assert_eq!(mode_of(&f.path("run.sh")), 0o755);
}

// ---------------------------------------------------------------------------------------
// Events

async fn next_event<B: AsRef<[u8]>>(
    stream: &mut (impl futures::Stream<Item = reqwest::Result<B>> + Unpin),
    buf: &mut String,
) -> Option<ExportEvent> {
    loop {
        if let Some(end) = buf.find("\n\n") {
            let frame: String = buf.drain(..end + 2).collect();
            if let Some(data) = frame.lines().find_map(|l| l.strip_prefix("data:")) {
                let event: ExportEvent = serde_json::from_str(data.trim()).unwrap();
                // The end of the first catch-up of AECP findings: a marker for the mount,
                // not a lease or change event these tests follow.
                if matches!(event, ExportEvent::AecpReady) {
                    continue;
                }
                return Some(event);
            }
            continue; // keep-alive comment
        }
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("no SSE data within 10 s")?;
        buf.push_str(&String::from_utf8_lossy(chunk.unwrap().as_ref()));
    }
}

#[tokio::test]
async fn events_deliver_renew_and_revoke_then_end() {
    let f = fixture(small_tree).await;
    let resp = f
        .client
        .get(f.url("events"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();

    let Some(ExportEvent::Lease {
        state,
        remaining_ms,
        expires_at,
        ..
    }) = next_event(&mut stream, &mut buf).await
    else {
        panic!("no first event");
    };
    assert_eq!((state, remaining_ms), (LeaseState::Active, 600_000));
    assert_eq!(expires_at, "2025-01-01T00:10:00.000Z");

    f.export.lease().renew(Duration::from_secs(1200)).unwrap();
    let Some(ExportEvent::Lease {
        state,
        remaining_ms,
        ..
    }) = next_event(&mut stream, &mut buf).await
    else {
        panic!("no renew event");
    };
    assert_eq!((state, remaining_ms), (LeaseState::Active, 1_200_000));

    f.clock.advance(Duration::from_secs(5));
    f.export.lease().revoke(true);
    let Some(ExportEvent::Lease {
        state,
        flush_grace_ms,
        expires_at,
        ..
    }) = next_event(&mut stream, &mut buf).await
    else {
        panic!("no revoke event");
    };
    assert_eq!((state, flush_grace_ms), (LeaseState::Revoked, 30_000));
    assert_eq!(expires_at, "2025-01-01T00:00:05.000Z");
    assert!(
        next_event(&mut stream, &mut buf).await.is_none(),
        "stream ends after a terminal event"
    );
}

#[tokio::test]
async fn events_fire_at_the_deadline_without_any_other_trigger() {
    // Real time here: the export's timer must wake the stream when the lease runs out.
    let root = tempfile::tempdir().unwrap();
    let staging = tempfile::tempdir().unwrap();
    let lease = Arc::new(Lease::grant(
        Arc::new(awcp_lease::SystemClock::new()),
        LeaseTerms {
            ttl: Duration::from_millis(300),
            max_ttl: Duration::from_secs(60),
            flush_grace: Duration::from_secs(5),
        },
    ));
    let registry = ExportRegistry::new();
    registry
        .register(
            "exp_rt".into(),
            TOKEN.into(),
            ExportConfig {
                root: root.path().to_owned(),
                read_only: false,
                block_size: BLOCK,
                staging_dir: staging.path().to_owned(),
            },
            lease,
        )
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = registry.router();
    tokio::spawn(async move { axum::serve(listener, router).await });
    let resp = reqwest::Client::new()
        .get(format!("http://{addr}/v1/exports/exp_rt/events"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let first = next_event(&mut stream, &mut buf).await.unwrap();
    assert!(matches!(
        first,
        ExportEvent::Lease {
            state: LeaseState::Active,
            ..
        }
    ));
    let second = next_event(&mut stream, &mut buf).await.unwrap();
    assert!(
        matches!(
            second,
            ExportEvent::Lease {
                state: LeaseState::Expired,
                ..
            }
        ),
        "{second:?}"
    );
    assert!(next_event(&mut stream, &mut buf).await.is_none());
}

// ---------------------------------------------------------------------------------------
// Registration

#[test]
fn register_refuses_bad_configs() {
    let root = tempfile::tempdir().unwrap();
    let lease = Arc::new(Lease::grant(
        Arc::new(ManualClock::new()),
        LeaseTerms {
            ttl: Duration::from_secs(1),
            max_ttl: Duration::from_secs(1),
            flush_grace: Duration::ZERO,
        },
    ));
    let reg = ExportRegistry::new();
    let cfg = |staging: PathBuf, block_size| ExportConfig {
        root: root.path().to_owned(),
        read_only: false,
        block_size,
        staging_dir: staging,
    };
    let outside = tempfile::tempdir().unwrap();
    let inside = root.path().join("staging");
    let err = reg
        .register(
            "e1".into(),
            TOKEN.into(),
            cfg(inside.clone(), 8),
            lease.clone(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    assert!(
        !inside.exists(),
        "the refused staging dir is not left in the tree"
    );
    assert!(
        reg.register(
            "e/1".into(),
            TOKEN.into(),
            cfg(outside.path().into(), 8),
            lease.clone()
        )
        .is_err()
    );
    assert!(
        reg.register(
            "e1".into(),
            String::new(),
            cfg(outside.path().into(), 8),
            lease.clone()
        )
        .is_err()
    );
    assert!(
        reg.register(
            "e1".into(),
            TOKEN.into(),
            cfg(outside.path().into(), 0),
            lease.clone()
        )
        .is_err()
    );
    let ok = reg.register(
        "e1".into(),
        TOKEN.into(),
        cfg(outside.path().into(), 8),
        lease.clone(),
    );
    assert!(ok.is_ok());
    assert_eq!(ok.unwrap().root(), root.path());
    let dup = reg
        .register(
            "e1".into(),
            TOKEN.into(),
            cfg(outside.path().into(), 8),
            lease.clone(),
        )
        .unwrap_err();
    assert!(dup.to_string().contains("already registered"), "{dup}");
    let not_dir = reg.register(
        "e2".into(),
        TOKEN.into(),
        ExportConfig {
            root: root.path().join("nope"),
            ..cfg(outside.path().into(), 8)
        },
        lease,
    );
    assert!(not_dir.is_err());
    assert!(reg.get("e1").is_some() && reg.get("e2").is_none());
}

/// `linkTo` never links to anything outside the root: a path escape is refused as a whole,
/// and a source that is a symlink (to a file outside with the same content) or sits behind
/// one gets a copy, never a hard link to the outside file. A source inside with the content
/// gets a real hard link.
#[tokio::test]
async fn link_to_never_reaches_outside_the_root() {
    use std::os::unix::fs::MetadataExt;
    let f = fixture(|root, outside| {
        escape_tree(root, outside);
        std::fs::write(outside.join("same"), b"pwned").unwrap();
        symlink(outside.join("same"), root.join("same-link")).unwrap();
        std::fs::write(root.join("inside"), b"pwned").unwrap();
    })
    .await;
    f.upload(b"pwned").await;
    let linked = |path: &str, to: &str| {
        let mut c = write(path, None, b"pwned", 0o644);
        if let Change::Write { link_to, .. } = &mut c {
            *link_to = Some(to.into());
        }
        c
    };
    for bad in ["../x", "/etc/passwd", ".awcp-tmp-x"] {
        let (status, err) = refusal(f.commit_raw(&cs("bad", vec![linked("new", bad)])).await).await;
        assert_eq!(
            (status, err.code.as_str()),
            (StatusCode::BAD_REQUEST, "INVALID_PATH"),
            "{bad}"
        );
    }
    let r = f
        .commit(&cs(
            "links",
            vec![
                linked("via-symlink", "same-link"),
                linked("via-dir", "out/same"),
                linked("real", "inside"),
            ],
        ))
        .await;
    assert_eq!((r.applied, r.conflicts.len()), (3, 0), "{r:?}");
    let outside_ino = std::fs::metadata(f.outside.path().join("same"))
        .unwrap()
        .ino();
    for p in ["via-symlink", "via-dir"] {
        let m = std::fs::symlink_metadata(f.path(p)).unwrap();
        assert!(m.is_file(), "{p}");
        assert_ne!(m.ino(), outside_ino, "{p} linked to a file outside");
        assert_eq!(std::fs::read(f.path(p)).unwrap(), b"pwned");
    }
    assert_eq!(
        std::fs::metadata(f.outside.path().join("same"))
            .unwrap()
            .nlink(),
        1
    );
    assert_eq!(
        std::fs::metadata(f.path("real")).unwrap().ino(),
        std::fs::metadata(f.path("inside")).unwrap().ino()
    );
}

/// Extended attributes from the Executor: `user.*` only, hex values, set on a written file
/// and changed alone by a chmod; anything else is a 400 and nothing applies.
#[tokio::test]
async fn xattrs_are_user_only_and_applied_with_writes_and_chmods() {
    let f = fixture(small_tree).await;
    f.upload(b"pwned").await;
    let with = |attrs: &[(&str, &str)]| {
        let mut c = write("x", None, b"pwned", 0o644);
        if let Change::Write { xattrs, .. } = &mut c {
            *xattrs = Some(
                attrs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            );
        }
        c
    };
    for bad in [
        ("trusted.x", "00"),
        ("security.selinux", "00"),
        ("user.", "00"),
        ("user.x", "not hex"),
    ] {
        let (status, err) = refusal(f.commit_raw(&cs("bad", vec![with(&[bad])])).await).await;
        assert_eq!(
            (status, err.code.as_str()),
            (StatusCode::BAD_REQUEST, "BAD_REQUEST"),
            "{bad:?}: {}",
            err.message
        );
    }
    assert!(!f.path("x").exists());
    let get = |n: &str| {
        let file = std::fs::File::open(f.path("x")).unwrap();
        let mut buf = [0u8; 64];
        rustix::fs::fgetxattr(&file, n, &mut buf[..])
            .ok()
            .map(|len| buf[..len].to_vec())
    };
    f.commit(&cs(
        "ok",
        vec![with(&[("user.a", "6869"), ("user.b", "00ff")])],
    ))
    .await;
    assert_eq!(get("user.a").as_deref(), Some(&b"hi"[..]));
    assert_eq!(get("user.b").as_deref(), Some(&[0u8, 255][..]));
    let r = f
        .commit(&cs(
            "chmod",
            vec![Change::Chmod {
                path: "x".into(),
                mode: 0o600,
                mtime_ns: None,
                base: None,
                xattrs: Some(
                    [
                        ("user.a".to_string(), None),
                        ("user.c".to_string(), Some("63".to_string())),
                    ]
                    .into_iter()
                    .collect(),
                ),
            }],
        ))
        .await;
    assert_eq!(r.applied, 1, "{r:?}");
    assert_eq!(get("user.a"), None);
    assert_eq!(
        get("user.b").as_deref(),
        Some(&[0u8, 255][..]),
        "left alone"
    );
    assert_eq!(get("user.c").as_deref(), Some(&b"c"[..]));
}

// ---------------------------------------------------------------------------------------
// Delegator-side changes

/// `GET /events`, past its first (lease) event.
async fn open_events(
    f: &Fixture,
) -> (
    impl futures::Stream<Item = reqwest::Result<axum::body::Bytes>> + Unpin,
    String,
) {
    let resp = f
        .client
        .get(f.url("events"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    assert!(matches!(
        next_event(&mut stream, &mut buf).await,
        Some(ExportEvent::Lease { .. })
    ));
    (stream, buf)
}

/// Read `changed` events until `done` says enough was seen (or 20 s pass); returns what
/// every event listed: present entries by path, and removed paths.
async fn collect_changes<B: AsRef<[u8]>>(
    stream: &mut (impl futures::Stream<Item = reqwest::Result<B>> + Unpin),
    buf: &mut String,
    mut done: impl FnMut(
        &std::collections::BTreeMap<String, awcp_protocol::dataplane::ManifestEntry>,
        &[String],
    ) -> bool,
) -> (
    std::collections::BTreeMap<String, awcp_protocol::dataplane::ManifestEntry>,
    Vec<String>,
) {
    let mut present = std::collections::BTreeMap::new();
    let mut removed = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !done(&present, &removed) {
        let ev = tokio::time::timeout_at(deadline, next_event(stream, buf))
            .await
            .unwrap_or_else(|_| panic!("changes not seen in time: {present:?} {removed:?}"));
        match ev {
            Some(ExportEvent::Changed {
                entries,
                removed: gone,
                ..
            }) => {
                for e in entries {
                    present.insert(e.path.clone(), e);
                }
                removed.extend(gone);
            }
            Some(_) => {}
            None => panic!("the event stream ended"),
        }
    }
    (present, removed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegator_changes_are_streamed_and_the_exports_own_commits_are_not() {
    let f = fixture(|root, outside| {
        small_tree(root, outside);
        std::fs::write(root.join("gone.txt"), b"soon removed").unwrap();
    })
    .await;
    let (mut stream, mut buf) = open_events(&f).await;
    // Give the watcher a moment to be in place (it starts with the export, off-thread).
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The Executor's own write-back: never reported as a Delegator change.
    let mine = b"written by the executor";
    assert_eq!(f.upload(mine).await.status(), StatusCode::OK);
    let r = f
        .commit(&cs("own-1", vec![write("mine.txt", None, mine, 0o644)]))
        .await;
    assert!(r.conflicts.is_empty(), "{r:?}");

    // The Delegator's changes: an edit, a new file in a new directory, a removal.
    std::fs::write(f.path("a.txt"), b"hello from the delegator").unwrap();
    std::fs::create_dir(f.path("fresh")).unwrap();
    std::fs::write(f.path("fresh/new.txt"), b"new").unwrap();
    std::fs::remove_file(f.path("gone.txt")).unwrap();

    let (present, _) = collect_changes(&mut stream, &mut buf, |p, r| {
        p.get("a.txt").is_some_and(|e| {
            e.hash.as_deref() == Some(blake3::hash(b"hello from the delegator").to_hex().as_str())
        }) && p.contains_key("fresh/new.txt")
            && r.iter().any(|x| x == "gone.txt")
    })
    .await;
    assert_eq!(present["fresh"].kind, EntryKind::Dir);
    assert_eq!(present["a.txt"].size, 24);
    assert!(
        !present.contains_key("mine.txt"),
        "the export's own commit came back as a Delegator change"
    );
    // The new content can be fetched by the hashes the event gave.
    let got = f.blocks(&present["a.txt"].blocks).await;
    let content: Vec<u8> = got.into_iter().flat_map(|(_, d)| d.unwrap()).collect();
    assert_eq!(content, b"hello from the delegator");

    // A mount that connects later is told every change so far, in its first events.
    let (mut late, mut buf2) = open_events(&f).await;
    let (present, removed) = collect_changes(&mut late, &mut buf2, |p, r| {
        p.contains_key("fresh/new.txt") && r.iter().any(|x| x == "gone.txt")
    })
    .await;
    assert!(present.contains_key("a.txt"));
    // Our own commit is in the catch-up too, as what it left (a mount recognises it).
    let mine_hash = blake3::hash(mine).to_hex().to_string();
    assert!(
        present
            .get("mine.txt")
            .is_none_or(|e| e.hash.as_deref() == Some(mine_hash.as_str()))
    );
    assert!(removed.iter().all(|r| r == "gone.txt"), "{removed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_in_every_directory_are_seen_even_those_that_came_later() {
    use std::os::unix::ffi::OsStrExt;
    let f = fixture(|root, outside| {
        small_tree(root, outside);
        std::fs::create_dir(root.join(std::ffi::OsStr::from_bytes(b"d\xff"))).unwrap();
        std::fs::create_dir_all(outside.join("moved/inner")).unwrap();
        std::fs::write(outside.join("moved/inner/m.txt"), b"m").unwrap();
    })
    .await;
    let (mut stream, mut buf) = open_events(&f).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let hash = |b: &[u8]| Some(blake3::hash(b).to_hex().to_string());
    let has = |p: &std::collections::BTreeMap<String, awcp_protocol::dataplane::ManifestEntry>,
               path: &str,
               b: &[u8]| { p.get(path).is_some_and(|e| e.hash == hash(b)) };

    // Directories the manifest listed, however deep, and one whose name is not UTF-8.
    std::fs::write(f.path("src/deep/x"), b"deep edit").unwrap();
    std::fs::write(raw_path(&f, b"d\xff/new"), b"raw").unwrap();
    let raw_new = awcp_protocol::rawname::from_bytes(b"d\xff/new").into_owned();
    collect_changes(&mut stream, &mut buf, |p, _| {
        has(p, "src/deep/x", b"deep edit") && has(p, &raw_new, b"raw")
    })
    .await;

    // A directory made after the manifest, and one moved in from outside the tree: what
    // they hold is reported with them, and what is written in them later is seen too.
    std::fs::create_dir(f.path("later")).unwrap();
    std::fs::rename(f.outside.path().join("moved"), f.path("moved")).unwrap();
    collect_changes(&mut stream, &mut buf, |p, _| {
        p.contains_key("later") && has(p, "moved/inner/m.txt", b"m")
    })
    .await;
    std::fs::create_dir(f.path("later/sub")).unwrap();
    std::fs::write(f.path("later/sub/n.txt"), b"n").unwrap();
    std::fs::write(f.path("moved/inner/m.txt"), b"m edited").unwrap();
    collect_changes(&mut stream, &mut buf, |p, _| {
        has(p, "later/sub/n.txt", b"n") && has(p, "moved/inner/m.txt", b"m edited")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hidden_and_temporary_paths_are_never_reported() {
    let f = fixture(small_tree).await;
    let (mut stream, mut buf) = open_events(&f).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Serving content opens files (inotify reports the opens): not a change.
    let (m, _) = f.manifest().await;
    let served: Vec<String> = m
        .entries
        .iter()
        .filter(|e| e.path == "a.txt" || e.path == "src/lib.rs")
        .flat_map(|e| e.blocks.clone())
        .collect();
    assert!(f.blocks(&served).await.iter().all(|(_, d)| d.is_some()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        f.export.stats().paths_described,
        0,
        "files opened to serve them were read again by the watcher"
    );
    std::fs::write(f.path(".awcp-tmp-0123456789abcdef"), b"staging").unwrap();
    std::fs::write(f.path("seen.txt"), b"x").unwrap();
    let (present, _) =
        collect_changes(&mut stream, &mut buf, |p, _| p.contains_key("seen.txt")).await;
    assert!(
        present.keys().all(|p| !p.starts_with(".awcp-tmp-")),
        "{present:?}"
    );
    assert!(
        !present.contains_key("a.txt") && !present.contains_key("src/lib.rs"),
        "files read to serve them were reported as changed: {present:?}"
    );
    // The watcher counts a change just after announcing it.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut stats = f.export.stats();
    while stats.upstream_changes == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        stats = f.export.stats();
    }
    assert!(
        stats.paths_described >= 1 && stats.upstream_changes >= 1,
        "{stats:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Names that are not UTF-8, and the Delegator's extended attributes

fn raw_tree(root: &Path, _outside: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let raw = |n: &[u8]| root.join(std::ffi::OsStr::from_bytes(n));
    std::fs::create_dir(raw(b"d\xff")).unwrap();
    std::fs::write(raw(b"caf\xe9.txt"), b"hello").unwrap();
    std::fs::write(raw(b"d\xff/x"), b"x").unwrap();
    symlink(std::ffi::OsStr::from_bytes(b"caf\xe9.txt"), raw(b"l\xfa")).unwrap();
    std::fs::write(root.join("tagged"), b"t").unwrap();
    rustix::fs::setxattr(
        root.join("tagged"),
        "user.color",
        b"blue",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
}

/// `rel` (raw bytes) below the export root.
fn raw_path(f: &Fixture, rel: &[u8]) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    f.root.path().join(std::ffi::OsStr::from_bytes(rel))
}

#[tokio::test]
async fn non_utf8_names_are_served_and_committed_byte_exactly() {
    use awcp_protocol::rawname;
    let f = fixture(raw_tree).await;
    let (m, body) = f.manifest().await;
    let body = String::from_utf8(body).unwrap();
    // base64 of "caf\xe9.txt"; the escaped in-memory form never reaches the wire.
    assert!(body.contains(r#""path":{"b64":"Y2Fm6S50eHQ="}"#), "{body}");
    assert!(!body.contains("\\u0000"), "{body}");
    assert!(body.contains(r#""path":"tagged""#), "UTF-8 stays a string");
    let raw_paths: Vec<Vec<u8>> = m
        .entries
        .iter()
        .map(|e| rawname::to_bytes(&e.path).into_owned())
        .collect();
    assert_eq!(
        raw_paths,
        [
            &b"caf\xe9.txt"[..],
            b"d\xff",
            b"d\xff/x",
            b"l\xfa",
            b"tagged"
        ]
    );
    let link = &m.entries[3];
    assert_eq!(
        &*rawname::to_bytes(link.target.as_deref().unwrap()),
        b"caf\xe9.txt"
    );
    assert_eq!(link.size, 8, "the target's length in bytes");
    let tagged = &m.entries[4];
    assert_eq!(
        tagged.xattrs.get("user.color").map(String::as_str),
        Some("626c7565")
    );
    // The binary form says the same (format 2: raw bytes and attributes).
    let compressed = f
        .client
        .get(f.url("manifest"))
        .bearer_auth(TOKEN)
        .header("accept", awcp_protocol::manifest_bin::MEDIA_TYPE)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let (decoded, _) = awcpfs::mount::remote::decode_manifest(&compressed).unwrap();
    assert_eq!(decoded, m);

    // Blocks of a file with a non-UTF-8 name are served.
    let frames = f.blocks(&m.entries[0].blocks).await;
    assert_eq!(frames[0].1.as_deref(), Some(&b"hello"[..]));

    // A rename on the Executor: write at the new name, unlink the old one.
    f.upload(b"hello").await;
    let file = |p: &[u8]| rawname::from_bytes(p).into_owned();
    let r = f
        .commit(&cs(
            "rename",
            vec![
                write(&file(b"moved\xe8.txt"), None, b"hello", 0o644),
                Change::Unlink {
                    path: file(b"caf\xe9.txt"),
                    base: Some(hex(b"hello")),
                },
                Change::Mkdir {
                    path: file(b"n\xf1"),
                    mode: 0o755,
                },
                Change::Symlink {
                    path: file(b"n\xf1/s\xf3"),
                    target: file(b"../moved\xe8.txt"),
                },
                Change::Unlink {
                    path: file(b"l\xfa"),
                    base: Some(file(b"caf\xe9.txt")),
                },
            ],
        ))
        .await;
    assert!(r.conflicts.is_empty(), "{r:?}");
    assert_eq!(
        std::fs::read(raw_path(&f, b"moved\xe8.txt")).unwrap(),
        b"hello"
    );
    assert!(!raw_path(&f, b"caf\xe9.txt").exists());
    assert!(!raw_path(&f, b"l\xfa").exists());
    assert_eq!(
        std::fs::read(raw_path(&f, b"n\xf1/s\xf3")).unwrap(),
        b"hello",
        "through the new symlink"
    );

    // A conflict keeps the Executor's version beside, under the same raw name.
    std::fs::write(raw_path(&f, b"d\xff/x"), b"delegator").unwrap();
    f.upload(b"executor").await;
    let r = f
        .commit(&cs(
            "conflict",
            vec![write(&file(b"d\xff/x"), Some(b"x"), b"executor", 0o644)],
        ))
        .await;
    assert_eq!(r.conflicts.len(), 1, "{r:?}");
    let kept = r.conflicts[0].kept_as.clone().unwrap();
    let kept_raw = rawname::to_bytes(&kept).into_owned();
    assert!(kept_raw.starts_with(b"d\xff/x.awcp-conflict-"), "{kept:?}");
    assert_eq!(std::fs::read(raw_path(&f, &kept_raw)).unwrap(), b"executor");
    // And the result names both paths in the wire form.
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains(r#""path":{"b64":"ZP8veA=="}"#), "{json}");
}

#[tokio::test]
async fn malformed_non_utf8_paths_get_a_readable_400() {
    let f = fixture(raw_tree).await;
    for (path, needle) in [
        (r#"{"b64":"!!"}"#, "not base64"),
        (r#"{"b64":"YWJj"}"#, "send it as a string"),
        (r#"{"b64":"YQBi6Q=="}"#, "NUL"),
        (r#""a\u0000e9""#, "NUL"),
        (r#"{"hex":"e9"}"#, "one key"),
    ] {
        let body = format!(
            r#"{{"commitId":"c","changes":[{{"op":"unlink","path":{path},"base":null}}]}}"#
        );
        let (status, err) = refusal(f.post("commit").body(body).send().await.unwrap()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {}", err.message);
        assert!(
            err.message.contains(needle),
            "{path}: message {:?} lacks {needle:?}",
            err.message
        );
    }
    // `..` and `/` inside a raw path are refused as paths.
    for path in [r#"{"b64":"Li4v6Q=="}"#, r#"{"b64":"6S8uLg=="}"#] {
        let body = format!(
            r#"{{"commitId":"c","changes":[{{"op":"unlink","path":{path},"base":null}}]}}"#
        );
        let (status, err) = refusal(f.post("commit").body(body).send().await.unwrap()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {}", err.message);
    }
    assert!(raw_path(&f, b"caf\xe9.txt").exists());
}

// ---------------------------------------------------------------------------------------
// Staged commits

#[tokio::test]
async fn a_staged_export_keeps_commits_off_the_tree_and_serves_their_blocks() {
    use awcpfs::export::stage::ChangeStage;
    let f = fixture(small_tree).await;
    let before = snapshot_tree(f.root.path());
    let stage_dir = f.staging.path().join("stage");
    let blocks_dir = f.staging.path().join("blocks");
    let stage = Arc::new(ChangeStage::open(&stage_dir, &blocks_dir).unwrap());
    assert!(f.export.stage_commits(stage.clone()));

    // A new file (uploaded), a.txt rewritten with content whose blocks only the tree has
    // (big.bin's), a removal.
    f.upload(b"brand new content!").await;
    let r = f
        .commit(&cs(
            "c1",
            vec![
                write("new.txt", None, b"brand new content!", 0o644),
                write("a.txt", Some(b"hello"), BIG, 0o600),
                Change::Unlink {
                    path: "src/deep/x".into(),
                    base: Some(hex(b"x")),
                },
            ],
        ))
        .await;
    assert_eq!(r.applied, 3);
    assert!(r.conflicts.is_empty(), "{r:?}");
    assert_eq!(
        snapshot_tree(f.root.path()),
        before,
        "the tree is untouched"
    );

    // The same checks as a live commit: missing blocks, then path escapes.
    let (status, err) = refusal(
        f.commit_raw(&cs("c2", vec![write("n2", None, b"not uploaded!", 0o644)]))
            .await,
    )
    .await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::CONFLICT, "MISSING_BLOCKS")
    );
    let (status, _) = refusal(
        f.commit_raw(&cs(
            "c3",
            vec![Change::Mkdir {
                path: "../out".into(),
                mode: 0o755,
            }],
        ))
        .await,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // Staged content is served, even once the tree no longer holds it.
    std::fs::write(f.path("big.bin"), b"changed by the delegator").unwrap();
    for content in [&b"brand new content!"[..], BIG] {
        let got = f.blocks(&block_hashes(content)).await;
        assert!(got.iter().all(|(_, d)| d.is_some()), "{got:?}");
    }

    // Durable: a stage reopened from disk holds the same change set. Applied through a
    // detached export, it changes the tree file by file; the Delegator's edit meanwhile
    // is a conflict and stays.
    std::fs::write(f.path("src/deep/x"), b"the delegator's x").unwrap();
    let reopened = ChangeStage::open(&stage_dir, &blocks_dir).unwrap();
    assert_eq!(reopened.changes(), stage.changes());
    assert_eq!(reopened.changes().len(), 3);
    let detached = Export::detached(f.root.path(), &blocks_dir, None).unwrap();
    let (plan, result) = reopened.apply(&detached).unwrap();
    assert_eq!(plan.changes.len(), 3, "{plan:?}");
    assert_eq!(result.conflicts.len(), 1, "{result:?}");
    assert_eq!(result.conflicts[0].path, "src/deep/x");
    assert_eq!(
        std::fs::read(f.path("src/deep/x")).unwrap(),
        b"the delegator's x"
    );
    assert_eq!(
        std::fs::read(f.path("new.txt")).unwrap(),
        b"brand new content!"
    );
    assert_eq!(std::fs::read(f.path("a.txt")).unwrap(), BIG);
    assert_eq!(mode_of(&f.path("a.txt")), 0o600);
    assert!(
        reopened.plan().changes.is_empty(),
        "a new generation starts empty"
    );
    assert_eq!(reopened.generation(), 1);
}

// ---------------------------------------------------------------------------------------
// Idempotency and change sequences across restarts and reconnects

// A commit the export applied, whose answer was lost, retried after the export process
// restarted (the daemon re-registers the export under the same id and staging directory):
// it used to be judged again against a tree that had moved on — here the Delegator removed
// the file since — and brought the file back (or made a conflict copy).
#[tokio::test]
async fn a_retried_commit_gets_its_first_outcome_after_the_export_restarts() {
    let f = fixture(small_tree).await;
    f.upload(b"once").await;
    let set = cs("lost-answer", vec![write("once.txt", None, b"once", 0o644)]);
    let first = f.commit(&set).await;
    assert_eq!((first.applied, first.conflicts.len()), (1, 0));
    assert!(
        first.seq.is_some(),
        "a commit answer carries the change sequence"
    );

    // The export process restarts: a new registry, the same id and staging directory.
    f.registry.remove("exp_test");
    let registry = ExportRegistry::new();
    let lease = Arc::new(Lease::grant(
        f.clock.clone(),
        LeaseTerms {
            ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(3600),
            flush_grace: Duration::from_secs(30),
        },
    ));
    let again = registry
        .register(
            "exp_test".into(),
            TOKEN.into(),
            ExportConfig {
                root: f.root.path().to_owned(),
                read_only: false,
                block_size: BLOCK,
                staging_dir: f.staging.path().join("blocks"),
            },
            lease,
        )
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = registry.router();
    tokio::spawn(async move { axum::serve(listener, router).await });
    // The Delegator removes the file meanwhile.
    std::fs::remove_file(f.path("once.txt")).unwrap();

    let resp = f
        .client
        .post(format!("http://{addr}/v1/exports/exp_test/commit"))
        .bearer_auth(TOKEN)
        .json(&set)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let retried: CommitResult = resp.json().await.unwrap();
    assert_eq!(retried, first, "the retry was judged again");
    assert!(!f.path("once.txt").exists(), "the retry was applied again");
    assert_eq!(again.stats().commits, 0);
    // The restarted export's change sequence starts above the one it handed out before.
    let resp = f
        .client
        .post(format!("http://{addr}/v1/exports/exp_test/commit"))
        .bearer_auth(TOKEN)
        .json(&cs(
            "after-restart",
            vec![Change::Mkdir {
                path: "new".into(),
                mode: 0o755,
            }],
        ))
        .send()
        .await
        .unwrap();
    let after: CommitResult = resp.json().await.unwrap();
    assert_eq!(after.applied, 1);
    assert!(after.seq > first.seq, "{:?} <= {:?}", after.seq, first.seq);
    assert_eq!(again.stats().commits, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_resumes_after_the_sequence_the_mount_has() {
    let f = fixture(small_tree).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (mut stream, mut buf) = open_events(&f).await;
    std::fs::write(f.path("a.txt"), b"first delegator change").unwrap();
    let first_seq = loop {
        match next_event(&mut stream, &mut buf).await {
            Some(ExportEvent::Changed { seq, entries, .. })
                if entries.iter().any(|e| e.path == "a.txt") =>
            {
                break seq;
            }
            Some(_) => {}
            None => panic!("the event stream ended"),
        }
    };
    std::fs::write(f.path("b.txt"), b"second delegator change").unwrap();
    collect_changes(&mut stream, &mut buf, |p, _| p.contains_key("b.txt")).await;

    // Reconnecting with `since` the first change: only what came after it.
    let resp = f
        .client
        .get(format!("{}?since={first_seq}", f.url("events")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let mut resumed = resp.bytes_stream();
    let mut buf = String::new();
    assert!(matches!(
        next_event(&mut resumed, &mut buf).await,
        Some(ExportEvent::Lease { .. })
    ));
    let Some(ExportEvent::Changed {
        seq,
        entries,
        removed,
    }) = next_event(&mut resumed, &mut buf).await
    else {
        panic!("no catch-up");
    };
    assert!(seq > first_seq);
    let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["b.txt"], "{removed:?}");

    // A `since` that is not a sequence number is refused with the reason.
    let resp = f
        .client
        .get(format!("{}?since=yesterday", f.url("events")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let (status, body) = refusal(resp).await;
    assert_eq!(
        (status, body.code.as_str()),
        (StatusCode::BAD_REQUEST, "BAD_REQUEST")
    );
    assert!(body.message.contains("since"), "{}", body.message);
}

#[tokio::test]
async fn applied_commits_are_named_to_the_token_holder_only_and_bad_questions_refused() {
    let f = fixture(small_tree).await;
    f.upload(b"once").await;
    let first = f
        .commit(&cs("c-1", vec![write("once.txt", None, b"once", 0o644)]))
        .await;
    // Which of these did the export apply? Only c-1, with its first outcome.
    let resp = f
        .post("commits/applied")
        .json(&AppliedQuery {
            ids: vec!["c-0".into(), "c-1".into(), "never".into()],
        })
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let answer: AppliedCommits = resp.json().await.unwrap();
    assert_eq!(answer.applied, vec![first]);
    // Without the token: refused like every other route.
    let (status, err) = refusal(
        f.client
            .post(f.url("commits/applied"))
            .json(&AppliedQuery {
                ids: vec!["c-1".into()],
            })
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, err.code.as_str()),
        (StatusCode::UNAUTHORIZED, "AUTH_FAILED")
    );
    // Bad questions get a readable refusal, never an answer.
    for (body, says) in [
        (serde_json::json!({ "ids": [""] }), "1 to 256 bytes"),
        (
            serde_json::json!({ "ids": ["x".repeat(257)] }),
            "1 to 256 bytes",
        ),
        (
            serde_json::json!({ "ids": vec!["c"; MAX_APPLIED_QUERY + 1] }),
            "commit ids in one question",
        ),
        (serde_json::json!({ "id": "c-1" }), "ids"),
    ] {
        let resp = f.post("commits/applied").json(&body).send().await.unwrap();
        let (status, err) = refusal(resp).await;
        assert!(status.is_client_error(), "{status} {err:?}");
        assert!(
            err.message.contains(says),
            "{says:?} not in {}",
            err.message
        );
    }
}

/// A commit makes every staged file durable before any is renamed into place, and every
/// directory it changed durable before it answers — with the files synced together, not
/// one by one. The export's tree lives on a recording filesystem that logs each write,
/// sync and rename it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_syncs_each_staged_file_before_its_rename_and_each_directory_after() {
    use awcpfs::testing::recordfs::{Op, Recorder};
    if !awcpfs::testing::fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (backing, root) = (tmp.path().join("backing"), tmp.path().join("root"));
    std::fs::create_dir_all(&backing).unwrap();
    std::fs::create_dir_all(&root).unwrap();
    let recorder = Recorder::mount(&backing, &root).unwrap();
    std::fs::create_dir_all(root.join("src")).unwrap();
    std::fs::write(root.join("src/old.rs"), b"old content").unwrap();
    let clock = Arc::new(ManualClock::new());
    let lease = Arc::new(Lease::grant(
        clock,
        LeaseTerms {
            ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(3600),
            flush_grace: Duration::from_secs(30),
        },
    ));
    let registry = ExportRegistry::new();
    registry
        .register(
            "exp_test".into(),
            TOKEN.into(),
            ExportConfig {
                root: root.clone(),
                read_only: false,
                block_size: BLOCK,
                staging_dir: tmp.path().join("staging"),
            },
            lease,
        )
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = registry.router();
    tokio::spawn(async move { axum::serve(listener, router).await });
    let url = |route: &str| format!("http://{addr}/v1/exports/exp_test/{route}");
    let client = reqwest::Client::new();

    let files: [(&str, &[u8]); 4] = [
        ("a.txt", b"first new file"),
        ("src/old.rs", b"old content, edited"),
        ("src/new.rs", b"a second new file"),
        ("docs/n.md", b"in a new directory"),
    ];
    let mut body = Vec::new();
    for (_, content) in files {
        for chunk in content.chunks(BLOCK as usize) {
            encode_block_frame(&mut body, blake3::hash(chunk).as_bytes(), Some(chunk));
        }
    }
    let up = client
        .post(url("upload"))
        .bearer_auth(TOKEN)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(up.status(), StatusCode::OK);
    let start = recorder.len();
    let mut changes = vec![Change::Mkdir {
        path: "docs".into(),
        mode: 0o755,
    }];
    for (path, content) in files {
        let base = (path == "src/old.rs").then_some(&b"old content"[..]);
        changes.push(write(path, base, content, 0o644));
    }
    let resp = client
        .post(url("commit"))
        .bearer_auth(TOKEN)
        .json(&cs("c-1", changes))
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let result: CommitResult = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(result.conflicts.is_empty(), "{:?}", result.conflicts);
    for (path, content) in files {
        assert_eq!(std::fs::read(root.join(path)).unwrap(), content, "{path}");
    }

    let ops = recorder.ops();
    let ops = &ops[..];
    // Node ids by name as they were created (directories and staged files).
    let created = |name: &str| -> Vec<(usize, u64)> {
        ops.iter()
            .enumerate()
            .filter_map(|(i, op)| match op {
                Op::Create { name: n, fid, .. } if n.to_string_lossy() == name => Some((i, *fid)),
                _ => None,
            })
            .collect()
    };
    let dir_fid = |name: &str| created(name).first().map(|(_, f)| *f);
    let renames: Vec<(usize, u64, String)> = ops[start..]
        .iter()
        .enumerate()
        .filter_map(|(i, op)| match op {
            Op::Rename {
                name,
                newparent,
                newname,
                ..
            } if name.to_string_lossy().starts_with(".awcp-tmp-") => Some((
                start + i,
                *newparent,
                newname.to_string_lossy().into_owned(),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        renames.len(),
        files.len(),
        "one rename per written file: {renames:?}"
    );
    let first_rename = renames.iter().map(|r| r.0).min().unwrap();
    // Each staged file: written, then synced, before the first rename of the commit.
    let staged: Vec<(usize, u64)> = ops[start..]
        .iter()
        .enumerate()
        .filter_map(|(i, op)| match op {
            Op::Create { name, fid, .. } if name.to_string_lossy().starts_with(".awcp-tmp-") => {
                Some((start + i, *fid))
            }
            _ => None,
        })
        .collect();
    assert_eq!(staged.len(), files.len(), "one staged file per write");
    for (_, fid) in &staged {
        let last_write = ops
            .iter()
            .rposition(|op| matches!(op, Op::Write { fid: f, .. } | Op::Truncate { fid: f, .. } if f == fid))
            .expect("a staged file never written");
        let synced = ops[last_write..first_rename]
            .iter()
            .any(|op| matches!(op, Op::Fsync { fid: f } if f == fid));
        assert!(
            synced,
            "a staged file was renamed into place before it was synced (ops {start}..): {:?}",
            &ops[start..]
        );
    }
    // Each directory a file was renamed into: synced after the last rename.
    let last_rename = renames.iter().map(|r| r.0).max().unwrap();
    let mut dirs: Vec<u64> = renames.iter().map(|r| r.1).collect();
    dirs.sort_unstable();
    dirs.dedup();
    assert_eq!(dirs.len(), 3, "the root, src and docs: {renames:?}");
    assert!(dirs.contains(&dir_fid("src").unwrap()) && dirs.contains(&dir_fid("docs").unwrap()));
    for dir in dirs {
        assert!(
            ops[last_rename..]
                .iter()
                .any(|op| matches!(op, Op::FsyncDir { fid } if *fid == dir)),
            "directory {dir} not synced after the commit's renames"
        );
    }
    drop(recorder);
}
