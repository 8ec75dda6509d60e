//! The witness runner: runs an artifact's witness and turns what happened into a status.
//!
//! The seed's semantics, exactly: exit 0 → `checked`; a failure after the witness printed its
//! marker → `refuted` (the publication is rejected with the reason); a failure before the
//! marker (the environment was not ready) → stays `unchecked`; a timeout is a failure at the
//! point it reached.
//!
//! The witness runs in a given directory (the worker's mount), optionally as a given user
//! (the agent's), in its own process group (so a timeout kills everything it started), with
//! a small fixed environment, and — where the machine allows it — in a new network namespace
//! (`unshare(CLONE_NEWNET)` before `exec`; it needs root or `CAP_SYS_ADMIN`). Where that is
//! refused the witness runs with the network and the run says so ([`WitnessRun::network`]).
//! Output is scanned for the marker as it streams (stdout and stderr together); only a
//! bounded tail is kept.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::knowledge::{Witness, WitnessStatus};

/// The last bytes of output kept for the reason.
pub const TAIL_BYTES: usize = 2048;

/// How a witness run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WitnessRun {
    /// The status it leads to.
    pub status: WitnessStatus,
    /// Whether the marker appeared in the output.
    pub marker_seen: bool,
    /// The exit code (`None`: killed by a signal or by the timeout).
    pub exit_code: Option<i32>,
    /// Whether the timeout stopped it.
    pub timed_out: bool,
    /// `isolated` (own network namespace) or `shared` (the machine refused one).
    pub network: String,
    /// One line saying what happened, for the publisher and the audit log.
    pub reason: String,
    /// The end of its output.
    pub output_tail: String,
    /// Milliseconds it ran.
    pub elapsed_ms: u64,
}

/// Where and as whom a witness runs.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// Its working directory: the worker's mount (or the named sandbox).
    pub dir: PathBuf,
    /// Run as this uid and gid (the agent's user); `None`: as this process.
    pub user: Option<(u32, u32)>,
    /// Ask for a new network namespace.
    pub isolate_network: bool,
}

/// The witness could not be started at all (not an outcome: nothing ran).
#[derive(Debug, thiserror::Error)]
pub enum WitnessError {
    /// The working directory does not exist.
    #[error("witness directory `{dir}` is not a directory")]
    NoDir {
        /// The directory.
        dir: PathBuf,
    },
    /// A pipe for its output could not be made.
    #[error("creating the witness's output pipe")]
    Pipe(#[source] std::io::Error),
}

/// Runs `w` as `spec` says and classifies the outcome. A command that cannot be executed
/// (not found, not executable) is a failure before the marker: `unchecked`.
pub fn run(w: &Witness, spec: &RunSpec) -> Result<WitnessRun, WitnessError> {
    if !spec.dir.is_dir() {
        return Err(WitnessError::NoDir {
            dir: spec.dir.clone(),
        });
    }
    let start = Instant::now();
    let (reader, writer) = std::io::pipe().map_err(WitnessError::Pipe)?;
    let writer2 = writer.try_clone().map_err(WitnessError::Pipe)?;
    let mut cmd = Command::new(&w.argv[0]);
    cmd.args(&w.argv[1..])
        .current_dir(&spec.dir)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("LANG", "C.UTF-8")
        .env("HOME", &spec.dir)
        .env("AECP_WITNESS", "1")
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(writer2)
        .process_group(0);
    let mut network = "shared";
    let spawned = if spec.isolate_network {
        sandbox::isolate(&mut cmd, spec.user, true);
        match cmd.spawn() {
            Ok(child) => {
                network = "isolated";
                Ok(child)
            }
            Err(e) if sandbox::is_refusal(&e) => {
                tracing::info!(
                    error = %e,
                    "no network namespace for the witness (needs root or CAP_SYS_ADMIN); it runs with the machine's network"
                );
                // The failed attempt consumed the pipe ends: build the command again.
                return run(
                    w,
                    &RunSpec {
                        isolate_network: false,
                        ..spec.clone()
                    },
                );
            }
            Err(e) => Err(e),
        }
    } else {
        sandbox::isolate(&mut cmd, spec.user, false);
        cmd.spawn()
    };
    // The parent's copies of the write ends must go, or the reader never sees EOF.
    drop(cmd);
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            return Ok(WitnessRun {
                status: WitnessStatus::Unchecked,
                marker_seen: false,
                exit_code: None,
                timed_out: false,
                network: network.into(),
                reason: format!("the witness could not start ({e}): environment not ready"),
                output_tail: String::new(),
                elapsed_ms: start.elapsed().as_millis() as u64,
            });
        }
    };
    let (done_tx, done_rx) = mpsc::channel();
    let marker = w.marker.clone();
    let scanner = std::thread::Builder::new()
        .name("aecp-witness-out".into())
        .spawn(move || {
            let result = scan(reader, marker.as_bytes());
            let _ = done_tx.send(());
            result
        })
        .expect("spawning a thread");
    let deadline = start + Duration::from_millis(w.timeout_ms);
    let pgid = child.id() as i32;
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() >= deadline => {
                timed_out = true;
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(_) => break None,
        }
    };
    // Output still held open by something the witness left running counts against the
    // same deadline.
    if !timed_out {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            timed_out = true;
        }
    }
    // Whatever is left of its process group goes (it may already be gone).
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pgid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let status = match status {
        Some(s) => Some(s),
        None => child.wait().ok(),
    };
    let (marker_seen, tail) = scanner.join().unwrap_or((false, Vec::new()));
    let exit_code = if timed_out {
        None
    } else {
        status.and_then(|s| s.code())
    };
    let success = !timed_out && exit_code == Some(0);
    let (status, reason) = classify(success, marker_seen, timed_out, exit_code, w.timeout_ms);
    Ok(WitnessRun {
        status,
        marker_seen,
        exit_code,
        timed_out,
        network: network.into(),
        reason,
        output_tail: String::from_utf8_lossy(&tail).into_owned(),
        elapsed_ms: start.elapsed().as_millis() as u64,
    })
}

/// The seed's table.
fn classify(
    success: bool,
    marker_seen: bool,
    timed_out: bool,
    exit_code: Option<i32>,
    timeout_ms: u64,
) -> (WitnessStatus, String) {
    let how = if timed_out {
        format!("timed out after {timeout_ms} ms")
    } else {
        match exit_code {
            Some(c) => format!("exited with {c}"),
            None => "was killed by a signal".to_owned(),
        }
    };
    if success {
        (WitnessStatus::Checked, "the witness exited 0".to_owned())
    } else if marker_seen {
        (
            WitnessStatus::Refuted,
            format!("the witness {how} after printing its marker: the claim does not hold"),
        )
    } else {
        (
            WitnessStatus::Unchecked,
            format!("the witness {how} before printing its marker: environment not ready"),
        )
    }
}

/// Reads to EOF; whether `marker` appeared (also across read boundaries) and the tail.
fn scan(mut r: impl Read, marker: &[u8]) -> (bool, Vec<u8>) {
    let mut seen = false;
    let mut tail: Vec<u8> = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Search the chunk with the end of what came before, so a marker split between two
        // reads is found.
        let keep = marker.len().saturating_sub(1).min(tail.len());
        let mut window = tail[tail.len() - keep..].to_vec();
        window.extend_from_slice(&buf[..n]);
        if !seen && window.windows(marker.len()).any(|x| x == marker) {
            seen = true;
        }
        tail.extend_from_slice(&buf[..n]);
        if tail.len() > TAIL_BYTES.max(marker.len()) {
            tail.drain(..tail.len() - TAIL_BYTES.max(marker.len()));
        }
    }
    if tail.len() > TAIL_BYTES {
        tail.drain(..tail.len() - TAIL_BYTES);
    }
    (seen, tail)
}

/// Whether `dir` is a usable witness directory (for callers that check before queueing).
pub fn usable_dir(dir: &Path) -> bool {
    dir.is_dir()
}

/// The one place with `unsafe`: the code that runs between `fork` and `exec`.
mod sandbox {
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    /// Whether a spawn failure is the kernel refusing a network namespace.
    pub(super) fn is_refusal(e: &std::io::Error) -> bool {
        use nix::errno::Errno;
        let refused = [Errno::EPERM, Errno::EINVAL, Errno::ENOSPC, Errno::EUSERS];
        e.raw_os_error()
            .is_some_and(|code| refused.iter().any(|r| *r as i32 == code))
    }

    /// Before `exec`: a new network namespace (if asked; needs privileges, so first), then
    /// the user's groups, gid and uid (after the namespace, which needs root).
    #[allow(unsafe_code)]
    pub(super) fn isolate(cmd: &mut Command, user: Option<(u32, u32)>, netns: bool) {
        if !netns && user.is_none() {
            return;
        }
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls (unshare, setgroups, setgid, setuid) without
        // allocating or taking locks.
        unsafe {
            cmd.pre_exec(move || {
                if netns {
                    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
                    // The new namespace has only a down loopback; bring nothing up: no
                    // network at all is the point.
                }
                if let Some((uid, gid)) = user {
                    nix::unistd::setgroups(&[nix::unistd::Gid::from_raw(gid)])?;
                    nix::unistd::setgid(nix::unistd::Gid::from_raw(gid))?;
                    nix::unistd::setuid(nix::unistd::Uid::from_raw(uid))?;
                }
                Ok(())
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, timeout_ms: u64) -> Witness {
        Witness {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            marker: "AECP-READY".into(),
            timeout_ms,
        }
    }

    fn spec(dir: &Path) -> RunSpec {
        RunSpec {
            dir: dir.to_path_buf(),
            user: None,
            isolate_network: true,
        }
    }

    #[test]
    fn exit_zero_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let r = run(&sh("echo AECP-READY; exit 0", 30_000), &spec(dir.path())).unwrap();
        assert_eq!(r.status, WitnessStatus::Checked, "{r:?}");
        assert!(r.marker_seen);
    }

    #[test]
    fn failure_after_marker_is_refuted() {
        let dir = tempfile::tempdir().unwrap();
        let r = run(
            &sh("echo AECP-READY; echo assertion failed >&2; exit 1", 30_000),
            &spec(dir.path()),
        )
        .unwrap();
        assert_eq!(r.status, WitnessStatus::Refuted, "{r:?}");
        assert_eq!(r.exit_code, Some(1));
        assert!(r.output_tail.contains("assertion failed"));
        assert!(
            r.reason.contains("after printing its marker"),
            "{}",
            r.reason
        );
    }

    #[test]
    fn failure_before_marker_stays_unchecked() {
        let dir = tempfile::tempdir().unwrap();
        let r = run(&sh("echo no python; exit 3", 30_000), &spec(dir.path())).unwrap();
        assert_eq!(r.status, WitnessStatus::Unchecked, "{r:?}");
        assert!(!r.marker_seen);
        let missing = Witness {
            argv: vec!["/nonexistent/witness".into()],
            ..sh("", 30_000)
        };
        let r = run(&missing, &spec(dir.path())).unwrap();
        assert_eq!(r.status, WitnessStatus::Unchecked, "{r:?}");
    }

    #[test]
    fn timeout_counts_as_failure_where_it_got_to() {
        let dir = tempfile::tempdir().unwrap();
        let after = run(
            &sh("echo AECP-READY; exec sleep 600", 300),
            &spec(dir.path()),
        )
        .unwrap();
        assert!(after.timed_out);
        assert_eq!(after.status, WitnessStatus::Refuted, "{after:?}");
        let before = run(&sh("exec sleep 600", 300), &spec(dir.path())).unwrap();
        assert!(before.timed_out);
        assert_eq!(before.status, WitnessStatus::Unchecked, "{before:?}");
    }

    #[test]
    fn a_background_child_holding_the_output_does_not_hang_the_run() {
        let dir = tempfile::tempdir().unwrap();
        // Exits 0 at once but leaves a child with the pipe open: the run ends at the
        // timeout, and the child is killed with the process group.
        let r = run(
            &sh("echo AECP-READY; sleep 600 & exit 0", 500),
            &spec(dir.path()),
        )
        .unwrap();
        assert!(r.timed_out, "{r:?}");
    }

    #[test]
    fn runs_in_the_given_directory_with_a_clean_environment() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("probe"), "here").unwrap();
        // Cargo sets this for the test process; the witness must not inherit it.
        assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
        let w = sh(
            "test -f probe && test -z \"$CARGO_PKG_NAME\" && echo AECP-READY",
            30_000,
        );
        let r = run(&w, &spec(dir.path())).unwrap();
        assert_eq!(r.status, WitnessStatus::Checked, "{r:?}");
    }

    #[test]
    fn the_network_is_isolated_where_the_machine_allows() {
        let dir = tempfile::tempdir().unwrap();
        // In a new namespace only a down `lo` exists: no interface is up.
        let w = sh(
            "echo AECP-READY; cat /proc/net/dev | tail -n +3 | grep -v '^ *lo:' | wc -l | grep -qx 0",
            30_000,
        );
        let r = run(&w, &spec(dir.path())).unwrap();
        if r.network == "isolated" {
            assert_eq!(r.status, WitnessStatus::Checked, "{r:?}");
        } else {
            assert_ne!(
                nix::unistd::geteuid().as_raw(),
                0,
                "root must get a network namespace"
            );
        }
    }

    #[test]
    fn runs_as_the_given_user() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: switching users needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let w = sh(
            "echo AECP-READY; test \"$(id -u):$(id -g)\" = 65534:65534",
            30_000,
        );
        let as_nobody = RunSpec {
            user: Some((65534, 65534)),
            ..spec(dir.path())
        };
        let r = run(&w, &as_nobody).unwrap();
        assert_eq!(r.status, WitnessStatus::Checked, "{r:?}");
        let r = run(&w, &spec(dir.path())).unwrap();
        assert_eq!(
            r.status,
            WitnessStatus::Refuted,
            "as root the check fails: {r:?}"
        );
    }

    #[test]
    fn marker_split_across_reads_is_found() {
        let data = b"xxxxAECP-READYyyy".to_vec();
        struct Dribble(Vec<u8>, usize);
        impl Read for Dribble {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                if self.1 >= self.0.len() {
                    return Ok(0);
                }
                buf[0] = self.0[self.1];
                self.1 += 1;
                Ok(1)
            }
        }
        let (seen, tail) = scan(Dribble(data.clone(), 0), b"AECP-READY");
        assert!(seen);
        assert_eq!(tail, data);
        let (seen, _) = scan(&b"AECP-READ"[..], b"AECP-READY");
        assert!(!seen);
    }
}
