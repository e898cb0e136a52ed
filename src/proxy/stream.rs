//! A governed stream: upstream frames go to the client as they arrive, a meter reads usage
//! and counts output on the way, and the call is settled exactly once however the stream
//! ends — completed, upstream error, timeout, over its reservation, or the client gone.

use super::finish::{close, Origin, Sent};
use super::respond::{Body, BoxError};
use super::snapshot::Snapshot;
use super::transport::{AnswerBody, InFlight};
use crate::audit::Audit;
use crate::dialect::Dialect;
use crate::governor::{BudgetState, Governor, Pending, ReasonClass, Record, UsageEvidence};
use crate::providers::Translator;
use crate::stream::SseMeter;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

/// What the stream needs to settle and record the call when it ends.
pub struct Tail {
    pub governor: Arc<Governor>,
    pub snap: Arc<Snapshot>,
    pub audit: Audit,
    /// Where and when the request came in, for the audit record and metrics.
    pub origin: Origin,
    pub pending: Box<Pending>,
    pub record: Record,
    pub input_tokens: u64,
    /// Output tokens reserved for this call (cap × n): the mid-stream guard's bound.
    pub max_output_total: u64,
    pub hide_usage: bool,
    /// The backend's in-flight slot: given back when the stream ends.
    pub permit: Option<InFlight>,
    /// The request's OpenTelemetry trace, ended with the stream.
    pub otel: Option<Box<crate::telemetry::otel::RequestTrace>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum End {
    Complete,
    UpstreamError,
    Timeout,
    OverReservation,
    /// Dropped unsettled (the pump task was cancelled): nothing more can be read.
    ClientGone,
    /// The client stopped reading and the total timeout ran out.
    ClientStalled,
    /// An SSE event or NDJSON line passed its size cap.
    Oversized,
}

/// What the meter reads of an upstream stream, and what the client gets of it.
pub enum StreamWire {
    /// OpenAI SSE: metered and forwarded (then rendered in the client's dialect).
    Internal,
    /// A native stream reshaped into OpenAI chunks: the chunks are metered and forwarded.
    Translated(Translator),
    /// A native stream in the client's own format: forwarded unchanged, while its translation
    /// is metered and dropped. The sidecar's own error events are written in `Dialect`.
    PassThrough(Translator, Dialect),
}

impl StreamWire {
    fn translator(&mut self) -> Option<&mut Translator> {
        match self {
            StreamWire::Internal => None,
            StreamWire::Translated(t) | StreamWire::PassThrough(t, _) => Some(t),
        }
    }
}

pub(super) struct Metered {
    inner: AnswerBody,
    wire: StreamWire,
    meter: SseMeter,
    tail: Option<Tail>,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// Bytes to send before ending (the rest of the stream, an error event).
    last: Option<Bytes>,
    ended: bool,
    /// The client went away; the stream is being read to its end for its usage.
    client_gone: bool,
}

/// Wraps an upstream stream body; a task of its own reads it (see [`super::pump`]).
pub fn metered(inner: AnswerBody, wire: StreamWire, tail: Tail, deadline: Instant) -> Body {
    let meter = SseMeter::new(tail.snap.policy.estimate.tokenizer, tail.hide_usage);
    let m = Metered {
        inner,
        wire,
        meter,
        tail: Some(tail),
        deadline: Box::pin(tokio::time::sleep_until(deadline.into())),
        last: None,
        ended: false,
        client_gone: false,
    };
    let snap = m.tail.as_ref().map(|t| t.snap.clone());
    super::pump::spawn(m, deadline, snap)
}

/// Slack over the reserved output before the guard stops a stream: per-chunk counting
/// over-counts slightly, and a provider that honours the cap must never be cut.
fn guard_bound(reserved: u64) -> u64 {
    reserved + reserved / 10 + 16
}

fn openai_error_event(message: &str, code: &str) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": "tollgate_stream_error", "code": code, "param": null}});
    Bytes::from(format!("data: {v}\n\n"))
}

impl Metered {
    /// The sidecar's own error event, in the shape of the stream the client reads.
    fn error_event(&self, message: &str, code: &str) -> Bytes {
        match &self.wire {
            StreamWire::PassThrough(_, d) => crate::dialect::stream_error_event(*d, message, code),
            _ => openai_error_event(message, code),
        }
    }

    /// Meters `data` (the upstream's bytes). Returns what the client gets of them, their
    /// internal (OpenAI SSE) form, and whether the provider reported an error in its stream.
    fn pass(&mut self, data: Bytes) -> (Bytes, Bytes, bool) {
        let (internal, failed) = match self.wire.translator() {
            None => (data.clone(), false),
            Some(tr) => {
                let mut out = Vec::new();
                tr.feed(&data, &mut out);
                (Bytes::from(out), tr.failed())
            }
        };
        let sent = self.meter.feed(&internal);
        match self.wire {
            StreamWire::PassThrough(..) => (data, internal, failed),
            _ => (sent, internal, failed),
        }
    }

    /// The client went away: what is still read is metered, not sent.
    pub(super) fn client_gone(&mut self) {
        self.client_gone = true;
    }

    /// Ends the stream now (the pump gave up on the client) and settles it.
    pub(super) fn stop(&mut self, end: End) {
        let _ = self.meter.flush();
        self.settle(end);
        self.ended = true;
    }

    fn settle(&mut self, end: End) {
        let Some(tail) = self.tail.take() else { return };
        let Tail {
            governor,
            snap,
            audit,
            origin,
            pending,
            mut record,
            input_tokens,
            max_output_total,
            permit,
            otel,
            ..
        } = tail;
        drop(permit);
        let policy = &snap.policy;
        let (mut usage, actual) = self.meter.usage_or_count(input_tokens);
        // Cut by the sidecar before the end (an event past its cap included: its text was
        // forwarded but never counted): the upstream may have produced more than was read, so
        // the reserved worst case is committed unless the provider's usage was seen.
        if !actual
            && matches!(
                end,
                End::Timeout | End::ClientGone | End::ClientStalled | End::Oversized
            )
        {
            usage.output_tokens = usage.output_tokens.max(max_output_total);
        }
        let evidence = match end {
            End::Complete if actual => UsageEvidence::Actual,
            End::Complete if self.meter.done => UsageEvidence::Estimated,
            _ => UsageEvidence::Partial,
        };
        let backend = policy.backends.get(pending.backend_index()).cloned();
        governor.settle(policy, &mut record, *pending, usage, evidence);
        record.client_disconnected = self.client_gone || end == End::ClientGone;
        match end {
            End::UpstreamError | End::Timeout | End::Oversized => {
                record.reason_class.note(ReasonClass::UpstreamFailure);
                match end {
                    End::Oversized => {
                        record.error = Some("the upstream sent an oversized stream event".into())
                    }
                    End::Timeout => {
                        record.error = Some("the stream passed its total timeout".into())
                    }
                    _ => {}
                }
                if let Some(b) = backend {
                    let now = crate::units::now_ms();
                    governor
                        .circuit(&b.id)
                        .on_failure(now, &b.circuit, None, None);
                }
            }
            End::OverReservation => {
                record.budget_state = BudgetState::HardExceeded;
                record.reason_class.note(ReasonClass::HardBudgetExceeded);
                record.error = Some("stream stopped: output passed the reserved worst case".into());
            }
            End::ClientGone => record.error = Some("client disconnected mid-stream".into()),
            End::ClientStalled => {
                record.error = Some("the client stopped reading: ended at the total timeout".into())
            }
            End::Complete if self.client_gone => {
                record.error = Some("client disconnected; the answer was read for its usage".into())
            }
            End::Complete => {}
        }
        let entry = close(&governor, policy, origin, record, Sent::Streamed(otel));
        // Drop may run outside an async context: hand the record to a task when we can.
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn(async move { audit.record(entry).await });
            }
            Err(_) => tracing::error!("no runtime to write the audit record of a stream"),
        }
    }

    /// Ends the stream: settles once and sends `before`, what the meter still holds, and an
    /// error event, as one last frame.
    fn finish_with(
        &mut self,
        end: End,
        before: Bytes,
        event: Option<Bytes>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let rest = self.meter.flush();
        self.settle(end);
        self.ended = true;
        let mut out = before.to_vec();
        if !matches!(self.wire, StreamWire::PassThrough(..)) {
            out.extend_from_slice(&rest);
        }
        if let Some(e) = event {
            out.extend_from_slice(&e);
        }
        if out.is_empty() {
            Poll::Ready(None)
        } else {
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))))
        }
    }
}

impl HttpBody for Metered {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some(b) = this.last.take() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            if this.deadline.as_mut().poll(cx).is_ready() {
                let ev = this.error_event(
                    "the upstream stream exceeded its total timeout",
                    "upstream_timeout",
                );
                return this.finish_with(End::Timeout, Bytes::new(), Some(ev));
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    // A translated stream may still owe its closing chunks (usage, [DONE]);
                    // a passed-through one has sent its own end (or was cut: a failure).
                    let (before, end) = match this.wire.translator() {
                        None => (Bytes::new(), End::Complete),
                        Some(tr) => {
                            let mut out = Vec::new();
                            tr.finish(&mut out);
                            let end = if tr.failed() {
                                End::UpstreamError
                            } else {
                                End::Complete
                            };
                            let sent = this.meter.feed(&Bytes::from(out));
                            match this.wire {
                                // Cut before its final event: say so in the client's format.
                                StreamWire::PassThrough(..) if end == End::UpstreamError => (
                                    this.error_event(
                                        "the upstream stream ended without its final event",
                                        "upstream_incomplete",
                                    ),
                                    end,
                                ),
                                StreamWire::PassThrough(..) => (Bytes::new(), end),
                                _ => (sent, end),
                            }
                        }
                    };
                    return this.finish_with(end, before, None);
                }
                Poll::Ready(Some(Err(e))) => {
                    tracing::warn!(error = %e, "upstream stream broke");
                    let ev = this
                        .error_event("the upstream stream ended with an error", "upstream_error");
                    return this.finish_with(End::UpstreamError, Bytes::new(), Some(ev));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let (out, internal, native_error) = this.pass(data);
                    if this.meter.oversized {
                        // An event that never ends: close what was forwarded of it (blank
                        // line), then the error event; a circuit failure, PARTIAL usage.
                        let mut ev = b"\n\n".to_vec();
                        ev.extend_from_slice(&this.error_event(
                            "the upstream sent a stream event larger than tollgate accepts",
                            "upstream_event_too_large",
                        ));
                        return this.finish_with(End::Oversized, out, Some(Bytes::from(ev)));
                    }
                    if let Some(t) = this.tail.as_mut().and_then(|t| t.otel.as_mut()) {
                        t.chunk(&internal);
                    }
                    if native_error {
                        // The provider reported an error inside its stream; its error event
                        // (OpenAI's, or passed through its own) is in `out`. End here: partial
                        // usage, a circuit failure.
                        return this.finish_with(End::UpstreamError, out, None);
                    }
                    let bound = this
                        .tail
                        .as_ref()
                        .map_or(u64::MAX, |t| guard_bound(t.max_output_total));
                    if this.meter.usage.is_none() && this.meter.counted_output > bound {
                        this.last = Some(this.error_event(
                            "tollgate stopped the stream: the output passed what was reserved for this call",
                            "hard_budget_exceeded",
                        ));
                        let _ = this.meter.flush();
                        this.settle(End::OverReservation);
                        this.ended = true;
                        if out.is_empty() {
                            continue;
                        }
                        return Poll::Ready(Some(Ok(Frame::data(out))));
                    }
                    if out.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(Frame::data(out))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.last.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        // Dropped before the end: the client went away. Dropping `inner` cancels the upstream.
        if self.tail.is_some() {
            self.settle(End::ClientGone);
        }
    }
}
