//! Fleet mode: one Delegator, N Executors on loopback — each Executor its own `awcp-ctl
//! executor` process with its own state directory and no block cache — all delegated the
//! same workspace at once, each agent reading every file. Counts the bytes on both tiers
//! (what the Delegator's process sent: blocks served by its export, objects uploaded to the
//! store; what the Executors got from the store) and the time to hydrate.
//!
//! Used by `tests/tests/block_tier.rs` and by the `awcp-fleet` bench binary
//! (`scripts/bench.sh --fleet N`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use awcp_ctl::daemon::{DaemonConfig, RunningDaemon};
use awcp_protocol::messages::AccessMode;

use crate::s3::S3Server;

/// The `awcp-ctl` binary built beside the running test or bench (`target/<profile>/`),
/// or `$AWCP_CTL_BIN`.
pub fn awcp_ctl_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("AWCP_CTL_BIN") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    // target/<profile>/deps/<test>-<hash>, or target/<profile>/<bin>.
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|d| d.join("awcp-ctl"))
        .find(|p| p.is_file())
}

/// One `awcp-ctl executor` process.
pub struct FleetExecutor {
    child: Child,
    /// Its AWCP endpoint.
    pub awcp_url: String,
    /// Its credential (drawn at its first start into `<dir>/state/executor-token`).
    pub credential: String,
    /// Its state directory (`--dir`).
    pub dir: PathBuf,
}

impl FleetExecutor {
    /// Start `bin executor` on a free loopback port, state in `dir`, running `agent_cmd`;
    /// waits until it answers.
    pub fn spawn(bin: &Path, dir: &Path, agent_cmd: &str) -> FleetExecutor {
        std::fs::create_dir_all(dir).unwrap();
        // Its agents' user passes through to the work directory; the paths the agent
        // command names are shared with the agents.
        if let Some(parent) = dir.parent() {
            crate::open_to_agents(parent);
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::fs::File::create(dir.join("executor.log")).unwrap();
        let child = Command::new(bin)
            .arg("executor")
            .args(["--agent-cmd", agent_cmd])
            .args(crate::shared_path_args(agent_cmd))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--dir")
            .arg(dir)
            .arg("--no-block-cache")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting awcp-ctl executor");
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "executor on port {port} did not start; see {}",
                dir.join("executor.log").display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Drawn before it listens.
        let credential = std::fs::read_to_string(awcp_ctl::executor::credential::credential_path(
            &dir.join("state"),
        ))
        .expect("the executor's credential file")
        .trim()
        .to_owned();
        FleetExecutor {
            child,
            credential,
            awcp_url: format!("http://127.0.0.1:{port}/awcp"),
            dir: dir.to_owned(),
        }
    }

    /// The mount counters of delegation `id` while it is mounted (`GET /awcp/status`).
    pub async fn mount_stats(&self, id: &str) -> Option<serde_json::Value> {
        let v: serde_json::Value = reqwest::Client::new()
            .get(format!("{}/status", self.awcp_url))
            .bearer_auth(&self.credential)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        v["delegations"]
            .as_array()?
            .iter()
            .find(|d| d["id"] == id)
            .map(|d| d["mount"]["stats"].clone())
    }
}

impl Drop for FleetExecutor {
    fn drop(&mut self) {
        // Our own child: SIGINT (it unmounts), then SIGKILL if it lingers.
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one fleet run measured.
#[derive(Debug, Clone, Default)]
pub struct FleetReport {
    /// Executors.
    pub executors: usize,
    /// Bytes of file content in the workspace.
    pub workspace_bytes: u64,
    /// Block bytes the Delegator's export served to mounts (`POST /blocks`).
    pub delegator_served: u64,
    /// Bytes the Delegator's process uploaded to the store.
    pub delegator_uploaded: u64,
    /// Block bytes the Executors got from the store.
    pub from_store: u64,
    /// Block bytes the Executors fetched in all (both tiers).
    pub fetched: u64,
    /// Blocks the store did not give intact (fetched from the Delegator instead).
    pub store_refused: u64,
    /// Blocks the Executors got from the store.
    pub blocks_from_store: u64,
    /// `GET`s the Executors sent to the store (a ranged read of a pack counts once).
    pub store_requests: u64,
    /// Presigned URLs the export handed out.
    pub urls: u64,
    /// From the first agent's start to the last agent's end of reading.
    pub all_hydrated: Duration,
    /// Each agent's reading time.
    pub each: Vec<Duration>,
    /// Each agent's exit status of reading (0: every read succeeded).
    pub read_status: Vec<i32>,
    /// Each agent's checksum of the tree it read (`sha256sum` of every file, sorted by path).
    pub sums: Vec<String>,
}

impl FleetReport {
    /// Everything the Delegator's process sent: blocks served plus objects uploaded.
    pub fn delegator_total(&self) -> u64 {
        self.delegator_served + self.delegator_uploaded
    }
}

/// Total size of the regular files under `dir`.
pub fn tree_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                n += e.metadata().unwrap().len();
            }
        }
    }
    n
}

/// Start a Delegator daemon in this process, state in `state`, with the block tier under
/// `prefix` on `s3` when given.
pub async fn start_delegator(
    state: &Path,
    s3: Option<(&S3Server, &str)>,
    url_ttl: Duration,
) -> RunningDaemon {
    start_delegator_with(state, s3.map(|(s, prefix)| s.tier(prefix, url_ttl))).await
}

/// [`start_delegator`] with the block tier configured as given.
pub async fn start_delegator_with(
    state: &Path,
    tier: Option<awcpfs::export::tier::BlockTierConfig>,
) -> RunningDaemon {
    let mut cfg = DaemonConfig::new(state.to_owned());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.export_listen = "127.0.0.1:0".parse().unwrap();
    cfg.flush_grace = Duration::from_secs(10);
    cfg.blocks = tier;
    awcp_ctl::daemon::start(cfg).await.unwrap()
}

/// The checksum of a tree as the fleet's agents compute it (`sha256sum` of every regular
/// file, sorted by path, relative to `dir`).
pub fn tree_sums(dir: &Path) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg("find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum")
        .current_dir(dir)
        .output()
        .expect("sha256sum");
    assert!(out.status.success(), "checksumming {}", dir.display());
    String::from_utf8(out.stdout).unwrap()
}

/// Delegate `workspace` (read-only) to every executor at once; each agent reads every file,
/// and waits for the test's word before it exits, so its mount counters can be read.
pub async fn run(
    daemon: &RunningDaemon,
    bin: &Path,
    work: &Path,
    workspace: &Path,
    executors: usize,
) -> FleetReport {
    let out = work.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let release = out.join("release");
    let _ = std::fs::remove_file(&release);
    // Every file read and checksummed; the status of reading kept, so that a failed read
    // ends the run at once (and fails the test that checks it) instead of a wait.
    let agent = format!(
        "date +%s%N > {o}/$AWCP_DELEGATION_ID.start && \
         {{ find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum > {o}/$AWCP_DELEGATION_ID.sums; \
            echo $? > {o}/$AWCP_DELEGATION_ID.rc; }} && \
         date +%s%N > {o}/$AWCP_DELEGATION_ID.tmp && \
         mv {o}/$AWCP_DELEGATION_ID.tmp {o}/$AWCP_DELEGATION_ID.end && \
         while [ ! -e {o}/release ]; do sleep 0.05; done; echo hydrated",
        o = out.display()
    );
    let fleet: Vec<FleetExecutor> = (0..executors)
        .map(|i| FleetExecutor::spawn(bin, &work.join(format!("executor-{i}")), &agent))
        .collect();
    let client = daemon.client();
    let ids: Vec<String> = futures::future::join_all(fleet.iter().map(|e| {
        let mut req = crate::request(
            e.awcp_url.clone(),
            &[("workspace", workspace, AccessMode::Ro)],
            600,
        );
        req.access_mode = Some(AccessMode::Ro);
        req.auth = Some(awcp_protocol::messages::AuthCredential {
            auth_type: awcp_protocol::messages::AuthType::Bearer,
            credential: e.credential.clone(),
            metadata: None,
        });
        let client = client.clone();
        async move {
            client
                .delegate(&req)
                .await
                .expect("delegate")
                .delegation_id
                .as_str()
                .to_string()
        }
    }))
    .await;
    let ends: Vec<PathBuf> = ids.iter().map(|id| out.join(format!("{id}.end"))).collect();
    assert!(
        crate::eventually(Duration::from_secs(600), || ends.iter().all(|p| p.exists())).await,
        "not every executor hydrated within 600 s"
    );
    let read_ns =
        |p: PathBuf| -> u128 { std::fs::read_to_string(&p).unwrap().trim().parse().unwrap() };
    let mut report = FleetReport {
        executors,
        workspace_bytes: tree_bytes(workspace),
        ..FleetReport::default()
    };
    let mut first = u128::MAX;
    let mut last = 0;
    for id in &ids {
        let s = read_ns(out.join(format!("{id}.start")));
        let e = read_ns(out.join(format!("{id}.end")));
        first = first.min(s);
        last = last.max(e);
        report
            .each
            .push(Duration::from_nanos(e.saturating_sub(s) as u64));
        let rc = std::fs::read_to_string(out.join(format!("{id}.rc"))).unwrap_or_default();
        report.read_status.push(rc.trim().parse().unwrap_or(-1));
        report
            .sums
            .push(std::fs::read_to_string(out.join(format!("{id}.sums"))).unwrap_or_default());
    }
    report.all_hydrated = Duration::from_nanos(last.saturating_sub(first) as u64);
    for (e, id) in fleet.iter().zip(&ids) {
        let stats = e
            .mount_stats(id)
            .await
            .unwrap_or_else(|| panic!("no mount stats for {id} at {}", e.awcp_url));
        let get = |k: &str| stats[k].as_u64().unwrap_or(0);
        report.fetched += get("bytesFetched");
        report.from_store += get("bytesFromStore");
        report.store_refused += get("storeRefused");
        report.blocks_from_store += get("blocksFromStore");
        report.store_requests += get("storeRequests");
    }
    std::fs::write(&release, b"").unwrap();
    for id in &ids {
        let start = Instant::now();
        loop {
            let v = client.get(id).await.expect("status");
            if v.record.state.is_terminal() {
                let t = v.transfer.unwrap_or_default();
                let get = |k: &str| t[k].as_u64().unwrap_or(0);
                report.delegator_served += get("bytesServed");
                report.delegator_uploaded += get("storeBytesUploaded");
                report.urls += get("storeUrls");
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "delegation {id} did not end"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    drop(fleet);
    report
}

/// A synthetic workspace: `files` files of `size` bytes of incompressible content each
/// (distinct per file), in directories of 100, plus one file of `big` bytes.
pub fn make_workspace(dir: &Path, files: usize, size: usize, big: usize) {
    use rand::{RngCore, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(22);
    for i in 0..files {
        let d = dir.join(format!("d{:03}", i / 100));
        std::fs::create_dir_all(&d).unwrap();
        let mut data = vec![0u8; size];
        rng.fill_bytes(&mut data);
        std::fs::write(d.join(format!("f{i:05}.bin")), data).unwrap();
    }
    if big > 0 {
        let mut data = vec![0u8; big];
        rng.fill_bytes(&mut data);
        std::fs::write(dir.join("big.bin"), data).unwrap();
    }
}
