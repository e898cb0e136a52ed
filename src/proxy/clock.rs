//! The sidecar's time, as the governor sees it (circuits, reservation leases, waits) and as
//! the sweep ages idle counters: the wall clock, or the wall clock moved forward by hand.
//!
//! A test that must wait out a circuit's `recovery_timeout` or a lease moves a
//! [`ManualClock`] forward instead of sleeping through it. Time still runs at its own pace
//! underneath (sockets, tokio timers and the audit's stamps keep the real clock), so the
//! sidecar behaves exactly as in production apart from the jumps a test asks for.

use crate::governor::Clock;
use crate::units::Millis;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

/// How far a test moved the sidecar's time ahead of the wall clock.
#[derive(Debug, Default)]
pub struct ManualClock {
    ahead_ms: AtomicI64,
}

impl ManualClock {
    /// A clock at the wall clock's time, leaked: the sidecar holds it for the life of the
    /// process, and a `&'static` keeps [`AppClock`] `Copy` with no reference count to touch.
    pub fn leaked() -> &'static ManualClock {
        Box::leak(Box::default())
    }

    /// Moves this clock `by` ahead (saturating: time never runs backwards or wraps).
    pub fn advance(&self, by: Duration) {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        let _ = self
            .ahead_ms
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| {
                Some(a.saturating_add(ms))
            });
    }

    /// How far ahead of the wall clock this clock reads.
    pub fn ahead(&self) -> Duration {
        Duration::from_millis(self.ahead_ms.load(Ordering::Acquire).max(0) as u64)
    }
}

/// The clock an `App` hands the governor. The wall clock unless built for a test: the
/// production path pays one predictable branch per read, no lock and no allocation.
#[derive(Debug, Clone, Copy, Default)]
pub struct AppClock {
    manual: Option<&'static ManualClock>,
}

impl AppClock {
    /// The wall clock and tokio timers.
    pub const SYSTEM: AppClock = AppClock { manual: None };

    /// The wall clock plus however far `clock` was moved ahead.
    pub fn manual(clock: &'static ManualClock) -> AppClock {
        AppClock {
            manual: Some(clock),
        }
    }
}

impl Clock for AppClock {
    #[inline]
    fn now_ms(&self) -> Millis {
        let now = crate::units::now_ms();
        match self.manual {
            None => now,
            Some(m) => now.saturating_add(m.ahead_ms.load(Ordering::Acquire)),
        }
    }

    /// A real wait: a test's jump shortens no wait the governor already started, which keeps
    /// a `Retry-After` wait honest (the upstream asked for real time).
    fn sleep_ms(&self, ms: u64) -> impl std::future::Future<Output = ()> + Send {
        tokio::time::sleep(Duration::from_millis(ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_reads_the_wall_clock_plus_its_jumps() {
        let m = ManualClock::leaked();
        let clock = AppClock::manual(m);
        let before = AppClock::SYSTEM.now_ms();
        m.advance(Duration::from_secs(5));
        let read = clock.now_ms();
        let after = AppClock::SYSTEM.now_ms();
        assert!(
            read >= before + 5_000 && read <= after + 5_000,
            "{before} {read} {after}"
        );
        m.advance(Duration::MAX);
        assert_eq!(clock.now_ms(), i64::MAX, "saturates instead of wrapping");
        assert_eq!(m.ahead(), Duration::from_millis(i64::MAX as u64));
    }
}
