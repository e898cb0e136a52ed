//! W3C Trace Context (`traceparent`, `tracestate`), span ids and the sampler, without the SDK:
//! parsing the caller's header, making ids and writing an attempt's header are a few hundred
//! instructions, not the SDK's context, propagator and id-generator machinery.

use std::cell::Cell;

/// A `traceparent` the caller sent (version 00 layout; later versions are read the same way,
/// as the W3C spec asks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn unhex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = hex_val(s[2 * i])? << 4 | hex_val(s[2 * i + 1])?;
    }
    Some(out)
}

/// Parses a `traceparent` value: `VV-<32 hex>-<16 hex>-FF`, lowercase hex, ids not all zero,
/// version not `ff`; a version above 00 may carry more after a `-`. Anything else is `None`
/// (the request then starts a trace of its own, as the spec says).
pub(crate) fn parse_traceparent(v: &[u8]) -> Option<Parent> {
    if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let version = unhex::<1>(&v[..2])?[0];
    if version == 0xff || (version == 0 && v.len() != 55) || (v.len() > 55 && v[55] != b'-') {
        return None;
    }
    let trace_id = unhex::<16>(&v[3..35])?;
    let span_id = unhex::<8>(&v[36..52])?;
    let flags = unhex::<1>(&v[53..55])?[0];
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
    })
}

/// The 16 lowercase hex digits of `v`, most significant first, computed eight at a time in
/// a word (no table, no per-digit loop).
fn hex_u64(v: u64) -> [u8; 16] {
    /// The 8 nibbles of `x`, one a byte, the most significant in the highest byte.
    fn spread(x: u32) -> u64 {
        let mut x = u64::from(x);
        x = (x | x << 16) & 0x0000_ffff_0000_ffff;
        x = (x | x << 8) & 0x00ff_00ff_00ff_00ff;
        (x | x << 4) & 0x0f0f_0f0f_0f0f_0f0f
    }
    /// Nibbles to ASCII: `'0' + n`, plus 39 more (`'a' - '0' - 10`) where `n > 9`.
    fn ascii(n: u64) -> [u8; 8] {
        let letters = ((n + 0x0606_0606_0606_0606) >> 4) & 0x0101_0101_0101_0101;
        (n + 0x3030_3030_3030_3030 + letters * 39).to_be_bytes()
    }
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&ascii(spread((v >> 32) as u32)));
    out[8..].copy_from_slice(&ascii(spread(v as u32)));
    out
}

fn put_hex(out: &mut [u8], b: &[u8; 8]) {
    out.copy_from_slice(&hex_u64(u64::from_be_bytes(*b)));
}

/// `00-<trace>-<span>-<flags>`, the header an attempt sends upstream.
pub(crate) fn traceparent(trace_id: &[u8; 16], span_id: &[u8; 8], sampled: bool) -> [u8; 55] {
    let mut b = [b'-'; 55];
    b[0] = b'0';
    b[1] = b'0';
    let (hi, lo) = trace_id.split_at(8);
    put_hex(&mut b[3..19], hi.try_into().unwrap_or(&[0; 8]));
    put_hex(&mut b[19..35], lo.try_into().unwrap_or(&[0; 8]));
    put_hex(&mut b[36..52], span_id);
    b[53] = b'0';
    b[54] = if sampled { b'1' } else { b'0' };
    b
}

thread_local! {
    /// wyrand state per thread, seeded from the OS generator once.
    static RNG: Cell<u64> = Cell::new(rand::random::<u64>() | 1);
}

/// 64 random bits (wyrand: fast, well distributed; ids need uniqueness, not secrecy).
fn next_u64() -> u64 {
    RNG.with(|s| {
        let x = s.get().wrapping_add(0xa076_1d64_78bd_642f);
        s.set(x);
        let t = u128::from(x) * u128::from(x ^ 0xe703_7ed1_a0b4_28db);
        (t >> 64) as u64 ^ t as u64
    })
}

/// A new span id (never all zero).
pub(crate) fn span_id() -> [u8; 8] {
    loop {
        let v = next_u64();
        if v != 0 {
            return v.to_be_bytes();
        }
    }
}

/// A new trace id (never all zero).
pub(crate) fn trace_id() -> [u8; 16] {
    let mut t = [0u8; 16];
    t[..8].copy_from_slice(&next_u64().to_be_bytes());
    t[8..].copy_from_slice(&span_id());
    t
}

/// The trace sampler (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampler {
    AlwaysOn,
    AlwaysOff,
    /// Keeps a trace when its id's low 63 bits fall under `ratio × 2^63` (the rule the SDKs
    /// share, so every service of a trace agrees on it).
    Ratio(f64),
    /// The caller's sampled flag decides when there is a caller; `root` decides otherwise.
    ParentBased(Root),
}

/// The sampler of a trace's root, under [`Sampler::ParentBased`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Root {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
}

fn ratio_keeps(ratio: f64, trace_id: &[u8; 16]) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    if ratio.is_nan() || ratio <= 0.0 {
        return false;
    }
    let bound = (ratio * (1u64 << 63) as f64) as u64;
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    (u64::from_be_bytes(low) >> 1) < bound
}

impl Sampler {
    /// Whether a trace with this id (and caller) is recorded and exported.
    pub(crate) fn keeps(&self, trace_id: &[u8; 16], parent: Option<&Parent>) -> bool {
        match *self {
            Sampler::AlwaysOn => true,
            Sampler::AlwaysOff => false,
            Sampler::Ratio(r) => ratio_keeps(r, trace_id),
            Sampler::ParentBased(root) => match (parent, root) {
                (Some(p), _) => p.sampled,
                (None, Root::AlwaysOn) => true,
                (None, Root::AlwaysOff) => false,
                (None, Root::Ratio(r)) => ratio_keeps(r, trace_id),
            },
        }
    }

    /// Reads `OTEL_TRACES_SAMPLER` and its argument (a ratio in 0..=1, default 1).
    pub(crate) fn from_env(name: &str, arg: Option<&str>) -> Result<Sampler, String> {
        let ratio = || -> Result<f64, String> {
            match arg {
                None => Ok(1.0),
                Some(a) => a
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|r| (0.0..=1.0).contains(r))
                    .ok_or_else(|| {
                        format!("OTEL_TRACES_SAMPLER_ARG=`{a}` is not a ratio in 0..=1")
                    }),
            }
        };
        Ok(match name.trim() {
            "always_on" => Sampler::AlwaysOn,
            "always_off" => Sampler::AlwaysOff,
            "traceidratio" => Sampler::Ratio(ratio()?),
            "parentbased_always_on" => Sampler::ParentBased(Root::AlwaysOn),
            "parentbased_always_off" => Sampler::ParentBased(Root::AlwaysOff),
            "parentbased_traceidratio" => Sampler::ParentBased(Root::Ratio(ratio()?)),
            other => {
                return Err(format!(
                    "OTEL_TRACES_SAMPLER=`{other}` is not one of always_on, always_off, \
                     traceidratio, parentbased_always_on, parentbased_always_off, \
                     parentbased_traceidratio"
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_digits_of_every_nibble_and_some_words() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut words = vec![0, u64::MAX, 0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210];
        for _ in 0..10_000 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            words.push(seed);
        }
        for v in words {
            assert_eq!(hex_u64(v).as_slice(), format!("{v:016x}").as_bytes());
        }
    }

    #[test]
    fn traceparent_round_trips_and_bad_ones_are_refused() {
        let v = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let p = parse_traceparent(v).unwrap();
        assert!(p.sampled);
        assert_eq!(&traceparent(&p.trace_id, &p.span_id, true), v);
        let unsampled = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(!parse_traceparent(unsampled).unwrap().sampled);
        // A later version may carry more after a dash.
        assert!(
            parse_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x")
                .is_some()
        );
        for bad in [
            &b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"[..],
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-é".as_bytes(),
        ] {
            assert_eq!(
                parse_traceparent(bad),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn ids_are_distinct_and_never_zero() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let t = trace_id();
            assert_ne!(t, [0; 16]);
            assert!(seen.insert(t));
        }
    }

    #[test]
    fn samplers_follow_the_caller_and_the_ratio() {
        let p = |sampled| Parent {
            trace_id: [1; 16],
            span_id: [2; 8],
            sampled,
        };
        let pb = Sampler::ParentBased(Root::AlwaysOff);
        assert!(pb.keeps(&[1; 16], Some(&p(true))));
        assert!(!pb.keeps(&[1; 16], None));
        assert!(!Sampler::ParentBased(Root::AlwaysOn).keeps(&[1; 16], Some(&p(false))));
        let half = Sampler::Ratio(0.5);
        let kept = (0..4000).filter(|_| half.keeps(&trace_id(), None)).count();
        assert!((1700..2300).contains(&kept), "{kept} of 4000 at 0.5");
        assert!(!Sampler::Ratio(0.0).keeps(&trace_id(), None));
        assert!(Sampler::Ratio(1.0).keeps(&trace_id(), None));
        assert_eq!(
            Sampler::from_env("parentbased_traceidratio", Some("0.25")).unwrap(),
            Sampler::ParentBased(Root::Ratio(0.25))
        );
        assert!(Sampler::from_env("traceidratio", Some("2")).is_err());
        assert!(Sampler::from_env("jaeger_remote", None).is_err());
    }
}
