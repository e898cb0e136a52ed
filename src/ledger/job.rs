//! Job ledgers: how many upstream calls and fallbacks one job has made. A job is a chain of
//! requests the app declares with a header; its attempt budget spans all of them.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};

#[derive(Debug, Default)]
pub struct JobLedger {
    attempts: AtomicU32,
    fallbacks: AtomicU32,
    last_seen: AtomicI64,
}

impl JobLedger {
    pub fn new(attempts: u32, fallbacks: u32, now: i64) -> Self {
        JobLedger {
            attempts: AtomicU32::new(attempts),
            fallbacks: AtomicU32::new(fallbacks),
            last_seen: AtomicI64::new(now),
        }
    }

    pub fn attempts(&self) -> u32 {
        self.attempts.load(Ordering::Acquire)
    }

    pub fn fallbacks(&self) -> u32 {
        self.fallbacks.load(Ordering::Acquire)
    }

    pub fn last_seen(&self) -> i64 {
        self.last_seen.load(Ordering::Relaxed)
    }

    pub fn touch(&self, now: i64) {
        self.last_seen.fetch_max(now, Ordering::Relaxed);
    }

    /// Takes one attempt if fewer than `max` were made. Attempts are never given back: a
    /// call that was made counts, whatever it returned.
    pub fn try_take_attempt(&self, max: u32) -> bool {
        take(&self.attempts, max)
    }

    /// Takes one fallback if fewer than `max` were made.
    pub fn try_take_fallback(&self, max: u32) -> bool {
        take(&self.fallbacks, max)
    }

    /// Gives back an attempt taken for a call that was then not made (the transport skipped it).
    pub fn return_attempt(&self) {
        let _ = self
            .attempts
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
    }

    /// Gives back a fallback slot taken for an attempt that was then not made.
    pub fn return_fallback(&self) {
        let _ = self
            .fallbacks
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
    }
}

fn take(cell: &AtomicU32, max: u32) -> bool {
    cell.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
        (v < max).then_some(v + 1)
    })
    .is_ok()
}
