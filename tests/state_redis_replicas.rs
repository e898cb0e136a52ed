//! Replicas sharing one Redis, as real `tollgate serve` processes: a shared hard budget holds
//! exactly under concurrent load, a replica killed mid-call stops holding its reservations
//! after the lease, and a Redis that stops mid-run is met as `state.on_unavailable` says and
//! used again when it returns.

mod common;

use common::mock::{Answer, MockUpstream};
use common::process::{free_port, Serve};
use common::try_post_json;
use serde_json::json as j;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tollgate::estimate::{self, Endpoint, Tokenizer};

const MAX_TOKENS: u64 = 50;

fn body() -> serde_json::Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": "share this budget"}], "max_tokens": MAX_TOKENS})
}

/// The worst case of `body()` (the mock reports exactly this as usage, so nothing is released).
fn worst() -> u64 {
    estimate::estimate(Endpoint::Chat, &body(), Tokenizer::O200k)
        .unwrap()
        .input_tokens
        + MAX_TOKENS
}

fn ns(name: &str) -> String {
    format!("test-{name}-{:08x}", rand::random::<u32>())
}

struct Replica {
    serve: Serve,
}

async fn replica(
    dir: &Path,
    name: &str,
    mock: &str,
    redis_url: &str,
    namespace: &str,
    extra_state: &str,
    bounds: &str,
) -> Replica {
    let (port, admin) = (free_port(), free_port());
    let yaml = format!(
        r#"
version: rr-1
server: {{listen: "127.0.0.1:{port}", admin_listen: "127.0.0.1:{admin}"}}
backends:
  - {{id: primary, kind: openai, base_url: "{mock}", timeouts: {{total: 1500ms}}}}
routes:
  - model: chat
    chain: [{{backend: primary, model: small}}]
{bounds}
state: {{backend: redis, redis_url: "{redis_url}", namespace: "{namespace}"{extra_state}}}
audit: {{sink: "off"}}
"#
    );
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    let serve = Serve::start(&path, port, admin, &dir.join(format!("{name}.log"))).await;
    Replica { serve }
}

async fn readyz(r: &Replica) -> u16 {
    let url = format!("http://127.0.0.1:{}/readyz", r.serve.admin_port);
    common::get(&url).await.0
}

async fn chat(r: &Replica) -> (u16, String, Option<String>) {
    chat_at(&r.serve.chat_url()).await
}

async fn chat_at(url: &str) -> (u16, String, Option<String>) {
    match try_post_json(url, &body(), &[]).await {
        Ok((status, h, _)) => {
            let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
            (
                status,
                get("x-tollgate-reason").unwrap_or_default(),
                get("retry-after"),
            )
        }
        Err(e) => (0, e, None),
    }
}

async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    common::redis_keys::conn(url).await
}

/// (committed tokens, held tokens) summed over the namespace's counters of `scope`.
async fn totals(url: &str, namespace: &str, scope: &str) -> (i64, i64) {
    let v = sums(url, namespace, scope, ["ct", "ht"]).await;
    (v[0], v[1])
}

/// The hash fields `fields` summed over the namespace's counters of `scope`.
async fn sums<const N: usize>(
    url: &str,
    namespace: &str,
    scope: &str,
    fields: [&str; N],
) -> [i64; N] {
    let mut c = redis_conn(url).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{{tollgate:{namespace}}}:c:{scope}:*"))
        .query_async(&mut c)
        .await
        .unwrap();
    let mut total = [0i64; N];
    for k in keys
        .iter()
        .filter(|k| !k.ends_with(":l") && !k.ends_with(":s"))
    {
        let v: Vec<Option<i64>> = redis::cmd("HMGET")
            .arg(k)
            .arg(&fields[..])
            .query_async(&mut c)
            .await
            .unwrap();
        for (t, x) in total.iter_mut().zip(v) {
            *t += x.unwrap_or(0);
        }
    }
    total
}

async fn cleanup(url: &str, namespace: &str) {
    common::redis_keys::delete_prefix(url, &format!("{{tollgate:{namespace}}}")).await
}

const REDIS: &str = "redis://127.0.0.1:6379/";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_hold_a_shared_hard_budget_exactly() {
    const K: u64 = 37;
    const PER_REPLICA: usize = 100;
    let w = worst();
    let bound = K * w;
    let up = MockUpstream::start_with_default(
        vec![],
        Answer::ok_chat("ok", w - MAX_TOKENS, MAX_TOKENS).delay(Duration::from_millis(20)),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let n = ns("pair");
    let bounds = format!(
        "budgets:\n  - {{name: shared-cap, scope: global, window: month, hard_tokens: {bound}}}"
    );
    let a = replica(dir.path(), "a", &up.base_url(), REDIS, &n, "", &bounds).await;
    let b = replica(dir.path(), "b", &up.base_url(), REDIS, &n, "", &bounds).await;
    let (a, b) = (std::sync::Arc::new(a), std::sync::Arc::new(b));

    let mut tasks = Vec::new();
    for i in 0..2 * PER_REPLICA {
        let r = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move { chat(&r).await }));
    }
    let (mut served, mut refused) = (0u64, 0u64);
    for t in tasks {
        let (status, reason, _) = t.await.unwrap();
        match status {
            200 => served += 1,
            403 => {
                assert_eq!(reason, "HARD_BUDGET_EXCEEDED");
                refused += 1
            }
            s => panic!("unexpected {s} {reason}"),
        }
    }
    // Settlements run in the background after the response: wait for the holds to drain.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (ct, ht) = loop {
        let (ct, ht) = totals(REDIS, &n, "global").await;
        if ht == 0 || Instant::now() > deadline {
            break (ct, ht);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(ht, 0, "every hold settled");
    assert!(
        ct as u64 <= bound,
        "committed {ct} crossed the bound {bound}"
    );
    assert_eq!(
        served, K,
        "exactly what one process would admit (refused {refused})"
    );
    assert_eq!(ct as u64, K * w);
    assert_eq!(up.hits() as u64, K);
    cleanup(REDIS, &n).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_reservations_end_with_the_lease() {
    let w = worst();
    let lease = Duration::from_secs(2);
    let slow = Answer::ok_chat("slow", w - MAX_TOKENS, MAX_TOKENS).delay(Duration::from_secs(60));
    let up = MockUpstream::start_with_default(
        vec![slow.clone(), slow],
        Answer::ok_chat("ok", w - MAX_TOKENS, MAX_TOKENS),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let n = ns("lease");
    let bounds = format!(
        "budgets:\n  - {{name: shared-cap, scope: global, window: month, hard_tokens: {}}}",
        2 * w
    );
    let extra = format!(", lease: {}ms", lease.as_millis());
    let mut a = replica(dir.path(), "a", &up.base_url(), REDIS, &n, &extra, &bounds).await;
    let b = replica(dir.path(), "b", &up.base_url(), REDIS, &n, &extra, &bounds).await;

    let t0 = Instant::now();
    for _ in 0..2 {
        let url = a.serve.chat_url();
        tokio::spawn(async move { chat_at(&url).await });
    }
    assert_eq!(up.wait_for_hits(2, Duration::from_secs(10)).await, 2);
    // Both reservations were made between t0 and now: their leases end within
    // [t0 + lease, held_at + lease].
    let held_at = Instant::now();
    let (_, held) = totals(REDIS, &n, "global").await;
    assert_eq!(held as u64, 2 * w, "a holds the whole budget");
    assert_eq!(
        chat(&b).await.0,
        403,
        "b is refused while a's calls are in flight"
    );

    // kill -9 a (long before its calls' 1.5 s timeout): its reservations are never settled.
    a.serve.kill9();
    if t0.elapsed() < lease - Duration::from_millis(1000) {
        assert_eq!(chat(&b).await.0, 403, "still held within the lease");
    }
    let until = held_at + lease + Duration::from_millis(300);
    tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
    let (status, reason, _) = chat(&b).await;
    assert_eq!(
        (status, reason.as_str()),
        (200, "OK"),
        "{}",
        b.serve.log_text()
    );
    let (ct, _) = totals(REDIS, &n, "global").await;
    assert!(ct as u64 <= w, "only b's call may be committed ({ct})");
    cleanup(REDIS, &n).await;
}

/// A private redis-server, killed when dropped (also when a test fails midway).
struct RedisServer(Child);

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A private redis-server on `port` (the system one is shared by other tests).
fn redis_server(port: u16, dir: &Path) -> RedisServer {
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--bind", "127.0.0.1", "--dir"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server is installed");
    RedisServer(child)
}

async fn wait_redis(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(c) = redis::Client::open(url) {
            if let Ok(Ok(mut conn)) =
                tokio::time::timeout(Duration::from_secs(1), c.get_multiplexed_async_connection())
                    .await
            {
                let pong: Result<String, _> = redis::cmd("PING").query_async(&mut conn).await;
                if pong.is_ok() {
                    return;
                }
            }
        }
        assert!(Instant::now() < deadline, "redis-server did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Retries `chat` until `want` (or 10 s).
async fn until_status(r: &Replica, want: u16) -> (u16, String, Option<String>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = chat(r).await;
        if got.0 == want || Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_run_follows_on_unavailable_and_recovers() {
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat("ok", 5, 5)).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}/");
    let server = redis_server(port, dir.path());
    wait_redis(&url).await;
    let bounds = "quotas:\n  - {name: daily, scope: consumer, match: \"*\", window: day, limit_requests: 1000}";
    let deny = replica(
        dir.path(),
        "deny",
        &up.base_url(),
        &url,
        "d",
        ", on_unavailable: deny",
        bounds,
    )
    .await;
    let local = replica(
        dir.path(),
        "local",
        &up.base_url(),
        &url,
        "l",
        ", on_unavailable: local",
        bounds,
    )
    .await;
    assert_eq!(chat(&deny).await.0, 200);
    assert_eq!(chat(&local).await.0, 200);
    assert_eq!(readyz(&deny).await, 200);

    // Redis stops mid-run.
    drop(server);
    let (status, reason, retry_after) = until_status(&deny, 503).await;
    assert_eq!(
        (status, reason.as_str()),
        (503, "STATE_UNAVAILABLE"),
        "deny refuses"
    );
    assert_eq!(retry_after.as_deref(), Some("1"));
    // /readyz pings Redis itself: deny is out of service, local keeps serving alone.
    assert_eq!(readyz(&deny).await, 503, "deny is not ready without Redis");
    assert_eq!(readyz(&local).await, 200, "local stays ready");
    // Every request local serves from here on is counted in Redis in the end: directly, or
    // written back after the outage.
    const ALONE: usize = 5;
    for _ in 0..ALONE {
        assert_eq!(
            chat(&local).await.0,
            200,
            "local serves from its own ledger"
        );
    }
    // Plus the call served before Redis stopped: the restarted Redis has lost it, and the
    // replica's journal gives it back (issue 51: lost counters are rebuilt, never a fresh
    // budget).
    let mut served = ALONE as i64 + 1;
    assert!(
        local
            .serve
            .log_text()
            .contains("THIS REPLICA NOW COUNTS ALONE"),
        "a loud warning:\n{}",
        local.serve.log_text()
    );

    // Redis returns (empty: no persistence): both replicas use it again.
    let server = redis_server(port, dir.path());
    wait_redis(&url).await;
    assert_eq!(until_status(&deny, 200).await.0, 200, "deny recovers");
    assert_eq!(readyz(&deny).await, 200, "ready again");
    // (May meet 503 STATE_REBUILDING while local gives its share back.)
    assert_eq!(until_status(&local, 200).await.0, 200);
    served += 1;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = redis_conn(&url).await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("{tollgate:l}:c:consumer:*")
            .query_async(&mut c)
            .await
            .unwrap();
        if !keys.is_empty() {
            break;
        }
        assert_eq!(chat(&local).await.0, 200);
        served += 1;
        assert!(Instant::now() < deadline, "local never went back to Redis");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The restarted Redis was empty: what it holds for local is exactly what local served,
    // the outage's share written back once (none twice, none lost), nothing held.
    let deadline = Instant::now() + Duration::from_secs(10);
    let [requests, held] = loop {
        let v = sums(&url, "l", "consumer", ["cr", "hr"]).await;
        if v[0] >= served || Instant::now() > deadline {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!((requests, held), (served, 0), "requests committed in Redis");
    assert!(
        local.serve.log_text().contains("written back"),
        "{}",
        local.serve.log_text()
    );
    assert!(deny.serve.log_text().contains("Redis answers again"));
    drop(server);
}
