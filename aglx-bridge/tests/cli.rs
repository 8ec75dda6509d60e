//! The `aglx-bridge` binary's command line: help that teaches, errors that say what to do.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_aglx-bridge");

#[test]
fn help_explains_subscriptions_keys_and_tls() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "handshake",
        "\"subscribe\":\"own\"",
        "--key-file <ZONE=PATH>",
        "--tls-cert",
        "--frame-timeout",
        "docs/PROTOCOL.md",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
}

#[test]
fn bad_key_files_are_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--no-udp",
            "--key-file",
            "no-equals-sign",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected ZONE=PATH"));

    let short = dir.path().join("short.key");
    std::fs::write(&short, "tiny\n").unwrap();
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--no-udp", "--key-file"])
        .arg(format!("lab={}", short.display()))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16"));

    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--name", "bridge"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("agent://name.domain"));
}
