//! Counters split by thread: each thread adds to a copy of its own, on cache lines no other
//! thread writes, and a reader sums the copies.
//!
//! Every request adds to a dozen counters (its decision, its dialect, its backend's attempts,
//! latency, tokens and cost). Held once, each of those lines went back and forth between the
//! connection workers on every request; at 64 connections on a 2-core host that cost ~2 µs of
//! user time a request (docs/performance.md, thirtieth round). Split, a worker's adds stay in
//! its own cache. The adds are still atomic: threads beyond [`SHARDS`] share a copy, and any
//! thread may finish a request (a stream's end).

use crossbeam_utils::CachePadded;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Copies of each split counter. Threads take copies in turn as they first add (mostly the
/// connection workers, which finish the requests); a ninth shares the first's.
pub const SHARDS: usize = 8;

thread_local! {
    static SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// This thread's copy.
#[inline]
fn slot() -> usize {
    SLOT.try_with(|s| {
        let v = s.get();
        if v != usize::MAX {
            return v;
        }
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let v = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
        s.set(v);
        v
    })
    // A thread being torn down: any copy will do (the adds are atomic).
    .unwrap_or(0)
}

/// [`SHARDS`] copies of `T`, each on cache lines of its own.
#[derive(Debug)]
pub struct Sharded<T>(Box<[CachePadded<T>]>);

impl<T: Default> Default for Sharded<T> {
    fn default() -> Self {
        Sharded(
            (0..SHARDS)
                .map(|_| CachePadded::new(T::default()))
                .collect(),
        )
    }
}

impl<T> Sharded<T> {
    /// The calling thread's copy: what it adds to.
    #[inline]
    pub fn here(&self) -> &T {
        &self.0[slot()]
    }

    /// Every copy: what a reader sums.
    pub fn all(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|c| &**c)
    }

    /// The sum over the copies of what `f` reads from one.
    pub fn sum(&self, f: impl Fn(&T) -> u64) -> u64 {
        self.all().map(f).fold(0, u64::saturating_add)
    }

    /// The sums over the copies of the `N` values `f` reads from one.
    pub fn sums<const N: usize>(&self, f: impl Fn(&T) -> [u64; N]) -> [u64; N] {
        self.all().map(f).fold([0; N], |mut acc, v| {
            for (a, x) in acc.iter_mut().zip(v) {
                *a = a.saturating_add(x);
            }
            acc
        })
    }
}

/// N plain sums.
#[derive(Debug)]
pub struct Counts<const N: usize>(pub [AtomicU64; N]);

impl<const N: usize> Default for Counts<N> {
    fn default() -> Self {
        Counts(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl<const N: usize> Counts<N> {
    #[inline]
    pub fn add(&self, i: usize, v: u64) {
        if let Some(c) = self.0.get(i) {
            c.fetch_add(v, Ordering::Relaxed);
        }
    }

    pub fn get(&self, i: usize) -> u64 {
        self.0.get(i).map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

/// The most buckets a [`Histogram`] takes (its bounds, then `+Inf`).
pub const MAX_BUCKETS: usize = 16;

/// A Prometheus histogram's counts over fixed bounds (seconds), and its sum in nanoseconds.
#[derive(Debug)]
pub struct Histogram {
    counts: [AtomicU64; MAX_BUCKETS],
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    /// One observation of `secs` against `bounds` (ascending, fewer than [`MAX_BUCKETS`]).
    #[inline]
    pub fn record(&self, bounds: &[f64], secs: f64) {
        let secs = if secs.is_finite() { secs.max(0.0) } else { 0.0 };
        let i = bounds
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(bounds.len())
            .min(MAX_BUCKETS - 1);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        // `as` saturates: an absurd value is capped, not wrapped, on its way into the sum.
        self.sum_ns
            .fetch_add((secs * 1e9) as u64, Ordering::Relaxed);
    }
}

/// The sums of a split histogram (`pick` finds it in a copy): counts per bucket (not
/// cumulative), then the sum.
fn histogram_sums<T>(h: &Sharded<T>, pick: impl Fn(&T) -> &Histogram) -> ([u64; MAX_BUCKETS], u64) {
    let mut counts = [0u64; MAX_BUCKETS];
    let mut sum = 0u64;
    for s in h.all().map(pick) {
        for (c, x) in counts.iter_mut().zip(&s.counts) {
            *c = c.saturating_add(x.load(Ordering::Relaxed));
        }
        sum = sum.saturating_add(s.sum_ns.load(Ordering::Relaxed));
    }
    (counts, sum)
}

/// Writes a histogram in the Prometheus text format: `name_bucket{labels,le=…}` (cumulative,
/// up to `+Inf`), `name_sum` (seconds) and `name_count`. `labels` is empty or `k="v",…`;
/// `pick` finds the histogram in a copy of `h`.
pub fn render_histogram<T>(
    out: &mut String,
    name: &str,
    labels: &str,
    bounds: &[f64],
    h: &Sharded<T>,
    pick: impl Fn(&T) -> &Histogram,
) {
    use std::fmt::Write;
    let (counts, sum_ns) = histogram_sums(h, pick);
    let sep = if labels.is_empty() { "" } else { "," };
    let mut cumulative = 0u64;
    for (i, b) in bounds.iter().enumerate().take(MAX_BUCKETS - 1) {
        cumulative = cumulative.saturating_add(counts[i]);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
    }
    let total: u64 = counts.iter().fold(0, |a, c| a.saturating_add(*c));
    let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {total}");
    let braces = |s: &str| {
        if s.is_empty() {
            String::new()
        } else {
            format!("{{{s}}}")
        }
    };
    let _ = writeln!(out, "{name}_sum{} {}", braces(labels), sum_ns as f64 / 1e9);
    let _ = writeln!(out, "{name}_count{} {total}", braces(labels));
}

/// `# HELP` and `# TYPE` lines of a metric.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    use std::fmt::Write;
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn adds_from_many_threads_are_all_summed() {
        let c = Arc::new(Sharded::<Counts<2>>::default());
        let hs: Vec<_> = (0..(SHARDS + 3))
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        c.here().add(0, 1);
                        c.here().add(1, 2);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let n = (SHARDS as u64 + 3) * 10_000;
        assert_eq!(c.sum(|s| s.get(0)), n);
        assert_eq!(c.sum(|s| s.get(1)), 2 * n);
        assert_eq!(c.sums(|s| [s.get(0), s.get(1)]), [n, 2 * n]);
        // An index past the end is ignored, not a panic.
        c.here().add(5, 1);
        assert_eq!(c.sum(|s| s.get(5)), 0);
    }

    #[test]
    fn threads_one_after_another_add_to_different_copies() {
        // Copies are taken in turn: of three threads started one after another, at least two
        // hold different copies even if other tests' threads took copies in between.
        let c = Arc::new(Sharded::<Counts<1>>::default());
        for _ in 0..3 {
            let c = c.clone();
            std::thread::spawn(move || c.here().add(0, 1))
                .join()
                .unwrap();
        }
        assert_eq!(c.sum(|s| s.get(0)), 3);
        assert!(c.all().filter(|s| s.get(0) > 0).count() >= 2);
    }

    #[test]
    fn a_histogram_renders_cumulative_buckets_sum_and_count() {
        let bounds = [0.1, 1.0];
        let h = Sharded::<Histogram>::default();
        for v in [0.05, 0.5, 0.5, 7.0, f64::NAN, -1.0, f64::INFINITY] {
            h.here().record(&bounds, v);
        }
        let mut out = String::new();
        render_histogram(&mut out, "x_seconds", "provider=\"p\"", &bounds, &h, |h| h);
        assert_eq!(
            out,
            "x_seconds_bucket{provider=\"p\",le=\"0.1\"} 4\n\
             x_seconds_bucket{provider=\"p\",le=\"1\"} 6\n\
             x_seconds_bucket{provider=\"p\",le=\"+Inf\"} 7\n\
             x_seconds_sum{provider=\"p\"} 8.05\n\
             x_seconds_count{provider=\"p\"} 7\n"
        );
        let mut bare = String::new();
        let empty = Sharded::<Histogram>::default();
        render_histogram(&mut bare, "y", "", &bounds, &empty, |h| h);
        assert!(bare.contains("y_bucket{le=\"+Inf\"} 0\n"), "{bare}");
        assert!(bare.contains("y_sum 0\ny_count 0\n"), "{bare}");
    }
}
