//! The sidecar's own HTTP/1.1 server for a client's connection: the common request (a whole
//! head in one read, a `Content-Length` body of at most
//! [`MAX_WHOLE_BODY`](crate::wire::request::MAX_WHOLE_BODY), no `Expect`, no
//! transfer coding, no upgrade) is parsed with `httparse`, its body read whole, handed to the
//! handler, and its answer written straight from the handler's response: the head in one
//! buffer, a whole body beside it in one `writev`, a stream as chunks written as they come
//! (never buffered). hyper's server costs ~14,000 instructions a request on this path; this
//! one a fraction of that (docs/performance.md, eighteenth round).
//!
//! Anything else (HTTP/1.0, h2c, `Expect: 100-continue`, a chunked or large request body, a
//! head that comes in pieces, a malformed head) hands the connection, with every byte read
//! and not yet served, to hyper, which serves it from there on exactly as before: its checks,
//! its error answers, its header timer. The hand-over is always possible because nothing of a
//! request is consumed until it is known to be served here.
//!
//! As with hyper: the client's close (or a broken connection) while its request is worked on
//! drops the handler's future (the governed work runs on to its end, detached, and is recorded
//! as the client's disconnect); bytes of a next (pipelined) request are kept, up to
//! [`MAX_AHEAD`]; `Connection: close` is honoured; a connection idle for the header timeout
//! is closed; on shutdown an idle connection closes at once and a busy one after its answer,
//! which says `connection: close`.

use super::finish::After;
use super::server::Handler;
use super::stamps::Stamps;
use crate::body::Body;
use bytes::{Bytes, BytesMut};
use http::header;
use http::{Request, Response};
use http_body::Body as _;
use std::future::{poll_fn, Future};
use std::io::{self, IoSlice};
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::body::ReqBody;
use crate::wire::request::{parse, Head, Parsed};
/// What a read asks room for.
const READ_ROOM: usize = 8 * 1024;
/// Most bytes of next requests read while one is served (more waits in the socket).
const MAX_AHEAD: usize = 64 * 1024;

/// A port's bounds for a connection, read from the policy in force when it was accepted.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// The longest wait for a next request, and for the rest of a body that came in pieces.
    pub header_timeout: Duration,
    /// `server.max_body_bytes`: a larger declared body is hyper's (and the handler's 413),
    /// never read here.
    pub max_body: u64,
}

/// How a connection served here ended.
pub enum End {
    /// Closed (by either side, or on shutdown).
    Closed,
    /// A request this server does not serve: the connection goes to hyper, with these bytes
    /// (read, not served) first.
    HandOver(Bytes),
}

/// Serves requests on `io` until the connection ends or a request is handed over.
/// `header_timeout` bounds the wait for a next request (then the connection closes) and for
/// the rest of a body that came in pieces (then the connection goes to hyper, whose handler
/// reads it under its own bounds).
pub async fn serve<H: Handler>(
    io: &mut TcpStream,
    bounds: Bounds,
    port: &'static str,
    stopping: &watch::Receiver<bool>,
    svc: &H,
) -> End {
    let header_timeout = bounds.header_timeout;
    let mut buf = BytesMut::with_capacity(READ_ROOM);
    let mut out: Vec<u8> = Vec::with_capacity(1024);
    let (mut watch_stop, peek_stop) = (stopping.clone(), stopping.clone());
    if *peek_stop.borrow() {
        return End::Closed;
    }
    // Made once: resolves when the shutdown begins.
    let mut stop = pin!(async move {
        let _ = watch_stop.changed().await;
    });
    // The wait for a next request is bounded by the header timeout, as hyper's was (its
    // header timer started as soon as it waited for a head). One timer for the connection,
    // moved on only when it fires early: an idle wait costs a clock read, not a timer.
    let mut idle = pin!(tokio::time::sleep(header_timeout));
    // The shutdown's and the timer's futures are polled once, to register this task's waker
    // (which stays the same for the connection's life); after that a wake-up from either is
    // read from their state, not by polling them again.
    let mut armed = false;
    loop {
        if buf.is_empty() {
            buf.reserve(READ_ROOM);
            let since = tokio::time::Instant::now();
            let read = {
                let mut read = pin!(io.read_buf(&mut buf));
                poll_fn(|cx| {
                    if let Poll::Ready(r) = read.as_mut().poll(cx) {
                        return Poll::Ready(Some(r));
                    }
                    if !armed {
                        armed = true;
                        if stop.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(None);
                        }
                        let _ = idle.as_mut().poll(cx);
                    } else if peek_stop.has_changed().unwrap_or(true) {
                        return Poll::Ready(None);
                    }
                    while idle.is_elapsed() {
                        let due = since + header_timeout;
                        if tokio::time::Instant::now() >= due {
                            return Poll::Ready(None);
                        }
                        idle.as_mut().reset(due);
                        let _ = idle.as_mut().poll(cx);
                    }
                    Poll::Pending
                })
                .await
            };
            match read {
                Some(Ok(n)) if n > 0 => {}
                _ => return End::Closed,
            }
        }
        let (head, req) = match whole_request(io, &mut buf, bounds, port).await {
            Ok(r) => r,
            Err(end) => return end,
        };
        // Made in its box (not moved there, nor through the frames below it).
        let answer = watched(pin_in_place!(svc.call(req)), io, &mut buf).await;
        let Some(Ok(resp)) = answer else {
            // The client went away: its request's work goes on detached (see `Detach`).
            return End::Closed;
        };
        let close = head.close || peek_stop.has_changed().unwrap_or(true);
        if !answered(io, resp, close, &mut out, &mut buf, header_timeout).await {
            return End::Closed;
        }
    }
}

/// Writes `resp`, then closes its request's record (which waits until the answer is out,
/// see `After`); `false` when the connection ends here (cut, or `close`), shut down.
async fn answered(
    io: &mut TcpStream,
    mut resp: Response<Body>,
    close: bool,
    out: &mut Vec<u8>,
    buf: &mut BytesMut,
    header_timeout: Duration,
) -> bool {
    let after = resp.extensions_mut().remove::<After>();
    let cut = write(io, resp, close, out, buf, header_timeout)
        .await
        .is_err();
    super::finish::run_after(after, cut).await;
    if cut || close {
        let _ = io.shutdown().await;
        return false;
    }
    true
}

/// The next request on `io`, whole: its head read on (under a deadline from its first
/// byte) while it is only begun, then its body waited for (under a deadline) when it is not
/// all here yet. Bytes past it (pipelined) stay in `buf`. `Err` says how the connection
/// ends instead: closed, or handed to hyper with what was read.
async fn whole_request(
    io: &mut TcpStream,
    buf: &mut BytesMut,
    bounds: Bounds,
    port: &'static str,
) -> Result<(Head, Request<ReqBody>), End> {
    let header_timeout = bounds.header_timeout;
    // Whatever its bytes look like, nothing goes to hyper before the head is whole:
    // hyper-util's protocol sniff waits without a timer for as long as the bytes could
    // still be the HTTP/2 preface (one `P` held a connection open forever).
    let started = tokio::time::Instant::now();
    let head = loop {
        match parse(buf, bounds.max_body) {
            Parsed::Here(head) => break head,
            Parsed::Elsewhere => return Err(End::HandOver(buf.split().freeze())),
            Parsed::Reject(bad) => {
                let _ = io.write_all(&super::conn::error_answer(bad, port)).await;
                let _ = io.shutdown().await;
                return Err(End::Closed);
            }
            Parsed::Partial => {
                buf.reserve(READ_ROOM);
                let due = started + header_timeout;
                match tokio::time::timeout_at(due, io.read_buf(buf)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    Ok(_) => return Err(End::Closed),
                    Err(_) => {
                        super::conn::count_refused(port, "slow_head");
                        return Err(End::Closed);
                    }
                }
            }
        }
    };
    let whole = head.len + head.body;
    if buf.len() < whole {
        buf.reserve(whole - buf.len());
        let deadline = tokio::time::Instant::now() + header_timeout;
        while buf.len() < whole {
            match tokio::time::timeout_at(deadline, io.read_buf(buf)).await {
                Ok(Ok(n)) if n > 0 => {}
                // Late, cut short or broken: hyper reads on (and answers) as it would have.
                _ => return Err(End::HandOver(buf.split().freeze())),
            }
        }
    }
    // Everything read so far, frozen: the head's parts and the body are slices of it;
    // what lies past this request (pipelined) goes back to the buffer.
    let all = buf.split().freeze();
    let body = all.slice(head.len..whole);
    let Some(req) = head.request(&all, body) else {
        return Err(End::HandOver(all));
    };
    if all.len() > whole {
        buf.extend_from_slice(&all[whole..]);
    }
    Ok((head, req))
}

/// `fut`'s output, or `None` when the client closes (or breaks) the connection first. Bytes
/// that come meanwhile (a next request) are kept in `buf`, up to [`MAX_AHEAD`]. The read side
/// is only looked at when readiness says something came: no system call otherwise.
async fn watched<T>(fut: impl Future<Output = T>, io: &TcpStream, buf: &mut BytesMut) -> Option<T> {
    let mut fut = pin!(fut);
    let mut watching = true;
    poll_fn(|cx| {
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(Some(v));
        }
        while watching {
            match io.poll_read_ready(cx) {
                Poll::Pending => break,
                Poll::Ready(Err(_)) => return Poll::Ready(None),
                Poll::Ready(Ok(())) => {}
            }
            if buf.len() >= MAX_AHEAD {
                // Too much ahead: no more is read (nor a close seen) until this answer is out.
                watching = false;
                break;
            }
            buf.reserve(READ_ROOM);
            match io.try_read_buf(buf) {
                Ok(0) => return Poll::Ready(None),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return Poll::Ready(None),
            }
        }
        Poll::Pending
    })
    .await
}

/// How an answer's body is delimited on the wire.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No body (1xx, 204, 304).
    None,
    Length(u64),
    Chunked,
}

/// Why an answer could not be written whole: the connection is closed after it.
struct Cut;

/// A piece at least this large is written from its own buffer (not copied into the one that
/// gathers what goes out together).
const OWN_WRITE: usize = 16 * 1024;
/// Most bytes gathered before they go out, however many pieces are ready.
const GATHER: usize = 64 * 1024;

/// Writes `resp` and its body. `Err`: the connection cannot carry another answer (the client
/// went, the body broke, or it did not match its length).
///
/// What goes out together: the head and every piece of the body already there when it is
/// looked at (a whole body: one write with the head; a stream's events that came in one read
/// of the upstream: one write). Nothing waits to be gathered: when the body has nothing ready,
/// what was gathered goes out before the next piece is awaited.
async fn write(
    io: &mut TcpStream,
    resp: Response<Body>,
    close: bool,
    out: &mut Vec<u8>,
    ahead: &mut BytesMut,
    stall: Duration,
) -> Result<(), Cut> {
    let (parts, mut body) = resp.into_parts();
    let status = parts.status.as_u16();
    let framing = if matches!(status, 100..=199 | 204 | 304) {
        Framing::None
    } else if let Some(n) = body.size_hint().exact() {
        Framing::Length(n)
    } else {
        Framing::Chunked
    };
    out.clear();
    head(out, &parts, framing, close);
    if framing == Framing::None {
        return send(io, &mut [IoSlice::new(out)], stall).await;
    }
    let chunked = framing == Framing::Chunked;
    let mut sent = 0u64;
    loop {
        let frame = match poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await {
            Poll::Ready(f) => f,
            Poll::Pending => {
                if !out.is_empty() {
                    send(io, &mut [IoSlice::new(out)], stall).await?;
                    out.clear();
                }
                let next = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx));
                watched(next, io, ahead).await.ok_or(Cut)?
            }
        };
        let data = match frame {
            None => break,
            Some(Err(_)) => {
                // What was gathered stands; the connection cannot go on.
                let _ = send(io, &mut [IoSlice::new(out)], stall).await;
                return Err(Cut);
            }
            Some(Ok(f)) => match f.into_data() {
                Ok(d) if !d.is_empty() => d,
                _ => continue,
            },
        };
        sent = sent.saturating_add(data.len() as u64);
        if let Framing::Length(n) = framing {
            if sent > n {
                let _ = send(io, &mut [IoSlice::new(out)], stall).await;
                return Err(Cut);
            }
        }
        let mut size = [0u8; 20];
        let line: &[u8] = if chunked {
            chunk_line(&mut size, data.len())
        } else {
            &[]
        };
        let last = body.is_end_stream();
        let tail: &[u8] = match (chunked, last) {
            (false, _) => &[],
            (true, false) => b"\r\n",
            (true, true) => b"\r\n0\r\n\r\n",
        };
        if last || data.len() >= OWN_WRITE {
            // Out at once, the piece from its own buffer: a whole body with its head.
            let mut parts = [
                IoSlice::new(out),
                IoSlice::new(line),
                IoSlice::new(&data),
                IoSlice::new(tail),
            ];
            send(io, &mut parts, stall).await?;
            out.clear();
            if last {
                return length_kept(framing, sent);
            }
            continue;
        }
        out.extend_from_slice(line);
        out.extend_from_slice(&data);
        out.extend_from_slice(tail);
        if out.len() >= GATHER {
            send(io, &mut [IoSlice::new(out)], stall).await?;
            out.clear();
        }
    }
    if chunked {
        out.extend_from_slice(b"0\r\n\r\n");
    }
    send(io, &mut [IoSlice::new(out)], stall).await?;
    length_kept(framing, sent)
}

/// `Err` when a body sent fewer bytes than its length said (what went out stands; the
/// connection cannot go on).
fn length_kept(framing: Framing, sent: u64) -> Result<(), Cut> {
    match framing {
        Framing::Length(n) if sent != n => Err(Cut),
        _ => Ok(()),
    }
}

/// A chunk's size line (`<hex>\r\n`) in `buf`.
fn chunk_line(buf: &mut [u8; 20], n: usize) -> &[u8] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut i = 18;
    let mut n = n;
    loop {
        i -= 1;
        buf[i] = HEX[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    buf[18] = b'\r';
    buf[19] = b'\n';
    &buf[i..]
}

/// The answer's head: status line, the handler's fields (not its framing ones: the framing is
/// written here; not those its stamped fields replace), the stamped fields, `date` when it has
/// none, and the framing.
fn head(out: &mut Vec<u8>, parts: &http::response::Parts, framing: Framing, close: bool) {
    let status = parts.status;
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let stamps = parts.extensions.get::<Stamps>();
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || name == header::CONNECTION
            || name.as_str() == "keep-alive"
            || stamps.is_some_and(|s| s.covers(name))
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if let Some(s) = stamps {
        out.extend_from_slice(s.lines());
    }
    if !parts.headers.contains_key(header::DATE) {
        out.extend_from_slice(b"date: ");
        date(out);
        out.extend_from_slice(b"\r\n");
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    match framing {
        Framing::None => {}
        Framing::Length(n) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    out.extend_from_slice(b"\r\n");
}

thread_local! {
    /// The HTTP date of the current second, and the second it is of.
    static DATE: std::cell::Cell<(u64, [u8; 29])> = const { std::cell::Cell::new((0, [0; 29])) };
}

/// Appends the current time as an HTTP date (made once a second per thread).
fn date(out: &mut Vec<u8>) {
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (at, text) = DATE.with(std::cell::Cell::get);
    if at == secs && at != 0 {
        out.extend_from_slice(&text);
        return;
    }
    let s = httpdate::fmt_http_date(now);
    let mut text = [b' '; 29];
    let n = s.len().min(29);
    text[..n].copy_from_slice(&s.as_bytes()[..n]);
    DATE.with(|d| d.set((secs, text)));
    out.extend_from_slice(&text);
}

/// Writes all of `parts` (empty ones skipped). A client that takes no byte for `stall` (the
/// header timeout: the longest a client may leave its connection without progress) is cut:
/// a stalled reader's socket is not held open after its stream was settled. No timer while
/// the socket takes what is written.
async fn send(io: &mut TcpStream, parts: &mut [IoSlice<'_>], stall: Duration) -> Result<(), Cut> {
    let mut parts: &mut [IoSlice<'_>] = parts;
    IoSlice::advance_slices(&mut parts, 0);
    while !parts.is_empty() {
        match io.try_write_vectored(parts) {
            Ok(0) => return Err(Cut),
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                match tokio::time::timeout(stall, io.writable()).await {
                    Ok(Ok(())) => {}
                    _ => return Err(Cut),
                }
            }
            Err(_) => return Err(Cut),
        }
    }
    Ok(())
}

/// A connection handed over to hyper: the bytes already read from it come first.
#[derive(Debug)]
pub struct Rewind {
    first: Bytes,
    io: TcpStream,
}

impl Rewind {
    pub fn new(first: Bytes, io: TcpStream) -> Self {
        Rewind { first, io }
    }
}

impl tokio::io::AsyncRead for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        out: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.first.is_empty() {
            let n = self.first.len().min(out.remaining());
            out.put_slice(&self.first.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, out)
    }
}

impl tokio::io::AsyncWrite for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn chunk_lines_are_hex() {
        let mut b = [0u8; 20];
        assert_eq!(chunk_line(&mut b, 0), b"0\r\n");
        assert_eq!(chunk_line(&mut b, 255), b"ff\r\n");
        assert_eq!(chunk_line(&mut b, usize::MAX), b"ffffffffffffffff\r\n");
    }

    #[test]
    fn a_head_frames_its_body_and_says_close() {
        let mut resp = Response::new(());
        resp.headers_mut()
            .insert("content-length", HeaderValue::from_static("99"));
        resp.headers_mut()
            .insert("x-a", HeaderValue::from_static("b"));
        resp.headers_mut()
            .insert("date", HeaderValue::from_static("D"));
        let (parts, ()) = resp.into_parts();
        let mut out = Vec::new();
        head(&mut out, &parts, Framing::Length(7), true);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 OK\r\nx-a: b\r\ndate: D\r\nconnection: close\r\ncontent-length: 7\r\n\r\n"
        );
        let mut out = Vec::new();
        head(&mut out, &parts, Framing::Chunked, false);
        let s = String::from_utf8(out).unwrap();
        assert!(
            s.ends_with("transfer-encoding: chunked\r\n\r\n") && !s.contains("99"),
            "{s}"
        );
    }
}
