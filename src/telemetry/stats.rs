//! In-process counters behind `/admin/status` and the dashboard: per backend, atomics only,
//! found through a lock-free map snapshot (`ArcSwap`), with the backend's Prometheus handles
//! resolved once so the request path does no label formatting.

use super::names::*;
use super::window::{Recent, Windowed};
use arc_swap::ArcSwap;
use metrics::{Counter, Histogram};
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

/// One backend's counters.
#[derive(Debug)]
pub struct BackendStats {
    pub id: Arc<str>,
    /// Upstream attempts since start: successes, failures.
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    /// Per minute: successes, failures, latency µs.
    pub recent: Recent<3, RECENT_MINUTES>,
    /// Committed tokens today (input, output), keyed by the day's start.
    pub tokens_day: Windowed<2>,
    /// Committed cost this month, micro-dollars, keyed by the month's start.
    pub cost_month: Windowed<1>,
    /// Committed cost since start, micro-dollars: `ai_cost_usd_total` (rendered by us, since
    /// the `metrics` crate's counters are integers and this one counts dollars).
    pub cost_micros: AtomicU64,
    m: Handles,
}

#[derive(Debug)]
struct Handles {
    ok: Counter,
    failure: Counter,
    failed: [Counter; 5],
    duration: Histogram,
    /// (model, input, output) token counters, grown on first sight of a model.
    tokens: ArcSwap<Vec<(Arc<str>, Counter, Counter)>>,
}

impl BackendStats {
    fn new(id: Arc<str>) -> Self {
        let p = id.to_string();
        let failed = FAILURE_CLASSES.map(
            |c| metrics::counter!(AI_REQUESTS_FAILED_TOTAL, "provider" => p.clone(), "class" => c),
        );
        let m = Handles {
            ok: metrics::counter!(AI_REQUESTS_TOTAL, "provider" => p.clone(), "outcome" => "success"),
            failure: metrics::counter!(AI_REQUESTS_TOTAL, "provider" => p.clone(), "outcome" => "failure"),
            failed,
            duration: metrics::histogram!(AI_REQUEST_DURATION_SECONDS, "provider" => p),
            tokens: ArcSwap::from_pointee(Vec::new()),
        };
        BackendStats {
            id,
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            recent: Recent::default(),
            tokens_day: Windowed::default(),
            cost_month: Windowed::default(),
            cost_micros: AtomicU64::new(0),
            m,
        }
    }

    /// One upstream attempt. `failure` is its class, `None` for an answer (a client error
    /// passed through counts as an answer: the backend is healthy).
    pub fn attempt(&self, minute: i64, failure: Option<&str>, latency_ms: i64) {
        let us = (latency_ms.max(0) as u64).saturating_mul(1000);
        self.m.duration.record(latency_ms.max(0) as f64 / 1000.0);
        match failure {
            None => {
                self.ok.fetch_add(1, Ordering::Relaxed);
                self.m.ok.increment(1);
                self.recent.add(minute, [1, 0, us]);
            }
            Some(class) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                self.m.failure.increment(1);
                if let Some(i) = FAILURE_CLASSES.iter().position(|c| *c == class) {
                    self.m.failed[i].increment(1);
                }
                self.recent.add(minute, [0, 1, us]);
            }
        }
    }

    /// Committed usage of a served call (`micros`: its cost in micro-dollars).
    pub fn usage(&self, w: UsageWindows, model: &Arc<str>, input: u64, output: u64, micros: u64) {
        let UsageWindows { day, month } = w;
        self.tokens_day.add(day, [input, output]);
        self.cost_month.add(month, [micros]);
        self.cost_micros.fetch_add(micros, Ordering::Relaxed);
        if let Some((_, i, o)) = self.m.tokens.load().iter().find(|(m, _, _)| m == model) {
            // Counted through the snapshot's handles, without cloning them.
            i.increment(input);
            o.increment(output);
            return;
        }
        let (i, o) = self.model_counters(model);
        i.increment(input);
        o.increment(output);
    }

    /// The token counters of a model first seen (added to the snapshot).
    #[cold]
    fn model_counters(&self, model: &Arc<str>) -> (Counter, Counter) {
        let (p, m) = (self.id.to_string(), model.to_string());
        let i = metrics::counter!(AI_TOKENS_TOTAL, "provider" => p.clone(), "model" => m.clone(), "direction" => "input");
        let o = metrics::counter!(AI_TOKENS_TOTAL, "provider" => p, "model" => m, "direction" => "output");
        self.m.tokens.rcu(|v| {
            let mut v = (**v).clone();
            if !v.iter().any(|(x, _, _)| x == model) {
                v.push((model.clone(), i.clone(), o.clone()));
            }
            v
        });
        (i, o)
    }

    /// (successes, failures, average latency ms) over the recent window, at `minute`.
    pub fn recent(&self, minute: i64) -> (u64, u64, Option<f64>) {
        let [ok, failed, us] = self.recent.sum(minute);
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
    /// The stats of `id`, created on first use (rare: once per backend id). The last one a
    /// thread found is kept with its id (held, so an equal pointer is the same id) and the
    /// `Stats` it came from: consecutive requests mostly go to one backend, and the map's
    /// snapshot load and hash cost ~200 instructions a look-up. Entries are never removed,
    /// so a kept one stays the map's.
    pub fn backend(&self, id: &Arc<str>) -> Arc<BackendStats> {
        let me = self.instance;
        let kept = LAST_BACKEND
            .try_with(|l| match &*l.borrow() {
                Some((at, k, s)) if *at == me && Arc::ptr_eq(k, id) => Some(s.clone()),
                _ => None,
            })
            .ok()
            .flatten();
        if let Some(s) = kept {
            return s;
        }
        let s = self.find_or_add(id);
        let _ = LAST_BACKEND.try_with(|l| *l.borrow_mut() = Some((me, id.clone(), s.clone())));
        s
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

    /// `ai_cost_usd_total` in the Prometheus text format (a float counter).
    pub fn render_cost(&self, out: &mut String) {
        use std::fmt::Write;
        let all = self.all();
        if all.is_empty() {
            return;
        }
        out.push_str("# HELP ai_cost_usd_total Committed cost in US dollars by backend\n");
        out.push_str("# TYPE ai_cost_usd_total counter\n");
        for b in all {
            let usd = b.cost_micros.load(Ordering::Relaxed) as f64 / 1e6;
            let _ = writeln!(
                out,
                "ai_cost_usd_total{{provider=\"{}\"}} {usd}",
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
    use super::Stats;
    use std::sync::Arc;

    #[test]
    fn a_kept_look_up_is_of_its_own_stats() {
        let id: Arc<str> = Arc::from("b1");
        let (a, b) = (Stats::default(), Stats::default());
        let sa = a.backend(&id);
        // The same id in another `Stats` (the thread keeps `a`'s): `b`'s own entry.
        let sb = b.backend(&id);
        assert!(!Arc::ptr_eq(&sa, &sb));
        assert!(Arc::ptr_eq(&b.backend(&id), &sb));
        assert!(Arc::ptr_eq(&a.backend(&id), &sa));
        // An equal id under another pointer finds the same entry through the map.
        assert!(Arc::ptr_eq(&a.backend(&Arc::from("b1")), &sa));
        assert!(Arc::ptr_eq(&a.get("b1").unwrap(), &sa));
    }
}
