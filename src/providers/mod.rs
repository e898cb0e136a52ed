//! Provider adapters: one module per backend `kind`. The app always speaks OpenAI to the
//! sidecar; an adapter turns that request into its provider's native one (URL, auth headers,
//! body) and the native answer — buffered, streamed, or an error — back into the OpenAI shape
//! the client asked for, with the provider's usage carried across faithfully.
//!
//! Adding a provider means adding one module that implements [`Provider`], one arm in
//! [`Adapter`] (the closed set of providers, dispatched statically by exhaustive matches) and,
//! when it streams in a format of its own, one arm in [`Translator`]. Everything here is
//! pure: bytes and JSON in, bytes and JSON out.

pub mod anthropic;
pub mod gemini;
pub mod ollama;
pub mod openai;
mod request_body;
pub mod responses;
pub mod retry_after;
mod scan;
pub mod splice;
pub mod translate;
pub mod validate;

#[cfg(test)]
mod tests;

use crate::estimate::Endpoint;
use crate::policy::{Backend, BackendKind};
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use serde_json::{json, Map, Value};

pub use request_body::RequestBody;
pub use translate::{NativeEvents, Split, Translator};

/// What an adapter needs to build one attempt's upstream request.
#[derive(Debug, Clone, Copy)]
pub struct BuildCtx<'a> {
    /// The backend's `base_url`, without a trailing slash.
    pub base_url: &'a str,
    pub endpoint: Endpoint,
    /// The client's OpenAI request body (parsed when a provider asks for its map).
    pub body: &'a RequestBody,
    /// The bytes `body` was read from, when it is their parse unchanged (the OpenAI dialect):
    /// an OpenAI request is then spliced from them, every member it does not edit as the
    /// client sent it.
    pub raw: Option<&'a [u8]>,
    /// The chain entry's upstream model.
    pub model: &'a str,
    /// The reserved output cap per choice: always sent, so the provider enforces the bound.
    pub max_output_tokens: u64,
    /// OpenAI kind: the chain entry's `output_cap_field` (`None`: chosen by model name).
    pub output_cap_field: Option<crate::policy::OutputCapField>,
    pub stream: bool,
    /// OpenAI kind only: ask for the usage chunk the client did not ask for.
    pub add_include_usage: bool,
}

/// A client body already in a provider's own wire format: what a same-format attempt passes
/// through (SPEC §3.1). The inbound dialect names it; the provider says whether it speaks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NativeFormat {
    /// Anthropic Messages (`/v1/messages`).
    AnthropicMessages,
    /// Gemini `generateContent`, or `streamGenerateContent?alt=sse`.
    GeminiGenerate,
    /// Ollama `/api/chat`.
    OllamaChat,
    /// Ollama `/api/generate`.
    OllamaGenerate,
    /// Ollama `/api/embed`.
    OllamaEmbed,
    /// OpenAI Responses (`/v1/responses`).
    OpenAiResponses,
}

/// How one attempt speaks to its backend: the per-attempt choice of SPEC §3.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wire {
    /// The internal (OpenAI) body, translated by the provider when it speaks another format;
    /// the answer comes back in the internal form and is rendered in the client's dialect.
    #[default]
    Translated,
    /// The client's own body, in the backend's own format, with only the model, the output
    /// cap, the stream-usage option and the key changed; the answer goes back to the client as
    /// the upstream sent it, and its internal form is read for usage only.
    PassThrough,
}

/// What an adapter needs to pass a client's own body through for one attempt.
#[derive(Debug, Clone, Copy)]
pub struct PassCtx<'a> {
    /// The backend's `base_url`, without a trailing slash.
    pub base_url: &'a str,
    pub format: NativeFormat,
    /// The client's body, as it sent it (a JSON object: the dialect parsed it).
    pub raw: &'a [u8],
    /// The chain entry's upstream model.
    pub model: &'a str,
    /// The reserved output cap per choice: always sent, so the provider enforces the bound.
    pub max_output_tokens: u64,
    pub stream: bool,
}

impl PassCtx<'_> {
    /// The client's body with `edits` applied, every other member as it sent it
    /// ([`splice`]), as a request to `suffix`.
    pub(crate) fn native(
        &self,
        suffix: &str,
        edits: &[splice::Edit<'_>],
    ) -> Result<NativeRequest, Untranslatable> {
        Ok(NativeRequest {
            url: join(self.base_url, suffix),
            body: splice::splice(self.raw, edits).map_err(Untranslatable)?,
        })
    }
}

/// The native request of one attempt.
#[derive(Debug)]
pub struct NativeRequest {
    /// The full URL: the backend's `base_url` plus the provider's path and query.
    pub url: String,
    pub body: Vec<u8>,
}

/// Why a request cannot be sent to a provider. The backend is skipped for this request (no
/// circuit failure: the backend did nothing wrong).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Untranslatable(pub String);

impl std::fmt::Display for Untranslatable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The OpenAI envelope of a translated answer: the ids the client sees.
#[derive(Debug, Clone)]
pub struct Envelope {
    /// `chatcmpl-<request id>`.
    pub id: String,
    /// The upstream model that answered.
    pub model: String,
    /// Unix seconds.
    pub created: i64,
    /// What the client asked for (the shape of the answer).
    pub endpoint: Endpoint,
    /// The client asked for the usage chunk: content chunks carry `"usage":null`, as OpenAI's
    /// do. Otherwise they carry no `usage` key (the SSE meter would only cut it out again).
    pub usage_nulls: bool,
}

/// What an upstream error body tells beyond its status and headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorHint {
    pub delay_ms: Option<i64>,
    /// Waiting minutes will not help (a per-day quota is used up): treat it as an outage.
    pub long_outage: bool,
}

/// One provider's wire format: the shape each provider module implements. Callers go
/// through [`Adapter`], which dispatches to the module statically.
pub trait Provider {
    /// Whether answers come back in another shape (`response` and `stream` translate).
    /// The OpenAI adapter says no, so the transport skips building an envelope.
    fn translates_answers(&self) -> bool {
        true
    }

    /// Whether this provider can serve the endpoint at all.
    fn supports(&self, endpoint: Endpoint) -> bool;

    /// The auth headers for a key (computed once per policy load).
    fn auth_headers(&self, key: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String>;

    /// Headers every request carries (e.g. `anthropic-version`).
    fn fixed_headers(&self) -> &'static [(&'static str, &'static str)] {
        &[]
    }

    /// The upstream request for one attempt.
    fn request(&self, c: &BuildCtx<'_>) -> Result<NativeRequest, Untranslatable>;

    /// A successful buffered answer in the OpenAI shape; `None` when it already is.
    fn response(&self, body: &[u8], env: &Envelope) -> Result<Option<Bytes>, String>;

    /// A translator for a successful stream; `None` when the stream is already OpenAI SSE.
    fn stream(&self, env: Envelope) -> Option<Translator>;

    /// Whether `backend` speaks `format` natively: a request in that format passes through
    /// (see [`Wire`]). No format by default.
    fn speaks(&self, _format: NativeFormat, _backend: &Backend) -> bool {
        false
    }

    /// The upstream request of a pass-through: the client's body with only the model, the
    /// output cap and the stream-usage option changed. Called only when [`Provider::speaks`].
    fn pass_through(&self, c: &PassCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        Err(Untranslatable(format!(
            "{:?} is not passed through by this provider",
            c.format
        )))
    }

    /// A passed-through buffered answer in the internal form, read for its usage only (the
    /// client gets the native bytes). By default the provider's own translation.
    fn pass_answer(
        &self,
        _format: NativeFormat,
        body: &[u8],
        env: &Envelope,
    ) -> Result<Bytes, String> {
        Ok(self
            .response(body, env)?
            .unwrap_or_else(|| Bytes::copy_from_slice(body)))
    }

    /// The reader of a passed-through stream: its internal form is metered, never sent. By
    /// default the provider's own stream translator.
    fn pass_stream(&self, _format: NativeFormat, env: Envelope) -> Option<Translator> {
        self.stream(env)
    }

    /// The delay an error response's headers state: `retry-after-ms`, then `retry-after`
    /// (seconds or a date), then the provider's own rate-limit headers.
    fn header_delay(&self, headers: &http::HeaderMap, now_ms: i64) -> Option<i64> {
        retry_after::from_headers(headers, now_ms)
    }

    /// What an error body says beyond the headers: a delay (Gemini's `RetryInfo`) and whether
    /// the backend is out for a long time (a per-day quota), which opens its circuit at once.
    /// Nothing by default: each kind that has such a body reads it with its own parser.
    fn error_hint(&self, _status: u16, _body: &[u8], _now_ms: i64) -> ErrorHint {
        ErrorHint::default()
    }

    /// A client error (4xx that is passed to the client) in OpenAI's error shape; `None`
    /// when it already is.
    fn error_body(&self, _status: u16, _body: &[u8]) -> Option<Bytes> {
        None
    }
}

/// The provider of each backend kind: a closed set, one arm per module, dispatched by
/// exhaustive matches (no trait objects).
#[derive(Debug, Clone, Copy)]
pub enum Adapter {
    OpenAi(openai::OpenAi),
    Anthropic(anthropic::Anthropic),
    Gemini(gemini::Gemini),
    Ollama(ollama::Ollama),
}

/// The adapter of a backend kind.
pub fn for_kind(kind: BackendKind) -> Adapter {
    match kind {
        BackendKind::Openai => Adapter::OpenAi(openai::OpenAi),
        BackendKind::Anthropic => Adapter::Anthropic(anthropic::Anthropic),
        BackendKind::Gemini => Adapter::Gemini(gemini::Gemini),
        BackendKind::Ollama => Adapter::Ollama(ollama::Ollama),
    }
}

/// `$p.$call` on the provider of every arm.
macro_rules! each {
    ($self:expr, $p:ident => $call:expr) => {
        match $self {
            Adapter::OpenAi($p) => $call,
            Adapter::Anthropic($p) => $call,
            Adapter::Gemini($p) => $call,
            Adapter::Ollama($p) => $call,
        }
    };
}

/// The [`Provider`] methods, dispatched to the kind's module.
impl Adapter {
    /// See [`Provider::translates_answers`].
    pub fn translates_answers(&self) -> bool {
        each!(self, p => p.translates_answers())
    }

    /// See [`Provider::supports`].
    pub fn supports(&self, endpoint: Endpoint) -> bool {
        each!(self, p => p.supports(endpoint))
    }

    /// See [`Provider::auth_headers`].
    pub fn auth_headers(&self, key: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        each!(self, p => p.auth_headers(key))
    }

    /// See [`Provider::fixed_headers`].
    pub fn fixed_headers(&self) -> &'static [(&'static str, &'static str)] {
        each!(self, p => p.fixed_headers())
    }

    /// See [`Provider::request`].
    pub fn request(&self, c: &BuildCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        each!(self, p => p.request(c))
    }

    /// See [`Provider::response`].
    pub fn response(&self, body: &[u8], env: &Envelope) -> Result<Option<Bytes>, String> {
        each!(self, p => p.response(body, env))
    }

    /// See [`Provider::stream`].
    pub fn stream(&self, env: Envelope) -> Option<Translator> {
        each!(self, p => p.stream(env))
    }

    /// See [`Provider::speaks`].
    pub fn speaks(&self, format: NativeFormat, backend: &Backend) -> bool {
        each!(self, p => p.speaks(format, backend))
    }

    /// See [`Provider::pass_through`].
    pub fn pass_through(&self, c: &PassCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        each!(self, p => p.pass_through(c))
    }

    /// See [`Provider::pass_answer`].
    pub fn pass_answer(
        &self,
        format: NativeFormat,
        body: &[u8],
        env: &Envelope,
    ) -> Result<Bytes, String> {
        each!(self, p => p.pass_answer(format, body, env))
    }

    /// See [`Provider::pass_stream`].
    pub fn pass_stream(&self, format: NativeFormat, env: Envelope) -> Option<Translator> {
        each!(self, p => p.pass_stream(format, env))
    }

    /// See [`Provider::header_delay`].
    pub fn header_delay(&self, headers: &http::HeaderMap, now_ms: i64) -> Option<i64> {
        each!(self, p => p.header_delay(headers, now_ms))
    }

    /// See [`Provider::error_hint`].
    pub fn error_hint(&self, status: u16, body: &[u8], now_ms: i64) -> ErrorHint {
        each!(self, p => p.error_hint(status, body, now_ms))
    }

    /// See [`Provider::error_body`].
    pub fn error_body(&self, status: u16, body: &[u8]) -> Option<Bytes> {
        each!(self, p => p.error_body(status, body))
    }
}

// ---- Shared pieces of the OpenAI side ----------------------------------------------------

/// The text of an OpenAI message `content` (a string, or an array of parts whose text parts
/// are joined); images and other parts are not text.
pub(crate) fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for p in parts {
                if let Some(t) = p.get("text").and_then(Value::as_str) {
                    if !s.is_empty() {
                        s.push('\n');
                    }
                    s.push_str(t);
                }
            }
            s
        }
        _ => String::new(),
    }
}

/// One OpenAI content part, as the adapters need it.
#[derive(Debug, PartialEq)]
pub(crate) enum Part<'a> {
    Text(&'a str),
    /// A `data:` URI image: media type and base64 data.
    InlineImage {
        media_type: &'a str,
        data: &'a str,
    },
    /// An image by URL (http/https).
    UrlImage(&'a str),
}

/// The parts of an OpenAI message `content`, in order.
pub(crate) fn content_parts(content: Option<&Value>) -> Result<Vec<Part<'_>>, Untranslatable> {
    match content {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![Part::Text(s)]),
        Some(Value::Array(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => out.push(Part::Text(
                        p.get("text").and_then(Value::as_str).unwrap_or(""),
                    )),
                    Some("image_url") => {
                        let url = p
                            .get("image_url")
                            .and_then(|u| u.get("url").or(Some(u)))
                            .and_then(Value::as_str)
                            .ok_or_else(|| Untranslatable("an image_url part has no url".into()))?;
                        out.push(match parse_data_uri(url) {
                            Some((media_type, data)) => Part::InlineImage { media_type, data },
                            None => Part::UrlImage(url),
                        });
                    }
                    Some(other) => {
                        return Err(Untranslatable(format!(
                            "content parts of type {other:?} cannot be translated"
                        )))
                    }
                    None => return Err(Untranslatable("a content part has no type".into())),
                }
            }
            Ok(out)
        }
        Some(_) => Err(Untranslatable(
            "message content is neither a string nor an array".into(),
        )),
    }
}

/// `data:image/png;base64,AAAA` → (`image/png`, `AAAA`).
pub(crate) fn parse_data_uri(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("data:")?;
    let (meta, data) = rest.split_once(',')?;
    let media_type = meta.strip_suffix(";base64")?;
    Some((media_type, data))
}

/// OpenAI `stop`: a string or an array of strings.
pub(crate) fn stop_sequences(body: &Map<String, Value>) -> Option<Vec<Value>> {
    match body.get("stop")? {
        Value::String(s) => Some(vec![Value::String(s.clone())]),
        Value::Array(a) if !a.is_empty() => Some(a.clone()),
        _ => None,
    }
}

/// A tool call's `arguments` (a JSON string) as an object; providers want the object.
pub(crate) fn parse_arguments(args: Option<&Value>) -> Result<Value, Untranslatable> {
    match args {
        None | Some(Value::Null) => Ok(json!({})),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(json!({})),
        Some(Value::String(s)) => serde_json::from_str(s)
            .map_err(|_| Untranslatable("a tool call's arguments are not valid JSON".into())),
        Some(v @ Value::Object(_)) => Ok(v.clone()),
        Some(_) => Err(Untranslatable(
            "a tool call's arguments are not a JSON object".into(),
        )),
    }
}

/// The usage object the sidecar writes into translated answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NativeUsage {
    /// Everything billed as input (Anthropic: input + cache creation + cache read).
    pub prompt: u64,
    /// Everything billed as output (Gemini: candidates + thoughts).
    pub completion: u64,
    /// Of the prompt, read from a cache.
    pub cached: Option<u64>,
    /// Of the prompt, written to a cache (Anthropic's `cache_creation_input_tokens`).
    pub cache_write: Option<u64>,
    /// Of the completion, reasoning.
    pub reasoning: Option<u64>,
}

impl NativeUsage {
    pub fn to_json(self) -> Value {
        let mut u = json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
        });
        if let Some(c) = self.cached {
            u["prompt_tokens_details"] = json!({"cached_tokens": c});
        }
        if let Some(w) = self.cache_write {
            u["cache_creation_input_tokens"] = json!(w);
        }
        if let Some(r) = self.reasoning {
            u["completion_tokens_details"] = json!({"reasoning_tokens": r});
        }
        u
    }
}

/// A translated buffered `chat.completion`.
pub(crate) fn completion_body(
    env: &Envelope,
    choices: Vec<Value>,
    usage: Option<NativeUsage>,
) -> Bytes {
    let mut v = json!({
        "id": env.id,
        "object": "chat.completion",
        "created": env.created,
        "model": env.model,
        "choices": choices,
    });
    if let Some(u) = usage {
        v["usage"] = u.to_json();
    }
    Bytes::from(v.to_string())
}

/// One `choices[]` entry of a translated completion.
pub(crate) fn choice(index: usize, text: String, tool_calls: Vec<Value>, finish: &str) -> Value {
    let mut msg = json!({"role": "assistant", "content": text});
    if !tool_calls.is_empty() {
        if text.is_empty() {
            msg["content"] = Value::Null;
        }
        msg["tool_calls"] = Value::Array(tool_calls);
    }
    json!({"index": index, "message": msg, "logprobs": null, "finish_reason": finish})
}

/// An OpenAI tool call (`arguments` as a JSON string).
pub(crate) fn tool_call(id: &str, name: &str, args: &Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}})
}

/// Writes OpenAI `chat.completion.chunk` events.
#[derive(Debug)]
pub(crate) struct ChunkWriter {
    env: Envelope,
    /// The role delta went out.
    started: bool,
}

impl ChunkWriter {
    pub fn new(env: Envelope) -> Self {
        ChunkWriter {
            env,
            started: false,
        }
    }

    fn event(&self, out: &mut Vec<u8>, choices: Value, usage: Value) {
        let mut v = json!({
            "id": self.env.id,
            "object": "chat.completion.chunk",
            "created": self.env.created,
            "model": self.env.model,
            "choices": choices,
        });
        if !usage.is_null() || self.env.usage_nulls {
            v["usage"] = usage;
        }
        out.extend_from_slice(b"data: ");
        // Writing to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, &v);
        out.extend_from_slice(b"\n\n");
    }

    /// The first chunk: the assistant role.
    pub fn start(&mut self, out: &mut Vec<u8>) {
        if !self.started {
            self.started = true;
            self.event(
                out,
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
                Value::Null,
            );
        }
    }

    pub fn delta(&mut self, out: &mut Vec<u8>, index: usize, delta: Value) {
        self.start(out);
        self.event(
            out,
            json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": null}]),
            Value::Null,
        );
    }

    pub fn text(&mut self, out: &mut Vec<u8>, index: usize, text: &str) {
        if !text.is_empty() {
            self.delta(out, index, json!({"content": text}));
        }
    }

    pub fn finish_reason(&mut self, out: &mut Vec<u8>, index: usize, reason: &str) {
        self.start(out);
        self.event(
            out,
            json!([{"index": index, "delta": {}, "logprobs": null, "finish_reason": reason}]),
            Value::Null,
        );
    }

    /// The usage chunk and `[DONE]`.
    pub fn end(&mut self, out: &mut Vec<u8>, usage: Option<NativeUsage>) {
        if let Some(u) = usage {
            self.event(out, json!([]), u.to_json());
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }

    /// An OpenAI-style error event for an error the provider sent inside its stream.
    pub fn error(&mut self, out: &mut Vec<u8>, message: &str, kind: &str) {
        let v = json!({"error": {"message": message, "type": kind, "code": kind, "param": null}});
        out.extend_from_slice(b"data: ");
        let _ = serde_json::to_writer(&mut *out, &v);
        out.extend_from_slice(b"\n\n");
    }

    /// The error event of a native stream that ended before its final event (cut short: an
    /// upstream failure).
    pub fn cut_short(&mut self, out: &mut Vec<u8>) {
        self.error(
            out,
            "the upstream stream ended without its final event",
            "upstream_incomplete",
        );
    }
}

/// An OpenAI error body.
pub(crate) fn openai_error(message: &str, kind: &str, code: Option<&str>) -> Bytes {
    Bytes::from(
        json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
            .to_string(),
    )
}

/// The OpenAI error type for an HTTP status.
pub(crate) fn error_type_for(status: u16) -> &'static str {
    match status {
        400 | 404 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        429 => "rate_limit_error",
        _ => "api_error",
    }
}

/// Appends `items` to the last turn when it has the same role (Anthropic and Gemini want turns
/// to alternate; consecutive tool results belong in one user turn). `field` is where a turn
/// keeps its items: `content` (Anthropic blocks) or `parts` (Gemini).
pub(crate) fn push_turn(turns: &mut Vec<Value>, role: &str, field: &str, items: Vec<Value>) {
    if items.is_empty() {
        return;
    }
    if let Some(last) = turns.last_mut() {
        if last["role"] == role {
            if let Some(arr) = last[field].as_array_mut() {
                arr.extend(items);
                return;
            }
        }
    }
    let mut turn = Map::new();
    turn.insert("role".into(), Value::from(role));
    turn.insert(field.into(), Value::Array(items));
    turns.push(Value::Object(turn));
}

/// One auth header carrying a key, marked sensitive so it is never logged.
pub(crate) fn key_header(
    name: &'static str,
    value: &str,
) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
    let mut v = HeaderValue::from_str(value)
        .map_err(|_| "the key is not a valid header value".to_string())?;
    v.set_sensitive(true);
    Ok(vec![(HeaderName::from_static(name), v)])
}

/// The `max_tokens`-style cap as JSON.
pub(crate) fn cap(c: &BuildCtx<'_>) -> Value {
    Value::from(c.max_output_tokens)
}

/// The base URL with `suffix` appended (no double slash).
pub(crate) fn join(base: &str, suffix: &str) -> String {
    let mut s = String::with_capacity(base.len() + suffix.len());
    s.push_str(base.trim_end_matches('/'));
    s.push_str(suffix);
    s
}
