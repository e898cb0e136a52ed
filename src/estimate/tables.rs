//! The two BPE tokenizers the estimator counts with, each built once, on first use: the
//! vocabulary ([`Ranks`], from `data/*.tokens`) and the tiktoken pre-tokenizer regex for text
//! that is not ASCII (ASCII is split by hand in `pretok`). A policy that names one tokenizer
//! never builds the other.

use super::ranks::Ranks;
use crate::estimate::Tokenizer;
use bpe_openai::byte_pair_encoding::BytePairEncoding;
use std::sync::LazyLock;

/// One tokenizer's tables.
pub(crate) struct Tables {
    pub ranks: Ranks,
    /// `bpe-openai`'s pre-tokenizer (the regex is all it is used for: it is built on a
    /// 256-token byte alphabet, not the vocabulary). `None` only if the regex failed to
    /// compile, which tests rule out; text is then counted unsplit.
    pub split: Option<bpe_openai::Tokenizer>,
}

static O200K: LazyLock<Tables> = LazyLock::new(|| Tables {
    ranks: Ranks::parse(include_bytes!("data/o200k_base.tokens")),
    split: splitter(&[(&O200K_PAT1.join("|"), false), (PAT2, true), (PAT3, false)]),
});

static CL100K: LazyLock<Tables> = LazyLock::new(|| Tables {
    ranks: Ranks::parse(include_bytes!("data/cl100k_base.tokens")),
    split: splitter(&[(CL100K_PAT1, false), (PAT2, true), (PAT3, false)]),
});

/// The tables of a BPE tokenizer (`None` for `Chars`).
pub(crate) fn tables(tok: Tokenizer) -> Option<&'static Tables> {
    match tok {
        Tokenizer::O200k => Some(&O200K),
        Tokenizer::Cl100k => Some(&CL100K),
        Tokenizer::Chars => None,
    }
}

// The patterns of `bpe-openai` 0.3 (tiktoken's, with `\s+(?!\S)` rewritten as a one-character
// look-ahead pattern, PAT2, whose last character the splitter drops).
const CL100K_PAT1: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+$";
const O200K_PAT1: [&str; 6] = [
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "\\p{N}{1,3}",
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*",
    "\\s*[\\r\\n]+",
    "\\s+$",
];
const PAT2: &str = "\\s+\\s";
const PAT3: &str = "\\s+";

fn splitter(patterns: &[(&str, bool)]) -> Option<bpe_openai::Tokenizer> {
    let bytes = BytePairEncoding::from_dictionary(
        (0..=255u8).map(|b| vec![b]),
        Some(17_846_336_922_010_275_747),
    );
    bpe_openai::Tokenizer::new_lookahead(bytes, patterns, false).ok()
}
