//! The usage of a buffered answer: the provider's, else the sidecar's own count of its text.

use crate::estimate::{self, Estimate};
use crate::governor::{Usage, UsageEvidence};
use crate::stream::StreamUsage;
use bytes::Bytes;
use serde::Deserialize;

#[derive(Deserialize)]
struct UsageOnly {
    usage: Option<StreamUsage>,
}

#[derive(Deserialize)]
struct Choices {
    #[serde(default)]
    choices: Vec<Choice>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    message: Option<Message>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    content: Option<serde_json::Value>,
}

/// Usage of a buffered answer (in its internal, OpenAI form): the provider's, else the
/// sidecar's own count.
/// `read`: the usage object already read when the answer was checked (it is then not parsed
/// again).
pub(super) fn buffered_usage(
    b: &Bytes,
    read: Option<StreamUsage>,
    est: &Estimate,
    tok: crate::policy::Tokenizer,
) -> (Usage, UsageEvidence) {
    if let Some(u) = read.and_then(|u| u.to_usage()) {
        return (u, UsageEvidence::Actual);
    }
    if let Ok(UsageOnly { usage: Some(u) }) = serde_json::from_slice::<UsageOnly>(b) {
        if let Some(u) = u.to_usage() {
            return (u, UsageEvidence::Actual);
        }
    }
    let mut out = 0;
    if let Ok(c) = serde_json::from_slice::<Choices>(b) {
        for ch in c.choices {
            if let Some(t) = ch.text {
                out += estimate::count_output_text(tok, &t);
            }
            match ch.message.and_then(|m| m.content) {
                Some(serde_json::Value::String(s)) => out += estimate::count_output_text(tok, &s),
                Some(other) => out += estimate::count_output_text(tok, &other.to_string()),
                None => {}
            }
        }
    }
    (Usage::new(est.input_tokens, out), UsageEvidence::Estimated)
}
