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
/// `checked`: the usage object as read when the answer was checked (`Some`: the body is not
/// searched for it again); `None`: not checked, so it is read from the body here.
pub(super) fn buffered_usage(
    b: &Bytes,
    checked: Option<Option<StreamUsage>>,
    est: &Estimate,
    tok: crate::policy::Tokenizer,
) -> (Usage, UsageEvidence) {
    let read = checked.unwrap_or_else(|| {
        serde_json::from_slice::<UsageOnly>(b)
            .ok()
            .and_then(|u| u.usage)
    });
    if let Some(u) = read.and_then(|u| u.to_usage()) {
        return (u, UsageEvidence::Actual);
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
