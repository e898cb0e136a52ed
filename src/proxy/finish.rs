//! The end of every request, however it was answered: a buffered answer, a streamed one (when
//! its stream ends, maybe in `Drop`), the route's static answer, a passed-through client
//! error, or a refusal. Each is recorded the same way, here: the metrics and alerts, the end of
//! the request's OpenTelemetry span, and the audit entry. Nothing here decides anything.

use crate::audit::{Entry, QueueWait};
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
    /// plus the upstream's; its trace was taken from the request task's scope.
    Whole(Option<Box<RequestTrace>>),
    /// Streamed: its wall time includes the streaming itself, so it is kept out of the
    /// overhead histogram; its trace left the request task with the stream.
    Streamed(Option<Box<RequestTrace>>),
}

/// Records a finished request: metrics (and alerts against `policy`'s windows), then the end
/// of its server span. Returns the audit entry for the caller to write: awaited for a whole
/// answer, from a task of its own for a stream (whose end may run outside an async context).
/// One warning per failed upstream call and per circuit it opened: an operator reading the
/// log learns that a backend is failing without the audit (ids and classes only, no body).
fn log_failures(rec: &crate::governor::Record) {
    use crate::governor::CircuitState;
    for a in &rec.attempts {
        // Skipped entries (attempt 0) made no call; `ok` and `not_retryable` were answers.
        if a.attempt == 0 || matches!(a.outcome, "ok" | "not_retryable") {
            continue;
        }
        tracing::warn!(
            request_id = %rec.request_id,
            backend = %a.backend,
            model = %a.model,
            outcome = a.outcome,
            status = a.status,
            "backend call failed"
        );
        if a.circuit_after == CircuitState::Open && a.circuit_before != CircuitState::Open {
            tracing::warn!(backend = %a.backend, request_id = %rec.request_id, "circuit opened: the backend is skipped until it recovers");
        }
    }
}

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
    log_failures(&entry.record);
    let windows = governor.windows_at(&policy.windows, crate::units::wall_ms(now));
    match sent {
        Sent::Whole(trace) => {
            crate::telemetry::observe(&entry, windows, &policy.alerts);
            if let Some(t) = trace {
                t.finish(&entry);
            }
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

/// What a whole answer leaves to do once it is written: its record closed (metrics and
/// alerts, the end of its span, the audit entry queued). None of that changes a byte of the
/// answer, so the server writing it runs this after the last byte went out (or the write
/// failed: `cut`), and none of it lies between the upstream's answer and the client's.
/// It travels in the response's extensions. A response dropped without being written (its
/// client gone while the work went on detached, an error path) runs it from `Drop`: a call
/// that reached an upstream is recorded whatever the client did.
pub struct After(Option<Box<Close>>);

/// The closing itself: `cut` when the answer could not be written whole (the client went
/// away). Hands back the wait for room in a full audit queue, which must be awaited.
type Close = dyn FnOnce(bool) -> Option<QueueWait> + Send + Sync;

impl After {
    pub fn new(close: impl FnOnce(bool) -> Option<QueueWait> + Send + Sync + 'static) -> Self {
        After(Some(Box::new(close)))
    }

    /// Closes the record; the wait it hands back when the audit queue is full must be awaited
    /// (records are never dropped, and the connection waits with them).
    #[must_use = "a full audit queue's wait must be awaited"]
    pub fn run(mut self, cut: bool) -> Option<QueueWait> {
        self.0.take().and_then(|close| close(cut))
    }
}

/// Runs the closing taken from an answer, if it had one, and waits for room in a full audit
/// queue: what a server does once it has written the answer (or handed it on).
pub async fn run_after(after: Option<After>, cut: bool) {
    if let Some(wait) = after.and_then(|a| a.run(cut)) {
        wait.await;
    }
}

impl Drop for After {
    fn drop(&mut self) {
        let Some(close) = self.0.take() else {
            return;
        };
        if let Some(wait) = close(false) {
            // No runtime: the process is shutting down (the writer drains what is queued).
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(wait);
            }
        }
    }
}

/// A copy carries no work: the record is closed once, by the original (the type only has
/// to be `Clone` to travel in a response's extensions).
impl Clone for After {
    fn clone(&self) -> Self {
        After(None)
    }
}

impl std::fmt::Debug for After {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "After(pending)"
        } else {
            "After(done)"
        })
    }
}

#[cfg(test)]
mod tests {
    use super::After;
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::sync::Arc;

    /// An `After` whose closing notes how it ran: 1 written, 2 cut.
    fn noted() -> (After, Arc<AtomicU8>) {
        let seen = Arc::new(AtomicU8::new(0));
        let s = seen.clone();
        let a = After::new(move |cut| {
            s.fetch_add(if cut { 2 } else { 1 }, Ordering::SeqCst);
            None
        });
        (a, seen)
    }

    #[test]
    fn run_closes_once_and_says_whether_the_write_was_cut() {
        let (a, seen) = noted();
        assert!(a.run(false).is_none());
        assert_eq!(
            seen.load(Ordering::SeqCst),
            1,
            "ran once, after a whole write"
        );
        let (a, seen) = noted();
        let _ = a.run(true);
        assert_eq!(seen.load(Ordering::SeqCst), 2, "a cut write is told");
    }

    #[test]
    fn a_response_dropped_unwritten_still_closes_its_record() {
        let (a, seen) = noted();
        let mut resp = http::Response::new(());
        resp.extensions_mut().insert(a);
        drop(resp);
        assert_eq!(seen.load(Ordering::SeqCst), 1, "closed from Drop");
    }

    #[test]
    fn a_copy_carries_no_work() {
        let (a, seen) = noted();
        let copy = a.clone();
        drop(copy);
        assert_eq!(seen.load(Ordering::SeqCst), 0, "the copy closed nothing");
        drop(a);
        assert_eq!(
            seen.load(Ordering::SeqCst),
            1,
            "the original closed it, once"
        );
    }
}
