//! The GenAI client metrics, aggregated per thread from the requests that ended there (no
//! shared counter is touched per request), added up by the export task ([`Aggregates::merge`])
//! and written as cumulative OTLP histograms.
//!
//! `gen_ai.client.token.usage` (`{token}`, per `gen_ai.token.type`),
//! `gen_ai.client.operation.duration` (`s`, one per upstream attempt) and
//! `gen_ai.client.operation.time_to_first_chunk` (`s`, streams), with the semconv's
//! recommended bucket boundaries. The response model comes from the upstream's answer, so the
//! number of series is capped: past [`MAX_SERIES`] new attribute sets are folded into one
//! series per metric marked `otel.metric.overflow=true`, as the OpenTelemetry spec does.

use super::proto::Writer;
use super::spans::{AttemptDone, Decision, Finished, Outcome};
use std::collections::HashMap;
use std::sync::Arc;

/// Most attribute sets kept across the three metrics.
pub(crate) const MAX_SERIES: usize = 2000;

const TOKEN_BOUNDS: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];

/// The semconv's recommended boundaries for GenAI durations, seconds.
const DURATION_BOUNDS: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    Tokens,
    Duration,
    FirstChunk,
}

const METRICS: [(Metric, &str, &str, &str, &[f64; 14]); 3] = [
    (
        Metric::Tokens,
        "gen_ai.client.token.usage",
        "Number of input and output tokens used",
        "{token}",
        &TOKEN_BOUNDS,
    ),
    (
        Metric::Duration,
        "gen_ai.client.operation.duration",
        "GenAI operation duration (one upstream attempt)",
        "s",
        &DURATION_BOUNDS,
    ),
    (
        Metric::FirstChunk,
        "gen_ai.client.operation.time_to_first_chunk",
        "Time to the first chunk of a streamed answer, from the attempt's start",
        "s",
        &DURATION_BOUNDS,
    ),
];

/// `error.type` of a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ErrorType {
    Class(&'static str),
    Status(u16),
}

/// One attribute set: an attempt's operation, provider, model, and its response model (the
/// served attempt) or error type (a failed one). The three metrics share it, so one look-up
/// per attempt records all of them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Series {
    op: &'static str,
    provider: &'static str,
    model: Arc<str>,
    response_model: Option<Arc<str>>,
    error: Option<ErrorType>,
}

/// The histograms of one [`Series`]: duration, time to first chunk, input and output tokens.
#[derive(Debug, Clone, Default)]
struct Group {
    hists: [Option<Hist>; 4],
}

const DURATION: usize = 0;
const FIRST_CHUNK: usize = 1;
const INPUT: usize = 2;
const OUTPUT: usize = 3;

impl Group {
    /// A duration, in seconds.
    fn record(&mut self, which: usize, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = DURATION_BOUNDS.partition_point(|b| *b < v);
        self.hists[which].get_or_insert_with(Hist::new).add(i, v);
    }

    /// A token count: its bucket is read from its bits ([`token_bucket`]), not searched for.
    fn record_tokens(&mut self, which: usize, n: u64) {
        self.hists[which]
            .get_or_insert_with(Hist::new)
            .add(token_bucket(n), n as f64);
    }
}

/// The bucket of `n` among [`TOKEN_BOUNDS`] (the powers of 4 from 1 to 4^13; OTLP buckets
/// are upper-inclusive): ⌈log4 n⌉, from ⌈log2 n⌉, at most 14.
fn token_bucket(n: u64) -> usize {
    let log2_ceil = 64 - n.saturating_sub(1).leading_zeros();
    (log2_ceil.div_ceil(2) as usize).min(TOKEN_BOUNDS.len())
}

#[derive(Debug, Clone)]
struct Hist {
    buckets: [u64; 15],
    count: u64,
    sum: f64,
    min: f64,
    max: f64,
}

impl Hist {
    fn new() -> Hist {
        Hist {
            buckets: [0; 15],
            count: 0,
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }

    /// Adds `v`, which falls in bucket `i` (OTLP buckets are upper-inclusive: bucket i holds
    /// (bounds[i-1], bounds[i]]).
    fn add(&mut self, i: usize, v: f64) {
        self.buckets[i] += 1;
        self.count += 1;
        self.sum += v;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    /// Adds what `other` holds (counts saturate: they come from every request since start).
    fn merge(&mut self, other: &Hist) {
        for (b, o) in self.buckets.iter_mut().zip(other.buckets) {
            *b = b.saturating_add(o);
        }
        self.count = self.count.saturating_add(other.count);
        self.sum += other.sum;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }
}

impl Group {
    fn merge(&mut self, other: &Group) {
        for (h, o) in self.hists.iter_mut().zip(&other.hists) {
            if let Some(o) = o {
                h.get_or_insert_with(Hist::new).merge(o);
            }
        }
    }
}

/// The cumulative aggregates since the exporter started.
#[derive(Debug)]
pub(crate) struct Aggregates {
    start_ns: u64,
    /// Every series and its histograms, in the order first seen.
    groups: Vec<(Series, Group)>,
    /// Where each series is in `groups`.
    index: HashMap<Series, usize, foldhash::fast::RandomState>,
    /// The series recorded last: consecutive attempts mostly share it, and it is found by
    /// comparing addresses (the policy's and the answer's `Arc`s), without hashing any text.
    last: Option<usize>,
    overflow: Group,
}

/// `&'static str`s by address (an equal string elsewhere only misses the shortcut).
fn same_static(a: &'static str, b: &'static str) -> bool {
    std::ptr::eq(a, b)
}

fn same_arc(a: Option<&Arc<str>>, b: Option<&Arc<str>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

impl Aggregates {
    pub fn new(start_ns: u64) -> Aggregates {
        Aggregates {
            start_ns,
            groups: Vec::new(),
            index: HashMap::default(),
            last: None,
            overflow: Group::default(),
        }
    }

    fn group(&mut self, s: Series) -> &mut Group {
        if let Some(&i) = self.index.get(&s) {
            self.last = Some(i);
            return &mut self.groups[i].1;
        }
        if self.groups.len() >= MAX_SERIES {
            return &mut self.overflow;
        }
        let i = self.groups.len();
        self.index.insert(s.clone(), i);
        self.groups.push((s, Group::default()));
        self.last = Some(i);
        &mut self.groups[i].1
    }

    /// The group of an attempt's series: the last one when it is the same by address, else
    /// looked up (or added).
    fn group_of(
        &mut self,
        op: &'static str,
        a: &AttemptDone,
        response_model: Option<&Arc<str>>,
        error: Option<ErrorType>,
    ) -> &mut Group {
        if let Some(i) = self.last {
            let s = &self.groups[i].0;
            if same_static(s.op, op)
                && same_static(s.provider, a.provider)
                && Arc::ptr_eq(&s.model, &a.model)
                && same_arc(s.response_model.as_ref(), response_model)
                && s.error == error
            {
                return &mut self.groups[i].1;
            }
        }
        self.group(Series {
            op,
            provider: a.provider,
            model: a.model.clone(),
            response_model: response_model.cloned(),
            error,
        })
    }

    /// Adds what `other` aggregated (a thread's requests since the export task last took
    /// them): series by series, past the cap into the overflow series.
    pub fn merge(&mut self, other: &Aggregates) {
        for (s, g) in &other.groups {
            self.group(s.clone()).merge(g);
        }
        self.overflow.merge(&other.overflow);
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty() && self.overflow.hists.iter().all(Option::is_none)
    }

    /// Adds what one finished request measured (sampled or not: metrics count every request).
    pub fn observe(&mut self, f: &Finished, d: &Decision<'_>) {
        for a in f.attempts.iter() {
            let served = a.outcome == Outcome::Served;
            let error = match a.outcome {
                Outcome::Served => None,
                Outcome::Failed(class, _) => Some(ErrorType::Class(class)),
                Outcome::Status(s) => Some(ErrorType::Status(s)),
                Outcome::Skipped(_) => Some(ErrorType::Class("skipped")),
            };
            let response_model = if served {
                f.notes.model.as_ref().or(d.upstream_model)
            } else {
                None
            };
            let g = self.group_of(f.op, a, response_model, error);
            g.record(DURATION, a.duration_s());
            if let Some(s) = a.first_chunk_s() {
                g.record(FIRST_CHUNK, s);
            }
            if served {
                if let Some((input, output)) = d.usage {
                    g.record_tokens(INPUT, input);
                    g.record_tokens(OUTPUT, output);
                }
            }
        }
    }

    /// The `ExportMetricsServiceRequest` with every series, cumulative, stamped `now_ns`.
    pub fn encode(&self, resource: &[u8], scope: &[u8], now_ns: u64) -> Vec<u8> {
        let mut buf = Vec::with_capacity(256 + self.groups.len() * 600);
        let mut w = Writer(&mut buf);
        let groups: Vec<(Option<&Series>, &Group)> = self
            .groups
            .iter()
            .map(|(s, g)| (Some(s), g))
            .chain(std::iter::once((None, &self.overflow)))
            .collect();
        // ExportMetricsServiceRequest.resource_metrics = 1
        w.message(1, |w| {
            w.bytes(1, resource); // ResourceMetrics.resource = 1
            w.message(2, |w| {
                // ResourceMetrics.scope_metrics = 2
                w.bytes(1, scope); // ScopeMetrics.scope = 1
                for (metric, name, description, unit, bounds) in METRICS {
                    let which: &[(usize, Option<&str>)] = match metric {
                        Metric::Tokens => &[(INPUT, Some("input")), (OUTPUT, Some("output"))],
                        Metric::Duration => &[(DURATION, None)],
                        Metric::FirstChunk => &[(FIRST_CHUNK, None)],
                    };
                    let points: Vec<(Option<&Series>, &Hist, Option<&str>)> = groups
                        .iter()
                        .flat_map(|(s, g)| {
                            which.iter().filter_map(move |(k, ty)| {
                                g.hists[*k].as_ref().map(|h| (*s, h, *ty))
                            })
                        })
                        .collect();
                    if points.is_empty() {
                        continue;
                    }
                    // ScopeMetrics.metrics = 2: Metric { name 1, description 2, unit 3,
                    // histogram 9 }
                    w.message(2, |w| {
                        w.string(1, name);
                        w.string(2, description);
                        w.string(3, unit);
                        w.message(9, |w| {
                            for (s, h, ty) in &points {
                                w.message(1, |w| self.point(w, *s, *ty, h, bounds, now_ns));
                            }
                            // aggregation_temporality = 2: CUMULATIVE
                            w.uint(2, 2);
                        });
                    });
                }
            });
        });
        buf
    }

    /// `HistogramDataPoint { start 2, time 3, count 4, sum 5, bucket_counts 6, bounds 7,
    /// attributes 9, min 11, max 12 }`.
    #[allow(clippy::too_many_arguments)]
    fn point(
        &self,
        w: &mut Writer<'_>,
        s: Option<&Series>,
        token_type: Option<&str>,
        h: &Hist,
        b: &[f64; 14],
        now: u64,
    ) {
        if let Some(t) = token_type {
            w.attr_str(9, "gen_ai.token.type", t);
        }
        match s {
            Some(s) => {
                w.attr_str(9, "gen_ai.operation.name", s.op);
                w.attr_str(9, "gen_ai.provider.name", s.provider);
                w.attr_str(9, "gen_ai.request.model", &s.model);
                if let Some(m) = &s.response_model {
                    w.attr_str(9, "gen_ai.response.model", m);
                }
                match s.error {
                    Some(ErrorType::Class(c)) => w.attr_str(9, "error.type", c),
                    Some(ErrorType::Status(st)) => {
                        w.attr_str(9, "error.type", itoa::Buffer::new().format(st))
                    }
                    None => {}
                }
            }
            None => w.attr_bool(9, "otel.metric.overflow", true),
        }
        w.fixed64(2, self.start_ns);
        w.fixed64(3, now);
        w.fixed64(4, h.count);
        w.double(5, h.sum);
        let mut counts = Vec::with_capacity(h.buckets.len() * 8);
        for c in h.buckets {
            counts.extend_from_slice(&c.to_le_bytes());
        }
        w.bytes(6, &counts);
        let mut bounds = Vec::with_capacity(b.len() * 8);
        for x in b {
            bounds.extend_from_slice(&x.to_bits().to_le_bytes());
        }
        w.bytes(7, &bounds);
        if h.count > 0 {
            w.double(11, h.min);
            w.double(12, h.max);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_counts_bucket_is_the_one_the_bounds_give() {
        let search = |n: u64| TOKEN_BOUNDS.partition_point(|b| *b < n as f64);
        let mut cases: Vec<u64> = (0..5000).collect();
        for k in 0..32 {
            let p = 1u64 << k;
            cases.extend([p - 1, p, p + 1, p.saturating_mul(3)]);
        }
        cases.extend([
            67_108_863,
            67_108_864,
            67_108_865,
            u64::MAX / 2,
            u64::MAX - 1,
            u64::MAX,
        ]);
        for n in cases {
            assert_eq!(token_bucket(n), search(n), "{n} tokens");
        }
    }

    #[test]
    fn buckets_are_upper_inclusive() {
        let mut g = Group::default();
        for n in [0, 1, 2, 4, 1_000_000_000] {
            g.record_tokens(INPUT, n);
        }
        let h = g.hists[INPUT].as_ref().unwrap();
        assert_eq!(h.buckets[0], 2, "0 and 1 are in (-inf, 1]");
        assert_eq!(h.buckets[1], 2, "2 and 4 are in (1, 4]");
        assert_eq!(h.buckets[14], 1, "past the last bound");
        assert_eq!((h.min, h.max), (0.0, 1e9));
        for v in [0.0, 0.01, 0.015, 0.02, 100.0, f64::NAN, f64::INFINITY] {
            g.record(DURATION, v);
        }
        let h = g.hists[DURATION].as_ref().unwrap();
        assert_eq!(h.buckets[0], 2, "0 and 0.01 are in (-inf, 0.01]");
        assert_eq!(h.buckets[1], 2, "0.015 and 0.02 are in (0.01, 0.02]");
        assert_eq!(h.buckets[14], 1, "past the last bound");
        assert_eq!(h.count, 5, "NaN and infinity are not recorded");
    }

    #[test]
    fn series_past_the_cap_fold_into_the_overflow_series() {
        let mut a = Aggregates::new(1);
        for i in 0..MAX_SERIES + 10 {
            let s = Series {
                op: "chat",
                provider: "openai",
                model: Arc::from("m"),
                response_model: Some(Arc::from(format!("hostile-{i}").as_str())),
                error: None,
            };
            a.group(s).record(DURATION, 0.5);
        }
        assert_eq!(a.groups.len(), MAX_SERIES);
        assert_eq!(a.index.len(), MAX_SERIES);
        assert_eq!(a.overflow.hists[DURATION].as_ref().unwrap().count, 10);
        // The overflow series is exported, marked.
        let body = a.encode(&[], &[], 2);
        assert!(memchr::memmem::find(&body, b"otel.metric.overflow").is_some());
    }

    /// A served attempt at `model`.
    fn attempt(model: &Arc<str>) -> AttemptDone {
        AttemptDone {
            span_id: [1; 8],
            start: 1,
            end: 2,
            backend: Arc::from("b"),
            provider: "openai",
            model: model.clone(),
            base_url: Arc::from("http://x"),
            max_tokens: 1,
            attempt: 0,
            probe: false,
            first_chunk: None,
            outcome: Outcome::Served,
        }
    }

    #[test]
    fn the_last_series_shortcut_never_mixes_series() {
        let (m1, m1_again, m2) = (Arc::from("m1"), Arc::from("m1"), Arc::from("m2"));
        let r: Arc<str> = Arc::from("resp");
        let mut a = Aggregates::new(1);
        // Same text in another Arc: the same series, found by content.
        for m in [&m1, &m1_again, &m1] {
            a.group_of("chat", &attempt(m), Some(&r), None)
                .record(DURATION, 1.0);
        }
        // Differing model, response model or error: other series, also right after the last.
        a.group_of("chat", &attempt(&m2), Some(&r), None)
            .record(DURATION, 1.0);
        a.group_of("chat", &attempt(&m2), None, None)
            .record(DURATION, 1.0);
        a.group_of("chat", &attempt(&m2), None, Some(ErrorType::Status(500)))
            .record(DURATION, 1.0);
        a.group_of("chat", &attempt(&m1), Some(&r), None)
            .record(DURATION, 1.0);
        let counts: Vec<u64> = a
            .groups
            .iter()
            .map(|(_, g)| g.hists[DURATION].as_ref().unwrap().count)
            .collect();
        assert_eq!(counts, [4, 1, 1, 1]);
    }

    #[test]
    fn threads_aggregates_merged_equal_one_aggregate_of_everything() {
        let (m1, m2) = (Arc::from("m1"), Arc::from("m2"));
        // What two threads recorded, in order: (model, error, duration, tokens).
        let first = [
            (&m1, None, 0.5, 10),
            (&m2, None, 1.0, 300),
            (&m1, None, 2.0, 7),
        ];
        let second = [
            (&m2, None, 0.25, 5),
            (&m1, Some(ErrorType::Status(503)), 4.0, 0),
        ];
        let record = |a: &mut Aggregates, rows: &[(&Arc<str>, Option<ErrorType>, f64, u64)]| {
            for (m, e, secs, tokens) in rows {
                let g = a.group_of("chat", &attempt(m), None, *e);
                g.record(DURATION, *secs);
                g.record_tokens(INPUT, *tokens);
            }
        };
        let mut all = Aggregates::new(1);
        record(&mut all, &first);
        record(&mut all, &second);
        let (mut a, mut b) = (Aggregates::new(0), Aggregates::new(0));
        record(&mut a, &first);
        record(&mut b, &second);
        let mut merged = Aggregates::new(1);
        assert!(merged.is_empty());
        merged.merge(&a);
        merged.merge(&b);
        assert!(!merged.is_empty());
        assert_eq!(format!("{:?}", merged.groups), format!("{:?}", all.groups));
        assert_eq!(merged.encode(&[], &[], 5), all.encode(&[], &[], 5));
        // Merged again (the next interval's), the counts add up.
        merged.merge(&a);
        let g = &merged.groups[0].1;
        assert_eq!(g.hists[DURATION].as_ref().unwrap().count, 4);
    }
}
