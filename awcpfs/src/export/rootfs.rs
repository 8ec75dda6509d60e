//! Root-confined filesystem access: every path is resolved *below* an open root directory.
//!
//! The export must never read or write outside its root, whatever paths the network sends
//! and whatever the tree contains (a symlink to `/etc`, a directory swapped for a symlink
//! between two requests). Checking a path and then opening it by name cannot promise that
//! (the tree can change in between), so this module never hands a multi-component path to
//! the kernel. Instead:
//!
//! * the root is opened once, as a directory file descriptor;
//! * a relative path is split on `/`, and every component except the last is opened with
//!   `openat(dir, component, O_DIRECTORY | O_NOFOLLOW)` relative to the previous one, so each
//!   step is a real directory that is a child of the previous real directory — a symlink or a
//!   non-directory anywhere in the chain makes the open fail;
//! * the last component is only ever used with `*at` calls that do not follow a symlink in
//!   that position (`openat(O_NOFOLLOW)`, `fstatat(AT_SYMLINK_NOFOLLOW)`, `renameat`,
//!   `unlinkat`, `mkdirat`, `symlinkat`, `readlinkat`, `fchmodat(AT_SYMLINK_NOFOLLOW)`).
//!
//! `.` and `..` components are refused here too (defence in depth: callers already validated
//! with [`awcp_protocol::dataplane::validate_rel_path`]). By induction every descriptor this
//! module opens names an object inside the tree below the root descriptor.
//!
//! Files are opened with `O_NONBLOCK` so that a FIFO planted in the tree can never block a
//! request; anything that is not a regular file is refused after `fstat`.

use std::borrow::Cow;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};

/// What a path names, without following a symlink in the last position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeKind {
    /// Nothing there.
    Absent,
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// A FIFO, socket or device: never served, never replaced.
    Special,
}

impl NodeKind {
    pub(crate) fn of(st: &FileStat) -> NodeKind {
        match SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT {
            SFlag::S_IFREG => NodeKind::File,
            SFlag::S_IFDIR => NodeKind::Dir,
            SFlag::S_IFLNK => NodeKind::Symlink,
            _ => NodeKind::Special,
        }
    }

    /// A word for messages.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            NodeKind::Absent => "nothing",
            NodeKind::File => "a file",
            NodeKind::Dir => "a directory",
            NodeKind::Symlink => "a symlink",
            NodeKind::Special => "a special file",
        }
    }
}

/// Why a path could not be resolved below the root.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FsError {
    /// A parent component is a symlink: following it could leave the export.
    #[error(
        "{path:?} escapes the export: `{component}` is a symlink, and the export never follows symlinks"
    )]
    SymlinkInPath {
        /// The whole path.
        path: String,
        /// The prefix that is a symlink.
        component: String,
    },
    /// A parent component is not a directory.
    #[error("{path:?}: `{component}` is {found}, not a directory")]
    NotDir {
        /// The whole path.
        path: String,
        /// The prefix that is not a directory.
        component: String,
        /// What it is instead.
        found: &'static str,
    },
    /// A parent component does not exist.
    #[error("{path:?}: parent directory `{component}` does not exist")]
    ParentMissing {
        /// The whole path.
        path: String,
        /// The first missing prefix.
        component: String,
    },
    /// The final component is not a regular file (when one was needed).
    #[error("{path:?} is {found}, not a regular file")]
    NotRegular {
        /// The path.
        path: String,
        /// What it is instead.
        found: &'static str,
    },
    /// `.`, `..` or an empty component.
    #[error("{path:?} has a `.`, `..` or empty component")]
    BadComponent {
        /// The path.
        path: String,
    },
    /// Any other system error.
    #[error("{op} {path:?}")]
    Io {
        /// The operation that failed.
        op: &'static str,
        /// The path it was applied to.
        path: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

impl FsError {
    /// Whether the error means "not there" (parent or file missing).
    pub(crate) fn is_not_found(&self) -> bool {
        match self {
            FsError::ParentMissing { .. } => true,
            FsError::Io { source, .. } => source.kind() == io::ErrorKind::NotFound,
            _ => false,
        }
    }
}

/// Open flags of every intermediate directory.
fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// Open flags for reading a file in the tree.
fn read_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY
}

fn io_err(op: &'static str, path: &str, e: Errno) -> FsError {
    FsError::Io {
        op,
        path: path.to_owned(),
        source: e.into(),
    }
}

/// The export root, held open as a directory descriptor.
#[derive(Debug)]
pub(crate) struct RootDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl RootDir {
    /// Open `path` as the root. The path itself may contain symlinks (it is the operator's
    /// choice); everything below it is resolved without following any.
    pub(crate) fn open(path: &Path) -> io::Result<RootDir> {
        let fd = nix::fcntl::open(
            path,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        Ok(RootDir {
            fd,
            path: path.to_owned(),
        })
    }

    /// The root's path as configured (for messages and for callers).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The root descriptor.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Open the parent directory of `rel` and return it with the last component.
    pub(crate) fn open_parent<'p>(&self, rel: &'p str) -> Result<(OwnedFd, &'p str), FsError> {
        let (parents, name) = match rel.rsplit_once('/') {
            Some((p, n)) => (Some(p), n),
            None => (None, rel),
        };
        check_component(rel, name)?;
        let dir = match parents {
            None => self.fd.try_clone().map_err(|source| FsError::Io {
                op: "dup root",
                path: String::new(),
                source,
            })?,
            Some(p) => self.open_dir(rel, p)?,
        };
        Ok((dir, name))
    }

    /// Open directory `dir_rel` (a prefix of `whole`, used in messages) component by component.
    pub(crate) fn open_dir(&self, whole: &str, dir_rel: &str) -> Result<OwnedFd, FsError> {
        let mut cur: Option<OwnedFd> = None;
        let mut end = 0usize;
        for comp in dir_rel.split('/') {
            check_component(whole, comp)?;
            end += comp.len() + usize::from(end > 0);
            let parent = cur.as_ref().map_or(self.fd.as_fd(), |f| f.as_fd());
            match openat(parent, &*os(comp), dir_flags(), Mode::empty()) {
                Ok(fd) => cur = Some(fd),
                Err(e) => {
                    let prefix = &dir_rel[..end];
                    return Err(classify_open_failure(parent, comp, whole, prefix, e));
                }
            }
        }
        match cur {
            Some(fd) => Ok(fd),
            None => Err(FsError::BadComponent {
                path: whole.to_owned(),
            }),
        }
    }

    /// What `rel` names (the last component is not followed). A missing parent is `Absent`.
    pub(crate) fn kind(&self, rel: &str) -> Result<NodeKind, FsError> {
        match self.open_parent(rel) {
            Ok((dir, name)) => kind_at(dir.as_fd(), &os(name), rel),
            Err(e) if e.is_not_found() => Ok(NodeKind::Absent),
            Err(e) => Err(e),
        }
    }

    /// Open `rel` for reading; it must be a regular file.
    pub(crate) fn open_file(&self, rel: &str) -> Result<File, FsError> {
        let (dir, name) = self.open_parent(rel)?;
        open_file_at(dir.as_fd(), &os(name), rel)
    }
}

/// The bytes a name or path component held as a `String` stands for (names that are not
/// UTF-8 are held escaped: see [`awcp_protocol::rawname`]), for a system call.
pub(crate) fn os(name: &str) -> Cow<'_, OsStr> {
    awcp_protocol::rawname::to_os(name)
}

/// Refuse the components that could leave the directory they are resolved in.
fn check_component(whole: &str, comp: &str) -> Result<(), FsError> {
    let raw = awcp_protocol::rawname::decode(comp);
    if comp.is_empty()
        || comp == "."
        || comp == ".."
        || raw.as_deref().map_or(true, |r| r.contains(&0))
    {
        return Err(FsError::BadComponent {
            path: whole.to_owned(),
        });
    }
    Ok(())
}

/// Turn a failed `openat(O_DIRECTORY | O_NOFOLLOW)` into a precise error.
fn classify_open_failure(
    parent: BorrowedFd<'_>,
    comp: &str,
    whole: &str,
    prefix: &str,
    e: Errno,
) -> FsError {
    let found = match fstatat(parent, &*os(comp), AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => NodeKind::of(&st),
        Err(Errno::ENOENT) => NodeKind::Absent,
        Err(_) => return io_err("open directory", prefix, e),
    };
    match found {
        NodeKind::Symlink => FsError::SymlinkInPath {
            path: whole.to_owned(),
            component: prefix.to_owned(),
        },
        NodeKind::Absent => FsError::ParentMissing {
            path: whole.to_owned(),
            component: prefix.to_owned(),
        },
        NodeKind::File | NodeKind::Special => FsError::NotDir {
            path: whole.to_owned(),
            component: prefix.to_owned(),
            found: found.describe(),
        },
        NodeKind::Dir => io_err("open directory", prefix, e),
    }
}

/// What `name` in `dir` is, without following a symlink.
pub(crate) fn kind_at(dir: BorrowedFd<'_>, name: &OsStr, rel: &str) -> Result<NodeKind, FsError> {
    match fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(NodeKind::of(&st)),
        Err(Errno::ENOENT) => Ok(NodeKind::Absent),
        Err(e) => Err(io_err("stat", rel, e)),
    }
}

/// Open regular file `name` in `dir` for reading.
pub(crate) fn open_file_at(dir: BorrowedFd<'_>, name: &OsStr, rel: &str) -> Result<File, FsError> {
    let fd = match openat(dir, name, read_flags(), Mode::empty()) {
        Ok(fd) => fd,
        // O_NOFOLLOW on a symlink gives ELOOP: say what it is rather than "too many links".
        Err(Errno::ELOOP) => {
            return Err(FsError::NotRegular {
                path: rel.to_owned(),
                found: NodeKind::Symlink.describe(),
            });
        }
        Err(e) => return Err(io_err("open", rel, e)),
    };
    let st = fstat(&fd).map_err(|e| io_err("stat", rel, e))?;
    match NodeKind::of(&st) {
        NodeKind::File => Ok(File::from(fd)),
        other => Err(FsError::NotRegular {
            path: rel.to_owned(),
            found: other.describe(),
        }),
    }
}

/// blake3 of the whole content of regular file `name` in `dir`.
pub(crate) fn hash_file_at(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    rel: &str,
) -> Result<blake3::Hash, FsError> {
    let file = open_file_at(dir, name, rel)?;
    let mut hasher = blake3::Hasher::new();
    hasher.update_reader(&file).map_err(|source| FsError::Io {
        op: "read",
        path: rel.to_owned(),
        source,
    })?;
    Ok(hasher.finalize())
}

/// Status change time of a stat result in nanoseconds since the epoch (saturating).
pub(crate) fn ctime_ns(st: &FileStat) -> i64 {
    st.st_ctime
        .saturating_mul(1_000_000_000)
        .saturating_add(st.st_ctime_nsec)
}

/// Modification time of a stat result in nanoseconds since the epoch (saturating).
pub(crate) fn mtime_ns(st: &FileStat) -> i64 {
    st.st_mtime
        .saturating_mul(1_000_000_000)
        .saturating_add(st.st_mtime_nsec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn tree() -> (tempfile::TempDir, tempfile::TempDir, RootDir) {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"top secret").unwrap();
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("d")).unwrap();
        std::fs::write(root.path().join("d/f"), b"hello").unwrap();
        std::fs::write(root.path().join("file"), b"x").unwrap();
        symlink(outside.path(), root.path().join("out")).unwrap();
        symlink(
            outside.path().join("secret"),
            root.path().join("secret-link"),
        )
        .unwrap();
        let r = RootDir::open(root.path()).unwrap();
        (outside, root, r)
    }

    #[test]
    fn reads_inside_and_refuses_every_escape() {
        let (_o, _root, r) = tree();
        let mut s = String::new();
        std::io::Read::read_to_string(&mut r.open_file("d/f").unwrap(), &mut s).unwrap();
        assert_eq!(s, "hello");
        assert!(matches!(
            r.open_file("out/secret"),
            Err(FsError::SymlinkInPath { ref component, .. }) if component == "out"
        ));
        assert!(matches!(
            r.open_file("secret-link"),
            Err(FsError::NotRegular { .. })
        ));
        assert!(matches!(r.open_file("file/x"), Err(FsError::NotDir { .. })));
        for bad in ["../x", "d/../../x", "./d/f", "d//f", ""] {
            assert!(
                matches!(r.open_file(bad), Err(FsError::BadComponent { .. })),
                "{bad:?} not refused"
            );
        }
        assert!(r.open_file("nope/x").unwrap_err().is_not_found());
    }

    #[test]
    fn kinds_do_not_follow_symlinks() {
        let (_o, _root, r) = tree();
        assert_eq!(r.kind("d").unwrap(), NodeKind::Dir);
        assert_eq!(r.kind("d/f").unwrap(), NodeKind::File);
        assert_eq!(r.kind("out").unwrap(), NodeKind::Symlink);
        assert_eq!(r.kind("missing/deeper").unwrap(), NodeKind::Absent);
        assert!(matches!(
            r.kind("out/secret"),
            Err(FsError::SymlinkInPath { .. })
        ));
    }

    #[test]
    fn fifo_never_blocks() {
        let (_o, root, r) = tree();
        nix::unistd::mkfifo(&root.path().join("fifo"), Mode::from_bits_truncate(0o644)).unwrap();
        assert!(matches!(
            r.open_file("fifo"),
            Err(FsError::NotRegular {
                found: "a special file",
                ..
            })
        ));
    }
}
