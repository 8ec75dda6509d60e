//! Fuzzes the AGLX decoder (stream and datagram) and the signature check: no input may
//! panic, overrun, or decode to a frame that does not re-encode to the same frame.
#![no_main]

use aglx_bridge::codec::{Limits, decode_datagram, decode_stream};
use aglx_bridge::security::{Keys, Policy, Verifier};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let small = Limits {
        max_line: 64,
        max_headers: 4,
        max_header_block: 256,
        max_body: 128,
    };
    // Re-encoding may add CONTENT-LENGTH, so the second decode gets room to spare.
    let roomy = Limits {
        max_line: 1 << 16,
        max_headers: 64,
        max_header_block: 1 << 20,
        max_body: 1 << 20,
    };
    let verifier = Verifier::new(Policy {
        keys: Keys::new().with("*", b"fuzz".to_vec()),
        ..Policy::default()
    });
    for limits in [Limits::TCP, Limits::UDP, small] {
        if let Ok(Some(d)) = decode_stream(data, &limits) {
            assert!(d.len <= data.len());
            let again = d.frame.encode().expect("a decoded frame re-encodes");
            let d2 = decode_stream(&again, &roomy).unwrap().unwrap();
            assert_eq!(d2.frame, d.frame);
            let _ = verifier.check(data, &d, 0);
        }
        if let Ok(d) = decode_datagram(data, &limits) {
            assert_eq!(d.len, data.len());
            let again = d.frame.encode().expect("a decoded frame re-encodes");
            assert_eq!(decode_datagram(&again, &roomy).unwrap().frame, d.frame);
        }
    }
});
