//! The upstream and the clock a recorded request is replayed with: each backend answers as
//! the record says it did, in the order it did, taking the time it took; a call the recording
//! never made is assumed served (its usage: [`Played::usage`]). No network.

use super::read::{Recorded, RecordedAttempt};
use crate::governor::{
    CallResult, CallSpec, Clock, Failure, FailureClass, Skip, Upstream, Usage, UsageEvidence,
};
use crate::policy::Backend;
use crate::units::Millis;
use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

/// The request's time: set to when it came in, advanced by what the core waits (backoff,
/// Retry-After) and by each recorded call's latency.
#[derive(Debug)]
pub struct ReplayClock {
    now: AtomicI64,
}

impl ReplayClock {
    pub fn new(now: Millis) -> Self {
        ReplayClock {
            now: AtomicI64::new(now),
        }
    }

    fn advance(&self, ms: i64) {
        // Clamped: a latency read from a file must not move time backwards or overflow.
        let ms = ms.clamp(0, 86_400_000);
        self.now.fetch_add(ms, Ordering::Relaxed);
    }
}

impl Clock for ReplayClock {
    fn now_ms(&self) -> Millis {
        self.now.load(Ordering::Relaxed)
    }
    fn sleep_ms(&self, ms: u64) -> impl Future<Output = ()> + Send {
        self.advance(i64::try_from(ms).unwrap_or(i64::MAX));
        std::future::ready(())
    }
}

/// What a served call of the replay was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// The recording's own served call: its usage is the record's.
    Recorded,
    /// A call the recording never made (a fallback or a request the old policy refused).
    Unrecorded,
}

/// The recorded request's upstream.
#[derive(Debug)]
pub struct Played<'a> {
    rec: &'a Recorded,
    clock: &'a ReplayClock,
    /// The recorded attempts not yet replayed, in order.
    left: Mutex<Vec<&'a RecordedAttempt>>,
    /// The output cap per choice of the last served call.
    served_cap: AtomicU64,
    endpoint: crate::estimate::Endpoint,
}

impl<'a> Played<'a> {
    pub fn new(rec: &'a Recorded, clock: &'a ReplayClock) -> Self {
        Played {
            rec,
            clock,
            left: Mutex::new(rec.attempts.iter().collect()),
            served_cap: AtomicU64::new(u64::MAX),
            endpoint: endpoint(&rec.endpoint),
        }
    }

    /// The usage a served call is settled with. The recorded call's is the record's; a call
    /// the recording never made is charged the request's recorded usage when it was served
    /// (the same prompt and answer, whoever serves it), else its worst case: the estimate
    /// and the whole output cap. Output is capped at what the call was allowed (a provider
    /// stops at the cap it is sent).
    pub fn usage(&self, served: Served, n: u32) -> (Usage, UsageEvidence) {
        let r = self.rec;
        let evidence = UsageEvidence::parse(&r.usage_evidence_state).unwrap_or(UsageEvidence::None);
        let cap = self
            .served_cap
            .load(Ordering::Relaxed)
            .saturating_mul(u64::from(n.max(1)));
        let recorded = Usage {
            input_tokens: r.actual_input_tokens,
            output_tokens: r.actual_output_tokens.min(cap),
            cached_input_tokens: r.actual_cached_input_tokens,
            cache_write_tokens: r.actual_cache_write_tokens,
        };
        match (served, evidence) {
            (Served::Recorded, UsageEvidence::None) => (recorded, UsageEvidence::Actual),
            (Served::Recorded, e) => (recorded, e),
            (Served::Unrecorded, UsageEvidence::None) => (
                Usage::new(r.estimated_input_tokens, cap),
                UsageEvidence::Estimated,
            ),
            (Served::Unrecorded, _) => (recorded, UsageEvidence::Estimated),
        }
    }

    /// The next recorded attempt on `backend`, taken off the list.
    fn next(&self, backend: &str) -> Option<&'a RecordedAttempt> {
        let mut left = self.left.lock().ok()?;
        let i = left.iter().position(|a| a.backend == backend)?;
        Some(left.remove(i))
    }

    fn answer(&self, a: &RecordedAttempt, spec: &CallSpec<'_>) -> CallResult<Served> {
        let failed = |class| {
            CallResult::Failed(Failure {
                class,
                status: a.status,
                retry_after_ms: a.retry_after_ms.map(|v| v.max(0)),
                long_outage: false,
                billed: a.committed_tokens > 0,
            })
        };
        match a.outcome.as_str() {
            "ok" => {
                self.served_cap
                    .store(spec.max_output_tokens, Ordering::Relaxed);
                // A served backend other than the one the record names is not its call.
                if a.backend == self.rec.backend {
                    CallResult::Served(Served::Recorded)
                } else {
                    CallResult::Served(Served::Unrecorded)
                }
            }
            "not_retryable" => CallResult::NotRetryable {
                payload: Served::Unrecorded,
                status: a.status.unwrap_or(400),
            },
            "saturated" => CallResult::Skipped(Skip::Saturated),
            "untranslatable" => CallResult::Skipped(Skip::Untranslatable),
            "429" => failed(FailureClass::Throttled),
            "5xx" => failed(FailureClass::Server),
            "timeout" => failed(FailureClass::Timeout),
            "auth" => failed(FailureClass::Auth),
            _ => failed(FailureClass::Connect),
        }
    }
}

/// The endpoint an audit record names (`chat.completions` when it names none we know).
fn endpoint(name: &str) -> crate::estimate::Endpoint {
    use crate::estimate::Endpoint;
    match name {
        "completions" => Endpoint::Completions,
        "embeddings" => Endpoint::Embeddings,
        _ => Endpoint::Chat,
    }
}

impl Upstream for Played<'_> {
    type Payload = Served;

    /// Every backend that serves the endpoint: whether its key was set when the traffic was
    /// recorded is not in the record, and the replaying machine's keys say nothing about it.
    fn eligible(&self, _index: usize, backend: &Backend) -> bool {
        crate::providers::for_kind(backend.kind).supports(self.endpoint)
    }

    fn call(&self, spec: CallSpec<'_>) -> impl Future<Output = CallResult<Served>> + Send {
        let r = match self.next(&spec.backend.id) {
            Some(a) => {
                self.clock.advance(a.latency_ms);
                self.answer(a, &spec)
            }
            None => {
                self.served_cap
                    .store(spec.max_output_tokens, Ordering::Relaxed);
                CallResult::Served(Served::Unrecorded)
            }
        };
        std::future::ready(r)
    }
}
