//! Circuit breaker per backend (SPEC §5): CLOSED → OPEN after `failure_threshold`
//! consecutive failures; OPEN admits nothing until `recovery_timeout` (or a longer upstream
//! Retry-After) has passed; then HALF_OPEN admits at most `half_open_max_calls` concurrent
//! probes — a probe's success closes it, a failure reopens it.
//!
//! No hold is longer than `max_open` (default 24h), whatever the upstream asked for, and an
//! operator can close a circuit at once (`POST /admin/circuits/{backend}/reset`).
//!
//! All state is atomics; admission in CLOSED is one load. Time is passed in (ms), never read.

use crate::policy::CircuitCfg;
use crate::units::Millis;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum CircuitState {
    Closed,
    HalfOpen,
    Open,
}

impl CircuitState {
    pub fn as_str(self) -> &'static str {
        match self {
            CircuitState::Closed => "CLOSED",
            CircuitState::HalfOpen => "HALF_OPEN",
            CircuitState::Open => "OPEN",
        }
    }
    /// The inverse of [`CircuitState::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "CLOSED" => Some(CircuitState::Closed),
            "HALF_OPEN" => Some(CircuitState::HalfOpen),
            "OPEN" => Some(CircuitState::Open),
            _ => None,
        }
    }
    /// Gauge value: 0 closed, 1 half-open, 2 open.
    pub fn gauge(self) -> f64 {
        match self {
            CircuitState::Closed => 0.0,
            CircuitState::HalfOpen => 1.0,
            CircuitState::Open => 2.0,
        }
    }
    fn from_u8(v: u8) -> Self {
        match v {
            1 => CircuitState::HalfOpen,
            2 => CircuitState::Open,
            _ => CircuitState::Closed,
        }
    }
}

/// What the breaker says to one call.
#[derive(Debug)]
pub enum Admission {
    /// A normal call.
    Normal,
    /// A half-open probe; the slot is held by the guard until the call ends.
    Probe(ProbeSlot),
    /// No call: open (or half-open without a free probe slot) for about this long.
    Rejected { retry_after_ms: i64 },
}

#[derive(Debug, Default)]
pub struct Circuit {
    state: AtomicU8,
    failures: AtomicU32,
    opened_at: AtomicI64,
    open_until: AtomicI64,
    probes: Arc<AtomicU32>,
}

/// A held probe slot, given back on drop (a cancelled probe leaves the state unchanged).
#[derive(Debug)]
pub struct ProbeSlot {
    probes: Arc<AtomicU32>,
}

impl Drop for ProbeSlot {
    fn drop(&mut self) {
        let _ = self
            .probes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
    }
}

/// Retry-After given for a half-open circuit whose probe slots are all taken.
const HALF_OPEN_BUSY_RETRY_MS: i64 = 1000;

impl Circuit {
    pub fn new() -> Self {
        Self::default()
    }

    /// Seeds a state (scenario files, persisted state).
    pub fn restore(
        &self,
        state: CircuitState,
        failures: u32,
        opened_at: Millis,
        open_until: Millis,
        probes: u32,
    ) {
        self.failures.store(failures, Ordering::Release);
        self.opened_at.store(opened_at, Ordering::Release);
        self.open_until.store(open_until, Ordering::Release);
        self.probes.store(probes, Ordering::Release);
        self.state.store(state as u8, Ordering::Release);
    }

    /// Closes the circuit now (an operator's reset): failures forgotten, no hold. Probes in
    /// flight keep their slots until they end; their outcome is counted as usual.
    pub fn reset(&self) {
        self.failures.store(0, Ordering::Release);
        self.open_until.store(0, Ordering::Release);
        self.opened_at.store(0, Ordering::Release);
        self.state
            .store(CircuitState::Closed as u8, Ordering::Release);
    }

    pub fn raw_state(&self) -> CircuitState {
        CircuitState::from_u8(self.state.load(Ordering::Acquire))
    }

    pub fn consecutive_failures(&self) -> u32 {
        self.failures.load(Ordering::Acquire)
    }

    pub fn opened_at(&self) -> Millis {
        self.opened_at.load(Ordering::Acquire)
    }

    pub fn open_until(&self) -> Millis {
        self.open_until.load(Ordering::Acquire)
    }

    pub fn probes_in_flight(&self) -> u32 {
        self.probes.load(Ordering::Acquire)
    }

    /// The state as it stands at `now`: an OPEN circuit past its time reads HALF_OPEN.
    pub fn state_at(&self, now: Millis) -> CircuitState {
        match self.raw_state() {
            CircuitState::Open if now >= self.open_until() => CircuitState::HalfOpen,
            s => s,
        }
    }

    /// Asks to make one call at `now`.
    pub fn admit(&self, now: Millis, cfg: &CircuitCfg) -> Admission {
        match self.raw_state() {
            CircuitState::Closed => Admission::Normal,
            CircuitState::Open => {
                let until = self.open_until();
                if now < until {
                    return Admission::Rejected {
                        retry_after_ms: until - now,
                    };
                }
                // Time is up: one caller moves it to HALF_OPEN with no probes in flight.
                if self
                    .state
                    .compare_exchange(
                        CircuitState::Open as u8,
                        CircuitState::HalfOpen as u8,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
                {
                    self.probes.store(0, Ordering::Release);
                }
                self.admit(now, cfg)
            }
            CircuitState::HalfOpen => {
                let max = cfg.half_open_max_calls.max(1);
                let took = self
                    .probes
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                        (v < max).then_some(v + 1)
                    })
                    .is_ok();
                if took {
                    Admission::Probe(ProbeSlot {
                        probes: self.probes.clone(),
                    })
                } else {
                    Admission::Rejected {
                        retry_after_ms: HALF_OPEN_BUSY_RETRY_MS,
                    }
                }
            }
        }
    }

    /// A call (normal or probe) succeeded, or the backend answered at all.
    pub fn on_success(&self, probe: Option<ProbeSlot>) {
        // Written only when there is something to clear: a store on every success made the
        // circuit's line one every connection worker wrote, where it is read on every request.
        if self.failures.load(Ordering::Acquire) != 0 {
            self.failures.store(0, Ordering::Release);
        }
        if probe.is_some() || self.raw_state() == CircuitState::HalfOpen {
            self.state
                .store(CircuitState::Closed as u8, Ordering::Release);
        }
        drop(probe);
    }

    /// A failure that says the backend is out for a long time (a per-day quota used up):
    /// opens the circuit now, held for at least `hold_ms` when `accept_retry_after` is on.
    pub fn open_for(&self, now: Millis, cfg: &CircuitCfg, probe: Option<ProbeSlot>, hold_ms: i64) {
        self.failures.fetch_add(1, Ordering::AcqRel);
        let until = now.saturating_add(hold(cfg, hold_ms));
        if self.raw_state() != CircuitState::Open {
            self.opened_at.store(now, Ordering::Release);
        }
        self.open_until.fetch_max(until, Ordering::AcqRel);
        self.state
            .store(CircuitState::Open as u8, Ordering::Release);
        drop(probe);
    }

    /// A call failed. Returns true when this failure opened the circuit.
    /// `retry_after_ms` extends the open time when the policy accepts Retry-After.
    pub fn on_failure(
        &self,
        now: Millis,
        cfg: &CircuitCfg,
        probe: Option<ProbeSlot>,
        retry_after_ms: Option<i64>,
    ) -> bool {
        let failures = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        let was_probe = probe.is_some() || self.raw_state() == CircuitState::HalfOpen;
        let trip = was_probe || failures >= cfg.failure_threshold.max(1);
        if trip && self.raw_state() != CircuitState::Open {
            let hold = hold(cfg, retry_after_ms.unwrap_or(0));
            self.opened_at.store(now, Ordering::Release);
            self.open_until
                .store(now.saturating_add(hold), Ordering::Release);
            self.state
                .store(CircuitState::Open as u8, Ordering::Release);
            drop(probe);
            return true;
        }
        drop(probe);
        false
    }
}

/// How long an opening holds: the recovery timeout, or what the backend asked for (a
/// Retry-After, a quota's reset) when longer and the policy accepts it — never more than
/// `max_open` (a `Retry-After: 99999999` must not hold a backend out for years).
fn hold(cfg: &CircuitCfg, asked_ms: i64) -> i64 {
    let recovery = millis(cfg.recovery_timeout);
    let asked = if cfg.accept_retry_after {
        recovery.max(asked_ms)
    } else {
        recovery
    };
    asked.min(max_open_ms(cfg))
}

fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The longest hold `cfg` allows (at least its recovery timeout).
fn max_open_ms(cfg: &CircuitCfg) -> i64 {
    millis(cfg.max_open).max(millis(cfg.recovery_timeout))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn cfg(max_open: Duration) -> CircuitCfg {
        CircuitCfg {
            failure_threshold: 1,
            recovery_timeout: Duration::from_secs(30),
            half_open_max_calls: 1,
            accept_retry_after: true,
            max_open,
        }
    }

    const DAY_MS: i64 = 86_400_000;

    #[test]
    fn a_huge_retry_after_holds_no_longer_than_max_open() {
        let c = Circuit::new();
        let cfg = cfg(Duration::from_secs(86_400));
        assert!(c.on_failure(1_000, &cfg, None, Some(99_999_999_000)));
        assert_eq!(c.open_until(), 1_000 + DAY_MS);
        let d = Circuit::new();
        d.open_for(1_000, &cfg, None, 99_999_999_000);
        assert_eq!(d.open_until(), 1_000 + DAY_MS);
        // A Gemini day quota (under 24h) still fits whole.
        let e = Circuit::new();
        e.open_for(0, &cfg, None, DAY_MS - 5);
        assert_eq!(e.open_until(), DAY_MS - 5);
    }

    #[test]
    fn max_open_never_cuts_below_the_recovery_timeout() {
        let c = Circuit::new();
        c.on_failure(0, &cfg(Duration::from_secs(1)), None, Some(3_600_000));
        assert_eq!(c.open_until(), 30_000);
    }

    #[test]
    fn reset_closes() {
        let cfg = cfg(Duration::from_secs(3_600));
        let c = Circuit::new();
        c.on_failure(0, &cfg, None, None);
        assert_eq!(c.state_at(1), CircuitState::Open);
        c.reset();
        assert_eq!(c.state_at(1), CircuitState::Closed);
        assert_eq!(c.consecutive_failures(), 0);
        assert!(matches!(c.admit(1, &cfg), Admission::Normal));
    }
}
