//! AECP follows every resource of a delegation (issue 33): each resource's mount is a worker
//! of its own directory's workspace — the first's worker id is the delegation id, the n-th's
//! `<id>.<n>` (its export's id). Two resources, a contract in each: each mount gets its own
//! stub, its own screen (a mismatching module held in each, with its own report), and the
//! findings of its own workspace only; each has its own socket.

use std::path::Path;
use std::time::Duration;

use awcp_ctl::daemon::aecp::{DeclareRequest, PublishRequest};
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, eventually, fuse_available};

const WAIT: Duration = Duration::from_secs(60);

fn violations_on(mount: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(mount.join(".aecp/violations"))
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

fn inbox_on(mount: &Path) -> String {
    std::fs::read_to_string(mount.join(".aecp/inbox")).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_resource_of_a_delegation_has_its_contracts_screen_and_findings() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("sleep 600").await;
    let (one, two) = (h.path("one"), h.path("two"));
    for dir in [&one, &two] {
        std::fs::create_dir_all(dir.join("pkg")).unwrap();
        std::fs::write(dir.join("pkg/__init__.py"), "").unwrap();
    }
    let id = h
        .delegate_resources(
            &[("one", &one, AccessMode::Rw), ("two", &two, AccessMode::Rw)],
            600,
        )
        .await;
    let work = h.mountpoint(&id);
    let (m1, m2) = (work.join("one"), work.join("two"));
    for m in [&m1, &m2] {
        assert!(
            eventually(WAIT, || m.join("pkg/__init__.py").exists()).await,
            "{} not mounted",
            m.display()
        );
    }
    let (w1, w2) = (id.clone(), format!("{id}.1"));

    // A contract in each, declared as that resource's worker: each stub in its own place.
    for (w, f) in [(&w1, "open_account"), (&w2, "close_account")] {
        let r = h
            .client
            .aecp_declare(
                &DeclareRequest {
                    worker: w.clone(),
                    module: "pkg/acct.py".into(),
                    interface: Some(format!("def {f}(owner: str) -> int: ...\n")),
                    contract: None,
                },
                false,
            )
            .await
            .unwrap_or_else(|e| panic!("declare as {w}: {e}"));
        assert_eq!(r.revision, 1, "each workspace has its own contract");
    }
    for (m, src, f) in [(&m1, &one, "open_account"), (&m2, &two, "close_account")] {
        assert!(
            std::fs::read_to_string(src.join("pkg/acct.py")).is_ok_and(|t| t.contains(f)),
            "the stub of {f} is not in {}",
            src.display()
        );
        assert!(
            eventually(WAIT, || std::fs::read_to_string(m.join("pkg/acct.py"))
                .is_ok_and(|t| t.contains(f)))
            .await,
            "the stub of {f} never reached {}",
            m.display()
        );
        let contract =
            std::fs::read_to_string(m.join(".aecp/contracts/pkg/acct.py")).unwrap_or_default();
        assert!(contract.contains(f), "{}: {contract}", m.display());
    }

    // A mismatching module in each: both held, each reported to its own worker.
    std::fs::write(
        m1.join("pkg/acct.py"),
        "def open_account(name: str) -> int:\n    return 1\n",
    )
    .unwrap();
    std::fs::write(
        m2.join("pkg/acct.py"),
        "def close_account(name: str) -> int:\n    return 2\n",
    )
    .unwrap();
    for (m, f) in [(&m1, "open_account"), (&m2, "close_account")] {
        assert!(
            eventually(WAIT, || violations_on(m)
                .iter()
                .any(|v| v["module"] == "pkg/acct.py"
                    && v["violation"]["held"] == true
                    && v["violation"]["violations"][0]["symbol"] == f))
            .await,
            "{} was not held on {}: {:?}",
            f,
            m.display(),
            violations_on(m)
        );
    }
    for src in [&one, &two] {
        assert!(
            std::fs::read_to_string(src.join("pkg/acct.py"))
                .unwrap()
                .contains("__aecp_stub__"),
            "a held module reached {}",
            src.display()
        );
    }
    for (w, f) in [(&w1, "open_account"), (&w2, "close_account")] {
        let listed = h.client.aecp_violations(w, false).await.unwrap();
        assert_eq!(listed.len(), 1, "{w}: {listed:?}");
        assert_eq!(listed[0].worker, *w);
        assert_eq!(listed[0].report["violations"][0]["symbol"], f);
    }

    // A finding in each workspace reaches that workspace's mount only.
    for (w, claim) in [(&w1, "one's init is empty"), (&w2, "two's init is empty")] {
        h.client
            .aecp_publish(&PublishRequest {
                worker: w.clone(),
                claim: claim.into(),
                scope: "file:pkg/__init__.py".into(),
                witness: None,
            })
            .await
            .unwrap_or_else(|e| panic!("publish as {w}: {e}"));
    }
    for (m, mine, other) in [
        (&m1, "one's init is empty", "two's init is empty"),
        (&m2, "two's init is empty", "one's init is empty"),
    ] {
        assert!(
            eventually(WAIT, || std::fs::read(m.join("pkg/__init__.py")).is_ok()
                && inbox_on(m).contains(mine))
            .await,
            "{} never received {mine:?}: {}",
            m.display(),
            inbox_on(m)
        );
        assert!(!inbox_on(m).contains(other), "{}", inbox_on(m));
    }
    let listed = h.client.aecp_list(&w2).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].producer, w2);

    // Each resource's mount has its own socket in the agent's directory.
    let agents = h.path("executor/agents").join(&id);
    for sock in ["aecp.sock", "aecp-two.sock"] {
        assert!(
            eventually(WAIT, || agents.join(sock).exists()).await,
            "no {sock} in {}",
            agents.display()
        );
    }

    h.client.revoke(&id, false).await.unwrap();
    h.stop().await;
}
