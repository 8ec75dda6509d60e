//! `Debug` helpers that keep secrets and bulk payloads out of logs.
//!
//! Transport handles carry capability tokens, private keys and whole workspaces in base64.
//! Their `Debug` impls print [`Redacted`] in place of those fields, so `tracing` a handle or a
//! START message can never leak a credential or write 100 MB to a log line.

use std::fmt;

/// Prints `<redacted N bytes>` instead of the string it wraps.
pub(crate) struct Redacted<'a>(pub(crate) &'a str);

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<redacted {} bytes>", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shows_length_not_content() {
        let shown = format!("{:?}", Redacted("s3cr3t"));
        assert_eq!(shown, "<redacted 6 bytes>");
    }
}
