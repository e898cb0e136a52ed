//! Inbound dialects over raw HTTP (issue 13, SPEC §3.1): Anthropic Messages, Gemini, Ollama
//! and OpenAI Responses clients against the real sidecar and in-process mock upstreams,
//! buffered and streamed, refusals in each dialect's shape, cross-kind fallback, and paths
//! under a dialect's prefix that are refused rather than forwarded.

mod common;

use common::mock::{Answer, MockUpstream};
use common::native::*;
use common::sidecar::Sidecar;
use common::{get, json, post_json, post_json_frames, sse_data_lines};
use serde_json::{json, Value};
use std::time::Duration;

const ANTHROPIC_KEY: &str = "TOLLGATE_TEST_DIALECT_ANTHROPIC_KEY";
const GEMINI_KEY: &str = "TOLLGATE_TEST_DIALECT_GEMINI_KEY";

fn keys() {
    std::env::set_var(ANTHROPIC_KEY, "sk-ant-test-secret");
    std::env::set_var(GEMINI_KEY, "AIza-test-secret");
}

/// Route `chat` (and `embed`) to one OpenAI-kind mock, plus `extra` YAML.
fn openai_policy(base: &str, extra: &str) -> String {
    format!(
        r#"version: dialect-test
backends:
  - {{id: mock, kind: openai, base_url: "{base}"}}
routes:
  - {{model: chat, chain: [{{backend: mock, model: gpt-mock}}]}}
  - {{model: embed, chain: [{{backend: mock, model: embed-mock}}]}}
{extra}"#
    )
}

fn root_url(sc: &Sidecar) -> String {
    sc.base.trim_end_matches("/v1").to_string()
}

fn events(text: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut name = String::new();
    for l in text.lines() {
        if let Some(n) = l.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = l.strip_prefix("data: ") {
            out.push((name.clone(), serde_json::from_str(d).unwrap_or(Value::Null)));
        }
    }
    out
}

// ---- Anthropic --------------------------------------------------------------------------

fn messages_body(stream: bool) -> Value {
    json!({"model": "chat", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
           "messages": [{"role": "user", "content": "Say hello"}],
           "stop_sequences": ["\n\n"], "stream": stream})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_buffered_streamed_and_counted() {
    let up = MockUpstream::start(vec![
        Answer::ok_chat("Hello there.", 21, 5),
        Answer::sse_chat(&["Hel", "lo"], Some((17, 2)), Duration::from_millis(1)),
    ])
    .await;
    let sc = Sidecar::start(&openai_policy(&up.base_url(), "")).await;
    let url = format!("{}/v1/messages", root_url(&sc));

    let (st, h, b) = post_json(&url, &messages_body(false), &[("x-api-key", "sk-any")]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], "chat");
    assert_eq!(v["content"][0]["text"], "Hello there.");
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["usage"]["input_tokens"], 21);
    assert_eq!(v["usage"]["output_tokens"], 5);
    // The internal request: system first, the stop sequences, the cap.
    let sent = up.last_request().unwrap().json.unwrap();
    assert_eq!(sent["messages"][0]["role"], "system");
    assert_eq!(sent["stop"], json!(["\n\n"]));
    let rid = h["x-tollgate-request-id"].to_str().unwrap().to_string();
    let a = sc.audit(&rid).await;
    assert_eq!(a["api"], "anthropic");

    let s = post_json_frames(&url, &messages_body(true), &[]).await;
    assert_eq!(s.status, 200);
    assert_eq!(s.headers["content-type"], "text/event-stream");
    let ev = events(&s.text());
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let text: String = ev
        .iter()
        .filter_map(|(_, v)| v["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "Hello");
    let delta = &ev[5].1;
    assert_eq!(delta["usage"]["output_tokens"], 2);
    assert_eq!(delta["usage"]["input_tokens"], 17);
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");

    // count_tokens: the estimate, no upstream call.
    let hits = up.hits();
    let (st, _, b) = post_json(
        &format!("{url}/count_tokens"),
        &json!({"model": "chat", "messages": [{"role": "user", "content": "Say hello"}]}),
        &[],
    )
    .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert!(json(&b)["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(up.hits(), hits, "counting never calls upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_refusals_have_anthropic_shape() {
    let up = MockUpstream::start(vec![]).await;
    let extra = "budgets:\n  - {name: per-request, scope: request, hard_tokens: 10}\n";
    let sc = Sidecar::start(&openai_policy(&up.base_url(), extra)).await;
    let url = format!("{}/v1/messages", root_url(&sc));
    let (st, h, b) = post_json(&url, &messages_body(false), &[]).await;
    assert_eq!(st, 403, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "permission_error");
    assert_eq!(v["tollgate"]["final_action"], "HARD_STOP");
    assert_eq!(h["x-tollgate-action"], "HARD_STOP");
    assert_eq!(up.hits(), 0);

    // Unknown model, bad JSON.
    let mut body = messages_body(false);
    body["model"] = json!("nope");
    let (st, _, b) = post_json(&url, &body, &[]).await;
    assert_eq!(st, 404);
    assert_eq!(json(&b)["error"]["type"], "not_found_error");
    let (st, _, b) = common::try_post_raw(&url, "{not json".into(), &[])
        .await
        .unwrap();
    assert_eq!(st, 400);
    assert_eq!(json(&b)["error"]["type"], "invalid_request_error");
    // Under the prefix but not an endpoint: refused in the dialect, never forwarded.
    let (st, _, b) = post_json(&format!("{url}/batches"), &json!({}), &[]).await;
    assert_eq!(st, 404);
    assert_eq!(json(&b)["type"], "error");
    assert_eq!(up.hits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_client_falls_back_to_gemini() {
    keys();
    let claude = MockUpstream::start(vec![anthropic_overloaded()]).await;
    let gemini = MockUpstream::start(vec![
        gemini_response("From Gemini.", 12, 4, 0),
        gemini_stream(&["Gem", "ini"], 12, 3),
    ])
    .await;
    // The Anthropic backend fails over at once (no same-backend retry), to Gemini.
    let yaml = claude_then_gemini(
        "dialect-fallback",
        &claude,
        &gemini,
        ANTHROPIC_KEY,
        GEMINI_KEY,
    );
    let sc = Sidecar::start(&yaml).await;
    let url = format!("{}/v1/messages", root_url(&sc));
    let (st, h, b) = post_json(&url, &messages_body(false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(h["x-tollgate-backend"], "gem");
    let v = json(&b);
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["text"], "From Gemini.");
    assert_eq!(v["usage"]["input_tokens"], 12);
    assert_eq!(v["usage"]["output_tokens"], 4);

    // Streamed: the Anthropic circuit may now be open or the mock answers its default; either
    // way Gemini serves and the client gets Anthropic events with Gemini's usage.
    claude.push_answers(vec![anthropic_overloaded()]);
    let s = post_json_frames(&url, &messages_body(true), &[]).await;
    assert_eq!(s.status, 200);
    let ev = events(&s.text());
    let text: String = ev
        .iter()
        .filter_map(|(_, v)| v["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "Gemini");
    let (last, delta) = (&ev[ev.len() - 1], &ev[ev.len() - 2]);
    assert_eq!(last.0, "message_stop");
    assert_eq!(delta.1["usage"]["output_tokens"], 3);
}

// ---- Gemini -----------------------------------------------------------------------------

fn gen_body() -> Value {
    json!({"contents": [{"role": "user", "parts": [{"text": "Say hello"}]}],
           "systemInstruction": {"parts": [{"text": "Be brief."}]},
           "generationConfig": {"maxOutputTokens": 32, "stopSequences": ["END"]}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_generate_stream_count_embed_and_list() {
    let up = MockUpstream::start(vec![
        Answer::ok_chat("Hi from Gemini dialect.", 9, 6),
        Answer::sse_chat(&["a", "b"], Some((9, 2)), Duration::from_millis(1)),
        Answer::sse_chat(&["c"], Some((9, 1)), Duration::from_millis(1)),
        Answer::ok_embedding(3, 4),
    ])
    .await;
    let sc = Sidecar::start(&openai_policy(&up.base_url(), "")).await;
    let root = root_url(&sc);

    let url = format!("{root}/v1beta/models/chat:generateContent");
    let (st, _, b) = post_json(&url, &gen_body(), &[("x-goog-api-key", "k")]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(
        v["candidates"][0]["content"]["parts"][0]["text"],
        "Hi from Gemini dialect."
    );
    assert_eq!(v["candidates"][0]["finishReason"], "STOP");
    assert_eq!(v["usageMetadata"]["promptTokenCount"], 9);
    assert_eq!(v["usageMetadata"]["candidatesTokenCount"], 6);
    let sent = up.last_request().unwrap().json.unwrap();
    assert_eq!(sent["model"], "gpt-mock");
    assert_eq!(sent["max_tokens"], 32);
    assert_eq!(sent["stop"], json!(["END"]));

    // SSE with alt=sse.
    let s = post_json_frames(
        &format!("{root}/v1/models/chat:streamGenerateContent?alt=sse"),
        &gen_body(),
        &[],
    )
    .await;
    assert_eq!(s.status, 200);
    let chunks: Vec<Value> = sse_data_lines(&s.text())
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["candidates"][0]["content"]["parts"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "ab");
    let last = chunks.last().unwrap();
    assert_eq!(last["usageMetadata"]["candidatesTokenCount"], 2);
    assert_eq!(last["candidates"][0]["finishReason"], "STOP");

    // Without alt=sse: one JSON array.
    let s = post_json_frames(
        &format!("{root}/v1beta/models/chat:streamGenerateContent"),
        &gen_body(),
        &[],
    )
    .await;
    let arr = json(&s.body());
    assert!(arr.is_array(), "{arr}");
    assert_eq!(arr[0]["candidates"][0]["content"]["parts"][0]["text"], "c");

    // countTokens: never calls upstream.
    let hits = up.hits();
    let (st, _, b) = post_json(
        &format!("{root}/v1beta/models/chat:countTokens"),
        &gen_body(),
        &[],
    )
    .await;
    assert_eq!(st, 200);
    assert!(json(&b)["totalTokens"].as_u64().unwrap() > 0);
    assert_eq!(up.hits(), hits);

    // embedContent.
    let (st, _, b) = post_json(
        &format!("{root}/v1beta/models/embed:embedContent"),
        &json!({"content": {"parts": [{"text": "vector me"}]}}),
        &[],
    )
    .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b)["embedding"]["values"].as_array().unwrap().len(), 3);

    let (st, _, b) = get(&format!("{root}/v1beta/models")).await;
    assert_eq!(st, 200);
    assert_eq!(json(&b)["models"][0]["name"], "models/chat");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_rate_limit_is_resource_exhausted_with_retry_info() {
    let up = MockUpstream::start(vec![Answer::ok_chat("one", 3, 1)]).await;
    let extra = "rate_limits:\n  - {name: rpm, scope: consumer, match: \"*\", window: minute, limit_requests: 1}\n";
    let sc = Sidecar::start(&openai_policy(&up.base_url(), extra)).await;
    let url = format!(
        "{}/v1beta/models/chat:generateContent?key=abc",
        root_url(&sc)
    );
    let (st, _, _) = post_json(&url, &gen_body(), &[]).await;
    assert_eq!(st, 200);
    let (st, h, b) = post_json(&url, &gen_body(), &[]).await;
    assert_eq!(st, 429, "{}", String::from_utf8_lossy(&b));
    assert!(h.contains_key("retry-after"));
    let v = json(&b);
    assert_eq!(v["error"]["status"], "RESOURCE_EXHAUSTED");
    assert_eq!(v["error"]["code"], 429);
    assert_eq!(
        v["error"]["details"][0]["@type"],
        "type.googleapis.com/google.rpc.RetryInfo"
    );
    assert_eq!(v["tollgate"]["final_action"], "DEFER");
    let (st, _, b) = post_json(
        &format!("{}/v1beta/cachedContents", root_url(&sc)),
        &json!({}),
        &[],
    )
    .await;
    assert_eq!(st, 404);
    assert_eq!(json(&b)["error"]["status"], "NOT_FOUND");
}

// ---- Ollama -----------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_chat_streams_ndjson_by_default() {
    let up = MockUpstream::start(vec![
        Answer::sse_chat(&["Hel", "lo"], Some((11, 2)), Duration::from_millis(1)),
        Answer::ok_chat("Buffered.", 11, 3),
        Answer::ok_chat("Generated.", 7, 2),
        Answer::ok_embedding(2, 3),
    ])
    .await;
    let sc = Sidecar::start(&openai_policy(&up.base_url(), "")).await;
    let root = root_url(&sc);
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                      "options": {"num_predict": 20}});
    let s = post_json_frames(&format!("{root}/api/chat"), &body, &[]).await;
    assert_eq!(s.status, 200);
    assert_eq!(s.headers["content-type"], "application/x-ndjson");
    let lines: Vec<Value> = s
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let text: String = lines
        .iter()
        .filter_map(|l| l["message"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello");
    let done = lines.last().unwrap();
    assert_eq!(done["done"], true);
    assert_eq!(done["prompt_eval_count"], 11);
    assert_eq!(done["eval_count"], 2);
    assert_eq!(up.requests()[0].json.as_ref().unwrap()["max_tokens"], 20);

    let mut b2 = body.clone();
    b2["stream"] = json!(false);
    let (st, _, b) = post_json(&format!("{root}/api/chat"), &b2, &[]).await;
    assert_eq!(st, 200);
    let v = json(&b);
    assert_eq!(v["message"]["content"], "Buffered.");
    assert_eq!(v["eval_count"], 3);

    let (st, _, b) = post_json(
        &format!("{root}/api/generate"),
        &json!({"model": "chat", "prompt": "hi", "stream": false}),
        &[],
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(json(&b)["response"], "Generated.");

    let (st, _, b) = post_json(
        &format!("{root}/api/embed"),
        &json!({"model": "embed", "input": ["a"]}),
        &[],
    )
    .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b)["embeddings"][0].as_array().unwrap().len(), 2);

    let (_, _, b) = get(&format!("{root}/api/tags")).await;
    assert_eq!(json(&b)["models"][0]["name"], "chat");
    let (_, _, b) = get(&format!("{root}/api/version")).await;
    assert!(json(&b)["version"].is_string());
    let (st, _, b) = post_json(&format!("{root}/api/pull"), &json!({"model": "x"}), &[]).await;
    assert_eq!(st, 404);
    assert!(json(&b)["error"].is_string());
}

// ---- Responses --------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_buffered_streamed_and_stateful_refused() {
    let up = MockUpstream::start(vec![
        Answer::ok_chat("Responses hello.", 14, 3),
        Answer::sse_chat(&["R", "S"], Some((14, 2)), Duration::from_millis(1)),
    ])
    .await;
    let sc = Sidecar::start(&openai_policy(&up.base_url(), "")).await;
    let url = format!("{}/v1/responses", root_url(&sc));
    let body = json!({"model": "chat", "instructions": "Be brief.", "input": "hi",
                      "max_output_tokens": 40});
    let (st, _, b) = post_json(&url, &body, &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(v["object"], "response");
    assert_eq!(v["output"][0]["content"][0]["text"], "Responses hello.");
    assert_eq!(v["usage"]["input_tokens"], 14);
    assert_eq!(v["usage"]["output_tokens"], 3);
    let sent = up.last_request().unwrap().json.unwrap();
    assert_eq!(sent["max_completion_tokens"], 40);
    assert_eq!(sent["messages"][0]["role"], "system");

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let s = post_json_frames(&url, &sb, &[]).await;
    let ev = events(&s.text());
    assert_eq!(ev[0].0, "response.created");
    let last = &ev.last().unwrap().1;
    assert_eq!(last["type"], "response.completed");
    assert_eq!(last["response"]["usage"]["output_tokens"], 2);
    let deltas: String = ev
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .filter_map(|(_, v)| v["delta"].as_str())
        .collect();
    assert_eq!(deltas, "RS");

    // Stateful: no translated entry can serve it; nothing goes upstream.
    let hits = up.hits();
    let mut st_body = body.clone();
    st_body["previous_response_id"] = json!("resp_1");
    let (st, h, _) = post_json(&url, &st_body, &[]).await;
    assert!(st >= 400, "{st}");
    assert_eq!(up.hits(), hits);
    let a = sc.audit(h["x-tollgate-request-id"].to_str().unwrap()).await;
    assert_eq!(a["api"], "responses");
    assert!(a.to_string().contains("untranslatable"), "{a}");
}
