//! What `/admin/status` (and the dashboard) show, and the gauges set at scrape time. All
//! computed here, off the request path: circuits, the ledger's counters in the current
//! windows, the telemetry's per-backend counters.

use super::Ops;
use crate::governor::CircuitState;
use crate::ledger::CounterKey;
use crate::policy::{Bound, BoundClass, Match, Policy};
use crate::proxy::App;
use crate::telemetry::names::*;
use crate::telemetry::stats::RECENT_MINUTES;
use crate::units::{fmt_amount, micros_to_usd, Amount, Dim, Scope};
use serde_json::{json, Value};
use std::sync::Arc;

/// Health thresholds on the recent success rate: below `RED_BELOW` (or an open circuit) is
/// red, below `YELLOW_BELOW` (or a half-open circuit) is yellow.
pub const RED_BELOW: f64 = 0.5;
pub const YELLOW_BELOW: f64 = 0.95;

/// green / yellow / red for a backend.
pub fn health(circuit: CircuitState, success_rate: Option<f64>) -> &'static str {
    match (circuit, success_rate) {
        (CircuitState::Open, _) => "red",
        (_, Some(r)) if r < RED_BELOW => "red",
        (CircuitState::HalfOpen, _) => "yellow",
        (_, Some(r)) if r < YELLOW_BELOW => "yellow",
        _ => "green",
    }
}

/// Ids shown per bound that keeps a counter per id (`match: "team-*"` or `"*"`): the ones
/// with the most use.
pub const TOP_IDS: usize = 10;

/// A bound with one fixed counter (global, or a single id), and that counter's key now.
fn fixed_key(b: &Bound, windows: &crate::ledger::WindowSet) -> Option<CounterKey> {
    let id: Arc<str> = match (b.scope, &b.matcher) {
        (Scope::Global, _) => Arc::from("global"),
        (Scope::Request, _) => return None,
        (_, Match::Id(id)) => id.clone(),
        (_, Match::Any | Match::Glob(_)) => return None,
    };
    Some(CounterKey {
        scope: b.scope,
        id,
        window: b.window.map(|w| windows.key(w)),
    })
}

/// One bound's use on one counter now: (dim, used, limit, ratio) of its fullest hard
/// dimension (soft when it has no hard limit), plus reserved tokens.
struct Use {
    key: CounterKey,
    dim: Dim,
    used: u64,
    limit: u64,
    /// The bound's soft limit in `dim`, if it has one (shown beside the hard one).
    soft: Option<u64>,
    /// Whether `limit` is a hard limit (else the bound is soft only).
    hard: bool,
    reserved_tokens: u64,
    /// A hard dimension has less room left than the smallest request needs.
    cannot_fit: bool,
    /// One of a bound's per-id counters (not the bound's only one).
    per_id: bool,
}

impl Use {
    fn ratio(&self) -> f64 {
        if self.limit == 0 {
            0.0
        } else {
            self.used as f64 / self.limit as f64
        }
    }
}

/// The smallest worst case any request can reserve, per dimension: one input token and one
/// output token (a client may cap its output at 1), on the cheapest chain entry. Below this
/// room a hard bound refuses every request, so it is shown exhausted, not merely past its soft
/// limit. (A bound with more room may still refuse a request with a larger cap: that one is
/// past its soft limit, not exhausted.)
fn smallest_request(policy: &Policy) -> [u64; 3] {
    let out = 1;
    let usd = policy
        .routes
        .iter()
        .flat_map(|r| &r.chain)
        .filter_map(|c| {
            let b = policy.backends.get(c.backend)?;
            Some(c.price_on(b).cost(b.scaled_input(1), out))
        })
        .min()
        .unwrap_or(0);
    let mut m = [0u64; 3];
    m[Dim::Tokens as usize] = 1 + out;
    m[Dim::Requests as usize] = 1;
    m[Dim::Usd as usize] = usd;
    m
}

/// The use of every bound: its one counter, or for a per-id bound the [`TOP_IDS`] ids with
/// the most use in the current window.
fn uses(app: &App, policy: &Policy, now: i64) -> Vec<(usize, Use)> {
    let windows = app.governor.windows_at(&policy.windows, now);
    let smallest = smallest_request(policy);
    let measure = |b: &Bound, key: CounterKey, committed: Amount, reserved: Amount| {
        let hard = !b.hard.is_empty();
        let limits = if hard { b.hard } else { b.soft };
        let best = Dim::ALL
            .into_iter()
            .filter_map(|d| limits.as_array()[d as usize].map(|l| (d, committed.get(d), l)))
            .max_by(|a, b| {
                let r = |(_, u, l): &(Dim, u64, u64)| *u as f64 / (*l).max(1) as f64;
                r(a).total_cmp(&r(b))
            });
        let cannot_fit = Dim::ALL.into_iter().any(|d| {
            b.hard.as_array()[d as usize]
                .is_some_and(|l| committed.get(d).saturating_add(smallest[d as usize]) > l)
        });
        best.map(|(dim, used, limit)| Use {
            key,
            dim,
            used,
            limit,
            soft: b.soft.as_array()[dim as usize],
            hard,
            reserved_tokens: reserved.tokens,
            cannot_fit,
            per_id: false,
        })
    };
    let mut out = Vec::new();
    for (i, b) in policy.bounds.iter().enumerate() {
        if let Some(key) = fixed_key(b, &windows) {
            let counter = app.governor.ledger.get(&key);
            let committed = counter.as_ref().map(|c| c.committed()).unwrap_or_default();
            let reserved = counter.as_ref().map(|c| c.reserved()).unwrap_or_default();
            out.extend(measure(b, key, committed, reserved).map(|u| (i, u)));
            continue;
        }
        // Per-id bounds; job counters are per (consumer, job) and short-lived: not listed.
        if matches!(b.scope, Scope::Request | Scope::Job) {
            continue;
        }
        let window = b.window.map(|w| windows.key(w));
        let mut ids: Vec<Use> = Vec::new();
        app.governor.ledger.for_each_counter(|k, c| {
            if k.scope == b.scope && k.window == window && b.matcher.matches(&k.id) {
                if let Some(mut u) = measure(b, k.clone(), c.committed(), c.reserved()) {
                    u.per_id = true;
                    ids.push(u);
                }
            }
        });
        ids.sort_by(|a, b| {
            b.ratio()
                .total_cmp(&a.ratio())
                .then_with(|| a.key.id.cmp(&b.key.id))
        });
        out.extend(ids.into_iter().take(TOP_IDS).map(|u| (i, u)));
    }
    out
}

/// Sets the gauges that are computed from state rather than counted: circuits, quota and
/// budget ratios, reserved tokens, policy info.
pub fn set_gauges(app: &App, ops: &Ops) {
    let snap = app.snap.load();
    let policy = &snap.policy;
    let now = jiff::Timestamp::now().as_millisecond();
    for b in &policy.backends {
        let state = app.governor.circuit(&b.id).state_at(now);
        metrics::gauge!(TOLLGATE_CIRCUIT_STATE, "backend" => b.id.to_string()).set(state.gauge());
    }
    for (i, u) in uses(app, policy, now) {
        if u.per_id {
            // One gauge per bound name: per-id use is in /admin/status, never a label.
            continue;
        }
        let b = &policy.bounds[i];
        let name = match b.class {
            BoundClass::Quota => TOLLGATE_QUOTA_USED_RATIO,
            BoundClass::Budget => TOLLGATE_BUDGET_USED_RATIO,
            BoundClass::RateLimit => continue,
        };
        let label = if b.class == BoundClass::Quota {
            "quota"
        } else {
            "budget"
        };
        metrics::gauge!(name, label => b.name.to_string()).set(u.ratio());
    }
    metrics::gauge!(TOLLGATE_RESERVED_TOKENS).set(app.governor.ledger.reserved_tokens() as f64);
    let versions = ops
        .reloads
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .versions
        .clone();
    for v in &versions {
        let on = if **v == *policy.version { 1.0 } else { 0.0 };
        metrics::gauge!(TOLLGATE_POLICY_INFO, "version" => v.to_string()).set(on);
    }
}

/// Why the backend at `idx` cannot be called (`key $X unset`), or `None`.
fn ineligible(snap: &crate::proxy::snapshot::Snapshot, idx: usize) -> Option<String> {
    if snap.eligible(idx) {
        return None;
    }
    let env = snap.policy.backends[idx]
        .api_key_env
        .as_deref()
        .unwrap_or("?");
    Some(format!("key ${env} unset"))
}

/// `id (key $X unset)` for every backend that cannot be called, for `/readyz`.
pub fn unusable(snap: &crate::proxy::snapshot::Snapshot) -> Vec<String> {
    (0..snap.policy.backends.len())
        .filter_map(|i| {
            ineligible(snap, i).map(|why| format!("{} ({why})", snap.policy.backends[i].id))
        })
        .collect()
}

fn ts(t: jiff::Timestamp) -> String {
    t.to_string()
}

/// The `/admin/status` document.
pub fn status(app: &App, ops: &Ops) -> Value {
    let snap = app.snap.load();
    let policy = &snap.policy;
    let now = jiff::Timestamp::now();
    let now_ms = now.as_millisecond();
    let minute = now_ms.div_euclid(60_000);
    let tel = crate::telemetry::global();
    let uw: crate::telemetry::stats::UsageWindows =
        app.governor.windows_at(&policy.windows, now_ms).into();

    let mut backends = Vec::new();
    let mut tokens_today = serde_json::Map::new();
    let mut open = Vec::new();
    for (idx, b) in policy.backends.iter().enumerate() {
        let circuit = app.governor.circuit(&b.id).state_at(now_ms);
        if circuit == CircuitState::Open {
            open.push(b.id.to_string());
        }
        let st = tel.stats.get(&b.id);
        let (ok, failed, avg) = st.as_ref().map_or((0, 0, None), |s| s.recent(minute));
        let rate = (ok + failed > 0).then(|| ok as f64 / (ok + failed) as f64);
        let (all_ok, all_failed) = st.as_ref().map_or((0, 0), |s| s.attempts());
        let [tin, tout] = st.as_ref().map_or([0, 0], |s| s.tokens_day(uw.day));
        let cost = st.as_ref().map_or(0, |s| s.cost_month(uw.month));
        tokens_today.insert(b.id.to_string(), json!(tin + tout));
        backends.push(json!({
            "id": &*b.id,
            "kind": b.kind.as_str(),
            "eligible": snap.eligible(idx),
            "ineligible": ineligible(&snap, idx),
            "circuit": circuit.as_str(),
            "health": health(circuit, rate),
            "requests": all_ok + all_failed,
            "failures": all_failed,
            "recent": {"minutes": RECENT_MINUTES, "requests": ok + failed, "failures": failed},
            "success_rate": rate,
            "avg_latency_ms": avg,
            "tokens_today": {"input": tin, "output": tout, "total": tin + tout},
            "cost_month_usd": micros_to_usd(cost),
        }));
    }
    let cost_month: u64 = tel.stats.all().iter().map(|s| s.cost_month(uw.month)).sum();
    let tokens_total: u64 = tokens_today.values().filter_map(Value::as_u64).sum();

    let limits: Vec<Value> = uses(app, policy, now_ms)
        .into_iter()
        .map(|(i, u)| {
            let b = &policy.bounds[i];
            let ratio = u.ratio();
            let state = if u.hard && (u.used >= u.limit || u.cannot_fit) {
                "exhausted"
            } else if u.soft.is_some_and(|s| u.used > s) {
                "soft_exceeded"
            } else if b.alert_at.iter().any(|a| ratio >= *a) {
                "alert"
            } else {
                "ok"
            };
            // Dollars for money (never micro-units), counts otherwise.
            let show = |v: u64| match u.dim {
                Dim::Usd => json!(micros_to_usd(v)),
                _ => json!(v),
            };
            let mut row = json!({
                "name": &*b.name,
                "class": b.class.as_str(),
                "scope": b.scope.as_str(),
                "id": &*u.key.id,
                "match": b.matcher.as_str(),
                "per_id": u.per_id,
                "window": b.window.map(|w| w.as_str()),
                "dim": u.dim.as_str(),
                "used": show(u.used),
                "limit": show(u.limit),
                "hard": u.hard,
                "soft": u.soft.map(show),
                "soft_ratio": u.soft.map(|s| s as f64 / u.limit.max(1) as f64),
                "used_text": fmt_amount(u.dim, u.used),
                "limit_text": fmt_amount(u.dim, u.limit),
                "soft_text": u.soft.map(|s| fmt_amount(u.dim, s)),
                "ratio": ratio,
                "alert_at": &b.alert_at,
                "reserved_tokens": u.reserved_tokens,
                "state": state,
            });
            let counter = app.governor.ledger.get(&u.key);
            let projection = counter
                .as_deref()
                .and_then(|c| app.governor.forecast(policy, b, (&u.key, c), u.dim, now_ms));
            crate::proxy::limits_view::forecast_fields(
                &mut row, policy, b, u.dim, projection, now_ms,
            );
            row
        })
        .collect();

    let st = ops
        .reloads
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let last = st.last.map(|(t, trig, ok)| {
        json!({"at": ts(t), "trigger": trig.as_str(), "result": if ok { "ok" } else { "error" }})
    });
    // The last error still stands only while no reload has succeeded since.
    let failing = st.last.is_some_and(|(_, _, ok)| !ok);
    let last_error = st.last_error.map(|(t, trig, msg)| {
        json!({"at": ts(t), "trigger": trig.as_str(), "message": msg, "current": failing})
    });
    let mut out = json!({
        "now": ts(now),
        "policy": {
            "version": &*policy.version,
            "source": policy.source,
            "loaded_at": ts(st.loaded_at),
            "path": ops.policy_path().map(|p| p.display().to_string()),
            "last_reload": last,
            "last_error": last_error,
            "reloads": {"ok": st.ok, "error": st.errors},
        },
        "timezone": policy.windows.timezone_name,
        "day_start": uw.day,
        "month_start": uw.month,
        "backends": backends,
        "tokens_today": tokens_today,
        "tokens_today_total": tokens_total,
        "cost_month_usd": micros_to_usd(cost_month),
        "reserved_tokens": app.governor.ledger.reserved_tokens(),
        "open_circuits": open,
        "limits": limits,
        "limits_top_ids": TOP_IDS,
        "health_thresholds": {"red_below": RED_BELOW, "yellow_below": YELLOW_BELOW},
    });
    // The shared state store (Redis): availability, eviction policy, rebuilds, journal.
    if let (Some(state), Some(o)) = (ops.state_status(), out.as_object_mut()) {
        o.insert("state".into(), state);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_from_circuit_and_success_rate() {
        assert_eq!(health(CircuitState::Closed, None), "green");
        assert_eq!(health(CircuitState::Closed, Some(1.0)), "green");
        assert_eq!(health(CircuitState::Closed, Some(0.95)), "green");
        assert_eq!(health(CircuitState::Closed, Some(0.9)), "yellow");
        assert_eq!(health(CircuitState::HalfOpen, Some(1.0)), "yellow");
        assert_eq!(health(CircuitState::Closed, Some(0.4)), "red");
        assert_eq!(health(CircuitState::Open, Some(1.0)), "red");
    }
}
