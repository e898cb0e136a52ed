//! Request bodies the client compressed, and bodies the sidecar will not read at all.
//!
//! The governor parses every body and the upstream gets it re-serialized, so a
//! `Content-Encoding` is decoded here (gzip and deflate, the decoded size capped at
//! `server.max_body_bytes`) and never forwarded; any other coding is refused with 415.
//! A body declared larger than the limit with `Expect: 100-continue` is refused at once,
//! before hyper would answer 100 and the client sent it.

use bytes::Bytes;
use http::HeaderMap;
use std::io::Read;

/// How a request body is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Identity,
    Gzip,
    Deflate,
}

/// Why a compressed body cannot be used.
#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Decoded past the limit.
    TooLarge,
    /// Not valid data of its coding.
    Corrupt(String),
}

/// The request's `Content-Encoding` (one coding; `identity` or absent is none), or the
/// unsupported coding as sent (bounded, for the refusal).
pub fn coding(headers: &HeaderMap) -> Result<Coding, String> {
    let mut values = headers.get_all(http::header::CONTENT_ENCODING).iter();
    let Some(v) = values.next() else {
        return Ok(Coding::Identity);
    };
    let unsupported = || {
        String::from_utf8_lossy(v.as_bytes())
            .chars()
            .take(40)
            .collect::<String>()
    };
    if values.next().is_some() {
        return Err(unsupported());
    }
    let s = v.to_str().map_err(|_| unsupported())?.trim();
    if s.eq_ignore_ascii_case("gzip") || s.eq_ignore_ascii_case("x-gzip") {
        Ok(Coding::Gzip)
    } else if s.eq_ignore_ascii_case("deflate") {
        Ok(Coding::Deflate)
    } else if s.eq_ignore_ascii_case("identity") || s.is_empty() {
        Ok(Coding::Identity)
    } else {
        Err(unsupported())
    }
}

/// Whether the client waits for `100 Continue` to send a body it declared larger than
/// `limit`: it is refused without being read.
pub fn expects_too_much(headers: &HeaderMap, limit: u64) -> bool {
    // The length is looked at only when the client waits (nearly none do).
    headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
        && headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > limit)
}

/// Decodes `body` (already read, at most `limit` bytes), the result capped at `limit`.
/// Inlined: nearly every body is sent as it is, which costs its caller a comparison.
#[inline]
pub fn decode(coding: Coding, body: Bytes, limit: usize) -> Result<Bytes, DecodeError> {
    match coding {
        Coding::Identity => Ok(body),
        coded => inflate(coded, body, limit),
    }
}

fn inflate(coding: Coding, body: Bytes, limit: usize) -> Result<Bytes, DecodeError> {
    let cap = (limit as u64).saturating_add(1);
    let mut out = Vec::new();
    let read = match coding {
        Coding::Identity => return Ok(body),
        Coding::Gzip => flate2::read::MultiGzDecoder::new(&body[..])
            .take(cap)
            .read_to_end(&mut out),
        Coding::Deflate => flate2::read::ZlibDecoder::new(&body[..])
            .take(cap)
            .read_to_end(&mut out),
    };
    read.map_err(|e| DecodeError::Corrupt(e.to_string()))?;
    if out.len() > limit {
        return Err(DecodeError::TooLarge);
    }
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gz(data: &[u8]) -> Bytes {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        Bytes::from(e.finish().unwrap())
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn gzip_decodes_within_the_cap_and_a_bomb_is_too_large() {
        let json = br#"{"model":"chat","messages":[]}"#;
        assert_eq!(decode(Coding::Gzip, gz(json), 100).unwrap(), &json[..]);
        // 10 MB of zeros compress to ~10 KB: decoding stops at the cap.
        let bomb = gz(&vec![b'0'; 10_000_000]);
        assert!(bomb.len() < 100_000);
        assert_eq!(
            decode(Coding::Gzip, bomb, 1_000_000),
            Err(DecodeError::TooLarge)
        );
        assert!(matches!(
            decode(Coding::Gzip, Bytes::from_static(b"not gzip"), 100),
            Err(DecodeError::Corrupt(_))
        ));
    }

    #[test]
    fn codings_and_expectations() {
        assert_eq!(coding(&headers(&[])), Ok(Coding::Identity));
        assert_eq!(
            coding(&headers(&[("content-encoding", "GZIP")])),
            Ok(Coding::Gzip)
        );
        assert!(coding(&headers(&[("content-encoding", "br")])).is_err());
        assert!(coding(&headers(&[
            ("content-encoding", "gzip"),
            ("content-encoding", "gzip")
        ]))
        .is_err());
        let big = headers(&[("expect", "100-continue"), ("content-length", "5000")]);
        assert!(expects_too_much(&big, 4096));
        assert!(!expects_too_much(&big, 5000));
        assert!(!expects_too_much(
            &headers(&[("content-length", "5000")]),
            4096
        ));
    }
}
