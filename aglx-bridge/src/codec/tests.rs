use super::*;
use crate::security::{Keys, Policy, Verifier, mac_matches, sign};
use proptest::prelude::*;

fn tcp(buf: &[u8]) -> Result<Option<Decoded>, FrameError> {
    decode_stream(buf, &Limits::TCP)
}

fn whole(buf: &[u8]) -> Frame {
    let d = tcp(buf).unwrap().unwrap();
    assert_eq!(d.len, buf.len());
    d.frame
}

/// Our own byte-exact vector: a CRLF frame exactly as `Frame::encode` writes it.
const VECTOR_CRLF: &[u8] = b"AGLX/1.0 TCP\r\n\
FROM: agent://alpha.local\r\n\
TO: agent://beta.local\r\n\
TYPE: status.report\r\n\
CONTENT-TYPE: application/json\r\n\
CONTENT-LENGTH: 19\r\n\
STATUS: 200\r\n\
\r\n\
{\"state\":\"running\"}";

#[test]
fn vector_crlf_decodes_and_reencodes_byte_exact() {
    let f = whole(VECTOR_CRLF);
    assert_eq!(f.from.as_ref().unwrap().to_string(), "agent://alpha.local");
    assert_eq!(
        f.to,
        Some(Recipient::Agent("agent://beta.local".parse().unwrap()))
    );
    assert_eq!(f.msg_type, Some(MessageType::StatusReport));
    assert_eq!(f.status, Some(Status::Ok));
    assert!(f.content_type_json);
    assert_eq!(f.body, "{\"state\":\"running\"}");
    assert_eq!(f.encode().unwrap(), VECTOR_CRLF);
    // Miscounting the body by two bytes (as the seed does by 35) cuts the JSON short.
    let short = String::from_utf8(VECTOR_CRLF.to_vec())
        .unwrap()
        .replace("CONTENT-LENGTH: 19", "CONTENT-LENGTH: 17");
    assert_eq!(tcp(short.as_bytes()).unwrap_err(), FrameError::BadBody);
}

#[test]
fn lf_and_crlf_line_ends_are_equivalent() {
    let lf = b"AGLX/1.0 TCP\nFROM: agent://a.b\nTYPE: handshake\n\n";
    let crlf = b"AGLX/1.0 TCP\r\nFROM: agent://a.b\r\nTYPE: handshake\r\n\r\n";
    assert_eq!(whole(lf), whole(crlf));
}

#[test]
fn partial_input_asks_for_more_until_complete() {
    let bytes = Frame::new(Transport::Tcp, MessageType::TaskAssign)
        .from("agent://a.b".parse().unwrap())
        .json(&serde_json::json!({"k": [1, 2, 3]}))
        .encode()
        .unwrap();
    for cut in 0..bytes.len() {
        assert_eq!(tcp(&bytes[..cut]), Ok(None), "cut at {cut}");
    }
    let mut two = bytes.clone();
    two.extend_from_slice(&bytes);
    let d = tcp(&two).unwrap().unwrap();
    assert_eq!(d.len, bytes.len());
}

#[test]
fn the_seeds_examples_as_written_are_refused() {
    // The seed's TCP example: CONTENT-LENGTH 156 for a 121-byte body missing a brace, and a
    // blank line holding one space.
    let seed_tcp = "AGLX/1.0 TCP\nFROM: agent://alpha.local\nTO: agent://beta.local\nTYPE: task.assign\nCREDITS: 2\nCONTENT-TYPE: application/json\nCONTENT-LENGTH: 156\n \n{\n  \"task\": \"analyze.dataset\",\n  \"priority\": 3,\n  \"payload\": {\n  \"dataset_url\": \"http://alpha.local/data/sample.csv\"\n}\n";
    assert!(matches!(
        tcp(seed_tcp.as_bytes()),
        Err(FrameError::BadHeaderLine { .. })
    ));
    let fixed_blank = seed_tcp.replace("\n \n", "\n\n");
    // Now the declared length exceeds what is there: a stream waits for more...
    assert_eq!(tcp(fixed_blank.as_bytes()), Ok(None));
    // ... and padding it to 156 bytes still is not JSON (the missing brace).
    let mut padded = fixed_blank.into_bytes();
    padded.resize(padded.len() + 40, b' ');
    assert_eq!(tcp(&padded).unwrap_err(), FrameError::BadBody);
    // The seed's UDP example says `TYPE: announce`; the type list says agent.announce. Both
    // decode (unknown types are kept as Other), the bridge acts only on agent.announce.
    let seed_udp = "AGLX/1.0 UDP\nFROM: agent://gamma.local\nTYPE: announce\nCONTENT-TYPE: application/json\n\n{\n  \"agent_name\": \"Gamma\",\n  \"uptime\": 3921\n}\n";
    let d = decode_datagram(seed_udp.as_bytes(), &Limits::UDP).unwrap();
    assert_eq!(
        d.frame.msg_type,
        Some(MessageType::Other("announce".into()))
    );
}

fn examples() -> Vec<(String, Vec<u8>)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/aglx-examples");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    assert!(out.len() >= 6, "examples missing from {}", dir.display());
    out
}

#[test]
fn doc_examples_decode_exactly_and_appear_verbatim_in_protocol_md() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/PROTOCOL.md"),
    )
    .unwrap();
    for (name, bytes) in examples() {
        let d = if name.contains("announce") {
            decode_datagram(&bytes, &Limits::UDP).unwrap()
        } else {
            tcp(&bytes).unwrap().unwrap()
        };
        assert_eq!(d.len, bytes.len(), "{name}: trailing bytes");
        // Re-encoding with LF line ends gives the same bytes (our canonical header order).
        let lf = String::from_utf8(d.frame.encode().unwrap())
            .unwrap()
            .replace("\r\n", "\n");
        if d.frame.signature.is_none() {
            assert_eq!(lf.as_bytes(), &bytes[..], "{name}: not in canonical order");
        }
        let text = String::from_utf8(bytes).unwrap();
        assert!(
            doc.contains(&format!("```text\n{text}\n```")),
            "{name} is not quoted verbatim in docs/PROTOCOL.md"
        );
    }
}

#[test]
fn doc_signed_example_verifies_with_the_documented_key() {
    let (_, bytes) = examples()
        .into_iter()
        .find(|(n, _)| n.contains("signed"))
        .unwrap();
    let d = tcp(&bytes).unwrap().unwrap();
    assert!(mac_matches(&bytes, &d, b"example-zone-key"));
    let v = Verifier::new(Policy {
        keys: Keys::new().with("lab.example", b"example-zone-key".to_vec()),
        ..Policy::default()
    });
    assert_eq!(v.check(&bytes, &d, 1_764_460_800 + 10), Ok(()));
    assert!(v.check(&bytes, &d, 1_764_460_800 + 20).is_err());
}

#[test]
fn strictness_table() {
    let ok = "AGLX/1.0 TCP\nFROM: agent://a.b\nTYPE: handshake\n\n";
    assert!(tcp(ok.as_bytes()).unwrap().is_some());
    let cases: &[(&str, FrameError)] = &[
        (
            "AGLX/2.0 TCP\n\n",
            FrameError::UnsupportedVersion { major: 2, minor: 0 },
        ),
        (
            "AGLX/1.0 UDP\n\n",
            FrameError::WrongTransport {
                expected: "TCP",
                found: "UDP",
            },
        ),
        ("AGLX/1.0  TCP\n\n", FrameError::BadStartLine),
        ("AGLX/01.0 TCP\n\n", FrameError::BadStartLine),
        ("aglx/1.0 TCP\n\n", FrameError::BadStartLine),
        ("AGLX/1.0 TCP \n\n", FrameError::BadStartLine),
        (
            "AGLX/1.0 TCP\nFROM : agent://a.b\n\n",
            FrameError::BadHeaderLine { line: 2 },
        ),
        (
            "AGLX/1.0 TCP\n FROM: agent://a.b\n\n",
            FrameError::BadHeaderLine { line: 2 },
        ),
        (
            "AGLX/1.0 TCP\nFROM agent://a.b\n\n",
            FrameError::BadHeaderLine { line: 2 },
        ),
        (
            "AGLX/1.0 TCP\nFROM: agent://a.b\nfrom: agent://a.b\n\n",
            FrameError::DuplicateHeader {
                name: "FROM".into(),
            },
        ),
        (
            "AGLX/1.0 TCP\nCONTENT-LENGTH: 2\nCONTENT-LENGTH: 2\n\n{}",
            FrameError::DuplicateHeader {
                name: "CONTENT-LENGTH".into(),
            },
        ),
        (
            "AGLX/1.0 TCP\nCONTENT-LENGTH: +2\n\n{}",
            FrameError::ContentLength,
        ),
        (
            "AGLX/1.0 TCP\nCONTENT-LENGTH: 02\n\n{}",
            FrameError::ContentLength,
        ),
        (
            "AGLX/1.0 TCP\nCONTENT-LENGTH: 2 2\n\n{}",
            FrameError::ContentLength,
        ),
        (
            "AGLX/1.0 TCP\nCONTENT-LENGTH: 0x2\n\n{}",
            FrameError::ContentLength,
        ),
        (
            "AGLX/1.0 TCP\nCONTENT-LENGTH: 99999999999999999999\n\n",
            FrameError::ContentLength,
        ),
        (
            "AGLX/1.0 TCP\nCONTENT-LENGTH: 2000000\n\n",
            FrameError::BodyTooLarge {
                size: 2_000_000,
                limit: 1024 * 1024,
            },
        ),
        (
            "AGLX/1.0 TCP\nX-A: a\rb\n\n",
            FrameError::BareCarriageReturn,
        ),
        (
            "AGLX/1.0 TCP\nX-A: a\0b\n\n",
            FrameError::BadHeaderValue { name: "X-A".into() },
        ),
        (
            "AGLX/1.0 TCP\nX-A:\n\n",
            FrameError::BadHeaderValue { name: "X-A".into() },
        ),
        (
            "AGLX/1.0 TCP\nTYPE: Task Assign\n\n",
            FrameError::BadHeaderValue {
                name: "TYPE".into(),
            },
        ),
        (
            "AGLX/1.0 TCP\nFROM: agent:alpha.local\n\n",
            FrameError::BadHeaderValue {
                name: "FROM".into(),
            },
        ),
        (
            "AGLX/1.0 TCP\nSTATUS: 201\n\n",
            FrameError::BadHeaderValue {
                name: "STATUS".into(),
            },
        ),
        (
            "AGLX/1.0 TCP\nCREDITS: -1\n\n",
            FrameError::BadHeaderValue {
                name: "CREDITS".into(),
            },
        ),
        (
            "AGLX/1.0 TCP\nNONCE: short\n\n",
            FrameError::BadHeaderValue {
                name: "NONCE".into(),
            },
        ),
        (
            "AGLX/1.0 TCP\nSIGNATURE: ABCD\n\n",
            FrameError::BadHeaderValue {
                name: "SIGNATURE".into(),
            },
        ),
        (
            "AGLX/1.0 TCP\nCONTENT-TYPE: text/plain\n\n",
            FrameError::UnsupportedContentType,
        ),
        (
            "AGLX/1.0 TCP\nCONTENT-LENGTH: 3\n\n{]}",
            FrameError::BadBody,
        ),
    ];
    for (input, want) in cases {
        assert_eq!(
            tcp(input.as_bytes()).as_ref().err(),
            Some(want),
            "{input:?}"
        );
    }
    assert_eq!(
        tcp(b"AGLX/1.0 TCP\nCONTENT-LENGTH: 2\n\n\xff\xfe").unwrap_err(),
        FrameError::BadBody
    );
    assert_eq!(
        tcp(b"AGLX/1.0 TCP\nX-A: \xff\n\n").unwrap_err(),
        FrameError::BadHeaderValue { name: "X-A".into() }
    );
}

#[test]
fn signature_must_be_the_last_header() {
    let sig = "0".repeat(64);
    let input = format!("AGLX/1.0 TCP\nSIGNATURE: {sig}\nFROM: agent://a.b\n\n");
    assert_eq!(
        tcp(input.as_bytes()).unwrap_err(),
        FrameError::BadHeaderLine { line: 3 }
    );
}

#[test]
fn limits_are_enforced_before_the_frame_is_complete() {
    let limits = Limits {
        max_line: 40,
        max_headers: 3,
        max_header_block: 120,
        max_body: 10,
    };
    // A long line without its newline yet.
    let long = format!("AGLX/1.0 TCP\nX-A: {}", "a".repeat(60));
    assert_eq!(
        decode_stream(long.as_bytes(), &limits).unwrap_err(),
        FrameError::LineTooLong { limit: 40 }
    );
    let many = "AGLX/1.0 TCP\nX-A: 1\nX-B: 1\nX-C: 1\nX-D: 1\n";
    assert_eq!(
        decode_stream(many.as_bytes(), &limits).unwrap_err(),
        FrameError::TooManyHeaders { limit: 3 }
    );
    let block = format!(
        "AGLX/1.0 TCP\nX-A: {a}\nX-B: {a}\nX-C: {a}\n",
        a = "a".repeat(35)
    );
    assert_eq!(
        decode_stream(block.as_bytes(), &limits).unwrap_err(),
        FrameError::HeaderBlockTooLarge { limit: 120 }
    );
    let body = "AGLX/1.0 TCP\nCONTENT-LENGTH: 11\n\n";
    assert_eq!(
        decode_stream(body.as_bytes(), &limits).unwrap_err(),
        FrameError::BodyTooLarge {
            size: 11,
            limit: 10
        }
    );
    let dgram = format!("AGLX/1.0 UDP\n\n[{}]", "1,".repeat(10) + "1");
    assert!(matches!(
        decode_datagram(dgram.as_bytes(), &limits),
        Err(FrameError::BodyTooLarge { .. })
    ));
}

#[test]
fn datagram_body_is_the_rest_and_must_match_a_declared_length() {
    let ok = b"AGLX/1.0 UDP\nTYPE: agent.announce\n\n{\"a\":1}";
    assert_eq!(
        decode_datagram(ok, &Limits::UDP).unwrap().frame.body,
        "{\"a\":1}"
    );
    let wrong = b"AGLX/1.0 UDP\nTYPE: agent.announce\nCONTENT-LENGTH: 3\n\n{\"a\":1}";
    assert_eq!(
        decode_datagram(wrong, &Limits::UDP).unwrap_err(),
        FrameError::ContentLength
    );
    let cut = b"AGLX/1.0 UDP\nTYPE: agent.announce\n";
    assert_eq!(
        decode_datagram(cut, &Limits::UDP).unwrap_err(),
        FrameError::Truncated
    );
    let tcp_in_udp = b"AGLX/1.0 TCP\n\n";
    assert!(matches!(
        decode_datagram(tcp_in_udp, &Limits::UDP),
        Err(FrameError::WrongTransport { .. })
    ));
}

#[test]
fn serializer_refuses_what_the_parser_would_refuse() {
    let base = Frame::new(Transport::Tcp, MessageType::StatusReport);
    for (name, value) in [
        ("X-EVIL", "a\r\nTO: agent://victim.x"),
        ("X-EVIL", "a\nb"),
        ("X-EVIL", "a\0b"),
        ("X-EVIL", " padded"),
        ("X-EVIL", ""),
        ("BAD NAME", "v"),
        ("FROM", "agent://a.b"),
    ] {
        let mut f = base.clone();
        f.extensions.push((name.into(), value.into()));
        assert!(f.encode().is_err(), "{name}: {value:?} was written");
    }
    let mut f = base.clone();
    f.nonce = Some("x\r\ny".repeat(8));
    assert!(f.encode().is_err());
    let mut f = base.clone();
    f.msg_type = Some(MessageType::Other("a\nb".into()));
    assert!(f.encode().is_err());
    let mut f = base.clone();
    f.body = "{not json".into();
    assert_eq!(f.encode().unwrap_err(), FrameError::BadBody);
    let mut f = base;
    f.signature = Some("zz".into());
    assert!(f.encode().is_err());
}

// ---- property tests ----

fn label() -> impl Strategy<Value = String> {
    "[a-z0-9]{1,10}"
}

fn agent() -> impl Strategy<Value = AgentUri> {
    (label(), prop::collection::vec(label(), 1..3))
        .prop_map(|(n, d)| AgentUri::new(&n, &d.join(".")).unwrap())
}

fn msg_type() -> impl Strategy<Value = MessageType> {
    prop_oneof![
        Just(MessageType::TaskAssign),
        Just(MessageType::TaskResult),
        Just(MessageType::StatusReport),
        Just(MessageType::CreditTransfer),
        Just(MessageType::AgentAnnounce),
        Just(MessageType::RegistryUpdate),
        Just(MessageType::MentorFeedback),
        Just(MessageType::Handshake),
        Just(MessageType::HandshakeAck),
        "[a-z][a-z0-9._-]{0,20}".prop_map(|s| s.parse().unwrap()),
    ]
}

fn status() -> impl Strategy<Value = Status> {
    prop::sample::select(vec![
        Status::Continue,
        Status::Ok,
        Status::BadRequest,
        Status::Unauthorized,
        Status::AgentNotFound,
        Status::InternalError,
    ])
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        "\\PC{0,20}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

prop_compose! {
    fn frame()(
        minor in 0u16..1000,
        udp in any::<bool>(),
        from in prop::option::of(agent()),
        to in prop::option::of(prop_oneof![agent().prop_map(Recipient::Agent), Just(Recipient::Broadcast)]),
        msg_type in prop::option::of(msg_type()),
        credits in prop::option::of(any::<u64>().prop_map(|c| c % 10_000_000_000_000_000_000)),
        content_type_json in any::<bool>(),
        status in prop::option::of(status()),
        timestamp in prop::option::of(0u64..10_000_000_000),
        nonce in prop::option::of("[A-Za-z0-9_-]{16,64}"),
        signature in prop::option::of("[0-9a-f]{64}"),
        extensions in prop::collection::btree_map("X-[A-Z0-9-]{1,10}", "[!-~]([ -~]{0,30}[!-~])?", 0..4),
        body in prop::option::of(json_value()),
    ) -> Frame {
        Frame {
            minor,
            transport: if udp { Transport::Udp } else { Transport::Tcp },
            from, to, msg_type, credits, content_type_json, status, timestamp, nonce, signature,
            extensions: extensions.into_iter().collect(),
            body: body.map(|b| serde_json::to_string_pretty(&b).unwrap()).unwrap_or_default(),
        }
    }
}

fn decode_any(bytes: &[u8], t: Transport) -> Result<Option<Decoded>, FrameError> {
    let limits = Limits {
        max_line: 4096,
        max_headers: 64,
        max_header_block: 64 * 1024,
        max_body: 1024 * 1024,
    };
    match t {
        Transport::Tcp => decode_stream(bytes, &limits),
        Transport::Udp => decode_datagram(bytes, &limits).map(Some),
    }
}

proptest! {
    #[test]
    fn prop_round_trip(f in frame()) {
        let bytes = f.encode().unwrap();
        let d = decode_any(&bytes, f.transport).unwrap().unwrap();
        prop_assert_eq!(d.len, bytes.len());
        prop_assert_eq!(&d.frame, &f);
        // And with LF line ends (the body has none of its own CRs to confuse).
        if !f.body.contains('\r') {
            let text = String::from_utf8(bytes.clone()).unwrap();
            let (head, body) = text.split_once("\r\n\r\n").unwrap();
            let lf = format!("{}\n\n{}", head.replace("\r\n", "\n"), body);
            let d = decode_any(lf.as_bytes(), f.transport).unwrap().unwrap();
            prop_assert_eq!(&d.frame, &f);
        }
    }

    #[test]
    fn prop_mutated_bytes_never_panic_and_never_overrun(
        f in frame(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..8),
    ) {
        let mut bytes = f.encode().unwrap();
        for (i, b, op) in edits {
            if bytes.is_empty() { break; }
            let at = i.index(bytes.len());
            match op {
                0 => bytes[at] = b,
                1 => { bytes.remove(at); }
                _ => bytes.insert(at, b),
            }
        }
        for t in [Transport::Tcp, Transport::Udp] {
            if let Ok(Some(d)) = decode_any(&bytes, t) {
                prop_assert!(d.len <= bytes.len());
                // Whatever decodes re-encodes, and that decodes to the same frame.
                let again = d.frame.encode().unwrap();
                let d2 = decode_any(&again, t).unwrap().unwrap();
                prop_assert_eq!(d2.frame, d.frame);
            }
        }
    }

    #[test]
    fn prop_signed_frames_verify_and_any_flip_fails(
        f in frame(),
        key in prop::collection::vec(any::<u8>(), 1..64),
        flip in any::<prop::sample::Index>(),
    ) {
        let mut f = f;
        f.transport = Transport::Tcp;
        f.from = Some("agent://x.zone".parse().unwrap());
        let raw = sign(&f, &key, 1000, "nonce-nonce-nonce-1").unwrap();
        let d = decode_stream(&raw, &Limits { max_line: 4096, max_headers: 64, max_header_block: 65536, max_body: 1 << 20 }).unwrap().unwrap();
        prop_assert!(mac_matches(&raw, &d, &key));
        let mut bad = raw.clone();
        let at = flip.index(bad.len());
        bad[at] ^= 0x20;
        if let Ok(Some(d2)) = decode_stream(&bad, &Limits { max_line: 4096, max_headers: 64, max_header_block: 65536, max_body: 1 << 20 }) {
            // A flipped byte that still decodes (e.g. header name case) must fail the MAC,
            // unless it only changed the signature line's name case.
            let sig_name_case = d2.signature_line.as_ref().is_some_and(|r| r.contains(&at));
            if !sig_name_case {
                prop_assert!(!mac_matches(&bad, &d2, &key));
            }
        }
    }
}
