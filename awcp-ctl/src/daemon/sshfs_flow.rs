//! The Delegator's half of the reference's `sshfs` transport: a dedicated, restricted
//! `sshd` per delegation, reached with a short-lived SSH user certificate from the daemon's
//! own CA.
//!
//! The daemon keeps a user CA and a host key (ed25519, 0600) in `<state>/sshfs/`. For each
//! delegation it:
//! * builds a chroot under `serve --sshfs-chroot-dir` (default `/run/awcp-sshfs`):
//!   `<base>/<id>/root/`, root-owned 0755 as sshd requires of a chroot, holding one bind
//!   mount per resource, `<base>/<id>/root/<resourceName>` (read-only for `ro` resources) —
//!   the reference's layout of an export root, so the handle's `exportLocator` is `/`;
//! * writes `<base>/<id>/principals`, naming only this delegation's principal
//!   (`awcp-<id>`), and an `sshd_config` (in the state directory) that allows nothing but
//!   SFTP: certificate authentication against the daemon's CA only, `AllowUsers` the one
//!   login user, `ChrootDirectory` the delegation's root, `ForceCommand internal-sftp`
//!   (`-R` for a read-only delegation), no TTY, no forwarding of any kind, no user rc;
//! * starts `sshd -D -e -f <config>` on a free port of `serve --sshfs-listen`;
//! * issues a fresh key pair and a certificate for it (`ssh-keygen -s CA -I awcp-<id>
//!   -n awcp-<id> -V -1m:+<ttl>s -O clear -O force-command=internal-sftp`), hands both to
//!   the Executor in START and keeps neither.
//!
//! When the delegation ends (done, error, revoke, expiry) the principals file is emptied
//! (the certificate is refused from then on), every process of that sshd — its live SFTP
//! sessions included — is killed, the bind mounts are detached and the chroot removed.
//!
//! Only root can chroot and bind-mount: the daemon must run as root to serve `sshfs`.

use std::collections::HashMap;
use std::io::Read as _;
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcp_protocol::api::{DelegateRequest, SnapshotMode};
use awcp_protocol::messages::AccessMode;
use awcp_protocol::transport::{SshCredential, SshEndpoint, SshfsHandle};
use awcp_protocol::{DelegationId, ErrorCode};

use super::flow::{Handle, NewDelegation, Refusal};
use super::{Daemon, Live};

/// How the daemon serves the `sshfs` transport (`serve --sshfs-*`).
#[derive(Debug, Clone)]
pub struct SshfsConfig {
    /// The `sshd` binary (`--sshd`; default `/usr/sbin/sshd`, else `sshd` on `PATH`).
    pub sshd: Option<PathBuf>,
    /// The address each delegation's sshd listens on (`--sshfs-listen`, default
    /// `127.0.0.1`).
    pub listen: IpAddr,
    /// The host name Executors are told to connect to (`--sshfs-host`; default the listen
    /// address).
    pub host: Option<String>,
    /// The login user (`--sshfs-user`; default the owner of the first resource directory,
    /// so files the Executor writes keep the workspace's owner).
    pub user: Option<String>,
    /// Where the chroots live (`--sshfs-chroot-dir`): every component of this path must be
    /// owned by root and writable by nobody else, as sshd demands of a chroot.
    pub chroot_base: PathBuf,
}

impl Default for SshfsConfig {
    fn default() -> Self {
        SshfsConfig {
            sshd: None,
            listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
            host: None,
            user: None,
            chroot_base: PathBuf::from("/run/awcp-sshfs"),
        }
    }
}

/// The running sshd servers, by delegation id.
#[derive(Default)]
pub(crate) struct Servers {
    map: Mutex<HashMap<String, Server>>,
    /// Servers being stopped: a daemon that stops waits for them (an exit half-way would
    /// leave a bind mount behind).
    stopping: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Servers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Servers")
            .field("running", &self.map.lock().len())
            .finish()
    }
}

/// One delegation's sshd.
struct Server {
    /// `None` until sshd is started.
    child: Option<Child>,
    /// `<base>/<id>`: principals file and chroot.
    dir: PathBuf,
    /// The bind mounts, `<base>/<id>/root/<name>`.
    binds: Vec<PathBuf>,
}

fn refuse(message: String, hint: &str) -> Refusal {
    Refusal {
        status: 500,
        message,
        code: Some(ErrorCode::SetupFailed),
        hint: Some(hint.into()),
    }
}

/// Run a command to its end; its stderr in the error.
fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {:?}: {e}", cmd.get_program()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{:?} failed ({}): {}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The directory OpenSSH's sshd names when it refuses to start without its
/// privilege-separation directory (compiled in: `/run/sshd` on Debian, `/var/empty` on
/// others), from its error text.
fn missing_privsep_dir(err: &str) -> Option<PathBuf> {
    const MARK: &str = "Missing privilege separation directory: ";
    let (_, rest) = err.split_once(MARK)?;
    let dir = rest.split_whitespace().next()?;
    let dir = Path::new(dir);
    (dir.is_absolute() && dir.components().all(|c| !matches!(c, Component::ParentDir)))
        .then(|| dir.to_path_buf())
}

/// Make sshd's privilege-separation directory as sshd requires it: root's, writable by no
/// one else (an existing one is left as it is).
fn make_privsep_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// The sshd binary to run.
fn sshd_binary(cfg: &SshfsConfig) -> Option<PathBuf> {
    if let Some(p) = &cfg.sshd {
        return Some(p.clone());
    }
    let default = PathBuf::from("/usr/sbin/sshd");
    if default.exists() {
        return Some(default);
    }
    find_in_path("sshd")
}

/// `bin` in a directory of `PATH`.
pub(crate) fn find_in_path(bin: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}

/// Check sshd's rule for a chroot path: every component root-owned, writable by no one
/// else.
fn check_chroot_path(path: &Path) -> Result<(), String> {
    let mut p = PathBuf::from("/");
    for c in path.components().skip(1) {
        p.push(c);
        let m = std::fs::metadata(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        if m.uid() != 0 || m.mode() & 0o022 != 0 {
            return Err(format!(
                "{} is {} with mode {:o}: sshd refuses a chroot below a directory that \
                 is not root-owned or is writable by others",
                p.display(),
                if m.uid() == 0 {
                    "root's".to_string()
                } else {
                    format!("uid {}'s", m.uid())
                },
                m.mode() & 0o7777
            ));
        }
    }
    Ok(())
}

/// Make `dir` (and its missing parents) root-owned with `mode`.
fn root_dir(dir: &Path, mode: u32) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
}

/// The CA and host key in `<state>/sshfs/`, created (ed25519, 0600) on first use.
fn ensure_keys(keys: &Path) -> Result<(), String> {
    awcpfs::private::create_dir_all(keys).map_err(|e| format!("{}: {e}", keys.display()))?;
    for (name, comment) in [("ca", "awcp-user-ca"), ("host_key", "awcp-sshfs-host")] {
        let path = keys.join(name);
        if path.exists() {
            continue;
        }
        run(Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
            .arg(&path))?;
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
    }
    Ok(())
}

/// The login user: configured, or the owner of `source`.
fn login_user(cfg: &SshfsConfig, source: &Path) -> Result<String, String> {
    if let Some(u) = &cfg.user {
        return Ok(u.clone());
    }
    let uid = std::fs::metadata(source)
        .map_err(|e| format!("{}: {e}", source.display()))?
        .uid();
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(u)) => Ok(u.name),
        _ => Err(format!(
            "the owner of {} (uid {uid}) has no user name to log in as",
            source.display()
        )),
    }
}

/// A user name safe in sshd's configuration.
fn plain_user(u: &str) -> bool {
    !u.is_empty()
        && !u.starts_with('-')
        && u.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// A free TCP port on `ip` (the listener is closed again; sshd binds it next).
fn free_port(ip: IpAddr) -> std::io::Result<u16> {
    Ok(TcpListener::bind((ip, 0))?.local_addr()?.port())
}

/// Every process whose parent chain leads to `pid` (read from `/proc`).
fn descendants(pid: i32) -> Vec<i32> {
    let mut parent: Vec<(i32, i32)> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
                continue;
            };
            if let Some(pp) = rest.split_whitespace().nth(1).and_then(|s| s.parse().ok()) {
                parent.push((p, pp));
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        for &(c, pp) in &parent {
            if pp == p && !out.contains(&c) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}

/// Kill an sshd and every process below it (its live sessions).
fn kill_tree(child: &mut Child) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let pid = child.id() as i32;
    // Stopped, the listener forks no new session while its children are found and killed.
    let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
    for _ in 0..5 {
        let below = descendants(pid);
        if below.is_empty() {
            break;
        }
        for p in below {
            let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Whether `path` is a mount point.
fn is_mount_point(path: &Path) -> bool {
    let (Ok(m), Some(parent)) = (std::fs::symlink_metadata(path), path.parent()) else {
        return false;
    };
    std::fs::metadata(parent).is_ok_and(|p| p.dev() != m.dev())
}

impl Server {
    /// End it: refuse the certificate, kill the sessions, detach the binds, remove the
    /// chroot. Never removes anything below a bind that is still mounted.
    fn stop(mut self, id: &str) {
        let _ = std::fs::write(self.dir.join("principals"), b"");
        if let Some(child) = &mut self.child {
            kill_tree(child);
        }
        for b in &self.binds {
            let _ = nix::mount::umount2(b, nix::mount::MntFlags::MNT_DETACH);
            if is_mount_point(b) {
                tracing::warn!(%id, bind = %b.display(), "cannot detach the sshfs bind mount; left in place");
                continue;
            }
            let _ = std::fs::remove_dir(b);
        }
        let _ = std::fs::remove_file(self.dir.join("principals"));
        let _ = std::fs::remove_dir(self.dir.join("root"));
        let _ = std::fs::remove_dir(&self.dir);
        tracing::info!(%id, "sshfs server stopped; its certificate is no longer accepted");
    }
}

/// Everything the blocking setup needs.
struct Plan {
    id: String,
    keys: PathBuf,
    state: PathBuf,
    dir: PathBuf,
    sshd: PathBuf,
    listen: IpAddr,
    user: String,
    ttl: Duration,
    read_only: bool,
    /// `(name, source, writable)`.
    resources: Vec<(String, PathBuf, bool)>,
}

/// Set the chroot, the config and the credential up and start sshd (blocking).
fn start_server(plan: &Plan) -> Result<(Server, u16, SshCredential, String), String> {
    let principal = format!("awcp-{}", plan.id);
    ensure_keys(&plan.keys)?;
    let base = plan.dir.parent().unwrap_or(Path::new("/"));
    root_dir(base, 0o755).map_err(|e| format!("{}: {e}", base.display()))?;
    check_chroot_path(base)?;
    let root = plan.dir.join("root");
    // 0711: the login user reads the principals file below it, and nothing else.
    root_dir(&plan.dir, 0o711).map_err(|e| format!("{}: {e}", plan.dir.display()))?;
    root_dir(&root, 0o755).map_err(|e| format!("{}: {e}", root.display()))?;
    std::fs::write(plan.dir.join("principals"), format!("{principal}\n"))
        .and_then(|_| {
            std::fs::set_permissions(
                plan.dir.join("principals"),
                std::fs::Permissions::from_mode(0o644),
            )
        })
        .map_err(|e| format!("writing the principals file: {e}"))?;
    let mut server = Server {
        child: None,
        dir: plan.dir.clone(),
        binds: Vec::new(),
    };
    let fail = |server: Server, e: String| {
        server.stop(&plan.id);
        Err(e)
    };
    for (name, source, writable) in &plan.resources {
        let target = root.join(name);
        if let Err(e) = std::fs::create_dir(&target) {
            return fail(server, format!("{}: {e}", target.display()));
        }
        server.binds.push(target.clone());
        use nix::mount::{MsFlags, mount};
        let flags = MsFlags::MS_BIND | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if let Err(e) = mount(Some(source), &target, None::<&str>, flags, None::<&str>) {
            return fail(
                server,
                format!("bind-mounting {} for sshd: {e}", source.display()),
            );
        }
        if !writable || plan.read_only {
            let ro = flags | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
            if let Err(e) = mount(None::<&str>, &target, None::<&str>, ro, None::<&str>) {
                return fail(
                    server,
                    format!("making {} read-only: {e}", target.display()),
                );
            }
        }
    }
    let port = match free_port(plan.listen) {
        Ok(p) => p,
        Err(e) => return fail(server, format!("no free port on {}: {e}", plan.listen)),
    };
    let listen = match plan.listen {
        IpAddr::V6(ip) => format!("[{ip}]:{port}"),
        IpAddr::V4(ip) => format!("{ip}:{port}"),
    };
    let root_login = if plan.user == "root" {
        // Root only with a forced command; the certificate carries one.
        "forced-commands-only"
    } else {
        "no"
    };
    let sftp = if plan.read_only {
        "internal-sftp -R"
    } else {
        "internal-sftp"
    };
    let config = format!(
        "# Written by awcp-ctl for delegation {id}: SFTP only, one certificate principal.\n\
         ListenAddress {listen}\n\
         HostKey {host_key}\n\
         PidFile none\n\
         TrustedUserCAKeys {ca}\n\
         AuthorizedPrincipalsFile {principals}\n\
         AuthorizedKeysFile none\n\
         PubkeyAuthentication yes\n\
         PasswordAuthentication no\n\
         KbdInteractiveAuthentication no\n\
         HostbasedAuthentication no\n\
         PermitEmptyPasswords no\n\
         PermitRootLogin {root_login}\n\
         AllowUsers {user}\n\
         UsePAM no\n\
         StrictModes yes\n\
         ChrootDirectory {root}\n\
         ForceCommand {sftp}\n\
         Subsystem sftp internal-sftp\n\
         DisableForwarding yes\n\
         AllowTcpForwarding no\n\
         AllowStreamLocalForwarding no\n\
         AllowAgentForwarding no\n\
         X11Forwarding no\n\
         PermitTunnel no\n\
         PermitTTY no\n\
         PermitUserRC no\n\
         PermitUserEnvironment no\n\
         GatewayPorts no\n\
         MaxAuthTries 2\n\
         LoginGraceTime 20\n\
         ClientAliveInterval 15\n\
         ClientAliveCountMax 3\n\
         LogLevel VERBOSE\n",
        id = plan.id,
        host_key = plan.keys.join("host_key").display(),
        ca = plan.keys.join("ca.pub").display(),
        principals = plan.dir.join("principals").display(),
        user = plan.user,
        root = root.display(),
    );
    let cfg_path = plan.state.join("sshd_config");
    if let Err(e) = awcpfs::private::create_dir_all(&plan.state)
        .and_then(|_| awcpfs::private::write(&cfg_path, config.as_bytes()))
    {
        return fail(server, format!("writing {}: {e}", cfg_path.display()));
    }
    let test_config = || run(Command::new(&plan.sshd).arg("-t").arg("-f").arg(&cfg_path));
    let mut tested = test_config();
    if let Some(dir) = tested.as_ref().err().and_then(|e| missing_privsep_dir(e)) {
        // A machine whose own sshd never started (a container, a fresh install) lacks the
        // directory its service manager makes at boot; sshd will not start without it.
        match make_privsep_dir(&dir) {
            Ok(()) => {
                tracing::info!(dir = %dir.display(), "created sshd's privilege-separation directory");
                tested = test_config();
            }
            Err(e) => {
                return fail(
                    server,
                    format!(
                        "sshd needs its privilege-separation directory {} and it could not be \
                         created ({e}); create it (root's, mode 0755) and delegate again",
                        dir.display()
                    ),
                );
            }
        }
    }
    if let Err(e) = tested {
        return fail(server, format!("sshd rejects its configuration: {e}"));
    }
    // The credential: a fresh key pair, certified for this delegation's principal for the
    // lease (from a minute ago, for clocks slightly apart); neither file is kept.
    let key = plan.state.join("key");
    let _ = std::fs::remove_file(&key);
    let _ = std::fs::remove_file(plan.state.join("key.pub"));
    let _ = std::fs::remove_file(plan.state.join("key-cert.pub"));
    let issued = run(Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C"])
        .arg(&principal)
        .arg("-f")
        .arg(&key))
    .and_then(|_| {
        run(Command::new("ssh-keygen")
            .arg("-q")
            .arg("-s")
            .arg(plan.keys.join("ca"))
            .args(["-I", &principal, "-n", &principal])
            .arg("-V")
            .arg(format!("-1m:+{}s", plan.ttl.as_secs().max(1)))
            .args(["-O", "clear", "-O", "force-command=internal-sftp"])
            .arg(plan.state.join("key.pub")))
    })
    .and_then(|_| {
        let private_key = std::fs::read_to_string(&key).map_err(|e| e.to_string())?;
        let certificate =
            std::fs::read_to_string(plan.state.join("key-cert.pub")).map_err(|e| e.to_string())?;
        Ok(SshCredential {
            private_key,
            certificate: certificate.trim().to_string(),
        })
    });
    let _ = std::fs::remove_file(&key);
    let _ = std::fs::remove_file(plan.state.join("key.pub"));
    let _ = std::fs::remove_file(plan.state.join("key-cert.pub"));
    let credential = match issued {
        Ok(c) => c,
        Err(e) => return fail(server, format!("issuing the certificate: {e}")),
    };
    let host_key = match std::fs::read_to_string(plan.keys.join("host_key.pub")) {
        // `type base64` (the comment left out).
        Ok(k) => k.split_whitespace().take(2).collect::<Vec<_>>().join(" "),
        Err(e) => return fail(server, format!("reading the host key: {e}")),
    };
    let log = match awcpfs::private::file_options()
        .truncate(true)
        .open(plan.state.join("sshd.log"))
    {
        Ok(f) => f,
        Err(e) => return fail(server, format!("creating sshd.log: {e}")),
    };
    match Command::new(&plan.sshd)
        .args(["-D", "-e", "-f"])
        .arg(&cfg_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
    {
        Ok(c) => server.child = Some(c),
        Err(e) => return fail(server, format!("cannot start {}: {e}", plan.sshd.display())),
    }
    // Up when it greets: `SSH-2.0-…`.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(Ok(Some(status))) = server.child.as_mut().map(Child::try_wait) {
            let log = std::fs::read_to_string(plan.state.join("sshd.log")).unwrap_or_default();
            return fail(server, format!("sshd exited ({status}): {}", log.trim()));
        }
        let greeted =
            TcpStream::connect_timeout(&(plan.listen, port).into(), Duration::from_secs(1))
                .ok()
                .and_then(|mut s| {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                    let mut buf = [0u8; 4];
                    s.read_exact(&mut buf).ok().map(|_| buf)
                });
        if greeted == Some(*b"SSH-") {
            break;
        }
        if Instant::now() > deadline {
            return fail(
                server,
                format!("sshd did not answer on {listen} within 10 s"),
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((server, port, credential, host_key))
}

/// The processes whose command line holds `needle`.
fn processes_with(needle: &str) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&cmd)
                .contains(needle)
                .then_some(pid)
        })
        .collect()
}

/// End what an earlier run of this daemon (state in `state_dir`) left behind: the sshd of
/// each delegation it had (found by its configuration's path) with its sessions, the bind
/// mounts and the chroot (blocking).
pub(crate) fn sweep_leftovers(state_dir: &Path, chroot_base: &Path) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let Ok(rd) = std::fs::read_dir(state_dir.join("sshfs")) else {
        return;
    };
    for e in rd.flatten() {
        let Some(id) = e.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !id.starts_with("dlg_") || !e.path().is_dir() {
            continue;
        }
        let cfg = e.path().join("sshd_config");
        if !cfg.exists() {
            let _ = std::fs::remove_dir_all(e.path());
            continue;
        }
        for pid in processes_with(&cfg.display().to_string()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
            for p in descendants(pid) {
                let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
            }
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let dir = chroot_base.join(&id);
        let binds = std::fs::read_dir(dir.join("root"))
            .map(|rd| rd.flatten().map(|b| b.path()).collect())
            .unwrap_or_default();
        Server {
            child: None,
            dir,
            binds,
        }
        .stop(&id);
        let _ = std::fs::remove_file(&cfg);
        let _ = std::fs::remove_file(e.path().join("sshd.log"));
        let _ = std::fs::remove_dir(e.path());
        tracing::warn!(%id, "ended an sshfs server left by an earlier run of the daemon");
    }
}

impl Daemon {
    /// `POST /delegate` with `transport: "sshfs"`.
    pub(crate) async fn delegate_sshfs(
        self: &Arc<Self>,
        req: DelegateRequest,
        progress: Arc<super::progress::Progress>,
    ) -> Result<DelegationId, Refusal> {
        if matches!(
            req.snapshot_mode,
            Some(SnapshotMode::Staged | SnapshotMode::Discard)
        ) {
            return Err(Refusal::bad(
                ErrorCode::WorkspaceInvalid,
                "with the sshfs transport the Executor writes into the workspace as it works: \
                 there is no snapshot to stage or discard"
                    .into(),
                "Use snapshotMode \"auto\" with sshfs, or the awcpfs or archive transport to \
                 review changes before they land",
            ));
        }
        if !nix::unistd::geteuid().is_root() {
            return Err(refuse(
                "the sshfs transport needs the daemon to run as root (sshd chroots each \
                 delegation and its workspace is bind-mounted into the chroot)"
                    .into(),
                "Run `awcp-ctl serve` as root to offer sshfs, or delegate with the awcpfs, \
                 archive, storage or git transport",
            ));
        }
        let cfg = self.cfg.sshfs.clone();
        let Some(sshd) = sshd_binary(&cfg) else {
            return Err(refuse(
                "sshd is not installed".into(),
                "Install OpenSSH's server (Debian: apt-get install openssh-server), or name it \
                 with `awcp-ctl serve --sshd PATH`",
            ));
        };
        super::resources::check_names(req.environment.resources.iter().map(|r| r.name.as_str()))?;
        let mut resources = Vec::new();
        for r in &req.environment.resources {
            let root = std::path::absolute(&r.source).unwrap_or_else(|_| PathBuf::from(&r.source));
            super::flow::check_dir(&root)?;
            if r.include.is_some() || r.exclude.is_some() || r.gitignore == Some(true) {
                return Err(Refusal::bad(
                    ErrorCode::WorkspaceInvalid,
                    format!(
                        "resource {}: sshfs serves the whole directory; include/exclude/\
                         gitignore cannot hide files from it",
                        r.name
                    ),
                    "Drop the filters, or use the awcpfs or archive transport, which apply them",
                ));
            }
            // Sensitive files cannot be hidden either: refused unless allowed.
            let filter = self.resource_filter(r, &root);
            let root2 = root.clone();
            let scan = tokio::task::spawn_blocking(move || crate::archive::scan(&root2, &filter))
                .await
                .map_err(|e| Refusal::internal(format!("scanning panicked: {e}")))?
                .map_err(|e| {
                    Refusal::bad(
                        ErrorCode::WorkspaceInvalid,
                        format!("cannot read resource {}: {e}", r.name),
                        "Check that every resource is a readable directory",
                    )
                })?;
            if !scan.sensitive.is_empty() {
                let files: Vec<String> = scan
                    .sensitive
                    .iter()
                    .map(|f| format!("{}/{f}", r.name))
                    .collect();
                let mut refusal = super::admission::sensitive(&files, &self.cfg.sensitive);
                refusal.hint = Some(format!(
                    "{} (sshfs cannot hide files: only --allow-sensitive, or another transport, \
                     delegates this directory)",
                    refusal.hint.unwrap_or_default()
                ));
                return Err(refusal);
            }
            resources.push((r.name.clone(), root, r.mode == AccessMode::Rw));
        }
        let source = resources[0].1.clone();
        let user = login_user(&cfg, &source).map_err(|e| {
            refuse(
                e,
                "Name the user sshd logs the Executor in as: awcp-ctl serve --sshfs-user NAME",
            )
        })?;
        if !plain_user(&user) {
            return Err(refuse(
                format!("`{user}` is not a user name sshd can be configured with"),
                "Name a plain user: awcp-ctl serve --sshfs-user NAME",
            ));
        }
        let access = req.access_mode.unwrap_or(AccessMode::Rw);
        let read_only = access == AccessMode::Ro || resources.iter().all(|r| !r.2);
        let access = if read_only {
            AccessMode::Ro
        } else {
            AccessMode::Rw
        };
        let ttl_s = req.ttl_seconds.unwrap_or(3600).max(1);
        let ttl = Duration::from_secs(ttl_s).min(self.cfg.max_ttl);
        let id = DelegationId::from_random_bytes(rand::random());
        let lease = Arc::new(Lease::grant(
            Arc::new(SystemClock::new()),
            LeaseTerms {
                ttl,
                max_ttl: self.cfg.max_ttl,
                flush_grace: self.cfg.flush_grace,
            },
        ));
        lease.limit_renewals(self.cfg.max_lease);
        let plan = Plan {
            id: id.as_str().to_string(),
            keys: self.cfg.state_dir.join("sshfs"),
            state: self.cfg.state_dir.join("sshfs").join(id.as_str()),
            dir: cfg.chroot_base.join(id.as_str()),
            sshd,
            listen: cfg.listen,
            user: user.clone(),
            ttl,
            read_only,
            resources,
        };
        let (server, port, credential, host_key) =
            tokio::task::spawn_blocking(move || start_server(&plan))
                .await
                .map_err(|e| Refusal::internal(format!("starting sshd panicked: {e}")))?
                .map_err(|e| {
                    refuse(
                        format!("cannot serve the workspace over sshfs: {e}"),
                        "See docs/TROUBLESHOOTING.md (sshfs); `awcp-ctl doctor` checks sshd",
                    )
                })?;
        self.sshfs
            .map
            .lock()
            .insert(id.as_str().to_string(), server);
        let handle = SshfsHandle {
            endpoint: SshEndpoint {
                host: cfg.host.clone().unwrap_or_else(|| cfg.listen.to_string()),
                port,
                user,
            },
            export_locator: "/".into(),
            credential,
            options: None,
            host_key: Some(host_key),
        };
        self.launch(
            req,
            NewDelegation {
                id,
                access,
                ttl,
                lease,
                token: String::new(),
                source,
                read_only,
                exports: Vec::new(),
                progress,
            },
            Handle::Sshfs(handle),
        )
        .await
    }

    /// The delegation is over: stop its sshd (if it has one).
    pub(crate) fn sshfs_release(&self, live: &Live) {
        let id = live.d.lock().record.id.as_str().to_string();
        let Some(server) = self.sshfs.map.lock().remove(&id) else {
            return;
        };
        let state = self.cfg.state_dir.join("sshfs").join(&id);
        let mut stopping = self.sshfs.stopping.lock();
        stopping.retain(|t| !t.is_finished());
        stopping.push(std::thread::spawn(move || {
            server.stop(&id);
            let _ = std::fs::remove_file(state.join("sshd_config"));
            let _ = std::fs::remove_file(state.join("sshd.log"));
            let _ = std::fs::remove_dir(&state);
        }));
    }

    /// The daemon stops: every sshd with it (blocking).
    pub(crate) fn sshfs_stop_all(&self) {
        let servers: Vec<(String, Server)> = self.sshfs.map.lock().drain().collect();
        for (id, server) in servers {
            server.stop(&id);
        }
        let stopping: Vec<_> = self.sshfs.stopping.lock().drain(..).collect();
        for t in stopping {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descendants_follow_the_parent_chain() {
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait"])
            .spawn()
            .unwrap();
        let start = Instant::now();
        let mut below = Vec::new();
        while below.len() < 2 && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
            below = descendants(child.id() as i32);
        }
        assert_eq!(below.len(), 2, "two sleeps below the shell: {below:?}");
        kill_tree(&mut child);
        for p in below {
            assert!(
                !Path::new(&format!("/proc/{p}")).exists()
                    || std::fs::read_to_string(format!("/proc/{p}/stat"))
                        .is_ok_and(|s| s.contains(") Z ")),
                "process {p} survived kill_tree"
            );
        }
    }

    #[test]
    fn a_missing_privsep_dir_is_named_from_sshds_error_and_made() {
        let err = "\"/usr/sbin/sshd\" failed (exit status: 255): \
                   Missing privilege separation directory: /run/sshd";
        assert_eq!(missing_privsep_dir(err), Some(PathBuf::from("/run/sshd")));
        assert_eq!(
            missing_privsep_dir("Missing privilege separation directory: /var/empty\nmore"),
            Some(PathBuf::from("/var/empty"))
        );
        // Anything else is sshd's own complaint, not ours to fix.
        assert_eq!(missing_privsep_dir("Bad configuration option: Foo"), None);
        assert_eq!(
            missing_privsep_dir("Missing privilege separation directory: run/sshd"),
            None
        );
        assert_eq!(
            missing_privsep_dir("Missing privilege separation directory: /run/../etc"),
            None
        );

        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run/sshd");
        make_privsep_dir(&dir).unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.permissions().mode() & 0o022, 0, "writable by others");
        make_privsep_dir(&dir).unwrap();
    }

    #[test]
    fn chroot_path_rule_is_sshds() {
        assert!(check_chroot_path(Path::new("/usr")).is_ok());
        let tmp = tempfile::tempdir().unwrap();
        // /tmp is world-writable: no chroot below it.
        let err = check_chroot_path(tmp.path()).unwrap_err();
        assert!(err.contains("writable by others"), "{err}");
    }

    /// Whether `sftp` logs in with `key` + `cert` and lists `name` at the root.
    fn sftp_lists(port: u16, user: &str, dir: &Path, cred: &SshCredential, name: &str) -> bool {
        let key = dir.join("k");
        let _ = std::fs::remove_file(&key);
        awcpfs::private::write(&key, cred.private_key.as_bytes()).unwrap();
        std::fs::write(dir.join("k-cert.pub"), format!("{}\n", cred.certificate)).unwrap();
        let out = Command::new("sftp")
            .args(["-b", "-", "-P", &port.to_string()])
            .arg("-o")
            .arg(format!("IdentityFile={}", key.display()))
            .arg("-o")
            .arg(format!(
                "CertificateFile={}",
                dir.join("k-cert.pub").display()
            ))
            .args([
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "BatchMode=yes",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
            ])
            .arg(format!("{user}@127.0.0.1"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write as _;
                c.stdin.take().unwrap().write_all(b"ls /\n")?;
                c.wait_with_output()
            })
            .unwrap();
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains(name)
    }

    /// A real sshd: the delegation's certificate logs in (and sees only its resources),
    /// the same certificate once expired does not, nor one of the same CA issued for
    /// another delegation's principal; stopping it detaches the bind and leaves the
    /// workspace whole.
    #[test]
    fn the_delegations_sshd_takes_its_certificate_only_while_valid() {
        let Some(sshd) = sshd_binary(&SshfsConfig::default()) else {
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "sshd is missing under CI (.ci/run installs openssh-server)"
            );
            eprintln!("SKIPPED: sshd is not installed (apt-get install openssh-server)");
            return;
        };
        if !nix::unistd::geteuid().is_root() {
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "CI runs as root"
            );
            eprintln!("SKIPPED: the sshfs server needs root (chroot, bind mounts)");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        std::fs::write(ws.join("a.txt"), "kept\n").unwrap();
        let id = format!("dlg_{}", hex::encode(rand::random::<[u8; 16]>()));
        let plan = |id: &str, ttl: u64| Plan {
            id: id.to_string(),
            keys: tmp.path().join("state/sshfs"),
            state: tmp.path().join("state/sshfs").join(id),
            dir: PathBuf::from("/run/awcp-sshfs").join(id),
            sshd: sshd.clone(),
            listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
            user: "root".into(),
            ttl: Duration::from_secs(ttl),
            read_only: false,
            resources: vec![("workspace".into(), ws.clone(), true)],
        };
        let (server, port, cred, host_key) = start_server(&plan(&id, 3)).unwrap();
        assert!(host_key.starts_with("ssh-ed25519 "), "{host_key}");
        assert!(
            sftp_lists(port, "root", tmp.path(), &cred, "workspace"),
            "the delegation's own certificate must log in"
        );
        // Another delegation of the same daemon (same CA): its certificate names its own
        // principal, which this sshd does not accept.
        let other = format!("dlg_{}", hex::encode(rand::random::<[u8; 16]>()));
        let (server2, port2, cred2, _) = start_server(&plan(&other, 60)).unwrap();
        assert!(sftp_lists(port2, "root", tmp.path(), &cred2, "workspace"));
        assert!(
            !sftp_lists(port, "root", tmp.path(), &cred2, "workspace"),
            "another delegation's certificate must be refused"
        );
        server2.stop(&other);
        // Past its validity (the lease, 3 s), the certificate is refused by the live sshd.
        std::thread::sleep(Duration::from_secs(5));
        assert!(
            !sftp_lists(port, "root", tmp.path(), &cred, "workspace"),
            "an expired certificate must be refused"
        );
        let log = std::fs::read_to_string(plan(&id, 3).state.join("sshd.log")).unwrap();
        assert!(log.contains("expired"), "sshd says why: {log}");
        let root = plan(&id, 3).dir;
        server.stop(&id);
        assert!(!root.exists(), "the chroot is removed");
        assert_eq!(std::fs::read_to_string(ws.join("a.txt")).unwrap(), "kept\n");
    }

    /// A daemon that died left an sshd running: the next start ends it and its chroot.
    #[test]
    fn leftovers_of_a_dead_daemon_are_swept() {
        let Some(sshd) = sshd_binary(&SshfsConfig::default()) else {
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "sshd is missing under CI"
            );
            eprintln!("SKIPPED: sshd is not installed (apt-get install openssh-server)");
            return;
        };
        if !nix::unistd::geteuid().is_root() {
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "CI runs as root"
            );
            eprintln!("SKIPPED: the sshfs server needs root (chroot, bind mounts)");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        std::fs::write(ws.join("a.txt"), "kept\n").unwrap();
        let id = format!("dlg_{}", hex::encode(rand::random::<[u8; 16]>()));
        let base = PathBuf::from("/run/awcp-sshfs");
        let state = tmp.path().join("state");
        let plan = Plan {
            id: id.clone(),
            keys: state.join("sshfs"),
            state: state.join("sshfs").join(&id),
            dir: base.join(&id),
            sshd: sshd.clone(),
            listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
            user: "root".into(),
            ttl: Duration::from_secs(60),
            read_only: true,
            resources: vec![("workspace".into(), ws.clone(), true)],
        };
        let (server, _port, _cred, _) = start_server(&plan).unwrap();
        let pid = server.child.as_ref().unwrap().id() as i32;
        // The daemon "dies": nothing stops this server.
        std::mem::forget(server);
        assert!(base.join(&id).join("root/workspace/a.txt").exists());
        sweep_leftovers(&state, &base);
        // The signal is sent; on a loaded machine the process takes a moment to go (a
        // zombie, never reaped here, counts as gone).
        let alive = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while alive() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!alive(), "the leftover sshd survived the sweep");
        assert!(
            !base.join(&id).exists(),
            "the leftover chroot survived the sweep"
        );
        assert!(!plan.state.exists());
        assert_eq!(std::fs::read_to_string(ws.join("a.txt")).unwrap(), "kept\n");
    }

    #[test]
    fn user_names_are_plain() {
        assert!(plain_user("alice"));
        assert!(plain_user("svc-awcp.1"));
        for bad in ["", "-oFoo", "a b", "a\nAllowUsers *", "a,b"] {
            assert!(!plain_user(bad), "{bad:?}");
        }
    }
}
