//! Limits people can read (SPEC §3.2): the `limit` a refusal names, the never-fits rule's
//! arithmetic, and the token bounds behind the rate-limit headers of every governed answer.

use super::plan::PartInfo;
use crate::ledger::WindowSet;
use crate::policy::{Backend, Bound, Policy, Price};
use crate::units::{micros_to_usd, Dim, Millis};
use serde::{Serialize, Serializer};
use std::sync::Arc;

/// The bound that refused a request, as the client reads it in `tollgate.limit`.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitDetail {
    pub name: Arc<str>,
    /// `rate_limit`, `quota` or `budget`.
    pub kind: &'static str,
    pub scope: &'static str,
    pub id: Arc<str>,
    pub window: Option<&'static str>,
    pub unit: Dim,
    /// Committed usage in the counter's window.
    pub used: u64,
    /// Held by calls in flight (their worst cases).
    pub reserved: u64,
    pub limit: u64,
    /// This request's worst case in `unit`.
    pub requested: u64,
    /// Room left now: `limit − used − reserved`.
    pub remaining: u64,
    /// When the window turns, Unix ms (none for job and request bounds).
    pub resets_at_ms: Option<Millis>,
    /// `resets_at_ms` as RFC 3339 with the offset of the policy's time zone.
    pub resets_at: Option<String>,
    /// The request's own worst case is larger than the whole limit: waiting cannot help.
    pub never_fits: bool,
}

/// An amount of `unit` as JSON: dollars for usd, a count otherwise.
fn amount(unit: Dim, v: u64) -> serde_json::Value {
    match unit {
        Dim::Usd => serde_json::json!(micros_to_usd(v)),
        _ => serde_json::json!(v),
    }
}

impl LimitDetail {
    /// The `limit` object of a refusal; usd amounts in dollars.
    pub fn to_json(&self) -> serde_json::Value {
        let u = self.unit;
        serde_json::json!({
            "name": &*self.name,
            "kind": self.kind,
            "scope": self.scope,
            "id": &*self.id,
            "window": self.window,
            "unit": u.as_str(),
            "used": amount(u, self.used),
            "reserved": amount(u, self.reserved),
            "limit": amount(u, self.limit),
            "requested": amount(u, self.requested),
            "remaining": amount(u, self.remaining),
            "resets_at": self.resets_at,
            "never_fits": self.never_fits,
        })
    }
}

impl Serialize for LimitDetail {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

/// RFC 3339 with the zone's offset (`2026-12-01T00:00:00+08:00`), no bracketed zone name.
pub fn rfc3339_in(tz: &jiff::tz::TimeZone, ms: Millis) -> Option<String> {
    let ts = jiff::Timestamp::from_millisecond(ms).ok()?;
    Some(
        ts.to_zoned(tz.clone())
            .strftime("%Y-%m-%dT%H:%M:%S%:z")
            .to_string(),
    )
}

/// What a refusal knows about the bound that refused it.
pub struct Refused<'a> {
    pub bound: &'a Bound,
    pub part: &'a PartInfo,
    pub dim: Dim,
    /// committed + reserved when refused.
    pub used_total: u64,
    pub limit: u64,
    pub requested: u64,
    pub never_fits: bool,
}

/// The `limit` object of a refusal.
pub fn detail(policy: &Policy, windows: &WindowSet, r: &Refused<'_>) -> LimitDetail {
    let committed = r.part.counter.committed().get(r.dim).min(r.used_total);
    let resets_at_ms = r.bound.window.map(|w| windows.end(w));
    LimitDetail {
        name: r.bound.name.clone(),
        kind: r.bound.class.as_str(),
        scope: r.bound.scope.as_str(),
        id: r.part.key.id.clone(),
        window: r.bound.window.map(|w| w.as_str()),
        unit: r.dim,
        used: committed,
        reserved: r.used_total - committed,
        limit: r.limit,
        requested: r.requested,
        remaining: r.limit.saturating_sub(r.used_total),
        resets_at_ms,
        resets_at: resets_at_ms.and_then(|ms| rfc3339_in(&policy.windows.timezone, ms)),
        never_fits: r.never_fits,
    }
}

/// The largest total output of one call on `backend` at `price` whose worst case stays
/// within `room` in `dim`; `None` when even no output does not fit.
pub fn max_output_within(
    dim: Dim,
    room: u64,
    backend: &Backend,
    price: Price,
    input_tokens: u64,
) -> Option<u64> {
    let scaled_in = backend.scaled_input(input_tokens);
    match dim {
        Dim::Requests => (room >= 1).then_some(u64::MAX),
        Dim::Tokens => room.checked_sub(scaled_in),
        Dim::Usd => {
            let price = price.for_input(scaled_in);
            room.checked_sub(price.cost(scaled_in, 0))?;
            if price.output_per_1k == 0 {
                return Some(u64::MAX);
            }
            // cost(out) = ceil((in*pin + out*pout)/1000) <= room ⇐ out <= (room*1000 - in*pin)/pout
            let budget =
                (room as u128) * 1000 - (scaled_in as u128) * (price.worst_input_per_1k() as u128);
            Some((budget / price.output_per_1k as u128).min(u64::MAX as u128) as u64)
        }
    }
}

/// One token or dollar bound that applies to an admitted request, for the limit headers.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLimit {
    pub name: Arc<str>,
    /// `Tokens`, or `Usd` (in micro-dollars) for a dollar bound.
    pub unit: Dim,
    /// A `rate_limits` entry (the x-ratelimit-* trio prefers these).
    pub rate: bool,
    pub limit: u64,
    pub remaining: u64,
    /// The window's length in seconds, when it has a window.
    pub window_secs: Option<u64>,
    /// When the window turns, Unix ms.
    pub resets_at_ms: Option<Millis>,
    /// Index of its counter in the request's parts (to recount after settling).
    pub part: usize,
}

fn window_secs(w: crate::units::Window) -> u64 {
    use crate::units::Window;
    match w {
        Window::Minute => 60,
        Window::Hour => 3_600,
        Window::Day => 86_400,
        // A calendar month varies; the draft's `w` is advisory: 30 days.
        Window::Month => 2_592_000,
    }
}

/// Every hard token and dollar bound on the request's counters, with its room left now.
pub fn token_limits(policy: &Policy, windows: &WindowSet, parts: &[&PartInfo]) -> Vec<TokenLimit> {
    let mut out = Vec::with_capacity(parts.len());
    for (pi, p) in parts.iter().enumerate() {
        let mut used = None;
        for &bi in &p.bounds {
            let b = &policy.bounds[bi];
            // The headers describe what is enforced; a shadow bound refuses nobody.
            if b.is_shadow() {
                continue;
            }
            for (unit, hard) in [(Dim::Tokens, b.hard.tokens), (Dim::Usd, b.hard.usd)] {
                let Some(limit) = hard else {
                    continue;
                };
                let u = used.get_or_insert_with(|| p.counter.used()).get(unit);
                out.push(TokenLimit {
                    name: b.name.clone(),
                    unit,
                    rate: b.class == crate::policy::BoundClass::RateLimit,
                    limit,
                    remaining: limit.saturating_sub(u),
                    window_secs: b.window.map(window_secs),
                    resets_at_ms: b.window.map(|w| windows.end(w)),
                    part: pi,
                });
            }
        }
    }
    out
}

/// Recounts the room left after the request's actual usage was committed.
pub fn recount(limits: &mut [TokenLimit], parts: &[PartInfo]) {
    for l in limits {
        if let Some(p) = parts.get(l.part) {
            l.remaining = l.limit.saturating_sub(p.counter.used().get(l.unit));
        }
    }
}

/// The bound the x-ratelimit-* trio describes: the token rate limit with the least room,
/// else (no token rate limit applies) the token bound with the least room.
pub fn tightest(limits: &[TokenLimit]) -> Option<&TokenLimit> {
    let tokens = || limits.iter().filter(|l| l.unit == Dim::Tokens);
    let rate = tokens().filter(|l| l.rate).min_by_key(|l| l.remaining);
    rate.or_else(|| tokens().min_by_key(|l| l.remaining))
}

/// The dollar bound with the least room (micro-dollars), for `x-tollgate-budget-remaining-usd`.
pub fn tightest_usd(limits: &[TokenLimit]) -> Option<&TokenLimit> {
    limits
        .iter()
        .filter(|l| l.unit == Dim::Usd)
        .min_by_key(|l| l.remaining)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Billed;

    fn price() -> Price {
        // Per 1k: $0.003 in, $0.0003 cached, $0.00375 written, $0.015 out (in micro-dollars).
        Price {
            input_per_1k: 3000,
            output_per_1k: 15000,
            cached_input_per_1k: 300,
            cache_write_per_1k: 3750,
            ..Price::default()
        }
    }

    #[test]
    fn cached_and_written_input_cost_their_own_rates() {
        let p = price();
        let b = Billed {
            input: 1000,
            cached: 600,
            cache_write: 300,
            output: 50,
        };
        // 100 × 3000 + 600 × 300 + 300 × 3750 + 50 × 15000, per 1000.
        assert_eq!(p.cost_billed(b), 2355);
        // No split: what the plain two-rate price charged.
        let plain = Billed {
            cached: 0,
            cache_write: 0,
            ..b
        };
        assert_eq!(p.cost_billed(plain), (1000 * 3000 + 50 * 15000) / 1000);
        // A split larger than the input is bounded by it.
        let silly = Billed {
            cached: u64::MAX,
            cache_write: u64::MAX,
            ..b
        };
        assert_eq!(p.cost_billed(silly), (1000 * 300 + 50 * 15000) / 1000);
        // The worst case prices all input at the dearest input rate.
        assert_eq!(p.cost(1000, 50), (1000 * 3750 + 50 * 15000) / 1000);
    }
}
