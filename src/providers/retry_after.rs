//! Reads an upstream's "come back later" in all the spellings seen in practice, in the
//! precedence the official SDKs use: `retry-after-ms`, `retry-after` as (fractional) seconds,
//! `retry-after` as an HTTP-date, then Gemini's `RetryInfo.retryDelay` in a JSON error body.

use http::HeaderMap;

/// The delay in ms, if the response states one. `now_ms` resolves HTTP-dates.
pub fn from_headers(h: &HeaderMap, now_ms: i64) -> Option<i64> {
    if let Some(ms) = ms_header(h, "retry-after-ms") {
        return Some(ms);
    }
    let v = h.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim();
    parse_retry_after(v, now_ms)
}

/// `Retry-After: <seconds>` (fractional accepted) or an HTTP-date (IMF-fixdate, RFC 850, asctime).
pub fn parse_retry_after(v: &str, now_ms: i64) -> Option<i64> {
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| (secs * 1000.0).round() as i64);
    }
    let when = httpdate::parse_http_date(v).ok()?;
    let ms = when.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as i64;
    Some((ms - now_ms).max(0))
}

/// Gemini's `{"error":{"details":[{"@type":"...RetryInfo","retryDelay":"22s"}]}}`.
pub fn from_gemini_body(body: &[u8]) -> Option<i64> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let details = v.get("error")?.get("details")?.as_array()?;
    details.iter().find_map(|d| {
        let ty = d.get("@type")?.as_str()?;
        if !ty.ends_with("google.rpc.RetryInfo") {
            return None;
        }
        parse_proto_duration(d.get("retryDelay")?.as_str()?)
    })
}

/// A protobuf JSON duration: `"22s"`, `"45.8s"`.
fn parse_proto_duration(s: &str) -> Option<i64> {
    let secs: f64 = s.strip_suffix('s')?.parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| (secs * 1000.0).round() as i64)
}

/// Azure's `x-ms-retry-after-ms`.
pub fn from_azure_header(h: &HeaderMap) -> Option<i64> {
    ms_header(h, "x-ms-retry-after-ms")
}

/// A header holding a delay in (fractional) milliseconds; `None` when absent or not a
/// finite, non-negative number.
fn ms_header(h: &HeaderMap, name: &str) -> Option<i64> {
    let v: f64 = h.get(name)?.to_str().ok()?.trim().parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| v.round() as i64)
}

/// OpenAI's rate-limit headers: for each exhausted limit (`x-ratelimit-remaining-{requests,
/// tokens}: 0`), its `x-ratelimit-reset-*` Go-style duration; the latest of them, since all
/// exhausted limits must reset before a call can pass.
pub fn from_openai_ratelimit(h: &HeaderMap) -> Option<i64> {
    ["requests", "tokens"]
        .iter()
        .filter(|k| header_str(h, &format!("x-ratelimit-remaining-{k}")) == Some("0"))
        .filter_map(|k| parse_go_duration(header_str(h, &format!("x-ratelimit-reset-{k}"))?))
        .max()
}

/// Anthropic's `anthropic-ratelimit-*-reset` (RFC 3339 instants) of the exhausted limits.
pub fn from_anthropic_ratelimit(h: &HeaderMap, now_ms: i64) -> Option<i64> {
    ["requests", "tokens", "input-tokens", "output-tokens"]
        .iter()
        .filter(|k| header_str(h, &format!("anthropic-ratelimit-{k}-remaining")) == Some("0"))
        .filter_map(|k| {
            let at: jiff::Timestamp = header_str(h, &format!("anthropic-ratelimit-{k}-reset"))?
                .parse()
                .ok()?;
            Some((at.as_millisecond() - now_ms).max(0))
        })
        .max()
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// A Go `time.Duration` string: `1s`, `6m0s`, `20ms`, `1h2m3.5s`, `250us`.
pub fn parse_go_duration(s: &str) -> Option<i64> {
    let mut rest = s;
    let mut total_ms = 0f64;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|&i| i > 0)?;
        let n: f64 = rest[..num_end].parse().ok()?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "h" => 3_600_000.0,
            "m" => 60_000.0,
            "s" => 1000.0,
            "ms" => 1.0,
            "us" | "µs" => 0.001,
            "ns" => 0.000_001,
            _ => return None,
        };
        total_ms += n * scale;
        rest = &rest[unit_end..];
    }
    (total_ms.is_finite() && total_ms >= 0.0).then(|| total_ms.ceil() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn precedence_and_forms() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("7"));
        assert_eq!(from_headers(&h, 0), Some(7000));
        h.insert("retry-after-ms", HeaderValue::from_static("1500"));
        assert_eq!(from_headers(&h, 0), Some(1500), "retry-after-ms wins");
        assert_eq!(parse_retry_after("2.5", 0), Some(2500));
        assert_eq!(parse_retry_after("-1", 0), None);
        assert_eq!(parse_retry_after("soon", 0), None);
    }

    #[test]
    fn http_dates() {
        let now = 784_111_777_000 - 30_000; // 30 s before Sun, 06 Nov 1994 08:49:37 GMT
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now),
            Some(30_000)
        );
        assert_eq!(
            parse_retry_after("Sunday, 06-Nov-94 08:49:37 GMT", now),
            Some(30_000)
        );
        assert_eq!(
            parse_retry_after("Sun Nov  6 08:49:37 1994", now),
            Some(30_000)
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now + 60_000),
            Some(0)
        );
    }

    #[test]
    fn provider_rate_limit_headers() {
        assert_eq!(parse_go_duration("1s"), Some(1000));
        assert_eq!(parse_go_duration("6m0s"), Some(360_000));
        assert_eq!(parse_go_duration("20ms"), Some(20));
        assert_eq!(parse_go_duration("1h2m3.5s"), Some(3_723_500));
        assert_eq!(parse_go_duration("soon"), None);
        assert_eq!(parse_go_duration(""), None);

        let mut h = HeaderMap::new();
        h.insert(
            "x-ratelimit-remaining-requests",
            HeaderValue::from_static("12"),
        );
        h.insert("x-ratelimit-reset-requests", HeaderValue::from_static("1s"));
        h.insert(
            "x-ratelimit-remaining-tokens",
            HeaderValue::from_static("0"),
        );
        h.insert("x-ratelimit-reset-tokens", HeaderValue::from_static("6m0s"));
        assert_eq!(
            from_openai_ratelimit(&h),
            Some(360_000),
            "only the exhausted limit"
        );
        h.insert(
            "x-ratelimit-remaining-tokens",
            HeaderValue::from_static("5"),
        );
        assert_eq!(
            from_openai_ratelimit(&h),
            None,
            "nothing exhausted: no delay"
        );

        let mut h = HeaderMap::new();
        h.insert(
            "anthropic-ratelimit-tokens-remaining",
            HeaderValue::from_static("0"),
        );
        h.insert(
            "anthropic-ratelimit-tokens-reset",
            HeaderValue::from_static("2026-11-30T12:00:30Z"),
        );
        h.insert(
            "anthropic-ratelimit-requests-remaining",
            HeaderValue::from_static("3"),
        );
        h.insert(
            "anthropic-ratelimit-requests-reset",
            HeaderValue::from_static("2026-11-30T12:05:00Z"),
        );
        let now = "2026-11-30T12:00:00Z"
            .parse::<jiff::Timestamp>()
            .unwrap()
            .as_millisecond();
        assert_eq!(from_anthropic_ratelimit(&h, now), Some(30_000));

        let mut h = HeaderMap::new();
        h.insert("x-ms-retry-after-ms", HeaderValue::from_static("750"));
        assert_eq!(from_azure_header(&h), Some(750));
    }

    #[test]
    fn gemini_retry_info() {
        let body = br#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","details":[
            {"@type":"type.googleapis.com/google.rpc.QuotaFailure"},
            {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"45.8s"}]}}"#;
        assert_eq!(from_gemini_body(body), Some(45_800));
        assert_eq!(from_gemini_body(b"not json"), None);
    }
}
