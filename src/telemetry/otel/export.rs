//! The way out: an OTLP/HTTP client on our own hyper + rustls stack, a bounded span queue
//! drained by a background task, and the periodic metric reader.
//!
//! The request path only ever `try_send`s a finished span into the queue: when it is full the
//! span is dropped and counted. The task exports in batches (when a batch fills, or every
//! schedule delay), each export bounded by the timeout; a failed batch is dropped and counted.

use super::config::Settings;
use crate::telemetry::names::TOLLGATE_OTEL_DROPPED_SPANS_TOTAL;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use opentelemetry::Context;
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Largest collector answer read (it is a small protobuf status).
const MAX_ANSWER: usize = 64 * 1024;

/// The exporter's HTTP client: hyper with the rustls connector the upstream calls use.
#[derive(Clone)]
pub(super) struct HyperClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
}

impl std::fmt::Debug for HyperClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HyperClient").finish_non_exhaustive()
    }
}

impl HyperClient {
    pub(super) fn new(timeout: Duration) -> Self {
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
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(4)
            .build(https);
        HyperClient { client, timeout }
    }

    async fn send(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let req = Request::from_parts(parts, Full::new(body));
        let call = async {
            let resp = self.client.request(req).await?;
            let (parts, body) = resp.into_parts();
            let body = Limited::new(body, MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| -> HttpError { e.to_string().into() })?
                .to_bytes();
            Ok::<_, HttpError>(Response::from_parts(parts, body))
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err("OTLP export timed out".into()),
        }
    }
}

impl HttpClient for HyperClient {
    fn send_bytes<'a, 'b>(
        &'a self,
        request: Request<Bytes>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<Bytes>, HttpError>> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        Box::pin(self.send(request))
    }
}

/// Asks the queue's task to export everything queued now.
#[derive(Debug, Clone)]
pub(super) struct Control(mpsc::Sender<oneshot::Sender<()>>);

impl Control {
    pub(super) async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.0.send(tx).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// The span processor the tracer calls: a non-blocking hand-off into the bounded queue.
#[derive(Debug)]
pub(super) struct Queue {
    tx: mpsc::Sender<SpanData>,
    full: metrics::Counter,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.tx.try_send(span).is_err() {
            self.full.increment(1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Starts the span queue's task on the current runtime.
pub(super) fn start(
    s: &Settings,
    client: HyperClient,
    resource: &Resource,
) -> Result<(Queue, Control), String> {
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(s.traces_endpoint.clone())
        .with_timeout(s.timeout)
        .with_retry_policy(opentelemetry_otlp::RetryPolicy::disabled())
        .build()
        .map_err(|e| format!("OTLP span exporter: {e}"))?;
    exporter.set_resource(resource);
    let (tx, rx) = mpsc::channel(s.queue);
    let (ctl_tx, ctl_rx) = mpsc::channel(4);
    let failed = metrics::counter!(TOLLGATE_OTEL_DROPPED_SPANS_TOTAL, "reason" => "export_failed");
    let full = metrics::counter!(TOLLGATE_OTEL_DROPPED_SPANS_TOTAL, "reason" => "queue_full");
    let worker = Worker {
        exporter,
        batch: s.batch,
        delay: s.schedule_delay,
        timeout: s.timeout,
        failed,
        failing: false,
    };
    tokio::runtime::Handle::try_current()
        .map_err(|_| "no Tokio runtime to export from".to_string())?
        .spawn(worker.run(rx, ctl_rx));
    Ok((Queue { tx, full }, Control(ctl_tx)))
}

struct Worker<E> {
    exporter: E,
    batch: usize,
    delay: Duration,
    timeout: Duration,
    failed: metrics::Counter,
    /// The last export failed (log the change only, not every failure).
    failing: bool,
}

impl<E: SpanExporter> Worker<E> {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<SpanData>,
        mut ctl: mpsc::Receiver<oneshot::Sender<()>>,
    ) {
        let mut buf = Vec::with_capacity(self.batch);
        let mut due = tokio::time::Instant::now() + self.delay;
        loop {
            tokio::select! {
                biased;
                done = ctl.recv() => {
                    let Some(done) = done else { return };
                    while let Ok(s) = rx.try_recv() {
                        buf.push(s);
                        if buf.len() >= self.batch {
                            self.export(&mut buf).await;
                        }
                    }
                    self.export(&mut buf).await;
                    let _ = done.send(());
                }
                n = rx.recv_many(&mut buf, self.batch), if buf.len() < self.batch => {
                    if n == 0 {
                        self.export(&mut buf).await;
                        return;
                    }
                    if buf.len() >= self.batch {
                        self.export(&mut buf).await;
                        due = tokio::time::Instant::now() + self.delay;
                    }
                }
                _ = tokio::time::sleep_until(due) => {
                    self.export(&mut buf).await;
                    due = tokio::time::Instant::now() + self.delay;
                }
            }
        }
    }

    async fn export(&mut self, buf: &mut Vec<SpanData>) {
        if buf.is_empty() {
            return;
        }
        let n = buf.len() as u64;
        let batch = std::mem::replace(buf, Vec::with_capacity(self.batch));
        let ok = matches!(
            tokio::time::timeout(self.timeout, self.exporter.export(batch)).await,
            Ok(Ok(()))
        );
        if !ok {
            self.failed.increment(n);
            if !self.failing {
                tracing::warn!(
                    spans = n,
                    "opentelemetry: span export failed; dropping spans until the collector answers"
                );
            }
        } else if self.failing {
            tracing::info!("opentelemetry: span export works again");
        }
        self.failing = !ok;
    }
}

/// The meter provider with a periodic OTLP reader on the current runtime.
pub(super) fn meters(
    s: &Settings,
    client: HyperClient,
    resource: Resource,
) -> Result<SdkMeterProvider, String> {
    let exporter = opentelemetry_otlp::MetricExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(s.metrics_endpoint.clone())
        .with_timeout(s.timeout)
        .with_retry_policy(opentelemetry_otlp::RetryPolicy::disabled())
        .build()
        .map_err(|e| format!("OTLP metric exporter: {e}"))?;
    let reader = PeriodicReader::builder(exporter, opentelemetry_sdk::runtime::Tokio)
        .with_interval(s.metric_interval)
        .with_timeout(s.timeout)
        .build();
    Ok(SdkMeterProvider::builder()
        .with_resource(resource)
        .with_reader(reader)
        .build())
}
