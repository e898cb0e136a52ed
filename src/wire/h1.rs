//! The HTTP/1.1 client side of a cleartext upstream connection, driven by the task that
//! makes the call (no connection task, no channel between the two): the request written in
//! one buffer, the answer's head parsed with `httparse` into an `http::Response`, and its body
//! framed by [`Decoder`] (`Content-Length`, chunked, or to the connection's close).
//!
//! Everything read from the upstream is bounded: the head (64 KiB, 100 headers, 16 interim
//! answers), a chunk-size line (16 hex digits, 4 KiB with extensions), trailers (16 KiB).

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, Version};
use std::io;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::MAX_HEAD;
/// Most header fields in an answer head.
const MAX_HEADERS: usize = 100;
/// Most interim (1xx) answers before the final one.
const MAX_INTERIM: usize = 16;
/// Largest chunk-size line (with its extensions).
const MAX_CHUNK_LINE: usize = 4 * 1024;
/// Largest trailer section of a chunked body.
const MAX_TRAILERS: usize = 16 * 1024;
/// Room an answer's header map is made with beyond its own fields: for the headers the
/// sidecar stamps on the answer it hands on (decision, ids, limits), so the map is not grown
/// as they are added.
pub const ROOM_FOR_STAMPS: usize = 14;
/// What a read asks room for.
const READ_ROOM: usize = 8 * 1024;

/// One connection to an upstream, with what was read from it and not yet used.
pub struct Conn {
    io: TcpStream,
    pub(super) buf: BytesMut,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Conn")
    }
}

/// What an idle connection's socket holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleState {
    /// Nothing: it can take a request.
    Quiet,
    /// The upstream closed it (or it broke).
    Closed,
    /// Bytes no request asked for.
    Unsolicited,
}

/// Why no answer head came.
#[derive(Debug, PartialEq, Eq)]
pub enum HeadError {
    /// The connection ended, or broke, before a single byte of an answer came: on a reused
    /// connection, the upstream's close of an idle connection that crossed the request.
    Closed,
    /// The connection ended, or broke, before the head was whole.
    Broken,
    /// Not an HTTP/1 answer head, or past a bound.
    Malformed,
}

/// How an answer's body is delimited, and whether the connection can carry another request
/// after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Framing {
    pub decoder: Decoder,
    pub keep_alive: bool,
}

impl Conn {
    /// A new connection to `authority` (`host:port`), within `connect`.
    pub async fn dial(authority: &str, connect: Duration) -> io::Result<Conn> {
        let io = tokio::time::timeout(connect, TcpStream::connect(authority))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timeout"))??;
        io.set_nodelay(true)?;
        let ka = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
        socket2::SockRef::from(&io).set_tcp_keepalive(&ka)?;
        Ok(Conn {
            io,
            buf: BytesMut::with_capacity(READ_ROOM),
        })
    }

    /// Whether an idle connection can take a request: nothing arrived on it since its last
    /// answer. One non-blocking `recv(MSG_PEEK)` asks the kernel itself: tokio's readiness
    /// may not have seen bytes that came after the last driver turn, and bytes read as the
    /// next caller's answer are the one failure a pool must never have.
    pub fn idle_state(&mut self) -> IdleState {
        if !self.buf.is_empty() {
            return IdleState::Unsolicited;
        }
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        match socket2::SockRef::from(&self.io).peek(&mut probe) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => IdleState::Quiet,
            Ok(0) | Err(_) => IdleState::Closed,
            Ok(_) => IdleState::Unsolicited,
        }
    }

    /// Acknowledges what was read at once instead of after the delayed-ACK timer: an upstream
    /// whose Nagle holds back bytes it sent after an answer (an answer nobody asked for)
    /// sends them now, so [`idle_state`](Self::idle_state) sees them before the connection
    /// carries another request, instead of their riding out on that request's ACK and being
    /// read as its answer.
    pub fn ack_now(&self) {
        #[cfg(target_os = "linux")]
        let _ = socket2::SockRef::from(&self.io).set_tcp_quickack(true);
    }

    /// Writes a whole request.
    pub async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.io.write_all(bytes).await
    }

    /// Reads the answer's head (interim 1xx answers skipped). `head_request`: the request was
    /// a HEAD, so the answer has no body whatever its headers say.
    pub async fn read_head(
        &mut self,
        head_request: bool,
    ) -> Result<(Response<()>, Framing), HeadError> {
        let mut interim = 0;
        loop {
            // Bytes of the buffer already known not to end the head: a head that arrives in
            // pieces is parsed again only once its end may have come (a trickle of single
            // bytes would otherwise cost a parse of the whole head per byte).
            let mut seen = 0;
            let parsed = loop {
                if seen == 0 || head_end_after(&self.buf, seen) {
                    if let Some(p) = parse_head(&mut self.buf)? {
                        break p;
                    }
                }
                seen = self.buf.len();
                if self.buf.len() >= MAX_HEAD {
                    return Err(HeadError::Malformed);
                }
                match std::future::poll_fn(|cx| self.poll_fill(cx)).await {
                    Ok(0) | Err(_) if interim == 0 && self.buf.is_empty() => {
                        return Err(HeadError::Closed)
                    }
                    Ok(0) | Err(_) => return Err(HeadError::Broken),
                    Ok(_) => {}
                }
            };
            let (resp, framing) = parsed;
            if resp.status().is_informational() {
                // 101 would switch protocols, which no call asks for.
                interim += 1;
                if resp.status() == StatusCode::SWITCHING_PROTOCOLS || interim > MAX_INTERIM {
                    return Err(HeadError::Malformed);
                }
                continue;
            }
            let framing = if head_request || matches!(resp.status().as_u16(), 204 | 304) {
                Framing {
                    decoder: Decoder::Length(0),
                    ..framing
                }
            } else {
                framing
            };
            return Ok((resp, framing));
        }
    }

    /// Reads an answer's body to its end and drops it, when it is at most `most` bytes (a
    /// collector's status answer); whether the connection can carry another request after
    /// it. A body read to the close, longer than `most`, or broken is not read further and
    /// the connection is not kept.
    pub async fn skip_body(&mut self, framing: Framing, most: usize) -> bool {
        let mut decoder = framing.decoder;
        if decoder == Decoder::Close || decoder.left().is_some_and(|n| n > most as u64) {
            return false;
        }
        let mut read = 0usize;
        loop {
            match decoder.decode(&mut self.buf) {
                Err(_) => return false,
                Ok(Step::Done) => return framing.keep_alive && self.buf.is_empty(),
                Ok(Step::Data(b)) => {
                    read = read.saturating_add(b.len());
                    if read > most {
                        return false;
                    }
                }
                Ok(Step::More) => match std::future::poll_fn(|cx| self.poll_fill(cx)).await {
                    Ok(0) | Err(_) => return false,
                    Ok(_) => {}
                },
            }
        }
    }

    /// Reads more into the buffer (a head or a body): `Ready(Ok(0))` at the connection's end.
    pub fn poll_fill(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<usize>> {
        loop {
            if self.buf.capacity() - self.buf.len() < READ_ROOM / 2 {
                self.buf.reserve(READ_ROOM);
            }
            let room = self.buf.capacity() - self.buf.len();
            match self.io.try_read_buf(&mut self.buf) {
                Ok(n) => {
                    if n > 0 && n < room && super::lane() != 0 {
                        drained(&self.io);
                    }
                    return std::task::Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::task::ready!(self.io.poll_read_ready(cx))?;
                }
                Err(e) => return std::task::Poll::Ready(Err(e)),
            }
        }
    }
}

/// After a read that did not fill the room it was given (the socket's queue was drained), the
/// socket's read readiness is cleared, as tokio's own `poll_read` does: the next read waits
/// for a new readiness event instead of making a system call that would only say "would
/// block" (one `recvfrom` per request saved). The pool's check before reuse does not rely on
/// readiness: it asks the kernel ([`Conn::idle_state`]). Only on a connection worker: its runtime is single-threaded, so no driver
/// turn (no new event) can come between the read and the clear; anything that arrives after
/// the read is an event of the next turn, which sets readiness again.
fn drained(io: &TcpStream) {
    let _ = io.try_io(tokio::io::Interest::READABLE, || {
        Err::<(), _>(io::ErrorKind::WouldBlock.into())
    });
}

/// Whether the blank line that ends a head may be in `buf` past its first `seen` bytes.
fn head_end_after(buf: &[u8], seen: usize) -> bool {
    let tail = &buf[seen.saturating_sub(3)..];
    memchr::memmem::find(tail, b"\n\r\n").is_some() || memchr::memmem::find(tail, b"\n\n").is_some()
}

/// Parses a complete head at the front of `buf` and takes it off; `None` when more is needed.
/// The framing is read from the fields as they are taken (no look-ups in the map after).
fn parse_head(buf: &mut BytesMut) -> Result<Option<(Response<()>, Framing)>, HeadError> {
    let mut slots = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut r = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut r, buf, &mut slots)
    {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(HeadError::Malformed),
    };
    let code = r.code.ok_or(HeadError::Malformed)?;
    let status = StatusCode::from_u16(code).map_err(|_| HeadError::Malformed)?;
    let version = if r.version == Some(1) {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    let mut f = Fields {
        keep_alive: version == Version::HTTP_11,
        transfer: None,
        length: None,
    };
    let base = buf.as_ptr() as usize;
    // Offsets of each field in the head, then the head frozen: the values are slices of it
    // (no copy each).
    let mut fields: smallvec::SmallVec<[(HeaderName, usize, usize); 16]> =
        smallvec::SmallVec::new();
    // Fields the `Connection` field names are for this hop only (RFC 9110 §7.6.1).
    let mut nominated: smallvec::SmallVec<[HeaderName; 2]> = smallvec::SmallVec::new();
    for h in r.headers.iter() {
        let (name, framing) = field_name(h.name.as_bytes()).ok_or(HeadError::Malformed)?;
        f.read(&name, h.value)?;
        if name == http::header::CONNECTION {
            let tokens = h.value.split(|&b| b == b',').map(<[u8]>::trim_ascii);
            nominated.extend(tokens.filter_map(|t| HeaderName::from_bytes(t).ok()));
        }
        if framing {
            // Read here, and of no use past this connection: not handed on (an answer is
            // framed again for the client).
            continue;
        }
        let at = h.value.as_ptr() as usize - base;
        fields.push((name, at, h.value.len()));
    }
    let head = buf.split_to(len).freeze();
    let mut headers = HeaderMap::with_capacity(fields.len() + ROOM_FOR_STAMPS);
    for (name, at, n) in fields {
        if nominated.contains(&name) {
            continue;
        }
        let v = HeaderValue::from_maybe_shared(head.slice(at..at + n))
            .map_err(|_| HeadError::Malformed)?;
        headers.append(name, v);
    }
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    *resp.headers_mut() = headers;
    Ok(Some((resp, f.framing())))
}

/// A field's name, and whether it is one of the framing fields (`Connection`, `Keep-Alive`,
/// `Content-Length`, `Transfer-Encoding`) as servers spell them. The names most answers (and
/// requests, for `super::front`) carry
/// are matched whole (a length compare, then a few bytes) instead of going through
/// `HeaderName::from_bytes`, which lower-cases the name into a scratch buffer and then looks
/// it up: about 250 instructions a field, a fifth of an answer head's cost. A framing field
/// spelled otherwise is still read (`Fields::read` compares names) and is left in the map for
/// the hop-by-hop filter of the answer handed on.
pub(super) fn field_name(b: &[u8]) -> Option<(HeaderName, bool)> {
    use http::header;
    Some(match b {
        b"Date" | b"date" => (header::DATE, false),
        b"Server" | b"server" => (header::SERVER, false),
        b"Content-Type" | b"content-type" => (header::CONTENT_TYPE, false),
        b"Content-Length" | b"content-length" => (header::CONTENT_LENGTH, true),
        b"Connection" | b"connection" => (header::CONNECTION, true),
        b"Keep-Alive" | b"keep-alive" => (HeaderName::from_static("keep-alive"), true),
        b"Transfer-Encoding" | b"transfer-encoding" => (header::TRANSFER_ENCODING, true),
        b"Cache-Control" | b"cache-control" => (header::CACHE_CONTROL, false),
        b"Vary" | b"vary" => (header::VARY, false),
        b"Content-Encoding" | b"content-encoding" => (header::CONTENT_ENCODING, false),
        // The names requests carry most (the sidecar's own server reads them with this).
        b"Host" | b"host" => (header::HOST, false),
        b"Authorization" | b"authorization" => (header::AUTHORIZATION, false),
        b"User-Agent" | b"user-agent" => (header::USER_AGENT, false),
        b"Accept" | b"accept" => (header::ACCEPT, false),
        b"Accept-Encoding" | b"accept-encoding" => (header::ACCEPT_ENCODING, false),
        _ => return HeaderName::from_bytes(b).ok().map(|n| (n, false)),
    })
}

/// What the framing fields of a head said.
struct Fields {
    keep_alive: bool,
    /// `Transfer-Encoding` was sent: whether its last coding is chunked.
    transfer: Option<bool>,
    length: Option<u64>,
}

impl Fields {
    fn read(&mut self, name: &HeaderName, value: &[u8]) -> Result<(), HeadError> {
        let tokens = || value.split(|&b| b == b',').map(<[u8]>::trim_ascii);
        if *name == http::header::CONNECTION {
            if tokens().any(|t| t.eq_ignore_ascii_case(b"close")) {
                self.keep_alive = false;
            }
        } else if *name == http::header::TRANSFER_ENCODING {
            self.transfer = Some(
                tokens()
                    .next_back()
                    .is_some_and(|t| t.eq_ignore_ascii_case(b"chunked")),
            );
        } else if *name == http::header::CONTENT_LENGTH {
            for part in tokens() {
                let n = crate::body::content_length(part).ok_or(HeadError::Malformed)?;
                if self.length.is_some_and(|l| l != n) {
                    return Err(HeadError::Malformed);
                }
                self.length = Some(n);
            }
        }
        Ok(())
    }

    /// The body's framing (RFC 9112 §6.3).
    fn framing(self) -> Framing {
        let close = Framing {
            decoder: Decoder::Close,
            keep_alive: false,
        };
        match (self.transfer, self.length) {
            (Some(true), length) => Framing {
                decoder: Decoder::Chunked(Chunk::Size),
                // A length beside a transfer coding is ignored, and the connection not
                // trusted again.
                keep_alive: self.keep_alive && length.is_none(),
            },
            (Some(false), _) | (None, None) => close,
            (None, Some(n)) => Framing {
                decoder: Decoder::Length(n),
                keep_alive: self.keep_alive,
            },
        }
    }
}

/// Where a chunked body's reading is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data: bytes left.
    Data(u64),
    /// After a chunk's data: its CRLF (`true` once the CR was seen).
    DataEnd(bool),
    /// After the last chunk: trailer lines, bytes read of them, and whether the current line
    /// is empty so far.
    Trailers { read: usize, empty: bool },
}

/// How much of the body is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoder {
    /// This many bytes.
    Length(u64),
    Chunked(Chunk),
    /// Everything to the connection's close.
    Close,
    /// The body ended.
    Done,
}

/// What [`Decoder::decode`] found in the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    Data(Bytes),
    /// Nothing usable yet: read more.
    More,
    Done,
}

/// A body that broke its own framing.
#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// A chunk-size line or trailer that is not one, or is past its bound.
    Malformed,
    /// The connection ended before the body did.
    Incomplete,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DecodeError::Malformed => "malformed chunked body",
            DecodeError::Incomplete => "the upstream closed before the body's end",
        })
    }
}

impl std::error::Error for DecodeError {}

fn take(buf: &mut BytesMut, left: u64) -> (Bytes, u64) {
    let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
    (buf.split_to(n).freeze(), left - n as u64)
}

impl Decoder {
    /// Takes the next piece of the body from the front of `buf`.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Step, DecodeError> {
        match self {
            Decoder::Done | Decoder::Length(0) => {
                *self = Decoder::Done;
                Ok(Step::Done)
            }
            Decoder::Length(left) => {
                if buf.is_empty() {
                    return Ok(Step::More);
                }
                let (data, rest) = take(buf, *left);
                *self = if rest == 0 {
                    Decoder::Done
                } else {
                    Decoder::Length(rest)
                };
                Ok(Step::Data(data))
            }
            Decoder::Close => {
                if buf.is_empty() {
                    return Ok(Step::More);
                }
                Ok(Step::Data(buf.split().freeze()))
            }
            Decoder::Chunked(c) => {
                let step = chunked(c, buf)?;
                if step == Step::Done {
                    *self = Decoder::Done;
                }
                Ok(step)
            }
        }
    }

    /// The connection ended: fine only for a body read to the close.
    pub fn eof(&mut self) -> Result<(), DecodeError> {
        match self {
            Decoder::Close | Decoder::Done => {
                *self = Decoder::Done;
                Ok(())
            }
            _ => Err(DecodeError::Incomplete),
        }
    }

    /// Bytes of the body still to come, when known.
    pub fn left(&self) -> Option<u64> {
        match self {
            Decoder::Length(n) => Some(*n),
            Decoder::Done => Some(0),
            _ => None,
        }
    }
}

/// A whole chunk-size line's size, read as strictly as hyper does: `httparse`'s parser (hex
/// digits, an optional `;` extension, CRLF; a bare LF, a second number or a stray byte after
/// CR refused). Leading zeros are taken off first: RFC 9112 puts no bound on them, and
/// httparse counts them against its 16 digits.
fn chunk_size(line: &[u8]) -> Result<u64, DecodeError> {
    let zeros = line.iter().take_while(|&&b| b == b'0').count();
    let from = if line.get(zeros).is_some_and(u8::is_ascii_hexdigit) {
        zeros
    } else {
        zeros.saturating_sub(1)
    };
    if !line.first().is_some_and(u8::is_ascii_hexdigit) {
        return Err(DecodeError::Malformed);
    }
    match httparse::parse_chunk_size(&line[from..]) {
        Ok(httparse::Status::Complete((n, size))) if from + n == line.len() => Ok(size),
        _ => Err(DecodeError::Malformed),
    }
}

fn chunked(c: &mut Chunk, buf: &mut BytesMut) -> Result<Step, DecodeError> {
    loop {
        if buf.is_empty() {
            return Ok(Step::More);
        }
        match c {
            Chunk::Data(left) => {
                let (data, rest) = take(buf, *left);
                *c = if rest == 0 {
                    Chunk::DataEnd(false)
                } else {
                    Chunk::Data(rest)
                };
                return Ok(Step::Data(data));
            }
            Chunk::DataEnd(cr) => {
                let b = buf[0];
                buf.advance(1);
                match (b, *cr) {
                    (b'\r', false) => *cr = true,
                    (b'\n', true) => *c = Chunk::Size,
                    _ => return Err(DecodeError::Malformed),
                }
            }
            Chunk::Size => {
                // The whole line first (it stays in the buffer until its end has come).
                let Some(end) = memchr::memchr(b'\n', &buf[..buf.len().min(MAX_CHUNK_LINE)]) else {
                    if buf.len() >= MAX_CHUNK_LINE {
                        return Err(DecodeError::Malformed);
                    }
                    return Ok(Step::More);
                };
                let size = chunk_size(&buf[..=end])?;
                buf.advance(end + 1);
                *c = if size == 0 {
                    Chunk::Trailers {
                        read: 0,
                        empty: true,
                    }
                } else {
                    Chunk::Data(size)
                };
            }
            Chunk::Trailers { read, empty } => {
                let b = buf[0];
                buf.advance(1);
                *read += 1;
                if *read > MAX_TRAILERS {
                    return Err(DecodeError::Malformed);
                }
                match b {
                    b'\n' if *empty => return Ok(Step::Done),
                    b'\n' => *empty = true,
                    b'\r' => {}
                    _ => *empty = false,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<Option<(Response<()>, Framing)>, HeadError> {
        parse_head(&mut BytesMut::from(text))
    }

    fn decode_all(mut d: Decoder, input: &[u8], piece: usize) -> Result<Vec<u8>, DecodeError> {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut fed = 0;
        loop {
            match d.decode(&mut buf)? {
                Step::Data(b) => out.extend_from_slice(&b),
                Step::Done => return Ok(out),
                Step::More if fed < input.len() => {
                    let end = (fed + piece).min(input.len());
                    buf.extend_from_slice(&input[fed..end]);
                    fed = end;
                }
                Step::More => {
                    d.eof()?;
                    return Ok(out);
                }
            }
        }
    }

    fn chunked0() -> Decoder {
        Decoder::Chunked(Chunk::Size)
    }

    #[test]
    fn known_names_are_matched_whole_and_framing_fields_are_read_not_handed_on() {
        for (spelled, name, framing) in [
            ("Date", "date", false),
            ("server", "server", false),
            ("Content-Type", "content-type", false),
            ("content-length", "content-length", true),
            ("Connection", "connection", true),
            ("Keep-Alive", "keep-alive", true),
            ("transfer-encoding", "transfer-encoding", true),
            ("Vary", "vary", false),
            ("Host", "host", false),
            ("authorization", "authorization", false),
            // Spelled otherwise: through `HeaderName::from_bytes`, the same name.
            ("CONTENT-TYPE", "content-type", false),
            ("X-Request-Id", "x-request-id", false),
        ] {
            let (n, f) = field_name(spelled.as_bytes()).unwrap();
            assert_eq!((n.as_str(), f), (name, framing), "{spelled}");
        }
        assert!(field_name(b"bad name").is_none());
        assert!(field_name(b"").is_none());
        let (r, f) = head("HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\nServer: x\r\n\r\n")
            .unwrap()
            .unwrap();
        let names: Vec<_> = r.headers().keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["server"]);
        assert_eq!(f.decoder, Decoder::Length(2));
        // A framing field spelled unusually is still read, and stays for the hop-by-hop filter.
        let (r, f) =
            head("HTTP/1.1 200 OK\r\nCONNECTION: close\r\nTRANSFER-ENCODING: chunked\r\n\r\n")
                .unwrap()
                .unwrap();
        assert!(!f.keep_alive);
        assert_eq!(f.decoder, chunked0());
        assert!(r.headers().contains_key("connection"));
        assert!(r.headers().contains_key("transfer-encoding"));
        assert!(r.headers().capacity() >= 2 + ROOM_FOR_STAMPS);
        // A field the `Connection` field names is this hop's only, wherever it stands.
        let (r, _) = head("HTTP/1.1 200 OK\r\nX-Hop: a\r\nConnection: x-hop, X-Other\r\nX-Other: b\r\nX-Kept: c\r\nContent-Length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        let names: Vec<_> = r.headers().keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["x-kept"]);
    }

    #[test]
    fn heads_give_status_headers_and_framing() {
        let (r, f) = head("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\nX-A: 1\r\nX-A: 2\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["content-type"], "application/json");
        assert_eq!(r.headers().get_all("x-a").iter().count(), 2);
        assert_eq!(
            f,
            Framing {
                decoder: Decoder::Length(12),
                keep_alive: true
            }
        );
        let (_, f) = head("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(matches!(f.decoder, Decoder::Chunked(_)) && f.keep_alive);
        let (_, f) =
            head("HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 1\r\n\r\n")
                .unwrap()
                .unwrap();
        assert!(!f.keep_alive);
        let (_, f) = head("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!f.keep_alive);
        let (_, f) = head("HTTP/1.1 200 OK\r\n\r\n").unwrap().unwrap();
        assert_eq!(
            f,
            Framing {
                decoder: Decoder::Close,
                keep_alive: false
            }
        );
        // A length beside chunked: chunked wins and the connection is not reused.
        let (_, f) =
            head("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
                .unwrap()
                .unwrap();
        assert!(matches!(f.decoder, Decoder::Chunked(_)) && !f.keep_alive);
        assert!(head("HTTP/1.1 200 OK\r\nContent-Length: 1")
            .unwrap()
            .is_none());
    }

    #[test]
    fn a_head_end_split_across_reads_is_seen() {
        let head = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
        let end = head.len();
        for seen in 1..end {
            assert!(head_end_after(head, seen), "{seen}");
        }
        assert!(!head_end_after(&head[..end - 1], end - 2));
        assert!(head_end_after(b"HTTP/1.1 200 OK\n\n", 16));
    }

    #[test]
    fn hostile_heads_are_refused() {
        for bad in [
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 0x10\r\n\r\n",
            "HTTP/1.1 20 OK\r\n\r\n",
            "SSH-2.0-OpenSSH\r\n\r\n",
            "HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
        ] {
            assert_eq!(head(bad).unwrap_err(), HeadError::Malformed, "{bad:?}");
        }
        let many: String = (0..MAX_HEADERS + 1)
            .map(|i| format!("x-{i}: v\r\n"))
            .collect();
        assert_eq!(
            head(&format!("HTTP/1.1 200 OK\r\n{many}\r\n")).unwrap_err(),
            HeadError::Malformed
        );
        // The same length said twice is one length.
        let (_, f) = head("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(f.decoder, Decoder::Length(5));
    }

    #[test]
    fn lengths_and_chunks_decode_whatever_the_pieces() {
        for piece in [1, 2, 3, 7, 64, 4096] {
            assert_eq!(
                decode_all(Decoder::Length(5), b"hello", piece).unwrap(),
                b"hello"
            );
            let body =
                b"5\r\nhello\r\n6;ext=1\r\n world\r\nA \r\n0123456789\r\n0\r\nx-t: 1\r\n\r\n";
            assert_eq!(
                decode_all(chunked0(), body, piece).unwrap(),
                b"hello world0123456789"
            );
            assert_eq!(
                decode_all(Decoder::Close, b"to the end", piece).unwrap(),
                b"to the end"
            );
        }
    }

    #[test]
    fn broken_bodies_are_errors_never_a_wrong_length() {
        assert_eq!(
            decode_all(Decoder::Length(10), b"short", 3),
            Err(DecodeError::Incomplete)
        );
        assert_eq!(
            decode_all(chunked0(), b"5\r\nhel", 2),
            Err(DecodeError::Incomplete)
        );
        for bad in [
            &b"11111111111111111\r\n"[..],
            b"zz\r\n",
            // Lenient forms hyper refuses: a bare LF, a second number, CR and a stray byte,
            // a bare LF after a chunk's data.
            b"5\nhello\r\n0\r\n\r\n",
            b"5 6\r\nhello\r\n0\r\n\r\n",
            b"5\rXhello\r\n0\r\n\r\n",
            b"5\r\nhello\n0\r\n\r\n",
            b"\r\n",
            b"5\r\nhelloXX",
        ] {
            assert_eq!(
                decode_all(chunked0(), bad, 5),
                Err(DecodeError::Malformed),
                "{bad:?}"
            );
        }
        let long_ext = format!("1;{}\r\n", "e".repeat(MAX_CHUNK_LINE));
        assert_eq!(
            decode_all(chunked0(), long_ext.as_bytes(), 512),
            Err(DecodeError::Malformed)
        );
        let trailers = format!("0\r\n{}", "x-t: 1\r\n".repeat(MAX_TRAILERS / 8 + 1));
        assert_eq!(
            decode_all(chunked0(), trailers.as_bytes(), 512),
            Err(DecodeError::Malformed)
        );
        // Leading zeros do not count against the 16 digits; an extension is taken.
        assert_eq!(
            decode_all(
                chunked0(),
                b"00000000000000005\r\nhello\r\n000;x=1\r\n\r\n",
                3
            ),
            Ok(b"hello".to_vec())
        );
        // A size at u64's bound is read, not wrapped.
        let mut d = chunked0();
        let mut buf = BytesMut::from(&b"ffffffffffffffff\r\nab"[..]);
        assert_eq!(
            d.decode(&mut buf).unwrap(),
            Step::Data(Bytes::from_static(b"ab"))
        );
        assert_eq!(d, Decoder::Chunked(Chunk::Data(u64::MAX - 2)));
    }

    #[test]
    fn a_body_leaves_what_follows_it_in_the_buffer() {
        let mut buf = BytesMut::from(&b"helloHTTP/1.1"[..]);
        let mut d = Decoder::Length(5);
        assert_eq!(
            d.decode(&mut buf).unwrap(),
            Step::Data(Bytes::from_static(b"hello"))
        );
        assert_eq!(d.decode(&mut buf).unwrap(), Step::Done);
        assert_eq!(&buf[..], b"HTTP/1.1");
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// `data` in chunks of the given sizes, each size line with leading zeros and maybe
        /// an extension.
        fn encode(data: &[u8], sizes: &[usize], zeros: usize, ext: bool) -> Vec<u8> {
            let mut out = Vec::new();
            let mut rest = data;
            let mut i = 0;
            while !rest.is_empty() {
                let n = sizes[i % sizes.len()].clamp(1, rest.len());
                i += 1;
                out.extend_from_slice(format!("{}{n:x}", "0".repeat(zeros)).as_bytes());
                if ext {
                    out.extend_from_slice(b";a=b");
                }
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(&rest[..n]);
                out.extend_from_slice(b"\r\n");
                rest = &rest[n..];
            }
            out.extend_from_slice(b"0\r\nx-t: 1\r\n\r\n");
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

            /// A valid chunked body decodes to its data whatever the reads' sizes.
            #[test]
            fn chunked_bodies_decode_whatever_the_reads(
                data in prop::collection::vec(any::<u8>(), 0..600),
                sizes in prop::collection::vec(1usize..300, 1..5),
                zeros in 0usize..20,
                ext in any::<bool>(),
                piece in 1usize..64,
            ) {
                let wire = encode(&data, &sizes, zeros, ext);
                prop_assert_eq!(decode_all(chunked0(), &wire, piece), Ok(data));
            }

            /// Any bytes: the decoder never panics, never yields more than it was given, and
            /// reads the same whatever the reads' sizes.
            #[test]
            fn any_bytes_decode_the_same_in_any_pieces(
                wire in prop::collection::vec(prop_oneof![Just(b'\r'), Just(b'\n'), Just(b'0'), Just(b'a'), Just(b';'), Just(b' '), any::<u8>()], 0..200),
                piece in 1usize..32,
            ) {
                let whole = decode_all(chunked0(), &wire, wire.len().max(1));
                let pieces = decode_all(chunked0(), &wire, piece);
                prop_assert_eq!(&whole, &pieces);
                if let Ok(out) = whole {
                    prop_assert!(out.len() <= wire.len());
                }
            }
        }
    }
}
