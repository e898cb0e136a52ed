//! "Is this piece one whole token?" in a single hash lookup.
//!
//! Most pre-tokenized pieces of English (" the", " manual", ".") are a token of the vocabulary
//! by themselves, and a BPE whose every token encodes to itself (which `bpe` asserts when it
//! builds these dictionaries) encodes such a piece as exactly that one token. tiktoken's own
//! encoder takes the same shortcut. A lookup is ~20x cheaper than running the BPE, which
//! allocates twice per piece.
//!
//! The sets are built lazily, once, the first time a tokenizer is used (or by `warm_up`): about
//! 20 ms and 4 MB for o200k, half that for cl100k, next to the ~100 MB of the BPE tables
//! themselves. Only tokens of at most [`MAX_PIECE`] bytes are kept, since longer pieces are
//! never looked up. Hashing is a fixed fast hash rather than SipHash: the table never changes
//! after start-up, so crafted input cannot make it degrade.

use bpe_openai::Tokenizer as BpeTokenizer;
use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::LazyLock;

/// Longest piece the estimator looks up (in the vocabulary and in its per-text memo).
pub(crate) const MAX_PIECE: usize = 24;

/// Every token of a vocabulary that is at most [`MAX_PIECE`] bytes long.
pub(crate) type VocabSet = HashSet<&'static [u8], BuildHasherDefault<PieceHasher>>;

static O200K: LazyLock<VocabSet> = LazyLock::new(|| build(bpe_openai::o200k_base()));
static CL100K: LazyLock<VocabSet> = LazyLock::new(|| build(bpe_openai::cl100k_base()));

/// The single-token set of the tokenizer `bpe` is (by address) `o200k_base` or `cl100k_base`.
pub(crate) fn vocab_for(bpe: &'static BpeTokenizer) -> Option<&'static VocabSet> {
    if std::ptr::eq(bpe, bpe_openai::o200k_base()) {
        Some(&O200K)
    } else if std::ptr::eq(bpe, bpe_openai::cl100k_base()) {
        Some(&CL100K)
    } else {
        None
    }
}

fn build(bpe: &'static BpeTokenizer) -> VocabSet {
    let n = bpe.bpe.num_tokens();
    let mut set = VocabSet::with_capacity_and_hasher(n, BuildHasherDefault::default());
    for id in 0..n {
        let Ok(id) = u32::try_from(id) else { break };
        let bytes = bpe.bpe.token_bytes(id);
        if bytes.len() <= MAX_PIECE {
            set.insert(bytes);
        }
    }
    set
}

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

fn load8(b: &[u8], i: usize) -> u64 {
    b.get(i..i + 8)
        .and_then(|w| w.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn load4(b: &[u8], i: usize) -> u64 {
    b.get(i..i + 4)
        .and_then(|w| w.try_into().ok())
        .map_or(0, |w| u64::from(u32::from_le_bytes(w)))
}

/// `Hasher` over [`hash_piece`]; `Hash for [u8]` writes the length, then the bytes in one go.
#[derive(Default)]
pub(crate) struct PieceHasher(u64);

impl Hasher for PieceHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = self.0.rotate_left(23) ^ hash_piece(bytes);
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = self.0.rotate_left(23) ^ (n as u64).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}
