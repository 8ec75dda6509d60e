//! The rule deciding which entries git may trust, on an inode table built by hand.

use super::*;
use crate::gitindex::Entry;
use std::collections::BTreeMap;

fn table() -> InodeTable {
    use awcp_protocol::dataplane::{EntryKind, Manifest, ManifestEntry};
    let file = |path: &str, size: u64, mode: u32, secs: i64| ManifestEntry {
        path: path.into(),
        kind: EntryKind::File,
        mode,
        size,
        mtime_ns: secs * 1_000_000_000 + 5,
        hash: Some(hex::encode(blake3::hash(path.as_bytes()).as_bytes())),
        blocks: vec![hex::encode(blake3::hash(path.as_bytes()).as_bytes())],
        target: None,
        ino: None,
        ctime_ns: None,
        xattrs: BTreeMap::new(),
    };
    let dir = |path: &str| ManifestEntry {
        path: path.into(),
        kind: EntryKind::Dir,
        mode: 0o755,
        size: 0,
        mtime_ns: 0,
        hash: None,
        blocks: vec![],
        target: None,
        ino: None,
        ctime_ns: None,
        xattrs: BTreeMap::new(),
    };
    let m = Manifest {
        entries: vec![
            file("a.txt", 10, 0o644, 100),
            dir("src"),
            file("src/run.sh", 20, 0o755, 100),
            file("src/x.rs", 30, 0o644, 100),
            file("src/new.rs", 30, 0o644, 300),
        ],
        version: awcp_protocol::dataplane::DATA_PLANE_VERSION,
        export_id: "x".into(),
        block_size: 1 << 20,
        read_only: false,
        root_mode: 0o755,
        root_mtime_ns: 0,
    };
    InodeTable::from_manifest(&m, 0, 0).unwrap()
}

fn entry(names: &mut Vec<u8>, path: &str, mode: u32, secs: u32, ns: u32, size: u32) -> Entry {
    let start = names.len();
    names.extend_from_slice(path.as_bytes());
    Entry {
        name: start..names.len(),
        mode,
        mtime: (secs, ns),
        size,
        stage: 0,
        special: false,
    }
}

#[test]
fn git_may_trust_only_entries_whose_stat_data_the_mount_shows() {
    let t = table();
    let mut names = Vec::new();
    let mut entries = vec![
        // Unchanged.
        entry(&mut names, "a.txt", 0o100644, 100, 5, 10),
        // Size differs.
        entry(&mut names, "src/run.sh", 0o100755, 100, 5, 21),
        // Executable bit differs.
        entry(&mut names, "src/x.rs", 0o100755, 100, 5, 30),
        // Nanoseconds differ.
        entry(&mut names, "src/new.rs", 0o100644, 300, 6, 30),
        // Not on the mount.
        entry(&mut names, "src/gone.rs", 0o100644, 100, 5, 30),
        // A symlink, and a submodule: git's to look at.
        entry(&mut names, "src/x.rs", 0o120000, 100, 5, 30),
        entry(&mut names, "src/x.rs", 0o160000, 100, 5, 30),
        // In a directory that is a file here.
        entry(&mut names, "a.txt/y", 0o100644, 100, 5, 10),
        // Unchanged, executable.
        entry(&mut names, "src/run.sh", 0o100755, 100, 5, 20),
    ];
    let mut conflicted = entry(&mut names, "a.txt", 0o100644, 100, 5, 10);
    conflicted.stage = 2;
    entries.push(conflicted);
    let mut ita = entry(&mut names, "a.txt", 0o100644, 100, 5, 10);
    ita.special = true;
    entries.push(ita);
    let index = Index::for_tests(entries, names);
    let dirty = index_dirty(&t, &index, (200, 0));
    assert_eq!(
        dirty,
        [
            false, true, true, true, true, true, true, true, false, true, true
        ]
    );
    // Racily clean: recorded no earlier than the index was written.
    assert!(index_dirty(&t, &index, (100, 5))[0]);
    assert!(!index_dirty(&t, &index, (100, 6))[0]);
}
