//! Files a toolchain process creates are handed to the kernel with FUSE passthrough
//! (`KernelOptions::passthrough_writes`, `MountConfig::passthrough_writers`): their writes
//! go to the upper file with no request, and the mount learns of them from inotify on that
//! file (`awcpfs/src/mount/bypass.rs`). On a real mount of an in-process export, with the
//! real gcc: no `write` request for what the assembler and the linker write, and what they
//! wrote reaches the Delegator. With a writer named in the list (a thread of this test):
//! `stat` shows its size meanwhile, writes after a pause and after an `fsync` are written
//! back like the first ones, and a file unlinked while open reaches the Delegator neither.
//! Anyone else's new file is written as before, and stays open to readers meanwhile.

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use awcpfs::mount::PassthroughWriters;
use awcpfs::testing::fuse_available;

/// The name of the threads that write as a listed process.
const WRITER: &str = "ptwriter";

mod common;
use common::InProcess;

/// A mount of a tree holding `d/old.txt`, whose new files the kernel writes directly for
/// the processes `writers` names.
fn setup(writers: PassthroughWriters) -> InProcess {
    InProcess::start(
        |src| {
            std::fs::create_dir_all(src.join("d")).unwrap();
            std::fs::write(src.join("d/old.txt"), "old\n").unwrap();
        },
        |cfg| cfg.passthrough_writers = writers,
    )
}

/// Wait until the Delegator's `path` holds `want` (10 s at most).
fn await_delegator(path: &Path, want: &[u8]) {
    let start = Instant::now();
    loop {
        let now = std::fs::read(path).ok();
        if now.as_deref() == Some(want) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{} never held the {} bytes written on the mount (it holds {:?} bytes)",
            path.display(),
            want.len(),
            now.map(|n| n.len())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn content(i: usize, n: usize) -> Vec<u8> {
    (0..n).map(|k| b'a' + ((i * 7 + k) % 26) as u8).collect()
}

/// Run `f` on a thread named [`WRITER`], as a listed process would.
fn as_writer<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .name(WRITER.into())
        .spawn(f)
        .unwrap()
        .join()
        .unwrap()
}

fn listed() -> PassthroughWriters {
    PassthroughWriters::Named(vec![WRITER.into()])
}

#[test]
fn what_gcc_assembles_and_links_is_written_without_requests_and_reaches_the_delegator() {
    if !fuse_available() {
        return;
    }
    let cc = std::process::Command::new("cc").arg("--version").output();
    if cc.is_err() {
        assert!(
            std::env::var("CI").is_err(),
            "no C compiler (cc): .ci/run installs gcc"
        );
        eprintln!("SKIPPED: no C compiler (cc) on this machine");
        return;
    }
    let s = setup(PassthroughWriters::Toolchain);
    std::fs::write(
        s.mnt.join("d/hello.c"),
        "#include <stdio.h>\nint main(void) { puts(\"hello from the mount\"); return 0; }\n",
    )
    .unwrap();
    let (writes, opens) = (s.op("write"), s.mount().stats().passthrough_opens);
    let run = |args: &[&str]| {
        let out = std::process::Command::new("cc")
            .args(args)
            .current_dir(s.mnt.join("d"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cc {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["-c", "hello.c", "-o", "hello.o"]);
    run(&["hello.o", "-o", "hello"]);
    assert!(
        s.mount().stats().passthrough_opens >= opens + 2,
        "the object and the program were not handed to the kernel"
    );
    assert_eq!(
        s.op("write"),
        writes,
        "the assembler's or the linker's writes came as requests"
    );
    let out = std::process::Command::new(s.mnt.join("d/hello"))
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"hello from the mount\n");
    for f in ["hello.o", "hello"] {
        let on_mount = std::fs::read(s.mnt.join("d").join(f)).unwrap();
        assert!(!on_mount.is_empty());
        await_delegator(&s.src.join("d").join(f), &on_mount);
    }
}

#[test]
fn a_listed_writers_file_shows_its_size_and_is_written_back_after_pauses_and_fsync() {
    if !fuse_available() {
        return;
    }
    let s = setup(listed());
    let writes = s.op("write");
    let path = s.mnt.join("d/slow.txt");
    let (tx, rx) = std::sync::mpsc::channel::<&'static [u8]>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<u64>();
    let writer = {
        let path = path.clone();
        std::thread::Builder::new()
            .name(WRITER.into())
            .spawn(move || {
                let mut f = std::fs::File::create(&path).unwrap();
                for chunk in rx {
                    f.write_all(chunk).unwrap();
                    if chunk.starts_with(b"third") {
                        f.sync_all().unwrap();
                    }
                    done_tx.send(f.metadata().unwrap().size()).unwrap();
                }
            })
            .unwrap()
    };
    let mut want = Vec::new();
    for line in [&b"first line\n"[..], b"second line\n", b"third line\n"] {
        tx.send(line).unwrap();
        want.extend_from_slice(line);
        assert_eq!(done_rx.recv().unwrap(), want.len() as u64);
        // `stat` by path while the writer holds the file (as make does).
        assert_eq!(
            std::fs::metadata(&path).unwrap().size(),
            want.len() as u64,
            "stat while the writer holds the file"
        );
        // The writer pauses until the mount has written the file back.
        await_delegator(&s.src.join("d/slow.txt"), &want);
    }
    drop(tx);
    writer.join().unwrap();
    assert!(s.mount().stats().passthrough_opens >= 1);
    assert_eq!(
        s.op("write"),
        writes,
        "the listed writer's writes came as requests"
    );
    // Closed: an ordinary file again, whose next writes come as requests.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(b"fourth line\n").unwrap();
    drop(f);
    want.extend_from_slice(b"fourth line\n");
    assert!(s.op("write") > writes, "an append by someone else");
    assert_eq!(std::fs::read(&path).unwrap(), want);
    await_delegator(&s.src.join("d/slow.txt"), &want);
}

#[test]
fn a_listed_writers_file_unlinked_while_open_never_reaches_the_delegator() {
    if !fuse_available() {
        return;
    }
    let s = setup(listed());
    let path = s.mnt.join("d/tmpfile");
    let size = as_writer(move || {
        let mut f = std::fs::File::create(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        f.write_all(&content(3, 10_000)).unwrap();
        f.sync_all().unwrap();
        f.metadata().unwrap().size()
    });
    assert_eq!(size, 10_000);
    // Something to wait for: a file written after it.
    std::fs::write(s.mnt.join("d/after.txt"), "after\n").unwrap();
    await_delegator(&s.src.join("d/after.txt"), b"after\n");
    assert!(!s.src.join("d/tmpfile").exists());
    assert_eq!(std::fs::read(s.src.join("d/old.txt")).unwrap(), b"old\n");
}

#[test]
fn anyone_elses_new_file_is_written_as_before_and_stays_open_to_readers() {
    if !fuse_available() {
        return;
    }
    let s = setup(PassthroughWriters::Toolchain);
    let (writes, opens) = (s.op("write"), s.mount().stats().passthrough_opens);
    let path = s.mnt.join("d/log.txt");
    let mut w = std::fs::File::create(&path).unwrap();
    let first = content(1, 5000);
    w.write_all(&first).unwrap();
    // A log read while it is written.
    let mut r = std::fs::File::open(&path).unwrap();
    let mut got = Vec::new();
    r.read_to_end(&mut got).unwrap();
    assert_eq!(got, first);
    let more = content(2, 6000);
    w.write_all(&more).unwrap();
    let mut tail = Vec::new();
    r.read_to_end(&mut tail).unwrap();
    assert_eq!(tail, more, "the reader's next read, past where it stopped");
    drop(w);
    assert!(s.op("write") > writes);
    assert_eq!(s.mount().stats().passthrough_opens, opens);
    let mut whole = first;
    whole.extend_from_slice(&more);
    await_delegator(&s.src.join("d/log.txt"), &whole);
}

#[test]
fn the_mounts_own_changes_to_a_listed_writers_open_file_do_not_end_its_watch() {
    if !fuse_available() {
        return;
    }
    let s = setup(listed());
    let path = s.mnt.join("d/grow.bin");
    let delegator = s.src.join("d/grow.bin");
    let (tx, rx) = std::sync::mpsc::channel::<u8>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let writer = {
        let path = path.clone();
        std::thread::Builder::new()
            .name(WRITER.into())
            .spawn(move || {
                let mut f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .unwrap();
                for step in rx {
                    match step {
                        // Requests the mount answers on its own descriptor of the file.
                        0 => {
                            f.write_all(b"0123456789").unwrap();
                            f.sync_all().unwrap();
                            f.set_len(20).unwrap();
                            nix::fcntl::posix_fallocate(&f, 0, 30).unwrap();
                            f.set_modified(std::time::SystemTime::now()).unwrap();
                        }
                        // Then the kernel's writes again.
                        _ => {
                            std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)).unwrap();
                            f.write_all(b"abc").unwrap();
                        }
                    }
                    done_tx.send(()).unwrap();
                }
            })
            .unwrap()
    };
    tx.send(0).unwrap();
    done_rx.recv().unwrap();
    let mut want = b"0123456789".to_vec();
    want.resize(30, 0);
    await_delegator(&delegator, &want);
    // Still watched: the write after the mount's own changes is seen and written back.
    tx.send(1).unwrap();
    done_rx.recv().unwrap();
    want.extend_from_slice(b"abc");
    assert_eq!(std::fs::metadata(&path).unwrap().size(), 33);
    await_delegator(&delegator, &want);
    drop(tx);
    writer.join().unwrap();
    assert!(s.mount().stats().passthrough_opens >= 1);
}
