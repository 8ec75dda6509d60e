//! The skill module for Delegator agents (skill/awcp): its scripts, run as an agent would,
//! against a real daemon and Executor — delegate, wait, status, snapshots, diff, apply,
//! discard, revoke, multi-round continue/close — and its packaging script.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use awcp_tests::{Harness, fuse_available};

/// The `awcp-ctl` binary the scripts drive. Under CI it must be there (the workspace build
/// makes it); elsewhere a missing one skips, loudly.
fn ctl_bin() -> Option<PathBuf> {
    if let Some(p) = awcp_tests::fleet::awcp_ctl_bin() {
        return Some(p);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("the skill's scripts need the awcp-ctl binary (cargo build -p awcp-ctl)");
    }
    eprintln!(
        "\n!!!!!!!! SKIPPING the skill test: no awcp-ctl binary (cargo build -p awcp-ctl) !!!!!!!!\n"
    );
    None
}

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../skill/awcp/scripts")
}

/// Run `script args…` with the daemon and Executor in the environment; (exit code, stdout,
/// stderr).
async fn run(h: &Harness, bin: &Path, script: &str, args: &[&str]) -> (i32, String, String) {
    let mut cmd = Command::new("bash");
    cmd.arg(scripts().join(script))
        .args(args)
        .env("AWCP_CTL", bin)
        .env("AWCP_DAEMON_URL", h.daemon.url())
        .env("AWCP_API_TOKEN", h.daemon.api_token().unwrap_or(""))
        .env("AWCP_EXECUTOR_URL", h.executor.awcp_url())
        .env("AWCP_LOG", "error");
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `delegate.sh`: the id it printed.
async fn delegate(h: &Harness, bin: &Path, dir: &Path, task: &str, extra: &[&str]) -> String {
    let d = dir.display().to_string();
    let mut args = vec![d.as_str(), task];
    args.extend_from_slice(extra);
    let (code, out, err) = run(h, bin, "delegate.sh", &args).await;
    assert_eq!(code, 0, "delegate.sh: {out}{err}");
    let id = out.trim().to_string();
    assert!(id.starts_with("dlg_") && id.len() == 36, "{out}");
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_skills_scripts_drive_a_delegation_from_start_to_apply_discard_and_revoke() {
    let Some(bin) = ctl_bin() else { return };
    if !fuse_available() {
        return;
    }
    // The agent runs its task as a shell command, so each delegation says what it does.
    let h = Harness::start("sh -c \"$AWCP_TASK_DESCRIPTION\"").await;
    let ws = h.path("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("README"), "hello\n").unwrap();

    // Staged: the change waits for apply.sh.
    let id = delegate(
        &h,
        &bin,
        &ws,
        "echo from-skill > added.txt",
        &["--snapshot-mode", "staged"],
    )
    .await;
    let (code, out, err) = run(&h, &bin, "wait.sh", &[&id, "60"]).await;
    assert_eq!(code, 0, "wait.sh: {out}{err}");
    assert!(out.contains("completed"), "{out}");
    let (code, out, _) = run(&h, &bin, "status.sh", &[&id]).await;
    assert_eq!(code, 0);
    assert!(out.contains(&id) && out.contains("completed"), "{out}");
    let (code, out, _) = run(&h, &bin, "status.sh", &[]).await;
    assert_eq!(code, 0);
    assert!(out.contains(&id), "status.sh lists it: {out}");
    assert!(!ws.join("added.txt").exists(), "staged: not applied yet");
    let (code, out, err) = run(&h, &bin, "snapshots.sh", &[&id]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("pending") || out.contains("staged"), "{out}");
    let (code, out, err) = run(&h, &bin, "diff.sh", &[&id]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("added.txt"), "{out}");
    let (code, out, err) = run(&h, &bin, "apply.sh", &[&id]).await;
    assert_eq!(code, 0, "apply.sh: {out}{err}");
    assert_eq!(
        std::fs::read_to_string(ws.join("added.txt")).unwrap(),
        "from-skill\n"
    );

    // Discarded: the change never lands.
    let id = delegate(
        &h,
        &bin,
        &ws,
        "echo unwanted > unwanted.txt",
        &["--snapshot-mode", "staged"],
    )
    .await;
    let (code, out, err) = run(&h, &bin, "wait.sh", &[&id, "60"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run(&h, &bin, "discard.sh", &[&id]).await;
    assert_eq!(code, 0, "discard.sh: {out}{err}");
    let (code, _, _) = run(&h, &bin, "apply.sh", &[&id]).await;
    assert_ne!(code, 0, "a discarded snapshot cannot be applied");
    assert!(!ws.join("unwanted.txt").exists());

    // Revoked mid-task: wait.sh reports the end and fails.
    let id = delegate(&h, &bin, &ws, "sleep 60", &[]).await;
    let (code, _, _) = run(&h, &bin, "wait.sh", &[&id, "1"]).await;
    assert_eq!(code, 2, "still running at the timeout");
    let (code, out, err) = run(&h, &bin, "revoke.sh", &[&id]).await;
    assert_eq!(code, 0, "revoke.sh: {out}{err}");
    let (code, out, _) = run(&h, &bin, "wait.sh", &[&id, "60"]).await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("cancelled"), "{out}");

    // A failing agent: watch.sh follows to the end and exits with the error's code.
    let id = delegate(&h, &bin, &ws, "echo broken >&2; exit 3", &[]).await;
    let (code, out, _) = run(&h, &bin, "watch.sh", &[&id]).await;
    assert_eq!(code, 5, "{out}");
    let (code, out, _) = run(&h, &bin, "wait.sh", &[&id, "10"]).await;
    assert_eq!(code, 1);
    assert!(out.contains("TASK_FAILED"), "{out}");

    // Rounds: idle after each, continue, close.
    let id = delegate(&h, &bin, &ws, "echo one >> rounds.txt", &["--multi-round"]).await;
    let (code, out, _) = run(&h, &bin, "wait.sh", &[&id, "60"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("idle"), "{out}");
    let (code, out, err) = run(&h, &bin, "continue.sh", &[&id, "echo two >> rounds.txt"]).await;
    assert_eq!(code, 0, "continue.sh: {out}{err}");
    // Wait for round 2 to be idle again (the file has both lines).
    assert!(
        awcp_tests::eventually(Duration::from_secs(60), || std::fs::read_to_string(
            ws.join("rounds.txt")
        )
        .is_ok_and(|s| s == "one\ntwo\n"))
        .await
    );
    let (code, _, _) = run(&h, &bin, "wait.sh", &[&id, "60"]).await;
    assert_eq!(code, 0);
    let (code, out, err) = run(&h, &bin, "close.sh", &[&id]).await;
    assert_eq!(code, 0, "close.sh: {out}{err}");
    let (code, out, _) = run(&h, &bin, "wait.sh", &[&id, "60"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("completed"), "{out}");

    // Bad input says what to do.
    let (code, _, err) = run(&h, &bin, "apply.sh", &["not-an-id"]).await;
    assert_eq!(code, 64);
    assert!(err.contains("give a delegation id"), "{err}");
    h.stop().await;
}

#[test]
fn the_skill_packages_into_a_reproducible_tarball() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let pack = |out: &Path| {
        let o = Command::new("bash")
            .arg(root.join("scripts/package-skill.sh"))
            .arg(out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let (a, b) = (tmp.path().join("a.tar.gz"), tmp.path().join("b.tar.gz"));
    pack(&a);
    pack(&b);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let list = Command::new("tar").arg("tzf").arg(&a).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    for f in [
        "awcp/SKILL.md",
        "awcp/scripts/delegate.sh",
        "awcp/scripts/wait.sh",
        "awcp/scripts/apply.sh",
        "awcp/scripts/discard.sh",
        "awcp/scripts/revoke.sh",
        "awcp/scripts/status.sh",
        "awcp/scripts/watch.sh",
        "awcp/scripts/snapshots.sh",
    ] {
        assert!(list.lines().any(|l| l == f), "{f} missing: {list}");
    }
    // Unpacked, the scripts still run (executable, self-contained).
    let x = Command::new("tar")
        .arg("xzf")
        .arg(&a)
        .arg("-C")
        .arg(tmp.path())
        .status()
        .unwrap();
    assert!(x.success());
    let o = Command::new(tmp.path().join("awcp/scripts/wait.sh"))
        .arg("-h")
        .env("AWCP_CTL", "true")
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("usage: wait.sh"));
}
