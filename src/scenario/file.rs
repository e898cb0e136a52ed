//! The scenario file format (SCENARIOS.md) as serde structs.

use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioFile {
    pub name: String,
    pub now: String,
    /// An inline policy mapping, or a path relative to the scenario file.
    pub policy: serde_norway::Value,
    #[serde(default)]
    pub state: StateSeed,
    pub request: RequestSpec,
    #[serde(default)]
    pub upstream: BTreeMap<String, Vec<Answer>>,
    #[serde(default)]
    pub expect: Expect,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateSeed {
    #[serde(default)]
    pub usage: Vec<UsageSeed>,
    /// Worst cases held by other calls in flight while this request runs.
    #[serde(default)]
    pub reserved: Vec<UsageSeed>,
    #[serde(default)]
    pub jobs: Vec<JobSeed>,
    #[serde(default)]
    pub circuits: Vec<CircuitSeed>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageSeed {
    pub scope: crate::units::Scope,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub window: Option<crate::units::Window>,
    /// Seeds the window that contains this instant (RFC 3339) instead of the one at `now`.
    #[serde(default)]
    pub at: Option<String>,
    #[serde(default)]
    pub tokens: u64,
    #[serde(default)]
    pub requests: u64,
    #[serde(default)]
    pub usd: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSeed {
    pub id: String,
    /// Whose job it is (job ledgers belong to a consumer); the request's consumer if absent.
    #[serde(default)]
    pub consumer: Option<String>,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default)]
    pub fallbacks: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitSeed {
    pub backend: String,
    pub state: String,
    #[serde(default)]
    pub opened_at: Option<String>,
    #[serde(default)]
    pub probes_in_flight: u32,
    #[serde(default)]
    pub consecutive_failures: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestSpec {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub consumer: Option<String>,
    /// The team the caller's virtual key names (team-scoped bounds apply only with one).
    #[serde(default)]
    pub team: Option<String>,
    #[serde(default)]
    pub job: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub input_tokens: Option<u64>,
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    #[serde(default)]
    pub n: Option<u32>,
    /// An OpenAI chat body instead of the lines above: the tokenizer estimates it.
    #[serde(default)]
    pub body: Option<serde_json::Value>,
    #[serde(default)]
    pub stream: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Answer {
    #[serde(default)]
    pub status: Option<u16>,
    /// Seconds (may be fractional).
    #[serde(default)]
    pub retry_after: Option<f64>,
    #[serde(default)]
    pub usage: Option<AnswerUsage>,
    /// Response text, counted by the tokenizer when no usage is reported.
    #[serde(default)]
    pub text: Option<String>,
    /// `timeout` or `connect`.
    #[serde(default)]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnswerUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Of the input, read from the provider's prompt cache.
    #[serde(default)]
    pub cached_input_tokens: u64,
    /// Of the input, written to the provider's prompt cache.
    #[serde(default)]
    pub cache_write_tokens: u64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    pub budget_state: Option<String>,
    pub quota_state: Option<String>,
    pub circuit_state: Option<String>,
    pub retry_state: Option<String>,
    pub usage_evidence_state: Option<String>,
    pub fallback_state: Option<String>,
    pub final_action: Option<String>,
    pub reason_class: Option<String>,
    pub http_status: Option<u16>,
    pub retry_after: Option<u64>,
    pub calls: Option<Vec<String>>,
    pub upstream_max_tokens: Option<u64>,
    pub circuit_after: Option<BTreeMap<String, String>>,
    /// Extras: the backend that served (`static`, `none` or an id).
    pub backend: Option<String>,
    /// Extras: committed usage on counters after the request.
    pub committed: Option<Vec<UsageSeed>>,
    /// Extras: worst-case tokens still reserved after the request (seeded reservations included).
    pub reserved_tokens: Option<u64>,
    /// Extras: how long the request waited in total (backoff, Retry-After), ms.
    pub waited_ms: Option<i64>,
    /// Extras: the shadow bounds (`enforce: shadow`) that would have refused the request, by
    /// name in the order noted; `[]` asserts none did.
    pub shadow: Option<Vec<String>>,
}
