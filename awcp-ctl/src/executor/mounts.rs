//! The mounts of one `awcpfs` task: one FUSE mount per resource, run as one.
//!
//! A delegation of one resource is mounted at the work directory itself (as before there
//! could be several). With several, the work directory is a plain directory and each
//! resource is mounted at `<workDir>/<name>`, from its own export, with its own journal and
//! state directory (`<stateDir>/<id>/resources/<name>`) and its own `ro`/`rw`: the layout
//! of the reference's environment and of our `archive` transport.
//!
//! The set acts as one mount: when one ends (revoke, expiry, unmount), all end; flushing,
//! finishing and ending run on every member at once; counters are summed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use awcp_protocol::messages::AccessMode;
use awcp_protocol::transport::AwcpfsHandle;
use awcpfs::mount::{EndReason, Mount, MountConfig, MountError};

/// Where the resources of a several-resource task keep their state, below its state dir.
pub(crate) const RESOURCES_DIR: &str = "resources";

/// One mount to make.
#[derive(Debug, Clone)]
pub(crate) struct MountPlan {
    /// The resource's name (`None`: the only resource, mounted at the work directory).
    pub(crate) name: Option<String>,
    /// Its handle alone (one export).
    pub(crate) handle: AwcpfsHandle,
    pub(crate) mountpoint: PathBuf,
    pub(crate) state_dir: PathBuf,
    pub(crate) read_only: bool,
}

/// Plan the mounts of handle `h` for a task working in `work_path` with state in
/// `state_dir`; `lease_ro` makes every resource read-only. Refuses resource names that are
/// not one plain path component, or repeated.
pub(crate) fn plan(
    h: &AwcpfsHandle,
    work_path: &Path,
    state_dir: &Path,
    lease_ro: bool,
) -> Result<Vec<MountPlan>, String> {
    let Some(resources) = h.resources.as_ref().filter(|r| r.len() > 1) else {
        let ro_resource = h
            .resources
            .as_ref()
            .and_then(|r| r.first())
            .is_some_and(|r| r.access_mode == AccessMode::Ro);
        return Ok(vec![MountPlan {
            name: None,
            handle: AwcpfsHandle {
                resources: None,
                ..h.clone()
            },
            mountpoint: work_path.to_path_buf(),
            state_dir: state_dir.to_path_buf(),
            read_only: lease_ro || ro_resource,
        }]);
    };
    let mut seen: Vec<&str> = Vec::new();
    let mut plans = Vec::new();
    for r in resources {
        let plain = !r.name.is_empty()
            && r.name.len() <= 128
            && r.name != "."
            && r.name != ".."
            && !r.name.contains(['/', '\\', '\0']);
        if !plain || seen.contains(&r.name.as_str()) {
            return Err(format!(
                "resource name {:?} is not a unique single path component",
                r.name
            ));
        }
        seen.push(&r.name);
        plans.push(MountPlan {
            name: Some(r.name.clone()),
            handle: h.for_resource(r),
            mountpoint: work_path.join(&r.name),
            state_dir: state_dir.join(RESOURCES_DIR).join(&r.name),
            read_only: lease_ro || r.access_mode == AccessMode::Ro,
        });
    }
    Ok(plans)
}

#[derive(Clone)]
struct Member {
    name: Option<String>,
    mount: Mount,
    state_dir: PathBuf,
}

/// The running mounts of one task. Cheap to clone.
#[derive(Clone)]
pub(crate) struct MountSet {
    members: Arc<Vec<Member>>,
}

impl MountSet {
    /// Mount every plan (blocking); `configure` builds each one's config. If one fails,
    /// those already mounted are ended and the error is returned.
    pub(crate) fn start(
        plans: &[MountPlan],
        configure: impl Fn(&MountPlan) -> MountConfig,
    ) -> Result<MountSet, (Option<String>, MountError)> {
        let mut members: Vec<Member> = Vec::new();
        for p in plans {
            let made = if p.name.is_some() {
                std::fs::create_dir_all(&p.mountpoint)
            } else {
                Ok(())
            };
            let started = made
                .map_err(|source| MountError::Fuse {
                    mountpoint: p.mountpoint.clone(),
                    source,
                })
                .and_then(|()| Mount::start(configure(p)));
            match started {
                Ok(mount) => members.push(Member {
                    name: p.name.clone(),
                    mount,
                    state_dir: p.state_dir.clone(),
                }),
                Err(e) => {
                    for m in &members {
                        m.mount.finish();
                    }
                    return Err((p.name.clone(), e));
                }
            }
        }
        Ok(MountSet {
            members: Arc::new(members),
        })
    }

    fn each(&self, f: impl Fn(&Mount) + Sync) {
        match self.members.as_slice() {
            [one] => f(&one.mount),
            many => std::thread::scope(|s| {
                for m in many {
                    let f = &f;
                    s.spawn(move || f(&m.mount));
                }
            }),
        }
    }

    /// End normally: fence, flush, unmount — every mount at once (blocking).
    pub(crate) fn finish(&self) {
        self.each(Mount::finish);
    }

    /// End access for `reason` on every mount at once (blocking).
    pub(crate) fn end(&self, reason: EndReason, flush_budget: Option<Duration>) {
        self.each(|m| m.end(reason.clone(), flush_budget));
    }

    /// Commit everything written so far on every mount; the first failure, if any.
    pub(crate) fn flush(&self) -> Result<(), awcpfs::mount::sync::SyncError> {
        for m in self.members.iter() {
            m.mount.flush()?;
        }
        Ok(())
    }

    /// Move every mount's lease deadline to `remaining` from now (a CONTINUE's lease).
    pub(crate) fn set_remaining(&self, remaining: Duration) {
        for m in self.members.iter() {
            m.mount.set_remaining(remaining);
        }
    }

    /// Why the set ended (the first member that did), if one has.
    pub(crate) fn ended(&self) -> Option<EndReason> {
        self.members.iter().find_map(|m| m.mount.ended())
    }

    /// Whether a final flush left changes behind on any mount.
    pub(crate) fn unsynced(&self) -> bool {
        self.members.iter().any(|m| m.mount.unsynced())
    }

    /// Files written back, all mounts together.
    pub(crate) fn files_written_back(&self) -> u64 {
        self.members
            .iter()
            .map(|m| m.mount.stats().files_written_back)
            .sum()
    }

    /// Run `f` once, when the first mount ends; the others are then ended for the same
    /// reason (they share one lease, so they would be fenced anyway; this makes sure).
    pub(crate) fn on_end(&self, f: impl FnOnce(EndReason) + Send + 'static) {
        let f = Arc::new(parking_lot::Mutex::new(Some(f)));
        let fired = Arc::new(AtomicBool::new(false));
        for (i, m) in self.members.iter().enumerate() {
            let (f, fired, set) = (f.clone(), fired.clone(), self.clone());
            m.mount.on_end(move |reason| {
                if fired.swap(true, Ordering::SeqCst) {
                    return;
                }
                if let Some(f) = f.lock().take() {
                    f(reason.clone());
                }
                if set.members.len() > 1 {
                    // Not on this mount's ending thread: ending another one blocks.
                    std::thread::spawn(move || {
                        for (j, other) in set.members.iter().enumerate() {
                            if j != i {
                                let budget = Some(Duration::from_secs(5));
                                other.mount.end(reason.clone(), budget);
                            }
                        }
                    });
                }
            });
        }
    }

    /// Each member mount's counters now.
    pub(crate) fn stats_snapshots(&self) -> Vec<awcpfs::mount::stats::StatsSnapshot> {
        self.members
            .iter()
            .map(|m| m.mount.status().stats)
            .collect()
    }

    /// The status the Executor reports (`GET /awcp/status`): one mount's as it is; several
    /// summed (`state` the first's), each also under `resources` with its name.
    pub(crate) fn status_json(&self) -> Option<serde_json::Value> {
        let each: Vec<serde_json::Value> = self
            .members
            .iter()
            .filter_map(|m| serde_json::to_value(m.mount.status()).ok())
            .collect();
        if let [one] = each.as_slice() {
            return Some(one.clone());
        }
        let mut sum = crate::jsonsum::sum(&each);
        let named: Vec<serde_json::Value> = each
            .into_iter()
            .zip(self.members.iter())
            .map(|(mut v, m)| {
                if let (Some(o), Some(name)) = (v.as_object_mut(), &m.name) {
                    o.insert("name".into(), name.clone().into());
                }
                v
            })
            .collect();
        if let Some(o) = sum.as_object_mut() {
            o.insert("resources".into(), serde_json::Value::Array(named));
        }
        Some(sum)
    }

    /// After the task: drop each saved handle (a credential) whose mount wrote everything
    /// back, and the resources' mount points below `work_path`.
    pub(crate) fn clean_up(&self, work_path: &Path, handle_file: &str) {
        for m in self.members.iter() {
            if !m.mount.unsynced() {
                let _ = std::fs::remove_file(m.state_dir.join(handle_file));
            }
            if let Some(name) = &m.name {
                let _ = std::fs::remove_dir(work_path.join(name));
            }
        }
        let _ = std::fs::remove_dir(work_path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use awcp_protocol::transport::AwcpfsResource;

    fn handle(resources: Option<Vec<(&str, AccessMode)>>) -> AwcpfsHandle {
        AwcpfsHandle {
            endpoint: "http://127.0.0.1:1".into(),
            token: "t".into(),
            export_id: "dlg_1".into(),
            manifest_digest: "d0".into(),
            block_size: 4096,
            expires_at: "2030-01-01T00:00:00Z".into(),
            tls_fingerprint: None,
            remaining_ms: None,
            resources: resources.map(|r| {
                r.into_iter()
                    .enumerate()
                    .map(|(i, (name, access_mode))| AwcpfsResource {
                        name: name.into(),
                        export_id: format!("dlg_1.{i}"),
                        manifest_digest: format!("d{i}"),
                        access_mode,
                    })
                    .collect()
            }),
        }
    }

    #[test]
    fn one_resource_mounts_at_the_work_dir() {
        let p = plan(
            &handle(None),
            Path::new("/w/dlg_1"),
            Path::new("/s/dlg_1"),
            false,
        )
        .unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].mountpoint, Path::new("/w/dlg_1"));
        assert_eq!(p[0].state_dir, Path::new("/s/dlg_1"));
        assert!(!p[0].read_only);
        let p = plan(
            &handle(Some(vec![("src", AccessMode::Ro)])),
            Path::new("/w/dlg_1"),
            Path::new("/s/dlg_1"),
            false,
        )
        .unwrap();
        assert!(p[0].read_only, "a lone ro resource is mounted ro");
    }

    #[test]
    fn several_resources_mount_under_their_names_with_their_modes() {
        let h = handle(Some(vec![
            ("src", AccessMode::Rw),
            ("data", AccessMode::Ro),
        ]));
        let p = plan(&h, Path::new("/w/x"), Path::new("/s/x"), false).unwrap();
        assert_eq!(p[1].mountpoint, Path::new("/w/x/data"));
        assert_eq!(p[1].state_dir, Path::new("/s/x/resources/data"));
        assert_eq!(p[1].handle.export_id, "dlg_1.1");
        assert!(p[1].handle.resources.is_none());
        assert!(!p[0].read_only && p[1].read_only);
        let p = plan(&h, Path::new("/w/x"), Path::new("/s/x"), true).unwrap();
        assert!(p.iter().all(|p| p.read_only), "an ro lease makes all ro");
    }

    #[test]
    fn hostile_resource_names_are_refused() {
        for bad in ["..", "a/b", "", "."] {
            let h = handle(Some(vec![("ok", AccessMode::Rw), (bad, AccessMode::Rw)]));
            assert!(
                plan(&h, Path::new("/w"), Path::new("/s"), false).is_err(),
                "{bad:?}"
            );
        }
        let h = handle(Some(vec![("a", AccessMode::Rw), ("a", AccessMode::Rw)]));
        assert!(plan(&h, Path::new("/w"), Path::new("/s"), false).is_err());
    }
}
