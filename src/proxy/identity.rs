//! Who is asking: request id, job id, consumer and team (SPEC §1.1, §4).
//!
//! With virtual keys configured, the key alone says who pays: consumer and team come from it
//! (compared in constant time against every key), an identity header can neither add nor
//! change them, and a request without a key is refused unless `identity.require_key` is off
//! (it is then the default consumer). Without virtual keys the consumer header is trusted.

use super::snapshot::Snapshot;
use crate::units::valid_id;
use http::{HeaderMap, HeaderName};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct Identity {
    pub request_id: Arc<str>,
    pub job_id: Arc<str>,
    pub consumer: Arc<str>,
    /// The team of the caller's virtual key, if it names one.
    pub team: Option<Arc<str>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityError {
    /// A key (or an `Authorization` header) that matches no virtual key.
    UnknownKey,
    /// No key, while the policy requires one.
    MissingKey,
    /// A header whose value cannot be an id.
    BadHeader(&'static str),
}

impl IdentityError {
    /// The message a client is shown; it never repeats what the client sent.
    pub fn message(&self) -> String {
        match self {
            IdentityError::UnknownKey => "the key is not a known virtual key".into(),
            IdentityError::MissingKey => {
                "a virtual key is required (Authorization: Bearer <key>, x-api-key or x-goog-api-key)"
                    .into()
            }
            IdentityError::BadHeader(h) => {
                format!("the {h} is not a valid id (1-128 of A-Z a-z 0-9 - _ . : @ /)")
            }
        }
    }
}

static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh request id: a per-process random prefix and a sequence number
/// (`tg-<8 hex>-<hex>`), written without `fmt`: one is made for most requests.
pub fn new_request_id() -> Arc<str> {
    static PREFIX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let p = *PREFIX.get_or_init(rand::random::<u32>);
    request_id_of(p, SEQ.fetch_add(1, Ordering::Relaxed))
}

fn request_id_of(p: u32, n: u64) -> Arc<str> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [0u8; 3 + 8 + 1 + 16];
    buf[..3].copy_from_slice(b"tg-");
    for (i, b) in buf[3..11].iter_mut().enumerate() {
        *b = HEX[(p >> (28 - 4 * i) & 0xf) as usize];
    }
    buf[11] = b'-';
    let digits = (64 - n.leading_zeros()).div_ceil(4).max(1) as usize;
    for i in 0..digits {
        buf[12 + i] = HEX[(n >> (4 * (digits - 1 - i)) & 0xf) as usize];
    }
    let len = 12 + digits;
    // Only ASCII hex digits, `t`, `g` and `-` were written.
    Arc::from(std::str::from_utf8(&buf[..len]).unwrap_or("tg-0"))
}

/// Inlined into `identify`, which reads the request and job ids with it (left out of line by
/// the compiler, it cost ~50 instructions a request more); `caller` reads the consumer with
/// [`header_id_with`] and [`consumer_id`].
#[inline]
fn header_id(
    h: &HeaderMap,
    name: Option<&HeaderName>,
    what: &'static str,
) -> Result<Option<Arc<str>>, IdentityError> {
    header_id_with(h, name, what, |s: &str| Arc::from(s))
}

/// [`header_id`], the text made an id by `make`.
#[inline(always)]
fn header_id_with(
    h: &HeaderMap,
    name: Option<&HeaderName>,
    what: &'static str,
    make: impl FnOnce(&str) -> Arc<str>,
) -> Result<Option<Arc<str>>, IdentityError> {
    let Some(name) = name else {
        return Ok(None);
    };
    match h.get(name) {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Ok(s) if valid_id(s) => Ok(Some(make(s))),
            _ => Err(IdentityError::BadHeader(what)),
        },
    }
}

thread_local! {
    /// The consumer id this thread read last from the consumer header.
    static LAST_CONSUMER: std::cell::RefCell<Option<Arc<str>>> =
        const { std::cell::RefCell::new(None) };
}

/// The consumer id `s`, sharing the `Arc` this thread made for the last one when it is the
/// same text. Requests come from a few consumers, mostly the same one in a row: a shared id
/// saves an allocation here and its free where the record is dropped last (the audit
/// writer's thread, the allocator's slower cross-thread path), and the trace export finds it
/// equal by address. One id per thread is kept, whatever the callers send.
fn consumer_id(s: &str) -> Arc<str> {
    LAST_CONSUMER.with(|last| {
        let Ok(mut last) = last.try_borrow_mut() else {
            return Arc::from(s);
        };
        match &*last {
            Some(a) if **a == *s => a.clone(),
            _ => {
                let a: Arc<str> = Arc::from(s);
                *last = Some(a.clone());
                a
            }
        }
    })
}

/// A credential as the client presented it.
#[derive(Debug, PartialEq, Eq)]
enum Presented<'a> {
    Nothing,
    Key(&'a str),
    /// An `Authorization` that is not `Bearer <key>` (e.g. `Basic …`, an empty bearer).
    Malformed,
}

/// The key of a request, from `Authorization: Bearer` (scheme case-insensitive), `x-api-key`
/// (Anthropic) or `x-goog-api-key` (Gemini), in that order.
fn presented(h: &HeaderMap) -> Presented<'_> {
    if let Some(v) = h.get(http::header::AUTHORIZATION) {
        let Ok(s) = v.to_str() else {
            return Presented::Malformed;
        };
        return match s.trim().split_once(' ') {
            Some((scheme, key)) if scheme.eq_ignore_ascii_case("bearer") => match key.trim() {
                "" => Presented::Malformed,
                k => Presented::Key(k),
            },
            _ => Presented::Malformed,
        };
    }
    for name in ["x-api-key", "x-goog-api-key"] {
        if let Some(v) = h.get(name) {
            return match v.to_str().map(str::trim) {
                Ok(k) if !k.is_empty() => Presented::Key(k),
                _ => Presented::Malformed,
            };
        }
    }
    Presented::Nothing
}

/// Consumer and team of the caller: from the key when keys are configured, else from the
/// consumer header or the default.
pub fn caller(
    h: &HeaderMap,
    snap: &Snapshot,
) -> Result<(Arc<str>, Option<Arc<str>>), IdentityError> {
    let id = &snap.policy.identity;
    // Virtual keys are only consulted when the policy configures them; otherwise the app's
    // Authorization (often a dummy key its SDK insists on) is ignored and never forwarded.
    if id.virtual_keys.is_empty() {
        let consumer = header_id_with(
            h,
            snap.consumer_header.as_ref(),
            "consumer header",
            consumer_id,
        )?
        .unwrap_or_else(|| id.default_consumer.clone());
        return Ok((consumer, None));
    }
    match presented(h) {
        Presented::Key(k) => match snap.virtual_keys.lookup(k) {
            Some(owner) => Ok((owner.consumer.clone(), owner.team.clone())),
            None => Err(IdentityError::UnknownKey),
        },
        Presented::Malformed => Err(IdentityError::UnknownKey),
        Presented::Nothing if id.require_key => Err(IdentityError::MissingKey),
        // Keys exist but are optional: a key-less request is the default consumer. The
        // consumer header is not trusted here, or it would bill whoever it names.
        Presented::Nothing => Ok((id.default_consumer.clone(), None)),
    }
}

pub fn identify(h: &HeaderMap, snap: &Snapshot) -> Result<Identity, (Arc<str>, IdentityError)> {
    let request_id = match header_id(h, Some(&X_REQUEST_ID), "x-request-id") {
        Ok(Some(id)) => id,
        _ => new_request_id(),
    };
    let job_id = match header_id(h, snap.job_header.as_ref(), "job header") {
        Ok(j) => j.unwrap_or_else(|| request_id.clone()),
        Err(e) => return Err((request_id, e)),
    };
    match caller(h, snap) {
        Ok((consumer, team)) => Ok(Identity {
            request_id,
            job_id,
            consumer,
            team,
        }),
        Err(e) => Err((request_id, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn auth(v: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, HeaderValue::from_static(v));
        h
    }

    #[test]
    fn a_repeated_consumer_shares_its_id_and_a_new_one_gets_its_own() {
        let a = consumer_id("team-a");
        let again = consumer_id("team-a");
        assert_eq!(&*again, "team-a");
        assert!(Arc::ptr_eq(&a, &again), "the same text shares the Arc");
        let b = consumer_id("team-b");
        assert_eq!(&*b, "team-b");
        // Only the last one is kept: back to the first text, a new Arc with its text.
        let a2 = consumer_id("team-a");
        assert_eq!(&*a2, "team-a");
        assert!(!Arc::ptr_eq(&a2, &b));
        // A prefix or an extension of the kept text is another id.
        assert_eq!(&*consumer_id("team-"), "team-");
        assert_eq!(&*consumer_id("team-ab"), "team-ab");
        // Through the header, as `caller` reads it.
        let name = HeaderName::from_static("x-tollgate-consumer");
        let mut h = HeaderMap::new();
        h.insert(name.clone(), HeaderValue::from_static("bench"));
        let read = |h: &HeaderMap| header_id_with(h, Some(&name), "consumer header", consumer_id);
        let (x, y) = (read(&h).unwrap().unwrap(), read(&h).unwrap().unwrap());
        assert_eq!(&*x, "bench");
        assert!(Arc::ptr_eq(&x, &y));
        h.insert(name.clone(), HeaderValue::from_static("bad id with spaces"));
        assert!(read(&h).is_err());
    }

    #[test]
    fn request_ids_read_as_before() {
        for p in [0, 0x2dcf_2d40, u32::MAX] {
            for n in [0, 1, 15, 16, 255, 0x13f, 0xabc_def0, u64::MAX] {
                assert_eq!(&*request_id_of(p, n), format!("tg-{p:08x}-{n:x}"));
            }
        }
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k1", "bearer k1", "BEARER k1", "BeArEr   k1 "] {
            assert_eq!(presented(&auth(v)), Presented::Key("k1"), "{v}");
        }
    }

    #[test]
    fn other_schemes_and_empty_bearers_are_malformed() {
        for v in [
            "Basic dXNlcjpwYXNz",
            "Bearer",
            "Bearer   ",
            "k1",
            "Token k1",
        ] {
            assert_eq!(presented(&auth(v)), Presented::Malformed, "{v}");
        }
        assert_eq!(presented(&HeaderMap::new()), Presented::Nothing);
    }

    #[test]
    fn anthropic_and_gemini_key_headers_are_keys() {
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("ka"));
        assert_eq!(presented(&h), Presented::Key("ka"));
        let mut h = HeaderMap::new();
        h.insert("x-goog-api-key", HeaderValue::from_static("kg"));
        assert_eq!(presented(&h), Presented::Key("kg"));
    }
}
