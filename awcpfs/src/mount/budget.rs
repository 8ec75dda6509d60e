//! A byte budget shared by every fetch of a mount: on-demand fetches of large files and
//! background hydration together never hold more fetched-but-unwritten data in memory
//! than the budget, however many files are opened at once.

use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

/// Bytes of fetched content a mount may hold in memory at once (default).
pub const DEFAULT_FETCH_BUDGET: u64 = 256 << 20;

/// The budget.
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: Mutex<u64>,
    freed: Condvar,
}

/// Bytes taken from a [`Budget`], given back when dropped.
#[derive(Debug)]
pub struct Grant {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Budget {
    /// A budget of `limit` bytes (at least 1).
    pub fn new(limit: u64) -> Arc<Budget> {
        Arc::new(Budget {
            limit: limit.max(1),
            used: Mutex::new(0),
            freed: Condvar::new(),
        })
    }

    /// Take `bytes` (capped at the whole budget, so one request larger than the budget
    /// still proceeds, alone), waiting until that much is free.
    pub fn acquire(self: &Arc<Self>, bytes: u64) -> Grant {
        let bytes = bytes.min(self.limit);
        let mut used = self.used.lock();
        while *used + bytes > self.limit {
            self.freed.wait(&mut used);
        }
        *used += bytes;
        Grant {
            budget: self.clone(),
            bytes,
        }
    }

    /// Bytes taken now.
    pub fn in_use(&self) -> u64 {
        *self.used.lock()
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        *self.budget.used.lock() -= self.bytes;
        self.budget.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn acquire_waits_until_enough_is_given_back() {
        let b = Budget::new(100);
        let first = b.acquire(70);
        assert_eq!(b.in_use(), 70);
        let b2 = b.clone();
        let waiter = std::thread::spawn(move || {
            let g = b2.acquire(50);
            g.bytes
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !waiter.is_finished(),
            "50 more bytes than the budget were handed out"
        );
        drop(first);
        assert_eq!(waiter.join().unwrap(), 50);
        assert_eq!(b.in_use(), 0);
    }

    #[test]
    fn a_request_larger_than_the_budget_proceeds_alone() {
        let b = Budget::new(10);
        let g = b.acquire(1000);
        assert_eq!(b.in_use(), 10);
        drop(g);
        assert_eq!(b.in_use(), 0);
    }
}
