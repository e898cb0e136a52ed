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

use crate::estimate::Tokenizer;

/// Byte classes, as bit flags so a set of classes is one mask test. Non-ASCII bytes never
/// reach the matchers (they are classed as punctuation for safety).
const LOWER: u8 = 1;
const UPPER: u8 = 2;
const DIGIT: u8 = 4;
const SPACE: u8 = 8;
const CRLF: u8 = 16;
/// `\t`, `\x0B`, `\x0C`: whitespace that is neither the space nor a line break.
const WS: u8 = 32;
/// Anything else: punctuation, symbols, other control characters.
const OTHER: u8 = 64;
/// Past the end of the text.
const END: u8 = 0;

const LETTER: u8 = LOWER | UPPER;
const WHITESPACE: u8 = SPACE | CRLF | WS;
/// `[^\r\n\p{L}\p{N}]`
const PREFIX: u8 = SPACE | WS | OTHER;

const CLASS: [u8; 256] = {
    let mut t = [OTHER; 256];
    let mut i = 0;
    while i < 128 {
        t[i] = match i as u8 {
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
    pos: usize,
    o200k: bool,
}

/// The high bit of each byte of a little-endian word (the word-at-a-time scans below).
const HIGH: u64 = 0x8080_8080_8080_8080;

/// End of the run of ASCII lowercase letters at `j`, eight bytes at a time: in each byte of a
/// word, adding `0x80 - b'a'` sets the high bit from `a` up and adding `0x80 - b'z' - 1` from
/// past `z`; a byte with its own high bit set (not ASCII) is never a letter. An addition
/// carries into the next byte only from a byte that is not a letter, and the first such byte
/// ends the run before any byte it could have changed.
#[inline(always)]
fn lowercase_run(b: &[u8], mut j: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    while let Some(w) = b.get(j..j + 8) {
        let x = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        let from_a = x.wrapping_add(ONES * u64::from(0x80 - b'a'));
        let past_z = x.wrapping_add(ONES * u64::from(0x80 - b'z' - 1));
        let not_lower = (!(from_a & !past_z) | x) & HIGH;
        if not_lower != 0 {
            return j + (not_lower.trailing_zeros() / 8) as usize;
        }
        j += 8;
    }
    while b.get(j).is_some_and(u8::is_ascii_lowercase) {
        j += 1;
    }
    j
}

impl<'a> AsciiSplit<'a> {
    /// `s` must be ASCII; `tok` must be `O200k` or `Cl100k` (`Chars` splits like `Cl100k`).
    pub(crate) fn new(tok: Tokenizer, s: &'a str) -> Self {
        debug_assert!(s.is_ascii());
        AsciiSplit {
            b: s.as_bytes(),
            pos: 0,
            o200k: tok == Tokenizer::O200k,
        }
    }

    #[inline(always)]
    fn class(&self, i: usize) -> u8 {
        match self.b.get(i) {
            Some(&c) => CLASS[usize::from(c)],
            None => END,
        }
    }

    /// End of the run of bytes in `mask` starting at `i`.
    #[inline(always)]
    fn run(&self, mut i: usize, mask: u8) -> usize {
        while let Some(&c) = self.b.get(i) {
            if CLASS[usize::from(c)] & mask == 0 {
                break;
            }
            i += 1;
        }
        i
    }

    /// Length of `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at `i`, 0 if none.
    #[inline(always)]
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
        let mut j = self.run(start, OTHER);
        // `[\r\n/]*`: a '/' can still follow once a line break has ended the OTHER run.
        while let Some(&c) = self.b.get(j) {
            if c == b'\r' || c == b'\n' || (self.o200k && c == b'/') {
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
        loop {
            let c = self.class(j);
            if c & WHITESPACE == 0 {
                break;
            }
            if c == CRLF {
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

    /// The shape of most English pieces, where both patterns agree: `[ ]?[A-Z]?[a-z]*` with at
    /// least one letter, followed by neither a letter nor an apostrophe (so no longer letter run
    /// and no contraction can extend it); or one punctuation byte followed by a space. `None`
    /// sends the caller to the full matcher.
    #[inline(always)]
    fn common_word(&self, i: usize) -> Option<usize> {
        let b = self.b;
        let first = *b.get(i)?;
        if CLASS[usize::from(first)] == OTHER {
            return (b.get(i + 1) == Some(&b' ')).then_some(i + 1);
        }
        let mut j = i + usize::from(first == b' ');
        let letters = j;
        if b.get(j).is_some_and(u8::is_ascii_uppercase) {
            j += 1;
        }
        j = lowercase_run(b, j);
        let ends_clean = match b.get(j) {
            None => true,
            Some(&c) => !c.is_ascii_alphabetic() && c != b'\'',
        };
        (j > letters && ends_clean).then_some(j)
    }

    /// End of the cl100k piece starting at `i`.
    fn next_cl100k(&self, i: usize) -> usize {
        let c = self.class(i);
        if c & LETTER != 0 {
            return self.run(i, LETTER);
        }
        let contraction = self.contraction(i);
        if contraction > 0 {
            return i + contraction;
        }
        if c & PREFIX != 0 && self.class(i + 1) & LETTER != 0 {
            return self.run(i + 1, LETTER);
        }
        if c == DIGIT {
            return self.run(i, DIGIT).min(i + 3);
        }
        self.punctuation(i).unwrap_or_else(|| self.whitespace(i))
    }

    /// End of the o200k piece starting at `i`.
    fn next_o200k(&self, i: usize) -> usize {
        let c = self.class(i);
        let j = if c & LETTER != 0 {
            i
        } else if c & PREFIX != 0 && self.class(i + 1) & LETTER != 0 {
            i + 1
        } else if c == DIGIT {
            return self.run(i, DIGIT).min(i + 3);
        } else {
            return self.punctuation(i).unwrap_or_else(|| self.whitespace(i));
        };
        // `[Lu]*[Ll]+('s|..)?`, else `[Lu]+[Ll]*('s|..)?` (and then `[Ll]*` is empty).
        let k = self.run(j, UPPER);
        let end = self.run(k, LOWER);
        end + self.contraction(end)
    }
}

impl<'a> Iterator for AsciiSplit<'a> {
    /// Pieces as bytes (they are ASCII, hence valid UTF-8): that is what BPE consumes.
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let start = self.pos;
        if start >= self.b.len() {
            return None;
        }
        let end = match self.common_word(start) {
            Some(end) => end,
            None if self.o200k => self.next_o200k(start),
            None => self.next_cl100k(start),
        };
        // Every branch consumes at least one byte; guard anyway so a bug cannot loop forever.
        let end = end.clamp(start + 1, self.b.len());
        self.pos = end;
        self.b.get(start..end)
    }
}

/// Where the first byte that is not ASCII is, eight bytes at a time (a text is mostly
/// ASCII, and this runs over all of it).
fn first_non_ascii(b: &[u8]) -> Option<usize> {
    let mut words = b.chunks_exact(8);
    let mut at = 0;
    for w in &mut words {
        let x = u64::from_le_bytes(w.try_into().unwrap_or([0; 8])) & HIGH;
        if x != 0 {
            return Some(at + (x.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    words
        .remainder()
        .iter()
        .position(|c| !c.is_ascii())
        .map(|p| at + p)
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
        let Some(off) = b.get(start..).and_then(first_non_ascii) else {
            pos = b.len();
            return s.get(start..).map(|c| (c, true));
        };
        let first = start + off;
        // Back up to the last safe cut before the non-ASCII byte, forward to the next one after.
        let cut_before = (start + 1..=first)
            .rev()
            .find(|&p| safe_cut(p))
            .unwrap_or(start);
        let cut_after = (first + 1..b.len())
            .find(|&p| safe_cut(p))
            .unwrap_or(b.len());
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

/// The fast paths must give exactly the library's pieces and counts.
#[cfg(test)]
mod tests {
    use super::{first_non_ascii, lowercase_run, AsciiSplit};
    use crate::estimate::count_text;
    use crate::estimate::Tokenizer;

    const O: Tokenizer = Tokenizer::O200k;
    const C: Tokenizer = Tokenizer::Cl100k;

    /// A tiny deterministic generator, so failures reproduce.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 16) as usize
        }
        fn text(&mut self, alphabet: &[&str], max_len: usize) -> String {
            let len = self.next() % max_len;
            (0..len)
                .map(|_| alphabet[self.next() % alphabet.len()])
                .collect()
        }
    }

    const TRICKY: &[&str] = &[
        "a", "b", "Z", "Q", "e", "s", "l", "L", "r", "E", "t", "D", "0", "7", "42", " ", " ", "  ",
        "\t", "\n", "\r", "\r\n", "\x0B", "\x0C", "\x1C", "\x00", "\x7F", "'", "'s", "'LL", "'re",
        "'Ve", "'d", "'M", ".", ",", "!", "/", "//", "-", "_", "(", "\"", "#", "$", "...", "?\n",
        " ,", "Hello", "world", "HTTP", "don't", "I'm", "ABCdef", "aBC", "x1",
    ];
    const NON_ASCII: &[&str] = &[
        "é", "日本", "—", "’s", "\u{a0}", "\u{2028}", "😀", "ß", "Ünï",
    ];

    fn lib(tok: Tokenizer) -> &'static bpe_openai::Tokenizer {
        if tok == O {
            bpe_openai::o200k_base()
        } else {
            bpe_openai::cl100k_base()
        }
    }

    #[test]
    fn ascii_pretokenizer_matches_the_library_regex() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let all_ascii: Vec<String> = (0u8..128).map(|b| char::from(b).to_string()).collect();
        let mut alphabet: Vec<&str> = all_ascii.iter().map(String::as_str).collect();
        alphabet.extend_from_slice(TRICKY);
        for tok in [O, C] {
            for i in 0..6000 {
                let s = rng.text(if i % 2 == 0 { TRICKY } else { &alphabet }, 40);
                let ours: Vec<&str> = AsciiSplit::new(tok, &s)
                    .filter_map(|p| std::str::from_utf8(p).ok())
                    .collect();
                let theirs: Vec<&str> = lib(tok).split(&s).collect();
                assert_eq!(ours, theirs, "{tok:?} split of {s:?}");
            }
        }
    }

    #[test]
    fn fast_count_equals_library_count_on_mixed_text() {
        let mut rng = Rng(12345);
        let mut alphabet: Vec<&str> = TRICKY.to_vec();
        alphabet.extend_from_slice(NON_ASCII);
        alphabet.extend_from_slice(&[" word", " Word", "x ", " y"]);
        for tok in [O, C] {
            for max in [60, 3000] {
                for _ in 0..300 {
                    let s = rng.text(&alphabet, max);
                    assert_eq!(
                        count_text(tok, &s),
                        lib(tok).count(s.as_str()) as u64,
                        "{tok:?} {s:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn long_text_with_cache_equals_library_count() {
        let para = "The quick brown fox jumps over the lazy dog's back; it's 2024, naïve café. ";
        // Pieces longer than the cache/vocabulary key limit, and repeats of them.
        let long = "Supercalifragilisticexpialidocious ==================================== \
                    12345678901234567890                                  done.\n";
        for text in [
            para.repeat(200),
            long.repeat(60),
            format!("{}{}", long.repeat(3), para.repeat(40)),
        ] {
            for tok in [O, C] {
                assert_eq!(count_text(tok, &text), lib(tok).count(text.as_str()) as u64);
            }
        }
    }

    #[test]
    fn lowercase_runs_end_at_the_first_byte_that_is_not_a_lowercase_letter() {
        // Every byte value at every position of a run longer than one word, and at its end.
        for len in 0..20usize {
            for at in 0..=len {
                for c in 0..=255u8 {
                    let mut b = vec![b'q'; len];
                    b.insert(at, c);
                    b.extend_from_slice(b"zz");
                    let want = b
                        .iter()
                        .position(|x| !x.is_ascii_lowercase())
                        .unwrap_or(b.len());
                    assert_eq!(lowercase_run(&b, 0), want, "len {len} at {at} byte {c}");
                }
            }
        }
    }

    #[test]
    fn the_first_byte_that_is_not_ascii_is_found_wherever_it_is() {
        for len in 0..40usize {
            let ascii = vec![b'a'; len];
            assert_eq!(first_non_ascii(&ascii), None, "{len}");
            for at in 0..len {
                for c in [0x80u8, 0xC3, 0xFF] {
                    let mut b = ascii.clone();
                    b[at] = c;
                    if at + 1 < len {
                        b[len - 1] = 0xE2;
                    }
                    assert_eq!(first_non_ascii(&b), Some(at), "len {len} at {at}");
                }
            }
        }
    }
}
