//! Inbound dialects: the wire formats apps speak to the sidecar (SPEC §3.1). Each dialect is
//! one module that parses its request into the internal form the governed path uses (an
//! OpenAI-chat-shaped body plus an [`Endpoint`]), and renders the internal answer, stream
//! events and refusals back in its own shape. The governed path itself never learns which
//! dialect a request came in: it governs, calls and meters the internal form only.
//!
//! A dialect must never buffer a stream (its renderer turns each internal event into its own
//! events as they pass) and never forward anything ungoverned: a path under a dialect's prefix
//! that is not one of its endpoints is refused in the dialect's error shape.

pub mod anthropic;
mod canon;
pub mod gemini;
pub mod ollama;
pub mod render;
pub mod responses;

#[cfg(test)]
mod tests;

pub use canon::{Answer, Event, EventParser, ToolCall, Usage};
pub use render::{Rendered, StreamRender};

use crate::estimate::Endpoint;
use crate::providers::NativeFormat;
use http::Method;
use serde_json::{Map, Value};

/// The closed set of inbound dialects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// OpenAI Chat Completions, Completions, Embeddings: the internal form itself.
    OpenAi,
    Anthropic,
    Gemini,
    Ollama,
    /// OpenAI Responses (`/v1/responses`).
    Responses,
}

impl Dialect {
    pub const ALL: [Dialect; 5] = [
        Dialect::OpenAi,
        Dialect::Anthropic,
        Dialect::Gemini,
        Dialect::Ollama,
        Dialect::Responses,
    ];

    /// The `api` label of metrics and the audit record.
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::OpenAi => "openai",
            Dialect::Anthropic => "anthropic",
            Dialect::Gemini => "gemini",
            Dialect::Ollama => "ollama",
            Dialect::Responses => "responses",
        }
    }
}

/// What an inbound path asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A governed generation (`stream`: the path itself says streamed, e.g. Gemini's
    /// `streamGenerateContent`; otherwise the body decides).
    Generate,
    /// Ollama `/api/generate` (a prompt, answered as `response`).
    OllamaGenerate,
    /// A governed embedding.
    Embed,
    /// Gemini `batchEmbedContents`, Ollama `/api/embed` (a list of vectors).
    EmbedBatch,
    /// Counting tokens: the sidecar's estimate, never charged.
    Count,
    /// Listing the aliases.
    List,
    /// Ollama `/api/version`.
    Version,
    /// Ollama `/api/show`.
    Show,
}

/// A request on a dialect's path, as the router understood it.
#[derive(Debug, Clone)]
pub struct Inbound {
    pub dialect: Dialect,
    pub op: Op,
    /// The model named in the path (Gemini).
    pub path_model: Option<String>,
    /// Gemini `streamGenerateContent`.
    pub path_stream: bool,
    /// Gemini `alt=sse` (else a streamed JSON array).
    pub sse: bool,
    /// Gemini `?key=`.
    pub query_key: Option<String>,
}

impl Inbound {
    const fn new(dialect: Dialect, op: Op) -> Self {
        Inbound {
            dialect,
            op,
            path_model: None,
            path_stream: false,
            sse: false,
            query_key: None,
        }
    }

    /// An OpenAI request: the internal form itself, nothing to parse or render.
    pub const fn openai() -> Self {
        Inbound::new(Dialect::OpenAi, Op::Generate)
    }

    /// The internal endpoint a governed op is sent as.
    pub fn endpoint(&self) -> Endpoint {
        match self.op {
            Op::Embed | Op::EmbedBatch => Endpoint::Embeddings,
            _ => Endpoint::Chat,
        }
    }

    /// Whether the op is governed (estimate, gates, call) or answered locally.
    pub fn governed(&self) -> bool {
        matches!(
            self.op,
            Op::Generate | Op::OllamaGenerate | Op::Embed | Op::EmbedBatch
        )
    }

    /// The client's key as a bearer token, when the dialect carries it elsewhere
    /// (`x-api-key`, `x-goog-api-key`, `?key=`) and no `Authorization` is set.
    pub fn bearer(&self, headers: &http::HeaderMap) -> Option<String> {
        if headers.contains_key(http::header::AUTHORIZATION) {
            return None;
        }
        let h = match self.dialect {
            Dialect::Anthropic => "x-api-key",
            Dialect::Gemini => "x-goog-api-key",
            _ => return None,
        };
        let key = headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .or_else(|| self.query_key.clone())?;
        Some(format!("Bearer {key}"))
    }

    /// The request body in the internal form (an OpenAI chat or embeddings body).
    pub fn parse(&self, bytes: &[u8]) -> Result<Map<String, Value>, String> {
        let v: Value = if bytes.iter().all(u8::is_ascii_whitespace) {
            Value::Object(Map::new())
        } else {
            serde_json::from_slice(bytes)
                .map_err(|e| format!("the request body is not JSON: {e}"))?
        };
        let Value::Object(body) = v else {
            return Err("the request body is not a JSON object".into());
        };
        match self.dialect {
            Dialect::OpenAi => Ok(body),
            Dialect::Anthropic => anthropic::parse(self, body),
            Dialect::Gemini => gemini::parse(self, body),
            Dialect::Ollama => ollama::parse(self, body),
            Dialect::Responses => responses::parse(body),
        }
    }

    /// The provider wire format this request is already in, when a backend speaking it can
    /// take the client's body as sent (SPEC §3.1: same format in and out passes through).
    /// A Gemini stream without `alt=sse` (a JSON array) is translated: the sidecar reads
    /// upstream streams as SSE.
    pub fn native_format(&self) -> Option<NativeFormat> {
        Some(match (self.dialect, self.op) {
            (Dialect::Anthropic, Op::Generate) => NativeFormat::AnthropicMessages,
            (Dialect::Gemini, Op::Generate) if !self.path_stream || self.sse => {
                NativeFormat::GeminiGenerate
            }
            (Dialect::Ollama, Op::Generate) => NativeFormat::OllamaChat,
            (Dialect::Ollama, Op::OllamaGenerate) => NativeFormat::OllamaGenerate,
            (Dialect::Ollama, Op::EmbedBatch) => NativeFormat::OllamaEmbed,
            (Dialect::Responses, Op::Generate) => NativeFormat::OpenAiResponses,
            _ => return None,
        })
    }

    /// Why no backend but one speaking this dialect natively could serve the request
    /// (stateful Responses features): every translated chain entry is ineligible.
    pub fn untranslatable(&self, body: &crate::providers::RequestBody) -> Option<&'static str> {
        match self.dialect {
            // A Responses body is parsed already (translated from its dialect).
            Dialect::Responses => body.map().ok().and_then(responses::stateful),
            _ => None,
        }
    }
}

/// What the router found for a path on the data port.
#[derive(Debug)]
pub enum Routed {
    /// A dialect endpoint.
    Found(Inbound),
    /// Under a dialect's prefix, with a method the endpoint does not take.
    MethodNotAllowed(Dialect),
    /// Under a dialect's prefix but no endpoint of it.
    NotFound(Dialect),
}

/// The dialect endpoint of a method, path and query; `None` for paths outside every
/// dialect's prefix (the OpenAI router answers those).
pub fn route(method: &Method, path: &str, query: Option<&str>) -> Option<Routed> {
    let post = method == Method::POST;
    let get = method == Method::GET;
    let found = |d, op, ok: bool| {
        Some(if ok {
            Routed::Found(Inbound::new(d, op))
        } else {
            Routed::MethodNotAllowed(d)
        })
    };
    match path {
        "/v1/messages" => return found(Dialect::Anthropic, Op::Generate, post),
        "/v1/messages/count_tokens" => return found(Dialect::Anthropic, Op::Count, post),
        "/v1/responses" => return found(Dialect::Responses, Op::Generate, post),
        "/api/chat" => return found(Dialect::Ollama, Op::Generate, post),
        "/api/generate" => return found(Dialect::Ollama, Op::OllamaGenerate, post),
        "/api/embed" => return found(Dialect::Ollama, Op::EmbedBatch, post),
        "/api/embeddings" => return found(Dialect::Ollama, Op::Embed, post),
        "/api/tags" => return found(Dialect::Ollama, Op::List, get),
        "/api/version" => return found(Dialect::Ollama, Op::Version, get),
        "/api/show" => return found(Dialect::Ollama, Op::Show, post),
        "/v1beta/models" => return found(Dialect::Gemini, Op::List, get),
        _ => {}
    }
    if let Some(rest) = path
        .strip_prefix("/v1beta/models/")
        .or_else(|| path.strip_prefix("/v1/models/"))
    {
        // `/v1/models/{id}` without an operation is OpenAI's model lookup: not governed here.
        let Some((model, op)) = rest.rsplit_once(':') else {
            return path
                .starts_with("/v1beta/")
                .then_some(Routed::NotFound(Dialect::Gemini));
        };
        let (op, stream) = match op {
            "generateContent" => (Op::Generate, false),
            "streamGenerateContent" => (Op::Generate, true),
            "countTokens" => (Op::Count, false),
            "embedContent" => (Op::Embed, false),
            "batchEmbedContents" => (Op::EmbedBatch, false),
            _ => return Some(Routed::NotFound(Dialect::Gemini)),
        };
        if !post {
            return Some(Routed::MethodNotAllowed(Dialect::Gemini));
        }
        let mut inb = Inbound::new(Dialect::Gemini, op);
        inb.path_model = Some(model.to_string());
        inb.path_stream = stream;
        for pair in query.unwrap_or("").split('&') {
            match pair.split_once('=') {
                Some(("alt", "sse")) => inb.sse = true,
                Some(("key", k)) if !k.is_empty() => inb.query_key = Some(k.to_string()),
                _ => {}
            }
        }
        return Some(Routed::Found(inb));
    }
    if path.starts_with("/api/") {
        return Some(Routed::NotFound(Dialect::Ollama));
    }
    if path.starts_with("/v1beta/") {
        return Some(Routed::NotFound(Dialect::Gemini));
    }
    if path.starts_with("/v1/messages/") {
        return Some(Routed::NotFound(Dialect::Anthropic));
    }
    if path.starts_with("/v1/responses/") {
        return Some(Routed::NotFound(Dialect::Responses));
    }
    None
}

/// The route aliases, for the listing endpoints.
pub fn list_body(d: Dialect, aliases: &[&str]) -> Value {
    match d {
        Dialect::Gemini => gemini::list(aliases),
        Dialect::Ollama => ollama::tags(aliases),
        _ => {
            serde_json::json!({"object": "list", "data": aliases.iter().map(|a| serde_json::json!({"id": a, "object": "model", "created": 0, "owned_by": "tollgate"})).collect::<Vec<_>>()})
        }
    }
}

/// The answer of a counting endpoint.
pub fn count_body(d: Dialect, input_tokens: u64) -> Value {
    match d {
        Dialect::Gemini => serde_json::json!({"totalTokens": input_tokens}),
        _ => serde_json::json!({"input_tokens": input_tokens}),
    }
}

/// An error body in the dialect's shape, with the `tollgate` object (when the sidecar made
/// the decision) and the delay a client should wait.
pub fn error_body(
    d: Dialect,
    status: u16,
    message: &str,
    tollgate: Option<&Value>,
    retry_after: Option<u64>,
) -> Value {
    let mut v = match d {
        Dialect::OpenAi | Dialect::Responses => serde_json::json!({"error": {
            "message": message, "type": crate::providers::error_type_for(status), "code": Value::Null, "param": Value::Null}}),
        Dialect::Anthropic => anthropic::error(status, message),
        Dialect::Gemini => gemini::error(status, message, retry_after),
        Dialect::Ollama => serde_json::json!({"error": message}),
    };
    if let (Some(t), Some(o)) = (tollgate, v.as_object_mut()) {
        o.insert("tollgate".into(), t.clone());
    }
    v
}

/// The sidecar's own error event inside a stream the client reads in its dialect's format
/// (a passed-through stream the sidecar has to end: a timeout, a cut upstream, the budget).
pub fn stream_error_event(d: Dialect, message: &str, code: &str) -> bytes::Bytes {
    let s = match d {
        Dialect::Anthropic => format!(
            "event: error\ndata: {}\n\n",
            serde_json::json!({"type": "error", "error": {"type": "api_error", "message": message}})
        ),
        Dialect::Gemini => format!("data: {}\n\n", gemini::error(500, message, None)),
        Dialect::Ollama => format!("{}\n", serde_json::json!({"error": message})),
        Dialect::Responses => format!(
            "event: error\ndata: {}\n\n",
            serde_json::json!({"type": "error", "code": code, "message": message, "param": null})
        ),
        Dialect::OpenAi => format!(
            "data: {}\n\n",
            serde_json::json!({"error": {"message": message, "type": "tollgate_stream_error", "code": code, "param": null}})
        ),
    };
    bytes::Bytes::from(s)
}

/// The first text of a JSON string or string array field (a prompt, stop sequences).
pub(crate) fn strings(v: Option<&Value>) -> Vec<Value> {
    match v {
        Some(Value::String(s)) => vec![Value::String(s.clone())],
        Some(Value::Array(a)) => a.iter().filter(|x| x.is_string()).cloned().collect(),
        _ => Vec::new(),
    }
}

/// Copies `from[src]` into `to[dst]` when present and not null.
pub(crate) fn copy(from: &Map<String, Value>, src: &str, to: &mut Map<String, Value>, dst: &str) {
    if let Some(v) = from.get(src).filter(|v| !v.is_null()) {
        to.insert(dst.into(), v.clone());
    }
}

/// Asks for the usage chunk of a stream: every dialect reports usage at the end of its own.
/// Appends one OpenAI chat message of content `parts` and `calls` (its `tool_calls`), unless
/// both are empty: a dialect turn translated into the internal (OpenAI chat) form.
pub(crate) fn push_chat_message(
    out: &mut Vec<Value>,
    role: &str,
    parts: Vec<Value>,
    calls: Vec<Value>,
) {
    if parts.is_empty() && calls.is_empty() {
        return;
    }
    let mut m = serde_json::json!({"role": role, "content": parts});
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    out.push(m);
}

pub(crate) fn stream_usage(to: &mut Map<String, Value>) {
    to.insert("stream".into(), Value::Bool(true));
    to.insert(
        "stream_options".into(),
        serde_json::json!({"include_usage": true}),
    );
}
