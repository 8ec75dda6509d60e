//! Names that are not UTF-8 and the Delegator's own extended attributes, end to end: a
//! Delegator workspace with Latin-1 names and `user.*` attributes is mounted by a real
//! Executor; the agent lists, reads, creates, renames and re-tags on the mount (with `ls`,
//! `find` and Python's byte-path API); the Delegator then holds exactly those bytes.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, fuse_available, tools_available};

const TASK_TIMEOUT: Duration = Duration::from_secs(120);

/// `dir` joined with a name given as raw bytes.
fn raw(dir: &Path, name: &[u8]) -> PathBuf {
    dir.join(OsStr::from_bytes(name))
}

fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = [0u8; 256];
    let n = rustix::fs::lgetxattr(path, name, &mut buf[..]).ok()?;
    Some(buf[..n].to_vec())
}

/// What the agent runs on the mount; one `key: repr` line per check.
const AGENT: &str = r#"python3 - > ../../../raw.out 2>&1 <<'PY'
import os, subprocess
def p(k, v):
    print(f"{k}: {v!r}", flush=True)
env = dict(os.environ, LC_ALL="C")
p("listdir", sorted(os.listdir(b".")))
p("read", open(b"caf\xe9.txt", "rb").read())
p("inner", open(b"d\xff/inner", "rb").read())
p("readlink", os.readlink(b"lnk"))
p("via_link", open(b"lnk", "rb").read())
ls = subprocess.run(["ls", "-1"], capture_output=True, env=env).stdout
p("ls", sorted(ls.splitlines()))
found = subprocess.run(["find", ".", "-name", "*.txt"], capture_output=True, env=env).stdout
p("find", sorted(found.splitlines()))
p("stat_size", os.stat(b"caf\xe9.txt").st_size)
p("xattr_file", os.getxattr("README", "user.color"))
p("xattr_list", sorted(os.listxattr("README")))
p("xattr_dir", os.getxattr("tagged", "user.d"))
p("xattr_raw_name", os.getxattr(b"caf\xe9.txt", "user.enc"))
# Changes that must reach the Delegator byte-exactly.
with open(b"new\xfe.bin", "wb") as f:
    f.write(b"\x00raw\xff")
os.rename(b"caf\xe9.txt", b"moved\xe8.txt")
os.mkdir(b"nd\xf1")
with open(b"nd\xf1/f\xf2", "wb") as f:
    f.write(b"deep")
os.symlink(b"new\xfe.bin", b"l\xfa")
os.unlink(b"d\xff/gone")
os.setxattr("README", "user.color", b"green")
os.removexattr("tagged", "user.d")
os.setxattr(b"new\xfe.bin", "user.k", b"v")
p("after", sorted(os.listdir(b".")))
p("done", True)
PY"#;

fn results(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn non_utf8_names_and_delegator_xattrs_round_trip() {
    if !fuse_available() || !tools_available(&["python3", "ls", "find"]) {
        return;
    }
    let h = Harness::start(AGENT).await;
    let repo = h.path("repo");
    std::fs::create_dir_all(raw(&repo, b"d\xff")).unwrap();
    std::fs::create_dir_all(repo.join("tagged")).unwrap();
    std::fs::write(repo.join("README"), "raw names\n").unwrap();
    std::fs::write(raw(&repo, b"caf\xe9.txt"), "latin1\n").unwrap();
    std::fs::write(raw(&repo, b"d\xff/inner"), "inside\n").unwrap();
    std::fs::write(raw(&repo, b"d\xff/gone"), "bye\n").unwrap();
    std::os::unix::fs::symlink(OsStr::from_bytes(b"caf\xe9.txt"), repo.join("lnk")).unwrap();
    let set = |p: &Path, n: &str, v: &[u8]| {
        rustix::fs::lsetxattr(p, n, v, rustix::fs::XattrFlags::empty()).unwrap()
    };
    set(&repo.join("README"), "user.color", b"blue");
    set(&repo.join("README"), "user.other", b"kept");
    set(&repo.join("tagged"), "user.d", b"1");
    set(&raw(&repo, b"caf\xe9.txt"), "user.enc", b"latin-1");

    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let state = h.wait_end(&id, TASK_TIMEOUT).await;
    let out = std::fs::read_to_string(h.path("raw.out")).unwrap_or_default();
    assert_eq!(
        state,
        DelegationState::Completed,
        "{out}\n{:?}",
        h.client.get(&id).await.map(|v| v.record.error)
    );
    let r = results(&out);
    let want = [
        (
            "listdir",
            r"[b'README', b'caf\xe9.txt', b'd\xff', b'lnk', b'tagged']",
        ),
        ("read", r"b'latin1\n'"),
        ("inner", r"b'inside\n'"),
        ("readlink", r"b'caf\xe9.txt'"),
        ("via_link", r"b'latin1\n'"),
        (
            "ls",
            r"[b'README', b'caf\xe9.txt', b'd\xff', b'lnk', b'tagged']",
        ),
        ("find", r"[b'./caf\xe9.txt']"),
        ("stat_size", "7"),
        ("xattr_file", "b'blue'"),
        ("xattr_list", "['user.color', 'user.other']"),
        ("xattr_dir", "b'1'"),
        ("xattr_raw_name", "b'latin-1'"),
        (
            "after",
            r"[b'README', b'd\xff', b'lnk', b'l\xfa', b'moved\xe8.txt', b'nd\xf1', b'new\xfe.bin', b'tagged']",
        ),
        ("done", "True"),
    ];
    for (k, v) in want {
        assert_eq!(r.get(k).map(String::as_str), Some(v), "{k}\n{out}");
    }

    // At the Delegator, the exact bytes.
    assert_eq!(
        std::fs::read(raw(&repo, b"new\xfe.bin")).unwrap(),
        b"\x00raw\xff"
    );
    assert_eq!(
        std::fs::read(raw(&repo, b"moved\xe8.txt")).unwrap(),
        b"latin1\n"
    );
    assert!(!raw(&repo, b"caf\xe9.txt").exists(), "renamed away");
    assert_eq!(std::fs::read(raw(&repo, b"nd\xf1/f\xf2")).unwrap(), b"deep");
    assert_eq!(
        std::fs::read_link(raw(&repo, b"l\xfa"))
            .unwrap()
            .as_os_str()
            .as_bytes(),
        b"new\xfe.bin"
    );
    assert!(!raw(&repo, b"d\xff/gone").exists());
    assert_eq!(
        std::fs::read(raw(&repo, b"d\xff/inner")).unwrap(),
        b"inside\n"
    );
    // Attributes: changed, removed and added on the mount; untouched ones stay.
    assert_eq!(
        xattr(&repo.join("README"), "user.color").as_deref(),
        Some(&b"green"[..])
    );
    assert_eq!(
        xattr(&repo.join("README"), "user.other").as_deref(),
        Some(&b"kept"[..])
    );
    assert_eq!(xattr(&repo.join("tagged"), "user.d"), None);
    assert_eq!(
        xattr(&raw(&repo, b"new\xfe.bin"), "user.k").as_deref(),
        Some(&b"v"[..])
    );
    // The renamed file is written anew at its new name, with its attributes.
    assert_eq!(
        xattr(&raw(&repo, b"moved\xe8.txt"), "user.enc").as_deref(),
        Some(&b"latin-1"[..])
    );
    // No conflict copies or temp files were left.
    let names: Vec<Vec<u8>> = std::fs::read_dir(&repo)
        .unwrap()
        .map(|e| e.unwrap().file_name().as_bytes().to_vec())
        .collect();
    assert!(
        names.iter().all(|n| !n.windows(5).any(|w| w == b".awcp")),
        "{names:?}"
    );
    h.stop().await;
}
