//! Rendering the governed path's answer (OpenAI-shaped, buffered or streamed, success or
//! error) in the client's dialect. A stream is translated event by event as it passes:
//! nothing is held back beyond the bytes of one unfinished SSE event.

use super::{anthropic, gemini, ollama, responses, Answer, Dialect, EventParser, Inbound, Op};
use crate::body::{full, Body, BoxError};
use crate::providers::Wire;
use crate::stream::{EventSplitter, Splitter};
use bytes::Bytes;
use http::{HeaderValue, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use serde_json::Value;
use std::pin::Pin;
use std::task::{Context, Poll};

/// What a renderer knows of the request.
#[derive(Debug, Clone, Default)]
pub struct Meta {
    /// The model the client named (the route alias).
    pub model: String,
    /// The sidecar's request id (answer ids derive from it).
    pub id: String,
    /// Unix seconds.
    pub created: i64,
    /// The sidecar's input estimate: what a stream reports before the provider's usage.
    pub input_estimate: u64,
    /// The client asked for a stream.
    pub stream: bool,
    /// The answer is already in the dialect (a count): nothing to render.
    pub local: bool,
    /// How the attempt that answered spoke to its backend: a passed-through answer is the
    /// upstream's own, in the client's format already.
    pub wire: Wire,
}

/// The dialect's stream renderer (enum dispatch: one arm per dialect).
#[derive(Debug)]
pub enum StreamRender {
    Anthropic(anthropic::Stream),
    Gemini(gemini::Stream),
    Ollama(ollama::Stream),
    Responses(responses::Stream),
}

impl StreamRender {
    /// The renderer of a dialect; `None` for OpenAI (nothing to translate).
    pub fn new(inb: &Inbound, meta: Meta) -> Option<StreamRender> {
        Some(match inb.dialect {
            Dialect::OpenAi => return None,
            Dialect::Anthropic => StreamRender::Anthropic(anthropic::Stream::new(meta)),
            Dialect::Gemini => StreamRender::Gemini(gemini::Stream::new(meta, inb.sse)),
            Dialect::Ollama => {
                StreamRender::Ollama(ollama::Stream::new(meta, inb.op == Op::OllamaGenerate))
            }
            Dialect::Responses => StreamRender::Responses(responses::Stream::new(meta)),
        })
    }

    /// One OpenAI SSE event's data in; the dialect's bytes appended to `out`.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) {
        EventParser::events(data, |ev| match self {
            StreamRender::Anthropic(s) => s.on(ev, out),
            StreamRender::Gemini(s) => s.on(ev, out),
            StreamRender::Ollama(s) => s.on(ev, out),
            StreamRender::Responses(s) => s.on(ev, out),
        });
    }

    /// The internal stream ended: close the dialect's stream if it is still open.
    pub fn end(&mut self, out: &mut Vec<u8>) {
        match self {
            StreamRender::Anthropic(s) => s.end(out),
            StreamRender::Gemini(s) => s.end(out),
            StreamRender::Ollama(s) => s.end(out),
            StreamRender::Responses(s) => s.end(out),
        }
    }

    fn content_type(&self) -> &'static str {
        match self {
            StreamRender::Gemini(s) if !s.sse() => "application/json",
            StreamRender::Ollama(_) => "application/x-ndjson",
            _ => "text/event-stream",
        }
    }
}

/// An internal OpenAI SSE body rendered in a dialect as it streams.
struct Rendering {
    inner: Body,
    split: EventSplitter,
    render: StreamRender,
    ended: bool,
}

impl HttpBody for Rendering {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if this.ended {
                return Poll::Ready(None);
            }
            let mut out = Vec::new();
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let (split, render) = (&mut this.split, &mut this.render);
                    split.feed(&data, |ev| render.feed(ev, &mut out));
                }
                Poll::Ready(end) => {
                    let (split, render) = (&mut this.split, &mut this.render);
                    split.finish(|ev| render.feed(ev, &mut out));
                    render.end(&mut out);
                    this.ended = true;
                    if let Some(Err(e)) = end {
                        if out.is_empty() {
                            return Poll::Ready(Some(Err(e)));
                        }
                    }
                }
            }
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// A response the governed path made, rendered in the client's dialect.
pub struct Rendered;

impl Rendered {
    /// Renders `resp` (OpenAI-shaped: an answer, a stream or an error) for `inb`'s dialect;
    /// a passed-through answer goes as it is.
    pub async fn respond(inb: Inbound, meta: Meta, resp: Response<Body>) -> Response<Body> {
        if inb.dialect == Dialect::OpenAi || meta.local || meta.wire == Wire::PassThrough {
            return resp;
        }
        let (mut parts, body) = resp.into_parts();
        let is_stream = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if parts.status.is_success() && is_stream {
            if let Some(render) = StreamRender::new(&inb, meta) {
                set_type(&mut parts.headers, render.content_type());
                let b = Rendering {
                    inner: body,
                    split: EventSplitter::default(),
                    render,
                    ended: false,
                };
                return Response::from_parts(parts, b.boxed());
            }
            return Response::from_parts(parts, body);
        }
        // Not a stream: the body is already in memory (a buffered answer, an error body, both
        // read under the transport's caps), so collecting it copies nothing new from the wire.
        let bytes = match body.collect().await {
            Ok(c) => c.to_bytes(),
            Err(e) => {
                tracing::warn!(error = %e, "answer body could not be re-read");
                Bytes::new()
            }
        };
        let status = parts.status.as_u16();
        let out = if parts.status.is_success() {
            match Answer::from_openai(&bytes) {
                Ok(a) => answer(&inb, &meta, &a),
                Err(e) => super::error_body(inb.dialect, 502, &e, None, None),
            }
        } else {
            let retry = parts
                .headers
                .get(http::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            reshape_error(inb.dialect, status, &bytes, retry)
        };
        set_type(&mut parts.headers, "application/json");
        Response::from_parts(parts, full(out.to_string()))
    }
}

fn set_type(h: &mut http::HeaderMap, t: &'static str) {
    h.remove(http::header::CONTENT_LENGTH);
    h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(t));
}

/// A buffered answer in the dialect (a streamed-only dialect shape for a buffered answer:
/// Ollama's and Gemini's single-chunk forms are their buffered ones).
pub fn answer(inb: &Inbound, meta: &Meta, a: &Answer) -> Value {
    match inb.dialect {
        Dialect::OpenAi => Value::Null,
        Dialect::Anthropic => anthropic::answer(meta, a),
        Dialect::Gemini => gemini::answer(inb, meta, a),
        Dialect::Ollama => ollama::answer(inb, meta, a),
        Dialect::Responses => responses::answer(meta, a),
    }
}

/// An OpenAI error body (the sidecar's refusal or an upstream client error) in a dialect's
/// shape, keeping the `tollgate` object.
pub fn reshape_error(d: Dialect, status: u16, body: &[u8], retry_after: Option<u64>) -> Value {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let message = v
        .pointer("/error/message")
        .and_then(Value::as_str)
        .or_else(|| v.get("error").and_then(Value::as_str))
        .unwrap_or("the upstream refused the request");
    let tollgate = v.get("tollgate").or_else(|| v.pointer("/error/tollgate"));
    let mut out = super::error_body(d, status, message, tollgate, retry_after);
    // The same `code` as the chat answer (`hard_budget_exceeded`), not null.
    if let (Dialect::OpenAi | Dialect::Responses, Some(code)) = (d, v.pointer("/error/code")) {
        if let Some(e) = out.get_mut("error").and_then(Value::as_object_mut) {
            e.insert("code".into(), code.clone());
        }
    }
    out
}
