//! Turning text into a token count.
//!
//! Every estimate bottoms out here: a string and a [`Tokenizer`] in, a token count out. The BPE
//! tokenizers come from `bpe-openai`, which is linear-time and matches tiktoken's
//! `encode_ordinary` exactly (special-token text such as `<|endoftext|>` is counted as plain
//! text). Its tokenizer tables live in `std::sync::LazyLock` statics inside that crate, so each
//! one is built at most once per process, on first use; so are our single-token sets
//! (`vocab`). [`warm_up`] moves that one-off cost from the first request to start-up.
//!
//! The library's own `count` runs a regex per piece and a full BPE per piece; we produce the
//! identical count about 3-4x faster on English by splitting ASCII text by hand (`pretok`),
//! answering whole-token pieces from a set (`vocab`), and remembering each piece's count
//! within one text (`PieceCache`). Tests check equality with the library on random input.

use super::{pretok, vocab};
use crate::policy::Tokenizer;
use bpe_openai::{cl100k_base, o200k_base, Tokenizer as BpeTokenizer};

/// Characters per token assumed by [`Tokenizer::Chars`] and by the JSON-length fallback.
pub const CHARS_PER_TOKEN: u64 = 4;

/// Number of tokens `s` encodes to under `tok`.
///
/// * `O200k` / `Cl100k`: the exact tiktoken count for `o200k_base` / `cl100k_base`.
/// * `Chars`: `ceil(chars / 4)`, where `chars` counts Unicode scalar values. The usual rule of
///   thumb for English; for models whose tokenizer we do not ship. It under-counts CJK and
///   other scripts that take more than one token per character.
pub fn count_text(tok: Tokenizer, s: &str) -> u64 {
    if s.is_empty() {
        return 0;
    }
    match tok {
        Tokenizer::O200k => bpe_count(o200k_base(), tok, s),
        Tokenizer::Cl100k => bpe_count(cl100k_base(), tok, s),
        Tokenizer::Chars => chars_to_tokens(to_u64(s.chars().count())),
    }
}

/// Number of tokens in response text, for when a provider reports no `usage` (an interrupted
/// stream, a provider that omits it). The same count as [`count_text`]; a separate name so call
/// sites say which side of the exchange they are pricing.
pub fn count_output_text(tok: Tokenizer, s: &str) -> u64 {
    count_text(tok, s)
}

/// Builds both BPE tokenizers now instead of on the first request that needs them.
/// Idempotent and cheap after the first call.
pub fn warm_up() {
    warm_up_for(Tokenizer::O200k);
    warm_up_for(Tokenizer::Cl100k);
}

/// Builds only the tokenizer `tok` needs (nothing for `Chars`); for a sidecar whose policy
/// names a single tokenizer and wants to spare the memory of the other.
pub fn warm_up_for(tok: Tokenizer) {
    // Dereferencing the LazyLock inside `*_base()` forces construction; counting a short
    // string also touches the pre-tokenizer regex so its lazy caches are populated.
    let _ = count_text(tok, "warm up");
    let _ = count_text(tok, "warm up, naïve café");
}

/// `bpe.count(s)`, faster: ASCII runs are split by [`pretok::AsciiSplit`] instead of the
/// library's regex, and pieces are counted through [`PieceCache`]. Gives exactly the
/// library's `Tokenizer::count` (tested).
fn bpe_count(bpe: &'static BpeTokenizer, kind: Tokenizer, s: &str) -> u64 {
    let normalized = bpe.normalize(s);
    let s = normalized.as_str();
    let mut cache = PieceCache::new(s.len(), vocab::vocab_for(bpe));
    let mut total: u64 = 0;
    for (chunk, ascii) in pretok::chunks(s) {
        if ascii {
            for piece in pretok::AsciiSplit::new(kind, chunk) {
                total = total.saturating_add(cache.count(bpe, piece));
            }
        } else {
            for piece in bpe.split(chunk) {
                total = total.saturating_add(cache.count(bpe, piece.as_bytes()));
            }
        }
    }
    total
}

/// Per-piece counting with two shortcuts before running the BPE: a piece that is a whole
/// vocabulary token counts 1 ([`vocab`]), and in long texts each piece's count is remembered.
/// English repeats its words, so most pieces of a long prompt are hits. The memo is
/// direct-mapped: a slot holds the last piece that hashed to it, so a collision (accidental or
/// crafted) only costs a miss, never more than counting uncached.
struct PieceCache<'a> {
    slots: Vec<Option<(&'a [u8], u32)>>,
    vocab: Option<&'static vocab::VocabSet>,
}

impl<'a> PieceCache<'a> {
    /// Texts shorter than this are counted without a memo.
    const MIN_TEXT: usize = 2048;
    /// Slot count bounds (powers of two); in between, one slot per 16 bytes of text.
    const MIN_SLOTS: usize = 512;
    const MAX_SLOTS: usize = 16384;

    fn new(text_len: usize, vocab: Option<&'static vocab::VocabSet>) -> Self {
        let slots = if text_len >= Self::MIN_TEXT {
            let n = (text_len / 16)
                .next_power_of_two()
                .clamp(Self::MIN_SLOTS, Self::MAX_SLOTS);
            vec![None; n]
        } else {
            Vec::new()
        };
        PieceCache { slots, vocab }
    }

    #[inline]
    fn count(&mut self, bpe: &BpeTokenizer, piece: &'a [u8]) -> u64 {
        if piece.len() > vocab::MAX_PIECE {
            return to_u64(bpe.bpe.count(piece));
        }
        let mask = self.slots.len().wrapping_sub(1);
        let slot = self.slots.get_mut(vocab::hash_piece(piece) as usize & mask);
        if let Some(Some((key, n))) = slot.as_deref() {
            if *key == piece {
                return u64::from(*n);
            }
        }
        let n = if self.vocab.is_some_and(|v| v.contains(piece)) {
            1
        } else {
            to_u64(bpe.bpe.count(piece))
        };
        if let Some(slot) = slot {
            *slot = Some((piece, u32::try_from(n).unwrap_or(u32::MAX)));
        }
        n
    }
}

/// `ceil(chars / 4)`.
pub(crate) fn chars_to_tokens(chars: u64) -> u64 {
    chars.div_ceil(CHARS_PER_TOKEN)
}

/// Conservative token count for a JSON value we do not understand (audio, files, unknown
/// parts): the length of its compact serialization in characters, divided by four, rounded up.
pub(crate) fn json_fallback_tokens(v: &serde_json::Value) -> u64 {
    chars_to_tokens(json_chars(v))
}

/// Tokens of the compact JSON serialization of `v` under `tok` (for schema fragments that are
/// rendered into the prompt more or less verbatim).
pub(crate) fn json_tokens(tok: Tokenizer, v: &serde_json::Value) -> u64 {
    match v {
        serde_json::Value::String(s) => count_text(tok, s),
        other => count_text(tok, &other.to_string()),
    }
}

/// Characters in the compact JSON serialization of `v`, counted without building the string.
pub(crate) fn json_chars(v: &serde_json::Value) -> u64 {
    let mut counter = CharCounter(0);
    // Writing a `Value` into an infallible writer cannot fail; if it somehow did, the count so
    // far is still a usable (lower) estimate.
    let _ = serde_json::to_writer(&mut counter, v);
    counter.0
}

/// An `io::Write` that only counts UTF-8 characters (bytes that are not continuation bytes).
struct CharCounter(u64);

impl std::io::Write for CharCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let chars = buf.iter().filter(|b| (**b & 0xC0) != 0x80).count();
        self.0 = self.0.saturating_add(to_u64(chars));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `usize` → `u64` without a cast that could silently truncate on exotic targets.
pub(crate) fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}
