//! A strict JSON scanner over bytes, without serde: it walks a body once, validating the
//! grammar serde_json applies (strings without control characters and with valid escapes,
//! numbers, literals, nesting), and hands the caller each key and value's position to read
//! what it wants in place. Its users answer only for the plain shapes they know and give up
//! (`None`) on anything else, leaving it to serde_json, which then decides; each is tested
//! against serde on many mutated bodies. Used by the answer scan (`providers`) and the
//! request estimate's fast path (`estimate`).

/// The objects and arrays of a JSON text (the `{` and `[` outside its strings), counted up
/// to `most + 1`: the parsed form of a body costs memory per container far beyond the
/// container's bytes, so a body with too many is refused before it is parsed. Not a
/// validation: a malformed text is still counted, and serde_json then refuses it.
pub(crate) fn containers(b: &[u8], most: usize) -> usize {
    let (mut n, mut i) = (0, 0);
    while i < b.len() {
        match b[i] {
            b'{' | b'[' => {
                n += 1;
                if n > most {
                    return n;
                }
            }
            b'"' => {
                // To the closing quote (a backslash takes the byte after it along).
                i += 1;
                while i < b.len() {
                    match special_at(&b[i..]) {
                        None => i = b.len(),
                        Some(at) => {
                            i += at;
                            match b[i] {
                                b'"' => break,
                                b'\\' => i += 2,
                                _ => i += 1,
                            }
                        }
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    n
}

/// Deeper nesting is left to serde_json (whose limit is 128).
pub(crate) const MAX_DEPTH: u32 = 100;

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

pub(crate) struct P<'a> {
    pub b: &'a [u8],
    pub i: usize,
    /// The body is read as serde decodes it into a `Value` (every string decoded, every
    /// number parsed), not as serde skips it: a `\\u` escape (which may be a lone surrogate)
    /// and a number with an exponent (which may be out of range) give up.
    pub decoded: bool,
}

impl<'a> P<'a> {
    /// A scanner of `b` as serde skips it.
    pub fn new(b: &'a [u8]) -> P<'a> {
        P {
            b,
            i: 0,
            decoded: false,
        }
    }

    #[inline]
    pub fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    #[inline]
    pub fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    #[inline]
    pub fn eat(&mut self, c: u8) -> Option<()> {
        if self.peek()? == c {
            self.i += 1;
            Some(())
        } else {
            None
        }
    }

    /// A string at `self.i` (its opening quote): the raw bytes inside the quotes, and whether
    /// they hold an escape. Control characters are refused and escapes checked as serde_json
    /// checks the strings it skips; UTF-8 is not checked here. Inlined: a call's saving and
    /// restoring of registers cost about what scanning a short key does.
    #[inline(always)]
    pub fn string(&mut self) -> Option<(&'a [u8], bool)> {
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
                b'u' if self.decoded => return None,
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
    pub fn number(&mut self) -> Option<()> {
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
            if self.decoded {
                return None;
            }
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

    /// A count: `null`, or an integer of at most 19 digits (anything else gives up: a sign, a
    /// fraction, an exponent). Read in one pass: the digits are validated as they are summed.
    pub fn count(&mut self) -> Option<Option<u64>> {
        match self.peek()? {
            b'n' => {
                self.literal(b"null")?;
                return Some(None);
            }
            b'0'..=b'9' => {}
            _ => return None,
        }
        let at = self.i;
        // A leading zero stands alone (a digit after it is left for the caller, which then
        // finds no separator, as serde_json refuses it).
        let mut n: u64 = 0;
        if self.b[at] == b'0' {
            self.i += 1;
        } else {
            while let Some(&d) = self.b.get(self.i) {
                if !d.is_ascii_digit() {
                    break;
                }
                // 19 digits fit a u64; one more gives up.
                if self.i - at == 19 {
                    return None;
                }
                n = n * 10 + u64::from(d - b'0');
                self.i += 1;
            }
        }
        match self.peek() {
            Some(b'.' | b'e' | b'E') => None,
            _ => Some(Some(n)),
        }
    }

    pub fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
    }

    pub fn digits1(&mut self) -> Option<()> {
        let at = self.i;
        self.digits();
        (self.i > at).then_some(())
    }

    pub fn literal(&mut self, word: &[u8]) -> Option<()> {
        if self.b.get(self.i..self.i + word.len())? == word {
            self.i += word.len();
            Some(())
        } else {
            None
        }
    }

    /// Skips any value (validating it).
    pub fn value(&mut self, depth: u32) -> Option<()> {
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
    pub fn object(
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

    pub fn array(
        &mut self,
        depth: u32,
        mut each: impl FnMut(&mut Self) -> Option<()>,
    ) -> Option<()> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_are_counted_outside_strings_and_capped() {
        assert_eq!(containers(br#"{"a":[1,{"b":"{[{["}],"c":"\"[{"}"#, 99), 3);
        assert_eq!(containers(b"[[[[[[", 3), 4);
        assert_eq!(containers(br#""unterminated {"#, 9), 0);
        assert_eq!(containers(b"", 9), 0);
    }

    /// What `special_at` must find: the first byte the table flags.
    fn by_table(s: &[u8]) -> Option<usize> {
        s.iter().position(|&c| SPECIAL[usize::from(c)])
    }

    /// The two-pass reading `count` replaced: the grammar's number, then its digits.
    fn count_by_number(b: &[u8]) -> (Option<Option<u64>>, usize) {
        let mut p = P::new(b);
        let r = (|| {
            if p.peek()? == b'n' {
                p.literal(b"null")?;
                return Some(None);
            }
            let at = p.i;
            p.number()?;
            let digits = &p.b[at..p.i];
            if digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let mut n: u64 = 0;
            for &d in digits {
                n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
            }
            Some(Some(n))
        })();
        (r, p.i)
    }

    #[test]
    fn counts_read_in_one_pass_as_the_grammar_and_a_digit_check_read_them() {
        let cases: &[&[u8]] = &[
            b"0",
            b"7,",
            b"31}",
            b"1234567890123456789",
            b"12345678901234567890",
            b"9999999999999999999",
            b"18446744073709551615",
            b"01",
            b"0.5",
            b"1.0",
            b"1e3",
            b"2E1",
            b"-1",
            b"-0",
            b"null",
            b"nul",
            b"",
            b"x",
            b"12a",
            b"00",
            b"5 ",
            b"0}",
        ];
        for b in cases {
            let mut p = P::new(b);
            let r = p.count();
            let (want, end) = count_by_number(b);
            assert_eq!(r, want, "{}", String::from_utf8_lossy(b));
            if r.is_some() {
                assert_eq!(p.i, end, "{}", String::from_utf8_lossy(b));
            }
        }
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
