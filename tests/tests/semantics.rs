//! POSIX semantics on the mount compared with a native directory: the same operation
//! sequence (`semantics_ops.py`: hard links, rename flags, open files losing their name,
//! open flags, sparse and >4 GiB files, fallocate, utimens, chmod/chown, xattrs, locks,
//! mmap, statfs, long and non-UTF-8 names, deep paths, link counts, st_ino) runs on both,
//! and every result must match except the differences `docs/SEMANTICS.md` documents. Then
//! the write-back is checked at the Delegator. A second test does the same for special
//! files, ownership and over-long names (`semantics_posix_ops.py`); a third lists a
//! 100,000-entry directory while it changes.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available, sh, tools_available};

const TASK_TIMEOUT: Duration = Duration::from_secs(300);

/// Checks whose result on the mount differs from a native directory, on purpose, with the
/// result the mount gives (see docs/SEMANTICS.md).
const DOCUMENTED_DIFFERENCES: &[(&str, &str)] = &[
    // No O_TMPFILE (EOPNOTSUPP, which Python names ENOTSUP): the kernel answers for FUSE.
    ("o_tmpfile", "ENOTSUP"),
    // The mount is `nodev`: a device node is made and listed, but not opened.
    ("open.char_device", "EACCES"),
];

fn results(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn operations_on_the_mount_match_a_native_directory() {
    operations_match(false, false).await;
}

/// The same with the kernel's writeback cache, which keeps written files' sizes and times
/// in the kernel and sends their data later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wbcache_operations_match_a_native_directory_with_the_writeback_cache() {
    operations_match(false, true).await;
}

/// The same with FUSE passthrough for read-only opens, where the kernel reads the local
/// copy itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn operations_match_a_native_directory_with_passthrough() {
    operations_match(true, false).await;
}

async fn operations_match(passthrough: bool, writeback_cache: bool) {
    if !fuse_available() || !tools_available(&["python3"]) {
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/semantics_ops.py");
    let agent = format!(
        "python3 {s} . > ../../../mount.out 2>&1; python3 {s} ../../../native > ../../../native.out 2>&1",
        s = script.display()
    );
    // Some checks act as another user (a non-owner's write clearing set-user-ID): the
    // default mount access serves them, as a native directory does, since the Executor's
    // 0700 work directory keeps every other user out.
    // The sequence also acts as root does (chown, set-ID bits, device nodes): the agent
    // runs as root here, still under Landlock.
    let h = Harness::start_with(&agent, |c| {
        c.passthrough = passthrough;
        c.writeback_cache = writeback_cache;
        c.unsafe_agent_as_root = true;
    })
    .await;
    let repo = h.path("repo");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::write(repo.join("README"), "semantics\n").unwrap();
    std::fs::create_dir_all(h.path("native")).unwrap();
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let state = h.wait_end(&id, TASK_TIMEOUT).await;
    let mount_out = std::fs::read_to_string(h.path("mount.out")).unwrap_or_default();
    let native_out = std::fs::read_to_string(h.path("native.out")).unwrap_or_default();
    assert_eq!(
        state,
        DelegationState::Completed,
        "{mount_out}\n{:?}",
        h.client.get(&id).await.map(|v| v.record.error)
    );
    let status: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(h.path(&format!("executor/state/{id}/status.json"))).unwrap(),
    )
    .unwrap();
    let pt_opens = status["stats"]["passthroughOpens"].as_u64().unwrap();
    assert_eq!(pt_opens > 0, passthrough, "passthrough opens: {pt_opens}");
    let (on_mount, native) = (results(&mount_out), results(&native_out));
    assert_eq!(
        native.get("done").map(String::as_str),
        Some("True"),
        "the sequence did not finish natively:\n{native_out}"
    );
    assert_eq!(
        on_mount.get("done").map(String::as_str),
        Some("True"),
        "the sequence did not finish on the mount:\n{mount_out}"
    );
    let mut unexpected = Vec::new();
    for (k, native_v) in &native {
        let mount_v = on_mount.get(k).map(String::as_str).unwrap_or("<missing>");
        match DOCUMENTED_DIFFERENCES.iter().find(|(name, _)| name == k) {
            Some((_, want)) if mount_v != *want => {
                unexpected.push(format!("{k}: mount {mount_v}, documented {want}"));
            }
            Some(_) => {}
            None if mount_v != native_v => {
                unexpected.push(format!("{k}: mount {mount_v}, native {native_v}"));
            }
            None => {}
        }
    }
    assert!(
        unexpected.is_empty(),
        "the mount differs from a native directory:\n{}\n\nmount:\n{mount_out}",
        unexpected.join("\n")
    );

    // What reached the Delegator.
    let links = repo.join("links");
    let (b, d) = (
        std::fs::metadata(links.join("b")).unwrap(),
        std::fs::metadata(links.join("d")).unwrap(),
    );
    assert_eq!(b.ino(), d.ino(), "hard links arrive as hard links");
    assert_eq!(std::fs::read(links.join("d")).unwrap(), b"one\ntwo\n");
    let (k1, k2) = (
        std::fs::metadata(links.join("keep")).unwrap(),
        std::fs::metadata(links.join("keep2")).unwrap(),
    );
    assert_eq!((k1.ino(), k1.nlink()), (k2.ino(), 2));
    assert!(!links.join("a").exists());
    let mapped = std::fs::read(repo.join("mapped")).unwrap();
    assert_eq!(
        (&mapped[0..5], &mapped[4096..4101]),
        (&b"hello"[..], &b"world"[..])
    );
    let big = std::fs::metadata(repo.join("big")).unwrap();
    assert_eq!(big.len(), (4 << 30) + 13);
    assert!(
        big.blocks() * 512 < 64 << 20,
        "a sparse file must stay sparse at the Delegator ({} blocks)",
        big.blocks()
    );
    let tail = sh(&repo, "tail -c 10 big");
    assert_eq!(tail, "past 4 GiB");
    let falloc = std::fs::read(repo.join("falloc")).unwrap();
    assert_eq!(falloc.len(), 1 << 20);
    assert!(falloc[..4096].iter().all(|b| *b == 0) && falloc[4096..4106] == [0u8; 10]);
    // utimens to the nanosecond, written back although the content did not change.
    let times = std::fs::metadata(repo.join("times")).unwrap();
    assert_eq!(
        (times.mtime(), times.mtime_nsec()),
        (1_000_000_000, 2),
        "mtime at the Delegator"
    );
    assert_eq!(times.mode() & 0o7777, 0o600);
    // user.* attributes arrive: the binary one set, the removed one gone.
    let xattrs = sh(
        &repo,
        "python3 -c \"import os; print(sorted(os.listxattr('xa')), os.getxattr('xa', 'user.bin') == bytes(range(256)))\"",
    );
    assert_eq!(xattrs, "['user.bin'] True\n");
    let long = "é".repeat(127) + "a";
    assert_eq!(std::fs::read(repo.join(&long)).unwrap(), b"long");
    // Names that are not UTF-8 arrive with their exact bytes.
    use std::os::unix::ffi::OsStrExt;
    let raw = |n: &[u8]| repo.join(std::ffi::OsStr::from_bytes(n));
    assert_eq!(std::fs::read(raw(b"bad\xff\xfename")).unwrap(), b"latin");
    assert_eq!(std::fs::read(raw(&[0xff; 255])).unwrap(), b"ff");
    assert!(!repo.join("open/gone").exists());
    assert_eq!(
        std::fs::read(repo.join("open/victim")).unwrap(),
        b"new content"
    );
    // Deep paths (over PATH_MAX in total) arrive too.
    let deep = sh(
        &repo,
        "python3 -c \"import os\nfd=os.open('.',os.O_RDONLY)\nfor i in range(40): fd=os.open(f'{i:03d}'+'d'*117, os.O_RDONLY, dir_fd=fd)\nprint(open(os.open('leaf', os.O_RDONLY, dir_fd=fd),'rb').read().decode())\"",
    );
    assert_eq!(deep, "deep\n");
    h.stop().await;
}

/// FIFOs between processes, Unix sockets, device nodes, ownership by the creating process
/// (chmod/chown rules, set-ID clearing, set-group-ID and sticky directories), and
/// `ENAMETOOLONG` for every path operation, compared with a native directory
/// (`semantics_posix_ops.py`; pjdfstest in `awcpfs/tests/posix_suites.rs` goes further).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn special_files_owners_and_long_names_match_a_native_directory() {
    if !fuse_available() || !tools_available(&["python3"]) {
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/semantics_posix_ops.py");
    let agent = format!(
        "python3 {s} . > ../../../mount.out 2>&1; python3 {s} ../../../native > ../../../native.out 2>&1",
        s = script.display()
    );
    // The script acts as other users on the mount too (chown/chmod rules, sticky
    // directories), from its working directory there: the default mount access serves
    // them by the files' modes, as a native directory would.
    // Acting as other users and making device nodes needs root: the agent runs as root
    // here, still under Landlock.
    let h = Harness::start_with(&agent, |c| c.unsafe_agent_as_root = true).await;
    let repo = h.path("repo");
    std::fs::create_dir_all(&repo).unwrap();
    // A Delegator file that the mount replaces with a FIFO.
    std::fs::write(repo.join("delegators"), "replaced on the mount\n").unwrap();
    std::fs::create_dir_all(h.path("native")).unwrap();
    std::fs::write(h.path("native/delegators"), "replaced on the mount\n").unwrap();
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let state = h.wait_end(&id, TASK_TIMEOUT).await;
    let mount_out = std::fs::read_to_string(h.path("mount.out")).unwrap_or_default();
    let native_out = std::fs::read_to_string(h.path("native.out")).unwrap_or_default();
    assert_eq!(
        state,
        DelegationState::Completed,
        "{mount_out}\n{:?}",
        h.client.get(&id).await.map(|v| v.record.error)
    );
    let (on_mount, native) = (results(&mount_out), results(&native_out));
    assert_eq!(
        native.get("done").map(String::as_str),
        Some("True"),
        "{native_out}"
    );
    assert_eq!(
        on_mount.get("done").map(String::as_str),
        Some("True"),
        "{mount_out}"
    );
    let mut unexpected = Vec::new();
    for (k, native_v) in &native {
        let mount_v = on_mount.get(k).map(String::as_str).unwrap_or("<missing>");
        match DOCUMENTED_DIFFERENCES.iter().find(|(name, _)| name == k) {
            Some((_, want)) if mount_v != *want => {
                unexpected.push(format!("{k}: mount {mount_v}, documented {want}"));
            }
            Some(_) => {}
            None if mount_v != native_v => {
                unexpected.push(format!("{k}: mount {mount_v}, native {native_v}"));
            }
            None => {}
        }
    }
    assert!(
        unexpected.is_empty(),
        "the mount differs from a native directory:\n{}\n\nmount:\n{mount_out}",
        unexpected.join("\n")
    );
    // FIFOs, sockets and device nodes live only on the mount: none reaches the Delegator,
    // and the Delegator's file that a FIFO replaced is gone there.
    for special in [
        "fifo",
        "fifo3",
        "cdev",
        "bdev",
        "was_file",
        "own/p",
        "rmd",
        "delegators",
    ] {
        assert!(
            std::fs::symlink_metadata(repo.join(special)).is_err(),
            "{special} must not reach the Delegator"
        );
    }
    // Owners stay on the Executor; what agents made reaches the Delegator with its content
    // and its mode less set-user-ID and set-group-ID.
    assert_eq!(std::fs::read(repo.join("own/f")).unwrap(), b"mine");
    let sg = std::fs::metadata(repo.join("own/sg/d")).unwrap();
    assert_eq!(sg.mode() & 0o7777, 0o755);
    assert!(repo.join("own/st/roots").exists() && !repo.join("own/st/mine").exists());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_100000_entry_directory_lists_stably_while_it_changes() {
    if !fuse_available() || !tools_available(&["python3"]) {
        return;
    }
    // 100,000 entries on the Delegator (from the manifest) and 2,000 created on the mount;
    // while one reader walks the listing in small steps, another process creates and
    // removes entries. Every entry present throughout must be listed exactly once.
    let agent = r#"python3 - > ../../../listing.out 2>&1 <<'PY'
import os, subprocess, sys, time
for i in range(2000):
    open(f"big/new-{i:05d}", "w").close()
churn = subprocess.Popen([sys.executable, "-c", """
import os
for i in range(3000):
    p = f'big/churn-{i:05d}'
    open(p, 'w').close()
    if i % 2:
        os.unlink(p)
    if i < 1000:
        os.unlink(f'big/new-{i:05d}')
"""])
seen = []
fd = os.open("big", os.O_RDONLY | os.O_DIRECTORY)
with os.scandir(fd) as it:
    for e in it:
        seen.append(e.name)
        if len(seen) % 1000 == 0:
            time.sleep(0.01)
churn.wait()
stable = [n for n in seen if n.startswith("f-") or (n.startswith("new-") and int(n[4:]) >= 1000)]
print("entries", len(set(n for n in seen if n.startswith("f-"))))
print("stable_new", len(set(n for n in stable if n.startswith("new-"))))
print("duplicates", len(seen) - len(set(seen)))
print("count_after", len(os.listdir("big")))
st = os.stat("big")
print("nlink", st.st_nlink)
PY"#;
    let h = Harness::start(agent).await;
    let repo = h.path("repo");
    let big = repo.join("big");
    std::fs::create_dir_all(&big).unwrap();
    for i in 0..100_000 {
        std::fs::File::create(big.join(format!("f-{i:06}"))).unwrap();
    }
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let state = h.wait_end(&id, TASK_TIMEOUT).await;
    let out = std::fs::read_to_string(h.path("listing.out")).unwrap_or_default();
    assert_eq!(
        state,
        DelegationState::Completed,
        "{out}\n{:?}",
        h.client.get(&id).await.map(|v| v.record)
    );
    let r: BTreeMap<&str, u64> = out
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
        .collect();
    assert_eq!(r.get("entries"), Some(&100_000), "{out}");
    assert_eq!(r.get("stable_new"), Some(&1000), "{out}");
    assert_eq!(r.get("duplicates"), Some(&0), "{out}");
    // 100,000 + new-01000..01999 + 1,500 churn files kept.
    assert_eq!(r.get("count_after"), Some(&102_500), "{out}");
    assert_eq!(r.get("nlink"), Some(&2), "{out}");
    // And the Delegator has the same directory.
    assert!(
        eventually(Duration::from_secs(5), || std::fs::read_dir(&big)
            .map(|d| d.count() == 102_500)
            .unwrap_or(false))
        .await
    );
    h.stop().await;
}
