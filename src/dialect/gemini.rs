//! Gemini in (`/v1beta/models/{alias}:op` and `/v1/…`): `generateContent`,
//! `streamGenerateContent` (SSE with `alt=sse`, else a streamed JSON array), `countTokens`,
//! `embedContent`, `batchEmbedContents`; answers, streams and errors in Gemini's shape.

use super::render::Meta;
use super::{stream_usage, Answer, Event, Inbound, Op, Usage};
use serde_json::{json, Map, Value};

/// A field in either spelling: the REST API takes camelCase and snake_case alike.
fn field<'a>(v: &'a Value, camel: &str, snake: &str) -> Option<&'a Value> {
    v.get(camel).or_else(|| v.get(snake))
}

/// Gemini's request → an OpenAI chat or embeddings body.
pub fn parse(inb: &Inbound, b: Map<String, Value>) -> Result<Map<String, Value>, String> {
    let model = inb.path_model.as_deref().unwrap_or("");
    let model = model.strip_prefix("models/").unwrap_or(model);
    let b = Value::Object(b);
    let mut o = Map::new();
    o.insert("model".into(), json!(model));
    match inb.op {
        Op::Embed => {
            let c = b.get("content").ok_or("`content` is required")?;
            o.insert("input".into(), json!(text_of(c)));
            return Ok(o);
        }
        Op::EmbedBatch => {
            let reqs = b
                .get("requests")
                .and_then(Value::as_array)
                .ok_or("`requests` is required")?;
            let input: Vec<Value> = reqs
                .iter()
                .map(|r| json!(r.get("content").map(text_of).unwrap_or_default()))
                .collect();
            o.insert("input".into(), Value::Array(input));
            return Ok(o);
        }
        _ => {}
    }
    // countTokens may wrap a whole generateContent request.
    let g = field(&b, "generateContentRequest", "generate_content_request").unwrap_or(&b);
    let mut messages = Vec::new();
    if let Some(si) = field(g, "systemInstruction", "system_instruction") {
        messages.push(json!({"role": "system", "content": text_of(si)}));
    }
    for c in g
        .get("contents")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        content(c, &mut messages)?;
    }
    o.insert("messages".into(), Value::Array(messages));
    if let Some(cfg) = field(g, "generationConfig", "generation_config") {
        for (camel, snake, to) in [
            ("maxOutputTokens", "max_output_tokens", "max_tokens"),
            ("temperature", "temperature", "temperature"),
            ("topP", "top_p", "top_p"),
            ("stopSequences", "stop_sequences", "stop"),
            ("candidateCount", "candidate_count", "n"),
        ] {
            if let Some(v) = field(cfg, camel, snake).filter(|v| !v.is_null()) {
                o.insert(to.into(), v.clone());
            }
        }
    }
    let mut tools = Vec::new();
    for t in g
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        for f in field(t, "functionDeclarations", "function_declarations")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            tools.push(json!({"type": "function", "function": {"name": f.get("name"),
                "description": f.get("description"),
                "parameters": f.get("parameters").or_else(|| field(f, "parametersJsonSchema", "parameters_json_schema")).cloned().unwrap_or(json!({"type": "object"}))}}));
        }
    }
    if !tools.is_empty() {
        o.insert("tools".into(), Value::Array(tools));
    }
    if inb.op == Op::Generate && inb.path_stream {
        stream_usage(&mut o);
    }
    Ok(o)
}

/// The joined text of a `Content` (`{parts: [{text}]}`).
fn text_of(c: &Value) -> String {
    c.get("parts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .collect::<Vec<_>>()
        .join("\n")
}

fn content(c: &Value, out: &mut Vec<Value>) -> Result<(), String> {
    let role = match c.get("role").and_then(Value::as_str) {
        Some("model") => "assistant",
        _ => "user",
    };
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    for p in c
        .get("parts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(t) = p.get("text").and_then(Value::as_str) {
            parts.push(json!({"type": "text", "text": t}));
        } else if let Some(d) = field(p, "inlineData", "inline_data") {
            let mt = field(d, "mimeType", "mime_type")
                .and_then(Value::as_str)
                .unwrap_or("");
            let data = d.get("data").and_then(Value::as_str).unwrap_or("");
            parts.push(
                json!({"type": "image_url", "image_url": {"url": format!("data:{mt};base64,{data}")}}),
            );
        } else if let Some(f) = field(p, "functionCall", "function_call") {
            let name = f.get("name").and_then(Value::as_str).unwrap_or("");
            calls.push(json!({"id": f.get("id").and_then(Value::as_str).unwrap_or(name), "type": "function",
                "function": {"name": name, "arguments": f.get("args").unwrap_or(&json!({})).to_string()}}));
        } else if let Some(f) = field(p, "functionResponse", "function_response") {
            let name = f.get("name").and_then(Value::as_str).unwrap_or("");
            out.push(json!({"role": "tool", "tool_call_id": f.get("id").and_then(Value::as_str).unwrap_or(name),
                "content": f.get("response").unwrap_or(&Value::Null).to_string()}));
        } else if p.get("thought").is_some() || p.get("thoughtSignature").is_some() {
        } else {
            return Err("a part of a type tollgate cannot translate (file data, code)".into());
        }
    }
    super::push_chat_message(out, role, parts, calls);
    Ok(())
}

fn finish_reason(f: &str) -> &'static str {
    match f {
        "length" => "MAX_TOKENS",
        "content_filter" => "SAFETY",
        _ => "STOP",
    }
}

fn usage_json(u: Usage) -> Value {
    let mut v = json!({"promptTokenCount": u.input, "candidatesTokenCount": u.output,
                       "totalTokenCount": u.input + u.output});
    if let Some(c) = u.cached {
        v["cachedContentTokenCount"] = json!(c);
    }
    v
}

fn chunk(m: &Meta, parts: Vec<Value>, finish: Option<&str>, usage: Option<Usage>) -> Value {
    let mut cand = json!({"content": {"role": "model", "parts": parts}, "index": 0});
    if let Some(f) = finish {
        cand["finishReason"] = json!(finish_reason(f));
    }
    let mut v = json!({"candidates": [cand], "modelVersion": m.model, "responseId": m.id});
    if let Some(u) = usage {
        v["usageMetadata"] = usage_json(u);
    }
    v
}

/// A buffered answer: `GenerateContentResponse`, or an embedding.
pub fn answer(inb: &Inbound, m: &Meta, a: &Answer) -> Value {
    match inb.op {
        Op::Embed => {
            json!({"embedding": {"values": a.embeddings.first().cloned().unwrap_or(json!([]))}})
        }
        Op::EmbedBatch => {
            json!({"embeddings": a.embeddings.iter().map(|e| json!({"values": e})).collect::<Vec<_>>()})
        }
        _ => {
            let mut parts = Vec::new();
            if !a.text.is_empty() || a.tool_calls.is_empty() {
                parts.push(json!({"text": a.text}));
            }
            for t in &a.tool_calls {
                let args: Value = serde_json::from_str(&t.arguments).unwrap_or_else(|_| json!({}));
                parts.push(json!({"functionCall": {"name": t.name, "args": args}}));
            }
            let u = a.usage.unwrap_or(Usage {
                input: m.input_estimate,
                ..Usage::default()
            });
            chunk(m, parts, Some(&a.finish), Some(u))
        }
    }
}

/// The aliases as a `ListModelsResponse`.
pub fn list(aliases: &[&str]) -> Value {
    let models: Vec<Value> = aliases
        .iter()
        .map(|a| json!({"name": format!("models/{a}"), "displayName": a, "description": "a tollgate route",
            "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens", "embedContent", "batchEmbedContents"]}))
        .collect();
    json!({"models": models})
}

/// Gemini's error body; a delay is also a `google.rpc.RetryInfo` detail.
pub fn error(status: u16, message: &str, retry_after: Option<u64>) -> Value {
    let st = match status {
        400 | 413 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        405 => "UNIMPLEMENTED",
        429 => "RESOURCE_EXHAUSTED",
        503 => "UNAVAILABLE",
        _ => "INTERNAL",
    };
    let mut details = Vec::new();
    if let Some(s) = retry_after {
        details.push(json!({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": format!("{s}s")}));
    }
    json!({"error": {"code": status, "message": message, "status": st, "details": details}})
}

/// Renders internal events as `GenerateContentResponse` chunks (SSE or a JSON array).
#[derive(Debug)]
pub struct Stream {
    meta: Meta,
    sse: bool,
    /// Chunks written so far (the array's separators).
    written: usize,
    finish: Option<String>,
    usage: Option<Usage>,
    /// Tool calls being assembled: (name, arguments so far).
    tools: Vec<(String, String)>,
    closed: bool,
}

impl Stream {
    pub fn new(meta: Meta, sse: bool) -> Self {
        Stream {
            meta,
            sse,
            written: 0,
            finish: None,
            usage: None,
            tools: Vec::new(),
            closed: false,
        }
    }

    pub fn sse(&self) -> bool {
        self.sse
    }

    fn write(&mut self, out: &mut Vec<u8>, v: &Value) {
        if self.sse {
            out.extend_from_slice(b"data: ");
        } else {
            let sep: &[u8] = if self.written == 0 { b"[" } else { b",\r\n" };
            out.extend_from_slice(sep);
        }
        let _ = serde_json::to_writer(&mut *out, v);
        if self.sse {
            out.extend_from_slice(b"\r\n\r\n");
        }
        self.written += 1;
    }

    pub fn on(&mut self, ev: Event<'_>, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        match ev {
            Event::Text(t) => {
                let c = chunk(&self.meta, vec![json!({"text": t})], None, None);
                self.write(out, &c);
            }
            Event::ToolStart { name, .. } => self.tools.push((name.to_string(), String::new())),
            Event::ToolArgs { args, .. } => {
                if let Some(t) = self.tools.last_mut() {
                    t.1.push_str(args);
                }
            }
            Event::Finish(r) => self.finish = Some(r.to_string()),
            Event::Usage(u) => self.usage = Some(u),
            Event::Error(m) => {
                let e = error(500, m, None);
                self.write(out, &e);
                self.close(out);
            }
            Event::Done => self.end(out),
        }
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        self.closed = true;
        if !self.sse {
            let end: &[u8] = if self.written == 0 { b"[]" } else { b"]" };
            out.extend_from_slice(end);
        }
    }

    pub fn end(&mut self, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        // Gemini sends a function call whole, in one part: it is assembled from the deltas.
        let parts: Vec<Value> = std::mem::take(&mut self.tools)
            .into_iter()
            .map(|(name, args)| {
                let args: Value = serde_json::from_str(&args).unwrap_or_else(|_| json!({}));
                json!({"functionCall": {"name": name, "args": args}})
            })
            .collect();
        let parts = if parts.is_empty() {
            vec![json!({"text": ""})]
        } else {
            parts
        };
        let u = self.usage.unwrap_or(Usage {
            input: self.meta.input_estimate,
            ..Usage::default()
        });
        let f = self.finish.clone().unwrap_or_else(|| "stop".into());
        let c = chunk(&self.meta, parts, Some(&f), Some(u));
        self.write(out, &c);
        self.close(out);
    }
}
