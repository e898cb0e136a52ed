//! Pre-flight token estimates for OpenAI-style request bodies.
//!
//! Before a request is forwarded the governor must know what it could cost, and all it has is
//! the body. This module reads the cost-relevant fields of a Chat Completions, legacy
//! Completions or Embeddings body (`model`, the prompt, the output cap, `n`, `stream`,
//! `stream_options.include_usage`), counts the prompt in tokens with the configured tokenizer,
//! and rejects bodies it cannot price with an error fit for the client. It never guesses a
//! default output cap: that is policy (`EstimateCfg::default_max_output_tokens`), applied by
//! the caller when [`Estimate::max_output_tokens`] is `None`.
//!
//! Counting rules are in the submodules: [`count`] (text → tokens, with its fast paths in
//! `pretok`, its vocabulary in `ranks` and `tables`), `chat` (messages, the OpenAI cookbook rule), [`images`] (image
//! parts), `tools` (tool definitions), `prompt` (completions prompts and embeddings inputs).
//! Counts are exact tiktoken counts; the fast paths exist because every request pays for its
//! estimate before it is forwarded (see `benches/estimate.rs`).

mod chat;
pub mod count;
mod error;
pub mod images;
mod memo;
mod plain;
mod pretok;
mod prompt;
mod ranks;
mod tables;
mod tools;
mod vocab;

#[cfg(test)]
mod tests;

/// Which token counter estimates a request (`estimate.tokenizer` in a policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tokenizer {
    O200k,
    Cl100k,
    Chars,
}
pub use chat::{REPLY_PRIMING_TOKENS, TOKENS_PER_MESSAGE, TOKENS_PER_NAME};
pub use count::{
    count_output_text, count_text, offload_whole, warm_up, warm_up_for, with_spare_words,
};
pub use error::EstimateError;
pub use plain::{chat as chat_plain, Member, Plain};

use serde_json::{Map, Value};

/// Which OpenAI-style endpoint a body was sent to; decides which fields are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions` (legacy)
    Completions,
    /// `POST /v1/embeddings`
    Embeddings,
}

/// What a request body asks for, in tokens, before anything is sent upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Estimate {
    /// Estimated prompt tokens for the whole request (all prompts of a batch).
    pub input_tokens: u64,
    /// The client's output cap per choice: chat `max_completion_tokens`, else `max_tokens`;
    /// completions `max_tokens`; `None` when the client set none. Always `Some(0)` for
    /// embeddings, which produce no output tokens.
    pub max_output_tokens: Option<u64>,
    /// How many choices the provider generates and bills output for. Chat: `n` (default 1).
    /// Completions: `max(n, best_of)` times the number of prompts in a batch. Embeddings: 1.
    pub n: u32,
    /// `stream: true` was requested.
    pub stream: bool,
    /// `stream_options.include_usage: true` was requested (as sent; OpenAI only accepts it
    /// together with `stream: true`).
    pub include_usage: bool,
    /// The `model` field, verbatim.
    pub model: String,
}

/// Largest `n` OpenAI accepts.
pub const MAX_N: u64 = 128;

/// Estimates the cost-relevant shape of `body`, a request to `endpoint`, counting text with
/// `tok`. Fails on a body OpenAI would reject for a reason that also stops us pricing it.
pub fn estimate(
    endpoint: Endpoint,
    body: &Value,
    tok: Tokenizer,
) -> Result<Estimate, EstimateError> {
    let Value::Object(body) = body else {
        return Err(EstimateError::NotAnObject);
    };
    estimate_object(endpoint, body, tok)
}

/// [`estimate`] for a body already known to be a JSON object.
pub fn estimate_object(
    endpoint: Endpoint,
    body: &Map<String, Value>,
    tok: Tokenizer,
) -> Result<Estimate, EstimateError> {
    let model = model(body)?;
    match endpoint {
        Endpoint::Chat => {
            let input_tokens = chat::chat_input_tokens(tok, body)?;
            let max_completion = opt_uint(body, "max_completion_tokens")?;
            let max_tokens = opt_uint(body, "max_tokens")?;
            Ok(Estimate {
                input_tokens,
                max_output_tokens: max_completion.or(max_tokens),
                n: choices(body)?,
                stream: opt_bool(body, "stream")?,
                include_usage: include_usage(body)?,
                model,
            })
        }
        Endpoint::Completions => {
            let prompt = match body.get("prompt") {
                // OpenAI: "if prompt is not specified the model will generate as if from the
                // beginning of a new document", i.e. from a single `<|endoftext|>` token.
                None | Some(Value::Null) => prompt::PromptCount {
                    tokens: 1,
                    prompts: 1,
                },
                Some(p) => prompt::prompt_tokens(tok, p, "prompt")?,
            };
            let suffix = match body.get("suffix") {
                None | Some(Value::Null) => 0,
                Some(Value::String(s)) => count_text(tok, s),
                Some(_) => return Err(EstimateError::wrong_type("suffix", "a string")),
            };
            let n = choices(body)?;
            let best_of = match opt_uint(body, "best_of")? {
                Some(0) => {
                    return Err(EstimateError::out_of_range(
                        "best_of",
                        "a value of at least 1",
                        &Value::from(0),
                    ))
                }
                Some(b) => b,
                None => 1,
            };
            let per_prompt = u64::from(n).max(best_of);
            let total_choices = per_prompt.saturating_mul(prompt.prompts.max(1));
            // Every prompt of a batch gets the suffix.
            let suffix_total = suffix.saturating_mul(prompt.prompts.max(1));
            Ok(Estimate {
                input_tokens: prompt.tokens.saturating_add(suffix_total),
                max_output_tokens: opt_uint(body, "max_tokens")?,
                n: u32::try_from(total_choices).unwrap_or(u32::MAX),
                stream: opt_bool(body, "stream")?,
                include_usage: include_usage(body)?,
                model,
            })
        }
        Endpoint::Embeddings => {
            let input = match body.get("input") {
                None | Some(Value::Null) => return Err(EstimateError::missing("input")),
                Some(i) => prompt::prompt_tokens(tok, i, "input")?,
            };
            if input.prompts == 0 {
                return Err(EstimateError::out_of_range(
                    "input",
                    "a non-empty array",
                    &Value::Array(Vec::new()),
                ));
            }
            Ok(Estimate {
                input_tokens: input.tokens,
                max_output_tokens: Some(0),
                n: 1,
                stream: false,
                include_usage: false,
                model,
            })
        }
    }
}

/// `model`: a non-empty string.
fn model(body: &Map<String, Value>) -> Result<String, EstimateError> {
    match body.get("model") {
        None | Some(Value::Null) => Err(EstimateError::missing("model")),
        Some(Value::String(m)) if !m.is_empty() => Ok(m.clone()),
        Some(_) => Err(EstimateError::wrong_type("model", "a non-empty string")),
    }
}

/// An optional non-negative integer; `null` counts as absent.
fn opt_uint(body: &Map<String, Value>, key: &str) -> Result<Option<u64>, EstimateError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Number(n)) => match n.as_u64() {
            Some(u) => Ok(Some(u)),
            None if n.is_i64() => Err(EstimateError::out_of_range(
                key,
                "a non-negative integer",
                v,
            )),
            None => Err(EstimateError::wrong_type(key, "an integer")),
        },
        Some(_) => Err(EstimateError::wrong_type(key, "an integer")),
    }
}

/// `n`: 1..=128, default 1.
fn choices(body: &Map<String, Value>) -> Result<u32, EstimateError> {
    match opt_uint(body, "n") {
        Ok(None) => Ok(1),
        Ok(Some(n)) if (1..=MAX_N).contains(&n) => Ok(u32::try_from(n).unwrap_or(1)),
        Ok(Some(n)) => Err(EstimateError::out_of_range(
            "n",
            "a value between 1 and 128",
            &Value::from(n),
        )),
        Err(EstimateError::OutOfRange { got, .. }) => Err(EstimateError::OutOfRange {
            param: "n".to_owned(),
            expected: "a value between 1 and 128",
            got,
        }),
        Err(e) => Err(e),
    }
}

/// An optional boolean; `null` counts as `false`.
fn opt_bool(body: &Map<String, Value>, key: &str) -> Result<bool, EstimateError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(EstimateError::wrong_type(key, "a boolean")),
    }
}

/// `stream_options.include_usage`.
fn include_usage(body: &Map<String, Value>) -> Result<bool, EstimateError> {
    match body.get("stream_options") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Object(opts)) => match opts.get("include_usage") {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(EstimateError::wrong_type(
                "stream_options.include_usage",
                "a boolean",
            )),
        },
        Some(_) => Err(EstimateError::wrong_type("stream_options", "an object")),
    }
}
