//! The spans of one governed request and the metrics recorded when they end.
//!
//! Server span (`SERVER`, `{operation} {model}`): from the handler's start to the end of the
//! answer (a stream's last byte), with the decision record's fields. Client spans (`CLIENT`),
//! one per upstream attempt: a failed or skipped attempt ends when it fails; the served one
//! ends with the request, carrying the usage, the response model and the finish reasons.

use super::notes::Notes;
use super::{with, Otel};
use crate::audit::Entry;
use crate::governor::{CallResult, CallSpec, Record, UsageEvidence};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Array, Context, KeyValue, StringValue, Value};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::Span;
use std::sync::Arc;
use std::time::Instant;

/// One governed request's trace: its server span (in the context) and the served attempt.
pub struct RequestTrace {
    cx: Context,
    op: &'static str,
    pub(super) notes: Notes,
    served: Option<Attempt>,
    metrics: Arc<Otel>,
}

impl std::fmt::Debug for RequestTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestTrace")
            .field("op", &self.op)
            .finish()
    }
}

/// One upstream attempt's client span.
pub struct Attempt {
    span: Span,
    started: Instant,
    /// The metric attributes: operation, provider, request (upstream) model.
    attrs: [KeyValue; 3],
    first_chunk: bool,
}

impl std::fmt::Debug for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempt").finish_non_exhaustive()
    }
}

/// The semconv `gen_ai.provider.name` of a backend kind.
fn provider_name(kind: crate::policy::BackendKind) -> &'static str {
    match kind.as_str() {
        "gemini" => "gcp.gemini",
        other => other,
    }
}

fn text(s: &Arc<str>) -> Value {
    Value::String(StringValue::from(s.clone()))
}

impl RequestTrace {
    pub(super) fn start(
        o: &Arc<Otel>,
        headers: &http::HeaderMap,
        path: &'static str,
        op: &'static str,
    ) -> Self {
        let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
        let span = o
            .tracer
            .span_builder(op)
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("gen_ai.operation.name", op),
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("url.path", path),
            ])
            .start_with_context(&o.tracer, &parent);
        RequestTrace {
            cx: parent.with_span(span),
            op,
            notes: Notes::default(),
            served: None,
            metrics: o.clone(),
        }
    }

    pub(super) fn attempt(&mut self, o: &Otel, spec: &CallSpec<'_>) -> Attempt {
        let op = self.op;
        let provider = provider_name(spec.backend.kind);
        let model: Arc<str> = Arc::from(spec.model);
        let attrs = [
            KeyValue::new("gen_ai.operation.name", op),
            KeyValue::new("gen_ai.provider.name", provider),
            KeyValue::new("gen_ai.request.model", text(&model)),
        ];
        let mut all = attrs.to_vec();
        all.extend([
            KeyValue::new("gen_ai.request.max_tokens", spec.max_output_tokens as i64),
            KeyValue::new("tollgate.backend", text(&spec.backend.id)),
            KeyValue::new("tollgate.attempt", i64::from(spec.attempt)),
            KeyValue::new("tollgate.probe", spec.probe),
        ]);
        if let Ok(u) = spec.backend.base_url.parse::<http::Uri>() {
            if let Some(h) = u.host() {
                all.push(KeyValue::new("server.address", h.to_string()));
            }
            if let Some(p) = u.port_u16() {
                all.push(KeyValue::new("server.port", i64::from(p)));
            }
        }
        let span = o
            .tracer
            .span_builder(format!("{op} {model}"))
            .with_kind(SpanKind::Client)
            .with_attributes(all)
            .start_with_context(&o.tracer, &self.cx);
        Attempt {
            span,
            started: Instant::now(),
            attrs,
            first_chunk: false,
        }
    }

    /// Notes a chunk of a streamed answer: its first arrival, and what it says of itself.
    pub fn chunk(&mut self, data: &[u8]) {
        if let Some(a) = self.served.as_mut() {
            if !a.first_chunk {
                a.first_chunk = true;
                let s = a.started.elapsed().as_secs_f64();
                self.metrics.instruments.first_chunk.record(s, &a.attrs);
                a.span.add_event("gen_ai.first_chunk", Vec::new());
            }
        }
        self.notes.scan(data);
    }

    /// Ends the served attempt (with usage) and the server span (with the decision).
    pub fn finish(mut self, entry: &Entry) {
        let rec = &entry.record;
        let response_model = self
            .notes
            .model
            .clone()
            .or_else(|| rec.upstream_model.clone());
        let usage = rec.usage_evidence_state != UsageEvidence::None;
        let mut gen_ai = Vec::with_capacity(8);
        if let Some(m) = &response_model {
            gen_ai.push(KeyValue::new("gen_ai.response.model", text(m)));
        }
        if usage {
            gen_ai.push(KeyValue::new(
                "gen_ai.usage.input_tokens",
                sat(rec.actual_input_tokens),
            ));
            gen_ai.push(KeyValue::new(
                "gen_ai.usage.output_tokens",
                sat(rec.actual_output_tokens),
            ));
        }
        if let Some(c) = self.notes.cached {
            gen_ai.push(KeyValue::new(
                "gen_ai.usage.cache_read.input_tokens",
                sat(c),
            ));
        }
        if !self.notes.finish.is_empty() {
            let v: Vec<StringValue> = self.notes.finish.iter().map(|s| s.clone().into()).collect();
            gen_ai.push(KeyValue::new(
                "gen_ai.response.finish_reasons",
                Value::Array(Array::String(v)),
            ));
        }
        let mut provider = None;
        if let Some(mut a) = self.served.take() {
            provider = Some(a.attrs[1].clone());
            a.span.set_attributes(gen_ai.iter().cloned());
            a.span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(rec.http_status),
            ));
            let m = &self.metrics.instruments;
            let mut attrs = a.attrs.to_vec();
            if let Some(m) = &response_model {
                attrs.push(KeyValue::new("gen_ai.response.model", text(m)));
            }
            m.duration.record(a.started.elapsed().as_secs_f64(), &attrs);
            if usage {
                attrs.push(KeyValue::new("gen_ai.token.type", "input"));
                m.tokens.record(rec.actual_input_tokens, &attrs);
                if let Some(last) = attrs.last_mut() {
                    *last = KeyValue::new("gen_ai.token.type", "output");
                }
                m.tokens.record(rec.actual_output_tokens, &attrs);
            }
            a.span.end();
        }
        // One call (one lock of the span) for every attribute of the server span.
        let mut all = Vec::with_capacity(gen_ai.len() + 24);
        if !rec.route.is_empty() {
            all.push(KeyValue::new("gen_ai.request.model", text(&rec.route)));
        }
        all.extend(provider);
        if rec.requested_output_tokens > 0 {
            all.push(KeyValue::new(
                "gen_ai.request.max_tokens",
                sat(rec.requested_output_tokens),
            ));
        }
        all.extend(gen_ai);
        decision(rec, &mut all);
        all.push(KeyValue::new(
            "http.response.status_code",
            i64::from(rec.http_status),
        ));
        if rec.http_status >= 400 {
            all.push(KeyValue::new("error.type", rec.reason_class.as_str()));
        }
        let cx = self.cx.span();
        if !rec.route.is_empty() {
            cx.update_name(format!("{} {}", self.op, rec.route));
        }
        cx.set_attributes(all);
        if rec.http_status >= 500 {
            cx.set_status(Status::error(rec.reason_class.as_str()));
        }
        cx.end();
    }
}

/// Counts are u64 in the record; OTel integers are i64.
fn sat(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The decision record's fields (`tollgate.*`): the eight states and who/what/which policy.
fn decision(rec: &Record, kv: &mut Vec<KeyValue>) {
    kv.extend([
        KeyValue::new("tollgate.final_action", rec.final_action.as_str()),
        KeyValue::new("tollgate.reason_class", rec.reason_class.as_str()),
        KeyValue::new("tollgate.budget_state", rec.budget_state.as_str()),
        KeyValue::new("tollgate.quota_state", rec.quota_state.as_str()),
        KeyValue::new("tollgate.circuit_state", rec.circuit_state.as_str()),
        KeyValue::new("tollgate.retry_state", rec.retry_state.as_str()),
        KeyValue::new(
            "tollgate.usage_evidence_state",
            rec.usage_evidence_state.as_str(),
        ),
        KeyValue::new("tollgate.fallback_state", rec.fallback_state.as_str()),
        KeyValue::new("tollgate.consumer", text(&rec.consumer_id)),
        KeyValue::new("tollgate.route", text(&rec.route)),
        KeyValue::new("tollgate.policy_version", text(&rec.policy_version)),
        KeyValue::new("tollgate.backend", text(&rec.backend)),
        KeyValue::new("tollgate.request_id", text(&rec.request_id)),
        KeyValue::new("tollgate.job_id", text(&rec.job_id)),
        KeyValue::new("tollgate.attempts", rec.attempts.len() as i64),
        KeyValue::new("tollgate.cost_usd", rec.cost_usd),
    ]);
    if let Some(team) = &rec.team {
        kv.push(KeyValue::new("tollgate.team", text(team)));
    }
}

impl Attempt {
    /// Writes this attempt's `traceparent` (and the caller's `tracestate`) on the upstream
    /// request, replacing any the client sent.
    pub fn inject(&self, headers: &mut http::HeaderMap) {
        let cx = Context::new().with_remote_span_context(self.span.span_context().clone());
        TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(headers));
    }

    /// Ends the attempt with its result; the served one is kept for the request's end.
    pub fn end<T>(mut self, r: &CallResult<T>) {
        let error = match r {
            CallResult::Served(_) => {
                // Outside a scope the span just ends (on drop).
                let _ = with(move |t| t.served = Some(self));
                return;
            }
            CallResult::NotRetryable { status, .. } => {
                self.span.set_attribute(KeyValue::new(
                    "http.response.status_code",
                    i64::from(*status),
                ));
                status.to_string()
            }
            CallResult::Failed(f) => {
                if let Some(s) = f.status {
                    self.span
                        .set_attribute(KeyValue::new("http.response.status_code", i64::from(s)));
                }
                f.class.as_str().to_string()
            }
            CallResult::Skipped(s) => {
                self.span
                    .set_attribute(KeyValue::new("tollgate.skipped", format!("{s:?}")));
                "skipped".to_string()
            }
        };
        if let Some(o) = super::get() {
            let mut attrs = self.attrs.to_vec();
            attrs.push(KeyValue::new("error.type", error.clone()));
            o.instruments
                .duration
                .record(self.started.elapsed().as_secs_f64(), &attrs);
        }
        self.span
            .set_attribute(KeyValue::new("error.type", error.clone()));
        self.span.set_status(Status::error(error));
        self.span.end();
    }
}
