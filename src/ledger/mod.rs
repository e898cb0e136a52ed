//! The ledger: lock-free counters keyed by (scope, id, window), reservations of the worst
//! case that are all-or-nothing across counters, and job ledgers.
//!
//! Hot path rule: no mutex. Counters are found in a sharded concurrent map and updated with
//! compare-exchange; a [`Reservation`] is a guard that gives its worst case back on every exit
//! path unless it was committed, and settling twice is impossible by construction.

mod counter;
mod job;
mod near;
pub mod shared;
mod window;

#[cfg(test)]
mod tests;

pub use counter::{Counter, DimRefusal};
pub use job::JobLedger;
pub use shared::{SharedCounters, SharedHold, SharedPart, SharedReply, StoreUnavailable};
pub use window::{window_at, window_end, WindowKey, WindowSet};

use crate::units::{Amount, Millis, Scope};
use dashmap::DashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Separates consumer and job in a job key. Job ids never contain it (see
/// [`crate::units::valid_id`]), so the last one splits a key unambiguously.
pub const JOB_KEY_SEP: char = '#';

/// The ledger key of a job: jobs belong to (consumer, job), so two consumers naming the same
/// job id never share an attempt budget or a job-scoped counter.
pub fn job_key(consumer: &str, job_id: &str) -> Arc<str> {
    // Put together on the stack when short (the usual case): one allocation, the `Arc`'s.
    let mut buf = [0u8; 128];
    let len = consumer.len() + 1 + job_id.len();
    if let Some(b) = buf.get_mut(..len) {
        b[..consumer.len()].copy_from_slice(consumer.as_bytes());
        b[consumer.len()] = JOB_KEY_SEP as u8;
        b[consumer.len() + 1..].copy_from_slice(job_id.as_bytes());
        if let Ok(s) = std::str::from_utf8(b) {
            return Arc::from(s);
        }
    }
    let mut s = String::with_capacity(len);
    s.push_str(consumer);
    s.push(JOB_KEY_SEP);
    s.push_str(job_id);
    Arc::from(s)
}

/// The job id part of a job key (the whole string if it has no consumer part).
pub fn job_of_key(key: &str) -> &str {
    key.rsplit_once(JOB_KEY_SEP).map_or(key, |(_, j)| j)
}

/// Counters are keyed by who (scope and id) and when (window). Several bounds on the same
/// key (a token quota and a USD budget for one consumer per day) read the same counter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterKey {
    pub scope: Scope,
    pub id: Arc<str>,
    pub window: Option<WindowKey>,
}

/// One counter of a reservation with the hard limits that apply to it.
#[derive(Debug, Clone)]
pub struct ReservePart {
    pub counter: Arc<Counter>,
    pub hard: [Option<u64>; 3],
}

/// A refused reservation: which part and which dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub part: usize,
    pub refusal: DimRefusal,
}

/// Reserved worst case held against a set of counters. Dropping it releases the worst case;
/// [`Reservation::commit`] replaces it with the actual usage. Either happens exactly once.
#[derive(Debug)]
pub struct Reservation {
    counters: Vec<Arc<Counter>>,
    amount: Amount,
    ledger: Arc<LedgerTotals>,
    settled: bool,
    /// The same worst case held in a shared store (Redis), settled or released with this one.
    shared: Option<Box<dyn SharedHold>>,
}

impl Reservation {
    pub fn amount(&self) -> Amount {
        self.amount
    }

    /// Ties a hold in a shared store to this reservation: committing settles it with the
    /// actual usage, dropping releases it.
    pub fn attach(&mut self, hold: Box<dyn SharedHold>) {
        self.shared = Some(hold);
    }

    /// Commits the actual usage in place of the reserved worst case. Returns, per counter
    /// in reservation order, the committed amount just before this commit.
    pub fn commit(mut self, actual: Amount) -> Vec<Amount> {
        let before = self
            .counters
            .iter()
            .map(|c| c.commit(&self.amount, &actual))
            .collect();
        self.ledger.unreserve(self.amount.tokens);
        self.settled = true;
        if let Some(h) = self.shared.take() {
            h.settle(actual);
        }
        before
    }

    /// Gives the whole reservation back (nothing was consumed).
    pub fn release(mut self) {
        self.do_release();
    }

    fn do_release(&mut self) {
        if self.settled {
            return;
        }
        for c in &self.counters {
            c.release(&self.amount);
        }
        self.ledger.unreserve(self.amount.tokens);
        self.settled = true;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.do_release();
    }
}

/// Process-wide totals kept beside the map so that gauges need no scan.
#[derive(Debug, Default)]
pub struct LedgerTotals {
    reserved_tokens: AtomicU64,
}

impl LedgerTotals {
    fn unreserve(&self, t: u64) {
        let _ = self
            .reserved_tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(t))
            });
    }
}

#[derive(Debug)]
pub struct Ledger {
    counters: DashMap<CounterKey, Arc<Counter>, foldhash::quality::RandomState>,
    jobs: DashMap<Arc<str>, Arc<JobLedger>, foldhash::quality::RandomState>,
    totals: Arc<LedgerTotals>,
    /// Unique per ledger in the process: what the per-thread memo of counters is keyed by.
    id: u64,
}

impl Default for Ledger {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Ledger {
            counters: DashMap::default(),
            jobs: DashMap::default(),
            totals: Arc::default(),
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }
}

impl Ledger {
    pub fn new() -> Self {
        Self::default()
    }

    /// The counter for `key` like [`Ledger::counter`], through this thread's memo of the
    /// counters it used last (`slot`: where to look, e.g. the bound's index): a counter seen
    /// before is handed out without the map's look-up while the map still holds it.
    pub fn counter_near(&self, slot: usize, key: &CounterKey, expires_at: Millis) -> Arc<Counter> {
        near::counter(self, slot, key, || self.counter(key, expires_at))
    }

    /// The counter for `key`, created empty if absent. `expires_at` is used on creation only.
    pub fn counter(&self, key: &CounterKey, expires_at: Millis) -> Arc<Counter> {
        if let Some(c) = self.counters.get(key) {
            return c.clone();
        }
        self.counters
            .entry(key.clone())
            .or_insert_with(|| Arc::new(Counter::new(expires_at)))
            .clone()
    }

    pub fn get(&self, key: &CounterKey) -> Option<Arc<Counter>> {
        self.counters.get(key).map(|c| c.clone())
    }

    pub fn remove(&self, key: &CounterKey) {
        if let Some((_, c)) = self.counters.remove(key) {
            c.evict();
        }
    }

    /// Reserves `amount` on every part, all or nothing. On refusal nothing stays reserved.
    pub fn reserve(&self, parts: &[ReservePart], amount: Amount) -> Result<Reservation, Refusal> {
        for (i, p) in parts.iter().enumerate() {
            if let Err(refusal) = p.counter.try_reserve(&amount, &p.hard) {
                for q in &parts[..i] {
                    q.counter.release(&amount);
                }
                return Err(Refusal { part: i, refusal });
            }
        }
        let _ =
            self.totals
                .reserved_tokens
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                    Some(v.saturating_add(amount.tokens))
                });
        Ok(Reservation {
            counters: parts.iter().map(|p| p.counter.clone()).collect(),
            amount,
            ledger: self.totals.clone(),
            settled: false,
            shared: None,
        })
    }

    /// Worst-case tokens reserved by calls in flight, process-wide.
    pub fn reserved_tokens(&self) -> u64 {
        self.totals.reserved_tokens.load(Ordering::Acquire)
    }

    /// The job ledger for `id`, created on first use.
    pub fn job(&self, id: &Arc<str>, now: Millis) -> Arc<JobLedger> {
        if let Some(j) = self.jobs.get(id) {
            j.touch(now);
            return j.clone();
        }
        self.jobs
            .entry(id.clone())
            .or_insert_with(|| Arc::new(JobLedger::new(0, 0, now)))
            .clone()
    }

    /// Seeds a job ledger (state loaded at start, scenario files).
    pub fn set_job(&self, id: Arc<str>, attempts: u32, fallbacks: u32, now: Millis) {
        self.jobs
            .insert(id, Arc::new(JobLedger::new(attempts, fallbacks, now)));
    }

    /// Drops a job's ledger and its job-scoped counter (a job that was only one request).
    pub fn forget_job(&self, id: &Arc<str>) {
        self.jobs.remove(id);
        // Unconditionally: a reservation still held (a concurrent request reusing the id)
        // settles into its own Arc of the counter; nothing is left behind in the map.
        if let Some((_, c)) = self.counters.remove(&CounterKey {
            scope: Scope::Job,
            id: id.clone(),
            window: None,
        }) {
            c.evict();
        }
    }

    /// Visits every counter in place (persistence scans). Not for the request path: it
    /// read-locks each shard of the map in turn.
    pub fn for_each_counter(&self, mut f: impl FnMut(&CounterKey, &Counter)) {
        for e in self.counters.iter() {
            f(e.key(), e.value());
        }
    }

    /// Calls `f(id, attempts, fallbacks, last seen)` for every job ledger, in place (no copy).
    /// Not for the request path.
    pub fn for_each_job(&self, mut f: impl FnMut(&Arc<str>, u32, u32, Millis)) {
        for e in self.jobs.iter() {
            let j = e.value();
            f(e.key(), j.attempts(), j.fallbacks(), j.last_seen());
        }
    }

    /// Whether a job ledger exists for `id`.
    pub fn has_job(&self, id: &str) -> bool {
        self.jobs.contains_key(id)
    }

    /// Every job ledger: (id, attempts, fallbacks, last seen). Not for the request path.
    pub fn jobs_snapshot(&self) -> Vec<(Arc<str>, u32, u32, Millis)> {
        self.jobs
            .iter()
            .map(|e| {
                let j = e.value();
                (e.key().clone(), j.attempts(), j.fallbacks(), j.last_seen())
            })
            .collect()
    }

    pub fn job_count(&self) -> usize {
        self.jobs.len()
    }

    pub fn counter_count(&self) -> usize {
        self.counters.len()
    }

    /// Every counter with its key (admin status, persistence). Not for the request path.
    pub fn snapshot(&self) -> Vec<(CounterKey, Amount, Amount)> {
        self.counters
            .iter()
            .map(|e| (e.key().clone(), e.value().committed(), e.value().reserved()))
            .collect()
    }

    /// Drops jobs idle for longer than `job_ttl_ms` (with their job counters) and counters
    /// whose window has ended. Counters still holding a reservation are kept, and so is a
    /// job whose counter holds one (a call longer than the ttl), so that a later sweep drops
    /// both instead of leaving the job counter behind for good.
    pub fn sweep(&self, now: Millis, job_ttl_ms: i64) {
        let mut dead_jobs = Vec::new();
        self.jobs.retain(|id, j| {
            let keep = now.saturating_sub(j.last_seen()) <= job_ttl_ms || {
                let key = CounterKey {
                    scope: Scope::Job,
                    id: id.clone(),
                    window: None,
                };
                self.counters
                    .get(&key)
                    .is_some_and(|c| c.reserved() != Amount::ZERO)
            };
            if !keep {
                dead_jobs.push(id.clone());
            }
            keep
        });
        for id in dead_jobs {
            let key = CounterKey {
                scope: Scope::Job,
                id,
                window: None,
            };
            if let Some((_, c)) = self
                .counters
                .remove_if(&key, |_, c| c.reserved() == Amount::ZERO)
            {
                c.evict();
            }
        }
        self.counters.retain(|_, c| {
            let keep = c.expires_at() > now || c.reserved() != Amount::ZERO;
            if !keep {
                c.evict();
            }
            keep
        });
    }
}
