//! The seams between the pure core and the world: the upstream call and the clock.
//! The proxy plugs in a pooled HTTP transport and the wall clock; `tollgate test` plugs in
//! scripted answers and a fixed clock that advances only when the core waits.

use crate::policy::{Backend, RetryOn};
use crate::units::Millis;
use std::future::Future;

/// What the core asks the transport to do for one attempt.
#[derive(Debug, Clone, Copy)]
pub struct CallSpec<'a> {
    pub backend: &'a Backend,
    pub backend_index: usize,
    /// The chain entry's upstream model name.
    pub model: &'a std::sync::Arc<str>,
    /// The chain entry's `output_cap_field` (OpenAI kind; `None`: by model name).
    pub output_cap_field: Option<crate::policy::OutputCapField>,
    /// The output cap per choice the upstream must enforce (the reserved worst case).
    pub max_output_tokens: u64,
    /// 1-based attempt number within this request.
    pub attempt: u32,
    pub probe: bool,
}

/// Why an attempt failed, in the classes the circuit and the retry policy understand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// 429 (and provider quota errors that say "slow down").
    Throttled,
    /// 5xx, 529, 408.
    Server,
    Timeout,
    Connect,
    /// Upstream 401/403: our key is wrong. Fail over, count against the circuit.
    Auth,
}

impl FailureClass {
    /// Label for `ai_requests_failed_total{class}` and the audit record.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::Throttled => "429",
            FailureClass::Server => "5xx",
            FailureClass::Timeout => "timeout",
            FailureClass::Connect => "connect",
            FailureClass::Auth => "auth",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    pub class: FailureClass,
    pub status: Option<u16>,
    /// The upstream's Retry-After (any of its spellings), ms.
    pub retry_after_ms: Option<i64>,
    /// The backend will not serve for a long time (a per-day quota is used up): its circuit
    /// opens at once, for at least `retry_after_ms`, instead of counting one failure.
    pub long_outage: bool,
    /// The upstream accepted the call (a 2xx head came) before it failed: it may have billed
    /// it, so the attempt's reserved worst case is committed, never released.
    pub billed: bool,
}

impl Failure {
    /// Whether `retry.retry_on` allows retrying the same backend after this failure.
    pub fn retryable(&self, retry_on: &[RetryOn]) -> bool {
        retry_on.iter().any(|r| match (r, self.class) {
            (RetryOn::Timeout, FailureClass::Timeout) => true,
            (RetryOn::ConnectError, FailureClass::Connect) => true,
            (RetryOn::Status(s), _) => self.status == Some(*s),
            _ => false,
        })
    }
}

/// The answer of one attempt.
#[derive(Debug)]
pub enum CallResult<T> {
    /// The backend accepted the call; `T` is the response (buffered or still streaming).
    Served(T),
    /// A client error (400/404/413/422): passed through unchanged, never retried.
    NotRetryable {
        payload: T,
        status: u16,
    },
    Failed(Failure),
    /// No call was made: the backend cannot take this request now (it is at its
    /// `max_in_flight`, or the request cannot be expressed in its wire format). Not the
    /// backend's fault: no circuit failure, no attempt spent; the chain moves on.
    Skipped(Skip),
}

/// Why the transport made no call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// The backend is at its `max_in_flight`: spill over now, the backend is merely busy.
    Saturated,
    /// The request cannot be expressed in the backend's wire format.
    Untranslatable,
}

impl Skip {
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Saturated => "saturated",
            Skip::Untranslatable => "untranslatable",
        }
    }
}

/// The upstream transport.
pub trait Upstream: Sync {
    type Payload: Send;

    /// Whether a backend (at `index` in the policy) can be called at all for this request (its
    /// key is set, it serves the endpoint, it has room).
    fn eligible(&self, index: usize, backend: &Backend) -> bool;

    fn call(&self, spec: CallSpec<'_>) -> impl Future<Output = CallResult<Self::Payload>> + Send;
}

/// Time, injected.
pub trait Clock: Sync {
    fn now_ms(&self) -> Millis;
    fn sleep_ms(&self, ms: u64) -> impl Future<Output = ()> + Send;
}

/// The wall clock and tokio timers.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        crate::units::now_ms()
    }
    fn sleep_ms(&self, ms: u64) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(std::time::Duration::from_millis(ms))
    }
}
