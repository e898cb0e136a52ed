//! Who is asking: request id, job id and consumer (SPEC §1.1). The consumer comes from a
//! virtual key compared in constant time, else a trusted header, else the default.

use super::snapshot::Snapshot;
use http::HeaderMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use subtle::ConstantTimeEq;

#[derive(Debug, Clone)]
pub struct Identity {
    pub request_id: Arc<str>,
    pub job_id: Arc<str>,
    pub consumer: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityError {
    /// A bearer key that matches no virtual key.
    UnknownKey,
    /// A header whose value cannot be an id.
    BadHeader(&'static str),
}

/// Longest id accepted from a header.
const MAX_ID: usize = 128;

fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID
        && s.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'@' | b'/')
        })
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh request id: a per-process random prefix and a sequence number.
pub fn new_request_id() -> Arc<str> {
    static PREFIX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let p = PREFIX.get_or_init(rand::random::<u32>);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    Arc::from(format!("tg-{p:08x}-{n:x}"))
}

fn header_id(
    h: &HeaderMap,
    name: &str,
    what: &'static str,
) -> Result<Option<Arc<str>>, IdentityError> {
    match h.get(name) {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Ok(s) if valid_id(s) => Ok(Some(Arc::from(s))),
            _ => Err(IdentityError::BadHeader(what)),
        },
    }
}

pub fn identify(h: &HeaderMap, snap: &Snapshot) -> Result<Identity, (Arc<str>, IdentityError)> {
    let request_id = match header_id(h, "x-request-id", "x-request-id") {
        Ok(Some(id)) => id,
        _ => new_request_id(),
    };
    let id = &snap.policy.identity;
    let job_id = match header_id(h, &id.job_header, "job header") {
        Ok(j) => j.unwrap_or_else(|| request_id.clone()),
        Err(e) => return Err((request_id, e)),
    };
    let bearer = h
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    // Virtual keys are only consulted when the policy configures them; otherwise the app's
    // Authorization (often a dummy key its SDK insists on) is ignored and never forwarded.
    if !id.virtual_keys.is_empty() {
        if let Some(key) = bearer {
            let mut found: Option<&Arc<str>> = None;
            for (secret, consumer) in &snap.virtual_keys {
                // Every key is compared, whatever matched, so timing says nothing.
                if bool::from(secret.expose().as_bytes().ct_eq(key.as_bytes())) {
                    found = Some(consumer);
                }
            }
            return match found {
                Some(c) => Ok(Identity {
                    request_id,
                    job_id,
                    consumer: c.clone(),
                }),
                None => Err((request_id, IdentityError::UnknownKey)),
            };
        }
    }
    let consumer = match header_id(h, &id.consumer_header, "consumer header") {
        Ok(c) => c.unwrap_or_else(|| id.default_consumer.clone()),
        Err(e) => return Err((request_id, e)),
    };
    Ok(Identity {
        request_id,
        job_id,
        consumer,
    })
}
