//! The way out: the finished-request queue, the export task that turns it into OTLP (spans
//! in batches, metrics every interval), and the task that posts to the collector over our own
//! hyper + rustls stack.
//!
//! The request path only ever pushes a finished request's boxed trace (its [`Finished`]
//! record) into a fixed-size lock-free queue: when the queue is full the record is dropped and
//! its spans counted. Nothing on the request path wakes a task: the export task drains the
//! queue every schedule delay, or sooner when a batch's worth is waiting. It never waits on the network either: encoded exports go to the
//! sender task through a short channel, and when that is full (the collector is slow or down)
//! the batch is dropped and counted. Each post is bounded by the timeout, with no retries.

use super::config::{Protocol, Settings};
use super::encode::{encode_spans, Blocks};
use super::metrics::Aggregates;
use super::proto;
use super::spans::{now_ns, Finished, RequestTrace, Wall};
use crate::telemetry::names::TOLLGATE_OTEL_DROPPED_SPANS_TOTAL;
use bytes::Bytes;
use crossbeam_queue::ArrayQueue;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, Notify};

/// Largest collector answer read (it is a small protobuf status).
const MAX_ANSWER: usize = 64 * 1024;

/// Encoded exports waiting for the sender (each up to a batch of spans, or one metric export).
const OUTBOX: usize = 4;

/// The exporter's HTTP client: hyper with the rustls connector the upstream calls use.
#[derive(Clone)]
pub(super) struct HyperClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
    grpc: bool,
}

impl HyperClient {
    pub(super) fn new(timeout: Duration, protocol: Protocol) -> Self {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout.min(Duration::from_secs(5))));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let grpc = protocol == Protocol::Grpc;
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(4)
            // gRPC is HTTP/2 only (h2c for a cleartext collector).
            .http2_only(grpc)
            .build(https);
        HyperClient {
            client,
            timeout,
            grpc,
        }
    }

    /// Posts one OTLP/HTTP protobuf export; `Err` with a short reason unless the collector
    /// answered 2xx within the timeout.
    async fn post(
        &self,
        url: &Uri,
        headers: &[(http::HeaderName, http::HeaderValue)],
        body: Bytes,
    ) -> Result<(), String> {
        let (content_type, body) = if self.grpc {
            // A gRPC message: uncompressed flag, big-endian length, the protobuf.
            let len = u32::try_from(body.len()).map_err(|_| "export too large".to_string())?;
            let mut framed = Vec::with_capacity(body.len() + 5);
            framed.push(0);
            framed.extend_from_slice(&len.to_be_bytes());
            framed.extend_from_slice(&body);
            ("application/grpc", Bytes::from(framed))
        } else {
            ("application/x-protobuf", body)
        };
        let mut req = Request::post(url.clone())
            .header(http::header::CONTENT_TYPE, content_type)
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        if self.grpc {
            req.headers_mut()
                .insert(http::header::TE, http::HeaderValue::from_static("trailers"));
        }
        for (k, v) in headers {
            req.headers_mut().insert(k.clone(), v.clone());
        }
        let call = async {
            let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let (parts, body) = resp.into_parts();
            // Read (bounded) so the connection can be reused, and for gRPC's trailers.
            let collected = Limited::new(body, MAX_ANSWER).collect().await;
            if !status.is_success() {
                return Err(format!("collector answered {status}"));
            }
            if self.grpc {
                // `grpc-status` is in the trailers, or in the headers of a trailers-only answer.
                let trailers = collected.as_ref().ok().and_then(|c| c.trailers().cloned());
                let code = trailers
                    .as_ref()
                    .and_then(|t| t.get("grpc-status"))
                    .or_else(|| parts.headers.get("grpc-status"))
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                match code.as_deref() {
                    Some("0") => {}
                    Some(c) => return Err(format!("collector answered grpc-status {c}")),
                    None => return Err("collector answered without a grpc-status".into()),
                }
            }
            Ok(())
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err("OTLP export timed out".into()),
        }
    }
}

/// The finished-request queue the request path pushes into.
pub(crate) struct SpanQueue {
    q: ArrayQueue<Box<RequestTrace>>,
    /// Records waiting at which the export task drains early.
    batch: usize,
    ready: Notify,
    full: metrics::Counter,
}

impl std::fmt::Debug for SpanQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpanQueue")
            .field("len", &self.q.len())
            .finish()
    }
}

/// The spans a finished request exports (none when its trace is not sampled).
fn spans_of(f: &Finished) -> u64 {
    if f.ids.sampled {
        1 + f.attempts.len() as u64
    } else {
        0
    }
}

impl SpanQueue {
    /// Queues `t` (its box: a pointer's worth of copying) without blocking or waking anyone
    /// unless a batch is ready.
    pub(crate) fn push(&self, t: Box<RequestTrace>) {
        match self.q.push(t) {
            Ok(()) => {
                // Counted in records: a sampled record carries one span or more, so `batch`
                // records hold at least a batch of spans (and unsampled ones feed the metrics).
                // `>=`, not `==`: two pushes at once can both see the length past `batch`.
                if self.q.len() >= self.batch {
                    self.ready.notify_one();
                }
            }
            Err(t) => self.full.increment(spans_of(&t.f)),
        }
    }
}

/// What the sender posts.
enum Out {
    Spans(Bytes, u64),
    Metrics(Bytes),
    /// Everything before it was posted (a flush).
    Ack(oneshot::Sender<()>),
}

/// Asks the export task to drain, encode and post everything now, and to answer when done.
#[derive(Debug)]
pub(super) struct Control(mpsc::Sender<oneshot::Sender<()>>);

impl Control {
    pub(super) async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.0.send(tx).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// Pre-encoded pieces every export repeats.
pub(super) struct Fixed {
    /// `Resource` message body (its attributes).
    pub resource: Vec<u8>,
    /// `InstrumentationScope` message body.
    pub scope: Vec<u8>,
}

/// Starts the export and sender tasks on the current runtime; returns the queue and control.
pub(super) fn start(s: &Settings, fixed: Fixed) -> Result<(Arc<SpanQueue>, Control), String> {
    let rt = tokio::runtime::Handle::try_current()
        .map_err(|_| "no Tokio runtime to export from".to_string())?;
    let traces: Uri = s.traces_endpoint.parse().map_err(|e| format!("{e}"))?;
    let metrics_url: Uri = s.metrics_endpoint.parse().map_err(|e| format!("{e}"))?;
    let queue = Arc::new(SpanQueue {
        q: ArrayQueue::new(s.queue),
        batch: s.batch,
        ready: Notify::new(),
        full: metrics::counter!(TOLLGATE_OTEL_DROPPED_SPANS_TOTAL, "reason" => "queue_full"),
    });
    let (out_tx, out_rx) = mpsc::channel(OUTBOX);
    let (ctl_tx, ctl_rx) = mpsc::channel(4);
    let sender = Sender {
        client: HyperClient::new(s.timeout, s.protocol),
        headers: s.headers.clone(),
        traces,
        metrics: metrics_url,
        failed: metrics::counter!(TOLLGATE_OTEL_DROPPED_SPANS_TOTAL, "reason" => "export_failed"),
        failing: false,
    };
    rt.spawn(sender.run(out_rx));
    let worker = Worker {
        queue: queue.clone(),
        out: out_tx,
        batch: s.batch,
        delay: s.schedule_delay,
        metric_interval: s.metric_interval,
        prefix: fixed.resource.len() + fixed.scope.len() + 32,
        fixed,
        spans: Vec::new(),
        last_batch: 0,
        blocks: Blocks::default(),
        in_batch: 0,
        aggregates: Aggregates::new(now_ns()),
        full: queue.full.clone(),
    };
    rt.spawn(worker.run(ctl_rx));
    Ok((queue, Control(ctl_tx)))
}

/// Room left in a batch's buffer below which it is handed off before the next request's spans
/// are added (a request with a few attempts encodes to a few KiB).
const ROOM_PER_REQUEST: usize = 8 * 1024;

struct Worker {
    queue: Arc<SpanQueue>,
    out: mpsc::Sender<Out>,
    batch: usize,
    delay: Duration,
    metric_interval: Duration,
    fixed: Fixed,
    /// The batch being built: `prefix` bytes kept free for the request's head (written at
    /// hand-off, so the spans are never copied or moved), then the encoded `Span` fields.
    spans: Vec<u8>,
    prefix: usize,
    blocks: Blocks,
    /// Bytes of the last batch handed off (the next one is reserved at 5/4 of it).
    last_batch: usize,
    in_batch: u64,
    aggregates: Aggregates,
    full: metrics::Counter,
}

impl Worker {
    async fn run(mut self, mut ctl: mpsc::Receiver<oneshot::Sender<()>>) {
        let mut due = tokio::time::Instant::now() + self.delay;
        let mut metrics_due = tokio::time::Instant::now() + self.metric_interval;
        let queue = self.queue.clone();
        loop {
            tokio::select! {
                biased;
                done = ctl.recv() => {
                    let Some(done) = done else {
                        // The exporter was replaced or shut down: send what is left.
                        self.drain(true).await;
                        self.metrics(true).await;
                        return;
                    };
                    self.drain(true).await;
                    self.metrics(true).await;
                    let _ = self.out.send(Out::Ack(done)).await;
                }
                _ = queue.ready.notified() => self.drain(false).await,
                _ = tokio::time::sleep_until(due) => {
                    self.drain(false).await;
                    self.hand_off(false).await;
                    due = tokio::time::Instant::now() + self.delay;
                }
                _ = tokio::time::sleep_until(metrics_due) => {
                    self.drain(false).await;
                    self.metrics(false).await;
                    metrics_due = tokio::time::Instant::now() + self.metric_interval;
                }
            }
        }
    }

    /// Takes everything queued: metrics for all, spans for the sampled, batches handed off as
    /// they fill (`wait`: for room in the outbox, as a flush does, instead of dropping).
    async fn drain(&mut self, wait: bool) {
        // The wall clock, read once for what this drain takes (see `Wall`).
        let mut wall: Option<Wall> = None;
        while let Some(t) = self.queue.q.pop() {
            let f = &t.f;
            self.aggregates.observe(f);
            if f.ids.sampled {
                if self.spans.capacity() - self.spans.len() < ROOM_PER_REQUEST && self.in_batch > 0
                {
                    // Out of the room reserved: sent as it is rather than copied to grow.
                    self.hand_off(wait).await;
                }
                if self.spans.is_empty() {
                    // Sized like the last batch and at least 2 KiB a span (1 KiB was too
                    // little for the bench request's spans): a growing batch would be copied at
                    // each doubling.
                    let first = self.batch.min(4096) * 2048;
                    // Never below the first guess: a small batch (a timer's flush of a few
                    // requests) must not make the next one small too.
                    self.spans.reserve(self.last_batch.max(first));
                    self.spans.resize(self.prefix, 0);
                }
                let wall = wall.get_or_insert_with(Wall::now);
                encode_spans(&mut self.blocks, &mut self.spans, f, wall);
                self.in_batch += spans_of(f);
            }
            if self.in_batch >= self.batch as u64 {
                self.hand_off(wait).await;
            }
        }
        if wait {
            self.hand_off(true).await;
        }
    }

    /// Writes the request's head in front of the batch's spans and gives it to the sender.
    async fn hand_off(&mut self, wait: bool) {
        if self.in_batch == 0 {
            return;
        }
        // ExportTraceServiceRequest.resource_spans = 1: { resource 1, scope_spans 2: { scope 1,
        // spans 2 } }
        let spans_len = self.spans.len() - self.prefix;
        let (res, scope) = (&self.fixed.resource, &self.fixed.scope);
        let (res_head, rn) = proto::head(1, res.len());
        let (scope_head, sn) = proto::head(1, scope.len());
        let scope_spans = sn + scope.len() + spans_len;
        let (ss_head, ssn) = proto::head(2, scope_spans);
        let resource_spans = rn + res.len() + ssn + scope_spans;
        let (rs_head, rsn) = proto::head(1, resource_spans);
        let mut head = Vec::with_capacity(self.prefix);
        head.extend_from_slice(&rs_head[..rsn]);
        head.extend_from_slice(&res_head[..rn]);
        head.extend_from_slice(res);
        head.extend_from_slice(&ss_head[..ssn]);
        head.extend_from_slice(&scope_head[..sn]);
        head.extend_from_slice(scope);
        let start = self.prefix - head.len();
        self.spans[start..self.prefix].copy_from_slice(&head);
        self.last_batch = self.spans.len() + self.spans.len() / 4;
        let body = Bytes::from(std::mem::take(&mut self.spans)).slice(start..);
        let n = std::mem::take(&mut self.in_batch);
        self.send(Out::Spans(body, n), wait).await;
    }

    async fn metrics(&mut self, wait: bool) {
        let body = self
            .aggregates
            .encode(&self.fixed.resource, &self.fixed.scope, now_ns());
        // Cumulative: an export skipped while the outbox is full is made good by the next.
        self.send(Out::Metrics(Bytes::from(body)), wait).await;
    }

    async fn send(&mut self, o: Out, wait: bool) {
        if wait {
            let _ = self.out.send(o).await;
            return;
        }
        if let Err(mpsc::error::TrySendError::Full(Out::Spans(_, n))) = self.out.try_send(o) {
            self.full.increment(n);
        }
    }
}

struct Sender {
    client: HyperClient,
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
    traces: Uri,
    metrics: Uri,
    failed: metrics::Counter,
    /// The last export failed (log the change only, not every failure).
    failing: bool,
}

impl Sender {
    async fn run(mut self, mut rx: mpsc::Receiver<Out>) {
        while let Some(o) = rx.recv().await {
            match o {
                Out::Ack(done) => {
                    let _ = done.send(());
                }
                Out::Spans(body, n) => {
                    let r = self.client.post(&self.traces, &self.headers, body).await;
                    if r.is_err() {
                        self.failed.increment(n);
                    }
                    self.note(r, "span");
                }
                Out::Metrics(body) => {
                    let r = self.client.post(&self.metrics, &self.headers, body).await;
                    self.note(r, "metric");
                }
            }
        }
    }

    fn note(&mut self, r: Result<(), String>, what: &str) {
        match r {
            Err(e) if !self.failing => {
                self.failing = true;
                tracing::warn!(
                    error = %e,
                    "opentelemetry: {what} export failed; dropping spans until the collector answers"
                );
            }
            Ok(()) if self.failing => {
                self.failing = false;
                tracing::info!("opentelemetry: export works again");
            }
            _ => {}
        }
    }
}
