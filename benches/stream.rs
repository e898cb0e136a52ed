//! Streaming through the sidecar vs direct, on loopback: time to first byte (p50/p99 over
//! sequential requests) and streaming throughput (chunks per second over concurrent streams).
//! Not criterion: each sample is a whole HTTP exchange; the figures are printed as a table.
//!   cargo bench --bench stream

#[path = "../tests/common/mod.rs"]
mod common;

use common::mock::{Answer, MockUpstream};
use http_body_util::BodyExt;
use std::time::{Duration, Instant};
use tollgate::audit::Audit;
use tollgate::proxy::Snapshot;
use tollgate::sidecar::{self, Options};

const POLICY: &str = r#"
version: stream-bench
backends:
  - {id: local, kind: openai, base_url: "URL", price_per_1k: {input: 0.0001, output: 0.0001}}
routes:
  - {model: chat, chain: [{backend: local, model: llama}]}
rate_limits:
  - {name: tpm, scope: consumer, match: "*", window: minute, limit_tokens: 100000000000}
budgets:
  - {name: monthly, scope: global, window: month, hard_usd: 1000000}
  - {name: per-request, scope: request, hard_tokens: 16000}
"#;

fn body() -> bytes::Bytes {
    bytes::Bytes::from(
        serde_json::json!({"model": "chat", "stream": true, "max_tokens": 64,
            "messages": [{"role": "user", "content": "Count to ten."}]})
        .to_string(),
    )
}

/// (time to first byte, chunks received) of one streamed request.
async fn one(client: &common::HttpClient, url: &str) -> (Duration, usize) {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(body()))
        .expect("request");
    let t0 = Instant::now();
    let resp = client.request(req).await.expect("response");
    let mut b = resp.into_body();
    let mut ttfb = None;
    let mut frames = 0;
    while let Some(f) = b.frame().await {
        let f = f.expect("frame");
        if f.is_data() {
            ttfb.get_or_insert_with(|| t0.elapsed());
            frames += 1;
        }
    }
    (ttfb.unwrap_or_default(), frames)
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

async fn ttfb(label: &str, url: &str, n: usize) -> (Duration, Duration) {
    let client = common::client();
    for _ in 0..n.min(50) {
        one(&client, url).await;
    }
    let mut v: Vec<Duration> = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(one(&client, url).await.0);
    }
    let (p50, p99) = (pct(&mut v, 0.5), pct(&mut v, 0.99));
    println!(
        "| {label} | TTFB p50 {:.0} µs | p99 {:.0} µs |",
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6
    );
    (p50, p99)
}

async fn throughput(label: &str, url: &str, streams: usize, per: usize) {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let url = url.to_string();
        tasks.push(tokio::spawn(async move {
            let client = common::client();
            let mut chunks = 0;
            for _ in 0..per {
                chunks += one(&client, &url).await.1;
            }
            chunks
        }));
    }
    let mut chunks = 0;
    for t in tasks {
        chunks += t.await.expect("task");
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "| {label} | {streams} concurrent streams | {:.0} streams/s | {:.0} chunks/s |",
        (streams * per) as f64 / secs,
        chunks as f64 / secs
    );
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this once as a smoke test.
    let full = std::env::args().any(|a| a == "--bench");
    let (samples, per_stream) = if full { (2000, 200) } else { (20, 5) };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let pieces: Vec<String> = (0..20).map(|i| format!(" {i}")).collect();
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let mock = MockUpstream::start_with_default(
            vec![],
            Answer::sse_chat(&refs, Some((12, 20)), Duration::ZERO),
        )
        .await;
        let policy =
            tollgate::policy::from_str(&POLICY.replace("URL", &mock.base_url()), "bench.yaml")
                .expect("policy");
        let snap = Snapshot::build(policy).expect("snapshot");
        let opts = Options {
            listen: Some("127.0.0.1:0".parse().expect("addr")),
            admin_listen: Some("127.0.0.1:0".parse().expect("addr")),
            workers: None,
        };
        let running = sidecar::start(snap, Audit::off(), opts)
            .await
            .expect("start");
        let direct = mock.url("/chat/completions");
        let through = format!("http://{}/v1/chat/completions", running.addr);
        println!("| path | | |");
        println!("| --- | --- | --- |");
        let (d50, _) = ttfb("direct", &direct, samples).await;
        let (t50, _) = ttfb("tollgate", &through, samples).await;
        println!(
            "added TTFB at p50: {:.0} µs",
            (t50.saturating_sub(d50)).as_secs_f64() * 1e6
        );
        println!();
        throughput("direct", &direct, 16, per_stream).await;
        throughput("tollgate", &through, 16, per_stream).await;
        running.shutdown().await;
    });
}
