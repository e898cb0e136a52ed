//! The validated, typed policy snapshot. Everything the request path reads comes from here;
//! nothing in it is optional in a way that needs defaulting at request time.

use crate::units::{Micros, Scope, Window};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// One validated policy. Immutable once built; a reload builds a new one and swaps it in.
#[derive(Debug, Clone)]
pub struct Policy {
    /// `version`: stamped on every decision.
    pub version: Arc<str>,
    /// Where the policy came from (file or directory), for messages.
    pub source: String,
    pub server: ServerCfg,
    pub identity: IdentityCfg,
    pub estimate: EstimateCfg,
    pub windows: WindowsCfg,
    /// In policy order; `ChainEntry::backend` indexes into this.
    pub backends: Vec<Backend>,
    pub routes: Vec<Route>,
    /// `rate_limits`, `quotas` and `budgets`, in that order, as one list of bounds.
    pub bounds: Vec<Bound>,
    pub retry: RetryCfg,
    pub fallback: FallbackCfg,
    pub degrade: DegradeCfg,
    pub defer: DeferCfg,
    pub state: StateCfg,
    pub audit: AuditCfg,
    /// `alerts`: where threshold crossings are delivered besides the log.
    pub alerts: AlertsCfg,
    /// `telemetry`: OpenTelemetry export (read at start; the `OTEL_*` variables win).
    pub telemetry: TelemetryCfg,
    /// route alias -> index into `routes`.
    pub route_index: HashMap<String, usize, foldhash::quality::RandomState>,
}

impl Policy {
    pub fn route(&self, alias: &str) -> Option<&Route> {
        self.route_index.get(alias).map(|&i| &self.routes[i])
    }

    pub fn backend(&self, id: &str) -> Option<&Backend> {
        self.backends.iter().find(|b| &*b.id == id)
    }
}

#[derive(Debug, Clone)]
pub struct ServerCfg {
    pub listen: String,
    pub admin_listen: String,
    pub max_body_bytes: u64,
    /// How long a connection may sit idle / take to send its headers.
    pub header_read_timeout: Duration,
    /// Graceful shutdown deadline for in-flight requests.
    pub shutdown_grace: Duration,
    /// Open connections per port; past it new ones get a 503 and are closed.
    pub max_connections: u32,
}

#[derive(Debug, Clone)]
pub struct IdentityCfg {
    /// Trusted only while `virtual_keys` is empty (SPEC §4).
    pub consumer_header: String,
    pub job_header: String,
    pub default_consumer: Arc<str>,
    /// A request without a key is refused (401). Defaults to true once keys are configured.
    pub require_key: bool,
    pub virtual_keys: Vec<VirtualKey>,
}

/// A virtual key: who presents it (consumer and team) and how the key is known.
#[derive(Debug, Clone)]
pub struct VirtualKey {
    pub consumer: Arc<str>,
    pub team: Option<Arc<str>>,
    pub secret: KeySource,
}

/// Where a virtual key's secret comes from: exactly one per key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// The key itself, read from this environment variable when the policy loads.
    Env(String),
    /// The SHA-256 digest of the key (so no secret is in the file).
    Sha256([u8; 32]),
}

impl Default for KeySource {
    /// Stands in for an invalid key while the rest of the policy is checked.
    fn default() -> Self {
        KeySource::Env(String::new())
    }
}

/// The estimator's tokenizer (`estimate.tokenizer`), defined where it is used.
pub use crate::estimate::Tokenizer;

#[derive(Debug, Clone)]
pub struct EstimateCfg {
    pub tokenizer: Tokenizer,
    pub default_max_output_tokens: u32,
}

#[derive(Debug, Clone)]
pub struct WindowsCfg {
    pub timezone_name: String,
    pub timezone: jiff::tz::TimeZone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Openai,
    Anthropic,
    Gemini,
    Ollama,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Openai => "openai",
            BackendKind::Anthropic => "anthropic",
            BackendKind::Gemini => "gemini",
            BackendKind::Ollama => "ollama",
        }
    }
}

/// Price in micro-dollars per 1000 tokens. Cached input and cache writes are billed at
/// their own rates (they default to the input price, so a policy without them costs the same).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Price {
    pub input_per_1k: Micros,
    pub output_per_1k: Micros,
    /// Input tokens read from the provider's prompt cache.
    pub cached_input_per_1k: Micros,
    /// Input tokens written to the provider's prompt cache.
    pub cache_write_per_1k: Micros,
    /// Long-context tiers, ascending by threshold: a call with more input tokens than a tier's
    /// threshold pays that tier's rates on the whole call, as Gemini and Claude bill. Inline
    /// (no allocation) so a price stays `Copy` on the request path.
    pub tiers: [Option<PriceTier>; MAX_PRICE_TIERS],
}

/// Most long-context tiers one price may carry.
pub const MAX_PRICE_TIERS: usize = 4;

/// The rates of calls whose input is above `above_input_tokens`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PriceTier {
    pub above_input_tokens: u64,
    pub input_per_1k: Micros,
    pub output_per_1k: Micros,
    pub cached_input_per_1k: Micros,
    pub cache_write_per_1k: Micros,
}

/// Billed tokens of one call: `input` counts every input token, `cached` and `cache_write`
/// are the parts of it the provider read from or wrote to its cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Billed {
    pub input: u64,
    pub cached: u64,
    pub cache_write: u64,
    pub output: u64,
}

impl Price {
    /// The flat rates a call with `input_tokens` of input pays: its tier's, else the base's.
    pub fn for_input(&self, input_tokens: u64) -> Price {
        let tier = self
            .tiers
            .iter()
            .flatten()
            .rfind(|t| input_tokens > t.above_input_tokens);
        match tier {
            Some(t) => Price {
                input_per_1k: t.input_per_1k,
                output_per_1k: t.output_per_1k,
                cached_input_per_1k: t.cached_input_per_1k,
                cache_write_per_1k: t.cache_write_per_1k,
                tiers: [None; MAX_PRICE_TIERS],
            },
            None => Price {
                tiers: [None; MAX_PRICE_TIERS],
                ..*self
            },
        }
    }

    /// Worst-case cost of a call in whole micro-dollars, rounded up (never under-reserve):
    /// input at the dearest input rate, since the cache split is known only afterwards.
    pub fn cost(&self, input_tokens: u64, output_tokens: u64) -> Micros {
        let p = self.for_input(input_tokens);
        let num = (input_tokens as u128) * (p.worst_input_per_1k() as u128)
            + (output_tokens as u128) * (p.output_per_1k as u128);
        num.div_ceil(1000).min(u64::MAX as u128) as u64
    }

    /// The dearest of the input rates (plain, cached, cache write).
    pub fn worst_input_per_1k(&self) -> Micros {
        self.input_per_1k
            .max(self.cached_input_per_1k)
            .max(self.cache_write_per_1k)
    }

    /// Actual cost of a call with its cache split, rounded up. Cached and written tokens are
    /// taken out of `input` (never more than it); the rest is plain input.
    pub fn cost_billed(&self, b: Billed) -> Micros {
        let p = self.for_input(b.input);
        let cached = b.cached.min(b.input);
        let write = b.cache_write.min(b.input - cached);
        let plain = b.input - cached - write;
        let num = (plain as u128) * (p.input_per_1k as u128)
            + (cached as u128) * (p.cached_input_per_1k as u128)
            + (write as u128) * (p.cache_write_per_1k as u128)
            + (b.output as u128) * (p.output_per_1k as u128);
        num.div_ceil(1000).min(u64::MAX as u128) as u64
    }
}

#[derive(Debug, Clone)]
pub struct Timeouts {
    pub connect: Duration,
    pub first_byte: Duration,
    pub total: Duration,
}

#[derive(Debug, Clone)]
pub struct CircuitCfg {
    pub failure_threshold: u32,
    pub recovery_timeout: Duration,
    pub half_open_max_calls: u32,
    pub accept_retry_after: bool,
    /// The longest any opening may hold, whatever the upstream asks (a Retry-After of years).
    pub max_open: Duration,
}

#[derive(Debug, Clone)]
pub struct Backend {
    pub id: Arc<str>,
    pub kind: BackendKind,
    /// Without a trailing slash. Shared: each traced attempt holds it.
    pub base_url: Arc<str>,
    pub api_key_env: Option<String>,
    pub token_ratio: f64,
    pub price: Price,
    pub timeouts: Timeouts,
    pub circuit: CircuitCfg,
    /// Concurrent calls allowed to this backend; `None` is unlimited.
    pub max_in_flight: Option<u32>,
    /// `kind: openai` only: the backend also serves OpenAI's Responses API
    /// (`{base_url}/responses`), so a Responses client's body passes through to it.
    pub responses_api: bool,
}

impl Backend {
    /// Worst-case tokens of a call on this backend: `ceil(input × token_ratio) + output`.
    pub fn worst_tokens(&self, input_tokens: u64, max_output_tokens: u64) -> u64 {
        self.scaled_input(input_tokens) + max_output_tokens
    }

    pub fn scaled_input(&self, input_tokens: u64) -> u64 {
        if self.token_ratio == 1.0 {
            input_tokens
        } else {
            (input_tokens as f64 * self.token_ratio).ceil() as u64
        }
    }

    /// Worst-case cost of a call on this backend, in micro-dollars.
    pub fn worst_cost(&self, input_tokens: u64, max_output_tokens: u64) -> Micros {
        self.price
            .cost(self.scaled_input(input_tokens), max_output_tokens)
    }
}

#[derive(Debug, Clone)]
pub struct ChainEntry {
    /// Index into `Policy::backends`.
    pub backend: usize,
    /// The upstream model name sent to that backend.
    pub model: Arc<str>,
    /// The entry's own `price_per_1k`, overriding its backend's.
    pub price: Option<Price>,
    /// `kind: openai` only: the body field that carries the output cap; `None` picks it by
    /// model name (`providers::openai`).
    pub output_cap_field: Option<OutputCapField>,
}

impl ChainEntry {
    /// The price of a call through this entry: its own, else its backend's.
    pub fn price_on(&self, backend: &Backend) -> Price {
        self.price.unwrap_or(backend.price)
    }
}

/// Which field of an OpenAI chat body carries the output cap. o-series and gpt-5 models
/// reject the legacy `max_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputCapField {
    MaxTokens,
    MaxCompletionTokens,
}

impl OutputCapField {
    pub fn as_str(self) -> &'static str {
        match self {
            OutputCapField::MaxTokens => "max_tokens",
            OutputCapField::MaxCompletionTokens => "max_completion_tokens",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Route {
    pub model: Arc<str>,
    pub chain: Vec<ChainEntry>,
    pub static_response: Option<Arc<str>>,
    /// A spend bound (consumer, team, job, global budget) that stops the request is answered
    /// with the static response too, instead of its refusal (SPEC §10; default false).
    pub static_on_budget: bool,
    /// The output cap per choice when the client sends none (overrides
    /// `estimate.default_max_output_tokens` for this route).
    pub default_max_output_tokens: Option<u32>,
}

impl Route {
    /// The output cap per choice injected when the client sets none.
    pub fn default_output_cap(&self, estimate: &EstimateCfg) -> u32 {
        self.default_max_output_tokens
            .unwrap_or(estimate.default_max_output_tokens)
    }
}

/// What kind of bound: decides the HTTP answer and the reason class when it refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundClass {
    /// `rate_limits`: short windows, 429 + Retry-After.
    RateLimit,
    /// `quotas`: calendar windows, 403.
    Quota,
    /// `budgets`: hard bounds on the worst case, soft bounds on the actual.
    Budget,
}

impl BoundClass {
    pub fn as_str(self) -> &'static str {
        match self {
            BoundClass::RateLimit => "rate_limit",
            BoundClass::Quota => "quota",
            BoundClass::Budget => "budget",
        }
    }
}

/// Which ids a bound applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Match {
    /// `"*"`: a separate counter per id.
    Any,
    /// Only this id.
    Id(Arc<str>),
    /// A pattern with `*` wildcards (`team-*`): a separate counter per matching id.
    Glob(Arc<str>),
}

impl Match {
    /// Whether every id matches (`*`, or no `match`).
    pub fn is_any(&self) -> bool {
        matches!(self, Match::Any)
    }

    pub fn matches(&self, id: &str) -> bool {
        match self {
            Match::Any => true,
            Match::Id(m) => &**m == id,
            Match::Glob(p) => glob_matches(p.as_bytes(), id.as_bytes()),
        }
    }

    /// The pattern as written in the policy.
    pub fn as_str(&self) -> &str {
        match self {
            Match::Any => "*",
            Match::Id(s) | Match::Glob(s) => s,
        }
    }
}

/// Whether `id` matches `pat`, where `*` stands for any run of bytes (possibly empty) and
/// every other byte for itself. Linear backtracking over the last star: no allocation.
pub fn glob_matches(pat: &[u8], id: &[u8]) -> bool {
    let (mut p, mut i) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while i < id.len() {
        if p < pat.len() && pat[p] == b'*' {
            star = Some((p, i));
            p += 1;
        } else if p < pat.len() && pat[p] == id[i] {
            p += 1;
            i += 1;
        } else if let Some((sp, si)) = star {
            p = sp + 1;
            i = si + 1;
            star = Some((sp, si + 1));
        } else {
            return false;
        }
    }
    pat[p..].iter().all(|&b| b == b'*')
}

/// Limits in the three dimensions; `None` = not limited in that dimension.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub tokens: Option<u64>,
    pub requests: Option<u64>,
    pub usd: Option<Micros>,
}

impl Limits {
    pub fn as_array(&self) -> [Option<u64>; 3] {
        [self.tokens, self.requests, self.usd]
    }
    /// The limit in dimension `d`.
    pub fn get(&self, d: crate::units::Dim) -> Option<u64> {
        match d {
            crate::units::Dim::Tokens => self.tokens,
            crate::units::Dim::Requests => self.requests,
            crate::units::Dim::Usd => self.usd,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_none() && self.requests.is_none() && self.usd.is_none()
    }
}

/// A rate limit, quota or budget.
#[derive(Debug, Clone)]
pub struct Bound {
    pub name: Arc<str>,
    pub class: BoundClass,
    pub scope: Scope,
    pub matcher: Match,
    /// `None` for request- and job-scoped bounds (they live as long as the job).
    pub window: Option<Window>,
    /// Hard limits: a reservation whose worst case would cross one is refused.
    pub hard: Limits,
    /// Soft limits (budgets only): crossing one by actual usage changes behaviour.
    pub soft: Limits,
    /// Fractions of the hard limit at which an alert fires once per window.
    pub alert_at: Vec<f64>,
    /// `enforce`: whether the hard limits refuse (`hard`) or are only reported (`shadow`).
    pub enforce: Enforce,
}

impl Bound {
    /// A shadow bound is counted like any other but never refuses, lowers an output cap or
    /// shows in the rate-limit headers: it only reports what it would have done.
    pub fn is_shadow(&self) -> bool {
        self.enforce == Enforce::Shadow
    }
}

/// `enforce` on a rate limit, quota or budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Enforce {
    /// The default: the hard limits refuse.
    #[default]
    Hard,
    /// Counted, never refuses; a request it would have refused is marked (SPEC §9).
    Shadow,
}

impl Enforce {
    pub const ALL: [Enforce; 2] = [Enforce::Hard, Enforce::Shadow];
    pub fn as_str(self) -> &'static str {
        match self {
            Enforce::Hard => "hard",
            Enforce::Shadow => "shadow",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryOn {
    Status(u16),
    Timeout,
    ConnectError,
}

#[derive(Debug, Clone)]
pub struct RetryCfg {
    pub max_attempts_per_job: u32,
    pub same_backend_retries: u32,
    pub retry_on: Vec<RetryOn>,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub max_retry_after: Duration,
}

#[derive(Debug, Clone)]
pub struct FallbackCfg {
    pub max_fallbacks_per_job: u32,
    pub max_amplification: f64,
}

#[derive(Debug, Clone, Default)]
pub struct DegradeCfg {
    /// `clamp_max_tokens.min_output_tokens`: clamp instead of stopping, not below this.
    pub clamp_min_output_tokens: Option<u32>,
    /// `on_soft_exceeded.max_output_tokens`: the cap applied past a soft bound.
    pub soft_max_output_tokens: Option<u32>,
}

#[derive(Debug, Clone)]
pub struct DeferCfg {
    pub allowed: bool,
    pub max_retry_after: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateBackend {
    Memory,
    Sqlite,
    Redis,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StateCfg {
    pub backend: StateBackend,
    pub path: String,
    pub redis_url: Option<String>,
    /// Redis Cluster: more seed nodes besides `redis_url` (empty: none).
    pub redis_urls: Vec<String>,
    /// Redis: how many shards (hash tags, so cluster slots) a namespace's counters are
    /// spread over; 1 keeps them all under `{tollgate:<namespace>}`.
    pub shards: u32,
    /// How long a job ledger lives after its last use.
    pub job_idle_ttl: Duration,
    /// What a request meets when the shared store (Redis) does not answer.
    pub on_unavailable: OnUnavailable,
    /// SQLite: how often the write-behind task persists changed state (the kill -9 loss bound).
    pub flush_interval: Duration,
    /// Redis: how long a reservation is held without being settled (a dead replica's holds
    /// vanish after it). Must outlast the longest call.
    pub lease: Duration,
    /// Redis: the key namespace (`{tollgate:<namespace>}`); replicas sharing budgets share it.
    pub namespace: String,
    /// Redis: lease slices of the bounds and admit from them locally (docs/scale-out-slices.md).
    pub slices: bool,
}

/// `state.on_unavailable`: fail closed (refuse with 503) or fall back to the replica's own
/// in-memory ledger while the shared store is down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnUnavailable {
    Deny,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuditSink {
    Jsonl,
    Sqlite,
    Postgres,
    Off,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AuditCfg {
    pub sink: AuditSink,
    pub path: String,
    pub postgres_url: Option<String>,
    /// Bounded queue between request path and writer.
    pub queue: usize,
    /// Usage-log table of the sqlite/postgres sinks: a plain SQL identifier (validated),
    /// since it is spliced into DDL. Tests give each run its own.
    pub table: String,
    /// JSONL: rotate the file before a record would take it past this size; 0 = never.
    pub max_bytes: u64,
    /// JSONL: rotated files kept (the oldest beyond this are deleted).
    pub keep: u32,
    /// JSONL: gzip rotated files.
    pub compress: bool,
    /// sqlite/postgres: usage rows older than this many days are deleted; `None` = kept.
    pub retention_days: Option<u32>,
}

/// `alerts`: threshold crossings (`alert_at`) always go to the log (target `tollgate::alert`);
/// with a `webhook_url` they are also POSTed as JSON by a background task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlertsCfg {
    /// An http:// or https:// URL; `None` = log only.
    pub webhook_url: Option<String>,
    /// Per delivery attempt.
    pub timeout: Duration,
    /// Alerts waiting for delivery; past this they are dropped (and counted).
    pub queue: usize,
    /// Delivery attempts per alert (the first plus retries with exponential backoff).
    pub max_attempts: u32,
}

#[cfg(test)]
mod glob_tests {
    use super::glob_matches;

    #[test]
    fn stars_match_any_run_and_everything_else_is_literal() {
        let m = |p: &str, s: &str| glob_matches(p.as_bytes(), s.as_bytes());
        assert!(m("*", ""));
        assert!(m("team-*", "team-a"));
        assert!(m("*-prod", "svc-prod"));
        assert!(m("svc-*-prod", "svc-a-b-prod"));
        assert!(m("a*b*c", "aXbYbZc"));
        assert!(m("**", "x"));
        assert!(!m("team-*", "team"));
        assert!(!m("svc-*-prod", "svc-prod"));
        assert!(!m("a*b*c", "aXbYbZ"));
        assert!(m("gpt-4.1", "gpt-4.1"));
        assert!(!m("gpt-4.1", "gpt-4x1"), "a dot is a dot");
    }
}

/// `telemetry`: optional OpenTelemetry export settings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TelemetryCfg {
    pub otlp: OtlpCfg,
}

/// `telemetry.otlp`: defaults under the standard `OTEL_*` variables, which override each key.
/// No endpoint (here or in `OTEL_EXPORTER_OTLP_ENDPOINT`): export is off.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OtlpCfg {
    /// Base URL (`http://collector:4318`); `/v1/traces` and `/v1/metrics` are appended.
    pub endpoint: Option<String>,
    /// `http/protobuf` (the only one built in).
    pub protocol: Option<String>,
    /// `service.name` (default `tollgate`).
    pub service_name: Option<String>,
    /// Parent-based trace-id ratio sampling, 0..=1 (default: every trace).
    pub sample_ratio: Option<f64>,
    /// Finished spans waiting for export; past this they are dropped and counted.
    pub queue: Option<usize>,
}
