//! OpenAI and every OpenAI-compatible server (Ollama's `/v1`, Gemini's `/openai`, vLLM, …):
//! the client's body goes through with this attempt's model, output cap and stream options,
//! serialized without copying the (possibly large) rest of it; answers pass through unchanged.

use super::splice::Edit;
use super::{
    join, key_header, BuildCtx, Envelope, NativeFormat, NativeRequest, PassCtx, Provider,
    RequestBody, Translator, Untranslatable,
};
use crate::estimate::Endpoint;
use crate::policy::Backend;
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

/// The client's bytes with the same edits [`Rewritten`] makes: the model, the cap (under one
/// of the two cap fields, the other removed) and the usage chunk asked for. Every other member
/// keeps the client's bytes and place.
fn spliced(
    raw: &[u8],
    body: &RequestBody,
    model: &str,
    cap: Option<(&'static str, u64)>,
    include_usage: bool,
) -> Result<Vec<u8>, Untranslatable> {
    let (model, yes) = (Value::from(model), Value::Bool(true));
    let capv = cap.map(|(_, v)| Value::from(v));
    let mut edits = [Edit::Set("model", &model); 4];
    let mut n = 1;
    if let (Some((key, _)), Some(v)) = (cap, &capv) {
        let other = if key == "max_tokens" {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        edits[1] = Edit::Set(key, v);
        edits[2] = Edit::Remove(other);
        n = 3;
    }
    if include_usage {
        edits[n] = Edit::SetIn("stream_options", "include_usage", &yes);
        n += 1;
    }
    // The members as the estimate's scan found them, when it did (a plain body).
    if let Some(m) = body.members_of(raw) {
        return Ok(super::splice::splice_members(&m, raw.len(), &edits[..n]));
    }
    super::splice::splice(raw, &edits[..n]).map_err(Untranslatable)
}

fn path_of(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Chat => "/chat/completions",
        Endpoint::Completions => "/completions",
        Endpoint::Embeddings => "/embeddings",
    }
}

/// The chat body field for the output cap: the chain entry's `output_cap_field` when set;
/// else `max_completion_tokens` for models that reject `max_tokens` (the o-series, gpt-5);
/// else the client's own spelling, `max_tokens` when it sent none (what every
/// OpenAI-compatible server understands).
fn chat_cap_field(c: &BuildCtx<'_>) -> &'static str {
    if let Some(f) = c.output_cap_field {
        return f.as_str();
    }
    if needs_max_completion_tokens(c.model) || c.body.has_max_completion_tokens() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    }
}

/// o1, o3, o4-mini, gpt-5, … (also behind a `vendor/` prefix, e.g. `openai/o3`).
pub fn needs_max_completion_tokens(model: &str) -> bool {
    let b = model.rsplit('/').next().unwrap_or(model).as_bytes();
    (b.len() >= 2 && b[0].eq_ignore_ascii_case(&b'o') && b[1].is_ascii_digit())
        || b.get(..5).is_some_and(|p| p.eq_ignore_ascii_case(b"gpt-5"))
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
        // Send the cap even when the client set none, so the reserved worst case is a bound
        // the provider enforces.
        let cap = match c.endpoint {
            Endpoint::Embeddings => None,
            Endpoint::Chat => Some((chat_cap_field(c), c.max_output_tokens)),
            Endpoint::Completions => Some(("max_tokens", c.max_output_tokens)),
        };
        let body = match c.raw {
            Some(raw) => spliced(raw, c.body, c.model, cap, c.add_include_usage)?,
            None => serde_json::to_vec(&Rewritten {
                body: c.body.map()?,
                model: c.model,
                cap,
                include_usage: c.add_include_usage,
            })
            .map_err(|e| Untranslatable(e.to_string()))?,
        };
        Ok(NativeRequest {
            url: join(c.base_url, path_of(c.endpoint)),
            body,
        })
    }

    /// The Responses API, on a backend that declares it (`responses_api: true`).
    fn speaks(&self, format: NativeFormat, backend: &Backend) -> bool {
        format == NativeFormat::OpenAiResponses && backend.responses_api
    }

    /// The cap is `max_output_tokens`; `response.completed` always carries the usage.
    fn pass_through(&self, c: &PassCtx<'_>) -> Result<NativeRequest, Untranslatable> {
        let (model, cap) = (Value::from(c.model), Value::from(c.max_output_tokens));
        c.native(
            "/responses",
            &[
                Edit::Set("model", &model),
                Edit::Set("max_output_tokens", &cap),
            ],
        )
    }

    fn pass_answer(
        &self,
        _format: NativeFormat,
        body: &[u8],
        env: &Envelope,
    ) -> Result<Bytes, String> {
        super::responses::internal_answer(body, env)
    }

    fn pass_stream(&self, _format: NativeFormat, env: Envelope) -> Option<Translator> {
        Some(super::responses::stream(env))
    }

    fn header_delay(&self, headers: &http::HeaderMap, now_ms: i64) -> Option<i64> {
        super::retry_after::from_headers(headers, now_ms)
            .or_else(|| super::retry_after::from_azure_header(headers))
            .or_else(|| super::retry_after::from_openai_ratelimit(headers))
    }

    fn response(&self, _body: &[u8], _env: &Envelope) -> Result<Option<Bytes>, String> {
        Ok(None)
    }

    fn stream(&self, _env: Envelope) -> Option<Translator> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::OutputCapField;
    use crate::providers::RequestBody;
    use serde_json::json;

    /// One attempt's body built both ways, from the parsed map and spliced from the client's
    /// bytes: the two must say the same.
    fn built(model: &str, raw: &str, field: Option<OutputCapField>, usage: bool) -> (Value, Value) {
        let body: serde_json::Map<String, Value> = serde_json::from_str(raw).expect("object");
        let body = RequestBody::from(body);
        let build = |raw: Option<&[u8]>| {
            let r = OpenAi
                .request(&BuildCtx {
                    base_url: "http://up",
                    endpoint: Endpoint::Chat,
                    body: &body,
                    raw,
                    model,
                    max_output_tokens: 77,
                    output_cap_field: field,
                    stream: usage,
                    add_include_usage: usage,
                })
                .expect("request");
            serde_json::from_slice::<Value>(&r.body).expect("json")
        };
        (build(None), build(Some(raw.as_bytes())))
    }

    fn sent(model: &str, body: Value, field: Option<OutputCapField>) -> Value {
        let (mapped, spliced) = built(model, &body.to_string(), field, false);
        assert_eq!(mapped, spliced);
        spliced
    }

    #[test]
    fn spliced_and_rewritten_bodies_agree() {
        for raw in [
            r#"{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":256}"#,
            r#"{"messages":[],"max_completion_tokens":9,"max_tokens":3,"temperature":0.5}"#,
            r#"{"messages":[],"stream":true,"stream_options":{"include_usage":false,"x":1}}"#,
            r#"{"messages":[],"stream":true,"stream_options":null}"#,
            r#"{"model":"a","messages":[{"role":"user","content":"long"}],"model":"b","messages":[]}"#,
            r#"{"messages":[],"max_tokens":1,"max_tokens":2000}"#,
            r#"{"m\u0065ssages":[{"role":"user","content":"\u00e9\n"}],"n":2}"#,
        ] {
            for usage in [false, true] {
                for field in [None, Some(OutputCapField::MaxCompletionTokens)] {
                    for model in ["llama", "o3"] {
                        let (mapped, spliced) = built(model, raw, field, usage);
                        assert_eq!(mapped, spliced, "{raw} usage={usage} {field:?} {model}");
                        assert_eq!(spliced["model"], model);
                        if usage {
                            assert_eq!(spliced["stream_options"]["include_usage"], true);
                        }
                    }
                }
            }
        }
    }

    /// A plain body spliced from the members its estimate found is, byte for byte, the body
    /// spliced from members found again.
    #[test]
    fn members_from_the_estimate_splice_as_members_found_again() {
        use crate::estimate::{chat_plain, Tokenizer};
        for raw in [
            r#"{"model":"chat","messages":[{"role":"user","content":"hi"}],"max_tokens":256}"#,
            r#" { "messages" : [ {"role":"user","content":"a\n\"b\""} ] , "model":"m", "x":{"y":[1,2]} , "max_completion_tokens": 5 } "#,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":false,"z":null},"seed":123456789012345678901234}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"metadata":{"a":1},"metadata":{"b":2},"temperature":0.50}"#,
        ] {
            let plain = chat_plain(raw.as_bytes(), Tokenizer::O200k).expect("a plain body");
            let bytes = Bytes::from(raw);
            let scanned = RequestBody::lazy(
                bytes.clone(),
                plain.max_completion_tokens_key,
                plain.members,
            );
            let found_again = RequestBody::from(
                serde_json::from_str::<serde_json::Map<String, Value>>(raw).unwrap(),
            );
            assert!(scanned.members_of(&bytes).is_some());
            // Not the same buffer: not used.
            assert!(scanned
                .members_of(raw.as_bytes().to_vec().as_slice())
                .is_none());
            for usage in [false, true] {
                for cap in [
                    None,
                    Some(("max_tokens", 7)),
                    Some(("max_completion_tokens", 9)),
                ] {
                    assert_eq!(
                        spliced(&bytes, &scanned, "up", cap, usage).unwrap(),
                        spliced(&bytes, &found_again, "up", cap, usage).unwrap(),
                        "{raw} {cap:?} {usage}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_spliced_body_keeps_the_clients_bytes() {
        // serde_json reads an integer past u64 as a float and would write it back changed.
        let raw = r#"{"model":"chat", "messages":[{"role":"user","content":"x"}], "temperature":1.50,"seed":123456789012345678901234,"max_tokens":5}"#;
        let body: serde_json::Map<String, Value> = serde_json::from_str(raw).unwrap();
        let body = RequestBody::from(body);
        let r = OpenAi
            .request(&BuildCtx {
                base_url: "http://up",
                endpoint: Endpoint::Chat,
                body: &body,
                raw: Some(raw.as_bytes()),
                model: "llama",
                max_output_tokens: 77,
                output_cap_field: None,
                stream: false,
                add_include_usage: false,
            })
            .unwrap();
        assert_eq!(
            std::str::from_utf8(&r.body).unwrap(),
            r#"{"model":"llama","messages":[{"role":"user","content":"x"}],"temperature":1.50,"seed":123456789012345678901234,"max_tokens":77}"#
        );
    }

    #[test]
    fn o_series_and_gpt5_get_max_completion_tokens() {
        let msgs = json!({"messages": [{"role": "user", "content": "x"}]});
        for m in [
            "o1",
            "o3-mini",
            "o4-mini",
            "gpt-5",
            "gpt-5-mini",
            "openai/o3",
            "O3",
        ] {
            let v = sent(m, msgs.clone(), None);
            assert_eq!(v["max_completion_tokens"], 77, "{m}: {v}");
            assert!(v.get("max_tokens").is_none(), "{m}: {v}");
        }
        // A client's legacy spelling is rewritten for them too (OpenAI rejects it).
        let v = sent("o3", json!({"messages": [], "max_tokens": 5000}), None);
        assert_eq!(v["max_completion_tokens"], 77, "{v}");
        assert!(v.get("max_tokens").is_none(), "{v}");
        for m in ["gpt-4o-mini", "llama3.1:8b", "ollama", "gpt-4.1", "omni"] {
            let v = sent(m, msgs.clone(), None);
            assert_eq!(v["max_tokens"], 77, "{m}: {v}");
            assert!(v.get("max_completion_tokens").is_none(), "{m}: {v}");
        }
    }

    #[test]
    fn the_chain_entry_setting_wins() {
        let msgs = json!({"messages": []});
        let v = sent(
            "my-reasoner",
            msgs.clone(),
            Some(OutputCapField::MaxCompletionTokens),
        );
        assert_eq!(v["max_completion_tokens"], 77, "{v}");
        assert!(v.get("max_tokens").is_none(), "{v}");
        let v = sent("o3", msgs, Some(OutputCapField::MaxTokens));
        assert_eq!(v["max_tokens"], 77, "{v}");
        assert!(v.get("max_completion_tokens").is_none(), "{v}");
    }
}
