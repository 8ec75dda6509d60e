//! The README's "Two commands" must work on a fresh machine with only README's prerequisites,
//! and CI must run exactly the README's test command.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The commands of README's "Two commands" code block, comments stripped.
fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let section = readme
        .split("## Two commands")
        .nth(1)
        .expect("README has a \"Two commands\" section");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the section has a sh code block");
    block
        .lines()
        .map(|l| l.split('#').next().unwrap().trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

// Symptom: README's test command was `cargo nextest run …`, which fails on a fresh machine
// ("no such command: nextest"); CI installed nextest itself, so it never noticed.
#[test]
fn readme_test_command_is_the_ci_command_and_needs_no_preinstalled_nextest() {
    let cmds = readme_commands();
    assert_eq!(cmds.len(), 2, "README's Two commands: {cmds:?}");
    assert_eq!(cmds[1], "bash scripts/test.sh");
    let ci = std::fs::read_to_string(repo_root().join(".ci/run")).unwrap();
    let last = ci.lines().rev().find(|l| !l.trim().is_empty()).unwrap();
    assert_eq!(
        last.trim(),
        cmds[1],
        ".ci/run must end with README's test command"
    );
    assert!(
        !ci.contains("cargo install --locked cargo-nextest"),
        "CI must not install nextest itself, or it would hide a README command that cannot"
    );

    // A machine without cargo-nextest: a `cargo` that knows no `nextest` until it has been
    // installed, logging every call.
    let fake = tempfile::tempdir().unwrap();
    let log = fake.path().join("log");
    let cargo = fake.path().join("cargo");
    std::fs::write(
        &cargo,
        format!(
            "#!/bin/sh\necho \"$*\" >> {log}\nif [ \"$1\" = install ]; then touch {dir}/nextest; exit 0; fi\n\
             if [ \"$1\" = nextest ] && [ ! -e {dir}/nextest ]; then echo 'error: no such command: `nextest`' >&2; exit 101; fi\nexit 0\n",
            log = log.display(),
            dir = fake.path().display()
        ),
    )
    .unwrap();
    Command::new("chmod")
        .arg("755")
        .arg(&cargo)
        .status()
        .unwrap();
    let path = format!(
        "{}:{}",
        fake.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/test.sh"))
        .env("PATH", path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scripts/test.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let calls: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(
        calls,
        [
            "nextest --version",
            "install --locked cargo-nextest",
            "nextest run --workspace --no-fail-fast",
        ],
        "what scripts/test.sh ran"
    );
}
