//! Google Gemini `generateContent` (`POST {base}/models/{model}:generateContent`, streaming
//! `:streamGenerateContent?alt=sse`, `x-goog-api-key`).
//!
//! Request: `contents` with roles `user`/`model`, `systemInstruction`, `generationConfig`
//! (`maxOutputTokens` always the reserved cap, `stopSequences`, `temperature`, `topP`,
//! `candidateCount`), tools as `functionDeclarations`, images as `inlineData`. Response:
//! candidates → choices, `finishReason` → `finish_reason`, usage output = candidates +
//! thoughts; a blocked prompt (200, `promptFeedback.blockReason`, no candidates) is a
//! `content_filter` finish. Streams repeat `usageMetadata` as running totals: the last wins.
//! Errors: `RetryInfo.retryDelay` in the body is the delay (no Retry-After header on 429); a
//! per-day quota violation will not clear in minutes and is reported as a long outage.

use super::splice::Edit;
use super::{
    choice, completion_body, content_parts, content_text, join, key_header, openai_error,
    parse_arguments, push_turn, stop_sequences, tool_call, BuildCtx, ChunkWriter, Envelope,
    ErrorHint, NativeRequest, NativeUsage, Part, Provider, Translator, Untranslatable,
};
use super::{NativeEvents, NativeFormat, PassCtx, Split};
use crate::estimate::Endpoint;
use crate::policy::Backend;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use serde_json::{json, Map, Value};

/// Gemini's daily quotas reset at midnight Pacific time.
const QUOTA_TIMEZONE: &str = "America/Los_Angeles";

#[derive(Debug, Clone, Copy)]
pub struct Gemini;

fn finish_reason(r: Option<&str>) -> Option<&'static str> {
    Some(match r? {
        "STOP" => "stop",
        "MAX_TOKENS" => "length",
        "SAFETY" | "RECITATION" | "BLOCKLIST" | "PROHIBITED_CONTENT" | "SPII" | "IMAGE_SAFETY" => {
            "content_filter"
        }
        "FINISH_REASON_UNSPECIFIED" => return None,
        _ => "stop",
    })
}

fn usage_of(u: &Value) -> NativeUsage {
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let thoughts = n("thoughtsTokenCount");
    let cached = n("cachedContentTokenCount");
    NativeUsage {
        prompt: n("promptTokenCount"),
        completion: n("candidatesTokenCount") + thoughts,
        cached: (cached > 0).then_some(cached),
        cache_write: None,
        reasoning: (thoughts > 0).then_some(thoughts),
    }
}

fn parts_of(content: Option<&Value>) -> Result<Vec<Value>, Untranslatable> {
    let mut parts = Vec::new();
    for p in content_parts(content)? {
        match p {
            Part::Text("") => {}
            Part::Text(t) => parts.push(json!({"text": t})),
            Part::InlineImage { media_type, data } => {
                parts.push(json!({"inlineData": {"mimeType": media_type, "data": data}}))
            }
            Part::UrlImage(_) => {
                return Err(Untranslatable(
                    "gemini takes images inline only (send a data: URI)".into(),
                ))
            }
        }
    }
    Ok(parts)
}

fn translate_tools(tools: &[Value]) -> Result<Value, Untranslatable> {
    let decls = tools
        .iter()
        .map(|t| {
            let f = t
                .get("function")
                .ok_or_else(|| Untranslatable("only function tools can be translated".into()))?;
            let mut d = Map::new();
            for k in ["name", "description", "parameters"] {
                if let Some(v) = f.get(k) {
                    d.insert(k.into(), v.clone());
                }
            }
            Ok(Value::Object(d))
        })
        .collect::<Result<Vec<_>, Untranslatable>>()?;
    Ok(json!([{"functionDeclarations": decls}]))
}

fn tool_config(v: &Value) -> Option<Value> {
    let (mode, names) = match v {
        Value::String(s) if s == "auto" => ("AUTO", None),
        Value::String(s) if s == "required" => ("ANY", None),
        Value::String(s) if s == "none" => ("NONE", None),
        Value::Object(o) => ("ANY", Some(o.get("function")?.get("name")?.clone())),
        _ => return None,
    };
    let mut cfg = json!({"mode": mode});
    if let Some(n) = names {
        cfg["allowedFunctionNames"] = json!([n]);
    }
    Some(json!({"functionCallingConfig": cfg}))
}

pub(crate) fn translate_request(c: &BuildCtx<'_>) -> Result<Value, Untranslatable> {
    let body = c.body.map()?;
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| Untranslatable("messages must be an array".into()))?;
    let mut system: Vec<Value> = Vec::new();
    let mut contents: Vec<Value> = Vec::with_capacity(messages.len());
    // Tool results name their function in Gemini; OpenAI names only the call id.
    let mut call_names: Vec<(String, String)> = Vec::new();
    for m in messages {
        match m.get("role").and_then(Value::as_str).unwrap_or("") {
            "system" | "developer" => {
                let t = content_text(m.get("content"));
                if !t.is_empty() {
                    system.push(json!({"text": t}));
                }
            }
            "user" => push_turn(&mut contents, "user", "parts", parts_of(m.get("content"))?),
            "assistant" => {
                let mut parts = parts_of(m.get("content"))?;
                for tc in m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let f = tc.get("function");
                    let name = f
                        .and_then(|f| f.get("name"))
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    if let Some(id) = tc.get("id").and_then(Value::as_str) {
                        call_names.push((id.to_string(), name.to_string()));
                    }
                    parts.push(json!({"functionCall": {
                        "name": name,
                        "args": parse_arguments(f.and_then(|f| f.get("arguments")))?,
                    }}));
                }
                push_turn(&mut contents, "model", "parts", parts);
            }
            "tool" => {
                let id = m.get("tool_call_id").and_then(Value::as_str).unwrap_or("");
                let name = call_names
                    .iter()
                    .find(|(i, _)| i == id)
                    .map(|(_, n)| n.clone())
                    .ok_or_else(|| {
                        Untranslatable(format!(
                            "the tool message for call {id:?} has no matching assistant tool call"
                        ))
                    })?;
                let text = content_text(m.get("content"));
                let response = match serde_json::from_str::<Value>(&text) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => json!({"content": text}),
                };
                push_turn(
                    &mut contents,
                    "user",
                    "parts",
                    vec![json!({"functionResponse": {"name": name, "response": response}})],
                );
            }
            other => {
                return Err(Untranslatable(format!(
                    "messages with role {other:?} cannot be translated"
                )))
            }
        }
    }
    let mut gen = Map::new();
    gen.insert("maxOutputTokens".into(), super::cap(c));
    if let Some(stop) = stop_sequences(body) {
        gen.insert("stopSequences".into(), Value::Array(stop));
    }
    if let Some(t) = body.get("temperature") {
        gen.insert("temperature".into(), t.clone());
    }
    if let Some(p) = body.get("top_p") {
        gen.insert("topP".into(), p.clone());
    }
    if let Some(n) = body.get("n").and_then(Value::as_u64).filter(|n| *n > 1) {
        gen.insert("candidateCount".into(), Value::from(n));
    }
    if body
        .get("response_format")
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        == Some("json_object")
    {
        gen.insert("responseMimeType".into(), Value::from("application/json"));
    }
    let mut out = Map::new();
    out.insert("contents".into(), Value::Array(contents));
    if !system.is_empty() {
        out.insert("systemInstruction".into(), json!({"parts": system}));
    }
    out.insert("generationConfig".into(), Value::Object(gen));
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        if !tools.is_empty() {
            out.insert("tools".into(), translate_tools(tools)?);
        }
    }
    if let Some(tc) = body.get("tool_choice").and_then(tool_config) {
        out.insert("toolConfig".into(), tc);
    }
    Ok(Value::Object(out))
}

/// One candidate's text, tool calls and finish reason.
fn read_candidate(c: &Value, index: usize) -> (String, Vec<Value>, Option<&'static str>) {
    let mut text = String::new();
    let mut calls = Vec::new();
    for (k, p) in c
        .get("content")
        .and_then(|c| c.get("parts"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        if p.get("thought").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        if let Some(t) = p.get("text").and_then(Value::as_str) {
            text.push_str(t);
        }
        if let Some(fc) = p.get("functionCall") {
            let id = fc
                .get("id")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| format!("call_{index}_{k}"));
            calls.push(tool_call(
                &id,
                fc.get("name").and_then(Value::as_str).unwrap_or(""),
                fc.get("args").unwrap_or(&Value::Null),
            ));
        }
    }
    let mut finish = finish_reason(c.get("finishReason").and_then(Value::as_str));
    if finish == Some("stop") && !calls.is_empty() {
        finish = Some("tool_calls");
    }
    (text, calls, finish)
}

fn blocked(v: &Value) -> bool {
    v.get("promptFeedback")
        .and_then(|f| f.get("blockReason"))
        .is_some()
        && v.get("candidates")
            .and_then(Value::as_array)
            .is_none_or(|c| c.is_empty())
}

pub(crate) fn translate_response(body: &[u8], env: &Envelope) -> Result<Bytes, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("not a Gemini response: {e}"))?;
    let usage = v.get("usageMetadata").map(usage_of);
    if blocked(&v) {
        return Ok(completion_body(
            env,
            vec![choice(0, String::new(), Vec::new(), "content_filter")],
            usage,
        ));
    }
    let choices = v
        .get("candidates")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, c)| {
            let index = c
                .get("index")
                .and_then(Value::as_u64)
                .map_or(i, |x| x as usize);
            let (text, calls, finish) = read_candidate(c, index);
            choice(index, text, calls, finish.unwrap_or("stop"))
        })
        .collect();
    Ok(completion_body(env, choices, usage))
}

/// The delay in a Gemini error body and whether a per-day quota is what ran out.
pub fn error_hint(_status: u16, body: &[u8], now_ms: i64) -> ErrorHint {
    let delay = super::retry_after::from_gemini_body(body);
    let per_day = per_day_quota(body);
    let delay_ms = if per_day {
        Some(until_quota_reset(now_ms).max(delay.unwrap_or(0)))
    } else {
        delay
    };
    ErrorHint {
        delay_ms,
        long_outage: per_day,
    }
}

/// `QuotaFailure` violations whose quota id or metric is per day.
fn per_day_quota(body: &[u8]) -> bool {
    if body.is_empty() || !body.windows(6).any(|w| w == b"PerDay") {
        return false;
    }
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    // The OpenAI-compatible endpoint wraps the error in a one-element array.
    let err = v
        .get("error")
        .or_else(|| v.get(0).and_then(|e| e.get("error")));
    err.and_then(|e| e.get("details"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|d| {
            d.get("@type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.ends_with("google.rpc.QuotaFailure"))
        })
        .flat_map(|d| {
            d.get("violations")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
        })
        .any(|viol| {
            ["quotaId", "quotaMetric"].iter().any(|k| {
                viol.get(*k)
                    .and_then(Value::as_str)
                    .is_some_and(|s| s.contains("PerDay"))
            })
        })
}

/// Milliseconds until the next midnight Pacific time.
fn until_quota_reset(now_ms: i64) -> i64 {
    let fallback = 3_600_000;
    let Ok(tz) = jiff::tz::TimeZone::get(QUOTA_TIMEZONE) else {
        return fallback;
    };
    let Ok(now) = jiff::Timestamp::from_millisecond(now_ms) else {
        return fallback;
    };
    let zoned = now.to_zoned(tz);
    let next = zoned
        .date()
        .tomorrow()
        .ok()
        .and_then(|d| d.to_zoned(zoned.time_zone().clone()).ok());
    match next {
        Some(n) => (n.timestamp().as_millisecond() - now_ms).max(1000),
        None => fallback,
    }
}

/// `/models/{model}:generateContent`, or the SSE stream of it.
fn generate_path(model: &str, stream: bool) -> String {
    let model = model.strip_prefix("models/").unwrap_or(model);
    if stream {
        format!("/models/{model}:streamGenerateContent?alt=sse")
    } else {
        format!("/models/{model}:generateContent")
    }
}

impl Provider for Gemini {
    fn error_hint(&self, status: u16, body: &[u8], now_ms: i64) -> ErrorHint {
        error_hint(status, body, now_ms)
    }

    fn supports(&self, endpoint: Endpoint) -> bool {
        endpoint == Endpoint::Chat
    }

    fn auth_headers(&self, key: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        key_header("x-goog-api-key", key)
    }

    fn request(&self, c: &BuildCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        if c.endpoint != Endpoint::Chat {
            return Err(Untranslatable("gemini serves chat completions only".into()));
        }
        let v = translate_request(c)?;
        Ok(NativeRequest {
            url: join(c.base_url, &generate_path(c.model, c.stream)),
            body: serde_json::to_vec(&v).map_err(|e| Untranslatable(e.to_string()))?,
        })
    }

    fn speaks(&self, format: NativeFormat, _backend: &Backend) -> bool {
        format == NativeFormat::GeminiGenerate
    }

    /// The model is in the path; the cap is `generationConfig.maxOutputTokens`; usage comes
    /// on every chunk without asking.
    fn pass_through(&self, c: &PassCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        // The model is in the path.
        let cap = Value::from(c.max_output_tokens);
        c.native(
            &generate_path(c.model, c.stream),
            &[Edit::SetIn("generationConfig", "maxOutputTokens", &cap)],
        )
    }

    fn response(&self, body: &[u8], env: &Envelope) -> Result<Option<Bytes>, String> {
        translate_response(body, env).map(Some)
    }

    fn stream(&self, env: Envelope) -> Option<Translator> {
        Some(Translator::Gemini(Split::new(GenerateStream::new(env))))
    }

    fn error_body(&self, status: u16, body: &[u8]) -> Option<Bytes> {
        // {"error":{"code":400,"message":"...","status":"INVALID_ARGUMENT"}}
        let v: Value = serde_json::from_slice(body).ok()?;
        let e = v.get("error")?;
        let msg = e.get("message").and_then(Value::as_str).unwrap_or("");
        let code = e.get("status").and_then(Value::as_str);
        Some(openai_error(msg, super::error_type_for(status), code))
    }
}

/// Gemini's SSE responses → OpenAI chunks.
#[derive(Debug)]
pub struct GenerateStream {
    w: ChunkWriter,
    usage: Option<NativeUsage>,
    /// Some candidate reported its finish reason (or the prompt was blocked).
    finished: bool,
    failed: bool,
    /// Tool calls emitted so far per candidate (their OpenAI index).
    tool_calls: Vec<usize>,
}

impl GenerateStream {
    pub fn new(env: Envelope) -> Self {
        GenerateStream {
            w: ChunkWriter::new(env),
            usage: None,
            finished: false,
            failed: false,
            tool_calls: Vec::new(),
        }
    }

    fn event(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.failed {
            return;
        }
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        if let Some(e) = v.get("error") {
            let msg = e
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("the provider reported an error mid-stream");
            let kind = e
                .get("status")
                .and_then(Value::as_str)
                .unwrap_or("api_error");
            self.failed = true;
            self.w.error(out, msg, kind);
            return;
        }
        if let Some(u) = v.get("usageMetadata") {
            // Running totals: keep the last.
            self.usage = Some(usage_of(u));
        }
        if blocked(&v) {
            self.finished = true;
            self.w.finish_reason(out, 0, "content_filter");
            return;
        }
        for (i, c) in v
            .get("candidates")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let index = c
                .get("index")
                .and_then(Value::as_u64)
                .map_or(i, |x| x as usize);
            let (text, calls, finish) = read_candidate(c, index);
            self.w.text(out, index, &text);
            if self.tool_calls.len() <= index {
                self.tool_calls.resize(index + 1, 0);
            }
            for call in calls {
                let k = self.tool_calls[index];
                self.tool_calls[index] += 1;
                let mut call = call;
                call["index"] = Value::from(k);
                self.w.delta(out, index, json!({"tool_calls": [call]}));
            }
            if let Some(f) = finish {
                self.finished = true;
                self.w.finish_reason(out, index, f);
            }
        }
    }
}

impl NativeEvents for GenerateStream {
    fn on_event(&mut self, data: &[u8], out: &mut Vec<u8>) {
        self.event(data, out);
    }

    /// Gemini sends no end marker: the stream is complete when a finish reason came; one
    /// that ends without it is cut short, an upstream failure.
    fn on_end(&mut self, out: &mut Vec<u8>) {
        if self.failed {
            return;
        }
        if self.finished {
            self.w.end(out, self.usage);
        } else {
            self.failed = true;
            self.w.cut_short(out);
        }
    }

    fn failed(&self) -> bool {
        self.failed
    }
}
