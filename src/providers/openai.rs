//! OpenAI and every OpenAI-compatible server (Ollama's `/v1`, Gemini's `/openai`, vLLM, …):
//! the client's body goes through with this attempt's model, output cap and stream options,
//! serialized without copying the (possibly large) rest of it; answers pass through unchanged.

use super::{
    join, key_header, BuildCtx, Envelope, NativeRequest, Provider, StreamTranslator, Untranslatable,
};
use crate::estimate::Endpoint;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::Value;

#[derive(Debug, Clone, Copy)]
pub struct OpenAi;

struct Rewritten<'a> {
    body: &'a serde_json::Map<String, Value>,
    model: &'a str,
    cap: Option<(&'static str, u64)>,
    include_usage: bool,
}

impl Serialize for Rewritten<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        let cap_key = self.cap.map(|(k, _)| k);
        for (k, v) in self.body {
            match k.as_str() {
                "model" => continue,
                "max_tokens" | "max_completion_tokens" if cap_key.is_some() => continue,
                "stream_options" if self.include_usage => continue,
                _ => m.serialize_entry(k, v)?,
            }
        }
        m.serialize_entry("model", self.model)?;
        if let Some((k, v)) = self.cap {
            m.serialize_entry(k, &v)?;
        }
        if self.include_usage {
            let mut opts = self
                .body
                .get("stream_options")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            opts.insert("include_usage".into(), Value::Bool(true));
            m.serialize_entry("stream_options", &opts)?;
        }
        m.end()
    }
}

fn path_of(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Chat => "/chat/completions",
        Endpoint::Completions => "/completions",
        Endpoint::Embeddings => "/embeddings",
    }
}

impl Provider for OpenAi {
    /// Gemini's OpenAI-compatible endpoint is a `kind: openai` backend: its error bodies
    /// (wrapped in a one-element array) carry `RetryInfo` and per-day quotas.
    fn error_hint(&self, status: u16, body: &[u8], now_ms: i64) -> super::ErrorHint {
        super::gemini::error_hint(status, body, now_ms)
    }

    fn translates_answers(&self) -> bool {
        false
    }

    fn supports(&self, _endpoint: Endpoint) -> bool {
        true
    }

    fn auth_headers(&self, key: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        key_header("authorization", &format!("Bearer {key}"))
    }

    fn request(&self, c: &BuildCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        let cap = match c.endpoint {
            Endpoint::Embeddings => None,
            // Keep the client's spelling; send the cap even when the client set none, so the
            // reserved worst case is a bound the provider enforces.
            Endpoint::Chat if c.body.contains_key("max_completion_tokens") => {
                Some(("max_completion_tokens", c.max_output_tokens))
            }
            _ => Some(("max_tokens", c.max_output_tokens)),
        };
        let body = serde_json::to_vec(&Rewritten {
            body: c.body,
            model: c.model,
            cap,
            include_usage: c.add_include_usage,
        })
        .map_err(|e| Untranslatable(e.to_string()))?;
        Ok(NativeRequest {
            url: join(c.base_url, path_of(c.endpoint)),
            body,
        })
    }

    fn header_delay(&self, headers: &http::HeaderMap, now_ms: i64) -> Option<i64> {
        super::retry_after::from_headers(headers, now_ms)
            .or_else(|| super::retry_after::from_azure_header(headers))
            .or_else(|| super::retry_after::from_openai_ratelimit(headers))
    }

    fn response(&self, _body: &[u8], _env: &Envelope) -> Result<Option<Bytes>, String> {
        Ok(None)
    }

    fn stream(&self, _env: Envelope) -> Option<Box<dyn StreamTranslator>> {
        None
    }
}
