//! One workspace to many Executors: `delegate --to A --to B …` (or `--to-file FILE`), and
//! the views across the delegations it made — `status ID ID …` (one line each and the
//! totals) and `wait ID ID …` (until every one has ended; the exit code is the worst).
//!
//! A fleet is the list of its delegation ids: the daemon keeps no fleet of its own, so the
//! ids printed by `delegate` are all a later `status` or `wait` needs, on any daemon of a
//! shared database.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use awcp_ctl::client::DaemonClient;
use awcp_ctl::daemon::api::DelegationView;
use awcp_protocol::DelegationState;
use awcp_protocol::api::DelegateRequest;

/// The Executors of `--to` and `--to-file`, in order, each once. `auto` (an AGLX pick) only
/// as the one `--to`.
pub(super) fn executors(to: &[String], to_file: Option<&Path>) -> anyhow::Result<Vec<String>> {
    let mut all: Vec<String> = to.iter().map(|s| s.trim().to_string()).collect();
    if let Some(f) = to_file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("reading --to-file {}", f.display()))?;
        all.extend(parse_list(&text));
    }
    anyhow::ensure!(
        !all.is_empty(),
        "no Executor to delegate to: give --to URL (repeatable) or --to-file FILE (one URL a line)"
    );
    if all.iter().any(|t| t == "auto") {
        anyhow::ensure!(
            all.len() == 1,
            "--to auto picks one Executor: it cannot be combined with other --to or --to-file"
        );
        return Ok(all);
    }
    let mut seen = std::collections::HashSet::new();
    for t in &all {
        anyhow::ensure!(
            seen.insert(t.as_str()),
            "Executor {t} is named twice: a fleet delegates the workspace once to each Executor \
             (an Executor runs one agent per delegation; name it once)"
        );
    }
    Ok(all)
}

/// The lines of a `--to-file`: one Executor URL a line; blank lines and `#` comments skipped.
fn parse_list(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// Delegate `reqs` (one per Executor) at once. Prints each outcome; returns the ids of
/// those that were accepted. Some refusing does not stop the others.
pub(super) async fn delegate_all(
    client: &DaemonClient,
    reqs: Vec<DelegateRequest>,
    dir: &Path,
    json: bool,
) -> (Vec<String>, usize) {
    let calls = reqs.iter().map(|r| client.delegate(r));
    let answers = futures::future::join_all(calls).await;
    let mut ids = Vec::new();
    let mut failed = 0;
    for (req, a) in reqs.iter().zip(answers) {
        let to = &req.executor_url;
        match a {
            Ok(r) => {
                let id = r.delegation_id.as_str().to_string();
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"delegationId": id, "executorUrl": to})
                    );
                } else {
                    println!("delegated {} to {to} as {id}", dir.display());
                }
                ids.push(id);
            }
            Err(e) => {
                failed += 1;
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"executorUrl": to, "error": format!("{e:#}")})
                    );
                } else {
                    eprintln!("error: delegating to {to}: {e:#}");
                }
            }
        }
    }
    if !json && ids.len() > 1 {
        println!(
            "fleet of {}: `awcp-ctl status {}` shows them all, `awcp-ctl wait …` waits for all",
            ids.len(),
            ids.join(" ")
        );
    }
    (ids, failed)
}

fn num(v: &Option<serde_json::Value>, k: &str) -> u64 {
    v.as_ref()
        .and_then(|t| t.get(k))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

/// `status ID ID …`: one line per delegation and the totals; `--json`: each
/// `GET /delegation/:id` per line, then `{"fleet":{…totals}}`.
pub(super) async fn status(
    client: &DaemonClient,
    ids: &[String],
    json: bool,
) -> anyhow::Result<ExitCode> {
    let views = futures::future::join_all(ids.iter().map(|id| client.get(id))).await;
    let mut missing = 0;
    let (mut served, mut written, mut files, mut conflicts) = (0u64, 0u64, 0u64, 0u64);
    let mut by_state: std::collections::BTreeMap<&'static str, usize> = Default::default();
    if !json {
        println!(
            "{:<37} {:<10} {:<32} {:>10} {:>12} {:>14} OWNER",
            "ID", "STATE", "EXECUTOR", "LEASE LEFT", "BYTES READ", "WRITTEN BACK"
        );
    }
    for (id, v) in ids.iter().zip(views) {
        let v: DelegationView = match v {
            Ok(v) => v,
            Err(e) => {
                missing += 1;
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"delegationId": id, "error": format!("{e:#}")})
                    );
                } else {
                    println!("{id:<37} {:<10} {e:#}", "?");
                }
                continue;
            }
        };
        let state = v.record.state;
        *by_state.entry(state.as_str()).or_default() += 1;
        let read = num(&v.transfer, "bytesServed");
        served += read;
        written += num(&v.transfer, "bytesWritten");
        files += num(&v.transfer, "filesWritten");
        conflicts += num(&v.transfer, "conflicts");
        if json {
            println!("{}", serde_json::to_string(&v)?);
        } else {
            let left = if state.is_terminal() {
                "-".to_string()
            } else {
                format!("{}s", v.lease.remaining_ms / 1000)
            };
            println!(
                "{:<37} {:<10} {:<32} {:>10} {:>12} {:>14} {}",
                id,
                state.as_str(),
                v.record.peer_url,
                left,
                read,
                format!(
                    "{}f/{}B",
                    num(&v.transfer, "filesWritten"),
                    num(&v.transfer, "bytesWritten")
                ),
                v.owner.as_deref().unwrap_or("-")
            );
        }
    }
    if json {
        println!(
            "{}",
            serde_json::json!({"fleet": {
                "delegations": ids.len(), "unknown": missing, "states": by_state,
                "bytesServed": served, "filesWritten": files, "bytesWritten": written,
                "conflicts": conflicts,
            }})
        );
    } else {
        let states: Vec<String> = by_state.iter().map(|(s, n)| format!("{n} {s}")).collect();
        println!(
            "total: {} delegation(s): {}{}; {served} bytes served, {files} file(s) ({written} bytes) written back, {conflicts} conflict(s)",
            ids.len(),
            states.join(", "),
            if missing > 0 {
                format!(", {missing} unknown")
            } else {
                String::new()
            }
        );
    }
    Ok(if missing > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// How bad an end is, for the exit code of a fleet: the worst one counts.
fn severity(state: DelegationState) -> u8 {
    match state {
        DelegationState::Completed => 0,
        DelegationState::Cancelled => 1,
        DelegationState::Expired => 2,
        _ => 3,
    }
}

/// `wait ID ID …` (and `delegate --to A --to B --wait`): until every delegation has ended
/// (or `limit` passed: exit 1), printing each end as it comes. The exit code is that of the
/// worst end (as `delegate --wait`: 0 completed, 3 cancelled, 4 expired, 5 error).
pub(super) async fn wait(
    client: &DaemonClient,
    ids: &[String],
    json: bool,
    limit: Option<Duration>,
) -> anyhow::Result<ExitCode> {
    let start = Instant::now();
    let mut open: Vec<String> = ids.to_vec();
    let mut worst: Option<DelegationState> = None;
    while !open.is_empty() {
        let views = futures::future::join_all(open.iter().map(|id| client.get(id))).await;
        let mut still = Vec::new();
        for (id, v) in open.iter().zip(views) {
            let v = v.with_context(|| format!("following {id}"))?;
            let state = v.record.state;
            if !state.is_terminal() {
                still.push(id.clone());
                continue;
            }
            if json {
                println!(
                    "{}",
                    serde_json::json!({"delegationId": id, "state": state.as_str(),
                        "bytesServed": num(&v.transfer, "bytesServed"),
                        "filesWritten": num(&v.transfer, "filesWritten")})
                );
            } else {
                println!(
                    "{id} {} ({} bytes served, {} file(s) written back)",
                    state.as_str(),
                    num(&v.transfer, "bytesServed"),
                    num(&v.transfer, "filesWritten")
                );
            }
            if worst.is_none_or(|w| severity(state) > severity(w)) {
                worst = Some(state);
            }
        }
        open = still;
        if open.is_empty() {
            break;
        }
        if limit.is_some_and(|l| start.elapsed() > l) {
            eprintln!(
                "still running after {:?}: {} (`awcp-ctl status {}`)",
                limit.unwrap_or_default(),
                open.join(" "),
                open.join(" ")
            );
            return Ok(ExitCode::from(1));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(worst.map_or(ExitCode::SUCCESS, super::exit_for))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn executor_lists() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("fleet.txt");
        std::fs::write(
            &f,
            "# the fleet\nhttp://a:7200/awcp\n\n  http://b:7200/awcp  # second\n",
        )
        .unwrap();
        let to = vec!["http://c:7200/awcp".to_string()];
        assert_eq!(
            executors(&to, Some(&f)).unwrap(),
            [
                "http://c:7200/awcp",
                "http://a:7200/awcp",
                "http://b:7200/awcp"
            ]
        );
        let twice = vec!["http://a:7200/awcp".to_string()];
        let e = executors(&twice, Some(&f)).unwrap_err().to_string();
        assert!(e.contains("named twice"), "{e}");
        let e = executors(&["auto".into(), "http://a/awcp".into()], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--to auto"), "{e}");
        assert!(executors(&[], None).is_err());
        assert!(executors(&[], Some(&dir.path().join("absent"))).is_err());
    }

    #[test]
    fn the_worst_end_decides() {
        assert!(severity(DelegationState::Error) > severity(DelegationState::Expired));
        assert!(severity(DelegationState::Expired) > severity(DelegationState::Cancelled));
        assert!(severity(DelegationState::Cancelled) > severity(DelegationState::Completed));
    }
}
