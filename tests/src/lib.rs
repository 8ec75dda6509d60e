//! Shared harness for the end-to-end tests: a real Delegator daemon and a real Executor on
//! loopback (ports chosen by the kernel), real FUSE mounts, real tools.
//!
//! FUSE tests need root and `/dev/fuse`. Where `/dev/fuse` is missing they skip, loudly —
//! except under `CI=true`, where a missing FUSE device fails the test.

pub mod agents;
pub mod browser;
pub mod fleet;
pub mod git_server;
pub mod hostile;
pub mod reference;
pub mod s3;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use awcp_ctl::client::DaemonClient;
use awcp_ctl::daemon::{DaemonConfig, RunningDaemon};
use awcp_ctl::executor::{ExecutorConfig, RunningExecutor};
use awcp_protocol::DelegationState;
use awcp_protocol::api::{DelegateRequest, EnvironmentSpec, ResourceSpec};
use awcp_protocol::messages::{AccessMode, ResourceType, TaskSpec};

pub use awcpfs::testing::{fuse_available, uring_available};

/// Run a command, panic with its output if it fails; return stdout.
pub fn sh(dir: &Path, script: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .output()
        .expect("running sh");
    assert!(
        out.status.success(),
        "`{script}` failed in {}: {}\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A git repository with a small Python package and its tests.
pub fn sample_repo(dir: &Path) {
    std::fs::create_dir_all(dir.join("calc")).unwrap();
    std::fs::write(dir.join("calc/__init__.py"), "").unwrap();
    std::fs::write(
        dir.join("calc/ops.py"),
        "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("tests")).unwrap();
    std::fs::write(dir.join("tests/__init__.py"), "").unwrap();
    std::fs::write(
        dir.join("tests/test_ops.py"),
        "import unittest\nfrom calc.ops import add, mul\n\n\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n",
    )
    .unwrap();
    std::fs::write(dir.join("README.md"), "# sample\n").unwrap();
    std::fs::write(dir.join("tool.sh"), "#!/bin/sh\necho old\n").unwrap();
    sh(
        dir,
        "chmod 755 tool.sh && git init -q -b main && git -c user.email=d@x -c user.name=delegator add -A && git -c user.email=d@x -c user.name=delegator commit -qm initial",
    );
}

/// Both services on loopback, state in a temp dir.
pub struct Harness {
    /// Unmounts whatever a failing test left mounted under the temp dir (declared first:
    /// fields drop in order, and the temp dir cannot be removed while something is mounted).
    _mounts: UnmountOnDrop,
    /// Everything lives here.
    pub tmp: tempfile::TempDir,
    /// The Delegator daemon.
    pub daemon: RunningDaemon,
    /// The Executor service.
    pub executor: RunningExecutor,
    /// A client of the daemon.
    pub client: DaemonClient,
}

/// Lazily unmounts every mount under a directory when dropped, so a test that panics in the
/// middle of a delegation does not leave a FUSE mount behind.
struct UnmountOnDrop(PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        let prefix = format!("{}/", self.0.display());
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for mp in mounts.lines().filter_map(|l| l.split(' ').nth(4)) {
            if mp.starts_with(&prefix) {
                let _ = nix::mount::umount2(mp, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
}

impl Harness {
    /// Start both services; the Executor runs `agent_cmd` in each mounted workspace.
    pub async fn start(agent_cmd: &str) -> Harness {
        Self::start_with(agent_cmd, |_| {}).await
    }

    /// Start both services, adjusting the Executor's config first.
    pub async fn start_with(agent_cmd: &str, adjust: impl FnOnce(&mut ExecutorConfig)) -> Harness {
        Self::start_full(agent_cmd, |_| {}, adjust).await
    }

    /// Start both services, adjusting both configs first.
    pub async fn start_full(
        agent_cmd: &str,
        adjust_daemon: impl FnOnce(&mut DaemonConfig),
        adjust: impl FnOnce(&mut ExecutorConfig),
    ) -> Harness {
        Self::start_inner(agent_cmd, adjust_daemon, adjust, true).await
    }

    /// Start both services with the Executor exactly as the product starts it: the agent
    /// shares nothing with the test (not even the temp dir, see [`Harness::start_full`]).
    pub async fn start_confined(agent_cmd: &str) -> Harness {
        Self::start_inner(agent_cmd, |_| {}, |_| {}, false).await
    }

    /// The Executor runs its agents as the product does: as its agents' user, under
    /// Landlock. Beyond that, tests share with their agents what an operator would with
    /// `--agent-allow-write`/`--agent-allow-read`: the paths the agent command names
    /// ([`share_named_paths`]) and, with `share_tmp`, the temp dir itself (made the agent
    /// user's; many agents write their output to `../../..`, the temp dir seen from the
    /// mount). The Executor's `state/` and `cache/` below it stay root's, 0700.
    async fn start_inner(
        agent_cmd: &str,
        adjust_daemon: impl FnOnce(&mut DaemonConfig),
        adjust: impl FnOnce(&mut ExecutorConfig),
        share_tmp: bool,
    ) -> Harness {
        if let Ok(filter) = std::env::var("AWCP_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_test_writer()
                .try_init();
        }
        let tmp = tempfile::tempdir().unwrap();
        let mut ecfg = ExecutorConfig::new(agent_cmd.to_string(), tmp.path().join("executor"));
        ecfg.listen = "127.0.0.1:0".parse().unwrap();
        adjust(&mut ecfg);
        // The Executor runs its agents as the product does: as its agents' user, under
        // Landlock. They reach their workspace through the temp dir; the paths the agent
        // command names (a test's output directory, a script) are shared with them.
        open_to_agents(tmp.path());
        share_named_paths(&mut ecfg);
        if share_tmp {
            if let Some(u) = agent_user_of(&ecfg) {
                std::os::unix::fs::chown(tmp.path(), Some(u.uid), Some(u.gid)).unwrap();
            }
            ecfg.agent_allow_write.push(tmp.path().to_path_buf());
        }
        // The Executor draws its credential at first start (secure by default)...
        let executor = awcp_ctl::executor::start(ecfg).await.unwrap();
        let mut dcfg = DaemonConfig::new(tmp.path().join("delegator"));
        dcfg.listen = "127.0.0.1:0".parse().unwrap();
        dcfg.export_listen = "127.0.0.1:0".parse().unwrap();
        dcfg.flush_grace = Duration::from_secs(5);
        // ...and the daemon is handed it, as `serve --executor-token-file` is.
        dcfg.executor_token = executor.executor.credential().map(str::to_owned);
        adjust_daemon(&mut dcfg);
        let daemon = awcp_ctl::daemon::start(dcfg).await.unwrap();
        // The daemon drew its API token in its state dir; the client sends it.
        let client = daemon.client();
        let _mounts = UnmountOnDrop(tmp.path().to_path_buf());
        Harness {
            tmp,
            daemon,
            executor,
            client,
            _mounts,
        }
    }

    /// The Executor's credential (what a Delegator must present in INVITE's `auth`).
    pub fn credential(&self) -> String {
        self.executor
            .executor
            .credential()
            .expect("the Executor runs with a credential")
            .to_owned()
    }

    /// A path in the temp dir.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    /// The Delegator's proof for `awcpfs` delegation `id` (its START's capability token),
    /// which the Executor's routes of that delegation require; read from the handle the
    /// Executor saved (waits up to 30 s for it).
    pub async fn proof(&self, id: &str) -> String {
        let path = self
            .tmp
            .path()
            .join("executor/state")
            .join(id)
            .join("handle.json");
        let start = Instant::now();
        loop {
            if let Ok(bytes) = std::fs::read(&path)
                && let Ok(h) =
                    serde_json::from_slice::<awcp_protocol::transport::AwcpfsHandle>(&bytes)
            {
                return h.token;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no handle at {}",
                path.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Where the Executor mounts delegation `id`.
    pub fn mountpoint(&self, id: &str) -> PathBuf {
        self.tmp.path().join("executor/work").join(id)
    }

    /// Delegate `dir`.
    pub async fn delegate(&self, dir: &Path, mode: AccessMode, ttl_seconds: u64) -> String {
        let req = DelegateRequest {
            executor_url: self.executor.awcp_url(),
            environment: EnvironmentSpec {
                resources: vec![ResourceSpec {
                    name: "workspace".into(),
                    resource_type: ResourceType::Fs,
                    source: dir.display().to_string(),
                    mode,
                    include: None,
                    exclude: None,
                    gitignore: None,
                    allow_sensitive: None,
                }],
            },
            task: TaskSpec {
                description: "test task".into(),
                prompt: "do the test".into(),
            },
            ttl_seconds: Some(ttl_seconds),
            access_mode: Some(mode),
            snapshot_mode: None,
            auth: None,
            transport: None,
            multi_round: None,
            git_remote: None,
            no_network: None,
        };
        self.client
            .delegate(&req)
            .await
            .expect("delegate")
            .delegation_id
            .as_str()
            .to_string()
    }

    /// A delegation request for several resources `(name, dir, mode)` (awcpfs, auto).
    pub fn request(
        &self,
        resources: &[(&str, &Path, AccessMode)],
        ttl_seconds: u64,
    ) -> DelegateRequest {
        request(self.executor.awcp_url(), resources, ttl_seconds)
    }

    /// Delegate several resources `(name, dir, mode)` in one delegation.
    pub async fn delegate_resources(
        &self,
        resources: &[(&str, &Path, AccessMode)],
        ttl_seconds: u64,
    ) -> String {
        self.client
            .delegate(&self.request(resources, ttl_seconds))
            .await
            .expect("delegate")
            .delegation_id
            .as_str()
            .to_string()
    }

    /// Wait until the delegation is in a terminal state; return it.
    pub async fn wait_end(&self, id: &str, timeout: Duration) -> DelegationState {
        let start = Instant::now();
        loop {
            let v = self.client.get(id).await.expect("status");
            if v.record.state.is_terminal() {
                return v.record.state;
            }
            assert!(
                start.elapsed() < timeout,
                "delegation {id} still {} after {timeout:?}",
                v.record.state.as_str()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stop both services.
    pub async fn stop(self) {
        self.executor.stop().await;
        self.daemon.stop().await;
    }
}

/// Let every user pass through `dir` (0711, no listing), as an Executor's base directory
/// must be for its agents' user to reach the work directory below it.
pub fn open_to_agents(dir: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o7777;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o011)).unwrap();
}

/// The absolute paths an agent command names (`/tmp/.tmpX/ready`, `/…/script.py`): every
/// run of characters starting with `/` after a space, a quote, `=` or the start, up to a
/// space, a quote or a shell operator.
pub fn named_paths(cmd: &str) -> Vec<PathBuf> {
    let stop = |c: char| c.is_whitespace() || "'\"`;|&<>()$".contains(c);
    let mut out = Vec::new();
    let mut prev = ' ';
    for (i, c) in cmd.char_indices() {
        if c == '/' && (stop(prev) || prev == '=') {
            let rest = &cmd[i..];
            let end = rest.find(stop).unwrap_or(rest.len());
            out.push(PathBuf::from(&rest[..end]));
        }
        prev = c;
    }
    out
}

/// What the tests' agents share with the test, as an operator would with
/// `--agent-allow-write` and `--agent-allow-read`: each temp directory the agent command
/// names (its top directory under the system temp dir, made the agent user's so that the
/// agent can write there too) may be written; any other existing path it names may be read.
pub fn share_named_paths(cfg: &mut ExecutorConfig) {
    let user = agent_user_of(cfg);
    let (write, read) = shared_paths(&cfg.agent_cmd, user.as_ref());
    for w in write {
        if !cfg.agent_allow_write.contains(&w) {
            cfg.agent_allow_write.push(w);
        }
    }
    for r in read {
        if !cfg.agent_allow_read.contains(&r) {
            cfg.agent_allow_read.push(r);
        }
    }
}

/// The user the Executor of `cfg` will run agents as (`None`: itself).
pub fn agent_user_of(cfg: &ExecutorConfig) -> Option<awcp_ctl::executor::AgentUser> {
    match (&cfg.agent_user, cfg.unsafe_agent_as_root) {
        (Some(u), _) => Some(u.clone()),
        (None, true) => None,
        (None, false) => default_agent_user(),
    }
}

/// The user an Executor of this process's user runs agents as by default (`None`: itself).
pub fn default_agent_user() -> Option<awcp_ctl::executor::AgentUser> {
    nix::unistd::geteuid()
        .is_root()
        .then(|| awcp_ctl::executor::ensure_default_user().expect("the agents' user"))
}

/// [`share_named_paths`] as `awcp-ctl executor` flags, for an Executor run as a process
/// with its default agent user.
pub fn shared_path_args(agent_cmd: &str) -> Vec<String> {
    let (write, read) = shared_paths(agent_cmd, default_agent_user().as_ref());
    let flag = |f: &str, p: PathBuf| [f.to_string(), p.display().to_string()];
    write
        .into_iter()
        .flat_map(|p| flag("--agent-allow-write", p))
        .chain(read.into_iter().flat_map(|p| flag("--agent-allow-read", p)))
        .collect()
}

/// The (writable, readable) paths of [`share_named_paths`]; writable ones are given to
/// `user`.
fn shared_paths(
    agent_cmd: &str,
    user: Option<&awcp_ctl::executor::AgentUser>,
) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let tmp = std::env::temp_dir();
    let (mut write, mut read) = (Vec::new(), Vec::new());
    for p in named_paths(agent_cmd) {
        if let Ok(rel) = p.strip_prefix(&tmp)
            && let Some(top) = rel.components().next()
        {
            let dir = tmp.join(top);
            if dir.is_dir() && !write.contains(&dir) {
                write.push(dir.clone());
            }
            // The directories on the way, down to the path itself, are the agent user's.
            if let Some(u) = user {
                for d in p.ancestors().filter(|d| d.starts_with(&dir) && d.is_dir()) {
                    std::os::unix::fs::chown(d, Some(u.uid), Some(u.gid)).unwrap();
                }
            }
        } else if p.exists() && !read.contains(&p) {
            read.push(p);
        }
    }
    (write, read)
}

/// Whether `path` is a mount point now.
pub fn is_mounted(path: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let p = path.display().to_string();
    mounts
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(p.as_str()))
}

/// Wait until `f` holds, up to `timeout`; true if it did.
pub async fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// Connects to a worker's AECP socket as its agent does: sends the `hello` line with the
/// worker's token (`$AECP_TOKEN`, here from the Executor) and reads up to the socket's
/// confirmation that this connection now receives the deliveries. Panics when the socket
/// refuses the token. Reads time out after 60 s.
pub fn aecp_subscribe(
    socket: &Path,
    token: &str,
) -> std::io::BufReader<std::os::unix::net::UnixStream> {
    use std::io::{BufRead as _, Write as _};
    let mut stream = std::os::unix::net::UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()));
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let hello = serde_json::json!({"kind": "hello", "token": token});
    stream.write_all(format!("{hello}\n").as_bytes()).unwrap();
    let mut r = std::io::BufReader::new(stream);
    loop {
        let mut line = String::new();
        r.read_line(&mut line)
            .expect("the socket answers the hello");
        let v: serde_json::Value = serde_json::from_str(&line).expect("one JSON line");
        if v["kind"] == "hello" && v["streaming"] == true {
            return r;
        }
        assert!(
            v["kind"] != "hello" || v.get("error").is_none(),
            "the socket refused the token: {v}"
        );
    }
}

/// Whether `path` exists within `timeout` (an agent's "ready" file, typically).
pub async fn appears(path: &Path, timeout: Duration) -> bool {
    eventually(timeout, || path.exists()).await
}

/// Whether every command in `tools` is installed (each checked with `sh -c 'command -v …'`).
/// Under `CI=true` a missing tool fails the test (`.ci/run` installs them all); elsewhere the
/// test is skipped, loudly.
pub fn tools_available(tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|t| {
            !Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {t}"))
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!(
            "toolchain tests must run in CI, but these tools are missing: {missing:?} (.ci/run installs them)"
        );
    }
    awcpfs::testing::skipped(
        &format!("a toolchain test ({})", missing.join(", ")),
        &format!("apt-get install {}", missing.join(" ")),
    );
    false
}

/// A delegation of `resources` `(name, dir, mode)` to the Executor at `executor_url`, with
/// the daemon's defaults for everything else (tests set the fields they need).
pub fn request(
    executor_url: String,
    resources: &[(&str, &Path, AccessMode)],
    ttl_seconds: u64,
) -> DelegateRequest {
    DelegateRequest {
        executor_url,
        environment: EnvironmentSpec {
            resources: resources
                .iter()
                .map(|(name, dir, mode)| ResourceSpec {
                    name: (*name).into(),
                    resource_type: ResourceType::Fs,
                    source: dir.display().to_string(),
                    mode: *mode,
                    include: None,
                    exclude: None,
                    gitignore: None,
                    allow_sensitive: None,
                })
                .collect(),
        },
        task: TaskSpec {
            description: "test task".into(),
            prompt: "do the test".into(),
        },
        ttl_seconds: Some(ttl_seconds),
        access_mode: None,
        snapshot_mode: None,
        auth: None,
        transport: None,
        multi_round: None,
        git_remote: None,
        no_network: None,
    }
}
