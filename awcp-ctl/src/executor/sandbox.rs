//! Confining the agent with the kernel's own mechanisms.
//!
//! Every agent command (and everything it starts) runs:
//! * as an unprivileged user: `executor --agent-user` (default `awcp-agent`, a system user
//!   the Executor creates on its first start as root), or the Executor's own user when the
//!   Executor is not root; root only with `--unsafe-agent-as-root`;
//! * under a Landlock domain ([`Policy`]): it may write only in its workspace and its own
//!   per-delegation directory (its `TMPDIR` and `HOME`), and read only the system's paths
//!   ([`SYSTEM_READ`]), the few devices every tool opens ([`DEVICES_RW`]) and what the
//!   operator added (`--agent-allow-read`, `--agent-allow-write`). Other delegations'
//!   workspaces, the Executor's state directory, its tokens, its block cache, `/root`,
//!   `/home` and `/tmp` answer `EACCES`. The domain also scopes signals and abstract Unix
//!   sockets to the agent's own processes, and Landlock keeps it from tracing any process
//!   outside its domain;
//! * with no network when the Delegator asks for none (INVITE's `requirements.sandboxProfile
//!   .allowNetwork: false`) or the operator forces it (`--agent-no-network`): a new network
//!   namespace (only a down loopback) where the Executor is root, and Landlock's TCP rules
//!   (no `connect`/`bind` at all: `EACCES`) on every kernel that has them.
//!
//! The ruleset is built in the Executor (opening the paths it names); the child only
//! switches namespace and user and enforces the ready ruleset between `fork` and `exec`.

use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access as _, AccessFs, AccessNet, CompatLevel, Compatible as _, Ruleset, RulesetAttr as _,
    RulesetCreated, RulesetCreatedAttr as _, Scope, path_beneath_rules,
};

/// The Landlock ABI this code asks for (the rights it names exist from this version on;
/// older kernels enforce what they know, see [`kernel_abi`]).
const ABI_WANTED: ABI = ABI::V6;

/// First ABI with TCP rules (`LANDLOCK_ACCESS_NET_*`, Linux 6.7).
pub const ABI_NET: i32 = 4;

/// System paths every agent may read and execute (those that exist).
pub const SYSTEM_READ: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/opt",
    "/proc",
    "/sys",
    "/dev",
    // /etc/resolv.conf is often a link into it.
    "/run/systemd/resolve",
];

/// Devices every agent may read and write (terminals, the null and random devices).
pub const DEVICES_RW: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
];

/// The Landlock ABI the running kernel offers (`0`: none, Landlock is not built in or not
/// enabled at boot).
pub fn kernel_abi() -> i32 {
    // landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    const VERSION: libc::c_uint = 1;
    #[allow(unsafe_code)]
    // SAFETY: with a NULL attribute pointer, size 0 and the VERSION flag the system call
    // reads no memory and only returns the ABI version (or -1 with errno).
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            VERSION,
        )
    };
    i32::try_from(v.max(0)).unwrap_or(0)
}

/// What one agent may touch.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// Read and execute below these (besides [`SYSTEM_READ`]).
    pub read: Vec<PathBuf>,
    /// Read, write, create, remove and execute below these (its workspace, its own
    /// directory, and what the operator added).
    pub write: Vec<PathBuf>,
    /// No TCP `connect`/`bind` (Landlock's network rules).
    pub no_network: bool,
}

/// Why a sandbox could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The Landlock ruleset could not be built.
    #[error("building the agent's Landlock ruleset")]
    Ruleset(#[source] landlock::RulesetError),
}

/// The ruleset of `policy`, ready to be enforced in the child.
pub fn ruleset(policy: &Policy) -> Result<RulesetCreated, SandboxError> {
    let abi = ABI_WANTED;
    let build = || -> Result<RulesetCreated, landlock::RulesetError> {
        let mut rs = Ruleset::default()
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(AccessFs::from_all(abi))?
            .scope(Scope::from_all(abi))?;
        if policy.no_network {
            rs = rs.handle_access(AccessNet::from_all(abi))?;
        }
        let existing = |paths: Vec<&Path>| -> Vec<PathBuf> {
            paths
                .into_iter()
                .filter(|p| p.exists())
                .map(Path::to_path_buf)
                .collect()
        };
        let read = existing(
            SYSTEM_READ
                .iter()
                .map(Path::new)
                .chain(policy.read.iter().map(PathBuf::as_path))
                .collect(),
        );
        let write = existing(
            DEVICES_RW
                .iter()
                .map(Path::new)
                .chain(policy.write.iter().map(PathBuf::as_path))
                .collect(),
        );
        rs.create()?
            .add_rules(path_beneath_rules(read, AccessFs::from_read(abi)))?
            .add_rules(path_beneath_rules(write, AccessFs::from_all(abi)))
    };
    build().map_err(SandboxError::Ruleset)
}

/// How the child confines itself before `exec`.
#[derive(Debug, Default)]
pub struct Confinement {
    /// A new network namespace (needs root: the Executor's user is root here).
    pub new_netns: bool,
    /// Switch to this (uid, gid), dropping supplementary groups.
    pub user: Option<(u32, u32)>,
    /// Enforce this ruleset (`None`: `--unsafe-agent-unconfined`).
    pub ruleset: Option<RulesetCreated>,
}

/// The one place with `unsafe` here: the code that runs between `fork` and `exec`.
///
/// Order: the network namespace first (it needs root), then the user (groups, gid, uid),
/// then Landlock (which also sets `no_new_privs`, so no setuid program gives rights back).
#[allow(unsafe_code)]
pub fn confine(cmd: &mut tokio::process::Command, c: Confinement) {
    let Confinement {
        new_netns,
        user,
        mut ruleset,
    } = c;
    // SAFETY: the closure runs in the forked child before exec and only makes system
    // calls (prctl, unshare, setgroups, setgid, setuid, landlock_restrict_self) on values
    // prepared in the parent; it takes no locks. It allocates only to build an error
    // value when a call fails, after which the child exits.
    unsafe {
        cmd.pre_exec(move || {
            // The Executor's allocator turns transparent huge pages off for its own process,
            // which a child inherits across exec: the agent's tools get the machine's setting.
            nix::sys::prctl::set_thp_disable(false)?;
            if new_netns {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
            }
            if let Some((uid, gid)) = user {
                nix::unistd::setgroups(&[nix::unistd::Gid::from_raw(gid)])?;
                nix::unistd::setgid(nix::unistd::Gid::from_raw(gid))?;
                nix::unistd::setuid(nix::unistd::Uid::from_raw(uid))?;
            }
            if let Some(rs) = ruleset.take() {
                rs.restrict_self().map_err(std::io::Error::other)?;
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_paths_are_absolute_and_devices_are_under_dev() {
        assert!(SYSTEM_READ.iter().all(|p| p.starts_with('/')));
        assert!(DEVICES_RW.iter().all(|p| p.starts_with("/dev/")));
    }

    #[test]
    fn a_ruleset_builds_on_this_kernel() {
        if kernel_abi() == 0 {
            eprintln!("!!!!!!!! no Landlock in this kernel: ruleset not built !!!!!!!!");
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "CI's kernel must have Landlock"
            );
            return;
        }
        let p = Policy {
            read: vec![PathBuf::from("/does/not/exist")],
            write: vec![std::env::temp_dir()],
            no_network: true,
        };
        ruleset(&p).expect("ruleset");
    }
}
