//! In-process counters behind `/admin/status`, the dashboard and the per-backend Prometheus
//! metrics: per backend, atomics only, split by thread ([`Sharded`]), found through a
//! lock-free map snapshot (`ArcSwap`); the request path does no label formatting.

use super::names::*;
use super::shard::{header, render_histogram, Counts, Histogram, Sharded};
use super::window::{Recent, Windowed};
use arc_swap::ArcSwap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The recent window for success rate and average latency, in minutes.
pub const RECENT_MINUTES: usize = 5;

/// Failure classes of `ai_requests_failed_total` (FailureClass::as_str).
pub const FAILURE_CLASSES: [&str; 5] = ["429", "5xx", "timeout", "connect", "auth"];

/// The calendar windows usage is summed in: starts of today and this month (Unix seconds,
/// in the policy's time zone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageWindows {
    pub day: i64,
    pub month: i64,
}

/// One backend's counters, split by thread ([`Sharded`]): the request path adds to its
/// thread's copy, readers sum the copies.
#[derive(Debug)]
pub struct BackendStats {
    pub id: Arc<str>,
    shards: Sharded<Shard>,
    /// Committed tokens (input, output) by upstream model, grown on first sight of a model.
    tokens: ArcSwap<Vec<ModelTokens>>,
}

/// One model's committed tokens (input, output) at one backend.
type ModelTokens = (Arc<str>, Arc<Sharded<Counts<2>>>);

/// One thread's copy of a backend's counters.
#[derive(Debug, Default)]
struct Shard {
    /// Upstream attempts since start: successes, failures.
    attempts: Counts<2>,
    /// Failures by class, in [`FAILURE_CLASSES`] order.
    failed: Counts<5>,
    /// Per minute: successes, failures, latency µs.
    recent: Recent<3, RECENT_MINUTES>,
    /// Committed tokens today (input, output), keyed by the day's start.
    tokens_day: Windowed<2>,
    /// Committed cost this month, micro-dollars, keyed by the month's start.
    cost_month: Windowed<1>,
    /// Committed cost since start, micro-dollars: `ai_cost_usd_total`.
    cost_micros: AtomicU64,
    /// `ai_request_duration_seconds`.
    duration: Histogram,
}

impl BackendStats {
    fn new(id: Arc<str>) -> Self {
        BackendStats {
            id,
            shards: Sharded::default(),
            tokens: ArcSwap::from_pointee(Vec::new()),
        }
    }

    /// One upstream attempt. `failure` is its class, `None` for an answer (a client error
    /// passed through counts as an answer: the backend is healthy).
    pub fn attempt(&self, minute: i64, failure: Option<&str>, latency_ms: i64) {
        let us = (latency_ms.max(0) as u64).saturating_mul(1000);
        let s = self.shards.here();
        s.duration
            .record(DURATION_BUCKETS, latency_ms.max(0) as f64 / 1000.0);
        match failure {
            None => {
                s.attempts.add(0, 1);
                s.recent.add(minute, [1, 0, us]);
            }
            Some(class) => {
                s.attempts.add(1, 1);
                if let Some(i) = FAILURE_CLASSES.iter().position(|c| *c == class) {
                    s.failed.add(i, 1);
                }
                s.recent.add(minute, [0, 1, us]);
            }
        }
    }

    /// Committed usage of a served call (`micros`: its cost in micro-dollars).
    pub fn usage(&self, w: UsageWindows, model: &str, input: u64, output: u64, micros: u64) {
        let UsageWindows { day, month } = w;
        let s = self.shards.here();
        s.tokens_day.add(day, [input, output]);
        s.cost_month.add(month, [micros]);
        s.cost_micros.fetch_add(micros, Ordering::Relaxed);
        let add = |t: &Sharded<Counts<2>>| {
            let t = t.here();
            t.add(0, input);
            t.add(1, output);
        };
        if let Some((_, t)) = self.tokens.load().iter().find(|(m, _)| &**m == model) {
            return add(t);
        }
        add(&self.model_tokens(model));
    }

    /// The token counters of a model first seen (added to the list).
    #[cold]
    fn model_tokens(&self, model: &str) -> Arc<Sharded<Counts<2>>> {
        let fresh: Arc<Sharded<Counts<2>>> = Arc::default();
        let mut out = fresh.clone();
        self.tokens.rcu(|v| {
            if let Some((_, t)) = v.iter().find(|(m, _)| &**m == model) {
                out = t.clone();
                return v.clone();
            }
            out = fresh.clone();
            let mut v = (**v).clone();
            v.push((Arc::from(model), fresh.clone()));
            Arc::new(v)
        });
        out
    }

    /// Upstream attempts since start: (successes, failures).
    pub fn attempts(&self) -> (u64, u64) {
        let [ok, failed] = self.shards.sums(|s| [s.attempts.get(0), s.attempts.get(1)]);
        (ok, failed)
    }

    /// Committed tokens (input, output) in the day that starts at `day`.
    pub fn tokens_day(&self, day: i64) -> [u64; 2] {
        self.shards.sums(|s| s.tokens_day.get(day))
    }

    /// Committed cost, micro-dollars, in the month that starts at `month`.
    pub fn cost_month(&self, month: i64) -> u64 {
        self.shards.sum(|s| s.cost_month.get(month)[0])
    }

    /// Committed cost since start, micro-dollars.
    pub fn cost_micros(&self) -> u64 {
        self.shards.sum(|s| s.cost_micros.load(Ordering::Relaxed))
    }

    /// (successes, failures, average latency ms) over the recent window, at `minute`.
    pub fn recent(&self, minute: i64) -> (u64, u64, Option<f64>) {
        let [ok, failed, us] = self.shards.sums(|s| s.recent.sum(minute));
        let n = ok + failed;
        (ok, failed, (n > 0).then(|| us as f64 / n as f64 / 1000.0))
    }
}

/// Every backend seen since start, by id.
#[derive(Debug)]
pub struct Stats {
    map: ArcSwap<HashMap<Arc<str>, Arc<BackendStats>, foldhash::quality::RandomState>>,
    /// This instance among all made in the process (what a thread's kept look-up is of).
    instance: u64,
}

impl Default for Stats {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Stats {
            map: ArcSwap::default(),
            instance: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }
}

type KeptBackend = Option<(u64, Arc<str>, Arc<BackendStats>)>;

thread_local! {
    /// The backend stats this thread found last ([`Stats::backend`]).
    static LAST_BACKEND: std::cell::RefCell<KeptBackend> = const { std::cell::RefCell::new(None) };
}

impl Stats {
    /// Runs `f` on the stats of `id`, created on first use (rare: once per backend id). The
    /// last one a thread found is kept with its id (held, so an equal pointer is the same id)
    /// and the `Stats` it came from: consecutive requests mostly go to one backend, and the
    /// map's snapshot load and hash cost ~200 instructions a look-up. Entries are never
    /// removed, so a kept one stays the map's. Lent, not cloned: a clone's count would be a
    /// line every worker writes.
    pub fn with_backend<R>(&self, id: &Arc<str>, f: impl FnOnce(&BackendStats) -> R) -> R {
        let me = self.instance;
        let mut f = Some(f);
        let kept = LAST_BACKEND
            .try_with(|l| match &*l.borrow() {
                Some((at, k, s)) if *at == me && Arc::ptr_eq(k, id) => f.take().map(|f| f(s)),
                _ => None,
            })
            .ok()
            .flatten();
        if let Some(r) = kept {
            return r;
        }
        let s = self.find_or_add(id);
        let _ = LAST_BACKEND.try_with(|l| *l.borrow_mut() = Some((me, id.clone(), s.clone())));
        match f.take() {
            Some(f) => f(&s),
            // Taken only by a kept look-up, which returned.
            None => unreachable!("the closure runs once"),
        }
    }

    fn find_or_add(&self, id: &Arc<str>) -> Arc<BackendStats> {
        if let Some(s) = self.map.load().get(id) {
            return s.clone();
        }
        let fresh = Arc::new(BackendStats::new(id.clone()));
        let mut out = fresh.clone();
        self.map.rcu(|m| {
            if let Some(s) = m.get(id) {
                out = s.clone();
                return m.clone();
            }
            out = fresh.clone();
            let mut m = (**m).clone();
            m.insert(id.clone(), fresh.clone());
            Arc::new(m)
        });
        out
    }

    pub fn get(&self, id: &str) -> Option<Arc<BackendStats>> {
        self.map.load().get(id).cloned()
    }
}

impl Stats {
    /// Every backend seen since start.
    pub fn all(&self) -> Vec<Arc<BackendStats>> {
        let mut v: Vec<_> = self.map.load().values().cloned().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// The per-backend metrics in the Prometheus text format: `ai_requests_total`,
    /// `ai_requests_failed_total`, `ai_tokens_total`, `ai_request_duration_seconds` and
    /// `ai_cost_usd_total` (a float counter). Nothing before the first backend is seen.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let all = self.all();
        if all.is_empty() {
            return;
        }
        header(out, AI_REQUESTS_TOTAL, "counter", AI_REQUESTS_TOTAL_HELP);
        for b in &all {
            let (ok, failed) = b.attempts();
            let p = escape(&b.id);
            let _ = writeln!(
                out,
                "{AI_REQUESTS_TOTAL}{{provider=\"{p}\",outcome=\"success\"}} {ok}"
            );
            let _ = writeln!(
                out,
                "{AI_REQUESTS_TOTAL}{{provider=\"{p}\",outcome=\"failure\"}} {failed}"
            );
        }
        header(
            out,
            AI_REQUESTS_FAILED_TOTAL,
            "counter",
            AI_REQUESTS_FAILED_TOTAL_HELP,
        );
        for b in &all {
            let p = escape(&b.id);
            for (i, class) in FAILURE_CLASSES.iter().enumerate() {
                let n = b.shards.sum(|s| s.failed.get(i));
                let _ = writeln!(
                    out,
                    "{AI_REQUESTS_FAILED_TOTAL}{{provider=\"{p}\",class=\"{class}\"}} {n}"
                );
            }
        }
        let tokens: Vec<_> = all.iter().map(|b| (b, b.tokens.load_full())).collect();
        if tokens.iter().any(|(_, t)| !t.is_empty()) {
            header(out, AI_TOKENS_TOTAL, "counter", AI_TOKENS_TOTAL_HELP);
            for (b, models) in &tokens {
                let p = escape(&b.id);
                for (m, t) in models.iter() {
                    let m = escape(m);
                    for (i, dir) in ["input", "output"].iter().enumerate() {
                        let n = t.sum(|s| s.get(i));
                        let _ = writeln!(out, "{AI_TOKENS_TOTAL}{{provider=\"{p}\",model=\"{m}\",direction=\"{dir}\"}} {n}");
                    }
                }
            }
        }
        header(
            out,
            AI_REQUEST_DURATION_SECONDS,
            "histogram",
            AI_REQUEST_DURATION_SECONDS_HELP,
        );
        for b in &all {
            let labels = format!("provider=\"{}\"", escape(&b.id));
            let h = &b.shards;
            render_histogram(
                out,
                AI_REQUEST_DURATION_SECONDS,
                &labels,
                DURATION_BUCKETS,
                h,
                |s| &s.duration,
            );
        }
        header(out, AI_COST_USD_TOTAL, "counter", AI_COST_USD_TOTAL_HELP);
        for b in &all {
            let usd = b.cost_micros() as f64 / 1e6;
            let _ = writeln!(
                out,
                "{AI_COST_USD_TOTAL}{{provider=\"{}\"}} {usd}",
                escape(&b.id)
            );
        }
    }
}

/// A Prometheus label value, escaped.
pub fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::{BackendStats, Stats};
    use std::sync::Arc;

    #[test]
    fn a_kept_look_up_is_of_its_own_stats() {
        let at = |s: &Stats, id: &Arc<str>| s.with_backend(id, |b| b as *const BackendStats);
        let id: Arc<str> = Arc::from("b1");
        let (a, b) = (Stats::default(), Stats::default());
        let sa = at(&a, &id);
        // The same id in another `Stats` (the thread keeps `a`'s): `b`'s own entry.
        let sb = at(&b, &id);
        assert_ne!(sa, sb);
        assert_eq!(at(&b, &id), sb);
        assert_eq!(at(&a, &id), sa);
        // An equal id under another pointer finds the same entry through the map.
        assert_eq!(at(&a, &Arc::from("b1")), sa);
        assert_eq!(Arc::as_ptr(&a.get("b1").unwrap()), sa);
    }
}
