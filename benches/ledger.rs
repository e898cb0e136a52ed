//! Ledger hot path: reserve the worst case on 4 counters (consumer day, consumer month,
//! global day, model day), then commit the actual. Lock-free ledger vs a
//! `Mutex<HashMap<Key, (u64, u64)>>` baseline doing the same work (find the 4 counters,
//! check all 4 limits, add, then commit under the lock again), at 1 and 2 threads.
//!
//! Two-thread benches use `iter_custom`: both threads hammer the same 4 counters and share
//! the iterations (each does half), so the figure is wall time per reserve+commit of the
//! whole system (inverse throughput); per-thread latency is about twice that.
//!
//! `lockfree_resolved` skips the map look-ups (counters found once, as the governor could
//! cache them): the counter arithmetic alone. `*_tokens_only` reserve tokens only, exactly
//! the single dimension the baseline books; the others book all three dimensions.
//!
//! Each bench measures for about 2 s (0.5 s warm-up, no plots); the whole file runs in
//! about 25 s on an idle 2-core machine.

#[path = "common/mod.rs"]
mod common;
use common::two_threads;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tollgate::ledger::*;
use tollgate::units::*;

/// Far above anything the bench adds, but `Some` so the compare-exchange path is measured.
const HARD: u64 = u64::MAX / 4;
/// Worst case of one call: tokens, one request, micro-dollars.
const WORST: Amount = Amount {
    tokens: 1_200,
    requests: 1,
    usd: 3_000,
};
const ACTUAL: Amount = Amount {
    tokens: 700,
    requests: 1,
    usd: 1_700,
};
/// Tokens-only amounts, the exact work of the single-dimension mutex baseline.
const WORST_T: Amount = Amount {
    tokens: 1_200,
    requests: 0,
    usd: 0,
};
const ACTUAL_T: Amount = Amount {
    tokens: 700,
    requests: 0,
    usd: 0,
};

fn keys() -> [CounterKey; 4] {
    let day = Some(WindowKey {
        window: Window::Day,
        start: 1_717_200_000,
    });
    let month = Some(WindowKey {
        window: Window::Month,
        start: 1_717_200_000,
    });
    [
        CounterKey {
            scope: Scope::Consumer,
            id: Arc::from("team-search"),
            window: day,
        },
        CounterKey {
            scope: Scope::Consumer,
            id: Arc::from("team-search"),
            window: month,
        },
        CounterKey {
            scope: Scope::Global,
            id: Arc::from("*"),
            window: day,
        },
        CounterKey {
            scope: Scope::Model,
            id: Arc::from("gpt-4o-mini"),
            window: day,
        },
    ]
}

/// One request on the lock-free ledger: find the 4 counters, reserve, commit.
#[inline]
fn lockfree_op(ledger: &Ledger, keys: &[CounterKey; 4], worst: Amount, actual: Amount) {
    let parts = keys.each_ref().map(|k| ReservePart {
        counter: ledger.counter(k, i64::MAX),
        hard: [Some(HARD); 3],
    });
    let r = ledger
        .reserve(&parts, black_box(worst))
        .expect("never refused");
    black_box(r.commit(black_box(actual)));
}

/// The same with the 4 counters already looked up (the counter arithmetic alone).
#[inline]
fn lockfree_resolved_op(ledger: &Ledger, parts: &[ReservePart; 4]) {
    let r = ledger
        .reserve(parts, black_box(WORST))
        .expect("never refused");
    black_box(r.commit(black_box(ACTUAL)));
}

type Baseline = Mutex<HashMap<CounterKey, (u64, u64)>>;

/// The same request on a mutex-guarded map of (used, committed) tokens.
#[inline]
fn mutex_op(map: &Baseline, keys: &[CounterKey; 4], worst: u64, actual: u64) {
    {
        let mut m = map.lock().unwrap();
        for k in keys {
            let (used, _) = m.get(k).copied().unwrap_or((0, 0));
            assert!(used + worst <= HARD, "never refused");
        }
        for k in keys {
            m.entry(k.clone()).or_insert((0, 0)).0 += worst;
        }
    }
    // ... the upstream call happens here ...
    let mut m = map.lock().unwrap();
    for k in keys {
        let e = m.get_mut(k).unwrap();
        e.0 = e.0 - worst + actual;
        e.1 += actual;
    }
    black_box(&*m);
}

fn bench(c: &mut Criterion) {
    let keys = keys();

    let mut g = c.benchmark_group("reserve_commit_4_counters");

    let ledger = Ledger::new();
    g.bench_function("lockfree/1_thread", |b| {
        b.iter(|| lockfree_op(&ledger, &keys, WORST, ACTUAL))
    });
    g.bench_function("lockfree_tokens_only/1_thread", |b| {
        b.iter(|| lockfree_op(&ledger, &keys, WORST_T, ACTUAL_T))
    });
    let resolved = keys.each_ref().map(|k| ReservePart {
        counter: ledger.counter(k, i64::MAX),
        hard: [Some(HARD); 3],
    });
    g.bench_function("lockfree_resolved/1_thread", |b| {
        b.iter(|| lockfree_resolved_op(&ledger, &resolved))
    });
    let map = Baseline::default();
    g.bench_function("mutex_hashmap/1_thread", |b| {
        b.iter(|| mutex_op(&map, &keys, WORST_T.tokens, ACTUAL_T.tokens))
    });

    g.bench_function("lockfree/2_threads", |b| {
        b.iter_custom(|iters| two_threads(iters, &ledger, |l| lockfree_op(l, &keys, WORST, ACTUAL)))
    });
    g.bench_function("lockfree_tokens_only/2_threads", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, &ledger, |l| lockfree_op(l, &keys, WORST_T, ACTUAL_T))
        })
    });
    g.bench_function("lockfree_resolved/2_threads", |b| {
        b.iter_custom(|iters| two_threads(iters, &ledger, |l| lockfree_resolved_op(l, &resolved)))
    });
    g.bench_function("mutex_hashmap/2_threads", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, &map, |m| {
                mutex_op(m, &keys, WORST_T.tokens, ACTUAL_T.tokens)
            })
        })
    });
    g.finish();

    // Sanity: nothing is left reserved.
    assert_eq!(ledger.reserved_tokens(), 0);
    for k in &keys {
        let c = ledger.get(k).unwrap();
        assert_eq!(c.reserved(), Amount::ZERO);
        let (used, committed) = map.lock().unwrap()[k];
        assert_eq!(used, committed);
    }

    // The windows every request computes once (4 kinds, in a zone with DST).
    let tz = jiff::tz::TimeZone::get("Europe/Berlin").unwrap();
    let mut g = c.benchmark_group("windows");
    let mut now = 1_717_243_200_000i64;
    g.bench_function("WindowSet::at/Europe_Berlin", |b| {
        b.iter(|| {
            now += 997;
            black_box(WindowSet::at(&tz, black_box(now)))
        })
    });
    g.finish();
}

fn config() -> Criterion {
    // No plots and fewer bootstrap resamples: the analysis, not the measuring, dominated the
    // run time on a small machine.
    Criterion::default()
        .without_plots()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .nresamples(20_000)
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench
}
criterion_main!(benches);
