//! OpenTelemetry export (OTLP/HTTP, protobuf): one server span per governed request joined to
//! the caller's W3C trace, one client span per upstream attempt, and the GenAI client metrics.
//! Attributes follow the GenAI semantic conventions v1.37.0 (`gen_ai.provider.name`); see
//! docs/opentelemetry.md. Never a prompt, a completion or a key.
//!
//! Off unless an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or the policy's
//! `telemetry.otlp.endpoint`). Off costs one relaxed atomic load per request: the request path
//! checks [`enabled`] before anything else. On, a finished request's spans are encoded into
//! its thread's batch, which a background task takes every schedule delay ([`export`]); a
//! full outbox or a failed export drops spans and counts them in
//! `tollgate_otel_dropped_spans_total`, never slowing or failing a request.
//!
//! The request's trace lives in the request task's scope ([`crate::telemetry::scope`]) for the
//! duration of the governed call, so the transport starts its attempt spans under it without
//! new parameters; a stream takes it with [`take`] and finishes it when the stream ends.

mod config;
mod context;
mod encode;
mod export;
mod metrics;
mod notes;
mod plain;
mod proto;
mod spans;

pub use config::{settings, Protocol, Settings};
pub use context::{Root, Sampler};
pub use spans::{is_trace_context, Attempt, RequestTrace, TraceLine};

use crate::estimate::Endpoint;
use crate::telemetry::scope;
use arc_swap::ArcSwapOption;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The installed exporter: the sampler, the threads' end of the export (see
/// [`export::Batches`]) and the export task's control.
pub struct Otel {
    sampler: Sampler,
    batches: Arc<export::Batches>,
    control: export::Control,
}

impl std::fmt::Debug for Otel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Otel").finish_non_exhaustive()
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static OTEL: ArcSwapOption<Otel> = ArcSwapOption::const_empty();
/// Bumped whenever [`OTEL`] changes: each thread keeps the exporter it loaded last with the
/// generation it loaded it at, and loads it again only when the generation moved.
static GENERATION: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static NEAR: RefCell<Option<(u64, Option<Arc<Otel>>)>> = const { RefCell::new(None) };
}

/// Runs `f` on the installed exporter (`None` when there is none). Each thread keeps the
/// exporter it used last while the generation holds: a request starts and ends its trace
/// with an atomic load and a comparison, not two loads of the `ArcSwap` (~100 instructions
/// each). A thread whose copy is stale (an exporter was installed or shut down since) loads
/// the current one; an old exporter lives on, draining what was pushed to it, until the last
/// thread holding it has moved on.
fn with_current<R>(f: impl FnOnce(&Otel) -> R) -> Option<R> {
    let generation = GENERATION.load(Ordering::Acquire);
    NEAR.with(|near| {
        let Ok(mut near) = near.try_borrow_mut() else {
            return OTEL.load().as_deref().map(f);
        };
        match &*near {
            Some((g, _)) if *g == generation => {}
            _ => *near = Some((generation, OTEL.load_full())),
        }
        near.as_ref().and_then(|(_, o)| o.as_deref()).map(f)
    })
}

/// Whether export is on: the request path's only check when it is off.
#[inline]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Starts a governed request's server span when export is on, continuing the caller's
/// `traceparent`/`tracestate` from `headers` (`None` when off: one atomic load).
pub fn start(headers: &http::HeaderMap, e: Endpoint) -> Option<Box<RequestTrace>> {
    if !enabled() {
        return None;
    }
    let sampler = with_current(|o| o.sampler)?;
    let (path, op) = match e {
        Endpoint::Chat => ("/v1/chat/completions", "chat"),
        Endpoint::Completions => ("/v1/completions", "text_completion"),
        Endpoint::Embeddings => ("/v1/embeddings", "embeddings"),
    };
    // A box a finished trace of this thread's left behind, started again in place, else a
    // new one the record is written into (the ~500 bytes not built on the stack and copied).
    let spare = SPARE
        .try_with(|s| s.try_borrow_mut().ok()?.pop())
        .ok()
        .flatten();
    Some(match spare {
        Some(mut b) => {
            b.restart(sampler, headers, path, op);
            b
        }
        None => Box::write(
            Box::new_uninit(),
            RequestTrace::start(sampler, headers, path, op),
        ),
    })
}

/// Boxes of finished traces a thread keeps for its next requests' (as many as it may have
/// requests ending between two that start, under load).
const SPARES: usize = 8;

thread_local! {
    /// The boxes of the last traces this thread finished, for its next requests' traces: a
    /// trace is recorded where its request ends (see [`export`]), so its box need not be
    /// freed there and allocated again. Boxes, not values: each goes on as the box its
    /// request's scope holds.
    #[allow(clippy::vec_box)]
    static SPARE: RefCell<Vec<Box<RequestTrace>>> = const { RefCell::new(Vec::new()) };
}

/// Keeps a finished trace's box for one of the thread's next requests (its contents go when
/// it is reused: the same work as dropping them now).
fn keep_box(t: Box<RequestTrace>) {
    let _ = SPARE.try_with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            if s.len() < SPARES {
                s.push(t);
            }
        }
    });
}

/// Records a finished request with the installed exporter (the one installed now: a reload
/// that replaced it sends the request with the new one's next batch).
fn record(f: &spans::Finished, d: &spans::Decision<'_>) {
    let _ = with_current(|o| o.batches.record(f, d));
}

/// Builds the exporter from `s` and installs it process-wide (replacing any before it, which
/// sends what it holds and stops once its last request has ended).
/// Must run inside a Tokio runtime: the export and sender tasks run on it.
pub fn install(s: &Settings) -> Result<(), String> {
    // The drop counters live in the Prometheus recorder: install it first.
    let _ = crate::telemetry::global();
    let o = build(s)?;
    OTEL.store(Some(Arc::new(o)));
    GENERATION.fetch_add(1, Ordering::AcqRel);
    ON.store(true, Ordering::Release);
    tracing::info!(
        traces = %s.traces_endpoint, metrics = %s.metrics_endpoint,
        protocol = ?s.protocol,
        "opentelemetry: exporting traces and metrics over OTLP"
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

/// Sends what is queued (spans and the metrics so far), waiting at most `within`.
pub async fn flush(within: Duration) {
    let Some(o) = OTEL.load_full() else { return };
    let _ = tokio::time::timeout(within, o.control.flush()).await;
}

/// Turns export off, flushing what is queued (bounded by `within`). For `serve`'s shutdown.
pub async fn shutdown(within: Duration) {
    ON.store(false, Ordering::Release);
    let old = OTEL.swap(None);
    GENERATION.fetch_add(1, Ordering::AcqRel);
    let Some(o) = old else { return };
    let _ = tokio::time::timeout(within, o.control.flush()).await;
}

fn build(s: &Settings) -> Result<Otel, String> {
    let mut resource = Vec::new();
    let mut w = proto::Writer(&mut resource);
    for (k, v) in s.resource() {
        // Resource.attributes = 1
        w.attr_str(1, &k, &v);
    }
    let mut scope = Vec::new();
    let mut w = proto::Writer(&mut scope);
    // InstrumentationScope { name 1, version 2 }
    w.string(1, "tollgate");
    w.string(2, env!("CARGO_PKG_VERSION"));
    let (batches, control) = export::start(s, export::Fixed { resource, scope })?;
    Ok(Otel {
        sampler: s.sampler,
        batches,
        control,
    })
}

/// Runs `f` on the request's trace, if this task's request has one (see [`scope::run`]: the
/// server span ends in [`finish`] or, for a stream, when the stream [`take`]s it and ends).
fn with<R>(f: impl FnOnce(&mut RequestTrace) -> R) -> Option<R> {
    if !enabled() {
        return None;
    }
    scope::with_trace(f)
}

/// Starts the span of one upstream attempt under the request's span (`None` outside a scope).
pub fn attempt(spec: &crate::governor::CallSpec<'_>) -> Option<Attempt> {
    with(|t| t.attempt(spec))
}

/// Reads what a buffered answer says of itself (response model, finish reasons, cached
/// tokens) for the request's span.
///
/// A body the transport has read already ([`note_said`]) is not scanned again.
pub fn note_body(body: &[u8]) {
    with(|t| {
        if !t.f.notes.read {
            t.f.notes.scan(body, t.f.ids.sampled);
        }
    });
}

/// Notes what a served answer said of itself, read in the transport's own parse of it
/// (`cached`: the usage's cached input tokens, when it states them).
pub fn note_said(span: Attempt, said: &crate::providers::validate::Said<'_>, cached: Option<u64>) {
    with(|t| t.said(span, said, cached));
}

/// Takes the request's trace out of the scope (a stream finishes it when it ends).
pub fn take() -> Option<Box<RequestTrace>> {
    if !enabled() {
        return None;
    }
    scope::take_trace()
}

/// Ends the request's server span with the finished record (buffered answers, refusals).
pub fn finish(entry: &crate::audit::Entry) {
    if let Some(t) = take() {
        t.finish(entry);
    }
}

#[cfg(test)]
mod tests;
