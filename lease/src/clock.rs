//! Clocks: where a lease reads the time.
//!
//! A lease needs two readings of time. Deadlines are kept on a **monotonic** reading
//! ([`Clock::now`], a [`Duration`] since the clock's origin) so a wall-clock jump (NTP step,
//! suspend, an operator changing the date) can neither extend nor cut short a lease. The
//! **wall** reading ([`Clock::wall_now`]) is only used to *report* deadlines to people and to
//! peers (`expiresAt` on the wire).
//!
//! [`SystemClock`] is the real thing; [`ManualClock`] is virtual time for tests: it only moves
//! when [`ManualClock::advance`] is called, so every rule about deadlines and grace windows can
//! be tested exactly, at and around each boundary, without sleeping.

use std::fmt;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

/// A source of time for leases.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Monotonic time since the clock's origin. Never goes backwards.
    fn now(&self) -> Duration;
    /// Wall-clock time, used only for reporting deadlines.
    fn wall_now(&self) -> SystemTime;
}

/// The real clock: [`Instant`] for monotonic time, [`SystemTime`] for wall time.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn wall_now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// Virtual time for tests: starts at a fixed wall time and moves only on [`advance`].
///
/// Share it between the test and the lease as `Arc<ManualClock>` (it coerces to
/// `Arc<dyn Clock>`).
///
/// [`advance`]: ManualClock::advance
#[derive(Debug)]
pub struct ManualClock {
    start_wall: SystemTime,
    elapsed: Mutex<Duration>,
}

impl ManualClock {
    /// Wall time at which [`ManualClock::new`] starts: 2025-01-01T00:00:00Z.
    pub const DEFAULT_START_UNIX_SECS: u64 = 1_735_689_600;

    /// A clock starting at 2025-01-01T00:00:00Z (a fixed instant keeps test output stable).
    pub fn new() -> Self {
        Self::starting_at(
            SystemTime::UNIX_EPOCH + Duration::from_secs(Self::DEFAULT_START_UNIX_SECS),
        )
    }

    /// A clock whose wall time starts at `start_wall`.
    pub fn starting_at(start_wall: SystemTime) -> Self {
        Self {
            start_wall,
            elapsed: Mutex::new(Duration::ZERO),
        }
    }

    /// Move time forward by `by` (saturating; time never goes backwards).
    pub fn advance(&self, by: Duration) {
        let mut elapsed = self.elapsed.lock();
        *elapsed = elapsed.saturating_add(by);
    }

    /// How far the clock has been advanced since it was made.
    pub fn elapsed(&self) -> Duration {
        *self.elapsed.lock()
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        self.elapsed()
    }

    fn wall_now(&self) -> SystemTime {
        // `checked_add` only fails past the platform's SystemTime range (hundreds of billions
        // of years out); staying at the start then is better than a panic in a test clock.
        self.start_wall
            .checked_add(self.elapsed())
            .unwrap_or(self.start_wall)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let c = ManualClock::new();
        let w0 = c.wall_now();
        assert_eq!(c.now(), Duration::ZERO);
        c.advance(Duration::from_millis(1500));
        assert_eq!(c.now(), Duration::from_millis(1500));
        assert_eq!(
            c.wall_now().duration_since(w0).unwrap(),
            Duration::from_millis(1500)
        );
        c.advance(Duration::MAX);
        assert_eq!(
            c.now(),
            Duration::MAX,
            "advance saturates instead of overflowing"
        );
    }

    #[test]
    fn system_clock_is_monotonic() {
        let c = SystemClock::new();
        let a = c.now();
        let b = c.now();
        assert!(b >= a);
    }
}
