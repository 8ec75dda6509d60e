//! storm: the load generator.
//!   storm lstat ROOT DIRS FILES THREADS   -> lstat every ROOT/d<i>/f<j>, THREADS slices
//!   storm write FILE COUNT SIZE           -> COUNT pwrite()s of SIZE bytes at offset 0
//!   storm mktree ROOT DIRS FILES          -> create the same shape (100-byte files) + sink
//! Prints one line: `<mode> ... wall_us=<n> per_op_us=<x> bad=<n>`.

use std::ffi::CString;
use std::sync::{Arc, Barrier};
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    match a.get(1).map(|s| s.as_str()) {
        Some("lstat") => lstat(
            &a[2],
            a[3].parse().unwrap(),
            a[4].parse().unwrap(),
            a[5].parse().unwrap(),
        ),
        Some("write") => write(&a[2], a[3].parse().unwrap(), a[4].parse().unwrap()),
        Some("mktree") => mktree(&a[2], a[3].parse().unwrap(), a[4].parse().unwrap()),
        _ => {
            eprintln!("usage: storm lstat ROOT D F THREADS | write FILE N SIZE | mktree ROOT D F");
            std::process::exit(2);
        }
    }
}

fn lstat(root: &str, dirs: u64, files: u64, threads: usize) {
    let mut paths = Vec::with_capacity((dirs * files) as usize);
    for d in 0..dirs {
        for f in 0..files {
            paths.push(CString::new(format!("{root}/d{d}/f{f}")).unwrap());
        }
    }
    let paths = Arc::new(paths);
    let n = paths.len();
    let chunk = n.div_ceil(threads);
    let barrier = Arc::new(Barrier::new(threads + 1));
    let mut hs = Vec::new();
    for t in 0..threads {
        let paths = paths.clone();
        let barrier = barrier.clone();
        hs.push(std::thread::spawn(move || {
            let lo = (t * chunk).min(n);
            let hi = ((t + 1) * chunk).min(n);
            barrier.wait();
            let t_start = Instant::now();
            let mut bad = 0usize;
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            for p in &paths[lo..hi] {
                let r = unsafe { libc::lstat(p.as_ptr(), &mut st) };
                if r != 0 || st.st_size != 100 || (st.st_mode & libc::S_IFMT) != libc::S_IFREG {
                    bad += 1;
                }
            }
            (bad, t_start, Instant::now())
        }));
    }
    barrier.wait();
    // wall = first thread start .. last thread end (main may be descheduled on 2 CPUs)
    let res: Vec<(usize, Instant, Instant)> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let bad: usize = res.iter().map(|r| r.0).sum();
    let t0 = res.iter().map(|r| r.1).min().unwrap();
    let t1 = res.iter().map(|r| r.2).max().unwrap();
    let us = (t1 - t0).as_secs_f64() * 1e6;
    println!(
        "lstat n={n} threads={threads} wall_us={us:.0} per_op_us={:.2} bad={bad}",
        us / n as f64
    );
}

fn write(path: &str, count: usize, size: usize) {
    let p = CString::new(path).unwrap();
    let fd = unsafe { libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CREAT, 0o644) };
    assert!(fd >= 0, "open {path}: {}", std::io::Error::last_os_error());
    let buf = vec![0x5au8; size];
    let mut bad = 0usize;
    let t0 = Instant::now();
    for _ in 0..count {
        let r = unsafe { libc::pwrite(fd, buf.as_ptr() as *const _, size, 0) };
        if r != size as isize {
            bad += 1;
        }
    }
    let us = t0.elapsed().as_secs_f64() * 1e6;
    unsafe { libc::close(fd) };
    println!(
        "write n={count} size={size} wall_us={us:.0} per_op_us={:.2} bad={bad}",
        us / count as f64
    );
}

fn mktree(root: &str, dirs: u64, files: u64) {
    std::fs::create_dir_all(root).unwrap();
    let data = [0u8; 100];
    for d in 0..dirs {
        let dp = format!("{root}/d{d}");
        std::fs::create_dir_all(&dp).unwrap();
        for f in 0..files {
            std::fs::write(format!("{dp}/f{f}"), data).unwrap();
        }
    }
    std::fs::write(format!("{root}/sink"), b"").unwrap();
    println!("mktree {root} {dirs}x{files}");
}
