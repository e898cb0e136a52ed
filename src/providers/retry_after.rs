//! Reads an upstream's "come back later" in all the spellings seen in practice, in the
//! precedence the official SDKs use: `retry-after-ms`, `retry-after` as (fractional) seconds,
//! `retry-after` as an HTTP-date, then Gemini's `RetryInfo.retryDelay` in a JSON error body.

use http::HeaderMap;

/// The delay in ms, if the response states one. `now_ms` resolves HTTP-dates.
pub fn from_headers(h: &HeaderMap, now_ms: i64) -> Option<i64> {
    if let Some(ms) = h.get("retry-after-ms").and_then(|v| v.to_str().ok()) {
        if let Ok(v) = ms.trim().parse::<f64>() {
            if v.is_finite() && v >= 0.0 {
                return Some(v.round() as i64);
            }
        }
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
    fn gemini_retry_info() {
        let body = br#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","details":[
            {"@type":"type.googleapis.com/google.rpc.QuotaFailure"},
            {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"45.8s"}]}}"#;
        assert_eq!(from_gemini_body(body), Some(45_800));
        assert_eq!(from_gemini_body(b"not json"), None);
    }
}
