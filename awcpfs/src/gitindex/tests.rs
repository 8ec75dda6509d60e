//! The index reader and writer against real git: every index version, both object formats,
//! `index.skipHash`; git must read what [`with_fsmonitor`] writes and trust exactly the
//! entries left clean.

use super::*;
use std::path::Path;
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .current_dir(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("HOME", dir)
        .output()
        .expect("running git");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A repository with `n` committed files in a few directories, one of them executable and a
/// symlink, its index at `version`.
fn repo(dir: &Path, init: &[&str], version: u32, n: usize) {
    let mut args = vec!["init", "-q"];
    args.extend_from_slice(init);
    git(dir, &args);
    for i in 0..n {
        let d = dir.join(format!("d{}/sub{}", i % 7, i % 3));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(format!("file-{i:04}.txt")), format!("content {i}\n")).unwrap();
    }
    std::fs::write(dir.join("run.sh"), "#!/bin/sh\n").unwrap();
    let exec = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(dir.join("run.sh"), exec).unwrap();
    std::os::unix::fs::symlink("run.sh", dir.join("link")).unwrap();
    git(dir, &["add", "-A"]);
    git(dir, &["commit", "-qm", "files"]);
    if version == 3 {
        // git writes version 3 only when an entry needs its extended flags.
        std::fs::write(dir.join("ita.txt"), "later\n").unwrap();
        git(dir, &["add", "-N", "ita.txt"]);
    }
    git(
        dir,
        &["update-index", "--index-version", &version.to_string()],
    );
}

/// What `git ls-files -f` says with a monitor whose hook reports nothing changed: per path,
/// whether git trusts the entry (a lowercase tag).
fn trusted(dir: &Path) -> Vec<(String, bool)> {
    let quiet = hook(dir, "quiet.sh", "next\\0");
    let out = git_monitored(dir, &quiet, &["ls-files", "-f"]);
    out.lines()
        .map(|l| {
            let (tag, path) = l.split_once(' ').unwrap();
            (
                path.to_string(),
                tag.chars().all(|c| c.is_ascii_lowercase()),
            )
        })
        .collect()
}

/// An executable fsmonitor hook `.git/<name>` that prints `output` (`printf` syntax).
fn hook(dir: &Path, name: &str, output: &str) -> std::path::PathBuf {
    let hook = dir.join(".git").join(name);
    std::fs::write(&hook, format!("#!/bin/sh\nprintf '{output}'\n")).unwrap();
    let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(&hook, mode).unwrap();
    hook
}

/// git with `hook` as its monitor (protocol version 2) and the untracked cache on.
fn git_monitored(dir: &Path, hook: &Path, args: &[&str]) -> String {
    let monitor = format!("core.fsmonitor={}", hook.display());
    let mut all = vec![
        "-c",
        &monitor,
        "-c",
        "core.fsmonitorHookVersion=2",
        "-c",
        "core.untrackedCache=true",
    ];
    all.extend_from_slice(args);
    git(dir, &all)
}

fn check(init: &[&str], version: u32, extra_config: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    repo(dir, init, version, 150);
    if !extra_config.is_empty() {
        let mut args = extra_config.to_vec();
        // Rewrite the index under the setting.
        args.extend(["update-index", "--force-write-index"]);
        git(dir, &args);
    }
    let path = dir.join(".git/index");
    // Under the same setting: git may write the index while it looks.
    let mut args = extra_config.to_vec();
    args.extend(["status", "--porcelain"]);
    let status = git(dir, &args);
    let data = std::fs::read(&path).unwrap();
    let index = parse(&data).unwrap();
    assert_eq!(index.version, version);
    assert_eq!(
        index.skip_hash,
        extra_config.contains(&"index.skipHash=true")
    );
    let listed = git(dir, &["ls-files", "-z"]);
    let paths: Vec<&[u8]> = listed
        .as_bytes()
        .split(|&b| b == 0)
        .filter(|p| !p.is_empty())
        .collect();
    let ours: Vec<&[u8]> = index.entries.iter().map(|e| index.path(e)).collect();
    assert_eq!(ours, paths, "entries and their order");
    let run = index
        .entries
        .iter()
        .find(|e| index.path(e) == b"run.sh")
        .unwrap();
    assert_eq!(run.mode, 0o100755);
    let link = index
        .entries
        .iter()
        .find(|e| index.path(e) == b"link")
        .unwrap();
    assert_eq!(link.mode, 0o120000);
    let meta = std::fs::metadata(dir.join("d0/sub0/file-0000.txt")).unwrap();
    let e0 = index
        .entries
        .iter()
        .find(|e| index.path(e) == b"d0/sub0/file-0000.txt")
        .unwrap();
    assert_eq!(e0.size as u64, meta.len());
    assert_eq!(
        e0.mtime.0 as i64,
        std::os::unix::fs::MetadataExt::mtime(&meta)
    );

    // Every third entry dirty.
    let primed = with_fsmonitor(&data, &index, "awcpfs:test:1", |i| i % 3 == 0, None);
    std::fs::write(&path, &primed).unwrap();
    let again = parse(&primed).unwrap();
    assert_eq!(again.fsmonitor_token(&primed), Some("awcpfs:test:1"));
    assert_eq!(again.entries, index.entries);
    let seen = trusted(dir);
    assert_eq!(seen.len(), index.entries.len());
    for (i, (p, trust)) in seen.iter().enumerate() {
        assert_eq!(p.as_bytes(), index.path(&index.entries[i]));
        assert_eq!(*trust, i % 3 != 0, "{p}: trusted {trust}");
    }
    if version == 3 {
        let ita = index.entries.iter().find(|e| index.path(e) == b"ita.txt");
        assert!(ita.unwrap().special, "intent-to-add is git's to look at");
    }
    // git reads it as the same index.
    assert_eq!(git(dir, &["status", "--porcelain"]), status);
}

#[test]
fn git_reads_the_monitor_extension_written_into_each_version() {
    for v in [2, 3, 4] {
        check(&[], v, &[]);
    }
}

#[test]
fn sha256_repositories_are_read_and_checksummed_with_their_hash() {
    check(&["--object-format=sha256"], 2, &[]);
    check(&["--object-format=sha256"], 4, &[]);
}

#[test]
fn an_index_without_a_checksum_stays_without_one() {
    check(&[], 2, &["-c", "index.skipHash=true"]);
}

#[test]
fn the_untracked_cache_and_an_old_monitor_extension_are_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    repo(dir, &[], 2, 20);
    let old = hook(dir, "old.sh", "old-token\\0/\\0");
    git_monitored(dir, &old, &["status", "--porcelain"]);
    let data = std::fs::read(dir.join(".git/index")).unwrap();
    let index = parse(&data).unwrap();
    let sigs: Vec<&[u8; 4]> = index.extensions.iter().map(|(s, _)| s).collect();
    assert!(
        sigs.contains(&b"UNTR") && sigs.contains(&b"FSMN"),
        "{sigs:?}"
    );
    assert_eq!(index.fsmonitor_token(&data), Some("old-token"));
    let primed = with_fsmonitor(&data, &index, "new", |_| false, None);
    let again = parse(&primed).unwrap();
    let sigs: Vec<&[u8; 4]> = again.extensions.iter().map(|(s, _)| s).collect();
    assert!(!sigs.contains(&b"UNTR"), "{sigs:?}");
    assert_eq!(sigs.iter().filter(|s| **s == b"FSMN").count(), 1);
    assert_eq!(again.fsmonitor_token(&primed), Some("new"));
    std::fs::write(dir.join(".git/index"), &primed).unwrap();
    assert!(trusted(dir).iter().all(|(_, t)| *t));
}

#[test]
fn a_damaged_index_is_refused_not_misread() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    repo(dir, &[], 2, 10);
    let data = std::fs::read(dir.join(".git/index")).unwrap();
    assert!(parse(&data).is_ok());
    assert_eq!(parse(b"nonsense").unwrap_err(), IndexError::NotIndex);
    let mut flipped = data.clone();
    flipped[100] ^= 1;
    assert_eq!(parse(&flipped).unwrap_err(), IndexError::Checksum);
    // Every truncation: an error, never a panic.
    for cut in 0..data.len() {
        assert!(parse(&data[..cut]).is_err());
    }
}

#[test]
fn the_bitmap_is_git_s_ewah() {
    // No bit: one empty run-length word.
    assert_eq!(
        ewah(&[]),
        [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    let b = ewah(&[0, 64, 65]);
    assert_eq!(&b[..4], &66u32.to_be_bytes());
    assert_eq!(&b[4..8], &3u32.to_be_bytes());
    assert_eq!(&b[8..16], &(2u64 << 33).to_be_bytes());
    assert_eq!(&b[16..24], &1u64.to_be_bytes());
    assert_eq!(&b[24..32], &3u64.to_be_bytes());
}

proptest::proptest! {
    #[test]
    fn random_bytes_after_a_header_never_panic(tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600), v in 2u32..5, n in 0u32..8) {
        let mut data = b"DIRC".to_vec();
        data.extend_from_slice(&v.to_be_bytes());
        data.extend_from_slice(&n.to_be_bytes());
        data.extend_from_slice(&tail);
        let body_len = data.len();
        let _ = parse(&data);
        // With a valid checksum the body itself is parsed.
        let sum = checksum(&data[..body_len], 20);
        data.extend_from_slice(&sum);
        let _ = parse(&data);
    }
}

/// The untracked cache git wrote under a monitor, rewritten: git trusts the listing of
/// every directory kept valid without reading it (so a file created there since is not
/// seen: the caller must keep only directories it knows unchanged), and reads again the
/// one marked invalid.
#[test]
fn the_untracked_cache_is_trusted_where_kept_and_read_again_where_not() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = &std::fs::canonicalize(tmp.path()).unwrap();
    repo(dir, &[], 2, 30);
    std::fs::write(dir.join("d1/sub1/u1.txt"), "u\n").unwrap();
    std::fs::write(dir.join("d2/sub2/u2.txt"), "u\n").unwrap();
    let everything = hook(dir, "everything.sh", "first\\0/\\0");
    let monitored = |hook: &Path| git_monitored(dir, hook, &["status", "--porcelain"]);
    // Twice: the first run adds the cache, the second fills it.
    monitored(&everything);
    let before = monitored(&everything);
    assert!(before.contains("?? d1/sub1/u1.txt"), "{before}");
    let data = std::fs::read(dir.join(".git/index")).unwrap();
    let index = parse(&data).unwrap();
    let body = index
        .untracked(&data)
        .expect("git wrote an untracked cache");
    // A file created since, which the monitor below will not report.
    std::fs::write(dir.join("d1/sub1/new.txt"), "n\n").unwrap();
    let quiet = hook(dir, "quiet.sh", "next\\0");
    let ident = format!("Location {}, system Linux", dir.display());
    let mut seen = Vec::new();
    for stale in [None, Some(&b"d1/sub1/"[..])] {
        let rewritten = rewrite_untracked(body, index.hash_len, &ident, |path, _| {
            seen.push(path.to_vec());
            Some(path) != stale
        })
        .unwrap();
        let primed = with_fsmonitor(&data, &index, "t", |_| false, Some(&rewritten));
        assert!(parse(&primed).unwrap().untracked(&primed).is_some());
        std::fs::write(dir.join(".git/index"), &primed).unwrap();
        let status = monitored(&quiet);
        assert!(status.contains("?? d1/sub1/u1.txt"), "{status}");
        assert!(status.contains("?? d2/sub2/u2.txt"), "{status}");
        assert_eq!(
            status.contains("?? d1/sub1/new.txt"),
            stale.is_some(),
            "directories marked invalid {stale:?}: {status}"
        );
    }
    // The root and its subdirectories, by path.
    assert!(seen.contains(&b"".to_vec()) && seen.contains(&b"d1/sub1/".to_vec()));
}

#[test]
fn a_bitmap_claiming_more_bits_than_it_maps_is_refused() {
    // Four billion bits in one run-length word: refused before anything is allocated.
    let mut b = u32::MAX.to_be_bytes().to_vec();
    b.extend_from_slice(&1u32.to_be_bytes());
    b.extend_from_slice(&((u64::from(u32::MAX) << 1) | 1).to_be_bytes());
    b.extend_from_slice(&0u32.to_be_bytes());
    assert!(ewah_bits(&b, 1000).is_err());
    assert_eq!(ewah_bits(&ewah(&[3, 999]), 1000).unwrap().0, [3, 999]);
}

#[test]
fn varints_are_git_s() {
    for v in [
        0usize,
        1,
        127,
        128,
        255,
        16511,
        16512,
        1 << 20,
        u32::MAX as usize,
    ] {
        let mut out = Vec::new();
        put_varint(&mut out, v);
        let mut at = 0;
        assert_eq!(varint(&out, &mut at).unwrap(), v);
        assert_eq!(at, out.len());
    }
    let mut out = Vec::new();
    put_varint(&mut out, 128);
    assert_eq!(out, [0x80, 0x00]);
}

proptest::proptest! {
    #[test]
    fn ewah_bitmaps_read_back(mut bits in proptest::collection::vec(0usize..2000, 0..100)) {
        bits.sort_unstable();
        bits.dedup();
        let enc = ewah(&bits);
        let (back, used) = ewah_bits(&enc, 2000).unwrap();
        proptest::prop_assert_eq!(back, bits);
        proptest::prop_assert_eq!(used, enc.len());
    }

    #[test]
    fn random_untracked_caches_never_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
        let _ = rewrite_untracked(&body, 20, "x", |_, _| true);
    }
}
