//! The end of every request, however it was answered: a buffered answer, a streamed one (when
//! its stream ends, maybe in `Drop`), the route's static answer, a passed-through client
//! error, or a refusal. Each is recorded the same way, here: the metrics and alerts, the end of
//! the request's OpenTelemetry span, and the audit entry. Nothing here decides anything.

use crate::audit::Entry;
use crate::governor::{Governor, Record};
use crate::policy::Policy;
use crate::telemetry::otel::RequestTrace;
use std::time::Instant;

/// Where and when a request came in: what its record is labelled and timed with.
#[derive(Debug, Clone, Copy)]
pub struct Origin {
    /// The internal endpoint (`chat.completions`, …), `unknown` for a path not governed.
    pub endpoint: &'static str,
    /// The client's dialect (`openai`, `anthropic`, …).
    pub api: &'static str,
    pub at: Instant,
}

/// How the answer went out.
// Built once per request and moved straight into `close`: boxing the trace would only add an
// allocation per stream.
#[allow(clippy::large_enum_variant)]
pub enum Sent {
    /// In one piece (buffered, static, a refusal): its wall time is the sidecar's overhead
    /// plus the upstream's, and its span is still in the request task's scope.
    Whole,
    /// Streamed: its wall time includes the streaming itself, so it is kept out of the
    /// overhead histogram; its trace left the request task with the stream.
    Streamed(Option<Box<RequestTrace>>),
}

/// Records a finished request: metrics (and alerts against `policy`'s windows), then the end
/// of its server span. Returns the audit entry for the caller to write: awaited for a whole
/// answer, from a task of its own for a stream (whose end may run outside an async context).
pub fn close(
    governor: &Governor,
    policy: &Policy,
    origin: Origin,
    record: Record,
    sent: Sent,
) -> Entry {
    let now = crate::units::now_wall();
    let entry = Entry {
        ts: crate::units::rfc3339(now),
        endpoint: origin.endpoint,
        api: origin.api,
        latency_ms: origin.at.elapsed().as_secs_f64() * 1000.0,
        record,
    };
    let windows = governor.windows_at(&policy.windows, crate::units::wall_ms(now));
    match sent {
        Sent::Whole => {
            crate::telemetry::observe(&entry, windows, &policy.alerts);
            crate::telemetry::otel::finish(&entry);
        }
        Sent::Streamed(trace) => {
            crate::telemetry::observe_stream(&entry, windows, &policy.alerts);
            if let Some(t) = trace {
                t.finish(&entry);
            }
        }
    }
    entry
}
