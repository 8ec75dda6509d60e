//! Random-operation exerciser: a seeded stream of file operations applied to an awcpfs mount
//! and to a native directory side by side, comparing contents and metadata after every step;
//! at the end the Delegator's directory must equal the native one (write-back is complete).
//!
//! `AWCP_SEED=<n>` reproduces a run; `AWCP_EXERCISER_OPS=<n>` sets its length (default 2000).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, appears, fuse_available, sample_repo};

/// The `user.*` extended attributes of a file or directory, as `name=hex` joined by `;`.
fn user_xattrs(p: &Path) -> String {
    let mut names = vec![0u8; 4096];
    let Ok(len) = rustix::fs::listxattr(p, &mut names[..]) else {
        return String::new();
    };
    let mut out: Vec<String> = names[..len]
        .split(|b| *b == 0)
        .filter(|n| n.starts_with(b"user."))
        .map(|n| {
            let name = String::from_utf8_lossy(n).into_owned();
            let mut value = vec![0u8; 1024];
            let v = rustix::fs::getxattr(p, name.as_str(), &mut value[..])
                .map(|l| {
                    value[..l]
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>()
                })
                .unwrap_or_else(|e| format!("error {e}"));
            format!("{name}={v}")
        })
        .collect();
    out.sort();
    out.join(";")
}

/// One entry as seen through `stat`/`read`: kind, mode, link count, content or target,
/// `user.*` extended attributes.
type Entry = (char, u32, u64, Vec<u8>, String);

/// A tree: path → entry.
fn snapshot(root: &Path) -> BTreeMap<String, Entry> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let mut names: Vec<_> = std::fs::read_dir(root.join(&rel))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for name in names {
            let r = rel.join(&name);
            if r.starts_with(".git") {
                continue;
            }
            let p = root.join(&r);
            let m = std::fs::symlink_metadata(&p).unwrap();
            let mode = m.permissions().mode() & 0o7777;
            let key = r.display().to_string();
            if m.file_type().is_symlink() {
                let t = std::fs::read_link(&p).unwrap();
                out.insert(
                    key,
                    (
                        'l',
                        0,
                        1,
                        t.display().to_string().into_bytes(),
                        String::new(),
                    ),
                );
            } else if m.is_dir() {
                out.insert(key, ('d', mode, 0, Vec::new(), user_xattrs(&p)));
                stack.push(r);
            } else {
                let nlink = std::os::unix::fs::MetadataExt::nlink(&m);
                let content = std::fs::read(&p).unwrap();
                out.insert(key, ('f', mode, nlink, content, user_xattrs(&p)));
            }
        }
    }
    out
}

struct Exerciser {
    rng: StdRng,
    roots: [PathBuf; 2],
    /// Files held open across an unlink: (handle on mount, handle on native, content).
    held: Vec<(File, File)>,
}

impl Exerciser {
    fn pick(&mut self, kind: char) -> Option<String> {
        let snap = snapshot(&self.roots[1]);
        let all: Vec<_> = snap
            .iter()
            .filter(|(_, (k, ..))| *k == kind)
            .map(|(p, _)| p.clone())
            .collect();
        if all.is_empty() {
            return None;
        }
        Some(all[self.rng.random_range(0..all.len())].clone())
    }

    fn dir(&mut self) -> String {
        if self.rng.random_bool(0.3) {
            String::new()
        } else {
            self.pick('d').map(|d| format!("{d}/")).unwrap_or_default()
        }
    }

    fn name(&mut self) -> String {
        format!("n{}", self.rng.random_range(0..40))
    }

    fn content(&mut self) -> Vec<u8> {
        let len = match self.rng.random_range(0..10) {
            0 => 0,
            1..=7 => self.rng.random_range(1..200),
            _ => self.rng.random_range(1000..20_000),
        };
        (0..len).map(|_| self.rng.random::<u8>()).collect()
    }

    /// Apply one random operation to both trees; both must succeed or both fail alike.
    fn step(&mut self) -> String {
        let op = self.rng.random_range(0..100);
        let roots = self.roots.clone();
        let both = |f: &dyn Fn(&Path) -> std::io::Result<()>| -> (String, String) {
            let a = f(&roots[0]).map_err(|e| e.kind()).err();
            let b = f(&roots[1]).map_err(|e| e.kind()).err();
            (format!("{a:?}"), format!("{b:?}"))
        };
        let (desc, (ra, rb)) = match op {
            0..=24 => {
                let p = format!("{}{}", self.dir(), self.name());
                let c = self.content();
                let d = format!("create {p} ({} bytes)", c.len());
                (d, both(&|r| std::fs::write(r.join(&p), &c)))
            }
            25..=39 => {
                let Some(p) = self.pick('f') else {
                    return "noop".into();
                };
                let c = self.content();
                let off = self.rng.random_range(0..30_000u64);
                let d = format!("pwrite {p} @{off} ({} bytes)", c.len());
                (
                    d,
                    both(&|r| {
                        let f = OpenOptions::new().write(true).open(r.join(&p))?;
                        f.write_all_at(&c, off)
                    }),
                )
            }
            40..=44 => {
                let Some(p) = self.pick('f') else {
                    return "noop".into();
                };
                let c = self.content();
                (
                    format!("append {p}"),
                    both(&|r| {
                        let mut f = OpenOptions::new().append(true).open(r.join(&p))?;
                        f.write_all(&c)
                    }),
                )
            }
            45..=51 => {
                let Some(p) = self.pick('f') else {
                    return "noop".into();
                };
                let len = self.rng.random_range(0..25_000u64);
                (
                    format!("truncate {p} to {len}"),
                    both(&|r| {
                        OpenOptions::new()
                            .write(true)
                            .open(r.join(&p))?
                            .set_len(len)
                    }),
                )
            }
            52..=63 => {
                let kind = if self.rng.random_bool(0.8) { 'f' } else { 'd' };
                let Some(from) = self.pick(kind) else {
                    return "noop".into();
                };
                let to = format!("{}{}", self.dir(), self.name());
                (
                    format!("rename {from} -> {to}"),
                    both(&|r| std::fs::rename(r.join(&from), r.join(&to))),
                )
            }
            64..=71 => {
                let Some(p) = self.pick('f') else {
                    return "noop".into();
                };
                // Unlink while open: the content stays readable through the handle.
                let a = File::open(self.roots[0].join(&p)).unwrap();
                let b = File::open(self.roots[1].join(&p)).unwrap();
                self.held.push((a, b));
                (
                    format!("unlink (held open) {p}"),
                    both(&|r| std::fs::remove_file(r.join(&p))),
                )
            }
            72..=79 => {
                let p = format!("{}d{}", self.dir(), self.rng.random_range(0..8));
                (
                    format!("mkdir {p}"),
                    both(&|r| std::fs::create_dir(r.join(&p))),
                )
            }
            80..=85 => {
                let Some(p) = self.pick('d') else {
                    return "noop".into();
                };
                (
                    format!("rmdir {p}"),
                    both(&|r| std::fs::remove_dir(r.join(&p))),
                )
            }
            86..=91 => {
                let p = format!("{}{}", self.dir(), self.name());
                let t = format!("target-{}", self.rng.random_range(0..5));
                (
                    format!("symlink {p} -> {t}"),
                    both(&|r| std::os::unix::fs::symlink(&t, r.join(&p))),
                )
            }
            92..=94 => {
                let Some(p) = self.pick('f') else {
                    return "noop".into();
                };
                let to = format!("{}{}", self.dir(), self.name());
                (
                    format!("link {p} -> {to}"),
                    both(&|r| std::fs::hard_link(r.join(&p), r.join(&to))),
                )
            }
            95..=96 => {
                let kind = if self.rng.random_bool(0.8) { 'f' } else { 'd' };
                let Some(p) = self.pick(kind) else {
                    return "noop".into();
                };
                let name = format!("user.{}", ['a', 'b', 'c'][self.rng.random_range(0..3)]);
                if self.rng.random_bool(0.7) {
                    let len = self.rng.random_range(0..20);
                    let value: Vec<u8> = (0..len).map(|_| self.rng.random::<u8>()).collect();
                    (
                        format!("setxattr {p} {name} ({len} bytes)"),
                        both(&|r| {
                            rustix::fs::setxattr(
                                r.join(&p),
                                name.as_str(),
                                &value,
                                rustix::fs::XattrFlags::empty(),
                            )
                            .map_err(std::io::Error::from)
                        }),
                    )
                } else {
                    (
                        format!("removexattr {p} {name}"),
                        both(&|r| {
                            rustix::fs::removexattr(r.join(&p), name.as_str())
                                .map_err(std::io::Error::from)
                        }),
                    )
                }
            }
            _ => {
                let Some(p) = self.pick('f') else {
                    return "noop".into();
                };
                let mode = [0o600, 0o644, 0o755, 0o700][self.rng.random_range(0..4)];
                (
                    format!("chmod {p} {mode:o}"),
                    both(&|r| {
                        std::fs::set_permissions(r.join(&p), std::fs::Permissions::from_mode(mode))
                    }),
                )
            }
        };
        assert_eq!(
            ra, rb,
            "{desc}: the mount and the native directory disagree on the outcome"
        );
        desc
    }

    fn check_held(&mut self) {
        for (a, b) in &mut self.held {
            let mut x = Vec::new();
            let mut y = Vec::new();
            a.seek(SeekFrom::Start(0)).unwrap();
            b.seek(SeekFrom::Start(0)).unwrap();
            a.read_to_end(&mut x).unwrap();
            b.read_to_end(&mut y).unwrap();
            assert_eq!(x, y, "an unlinked-but-open file reads differently");
        }
        if self.held.len() > 8 {
            self.held.drain(..4);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_operations_match_a_native_directory_and_write_back_completely() {
    if !fuse_available() {
        return;
    }
    let seed: u64 = std::env::var("AWCP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let ops: usize = std::env::var("AWCP_EXERCISER_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    eprintln!("exerciser: AWCP_SEED={seed} AWCP_EXERCISER_OPS={ops}");
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        "touch {o}/ready; while [ ! -e {o}/go ]; do sleep 0.05; done",
        o = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let native = h.path("native");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(&repo)
        .arg(&native)
        .status()
        .unwrap();
    assert!(status.success());
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(appears(&out.path().join("ready"), Duration::from_secs(30)).await);
    let mnt = h.mountpoint(&id);

    let result = tokio::task::spawn_blocking(move || {
        let mut ex = Exerciser {
            rng: StdRng::seed_from_u64(seed),
            roots: [mnt.clone(), native.clone()],
            held: Vec::new(),
        };
        let mut log = Vec::new();
        for i in 0..ops {
            let desc = ex.step();
            log.push(desc);
            let (a, b) = (snapshot(&mnt), snapshot(&native));
            if a != b {
                let diff: Vec<_> = a
                    .iter()
                    .filter(|(k, v)| b.get(*k) != Some(v))
                    .map(|(k, _)| format!("mount has {k} differently"))
                    .chain(
                        b.keys()
                            .filter(|k| !a.contains_key(*k))
                            .map(|k| format!("mount lacks {k}")),
                    )
                    .take(10)
                    .collect();
                panic!(
                    "AWCP_SEED={seed}: trees differ after step {i} ({}): {diff:?}\nlast ops: {:?}",
                    log.last().unwrap(),
                    &log[log.len().saturating_sub(8)..]
                );
            }
            if i % 50 == 0 {
                ex.check_held();
            }
        }
        ex.check_held();
        drop(ex);
        (native, seed)
    })
    .await;
    let (native, seed) = result.unwrap();
    std::fs::write(out.path().join("go"), "").unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    let (got, want) = (snapshot(&repo), snapshot(&native));
    let missing: Vec<_> = want
        .keys()
        .filter(|k| got.get(*k) != want.get(*k))
        .take(10)
        .collect();
    let extra: Vec<_> = got
        .keys()
        .filter(|k| !want.contains_key(*k))
        .take(10)
        .collect();
    let show = |e: Option<&Entry>| {
        e.map(|(k, m, n, c, x)| format!("{k} {m:o} nlink {n}, {} bytes, xattrs {x:?}", c.len()))
    };
    let details: Vec<String> = missing
        .iter()
        .take(3)
        .map(|k| {
            format!(
                "{k}: Delegator {:?}, native {:?}",
                show(got.get(*k)),
                show(want.get(*k))
            )
        })
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "AWCP_SEED={seed}: the Delegator's directory differs after write-back: wrong or missing {missing:?}, extra {extra:?}\n{}",
        details.join("\n")
    );
    h.stop().await;
}
