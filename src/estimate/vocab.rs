//! The estimator's hash of short byte strings (pieces of text, vocabulary tokens).
//!
//! Most pre-tokenized pieces of English (" the", " manual", ".") are a token of the vocabulary
//! by themselves; `ranks` answers "is this piece a token, and which" with one lookup in a table
//! hashed by [`hash_piece`], and `count` remembers pieces per thread with the same hash. It is a
//! fixed fast hash rather than SipHash: the vocabulary never changes after start-up and the memo
//! is direct-mapped (a collision costs a miss), so crafted input cannot make either degrade
//! beyond a probe sequence bounded by the table's load factor.

/// A quick multiplicative hash of a short byte string, from (overlapping) 8- or 4-byte loads
/// that together cover every byte of keys up to 24 bytes.
#[inline]
pub(crate) fn hash_piece(b: &[u8]) -> u64 {
    const K1: u64 = 0x9E37_79B9_7F4A_7C15;
    const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    let n = b.len();
    let (lo, hi) = match n {
        0 => (0, 0),
        1..=3 => {
            let byte = |i: usize| u64::from(b.get(i).copied().unwrap_or(0));
            (byte(0) | byte(n / 2) << 8 | byte(n - 1) << 16, 0)
        }
        4..=7 => (load4(b, 0), load4(b, n - 4)),
        8..=16 => (load8(b, 0), load8(b, n - 8)),
        _ => (load8(b, 0) ^ load8(b, 8).rotate_left(29), load8(b, n - 8)),
    };
    let h = (lo ^ n as u64).wrapping_mul(K1) ^ hi.wrapping_mul(K2);
    // Fold the well-mixed high bits down into the low bits, where table indices come from.
    h ^ (h >> 32) ^ (h >> 45)
}

pub(crate) fn load8(b: &[u8], i: usize) -> u64 {
    b.get(i..i + 8)
        .and_then(|w| w.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

pub(crate) fn load4(b: &[u8], i: usize) -> u64 {
    b.get(i..i + 4)
        .and_then(|w| w.try_into().ok())
        .map_or(0, |w| u64::from(u32::from_le_bytes(w)))
}

/// Byte equality of two short strings with the same word loads as [`hash_piece`] instead of a
/// `memcmp` call (tokens and pieces are mostly under 16 bytes); longer ones compare as slices.
#[inline]
pub(crate) fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    match n {
        0 => true,
        1..=3 => a.first() == b.first() && a.get(n / 2) == b.get(n / 2) && a.last() == b.last(),
        4..=7 => load4(a, 0) == load4(b, 0) && load4(a, n - 4) == load4(b, n - 4),
        8..=16 => load8(a, 0) == load8(b, 0) && load8(a, n - 8) == load8(b, n - 8),
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_byte_equality_sees_every_byte() {
        for n in 0..40usize {
            let a: Vec<u8> = (0..n as u8).map(|i| i.wrapping_mul(37) ^ 0x5A).collect();
            assert!(same_bytes(&a, &a.clone()), "{n}");
            for i in 0..n {
                let mut b = a.clone();
                b[i] ^= 0x01;
                assert!(!same_bytes(&a, &b), "len {n}, byte {i}");
            }
            let mut longer = a.clone();
            longer.push(0);
            assert!(!same_bytes(&a, &longer), "{n}");
        }
    }
}
