//! Every metric name in one place (OPERATIONS.md is the contract: extend, never rename),
//! described once at start with its unit. Labels are bounded: backend ids and model names
//! come from the policy, the rest from closed enums — never a request id, path or message.

use metrics::{describe_counter, describe_gauge, Unit};

/// counter {provider, model, direction}: committed actual tokens.
pub const AI_TOKENS_TOTAL: &str = "ai_tokens_total";
/// counter {provider, class}: failed upstream attempts.
pub const AI_REQUESTS_FAILED_TOTAL: &str = "ai_requests_failed_total";
/// counter {provider, outcome}: upstream attempts.
pub const AI_REQUESTS_TOTAL: &str = "ai_requests_total";
/// counter {provider}: committed cost in USD (a float counter, rendered by `Stats`).
pub const AI_COST_USD_TOTAL: &str = "ai_cost_usd_total";
/// histogram {provider}: upstream latency of one attempt.
pub const AI_REQUEST_DURATION_SECONDS: &str = "ai_request_duration_seconds";
/// histogram: time in the sidecar itself, upstream attempts and waits excluded.
pub const TOLLGATE_OVERHEAD_SECONDS: &str = "tollgate_overhead_seconds";
/// counter {action, reason}: one per governed request.
pub const TOLLGATE_DECISIONS_TOTAL: &str = "tollgate_decisions_total";
/// gauge {backend}: 0 closed, 1 half-open, 2 open.
pub const TOLLGATE_CIRCUIT_STATE: &str = "tollgate_circuit_state";
/// gauge {quota}: used / limit in the current window.
pub const TOLLGATE_QUOTA_USED_RATIO: &str = "tollgate_quota_used_ratio";
/// gauge {budget}: used / limit in the current window.
pub const TOLLGATE_BUDGET_USED_RATIO: &str = "tollgate_budget_used_ratio";
/// gauge: worst-case tokens reserved by calls in flight.
pub const TOLLGATE_RESERVED_TOKENS: &str = "tollgate_reserved_tokens";
/// counter {api}: governed requests by the client's dialect (openai, anthropic, gemini,
/// ollama, responses).
pub const TOLLGATE_REQUESTS_TOTAL: &str = "tollgate_requests_total";
/// counter {result}: policy reload attempts.
pub const TOLLGATE_POLICY_RELOADS_TOTAL: &str = "tollgate_policy_reloads_total";
/// gauge {version}: 1 for the version in force.
pub const TOLLGATE_POLICY_INFO: &str = "tollgate_policy_info";
/// counter {outcome}: alert crossings and their webhook deliveries (an extension).
pub const TOLLGATE_ALERTS_TOTAL: &str = "tollgate_alerts_total";
/// counter {port, reason}: connections closed by the sidecar before any request: `limit`
/// (past `server.max_connections`, answered 503), `idle` (no byte within
/// `server.header_read_timeout`), `slow_head` (a head begun and not whole within it) or
/// `malformed` (a head answered 400/431/414).
pub const TOLLGATE_CONNECTIONS_REFUSED_TOTAL: &str = "tollgate_connections_refused_total";
/// counter {backend}: calls whose committed usage was above their reserved worst case (a
/// provider billing past the cap it was sent, or an absurd usage report).
pub const TOLLGATE_USAGE_OVER_RESERVATION_TOTAL: &str = "tollgate_usage_over_reservation_total";
/// counter {upstream, fault}: wire faults of cleartext upstream connections: `unsolicited`
/// (bytes no request asked for: the upstream's pooled connections are distrusted for a
/// while) and `closed_idle` (a reused connection closed before any answer byte: the request
/// went again on a fresh connection).
pub const TOLLGATE_UPSTREAM_WIRE_FAULTS_TOTAL: &str = crate::wire::pool::WIRE_FAULTS_TOTAL;
/// counter {team, direction}: committed actual tokens by the caller's team (configured
/// keys' teams, `none`, `other`).
pub const TOLLGATE_TEAM_TOKENS_TOTAL: &str = "tollgate_team_tokens_total";
/// counter {team}: committed cost in USD by the caller's team.
pub const TOLLGATE_TEAM_COST_USD_TOTAL: &str = "tollgate_team_cost_usd_total";
/// counter {bound}: requests a shadow bound (`enforce: shadow`) would have refused; bound
/// names come from the policy.
pub const TOLLGATE_SHADOW_REFUSALS_TOTAL: &str = "tollgate_shadow_refusals_total";
/// gauge {bound}: seconds until a windowed bound's hard limit is reached at its burn rate,
/// set while that falls before the window turns (and 0 once the forecast clears).
pub const TOLLGATE_BOUND_PROJECTED_EXHAUSTION_SECONDS: &str =
    "tollgate_bound_projected_exhaustion_seconds";
/// counter {reason}: finished spans the OTLP export dropped (`queue_full`, `export_failed`).
pub const TOLLGATE_OTEL_DROPPED_SPANS_TOTAL: &str = "tollgate_otel_dropped_spans_total";

/// Upstream latency buckets, seconds: local models answer in ms, big ones in a minute.
pub const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Sidecar overhead buckets, seconds: tens of microseconds to a few milliseconds.
pub const OVERHEAD_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
];

/// Help texts of the metrics rendered by tollgate itself (split by thread: `shard`), not by
/// the recorder.
pub const TOLLGATE_REQUESTS_TOTAL_HELP: &str = "Governed requests by the client's dialect (api)";
pub const AI_TOKENS_TOTAL_HELP: &str =
    "Committed actual tokens by backend (provider), upstream model and direction";
pub const AI_REQUESTS_FAILED_TOTAL_HELP: &str =
    "Failed upstream attempts by backend and failure class (429, 5xx, timeout, connect, auth)";
pub const AI_REQUESTS_TOTAL_HELP: &str =
    "Upstream attempts by backend and outcome (success/failure)";
pub const AI_REQUEST_DURATION_SECONDS_HELP: &str = "Latency of one upstream attempt by backend";
pub const TOLLGATE_OVERHEAD_SECONDS_HELP: &str = "Time spent in the sidecar itself per request, upstream attempts and waits excluded (buffered answers only)";
pub const TOLLGATE_DECISIONS_TOTAL_HELP: &str =
    "Governed requests by final action and reason class";
pub const AI_COST_USD_TOTAL_HELP: &str = "Committed cost in US dollars by backend";
pub const TOLLGATE_TEAM_TOKENS_TOTAL_HELP: &str = "Committed actual tokens by the caller's team (a configured key's team, none, or other) and direction";
pub const TOLLGATE_TEAM_COST_USD_TOTAL_HELP: &str =
    "Committed cost in US dollars by the caller's team (a configured key's team, none, or other)";

/// Registers help text and units with the recorder in force (the metrics it renders).
pub fn describe() {
    describe_gauge!(
        TOLLGATE_CIRCUIT_STATE,
        "Circuit breaker state per backend: 0 closed, 1 half-open, 2 open"
    );
    describe_gauge!(
        TOLLGATE_QUOTA_USED_RATIO,
        Unit::Count,
        "Used / limit of a named quota in its current calendar window (fixed-id quotas)"
    );
    describe_gauge!(
        TOLLGATE_BUDGET_USED_RATIO,
        Unit::Count,
        "Used / limit of a global or fixed-id budget in its current window"
    );
    describe_gauge!(
        TOLLGATE_RESERVED_TOKENS,
        Unit::Count,
        "Worst-case tokens reserved by calls in flight"
    );
    describe_counter!(
        TOLLGATE_POLICY_RELOADS_TOTAL,
        Unit::Count,
        "Policy reload attempts by result (ok/error)"
    );
    describe_gauge!(
        TOLLGATE_POLICY_INFO,
        "1 for the policy version in force, 0 for versions replaced since start"
    );
    describe_counter!(
        TOLLGATE_SHADOW_REFUSALS_TOTAL,
        Unit::Count,
        "Requests a shadow bound (enforce: shadow) would have refused, by bound"
    );
    describe_gauge!(
        TOLLGATE_BOUND_PROJECTED_EXHAUSTION_SECONDS,
        Unit::Seconds,
        "Seconds until a windowed bound's hard limit is hit at its trailing burn rate, while that is before the window turns"
    );
    describe_counter!(
        TOLLGATE_ALERTS_TOTAL,
        Unit::Count,
        "Alert threshold crossings (logged) and webhook deliveries (delivered/failed/dropped)"
    );
    describe_counter!(
        TOLLGATE_CONNECTIONS_REFUSED_TOTAL,
        Unit::Count,
        "Connections closed before any request, by port (data/admin) and reason (limit/idle/slow_head/malformed)"
    );
    describe_counter!(
        TOLLGATE_USAGE_OVER_RESERVATION_TOTAL,
        Unit::Count,
        "Calls whose committed usage was above their reserved worst case, by backend"
    );
    describe_counter!(
        TOLLGATE_UPSTREAM_WIRE_FAULTS_TOTAL,
        Unit::Count,
        "Wire faults of cleartext upstream connections, by upstream and fault (unsolicited/closed_idle)"
    );
    describe_counter!(
        TOLLGATE_OTEL_DROPPED_SPANS_TOTAL,
        Unit::Count,
        "Finished spans the OpenTelemetry export dropped: queue full or export failed"
    );
}
