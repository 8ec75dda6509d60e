//! Manifest builds reuse the hashes of unchanged files, and only those.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use awcp_lease::{Lease, LeaseTerms, ManualClock};
use awcp_protocol::dataplane::{EntryKind, Manifest};
use awcpfs::export::hashcache::HashCache;
use awcpfs::export::{ExportConfig, ExportRegistry};

const BLOCK: u32 = 8;

fn register(registry: &ExportRegistry, id: &str, root: &Path, staging: &Path) -> Manifest {
    let lease = Arc::new(Lease::grant(
        Arc::new(ManualClock::new()),
        LeaseTerms {
            ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(600),
            flush_grace: Duration::from_secs(5),
        },
    ));
    let export = registry
        .register(
            id.into(),
            "token".into(),
            ExportConfig {
                root: root.to_owned(),
                read_only: false,
                block_size: BLOCK,
                staging_dir: staging.join(id),
            },
            lease,
        )
        .unwrap();
    export.manifest().clone()
}

/// The manifest an uncached build gives, for comparison.
fn fresh(root: &Path, staging: &Path, id: &str) -> Manifest {
    register(&ExportRegistry::new(), id, root, staging)
}

fn content_of(m: &Manifest) -> Vec<(String, u64, Option<String>, Vec<String>)> {
    m.entries
        .iter()
        .filter(|e| e.kind == EntryKind::File)
        .map(|e| (e.path.clone(), e.size, e.hash.clone(), e.blocks.clone()))
        .collect()
}

#[test]
fn unchanged_files_are_not_hashed_again_and_changed_ones_are() {
    let root = tempfile::tempdir().unwrap();
    let staging = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let r = root.path();
    std::fs::create_dir(r.join("src")).unwrap();
    std::fs::write(r.join("src/a.txt"), "alpha alpha alpha").unwrap();
    std::fs::write(r.join("b.txt"), "bravo").unwrap();
    std::fs::write(r.join("empty"), "").unwrap();
    std::fs::write(r.join("multi.bin"), vec![7u8; 8 * 5 + 3]).unwrap();
    let path = state.path().join("hashes.bin");
    let cache = Arc::new(HashCache::open(&path).with_racy_window(Duration::ZERO));
    let registry = ExportRegistry::with_hash_cache(cache.clone());

    let first = register(&registry, "exp_one", r, staging.path());
    assert_eq!(cache.hits_and_misses(), (0, 4));
    assert_eq!(
        content_of(&first),
        content_of(&fresh(r, staging.path(), "exp_f1"))
    );

    let second = register(&registry, "exp_two", r, staging.path());
    assert_eq!(
        cache.hits_and_misses(),
        (4, 4),
        "every file came from the cache"
    );
    assert_eq!(content_of(&second), content_of(&first));

    // Same size, new content: ctime and mtime give it away.
    std::fs::write(r.join("b.txt"), "BRAVO").unwrap();
    let third = register(&registry, "exp_three", r, staging.path());
    assert_eq!(cache.hits_and_misses(), (7, 5));
    let want = content_of(&fresh(r, staging.path(), "exp_f2"));
    assert_eq!(content_of(&third), want);
    let b = third.entries.iter().find(|e| e.path == "b.txt").unwrap();
    assert_eq!(
        b.hash.as_deref(),
        Some(blake3::hash(b"BRAVO").to_hex().as_str())
    );

    // The cache survives a restart.
    cache.save().unwrap();
    let reloaded = Arc::new(HashCache::open(&path));
    assert_eq!(reloaded.len(), 4);
    let registry = ExportRegistry::with_hash_cache(reloaded.clone());
    let fourth = register(&registry, "exp_four", r, staging.path());
    assert_eq!(reloaded.hits_and_misses(), (4, 0));
    assert_eq!(content_of(&fourth), want);
}

#[test]
fn files_changed_moments_ago_are_not_remembered() {
    let root = tempfile::tempdir().unwrap();
    let staging = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("hot.txt"), "just written").unwrap();
    // The default window: a file written this instant may change again within the same
    // timestamp tick, so it is hashed every time.
    let cache = Arc::new(HashCache::in_memory());
    let registry = ExportRegistry::with_hash_cache(cache.clone());
    register(&registry, "exp_a", root.path(), staging.path());
    register(&registry, "exp_b", root.path(), staging.path());
    assert_eq!(cache.hits_and_misses(), (0, 2));
    assert!(cache.is_empty());
}

#[test]
fn attributes_come_with_cached_hashes_and_a_change_of_one_is_seen() {
    let root = tempfile::tempdir().unwrap();
    let staging = tempfile::tempdir().unwrap();
    let r = root.path();
    std::fs::write(r.join("f"), "x").unwrap();
    let set = |v: &[u8]| {
        rustix::fs::setxattr(r.join("f"), "user.tag", v, rustix::fs::XattrFlags::empty()).unwrap()
    };
    set(b"one");
    let cache = Arc::new(HashCache::in_memory().with_racy_window(Duration::ZERO));
    let registry = ExportRegistry::with_hash_cache(cache.clone());
    let tag = |m: &Manifest| m.entries[0].xattrs.get("user.tag").cloned();
    let first = register(&registry, "exp_one", r, staging.path());
    assert_eq!(tag(&first).as_deref(), Some("6f6e65"));
    let second = register(&registry, "exp_two", r, staging.path());
    assert_eq!(cache.hits_and_misses().0, 1, "from the cache");
    assert_eq!(tag(&second).as_deref(), Some("6f6e65"));
    // Setting an attribute changes the ctime: the cached entry no longer applies.
    set(b"two");
    let third = register(&registry, "exp_three", r, staging.path());
    assert_eq!(tag(&third).as_deref(), Some("74776f"));
}
