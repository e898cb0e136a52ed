//! Same format in and out passes through (SPEC §3.1, issue 13): an Anthropic client on an
//! Anthropic backend, a Gemini client on a Gemini backend, an Ollama client on an Ollama
//! backend and a Responses client on an OpenAI backend that declares `responses_api` send
//! their own body upstream — fields the sidecar does not know included — with only the
//! model, the output cap and the key changed, and get the upstream's own answer back, while
//! usage is still metered from it. A fallback to another kind still translates.

mod common;

use common::mock::{Answer, MockUpstream};
use common::native::*;
use common::sidecar::Sidecar;
use common::{json, post_json, post_json_frames};
use serde_json::{json, Value};
use std::time::Duration;

const ANTHROPIC_KEY: &str = "TOLLGATE_TEST_PASS_ANTHROPIC_KEY";
const GEMINI_KEY: &str = "TOLLGATE_TEST_PASS_GEMINI_KEY";
const ANTHROPIC_SECRET: &str = "sk-ant-pass-secret";

fn keys() {
    std::env::set_var(ANTHROPIC_KEY, ANTHROPIC_SECRET);
    std::env::set_var(GEMINI_KEY, "AIza-pass-secret");
}

/// A field no dialect knows, nested.
fn custom() -> Value {
    json!({"a": [1, 2, {"b": "c"}]})
}

/// One route `chat` to one backend.
fn one_backend(kind: &str, base: &str, extra: &str, model: &str) -> String {
    format!(
        r#"version: pass-test
backends:
  - {{id: up, kind: {kind}, base_url: "{base}"{extra}}}
routes:
  - {{model: chat, chain: [{{backend: up, model: {model}}}]}}
"#
    )
}

fn root_url(sc: &Sidecar) -> String {
    sc.base.trim_end_matches("/v1").to_string()
}

fn request_id(h: &http::HeaderMap) -> String {
    h["x-tollgate-request-id"].to_str().unwrap().to_string()
}

/// The audit record says the upstream's own usage was committed.
fn assert_actual_usage(a: &Value, input: u64, output: u64) {
    assert_eq!(a["usage_evidence_state"], "ACTUAL", "{a}");
    assert_eq!(a["actual_input_tokens"], input, "{a}");
    assert_eq!(a["actual_output_tokens"], output, "{a}");
}

// ---- Anthropic ---------------------------------------------------------------------------

fn messages_body(stream: bool) -> Value {
    json!({"model": "chat", "max_tokens": 64,
           "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
           "messages": [{"role": "user", "content": "Say hello"}],
           "metadata": {"user_id": "u-42"}, "top_k": 5, "x_custom": custom(), "stream": stream})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_client_on_anthropic_backend_passes_through() {
    keys();
    let answer = json!({
        "id": "msg_pass", "type": "message", "role": "assistant", "model": "claude-mock",
        "content": [{"type": "text", "text": "Hello.", "citations": null}],
        "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 21, "output_tokens": 5, "service_tier": "standard"},
        "x_upstream_only": {"kept": true},
    });
    let events = anthropic_stream_events(&["Hel", "lo"], 17, 6);
    let up = MockUpstream::start(vec![
        Answer::json(200, answer.clone()),
        Answer::sse(events.clone(), Duration::from_millis(2)),
    ])
    .await;
    let extra = format!(", api_key_env: {ANTHROPIC_KEY}");
    let sc = Sidecar::start(&one_backend("anthropic", &root(&up), &extra, "claude-x")).await;
    let url = format!("{}/v1/messages", root_url(&sc));
    let client_headers = [
        ("x-api-key", "sk-client-own"),
        ("anthropic-beta", "prompt-caching-2024-07-31"),
    ];

    let body = messages_body(false);
    let (st, h, b) = post_json(&url, &body, &client_headers).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    // The client gets the upstream's own answer, not a rendering of it.
    assert_eq!(json(&b), answer);

    let got = up.last_request().unwrap();
    assert_eq!(got.path, "/v1/messages");
    let sent = got.json.clone().unwrap();
    for k in [
        "x_custom", "metadata", "top_k", "system", "messages", "stream",
    ] {
        assert_eq!(sent[k], body[k], "{k} reaches the upstream as sent");
    }
    assert_eq!(sent["model"], "claude-x");
    assert_eq!(sent["max_tokens"], 64);
    // The key comes from the policy only; the client's beta header goes along.
    assert_eq!(got.header("x-api-key"), Some(ANTHROPIC_SECRET));
    assert!(got.header("anthropic-version").is_some());
    assert_eq!(
        got.header("anthropic-beta"),
        Some("prompt-caching-2024-07-31")
    );
    let a = sc.audit(&request_id(&h)).await;
    assert_eq!(a["api"], "anthropic");
    assert_eq!(a["backend"], "up");
    assert_actual_usage(&a, 21, 5);

    // Streamed: the native events reach the client unchanged (the `ping` included), and the
    // usage of message_start / message_delta is committed.
    let s = post_json_frames(&url, &messages_body(true), &client_headers).await;
    assert_eq!(s.status, 200);
    assert!(s.error.is_none(), "{:?}", s.error);
    assert_eq!(s.text(), events.concat());
    let sent = up.last_request().unwrap().json.unwrap();
    assert_eq!(sent["x_custom"], custom());
    assert_eq!(sent["stream"], true);
    let a = sc.audit(&request_id(&s.headers)).await;
    assert_actual_usage(&a, 17, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_through_stream_cut_before_its_end_is_partial() {
    keys();
    // message_stop never comes: the upstream stopped mid-answer.
    let mut events = anthropic_stream_events(&["Hel", "lo"], 17, 6);
    events.truncate(3 + 2);
    let up = MockUpstream::start(vec![Answer::sse(events.clone(), Duration::from_millis(2))]).await;
    let extra = format!(", api_key_env: {ANTHROPIC_KEY}");
    let sc = Sidecar::start(&one_backend("anthropic", &root(&up), &extra, "claude-x")).await;
    let url = format!("{}/v1/messages", root_url(&sc));
    let s = post_json_frames(&url, &messages_body(true), &[]).await;
    assert_eq!(s.status, 200);
    let text = s.text();
    assert!(text.starts_with(&events.concat()), "{text}");
    assert!(!text.contains("message_stop"), "{text}");
    // The sidecar ends it with an Anthropic error event, so the client's SDK raises.
    let tail = &text[events.concat().len()..];
    assert!(tail.starts_with("event: error\ndata: "), "{tail}");
    let a = sc.audit(&request_id(&s.headers)).await;
    assert_eq!(a["usage_evidence_state"], "PARTIAL", "{a}");
    assert!(
        a["reason_class"].to_string().contains("UPSTREAM_FAILURE"),
        "{a}"
    );
}

// ---- Gemini ------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_client_on_gemini_backend_passes_through() {
    keys();
    let answer = json!({
        "candidates": [{"content": {"role": "model", "parts": [{"text": "Hi."}]},
                        "finishReason": "STOP", "index": 0, "safetyRatings": []}],
        "usageMetadata": {"promptTokenCount": 9, "candidatesTokenCount": 3, "totalTokenCount": 12},
        "modelVersion": "gemini-mock", "responseId": "resp-pass",
    });
    let up = MockUpstream::start(vec![Answer::json(200, answer.clone())]).await;
    let extra = format!(", api_key_env: {GEMINI_KEY}");
    let sc = Sidecar::start(&one_backend("gemini", &root(&up), &extra, "gemini-x")).await;
    let url = format!("{}/v1beta/models/chat:generateContent", root_url(&sc));
    let body = json!({
        "contents": [{"role": "user", "parts": [{"text": "Say hi"}]}],
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        "generationConfig": {"temperature": 0.25, "maxOutputTokens": 50, "seed": 7},
        "x_custom": custom(),
    });
    let (st, h, b) = post_json(&url, &body, &[("x-goog-api-key", "client-own")]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b), answer);

    let got = up.last_request().unwrap();
    assert_eq!(got.path, "/models/gemini-x:generateContent");
    let sent = got.json.clone().unwrap();
    assert_eq!(
        sent, body,
        "the body goes as sent (the cap is the client's own here)"
    );
    assert_eq!(got.header("x-goog-api-key"), Some("AIza-pass-secret"));
    let a = sc.audit(&request_id(&h)).await;
    assert_eq!(a["api"], "gemini");
    assert_actual_usage(&a, 9, 3);

    // Without a cap of the client's, the reserved one is set where Gemini reads it.
    up.push_answers(vec![Answer::json(200, answer.clone())]);
    let mut no_cap = body.clone();
    no_cap["generationConfig"]
        .as_object_mut()
        .unwrap()
        .remove("maxOutputTokens");
    let (st, _, _) = post_json(&url, &no_cap, &[]).await;
    assert_eq!(st, 200);
    let sent = up.last_request().unwrap().json.unwrap();
    assert_eq!(sent["generationConfig"]["maxOutputTokens"], 1024);
    assert_eq!(sent["generationConfig"]["seed"], 7);
    assert_eq!(sent["x_custom"], custom());

    // Streamed with alt=sse: Gemini's own chunks, running usage totals and all.
    let native = gemini_stream(&["Gem", "ini"], 12, 3);
    let want = {
        let probe = MockUpstream::start(vec![native.clone()]).await;
        let (_, _, b) = common::get(&probe.base_url()).await;
        String::from_utf8(b.to_vec()).unwrap()
    };
    up.push_answers(vec![native]);
    let surl = format!(
        "{}/v1beta/models/chat:streamGenerateContent?alt=sse",
        root_url(&sc)
    );
    let s = post_json_frames(&surl, &body, &[]).await;
    assert_eq!(s.status, 200);
    assert_eq!(
        s.text(),
        want,
        "the native chunks reach the client unchanged"
    );
    let got = up.last_request().unwrap();
    assert_eq!(got.path, "/models/gemini-x:streamGenerateContent");
    assert_eq!(got.query.as_deref(), Some("alt=sse"));
    assert_eq!(got.json.unwrap(), body);
    let a = sc.audit(&request_id(&s.headers)).await;
    assert_actual_usage(&a, 12, 3);
}

// ---- Ollama ------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_client_on_ollama_backend_passes_through() {
    let chat = json!({"model": "llama-mock", "created_at": "2026-11-30T00:00:00Z",
        "message": {"role": "assistant", "content": "Yo."},
        "done": true, "done_reason": "stop", "total_duration": 4_883_583_458u64,
        "load_duration": 1234, "prompt_eval_count": 8, "eval_count": 2});
    let generate = json!({"model": "llama-mock", "created_at": "2026-11-30T00:00:00Z",
        "response": "Generated.", "done": true, "done_reason": "stop", "context": [1, 2, 3],
        "prompt_eval_count": 6, "eval_count": 4});
    let up = MockUpstream::start(vec![
        Answer::json(200, chat.clone()),
        Answer::json(200, generate.clone()),
    ])
    .await;
    let sc = Sidecar::start(&one_backend("ollama", &root(&up), "", "llama-x")).await;
    let root_url = root_url(&sc);

    let body = json!({"model": "chat", "stream": false, "keep_alive": "10m",
        "messages": [{"role": "user", "content": "hi"}],
        "options": {"seed": 42, "num_predict": 30, "mirostat": 1}, "x_custom": custom()});
    let (st, h, b) = post_json(&format!("{root_url}/api/chat"), &body, &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b), chat);
    let got = up.last_request().unwrap();
    assert_eq!(got.path, "/api/chat");
    let sent = got.json.unwrap();
    for k in ["x_custom", "keep_alive", "messages", "options", "stream"] {
        assert_eq!(sent[k], body[k], "{k} reaches the upstream as sent");
    }
    assert_eq!(sent["model"], "llama-x");
    let a = sc.audit(&request_id(&h)).await;
    assert_eq!(a["api"], "ollama");
    assert_actual_usage(&a, 8, 2);

    // /api/generate goes to /api/generate: its answer (with `context`) comes back as it is.
    let body = json!({"model": "chat", "stream": false, "prompt": "go", "raw": true,
        "options": {"seed": 1}, "x_custom": custom()});
    let (st, h, b) = post_json(&format!("{root_url}/api/generate"), &body, &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b), generate);
    let got = up.last_request().unwrap();
    assert_eq!(got.path, "/api/generate");
    let sent = got.json.unwrap();
    assert_eq!(sent["prompt"], "go");
    assert_eq!(sent["raw"], true);
    assert_eq!(sent["x_custom"], custom());
    assert_eq!(sent["options"]["seed"], 1);
    assert_eq!(
        sent["options"]["num_predict"], 1024,
        "the reserved cap is set"
    );
    let a = sc.audit(&request_id(&h)).await;
    assert_actual_usage(&a, 6, 4);
}

// ---- Responses ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_client_on_a_responses_backend_passes_through() {
    let answer = json!({
        "id": "resp_pass", "object": "response", "created_at": 1, "status": "completed",
        "model": "gpt-x-2026",
        "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "Stateful hi.", "annotations": []}]}],
        "usage": {"input_tokens": 11, "output_tokens": 7,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 18},
        "x_upstream_only": "kept",
    });
    let up = MockUpstream::start(vec![Answer::json(200, answer.clone())]).await;
    let sc = Sidecar::start(&one_backend(
        "openai",
        &up.base_url(),
        ", responses_api: true",
        "gpt-x",
    ))
    .await;
    let url = format!("{}/v1/responses", root_url(&sc));
    // Stateful fields too: a translated entry could not serve this at all.
    let body = json!({"model": "chat", "input": "hi", "instructions": "Be brief.",
        "previous_response_id": "resp_0", "store": true, "max_output_tokens": 40,
        "reasoning": {"effort": "low"}, "x_custom": custom()});
    let (st, h, b) = post_json(&url, &body, &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b), answer);
    let got = up.last_request().unwrap();
    assert_eq!(got.path, "/v1/responses");
    let sent = got.json.unwrap();
    for k in [
        "x_custom",
        "previous_response_id",
        "store",
        "input",
        "instructions",
        "reasoning",
    ] {
        assert_eq!(sent[k], body[k], "{k} reaches the upstream as sent");
    }
    assert_eq!(sent["model"], "gpt-x");
    assert_eq!(sent["max_output_tokens"], 40);
    assert!(sent.get("messages").is_none(), "not translated to chat");
    let a = sc.audit(&request_id(&h)).await;
    assert_eq!(a["api"], "responses");
    assert_actual_usage(&a, 11, 7);
}

// ---- Fallback across kinds ---------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_choice_is_per_attempt_a_cross_kind_fallback_translates() {
    keys();
    let claude = MockUpstream::start(vec![anthropic_overloaded()]).await;
    let gemini = MockUpstream::start(vec![gemini_response("From Gemini.", 12, 4, 0)]).await;
    let yaml = claude_then_gemini("pass-fallback", &claude, &gemini, ANTHROPIC_KEY, GEMINI_KEY);
    let sc = Sidecar::start(&yaml).await;
    let url = format!("{}/v1/messages", root_url(&sc));
    let (st, h, b) = post_json(&url, &messages_body(false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(h["x-tollgate-backend"], "gem");
    // The Anthropic attempt passed the body through...
    let first = claude.last_request().unwrap().json.unwrap();
    assert_eq!(first["x_custom"], custom());
    assert_eq!(first["model"], "claude-x");
    // ...the Gemini one was translated, and the answer rendered as an Anthropic message.
    let second = gemini.last_request().unwrap().json.unwrap();
    assert!(second["contents"].is_array(), "{second}");
    assert!(second.get("x_custom").is_none());
    assert!(second.get("messages").is_none());
    let v = json(&b);
    assert_eq!(v["type"], "message");
    assert_eq!(v["model"], "chat");
    assert_eq!(v["content"][0]["text"], "From Gemini.");
    assert_eq!(v["usage"]["input_tokens"], 12);
    let a = sc.audit(&request_id(&h)).await;
    assert_eq!(a["fallback_state"], "USED");
    assert_actual_usage(&a, 12, 4);
}

// ---- Errors ------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_client_error_passes_through_in_its_own_shape() {
    keys();
    let err = json!({"type": "error", "error": {"type": "invalid_request_error",
        "message": "top_k: must be positive"}, "request_id": "req_up"});
    let up = MockUpstream::start(vec![Answer::json(400, err.clone())]).await;
    let extra = format!(", api_key_env: {ANTHROPIC_KEY}");
    let sc = Sidecar::start(&one_backend("anthropic", &root(&up), &extra, "claude-x")).await;
    let url = format!("{}/v1/messages", root_url(&sc));
    let (st, h, b) = post_json(&url, &messages_body(false), &[]).await;
    assert_eq!(st, 400);
    assert_eq!(json(&b), err);
    let a = sc.audit(&request_id(&h)).await;
    assert_eq!(a["retry_state"], "NOT_RETRYABLE");
}

// ---- Byte fidelity -----------------------------------------------------------------------

/// The members the sidecar does not change reach the upstream as the client wrote them: key
/// order inside them, number spelling and spacing included (a re-serialized body would sort
/// the keys and write `2.5`). Only the model and the cap are rewritten, in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_members_reach_the_upstream_byte_for_byte() {
    keys();
    let custom = r#"{"zeta": [2.50, 1e3, "\u00e9"], "alpha": {"y": null, "b": true}}"#;
    let answer = json!({
        "candidates": [{"content": {"role": "model", "parts": [{"text": "Hi."}]},
                        "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 9, "candidatesTokenCount": 3, "totalTokenCount": 12},
    });
    let up = MockUpstream::start(vec![Answer::json(200, answer)]).await;
    let extra = format!(", api_key_env: {GEMINI_KEY}");
    let sc = Sidecar::start(&one_backend("gemini", &root(&up), &extra, "gemini-x")).await;
    let url = format!("{}/v1beta/models/chat:generateContent", root_url(&sc));
    let body = format!(
        r#"{{"x_custom": {custom}, "contents": [{{"role": "user", "parts": [{{"text": "Say hi"}}]}}],
            "generationConfig": {{"temperature": 0.250, "maxOutputTokens": 5000, "seed": 7}}}}"#
    );
    let (st, _, b) = common::try_post_raw(
        &url,
        bytes::Bytes::from(body),
        &[("content-type", "application/json")],
    )
    .await
    .unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let got = up.last_request().unwrap();
    let sent = std::str::from_utf8(&got.body).unwrap();
    assert!(
        sent.starts_with(&format!(r#"{{"x_custom":{custom},"contents":"#)),
        "unknown member first and byte-for-byte: {sent}"
    );
    // The cap is clamped to the reserved one inside generationConfig; its siblings keep
    // their spelling.
    assert!(
        sent.contains(r#""temperature":0.250"#),
        "generationConfig's other members as sent: {sent}"
    );
    let v: Value = serde_json::from_str(sent).unwrap();
    assert_eq!(v["generationConfig"]["seed"], 7);
    assert!(v["generationConfig"]["maxOutputTokens"].as_u64().unwrap() <= 5000);
}
