//! Every file in `tests/fixtures/` parses into the type its name says and re-serializes to
//! exactly the same bytes.
//!
//! File names are `<category>.<kind>[.<variant>].json`:
//! * `message.<type>` — an [`AwcpMessage`] of that `type` (lowercased), parsed with
//!   [`parse_message`];
//! * `event.<type>` — a [`TaskEvent`] of that `type`, parsed with [`parse_event`];
//! * `transport.<transport>` — a [`TransportHandle`], parsed with [`parse_transport_handle`];
//! * `api.<body>` — one of the HTTP bodies of [`awcp_protocol::api`], by name.
//!
//! Canonical form: `serde_json::to_string_pretty` plus a trailing newline. So the fixtures
//! also pin the field order of every struct, and any field that is dropped, renamed or
//! reordered by a change fails here.

use std::path::{Path, PathBuf};

use awcp_protocol::api::{
    ApiError, CancelResponse, ContinueRequest, ContinueResponse, DelegateRequest, DelegateResponse,
    DelegationList, DelegationRecord, ExecutorStatus, HealthResponse, InviteReply, OkResponse,
    SnapshotList, TaskResultResponse,
};
use awcp_protocol::{
    AwcpMessage, TaskEvent, TransportHandle, parse_event, parse_message, parse_transport_handle,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

fn fixtures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    files
}

fn canonical<T: Serialize>(value: &T) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap();
    text.push('\n');
    text
}

/// Parse `text` as `T` and check it re-serializes to the same bytes.
fn round_trip<T: Serialize + DeserializeOwned>(name: &str, text: &str) {
    let value: T = serde_json::from_str(text).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(canonical(&value), text, "{name} does not round-trip");
}

/// Check the file and return `(category, kind)`.
fn check(path: &Path) -> (String, String) {
    let name = path.file_name().unwrap().to_str().unwrap().to_owned();
    let text = std::fs::read_to_string(path).unwrap();
    let stem = name
        .strip_suffix(".json")
        .unwrap_or_else(|| panic!("{name}: not a .json file"));
    let mut parts = stem.split('.');
    let category = parts.next().unwrap().to_owned();
    let kind = parts
        .next()
        .unwrap_or_else(|| panic!("{name}: no kind in the name"))
        .to_owned();
    match category.as_str() {
        "message" => {
            let msg = parse_message(text.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(msg.kind(), kind.to_uppercase(), "{name}");
            assert_eq!(canonical(&msg), text, "{name} does not round-trip");
        }
        "event" => {
            let event = parse_event(text.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(event.kind(), kind, "{name}");
            assert_eq!(canonical(&event), text, "{name} does not round-trip");
        }
        "transport" => {
            let handle =
                parse_transport_handle(text.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(handle.transport_type().as_str(), kind, "{name}");
            assert_eq!(canonical(&handle), text, "{name} does not round-trip");
        }
        "api" => match kind.as_str() {
            "delegate_request" => round_trip::<DelegateRequest>(&name, &text),
            "delegate_response" => round_trip::<DelegateResponse>(&name, &text),
            "delegation_list" => round_trip::<DelegationList>(&name, &text),
            "delegation_record" => round_trip::<DelegationRecord>(&name, &text),
            "snapshot_list" => round_trip::<SnapshotList>(&name, &text),
            "error" => round_trip::<ApiError>(&name, &text),
            "ok" => round_trip::<OkResponse>(&name, &text),
            "health" => round_trip::<HealthResponse>(&name, &text),
            "continue_request" => round_trip::<ContinueRequest>(&name, &text),
            "continue_response" => round_trip::<ContinueResponse>(&name, &text),
            "cancel_response" => round_trip::<CancelResponse>(&name, &text),
            "task_result" => round_trip::<TaskResultResponse>(&name, &text),
            "executor_status" => round_trip::<ExecutorStatus>(&name, &text),
            "invite_reply" => round_trip::<InviteReply>(&name, &text),
            other => panic!("{name}: no API body named {other:?}"),
        },
        other => panic!("{name}: unknown fixture category {other:?}"),
    }
    (category, kind)
}

#[test]
fn every_fixture_round_trips_byte_for_byte() {
    let files = fixtures();
    assert!(!files.is_empty(), "no fixtures found");
    for path in &files {
        check(path);
    }
}

#[test]
fn every_message_event_and_transport_kind_has_a_fixture() {
    let seen: Vec<(String, String)> = fixtures().iter().map(|p| check(p)).collect();
    let has = |category: &str, kind: &str| seen.iter().any(|(c, k)| c == category && k == kind);
    for kind in AwcpMessage::KINDS {
        assert!(
            has("message", &kind.to_lowercase()),
            "no fixture for message {kind}"
        );
    }
    for kind in TaskEvent::KINDS {
        assert!(has("event", kind), "no fixture for event {kind}");
    }
    for kind in TransportHandle::KINDS {
        assert!(has("transport", kind), "no fixture for transport {kind}");
    }
}

#[test]
fn archive_fixture_is_a_zip_with_a_sha256_hex_checksum() {
    // The payload is a real zip (base64 of "PK\x03\x04" starts with "UEsDB") and the
    // checksum has the reference's shape: 64 lowercase hex digits. (Its value is the zip's
    // sha256, computed when the fixture was written; checking it needs a hash dependency.)
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transport.archive.json");
    let text = std::fs::read_to_string(path).unwrap();
    let TransportHandle::Archive(handle) = parse_transport_handle(text.as_bytes()).unwrap() else {
        panic!("transport.archive.json is not an archive handle");
    };
    assert!(handle.workspace_base64.starts_with("UEsDB"));
    assert_eq!(handle.checksum.len(), 64);
    assert!(
        handle
            .checksum
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    );
}
