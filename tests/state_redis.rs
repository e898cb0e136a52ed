//! The Redis store's scripts against the real Redis on 127.0.0.1:6379: all-or-nothing
//! reservations across counters and dimensions, idempotent settlement, leases that release a
//! dead holder's worst case, keys that expire with their window. Each test uses its own
//! namespace and deletes its keys.

mod common;

use std::sync::Arc;
use std::time::Duration;
use tollgate::ledger::{CounterKey, DimRefusal, SharedPart, WindowKey};
use tollgate::policy::OnUnavailable;
use tollgate::state::RedisStore;
use tollgate::units::{Amount, Dim, Scope, Window};

const URL: &str = "redis://127.0.0.1:6379/";

fn ns(name: &str) -> String {
    format!("test-{name}-{:08x}", rand::random::<u32>())
}

fn store(ns: &str, lease_ms: u64) -> RedisStore {
    RedisStore::with(
        URL,
        ns,
        Duration::from_millis(lease_ms),
        Duration::from_secs(600),
        OnUnavailable::Deny,
    )
    .unwrap()
}

async fn conn() -> redis::aio::MultiplexedConnection {
    common::redis_keys::conn(URL).await
}

/// Deletes every key of the namespace (call it at the end of each test).
async fn cleanup(prefix: &str) {
    common::redis_keys::delete_prefix(URL, prefix).await
}

async fn hget(key: &str, field: &str) -> i64 {
    let mut c = conn().await;
    let v: Option<i64> = redis::cmd("HGET")
        .arg(key)
        .arg(field)
        .query_async(&mut c)
        .await
        .unwrap();
    v.unwrap_or(0)
}

fn day_key(id: &str) -> CounterKey {
    CounterKey {
        scope: Scope::Consumer,
        id: Arc::from(id),
        window: Some(WindowKey {
            window: Window::Day,
            start: 1_800_000_000,
        }),
    }
}

fn tokens(t: u64) -> Amount {
    Amount {
        tokens: t,
        requests: 1,
        usd: 10,
    }
}

fn far() -> i64 {
    jiff::Timestamp::now().as_millisecond() + 3_600_000
}

#[tokio::test]
async fn reservations_are_all_or_nothing_across_counters_and_dimensions() {
    let n = ns("aon");
    let s = store(&n, 30_000);
    let (a, b) = (day_key("a"), day_key("b"));
    let parts = [
        SharedPart {
            key: &a,
            hard: [Some(100), None, None],
            expires_at: far(),
        },
        SharedPart {
            key: &b,
            hard: [Some(50), Some(5), None],
            expires_at: far(),
        },
    ];
    let (r, committed) = s.reserve_hold(&parts, tokens(40)).await.unwrap();
    let mut first = r.expect("fits both");
    assert_eq!(committed, vec![Amount::ZERO; 2]);
    // 40 more fits a (80 <= 100) but not b (80 > 50): nothing may stay held on a.
    let (r, _) = s.reserve_hold(&parts, tokens(40)).await.unwrap();
    let (part, refusal) = r.expect_err("b is full");
    assert_eq!(
        (part, refusal),
        (
            1,
            DimRefusal {
                dim: Dim::Tokens,
                used: 40,
                hard: 50
            }
        )
    );
    let (ka, kb) = (s.counter_key(&a), s.counter_key(&b));
    assert_eq!(
        hget(&ka, "ht").await,
        40,
        "the refused call left nothing on a"
    );
    assert_eq!(hget(&kb, "ht").await, 40);

    // The requests dimension refuses on its own.
    first.settle_now(Some(tokens(10))).await.unwrap();
    let small = tokens(1);
    let mut held = Vec::new();
    for _ in 0..4 {
        let (r, _) = s.reserve_hold(&parts, small).await.unwrap();
        held.push(r.expect("requests left"));
    }
    let (r, committed) = s.reserve_hold(&parts, small).await.unwrap();
    let (part, refusal) = r.expect_err("5 requests used");
    assert_eq!(
        (part, refusal.dim, refusal.used, refusal.hard),
        (1, Dim::Requests, 5, 5)
    );
    assert_eq!(
        committed[1],
        tokens(10),
        "committed totals come back with a refusal"
    );
    for mut h in held {
        h.settle_now(None).await.unwrap();
    }
    assert_eq!(hget(&kb, "hr").await, 0);
    assert_eq!(hget(&kb, "cr").await, 1, "releases commit nothing");
    cleanup(s.prefix()).await;
}

#[tokio::test]
async fn settlement_is_idempotent_by_reservation_id() {
    let n = ns("idem");
    let s = store(&n, 30_000);
    let a = day_key("a");
    let parts = [SharedPart {
        key: &a,
        hard: [Some(100), None, None],
        expires_at: far(),
    }];
    let (r, _) = s.reserve_hold(&parts, tokens(60)).await.unwrap();
    let mut h = r.unwrap();
    assert_eq!(h.settle_now(Some(tokens(25))).await.unwrap(), 1);
    assert_eq!(
        h.settle_now(Some(tokens(25))).await.unwrap(),
        0,
        "a retry is a no-op"
    );
    assert_eq!(h.settle_now(None).await.unwrap(), 0);
    let k = s.counter_key(&a);
    assert_eq!(hget(&k, "ct").await, 25);
    assert_eq!(hget(&k, "cu").await, 10);
    assert_eq!(hget(&k, "ht").await, 0);
    // 25 committed + 75 fits exactly; 76 does not.
    let (r, c) = s.reserve_hold(&parts, tokens(76)).await.unwrap();
    assert!(r.is_err());
    assert_eq!(c[0].tokens, 25);
    let (r, _) = s.reserve_hold(&parts, tokens(75)).await.unwrap();
    r.unwrap().settle_now(None).await.unwrap();
    cleanup(s.prefix()).await;
}

#[tokio::test]
async fn an_expired_lease_releases_a_dead_holders_worst_case() {
    let n = ns("lease");
    let s = store(&n, 300);
    let a = day_key("a");
    let parts = [SharedPart {
        key: &a,
        hard: [Some(50), None, None],
        expires_at: far(),
    }];
    let (r, _) = s.reserve_hold(&parts, tokens(40)).await.unwrap();
    // The holder dies: neither settle nor release ever reaches Redis.
    std::mem::forget(r.unwrap());
    let (r, _) = s.reserve_hold(&parts, tokens(40)).await.unwrap();
    assert!(r.is_err(), "held until the lease ends");
    tokio::time::sleep(Duration::from_millis(450)).await;
    let (r, _) = s.reserve_hold(&parts, tokens(40)).await.unwrap();
    let mut h = r.expect("the dead hold was purged");
    assert_eq!(
        hget(&s.counter_key(&a), "ht").await,
        40,
        "only the live hold counts"
    );
    // A late settle of a purged hold still commits what was used, once.
    h.settle_now(Some(tokens(5))).await.unwrap();
    assert_eq!(hget(&s.counter_key(&a), "ht").await, 0);
    cleanup(s.prefix()).await;
}

/// A settle that arrives after its hold's lease ran out (a journal replay after an outage)
/// still commits the actual usage, and a replay of it never counts twice.
#[tokio::test]
async fn a_settle_after_the_lease_commits_once() {
    let n = ns("late");
    let s = store(&n, 300);
    let a = day_key("a");
    let parts = [SharedPart {
        key: &a,
        hard: [Some(50), None, None],
        expires_at: far(),
    }];
    let (r, _) = s.reserve_hold(&parts, tokens(40)).await.unwrap();
    let mut late = r.unwrap();
    tokio::time::sleep(Duration::from_millis(450)).await;
    // Another reservation purges the expired hold.
    let (r, _) = s.reserve_hold(&parts, tokens(40)).await.unwrap();
    let mut live = r.expect("the expired hold was purged");
    assert_eq!(late.settle_now(Some(tokens(5))).await.unwrap(), 1);
    let k = s.counter_key(&a);
    assert_eq!((hget(&k, "ct").await, hget(&k, "ht").await), (5, 40));
    assert_eq!(
        late.settle_now(Some(tokens(5))).await.unwrap(),
        0,
        "replayed"
    );
    assert_eq!(hget(&k, "ct").await, 5, "counted once");
    live.settle_now(None).await.unwrap();
    assert_eq!(hget(&k, "ht").await, 0);
    cleanup(s.prefix()).await;
}

#[tokio::test]
async fn keys_expire_with_their_window() {
    let n = ns("ttl");
    let lease = 2_000;
    let s = store(&n, lease);
    let a = day_key("a");
    let job = CounterKey {
        scope: Scope::Job,
        id: Arc::from("job-1"),
        window: None,
    };
    let end = jiff::Timestamp::now().as_millisecond() + 10_000;
    let parts = [
        SharedPart {
            key: &a,
            hard: [None; 3],
            expires_at: end,
        },
        SharedPart {
            key: &job,
            hard: [Some(1_000), None, None],
            expires_at: i64::MAX,
        },
    ];
    let (r, _) = s.reserve_hold(&parts, tokens(1)).await.unwrap();
    r.unwrap().settle_now(Some(tokens(1))).await.unwrap();
    let mut c = conn().await;
    for suffix in ["", ":l", ":s"] {
        let k = format!("{}{suffix}", s.counter_key(&a));
        let at: i64 = redis::cmd("PEXPIRETIME")
            .arg(&k)
            .query_async(&mut c)
            .await
            .unwrap();
        if suffix == ":l" && at == -2 {
            continue; // the holds ZSET is gone once empty
        }
        assert_eq!(at, end + lease as i64 + 60_000, "{k}");
    }
    let pttl: i64 = redis::cmd("PTTL")
        .arg(s.counter_key(&job))
        .query_async(&mut c)
        .await
        .unwrap();
    let want = 600_000 + lease as i64;
    assert!(
        pttl > want - 5_000 && pttl <= want,
        "job counter ttl {pttl}"
    );
    assert!(
        s.prefix().starts_with("{tollgate:"),
        "one hash tag for every key"
    );
    cleanup(s.prefix()).await;
}

#[tokio::test]
async fn an_unreachable_redis_answers_unavailable_fast() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let s = RedisStore::with(
        &format!("redis://127.0.0.1:{port}/"),
        "x",
        Duration::from_secs(5),
        Duration::from_secs(60),
        OnUnavailable::Local,
    )
    .unwrap();
    let a = day_key("a");
    let parts = [SharedPart {
        key: &a,
        hard: [None; 3],
        expires_at: far(),
    }];
    let t0 = std::time::Instant::now();
    assert!(s.reserve_hold(&parts, tokens(1)).await.is_err());
    assert!(s.is_down());
    // Within the retry window the answer needs no network at all.
    assert!(s.reserve_hold(&parts, tokens(1)).await.is_err());
    assert!(
        t0.elapsed() < Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
}
