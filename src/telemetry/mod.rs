//! Metrics and the in-process counters behind the admin status: one process-wide Prometheus
//! recorder (a global recorder can be installed once per process), fed from the finished
//! audit [`Entry`] of each request so the request path has a single hook.
//!
//! Never on the request path: label formatting (handles are resolved once per backend), locks,
//! or anything unbounded as a label. Gauges that need a scan (quota ratios, circuits) are
//! computed at scrape time by the admin port.

pub mod alerts;
pub mod names;
pub mod otel;
pub mod scope;
pub mod shard;
pub mod stats;
pub mod teams;
pub mod window;

use crate::audit::Entry;
use crate::governor::{FinalAction, ReasonClass};
use crate::ledger::WindowSet;
use crate::policy::{AlertsCfg, Policy};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use names::*;
use shard::Sharded;
use stats::{Stats, UsageWindows};
use std::sync::OnceLock;
use std::time::Duration;

/// How often the recorder's histograms are drained between scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The process-wide telemetry state.
pub struct Telemetry {
    /// `None` when another global recorder was installed first (metrics then go there).
    handle: Option<PrometheusHandle>,
    pub stats: Stats,
    pub alerts: alerts::Alerts,
    /// Spend by team (`tollgate_team_*`), labels bounded by the configured keys.
    pub teams: teams::TeamSpend,
    /// The request path's process-wide counters, split by thread.
    counts: Sharded<Counters>,
    /// Bounds whose exhaustion gauge has been set (cleared to NaN when their forecast ends);
    /// touched by the forecast timer only.
    forecast_gauges: std::sync::Mutex<Vec<std::sync::Arc<str>>>,
}

/// One thread's copy of the process-wide counters every request adds to.
#[derive(Debug, Default)]
struct Counters {
    /// `tollgate_decisions_total` per (action, reason): index
    /// `action × ReasonClass::ALL.len() + reason`. All series exist from the start, at 0.
    decisions: shard::Counts<DECISIONS>,
    /// `tollgate_requests_total` per dialect, in `Dialect::ALL` order.
    apis: shard::Counts<APIS>,
    /// `tollgate_overhead_seconds`.
    overhead: shard::Histogram,
}

const DECISIONS: usize = FinalAction::ALL.len() * ReasonClass::ALL.len();
const APIS: usize = crate::dialect::Dialect::ALL.len();
const _: () = assert!(
    DURATION_BUCKETS.len() < shard::MAX_BUCKETS && OVERHEAD_BUCKETS.len() < shard::MAX_BUCKETS,
    "a histogram's bounds and +Inf must fit its buckets"
);

/// Where a decision's (action, reason) is counted in [`Counters::decisions`], by their
/// positions in `FinalAction::ALL` and `ReasonClass::ALL`.
fn decision_index(action: usize, reason: usize) -> usize {
    action * ReasonClass::ALL.len() + reason
}

static GLOBAL: OnceLock<Telemetry> = OnceLock::new();

/// The telemetry state, installing the Prometheus recorder on first use.
pub fn global() -> &'static Telemetry {
    GLOBAL.get_or_init(|| Telemetry {
        handle: install(),
        stats: Stats::default(),
        alerts: alerts::Alerts::default(),
        teams: teams::TeamSpend::default(),
        counts: Sharded::default(),
        forecast_gauges: Default::default(),
    })
}

fn install() -> Option<PrometheusHandle> {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    if metrics::set_global_recorder(recorder).is_err() {
        tracing::warn!("metrics: another recorder is installed; /metrics serves nothing");
        return None;
    }
    describe();
    let h = handle.clone();
    let spawned = std::thread::Builder::new()
        .name("tollgate-metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_EVERY);
            h.run_upkeep();
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "metrics: no upkeep thread; histograms drain on scrape only");
    }
    Some(handle)
}

impl Telemetry {
    /// Adopts what the telemetry reads from a policy now in force: where alerts go. Called
    /// at start and after each good reload.
    pub fn configure(&self, policy: &Policy) {
        self.alerts.configure(&policy.alerts);
        self.configure_teams(policy);
    }

    /// Adds the spend counters of the teams `policy`'s keys name (start and each good
    /// reload; teams are never removed, so a counter never goes back).
    pub fn configure_teams(&self, policy: &Policy) {
        let keys = &policy.identity.virtual_keys;
        self.teams
            .configure(keys.iter().filter_map(|k| k.team.as_ref()));
    }

    /// The Prometheus text of every metric: the recorder's (none when another recorder is
    /// installed), then the request path's own, split by thread.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut out = self.handle.as_ref().map(|h| h.render()).unwrap_or_default();
        let c = &self.counts;
        shard::header(
            &mut out,
            TOLLGATE_DECISIONS_TOTAL,
            "counter",
            TOLLGATE_DECISIONS_TOTAL_HELP,
        );
        for (a, action) in FinalAction::ALL.iter().enumerate() {
            for (r, reason) in ReasonClass::ALL.iter().enumerate() {
                let n = c.sum(|s| s.decisions.get(decision_index(a, r)));
                let _ = writeln!(
                    out,
                    "{TOLLGATE_DECISIONS_TOTAL}{{action=\"{action}\",reason=\"{reason}\"}} {n}"
                );
            }
        }
        shard::header(
            &mut out,
            TOLLGATE_REQUESTS_TOTAL,
            "counter",
            TOLLGATE_REQUESTS_TOTAL_HELP,
        );
        for (i, d) in crate::dialect::Dialect::ALL.iter().enumerate() {
            let n = c.sum(|s| s.apis.get(i));
            let _ = writeln!(
                out,
                "{TOLLGATE_REQUESTS_TOTAL}{{api=\"{}\"}} {n}",
                d.as_str()
            );
        }
        shard::header(
            &mut out,
            TOLLGATE_OVERHEAD_SECONDS,
            "histogram",
            TOLLGATE_OVERHEAD_SECONDS_HELP,
        );
        shard::render_histogram(
            &mut out,
            TOLLGATE_OVERHEAD_SECONDS,
            "",
            OVERHEAD_BUCKETS,
            c,
            |s| &s.overhead,
        );
        self.stats.render(&mut out);
        self.teams.render(&mut out);
        out
    }
}

/// Publishes a forecast tick (`Governor::forecast_tick`): sends the alerts it marked, and sets
/// `tollgate_bound_projected_exhaustion_seconds{bound}` to the soonest exhaustion of each
/// bound (over its ids); a bound forecast before and not now is set to NaN, which no
/// threshold rule matches. Runs on the sidecar's forecast timer, never on a request.
pub fn publish_forecasts(
    policy: &Policy,
    forecasts: &[crate::governor::forecast::BoundForecast],
    now: crate::units::Millis,
) {
    use crate::governor::limits::rfc3339_in;
    let t = global();
    let tz = &policy.windows.timezone;
    let ts = rfc3339_in(tz, now).unwrap_or_default();
    let mut soonest: std::collections::HashMap<&str, u64> = Default::default();
    for f in forecasts {
        let b = &policy.bounds[f.bound];
        let Some(secs) = f.projection.seconds_from(now) else {
            continue;
        };
        let e = soonest.entry(&b.name).or_insert(secs);
        *e = (*e).min(secs);
        if !f.alert {
            continue;
        }
        let alert = alerts::ForecastAlert {
            bound: &b.name,
            class: b.class.as_str(),
            scope: f.key.scope.as_str(),
            id: &f.key.id,
            window: f.key.window.map(|w| w.window.as_str()),
            window_start: f.key.window.map(|w| w.start),
            dim: f.dim.as_str(),
            used: f.used,
            limit: f.limit,
            per_hour_1h: f.projection.per_hour_1h,
            per_hour_24h: f.projection.per_hour_24h,
            exhausts_at: f
                .projection
                .exhausts_at_ms
                .and_then(|ms| rfc3339_in(tz, ms))
                .unwrap_or_default(),
            projected_exhaustion_seconds: secs,
            resets_at: rfc3339_in(tz, f.window_end_ms).unwrap_or_default(),
        };
        t.alerts
            .emit_forecast(&policy.alerts, &alert, &policy.version, &ts);
    }
    let mut shown = t.forecast_gauges.lock().unwrap_or_else(|e| e.into_inner());
    for name in shown.iter() {
        if !soonest.contains_key(&**name) {
            metrics::gauge!(TOLLGATE_BOUND_PROJECTED_EXHAUSTION_SECONDS, "bound" => name.to_string())
                .set(f64::NAN);
        }
    }
    for (name, secs) in &soonest {
        metrics::gauge!(TOLLGATE_BOUND_PROJECTED_EXHAUSTION_SECONDS, "bound" => name.to_string())
            .set(*secs as f64);
        if !shown.iter().any(|n| &**n == *name) {
            shown.push(std::sync::Arc::from(*name));
        }
    }
}

/// "Today" and "this month" of a policy's calendar windows (the governor's, cached:
/// `Governor::windows_at`).
impl From<WindowSet> for UsageWindows {
    fn from(w: WindowSet) -> Self {
        UsageWindows {
            day: w.key(crate::units::Window::Day).start,
            month: w.key(crate::units::Window::Month).start,
        }
    }
}

/// Records the metrics of a finished request whose answer was buffered (or refused);
/// `windows` are the calendar windows of now in the policy's zone, `alerts` the policy's
/// alert settings (read from the snapshot in force, so a reload is one swap).
pub fn observe(entry: &Entry, windows: WindowSet, alerts: &AlertsCfg) {
    record(entry, true, windows.into(), alerts);
}

/// Records the metrics of a finished stream. Its wall time includes the streaming itself,
/// so it says nothing about the sidecar's overhead and is left out of that histogram.
pub fn observe_stream(entry: &Entry, windows: WindowSet, alerts: &AlertsCfg) {
    record(entry, false, windows.into(), alerts);
}

fn record(entry: &Entry, overhead: bool, today: UsageWindows, alerts: &AlertsCfg) {
    let t = global();
    let rec = &entry.record;
    let here = t.counts.here();
    let a = FinalAction::ALL.iter().position(|x| *x == rec.final_action);
    let r = ReasonClass::ALL.iter().position(|x| *x == rec.reason_class);
    if let (Some(a), Some(r)) = (a, r) {
        here.decisions.add(decision_index(a, r), 1);
    }
    if let Some(i) = crate::dialect::Dialect::ALL
        .iter()
        .position(|d| d.as_str() == entry.api)
    {
        here.apis.add(i, 1);
    }
    let now = crate::units::now_ms();
    let minute = now.div_euclid(60_000);
    let mut upstream_ms = 0i64;
    for a in &rec.attempts {
        if a.attempt == 0 {
            // Skipped without a call (saturated, untranslatable): not an upstream attempt.
            continue;
        }
        upstream_ms += a.latency_ms.max(0) + a.waited_ms.max(0);
        let failure = match a.outcome {
            "ok" | "not_retryable" => None,
            class => Some(class),
        };
        t.stats
            .with_backend(&a.backend, |b| b.attempt(minute, failure, a.latency_ms));
    }
    if overhead {
        let ms = (entry.latency_ms - upstream_ms as f64).max(0.0);
        here.overhead.record(OVERHEAD_BUCKETS, ms / 1000.0);
    }
    // Settled usage of a call an upstream served (a passed-through client error is not).
    let served = rec.usage_evidence_state != crate::governor::UsageEvidence::None
        && rec.attempts.iter().any(|a| a.backend == rec.backend);
    if served {
        let model = rec.upstream_model.as_deref().unwrap_or("unknown");
        let micros = crate::units::usd_to_micros(rec.cost_usd);
        // The served attempt's look-up is the thread's kept one (`Stats::with_backend`).
        t.stats.with_backend(&rec.backend, |b| {
            b.usage(
                today,
                model,
                rec.actual_input_tokens,
                rec.actual_output_tokens,
                micros,
            )
        });
        t.teams.add(
            rec.team.as_deref(),
            rec.actual_input_tokens,
            rec.actual_output_tokens,
            micros,
        );
    }
    if rec.usage_over_reservation {
        metrics::counter!(names::TOLLGATE_USAGE_OVER_RESERVATION_TOTAL, "backend" => rec.backend.to_string())
            .increment(1);
    }
    for (i, l) in rec.shadow.iter().enumerate() {
        // Once per bound and request, though a glob bound may note several ids.
        if rec.shadow[..i].iter().all(|p| p.name != l.name) {
            metrics::counter!(names::TOLLGATE_SHADOW_REFUSALS_TOTAL, "bound" => l.name.to_string())
                .increment(1);
        }
    }
    if !rec.alerts.is_empty() {
        let _dropped = t.alerts.emit(alerts, rec, &entry.ts);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::governor::{AttemptRecord, CircuitState, Record, UsageEvidence};
    use std::sync::Arc;

    /// Cost of the request-path hook for a served request with one attempt. A measurement,
    /// not a check: `cargo test --lib observe_cost -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn observe_cost() {
        let mut rec = Record::test_chat("bench-b");
        rec.upstream_model = Some(Arc::from("m"));
        rec.usage_evidence_state = UsageEvidence::Actual;
        rec.actual_input_tokens = 10;
        rec.actual_output_tokens = 5;
        rec.cost_usd = 0.001;
        rec.attempts.push(AttemptRecord {
            backend: Arc::from("bench-b"),
            model: Arc::from("m"),
            attempt: 1,
            probe: false,
            worst_tokens: 100,
            worst_cost_usd: 0.01,
            max_output_tokens: 50,
            outcome: "ok",
            status: Some(200),
            retry_after_ms: None,
            circuit_before: CircuitState::Closed,
            circuit_after: CircuitState::Closed,
            latency_ms: 3,
            waited_ms: 0,
            committed_tokens: 0,
        });
        let entry = Entry {
            ts: "2026-01-01T00:00:00Z".into(),
            endpoint: "chat.completions",
            api: "openai",
            latency_ms: 3.2,
            record: rec,
        };
        // The windows come from the governor's cache on the request path.
        let w = WindowSet::at(&jiff::tz::TimeZone::UTC, 1_800_000_000_000);
        let alerts = AlertsCfg {
            webhook_url: None,
            timeout: Duration::from_secs(1),
            queue: 1,
            max_attempts: 1,
        };
        observe(&entry, w, &alerts);
        let n = 200_000;
        let t0 = std::time::Instant::now();
        for _ in 0..n {
            observe(&entry, w, &alerts);
        }
        let per = t0.elapsed().as_nanos() as f64 / n as f64;
        eprintln!("observe: {per:.0} ns per request");
    }
}
