//! Ollama in (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, and the local
//! `/api/tags`, `/api/version`, `/api/show`): streamed NDJSON unless `"stream": false`, as
//! Ollama does, with `prompt_eval_count` / `eval_count` on the `done` line.

use super::render::Meta;
use super::{stream_usage, strings, Answer, Event, Inbound, Op, Usage};
use serde_json::{json, Map, Value};

/// The version `/api/version` reports: an Ollama API level clients accept.
pub const VERSION: &str = "0.6.0";

/// Ollama's request → an OpenAI chat or embeddings body.
pub fn parse(inb: &Inbound, b: Map<String, Value>) -> Result<Map<String, Value>, String> {
    let mut o = Map::new();
    o.insert(
        "model".into(),
        b.get("model").cloned().ok_or("`model` is required")?,
    );
    match inb.op {
        Op::Embed => {
            o.insert(
                "input".into(),
                b.get("prompt").cloned().unwrap_or(json!("")),
            );
            return Ok(o);
        }
        Op::EmbedBatch => {
            o.insert("input".into(), b.get("input").cloned().unwrap_or(json!("")));
            return Ok(o);
        }
        Op::Show | Op::Count | Op::List | Op::Version => return Ok(o),
        Op::Generate | Op::OllamaGenerate => {}
    }
    let mut messages = Vec::new();
    if inb.op == Op::OllamaGenerate {
        if let Some(s) = b.get("system").and_then(Value::as_str) {
            messages.push(json!({"role": "system", "content": s}));
        }
        let prompt = b.get("prompt").and_then(Value::as_str).unwrap_or("");
        messages.push(user(prompt, b.get("images")));
    } else {
        for m in b
            .get("messages")
            .and_then(Value::as_array)
            .ok_or("`messages` is required and must be an array")?
        {
            let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
            let text = m.get("content").and_then(Value::as_str).unwrap_or("");
            let mut msg = if role == "user" {
                user(text, m.get("images"))
            } else {
                json!({"role": role, "content": text})
            };
            if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
                let c: Vec<Value> = calls.iter().enumerate().map(|(i, c)| {
                    json!({"id": format!("call_{i}"), "type": "function", "function": {
                        "name": c.pointer("/function/name"),
                        "arguments": c.pointer("/function/arguments").unwrap_or(&json!({})).to_string()}})
                }).collect();
                msg["tool_calls"] = Value::Array(c);
            }
            if role == "tool" {
                msg["tool_call_id"] = m.get("tool_name").cloned().unwrap_or(json!("call_0"));
            }
            messages.push(msg);
        }
    }
    o.insert("messages".into(), Value::Array(messages));
    if let Some(opts) = b.get("options").and_then(Value::as_object) {
        for (from, to) in [
            ("num_predict", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
        ] {
            // num_predict -1 (or -2) means unlimited: no client cap.
            if let Some(v) = opts.get(from).filter(|v| v.as_i64().is_none_or(|n| n >= 0)) {
                o.insert(to.into(), v.clone());
            }
        }
        let stop = strings(opts.get("stop"));
        if !stop.is_empty() {
            o.insert("stop".into(), Value::Array(stop));
        }
    }
    if let Some(t) = b.get("tools").filter(|t| t.is_array()) {
        o.insert("tools".into(), t.clone());
    }
    if b.get("stream").and_then(Value::as_bool) != Some(false) {
        stream_usage(&mut o);
    }
    Ok(o)
}

/// A user message with Ollama's base64 `images` as data-URI parts.
fn user(text: &str, images: Option<&Value>) -> Value {
    let imgs: Vec<Value> = images
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|d| json!({"type": "image_url", "image_url": {"url": format!("data:{};base64,{d}", sniff(d))}}))
        .collect();
    if imgs.is_empty() {
        return json!({"role": "user", "content": text});
    }
    let mut parts = vec![json!({"type": "text", "text": text})];
    parts.extend(imgs);
    json!({"role": "user", "content": parts})
}

/// The media type of base64 image data, from its first bytes.
fn sniff(b64: &str) -> &'static str {
    match b64.get(..4) {
        Some("/9j/") => "image/jpeg",
        Some("R0lG") => "image/gif",
        Some("UklG") => "image/webp",
        _ => "image/png",
    }
}

fn done_reason(f: &str) -> &'static str {
    match f {
        "length" => "length",
        _ => "stop",
    }
}

fn now() -> String {
    jiff::Timestamp::now().to_string()
}

fn message(text: &str, calls: Vec<Value>) -> Value {
    let mut m = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    m
}

fn line(m: &Meta, generate: bool, text: &str, calls: Vec<Value>) -> Value {
    let mut v = json!({"model": m.model, "created_at": now(), "done": false});
    if generate {
        v["response"] = json!(text);
    } else {
        v["message"] = message(text, calls);
    }
    v
}

fn done(v: &mut Value, finish: &str, u: Usage) {
    v["done"] = json!(true);
    v["done_reason"] = json!(done_reason(finish));
    v["prompt_eval_count"] = json!(u.input);
    v["eval_count"] = json!(u.output);
    v["total_duration"] = json!(0);
}

/// A buffered answer (`"stream": false`), or an embedding.
pub fn answer(inb: &Inbound, m: &Meta, a: &Answer) -> Value {
    let u = a.usage.unwrap_or(Usage {
        input: m.input_estimate,
        ..Usage::default()
    });
    match inb.op {
        Op::Embed => json!({"embedding": a.embeddings.first().cloned().unwrap_or(json!([]))}),
        Op::EmbedBatch => {
            json!({"model": m.model, "embeddings": a.embeddings, "prompt_eval_count": u.input})
        }
        _ => {
            let calls = a
                .tool_calls
                .iter()
                .map(|t| {
                    let args: Value =
                        serde_json::from_str(&t.arguments).unwrap_or_else(|_| json!({}));
                    json!({"function": {"name": t.name, "arguments": args}})
                })
                .collect();
            let mut v = line(m, inb.op == Op::OllamaGenerate, &a.text, calls);
            done(&mut v, &a.finish, u);
            v
        }
    }
}

/// The aliases as `/api/tags` lists models.
pub fn tags(aliases: &[&str]) -> Value {
    let models: Vec<Value> = aliases
        .iter()
        .map(|a| {
            json!({"name": a, "model": a, "modified_at": "1970-01-01T00:00:00Z", "size": 0,
            "digest": "", "details": {"format": "", "family": "tollgate", "families": null,
            "parameter_size": "", "quantization_level": ""}})
        })
        .collect();
    json!({"models": models})
}

/// `/api/show` for an alias.
pub fn show(alias: &str) -> Value {
    json!({"modelfile": "", "parameters": "", "template": "", "modified_at": "1970-01-01T00:00:00Z",
           "details": {"format": "", "family": "tollgate", "families": null, "parameter_size": "",
                       "quantization_level": ""},
           "model_info": {"general.basename": alias}, "capabilities": ["completion", "tools"]})
}

/// Renders internal events as NDJSON lines.
#[derive(Debug)]
pub struct Stream {
    meta: Meta,
    generate: bool,
    finish: Option<String>,
    usage: Option<Usage>,
    tools: Vec<(String, String)>,
    closed: bool,
}

impl Stream {
    pub fn new(meta: Meta, generate: bool) -> Self {
        Stream {
            meta,
            generate,
            finish: None,
            usage: None,
            tools: Vec::new(),
            closed: false,
        }
    }

    fn write(out: &mut Vec<u8>, v: &Value) {
        let _ = serde_json::to_writer(&mut *out, v);
        out.push(b'\n');
    }

    pub fn on(&mut self, ev: Event<'_>, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        match ev {
            Event::Text(t) => Self::write(out, &line(&self.meta, self.generate, t, Vec::new())),
            Event::ToolStart { name, .. } => self.tools.push((name.to_string(), String::new())),
            Event::ToolArgs { args, .. } => {
                if let Some(t) = self.tools.last_mut() {
                    t.1.push_str(args);
                }
            }
            Event::Finish(r) => self.finish = Some(r.to_string()),
            Event::Usage(u) => self.usage = Some(u),
            Event::Error(m) => {
                self.closed = true;
                Self::write(out, &json!({"error": m}));
            }
            Event::Done => self.end(out),
        }
    }

    pub fn end(&mut self, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        self.closed = true;
        let calls: Vec<Value> = std::mem::take(&mut self.tools)
            .into_iter()
            .map(|(name, args)| {
                let args: Value = serde_json::from_str(&args).unwrap_or_else(|_| json!({}));
                json!({"function": {"name": name, "arguments": args}})
            })
            .collect();
        let mut v = line(&self.meta, self.generate, "", calls);
        let u = self.usage.unwrap_or(Usage {
            input: self.meta.input_estimate,
            ..Usage::default()
        });
        done(&mut v, self.finish.as_deref().unwrap_or("stop"), u);
        Self::write(out, &v);
    }
}
