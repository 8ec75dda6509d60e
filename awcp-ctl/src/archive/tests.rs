use std::io::Write;

use super::*;

fn write(root: &Path, rel: &str, content: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, content).unwrap();
}

fn read(root: &Path, rel: &str) -> Option<String> {
    std::fs::read_to_string(root.join(rel)).ok()
}

/// A zip with exactly these entry names, even ones the zip writer refuses: each entry is
/// written under a placeholder of the same length, then renamed in the raw bytes (names are
/// not covered by the CRC).
fn zip_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut zw = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let mut renames = Vec::new();
    for (i, (name, data)) in entries.iter().enumerate() {
        let placeholder: String =
            format!("{i}{}", "q".repeat(name.len()))[..name.len()].to_string();
        zw.start_file(placeholder.clone(), SimpleFileOptions::default())
            .unwrap();
        zw.write_all(data).unwrap();
        renames.push((placeholder, name.to_string()));
    }
    let mut bytes = zw.finish().unwrap().into_inner();
    for (from, to) in renames {
        let (from, to) = (from.as_bytes(), to.as_bytes());
        let mut i = 0;
        while i + from.len() <= bytes.len() {
            if &bytes[i..i + from.len()] == from {
                bytes[i..i + from.len()].copy_from_slice(to);
                i += from.len();
            } else {
                i += 1;
            }
        }
    }
    bytes
}

fn resource(name: &str, root: &Path) -> SourceResource {
    SourceResource {
        name: name.into(),
        root: root.to_path_buf(),
        filter: Filter::new(vec![], vec![]),
    }
}

#[test]
fn build_then_extract_round_trips_under_resource_names() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src, "a.txt", "A");
    write(&src, "sub/b.txt", "B");
    write(&src, ".hidden", "H");
    std::fs::create_dir_all(src.join("empty")).unwrap();
    let built = build(&[resource("workspace", &src)], &ScanLimits::REFERENCE).unwrap();
    assert_eq!(built.checksum, sha256_hex(&built.bytes));
    assert_eq!(built.files, 3);
    assert_eq!(built.base["workspace"].len(), 3);
    let dest = tmp.path().join("dest");
    let stats = extract(&built.bytes, &dest, &ScanLimits::REFERENCE).unwrap();
    assert_eq!(stats.files, 3);
    assert_eq!(read(&dest, "workspace/sub/b.txt").as_deref(), Some("B"));
    assert_eq!(read(&dest, "workspace/.hidden").as_deref(), Some("H"));
    assert!(dest.join("workspace/empty").is_dir());
}

#[test]
fn extraction_refuses_escaping_names_and_links() {
    let tmp = tempfile::tempdir().unwrap();
    for (i, name) in ["../evil", "/abs", "a/../../evil", "a\\..\\evil", "a//b"]
        .into_iter()
        .enumerate()
    {
        let z = zip_of(&[(name, b"x")]);
        let dest = tmp.path().join(format!("d{i}"));
        let err = extract(&z, &dest, &ScanLimits::REFERENCE).unwrap_err();
        assert!(
            matches!(err, ArchiveError::UnsafeEntry { .. }),
            "{name}: {err}"
        );
    }
    assert!(!tmp.path().join("evil").exists());
    // A symbolic link entry.
    let mut zw = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    zw.add_symlink("w/link", "/etc", SimpleFileOptions::default())
        .unwrap();
    let z = zw.finish().unwrap().into_inner();
    let err = extract(&z, &tmp.path().join("sl"), &ScanLimits::REFERENCE).unwrap_err();
    assert!(err.to_string().contains("symbolic links"), "{err}");
}

#[test]
fn extraction_stops_at_the_limit_counting_real_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let zeros = vec![0u8; 1 << 20];
    let z = zip_of(&[("w/big", &zeros)]);
    let limits = ScanLimits {
        max_total_bytes: 1000,
        max_files: 10,
        max_file_bytes: 1000,
    };
    let err = extract(&z, &tmp.path().join("d"), &limits).unwrap_err();
    assert!(matches!(err, ArchiveError::TooLarge { .. }), "{err}");
    let size = std::fs::metadata(tmp.path().join("d/w/big")).unwrap().len();
    assert!(size <= 1001, "wrote {size} bytes");
}

#[test]
fn admission_refuses_sensitive_files_and_size_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src, "ok.txt", "fine");
    write(&src, "conf/.env", "SECRET=1");
    write(&src, "keys/id_rsa", "PRIVATE");
    let err = build(&[resource("w", &src)], &ScanLimits::REFERENCE).unwrap_err();
    let ArchiveError::Sensitive { files } = err else {
        panic!("{err}")
    };
    assert_eq!(files, vec!["w/conf/.env", "w/keys/id_rsa"]);
    // Excluding them delegates the rest; they are not in the zip.
    let r = SourceResource {
        filter: Filter::new(vec![], vec![".env".into(), "keys".into()]),
        ..resource("w", &src)
    };
    let built = build(&[r], &ScanLimits::REFERENCE).unwrap();
    assert_eq!(
        built.base["w"].keys().collect::<Vec<_>>(),
        vec!["ok.txt"],
        "only the allowed file travels"
    );
    let limits = ScanLimits {
        max_total_bytes: 100,
        max_files: 1,
        max_file_bytes: 100,
    };
    write(&src, "two.txt", "2");
    let r = SourceResource {
        filter: Filter::new(vec![], vec![".env".into(), "keys".into()]),
        ..resource("w", &src)
    };
    let err = build(&[r], &limits).unwrap_err();
    assert!(err.to_string().contains("2 files (limit 1)"), "{err}");
}

#[test]
fn links_leaving_the_resource_do_not_travel() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src, "in.txt", "in");
    write(tmp.path(), "outside.txt", "secret");
    std::os::unix::fs::symlink(tmp.path().join("outside.txt"), src.join("out-link")).unwrap();
    std::os::unix::fs::symlink("in.txt", src.join("in-link")).unwrap();
    let built = build(&[resource("w", &src)], &ScanLimits::REFERENCE).unwrap();
    assert!(built.base["w"].contains_key("in-link"));
    assert!(!built.base["w"].contains_key("out-link"));
    assert_eq!(built.skipped, vec!["w/out-link"]);
}

/// Build from `src`, let `executor` change the unpacked copy, snapshot it, and return the
/// snapshot with the base manifest.
fn round(src: &Path, executor: impl FnOnce(&Path)) -> (Vec<u8>, BaseManifest) {
    let built = build(&[resource("w", src)], &ScanLimits::REFERENCE).unwrap();
    let work = src
        .parent()
        .unwrap()
        .join(format!("work-{}", crate::random_token()));
    extract(&built.bytes, &work, &ScanLimits::REFERENCE).unwrap();
    executor(&work.join("w"));
    let (zip, _, _) = pack_dir(&work).unwrap();
    (zip, built.base)
}

#[test]
fn apply_merges_file_by_file_and_keeps_both_sides_of_a_conflict() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src, "keep.txt", "keep");
    write(&src, "edit.txt", "v1");
    write(&src, "both.txt", "v1");
    write(&src, "gone.txt", "bye");
    write(&src, "gone-but-edited.txt", "v1");
    write(&src, "dir/only.txt", "x");
    let (snap, mut base) = round(&src, |w| {
        write(w, "edit.txt", "v2 executor");
        write(w, "both.txt", "executor");
        write(w, "new/file.txt", "new");
        std::fs::remove_file(w.join("gone.txt")).unwrap();
        std::fs::remove_file(w.join("gone-but-edited.txt")).unwrap();
        std::fs::remove_dir_all(w.join("dir")).unwrap();
    });
    // Meanwhile on the Delegator.
    write(&src, "both.txt", "delegator");
    write(&src, "gone-but-edited.txt", "v2 delegator");
    write(&src, "untracked-local.txt", "local only");
    let targets = [ApplyTarget {
        name: "w".into(),
        root: src.clone(),
        writable: true,
    }];
    let report = apply(
        &snap,
        &mut base,
        &targets,
        &tmp.path().join("scratch"),
        "snap_1",
        &ScanLimits::REFERENCE,
    )
    .unwrap();
    assert_eq!(read(&src, "edit.txt").as_deref(), Some("v2 executor"));
    assert_eq!(read(&src, "new/file.txt").as_deref(), Some("new"));
    assert_eq!(read(&src, "keep.txt").as_deref(), Some("keep"));
    assert_eq!(read(&src, "gone.txt"), None);
    assert!(!src.join("dir").exists(), "emptied directory removed");
    // Not in the snapshot, never sent: untouched (no whole-directory replace).
    assert_eq!(
        read(&src, "untracked-local.txt").as_deref(),
        Some("local only")
    );
    // Conflicts: the Delegator's version stays, the Executor's is kept beside.
    assert_eq!(read(&src, "both.txt").as_deref(), Some("delegator"));
    assert_eq!(
        read(&src, "both.txt.awcp-conflict-snap_1").as_deref(),
        Some("executor")
    );
    assert_eq!(
        read(&src, "gone-but-edited.txt").as_deref(),
        Some("v2 delegator")
    );
    let mut paths: Vec<_> = report.conflicts.iter().map(|c| c.path.as_str()).collect();
    paths.sort();
    assert_eq!(paths, vec!["w/both.txt", "w/gone-but-edited.txt"]);
    assert_eq!(report.deleted, vec!["w/dir/only.txt", "w/gone.txt"]);
}

#[test]
fn apply_never_writes_through_a_delegator_side_link() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    write(&src, "a.txt", "a");
    let (snap, mut base) = round(&src, |w| write(w, "sub/x.txt", "x"));
    // After sending, the Delegator's `sub` became a link out of the resource.
    std::os::unix::fs::symlink(&outside, src.join("sub")).unwrap();
    let targets = [ApplyTarget {
        name: "w".into(),
        root: src.clone(),
        writable: true,
    }];
    let report = apply(
        &snap,
        &mut base,
        &targets,
        &tmp.path().join("scratch"),
        "s",
        &ScanLimits::REFERENCE,
    )
    .unwrap();
    assert!(!outside.join("x.txt").exists(), "wrote through a link");
    assert_eq!(report.conflicts.len(), 1, "{report:?}");
}

#[test]
fn read_only_resources_are_not_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src, "a.txt", "a");
    let (snap, mut base) = round(&src, |w| write(w, "a.txt", "changed"));
    let targets = [ApplyTarget {
        name: "w".into(),
        root: src.clone(),
        writable: false,
    }];
    let report = apply(
        &snap,
        &mut base,
        &targets,
        &tmp.path().join("scratch"),
        "s",
        &ScanLimits::REFERENCE,
    )
    .unwrap();
    assert_eq!(report, ApplyReport::default());
    assert_eq!(read(&src, "a.txt").as_deref(), Some("a"));
    let changed = changed_files(
        &snap,
        &base,
        &tmp.path().join("scratch"),
        &ScanLimits::REFERENCE,
    )
    .unwrap();
    assert_eq!(changed, vec!["w/a.txt"]);
}

proptest::proptest! {
    /// Whatever the name, an accepted one stays inside the directory.
    #[test]
    fn accepted_entry_names_never_leave_the_directory(name in "[a-z./\\\\\\x00]{0,12}") {
        if let Ok(parts) = safe_parts(&name) {
            proptest::prop_assert!(!name.starts_with('/'));
            for p in parts {
                proptest::prop_assert!(!p.is_empty() && p != "." && p != "..");
                proptest::prop_assert!(!p.contains('\\') && !p.contains('\0'));
            }
        }
    }

    /// The glob matcher never panics, and a pattern matches itself when it has no
    /// wildcards.
    #[test]
    fn globs_do_not_panic(pattern in "[a-z*?/.]{0,10}", path in "[a-z/.]{1,12}") {
        let _ = walk::glob_path(&pattern, &path);
        if !pattern.contains(['*', '?']) && !pattern.is_empty() && !pattern.contains("//")
            && !pattern.starts_with('/') && !pattern.ends_with('/') && !pattern.starts_with("./")
        {
            proptest::prop_assert!(walk::glob_path(&pattern, &pattern));
        }
    }

    /// Random bytes are refused as a zip, never a panic, and nothing is written outside.
    #[test]
    fn random_bytes_do_not_unpack(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        let tmp = tempfile::tempdir().unwrap();
        let _ = extract(&bytes, &tmp.path().join("d"), &ScanLimits::REFERENCE);
        let outside: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten()
            .filter(|e| e.file_name() != "d").collect();
        proptest::prop_assert!(outside.is_empty());
    }
}
