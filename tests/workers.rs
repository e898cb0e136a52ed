//! The data port's connection workers (single-threaded runtimes, one per core by default):
//! requests on many connections are governed and audited whichever worker serves them, a
//! large prompt arriving on a worker (the size estimated on the blocking pool: which sizes
//! leave the worker is unit-tested in `estimate::tests`) is estimated and governed like any
//! other beside a small one, and `workers: 0` serves on the shared runtime as before.

mod common;

use common::mock::MockUpstream;
use common::post_json;
use common::sidecar::Sidecar;
use serde_json::json;
use tollgate::estimate::{self, Endpoint};

fn policy(base_url: &str) -> String {
    format!(
        r#"
version: workers-1
estimate: {{tokenizer: o200k}}
backends:
  - {{id: up, kind: openai, base_url: {base_url}}}
routes:
  - model: chat
    chain: [{{backend: up, model: small}}]
budgets:
  - {{name: cap, scope: global, window: day, hard_tokens: 100000000}}
"#
    )
}

fn chat(text: &str) -> serde_json::Value {
    json!({"model": "chat", "max_tokens": 16, "messages": [{"role": "user", "content": text}]})
}

fn request_id(h: &http::HeaderMap) -> String {
    h["x-tollgate-request-id"].to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_prompt_on_a_single_worker_is_estimated_and_governed_beside_a_small_one() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start_workers(&policy(&up.base_url()), 1).await;
    // ~380 KB of text: well over the size that leaves the worker for the blocking pool.
    let big = chat(&"The quick brown fox jumps over the lazy dog; naïve café. ".repeat(6_500));
    let small = chat("hello");
    let url = sc.chat_url();
    let (a, b) = tokio::join!(post_json(&url, &big, &[]), post_json(&url, &small, &[]));
    assert_eq!((a.0, b.0), (200, 200), "{:?} {:?}", a.2, b.2);
    let want = estimate::estimate(Endpoint::Chat, &big, sc.tokenizer())
        .unwrap()
        .input_tokens;
    let rec = sc.audit(&request_id(&a.1)).await;
    assert_eq!(rec["estimated_input_tokens"], want, "{rec}");
    assert_eq!(rec["final_action"], "ALLOW");
    let rec = sc.audit(&request_id(&b.1)).await;
    assert_eq!(rec["final_action"], "ALLOW");
    assert_eq!(up.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_on_many_connections_over_several_workers_are_each_governed_once() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start_workers(&policy(&up.base_url()), 3).await;
    let url = sc.chat_url();
    // Every call makes its own client connection: they spread over the three workers.
    let calls: Vec<_> = (0..24)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { post_json(&url, &chat(&format!("call {i}")), &[]).await })
        })
        .collect();
    let mut ids = Vec::new();
    for c in calls {
        let (status, h, body) = c.await.unwrap();
        assert_eq!(status, 200, "{body:?}");
        ids.push(request_id(&h));
    }
    for id in &ids {
        assert_eq!(sc.audit(id).await["final_action"], "ALLOW");
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 24);
    assert_eq!(up.hits(), 24);
    // Each call's usage was committed once: the global counter holds 24 requests.
    let total: u64 = sc
        .ledger()
        .snapshot()
        .iter()
        .filter(|(k, _, _)| k.scope == tollgate::units::Scope::Global)
        .map(|(_, committed, _)| committed.requests)
        .sum();
    assert_eq!(total, 24);
}

#[tokio::test]
async fn without_workers_connections_are_served_on_the_callers_runtime() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start_workers(&policy(&up.base_url()), 0).await;
    let (status, h, _) = post_json(&sc.chat_url(), &chat("hello"), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(sc.audit(&request_id(&h)).await["final_action"], "ALLOW");
}
