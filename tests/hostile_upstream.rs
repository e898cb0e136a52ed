//! Upstreams that lie, stall, loop or leak: absurd usage reports, events that never end,
//! 200s that are not answers, streams cut before their end, redirects, and error pages that
//! echo the request's credentials. None of them gets around the governor.

mod common;

use common::mock::{Answer, MockUpstream};
use common::native::anthropic_stream_events;
use common::sidecar::Sidecar;
use common::{json, post_json, post_json_frames};
use serde_json::{json as j, Value};
use std::time::Duration;

const KEY_ENV: &str = "TOLLGATE_TEST_HOSTILE_UPSTREAM_KEY";
const SECRET: &str = "sk-hostile-test-secret-0123456789";

fn chat(stream: bool) -> Value {
    j!({"model": "chat", "max_tokens": 50, "stream": stream,
        "messages": [{"role": "user", "content": "hi"}]})
}

/// Backends `a` (and `b` when given) of `kind`, route `chat` over them, a global budget.
fn policy(kind: &str, a: &str, b: Option<&str>, hard_tokens: u64) -> String {
    let mut y = format!(
        "version: hostile\nbackends:\n  - {{id: a, kind: {kind}, base_url: \"{a}\", api_key_env: {KEY_ENV}, circuit: {{failure_threshold: 5}}}}\n"
    );
    if let Some(b) = b {
        y.push_str(&format!(
            "  - {{id: b, kind: openai, base_url: \"{b}\", circuit: {{failure_threshold: 5}}}}\n"
        ));
    }
    y.push_str("routes:\n  - model: chat\n    chain:\n      - {backend: a, model: m-a}\n");
    if b.is_some() {
        y.push_str("      - {backend: b, model: m-b}\n");
    }
    y.push_str(&format!(
        "budgets:\n  - {{name: all, scope: global, window: month, hard_tokens: {hard_tokens}}}\n"
    ));
    y
}

fn rid(h: &http::HeaderMap) -> String {
    h.get("x-tollgate-request-id")
        .and_then(|v| v.to_str().ok())
        .expect("x-tollgate-request-id")
        .to_string()
}

fn key() {
    std::env::set_var(KEY_ENV, SECRET);
}

// Item 5: counters saturate; usage above the reservation is flagged.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absurd_usage_report_saturates_the_counters_instead_of_wrapping() {
    key();
    let huge = j!({"id": "x", "object": "chat.completion", "created": 1, "model": "m-a",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": u64::MAX - 1, "completion_tokens": 5, "total_tokens": u64::MAX}});
    let mock = MockUpstream::start_with_default(
        vec![Answer::json(200, huge)],
        Answer::ok_chat("fine", 5, 5),
    )
    .await;
    let sc = Sidecar::start(&policy("openai", &mock.base_url(), None, 100_000)).await;
    let (st, h, b) = post_json(&sc.chat_url(), &chat(false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["usage_over_reservation"], true, "{a}");
    // Spent, whatever the provider says: every following call is refused (a wrapped counter
    // would read as ~0 and let them through).
    for _ in 0..3 {
        let (st, _, b) = post_json(&sc.chat_url(), &chat(false), &[]).await;
        assert_ne!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    assert_eq!(mock.hits(), 1);
    let (_, _, m) = common::get(&format!("http://{}/metrics", sc.running.admin_addr)).await;
    let m = String::from_utf8_lossy(&m);
    assert!(
        m.lines()
            .any(|l| l.starts_with("tollgate_usage_over_reservation_total{backend=\"a\"}")),
        "{m}"
    );
    sc.stop().await;
}

// Item 6: an SSE event that never ends.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_that_never_ends_is_cut_at_its_cap_and_counts_as_a_failure() {
    key();
    // 64 KiB frames of one `data:` line that never ends: 16 MiB if it were all read.
    let frame = format!("data: {}", "x".repeat(64 * 1024));
    let first =
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n".to_string();
    let mut events = vec![first];
    events.extend(std::iter::repeat_n(frame, 256));
    let mock = MockUpstream::start(vec![Answer::sse(events, Duration::ZERO)]).await;
    let sc = Sidecar::start(&policy("openai", &mock.base_url(), None, 100_000)).await;
    let s = post_json_frames(&sc.chat_url(), &chat(true), &[]).await;
    assert_eq!(s.status, 200);
    let body = s.body();
    assert!(
        body.len() < 6 * 1024 * 1024,
        "stopped near the cap: {} bytes",
        body.len()
    );
    let last = s.sse_data().last().cloned().unwrap_or_default();
    assert!(
        last.contains("upstream_event_too_large"),
        "ends with an error event: {last}"
    );
    let a = sc.audit(&rid(&s.headers)).await;
    assert_eq!(a["usage_evidence_state"], "PARTIAL", "{a}");
    assert_eq!(a["reason_class"], "UPSTREAM_FAILURE", "{a}");
    // Megabytes forwarded that were never counted: the reserved worst case is committed.
    assert_eq!(
        a["actual_output_tokens"], a["upstream_max_tokens"],
        "the worst case's output, not what was counted: {a}"
    );
    assert_eq!(sc.circuit("a").consecutive_failures(), 1);
    assert_eq!(sc.ledger().reserved_tokens(), 0);
    sc.stop().await;
}

// Item 7: a 2xx that is not the answer, a redirect, a native stream cut short.

async fn falls_back_from(bad: Answer, stream: bool) {
    key();
    let a = MockUpstream::start(vec![bad]).await;
    let b = MockUpstream::start_with_default(
        vec![],
        if stream {
            Answer::sse_chat(&["from", " b"], Some((5, 2)), Duration::from_millis(2))
        } else {
            Answer::ok_chat("from b", 5, 2)
        },
    )
    .await;
    let sc = Sidecar::start(&policy(
        "openai",
        &a.base_url(),
        Some(&b.base_url()),
        100_000,
    ))
    .await;
    let (st, h, text) = if stream {
        let s = post_json_frames(&sc.chat_url(), &chat(true), &[]).await;
        (s.status, s.headers.clone(), s.text())
    } else {
        let (st, h, b) = post_json(&sc.chat_url(), &chat(false), &[]).await;
        (st, h, String::from_utf8_lossy(&b).into_owned())
    };
    assert_eq!(st, 200, "{text}");
    assert!(
        text.contains("from") && text.contains("b"),
        "served by b: {text}"
    );
    assert!(!text.contains("<html"), "{text}");
    let rec = sc.audit(&rid(&h)).await;
    assert_eq!(rec["backend"], "b", "{rec}");
    assert_eq!(rec["fallback_state"], "USED", "{rec}");
    assert_eq!(rec["attempts"][0]["outcome"], "5xx", "{rec}");
    assert_eq!(a.hits(), 1);
    assert_eq!(b.hits(), 1);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200_html_page_is_a_failure_not_an_answer() {
    falls_back_from(
        Answer::raw(200, "text/html", "<html>maintenance</html>"),
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_200_and_a_204_are_failures() {
    falls_back_from(Answer::raw(200, "application/json", ""), false).await;
    falls_back_from(Answer::raw(204, "application/json", ""), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_answered_empty_falls_back() {
    // Declared empty (`Content-Length: 0`) though typed as a stream: the client reads the
    // length as framing and keeps it out of the answer's headers; the body's size says it.
    falls_back_from(Answer::raw(200, "text/event-stream", ""), true).await;
    falls_back_from(Answer::raw(204, "text/event-stream", ""), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_answered_with_an_html_page_falls_back() {
    falls_back_from(Answer::raw(200, "text/html", "<html>login</html>"), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_a_failure_and_never_reaches_the_client() {
    let redirect = Answer::raw(302, "text/html", "<html>moved</html>")
        .header("location", "http://127.0.0.1:9/elsewhere");
    falls_back_from(redirect.clone(), false).await;
    falls_back_from(redirect, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_stream_without_its_final_event_is_an_upstream_failure() {
    key();
    let mut events = anthropic_stream_events(&["Hel", "lo"], 9, 4);
    // Cut before message_delta / message_stop.
    events.retain(|e| !e.contains("message_stop") && !e.contains("message_delta"));
    let mock = MockUpstream::start(vec![Answer::sse(events, Duration::from_millis(2))]).await;
    let sc = Sidecar::start(&policy("anthropic", &mock.base_url(), None, 100_000)).await;
    let s = post_json_frames(&sc.chat_url(), &chat(true), &[]).await;
    assert_eq!(s.status, 200);
    let data = s.sse_data();
    let last = data.last().cloned().unwrap_or_default();
    assert!(last.contains("upstream_incomplete"), "{data:?}");
    assert!(!data.iter().any(|d| d == "[DONE]"), "{data:?}");
    let a = sc.audit(&rid(&s.headers)).await;
    assert_eq!(a["reason_class"], "UPSTREAM_FAILURE", "{a}");
    assert_eq!(a["usage_evidence_state"], "PARTIAL", "{a}");
    assert_eq!(sc.circuit("a").consecutive_failures(), 1);
    sc.stop().await;
}

// Item 8: secrets echoed by an upstream are redacted.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_body_that_echoes_the_upstream_key_is_redacted() {
    key();
    let mock = MockUpstream::start(vec![Answer::echo_request(400)]).await;
    let sc = Sidecar::start(&policy("openai", &mock.base_url(), None, 100_000)).await;
    let (st, h, b) = post_json(&sc.chat_url(), &chat(false), &[]).await;
    assert_eq!(st, 400);
    let got = mock.requests()[0]
        .headers
        .get("authorization")
        .map(|v| v.to_str().unwrap_or("").to_string())
        .unwrap_or_default();
    assert!(got.contains(SECRET), "the upstream did get the key: {got}");
    let text = String::from_utf8_lossy(&b);
    assert!(!text.contains(SECRET), "{text}");
    assert!(text.contains("[redacted]"), "{text}");
    let _ = json(&b);
    for (k, v) in &h {
        assert!(
            !String::from_utf8_lossy(v.as_bytes()).contains(SECRET),
            "header {k} leaks the key"
        );
    }
    assert_eq!(
        h.get("x-echo-authorization").and_then(|v| v.to_str().ok()),
        Some("Bearer [redacted]")
    );
    sc.stop().await;
}
