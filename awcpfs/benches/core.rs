//! Micro-benchmarks of the pieces every delegation leans on: the manifest codec (100,000
//! entries, as a large repository has), block hashing, and the block cache.
//!
//! `cargo bench -p awcpfs` (criterion; reports land in `target/criterion`).

use std::hint::black_box;
use std::sync::Arc;

use awcp_protocol::dataplane::{EntryKind, Manifest, ManifestEntry};
use awcpfs::cache::{BlockCache, CacheConfig};
use awcpfs::export::manifest::hash_blocks;
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

criterion_group!(benches, manifest_codec, hashing, cache);
criterion_main!(benches);
