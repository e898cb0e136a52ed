//! Failure handling over real HTTP (issue 3, §9): failover down a three-backend chain,
//! Retry-After honoured when short and turned into DEFER when long, and a circuit that opens
//! after its threshold and closes again after a half-open probe.

mod common;

use std::time::{Duration, Instant};

use common::mock::{Answer, MockUpstream};
use common::sidecar::Sidecar;
use common::{json, post_json};
use http::HeaderMap;
use serde_json::{json as j, Value};
use tollgate::governor::CircuitState;

fn hdr<'a>(h: &'a HeaderMap, name: &str) -> &'a str {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("missing header {name}: {h:?}"))
}

fn chat(content: &str) -> Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": content}], "max_tokens": 50})
}

fn rid(id: &str) -> [(&str, &str); 1] {
    [("x-request-id", id)]
}

// ---------------------------------------------------------------------------------------------
// Failover across a three-backend chain
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_across_three_backends() {
    let a = MockUpstream::start(vec![Answer::reset()]).await;
    let b = MockUpstream::start(vec![Answer::status(503)]).await;
    let c = MockUpstream::start(vec![Answer::ok_chat("served by the third", 12, 7)]).await;
    let yaml = format!(
        r#"
version: fo-1
backends:
  - {{id: first, kind: openai, base_url: {}}}
  - {{id: second, kind: openai, base_url: {}}}
  - {{id: third, kind: openai, base_url: {}}}
routes:
  - model: chat
    chain:
      - {{backend: first, model: m-first}}
      - {{backend: second, model: m-second}}
      - {{backend: third, model: m-third}}
retry: {{max_attempts_per_job: 3, same_backend_retries: 0}}
fallback: {{max_fallbacks_per_job: 2, max_amplification: 3.0}}
"#,
        a.base_url(),
        b.base_url(),
        c.base_url()
    );
    let sc = Sidecar::start(&yaml).await;
    let t0 = Instant::now();
    let (s, h, body) = post_json(&sc.chat_url(), &chat("hi"), &rid("fo-1")).await;
    assert_eq!(s, 200, "{h:?} {}", String::from_utf8_lossy(&body));
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "no waiting on the way down the chain: {:?}",
        t0.elapsed()
    );
    assert_eq!(hdr(&h, "x-tollgate-backend"), "third");
    assert_eq!(hdr(&h, "x-tollgate-action"), "ALLOW");
    // A request served by a fallback keeps the reason why the primary was not used.
    assert_eq!(hdr(&h, "x-tollgate-reason"), "UPSTREAM_FAILURE");
    let v = json(&body);
    assert_eq!(v["choices"][0]["message"]["content"], "served by the third");
    assert_eq!(v["model"], "m-third");
    assert_eq!((a.hits(), b.hits(), c.hits()), (1, 1, 1));
    assert_eq!(c.last_request().unwrap().model(), Some("m-third"));
    assert_eq!(b.last_request().unwrap().model(), Some("m-second"));

    let au = sc.audit("fo-1").await;
    assert_eq!(au["calls"], j!(["first", "second", "third"]));
    assert_eq!(au["fallback_state"], "USED");
    assert_eq!(au["retry_state"], "RETRIED");
    assert_eq!(au["usage_evidence_state"], "ACTUAL");
    assert_eq!(au["attempts"][0]["outcome"], "connect");
    assert_eq!(au["attempts"][1]["outcome"], "5xx");
    assert_eq!(au["attempts"][1]["status"], 503);
    assert_eq!(au["attempts"][2]["outcome"], "ok");
    // Each failure is counted against its own backend's circuit (threshold 5: still closed).
    assert_eq!(sc.circuit("first").consecutive_failures(), 1);
    assert_eq!(sc.circuit("second").consecutive_failures(), 1);
    assert_eq!(sc.circuit("third").consecutive_failures(), 0);
    assert_eq!(sc.running.app.governor.ledger.reserved_tokens(), 0);
    sc.stop().await;
}

/// The whole chain fails: 503 DEFER with a Retry-After, never a hang or a 5xx pass-through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_chain_down_defers() {
    let a = MockUpstream::start(vec![Answer::status(502)]).await;
    let b = MockUpstream::start(vec![Answer::reset()]).await;
    let yaml = format!(
        r#"
version: fo-2
backends:
  - {{id: first, kind: openai, base_url: {}}}
  - {{id: second, kind: openai, base_url: {}}}
routes:
  - model: chat
    chain: [{{backend: first, model: m1}}, {{backend: second, model: m2}}]
retry: {{same_backend_retries: 0}}
"#,
        a.base_url(),
        b.base_url()
    );
    let sc = Sidecar::start(&yaml).await;
    let (s, h, body) = post_json(&sc.chat_url(), &chat("hi"), &rid("fo-2")).await;
    assert_eq!(s, 503, "{h:?} {}", String::from_utf8_lossy(&body));
    assert_eq!(hdr(&h, "x-tollgate-action"), "DEFER");
    assert_eq!(hdr(&h, "x-tollgate-reason"), "UPSTREAM_FAILURE");
    assert!(hdr(&h, "retry-after").parse::<u64>().unwrap() >= 1);
    let v = json(&body);
    assert_eq!(v["error"]["type"], "service_unavailable");
    assert_eq!(v["tollgate"]["fallback_state"], "EXHAUSTED");
    assert_eq!(v["tollgate"]["retry_state"], "RETRIED");
    assert_eq!((a.hits(), b.hits()), (1, 1));
    sc.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Retry-After: honoured when short, DEFER when long
// ---------------------------------------------------------------------------------------------

fn one_backend(url: &str, extra: &str) -> String {
    format!(
        r#"
version: ra-1
backends:
  - id: primary
    kind: openai
    base_url: {url}
{extra}
routes:
  - model: chat
    chain: [{{backend: primary, model: small}}]
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_retry_after_is_waited_out_then_the_same_backend_serves() {
    let up = MockUpstream::start(vec![
        Answer::status(429).header("retry-after", "1"),
        Answer::ok_chat("after the wait", 10, 5),
    ])
    .await;
    // Defaults: same_backend_retries 1, max_attempts_per_job 3, max_retry_after 10s.
    let sc = Sidecar::start(&one_backend(&up.base_url(), "")).await;
    let t0 = Instant::now();
    let (s, h, body) = post_json(&sc.chat_url(), &chat("hi"), &rid("ra-short")).await;
    let took = t0.elapsed();
    assert_eq!(s, 200, "{h:?} {}", String::from_utf8_lossy(&body));
    assert!(
        took >= Duration::from_secs(1),
        "Retry-After: 1 is honoured: took {took:?}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(up.hits(), 2, "the same (only) backend, twice");
    assert_eq!(hdr(&h, "x-tollgate-backend"), "primary");
    assert!(!h.contains_key("retry-after"));
    assert_eq!(
        json(&body)["choices"][0]["message"]["content"],
        "after the wait"
    );
    let au = sc.audit("ra-short").await;
    assert_eq!(au["retry_state"], "RETRIED");
    assert_eq!(au["fallback_state"], "NOT_NEEDED");
    assert_eq!(au["attempts"][0]["retry_after_ms"], 1000);
    assert_eq!(au["attempts"][1]["waited_ms"], 1000);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_retry_after_defers_with_the_upstream_delay() {
    let up = MockUpstream::start(vec![Answer::status(429).header("retry-after", "120")]).await;
    let sc = Sidecar::start(&one_backend(&up.base_url(), "")).await; // max_retry_after 10s
    let t0 = Instant::now();
    let (s, h, body) = post_json(&sc.chat_url(), &chat("hi"), &rid("ra-long")).await;
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "not waited in-request: {:?}",
        t0.elapsed()
    );
    assert_eq!(s, 429, "{h:?} {}", String::from_utf8_lossy(&body));
    assert_eq!(hdr(&h, "retry-after"), "120");
    assert_eq!(hdr(&h, "x-tollgate-action"), "DEFER");
    assert_eq!(hdr(&h, "x-tollgate-reason"), "UPSTREAM_FAILURE");
    assert_eq!(hdr(&h, "x-tollgate-backend"), "none");
    let v = json(&body);
    assert_eq!(v["error"]["type"], "rate_limit_exceeded");
    let t = &v["tollgate"];
    assert_eq!(t["final_action"], "DEFER");
    assert_eq!(t["retry_after"], 120);
    assert_eq!(t["retry_state"], "BLOCKED");
    assert_eq!(t["usage_evidence_state"], "NONE");
    assert_eq!(up.hits(), 1, "no retry inside the request");

    // The Retry-After in milliseconds spelling is read too (and wins over retry-after).
    up.push_answers(vec![Answer::status(429)
        .header("retry-after-ms", "45000")
        .header("retry-after", "1")]);
    let (s, h, _) = post_json(&sc.chat_url(), &chat("hi"), &[]).await;
    assert_eq!(s, 429);
    assert_eq!(hdr(&h, "retry-after"), "45");
    assert_eq!(up.hits(), 2);
    sc.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Circuit: opens after the threshold, closes after a half-open probe
// ---------------------------------------------------------------------------------------------

/// Far longer than any test runs: only a move of the sidecar's clock ([`RECOVERY`]) reaches
/// HALF_OPEN, so no test sleeps through it and none passes by waiting long enough.
const RECOVERY: Duration = Duration::from_secs(60);

fn circuit_policy(url: &str) -> String {
    one_backend(
        url,
        "    circuit: {failure_threshold: 2, recovery_timeout: 60s, half_open_max_calls: 1}\n\
         retry: {same_backend_retries: 0}",
    )
}

/// Moves the sidecar's clock to just past the circuit's recovery timeout (opened "now").
fn past_recovery(sc: &Sidecar) {
    sc.advance(RECOVERY + Duration::from_millis(50));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn circuit_opens_after_threshold_and_closes_after_half_open_probe() {
    let up = MockUpstream::start(vec![Answer::status(503), Answer::status(503)]).await;
    let sc = Sidecar::start_manual_clock(&circuit_policy(&up.base_url())).await;
    let url = sc.chat_url();

    // Two failures: each a 503 DEFER from the sidecar; the second trips the circuit.
    for (i, id) in ["c-1", "c-2"].into_iter().enumerate() {
        let (s, h, body) = post_json(&url, &chat("hi"), &rid(id)).await;
        assert_eq!(s, 503, "{h:?} {}", String::from_utf8_lossy(&body));
        assert_eq!(hdr(&h, "x-tollgate-action"), "DEFER");
        assert_eq!(hdr(&h, "x-tollgate-reason"), "UPSTREAM_FAILURE");
        assert_eq!(json(&body)["tollgate"]["circuit_state"], "CLOSED");
        assert_eq!(up.hits(), i + 1);
    }
    assert_eq!(sc.circuit("primary").raw_state(), CircuitState::Open);

    // Third request: not sent to the mock.
    let (s, h, body) = post_json(&url, &chat("hi"), &rid("c-3")).await;
    assert_eq!(s, 503, "{h:?} {}", String::from_utf8_lossy(&body));
    assert_eq!(up.hits(), 2, "an open circuit admits no call");
    assert_eq!(hdr(&h, "x-tollgate-action"), "DEFER");
    assert_eq!(hdr(&h, "x-tollgate-reason"), "CIRCUIT_OPEN");
    assert_eq!(hdr(&h, "retry-after"), "60");
    let t = &json(&body)["tollgate"];
    assert_eq!(t["circuit_state"], "OPEN");
    assert_eq!(t["reason_class"], "CIRCUIT_OPEN");
    assert_eq!(t["fallback_state"], "EXHAUSTED");
    assert_eq!(t["usage_evidence_state"], "NONE");

    // Just before the recovery timeout it is still open, with the wait counted down.
    sc.advance(RECOVERY - Duration::from_secs(2));
    let (s, h, _) = post_json(&url, &chat("hi"), &rid("c-3b")).await;
    assert_eq!(s, 503);
    assert_eq!(hdr(&h, "x-tollgate-reason"), "CIRCUIT_OPEN");
    let left: u64 = hdr(&h, "retry-after").parse().unwrap();
    assert!((1..=2).contains(&left), "retry-after {left}");
    assert_eq!(up.hits(), 2);

    // Past the recovery timeout: one probe goes through and closes the circuit.
    sc.advance(Duration::from_secs(3));
    let (s, h, body) = post_json(&url, &chat("hi"), &rid("c-4")).await;
    assert_eq!(s, 200, "{h:?} {}", String::from_utf8_lossy(&body));
    assert_eq!(up.hits(), 3);
    assert_eq!(hdr(&h, "x-tollgate-action"), "ALLOW");
    assert_eq!(hdr(&h, "x-tollgate-reason"), "HALF_OPEN_PROBE");
    let au = sc.audit("c-4").await;
    assert_eq!(au["circuit_state"], "HALF_OPEN");
    assert_eq!(au["attempts"][0]["probe"], true);
    assert_eq!(au["attempts"][0]["circuit_after"], "CLOSED");
    assert_eq!(sc.circuit("primary").raw_state(), CircuitState::Closed);

    // And the one after is a normal call.
    let (s, h, _) = post_json(&url, &chat("hi"), &rid("c-5")).await;
    assert_eq!(s, 200);
    assert_eq!(up.hits(), 4);
    assert_eq!(hdr(&h, "x-tollgate-reason"), "OK");
    let au = sc.audit("c-5").await;
    assert_eq!(au["circuit_state"], "CLOSED");
    assert_eq!(au["attempts"][0]["probe"], false);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_half_open_probe_reopens_the_circuit() {
    let up = MockUpstream::start(vec![
        Answer::status(500),
        Answer::status(500),
        Answer::status(500),
    ])
    .await;
    let sc = Sidecar::start_manual_clock(&circuit_policy(&up.base_url())).await;
    let url = sc.chat_url();
    for _ in 0..2 {
        let (s, _, _) = post_json(&url, &chat("hi"), &[]).await;
        assert_eq!(s, 503);
    }
    assert_eq!(sc.circuit("primary").raw_state(), CircuitState::Open);
    past_recovery(&sc);
    // The probe fails: reopened at once.
    let (s, h, body) = post_json(&url, &chat("hi"), &rid("p-1")).await;
    assert_eq!(s, 503, "{h:?} {}", String::from_utf8_lossy(&body));
    assert_eq!(up.hits(), 3);
    assert_eq!(json(&body)["tollgate"]["circuit_state"], "HALF_OPEN");
    assert_eq!(sc.circuit("primary").raw_state(), CircuitState::Open);
    // The next request finds it open again and makes no call.
    let (s, h, body) = post_json(&url, &chat("hi"), &[]).await;
    assert_eq!(s, 503, "{h:?} {}", String::from_utf8_lossy(&body));
    assert_eq!(hdr(&h, "x-tollgate-reason"), "CIRCUIT_OPEN");
    assert_eq!(up.hits(), 3);
    sc.stop().await;
}

/// Two requests reach a HALF_OPEN circuit at once with one probe slot: one is the probe, the
/// other finds no slot and is treated as OPEN (SPEC §5) — no second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_admits_one_probe_the_other_is_treated_as_open() {
    let up = MockUpstream::start(vec![
        Answer::status(503),
        Answer::status(503),
        Answer::ok_chat("probe", 5, 5).delay(Duration::from_millis(400)),
    ])
    .await;
    let sc = Sidecar::start_manual_clock(&circuit_policy(&up.base_url())).await;
    let url = sc.chat_url();
    for _ in 0..2 {
        let (s, _, _) = post_json(&url, &chat("hi"), &[]).await;
        assert_eq!(s, 503);
    }
    assert_eq!(sc.circuit("primary").raw_state(), CircuitState::Open);
    past_recovery(&sc);
    let probe = tokio::spawn({
        let url = url.clone();
        async move { post_json(&url, &chat("hi"), &rid("h-probe")).await }
    });
    // Let the probe take the slot (the mock holds it for 400 ms).
    assert_eq!(up.wait_for_hits(3, Duration::from_secs(5)).await, 3);
    let (s, h, body) = post_json(&url, &chat("hi"), &rid("h-other")).await;
    assert_eq!(s, 503, "{h:?} {}", String::from_utf8_lossy(&body));
    assert_eq!(hdr(&h, "x-tollgate-reason"), "CIRCUIT_OPEN");
    assert_eq!(hdr(&h, "x-tollgate-action"), "DEFER");
    assert!(h.contains_key("retry-after"));
    let (s, h, _) = probe.await.unwrap();
    assert_eq!(s, 200);
    assert_eq!(hdr(&h, "x-tollgate-reason"), "HALF_OPEN_PROBE");
    assert_eq!(
        up.hits(),
        3,
        "the request without a probe slot made no call"
    );
    assert_eq!(sc.circuit("primary").raw_state(), CircuitState::Closed);
    sc.stop().await;
}

/// Upstream 401/403 means our key is wrong: a backend failure (fail over, count against the
/// circuit), not a pass-through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_auth_failure_fails_over() {
    let a = MockUpstream::start(vec![Answer::status(401), Answer::status(403)]).await;
    let b = MockUpstream::start(vec![]).await;
    let yaml = format!(
        r#"
version: fo-3
backends:
  - {{id: first, kind: openai, base_url: {}}}
  - {{id: second, kind: openai, base_url: {}}}
routes:
  - model: chat
    chain: [{{backend: first, model: m1}}, {{backend: second, model: m2}}]
retry: {{same_backend_retries: 0}}
"#,
        a.base_url(),
        b.base_url()
    );
    let sc = Sidecar::start(&yaml).await;
    for (i, id) in ["au-1", "au-2"].into_iter().enumerate() {
        let (s, h, body) = post_json(&sc.chat_url(), &chat("hi"), &rid(id)).await;
        assert_eq!(s, 200, "{h:?} {}", String::from_utf8_lossy(&body));
        assert_eq!(hdr(&h, "x-tollgate-backend"), "second");
        assert_eq!(hdr(&h, "x-tollgate-reason"), "UPSTREAM_FAILURE");
        let au = sc.audit(id).await;
        assert_eq!(au["attempts"][0]["outcome"], "auth");
        assert_eq!(au["fallback_state"], "USED");
        assert_eq!(sc.circuit("first").consecutive_failures(), i as u32 + 1);
    }
    assert_eq!((a.hits(), b.hits()), (2, 2));
    sc.stop().await;
}

/// A backend that does not answer within its first-byte timeout is a failure: fail over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_byte_timeout_fails_over() {
    let a = MockUpstream::start(vec![
        Answer::ok_chat("too late", 1, 1).delay(Duration::from_secs(5))
    ])
    .await;
    let b = MockUpstream::start(vec![]).await;
    let yaml = format!(
        r#"
version: fo-4
backends:
  - {{id: slow, kind: openai, base_url: {}, timeouts: {{connect: 1s, first_byte: 300ms, total: 10s}}}}
  - {{id: fast, kind: openai, base_url: {}}}
routes:
  - model: chat
    chain: [{{backend: slow, model: m1}}, {{backend: fast, model: m2}}]
retry: {{same_backend_retries: 0}}
"#,
        a.base_url(),
        b.base_url()
    );
    let sc = Sidecar::start(&yaml).await;
    let t0 = Instant::now();
    let (s, h, body) = post_json(&sc.chat_url(), &chat("hi"), &rid("to-1")).await;
    let took = t0.elapsed();
    assert_eq!(s, 200, "{h:?} {}", String::from_utf8_lossy(&body));
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "took {took:?}"
    );
    assert_eq!(hdr(&h, "x-tollgate-backend"), "fast");
    let au = sc.audit("to-1").await;
    assert_eq!(au["attempts"][0]["outcome"], "timeout");
    assert_eq!((a.hits(), b.hits()), (1, 1));
    sc.stop().await;
}

/// Retry-After as an HTTP-date, and Gemini's RetryInfo in the JSON error body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_spellings_http_date_and_gemini_body() {
    let when = std::time::SystemTime::now() + Duration::from_secs(121);
    let date = httpdate::fmt_http_date(when);
    let gemini = j!({"error": {"code": 429, "message": "Resource has been exhausted", "status": "RESOURCE_EXHAUSTED",
        "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "33s"}]}});
    let up = MockUpstream::start(vec![
        Answer::status(429).header("retry-after", &date),
        Answer::json(429, gemini),
    ])
    .await;
    let sc = Sidecar::start(&one_backend(&up.base_url(), "")).await;
    let (s, h, _) = post_json(&sc.chat_url(), &chat("hi"), &[]).await;
    assert_eq!(s, 429);
    let ra: u64 = hdr(&h, "retry-after").parse().unwrap();
    assert!(
        (119..=121).contains(&ra),
        "HTTP-date Retry-After ≈ 120 s, got {ra}"
    );
    let (s, h, _) = post_json(&sc.chat_url(), &chat("hi"), &[]).await;
    assert_eq!(s, 429);
    assert_eq!(hdr(&h, "retry-after"), "33");
    assert_eq!(up.hits(), 2);
    sc.stop().await;
}
