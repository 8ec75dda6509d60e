//! Wire conformance: every fixture in `tests/fixtures/conformance/` is replayed against the
//! live service it names (`executor.*` → our Executor, `daemon.*` → our Delegator daemon),
//! each on fresh services, and the live answer is checked against the fixture's shape.
//!
//! A fixture: `{"description", "setup", "request": {"method", "path", "body"?},
//! "response": {"status", "body"?, "events"?}}`.
//! * `setup` brings the delegation `{{id}}` to a state first: `none` (a fresh id nobody
//!   knows), `invited`, `running`, `completed` (for the daemon: an `archive` delegation with a
//!   staged snapshot `{{sid}}`).
//! * Request strings may hold `{{id}}`, `{{sid}}`, `{{executor}}` (our Executor's AWCP URL),
//!   `{{workspace}}` (a fresh directory), `{{zip}}`/`{{checksum}}` (an archive of it),
//!   `{{expiresAt}}` (an hour from now), `{{credential}}` (the Executor's credential).
//!   A request may name `headers` (e.g. `authorization`).
//! * In the expected body, `"{{string}}"`, `"{{number}}"`, `"{{bool}}"` match any value of
//!   that type and `"{{absent}}"` requires the key to be missing; the other placeholders
//!   stand for their values; any other value must be equal. Keys the fixture does not name
//!   may be present (our additions); arrays must have the fixture's length.
//! * `events` lists the SSE events expected (from `data:` lines only, as the reference's
//!   client reads them), in order; other events may come between them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};

use awcp_protocol::api::{DelegateRequest, EnvironmentSpec, ResourceSpec, SnapshotMode};
use awcp_protocol::messages::{AccessMode, ResourceType, TaskSpec};
use awcp_protocol::{DelegationId, DelegationState, TransportType};
use awcp_tests::reference::{read_data_lines, sha256_hex, zip_entries};
use awcp_tests::{Harness, fuse_available};

const TIMEOUT: Duration = Duration::from_secs(60);

/// The agent: slow when the workspace holds a `slow` file (for `running` setups).
const AGENT: &str = "if [ -f workspace/slow ] || [ -f slow ]; then sleep 120; fi; \
                     echo changed > workspace/a.txt 2>/dev/null || echo changed > a.txt; echo ok";

fn fixtures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/conformance");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

fn substitute(v: &Value, vars: &BTreeMap<&str, String>) -> Value {
    match v {
        Value::String(s) => {
            let mut out = s.clone();
            for (k, val) in vars {
                out = out.replace(&format!("{{{{{k}}}}}"), val);
            }
            Value::String(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| substitute(x, vars)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| (k.clone(), substitute(x, vars)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Check `live` against the `expected` shape; the first difference, with its path.
fn matches(expected: &Value, live: Option<&Value>, at: &str) -> Result<(), String> {
    let type_ok = |ok: bool, what: &str| {
        if ok {
            Ok(())
        } else {
            Err(format!("{at}: expected {what}, got {live:?}"))
        }
    };
    match (expected, live) {
        (Value::String(s), _) if s == "{{absent}}" => type_ok(live.is_none(), "no value"),
        (_, None) => Err(format!("{at}: missing")),
        (Value::String(s), Some(l)) if s == "{{string}}" => type_ok(l.is_string(), "a string"),
        (Value::String(s), Some(l)) if s == "{{number}}" => type_ok(l.is_number(), "a number"),
        (Value::String(s), Some(l)) if s == "{{bool}}" => type_ok(l.is_boolean(), "a bool"),
        (Value::Object(e), Some(Value::Object(l))) => {
            for (k, ev) in e {
                matches(ev, l.get(k), &format!("{at}.{k}"))?;
            }
            Ok(())
        }
        (Value::Array(e), Some(Value::Array(l))) => {
            if e.len() != l.len() {
                return Err(format!(
                    "{at}: expected {} items, got {}: {l:?}",
                    e.len(),
                    l.len()
                ));
            }
            for (i, (ev, lv)) in e.iter().zip(l).enumerate() {
                matches(ev, Some(lv), &format!("{at}[{i}]"))?;
            }
            Ok(())
        }
        (e, Some(l)) => type_ok(e == l, &e.to_string()),
    }
}

fn new_id() -> String {
    DelegationId::from_random_bytes(rand::random())
        .as_str()
        .to_string()
}

fn workspace(h: &Harness, slow: bool) -> PathBuf {
    let dir = h.path(&format!("ws-{}", new_id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.txt"), "original\n").unwrap();
    if slow {
        std::fs::write(dir.join("slow"), "").unwrap();
    }
    dir
}

async fn send(method: &str, url: &str, body: Option<&Value>) -> reqwest::Response {
    send_with(method, url, body, None).await
}

async fn send_with(
    method: &str,
    url: &str,
    body: Option<&Value>,
    headers: Option<&Value>,
) -> reqwest::Response {
    let http = reqwest::Client::new();
    let rq = match method {
        "GET" => http.get(url),
        "POST" => http.post(url),
        "DELETE" => http.delete(url),
        other => panic!("method {other}"),
    };
    let mut rq = match body {
        Some(b) => rq.json(b),
        None => rq,
    };
    for (k, v) in headers.and_then(Value::as_object).into_iter().flatten() {
        rq = rq.header(k.as_str(), v.as_str().unwrap());
    }
    rq.send().await.unwrap()
}

async fn executor_setup(h: &Harness, setup: &str, vars: &mut BTreeMap<&str, String>) {
    let awcp = h.executor.awcp_url();
    let invite = json!({
        "version": "1", "type": "INVITE", "delegationId": vars["id"],
        "auth": {"type": "bearer", "credential": vars["credential"]},
        "task": {"description": "d", "prompt": "p"},
        "lease": {"ttlSeconds": 600, "accessMode": "rw"}, "retentionMs": 604800000,
        "environment": {"resources": [{"name": "workspace", "type": "fs", "mode": "rw"}]}
    });
    if setup == "none" {
        return;
    }
    let r = send("POST", &awcp, Some(&invite)).await;
    assert_eq!(r.json::<Value>().await.unwrap()["type"], "ACCEPT");
    if setup == "invited" {
        return;
    }
    let start = |zip: &[u8]| {
        json!({
            "version": "1", "type": "START", "delegationId": vars["id"],
            "lease": {"expiresAt": vars["expiresAt"], "accessMode": "rw"},
            "transportHandle": {"transport": "archive",
                "workspaceBase64": base64::engine::general_purpose::STANDARD.encode(zip),
                "checksum": sha256_hex(zip)}
        })
    };
    let id = vars["id"].clone();
    match setup {
        "completed" => {
            let events = reqwest::get(format!("{awcp}/tasks/{id}/events"))
                .await
                .unwrap();
            send("POST", &awcp, Some(&start(&decoded(vars)))).await;
            let evs = tokio::time::timeout(TIMEOUT, read_data_lines(events))
                .await
                .unwrap();
            assert_eq!(evs.last().unwrap()["type"], "done", "{evs:?}");
        }
        "running" => {
            let zip = zip_entries(
                &[("workspace/a.txt", b"a"), ("workspace/slow", b"")],
                zip::CompressionMethod::Deflated,
            );
            send("POST", &awcp, Some(&start(&zip))).await;
            let url = format!("{awcp}/status");
            let mut running = false;
            for _ in 0..500 {
                let st: Value = reqwest::get(&url).await.unwrap().json().await.unwrap();
                if st["activeDelegations"] == 1 {
                    running = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(running, "the task did not start");
        }
        other => panic!("unknown executor setup {other}"),
    }
}

fn decoded(vars: &BTreeMap<&str, String>) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(&vars["zip"])
        .unwrap()
}

async fn daemon_setup(h: &Harness, setup: &str, vars: &mut BTreeMap<&str, String>) {
    if setup == "none" {
        return;
    }
    let ws = workspace(h, setup == "running");
    let req = DelegateRequest {
        executor_url: h.executor.awcp_url(),
        environment: EnvironmentSpec {
            resources: vec![ResourceSpec {
                name: "workspace".into(),
                resource_type: ResourceType::Fs,
                source: ws.display().to_string(),
                mode: AccessMode::Rw,
                include: None,
                exclude: None,
                gitignore: None,
                allow_sensitive: None,
            }],
        },
        task: TaskSpec {
            description: "conformance".into(),
            prompt: "p".into(),
        },
        ttl_seconds: Some(600),
        access_mode: Some(AccessMode::Rw),
        snapshot_mode: Some(SnapshotMode::Staged),
        auth: None,
        transport: Some(TransportType::Archive),
        multi_round: None,
        git_remote: None,
        no_network: None,
    };
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    let id = id.as_str().to_string();
    vars.insert("id", id.clone());
    match setup {
        "completed" => {
            assert_eq!(h.wait_end(&id, TIMEOUT).await, DelegationState::Completed);
            let v = h.client.get(&id).await.unwrap();
            let sid = v.record.snapshots.unwrap()[0].id.clone();
            vars.insert("sid", sid);
        }
        "running" => {
            let client = h.client.clone();
            let mut state = DelegationState::Created;
            for _ in 0..500 {
                state = client.get(&id).await.unwrap().record.state;
                if state == DelegationState::Running {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(state, DelegationState::Running);
        }
        other => panic!("unknown daemon setup {other}"),
    }
}

async fn replay(path: &Path) -> Result<(), String> {
    let name = path.file_name().unwrap().to_string_lossy().to_string();
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .map_err(|e| format!("{name}: {e}"))?;
    // An Executor without sshfs installed (it offers sshfs only where it is): the
    // DEP_MISSING fixture asks it for sshfs.
    let h = Harness::start_with(AGENT, |c| {
        c.transports
            .retain(|t| *t != awcp_protocol::TransportType::Sshfs)
    })
    .await;
    let ws = workspace(&h, false);
    let zip = zip_entries(
        &[("workspace/a.txt", b"original\n")],
        zip::CompressionMethod::Deflated,
    );
    let mut vars: BTreeMap<&str, String> = BTreeMap::new();
    vars.insert("id", new_id());
    vars.insert("executor", h.executor.awcp_url());
    vars.insert("credential", h.credential());
    vars.insert("workspace", ws.display().to_string());
    vars.insert("checksum", sha256_hex(&zip));
    vars.insert(
        "zip",
        base64::engine::general_purpose::STANDARD.encode(&zip),
    );
    vars.insert("expiresAt", an_hour_from_now());
    let setup = fixture["setup"].as_str().unwrap_or("none");
    let base = if name.starts_with("executor.") {
        executor_setup(&h, setup, &mut vars).await;
        format!("http://{}", h.executor.addr)
    } else {
        daemon_setup(&h, setup, &mut vars).await;
        h.daemon.token_url()
    };
    let rq = substitute(&fixture["request"], &vars);
    let url = format!("{base}{}", rq["path"].as_str().unwrap());
    let resp = send_with(
        rq["method"].as_str().unwrap(),
        &url,
        rq.get("body"),
        rq.get("headers"),
    )
    .await;
    let expected = substitute(&fixture["response"], &vars);
    let status = resp.status().as_u16();
    let result = if let Some(events) = expected.get("events") {
        let live = tokio::time::timeout(TIMEOUT, read_data_lines(resp))
            .await
            .map_err(|_| format!("{name}: the stream did not end"))?;
        let mut it = live.iter();
        let mut out = Ok(());
        for (i, e) in events.as_array().unwrap().iter().enumerate() {
            if !it.any(|l| matches(e, Some(l), "").is_ok()) {
                out = Err(format!(
                    "{name}: event {i} {e} not found in order in {live:?}"
                ));
                break;
            }
        }
        out
    } else {
        let body: Option<Value> = resp.json().await.ok();
        match expected.get("body") {
            Some(e) => matches(e, body.as_ref(), "body").map_err(|m| format!("{name}: {m}")),
            None => Ok(()),
        }
    };
    let want = expected["status"].as_u64().unwrap() as u16;
    h.stop().await;
    if status != want {
        return Err(format!("{name}: status {status}, expected {want}"));
    }
    result
}

/// An hour from now, as the reference writes times.
fn an_hour_from_now() -> String {
    (chrono::Utc::now() + chrono::Duration::hours(1))
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_fixture_matches_the_live_services() {
    if !fuse_available() {
        return;
    }
    let all = fixtures();
    assert!(all.len() >= 30, "fixtures missing: {}", all.len());
    let mut failures = Vec::new();
    for f in &all {
        if let Err(e) = replay(f).await {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_shape_matcher_can_fail() {
    let e = json!({"a": "{{string}}", "b": [1, "{{number}}"], "c": "{{absent}}"});
    assert!(matches(&e, Some(&json!({"a": "x", "b": [1, 2], "extra": 1})), "").is_ok());
    assert!(matches(&e, Some(&json!({"a": 1, "b": [1, 2]})), "").is_err());
    assert!(matches(&e, Some(&json!({"a": "x", "b": [1]})), "").is_err());
    assert!(matches(&e, Some(&json!({"a": "x", "b": [2, 2]})), "").is_err());
    assert!(matches(&e, Some(&json!({"a": "x", "b": [1, 2], "c": 0})), "").is_err());
    assert!(matches(&e, Some(&json!({"b": [1, 2]})), "").is_err());
}
