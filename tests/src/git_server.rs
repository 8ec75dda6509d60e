//! A real git server on loopback for the `git` transport's tests: `git daemon` serving bare
//! repositories from a temp directory over `git://`, with pushes enabled. Stopped (killed
//! and reaped) on drop.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `git daemon`.
pub struct GitServer {
    child: Child,
    port: u16,
    base: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl GitServer {
    /// Serve bare repositories from a temp directory of its own, removed on drop.
    pub fn start_temp() -> GitServer {
        let tmp = tempfile::tempdir().unwrap();
        let mut s = GitServer::start(tmp.path());
        s._tmp = Some(tmp);
        s
    }

    /// Serve the bare repositories under `base` (created if missing) on `127.0.0.1`.
    pub fn start(base: &Path) -> GitServer {
        std::fs::create_dir_all(base).unwrap();
        // `git daemon` takes no port 0: take a free one from the kernel, then hand it over.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("git")
            .arg("daemon")
            .arg("--export-all")
            .arg("--enable=receive-pack")
            .arg("--reuseaddr")
            .arg("--listen=127.0.0.1")
            .arg(format!("--port={port}"))
            .arg(format!("--base-path={}", base.display()))
            .arg(base)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting git daemon");
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "git daemon did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        GitServer {
            child,
            port,
            base: base.to_path_buf(),
            _tmp: None,
        }
    }

    /// Create an empty bare repository `name` (e.g. `ws.git`); its `git://` URL.
    pub fn bare(&self, name: &str) -> String {
        let out = Command::new("git")
            .args(["init", "--bare", "--quiet"])
            .arg(self.base.join(name))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        self.url(name)
    }

    /// The `git://` URL of repository `name`.
    pub fn url(&self, name: &str) -> String {
        format!("git://127.0.0.1:{}/{name}", self.port)
    }

    /// The branches of repository `name`, as `git for-each-ref` lists them.
    pub fn branches(&self, name: &str) -> Vec<String> {
        let out = Command::new("git")
            .arg("--git-dir")
            .arg(self.base.join(name))
            .args(["for-each-ref", "--format=%(refname:short)", "refs/heads"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// `git show <rev>:<path>` in repository `name`.
    pub fn show(&self, name: &str, rev_path: &str) -> Option<String> {
        let out = Command::new("git")
            .arg("--git-dir")
            .arg(self.base.join(name))
            .args(["show", rev_path])
            .output()
            .unwrap();
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for GitServer {
    fn drop(&mut self) {
        // The child is ours (spawned above); it is reaped before the temp dir goes.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
