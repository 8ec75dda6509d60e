//! git's fsmonitor hook for the tests: what `awcp-ctl fsmonitor` runs (the tests drive the
//! Executor in-process, where the running binary is the test itself).

fn main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let version = args.next().unwrap_or_default();
    let token = args.next().unwrap_or_default();
    match awcpfs::fsmonitor::query(std::path::Path::new("."), &version, &token) {
        Ok(answer) => {
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            if out.write_all(&answer).and_then(|_| out.flush()).is_err() {
                return std::process::ExitCode::from(1);
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("awcp-test-fsmonitor: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
