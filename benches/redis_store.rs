//! Redis store on loopback: latency of one reservation (the `reserve.lua` round trip) and one
//! settlement (`settle.lua`) across the 5 counters of a typical request (consumer minute and
//! day, global month, backend day, job), p50/p99 sequentially, then throughput with 16
//! reservations in flight at once over one multiplexed connection.
//!
//! `cargo bench --bench redis_store` (needs Redis on 127.0.0.1:6379, or `TOLLGATE_BENCH_REDIS`).
//! Bounded: 5 000 sequential pairs and 3 s of concurrent load (`BENCH_SECS`). Under
//! `cargo test --all-targets` (no `--bench` argument) it runs 50 pairs as a smoke test.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate::ledger::{CounterKey, SharedPart, WindowKey};
use tollgate::policy::OnUnavailable;
use tollgate::state::RedisStore;
use tollgate::units::{Amount, Scope, Window};

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

fn keys() -> Vec<CounterKey> {
    let w = |window, start| Some(WindowKey { window, start });
    vec![
        CounterKey {
            scope: Scope::Consumer,
            id: Arc::from("bench"),
            window: w(Window::Minute, 1_800_000_000),
        },
        CounterKey {
            scope: Scope::Consumer,
            id: Arc::from("bench"),
            window: w(Window::Day, 1_799_971_200),
        },
        CounterKey {
            scope: Scope::Global,
            id: Arc::from("global"),
            window: w(Window::Month, 1_798_761_600),
        },
        CounterKey {
            scope: Scope::Backend,
            id: Arc::from("gemini"),
            window: w(Window::Day, 1_799_971_200),
        },
        CounterKey {
            scope: Scope::Job,
            id: Arc::from("job-bench"),
            window: None,
        },
    ]
}

fn pct(v: &mut [u64], p: f64) -> f64 {
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i] as f64 / 1000.0
}

async fn pair(s: &RedisStore, parts: &[SharedPart<'_>]) -> (u64, u64) {
    let t0 = Instant::now();
    let (r, _) = s.reserve_hold(parts, WORST).await.expect("redis answers");
    let t1 = Instant::now();
    let mut h = r.expect("no limit is near");
    h.settle_now(Some(ACTUAL)).await.expect("redis answers");
    let t2 = Instant::now();
    ((t1 - t0).as_nanos() as u64, (t2 - t1).as_nanos() as u64)
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let url =
        std::env::var("TOLLGATE_BENCH_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let secs: u64 = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let ns = format!("bench-{:08x}", rand::random::<u32>());
        let s = RedisStore::with(
            &url,
            &ns,
            Duration::from_secs(150),
            Duration::from_secs(600),
            OnUnavailable::Deny,
        )
        .expect("redis url");
        let keys = keys();
        let far = jiff::Timestamp::now().as_millisecond() + 3_600_000;
        let parts: Vec<SharedPart<'_>> = keys
            .iter()
            .map(|k| SharedPart {
                key: k,
                hard: [Some(u64::MAX / 4), Some(u64::MAX / 4), None],
                expires_at: far,
            })
            .collect();
        let n = if bench { 5_000 } else { 50 };
        for _ in 0..n.min(500) {
            pair(&s, &parts).await;
        }
        let (mut res, mut set, mut both) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for _ in 0..n {
            let (r, t) = pair(&s, &parts).await;
            res.push(r);
            set.push(t);
            both.push(r + t);
        }
        // Baseline: a bare PING round trip on a connection of its own.
        let mut c = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let mut ping = Vec::with_capacity(n);
        for _ in 0..n {
            let t0 = Instant::now();
            let _: String = redis::cmd("PING").query_async(&mut c).await.unwrap();
            ping.push(t0.elapsed().as_nanos() as u64);
        }
        println!(
            "  PING     p50 {:7.1} µs  p99 {:7.1} µs",
            pct(&mut ping, 0.5),
            pct(&mut ping, 0.99)
        );
        println!(
            "redis_store: {} counters per call, {n} sequential reserve+settle pairs",
            parts.len()
        );
        println!(
            "  reserve  p50 {:7.1} µs  p99 {:7.1} µs",
            pct(&mut res, 0.5),
            pct(&mut res, 0.99)
        );
        println!(
            "  settle   p50 {:7.1} µs  p99 {:7.1} µs",
            pct(&mut set, 0.5),
            pct(&mut set, 0.99)
        );
        println!(
            "  pair     p50 {:7.1} µs  p99 {:7.1} µs",
            pct(&mut both, 0.5),
            pct(&mut both, 0.99)
        );

        if bench {
            let done = Arc::new(AtomicU64::new(0));
            let until = Instant::now() + Duration::from_secs(secs);
            let s = Arc::new(s.clone());
            let keys = Arc::new(keys);
            let mut tasks = Vec::new();
            for _ in 0..16 {
                let (s, keys, done) = (s.clone(), keys.clone(), done.clone());
                tasks.push(tokio::spawn(async move {
                    let parts: Vec<SharedPart<'_>> = keys
                        .iter()
                        .map(|k| SharedPart {
                            key: k,
                            hard: [Some(u64::MAX / 4), Some(u64::MAX / 4), None],
                            expires_at: far,
                        })
                        .collect();
                    while Instant::now() < until {
                        pair(&s, &parts).await;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }));
            }
            let t0 = Instant::now();
            for t in tasks {
                t.await.unwrap();
            }
            let ops = done.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64();
            println!(
                "  16 in flight: {ops:.0} reserve+settle pairs/s ({:.0} round trips/s)",
                ops * 2.0
            );
        }
        // Clean up the namespace's keys.
        let mut c = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let ks: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", s_prefix(&ns)))
            .query_async(&mut c)
            .await
            .unwrap();
        if !ks.is_empty() {
            let _: () = redis::cmd("DEL").arg(ks).query_async(&mut c).await.unwrap();
        }
    });
}

fn s_prefix(ns: &str) -> String {
    format!("{{tollgate:{ns}}}")
}
