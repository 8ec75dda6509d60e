//! The Executor gives its agents git's filesystem monitor, served by their mount: the
//! agent's environment carries the settings (`GIT_CONFIG_*`), `git status` in the workspace
//! asks the hook and is right about what changed, and the Delegator's `.git/config` never
//! learns of it.

use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, fuse_available, sample_repo, sh};

fn read(p: impl AsRef<std::path::Path>) -> String {
    std::fs::read_to_string(p.as_ref()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agents_on_a_mount_get_git_fsmonitor_from_their_environment() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        r#"set -e
        git config --get core.fsmonitor > {o}/hook
        git config --get core.untrackedCache > {o}/untracked
        git status --porcelain > {o}/s0
        git status --porcelain > /dev/null
        echo "print('changed')" >> calc/ops.py
        echo new > notes.txt
        rm tool.sh
        GIT_TRACE_FSMONITOR={o}/trace git status --porcelain > {o}/s1
        git ls-files -f > {o}/tags
        "#,
        o = out.path().display()
    );
    let hook = env!("CARGO_BIN_EXE_awcp-test-fsmonitor");
    let h = Harness::start_with(&agent, |c| c.fsmonitor_hook = Some(hook.to_string())).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let config_before = std::fs::read(repo.join(".git/config")).unwrap();
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert_eq!(read(out.path().join("hook")), format!("{hook}\n"));
    assert_eq!(read(out.path().join("untracked")), "true\n");
    assert_eq!(read(out.path().join("s0")), "");
    assert_eq!(
        read(out.path().join("s1")),
        " M calc/ops.py\n D tool.sh\n?? notes.txt\n"
    );
    // git asked the hook, and the hook answered from the change log (not "everything").
    let trace = read(out.path().join("trace"));
    assert!(
        trace.contains("returned success") && trace.contains("'calc/ops.py'"),
        "git did not use the mount's answer: {trace}"
    );
    // Unchanged files are marked valid by the monitor (lowercase tags): not looked at.
    let tags = read(out.path().join("tags"));
    assert!(
        tags.lines().any(|l| l == "h README.md"),
        "the index does not carry the monitor's marks: {tags}"
    );
    // The repository's own config was never changed: the settings lived in the agent's
    // environment only.
    assert_eq!(
        std::fs::read(repo.join(".git/config")).unwrap(),
        config_before
    );
    assert_eq!(
        sh(&repo, "git config --get core.fsmonitor || echo none"),
        "none\n"
    );
    h.stop().await;
}
