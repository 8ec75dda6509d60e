//! An AGLX client written independently in Python (tests/aglx_client.py) talks to the
//! `aglx-bridge` daemon binary.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn independent_python_client_talks_to_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("zone.key");
    std::fs::write(&key, "py-test-zone-key-0123456789\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_aglx-bridge"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--udp",
            "127.0.0.1:0",
            "--key-file",
        ])
        .arg(format!("py.test={}", key.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let daemon = Daemon(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    // "aglx-bridge listening tcp=127.0.0.1:P udp=127.0.0.1:Q tls=off"
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
            .to_string()
    };
    let (tcp, udp) = (field("tcp="), field("udp="));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/aglx_client.py");
    let out = Command::new("python3")
        .arg(script)
        .args([&tcp, &udp])
        .arg(&key)
        .output()
        .expect("python3 must be installed (CI installs it)");
    drop(daemon);
    assert!(
        out.status.success(),
        "python client failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("all checks passed"));
}
