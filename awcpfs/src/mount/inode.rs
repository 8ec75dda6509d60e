//! The inode table: the whole namespace of a mount, in memory.
//!
//! Built from the export's manifest when the mount starts, then changed by the filesystem
//! operations. Inode numbers are the Delegator's own where the manifest carries usable ones
//! (so git's index, which records them, still matches), else assigned in manifest order
//! after the root; either way the same manifest always yields the same numbers. New entries
//! take numbers above all of them.
//!
//! Invariants:
//! * every node reachable from the root has `parent`/`name` naming its first dentry; a
//!   file or symlink with hard links lists its other dentries in `links`, and each of them
//!   names it in its parent's `children` (directories never have more than one dentry);
//! * a node that was unlinked while open stays in the table with `unlinked = true` and no
//!   dentry until its last handle is released;
//! * a file's content is either remote (hash and block list from the manifest) or local (an
//!   upper file in the state directory, named after the inode number).
//!
//! Change tracking, for the syncer and for directory listings, is kept here because every
//! change to the namespace goes through the table's lock:
//! * [`Dirty`]: the paths whose dentries changed (each with everything below it) and the
//!   nodes whose content or attributes changed since the syncer last took the set, so a
//!   write-back round compares only those with what the export has, not the whole tree;
//! * a per-directory generation, bumped whenever the directory's entries (or its own `..`)
//!   change, so a listing kept from an earlier `readdir` is reused after comparing two
//!   numbers.

use compact_str::CompactString;
use std::collections::{BTreeMap, HashMap, HashSet};

/// The table's maps: keyed by inode numbers and paths the Delegator's manifest chose, so
/// seeded per process (foldhash's `RandomState`), not a fixed function.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use awcp_protocol::dataplane::{EntryKind, MAX_MANIFEST_XATTR_VALUE, Manifest};

/// Inode number.
pub type Ino = u64;
/// The root directory's inode number (FUSE fixes it at 1).
pub const ROOT_INO: Ino = 1;

/// What a node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// A FIFO (named pipe): the kernel runs the pipe itself, the node only names it.
    Fifo,
    /// A Unix domain socket's name (`bind`): the socket itself is process state.
    Socket,
    /// A character device node, with its device number (`st_rdev`).
    CharDev(u32),
    /// A block device node, with its device number.
    BlockDev(u32),
}

impl Kind {
    /// A FIFO, socket or device node: lives only on the mount, never written back (see
    /// `special.rs`).
    pub fn is_special(self) -> bool {
        matches!(
            self,
            Kind::Fifo | Kind::Socket | Kind::CharDev(_) | Kind::BlockDev(_)
        )
    }
}

impl From<EntryKind> for Kind {
    fn from(k: EntryKind) -> Self {
        match k {
            EntryKind::File => Kind::File,
            EntryKind::Dir => Kind::Dir,
            EntryKind::Symlink => Kind::Symlink,
        }
    }
}

/// A blake3 hash, kept as its 32 bytes (the table holds one or more per file: as hex
/// strings they were a third of a large mount's memory).
pub type Hash = [u8; 32];

/// A hash from the manifest's hex; a malformed one becomes all zeros, which no content
/// has, so fetching it fails and writing over it conflicts, as with any wrong hash.
pub fn hash_from_hex(hex: &str) -> Hash {
    super::remote::parse_hash(hex).unwrap_or([0; 32])
}

/// Where a file's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Data {
    /// The export's content under these hashes, not in an upper file.
    Remote {
        /// blake3 of the whole content.
        hash: Hash,
        /// blake3 of each block; `None` when the content is one block, whose hash is then
        /// the content's (no second copy, no allocation, for the typical small file).
        blocks: Option<Box<[Hash]>>,
        /// Where a copy of the content (`size` bytes) starts in the mount's pack file, once
        /// fetched for reading (background hydration, a read without a handle): one file
        /// holds every such copy, so hydrating 20,000 small files writes one file, not
        /// 20,000. Reads are served from it; anything that needs an upper file (a write, a
        /// truncation, an open with a handle, passthrough) copies it out first. The node is
        /// still remote in every other respect (write-back, journal, Delegator-side
        /// changes), and a restarted mount, whose pack starts empty, fetches it again.
        packed: Option<u64>,
    },
    /// In the upper file `upper/<ino>` of the state directory.
    Local {
        /// Changed since it was last known to match `hash`.
        dirty: bool,
        /// Content hash when clean (what the export has, as far as we know).
        hash: Option<Hash>,
        /// Bumped on every change; lets the syncer tell whether a file changed under it.
        generation: u64,
    },
    /// Not a regular file.
    None,
}

impl Data {
    /// Remote content from the manifest's hex hashes.
    pub fn remote(hash: Option<&str>, blocks: &[String]) -> Data {
        let hash = hash.map_or([0; 32], hash_from_hex);
        let blocks = match blocks {
            [one] if hash_from_hex(one) == hash => None,
            _ => Some(blocks.iter().map(|b| hash_from_hex(b)).collect()),
        };
        Data::Remote {
            hash,
            blocks,
            packed: None,
        }
    }

    /// The block hashes of remote content, in hex as the data plane names them (empty for
    /// anything else).
    pub fn remote_blocks(&self) -> Vec<String> {
        self.remote_block_hashes().iter().map(hex::encode).collect()
    }

    /// The block hashes of remote content (empty for anything else).
    pub fn remote_block_hashes(&self) -> &[[u8; 32]] {
        match self {
            Data::Remote {
                hash, blocks: None, ..
            } => std::slice::from_ref(hash),
            Data::Remote {
                blocks: Some(b), ..
            } => b,
            _ => &[],
        }
    }

    /// Where remote content's copy sits in the pack file, if it has one.
    pub fn packed(&self) -> Option<u64> {
        match self {
            Data::Remote { packed, .. } => *packed,
            _ => None,
        }
    }
}

/// One inode.
#[derive(Debug, Clone)]
pub struct Node {
    /// Its number.
    pub ino: Ino,
    /// Parent directory (the root is its own parent).
    pub parent: Ino,
    /// Name in the parent.
    pub name: String,
    /// File, directory or symlink.
    pub kind: Kind,
    /// Permission bits.
    pub perm: u16,
    /// Owner (local to the Executor; not synced).
    pub uid: u32,
    /// Group (local to the Executor; not synced).
    pub gid: u32,
    /// Size in bytes.
    pub size: u64,
    /// Last access.
    pub atime: SystemTime,
    /// Last modification.
    pub mtime: SystemTime,
    /// Last status change.
    pub ctime: SystemTime,
    /// Children by name (directories). Names of up to 24 bytes are held in the map's own
    /// nodes: a lookup compares them without a pointer to follow each (and a cache miss).
    pub children: BTreeMap<CompactString, Ino>,
    /// How many of the children are directories (kept by [`InodeTable`]).
    pub subdirs: u32,
    /// Target (symlinks).
    pub target: Option<String>,
    /// Content (files).
    pub data: Data,
    /// Open file handles on this node.
    pub open_handles: u32,
    /// Open handles that may write.
    pub open_writers: u32,
    /// Removed from the namespace, kept while open.
    pub unlinked: bool,
    /// Created with FUSE passthrough and not forgotten by the kernel yet: it may write the
    /// upper file directly, so the size and times `stat` shows are the upper file's (the
    /// table takes them when the writes go quiet; see `mount/bypass.rs`).
    pub bypassed: bool,
    /// Dentries beyond `parent`/`name` (hard links), as (directory, name).
    pub links: Vec<(Ino, String)>,
    /// Extended attributes (`user.*` only), name → value.
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

impl Node {
    /// Link count as `stat` reports it: 2 plus one per subdirectory for a directory (tools
    /// like `find` rely on it to skip leaf directories), the number of names for a file or
    /// symlink, 0 once unlinked.
    pub fn nlink(&self) -> u32 {
        match self.kind {
            Kind::Dir => 2u32.saturating_add(self.subdirs),
            _ if self.unlinked => 0,
            _ => 1u32.saturating_add(u32::try_from(self.links.len()).unwrap_or(u32::MAX)),
        }
    }
}

/// Convert nanoseconds since the epoch to a `SystemTime` (negative values clamp to the epoch).
pub fn time_from_ns(ns: i64) -> SystemTime {
    u64::try_from(ns)
        .map(|ns| UNIX_EPOCH + Duration::from_nanos(ns))
        .unwrap_or(UNIX_EPOCH)
}

/// Convert a `SystemTime` to nanoseconds since the epoch.
pub fn time_to_ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        Err(_) => 0,
    }
}

/// Whether two manifest entries with one inode number are names of one file (hard links):
/// both files, same content and mode.
fn is_hard_link(
    a: &awcp_protocol::dataplane::ManifestEntry,
    b: &awcp_protocol::dataplane::ManifestEntry,
) -> bool {
    a.kind == EntryKind::File
        && b.kind == EntryKind::File
        && a.hash == b.hash
        && a.size == b.size
        && a.mode == b.mode
}

/// A manifest entry's attributes as a node keeps them: the Delegator's `user.*` attributes
/// (hex on the wire), nothing else.
pub fn manifest_xattrs(e: &awcp_protocol::dataplane::ManifestEntry) -> BTreeMap<String, Vec<u8>> {
    e.xattrs
        .iter()
        .filter(|(k, v)| k.starts_with("user.") && v.len() <= 2 * MAX_MANIFEST_XATTR_VALUE)
        .filter_map(|(k, v)| Some((k.clone(), hex::decode(v).ok()?)))
        .collect()
}

/// Error building the table from a manifest.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// An entry's parent directory is not listed before it.
    #[error("manifest entry {path:?} comes before its parent directory")]
    Orphan {
        /// The entry.
        path: String,
    },
    /// An entry's path is not a valid relative path.
    #[error("manifest entry has an invalid path")]
    BadPath {
        /// Why.
        #[source]
        source: awcp_protocol::dataplane::PathError,
    },
    /// A path is listed twice.
    #[error("manifest lists {path:?} twice")]
    Duplicate {
        /// The entry.
        path: String,
    },
}

/// What changed since the syncer last took the set (see [`InodeTable::take_dirty`]).
///
/// Invariant: a path not covered by it (not one of `subtrees` or below one, not a name of
/// one of `inos`) has the same entry in the tree as at the end of the last round that took
/// the set, so a round that compares only what the set covers finds every change.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Dirty {
    /// Paths whose dentry changed (created, removed, renamed from or to, linked): the entry
    /// and everything below it must be compared.
    pub subtrees: HashSet<String>,
    /// Nodes whose content or attributes changed: compared at each of their names.
    pub inos: HashSet<Ino>,
    /// Compare the whole tree (after a journal replay, or when a change could not be tied
    /// to a path).
    pub all: bool,
}

impl Dirty {
    /// Nothing changed.
    pub fn is_empty(&self) -> bool {
        !self.all && self.subtrees.is_empty() && self.inos.is_empty()
    }

    /// Add everything `other` covers.
    pub fn merge(&mut self, other: Dirty) {
        self.all |= other.all;
        if !self.all {
            self.subtrees.extend(other.subtrees);
            self.inos.extend(other.inos);
        }
    }
}

/// The inode table behind its lock. Every FUSE request that names a path probes the
/// table, so it lives in huge pages: whatever is allocated while the lock is held — new
/// nodes, a directory's children, the maps' growth, and values made in passing — comes from
/// the hot arena ([`crate::alloc`]), as does the table's first build.
pub struct TableLock(parking_lot::Mutex<InodeTable>);

/// The table, locked; allocations on this thread go to the hot arena until it drops.
pub struct TableGuard<'a> {
    table: parking_lot::MutexGuard<'a, InodeTable>,
    _hot: crate::alloc::Scope,
}

impl TableLock {
    pub fn new(table: InodeTable) -> TableLock {
        TableLock(parking_lot::Mutex::new(table))
    }

    /// Lock the table.
    pub fn lock(&self) -> TableGuard<'_> {
        let hot = crate::alloc::scope();
        TableGuard {
            table: self.0.lock(),
            _hot: hot,
        }
    }
}

impl std::ops::Deref for TableGuard<'_> {
    type Target = InodeTable;
    fn deref(&self) -> &InodeTable {
        &self.table
    }
}

impl std::ops::DerefMut for TableGuard<'_> {
    fn deref_mut(&mut self) -> &mut InodeTable {
        &mut self.table
    }
}

/// The namespace.
#[derive(Debug, Default)]
pub struct InodeTable {
    /// Boxed: the map stays small enough for the CPU's caches, and nodes allocated one
    /// after another (a manifest's entries, a directory's files) lie together in memory.
    nodes: FastMap<Ino, Box<Node>>,
    next_ino: Ino,
    /// Changes since the syncer last looked; recorded once the table is built.
    dirty: Dirty,
    track: bool,
    /// Generation of each directory whose entries changed since the table was built
    /// (absent: 0).
    dir_gens: HashMap<Ino, u64>,
    /// Files whose content the export withholds (a manifest file entry without a hash: an
    /// excluded or sensitive file on the Delegator): shown with the Delegator's metadata,
    /// never read, written, renamed or removed here.
    withheld: HashSet<Ino>,
}

impl InodeTable {
    /// Build the table from a manifest; every node is owned by `uid`/`gid`.
    pub fn from_manifest(m: &Manifest, uid: u32, gid: u32) -> Result<Self, ManifestError> {
        // The table's nodes and maps in the hot arena (see `TableLock`).
        let _hot = crate::alloc::scope();
        let root_time = time_from_ns(m.root_mtime_ns);
        let mut table = InodeTable {
            nodes: FastMap::with_capacity_and_hasher(m.entries.len() + 1, Default::default()),
            next_ino: ROOT_INO + 1,
            ..Default::default()
        };
        table.nodes.insert(
            ROOT_INO,
            Box::new(Node {
                ino: ROOT_INO,
                parent: ROOT_INO,
                name: String::new(),
                kind: Kind::Dir,
                perm: (m.root_mode & 0o7777) as u16,
                uid,
                gid,
                size: 0,
                atime: root_time,
                mtime: root_time,
                ctime: root_time,
                children: BTreeMap::new(),
                subdirs: 0,
                target: None,
                data: Data::None,
                open_handles: 0,
                open_writers: 0,
                bypassed: false,
                unlinked: false,
                links: Vec::new(),
                xattrs: BTreeMap::new(),
            }),
        );
        // Inode numbers: the Delegator's own where they are usable (unique, not the root's
        // 1), so git's index, which records st_ino, still matches on the mount; otherwise,
        // and for new files, numbers above every one of them.
        // Entries sharing an inode number are hard links on the Delegator when both are
        // files with the same content: they become one node with several names here.
        let mut seen_ino: FastMap<Ino, &awcp_protocol::dataplane::ManifestEntry> =
            FastMap::with_capacity_and_hasher(m.entries.len(), Default::default());
        let use_source = m.entries.iter().all(|e| {
            e.ino.is_some_and(|i| {
                i > ROOT_INO
                    && match seen_ino.get(&i) {
                        None => {
                            seen_ino.insert(i, e);
                            true
                        }
                        Some(first) => is_hard_link(first, e),
                    }
            })
        });
        if use_source {
            let max = m
                .entries
                .iter()
                .filter_map(|e| e.ino)
                .max()
                .unwrap_or(ROOT_INO);
            table.next_ino = max.saturating_add(1);
        }
        // Parents by path: directories only (a file's path is never a parent). Entries come
        // parents first, mostly in runs under one directory: the last parent looked up is
        // tried first. A repeated path is found in its parent's children.
        let mut dirs: FastMap<&str, Ino> = FastMap::default();
        dirs.insert("", ROOT_INO);
        let mut last_parent: (&str, Ino) = ("", ROOT_INO);
        for e in &m.entries {
            awcp_protocol::dataplane::validate_rel_path(&e.path)
                .map_err(|source| ManifestError::BadPath { source })?;
            let (parent_path, name) = e.path.rsplit_once('/').unwrap_or(("", e.path.as_str()));
            let parent = if parent_path == last_parent.0 {
                last_parent.1
            } else {
                let p = *dirs.get(parent_path).ok_or_else(|| ManifestError::Orphan {
                    path: e.path.clone(),
                })?;
                last_parent = (parent_path, p);
                p
            };
            if table
                .nodes
                .get(&parent)
                .is_some_and(|p| p.children.contains_key(name))
            {
                return Err(ManifestError::Duplicate {
                    path: e.path.clone(),
                });
            }
            let kind = Kind::from(e.kind);
            let t = time_from_ns(e.mtime_ns);
            if use_source
                && let Some(ino) = e.ino
                && let Some(first) = table.nodes.get_mut(&ino)
            {
                // Another name of a file already listed (checked by `is_hard_link`).
                first.links.push((parent, name.to_string()));
                table.attach(parent, name, ino, false);
                continue;
            }
            let ino = match e.ino {
                Some(ino) if use_source => ino,
                _ => table.alloc_ino(),
            };
            let data = match kind {
                Kind::File => Data::remote(e.hash.as_deref(), &e.blocks),
                _ => Data::None,
            };
            if kind == Kind::File && e.hash.is_none() {
                table.withheld.insert(ino);
            }
            let node = Node {
                ino,
                parent,
                name: name.to_string(),
                kind,
                perm: (e.mode & 0o7777) as u16,
                uid,
                gid,
                size: e.size,
                atime: t,
                mtime: t,
                // The Delegator's ctime when known (git compares it), else mtime: stable
                // across remounts of the same tree either way.
                ctime: e.ctime_ns.map(time_from_ns).unwrap_or(t),
                children: BTreeMap::new(),
                subdirs: 0,
                target: e.target.clone(),
                data,
                open_handles: 0,
                open_writers: 0,
                bypassed: false,
                unlinked: false,
                links: Vec::new(),
                xattrs: manifest_xattrs(e),
            };
            if kind == Kind::Dir {
                dirs.insert(&e.path, ino);
            }
            table.nodes.insert(ino, Box::new(node));
            table.attach(parent, name, ino, kind == Kind::Dir);
        }
        // The tree is what the manifest says: nothing to write back. Changes count from here.
        table.track = true;
        Ok(table)
    }

    /// Take the set of changes since the last call (the syncer, at the start of a round).
    pub fn take_dirty(&mut self) -> Dirty {
        std::mem::take(&mut self.dirty)
    }

    /// Put back changes a round took but did not write (it failed, or skipped them).
    pub fn restore_dirty(&mut self, d: Dirty) {
        self.dirty.merge(d);
    }

    /// Whether anything changed since the syncer last took the set.
    pub fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Record that `ino`'s content or attributes changed.
    pub fn mark_node(&mut self, ino: Ino) {
        if self.track && ino != ROOT_INO {
            self.dirty.inos.insert(ino);
        }
    }

    /// Record that the entry at `path`, and everything below it, may have changed.
    pub fn mark_path(&mut self, path: &str) {
        if !self.track {
            return;
        }
        if path.is_empty() {
            self.dirty.all = true;
        } else if !self.dirty.all {
            self.dirty.subtrees.insert(path.to_string());
        }
    }

    /// Record that everything may have changed (journal replay).
    pub fn mark_all(&mut self) {
        self.dirty.all = true;
    }

    /// Record a change of the dentry `parent`/`name`: the syncer compares its path, and a
    /// listing kept for `parent` is stale.
    fn mark_dentry(&mut self, parent: Ino, name: &str) {
        if !self.track {
            return;
        }
        self.bump_dir(parent);
        if self.dirty.all {
            return;
        }
        match self.path_of(parent) {
            Some(p) if p.is_empty() => {
                self.dirty.subtrees.insert(name.to_string());
            }
            Some(p) => {
                self.dirty.subtrees.insert(format!("{p}/{name}"));
            }
            // Not reachable (cannot happen for a directory still in the table): be safe.
            None => self.dirty.all = true,
        }
    }

    fn bump_dir(&mut self, dir: Ino) {
        if !self.track {
            return;
        }
        let g = self.dir_gens.entry(dir).or_insert(0);
        *g = g.wrapping_add(1);
    }

    /// The generation of directory `ino`'s entries: it changes whenever a name is added to
    /// or removed from it, or the directory itself moves (its `..`).
    pub fn dir_generation(&self, ino: Ino) -> u64 {
        self.dir_gens.get(&ino).copied().unwrap_or(0)
    }

    /// The node at relative `path` (`""`: the root).
    pub fn resolve(&self, path: &str) -> Option<Ino> {
        let mut ino = ROOT_INO;
        if path.is_empty() {
            return Some(ino);
        }
        for part in path.split('/') {
            ino = self.child(ino, part)?;
        }
        Some(ino)
    }

    /// The paths of every name of `ino` (one, or more for a file with hard links); none
    /// when it is unlinked or not in the table.
    pub fn paths_of(&self, ino: Ino) -> Vec<String> {
        let Some(node) = self.nodes.get(&ino) else {
            return Vec::new();
        };
        if node.unlinked || ino == ROOT_INO {
            return Vec::new();
        }
        std::iter::once((node.parent, node.name.as_str()))
            .chain(node.links.iter().map(|(p, n)| (*p, n.as_str())))
            .filter_map(|(p, n)| {
                let pp = self.path_of(p)?;
                Some(if pp.is_empty() {
                    n.to_string()
                } else {
                    format!("{pp}/{n}")
                })
            })
            .collect()
    }

    /// Take the next free inode number.
    pub fn alloc_ino(&mut self) -> Ino {
        let ino = self.next_ino;
        self.next_ino += 1;
        ino
    }

    /// Make sure future allocations are above `ino` (journal replay).
    pub fn reserve_ino(&mut self, ino: Ino) {
        self.next_ino = self.next_ino.max(ino + 1);
    }

    /// Look a node up.
    pub fn get(&self, ino: Ino) -> Option<&Node> {
        self.nodes.get(&ino).map(|n| &**n)
    }

    /// Look a node up for change.
    pub fn get_mut(&mut self, ino: Ino) -> Option<&mut Node> {
        self.nodes.get_mut(&ino).map(|n| &mut **n)
    }

    /// Add a node (its dentry is added separately with [`InodeTable::insert_child`]).
    pub fn insert(&mut self, node: Node) {
        self.reserve_ino(node.ino);
        self.nodes.insert(node.ino, Box::new(node));
    }

    /// Drop a node entirely.
    pub fn remove(&mut self, ino: Ino) -> Option<Node> {
        self.nodes.remove(&ino).map(|n| *n)
    }

    /// The child `name` of directory `parent`.
    pub fn child(&self, parent: Ino, name: &str) -> Option<Ino> {
        self.nodes.get(&parent)?.children.get(name).copied()
    }

    fn is_dir(&self, ino: Ino) -> bool {
        self.nodes.get(&ino).map(|n| n.kind) == Some(Kind::Dir)
    }

    /// Add the dentry `parent`/`name` → `ino` while the table is built from a manifest
    /// (the caller checked that the name is free and the parent is a directory).
    fn attach(&mut self, parent: Ino, name: &str, ino: Ino, is_dir: bool) {
        if let Some(p) = self.nodes.get_mut(&parent) {
            p.children.insert(name.into(), ino);
            if is_dir {
                p.subdirs += 1;
            }
        }
    }

    /// Add a dentry (the child node must already be in the table), replacing any other.
    pub fn insert_child(&mut self, parent: Ino, name: String, ino: Ino) {
        let child_is_dir = self.is_dir(ino);
        let Some(p) = self.nodes.get(&parent) else {
            return;
        };
        if p.children.get(name.as_str()) == Some(&ino) {
            return;
        }
        self.mark_dentry(parent, &name);
        let Some(p) = self.nodes.get_mut(&parent) else {
            return;
        };
        if let Some(old) = p.children.insert(name.into(), ino) {
            let old_is_dir = self.is_dir(old);
            if let Some(p) = self.nodes.get_mut(&parent)
                && old_is_dir
            {
                p.subdirs = p.subdirs.saturating_sub(1);
            }
        }
        if child_is_dir && let Some(p) = self.nodes.get_mut(&parent) {
            p.subdirs += 1;
        }
    }

    /// Remove a dentry, returning the inode it named.
    pub fn remove_child(&mut self, parent: Ino, name: &str) -> Option<Ino> {
        let ino = self.nodes.get_mut(&parent)?.children.remove(name)?;
        self.mark_dentry(parent, name);
        if self.is_dir(ino)
            && let Some(p) = self.nodes.get_mut(&parent)
        {
            p.subdirs = p.subdirs.saturating_sub(1);
        }
        Some(ino)
    }

    /// Remove the dentry `parent`/`name` of a file or symlink, keeping the node's other
    /// names: when the first name goes, the next one takes its place. Returns the inode and
    /// whether that was its last name (the caller then drops it or keeps it while open).
    pub fn unlink_dentry(&mut self, parent: Ino, name: &str) -> Option<(Ino, bool)> {
        let ino = self.remove_child(parent, name)?;
        let node = self.nodes.get_mut(&ino)?;
        if node.parent == parent && node.name == name {
            if node.links.is_empty() {
                return Some((ino, true));
            }
            let (p, n) = node.links.remove(0);
            node.parent = p;
            node.name = n;
        } else {
            node.links.retain(|(p, n)| !(*p == parent && n == name));
        }
        Some((ino, false))
    }

    /// Add the dentry `parent`/`name` for an existing file or symlink (a hard link),
    /// replacing whatever that name named (the caller has dealt with it).
    pub fn add_link(&mut self, ino: Ino, parent: Ino, name: &str) {
        let Some(node) = self.nodes.get_mut(&ino) else {
            return;
        };
        if (node.parent == parent && node.name == name)
            || node.links.iter().any(|(p, n)| *p == parent && n == name)
        {
            return;
        }
        node.links.push((parent, name.to_string()));
        self.insert_child(parent, name.to_string(), ino);
    }

    /// Rename one dentry of `ino` in the node's own records (`children` maps are the
    /// caller's): the first name or one of its hard links.
    pub fn move_dentry(&mut self, ino: Ino, from: (Ino, &str), to: (Ino, &str)) {
        let Some(node) = self.nodes.get_mut(&ino) else {
            return;
        };
        if node.parent == from.0 && node.name == from.1 {
            node.parent = to.0;
            node.name = to.1.to_string();
            // A directory moved elsewhere has a new `..`: its kept listing is stale.
            if node.kind == Kind::Dir && from.0 != to.0 {
                self.bump_dir(ino);
            }
        } else if let Some(l) = node
            .links
            .iter_mut()
            .find(|(p, n)| *p == from.0 && n == from.1)
        {
            *l = (to.0, to.1.to_string());
        }
    }

    /// Number of nodes, the root included.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Every node, reachable or not (unlinked files kept for their descriptors too).
    pub fn iter(&self) -> impl Iterator<Item = &Node> {
        self.nodes.values().map(|n| &**n)
    }

    /// Whether the table is empty (never, once built).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Relative path of a node reachable from the root (`""` for the root).
    pub fn path_of(&self, ino: Ino) -> Option<String> {
        let mut parts = Vec::new();
        let mut cur = ino;
        while cur != ROOT_INO {
            let n = self.nodes.get(&cur)?;
            if n.unlinked {
                return None;
            }
            parts.push(n.name.as_str());
            cur = n.parent;
            if parts.len() > 4096 {
                return None;
            }
        }
        parts.reverse();
        Some(parts.join("/"))
    }

    /// Whether `anc` is `ino` or one of its ancestors.
    /// Whether `ino` is a file whose content the export withholds.
    pub fn is_withheld(&self, ino: Ino) -> bool {
        self.withheld.contains(&ino)
    }

    /// Whether a withheld file lies anywhere below the directory `dir`.
    pub fn holds_withheld(&self, dir: Ino) -> bool {
        self.withheld.iter().any(|w| {
            self.nodes
                .get(w)
                .is_some_and(|n| !n.unlinked && self.is_ancestor(dir, n.parent))
        })
    }

    /// `ino` is a file whose content the export withholds (see [`InodeTable::is_withheld`]).
    pub fn refuse_withheld(&self, ino: Ino) -> Result<(), super::error::FsError> {
        if self.is_withheld(ino) {
            return Err(super::error::FsError::Withheld);
        }
        Ok(())
    }

    pub fn is_ancestor(&self, anc: Ino, ino: Ino) -> bool {
        let mut cur = ino;
        loop {
            if cur == anc {
                return true;
            }
            if cur == ROOT_INO {
                return false;
            }
            match self.nodes.get(&cur) {
                Some(n) => cur = n.parent,
                None => return false,
            }
        }
    }

    /// Visit every node reachable from the root, parents before children, with its path.
    pub fn walk(&self, f: impl FnMut(&str, &Node)) {
        self.walk_from(ROOT_INO, "", f);
    }

    /// Visit every node reachable from the root in [`InodeTable::walk`]'s order, without
    /// building paths (one string per node saved, under the table's lock).
    pub fn walk_nodes(&self, mut f: impl FnMut(&Node)) {
        let mut stack = vec![ROOT_INO];
        while let Some(ino) = stack.pop() {
            let Some(node) = self.nodes.get(&ino) else {
                continue;
            };
            if ino != ROOT_INO {
                f(node);
            }
            stack.extend(node.children.values().rev());
        }
    }

    /// Visit `start` (at `path`) and every node below it, parents before children, with
    /// their paths (the root itself is never visited).
    pub fn walk_from(&self, start: Ino, path: &str, mut f: impl FnMut(&str, &Node)) {
        let mut stack: Vec<(String, Ino)> = vec![(path.to_string(), start)];
        while let Some((path, ino)) = stack.pop() {
            let Some(node) = self.nodes.get(&ino) else {
                continue;
            };
            if ino != ROOT_INO {
                f(&path, node);
            }
            for (name, child) in node.children.iter().rev() {
                let p = if path.is_empty() {
                    name.to_string()
                } else {
                    format!("{path}/{name}")
                };
                stack.push((p, *child));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use awcp_protocol::dataplane::ManifestEntry;

    fn entry(path: &str, kind: EntryKind) -> ManifestEntry {
        ManifestEntry {
            path: path.into(),
            kind,
            mode: 0o644,
            size: 3,
            mtime_ns: 1_000_000_000,
            hash: (kind == EntryKind::File).then(|| "h".into()),
            blocks: vec![],
            target: (kind == EntryKind::Symlink).then(|| "t".into()),
            ino: None,
            ctime_ns: None,
            xattrs: Default::default(),
        }
    }

    fn manifest(entries: Vec<ManifestEntry>) -> Manifest {
        Manifest {
            version: 1,
            export_id: "e".into(),
            block_size: 4096,
            read_only: false,
            root_mode: 0o755,
            root_mtime_ns: 0,
            entries,
        }
    }

    #[test]
    fn builds_tree_with_stable_inodes() {
        let m = manifest(vec![
            entry("src", EntryKind::Dir),
            entry("src/a.py", EntryKind::File),
            entry("link", EntryKind::Symlink),
        ]);
        let t = InodeTable::from_manifest(&m, 0, 0).unwrap();
        let src = t.child(ROOT_INO, "src").unwrap();
        let a = t.child(src, "a.py").unwrap();
        assert_eq!(t.path_of(a).as_deref(), Some("src/a.py"));
        assert_eq!(t.get(src).unwrap().nlink(), 2);
        // The root has one subdirectory, `src`: 2 + 1.
        assert_eq!(t.get(ROOT_INO).unwrap().nlink(), 3);
        let t2 = InodeTable::from_manifest(&m, 0, 0).unwrap();
        assert_eq!(
            t2.child(src, "a.py"),
            Some(a),
            "inode numbers must be stable"
        );
        let mut paths = Vec::new();
        t.walk(|p, _| paths.push(p.to_string()));
        assert_eq!(paths, vec!["link", "src", "src/a.py"]);
        let mut by_path = Vec::new();
        t.walk(|_, n| by_path.push(n.ino));
        let mut nodes = Vec::new();
        t.walk_nodes(|n| nodes.push(n.ino));
        assert_eq!(nodes, by_path, "the same nodes in the same order");
    }

    #[test]
    fn uses_the_delegators_inode_numbers_when_they_are_usable() {
        let mut m = manifest(vec![
            entry("src", EntryKind::Dir),
            entry("src/a.py", EntryKind::File),
        ]);
        m.entries[0].ino = Some(500);
        m.entries[1].ino = Some(77);
        m.entries[1].ctime_ns = Some(5_000_000_000);
        let mut t = InodeTable::from_manifest(&m, 0, 0).unwrap();
        assert_eq!(t.child(ROOT_INO, "src"), Some(500));
        assert_eq!(t.child(500, "a.py"), Some(77));
        assert_eq!(t.get(77).unwrap().ctime, time_from_ns(5_000_000_000));
        assert_eq!(t.alloc_ino(), 501, "new files above every source inode");
        // A duplicate (two filesystems in one tree) or the root's number: fall back.
        m.entries[1].ino = Some(500);
        let t = InodeTable::from_manifest(&m, 0, 0).unwrap();
        assert_eq!(t.child(ROOT_INO, "src"), Some(2));
        m.entries[1].ino = Some(ROOT_INO);
        let t = InodeTable::from_manifest(&m, 0, 0).unwrap();
        assert_eq!(t.child(ROOT_INO, "src"), Some(2));
    }

    #[test]
    fn non_utf8_names_and_manifest_xattrs() {
        let mut m = manifest(vec![
            entry(
                &awcp_protocol::rawname::from_bytes(b"d\xff"),
                EntryKind::Dir,
            ),
            entry(
                &awcp_protocol::rawname::from_bytes(b"d\xff/caf\xe9"),
                EntryKind::File,
            ),
        ]);
        m.entries[1].xattrs = [
            ("user.a".to_string(), "6869".to_string()),
            ("trusted.x".to_string(), "00".to_string()),
            ("user.bad".to_string(), "zz".to_string()),
        ]
        .into_iter()
        .collect();
        let t = InodeTable::from_manifest(&m, 0, 0).unwrap();
        let d = t.child(ROOT_INO, "d\0ff").unwrap();
        let f = t.child(d, "caf\0e9").unwrap();
        assert_eq!(t.path_of(f).as_deref(), Some("d\0ff/caf\0e9"));
        let x: Vec<_> = t.get(f).unwrap().xattrs.iter().collect();
        assert_eq!(x, [(&"user.a".to_string(), &b"hi".to_vec())], "user.* only");
        // A malformed escape is refused like any bad path.
        let m = manifest(vec![entry("d\0zz", EntryKind::File)]);
        assert!(matches!(
            InodeTable::from_manifest(&m, 0, 0),
            Err(ManifestError::BadPath { .. })
        ));
    }

    #[test]
    fn hashes_are_raw_and_a_one_block_file_keeps_one() {
        let h = hex::encode(blake3::hash(b"x").as_bytes());
        let other = hex::encode([1u8; 32]);
        let one = Data::remote(Some(&h), std::slice::from_ref(&h));
        assert!(matches!(one, Data::Remote { blocks: None, .. }));
        assert_eq!(one.remote_blocks(), vec![h.clone()]);
        let two = Data::remote(Some(&h), &[h.clone(), other.clone()]);
        assert_eq!(two.remote_blocks(), vec![h.clone(), other.clone()]);
        // One block that is not the content's hash (a malformed manifest) is kept as is.
        let odd = Data::remote(Some(&h), std::slice::from_ref(&other));
        assert_eq!(odd.remote_blocks(), vec![other]);
        assert!(Data::remote(Some(&h), &[]).remote_blocks().is_empty());
        assert_eq!(hash_from_hex("not hex"), [0; 32]);
    }

    #[test]
    fn changes_are_tracked_by_path_and_node_and_bump_directory_generations() {
        let m = manifest(vec![
            entry("src", EntryKind::Dir),
            entry("src/a.py", EntryKind::File),
            entry("other", EntryKind::Dir),
        ]);
        let mut t = InodeTable::from_manifest(&m, 0, 0).unwrap();
        assert!(!t.has_dirty(), "a fresh table has nothing to write back");
        let src = t.child(ROOT_INO, "src").unwrap();
        let other = t.child(ROOT_INO, "other").unwrap();
        let a = t.child(src, "a.py").unwrap();
        assert_eq!((t.dir_generation(src), t.dir_generation(other)), (0, 0));
        // Rename src/a.py to other/b.py: both paths, both directories.
        t.remove_child(src, "a.py");
        t.insert_child(other, "b.py".into(), a);
        t.move_dentry(a, (src, "a.py"), (other, "b.py"));
        t.mark_node(a);
        assert_eq!((t.dir_generation(src), t.dir_generation(other)), (1, 1));
        let d = t.take_dirty();
        let mut paths: Vec<_> = d.subtrees.iter().cloned().collect();
        paths.sort();
        assert_eq!(paths, vec!["other/b.py", "src/a.py"]);
        assert_eq!(d.inos, HashSet::from([a]));
        assert!(!t.has_dirty());
        assert_eq!(t.paths_of(a), vec!["other/b.py"]);
        // A directory moving to another parent has a new `..`.
        t.remove_child(ROOT_INO, "src");
        t.insert_child(other, "src".into(), src);
        t.move_dentry(src, (ROOT_INO, "src"), (other, "src"));
        assert_eq!(t.dir_generation(src), 2);
        assert_eq!(t.resolve("other/src"), Some(src));
        // Given back after a failed round, merged with what came since.
        t.restore_dirty(d);
        assert!(t.take_dirty().subtrees.contains("other/src"));
    }

    #[test]
    fn rejects_orphans_duplicates_and_escapes() {
        let m = manifest(vec![entry("a/b", EntryKind::File)]);
        assert!(matches!(
            InodeTable::from_manifest(&m, 0, 0),
            Err(ManifestError::Orphan { .. })
        ));
        let m = manifest(vec![
            entry("a", EntryKind::File),
            entry("a/b", EntryKind::File),
        ]);
        assert!(InodeTable::from_manifest(&m, 0, 0).is_err());
        let m = manifest(vec![entry("a", EntryKind::Dir), entry("a", EntryKind::Dir)]);
        assert!(matches!(
            InodeTable::from_manifest(&m, 0, 0),
            Err(ManifestError::Duplicate { .. })
        ));
        let m = manifest(vec![entry("../x", EntryKind::File)]);
        assert!(matches!(
            InodeTable::from_manifest(&m, 0, 0),
            Err(ManifestError::BadPath { .. })
        ));
    }
}
