//! 200 concurrent requests against one hard budget over real HTTP (issue 3, §9): the sum of
//! committed usage never crosses the bound and exactly as many requests are admitted as the
//! budget allows.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::mock::{Answer, MockUpstream};
use common::{json, try_send_with};
use http::Method;
use serde_json::json as j;
use tollgate::audit::Audit;
use tollgate::estimate::{self, Endpoint, Tokenizer};
use tollgate::ledger::{window_at, window_end, CounterKey};
use tollgate::proxy::Snapshot;
use tollgate::sidecar::{self, Options};
use tollgate::units::{Scope, Window};

const REQUESTS: usize = 200;
/// How many requests the budget admits.
const K: u64 = 37;
const MAX_TOKENS: u64 = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_never_cross_a_hard_budget() {
    let body = j!({"model": "chat", "messages": [{"role": "user", "content": "count my tokens, please"}], "max_tokens": MAX_TOKENS});
    let est = estimate::estimate(Endpoint::Chat, &body, Tokenizer::O200k)
        .unwrap()
        .input_tokens;
    // Each request's worst case; the mock reports exactly that as usage, so nothing is released
    // and the budget admits exactly K of them whatever the interleaving.
    let worst = est + MAX_TOKENS;
    let bound = K * worst;

    // A little latency so that many reservations are in flight at once.
    let up = MockUpstream::start_with_default(
        vec![],
        Answer::ok_chat("ok", est, MAX_TOKENS).delay(Duration::from_millis(20)),
    )
    .await;
    let yaml = format!(
        r#"
version: cc-1
estimate: {{tokenizer: o200k}}
backends:
  - {{id: primary, kind: openai, base_url: {}}}
routes:
  - model: chat
    chain: [{{backend: primary, model: small}}]
budgets:
  - {{name: global-cap, scope: global, window: month, hard_tokens: {bound}}}
"#,
        up.base_url()
    );
    let policy = tollgate::policy::from_str(&yaml, "test.yaml").expect("policy");
    let snap = Snapshot::build(policy).expect("snapshot");
    let running = sidecar::start(
        snap,
        Audit::off(),
        Options {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            admin_listen: Some("127.0.0.1:0".parse().unwrap()),
            workers: None,
        },
    )
    .await
    .unwrap();
    let url = format!("http://{}/v1/chat/completions", running.addr);
    let ledger = running.app.governor.ledger.clone();
    let tz = running.app.snap.load().policy.windows.timezone.clone();
    let now = jiff::Timestamp::now().as_millisecond();
    let wk = window_at(&tz, Window::Month, now);
    let key = CounterKey {
        scope: Scope::Global,
        id: Arc::from("global"),
        window: Some(wk),
    };
    // The same counter the plan uses (created on first use either way).
    let counter = ledger.counter(&key, window_end(&tz, wk));

    // Watch the counter while the requests run: committed + reserved never crosses the bound.
    let stop = Arc::new(AtomicBool::new(false));
    let max_used = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (stop, max_used, counter) = (stop.clone(), max_used.clone(), counter.clone());
        tokio::spawn(async move {
            let mut samples = 0u64;
            while !stop.load(Ordering::Acquire) {
                let used = counter.used().tokens;
                let committed = counter.committed().tokens;
                assert!(committed <= bound, "committed {committed} > bound {bound}");
                assert!(used <= bound, "committed + reserved {used} > bound {bound}");
                max_used.fetch_max(used, Ordering::AcqRel);
                samples += 1;
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            samples
        })
    };

    let client = common::client();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..REQUESTS {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        tasks.spawn(async move {
            let job = format!("cc-{i}");
            let r = try_send_with(
                &client,
                Method::POST,
                &url,
                Some(&body),
                &[("x-tollgate-job", job.as_str())],
            )
            .await;
            (i, r)
        });
    }
    let run = async {
        let mut out = Vec::new();
        while let Some(r) = tasks.join_next().await {
            out.push(r.expect("task"));
        }
        out
    };
    let results = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("all requests answered");
    stop.store(true, Ordering::Release);
    let samples = watcher.await.expect("the watcher saw the bound hold");
    assert!(samples > 0);

    let (mut ok, mut stopped) = (0u64, 0u64);
    for (i, r) in results {
        let (status, h, b) = r.unwrap_or_else(|e| panic!("request {i}: {e}"));
        match status {
            200 => {
                ok += 1;
                assert_eq!(h["x-tollgate-action"], "ALLOW");
                assert_eq!(json(&b)["usage"]["total_tokens"], worst);
            }
            403 => {
                stopped += 1;
                assert_eq!(h["x-tollgate-action"], "HARD_STOP");
                assert_eq!(h["x-tollgate-reason"], "HARD_BUDGET_EXCEEDED");
                let v = json(&b);
                let t = &v["tollgate"];
                assert_eq!(t["final_action"], "HARD_STOP");
                assert_eq!(t["reason_class"], "HARD_BUDGET_EXCEEDED");
                assert_eq!(t["budget_state"], "HARD_EXCEEDED");
                assert_eq!(t["usage_evidence_state"], "NONE");
                assert_eq!(v["error"]["code"], "hard_budget_exceeded");
            }
            s => panic!(
                "request {i}: unexpected {s}: {h:?} {}",
                String::from_utf8_lossy(&b)
            ),
        }
    }
    assert_eq!(ok, K, "exactly what the budget allows is admitted");
    assert_eq!(stopped, REQUESTS as u64 - K);
    assert_eq!(
        up.hits() as u64,
        K,
        "refused requests never reach the upstream"
    );
    assert_eq!(counter.committed().tokens, K * worst);
    assert_eq!(counter.committed().requests, K);
    assert_eq!(counter.reserved().tokens, 0);
    assert_eq!(ledger.reserved_tokens(), 0);
    assert!(max_used.load(Ordering::Acquire) <= bound);

    // Full: one more request is refused before any call.
    let (s, _, _) = try_send_with(&client, Method::POST, &url, Some(&body), &[])
        .await
        .unwrap();
    assert_eq!(s, 403);
    assert_eq!(up.hits() as u64, K);
    tokio::time::timeout(Duration::from_secs(10), running.shutdown())
        .await
        .expect("shutdown");
}
