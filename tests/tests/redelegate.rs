//! Delegating an unchanged workspace again: the Delegator checks the walk it kept from an
//! earlier delegation (one `fstatat` per entry) and serves that walk's entries as they were
//! encoded, instead of walking and encoding the tree anew. A change made between two
//! delegations must show on the second mount all the same.

use std::path::Path;
use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, fuse_available, sh};

/// What a tree looks like: every path with its type, mode and link target, then every
/// file's content digest (the same command on the mount and on the Delegator's tree).
const VIEW: &str = "{ find . -printf '%p %y %m %l\\n'; find . -type f -exec md5sum {} +; } \
                    | LC_ALL=C sort";

/// Longer than the export's racy window: a walk is kept only when every entry it saw had
/// settled that long before it began.
const SETTLE: Duration = Duration::from_millis(2_500);

fn workspace(ws: &Path) {
    sh(
        ws,
        "mkdir -p src/deep docs && echo 'fn a() {}' > src/a.rs && seq 1 5000 > src/deep/big.txt \
         && echo readme > README && echo doc > docs/guide.md && ln -s a.rs src/link",
    );
}

/// Delegate `ws` and return what its agent saw.
async fn delegation_view(h: &Harness, ws: &Path, out: &Path) -> String {
    let id = h.delegate(ws, AccessMode::Ro, 300).await;
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    std::fs::read_to_string(out.join(&id)).expect("the agent wrote its view")
}

// Every kind of change between two delegations of a tree whose walk was kept: the second
// mount shows the tree as changed, not the kept walk (a stale encoded manifest served for a
// changed tree would show the first delegation's view).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_between_two_delegations_shows_on_the_second_mount() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let agent = format!("{VIEW} > {}/$AWCP_DELEGATION_ID", out.display());
    let h = Harness::start(&agent).await;
    type Change = fn(&Path);
    let changes: &[(&str, Change)] = &[
        ("edit, same size", |ws| {
            std::fs::write(ws.join("src/a.rs"), "fn b() {}\n").unwrap()
        }),
        ("add a file", |ws| {
            std::fs::write(ws.join("src/deep/new.rs"), "new\n").unwrap()
        }),
        ("delete a file", |ws| {
            std::fs::remove_file(ws.join("docs/guide.md")).unwrap()
        }),
        ("chmod a file", |ws| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(ws.join("README"), std::fs::Permissions::from_mode(0o755))
                .unwrap()
        }),
    ];
    for (i, (what, change)) in changes.iter().enumerate() {
        let ws = tmp.path().join(format!("ws{i}"));
        std::fs::create_dir_all(&ws).unwrap();
        workspace(&ws);
        tokio::time::sleep(SETTLE).await;
        let before = sh(&ws, VIEW);
        // The first delegation walks the tree and keeps the walk; the second takes it.
        for n in 1..=2 {
            let seen = delegation_view(&h, &ws, &out).await;
            assert_eq!(seen, before, "{what}: delegation {n} of the unchanged tree");
        }
        change(&ws);
        let after = sh(&ws, VIEW);
        assert_ne!(after, before, "{what}: the change changes the view");
        let seen = delegation_view(&h, &ws, &out).await;
        assert_eq!(seen, after, "{what}: the delegation after the change");
    }
    h.stop().await;
}
