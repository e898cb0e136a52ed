//! The client's request body as the providers read it (the OpenAI form): a `serde_json` map,
//! parsed from the client's bytes only when a provider asks for it. An OpenAI request to an
//! OpenAI-compatible backend is spliced from the bytes and never needs it; the estimate of a
//! plain body is read from the bytes too (`estimate::chat_plain`), so such a request builds
//! no `Value` tree at all.

use super::Untranslatable;
use crate::estimate::Member;
use bytes::Bytes;
use serde_json::{Map, Value};
use std::sync::OnceLock;

#[derive(Debug)]
pub struct RequestBody {
    /// The client's bytes, when the map is parsed from them on first use.
    raw: Bytes,
    map: OnceLock<Result<Map<String, Value>, String>>,
    /// Whether the body has a top-level `max_completion_tokens` key (an OpenAI request then
    /// keeps that name for its cap).
    max_completion_tokens_key: bool,
    /// Where `raw`'s top-level members are (`estimate::Plain::members`), when known.
    members: Option<Vec<Member>>,
}

impl RequestBody {
    /// A body parsed already (a translated dialect's, a test's).
    pub fn parsed(map: Map<String, Value>) -> RequestBody {
        RequestBody {
            raw: Bytes::new(),
            max_completion_tokens_key: map.contains_key("max_completion_tokens"),
            map: OnceLock::from(Ok(map)),
            members: None,
        }
    }

    /// A body to parse from `raw` when asked: bytes the caller has found to be a JSON object
    /// serde accepts (a plain body, `estimate::chat_plain`), with what that scan saw: the
    /// `max_completion_tokens` key and where the top-level members are.
    pub fn lazy(
        raw: Bytes,
        max_completion_tokens_key: bool,
        members: Option<Vec<Member>>,
    ) -> RequestBody {
        RequestBody {
            raw,
            map: OnceLock::new(),
            max_completion_tokens_key,
            members,
        }
    }

    /// The top-level members of `raw` (keys without escapes, values' raw text), when `raw` is
    /// the very buffer this body was scanned from and the scan recorded them.
    pub fn members_of<'r>(&self, raw: &'r [u8]) -> Option<Vec<(&'r [u8], &'r [u8])>> {
        let spans = self.members.as_ref()?;
        if !std::ptr::eq(raw, &self.raw[..]) {
            return None;
        }
        spans
            .iter()
            .map(|(k, v)| Some((raw.get(k.clone())?, raw.get(v.clone())?)))
            .collect()
    }

    /// The body as a map, parsed on the first call. It does not fail for the bodies
    /// [`RequestBody::lazy`] is given; if one did, the attempt asking is untranslatable
    /// (skipped and logged), never sent.
    pub fn map(&self) -> Result<&Map<String, Value>, Untranslatable> {
        self.map
            .get_or_init(|| serde_json::from_slice(&self.raw).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Untranslatable(format!("the request body does not parse: {e}")))
    }

    pub fn has_max_completion_tokens(&self) -> bool {
        self.max_completion_tokens_key
    }
}

impl From<Map<String, Value>> for RequestBody {
    fn from(map: Map<String, Value>) -> RequestBody {
        RequestBody::parsed(map)
    }
}
