//! OpenTelemetry export (OTLP/HTTP, protobuf): one server span per governed request joined to
//! the caller's W3C trace, one client span per upstream attempt, and the GenAI client metrics.
//! Attributes follow the GenAI semantic conventions v1.37.0 (`gen_ai.provider.name`); see
//! docs/opentelemetry.md. Never a prompt, a completion or a key.
//!
//! Off unless an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or the policy's
//! `telemetry.otlp.endpoint`). Off costs one relaxed atomic load per request: the request path
//! checks [`enabled`] before anything else. On, spans go into a bounded queue that a
//! background task drains ([`export`]); a full queue or a failed export drops spans and counts
//! them in `tollgate_otel_dropped_spans_total`, never slowing or failing a request.
//!
//! The request's trace lives in a task-local for the duration of the governed call, so the
//! transport starts its attempt spans under it without new parameters; a stream takes it with
//! [`take`] and finishes it when the stream ends.

mod config;
mod export;
mod notes;
mod spans;

pub use config::{settings, Protocol, Settings};
pub use spans::{Attempt, RequestTrace};

use crate::estimate::Endpoint;
use arc_swap::ArcSwapOption;
use opentelemetry::metrics::{Histogram, MeterProvider as _};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use std::cell::RefCell;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The installed exporter: tracer, meters and the span queue's control.
pub struct Otel {
    tracer: SdkTracer,
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
    queue: export::Control,
    pub(crate) instruments: Instruments,
}

impl std::fmt::Debug for Otel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Otel").finish_non_exhaustive()
    }
}

/// The GenAI client metrics (semconv names and recommended buckets).
pub(crate) struct Instruments {
    pub tokens: Histogram<u64>,
    pub duration: Histogram<f64>,
    pub first_chunk: Histogram<f64>,
}

static ON: AtomicBool = AtomicBool::new(false);
static OTEL: ArcSwapOption<Otel> = ArcSwapOption::const_empty();

tokio::task_local! {
    static REQUEST: RefCell<Option<RequestTrace>>;
}

/// Whether export is on: the request path's only check when it is off.
#[inline]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The installed exporter, if any.
pub fn get() -> Option<Arc<Otel>> {
    if !enabled() {
        return None;
    }
    OTEL.load_full()
}

/// Builds the exporter from `s` and installs it process-wide (replacing any before it).
/// Must run inside a Tokio runtime: the span queue and the metric reader are tasks on it.
pub fn install(s: &Settings) -> Result<(), String> {
    // The drop counters live in the Prometheus recorder: install it first.
    let _ = crate::telemetry::global();
    let o = build(s)?;
    OTEL.store(Some(Arc::new(o)));
    ON.store(true, Ordering::Release);
    tracing::info!(
        traces = %s.traces_endpoint, metrics = %s.metrics_endpoint,
        "opentelemetry: exporting traces and metrics over OTLP/HTTP"
    );
    Ok(())
}

/// Reads the `OTEL_*` variables over the policy's `telemetry.otlp` section and installs the
/// exporter when an endpoint is configured. Errors are logged: telemetry never stops serving.
pub fn init(policy: &crate::policy::Policy) {
    let env = |k: &str| std::env::var(k).ok();
    match settings(&env, &policy.telemetry.otlp) {
        Ok(None) => {}
        Ok(Some(s)) => {
            if let Err(e) = install(&s) {
                tracing::error!(error = %e, "opentelemetry: export is off");
            }
        }
        Err(e) => tracing::error!(error = %e, "opentelemetry: export is off"),
    }
}

/// Sends what is queued (spans, then metrics), waiting at most `within`.
pub async fn flush(within: Duration) {
    let Some(o) = OTEL.load_full() else { return };
    flush_one(&o, within).await;
}

async fn flush_one(o: &Otel, within: Duration) {
    let _ = tokio::time::timeout(within, o.queue.flush()).await;
    let mp = o.meter_provider.clone();
    // The SDK's flush blocks on the reader task: off the runtime's threads.
    let job = tokio::task::spawn_blocking(move || mp.force_flush());
    if let Ok(Ok(Err(e))) = tokio::time::timeout(within, job).await {
        tracing::debug!(error = %e, "opentelemetry: metric flush failed");
    }
}

/// Turns export off, flushing what is queued (bounded by `within`). For `serve`'s shutdown.
pub async fn shutdown(within: Duration) {
    ON.store(false, Ordering::Release);
    let Some(o) = OTEL.swap(None) else { return };
    flush_one(&o, within).await;
    let (tp, mp) = (o.tracer_provider.clone(), o.meter_provider.clone());
    let job = tokio::task::spawn_blocking(move || {
        let _ = tp.shutdown();
        let _ = mp.shutdown();
    });
    let _ = tokio::time::timeout(within, job).await;
}

fn build(s: &Settings) -> Result<Otel, String> {
    let resource = s.resource();
    let client = export::HyperClient::new(s.timeout);
    let (processor, queue) = export::start(s, client.clone(), &resource)?;
    let mut tp = SdkTracerProvider::builder()
        .with_resource(resource.clone())
        .with_span_processor(processor);
    if let Some(sampler) = s.sampler() {
        tp = tp.with_sampler(sampler);
    }
    let tracer_provider = tp.build();
    let tracer = tracer_provider.tracer("tollgate");
    let meter_provider = export::meters(s, client, resource)?;
    let meter = meter_provider.meter("tollgate");
    let instruments = Instruments {
        tokens: meter
            .u64_histogram("gen_ai.client.token.usage")
            .with_unit("{token}")
            .with_description("Number of input and output tokens used")
            .with_boundaries(vec![
                1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0,
                4194304.0, 16777216.0, 67108864.0,
            ])
            .build(),
        duration: meter
            .f64_histogram("gen_ai.client.operation.duration")
            .with_unit("s")
            .with_description("GenAI operation duration (one upstream attempt)")
            .with_boundaries(DURATION_BOUNDS.to_vec())
            .build(),
        first_chunk: meter
            .f64_histogram("gen_ai.client.operation.time_to_first_chunk")
            .with_unit("s")
            .with_description(
                "Time to the first chunk of a streamed answer, from the attempt's start",
            )
            .with_boundaries(DURATION_BOUNDS.to_vec())
            .build(),
    };
    Ok(Otel {
        tracer,
        tracer_provider,
        meter_provider,
        queue,
        instruments,
    })
}

/// The semconv's recommended boundaries for GenAI durations, seconds.
const DURATION_BOUNDS: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

impl Otel {
    /// Starts a governed request's server span, continuing the caller's
    /// `traceparent`/`tracestate` from `headers`.
    pub fn start(self: &Arc<Self>, headers: &http::HeaderMap, e: Endpoint) -> RequestTrace {
        let (path, op) = match e {
            Endpoint::Chat => ("/v1/chat/completions", "chat"),
            Endpoint::Completions => ("/v1/completions", "text_completion"),
            Endpoint::Embeddings => ("/v1/embeddings", "embeddings"),
        };
        RequestTrace::start(self, headers, path, op)
    }
}

/// Runs `fut` (a governed request) under `trace`. The server span ends in [`finish`] or, for
/// a stream, when the stream [`take`]s it and ends.
pub async fn scope<F: Future>(trace: RequestTrace, fut: F) -> F::Output {
    REQUEST.scope(RefCell::new(Some(trace)), fut).await
}

/// Runs `f` on the request's trace, if this task is in a [`scope`].
fn with<R>(f: impl FnOnce(&mut RequestTrace) -> R) -> Option<R> {
    if !enabled() {
        return None;
    }
    REQUEST
        .try_with(|c| c.borrow_mut().as_mut().map(f))
        .ok()
        .flatten()
}

/// Starts the span of one upstream attempt under the request's span (`None` outside a scope).
pub fn attempt(spec: &crate::governor::CallSpec<'_>) -> Option<Attempt> {
    let o = get()?;
    with(|t| t.attempt(&o, spec))
}

/// Reads what a buffered answer says of itself (response model, finish reasons, cached
/// tokens) for the request's span.
pub fn note_body(body: &[u8]) {
    with(|t| t.notes.scan(body));
}

/// Takes the request's trace out of the scope (a stream finishes it when it ends).
pub fn take() -> Option<RequestTrace> {
    with(|_| ())?;
    REQUEST.try_with(|c| c.borrow_mut().take()).ok().flatten()
}

/// Ends the request's server span with the finished record (buffered answers, refusals).
pub fn finish(entry: &crate::audit::Entry) {
    if let Some(t) = take() {
        t.finish(entry);
    }
}

#[cfg(test)]
mod tests;
