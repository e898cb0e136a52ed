//! The real upstream: pooled keep-alive hyper clients (rustls, HTTP/2 by ALPN), per-backend
//! timeouts, the request rewritten for the chosen chain entry, and the answer classified into
//! what the governor understands. The upstream URL comes only from the policy.

use super::respond::is_hop_by_hop;
use super::snapshot::Snapshot;
use crate::estimate::Endpoint;
use crate::governor::{CallResult, CallSpec, Failure, FailureClass, Skip, Upstream};
use crate::policy::Backend;
use crate::providers::{
    self, Adapter, BuildCtx, Envelope, ErrorHint, NativeFormat, PassCtx, Translator,
    Untranslatable, Wire,
};
use crate::stream::StreamUsage;
use crate::wire::pool::{Pools, UpstreamBody};
use bytes::Bytes;
use dashmap::DashMap;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Largest upstream body the sidecar buffers (a buffered completion, an error body).
const MAX_UPSTREAM_BODY: usize = 64 * 1024 * 1024;
/// Largest error body read to find a retry delay.
const MAX_ERROR_BODY: usize = 256 * 1024;

/// The upstream connections: cleartext HTTP/1 upstreams on the own pools (`crate::wire::pool`), TLS ones
/// on hyper-util's pooled clients, one per connect timeout (the connector carries it).
/// Survives reloads.
#[derive(Default)]
pub struct Transport {
    h1: Pools,
    clients: DashMap<u64, HttpClient, foldhash::quality::RandomState>,
    /// Calls in flight per backend id, for backends with `max_in_flight`.
    in_flight: DashMap<Arc<str>, Arc<AtomicU32>, foldhash::quality::RandomState>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("clients", &self.clients.len())
            .finish()
    }
}

impl Transport {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sends a request, with the trace context of its attempt's span when it has one, and
    /// gives back the answer: its head, and its body to read.
    async fn send(
        &self,
        mut req: Request<Bytes>,
        connect: Duration,
        trace: Option<crate::telemetry::otel::Attempt>,
    ) -> Result<hyper::Response<AnswerBody>, ()> {
        if req.uri().scheme() == Some(&http::uri::Scheme::HTTP) {
            // The attempt's trace context goes out as lines of the own client's head.
            let lines = trace.and_then(|s| s.lines(req.headers_mut()));
            let extra = lines.as_ref().map_or(&[][..], |l| l.as_bytes());
            return match self.h1.send_with(req, connect, extra).await {
                Ok(r) => Ok(r.map(AnswerBody::Own)),
                Err(_) => Err(()),
            };
        }
        if let Some(s) = trace {
            s.inject(req.headers_mut());
        }
        self.client(connect)
            .request(req.map(Full::new))
            .await
            .map(|r| r.map(AnswerBody::Hyper))
            .map_err(|_| ())
    }

    fn client(&self, connect: Duration) -> HttpClient {
        let key = connect.as_millis() as u64;
        if let Some(c) = self.clients.get(&key) {
            return c.clone();
        }
        self.clients
            .entry(key)
            .or_insert_with(|| {
                let mut http = HttpConnector::new();
                http.enforce_http(false);
                http.set_nodelay(true);
                http.set_connect_timeout(Some(connect));
                http.set_keepalive(Some(Duration::from_secs(60)));
                let https = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(crate::tls::client_config())
                    .https_or_http()
                    .enable_http1()
                    .enable_http2()
                    .wrap_connector(http);
                Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(90))
                    .pool_max_idle_per_host(256)
                    .build(https)
            })
            .clone()
    }
}

/// An upstream answer the governor accepted or passed through. Translated (`wire`), a
/// buffered body is already in the OpenAI shape and a native stream carries the translator
/// that reshapes it on the way; passed through, the body is the upstream's own and the
/// translation is read for usage only.
pub struct UpstreamResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: UpBody,
    /// When the total timeout runs out.
    pub deadline: Instant,
    /// How the attempt that answered spoke to its backend.
    pub wire: Wire,
    /// A passed-through buffered answer in the internal form, read for its usage only.
    pub internal: Option<Bytes>,
    /// A buffered answer's `usage` object as read when the answer was checked: `Some(None)`
    /// when it had none (or an unreadable one); `None` when it was not checked (a translated
    /// answer), so the usage is looked for in the body.
    pub usage: Option<Option<StreamUsage>>,
    /// Turns a native stream into OpenAI chunks (`None`: already OpenAI SSE).
    pub translate: Option<Translator>,
    /// The backend's in-flight slot, held until the answer is fully read.
    pub permit: Option<InFlight>,
}

impl std::fmt::Debug for UpstreamResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamResponse")
            .field("status", &self.status)
            .field("wire", &self.wire)
            .field("translated", &self.translate.is_some())
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
pub enum UpBody {
    Buffered(Bytes),
    Stream(AnswerBody),
}

/// An upstream answer's body as it arrives: from an own cleartext HTTP/1 connection, or from
/// hyper's client (TLS).
#[derive(Debug)]
pub enum AnswerBody {
    Own(UpstreamBody),
    Hyper(Incoming),
}

impl http_body::Body for AnswerBody {
    type Data = Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            AnswerBody::Own(b) => std::pin::Pin::new(b).poll_frame(cx).map_err(Into::into),
            AnswerBody::Hyper(b) => std::pin::Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            AnswerBody::Own(b) => b.is_end_stream(),
            AnswerBody::Hyper(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            AnswerBody::Own(b) => b.size_hint(),
            AnswerBody::Hyper(b) => b.size_hint(),
        }
    }
}

/// One call in flight on a backend with `max_in_flight`; given back on drop.
#[derive(Debug)]
pub struct InFlight(Arc<AtomicU32>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Transport {
    fn in_flight_cell(&self, backend: &Backend) -> Arc<AtomicU32> {
        if let Some(c) = self.in_flight.get(&backend.id) {
            return c.clone();
        }
        self.in_flight
            .entry(backend.id.clone())
            .or_insert_with(|| Arc::new(AtomicU32::new(0)))
            .clone()
    }

    /// Takes a slot if the backend has room; `Ok(None)` when it has no limit.
    fn take_slot(&self, backend: &Backend) -> Result<Option<InFlight>, ()> {
        let Some(max) = backend.max_in_flight else {
            return Ok(None);
        };
        let cell = self.in_flight_cell(backend);
        cell.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            (v < max).then_some(v + 1)
        })
        .map(|_| Some(InFlight(cell)))
        .map_err(|_| ())
    }

    /// Calls in flight on a backend (for status and tests).
    pub fn in_flight(&self, backend_id: &str) -> u32 {
        self.in_flight
            .get(backend_id)
            .map_or(0, |c| c.load(Ordering::Acquire))
    }
}

/// One request's view of the transport: what to send for each attempt.
pub struct Call<'a> {
    pub transport: &'a Transport,
    pub snap: &'a Snapshot,
    pub endpoint: Endpoint,
    pub request_id: &'a str,
    pub body: &'a providers::RequestBody,
    /// The bytes `body` was read from, when it is their parse unchanged (see `BuildCtx::raw`).
    pub raw: Option<&'a [u8]>,
    pub client_headers: &'a HeaderMap,
    pub stream: bool,
    /// Ask the upstream for the usage chunk (the client did not).
    pub add_include_usage: bool,
    /// Why no translated entry can serve this request (a stateful Responses request):
    /// every entry is skipped as untranslatable.
    pub untranslatable: Option<&'static str>,
    /// The client's own body, when it is in a provider's wire format: passed through to a
    /// backend that speaks that format.
    pub native: Option<NativeBody<'a>>,
}

/// A client's body as it sent it, in a provider's wire format.
#[derive(Debug, Clone, Copy)]
pub struct NativeBody<'a> {
    pub format: NativeFormat,
    /// The client's body as it sent it.
    pub body: &'a [u8],
}

/// Most upstream URLs a thread keeps parsed ([`upstream_uri`]); past it, it starts over.
const MAX_URIS: usize = 16;

thread_local! {
    /// Upstream URLs and their parsed `Uri`s: a backend's URL for an endpoint is the same on
    /// every call, and parsing it cost ~900 instructions a call where a clone of the parsed
    /// one costs a few reference counts.
    static URIS: super::header_memo::List<String, http::Uri> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// `url` parsed, from the thread's kept copy when it has one.
fn upstream_uri(url: String) -> Result<http::Uri, http::uri::InvalidUri> {
    super::header_memo::listed(
        &URIS,
        MAX_URIS,
        |k| *k == url,
        || http::Uri::try_from(url.as_str()).map(|uri| (url.clone(), uri)),
        http::Uri::clone,
    )
}

/// Client headers that never go upstream: hop-by-hop, credentials, our own.
fn forwardable(name: &http::HeaderName) -> bool {
    let n = name.as_str();
    !(is_hop_by_hop(name)
        || matches!(
            n,
            "authorization"
                | "api-key"
                | "x-api-key"
                | "x-goog-api-key"
                | "cookie"
                | "accept-encoding"
                | "content-length"
                | "anthropic-version"
        )
        || n.starts_with("x-tollgate-")
        || n == "content-type")
}

/// A failure after a 2xx head: the upstream took the call and may have billed it.
fn billed_failure(class: FailureClass, status: StatusCode) -> CallResult<Box<UpstreamResponse>> {
    CallResult::Failed(Failure {
        class,
        status: Some(status.as_u16()),
        retry_after_ms: None,
        long_outage: false,
        billed: true,
    })
}

fn failure(
    class: FailureClass,
    status: Option<u16>,
    retry_after_ms: Option<i64>,
) -> CallResult<Box<UpstreamResponse>> {
    CallResult::Failed(Failure {
        class,
        status,
        retry_after_ms,
        long_outage: false,
        billed: false,
    })
}

/// Whether an answer says its body is JSON.
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("application/json")
        })
}

/// Whether an answer's body carries a content coding other than `identity`.
fn coded(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::CONTENT_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))
}

/// A buffered answer's body with its content coding (gzip, deflate) undone, at most
/// [`MAX_UPSTREAM_BODY`] bytes decoded, and the `Content-Encoding` field taken off; `Err`
/// for a coding the sidecar cannot read or a corrupt or oversized body.
fn uncoded(headers: &mut HeaderMap, b: Bytes) -> Result<Bytes, ()> {
    if !coded(headers) {
        headers.remove(http::header::CONTENT_ENCODING);
        return Ok(b);
    }
    let coding = super::encoding::coding(headers).map_err(|_| ())?;
    headers.remove(http::header::CONTENT_ENCODING);
    headers.remove(http::header::CONTENT_LENGTH);
    super::encoding::decode(coding, b, MAX_UPSTREAM_BODY).map_err(|_| ())
}

/// Headers of a body the sidecar rewrote: the upstream's length and type no longer apply.
fn retype(headers: &mut HeaderMap, content_type: &'static str) {
    headers.remove(http::header::CONTENT_LENGTH);
    headers.remove(http::header::CONTENT_ENCODING);
    headers.remove(http::header::TRANSFER_ENCODING);
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
}

impl Call<'_> {
    fn envelope(&self, spec: &CallSpec<'_>) -> Envelope {
        Envelope {
            id: format!("chatcmpl-{}", self.request_id),
            model: spec.model.to_string(),
            created: crate::units::now_ms().div_euclid(1000),
            endpoint: self.endpoint,
            usage_nulls: !self.add_include_usage,
        }
    }

    /// The per-attempt choice: the client's own body to a backend that speaks its format,
    /// else the internal form, translated.
    fn wire(&self, backend: &Backend, provider: Adapter) -> Wire {
        match self.native {
            Some(n) if provider.speaks(n.format, backend) => Wire::PassThrough,
            _ => Wire::Translated,
        }
    }

    /// The client's own body, when `wire` passes it through.
    fn passed(&self, wire: Wire) -> Option<NativeBody<'_>> {
        self.native.filter(|_| wire == Wire::PassThrough)
    }

    fn build(
        &self,
        spec: &CallSpec<'_>,
        provider: Adapter,
        wire: Wire,
        traced: bool,
    ) -> Result<Request<Bytes>, Untranslatable> {
        let backend = spec.backend;
        let native = match self.passed(wire) {
            Some(n) => provider.pass_through(&PassCtx {
                base_url: &backend.base_url,
                format: n.format,
                raw: n.body,
                model: spec.model,
                max_output_tokens: spec.max_output_tokens,
                stream: self.stream,
            })?,
            None => {
                if let Some(why) = self.untranslatable {
                    return Err(Untranslatable(why.into()));
                }
                provider.request(&BuildCtx {
                    base_url: &backend.base_url,
                    endpoint: self.endpoint,
                    body: self.body,
                    raw: self.raw,
                    model: spec.model,
                    max_output_tokens: spec.max_output_tokens,
                    output_cap_field: spec.output_cap_field,
                    stream: self.stream,
                    add_include_usage: self.add_include_usage,
                })?
            }
        };
        let uri = upstream_uri(native.url).map_err(|e| Untranslatable(e.to_string()))?;
        let mut req = Request::builder().method(Method::POST).uri(uri);
        let h = req
            .headers_mut()
            .ok_or_else(|| Untranslatable("bad request builder".into()))?;
        for (k, v) in self.client_headers {
            // A traced attempt sends its own trace context (see `Attempt::inject`).
            if forwardable(k) && !(traced && crate::telemetry::otel::is_trace_context(k)) {
                h.append(k.clone(), v.clone());
            }
        }
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        for (k, v) in provider.fixed_headers() {
            h.insert(*k, HeaderValue::from_static(v));
        }
        for (k, v) in &self.snap.auth[spec.backend_index] {
            h.insert(k.clone(), v.clone());
        }
        req.body(Bytes::from(native.body))
            .map_err(|e| Untranslatable(e.to_string()))
    }

    async fn attempt(&self, spec: CallSpec<'_>) -> CallResult<Box<UpstreamResponse>> {
        // A handle (the record lives in the request's trace): the span is held across the
        // call, and every level of the request's future above carries it even with export off.
        let span = crate::telemetry::otel::attempt(&spec);
        let r = self.attempt_inner(spec, span).await;
        if let Some(span) = span {
            span.end(&r);
        }
        r
    }

    /// One call to one backend: build, take a slot, send, and read the head within the
    /// first-byte timeout; then the answer is taken by its status ([`Verdict`]), each way a
    /// step of its own.
    async fn attempt_inner(
        &self,
        spec: CallSpec<'_>,
        span: Option<crate::telemetry::otel::Attempt>,
    ) -> CallResult<Box<UpstreamResponse>> {
        let backend = spec.backend;
        let provider = providers::for_kind(backend.kind);
        let t = &backend.timeouts;
        let deadline = Instant::now() + t.total;
        let wire = self.wire(backend, provider);
        let req = match self.build(&spec, provider, wire, span.is_some()) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(backend = %backend.id, error = %e, "request cannot be sent to this backend: skipped");
                return CallResult::Skipped(Skip::Untranslatable);
            }
        };
        let Ok(permit) = self.transport.take_slot(backend) else {
            return CallResult::Skipped(Skip::Saturated);
        };
        let first_byte = t.first_byte.min(t.total);
        // A cleartext upstream's connection goes back to its pool when its body is read to
        // the end: at once for a buffered answer, when the stream ends for a stream.
        // The send made in its box: not moved into the timer's future and through the
        // frames of every future above this one.
        let send = pin_in_place!(self.transport.send(req, t.connect, span));
        let resp = match tokio::time::timeout(first_byte, send).await {
            Err(_) => return failure(FailureClass::Timeout, None, None),
            Ok(Err(())) => return failure(FailureClass::Connect, None, None),
            Ok(Ok(r)) => r,
        };
        let (parts, incoming) = resp.into_parts();
        let head = Head {
            backend,
            provider,
            wire,
            deadline,
            span,
            status: parts.status,
            headers: parts.headers,
        };
        match Verdict::of(head.status) {
            Verdict::Answer if self.stream => self.served_stream(&spec, head, incoming, permit),
            Verdict::Answer => self.served_buffered(&spec, head, incoming, permit).await,
            Verdict::ClientError => head.client_error(incoming).await,
            Verdict::Failed(class) => head.failed(class, incoming).await,
        }
    }

    /// A 2xx head to a stream request: checked to be a stream the sidecar can meter, then
    /// handed on unread with its translator (the slot is held until the stream ends).
    fn served_stream(
        &self,
        spec: &CallSpec<'_>,
        mut head: Head<'_>,
        incoming: AnswerBody,
        permit: Option<InFlight>,
    ) -> CallResult<Box<UpstreamResponse>> {
        let (backend, provider, wire, status) =
            (head.backend, head.provider, head.wire, head.status);
        let empty = http_body::Body::size_hint(&incoming).exact() == Some(0);
        if !providers::validate::stream_head_ok(status, &head.headers, empty) {
            tracing::warn!(backend = %backend.id, status = status.as_u16(), "the upstream's stream answer is not a stream");
            // A JSON answer to a stream request is still an answer the upstream billed.
            if is_json(&head.headers) {
                return billed_failure(FailureClass::Server, status);
            }
            return failure(FailureClass::Server, Some(status.as_u16()), None);
        }
        if coded(&head.headers) {
            // Compressed though never asked to be: its usage cannot be read on the way.
            tracing::warn!(backend = %backend.id, "the upstream's stream answer is compressed, never asked for");
            return billed_failure(FailureClass::Server, status);
        }
        // Answers already in the OpenAI shape pass as they are: no envelope to build.
        let translate = match self.passed(wire) {
            // The client gets the native stream as it is; its translation is metered.
            Some(n) => provider.pass_stream(n.format, self.envelope(spec)),
            _ if provider.translates_answers() => provider.stream(self.envelope(spec)),
            _ => None,
        };
        if translate.is_some() && wire == Wire::Translated {
            retype(&mut head.headers, "text/event-stream");
        }
        CallResult::Served(Box::new(head.answer(
            UpBody::Stream(incoming),
            translate,
            permit,
        )))
    }

    /// A 2xx head to a buffered request: the body read whole (bounded, within the total
    /// timeout) and decoded, the slot given back, then checked and read for its usage.
    async fn served_buffered(
        &self,
        spec: &CallSpec<'_>,
        mut head: Head<'_>,
        incoming: AnswerBody,
        permit: Option<InFlight>,
    ) -> CallResult<Box<UpstreamResponse>> {
        let status = head.status;
        let b = match read_body(incoming, head.deadline, MAX_UPSTREAM_BODY).await {
            Ok(b) => b,
            // Headers came but the body broke: nothing reached the client, so fail over; the
            // upstream took the call, so its worst case is committed.
            Err(class) => return billed_failure(class, status),
        };
        // Compressed though never asked to be (the sidecar sends no Accept-Encoding): read
        // as the plain body it stands for, bounded, and handed on plain.
        let b = match uncoded(&mut head.headers, b) {
            Ok(b) => b,
            Err(()) => {
                tracing::warn!(backend = %head.backend.id, "the upstream's answer is compressed in a way that cannot be read");
                return billed_failure(FailureClass::Server, status);
            }
        };
        drop(permit);
        match self.passed(head.wire) {
            Some(n) => self.passed_answer(spec, head, n, b),
            None => self.translated_answer(spec, head, b),
        }
    }

    /// A buffered answer passed through: the client gets the native answer as it came; its
    /// internal form is read for the usage.
    fn passed_answer(
        &self,
        spec: &CallSpec<'_>,
        head: Head<'_>,
        n: NativeBody<'_>,
        b: Bytes,
    ) -> CallResult<Box<UpstreamResponse>> {
        let read = head
            .provider
            .pass_answer(n.format, &b, &self.envelope(spec))
            .ok()
            .and_then(|i| read_answer(self.endpoint, &i, head.span).map(|u| (i, u)));
        let Some((internal, usage)) = read else {
            tracing::warn!(backend = %head.backend.id, status = head.status.as_u16(), "unreadable answer");
            return failure(FailureClass::Server, Some(head.status.as_u16()), None);
        };
        let mut answer = head.answer(UpBody::Buffered(b), None, None);
        answer.internal = Some(internal);
        answer.usage = Some(usage);
        CallResult::Served(Box::new(answer))
    }

    /// A buffered answer in the OpenAI shape, as the upstream's own or translated into it;
    /// a 2xx that is neither is the backend's failure (fail over).
    fn translated_answer(
        &self,
        spec: &CallSpec<'_>,
        mut head: Head<'_>,
        b: Bytes,
    ) -> CallResult<Box<UpstreamResponse>> {
        let (backend, status) = (head.backend, head.status);
        let translated = if head.provider.translates_answers() {
            head.provider.response(&b, &self.envelope(spec))
        } else {
            Ok(None)
        };
        let (body, usage) = match translated {
            Ok(None) => match read_answer(self.endpoint, &b, head.span) {
                Some(usage) => (b, Some(usage)),
                None => {
                    // A 2xx that is not the answer (an HTML page, empty, a 204): fail over.
                    tracing::warn!(backend = %backend.id, status = status.as_u16(), "the upstream's answer is not the expected JSON");
                    return failure(FailureClass::Server, Some(status.as_u16()), None);
                }
            },
            Ok(Some(t)) => {
                retype(&mut head.headers, "application/json");
                (t, None)
            }
            Err(e) => {
                // A 200 we cannot read is the backend's failure: fail over.
                tracing::warn!(backend = %backend.id, error = %e, "unreadable answer");
                return failure(FailureClass::Server, Some(status.as_u16()), None);
            }
        };
        let mut answer = head.answer(UpBody::Buffered(body), None, None);
        answer.usage = usage;
        CallResult::Served(Box::new(answer))
    }
}

/// How an upstream's status is taken.
enum Verdict {
    /// A 2xx: the answer, to be checked and read.
    Answer,
    /// A client error the upstream owns (400, 404, 422...): passed on, never retried.
    ClientError,
    /// The backend's failure: retried, failed over or counted against its circuit.
    Failed(FailureClass),
}

impl Verdict {
    fn of(status: StatusCode) -> Verdict {
        match status.as_u16() {
            200..=299 => Verdict::Answer,
            // A redirect is never followed nor passed on: the upstream URL comes only from
            // the policy, and a 3xx is not an answer.
            300..=399 => Verdict::Failed(FailureClass::Server),
            429 => Verdict::Failed(FailureClass::Throttled),
            401 | 403 => Verdict::Failed(FailureClass::Auth),
            // 529 is Anthropic's overloaded_error.
            408 | 500..=599 => Verdict::Failed(FailureClass::Server),
            _ => Verdict::ClientError,
        }
    }
}

/// An upstream answer's head and what it is read against: who answered, how the sidecar
/// spoke to it, until when. Carried whole between the steps of [`Call::attempt_inner`] so
/// each step takes one value, not seven.
struct Head<'s> {
    backend: &'s Backend,
    provider: Adapter,
    wire: Wire,
    deadline: Instant,
    span: Option<crate::telemetry::otel::Attempt>,
    status: StatusCode,
    headers: HeaderMap,
}

impl Head<'_> {
    /// The answer for the governor: this head over `body`.
    fn answer(
        self,
        body: UpBody,
        translate: Option<Translator>,
        permit: Option<InFlight>,
    ) -> UpstreamResponse {
        UpstreamResponse {
            status: self.status,
            headers: self.headers,
            body,
            deadline: self.deadline,
            wire: self.wire,
            internal: None,
            usage: None,
            translate,
            permit,
        }
    }

    /// A client error, read whole and passed on: in OpenAI's error shape when translated,
    /// in the upstream's own when passed through (the client speaks it).
    async fn client_error(mut self, incoming: AnswerBody) -> CallResult<Box<UpstreamResponse>> {
        let status = self.status.as_u16();
        let b = match read_body(incoming, self.deadline, MAX_UPSTREAM_BODY).await {
            Ok(b) => b,
            Err(class) => return failure(class, Some(status), None),
        };
        let translated = match self.wire {
            Wire::Translated => self.provider.error_body(status, &b),
            Wire::PassThrough => None,
        };
        let body = match translated {
            Some(t) => {
                retype(&mut self.headers, "application/json");
                t
            }
            None => b,
        };
        CallResult::NotRetryable {
            payload: Box::new(self.answer(UpBody::Buffered(body), None, None)),
            status,
        }
    }

    /// The backend's failure, with the delay it asks for: only failures look for one
    /// (providers send rate-limit headers on every answer), in the headers and, for Gemini
    /// (RetryInfo), in the body, read bounded.
    async fn failed(
        self,
        class: FailureClass,
        incoming: AnswerBody,
    ) -> CallResult<Box<UpstreamResponse>> {
        let status = self.status.as_u16();
        let now_ms = jiff::Timestamp::now().as_millisecond();
        let header_delay = self.provider.header_delay(&self.headers, now_ms);
        let hint = match read_body(incoming, self.deadline, MAX_ERROR_BODY).await {
            Ok(b) => self.provider.error_hint(status, &b, now_ms),
            Err(_) => ErrorHint::default(),
        };
        let retry_after_ms = if hint.long_outage {
            hint.delay_ms.max(header_delay)
        } else {
            header_delay.or(hint.delay_ms)
        };
        CallResult::Failed(Failure {
            class,
            status: Some(status),
            retry_after_ms,
            long_outage: hint.long_outage,
            billed: false,
        })
    }
}

/// Reads a buffered OpenAI-shaped answer for its shape and usage; under an attempt's span,
/// in the same pass what the answer says of itself, for the trace (its body is then not
/// scanned again).
fn read_answer(
    endpoint: Endpoint,
    b: &[u8],
    span: Option<crate::telemetry::otel::Attempt>,
) -> Option<Option<StreamUsage>> {
    let Some(span) = span else {
        return providers::validate::openai_answer(endpoint, b);
    };
    providers::validate::openai_answer_noting(endpoint, b, |said, usage| {
        let cached = usage
            .and_then(|u| u.prompt_tokens_details)
            .and_then(|d| d.cached_tokens);
        crate::telemetry::otel::note_said(span, said, cached);
    })
}

async fn read_body(
    mut body: AnswerBody,
    deadline: Instant,
    limit: usize,
) -> Result<Bytes, FailureClass> {
    if let AnswerBody::Own(b) = &mut body {
        if let Some(whole) = b.arrived(limit) {
            return Ok(whole);
        }
    }
    let left = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout(left, Limited::new(body, limit).collect()).await {
        Err(_) => Err(FailureClass::Timeout),
        Ok(Err(_)) => Err(FailureClass::Server),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

impl Upstream for Call<'_> {
    /// Boxed: the answer (~540 bytes) is handed up through every level of the attempt loop
    /// and the handler, a copy at each; the box moves as a pointer.
    type Payload = Box<UpstreamResponse>;

    fn eligible(&self, index: usize, backend: &Backend) -> bool {
        self.snap.eligible(index) && providers::for_kind(backend.kind).supports(self.endpoint)
    }

    fn call(
        &self,
        spec: CallSpec<'_>,
    ) -> impl Future<Output = CallResult<Box<UpstreamResponse>>> + Send {
        self.attempt(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::{upstream_uri, MAX_URIS};

    #[test]
    fn kept_urls_parse_as_fresh_ones_and_bad_ones_are_refused() {
        // More distinct URLs than a thread keeps, twice over: each reads as a fresh parse.
        for round in 0..2 {
            for i in 0..MAX_URIS + 3 {
                let url = format!(
                    "http://127.0.0.1:{}/v1/chat/completions?r={round}",
                    18000 + i
                );
                let kept = upstream_uri(url.clone()).unwrap();
                assert_eq!(kept, http::Uri::try_from(url.as_str()).unwrap());
                assert_eq!(upstream_uri(url.clone()).unwrap(), kept);
            }
        }
        assert!(upstream_uri("http://exa mple.com/v1".into()).is_err());
        assert!(upstream_uri(String::new()).is_err());
    }
}
