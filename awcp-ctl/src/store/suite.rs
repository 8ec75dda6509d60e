//! One suite of store tests, instantiated for every engine with [`store_suite!`]: whatever
//! the daemon relies on (round trips, versions, the owner fence, heartbeats and the claim
//! of orphans) must hold on SQLite and PostgreSQL alike.

use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::api::DelegationRecord;

use super::{StateStore, StoreError, StoredDelegation};

/// A delegation named `name` (its id is derived from the name) in `state`.
pub(crate) fn delegation(name: &str, state: DelegationState) -> StoredDelegation {
    let hash = blake3::hash(name.as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&hash.as_bytes()[..16]);
    let id = awcp_protocol::DelegationId::from_random_bytes(bytes);
    let record: DelegationRecord = serde_json::from_value(serde_json::json!({
        "id": id.as_str(),
        "state": state,
        "peerUrl": "http://127.0.0.1:9/awcp",
        "environment": {"resources": [{"name": "workspace", "type": "fs", "source": "/tmp/x", "mode": "rw"}]},
        "task": {"description": name, "prompt": "p"},
        "leaseConfig": {"ttlSeconds": 60, "accessMode": "rw"},
        "retentionMs": 1000,
        "createdAt": crate::now_iso(),
        "updatedAt": crate::now_iso(),
    }))
    .expect("a test delegation record");
    StoredDelegation {
        record,
        export_id: format!("exp_{name}"),
        token: format!("tok_{name}"),
        source: "/tmp/x".into(),
        read_only: false,
        events: Vec::new(),
        last_event_id: None,
        transport: awcp_protocol::TransportType::Awcpfs,
        executor_token: None,
        multi_round: false,
        resources: Vec::new(),
    }
}

fn id(d: &StoredDelegation) -> &str {
    d.record.id.as_str()
}

pub(crate) fn round_trip(s: &dyn StateStore) {
    let mut d = delegation("round-trip", DelegationState::Running);
    d.last_event_id = Some("7".into());
    d.executor_token = Some("exec-secret".into());
    s.put("dmn_a", &d).unwrap();
    let row = s.get(id(&d)).unwrap().expect("the row just written");
    assert_eq!(row.owner.as_deref(), Some("dmn_a"));
    assert_eq!(
        serde_json::to_value(&row.delegation).unwrap(),
        serde_json::to_value(&d).unwrap()
    );
    assert!(
        s.get(id(&delegation("absent", DelegationState::Running)))
            .unwrap()
            .is_none()
    );
    // Replacing keeps one row.
    d.record.state = DelegationState::Completed;
    s.put("dmn_a", &d).unwrap();
    let all = s.all().unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].record.state, DelegationState::Completed);
}

pub(crate) fn all_is_oldest_first(s: &dyn StateStore) {
    let names = ["first", "second", "third"];
    let ds: Vec<_> = names
        .iter()
        .map(|n| {
            std::thread::sleep(Duration::from_millis(3));
            delegation(n, DelegationState::Running)
        })
        .collect();
    // Written newest first, and the oldest rewritten last: order is by creation.
    for d in ds.iter().rev() {
        s.put("dmn_a", d).unwrap();
    }
    s.put("dmn_a", &ds[0]).unwrap();
    let got: Vec<String> = s
        .all()
        .unwrap()
        .iter()
        .map(|d| d.record.task.description.clone())
        .collect();
    assert_eq!(got, names);
}

pub(crate) fn versions_grow_and_changed_since_sees_only_newer(s: &dyn StateStore) {
    let a = delegation("va", DelegationState::Running);
    let b = delegation("vb", DelegationState::Running);
    s.put("dmn_a", &a).unwrap();
    s.put("dmn_a", &b).unwrap();
    let va = s.get(id(&a)).unwrap().unwrap().version;
    let vb = s.get(id(&b)).unwrap().unwrap().version;
    assert!(vb > va, "versions grow: {va} then {vb}");
    assert_eq!(s.changed_since(0).unwrap().len(), 2);
    let newer = s.changed_since(va).unwrap();
    assert_eq!(newer.len(), 1);
    assert_eq!(id(&newer[0].delegation), id(&b));
    // Rewriting `a` makes it the newest.
    s.put("dmn_a", &a).unwrap();
    let newer = s.changed_since(vb).unwrap();
    assert_eq!(newer.len(), 1);
    assert_eq!(id(&newer[0].delegation), id(&a));
    assert!(s.changed_since(newer[0].version).unwrap().is_empty());
}

pub(crate) fn another_daemon_cannot_overwrite(s: &dyn StateStore) {
    let mut d = delegation("fenced", DelegationState::Running);
    s.put("dmn_a", &d).unwrap();
    d.record.state = DelegationState::Cancelled;
    match s.put("dmn_b", &d) {
        Err(StoreError::NotOwner { id: got, owner }) => {
            assert_eq!(got, id(&d));
            assert_eq!(owner, "dmn_a");
        }
        other => panic!("expected NotOwner, got {other:?}"),
    }
    let row = s.get(id(&d)).unwrap().unwrap();
    assert_eq!(row.delegation.record.state, DelegationState::Running);
    assert_eq!(row.owner.as_deref(), Some("dmn_a"));
}

pub(crate) fn heartbeats_are_listed(s: &dyn StateStore) {
    s.heartbeat("dmn_a", "http://127.0.0.1:1").unwrap();
    s.heartbeat("dmn_b", "http://127.0.0.1:2").unwrap();
    s.heartbeat("dmn_a", "http://127.0.0.1:3").unwrap();
    let ds = s.daemons().unwrap();
    assert_eq!(ds.len(), 2);
    assert_eq!(ds[0].id, "dmn_a");
    assert_eq!(ds[0].api_url, "http://127.0.0.1:3");
    assert!(ds[0].age < Duration::from_secs(5), "{:?}", ds[0].age);
}

pub(crate) fn orphans_of_a_lapsed_daemon_are_claimed_once(s: &dyn StateStore) {
    let lapse = Duration::from_millis(300);
    let running = delegation("orphan-running", DelegationState::Running);
    let ended = delegation("orphan-ended", DelegationState::Completed);
    let kept = delegation("kept-by-c", DelegationState::Running);
    s.heartbeat("dmn_a", "http://a").unwrap();
    s.put("dmn_a", &running).unwrap();
    s.put("dmn_a", &ended).unwrap();
    // While A beats, nothing of it is claimed.
    s.heartbeat("dmn_b", "http://b").unwrap();
    assert!(s.claim_orphans("dmn_b", lapse).unwrap().is_empty());
    std::thread::sleep(lapse + Duration::from_millis(200));
    // C beats and owns a delegation; A has lapsed.
    s.heartbeat("dmn_c", "http://c").unwrap();
    s.put("dmn_c", &kept).unwrap();
    // B's own heartbeat has lapsed too: it must not claim.
    assert!(s.claim_orphans("dmn_b", lapse).unwrap().is_empty());
    s.heartbeat("dmn_b", "http://b").unwrap();
    let claimed = s.claim_orphans("dmn_b", lapse).unwrap();
    assert_eq!(claimed.len(), 1, "only A's running delegation: {claimed:?}");
    assert_eq!(id(&claimed[0].delegation), id(&running));
    assert_eq!(claimed[0].owner.as_deref(), Some("dmn_b"));
    assert_eq!(
        s.get(id(&running)).unwrap().unwrap().owner.as_deref(),
        Some("dmn_b")
    );
    // An ended delegation stays where it was; C's stays C's.
    assert_eq!(
        s.get(id(&ended)).unwrap().unwrap().owner.as_deref(),
        Some("dmn_a")
    );
    assert_eq!(
        s.get(id(&kept)).unwrap().unwrap().owner.as_deref(),
        Some("dmn_c")
    );
    // The claim is a write: others see it in changed_since.
    let v = claimed[0].version;
    assert!(
        s.changed_since(v - 1)
            .unwrap()
            .iter()
            .any(|r| id(&r.delegation) == id(&running))
    );
    // Claimed once: C, also alive, gets nothing more; A, back, can no longer write it.
    s.heartbeat("dmn_c", "http://c").unwrap();
    assert!(s.claim_orphans("dmn_c", lapse).unwrap().is_empty());
    assert!(matches!(
        s.put("dmn_a", &running),
        Err(StoreError::NotOwner { .. })
    ));
    s.put("dmn_b", &running).unwrap();
}

/// Instantiate the suite for one engine: `$open` returns `Some((store, guard))`, or `None`
/// when the engine is absent (the opener decides whether that skips or fails).
macro_rules! store_suite {
    ($open:expr) => {
        #[test]
        fn suite_round_trip() {
            let Some((s, _guard)) = ($open)() else { return };
            $crate::store::suite::round_trip(&*s);
        }
        #[test]
        fn suite_all_is_oldest_first() {
            let Some((s, _guard)) = ($open)() else { return };
            $crate::store::suite::all_is_oldest_first(&*s);
        }
        #[test]
        fn suite_versions_grow_and_changed_since_sees_only_newer() {
            let Some((s, _guard)) = ($open)() else { return };
            $crate::store::suite::versions_grow_and_changed_since_sees_only_newer(&*s);
        }
        #[test]
        fn suite_another_daemon_cannot_overwrite() {
            let Some((s, _guard)) = ($open)() else { return };
            $crate::store::suite::another_daemon_cannot_overwrite(&*s);
        }
        #[test]
        fn suite_heartbeats_are_listed() {
            let Some((s, _guard)) = ($open)() else { return };
            $crate::store::suite::heartbeats_are_listed(&*s);
        }
        #[test]
        fn suite_orphans_of_a_lapsed_daemon_are_claimed_once() {
            let Some((s, _guard)) = ($open)() else { return };
            $crate::store::suite::orphans_of_a_lapsed_daemon_are_claimed_once(&*s);
        }
    };
}
pub(crate) use store_suite;
