//! One pass over a buffered OpenAI-shaped answer, without serde: is it a JSON object with
//! `choices` (or `data`) as an array, where is its `usage`, and what does it say of itself
//! (the response model, the finish reasons). Used by [`super::validate`] as a fast path.
//!
//! The scan ([`crate::jscan`]) is exact only where it answers: it validates the whole body with
//! the grammar serde_json applies to the values it skips (strings without control characters
//! and with valid escapes, numbers, literals, nesting), and answers only for the plain shape. On
//! anything else (a malformed body, a key written with escapes, a duplicate known key, `null`
//! for `choices`, deep nesting, a value it would have to decode) it gives up (`None`) and the
//! caller parses with serde_json, which then decides. So an answer it accepts is one serde
//! accepts, with the same result (a differential test checks this on many mutated bodies).

use crate::jscan::P;
use crate::stream::{PromptDetails, StreamUsage};

/// What the scan found in an answer it accepted.
#[derive(Debug, Default)]
pub struct Scanned<'a> {
    /// `choices` is present (an array).
    pub choices: bool,
    /// `data` is present (an array).
    pub data: bool,
    /// The raw `usage` value (valid UTF-8), if present.
    pub usage: Option<&'a [u8]>,
    /// `usage` read in place, when it has the plain shape (see [`usage_here`]).
    pub read_usage: Option<StreamUsage>,
    /// With `said`: the model and each choice's `finish_reason`, when short strings without
    /// escapes.
    pub said: super::validate::Said<'a>,
}

/// Longest `model` or finish reason kept (longer ones are left out, as serde's path does).
const MAX_NAME: usize = 128;

/// A value serde decodes (`deserialize_any`) rather than skips: a string as `&str` when
/// it is short, any other value skipped and read as no name. What serde would decode and
/// might refuse gives up (`None`): a string with escapes (which may be lone surrogates) or
/// bytes that are not UTF-8, a number that is not a short integer (a float may be out of
/// range), an object with such a key (serde decodes the keys of a map it visits). Arrays
/// are skipped by serde too.
fn name<'a>(p: &mut P<'a>, depth: u32) -> Option<Option<&'a [u8]>> {
    match p.peek()? {
        b'"' => {}
        b'-' | b'0'..=b'9' => {
            let at = p.i;
            p.number()?;
            let n = &p.b[at..p.i];
            let short = n.len() <= 18 && !n.iter().any(|c| matches!(c, b'.' | b'e' | b'E'));
            return short.then_some(None);
        }
        // serde visits the map: its keys are decoded (UTF-8, escapes), its values skipped.
        b'{' => {
            p.object(depth + 1, |p, k, escaped| {
                if escaped {
                    return None;
                }
                std::str::from_utf8(k).ok()?;
                p.value(depth + 1)
            })?;
            return Some(None);
        }
        _ => {
            p.value(depth)?;
            return Some(None);
        }
    }
    let (s, escaped) = p.string()?;
    if escaped {
        return None;
    }
    // serde decodes it: bytes that are not UTF-8 are refused (ASCII, nearly always, is).
    if !s.is_ascii() {
        std::str::from_utf8(s).ok()?;
    }
    Some((s.len() <= MAX_NAME).then_some(s))
}

/// Scans `body`; `said`: also read the model and the finish reasons. `None`: not answered
/// here (the caller parses with serde_json).
pub fn answer(body: &[u8], said: bool) -> Option<Scanned<'_>> {
    let mut p = P::new(body);
    let mut out = Scanned::default();
    let mut seen = [false; 4];
    p.ws();
    p.object(1, |p, k, escaped| {
        let slot = match k {
            b"choices" => 0,
            b"data" => 1,
            b"model" => 2,
            b"usage" => 3,
            // A key with escapes could spell a known one; one that is not UTF-8 makes serde
            // refuse the body: both are left to serde.
            _ if escaped || !k.is_ascii() => return None,
            _ => return p.value(1),
        };
        if escaped || std::mem::replace(&mut seen[slot], true) {
            return None;
        }
        match slot {
            0 => {
                out.choices = true;
                if said {
                    p.array(2, |p| {
                        if p.peek()? != b'{' {
                            // Decoded by serde as any value: the same rules as a name.
                            return name(p, 2).map(drop);
                        }
                        let mut reason = None;
                        p.object(3, |p, k, escaped| {
                            if escaped {
                                return None;
                            }
                            if k == b"finish_reason" {
                                reason = name(p, 3)?;
                                Some(())
                            } else {
                                p.value(3)
                            }
                        })?;
                        if let Some(r) = reason {
                            out.said.finish.add(r);
                        }
                        Some(())
                    })
                } else {
                    p.array(2, |p| p.value(2))
                }
            }
            1 => {
                out.data = true;
                p.array(2, |p| p.value(2))
            }
            2 if said => {
                out.said.model = name(p, 1)?;
                Some(())
            }
            2 => p.value(1),
            _ => {
                // Read in place when it has the plain shape (one pass over it, not two); else
                // skipped, and kept raw for the caller.
                let at = p.i;
                out.read_usage = usage_here(p, 2);
                if out.read_usage.is_none() {
                    p.i = at;
                    p.value(1)?;
                }
                let raw = &p.b[at..p.i];
                if !raw.is_ascii() {
                    std::str::from_utf8(raw).ok()?;
                }
                out.usage = Some(raw);
                Some(())
            }
        }
    })?;
    p.ws();
    (p.i == body.len()).then_some(out)
}

/// An answer's `usage`, the value at `p.i` (an object at nesting `depth`), read in place when
/// it has the plain shape: an object whose counts are integers or `null`; `p.i` ends past it.
/// `None`: not answered here (`p.i` anywhere; the caller skips the value and reads its raw
/// text with serde_json, which then decides).
fn usage_here(p: &mut P<'_>, depth: u32) -> Option<StreamUsage> {
    let mut u = StreamUsage::default();
    let mut seen = [false; 5];
    p.object(depth, |p, k, escaped| {
        if escaped {
            return None;
        }
        let slot = match k {
            b"prompt_tokens" => 0,
            b"completion_tokens" => 1,
            b"total_tokens" => 2,
            b"cache_creation_input_tokens" => 3,
            b"prompt_tokens_details" => 4,
            _ => return p.value(depth),
        };
        if std::mem::replace(&mut seen[slot], true) {
            return None;
        }
        if slot == 4 {
            if p.peek()? == b'n' {
                return p.literal(b"null");
            }
            let mut cached = None;
            let mut seen = false;
            p.object(depth + 1, |p, k, escaped| match k {
                _ if escaped => None,
                b"cached_tokens" if !std::mem::replace(&mut seen, true) => {
                    cached = p.count()?;
                    Some(())
                }
                b"cached_tokens" => None,
                _ => p.value(depth + 1),
            })?;
            u.prompt_tokens_details = Some(PromptDetails {
                cached_tokens: cached,
            });
            return Some(());
        }
        let n = p.count()?;
        match slot {
            0 => u.prompt_tokens = n,
            1 => u.completion_tokens = n,
            2 => u.total_tokens = n,
            _ => u.cache_creation_input_tokens = n,
        }
        Some(())
    })?;
    Some(u)
}
