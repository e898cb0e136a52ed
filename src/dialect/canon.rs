//! The internal answer and stream events every dialect renders from: read once from the
//! OpenAI-shaped answer the governed path produces (whichever provider served it).

use serde_json::Value;

/// Token usage as the client sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub input: u64,
    pub output: u64,
    /// Of the input, read from a cache.
    pub cached: Option<u64>,
}

impl Usage {
    fn from_openai(u: &Value) -> Option<Usage> {
        let input = u.get("prompt_tokens").and_then(Value::as_u64)?;
        let completion = u
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        // Some providers count thinking only in the total: output is never less than that.
        let total = u.get("total_tokens").and_then(Value::as_u64).unwrap_or(0);
        Some(Usage {
            input,
            output: completion.max(total.saturating_sub(input)),
            cached: u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64),
        })
    }
}

/// One tool call of an answer; `arguments` is the JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// A buffered answer: the first choice of a chat completion (or a completion's text).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    /// OpenAI's `finish_reason` (`stop`, `length`, `tool_calls`, `content_filter`).
    pub finish: String,
    pub usage: Option<Usage>,
    /// Embedding vectors, in order (embeddings answers).
    pub embeddings: Vec<Value>,
}

impl Answer {
    /// Reads an OpenAI chat completion, completion or embeddings list.
    pub fn from_openai(b: &[u8]) -> Result<Answer, String> {
        let v: Value = serde_json::from_slice(b).map_err(|e| format!("unreadable answer: {e}"))?;
        let mut a = Answer {
            usage: v.get("usage").and_then(Usage::from_openai),
            ..Answer::default()
        };
        if let Some(data) = v.get("data").and_then(Value::as_array) {
            a.embeddings = data
                .iter()
                .map(|d| d.get("embedding").cloned().unwrap_or(Value::Null))
                .collect();
            return Ok(a);
        }
        let Some(c) = v.pointer("/choices/0") else {
            return Ok(a);
        };
        a.finish = c
            .get("finish_reason")
            .and_then(Value::as_str)
            .unwrap_or("stop")
            .to_string();
        if let Some(t) = c.get("text").and_then(Value::as_str) {
            a.text = t.to_string();
        }
        if let Some(m) = c.get("message") {
            a.text = crate::providers::content_text(m.get("content"));
            for tc in m
                .get("tool_calls")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                a.tool_calls.push(ToolCall {
                    id: str_at(tc, "/id").to_string(),
                    name: str_at(tc, "/function/name").to_string(),
                    arguments: str_at(tc, "/function/arguments").to_string(),
                });
            }
        }
        Ok(a)
    }
}

fn str_at<'a>(v: &'a Value, p: &str) -> &'a str {
    v.pointer(p).and_then(Value::as_str).unwrap_or("")
}

/// One internal stream event (from an OpenAI `chat.completion.chunk` of choice 0).
#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    Text(&'a str),
    /// A tool call begins (OpenAI sends its id and name first).
    ToolStart {
        index: u64,
        id: &'a str,
        name: &'a str,
    },
    /// More of a tool call's arguments (JSON text, split anywhere).
    ToolArgs {
        index: u64,
        args: &'a str,
    },
    Finish(&'a str),
    Usage(Usage),
    /// The stream failed (an upstream error, a guard stop): the message.
    Error(&'a str),
    /// `[DONE]`: the stream completed.
    Done,
}

/// Reads OpenAI SSE event data into [`Event`]s.
#[derive(Debug, Default)]
pub struct EventParser;

impl EventParser {
    /// Calls `f` with each event in one SSE event's data.
    pub fn events(data: &[u8], mut f: impl FnMut(Event<'_>)) {
        if data == b"[DONE]" {
            return f(Event::Done);
        }
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        if let Some(e) = v.get("error") {
            let msg = e
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("the upstream stream failed");
            return f(Event::Error(msg));
        }
        if let Some(c) = v.pointer("/choices/0") {
            if let Some(d) = c.get("delta") {
                if let Some(t) = d.get("content").and_then(Value::as_str) {
                    if !t.is_empty() {
                        f(Event::Text(t));
                    }
                }
                for tc in d
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let index = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
                    if let Some(name) = tc.pointer("/function/name").and_then(Value::as_str) {
                        f(Event::ToolStart {
                            index,
                            id: str_at(tc, "/id"),
                            name,
                        });
                    }
                    if let Some(a) = tc.pointer("/function/arguments").and_then(Value::as_str) {
                        if !a.is_empty() {
                            f(Event::ToolArgs { index, args: a });
                        }
                    }
                }
            } else if let Some(t) = c.get("text").and_then(Value::as_str) {
                if !t.is_empty() {
                    f(Event::Text(t));
                }
            }
            if let Some(r) = c.get("finish_reason").and_then(Value::as_str) {
                f(Event::Finish(r));
            }
        }
        if let Some(u) = v.get("usage").and_then(Usage::from_openai) {
            f(Event::Usage(u));
        }
    }
}
