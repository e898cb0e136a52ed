//! In-process mock OpenAI upstream for integration tests.
//!
//! ```ignore
//! let up = MockUpstream::start(vec![
//!     Answer::status(429).header("retry-after", "1"),
//!     Answer::ok_chat("hi", 10, 2),
//! ]).await;
//! // point the sidecar at up.base_url() ("http://127.0.0.1:PORT/v1")
//! assert_eq!(up.hits(), 2);
//! ```
//!
//! The script is consumed in arrival order (under a std Mutex); once it runs out the default
//! answer repeats. Every request is recorded (method, path, headers, body, parsed JSON) before it
//! is answered, so `requests()[i]` is the request that got `script[i]`.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type RespBody = UnsyncBoxBody<Bytes, BoxError>;

/// Model name used in responses when the request carries no `model`.
pub const FALLBACK_MODEL: &str = "mock-model";
/// Fixed `created` timestamp used in every generated response.
pub const CREATED: u64 = 1_700_000_000;

// ---------------------------------------------------------------------------------------------
// Received
// ---------------------------------------------------------------------------------------------

/// One request as the mock saw it.
#[derive(Clone, Debug)]
pub struct Received {
    pub method: Method,
    /// URI path only, e.g. "/v1/chat/completions".
    pub path: String,
    /// Raw query string without '?', if any.
    pub query: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The body parsed as JSON, when it is JSON.
    pub json: Option<Value>,
    /// Which TCP connection it came on (1-based, in accept order): equal values mean keep-alive
    /// reuse.
    pub conn: usize,
}

impl Received {
    /// A header value as a string (first value), if present and valid UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// The request's `model` field, if any.
    pub fn model(&self) -> Option<&str> {
        self.json.as_ref()?.get("model")?.as_str()
    }
    /// The body as (lossy) UTF-8 text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// Whether the request asked for `stream_options.include_usage: true`.
    pub fn include_usage(&self) -> bool {
        self.json
            .as_ref()
            .and_then(|j| j.pointer("/stream_options/include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }
}

// ---------------------------------------------------------------------------------------------
// Answer
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Kind {
    Chat {
        content: String,
        usage: Option<(u64, u64)>,
    },
    Completion {
        text: String,
        usage: (u64, u64),
    },
    Embedding {
        dims: usize,
        prompt_tokens: u64,
    },
    Json {
        status: u16,
        body: Value,
    },
    Raw {
        status: u16,
        content_type: String,
        body: Bytes,
    },
    Reset,
    Sse {
        events: Vec<String>,
        every: Duration,
    },
    SseChat {
        pieces: Vec<String>,
        usage: Option<(u64, u64)>,
        every: Duration,
    },
    SseRepeat {
        frame: Bytes,
        count: usize,
        every: Duration,
    },
    Echo {
        status: u16,
    },
}

/// A scripted answer. Build with the constructors, refine with `.header()`, `.delay()`,
/// `.abort_body()`.
#[derive(Clone, Debug)]
pub struct Answer {
    kind: Kind,
    headers: Vec<(String, String)>,
    delay: Option<Duration>,
    abort_body: bool,
}

impl Answer {
    fn of(kind: Kind) -> Answer {
        Answer {
            kind,
            headers: Vec::new(),
            delay: None,
            abort_body: false,
        }
    }

    /// 200 `chat.completion` with one choice carrying `content` and a full `usage` object.
    /// The `model` field echoes the request's model.
    pub fn ok_chat(content: &str, prompt_tokens: u64, completion_tokens: u64) -> Answer {
        Answer::of(Kind::Chat {
            content: content.to_string(),
            usage: Some((prompt_tokens, completion_tokens)),
        })
    }

    /// 200 `chat.completion` without any `usage` key.
    pub fn ok_chat_no_usage(content: &str) -> Answer {
        Answer::of(Kind::Chat {
            content: content.to_string(),
            usage: None,
        })
    }

    /// 200 embedding `list` response: one `dims`-long vector per input (a string or a token
    /// array counts as one input; an array of strings / token arrays as one per element),
    /// usage `{prompt_tokens, total_tokens}`.
    pub fn ok_embedding(dims: usize, prompt_tokens: u64) -> Answer {
        Answer::of(Kind::Embedding {
            dims,
            prompt_tokens,
        })
    }

    /// 200 legacy `/v1/completions` `text_completion` response with usage.
    pub fn ok_completion(text: &str, prompt_tokens: u64, completion_tokens: u64) -> Answer {
        Answer::of(Kind::Completion {
            text: text.to_string(),
            usage: (prompt_tokens, completion_tokens),
        })
    }

    /// `code` with an OpenAI-style error body
    /// `{"error":{"message","type","param":null,"code"}}`.
    pub fn status(code: u16) -> Answer {
        let (ty, c): (&str, Value) = match code {
            400 => ("invalid_request_error", Value::Null),
            401 => ("invalid_request_error", json!("invalid_api_key")),
            403 => (
                "permission_error",
                json!("unsupported_country_region_territory"),
            ),
            404 => ("invalid_request_error", json!("model_not_found")),
            408 => ("timeout", Value::Null),
            409 => ("conflict", Value::Null),
            413 => ("invalid_request_error", json!("request_too_large")),
            429 => ("requests", json!("rate_limit_exceeded")),
            500..=599 => ("server_error", Value::Null),
            _ => ("mock_error", Value::Null),
        };
        Answer::json(
            code,
            json!({"error": {
                "message": format!("mock upstream error {code}"),
                "type": ty,
                "param": null,
                "code": c,
            }}),
        )
    }

    /// 429 `insufficient_quota` (a 429 that waiting does not fix).
    pub fn insufficient_quota() -> Answer {
        Answer::json(
            429,
            json!({"error": {
                "message": "You exceeded your current quota, please check your plan and billing details.",
                "type": "insufficient_quota",
                "param": null,
                "code": "insufficient_quota",
            }}),
        )
    }

    /// `code` with the given JSON body (content-type application/json).
    pub fn json(code: u16, body: Value) -> Answer {
        Answer::of(Kind::Json { status: code, body })
    }

    /// `code` with an arbitrary body and content type (e.g. malformed JSON).
    pub fn raw(code: u16, content_type: &str, body: impl Into<Bytes>) -> Answer {
        Answer::of(Kind::Raw {
            status: code,
            content_type: content_type.to_string(),
            body: body.into(),
        })
    }

    /// Add a response header. Repeating a name adds several values; naming a header the answer
    /// sets by default (e.g. content-type) replaces it.
    pub fn header(mut self, name: &str, value: &str) -> Answer {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Wait `d` (after the request is recorded) before sending the response headers.
    /// For `reset()`, wait before dropping the connection.
    pub fn delay(mut self, d: Duration) -> Answer {
        self.delay = Some(d);
        self
    }

    /// For streaming answers (`sse`, `sse_chat`): after the last event (and another `every`),
    /// end the body with an error instead of a clean end, so the client sees a broken,
    /// unterminated chunked body (an interrupted stream). No effect on other answers.
    pub fn abort_body(mut self) -> Answer {
        self.abort_body = true;
        self
    }

    /// Accept the request, then drop the TCP connection (RST) without any response.
    pub fn reset() -> Answer {
        Answer::of(Kind::Reset)
    }

    /// 200 `text/event-stream`: each string is sent verbatim as its own body frame, `every`
    /// apart (the first immediately). Include the `data: ` prefix and `\n\n` yourself.
    pub fn sse(events: Vec<String>, every: Duration) -> Answer {
        Answer::of(Kind::Sse { events, every })
    }

    /// A full OpenAI chat stream: role chunk, one content chunk per piece, a finish chunk
    /// (`finish_reason: "stop"`), then — when `usage` is Some AND the request asked for
    /// `stream_options.include_usage` — the usage chunk with `"choices": []`, then
    /// `data: [DONE]`. With include_usage every other chunk carries `"usage": null`.
    /// Each event is its own frame, `every` apart.
    pub fn sse_chat(content_pieces: &[&str], usage: Option<(u64, u64)>, every: Duration) -> Answer {
        Answer::of(Kind::SseChat {
            pieces: content_pieces.iter().map(|s| s.to_string()).collect(),
            usage,
            every,
        })
    }

    /// 200 `text/event-stream` sending the same `frame` `count` times, `every` apart (zero:
    /// as fast as the client takes them), without holding them all in memory. For hostile
    /// streams: a huge answer, an event that never ends.
    pub fn sse_repeat(frame: impl Into<Bytes>, count: usize, every: Duration) -> Answer {
        Answer::of(Kind::SseRepeat {
            frame: frame.into(),
            count,
            every,
        })
    }

    /// `status` with an OpenAI-style error body whose message echoes every request header
    /// (name: value), and the request's `authorization` echoed in an `x-echo-authorization`
    /// response header: an upstream that leaks what it was sent.
    pub fn echo_request(status: u16) -> Answer {
        Answer::of(Kind::Echo { status })
    }

    /// Whether this answer is `reset()`.
    pub fn is_reset(&self) -> bool {
        matches!(self.kind, Kind::Reset)
    }
}

/// The default answer of `MockUpstream::start`.
pub fn default_answer() -> Answer {
    Answer::ok_chat("Hello from the mock upstream.", 12, 7)
}

fn usage_json(p: u64, c: u64) -> Value {
    json!({
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    })
}

/// `data: {json}\n\n`
pub fn sse_data(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// `data: [DONE]\n\n`
pub fn sse_done() -> String {
    "data: [DONE]\n\n".to_string()
}

/// The events `Answer::sse_chat` sends for a given request.
pub fn chat_stream_events(
    model: &str,
    pieces: &[String],
    usage: Option<(u64, u64)>,
    include_usage: bool,
) -> Vec<String> {
    let chunk = |choices: Value| {
        let mut v = json!({
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "system_fingerprint": null,
            "choices": choices,
        });
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    };
    let mut out = Vec::new();
    out.push(sse_data(&chunk(json!([{
        "index": 0,
        "delta": {"role": "assistant", "content": "", "refusal": null},
        "logprobs": null,
        "finish_reason": null,
    }]))));
    for p in pieces {
        out.push(sse_data(&chunk(json!([{
            "index": 0,
            "delta": {"content": p},
            "logprobs": null,
            "finish_reason": null,
        }]))));
    }
    out.push(sse_data(&chunk(json!([{
        "index": 0,
        "delta": {},
        "logprobs": null,
        "finish_reason": "stop",
    }]))));
    if let (Some((p, c)), true) = (usage, include_usage) {
        let mut u = chunk(json!([]));
        u["usage"] = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
        out.push(sse_data(&u));
    }
    out.push(sse_done());
    out
}

fn embedding_inputs(req: &Received) -> usize {
    match req.json.as_ref().and_then(|j| j.get("input")) {
        Some(Value::Array(items)) if !items.is_empty() => {
            if items.iter().all(Value::is_number) {
                1 // a single token array
            } else {
                items.len()
            }
        }
        _ => 1,
    }
}

fn full(status: u16, content_type: &str, body: Bytes) -> Response<RespBody> {
    let mut resp = Response::new(
        Full::new(body)
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *resp.status_mut() = StatusCode::from_u16(status).expect("valid status code");
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_str(content_type).unwrap(),
    );
    resp
}

fn json_resp(status: u16, v: &Value) -> Response<RespBody> {
    full(
        status,
        "application/json",
        Bytes::from(serde_json::to_vec(v).unwrap()),
    )
}

fn streaming(frames: Vec<Bytes>, every: Duration, abort: bool) -> Response<RespBody> {
    let n = frames.len();
    let stream = futures_util::stream::unfold((0usize, frames), move |(i, frames)| async move {
        if i < n {
            if i > 0 && !every.is_zero() {
                tokio::time::sleep(every).await;
            }
            let f = frames[i].clone();
            Some((Ok::<_, BoxError>(Frame::data(f)), (i + 1, frames)))
        } else if abort && i == n {
            if !every.is_zero() {
                tokio::time::sleep(every).await;
            }
            let e: BoxError = Box::new(io::Error::other("mock upstream: stream aborted"));
            Some((Err(e), (i + 1, frames)))
        } else {
            None
        }
    });
    let mut resp = Response::new(StreamBody::new(stream).boxed_unsync());
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache"),
    );
    resp
}

fn streaming_repeat(frame: Bytes, count: usize, every: Duration) -> Response<RespBody> {
    let stream = futures_util::stream::unfold(0usize, move |i| {
        let frame = frame.clone();
        async move {
            if i >= count {
                return None;
            }
            if i > 0 && !every.is_zero() {
                tokio::time::sleep(every).await;
            }
            Some((Ok::<_, BoxError>(Frame::data(frame)), i + 1))
        }
    });
    let mut resp = Response::new(StreamBody::new(stream).boxed_unsync());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    resp
}

impl Answer {
    /// Render the response for `req`. Not for `reset()`.
    fn render(&self, req: &Received, seq: usize) -> Response<RespBody> {
        let model = req.model().unwrap_or(FALLBACK_MODEL).to_string();
        let mut resp = match &self.kind {
            Kind::Chat { content, usage } => {
                let mut v = json!({
                    "id": format!("chatcmpl-mock-{seq}"),
                    "object": "chat.completion",
                    "created": CREATED,
                    "model": model,
                    "choices": [{
                        "index": 0,
                        "message": {"role": "assistant", "content": content, "refusal": null},
                        "logprobs": null,
                        "finish_reason": "stop",
                    }],
                    "system_fingerprint": null,
                });
                if let Some((p, c)) = usage {
                    v["usage"] = usage_json(*p, *c);
                }
                json_resp(200, &v)
            }
            Kind::Completion {
                text,
                usage: (p, c),
            } => json_resp(
                200,
                &json!({
                    "id": format!("cmpl-mock-{seq}"),
                    "object": "text_completion",
                    "created": CREATED,
                    "model": model,
                    "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
                }),
            ),
            Kind::Embedding {
                dims,
                prompt_tokens,
            } => {
                let data: Vec<Value> = (0..embedding_inputs(req))
                    .map(|i| {
                        let vec: Vec<f64> = (0..*dims)
                            .map(|j| (((i + j) % 17) as f64 - 8.0) / 16.0)
                            .collect();
                        json!({"object": "embedding", "index": i, "embedding": vec})
                    })
                    .collect();
                json_resp(
                    200,
                    &json!({
                        "object": "list",
                        "data": data,
                        "model": model,
                        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
                    }),
                )
            }
            Kind::Json { status, body } => json_resp(*status, body),
            Kind::Raw {
                status,
                content_type,
                body,
            } => full(*status, content_type, body.clone()),
            Kind::Sse { events, every } => streaming(
                events.iter().map(|e| Bytes::from(e.clone())).collect(),
                *every,
                self.abort_body,
            ),
            Kind::SseChat {
                pieces,
                usage,
                every,
            } => streaming(
                chat_stream_events(&model, pieces, *usage, req.include_usage())
                    .into_iter()
                    .map(Bytes::from)
                    .collect(),
                *every,
                self.abort_body,
            ),
            Kind::SseRepeat {
                frame,
                count,
                every,
            } => streaming_repeat(frame.clone(), *count, *every),
            Kind::Echo { status } => {
                let seen: Vec<String> = req
                    .headers
                    .iter()
                    .map(|(k, v)| format!("{k}: {}", String::from_utf8_lossy(v.as_bytes())))
                    .collect();
                let mut r = json_resp(
                    *status,
                    &json!({"error": {
                        "message": format!("rejected; you sent {}", seen.join(", ")),
                        "type": "invalid_request_error", "param": null, "code": null,
                    }}),
                );
                for name in ["authorization", "x-api-key", "x-goog-api-key"] {
                    if let Some(v) = req.headers.get(name) {
                        r.headers_mut().insert(
                            HeaderName::from_bytes(format!("x-echo-{name}").as_bytes()).unwrap(),
                            v.clone(),
                        );
                    }
                }
                r
            }
            Kind::Reset => unreachable!("reset has no response"),
        };
        let h = resp.headers_mut();
        let mut replaced: Vec<HeaderName> = Vec::new();
        for (name, value) in &self.headers {
            let name = HeaderName::from_bytes(name.as_bytes()).expect("valid header name");
            let value = HeaderValue::from_str(value).expect("valid header value");
            if !replaced.contains(&name) {
                h.remove(&name);
                replaced.push(name.clone());
            }
            h.append(name, value);
        }
        resp
    }
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

struct State {
    script: VecDeque<Answer>,
    received: Vec<Received>,
}

struct Shared {
    state: Mutex<State>,
    default: Answer,
}

/// The running mock. Dropping it (or `shutdown().await`) stops the server and closes every
/// connection.
pub struct MockUpstream {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<JoinHandle<()>>,
}

impl MockUpstream {
    /// Bind 127.0.0.1:0 and serve `script` in order; then `default_answer()` (a 200 chat
    /// completion) forever.
    pub async fn start(script: Vec<Answer>) -> MockUpstream {
        MockUpstream::start_with_default(script, default_answer()).await
    }

    /// Bind 127.0.0.1:0 and serve `script` in order; then `default` forever.
    pub async fn start_with_default(script: Vec<Answer>, default: Answer) -> MockUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind mock upstream");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                script: script.into(),
                received: Vec::new(),
            }),
            default,
        });
        let task = tokio::spawn(accept_loop(listener, shared.clone()));
        MockUpstream {
            addr,
            shared,
            task: Some(task),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// "http://127.0.0.1:PORT/v1"
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// "http://127.0.0.1:PORT" + path (path should start with '/').
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Requests received (and recorded) so far.
    pub fn hits(&self) -> usize {
        self.shared.state.lock().unwrap().received.len()
    }

    /// All recorded requests, in arrival order.
    pub fn requests(&self) -> Vec<Received> {
        self.shared.state.lock().unwrap().received.clone()
    }

    pub fn last_request(&self) -> Option<Received> {
        self.shared.state.lock().unwrap().received.last().cloned()
    }

    /// Scripted answers not yet consumed.
    pub fn remaining_script(&self) -> usize {
        self.shared.state.lock().unwrap().script.len()
    }

    /// Append answers to the end of the script (before the default takes over).
    pub fn push_answers(&self, answers: Vec<Answer>) {
        self.shared.state.lock().unwrap().script.extend(answers);
    }

    /// Poll until at least `n` requests were received or `timeout` passes; returns hits().
    pub async fn wait_for_hits(&self, n: usize, timeout: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let h = self.hits();
            if h >= n || tokio::time::Instant::now() >= deadline {
                return h;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stop the server and wait until the listener and all connections are closed.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    // Connection tasks live in this JoinSet: aborting this task drops them all.
    let mut conns = JoinSet::new();
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let mut conn_no = 0usize;
    loop {
        while conns.try_join_next().is_some() {}
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        conn_no += 1;
        let conn_id = conn_no;
        let builder = builder.clone();
        let shared = shared.clone();
        conns.spawn(async move {
            let stream = Arc::new(stream);
            let weak = Arc::downgrade(&stream);
            let kill = Arc::new(Notify::new());
            let kill2 = kill.clone();
            let svc = service_fn(move |req| {
                handle(req, shared.clone(), weak.clone(), kill2.clone(), conn_id)
            });
            let conn = builder.serve_connection(TokioIo::new(SharedStream(stream)), svc);
            tokio::select! {
                _ = conn => {}
                _ = kill.notified() => {}
            }
            // Dropping the connection here drops the last strong ref to the socket: with
            // SO_LINGER=0 set by a reset answer the kernel sends RST.
        });
    }
}

async fn handle(
    req: Request<Incoming>,
    shared: Arc<Shared>,
    stream: Weak<TcpStream>,
    kill: Arc<Notify>,
    conn: usize,
) -> Result<Response<RespBody>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let json = serde_json::from_slice::<Value>(&body).ok();
    let received = Received {
        method: parts.method,
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers: parts.headers,
        body,
        json,
        conn,
    };
    let (answer, seq) = {
        let mut st = shared.state.lock().unwrap();
        st.received.push(received.clone());
        let seq = st.received.len();
        let answer = st
            .script
            .pop_front()
            .unwrap_or_else(|| shared.default.clone());
        (answer, seq)
    };
    if let Some(d) = answer.delay {
        tokio::time::sleep(d).await;
    }
    if answer.is_reset() {
        if let Some(s) = stream.upgrade() {
            let _ = s.set_zero_linger();
        }
        kill.notify_one();
        // The connection task drops this future; the sleep only bounds a leak if the future
        // were ever polled elsewhere (HTTP/2 streams run on spawned tasks).
        tokio::time::sleep(Duration::from_secs(30)).await;
        let mut r = Response::new(
            Full::new(Bytes::new())
                .map_err(|n| match n {})
                .boxed_unsync(),
        );
        *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        return Ok(r);
    }
    Ok(answer.render(&received, seq))
}

/// A TcpStream shared through an Arc so a reset answer can set SO_LINGER=0 on the socket the
/// hyper connection owns.
struct SharedStream(Arc<TcpStream>);

impl AsyncRead for SharedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.0.poll_read_ready(cx))?;
            let dst = buf.initialize_unfilled();
            match self.0.try_read(dst) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for SharedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write(buf) {
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The socket closes (FIN) when the connection drops its last reference.
        Poll::Ready(Ok(()))
    }
}
