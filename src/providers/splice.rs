//! Edits a client's JSON body in place of re-serializing it: the top-level members keep their
//! order and every value the edit does not name keeps its exact bytes (key order inside it,
//! number spelling, whitespace). Same-format pass-through uses it, and so does an OpenAI
//! request to an OpenAI-compatible backend, so a field the sidecar does not know reaches the
//! upstream byte-for-byte as the client sent it.
//!
//! A key the client sent twice is sent once, with its last value: the value serde_json (and so
//! the estimate) read. An upstream that kept the first would otherwise run on a body the
//! governor never counted.

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;
use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

/// One change to a body: a top-level member set, a member of a top-level object set (the
/// object created when missing, replaced when not an object), or a top-level member removed.
#[derive(Debug, Clone, Copy)]
pub enum Edit<'a> {
    Set(&'a str, &'a Value),
    SetIn(&'a str, &'a str, &'a Value),
    Remove(&'a str),
}

impl Edit<'_> {
    fn key(&self) -> &str {
        match self {
            Edit::Set(k, _) | Edit::SetIn(k, _, _) | Edit::Remove(k) => k,
        }
    }
}

/// A member's key: borrowed from the body unless it holds an escape.
struct Key<'a>(Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// The members of a JSON object, in order, each value as its raw text.
struct Members<'a>(Vec<(Key<'a>, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(m.size_hint().unwrap_or(8).min(64));
                while let Some((k, v)) = m.next_entry::<Key<'de>, &'de RawValue>()? {
                    out.push((k, v));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// A member: its key (unescaped) and its value's raw text.
type Member<'a> = (&'a [u8], &'a [u8]);

/// Which members are their key's last occurrence: `None` when each is checked against the
/// few after it ([`is_last`]); a long object (a hostile body can hold a great many keys) is
/// checked through a set, once.
fn last_of_key(members: &[Member<'_>]) -> Option<Vec<bool>> {
    let n = members.len();
    if n <= 16 {
        return None;
    }
    let mut seen = HashSet::with_capacity(n);
    let mut last = vec![false; n];
    for (i, (k, _)) in members.iter().enumerate().rev() {
        last[i] = seen.insert(*k);
    }
    Some(last)
}

fn is_last(members: &[Member<'_>], last: Option<&[bool]>, i: usize) -> bool {
    match last {
        Some(l) => l[i],
        None => !members[i + 1..].iter().any(|(k, _)| *k == members[i].0),
    }
}

fn push_key(out: &mut Vec<u8>, k: &[u8]) {
    if k.iter().any(|&c| c == b'"' || c == b'\\' || c < 0x20) {
        // A decoded key that needs escapes (UTF-8: it came from a `str`).
        let _ = serde_json::to_writer(&mut *out, &String::from_utf8_lossy(k));
    } else {
        out.push(b'"');
        out.extend_from_slice(k);
        out.push(b'"');
    }
    out.push(b':');
}

fn push_value(out: &mut Vec<u8>, v: &Value) {
    let _ = serde_json::to_writer(&mut *out, v);
}

/// `raw` (a JSON object) with `edits` applied. Each key is written once, where it last
/// appeared, with its last value; a member an edit names is written (or left out) as the edit
/// says, and an edit's member that is missing is appended. Other members are copied as they
/// came. Fails only when `raw` is not a JSON object.
pub fn splice(raw: &[u8], edits: &[Edit<'_>]) -> Result<Vec<u8>, String> {
    if edits.len() > 64 {
        return Err("too many edits".into());
    }
    // Every caller has parsed `raw` already: the members are found without validating again
    // (a key with escapes, or a body that is not an object, goes to serde_json, which decodes
    // or refuses it).
    if let Some(members) = members_of_parsed(raw) {
        return Ok(write(&members, raw.len(), edits));
    }
    let Members(members) = serde_json::from_slice::<Members<'_>>(raw)
        .map_err(|e| format!("the body is not a JSON object: {e}"))?;
    let members: Vec<Member<'_>> = members
        .iter()
        .map(|(k, v)| (k.0.as_bytes(), v.get().as_bytes()))
        .collect();
    Ok(write(&members, raw.len(), edits))
}

fn ws(b: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = b.get(i) {
        i += 1;
    }
    i
}

/// The index of the quote that ends the string whose text starts at `i` (`None` at a control
/// character: not JSON, left to serde_json).
fn string_end(b: &[u8], mut i: usize) -> Option<usize> {
    loop {
        i += crate::jscan::special_at(b.get(i..)?)?;
        match b[i] {
            b'"' => return Some(i),
            b'\\' => i += 2, // the escaped byte (a `\uXXXX`'s digits hold no quote)
            _ => return None,
        }
    }
}

/// The index just past the value that starts at `i`.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i + 1).map(|e| e + 1),
        b'{' | b'[' => {
            let (mut j, mut depth) = (i, 0usize);
            loop {
                match *b.get(j)? {
                    b'"' => j = string_end(b, j + 1)?,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let n = b[i..]
                .iter()
                .position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                .unwrap_or(b.len() - i);
            (n > 0).then_some(i + n)
        }
    }
}

/// The members of `raw`, a JSON object the caller has parsed: each key (one without escapes)
/// and its value's raw text, found by the quotes and brackets alone. `None`: a key with
/// escapes, or not the shape of an object. On bytes no parser accepted, the members found may
/// be wrong but every index is checked: never a panic.
fn members_of_parsed(raw: &[u8]) -> Option<Vec<Member<'_>>> {
    let mut i = ws(raw, 0);
    if raw.get(i) != Some(&b'{') {
        return None;
    }
    let mut out = Vec::with_capacity(16);
    i = ws(raw, i + 1);
    if raw.get(i) == Some(&b'}') {
        return (ws(raw, i + 1) == raw.len()).then_some(out);
    }
    loop {
        if raw.get(i) != Some(&b'"') {
            return None;
        }
        let end = string_end(raw, i + 1)?;
        let key = &raw[i + 1..end];
        if key.contains(&b'\\') {
            return None;
        }
        i = ws(raw, end + 1);
        if raw.get(i) != Some(&b':') {
            return None;
        }
        i = ws(raw, i + 1);
        let at = i;
        i = value_end(raw, i)?;
        out.push((key, &raw[at..i]));
        i = ws(raw, i);
        match raw.get(i)? {
            b',' => i = ws(raw, i + 1),
            b'}' => return (ws(raw, i + 1) == raw.len()).then_some(out),
            _ => return None,
        }
    }
}

/// An object being written: each member's separator and key, then its value.
struct Obj {
    out: Vec<u8>,
    first: bool,
}

impl Obj {
    /// Starts a member: the buffer to write its value into.
    fn member(&mut self, k: &[u8]) -> &mut Vec<u8> {
        if !std::mem::replace(&mut self.first, false) {
            self.out.push(b',');
        }
        push_key(&mut self.out, k);
        &mut self.out
    }
}

/// [`splice`] of a body whose top-level members the caller found already (each key without
/// escapes and each value's raw text, in order: what [`members_of_parsed`] finds).
pub fn splice_members(members: &[Member<'_>], len: usize, edits: &[Edit<'_>]) -> Vec<u8> {
    write(members, len, edits)
}

fn write(members: &[Member<'_>], len: usize, edits: &[Edit<'_>]) -> Vec<u8> {
    let last = last_of_key(members);
    let mut o = Obj {
        out: Vec::with_capacity(len + 64),
        first: true,
    };
    o.out.push(b'{');
    let mut done = 0u64; // bit i: edit i met its member
    for (i, &(k, v)) in members.iter().enumerate() {
        if !is_last(members, last.as_deref(), i) {
            continue; // a key sent again later: its last value is the one read
        }
        let edit = edits.iter().position(|e| e.key().as_bytes() == k);
        if let Some(i) = edit {
            done |= 1 << i;
        }
        match edit.map(|i| edits[i]) {
            Some(Edit::Remove(_)) => {}
            None => o.member(k).extend_from_slice(v),
            Some(Edit::Set(_, nv)) => push_value(o.member(k), nv),
            Some(Edit::SetIn(_, inner, nv)) => {
                let out = o.member(k);
                match splice(v, &[Edit::Set(inner, nv)]) {
                    Ok(obj) => out.extend_from_slice(&obj),
                    // Not an object: replaced by one holding the member alone.
                    Err(_) => push_object(out, inner, nv),
                }
            }
        }
    }
    // Edits whose member was missing: appended.
    for (i, e) in edits.iter().enumerate() {
        if done & (1 << i) != 0 {
            continue;
        }
        match *e {
            Edit::Remove(_) => {}
            Edit::Set(k, nv) => push_value(o.member(k.as_bytes()), nv),
            Edit::SetIn(k, inner, nv) => push_object(o.member(k.as_bytes()), inner, nv),
        }
    }
    o.out.push(b'}');
    o.out
}

fn push_object(out: &mut Vec<u8>, k: &str, v: &Value) {
    out.push(b'{');
    push_key(out, k.as_bytes());
    push_value(out, v);
    out.push(b'}');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn s(raw: &str, edits: &[Edit<'_>]) -> String {
        String::from_utf8(splice(raw.as_bytes(), edits).unwrap()).unwrap()
    }

    #[test]
    fn unnamed_members_keep_their_bytes_and_order() {
        let raw = r#"{ "z": {"b": 1, "a": 2.50},  "model":"chat", "x" : [1, 2 ,3] }"#;
        let m = json!("up-model");
        assert_eq!(
            s(raw, &[Edit::Set("model", &m)]),
            r#"{"z":{"b": 1, "a": 2.50},"model":"up-model","x":[1, 2 ,3]}"#
        );
    }

    #[test]
    fn missing_members_are_appended_and_nested_ones_edited_in_place() {
        let raw = r#"{"generationConfig": {"temperature": 0.10, "maxOutputTokens": 9000}, "k": 1}"#;
        let cap = json!(64);
        assert_eq!(
            s(
                raw,
                &[Edit::SetIn("generationConfig", "maxOutputTokens", &cap)]
            ),
            r#"{"generationConfig":{"temperature":0.10,"maxOutputTokens":64},"k":1}"#
        );
        let m = json!("m");
        assert_eq!(
            s(
                r#"{"k":1}"#,
                &[
                    Edit::Set("model", &m),
                    Edit::SetIn("options", "num_predict", &cap)
                ]
            ),
            r#"{"k":1,"model":"m","options":{"num_predict":64}}"#
        );
        // A member that should be an object but is not is replaced by one.
        assert_eq!(
            s(
                r#"{"options":7}"#,
                &[Edit::SetIn("options", "num_predict", &cap)]
            ),
            r#"{"options":{"num_predict":64}}"#
        );
    }

    #[test]
    fn a_key_sent_twice_is_sent_once_with_its_last_value() {
        let m = json!("m");
        assert_eq!(
            s(
                r#"{"model":"a","x":1,"model":"b"}"#,
                &[Edit::Set("model", &m)]
            ),
            r#"{"x":1,"model":"m"}"#
        );
        // Not edited: the last value is the one serde_json, and so the estimate, read.
        let raw = r#"{"messages":[{"role":"user","content":"a long text"}],"n":1,"messages":[]}"#;
        let out = s(raw, &[]);
        assert_eq!(out, r#"{"n":1,"messages":[]}"#);
        let read: Value = serde_json::from_str(raw).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), read);
        // An escaped spelling is the same key.
        assert_eq!(s(r#"{"a":1,"\u0061":2}"#, &[]), r#"{"a":2}"#);
    }

    #[test]
    fn many_keys_keep_the_last_of_each() {
        // Past the pair-by-pair check: the set is used.
        let mut raw = String::from("{");
        for i in 0..40 {
            raw.push_str(&format!("\"k{}\":{i},", i % 20));
        }
        raw.push_str("\"z\":0}");
        let out: Value = serde_json::from_str(&s(&raw, &[])).unwrap();
        let read: Value = serde_json::from_str(&raw).unwrap();
        assert_eq!(out, read);
        assert_eq!(out.as_object().unwrap().len(), 21);
        assert_eq!(out["k3"], json!(23));
    }

    #[test]
    fn removed_members_are_left_out() {
        let cap = json!(64);
        assert_eq!(
            s(
                r#"{"max_tokens":9,"x":1,"max_completion_tokens":5}"#,
                &[
                    Edit::Remove("max_completion_tokens"),
                    Edit::Set("max_tokens", &cap)
                ]
            ),
            r#"{"max_tokens":64,"x":1}"#
        );
        // A removal of a missing member adds nothing.
        assert_eq!(s(r#"{"x":1}"#, &[Edit::Remove("y")]), r#"{"x":1}"#);
    }

    /// The members serde_json reads, for the differential test.
    fn by_serde(raw: &str) -> Option<Vec<(String, String)>> {
        let Members(m) = serde_json::from_str::<Members<'_>>(raw).ok()?;
        Some(
            m.iter()
                .map(|(k, v)| (k.0.to_string(), v.get().to_string()))
                .collect(),
        )
    }

    #[test]
    fn the_members_found_are_the_members_serde_reads() {
        let bodies = [
            r#"{"model":"chat","messages":[{"role":"user","content":"hi \"there\" \n \\"}],"n":1}"#,
            " {\n \"a\" : [1, 2.5e-3, -0, true, false, null,[[]],{\"]\":\"}\"}] ,\t\"b\":{\"c\":{}} , \"d\":\"\" }\n",
            r#"{}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"é":"ü","x":"\ud83d\ude00","y":"\u0022}"}"#,
        ];
        for raw in bodies {
            let found: Vec<(String, String)> = members_of_parsed(raw.as_bytes())
                .expect("found")
                .iter()
                .map(|(k, v)| {
                    (
                        String::from_utf8(k.to_vec()).unwrap(),
                        String::from_utf8(v.to_vec()).unwrap(),
                    )
                })
                .collect();
            assert_eq!(Some(found), by_serde(raw), "{raw}");
        }
        // Left to serde: a key with escapes, not an object.
        for raw in [r#"{"\u0061":1}"#, "[1]", "1", r#"{"a":1} x"#] {
            assert!(members_of_parsed(raw.as_bytes()).is_none(), "{raw}");
        }
        assert_eq!(s(r#"{"\u0061":1}"#, &[]), r#"{"a":1}"#);
    }

    #[test]
    fn bytes_no_parser_accepted_never_panic() {
        let raw = br#"{"model":"chat","messages":[{"role":"user","content":"a\"b\\"}],"x":[1,{"y":null}],"n":12}"#;
        let m = json!("m");
        for end in 0..=raw.len() {
            for start in 0..end.min(4) {
                let _ = splice(&raw[start..end], &[Edit::Set("model", &m)]);
            }
        }
        for junk in [
            &b"{\"a\":\"\\"[..],
            b"{\"a\":]]]}",
            b"{\"a\":}",
            b"{\"a\"",
            b"{\"",
            b"{,}",
        ] {
            let _ = splice(junk, &[Edit::Set("model", &m)]);
        }
    }

    #[test]
    fn escapes_and_non_objects() {
        let m = json!("m");
        assert_eq!(
            s(
                r#"{"t\u0041":"\"q\"","model":1}"#,
                &[Edit::Set("model", &m)]
            ),
            r#"{"tA":"\"q\"","model":"m"}"#
        );
        assert!(splice(b"[1,2]", &[]).is_err());
        assert!(splice(b"{\"a\":", &[]).is_err());
        assert_eq!(s("{}", &[]), "{}");
    }
}
