//! One counter: committed actual usage and reserved worst case in three dimensions.
//!
//! Each dimension is held as two atomics: `used = committed + reserved` and `committed`.
//! A reservation is a compare-exchange on `used` that refuses to cross the hard limit, so
//! the invariant `committed + reserved <= hard` is kept without a lock. `reserved` is always
//! reconstructible as `used - committed`.

use crate::units::{Amount, Dim};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Counter {
    used: [AtomicU64; 3],
    committed: [AtomicU64; 3],
    /// When the counter may be dropped (window end), ms since epoch; `i64::MAX` = never by time.
    expires_at: AtomicI64,
    /// Set when the ledger's map let go of it: a per-thread memo of counters
    /// ([`super::near`]) must not hand it out again.
    evicted: AtomicBool,
}

/// Why a dimension could not take a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DimRefusal {
    pub dim: Dim,
    /// committed + reserved at the moment of refusal.
    pub used: u64,
    pub hard: u64,
}

/// Adds without wrapping: a provider may report any number, and a counter that wrapped to
/// zero would let a spent consumer through again. Returns the value before.
fn add_saturating(cell: &AtomicU64, delta: u64) -> u64 {
    if delta == 0 {
        return cell.load(Ordering::Acquire);
    }
    match cell.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
        Some(v.saturating_add(delta))
    }) {
        Ok(v) | Err(v) => v,
    }
}

impl Counter {
    pub fn new(expires_at: i64) -> Self {
        let c = Counter::default();
        c.expires_at.store(expires_at, Ordering::Relaxed);
        c
    }

    pub fn expires_at(&self) -> i64 {
        self.expires_at.load(Ordering::Relaxed)
    }

    /// Marks the counter as no longer the ledger's (removed from its map).
    pub(super) fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
    }

    /// Whether the ledger's map let go of it.
    pub(super) fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// Committed actual usage.
    pub fn committed(&self) -> Amount {
        Amount::from_array(std::array::from_fn(|i| {
            self.committed[i].load(Ordering::Acquire)
        }))
    }

    /// committed + reserved.
    pub fn used(&self) -> Amount {
        Amount::from_array(std::array::from_fn(|i| {
            self.used[i].load(Ordering::Acquire)
        }))
    }

    /// Reserved worst case of calls in flight.
    pub fn reserved(&self) -> Amount {
        let u = self.used();
        let c = self.committed();
        Amount {
            tokens: u.tokens.saturating_sub(c.tokens),
            requests: u.requests.saturating_sub(c.requests),
            usd: u.usd.saturating_sub(c.usd),
        }
    }

    /// Adds to one dimension if `used + delta <= hard` (no check when `hard` is `None`).
    fn try_add(&self, dim: Dim, delta: u64, hard: Option<u64>) -> Result<(), DimRefusal> {
        let cell = &self.used[dim as usize];
        if delta == 0 {
            return Ok(());
        }
        let Some(hard) = hard else {
            add_saturating(cell, delta);
            return Ok(());
        };
        let mut cur = cell.load(Ordering::Acquire);
        loop {
            let next = match cur.checked_add(delta) {
                Some(n) if n <= hard => n,
                _ => {
                    return Err(DimRefusal {
                        dim,
                        used: cur,
                        hard,
                    })
                }
            };
            match cell.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(actual) => cur = actual,
            }
        }
    }

    fn sub_used(&self, dim: Dim, delta: u64) {
        if delta == 0 {
            return;
        }
        // Saturating: a counter reloaded or seeded under a reservation must never wrap.
        let cell = &self.used[dim as usize];
        let mut cur = cell.load(Ordering::Acquire);
        loop {
            let next = cur.saturating_sub(delta);
            match cell.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Reserves `amount` against `hard` in every dimension, all or nothing.
    pub fn try_reserve(&self, amount: &Amount, hard: &[Option<u64>; 3]) -> Result<(), DimRefusal> {
        for (i, dim) in Dim::ALL.iter().enumerate() {
            if let Err(r) = self.try_add(*dim, amount.get(*dim), hard[i]) {
                for d in &Dim::ALL[..i] {
                    self.sub_used(*d, amount.get(*d));
                }
                return Err(r);
            }
        }
        Ok(())
    }

    /// Returns a reservation unused.
    pub fn release(&self, amount: &Amount) {
        for d in Dim::ALL {
            self.sub_used(d, amount.get(d));
        }
    }

    /// Replaces a reservation of `reserved` with the actual usage `actual`.
    /// `committed` grows first so that a concurrent reader never sees less than is spent.
    /// Returns the committed amount just before this commit (exactly-once threshold checks).
    pub fn commit(&self, reserved: &Amount, actual: &Amount) -> Amount {
        let mut before = [0u64; 3];
        for d in Dim::ALL {
            let (r, a) = (reserved.get(d), actual.get(d));
            before[d as usize] = add_saturating(&self.committed[d as usize], a);
            if a >= r {
                add_saturating(&self.used[d as usize], a - r);
            } else {
                self.sub_used(d, r - a);
            }
        }
        Amount::from_array(before)
    }

    /// Sets the committed amount to what a shared store reports (Redis holds the truth for
    /// every replica; the local counter mirrors it for soft bounds, status and metrics).
    /// Local reservations in flight stay counted in `used`.
    pub fn mirror_committed(&self, shared: &Amount) {
        for d in Dim::ALL {
            let i = d as usize;
            let target = shared.get(d);
            let old = self.committed[i].swap(target, Ordering::AcqRel);
            if target >= old {
                add_saturating(&self.used[i], target - old);
            } else {
                self.sub_used(d, old - target);
            }
        }
    }

    /// Books usage that needs no reservation (state loaded at start, scenario seeds).
    pub fn add_committed(&self, actual: &Amount) {
        let _ = self.commit(&Amount::ZERO, actual);
    }
}
