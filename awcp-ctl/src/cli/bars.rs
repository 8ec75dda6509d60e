//! Progress bars for the long parts of client commands (indicatif, on stderr).
//!
//! Shown only when stderr is a terminal and `--json` is off: piped output and JSON output
//! (one object per line on stdout) carry no progress noise. Each bar polls the daemon
//! API — the numbers come from `GET /delegate/progress/:key` while a delegation is being
//! set up, then from `GET /delegation/:id` (`progress`, `transfer`) — so a bar costs the
//! daemon nothing when nobody is watching.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use awcp_ctl::client::DaemonClient;

/// How often a bar asks the daemon.
const POLL: Duration = Duration::from_millis(150);

/// Whether bars are shown: stderr is a terminal and the output is not JSON.
pub(crate) fn wanted(json: bool) -> bool {
    !json && std::io::IsTerminal::is_terminal(&std::io::stderr())
}

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{spinner} {prefix:.bold} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta}) {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ")
}

fn spinner_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner} {prefix:.bold} {msg} ({elapsed})")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

fn new_bar(prefix: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    pb.set_style(spinner_style());
    pb.set_prefix(prefix.to_string());
    pb.enable_steady_tick(Duration::from_millis(100));
    pb
}

/// A running bar: stop it (and clear its line) with [`Bar::finish`].
pub(crate) struct Bar {
    pb: ProgressBar,
    task: tokio::task::JoinHandle<()>,
}

impl Bar {
    /// Run `f` (which prints) with the bar hidden, so lines do not mix.
    pub(crate) fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.pb.suspend(f)
    }

    /// Stop polling and clear the bar's line.
    pub(crate) fn finish(self) {
        self.task.abort();
        self.pb.finish_and_clear();
    }
}

/// `delegate`: the manifest builds (bytes hashed of the total, files in the message), then
/// the invitation and START, while `POST /delegate` with progress key `key` runs.
pub(crate) fn setup(client: &DaemonClient, key: String, what: String) -> Bar {
    let pb = new_bar("delegating");
    pb.set_message(what);
    let (c, p) = (client.clone(), pb.clone());
    let task = tokio::spawn(async move {
        let mut determinate = false;
        loop {
            tokio::time::sleep(POLL).await;
            let Ok(v) = c.setup_progress(&key).await else {
                continue;
            };
            let m = v.manifest;
            match v.phase.as_str() {
                "manifest" if !m.done => {
                    if !determinate {
                        p.set_style(bar_style());
                        p.set_prefix("manifest");
                        determinate = true;
                    }
                    p.set_length(m.bytes_total.max(1));
                    p.set_position(m.bytes_hashed);
                    p.set_message(format!(
                        "{}/{} file(s) hashed{}",
                        m.files_hashed,
                        m.files_total,
                        if m.walked { "" } else { ", still listing" }
                    ));
                }
                phase => {
                    if determinate {
                        p.set_style(spinner_style());
                        p.set_prefix("delegating");
                        determinate = false;
                    }
                    p.set_message(match phase {
                        "admission" => "checking the workspace".to_string(),
                        "invite" | "manifest" => format!(
                            "{} file(s) ({} bytes) exported; inviting the executor",
                            m.files_total, m.bytes_total
                        ),
                        _ => "starting the executor's mount".to_string(),
                    });
                }
            }
        }
    });
    Bar { pb, task }
}

/// `delegate --wait` / `watch`: how much of the workspace the Executor has pulled
/// (hydration: bytes served of the workspace's bytes) and what came back.
pub(crate) fn transfer(client: &DaemonClient, id: String) -> Bar {
    let pb = new_bar("hydrating");
    let (c, p) = (client.clone(), pb.clone());
    let task = tokio::spawn(async move {
        let mut determinate = false;
        loop {
            tokio::time::sleep(POLL.max(Duration::from_millis(500))).await;
            let Ok(v) = c.get(&id).await else { continue };
            let n = |k: &str| {
                v.transfer
                    .as_ref()
                    .and_then(|t| t.get(k))
                    .and_then(|x| x.as_u64())
                    .unwrap_or(0)
            };
            let total = v.progress.as_ref().map_or(0, |p| p.manifest.bytes_total);
            if total > 0 && !determinate {
                p.set_style(bar_style());
                determinate = true;
            }
            if determinate {
                p.set_length(total);
                // Re-fetched or rewritten content can exceed the tree's size.
                p.set_position(n("bytesServed").min(total));
            }
            p.set_message(format!(
                "{}: {} file(s) written back",
                v.record.state.as_str(),
                n("filesWritten")
            ));
        }
    });
    Bar { pb, task }
}

/// `revoke --wait` / `close --wait`: the Executor's final sync (bytes written back so
/// far; the total is known only to the Executor, so this is a counter, not a bar).
pub(crate) fn final_sync(client: &DaemonClient, id: String) -> Bar {
    let pb = new_bar("final sync");
    let (c, p) = (client.clone(), pb.clone());
    let task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(POLL).await;
            let Ok(v) = c.get(&id).await else { continue };
            let n = |k: &str| {
                v.transfer
                    .as_ref()
                    .and_then(|t| t.get(k))
                    .and_then(|x| x.as_u64())
                    .unwrap_or(0)
            };
            p.set_message(format!(
                "{} file(s), {} written back; waiting for the executor to unmount",
                n("filesWritten"),
                indicatif::HumanBytes(n("bytesWritten"))
            ));
        }
    });
    Bar { pb, task }
}
