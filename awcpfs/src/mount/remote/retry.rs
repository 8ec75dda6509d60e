//! Transient faults of the link, retried within the read timeout.
//!
//! A blackhole is waited out by the request's own timeout; a reset, a refused connection or
//! a kept-alive connection the export (or a proxy) closed fail at once instead. Those are
//! the commonest faults of a real link (a proxy restart, a NAT timeout), so a read retries
//! them with backoff until the read timeout is spent, measured from the first attempt: only
//! a fault that outlasts it reaches the caller (as `EIO`). Only requests that change nothing
//! at the export are retried here (manifest, blocks, `missing`); commits have their own
//! exactly-once retries in the syncer.

use std::time::{Duration, Instant};

use super::RemoteError;

/// The first pause after a transient fault; doubled after each further one.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest pause between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// Below this much time left, another attempt could not get an answer through.
const MIN_ATTEMPT: Duration = Duration::from_millis(20);

/// Whether `e` is a fault of the connection that a new one may not have: a refused or
/// reset connection, a kept-alive one closed under us, an answer cut off. Timeouts are not
/// in this list only in effect: a timed-out attempt has spent the time left.
pub(super) fn is_transient(e: &RemoteError) -> bool {
    use std::io::ErrorKind as K;
    match e {
        RemoteError::Transport { source, .. } => matches!(
            source.kind(),
            ureq::ErrorKind::ConnectionFailed
                | ureq::ErrorKind::Dns
                | ureq::ErrorKind::Io
                // An empty or garbled status line: typically a kept-alive connection the
                // peer closed just as the request went out.
                | ureq::ErrorKind::BadStatus
                | ureq::ErrorKind::ProxyConnect
        ),
        RemoteError::Io { source } => matches!(
            source.kind(),
            K::ConnectionReset
                | K::ConnectionAborted
                | K::ConnectionRefused
                | K::BrokenPipe
                | K::NotConnected
                | K::UnexpectedEof
        ),
        RemoteError::Unauthorized { .. }
        | RemoteError::LeaseEnded { .. }
        | RemoteError::Refused { .. }
        | RemoteError::Protocol { .. }
        | RemoteError::BadBlock { .. } => false,
    }
}

/// Run `attempt` (given the time left for its request) until it succeeds, fails for good,
/// or `budget` (the read timeout) is spent; transient faults are retried with backoff.
/// `what` names the request in the log, which says what was waited for.
pub(super) fn within<T>(
    budget: Duration,
    endpoint: &str,
    what: &str,
    attempt: impl FnMut(Duration) -> Result<T, RemoteError>,
) -> Result<T, RemoteError> {
    since(Instant::now(), budget, endpoint, what, attempt)
}

/// [`within`], with the budget counted from `started` (several requests of one read share
/// one read timeout).
pub(super) fn since<T>(
    started: Instant,
    budget: Duration,
    endpoint: &str,
    what: &str,
    mut attempt: impl FnMut(Duration) -> Result<T, RemoteError>,
) -> Result<T, RemoteError> {
    let mut backoff = FIRST_BACKOFF;
    let mut retries = 0u32;
    loop {
        let left = budget.saturating_sub(started.elapsed());
        match attempt(left.max(MIN_ATTEMPT)) {
            Ok(v) => {
                if retries > 0 {
                    tracing::warn!(
                        request = what,
                        endpoint,
                        retries,
                        waited_ms = started.elapsed().as_millis() as u64,
                        "the export answered again after transient network faults"
                    );
                }
                return Ok(v);
            }
            Err(e) if is_transient(&e) => {
                let left = budget.saturating_sub(started.elapsed());
                if left <= MIN_ATTEMPT {
                    tracing::warn!(
                        request = what,
                        endpoint,
                        retries,
                        waited_ms = started.elapsed().as_millis() as u64,
                        budget_ms = budget.as_millis() as u64,
                        error = %chain(&e),
                        "giving up: the network fault outlasted the read timeout"
                    );
                    return Err(e);
                }
                if retries == 0 {
                    tracing::warn!(
                        request = what,
                        endpoint,
                        budget_ms = budget.as_millis() as u64,
                        error = %chain(&e),
                        "transient network fault; retrying with backoff within the read timeout"
                    );
                } else {
                    tracing::debug!(request = what, retries, error = %e, "retrying");
                }
                std::thread::sleep(backoff.min(left - MIN_ATTEMPT));
                backoff = (backoff * 2).min(MAX_BACKOFF);
                retries += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// `e` with its causes, `: `-separated (the bare `ureq` error says only "Network Error").
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn reset() -> RemoteError {
        RemoteError::Io {
            source: std::io::Error::from(std::io::ErrorKind::ConnectionReset),
        }
    }

    #[test]
    fn a_reset_is_retried_until_it_passes() {
        let calls = Cell::new(0);
        let r = within(Duration::from_secs(5), "e", "blocks", |_| {
            calls.set(calls.get() + 1);
            if calls.get() < 4 { Err(reset()) } else { Ok(7) }
        });
        assert_eq!(r.unwrap(), 7);
        assert_eq!(calls.get(), 4);
    }

    #[test]
    fn a_fault_that_outlasts_the_budget_is_returned_within_it() {
        let started = Instant::now();
        let calls = Cell::new(0);
        let r: Result<(), _> = within(Duration::from_millis(400), "e", "blocks", |left| {
            calls.set(calls.get() + 1);
            assert!(left <= Duration::from_millis(400));
            Err(reset())
        });
        assert!(matches!(r, Err(RemoteError::Io { .. })));
        assert!(calls.get() >= 3, "{} attempts", calls.get());
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_millis(800),
            "{took:?}"
        );
    }

    #[test]
    fn a_refusal_is_not_retried() {
        let calls = Cell::new(0);
        let r: Result<(), _> = within(Duration::from_secs(5), "e", "blocks", |_| {
            calls.set(calls.get() + 1);
            Err(RemoteError::BadBlock { hash: "x".into() })
        });
        assert!(r.is_err());
        assert_eq!(calls.get(), 1);
    }
}
