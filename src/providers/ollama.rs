//! Ollama's own API (`POST /api/chat`, NDJSON streaming).
//!
//! Ollama streams by default and generates without limit by default: `stream` is always
//! set explicitly and `options.num_predict` is always the reserved cap. Usage arrives only on
//! the final `"done": true` object (`prompt_eval_count` / `eval_count`, omitted when zero).
//! Overload is a 503 "server busy" without Retry-After (a backend failure); a missing model is
//! a 404 (passed to the client, not retried).

use super::splice::Edit;
use super::{
    choice, completion_body, content_parts, join, openai_error, parse_arguments, stop_sequences,
    tool_call, BuildCtx, ChunkWriter, Envelope, NativeEvents, NativeRequest, NativeUsage, Part,
    Provider, Split, Translator, Untranslatable,
};
use super::{NativeFormat, PassCtx};
use crate::estimate::Endpoint;
use crate::policy::Backend;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use serde_json::{json, Map, Value};

#[derive(Debug, Clone, Copy)]
pub struct Ollama;

fn finish_reason(done_reason: Option<&str>, tool_calls: bool) -> &'static str {
    if tool_calls {
        return "tool_calls";
    }
    match done_reason {
        Some("length") => "length",
        _ => "stop",
    }
}

fn usage_of(v: &Value) -> NativeUsage {
    let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    NativeUsage {
        prompt: n("prompt_eval_count"),
        completion: n("eval_count"),
        cached: None,
        cache_write: None,
        reasoning: None,
    }
}

fn message_of(m: &Value) -> Result<Value, Untranslatable> {
    let role = m.get("role").and_then(Value::as_str).unwrap_or("");
    let role = match role {
        "developer" => "system",
        "system" | "user" | "assistant" | "tool" => role,
        other => {
            return Err(Untranslatable(format!(
                "messages with role {other:?} cannot be translated"
            )))
        }
    };
    let mut text = String::new();
    let mut images = Vec::new();
    for p in content_parts(m.get("content"))? {
        match p {
            Part::Text(t) => {
                if !text.is_empty() && !t.is_empty() {
                    text.push('\n');
                }
                text.push_str(t);
            }
            Part::InlineImage { data, .. } => images.push(Value::from(data)),
            Part::UrlImage(_) => {
                return Err(Untranslatable(
                    "ollama takes images inline only (send a data: URI)".into(),
                ))
            }
        }
    }
    let mut out = json!({"role": role, "content": text});
    if !images.is_empty() {
        out["images"] = Value::Array(images);
    }
    if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
        let calls = calls
            .iter()
            .map(|tc| {
                let f = tc.get("function");
                Ok(json!({"function": {
                    "name": f.and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or(""),
                    "arguments": parse_arguments(f.and_then(|f| f.get("arguments")))?,
                }}))
            })
            .collect::<Result<Vec<_>, Untranslatable>>()?;
        out["tool_calls"] = Value::Array(calls);
    }
    Ok(out)
}

pub(crate) fn translate_request(c: &BuildCtx<'_>) -> Result<Value, Untranslatable> {
    let body = c.body.map()?;
    if body.get("n").and_then(Value::as_u64).unwrap_or(1) > 1 {
        return Err(Untranslatable("ollama does not support n > 1".into()));
    }
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| Untranslatable("messages must be an array".into()))?
        .iter()
        .map(message_of)
        .collect::<Result<Vec<_>, _>>()?;
    let mut options = Map::new();
    options.insert("num_predict".into(), super::cap(c));
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("seed", "seed"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    ] {
        if let Some(v) = body.get(from) {
            options.insert(to.into(), v.clone());
        }
    }
    if let Some(stop) = stop_sequences(body) {
        options.insert("stop".into(), Value::Array(stop));
    }
    let mut out = Map::new();
    out.insert("model".into(), Value::from(c.model));
    out.insert("messages".into(), Value::Array(messages));
    out.insert("stream".into(), Value::Bool(c.stream));
    out.insert("options".into(), Value::Object(options));
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        if !tools.is_empty() {
            out.insert("tools".into(), Value::Array(tools.clone()));
        }
    }
    if body
        .get("response_format")
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        == Some("json_object")
    {
        out.insert("format".into(), Value::from("json"));
    }
    Ok(Value::Object(out))
}

fn tool_calls_of(msg: Option<&Value>, first_index: usize) -> Vec<Value> {
    msg.and_then(|m| m.get("tool_calls"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(k, tc)| {
            let f = tc.get("function");
            tool_call(
                &format!("call_{}", first_index + k),
                f.and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .unwrap_or(""),
                f.and_then(|f| f.get("arguments")).unwrap_or(&Value::Null),
            )
        })
        .collect()
}

pub(crate) fn translate_response(body: &[u8], env: &Envelope) -> Result<Bytes, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("not an Ollama chat response: {e}"))?;
    let msg = v.get("message");
    // `/api/generate` answers carry the text in `response`.
    let text = msg
        .and_then(|m| m.get("content"))
        .or_else(|| v.get("response"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let calls = tool_calls_of(msg, 0);
    let finish = finish_reason(
        v.get("done_reason").and_then(Value::as_str),
        !calls.is_empty(),
    );
    let usage = (v.get("done").and_then(Value::as_bool) == Some(true)).then(|| usage_of(&v));
    Ok(completion_body(
        env,
        vec![choice(0, text, calls, finish)],
        usage,
    ))
}

/// OpenAI `/v1/embeddings` → Ollama `/api/embed` (`input`: a string or strings).
pub(crate) fn translate_embed_request(c: &BuildCtx<'_>) -> Result<Value, Untranslatable> {
    let body = c.body.map()?;
    let input = match body.get("input") {
        Some(v @ Value::String(_)) => v.clone(),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => Value::Array(a.clone()),
        _ => {
            return Err(Untranslatable(
                "ollama embeds text only (input as a string or an array of strings)".into(),
            ))
        }
    };
    let mut out = Map::new();
    out.insert("model".into(), Value::from(c.model));
    out.insert("input".into(), input);
    if let Some(d) = body.get("dimensions") {
        out.insert("dimensions".into(), d.clone());
    }
    Ok(Value::Object(out))
}

/// `{"embeddings": [[..]], "prompt_eval_count": N}` → OpenAI's embedding list.
pub(crate) fn translate_embed_response(body: &[u8], env: &Envelope) -> Result<Bytes, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("not an Ollama embed response: {e}"))?;
    let data: Vec<Value> = v
        .get("embeddings")
        .and_then(Value::as_array)
        .ok_or("an Ollama embed response without embeddings")?
        .iter()
        .enumerate()
        .map(|(i, e)| json!({"object": "embedding", "index": i, "embedding": e}))
        .collect();
    let prompt = v
        .get("prompt_eval_count")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Ok(Bytes::from(
        json!({
            "object": "list",
            "data": data,
            "model": env.model,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        })
        .to_string(),
    ))
}

impl Provider for Ollama {
    fn supports(&self, endpoint: Endpoint) -> bool {
        matches!(endpoint, Endpoint::Chat | Endpoint::Embeddings)
    }

    fn auth_headers(&self, key: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        // Ollama itself has no auth; a key is for a proxy in front of it.
        super::openai::OpenAi.auth_headers(key)
    }

    fn request(&self, c: &BuildCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        match c.endpoint {
            Endpoint::Chat => {}
            Endpoint::Embeddings => {
                return Ok(NativeRequest {
                    url: join(c.base_url, "/api/embed"),
                    body: serde_json::to_vec(&translate_embed_request(c)?)
                        .map_err(|e| Untranslatable(e.to_string()))?,
                })
            }
            Endpoint::Completions => {
                return Err(Untranslatable(
                    "ollama's native API serves chat and embeddings; use kind: openai for /v1/completions".into(),
                ))
            }
        }
        let v = translate_request(c)?;
        Ok(NativeRequest {
            url: join(c.base_url, "/api/chat"),
            body: serde_json::to_vec(&v).map_err(|e| Untranslatable(e.to_string()))?,
        })
    }

    fn speaks(&self, format: NativeFormat, _backend: &Backend) -> bool {
        matches!(
            format,
            NativeFormat::OllamaChat | NativeFormat::OllamaGenerate | NativeFormat::OllamaEmbed
        )
    }

    /// The cap is `options.num_predict`; `stream` stays as the client sent it (Ollama
    /// streams when it is absent, and so does the sidecar); usage is on the `done` line.
    fn pass_through(&self, c: &PassCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        let (model, cap) = (Value::from(c.model), Value::from(c.max_output_tokens));
        let path = match c.format {
            NativeFormat::OllamaChat => "/api/chat",
            NativeFormat::OllamaGenerate => "/api/generate",
            NativeFormat::OllamaEmbed => {
                return c.native("/api/embed", &[Edit::Set("model", &model)])
            }
            other => return Err(Untranslatable(format!("ollama does not speak {other:?}"))),
        };
        c.native(
            path,
            &[
                Edit::Set("model", &model),
                Edit::SetIn("options", "num_predict", &cap),
            ],
        )
    }

    fn response(&self, body: &[u8], env: &Envelope) -> Result<Option<Bytes>, String> {
        match env.endpoint {
            Endpoint::Embeddings => translate_embed_response(body, env).map(Some),
            _ => translate_response(body, env).map(Some),
        }
    }

    fn stream(&self, env: Envelope) -> Option<Translator> {
        Some(Translator::Ollama(Split::new(ChatStream::new(env))))
    }

    fn error_body(&self, status: u16, body: &[u8]) -> Option<Bytes> {
        // {"error":"model 'x' not found"}
        let v: Value = serde_json::from_slice(body).ok()?;
        let msg = v.get("error")?.as_str()?;
        let code = (status == 404).then_some("model_not_found");
        Some(openai_error(msg, super::error_type_for(status), code))
    }
}

/// Ollama's NDJSON lines → OpenAI chunks.
#[derive(Debug)]
pub struct ChatStream {
    w: ChunkWriter,
    tool_calls: usize,
    done: bool,
    failed: bool,
}

impl ChatStream {
    pub fn new(env: Envelope) -> Self {
        ChatStream {
            w: ChunkWriter::new(env),
            tool_calls: 0,
            done: false,
            failed: false,
        }
    }

    fn on_line(&mut self, line: &[u8], out: &mut Vec<u8>) {
        if self.done || self.failed || line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        let Ok(v) = serde_json::from_slice::<Value>(line) else {
            return;
        };
        if let Some(e) = v.get("error") {
            let msg = e
                .as_str()
                .unwrap_or("the provider reported an error mid-stream");
            self.failed = true;
            self.w.error(out, msg, "api_error");
            return;
        }
        let msg = v.get("message");
        let text = msg
            .and_then(|m| m.get("content"))
            .or_else(|| v.get("response"));
        if let Some(t) = text.and_then(Value::as_str) {
            self.w.text(out, 0, t);
        }
        for mut call in tool_calls_of(msg, self.tool_calls) {
            call["index"] = Value::from(self.tool_calls);
            self.tool_calls += 1;
            self.w.delta(out, 0, json!({"tool_calls": [call]}));
        }
        if v.get("done").and_then(Value::as_bool) == Some(true) {
            self.done = true;
            let reason = finish_reason(
                v.get("done_reason").and_then(Value::as_str),
                self.tool_calls > 0,
            );
            self.w.finish_reason(out, 0, reason);
            self.w.end(out, Some(usage_of(&v)));
        }
    }
}

impl NativeEvents for ChatStream {
    fn on_event(&mut self, line: &[u8], out: &mut Vec<u8>) {
        self.on_line(line, out);
    }

    /// A stream that ends before its `"done": true` line is cut short: an upstream failure.
    fn on_end(&mut self, out: &mut Vec<u8>) {
        if !self.done && !self.failed {
            self.failed = true;
            self.w.cut_short(out);
        }
    }

    fn failed(&self) -> bool {
        self.failed
    }
}
