//! Admission of connections, before hyper sees them: a cap on open connections per port
//! (`server.max_connections`, refused with a 503 in the client's error shape) and a deadline
//! for the first byte (`server.header_read_timeout`: hyper's header timer only starts once a
//! request has begun, so a socket that never sends anything would otherwise stay open
//! forever and, under a file-descriptor limit, starve real clients).

use crate::telemetry::names::TOLLGATE_CONNECTIONS_REFUSED_TOTAL;
pub use crate::wire::request::Malformed;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a refused connection may take to receive its 503.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// The body of the refusal past the connection cap (OpenAI's error shape).
const REFUSAL_BODY: &str = concat!(
    r#"{"error":{"message":"too many open connections to this sidecar "#,
    r#"(server.max_connections); retry shortly","type":"server_error","param":null,"#,
    r#""code":"too_many_connections"}}"#
);

/// Open connections of one port.
#[derive(Debug, Default)]
pub struct Gate {
    open: Arc<AtomicUsize>,
}

/// One admitted connection; the count goes down when it drops.
#[derive(Debug)]
pub struct Slot {
    open: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gate {
    /// A slot, or `None` when `max` connections are already open.
    pub fn enter(&self, max: usize) -> Option<Slot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot {
                open: self.open.clone(),
            })
    }

    #[cfg(test)]
    fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// Answers a connection past the cap with a 503 and `Connection: close`, then closes it.
/// Runs in its own task: the accept loop never waits on a client.
pub async fn refuse(mut stream: TcpStream, port: &'static str) {
    metrics::counter!(TOLLGATE_CONNECTIONS_REFUSED_TOTAL, "port" => port, "reason" => "limit")
        .increment(1);
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         connection: close\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n",
        REFUSAL_BODY.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(REFUSAL_BODY.as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the client sent until it closes: closing with unread data would reset
        // the connection and could lose the 503 before the client reads it.
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<(), std::io::Error>(())
    };
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, write).await;
}

/// Waits until the client sends its first byte (true), or closes, or `within` passes
/// (false: the caller drops the connection).
pub async fn first_byte(stream: &TcpStream, within: Duration, port: &'static str) -> bool {
    let mut one = [0u8; 1];
    match tokio::time::timeout(within, stream.peek(&mut one)).await {
        Ok(Ok(n)) => n > 0,
        Ok(Err(_)) => false,
        Err(_) => {
            metrics::counter!(TOLLGATE_CONNECTIONS_REFUSED_TOTAL, "port" => port, "reason" => "idle")
                .increment(1);
            false
        }
    }
}

/// The connection as hyper sees it: reads pass through; writes pass through too, except the
/// bare answers hyper makes itself when it cannot parse a request (400 malformed head,
/// conflicting `Content-Length`, a NUL in a header; 431 headers too large or too many; 414 URI
/// too long). Those come with an empty body and there is no hook to give them one, so they
/// are recognized here by their exact shape (a 4xx status line, then only `connection: close`,
/// `content-length: 0` and `date`, which no answer of the sidecar's own has) and replaced by
/// the same status with an error body in OpenAI's shape. Every other write costs one prefix
/// comparison.
#[derive(Debug)]
pub struct Shaped<S> {
    inner: S,
    /// A replacement being written: its bytes, how many are out, and how many of hyper's
    /// bytes it stands for (reported as written once it is all out).
    replacing: Option<(Vec<u8>, usize, usize)>,
    port: &'static str,
}

impl<S> Shaped<S> {
    pub fn new(inner: S, port: &'static str) -> Self {
        Shaped {
            inner,
            replacing: None,
            port,
        }
    }
}

const HYPER_ERROR_TAIL: &[u8] = b"\r\nconnection: close\r\ncontent-length: 0\r\ndate: ";

/// The answer to write instead of `head`, when `head` is one of hyper's bare parse-error
/// answers.
fn shaped_error(head: &[u8], port: &'static str) -> Option<Vec<u8>> {
    if !head.starts_with(b"HTTP/1.1 4") || !head.ends_with(b"\r\n\r\n") {
        return None;
    }
    let line_end = head.windows(2).position(|w| w == b"\r\n")?;
    let rest = &head[line_end..];
    // `date: <29 characters>\r\n\r\n` ends it.
    if !rest.starts_with(HYPER_ERROR_TAIL) || rest.len() != HYPER_ERROR_TAIL.len() + 29 + 4 {
        return None;
    }
    let kind = match head.get(9..12)? {
        b"400" => Malformed::Head,
        b"431" => Malformed::HeadTooLarge,
        b"414" => Malformed::UriTooLong,
        _ => return None,
    };
    Some(error_answer(kind, port))
}

/// The whole answer (head and OpenAI-shaped error body, `connection: close`) to a head refused
/// for `kind`, counted in `tollgate_connections_refused_total{reason="malformed"}`.
pub fn error_answer(kind: Malformed, port: &'static str) -> Vec<u8> {
    count_refused(port, "malformed");
    let (status, body) = error_body(kind);
    let mut out = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

/// The status line's code and reason, and the OpenAI-shaped error body, of a refused head.
pub fn error_body(kind: Malformed) -> (&'static str, String) {
    let (status, message, code) = match kind {
        Malformed::Head => (
            "400 Bad Request",
            "the request could not be parsed: a malformed request line or header (a NUL or \
             control byte, an invalid name), or conflicting Content-Length headers",
            "malformed_request",
        ),
        Malformed::BareLf => (
            "400 Bad Request",
            "the request head ends a line with a bare LF; HTTP/1.1 lines end with CRLF",
            "malformed_request",
        ),
        Malformed::Host => (
            "400 Bad Request",
            "an HTTP/1.1 request must carry exactly one Host header",
            "malformed_request",
        ),
        Malformed::HeadTooLarge => (
            "431 Request Header Fields Too Large",
            "the request's headers are too large or too many (at most 100 headers and 64 KiB \
             of request head)",
            "headers_too_large",
        ),
        Malformed::UriTooLong => (
            "414 URI Too Long",
            "the request URI is too long",
            "uri_too_long",
        ),
    };
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error",
        "param": null, "code": code}})
    .to_string();
    (status, body)
}

/// Counts a connection closed or refused before a request was served.
pub fn count_refused(port: &'static str, reason: &'static str) {
    metrics::counter!(TOLLGATE_CONNECTIONS_REFUSED_TOTAL, "port" => port, "reason" => reason)
        .increment(1);
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Shaped<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> Shaped<S> {
    /// Writes out the replacement; ready with the count of hyper's bytes it stands for.
    fn drain(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        let Some((bytes, out, stands_for)) = self.replacing.as_mut() else {
            return Poll::Ready(Ok(0));
        };
        while *out < bytes.len() {
            match std::pin::Pin::new(&mut self.inner).poll_write(cx, &bytes[*out..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => *out += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        let n = *stands_for;
        self.replacing = None;
        Poll::Ready(Ok(n))
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Shaped<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.replacing.is_none() && buf.starts_with(b"HTTP/1.1 4") {
            if let Some(r) = shaped_error(buf, self.port) {
                self.replacing = Some((r, 0, buf.len()));
            }
        }
        if self.replacing.is_some() {
            return self.drain(cx);
        }
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        // hyper's own error answer is a head alone: one non-empty slice.
        let mut nonempty = bufs.iter().filter(|b| !b.is_empty());
        if let (Some(first), None) = (nonempty.next(), nonempty.next()) {
            if self.replacing.is_some() || first.starts_with(b"HTTP/1.1 4") {
                return self.poll_write(cx, first);
            }
        }
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.replacing.is_some() {
            std::task::ready!(self.drain(cx))?;
        }
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.replacing.is_some() {
            std::task::ready!(self.drain(cx))?;
        }
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_counts_and_refuses_past_max() {
        let g = Gate::default();
        let a = g.enter(2).unwrap();
        let _b = g.enter(2).unwrap();
        assert!(g.enter(2).is_none());
        drop(a);
        assert_eq!(g.open(), 1);
        assert!(g.enter(2).is_some());
    }

    #[test]
    fn the_refusal_body_is_openai_shaped_json() {
        let v: serde_json::Value = serde_json::from_str(REFUSAL_BODY).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
        assert_eq!(v["error"]["type"], "server_error");
    }

    #[test]
    fn hyper_bare_parse_errors_get_a_body_and_nothing_else_is_touched() {
        let date = "Tue, 01 Dec 2026 18:49:32 GMT";
        for (status, code) in [
            ("400 Bad Request", "malformed_request"),
            ("431 Request Header Fields Too Large", "headers_too_large"),
            ("414 URI Too Long", "uri_too_long"),
        ] {
            let head = format!(
                "HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: 0\r\ndate: {date}\r\n\r\n"
            );
            let out = String::from_utf8(shaped_error(head.as_bytes(), "data").unwrap()).unwrap();
            let (h, body) = out.split_once("\r\n\r\n").unwrap();
            assert!(h.starts_with(&format!("HTTP/1.1 {status}\r\n")), "{h}");
            assert!(h.contains("content-type: application/json"), "{h}");
            assert!(
                h.contains(&format!("content-length: {}", body.len())),
                "{h}"
            );
            let v: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(v["error"]["code"], code);
        }
        // The sidecar's own answers (a header more, a body, a 2xx) pass untouched.
        for head in [
            format!("HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: 0\r\ndate: {date}\r\n\r\n"),
            format!("HTTP/1.1 404 Not Found\r\nconnection: close\r\ncontent-length: 0\r\ndate: {date}\r\n\r\n"),
            format!("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\ndate: {date}\r\n\r\n"),
            format!("HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: {date}\r\n\r\n{{}}"),
        ] {
            assert!(shaped_error(head.as_bytes(), "data").is_none(), "{head}");
        }
    }
}
