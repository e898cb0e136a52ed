//! What an answer says of itself (response model, finish reasons, cached input tokens), read
//! from its bytes without keeping any text.

use crate::providers::validate::Said;
use memchr::memmem::Finder;
use std::sync::{Arc, LazyLock};

/// The keys' searchers, built once (building one per search cost more than the search).
static MODEL: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"model\""));
static FINISH: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"finish_reason\""));
static CACHED: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"cached_tokens\""));

/// What an answer says of itself, read without parsing it: the response model, finish
/// reasons and cached input tokens (OpenAI's shape, which native answers are turned into).
/// The keys are matched with their unescaped quotes, which text inside a JSON string cannot have.
#[derive(Debug, Default)]
pub(crate) struct Notes {
    pub model: Option<Arc<str>>,
    pub finish: Finish,
    pub cached: Option<u64>,
    /// Read already, in the transport's parse of the answer ([`Notes::said`]).
    pub read: bool,
}

/// At most this many finish reasons are kept (`n` choices).
const MAX_FINISH: usize = 8;

/// The finish reasons the OpenAI shape uses, kept without an allocation.
const KNOWN: [&str; 5] = [
    "stop",
    "length",
    "tool_calls",
    "content_filter",
    "function_call",
];

/// Distinct finish reasons in the order first seen, as small codes: the known ones cost no
/// allocation (nearly all), others are kept in `other`.
#[derive(Debug, Default, Clone)]
pub(crate) struct Finish {
    /// An index into [`KNOWN`], or `KNOWN.len()` + an index into `other`.
    codes: [u8; MAX_FINISH],
    n: u8,
    other: Vec<Box<str>>,
}

impl Finish {
    pub fn clear(&mut self) {
        self.n = 0;
        self.other.clear();
    }

    pub fn len(&self) -> usize {
        usize::from(self.n)
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.codes[..self.len()]
            .iter()
            .map(|&c| match KNOWN.get(usize::from(c)) {
                Some(k) => *k,
                None => &*self.other[usize::from(c) - KNOWN.len()],
            })
    }

    /// Adds a reason given as valid UTF-8 bytes (a text, or an answer's bytes).
    pub fn add(&mut self, s: impl AsRef<[u8]>) {
        let s = s.as_ref();
        if self.len() >= MAX_FINISH || self.iter().any(|f| f.as_bytes() == s) {
            return;
        }
        let code = match KNOWN.iter().position(|k| k.as_bytes() == s) {
            Some(i) => i,
            None => {
                self.other.push(String::from_utf8_lossy(s).into());
                KNOWN.len() + self.other.len() - 1
            }
        };
        // At most KNOWN.len() + MAX_FINISH: fits a byte.
        self.codes[self.len()] = code as u8;
        self.n += 1;
    }
}

impl PartialEq for Finish {
    /// By codes: two lists built by [`Finish::add`] from the same reasons in the same order
    /// have the same codes and the same `other` (a known reason always has its fixed code, an
    /// unknown one the index of its first sighting).
    fn eq(&self, other: &Finish) -> bool {
        // The codes compared as one word (a slice comparison is a `memcmp` call), masked to
        // the first `n`: a cleared list keeps its old codes past `n`.
        let mask = u64::MAX
            .checked_shr(8 * (MAX_FINISH - self.len()) as u32)
            .unwrap_or(0);
        self.n == other.n
            && u64::from_le_bytes(self.codes) & mask == u64::from_le_bytes(other.codes) & mask
            && self.other == other.other
    }
}

impl<const N: usize> PartialEq<[&str; N]> for Finish {
    fn eq(&self, other: &[&str; N]) -> bool {
        self.len() == N && self.iter().eq(other.iter().copied())
    }
}

impl Notes {
    /// Reads `b`; with `spans` false only the model (all the metrics need), for an unsampled
    /// trace whose spans are not exported.
    pub fn scan(&mut self, b: &[u8], spans: bool) {
        if self.model.is_none() {
            self.model = MODEL
                .find(b)
                .and_then(|i| string_at(&b[i + 7..]))
                .map(Arc::from);
        }
        if !spans {
            return;
        }
        let mut rest = b;
        while let Some(i) = FINISH.find(rest) {
            rest = &rest[i + 15..];
            if let Some(s) = string_at(rest) {
                self.finish.add(s);
            }
        }
        if let Some(i) = CACHED.find(b) {
            let n = number_at(&b[i + 15..]);
            if n.is_some() {
                self.cached = n;
            }
        }
    }

    /// Takes what the transport read from a served answer in its own parse of it (the body is
    /// then not scanned again): the model (the attempt's own `Arc` when they are the same),
    /// the finish reasons and the cached input tokens.
    pub fn said(
        &mut self,
        attempt_model: &Arc<str>,
        s: &Said<'_>,
        cached: Option<u64>,
        spans: bool,
    ) {
        self.read = true;
        self.model = s.model.map(|m| {
            if m == attempt_model.as_bytes() {
                attempt_model.clone()
            } else {
                Arc::from(String::from_utf8_lossy(m))
            }
        });
        if !spans {
            return;
        }
        self.finish.clear();
        for r in s.finish.as_slice() {
            self.finish.add(r);
        }
        self.cached = cached;
    }
}

/// `: "value"` → value (short, unescaped names only).
fn string_at(b: &[u8]) -> Option<&str> {
    let b = skip_colon(b)?;
    let b = b.strip_prefix(b"\"")?;
    let end = b.iter().take(128).position(|&c| c == b'"' || c == b'\\')?;
    if b[end] != b'"' {
        return None;
    }
    std::str::from_utf8(&b[..end]).ok()
}

fn number_at(b: &[u8]) -> Option<u64> {
    let b = skip_colon(b)?;
    let end = b
        .iter()
        .position(|c| !c.is_ascii_digit())
        .unwrap_or(b.len());
    std::str::from_utf8(&b[..end.min(19)]).ok()?.parse().ok()
}

fn skip_colon(b: &[u8]) -> Option<&[u8]> {
    let b = b.trim_ascii_start().strip_prefix(b":")?;
    Some(b.trim_ascii_start())
}

#[cfg(test)]
mod tests {
    use super::{Finish, MAX_FINISH};

    #[test]
    fn finish_reasons_keep_their_order_known_or_not_and_stop_at_the_cap() {
        let mut f = Finish::default();
        for r in ["stop", "weird", "stop", "length", "weird", "other"] {
            f.add(r);
        }
        assert_eq!(f, ["stop", "weird", "length", "other"]);
        let mut g = f.clone();
        assert_eq!(g, f);
        g.clear();
        assert!(g.is_empty());
        g.add("other");
        assert_eq!(g, ["other"]);
        assert_ne!(g, f);
        for i in 0..3 * MAX_FINISH {
            g.add(format!("r{i}"));
        }
        assert_eq!(g.len(), MAX_FINISH);
        assert_eq!(g.iter().nth(1), Some("r0"));
        // Equal by what they hold: a cleared list's old codes past its length do not count,
        // and every one of the first `n` does.
        let (mut reused, mut fresh) = (Finish::default(), Finish::default());
        for r in ["length", "tool_calls", "content_filter"] {
            reused.add(r);
        }
        reused.clear();
        reused.add("stop");
        fresh.add("stop");
        assert_eq!(reused, fresh);
        reused.add("length");
        assert_ne!(reused, fresh);
        fresh.add("tool_calls");
        assert_ne!(reused, fresh);
        let mut full = Finish::default();
        let mut other = Finish::default();
        for r in [
            "stop",
            "length",
            "tool_calls",
            "content_filter",
            "function_call",
        ] {
            full.add(r);
            other.add(r);
        }
        assert_eq!(full, other);
    }
}
