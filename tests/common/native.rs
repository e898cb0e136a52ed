//! Native provider answers for the in-process mock upstream, in each provider's real wire
//! format (see docs/dialects.md and the provider adapters in src/providers/): Anthropic Messages, Gemini generateContent and
//! Ollama's `/api/chat`, buffered, streamed, and their error bodies.
#![allow(dead_code)]

use super::mock::{Answer, MockUpstream};
use serde_json::{json, Value};
use std::time::Duration;

/// `http://127.0.0.1:PORT` — the root a native `base_url` points at.
pub fn root(up: &MockUpstream) -> String {
    format!("http://{}", up.addr())
}

/// A policy whose route `chat` goes to an Anthropic backend (`claude`, model `claude-x`) and
/// fails over at once (no same-backend retry) to a Gemini one (`gem`, model `gemini-x`); the
/// keys are read from the variables named.
pub fn claude_then_gemini(
    version: &str,
    claude: &MockUpstream,
    gemini: &MockUpstream,
    anthropic_key_env: &str,
    gemini_key_env: &str,
) -> String {
    format!(
        r#"version: {version}
backends:
  - {{id: claude, kind: anthropic, base_url: "{}", api_key_env: {anthropic_key_env}}}
  - {{id: gem, kind: gemini, base_url: "{}", api_key_env: {gemini_key_env}}}
routes:
  - {{model: chat, chain: [{{backend: claude, model: claude-x}}, {{backend: gem, model: gemini-x}}]}}
retry:
  same_backend_retries: 0
  backoff: {{initial: 1ms, max: 2ms}}
"#,
        root(claude),
        root(gemini)
    )
}

/// `http://127.0.0.1:PORT` with nothing listening there (a backend that is down).
pub fn closed_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let a = l.local_addr().expect("local addr");
    drop(l);
    format!("http://{a}")
}

// ---- Anthropic ---------------------------------------------------------------------------

/// 200 Messages answer with text and usage (input, output, cache creation, cache read).
pub fn anthropic_message(text: &str, usage: (u64, u64, u64, u64)) -> Answer {
    Answer::json(
        200,
        json!({
            "id": "msg_mock", "type": "message", "role": "assistant", "model": "claude-mock",
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": usage.0, "output_tokens": usage.1,
                      "cache_creation_input_tokens": usage.2, "cache_read_input_tokens": usage.3},
        }),
    )
}

fn anthropic_event(kind: &str, data: Value) -> String {
    format!("event: {kind}\ndata: {data}\n\n")
}

/// The event stream of a text answer: `message_start` (input usage), a ping, one text delta
/// per piece, cumulative `message_delta` usage, `message_stop`. Each event its own frame.
pub fn anthropic_stream_events(pieces: &[&str], input: u64, output: u64) -> Vec<String> {
    let mut ev = vec![
        anthropic_event(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_mock", "type": "message", "role": "assistant",
                "content": [], "model": "claude-mock", "stop_reason": null,
                "usage": {"input_tokens": input, "output_tokens": 1}}}),
        ),
        anthropic_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        anthropic_event("ping", json!({"type": "ping"})),
    ];
    for p in pieces {
        ev.push(anthropic_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}}),
        ));
    }
    ev.push(anthropic_event(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    ));
    ev.push(anthropic_event(
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
            "usage": {"output_tokens": output / 2}}),
    ));
    ev.push(anthropic_event(
        "message_delta",
        json!({"type": "message_delta", "delta": {}, "usage": {"output_tokens": output}}),
    ));
    ev.push(anthropic_event(
        "message_stop",
        json!({"type": "message_stop"}),
    ));
    ev
}

pub fn anthropic_stream(pieces: &[&str], input: u64, output: u64) -> Answer {
    Answer::sse(
        anthropic_stream_events(pieces, input, output),
        Duration::from_millis(5),
    )
}

/// 529 `overloaded_error`.
pub fn anthropic_overloaded() -> Answer {
    Answer::json(
        529,
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    )
}

// ---- Gemini ------------------------------------------------------------------------------

/// 200 generateContent answer: text, prompt, candidates and thoughts tokens.
pub fn gemini_response(text: &str, prompt: u64, candidates: u64, thoughts: u64) -> Answer {
    Answer::json(
        200,
        json!({
            "candidates": [{"content": {"role": "model", "parts": [{"text": text}]},
                            "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": prompt, "candidatesTokenCount": candidates,
                              "thoughtsTokenCount": thoughts,
                              "totalTokenCount": prompt + candidates + thoughts},
            "modelVersion": "gemini-mock",
        }),
    )
}

/// `alt=sse` stream: usage repeats as running totals on every chunk; no end marker.
pub fn gemini_stream(pieces: &[&str], prompt: u64, candidates: u64) -> Answer {
    let n = pieces.len() as u64;
    let events = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let last = i as u64 + 1 == n;
            let mut cand =
                json!({"content": {"role": "model", "parts": [{"text": p}]}, "index": 0});
            if last {
                cand["finishReason"] = json!("STOP");
            }
            let so_far = if last {
                candidates
            } else {
                (i as u64 + 1).min(candidates)
            };
            let v = json!({"candidates": [cand],
                "usageMetadata": {"promptTokenCount": prompt, "candidatesTokenCount": so_far,
                                  "totalTokenCount": prompt + so_far}});
            format!("data: {v}\r\n\r\n")
        })
        .collect();
    Answer::sse(events, Duration::from_millis(5))
}

/// 429 RESOURCE_EXHAUSTED with the delay only in the body (`RetryInfo`), no Retry-After.
pub fn gemini_429(retry_delay: &str, per_day: bool) -> Answer {
    let quota_id = if per_day {
        "GenerateRequestsPerDayPerProjectPerModel-FreeTier"
    } else {
        "GenerateRequestsPerMinutePerProjectPerModel-FreeTier"
    };
    Answer::json(
        429,
        json!({"error": {"code": 429, "message": "You exceeded your current quota.",
        "status": "RESOURCE_EXHAUSTED",
        "details": [
            {"@type": "type.googleapis.com/google.rpc.QuotaFailure",
             "violations": [{"quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                             "quotaId": quota_id}]},
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry_delay}
        ]}}),
    )
}

// ---- Ollama ------------------------------------------------------------------------------

/// 200 `/api/chat` answer with `stream: false`.
pub fn ollama_chat(text: &str, prompt: u64, eval: u64) -> Answer {
    Answer::json(
        200,
        json!({"model": "llama-mock", "created_at": "2026-11-30T00:00:00Z",
            "message": {"role": "assistant", "content": text},
            "done": true, "done_reason": "stop", "total_duration": 4_883_583_458u64,
            "prompt_eval_count": prompt, "eval_count": eval}),
    )
}

/// NDJSON stream: one line per piece, then the `done` line with the usage.
pub fn ollama_stream(pieces: &[&str], prompt: u64, eval: u64) -> Answer {
    let mut lines: Vec<String> = pieces
        .iter()
        .map(|p| {
            format!(
                "{}\n",
                json!({"model": "llama-mock", "message": {"role": "assistant", "content": p}, "done": false})
            )
        })
        .collect();
    lines.push(format!(
        "{}\n",
        json!({"model": "llama-mock", "message": {"role": "assistant", "content": ""}, "done": true,
            "done_reason": "stop", "prompt_eval_count": prompt, "eval_count": eval})
    ));
    Answer::sse(lines, Duration::from_millis(5)).header("content-type", "application/x-ndjson")
}

/// 503 `server busy` (queue full): no Retry-After.
pub fn ollama_busy() -> Answer {
    Answer::json(
        503,
        json!({"error": "server busy, please try again.  maximum pending requests exceeded"}),
    )
}

/// 404 model not found.
pub fn ollama_no_model(model: &str) -> Answer {
    Answer::json(404, json!({"error": format!("model '{model}' not found")}))
}
