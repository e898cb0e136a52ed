//! One pass over a buffered OpenAI-shaped answer, without serde: is it a JSON object with
//! `choices` (or `data`) as an array, where is its `usage`, and what does it say of itself
//! (the response model, the finish reasons). Used by [`super::validate`] as a fast path.
//!
//! The scanner is exact only where it answers: it validates the whole body with the same
//! grammar serde_json applies to the values it skips (strings without control characters and
//! with valid escapes, numbers, literals, nesting), and answers only for the plain shape. On
//! anything else (a malformed body, a key written with escapes, a duplicate known key, `null`
//! for `choices`, deep nesting, a value it would have to decode) it gives up (`None`) and the
//! caller parses with serde_json, which then decides. So an answer it accepts is one serde
//! accepts, with the same result (a differential test checks this on many mutated bodies).

use crate::stream::{PromptDetails, StreamUsage};

/// What the scan found in an answer it accepted.
#[derive(Debug, Default)]
pub struct Scanned<'a> {
    /// `choices` is present (an array).
    pub choices: bool,
    /// `data` is present (an array).
    pub data: bool,
    /// The raw `usage` value (valid UTF-8), if present.
    pub usage: Option<&'a [u8]>,
    /// `model`, when a short string without escapes.
    pub model: Option<&'a str>,
    /// Each choice's `finish_reason`, when a short string without escapes, in order.
    pub finish: super::validate::Reasons<'a>,
}

/// Deeper nesting is left to serde_json (whose limit is 128).
const MAX_DEPTH: u32 = 100;

/// Longest `model` or finish reason kept (longer ones are left out, as serde's path does).
const MAX_NAME: usize = 128;

/// The bytes that end a run of plain string bytes: the quote, the backslash and the control
/// characters.
static SPECIAL: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 0x20 {
        t[c] = true;
        c += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

/// The index of the first quote, backslash or control character in `s`: eight bytes at a time
/// (SWAR), the tail by the table. Of each word's flagged bytes the lowest is always a true one
/// (a borrow only runs upward from a true match), and the lowest is the one taken.
#[inline]
pub(crate) fn special_at(s: &[u8]) -> Option<usize> {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let mut i = 0;
    while let Some(chunk) = s.get(i..i + 8) {
        let w = u64::from_le_bytes(chunk.try_into().ok()?);
        let q = w ^ (LO * u64::from(b'"'));
        let b = w ^ (LO * u64::from(b'\\'));
        let t = ((q.wrapping_sub(LO) & !q)
            | (b.wrapping_sub(LO) & !b)
            | (w.wrapping_sub(LO * 0x20) & !w))
            & HI;
        if t != 0 {
            return Some(i + (t.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    s[i..]
        .iter()
        .position(|&c| SPECIAL[usize::from(c)])
        .map(|n| i + n)
}

struct P<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> P<'a> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    #[inline]
    fn eat(&mut self, c: u8) -> Option<()> {
        if self.peek()? == c {
            self.i += 1;
            Some(())
        } else {
            None
        }
    }

    /// A string at `self.i` (its opening quote): the raw bytes inside the quotes, and whether
    /// they hold an escape. Control characters are refused and escapes checked as serde_json
    /// checks the strings it skips; UTF-8 is not checked here.
    fn string(&mut self) -> Option<(&'a [u8], bool)> {
        self.eat(b'"')?;
        let start = self.i;
        let mut escaped = false;
        loop {
            // Plain bytes are the common case: eight at a time.
            let rest = self.b.get(self.i..)?;
            let n = special_at(rest)?;
            self.i += n;
            match rest[n] {
                b'"' => {
                    let s = &self.b[start..self.i];
                    self.i += 1;
                    return Some((s, escaped));
                }
                b'\\' => {}
                _ => return None, // a control character
            }
            escaped = true;
            self.i += 1;
            match self.peek()? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.i += 1,
                b'u' => {
                    let hex = self.b.get(self.i + 1..self.i + 5)?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return None;
                    }
                    self.i += 5;
                }
                _ => return None,
            }
        }
    }

    /// `-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?`
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            self.digits1()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            self.digits1()?;
        }
        // serde_json refuses a digit right after a leading zero; so does the grammar here,
        // as the caller then finds no separator.
        Some(())
    }

    /// A count: `null`, or an integer that fits a `u64` (anything else gives up).
    fn count(&mut self) -> Option<Option<u64>> {
        if self.peek()? == b'n' {
            self.literal(b"null")?;
            return Some(None);
        }
        let at = self.i;
        self.number()?;
        let digits = &self.b[at..self.i];
        if digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let mut n: u64 = 0;
        for &d in digits {
            n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
        }
        Some(Some(n))
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
    }

    fn digits1(&mut self) -> Option<()> {
        let at = self.i;
        self.digits();
        (self.i > at).then_some(())
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        if self.b.get(self.i..self.i + word.len())? == word {
            self.i += word.len();
            Some(())
        } else {
            None
        }
    }

    /// Skips any value (validating it).
    fn value(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'{' => self.object(depth + 1, |p, _, _| p.value(depth + 1)),
            b'[' => self.array(depth + 1, |p| p.value(depth + 1)),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    /// An object at `self.i`: `each` reads the value of every key (given raw, and whether it
    /// holds escapes), with `self.i` at the value.
    fn object(
        &mut self,
        depth: u32,
        mut each: impl FnMut(&mut Self, &'a [u8], bool) -> Option<()>,
    ) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(b'{')?;
        self.ws();
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            let (k, escaped) = self.string()?;
            self.ws();
            self.eat(b':')?;
            self.ws();
            each(self, k, escaped)?;
            self.ws();
            match self.peek()? {
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    fn array(&mut self, depth: u32, mut each: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(b'[')?;
        self.ws();
        if self.eat(b']').is_some() {
            return Some(());
        }
        loop {
            each(self)?;
            self.ws();
            match self.peek()? {
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                b']' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A value serde decodes (`deserialize_any`) rather than skips: a string as `&str` when
    /// it is short, any other value skipped and read as no name. What serde would decode and
    /// might refuse gives up (`None`): a string with escapes (which may be lone surrogates) or
    /// bytes that are not UTF-8, a number that is not a short integer (a float may be out of
    /// range), an object with such a key (serde decodes the keys of a map it visits). Arrays
    /// are skipped by serde too.
    fn name(&mut self, depth: u32) -> Option<Option<&'a str>> {
        match self.peek()? {
            b'"' => {}
            b'-' | b'0'..=b'9' => {
                let at = self.i;
                self.number()?;
                let n = &self.b[at..self.i];
                let short = n.len() <= 18 && !n.iter().any(|c| matches!(c, b'.' | b'e' | b'E'));
                return short.then_some(None);
            }
            // serde visits the map: its keys are decoded (UTF-8, escapes), its values skipped.
            b'{' => {
                self.object(depth + 1, |p, k, escaped| {
                    if escaped {
                        return None;
                    }
                    std::str::from_utf8(k).ok()?;
                    p.value(depth + 1)
                })?;
                return Some(None);
            }
            _ => {
                self.value(depth)?;
                return Some(None);
            }
        }
        let (s, escaped) = self.string()?;
        if escaped {
            return None;
        }
        let s = std::str::from_utf8(s).ok()?;
        Some((s.len() <= MAX_NAME).then_some(s))
    }
}

/// Scans `body`; `said`: also read the model and the finish reasons. `None`: not answered
/// here (the caller parses with serde_json).
pub fn answer(body: &[u8], said: bool) -> Option<Scanned<'_>> {
    let mut p = P { b: body, i: 0 };
    let mut out = Scanned::default();
    let mut seen = [false; 4];
    p.ws();
    p.object(1, |p, k, escaped| {
        let slot = match k {
            b"choices" => 0,
            b"data" => 1,
            b"model" => 2,
            b"usage" => 3,
            // A key with escapes could spell a known one; one that is not UTF-8 makes serde
            // refuse the body: both are left to serde.
            _ if escaped || !k.is_ascii() => return None,
            _ => return p.value(1),
        };
        if escaped || std::mem::replace(&mut seen[slot], true) {
            return None;
        }
        match slot {
            0 => {
                out.choices = true;
                if said {
                    p.array(2, |p| {
                        if p.peek()? != b'{' {
                            // Decoded by serde as any value: the same rules as a name.
                            return p.name(2).map(drop);
                        }
                        let mut reason = None;
                        p.object(3, |p, k, escaped| {
                            if escaped {
                                return None;
                            }
                            if k == b"finish_reason" {
                                reason = p.name(3)?;
                                Some(())
                            } else {
                                p.value(3)
                            }
                        })?;
                        if let Some(r) = reason {
                            out.finish.add(r);
                        }
                        Some(())
                    })
                } else {
                    p.array(2, |p| p.value(2))
                }
            }
            1 => {
                out.data = true;
                p.array(2, |p| p.value(2))
            }
            2 if said => {
                out.model = p.name(1)?;
                Some(())
            }
            2 => p.value(1),
            _ => {
                let at = p.i;
                p.value(1)?;
                let raw = &p.b[at..p.i];
                std::str::from_utf8(raw).ok()?;
                out.usage = Some(raw);
                Some(())
            }
        }
    })?;
    p.ws();
    (p.i == body.len()).then_some(out)
}

/// An answer's `usage` (the raw value [`answer`] found), read by hand when it has the plain
/// shape: an object whose counts are integers or `null`. `None`: not answered here (the
/// caller reads it with serde_json, which then decides).
pub fn usage(raw: &[u8]) -> Option<StreamUsage> {
    let mut p = P { b: raw, i: 0 };
    let mut u = StreamUsage::default();
    let mut seen = [false; 5];
    p.ws();
    p.object(1, |p, k, escaped| {
        if escaped {
            return None;
        }
        let slot = match k {
            b"prompt_tokens" => 0,
            b"completion_tokens" => 1,
            b"total_tokens" => 2,
            b"cache_creation_input_tokens" => 3,
            b"prompt_tokens_details" => 4,
            _ => return p.value(1),
        };
        if std::mem::replace(&mut seen[slot], true) {
            return None;
        }
        if slot == 4 {
            if p.peek()? == b'n' {
                return p.literal(b"null");
            }
            let mut cached = None;
            let mut seen = false;
            p.object(2, |p, k, escaped| match k {
                _ if escaped => None,
                b"cached_tokens" if !std::mem::replace(&mut seen, true) => {
                    cached = p.count()?;
                    Some(())
                }
                b"cached_tokens" => None,
                _ => p.value(2),
            })?;
            u.prompt_tokens_details = Some(PromptDetails {
                cached_tokens: cached,
            });
            return Some(());
        }
        let n = p.count()?;
        match slot {
            0 => u.prompt_tokens = n,
            1 => u.completion_tokens = n,
            2 => u.total_tokens = n,
            _ => u.cache_creation_input_tokens = n,
        }
        Some(())
    })?;
    p.ws();
    (p.i == raw.len()).then_some(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `special_at` must find: the first byte the table flags.
    fn by_table(s: &[u8]) -> Option<usize> {
        s.iter().position(|&c| SPECIAL[usize::from(c)])
    }

    #[test]
    fn eight_at_a_time_finds_what_the_table_finds() {
        // Every single special byte at every place in strings of every length to 40, over
        // backgrounds of plain ASCII and of high bytes (UTF-8), then random mixtures.
        let specials: Vec<u8> = (0u8..=255).filter(|&c| SPECIAL[usize::from(c)]).collect();
        assert_eq!(specials.len(), 34);
        for bg in [b'a', 0x21, 0x5b, 0x5d, 0x7f, 0x80, 0xe9, 0xff] {
            for len in 0..40 {
                let plain = vec![bg; len];
                assert_eq!(special_at(&plain), None, "{bg:#x} {len}");
                for at in 0..len {
                    for &c in &specials {
                        let mut v = plain.clone();
                        v[at] = c;
                        assert_eq!(special_at(&v), Some(at), "{bg:#x} {len} {at} {c:#x}");
                        // A second special byte after the first never moves the answer.
                        if at + 1 < len {
                            v[len - 1] = b'"';
                            assert_eq!(special_at(&v), Some(at));
                        }
                    }
                }
            }
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            let len = (x % 48) as usize;
            let v: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Mostly plain bytes, now and then a special one or a neighbour of one.
                    match x % 16 {
                        0 => b'"',
                        1 => b'\\',
                        2 => (x >> 8) as u8 % 0x21,
                        3 => 0x21 + (x >> 8) as u8 % 0x3c,
                        _ => (x >> 8) as u8,
                    }
                })
                .collect();
            assert_eq!(special_at(&v), by_table(&v), "{v:?}");
        }
    }
}
