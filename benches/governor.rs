//! The whole decision for an allowed request (gates, reservation across every counter,
//! circuit admission, the call through a no-op upstream, settle), at one thread and at two at
//! once (two connection workers: `iter_custom`, the wall time of all iterations split over
//! both, i.e. inverse throughput), and circuit admission alone.

#[path = "common/mod.rs"]
mod common;
use criterion::{criterion_group, criterion_main, Criterion};
use futures_util::FutureExt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tollgate::governor::{
    CallResult, CallSpec, Circuit, Clock, Governor, RequestCtx, Served, Upstream, Usage,
    UsageEvidence,
};
use tollgate::ledger::Ledger;
use tollgate::policy::Backend;

const POLICY: &str = r#"
version: bench
backends:
  - {id: ollama, kind: openai, base_url: "http://127.0.0.1:11434/v1", price_per_1k: {input: 0, output: 0}}
  - {id: gemini, kind: openai, base_url: "http://127.0.0.1:9/v1", price_per_1k: {input: 0.001, output: 0.001}}
  - {id: claude, kind: openai, base_url: "http://127.0.0.1:10/v1", price_per_1k: {input: 0.008, output: 0.008}}
routes:
  - model: chat
    chain:
      - {backend: ollama, model: llama}
      - {backend: gemini, model: flash}
      - {backend: claude, model: haiku}
    static_response: "unavailable"
rate_limits:
  - {name: consumer-tpm, scope: consumer, match: "*", window: minute, limit_tokens: 1000000000000}
quotas:
  - {name: consumer-daily, scope: consumer, match: "*", window: day, limit_tokens: 1000000000000}
  - {name: gemini-daily, scope: backend, match: gemini, window: day, limit_tokens: 100000}
budgets:
  - {name: monthly-spend, scope: global, window: month, hard_usd: 1000000}
  - {name: per-job, scope: job, hard_tokens: 1000000000, soft_tokens: 900000000}
  - {name: per-request, scope: request, hard_tokens: 16000}
"#;

struct Instant200;
impl Upstream for Instant200 {
    type Payload = ();
    fn eligible(&self, _i: usize, _b: &Backend) -> bool {
        true
    }
    fn call(&self, _spec: CallSpec<'_>) -> impl Future<Output = CallResult<()>> + Send {
        std::future::ready(CallResult::Served(()))
    }
}

struct Frozen(i64);
impl Clock for Frozen {
    fn now_ms(&self) -> i64 {
        self.0
    }
    fn sleep_ms(&self, _ms: u64) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

fn bench(c: &mut Criterion) {
    let policy = tollgate::policy::from_str(POLICY, "bench.yaml").expect("policy");
    let route = policy.route("chat").expect("route").clone();
    let gov = Governor::new(Arc::new(Ledger::new()));
    let clock = Frozen(1_795_990_000_000);
    let jobs: Vec<Arc<str>> = (0..1024).map(|i| Arc::from(format!("job-{i}"))).collect();
    let consumers: Vec<Arc<str>> = (0..16)
        .map(|i| Arc::from(format!("consumer-{i}")))
        .collect();
    let decide = |i: usize| {
        let ctx = RequestCtx {
            request_id: jobs[i % 1024].clone(),
            job_id: jobs[i % 1024].clone(),
            consumer: consumers[i % 16].clone(),
            team: None,
            input_tokens: 500,
            max_output_tokens: Some(500),
            n: 1,
            static_ok: true,
        };
        let out = gov
            .govern(&policy, &route, &ctx, &Instant200, &clock)
            .now_or_never()
            .expect("ready");
        let mut rec = out.record;
        if let Served::Upstream { pending, .. } = out.served {
            gov.settle(
                &policy,
                &mut rec,
                *pending,
                Usage::new(480, 200),
                UsageEvidence::Actual,
            );
        }
        rec
    };
    let mut i = 0usize;
    c.bench_function(
        "decision/allowed request (govern + settle, 5 counters)",
        |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                decide(i)
            })
        },
    );
    // Both threads ask for the same consumers and jobs (as two workers serving one client);
    // each counts its own requests (a shared count would be one more line between them).
    thread_local! {
        static NEXT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }
    c.bench_function(
        "decision/allowed request (govern + settle, 5 counters), 2 threads",
        |b| {
            b.iter_custom(|iters| {
                common::two_threads(iters, &(), |_| {
                    let i = NEXT.with(|n| {
                        n.set(n.get().wrapping_add(1));
                        n.get()
                    });
                    criterion::black_box(decide(i));
                })
            })
        },
    );
    let circuit = Circuit::new();
    let cfg = policy.backends[0].circuit.clone();
    c.bench_function("circuit/admission (closed)", |b| {
        b.iter(|| circuit.admit(clock.0, &cfg))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
