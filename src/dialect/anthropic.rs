//! Anthropic Messages in (`/v1/messages`, `/v1/messages/count_tokens`): the request into the
//! internal chat form, the answer, the stream (`message_start` … `message_stop`) and errors
//! back in Anthropic's shape.

use super::render::Meta;
use super::{copy, stream_usage, Answer, Event, Inbound, Op, Usage};
use serde_json::{json, Map, Value};

/// Anthropic's request → an OpenAI chat body.
pub fn parse(inb: &Inbound, b: Map<String, Value>) -> Result<Map<String, Value>, String> {
    let mut o = Map::new();
    copy(&b, "model", &mut o, "model");
    let mut messages = Vec::new();
    match b.get("system") {
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            let text = blocks
                .iter()
                .filter_map(|x| x.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n");
            messages.push(json!({"role": "system", "content": text}));
        }
        _ => {}
    }
    let turns = b
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("`messages` is required and must be an array")?;
    for t in turns {
        let role = t.get("role").and_then(Value::as_str).unwrap_or("user");
        message(role, t.get("content"), &mut messages)?;
    }
    o.insert("messages".into(), Value::Array(messages));
    if inb.op == Op::Generate {
        copy(&b, "max_tokens", &mut o, "max_tokens");
    }
    copy(&b, "temperature", &mut o, "temperature");
    copy(&b, "top_p", &mut o, "top_p");
    copy(&b, "stop_sequences", &mut o, "stop");
    if let Some(tools) = b.get("tools").and_then(Value::as_array) {
        let t: Vec<Value> = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                "name": t.get("name").cloned().unwrap_or(Value::Null),
                "description": t.get("description").cloned().unwrap_or(Value::Null),
                "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))}})
            })
            .collect();
        o.insert("tools".into(), Value::Array(t));
    }
    if let Some(tc) = b.get("tool_choice") {
        let c = match tc.get("type").and_then(Value::as_str) {
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => json!({"type": "function", "function": {"name": tc.get("name")}}),
            _ => json!("auto"),
        };
        o.insert("tool_choice".into(), c);
    }
    if inb.op == Op::Generate && b.get("stream").and_then(Value::as_bool) == Some(true) {
        stream_usage(&mut o);
    }
    Ok(o)
}

/// One Anthropic turn → OpenAI messages (tool results become `tool` messages).
fn message(role: &str, content: Option<&Value>, out: &mut Vec<Value>) -> Result<(), String> {
    let blocks = match content {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(a)) => a,
        _ => return Err("a message's `content` must be a string or an array of blocks".into()),
    };
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    for bl in blocks {
        match bl.get("type").and_then(Value::as_str) {
            Some("text") => parts.push(json!({"type": "text", "text": bl.get("text")})),
            Some("image") => {
                let s = bl.get("source").cloned().unwrap_or(Value::Null);
                let url = match s.get("type").and_then(Value::as_str) {
                    Some("base64") => format!(
                        "data:{};base64,{}",
                        s.get("media_type").and_then(Value::as_str).unwrap_or(""),
                        s.get("data").and_then(Value::as_str).unwrap_or("")
                    ),
                    _ => s.get("url").and_then(Value::as_str).unwrap_or("").into(),
                };
                parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            Some("tool_use") => calls.push(json!({"id": bl.get("id"), "type": "function",
                "function": {"name": bl.get("name"),
                "arguments": bl.get("input").unwrap_or(&json!({})).to_string()}})),
            Some("tool_result") => {
                let text = match bl.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    c => crate::providers::content_text(c),
                };
                out.push(
                    json!({"role": "tool", "tool_call_id": bl.get("tool_use_id"), "content": text}),
                );
            }
            // Thinking blocks of earlier turns carry no billable input the estimate needs.
            Some("thinking" | "redacted_thinking") => {}
            other => {
                return Err(format!(
                    "content blocks of type {other:?} are not supported"
                ))
            }
        }
    }
    super::push_chat_message(out, role, parts, calls);
    Ok(())
}

fn stop_reason(finish: &str) -> &'static str {
    match finish {
        "length" => "max_tokens",
        "tool_calls" | "function_call" => "tool_use",
        _ => "end_turn",
    }
}

fn usage_json(u: Usage) -> Value {
    let mut v = json!({"input_tokens": u.input, "output_tokens": u.output});
    if let Some(c) = u.cached {
        // Anthropic's input excludes cache reads; the internal input includes them.
        v["input_tokens"] = json!(u.input.saturating_sub(c));
        v["cache_read_input_tokens"] = json!(c);
    }
    v
}

/// A buffered Anthropic message.
pub fn answer(m: &Meta, a: &Answer) -> Value {
    let mut content = Vec::new();
    if !a.text.is_empty() || a.tool_calls.is_empty() {
        content.push(json!({"type": "text", "text": a.text}));
    }
    for t in &a.tool_calls {
        let input: Value = serde_json::from_str(&t.arguments).unwrap_or_else(|_| json!({}));
        content.push(json!({"type": "tool_use", "id": t.id, "name": t.name, "input": input}));
    }
    let u = a.usage.unwrap_or(Usage {
        input: m.input_estimate,
        ..Usage::default()
    });
    json!({"id": format!("msg_{}", m.id), "type": "message", "role": "assistant",
           "model": m.model, "content": content, "stop_reason": stop_reason(&a.finish),
           "stop_sequence": null, "usage": usage_json(u)})
}

/// Anthropic's error body (`tollgate` is added beside `error` by the caller).
pub fn error(status: u16, message: &str) -> Value {
    let ty = match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": ty, "message": message}})
}

/// Renders internal events as Anthropic's event sequence.
#[derive(Debug)]
pub struct Stream {
    meta: Meta,
    started: bool,
    /// Index of the open content block, if one is open.
    open: Option<usize>,
    /// The open block is a text block.
    text_open: bool,
    next: usize,
    finish: Option<String>,
    usage: Option<Usage>,
    closed: bool,
}

fn event(out: &mut Vec<u8>, name: &str, v: &Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    let _ = serde_json::to_writer(&mut *out, v);
    out.extend_from_slice(b"\n\n");
}

impl Stream {
    pub fn new(meta: Meta) -> Self {
        Stream {
            meta,
            started: false,
            open: None,
            text_open: false,
            next: 0,
            finish: None,
            usage: None,
            closed: false,
        }
    }

    fn start(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        let msg = json!({"id": format!("msg_{}", self.meta.id), "type": "message", "role": "assistant",
            "model": self.meta.model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.meta.input_estimate, "output_tokens": 0}});
        event(
            out,
            "message_start",
            &json!({"type": "message_start", "message": msg}),
        );
    }

    fn close_block(&mut self, out: &mut Vec<u8>) {
        if let Some(i) = self.open.take() {
            event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": i}),
            );
        }
    }

    fn open_block(&mut self, out: &mut Vec<u8>, block: Value) -> usize {
        self.close_block(out);
        let i = self.next;
        self.next += 1;
        self.open = Some(i);
        event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": i, "content_block": block}),
        );
        i
    }

    pub fn on(&mut self, ev: Event<'_>, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        self.start(out);
        match ev {
            Event::Text(t) => {
                let i = match self.open {
                    Some(i) if self.text_open => i,
                    _ => {
                        let i = self.open_block(out, json!({"type": "text", "text": ""}));
                        self.text_open = true;
                        i
                    }
                };
                event(
                    out,
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": i,
                            "delta": {"type": "text_delta", "text": t}}),
                );
            }
            Event::ToolStart { id, name, .. } => {
                self.text_open = false;
                self.open_block(
                    out,
                    json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                );
            }
            Event::ToolArgs { args, .. } => {
                if let Some(i) = self.open.filter(|_| !self.text_open) {
                    event(
                        out,
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "index": i,
                                "delta": {"type": "input_json_delta", "partial_json": args}}),
                    );
                }
            }
            Event::Finish(r) => self.finish = Some(r.to_string()),
            Event::Usage(u) => self.usage = Some(u),
            Event::Error(m) => {
                self.closed = true;
                event(
                    out,
                    "error",
                    &json!({"type": "error", "error": {"type": "api_error", "message": m}}),
                );
            }
            Event::Done => self.end(out),
        }
    }

    pub fn end(&mut self, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        self.start(out);
        self.closed = true;
        self.close_block(out);
        let u = self.usage.unwrap_or(Usage {
            input: self.meta.input_estimate,
            ..Usage::default()
        });
        let reason = stop_reason(self.finish.as_deref().unwrap_or("stop"));
        event(
            out,
            "message_delta",
            &json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": null},
                    "usage": usage_json(u)}),
        );
        event(out, "message_stop", &json!({"type": "message_stop"}));
    }
}
