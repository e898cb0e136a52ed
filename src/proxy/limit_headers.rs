//! The limit headers of every governed answer (SPEC §3.2, §10): OpenAI's
//! `x-ratelimit-{limit,remaining,reset}-tokens` for the tightest token bound, and the IETF
//! `RateLimit-Policy` / `RateLimit` fields (draft-ietf-httpapi-ratelimit-headers, structured
//! fields) for every windowed token and dollar bound (dollars as `qu="usd-micros"`: the
//! fields' values are integers), and `x-tollgate-budget-remaining-usd` for the tightest dollar
//! bound.

use super::header_memo;
use super::stamps::{Fields, Stamp};
use crate::governor::limits::{tightest, tightest_usd, TokenLimit};
use crate::units::{usd_decimal, Dim, Millis};
use http::HeaderValue;

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
pub(super) fn sf_string(out: &mut String, name: &str) {
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

/// The quota unit of a bound in the IETF fields: their values are integers, so dollars go as
/// micro-dollars.
fn quota_unit(unit: Dim) -> &'static str {
    match unit {
        Dim::Usd => "usd-micros",
        Dim::Tokens | Dim::Requests => "tokens",
    }
}

/// The windowed token and dollar bounds, with their window's length and end.
fn windowed(limits: &[TokenLimit]) -> impl Iterator<Item = (&TokenLimit, u64, Millis)> {
    limits
        .iter()
        .filter_map(|l| Some((l, l.window_secs?, l.resets_at_ms?)))
}

/// The `RateLimit-Policy` value: each windowed bound's name, quota and window.
fn policy_field(limits: &[TokenLimit]) -> String {
    let mut policy = String::with_capacity(64 * limits.len());
    for (l, w, _) in windowed(limits) {
        if !policy.is_empty() {
            policy.push_str(", ");
        }
        sf_string(&mut policy, &l.name);
        policy.push_str(";q=");
        push_u64(&mut policy, l.limit);
        policy.push_str(";qu=\"");
        policy.push_str(quota_unit(l.unit));
        policy.push_str("\";w=");
        push_u64(&mut policy, w);
    }
    policy
}

/// Most bound names whose quoted form a thread keeps ([`quoted`]); past it, it starts over.
const MAX_QUOTED: usize = 64;

thread_local! {
    /// Bound names (held, so an equal pointer is the same name) and their structured-field
    /// strings: the `RateLimit` value names every windowed bound on every answer.
    static QUOTED: header_memo::List<std::sync::Arc<str>, Box<str>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Appends `name` as a structured-field string, from the thread's kept copy when it has one.
fn quoted(out: &mut String, name: &std::sync::Arc<str>) {
    let s = header_memo::listed(
        &QUOTED,
        MAX_QUOTED,
        |n| std::sync::Arc::ptr_eq(n, name),
        || {
            let mut s = String::with_capacity(name.len() + 2);
            sf_string(&mut s, name);
            Ok::<_, std::convert::Infallible>((name.clone(), s.into_boxed_str()))
        },
        |s| out.push_str(s),
    );
    let Ok(()) = s;
}

/// The `RateLimit` value: each windowed bound's room and seconds until its window turns.
fn state_field(limits: &[TokenLimit], now: Millis) -> String {
    let mut state = String::with_capacity(48 * limits.len());
    for (l, _, reset) in windowed(limits) {
        if !state.is_empty() {
            state.push_str(", ");
        }
        quoted(&mut state, &l.name);
        state.push_str(";r=");
        push_u64(&mut state, l.remaining);
        state.push_str(";t=");
        push_u64(&mut state, secs_until(reset, now));
    }
    state
}

/// What a `RateLimit-Policy` value was built from: each windowed bound's name (held, so an
/// equal pointer is the same name), unit, quota and window.
type PolicyKey = Vec<(std::sync::Arc<str>, Dim, u64, u64)>;

thread_local! {
    /// The last `RateLimit-Policy` value this thread built. It changes only with the policy
    /// and the set of bounds a request falls under, so most answers reuse it (a clone of a
    /// shared buffer) instead of writing and validating it again.
    static POLICY_VALUE: header_memo::Slot<PolicyKey> = const { std::cell::RefCell::new(None) };
}

/// The `RateLimit-Policy` header value (`None`: no windowed bound, or a value a header
/// cannot carry).
fn policy_value(limits: &[TokenLimit]) -> Option<HeaderValue> {
    let same = |key: &PolicyKey| {
        let mut it = key.iter();
        windowed(limits).all(|(l, w, _)| {
            it.next().is_some_and(|(n, u, q, kw)| {
                (std::sync::Arc::ptr_eq(n, &l.name) || **n == *l.name)
                    && *u == l.unit
                    && *q == l.limit
                    && *kw == w
            })
        }) && it.next().is_none()
    };
    header_memo::value(&POLICY_VALUE, same, || {
        let policy = policy_field(limits);
        if policy.is_empty() {
            return None;
        }
        let v = HeaderValue::from_maybe_shared(bytes::Bytes::from(policy)).ok()?;
        let key = windowed(limits)
            .map(|(l, w, _)| (l.name.clone(), l.unit, l.limit, w))
            .collect();
        Some((key, v))
    })
}

/// Stamps the token rate-limit headers of an answer whose call was admitted. Every value is
/// carriable as made: digits, an OpenAI duration, structured-field strings of printable ASCII.
pub fn stamp(f: &mut impl Fields, limits: &[TokenLimit]) {
    if limits.is_empty() {
        return;
    }
    let now = crate::units::now_ms();
    if let Some(t) = tightest(limits) {
        let mut n = itoa::Buffer::new();
        f.put_known(Stamp::LimitTokens, n.format(t.limit).as_bytes());
        f.put_known(Stamp::RemainingTokens, n.format(t.remaining).as_bytes());
        if let Some(reset) = t.resets_at_ms {
            f.put_known(
                Stamp::ResetTokens,
                openai_duration(secs_until(reset, now)).as_bytes(),
            );
        }
    }
    if let Some(u) = tightest_usd(limits) {
        let mut b = [0u8; 28];
        f.put_known(
            Stamp::BudgetRemainingUsd,
            usd_decimal(u.remaining, &mut b).as_bytes(),
        );
    }
    if let Some(p) = policy_value(limits) {
        f.put_known(Stamp::RateLimitPolicy, p.as_bytes());
        f.put_known(Stamp::RateLimit, state_field(limits, now).as_bytes());
    }
}

/// `x-tollgate-shadow`: the shadow bounds that would have refused this request (SPEC §9),
/// comma-separated. Nothing is written (or allocated) when there are none.
pub fn stamp_shadow(f: &mut impl Fields, shadow: &[crate::governor::limits::LimitDetail]) {
    let Some((first, rest)) = shadow.split_first() else {
        return;
    };
    let mut v = String::with_capacity(16 * shadow.len());
    v.push_str(&first.name);
    for l in rest {
        // One name per bound, though a glob bound may note several ids.
        if !v.split(", ").any(|n| n == &*l.name) {
            v.push_str(", ");
            v.push_str(&l.name);
        }
    }
    f.put(Stamp::Shadow, v.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn tl(name: &str, rate: bool, limit: u64, remaining: u64, w: Option<u64>) -> TokenLimit {
        TokenLimit {
            name: Arc::from(name),
            unit: Dim::Tokens,
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
    fn the_ietf_fields_list_every_windowed_token_bound() {
        let limits = [
            tl("tpm", true, 20000, 18766, Some(60)),
            tl("per-job", false, 30000, 100, None),
            tl("day \"q\"", false, 100000, 5000, Some(86400)),
        ];
        let (p, s) = (policy_field(&limits), state_field(&limits, 18_000));
        assert_eq!(
            p,
            r#""tpm";q=20000;qu="tokens";w=60, "day \"q\"";q=100000;qu="tokens";w=86400"#
        );
        assert_eq!(s, r#""tpm";r=18766;t=42, "day \"q\"";r=5000;t=42"#);
        // No windowed bound: neither field.
        assert!(policy_field(&limits[1..2]).is_empty() && state_field(&limits[1..2], 0).is_empty());
        // Outside printable ASCII: replaced, as a structured-field string must be.
        let p = policy_field(&[tl("tägliche", false, 1, 1, Some(60))]);
        assert_eq!(p, r#""t_gliche";q=1;qu="tokens";w=60"#);
    }

    #[test]
    fn the_trio_follows_the_tightest_rate_limit() {
        let limits = [
            tl("tpm", true, 20000, 18766, Some(60)),
            tl("per-job", false, 30000, 100, None),
        ];
        let mut h = http::HeaderMap::new();
        stamp(&mut h, &limits);
        assert_eq!(h["x-ratelimit-limit-tokens"], "20000");
        assert_eq!(h["x-ratelimit-remaining-tokens"], "18766");
        assert!(h.contains_key("x-ratelimit-reset-tokens"));
        assert!(h["ratelimit-policy"]
            .to_str()
            .unwrap()
            .starts_with("\"tpm\""));
        // No rate limit: the tightest token bound of any kind, without a reset if unwindowed.
        let mut h = http::HeaderMap::new();
        stamp(&mut h, &limits[1..]);
        assert_eq!(h["x-ratelimit-remaining-tokens"], "100");
        assert!(!h.contains_key("x-ratelimit-reset-tokens"));
        assert!(!h.contains_key("ratelimit"));
    }

    #[test]
    fn the_policy_value_is_reused_only_for_the_same_bounds() {
        let a = [tl("tpm", true, 20000, 18766, Some(60))];
        let v = policy_value(&a).unwrap();
        assert_eq!(v, r#""tpm";q=20000;qu="tokens";w=60"#);
        // Same bounds (another name buffer with the same text): the same value.
        assert_eq!(
            policy_value(&[tl("tpm", true, 20000, 1, Some(60))]).unwrap(),
            v
        );
        // A changed quota, window, name or set of bounds is written afresh.
        for (other, want) in [
            (
                vec![tl("tpm", true, 30000, 1, Some(60))],
                r#""tpm";q=30000;qu="tokens";w=60"#,
            ),
            (
                vec![tl("tpm", true, 20000, 1, Some(3600))],
                r#""tpm";q=20000;qu="tokens";w=3600"#,
            ),
            (
                vec![tl("tph", true, 20000, 1, Some(60))],
                r#""tph";q=20000;qu="tokens";w=60"#,
            ),
            (
                vec![
                    tl("tpm", true, 20000, 1, Some(60)),
                    tl("day", false, 9, 1, Some(86400)),
                ],
                r#""tpm";q=20000;qu="tokens";w=60, "day";q=9;qu="tokens";w=86400"#,
            ),
            (
                vec![tl("tpm", true, 20000, 1, Some(60))],
                r#""tpm";q=20000;qu="tokens";w=60"#,
            ),
        ] {
            assert_eq!(policy_value(&other).unwrap(), want);
        }
        // No windowed bound: no value, and the next request still gets its own.
        assert!(policy_value(&[tl("per-job", false, 1, 1, None)]).is_none());
        assert_eq!(policy_value(&a).unwrap(), v);
    }
}
