//! git's filesystem monitor hook (`core.fsmonitor`, protocol version 2), answered by the
//! mount: `git status` then costs O(changes) instead of an `lstat` per tracked file.
//!
//! git runs the hook in the work tree with two arguments, the protocol version and the
//! token of its last question, and reads `<new token> NUL <path> NUL …` (or `/` for
//! "everything") from its output. [`query`] asks the mount for exactly that with one
//! `getxattr` of [`FSMONITOR_XATTR`]`<token>` on
//! the work tree (see `mount/changes.rs` for how the mount builds the answer): the hook
//! needs nothing but the mount, so it works for an agent confined to its workspace.
//!
//! The configuration goes into git's environment ([`git_config_env`]), never into the
//! repository's `.git/config`: the Delegator's own git is left as it was.

use std::ffi::OsString;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use crate::mount::changes::{FSMONITOR_XATTR, MAX_ANSWER};

/// `FUSE_SUPER_MAGIC`: the filesystem type of a FUSE mount (`statfs`).
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Longest token passed on: the attribute's name must stay within 255 bytes. git only
/// gives back what the hook printed, so a longer one is foreign and means "everything".
const MAX_TOKEN: usize = 200;

/// Why the hook could not answer (git then looks at every file itself).
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// git asked in a protocol version other than 2.
    #[error("protocol version {version} is not supported (set core.fsmonitorHookVersion=2)")]
    Version {
        /// What git asked for.
        version: String,
    },
    /// The work tree is not on an awcpfs mount (or on one too old to answer).
    #[error(
        "{} is not on an awcpfs mount (or the mount predates fsmonitor support): \
         unset core.fsmonitor for this repository",
        dir.display()
    )]
    NotAwcpfs {
        /// The directory asked about.
        dir: PathBuf,
    },
    /// The mount did not answer.
    #[error("asking the mount at {}", dir.display())]
    Io {
        /// The directory asked about.
        dir: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

/// The hook's answer for the work tree `dir`: the bytes to print.
pub fn query(dir: &Path, version: &str, token: &str) -> Result<Vec<u8>, HookError> {
    if version != "2" {
        return Err(HookError::Version {
            version: version.to_string(),
        });
    }
    let io = |source: std::io::Error| HookError::Io {
        dir: dir.to_path_buf(),
        source,
    };
    let d = std::fs::File::open(dir).map_err(io)?;
    let fs = rustix::fs::fstatfs(d.as_fd()).map_err(|e| io(e.into()))?;
    #[allow(clippy::unnecessary_cast)] // `f_type`'s width differs between targets.
    if fs.f_type as i64 != FUSE_SUPER_MAGIC {
        return Err(HookError::NotAwcpfs {
            dir: dir.to_path_buf(),
        });
    }
    // Written pages the kernel still holds (writeback cache) reach the mount first, so the
    // answer covers every write made before this question.
    rustix::fs::syncfs(d.as_fd()).map_err(|e| io(e.into()))?;
    let token = if token.len() > MAX_TOKEN || token.contains('\0') {
        ""
    } else {
        token
    };
    let mut buf = vec![0u8; MAX_ANSWER];
    let name = format!("{FSMONITOR_XATTR}{token}");
    match rustix::fs::getxattr(dir, name.as_str(), &mut buf[..]) {
        Ok(n) => {
            buf.truncate(n);
            Ok(buf)
        }
        Err(e) if e == rustix::io::Errno::NODATA || e == rustix::io::Errno::NOTSUP => {
            Err(HookError::NotAwcpfs {
                dir: dir.to_path_buf(),
            })
        }
        Err(e) => Err(io(e.into())),
    }
}

/// `<binary> fsmonitor VERSION [TOKEN]`, recognised without an argument parser: git runs
/// the hook on every `git status`, so the binary answers before it sets up anything else
/// (logging, a runtime, its parser). `None` for any other command line — options, help —
/// which the binary's parser handles as usual.
pub fn hook_args() -> Option<(String, String)> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != "fsmonitor" {
        return None;
    }
    let version = args.next()?.into_string().ok()?;
    let token = match args.next() {
        Some(t) => t.into_string().ok()?,
        None => String::new(),
    };
    if args.next().is_some() || version.starts_with('-') || token.starts_with('-') {
        return None;
    }
    Some((version, token))
}

/// The hook's whole run for a binary's `fsmonitor` command: asks the mount about the
/// working directory and prints the answer. A failure is told on stderr (after `name`,
/// with its causes) and exits 1; git then looks at every file itself.
pub fn run_hook(name: &str, version: &str, token: &str) -> std::process::ExitCode {
    use std::io::Write as _;
    match query(Path::new("."), version, token) {
        Ok(answer) => {
            let mut out = std::io::stdout().lock();
            if out.write_all(&answer).and_then(|_| out.flush()).is_err() {
                return std::process::ExitCode::from(1);
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            let mut msg = format!("{name}: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("{msg}");
            std::process::ExitCode::from(1)
        }
    }
}

/// The hook command line for git (run by a shell): `exe` with `args`, quoted.
pub fn hook_command(exe: &Path, args: &[&str]) -> String {
    std::iter::once(exe.to_string_lossy().into_owned())
        .chain(args.iter().map(|a| a.to_string()))
        .map(|w| shell_quote(&w))
        .collect::<Vec<_>>()
        .join(" ")
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+=:,".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The git settings that use the hook `hook`: the monitor, its protocol version (so git
/// does not try version 1 first), and the untracked cache (so unchanged directories are
/// not read either).
pub fn git_config(hook: &str) -> [(&'static str, String); 3] {
    [
        ("core.fsmonitor", hook.to_string()),
        ("core.fsmonitorHookVersion", "2".to_string()),
        ("core.untrackedCache", "true".to_string()),
    ]
}

/// The environment that gives git [`git_config`] without touching any config file
/// (`GIT_CONFIG_COUNT`, `GIT_CONFIG_KEY_<n>`, `GIT_CONFIG_VALUE_<n>`), appended after the
/// `existing` count of such settings already in the environment (`GIT_CONFIG_COUNT`).
pub fn git_config_env(hook: &str, existing: Option<&str>) -> Vec<(String, OsString)> {
    let first: usize = existing.and_then(|c| c.trim().parse().ok()).unwrap_or(0);
    let settings = git_config(hook);
    let mut env = Vec::new();
    for (i, (k, v)) in settings.iter().enumerate() {
        env.push((format!("GIT_CONFIG_KEY_{}", first + i), OsString::from(k)));
        env.push((format!("GIT_CONFIG_VALUE_{}", first + i), OsString::from(v)));
    }
    env.push((
        "GIT_CONFIG_COUNT".to_string(),
        OsString::from((first + settings.len()).to_string()),
    ));
    env
}

/// How to turn the monitor on in a shell (what `awcpfs mount` prints).
pub fn shell_setup(hook: &str) -> String {
    git_config_env(hook, None)
        .into_iter()
        .map(|(k, v)| format!("{k}={}", shell_quote(&v.to_string_lossy())))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_appends_to_settings_already_given() {
        let env = git_config_env("/usr/bin/awcpfs fsmonitor", Some("2"));
        let get = |k: &str| {
            env.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.to_string_lossy().into_owned())
        };
        assert_eq!(get("GIT_CONFIG_COUNT").as_deref(), Some("5"));
        assert_eq!(get("GIT_CONFIG_KEY_2").as_deref(), Some("core.fsmonitor"));
        assert_eq!(
            get("GIT_CONFIG_VALUE_2").as_deref(),
            Some("/usr/bin/awcpfs fsmonitor")
        );
        assert_eq!(
            get("GIT_CONFIG_KEY_4").as_deref(),
            Some("core.untrackedCache")
        );
        assert_eq!(get("GIT_CONFIG_KEY_0"), None);
        let env = git_config_env("h", Some("junk"));
        assert!(env.iter().any(|(k, v)| k == "GIT_CONFIG_COUNT" && v == "3"));
    }

    #[test]
    fn hook_commands_survive_the_shell() {
        assert_eq!(
            hook_command(Path::new("/opt/awcp/bin/awcpfs"), &["fsmonitor"]),
            "/opt/awcp/bin/awcpfs fsmonitor"
        );
        assert_eq!(
            hook_command(Path::new("/tmp/it's here/awcpfs"), &["fsmonitor"]),
            r"'/tmp/it'\''s here/awcpfs' fsmonitor"
        );
        assert!(shell_setup("a b").contains("GIT_CONFIG_VALUE_0='a b'"));
    }

    #[test]
    fn refuses_other_versions_and_other_filesystems() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            query(dir.path(), "1", "x"),
            Err(HookError::Version { .. })
        ));
        // A temporary directory is not a FUSE mount (and no syncfs of it is made).
        if rustix::fs::statfs(dir.path()).unwrap().f_type as i64 != FUSE_SUPER_MAGIC {
            assert!(matches!(
                query(dir.path(), "2", "x"),
                Err(HookError::NotAwcpfs { .. })
            ));
        }
    }
}
