//! Slices (docs/scale-out-slices.md) against the real Redis on 127.0.0.1:6379: several
//! replicas (one `SlicedStore` each, same namespace) on one hard bound never admit more than
//! the limit and commit what they served; a dead replica's slice ends with its lease; slices
//! shrink near the limit so a second replica gets the remainder; with Redis cut and
//! `on_unavailable: local` a replica admits only what its slice holds. Each test uses its own
//! namespace and deletes its keys.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate::ledger::{CounterKey, SharedCounters, SharedPart, SharedReply, WindowKey};
use tollgate::policy::OnUnavailable;
use tollgate::state::{RedisStore, SlicedStore};
use tollgate::units::{Amount, Scope, Window};

const URL: &str = "redis://127.0.0.1:6379/";

fn ns(name: &str) -> String {
    format!("test-sl-{name}-{:08x}", rand::random::<u32>())
}

fn sliced(url: &str, ns: &str, lease_ms: u64, ou: OnUnavailable) -> SlicedStore {
    SlicedStore::new(
        RedisStore::with(
            url,
            ns,
            Duration::from_millis(lease_ms),
            Duration::from_secs(600),
            ou,
        )
        .unwrap(),
    )
}

fn minute_key() -> CounterKey {
    CounterKey {
        scope: Scope::Consumer,
        id: Arc::from("c"),
        window: Some(WindowKey {
            window: Window::Minute,
            start: 1_800_000_000,
        }),
    }
}

fn far() -> i64 {
    jiff::Timestamp::now().as_millisecond() + 3_600_000
}

fn tok(t: u64) -> Amount {
    Amount {
        tokens: t,
        requests: 1,
        usd: 0,
    }
}

/// Committed and held tokens of the counter in Redis.
async fn redis_ct_ht(key: &str) -> (u64, u64) {
    let mut c = common::redis_keys::conn(URL).await;
    let v: Vec<Option<u64>> = redis::cmd("HMGET")
        .arg(key)
        .arg("ct")
        .arg("ht")
        .query_async(&mut c)
        .await
        .unwrap();
    (v[0].unwrap_or(0), v[1].unwrap_or(0))
}

async fn poll_until<F: std::future::Future<Output = bool>>(
    within: Duration,
    mut f: impl FnMut() -> F,
) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// (a) Four replicas, eight tasks each, hammer one hard token bound with random worst cases
/// (settled at their worst case): the tokens admitted never exceed the limit, and once every
/// slice is given back Redis has committed exactly what was served and holds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_on_one_hard_bound_never_admit_past_it_and_commit_what_they_served() {
    const LIMIT: u64 = 20_000;
    let n = ns("exact");
    let key = minute_key();
    let replicas: Vec<SlicedStore> = (0..4)
        .map(|_| sliced(URL, &n, 30_000, OnUnavailable::Deny))
        .collect();
    let rkey = replicas[0].redis().counter_key(&key);
    let prefix = replicas[0].redis().prefix().to_owned();
    let admitted = Arc::new(AtomicU64::new(0));
    let served = Arc::new(AtomicU64::new(0));
    let exp = far();
    let mut tasks = Vec::new();
    for r in &replicas {
        for _ in 0..8 {
            let (r, admitted, served, key) =
                (r.clone(), admitted.clone(), served.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                let parts = [SharedPart {
                    key: &key,
                    hard: [Some(LIMIT), None, None],
                    expires_at: exp,
                }];
                let end = Instant::now() + Duration::from_secs(4);
                let mut refused_in_a_row = 0;
                while Instant::now() < end && refused_in_a_row < 40 {
                    let w = 5 + rand::random::<u64>() % 46;
                    match r.reserve(&parts, tok(w), 0).await.expect("redis answers") {
                        SharedReply::Held { hold, .. } => {
                            refused_in_a_row = 0;
                            let total = admitted.fetch_add(w, Ordering::SeqCst) + w;
                            assert!(total <= LIMIT, "admitted {total} > {LIMIT}");
                            if rand::random::<u8>().is_multiple_of(4) {
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                            served.fetch_add(w, Ordering::SeqCst);
                            hold.settle(tok(w));
                        }
                        SharedReply::Refused { .. } => {
                            refused_in_a_row += 1;
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        SharedReply::Rebuilding => panic!("no rebuild here"),
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    for r in &replicas {
        assert!(
            r.give_back_all(Duration::from_secs(5)).await,
            "slices given back"
        );
    }
    let (ct, ht) = redis_ct_ht(&rkey).await;
    let admitted = admitted.load(Ordering::SeqCst);
    assert_eq!(ct, served.load(Ordering::SeqCst), "committed == served");
    assert_eq!(ct, admitted);
    assert!(ct <= LIMIT, "committed {ct} > {LIMIT}");
    assert_eq!(ht, 0, "nothing held after every slice went back");
    assert!(
        admitted > LIMIT / 2,
        "the fleet got most of the bound: {admitted}"
    );
    common::redis_keys::delete_prefix(URL, &prefix).await;
}

/// (b) A replica that stops without giving its slice back: the slice keeps its amount out of
/// reach until its lease ends, then another replica gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_slice_ends_with_its_lease() {
    let n = ns("dead");
    let key = minute_key();
    let exp = far();
    let parts = [SharedPart {
        key: &key,
        hard: [Some(1_000), None, None],
        expires_at: exp,
    }];
    let a = sliced(URL, &n, 1_000, OnUnavailable::Deny);
    let rkey = a.redis().counter_key(&key);
    let prefix = a.redis().prefix().to_owned();
    let SharedReply::Held { hold, .. } = a.reserve(&parts, tok(10), 0).await.unwrap() else {
        panic!("a leases a slice");
    };
    assert_eq!(a.granted().tokens, 125, "min(64 x 10, 1000 / 8)");
    a.halt();
    std::mem::forget(hold);
    drop(a);
    assert_eq!(redis_ct_ht(&rkey).await, (0, 125));

    let b = sliced(URL, &n, 30_000, OnUnavailable::Deny);
    let t0 = Instant::now();
    let first = b.reserve(&parts, tok(880), 0).await.unwrap();
    assert!(
        matches!(first, SharedReply::Refused { .. }),
        "875 left while the dead slice holds 125"
    );
    let mut got = None;
    let end = Instant::now() + Duration::from_secs(5);
    while got.is_none() && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let SharedReply::Held { hold, .. } = b.reserve(&parts, tok(880), 0).await.unwrap() {
            got = Some(hold);
        }
    }
    let ok = got.is_some();
    assert!(ok, "the dead replica's slice was not released by its lease");
    assert!(
        t0.elapsed() >= Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    got.unwrap().settle(tok(880));
    b.give_back_all(Duration::from_secs(5)).await;
    common::redis_keys::delete_prefix(URL, &prefix).await;
}

/// (c) One replica holds a slice; a second one is not starved: slices shrink as the bound
/// nears its limit and end in per-request holds, so the second admits everything the first
/// does not hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_shrink_near_the_limit_so_a_second_replica_gets_the_remainder() {
    let n = ns("share");
    let key = minute_key();
    let exp = far();
    let parts = [SharedPart {
        key: &key,
        hard: [Some(1_000), None, None],
        expires_at: exp,
    }];
    let a = sliced(URL, &n, 30_000, OnUnavailable::Deny);
    let b = sliced(URL, &n, 30_000, OnUnavailable::Deny);
    let rkey = a.redis().counter_key(&key);
    let prefix = a.redis().prefix().to_owned();
    let SharedReply::Held { hold: ha, .. } = a.reserve(&parts, tok(10), 0).await.unwrap() else {
        panic!("a leases");
    };
    let a_slice = a.granted().tokens;
    assert_eq!(a_slice, 125);
    // b's replaced slices give their unused crumbs back within a batch period: a refusal is
    // final only once it lasts 1 s.
    let mut held = Vec::new();
    let mut refused_since: Option<Instant> = None;
    loop {
        match b.reserve(&parts, tok(10), 0).await.unwrap() {
            SharedReply::Held { hold, .. } => {
                refused_since = None;
                held.push(hold);
            }
            SharedReply::Refused { .. } => {
                let since = *refused_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_secs(1) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            SharedReply::Rebuilding => panic!(),
        }
        assert!(held.len() <= 100, "b admitted past the limit");
    }
    // Everything a does not hold: (1000 - 125) / 10 requests of 10 tokens.
    assert_eq!(held.len(), 87, "b got the remainder");
    let (ct, ht) = redis_ct_ht(&rkey).await;
    assert!(ct + ht <= 1_000, "{ct} + {ht}");
    // b's slices shrank: none of its slices may exceed 1/8 of what was left at its lease, so
    // b holds at most 875 in total and its largest slice is at most 109.
    assert!(b.granted().tokens <= 875);
    drop(ha);
    for h in held {
        h.settle(tok(10));
    }
    assert!(a.give_back_all(Duration::from_secs(5)).await);
    assert!(b.give_back_all(Duration::from_secs(5)).await);
    assert_eq!(redis_ct_ht(&rkey).await, (870, 0));
    common::redis_keys::delete_prefix(URL, &prefix).await;
}

/// (d) `on_unavailable: local` with slices: while Redis is cut the replica admits only what
/// its slice holds (then refuses, and the governor turns that into 503), and the usage is
/// written back once Redis answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_an_outage_a_replica_spends_only_its_slice() {
    let proxy = common::cuttable::Cuttable::start(6379).await;
    let via = format!("redis://127.0.0.1:{}/", proxy.port);
    let n = ns("outage");
    let key = minute_key();
    let exp = far();
    let parts = [SharedPart {
        key: &key,
        hard: [Some(1_000), None, None],
        expires_at: exp,
    }];
    let a = sliced(&via, &n, 30_000, OnUnavailable::Local);
    assert!(a.bounded_offline());
    let rkey = a.redis().counter_key(&key);
    let prefix = a.redis().prefix().to_owned();
    let SharedReply::Held { hold, .. } = a.reserve(&parts, tok(10), 0).await.unwrap() else {
        panic!("a leases");
    };
    assert_eq!(a.granted().tokens, 125);
    proxy.set_cut(true).await;
    hold.settle(tok(10));
    let mut during = 1;
    loop {
        match a.reserve(&parts, tok(10), 0).await {
            Ok(SharedReply::Held { hold, .. }) => {
                during += 1;
                hold.settle(tok(10));
            }
            Ok(other) => panic!("{other:?}"),
            Err(_) => break,
        }
        assert!(during <= 13, "admitted past the slice during the outage");
    }
    assert_eq!(during, 12, "exactly what the slice holds: 125 / 10");
    // Redis still counts the slice against the limit (nobody else can spend it).
    assert_eq!(redis_ct_ht(&rkey).await, (0, 125));
    proxy.set_cut(false).await;
    let written = poll_until(Duration::from_secs(10), || async {
        redis_ct_ht(&rkey).await.0 == 120
    })
    .await;
    assert!(
        written,
        "usage batched once Redis answers: {:?}",
        redis_ct_ht(&rkey).await
    );
    assert!(a.give_back_all(Duration::from_secs(5)).await);
    assert_eq!(redis_ct_ht(&rkey).await, (120, 0));
    common::redis_keys::delete_prefix(URL, &prefix).await;
}

/// (committed, held) tokens over the namespace's global counters on the machine's Redis.
async fn global_ct_ht(namespace: &str) -> (u64, u64) {
    let mut c = common::redis_keys::conn(URL).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{{tollgate:{namespace}}}:c:global:*"))
        .query_async(&mut c)
        .await
        .unwrap();
    let mut sum = (0, 0);
    for k in keys
        .iter()
        .filter(|k| !k.ends_with(":l") && !k.ends_with(":s"))
    {
        let (ct, ht) = redis_ct_ht(k).await;
        sum = (sum.0 + ct, sum.1 + ht);
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_sidecar_gives_its_slices_back() {
    let mock = common::mock::MockUpstream::start_with_default(
        vec![],
        common::mock::Answer::ok_chat("hi", 7, 5),
    )
    .await;
    let namespace = ns("stop");
    let yaml = format!(
        "version: slices-stop\nbackends:\n  - {{id: a, kind: openai, base_url: \"{}\"}}\nroutes:\n  - {{model: chat, chain: [{{backend: a, model: m}}]}}\nbudgets:\n  - {{name: cap, scope: global, window: month, hard_tokens: 1000000}}\nstate: {{backend: redis, redis_url: \"{URL}\", namespace: \"{namespace}\", slices: true}}\naudit: {{sink: \"off\"}}\n",
        mock.base_url()
    );
    let sc = common::sidecar::Sidecar::start_shared(&yaml).await;
    let body = serde_json::json!({"model": "chat", "max_tokens": 20,
        "messages": [{"role": "user", "content": "hi"}]});
    for _ in 0..3 {
        let (st, _, b) = common::post_json(&sc.chat_url(), &body, &[]).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    let (_, held) = global_ct_ht(&namespace).await;
    assert!(held > 0, "a slice is leased while serving");
    sc.stop().await;
    assert_eq!(
        global_ct_ht(&namespace).await,
        (36, 0),
        "what was served is committed and the rest of the slice given back"
    );
    common::redis_keys::delete_prefix(URL, &format!("{{tollgate:{namespace}}}")).await;
}
