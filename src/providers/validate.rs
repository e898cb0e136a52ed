//! Is a 2xx answer the one that was asked for? An HTML error page, an empty body or a 204
//! served with a 200-class status is the upstream's failure (tollgate falls back as for a
//! 5xx), never an `ALLOW/OK` answer.

use crate::estimate::Endpoint;
use crate::stream::StreamUsage;
use http::{header, HeaderMap, StatusCode};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;

#[derive(Deserialize)]
struct Shape<'a> {
    #[serde(default)]
    choices: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    data: Option<Vec<IgnoredAny>>,
    /// Kept raw: a malformed usage object does not make the answer malformed.
    #[serde(default, borrow)]
    usage: Option<&'a RawValue>,
}

/// A buffered OpenAI-shaped answer: a JSON object with `choices` (chat, completions) or
/// `data` (embeddings).
pub fn openai_answer_ok(endpoint: Endpoint, body: &[u8]) -> bool {
    openai_answer(endpoint, body).is_some()
}

/// [`openai_answer_ok`], in the same pass reading the answer's `usage` object (`Some(None)`:
/// the answer is fine but has no readable usage), so the answer is parsed once.
pub fn openai_answer(endpoint: Endpoint, body: &[u8]) -> Option<Option<StreamUsage>> {
    let s = serde_json::from_slice::<Shape<'_>>(body).ok()?;
    let ok = match endpoint {
        Endpoint::Embeddings => s.data.is_some(),
        Endpoint::Chat | Endpoint::Completions => s.choices.is_some(),
    };
    ok.then(|| s.usage.and_then(|u| serde_json::from_str(u.get()).ok()))
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
        // The usage is read in the same pass; a malformed one leaves the answer valid.
        let u = openai_answer(
            Endpoint::Chat,
            br#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#,
        );
        assert_eq!(u.unwrap().unwrap().completion_tokens, Some(4));
        assert_eq!(
            openai_answer(Endpoint::Chat, br#"{"choices":[],"usage":"lots"}"#),
            Some(None)
        );
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
