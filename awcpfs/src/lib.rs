//! awcpfs: the transport that projects a delegated workspace onto an Executor.
//!
//! Two halves: [`export`] serves a directory on the Delegator (manifest, blocks, commits),
//! and [`mount`] is the FUSE filesystem on the Executor that consumes it.

pub mod alloc;
pub mod blockobj;
pub mod cache;
pub(crate) mod durable;
pub mod export;
pub mod fsmonitor;
pub mod gitindex;
pub mod lag;
pub mod mount;
pub mod private;

/// Support for this workspace's tests (not part of the API).
#[doc(hidden)]
pub mod testing {
    pub mod proxy;
    pub mod recordfs;

    /// The environment variable naming a file where skipped suites are recorded, one
    /// `suite<TAB>how to install it` line each; `scripts/test.sh` sets it and lists them at
    /// the end (nextest hides the stderr of a passing test, so a skip notice alone is lost).
    pub const SKIPS_VAR: &str = "AWCP_TEST_SKIPS";

    /// Say loudly that a test skips because `suite` cannot run here, and record it in the
    /// file named by [`SKIPS_VAR`] (when set) with `install`, the command that makes it run.
    /// Callers panic instead under `CI=true`, where every suite must run.
    pub fn skipped(suite: &str, install: &str) {
        eprintln!("\n!!!!!!!! SKIPPING {suite}: not available here ({install}) !!!!!!!!\n");
        if let Some(path) = std::env::var_os(SKIPS_VAR) {
            use std::io::Write as _;
            // One short append per line: concurrent test processes do not interleave.
            let line = format!("{suite}\t{install}\n");
            let appended = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .and_then(|mut f| f.write_all(line.as_bytes()));
            if let Err(e) = appended {
                eprintln!("cannot record the skip in {}: {e}", path.to_string_lossy());
            }
        }
    }

    /// Whether FUSE tests can run here (`/dev/fuse` exists and we are root). When they
    /// cannot, says so loudly on stderr, and panics under `CI=true`: CI must run them.
    pub fn fuse_available() -> bool {
        let ok = std::path::Path::new("/dev/fuse").exists() && nix::unistd::geteuid().is_root();
        if !ok {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "FUSE tests must run in CI: /dev/fuse is missing or we are not root"
            );
            skipped(
                "the FUSE tests",
                "run them as root on a machine with /dev/fuse: modprobe fuse",
            );
        }
        ok
    }

    /// Whether FUSE-over-io_uring tests can run here: the FUSE tests can, and the kernel
    /// offers io_uring (`/sys/module/fuse/parameters/enable_uring` is Y; `.ci/run` sets it).
    /// When it does not, says so loudly, and panics under `CI=true`.
    pub fn uring_available() -> bool {
        if !fuse_available() {
            return false;
        }
        match crate::mount::uring::uring_unavailable() {
            None => true,
            Some(why) => {
                assert!(
                    std::env::var("CI").as_deref() != Ok("true"),
                    "the io_uring FUSE tests must run in CI: {why}"
                );
                skipped(
                    "the FUSE-over-io_uring tests",
                    &format!("{why}; .ci/run sets it"),
                );
                false
            }
        }
    }
}

/// Raise this process's soft limit on open files to its hard limit, and say what it is.
///
/// A large commit stages every file before any is applied, holding a directory descriptor
/// per staged file, and a mount serves many open files at once: the common default soft
/// limit of 1,024 is too low for either. Failing to raise it is logged, not fatal.
pub fn raise_fd_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_limit() {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        // Start from a low soft limit, as on a default system (this test runs in its own
        // process under nextest).
        setrlimit(Resource::RLIMIT_NOFILE, hard.min(256), hard).unwrap();
        assert_eq!(super::raise_fd_limit(), hard);
        assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (hard, hard));
    }
}
