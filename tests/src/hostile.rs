//! Acting as a hostile local user: another uid (`nobody`, through `setpriv`) running plain
//! tools against our services.

use std::process::Command;

/// The uid a hostile local user has here.
pub const NOBODY: u32 = 65534;

/// Run `argv` as `uid` (primary group the same number, no supplementary groups).
pub fn as_user(uid: u32, argv: &[&str]) -> std::process::Output {
    Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .args(argv)
        .output()
        .expect("running setpriv (util-linux)")
}

/// `curl` run as `uid` with `args`: the HTTP status and the body. Panics when curl itself
/// fails (no connection), since every caller expects an HTTP answer.
pub fn curl_as(uid: u32, args: &[&str]) -> (u16, String) {
    let mut argv = vec!["curl", "-s", "-w", "\n%{http_code}"];
    argv.extend_from_slice(args);
    let out = as_user(uid, &argv);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "curl {args:?} as uid {uid} failed: {} {}",
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (
        code.trim().parse().unwrap_or_else(|_| panic!("{text}")),
        body.to_string(),
    )
}
