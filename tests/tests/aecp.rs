//! AECP end to end (issue 19): two Executors mount one workspace (two workers); worker A
//! publishes a witnessed finding about `pkg/a.py`; worker B receives it at the point of use
//! — opening `pkg/a.py` — through `.aecp/inbox`, the `user.aecp.findings` attribute and its
//! delivery socket; the code changes so the witness fails, B flags it, the witness re-runs
//! in B's mount and refutes it, and it is never delivered again.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aecp_hooks::knowledge::{Delivery, Witness, WitnessStatus};
use awcp_ctl::daemon::aecp::{FlagRequest, PublishRequest};
use awcp_ctl::executor::ExecutorConfig;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available, request};

const WAIT: Duration = Duration::from_secs(60);

fn read_lines(path: &Path) -> Vec<Delivery> {
    std::fs::read(path)
        .unwrap_or_default()
        .split(|c| *c == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("every line is one delivery"))
        .collect()
}

fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 64 * 1024];
    match rustix::fs::getxattr(path, name, &mut buf[..]) {
        Ok(n) => Some(buf[..n].to_vec()),
        Err(e) => {
            assert_eq!(e, rustix::io::Errno::NODATA, "getxattr {name}: {e}");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_finding_reaches_the_other_worker_at_the_point_of_use_until_refuted() {
    finding_reaches_the_point_of_use(false).await;
}

/// Under the kernel's writeback cache the kernel keeps a cached file's size over the
/// mount's: `.aecp/inbox` must still show each delivery at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wbcache_a_finding_reaches_the_other_worker_at_the_point_of_use_until_refuted() {
    finding_reaches_the_point_of_use(true).await;
}

async fn finding_reaches_the_point_of_use(writeback_cache: bool) {
    if !fuse_available() {
        return;
    }
    // The agents only keep their mounts alive; the test plays both agents.
    let h = Harness::start_with("sleep 600", |c| c.writeback_cache = writeback_cache).await;
    let mut cfg_b = ExecutorConfig::new("sleep 600".into(), h.path("executor-b"));
    cfg_b.listen = "127.0.0.1:0".parse().unwrap();
    cfg_b.writeback_cache = writeback_cache;
    // One operator's two Executors, one credential (the daemon presents it to both).
    cfg_b.token = Some(h.credential());
    let executor_b = awcp_ctl::executor::start(cfg_b).await.unwrap();

    let ws = h.path("ws");
    std::fs::create_dir_all(ws.join("pkg")).unwrap();
    std::fs::write(ws.join("pkg/__init__.py"), "").unwrap();
    std::fs::write(
        ws.join("pkg/a.py"),
        "LIMIT = 10\n\ndef parse(s):\n    return s[:LIMIT]\n",
    )
    .unwrap();
    std::fs::write(ws.join("pkg/b.py"), "from pkg.a import parse\n").unwrap();

    let a = h.delegate(&ws, AccessMode::Rw, 600).await;
    let b = h
        .client
        .delegate(&request(
            executor_b.awcp_url(),
            &[("workspace", &ws, AccessMode::Rw)],
            600,
        ))
        .await
        .expect("a second rw delegation of the same directory")
        .delegation_id
        .as_str()
        .to_string();
    let mount_a = h.mountpoint(&a);
    let mount_b: PathBuf = h.path("executor-b/work").join(&b);
    assert!(
        eventually(WAIT, || mount_a.join("pkg/a.py").exists()
            && mount_b.join("pkg/a.py").exists())
        .await
    );

    // A publishes a witnessed finding; the witness runs in A's mount on A's Executor.
    let witness = Witness {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "echo AECP-READY; grep -q 'LIMIT = 10' pkg/a.py && pwd".into(),
        ],
        marker: "AECP-READY".into(),
        timeout_ms: 30_000,
    };
    let published = h
        .client
        .aecp_publish(&PublishRequest {
            worker: a.clone(),
            claim: "parse() cuts its input to LIMIT (10) characters".into(),
            scope: "symbol:pkg.a.parse".into(),
            witness: Some(witness),
        })
        .await
        .expect("publish");
    let art = published.artifact;
    assert_eq!(art.status, WitnessStatus::Checked);
    assert_eq!(
        art.bound, "pkg/a.py",
        "the symbol resolved to its defining file"
    );
    let run = published.witness.expect("the witness ran");
    assert!(
        run.output_tail.contains(&mount_a.display().to_string()),
        "ran in A's mount: {run:?}"
    );

    // B's replica learns of it over the export's event stream.
    let findings_b = mount_b.join(".aecp/findings/pkg/a.py");
    assert!(
        eventually(WAIT, || read_lines(&findings_b)
            .iter()
            .any(|d| d.id == art.id))
        .await
    );
    // Looking at `.aecp/` is not a delivery, and the tree is hidden from the root's listing.
    assert!(read_lines(&mount_b.join(".aecp/inbox")).is_empty());
    let names: Vec<String> = std::fs::read_dir(&mount_b)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n == ".aecp"), "{names:?}");

    // B's harness listens on its socket.
    let socket = h.path("executor-b/agents").join(&b).join("aecp.sock");
    assert!(
        eventually(WAIT, || socket.exists()).await,
        "no socket at {}",
        socket.display()
    );
    // As B's agent does: with B's token (the reporter has accepted the connection once
    // it confirms the hello).
    let mut stream = awcp_tests::aecp_subscribe(&socket, &executor_b.executor.aecp_token(&b));

    // The point of use: B opens pkg/a.py.
    let text = std::fs::read_to_string(mount_b.join("pkg/a.py")).unwrap();
    assert!(text.contains("LIMIT = 10"));
    let inbox = read_lines(&mount_b.join(".aecp/inbox"));
    assert_eq!(inbox.len(), 1, "{inbox:?}");
    assert_eq!(inbox[0].id, art.id);
    assert_eq!(inbox[0].status, WitnessStatus::Checked);
    assert_eq!(inbox[0].producer, a);
    assert_eq!(inbox[0].scope, "symbol:pkg.a.parse");
    let attr = xattr(&mount_b.join("pkg/a.py"), "user.aecp.findings").expect("the attribute");
    assert!(String::from_utf8_lossy(&attr).contains(&format!("\"id\":{}", art.id)));
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        stream.read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    let from_socket: Delivery = serde_json::from_str(&line).unwrap();
    assert_eq!(from_socket, inbox[0]);
    // Reading again delivers nothing new; the daemon hears of the delivery.
    std::fs::read(mount_b.join("pkg/a.py")).unwrap();
    assert_eq!(read_lines(&mount_b.join(".aecp/inbox")).len(), 1);
    let mut recorded = false;
    for _ in 0..600 {
        if h.client
            .aecp_inbox(&b)
            .await
            .unwrap()
            .iter()
            .any(|d| d.id == art.id)
        {
            recorded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(recorded, "the delivery was recorded on the Delegator");
    // The daemon's metrics count it: one delivery (to B), as the inboxes show.
    let inboxes =
        h.client.aecp_inbox(&a).await.unwrap().len() + h.client.aecp_inbox(&b).await.unwrap().len();
    let scrape = reqwest::Client::new()
        .get(format!("{}/metrics", h.daemon.url()))
        .bearer_auth(h.daemon.api_token().unwrap())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let counted: f64 = scrape
        .lines()
        .find_map(|l| l.strip_prefix("awcp_aecp_deliveries_total "))
        .unwrap_or_else(|| panic!("no awcp_aecp_deliveries_total in {scrape}"))
        .trim()
        .parse()
        .unwrap();
    assert_eq!(inboxes, 1);
    assert_eq!(counted, inboxes as f64);
    // Nothing of AECP shows in the workspace itself.
    let grep = std::process::Command::new("grep")
        .args(["-r", "-l", "LIMIT"])
        .current_dir(&mount_b)
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&grep.stdout);
    assert!(!listed.contains(".aecp"), "{listed}");

    // The code changes (B edits it) so the witness fails; B flags the finding.
    std::fs::write(
        mount_b.join("pkg/a.py"),
        "LIMIT = 20\n\ndef parse(s):\n    return s[:LIMIT]\n",
    )
    .unwrap();
    let flagged = h
        .client
        .aecp_flag(&FlagRequest {
            worker: b.clone(),
            id: art.id,
            reason: "LIMIT is 20 now".into(),
        })
        .await
        .expect("flag");
    assert_eq!(
        flagged.artifact.status,
        WitnessStatus::Refuted,
        "{:?}",
        flagged.witness
    );

    // Never delivered again: A (which never received it) opens pkg/a.py and gets nothing;
    // neither channel shows it any more.
    assert!(
        eventually(WAIT, || read_lines(&findings_b).is_empty()).await,
        "still listed for B"
    );
    // A's replica learns of the refutation over its own event stream; until it has, an
    // access to pkg/a.py on A's mount (a getxattr looks the file up again once B's write
    // has invalidated it there) would still deliver the finding. `.aecp/` is no delivery.
    let findings_a = mount_a.join(".aecp/findings/pkg/a.py");
    assert!(
        eventually(WAIT, || read_lines(&findings_a).is_empty()).await,
        "still listed for A"
    );
    assert!(
        eventually(WAIT, || xattr(
            &mount_a.join("pkg/a.py"),
            "user.aecp.findings"
        )
        .is_none())
        .await
    );
    std::fs::read(mount_a.join("pkg/a.py")).unwrap();
    assert!(
        read_lines(&mount_a.join(".aecp/inbox")).is_empty(),
        "refuted, yet delivered to A"
    );
    assert!(h.client.aecp_inbox(&a).await.unwrap().is_empty());
    // The audit log kept everything.
    let kinds: Vec<String> = h
        .client
        .aecp_audit(&a)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    for k in ["publish", "witness", "delivery", "flag", "refutation"] {
        assert!(kinds.iter().any(|x| x == k), "{k} missing from {kinds:?}");
    }

    h.client.revoke(&a, false).await.unwrap();
    h.client.revoke(&b, false).await.unwrap();
    executor_b.stop().await;
    h.stop().await;
}
