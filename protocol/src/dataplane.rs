//! Data-plane API types of the `awcpfs` transport.
//!
//! The data plane is plain HTTP on the Delegator's export. Every request carries the
//! delegation's capability token as `Authorization: Bearer <token>`; every answer is refused
//! once the lease is over. All routes live under `/v1/exports/{exportId}`:
//!
//! | route | body in | body out |
//! |---|---|---|
//! | `GET  /manifest` | — | [`Manifest`] (JSON) |
//! | `POST /blocks` | [`BlockRequest`] | block frames (see [`encode_block_frame`]) |
//! | `POST /locate` | [`LocateRequest`] | [`BlockLocations`] (the block tier; ours) |
//! | `POST /missing` | [`BlockRequest`] | [`MissingBlocks`] |
//! | `POST /upload` | block frames | [`UploadResult`] |
//! | `POST /commit` | [`ChangeSet`] | [`CommitResult`] |
//! | `POST /commits/applied` | [`AppliedQuery`] | [`AppliedCommits`] |
//! | `GET  /events` | — | SSE stream of [`ExportEvent`] |
//!
//! Paths on the wire are always relative to the export root, `/`-separated, never empty,
//! never absolute, and never contain `.` or `..` components ([`validate_rel_path`]).
//!
//! Block frames are the one binary encoding: for each block, 32 bytes of blake3 hash, a
//! little-endian `u32` length, then that many bytes. A length of [`MISSING_BLOCK`] with no
//! bytes following means the export no longer has that block.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Version of the data-plane API described here.
pub const DATA_PLANE_VERSION: u32 = 1;
/// Default block size: 1 MiB. Smaller files are one block of their real size.
pub const DEFAULT_BLOCK_SIZE: u32 = 1 << 20;
/// Length value in a block frame that says the block is missing.
pub const MISSING_BLOCK: u32 = u32::MAX;
/// Header carrying the wall-clock expiry of the lease on every data-plane answer.
pub const LEASE_EXPIRES_HEADER: &str = "x-awcp-lease-expires";

/// Kind of a manifest entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
}

/// The whole tree's metadata, fetched once when a mount starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// [`DATA_PLANE_VERSION`] of the export that built it.
    pub version: u32,
    /// The export this manifest describes.
    pub export_id: String,
    /// Block size used to cut files into blocks.
    pub block_size: u32,
    /// Whether the export refuses commits (`ro` delegation).
    pub read_only: bool,
    /// Mode bits of the root directory.
    pub root_mode: u32,
    /// Modification time of the root directory, nanoseconds since the Unix epoch.
    pub root_mtime_ns: i64,
    /// Every entry below the root, parents before children.
    pub entries: Vec<ManifestEntry>,
}

/// Metadata of one path in the exported tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ManifestEntry {
    /// Path relative to the export root (see [`crate::rawname`] for names that are not
    /// UTF-8).
    #[serde(with = "crate::rawname::wire")]
    pub path: String,
    /// File, directory or symlink.
    pub kind: EntryKind,
    /// Permission bits (`0o7777` mask).
    pub mode: u32,
    /// Size in bytes (files), target length (symlinks), 0 (directories).
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// blake3 hash (hex) of the whole content, for files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    /// blake3 hashes (hex) of the file's blocks, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<String>,
    /// Target of a symlink, as stored (may point outside: shown, never followed).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::rawname::wire_opt"
    )]
    pub target: Option<String>,
    /// Inode number on the Delegator. A mount reports it as `st_ino`, so an index that
    /// records inode numbers (git's) still matches on the mount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ino: Option<u64>,
    /// Status change time on the Delegator, nanoseconds since the Unix epoch (for the same
    /// reason).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctime_ns: Option<i64>,
    /// The entry's `user.*` extended attributes on the Delegator, name → value in hex.
    /// Values over [`MAX_MANIFEST_XATTR_VALUE`] bytes and names that are not UTF-8 are left
    /// out. Absent: none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, String>,
}

/// Largest extended attribute value the manifest carries (64 KiB, what the mount accepts
/// for a value too).
pub const MAX_MANIFEST_XATTR_VALUE: usize = 64 * 1024;

/// A list of block hashes: what to fetch, or what to check for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BlockRequest {
    /// blake3 hashes (hex).
    pub hashes: Vec<String>,
}

/// `POST /locate` body (ours): the blocks wanted, and whether the mount reads blocks out of
/// pack objects by range. An export that predates `ranges` ignores it (and answers a URL
/// per block), so a mount may always send it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LocateRequest {
    /// blake3 hashes (hex).
    pub hashes: Vec<String>,
    /// The mount understands [`BlockLocations::packs`] and [`BlockLocations::ranges`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ranges: bool,
}

/// Answer to `POST /locate` (the block tier, ours): where the Executor may fetch each asked
/// block without the Delegator's process serving its bytes — a short-lived presigned `GET`
/// URL of an object store. `urls[i]` answers `hashes[i]`; `null` means "ask `/blocks`" —
/// unless `ranges[i]` places the block in a pack. Whatever the store returns is verified
/// against the block's hash by the mount, which falls back to `/blocks` on a mismatch or a
/// failed fetch. An export without a block tier answers `blockStore: false` and no URLs,
/// and the mount stops asking. (`/upload-urls` answers the same shape, without packs.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BlockLocations {
    /// Whether this export has a block tier at all.
    pub block_store: bool,
    /// When the URLs stop working (ISO 8601); absent without URLs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// One entry per asked hash, in order: a URL of the block's own object, or `null`.
    #[serde(default)]
    pub urls: Vec<Option<String>>,
    /// Presigned `GET` URLs of the pack objects `ranges` point into (only when the request
    /// asked for `ranges`; absent when no asked block is packed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packs: Vec<String>,
    /// Empty, or one entry per asked hash: `[pack, offset, length]` — the block's object
    /// is bytes `offset..offset+length` of `packs[pack]` — or `null` (see `urls[i]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<Option<[u64; 3]>>,
}

/// Answer to `POST /missing`: the subset of the asked hashes the export does not have.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MissingBlocks {
    /// blake3 hashes (hex) to upload before committing.
    pub missing: Vec<String>,
}

/// Body of `POST /commits/applied`: ids of commits an Executor sent and never saw
/// answered, or whose answer it could not record (crash recovery asks, so as not to take
/// its own applied commits for the Delegator's changes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AppliedQuery {
    /// Commit ids, at most [`MAX_APPLIED_QUERY`], each 1 to 256 bytes.
    pub ids: Vec<String>,
}

/// Body and answer of `POST /mounts/ended` (a mount ended with every change it made
/// applied as sent: the export records it) and `POST /mounts/ended/query` (did that mount
/// end so here?). git's fsmonitor tokens name their mount instance: a later mount of the
/// same export answers such a token from the export's changes since registration only
/// when its instance ended cleanly, else "everything".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MountEnded {
    /// The mount instance: 1 to [`MAX_MOUNT_INSTANCE`] lowercase hex digits.
    pub instance: String,
    /// In an answer: whether the export holds that instance's clean end (a request's value
    /// is ignored).
    #[serde(default)]
    pub ended: bool,
}

/// Longest [`MountEnded::instance`].
pub const MAX_MOUNT_INSTANCE: usize = 64;

/// Whether `instance` is a well-formed [`MountEnded::instance`].
pub fn valid_mount_instance(instance: &str) -> bool {
    !instance.is_empty()
        && instance.len() <= MAX_MOUNT_INSTANCE
        && instance
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Most ids in one [`AppliedQuery`] (an export remembers this many outcomes).
pub const MAX_APPLIED_QUERY: usize = 4096;

/// Answer to `POST /commits/applied`: the first outcome of each asked commit the export
/// applied and still remembers; an id it does not know was never applied there (or so
/// long ago that it has forgotten it: it remembers the last 4,096).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AppliedCommits {
    /// The outcomes, in the order asked.
    pub applied: Vec<CommitResult>,
}

/// Answer to `POST /upload`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UploadResult {
    /// How many blocks were stored.
    pub stored: u64,
}

/// One change to the exported tree. File changes carry the content hash they were based
/// on, so the export detects a conflicting change on its side instead of overwriting it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Change {
    /// Create a directory (no-op if it exists as a directory).
    #[serde(rename_all = "camelCase")]
    Mkdir {
        /// Where.
        #[serde(with = "crate::rawname::wire")]
        path: String,
        /// Permission bits.
        mode: u32,
    },
    /// Remove an empty directory (no-op if absent).
    #[serde(rename_all = "camelCase")]
    Rmdir {
        /// Which.
        #[serde(with = "crate::rawname::wire")]
        path: String,
    },
    /// Create or replace a file with the content made of `blocks`.
    #[serde(rename_all = "camelCase")]
    Write {
        /// Which file.
        #[serde(with = "crate::rawname::wire")]
        path: String,
        /// Permission bits of the result.
        mode: u32,
        /// Content hash the change was based on; `None` when the file is new.
        base: Option<String>,
        /// blake3 hash (hex) of the new content.
        hash: String,
        /// Size of the new content.
        size: u64,
        /// Block hashes of the new content, in order.
        blocks: Vec<String>,
        /// Modification time to set, nanoseconds since the Unix epoch.
        mtime_ns: i64,
        /// On the Executor this file is a hard link of the file at `linkTo` (a path written
        /// earlier in the same change set, or already at the export with this content). If
        /// that file has `hash` when this change is applied, the export makes `path` a hard
        /// link to it; otherwise it writes the content as for any write. Absent for files
        /// with one name.
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            with = "crate::rawname::wire_opt"
        )]
        link_to: Option<String>,
        /// The file's `user.*` extended attributes on the Executor, name → value in hex; the
        /// export gives them to the new file. Absent: the new file has none.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        xattrs: Option<BTreeMap<String, String>>,
    },
    /// Remove a file or symlink.
    #[serde(rename_all = "camelCase")]
    Unlink {
        /// Which.
        #[serde(with = "crate::rawname::wire")]
        path: String,
        /// Content hash (files) or target (symlinks) the removal was based on.
        #[serde(default, with = "crate::rawname::wire_opt")]
        base: Option<String>,
    },
    /// Create or replace a symlink.
    #[serde(rename_all = "camelCase")]
    Symlink {
        /// Where.
        #[serde(with = "crate::rawname::wire")]
        path: String,
        /// Its target.
        #[serde(with = "crate::rawname::wire")]
        target: String,
    },
    /// Change permission bits.
    #[serde(rename_all = "camelCase")]
    Chmod {
        /// Which.
        #[serde(with = "crate::rawname::wire")]
        path: String,
        /// New permission bits.
        mode: u32,
        /// Also set a file's modification time (nanoseconds since the epoch): the content is
        /// unchanged but its time is not (`touch`, `utimensat`). Ignored for directories.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mtime_ns: Option<i64>,
        /// With `mtime_ns`: the content hash the time belongs to. The export sets the time
        /// only if the file still has this content, so an older time never lands on content
        /// the Delegator changed meanwhile.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        base: Option<String>,
        /// `user.*` extended attributes of the file or directory that changed on the
        /// Executor: name → new value in hex, or `null` for one removed. Attributes not
        /// listed are left as they are.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        xattrs: Option<BTreeMap<String, Option<String>>>,
    },
}

impl Change {
    /// The path the change applies to.
    pub fn path(&self) -> &str {
        match self {
            Change::Mkdir { path, .. }
            | Change::Rmdir { path }
            | Change::Write { path, .. }
            | Change::Unlink { path, .. }
            | Change::Symlink { path, .. }
            | Change::Chmod { path, .. } => path,
        }
    }
}

/// An ordered set of changes applied by the export as one commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChangeSet {
    /// Client-chosen id; a retried commit with the same id is answered from the first result.
    pub commit_id: String,
    /// The changes, applied in order after every written file's content has been staged.
    pub changes: Vec<Change>,
    /// How long before it was sent the oldest write it carries was closed on the mount,
    /// in milliseconds (ours, optional): the export's write-back lag starts from it. An
    /// export that predates it ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_ms: Option<u64>,
}

/// A change the export did not apply because its side changed since the base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Conflict {
    /// The path in question.
    #[serde(with = "crate::rawname::wire")]
    pub path: String,
    /// What was found instead of the base.
    pub reason: String,
    /// Where the Executor's version was kept, if it was a write.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::rawname::wire_opt"
    )]
    pub kept_as: Option<String>,
}

/// A write the export did not apply because the Delegator's commit screen held it (an AECP
/// contract the new content provably breaks, or a consumer that has not acknowledged a
/// revised module it imports). Nothing is written at the path or beside it: the Executor
/// keeps its version and sends it again once the file changes (or the export releases it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Held {
    /// The path in question.
    #[serde(with = "crate::rawname::wire")]
    pub path: String,
    /// Why, in a sentence.
    pub reason: String,
    /// The screen's structured report (for AECP: the verifier's verdict and violations),
    /// if it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<serde_json::Value>,
}

/// Answer to `POST /commit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CommitResult {
    /// The commit's id, echoed.
    pub commit_id: String,
    /// Changes applied.
    pub applied: u64,
    /// Changes not applied because of a conflict (the Executor's data is kept beside).
    pub conflicts: Vec<Conflict>,
    /// The export's change sequence (the `seq` of `changed` events) at which this commit's
    /// changes were recorded: a `changed` event with a `seq` not above it was described
    /// before the commit, so it is older than what the commit left at those paths. A retry
    /// of a known `commitId` gets the original value. Absent from exports that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// Writes the export's commit screen held: not applied, not kept beside, left to the
    /// Executor. Absent (empty) from exports without a screen and from those that predate
    /// it; an older client ignores it (and sees those writes as neither applied nor
    /// conflicting — it sends them again with its next change there).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<Held>,
    /// What the export has now at the paths of the conflicts where the Delegator's state won
    /// and nothing of the Executor's change was kept (a removal, `mkdir`, `rmdir`, `chmod` or
    /// symlink that met a Delegator-side change), described as a `changed` event at `seq`
    /// would describe them, so the Executor can show the Delegator's version instead of
    /// keeping its own discarded one. Absent when there are none, from exports that predate
    /// it, and for a path the export could not describe (the Executor then waits for the
    /// path's next `changed` event); an older client ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<CurrentState>,
}

/// The Delegator's state of some paths, as a `changed` event carries it: see
/// [`CommitResult::current`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CurrentState {
    /// Entries present, as the manifest would list them (a directory with its subtree),
    /// parents before children.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entries: Vec<ManifestEntry>,
    /// Paths that do not exist on the export.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<String>,
}

impl CurrentState {
    /// Whether it describes nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.removed.is_empty()
    }
}

/// State of the lease as the export sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    /// Access allowed until `expiresAt`.
    Active,
    /// Revoked by the Delegator.
    Revoked,
    /// Expired without renewal.
    Expired,
}

/// Events on `GET /events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum ExportEvent {
    /// The lease changed (granted, renewed, revoked, expired). Sent once on connect too.
    #[serde(rename_all = "camelCase")]
    Lease {
        /// New state.
        state: LeaseState,
        /// Wall-clock expiry, ISO 8601.
        expires_at: String,
        /// Remaining milliseconds when the event was sent (clock-skew-free).
        remaining_ms: u64,
        /// How long the export still accepts a final flush commit after the lease ended.
        #[serde(default)]
        flush_grace_ms: u64,
    },
    /// The Delegator changed the tree: what these paths are now. Sent when the export sees a
    /// change (after a short debounce), and on connect for every path changed since the
    /// export was registered (or, with `GET /events?since=<seq>`, since that sequence), so a
    /// mount that reconnects catches up. Changes the export
    /// made itself (commits) are reported too: a mount recognises its own write-back by its
    /// hash. A path is listed at most once per event; parents come before children.
    #[serde(rename_all = "camelCase")]
    Changed {
        /// The export's change sequence when the event was described: every path in it is
        /// in the state it had at that sequence. It never decreases, across reconnects and
        /// export restarts; a path's latest change wins.
        seq: u64,
        /// Entries now present (new or changed), as the manifest would list them.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        entries: Vec<ManifestEntry>,
        /// Paths that no longer exist (a directory's removal implies its whole subtree).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        removed: Vec<String>,
    },
    /// AECP: one change to the mount's replica of its workspace's artifact index (an
    /// `aecp_hooks::index::IndexEvent`, kept opaque here). All of them are sent on connect
    /// (catch-up), then each as it happens.
    Aecp {
        /// The index event.
        event: serde_json::Value,
    },
    /// AECP: every `aecp` event of the connection's catch-up has been sent (once per
    /// connection, right after them). A mount reads its catch-up up to here before it
    /// answers its first lookup, so its first accesses see every finding already stored.
    /// Mounts that do not know it ignore it.
    AecpReady,
}

/// Error body of every refused data-plane request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DataPlaneError {
    /// Machine-readable code, e.g. `AUTH_FAILED`, `EXPIRED`, `INVALID_PATH`, `READ_ONLY`.
    pub code: String,
    /// What went wrong, for people.
    pub message: String,
}

/// Why a relative path is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// Empty path.
    #[error("path is empty")]
    Empty,
    /// Starts with `/`.
    #[error("path {path:?} is absolute")]
    Absolute {
        /// The path.
        path: String,
    },
    /// Contains `.`, `..` or an empty component.
    #[error("path {path:?} has a `.`, `..` or empty component")]
    BadComponent {
        /// The path.
        path: String,
    },
    /// Contains a NUL byte, or a malformed escape of a name that is not UTF-8.
    #[error("path {path:?} contains NUL (or a malformed escape of a non-UTF-8 name)")]
    Nul {
        /// The path.
        path: String,
    },
    /// Component over 255 bytes.
    #[error("path {path:?} has a component longer than 255 bytes")]
    TooLong {
        /// The path.
        path: String,
    },
}

/// Check that `path` is a relative, normalised path inside an export. A path holding a
/// name that is not UTF-8 must be in the canonical escaped form of [`crate::rawname`]; its
/// components are checked on the raw bytes.
pub fn validate_rel_path(path: &str) -> Result<(), PathError> {
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute { path: path.into() });
    }
    let raw = crate::rawname::decode(path).map_err(|_| PathError::Nul { path: path.into() })?;
    if raw.contains(&0) {
        return Err(PathError::Nul { path: path.into() });
    }
    for comp in raw.split(|&b| b == b'/') {
        if comp.is_empty() || comp == b"." || comp == b".." {
            return Err(PathError::BadComponent { path: path.into() });
        }
        if comp.len() > 255 {
            return Err(PathError::TooLong { path: path.into() });
        }
    }
    Ok(())
}

/// Append one block frame (hash, length, bytes) to `out`.
pub fn encode_block_frame(out: &mut Vec<u8>, hash: &[u8; 32], data: Option<&[u8]>) {
    out.extend_from_slice(&block_frame_head(hash, data.map(<[u8]>::len)));
    if let Some(d) = data {
        out.extend_from_slice(d);
    }
}

/// A block frame's first 36 bytes: the hash, then the block's length (`None`: the
/// [`MISSING_BLOCK`] marker). The block's bytes follow it on the wire.
pub fn block_frame_head(hash: &[u8; 32], len: Option<usize>) -> [u8; 36] {
    let len = match len {
        Some(n) => u32::try_from(n).expect("blocks are at most 4 GiB"),
        None => MISSING_BLOCK,
    };
    let mut head = [0u8; 36];
    head[..32].copy_from_slice(hash);
    head[32..].copy_from_slice(&len.to_le_bytes());
    head
}

/// Error decoding block frames.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("truncated block frame at byte {offset}")]
pub struct FrameError {
    /// Where the input ended early.
    pub offset: usize,
}

/// One decoded block frame.
pub type BlockFrame<'a> = ([u8; 32], Option<&'a [u8]>);

/// Decode a buffer of block frames; never panics on malformed input.
pub fn decode_block_frames(mut buf: &[u8]) -> Result<Vec<BlockFrame<'_>>, FrameError> {
    let total = buf.len();
    let mut out = Vec::new();
    while !buf.is_empty() {
        let offset = total - buf.len();
        if buf.len() < 36 {
            return Err(FrameError { offset });
        }
        let mut hash = [0u8; 32];
        hash.copy_from_slice(&buf[..32]);
        let len = u32::from_le_bytes([buf[32], buf[33], buf[34], buf[35]]);
        buf = &buf[36..];
        if len == MISSING_BLOCK {
            out.push((hash, None));
            continue;
        }
        let len = len as usize;
        if buf.len() < len {
            return Err(FrameError { offset });
        }
        out.push((hash, Some(&buf[..len])));
        buf = &buf[len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_paths() {
        assert!(validate_rel_path("a/b.txt").is_ok());
        assert!(validate_rel_path(".git/HEAD").is_ok());
        for bad in [
            "",
            "/etc/passwd",
            "a/../b",
            "..",
            "./a",
            "a//b",
            "a/",
            "a\0b",
        ] {
            assert!(validate_rel_path(bad).is_err(), "{bad:?} accepted");
        }
        assert!(validate_rel_path(&"x".repeat(256)).is_err());
    }

    #[test]
    fn frames_round_trip_and_truncation() {
        let mut buf = Vec::new();
        encode_block_frame(&mut buf, &[1; 32], Some(b"hello"));
        encode_block_frame(&mut buf, &[2; 32], None);
        encode_block_frame(&mut buf, &[3; 32], Some(b""));
        let frames = decode_block_frames(&buf).unwrap();
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0], ([1; 32], Some(&b"hello"[..])));
        assert_eq!(frames[1], ([2; 32], None));
        assert_eq!(frames[2], ([3; 32], Some(&b""[..])));
        for cut in 1..buf.len() {
            if cut == 41 || cut == 77 {
                continue; // frame boundaries
            }
            assert!(
                decode_block_frames(&buf[..cut]).is_err(),
                "cut at {cut} accepted"
            );
        }
    }

    #[test]
    fn change_wire_shape() {
        let c = Change::Unlink {
            path: "a".into(),
            base: None,
        };
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(json, r#"{"op":"unlink","path":"a","base":null}"#);
    }
}

/// First bytes of a recovery bundle.
pub const BUNDLE_MAGIC: &[u8; 10] = b"AWCPBNDL1\n";

/// A recovery bundle: the change set an Executor could not commit in time, with the
/// blocks it needs. Encoded as [`BUNDLE_MAGIC`], a little-endian `u32` length, the change
/// set as JSON, then block frames (see [`encode_block_frame`]).
pub fn encode_bundle(changes: &ChangeSet, blocks: &[([u8; 32], Vec<u8>)]) -> Vec<u8> {
    let json = serde_json::to_vec(changes).unwrap_or_default();
    let mut out =
        Vec::with_capacity(16 + json.len() + blocks.iter().map(|b| 36 + b.1.len()).sum::<usize>());
    out.extend_from_slice(BUNDLE_MAGIC);
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    for (hash, data) in blocks {
        encode_block_frame(&mut out, hash, Some(data));
    }
    out
}

/// Why a recovery bundle does not decode.
#[derive(Debug, thiserror::Error)]
pub enum BundleDecodeError {
    /// Not a bundle, or truncated before its change set.
    #[error("not a recovery bundle (bad magic or truncated header)")]
    Header,
    /// The change set is not valid JSON.
    #[error("the bundle's change set is malformed")]
    ChangeSet {
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The block frames are truncated.
    #[error("the bundle's blocks are malformed")]
    Frames {
        /// Why.
        #[source]
        source: FrameError,
    },
}

/// Blocks carried by a recovery bundle: (hash, content).
pub type BundleBlocks = Vec<([u8; 32], Vec<u8>)>;

/// Decode a recovery bundle; never panics on malformed input.
pub fn decode_bundle(buf: &[u8]) -> Result<(ChangeSet, BundleBlocks), BundleDecodeError> {
    let rest = buf
        .strip_prefix(&BUNDLE_MAGIC[..])
        .ok_or(BundleDecodeError::Header)?;
    if rest.len() < 4 {
        return Err(BundleDecodeError::Header);
    }
    let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
    let rest = &rest[4..];
    if rest.len() < len {
        return Err(BundleDecodeError::Header);
    }
    let changes = serde_json::from_slice(&rest[..len])
        .map_err(|source| BundleDecodeError::ChangeSet { source })?;
    let frames =
        decode_block_frames(&rest[len..]).map_err(|source| BundleDecodeError::Frames { source })?;
    let mut blocks = Vec::with_capacity(frames.len());
    for (hash, data) in frames {
        if let Some(d) = data {
            blocks.push((hash, d.to_vec()));
        }
    }
    Ok((changes, blocks))
}

#[cfg(test)]
mod commit_result_tests {
    use super::*;

    // `current` is additive: an answer without it (an older export) parses, one with it
    // round-trips, and an empty one is not sent.
    #[test]
    fn current_is_optional_and_round_trips() {
        let old = r#"{"commitId":"c","applied":1,"conflicts":[],"seq":5}"#;
        let r: CommitResult = serde_json::from_str(old).unwrap();
        assert_eq!(r.current, None);
        assert!(!serde_json::to_string(&r).unwrap().contains("current"));
        let with = r#"{"commitId":"c","applied":0,"conflicts":[{"path":"f","reason":"x"}],"seq":5,
            "current":{"entries":[{"path":"f","kind":"file","mode":420,"size":1,"mtimeNs":7,"hash":"aa","blocks":["aa"]}],"removed":["g"]}}"#;
        let r: CommitResult = serde_json::from_str(with).unwrap();
        let current = r.current.clone().unwrap();
        assert_eq!(current.entries[0].path, "f");
        assert_eq!(current.removed, vec!["g".to_string()]);
        let again: CommitResult =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(again, r);
    }
}

#[cfg(test)]
mod bundle_tests {
    use super::*;

    #[test]
    fn bundles_round_trip_and_reject_garbage() {
        let cs = ChangeSet {
            commit_id: "c1".into(),
            changes: vec![Change::Mkdir {
                path: "d".into(),
                mode: 0o755,
            }],
            age_ms: Some(1500),
        };
        let blocks = vec![([7u8; 32], b"data".to_vec())];
        let enc = encode_bundle(&cs, &blocks);
        let (cs2, blocks2) = decode_bundle(&enc).unwrap();
        assert_eq!(cs2, cs);
        assert_eq!(blocks2, blocks);
        assert!(decode_bundle(b"nope").is_err());
        for cut in 0..enc.len() {
            // Truncation anywhere but at a frame boundary fails; it never panics.
            let _ = decode_bundle(&enc[..cut]);
        }
        assert!(decode_bundle(&enc[..enc.len() - 1]).is_err());
    }
}
