//! Fleet bench (`scripts/bench.sh --fleet N`): one Delegator (this process), N `awcp-ctl
//! executor` processes on loopback, one synthetic workspace, every agent reading every
//! file. Runs, side by side: one Executor alone without the block tier (the baseline), N
//! without it, N with the block tier on a cold store (`s3s-fs`, started here), N again
//! on the now warm store (a second delegation of the same workspace), and one alone on the
//! warm store. Prints a Markdown
//! table: bytes the Delegator's process sent (blocks served + objects uploaded), bytes the
//! Executors got from the store and in how many `GET`s (small blocks are packed and read by
//! range), and the time until every Executor had read everything.
//!
//! usage: awcp-fleet --executors N [--files F] [--size BYTES] [--big BYTES] [--work DIR]

use std::path::PathBuf;
use std::time::Duration;

use awcp_tests::fleet::{self, FleetReport};
use awcp_tests::s3::S3Server;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn num(args: &[String], name: &str, default: usize) -> usize {
    arg(args, name).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name} needs a number, got {v:?}"))
    })
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1 << 20) as f64)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        eprintln!(
            "usage: awcp-fleet --executors N [--files F (20000)] [--size BYTES (4096)] \
             [--big BYTES (0)] [--work DIR]\n\
             Needs root, /dev/fuse, s3s-fs on PATH and the awcp-ctl binary beside this one \
             (or AWCP_CTL_BIN)."
        );
        return;
    }
    let n = num(&args, "--executors", 4);
    let files = num(&args, "--files", 20_000);
    let size = num(&args, "--size", 4096);
    let big = num(&args, "--big", 0);
    let work = arg(&args, "--work").map(PathBuf::from);
    let tmp = tempfile::tempdir_in(work.as_deref().unwrap_or(std::path::Path::new("/var/tmp")))
        .expect("work dir");
    let bin = fleet::awcp_ctl_bin().expect("no awcp-ctl binary beside this one; set AWCP_CTL_BIN");
    if !awcp_tests::fuse_available() {
        std::process::exit(2);
    }
    let Some(s3) = S3Server::start() else {
        std::process::exit(2);
    };
    let ws = tmp.path().join("ws");
    eprintln!("fleet: making a workspace of {files} files of {size} bytes (+{big})");
    fleet::make_workspace(&ws, files, size, big);
    let mut rows: Vec<(String, FleetReport)> = Vec::new();
    let scenarios: [(&str, usize, Option<&str>); 5] = [
        ("1 Executor, no block tier", 1, None),
        ("N Executors, no block tier", n, None),
        ("N Executors, block tier (cold store)", n, Some("bench")),
        (
            "N Executors, block tier (warm store: a second delegation)",
            n,
            Some("bench"),
        ),
        ("1 Executor, block tier (warm store)", 1, Some("bench")),
    ];
    for (i, (name, count, prefix)) in scenarios.into_iter().enumerate() {
        eprintln!("fleet: {name} ({count})");
        let daemon = fleet::start_delegator(
            &tmp.path().join(format!("delegator-{i}")),
            prefix.map(|p| (&s3, p)),
            Duration::from_secs(10),
        )
        .await;
        let run = tmp.path().join(format!("run-{i}"));
        let r = fleet::run(&daemon, &bin, &run, &ws, count).await;
        daemon.stop().await;
        let _ = std::fs::remove_dir_all(&run);
        rows.push((name.replace('N', &n.to_string()), r));
    }
    let alone = rows[0].1.all_hydrated.as_secs_f64();
    let size_total = rows[0].1.workspace_bytes;
    println!(
        "\n### Fleet: {n} Executors, {files} files, {} MiB\n",
        mib(size_total)
    );
    println!(
        "| run | Delegator sent (MiB) | × workspace | served by export | uploaded to store | from store (MiB) | store GETs / blocks | store refused | all hydrated (s) | × one alone |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (name, r) in &rows {
        println!(
            "| {name} | {} | {:.2} | {} | {} | {} | {} / {} | {} | {:.2} | {:.2} |",
            mib(r.delegator_total()),
            r.delegator_total() as f64 / size_total.max(1) as f64,
            mib(r.delegator_served),
            mib(r.delegator_uploaded),
            mib(r.from_store),
            r.store_requests,
            r.blocks_from_store,
            r.store_refused,
            r.all_hydrated.as_secs_f64(),
            r.all_hydrated.as_secs_f64() / alone.max(1e-9)
        );
    }
}
