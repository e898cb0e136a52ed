//! The spans of one governed request, kept as compact records while it runs and turned into
//! OTLP when it ends, on the thread where it ended ([`super::export`]).
//!
//! Server span (`SERVER`, `{operation} {route}`): from the handler's start to the end of the
//! answer (a stream's last byte), with the decision record's fields. Client spans (`CLIENT`),
//! one per upstream attempt: a failed or skipped attempt ends when it fails; the served one
//! ends with the request, carrying the usage, the response model and the finish reasons.
//!
//! What the request path does while the request runs: parse the caller's `traceparent`, make
//! ids, read the monotonic clock once per event as plain nanoseconds (placed on the wall clock
//! at encoding, which reads it once a batch), write one `traceparent` per attempt, and note
//! what the answer says of itself. Attributes, names, protobuf and metric aggregation happen
//! once it has been answered (after the answer's last byte went out), reading the decision
//! from the finished record ([`Decision`]: borrowed, not copied); the trace's box is then kept
//! for the thread's next request.

use super::context::{self, Parent, Sampler};
use super::notes::Notes;
use super::with;
use crate::audit::Entry;
use crate::governor::{
    BudgetState, CallResult, CallSpec, CircuitState, FallbackState, FinalAction, QuotaState,
    ReasonClass, Record, RetryState, UsageEvidence,
};
use crate::policy::BackendKind;
use http::HeaderValue;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");
const TRACESTATE: http::HeaderName = http::HeaderName::from_static("tracestate");

/// Wall-clock now, ns since the Unix epoch (OTLP's timestamps).
pub(super) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The monotonic clock (`CLOCK_MONOTONIC`, the one `Instant` reads), in ns: span times are
/// kept in it as plain integers, whose differences cost a subtraction (an `Instant`'s cost
/// ~80 instructions each).
pub(crate) fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let secs = u64::try_from(t.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(t.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

/// Seconds between two [`mono_ns`] readings (0 when `end` is not after `start`).
pub(crate) fn secs_between(start: u64, end: u64) -> f64 {
    end.saturating_sub(start) as f64 * 1e-9
}

/// The wall clock at one monotonic reading, which places the others on it: the request path
/// reads only the monotonic clock, and the wall clock is read once a batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wall {
    ns: u64,
    mono: u64,
}

impl Wall {
    pub fn now() -> Wall {
        Wall {
            ns: now_ns(),
            mono: mono_ns(),
        }
    }

    /// The [`mono_ns`] reading `m` in Unix ns (saturating).
    pub fn ns(&self, m: u64) -> u64 {
        if m >= self.mono {
            self.ns.saturating_add(m - self.mono)
        } else {
            self.ns.saturating_sub(self.mono - m)
        }
    }
}

/// What every span of one trace shares.
#[derive(Debug, Clone)]
pub(crate) struct TraceIds {
    pub trace_id: [u8; 16],
    pub sampled: bool,
    /// The caller's `tracestate`, passed on as it came.
    pub tracestate: Option<HeaderValue>,
}

/// One governed request's trace: its server span and its attempts, kept in the record the
/// encoding reads (the trace is boxed once, and the box is kept for the thread's next request).
pub struct RequestTrace {
    pub(super) f: Finished,
    /// The served attempt, open until the request ends.
    served: Option<Attempt>,
}

impl std::fmt::Debug for RequestTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestTrace")
            .field("op", &self.f.op)
            .finish_non_exhaustive()
    }
}

/// One upstream attempt's client span: its place among the request's attempts, whose record
/// lives in the request's trace (filled in place there: no allocation per attempt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt(u32);

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Served; `status` is the answer's.
    Served,
    /// A failure class (`429`, `5xx`, `timeout`, …), with the status when there was one.
    Failed(&'static str, Option<u16>),
    /// A client error passed through (never retried).
    Status(u16),
    /// No call was made (`saturated`, `untranslatable`).
    Skipped(&'static str),
}

/// An attempt's record, as the encoding reads it (`end` and `outcome` are set when it
/// ends).
#[derive(Debug)]
pub(crate) struct AttemptDone {
    pub span_id: [u8; 8],
    /// Start and end, [`mono_ns`].
    pub start: u64,
    pub end: u64,
    pub backend: Arc<str>,
    pub provider: &'static str,
    pub model: Arc<str>,
    /// The backend's base URL (its host and port become `server.*` when encoded).
    pub base_url: Arc<str>,
    pub max_tokens: u64,
    pub attempt: u32,
    pub probe: bool,
    /// When the first chunk of a streamed answer came ([`mono_ns`]).
    pub first_chunk: Option<u64>,
    pub outcome: Outcome,
}

impl AttemptDone {
    /// How long the attempt took, in seconds.
    pub fn duration_s(&self) -> f64 {
        secs_between(self.start, self.end)
    }

    /// Time to the first chunk of a streamed answer, in seconds.
    pub fn first_chunk_s(&self) -> Option<f64> {
        self.first_chunk.map(|c| secs_between(self.start, c))
    }
}

/// A request's attempts, in order, kept in the request's trace: the first inline (most
/// requests make one attempt, whose list then costs no allocation). An attempt is exported
/// once it ended; one still open when the request ends (its call was abandoned) is not.
#[derive(Debug, Default)]
pub(crate) struct Attempts {
    first: Option<Slot>,
    rest: Vec<Slot>,
}

#[derive(Debug)]
struct Slot {
    done: AttemptDone,
    open: bool,
}

impl Attempts {
    /// Adds an open attempt, returning its place.
    fn open(&mut self, done: AttemptDone) -> Attempt {
        let slot = Slot { done, open: true };
        if self.first.is_none() {
            self.first = Some(slot);
            return Attempt(0);
        }
        self.rest.push(slot);
        Attempt(u32::try_from(self.rest.len()).unwrap_or(u32::MAX))
    }

    /// Forgets every attempt (keeping the room of the later ones).
    fn clear(&mut self) {
        self.first = None;
        self.rest.clear();
    }

    fn slot(&mut self, a: Attempt) -> Option<&mut Slot> {
        match a.0 {
            0 => self.first.as_mut(),
            i => self.rest.get_mut(i as usize - 1),
        }
    }

    fn get(&self, a: Attempt) -> Option<&AttemptDone> {
        match a.0 {
            0 => self.first.as_ref(),
            i => self.rest.get(i as usize - 1),
        }
        .map(|s| &s.done)
    }

    /// The ended attempts, in order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &AttemptDone> {
        self.first
            .iter()
            .chain(&self.rest)
            .filter(|s| !s.open)
            .map(|s| &s.done)
    }

    pub fn last(&self) -> Option<&AttemptDone> {
        self.iter().next_back()
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }
}

/// Tests build a record's attempts from their records alone.
#[cfg(test)]
impl From<Vec<AttemptDone>> for Attempts {
    fn from(v: Vec<AttemptDone>) -> Attempts {
        let mut a = Attempts::default();
        for done in v {
            let at = a.open(done);
            if let Some(s) = a.slot(at) {
                s.open = false;
            }
        }
        a
    }
}

/// The decision record's fields the export reads, borrowed from the finished record where
/// the request ends (the spans are encoded there: nothing is copied or cloned).
#[derive(Debug)]
pub(crate) struct Decision<'a> {
    pub states: States,
    pub http_status: u16,
    pub route: &'a Arc<str>,
    pub consumer: &'a Arc<str>,
    pub team: Option<&'a Arc<str>>,
    pub policy_version: &'a Arc<str>,
    pub backend: &'a Arc<str>,
    pub request_id: &'a Arc<str>,
    /// `None`: the request's own id (a request without a job header is its own job).
    pub job_id: Option<&'a Arc<str>>,
    pub upstream_model: Option<&'a Arc<str>>,
    pub requested_output_tokens: u64,
    /// Settled usage, when there is any evidence of it.
    pub usage: Option<(u64, u64)>,
    pub cache_write_tokens: u64,
    pub cost_usd: f64,
    pub attempts: usize,
}

impl<'a> Decision<'a> {
    pub(crate) fn of(rec: &'a Record) -> Decision<'a> {
        Decision {
            states: States {
                final_action: rec.final_action,
                reason_class: rec.reason_class,
                budget: rec.budget_state,
                quota: rec.quota_state,
                circuit: rec.circuit_state,
                retry: rec.retry_state,
                usage_evidence: rec.usage_evidence_state,
                fallback: rec.fallback_state,
            },
            http_status: rec.http_status,
            route: &rec.route,
            consumer: &rec.consumer_id,
            team: rec.team.as_ref(),
            policy_version: &rec.policy_version,
            backend: &rec.backend,
            request_id: &rec.request_id,
            job_id: (!Arc::ptr_eq(&rec.job_id, &rec.request_id)).then_some(&rec.job_id),
            upstream_model: rec.upstream_model.as_ref(),
            requested_output_tokens: rec.requested_output_tokens,
            usage: (rec.usage_evidence_state != UsageEvidence::None)
                .then_some((rec.actual_input_tokens, rec.actual_output_tokens)),
            cache_write_tokens: rec.actual_cache_write_tokens,
            cost_usd: rec.cost_usd,
            attempts: rec.attempts.len(),
        }
    }

    /// `tollgate.job_id`.
    pub fn job_id(&self) -> &'a str {
        self.job_id.unwrap_or(self.request_id)
    }

    /// `tollgate.reason_class`.
    pub fn reason(&self) -> &'static str {
        self.states.reason_class.as_str()
    }
}

/// The decision's eight states, as the governor's enums (their names are looked up only when
/// a block of attributes is encoded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct States {
    pub final_action: FinalAction,
    pub reason_class: ReasonClass,
    pub budget: BudgetState,
    pub quota: QuotaState,
    pub circuit: CircuitState,
    pub retry: RetryState,
    pub usage_evidence: UsageEvidence,
    pub fallback: FallbackState,
}

impl Default for States {
    /// Nothing happened yet: allowed, no limit hit, no usage seen.
    fn default() -> States {
        States {
            final_action: FinalAction::Allow,
            reason_class: ReasonClass::Ok,
            budget: BudgetState::Ok,
            quota: QuotaState::Ok,
            circuit: CircuitState::Closed,
            retry: RetryState::NotNeeded,
            usage_evidence: UsageEvidence::None,
            fallback: FallbackState::NotNeeded,
        }
    }
}

impl States {
    /// The values of [`STATE_KEYS`], in order.
    pub fn strs(&self) -> [&'static str; 8] {
        [
            self.final_action.as_str(),
            self.reason_class.as_str(),
            self.budget.as_str(),
            self.quota.as_str(),
            self.circuit.as_str(),
            self.retry.as_str(),
            self.usage_evidence.as_str(),
            self.fallback.as_str(),
        ]
    }
}

/// The names of [`States::strs`], in order.
pub(crate) const STATE_KEYS: [&str; 8] = [
    "tollgate.final_action",
    "tollgate.reason_class",
    "tollgate.budget_state",
    "tollgate.quota_state",
    "tollgate.circuit_state",
    "tollgate.retry_state",
    "tollgate.usage_evidence_state",
    "tollgate.fallback_state",
];

/// A finished request, as the encoding reads it.
#[derive(Debug)]
pub(crate) struct Finished {
    pub ids: TraceIds,
    pub span_id: [u8; 8],
    pub parent: Option<[u8; 8]>,
    /// Start and end, [`mono_ns`].
    pub start: u64,
    pub end: u64,
    pub op: &'static str,
    pub path: &'static str,
    pub notes: Notes,
    pub attempts: Attempts,
}

impl Finished {
    /// The attempt that served, if one did: the last, ended with the request.
    pub fn served(&self) -> Option<&AttemptDone> {
        self.attempts
            .last()
            .filter(|a| a.outcome == Outcome::Served)
    }
}

/// The semconv `gen_ai.provider.name` of a backend kind.
pub(crate) fn provider_name(kind: BackendKind) -> &'static str {
    match kind {
        BackendKind::Gemini => "gcp.gemini",
        other => other.as_str(),
    }
}

impl RequestTrace {
    /// Inlined into its caller, which writes it straight into its box.
    #[inline(always)]
    pub(super) fn start(
        sampler: Sampler,
        headers: &http::HeaderMap,
        path: &'static str,
        op: &'static str,
    ) -> Self {
        let (ids, parent, start) = begin(sampler, headers);
        RequestTrace {
            f: Finished {
                ids,
                span_id: context::span_id(),
                parent,
                start,
                end: start,
                op,
                path,
                notes: Notes::default(),
                attempts: Attempts::default(),
            },
            served: None,
        }
    }

    /// Starts a new request's trace in the place of this finished one (its box reused), each
    /// field written where it is: the record is not built elsewhere and copied in.
    pub(super) fn restart(
        &mut self,
        sampler: Sampler,
        headers: &http::HeaderMap,
        path: &'static str,
        op: &'static str,
    ) {
        let (ids, parent, start) = begin(sampler, headers);
        let f = &mut self.f;
        f.ids = ids;
        f.span_id = context::span_id();
        f.parent = parent;
        f.start = start;
        f.end = start;
        f.op = op;
        f.path = path;
        f.notes = Notes::default();
        f.attempts.clear();
        self.served = None;
    }

    pub(super) fn attempt(&mut self, spec: &CallSpec<'_>) -> Attempt {
        let start = mono_ns();
        self.f.attempts.open(AttemptDone {
            span_id: context::span_id(),
            start,
            end: start,
            backend: spec.backend.id.clone(),
            provider: provider_name(spec.backend.kind),
            model: spec.model.clone(),
            base_url: spec.backend.base_url.clone(),
            max_tokens: spec.max_output_tokens,
            attempt: spec.attempt,
            probe: spec.probe,
            first_chunk: None,
            // Set when it ends.
            outcome: Outcome::Served,
        })
    }

    /// Ends attempt `a` with `outcome`: a failed or skipped one now, the served one with the
    /// request ([`RequestTrace::finish`]).
    pub(super) fn end_attempt(&mut self, a: Attempt, outcome: Outcome) {
        let Some(s) = self.f.attempts.slot(a) else {
            return;
        };
        s.open = false;
        s.done.outcome = outcome;
        if outcome == Outcome::Served {
            self.served = Some(a);
        } else {
            s.done.end = mono_ns();
        }
    }

    /// Notes what a served answer said of itself, read in the transport's own parse of it.
    pub(super) fn said(
        &mut self,
        a: Attempt,
        said: &crate::providers::validate::Said<'_>,
        cached: Option<u64>,
    ) {
        let f = &mut self.f;
        if let Some(a) = f.attempts.get(a) {
            f.notes.said(&a.model, said, cached, f.ids.sampled);
        }
    }

    /// Notes a chunk of a streamed answer: its first arrival, and what it says of itself.
    pub fn chunk(&mut self, data: &[u8]) {
        if let Some(s) = self.served.and_then(|a| self.f.attempts.slot(a)) {
            if s.done.first_chunk.is_none() {
                s.done.first_chunk = Some(mono_ns());
            }
        }
        self.f.notes.scan(data, self.f.ids.sampled);
    }

    /// Ends the served attempt and the server span with the decision, and records the lot
    /// for export on this thread (its spans encoded into the thread's batch, its metrics into
    /// the thread's aggregates: see [`super::export`]).
    pub fn finish(mut self: Box<Self>, entry: &Entry) {
        self.close();
        super::record(&self.f, &Decision::of(&entry.record));
        super::keep_box(self);
    }

    /// Ends the served attempt and the server span.
    fn close(&mut self) {
        let end = mono_ns();
        self.f.end = end;
        if let Some(s) = self.served.and_then(|a| self.f.attempts.slot(a)) {
            s.done.end = end;
        }
    }
}

/// A new trace's ids (the caller's trace continued, when it sent one), its parent and its start.
#[inline(always)]
fn begin(sampler: Sampler, headers: &http::HeaderMap) -> (TraceIds, Option<[u8; 8]>, u64) {
    let start = mono_ns();
    let caller: Option<Parent> =
        header(headers, &TRACEPARENT).and_then(|v| context::parse_traceparent(v.as_bytes()));
    let trace_id = caller.map_or_else(context::trace_id, |p| p.trace_id);
    let sampled = sampler.keeps(&trace_id, caller.as_ref());
    let tracestate = match caller {
        Some(_) => header(headers, &TRACESTATE).cloned(),
        None => None,
    };
    let ids = TraceIds {
        trace_id,
        sampled,
        tracestate,
    };
    (ids, caller.map(|p| p.span_id), start)
}

/// A request header's first value. Most requests carry no trace context: whether the name is
/// there at all is found by comparing the handful of names a request has (most differ in
/// length or are standard ones), which costs less than hashing a custom name for the map's
/// look-up; the look-up runs only when it is there (or past a few dozen headers).
fn header<'h>(headers: &'h http::HeaderMap, name: &http::HeaderName) -> Option<&'h HeaderValue> {
    if headers.keys_len() <= 32 && !headers.keys().any(|k| k == name) {
        return None;
    }
    headers.get(name)
}

/// Whether `name` is a W3C trace-context header, which a traced attempt writes itself.
pub fn is_trace_context(name: &http::HeaderName) -> bool {
    name == TRACEPARENT || name == TRACESTATE
}

/// An attempt's `traceparent` as a line of the own HTTP/1.1 client's head:
/// `\r\ntraceparent: 00-…` (hex digits and dashes: carriable as made).
pub struct TraceLine([u8; 70]);

impl TraceLine {
    fn new(tp: &[u8; 55]) -> Self {
        let mut b = [0u8; 70];
        b[..15].copy_from_slice(b"\r\ntraceparent: ");
        b[15..].copy_from_slice(tp);
        TraceLine(b)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The field's value alone.
    fn value(&self) -> &[u8] {
        &self.0[15..]
    }
}

impl Attempt {
    /// This attempt's `traceparent` as a header line the own client writes as it is (no
    /// header map insert, no `HeaderValue` made); the caller's `tracestate`, when it sent one,
    /// goes into `headers`. `None` outside a traced request.
    pub fn lines(self, headers: &mut http::HeaderMap) -> Option<TraceLine> {
        with(|t| {
            let a = t.f.attempts.get(self)?;
            let ids = &t.f.ids;
            if let Some(ts) = &ids.tracestate {
                headers.insert(TRACESTATE, ts.clone());
            }
            Some(TraceLine::new(&context::traceparent(
                &ids.trace_id,
                &a.span_id,
                ids.sampled,
            )))
        })
        .flatten()
    }

    /// Writes this attempt's `traceparent` (and the caller's `tracestate`) on the upstream
    /// request, which carries none of the client's (the transport does not forward them on a
    /// traced attempt): [`lines`](Self::lines), with the line's value put in the map.
    pub fn inject(self, headers: &mut http::HeaderMap) {
        if let Some(line) = self.lines(headers) {
            if let Ok(v) = HeaderValue::from_bytes(line.value()) {
                headers.insert(TRACEPARENT, v);
            }
        }
    }

    /// Ends the attempt with its result; the served one ends with the request.
    pub fn end<T>(self, r: &CallResult<T>) {
        let outcome = match r {
            CallResult::Served(_) => Outcome::Served,
            CallResult::NotRetryable { status, .. } => Outcome::Status(*status),
            CallResult::Failed(f) => Outcome::Failed(f.class.as_str(), f.status),
            CallResult::Skipped(s) => Outcome::Skipped(s.as_str()),
        };
        with(|t| t.end_attempt(self, outcome));
    }
}

#[cfg(test)]
mod tests {
    use super::{context::Sampler, Attempt, Outcome, RequestTrace};
    use crate::governor::CallSpec;
    use crate::policy::Policy;
    use std::sync::Arc;

    /// A policy of one backend, and the model its route calls.
    fn policy() -> (Policy, Arc<str>) {
        let p = crate::policy::from_str(
            "version: v\nbackends:\n  - {id: b, kind: openai, base_url: 'http://h:9/v1'}\nroutes:\n  - model: chat\n    chain: [{backend: b, model: m}]\n",
            "p.yaml",
        )
        .unwrap();
        (p, Arc::from("m"))
    }

    /// Attempt number `attempt` of the policy's one backend.
    fn spec<'a>(p: &'a Policy, model: &'a Arc<str>, attempt: u32) -> CallSpec<'a> {
        CallSpec {
            backend: &p.backends[0],
            backend_index: 0,
            model,
            output_cap_field: None,
            max_output_tokens: 10,
            attempt,
            probe: false,
        }
    }

    #[test]
    fn attempts_keep_their_order_and_one_left_open_is_not_exported() {
        let (p, model) = policy();
        let spec = |attempt| spec(&p, &model, attempt);
        let mut t = RequestTrace::start(
            Sampler::AlwaysOn,
            &http::HeaderMap::new(),
            "/v1/chat/completions",
            "chat",
        );
        // Failed, then served, then one abandoned (its call dropped before it ended).
        let (a, b, c) = (
            t.attempt(&spec(1)),
            t.attempt(&spec(2)),
            t.attempt(&spec(3)),
        );
        assert_eq!((a, b, c), (Attempt(0), Attempt(1), Attempt(2)));
        t.end_attempt(a, Outcome::Failed("5xx", Some(503)));
        t.end_attempt(b, Outcome::Served);
        assert_eq!(t.f.attempts.len(), 2);
        t.chunk(b"data: {}");
        // A handle of no attempt of this trace changes nothing.
        t.end_attempt(Attempt(9), Outcome::Served);
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.close();
        let ended: Vec<(u32, Outcome)> =
            t.f.attempts
                .iter()
                .map(|d| (d.attempt, d.outcome))
                .collect();
        assert_eq!(
            ended,
            [(1, Outcome::Failed("5xx", Some(503))), (2, Outcome::Served)]
        );
        let served = t.f.served().unwrap();
        assert_eq!(served.attempt, 2);
        // The served attempt ends with the request, after its first chunk.
        assert_eq!(served.end, t.f.end);
        assert!(served
            .first_chunk
            .is_some_and(|c| c >= served.start && c < served.end));
        assert!(t.f.attempts.iter().next().unwrap().end < served.end);
    }

    #[test]
    fn a_trace_started_again_in_its_box_keeps_nothing_of_the_last() {
        let (p, model) = policy();
        let spec = |attempt| spec(&p, &model, attempt);
        let mut caller = http::HeaderMap::new();
        caller.insert(
            "traceparent",
            http::HeaderValue::from_static(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        );
        caller.insert("tracestate", http::HeaderValue::from_static("k=v"));
        let mut t = RequestTrace::start(Sampler::AlwaysOn, &caller, "/v1/chat/completions", "chat");
        let (a, b) = (t.attempt(&spec(1)), t.attempt(&spec(2)));
        t.end_attempt(a, Outcome::Failed("5xx", Some(503)));
        t.end_attempt(b, Outcome::Served);
        t.chunk(br#"{"model":"resp","choices":[{"finish_reason":"stop"}],"usage":{"prompt_tokens_details":{"cached_tokens":3}}}"#);
        assert!(t.f.notes.model.is_some() && !t.f.notes.finish.is_empty());
        t.close();
        let old = (t.f.ids.trace_id, t.f.span_id);
        t.restart(
            Sampler::AlwaysOn,
            &http::HeaderMap::new(),
            "/v1/embeddings",
            "embeddings",
        );
        let f = &t.f;
        assert_ne!((f.ids.trace_id, f.span_id), old);
        assert!(f.ids.tracestate.is_none() && f.parent.is_none());
        assert_eq!(
            (f.op, f.path, f.end),
            ("embeddings", "/v1/embeddings", f.start)
        );
        assert_eq!(f.attempts.len(), 0);
        assert!(f.notes.model.is_none() && f.notes.finish.is_empty() && f.notes.cached.is_none());
        assert!(t.served.is_none());
        // Its attempts start over at the first place.
        assert_eq!(t.attempt(&spec(1)), Attempt(0));
        assert_eq!(t.f.attempts.len(), 0, "open until it ends");
    }
}
