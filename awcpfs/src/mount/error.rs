//! The filesystem layer's error type, and its one mapping to errno.
//!
//! Operations return [`FsError`]; only the FUSE adapter turns it into an errno, through
//! [`FsError::errno`], an exhaustive match with the reason for each non-obvious choice.

use fuser::Errno;

use super::remote::RemoteError;

/// Why access to the mount ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EndReason {
    /// The Delegator revoked the lease.
    Revoked,
    /// The lease ran out without renewal.
    Expired,
    /// The Executor (or the operator) ended the task and unmounted.
    Unmounted,
}

impl std::fmt::Display for EndReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EndReason::Revoked => "the lease was revoked",
            EndReason::Expired => "the lease expired",
            EndReason::Unmounted => "the mount was closed",
        })
    }
}

/// A failed filesystem operation.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// No such entry.
    #[error("no such file or directory")]
    NotFound,
    /// The name is taken.
    #[error("file exists")]
    Exists,
    /// A directory was expected.
    #[error("not a directory")]
    NotDir,
    /// A non-directory was expected.
    #[error("is a directory")]
    IsDir,
    /// rmdir or rename over a non-empty directory.
    #[error("directory not empty")]
    NotEmpty,
    /// The request makes no sense (e.g. moving a directory into itself).
    #[error("invalid argument: {what}")]
    Invalid {
        /// What.
        what: &'static str,
    },
    /// Over 255 bytes.
    #[error("file name too long")]
    NameTooLong,
    /// `ro` delegation.
    #[error("the delegation is read-only")]
    ReadOnly,
    /// The lease ended: the mount is fenced.
    #[error("access ended: {reason}")]
    Fenced {
        /// Why.
        reason: EndReason,
    },
    /// Unknown file handle.
    #[error("bad file handle")]
    BadHandle,
    /// A hard link to a directory.
    #[error("hard links to directories are not allowed")]
    NoHardLinks,
    /// No such extended attribute.
    #[error("no such extended attribute")]
    NoAttr,
    /// The caller's buffer is too small for the attribute value or list.
    #[error("the buffer is too small")]
    AttrRange,
    /// An extended attribute value or the inode's attributes together are too large.
    #[error("extended attribute too large: {what}")]
    AttrTooBig {
        /// Which limit.
        what: &'static str,
    },
    /// The file is present on the Delegator but its content is withheld (excluded or
    /// sensitive): it cannot be read, written, renamed or removed on the mount.
    #[error("the Delegator withholds this file (excluded or sensitive)")]
    Withheld,
    /// Not implemented by awcpfs.
    #[error("{op} is not supported on awcpfs")]
    Unsupported {
        /// Which operation.
        op: &'static str,
    },
    /// Fetching content from the export failed.
    #[error("fetching content from the Delegator failed")]
    Remote {
        /// Why.
        #[source]
        source: RemoteError,
    },
    /// A fetch of the same file from the export failed a moment ago (or while this
    /// operation waited for it): this one fails at once instead of waiting a second
    /// request deadline.
    #[error(
        "fetching this file from the Delegator failed a moment ago; the export is unreachable \
         or too slow (try again)"
    )]
    FetchFailedRecently,
    /// Local I/O on the state directory failed.
    #[error("local I/O failed")]
    Io {
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl From<std::io::Error> for FsError {
    fn from(source: std::io::Error) -> Self {
        FsError::Io { source }
    }
}

impl From<RemoteError> for FsError {
    fn from(source: RemoteError) -> Self {
        FsError::Remote { source }
    }
}

impl FsError {
    /// The errno the kernel hands to the caller.
    pub fn errno(&self) -> Errno {
        match self {
            FsError::NotFound => Errno::ENOENT,
            FsError::Exists => Errno::EEXIST,
            FsError::NotDir => Errno::ENOTDIR,
            FsError::IsDir => Errno::EISDIR,
            FsError::NotEmpty => Errno::ENOTEMPTY,
            FsError::Invalid { .. } => Errno::EINVAL,
            FsError::NameTooLong => Errno::ENAMETOOLONG,
            FsError::ReadOnly => Errno::EROFS,
            // EACCES, not EIO: the data is intact, the caller simply has no right any more.
            // Tools print "Permission denied", which is the truth.
            FsError::Fenced { .. } => Errno::EACCES,
            FsError::BadHandle => Errno::EBADF,
            FsError::Unsupported { .. } => Errno::EOPNOTSUPP,
            // link(2): "EPERM oldpath is a directory."
            FsError::NoHardLinks => Errno::EPERM,
            // "Permission denied": the file is there (stat works, git's index matches),
            // but this mount may not touch it. ENOENT would make it look deleted.
            FsError::Withheld => Errno::EACCES,
            // getxattr(2)/removexattr(2): "ENODATA The named attribute does not exist".
            FsError::NoAttr => Errno::ENODATA,
            FsError::AttrRange => Errno::ERANGE,
            // setxattr(2): "E2BIG The size of name or value exceeds a filesystem-specific
            // limit"; ENOSPC would suggest the disk is full.
            FsError::AttrTooBig { .. } => Errno::E2BIG,
            FsError::Remote { source } => match source {
                // The lease ended between the fence check and the fetch.
                RemoteError::Unauthorized { .. } | RemoteError::LeaseEnded { .. } => Errno::EACCES,
                // Network and export failures are I/O errors to the caller: the operation
                // may succeed again later.
                RemoteError::Refused { .. }
                | RemoteError::Transport { .. }
                | RemoteError::Protocol { .. }
                | RemoteError::BadBlock { .. }
                | RemoteError::Io { .. } => Errno::EIO,
            },
            // The same EIO the failed fetch it repeats gave.
            FsError::FetchFailedRecently => Errno::EIO,
            FsError::Io { source } => source
                .raw_os_error()
                .map(Errno::from_i32)
                .unwrap_or(Errno::EIO),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_choices() {
        assert_eq!(
            FsError::Fenced {
                reason: EndReason::Revoked
            }
            .errno(),
            Errno::EACCES
        );
        assert_eq!(FsError::ReadOnly.errno(), Errno::EROFS);
        let enospc = std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(FsError::from(enospc).errno(), Errno::ENOSPC);
    }
}
