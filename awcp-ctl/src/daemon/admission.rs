//! Admission on the Delegator, for both transports: which files a resource shows
//! (include/exclude globs, `.gitignore` on request, sensitive files), and limits on size and
//! file count.
//!
//! For `archive` the check runs over the tree before it is zipped
//! ([`archive::build`](crate::archive::build)). For `awcpfs` it runs in the export's single
//! manifest walk: the export is registered with a [`PathFilter`] that hides excluded and
//! sensitive paths — so they are invisible on the mount and refused in commits — and records
//! the sensitive files it hid during that walk; the delegation is refused if there are any
//! (as the reference refuses them), or if the manifest is over the limits.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use awcp_protocol::ErrorCode;
use awcp_protocol::api::ResourceSpec;
use awcp_protocol::dataplane::{EntryKind, ManifestEntry};
use awcpfs::export::PathFilter;

use super::Daemon;
use super::flow::Refusal;
use crate::archive::{Filter, ScanLimits};

impl Daemon {
    /// The filter of one resource: its include/exclude globs, its root `.gitignore` when
    /// asked for, and the daemon's sensitive patterns.
    pub(crate) fn resource_filter(&self, r: &ResourceSpec, root: &Path) -> Filter {
        let mut f = Filter {
            include: r.include.clone().unwrap_or_default(),
            exclude: r.exclude.clone().unwrap_or_default(),
            sensitive: self.cfg.sensitive.clone(),
            allow_sensitive: r.allow_sensitive.clone().unwrap_or_default(),
        };
        if r.gitignore == Some(true) {
            f.add_gitignore(root);
        }
        f
    }
}

/// The sensitive files an export's filter hid while recording.
#[derive(Debug, Default)]
pub(crate) struct SensitiveHits {
    hits: Mutex<Vec<String>>,
    recording: AtomicBool,
}

impl SensitiveHits {
    /// Stop recording (after the manifest walk) and return what was hidden.
    pub(crate) fn take(&self) -> Vec<String> {
        self.recording.store(false, Ordering::SeqCst);
        std::mem::take(&mut *self.hits.lock())
    }
}

/// An export filter from `filter`; with `record`, it records the sensitive files it hides
/// until [`SensitiveHits::take`].
pub(crate) fn export_filter(filter: Filter, record: bool) -> (PathFilter, Arc<SensitiveHits>) {
    export_filter_with(filter, Arc::new(Withheld::default()), record)
}

/// [`export_filter`] for an export that builds a manifest of `root`: the hidden files git
/// tracks there are withheld, not left out (listed with their metadata, content refused;
/// see [`PathFilter`]), so on the mount they look unchanged to git, not deleted. Blocking:
/// runs `git ls-files`.
pub(crate) fn export_filter_withholding(
    filter: Filter,
    root: &Path,
    record: bool,
) -> (PathFilter, Arc<SensitiveHits>) {
    let (f, hits, _) = export_filter_keyed(filter, root, record, None);
    (f, hits)
}

/// [`export_filter_withholding`], and a key naming the filter's settings (patterns and
/// withheld paths) for [`awcpfs::export::ExportRegistry::register_reusing`]: two filters
/// with one key show, withhold and record the same paths of the same tree.
/// With a `cache`, `git ls-files` runs again only when the root's git index changed.
pub(crate) fn export_filter_keyed(
    filter: Filter,
    root: &Path,
    record: bool,
    cache: Option<&WithheldCache>,
) -> (PathFilter, Arc<SensitiveHits>, String) {
    let stamp = cache.and_then(|_| IndexStamp::settled(root));
    let cached = cache
        .zip(stamp.as_ref())
        .and_then(|(c, s)| c.get(root, s, &filter));
    let (withheld, key) = cached.unwrap_or_else(|| {
        let withheld = Withheld::of(&filter, git_tracked(root));
        if !withheld.files.is_empty() {
            tracing::info!(
                root = %root.display(),
                files = withheld.files.len(),
                "hidden files git tracks are withheld: present but unreadable on the mount"
            );
        }
        let key = {
            let mut files: Vec<&String> = withheld.files.iter().collect();
            let mut dirs: Vec<&String> = withheld.dirs.iter().collect();
            files.sort_unstable();
            dirs.sort_unstable();
            let settings = format!("{filter:?}\0{files:?}\0{dirs:?}");
            blake3::hash(settings.as_bytes()).to_hex().to_string()
        };
        let withheld = Arc::new(withheld);
        if let (Some(c), Some(s)) = (cache, stamp) {
            c.put(root, s, &filter, withheld.clone(), key.clone());
        }
        (withheld, key)
    });
    let (f, hits) = export_filter_with(filter, withheld, record);
    (f, hits, key)
}

/// The withheld paths last worked out per root and filter, with the stamp of the git
/// index they came from: a resource delegated again is not listed by `git ls-files`
/// again (100,000 paths, each matched against every pattern) while its index file is
/// the same file, unchanged.
#[derive(Debug, Default)]
pub(crate) struct WithheldCache(Mutex<Vec<CachedWithheld>>);

#[derive(Debug)]
struct CachedWithheld {
    root: std::path::PathBuf,
    index: IndexStamp,
    filter: Filter,
    withheld: Arc<Withheld>,
    key: String,
}

/// Most roots and filters remembered.
const WITHHELD_CACHED: usize = 8;

impl WithheldCache {
    fn get(
        &self,
        root: &Path,
        index: &IndexStamp,
        filter: &Filter,
    ) -> Option<(Arc<Withheld>, String)> {
        self.0
            .lock()
            .iter()
            .find(|c| c.root == root && c.index == *index && c.filter == *filter)
            .map(|c| (c.withheld.clone(), c.key.clone()))
    }

    fn put(
        &self,
        root: &Path,
        index: IndexStamp,
        filter: &Filter,
        withheld: Arc<Withheld>,
        key: String,
    ) {
        let mut all = self.0.lock();
        all.retain(|c| !(c.root == root && c.filter == *filter));
        all.push(CachedWithheld {
            root: root.to_owned(),
            index,
            filter: filter.clone(),
            withheld,
            key,
        });
        if all.len() > WITHHELD_CACHED {
            all.remove(0);
        }
    }
}

/// What identifies the content of a root's `.git/index`: git replaces the file (a new
/// inode) whenever it writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct IndexStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl IndexStamp {
    /// The stamp of `root/.git/index`, if it exists and last changed long enough ago that
    /// a change within the same timestamp tick cannot go unseen (the hash cache's racy
    /// window).
    fn settled(root: &Path) -> Option<IndexStamp> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(root.join(".git").join("index")).ok()?;
        if !m.is_file() {
            return None;
        }
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        let stamp = IndexStamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?
            .as_nanos() as i128;
        let window = awcpfs::export::hashcache::RACY_WINDOW.as_nanos() as i128;
        (stamp.mtime_ns < now - window && stamp.ctime_ns < now - window).then_some(stamp)
    }
}

/// The hidden files git tracks below a resource's root, and the hidden directories (or
/// directories below hidden ones) on their way: what its export withholds.
#[derive(Debug, Default)]
struct Withheld {
    files: HashSet<String>,
    dirs: HashSet<String>,
}

impl Withheld {
    fn of(filter: &Filter, tracked: Vec<String>) -> Withheld {
        let mut w = Withheld::default();
        for path in tracked {
            let mut hidden_above = false;
            let mut dirs = Vec::new();
            for (end, _) in path.match_indices('/') {
                let dir = &path[..end];
                hidden_above = hidden_above || !filter.visible(dir, true);
                if hidden_above {
                    dirs.push(dir.to_string());
                }
            }
            if hidden_above || !filter.visible(&path, false) {
                w.dirs.extend(dirs);
                w.files.insert(path);
            }
        }
        w
    }
}

/// The files git tracks below `root` (relative to it), when `root` is the top of a git work
/// tree and `git` runs; otherwise none (hidden files are then simply left out).
fn git_tracked(root: &Path) -> Vec<String> {
    if !root.join(".git").exists() {
        return Vec::new();
    }
    let out = std::process::Command::new("git")
        // The daemon often runs as root on another user's repository.
        .args(["-c", "safe.directory=*", "-C"])
        .arg(root)
        .args(["ls-files", "-z", "--cached"])
        .stdin(std::process::Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => o
            .stdout
            .split(|b| *b == 0)
            .filter(|p| !p.is_empty())
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .collect(),
        Ok(o) => {
            tracing::warn!(root = %root.display(), stderr = %String::from_utf8_lossy(&o.stderr).trim(),
                "git ls-files failed: excluded files git tracks will look deleted on the mount");
            Vec::new()
        }
        Err(e) => {
            tracing::warn!(root = %root.display(), error = %e,
                "cannot run git: excluded files git tracks will look deleted on the mount");
            Vec::new()
        }
    }
}

fn export_filter_with(
    filter: Filter,
    withheld: Arc<Withheld>,
    record: bool,
) -> (PathFilter, Arc<SensitiveHits>) {
    let hits = Arc::new(SensitiveHits {
        hits: Mutex::new(Vec::new()),
        recording: AtomicBool::new(record),
    });
    let h = hits.clone();
    let w = withheld.clone();
    let f = PathFilter::new(move |rel: &str, is_dir: bool| {
        // Below a withheld directory (entered only for the files it withholds) nothing is
        // shown.
        let in_withheld_dir = rel
            .rsplit_once('/')
            .is_some_and(|(parent, _)| w.dirs.contains(parent));
        let shown = !in_withheld_dir && filter.visible(rel, is_dir);
        if !shown
            && !is_dir
            && h.recording.load(Ordering::SeqCst)
            && filter.passes(rel)
            && filter.is_sensitive(rel)
        {
            h.hits.lock().push(rel.to_string());
        }
        shown
    })
    .withholding(move |rel: &str, is_dir: bool| {
        if is_dir {
            withheld.dirs.contains(rel)
        } else {
            withheld.files.contains(rel)
        }
    });
    (f, hits)
}

/// Refuse a manifest over `limits`, as the reference words it.
pub(crate) fn check_limits(entries: &[ManifestEntry], limits: &ScanLimits) -> Result<(), Refusal> {
    let files = entries.iter().filter(|e| e.kind == EntryKind::File);
    let (mut count, mut total) = (0u64, 0u64);
    for f in files {
        count += 1;
        total += f.size;
        if f.size > limits.max_file_bytes {
            return Err(too_large(format!(
                "{} is {} bytes (limit per file {})",
                f.path, f.size, limits.max_file_bytes
            )));
        }
    }
    if count > limits.max_files {
        return Err(too_large(format!(
            "{count} files (limit {})",
            limits.max_files
        )));
    }
    if total > limits.max_total_bytes {
        return Err(too_large(format!(
            "Workspace size ({total} bytes) exceeds limit ({} bytes)",
            limits.max_total_bytes
        )));
    }
    Ok(())
}

fn too_large(detail: String) -> Refusal {
    Refusal {
        status: 400,
        message: "Workspace exceeds size limits".into(),
        code: Some(ErrorCode::WorkspaceTooLarge),
        hint: Some(format!(
            "{detail}. Consider selecting a smaller subdirectory or excluding files."
        )),
    }
}

/// How many sensitive files a refusal names; the rest are counted.
const NAMED_SENSITIVE: usize = 10;

/// The refusal for sensitive files (the reference's message, every file named up to
/// [`NAMED_SENSITIVE`], then a count), with the exact `--exclude` that would pass and the
/// `--allow-sensitive` that would delegate them anyway. `files` are paths as reported
/// (for `archive`, `<resource>/<path>`); `patterns` the sensitive globs in force.
pub(crate) fn sensitive(files: &[String], patterns: &[String]) -> Refusal {
    let named = files
        .iter()
        .take(NAMED_SENSITIVE)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    let message = if files.len() > NAMED_SENSITIVE {
        format!(
            "Sensitive files detected: {named} … and {} more ({} in all)",
            files.len() - NAMED_SENSITIVE,
            files.len()
        )
    } else {
        format!("Sensitive files detected: {named}")
    };
    // The sensitive patterns these files match: excluding exactly those leaves out every
    // one of them and nothing that is not sensitive itself.
    let mut matched: Vec<&str> = Vec::new();
    for f in files {
        // `archive` names `<resource>/<path>`; try the path within the resource too.
        let inner = f.split_once('/').map(|(_, rest)| rest);
        let hit = patterns.iter().find(|p| {
            crate::archive::glob_matches(p, f)
                || inner.is_some_and(|i| crate::archive::glob_matches(p, i))
        });
        if let Some(p) = hit
            && !matched.contains(&p.as_str())
        {
            matched.push(p);
        }
    }
    let flags = |flag: &str| {
        matched
            .iter()
            .map(|p| format!("{flag} '{p}'"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let hint = if matched.is_empty() {
        "Remove or exclude sensitive files before delegating".to_string()
    } else {
        format!(
            "Leave them out with `{}` (API: resources[].exclude), or, if they are safe to \
             share, delegate them with `{}` (API: resources[].allowSensitive)",
            flags("--exclude"),
            flags("--allow-sensitive")
        )
    };
    Refusal::bad(ErrorCode::SensitiveFiles, message, &hint)
}
