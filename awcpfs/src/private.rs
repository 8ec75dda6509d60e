//! Directories and files only their owner may open.
//!
//! Everything that holds capability tokens, transport handles, journals or workspace
//! content (the daemon's state directory, the Executor's state, work and cache directories,
//! a mount's state directory and its upper files) is created through these helpers: the
//! directories 0700, the files 0600, whatever the process's umask. A directory that already
//! exists keeps its owner but loses the group and other bits, so a state directory created
//! by an older, looser version is tightened at the next start.

use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Mode of the directories made here.
pub const DIR_MODE: u32 = 0o700;
/// Mode of the files made here.
pub const FILE_MODE: u32 = 0o600;

/// `mkdir -p -m 0700 dir`: every directory created on the way is 0700, and `dir` itself
/// is made 0700 if it existed with wider permissions.
pub fn create_dir_all(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)?;
    restrict(dir, DIR_MODE)
}

/// Remove the group and other bits of `path` (and any bits beyond `mode`).
pub fn restrict(path: &Path, mode: u32) -> io::Result<()> {
    let now = std::fs::metadata(path)?.permissions().mode() & 0o7777;
    if now & !mode != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(now & mode))?;
    }
    Ok(())
}

/// Options that create a file 0600 (for writing; add what else is needed).
pub fn file_options() -> std::fs::OpenOptions {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).mode(FILE_MODE);
    o
}

/// Write `bytes` to `path`, replacing it, as a 0600 file (an existing file is tightened
/// first).
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use io::Write as _;
    if path.exists() {
        restrict(path, FILE_MODE)?;
    }
    let mut f = file_options().truncate(true).open(path)?;
    f.write_all(bytes)
}

/// Whether `mode` lets anyone but the owner in (any group or other bit).
pub fn is_shared(mode: u32) -> bool {
    mode & 0o077 != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_and_files_are_private_whatever_the_umask() {
        let tmp = tempfile::tempdir().unwrap();
        let deep = tmp.path().join("a/b/c");
        create_dir_all(&deep).unwrap();
        for d in ["a", "a/b", "a/b/c"] {
            let m = std::fs::metadata(tmp.path().join(d))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(m & 0o777, DIR_MODE, "{d}");
        }
        let f = deep.join("secret");
        write(&f, b"x").unwrap();
        let m = std::fs::metadata(&f).unwrap().permissions().mode();
        assert_eq!(m & 0o777, FILE_MODE);
    }

    // A state directory made 0755 by an older version must not stay readable by others.
    #[test]
    fn an_existing_open_directory_is_tightened() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("state");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        create_dir_all(&d).unwrap();
        let m = std::fs::metadata(&d).unwrap().permissions().mode();
        assert_eq!(m & 0o777, 0o700);
        assert!(!is_shared(m));
        assert!(is_shared(0o644));
    }
}
