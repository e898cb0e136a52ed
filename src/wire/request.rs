//! The head of a request at the front of a connection's buffer, read in place with httparse
//! for the sidecar's own HTTP/1.1 server (`proxy::front`): served there, left to hyper, waited
//! for, or refused as no server may serve it.

use crate::body::ReqBody;
use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Method, Request, Uri, Version};

/// Largest request head served here (hyper's bound is the same).
use super::MAX_HEAD;
/// Most header fields of a request served here (more: hyper, which allows 100).
pub const MAX_FIELDS: usize = 64;
/// Largest request body read whole by the own server (larger: hyper, and the handler's
/// streaming read).
pub const MAX_WHOLE_BODY: u64 = 1024 * 1024;
/// What an h2c client with prior knowledge sends first (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Why a request head was refused before any handler saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malformed {
    /// Not a request head: a bad request line or field, a NUL or control byte, conflicting
    /// `Content-Length` fields.
    Head,
    /// A line ended by a bare LF.
    BareLf,
    /// No `Host` field, or more than one.
    Host,
    /// More than 64 KiB of head.
    HeadTooLarge,
    UriTooLong,
}

/// A head served here, read in place: where its parts are in the buffer it was read into.
pub struct Head {
    pub method: Method,
    /// The request target's offset and length.
    pub target: (usize, usize),
    /// Each field's name, and its value's offset and length.
    pub fields: smallvec::SmallVec<[(HeaderName, usize, usize); 16]>,
    /// Bytes of the head.
    pub len: usize,
    /// The body's declared length.
    pub body: usize,
    /// The client asked for the connection's close.
    pub close: bool,
}

impl Head {
    /// The request, its target and field values slices of `all` (the bytes the head was
    /// parsed from, frozen: no copy each); `None` when the target is not a URI.
    pub fn request(&self, all: &Bytes, body: Bytes) -> Option<Request<ReqBody>> {
        let (at, n) = self.target;
        let uri = Uri::from_maybe_shared(all.slice(at..at + n)).ok()?;
        let mut headers = HeaderMap::with_capacity(self.fields.len());
        for (name, at, n) in &self.fields {
            let v = HeaderValue::from_maybe_shared(all.slice(*at..*at + *n)).ok()?;
            headers.append(name.clone(), v);
        }
        let mut req = Request::new(ReqBody::Whole(Some(body)));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = headers;
        Some(req)
    }
}

/// What the bytes at the front of a connection's buffer are.
// The head is moved out at once; a box would be an allocation per request.
#[allow(clippy::large_enum_variant)]
pub enum Parsed {
    /// A request served here.
    Here(Head),
    /// A head begun, not yet whole.
    Partial,
    /// A whole head this server leaves to hyper (HTTP/1.0, the HTTP/2 preface, a chunked or
    /// large body, `Expect`, `Upgrade`, 65-100 fields).
    Elsewhere,
    /// A head no server may serve: answered here with an error and the connection closed.
    Reject(Malformed),
}

/// The request at the front of `buf` when it is one served here: a whole HTTP/1.1 head
/// without `Expect`, `Upgrade`, `Transfer-Encoding` or a connection option other than
/// `close` and `keep-alive`, with at most one plain `Content-Length` no larger than
/// [`MAX_WHOLE_BODY`] nor `max_body`. Refused outright (RFC 9112 §2.2, §3.2): a head with a
/// bare LF line end, without exactly one `Host`, or that httparse cannot parse.
pub fn parse(buf: &BytesMut, max_body: u64) -> Parsed {
    // The HTTP/2 preface, begun: hyper's to serve once whole (its sniff would wait for the
    // rest without a timer).
    if buf.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(buf) {
        return Parsed::Partial;
    }
    let mut slots = [const { std::mem::MaybeUninit::uninit() }; MAX_FIELDS];
    let mut r = httparse::Request::new(&mut []);
    let len = match httparse::ParserConfig::default()
        .parse_request_with_uninit_headers(&mut r, buf, &mut slots)
    {
        Ok(httparse::Status::Complete(n)) if n <= MAX_HEAD => n,
        Ok(httparse::Status::Complete(_)) => return Parsed::Reject(Malformed::HeadTooLarge),
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => return Parsed::Partial,
        Ok(httparse::Status::Partial) => return Parsed::Reject(Malformed::HeadTooLarge),
        Err(httparse::Error::Version | httparse::Error::TooManyHeaders) => {
            return Parsed::Elsewhere
        }
        Err(_) => return Parsed::Reject(Malformed::Head),
    };
    if r.version != Some(1) {
        return Parsed::Elsewhere;
    }
    if bare_lf(&buf[..len]) {
        return Parsed::Reject(Malformed::BareLf);
    }
    let method = match r.method {
        Some("POST") => Method::POST,
        Some("GET") => Method::GET,
        Some("HEAD" | "CONNECT") | None => return Parsed::Elsewhere,
        Some(m) => match Method::from_bytes(m.as_bytes()) {
            Ok(m) => m,
            Err(_) => return Parsed::Reject(Malformed::Head),
        },
    };
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| (s.as_ptr() as usize - base, s.len());
    let Some(path) = r.path else {
        return Parsed::Reject(Malformed::Head);
    };
    let target = at(path.as_bytes());
    let mut fields = smallvec::SmallVec::new();
    let (mut body, mut close, mut hosts) = (None, false, 0u32);
    for h in r.headers.iter() {
        let Some((name, _)) = super::h1::field_name(h.name.as_bytes()) else {
            return Parsed::Reject(Malformed::Head);
        };
        if name == header::HOST {
            hosts += 1;
        } else if name == header::CONTENT_LENGTH {
            if body.is_some() {
                return Parsed::Elsewhere;
            }
            let most = MAX_WHOLE_BODY.min(max_body);
            match crate::body::content_length(h.value).filter(|&n| n <= most) {
                Some(n) => body = Some(n),
                None => return Parsed::Elsewhere,
            }
        } else if name == header::CONNECTION {
            for t in h.value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                if t.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if !t.eq_ignore_ascii_case(b"keep-alive") {
                    return Parsed::Elsewhere;
                }
            }
        } else if name == header::TRANSFER_ENCODING
            || name == header::EXPECT
            || name == header::UPGRADE
        {
            return Parsed::Elsewhere;
        }
        let (at, n) = at(h.value);
        fields.push((name, at, n));
    }
    if hosts != 1 {
        return Parsed::Reject(Malformed::Host);
    }
    Parsed::Here(Head {
        method,
        target,
        fields,
        len,
        body: body.unwrap_or(0) as usize,
        close,
    })
}

/// Whether a head ends a line with a bare LF (httparse takes it; RFC 9112 §2.2 lets a server
/// refuse it, and a proxy must not read a head differently from the servers behind it).
pub fn bare_lf(head: &[u8]) -> bool {
    memchr::memchr_iter(b'\n', head).any(|i| i == 0 || head[i - 1] != b'\r')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request served here from `raw`, with its head's length, declared body and close.
    fn parsed(raw: &str) -> Option<(Request<ReqBody>, usize, usize, bool)> {
        let buf = BytesMut::from(raw.as_bytes());
        let Parsed::Here(h) = parse(&buf, 4 << 20) else {
            return None;
        };
        let all = buf.freeze();
        let req = h.request(&all, Bytes::new())?;
        Some((req, h.len, h.body, h.close))
    }

    #[test]
    fn a_plain_request_is_served_here() {
        let raw = "POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nX-Y: z\r\n\r\n{}";
        let (req, len, body, close) = parsed(raw).expect("served");
        assert_eq!(req.method(), Method::POST);
        assert_eq!(req.uri().path(), "/v1/chat/completions");
        assert_eq!(req.uri().query(), Some("x=1"));
        assert_eq!(req.headers()["x-y"], "z");
        assert_eq!(req.headers()["content-length"], "2");
        assert_eq!(req.version(), Version::HTTP_11);
        assert_eq!((len, body, close), (raw.len() - 2, 2, false));
        let (_, _, body, close) =
            parsed("GET / HTTP/1.1\r\nHost: a\r\nConnection: Keep-Alive, close\r\n\r\n")
                .expect("served");
        assert_eq!((body, close), (0, true));
    }

    #[test]
    fn everything_unusual_goes_to_hyper() {
        for raw in [
            "POST / HTTP/1.1\r\nHost: a\r\n",                 // head not whole
            "POST / HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}", // HTTP/1.0
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",               // h2c preface
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", // chunked body
            "POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
            "POST / HTTP/1.1\r\nContent-Length: +2\r\n\r\n{}",
            "POST / HTTP/1.1\r\nContent-Length: 1048577\r\n\r\n",
            "POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
            "GET / HTTP/1.1\r\nUpgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\n\r\n",
            "HEAD / HTTP/1.1\r\n\r\n",
            "GET http://[::1 HTTP/1.1\r\nHost: a\r\n\r\n",
        ] {
            assert!(parsed(raw).is_none(), "{raw:?}");
        }
        let verdict = |raw: &str| parse(&BytesMut::from(raw.as_bytes()), 4 << 20);
        assert!(matches!(
            verdict("POST / HTTP/1.1\r\nHost: a\r\n"),
            Parsed::Partial
        ));
        assert!(matches!(verdict("P"), Parsed::Partial));
        assert!(matches!(verdict("PRI * HTTP/2.0\r\n\r\n"), Parsed::Partial));
        assert!(matches!(
            verdict("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
            Parsed::Elsewhere
        ));
        let many: String = (0..MAX_FIELDS + 1)
            .map(|i| format!("x-{i}: v\r\n"))
            .collect();
        assert!(parsed(&format!("GET / HTTP/1.1\r\n{many}\r\n")).is_none());
        // Over the policy's body limit: the handler's 413, under hyper, never read here.
        let buf = BytesMut::from(&b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\n"[..]);
        assert!(matches!(parse(&buf, 10), Parsed::Elsewhere));
        assert!(matches!(parse(&buf, 11), Parsed::Here(_)));
    }

    #[test]
    fn heads_no_server_may_serve_are_refused_here() {
        use Malformed;
        let verdict = |raw: &str| match parse(&BytesMut::from(raw.as_bytes()), 4 << 20) {
            Parsed::Reject(m) => Some(m),
            _ => None,
        };
        assert_eq!(
            verdict("GET / HTTP/1.1\r\nBad Name: x\r\n\r\n"),
            Some(Malformed::Head)
        );
        assert_eq!(verdict("GET / HTTP/1.1\r\n\r\n"), Some(Malformed::Host));
        assert_eq!(
            verdict("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
            Some(Malformed::Host)
        );
        assert_eq!(
            verdict("GET / HTTP/1.1\nHost: a\r\n\r\n"),
            Some(Malformed::BareLf)
        );
        assert_eq!(
            verdict("GET / HTTP/1.1\r\nHost: a\n\n"),
            Some(Malformed::BareLf)
        );
        let big = format!("GET / HTTP/1.1\r\nHost: a\r\nx: {}", "v".repeat(MAX_HEAD));
        assert_eq!(verdict(&big), Some(Malformed::HeadTooLarge));
        assert_eq!(verdict("GET / HTTP/1.1\r\nHost: a\r\n\r\n"), None);
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn field() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("Host: a".to_string()),
                Just("host: b".to_string()),
                Just("Content-Length: 2".to_string()),
                Just("Content-Length: 3".to_string()),
                Just("Transfer-Encoding: chunked".to_string()),
                Just("Connection: close".to_string()),
                Just("Expect: 100-continue".to_string()),
                "[a-zA-Z-]{1,12}: [ -~]{0,20}",
                // Anything at all, control bytes and separators included.
                "[\\x00-\\xff]{0,12}",
            ]
        }

        fn head() -> impl Strategy<Value = Vec<u8>> {
            (
                prop_oneof![4 => Just("POST"), 2 => Just("GET"), 1 => Just("HEAD"), 1 => Just("P@ST"), 1 => Just("")],
                prop_oneof![
                    Just("/v1/chat/completions".to_string()),
                    Just("*".to_string()),
                    "[!-~]{0,16}"
                ],
                prop_oneof![6 => Just("HTTP/1.1"), 1 => Just("HTTP/1.0"), 1 => Just("HTTP/2.0"), 1 => Just("HTTP/1.1 ")],
                prop::collection::vec(field(), 0..6),
                prop_oneof![4 => Just("\r\n"), 1 => Just("\n")],
                "[\\x00-\\xff]{0,4}",
            )
                .prop_map(|(m, p, v, fields, eol, body)| {
                    let mut s = format!("{m} {p} {v}{eol}");
                    for f in fields {
                        s.push_str(&f);
                        s.push_str(eol);
                    }
                    s.push_str(eol);
                    s.push_str(&body);
                    s.into_bytes()
                })
        }

        static HERE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

        #[test]
        fn the_property_serves_some_heads() {
            the_head_parser_agrees_with_httparse();
            assert!(HERE.load(std::sync::atomic::Ordering::Relaxed) >= 20);
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

            /// The own parser against httparse (the parser hyper runs): what it serves,
            /// httparse reads as the same head, with exactly one Host and no bare LF; what it
            /// refuses as malformed, httparse refuses too (or it breaks a rule httparse does
            /// not check); and every strict prefix of a head it serves waits for more.
            #[test]
            fn the_head_parser_agrees_with_httparse(raw in head()) {
                let buf = BytesMut::from(&raw[..]);
                let mut fields = [httparse::EMPTY_HEADER; 100];
                let mut r = httparse::Request::new(&mut fields);
                let reference = r.parse(&raw);
                match parse(&buf, 4 << 20) {
                    Parsed::Here(h) => {
                        HERE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        prop_assert_eq!(reference.ok(), Some(httparse::Status::Complete(h.len)));
                        let hosts = r.headers.iter().filter(|f| f.name.eq_ignore_ascii_case("host")).count();
                        prop_assert_eq!(hosts, 1);
                        prop_assert!(!bare_lf(&raw[..h.len]));
                        for cut in 0..h.len {
                            let part = BytesMut::from(&raw[..cut]);
                            prop_assert!(matches!(parse(&part, 4 << 20), Parsed::Partial), "prefix {}", cut);
                        }
                    }
                    Parsed::Reject(Malformed::Head) => {
                        prop_assert!(reference.is_err() || r.method.is_some_and(|m| Method::from_bytes(m.as_bytes()).is_err()));
                    }
                    Parsed::Reject(_) | Parsed::Elsewhere => {}
                    Parsed::Partial => prop_assert_eq!(reference.ok(), Some(httparse::Status::Partial)),
                }
            }
        }
    }
}
