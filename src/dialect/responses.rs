//! OpenAI Responses in (`POST /v1/responses`): `input` (a string or items), `instructions`,
//! `max_output_tokens`, tools and images into the internal chat form; the answer as a
//! `response` object, the stream as `response.created` … `response.completed` with usage.
//! Stateful features (`previous_response_id`, `store`, `background`) need a backend that
//! keeps state: no translated entry can serve them.

use super::render::Meta;
use super::{copy, stream_usage, Answer, Event, Usage};
use serde_json::{json, Map, Value};

/// Why a request needs a Responses backend (stored state), if it does.
pub fn stateful(b: &Map<String, Value>) -> Option<&'static str> {
    if b.get("previous_response_id").is_some_and(|v| !v.is_null()) {
        Some("previous_response_id needs a backend that keeps Responses state")
    } else if b.get("background").and_then(Value::as_bool) == Some(true) {
        Some("background mode needs a backend that keeps Responses state")
    } else if b.get("store").and_then(Value::as_bool) == Some(true) {
        Some("store: true needs a backend that keeps Responses state")
    } else {
        None
    }
}

/// The Responses request → an OpenAI chat body. Stateful fields are kept (the caller makes
/// every translated entry ineligible when they are set; see [`stateful`]).
pub fn parse(b: Map<String, Value>) -> Result<Map<String, Value>, String> {
    let mut o = Map::new();
    copy(&b, "model", &mut o, "model");
    if stateful(&b).is_some() {
        // Kept so the entry check sees them; such a request never goes to a translated entry.
        for k in ["previous_response_id", "background", "store"] {
            copy(&b, k, &mut o, k);
        }
    }
    let mut messages = Vec::new();
    if let Some(i) = b.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": i}));
    }
    match b.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for it in items {
                item(it, &mut messages)?;
            }
        }
        _ => return Err("`input` is required: a string or an array of items".into()),
    }
    o.insert("messages".into(), Value::Array(messages));
    copy(&b, "max_output_tokens", &mut o, "max_completion_tokens");
    copy(&b, "temperature", &mut o, "temperature");
    copy(&b, "top_p", &mut o, "top_p");
    if let Some(tools) = b.get("tools").and_then(Value::as_array) {
        let mut t = Vec::new();
        for x in tools {
            if x.get("type").and_then(Value::as_str) != Some("function") {
                return Err("only function tools can be translated".into());
            }
            t.push(
                json!({"type": "function", "function": {"name": x.get("name"),
                "description": x.get("description"),
                "parameters": x.get("parameters").cloned().unwrap_or(json!({"type": "object"}))}}),
            );
        }
        o.insert("tools".into(), Value::Array(t));
    }
    if b.get("stream").and_then(Value::as_bool) == Some(true) {
        stream_usage(&mut o);
    }
    Ok(o)
}

fn item(it: &Value, out: &mut Vec<Value>) -> Result<(), String> {
    match it.get("type").and_then(Value::as_str) {
        Some("function_call") => {
            out.push(
                json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": it.get("call_id"), "type": "function", "function": {"name": it.get("name"),
            "arguments": it.get("arguments").and_then(Value::as_str).unwrap_or("{}")}}]}),
            );
            return Ok(());
        }
        Some("function_call_output") => {
            let output = match it.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => String::new(),
            };
            out.push(json!({"role": "tool", "tool_call_id": it.get("call_id"), "content": output}));
            return Ok(());
        }
        None | Some("message") => {}
        Some(other) => {
            return Err(format!(
                "input items of type {other:?} cannot be translated"
            ))
        }
    }
    let role = match it.get("role").and_then(Value::as_str) {
        Some("developer") => "system",
        Some(r) => r,
        None => "user",
    };
    let content = match it.get("content") {
        Some(Value::String(s)) => json!(s),
        Some(Value::Array(parts)) => {
            let mut ps = Vec::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        ps.push(json!({"type": "text", "text": p.get("text")}))
                    }
                    Some("input_image") => {
                        let url = p.get("image_url").and_then(Value::as_str).unwrap_or("");
                        let mut iu = json!({"url": url});
                        if let Some(d) = p.get("detail") {
                            iu["detail"] = d.clone();
                        }
                        ps.push(json!({"type": "image_url", "image_url": iu}));
                    }
                    other => {
                        return Err(format!(
                            "content parts of type {other:?} cannot be translated"
                        ))
                    }
                }
            }
            Value::Array(ps)
        }
        _ => return Err("an input message has no content".into()),
    };
    out.push(json!({"role": role, "content": content}));
    Ok(())
}

fn usage_json(u: Usage) -> Value {
    json!({"input_tokens": u.input, "input_tokens_details": {"cached_tokens": u.cached.unwrap_or(0)},
           "output_tokens": u.output, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": u.input + u.output})
}

fn response(
    m: &Meta,
    status: &str,
    output: Vec<Value>,
    usage: Option<Usage>,
    finish: &str,
) -> Value {
    let incomplete = if finish == "length" {
        json!({"reason": "max_output_tokens"})
    } else {
        Value::Null
    };
    let status = if finish == "length" && status == "completed" {
        "incomplete"
    } else {
        status
    };
    json!({"id": format!("resp_{}", m.id), "object": "response", "created_at": m.created,
           "status": status, "error": null, "incomplete_details": incomplete, "instructions": null,
           "max_output_tokens": null, "model": m.model, "output": output,
           "parallel_tool_calls": true, "temperature": null, "tool_choice": "auto", "tools": [],
           "top_p": null, "usage": usage.map(usage_json)})
}

fn message_item(m: &Meta, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": format!("msg_{}", m.id), "role": "assistant", "status": status,
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

fn call_item(t: &super::ToolCall, status: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_{}", t.id), "call_id": t.id, "name": t.name,
           "arguments": t.arguments, "status": status})
}

/// A buffered `response` object.
pub fn answer(m: &Meta, a: &Answer) -> Value {
    let mut output = Vec::new();
    if !a.text.is_empty() || a.tool_calls.is_empty() {
        output.push(message_item(m, &a.text, "completed"));
    }
    for t in &a.tool_calls {
        output.push(call_item(t, "completed"));
    }
    let u = a.usage.unwrap_or(Usage {
        input: m.input_estimate,
        ..Usage::default()
    });
    response(m, "completed", output, Some(u), &a.finish)
}

/// Renders internal events as the Responses stream.
#[derive(Debug)]
pub struct Stream {
    meta: Meta,
    seq: u64,
    started: bool,
    text: String,
    /// The message item went out (its index is 0).
    message: bool,
    tools: Vec<super::ToolCall>,
    finish: Option<String>,
    usage: Option<Usage>,
    closed: bool,
}

impl Stream {
    pub fn new(meta: Meta) -> Self {
        Stream {
            meta,
            seq: 0,
            started: false,
            text: String::new(),
            message: false,
            tools: Vec::new(),
            finish: None,
            usage: None,
            closed: false,
        }
    }

    fn event(&mut self, out: &mut Vec<u8>, ty: &str, mut v: Value) {
        v["type"] = json!(ty);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(ty.as_bytes());
        out.extend_from_slice(b"\ndata: ");
        let _ = serde_json::to_writer(&mut *out, &v);
        out.extend_from_slice(b"\n\n");
    }

    fn start(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        let r = response(&self.meta, "in_progress", Vec::new(), None, "stop");
        self.event(out, "response.created", json!({"response": r.clone()}));
        self.event(out, "response.in_progress", json!({"response": r}));
    }

    fn open_message(&mut self, out: &mut Vec<u8>) {
        if self.message {
            return;
        }
        self.message = true;
        let item = json!({"type": "message", "id": format!("msg_{}", self.meta.id),
                          "role": "assistant", "status": "in_progress", "content": []});
        self.event(
            out,
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        );
        let id = format!("msg_{}", self.meta.id);
        self.event(
            out,
            "response.content_part.added",
            json!({"item_id": id, "output_index": 0,
            "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
        );
    }

    pub fn on(&mut self, ev: Event<'_>, out: &mut Vec<u8>) {
        if self.closed {
            return;
        }
        self.start(out);
        match ev {
            Event::Text(t) => {
                self.open_message(out);
                self.text.push_str(t);
                let id = format!("msg_{}", self.meta.id);
                self.event(
                    out,
                    "response.output_text.delta",
                    json!({"item_id": id,
                    "output_index": 0, "content_index": 0, "delta": t, "logprobs": []}),
                );
            }
            Event::ToolStart { id, name, .. } => self.tools.push(super::ToolCall {
                id: id.to_string(),
                name: name.to_string(),
                arguments: String::new(),
            }),
            Event::ToolArgs { args, .. } => {
                if let Some(t) = self.tools.last_mut() {
                    t.arguments.push_str(args);
                }
            }
            Event::Finish(r) => self.finish = Some(r.to_string()),
            Event::Usage(u) => self.usage = Some(u),
            Event::Error(m) => {
                self.closed = true;
                self.event(
                    out,
                    "error",
                    json!({"code": "upstream_error", "message": m, "param": null}),
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
        let mut output = Vec::new();
        if self.message || self.tools.is_empty() {
            self.open_message(out);
            let id = format!("msg_{}", self.meta.id);
            let text = std::mem::take(&mut self.text);
            self.event(
                out,
                "response.output_text.done",
                json!({"item_id": id, "output_index": 0,
                "content_index": 0, "text": text, "logprobs": []}),
            );
            self.event(out, "response.content_part.done", json!({"item_id": id, "output_index": 0,
                "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}}));
            let item = message_item(&self.meta, &text, "completed");
            self.event(
                out,
                "response.output_item.done",
                json!({"output_index": 0, "item": item.clone()}),
            );
            output.push(item);
        }
        for t in std::mem::take(&mut self.tools) {
            let idx = output.len();
            let item = call_item(&t, "completed");
            self.event(
                out,
                "response.output_item.added",
                json!({"output_index": idx, "item": item.clone()}),
            );
            self.event(
                out,
                "response.output_item.done",
                json!({"output_index": idx, "item": item.clone()}),
            );
            output.push(item);
        }
        let finish = self.finish.clone().unwrap_or_else(|| "stop".into());
        let r = response(&self.meta, "completed", output, self.usage, &finish);
        let ty = if r["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.event(out, ty, json!({"response": r}));
    }
}
