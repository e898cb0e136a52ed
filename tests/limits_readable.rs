//! Limits people can read (issue 14 items 4, 5, 6, 8), end to end against a real sidecar and
//! mock upstreams: the `limit` object and dollar messages of refusals, the never-fits rule,
//! the rate-limit headers of every answer, and cached tokens priced at their own rates.

mod common;

use common::mock::{sse_data, sse_done, Answer, MockUpstream};
use common::native::anthropic_message;
use common::sidecar::Sidecar;
use common::{json, post_json};
use http::HeaderMap;
use serde_json::{json as j, Value};
use std::sync::Arc;
use std::time::Duration;
use tollgate::ledger::{window_at, window_end, CounterKey};
use tollgate::units::{Amount, Scope, Window};

fn now_ms() -> i64 {
    jiff::Timestamp::now().as_millisecond()
}

fn hdr<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

fn chat(max_tokens: u64) -> Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens})
}

/// Commits `amount` on a windowed counter of the running sidecar, as earlier traffic would.
fn seed(sc: &Sidecar, scope: Scope, id: &str, w: Window, amount: Amount) {
    let tz = sc.running.app.snap.load().policy.windows.timezone.clone();
    let key = CounterKey {
        scope,
        id: Arc::from(id),
        window: Some(window_at(&tz, w, now_ms())),
    };
    sc.ledger().counter(&key, i64::MAX).add_committed(&amount);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_refusal_names_its_limit_in_dollars_and_the_policys_time_zone() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&format!(
        r#"version: lr-1
windows: {{timezone: Asia/Taipei}}
backends:
  - {{id: up, kind: openai, base_url: "{}", price_per_1k: {{input: 1.0, output: 1.0}}}}
routes:
  - {{model: chat, chain: [{{backend: up, model: m}}]}}
budgets:
  - {{name: monthly-spend, scope: global, window: month, hard_usd: 50, soft_usd: 40}}
"#,
        up.base_url()
    ))
    .await;
    seed(
        &sc,
        Scope::Global,
        "global",
        Window::Month,
        Amount {
            usd: 49_450_000,
            ..Amount::ZERO
        },
    );
    let (code, h, body) = post_json(&sc.chat_url(), &chat(1000), &[]).await;
    assert_eq!(code, 403, "{}", String::from_utf8_lossy(&body));
    assert!(hdr(&h, "retry-after").is_none());
    let v = json(&body);
    let l = &v["tollgate"]["limit"];
    assert_eq!(
        l, &v["error"]["tollgate"]["limit"],
        "the same inside `error`"
    );
    assert_eq!(l["name"], "monthly-spend");
    assert_eq!(l["kind"], "budget");
    assert_eq!(l["scope"], "global");
    assert_eq!(l["id"], "global");
    assert_eq!(l["window"], "month");
    assert_eq!(l["unit"], "usd");
    assert_eq!(l["used"], 49.45, "dollars, never micro-units");
    assert_eq!(l["reserved"], 0.0);
    assert_eq!(l["limit"], 50.0);
    assert_eq!(l["remaining"].as_f64().unwrap(), 0.55);
    let requested = l["requested"].as_f64().unwrap();
    assert!(requested > 1.0 && requested < 1.1, "{requested}");
    assert_eq!(l["never_fits"], false);
    // The month turns at midnight in Taipei, written with Taipei's offset.
    let tz = jiff::tz::TimeZone::get("Asia/Taipei").unwrap();
    let end = window_end(&tz, window_at(&tz, Window::Month, now_ms()));
    let want = jiff::Timestamp::from_millisecond(end)
        .unwrap()
        .to_zoned(tz)
        .strftime("%Y-%m-%dT%H:%M:%S+08:00")
        .to_string();
    assert!(want.contains("01T00:00:00+08:00"), "{want}");
    assert_eq!(l["resets_at"], want.as_str());
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("budget `monthly-spend` (global, per month): $49.45 of $50.00 used"),
        "{msg}"
    );
    assert!(msg.contains(&format!("it resets at {want}")), "{msg}");
    assert!(!msg.contains("49450000"), "{msg}");
    assert_eq!(up.hits(), 0);
    // The audit record keeps the same object.
    let rid = hdr(&h, "x-tollgate-request-id").unwrap();
    let a = sc.audit(rid).await;
    assert_eq!(a["limit"]["used"], 49.45);
    sc.stop().await;
}

const TPM_POLICY: &str = r#"version: lr-2
backends:
  - {id: up, kind: openai, base_url: "BASE"}
routes:
  - {model: chat, chain: [{backend: up, model: m}]}
rate_limits:
  - {name: consumer-tpm, scope: consumer, match: "*", window: minute, limit_tokens: 5000}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_the_whole_rate_limit_is_stopped_not_told_to_wait() {
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat("fine", 40, 25)).await;
    let sc = Sidecar::start(&TPM_POLICY.replace("BASE", &up.base_url())).await;
    // 8,000 output tokens against 5,000 a minute: no window will ever hold it.
    for _ in 0..2 {
        let (code, h, body) = post_json(&sc.chat_url(), &chat(8000), &[]).await;
        assert_eq!(code, 403, "{}", String::from_utf8_lossy(&body));
        assert!(hdr(&h, "retry-after").is_none(), "never told to wait");
        assert_eq!(hdr(&h, "x-tollgate-action"), Some("HARD_STOP"));
        assert_eq!(hdr(&h, "x-tollgate-reason"), Some("RATE_LIMITED"));
        let v = json(&body);
        let l = &v["tollgate"]["limit"];
        assert_eq!(l["name"], "consumer-tpm");
        assert_eq!(l["kind"], "rate_limit");
        assert_eq!(l["unit"], "tokens");
        assert_eq!(l["limit"], 5000);
        assert_eq!(l["never_fits"], true);
        let requested = l["requested"].as_u64().unwrap();
        assert!(requested > 8000, "{requested}");
        assert!(v["tollgate"]["retry_after"].is_null());
        let msg = v["error"]["message"].as_str().unwrap();
        let over = format!("{} tokens more than the whole limit of 5,000 tokens", {
            let d = requested - 5000;
            if d >= 1000 {
                format!("{},{:03}", d / 1000, d % 1000)
            } else {
                d.to_string()
            }
        });
        assert!(msg.contains("rate_limit `consumer-tpm`"), "{msg}");
        assert!(msg.contains(&over), "{msg}");
        assert!(msg.contains("can never fit"), "{msg}");
        assert!(!msg.contains("retry after"), "{msg}");
    }
    assert_eq!(up.hits(), 0);

    // One that fits an empty window but not this one is still told when to come back.
    seed(
        &sc,
        Scope::Consumer,
        "default",
        Window::Minute,
        Amount {
            tokens: 4500,
            ..Amount::ZERO
        },
    );
    let (code, h, body) = post_json(&sc.chat_url(), &chat(1000), &[]).await;
    assert_eq!(code, 429, "{}", String::from_utf8_lossy(&body));
    let ra: u64 = hdr(&h, "retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&ra), "{ra}");
    let v = json(&body);
    let l = &v["tollgate"]["limit"];
    assert_eq!(l["never_fits"], false);
    assert_eq!(l["used"], 4500);
    assert_eq!(l["remaining"], 500);
    assert!(l["resets_at"].as_str().unwrap().ends_with("+00:00"));
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("(consumer default, per minute): 4,500 tokens of 5,000 tokens used"),
        "{msg}"
    );
    assert_eq!(up.hits(), 0);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_fitting_request_is_clamped_when_the_policy_allows() {
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat("fine", 40, 25)).await;
    let yaml = TPM_POLICY.replace("BASE", &up.base_url())
        + "degrade:\n  clamp_max_tokens: {min_output_tokens: 256}\n";
    let sc = Sidecar::start(&yaml).await;
    let (code, h, body) = post_json(&sc.chat_url(), &chat(8000), &[]).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(hdr(&h, "x-tollgate-action"), Some("DEGRADE"));
    let sent = up.last_request().unwrap().json.unwrap()["max_tokens"]
        .as_u64()
        .unwrap();
    assert!((256..5000).contains(&sent), "clamped to fit: {sent}");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_carries_the_token_rate_limit_headers_after_actual_usage() {
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat("fine", 40, 25)).await;
    let sc = Sidecar::start(&format!(
        r#"version: lr-3
backends:
  - {{id: up, kind: openai, base_url: "{}"}}
routes:
  - {{model: chat, chain: [{{backend: up, model: m}}]}}
rate_limits:
  - {{name: tpm, scope: consumer, match: "*", window: minute, limit_tokens: 20000}}
quotas:
  - {{name: daily, scope: consumer, match: "*", window: day, limit_tokens: 100000}}
budgets:
  - {{name: per-job, scope: job, hard_tokens: 3000}}
"#,
        up.base_url()
    ))
    .await;
    for (i, left) in [(1u64, 20000 - 65), (2, 20000 - 130)] {
        let (code, h, body) = post_json(&sc.chat_url(), &chat(500), &[]).await;
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
        // The tightest token *rate limit* (not the tighter job budget), counted after this
        // request's actual 65 tokens, not its released worst case.
        assert_eq!(hdr(&h, "x-ratelimit-limit-tokens"), Some("20000"));
        // (Should the minute turn between the two requests, the window starts afresh.)
        let got: u64 = hdr(&h, "x-ratelimit-remaining-tokens")
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            got == left || (i == 2 && got == 20000 - 65),
            "request {i}: {got}"
        );
        let left = got;
        let reset = hdr(&h, "x-ratelimit-reset-tokens").unwrap();
        // OpenAI's duration form: `52s`, or `1m0s` when a fresh minute window has a full
        // 60 s left (the first second of the minute).
        let secs = tollgate::providers::retry_after::parse_go_duration(reset)
            .unwrap_or_else(|| panic!("{reset}"))
            / 1000;
        assert!(secs <= 60, "{reset}");
        let policy = hdr(&h, "ratelimit-policy").unwrap();
        assert_eq!(
            policy,
            r#""tpm";q=20000;qu="tokens";w=60, "daily";q=100000;qu="tokens";w=86400"#
        );
        let state = hdr(&h, "ratelimit").unwrap();
        let daily_left = 100000 - 65 * i;
        assert!(
            state.starts_with(&format!("\"tpm\";r={left};t="))
                && state.contains(&format!("\"daily\";r={daily_left};t=")),
            "{state}"
        );
    }
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_are_priced_at_their_own_rates_buffered_and_streamed() {
    let body = |stream: bool| {
        let mut b = chat(100);
        if stream {
            b["stream"] = j!(true);
            b["stream_options"] = j!({"include_usage": true});
        }
        b
    };
    let usage = j!({"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100,
                    "prompt_tokens_details": {"cached_tokens": 800}});
    let buffered = Answer::json(
        200,
        j!({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop"}],
            "usage": usage.clone()}),
    );
    let chunk = j!({"id": "c2", "object": "chat.completion.chunk", "created": 1, "model": "m",
                    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]});
    let tail = j!({"id": "c2", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [], "usage": usage});
    let streamed = Answer::sse(
        vec![sse_data(&chunk), sse_data(&tail), sse_done()],
        Duration::from_millis(1),
    );
    let oa = MockUpstream::start(vec![buffered, streamed]).await;
    let an = MockUpstream::start(vec![anthropic_message("hi", (100, 50, 300, 600))]).await;
    std::env::set_var("TOLLGATE_TEST_LR_ANTHROPIC_KEY", "sk-ant-test");
    let sc = Sidecar::start(&format!(
        r#"version: lr-4
backends:
  - {{id: oa, kind: openai, base_url: "{}",
     price_per_1k: {{input: 0.01, cached_input: 0.001, output: 0.02}}}}
  - {{id: an, kind: anthropic, base_url: "{}", api_key_env: TOLLGATE_TEST_LR_ANTHROPIC_KEY,
     price_per_1k: {{input: 1.0, output: 1.0}}}}
routes:
  - {{model: chat, chain: [{{backend: oa, model: m}}]}}
  - model: claude
    chain:
      - {{backend: an, model: claude-x,
         price_per_1k: {{input: 0.003, cached_input: 0.0003, cache_write: 0.00375, output: 0.015}}}}
"#,
        oa.base_url(),
        common::native::root(&an)
    ))
    .await;
    // OpenAI: 200 plain × $0.01 + 800 cached × $0.001 + 100 out × $0.02 (per 1k) = $0.0048.
    for stream in [false, true] {
        let (code, h, b) = post_json(&sc.chat_url(), &body(stream), &[]).await;
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&b));
        let a = sc.audit(hdr(&h, "x-tollgate-request-id").unwrap()).await;
        assert_eq!(a["actual_input_tokens"], 1000, "stream {stream}");
        assert_eq!(a["actual_cached_input_tokens"], 800, "stream {stream}");
        assert_eq!(a["actual_cache_write_tokens"], 0);
        assert_eq!(a["cost_usd"], 0.0048, "stream {stream}");
    }
    // Anthropic, at the chain entry's own price (its backend's is $1/1k):
    // 100 plain × $0.003 + 600 read × $0.0003 + 300 written × $0.00375 + 50 out × $0.015.
    let mut b = chat(100);
    b["model"] = j!("claude");
    let (code, h, out) = post_json(&sc.chat_url(), &b, &[]).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&out));
    let u = &json(&out)["usage"];
    assert_eq!(u["prompt_tokens"], 1000);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 600);
    assert_eq!(u["cache_creation_input_tokens"], 300);
    let a = sc.audit(hdr(&h, "x-tollgate-request-id").unwrap()).await;
    assert_eq!(a["actual_cached_input_tokens"], 600);
    assert_eq!(a["actual_cache_write_tokens"], 300);
    assert_eq!(a["cost_usd"], 0.002355);
    sc.stop().await;
}
