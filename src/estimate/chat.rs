//! Prompt tokens of a Chat Completions body.
//!
//! The OpenAI cookbook rule (`num_tokens_from_messages`): every message costs 3 tokens of
//! framing plus the encoded value of each of its fields (role included), a `name` costs 1 more,
//! and the reply is primed with 3 tokens. Fields are priced as follows:
//!
//! * `role`, `name`, `tool_call_id`, `refusal` and any other string field: encoded as text.
//! * `content`: a string, `null`, or an array of parts. `text`/`refusal` parts are encoded;
//!   `image_url` parts cost what [`super::images`] says; `input_audio`, `file` and unknown parts
//!   cost `ceil(json_chars / 4)` of the part, a deliberately conservative fallback (for base64
//!   audio this is far above the real audio-token count).
//! * `tool_calls`: each call's `function.name` and `function.arguments` are encoded (a call of
//!   another kind falls back to its JSON length); legacy `function_call` likewise.
//! * any other non-string field: the JSON-length fallback.
//!
//! Tool definitions are added by [`super::tools`]; a `response_format` JSON schema adds the
//! tokens of its compact JSON.

use super::count::{count_text, json_fallback_tokens, json_tokens};
use super::error::{EstimateError, Param};
use super::images::image_part_tokens;
use super::tools::tools_tokens;
use crate::estimate::Tokenizer;
use serde_json::{Map, Value};

/// Framing tokens per message.
pub const TOKENS_PER_MESSAGE: u64 = 3;
/// Extra tokens when a message carries a `name`.
pub const TOKENS_PER_NAME: u64 = 1;
/// Tokens priming the assistant's reply, once per request.
pub const REPLY_PRIMING_TOKENS: u64 = 3;

/// All prompt tokens of a chat body: messages, reply priming, tools, response schema.
pub(crate) fn chat_input_tokens(
    tok: Tokenizer,
    body: &Map<String, Value>,
) -> Result<u64, EstimateError> {
    let messages = match body.get("messages") {
        None | Some(Value::Null) => return Err(EstimateError::missing("messages")),
        Some(Value::Array(m)) => m,
        Some(_) => {
            return Err(EstimateError::wrong_type(
                "messages",
                "an array of message objects",
            ))
        }
    };
    if messages.is_empty() {
        return Err(EstimateError::out_of_range(
            "messages",
            "a non-empty array",
            &Value::Array(Vec::new()),
        ));
    }
    let mut total = REPLY_PRIMING_TOKENS;
    for (i, message) in messages.iter().enumerate() {
        total = total.saturating_add(message_tokens(tok, message, i)?);
    }
    total = total.saturating_add(tools_tokens(tok, body)?);
    total = total.saturating_add(response_format_tokens(tok, body));
    Ok(total)
}

/// One message, including its 3 framing tokens.
fn message_tokens(tok: Tokenizer, message: &Value, index: usize) -> Result<u64, EstimateError> {
    let messages = Param::root("messages");
    let param = messages.index(index);
    let Value::Object(message) = message else {
        return Err(EstimateError::wrong_type(param, "an object"));
    };
    match message.get("role") {
        Some(Value::String(_)) => {}
        None | Some(Value::Null) => return Err(EstimateError::missing(param.key("role"))),
        Some(_) => return Err(EstimateError::wrong_type(param.key("role"), "a string")),
    }
    let mut n = TOKENS_PER_MESSAGE;
    for (key, value) in message {
        let field = match (key.as_str(), value) {
            (_, Value::Null) => 0,
            ("content", v) => content_tokens(tok, v, param.key("content"))?,
            ("name", Value::String(s)) => count_text(tok, s).saturating_add(TOKENS_PER_NAME),
            ("tool_calls", v) => tool_calls_tokens(tok, v, param.key("tool_calls"))?,
            ("function_call", Value::Object(call)) => function_call_tokens(tok, call, value),
            (_, Value::String(s)) => count_text(tok, s),
            ("name" | "tool_call_id", _) => {
                return Err(EstimateError::wrong_type(param.key(key), "a string"))
            }
            (_, other) => json_fallback_tokens(other),
        };
        n = n.saturating_add(field);
    }
    Ok(n)
}

/// A message's `content`: string, or array of typed parts.
fn content_tokens(tok: Tokenizer, content: &Value, param: Param<'_>) -> Result<u64, EstimateError> {
    let parts = match content {
        Value::Null => return Ok(0),
        Value::String(s) => return Ok(count_text(tok, s)),
        Value::Array(parts) => parts,
        _ => {
            return Err(EstimateError::wrong_type(
                param,
                "a string or an array of content parts",
            ))
        }
    };
    let mut n: u64 = 0;
    for (i, part) in parts.iter().enumerate() {
        let part_param = param.index(i);
        let Value::Object(obj) = part else {
            return Err(EstimateError::wrong_type(
                part_param,
                "a content part object",
            ));
        };
        let kind = match obj.get("type") {
            Some(Value::String(kind)) => kind.as_str(),
            None | Some(Value::Null) => return Err(EstimateError::missing(part_param.key("type"))),
            Some(_) => {
                return Err(EstimateError::wrong_type(
                    part_param.key("type"),
                    "a string",
                ))
            }
        };
        let cost = match kind {
            "text" | "refusal" => match obj.get(kind) {
                Some(Value::String(s)) => count_text(tok, s),
                None | Some(Value::Null) => {
                    return Err(EstimateError::missing(part_param.key(kind)))
                }
                Some(_) => return Err(EstimateError::wrong_type(part_param.key(kind), "a string")),
            },
            "image_url" => image_part_tokens(obj, part_param)?,
            _ => json_fallback_tokens(part),
        };
        n = n.saturating_add(cost);
    }
    Ok(n)
}

/// An assistant message's `tool_calls`.
fn tool_calls_tokens(
    tok: Tokenizer,
    calls: &Value,
    param: Param<'_>,
) -> Result<u64, EstimateError> {
    let Value::Array(calls) = calls else {
        return Err(EstimateError::wrong_type(param, "an array of tool calls"));
    };
    let mut n: u64 = 0;
    for (i, call) in calls.iter().enumerate() {
        let cost = match call {
            Value::Object(obj) => match obj.get("function") {
                Some(Value::Object(f)) => function_call_tokens(tok, f, call),
                _ => json_fallback_tokens(call),
            },
            _ => return Err(EstimateError::wrong_type(param.index(i), "an object")),
        };
        n = n.saturating_add(cost);
    }
    Ok(n)
}

/// `{"name":..,"arguments":..}` of a tool call or legacy function call; `whole` is the
/// enclosing value, priced by its JSON length if the name or arguments are not strings.
fn function_call_tokens(tok: Tokenizer, f: &Map<String, Value>, whole: &Value) -> u64 {
    match (f.get("name"), f.get("arguments")) {
        (Some(Value::String(name)), Some(Value::String(args))) => {
            count_text(tok, name).saturating_add(count_text(tok, args))
        }
        (Some(Value::String(name)), None | Some(Value::Null)) => count_text(tok, name),
        _ => json_fallback_tokens(whole),
    }
}

/// `response_format: {"type":"json_schema","json_schema":{..}}` puts the schema in the prompt.
fn response_format_tokens(tok: Tokenizer, body: &Map<String, Value>) -> u64 {
    body.get("response_format")
        .and_then(|rf| rf.get("json_schema"))
        .filter(|schema| !schema.is_null())
        .map_or(0, |schema| json_tokens(tok, schema))
}
