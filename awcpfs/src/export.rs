//! Delegator side of the `awcpfs` data plane: serve directories to Executors.
//!
//! An [`ExportRegistry`] holds any number of [`Export`]s, each one directory shared under an
//! id, a capability token and a [`Lease`]. [`ExportRegistry::router`] is the HTTP API of
//! [`awcp_protocol::dataplane`] for all of them (`/v1/exports/{id}/…`).
//!
//! # Design
//!
//! * **Manifest snapshot.** [`ExportRegistry::register`] walks the tree once and keeps the
//!   manifest's canonical binary encoding ([`Manifest::to_binary`]), zstd-compressed, as it
//!   serves it; the blake3 of the uncompressed encoding is the `manifestDigest` of the
//!   transport handle. JSON is served too, on request, built on first use.
//!   The manifest is never rebuilt: the Executor sees the tree as it was at register time plus
//!   its own commits.
//! * **Content-addressed blocks.** Content is served by block hash, from a block index built
//!   with the manifest and extended by commits, and from a staging store of uploaded blocks.
//!   Every block read from the tree is re-hashed before it is served, so a file that changed
//!   since the snapshot is never served as if it had not (see `store`).
//! * **Confinement.** Every filesystem access goes through a root directory descriptor and
//!   `openat(O_NOFOLLOW)` component by component (see `rootfs`): no path from the
//!   network, and no symlink in the tree, can make the export read or write outside its root.
//! * **Commits** are serialised per export, idempotent by `commitId`, staged completely before
//!   anything is applied, and detect conflicting changes on the Delegator's side from the base
//!   hash each change carries (see `commit`).
//! * **Gates.** Every request is authenticated (constant-time token comparison) and checked
//!   against the lease: reads need an active lease; `/missing`, `/upload` and `/commit`
//!   are also accepted within the lease's flush grace so the Executor can push its last
//!   changes after a revoke or an expiry (see `http`).
//!
//! Registering does blocking IO (the walk hashes every file); call it from
//! `tokio::task::spawn_blocking` in async code. The router does its own blocking IO on the
//! blocking pool.

pub mod aecp;
mod commit;
mod error;
pub mod hashcache;
mod http;
pub mod identity;
pub mod manifest;
mod progress;
mod reuse;
mod rootfs;
pub mod screen;
mod served;
pub mod stage;
mod store;
pub mod tier;
mod watch;

pub use progress::{BuildProgress, BuildProgressSnapshot};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use awcp_lease::Lease;
use awcp_protocol::dataplane::{
    ChangeSet, CommitResult, Conflict, EntryKind, Manifest, ManifestEntry,
};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use self::manifest::ManifestParams;
use self::rootfs::RootDir;
use self::store::{BlockSource, Staging};

/// Largest block size an export accepts (64 MiB): one block is held in memory at a time.
pub const MAX_BLOCK_SIZE: u32 = 64 << 20;
/// How many recent conflicts [`ExportStats::recent_conflicts`] keeps.
pub const RECENT_CONFLICTS: usize = 32;

/// Which paths an export shows: a predicate called with a path relative to the root
/// (`/`-separated) and whether it is a directory, `true` when it is visible. A hidden
/// directory is not entered. Hidden paths are left out of the manifest (so never served) and
/// refused in commits.
///
/// A filter may also *withhold* some hidden paths ([`PathFilter::withholding`]) instead of
/// leaving them out: a withheld file is listed in the manifest with its metadata as on the
/// Delegator (mode, size, times, inode number) and no content (no `hash`, no blocks, so
/// nothing of it can be fetched); a withheld directory is listed and entered, its entries
/// judged one by one. Both stay refused in commits. A mount shows a withheld file as present
/// but unreadable, so a tool comparing it with a record of the tree (git's index) finds it
/// unchanged instead of deleted.
#[derive(Clone)]
pub struct PathFilter {
    shows: Arc<PathPredicate>,
    withholds: Option<Arc<PathPredicate>>,
}

/// `(path, is_dir) -> visible`.
pub type PathPredicate = dyn Fn(&str, bool) -> bool + Send + Sync;

impl std::fmt::Debug for PathFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PathFilter(..)")
    }
}

impl PathFilter {
    /// A filter showing the paths `shows(path, is_dir)` is true for.
    pub fn new(shows: impl Fn(&str, bool) -> bool + Send + Sync + 'static) -> PathFilter {
        PathFilter {
            shows: Arc::new(shows),
            withholds: None,
        }
    }

    /// Of the hidden paths, list those `withholds(path, is_dir)` is true for (asked only
    /// about paths the filter hides) instead of leaving them out (see [`PathFilter`]).
    pub fn withholding(
        mut self,
        withholds: impl Fn(&str, bool) -> bool + Send + Sync + 'static,
    ) -> PathFilter {
        self.withholds = Some(Arc::new(withholds));
        self
    }

    /// Whether the entry `path` itself is visible (the directories above it aside).
    pub fn shows_entry(&self, path: &str, is_dir: bool) -> bool {
        (self.shows)(path, is_dir)
    }

    /// Whether the hidden entry `path` is listed anyway, its content withheld.
    pub fn withholds(&self, path: &str, is_dir: bool) -> bool {
        self.withholds.as_ref().is_some_and(|w| w(path, is_dir))
    }

    /// Whether `path` and every directory above it are visible. A name that is not UTF-8
    /// is matched with each undecodable byte shown as U+FFFD (so `*` and `?` patterns
    /// cover it; see [`awcp_protocol::rawname::lossy`]).
    pub fn shows(&self, path: &str, is_dir: bool) -> bool {
        let path = awcp_protocol::rawname::lossy(path);
        path.match_indices('/')
            .all(|(end, _)| (self.shows)(&path[..end], true))
            && (self.shows)(&path, is_dir)
    }
}

/// How to serve one directory.
#[derive(Debug, Clone)]
pub struct ExportConfig {
    /// The directory to serve.
    pub root: PathBuf,
    /// Refuse commits and uploads (`ro` delegation).
    pub read_only: bool,
    /// Block size for the manifest and the block index (1 ..= [`MAX_BLOCK_SIZE`]).
    pub block_size: u32,
    /// Per-export scratch directory for uploaded blocks; created if missing; must lie
    /// outside `root`.
    pub staging_dir: PathBuf,
}

/// Why an export could not be registered.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The id is already registered.
    #[error("export id {export_id:?} is already registered; remove it first or choose another id")]
    Duplicate {
        /// The id.
        export_id: String,
    },
    /// The id cannot be used as a URL path segment.
    #[error(
        "export id {export_id:?} is not usable: use 1 to 128 characters from A-Z a-z 0-9 _ . -"
    )]
    InvalidId {
        /// The id.
        export_id: String,
    },
    /// The token is empty.
    #[error("the capability token of export {export_id:?} is empty; generate a random token")]
    EmptyToken {
        /// The id.
        export_id: String,
    },
    /// The block size is out of range.
    #[error("block size {block_size} is out of range; use 1 to {max} bytes")]
    BlockSize {
        /// The configured size.
        block_size: u32,
        /// The largest accepted.
        max: u32,
    },
    /// The root cannot be opened as a directory.
    #[error("cannot open export root {} as a directory", root.display())]
    OpenRoot {
        /// The root.
        root: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The staging directory lies inside the root.
    #[error(
        "staging dir {} lies inside export root {}; put it outside so uploads never appear in the shared tree",
        staging_dir.display(),
        root.display()
    )]
    StagingInsideRoot {
        /// The staging directory.
        staging_dir: PathBuf,
        /// The root.
        root: PathBuf,
    },
    /// The staging directory cannot be created or resolved.
    #[error("cannot create staging dir {}", staging_dir.display())]
    Staging {
        /// The staging directory.
        staging_dir: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The walk of the root failed.
    #[error("cannot build the manifest of {}", root.display())]
    Manifest {
        /// The root.
        root: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The manifest could not be encoded.
    #[error("cannot encode the manifest of export {export_id:?}")]
    Serialize {
        /// The id.
        export_id: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Counters of one export, as reported by status endpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExportStats {
    /// Block content bytes served by `/blocks`.
    pub bytes_served: u64,
    /// Blocks served by `/blocks` (missing ones not counted).
    pub blocks_served: u64,
    /// `GET /manifest` answers.
    pub manifest_fetches: u64,
    /// Commits applied (retries answered from memory not counted).
    pub commits: u64,
    /// Files written by commits (conflict copies included).
    pub files_written: u64,
    /// Bytes of those files.
    pub bytes_written: u64,
    /// Changes not applied because of a conflict.
    pub conflicts: u64,
    /// The last [`RECENT_CONFLICTS`] conflicts, oldest first.
    pub recent_conflicts: Vec<Conflict>,
    /// Paths the watcher read to see whether the Delegator changed them.
    pub paths_described: u64,
    /// Delegator-side changes recorded for mounts.
    pub upstream_changes: u64,
    /// Block tier: bytes this export uploaded to the object store (its share of what the
    /// Delegator's process sent out besides `bytesServed`).
    pub store_bytes_uploaded: u64,
    /// Block tier: presigned URLs handed to mounts (`POST /locate`), one per block.
    pub store_urls: u64,
    /// Block tier, write-back: bytes of blocks the Executor put in the store and the export
    /// took from there (`POST /adopt`) instead of receiving them on `/upload`.
    pub store_bytes_adopted: u64,
}

/// Live counters behind [`ExportStats`].
#[derive(Debug, Default)]
struct Stats {
    bytes_served: AtomicU64,
    blocks_served: AtomicU64,
    manifest_fetches: AtomicU64,
    commits: AtomicU64,
    files_written: AtomicU64,
    bytes_written: AtomicU64,
    conflicts: AtomicU64,
    recent_conflicts: Mutex<std::collections::VecDeque<Conflict>>,
    paths_described: AtomicU64,
    upstream_changes: AtomicU64,
    store_bytes_uploaded: AtomicU64,
    store_urls: AtomicU64,
    store_bytes_adopted: AtomicU64,
}

impl Stats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn record_conflict(&self, c: &Conflict) {
        Self::add(&self.conflicts, 1);
        let mut recent = self.recent_conflicts.lock();
        if recent.len() == RECENT_CONFLICTS {
            recent.pop_front();
        }
        recent.push_back(c.clone());
    }

    fn snapshot(&self) -> ExportStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ExportStats {
            bytes_served: get(&self.bytes_served),
            blocks_served: get(&self.blocks_served),
            manifest_fetches: get(&self.manifest_fetches),
            commits: get(&self.commits),
            files_written: get(&self.files_written),
            bytes_written: get(&self.bytes_written),
            conflicts: get(&self.conflicts),
            recent_conflicts: self.recent_conflicts.lock().iter().cloned().collect(),
            paths_described: get(&self.paths_described),
            upstream_changes: get(&self.upstream_changes),
            store_bytes_uploaded: get(&self.store_bytes_uploaded),
            store_urls: get(&self.store_urls),
            store_bytes_adopted: get(&self.store_bytes_adopted),
        }
    }
}

/// One served directory.
#[derive(Debug)]
pub struct Export {
    id: String,
    /// blake3 of the token: comparing hashes is constant-time in both content and length.
    token_hash: blake3::Hash,
    read_only: bool,
    block_size: u32,
    lease: Arc<Lease>,
    /// The manifest's header: its `entries` are empty (they are `manifest_entries`).
    manifest: Manifest,
    /// The manifest's entries: shared with a kept walk, not copied (100,000s of entries).
    manifest_entries: Arc<Vec<ManifestEntry>>,
    /// The binary encoding, zstd-compressed: what mounts fetch.
    manifest_zst: axum::body::Bytes,
    /// Its entries, encoded once (see `served`): kept with a kept walk.
    manifest_body: Option<Arc<served::EncodedBody>>,
    /// The JSON form, built the first time someone asks for it.
    manifest_json: std::sync::OnceLock<axum::body::Bytes>,
    /// Where each path is in `manifest.entries`, built the first time a commit needs an
    /// entry of it (a `chmod` of a path unchanged since registration).
    manifest_paths: std::sync::OnceLock<std::collections::HashMap<String, usize>>,
    manifest_digest: String,
    blocks: BlockSource,
    stats: Stats,
    commits: Arc<tokio::sync::Mutex<commit::CommitLog>>,
    filter: Option<PathFilter>,
    /// Changes to the tree since registration, for mounts (see `watch`).
    feed: watch::ChangeFeed,
    /// Where commits go instead of the tree, once set (staged snapshot mode).
    stage: std::sync::OnceLock<Arc<stage::ChangeStage>>,
    /// AECP artifact-index events for the mount, and its delivery reports.
    aecp: aecp::AecpFeed,
    /// The Delegator's block tier, if it has one (`POST /locate` hands out its URLs).
    tier: Option<Arc<tier::BlockTier>>,
    /// The commit screen and the worker it screens for, once a daemon installs one.
    screen: Mutex<Option<(String, Arc<dyn screen::CommitScreen>)>>,
    /// How long the writes of applied commits had waited since their close on the mount
    /// (see [`crate::lag`]).
    writeback_lag: crate::lag::Lag,
    /// What its walk tells about keeping it for the next registration (a fresh walk of a
    /// registration that gave a key; see [`ExportRegistry::keep_walk`]).
    walk: Option<reuse::WalkFacts>,
    /// Its manifest is a kept walk's, checked against the tree instead of walked again.
    took_kept_walk: bool,
}

impl Export {
    /// The content of block `hash`, verified: from the block index or the staging store,
    /// else — the index keeps a few places per block, and content found in many files can
    /// outlive all of them — from a file the change feed knows as holding exactly this
    /// content (one-block files, the common case). `None` when nothing has it any more.
    pub(crate) fn read_block(&self, hash: &store::BlockHash) -> Option<Vec<u8>> {
        self.blocks
            .read_block(hash)
            .or_else(|| self.read_block_elsewhere(hash))
    }

    /// [`Export::read_block`]'s last resort: a one-block file the change feed knows as
    /// holding exactly this content. A scan of the feed's paths (about a millisecond at
    /// 100,000), paid only by a block nothing indexed holds — mostly content the Delegator
    /// has changed since, which no file holds any more.
    fn read_block_elsewhere(&self, hash: &store::BlockHash) -> Option<Vec<u8>> {
        let block_size = u64::from(self.block_size);
        let places: Vec<store::BlockLoc> = self
            .feed
            .files_with_content(&store::hash_hex(hash), block_size, 8)
            .into_iter()
            .map(|(path, size)| store::BlockLoc {
                path: path.into(),
                offset: 0,
                len: size as u32,
            })
            .collect();
        if places.is_empty() {
            return None;
        }
        let found = self.blocks.read_unindexed(hash, places);
        if found.is_some() {
            tracing::debug!(hash = %store::hash_hex(hash), "block found outside the index");
        }
        found
    }

    /// Count bytes this export uploaded to the block tier.
    pub(crate) fn note_store_upload(&self, bytes: u64) {
        Stats::add(&self.stats.store_bytes_uploaded, bytes);
    }

    /// The block tier this export hands out URLs of, if any.
    pub fn tier(&self) -> Option<&Arc<tier::BlockTier>> {
        self.tier.as_ref()
    }

    /// The manifest as JSON (built on first use and kept).
    pub(crate) fn manifest_json(&self) -> axum::body::Bytes {
        self.manifest_json
            .get_or_init(|| {
                serde_json::to_vec(&self.manifest())
                    .unwrap_or_default()
                    .into()
            })
            .clone()
    }

    /// The export's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// blake3 (hex) of the manifest's canonical binary encoding, the bytes `GET /manifest`
    /// serves (zstd-compressed) to a client that accepts them.
    pub fn manifest_digest(&self) -> String {
        self.manifest_digest.clone()
    }

    /// The registration manifest's entry at `path`, if it lists one.
    pub(crate) fn manifest_entry(&self, path: &str) -> Option<ManifestEntry> {
        let paths = self.manifest_paths.get_or_init(|| {
            self.manifest_entries
                .iter()
                .enumerate()
                .map(|(i, e)| (e.path.clone(), i))
                .collect()
        });
        paths.get(path).map(|&i| self.manifest_entries[i].clone())
    }

    /// A copy of the manifest as built at register time (at 100,000 files a copy of
    /// 100,000 entries: [`Export::manifest_entries`] reads them in place).
    pub fn manifest(&self) -> Manifest {
        Manifest {
            entries: self.manifest_entries.to_vec(),
            ..self.manifest.clone()
        }
    }

    /// The entries of the manifest built at register time.
    pub fn manifest_entries(&self) -> &[ManifestEntry] {
        &self.manifest_entries
    }

    /// Whether its manifest is an earlier registration's walk, found unchanged (see
    /// [`ExportRegistry::register_reusing`]), rather than a walk of its own.
    pub fn took_kept_walk(&self) -> bool {
        self.took_kept_walk
    }

    /// Block size of the manifest.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Whether commits and uploads are refused.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The lease that gates every request.
    pub fn lease(&self) -> &Arc<Lease> {
        &self.lease
    }

    /// AECP's events for the mounts of this export and their delivery reports.
    pub fn aecp(&self) -> &aecp::AecpFeed {
        &self.aecp
    }

    /// Screen the writes of `worker`'s commits with `screen` from now on (replacing an
    /// earlier screen; see [`screen::CommitScreen`]).
    pub fn set_screen(&self, worker: &str, screen: Arc<dyn screen::CommitScreen>) {
        *self.screen.lock() = Some((worker.to_owned(), screen));
    }

    /// The installed screen and its worker.
    pub(crate) fn screen(&self) -> Option<(String, Arc<dyn screen::CommitScreen>)> {
        self.screen.lock().clone()
    }

    /// The served directory.
    pub fn root(&self) -> &Path {
        self.blocks.root.path()
    }

    /// Current counters.
    pub fn stats(&self) -> ExportStats {
        self.stats.snapshot()
    }

    /// How long the writes of the commits applied to the workspace had waited since the
    /// mount closed them: the commit's `ageMs` plus the time until it was applied. Commits
    /// without `ageMs` (an older mount's), to a staging area, or answered again from the
    /// log are not counted.
    pub fn writeback_lag(&self) -> crate::lag::Histogram {
        self.writeback_lag.snapshot()
    }

    /// Count a commit applied `since` it arrived whose oldest change had waited `age_ms`
    /// on the mount when it was sent.
    pub(crate) fn note_applied(&self, age_ms: Option<u64>, since: std::time::Instant) {
        if let Some(age) = age_ms {
            self.writeback_lag
                .observe(std::time::Duration::from_millis(age) + since.elapsed());
        }
    }

    /// Apply a change set that arrives with its new blocks in hand — a recovery bundle an
    /// Executor kept when it could not write back in time (`awcp-ctl collect`). Blocks are
    /// verified and staged, then the change set is committed exactly as `POST /commit`
    /// would: same path checks, same base-hash conflict handling (both versions kept). The
    /// lease is not consulted: the Delegator itself asked for this.
    pub fn apply_bundle(
        &self,
        changes: &ChangeSet,
        blocks: &[([u8; 32], Vec<u8>)],
    ) -> Result<CommitResult, BundleError> {
        for (hash, data) in blocks {
            if blake3::hash(data).as_bytes() != hash {
                return Err(BundleError::Checksum {
                    hash: hex::encode(hash),
                });
            }
            self.blocks
                .staging
                .store(hash, data)
                .map_err(|source| BundleError::Staging { source })?;
        }
        commit::run(self, changes).map_err(|e| BundleError::Commit {
            message: e.to_string(),
        })
    }

    /// From now on, keep every commit in `stage` instead of writing it to the tree (staged
    /// snapshot mode). Set it before the Executor can commit; false if a stage was already
    /// set (the first one stays).
    pub fn stage_commits(&self, stage: Arc<stage::ChangeStage>) -> bool {
        self.stage.set(stage).is_ok()
    }

    /// The change set commits go to, if this export stages them.
    pub fn stage(&self) -> Option<&Arc<stage::ChangeStage>> {
        self.stage.get()
    }

    /// An export of `root` that serves nothing and is in no registry: it exists to commit a
    /// change set whose blocks are in `staging_dir` (applying a staged change set after
    /// the delegation's own export is gone). No manifest is built.
    pub fn detached(
        root: &Path,
        staging_dir: &Path,
        filter: Option<PathFilter>,
    ) -> Result<Export, ExportError> {
        let dir = RootDir::open(root).map_err(|source| ExportError::OpenRoot {
            root: root.to_owned(),
            source,
        })?;
        let staging = Staging::open(staging_dir).map_err(|source| ExportError::Staging {
            staging_dir: staging_dir.to_owned(),
            source,
        })?;
        let lease = Arc::new(Lease::grant(
            Arc::new(awcp_lease::SystemClock::new()),
            awcp_lease::LeaseTerms {
                ttl: std::time::Duration::from_secs(60),
                max_ttl: std::time::Duration::from_secs(60),
                flush_grace: std::time::Duration::ZERO,
            },
        ));
        let block_size = awcp_protocol::dataplane::DEFAULT_BLOCK_SIZE;
        let manifest = Manifest {
            version: awcp_protocol::dataplane::DATA_PLANE_VERSION,
            export_id: "detached".into(),
            block_size,
            read_only: false,
            root_mode: 0o755,
            root_mtime_ns: 0,
            entries: Vec::new(),
        };
        Ok(Export {
            id: "detached".into(),
            token_hash: blake3::hash(&rand::random::<[u8; 32]>()),
            read_only: false,
            block_size,
            lease,
            // Not watched: nothing mounts a detached export.
            feed: watch::ChangeFeed::new(&manifest),
            manifest,
            manifest_entries: Default::default(),
            manifest_zst: axum::body::Bytes::new(),
            manifest_body: None,
            manifest_json: std::sync::OnceLock::new(),
            manifest_paths: std::sync::OnceLock::new(),
            manifest_digest: String::new(),
            blocks: BlockSource {
                root: dir,
                index: RwLock::new(Default::default()),
                staging,
            },
            stats: Stats::default(),
            commits: Arc::new(tokio::sync::Mutex::new(commit::CommitLog::default())),
            filter,
            stage: std::sync::OnceLock::new(),
            aecp: aecp::AecpFeed::default(),
            tier: None,
            screen: Mutex::new(None),
            writeback_lag: Default::default(),
            walk: None,
            took_kept_walk: false,
        })
    }

    /// Whether `token` is this export's token (constant time).
    fn token_matches(&self, token: &str) -> bool {
        // `blake3::Hash`'s `PartialEq` is constant-time.
        blake3::hash(token.as_bytes()) == self.token_hash
    }
}

/// Why a recovery bundle could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// A block's content does not match its hash.
    #[error("bundle block {hash} does not match its hash")]
    Checksum {
        /// The block.
        hash: String,
    },
    /// Staging a block failed.
    #[error("staging a bundle block failed")]
    Staging {
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The commit was refused as a whole (bad paths, missing blocks).
    #[error("the bundle's change set was refused: {message}")]
    Commit {
        /// The export's words.
        message: String,
    },
}

/// All exports of a process. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct ExportRegistry {
    exports: Arc<RwLock<HashMap<String, Arc<Export>>>>,
    hash_cache: Option<Arc<hashcache::HashCache>>,
    watch: bool,
    tier: Option<Arc<tier::BlockTier>>,
    /// Walks kept for the next registration of the same root (see `reuse`).
    kept: Arc<Mutex<reuse::Kept>>,
}

impl Default for ExportRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl ExportRegistry {
    /// Ends the event streams of every export (the serving process stops: see
    /// [`aecp::AecpFeed::close_streams`]).
    pub fn close_streams(&self) {
        for e in self.exports.read().values() {
            e.aecp().close_streams();
        }
    }

    /// An empty registry; every registration hashes every file. Exports watch their tree
    /// and tell mounts about the Delegator's own changes (see [`without_watch`]).
    ///
    /// [`without_watch`]: Self::without_watch
    pub fn new() -> Self {
        ExportRegistry {
            exports: Arc::default(),
            hash_cache: None,
            watch: true,
            tier: None,
            kept: Arc::default(),
        }
    }

    /// An empty registry whose manifest builds reuse the hashes of files unchanged since
    /// an earlier build (saved to the cache's file after each registration).
    pub fn with_hash_cache(cache: Arc<hashcache::HashCache>) -> Self {
        ExportRegistry {
            hash_cache: Some(cache),
            ..Self::new()
        }
    }

    /// Put every export's blocks in `tier` (uploaded in the background after registration
    /// and when first asked for) and hand mounts presigned URLs of them (`POST /locate`).
    pub fn with_block_tier(mut self, tier: Arc<tier::BlockTier>) -> Self {
        self.tier = Some(tier);
        self
    }

    /// The block tier, if any.
    pub fn block_tier(&self) -> Option<&Arc<tier::BlockTier>> {
        self.tier.as_ref()
    }

    /// Do not watch exported trees: mounts then see each tree as it was when it was
    /// registered, plus their own changes (the manifest is a snapshot).
    pub fn without_watch(mut self) -> Self {
        self.watch = false;
        self
    }

    /// Serve `cfg.root` as `export_id`, guarded by `token` and `lease`.
    ///
    /// Builds the manifest and the block index eagerly: blocking IO proportional to the
    /// tree's size (every file is hashed), so call it from `spawn_blocking` in async code.
    pub fn register(
        &self,
        export_id: String,
        token: String,
        cfg: ExportConfig,
        lease: Arc<Lease>,
    ) -> Result<Arc<Export>, ExportError> {
        self.register_filtered(export_id, token, cfg, lease, None)
    }

    /// [`register`](Self::register), showing only the paths `filter` lets through.
    pub fn register_filtered(
        &self,
        export_id: String,
        token: String,
        cfg: ExportConfig,
        lease: Arc<Lease>,
        filter: Option<PathFilter>,
    ) -> Result<Arc<Export>, ExportError> {
        self.register_with_progress(export_id, token, cfg, lease, filter, None)
    }

    /// [`register_filtered`](Self::register_filtered), counting the manifest build's
    /// progress in `progress` (files and bytes found and hashed) as it goes.
    pub fn register_with_progress(
        &self,
        export_id: String,
        token: String,
        cfg: ExportConfig,
        lease: Arc<Lease>,
        filter: Option<PathFilter>,
        progress: Option<Arc<BuildProgress>>,
    ) -> Result<Arc<Export>, ExportError> {
        self.register_inner(export_id, token, cfg, lease, filter, progress, None)
    }

    /// [`register_with_progress`](Self::register_with_progress), taking the walk kept from
    /// an earlier registration of the same root with the same `walk_key` when nothing in
    /// the tree changed since (checked entry by entry: see [`keep_walk`](Self::keep_walk)).
    ///
    /// `walk_key` names everything besides the tree that decides what the walk lists and
    /// what the caller learned from it: the filter's settings, and whatever the filter
    /// records. A registration that takes a kept walk does not call the filter at all.
    #[allow(clippy::too_many_arguments)]
    pub fn register_reusing(
        &self,
        export_id: String,
        token: String,
        cfg: ExportConfig,
        lease: Arc<Lease>,
        filter: Option<PathFilter>,
        progress: Option<Arc<BuildProgress>>,
        walk_key: String,
    ) -> Result<Arc<Export>, ExportError> {
        self.register_inner(
            export_id,
            token,
            cfg,
            lease,
            filter,
            progress,
            Some(walk_key),
        )
    }

    /// Keep `export`'s walk for the next [`register_reusing`](Self::register_reusing) of
    /// its root with the same key: call it once the caller has accepted what the walk found
    /// (e.g. its filter recorded nothing that refuses the tree). Only a fresh walk whose
    /// every entry was settled when it ran, whose hashes were all trusted and which skipped
    /// nothing is kept; the change feed's map for it is built on a background thread.
    pub fn keep_walk(&self, export: &Arc<Export>) {
        let Some(facts) = export.walk.clone().filter(|f| f.keepable) else {
            return;
        };
        let Some(body) = export.manifest_body.clone() else {
            return;
        };
        let (export, kept) = (export.clone(), self.kept.clone());
        let spawned = std::thread::Builder::new()
            .name("awcpfs-keep-walk".into())
            .spawn(move || {
                // A copy of 100,000s of entries, off the delegation's path.
                let walk = reuse::KeptWalk {
                    key: facts.key,
                    root: facts.root,
                    known: watch::known_of(&export.manifest_entries),
                    entries: export.manifest_entries.clone(),
                    index: export.blocks.index.read().clone(),
                    body,
                };
                drop(export);
                kept.lock().put(Arc::new(walk));
            });
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "cannot keep the walk");
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn register_inner(
        &self,
        export_id: String,
        token: String,
        cfg: ExportConfig,
        lease: Arc<Lease>,
        filter: Option<PathFilter>,
        progress: Option<Arc<BuildProgress>>,
        walk_key: Option<String>,
    ) -> Result<Arc<Export>, ExportError> {
        if !valid_id(&export_id) {
            return Err(ExportError::InvalidId { export_id });
        }
        if token.is_empty() {
            return Err(ExportError::EmptyToken { export_id });
        }
        if cfg.block_size == 0 || cfg.block_size > MAX_BLOCK_SIZE {
            return Err(ExportError::BlockSize {
                block_size: cfg.block_size,
                max: MAX_BLOCK_SIZE,
            });
        }
        if self.exports.read().contains_key(&export_id) {
            return Err(ExportError::Duplicate { export_id });
        }
        let root = RootDir::open(&cfg.root).map_err(|source| ExportError::OpenRoot {
            root: cfg.root.clone(),
            source,
        })?;
        let staging = open_staging(&cfg)?;
        let params = ManifestParams {
            export_id: export_id.clone(),
            block_size: cfg.block_size,
            read_only: cfg.read_only,
            filter: filter.clone(),
            progress: progress.clone(),
        };
        // Phase times, logged once registered: where a slow delegation goes.
        let t0 = std::time::Instant::now();
        let started = std::time::SystemTime::now();
        let walk_key = walk_key.map(|filter| reuse::WalkKey {
            root: cfg.root.clone(),
            block_size: cfg.block_size,
            filter,
        });
        let manifest_err = |source| ExportError::Manifest {
            root: cfg.root.clone(),
            source,
        };
        let root_stat = nix::sys::stat::fstat(root.fd())
            .map_err(std::io::Error::from)
            .map_err(manifest_err)?;
        let kept = walk_key.as_ref().and_then(|k| self.kept.lock().get(k));
        let reused = kept.filter(|k| reuse::still_holds(&root, k));
        let t_check = t0.elapsed();
        if let (Some(key), None) = (&walk_key, &reused) {
            // Changed since (or never kept): this walk may be kept instead.
            self.kept.lock().forget(key);
        }
        // `built.manifest` is the header from here on: its entries are `entries`.
        let (built, walk, entries) = match &reused {
            Some(k) => {
                if let Some(p) = &progress {
                    // The kept walk's files, all hashed: the figures a walk would show.
                    for e in k.entries.iter().filter(|e| e.kind == EntryKind::File) {
                        p.saw_file(e.size, true);
                    }
                    p.set_walked();
                }
                let built = manifest::Built {
                    manifest: Manifest {
                        version: awcp_protocol::dataplane::DATA_PLANE_VERSION,
                        export_id: params.export_id.clone(),
                        block_size: params.block_size,
                        read_only: params.read_only,
                        root_mode: k.root.mode(),
                        root_mtime_ns: k.root.mtime_ns(),
                        entries: Vec::new(),
                    },
                    index: k.index.clone(),
                    skipped: 0,
                    untrusted: 0,
                };
                (built, None, k.entries.clone())
            }
            None => {
                let built = manifest::build(&root, &params, self.hash_cache.as_deref())
                    .map_err(manifest_err)?;
                let walk = walk_key.map(|key| {
                    reuse::WalkFacts::of(
                        key,
                        reuse::RootStamp::of(&root_stat),
                        started,
                        &built.manifest.entries,
                        built.skipped,
                        built.untrusted,
                    )
                });
                let mut built = built;
                let entries = Arc::new(std::mem::take(&mut built.manifest.entries));
                (built, walk, entries)
            }
        };
        let t_walk = t0.elapsed();
        if let Some(cache) = self.hash_cache.as_ref().filter(|_| reused.is_none()) {
            // Off the delegation's path; a failed save only costs hashing again next time.
            let cache = cache.clone();
            std::thread::spawn(move || {
                if let Err(e) = cache.save() {
                    tracing::warn!(error = %e, "could not save the hash cache");
                }
            });
        }
        let serialize = |source: Box<dyn std::error::Error + Send + Sync>| ExportError::Serialize {
            export_id: export_id.clone(),
            source,
        };
        // The change feed's starting point (a map of every path) is built on a second thread
        // while this one encodes, hashes and compresses the manifest: ~30 ms each at 100,000
        // entries, on the way to the handle. A kept walk brings its entries encoded: then
        // only the header is (see `served`).
        let (encoded, feed) = std::thread::scope(|s| {
            let feed = s.spawn(|| {
                let t = std::time::Instant::now();
                let feed = match &reused {
                    Some(k) => watch::ChangeFeed::starting_from(k.known.clone()),
                    None => watch::ChangeFeed::starting_from(watch::known_of(&entries)),
                };
                (feed, t.elapsed())
            });
            let body = match &reused {
                Some(k) => Ok(k.body.clone()),
                None => served::EncodedBody::of(&entries).map(Arc::new),
            };
            let encoded = body
                .and_then(|body| Ok((served::serve(&built.manifest, &body)?, body)))
                .map_err(|e| serialize(Box::new(e)));
            if let (Some(p), Ok(_)) = (&progress, &encoded) {
                p.set_done();
            }
            let feed = feed
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (encoded, feed)
        });
        let (
            served::Served {
                digest: manifest_digest,
                zst,
            },
            body,
        ) = encoded?;
        let (feed, t_feed) = feed;
        let ms = |d: std::time::Duration| d.as_millis() as u64;
        tracing::info!(
            export = %export_id,
            root = %cfg.root.display(),
            entries = entries.len(),
            blocks = built.index.len(),
            digest = %manifest_digest,
            walk_ms = ms(t_walk),
            check_ms = ms(t_check),
            feed_ms = ms(t_feed),
            encode_ms = ms(t0.elapsed() - t_walk),
            kept_walk = reused.is_some(),
            "export registered"
        );
        // Answers to earlier commits (an export registered again after a restart), and a
        // change sequence that starts above every one they carry, even if the clock went
        // back.
        let commits = commit::CommitLog::open(&cfg.staging_dir);
        if let Some(seq) = commits.max_seq() {
            feed.start_above(seq);
        }
        let export = Arc::new(Export {
            feed,
            token_hash: blake3::hash(token.as_bytes()),
            read_only: cfg.read_only,
            block_size: cfg.block_size,
            lease,
            manifest: built.manifest,
            manifest_entries: entries,
            manifest_zst: zst.into(),
            manifest_body: Some(body),
            manifest_json: std::sync::OnceLock::new(),
            manifest_paths: std::sync::OnceLock::new(),
            manifest_digest,
            blocks: BlockSource {
                root,
                index: RwLock::new(built.index),
                staging,
            },
            stats: Stats::default(),
            commits: Arc::new(tokio::sync::Mutex::new(commits)),
            filter,
            stage: std::sync::OnceLock::new(),
            aecp: aecp::AecpFeed::default(),
            tier: self.tier.clone(),
            screen: Mutex::new(None),
            writeback_lag: Default::default(),
            id: export_id.clone(),
            walk,
            took_kept_walk: reused.is_some(),
        });
        // Re-check under the write lock: the walk above ran without it.
        let mut exports = self.exports.write();
        if exports.contains_key(&export_id) {
            return Err(ExportError::Duplicate { export_id });
        }
        exports.insert(export_id, export.clone());
        drop(exports);
        if self.watch {
            watch::spawn(&export, self.hash_cache.clone());
        }
        if let Some(tier) = &self.tier {
            tier.warm(&export);
        }
        Ok(export)
    }

    /// The export registered as `export_id`.
    pub fn get(&self, export_id: &str) -> Option<Arc<Export>> {
        self.exports.read().get(export_id).cloned()
    }

    /// Stop serving `export_id` (requests already running finish; open event streams end at
    /// the lease's next terminal event). Staged blocks stay in its `staging_dir`.
    pub fn remove(&self, export_id: &str) -> Option<Arc<Export>> {
        self.exports.write().remove(export_id)
    }

    /// The data-plane routes (`/v1/exports/{id}/…`) over this registry.
    pub fn router(&self) -> axum::Router {
        http::router(self.clone())
    }
}

/// Ids appear in URLs: keep them to a safe alphabet.
fn valid_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        && id != "."
        && id != ".."
}

/// Create the staging directory and check that it lies outside the root.
fn open_staging(cfg: &ExportConfig) -> Result<Staging, ExportError> {
    let staging_err = |source| ExportError::Staging {
        staging_dir: cfg.staging_dir.clone(),
        source,
    };
    let existed = cfg.staging_dir.exists();
    let staging = Staging::open(&cfg.staging_dir).map_err(staging_err)?;
    let staging_real = cfg.staging_dir.canonicalize().map_err(staging_err)?;
    let root_real = cfg
        .root
        .canonicalize()
        .map_err(|source| ExportError::OpenRoot {
            root: cfg.root.clone(),
            source,
        })?;
    if staging_real.starts_with(&root_real) {
        if !existed {
            // Do not leave the directory we just made in the shared tree.
            let _ = std::fs::remove_dir(&cfg.staging_dir);
        }
        return Err(ExportError::StagingInsideRoot {
            staging_dir: cfg.staging_dir.clone(),
            root: cfg.root.clone(),
        });
    }
    Ok(staging)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_see_non_utf8_names_with_replacement_characters() {
        let f = PathFilter::new(|p: &str, _| {
            assert!(
                !p.contains('\0'),
                "the escaped form reached a filter: {p:?}"
            );
            !p.ends_with(".secret") && p != "h\u{fffd}dden"
        });
        assert!(!f.shows("d\0ff/x.secret", false));
        assert!(
            !f.shows("h\0e9dden/x", false),
            "a hidden directory hides what is inside"
        );
        assert!(f.shows("d\0ff/x", false));
    }

    #[test]
    fn ids_are_url_safe() {
        assert!(valid_id("exp_0123abcd"));
        assert!(valid_id("a.b-c"));
        for bad in ["", ".", "..", "a/b", "a b", "ä", &"x".repeat(129)] {
            assert!(!valid_id(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn build_progress_counts_every_file_and_byte() {
        let root = tempfile::tempdir().unwrap();
        let staging = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("d")).unwrap();
        std::fs::write(root.path().join("a"), vec![1u8; 5000]).unwrap();
        std::fs::write(root.path().join("d/b"), b"hello").unwrap();
        std::fs::write(root.path().join("d/c"), b"").unwrap();
        let lease = Arc::new(Lease::grant(
            Arc::new(awcp_lease::ManualClock::new()),
            awcp_lease::LeaseTerms {
                ttl: std::time::Duration::from_secs(60),
                max_ttl: std::time::Duration::from_secs(60),
                flush_grace: std::time::Duration::ZERO,
            },
        ));
        let progress = Arc::new(BuildProgress::default());
        assert_eq!(progress.snapshot(), BuildProgressSnapshot::default());
        ExportRegistry::new()
            .register_with_progress(
                "exp_p".into(),
                "tok".into(),
                ExportConfig {
                    root: root.path().to_owned(),
                    read_only: false,
                    block_size: 4096,
                    staging_dir: staging.path().join("blocks"),
                },
                lease,
                None,
                Some(progress.clone()),
            )
            .unwrap();
        let p = progress.snapshot();
        assert_eq!(
            p,
            BuildProgressSnapshot {
                files_total: 3,
                bytes_total: 5005,
                files_hashed: 3,
                bytes_hashed: 5005,
                walked: true,
                done: true,
            }
        );
    }
}
