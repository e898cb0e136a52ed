//! Keep-alive connections to cleartext HTTP/1 upstreams (a local Ollama, vLLM, an in-cluster
//! gateway), pooled per authority, each spoken to by the task that makes the call
//! ([`super::h1`]).
//!
//! hyper-util's pooled client cost ~11,800 instructions per request on the bench request;
//! hyper's own `client::conn` over this pool still ~13,000 (a connection task per connection,
//! woken through a channel for every request and every piece of its body, and a header map
//! parsed for it). Here the request's own task writes the request, parses the answer's head
//! and reads its body: no task, no channel. An idle connection waits in a lock-free queue per
//! authority; the body that read an answer to its end puts the connection back (a body
//! dropped before its end closes it). TLS upstreams keep hyper-util's client (HTTP/2 by ALPN).
//!
//! The idle queue of an authority has one lane per connection worker
//! ([`super::lane`]): a socket is registered with the runtime that dialed it, so it
//! is only reused from there.

use super::h1::{Conn, DecodeError, Decoder, HeadError, IdleState, Step};
use super::MAX_LANES as MAX_WORKERS;
use bytes::Bytes;
use crossbeam_queue::ArrayQueue;
use dashmap::DashMap;
use http::{HeaderValue, Method, Request, Response};
use http_body::{Frame, SizeHint};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Idle connections kept per authority and lane.
const MAX_IDLE: usize = 256;
/// An idle connection older than this is closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Attempts on reused connections that turned out closed before the request was written.
const STALE_RETRIES: usize = 4;
/// Bodies up to this size are written in the same buffer as the head (one write).
const INLINE_BODY: usize = 256 * 1024;
/// The counter of wire faults (`telemetry::names` describes it).
pub const WIRE_FAULTS_TOTAL: &str = "tollgate_upstream_wire_faults_total";
/// How long an upstream that sent bytes no request asked for gets a fresh connection per
/// request (each closed after its answer) instead of pooled ones.
const DISTRUST: Duration = Duration::from_secs(60);

/// Milliseconds since the process's first use of the pool (0 is never a deadline).
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// The idle connections to one authority, one queue per lane (made on the lane's first use).
pub struct Pool {
    lanes: Box<[OnceLock<ArrayQueue<Idle>>]>,
    /// The `Host` header of every request to it.
    host: HeaderValue,
    /// The authority, for the fault counter's label.
    authority: Box<str>,
    /// Until when (see [`now_ms`]) no connection to it is reused: it sent bytes no request
    /// asked for, so any of its connections may hold an answer that belongs to no one.
    distrusted_until: AtomicU64,
}

impl Pool {
    fn new(authority: &str) -> Self {
        Self {
            lanes: (0..=MAX_WORKERS).map(|_| OnceLock::new()).collect(),
            host: host_header(authority),
            authority: authority.into(),
            distrusted_until: AtomicU64::new(0),
        }
    }

    fn lane(&self, lane: usize) -> &ArrayQueue<Idle> {
        self.lanes[lane.min(MAX_WORKERS)].get_or_init(|| ArrayQueue::new(MAX_IDLE))
    }

    fn distrusted(&self) -> bool {
        let until = self.distrusted_until.load(Ordering::Relaxed);
        until != 0 && now_ms() < until
    }

    /// The upstream sent bytes no request asked for: its idle connections are closed and no
    /// connection to it is reused for [`DISTRUST`].
    fn distrust(&self) {
        self.distrusted_until
            .store(now_ms() + DISTRUST.as_millis() as u64, Ordering::Relaxed);
        for lane in self.lanes.iter().filter_map(OnceLock::get) {
            while lane.pop().is_some() {}
        }
        self.fault("unsolicited");
        tracing::warn!(
            upstream = %self.authority,
            distrust_s = DISTRUST.as_secs(),
            "upstream sent bytes no request asked for: its connections are not reused for a while"
        );
    }

    fn fault(&self, fault: &'static str) {
        metrics::counter!(
            WIRE_FAULTS_TOTAL,
            "upstream" => self.authority.to_string(),
            "fault" => fault
        )
        .increment(1);
    }

    fn put(&self, lane: usize, conn: Conn) {
        if self.distrusted() {
            return;
        }
        // A full queue drops the connection, which closes it.
        let _ = self.lane(lane).push(Idle {
            conn,
            since: Instant::now(),
        });
    }

    /// An idle connection of `lane` that can take a request now, if any.
    fn take(&self, lane: usize) -> Option<Conn> {
        let idle = self.lanes[lane.min(MAX_WORKERS)].get()?;
        while let Some(mut i) = idle.pop() {
            if i.since.elapsed() >= IDLE_TIMEOUT {
                continue;
            }
            match i.conn.idle_state() {
                IdleState::Quiet => return Some(i.conn),
                IdleState::Closed => {}
                IdleState::Unsolicited => {
                    self.distrust();
                    return None;
                }
            }
        }
        None
    }

    /// Idle connections waiting, on every lane (for tests and status).
    pub fn idle(&self) -> usize {
        self.lanes
            .iter()
            .filter_map(OnceLock::get)
            .map(ArrayQueue::len)
            .sum()
    }
}

/// Why a request got no answer head.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be made.
    Connect,
    /// The connection broke before the answer's head, or the head was not HTTP/1.
    Broken,
}

/// The pools, one per authority. Survives reloads.
#[derive(Default)]
pub struct Pools {
    by_authority: DashMap<Box<str>, Arc<Pool>, foldhash::quality::RandomState>,
}

impl Pools {
    /// The pool for an `http://` URI's authority (created on first use).
    pub fn pool(&self, authority: &str) -> Arc<Pool> {
        if let Some(p) = self.by_authority.get(authority) {
            return p.clone();
        }
        self.by_authority
            .entry(authority.into())
            .or_insert_with(|| Arc::new(Pool::new(authority)))
            .clone()
    }

    /// Idle connections to `authority` (for tests and status).
    pub fn idle(&self, authority: &str) -> usize {
        self.by_authority.get(authority).map_or(0, |p| p.idle())
    }

    /// Sends `req` (an absolute `http://` URI) on a pooled connection, or a new one made
    /// within `connect`. The answer's body holds the connection: read to its end, it puts it
    /// back.
    pub async fn send(
        &self,
        req: Request<Bytes>,
        connect: Duration,
    ) -> Result<Response<UpstreamBody>, SendError> {
        self.send_with(req, connect, &[]).await
    }

    /// [`send`](Self::send), with `extra` header lines (each `\r\nname: value`, carriable as
    /// made) written after the request's own fields: fields the sidecar makes per attempt
    /// (the trace context) go out without a header map's insert.
    pub async fn send_with(
        &self,
        req: Request<Bytes>,
        connect: Duration,
        extra: &[u8],
    ) -> Result<Response<UpstreamBody>, SendError> {
        let uri = req.uri();
        let authority = uri.authority().map_or("", |a| a.as_str());
        let pool = self.pool(authority);
        let head_request = req.method() == Method::HEAD;
        let bytes = serialize(&req, &pool.host, extra);
        let body = req.body();
        let lane = super::lane();
        let mut stale = 0;
        loop {
            let pooled = if stale < STALE_RETRIES {
                pool.take(lane)
            } else {
                None
            };
            let (mut conn, reused) = match pooled {
                Some(c) => (c, true),
                None => (dial(authority, connect).await?, false),
            };
            let fresh = !reused;
            let mut written = conn.write(&bytes).await;
            if written.is_ok() && body.len() > INLINE_BODY {
                written = conn.write(body).await;
            }
            if written.is_err() {
                // Closed by the upstream while idle: nothing of it was read. Send again, on
                // another connection.
                if reused {
                    stale += 1;
                    continue;
                }
                return Err(SendError::Broken);
            }
            return match conn.read_head(head_request).await {
                Ok((resp, framing)) => {
                    let body = UpstreamBody {
                        conn: Some(conn),
                        decoder: framing.decoder,
                        // A connection made while the upstream is distrusted is not reused.
                        keep_alive: framing.keep_alive && !(fresh && pool.distrusted()),
                        home: pool,
                        lane,
                    };
                    Ok(resp.map(|()| body))
                }
                // A reused connection the upstream closed as the request crossed its idle
                // timeout: no byte of an answer came, so the request goes once more, on a
                // fresh connection (as hyper and Pingora do). Not the upstream's failure.
                Err(HeadError::Closed) if reused => {
                    pool.fault("closed_idle");
                    stale = STALE_RETRIES;
                    continue;
                }
                Err(_) => Err(SendError::Broken),
            };
        }
    }
}

/// The request's bytes: its line (origin form: the path only), `Host`, its headers, its
/// length, and the body when it is small enough to go in the same write.
fn serialize(req: &Request<Bytes>, host: &HeaderValue, extra: &[u8]) -> Vec<u8> {
    let body = req.body();
    let path = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
    let mut size = req.method().as_str().len() + path.len() + host.len() + extra.len() + 64;
    for (k, v) in req.headers() {
        size += k.as_str().len() + v.len() + 4;
    }
    let inline = body.len() <= INLINE_BODY;
    if inline {
        size += body.len();
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(req.method().as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    for (k, v) in req.headers() {
        if k == http::header::HOST || k == http::header::CONTENT_LENGTH {
            continue;
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(k.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v.as_bytes());
    }
    out.extend_from_slice(extra);
    out.extend_from_slice(b"\r\ncontent-length: ");
    out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
    out.extend_from_slice(b"\r\n\r\n");
    if inline {
        out.extend_from_slice(body);
    }
    out
}

/// A new connection to the authority.
async fn dial(authority: &str, connect: Duration) -> Result<Conn, SendError> {
    let addr = if authority.contains(':') && !authority.ends_with(']') {
        std::borrow::Cow::Borrowed(authority)
    } else {
        std::borrow::Cow::Owned(format!("{authority}:80"))
    };
    Conn::dial(&addr, connect)
        .await
        .map_err(|_| SendError::Connect)
}

/// An upstream answer's body, read from its connection as the reader polls; at its end the
/// connection goes back to its pool (when its framing allows another request on it).
pub struct UpstreamBody {
    conn: Option<Conn>,
    decoder: Decoder,
    keep_alive: bool,
    home: Arc<Pool>,
    lane: usize,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("decoder", &self.decoder)
            .finish_non_exhaustive()
    }
}

impl UpstreamBody {
    /// The whole body, when it has already arrived with the head and is at most `limit`
    /// bytes (a buffered answer's usual case): no polling, no collecting.
    pub fn arrived(&mut self, limit: usize) -> Option<Bytes> {
        let conn = self.conn.as_mut()?;
        let n = usize::try_from(self.decoder.left()?).ok()?;
        if n > limit || conn.buf.len() < n {
            return None;
        }
        let body = conn.buf.split_to(n).freeze();
        self.decoder = Decoder::Done;
        self.end();
        Some(body)
    }

    /// The body ended: its connection back to the pool, or closed. Bytes already read past
    /// the body's end were asked for by no request: the upstream is distrusted.
    fn end(&mut self) {
        if let Some(conn) = self.conn.take() {
            if !conn.buf.is_empty() {
                self.home.distrust();
            } else if self.keep_alive {
                conn.ack_now();
                self.home.put(self.lane, conn);
            }
        }
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = DecodeError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, DecodeError>>> {
        let this = self.get_mut();
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match this.decoder.decode(&mut conn.buf) {
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Ok(Step::Data(b)) => return Poll::Ready(Some(Ok(Frame::data(b)))),
                Ok(Step::Done) => {
                    this.end();
                    return Poll::Ready(None);
                }
                Ok(Step::More) => {}
            }
            match std::task::ready!(conn.poll_fill(cx)) {
                Ok(0) => {
                    let ended = this.decoder.eof();
                    this.conn = None;
                    return Poll::Ready(ended.err().map(Err));
                }
                Ok(_) => {}
                Err(_) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(DecodeError::Incomplete)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none() || self.decoder == Decoder::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder.left() {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

/// The `Host` header for an authority: the port left out when it is HTTP's default.
fn host_header(authority: &str) -> HeaderValue {
    let host = authority.strip_suffix(":80").unwrap_or(authority);
    HeaderValue::from_str(host).unwrap_or_else(|_| HeaderValue::from_static("localhost"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_header_leaves_out_the_default_port() {
        assert_eq!(host_header("ollama:80"), "ollama");
        assert_eq!(host_header("127.0.0.1:11434"), "127.0.0.1:11434");
        assert_eq!(host_header("[::1]:8080"), "[::1]:8080");
        assert_eq!(host_header("up.internal"), "up.internal");
    }

    #[test]
    fn extra_lines_go_after_the_fields_and_before_the_length() {
        let req = Request::post("http://up.internal/v1/chat/completions")
            .header("content-type", "application/json")
            .body(Bytes::from_static(b"{}"))
            .unwrap();
        let host = HeaderValue::from_static("up.internal");
        let out = serialize(&req, &host, b"\r\ntraceparent: 00-ab-cd-01");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/chat/completions HTTP/1.1\r\nhost: up.internal\r\n\
             content-type: application/json\r\ntraceparent: 00-ab-cd-01\r\n\
             content-length: 2\r\n\r\n{}"
        );
        let plain = serialize(&req, &host, &[]);
        assert!(!String::from_utf8(plain).unwrap().contains("traceparent"));
    }
}
