//! The sidecar's own fields of an answer (SPEC §3, §3.2): its decision and ids, and the
//! readable token limits. They are kept, in the answer's extensions, as the header lines they
//! are written as: the sidecar's HTTP/1.1 server writes the block as it is, with no header
//! map in between (eleven map inserts were ~5,000 instructions an answer, docs/performance.md,
//! eighteenth round). On hyper's connections (h2c, and a connection handed to hyper) they are
//! put into the answer's map before it is written ([`into_headers`]).
//!
//! An answer's own fields replace any field of the same name the upstream sent (its
//! `x-ratelimit-*` headers, say): the map's are left out when the block is written
//! ([`Stamps::covers`]), and replaced when the block goes into the map.

use http::{HeaderMap, HeaderName, HeaderValue, Response};

/// The fields stamped this way, by their index in [`NAMES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stamp {
    RequestId = 0,
    Action,
    Reason,
    Backend,
    PolicyVersion,
    LimitTokens,
    RemainingTokens,
    ResetTokens,
    RateLimitPolicy,
    RateLimit,
    Shadow,
    /// The bound that stopped the request (a refusal, or a static answer in its place).
    Limit,
    /// What a served answer cost, in dollars.
    CostUsd,
    /// Dollars left on the tightest dollar bound that applies.
    BudgetRemainingUsd,
}

/// The names of the stamped fields, in [`Stamp`]'s order.
static NAMES: [HeaderName; 14] = [
    HeaderName::from_static("x-tollgate-request-id"),
    HeaderName::from_static("x-tollgate-action"),
    HeaderName::from_static("x-tollgate-reason"),
    HeaderName::from_static("x-tollgate-backend"),
    HeaderName::from_static("x-tollgate-policy-version"),
    HeaderName::from_static("x-ratelimit-limit-tokens"),
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
    HeaderName::from_static("ratelimit-policy"),
    HeaderName::from_static("ratelimit"),
    HeaderName::from_static("x-tollgate-shadow"),
    HeaderName::from_static("x-tollgate-limit"),
    HeaderName::from_static("x-tollgate-cost-usd"),
    HeaderName::from_static("x-tollgate-budget-remaining-usd"),
];

impl Stamp {
    pub fn name(self) -> &'static HeaderName {
        &NAMES[self as usize]
    }
}

/// Where stamped fields are put: the block of an answer, or a header map (a field there
/// replaces the one of the same name).
pub trait Fields {
    /// Puts `value`, unless a header cannot carry it (a control byte).
    fn put(&mut self, field: Stamp, value: &[u8]);
    /// Puts a value known to be carriable by how it was made (digits, a structured-field
    /// string, a `HeaderValue`'s bytes, a name the policy checked): not looked at again.
    fn put_known(&mut self, field: Stamp, value: &[u8]) {
        self.put(field, value);
    }
}

impl Fields for HeaderMap {
    fn put(&mut self, field: Stamp, value: &[u8]) {
        if let Ok(v) = HeaderValue::from_bytes(value) {
            self.insert(field.name().clone(), v);
        }
    }
}

/// An answer's stamped fields, as header lines (`name: value\r\n` each).
#[derive(Debug, Clone, Default)]
pub struct Stamps {
    lines: Vec<u8>,
    /// Which of [`NAMES`] are in `lines`.
    has: u16,
}

/// Whether a header may carry `value` (as `HeaderValue::from_bytes` judges: no control byte
/// but a tab): a value that may not is left out, so no line can be broken or added.
fn carriable(value: &[u8]) -> bool {
    value
        .iter()
        .all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

impl Fields for Stamps {
    fn put(&mut self, field: Stamp, value: &[u8]) {
        if carriable(value) {
            self.put_known(field, value);
        }
    }

    fn put_known(&mut self, field: Stamp, value: &[u8]) {
        debug_assert!(carriable(value), "{field:?}");
        let bit = 1u16 << field as u16;
        if self.has & bit != 0 {
            // Stamped again: the new value replaces the old, as in a map.
            self.remove(field);
        }
        self.has |= bit;
        let name = field.name().as_str().as_bytes();
        self.lines.reserve(name.len() + value.len() + 4);
        self.lines.extend_from_slice(name);
        self.lines.extend_from_slice(b": ");
        self.lines.extend_from_slice(value);
        self.lines.extend_from_slice(b"\r\n");
    }
}

impl Stamps {
    pub fn with_capacity(n: usize) -> Stamps {
        Stamps {
            lines: Vec::with_capacity(n),
            has: 0,
        }
    }

    /// The header lines, each ending in CRLF.
    pub fn lines(&self) -> &[u8] {
        &self.lines
    }

    /// Whether a field named `name` is stamped (so a field of that name in the answer's map
    /// is not written). Names that cannot be stamped cost one or two byte compares.
    pub fn covers(&self, name: &HeaderName) -> bool {
        let n = name.as_str().as_bytes();
        if self.has == 0 || !matches!(n.first(), Some(b'x' | b'r')) {
            return false;
        }
        NAMES
            .iter()
            .enumerate()
            .any(|(i, s)| self.has & (1 << i) != 0 && s.as_str().as_bytes() == n)
    }

    /// Each stamped field and its value.
    fn each(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.lines
            .split(|&b| b == b'\n')
            .filter_map(|l| l.strip_suffix(b"\r"))
            .filter_map(|l| {
                let at = memchr::memmem::find(l, b": ")?;
                Some((&l[..at], &l[at + 2..]))
            })
    }

    fn remove(&mut self, field: Stamp) {
        let name = field.name().as_str().as_bytes();
        let mut kept = Vec::with_capacity(self.lines.len());
        for (n, v) in self.each() {
            if n != name {
                kept.extend_from_slice(n);
                kept.extend_from_slice(b": ");
                kept.extend_from_slice(v);
                kept.extend_from_slice(b"\r\n");
            }
        }
        self.lines = kept;
        self.has &= !(1u16 << field as u16);
    }
}

/// Moves `resp`'s stamped fields into its header map (for a connection hyper writes).
pub fn into_headers<B>(resp: &mut Response<B>) {
    let Some(s) = resp.extensions_mut().remove::<Stamps>() else {
        return;
    };
    let h = resp.headers_mut();
    for (i, name) in NAMES.iter().enumerate() {
        if s.has & (1 << i) != 0 {
            h.remove(name);
        }
    }
    for (n, v) in s.each() {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(n), HeaderValue::from_bytes(v)) {
            h.append(n, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamped_fields_are_lines_and_replace_their_namesakes() {
        let mut s = Stamps::default();
        s.put(Stamp::Action, b"ALLOW");
        s.put(Stamp::RemainingTokens, b"10");
        s.put(Stamp::RemainingTokens, b"9");
        s.put(Stamp::Backend, b"bad\r\nx-injected: 1");
        assert_eq!(
            String::from_utf8_lossy(s.lines()),
            "x-tollgate-action: ALLOW\r\nx-ratelimit-remaining-tokens: 9\r\n"
        );
        assert!(s.covers(&HeaderName::from_static("x-ratelimit-remaining-tokens")));
        assert!(!s.covers(&HeaderName::from_static("x-ratelimit-limit-tokens")));
        assert!(!s.covers(&http::header::CONTENT_TYPE));
        let mut resp = Response::new(());
        resp.headers_mut().insert(
            "x-ratelimit-remaining-tokens",
            HeaderValue::from_static("77"),
        );
        resp.headers_mut()
            .insert("x-ratelimit-limit-tokens", HeaderValue::from_static("100"));
        resp.extensions_mut().insert(s);
        into_headers(&mut resp);
        let h = resp.headers();
        assert_eq!(h["x-tollgate-action"], "ALLOW");
        assert_eq!(h.get_all("x-ratelimit-remaining-tokens").iter().count(), 1);
        assert_eq!(h["x-ratelimit-remaining-tokens"], "9");
        assert_eq!(
            h["x-ratelimit-limit-tokens"], "100",
            "an upstream field not stamped stays"
        );
        assert!(h.get("x-tollgate-backend").is_none() && h.get("x-injected").is_none());
        assert!(resp.extensions().get::<Stamps>().is_none());
    }
}
