//! Tokens: an Executor started with one checks INVITE's `auth` (AUTH_FAILED otherwise) and
//! the bearer token on every other route; a daemon started with an API token requires it on
//! every route but `/health`.

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
        no_network: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_executor_with_a_token_refuses_everyone_without_it() {
    if !fuse_available() {
        return;
    }
    let agent = "if [ -d workspace ]; then cd workspace; fi; echo hi > out.txt";
    let h = Harness::start_with(agent, |c| c.token = Some(TOKEN.into())).await;
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
    // Every other route wants the bearer token.
    let r = http.get(format!("{awcp}/status")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = http
        .get(format!("{awcp}/status"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = http
        .get(format!("{awcp}/status"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let close = json!({"version": "1", "type": "CLOSE", "delegationId": id()});
    let r = http.post(&awcp).json(&close).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
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
    let h = Harness::start_full("true", |d| d.api_token = Some("api-tok".into()), |_| {}).await;
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
