//! Admission on the Delegator for `awcpfs` delegations: sensitive files refuse a
//! delegation; excluded, `.gitignore`d and sensitive files are invisible on the mount and
//! refused by the export; size and file-count limits.

use std::time::Duration;

use serde_json::{Value, json};

use awcp_ctl::client::ClientError;
use awcp_protocol::DelegationState;
use awcp_protocol::api::{DelegateRequest, EnvironmentSpec, ResourceSpec};
use awcp_protocol::messages::{AccessMode, ResourceType, TaskSpec};
use awcp_tests::{Harness, eventually, fuse_available};

fn request(
    h: &Harness,
    dir: &std::path::Path,
    exclude: Option<Vec<String>>,
    gitignore: bool,
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
                exclude,
                gitignore: gitignore.then_some(true),
                allow_sensitive: None,
            }],
        },
        task: TaskSpec {
            description: "admission".into(),
            prompt: "p".into(),
        },
        ttl_seconds: Some(120),
        access_mode: Some(AccessMode::Rw),
        snapshot_mode: None,
        auth: None,
        transport: None,
        multi_round: None,
        git_remote: None,
        no_network: None,
    }
}

fn repo(dir: &std::path::Path) {
    std::fs::create_dir_all(dir.join("conf")).unwrap();
    std::fs::create_dir_all(dir.join("target")).unwrap();
    std::fs::write(dir.join("main.py"), "print(1)\n").unwrap();
    std::fs::write(dir.join("conf/app.toml"), "x = 1\n").unwrap();
    std::fs::write(dir.join("conf/.env"), "TOKEN=secret\n").unwrap();
    std::fs::write(dir.join("target/out.bin"), "bin").unwrap();
    std::fs::write(dir.join("debug.log"), "log").unwrap();
    std::fs::write(dir.join(".gitignore"), "*.log\n").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn excluded_and_sensitive_files_are_invisible_on_the_mount_and_refused_by_the_export() {
    if !fuse_available() {
        return;
    }
    let flags = tempfile::tempdir().unwrap();
    let flag = flags.path().join("release");
    let agent = format!(
        "set -e; test -f main.py; test -f conf/app.toml; test ! -e conf/.env; test ! -e target; \
         test ! -e debug.log; ls -a conf > listing.txt; \
         while [ ! -e {} ]; do sleep 0.05; done",
        flag.display()
    );
    let h = Harness::start(&agent).await;
    let dir = h.path("repo");
    repo(&dir);
    // Sensitive files refuse the delegation, as in the reference.
    let err = h
        .client
        .delegate(&request(&h, &dir, None, false))
        .await
        .unwrap_err();
    let ClientError::Refused { status, body } = err else {
        panic!("{err}")
    };
    assert_eq!(status, 400);
    assert_eq!(body.code.unwrap().as_str(), "SENSITIVE_FILES");
    assert_eq!(body.error, "Sensitive files detected: conf/.env");
    // Excluded (and .gitignore'd), the rest is delegated and they are invisible.
    let id = h
        .client
        .delegate(&request(
            &h,
            &dir,
            Some(vec![".env".into(), "target".into()]),
            true,
        ))
        .await
        .unwrap()
        .delegation_id;
    let id = id.as_str().to_string();
    assert!(
        eventually(Duration::from_secs(30), || dir.join("listing.txt").exists()).await,
        "the agent never got past its checks"
    );
    let listing = std::fs::read_to_string(dir.join("listing.txt")).unwrap();
    assert!(
        listing.contains("app.toml") && !listing.contains(".env"),
        "{listing}"
    );
    // The export never writes hidden paths, whoever asks: each such change comes back as a
    // conflict (kept nowhere) and the rest of the set still applies.
    let token = h.daemon.daemon.export_token(&id).unwrap();
    let url = format!("{}/v1/exports/{id}/commit", h.daemon.daemon.export_url());
    for change in [
        json!({"op": "symlink", "path": "conf/.env", "target": "x"}),
        json!({"op": "mkdir", "path": "target/sub", "mode": 493}),
        json!({"op": "mkdir", "path": "logs.log", "mode": 493}),
    ] {
        let r = reqwest::Client::new()
            .post(&url)
            .bearer_auth(&token)
            .json(&json!({"commitId": format!("c-{}", rand::random::<u32>()), "changes": [change]}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let b: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 200, "{change}: {b}");
        assert_eq!(b["applied"], 0, "{b}");
        assert_eq!(b["conflicts"][0]["path"], change["path"], "{b}");
        assert!(
            b["conflicts"][0]["reason"]
                .as_str()
                .unwrap()
                .contains("hidden"),
            "{b}"
        );
    }
    // Mixed with a visible change, the visible one applies.
    let r = reqwest::Client::new()
        .post(&url)
        .bearer_auth(&token)
        .json(&json!({"commitId": "c-mixed", "changes": [
            {"op": "mkdir", "path": "target", "mode": 493},
            {"op": "mkdir", "path": "visible-dir", "mode": 493},
        ]}))
        .send()
        .await
        .unwrap();
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["applied"], 1, "{b}");
    assert_eq!(b["conflicts"].as_array().unwrap().len(), 1, "{b}");
    assert!(dir.join("visible-dir").is_dir());
    std::fs::write(&flag, "").unwrap();
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    // Nothing hidden was touched.
    assert_eq!(
        std::fs::read_to_string(dir.join("conf/.env")).unwrap(),
        "TOKEN=secret\n"
    );
    assert!(!dir.join("target/sub").exists());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn awcpfs_delegations_have_size_and_file_count_limits() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_full("true", |d| d.awcpfs_limits.max_files = 2, |_| {}).await;
    let dir = h.path("repo");
    repo(&dir);
    let req = request(&h, &dir, Some(vec![".env".into()]), false);
    let err = h.client.delegate(&req).await.unwrap_err();
    let ClientError::Refused { status, body } = err else {
        panic!("{err}")
    };
    assert_eq!(status, 400);
    assert_eq!(body.code.unwrap().as_str(), "WORKSPACE_TOO_LARGE");
    assert!(body.hint.unwrap().contains("(limit 2)"));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_executor_admits_only_its_modes_transports_and_capacity() {
    if !fuse_available() {
        return;
    }
    let h = Harness::start_with("sleep 30", |c| {
        c.access_modes = vec![AccessMode::Ro];
        c.transports = vec![awcp_protocol::TransportType::Archive];
        c.max_concurrent = 1;
    })
    .await;
    let awcp = h.executor.awcp_url();
    let credential = h.credential();
    let invite = |mode: &str, transport: &str| {
        json!({
            "version": "1", "type": "INVITE",
            "auth": {"type": "bearer", "credential": credential},
            "delegationId": awcp_protocol::DelegationId::from_random_bytes(rand::random()).as_str(),
            "task": {"description": "d", "prompt": "p"},
            "lease": {"ttlSeconds": 60, "accessMode": mode}, "retentionMs": 1000,
            "environment": {"resources": [{"name": "w", "type": "fs", "mode": mode}]},
            "requirements": {"transport": transport}
        })
    };
    let post = |body: Value| {
        let awcp = awcp.clone();
        async move {
            reqwest::Client::new()
                .post(&awcp)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let b = post(invite("rw", "archive")).await;
    assert_eq!(
        (b["type"].as_str(), b["code"].as_str()),
        (Some("ERROR"), Some("DECLINED")),
        "{b}"
    );
    let b = post(invite("ro", "awcpfs")).await;
    assert_eq!(b["code"], "DEP_MISSING", "{b}");
    assert_eq!(b["hint"], "Delegate with one of: archive");
    let b = post(invite("ro", "archive")).await;
    assert_eq!(b["type"], "ACCEPT", "{b}");
    let b = post(invite("ro", "archive")).await;
    assert_eq!(b["code"], "DECLINED", "capacity: {b}");
    assert!(
        b["message"]
            .as_str()
            .unwrap()
            .contains("Maximum concurrent"),
        "{b}"
    );
    h.stop().await;
}

// Symptom: the sensitive-file check refused a delegation naming the first match it found;
// the user fixed that one, retried, and met the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sensitive_refusal_names_every_match_and_the_flags_that_pass() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let agent = format!(
        "cp vendor/dep0/release.key {}/seen.key 2>/dev/null || true",
        out.path().display()
    );
    let h = Harness::start(&agent).await;
    let dir = h.path("repo");
    std::fs::create_dir_all(dir.join("conf")).unwrap();
    std::fs::write(dir.join("main.py"), "print(1)\n").unwrap();
    std::fs::write(dir.join("conf/.env"), "TOKEN=secret\n").unwrap();
    for i in 0..12 {
        std::fs::create_dir_all(dir.join(format!("vendor/dep{i}"))).unwrap();
        std::fs::write(dir.join(format!("vendor/dep{i}/release.key")), "PUBLIC\n").unwrap();
    }
    let err = h
        .client
        .delegate(&request(&h, &dir, None, false))
        .await
        .unwrap_err();
    let ClientError::Refused { status, body } = err else {
        panic!("{err}")
    };
    assert_eq!(status, 400);
    assert_eq!(body.code.unwrap().as_str(), "SENSITIVE_FILES");
    assert!(
        body.error.starts_with("Sensitive files detected: ")
            && body.error.contains("conf/.env")
            && body.error.contains("vendor/dep0/release.key")
            && body.error.contains("and 3 more (13 in all)"),
        "{}",
        body.error
    );
    let hint = body.hint.unwrap();
    for flag in [
        "--exclude '.env'",
        "--exclude '*.key'",
        "--allow-sensitive '*.key'",
    ] {
        assert!(hint.contains(flag), "{flag} missing: {hint}");
    }
    // The excludes the hint names pass; the files stay out.
    let req = request(&h, &dir, Some(vec![".env".into(), "*.key".into()]), false);
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    assert_eq!(
        h.wait_end(id.as_str(), Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert!(!out.path().join("seen.key").exists());
    // Allowed explicitly, they are delegated.
    let mut req = request(&h, &dir, Some(vec![".env".into()]), false);
    req.environment.resources[0].allow_sensitive = Some(vec!["*.key".into()]);
    let id = h.client.delegate(&req).await.unwrap().delegation_id;
    assert_eq!(
        h.wait_end(id.as_str(), Duration::from_secs(60)).await,
        DelegationState::Completed
    );
    assert_eq!(
        std::fs::read_to_string(out.path().join("seen.key")).unwrap(),
        "PUBLIC\n"
    );
    h.stop().await;
}

// Symptom: with `--exclude '**/*.key'`, `git status` in the agent's workspace showed
// ` D rust-deps/…/llvm-snapshot.gpg.key`, and an agent's `git commit -a` recorded the
// deletion in the Delegator's own history.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn excluded_files_git_tracks_are_present_but_unreadable_never_deleted() {
    if !fuse_available() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let o = out.path().display();
    let key = "rust-deps/llvm/llvm-snapshot.gpg.key";
    let agent = format!(
        r#"set -e
        git status --porcelain > {o}/status.txt
        stat -c %s {key} > {o}/size.txt
        if cat {key} > {o}/leak.txt 2> {o}/cat.err; then echo read > {o}/read.txt; fi
        rm -f {key} 2> {o}/rm.err || echo refused > {o}/rm.txt
        mv {key} moved.key 2> {o}/mv.err || echo refused > {o}/mv.txt
        (echo overwrite > {key}) 2> {o}/write.err || echo refused > {o}/write.txt
        echo 'print(2)' >> main.py
        git -c user.email=a@x -c user.name=agent commit -qam 'agent change'
        git status --porcelain > {o}/status-after.txt
        "#
    );
    // As root (still under Landlock): git compares the index's owner with the mount's, and
    // under the agents' user every file looks changed, so `commit -a` would try to read
    // the excluded key (see docs/TROUBLESHOOTING.md).
    let h = Harness::start_with(&agent, |c| c.unsafe_agent_as_root = true).await;
    let dir = h.path("repo");
    std::fs::create_dir_all(dir.join("rust-deps/llvm")).unwrap();
    std::fs::write(dir.join("main.py"), "print(1)\n").unwrap();
    std::fs::write(dir.join(key), "-----BEGIN PGP PUBLIC KEY BLOCK-----\n").unwrap();
    std::fs::write(dir.join("rust-deps/llvm/README"), "llvm\n").unwrap();
    // Old mtimes, so no entry of the index is racily clean (git would read it again).
    awcp_tests::sh(
        &dir,
        "touch -d 2020-01-01 main.py rust-deps/llvm/* && git init -q -b main && \
         git add -A && git -c user.email=d@x -c user.name=d commit -qm initial && \
         git status --porcelain",
    );
    let id = h
        .client
        .delegate(&request(&h, &dir, Some(vec!["**/*.key".into()]), false))
        .await
        .unwrap()
        .delegation_id;
    let state = h.wait_end(id.as_str(), Duration::from_secs(90)).await;
    let recorded: Vec<String> = std::fs::read_dir(out.path())
        .unwrap()
        .flatten()
        .map(|e| {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            format!("{}: {text}", e.file_name().to_string_lossy())
        })
        .collect();
    assert_eq!(
        state,
        DelegationState::Completed,
        "what the agent recorded: {recorded:#?}\n{:?}",
        h.client.get(id.as_str()).await.map(|v| v.record.error)
    );
    let read = |f: &str| std::fs::read_to_string(out.path().join(f)).unwrap_or_default();
    assert_eq!(read("status.txt"), "", "git status on the mount is clean");
    assert_eq!(
        read("size.txt").trim(),
        "37",
        "stat as the Delegator has it"
    );
    assert!(read("read.txt").is_empty(), "the content was readable");
    assert_eq!(read("leak.txt"), "", "content left the Delegator");
    assert!(
        read("cat.err").contains("Permission denied"),
        "{}",
        read("cat.err")
    );
    for what in ["rm.txt", "mv.txt", "write.txt"] {
        assert_eq!(read(what).trim(), "refused", "{what}");
    }
    assert_eq!(
        read("status-after.txt"),
        "",
        "clean after the agent's commit"
    );
    // The Delegator: the agent's commit changed main.py only, the key is as it was, and
    // the working tree is clean.
    assert_eq!(
        awcp_tests::sh(&dir, "git show --name-status --format= HEAD"),
        "M\tmain.py\n"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join(key)).unwrap(),
        "-----BEGIN PGP PUBLIC KEY BLOCK-----\n"
    );
    assert_eq!(awcp_tests::sh(&dir, "git status --porcelain"), "");
    h.stop().await;
}
