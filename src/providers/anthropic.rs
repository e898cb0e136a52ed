//! Anthropic Messages (`POST /v1/messages`, `x-api-key`, `anthropic-version`).
//!
//! Request: system/developer messages hoisted into `system`; tool calls and tool results
//! become `tool_use` / `tool_result` blocks; images become base64 (or URL) image blocks;
//! `max_tokens` is always the reserved cap; `stop` → `stop_sequences`; temperature clamped to
//! Anthropic's 0–1. Response: text and `tool_use` blocks → one choice; `stop_reason` →
//! `finish_reason`; usage input = input + cache creation + cache read. Stream: the event
//! sequence becomes `chat.completion.chunk`s; `message_delta` usage is cumulative (the last
//! one wins); `ping` and unknown events are ignored; an `error` event after the 200 becomes an
//! OpenAI error event and marks the stream failed.

use super::splice::Edit;
use super::{
    choice, completion_body, content_parts, content_text, join, key_header, openai_error,
    parse_arguments, push_turn, stop_sequences, tool_call, BuildCtx, ChunkWriter, Envelope,
    NativeEvents, NativeFormat, NativeRequest, NativeUsage, Part, PassCtx, Provider, Split,
    Translator, Untranslatable,
};
use crate::estimate::Endpoint;
use crate::policy::Backend;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use serde_json::{json, Map, Value};

pub const VERSION: &str = "2023-06-01";

#[derive(Debug, Clone, Copy)]
pub struct Anthropic;

fn finish_reason(stop: Option<&str>) -> &'static str {
    match stop {
        Some("max_tokens") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        _ => "stop",
    }
}

fn usage_of(u: &Value) -> NativeUsage {
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let cache_read = n("cache_read_input_tokens");
    let cache_write = n("cache_creation_input_tokens");
    NativeUsage {
        prompt: n("input_tokens")
            .saturating_add(cache_write)
            .saturating_add(cache_read),
        completion: n("output_tokens"),
        cached: (cache_read > 0).then_some(cache_read),
        cache_write: (cache_write > 0).then_some(cache_write),
        reasoning: None,
    }
}

fn blocks_of(content: Option<&Value>) -> Result<Vec<Value>, Untranslatable> {
    let mut blocks = Vec::new();
    for p in content_parts(content)? {
        match p {
            Part::Text("") => {}
            Part::Text(t) => blocks.push(json!({"type": "text", "text": t})),
            Part::InlineImage { media_type, data } => blocks.push(json!({
                "type": "image",
                "source": {"type": "base64", "media_type": media_type, "data": data},
            })),
            Part::UrlImage(url) => blocks.push(json!({
                "type": "image",
                "source": {"type": "url", "url": url},
            })),
        }
    }
    Ok(blocks)
}

fn translate_tools(tools: &[Value]) -> Result<Vec<Value>, Untranslatable> {
    tools
        .iter()
        .map(|t| {
            let f = t
                .get("function")
                .ok_or_else(|| Untranslatable("only function tools can be translated".into()))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| Untranslatable("a tool has no name".into()))?;
            let mut out = json!({
                "name": name,
                "input_schema": f.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            });
            if let Some(d) = f.get("description") {
                out["description"] = d.clone();
            }
            Ok(out)
        })
        .collect()
}

fn tool_choice(v: &Value) -> Option<Value> {
    match v {
        Value::String(s) if s == "auto" => Some(json!({"type": "auto"})),
        Value::String(s) if s == "required" => Some(json!({"type": "any"})),
        Value::String(s) if s == "none" => Some(json!({"type": "none"})),
        Value::Object(o) => {
            let name = o.get("function")?.get("name")?.as_str()?;
            Some(json!({"type": "tool", "name": name}))
        }
        _ => None,
    }
}

pub(crate) fn translate_request(c: &BuildCtx<'_>) -> Result<Value, Untranslatable> {
    let body = c.body.map()?;
    if body.get("n").and_then(Value::as_u64).unwrap_or(1) > 1 {
        return Err(Untranslatable("anthropic does not support n > 1".into()));
    }
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| Untranslatable("messages must be an array".into()))?;
    let mut system: Vec<String> = Vec::new();
    let mut msgs: Vec<Value> = Vec::with_capacity(messages.len());
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        match role {
            "system" | "developer" => {
                let t = content_text(m.get("content"));
                if !t.is_empty() {
                    system.push(t);
                }
            }
            "user" => {
                let blocks = blocks_of(m.get("content"))?;
                push_turn(&mut msgs, "user", "content", blocks);
            }
            "assistant" => {
                let mut blocks = blocks_of(m.get("content"))?;
                for tc in m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let f = tc.get("function");
                    blocks.push(json!({
                        "type": "tool_use",
                        "id": tc.get("id").and_then(Value::as_str).unwrap_or(""),
                        "name": f.and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or(""),
                        "input": parse_arguments(f.and_then(|f| f.get("arguments")))?,
                    }));
                }
                push_turn(&mut msgs, "assistant", "content", blocks);
            }
            "tool" => {
                let id = m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| Untranslatable("a tool message has no tool_call_id".into()))?;
                let block = json!({
                    "type": "tool_result",
                    "tool_use_id": id,
                    "content": content_text(m.get("content")),
                });
                push_turn(&mut msgs, "user", "content", vec![block]);
            }
            other => {
                return Err(Untranslatable(format!(
                    "messages with role {other:?} cannot be translated"
                )))
            }
        }
    }
    let mut out = Map::new();
    out.insert("model".into(), Value::from(c.model));
    out.insert("max_tokens".into(), super::cap(c));
    out.insert("messages".into(), Value::Array(msgs));
    if !system.is_empty() {
        out.insert("system".into(), Value::String(system.join("\n\n")));
    }
    if let Some(stop) = stop_sequences(body) {
        out.insert("stop_sequences".into(), Value::Array(stop));
    }
    if let Some(t) = body.get("temperature").and_then(Value::as_f64) {
        out.insert("temperature".into(), Value::from(t.clamp(0.0, 1.0)));
    }
    if let Some(p) = body.get("top_p") {
        out.insert("top_p".into(), p.clone());
    }
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        if !tools.is_empty() {
            out.insert("tools".into(), Value::Array(translate_tools(tools)?));
        }
    }
    if let Some(tc) = body.get("tool_choice").and_then(tool_choice) {
        out.insert("tool_choice".into(), tc);
    }
    if let Some(u) = body.get("user").and_then(Value::as_str) {
        out.insert("metadata".into(), json!({"user_id": u}));
    }
    if c.stream {
        out.insert("stream".into(), Value::Bool(true));
    }
    Ok(Value::Object(out))
}

pub(crate) fn translate_response(body: &[u8], env: &Envelope) -> Result<Bytes, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("not an Anthropic message: {e}"))?;
    let mut text = String::new();
    let mut calls = Vec::new();
    for b in v
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("tool_use") => calls.push(tool_call(
                b.get("id").and_then(Value::as_str).unwrap_or(""),
                b.get("name").and_then(Value::as_str).unwrap_or(""),
                b.get("input").unwrap_or(&Value::Null),
            )),
            _ => {}
        }
    }
    let finish = finish_reason(v.get("stop_reason").and_then(Value::as_str));
    let usage = v.get("usage").map(usage_of);
    Ok(completion_body(
        env,
        vec![choice(0, text, calls, finish)],
        usage,
    ))
}

impl Provider for Anthropic {
    fn supports(&self, endpoint: Endpoint) -> bool {
        endpoint == Endpoint::Chat
    }

    fn auth_headers(&self, key: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        key_header("x-api-key", key)
    }

    fn fixed_headers(&self) -> &'static [(&'static str, &'static str)] {
        &[("anthropic-version", VERSION)]
    }

    fn request(&self, c: &BuildCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        if c.endpoint != Endpoint::Chat {
            return Err(Untranslatable(
                "anthropic serves chat completions only".into(),
            ));
        }
        let v = translate_request(c)?;
        Ok(NativeRequest {
            url: join(c.base_url, "/v1/messages"),
            body: serde_json::to_vec(&v).map_err(|e| Untranslatable(e.to_string()))?,
        })
    }

    fn speaks(&self, format: NativeFormat, _backend: &Backend) -> bool {
        format == NativeFormat::AnthropicMessages
    }

    /// Anthropic has no stream-usage option: `message_start` and `message_delta` always
    /// carry it.
    fn pass_through(&self, c: &PassCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        let (model, cap) = (Value::from(c.model), Value::from(c.max_output_tokens));
        c.native(
            "/v1/messages",
            &[Edit::Set("model", &model), Edit::Set("max_tokens", &cap)],
        )
    }

    fn header_delay(&self, headers: &http::HeaderMap, now_ms: i64) -> Option<i64> {
        super::retry_after::from_headers(headers, now_ms)
            .or_else(|| super::retry_after::from_anthropic_ratelimit(headers, now_ms))
    }

    fn response(&self, body: &[u8], env: &Envelope) -> Result<Option<Bytes>, String> {
        translate_response(body, env).map(Some)
    }

    fn stream(&self, env: Envelope) -> Option<Translator> {
        Some(Translator::Anthropic(Split::new(MessagesStream::new(env))))
    }

    fn error_body(&self, _status: u16, body: &[u8]) -> Option<Bytes> {
        // {"type":"error","error":{"type":"invalid_request_error","message":"..."}}
        let v: Value = serde_json::from_slice(body).ok()?;
        let e = v.get("error")?;
        let kind = e.get("type").and_then(Value::as_str).unwrap_or("api_error");
        let msg = e.get("message").and_then(Value::as_str).unwrap_or("");
        Some(openai_error(msg, kind, Some(kind)))
    }
}

/// Anthropic's SSE events → OpenAI chunks.
#[derive(Debug)]
pub struct MessagesStream {
    w: ChunkWriter,
    /// Usage from `message_start`, updated by each `message_delta` (cumulative).
    usage: Option<NativeUsage>,
    /// Content block index → tool call index (in the order tool blocks start).
    tool_index: Vec<(u64, usize)>,
    completed: bool,
    failed: bool,
}

impl MessagesStream {
    pub fn new(env: Envelope) -> Self {
        MessagesStream {
            w: ChunkWriter::new(env),
            usage: None,
            tool_index: Vec::new(),
            completed: false,
            failed: false,
        }
    }

    fn tool_of(&self, block: u64) -> Option<usize> {
        self.tool_index
            .iter()
            .find(|(b, _)| *b == block)
            .map(|(_, t)| *t)
    }

    fn event(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.completed || self.failed {
            return;
        }
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        match v.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                if let Some(u) = v.get("message").and_then(|m| m.get("usage")) {
                    self.usage = Some(usage_of(u));
                }
                self.w.start(out);
            }
            Some("content_block_start") => {
                let idx = v.get("index").and_then(Value::as_u64).unwrap_or(0);
                let b = &v["content_block"];
                match b.get("type").and_then(Value::as_str) {
                    Some("tool_use") => {
                        let k = self.tool_index.len();
                        self.tool_index.push((idx, k));
                        self.w.delta(
                            out,
                            0,
                            json!({"tool_calls": [{
                                "index": k,
                                "id": b.get("id").and_then(Value::as_str).unwrap_or(""),
                                "type": "function",
                                "function": {"name": b.get("name").and_then(Value::as_str).unwrap_or(""), "arguments": ""},
                            }]}),
                        );
                    }
                    Some("text") => {
                        let t = b.get("text").and_then(Value::as_str).unwrap_or("");
                        self.w.text(out, 0, t);
                    }
                    _ => {}
                }
            }
            Some("content_block_delta") => {
                let idx = v.get("index").and_then(Value::as_u64).unwrap_or(0);
                let d = &v["delta"];
                match d.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        let t = d.get("text").and_then(Value::as_str).unwrap_or("");
                        self.w.text(out, 0, t);
                    }
                    Some("input_json_delta") => {
                        if let Some(k) = self.tool_of(idx) {
                            let part = d.get("partial_json").and_then(Value::as_str).unwrap_or("");
                            self.w.delta(
                                out,
                                0,
                                json!({"tool_calls": [{"index": k, "function": {"arguments": part}}]}),
                            );
                        }
                    }
                    Some("thinking_delta") => {
                        let t = d.get("thinking").and_then(Value::as_str).unwrap_or("");
                        if !t.is_empty() {
                            self.w.delta(out, 0, json!({"reasoning_content": t}));
                        }
                    }
                    _ => {}
                }
            }
            Some("message_delta") => {
                if let Some(u) = v.get("usage") {
                    // Cumulative: take the latest figures, never add them up.
                    let mut cur = self.usage.unwrap_or_default();
                    if let Some(o) = u.get("output_tokens").and_then(Value::as_u64) {
                        cur.completion = o;
                    }
                    if u.get("input_tokens").is_some() {
                        let fresh = usage_of(u);
                        cur.prompt = cur.prompt.max(fresh.prompt);
                        cur.cached = fresh.cached.or(cur.cached);
                        cur.cache_write = fresh.cache_write.or(cur.cache_write);
                    }
                    self.usage = Some(cur);
                }
                if let Some(stop) = v.get("delta").and_then(|d| d.get("stop_reason")) {
                    if let Some(s) = stop.as_str() {
                        self.w.finish_reason(out, 0, finish_reason(Some(s)));
                    }
                }
            }
            Some("message_stop") => {
                self.completed = true;
                self.w.end(out, self.usage);
            }
            Some("error") => {
                let e = &v["error"];
                let kind = e.get("type").and_then(Value::as_str).unwrap_or("api_error");
                let msg = e
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("the provider reported an error mid-stream");
                self.failed = true;
                self.w.error(out, msg, kind);
            }
            // `ping` and event types added later.
            _ => {}
        }
    }
}

impl NativeEvents for MessagesStream {
    fn on_event(&mut self, data: &[u8], out: &mut Vec<u8>) {
        self.event(data, out);
    }

    /// A stream that ends before `message_stop` is cut short: an upstream failure.
    fn on_end(&mut self, out: &mut Vec<u8>) {
        if !self.completed && !self.failed {
            self.failed = true;
            self.w.cut_short(out);
        }
    }

    fn failed(&self) -> bool {
        self.failed
    }
}
