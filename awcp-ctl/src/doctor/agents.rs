//! `doctor`'s checks of how an Executor on this machine confines its agents: the kernel's
//! Landlock ABI, the agents' user, and any running `awcp-ctl executor` started with an
//! unsafe agent flag.

use super::{Check, Status, check};
use crate::executor::{DEFAULT_AGENT_USER, sandbox};

/// The flags that take an agent's confinement away.
const UNSAFE_FLAGS: &[&str] = &["--unsafe-agent-as-root", "--unsafe-agent-unconfined"];

/// The agent checks; `processes` are the machine's (pid, argv) (see [`processes`]).
pub fn agent_sandbox(processes: &[(u32, Vec<String>)]) -> Vec<Check> {
    let mut out = Vec::new();
    let abi = sandbox::kernel_abi();
    out.push(match abi {
        0 => check(
            "agent sandbox",
            Status::Fail,
            "this kernel has no Landlock: an Executor refuses to start (agents could read \
             and write whatever their user can)"
                .into(),
            Some(
                "boot Linux 5.13+ with `landlock` in lsm=, or accept unconfined agents with \
                 `executor --unsafe-agent-unconfined`",
            ),
        ),
        a if a < sandbox::ABI_NET => check(
            "agent sandbox",
            Status::Warn,
            format!(
                "Landlock ABI {a}: agents write only in their workspace, but without TCP \
                 rules a no-network delegation needs an Executor running as root (network \
                 namespace)"
            ),
            Some("run the Executor as root, or boot Linux 6.7+"),
        ),
        a => check(
            "agent sandbox",
            Status::Ok,
            format!(
                "Landlock ABI {a}: agents write only in their workspace and TMPDIR, read only \
                 system paths, and get no network when asked"
            ),
            None,
        ),
    });
    out.push(agent_user());
    for (pid, argv) in processes {
        let flags: Vec<&str> = argv
            .iter()
            .map(String::as_str)
            .filter(|a| UNSAFE_FLAGS.contains(a))
            .collect();
        if is_executor(argv) && !flags.is_empty() {
            out.push(check(
                "executor agents",
                Status::Warn,
                format!(
                    "the Executor (pid {pid}) runs with {}: whoever delegates to it runs code \
                     {}",
                    flags.join(" "),
                    if flags.contains(&"--unsafe-agent-as-root") {
                        "as root"
                    } else {
                        "outside any sandbox"
                    }
                ),
                Some("restart it without the --unsafe-agent-… flags"),
            ));
        }
    }
    out
}

/// Who agents run as.
fn agent_user() -> Check {
    if !nix::unistd::geteuid().is_root() {
        return check(
            "agent user",
            Status::Ok,
            format!(
                "an Executor started by this user (uid {}) runs agents as itself, confined",
                nix::unistd::geteuid()
            ),
            None,
        );
    }
    match nix::unistd::User::from_name(DEFAULT_AGENT_USER) {
        Ok(Some(u)) => check(
            "agent user",
            Status::Ok,
            format!(
                "agents run as {DEFAULT_AGENT_USER} (uid {}) unless --agent-user names another",
                u.uid
            ),
            None,
        ),
        _ if std::path::Path::new("/usr/sbin/useradd").exists()
            || std::path::Path::new("/sbin/useradd").exists() =>
        {
            check(
                "agent user",
                Status::Ok,
                format!(
                    "{DEFAULT_AGENT_USER} does not exist yet: the Executor creates it at its \
                     first start (useradd --system)"
                ),
                None,
            )
        }
        _ => check(
            "agent user",
            Status::Fail,
            format!("{DEFAULT_AGENT_USER} does not exist and there is no useradd to create it"),
            Some("create it (`useradd --system --user-group awcp-agent`) or use --agent-user"),
        ),
    }
}

/// Whether `argv` is an `awcp-ctl executor` process.
fn is_executor(argv: &[String]) -> bool {
    argv.first().is_some_and(|a| a.ends_with("awcp-ctl")) && argv.iter().any(|a| a == "executor")
}

/// The machine's processes as (pid, argv), from `/proc` (those this user may read).
pub fn processes() -> Vec<(u32, Vec<String>)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let raw = std::fs::read(e.path().join("cmdline")).ok()?;
            let argv = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            Some((pid, argv))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split(' ').map(str::to_owned).collect()
    }

    #[test]
    fn an_executor_with_an_unsafe_agent_flag_is_reported() {
        let procs = vec![
            (
                10,
                argv("/usr/bin/awcp-ctl executor --agent-cmd x --unsafe-agent-as-root"),
            ),
            (11, argv("/usr/bin/awcp-ctl executor --agent-cmd x")),
            (12, argv("/bin/sh -c --unsafe-agent-as-root")),
        ];
        let warned: Vec<String> = agent_sandbox(&procs)
            .into_iter()
            .filter(|c| c.check == "executor agents")
            .map(|c| c.detail)
            .collect();
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(warned[0].contains("pid 10") && warned[0].contains("as root"));
    }
}
