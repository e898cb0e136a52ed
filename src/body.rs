//! The one response body type: every answer the sidecar sends (its own, an upstream's, a
//! rendered dialect stream) is this boxed body, so the layers that build bodies need not know
//! each other.

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = BoxBody<Bytes, BoxError>;

/// A body of one buffer.
pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

/// A `Content-Length` value: 1 to 19 digits (no sign, no whitespace, no overflow); the
/// client's server, the upstream client and the OTLP poster all read lengths with it.
pub fn content_length(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// A request's body as the handlers get it: hyper's, or one the sidecar's own HTTP/1.1 server
/// ([`crate::proxy::front`]) has already read whole.
#[derive(Debug)]
pub enum ReqBody {
    Hyper(hyper::body::Incoming),
    /// The whole body (`None` once handed out).
    Whole(Option<Bytes>),
}

impl http_body::Body for ReqBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            ReqBody::Hyper(b) => std::pin::Pin::new(b).poll_frame(cx),
            ReqBody::Whole(b) => std::task::Poll::Ready(
                b.take()
                    .filter(|b| !b.is_empty())
                    .map(|b| Ok(http_body::Frame::data(b))),
            ),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ReqBody::Hyper(b) => b.is_end_stream(),
            ReqBody::Whole(b) => b.as_ref().is_none_or(Bytes::is_empty),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            ReqBody::Hyper(b) => b.size_hint(),
            ReqBody::Whole(b) => {
                http_body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::content_length;

    #[test]
    fn a_length_is_digits_only_and_never_overflows() {
        assert_eq!(content_length(b"0"), Some(0));
        assert_eq!(content_length(b"1234"), Some(1234));
        assert_eq!(
            content_length(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b" 1",
            b"1 ",
            b"1,1",
            b"0x10",
            b"99999999999999999999",
        ] {
            assert_eq!(
                content_length(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
