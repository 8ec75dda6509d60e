//! Credentials: an Executor checks INVITE's `auth` against its credential (AUTH_FAILED
//! otherwise) and shows ids and paths in `/status` only to a holder of it; a daemon started
//! with an API token requires it on every route but `/health`.

use std::time::Duration;

use serde_json::{Value, json};

use awcp_ctl::client::{ClientError, DaemonClient};
use awcp_protocol::api::{DelegateRequest, EnvironmentSpec, ResourceSpec};
use awcp_protocol::messages::{AccessMode, AuthCredential, AuthType, ResourceType, TaskSpec};
use awcp_protocol::{DelegationId, DelegationState, TransportType};
use awcp_tests::{Harness, fuse_available};

const TOKEN: &str = "s3cret-executor-token";

fn invite(id: &str, auth: Option<&str>) -> Value {
    let mut v = json!({
        "version": "1", "type": "INVITE", "delegationId": id,
        "task": {"description": "d", "prompt": "p"},
        "lease": {"ttlSeconds": 60, "accessMode": "rw"}, "retentionMs": 1000,
        "environment": {"resources": [{"name": "workspace", "type": "fs", "mode": "rw"}]}
    });
    if let Some(a) = auth {
        v["auth"] = json!({"type": "bearer", "credential": a});
    }
    v
}

fn request(
    h: &Harness,
    dir: &std::path::Path,
    transport: TransportType,
    token: Option<&str>,
) -> DelegateRequest {
    DelegateRequest {
        executor_url: h.executor.awcp_url(),
        environment: EnvironmentSpec {
            resources: vec![ResourceSpec {
                name: "workspace".into(),
                resource_type: ResourceType::Fs,
                source: dir.display().to_string(),
                mode: AccessMode::Rw,
                include: None,
                exclude: None,
                gitignore: None,
                allow_sensitive: None,
            }],
        },
        task: TaskSpec {
            description: "auth".into(),
            prompt: "p".into(),
        },
        ttl_seconds: Some(120),
        access_mode: Some(AccessMode::Rw),
        snapshot_mode: None,
        auth: token.map(|t| AuthCredential {
            auth_type: AuthType::Bearer,
            credential: t.into(),
            metadata: None,
        }),
        transport: Some(transport),
        multi_round: None,
        git_remote: None,
        no_network: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_executor_with_a_token_refuses_everyone_without_it() {
    if !fuse_available() {
        return;
    }
    let agent = "if [ -d workspace ]; then cd workspace; fi; echo hi > out.txt";
    // The daemon is given no default credential: each request names its own.
    let h = Harness::start_full(
        agent,
        |d| d.executor_token = None,
        |c| c.token = Some(TOKEN.into()),
    )
    .await;
    let awcp = h.executor.awcp_url();
    let http = reqwest::Client::new();
    let id = || {
        DelegationId::from_random_bytes(rand::random())
            .as_str()
            .to_string()
    };
    for auth in [None, Some("wrong")] {
        let b: Value = http
            .post(&awcp)
            .json(&invite(&id(), auth))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(b["type"], "ERROR", "{b}");
        assert_eq!(b["code"], "AUTH_FAILED", "{b}");
    }
    let b: Value = http
        .post(&awcp)
        .json(&invite(&id(), Some(TOKEN)))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(b["type"], "ACCEPT", "{b}");
    // The status: counts for anyone, the pending INVITE's id only with the credential.
    for bearer in [None, Some("wrong")] {
        let mut rq = http.get(format!("{awcp}/status"));
        if let Some(b) = bearer {
            rq = rq.bearer_auth(b);
        }
        let st: Value = rq.send().await.unwrap().json().await.unwrap();
        assert_eq!(st["pendingInvitations"], 1, "{st}");
        assert_eq!(st["auth"], "credential", "{st}");
        assert!(st.get("pending").is_none(), "{bearer:?}: {st}");
    }
    let st: Value = http
        .get(format!("{awcp}/status"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(st["pending"][0]["id"], b["delegationId"], "{st}");
    assert_eq!(st["pending"][0]["authenticated"], true, "{st}");
    // Our daemon, given the token, delegates with both transports.
    for transport in [TransportType::Archive, TransportType::Awcpfs] {
        let dir = h.path(&format!("ws-{}", transport.as_str()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.txt"), "a").unwrap();
        let id = h
            .client
            .delegate(&request(&h, &dir, transport, Some(TOKEN)))
            .await
            .unwrap()
            .delegation_id;
        let id = id.as_str().to_string();
        assert_eq!(
            h.wait_end(&id, Duration::from_secs(60)).await,
            DelegationState::Completed,
            "{transport}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("out.txt")).unwrap(),
            "hi\n"
        );
        // And without it, the Executor's refusal comes back with its code.
        let err = h
            .client
            .delegate(&request(&h, &dir, transport, None))
            .await
            .unwrap_err();
        let ClientError::Refused { status, body } = err else {
            panic!("{err}")
        };
        assert_eq!(status, 400);
        assert_eq!(body.code.unwrap().as_str(), "AUTH_FAILED");
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_daemon_with_an_api_token_requires_it() {
    if !fuse_available() {
        return;
    }
    // The test runs as the daemon's user, whom the kernel vouches for by default
    // (tests/tests/peer_uid.rs): here every caller must bring the token.
    let h = Harness::start_full(
        "true",
        |d| {
            d.api_token = Some("api-tok".into());
            d.trust_local_uid = false;
        },
        |_| {},
    )
    .await;
    let api = h.daemon.url();
    let http = reqwest::Client::new();
    let r = http.get(format!("{api}/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "health stays open");
    for path in [
        "/delegations",
        "/delegation/dlg_00000000000000000000000000000000",
    ] {
        let r = http.get(format!("{api}{path}")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{path}");
        let b: Value = r.json().await.unwrap();
        assert!(b["error"].as_str().unwrap().contains("token"), "{b}");
    }
    let r = http
        .post(format!("{api}/delegate"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert!(matches!(
        DaemonClient::new(&api).list().await,
        Err(ClientError::Refused { status: 401, .. })
    ));
    let client = DaemonClient::new(&api).with_token(Some("api-tok".into()));
    assert_eq!(client.list().await.unwrap().delegations.len(), 0);
    h.stop().await;
}

// Issue 29: `executorUrl: "not a url"` was a 500 `builder error` recorded as an error
// delegation, and an Executor that could not be reached a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_or_unreachable_executor_url_gets_400_or_502() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start("true").await;
    let dir = h.path("ws");
    std::fs::create_dir_all(&dir).unwrap();
    let api = h.daemon.token_url();
    let http = reqwest::Client::new();
    let mut req = serde_json::to_value(request(&h, &dir, TransportType::Archive, None)).unwrap();
    req["executorUrl"] = json!("not a url");
    let r = http
        .post(format!("{api}/delegate"))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let b: Value = r.json().await.unwrap();
    assert!(b["error"].as_str().unwrap().contains("not a URL"), "{b}");
    assert_eq!(
        h.client.list().await.unwrap().delegations.len(),
        0,
        "recorded"
    );
    // A port nobody listens on: refused, 502, naming what was tried.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let url = format!("http://127.0.0.1:{port}/awcp");
    req["executorUrl"] = json!(url);
    let r = http
        .post(format!("{api}/delegate"))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let b: Value = r.json().await.unwrap();
    assert!(b["error"].as_str().unwrap().contains(&url), "{b}");
    h.stop().await;
}
