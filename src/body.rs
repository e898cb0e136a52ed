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
