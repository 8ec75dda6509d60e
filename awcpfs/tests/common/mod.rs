//! A real mount of an in-process export, for the integration tests that need one: a
//! Delegator tree in a temp dir, its export served on loopback by a tokio runtime of the
//! test's own, and `awcpfs::mount::Mount` on a mount point beside it. Ended (written back,
//! unmounted) when dropped.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcpfs::export::{ExportConfig, ExportRegistry};
use awcpfs::mount::{Mount, MountConfig};

pub struct InProcess {
    _tmp: tempfile::TempDir,
    _rt: tokio::runtime::Runtime,
    /// The Delegator's tree.
    #[allow(dead_code)]
    pub src: PathBuf,
    /// The mount point.
    pub mnt: PathBuf,
    mount: Option<Mount>,
}

impl InProcess {
    /// `build` fills the Delegator's tree, `adjust` the mount's config; the lease runs
    /// 10 minutes, blocks are 1 MiB, the export does not watch its tree.
    pub fn start(build: impl FnOnce(&Path), adjust: impl FnOnce(&mut MountConfig)) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        let mnt = tmp.path().join("mnt");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir_all(&mnt).unwrap();
        build(&src);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let registry = ExportRegistry::new().without_watch();
        let lease = Arc::new(Lease::grant(
            Arc::new(SystemClock::new()),
            LeaseTerms {
                ttl: Duration::from_secs(600),
                max_ttl: Duration::from_secs(600),
                flush_grace: Duration::from_secs(10),
            },
        ));
        let export = registry
            .register(
                "ex".into(),
                "tok".into(),
                ExportConfig {
                    root: src.clone(),
                    read_only: false,
                    block_size: 1 << 20,
                    staging_dir: tmp.path().join("staging"),
                },
                lease,
            )
            .unwrap();
        let addr = rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let a = l.local_addr().unwrap();
            let router = registry.router();
            // As the export's own server: no delayed ACK (Nagle) on small answers.
            let l = axum::serve::ListenerExt::tap_io(l, |s| {
                let _ = s.set_nodelay(true);
            });
            tokio::spawn(async move { axum::serve(l, router).await });
            a
        });
        let mut cfg = MountConfig::new(
            &format!("http://{addr}"),
            "ex",
            "tok",
            &mnt,
            &tmp.path().join("state"),
        );
        cfg.manifest_digest = Some(export.manifest_digest());
        cfg.remaining = Some(Duration::from_secs(600));
        adjust(&mut cfg);
        let mount = Mount::start(cfg).unwrap();
        InProcess {
            _tmp: tmp,
            _rt: rt,
            src,
            mnt,
            mount: Some(mount),
        }
    }

    pub fn mount(&self) -> &Mount {
        self.mount.as_ref().unwrap()
    }

    /// FUSE requests of kind `name` the mount answered so far.
    #[allow(dead_code)]
    pub fn op(&self, name: &str) -> u64 {
        self.mount().stats().ops.get(name).copied().unwrap_or(0)
    }

    /// End the mount (write back, unmount) now.
    pub fn end(&mut self) {
        if let Some(m) = self.mount.take() {
            m.end(awcpfs::mount::EndReason::Unmounted, None);
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.end();
    }
}
