//! Keep-alive connections to cleartext HTTP/1 upstreams (a local Ollama, vLLM, an in-cluster
//! gateway), pooled per authority over hyper's `client::conn` API.
//!
//! hyper-util's pooled client costs ~11,800 instructions per request on the bench request
//! (a SipHash map and a mutex per checkout and per return, and a task spawned per request to
//! put the connection back once its answer is read). Here an idle connection waits in a
//! lock-free queue per authority; a lease taken from it goes back when dropped, straight away
//! when the connection is already idle (a buffered answer read whole) and otherwise through a
//! small task that waits for it to become idle (a stream the client is still reading). TLS
//! upstreams keep hyper-util's client (HTTP/2 by ALPN).
//!
//! The idle queue of an authority has one lane per connection worker
//! ([`super::workers::lane`]): a connection's driver runs on the runtime that dialed it, so
//! it is only reused from there (never driven by one worker for another's requests).

use super::workers::MAX_WORKERS;
use bytes::Bytes;
use crossbeam_queue::ArrayQueue;
use dashmap::DashMap;
use http::{HeaderValue, Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tower_service::Service;

/// Idle connections kept per authority (as hyper-util's `pool_max_idle_per_host` was).
const MAX_IDLE: usize = 256;
/// An idle connection older than this is closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Attempts on reused connections that the upstream closed before the request was written.
const STALE_RETRIES: usize = 4;

type Sender = SendRequest<Full<Bytes>>;

struct Idle {
    tx: Sender,
    since: Instant,
}

/// The idle connections to one authority, one queue per lane (made on the lane's first use).
pub struct Pool {
    lanes: Box<[OnceLock<ArrayQueue<Idle>>]>,
    /// The `Host` header of every request to it.
    host: HeaderValue,
}

/// A connection carrying one request: back to its pool when dropped (once idle).
pub struct Lease {
    tx: Option<Sender>,
    pool: Arc<Pool>,
    /// The lane the connection was dialed on (its driver runs there).
    lane: usize,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Lease")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(mut tx) = self.tx.take() else {
            return;
        };
        if tx.is_closed() {
            return;
        }
        let lane = self.lane;
        if tx.is_ready() {
            self.pool.put(lane, tx);
            return;
        }
        // Still reading its answer: back once that is done (an error means it closed).
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = self.pool.clone();
        rt.spawn(async move {
            if tx.ready().await.is_ok() {
                pool.put(lane, tx);
            }
        });
    }
}

impl Pool {
    fn new(host: HeaderValue) -> Self {
        Self {
            lanes: (0..=MAX_WORKERS).map(|_| OnceLock::new()).collect(),
            host,
        }
    }

    fn lane(&self, lane: usize) -> &ArrayQueue<Idle> {
        self.lanes[lane.min(MAX_WORKERS)].get_or_init(|| ArrayQueue::new(MAX_IDLE))
    }

    fn put(&self, lane: usize, tx: Sender) {
        // A full queue drops the connection, which closes it.
        let _ = self.lane(lane).push(Idle {
            tx,
            since: Instant::now(),
        });
    }

    /// An idle connection of `lane` that can take a request now, if any.
    fn take(&self, lane: usize) -> Option<Sender> {
        let idle = self.lanes[lane.min(MAX_WORKERS)].get()?;
        while let Some(i) = idle.pop() {
            if i.tx.is_ready() && i.since.elapsed() < IDLE_TIMEOUT {
                return Some(i.tx);
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
    /// The connection broke before the answer's head.
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
            .or_insert_with(|| Arc::new(Pool::new(host_header(authority))))
            .clone()
    }

    /// Idle connections to `authority` (for tests and status).
    pub fn idle(&self, authority: &str) -> usize {
        self.by_authority.get(authority).map_or(0, |p| p.idle())
    }

    /// Sends `req` (an absolute `http://` URI) on a pooled connection, or a new one made
    /// within `connect`. The answer's connection comes back as a lease: hold it while the
    /// answer's body is read.
    pub async fn send(
        &self,
        mut req: Request<Full<Bytes>>,
        connect: Duration,
    ) -> Result<(Response<Incoming>, Lease), SendError> {
        let uri = req.uri().clone();
        let authority = uri.authority().map_or("", |a| a.as_str());
        let pool = self.pool(authority);
        // HTTP/1 to an origin server: the request line carries the path only.
        *req.uri_mut() = origin_form(&uri);
        req.headers_mut()
            .insert(http::header::HOST, pool.host.clone());
        let lane = super::workers::lane();
        let mut stale = 0;
        loop {
            let (mut tx, reused) = match pool.take(lane) {
                Some(tx) if stale < STALE_RETRIES => (tx, true),
                _ => (dial(&uri, connect).await?, false),
            };
            match tx.try_send_request(req).await {
                Ok(resp) => {
                    let lease = Lease {
                        tx: Some(tx),
                        pool,
                        lane,
                    };
                    return Ok((resp, lease));
                }
                Err(mut e) => match e.take_message() {
                    // Never written: the upstream had closed the idle connection. Safe to
                    // send again, on another one.
                    Some(r) if reused => {
                        req = r;
                        stale += 1;
                    }
                    _ => return Err(SendError::Broken),
                },
            }
        }
    }
}

/// A new connection to the URI's authority, its driver running as a task of its own.
async fn dial(uri: &Uri, connect: Duration) -> Result<Sender, SendError> {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.set_connect_timeout(Some(connect));
    c.set_keepalive(Some(Duration::from_secs(60)));
    let io: TokioIo<tokio::net::TcpStream> =
        c.call(uri.clone()).await.map_err(|_| SendError::Connect)?;
    let (tx, conn) = http1::Builder::new()
        .handshake(io)
        .await
        .map_err(|_| SendError::Connect)?;
    tokio::spawn(async move {
        // The connection's end (closed by either side, or broken) is seen by its sender.
        let _ = conn.await;
    });
    Ok(tx)
}

/// `/path?query` of an absolute URI.
fn origin_form(uri: &Uri) -> Uri {
    match uri.path_and_query() {
        Some(pq) => Uri::from(pq.clone()),
        None => Uri::from_static("/"),
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
    fn origin_form_keeps_path_and_query() {
        let u: Uri = "http://h:1/v1/chat/completions?x=1".parse().unwrap();
        assert_eq!(origin_form(&u), "/v1/chat/completions?x=1");
        let u: Uri = "http://h:1".parse().unwrap();
        assert_eq!(origin_form(&u), "/");
    }
}
