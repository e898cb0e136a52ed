//! Is a 2xx answer the one that was asked for? An HTML error page, an empty body or a 204
//! served with a 200-class status is the upstream's failure (tollgate falls back as for a
//! 5xx), never an `ALLOW/OK` answer.

use crate::estimate::Endpoint;
use http::{header, HeaderMap, StatusCode};
use serde::de::IgnoredAny;
use serde::Deserialize;

#[derive(Deserialize)]
struct Shape {
    #[serde(default)]
    choices: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    data: Option<Vec<IgnoredAny>>,
}

/// A buffered OpenAI-shaped answer: a JSON object with `choices` (chat, completions) or
/// `data` (embeddings).
pub fn openai_answer_ok(endpoint: Endpoint, body: &[u8]) -> bool {
    match serde_json::from_slice::<Shape>(body) {
        Ok(s) => match endpoint {
            Endpoint::Embeddings => s.data.is_some(),
            Endpoint::Chat | Endpoint::Completions => s.choices.is_some(),
        },
        Err(_) => false,
    }
}

/// A streamed answer's head: not a 204, not declared empty, and typed as a stream (SSE or
/// NDJSON) when typed at all.
pub fn stream_head_ok(status: StatusCode, headers: &HeaderMap) -> bool {
    if status == StatusCode::NO_CONTENT {
        return false;
    }
    if headers
        .get(header::CONTENT_LENGTH)
        .is_some_and(|v| v.as_bytes() == b"0")
    {
        return false;
    }
    match headers.get(header::CONTENT_TYPE) {
        None => true,
        Some(v) => {
            let t = v.as_bytes().to_ascii_lowercase();
            let has = |n: &[u8]| t.windows(n.len()).any(|w| w == n);
            has(b"event-stream") || has(b"ndjson")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn buffered_answers_must_have_their_shape() {
        assert!(openai_answer_ok(Endpoint::Chat, br#"{"choices":[]}"#));
        assert!(openai_answer_ok(Endpoint::Embeddings, br#"{"data":[{}]}"#));
        assert!(!openai_answer_ok(
            Endpoint::Embeddings,
            br#"{"choices":[]}"#
        ));
        assert!(!openai_answer_ok(Endpoint::Chat, b""));
        assert!(!openai_answer_ok(Endpoint::Chat, b"<html>oops</html>"));
        assert!(!openai_answer_ok(Endpoint::Chat, b"{}"));
        assert!(!openai_answer_ok(Endpoint::Chat, b"[1]"));
    }

    #[test]
    fn stream_heads_must_be_streams() {
        let mut h = HeaderMap::new();
        assert!(stream_head_ok(StatusCode::OK, &h));
        assert!(!stream_head_ok(StatusCode::NO_CONTENT, &h));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html"));
        assert!(!stream_head_ok(StatusCode::OK, &h));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        assert!(stream_head_ok(StatusCode::OK, &h));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        );
        assert!(stream_head_ok(StatusCode::OK, &h));
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        assert!(!stream_head_ok(StatusCode::OK, &h));
    }
}
