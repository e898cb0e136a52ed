//! Prompt tokens of legacy Completions `prompt` and Embeddings `input`.
//!
//! Both fields take the same four shapes: a string, an array of strings (a batch), an array of
//! token ids (one pre-tokenized prompt), or an array of arrays of token ids (a batch of them).
//! Strings are encoded; token arrays count one token per element, whatever the tokenizer.
//! There is no per-item framing: the legacy endpoints bill exactly the encoded text.

use super::count::{count_text, to_u64};
use super::error::{EstimateError, Param};
use crate::estimate::Tokenizer;
use serde_json::Value;

/// Tokens in a `prompt`/`input` value and how many separate prompts it holds (a batch of `k`
/// prompts makes the provider generate `n` choices for each of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PromptCount {
    pub tokens: u64,
    /// 0 for an empty array; 1 for a string or a single token array.
    pub prompts: u64,
}

const EXPECTED: &str =
    "a string, an array of strings, an array of integers or an array of integer arrays";

/// Counts `value` (the field named `param`).
pub(crate) fn prompt_tokens(
    tok: Tokenizer,
    value: &Value,
    param: &str,
) -> Result<PromptCount, EstimateError> {
    let param = Param::root(param);
    let items = match value {
        Value::String(s) => {
            return Ok(PromptCount {
                tokens: count_text(tok, s),
                prompts: 1,
            })
        }
        Value::Array(items) => items,
        _ => return Err(EstimateError::wrong_type(param, EXPECTED)),
    };
    let Some(first) = items.first() else {
        return Ok(PromptCount {
            tokens: 0,
            prompts: 0,
        });
    };
    match first {
        Value::String(_) => {
            let mut tokens: u64 = 0;
            for (i, item) in items.iter().enumerate() {
                let Value::String(s) = item else {
                    return Err(EstimateError::wrong_type(param.index(i), "a string"));
                };
                tokens = tokens.saturating_add(count_text(tok, s));
            }
            Ok(PromptCount {
                tokens,
                prompts: to_u64(items.len()),
            })
        }
        Value::Number(_) => {
            check_token_ids(items, param)?;
            Ok(PromptCount {
                tokens: to_u64(items.len()),
                prompts: 1,
            })
        }
        Value::Array(_) => {
            let mut tokens: u64 = 0;
            for (i, item) in items.iter().enumerate() {
                let item_param = param.index(i);
                let Value::Array(ids) = item else {
                    return Err(EstimateError::wrong_type(
                        item_param,
                        "an array of integers",
                    ));
                };
                check_token_ids(ids, item_param)?;
                tokens = tokens.saturating_add(to_u64(ids.len()));
            }
            Ok(PromptCount {
                tokens,
                prompts: to_u64(items.len()),
            })
        }
        _ => Err(EstimateError::wrong_type(param, EXPECTED)),
    }
}

/// Every element must be a non-negative integer token id.
fn check_token_ids(ids: &[Value], param: Param<'_>) -> Result<(), EstimateError> {
    for (i, id) in ids.iter().enumerate() {
        match id {
            Value::Number(n) if n.is_u64() => {}
            Value::Number(_) => {
                return Err(EstimateError::out_of_range(
                    param.index(i),
                    "a non-negative integer token id",
                    id,
                ))
            }
            _ => return Err(EstimateError::wrong_type(param.index(i), "an integer")),
        }
    }
    Ok(())
}
