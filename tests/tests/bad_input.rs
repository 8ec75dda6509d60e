//! Bad input from the network gets a clear protocol error — never a panic, a hang, or a
//! write outside the workspace (issue 2, test 7).

use std::time::Duration;

use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, appears, fuse_available, sample_repo};

async fn post_raw(url: &str, body: &str) -> (u16, serde_json::Value) {
    let resp = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(serde_json::Value::Null))
}

/// POST a body of `len` bytes and read the answer the server gives, while the body is still
/// being sent (a server may answer, and stop reading, before all of it has arrived):
/// (status, whole answer).
async fn post_large(url: &str, len: u64) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let u = reqwest::Url::parse(url).unwrap();
    let s = tokio::net::TcpStream::connect((u.host_str().unwrap(), u.port().unwrap()))
        .await
        .unwrap();
    let (mut rd, mut wr) = s.into_split();
    let head = format!(
        "POST {} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n",
        u.path(),
        u.host_str().unwrap()
    );
    let writer = tokio::spawn(async move {
        wr.write_all(head.as_bytes()).await?;
        let chunk = vec![b' '; 1 << 20];
        let mut sent = 0u64;
        while sent < len {
            let n = chunk.len().min((len - sent) as usize);
            wr.write_all(&chunk[..n]).await?;
            sent += n as u64;
        }
        std::io::Result::Ok(())
    });
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), async {
        let mut buf = [0u8; 4096];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
            if String::from_utf8_lossy(&out).contains('}') {
                break;
            }
        }
    })
    .await;
    writer.abort();
    assert!(read.is_ok(), "no answer to an oversized body");
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn executor_and_daemon_answer_malformed_and_unknown_input_clearly() {
    let h = Harness::start("true").await;
    let awcp = h.executor.awcp_url();
    let (s, b) = post_raw(&format!("{awcp}/"), "{not json").await;
    assert_eq!(s, 400);
    assert!(b["error"].as_str().unwrap().contains("JSON"), "{b}");
    let (s, b) = post_raw(
        &format!("{awcp}/"),
        r#"{"version":"1","type":"BOGUS","delegationId":"dlg_0123456789abcdef0123456789abcdef"}"#,
    )
    .await;
    // Symptom: an unknown type was answered 500, as if the Executor had failed.
    assert_eq!(s, 400);
    assert!(b["error"].as_str().unwrap().contains("BOGUS"), "{b}");
    let (s, b) = post_raw(
        &format!("{awcp}/"),
        r#"{"version":"2","type":"INVITE","delegationId":"dlg_0123456789abcdef0123456789abcdef"}"#,
    )
    .await;
    assert_eq!(s, 400);
    assert!(b["error"].as_str().unwrap().contains("version"), "{b}");
    // START for an id never invited.
    let (s, _) = post_raw(
        &format!("{awcp}/"),
        r#"{"version":"1","type":"START","delegationId":"dlg_0123456789abcdef0123456789abcdef",
            "lease":{"expiresAt":"2030-01-01T00:00:00.000Z","accessMode":"rw"},
            "transportHandle":{"transport":"archive","workspaceBase64":"","checksum":"00"}}"#,
    )
    .await;
    // Symptom: START for an unknown id was answered 500 (the reference's), not 404.
    assert_eq!(s, 404, "an unknown id is not found");
    for body in [
        r#"{"version":"1","type":"ERROR","delegationId":"dlg_0123456789abcdef0123456789abcdef","code":"CANCELLED","message":"m"}"#,
        r#"{"version":"1","type":"CONTINUE","delegationId":"dlg_0123456789abcdef0123456789abcdef","task":{"description":"d","prompt":"p"},"round":2}"#,
        r#"{"version":"1","type":"CLOSE","delegationId":"dlg_0123456789abcdef0123456789abcdef"}"#,
    ] {
        let (s, b) = post_raw(&format!("{awcp}/"), body).await;
        assert_eq!(s, 404, "{body}: {b}");
        assert!(
            b["error"].as_str().unwrap().contains("Unknown delegation"),
            "{b}"
        );
    }
    let unknown = "dlg_0123456789abcdef0123456789abcdef";
    let http = reqwest::Client::new();
    // (An unknown id's event stream is a 200 stream with one NOT_FOUND event, as the
    // reference's: see interop.rs.)
    for (method, path) in [
        ("GET", format!("{awcp}/tasks/{unknown}/result")),
        ("POST", format!("{awcp}/cancel/{unknown}")),
    ] {
        let rq = if method == "GET" {
            http.get(&path)
        } else {
            http.post(&path)
        };
        let status = rq.send().await.unwrap().status().as_u16();
        assert_eq!(status, 404, "{method} {path}");
    }
    // The daemon API.
    let api = h.daemon.token_url();
    let (s, b) = post_raw(&format!("{api}/delegate"), "[1,2").await;
    assert_eq!(s, 400);
    assert!(b["error"].as_str().unwrap().contains("executorUrl"), "{b}");
    let (s, b) = post_raw(&format!("{api}/delegate"), r#"{"executorUrl":"x"}"#).await;
    assert_eq!(s, 400, "{b}");
    // Symptom: a 200 MB body was answered 400 "length limit exceeded", not 413.
    let (s, b) = post_large(&format!("{api}/delegate"), 200 << 20).await;
    assert_eq!(s, 413, "{b}");
    assert!(b.contains("too large"), "{b}");
    let s = http
        .get(format!("{api}/delegation/{unknown}"))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(s.as_u16(), 404);
    let s = http
        .post(format!("{api}/delegation/{unknown}/revoke"))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(s.as_u16(), 404);
    // A workspace that does not exist is refused with the reference's code.
    let body = serde_json::json!({
        "executorUrl": awcp,
        "environment": {"resources": [{"name": "w", "type": "fs", "source": "/nonexistent/awcp", "mode": "rw"}]},
        "task": {"description": "d", "prompt": "p"}
    });
    let resp = http
        .post(format!("{api}/delegate"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let b: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(b["code"], "WORKSPACE_NOT_FOUND", "{b}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_export_refuses_escapes_and_bad_tokens_of_a_live_delegation() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        "touch {o}/ready; while [ ! -e {o}/go ]; do sleep 0.05; done",
        o = out.path().display()
    );
    let h = Harness::start(&agent).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let outside = h.path("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret"), "untouched").unwrap();
    std::os::unix::fs::symlink(&outside, repo.join("escape")).unwrap();
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    assert!(appears(&out.path().join("ready"), Duration::from_secs(60)).await);

    let token = h.daemon.daemon.export_token(&id).unwrap();
    let base = format!("{}/v1/exports/{id}", h.daemon.daemon.export_url());
    let http = reqwest::Client::new();
    // Missing and wrong tokens.
    let s = http
        .get(format!("{base}/manifest"))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(s.as_u16(), 401);
    let s = http
        .get(format!("{base}/manifest"))
        .bearer_auth("not-the-token")
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(s.as_u16(), 401);
    // Escapes: `..`, absolute paths, and a symlink pointing outside.
    let empty = blake3::hash(b"").to_hex().to_string();
    for path in [
        "../outside/secret",
        "/etc/awcp-escape",
        "escape/secret",
        "calc/../../outside/x",
    ] {
        let body = serde_json::json!({"commitId": format!("escape-{path}"), "changes": [
            {"op": "write", "path": path, "mode": 420, "base": null, "hash": empty,
             "size": 0, "blocks": [], "mtimeNs": 0}
        ]});
        let resp = http
            .post(format!("{base}/commit"))
            .bearer_auth(&token)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 400, "{path} was not refused");
        let b: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(b["code"], "INVALID_PATH", "{path}: {b}");
    }
    assert_eq!(
        std::fs::read_to_string(outside.join("secret")).unwrap(),
        "untouched"
    );
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        1,
        "something was written outside"
    );
    assert!(!std::path::Path::new("/etc/awcp-escape").exists());
    // Malformed JSON to the data plane.
    let resp = http
        .post(format!("{base}/commit"))
        .bearer_auth(&token)
        .header("content-type", "application/json")
        .body("{\"commitId\":")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    std::fs::write(out.path().join("go"), "").unwrap();
    h.wait_end(&id, Duration::from_secs(60)).await;
    h.stop().await;
}
