//! Paths on the wire: UTF-8 paths are plain JSON strings exactly as before; any other name
//! round-trips byte-exactly as `{"b64": ...}`; malformed encodings are refused.

use awcp_protocol::dataplane::{Change, ChangeSet, Manifest, validate_rel_path};
use awcp_protocol::rawname;
use proptest::prelude::*;

/// A name of arbitrary bytes: anything but `/` and NUL.
fn raw_name() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(1u8..=255, 1..40).prop_map(|v| {
        v.into_iter()
            .map(|b| if b == b'/' { b'x' } else { b })
            .collect()
    })
}

fn unlink(path: String) -> String {
    serde_json::to_string(&Change::Unlink { path, base: None }).unwrap()
}

#[test]
fn utf8_paths_encode_exactly_as_before() {
    for p in ["a", "src/é.rs", "dir with space/x\ty", "日本/語", "a\"b\\c"] {
        let json = unlink(p.to_owned());
        let before = format!(
            r#"{{"op":"unlink","path":{},"base":null}}"#,
            serde_json::to_string(p).unwrap()
        );
        assert_eq!(json, before, "{p:?}");
    }
    let c = Change::Symlink {
        path: "l".into(),
        target: "../t".into(),
    };
    assert_eq!(
        serde_json::to_string(&c).unwrap(),
        r#"{"op":"symlink","path":"l","target":"../t"}"#
    );
}

#[test]
fn non_utf8_paths_are_base64_objects() {
    let p = rawname::from_bytes(b"d/caf\xe9.txt").into_owned();
    let json = unlink(p.clone());
    assert_eq!(
        json,
        r#"{"op":"unlink","path":{"b64":"ZC9jYWbpLnR4dA=="},"base":null}"#
    );
    let back: Change = serde_json::from_str(&json).unwrap();
    assert_eq!(back.path(), p);
    assert_eq!(&*rawname::to_bytes(back.path()), b"d/caf\xe9.txt");
    validate_rel_path(back.path()).unwrap();
}

#[test]
fn malformed_encodings_are_refused() {
    for bad in [
        // Not base64.
        r#"{"op":"unlink","path":{"b64":"!!"},"base":null}"#,
        // UTF-8 bytes must travel as a string: one path, one encoding.
        r#"{"op":"unlink","path":{"b64":"YWJj"},"base":null}"#,
        // NUL inside, either way.
        r#"{"op":"unlink","path":{"b64":"YQBi6Q=="},"base":null}"#,
        "{\"op\":\"unlink\",\"path\":\"a\\u0000e9\",\"base\":null}",
        // Unknown or extra keys.
        r#"{"op":"unlink","path":{"hex":"e9"},"base":null}"#,
        r#"{"op":"unlink","path":{"b64":"6Q==","x":1},"base":null}"#,
        r#"{"op":"unlink","path":{},"base":null}"#,
        r#"{"op":"unlink","path":7,"base":null}"#,
    ] {
        let r: Result<Change, _> = serde_json::from_str(bad);
        assert!(r.is_err(), "{bad} accepted");
    }
    // Escapes outside the canonical form, `..` and `/` smuggled as bytes are refused by
    // path validation.
    for bad in ["\0c3\0a9", "a\0zz", "\u{0}2f", "a/\0"] {
        assert!(validate_rel_path(bad).is_err(), "{bad:?} accepted");
    }
    // `..` as a non-UTF-8 path: decodes, then path validation refuses it.
    let dotdot: Change =
        serde_json::from_str(r#"{"op":"unlink","path":{"b64":"Li4v6Q=="},"base":null}"#).unwrap();
    assert_eq!(&*rawname::to_bytes(dotdot.path()), b"../\xe9");
    assert!(validate_rel_path(dotdot.path()).is_err());
    let dotdot_raw = rawname::from_bytes(b"../\xe9").into_owned();
    assert!(validate_rel_path(&dotdot_raw).is_err());
}

#[test]
fn manifest_json_carries_xattrs_only_when_present() {
    let m: Manifest = serde_json::from_str(
        r#"{"version":1,"exportId":"e","blockSize":4096,"readOnly":false,"rootMode":493,
            "rootMtimeNs":0,"entries":[{"path":"a","kind":"file","mode":420,"size":0,
            "mtimeNs":0}]}"#,
    )
    .unwrap();
    assert!(m.entries[0].xattrs.is_empty());
    assert!(!serde_json::to_string(&m).unwrap().contains("xattrs"));
}

proptest! {
    #[test]
    fn arbitrary_byte_paths_round_trip_through_json(
        names in prop::collection::vec(raw_name(), 1..4),
        target in raw_name(),
    ) {
        let raw = names.join(&b'/');
        let path = rawname::from_bytes(&raw).into_owned();
        let target = rawname::from_bytes(&target).into_owned();
        let cs = ChangeSet {
            commit_id: "c".into(),
            changes: vec![
                Change::Symlink { path: path.clone(), target: target.clone() },
                Change::Unlink { path: path.clone(), base: Some(target.clone()) },
            ],
            age_ms: None,
        };
        let json = serde_json::to_string(&cs).unwrap();
        // The escaped form never reaches the wire.
        prop_assert!(!json.contains("\\u0000"));
        let back: ChangeSet = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(&back, &cs);
        prop_assert_eq!(&*rawname::to_bytes(back.changes[0].path()), &raw[..]);
        let valid = names.iter().all(|n| n != b"." && n != b".." && n.len() <= 255);
        prop_assert_eq!(validate_rel_path(&path).is_ok(), valid);
    }

    #[test]
    fn the_string_form_is_a_bijection(raw in prop::collection::vec(any::<u8>(), 0..64)) {
        let s = rawname::from_bytes(&raw);
        prop_assert_eq!(&*rawname::decode(&s).unwrap(), &raw[..]);
        // UTF-8 without NUL is held as itself; anything else is marked.
        let plain = std::str::from_utf8(&raw).is_ok_and(|t| !t.contains('\0'));
        prop_assert_eq!(rawname::is_escaped(&s), !plain);
    }
}
