//! The usage-log row (the ADR's `ai_usage_logs`), derived from an audit [`Entry`]. One mapping
//! feeds both the SQLite and the Postgres sink, so the two logs agree column for column. The
//! row holds ids, counts, classes and the sidecar's own error text: never a key or a prompt.

use super::Entry;

/// One usage-log row. `id` is made by the sidecar when the row is built (not the client's
/// request id, which a client may repeat): a retried batch re-inserts the same ids and the
/// database ignores the ones already committed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UsageRow {
    pub id: String,
    /// UTC, RFC 3339 with exactly six fractional digits, so text order is time order.
    pub created_at: String,
    /// The backend id that served, `static`, or `none`.
    pub provider: String,
    pub model: Option<String>,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub latency_ms: i64,
    /// Served (by an upstream or the static answer) with a 2xx status.
    pub success: bool,
    pub error_message: Option<String>,
    pub consumer: String,
    pub request_id: String,
    pub job_id: String,
    /// The chain entries the request went through, in order, comma-separated — called ones
    /// and ones skipped without a call (saturated, untranslatable) alike; empty when none was
    /// reached. (Telemetry's attempt counts leave the skipped ones out.)
    pub tried: String,
    pub route: String,
    pub policy_version: String,
    pub estimated_input_tokens: i64,
    /// The output allowance the precheck reserved for (`max_tokens` or the policy default).
    pub requested_output_tokens: i64,
    /// Where the token counts come from: ACTUAL, ESTIMATED, PARTIAL or NONE.
    pub provenance: String,
    pub cost_usd: f64,
    pub action: String,
    pub reason: String,
    pub http_status: i32,
    pub endpoint: String,
    /// Of `input_tokens`: read from the provider's prompt cache (priced at `cached_input`).
    #[serde(default)]
    pub cached_input_tokens: i64,
    /// Of `input_tokens`: written to the provider's prompt cache (priced at `cache_write`).
    #[serde(default)]
    pub cache_write_tokens: i64,
    /// The client's dialect: `openai`, `anthropic`, `gemini`, `ollama` (empty in rows
    /// spilled by an older build).
    #[serde(default)]
    pub api: String,
    /// The caller's team, from its virtual key; empty when it has none (and in rows written
    /// before the column existed).
    #[serde(default)]
    pub team: String,
}

/// The columns in insert order (`id` first), shared by the DDL and the inserts.
pub const COLUMNS: &[&str] = &[
    "id",
    "created_at",
    "provider",
    "model",
    "input_tokens",
    "output_tokens",
    "latency_ms",
    "success",
    "error_message",
    "consumer",
    "request_id",
    "job_id",
    "tried",
    "route",
    "policy_version",
    "estimated_input_tokens",
    "requested_output_tokens",
    "provenance",
    "cost_usd",
    "action",
    "reason",
    "http_status",
    "endpoint",
    "cached_input_tokens",
    "cache_write_tokens",
    "api",
    "team",
];

/// Columns added after the first release, with their SQL types (SQLite, Postgres) and
/// defaults: a log created by an older build gains them at start (`ALTER TABLE ADD COLUMN`).
pub const ADDED_COLUMNS: &[(&str, &str, &str)] = &[
    (
        "cached_input_tokens",
        "INTEGER NOT NULL DEFAULT 0",
        "bigint NOT NULL DEFAULT 0",
    ),
    (
        "cache_write_tokens",
        "INTEGER NOT NULL DEFAULT 0",
        "bigint NOT NULL DEFAULT 0",
    ),
    (
        "api",
        "TEXT NOT NULL DEFAULT ''",
        "text NOT NULL DEFAULT ''",
    ),
    (
        "team",
        "TEXT NOT NULL DEFAULT ''",
        "text NOT NULL DEFAULT ''",
    ),
];

/// Longest error text kept in a row: the record's error is the sidecar's own message, bounded
/// so a pathological upstream body cannot bloat the log.
const MAX_ERROR: usize = 1000;

/// Maps an audit entry to its usage-log row.
pub fn usage_row(e: &Entry) -> UsageRow {
    let r = &e.record;
    let served = &*r.backend != "none";
    let mut tried = String::new();
    for a in &r.attempts {
        if !tried.is_empty() {
            tried.push(',');
        }
        tried.push_str(&a.backend);
    }
    UsageRow {
        id: new_id(),
        created_at: utc_micros(&e.ts),
        provider: r.backend.to_string(),
        model: r.upstream_model.as_deref().map(str::to_owned),
        input_tokens: clamp(r.actual_input_tokens),
        output_tokens: clamp(r.actual_output_tokens),
        latency_ms: e.latency_ms.round().max(0.0) as i64,
        success: served && (200..300).contains(&r.http_status),
        error_message: r
            .error
            .as_deref()
            .map(|s| truncate(s, MAX_ERROR).to_owned()),
        consumer: r.consumer_id.to_string(),
        request_id: r.request_id.to_string(),
        job_id: r.job_id.to_string(),
        tried,
        route: r.route.to_string(),
        policy_version: r.policy_version.to_string(),
        estimated_input_tokens: clamp(r.estimated_input_tokens),
        requested_output_tokens: clamp(r.requested_output_tokens),
        provenance: r.usage_evidence_state.as_str().to_owned(),
        cost_usd: r.cost_usd,
        action: r.final_action.as_str().to_owned(),
        reason: r.reason_class.as_str().to_owned(),
        http_status: i32::from(r.http_status),
        endpoint: e.endpoint.to_owned(),
        cached_input_tokens: clamp(r.actual_cached_input_tokens),
        cache_write_tokens: clamp(r.actual_cache_write_tokens),
        api: e.api.to_owned(),
        team: r.team.as_deref().unwrap_or_default().to_owned(),
    }
}

pub use crate::policy::valid_table;

/// A timestamp as UTC text with six fractional digits (jiff's `Display` prints a variable
/// number, which breaks text ordering within a second). Unparsable input is taken as now.
pub fn utc_micros(ts: &str) -> String {
    let t = ts
        .parse::<jiff::Timestamp>()
        .unwrap_or_else(|_| jiff::Timestamp::now());
    format_utc(t)
}

/// `t` as `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
pub fn format_utc(t: jiff::Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// A random UUID (version 4) as text.
fn new_id() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::governor::UsageEvidence;
    use crate::governor::{AttemptRecord, CircuitState, FinalAction, ReasonClass, Record};
    use std::sync::Arc;

    fn entry() -> Entry {
        let mut r = Record::new(
            Arc::from("v1"),
            Arc::from("req-1"),
            Arc::from("job-1"),
            Arc::from("alice"),
            Arc::from("chat"),
        );
        r.backend = Arc::from("gemini");
        r.upstream_model = Some(Arc::from("gemini-2.0-flash"));
        r.actual_input_tokens = 12;
        r.actual_output_tokens = 34;
        r.estimated_input_tokens = 11;
        r.requested_output_tokens = 256;
        r.usage_evidence_state = UsageEvidence::Actual;
        r.cost_usd = 0.046;
        for b in ["ollama", "gemini"] {
            r.attempts.push(AttemptRecord {
                backend: Arc::from(b),
                model: Arc::from("m"),
                attempt: 1,
                probe: false,
                worst_tokens: 0,
                worst_cost_usd: 0.0,
                max_output_tokens: 0,
                outcome: "ok",
                status: Some(200),
                retry_after_ms: None,
                circuit_before: CircuitState::Closed,
                circuit_after: CircuitState::Closed,
                latency_ms: 1,
                waited_ms: 0,
                committed_tokens: 0,
            });
        }
        Entry {
            ts: "2026-11-30T02:58:23.5Z".into(),
            endpoint: "chat.completions",
            api: "openai",
            latency_ms: 12.6,
            record: r,
        }
    }

    #[test]
    fn maps_every_column() {
        let row = usage_row(&entry());
        assert_eq!(row.created_at, "2026-11-30T02:58:23.500000Z");
        assert_eq!(row.provider, "gemini");
        assert_eq!(row.model.as_deref(), Some("gemini-2.0-flash"));
        assert_eq!((row.input_tokens, row.output_tokens), (12, 34));
        assert_eq!(row.latency_ms, 13);
        assert!(row.success);
        assert_eq!(row.error_message, None);
        assert_eq!(
            (&*row.consumer, &*row.request_id, &*row.job_id),
            ("alice", "req-1", "job-1")
        );
        assert_eq!(row.tried, "ollama,gemini");
        assert_eq!((&*row.route, &*row.policy_version), ("chat", "v1"));
        assert_eq!(
            (row.estimated_input_tokens, row.requested_output_tokens),
            (11, 256)
        );
        assert_eq!(row.provenance, "ACTUAL");
        assert_eq!(row.cost_usd, 0.046);
        assert_eq!((&*row.action, &*row.reason), ("ALLOW", "OK"));
        assert_eq!((row.http_status, &*row.endpoint), (200, "chat.completions"));
        assert_eq!(row.team, "", "no key, no team");
        let mut e = entry();
        e.record.team = Some(Arc::from("team-a"));
        assert_eq!(usage_row(&e).team, "team-a");
        assert_eq!(row.id.len(), 36);
        assert_eq!(&row.id[14..15], "4");
        assert_ne!(row.id, usage_row(&entry()).id);
    }

    #[test]
    fn refused_and_failed_requests_are_not_successes() {
        let mut e = entry();
        e.record.backend = Arc::from("none");
        e.record.final_action = FinalAction::HardStop;
        e.record.reason_class = ReasonClass::QuotaBlocked;
        e.record.http_status = 403;
        e.record.error = Some("é".repeat(600));
        let row = usage_row(&e);
        assert!(!row.success);
        assert_eq!((&*row.action, &*row.reason), ("HARD_STOP", "QUOTA_BLOCKED"));
        assert_eq!(row.error_message.as_ref().map(|s| s.len()), Some(1000));

        let mut s = entry();
        s.record.backend = Arc::from("static");
        s.record.final_action = FinalAction::Degrade;
        assert!(usage_row(&s).success, "the static answer is a served 200");
        s.record.http_status = 502;
        s.record.backend = Arc::from("gemini");
        assert!(!usage_row(&s).success);
    }

    #[test]
    fn table_names_are_plain_identifiers() {
        for ok in ["ai_usage_logs", "_t", "T1"] {
            assert!(valid_table(ok), "{ok}");
        }
        for bad in ["", "1t", "a-b", "a;drop", "a b", &"x".repeat(64)] {
            assert!(!valid_table(bad), "{bad}");
        }
    }

    #[test]
    fn text_timestamps_sort_as_times() {
        let a = utc_micros("2026-11-30T00:00:00Z");
        let b = utc_micros("2026-11-30T00:00:00.5Z");
        assert!(a < b, "{a} < {b}");
    }
}
