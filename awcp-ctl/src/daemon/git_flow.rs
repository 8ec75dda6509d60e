//! The Delegator's half of the reference's `git` transport.
//!
//! As the reference does, the workspace need not be a git repository: its files (admitted
//! and filtered as for `archive`, `.git` directories left out) are committed as one commit
//! in a fresh repository under `<state>/git/<id>/`, laid out like the archive zip
//! (`<resourceName>/…`), and pushed to the remote the request names. Unlike the
//! reference, which force-pushes `main`, the base branch is the delegation's own,
//! `awcp-base/<delegationId>`, so delegations sharing a remote never overwrite each other
//! or anyone's `main`.
//!
//! The Executor pushes its result as `awcp/<delegationId>` and reports
//! `{branch, commitHash, baseCommit, changedFiles}`. The daemon fetches that branch (only a
//! branch name git accepts, only from its own remote), says whether the result is a
//! fast-forward of the base commit or a history of the Executor's own making, checks the
//! result's tree out into a scratch directory and merges it into the workspace file by
//! file, exactly as an `archive` snapshot: a file changed on both sides is a conflict, the
//! Executor's version kept beside the Delegator's, never over it.
//!
//! Credentials: git's own credential helper (the daemon user's configuration), or the
//! token in `serve --git-token-file`, handed to git through its environment
//! (a credential helper reading a variable), never a command-line argument.

use std::path::{Path, PathBuf};
use std::process::Command;

use awcp_protocol::transport::{GitCredential, GitHandle, GitSnapshotInfo};

use super::Daemon;

/// What was pushed: the remote and the base commit (`<state>/git/<id>/sent.json`).
const SENT: &str = "sent.json";
use super::flow::Refusal;

/// Runs git for the daemon: no prompts, no hooks, credentials in the environment.
struct Git {
    dir: PathBuf,
    env: Vec<(String, String)>,
}

impl Git {
    fn run(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("git")
            .args(["-c", "core.hooksPath=/dev/null"])
            .args(args)
            .current_dir(&self.dir)
            .env("GIT_TERMINAL_PROMPT", "0")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .map_err(|e| format!("cannot run git: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "git {} failed: {}",
                args.first().copied().unwrap_or(""),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }
}

impl Daemon {
    fn git_dir(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join("git").join(id)
    }

    /// The token of `serve --git-token-file`, if one is configured.
    fn git_token(&self) -> Result<Option<String>, Refusal> {
        let Some(path) = &self.cfg.git_token_file else {
            return Ok(None);
        };
        let token = std::fs::read_to_string(path).map_err(|e| {
            Refusal::internal(format!(
                "reading the git token file {}: {e}",
                path.display()
            ))
        })?;
        Ok(Some(token.trim().to_string()))
    }

    fn git_for(&self, dir: PathBuf) -> Result<Git, Refusal> {
        let env = match self.git_token()? {
            Some(t) => crate::executor::git_token_env(&t),
            None => Vec::new(),
        };
        Ok(Git { dir, env })
    }

    /// Commit the packed workspace in a fresh repository and push it to `remote` as
    /// `awcp-base/<id>`; the handle the Executor clones from.
    pub(crate) async fn git_handle(
        &self,
        id: &str,
        remote: String,
        zip: Vec<u8>,
    ) -> Result<GitHandle, Refusal> {
        if !crate::executor::git_remote_allowed(&remote) {
            return Err(Refusal::bad(
                awcp_protocol::ErrorCode::WorkspaceInvalid,
                format!("git remote `{remote}` is not one an Executor will clone"),
                "Name an https://, ssh://, git:// or user@host:path remote",
            ));
        }
        let root = self.git_dir(id);
        let git = self.git_for(root.join("repo"))?;
        let token = self.git_token()?;
        let limits = self.cfg.snapshot_limits;
        let id = id.to_string();
        tokio::task::spawn_blocking(move || {
            let _ = std::fs::remove_dir_all(&root);
            awcpfs::private::create_dir_all(&root).map_err(|e| e.to_string())?;
            crate::archive::extract(&zip, &git.dir, &limits).map_err(|e| e.to_string())?;
            let branch = format!("awcp-base/{id}");
            git.run(&["init", "--quiet"])?;
            git.run(&["add", "-A"])?;
            git.run(&[
                "-c",
                "user.name=AWCP Delegator",
                "-c",
                "user.email=delegator@awcp.local",
                "commit",
                "--quiet",
                "--allow-empty",
                "-m",
                &format!("AWCP: Initial workspace for {id}"),
            ])?;
            let base = git.run(&["rev-parse", "HEAD"])?.trim().to_string();
            let sent = serde_json::json!({ "remote": remote, "baseCommit": base });
            awcpfs::private::write(&root.join(SENT), sent.to_string().as_bytes())
                .map_err(|e| e.to_string())?;
            git.run(&[
                "push",
                "--quiet",
                "--force",
                "--",
                &remote,
                &format!("HEAD:refs/heads/{branch}"),
            ])?;
            Ok::<_, String>(GitHandle {
                repo_url: remote,
                base_branch: branch,
                base_commit: base,
                auth: token.map(|token| GitCredential::Token { token }),
            })
        })
        .await
        .map_err(|e| Refusal::internal(format!("preparing the git workspace panicked: {e}")))?
        .map_err(|e| Refusal {
            status: 400,
            message: format!("pushing the workspace to the git remote failed: {e}"),
            code: Some(awcp_protocol::ErrorCode::TransportError),
            hint: Some(
                "Check that the daemon can push to the remote (git's credential helper, or \
                 serve --git-token-file)"
                    .into(),
            ),
        })
    }

    /// Fetch the result branch a `git` snapshot event names and zip its tree, laid out as
    /// an `archive` snapshot; with a sentence on how the result relates to the base.
    pub(crate) async fn git_result(
        &self,
        id: &str,
        snapshot: &str,
    ) -> Result<(Vec<u8>, String), String> {
        let info: GitSnapshotInfo = serde_json::from_str(snapshot).map_err(|e| {
            format!("the snapshot is not the git transport's {{branch, commitHash, …}} ({e})")
        })?;
        if !crate::executor::git_branch_ok(&info.branch) {
            return Err(format!(
                "result branch `{}` is not a valid branch name",
                info.branch
            ));
        }
        let root = self.git_dir(id);
        let sent: serde_json::Value = std::fs::read(root.join(SENT))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| format!("{} is missing: the base was not pushed", SENT))?;
        let (Some(remote), Some(base_commit)) = (
            sent["remote"].as_str().map(str::to_string),
            sent["baseCommit"].as_str().map(str::to_string),
        ) else {
            return Err(format!("{SENT} is unreadable"));
        };
        let git = self.git_for(root.join("repo")).map_err(|e| e.message)?;
        tokio::task::spawn_blocking(move || {
            fetch_and_pack(&git, &root, &remote, &base_commit, &info)
        })
        .await
        .map_err(|e| format!("fetching the result panicked: {e}"))?
    }
}

fn fetch_and_pack(
    git: &Git,
    root: &Path,
    remote: &str,
    base: &str,
    info: &GitSnapshotInfo,
) -> Result<(Vec<u8>, String), String> {
    git.run(&[
        "fetch",
        "--quiet",
        "--no-tags",
        "--",
        remote,
        &format!("+refs/heads/{}:refs/awcp/result", info.branch),
    ])?;
    let got = git.run(&["rev-parse", "refs/awcp/result^{commit}"])?;
    let got = got.trim();
    let mut how = if git.run(&["merge-base", "--is-ancestor", base, got]).is_ok() {
        format!(
            "{} at {} fast-forwards the base commit",
            info.branch,
            short(got)
        )
    } else {
        format!(
            "{} at {} does not descend from the base commit (the Executor rewrote history); \
             its tree is merged file by file",
            info.branch,
            short(got)
        )
    };
    if !info.commit_hash.is_empty() && !got.starts_with(info.commit_hash.trim()) {
        how.push_str(&format!(
            " (the Executor reported {}, the branch holds {})",
            short(&info.commit_hash),
            short(got)
        ));
    }
    let tree = root.join("result");
    let _ = std::fs::remove_dir_all(&tree);
    awcpfs::private::create_dir_all(&tree).map_err(|e| e.to_string())?;
    // Check the result's tree out into a scratch directory of its own (links are left out
    // by the packing, as for `archive`).
    let out = Command::new("git")
        .arg("--git-dir")
        .arg(git.dir.join(".git"))
        .arg("--work-tree")
        .arg(&tree)
        .args([
            "-c",
            "core.hooksPath=/dev/null",
            "checkout",
            "--quiet",
            "-f",
        ])
        .arg(got)
        .args(["--", "."])
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .map_err(|e| format!("cannot run git: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "git checkout of the result failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let (zip, _, _) = crate::archive::pack_dir(&tree).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&tree);
    Ok((zip, how))
}

fn short(commit: &str) -> &str {
    commit.get(..12).unwrap_or(commit)
}
