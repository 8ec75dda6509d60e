//! The Executor's half of the reference's `git` transport: clone the handle's base branch
//! into the work directory, let the agent work there, then commit everything on a task
//! branch `awcp/<delegationId>` (the reference's name) and push it, reporting
//! `{branch, commitHash, baseCommit, changedFiles}` in the `snapshot` event.
//!
//! Unlike the reference, the repository the Executor commits and pushes from lives in the
//! Executor's state directory (`--separate-git-dir`), and every git command the Executor
//! runs names it and the work tree explicitly, with hooks off: the agent (untrusted code)
//! can change the work tree, but not the configuration, hooks or refs the Executor's own
//! `git commit` and `git push` run with. The agent gets a repository of its own in the
//! work tree (`.git`, a copy of the task branch without the remote, handed to the agent's
//! user), so its `git status`, `diff` and `commit` work when it runs confined; after the
//! round its commits are brought over without running anything of its repository
//! ([`import_agent_commits`]: its objects copied as plain files into a repository the
//! Executor configures, its `HEAD` read as text). Credentials from the handle reach
//! git through its environment (a credential helper reading a variable, or
//! `GIT_SSH_COMMAND` naming a 0600 key file), never through a command line, and never
//! reach the agent's repository.
//!
//! Everything here blocks: call it from `spawn_blocking`.

use std::path::{Path, PathBuf};
use std::process::Command;

use awcp_protocol::transport::{GitCredential, GitHandle, GitSnapshotInfo};

/// Whether a `git` binary can be run.
pub(super) fn git_available() -> bool {
    Command::new("git")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A failed git step: what was being done, and git's own words.
#[derive(Debug)]
pub(super) struct GitFailure {
    /// Which step (`clone`, `push`, …).
    pub(super) step: &'static str,
    /// git's stderr (or why it could not run).
    pub(super) detail: String,
}

impl std::fmt::Display for GitFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "git {} failed: {}", self.step, self.detail.trim())
    }
}

/// Whether `url` is a remote this Executor may clone: `http(s)://`, `ssh://`, `git://` or
/// scp-like `user@host:path`. Local paths, `file://` and `ext::` are refused: a Delegator
/// must not make the Executor read its own disk or run a command through git.
pub(crate) fn remote_allowed(url: &str) -> bool {
    if url.starts_with('-') || url.chars().any(|c| c.is_control()) {
        return false;
    }
    let lower = url.to_ascii_lowercase();
    if ["https://", "http://", "ssh://", "git://"]
        .iter()
        .any(|p| lower.starts_with(p))
    {
        return true;
    }
    // scp-like: `user@host:path`, with no `/` before the `:` and no `::` (transport helpers).
    match (url.find('@'), url.find(':'), url.find('/')) {
        (Some(at), Some(colon), slash) => {
            at < colon && slash.is_none_or(|s| s > colon) && !url.contains("::")
        }
        _ => false,
    }
}

/// Whether `name` is a branch name git accepts and that cannot be read as an option.
pub(crate) fn branch_ok(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('-')
        && Command::new("git")
            .args(["check-ref-format", "--branch", name])
            .output()
            .is_ok_and(|o| o.status.success())
}

/// A cloned workspace and what the Executor needs to commit and push it.
#[derive(Debug)]
pub(super) struct GitWork {
    git_dir: PathBuf,
    work: PathBuf,
    branch: String,
    base_commit: String,
    delegation_id: String,
    env: Vec<(String, String)>,
    key_file: Option<PathBuf>,
}

impl GitWork {
    fn cmd(&self) -> Command {
        let mut c = Command::new("git");
        c.arg("--git-dir")
            .arg(&self.git_dir)
            .arg("--work-tree")
            .arg(&self.work)
            .args([
                "-c",
                "core.hooksPath=/dev/null",
                "-c",
                "core.fsmonitor=false",
            ])
            .current_dir(&self.work);
        env(&mut c, &self.env);
        c
    }

    fn run(&self, step: &'static str, args: &[&str]) -> Result<String, GitFailure> {
        output(step, self.cmd().args(args))
    }

    /// Remove the git directory and the key file (the work tree is the caller's).
    pub(super) fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.git_dir);
        if let Some(k) = &self.key_file {
            let _ = std::fs::remove_file(k);
        }
    }
}

fn env(c: &mut Command, vars: &[(String, String)]) {
    c.env("GIT_TERMINAL_PROMPT", "0")
        // Refuse `ext::` and local transports in anything this clone fetches (submodules
        // included), whatever the user's configuration says.
        .env("GIT_PROTOCOL_FROM_USER", "0")
        .env("GIT_ALLOW_PROTOCOL", "http:https:ssh:git")
        .envs(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())));
}

fn output(step: &'static str, c: &mut Command) -> Result<String, GitFailure> {
    let out = c.output().map_err(|e| GitFailure {
        step,
        detail: format!("cannot run git: {e}"),
    })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(GitFailure {
            step,
            detail: if err.trim().is_empty() {
                String::from_utf8_lossy(&out.stdout).into_owned()
            } else {
                err.into_owned()
            },
        })
    }
}

/// Environment variables for git, and the key file written for them (removed with the
/// clone).
pub(crate) type AuthEnv = (Vec<(String, String)>, Option<PathBuf>);

/// The environment that hands `auth` to git: a token through a credential helper that
/// reads it from a variable, a private key through `GIT_SSH_COMMAND`.
pub(crate) fn auth_env(auth: Option<&GitCredential>, key_file: &Path) -> std::io::Result<AuthEnv> {
    match auth {
        Some(GitCredential::Token { token }) => Ok((token_env(token), None)),
        Some(GitCredential::Ssh {
            private_key: Some(key),
        }) => {
            awcpfs::private::write(key_file, key.as_bytes())?;
            let path = key_file.display().to_string().replace('\'', "'\\''");
            Ok((
                vec![(
                    "GIT_SSH_COMMAND".into(),
                    format!(
                        "ssh -i '{path}' -o IdentitiesOnly=yes -o StrictHostKeyChecking=accept-new"
                    ),
                )],
                Some(key_file.to_path_buf()),
            ))
        }
        _ => Ok((Vec::new(), None)),
    }
}

/// A credential helper, configured through git's environment (`GIT_CONFIG_*`), that answers
/// with the token held in `AWCP_GIT_TOKEN`: the token is in no command line and no file.
pub(crate) fn token_env(token: &str) -> Vec<(String, String)> {
    vec![
        ("GIT_CONFIG_COUNT".into(), "1".into()),
        ("GIT_CONFIG_KEY_0".into(), "credential.helper".into()),
        (
            "GIT_CONFIG_VALUE_0".into(),
            "!f() { test \"$1\" = get && echo username=x-access-token && \
             echo \"password=$AWCP_GIT_TOKEN\"; }; f"
                .into(),
        ),
        ("AWCP_GIT_TOKEN".into(), token.into()),
    ]
}

/// Clone `h`'s base branch into `work` (which must not exist), with the git directory at
/// `git_dir`, and check out the task branch at `baseCommit`.
pub(super) fn setup(
    h: &GitHandle,
    delegation_id: &str,
    work: &Path,
    git_dir: &Path,
    key_file: &Path,
) -> Result<GitWork, GitFailure> {
    let bad = |detail: String| GitFailure {
        step: "setup",
        detail,
    };
    if !remote_allowed(&h.repo_url) {
        return Err(bad(format!(
            "repoUrl `{}` is not an http(s)://, ssh://, git:// or user@host:path remote",
            h.repo_url
        )));
    }
    if !branch_ok(&h.base_branch) {
        return Err(bad(format!(
            "baseBranch `{}` is not a valid branch name",
            h.base_branch
        )));
    }
    if h.base_commit.len() < 4 || !h.base_commit.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(bad(format!(
            "baseCommit `{}` is not a commit id",
            h.base_commit
        )));
    }
    let (env_vars, key) = auth_env(h.auth.as_ref(), key_file)
        .map_err(|e| bad(format!("writing {}: {e}", key_file.display())))?;
    if let Some(parent) = git_dir.parent() {
        awcpfs::private::create_dir_all(parent)
            .map_err(|e| bad(format!("creating {}: {e}", parent.display())))?;
    }
    let _ = std::fs::remove_dir_all(git_dir);
    let mut clone = Command::new("git");
    clone
        .args(["clone", "--quiet", "--single-branch", "--branch"])
        .arg(&h.base_branch)
        .arg("--separate-git-dir")
        .arg(git_dir)
        .arg("--")
        .arg(&h.repo_url)
        .arg(work);
    env(&mut clone, &env_vars);
    output("clone", &mut clone)?;
    let w = GitWork {
        git_dir: git_dir.to_path_buf(),
        work: work.to_path_buf(),
        branch: format!("awcp/{delegation_id}"),
        base_commit: h.base_commit.clone(),
        delegation_id: delegation_id.to_string(),
        env: env_vars,
        key_file: key,
    };
    let base = w
        .run(
            "rev-parse",
            &[
                "rev-parse",
                "--verify",
                &format!("{}^{{commit}}", h.base_commit),
            ],
        )
        .map_err(|e| GitFailure {
            step: "setup",
            detail: format!(
                "baseCommit {} is not on branch {}: {}",
                h.base_commit, h.base_branch, e.detail
            ),
        })?;
    w.run(
        "checkout",
        &["checkout", "--quiet", "-B", &w.branch, base.trim()],
    )?;
    w.run("config", &["config", "user.name", "AWCP Executor"])?;
    w.run("config", &["config", "user.email", "executor@awcp.local"])?;
    agent_repository(&w)?;
    Ok(w)
}

/// git run by the Executor on a repository it made itself (no credentials, local paths
/// allowed, hooks off).
fn local_git(git_dir: &Path) -> Command {
    let mut c = Command::new("git");
    c.arg("--git-dir")
        .arg(git_dir)
        .args([
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "core.fsmonitor=false",
        ])
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1");
    c
}

/// The agent's own repository at `<work>/.git` (in place of the pointer file the clone
/// left): the task branch fetched from the Executor's repository, its index matching the
/// checkout, no remote (the agent has no credentials and pushes nothing). Made before the
/// agent starts; the work tree, this included, is then handed to the agent's user.
fn agent_repository(w: &GitWork) -> Result<(), GitFailure> {
    let step = "setup";
    let fail = |detail: String| GitFailure { step, detail };
    let dot_git = w.work.join(".git");
    std::fs::remove_file(&dot_git)
        .map_err(|e| fail(format!("removing {}: {e}", dot_git.display())))?;
    output(
        step,
        Command::new("git")
            .args(["init", "--quiet", "--initial-branch"])
            .arg(&w.branch)
            .arg(&w.work)
            .env("GIT_CONFIG_NOSYSTEM", "1"),
    )?;
    let refspec = format!("+refs/heads/{0}:refs/heads/{0}", w.branch);
    output(
        step,
        local_git(&dot_git)
            .args(["fetch", "--quiet", "--no-tags", "--update-head-ok"])
            .arg(&w.git_dir)
            .arg(&refspec),
    )?;
    // A mixed reset: the index from the branch, the files (already checked out) untouched.
    output(
        step,
        local_git(&dot_git)
            .arg("--work-tree")
            .arg(&w.work)
            .args(["reset", "--quiet"]),
    )?;
    for (k, v) in [
        ("user.name", "AWCP Agent"),
        ("user.email", "agent@awcp.local"),
    ] {
        output(step, local_git(&dot_git).args(["config", k, v]))?;
    }
    Ok(())
}

/// What the agent's `HEAD` names, read as text from its repository (never by running git
/// there): `ref: refs/heads/<b>` through the loose ref or `packed-refs`, or a commit id.
fn agent_head(dot_git: &Path) -> Option<String> {
    let read = |p: &Path| -> Option<String> {
        let meta = std::fs::symlink_metadata(p).ok()?;
        if !meta.is_file() || meta.len() > 1 << 20 {
            return None;
        }
        std::fs::read_to_string(p).ok()
    };
    let is_id =
        |s: &str| (s.len() == 40 || s.len() == 64) && s.bytes().all(|b| b.is_ascii_hexdigit());
    let head = read(&dot_git.join("HEAD"))?;
    let head = head.trim();
    if is_id(head) {
        return Some(head.to_string());
    }
    let name = head.strip_prefix("ref: ")?.trim();
    if !name.starts_with("refs/heads/") || name.split('/').any(|c| c.is_empty() || c == "..") {
        return None;
    }
    if let Some(id) = read(&dot_git.join(name)) {
        let id = id.trim();
        return is_id(id).then(|| id.to_string());
    }
    read(&dot_git.join("packed-refs"))?.lines().find_map(|l| {
        let (id, r) = l.split_once(' ')?;
        (r == name && is_id(id)).then(|| id.to_string())
    })
}

/// Copy the regular files and directories under `from` to `to`, following no link.
fn copy_plain(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let ft = entry.file_type()?;
        let dest = to.join(entry.file_name());
        if ft.is_dir() {
            copy_plain(&entry.path(), &dest)?;
        } else if ft.is_file() {
            std::fs::copy(entry.path(), &dest)?;
        }
    }
    Ok(())
}

/// Bring the agent's commits into the Executor's repository when they build on its branch:
/// the agent's objects are copied as plain files (no alternates: they could name any
/// repository on this machine) into a quarantine repository the Executor configures, and
/// fetched from there with every object checked (`transfer.fsckObjects`); then the branch
/// moves to the agent's `HEAD` (the index stays, so `add -A` next stages the work tree
/// against it). Commits that do not descend from the branch (the agent rewrote history, or
/// committed on an older round) are left out: the work tree is committed either way.
/// Returns the commit taken, if any.
fn import_agent_commits(w: &GitWork) -> Option<String> {
    let dot_git = w.work.join(".git");
    if !std::fs::symlink_metadata(&dot_git).is_ok_and(|m| m.is_dir()) {
        return None;
    }
    let head = agent_head(&dot_git)?;
    let ours = w.run("rev-parse", &["rev-parse", "HEAD"]).ok()?;
    if head == ours.trim() {
        return None;
    }
    let q = w.git_dir.with_extension("agent-import");
    let _ = std::fs::remove_dir_all(&q);
    let imported = (|| {
        output(
            "import",
            Command::new("git")
                .args(["init", "--quiet", "--bare"])
                .arg(&q)
                .env("GIT_CONFIG_NOSYSTEM", "1"),
        )
        .ok()?;
        let objects = q.join("objects");
        for sub in std::fs::read_dir(dot_git.join("objects")).ok()? {
            let sub = sub.ok()?;
            let name = sub.file_name();
            // Loose objects (`xx/`) and packs; never `info/` (alternates).
            if name == "info" || !sub.file_type().ok()?.is_dir() {
                continue;
            }
            copy_plain(&sub.path(), &objects.join(&name)).ok()?;
        }
        output(
            "import",
            local_git(&q).args(["update-ref", "refs/heads/agent", &head]),
        )
        .ok()?;
        output(
            "import",
            local_git(&w.git_dir)
                .args([
                    "-c",
                    "transfer.fsckObjects=true",
                    "fetch",
                    "--quiet",
                    "--no-tags",
                ])
                .arg(&q)
                .arg("+refs/heads/agent:refs/awcp/agent"),
        )
        .ok()?;
        w.run(
            "merge-base",
            &[
                "merge-base",
                "--is-ancestor",
                ours.trim(),
                "refs/awcp/agent",
            ],
        )
        .ok()?;
        w.run("reset", &["reset", "--soft", "--quiet", "refs/awcp/agent"])
            .ok()?;
        Some(head.clone())
    })();
    let _ = std::fs::remove_dir_all(&q);
    let _ = w.run("update-ref", &["update-ref", "-d", "refs/awcp/agent"]);
    if imported.is_none() {
        tracing::info!(delegation = %w.delegation_id, agent_head = %head,
            "the agent's commits do not build on the task branch (or could not be read): the work tree is committed without them");
    }
    imported
}

/// Commit whatever the agent changed (if anything) and push the task branch; what to put
/// in the `snapshot` event.
pub(super) fn capture(w: &GitWork) -> Result<GitSnapshotInfo, GitFailure> {
    import_agent_commits(w);
    w.run("add", &["add", "-A"])?;
    let status = w.run("status", &["status", "--porcelain"])?;
    if !status.trim().is_empty() {
        w.run(
            "commit",
            &[
                "commit",
                "--quiet",
                "--no-verify",
                "-m",
                &format!("AWCP: Task completed for {}", w.delegation_id),
            ],
        )?;
    }
    // HEAD (with the agent's commits, when they build on it) is the result; the branch is
    // this delegation's own, so a leftover from an earlier attempt is overwritten.
    w.run(
        "push",
        &[
            "push",
            "--quiet",
            "--force",
            "origin",
            &format!("HEAD:refs/heads/{}", w.branch),
        ],
    )?;
    let commit = w
        .run("rev-parse", &["rev-parse", "HEAD"])?
        .trim()
        .to_string();
    let changed = w.run(
        "diff",
        &["diff", "--name-only", "-z", &w.base_commit, "HEAD"],
    )?;
    Ok(GitSnapshotInfo {
        branch: w.branch.clone(),
        commit_hash: commit,
        base_commit: w.base_commit.clone(),
        changed_files: changed
            .split('\0')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_network_remotes_are_cloned() {
        for ok in [
            "https://github.com/o/r.git",
            "http://127.0.0.1:9/r.git",
            "ssh://git@host/r.git",
            "git://127.0.0.1:9418/r.git",
            "git@github.com:o/r.git",
        ] {
            assert!(remote_allowed(ok), "{ok}");
        }
        for bad in [
            "/etc",
            "file:///etc",
            "ext::sh -c touch% /tmp/pwned",
            "--upload-pack=touch /tmp/x",
            "./repo",
            "a/b@c:d",
            "fd::17",
            "",
        ] {
            assert!(!remote_allowed(bad), "{bad}");
        }
    }

    /// The token helper works through git itself: `git credential fill` answers with the
    /// token from the environment, and the token is in no argument.
    #[test]
    fn a_token_reaches_git_through_its_environment_only() {
        let env = token_env("s3cr3t-token");
        assert!(
            env.iter()
                .filter(|(k, _)| k != "AWCP_GIT_TOKEN")
                .all(|(_, v)| !v.contains("s3cr3t")),
            "{env:?}"
        );
        let mut c = Command::new("git");
        c.args(["credential", "fill"])
            .env_remove("GIT_ASKPASS")
            .env("GIT_TERMINAL_PROMPT", "0")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        let mut child = c.spawn().expect("git");
        use std::io::Write as _;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"protocol=https\nhost=git.example\n\n")
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("password=s3cr3t-token"), "{text}");
        assert!(text.contains("username=x-access-token"), "{text}");
    }

    #[test]
    fn an_ssh_key_is_written_owner_only_and_named_in_the_environment() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("it's key");
        let (env, file) = auth_env(
            Some(&GitCredential::Ssh {
                private_key: Some("-----BEGIN OPENSSH PRIVATE KEY-----\n".into()),
            }),
            &key,
        )
        .unwrap();
        assert_eq!(file.as_deref(), Some(key.as_path()));
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(env[0].0, "GIT_SSH_COMMAND");
        // The path is quoted for the shell git runs the command with.
        assert!(env[0].1.contains("'\\''"), "{}", env[0].1);
        let (env, file) = auth_env(Some(&GitCredential::None), &key).unwrap();
        assert!(env.is_empty() && file.is_none());
    }

    #[test]
    fn branch_names_that_read_as_options_are_refused() {
        assert!(branch_ok("main"));
        assert!(branch_ok("awcp-base/dlg_1"));
        assert!(!branch_ok("-d"));
        assert!(!branch_ok("a..b"));
        assert!(!branch_ok(""));
    }
}
