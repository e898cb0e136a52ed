//! Small value types shared by the policy, the ledger and the governor.
//!
//! They live at the bottom of the module graph so that `policy` and `ledger` can both use
//! them without importing each other.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Money in whole micro-dollars (1 USD = 1_000_000). Never floating point on the books.
pub type Micros = u64;

/// The wall clock in Unix milliseconds, read with one `clock_gettime` through the vDSO: the
/// request path reads it several times, and `jiff::Timestamp::now()` costs ~130 instructions
/// a read (a `SystemTime`, then its checked conversion) where this costs ~40.
pub fn now_ms() -> i64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Realtime);
    (t.tv_sec as i64)
        .saturating_mul(1000)
        .saturating_add(t.tv_nsec as i64 / 1_000_000)
}

/// The wall clock now, as Unix seconds and nanoseconds (one `clock_gettime` through the vDSO).
pub fn now_wall() -> (i64, u32) {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Realtime);
    (
        t.tv_sec as i64,
        u32::try_from(t.tv_nsec).unwrap_or(0).min(999_999_999),
    )
}

/// Unix milliseconds of a [`now_wall`] reading.
pub fn wall_ms((secs, nanos): (i64, u32)) -> i64 {
    secs.saturating_mul(1000)
        .saturating_add(i64::from(nanos / 1_000_000))
}

thread_local! {
    /// The second last formatted by [`rfc3339`] and its `YYYY-MM-DDTHH:MM:SS` (19 bytes).
    static SECOND: std::cell::Cell<(i64, [u8; 19])> = const { std::cell::Cell::new((i64::MIN, [0; 19])) };
}

/// A wall-clock reading in RFC 3339, UTC, as `jiff::Timestamp`'s `Display` writes it
/// (`2026-12-05T15:21:06.506053273Z`: the fraction only when not zero, without trailing
/// zeros). The date and time of day are formatted once a second per thread and kept; the
/// fraction is written each time (jiff's printer cost ~620 instructions a record).
pub fn rfc3339((secs, nanos): (i64, u32)) -> String {
    // Outside years 0-9999 (never from a clock), or on a thread past its locals: jiff writes
    // it whole.
    let whole = || {
        jiff::Timestamp::new(secs, nanos as i32)
            .map(|t| t.to_string())
            .unwrap_or_default()
    };
    let mut out = String::with_capacity(32);
    let Ok((last, mut head)) = SECOND.try_with(std::cell::Cell::get) else {
        return whole();
    };
    if last != secs {
        let Some(h) = jiff::Timestamp::from_second(secs)
            .ok()
            .map(|t| t.to_string())
            .filter(|h| h.len() == 20 && h.ends_with('Z'))
            .and_then(|h| <[u8; 19]>::try_from(&h.as_bytes()[..19]).ok())
        else {
            return whole();
        };
        head = h;
        let _ = SECOND.try_with(|c| c.set((secs, head)));
    }
    out.push_str(std::str::from_utf8(&head).unwrap_or_default());
    if nanos > 0 {
        let mut digits = [b'0'; 10];
        digits[0] = b'.';
        let mut n = nanos;
        for d in digits[1..].iter_mut().rev() {
            *d = b'0' + (n % 10) as u8;
            n /= 10;
        }
        let end = 10 - digits.iter().rev().take_while(|&&d| d == b'0').count();
        out.push_str(std::str::from_utf8(&digits[..end]).unwrap_or_default());
    }
    out.push('Z');
    out
}

/// Converts a USD amount from a policy or scenario to micro-dollars, rounding to nearest.
pub fn usd_to_micros(usd: f64) -> Micros {
    (usd * 1_000_000.0).round().max(0.0) as Micros
}

/// Converts micro-dollars to USD for display and audit.
pub fn micros_to_usd(m: Micros) -> f64 {
    m as f64 / 1_000_000.0
}

/// Longest id accepted for a consumer, team or job.
pub const MAX_ID: usize = 128;

/// Whether `s` can be a consumer, team or job id: 1-128 of `A-Z a-z 0-9 - _ . : @ /`.
pub fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID
        && s.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'@' | b'/')
        })
}

/// Groups the digits of `n` by thousands: `1234567` → `"1,234,567"`.
pub fn group_thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Micro-dollars as people read money: `$49.45`, `$1,250.00`, `$0.0042`. From one dollar up
/// the amount is rounded to the cent; below it, every non-zero digit is kept (at least two
/// decimals), so a small price never reads as `$0.00`. Never micro-units.
pub fn fmt_usd(m: Micros) -> String {
    if m >= 1_000_000 {
        let cents = m.saturating_add(5_000) / 10_000;
        return format!("${}.{:02}", group_thousands(cents / 100), cents % 100);
    }
    let mut frac = format!("{m:06}");
    while frac.len() > 2 && frac.ends_with('0') {
        frac.pop();
    }
    format!("$0.{frac}")
}

/// Micro-dollars as an exact decimal number of dollars for machines (a header, JSON):
/// `0.000096`, `1.5`, `12`, `0`. No float on the way, so no float noise; written into `buf`
/// (no allocation).
pub fn usd_decimal(m: Micros, buf: &mut [u8; 28]) -> &str {
    let mut n = itoa::Buffer::new();
    let whole = n.format(m / 1_000_000).as_bytes();
    let mut len = whole.len();
    buf[..len].copy_from_slice(whole);
    let mut frac = m % 1_000_000;
    if frac != 0 {
        buf[len] = b'.';
        len += 1;
        let mut digits = 6;
        while frac.is_multiple_of(10) {
            frac /= 10;
            digits -= 1;
        }
        for i in (0..digits).rev() {
            buf[len + i] = b'0' + (frac % 10) as u8;
            frac /= 10;
        }
        len += digits;
    }
    std::str::from_utf8(&buf[..len]).unwrap_or("0")
}

/// An amount in a dimension, for messages: `5,000 tokens`, `12 requests`, `$49.45`.
pub fn fmt_amount(dim: Dim, v: u64) -> String {
    match dim {
        Dim::Usd => fmt_usd(v),
        Dim::Tokens => format!("{} tokens", group_thousands(v)),
        Dim::Requests if v == 1 => "1 request".to_string(),
        Dim::Requests => format!("{} requests", group_thousands(v)),
    }
}

/// Who a counter belongs to (SPEC §4 "Scopes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Request,
    Job,
    Consumer,
    /// The team a virtual key names (SPEC §4): counted beside the consumer's own bounds.
    Team,
    Backend,
    Model,
    Global,
}

impl Scope {
    pub const ALL: [Scope; 7] = [
        Scope::Request,
        Scope::Job,
        Scope::Consumer,
        Scope::Team,
        Scope::Backend,
        Scope::Model,
        Scope::Global,
    ];

    /// The inverse of [`Scope::as_str`].
    pub fn parse(s: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|x| x.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Request => "request",
            Scope::Job => "job",
            Scope::Consumer => "consumer",
            Scope::Team => "team",
            Scope::Backend => "backend",
            Scope::Model => "model",
            Scope::Global => "global",
        }
    }

    /// Backend- and model-scoped bounds only make the chain entries they cover ineligible;
    /// every other scope decides for the whole request (SPEC §5).
    pub fn is_entry_scoped(self) -> bool {
        matches!(self, Scope::Backend | Scope::Model)
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A calendar window in `windows.timezone`, or none (request and job counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Window {
    Minute,
    Hour,
    Day,
    Month,
}

impl Window {
    pub const ALL: [Window; 4] = [Window::Minute, Window::Hour, Window::Day, Window::Month];

    /// The inverse of [`Window::as_str`].
    pub fn parse(s: &str) -> Option<Window> {
        Window::ALL.into_iter().find(|x| x.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Window::Minute => "minute",
            Window::Hour => "hour",
            Window::Day => "day",
            Window::Month => "month",
        }
    }
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The three dimensions every counter holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dim {
    Tokens = 0,
    Requests = 1,
    Usd = 2,
}

impl Dim {
    pub const ALL: [Dim; 3] = [Dim::Tokens, Dim::Requests, Dim::Usd];
    pub fn as_str(self) -> &'static str {
        match self {
            Dim::Tokens => "tokens",
            Dim::Requests => "requests",
            Dim::Usd => "usd",
        }
    }
}

/// An amount in all three dimensions (tokens, requests, micro-dollars).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Amount {
    pub tokens: u64,
    pub requests: u64,
    pub usd: Micros,
}

impl Amount {
    pub const ZERO: Amount = Amount {
        tokens: 0,
        requests: 0,
        usd: 0,
    };

    pub fn get(&self, d: Dim) -> u64 {
        match d {
            Dim::Tokens => self.tokens,
            Dim::Requests => self.requests,
            Dim::Usd => self.usd,
        }
    }

    pub fn as_array(&self) -> [u64; 3] {
        [self.tokens, self.requests, self.usd]
    }

    pub fn from_array(a: [u64; 3]) -> Self {
        Amount {
            tokens: a[0],
            requests: a[1],
            usd: a[2],
        }
    }
}

/// Milliseconds since the Unix epoch: the only notion of "now" the core knows.
pub type Millis = i64;

#[cfg(test)]
mod tests {
    #[test]
    fn now_ms_reads_the_wall_clock() {
        let before = jiff::Timestamp::now().as_millisecond();
        let now = super::now_ms();
        let after = jiff::Timestamp::now().as_millisecond();
        assert!(before <= now && now <= after, "{before} {now} {after}");
    }

    use super::*;

    #[test]
    fn dollars_for_machines_are_exact_decimals() {
        let mut b = [0u8; 28];
        for (m, want) in [
            (0, "0"),
            (96, "0.000096"),
            (1_500_000, "1.5"),
            (12_000_000, "12"),
            (49_450_000, "49.45"),
            (100, "0.0001"),
            (1_000_001, "1.000001"),
            (u64::MAX, "18446744073709.551615"),
        ] {
            assert_eq!(usd_decimal(m, &mut b), want);
        }
    }

    #[test]
    fn timestamps_are_written_as_jiff_writes_them() {
        let jiff = |s: i64, n: u32| jiff::Timestamp::new(s, n as i32).unwrap().to_string();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut cases: Vec<(i64, u32)> = vec![
            (0, 0),
            (0, 1),
            (1_764_947_266, 0),
            (1_764_947_266, 500_000_000),
            (1_764_947_266, 506_053_273),
            (1_764_947_266, 999_999_999),
            (1_764_947_266, 120),
            (1_764_947_267, 1_000),
            (253_402_207_199, 7),
            (-1, 5),
        ];
        for _ in 0..5_000 {
            let secs = (next() % 4_000_000_000) as i64;
            // Every count of trailing zeros, and whole seconds.
            let nanos = (next() % 1_000_000_000) as u32 / 10u32.pow((next() % 10) as u32);
            cases.push((secs, nanos));
            // The same second again: the kept head serves it.
            cases.push((secs, nanos / 3));
        }
        for (s, n) in cases {
            assert_eq!(rfc3339((s, n)), jiff(s, n), "{s} {n}");
        }
        let w = now_wall();
        let t: jiff::Timestamp = rfc3339(w).parse().unwrap();
        assert_eq!(t.as_millisecond(), wall_ms(w));
    }

    #[test]
    fn dollars_read_as_dollars() {
        assert_eq!(fmt_usd(49_450_000), "$49.45");
        assert_eq!(fmt_usd(50_000_000), "$50.00");
        assert_eq!(fmt_usd(49_454_999), "$49.45");
        assert_eq!(fmt_usd(49_455_000), "$49.46");
        assert_eq!(fmt_usd(1_234_567_890_000), "$1,234,567.89");
        assert_eq!(fmt_usd(1_000_000), "$1.00");
        assert_eq!(fmt_usd(999_999), "$0.999999");
        assert_eq!(fmt_usd(500_000), "$0.50");
        assert_eq!(fmt_usd(4_200), "$0.0042");
        assert_eq!(fmt_usd(1), "$0.000001");
        assert_eq!(fmt_usd(0), "$0.00");
        assert_eq!(fmt_usd(u64::MAX), "$18,446,744,073,709.55");
    }

    #[test]
    fn amounts_name_their_unit() {
        assert_eq!(fmt_amount(Dim::Tokens, 5000), "5,000 tokens");
        assert_eq!(fmt_amount(Dim::Tokens, 999), "999 tokens");
        assert_eq!(fmt_amount(Dim::Requests, 1), "1 request");
        assert_eq!(fmt_amount(Dim::Requests, 1200), "1,200 requests");
        assert_eq!(fmt_amount(Dim::Usd, 12_500_000), "$12.50");
        assert_eq!(group_thousands(0), "0");
        assert_eq!(group_thousands(100), "100");
        assert_eq!(group_thousands(1000), "1,000");
    }
}

/// Usage of one served call, from the provider or the sidecar's own count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Every input token, cached and cache-written ones included.
    pub input_tokens: u64,
    /// Every output token, reasoning included.
    pub output_tokens: u64,
    /// Of the input, read from the provider's prompt cache (priced `cached_input`).
    pub cached_input_tokens: u64,
    /// Of the input, written to the provider's prompt cache (priced `cache_write`).
    pub cache_write_tokens: u64,
}

impl Usage {
    /// Plain input and output, no cache split.
    pub fn new(input_tokens: u64, output_tokens: u64) -> Usage {
        Usage {
            input_tokens,
            output_tokens,
            ..Usage::default()
        }
    }
}
