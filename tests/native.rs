//! Native backends end to end (issue 5): the app speaks OpenAI to the sidecar; in-process
//! mocks speak Anthropic Messages, Gemini generateContent and Ollama's `/api/chat` in their
//! real wire formats. Checks what went upstream, what came back, the usage committed, the
//! errors, failover across kinds and `max_in_flight` spill-over.

mod common;

use common::mock::{Answer, MockUpstream};
use common::native::*;
use common::sidecar::Sidecar;
use common::{json, post_json, post_json_frames};
use serde_json::{json, Value};
use std::time::Duration;

const ANTHROPIC_KEY: &str = "TOLLGATE_TEST_NATIVE_ANTHROPIC_KEY";
const GEMINI_KEY: &str = "TOLLGATE_TEST_NATIVE_GEMINI_KEY";

fn keys() {
    std::env::set_var(ANTHROPIC_KEY, "sk-ant-test-secret");
    std::env::set_var(GEMINI_KEY, "AIza-test-secret");
}

/// One backend of `kind` at `base`, route `chat` to it, and a `static` route over nothing.
fn one_backend(kind: &str, base: &str, key_env: Option<&str>, extra: &str) -> String {
    let key = key_env.map_or("null".to_string(), |k| k.to_string());
    format!(
        r#"version: native-test
backends:
  - {{id: up, kind: {kind}, base_url: "{base}", api_key_env: {key}{extra}}}
routes:
  - {{model: chat, chain: [{{backend: up, model: native-model}}]}}
"#
    )
}

fn chat_body(stream: bool, include_usage: bool) -> Value {
    let mut b = json!({
        "model": "chat",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello"}
        ],
        "max_tokens": 64,
        "temperature": 1.5,
        "stop": ["\n\n"]
    });
    if stream {
        b["stream"] = json!(true);
        if include_usage {
            b["stream_options"] = json!({"include_usage": true});
        }
    }
    b
}

fn rid(h: &http::HeaderMap) -> String {
    h.get("x-tollgate-request-id")
        .and_then(|v| v.to_str().ok())
        .expect("x-tollgate-request-id")
        .to_string()
}

fn chunks(data: &[String]) -> Vec<Value> {
    data.iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn text_of(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect()
}

fn usage_chunks(chunks: &[Value]) -> Vec<&Value> {
    chunks
        .iter()
        .filter(|c| c["usage"].is_object())
        .map(|c| &c["usage"])
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_buffered_and_streamed() {
    keys();
    let up = MockUpstream::start(vec![
        anthropic_message("Hello there.", (20, 6, 3, 5)),
        anthropic_stream(&["Hel", "lo", " world"], 17, 9),
        anthropic_stream(&["quiet"], 17, 4),
    ])
    .await;
    let sc = Sidecar::start(&one_backend(
        "anthropic",
        &root(&up),
        Some(ANTHROPIC_KEY),
        "",
    ))
    .await;

    // Buffered.
    let (st, h, b) = post_json(&sc.chat_url(), &chat_body(false, false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(h["content-type"], "application/json");
    let v = json(&b);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "native-model");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello there.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"]["prompt_tokens"], 28,
        "input + cache creation + cache read"
    );
    assert_eq!(v["usage"]["completion_tokens"], 6);
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["usage_evidence_state"], "ACTUAL");
    assert_eq!(
        (
            a["actual_input_tokens"].as_u64(),
            a["actual_output_tokens"].as_u64()
        ),
        (Some(28), Some(6))
    );

    let req = &up.requests()[0];
    assert_eq!(req.path, "/v1/messages");
    assert_eq!(req.header("x-api-key"), Some("sk-ant-test-secret"));
    assert_eq!(req.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(req.header("authorization"), None);
    let j = req.json.as_ref().unwrap();
    assert_eq!(j["system"], "Be brief.");
    assert_eq!(j["max_tokens"], 64);
    assert_eq!(j["temperature"], 1.0);
    assert_eq!(j["stop_sequences"], json!(["\n\n"]));
    assert_eq!(
        j["messages"],
        json!([{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}])
    );
    assert!(
        !sc.audit_text().contains("sk-ant-test-secret"),
        "the key never reaches the audit"
    );

    // Streamed, usage asked for.
    let s = post_json_frames(&sc.chat_url(), &chat_body(true, true), &[]).await;
    assert_eq!(s.status, 200);
    assert_eq!(s.headers["content-type"], "text/event-stream");
    let data = s.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let c = chunks(&data);
    assert_eq!(text_of(&c), "Hello world");
    assert!(c.iter().any(|x| x["choices"][0]["finish_reason"] == "stop"));
    let u = usage_chunks(&c);
    assert_eq!(u.len(), 1, "exactly one usage chunk");
    assert_eq!(
        (
            u[0]["prompt_tokens"].as_u64(),
            u[0]["completion_tokens"].as_u64()
        ),
        (Some(17), Some(9))
    );
    let a = sc.audit(&rid(&s.headers)).await;
    assert_eq!(a["usage_evidence_state"], "ACTUAL");
    assert_eq!(
        a["actual_output_tokens"], 9,
        "the last cumulative message_delta"
    );
    assert_eq!(up.requests()[1].json.as_ref().unwrap()["stream"], true);

    // Streamed, usage not asked for: no usage chunk reaches the client, still ACTUAL.
    let s = post_json_frames(&sc.chat_url(), &chat_body(true, false), &[]).await;
    let c = chunks(&s.sse_data());
    assert_eq!(text_of(&c), "quiet");
    assert!(usage_chunks(&c).is_empty(), "{:?}", s.text());
    assert!(!s.text().contains("\"usage\":null"));
    let a = sc.audit(&rid(&s.headers)).await;
    assert_eq!(a["usage_evidence_state"], "ACTUAL");
    assert_eq!(a["actual_output_tokens"], 4);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_buffered_streamed_and_blocked() {
    keys();
    let up = MockUpstream::start(vec![
        gemini_response("Hi from Gemini.", 11, 4, 30),
        gemini_stream(&["One", " two", " three"], 9, 3),
        Answer::json(
            200,
            json!({"promptFeedback": {"blockReason": "SAFETY"},
            "usageMetadata": {"promptTokenCount": 7, "totalTokenCount": 7}}),
        ),
    ])
    .await;
    let base = format!("{}/v1beta", root(&up));
    let sc = Sidecar::start(&one_backend("gemini", &base, Some(GEMINI_KEY), "")).await;

    let (st, h, b) = post_json(&sc.chat_url(), &chat_body(false, false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(v["choices"][0]["message"]["content"], "Hi from Gemini.");
    assert_eq!(v["usage"]["completion_tokens"], 34, "candidates + thoughts");
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["actual_output_tokens"], 34);
    let req = &up.requests()[0];
    assert_eq!(req.path, "/v1beta/models/native-model:generateContent");
    assert_eq!(req.header("x-goog-api-key"), Some("AIza-test-secret"));
    let j = req.json.as_ref().unwrap();
    assert_eq!(j["generationConfig"]["maxOutputTokens"], 64);
    assert_eq!(j["generationConfig"]["stopSequences"], json!(["\n\n"]));
    assert_eq!(j["systemInstruction"]["parts"][0]["text"], "Be brief.");
    assert_eq!(j["contents"][0]["role"], "user");

    let s = post_json_frames(&sc.chat_url(), &chat_body(true, true), &[]).await;
    assert_eq!(s.status, 200);
    let req = &up.requests()[1];
    assert_eq!(
        req.path,
        "/v1beta/models/native-model:streamGenerateContent"
    );
    assert_eq!(req.query.as_deref(), Some("alt=sse"));
    let data = s.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let c = chunks(&data);
    assert_eq!(text_of(&c), "One two three");
    let u = usage_chunks(&c);
    assert_eq!(u.len(), 1);
    assert_eq!(u[0]["completion_tokens"], 3, "the last running total");
    let a = sc.audit(&rid(&s.headers)).await;
    assert_eq!(a["usage_evidence_state"], "ACTUAL");
    assert_eq!(a["actual_input_tokens"], 9);

    let (st, _, b) = post_json(&sc.chat_url(), &chat_body(false, false), &[]).await;
    assert_eq!(st, 200);
    let v = json(&b);
    assert_eq!(v["choices"][0]["finish_reason"], "content_filter");
    assert_eq!(v["usage"]["prompt_tokens"], 7);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_buffered_streamed_and_errors() {
    let up = MockUpstream::start(vec![
        ollama_chat("Local hello.", 26, 5),
        ollama_stream(&["The", " sky"], 26, 2),
        ollama_no_model("native-model"),
    ])
    .await;
    let sc = Sidecar::start(&one_backend("ollama", &root(&up), None, "")).await;

    let (st, h, b) = post_json(&sc.chat_url(), &chat_body(false, false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(v["choices"][0]["message"]["content"], "Local hello.");
    assert_eq!(
        (
            v["usage"]["prompt_tokens"].as_u64(),
            v["usage"]["completion_tokens"].as_u64()
        ),
        (Some(26), Some(5))
    );
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["usage_evidence_state"], "ACTUAL");
    let req = &up.requests()[0];
    assert_eq!(req.path, "/api/chat");
    let j = req.json.as_ref().unwrap();
    assert_eq!(j["stream"], false, "Ollama streams unless told not to");
    assert_eq!(j["options"]["num_predict"], 64);
    assert_eq!(
        j["messages"][0],
        json!({"role": "system", "content": "Be brief."})
    );

    let s = post_json_frames(&sc.chat_url(), &chat_body(true, true), &[]).await;
    assert_eq!(s.status, 200);
    assert_eq!(s.headers["content-type"], "text/event-stream");
    assert_eq!(up.requests()[1].json.as_ref().unwrap()["stream"], true);
    let c = chunks(&s.sse_data());
    assert_eq!(text_of(&c), "The sky");
    assert_eq!(usage_chunks(&c)[0]["completion_tokens"], 2);

    // 404 model not found: passed on as an OpenAI error, not retried.
    let (st, h, b) = post_json(&sc.chat_url(), &chat_body(false, false), &[]).await;
    assert_eq!(st, 404);
    let v = json(&b);
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["message"], "model 'native-model' not found");
    assert_eq!(up.hits(), 3, "not retried");
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["retry_state"], "NOT_RETRYABLE");
    sc.stop().await;
}

/// The ADR chain: Ollama down → Gemini 429 with RetryInfo → Claude serves.
fn adr_chain(ollama: &str, gemini: &str, claude: &str, ollama_extra: &str) -> String {
    format!(
        r#"version: adr-chain
backends:
  - {{id: ollama, kind: ollama, base_url: "{ollama}", timeouts: {{connect: 500ms, first_byte: 10s, total: 20s}}{ollama_extra}}}
  - {{id: gemini, kind: gemini, base_url: "{gemini}", api_key_env: {GEMINI_KEY}}}
  - {{id: claude, kind: anthropic, base_url: "{claude}", api_key_env: {ANTHROPIC_KEY}}}
routes:
  - model: chat
    chain:
      - {{backend: ollama, model: "llama3.1:8b"}}
      - {{backend: gemini, model: gemini-2.0-flash}}
      - {{backend: claude, model: claude-3-5-haiku-latest}}
retry:
  max_attempts_per_job: 3
  same_backend_retries: 0
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adr_chain_fails_over_across_kinds() {
    keys();
    let gemini = MockUpstream::start(vec![gemini_429("22s", false)]).await;
    let claude =
        MockUpstream::start(vec![anthropic_message("Claude answers.", (40, 8, 0, 0))]).await;
    let sc = Sidecar::start(&adr_chain(
        &closed_port(),
        &format!("{}/v1beta", root(&gemini)),
        &root(&claude),
        "",
    ))
    .await;
    let (st, h, b) = post_json(&sc.chat_url(), &chat_body(false, false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(v["choices"][0]["message"]["content"], "Claude answers.");
    assert_eq!(v["model"], "claude-3-5-haiku-latest");
    assert_eq!(
        (
            v["usage"]["prompt_tokens"].as_u64(),
            v["usage"]["completion_tokens"].as_u64()
        ),
        (Some(40), Some(8))
    );
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["backend"], "claude");
    assert_eq!(a["fallback_state"], "USED");
    let outcomes: Vec<_> = a["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["backend"].as_str().unwrap().to_string(),
                x["outcome"].as_str().unwrap().to_string(),
                x["retry_after_ms"].as_i64(),
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        [
            ("ollama".into(), "connect".into(), None),
            ("gemini".into(), "429".into(), Some(22_000)),
            ("claude".into(), "ok".into(), None)
        ]
    );
    assert_eq!(a["actual_output_tokens"], 8);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_per_day_quota_opens_its_circuit_at_once() {
    keys();
    let gemini = MockUpstream::start(vec![gemini_429("30s", true)]).await;
    let claude =
        MockUpstream::start_with_default(vec![], anthropic_message("ok", (5, 1, 0, 0))).await;
    let sc = Sidecar::start(&adr_chain(
        &closed_port(),
        &format!("{}/v1beta", root(&gemini)),
        &root(&claude),
        "",
    ))
    .await;
    let (st, _, _) = post_json(&sc.chat_url(), &chat_body(false, false), &[]).await;
    assert_eq!(st, 200);
    let now = jiff::Timestamp::now().as_millisecond();
    // One failure, threshold 5: a per-day quota is an outage, not a blip.
    let c = sc.circuit("gemini");
    assert_eq!(format!("{:?}", c.state_at(now)), "Open");
    // Gemini's daily quotas reset at midnight Pacific time.
    let pacific = jiff::tz::TimeZone::get("America/Los_Angeles").unwrap();
    let reset = jiff::Timestamp::from_millisecond(now)
        .unwrap()
        .to_zoned(pacific.clone())
        .date()
        .tomorrow()
        .unwrap()
        .to_zoned(pacific)
        .unwrap()
        .timestamp()
        .as_millisecond();
    assert!(
        c.open_until() >= reset - 2_000,
        "held until the quota resets ({reset}), not 30 s: {}",
        c.open_until()
    );
    let (st, h, _) = post_json(&sc.chat_url(), &chat_body(false, false), &[]).await;
    assert_eq!(st, 200);
    assert_eq!(gemini.hits(), 1, "the second request does not call Gemini");
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["backend"], "claude");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_overload_and_stream_error_are_backend_failures() {
    keys();
    let claude = MockUpstream::start(vec![
        anthropic_overloaded().header("retry-after", "3"),
        Answer::sse(
            vec![
                anthropic_stream_events(&["Hi"], 5, 1)[0].clone(),
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n".into(),
                "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n".into(),
            ],
            Duration::from_millis(5),
        ),
    ])
    .await;
    let yaml = format!(
        r#"version: native-test
backends:
  - {{id: up, kind: anthropic, base_url: "{}", api_key_env: {ANTHROPIC_KEY}}}
routes:
  - {{model: chat, chain: [{{backend: up, model: native-model}}], static_response: busy}}
retry: {{same_backend_retries: 0}}
"#,
        root(&claude)
    );
    let sc = Sidecar::start(&yaml).await;
    let (st, h, b) = post_json(
        &sc.chat_url(),
        &chat_body(false, false),
        &[("x-tollgate-job", "j-overload")],
    )
    .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        json(&b)["choices"][0]["message"]["content"],
        "busy",
        "529 → static answer"
    );
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["attempts"][0]["outcome"], "5xx");
    assert_eq!(a["attempts"][0]["status"], 529);
    assert_eq!(a["attempts"][0]["retry_after_ms"], 3000);

    let s = post_json_frames(&sc.chat_url(), &chat_body(true, false), &[]).await;
    assert_eq!(s.status, 200);
    let data = s.sse_data();
    let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "overloaded_error");
    assert!(!data.iter().any(|d| d == "[DONE]"));
    let a = sc.audit(&rid(&s.headers)).await;
    assert_eq!(a["usage_evidence_state"], "PARTIAL");
    assert_eq!(sc.ledger().reserved_tokens(), 0);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_spills_over_instead_of_queueing() {
    keys();
    // Ollama holds its one slot for 3 s; a second request meanwhile goes to Gemini.
    let ollama = MockUpstream::start_with_default(
        vec![ollama_chat("slow local", 5, 2).delay(Duration::from_secs(3))],
        ollama_chat("local again", 5, 2),
    )
    .await;
    let gemini = MockUpstream::start_with_default(vec![], gemini_response("cloud", 5, 2, 0)).await;
    let claude = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&adr_chain(
        &root(&ollama),
        &format!("{}/v1beta", root(&gemini)),
        &root(&claude),
        ", max_in_flight: 1",
    ))
    .await;
    let url = sc.chat_url();
    let first = tokio::spawn({
        let url = url.clone();
        async move { post_json(&url, &chat_body(false, false), &[]).await }
    });
    // Wait until the slow call is in flight.
    let t0 = std::time::Instant::now();
    assert_eq!(ollama.wait_for_hits(1, Duration::from_secs(5)).await, 1);
    assert_eq!(sc.running.app.transport.in_flight("ollama"), 1);
    let (st, h, b) = post_json(&url, &chat_body(false, false), &[]).await;
    assert_eq!(st, 200);
    assert_eq!(json(&b)["choices"][0]["message"]["content"], "cloud");
    assert!(
        t0.elapsed() < Duration::from_millis(700),
        "did not wait for Ollama"
    );
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["backend"], "gemini");
    assert_eq!(a["attempts"][0]["outcome"], "saturated");
    assert_eq!(a["attempts"][0]["attempt"], 0, "no call was made");
    assert_eq!(a["job_attempts"], 1, "a skipped backend costs no attempt");
    let (st, _, b) = first.await.unwrap();
    assert_eq!(st, 200);
    assert_eq!(json(&b)["choices"][0]["message"]["content"], "slow local");
    assert_eq!(sc.running.app.transport.in_flight("ollama"), 0);
    assert_eq!(ollama.hits(), 1);
    // With the slot free, Ollama serves again.
    let (_, _, b) = post_json(&url, &chat_body(false, false), &[]).await;
    assert_eq!(json(&b)["choices"][0]["message"]["content"], "local again");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_kinds_skip_endpoints_they_do_not_serve() {
    keys();
    let claude = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&one_backend(
        "anthropic",
        &root(&claude),
        Some(ANTHROPIC_KEY),
        "",
    ))
    .await;
    let (st, _, b) = post_json(
        &format!("{}/embeddings", sc.base),
        &json!({"model": "chat", "input": "hello"}),
        &[],
    )
    .await;
    assert_eq!(st, 403, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b)["tollgate"]["reason_class"], "MODEL_INELIGIBLE");
    assert_eq!(claude.hits(), 0);
    sc.stop().await;
}

/// A 429 from Anthropic without Retry-After: the delay comes from the reset instant of the
/// exhausted `anthropic-ratelimit-*` limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_rate_limit_reset_headers_give_the_delay() {
    keys();
    let reset = (jiff::Timestamp::now() + jiff::SignedDuration::from_secs(40)).to_string();
    let claude = MockUpstream::start(vec![Answer::json(
        429,
        json!({"type": "error", "error": {"type": "rate_limit_error", "message": "Number of request tokens has exceeded your per-minute rate limit"}}),
    )
    .header("anthropic-ratelimit-tokens-remaining", "0")
    .header("anthropic-ratelimit-tokens-reset", &reset)
    .header("anthropic-ratelimit-requests-remaining", "99")])
    .await;
    let sc = Sidecar::start(&one_backend(
        "anthropic",
        &root(&claude),
        Some(ANTHROPIC_KEY),
        "",
    ))
    .await;
    let (st, h, _) = post_json(&sc.chat_url(), &chat_body(false, false), &[]).await;
    assert_eq!(st, 429, "a throttled backend defers");
    let a = sc.audit(&rid(&h)).await;
    let ms = a["attempts"][0]["retry_after_ms"]
        .as_i64()
        .expect("a delay");
    assert!((35_000..=40_000).contains(&ms), "{ms}");
    assert_eq!(
        claude.hits(),
        1,
        "40 s is past max_retry_after: not waited out in-request"
    );
    sc.stop().await;
}

/// A stream holds its backend's in-flight slot until it ends, and gives it back when it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_holds_its_in_flight_slot_until_it_ends() {
    keys();
    let ollama = MockUpstream::start(vec![Answer::sse(
        vec![
            "{\"message\":{\"role\":\"assistant\",\"content\":\"a\"},\"done\":false}\n".into(),
            "{\"message\":{\"role\":\"assistant\",\"content\":\"b\"},\"done\":false}\n".into(),
            "{\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,\"done_reason\":\"stop\",\"prompt_eval_count\":5,\"eval_count\":2}\n".into(),
        ],
        Duration::from_millis(300),
    )])
    .await;
    let gemini = MockUpstream::start_with_default(vec![], gemini_response("cloud", 5, 2, 0)).await;
    let claude = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&adr_chain(
        &root(&ollama),
        &format!("{}/v1beta", root(&gemini)),
        &root(&claude),
        ", max_in_flight: 1",
    ))
    .await;
    let url = sc.chat_url();
    let streaming = tokio::spawn({
        let url = url.clone();
        async move { post_json_frames(&url, &chat_body(true, false), &[]).await }
    });
    assert_eq!(ollama.wait_for_hits(1, Duration::from_secs(5)).await, 1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        sc.running.app.transport.in_flight("ollama"),
        1,
        "held mid-stream"
    );
    let (_, _, b) = post_json(&url, &chat_body(false, false), &[]).await;
    assert_eq!(
        json(&b)["choices"][0]["message"]["content"],
        "cloud",
        "spilled over"
    );
    let s = streaming.await.unwrap();
    assert_eq!(text_of(&chunks(&s.sse_data())), "ab");
    let t1 = std::time::Instant::now();
    while sc.running.app.transport.in_flight("ollama") != 0 {
        assert!(t1.elapsed() < Duration::from_secs(2), "slot not given back");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sc.stop().await;
}

/// Embeddings on a local Ollama through its own `/api/embed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_serves_embeddings_natively() {
    let up = MockUpstream::start(vec![Answer::json(
        200,
        json!({"model": "nomic-embed-text", "embeddings": [[0.5, -0.25, 1.0]], "prompt_eval_count": 4}),
    )])
    .await;
    let sc = Sidecar::start(&one_backend("ollama", &root(&up), None, "")).await;
    let (st, h, b) = post_json(
        &format!("{}/embeddings", sc.base),
        &json!({"model": "chat", "input": "hello world"}),
        &[],
    )
    .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["embedding"], json!([0.5, -0.25, 1.0]));
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    let req = &up.requests()[0];
    assert_eq!(req.path, "/api/embed");
    assert_eq!(req.json.as_ref().unwrap()["input"], "hello world");
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["usage_evidence_state"], "ACTUAL");
    assert_eq!(a["actual_input_tokens"], 4);
    assert_eq!(a["actual_output_tokens"], 0);
    sc.stop().await;
}
