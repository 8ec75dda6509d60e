//! The binary manifest: any manifest round-trips byte-exactly, and any bytes decode to a
//! manifest or an error, never a panic.

use std::collections::BTreeMap;

use awcp_protocol::dataplane::{EntryKind, Manifest, ManifestEntry};
use awcp_protocol::rawname;
use proptest::prelude::*;

/// A name of arbitrary bytes (no `/`, no NUL), mostly not UTF-8.
fn raw_name() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(1u8..=255, 1..16).prop_map(|v| {
        v.into_iter()
            .map(|b| if b == b'/' { b'_' } else { b })
            .collect()
    })
}

/// A path: UTF-8 (the common case) or made of arbitrary-byte names, in `String` form.
fn path() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zé/._-]{1,24}",
        prop::collection::vec(raw_name(), 1..4)
            .prop_map(|names| rawname::from_bytes(&names.join(&b'/')).into_owned()),
    ]
}

fn xattrs() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(
        "user\\.[a-z.]{1,10}",
        prop::collection::vec(any::<u8>(), 0..20).prop_map(hex::encode),
        0..3,
    )
}

fn hash() -> impl Strategy<Value = String> {
    prop::array::uniform32(any::<u8>()).prop_map(|b| b.iter().map(|x| format!("{x:02x}")).collect())
}

fn entry() -> impl Strategy<Value = ManifestEntry> {
    (
        path(),
        0u8..3,
        0u32..0o10000,
        any::<u64>(),
        any::<i64>(),
        prop::option::of(hash()),
        prop::collection::vec(hash(), 0..4),
        prop::option::of(prop_oneof!["[ -~]{0,20}".boxed(), path().boxed()]),
        prop::option::of(any::<u64>()),
        prop::option::of(any::<i64>()),
        (any::<bool>(), xattrs()),
    )
        .prop_map(
            |(
                path,
                kind,
                mode,
                size,
                mtime_ns,
                hash,
                mut blocks,
                target,
                ino,
                ctime_ns,
                (sole, xattrs),
            )| {
                // Exercise the "one block equal to the hash" shortcut too.
                if sole && let Some(h) = &hash {
                    blocks = vec![h.clone()];
                }
                ManifestEntry {
                    path,
                    kind: [EntryKind::File, EntryKind::Dir, EntryKind::Symlink][kind as usize],
                    mode,
                    size,
                    mtime_ns,
                    hash,
                    blocks,
                    target,
                    ino,
                    ctime_ns,
                    xattrs,
                }
            },
        )
}

proptest! {
    #[test]
    fn manifests_round_trip(
        entries in prop::collection::vec(entry(), 0..40),
        export_id in "[a-z0-9_]{1,20}",
        block_size in any::<u32>(),
        read_only in any::<bool>(),
        root_mtime_ns in any::<i64>(),
    ) {
        let m = Manifest {
            version: 1,
            export_id,
            block_size,
            read_only,
            root_mode: 0o755,
            root_mtime_ns,
            entries,
        };
        let bin = m.to_binary().unwrap();
        let back = Manifest::from_binary(&bin).unwrap();
        prop_assert_eq!(&back, &m);
        // Canonical: the same manifest, the same bytes (so the digest is stable).
        prop_assert_eq!(back.to_binary().unwrap(), bin);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Manifest::from_binary(&bytes);
        // And with a valid header in front.
        for format in [1u8, 2] {
            let mut framed = b"AWMF".to_vec();
            framed.push(format);
            framed.extend_from_slice(&bytes);
            let _ = Manifest::from_binary(&framed);
        }
    }
}
