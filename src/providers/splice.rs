//! Edits a client's JSON body in place of re-serializing it: the top-level members keep their
//! order and every value the edit does not name keeps its exact bytes (key order inside it,
//! number spelling, whitespace). Same-format pass-through uses it, so a field the sidecar does
//! not know reaches the upstream byte-for-byte as the client sent it.

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;
use std::fmt;

/// One change to a body: a top-level member, or a member of a top-level object (created when
/// missing, replaced when not an object).
#[derive(Debug, Clone, Copy)]
pub enum Edit<'a> {
    Set(&'a str, &'a Value),
    SetIn(&'a str, &'a str, &'a Value),
}

impl Edit<'_> {
    fn key(&self) -> &str {
        match self {
            Edit::Set(k, _) | Edit::SetIn(k, _, _) => k,
        }
    }
}

/// The members of a JSON object, in order, each value as its raw text.
struct Members<'a>(Vec<(String, &'a RawValue)>);

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
                while let Some((k, v)) = m.next_entry::<String, &'de RawValue>()? {
                    out.push((k, v));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

fn push_key(out: &mut Vec<u8>, k: &str) {
    // A key is a plain string: serializing it cannot fail.
    let _ = serde_json::to_writer(&mut *out, k);
    out.push(b':');
}

fn push_value(out: &mut Vec<u8>, v: &Value) {
    let _ = serde_json::to_writer(&mut *out, v);
}

/// `raw` (a JSON object) with `edits` applied. A member an edit names is written once, where it
/// first appeared (a duplicate later in the body is dropped); members no edit names are copied
/// as they came. Fails only when `raw` is not a JSON object.
pub fn splice(raw: &[u8], edits: &[Edit<'_>]) -> Result<Vec<u8>, String> {
    let Members(members) = serde_json::from_slice::<Members<'_>>(raw)
        .map_err(|e| format!("the body is not a JSON object: {e}"))?;
    let mut out = Vec::with_capacity(raw.len() + 64);
    out.push(b'{');
    let mut done = vec![false; edits.len()];
    let mut first = true;
    for (k, v) in &members {
        let edit = edits.iter().position(|e| e.key() == k);
        if let Some(i) = edit {
            if done[i] {
                continue; // a duplicate of an edited member
            }
            done[i] = true;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        push_key(&mut out, k);
        match edit.map(|i| edits[i]) {
            None => out.extend_from_slice(v.get().as_bytes()),
            Some(Edit::Set(_, nv)) => push_value(&mut out, nv),
            Some(Edit::SetIn(_, inner, nv)) => {
                let inner_edit = [Edit::Set(inner, nv)];
                match splice(v.get().as_bytes(), &inner_edit) {
                    Ok(obj) => out.extend_from_slice(&obj),
                    // Not an object: replaced by one holding the member alone.
                    Err(_) => push_object(&mut out, inner, nv),
                }
            }
        }
    }
    for (e, done) in edits.iter().zip(done) {
        if done {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        push_key(&mut out, e.key());
        match *e {
            Edit::Set(_, nv) => push_value(&mut out, nv),
            Edit::SetIn(_, inner, nv) => push_object(&mut out, inner, nv),
        }
    }
    out.push(b'}');
    Ok(out)
}

fn push_object(out: &mut Vec<u8>, k: &str, v: &Value) {
    out.push(b'{');
    push_key(out, k);
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
    fn duplicates_of_an_edited_member_are_written_once() {
        let m = json!("m");
        assert_eq!(
            s(
                r#"{"model":"a","x":1,"model":"b"}"#,
                &[Edit::Set("model", &m)]
            ),
            r#"{"model":"m","x":1}"#
        );
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
