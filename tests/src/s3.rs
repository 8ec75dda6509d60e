//! A real S3-compatible server for the block tier's tests: `s3s-fs` (crates.io; `.ci/run`
//! installs it with `cargo install --locked s3s-fs --version 0.14.1 --features binary`),
//! started on loopback with fixed credentials and its data in a temp dir, stopped on drop.
//!
//! Where `s3s-fs` is missing, [`S3Server::start`] answers `None` and says so loudly —
//! except under `CI=true`, where it panics: CI must run these tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use awcpfs::blockobj::PackEntry;
use awcpfs::export::tier::BlockTierConfig;

/// The server's access key (tests only).
pub const ACCESS_KEY: &str = "AKIAAWCPTESTS000";
/// The server's secret key (tests only).
pub const SECRET_KEY: &str = "awcp-tests-secret-key-not-a-real-one";
/// The bucket every test uses.
pub const BUCKET: &str = "awcp-blocks";
/// The region the client signs for (s3s-fs accepts any).
pub const REGION: &str = "us-east-1";

/// A running `s3s-fs`.
pub struct S3Server {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
    /// Where it keeps buckets (one directory each) and objects (files below them).
    pub root: PathBuf,
    _dir: tempfile::TempDir,
}

impl S3Server {
    /// Start `s3s-fs` on a free loopback port with [`BUCKET`] created; `None` (loudly) when
    /// it is not installed and `CI` is not `true`.
    pub fn start() -> Option<S3Server> {
        let found = Command::new("s3s-fs")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "block tier tests must run in CI, but s3s-fs is missing (.ci/run installs it: \
                 cargo install --locked s3s-fs --version 0.14.1 --features binary)"
            );
            awcpfs::testing::skipped(
                "the block tier tests (s3s-fs)",
                "cargo install --locked s3s-fs --version 0.14.1 --features binary",
            );
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("s3");
        std::fs::create_dir_all(root.join(BUCKET)).unwrap();
        // A free port: bind, note, release (s3s-fs cannot report the one it chose).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::fs::File::create(dir.path().join("s3s-fs.log")).unwrap();
        let child = Command::new("s3s-fs")
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(&root)
            .env("RUST_LOG", "warn")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting s3s-fs");
        let server = S3Server {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
            root,
            _dir: dir,
        };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "s3s-fs did not listen on port {port} within 20 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(server)
    }

    /// The settings a client of this server needs (endpoint, credentials, plain HTTP).
    pub fn options(&self) -> Vec<(String, String)> {
        [
            ("aws_endpoint", self.endpoint.as_str()),
            ("aws_access_key_id", ACCESS_KEY),
            ("aws_secret_access_key", SECRET_KEY),
            ("aws_region", REGION),
            ("aws_allow_http", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    /// A block tier under `s3://<BUCKET>/<prefix>` on this server.
    pub fn tier(&self, prefix: &str, url_ttl: Duration) -> BlockTierConfig {
        BlockTierConfig {
            url: format!("s3://{BUCKET}/{prefix}"),
            url_ttl,
            options: self.options(),
            call_timeout: awcpfs::export::tier::DEFAULT_CALL_TIMEOUT,
        }
    }

    /// The environment `awcp-ctl serve --blocks` reads to reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
            ("AWS_REGION", REGION.into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }

    /// Where the object of block `hash` (hex) under `prefix` is on disk.
    pub fn block_object(&self, prefix: &str, hash: &str) -> PathBuf {
        let mut p = self.root.join(BUCKET);
        if !prefix.is_empty() {
            p = p.join(prefix);
        }
        p.join("b3").join(hash)
    }

    /// How many block objects of their own are stored under `prefix`.
    pub fn block_count(&self, prefix: &str) -> usize {
        hash_names(&self.block_object(prefix, "")).len()
    }

    /// Where pack `name` (hex) under `prefix` is on disk (its index: the same with `.idx`).
    pub fn pack_object(&self, prefix: &str, name: &str) -> PathBuf {
        let mut p = self.root.join(BUCKET);
        if !prefix.is_empty() {
            p = p.join(prefix);
        }
        p.join("p3").join(name)
    }

    /// Every pack under `prefix` that has its index, and the index's entries (checked as a
    /// Delegator reading them at start does; a malformed index panics).
    pub fn packs(&self, prefix: &str) -> Vec<(String, Vec<PackEntry>)> {
        let mut out = Vec::new();
        for name in hash_names(&self.pack_object(prefix, "")) {
            let pack = self.pack_object(prefix, &name);
            let Ok(index) = std::fs::read(pack.with_extension("idx")) else {
                continue;
            };
            let size = std::fs::metadata(&pack).unwrap().len();
            let mut hash = [0u8; 32];
            hex::decode_to_slice(&name, &mut hash).unwrap();
            let entries = awcpfs::blockobj::decode_pack_index(&index, &hash, size)
                .unwrap_or_else(|| panic!("malformed index of pack {name}"));
            out.push((name, entries));
        }
        out
    }

    /// Every block stored under `prefix` (hex), once per copy: objects of their own and
    /// entries of pack indexes.
    pub fn stored_blocks(&self, prefix: &str) -> Vec<String> {
        let mut out = hash_names(&self.block_object(prefix, ""));
        for (_, entries) in self.packs(prefix) {
            out.extend(entries.iter().map(|e| hex::encode(e.hash)));
        }
        out
    }

    /// Where block `hash` (hex) sits in a pack under `prefix`: the pack's file, and the
    /// offset and length of the block's object in it.
    pub fn packed_block(&self, prefix: &str, hash: &str) -> Option<(PathBuf, u64, u32)> {
        self.packs(prefix).into_iter().find_map(|(name, entries)| {
            let e = entries.iter().find(|e| hex::encode(e.hash) == hash)?;
            Some((self.pack_object(prefix, &name), e.offset, e.len))
        })
    }
}

/// The names in `dir` that are 64 hex digits.
fn hash_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| is_hash(n))
                .collect()
        })
        .unwrap_or_default()
}

fn is_hash(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

impl Drop for S3Server {
    fn drop(&mut self) {
        // Our own child, by its pid.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The distinct block hashes (hex) of every file under `dir`, cut into `block_size` blocks
/// as the export does.
pub fn block_hashes(dir: &Path, block_size: usize) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                if e.file_name() != ".git" {
                    stack.push(e.path());
                }
            } else if t.is_file() {
                let data = std::fs::read(e.path()).unwrap();
                for chunk in data.chunks(block_size) {
                    out.insert(blake3::hash(chunk).to_hex().to_string());
                }
            }
        }
    }
    out
}
