//! No configured secret leaves in an upstream's answer. An upstream error page may echo the
//! request it received (its `Authorization`, `x-api-key`, `?key=`), so every body and header
//! value that comes from an upstream is searched for the upstream api keys and the virtual
//! keys of the policy in force, and each occurrence is replaced by `[redacted]`.
//!
//! Nothing is copied when nothing matches (the usual case). Secrets shorter than
//! [`MIN_SECRET`] bytes are not searched: masking a 3-letter string everywhere would corrupt
//! answers, and keys that short are not secrets worth the name.

use super::snapshot::Snapshot;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue};

/// What a secret is replaced with.
pub const MASK: &[u8] = b"[redacted]";
/// Shortest secret searched for.
pub const MIN_SECRET: usize = 8;

fn secrets(snap: &Snapshot) -> impl Iterator<Item = &[u8]> {
    snap.keys
        .iter()
        .flatten()
        .map(|s| s.expose().as_bytes())
        .chain(
            snap.virtual_keys
                .plain
                .iter()
                .map(|(s, _)| s.expose().as_bytes()),
        )
        .filter(|s| s.len() >= MIN_SECRET)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let first = *needle.first()?;
    let mut i = 0;
    while i + needle.len() <= hay.len() {
        let j = hay[i..=hay.len() - needle.len()]
            .iter()
            .position(|&b| b == first)?;
        i += j;
        if hay[i..].starts_with(needle) {
            return Some(i);
        }
        i += 1;
    }
    None
}

fn replace_all(hay: &[u8], needle: &[u8], at: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len());
    let mut rest = hay;
    let mut next = Some(at);
    while let Some(p) = next {
        out.extend_from_slice(&rest[..p]);
        out.extend_from_slice(MASK);
        rest = &rest[p + needle.len()..];
        next = find(rest, needle);
    }
    out.extend_from_slice(rest);
    out
}

/// `b` with every secret masked (the same bytes, uncopied, when none occurs).
pub fn bytes(snap: &Snapshot, b: Bytes) -> Bytes {
    let mut changed: Option<Vec<u8>> = None;
    for s in secrets(snap) {
        let cur: &[u8] = changed.as_deref().unwrap_or(&b);
        if let Some(at) = find(cur, s) {
            changed = Some(replace_all(cur, s, at));
        }
    }
    changed.map_or(b, Bytes::from)
}

/// Masks secrets in header values in place.
pub fn headers(snap: &Snapshot, h: &mut HeaderMap) {
    if secrets(snap).next().is_none() {
        return;
    }
    for v in h.values_mut() {
        if !secrets(snap).any(|s| find(v.as_bytes(), s).is_some()) {
            continue;
        }
        let masked = bytes(snap, Bytes::copy_from_slice(v.as_bytes()));
        *v = HeaderValue::from_maybe_shared(masked)
            .unwrap_or_else(|_| HeaderValue::from_static("[redacted]"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_and_replace_every_occurrence() {
        let hay = b"a sk-secret-1 b sk-secret-1sk-secret-1 c";
        let at = find(hay, b"sk-secret-1").unwrap();
        assert_eq!(at, 2);
        assert_eq!(
            replace_all(hay, b"sk-secret-1", at),
            b"a [redacted] b [redacted][redacted] c".to_vec()
        );
        assert_eq!(find(b"sk-secret", b"sk-secret-1"), None);
        assert_eq!(find(b"", b"x"), None);
        assert_eq!(find(b"xx", b"x"), Some(0));
        assert_eq!(find(b"ax", b"x"), Some(1));
    }
}
