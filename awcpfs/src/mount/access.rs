//! Who the kernel lets into a mount.
//!
//! FUSE admits only the mounting user unless the filesystem is mounted with `allow_other`.
//! That is safe but not how a local filesystem behaves: a process that switches user inside
//! the workspace (a test suite run as root that drops to `nobody`, `sudo -u`, a build that
//! runs a step as another user) is refused with `EACCES` whatever the files' modes say.
//!
//! The default, [`MountAccess::Path`], makes the mount behave like a local directory at the
//! mountpoint without opening it to the machine: the kernel admits every user
//! (`allow_other`, with `default_permissions`, so the mode bits decide as on a local disk)
//! **only when the mountpoint's own path already keeps every other user out** — when a
//! directory above it may be searched by nobody but the mount's users and root (a *gate*,
//! e.g. the Executor's 0700 work directory). Another user then cannot reach the mount by
//! name, exactly as it could not reach a local directory there; only a process that was
//! let in first (a child of the agent that changed user, with its working directory in the
//! mount) is served, by the files' modes. Where no gate exists the mount stays its owner's
//! alone ([`MountAccess::Owner`]) and says how to change that.

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

/// Who may use a mount (`awcpfs mount --access`, `awcp-ctl executor --mount-access`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MountAccess {
    /// Like a local directory at the mountpoint: every process that can reach the mount
    /// is served by the files' modes — chosen only when a directory above the mountpoint
    /// keeps every other user out (mode without group and other search, no ACL); otherwise
    /// the same as `owner`.
    #[default]
    Path,
    /// Only the mounting user (and the mount's owner): another uid gets `EACCES` even
    /// where the path and the modes would let it in.
    Owner,
    /// Every user of the machine that can reach the mountpoint: the files' modes decide
    /// (a 0644 file, `.git` included, is readable by all who can get there).
    All,
}

/// What [`decide`] chose, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Mount with `allow_other`.
    pub allow_other: bool,
    /// The directory that keeps other users out, when `Path` found one.
    pub gate: Option<PathBuf>,
}

impl Decision {
    /// One line for the log (and the standalone mount's terminal): who gets in.
    pub fn describe(&self, access: MountAccess) -> String {
        match (access, &self.gate) {
            (MountAccess::All, _) => "open to every user who can reach it (--access all): \
                 the files' modes decide"
                .into(),
            (MountAccess::Owner, _) => "only its own user gets in (--access owner)".into(),
            (MountAccess::Path, Some(gate)) => format!(
                "served like a local directory: {} keeps other users out, and processes \
                 inside that change user are served by the files' modes",
                gate.display()
            ),
            (MountAccess::Path, None) => "only its own user gets in: the mountpoint's path is \
                 open to other users, so a process that changes user (a test suite run as \
                 root dropping to `nobody`, `sudo -u`) gets EACCES on the mount; mount it \
                 below a directory only you may search (`chmod 700`) to serve such processes \
                 like a local filesystem, or pass --access all"
                .into(),
        }
    }
}

/// Decide `allow_other` for a mount at `mountpoint` used by `users` (the mounting uid, and
/// the mount's owner when that is another).
pub fn decide(access: MountAccess, mountpoint: &Path, users: &[u32]) -> Decision {
    match access {
        MountAccess::All => Decision {
            allow_other: true,
            gate: None,
        },
        MountAccess::Owner => Decision {
            allow_other: false,
            gate: None,
        },
        MountAccess::Path => {
            let gate = gate(mountpoint, users);
            Decision {
                allow_other: gate.is_some(),
                gate,
            }
        }
    }
}

/// The nearest directory above `mountpoint` that no user but root and `users` may search:
/// owned by one of them, without group or other execute bits, without an access ACL.
/// `None` when every directory on the way lets some other user through (or cannot be read).
pub fn gate(mountpoint: &Path, users: &[u32]) -> Option<PathBuf> {
    let abs = std::path::absolute(mountpoint).ok()?;
    // The mountpoint's own directory is covered by the mount: only what is above counts.
    // Symlinks on the way are resolved, so the directories judged are the ones walked.
    let parent = abs.parent()?.canonicalize().ok()?;
    parent
        .ancestors()
        .find(|dir| closes(dir, users))
        .map(Path::to_path_buf)
}

/// Whether `dir` may be searched by nobody but root and `users`.
fn closes(dir: &Path, users: &[u32]) -> bool {
    let Ok(m) = std::fs::metadata(dir) else {
        return false;
    };
    let owner_ok = m.uid() == 0 || users.contains(&m.uid());
    owner_ok && m.mode() & 0o011 == 0 && !has_access_acl(dir)
}

/// Whether `dir` carries a POSIX access ACL (which can let named users or groups through
/// whatever the group bits say).
fn has_access_acl(dir: &Path) -> bool {
    // An empty buffer asks only for the value's size: any answer but "no such attribute"
    // (or "not supported") means an ACL may be there.
    match rustix::fs::getxattr(dir, "system.posix_acl_access", &mut [0u8; 0][..]) {
        Ok(_) => true,
        Err(e) => !matches!(e, rustix::io::Errno::NODATA | rustix::io::Errno::NOTSUP),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_private_directory_above_the_mountpoint_is_its_gate() {
        let tmp = tempfile::tempdir().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let outer = tmp.path().join("outer");
        let inner = outer.join("inner");
        let mnt = inner.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        chmod(tmp.path(), 0o755);
        chmod(&outer, 0o755);
        chmod(&inner, 0o700);
        assert_eq!(gate(&mnt, &[me]), Some(inner.clone()));
        let d = decide(MountAccess::Path, &mnt, &[me]);
        assert!(d.allow_other);
        assert!(d.describe(MountAccess::Path).contains("inner"));
        // Group search lets the group's members through: no gate there any more.
        chmod(&inner, 0o710);
        assert_eq!(gate(&mnt, &[me]), ancestor_gate(tmp.path()));
        // The mountpoint's own mode does not count: the mount covers it.
        chmod(&inner, 0o755);
        chmod(&mnt, 0o700);
        assert_eq!(gate(&mnt, &[me]), ancestor_gate(tmp.path()));
        let d = decide(MountAccess::Path, &mnt, &[me]);
        assert_eq!(d.allow_other, d.gate.is_some());
        if d.gate.is_none() {
            assert!(d.describe(MountAccess::Path).contains("EACCES"));
        }
    }

    /// A gate above the test's temporary directory, if the machine has one (a `TMPDIR`
    /// below `/root`, say): the walk goes all the way up.
    fn ancestor_gate(tmp: &Path) -> Option<PathBuf> {
        let me = nix::unistd::geteuid().as_raw();
        let above = tmp.parent()?.canonicalize().ok()?;
        above
            .ancestors()
            .find(|d| closes(d, &[me]))
            .map(Path::to_path_buf)
    }

    #[test]
    fn a_directory_another_user_owns_is_no_gate_for_us() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("theirs");
        std::fs::create_dir(&dir).unwrap();
        chmod(&dir, 0o700);
        let me = nix::unistd::geteuid().as_raw();
        assert!(closes(&dir, &[me]));
        if me == 0 {
            // Owned by `nobody`, it lets `nobody` through (and `nobody` could open it).
            nix::unistd::chown(&dir, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
            assert!(!closes(&dir, &[0]));
            assert!(closes(&dir, &[0, 65534]));
        }
    }

    #[test]
    fn owner_and_all_ignore_the_path() {
        let tmp = tempfile::tempdir().unwrap();
        let mnt = tmp.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        assert!(!decide(MountAccess::Owner, &mnt, &[0]).allow_other);
        assert!(decide(MountAccess::All, &mnt, &[0]).allow_other);
        assert_eq!(decide(MountAccess::All, &mnt, &[0]).gate, None);
    }
}
