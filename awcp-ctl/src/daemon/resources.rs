//! The resources of an `awcpfs` delegation: one export per resource.
//!
//! Each resource gets its own export — its own manifest, filter and admission, its own
//! `ro`/`rw` — all behind the delegation's one capability token and one lease, so a revoke
//! or expiry refuses every export at once. The first resource's export id is the
//! delegation id (as it was when a delegation carried one resource); the others are
//! `<id>.<n>`. The Executor mounts each at `<workDir>/<name>` (one FUSE mount per resource;
//! see `docs/ARCHITECTURE.md` for why not one mount with a directory per resource).

use std::path::PathBuf;
use std::sync::Arc;

use awcp_lease::Lease;
use awcp_protocol::ErrorCode;
use awcp_protocol::api::ResourceSpec;
use awcp_protocol::messages::AccessMode;
use awcp_protocol::transport::AwcpfsResource;
use awcpfs::export::{BuildProgress, Export, ExportConfig};

use super::Daemon;
use super::flow::{Refusal, check_dir};
use crate::store::StoredResource;

/// A resource name usable as one directory on the Executor: one path component, not `.`
/// or `..`, at most 128 bytes.
pub(crate) fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
}

/// Refuse a resource list that is empty, or whose names are not unique plain names.
pub(crate) fn check_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<(), Refusal> {
    let mut seen: Vec<&str> = Vec::new();
    for name in names {
        if !plain_name(name) {
            return Err(Refusal::bad(
                ErrorCode::WorkspaceInvalid,
                format!(
                    "resource name {name:?} is not usable: it becomes a directory on the \
                     executor, so it must be one path component (no `/`, not `.` or `..`, \
                     not empty, at most 128 bytes)"
                ),
                "Name each resource with one plain path component, e.g. `workspace`",
            ));
        }
        if seen.contains(&name) {
            return Err(Refusal::bad(
                ErrorCode::WorkspaceInvalid,
                format!("resource name {name:?} is given twice"),
                "Give each resource a different name",
            ));
        }
        seen.push(name);
    }
    if seen.is_empty() {
        return Err(Refusal::bad(
            ErrorCode::WorkspaceInvalid,
            "no resources to delegate".into(),
            "Give at least one resource",
        ));
    }
    Ok(())
}

/// The export id of the `n`-th resource of delegation `id`.
pub(crate) fn export_id(id: &str, n: usize) -> String {
    if n == 0 {
        id.to_string()
    } else {
        format!("{id}.{n}")
    }
}

/// A resource exported for a delegation.
pub(crate) struct Exported {
    pub(crate) stored: StoredResource,
    pub(crate) export: Arc<Export>,
}

impl Exported {
    /// Its entry in a several-resource handle.
    pub(crate) fn handle_entry(&self) -> AwcpfsResource {
        AwcpfsResource {
            name: self.stored.name.clone(),
            export_id: self.export.id().to_string(),
            manifest_digest: self.export.manifest_digest(),
            access_mode: if self.stored.read_only {
                AccessMode::Ro
            } else {
                AccessMode::Rw
            },
        }
    }
}

impl Daemon {
    /// Export every resource of a new delegation (`ro` if `access` is, or the resource
    /// is), each checked against the admission rules. On a refusal nothing stays
    /// registered.
    pub(crate) async fn export_resources(
        &self,
        id: &str,
        token: &str,
        lease: &Arc<Lease>,
        resources: &[ResourceSpec],
        access: AccessMode,
        progress: &super::progress::Progress,
    ) -> Result<Vec<Exported>, Refusal> {
        check_names(resources.iter().map(|r| r.name.as_str()))?;
        let mut sources = Vec::new();
        for r in resources {
            let source = PathBuf::from(&r.source);
            let source = std::path::absolute(&source).unwrap_or(source);
            check_dir(&source)?;
            sources.push(source);
        }
        let counters: Vec<Arc<BuildProgress>> = resources
            .iter()
            .map(|r| progress.add_manifest(&r.name))
            .collect();
        let mut done: Vec<Exported> = Vec::new();
        for (n, (r, source)) in resources.iter().zip(sources).enumerate() {
            let stored = StoredResource {
                name: r.name.clone(),
                export_id: export_id(id, n),
                source,
                read_only: access == AccessMode::Ro || r.mode == AccessMode::Ro,
            };
            match self
                .export_one(token, lease, r, &stored, &counters[n])
                .await
            {
                Ok(export) => done.push(Exported { stored, export }),
                Err(refusal) => {
                    for e in &done {
                        self.exports.remove(e.export.id());
                    }
                    return Err(refusal);
                }
            }
        }
        Ok(done)
    }

    /// Register one resource's export and admit it (sensitive files, limits).
    async fn export_one(
        &self,
        token: &str,
        lease: &Arc<Lease>,
        resource: &ResourceSpec,
        target: &StoredResource,
        progress: &Arc<BuildProgress>,
    ) -> Result<Arc<Export>, Refusal> {
        let (eid, source) = (target.export_id.as_str(), target.source.as_path());
        let export_cfg = ExportConfig {
            root: source.to_path_buf(),
            read_only: target.read_only,
            block_size: self.cfg.block_size,
            staging_dir: self.cfg.state_dir.join("staging").join(eid),
        };
        let filter = self.resource_filter(resource, source);
        let exports = self.exports.clone();
        let withheld = self.withheld.clone();
        let (eid, etoken, elease, p, root) = (
            eid.to_string(),
            token.to_string(),
            lease.clone(),
            progress.clone(),
            source.to_path_buf(),
        );
        let (export, hits) = tokio::task::spawn_blocking(move || {
            let t0 = std::time::Instant::now();
            let (filter, hits, key) =
                super::admission::export_filter_keyed(filter, &root, true, Some(&withheld));
            tracing::debug!(
                ms = t0.elapsed().as_millis() as u64,
                "export filter made (git ls-files, withheld paths)"
            );
            // An unchanged tree delegated again with the same filter takes the walk kept
            // below (its admission passed, so its filter recorded no sensitive file).
            let export = exports.register_reusing(
                eid,
                etoken,
                export_cfg,
                elease,
                Some(filter),
                Some(p),
                key,
            );
            (export, hits)
        })
        .await
        .map_err(|e| Refusal::internal(format!("building the manifest panicked: {e}")))?;
        let export = export.map_err(|e| {
            let hint = match &e {
                awcpfs::export::ExportError::StagingInsideRoot { .. } => {
                    "The daemon's --state-dir is inside the workspace; restart \
                     `awcp-ctl serve` with a --state-dir outside it"
                }
                _ => "Check that the workspace is a readable directory",
            };
            Refusal::bad(
                ErrorCode::WorkspaceInvalid,
                format!("cannot export {}: {e}", source.display()),
                hint,
            )
        })?;
        let admitted = match hits.take().as_slice() {
            [] => {
                super::admission::check_limits(export.manifest_entries(), &self.cfg.awcpfs_limits)
            }
            files => Err(super::admission::sensitive(files, &self.cfg.sensitive)),
        };
        if let Err(refusal) = admitted {
            self.exports.remove(export.id());
            return Err(refusal);
        }
        self.exports.keep_walk(&export);
        Ok(export)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_must_be_unique_plain_components() {
        assert!(check_names(["src", "data", "a.b", "-x"]).is_ok());
        for bad in [
            vec![""],
            vec!["a/b"],
            vec![".."],
            vec!["."],
            vec!["a\\b"],
            vec!["src", "src"],
            vec![],
        ] {
            let r = check_names(bad.iter().copied()).unwrap_err();
            assert_eq!(r.status, 400, "{bad:?}");
            assert_eq!(r.code, Some(ErrorCode::WorkspaceInvalid), "{bad:?}");
        }
        let long = "x".repeat(129);
        assert!(check_names([long.as_str()]).is_err());
    }

    #[test]
    fn first_export_keeps_the_delegation_id() {
        assert_eq!(export_id("dlg_1", 0), "dlg_1");
        assert_eq!(export_id("dlg_1", 2), "dlg_1.2");
    }
}
