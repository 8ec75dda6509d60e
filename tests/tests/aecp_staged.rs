//! Staged and discarded change sets are screened like live write-backs (issue 33).
//!
//! A producer (a live worker of the workspace) declares a contract; then a second worker, in
//! a snapshot mode that keeps a change set, writes the module.
//!
//! * `staged`: the worker writes a module that breaks its contract. Its commit is screened
//!   and reported to it as a live write-back's would be; applying the snapshot holds that
//!   file with the live write-back's reason (the rest applies), and the file stays staged;
//!   the producer's revision that the held module keeps releases it, and the next apply
//!   writes it.
//! * `discard`: the worker sees the same report while it works; once the change set is
//!   discarded nothing of it is left behind — no report, no held content (a revision then
//!   writes its stub as usual instead of releasing anything).

use std::path::Path;
use std::time::Duration;

use awcp_ctl::client::DaemonClient;
use awcp_ctl::daemon::aecp::{DeclareRequest, StubOutcome};
use awcp_protocol::api::{DelegateRequest, SnapshotMode, SnapshotStatus};
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available};

const WAIT: Duration = Duration::from_secs(60);

const IMPLEMENTATION: &str = "def open_account(name: str) -> int:\n    return len(name)\n";

/// The sentence a live write-back of [`IMPLEMENTATION`] is held with (revision 1 declares
/// `owner`).
const REASON: &str = "held by the AECP contract of pkg/acct.py (revision 1): verdict mismatch: \
                      open_account (parameters, line 1)";

fn declare(worker: &str, iface: &str) -> DeclareRequest {
    DeclareRequest {
        worker: worker.to_owned(),
        module: "pkg/acct.py".into(),
        interface: Some(iface.to_owned()),
        contract: None,
    }
}

/// An agent that waits for its script, runs it, and ends when the test says so.
fn agent(dir: &Path) -> String {
    let dir = dir.display();
    format!(
        "while [ ! -f {dir}/go-$AWCP_DELEGATION_ID ]; do sleep 0.1; done; \
         . {dir}/go-$AWCP_DELEGATION_ID; \
         while [ ! -f {dir}/stop-$AWCP_DELEGATION_ID ]; do sleep 0.1; done"
    )
}

/// A producer: a live worker of `ws` that declares the contract (its stub is then in the
/// workspace, and in the manifest of every delegation made after).
async fn producer(h: &Harness, ws: &Path) -> String {
    let p = h.delegate(ws, AccessMode::Rw, 600).await;
    assert!(
        eventually(WAIT, || h.mountpoint(&p).join("pkg/__init__.py").exists()).await,
        "the producer's mount is not up"
    );
    h.client
        .aecp_declare(
            &declare(&p, "def open_account(owner: str) -> int: ...\n"),
            false,
        )
        .await
        .expect("declare");
    assert!(
        std::fs::read_to_string(ws.join("pkg/acct.py")).is_ok_and(|t| t.contains("__aecp_stub__")),
        "no stub in the workspace"
    );
    p
}

/// Delegates `ws` in `mode` (a snapshot mode whose export keeps a change set), waits for
/// the contract's stub on the mount, and has the agent write [`IMPLEMENTATION`] over it
/// (and one unrelated file).
async fn delegate_and_write(h: &Harness, out: &Path, ws: &Path, mode: SnapshotMode) -> String {
    let req = DelegateRequest {
        snapshot_mode: Some(mode),
        ..h.request(&[("workspace", ws, AccessMode::Rw)], 600)
    };
    let id = h
        .client
        .delegate(&req)
        .await
        .expect("delegate")
        .delegation_id
        .as_str()
        .to_string();
    let mount = h.mountpoint(&id);
    assert!(
        eventually(WAIT, || std::fs::read_to_string(mount.join("pkg/acct.py"))
            .is_ok_and(|t| t.contains("__aecp_stub__")))
        .await,
        "the stub is not on the mount"
    );
    std::fs::write(
        out.join(format!("go-{id}")),
        format!("printf '%s' '{IMPLEMENTATION}' > pkg/acct.py\necho notes > notes.txt\n"),
    )
    .unwrap();
    id
}

/// The worker's reports, as `awcp-ctl aecp violations` lists them.
async fn reports(client: &DaemonClient, id: &str) -> Vec<serde_json::Value> {
    client
        .aecp_violations(id, false)
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.report)
        .collect()
}

/// The lines of the mount's `.aecp/violations`.
fn violations_on(mount: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(mount.join(".aecp/violations"))
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

fn held_report(v: &serde_json::Value) -> bool {
    v["module"] == "pkg/acct.py"
        && v["violation"]["held"] == true
        && v["violation"]["violations"][0]["symbol"] == "open_account"
}

async fn pending(client: &DaemonClient, id: &str) -> Vec<awcp_protocol::api::EnvironmentSnapshot> {
    client
        .snapshots(id)
        .await
        .unwrap()
        .snapshots
        .into_iter()
        .filter(|s| s.status == SnapshotStatus::Pending)
        .collect()
}

/// A workspace with a contract declared by a live producer `p`, and a delegation `id` in
/// `mode` whose agent wrote a module that breaks it.
struct Setup {
    out: tempfile::TempDir,
    h: Harness,
    ws: std::path::PathBuf,
    p: String,
    id: String,
    mount: std::path::PathBuf,
}

async fn setup(mode: SnapshotMode) -> Setup {
    let out = tempfile::tempdir().unwrap();
    let h = Harness::start(&agent(out.path())).await;
    let ws = h.path("ws");
    std::fs::create_dir_all(ws.join("pkg")).unwrap();
    std::fs::write(ws.join("pkg/__init__.py"), "").unwrap();
    let p = producer(&h, &ws).await;
    let id = delegate_and_write(&h, out.path(), &ws, mode).await;
    let mount = h.mountpoint(&id);
    Setup {
        out,
        h,
        ws,
        p,
        id,
        mount,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_staged_module_breaking_its_contract_is_held_at_apply_until_the_fix() {
    if !fuse_available() {
        return;
    }
    let Setup {
        out,
        h,
        ws,
        p,
        id,
        mount,
    } = setup(SnapshotMode::Staged).await;

    // The staged commit is screened and reported like a live write-back.
    assert!(
        eventually(WAIT, || violations_on(&mount).iter().any(held_report)).await,
        "the worker was not told its staged module breaks the contract: {:?}",
        violations_on(&mount)
    );
    std::fs::write(out.path().join(format!("stop-{id}")), "").unwrap();
    h.wait_end(&id, WAIT).await;
    let listed = reports(&h.client, &id).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["held"], true, "{listed:?}");

    // Applying holds that file with the live write-back's reason; the rest lands.
    let snaps = pending(&h.client, &id).await;
    assert_eq!(snaps.len(), 1, "{snaps:#?}");
    let r = h.client.apply(&id, &snaps[0].id).await.expect("apply");
    assert_eq!(r.report.held.len(), 1, "{:#?}", r.report);
    let held = &r.report.held[0];
    assert_eq!(held.path, "workspace/pkg/acct.py");
    assert!(held.reason.starts_with(REASON), "{}", held.reason);
    assert_eq!(
        held.report.as_ref().unwrap()["violations"][0]["constraint"],
        "parameters"
    );
    assert!(
        !r.report
            .written
            .contains(&"workspace/pkg/acct.py".to_string()),
        "{:#?}",
        r.report
    );
    assert!(
        r.report
            .written
            .contains(&"workspace/notes.txt".to_string()),
        "{:#?}",
        r.report
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("notes.txt")).unwrap(),
        "notes\n"
    );
    assert!(
        std::fs::read_to_string(ws.join("pkg/acct.py"))
            .unwrap()
            .contains("__aecp_stub__"),
        "the held module reached the Delegator"
    );
    // The held file is still staged: the next snapshot holds it alone.
    let next = pending(&h.client, &id).await;
    assert_eq!(next.len(), 1, "{next:#?}");
    assert_ne!(next[0].id, snaps[0].id);
    let changed = next[0]
        .metadata
        .as_ref()
        .and_then(|m| m.changed_files.clone())
        .unwrap_or_default();
    assert_eq!(changed, ["pkg/acct.py"], "{next:#?}");
    // Applying again without a fix holds it again.
    let again = h.client.apply(&id, &next[0].id).await.expect("apply");
    assert_eq!(again.report.held.len(), 1, "{:#?}", again.report);
    let next = pending(&h.client, &id).await;
    assert_eq!(next.len(), 1, "{next:#?}");

    // The fix: the producer revises the contract to what it wrote. The held module keeps
    // it and is released (the stub is left for it), and the next apply writes it.
    let revised = h
        .client
        .aecp_declare(
            &declare(&p, "def open_account(name: str) -> int: ...\n"),
            true,
        )
        .await
        .expect("revise");
    assert_eq!(revised.stub, StubOutcome::ReleasedImplementation);
    assert!(reports(&h.client, &id).await.is_empty(), "still reported");
    let r = h.client.apply(&id, &next[0].id).await.expect("apply");
    assert!(r.report.held.is_empty(), "{:#?}", r.report);
    assert!(r.report.conflicts.is_empty(), "{:#?}", r.report);
    assert!(
        r.report
            .written
            .contains(&"workspace/pkg/acct.py".to_string()),
        "{:#?}",
        r.report
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("pkg/acct.py")).unwrap(),
        IMPLEMENTATION
    );
    assert!(pending(&h.client, &id).await.is_empty());
    let on: Vec<String> = h
        .client
        .aecp_audit(&id)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "verdict")
        .map(|e| e.detail["verdict"]["on"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(on.iter().any(|o| o == "revision"), "{on:?}");
    h.client.revoke(&p, false).await.unwrap();
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_discarded_change_set_leaves_no_report_or_held_content_behind() {
    if !fuse_available() {
        return;
    }
    let Setup {
        out,
        h,
        ws,
        p,
        id,
        mount,
    } = setup(SnapshotMode::Discard).await;

    // Screened while the worker works, as a live write-back is.
    assert!(
        eventually(WAIT, || violations_on(&mount).iter().any(held_report)).await,
        "the worker was not told its module breaks the contract: {:?}",
        violations_on(&mount)
    );
    assert_eq!(reports(&h.client, &id).await.len(), 1);

    // The delegation ends; its change set is discarded, and its reports with it.
    std::fs::write(out.path().join(format!("stop-{id}")), "").unwrap();
    h.wait_end(&id, WAIT).await;
    let list = h.client.snapshots(&id).await.unwrap().snapshots;
    assert!(
        list.iter().all(|s| s.status == SnapshotStatus::Discarded),
        "{list:#?}"
    );
    let start = std::time::Instant::now();
    while !reports(&h.client, &id).await.is_empty() {
        assert!(
            start.elapsed() < WAIT,
            "a discarded change set left its report behind: {:?}",
            reports(&h.client, &id).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // No held content either: a revision has nothing to release and writes its stub.
    let revised = h
        .client
        .aecp_declare(
            &declare(&p, "def open_account(name: str) -> int: ...\n"),
            true,
        )
        .await
        .expect("revise");
    assert_eq!(revised.stub, StubOutcome::Written);
    let stub = std::fs::read_to_string(ws.join("pkg/acct.py")).unwrap();
    assert!(
        stub.contains("__aecp_stub__") && stub.contains("name: str"),
        "{stub}"
    );
    assert!(!ws.join("notes.txt").exists(), "discard applied something");
    assert!(reports(&h.client, &id).await.is_empty());
    h.client.revoke(&p, false).await.unwrap();
    h.stop().await;
}
