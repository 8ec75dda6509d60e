//! Merging a snapshot into the Delegator's resources, file by file, with conflict checks.
//!
//! Three versions of each path meet: the one sent (its hash in the [`BaseManifest`]), the
//! Executor's (in the snapshot) and the Delegator's now (on disk). Only a path whose
//! Delegator version is still the one sent is changed; otherwise the Executor's version is
//! kept beside it as `<path>.awcp-conflict-<tag>` and the Delegator's stays. Paths are
//! written through real directories only: a symbolic link on the Delegator's side is never
//! followed, so a snapshot cannot write outside a resource.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use awcp_protocol::dataplane::Conflict;
use serde::{Deserialize, Serialize};

use super::{ArchiveError, BaseManifest, Filter, ScanLimits, file_sha256, io_err};

/// One resource a snapshot may change.
#[derive(Debug, Clone)]
pub struct ApplyTarget {
    /// The resource's name (its directory in the snapshot).
    pub name: String,
    /// Its directory on the Delegator.
    pub root: PathBuf,
    /// `rw`: only writable resources are changed.
    pub writable: bool,
}

/// What [`apply`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApplyReport {
    /// Files written (`<resource>/<path>`).
    pub written: Vec<String>,
    /// Files removed because the Executor deleted them.
    pub deleted: Vec<String>,
    /// Paths left as the Delegator has them, with why.
    pub conflicts: Vec<Conflict>,
    /// Ours (`awcpfs` staged change sets): files the AECP commit screen held, as it holds a
    /// live write-back — not applied, still in the change set, with the screen's reason and
    /// report.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<awcp_protocol::dataplane::Held>,
}

/// The state of a path on the Delegator.
#[derive(Debug, PartialEq, Eq)]
enum Local {
    Missing,
    File(String),
    /// A directory, a link, or a path through a link: not ours to replace.
    Other(&'static str),
}

/// Look at `root/rel` without following any symbolic link on the way.
fn local_state(root: &Path, rel: &str) -> Result<Local, ArchiveError> {
    let mut p = root.to_path_buf();
    let parts: Vec<&str> = rel.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        p.push(part);
        let meta = match std::fs::symlink_metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Local::Missing),
            Err(e) => return Err(io_err(&p)(e)),
        };
        let last = i + 1 == parts.len();
        if meta.file_type().is_symlink() {
            return Ok(Local::Other("a symbolic link on the Delegator"));
        }
        if !last && !meta.is_dir() {
            return Ok(Local::Other("a file where the snapshot has a directory"));
        }
        if last {
            if meta.is_dir() {
                return Ok(Local::Other("a directory on the Delegator"));
            }
            if !meta.is_file() {
                return Ok(Local::Other("not a regular file on the Delegator"));
            }
            return Ok(Local::File(file_sha256(&p)?));
        }
    }
    Ok(Local::Missing)
}

/// Create the missing directories of `root/rel`'s parent (never through a link).
fn make_parents(root: &Path, rel: &str) -> Result<(), ArchiveError> {
    let mut p = root.to_path_buf();
    let parts: Vec<&str> = rel.split('/').collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        p.push(part);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() && !m.file_type().is_symlink() => {}
            Ok(_) => {
                return Err(io_err(&p)(std::io::Error::other(
                    "not a directory (or a link)",
                )));
            }
            Err(_) => std::fs::create_dir(&p).map_err(io_err(&p))?,
        }
    }
    Ok(())
}

/// Copy `src` over `root/rel` atomically (a temporary file in the same directory, renamed).
fn install(src: &Path, root: &Path, rel: &str) -> Result<(), ArchiveError> {
    use std::os::unix::fs::PermissionsExt;
    make_parents(root, rel)?;
    let dest = root.join(rel);
    let dir = dest.parent().unwrap_or(root);
    let tmp = dir.join(format!(".awcp-apply-{}", crate::random_token()));
    std::fs::copy(src, &tmp).map_err(io_err(&tmp))?;
    let mode = std::fs::metadata(src).map_err(io_err(src))?.permissions();
    let _ = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode.mode() & 0o777));
    std::fs::rename(&tmp, &dest).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err(&dest)(e)
    })
}

/// The files of one resource in an unpacked snapshot: relative path → file, and its
/// directories.
fn snapshot_tree(
    dir: &Path,
) -> Result<(BTreeMap<String, PathBuf>, BTreeSet<String>), ArchiveError> {
    let scan = super::walk::scan(dir, &Filter::everything())?;
    let files = scan
        .files
        .into_iter()
        .map(|f| (f.rel.clone(), dir.join(&f.rel)))
        .collect();
    let dirs = scan.dirs.into_iter().map(|d| d.rel).collect();
    Ok((files, dirs))
}

/// Merge `snapshot` (a zip of `<resource>/…`) into `targets`. `scratch` is a directory the
/// Delegator owns outside every resource (the snapshot is unpacked there first, with the
/// checks of [`extract`](super::extract)); `tag` names conflict copies. A resource whose
/// directory the snapshot lacks is left alone, as the reference does.
///
/// `base` becomes the snapshot's content for every resource merged, so the next snapshot
/// of a multi-round session is compared with what the Executor had, not with the first
/// send (a conflict kept here is then not reported again unless the Executor changes that
/// file again).
pub fn apply(
    snapshot: &[u8],
    base: &mut BaseManifest,
    targets: &[ApplyTarget],
    scratch: &Path,
    tag: &str,
    limits: &ScanLimits,
) -> Result<ApplyReport, ArchiveError> {
    let unpacked = scratch.join(format!("unpack-{tag}-{}", crate::random_token()));
    let _ = awcpfs::private::create_dir_all(scratch);
    let result = super::extract(snapshot, &unpacked, limits)
        .and_then(|_| merge(&unpacked, base, targets, tag));
    let _ = std::fs::remove_dir_all(&unpacked);
    result
}

fn merge(
    unpacked: &Path,
    base: &mut BaseManifest,
    targets: &[ApplyTarget],
    tag: &str,
) -> Result<ApplyReport, ArchiveError> {
    let mut report = ApplyReport::default();
    let empty = BTreeMap::new();
    for t in targets.iter().filter(|t| t.writable) {
        let dir = unpacked.join(&t.name);
        if !dir.is_dir() {
            continue;
        }
        let sent = base.get(&t.name).unwrap_or(&empty).clone();
        let sent = &sent;
        let mut now_theirs = BTreeMap::new();
        let (files, dirs) = snapshot_tree(&dir)?;
        let shown = |rel: &str| format!("{}/{rel}", t.name);
        let mut conflict = |rel: &str, reason: &str, kept: Option<&Path>| {
            let kept_as = kept.and_then(|src| {
                let copy = format!("{rel}.awcp-conflict-{tag}");
                install(src, &t.root, &copy).ok().map(|_| shown(&copy))
            });
            report.conflicts.push(Conflict {
                path: shown(rel),
                reason: reason.to_string(),
                kept_as,
            });
        };
        for d in &dirs {
            if let Local::Missing = local_state(&t.root, d)? {
                make_parents(&t.root, &format!("{d}/x"))?;
            }
        }
        let mut written = Vec::new();
        for (rel, src) in &files {
            let theirs = file_sha256(src)?;
            now_theirs.insert(rel.clone(), theirs.clone());
            let was = sent.get(rel);
            match local_state(&t.root, rel)? {
                Local::File(ours) if ours == theirs => {}
                Local::Other(why) => conflict(rel, why, Some(src)),
                now => {
                    let unchanged = match (&now, was) {
                        (Local::Missing, None) => true,
                        (Local::File(ours), Some(was)) => ours == was,
                        _ => false,
                    };
                    if unchanged {
                        install(src, &t.root, rel)?;
                        written.push(shown(rel));
                    } else if was.is_some_and(|w| *w == theirs) {
                        // The Executor left it as sent; the Delegator's change stands.
                    } else {
                        let why = match (&now, was) {
                            (Local::Missing, Some(_)) => {
                                "deleted on the Delegator, changed by the Executor"
                            }
                            (_, None) => "created on both sides with different content",
                            _ => "changed on both sides",
                        };
                        conflict(rel, why, Some(src));
                    }
                }
            }
        }
        report.written.extend(written);
        for (rel, was) in sent {
            if files.contains_key(rel) {
                continue;
            }
            match local_state(&t.root, rel)? {
                Local::Missing => {}
                Local::File(ours) if ours == *was => {
                    let p = t.root.join(rel);
                    std::fs::remove_file(&p).map_err(io_err(&p))?;
                    report.deleted.push(shown(rel));
                }
                Local::File(_) => conflict(
                    rel,
                    "deleted by the Executor, changed on the Delegator",
                    None,
                ),
                Local::Other(why) => conflict(rel, why, None),
            }
        }
        // Directories the Executor removed, emptied by the deletions above: remove them if
        // they are empty now (never a non-empty one).
        let mut candidates: Vec<String> = sent
            .keys()
            .flat_map(|rel| {
                let parts: Vec<&str> = rel.split('/').collect();
                (1..parts.len())
                    .map(|i| parts[..i].join("/"))
                    .collect::<Vec<_>>()
            })
            .filter(|d| !dirs.contains(d))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        // Deepest first.
        candidates.sort_by_key(|d| std::cmp::Reverse(d.matches('/').count()));
        for d in candidates {
            if let Local::Other("a directory on the Delegator") = local_state(&t.root, &d)? {
                let _ = std::fs::remove_dir(t.root.join(&d));
            }
        }
        base.insert(t.name.clone(), now_theirs);
    }
    Ok(report)
}

/// How a snapshot changes one file relative to what was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Change {
    /// Not sent; in the snapshot.
    Added,
    /// Sent; different in the snapshot.
    Modified,
    /// Sent; not in the snapshot.
    Deleted,
    /// Moved from `from` with its content unchanged (`awcpfs` change sets).
    Renamed,
}

/// One changed file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileChange {
    /// `<resource>/<path>`.
    pub path: String,
    /// How.
    pub change: Change,
    /// For a rename: the old `<resource>/<path>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// One line on what changed where no text diff says it: a binary file, a mode, a
    /// symlink, a directory (`awcpfs` change sets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The change as a unified diff, for a text file (`awcpfs` change sets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
}

/// What a snapshot changes relative to what was sent, sorted by path (resources the
/// snapshot has no directory for are left out, as [`apply`] leaves them alone).
pub fn diff(
    snapshot: &[u8],
    base: &BaseManifest,
    scratch: &Path,
    limits: &ScanLimits,
) -> Result<Vec<FileChange>, ArchiveError> {
    let unpacked = scratch.join(format!("diff-{}", crate::random_token()));
    let _ = awcpfs::private::create_dir_all(scratch);
    let result = super::extract(snapshot, &unpacked, limits).and_then(|_| {
        let mut out = Vec::new();
        for (name, sent) in base {
            let dir = unpacked.join(name);
            if !dir.is_dir() {
                continue;
            }
            let (files, _) = snapshot_tree(&dir)?;
            for (rel, src) in &files {
                let change = match sent.get(rel) {
                    None => Change::Added,
                    Some(h) if *h != file_sha256(src)? => Change::Modified,
                    Some(_) => continue,
                };
                out.push(FileChange {
                    path: format!("{name}/{rel}"),
                    change,
                    from: None,
                    detail: None,
                    patch: None,
                });
            }
            for rel in sent.keys().filter(|r| !files.contains_key(*r)) {
                out.push(FileChange {
                    path: format!("{name}/{rel}"),
                    change: Change::Deleted,
                    from: None,
                    detail: None,
                    patch: None,
                });
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    });
    let _ = std::fs::remove_dir_all(&unpacked);
    result
}

/// The paths a snapshot changes relative to what was sent (`<resource>/<path>`), for
/// `metadata.changedFiles`.
pub fn changed_files(
    snapshot: &[u8],
    base: &BaseManifest,
    scratch: &Path,
    limits: &ScanLimits,
) -> Result<Vec<String>, ArchiveError> {
    Ok(diff(snapshot, base, scratch, limits)?
        .into_iter()
        .map(|c| c.path)
        .collect())
}
