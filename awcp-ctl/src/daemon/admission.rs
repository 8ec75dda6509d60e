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

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use awcp_protocol::ErrorCode;
use awcp_protocol::api::ResourceSpec;
use awcp_protocol::dataplane::{EntryKind, Manifest};
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
    let hits = Arc::new(SensitiveHits {
        hits: Mutex::new(Vec::new()),
        recording: AtomicBool::new(record),
    });
    let h = hits.clone();
    let f = PathFilter(Arc::new(move |rel: &str, is_dir: bool| {
        let shown = filter.visible(rel, is_dir);
        if !shown
            && !is_dir
            && h.recording.load(Ordering::SeqCst)
            && filter.passes(rel)
            && filter.is_sensitive(rel)
        {
            h.hits.lock().push(rel.to_string());
        }
        shown
    }));
    (f, hits)
}

/// Refuse a manifest over `limits`, as the reference words it.
pub(crate) fn check_limits(m: &Manifest, limits: &ScanLimits) -> Result<(), Refusal> {
    let files = m.entries.iter().filter(|e| e.kind == EntryKind::File);
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

/// The reference's refusal for sensitive files.
pub(crate) fn sensitive(files: &[String]) -> Refusal {
    Refusal::bad(
        ErrorCode::SensitiveFiles,
        format!("Sensitive files detected: {}", files.join(", ")),
        "Remove or exclude sensitive files before delegating",
    )
}
