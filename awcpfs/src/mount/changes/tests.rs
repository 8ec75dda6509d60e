use super::*;
use awcp_protocol::dataplane::{EntryKind, Manifest, ManifestEntry};

use crate::mount::inode::ROOT_INO;

fn entry(path: &str, kind: EntryKind) -> ManifestEntry {
    ManifestEntry {
        path: path.into(),
        kind,
        mode: 0o644,
        size: 3,
        mtime_ns: 1_000_000_000,
        hash: (kind == EntryKind::File).then(|| "h".into()),
        blocks: vec![],
        target: None,
        ino: None,
        ctime_ns: None,
        xattrs: Default::default(),
    }
}

fn table() -> InodeTable {
    let m = Manifest {
        version: 1,
        export_id: "e".into(),
        block_size: 4096,
        read_only: false,
        root_mode: 0o755,
        root_mtime_ns: 0,
        entries: vec![
            entry("repo", EntryKind::Dir),
            entry("repo/src", EntryKind::Dir),
            entry("repo/src/a.rs", EntryKind::File),
            entry("repo/README", EntryKind::File),
            entry("other.txt", EntryKind::File),
        ],
    };
    InodeTable::from_manifest(&m, 0, 0).unwrap()
}

fn ino(t: &InodeTable, path: &str) -> Ino {
    t.resolve(path).unwrap()
}

/// The token and paths of an answer; `None` for "everything".
fn split(a: &Answer) -> (String, Option<Vec<String>>) {
    match a {
        Answer::All { token } => (token.clone(), None),
        Answer::Paths { token, paths } => (
            token.clone(),
            Some(
                paths
                    .iter()
                    .map(|p| String::from_utf8(p.clone()).unwrap())
                    .collect(),
            ),
        ),
    }
}

/// A log whose entries are all older than [`SETTLE`] (so tokens reach the head).
fn settled(log: &ChangeLog) {
    let old = Instant::now() - SETTLE - Duration::from_millis(10);
    for (_, (at, _)) in log.inner.lock().log.iter_mut() {
        *at = old;
    }
}

#[test]
fn unknown_and_foreign_tokens_answer_everything() {
    let t = table();
    let log = ChangeLog::new();
    for token in ["", "builtin:fake", "awcpfs:0000:1", "awcpfs:x:y", "1234"] {
        let (tok, paths) = split(&log.answer(&t, ROOT_INO, token));
        assert!(paths.is_none(), "{token}");
        assert!(tok.starts_with("awcpfs:"), "{tok}");
    }
    // A token of another instance, even with a plausible sequence.
    let other = ChangeLog::new();
    let (tok, _) = split(&other.answer(&t, ROOT_INO, ""));
    assert!(split(&log.answer(&t, ROOT_INO, &tok)).1.is_none());
    // A sequence this instance never reached.
    let (tok, _) = split(&log.answer(&t, ROOT_INO, ""));
    let future = format!("{}:99", tok.rsplit_once(':').unwrap().0);
    assert!(split(&log.answer(&t, ROOT_INO, &future)).1.is_none());
    assert_eq!(Answer::All { token: "t".into() }.to_bytes(), b"t\0/\0");
}

#[test]
fn answers_what_changed_since_the_token_relative_to_the_directory_asked() {
    let t = table();
    let log = ChangeLog::new();
    let (t0, _) = split(&log.answer(&t, ROOT_INO, ""));
    assert_eq!(split(&log.answer(&t, ROOT_INO, &t0)).1, Some(vec![]));
    log.note_write(ino(&t, "repo/src/a.rs"));
    log.note_records(&[Record::Unlink {
        parent: ino(&t, "repo"),
        name: "gone".into(),
    }]);
    log.note_write(ino(&t, "other.txt"));
    let repo = ino(&t, "repo");
    let (_, paths) = split(&log.answer(&t, repo, &t0));
    assert_eq!(
        paths.unwrap(),
        vec!["gone".to_string(), "gone/".into(), "src/a.rs".into()]
    );
    let (_, paths) = split(&log.answer(&t, ROOT_INO, &t0));
    assert_eq!(paths.unwrap().len(), 4);
    // Nothing new since a token given after the changes settled.
    settled(&log);
    let (t1, _) = split(&log.answer(&t, repo, &t0));
    assert_eq!(split(&log.answer(&t, repo, &t1)).1, Some(vec![]));
    let bytes = log.answer(&t, repo, &t0).to_bytes();
    assert!(bytes.ends_with(b"\0gone\0gone/\0src/a.rs\0"), "{bytes:?}");
}

#[test]
fn a_change_of_the_directory_asked_about_or_above_it_is_everything() {
    let t = table();
    let log = ChangeLog::new();
    let (t0, _) = split(&log.answer(&t, ROOT_INO, ""));
    log.note_records(&[Record::Move {
        ino: ino(&t, "repo"),
        from_parent: ROOT_INO,
        from_name: "repo".into(),
        parent: ROOT_INO,
        name: "repo2".into(),
    }]);
    let src = ino(&t, "repo/src");
    assert!(split(&log.answer(&t, src, &t0)).1.is_none());
    // Seen from the root it is two names.
    let (_, paths) = split(&log.answer(&t, ROOT_INO, &t0));
    assert_eq!(
        paths.unwrap(),
        vec!["repo", "repo/", "repo2", "repo2/"]
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>()
    );
}

#[test]
fn tokens_stay_before_changes_in_flight_and_unsettled_ones() {
    let t = table();
    let log = ChangeLog::new();
    let a = ino(&t, "repo/README");
    log.note_write(a);
    settled(&log);
    let (t1, _) = split(&log.answer(&t, ROOT_INO, ""));
    assert!(t1.ends_with(":1"), "{t1}");
    let op = log.begin();
    log.note_write(a);
    settled(&log);
    // The write's operation has not answered yet: the next token does not pass it.
    let (t2, paths) = split(&log.answer(&t, ROOT_INO, &t1));
    assert_eq!(paths.unwrap(), vec!["repo/README".to_string()]);
    assert_eq!(t2, t1);
    drop(op);
    let (t3, _) = split(&log.answer(&t, ROOT_INO, &t2));
    assert!(t3.ends_with(":2"), "{t3}");
    // A change just made stays after the token for a moment.
    log.note_write(a);
    let (t4, paths) = split(&log.answer(&t, ROOT_INO, &t3));
    assert_eq!(paths.unwrap(), vec!["repo/README".to_string()]);
    assert_eq!(t4, t3);
}

#[test]
fn repeated_changes_fold_into_the_newest_and_old_tokens_expire() {
    let t = table();
    let log = ChangeLog::new();
    let (t0, _) = split(&log.answer(&t, ROOT_INO, ""));
    let a = ino(&t, "repo/README");
    for _ in 0..1000 {
        log.note_write(a);
    }
    assert_eq!(log.inner.lock().log.len(), 1);
    assert_eq!(
        split(&log.answer(&t, ROOT_INO, &t0)).1.unwrap(),
        vec!["repo/README".to_string()]
    );
    // Past the bound, the oldest entries go and a token before them is "everything".
    let names: Vec<Record> = (0..MAX_ENTRIES + 5)
        .map(|i| Record::Unlink {
            parent: ROOT_INO,
            name: format!("n{i}"),
        })
        .collect();
    log.note_records(&names);
    assert!(log.inner.lock().log.len() <= MAX_ENTRIES);
    assert!(split(&log.answer(&t, ROOT_INO, &t0)).1.is_none());
}

#[test]
fn an_answer_too_large_for_an_attribute_is_everything() {
    let t = table();
    let log = ChangeLog::new();
    let (t0, _) = split(&log.answer(&t, ROOT_INO, ""));
    let names: Vec<Record> = (0..MAX_ANSWER / 8)
        .map(|i| Record::Unlink {
            parent: ROOT_INO,
            name: format!("file-{i:06}"),
        })
        .collect();
    log.note_records(&names);
    let a = log.answer(&t, ROOT_INO, &t0);
    assert!(split(&a).1.is_none());
    assert!(a.to_bytes().len() <= MAX_ANSWER);
}

#[test]
fn an_earlier_mounts_token_is_answered_from_the_whole_log_only_when_vouched_and_caught_up() {
    let t = table();
    let earlier = ChangeLog::new();
    let (old, _) = split(&earlier.answer(&t, ROOT_INO, ""));
    let log = ChangeLog::new();
    assert_eq!(log.foreign_instance(&old), Some(earlier.instance()));
    // Its own tokens and unreadable ones are not another mount's.
    let (own, _) = split(&log.answer(&t, ROOT_INO, ""));
    assert_eq!(log.foreign_instance(&own), None);
    assert_eq!(log.foreign_instance("awcpfs:XYZ:1"), None);
    assert_eq!(log.foreign_instance("awcpfs:00ff:x"), None);
    // The export's catch-up and a change of this mount's own.
    log.note_paths(["repo/README", "gone/dir"]);
    log.note_write(ino(&t, "repo/src/a.rs"));
    // The export does not vouch for it: everything.
    log.vouch(earlier.instance(), |_| false);
    assert!(split(&log.answer(&t, ROOT_INO, &old)).1.is_none());
    // Vouched, but the catch-up is not in (the wait gives up): everything still.
    let began = Instant::now();
    let mut asked = 0;
    log.vouch(earlier.instance(), |_| {
        asked += 1;
        true
    });
    assert!(began.elapsed() >= CATCH_UP_WAIT);
    assert!(split(&log.answer(&t, ROOT_INO, &old)).1.is_none());
    // Caught up: the whole log, relative to the directory asked about; the export is not
    // asked again.
    log.mark_caught_up();
    log.vouch(earlier.instance(), |_| {
        asked += 1;
        true
    });
    assert_eq!(asked, 1);
    let (_, paths) = split(&log.answer(&t, ROOT_INO, &old));
    assert_eq!(
        paths.unwrap(),
        vec![
            "gone/dir".to_string(),
            "gone/dir/".into(),
            "repo/README".into(),
            "repo/README/".into(),
            "repo/src/a.rs".into()
        ]
    );
    let (_, paths) = split(&log.answer(&t, ino(&t, "repo"), &old));
    assert_eq!(
        paths.unwrap(),
        vec!["README".to_string(), "README/".into(), "src/a.rs".into()]
    );
    // A third instance, never vouched for: everything.
    let (third, _) = split(&ChangeLog::new().answer(&t, ROOT_INO, ""));
    assert!(split(&log.answer(&t, ROOT_INO, &third)).1.is_none());
    // Once entries were dropped for room, the log no longer reaches back to the start.
    log.inner.lock().dropped = 1;
    assert_eq!(log.foreign_instance(&old), None);
    assert!(split(&log.answer(&t, ROOT_INO, &old)).1.is_none());
}
