//! The write journal: every namespace change, durable before the operation returns.
//!
//! File content lives in upper files (`upper/<ino>` in the state directory), written with
//! `pwrite` as the application writes. What the upper files cannot say — which names exist,
//! which inode each names, modes, sizes, symlink targets — is appended to this journal as
//! one JSON line per changed node, with a single `write(2)` per operation. A write that has
//! returned survives a crash of the process (the kernel holds it); `fsync` on any file of
//! the mount also syncs the journal to disk, so it survives a crash of the machine too.
//!
//! Records describe resulting state, not operations, so replaying a journal over the
//! manifest it started from is idempotent: applying a record twice gives the same tree.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::inode::{Data, Ino, InodeTable, Kind, Node, time_from_ns};

/// One journal line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "r", rename_all = "lowercase")]
pub enum Record {
    /// A node's state and its first dentry (`parent`/`name`).
    Node {
        /// Inode number.
        ino: Ino,
        /// Parent directory.
        parent: Ino,
        /// Name in the parent.
        name: String,
        /// Kind.
        kind: Kind,
        /// Permission bits.
        perm: u16,
        /// Size.
        size: u64,
        /// Modification time.
        mtime_ns: i64,
        /// Symlink target.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target: Option<String>,
        /// Content is in the upper file (changed locally).
        local: bool,
    },
    /// A dentry was removed.
    Unlink {
        /// Parent directory.
        parent: Ino,
        /// Name.
        name: String,
    },
    /// A new name for an existing file or symlink (a hard link).
    Link {
        /// The inode.
        ino: Ino,
        /// Directory of the new name.
        parent: Ino,
        /// The new name.
        name: String,
    },
    /// One name of `ino` moved (rename); whatever the new name named was removed by an
    /// `Unlink` record before.
    Move {
        /// The inode.
        ino: Ino,
        /// Old directory.
        from_parent: Ino,
        /// Old name.
        from_name: String,
        /// New directory.
        parent: Ino,
        /// New name.
        name: String,
    },
    /// A node given the Delegator's state (a change made on the Delegator's side during the
    /// lease), with its first dentry; replaces whatever the name named.
    Upstream {
        /// Inode number.
        ino: Ino,
        /// Parent directory.
        parent: Ino,
        /// Name in the parent.
        name: String,
        /// Kind.
        kind: Kind,
        /// Permission bits.
        perm: u16,
        /// Size.
        size: u64,
        /// Modification time.
        mtime_ns: i64,
        /// Status change time.
        ctime_ns: i64,
        /// Symlink target.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target: Option<String>,
        /// Content hash (files).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hash: Option<String>,
        /// Block hashes (files).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        blocks: Vec<String>,
        /// `user.*` extended attributes, name → hex value.
        #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
        xattrs: std::collections::BTreeMap<String, String>,
    },
    /// An extended attribute set (`value` hex) or removed (`None`).
    Xattr {
        /// The inode.
        ino: Ino,
        /// Attribute name.
        name: String,
        /// New value, hex-encoded; `None` when removed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value: Option<String>,
    },
    /// The records of one operation that needs several (a rename over another name, an
    /// exchange), on one line: a crash inside its write keeps all of them or none, never
    /// the removal of the target without the move.
    Batch {
        /// The records, in order.
        records: Vec<Record>,
    },
}

impl Record {
    /// The record describing `node` as it is now.
    pub fn node(node: &Node) -> Record {
        Record::Node {
            ino: node.ino,
            parent: node.parent,
            name: node.name.clone(),
            kind: node.kind,
            perm: node.perm,
            size: node.size,
            mtime_ns: super::inode::time_to_ns(node.mtime),
            target: node.target.clone(),
            local: matches!(node.data, Data::Local { .. }),
        }
    }

    /// The record of a node that took the Delegator's state (its data is remote).
    pub fn upstream(node: &Node) -> Record {
        let (hash, blocks) = match &node.data {
            Data::Remote { hash, .. } => (Some(hex::encode(hash)), node.data.remote_blocks()),
            _ => (None, Vec::new()),
        };
        Record::Upstream {
            ino: node.ino,
            parent: node.parent,
            name: node.name.clone(),
            kind: node.kind,
            perm: node.perm,
            size: node.size,
            mtime_ns: super::inode::time_to_ns(node.mtime),
            ctime_ns: super::inode::time_to_ns(node.ctime),
            target: node.target.clone(),
            hash,
            blocks,
            xattrs: super::sync::hex_xattrs(node),
        }
    }
}

/// Append-only journal file.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: Mutex<File>,
    /// The same open file, for `fdatasync` without the append lock: a sync waits for the
    /// disk (tens of milliseconds when other processes write too), and holding the lock
    /// meanwhile would stall every namespace operation of the mount behind it.
    sync_fd: File,
}

impl Journal {
    /// Open (or create) the journal at `path`, appending.
    pub fn open(path: &Path) -> std::io::Result<Journal> {
        let file = crate::private::file_options().append(true).open(path)?;
        let sync_fd = file.try_clone()?;
        Ok(Journal {
            path: path.to_path_buf(),
            file: Mutex::new(file),
            sync_fd,
        })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append records with one `write(2)`: all of them, or (on an error such as `ENOSPC`)
    /// none. Callers append before they change the inode table, so an operation whose
    /// records cannot be written fails without having happened.
    pub fn append(&self, records: &[Record]) -> std::io::Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(128 * records.len());
        let line = |buf: &mut Vec<u8>, r: &Record| {
            serde_json::to_writer(&mut *buf, r).map_err(std::io::Error::other)?;
            buf.push(b'\n');
            Ok::<_, std::io::Error>(())
        };
        match records {
            [one] => line(&mut buf, one)?,
            several => line(
                &mut buf,
                &Record::Batch {
                    records: several.to_vec(),
                },
            )?,
        }
        append_whole(&mut self.file.lock(), &buf, false)
    }

    /// Make everything appended so far durable on disk. The append lock is not held: an
    /// `fdatasync` covers every page of the file dirty when it starts, so every append
    /// that returned before this call is durable when it returns; appends made meanwhile
    /// may or may not be, and are not promised.
    pub fn sync(&self) -> std::io::Result<()> {
        self.sync_fd.sync_data()
    }

    /// The open journal file, for syncing it alongside other files (see [`Journal::sync`]).
    pub(super) fn sync_handle(&self) -> &File {
        &self.sync_fd
    }

    /// Read every complete record up to the first that cannot be read: a torn last line
    /// (a crash mid-write), or a hole a power loss left (the kernel wrote a later page of
    /// the file but not an earlier one). Nothing after such a line was made durable by an
    /// `fsync` either, so replaying it would give a state the mount never had (a later
    /// operation without an earlier one); it is left out, and recovery gives the state
    /// after the last operation that reached the disk whole.
    pub fn read_all(path: &Path) -> std::io::Result<Vec<Record>> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for line in BufReader::new(file).split(b'\n') {
            let line = line?;
            match serde_json::from_slice(&line) {
                Ok(r) => out.push(r),
                Err(e) => {
                    tracing::warn!(error = %e, records = out.len(),
                        "journal: a torn or unreadable record; replaying only the records before it");
                    break;
                }
            }
        }
        Ok(out)
    }
}

/// Append `buf` to `file` (opened `O_APPEND`), and `fdatasync` it when `sync`: all of it,
/// or nothing. A write cut short (`ENOSPC` part-way) or a failed sync is cut off again
/// (truncating needs no space), so a later append never joins a torn line and the reader
/// never loses the record after it; a line that failed is not left for recovery to act on.
pub(super) fn append_whole(file: &mut File, buf: &[u8], sync: bool) -> std::io::Result<()> {
    let before = write_whole(file, buf)?;
    if sync && let Err(e) = file.sync_data() {
        cut_back(file, before);
        return Err(e);
    }
    Ok(())
}

/// Append `buf` to `file` (opened `O_APPEND`), all of it or nothing (see [`append_whole`]);
/// returns the length before it, for [`cut_back`] should a later step fail.
pub(super) fn write_whole(file: &mut File, buf: &[u8]) -> std::io::Result<u64> {
    let before = file.metadata()?.len();
    if let Err(e) = file.write_all(buf) {
        cut_back(file, before);
        return Err(e);
    }
    Ok(before)
}

/// Cut `file` back to `len` bytes (an append that failed, or whose sync did).
pub(super) fn cut_back(file: &File, len: u64) {
    if let Err(cut) = file.set_len(len) {
        tracing::warn!(error = %cut, "cannot cut a failed append off the state file");
    }
}

/// Apply journal records to a table built from the same manifest (crash recovery).
pub fn replay(table: &mut InodeTable, records: &[Record], uid: u32, gid: u32) {
    // New nodes in the hot arena, as under the table's lock (`TableLock`).
    let _hot = crate::alloc::scope();
    if !records.is_empty() {
        // The first write-back round compares the whole tree with what the export has.
        table.mark_all();
    }
    apply(table, records, uid, gid);
}

fn apply(table: &mut InodeTable, records: &[Record], uid: u32, gid: u32) {
    for r in records {
        match r {
            Record::Batch { records } => apply(table, records, uid, gid),
            Record::Node {
                ino,
                parent,
                name,
                kind,
                perm,
                size,
                mtime_ns,
                target,
                local,
            } => {
                let t = time_from_ns(*mtime_ns);
                if let Some(old) = table
                    .get(*ino)
                    .map(|n| (n.parent, n.name.clone(), n.unlinked))
                    && !old.2
                    && (old.0 != *parent || old.1 != *name)
                    && table.child(old.0, &old.1) == Some(*ino)
                {
                    table.remove_child(old.0, &old.1);
                }
                // Whatever the name named before is replaced.
                if table.child(*parent, name).is_some_and(|prev| prev != *ino) {
                    unlink_replayed(table, *parent, name);
                }
                let data = if *local {
                    Data::Local {
                        dirty: true,
                        hash: None,
                        generation: 0,
                    }
                } else {
                    table
                        .get(*ino)
                        .map(|n| n.data.clone())
                        .unwrap_or(Data::None)
                };
                let (children, subdirs, links, xattrs) = table
                    .get(*ino)
                    .map(|n| {
                        (
                            n.children.clone(),
                            n.subdirs,
                            n.links.clone(),
                            n.xattrs.clone(),
                        )
                    })
                    .unwrap_or_default();
                table.insert(Node {
                    ino: *ino,
                    parent: *parent,
                    name: name.clone(),
                    kind: *kind,
                    perm: *perm,
                    uid,
                    gid,
                    size: *size,
                    atime: t,
                    mtime: t,
                    ctime: t,
                    children,
                    subdirs,
                    target: target.clone(),
                    data,
                    open_handles: 0,
                    open_writers: 0,
                    bypassed: false,
                    unlinked: false,
                    links,
                    xattrs,
                });
                table.insert_child(*parent, name.clone(), *ino);
            }
            Record::Upstream {
                ino,
                parent,
                name,
                kind,
                perm,
                size,
                mtime_ns,
                ctime_ns,
                target,
                hash,
                blocks,
                xattrs,
            } => {
                if table.child(*parent, name).is_some_and(|prev| prev != *ino) {
                    unlink_replayed(table, *parent, name);
                }
                table.reserve_ino(*ino);
                let t = time_from_ns(*mtime_ns);
                let (children, subdirs) = table
                    .get(*ino)
                    .map(|n| (n.children.clone(), n.subdirs))
                    .unwrap_or_default();
                let xattrs = xattrs
                    .iter()
                    .filter_map(|(k, v)| Some((k.clone(), hex::decode(v).ok()?)))
                    .collect();
                table.insert(Node {
                    ino: *ino,
                    parent: *parent,
                    name: name.clone(),
                    kind: *kind,
                    perm: *perm,
                    uid,
                    gid,
                    size: *size,
                    atime: t,
                    mtime: t,
                    ctime: time_from_ns(*ctime_ns),
                    children,
                    subdirs,
                    target: target.clone(),
                    data: match (kind, hash) {
                        (Kind::File, Some(h)) => Data::remote(Some(h), blocks),
                        _ => Data::None,
                    },
                    open_handles: 0,
                    open_writers: 0,
                    bypassed: false,
                    unlinked: false,
                    links: Vec::new(),
                    xattrs,
                });
                table.insert_child(*parent, name.clone(), *ino);
            }
            Record::Unlink { parent, name } => unlink_replayed(table, *parent, name),
            Record::Link { ino, parent, name } => {
                if table.get(*ino).is_none() {
                    continue;
                }
                if table.child(*parent, name).is_some_and(|prev| prev != *ino) {
                    unlink_replayed(table, *parent, name);
                }
                table.add_link(*ino, *parent, name);
            }
            Record::Move {
                ino,
                from_parent,
                from_name,
                parent,
                name,
            } => {
                if table.get(*ino).is_none() {
                    continue;
                }
                if table.child(*from_parent, from_name) == Some(*ino) {
                    table.remove_child(*from_parent, from_name);
                }
                table.insert_child(*parent, name.clone(), *ino);
                table.move_dentry(*ino, (*from_parent, from_name), (*parent, name));
                if let Some(n) = table.get_mut(*ino) {
                    n.unlinked = false;
                }
            }
            Record::Xattr { ino, name, value } => {
                if let Some(n) = table.get_mut(*ino) {
                    match value.as_deref().map(hex::decode) {
                        Some(Ok(v)) => {
                            n.xattrs.insert(name.clone(), v);
                        }
                        Some(Err(_)) => {
                            tracing::warn!(ino, "journal: ignoring an unreadable xattr value");
                        }
                        None => {
                            n.xattrs.remove(name);
                        }
                    }
                }
            }
        }
    }
}

/// Replay the removal of one name: the node loses that name, and is marked unlinked when
/// it was its last.
fn unlink_replayed(table: &mut InodeTable, parent: Ino, name: &str) {
    if let Some((ino, true)) = table.unlink_dentry(parent, name)
        && let Some(n) = table.get_mut(ino)
    {
        n.unlinked = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torn_last_line_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("j");
        let j = Journal::open(&p).unwrap();
        j.append(&[Record::Unlink {
            parent: 1,
            name: "a".into(),
        }])
        .unwrap();
        drop(j);
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"{\"r\":\"unl").unwrap();
        let recs = Journal::read_all(&p).unwrap();
        assert_eq!(recs.len(), 1);
    }

    #[test]
    fn upstream_records_replay_the_delegators_state() {
        use awcp_protocol::dataplane::{EntryKind, Manifest, ManifestEntry};
        let h1 = hex::encode([1u8; 32]);
        let h2 = hex::encode([2u8; 32]);
        let file = |path: &str, hash: &str| ManifestEntry {
            path: path.into(),
            kind: EntryKind::File,
            mode: 0o644,
            size: 1,
            mtime_ns: 1,
            hash: Some(hash.into()),
            blocks: vec![hash.into()],
            target: None,
            ino: None,
            ctime_ns: None,
            xattrs: Default::default(),
        };
        let m = Manifest {
            version: 1,
            export_id: "e".into(),
            block_size: 8,
            read_only: false,
            root_mode: 0o755,
            root_mtime_ns: 0,
            entries: vec![file("a", &h1)],
        };
        let mut table = InodeTable::from_manifest(&m, 0, 0).unwrap();
        let a = table.child(super::super::inode::ROOT_INO, "a").unwrap();
        let mut changed = table.get(a).unwrap().clone();
        changed.data = Data::remote(Some(&h2), std::slice::from_ref(&h2));
        changed.size = 2;
        let new_ino = a + 100;
        let mut created = changed.clone();
        created.ino = new_ino;
        created.name = "b".into();
        let records = [Record::upstream(&changed), Record::upstream(&created)];
        // Through the text form, as recovery reads it.
        let lines: Vec<Record> = records
            .iter()
            .map(|r| serde_json::from_str(&serde_json::to_string(r).unwrap()).unwrap())
            .collect();
        replay(&mut table, &lines, 0, 0);
        let root = super::super::inode::ROOT_INO;
        let a_now = table.get(table.child(root, "a").unwrap()).unwrap();
        assert_eq!(
            a_now.data,
            Data::remote(Some(&h2), std::slice::from_ref(&h2))
        );
        assert_eq!(a_now.data.remote_blocks(), std::slice::from_ref(&h2));
        assert_eq!(a_now.size, 2);
        assert_eq!(table.child(root, "b"), Some(new_ino));
        // New inode numbers stay above the replayed ones.
        assert!(table.alloc_ino() > new_ino);
    }

    #[test]
    fn non_utf8_names_survive_the_journal() {
        // Held escaped in memory (see `awcp_protocol::rawname`), as JSON in the journal.
        let name = awcp_protocol::rawname::from_bytes(b"caf\xe9").into_owned();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("j");
        let j = Journal::open(&p).unwrap();
        let rec = Record::Unlink { parent: 1, name };
        j.append(std::slice::from_ref(&rec)).unwrap();
        assert_eq!(Journal::read_all(&p).unwrap(), [rec]);
    }
}
