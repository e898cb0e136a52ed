//! Burn-rate forecasts (SPEC §9): when, at the pace of the trailing hour and day, a windowed
//! quota's or budget's hard limit will be hit, and whether that is before its window turns.
//!
//! Nothing here runs on a governed request. The rate is read from samples of the ledger's
//! committed totals, taken by whoever calls [`Governor::forecast_tick`] (the sidecar, on a
//! timer; a test, on a fixed clock), so the request path pays nothing for it. A window's
//! counter starts at zero, so its start is always a sample: before any other exists the rate
//! is the window's average so far. Time is always passed in: this module reads no clock.

use super::Governor;
use crate::ledger::{Counter, CounterKey};
use crate::policy::{Bound, BoundClass, Policy};
use crate::units::{Amount, Dim, Millis, Scope};
use dashmap::DashMap;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

const MINUTE: Millis = 60_000;
const HOUR: Millis = 60 * MINUTE;
const DAY: Millis = 24 * HOUR;
/// A rate over less than this is noise (one request just after the window turned).
const MIN_SPAN: Millis = MINUTE;

/// Committed totals of one counter over its window: about one a minute for the last hour,
/// one an hour for the last day (at most ~85 samples per counter).
#[derive(Debug, Default)]
struct Ring {
    recent: VecDeque<(Millis, Amount)>,
    hourly: VecDeque<(Millis, Amount)>,
}

impl Ring {
    fn push(&mut self, now: Millis, committed: Amount) {
        if self.recent.back().is_some_and(|&(t, _)| now - t < MINUTE) {
            return;
        }
        self.recent.push_back((now, committed));
        while let Some(&(t, a)) = self.recent.front() {
            if now - t <= HOUR + MINUTE {
                break;
            }
            self.recent.pop_front();
            if self.hourly.back().is_none_or(|&(h, _)| t - h >= HOUR) {
                self.hourly.push_back((t, a));
            }
        }
        while self
            .hourly
            .front()
            .is_some_and(|&(t, _)| now - t > DAY + HOUR)
        {
            self.hourly.pop_front();
        }
    }

    /// The sample nearest to `span` before `now` (and at least [`MIN_SPAN`] before it), the
    /// window's start (zero) included.
    fn baseline(&self, start: Millis, span: Millis, now: Millis) -> Option<(Millis, Amount)> {
        let target = (now - span).max(start);
        std::iter::once((start, Amount::ZERO))
            .chain(self.hourly.iter().copied())
            .chain(self.recent.iter().copied())
            .filter(|&(t, _)| t >= start && now - t >= MIN_SPAN)
            .min_by_key(|&(t, _)| (t - target).abs())
    }
}

/// What the burn rate says about one dimension of one bound's counter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Projection {
    /// Units (tokens, requests, micro-dollars) per hour over the trailing hour.
    pub per_hour_1h: Option<f64>,
    /// Units per hour over the trailing day (the window's start, when younger).
    pub per_hour_24h: Option<f64>,
    /// When the hard limit is hit at the faster of the two rates, if before the window
    /// turns; `None` otherwise (no usage, or the window turns first).
    pub exhausts_at_ms: Option<Millis>,
}

impl Projection {
    /// Whole seconds from `now` to the projected exhaustion.
    pub fn seconds_from(&self, now: Millis) -> Option<u64> {
        self.exhausts_at_ms
            .map(|at| (at.saturating_sub(now).max(0) as u64).div_ceil(1000))
    }
}

/// The pure projection: committed usage `now`, a baseline sample per span, `used` (committed
/// and reserved) against `limit`, a window ending at `end`.
fn project(
    ring: Option<&Ring>,
    (start, end): (Millis, Millis),
    dim: Dim,
    committed: Amount,
    (used, limit): (u64, u64),
    now: Millis,
) -> Projection {
    let rate = |span: Millis| -> Option<f64> {
        let empty = Ring::default();
        let (t, base) = ring.unwrap_or(&empty).baseline(start, span, now)?;
        let grew = committed.get(dim).saturating_sub(base.get(dim));
        Some(grew as f64 * HOUR as f64 / (now - t) as f64)
    };
    let (h, d) = (rate(HOUR), rate(DAY));
    let fastest = h.unwrap_or(0.0).max(d.unwrap_or(0.0));
    let exhausts_at_ms = if used >= limit {
        Some(now)
    } else if fastest > 0.0 {
        let ms = (limit - used) as f64 / fastest * HOUR as f64;
        let at = now.saturating_add(ms.ceil().min(i64::MAX as f64) as i64);
        (at < end).then_some(at)
    } else {
        None
    };
    Projection {
        per_hour_1h: h,
        per_hour_24h: d,
        exhausts_at_ms,
    }
}

/// Whether `b` is forecast: a quota or budget with a calendar window.
pub fn forecast_applies(b: &Bound) -> bool {
    b.window.is_some() && matches!(b.class, BoundClass::Quota | BoundClass::Budget)
}

/// Samples and fired alerts of the forecasts, kept by the governor. Its locks are taken by
/// the sampler and the read-only views (limits, status), never by a governed request.
#[derive(Debug, Default)]
pub struct Forecasts {
    rings: DashMap<CounterKey, Mutex<Ring>, foldhash::quality::RandomState>,
    /// (bound, counter) pairs whose forecast alert fired this window (the window is in the key).
    fired: DashMap<(Arc<str>, CounterKey), (), foldhash::quality::RandomState>,
}

/// One bound's forecast on one counter, in one dimension, as a tick found it.
#[derive(Debug, Clone)]
pub struct BoundForecast {
    /// Index into `Policy::bounds`.
    pub bound: usize,
    pub key: CounterKey,
    pub dim: Dim,
    pub used: u64,
    pub limit: u64,
    pub window_end_ms: Millis,
    pub projection: Projection,
    /// Its exhaustion falls before the window turns and no alert has fired for it in this
    /// window yet: the caller sends the `forecast` alert now.
    pub alert: bool,
}

impl Governor {
    /// The forecast of bound `b` on `counter` (keyed `key`) in `dim`, at `now`. `None` when
    /// the bound is not forecast or has no hard limit in `dim`.
    pub fn forecast(
        &self,
        policy: &Policy,
        b: &Bound,
        (key, counter): (&CounterKey, &Counter),
        dim: Dim,
        now: Millis,
    ) -> Option<Projection> {
        if !forecast_applies(b) {
            return None;
        }
        let limit = b.hard.get(dim)?;
        let wk = key.window?;
        let end = crate::ledger::window_end(&policy.windows.timezone, wk);
        let ring = self.forecasts.rings.get(key);
        let guard = ring
            .as_ref()
            .map(|r| r.lock().unwrap_or_else(|e| e.into_inner()));
        Some(project(
            guard.as_deref(),
            (wk.start.saturating_mul(1000), end),
            dim,
            counter.committed(),
            (counter.used().get(dim), limit),
            now,
        ))
    }

    /// Samples every live counter of a forecast bound's current window, drops the samples
    /// and fired marks of windows that ended, and returns every forecast whose exhaustion
    /// falls before its window turns; `alert` is set once per (bound, counter, window).
    pub fn forecast_tick(&self, policy: &Policy, now: Millis) -> Vec<BoundForecast> {
        let windows = self.windows_at(&policy.windows, now);
        let mut keys: Vec<CounterKey> = Vec::new();
        self.ledger.for_each_counter(|k, _| {
            if k.window.is_some_and(|w| windows.key(w.window) == w) {
                keys.push(k.clone());
            }
        });
        let live: Vec<(CounterKey, Arc<Counter>)> = keys
            .into_iter()
            .filter_map(|k| self.ledger.get(&k).map(|c| (k, c)))
            .collect();
        let mut out = Vec::new();
        let mut sampled: std::collections::HashSet<&CounterKey> = Default::default();
        for (bi, b) in policy.bounds.iter().enumerate() {
            if !forecast_applies(b) {
                continue;
            }
            for (key, counter) in &live {
                if key.scope != b.scope
                    || key.window.map(|w| w.window) != b.window
                    || !(b.scope == Scope::Global || b.matcher.matches(&key.id))
                {
                    continue;
                }
                if sampled.insert(key) {
                    self.forecasts
                        .rings
                        .entry(key.clone())
                        .or_default()
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(now, counter.committed());
                }
                for dim in Dim::ALL {
                    let Some(p) = self.forecast(policy, b, (key, counter), dim, now) else {
                        continue;
                    };
                    let Some(_) = p.exhausts_at_ms else {
                        continue;
                    };
                    let alert = self
                        .forecasts
                        .fired
                        .insert((b.name.clone(), key.clone()), ())
                        .is_none();
                    let end = key.window.map_or(i64::MAX, |w| windows.end(w.window));
                    out.push(BoundForecast {
                        bound: bi,
                        key: key.clone(),
                        dim,
                        used: counter.used().get(dim),
                        limit: b.hard.get(dim).unwrap_or(0),
                        window_end_ms: end,
                        projection: p,
                        alert,
                    });
                }
            }
        }
        let current = |k: &CounterKey| k.window.is_some_and(|w| windows.key(w.window) == w);
        self.forecasts.rings.retain(|k, _| current(k));
        self.forecasts.fired.retain(|(_, k), _| current(k));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn amt(tokens: u64) -> Amount {
        Amount {
            tokens,
            requests: 0,
            usd: 0,
        }
    }

    #[test]
    fn without_samples_the_rate_is_the_windows_average() {
        // 3 h into a day window, 300 used of 1000: 100/h, the rest lasts 7 h.
        let p = project(None, (0, DAY), Dim::Tokens, amt(300), (300, 1000), 3 * HOUR);
        assert_eq!(p.per_hour_1h, Some(100.0));
        assert_eq!(p.exhausts_at_ms, Some(10 * HOUR));
        assert_eq!(p.seconds_from(3 * HOUR), Some(7 * 3600));
    }

    #[test]
    fn the_trailing_hour_wins_when_it_burns_faster() {
        let mut r = Ring::default();
        for m in 0..=120 {
            // Flat for two hours, then 600 in the last hour (10 a minute).
            let used = if m <= 60 { 0 } else { (m - 60) as u64 * 10 };
            r.push(m * MINUTE, amt(used));
        }
        let now = 120 * MINUTE;
        let p = project(Some(&r), (0, DAY), Dim::Tokens, amt(600), (600, 1200), now);
        assert_eq!(p.per_hour_1h, Some(600.0));
        assert_eq!(p.per_hour_24h, Some(300.0));
        assert_eq!(p.exhausts_at_ms, Some(now + HOUR));
    }

    #[test]
    fn no_forecast_when_the_window_turns_first_or_nothing_burns() {
        let late = project(
            None,
            (0, DAY),
            Dim::Tokens,
            amt(100),
            (100, 1000),
            12 * HOUR,
        );
        assert_eq!(late.exhausts_at_ms, None, "at 8.3/h the day ends first");
        let idle = project(None, (0, DAY), Dim::Tokens, amt(0), (0, 1000), 12 * HOUR);
        assert_eq!((idle.per_hour_1h, idle.exhausts_at_ms), (Some(0.0), None));
        let young = project(None, (0, DAY), Dim::Tokens, amt(10), (10, 1000), 30_000);
        assert_eq!(
            young.per_hour_1h, None,
            "half a minute is too short for a rate"
        );
        let spent = project(None, (0, DAY), Dim::Tokens, amt(1000), (1000, 1000), HOUR);
        assert_eq!(
            spent.exhausts_at_ms,
            Some(HOUR),
            "already at the limit: now"
        );
    }

    #[test]
    fn the_ring_keeps_an_hour_of_minutes_and_a_day_of_hours() {
        let mut r = Ring::default();
        for m in 0..(3 * 24 * 60) {
            r.push(m * MINUTE, amt(m as u64));
            r.push(m * MINUTE + 1_000, amt(m as u64)); // a second sample that minute: dropped
        }
        assert!(r.recent.len() <= 62, "{}", r.recent.len());
        assert!(r.hourly.len() <= 26, "{}", r.hourly.len());
    }
}
