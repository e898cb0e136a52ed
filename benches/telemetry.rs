//! What a request's end costs in counters, alone and with two threads at it at once (two
//! connection workers): the metrics and status counters of a served request
//! (`telemetry::observe`), and a call's circuit (found, read, told of the success).
//!
//! Two-thread benches use `iter_custom` and report the wall time of all iterations split over
//! both threads: inverse throughput. Shared counters show there as lines moving between the
//! cores on every call.
//!
//!   cargo bench --bench telemetry

#[path = "common/mod.rs"]
mod common;
use common::two_threads;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::sync::Arc;
use std::time::Duration;
use tollgate::audit::Entry;
use tollgate::governor::{AttemptRecord, CircuitState, Governor, Record, UsageEvidence};
use tollgate::ledger::{Ledger, WindowSet};
use tollgate::policy::AlertsCfg;

/// The record of a served chat request: one attempt, actual usage.
fn served() -> Entry {
    let backend: Arc<str> = Arc::from("local");
    let model: Arc<str> = Arc::from("llama");
    let mut rec = Record::new(
        Arc::from("bench-1"),
        Arc::from("r"),
        Arc::from("r"),
        Arc::from("bench"),
        Arc::from("chat"),
    );
    rec.backend = backend.clone();
    rec.upstream_model = Some(model.clone());
    rec.usage_evidence_state = UsageEvidence::Actual;
    rec.actual_input_tokens = 20;
    rec.actual_output_tokens = 9;
    rec.cost_usd = 0.000_002_9;
    rec.attempts.push(AttemptRecord {
        backend,
        model,
        attempt: 1,
        probe: false,
        worst_tokens: 1_000,
        worst_cost_usd: 0.0001,
        max_output_tokens: 980,
        outcome: "ok",
        status: Some(200),
        retry_after_ms: None,
        circuit_before: CircuitState::Closed,
        circuit_after: CircuitState::Closed,
        latency_ms: 1,
        waited_ms: 0,
        committed_tokens: 0,
    });
    Entry {
        ts: "2026-12-07T00:00:00Z".into(),
        endpoint: "chat.completions",
        api: "openai",
        latency_ms: 1.2,
        record: rec,
    }
}

fn bench(c: &mut Criterion) {
    let entry = served();
    let windows = WindowSet::at(&jiff::tz::TimeZone::UTC, 1_800_000_000_000);
    let alerts = AlertsCfg {
        webhook_url: None,
        timeout: Duration::from_secs(1),
        queue: 1,
        max_attempts: 1,
    };
    let observe = |e: &Entry| tollgate::telemetry::observe(black_box(e), windows, &alerts);

    let mut g = c.benchmark_group("observe_served");
    g.bench_function("1_thread", |b| b.iter(|| observe(&entry)));
    g.bench_function("2_threads", |b| {
        b.iter_custom(|iters| two_threads(iters, &entry, observe))
    });
    g.finish();

    let gov = Governor::new(Arc::new(Ledger::new()));
    let id: Arc<str> = Arc::from("local");
    let call = |g: &Governor| {
        let c = g.circuit(black_box(&id));
        black_box(c.state_at(1_800_000_000_000));
        c.on_success(None);
    };
    let mut g = c.benchmark_group("circuit_per_call");
    g.bench_function("1_thread", |b| b.iter(|| call(&gov)));
    g.bench_function("2_threads", |b| {
        b.iter_custom(|iters| two_threads(iters, &gov, call))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
