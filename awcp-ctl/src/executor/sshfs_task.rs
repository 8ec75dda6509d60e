//! The Executor's half of the reference's `sshfs` transport: mount the Delegator's export
//! with the system's `sshfs`, using the key and certificate START carries, and unmount it
//! when the task ends (done, error, revoke, expiry) — lazily if a file is still open —
//! never leaving a mount behind.
//!
//! The key and certificate are written 0600 in the delegation's private state directory
//! (`<state>/<id>/sshfs/`, closed to the agent) and removed with the mount. The server is
//! checked strictly against the handle's `hostKey` when the Delegator sends one (ours
//! does); otherwise its first key is pinned in that directory's own `known_hosts`, never
//! the user's. The handle's `options` are passed on only from a short list of harmless
//! sshfs options: anything else (an `ssh_command`, a `ProxyCommand`) would let a
//! Delegator run commands here, and is refused.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use awcp_protocol::ErrorCode;
use awcp_protocol::transport::SshfsHandle;

type Failure = (ErrorCode, String, Option<String>);

/// How long `sshfs` may take to connect and mount.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);

/// The handle options passed on to `sshfs -o` (values must be plain too).
const ALLOWED_OPTIONS: &[&str] = &[
    "reconnect",
    "ServerAliveInterval",
    "ServerAliveCountMax",
    "Compression",
    "compression",
    "cache",
    "cache_timeout",
    "attr_timeout",
    "entry_timeout",
    "max_conns",
    "follow_symlinks",
    "transform_symlinks",
    "kernel_cache",
    "auto_cache",
    "dir_cache",
];

/// Whether `bin` is installed (on `PATH`).
pub(crate) fn installed(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

/// Whether this machine can mount `sshfs` handles.
pub fn available() -> bool {
    installed("sshfs") && (installed("fusermount3") || installed("fusermount"))
}

/// A live mount and its credential files.
#[derive(Debug)]
pub(super) struct SshfsMount {
    mountpoint: PathBuf,
    keys: PathBuf,
}

fn invalid(msg: String) -> Failure {
    (
        ErrorCode::WorkspaceInvalid,
        msg,
        Some("The sshfs handle must name a plain host, user and path".into()),
    )
}

/// A host name, IPv4 address or bracketed IPv6 address: nothing ssh could read as an
/// option or a second argument.
fn plain_host(h: &str) -> bool {
    let bare = h
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(h);
    !bare.is_empty()
        && !bare.starts_with('-')
        && bare
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':'))
        && (bare == h || bare.contains(':'))
}

fn plain_user(u: &str) -> bool {
    !u.is_empty()
        && !u.starts_with('-')
        && u.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// The `-o` option list of a mount, or why the handle is refused.
fn options(
    h: &SshfsHandle,
    keys: &Path,
    agent: Option<(u32, u32)>,
) -> Result<Vec<String>, Failure> {
    let mut o = vec![
        format!("IdentityFile={}", keys.join("key").display()),
        format!("CertificateFile={}", keys.join("key-cert.pub").display()),
        format!("Port={}", h.endpoint.port),
        format!("UserKnownHostsFile={}", keys.join("known_hosts").display()),
        "GlobalKnownHostsFile=/dev/null".into(),
        if h.host_key.is_some() {
            "StrictHostKeyChecking=yes".into()
        } else {
            "StrictHostKeyChecking=accept-new".into()
        },
        "IdentitiesOnly=yes".into(),
        "IdentityAgent=none".into(),
        "BatchMode=yes".into(),
        "PasswordAuthentication=no".into(),
        "ConnectTimeout=15".into(),
        "ServerAliveInterval=15".into(),
        "ServerAliveCountMax=3".into(),
    ];
    if h.host_key.is_none() {
        // A reference Delegator's export root links to each resource (its `environments/`
        // directory holds symbolic links): follow them on the server, as its Executor does.
        o.push("follow_symlinks".into());
    }
    if let Some((uid, gid)) = agent {
        // The agent runs as its own user: let it in (the 0700 work directory keeps
        // everyone else out), and show it the files as its own, as they are to the server's
        // login user (git refuses a repository owned by someone else).
        o.push("allow_other".into());
        o.push(format!("uid={uid}"));
        o.push(format!("gid={gid}"));
    }
    for (k, v) in h.options.iter().flatten() {
        let plain = |s: &str| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        };
        if !ALLOWED_OPTIONS.contains(&k.as_str()) || !plain(v) {
            return Err((
                ErrorCode::WorkspaceInvalid,
                format!(
                    "the sshfs handle asks for option `{k}={v}`, which this Executor does not pass on"
                ),
                Some(format!(
                    "Options passed on: {} (plain values only)",
                    ALLOWED_OPTIONS.join(", ")
                )),
            ));
        }
        o.push(if v.is_empty() {
            k.clone()
        } else {
            format!("{k}={v}")
        });
    }
    Ok(o)
}

/// Whether `path` is mounted on.
pub(super) fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(m), Some(parent)) = (std::fs::symlink_metadata(path), path.parent()) else {
        return false;
    };
    std::fs::metadata(parent).is_ok_and(|p| p.dev() != m.dev())
}

/// Unmount `path`: `fusermount -u`, then lazily (`-uz`) if something holds it open, then
/// `umount -l`. Whether it is unmounted.
pub(super) fn unmount(path: &Path) -> bool {
    let fusermount = if installed("fusermount3") {
        "fusermount3"
    } else {
        "fusermount"
    };
    let attempts: [(&str, &[&str]); 3] = [
        (fusermount, &["-u"]),
        (fusermount, &["-uz"]),
        ("umount", &["-l"]),
    ];
    for (bin, args) in attempts {
        if !is_mount_point(path) {
            return true;
        }
        let _ = Command::new(bin)
            .args(args)
            .arg(path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    !is_mount_point(path)
}

/// Mount the handle at `mountpoint` (blocking). `keys` is the delegation's private
/// directory for the credential; `agent` the agent's user `(uid, gid)`, let in.
pub(super) fn mount(
    h: &SshfsHandle,
    mountpoint: &Path,
    keys: &Path,
    agent: Option<(u32, u32)>,
) -> Result<SshfsMount, Failure> {
    if !available() {
        return Err((
            ErrorCode::DepMissing,
            "sshfs is not installed on this Executor".into(),
            Some("Install sshfs (Debian: apt-get install sshfs)".into()),
        ));
    }
    if !plain_host(&h.endpoint.host) {
        return Err(invalid(format!(
            "endpoint.host `{}` is not a host name or address",
            h.endpoint.host
        )));
    }
    if !plain_user(&h.endpoint.user) {
        return Err(invalid(format!(
            "endpoint.user `{}` is not a plain user name",
            h.endpoint.user
        )));
    }
    if h.endpoint.port == 0 {
        return Err(invalid("endpoint.port is 0".into()));
    }
    let locator = &h.export_locator;
    if locator.is_empty() || locator.chars().any(|c| c.is_control() || c == ',') {
        return Err(invalid(format!(
            "exportLocator {locator:?} is not a plain path"
        )));
    }
    if let Some(k) = &h.host_key {
        let parts: Vec<&str> = k.split_whitespace().collect();
        if parts.len() < 2
            || k.contains('\n')
            || !parts[0].starts_with("ssh-") && !parts[0].starts_with("ecdsa-")
        {
            return Err(invalid(format!(
                "hostKey is not an OpenSSH public key: {k:?}"
            )));
        }
    }
    let cert = h.credential.certificate.trim();
    if cert.contains('\n') || !cert.contains("-cert-v01@openssh.com") {
        return Err(invalid(
            "credential.certificate is not an OpenSSH certificate".into(),
        ));
    }
    let setup = |e: std::io::Error| {
        (
            ErrorCode::WorkdirDenied,
            format!(
                "cannot write the sshfs credential in {}: {e}",
                keys.display()
            ),
            None,
        )
    };
    let _ = std::fs::remove_dir_all(keys);
    awcpfs::private::create_dir_all(keys).map_err(setup)?;
    let mut key = h.credential.private_key.clone();
    if !key.ends_with('\n') {
        key.push('\n');
    }
    awcpfs::private::write(&keys.join("key"), key.as_bytes()).map_err(setup)?;
    awcpfs::private::write(&keys.join("key-cert.pub"), format!("{cert}\n").as_bytes())
        .map_err(setup)?;
    let known = match &h.host_key {
        Some(k) => {
            let host = h
                .endpoint
                .host
                .trim_start_matches('[')
                .trim_end_matches(']');
            let key = k.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
            format!("[{host}]:{} {key}\n", h.endpoint.port)
        }
        None => String::new(),
    };
    awcpfs::private::write(&keys.join("known_hosts"), known.as_bytes()).map_err(setup)?;
    let m = SshfsMount {
        mountpoint: mountpoint.to_path_buf(),
        keys: keys.to_path_buf(),
    };
    let opts = match options(h, keys, agent) {
        Ok(o) => o,
        Err(e) => {
            m.remove_keys();
            return Err(e);
        }
    };
    let host = if h.endpoint.host.contains(':') && !h.endpoint.host.starts_with('[') {
        format!("[{}]", h.endpoint.host)
    } else {
        h.endpoint.host.clone()
    };
    let mut cmd = Command::new("sshfs");
    cmd.arg(format!("{}@{host}:{locator}", h.endpoint.user))
        .arg(mountpoint)
        .arg("-o")
        .arg(opts.join(","))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let child = cmd.spawn().map_err(|e| {
        m.remove_keys();
        (
            ErrorCode::DepMissing,
            format!("cannot run sshfs: {e}"),
            Some("Install sshfs (Debian: apt-get install sshfs)".into()),
        )
    })?;
    // sshfs daemonizes once mounted: its exit status is the mount's.
    let out = wait_with_timeout(child, MOUNT_TIMEOUT);
    let failed = |msg: String| {
        unmount(mountpoint);
        m.remove_keys();
        Err((
            ErrorCode::TransportError,
            msg,
            Some(
                "Check that the Executor reaches the Delegator's sshd (endpoint host and port) \
                 and that the lease has not ended"
                    .into(),
            ),
        ))
    };
    match out {
        Some(o) if o.status.success() => {}
        Some(o) => {
            return failed(format!(
                "sshfs could not mount {}@{host}:{locator}: {}",
                h.endpoint.user,
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        None => {
            return failed(format!(
                "sshfs did not mount {}@{host}:{locator} within {} s",
                h.endpoint.user,
                MOUNT_TIMEOUT.as_secs()
            ));
        }
    }
    if !is_mount_point(mountpoint) {
        return failed("sshfs exited but nothing is mounted".into());
    }
    Ok(m)
}

/// Wait for `child`, killing it after `limit`; its output, or `None` on timeout.
fn wait_with_timeout(
    mut child: std::process::Child,
    limit: Duration,
) -> Option<std::process::Output> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().ok(),
            Ok(None) if start.elapsed() < limit => std::thread::sleep(Duration::from_millis(25)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

impl SshfsMount {
    fn remove_keys(&self) {
        let _ = std::fs::remove_dir_all(&self.keys);
    }

    /// Unmount (lazily if need be) and remove the credential. Whether nothing is mounted
    /// any more.
    pub(super) fn finish(&self) -> bool {
        let gone = unmount(&self.mountpoint);
        if !gone {
            tracing::warn!(mountpoint = %self.mountpoint.display(), "cannot unmount the sshfs mount");
        }
        self.remove_keys();
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use awcp_protocol::transport::{SshCredential, SshEndpoint};

    fn handle() -> SshfsHandle {
        SshfsHandle {
            endpoint: SshEndpoint {
                host: "127.0.0.1".into(),
                port: 2222,
                user: "alice".into(),
            },
            export_locator: "/".into(),
            credential: SshCredential {
                private_key: "k".into(),
                certificate: "ssh-ed25519-cert-v01@openssh.com AAAA c".into(),
            },
            options: None,
            host_key: Some("ssh-ed25519 AAAA".into()),
        }
    }

    #[test]
    fn options_that_could_run_commands_are_refused() {
        for (k, v) in [
            ("ssh_command", "sh -c id"),
            ("ProxyCommand", "nc"),
            ("reconnect", "yes,ssh_command=x"),
            ("LocalCommand", "id"),
        ] {
            let mut h = handle();
            h.options = Some([(k.to_string(), v.to_string())].into());
            let err = options(&h, Path::new("/k"), None).unwrap_err();
            assert_eq!(err.0, ErrorCode::WorkspaceInvalid, "{k}={v}");
        }
        let mut h = handle();
        h.options = Some([("reconnect".to_string(), String::new())].into());
        let o = options(&h, Path::new("/k"), Some((1000, 1000))).unwrap();
        assert!(o.contains(&"reconnect".to_string()));
        assert!(o.contains(&"allow_other".to_string()));
        assert!(o.contains(&"uid=1000".to_string()));
        assert!(o.contains(&"StrictHostKeyChecking=yes".to_string()));
    }

    #[test]
    fn without_a_host_key_the_first_is_pinned_per_delegation() {
        let mut h = handle();
        h.host_key = None;
        let o = options(&h, Path::new("/k"), None).unwrap();
        assert!(o.contains(&"StrictHostKeyChecking=accept-new".to_string()));
        assert!(o.contains(&"UserKnownHostsFile=/k/known_hosts".to_string()));
        assert!(o.contains(&"follow_symlinks".to_string()));
    }

    #[test]
    fn hosts_and_users_are_plain() {
        for good in ["example.com", "127.0.0.1", "[::1]", "::1"] {
            assert!(plain_host(good), "{good}");
        }
        for bad in ["", "-oProxyCommand=x", "a b", "a@b", "[a.b]", "a/b"] {
            assert!(!plain_host(bad), "{bad}");
        }
        assert!(plain_user("alice"));
        for bad in ["", "-l", "a@b", "a b"] {
            assert!(!plain_user(bad), "{bad}");
        }
    }
}
