//! What a standalone export (`awcpfs export`) keeps in its state directory so that a restart
//! serves the same delegation: its export id, its capability token and the lease's expiry.
//!
//! Without it, a restarted export drew a new id and token, so the mount's handle pointed at
//! an export that no longer existed (404): the mount could not resume and `awcpfs recover`
//! failed. With it, an export restarted with the same directory and `--state-dir` answers
//! the old handle: a running mount goes on where it was, and recovery works. The manifest
//! is walked again at the restart (the tree may have changed meanwhile, not least through
//! the mount's own commits), so the handle the restarted export prints has a new
//! `manifestDigest`; only a *new* mount needs that handle.
//!
//! One file per exported directory, `<state-dir>/export-<hash of the root>.json`, mode 0600
//! (it holds the token), written to a temporary name, fsynced and renamed. A lease that has
//! ended by the restart is not revived: the export starts a new delegation (new id and
//! token) and says so.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// A standalone export's identity across restarts.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExportIdentity {
    /// The exported directory (canonical).
    pub root: PathBuf,
    /// The export id.
    pub export_id: String,
    /// The capability token.
    pub token: String,
    /// When the lease ends (RFC 3339).
    pub expires_at: String,
}

/// How [`load_or_create`] found the identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// None was saved: a new one.
    New,
    /// The saved one, whose lease has this much left.
    Resumed {
        /// Lease left.
        remaining: Duration,
    },
    /// The saved one's lease had ended: a new one replaced it.
    Replaced {
        /// When the old lease ended.
        expired_at: String,
    },
}

/// Why the identity could not be read or saved.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// Reading or writing the file failed.
    #[error("cannot read or write the export's identity file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not an identity.
    #[error(
        "{path} is not a saved export identity ({message}); move it away to start a new \
         delegation (the old handle then stops working)"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parser's words.
        message: String,
    },
}

/// The identity file for `root` in `state_dir`.
pub fn identity_path(state_dir: &Path, root: &Path) -> PathBuf {
    let h = blake3::hash(root.as_os_str().as_encoded_bytes()).to_hex();
    state_dir.join(format!("export-{}.json", &h[..16]))
}

/// The saved identity of the export of `root` if its lease is still running, else a new
/// one with a lease of `ttl` (saved before it is returned).
pub fn load_or_create(
    state_dir: &Path,
    root: &Path,
    ttl: Duration,
) -> Result<(ExportIdentity, Origin), IdentityError> {
    let path = identity_path(state_dir, root);
    let io = |source| IdentityError::Io {
        path: path.clone(),
        source,
    };
    let mut replaced = None;
    match std::fs::read(&path) {
        Ok(bytes) => {
            let saved: ExportIdentity =
                serde_json::from_slice(&bytes).map_err(|e| IdentityError::Corrupt {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            let end = chrono::DateTime::parse_from_rfc3339(&saved.expires_at).map_err(|e| {
                IdentityError::Corrupt {
                    path: path.clone(),
                    message: format!("expiresAt: {e}"),
                }
            })?;
            let end: SystemTime = end.with_timezone(&chrono::Utc).into();
            match end.duration_since(SystemTime::now()) {
                Ok(remaining) if saved.root == root && !remaining.is_zero() => {
                    return Ok((saved, Origin::Resumed { remaining }));
                }
                _ => replaced = Some(saved.expires_at),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let expires: chrono::DateTime<chrono::Utc> = (SystemTime::now() + ttl).into();
    let id = ExportIdentity {
        root: root.to_path_buf(),
        export_id: format!("exp_{}", hex::encode(rand::random::<[u8; 8]>())),
        token: hex::encode(rand::random::<[u8; 32]>()),
        expires_at: expires.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    };
    save(&path, &id).map_err(io)?;
    let origin = match replaced {
        Some(expired_at) => Origin::Replaced { expired_at },
        None => Origin::New,
    };
    Ok((id, origin))
}

/// Write `id` to `path`, mode 0600, atomically.
fn save(path: &Path, id: &ExportIdentity) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&serde_json::to_vec_pretty(id).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_restart_resumes_the_saved_identity_until_its_lease_ends() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let (first, origin) = load_or_create(tmp.path(), &root, Duration::from_secs(60)).unwrap();
        assert_eq!(origin, Origin::New);
        let path = identity_path(tmp.path(), &root);
        // It holds the token: owner only.
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        let (again, origin) = load_or_create(tmp.path(), &root, Duration::from_secs(5)).unwrap();
        assert_eq!(again, first);
        match origin {
            Origin::Resumed { remaining } => {
                assert!(remaining > Duration::from_secs(30), "{remaining:?}")
            }
            other => panic!("not resumed: {other:?}"),
        }
        // Another directory with the same state directory has its own identity.
        let (other, _) =
            load_or_create(tmp.path(), &tmp.path().join("b"), Duration::from_secs(60)).unwrap();
        assert_ne!(other.export_id, first.export_id);
        assert_ne!(other.token, first.token);
        // An ended lease is not revived.
        let mut old = first.clone();
        old.expires_at = "2001-01-01T00:00:00.000Z".into();
        save(&path, &old).unwrap();
        let (fresh, origin) = load_or_create(tmp.path(), &root, Duration::from_secs(60)).unwrap();
        assert_ne!(fresh.export_id, first.export_id);
        assert_eq!(
            origin,
            Origin::Replaced {
                expired_at: "2001-01-01T00:00:00.000Z".into()
            }
        );
    }

    #[test]
    fn a_damaged_identity_file_is_an_error_that_says_what_to_do() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::write(identity_path(tmp.path(), &root), "{not json").unwrap();
        let err = load_or_create(tmp.path(), &root, Duration::from_secs(60)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("move it away"), "{msg}");
    }
}
