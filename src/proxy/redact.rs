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

/// Redaction of a body that comes in pieces (a stream): a secret split across two reads is
/// masked too. The end of a piece that could be the start of a secret is held back until the
/// next piece shows whether it is one; nothing else waits (an SSE event ends in a blank line,
/// which no secret starts with, so events go out as they come).
#[derive(Debug, Default)]
pub struct Pieces {
    held: Vec<u8>,
}

impl Pieces {
    /// What of `piece` (after what was held) can go out now, secrets masked.
    pub fn next(&mut self, snap: &Snapshot, piece: Bytes) -> Bytes {
        if secrets(snap).next().is_none() {
            return piece;
        }
        let joined = if self.held.is_empty() {
            piece
        } else {
            let mut j = std::mem::take(&mut self.held);
            j.extend_from_slice(&piece);
            Bytes::from(j)
        };
        let masked = bytes(snap, joined);
        let keep = secrets(snap)
            .map(|s| open_prefix(&masked, s))
            .max()
            .unwrap_or(0);
        if keep > 0 {
            self.held.extend_from_slice(&masked[masked.len() - keep..]);
        }
        masked.slice(..masked.len() - keep)
    }

    /// What was held back at the body's end (it was no secret).
    pub fn finish(&mut self) -> Option<Bytes> {
        (!self.held.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.held)))
    }
}

/// The length of the longest end of `hay` that is the start, not the whole, of `secret`.
fn open_prefix(hay: &[u8], secret: &[u8]) -> usize {
    let from = hay.len().saturating_sub(secret.len() - 1);
    (from..hay.len())
        .find(|&i| secret.starts_with(&hay[i..]))
        .map_or(0, |i| hay.len() - i)
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

    #[test]
    fn the_open_end_of_a_piece_is_the_longest_start_of_the_secret() {
        assert_eq!(open_prefix(b"data: sk-sec", b"sk-secret-1"), 6);
        assert_eq!(open_prefix(b"data: s", b"sk-secret-1"), 1);
        assert_eq!(open_prefix(b"data: x\n\n", b"sk-secret-1"), 0);
        // The whole secret at the end is masked already, not held.
        assert_eq!(open_prefix(b"sk-secret-1", b"sk-secret-1"), 0);
        assert_eq!(open_prefix(b"", b"sk-secret-1"), 0);
    }
}
