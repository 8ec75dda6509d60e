//! `awcp-ctl doctor`: check what delegations need on this machine and around it — the FUSE
//! device, the privileges to mount, kernel passthrough support, the daemon and Executors
//! being reachable — and say how to fix each problem found.

mod agents;

pub use agents::{agent_sandbox, processes};

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Ok,
    /// Works, with a limitation.
    Warn,
    /// Delegations will fail here until it is fixed.
    Fail,
}

/// One check.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was checked.
    pub check: String,
    /// How it came out.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

fn check(name: &str, status: Status, detail: String, fix: Option<&str>) -> Check {
    Check {
        check: name.into(),
        status,
        detail,
        fix: fix.map(str::to_owned),
    }
}

/// `CAP_SYS_ADMIN` in the effective set (bit 21 of `CapEff`).
fn has_cap_sys_admin() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 21) != 0)
}

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

/// Kernel release as (major, minor).
fn kernel() -> Option<(u32, u32)> {
    let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let mut it = r.trim().split(['.', '-']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// The local checks: FUSE device, privileges, kernel.
pub fn local() -> Vec<Check> {
    let mut out = Vec::new();
    match std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse") {
        Ok(_) => out.push(check("fuse device", Status::Ok, "/dev/fuse opens read-write".into(), None)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => out.push(check(
            "fuse device",
            Status::Fail,
            "/dev/fuse is missing: an Executor cannot mount workspaces".into(),
            Some("load the module (`modprobe fuse`); in a container, start it with `--device /dev/fuse`"),
        )),
        Err(e) => out.push(check(
            "fuse device",
            Status::Fail,
            format!("/dev/fuse cannot be opened: {e}"),
            Some("run the Executor as root, or give its user access to /dev/fuse"),
        )),
    }
    let root = nix::unistd::geteuid().is_root();
    if root || has_cap_sys_admin() {
        out.push(check(
            "mount privileges",
            Status::Ok,
            if root {
                "running as root".into()
            } else {
                "CAP_SYS_ADMIN is effective".into()
            },
            None,
        ));
    } else if on_path("fusermount3") {
        out.push(check(
            "mount privileges",
            Status::Warn,
            "not root: mounts go through fusermount3 (FUSE passthrough is unavailable)".into(),
            Some("run the Executor as root or with CAP_SYS_ADMIN for passthrough"),
        ));
    } else {
        out.push(check(
            "mount privileges",
            Status::Fail,
            "not root, no CAP_SYS_ADMIN, and no fusermount3: mounting will fail".into(),
            Some("run the Executor as root, or install fuse3 (`apt-get install fuse3`)"),
        ));
    }
    match kernel() {
        Some((maj, min)) if (maj, min) >= (6, 9) => out.push(check(
            "kernel passthrough",
            Status::Ok,
            format!("Linux {maj}.{min} has FUSE passthrough (`executor --passthrough`)"),
            None,
        )),
        Some((maj, min)) => out.push(check(
            "kernel passthrough",
            Status::Warn,
            format!("Linux {maj}.{min} lacks FUSE passthrough: reads are served through FUSE"),
            Some("Linux 6.9 or later gives native read speed with `executor --passthrough`"),
        )),
        None => out.push(check(
            "kernel passthrough",
            Status::Warn,
            "cannot read the kernel version".into(),
            None,
        )),
    }
    out.push(inotify_watches(
        std::fs::read_to_string("/proc/sys/fs/inotify/max_user_watches")
            .ok()
            .and_then(|s| s.trim().parse().ok()),
    ));
    out.extend(sshfs_checks());
    out
}

/// The `sshfs` transport: the Executor offers it only where `sshfs` is installed; a
/// Delegator serves it with its own sshd, as root.
fn sshfs_checks() -> Vec<Check> {
    let mut out = Vec::new();
    out.push(if crate::executor::sshfs_task::available() {
        check(
            "sshfs (Executor)",
            Status::Ok,
            "sshfs is installed: an Executor offers the sshfs transport".into(),
            None,
        )
    } else {
        check(
            "sshfs (Executor)",
            Status::Warn,
            "sshfs is not installed: an Executor does not offer the sshfs transport".into(),
            Some("install it to accept sshfs delegations (`apt-get install sshfs`)"),
        )
    });
    let sshd = std::path::Path::new("/usr/sbin/sshd").exists() || on_path("sshd");
    let root = nix::unistd::geteuid().is_root();
    out.push(match (sshd, root) {
        (true, true) => check(
            "sshd (Delegator)",
            Status::Ok,
            "sshd is installed and this is root: `serve` can offer the sshfs transport".into(),
            None,
        ),
        (true, false) => check(
            "sshd (Delegator)",
            Status::Warn,
            "not root: `serve` refuses sshfs delegations (sshd must chroot each one)".into(),
            Some("run `awcp-ctl serve` as root to delegate with --transport sshfs"),
        ),
        (false, _) => check(
            "sshd (Delegator)",
            Status::Warn,
            "sshd is not installed: `serve` refuses sshfs delegations".into(),
            Some("install OpenSSH's server (`apt-get install openssh-server`), or name one with `serve --sshd`"),
        ),
    });
    out
}

/// Fewest inotify watches per user before a Delegator's watch of a larger workspace (one
/// watch per directory) is likely to fail.
const MIN_INOTIFY_WATCHES: u64 = 65_536;

/// The daemon watches every delegated directory (one inotify watch per directory).
fn inotify_watches(limit: Option<u64>) -> Check {
    const NAME: &str = "inotify watches";
    const FIX: &str = "sysctl -w fs.inotify.max_user_watches=1048576 (and set it in \
                       /etc/sysctl.d/ to keep it)";
    match limit {
        Some(n) if n >= MIN_INOTIFY_WATCHES => check(
            NAME,
            Status::Ok,
            format!("up to {n} watched directories per user (Delegator-side changes reach mounts)"),
            None,
        ),
        Some(n) => check(
            NAME,
            Status::Warn,
            format!(
                "only {n} watched directories per user: a daemon delegating larger workspaces \
                 cannot watch them, and mounts then miss the Delegator's own changes"
            ),
            Some(FIX),
        ),
        None => check(
            NAME,
            Status::Warn,
            "cannot read fs.inotify.max_user_watches: the daemon may not be able to watch \
             delegated directories"
                .into(),
            Some(FIX),
        ),
    }
}

/// Is the daemon there (and does it take our token)?
pub async fn daemon(url: &str, token: Option<&str>) -> Check {
    daemon_named("daemon", url, token).await.0
}

/// The daemons of `--daemon`: one URL, or several comma-separated (daemons sharing one
/// database, which clients fail over between). Each is checked on its own — does it
/// answer, does it take our token, which daemon it is — and its credential mode; with
/// several, the checks are named after their URL (`daemon <url>`, `daemon credential
/// <url>`), a daemon that does not answer is a warning while another does (clients move
/// to that one), and a last check (`daemons`) says whether they make one fleet.
pub async fn daemons(list: &str, token: Option<&str>) -> Vec<Check> {
    let urls: Vec<&str> = list
        .split(',')
        .map(|u| u.trim().trim_end_matches('/'))
        .filter(|u| !u.is_empty())
        .collect();
    if urls.len() <= 1 {
        let url = urls.first().copied().unwrap_or(list);
        return vec![daemon(url, token).await, daemon_credential(url).await];
    }
    let mut checks = Vec::new();
    let mut reached: Vec<(&str, Option<String>)> = Vec::new();
    for url in urls.iter().copied() {
        let (c, health) = daemon_named(&format!("daemon {url}"), url, token).await;
        checks.push(c);
        if let Some(id) = health {
            reached.push((url, id));
            checks.push(named(
                daemon_credential(url).await,
                &format!("daemon credential {url}"),
            ));
        }
    }
    if !reached.is_empty() {
        // Clients move to the next daemon that answers: one down is not a failure.
        for c in &mut checks {
            if c.status == Status::Fail && c.detail.starts_with("cannot reach") {
                c.status = Status::Warn;
                c.detail
                    .push_str(" (clients use another daemon of the list meanwhile)");
            }
        }
    }
    checks.push(fleet(&urls, &reached));
    checks
}

/// `c` under another name.
fn named(mut c: Check, name: &str) -> Check {
    c.check = name.to_owned();
    c
}

/// Whether the daemons of a `--daemon` list make one fleet: `reached` are those that
/// answered, with the id each gave (`None`: a daemon with state of its own).
fn fleet(urls: &[&str], reached: &[(&str, Option<String>)]) -> Check {
    const NAME: &str = "daemons";
    if reached.is_empty() {
        return check(
            NAME,
            Status::Fail,
            format!("none of the {} daemons of --daemon answers", urls.len()),
            Some("start `awcp-ctl serve --state postgres://…` on at least one of them"),
        );
    }
    let own: Vec<&str> = reached
        .iter()
        .filter(|(_, id)| id.is_none())
        .map(|(u, _)| *u)
        .collect();
    if !own.is_empty() {
        return check(
            NAME,
            Status::Warn,
            format!(
                "{} keep{} state of {} own, not a shared database: a client that moves there \
                 finds other delegations, not the ones it was following",
                own.join(", "),
                if own.len() == 1 { "s" } else { "" },
                if own.len() == 1 { "its" } else { "their" },
            ),
            Some(
                "list only daemons started with one `serve --state postgres://…` database, or \
                 give --daemon a single URL",
            ),
        );
    }
    let mut ids: Vec<&str> = reached.iter().filter_map(|(_, id)| id.as_deref()).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        let twice: Vec<&str> = reached
            .iter()
            .filter(|(_, id)| id.as_deref() == Some(w[0]))
            .map(|(u, _)| *u)
            .collect();
        return check(
            NAME,
            Status::Warn,
            format!(
                "{} are one daemon ({}): the list has no second daemon there to fail over to",
                twice.join(" and "),
                w[0]
            ),
            Some("list each daemon once"),
        );
    }
    let first = reached[0].0;
    let status = if reached.len() == urls.len() {
        Status::Ok
    } else {
        Status::Warn
    };
    check(
        NAME,
        status,
        format!(
            "{} of {} daemons answer, each on a shared database; clients use {first} now and \
             move along the list ({}) when one cannot be reached",
            reached.len(),
            urls.len(),
            urls.join(", ")
        ),
        (status == Status::Warn)
            .then_some("start the daemons that do not answer, or take them off the list"),
    )
}

/// [`daemon`] under the check name `name`; also answers, when the daemon answered
/// `/health`, the id it gave (`None` inside: state of its own).
async fn daemon_named(
    name: &str,
    url: &str,
    token: Option<&str>,
) -> (Check, Option<Option<String>>) {
    let http = reqwest::Client::new();
    let base = url.trim_end_matches('/');
    let health = http
        .get(format!("{base}/health"))
        .timeout(Duration::from_secs(2))
        .send()
        .await;
    let id = match health {
        Ok(r) if r.status().is_success() => r
            .json::<awcp_protocol::api::HealthResponse>()
            .await
            .ok()
            .and_then(|h| h.daemon),
        Ok(r) => {
            return (
                check(
                    name,
                    Status::Fail,
                    format!("{base}/health answered {}", r.status()),
                    Some("is --daemon the URL of an `awcp-ctl serve`?"),
                ),
                None,
            );
        }
        Err(e) => {
            return (
                check(
                    name,
                    Status::Fail,
                    format!("cannot reach {base}: {e}"),
                    Some("start `awcp-ctl serve`, or point --daemon / AWCP_DAEMON_URL at it"),
                ),
                None,
            );
        }
    };
    let role = match &id {
        Some(id) => format!("daemon {id}, one of the daemons sharing its database"),
        None => "state of its own (not a shared database)".to_owned(),
    };
    let mut rq = http
        .get(format!("{base}/delegations"))
        .timeout(Duration::from_secs(2));
    if let Some(t) = token {
        rq = rq.bearer_auth(t);
    }
    let c = match rq.send().await {
        Ok(r) if r.status().as_u16() == 401 => check(
            name,
            Status::Fail,
            format!("{base} ({role}) requires an API token, and ours is missing or wrong"),
            Some(
                "set --api-token or AWCP_API_TOKEN to the daemon's token (for several daemons, \
                 one of `awcp-ctl token create`, which all of them accept)",
            ),
        ),
        Ok(r) if r.status().is_success() => check(
            name,
            Status::Ok,
            format!("{base} answers and takes our credential; {role}"),
            None,
        ),
        Ok(r) => check(
            name,
            Status::Fail,
            format!("{base}/delegations answered {}", r.status()),
            None,
        ),
        Err(e) => check(name, Status::Fail, format!("{base}: {e}"), None),
    };
    (c, Some(id))
}

/// Does the daemon refuse a request without its token (`--unsafe-no-auth` lets anyone in)?
pub async fn daemon_credential(url: &str) -> Check {
    const NAME: &str = "daemon credential";
    let base = url.trim_end_matches('/');
    // Asked without any token, and without one in the path.
    let bare = match reqwest::Url::parse(base) {
        Ok(mut u) => {
            u.set_path("/delegations");
            u.to_string()
        }
        Err(_) => format!("{base}/delegations"),
    };
    match reqwest::Client::new()
        .get(&bare)
        .timeout(Duration::from_secs(2))
        .send()
        .await
    {
        Ok(r) if r.status().as_u16() == 401 => check(
            NAME,
            Status::Ok,
            "the daemon API refuses requests without its token".into(),
            None,
        ),
        Ok(r)
            if r.status().is_success()
                && r.headers()
                    .get(crate::daemon::api::AUTH_HEADER)
                    .is_some_and(|v| v == crate::daemon::api::AUTH_PEER_UID) =>
        {
            check(
                NAME,
                Status::Ok,
                "the daemon API refuses requests without its token, but for its own user and \
                 root on this machine (named by the kernel, as we are)"
                    .into(),
                None,
            )
        }
        Ok(r) if r.status().is_success() => check(
            NAME,
            Status::Warn,
            "the daemon API takes no credential (`serve --unsafe-no-auth`): any process that \
             can connect may delegate any directory the daemon can read"
                .into(),
            Some("restart `awcp-ctl serve` without --unsafe-no-auth"),
        ),
        Ok(r) => check(
            NAME,
            Status::Warn,
            format!("{bare} answered {}", r.status()),
            None,
        ),
        Err(e) => check(NAME, Status::Warn, format!("cannot ask {bare}: {e}"), None),
    }
}

/// Are the daemon's and the Executor's state on this machine private (nothing readable by
/// group or others)? Paths that do not exist are skipped.
pub fn file_modes(daemon_state: &std::path::Path, executor_dir: &std::path::Path) -> Check {
    use std::os::unix::fs::PermissionsExt as _;
    const NAME: &str = "file modes";
    let mut paths = vec![daemon_state.to_path_buf()];
    for f in [
        crate::daemon::API_TOKEN_FILE,
        "delegator.db",
        "delegator.db-wal",
        "delegator.db-shm",
        "staging",
        "archive",
    ] {
        paths.push(daemon_state.join(f));
    }
    // What the daemon keeps per delegation: upload staging (blocks, change sets, commit
    // logs) and archive bases (file lists, hashes) and snapshots, two levels down.
    for d in ["staging", "archive"] {
        paths.extend(below(&daemon_state.join(d), 2));
    }
    for d in ["state", "work", "cache"] {
        paths.push(executor_dir.join(d));
    }
    paths.push(crate::executor::credential::credential_path(
        &executor_dir.join("state"),
    ));
    let mut checked = 0;
    let mut open = Vec::new();
    for p in &paths {
        let Ok(m) = std::fs::metadata(p) else {
            continue;
        };
        checked += 1;
        let mode = m.permissions().mode() & 0o777;
        if awcpfs::private::is_shared(mode) {
            open.push(format!("{} ({mode:o})", p.display()));
        }
    }
    if !open.is_empty() {
        return check(
            NAME,
            Status::Warn,
            format!("readable by other users: {}", open.join(", ")),
            Some(
                "chmod 0700 the directories and 0600 the files (the daemon and the Executor \
                 tighten their own at start)",
            ),
        );
    }
    check(
        NAME,
        Status::Ok,
        if checked == 0 {
            format!(
                "no state yet under {} or {}",
                daemon_state.display(),
                executor_dir.display()
            )
        } else {
            format!("{checked} state paths, all private (0700/0600)")
        },
        None,
    )
}

/// The entries below `dir`, `depth` levels down (at most 10,000).
fn below(dir: &std::path::Path, depth: usize) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut level = vec![dir.to_path_buf()];
    for _ in 0..depth {
        let mut next = Vec::new();
        for d in &level {
            for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                if out.len() >= 10_000 {
                    return out;
                }
                let p = e.path();
                out.push(p.clone());
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    next.push(p);
                }
            }
        }
        level = next;
    }
    out
}

/// Are awcpfs mounts on this machine open to other users? A mount with `allow_other` is
/// fine behind a gate — a directory above it that only its users and root may search (the
/// Executor's 0700 work directory; `gate_of` finds it, see `awcpfs::mount::access`) — and
/// a warning without one.
pub fn mount_access(
    mountinfo: &str,
    gate_of: impl Fn(&std::path::Path) -> Option<PathBuf>,
) -> Check {
    const NAME: &str = "mount access";
    let mut gated = Vec::new();
    let mut open = Vec::new();
    for l in mountinfo
        .lines()
        .filter(|l| l.contains(" fuse.awcpfs ") && l.contains("allow_other"))
    {
        let Some(mp) = l.split(' ').nth(4) else {
            continue;
        };
        // mountinfo escapes space, tab, newline and backslash as octal.
        let mp = mp
            .replace("\\040", " ")
            .replace("\\011", "\t")
            .replace("\\012", "\n")
            .replace("\\134", "\\");
        match gate_of(std::path::Path::new(&mp)) {
            Some(gate) => gated.push(format!("{mp} (behind {})", gate.display())),
            None => open.push(mp),
        }
    }
    if !open.is_empty() {
        return check(
            NAME,
            Status::Warn,
            format!(
                "awcpfs mounts open to every user who can reach them (allow_other, no private \
                 directory above): {}",
                open.join(", ")
            ),
            Some(
                "run the Executor with the default --mount-access path and keep its work \
                 directory 0700 (a standalone mount: --access path below a 0700 directory)",
            ),
        );
    }
    let detail = if gated.is_empty() {
        "no awcpfs mount here lets other users in (no allow_other)".into()
    } else {
        format!(
            "awcpfs mounts served like local directories, other users kept out by the path: {}",
            gated.join(", ")
        )
    };
    check(NAME, Status::Ok, detail, None)
}

/// Which FUSE transport the running mounts use (from each mount's `status.json` below
/// `executor_dir`, `fuseTransport`), and what `--fuse-transport auto` would choose here.
pub fn fuse_transport(executor_dir: &std::path::Path) -> Check {
    const NAME: &str = "fuse transport";
    let mut mounts = Vec::new();
    let mut dirs = vec![(executor_dir.to_path_buf(), 0)];
    while let Some((dir, depth)) = dirs.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) && depth < 3 {
                dirs.push((p, depth + 1));
            } else if e.file_name() == "status.json"
                && let Ok(text) = std::fs::read_to_string(&p)
                && let Ok(st) = serde_json::from_str::<serde_json::Value>(&text)
                && st["state"] == "mounted"
                && let (Some(mp), Some(t)) =
                    (st["mountpoint"].as_str(), st["fuseTransport"].as_str())
            {
                mounts.push(format!("{mp} over {t}"));
            }
        }
    }
    mounts.sort();
    let auto = match awcpfs::mount::uring::uring_unavailable() {
        None => "--fuse-transport auto serves new mounts over io_uring".to_string(),
        Some(why) => format!("--fuse-transport auto serves new mounts over /dev/fuse: {why}"),
    };
    let detail = if mounts.is_empty() {
        format!("no running mount below {}; {auto}", executor_dir.display())
    } else {
        format!("{}; {auto}", mounts.join(", "))
    };
    // Only the kernel's switch stands between this machine and io_uring: say what it buys.
    let fix = (awcpfs::mount::uring::kernel_enables_uring() == Some(false)
        && nix::unistd::geteuid().is_root())
    .then_some(
        "turn enable_uring on as above and mount again: over /dev/fuse a request wakes a \
         server thread on another CPU, about 3x a request over io_uring, and every Python \
         open() makes one (its isatty ioctl); see docs/BENCHMARKS.md",
    );
    check(NAME, Status::Ok, detail, fix)
}

/// The gate of a mount seen in mountinfo: judged for the mounting user (`user_id`, root
/// here) and the owner of the mount's root (an Executor's `--agent-user`).
pub fn mount_gate(mountpoint: &std::path::Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt as _;
    let mut users = vec![nix::unistd::geteuid().as_raw()];
    if let Ok(m) = std::fs::metadata(mountpoint) {
        users.push(m.uid());
    }
    awcpfs::mount::access::gate(mountpoint, &users)
}

/// Is this Executor's AWCP endpoint there?
pub async fn executor(url: &str, token: Option<&str>) -> Check {
    let u = url.trim_end_matches('/');
    let base = u.strip_suffix("/awcp").unwrap_or(u);
    let mut rq = reqwest::Client::new()
        .get(format!("{base}/awcp/status"))
        .timeout(Duration::from_secs(2));
    if let Some(t) = token {
        rq = rq.bearer_auth(t);
    }
    let name = format!("executor {url}");
    match rq.send().await {
        Ok(r) if r.status().is_success() => {
            let st = r.json::<awcp_protocol::api::ExecutorStatus>().await.ok();
            match st.as_ref().and_then(|s| s.auth.as_deref()) {
                Some("open") => check(
                    &name,
                    Status::Warn,
                    "the Executor accepts INVITEs from anyone (--unsafe-open): whoever reaches \
                     it can run code there"
                        .into(),
                    Some(
                        "restart it without --unsafe-open and hand its credential \
                         (<dir>/state/executor-token) to your Delegators",
                    ),
                ),
                Some(_) if token.is_none() => check(
                    &name,
                    Status::Ok,
                    "the AWCP endpoint answers; it requires its credential (give it with \
                     --executor-token-file to check it)"
                        .into(),
                    None,
                ),
                Some(_) if st.as_ref().is_some_and(|s| s.pending.is_none()) => check(
                    &name,
                    Status::Fail,
                    "the Executor does not take the credential given".into(),
                    Some("give the content of its <dir>/state/executor-token"),
                ),
                _ => check(&name, Status::Ok, "the AWCP endpoint answers".into(), None),
            }
        }
        Ok(r) if r.status().as_u16() == 401 => check(
            &name,
            Status::Fail,
            "the Executor requires a token".into(),
            Some("give it with --executor-token-file (AWCP_EXECUTOR_TOKEN_FILE)"),
        ),
        Ok(r) => check(
            &name,
            Status::Fail,
            format!("{base}/awcp/status answered {}", r.status()),
            Some("the Executor's AWCP endpoint is <base>/awcp (`awcp-ctl executor` serves it)"),
        ),
        Err(e) => check(
            &name,
            Status::Fail,
            format!("cannot reach it: {e}"),
            Some("start `awcp-ctl executor` there, and check --listen and firewalls"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loose_state_and_open_mounts_are_warnings() {
        use std::os::unix::fs::PermissionsExt as _;
        let tmp = tempfile::tempdir().unwrap();
        let (d, e) = (tmp.path().join("d"), tmp.path().join("e"));
        assert_eq!(file_modes(&d, &e).status, Status::Ok, "nothing there yet");
        awcpfs::private::create_dir_all(&d).unwrap();
        awcpfs::private::write(&d.join("delegator.db"), b"").unwrap();
        assert_eq!(file_modes(&d, &e).status, Status::Ok);
        std::fs::set_permissions(
            d.join("delegator.db"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let loose = file_modes(&d, &e);
        assert_eq!(loose.status, Status::Warn);
        assert!(
            loose.detail.contains("delegator.db (644)"),
            "{}",
            loose.detail
        );

        let closed = "36 25 0:50 / /x/work/dlg_1 rw,nosuid,nodev - fuse.awcpfs awcpfs:dlg_1 rw,user_id=0,group_id=0,default_permissions";
        let no_gate = |_: &std::path::Path| None;
        assert_eq!(mount_access(closed, no_gate).status, Status::Ok);
        let open = format!("{closed},allow_other");
        let w = mount_access(&open, no_gate);
        assert_eq!(w.status, Status::Warn);
        assert!(w.detail.contains("/x/work/dlg_1"), "{}", w.detail);
        // Behind a private directory it is what the default asks for.
        let behind = mount_access(&open, |p: &std::path::Path| {
            p.parent().map(std::path::Path::to_path_buf)
        });
        assert_eq!(behind.status, Status::Ok);
        assert!(
            behind.detail.contains("behind /x/work"),
            "{}",
            behind.detail
        );
        // Escaped names come back whole.
        let spaced = open.replace("dlg_1 rw,nosuid", "my\\040ws rw,nosuid");
        let seen = std::cell::RefCell::new(Vec::new());
        mount_access(&spaced, |p: &std::path::Path| {
            seen.borrow_mut().push(p.to_path_buf());
            None
        });
        assert_eq!(seen.into_inner(), [PathBuf::from("/x/work/my ws")]);
    }

    #[test]
    fn a_list_of_daemons_is_one_fleet_only_on_one_shared_database() {
        let urls = ["http://a:3100", "http://b:3100"];
        let id = |s: &str| Some(s.to_owned());
        let both = [(urls[0], id("dmn_1")), (urls[1], id("dmn_2"))];
        let c = fleet(&urls, &both);
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert!(c.detail.contains("clients use http://a:3100 now"), "{c:?}");
        // One down: clients still work, through the other.
        let c = fleet(&urls, &both[1..]);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.contains("1 of 2"), "{c:?}");
        assert!(c.detail.contains("clients use http://b:3100 now"), "{c:?}");
        // None.
        assert_eq!(fleet(&urls, &[]).status, Status::Fail);
        // A daemon with state of its own.
        let c = fleet(&urls, &[(urls[0], id("dmn_1")), (urls[1], None)]);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(
            c.detail.starts_with("http://b:3100 keeps state of its own"),
            "{c:?}"
        );
        // One daemon behind both URLs (or two sharing a state directory).
        let c = fleet(&urls, &[(urls[0], id("dmn_1")), (urls[1], id("dmn_1"))]);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.contains("are one daemon (dmn_1)"), "{c:?}");
    }

    #[test]
    fn a_low_inotify_limit_is_a_warning_with_a_fix() {
        let low = inotify_watches(Some(8192));
        assert_eq!(low.status, Status::Warn);
        assert!(low.fix.as_deref().unwrap().contains("max_user_watches"));
        assert_eq!(inotify_watches(Some(1 << 20)).status, Status::Ok);
        assert_eq!(inotify_watches(None).status, Status::Warn);
    }

    #[test]
    fn the_fuse_transport_check_names_each_running_mounts_transport() {
        let dir = tempfile::tempdir().unwrap();
        let task = dir.path().join("state").join("task-1");
        std::fs::create_dir_all(&task).unwrap();
        let status = |state: &str, mp: &str, t: &str| {
            serde_json::json!({"state": state, "mountpoint": mp, "fuseTransport": t}).to_string()
        };
        std::fs::write(
            task.join("status.json"),
            status("mounted", "/w/a", "io_uring"),
        )
        .unwrap();
        let ended = dir.path().join("state").join("task-2");
        std::fs::create_dir_all(&ended).unwrap();
        std::fs::write(
            ended.join("status.json"),
            status("ended", "/w/b", "/dev/fuse"),
        )
        .unwrap();
        let c = super::fuse_transport(dir.path());
        assert!(c.detail.contains("/w/a over io_uring"), "{}", c.detail);
        assert!(
            !c.detail.contains("/w/b"),
            "an ended mount is not running: {}",
            c.detail
        );
        assert!(c.detail.contains("--fuse-transport auto"), "{}", c.detail);
    }
}
