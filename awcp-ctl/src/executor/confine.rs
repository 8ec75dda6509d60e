//! Who the agent runs as, where it may write, and how it is confined (see
//! [`super::sandbox`] for the kernel side and docs/SECURITY.md for the threat model).
//!
//! * At start ([`choose_agent`]): an Executor running as root runs agents as
//!   `--agent-user`, by default [`DEFAULT_AGENT_USER`] (a system user created here when
//!   missing), never as root unless `--unsafe-agent-as-root`; an Executor not running as
//!   root runs them as itself. A kernel without Landlock stops the start unless
//!   `--unsafe-agent-unconfined`.
//! * The layout ([`prepare_dirs`]): `state/` and `cache/` stay 0700 root's; `work/` (the
//!   mounts) and `agents/` (each agent's `TMPDIR`, `HOME` and AECP socket) are the agent
//!   user's, 0700; the base directory lets that user pass (0711) without listing it.
//! * Per agent ([`apply`]): its own directory, a scrubbed environment, the user switch, a
//!   network namespace when it must have no network, and its Landlock domain.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::sandbox::{self, Confinement, Policy};
use super::{AgentUser, Assignment, Executor, ExecutorConfig};

/// The user an Executor running as root runs its agents as by default.
pub const DEFAULT_AGENT_USER: &str = "awcp-agent";

/// The Executor's base directory when it runs as root and `--dir` is not given: not under
/// root's 0700 home, which the agent's user could not pass.
pub const ROOT_DEFAULT_DIR: &str = "/var/lib/awcp/executor";

/// The agent's `TMPDIR`, below its own directory.
const TMP: &str = "tmp";
/// The agent's `HOME`, below its own directory.
const HOME: &str = "home";
/// The worker's AECP socket, in the agent's own directory (the mount's state directory,
/// where the socket used to be, is closed to the agent).
const AECP_SOCKET: &str = "aecp.sock";

impl AgentUser {
    /// [`AgentUser::lookup`], creating [`DEFAULT_AGENT_USER`] when that is the name asked
    /// for and it does not exist yet.
    pub fn lookup_or_create(name: &str) -> anyhow::Result<AgentUser> {
        if name == DEFAULT_AGENT_USER {
            ensure_default_user()
        } else {
            AgentUser::lookup(name)
        }
    }
}

/// [`DEFAULT_AGENT_USER`], created with `useradd --system` if missing (no home, no login
/// shell, a group of its own). Several Executors starting at once may race: one creates
/// it, the others find it.
pub fn ensure_default_user() -> anyhow::Result<AgentUser> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if nix::unistd::User::from_name(DEFAULT_AGENT_USER)?.is_some() {
            return AgentUser::lookup(DEFAULT_AGENT_USER);
        }
        let out = std::process::Command::new("useradd")
            .args([
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                "--comment",
                "awcp-ctl executor agents",
                DEFAULT_AGENT_USER,
            ])
            .output()
            .with_context(|| {
                format!(
                    "creating the agents' user {DEFAULT_AGENT_USER} with `useradd` (install \
                     the `passwd` package, or name an existing user with --agent-user)"
                )
            })?;
        if out.status.success() {
            tracing::info!(
                user = DEFAULT_AGENT_USER,
                "created the system user agents run as"
            );
            continue;
        }
        // Another Executor starting at once may have made it (9) or hold the lock on
        // /etc/passwd (1, 10): look again, until the deadline.
        if std::time::Instant::now() > deadline {
            anyhow::bail!(
                "creating the agents' user {DEFAULT_AGENT_USER} failed ({}): {}; create it \
                 (`useradd --system --user-group {DEFAULT_AGENT_USER}`) or name another with \
                 --agent-user",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Decide who the agents run as and whether they can be confined; warn about every unsafe
/// choice.
pub(super) fn choose_agent(cfg: &mut ExecutorConfig) -> anyhow::Result<()> {
    let root = nix::unistd::geteuid().is_root();
    if cfg.unsafe_agent_as_root {
        anyhow::ensure!(
            cfg.agent_user.is_none(),
            "--unsafe-agent-as-root and --agent-user contradict each other: choose one"
        );
        if root {
            tracing::warn!(
                "--unsafe-agent-as-root: agents run as root; whoever can delegate to this \
                 Executor runs code as root on this machine"
            );
        }
    } else if cfg.agent_user.is_none() && root {
        cfg.agent_user = Some(ensure_default_user()?);
    }
    let abi = sandbox::kernel_abi();
    if cfg.unsafe_agent_unconfined {
        tracing::warn!(
            landlock_abi = abi,
            "--unsafe-agent-unconfined: agents run without Landlock; they can read and \
             write whatever their user can, other delegations' workspaces included"
        );
    } else if abi == 0 {
        anyhow::bail!(
            "this kernel has no Landlock (needs Linux 5.13 or later, with `landlock` in the \
             boot's lsm= list): the Executor cannot confine its agents to their workspace. \
             Boot a kernel with Landlock, or accept unconfined agents with \
             --unsafe-agent-unconfined"
        );
    }
    if cfg.agent_no_network && !can_isolate_network(cfg) {
        anyhow::bail!(
            "--agent-no-network needs a network namespace (the Executor must run as root) \
             or Landlock's network rules (ABI {} or later; this kernel has {abi}, and \
             --unsafe-agent-unconfined turns Landlock off)",
            sandbox::ABI_NET
        );
    }
    Ok(())
}

/// Whether this Executor can run an agent with no network.
pub(super) fn can_isolate_network(cfg: &ExecutorConfig) -> bool {
    nix::unistd::geteuid().is_root()
        || (!cfg.unsafe_agent_unconfined && sandbox::kernel_abi() >= sandbox::ABI_NET)
}

/// Create the Executor's directories (see the module doc for who owns what).
pub(super) fn prepare_dirs(cfg: &ExecutorConfig) -> anyhow::Result<()> {
    // The directories this start creates (the base and whatever led to it), which it may
    // open for the agent's user to pass; existing ones are the operator's to decide.
    let created: Vec<PathBuf> = [&cfg.work_dir, &cfg.agents_dir]
        .iter()
        .flat_map(|d| d.ancestors().skip(1))
        .filter(|d| !d.exists())
        .map(Path::to_path_buf)
        .collect();
    for dir in [&cfg.work_dir, &cfg.state_dir, &cfg.agents_dir] {
        awcpfs::private::create_dir_all(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    let Some(u) = &cfg.agent_user else {
        return Ok(());
    };
    for dir in [&cfg.work_dir, &cfg.agents_dir] {
        give(dir, u).with_context(|| {
            format!(
                "giving {} to the agents' user {} (the Executor must run as root for it)",
                dir.display(),
                u.name
            )
        })?;
        // The base directory (0700 when made here) lets it pass through, without
        // listing: 0711. state/ and cache/ beside stay 0700.
        let mut opened: Vec<PathBuf> = Vec::new();
        while let Some(b) = u.blocked_at(dir).filter(|b| {
            !opened.contains(b) && (created.contains(b) || Some(b.as_path()) == dir.parent())
        }) {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&b)?.permissions().mode() & 0o7777;
            std::fs::set_permissions(&b, std::fs::Permissions::from_mode(mode | 0o011))
                .with_context(|| format!("letting the agents' user through {}", b.display()))?;
            opened.push(b);
        }
        if let Some(b) = u.blocked_at(dir) {
            anyhow::bail!(
                "the agents' user {} cannot pass through {} to {}: its agents could not \
                 start. Use a --dir it can reach (the default for root is {ROOT_DEFAULT_DIR}), \
                 or let it through (`chmod o+x {}`)",
                u.name,
                b.display(),
                dir.display(),
                b.display()
            );
        }
    }
    Ok(())
}

fn give(path: &Path, u: &AgentUser) -> std::io::Result<()> {
    std::os::unix::fs::chown(path, Some(u.uid), Some(u.gid))
}

/// The agent's own directory for delegation `id`.
pub(super) fn agent_dir(ex: &Executor, id: &str) -> PathBuf {
    ex.cfg.agents_dir.join(id)
}

/// Where the worker's AECP socket is bound and what `AECP_SOCKET` names.
pub(super) fn aecp_socket(ex: &Executor, id: &str) -> PathBuf {
    agent_dir(ex, id).join(AECP_SOCKET)
}

/// Where the AECP socket of resource `name` of a several-resource delegation is bound
/// (every resource but the first: the first's is [`aecp_socket`]).
pub(super) fn aecp_resource_socket(ex: &Executor, id: &str, name: &str) -> PathBuf {
    agent_dir(ex, id).join(format!("aecp-{name}.sock"))
}

/// Create the agent's own directory (and its `TMPDIR` and `HOME`), the agent user's, 0700.
pub(super) fn prepare_agent_dir(ex: &Executor, id: &str) -> std::io::Result<PathBuf> {
    let dir = agent_dir(ex, id);
    for d in [dir.clone(), dir.join(TMP), dir.join(HOME)] {
        awcpfs::private::create_dir_all(&d)?;
        if let Some(u) = &ex.cfg.agent_user {
            give(&d, u)?;
        }
    }
    Ok(dir)
}

/// The secret of worker `id`'s AECP socket (`$AECP_TOKEN`, and the mount's
/// `aecp_token`): agents of one user can connect to each other's sockets (Landlock does
/// not govern connecting to a named socket), and a request on it acts as that worker, so
/// each request carries this. A keyed hash of the delegation id under a key drawn at this
/// process's start: an agent and its mount always come from the same process.
pub(super) fn aecp_token(id: &str) -> String {
    static KEY: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    let key = KEY.get_or_init(rand::random);
    blake3::keyed_hash(key, id.as_bytes()).to_hex().to_string()
}

/// Remove the agent's own directory (its temporary files die with the delegation).
pub(super) fn remove_agent_dir(ex: &Executor, id: &str) {
    let dir = agent_dir(ex, id);
    if let Err(e) = std::fs::remove_dir_all(&dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the agent's directory");
    }
}

/// Whether the agent of `a` runs with no network.
pub(super) fn no_network(ex: &Executor, a: &Assignment) -> bool {
    ex.cfg.agent_no_network
        || a.invite
            .requirements
            .as_ref()
            .is_some_and(|r| r.no_network())
}

/// Environment variables the agent does not inherit from the Executor: its own settings
/// (tokens among them) and anything named like a secret.
fn is_private_env(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    upper.starts_with("AWCP_")
        || upper == "SSH_AUTH_SOCK"
        || [
            "TOKEN",
            "SECRET",
            "PASSWORD",
            "PASSWD",
            "CREDENTIAL",
            "API_KEY",
        ]
        .iter()
        .any(|s| upper.contains(s))
}

/// Set the agent command up to run confined in `cwd` (its workspace): its user, its
/// directory as `TMPDIR` and `HOME`, a scrubbed environment, and its sandbox.
pub(super) fn apply(
    ex: &Executor,
    a: &Assignment,
    cwd: &Path,
    cmd: &mut tokio::process::Command,
) -> std::io::Result<()> {
    let id = a.invite.delegation_id.as_str();
    let own = prepare_agent_dir(ex, id)?;
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_none_or(is_private_env) {
            cmd.env_remove(&name);
        }
    }
    cmd.env("TMPDIR", own.join(TMP)).env("HOME", own.join(HOME));
    if let Some(u) = &ex.cfg.agent_user {
        cmd.env("USER", &u.name).env("LOGNAME", &u.name);
    }
    let no_net = no_network(ex, a);
    let root = nix::unistd::geteuid().is_root();
    if no_net && !can_isolate_network(&ex.cfg) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "the delegation asks for no network, and this Executor can isolate none \
             (it is not root, and Landlock's network rules are missing or turned off)",
        ));
    }
    let ruleset = if ex.cfg.unsafe_agent_unconfined {
        None
    } else {
        let mut write = vec![cwd.to_path_buf(), a.work_path.clone(), own];
        write.extend(ex.cfg.agent_allow_write.iter().cloned());
        let mut read = ex.cfg.agent_allow_read.clone();
        if ex.cfg.git_fsmonitor {
            // git runs the fsmonitor hook (this binary, or the configured one) as the agent.
            read.extend(super::fsmonitor::hook_binary(
                ex.cfg.fsmonitor_hook.as_deref(),
            ));
        }
        let policy = Policy {
            read,
            write,
            no_network: no_net,
        };
        Some(sandbox::ruleset(&policy).map_err(std::io::Error::other)?)
    };
    sandbox::confine(
        cmd,
        Confinement {
            new_netns: no_net && root,
            user: ex.cfg.agent_user.as_ref().map(|u| (u.uid, u.gid)),
            ruleset,
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_and_our_settings_stay_out_of_the_agents_environment() {
        for name in [
            "AWCP_EXECUTOR_TOKEN",
            "AWCP_API_TOKEN",
            "GITHUB_TOKEN",
            "aws_secret_access_key",
            "OPENAI_API_KEY",
            "SSH_AUTH_SOCK",
            "PGPASSWORD",
        ] {
            assert!(is_private_env(name), "{name} would reach the agent");
        }
        for name in ["PATH", "LANG", "TERM", "CARGO_HOME", "PYTHONPATH"] {
            assert!(
                !is_private_env(name),
                "{name} would be taken from the agent"
            );
        }
    }
}
