//! The way out: each thread's batch of encoded spans and its metrics, the export task that
//! takes them (spans every schedule delay, metrics every interval), and the task that posts to
//! the collector: over its own HTTP/1.1 connection to an `http://` collector ([`Plain`]), or
//! through hyper + rustls for `https://` and gRPC.
//!
//! A finished request is recorded on the thread where it ended ([`Batches::record`]): its
//! spans encoded into the thread's batch and its metrics added to the thread's aggregates, so
//! nothing per request crosses to another thread (no record to queue, copy or free
//! elsewhere). The thread keeps that work in a slot of its own, which it takes and puts back
//! around each request and the export task takes every schedule delay: one atomic swap of a
//! pointer each, never a lock, and nothing on the request path wakes a task. A batch that
//! fills goes to the sender task from the thread, through a short channel; when that is full
//! (the collector is slow or down) the batch is dropped and its spans counted. Nothing waits
//! on the network: each post is bounded by the timeout, with no retries.

use super::config::{Protocol, Settings};
use super::encode::{encode_spans, Blocks};
use super::metrics::Aggregates;
use super::plain::Plain;
use super::proto;
use super::spans::{now_ns, Decision, Finished, Wall};
use crate::telemetry::names::TOLLGATE_OTEL_DROPPED_SPANS_TOTAL;
use bytes::Bytes;
use crossbeam_utils::atomic::AtomicCell;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Largest collector answer read (it is a small protobuf status).
const MAX_ANSWER: usize = 64 * 1024;

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
            .with_tls_config(crate::tls::client_config())
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

/// What one thread encoded and measured since the export task last took it: the batch of
/// spans it is building (`prefix` bytes kept free in front for the request's head, written at
/// hand-off, so the spans are never copied or moved) and the metrics of its requests.
struct Pending {
    spans: Vec<u8>,
    /// Spans in `spans`.
    in_batch: u64,
    aggregates: Aggregates,
    /// The wall clock when this began: it places the spans' monotonic instants (see [`Wall`]).
    wall: Wall,
}

/// A thread's [`Pending`]: the thread takes it out and puts it back around each request it
/// ends, and the export task takes it on its ticks, each with one atomic swap of a pointer
/// (no lock, no wake-up). Whoever finds it empty starts a new one (the thread) or moves on
/// (the export task).
#[derive(Default)]
struct Slot(AtomicCell<Option<Box<Pending>>>);

/// The exporter's end the request path reaches: where a thread's slot is registered, and
/// what a thread needs to hand a full batch to the sender itself.
pub(crate) struct Batches {
    /// Tells this exporter from one installed before or after it (a thread's slot belongs
    /// to one).
    id: u64,
    out: mpsc::Sender<Out>,
    fixed: Fixed,
    /// Bytes kept free in front of a batch for its head.
    prefix: usize,
    batch: usize,
    /// Every thread's slot (registered once per thread; a slot whose thread is gone is
    /// emptied and dropped by the export task).
    slots: Mutex<Vec<Arc<Slot>>>,
    full: metrics::Counter,
}

impl std::fmt::Debug for Batches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batches")
            .field("id", &self.id)
            .finish_non_exhaustive()
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

/// What a thread keeps for the spans it encodes: the memo of repeating attributes and the
/// span templates ([`Blocks`]), and its slot with the exporter it belongs to.
struct Local {
    blocks: Blocks,
    slot: Option<(u64, Arc<Slot>)>,
}

thread_local! {
    static LOCAL: RefCell<Local> = RefCell::new(Local {
        blocks: Blocks::default(),
        slot: None,
    });
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Batches {
    fn new(fixed: Fixed, batch: usize, out: mpsc::Sender<Out>) -> Batches {
        Batches {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            out,
            prefix: fixed.resource.len() + fixed.scope.len() + 32,
            fixed,
            batch: batch.max(1),
            slots: Mutex::new(Vec::new()),
            full: metrics::counter!(TOLLGATE_OTEL_DROPPED_SPANS_TOTAL, "reason" => "queue_full"),
        }
    }

    /// Records a finished request where it ended: its metrics into the thread's aggregates
    /// and, when sampled, its spans encoded into the thread's batch, which goes to the sender
    /// once full (dropped and counted when the sender's outbox is full). Nothing is queued per
    /// request and nothing crosses to another thread but full batches.
    pub(crate) fn record(&self, f: &Finished, d: &Decision<'_>) {
        LOCAL.with(|l| {
            let Ok(mut l) = l.try_borrow_mut() else {
                self.full.increment(spans_of(f));
                return;
            };
            let Local { blocks, slot } = &mut *l;
            if !matches!(slot, Some((id, _)) if *id == self.id) {
                // Once per thread (and per exporter installed).
                let s = Arc::new(Slot::default());
                lock(&self.slots).push(s.clone());
                *slot = Some((self.id, s));
            }
            let Some((_, slot)) = slot.as_ref() else {
                return;
            };
            let mut p = slot.0.take().unwrap_or_else(|| {
                Box::new(Pending {
                    spans: Vec::new(),
                    in_batch: 0,
                    aggregates: Aggregates::new(0),
                    wall: Wall::now(),
                })
            });
            p.aggregates.observe(f, d);
            if f.ids.sampled {
                if p.spans.capacity() - p.spans.len() < ROOM_PER_REQUEST && p.in_batch > 0 {
                    // Out of the room reserved: sent as it is rather than copied to grow.
                    self.hand_off(&mut p);
                }
                if p.spans.is_empty() {
                    // At least 2 KiB a span (1 KiB was too little for the bench request's
                    // spans): a growing batch would be copied at each doubling.
                    p.spans.reserve(self.prefix + self.batch.min(4096) * 2048);
                    p.spans.resize(self.prefix, 0);
                }
                encode_spans(blocks, &mut p.spans, f, d, &p.wall);
                p.in_batch += spans_of(f);
                if p.in_batch >= self.batch as u64 {
                    self.hand_off(&mut p);
                }
            }
            slot.0.store(Some(p));
        });
    }

    /// Gives `p`'s batch to the sender without waiting (dropped and counted when its outbox
    /// is full: the collector is slow or down).
    fn hand_off(&self, p: &mut Pending) {
        if p.in_batch == 0 {
            return;
        }
        let n = std::mem::take(&mut p.in_batch);
        let body = self.seal(std::mem::take(&mut p.spans));
        if self.out.try_send(Out::Spans(body, n)).is_err() {
            self.full.increment(n);
        }
    }

    /// Writes the request's head in front of a batch's spans.
    fn seal(&self, mut spans: Vec<u8>) -> Bytes {
        // ExportTraceServiceRequest.resource_spans = 1: { resource 1, scope_spans 2: { scope 1,
        // spans 2 } }
        let spans_len = spans.len() - self.prefix;
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
        spans[start..self.prefix].copy_from_slice(&head);
        Bytes::from(spans).slice(start..)
    }

    /// Takes every thread's pending work, and forgets the slots of threads that are gone.
    fn take_all(&self) -> Vec<Pending> {
        let mut taken = Vec::new();
        lock(&self.slots).retain(|s| {
            if let Some(p) = s.0.take() {
                taken.push(*p);
            }
            // Held by its thread too while the thread lives (and uses this exporter).
            Arc::strong_count(s) > 1
        });
        taken
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the sender posts.
enum Out {
    Spans(Bytes, u64),
    Metrics(Bytes),
    /// Everything before it was posted (a flush).
    Ack(oneshot::Sender<()>),
}

/// Asks the export task to take, encode and post everything now, and to answer when done.
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

/// Starts the export and sender tasks on the current runtime; returns the threads' end
/// ([`Batches`]) and the control.
pub(super) fn start(s: &Settings, fixed: Fixed) -> Result<(Arc<Batches>, Control), String> {
    let rt = tokio::runtime::Handle::try_current()
        .map_err(|_| "no Tokio runtime to export from".to_string())?;
    let traces: Uri = s.traces_endpoint.parse().map_err(|e| format!("{e}"))?;
    let metrics_url: Uri = s.metrics_endpoint.parse().map_err(|e| format!("{e}"))?;
    // Encoded exports waiting for the sender, each up to a batch of spans (or one metric
    // export): as many batches as the queue size holds.
    let (out_tx, out_rx) = mpsc::channel((s.queue / s.batch.max(1)).max(1));
    let batches = Arc::new(Batches::new(fixed, s.batch, out_tx));
    let (ctl_tx, ctl_rx) = mpsc::channel(4);
    let plain = match s.protocol {
        Protocol::Grpc => None,
        _ => Plain::new(&traces, &s.headers, s.timeout).zip(Plain::new(
            &metrics_url,
            &s.headers,
            s.timeout,
        )),
    };
    let client = match plain {
        Some((traces, metrics)) => Collector::Plain { traces, metrics },
        None => Collector::Hyper {
            client: Box::new(HyperClient::new(s.timeout, s.protocol)),
            headers: s.headers.clone(),
            traces,
            metrics: metrics_url,
        },
    };
    let sender = Sender {
        client,
        failed: metrics::counter!(TOLLGATE_OTEL_DROPPED_SPANS_TOTAL, "reason" => "export_failed"),
        failing: false,
    };
    rt.spawn(sender.run(out_rx));
    let worker = Worker {
        batches: batches.clone(),
        delay: s.schedule_delay,
        metric_interval: s.metric_interval,
        aggregates: Aggregates::new(now_ns()),
    };
    rt.spawn(worker.run(ctl_rx));
    Ok((batches, Control(ctl_tx)))
}

/// Room left in a batch's buffer below which it is handed off before the next request's spans
/// are added (a request with a few attempts encodes to a few KiB).
const ROOM_PER_REQUEST: usize = 8 * 1024;

/// The export task: every schedule delay it takes what the threads have pending and sends
/// their batches; every metric interval, the metrics (cumulative, from all threads' since
/// the start).
struct Worker {
    batches: Arc<Batches>,
    delay: Duration,
    metric_interval: Duration,
    aggregates: Aggregates,
}

impl Worker {
    async fn run(mut self, mut ctl: mpsc::Receiver<oneshot::Sender<()>>) {
        let mut due = tokio::time::Instant::now() + self.delay;
        let mut metrics_due = tokio::time::Instant::now() + self.metric_interval;
        loop {
            tokio::select! {
                biased;
                done = ctl.recv() => {
                    let Some(done) = done else {
                        // The exporter was replaced or shut down: send what is left.
                        self.collect(true).await;
                        self.metrics(true).await;
                        return;
                    };
                    self.collect(true).await;
                    self.metrics(true).await;
                    let _ = self.batches.out.send(Out::Ack(done)).await;
                }
                _ = tokio::time::sleep_until(due) => {
                    self.collect(false).await;
                    due = tokio::time::Instant::now() + self.delay;
                }
                _ = tokio::time::sleep_until(metrics_due) => {
                    self.collect(false).await;
                    self.metrics(false).await;
                    metrics_due = tokio::time::Instant::now() + self.metric_interval;
                }
            }
        }
    }

    /// Takes every thread's pending work: its metrics into the totals, its spans to the sender
    /// (`wait`: for room in the outbox, as a flush does, instead of dropping).
    async fn collect(&mut self, wait: bool) {
        for p in self.batches.take_all() {
            if !p.aggregates.is_empty() {
                self.aggregates.merge(&p.aggregates);
            }
            if p.in_batch > 0 {
                let body = self.batches.seal(p.spans);
                self.send(Out::Spans(body, p.in_batch), wait).await;
            }
        }
    }

    async fn metrics(&mut self, wait: bool) {
        let body = self.aggregates.encode(
            &self.batches.fixed.resource,
            &self.batches.fixed.scope,
            now_ns(),
        );
        // Cumulative: an export skipped while the outbox is full is made good by the next.
        self.send(Out::Metrics(Bytes::from(body)), wait).await;
    }

    async fn send(&mut self, o: Out, wait: bool) {
        if wait {
            let _ = self.batches.out.send(o).await;
            return;
        }
        if let Err(mpsc::error::TrySendError::Full(Out::Spans(_, n))) = self.batches.out.try_send(o)
        {
            self.batches.full.increment(n);
        }
    }
}

/// How the sender reaches the collector: a cleartext OTLP/HTTP collector over our own
/// HTTP/1.1 connection per endpoint ([`Plain`]: about a fifth of hyper's client's work per
/// export); `https://` and gRPC through hyper.
enum Collector {
    Plain {
        traces: Plain,
        metrics: Plain,
    },
    Hyper {
        client: Box<HyperClient>,
        headers: Vec<(http::HeaderName, http::HeaderValue)>,
        traces: Uri,
        metrics: Uri,
    },
}

impl Collector {
    async fn post(&mut self, spans: bool, body: Bytes) -> Result<(), String> {
        match self {
            Collector::Plain { traces, metrics } => {
                if spans { traces } else { metrics }.post(&body).await
            }
            Collector::Hyper {
                client,
                headers,
                traces,
                metrics,
            } => {
                let url = if spans { traces } else { metrics };
                client.post(url, headers, body).await
            }
        }
    }
}

struct Sender {
    client: Collector,
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
                    let r = self.client.post(true, body).await;
                    if r.is_err() {
                        self.failed.increment(n);
                    }
                    self.note(r, "span");
                }
                Out::Metrics(body) => {
                    let r = self.client.post(false, body).await;
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

#[cfg(test)]
mod tests {
    use super::super::context::Sampler;
    use super::super::spans::{Decision, Outcome, RequestTrace};
    use super::{Batches, Fixed, Out};
    use crate::governor::{CallSpec, Record};
    use std::sync::Arc;
    use tokio::sync::mpsc;

    /// The batches of an exporter whose sender's outbox holds `outbox` exports, and the
    /// outbox's receiving end.
    fn setup(batch: usize, outbox: usize) -> (Arc<Batches>, mpsc::Receiver<Out>) {
        let (tx, rx) = mpsc::channel(outbox);
        let (mut resource, mut scope) = (Vec::new(), Vec::new());
        super::proto::Writer(&mut resource).attr_str(1, "service.name", "t");
        super::proto::Writer(&mut scope).string(1, "tollgate");
        let fixed = Fixed { resource, scope };
        (Arc::new(Batches::new(fixed, batch, tx)), rx)
    }

    /// A served request's trace (a server span and one attempt's) with its record.
    fn request() -> (Box<RequestTrace>, Record) {
        let p = crate::policy::from_str(
            "version: v\nbackends:\n  - {id: b, kind: openai, base_url: 'http://h:9/v1'}\nroutes:\n  - model: chat\n    chain: [{backend: b, model: m}]\n",
            "p.yaml",
        )
        .unwrap();
        let model: Arc<str> = Arc::from("m");
        let mut t = Box::new(RequestTrace::start(
            Sampler::AlwaysOn,
            &http::HeaderMap::new(),
            "/v1/chat/completions",
            "chat",
        ));
        let a = t.attempt(&CallSpec {
            backend: &p.backends[0],
            backend_index: 0,
            model: &model,
            output_cap_field: None,
            max_output_tokens: 10,
            attempt: 1,
            probe: false,
        });
        t.end_attempt(a, Outcome::Served);
        let rec = Record::test_chat("b");
        (t, rec)
    }

    /// Decodes a trace export and counts its spans.
    fn spans_in(body: &[u8]) -> usize {
        use prost::Message;
        let req =
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest::decode(
                body,
            )
            .unwrap();
        let rs = &req.resource_spans[0];
        assert_eq!(rs.scope_spans[0].scope.as_ref().unwrap().name, "tollgate");
        rs.scope_spans.iter().map(|s| s.spans.len()).sum()
    }

    #[test]
    fn a_threads_pending_work_is_taken_after_the_thread_ended_and_its_slot_forgotten() {
        let (q, _rx) = setup(512, 4);
        let (t, rec) = request();
        let on_thread = q.clone();
        std::thread::spawn(move || {
            for _ in 0..3 {
                on_thread.record(&t.f, &Decision::of(&rec));
            }
        })
        .join()
        .unwrap();
        // This thread records too, and lives on.
        let (t, rec) = request();
        q.record(&t.f, &Decision::of(&rec));
        assert_eq!(super::lock(&q.slots).len(), 2);
        let mut taken = q.take_all();
        taken.sort_by_key(|p| p.in_batch);
        // Each request: its server span and its attempt's.
        assert_eq!(taken.iter().map(|p| p.in_batch).collect::<Vec<_>>(), [2, 6]);
        assert!(taken.iter().all(|p| !p.aggregates.is_empty()));
        // The ended thread's slot is gone; this thread's stays, empty until it records again.
        assert_eq!(super::lock(&q.slots).len(), 1);
        assert!(q.take_all().is_empty());
        q.record(&t.f, &Decision::of(&rec));
        assert_eq!(q.take_all().len(), 1);
        // What was taken is a whole export.
        let p = taken.pop().unwrap();
        assert_eq!(spans_in(&q.seal(p.spans)), 6);
    }

    #[test]
    fn a_full_batch_goes_to_the_sender_from_the_thread_and_a_full_outbox_drops_it() {
        // A batch of two spans (one request's); an outbox of one export.
        let (q, mut rx) = setup(2, 1);
        let (t, rec) = request();
        q.record(&t.f, &Decision::of(&rec));
        let Ok(Out::Spans(body, n)) = rx.try_recv() else {
            panic!("the full batch was not handed to the sender");
        };
        assert_eq!((n, spans_in(&body)), (2, 2));
        // The outbox is full after the next; the one after is dropped, and nothing is left
        // pending.
        q.record(&t.f, &Decision::of(&rec));
        q.record(&t.f, &Decision::of(&rec));
        assert!(matches!(rx.try_recv(), Ok(Out::Spans(_, 2))));
        assert!(rx.try_recv().is_err());
        assert!(q.take_all().iter().all(|p| p.in_batch == 0));
    }

    #[test]
    fn an_exporter_installed_after_another_gets_its_own_slot_on_each_thread() {
        let (a, _ra) = setup(512, 4);
        let (b, _rb) = setup(512, 4);
        let (t, rec) = request();
        a.record(&t.f, &Decision::of(&rec));
        b.record(&t.f, &Decision::of(&rec));
        // The thread moved to `b`: `a`'s slot is left with what was recorded there, for `a`
        // to take (and then forget); `b` has its own.
        let from_a = a.take_all();
        assert_eq!(from_a.iter().map(|p| p.in_batch).sum::<u64>(), 2);
        assert!(super::lock(&a.slots).is_empty());
        assert_eq!(b.take_all().iter().map(|p| p.in_batch).sum::<u64>(), 2);
    }
}
