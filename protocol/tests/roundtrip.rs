//! Property tests of the codecs: arbitrary messages, events and transport handles survive
//! JSON; every top-level field is either required (and named when missing) or optional; a
//! version other than "1" is always named; no input makes a parser panic.

use std::collections::BTreeMap;

use awcp_protocol::events::{
    DoneEvent, ErrorEvent, RoundDoneEvent, RunStatus, SnapshotEvent, SnapshotMetadata, StatusEvent,
};
use awcp_protocol::messages::{
    AcceptMessage, AccessMode, ActiveLease, AuthCredential, AuthType, CloseMessage,
    ContinueMessage, DoneMessage, EnvironmentDeclaration, ErrorMessage, ExecutorConstraints,
    ExecutorWorkDir, InviteMessage, LeaseConfig, Requirements, ResourceDeclaration, ResourceType,
    SandboxProfile, StartMessage, TaskSpec,
};
use awcp_protocol::transport::{
    ArchiveHandle, AwcpfsHandle, GitCredential, GitHandle, SshCredential, SshEndpoint, SshfsHandle,
    StorageHandle,
};
use awcp_protocol::{
    AwcpMessage, DelegationId, ErrorCode, ProtocolError, ProtocolVersion, TaskEvent,
    TransportHandle, TransportType, parse_event, parse_message, parse_transport_handle,
};
use proptest::option::of;
use proptest::prelude::*;
use serde_json::Value;

fn text() -> impl Strategy<Value = String> {
    any::<String>()
}

fn strings() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(text(), 0..4)
}

fn string_map() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(text(), text(), 0..4)
}

fn id() -> impl Strategy<Value = DelegationId> {
    any::<[u8; 16]>().prop_map(DelegationId::from_random_bytes)
}

fn code() -> impl Strategy<Value = ErrorCode> {
    prop_oneof![
        prop::sample::select(ErrorCode::KNOWN.to_vec()),
        text().prop_map(|s| ErrorCode::from_wire(&s)),
    ]
}

fn access() -> impl Strategy<Value = AccessMode> {
    prop_oneof![Just(AccessMode::Ro), Just(AccessMode::Rw)]
}

fn task() -> impl Strategy<Value = TaskSpec> {
    (text(), text()).prop_map(|(description, prompt)| TaskSpec {
        description,
        prompt,
    })
}

fn active_lease() -> impl Strategy<Value = ActiveLease> {
    (text(), access()).prop_map(|(expires_at, access_mode)| ActiveLease {
        expires_at,
        access_mode,
    })
}

fn transport_type() -> impl Strategy<Value = TransportType> {
    prop::sample::select(vec![
        TransportType::Sshfs,
        TransportType::Archive,
        TransportType::Storage,
        TransportType::Git,
        TransportType::Awcpfs,
    ])
}

fn transport_handle() -> impl Strategy<Value = TransportHandle> {
    let archive = (text(), text()).prop_map(|(workspace_base64, checksum)| {
        TransportHandle::Archive(ArchiveHandle {
            workspace_base64,
            checksum,
        })
    });
    let sshfs = (
        (text(), any::<u16>(), text()),
        text(),
        (text(), text()),
        of(string_map()),
        of(text()),
    )
        .prop_map(
            |(
                (host, port, user),
                export_locator,
                (private_key, certificate),
                options,
                host_key,
            )| {
                TransportHandle::Sshfs(SshfsHandle {
                    endpoint: SshEndpoint { host, port, user },
                    export_locator,
                    credential: SshCredential {
                        private_key,
                        certificate,
                    },
                    options,
                    host_key,
                })
            },
        );
    let storage = (text(), text(), text(), text(), of(string_map())).prop_map(
        |(download_url, upload_url, checksum, expires_at, headers)| {
            TransportHandle::Storage(StorageHandle {
                download_url,
                upload_url,
                checksum,
                expires_at,
                headers,
            })
        },
    );
    let git_auth = prop_oneof![
        text().prop_map(|token| GitCredential::Token { token }),
        of(text()).prop_map(|private_key| GitCredential::Ssh { private_key }),
        Just(GitCredential::None),
    ];
    let git = (text(), text(), text(), of(git_auth)).prop_map(
        |(repo_url, base_branch, base_commit, auth)| {
            TransportHandle::Git(GitHandle {
                repo_url,
                base_branch,
                base_commit,
                auth,
            })
        },
    );
    let awcpfs = (
        text(),
        text(),
        text(),
        text(),
        any::<u32>(),
        text(),
        of(text()),
    )
        .prop_map(
            |(endpoint, token, export_id, manifest_digest, block_size, expires_at, tls)| {
                TransportHandle::Awcpfs(AwcpfsHandle {
                    endpoint,
                    token,
                    export_id,
                    manifest_digest,
                    block_size,
                    expires_at,
                    tls_fingerprint: tls,
                    remaining_ms: None,
                    resources: None,
                })
            },
        );
    prop_oneof![archive, sshfs, storage, git, awcpfs]
}

fn invite() -> impl Strategy<Value = AwcpMessage> {
    let resource = (text(), access()).prop_map(|(name, mode)| ResourceDeclaration {
        name,
        resource_type: ResourceType::Fs,
        mode,
    });
    let auth_type = prop::sample::select(vec![
        AuthType::ApiKey,
        AuthType::Bearer,
        AuthType::Oauth2,
        AuthType::Custom,
    ]);
    let auth =
        (auth_type, text(), of(string_map())).prop_map(|(auth_type, credential, metadata)| {
            AuthCredential {
                auth_type,
                credential,
                metadata,
            }
        });
    (
        id(),
        task(),
        (any::<u64>(), access()),
        any::<u64>(),
        prop::collection::vec(resource, 0..3),
        of(of(transport_type())),
        of(auth),
    )
        .prop_map(
            |(delegation_id, task, (ttl, mode), retention_ms, resources, req, auth)| {
                AwcpMessage::Invite(InviteMessage {
                    version: ProtocolVersion,
                    delegation_id,
                    task,
                    lease: LeaseConfig {
                        ttl_seconds: ttl,
                        access_mode: mode,
                    },
                    retention_ms,
                    environment: EnvironmentDeclaration { resources },
                    requirements: req.map(|transport| Requirements {
                        transport,
                        sandbox_profile: None,
                    }),
                    auth,
                    multi_round: None,
                })
            },
        )
}

fn accept() -> impl Strategy<Value = AwcpMessage> {
    let sandbox = (of(any::<bool>()), of(any::<bool>()), of(any::<bool>())).prop_map(
        |(cwd_only, allow_network, allow_exec)| SandboxProfile {
            cwd_only,
            allow_network,
            allow_exec,
        },
    );
    let constraints = (of(access()), of(any::<u64>()), of(sandbox)).prop_map(
        |(accepted_access_mode, max_ttl_seconds, sandbox_profile)| ExecutorConstraints {
            accepted_access_mode,
            max_ttl_seconds,
            sandbox_profile,
        },
    );
    (id(), any::<u64>(), text(), of(constraints)).prop_map(
        |(delegation_id, retention_ms, path, executor_constraints)| {
            AwcpMessage::Accept(AcceptMessage {
                version: ProtocolVersion,
                delegation_id,
                retention_ms,
                executor_work_dir: ExecutorWorkDir { path },
                executor_constraints,
            })
        },
    )
}

fn message() -> impl Strategy<Value = AwcpMessage> {
    let start = (id(), active_lease(), transport_handle()).prop_map(
        |(delegation_id, lease, transport_handle)| {
            AwcpMessage::Start(StartMessage {
                version: ProtocolVersion,
                delegation_id,
                lease,
                transport_handle,
            })
        },
    );
    let done = (id(), text(), of(strings()), of(text())).prop_map(
        |(delegation_id, final_summary, highlights, notes)| {
            AwcpMessage::Done(DoneMessage {
                version: ProtocolVersion,
                delegation_id,
                final_summary,
                highlights,
                notes,
            })
        },
    );
    let error = (id(), code(), text(), of(text())).prop_map(|(delegation_id, code, msg, hint)| {
        AwcpMessage::Error(ErrorMessage {
            version: ProtocolVersion,
            delegation_id,
            code,
            message: msg,
            hint,
        })
    });
    let cont = (id(), task(), any::<u32>(), of(active_lease())).prop_map(
        |(delegation_id, task, round, lease)| {
            AwcpMessage::Continue(ContinueMessage {
                version: ProtocolVersion,
                delegation_id,
                task,
                round,
                lease,
            })
        },
    );
    let close = id().prop_map(|delegation_id| AwcpMessage::Close(CloseMessage::new(delegation_id)));
    prop_oneof![invite(), accept(), start, done, error, cont, close]
}

fn metadata() -> impl Strategy<Value = SnapshotMetadata> {
    // Extra keys must not collide with the named fields, or they would not be extra.
    let extra_value = prop_oneof![
        text().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<bool>().prop_map(Value::from),
    ];
    (
        of(any::<u64>()),
        of(any::<u64>()),
        of(strings()),
        prop::collection::btree_map("x_[a-z]{1,8}", extra_value, 0..3),
    )
        .prop_map(
            |(file_count, total_bytes, changed_files, extra)| SnapshotMetadata {
                file_count,
                total_bytes,
                changed_files,
                extra: extra.into_iter().collect(),
            },
        )
}

fn event() -> impl Strategy<Value = TaskEvent> {
    // Progress values with few significant digits: serde_json (without `float_roundtrip`)
    // parses those exactly; arbitrary f64 bit patterns are not a wire concern.
    let progress = (0u32..=100_000).prop_map(|i| f64::from(i) / 1000.0);
    let status = (
        id(),
        text(),
        prop_oneof![Just(RunStatus::Running), Just(RunStatus::Progress)],
        of(text()),
        of(progress),
    )
        .prop_map(|(delegation_id, timestamp, status, message, progress)| {
            TaskEvent::Status(StatusEvent {
                delegation_id,
                timestamp,
                status,
                message,
                progress,
            })
        });
    let snapshot = (
        (id(), text()),
        (text(), text(), of(strings()), text()),
        (of(any::<bool>()), of(metadata())),
    )
        .prop_map(
            |(
                (delegation_id, timestamp),
                (snapshot_id, summary, highlights, snapshot_base64),
                (recommended, metadata),
            )| {
                TaskEvent::Snapshot(SnapshotEvent {
                    delegation_id,
                    timestamp,
                    snapshot_id,
                    summary,
                    highlights,
                    snapshot_base64,
                    recommended,
                    metadata,
                })
            },
        );
    let done = (
        id(),
        text(),
        text(),
        of(strings()),
        of(strings()),
        of(text()),
    )
        .prop_map(
            |(delegation_id, timestamp, summary, highlights, snapshot_ids, recommended)| {
                TaskEvent::Done(DoneEvent {
                    delegation_id,
                    timestamp,
                    summary,
                    highlights,
                    snapshot_ids,
                    recommended_snapshot_id: recommended,
                })
            },
        );
    let error = (id(), text(), code(), text(), of(text())).prop_map(
        |(delegation_id, timestamp, code, message, hint)| {
            TaskEvent::Error(ErrorEvent {
                delegation_id,
                timestamp,
                code,
                message,
                hint,
            })
        },
    );
    let round_done = (
        id(),
        text(),
        any::<u32>(),
        text(),
        of(strings()),
        of(strings()),
        of(text()),
    )
        .prop_map(
            |(delegation_id, timestamp, round, summary, highlights, snapshot_ids, recommended)| {
                TaskEvent::RoundDone(RoundDoneEvent {
                    delegation_id,
                    timestamp,
                    round,
                    summary,
                    highlights,
                    snapshot_ids,
                    recommended_snapshot_id: recommended,
                })
            },
        );
    prop_oneof![status, snapshot, done, error, round_done]
}

/// Ok, or an error with a non-empty explanation.
fn explained<T>(result: Result<T, ProtocolError>) -> bool {
    result.map_or_else(|e| !e.to_string().is_empty(), |_| true)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn messages_round_trip(msg in message()) {
        let compact = serde_json::to_vec(&msg).unwrap();
        prop_assert_eq!(&parse_message(&compact).unwrap(), &msg);
        let pretty = serde_json::to_vec_pretty(&msg).unwrap();
        prop_assert_eq!(&parse_message(&pretty).unwrap(), &msg);
        let value = serde_json::to_value(&msg).unwrap();
        prop_assert_eq!(&value["type"], msg.kind());
        prop_assert_eq!(&value["version"], "1");
        prop_assert_eq!(&value["delegationId"], msg.delegation_id().as_str());
    }

    #[test]
    fn events_round_trip(event in event()) {
        let json = serde_json::to_vec(&event).unwrap();
        prop_assert_eq!(&parse_event(&json).unwrap(), &event);
        let value = serde_json::to_value(&event).unwrap();
        prop_assert_eq!(&value["type"], event.kind());
        prop_assert_eq!(&value["timestamp"], event.timestamp());
    }

    #[test]
    fn transport_handles_round_trip(handle in transport_handle()) {
        let json = serde_json::to_vec(&handle).unwrap();
        prop_assert_eq!(&parse_transport_handle(&json).unwrap(), &handle);
        let value = serde_json::to_value(&handle).unwrap();
        prop_assert_eq!(&value["transport"], handle.transport_type().as_str());
    }

    #[test]
    fn any_other_version_is_named(msg in message(), version in any::<String>()) {
        prop_assume!(version != "1");
        let mut value = serde_json::to_value(&msg).unwrap();
        value["version"] = Value::from(version.clone());
        let err = parse_message(&serde_json::to_vec(&value).unwrap()).unwrap_err();
        match err {
            ProtocolError::UnsupportedVersion { received } => {
                prop_assert_eq!(received, Value::from(version).to_string());
            }
            other => prop_assert!(false, "got {:?}", other),
        }
    }

    #[test]
    fn each_field_is_required_and_named_or_optional(msg in message()) {
        let value = serde_json::to_value(&msg).unwrap();
        for key in value.as_object().unwrap().keys().filter(|k| *k != "type") {
            let mut without = value.clone();
            without.as_object_mut().unwrap().remove(key);
            match parse_message(&serde_json::to_vec(&without).unwrap()) {
                Err(ProtocolError::MissingField { field, .. }) => prop_assert_eq!(&field, key),
                Err(other) => prop_assert!(false, "removing {} gave {:?}", key, other),
                Ok(parsed) => {
                    // Accepted without it: then it is optional, and stays absent.
                    let back = serde_json::to_value(&parsed).unwrap();
                    prop_assert!(back.get(key.as_str()).is_none(), "{} reappeared", key);
                }
            }
        }
    }

    #[test]
    fn truncated_messages_are_malformed_json(msg in message(), cut in any::<prop::sample::Index>()) {
        let json = serde_json::to_vec(&msg).unwrap();
        let prefix = &json[..cut.index(json.len())];
        let is_malformed = matches!(parse_message(prefix), Err(ProtocolError::MalformedJson { .. }));
        prop_assert!(is_malformed);
    }

    #[test]
    fn mutated_bytes_never_panic(
        msg in message(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut json = serde_json::to_vec(&msg).unwrap();
        for (at, byte) in flips {
            let i = at.index(json.len());
            json[i] = byte;
        }
        // Not panicking is the property; beyond that, an accepted mutation must still be a
        // well-formed message, and a refusal must explain itself.
        match parse_message(&json) {
            Ok(parsed) => prop_assert!(AwcpMessage::KINDS.contains(&parsed.kind())),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        prop_assert!(explained(parse_event(&json)));
        prop_assert!(explained(parse_transport_handle(&json)));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        prop_assert!(explained(parse_message(&bytes)));
        prop_assert!(explained(parse_event(&bytes)));
        prop_assert!(explained(parse_transport_handle(&bytes)));
    }
}

/// What the reference's `storage` and `git` Executors put in a `snapshot` event's
/// `snapshotBase64` (JSON text, not base64), field for field
/// (`packages/transport-storage/src/executor/transport.ts`,
/// `packages/transport-git/src/{types,executor/transport}.ts`).
#[test]
fn storage_and_git_snapshot_infos_have_the_reference_shape() {
    use awcp_protocol::transport::{GitSnapshotInfo, StorageSnapshotInfo};
    let s = StorageSnapshotInfo {
        result_url: "http://d:3101/storage/dlg_1/ab/result.zip".into(),
    };
    assert_eq!(
        serde_json::to_string(&s).unwrap(),
        r#"{"resultUrl":"http://d:3101/storage/dlg_1/ab/result.zip"}"#
    );
    let reference = r#"{"branch":"awcp/dlg_1","commitHash":"c0ffee","baseCommit":"ba5e","changedFiles":["workspace/a.py","workspace/b.txt"]}"#;
    let g: GitSnapshotInfo = serde_json::from_str(reference).unwrap();
    assert_eq!(g.branch, "awcp/dlg_1");
    assert_eq!(g.changed_files.len(), 2);
    assert_eq!(serde_json::to_string(&g).unwrap(), reference);
    // A missing field is an error, not a silent default.
    assert!(serde_json::from_str::<GitSnapshotInfo>(r#"{"branch":"x"}"#).is_err());
    assert!(serde_json::from_str::<StorageSnapshotInfo>("{}").is_err());
}

/// START's `storage` and `git` handles as our daemon sends them, in the reference's
/// field names (`packages/core/src/types/transport.ts`); `headers` and `auth` left out
/// when absent, as the reference never sends `null`.
#[test]
fn storage_and_git_handles_have_the_reference_shape() {
    let storage = TransportHandle::Storage(StorageHandle {
        download_url: "http://d/storage/dlg_1/s/workspace.zip".into(),
        upload_url: "http://d/storage/dlg_1/s/result.zip".into(),
        checksum: "ab".repeat(32),
        expires_at: "2026-03-09T14:38:47.123Z".into(),
        headers: None,
    });
    let v = serde_json::to_value(&storage).unwrap();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "checksum",
            "downloadUrl",
            "expiresAt",
            "transport",
            "uploadUrl"
        ]
    );
    assert_eq!(v["transport"], "storage");
    let git = TransportHandle::Git(GitHandle {
        repo_url: "git://127.0.0.1:9418/ws.git".into(),
        base_branch: "awcp-base/dlg_1".into(),
        base_commit: "c0ffee".into(),
        auth: Some(GitCredential::Token {
            token: "t0k".into(),
        }),
    });
    assert_eq!(
        serde_json::to_string(&git).unwrap(),
        r#"{"transport":"git","repoUrl":"git://127.0.0.1:9418/ws.git","baseBranch":"awcp-base/dlg_1","baseCommit":"c0ffee","auth":{"type":"token","token":"t0k"}}"#
    );
    // The reference's delegator, with `auth: {type: "none"}`, parses too.
    let reference = r#"{"transport":"git","repoUrl":"https://g/r.git","baseBranch":"main","baseCommit":"c0ffee","auth":{"type":"none"}}"#;
    let back = awcp_protocol::parse_transport_handle(reference.as_bytes()).unwrap();
    assert!(matches!(
        back,
        TransportHandle::Git(GitHandle {
            auth: Some(GitCredential::None),
            ..
        })
    ));
}

/// Ours, additive: `gitRemote` in `POST /delegate`, absent unless given.
#[test]
fn delegate_request_names_a_git_remote_only_when_given() {
    let text = r#"{"executorUrl":"http://e/awcp","environment":{"resources":[]},"task":{"description":"d","prompt":"p"},"transport":"git","gitRemote":"git://h/r.git"}"#;
    let req: awcp_protocol::api::DelegateRequest = serde_json::from_str(text).unwrap();
    assert_eq!(req.git_remote.as_deref(), Some("git://h/r.git"));
    assert_eq!(req.transport, Some(TransportType::Git));
    let mut req = req;
    req.git_remote = None;
    let back = serde_json::to_string(&req).unwrap();
    assert!(!back.contains("gitRemote"), "{back}");
}
