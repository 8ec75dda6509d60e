//! The reference's `archive` transport: the delegated resources travel as one zip inside
//! START (`workspaceBase64`, with the sha256 of the zip as `checksum`), and the result comes
//! back as a zip in the SSE `snapshot` event.
//!
//! Layout, as the reference's: every entry is `<resourceName>/<relative path>`; directories
//! have their own entries (so empty ones survive); no symbolic links travel.
//!
//! Both ends are here:
//! * the Delegator [`build`]s the zip (admission first: size, file count, per-file size,
//!   sensitive files) and keeps a [`BaseManifest`] — the sha256 of every file it sent — so
//!   that [`apply`] can merge the snapshot file by file: a file the Delegator has not
//!   touched since is replaced, a file changed on both sides is a conflict (the Executor's
//!   version is kept beside it, the Delegator's stays), and nothing is ever removed except a
//!   single file the Executor deleted and the Delegator had not changed. Unlike the
//!   reference, a resource directory is never deleted and re-copied.
//! * the Executor [`extract`]s the zip into a fresh work directory — refusing entries that
//!   would escape it (absolute paths, `..`), symbolic links, duplicate entries and more data
//!   than its limits allow — and [`pack_dir`]s the work directory as the snapshot.
//!
//! Everything here is blocking file I/O: call it from `spawn_blocking`.

mod apply;
mod walk;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use zip::write::SimpleFileOptions;

pub use apply::{ApplyReport, ApplyTarget, Change, FileChange, apply, changed_files, diff};
pub(crate) use walk::glob_path as glob_matches;
pub(crate) use walk::scan;
pub use walk::{Filter, ScanLimits};

/// The sensitive-file patterns of the reference (basename globs): refused by admission.
pub const DEFAULT_SENSITIVE: &[&str] = &[
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "id_rsa",
    "id_rsa.*",
    "id_ed25519",
    "id_ed25519.*",
    "id_ecdsa",
    "id_ecdsa.*",
    "credentials.json",
    "service-account*.json",
    ".npmrc",
    ".pypirc",
];

/// Why an archive could not be built, read or applied.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// Which file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The zip library failed (a corrupt or truncated zip).
    #[error("the zip is unreadable: {source}")]
    Zip {
        /// Why.
        #[source]
        source: zip::result::ZipError,
    },
    /// The workspace exceeds a limit.
    #[error("Workspace exceeds size limits: {detail}")]
    TooLarge {
        /// Which limit, with the numbers.
        detail: String,
    },
    /// Sensitive files would be sent.
    #[error("Sensitive files detected: {}", files.join(", "))]
    Sensitive {
        /// Their paths, `<resource>/<path>`.
        files: Vec<String>,
    },
    /// A zip entry is not acceptable (it would escape the directory, is a link, …).
    #[error("unsafe zip entry `{name}`: {reason}")]
    UnsafeEntry {
        /// The entry's name as stored.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ArchiveError + '_ {
    move |source| ArchiveError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn zip_err(source: zip::result::ZipError) -> ArchiveError {
    ArchiveError::Zip { source }
}

/// sha256 of `bytes`, lowercase hex: the `checksum` of an archive handle.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// sha256 of a file's content, hex.
pub(crate) fn file_sha256(path: &Path) -> Result<String, ArchiveError> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// What the Delegator sent: resource name → relative path → sha256 of the content.
pub type BaseManifest = BTreeMap<String, BTreeMap<String, String>>;

/// One resource to pack: its name (top-level directory in the zip) and local directory.
#[derive(Debug, Clone)]
pub struct SourceResource {
    /// The resource's name.
    pub name: String,
    /// Its directory on the Delegator.
    pub root: PathBuf,
    /// Which files travel.
    pub filter: Filter,
}

/// A built archive.
pub struct Built {
    /// The zip.
    pub bytes: Vec<u8>,
    /// sha256 of `bytes`, hex.
    pub checksum: String,
    /// What was sent, for the merge of the snapshot.
    pub base: BaseManifest,
    /// Files packed.
    pub files: u64,
    /// Their total size.
    pub total_bytes: u64,
    /// Paths left out (links out of the resource, unnamed files), for the record.
    pub skipped: Vec<String>,
}

impl std::fmt::Debug for Built {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Built")
            .field("len", &self.bytes.len())
            .field("checksum", &self.checksum)
            .field("files", &self.files)
            .field("total_bytes", &self.total_bytes)
            .finish_non_exhaustive()
    }
}

fn options(mode: u32, size: u64) -> SimpleFileOptions {
    SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated)
        .compression_level(Some(6))
        .unix_permissions(mode & 0o777)
        .large_file(size >= u64::from(u32::MAX))
}

/// Admission and packing on the Delegator: check every resource against `limits` and the
/// sensitive patterns, then zip them as `<name>/…`.
pub fn build(resources: &[SourceResource], limits: &ScanLimits) -> Result<Built, ArchiveError> {
    // Scan everything first, so a refusal costs no compression.
    let mut scans = Vec::new();
    let (mut files, mut total) = (0u64, 0u64);
    let mut sensitive = Vec::new();
    let mut skipped = Vec::new();
    for r in resources {
        let scan = walk::scan(&r.root, &r.filter)?;
        for f in &scan.files {
            files += 1;
            total += f.size;
            if f.size > limits.max_file_bytes {
                return Err(ArchiveError::TooLarge {
                    detail: format!(
                        "{}/{} is {} (limit per file {})",
                        r.name,
                        f.rel,
                        human(f.size),
                        human(limits.max_file_bytes)
                    ),
                });
            }
        }
        sensitive.extend(scan.sensitive.iter().map(|p| format!("{}/{p}", r.name)));
        skipped.extend(scan.skipped.iter().map(|p| format!("{}/{p}", r.name)));
        scans.push(scan);
    }
    if files > limits.max_files {
        return Err(ArchiveError::TooLarge {
            detail: format!("{files} files (limit {})", limits.max_files),
        });
    }
    if total > limits.max_total_bytes {
        return Err(ArchiveError::TooLarge {
            detail: format!(
                "Workspace size ({}) exceeds limit ({})",
                human(total),
                human(limits.max_total_bytes)
            ),
        });
    }
    if !sensitive.is_empty() {
        return Err(ArchiveError::Sensitive { files: sensitive });
    }
    let mut zw = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let mut base = BaseManifest::new();
    for (r, scan) in resources.iter().zip(&scans) {
        let sent = base.entry(r.name.clone()).or_default();
        zw.add_directory(format!("{}/", r.name), options(0o755, 0))
            .map_err(zip_err)?;
        for d in &scan.dirs {
            zw.add_directory(format!("{}/{}/", r.name, d.rel), options(d.mode, 0))
                .map_err(zip_err)?;
        }
        for f in &scan.files {
            let path = r.root.join(&f.rel);
            let data = std::fs::read(&path).map_err(io_err(&path))?;
            zw.start_file(
                format!("{}/{}", r.name, f.rel),
                options(f.mode, data.len() as u64),
            )
            .map_err(zip_err)?;
            zw.write_all(&data).map_err(io_err(&path))?;
            sent.insert(f.rel.clone(), sha256_hex(&data));
        }
    }
    let bytes = zw.finish().map_err(zip_err)?.into_inner();
    Ok(Built {
        checksum: sha256_hex(&bytes),
        bytes,
        base,
        files,
        total_bytes: total,
        skipped,
    })
}

/// Sizes as the reference prints them (`120.0MB`).
fn human(n: u64) -> String {
    format!("{:.1}MB", n as f64 / (1024.0 * 1024.0))
}

/// The parts of a zip entry name, checked: relative, no `..`, no empty or `.` parts, no
/// backslashes or NULs (which other systems read as separators or terminators).
pub(crate) fn safe_parts(name: &str) -> Result<Vec<&str>, &'static str> {
    if name.starts_with('/') {
        return Err("absolute path");
    }
    if name.contains('\\') || name.contains('\0') {
        return Err("backslash or NUL in the name");
    }
    let trimmed = name.strip_suffix('/').unwrap_or(name);
    if trimmed.is_empty() {
        return Err("empty name");
    }
    let parts: Vec<&str> = trimmed.split('/').collect();
    for p in &parts {
        match *p {
            "" => return Err("empty path component"),
            "." => return Err("`.` path component"),
            ".." => return Err("`..` would leave the directory"),
            _ => {}
        }
    }
    Ok(parts)
}

/// What [`extract`] unpacked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtractStats {
    /// Files written.
    pub files: u64,
    /// Their total size.
    pub bytes: u64,
}

/// Unpack `zip` into `dest`, which must not exist yet (it is created). Refuses, before or
/// while writing: entries that would leave `dest`, symbolic links, duplicate entries, more
/// than `limits` allows (counting the real decompressed bytes, so a zip bomb stops at the
/// limit). On error, `dest` may hold part of the archive; remove it.
pub fn extract(zip: &[u8], dest: &Path, limits: &ScanLimits) -> Result<ExtractStats, ArchiveError> {
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(zip)).map_err(zip_err)?;
    std::fs::create_dir(dest).map_err(io_err(dest))?;
    let mut stats = ExtractStats::default();
    for i in 0..archive.len() {
        let mut entry = archive.by_index(i).map_err(zip_err)?;
        let name = entry.name().map_err(zip_err)?.into_owned();
        let unsafe_entry = |reason| ArchiveError::UnsafeEntry {
            name: name.clone(),
            reason,
        };
        let parts = safe_parts(&name).map_err(unsafe_entry)?;
        if entry.is_symlink() {
            return Err(unsafe_entry("symbolic links are not accepted"));
        }
        let target = parts.iter().fold(dest.to_path_buf(), |p, c| p.join(c));
        if entry.is_dir() {
            std::fs::create_dir_all(&target).map_err(io_err(&target))?;
            continue;
        }
        stats.files += 1;
        if stats.files > limits.max_files {
            return Err(ArchiveError::TooLarge {
                detail: format!("more than {} files", limits.max_files),
            });
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        let mode = entry.unix_mode().map(|m| m & 0o777).unwrap_or(0o644) | 0o600;
        let mut out = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&target)
                .map_err(|e| {
                    if e.kind() == std::io::ErrorKind::AlreadyExists {
                        unsafe_entry("duplicate entry")
                    } else {
                        io_err(&target)(e)
                    }
                })?
        };
        let room = limits
            .max_total_bytes
            .saturating_sub(stats.bytes)
            .min(limits.max_file_bytes);
        let n = std::io::copy(&mut (&mut entry).take(room + 1), &mut out).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                zip_err(zip::result::ZipError::Io(e))
            } else {
                io_err(&target)(e)
            }
        })?;
        if n > room {
            return Err(ArchiveError::TooLarge {
                detail: format!(
                    "{name} unpacks past the limit ({} per file, {} in all)",
                    human(limits.max_file_bytes),
                    human(limits.max_total_bytes)
                ),
            });
        }
        stats.bytes += n;
    }
    Ok(stats)
}

/// Zip the whole of `dir` (the Executor's work directory) as a snapshot: paths relative to
/// `dir`, directories included, symbolic links left out. Returns the zip, the number of
/// files and their total size.
pub fn pack_dir(dir: &Path) -> Result<(Vec<u8>, u64, u64), ArchiveError> {
    let scan = walk::scan(dir, &Filter::everything())?;
    let mut zw = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for d in &scan.dirs {
        zw.add_directory(format!("{}/", d.rel), options(d.mode, 0))
            .map_err(zip_err)?;
    }
    let mut total = 0;
    for f in &scan.files {
        let path = dir.join(&f.rel);
        let data = std::fs::read(&path).map_err(io_err(&path))?;
        total += data.len() as u64;
        zw.start_file(f.rel.clone(), options(f.mode, data.len() as u64))
            .map_err(zip_err)?;
        zw.write_all(&data).map_err(io_err(&path))?;
    }
    let bytes = zw.finish().map_err(zip_err)?.into_inner();
    Ok((bytes, scan.files.len() as u64, total))
}

#[cfg(test)]
mod tests;
