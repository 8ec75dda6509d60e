//! Micro-benchmarks of the pieces every delegation leans on: the manifest codec and the
//! inode table built from it (100,000 entries, as a large repository has), block hashing, the block cache, and the mount's
//! hot paths on a 20,000-file tree (a write-back round after a few changes, `lookup`, a
//! `readdir` of an unchanged directory).
//!
//! `cargo bench -p awcpfs` (criterion; reports land in `target/criterion`).

use std::hint::black_box;
use std::sync::Arc;

use awcp_protocol::dataplane::{
    ChangeSet, CommitResult, EntryKind, ExportEvent, Manifest, ManifestEntry,
};
use awcpfs::cache::{BlockCache, CacheConfig};
use awcpfs::export::manifest::hash_blocks;
use awcpfs::mount::remote::RemoteError;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

/// A manifest shaped like the benchmark repository: 8-way fan-out, ~24 files a directory.
fn manifest(files: usize) -> Manifest {
    let mut entries = Vec::with_capacity(files + files / 20);
    let mut n = 0;
    'outer: for d in 0.. {
        let dir = format!("src/mod{}/sub{}", d / 8, d % 8);
        entries.push(ManifestEntry {
            path: dir.clone(),
            kind: EntryKind::Dir,
            mode: 0o755,
            size: 0,
            mtime_ns: 1_700_000_000_000_000_000,
            hash: None,
            blocks: vec![],
            target: None,
            ino: Some(1000 + d as u64),
            ctime_ns: Some(1_700_000_000_000_000_000),
            xattrs: Default::default(),
        });
        for f in 0..24 {
            if n == files {
                break 'outer;
            }
            let h = blake3::hash(format!("{n}").as_bytes()).to_hex().to_string();
            entries.push(ManifestEntry {
                path: format!("{dir}/file_{f}.rs"),
                kind: EntryKind::File,
                mode: 0o644,
                size: 3000 + n as u64,
                mtime_ns: 1_700_000_000_000_000_000 + n as i64,
                hash: Some(h.clone()),
                blocks: vec![h],
                target: None,
                ino: Some(100_000 + n as u64),
                ctime_ns: Some(1_700_000_000_000_000_000 + n as i64),
                xattrs: Default::default(),
            });
            n += 1;
        }
    }
    Manifest {
        version: 1,
        export_id: "exp_bench".into(),
        block_size: 1 << 20,
        read_only: false,
        root_mode: 0o755,
        root_mtime_ns: 0,
        entries,
    }
}

/// [`manifest`] with every directory listed: the codec benchmarks' manifest lists leaf
/// directories only, a mount's table needs their parents.
fn tree_manifest(files: usize) -> Manifest {
    let mut m = manifest(files);
    let mut seen = std::collections::HashSet::new();
    let mut entries = Vec::with_capacity(m.entries.len() + 200);
    for e in std::mem::take(&mut m.entries) {
        for (i, _) in e.path.match_indices('/') {
            let parent = &e.path[..i];
            if seen.insert(parent.to_string()) {
                entries.push(ManifestEntry {
                    path: parent.to_string(),
                    hash: None,
                    blocks: vec![],
                    size: 0,
                    kind: EntryKind::Dir,
                    mode: 0o755,
                    ino: None,
                    ..e.clone()
                });
            }
        }
        if e.kind == EntryKind::Dir {
            seen.insert(e.path.clone());
        }
        entries.push(e);
    }
    m.entries = entries;
    m
}

fn manifest_codec(c: &mut Criterion) {
    let m = manifest(100_000);
    let binary = m.to_binary().unwrap();
    let compressed = zstd::bulk::compress(&binary, 3).unwrap();
    let json = serde_json::to_vec(&m).unwrap();
    let mut g = c.benchmark_group("manifest_100k");
    g.sample_size(10);
    g.bench_function("encode_binary", |b| {
        b.iter(|| black_box(&m).to_binary().unwrap())
    });
    g.bench_function("decode_binary", |b| {
        b.iter(|| Manifest::from_binary(black_box(&binary)).unwrap())
    });
    g.bench_function("decode_served_zstd", |b| {
        b.iter(|| awcpfs::mount::remote::decode_manifest(black_box(&compressed)).unwrap())
    });
    // The mount's start after the decode: the inode table of the whole tree.
    let tree = tree_manifest(100_000);
    g.bench_function("inode_table", |b| {
        b.iter(|| awcpfs::mount::inode::InodeTable::from_manifest(black_box(&tree), 0, 0).unwrap())
    });
    g.bench_function("encode_json", |b| {
        b.iter(|| serde_json::to_vec(black_box(&m)).unwrap())
    });
    g.bench_function("decode_json", |b| {
        b.iter(|| serde_json::from_slice::<Manifest>(black_box(&json)).unwrap())
    });
    g.finish();
    eprintln!(
        "manifest_100k sizes: json {} B, binary {} B, binary+zstd {} B",
        json.len(),
        binary.len(),
        compressed.len()
    );
}

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash_blocks");
    for size in [3 << 10, 1 << 20, 8 << 20] {
        let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &data, |b, d| {
            b.iter(|| hash_blocks(&d[..], 1 << 20).unwrap())
        });
    }
    g.finish();
}

fn cache(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = CacheConfig::new(Some(dir.path().to_path_buf()));
    cfg.memory_bytes = 0; // measure the disk tier
    let cache = BlockCache::open(&cfg).unwrap();
    let text: Vec<u8> = b"fn main() { println!(\"hello\"); }\n".repeat(2000);
    let hash = *blake3::hash(&text).as_bytes();
    cache.put(hash, Arc::from(&text[..]));
    cache.flush();
    let mut g = c.benchmark_group("block_cache");
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("disk_hit_zstd_64k", |b| {
        b.iter(|| cache.get(black_box(&hash)).unwrap())
    });
    let mem = BlockCache::open(&CacheConfig::new(None)).unwrap();
    mem.put(hash, Arc::from(&text[..]));
    g.bench_function("memory_hit_64k", |b| {
        b.iter(|| mem.get(black_box(&hash)).unwrap())
    });
    g.finish();
}

/// A remote that accepts every commit and has every block (no network in the measure).
struct AcceptAll;

impl awcpfs::mount::remote::Remote for AcceptAll {
    fn manifest(&self) -> Result<(Manifest, String), RemoteError> {
        Err(offline())
    }
    fn fetch_blocks(&self, hashes: &[String]) -> Result<Vec<Vec<u8>>, RemoteError> {
        // Content is not verified here (the real remote does that): any bytes will do.
        Ok(hashes.iter().map(|_| vec![b'x'; 3000]).collect())
    }
    fn missing(&self, _: &[String]) -> Result<Vec<String>, RemoteError> {
        Ok(Vec::new())
    }
    fn upload(&self, _: &[([u8; 32], &[u8])]) -> Result<(), RemoteError> {
        Ok(())
    }
    fn commit(&self, changes: &ChangeSet) -> Result<CommitResult, RemoteError> {
        Ok(CommitResult {
            commit_id: changes.commit_id.clone(),
            applied: changes.changes.len() as u64,
            conflicts: Vec::new(),
            seq: None,
            held: Vec::new(),
            current: None,
        })
    }
    fn renew(&self) -> Result<ExportEvent, RemoteError> {
        Err(offline())
    }
    fn events(
        &self,
    ) -> Result<Box<dyn Iterator<Item = awcpfs::mount::remote::StreamItem> + Send>, RemoteError>
    {
        Err(offline())
    }
}

fn offline() -> RemoteError {
    RemoteError::Protocol {
        what: "the benchmark has no export".into(),
    }
}

fn mount_paths(c: &mut Criterion) {
    use awcpfs::mount::content::SetAttr;
    use awcpfs::mount::fs::{AwcpFs, FsOptions};
    use awcpfs::mount::inode::{InodeTable, ROOT_INO};
    use awcpfs::mount::journal::Journal;
    use awcpfs::mount::stats::Stats;
    use awcpfs::mount::sync::{SyncSignal, Syncer};
    use std::ffi::OsStr;

    let m = tree_manifest(20_000);
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join("upper")).unwrap();
    let table = InodeTable::from_manifest(&m, 0, 0).unwrap();
    let fs = Arc::new(AwcpFs::new(
        table,
        Arc::new(AcceptAll),
        Journal::open(&tmp.path().join("journal.log")).unwrap(),
        FsOptions {
            read_only: false,
            uid: 0,
            gid: 0,
            upper_dir: tmp.path().join("upper"),
            block_size: m.block_size,
        },
        Arc::new(SyncSignal::default()),
        Arc::new(Stats::default()),
    ));
    let syncer = Syncer::new(fs.clone(), &m);
    let lookup = |path: &str| {
        path.split('/').fold(ROOT_INO, |ino, part| {
            fs.lookup(ino, OsStr::new(part)).unwrap().ino.0
        })
    };
    let files: Vec<u64> = (0..5)
        .map(|i| lookup(&format!("src/mod{i}/sub3/file_7.rs")))
        .collect();
    let dir = lookup("src/mod2/sub5");
    let mut g = c.benchmark_group("mount_20k");
    let mut flip = false;
    g.bench_function("sync_round_after_5_chmods", |b| {
        b.iter(|| {
            flip = !flip;
            for ino in &files {
                let set = SetAttr {
                    mode: Some(if flip { 0o600 } else { 0o644 }),
                    ..Default::default()
                };
                fs.setattr(*ino, set).unwrap();
            }
            black_box(syncer.round(false).unwrap());
        })
    });
    g.bench_function("sync_round_nothing_changed", |b| {
        b.iter(|| black_box(syncer.round(false).unwrap()))
    });
    g.bench_function("lookup", |b| {
        b.iter(|| black_box(fs.lookup(dir, OsStr::new("file_13.rs")).unwrap()))
    });
    // Every file once, in the manifest's order, as a `git status` after the kernel dropped
    // its dentries asks: each lookup finds a node the ones before it did not touch.
    let every: Vec<(u64, String)> = m
        .entries
        .iter()
        .filter(|e| e.kind == EntryKind::File)
        .map(|e| {
            let (dir, name) = e.path.rsplit_once('/').unwrap();
            (lookup(dir), name.to_string())
        })
        .collect();
    g.throughput(Throughput::Elements(every.len() as u64));
    g.bench_function("lookup_every_file", |b| {
        b.iter(|| {
            for (dir, name) in &every {
                black_box(fs.lookup(*dir, OsStr::new(name)).unwrap());
            }
        })
    });
    g.throughput(Throughput::Elements(1));
    // A file fetched by background hydration (its content local, never changed).
    let fetched = lookup("src/mod2/sub5/file_14.rs");
    assert_eq!(fs.prefetch(&[fetched]).unwrap(), 1);
    g.bench_function("lookup_fetched_file", |b| {
        b.iter(|| black_box(fs.lookup(dir, OsStr::new("file_14.rs")).unwrap()))
    });
    g.bench_function("readdir_unchanged_dir", |b| {
        b.iter(|| black_box(fs.listing_at(dir, 0).unwrap()))
    });
    g.finish();
}

criterion_group!(benches, manifest_codec, hashing, cache, mount_paths);
criterion_main!(benches);
