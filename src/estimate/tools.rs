//! What tool and function definitions add to a chat prompt.
//!
//! OpenAI renders `tools` (and the legacy `functions`) into a hidden system preamble that is
//! billed as prompt tokens. We follow the OpenAI cookbook's `num_tokens_for_tools`, which was
//! fitted against gpt-4o/gpt-4o-mini:
//!
//! ```text
//! per function:  7 (func_init) + tokens("{name}:{description}")       # trailing '.' dropped
//!   if it has properties: 3 (prop_init), then per property:
//!       3 (prop_key) + tokens("{key}:{type}:{description}")           # trailing '.' dropped
//!       if it has an enum: -3 (enum_init) + per item 3 (enum_item) + tokens(item)
//! once, if any functions: 12 (func_end)
//! ```
//!
//! The cookbook ignores nested schemas. So that a deep schema cannot slip through as nearly
//! free, every property key other than `type`, `description` and `enum` (nested `properties`,
//! `items`, `anyOf`, `format`, ...) adds the tokens of its compact JSON serialization, and a
//! tool that is not a function definition at all (a hosted or custom tool) is counted as the
//! tokens of its whole JSON. Exact for flat schemas; an over-estimate for nested ones.

use super::count::{count_text, json_tokens};
use super::error::{EstimateError, Param};
use crate::estimate::Tokenizer;
use serde_json::{Map, Value};

const FUNC_INIT: i64 = 7;
const PROP_INIT: i64 = 3;
const PROP_KEY: i64 = 3;
const ENUM_INIT: i64 = -3;
const ENUM_ITEM: i64 = 3;
const FUNC_END: i64 = 12;

/// Prompt tokens added by `tools` and `functions` in a chat body (0 when neither is present).
pub(crate) fn tools_tokens(
    tok: Tokenizer,
    body: &Map<String, Value>,
) -> Result<u64, EstimateError> {
    let mut total: i64 = 0;
    let mut any = false;
    for key in ["tools", "functions"] {
        let list = match body.get(key) {
            None | Some(Value::Null) => continue,
            Some(Value::Array(list)) => list,
            Some(_) => return Err(EstimateError::wrong_type(key, "an array of tool objects")),
        };
        let list_param = Param::root(key);
        for (i, item) in list.iter().enumerate() {
            let param = list_param.index(i);
            let Value::Object(obj) = item else {
                return Err(EstimateError::wrong_type(param, "an object"));
            };
            // `tools` wraps the definition in `{"type":"function","function":{..}}`;
            // `functions` (and the Responses-style flat tool) put it at the top level.
            let def = match obj.get("function") {
                Some(Value::Object(f)) => Some(f),
                Some(_) => {
                    return Err(EstimateError::wrong_type(
                        param.key("function"),
                        "an object",
                    ))
                }
                None if obj.contains_key("name") => Some(obj),
                None => None,
            };
            total = total.saturating_add(match def {
                Some(f) => function_tokens(tok, f),
                None => saturating_i64(json_tokens(tok, item)),
            });
            any = true;
        }
    }
    if any {
        total = total.saturating_add(FUNC_END);
    }
    Ok(u64::try_from(total).unwrap_or(0))
}

/// One function definition, cookbook-style.
fn function_tokens(tok: Tokenizer, f: &Map<String, Value>) -> i64 {
    let name = str_or_json(f.get("name"));
    let desc = str_or_json(f.get("description"));
    let mut n = FUNC_INIT.saturating_add(count_i64(tok, &format!("{name}:{}", trim_period(&desc))));

    let props = f
        .get("parameters")
        .and_then(Value::as_object)
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object);
    if let Some(props) = props.filter(|p| !p.is_empty()) {
        n = n.saturating_add(PROP_INIT);
        for (key, prop) in props {
            n = n
                .saturating_add(PROP_KEY)
                .saturating_add(property_tokens(tok, key, prop));
        }
    }
    n
}

/// One property of a function's parameter schema.
fn property_tokens(tok: Tokenizer, key: &str, prop: &Value) -> i64 {
    let Value::Object(prop) = prop else {
        // `"x": true` and similar schema shorthands: the key plus whatever the value spells.
        return count_i64(tok, key).saturating_add(saturating_i64(json_tokens(tok, prop)));
    };
    let ty = str_or_json(prop.get("type"));
    let desc = str_or_json(prop.get("description"));
    let mut n = count_i64(tok, &format!("{key}:{ty}:{}", trim_period(&desc)));
    if let Some(Value::Array(items)) = prop.get("enum") {
        n = n.saturating_add(ENUM_INIT);
        for item in items {
            n = n
                .saturating_add(ENUM_ITEM)
                .saturating_add(saturating_i64(json_tokens(tok, item)));
        }
    }
    for (k, v) in prop {
        if !matches!(k.as_str(), "type" | "description" | "enum") {
            let extra = count_text(tok, k).saturating_add(json_tokens(tok, v));
            n = n.saturating_add(saturating_i64(extra));
        }
    }
    n
}

/// A string field as-is, anything else (a `type` list, a number) as its JSON text, absent as "".
fn str_or_json(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

fn trim_period(s: &str) -> &str {
    s.strip_suffix('.').unwrap_or(s)
}

fn count_i64(tok: Tokenizer, s: &str) -> i64 {
    saturating_i64(count_text(tok, s))
}

fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
