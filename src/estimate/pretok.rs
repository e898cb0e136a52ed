//! A fast, exact pre-tokenizer for ASCII text, so a 100 KB prompt costs well under 1 ms.
//!
//! `bpe-openai` splits text with its tiktoken-compatible regex before byte-pair encoding each
//! piece. On English text that regex is about half of the counting time (one anchored regex
//! search per ~6-byte piece), and BPE-encoding each piece (two small allocations each) is the
//! other half. This module replaces the first half for ASCII text with a hand-written matcher
//! of the same pattern, and [`super::count`] memoizes the second half per repeated piece.
//!
//! The matchers below transcribe the `cl100k_base` and `o200k_base` patterns restricted to
//! ASCII (where `\p{L}` is `[A-Za-z]`, `\p{Lu}` is `[A-Z]`, `\p{Ll}` is `[a-z]`, `\p{N}` is
//! `[0-9]`, `\s` is `[\t\n\x0B\x0C\r ]`), alternative by alternative, in leftmost-first order.
//! Tests check them piece-for-piece against the library's regex on random ASCII.
//!
//! Non-ASCII text goes through the library's regex. A mixed string is cut into ASCII and
//! non-ASCII chunks only at positions `p` where `s[p-1]` is an ASCII letter, `s[p]` is a space
//! and `s[p+1]` is an ASCII letter: no alternative of either pattern can match a letter
//! followed by a space, so the regex always ends a piece at `p`, and since its search is anchored
//! with no look-behind, the pieces after `p` do not depend on what precedes it.

use crate::policy::Tokenizer;

/// Byte classes. Non-ASCII bytes never reach the matchers.
const LOWER: u8 = 1;
const UPPER: u8 = 2;
const DIGIT: u8 = 3;
const SPACE: u8 = 4;
const CRLF: u8 = 5;
/// `\t`, `\x0B`, `\x0C`: whitespace that is neither the space nor a line break.
const WS: u8 = 6;
/// Anything else: punctuation, symbols, other control characters.
const OTHER: u8 = 7;

const CLASS: [u8; 128] = {
    let mut t = [OTHER; 128];
    let mut i = 0;
    while i < 128 {
        let c = i as u8;
        t[i] = match c {
            b'a'..=b'z' => LOWER,
            b'A'..=b'Z' => UPPER,
            b'0'..=b'9' => DIGIT,
            b' ' => SPACE,
            b'\r' | b'\n' => CRLF,
            b'\t' | 0x0B | 0x0C => WS,
            _ => OTHER,
        };
        i += 1;
    }
    t
};

/// A pre-tokenizer for ASCII input, one alternative-for-alternative copy of a tiktoken regex.
pub(crate) struct AsciiSplit<'a> {
    b: &'a [u8],
    s: &'a str,
    pos: usize,
    o200k: bool,
}

impl<'a> AsciiSplit<'a> {
    /// `s` must be ASCII; `tok` must be `O200k` or `Cl100k` (`Chars` splits like `Cl100k`).
    pub(crate) fn new(tok: Tokenizer, s: &'a str) -> Self {
        debug_assert!(s.is_ascii());
        AsciiSplit { b: s.as_bytes(), s, pos: 0, o200k: tok == Tokenizer::O200k }
    }

    fn class(&self, i: usize) -> u8 {
        match self.b.get(i) {
            Some(&c) if c < 128 => CLASS[usize::from(c)],
            Some(_) => OTHER,
            None => 0,
        }
    }

    fn is_letter(&self, i: usize) -> bool {
        matches!(self.class(i), LOWER | UPPER)
    }

    /// `[^\r\n\p{L}\p{N}]`
    fn is_prefix(&self, i: usize) -> bool {
        matches!(self.class(i), SPACE | WS | OTHER)
    }

    fn run(&self, mut i: usize, pred: impl Fn(u8) -> bool) -> usize {
        while i < self.b.len() && pred(self.class(i)) {
            i += 1;
        }
        i
    }

    /// Length of `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at `i`, 0 if none.
    fn contraction(&self, i: usize) -> usize {
        if self.b.get(i) != Some(&b'\'') {
            return 0;
        }
        let lower = |j: usize| self.b.get(j).map(u8::to_ascii_lowercase);
        match lower(i + 1) {
            Some(b's' | b't' | b'm' | b'd') => 2,
            Some(b'r' | b'v') if lower(i + 2) == Some(b'e') => 3,
            Some(b'l') if lower(i + 2) == Some(b'l') => 3,
            _ => 0,
        }
    }

    /// ` ?[^\s\p{L}\p{N}]+` followed by `[\r\n]*` (cl100k) or `[\r\n/]*` (o200k); `None` if
    /// it does not match at `i`.
    fn punctuation(&self, i: usize) -> Option<usize> {
        let start = match self.class(i) {
            OTHER => i,
            SPACE if self.class(i + 1) == OTHER => i + 1,
            _ => return None,
        };
        let end = self.run(start, |c| c == OTHER);
        let o200k = self.o200k;
        let mut j = end;
        while let Some(&c) = self.b.get(j) {
            if c == b'\r' || c == b'\n' || (o200k && c == b'/') {
                j += 1;
            } else {
                break;
            }
        }
        Some(j)
    }

    /// The whitespace alternatives, at a whitespace byte `i`:
    /// `\s*[\r\n]+ | \s+$ | \s+(?!\S) | \s+`.
    fn whitespace(&self, i: usize) -> usize {
        let mut j = i;
        let mut last_break = None;
        while j < self.b.len() && matches!(self.class(j), SPACE | CRLF | WS) {
            if self.class(j) == CRLF {
                last_break = Some(j);
            }
            j += 1;
        }
        match last_break {
            Some(k) => k + 1,
            None if j == self.b.len() => j,
            None if j - i >= 2 => j - 1,
            None => j,
        }
    }

    /// End of the cl100k piece starting at `i`.
    fn next_cl100k(&self, i: usize) -> usize {
        let c = self.class(i);
        let contraction = self.contraction(i);
        if contraction > 0 {
            return i + contraction;
        }
        if c == LOWER || c == UPPER {
            return self.run(i, |c| c == LOWER || c == UPPER);
        }
        if self.is_prefix(i) && self.is_letter(i + 1) {
            return self.run(i + 1, |c| c == LOWER || c == UPPER);
        }
        if c == DIGIT {
            return self.run(i, |c| c == DIGIT).min(i + 3);
        }
        self.punctuation(i).unwrap_or_else(|| self.whitespace(i))
    }

    /// End of the o200k piece starting at `i`.
    fn next_o200k(&self, i: usize) -> usize {
        let c = self.class(i);
        let letters_at = if c == LOWER || c == UPPER {
            Some(i)
        } else if self.is_prefix(i) && self.is_letter(i + 1) {
            Some(i + 1)
        } else {
            None
        };
        if let Some(j) = letters_at {
            // `[Lu]*[Ll]+('s|..)?`, else `[Lu]+[Ll]*('s|..)?` (and then `[Ll]*` is empty).
            let k = self.run(j, |c| c == UPPER);
            let end = if self.class(k) == LOWER { self.run(k, |c| c == LOWER) } else { k };
            return end + self.contraction(end);
        }
        if c == DIGIT {
            return self.run(i, |c| c == DIGIT).min(i + 3);
        }
        self.punctuation(i).unwrap_or_else(|| self.whitespace(i))
    }
}

impl<'a> Iterator for AsciiSplit<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let start = self.pos;
        if start >= self.b.len() {
            return None;
        }
        let end = if self.o200k { self.next_o200k(start) } else { self.next_cl100k(start) };
        // Every branch consumes at least one byte; guard anyway so a bug cannot loop forever.
        let end = end.clamp(start + 1, self.b.len());
        self.pos = end;
        self.s.get(start..end)
    }
}

/// Cuts `s` into consecutive chunks, each either all ASCII (`true`) or containing non-ASCII
/// (`false`), cutting only where the tokenizer's regex is guaranteed to end a piece.
pub(crate) fn chunks(s: &str) -> impl Iterator<Item = (&str, bool)> {
    let b = s.as_bytes();
    let safe_cut = move |p: usize| {
        p > 0
            && p + 1 < b.len()
            && b[p] == b' '
            && b[p - 1].is_ascii_alphabetic()
            && b[p + 1].is_ascii_alphabetic()
    };
    let mut pos = 0;
    let mut pending: Option<(usize, usize)> = None;
    std::iter::from_fn(move || {
        if let Some((a, z)) = pending.take() {
            pos = z;
            return s.get(a..z).map(|c| (c, false));
        }
        if pos >= b.len() {
            return None;
        }
        let start = pos;
        let Some(off) = b[start..].iter().position(|c| !c.is_ascii()) else {
            pos = b.len();
            return s.get(start..).map(|c| (c, true));
        };
        let first = start + off;
        // Back up to the last safe cut before the non-ASCII byte, forward to the next one after.
        let cut_before = (start + 1..=first).rev().find(|&p| safe_cut(p)).unwrap_or(start);
        let cut_after = (first + 1..b.len()).find(|&p| safe_cut(p)).unwrap_or(b.len());
        if cut_before > start {
            pending = Some((cut_before, cut_after));
            pos = cut_before;
            s.get(start..cut_before).map(|c| (c, true))
        } else {
            pos = cut_after;
            s.get(start..cut_after).map(|c| (c, false))
        }
    })
}
