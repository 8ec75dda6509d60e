//! The Executor process is killed (SIGKILL) while its agent writes: when the Executor
//! starts again with the same directory, it unmounts the leftover mount, writes back
//! every change the agent's `close` had returned for, and tells the Delegator how the
//! delegation ended (`error`, `TASK_FAILED`: the Executor restarted).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use awcpfs::testing::fuse_available;

const BIN: &str = env!("CARGO_BIN_EXE_awcp-ctl");

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

fn executor(dir: &Path, port: u16, agent: &str, extra: &[&str]) -> Proc {
    Proc(
        Command::new(BIN)
            .arg("executor")
            .args(extra)
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--agent-cmd",
                agent,
                "--dir",
            ])
            .arg(dir)
            // The agent records what it wrote in `out/` beside the Executor's directory.
            .arg("--agent-allow-write")
            .arg(dir.parent().unwrap().join("out"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn a_killed_executor_recovers_its_mounts_writes_on_restart() {
    crash_and_recover(false, &[]);
}

/// With two resources (two mounts, two journals), both are recovered.
#[test]
fn a_killed_executor_recovers_every_resources_writes_on_restart() {
    crash_and_recover(true, &[]);
}

/// With the kernel's writeback cache, `close` has the kernel write the file's pages to the
/// mount before it returns: what it returned for is recovered the same.
#[test]
fn wbcache_a_killed_executor_recovers_its_mounts_writes_on_restart() {
    crash_and_recover(false, &["--writeback-cache"]);
}

fn crash_and_recover(several: bool, extra: &[&str]) {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // The agents' user passes through to the Executor's work directory (0711).
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .unwrap();
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::write(repo.join("seed.txt"), "seed\n").unwrap();
    let second_dir = tmp.path().join("second");
    std::fs::create_dir_all(&second_dir).unwrap();
    // With two resources the agent runs above them: `workspace/` and `data/`.
    let (into_repo, into_second) = if several {
        ("workspace/", "data/")
    } else {
        ("", "")
    };
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let u = awcp_ctl::executor::ensure_default_user().unwrap();
    std::os::unix::fs::chown(&out, Some(u.uid), Some(u.gid)).unwrap();
    let (api, data, exec) = (free_port(), free_port(), free_port());
    let _serve = Proc(
        Command::new(BIN)
            .args(["serve", "--listen", &format!("127.0.0.1:{api}")])
            .args([
                "--export-listen",
                &format!("127.0.0.1:{data}"),
                "--state-dir",
            ])
            .arg(tmp.path().join("delegator"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Writes files one by one; after each close returns, records it outside the mount.
    // coreutils' printf closes its output and fails if the close did: bash ignores what
    // closing a redirection returns, and under the writeback cache the data reaches the
    // mount only at that close (the kill can fail it after `write(2)` succeeded).
    let agent = format!(
        r#"echo $$ > {o}/agent.pid
        i=0
        while true; do
          env printf 'file %s\n' $i > {r}f$i.txt || exit 1
          {second}
          echo $i >> {o}/acked
          i=$((i+1))
        done"#,
        o = out.display(),
        r = into_repo,
        second = if several {
            format!("env printf 'data %s\\n' $i > {into_second}g$i.txt || exit 1")
        } else {
            String::new()
        },
    );
    let exec_dir = tmp.path().join("executor");
    let mut first = executor(&exec_dir, exec, &agent, extra);
    let daemon = format!("http://127.0.0.1:{api}");
    wait_for("the daemon", || {
        std::net::TcpStream::connect(("127.0.0.1", api)).is_ok()
            && std::net::TcpStream::connect(("127.0.0.1", exec)).is_ok()
    });
    let st = Command::new(BIN)
        .args(["--daemon", &daemon, "delegate"])
        // Where the daemon wrote its API token: the CLI finds it there by itself.
        .env("AWCP_STATE_DIR", tmp.path().join("delegator"))
        // ...and the Executor its credential (a loopback Executor's: read from its dir).
        .env("AWCP_EXECUTOR_DIR", &exec_dir)
        .arg(&repo)
        .args([
            "--to",
            &format!("http://127.0.0.1:{exec}/awcp"),
            "--task",
            "write",
        ])
        .args(if several {
            vec![
                "--resource".to_string(),
                format!("data={}", second_dir.display()),
            ]
        } else {
            Vec::new()
        })
        .status()
        .unwrap();
    assert!(st.success());
    let acked = out.join("acked");
    wait_for("acknowledged writes", || {
        std::fs::read_to_string(&acked).is_ok_and(|s| s.lines().count() >= 200)
    });
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    // The agent runs in its own process group; it dies with its mount's errors or here.
    if let Ok(pid) = std::fs::read_to_string(out.join("agent.pid")) {
        let pid: i32 = pid.trim().parse().unwrap();
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    std::thread::sleep(Duration::from_millis(200));
    let acked: Vec<u64> = std::fs::read_to_string(&acked)
        .unwrap()
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect();

    // A new Executor on the same directory recovers before it serves.
    let _second = executor(&exec_dir, exec, "true", extra);
    let missing = || -> Vec<String> {
        let mut bad = Vec::new();
        for i in &acked {
            let f = repo.join(format!("f{i}.txt"));
            match std::fs::read_to_string(&f) {
                Ok(c) if c == format!("file {i}\n") => {}
                got => bad.push(format!("f{i}.txt: {got:?}")),
            }
            if several {
                let g = second_dir.join(format!("g{i}.txt"));
                match std::fs::read_to_string(&g) {
                    Ok(c) if c == format!("data {i}\n") => {}
                    got => bad.push(format!("g{i}.txt: {got:?}")),
                }
            }
        }
        bad
    };
    let start = Instant::now();
    while !missing().is_empty() && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(25));
    }
    let bad = missing();
    assert!(
        bad.is_empty(),
        "acknowledged writes missing at the Delegator: {bad:?}"
    );
    let work = exec_dir.join("work");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&work.display().to_string()),
        "the crashed executor's mount was left behind"
    );

    // Regression (issue 30): the delegation ended as `error: Delegation not found on
    // executor`. The restarted Executor tells the Delegator what happened: `error` with
    // TASK_FAILED, saying it restarted and that the changes were written back.
    let cli = |args: &[&str]| -> serde_json::Value {
        let out = Command::new(BIN)
            .args(["--daemon", &daemon, "--json", "status"])
            .args(args)
            .env("AWCP_STATE_DIR", tmp.path().join("delegator"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let first = text.lines().next().unwrap_or("null");
        serde_json::from_str(first).unwrap_or(serde_json::Value::Null)
    };
    // The list names it; `status <id>` gives the whole record, its error included.
    let id = cli(&[])["id"].as_str().expect("the delegation").to_string();
    let status = || cli(&[&id]);
    let start = Instant::now();
    let mut v = status();
    while !matches!(
        v["state"].as_str(),
        Some("completed" | "error" | "cancelled" | "expired")
    ) && start.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(100));
        v = status();
    }
    assert_eq!(v["state"], "error", "{v}");
    assert_eq!(v["error"]["code"], "TASK_FAILED", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("Executor restarted"), "{v}");
    assert!(message.contains("written back"), "{v}");
    assert!(!message.contains("not found"), "{v}");
}
