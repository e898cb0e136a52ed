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

/// A whole answer's body as hyper writes it, carrying the answer's closing: the record is
/// closed as hyper takes the body's last piece (where the own server closes it, once its write
/// is done), or, when hyper drops the body unfinished because the client went away during the
/// write, closed as cut. Both server paths thus say `client_disconnected` for the same client.
/// A large piece is handed on in slices of [`PIECE`], so a write that fails partway is seen.
pub struct Finishing {
    inner: crate::body::Body,
    after: Option<After>,
    /// What is left of the piece being handed on.
    rest: bytes::Bytes,
    /// A full audit queue's wait, and the last piece held back until it is over.
    wait: Option<QueueWait>,
    held: Option<bytes::Bytes>,
    /// `inner` said it ended (it is not polled again).
    ended: bool,
}

/// The slice hyper is handed at a time: about what its write buffer takes before it flushes.
const PIECE: usize = 64 * 1024;

impl Finishing {
    /// `inner` with `after` (if the answer has one) run as described above.
    pub fn new(inner: crate::body::Body, after: Option<After>) -> Self {
        Finishing {
            inner,
            after,
            rest: bytes::Bytes::new(),
            wait: None,
            held: None,
            ended: false,
        }
    }

    /// Closes the record (the body is whole in hyper's hands); `last` goes out once a full
    /// audit queue has room.
    fn close(&mut self, last: Option<bytes::Bytes>) {
        if let Some(wait) = self.after.take().and_then(|a| a.run(false)) {
            self.wait = Some(wait);
            self.held = last;
        } else {
            self.held = last;
        }
    }
}

impl http_body::Body for Finishing {
    type Data = bytes::Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        if this.after.is_none() && this.rest.is_empty() {
            // Closed (or nothing to close: a stream closes its own record): pieces go as they come.
            if let Some(w) = this.wait.as_mut() {
                std::task::ready!(w.as_mut().poll(cx));
                this.wait = None;
            }
            if let Some(last) = this.held.take() {
                return Poll::Ready(Some(Ok(http_body::Frame::data(last))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            return std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        }
        loop {
            if !this.rest.is_empty() {
                let piece = this.rest.split_to(this.rest.len().min(PIECE));
                if this.rest.is_empty() && this.inner.is_end_stream() {
                    this.close(Some(piece));
                    return self.poll_frame(cx);
                }
                return Poll::Ready(Some(Ok(http_body::Frame::data(piece))));
            }
            match std::task::ready!(std::pin::Pin::new(&mut this.inner).poll_frame(cx)) {
                None => {
                    this.ended = true;
                    this.close(None);
                    return self.poll_frame(cx);
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.rest = data,
                    Err(other) => return Poll::Ready(Some(Ok(other))),
                },
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.after.is_none()
            && self.rest.is_empty()
            && self.held.is_none()
            && self.wait.is_none()
            && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut hint = self.inner.size_hint();
        let extra = (self.rest.len() + self.held.as_ref().map_or(0, bytes::Bytes::len)) as u64;
        hint.set_lower(hint.lower().saturating_add(extra));
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper.saturating_add(extra));
        }
        hint
    }
}

impl Drop for Finishing {
    fn drop(&mut self) {
        // Dropped with its closing still to run: hyper gave up on the write (the client went).
        let wait = self
            .after
            .take()
            .and_then(|a| a.run(true))
            .or_else(|| self.wait.take());
        if let Some(wait) = wait {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(wait);
            }
        }
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

    #[tokio::test]
    async fn hyper_s_body_closes_as_its_last_piece_is_taken_or_as_cut_when_dropped() {
        use http_body_util::BodyExt;
        let (a, seen) = noted();
        let mut body = super::Finishing::new(crate::body::full(vec![7u8; 200_000]), Some(a));
        let mut got = 0;
        while let Some(frame) = body.frame().await {
            let n = frame.unwrap().into_data().unwrap().len();
            assert!(n <= super::PIECE, "handed on in slices");
            got += n;
            if got < 200_000 {
                assert_eq!(
                    seen.load(Ordering::SeqCst),
                    0,
                    "not closed before the last piece"
                );
            }
        }
        assert_eq!(got, 200_000);
        assert_eq!(seen.load(Ordering::SeqCst), 1, "closed once, as written");
        drop(body);
        assert_eq!(seen.load(Ordering::SeqCst), 1, "not twice");

        let (a, seen) = noted();
        let mut body = super::Finishing::new(crate::body::full(vec![7u8; 200_000]), Some(a));
        let _ = body.frame().await;
        drop(body);
        assert_eq!(seen.load(Ordering::SeqCst), 2, "dropped unfinished: cut");
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
