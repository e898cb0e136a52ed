//! The estimate of a plain chat body, read straight from its bytes: no `serde_json::Value`
//! tree is built (its maps, keys and strings were ~8,500 instructions of a small request's
//! ~105,000, more than the whole estimate).
//!
//! Exact only where it answers, like the answer scan: the body is scanned with the grammar
//! serde_json applies when it decodes a body into a `Value` ([`crate::jscan`] in its decoded
//! mode), and an estimate is given only for the plain shape: an object whose `model` is a
//! non-empty string, whose `messages` are objects of string (or `null`) fields with a `role`,
//! and whose `max_tokens`, `max_completion_tokens`, `n`, `stream` and `stream_options` are
//! plain. Anything else (tools, a response schema, content parts, a duplicate key, a `\u`
//! escape, a number with an exponent, a value out of range, any error) gives up (`None`), and
//! the caller takes the `Value` path, which then prices or refuses the body. So a body answered
//! here is one serde accepts, with the same estimate (a differential test checks this on many
//! mutated bodies).

use super::chat::{REPLY_PRIMING_TOKENS, TOKENS_PER_MESSAGE, TOKENS_PER_NAME};
use super::count::count_text;
use super::{Estimate, Tokenizer, MAX_N};
use crate::jscan::P;

/// A plain chat body's estimate, whether it has a top-level `max_completion_tokens` key (an
/// OpenAI request then keeps that name for its cap), and where its top-level members are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plain {
    pub est: Estimate,
    pub max_completion_tokens_key: bool,
    /// Each top-level member's key (its text between the quotes, without escapes) and value
    /// (its raw text), as byte ranges of the body, in order; `None` past [`MAX_MEMBERS`]. An
    /// OpenAI request is spliced from them without finding them again.
    pub members: Option<Vec<Member>>,
}

/// A member's key and value, as byte ranges of the body.
pub type Member = (std::ops::Range<usize>, std::ops::Range<usize>);

/// Most top-level members recorded (a body has a dozen or so; a hostile one may have many).
pub const MAX_MEMBERS: usize = 64;

/// The top-level keys read here; a second one of them gives up (serde keeps the last).
#[derive(Clone, Copy)]
enum Key {
    Model,
    Messages,
    MaxTokens,
    MaxCompletionTokens,
    N,
    Stream,
    StreamOptions,
}

/// Estimates a chat body given as bytes; `None`: not a plain body (see the module's notes).
pub fn chat(raw: &[u8], tok: Tokenizer) -> Option<Plain> {
    // Every string of a valid UTF-8 body is valid UTF-8, and a body that is not has its bad
    // bytes in a string (outside them only ASCII is grammar), which serde would refuse.
    let text = std::str::from_utf8(raw).ok()?;
    let mut p = P {
        b: raw,
        i: 0,
        decoded: true,
    };
    let mut seen = [false; 7];
    let mut model = None;
    let mut input = None;
    let (mut max_tokens, mut max_completion, mut n) = (None, None, None);
    let (mut stream, mut include_usage) = (false, false);
    // The members' values, read by key.
    let mut read = |p: &mut P<'_>, k: &[u8]| -> Option<()> {
        let key = match k {
            b"model" => Key::Model,
            b"messages" => Key::Messages,
            b"max_tokens" => Key::MaxTokens,
            b"max_completion_tokens" => Key::MaxCompletionTokens,
            b"n" => Key::N,
            b"stream" => Key::Stream,
            b"stream_options" => Key::StreamOptions,
            // Priced from their structure: the `Value` path's.
            b"tools" | b"functions" | b"response_format" => return None,
            _ => return p.value(1),
        };
        if std::mem::replace(&mut seen[key as usize], true) {
            return None;
        }
        match key {
            Key::Model => model = Some(string(p, text)?),
            Key::Messages => input = Some(messages(p, text, tok)?),
            Key::MaxTokens => max_tokens = p.count()?,
            Key::MaxCompletionTokens => max_completion = p.count()?,
            Key::N => n = p.count()?,
            Key::Stream => stream = flag(p)?,
            Key::StreamOptions => include_usage = stream_options(p)?,
        }
        Some(())
    };
    let mut members = Some(Vec::with_capacity(8));
    p.ws();
    p.object(1, |p, k, escaped| {
        if escaped {
            return None;
        }
        let at = p.i;
        read(p, k)?;
        if let Some(m) = members.as_mut() {
            if m.len() == MAX_MEMBERS {
                members = None;
            } else {
                // `k` is a slice of `raw`: its place is its distance from the start.
                let from = k.as_ptr() as usize - raw.as_ptr() as usize;
                m.push((from..from + k.len(), at..p.i));
            }
        }
        Some(())
    })?;
    p.ws();
    if p.i != raw.len() {
        return None;
    }
    let model = model.filter(|m: &std::borrow::Cow<'_, str>| !m.is_empty())?;
    let n = match n {
        None => 1,
        Some(n) if (1..=MAX_N).contains(&n) => u32::try_from(n).ok()?,
        Some(_) => return None,
    };
    Some(Plain {
        est: Estimate {
            input_tokens: input?,
            max_output_tokens: max_completion.or(max_tokens),
            n,
            stream,
            include_usage,
            model: model.into_owned(),
        },
        max_completion_tokens_key: seen[Key::MaxCompletionTokens as usize],
        members,
    })
}

/// A string value, decoded (in the decoded mode its only escapes are the one-letter ones).
fn string<'t>(p: &mut P<'_>, text: &'t str) -> Option<std::borrow::Cow<'t, str>> {
    if p.peek()? != b'"' {
        return None;
    }
    let (s, escaped) = p.string()?;
    let end = p.i - 1;
    let raw = text.get(end - s.len()..end)?;
    if !escaped {
        return Some(raw.into());
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next()? {
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'b' => '\u{8}',
            'f' => '\u{c}',
            c @ ('"' | '\\' | '/') => c,
            _ => return None,
        });
    }
    Some(out.into())
}

/// `true`, `false` or `null` (false).
fn flag(p: &mut P<'_>) -> Option<bool> {
    match p.peek()? {
        b't' => p.literal(b"true").map(|()| true),
        b'f' => p.literal(b"false").map(|()| false),
        b'n' => p.literal(b"null").map(|()| false),
        _ => None,
    }
}

/// `stream_options`: `null`, or an object whose `include_usage` is a flag.
fn stream_options(p: &mut P<'_>) -> Option<bool> {
    if p.peek()? == b'n' {
        return p.literal(b"null").map(|()| false);
    }
    let mut include = None;
    p.object(2, |p, k, escaped| match k {
        _ if escaped => None,
        b"include_usage" if include.is_none() => {
            include = Some(flag(p)?);
            Some(())
        }
        b"include_usage" => None,
        _ => p.value(2),
    })?;
    Some(include.unwrap_or(false))
}

/// Most distinct keys of a message read here (a message has a handful).
const MAX_MESSAGE_KEYS: usize = 12;

/// `messages`: a non-empty array of plain messages, priced as the `Value` path prices them
/// (the cookbook rule: 3 per message, each string field's text, 1 more for a `name`), with the
/// reply's priming.
fn messages(p: &mut P<'_>, text: &str, tok: Tokenizer) -> Option<u64> {
    if p.peek()? != b'[' {
        return None;
    }
    let mut total = REPLY_PRIMING_TOKENS;
    let mut count = 0usize;
    p.array(2, |p| {
        count += 1;
        total = total.saturating_add(message(p, text, tok)?);
        Some(())
    })?;
    (count > 0).then_some(total)
}

fn message(p: &mut P<'_>, text: &str, tok: Tokenizer) -> Option<u64> {
    if p.peek()? != b'{' {
        return None;
    }
    let mut keys: [&[u8]; MAX_MESSAGE_KEYS] = [&[]; MAX_MESSAGE_KEYS];
    let mut nkeys = 0;
    let mut role = false;
    let mut n = TOKENS_PER_MESSAGE;
    p.object(3, |p, k, escaped| {
        if escaped || nkeys == MAX_MESSAGE_KEYS || keys[..nkeys].contains(&k) {
            return None;
        }
        keys[nkeys] = k;
        nkeys += 1;
        if p.peek()? == b'n' {
            // `null` costs nothing, but a `role` must be a string.
            if k == b"role" {
                return None;
            }
            return p.literal(b"null");
        }
        let s = string(p, text)?;
        let tokens = count_text(tok, &s);
        n = n.saturating_add(match k {
            b"role" => {
                role = true;
                tokens
            }
            b"name" => tokens.saturating_add(TOKENS_PER_NAME),
            _ => tokens,
        });
        Some(())
    })?;
    role.then_some(n)
}

#[cfg(test)]
mod tests {
    use super::{chat, Plain};
    use crate::estimate::{estimate_object, Endpoint, Tokenizer};
    use serde_json::{Map, Value};

    /// Plain bodies (answered here) and bodies near them (some answered, most not).
    const SEEDS: &[&str] = &[
        r#"{"model":"chat","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Summarise the plot of Hamlet in two sentences."}],"max_tokens":256}"#,
        r#" { "model" : "gpt-4o" , "messages" : [ { "role" : "user" , "content" : "line one\nline \"two\"\\ and a \/ slash\tand a tab, résumé" , "name" : "ann" } ] , "stream" : true , "stream_options" : { "include_usage" : true , "other" : [1, {"x": null}] } , "n" : 2 } "#,
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"caf\u{e9} \u{1f600} \u{4e2d}\u{6587} text that is long enough for the memo\"}],\"max_completion_tokens\":null,\"max_tokens\":12}",
        r#"{"model":"m","messages":[{"role":"assistant","content":null,"refusal":"no"},{"role":"tool","content":"42","tool_call_id":"c1"}],"temperature":0.7,"top_p":1,"seed":123456789012345678901234,"stop":["\n\n","END"],"logit_bias":{"50256":-100},"user":"u-1","metadata":{"a":"b"}}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5,"stream":null,"stream_options":null,"n":null}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        r#"{"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{}}}}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"\ud83d\ude00 and \u0041"}],"n":128,"max_tokens":0}"#,
        r#"{"model":"m","messages":[],"max_tokens":1}"#,
        r#"{"model":"","messages":[{"role":"user","content":"x"}]}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"model":"m","model":"n"}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x","content":"y"}]}"#,
        r#"{"model":"m","messages":[{"content":"x"}]}"#,
        r#"{"model":"m","messages":[{"role":null,"content":"x"}],"n":0}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":129,"max_tokens":-1,"stream":1}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":1.0,"extra":1e400,"more":-0.5E3}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x","name":7}],"max_tokens":18446744073709551616}"#,
        r#"[{"model":"m"}]"#,
    ];

    /// The bytes the mutations put in: grammar, escapes, digits, letters, a control byte and
    /// a UTF-8 lead byte.
    const INSERTS: &[u8] = b"\"\\{}[],:0129-.eEnutfa \n\x01\xc3/";

    fn slow(b: &[u8], tok: Tokenizer) -> Option<(Map<String, Value>, crate::estimate::Estimate)> {
        let map: Map<String, Value> = serde_json::from_slice(b).ok()?;
        let est = estimate_object(Endpoint::Chat, &map, tok).ok()?;
        Some((map, est))
    }

    /// Whatever the scan answers is what the `Value` path says, on every body tried.
    fn check(b: &[u8], tok: Tokenizer) -> bool {
        let Some(Plain {
            est,
            max_completion_tokens_key,
            members,
        }) = chat(b, tok)
        else {
            return false;
        };
        let shown = String::from_utf8_lossy(b);
        let (map, want) = slow(b, tok)
            .unwrap_or_else(|| panic!("answered a body serde refuses or cannot price: {shown}"));
        assert_eq!(est, want, "{shown}");
        assert_eq!(
            max_completion_tokens_key,
            map.contains_key("max_completion_tokens"),
            "{shown}"
        );
        // The members: in order, each key a key of the map, each value the raw text of a
        // JSON value; the last of each key is the map's value, and every key is there.
        let members = members.expect("recorded");
        let mut keys = Map::new();
        let mut end = 0;
        for (k, v) in members {
            assert!(end <= k.start && k.end < v.start, "{shown}");
            end = v.end;
            let key = std::str::from_utf8(&b[k]).unwrap();
            let value: Value = serde_json::from_slice(&b[v]).unwrap();
            keys.insert(key.to_owned(), value);
        }
        assert_eq!(keys, map, "{shown}");
        true
    }

    #[test]
    fn plain_bodies_are_answered_with_the_value_paths_estimate() {
        for tok in [Tokenizer::O200k, Tokenizer::Chars] {
            for (i, seed) in SEEDS.iter().enumerate() {
                let answered = check(seed.as_bytes(), tok);
                // The first five are plain; the rest are not (or not priceable at all).
                assert_eq!(answered, i < 5, "seed {i}: {seed}");
            }
        }
    }

    #[test]
    fn mutated_bodies_are_answered_only_as_the_value_path_answers() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut tried, mut answered) = (0u32, 0u32);
        for seed in SEEDS {
            for _ in 0..1500 {
                let mut b = seed.as_bytes().to_vec();
                for _ in 0..1 + next() % 3 {
                    let at = (next() % (b.len() as u64 + 1)) as usize;
                    match next() % 4 {
                        0 if at < b.len() => {
                            b.remove(at);
                        }
                        1 => b.insert(at, INSERTS[(next() % INSERTS.len() as u64) as usize]),
                        2 if at < b.len() => {
                            b[at] = INSERTS[(next() % INSERTS.len() as u64) as usize]
                        }
                        _ => {
                            let end = (at + (next() % 12) as usize).min(b.len());
                            let piece = b[at..end].to_vec();
                            b.splice(at..at, piece);
                        }
                    }
                }
                tried += 1;
                answered += u32::from(check(&b, Tokenizer::O200k));
            }
        }
        // Not vacuous: a good share of the mutations stay plain (a changed letter in a text).
        assert!(answered > tried / 20, "{answered} of {tried}");
    }
}
