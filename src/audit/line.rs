//! The JSONL audit line, written by hand: the same bytes `serde_json` writes from the derived
//! `Serialize` of [`Entry`] (a test holds the two equal), at a fraction of the cost. The
//! derive goes through `#[serde(flatten)]` (a map serializer) and escapes every key and every
//! string byte by byte; here keys are literals, the closed-set values are written as they are,
//! and a free-text value is scanned once and copied whole unless it needs escaping. The rare,
//! nested parts (refusals, alerts, the refusing limit) still go through `serde_json`.

use super::Entry;
use crate::governor::{AttemptRecord, Record};
use serde_json::ser::{CompactFormatter, Formatter};
use std::io::{self, Write};

/// Writes `e` as one JSON object (no newline).
pub fn write(out: &mut impl Write, e: &Entry) -> io::Result<()> {
    // Built in a buffer (small appends are cheap there) and handed to `out` in one write.
    let mut buf = Vec::with_capacity(1536);
    fill(&mut buf, e)?;
    out.write_all(&buf)
}

fn fill(out: &mut Vec<u8>, e: &Entry) -> io::Result<()> {
    let mut w = Line { out, first: true };
    w.out.write_all(b"{")?;
    w.text("ts", &e.ts)?;
    w.text("endpoint", e.endpoint)?;
    w.text("api", e.api)?;
    w.f64("latency_ms", e.latency_ms)?;
    record(&mut w, &e.record)?;
    w.out.write_all(b"}")
}

fn record<W: Write>(w: &mut Line<'_, W>, r: &Record) -> io::Result<()> {
    w.raw("budget_state", r.budget_state.as_str())?;
    w.raw("quota_state", r.quota_state.as_str())?;
    w.raw("circuit_state", r.circuit_state.as_str())?;
    w.raw("retry_state", r.retry_state.as_str())?;
    w.raw("usage_evidence_state", r.usage_evidence_state.as_str())?;
    w.raw("fallback_state", r.fallback_state.as_str())?;
    w.raw("final_action", r.final_action.as_str())?;
    w.raw("reason_class", r.reason_class.as_str())?;
    w.int("http_status", u64::from(r.http_status))?;
    if let Some(v) = r.retry_after {
        w.int("retry_after", v)?;
    }
    w.array("calls", &r.calls, |out, c| string(out, c))?;
    if let Some(v) = r.upstream_max_tokens {
        w.int("upstream_max_tokens", v)?;
    }
    w.text("policy_version", &r.policy_version)?;
    w.text("request_id", &r.request_id)?;
    w.text("job_id", &r.job_id)?;
    w.text("consumer_id", &r.consumer_id)?;
    if let Some(t) = &r.team {
        w.text("team", t)?;
    }
    w.text("route", &r.route)?;
    w.text("backend", &r.backend)?;
    if let Some(m) = &r.upstream_model {
        w.text("upstream_model", m)?;
    }
    w.int("estimated_input_tokens", r.estimated_input_tokens)?;
    w.int("requested_output_tokens", r.requested_output_tokens)?;
    w.int("worst_case_tokens", r.worst_case_tokens)?;
    w.f64("worst_case_usd", r.worst_case_usd)?;
    w.int("actual_input_tokens", r.actual_input_tokens)?;
    w.int("actual_output_tokens", r.actual_output_tokens)?;
    w.int("actual_cached_input_tokens", r.actual_cached_input_tokens)?;
    w.int("actual_cache_write_tokens", r.actual_cache_write_tokens)?;
    w.f64("cost_usd", r.cost_usd)?;
    w.int("job_attempts", u64::from(r.job_attempts))?;
    w.int("retry_budget", u64::from(r.retry_budget))?;
    w.int("job_fallbacks", u64::from(r.job_fallbacks))?;
    w.f64("amplification", r.amplification)?;
    if let Some(v) = r.remaining_tokens {
        w.int("remaining_tokens", v)?;
    }
    w.array("attempts", &r.attempts, |out, a| attempt(out, a))?;
    w.serde("refusals", &r.refusals)?;
    if let Some(l) = &r.limit {
        w.serde("limit", l)?;
    }
    if !r.alerts.is_empty() {
        w.serde("alerts", &r.alerts)?;
    }
    if let Some(e) = &r.error {
        w.text("error", e)?;
    }
    if r.usage_over_reservation {
        w.key("usage_over_reservation")?;
        w.out.write_all(b"true")?;
    }
    if r.client_disconnected {
        w.key("client_disconnected")?;
        w.out.write_all(b"true")?;
    }
    Ok(())
}

fn attempt(out: &mut impl Write, a: &AttemptRecord) -> io::Result<()> {
    let mut w = Line { out, first: true };
    w.out.write_all(b"{")?;
    w.text("backend", &a.backend)?;
    w.text("model", &a.model)?;
    w.int("attempt", u64::from(a.attempt))?;
    w.key("probe")?;
    w.out.write_all(if a.probe { b"true" } else { b"false" })?;
    w.int("worst_tokens", a.worst_tokens)?;
    w.f64("worst_cost_usd", a.worst_cost_usd)?;
    w.int("max_output_tokens", a.max_output_tokens)?;
    w.text("outcome", a.outcome)?;
    if let Some(s) = a.status {
        w.int("status", u64::from(s))?;
    }
    if let Some(v) = a.retry_after_ms {
        w.int("retry_after_ms", v)?;
    }
    w.raw("circuit_before", a.circuit_before.as_str())?;
    w.raw("circuit_after", a.circuit_after.as_str())?;
    w.int("latency_ms", a.latency_ms)?;
    w.int("waited_ms", a.waited_ms)?;
    w.out.write_all(b"}")
}

/// An object being written: its members' separators.
struct Line<'a, W: Write> {
    out: &'a mut W,
    first: bool,
}

impl<W: Write> Line<'_, W> {
    /// `"k":` (keys are literals of this file: nothing to escape), after a comma but first.
    fn key(&mut self, k: &str) -> io::Result<()> {
        if !self.first {
            self.out.write_all(b",")?;
        }
        self.first = false;
        self.out.write_all(b"\"")?;
        self.out.write_all(k.as_bytes())?;
        self.out.write_all(b"\":")
    }

    /// A closed-set value (an upper-case state name): written as it is.
    fn raw(&mut self, k: &str, v: &'static str) -> io::Result<()> {
        self.key(k)?;
        self.out.write_all(b"\"")?;
        self.out.write_all(v.as_bytes())?;
        self.out.write_all(b"\"")
    }

    fn text(&mut self, k: &str, v: &str) -> io::Result<()> {
        self.key(k)?;
        string(self.out, v)
    }

    fn int(&mut self, k: &str, v: impl itoa::Integer) -> io::Result<()> {
        self.key(k)?;
        self.out.write_all(itoa::Buffer::new().format(v).as_bytes())
    }

    /// As `serde_json` writes an `f64`: shortest round-trip digits, `null` when not finite.
    fn f64(&mut self, k: &str, v: f64) -> io::Result<()> {
        self.key(k)?;
        if v.is_finite() {
            CompactFormatter.write_f64(self.out, v)
        } else {
            self.out.write_all(b"null")
        }
    }

    /// `"k":[…]`, each item written by `item`.
    fn array<T>(
        &mut self,
        k: &str,
        items: &[T],
        item: impl Fn(&mut W, &T) -> io::Result<()>,
    ) -> io::Result<()> {
        self.key(k)?;
        self.out.write_all(b"[")?;
        for (i, x) in items.iter().enumerate() {
            if i > 0 {
                self.out.write_all(b",")?;
            }
            item(self.out, x)?;
        }
        self.out.write_all(b"]")
    }

    fn serde(&mut self, k: &str, v: &impl serde::Serialize) -> io::Result<()> {
        self.key(k)?;
        serde_json::to_writer(&mut *self.out, v).map_err(io::Error::other)
    }
}

/// A JSON string: copied whole when nothing in it needs escaping (one branch-free pass the
/// compiler vectorises), else escaped by `serde_json`.
fn string(out: &mut impl Write, s: &str) -> io::Result<()> {
    let needs = s.bytes().fold(false, |acc, b| {
        acc | (b < 0x20) | (b == b'"') | (b == b'\\')
    });
    if needs {
        return serde_json::to_writer(out, s).map_err(io::Error::other);
    }
    out.write_all(b"\"")?;
    out.write_all(s.as_bytes())?;
    out.write_all(b"\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::governor::{
        AlertNote, BoundNote, BudgetState, CircuitState, FinalAction, ReasonClass, RetryState,
    };
    use std::sync::Arc;

    fn by_hand(e: &Entry) -> String {
        let mut v = Vec::new();
        write(&mut v, e).unwrap();
        String::from_utf8(v).unwrap()
    }

    fn entry(record: Record) -> Entry {
        Entry {
            ts: "2026-12-01T21:11:06.965932792Z".into(),
            endpoint: "chat.completions",
            api: "openai",
            latency_ms: 3.868_114_000_000_000_3,
            record,
        }
    }

    #[test]
    fn a_plain_record_is_written_as_serde_writes_it() {
        let mut r = Record::new(
            Arc::from("bench-1"),
            Arc::from("tg-2dcf2d40-13f"),
            Arc::from("tg-2dcf2d40-13f"),
            Arc::from("bench"),
            Arc::from("chat"),
        );
        r.calls.push(Arc::from("local"));
        r.upstream_max_tokens = Some(256);
        r.worst_case_usd = 0.000029;
        r.cost_usd = 4e-6;
        r.amplification = 1.0;
        r.remaining_tokens = Some(99_999_987_200);
        r.attempts.push(AttemptRecord {
            backend: Arc::from("local"),
            model: Arc::from("llama"),
            attempt: 1,
            probe: false,
            worst_tokens: 284,
            worst_cost_usd: 0.000029,
            max_output_tokens: 256,
            outcome: "ok",
            status: None,
            retry_after_ms: None,
            circuit_before: CircuitState::Closed,
            circuit_after: CircuitState::Closed,
            latency_ms: 2,
            waited_ms: 0,
        });
        let e = entry(r);
        assert_eq!(by_hand(&e), serde_json::to_string(&e).unwrap());
    }

    #[test]
    fn every_optional_part_and_hostile_text_is_written_as_serde_writes_it() {
        let mut r = Record::new(
            Arc::from("v\"2\\"),
            Arc::from("id\nwith\tcontrol\u{1}"),
            Arc::from("job ünïcödé ✓"),
            Arc::from("c"),
            Arc::from("r"),
        );
        r.budget_state = BudgetState::HardExceeded;
        r.retry_state = RetryState::Exhausted;
        r.final_action = FinalAction::HardStop;
        r.reason_class = ReasonClass::HardBudgetExceeded;
        r.http_status = 429;
        r.retry_after = Some(30);
        r.calls = vec![Arc::from("a"), Arc::from("b\"")];
        r.team = Some(Arc::from("team-1"));
        r.upstream_model = Some(Arc::from("m"));
        r.worst_case_usd = f64::NAN;
        r.cost_usd = 1e21;
        r.amplification = 2.5;
        for (i, st) in [(1, Some(503)), (2, None)] {
            r.attempts.push(AttemptRecord {
                backend: Arc::from("b"),
                model: Arc::from("m"),
                attempt: i,
                probe: i == 2,
                worst_tokens: u64::MAX,
                worst_cost_usd: 0.1 + 0.2,
                max_output_tokens: 0,
                outcome: "server",
                status: st,
                retry_after_ms: Some(-5),
                circuit_before: CircuitState::HalfOpen,
                circuit_after: CircuitState::Open,
                latency_ms: i64::MAX,
                waited_ms: i64::MIN,
            });
        }
        r.refusals.push(BoundNote {
            name: Arc::from("monthly"),
            class: "budget",
            scope: "global",
            id: Arc::from("global"),
            window: Some("month"),
            dim: "usd",
            used: 1,
            limit: 2,
            asked: 3,
            backend: Arc::from("b"),
        });
        r.alerts.push(AlertNote {
            bound: Arc::from("q"),
            class: "quota",
            scope: "backend",
            id: Arc::from("b"),
            window: None,
            window_start: Some(1_700_000_000),
            dim: "tokens",
            threshold: 0.9,
            used: 90,
            limit: 100,
        });
        r.error = Some("upstream said \"no\"\r\n".into());
        r.usage_over_reservation = true;
        r.client_disconnected = true;
        let e = entry(r);
        let line = by_hand(&e);
        assert_eq!(line, serde_json::to_string(&e).unwrap());
        // Still one line: the control characters were escaped.
        assert!(!line.contains('\n'));
    }
}
