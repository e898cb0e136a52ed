//! The decision record (SPEC §2): eight fields with closed value sets, plus the facts a
//! reviewer needs to rebuild why a call was allowed, degraded, deferred or stopped.

use serde::Serialize;
use std::sync::Arc;

use super::circuit::CircuitState;
use super::upstream::{FailureClass, Skip};

macro_rules! state_enum {
    ($(#[$m:meta])* $name:ident { $($variant:ident => $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
        pub enum $name { $(#[serde(rename = $s)] $variant),+ }
        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            pub fn as_str(self) -> &'static str { match self { $($name::$variant => $s),+ } }
            pub fn parse(s: &str) -> Option<Self> { match s { $($s => Some($name::$variant),)+ _ => None } }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(self.as_str()) }
        }
    };
}

state_enum!(BudgetState { Ok => "OK", SoftExceeded => "SOFT_EXCEEDED", HardExceeded => "HARD_EXCEEDED" });
state_enum!(QuotaState { Ok => "OK", RateLimited => "RATE_LIMITED", Exhausted => "EXHAUSTED" });
state_enum!(RetryState {
    NotNeeded => "NOT_NEEDED", Retried => "RETRIED", Exhausted => "EXHAUSTED",
    Blocked => "BLOCKED", NotRetryable => "NOT_RETRYABLE",
});
state_enum!(UsageEvidence { None => "NONE", Actual => "ACTUAL", Estimated => "ESTIMATED", Partial => "PARTIAL" });
state_enum!(FallbackState {
    NotNeeded => "NOT_NEEDED", Used => "USED", BlockedBudget => "BLOCKED_BUDGET", Exhausted => "EXHAUSTED",
});
state_enum!(FinalAction { Allow => "ALLOW", Degrade => "DEGRADE", Defer => "DEFER", HardStop => "HARD_STOP" });
state_enum!(
    /// Declared in gate order (SPEC §1.3): the first gate that blocked or changed the outcome
    /// wins, so the derived `Ord` is the precedence.
    #[derive(PartialOrd, Ord)]
    ReasonClass {
        Ok => "OK",
        Unauthenticated => "UNAUTHENTICATED",
        BadRequest => "BAD_REQUEST",
        // Not in SPEC §2's list: the shared state store (Redis) did not answer, so no bound
        // could be judged. It precedes the bounds' gates; the answer is DEFER 503.
        StateUnavailable => "STATE_UNAVAILABLE",
        // Also tollgate's: Redis lost its counters (epoch marker gone) and they are being
        // rebuilt from the replicas' journals; no hard bound is judged until they are.
        StateRebuilding => "STATE_REBUILDING",
        RateLimited => "RATE_LIMITED",
        QuotaBlocked => "QUOTA_BLOCKED",
        HardBudgetExceeded => "HARD_BUDGET_EXCEEDED",
        FallbackOverBudget => "FALLBACK_OVER_BUDGET",
        SoftBudgetExceeded => "SOFT_BUDGET_EXCEEDED",
        ModelIneligible => "MODEL_INELIGIBLE",
        CircuitOpen => "CIRCUIT_OPEN",
        HalfOpenProbe => "HALF_OPEN_PROBE",
        RetryBudgetExhausted => "RETRY_BUDGET_EXHAUSTED",
        UpstreamFailure => "UPSTREAM_FAILURE",
    }
);

impl ReasonClass {
    /// Keeps the earlier gate's reason: `OK` is replaced by anything.
    pub fn note(&mut self, r: ReasonClass) {
        if *self == ReasonClass::Ok || r < *self {
            *self = r;
        }
    }
}

/// How one attempt ended: the audit record's `attempts[].outcome`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// The upstream served the call.
    Ok,
    /// A client error passed through unchanged.
    NotRetryable,
    /// The call failed, in one of the circuit's failure classes.
    Failed(FailureClass),
    /// No call was made (`attempt` is 0 in the record).
    Skipped(Skip),
}

impl AttemptOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Ok => "ok",
            AttemptOutcome::NotRetryable => "not_retryable",
            AttemptOutcome::Failed(class) => class.as_str(),
            AttemptOutcome::Skipped(why) => why.as_str(),
        }
    }
}

/// Who answered a request: the record's `backend` string. The record keeps the string (the
/// audit log, the metrics and the `x-tollgate-backend` header read it as one); the governor
/// writes it only through this type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServedBy {
    /// A backend's id.
    Backend(Arc<str>),
    /// The route's static response (`static`).
    Static,
    /// Nobody: the request was refused, or failed before a backend answered (`none`).
    None,
}

/// The constant strings a record starts with, made once and shared: a record is made twice
/// a request, and a fresh `Arc` of a constant cost an allocation and a free each time.
static NONE: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("none"));
static STATIC: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("static"));
static EMPTY: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(""));

/// The empty string, shared (a record's route before one is resolved).
pub fn empty() -> Arc<str> {
    Arc::clone(&EMPTY)
}

/// `"none"`, shared (the backend and consumer of a record nothing was resolved for).
pub fn none() -> Arc<str> {
    Arc::clone(&NONE)
}

impl ServedBy {
    /// The record's `backend` string.
    pub fn label(&self) -> Arc<str> {
        match self {
            ServedBy::Backend(id) => id.clone(),
            ServedBy::Static => Arc::clone(&STATIC),
            ServedBy::None => none(),
        }
    }
}

/// One upstream attempt, for the audit record.
#[derive(Debug, Clone, Serialize)]
pub struct AttemptRecord {
    pub backend: Arc<str>,
    pub model: Arc<str>,
    pub attempt: u32,
    pub probe: bool,
    pub worst_tokens: u64,
    pub worst_cost_usd: f64,
    pub max_output_tokens: u64,
    /// `ok`, `not_retryable`, the failure class, or why no call was made
    /// ([`AttemptOutcome::as_str`]).
    pub outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<i64>,
    pub circuit_before: CircuitState,
    pub circuit_after: CircuitState,
    pub latency_ms: i64,
    /// What was waited before this attempt (backoff or Retry-After), ms.
    pub waited_ms: i64,
    /// Tokens committed for a failed attempt the upstream had accepted (its reserved worst
    /// case); 0 otherwise (a served attempt's usage is the record's own).
    #[serde(skip_serializing_if = "is_zero")]
    pub committed_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// A bound that refused or was checked, for the audit record. Its usd amounts are held in
/// micro-dollars and written in dollars, like every other amount of the record.
#[derive(Debug, Clone)]
pub struct BoundNote {
    pub name: Arc<str>,
    pub class: &'static str,
    pub scope: &'static str,
    pub id: Arc<str>,
    pub window: Option<&'static str>,
    pub dim: &'static str,
    pub used: u64,
    pub limit: u64,
    pub asked: u64,
    /// Which backend's attempt was refused.
    pub backend: Arc<str>,
}

impl Serialize for BoundNote {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let usd = self.dim == "usd";
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("name", &*self.name)?;
        m.serialize_entry("class", self.class)?;
        m.serialize_entry("scope", self.scope)?;
        m.serialize_entry("id", &*self.id)?;
        if let Some(w) = self.window {
            m.serialize_entry("window", w)?;
        }
        m.serialize_entry("dim", self.dim)?;
        for (k, v) in [
            ("used", self.used),
            ("limit", self.limit),
            ("asked", self.asked),
        ] {
            if usd {
                m.serialize_entry(k, &crate::units::micros_to_usd(v))?;
            } else {
                m.serialize_entry(k, &v)?;
            }
        }
        m.serialize_entry("backend", &*self.backend)?;
        m.end()
    }
}

/// One `alert_at` threshold crossed by a request's committed usage.
#[derive(Debug, Clone, Serialize)]
pub struct AlertNote {
    /// The bound's name.
    pub bound: Arc<str>,
    /// `rate_limit`, `quota` or `budget`.
    pub class: &'static str,
    pub scope: &'static str,
    /// Whose counter crossed (a backend, model or consumer id, `global`, a job id).
    pub id: Arc<str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<&'static str>,
    /// Start of the counter's window, Unix seconds (tells windows apart).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window_start: Option<i64>,
    /// `tokens`, `requests` or `usd` (usd amounts in micro-dollars).
    pub dim: &'static str,
    /// The fraction of `limit` from `alert_at`.
    pub threshold: f64,
    pub used: u64,
    pub limit: u64,
}

/// The full decision for one governed request: its fields ([`RecordFields`]) in one box, so
/// the record moves between the phases of a request, the governor, the audit queue and the
/// trace as a pointer (the fields are ~700 bytes: each move was a `memcpy` of ~90
/// instructions, ~15 of them a request). Reads and writes of its fields go through `Deref`.
#[derive(Clone, Serialize)]
#[serde(transparent)]
pub struct Record(Box<RecordFields>);

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::ops::Deref for Record {
    type Target = RecordFields;
    #[inline]
    fn deref(&self) -> &RecordFields {
        &self.0
    }
}

impl std::ops::DerefMut for Record {
    #[inline]
    fn deref_mut(&mut self) -> &mut RecordFields {
        &mut self.0
    }
}

/// The fields of a [`Record`].
#[derive(Debug, Clone, Serialize)]
pub struct RecordFields {
    pub budget_state: BudgetState,
    pub quota_state: QuotaState,
    pub circuit_state: CircuitState,
    pub retry_state: RetryState,
    pub usage_evidence_state: UsageEvidence,
    pub fallback_state: FallbackState,
    pub final_action: FinalAction,
    pub reason_class: ReasonClass,

    pub http_status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
    /// Inline for the common single call (no allocation); a retry or fallback spills.
    pub calls: smallvec::SmallVec<[Arc<str>; 1]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_max_tokens: Option<u64>,

    pub policy_version: Arc<str>,
    pub request_id: Arc<str>,
    pub job_id: Arc<str>,
    pub consumer_id: Arc<str>,
    /// The caller's team, from its virtual key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub team: Option<Arc<str>>,
    pub route: Arc<str>,
    /// The backend that served: an id, `static`, or `none` ([`ServedBy::label`]).
    pub backend: Arc<str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_model: Option<Arc<str>>,
    pub estimated_input_tokens: u64,
    pub requested_output_tokens: u64,
    /// The client's own output cap per choice (`max_tokens` or its dialect's name); absent:
    /// it sent none and the route's default applied. With `n`, what `tollgate replay` needs
    /// to work the cap out again under another policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_max_tokens: Option<u64>,
    /// Choices asked for; written only when more than one.
    #[serde(skip_serializing_if = "is_one")]
    pub n: u32,
    pub worst_case_tokens: u64,
    pub worst_case_usd: f64,
    pub actual_input_tokens: u64,
    pub actual_output_tokens: u64,
    /// Of the actual input, read from the provider's prompt cache.
    pub actual_cached_input_tokens: u64,
    /// Of the actual input, written to the provider's prompt cache.
    pub actual_cache_write_tokens: u64,
    pub cost_usd: f64,
    pub job_attempts: u32,
    pub retry_budget: u32,
    pub job_fallbacks: u32,
    /// Sum of the worst cases of this request's attempts over the primary's worst case.
    pub amplification: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining_tokens: Option<u64>,
    /// Inline for the common single attempt (no allocation); more spill.
    pub attempts: smallvec::SmallVec<[AttemptRecord; 1]>,
    pub refusals: Vec<BoundNote>,
    /// The bound that refused this request, as the client reads it (SPEC §3.2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<super::limits::LimitDetail>,
    /// Shadow bounds (`enforce: shadow`) this request crossed: the `limit` object each would
    /// have refused it with (SPEC §9). Empty (no allocation) as a rule.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shadow: Vec<super::limits::LimitDetail>,
    /// The token bounds of the admitted call, for the rate-limit headers (not audited).
    #[serde(skip)]
    pub token_limits: Vec<super::limits::TokenLimit>,
    /// Alert thresholds this request's usage crossed (each crossing happens once per
    /// counter and window: committed usage only grows within a window).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub alerts: Vec<AlertNote>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The committed usage was above the reserved worst case (a provider billed past the cap
    /// it was sent, or reported an absurd count).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub usage_over_reservation: bool,
    /// The client went away before the answer was delivered; the call was still reconciled.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub client_disconnected: bool,
}

impl Record {
    /// A record for tests: policy `v`, request and job `r`, consumer `c`, route `chat`, served
    /// by `backend`.
    #[cfg(test)]
    pub fn test_chat(backend: &str) -> Self {
        let mut r = Record::new(
            Arc::from("v"),
            Arc::from("r"),
            Arc::from("r"),
            Arc::from("c"),
            Arc::from("chat"),
        );
        r.backend = Arc::from(backend);
        r
    }

    pub fn new(
        policy_version: Arc<str>,
        request_id: Arc<str>,
        job_id: Arc<str>,
        consumer_id: Arc<str>,
        route: Arc<str>,
    ) -> Self {
        // Written into its box: the fields are not built on the stack and copied.
        Record(Box::write(
            Box::new_uninit(),
            RecordFields {
                budget_state: BudgetState::Ok,
                quota_state: QuotaState::Ok,
                circuit_state: CircuitState::Closed,
                retry_state: RetryState::NotNeeded,
                usage_evidence_state: UsageEvidence::None,
                fallback_state: FallbackState::NotNeeded,
                final_action: FinalAction::Allow,
                reason_class: ReasonClass::Ok,
                http_status: 200,
                retry_after: None,
                calls: smallvec::SmallVec::new(),
                upstream_max_tokens: None,
                policy_version,
                request_id,
                job_id,
                consumer_id,
                team: None,
                route,
                backend: ServedBy::None.label(),
                upstream_model: None,
                estimated_input_tokens: 0,
                requested_output_tokens: 0,
                client_max_tokens: None,
                n: 1,
                worst_case_tokens: 0,
                worst_case_usd: 0.0,
                actual_input_tokens: 0,
                actual_output_tokens: 0,
                actual_cached_input_tokens: 0,
                actual_cache_write_tokens: 0,
                cost_usd: 0.0,
                job_attempts: 0,
                retry_budget: 0,
                job_fallbacks: 0,
                amplification: 0.0,
                remaining_tokens: None,
                attempts: smallvec::SmallVec::new(),
                refusals: Vec::new(),
                limit: None,
                shadow: Vec::new(),
                token_limits: Vec::new(),
                alerts: Vec::new(),
                error: None,
                usage_over_reservation: false,
                client_disconnected: false,
            },
        ))
    }

    /// Names who answered ([`ServedBy`]) in the `backend` field.
    pub fn set_served_by(&mut self, by: ServedBy) {
        self.backend = by.label();
    }

    /// A request refused before the governor ran (identity, parsing): no call was made.
    pub fn refused_early(mut self, reason: ReasonClass, http_status: u16, msg: String) -> Self {
        self.reason_class = reason;
        self.final_action = FinalAction::HardStop;
        self.http_status = http_status;
        self.error = Some(msg);
        self
    }
}
