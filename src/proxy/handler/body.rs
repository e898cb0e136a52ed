//! Reading a request body: bounded in size and in time, decoded (bounded) when compressed,
//! and never read past the limit it declares to a client waiting for `100 Continue`.

use super::super::encoding::{self, DecodeError};
use super::super::respond::BodyError;
use crate::body::ReqBody;
use bytes::Bytes;
use http::HeaderMap;
use http_body_util::BodyExt;

/// A slow client may not pin a connection: the whole body must arrive within this.
const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// What is read and thrown away of a body over the limit, so that a client still writing it
/// gets the 413 instead of a connection reset (RFC 9112 §9.6); past this the connection closes.
const DRAIN_BEYOND_LIMIT: usize = 16 * 1024 * 1024;

/// The body of a governed request, decoded, at most `limit` bytes before and after decoding.
/// The `Content-Encoding` header is removed: the upstream gets the body re-serialized.
pub(super) async fn read_decoded(
    headers: &mut HeaderMap,
    body: ReqBody,
    limit: u64,
) -> Result<Bytes, BodyError> {
    let (coding, too_much) = (
        encoding::coding(headers),
        encoding::expects_too_much(headers, limit),
    );
    headers.remove(http::header::CONTENT_ENCODING);
    match coding {
        Err(c) => Err(BodyError::Encoding(c)),
        Ok(_) if too_much => Err(BodyError::TooLarge { limit }),
        Ok(c) => {
            let b = read(body, limit as usize).await?;
            encoding::decode(c, b, limit as usize).map_err(|e| match e {
                DecodeError::TooLarge => BodyError::TooLarge { limit },
                DecodeError::Corrupt(m) => BodyError::Corrupt(m),
            })
        }
    }
}

/// Reads the request body up to `limit` bytes within [`BODY_READ_TIMEOUT`]. A body over the
/// limit is drained (up to [`DRAIN_BEYOND_LIMIT`] more) before answering.
pub(super) async fn read(body: ReqBody, limit: usize) -> Result<Bytes, BodyError> {
    let too_large = || BodyError::TooLarge {
        limit: limit as u64,
    };
    let mut body = match body {
        // Read whole already, within its own bounds (`front`): only the limit is left to check.
        ReqBody::Whole(b) => {
            let b = b.unwrap_or_default();
            return if b.len() > limit {
                Err(too_large())
            } else {
                Ok(b)
            };
        }
        ReqBody::Hyper(b) => b,
    };
    let deadline = tokio::time::Instant::now() + BODY_READ_TIMEOUT;
    let mut buf = bytes::BytesMut::new();
    let mut seen = 0usize;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) if seen > limit => return Err(too_large()),
            Err(_) => return Err(BodyError::Timeout(BODY_READ_TIMEOUT)),
            Ok(None) => break,
            Ok(Some(Err(e))) if seen > limit => {
                tracing::debug!(error = %e, "oversized body broke off while draining");
                return Err(too_large());
            }
            Ok(Some(Err(e))) => return Err(BodyError::Broken(e)),
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen <= limit {
            buf.extend_from_slice(&data);
        } else if seen > limit.saturating_add(DRAIN_BEYOND_LIMIT) {
            break;
        }
    }
    if seen > limit {
        Err(too_large())
    } else {
        Ok(buf.freeze())
    }
}
