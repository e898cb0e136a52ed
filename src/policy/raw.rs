//! The policy file exactly as written: serde structs that mirror every key of SPEC §4.
//!
//! Everything here is optional (a scenario's inline policy omits anything with a default) and
//! every struct denies unknown fields, so a typo is an error with a line number instead of a
//! silently ignored setting. Nothing here is trusted: `validate` checks ranges, references and
//! names and fills in the defaults below. Only the two things serde must decide while reading
//! are parsed here: durations (`250ms`, `1h30m`) and `retry_on` entries.

use super::types::RetryOn;
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use std::fmt;
use std::time::Duration;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8787";
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9464";
pub const DEFAULT_MAX_BODY_BYTES: u64 = 4_194_304;
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
pub const DEFAULT_CONSUMER_HEADER: &str = "x-tollgate-consumer";
pub const DEFAULT_JOB_HEADER: &str = "x-tollgate-job";
pub const DEFAULT_CONSUMER: &str = "default";
pub const DEFAULT_TOKENIZER: &str = "o200k";
pub const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 1024;
pub const DEFAULT_TIMEZONE: &str = "UTC";
pub const DEFAULT_TOKEN_RATIO: f64 = 1.0;
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_TOTAL_TIMEOUT: Duration = Duration::from_secs(120);
pub const DEFAULT_FAILURE_THRESHOLD: u32 = 5;
pub const DEFAULT_RECOVERY_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_HALF_OPEN_MAX_CALLS: u32 = 1;
pub const DEFAULT_ACCEPT_RETRY_AFTER: bool = true;
pub const DEFAULT_MAX_OPEN: Duration = Duration::from_secs(24 * 3600);
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10_000;
pub const DEFAULT_MAX_ATTEMPTS_PER_JOB: u32 = 3;
pub const DEFAULT_SAME_BACKEND_RETRIES: u32 = 1;
pub const DEFAULT_RETRY_ON: [RetryOn; 7] = [
    RetryOn::Status(429),
    RetryOn::Status(500),
    RetryOn::Status(502),
    RetryOn::Status(503),
    RetryOn::Status(504),
    RetryOn::Timeout,
    RetryOn::ConnectError,
];
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(200);
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(2);
pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(10);
pub const DEFAULT_MAX_FALLBACKS_PER_JOB: u32 = 2;
pub const DEFAULT_MAX_AMPLIFICATION: f64 = 3.0;
pub const DEFAULT_DEFER_ALLOWED: bool = true;
pub const DEFAULT_DEFER_MAX_RETRY_AFTER: Duration = Duration::from_secs(300);
pub const DEFAULT_STATE_BACKEND: &str = "sqlite";
pub const DEFAULT_STATE_PATH: &str = "tollgate.db";
pub const DEFAULT_JOB_IDLE_TTL: Duration = Duration::from_secs(3600);
pub const DEFAULT_STATE_ON_UNAVAILABLE: &str = "deny";
pub const DEFAULT_STATE_FLUSH_INTERVAL: Duration = Duration::from_millis(50);
pub const DEFAULT_STATE_LEASE: Duration = Duration::from_secs(150);
pub const DEFAULT_STATE_NAMESPACE: &str = "default";
pub const DEFAULT_AUDIT_SINK: &str = "jsonl";
pub const DEFAULT_AUDIT_PATH: &str = "tollgate-audit.jsonl";
pub const DEFAULT_AUDIT_QUEUE: usize = 8192;
/// 100 MiB: at ~1.4 KB a record, ~75,000 requests a file.
pub const DEFAULT_AUDIT_MAX_BYTES: u64 = 100 * 1024 * 1024;
pub const DEFAULT_AUDIT_KEEP: u32 = 5;
/// Most rotated audit files kept (a typo such as `keep: 50000` would mean a full disk).
pub const MAX_AUDIT_KEEP: u32 = 1000;
/// Longest usage-log retention a policy may set (~100 years; beyond it the cut-off date
/// would precede every timestamp anyway).
pub const MAX_RETENTION_DAYS: u32 = 36_500;
pub const DEFAULT_ALERT_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_ALERT_QUEUE: usize = 256;
pub const DEFAULT_ALERT_ATTEMPTS: u32 = 5;
/// The usage-log table of the sqlite and postgres sinks (the ADR's name).
pub const DEFAULT_AUDIT_TABLE: &str = "ai_usage_logs";
/// `match` when absent: a separate counter per id.
pub const MATCH_ANY: &str = "*";

/// One policy file (or a scenario's inline policy) as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    pub version: Option<Text>,
    pub server: Option<RawServer>,
    pub identity: Option<RawIdentity>,
    pub estimate: Option<RawEstimate>,
    pub windows: Option<RawWindows>,
    pub backends: Option<Vec<RawBackend>>,
    pub routes: Option<Vec<RawRoute>>,
    pub rate_limits: Option<Vec<RawLimit>>,
    pub quotas: Option<Vec<RawLimit>>,
    pub budgets: Option<Vec<RawBudget>>,
    pub retry: Option<RawRetry>,
    pub fallback: Option<RawFallback>,
    pub degrade: Option<RawDegrade>,
    pub defer: Option<RawDefer>,
    pub state: Option<RawState>,
    pub audit: Option<RawAudit>,
    pub alerts: Option<RawAlerts>,
    pub telemetry: Option<RawTelemetry>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    pub max_body_bytes: Option<u64>,
    pub header_read_timeout: Option<RawDuration>,
    pub shutdown_grace: Option<RawDuration>,
    pub max_connections: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawIdentity {
    pub consumer_header: Option<String>,
    pub job_header: Option<String>,
    pub default_consumer: Option<Text>,
    pub require_key: Option<bool>,
    pub virtual_keys: Option<Vec<RawVirtualKey>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawVirtualKey {
    pub consumer: Option<Text>,
    pub team: Option<Text>,
    pub key_env: Option<String>,
    pub key_sha256: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEstimate {
    pub tokenizer: Option<String>,
    pub default_max_output_tokens: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWindows {
    pub timezone: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBackend {
    pub id: Option<Text>,
    pub kind: Option<String>,
    pub base_url: Option<String>,
    pub api_key_env: Option<String>,
    pub token_ratio: Option<f64>,
    pub price_per_1k: Option<RawPrice>,
    pub timeouts: Option<RawTimeouts>,
    pub circuit: Option<RawCircuit>,
    pub max_in_flight: Option<u32>,
    pub responses_api: Option<bool>,
}

/// USD per 1000 tokens; a missing side costs nothing; missing cache rates cost the input rate.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrice {
    pub input: Option<f64>,
    pub output: Option<f64>,
    pub cached_input: Option<f64>,
    pub cache_write: Option<f64>,
    pub tiers: Option<Vec<RawPriceTier>>,
}

/// A long-context tier: above this many input tokens, these rates on the whole call.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPriceTier {
    pub above_input_tokens: Option<u64>,
    pub input: Option<f64>,
    pub output: Option<f64>,
    pub cached_input: Option<f64>,
    pub cache_write: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTimeouts {
    pub connect: Option<RawDuration>,
    pub first_byte: Option<RawDuration>,
    pub total: Option<RawDuration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCircuit {
    pub failure_threshold: Option<u32>,
    pub recovery_timeout: Option<RawDuration>,
    pub half_open_max_calls: Option<u32>,
    pub accept_retry_after: Option<bool>,
    pub max_open: Option<RawDuration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub model: Option<Text>,
    pub chain: Option<Vec<RawChainEntry>>,
    pub static_response: Option<String>,
    pub static_on_budget: Option<bool>,
    pub default_max_output_tokens: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawChainEntry {
    pub backend: Option<Text>,
    pub model: Option<Text>,
    pub price_per_1k: Option<RawPrice>,
    pub output_cap_field: Option<String>,
}

/// An entry of `rate_limits` or `quotas`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    pub name: Option<Text>,
    pub scope: Option<String>,
    #[serde(rename = "match")]
    pub matcher: Option<Text>,
    pub window: Option<String>,
    pub limit_tokens: Option<u64>,
    pub limit_requests: Option<u64>,
    pub limit_usd: Option<f64>,
    pub alert_at: Option<Vec<f64>>,
    pub enforce: Option<String>,
}

/// An entry of `budgets`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    pub name: Option<Text>,
    pub scope: Option<String>,
    #[serde(rename = "match")]
    pub matcher: Option<Text>,
    pub window: Option<String>,
    pub hard_tokens: Option<u64>,
    pub soft_tokens: Option<u64>,
    pub hard_requests: Option<u64>,
    pub soft_requests: Option<u64>,
    pub hard_usd: Option<f64>,
    pub soft_usd: Option<f64>,
    pub alert_at: Option<Vec<f64>>,
    pub enforce: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRetry {
    pub max_attempts_per_job: Option<u32>,
    pub same_backend_retries: Option<u32>,
    pub retry_on: Option<Vec<RawRetryOn>>,
    pub backoff: Option<RawBackoff>,
    pub max_retry_after: Option<RawDuration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBackoff {
    pub initial: Option<RawDuration>,
    pub max: Option<RawDuration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFallback {
    pub max_fallbacks_per_job: Option<u32>,
    pub max_amplification: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDegrade {
    pub clamp_max_tokens: Option<RawClamp>,
    pub on_soft_exceeded: Option<RawOnSoft>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClamp {
    pub min_output_tokens: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOnSoft {
    pub max_output_tokens: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDefer {
    pub allowed: Option<bool>,
    pub max_retry_after: Option<RawDuration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawState {
    pub backend: Option<String>,
    pub path: Option<String>,
    pub redis_url: Option<String>,
    pub redis_urls: Option<Vec<String>>,
    pub shards: Option<u32>,
    pub job_idle_ttl: Option<RawDuration>,
    pub on_unavailable: Option<String>,
    pub flush_interval: Option<RawDuration>,
    pub lease: Option<RawDuration>,
    pub namespace: Option<String>,
    pub slices: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAudit {
    pub sink: Option<String>,
    pub path: Option<String>,
    pub postgres_url: Option<String>,
    pub queue: Option<usize>,
    pub table: Option<String>,
    pub max_bytes: Option<u64>,
    pub keep: Option<u32>,
    pub compress: Option<bool>,
    pub retention_days: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAlerts {
    pub webhook_url: Option<String>,
    pub timeout: Option<RawDuration>,
    pub queue: Option<usize>,
    pub max_attempts: Option<u32>,
}

/// `telemetry`: only `otlp` so far (the `OTEL_*` variables override it).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTelemetry {
    pub otlp: Option<RawOtlp>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOtlp {
    pub endpoint: Option<String>,
    pub protocol: Option<String>,
    pub service_name: Option<String>,
    pub sample_ratio: Option<f64>,
    pub queue: Option<usize>,
}

/// A scalar read as text: YAML turns `version: 2026.1` or `match: 42` into numbers, but
/// they are names, so numbers are accepted and stringified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text(pub String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_owned()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration written as a string (`250ms`, `30s`, `5m`, `24h`, `1h30m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawDuration(pub Duration);

impl<'de> Deserialize<'de> for RawDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawDuration;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a duration string such as `250ms`, `30s`, `5m` or `1h30m`")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawDuration, E> {
                parse_duration(v).map(RawDuration).map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

/// Parses `250ms`, `30s`, `5m`, `24h`, `1h30m`, `1.5s`: one or more `<number><unit>` parts
/// with units `ms`, `s`, `m`, `h`, `d`. A bare number is refused: `30` could mean anything.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = |why: &str| {
        format!("invalid duration `{s}`: {why} (use e.g. `250ms`, `30s`, `5m`, `24h`, `1h30m`)")
    };
    let text = s.trim();
    if text.is_empty() {
        return Err(bad("empty"));
    }
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut total: u128 = 0;
    while i < bytes.len() {
        let num_start = i;
        while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let num = &text[num_start..i];
        let unit_start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let unit = &text[unit_start..i];
        if num.is_empty() {
            return Err(bad("expected a number"));
        }
        let unit_nanos: u128 = match unit {
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            "" => return Err(bad("missing unit")),
            _ => return Err(bad(&format!("unknown unit `{unit}`"))),
        };
        let (int, frac) = num.split_once('.').unwrap_or((num, ""));
        if int.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 9 {
            return Err(bad(&format!("bad number `{num}`")));
        }
        let int_v: u128 = if int.is_empty() {
            0
        } else {
            int.parse()
                .map_err(|_| bad(&format!("bad number `{num}`")))?
        };
        let mut part = int_v.saturating_mul(unit_nanos);
        if !frac.is_empty() {
            let digits: u128 = frac
                .parse()
                .map_err(|_| bad(&format!("bad number `{num}`")))?;
            part += digits * unit_nanos / 10u128.pow(frac.len() as u32);
        }
        total = total.saturating_add(part);
    }
    let secs = u64::try_from(total / 1_000_000_000).map_err(|_| bad("too long"))?;
    Ok(Duration::new(secs, (total % 1_000_000_000) as u32))
}

/// A `retry_on` entry: an HTTP error status, `timeout` or `connect_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawRetryOn(pub RetryOn);

impl<'de> Deserialize<'de> for RawRetryOn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawRetryOn;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an HTTP status (400-599), `timeout` or `connect_error`")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawRetryOn, E> {
                match u16::try_from(v) {
                    Ok(s) if (400..=599).contains(&s) => Ok(RawRetryOn(RetryOn::Status(s))),
                    _ => Err(E::custom(format!(
                        "retry_on status {v} is not an HTTP error status (400-599)"
                    ))),
                }
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawRetryOn, E> {
                match u64::try_from(v) {
                    Ok(u) => self.visit_u64(u),
                    Err(_) => Err(E::custom(format!(
                        "retry_on status {v} is not an HTTP error status (400-599)"
                    ))),
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawRetryOn, E> {
                match v {
                    "timeout" => Ok(RawRetryOn(RetryOn::Timeout)),
                    "connect_error" => Ok(RawRetryOn(RetryOn::ConnectError)),
                    _ => match v.parse::<u64>() {
                        Ok(n) => self.visit_u64(n),
                        Err(_) => Err(E::custom(format!(
                            "unknown retry_on entry `{v}`: expected an HTTP status (400-599), \
                             `timeout` or `connect_error`"
                        ))),
                    },
                }
            }
        }
        d.deserialize_any(V)
    }
}
