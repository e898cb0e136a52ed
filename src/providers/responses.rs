//! OpenAI's Responses API upstream (`POST {base_url}/responses`), for a `kind: openai` backend
//! with `responses_api: true`. Only Responses clients go there, and their body passes through
//! (SPEC §3.1); this module reads the native answer and stream for usage: `usage` of the
//! response object, carried by `response.completed` (or `response.incomplete`) when streamed.

use super::{
    choice, completion_body, ChunkWriter, Envelope, NativeEvents, NativeUsage, Split, Translator,
};
use bytes::Bytes;
use serde_json::Value;

/// `{"input_tokens", "output_tokens", "input_tokens_details": {"cached_tokens"},
/// "output_tokens_details": {"reasoning_tokens"}}`.
fn usage_of(u: &Value) -> Option<NativeUsage> {
    let n = |p: &str| u.pointer(p).and_then(Value::as_u64);
    Some(NativeUsage {
        prompt: n("/input_tokens")?,
        completion: n("/output_tokens").unwrap_or(0),
        cached: n("/input_tokens_details/cached_tokens"),
        cache_write: None,
        reasoning: n("/output_tokens_details/reasoning_tokens"),
    })
}

/// The text of a response object's `output` messages.
fn output_text(r: &Value) -> String {
    let mut s = String::new();
    let items = r.get("output").and_then(Value::as_array);
    for item in items.into_iter().flatten() {
        let parts = item.get("content").and_then(Value::as_array);
        for p in parts.into_iter().flatten() {
            if let Some(t) = p.get("text").and_then(Value::as_str) {
                s.push_str(t);
            }
        }
    }
    s
}

/// A buffered response object in the internal form (text and usage).
pub(crate) fn internal_answer(body: &[u8], env: &Envelope) -> Result<Bytes, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("not a Responses answer: {e}"))?;
    if v.get("object").and_then(Value::as_str) != Some("response") {
        return Err("not a Responses answer (no `object: response`)".into());
    }
    let usage = v.get("usage").and_then(usage_of);
    Ok(completion_body(
        env,
        vec![choice(0, output_text(&v), Vec::new(), "stop")],
        usage,
    ))
}

/// A reader of a Responses event stream for the meter: output text deltas and the usage of
/// the terminal event, as internal chunks.
pub(crate) fn stream(env: Envelope) -> Translator {
    Translator::Responses(Split::new(EventsStream {
        w: ChunkWriter::new(env),
        completed: false,
        failed: false,
    }))
}

/// The per-event reader of a Responses stream.
#[derive(Debug)]
pub struct EventsStream {
    w: ChunkWriter,
    completed: bool,
    failed: bool,
}

impl NativeEvents for EventsStream {
    fn on_event(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.completed || self.failed {
            return;
        }
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        match v.get("type").and_then(Value::as_str) {
            Some("response.output_text.delta") => {
                let d = v.get("delta").and_then(Value::as_str).unwrap_or("");
                self.w.text(out, 0, d);
            }
            Some("response.completed" | "response.incomplete") => {
                self.completed = true;
                let usage = v.pointer("/response/usage").and_then(usage_of);
                self.w.finish_reason(out, 0, "stop");
                self.w.end(out, usage);
            }
            Some("response.failed" | "error") => {
                self.failed = true;
                let m = v
                    .pointer("/response/error/message")
                    .or_else(|| v.get("message"))
                    .and_then(Value::as_str)
                    .unwrap_or("the provider reported an error mid-stream");
                self.w.error(out, m, "api_error");
            }
            _ => {}
        }
    }

    /// A stream that ends before `response.completed` is cut short: an upstream failure.
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
