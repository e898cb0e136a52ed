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

/// A key as the line writes it after another member: `,"name":` (the first member of an
/// object drops the comma).
macro_rules! k {
    ($name:literal) => {
        concat!(",\"", $name, "\":")
    };
}

/// Writes `e` as one JSON object and its newline.
pub fn write(out: &mut impl Write, e: &Entry) -> io::Result<()> {
    // Built in a buffer and handed to `out` in one write: the line is ~60 small appends,
    // each a few inlined moves into a `Vec` (a key's length is known where it is written).
    let mut buf = Vec::with_capacity(1536);
    fill(&mut buf, e)?;
    buf.push(b'\n');
    out.write_all(&buf)
}

fn fill(out: &mut Vec<u8>, e: &Entry) -> io::Result<()> {
    let mut w = Line { out, first: true };
    w.out.push(b'{');
    w.text(k!("ts"), &e.ts);
    w.text(k!("endpoint"), e.endpoint);
    w.text(k!("api"), e.api);
    w.f64(k!("latency_ms"), e.latency_ms)?;
    record(&mut w, &e.record)?;
    w.out.push(b'}');
    Ok(())
}

fn record(w: &mut Line<'_>, r: &Record) -> io::Result<()> {
    w.raw(k!("budget_state"), r.budget_state.as_str());
    w.raw(k!("quota_state"), r.quota_state.as_str());
    w.raw(k!("circuit_state"), r.circuit_state.as_str());
    w.raw(k!("retry_state"), r.retry_state.as_str());
    w.raw(k!("usage_evidence_state"), r.usage_evidence_state.as_str());
    w.raw(k!("fallback_state"), r.fallback_state.as_str());
    w.raw(k!("final_action"), r.final_action.as_str());
    w.raw(k!("reason_class"), r.reason_class.as_str());
    w.int(k!("http_status"), u64::from(r.http_status));
    if let Some(v) = r.retry_after {
        w.int(k!("retry_after"), v);
    }
    w.array(k!("calls"), &r.calls, |out, c| {
        string(out, c);
        Ok(())
    })?;
    if let Some(v) = r.upstream_max_tokens {
        w.int(k!("upstream_max_tokens"), v);
    }
    w.text(k!("policy_version"), &r.policy_version);
    w.text(k!("request_id"), &r.request_id);
    w.text(k!("job_id"), &r.job_id);
    w.text(k!("consumer_id"), &r.consumer_id);
    if let Some(t) = &r.team {
        w.text(k!("team"), t);
    }
    w.text(k!("route"), &r.route);
    w.text(k!("backend"), &r.backend);
    if let Some(m) = &r.upstream_model {
        w.text(k!("upstream_model"), m);
    }
    w.int(k!("estimated_input_tokens"), r.estimated_input_tokens);
    w.int(k!("requested_output_tokens"), r.requested_output_tokens);
    if let Some(v) = r.client_max_tokens {
        w.int(k!("client_max_tokens"), v);
    }
    if r.n != 1 {
        w.int(k!("n"), u64::from(r.n));
    }
    w.int(k!("worst_case_tokens"), r.worst_case_tokens);
    w.f64(k!("worst_case_usd"), r.worst_case_usd)?;
    w.int(k!("actual_input_tokens"), r.actual_input_tokens);
    w.int(k!("actual_output_tokens"), r.actual_output_tokens);
    w.int(
        k!("actual_cached_input_tokens"),
        r.actual_cached_input_tokens,
    );
    w.int(k!("actual_cache_write_tokens"), r.actual_cache_write_tokens);
    w.f64(k!("cost_usd"), r.cost_usd)?;
    w.int(k!("job_attempts"), u64::from(r.job_attempts));
    w.int(k!("retry_budget"), u64::from(r.retry_budget));
    w.int(k!("job_fallbacks"), u64::from(r.job_fallbacks));
    w.f64(k!("amplification"), r.amplification)?;
    if let Some(v) = r.remaining_tokens {
        w.int(k!("remaining_tokens"), v);
    }
    w.array(k!("attempts"), &r.attempts, attempt)?;
    if r.refusals.is_empty() {
        w.key(k!("refusals"));
        w.out.extend_from_slice(b"[]");
    } else {
        w.serde(k!("refusals"), &r.refusals)?;
    }
    if let Some(l) = &r.limit {
        w.serde(k!("limit"), l)?;
    }
    if !r.shadow.is_empty() {
        w.serde(k!("shadow"), &r.shadow)?;
    }
    if !r.alerts.is_empty() {
        w.serde(k!("alerts"), &r.alerts)?;
    }
    if let Some(e) = &r.error {
        w.text(k!("error"), e);
    }
    if r.usage_over_reservation {
        w.key(k!("usage_over_reservation"));
        w.out.extend_from_slice(b"true");
    }
    if r.client_disconnected {
        w.key(k!("client_disconnected"));
        w.out.extend_from_slice(b"true");
    }
    Ok(())
}

fn attempt(out: &mut Vec<u8>, a: &AttemptRecord) -> io::Result<()> {
    let mut w = Line { out, first: true };
    w.out.push(b'{');
    w.text(k!("backend"), &a.backend);
    w.text(k!("model"), &a.model);
    w.int(k!("attempt"), u64::from(a.attempt));
    w.key(k!("probe"));
    w.out
        .extend_from_slice(if a.probe { b"true" } else { b"false" });
    w.int(k!("worst_tokens"), a.worst_tokens);
    w.f64(k!("worst_cost_usd"), a.worst_cost_usd)?;
    w.int(k!("max_output_tokens"), a.max_output_tokens);
    w.text(k!("outcome"), a.outcome);
    if let Some(s) = a.status {
        w.int(k!("status"), u64::from(s));
    }
    if let Some(v) = a.retry_after_ms {
        w.int(k!("retry_after_ms"), v);
    }
    w.raw(k!("circuit_before"), a.circuit_before.as_str());
    w.raw(k!("circuit_after"), a.circuit_after.as_str());
    w.int(k!("latency_ms"), a.latency_ms);
    w.int(k!("waited_ms"), a.waited_ms);
    if a.committed_tokens > 0 {
        w.int(k!("committed_tokens"), a.committed_tokens);
    }
    w.out.push(b'}');
    Ok(())
}

/// A number `Line::f64` formatted: its bits, its text and the text's length.
type Formatted = (u64, [u8; 32], u8);

thread_local! {
    /// The last few numbers `Line::f64` formatted (round-robin: the slots and the next one).
    static FLOATS: std::cell::RefCell<([Formatted; 4], usize)> =
        const { std::cell::RefCell::new(([(0, [0; 32], 0); 4], 0)) };
}

/// An object being written into the line's buffer: its members' separators. Appends to a
/// `Vec` cannot fail; only `serde_json`'s parts return errors.
struct Line<'a> {
    out: &'a mut Vec<u8>,
    first: bool,
}

impl Line<'_> {
    /// `,"k":`, without the comma for the first member; `k` is the key already quoted (`k!`:
    /// a literal of this file, nothing to escape), so it is a copy of a length known where it
    /// is inlined: a few moves, no `memcpy` call.
    #[inline(always)]
    fn key(&mut self, k: &'static str) {
        let k = k.as_bytes();
        if self.first {
            self.first = false;
            self.out.extend_from_slice(&k[1..]);
        } else {
            self.out.extend_from_slice(k);
        }
    }

    /// A closed-set value (an upper-case state name): written as it is.
    #[inline(always)]
    fn raw(&mut self, k: &'static str, v: &'static str) {
        self.key(k);
        self.out.push(b'"');
        self.out.extend_from_slice(v.as_bytes());
        self.out.push(b'"');
    }

    #[inline(always)]
    fn text(&mut self, k: &'static str, v: &str) {
        self.key(k);
        string(self.out, v);
    }

    #[inline(always)]
    fn int(&mut self, k: &'static str, v: impl itoa::Integer) {
        self.key(k);
        self.out
            .extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
    }

    /// As `serde_json` writes an `f64`: shortest round-trip digits, `null` when not finite.
    /// A whole number (an amplification of 1.0) is written as an integer and `.0`; a number
    /// among the last few written (an attempt's worst cost is its request's when it made one,
    /// and consecutive lines share prices) is copied as it was written.
    fn f64(&mut self, k: &'static str, v: f64) -> io::Result<()> {
        self.key(k);
        if !v.is_finite() {
            self.out.extend_from_slice(b"null");
            return Ok(());
        }
        if v.fract() == 0.0 && v.abs() < 1e15 && !(v == 0.0 && v.is_sign_negative()) {
            self.out
                .extend_from_slice(itoa::Buffer::new().format(v as i64).as_bytes());
            self.out.extend_from_slice(b".0");
            return Ok(());
        }
        let bits = v.to_bits();
        let hit = FLOATS
            .try_with(|f| {
                let f = f.borrow();
                f.0.iter()
                    .find(|(b, _, n)| *b == bits && *n > 0)
                    .map(|(_, text, n)| self.out.extend_from_slice(&text[..usize::from(*n)]))
                    .is_some()
            })
            .unwrap_or(false);
        if hit {
            return Ok(());
        }
        let at = self.out.len();
        CompactFormatter.write_f64(self.out, v)?;
        let written = &self.out[at..];
        if let Ok(n) = u8::try_from(written.len()) {
            if written.len() <= 32 {
                let mut text = [0u8; 32];
                text[..written.len()].copy_from_slice(written);
                let _ = FLOATS.try_with(|f| {
                    let mut f = f.borrow_mut();
                    let slot = f.1 % f.0.len();
                    f.0[slot] = (bits, text, n);
                    f.1 = f.1.wrapping_add(1);
                });
            }
        }
        Ok(())
    }

    /// `"k":[…]`, each item written by `item`.
    fn array<T>(
        &mut self,
        k: &'static str,
        items: &[T],
        item: impl Fn(&mut Vec<u8>, &T) -> io::Result<()>,
    ) -> io::Result<()> {
        self.key(k);
        self.out.push(b'[');
        for (i, x) in items.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            item(self.out, x)?;
        }
        self.out.push(b']');
        Ok(())
    }

    fn serde(&mut self, k: &'static str, v: &impl serde::Serialize) -> io::Result<()> {
        self.key(k);
        serde_json::to_writer(&mut *self.out, v).map_err(io::Error::other)
    }
}

/// A JSON string: copied whole when nothing in it needs escaping (found eight bytes at a
/// time, [`crate::jscan::special_at`]), else escaped as `serde_json` escapes it.
fn string(out: &mut Vec<u8>, s: &str) {
    if crate::jscan::special_at(s.as_bytes()).is_some() {
        // Writing into a `Vec` cannot fail, and a `&str` always serialises.
        let _ = serde_json::to_writer(out, s);
        return;
    }
    out.reserve(s.len() + 2);
    out.push(b'"');
    out.extend_from_slice(s.as_bytes());
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::governor::{
        AlertNote, BoundNote, BudgetState, CircuitState, FinalAction, ReasonClass, RetryState,
    };
    use std::sync::Arc;

    #[test]
    fn numbers_are_written_as_serde_writes_them() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut vs = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            1.5,
            4e-6,
            0.000029,
            1e15,
            1e15 - 1.0,
            1e16,
            123456789.0,
            f64::MAX,
            f64::MIN_POSITIVE,
            5e-324,
            -2.5e-308,
            147.70893700000002,
            f64::NAN,
            f64::INFINITY,
        ];
        for _ in 0..20_000 {
            let r = next();
            vs.push(match r % 4 {
                0 => f64::from_bits(next()),
                1 => (next() % 1_000_000) as f64 / 1000.0,
                2 => (next() % 10_000) as f64,
                _ => vs[(next() % vs.len() as u64) as usize],
            });
        }
        for v in vs {
            let mut out = Vec::new();
            let mut w = Line {
                out: &mut out,
                first: true,
            };
            w.f64(",\"k\":", v).unwrap();
            let want = format!("\"k\":{}", serde_json::to_string(&v).unwrap());
            assert_eq!(String::from_utf8(out).unwrap(), want, "{v:e}");
        }
    }

    fn by_hand(e: &Entry) -> String {
        let mut v = Vec::new();
        fill(&mut v, e).unwrap();
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
            committed_tokens: 0,
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
        r.calls = smallvec::smallvec![Arc::from("a"), Arc::from("b\"")];
        r.team = Some(Arc::from("team-1"));
        r.upstream_model = Some(Arc::from("m"));
        r.client_max_tokens = Some(64);
        r.n = 3;
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
                committed_tokens: 0,
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
