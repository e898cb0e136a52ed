//! The token rate-limit headers of every governed answer (SPEC §3.2): OpenAI's
//! `x-ratelimit-{limit,remaining,reset}-tokens` for the tightest token bound, and the IETF
//! `RateLimit-Policy` / `RateLimit` fields (draft-ietf-httpapi-ratelimit-headers, structured
//! fields) for every windowed token bound.

use crate::governor::limits::{tightest, TokenLimit};
use crate::units::Millis;
use http::{HeaderMap, HeaderName, HeaderValue};

static H_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
static H_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
static H_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");
static H_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static H_RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Seconds until `at`, rounded up, never negative.
fn secs_until(at: Millis, now: Millis) -> u64 {
    (at.saturating_sub(now).max(0) as u64).div_ceil(1000)
}

/// A duration as OpenAI writes its reset headers: `0s`, `52s`, `1m30s`, `2h0m5s`.
pub fn openai_duration(secs: u64) -> String {
    let mut out = String::with_capacity(12);
    let (h, m, s) = (secs / 3600, secs % 3600 / 60, secs % 60);
    if h > 0 {
        push_u64(&mut out, h);
        out.push('h');
    }
    if h > 0 || m > 0 {
        push_u64(&mut out, m);
        out.push('m');
    }
    push_u64(&mut out, s);
    out.push('s');
    out
}

/// Decimal digits without `fmt` (these headers are written on every answer).
fn push_u64(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// A bound name as a structured-field string: printable ASCII, `"` and `\` escaped.
fn sf_string(out: &mut String, name: &str) {
    out.push('"');
    // Names are usually plain: copied whole after one pass over their bytes.
    if name
        .bytes()
        .all(|b| matches!(b, b' '..=b'~') && b != b'"' && b != b'\\')
    {
        out.push_str(name);
    } else {
        for c in name.chars() {
            match c {
                '"' | '\\' => {
                    out.push('\\');
                    out.push(c);
                }
                ' '..='~' => out.push(c),
                _ => out.push('_'),
            }
        }
    }
    out.push('"');
}

/// (`RateLimit-Policy`, `RateLimit`) values for the windowed token bounds, if any.
pub fn ietf_fields(limits: &[TokenLimit], now: Millis) -> Option<(String, String)> {
    let mut policy = String::new();
    let mut state = String::new();
    for l in limits {
        let (Some(w), Some(reset)) = (l.window_secs, l.resets_at_ms) else {
            continue;
        };
        if policy.is_empty() {
            policy.reserve(64 * limits.len());
            state.reserve(48 * limits.len());
        } else {
            policy.push_str(", ");
            state.push_str(", ");
        }
        sf_string(&mut policy, &l.name);
        policy.push_str(";q=");
        push_u64(&mut policy, l.limit);
        policy.push_str(";qu=\"tokens\";w=");
        push_u64(&mut policy, w);
        sf_string(&mut state, &l.name);
        state.push_str(";r=");
        push_u64(&mut state, l.remaining);
        state.push_str(";t=");
        push_u64(&mut state, secs_until(reset, now));
    }
    (!policy.is_empty()).then_some((policy, state))
}

/// Stamps the token rate-limit headers of an answer whose call was admitted.
pub fn stamp(h: &mut HeaderMap, limits: &[TokenLimit]) {
    let Some(t) = tightest(limits) else {
        return;
    };
    let now = jiff::Timestamp::now().as_millisecond();
    h.insert(H_LIMIT.clone(), HeaderValue::from(t.limit));
    h.insert(H_REMAINING.clone(), HeaderValue::from(t.remaining));
    if let Some(reset) = t.resets_at_ms {
        if let Ok(v) = HeaderValue::from_str(&openai_duration(secs_until(reset, now))) {
            h.insert(H_RESET.clone(), v);
        }
    }
    if let Some((policy, state)) = ietf_fields(limits, now) {
        if let (Ok(p), Ok(s)) = (
            HeaderValue::from_str(&policy),
            HeaderValue::from_str(&state),
        ) {
            h.insert(H_POLICY.clone(), p);
            h.insert(H_RATELIMIT.clone(), s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn tl(name: &str, rate: bool, limit: u64, remaining: u64, w: Option<u64>) -> TokenLimit {
        TokenLimit {
            name: Arc::from(name),
            rate,
            limit,
            remaining,
            window_secs: w,
            resets_at_ms: w.map(|_| 60_000),
            part: 0,
        }
    }

    #[test]
    fn durations_read_like_openai() {
        assert_eq!(openai_duration(0), "0s");
        assert_eq!(openai_duration(52), "52s");
        assert_eq!(openai_duration(90), "1m30s");
        assert_eq!(openai_duration(7205), "2h0m5s");
        assert_eq!(openai_duration(3600), "1h0m0s");
        assert_eq!(openai_duration(60), "1m0s");
        assert_eq!(secs_until(60_000, 17_500), 43);
        assert_eq!(secs_until(60_000, 61_000), 0);
    }

    #[test]
    fn ietf_fields_list_every_windowed_token_bound() {
        let limits = [
            tl("tpm", true, 20000, 18766, Some(60)),
            tl("per-job", false, 30000, 100, None),
            tl("day \"q\"", false, 100000, 5000, Some(86400)),
        ];
        let (p, s) = ietf_fields(&limits, 18_000).unwrap();
        assert_eq!(
            p,
            r#""tpm";q=20000;qu="tokens";w=60, "day \"q\"";q=100000;qu="tokens";w=86400"#
        );
        assert_eq!(s, r#""tpm";r=18766;t=42, "day \"q\"";r=5000;t=42"#);
        assert!(ietf_fields(&limits[1..2], 0).is_none());
        // Outside printable ASCII: replaced, as a structured-field string must be.
        let (p, _) = ietf_fields(&[tl("tägliche", false, 1, 1, Some(60))], 0).unwrap();
        assert_eq!(p, r#""t_gliche";q=1;qu="tokens";w=60"#);
    }

    #[test]
    fn the_trio_follows_the_tightest_rate_limit() {
        let limits = [
            tl("tpm", true, 20000, 18766, Some(60)),
            tl("per-job", false, 30000, 100, None),
        ];
        let mut h = HeaderMap::new();
        stamp(&mut h, &limits);
        assert_eq!(h["x-ratelimit-limit-tokens"], "20000");
        assert_eq!(h["x-ratelimit-remaining-tokens"], "18766");
        assert!(h.contains_key("x-ratelimit-reset-tokens"));
        assert!(h["ratelimit-policy"]
            .to_str()
            .unwrap()
            .starts_with("\"tpm\""));
        // No rate limit: the tightest token bound of any kind, without a reset if unwindowed.
        let mut h = HeaderMap::new();
        stamp(&mut h, &limits[1..]);
        assert_eq!(h["x-ratelimit-remaining-tokens"], "100");
        assert!(!h.contains_key("x-ratelimit-reset-tokens"));
        assert!(!h.contains_key("ratelimit"));
    }
}
