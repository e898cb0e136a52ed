//! OTLP/HTTP to a cleartext collector (`http://`, the sidecar's usual `localhost:4318`): one
//! kept-alive HTTP/1.1 connection per endpoint, owned by the sender task and spoken to through
//! the same client connection as the upstream calls ([`crate::wire::h1::Conn`]: its answer-head
//! parser, body decoder, idle check and bounds). Each export is one prepared head (written
//! once per endpoint, only the length added per post) and the body, written together. An
//! `https://` collector and gRPC go through hyper instead ([`super::export`]).
//!
//! A connection is kept only after a whole answer of at most 64 KiB that did not ask to
//! close; any other answer, an error or a timeout drops it, and the next export dials anew.

use crate::wire::h1::{Conn, HeadError, IdleState};
use bytes::Bytes;
use http::Uri;
use std::time::Duration;

/// Largest answer body read (a collector answers a small protobuf status).
const MAX_BODY: usize = 64 * 1024;

/// One endpoint (`http://host:port/path`) and the connection to it, if one is kept.
pub(super) struct Plain {
    authority: String,
    /// The request head up to the length's value: request line, `Host`, `Content-Type`, the
    /// configured headers, then `Content-Length: `.
    head: Vec<u8>,
    conn: Option<Conn>,
    /// The request's head and body as written (reused).
    out: Vec<u8>,
    timeout: Duration,
}

impl std::fmt::Debug for Plain {
    // Not the head: it carries the configured headers, which may hold a key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plain")
            .field("authority", &self.authority)
            .finish_non_exhaustive()
    }
}

impl Plain {
    /// `None` unless `url` is `http://` with a host (the scheme this client speaks).
    pub(super) fn new(
        url: &Uri,
        headers: &[(http::HeaderName, http::HeaderValue)],
        timeout: Duration,
    ) -> Option<Plain> {
        if url.scheme_str() != Some("http") {
            return None;
        }
        let host = url.host()?;
        let port = url.port_u16().unwrap_or(80);
        // An IPv6 literal keeps its brackets in both the address dialled and `Host`.
        let authority = format!("{host}:{port}");
        let path = url.path_and_query().map_or("/", |p| p.as_str());
        let mut head = Vec::with_capacity(256);
        head.extend_from_slice(b"POST ");
        head.extend_from_slice(path.as_bytes());
        head.extend_from_slice(b" HTTP/1.1\r\nHost: ");
        // Host and port only: credentials written into the URL (`user:pass@`) stay out.
        head.extend_from_slice(host.as_bytes());
        if let Some(p) = url.port() {
            head.extend_from_slice(b":");
            head.extend_from_slice(p.as_str().as_bytes());
        }
        head.extend_from_slice(b"\r\nContent-Type: application/x-protobuf\r\n");
        for (k, v) in headers {
            // `HeaderValue` holds no CR or LF: a value cannot end its line early.
            head.extend_from_slice(k.as_str().as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(v.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"Content-Length: ");
        Some(Plain {
            authority,
            head,
            conn: None,
            out: Vec::new(),
            timeout,
        })
    }

    /// Posts one export; `Err` with a short reason unless the collector answered 2xx within
    /// the timeout. The connection is kept for the next export only after a whole answer that
    /// allows it.
    pub(super) async fn post(&mut self, body: &Bytes) -> Result<(), String> {
        let timeout = self.timeout;
        match tokio::time::timeout(timeout, self.exchange(body)).await {
            Ok(Ok(status)) if (200..300).contains(&status) => Ok(()),
            Ok(Ok(status)) => Err(format!("collector answered {status}")),
            Ok(Err(e)) => {
                self.conn = None;
                Err(e)
            }
            Err(_) => {
                self.conn = None;
                Err("OTLP export timed out".into())
            }
        }
    }

    /// Sends the export on the kept connection, else on a new one; the answer's status. A
    /// kept connection the collector closed as the export went out (no byte of an answer
    /// came: its idle timeout met the export) gets the export again on a new connection,
    /// once, as an upstream call's does; a new connection's failure is final.
    async fn exchange(&mut self, body: &Bytes) -> Result<u16, String> {
        if let Some(mut c) = self.conn.take() {
            if c.idle_state() == IdleState::Quiet {
                match self.send_on(c, body).await {
                    Err(HeadError::Closed) => {}
                    r => return r.map_err(said),
                }
            }
        }
        let c = Conn::dial(&self.authority, self.timeout)
            .await
            .map_err(|e| format!("connecting to the collector: {}", e.kind()))?;
        self.send_on(c, body).await.map_err(said)
    }

    /// Writes the request on `conn` and reads the answer; keeps `conn` when the answer allows.
    async fn send_on(&mut self, mut conn: Conn, body: &Bytes) -> Result<u16, HeadError> {
        self.out.clear();
        self.out.extend_from_slice(&self.head);
        self.out
            .extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
        self.out.extend_from_slice(b"\r\n\r\n");
        // Head and body in one write when the body is small; else two (no copy of a batch).
        let written = if body.len() <= 16 * 1024 {
            self.out.extend_from_slice(body);
            conn.write(&self.out).await
        } else {
            match conn.write(&self.out).await {
                Ok(()) => conn.write(body).await,
                e => e,
            }
        };
        // A write the collector's close cut: nothing of an answer came.
        written.map_err(|_| HeadError::Closed)?;
        let (answer, framing) = conn.read_head(false).await?;
        if conn.skip_body(framing, MAX_BODY).await {
            conn.ack_now();
            self.conn = Some(conn);
        }
        Ok(answer.status().as_u16())
    }
}

/// What went wrong, said for the export's error counter and log.
fn said(e: HeadError) -> String {
    match e {
        HeadError::Closed | HeadError::Broken => {
            "the collector closed the connection before answering".into()
        }
        HeadError::Malformed => "the collector's answer is malformed (or too large)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::Plain;
    use bytes::Bytes;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// Reads one request (head and `Content-Length` body) off `s`; its head as text and body.
    async fn request(s: &mut TcpStream) -> Option<(String, Vec<u8>)> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8(buf[..end].to_vec()).unwrap();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Content-Length: "))
                    .unwrap()
                    .parse()
                    .unwrap();
                let mut body = buf[end + 4..].to_vec();
                while body.len() < len {
                    let n = s.read(&mut chunk).await.unwrap();
                    assert!(n > 0);
                    body.extend_from_slice(&chunk[..n]);
                }
                return Some((head, body));
            }
            let n = s.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// What the test collector received: each request's connection number, head and body.
    type Rx = tokio::sync::mpsc::UnboundedReceiver<(usize, String, Vec<u8>)>;

    /// A collector that answers the requests it gets, on whichever connection, with
    /// `answers` in turn (a connection with none left is closed); what it was sent, with the
    /// number of the connection it came on.
    async fn collector(answers: Vec<&'static [u8]>) -> (String, Rx) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/traces", l.local_addr().unwrap());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let answers = std::sync::Arc::new(std::sync::Mutex::new(answers.into_iter()));
        tokio::spawn(async move {
            let mut conn_no = 0;
            while let Ok((mut s, _)) = l.accept().await {
                conn_no += 1;
                let (answers, tx) = (answers.clone(), tx.clone());
                tokio::spawn(async move {
                    while let Some((head, body)) = request(&mut s).await {
                        let _ = tx.send((conn_no, head, body));
                        // None left, or an empty answer: the connection is closed unanswered.
                        let Some(a) = answers.lock().unwrap().next().filter(|a| !a.is_empty())
                        else {
                            return;
                        };
                        // (A client that stops reading a hostile answer closes: not an error.)
                        // An answer ending in `<close>` is written without it, then closed.
                        if let Some(a) = a.strip_suffix(b"<close>") {
                            let _ = s.write_all(a).await;
                            return;
                        }
                        let _ = s.write_all(a).await;
                    }
                });
            }
        });
        (url, rx)
    }

    /// The connection numbers of the next `n` requests the collector has already received.
    fn conns(rx: &mut Rx, n: usize) -> Vec<usize> {
        (0..n).map(|_| rx.try_recv().unwrap().0).collect()
    }

    fn plain(url: &str, timeout_ms: u64) -> Plain {
        let headers = vec![(
            http::HeaderName::from_static("api-key"),
            http::HeaderValue::from_static("k-123"),
        )];
        Plain::new(
            &url.parse().unwrap(),
            &headers,
            Duration::from_millis(timeout_ms),
        )
        .unwrap()
    }

    const OK: &[u8] =
        b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";

    #[tokio::test]
    async fn posts_the_body_with_its_headers_and_keeps_the_connection() {
        let (url, mut rx) = collector(vec![OK, OK, OK]).await;
        let mut p = plain(&url, 2000);
        let big = Bytes::from(vec![7u8; 40_000]);
        for body in [Bytes::from_static(b"abc"), big.clone(), Bytes::new()] {
            p.post(&body).await.unwrap();
            let (conn, head, got) = rx.recv().await.unwrap();
            assert_eq!(conn, 1, "one connection for all three");
            assert!(head.starts_with("POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1:"));
            assert!(head.contains("\r\nContent-Type: application/x-protobuf\r\n"));
            assert!(head.contains("\r\napi-key: k-123\r\n"));
            assert_eq!(got, body);
        }
        assert!(!format!("{p:?}").contains("k-123"), "no key in Debug");
    }

    #[tokio::test]
    async fn an_error_status_fails_the_export_and_a_closing_answer_drops_the_connection() {
        let (url, mut rx) = collector(vec![
            b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy",
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            OK,
        ])
        .await;
        let mut p = plain(&url, 2000);
        let e = p.post(&Bytes::from_static(b"x")).await.unwrap_err();
        assert_eq!(e, "collector answered 503");
        p.post(&Bytes::from_static(b"x")).await.unwrap();
        p.post(&Bytes::from_static(b"x")).await.unwrap();
        // The 503 had a whole body: kept. The answer that asked to close: a new connection.
        assert_eq!(conns(&mut rx, 3), [1, 1, 2]);
    }

    #[tokio::test]
    async fn interim_chunked_and_closed_connections_are_handled() {
        let (url, mut rx) = collector(vec![
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
            OK,
        ])
        .await;
        let mut p = plain(&url, 2000);
        // Chunked: read to its end (a small body), the connection kept.
        p.post(&Bytes::from_static(b"a")).await.unwrap();
        // HTTP/1.0 without keep-alive: not kept.
        p.post(&Bytes::from_static(b"b")).await.unwrap();
        p.post(&Bytes::from_static(b"c")).await.unwrap();
        assert_eq!(conns(&mut rx, 3), [1, 1, 2]);
    }

    #[tokio::test]
    async fn a_kept_connection_closed_unanswered_gets_the_export_again_once() {
        let (url, mut rx) = collector(vec![OK, b"", OK, b"", b""]).await;
        let mut p = plain(&url, 2000);
        p.post(&Bytes::from_static(b"1")).await.unwrap();
        // The collector reads the second export on the kept connection and closes it.
        p.post(&Bytes::from_static(b"2")).await.unwrap();
        let got: Vec<(usize, Vec<u8>)> = [(); 3]
            .iter()
            .map(|_| rx.try_recv().map(|(c, _, b)| (c, b)).unwrap())
            .collect();
        assert_eq!(
            got,
            [(1, b"1".to_vec()), (1, b"2".to_vec()), (2, b"2".to_vec())]
        );
        // Kept again, closed again: sent again on a new connection, which closes too: failed,
        // and not sent a third time.
        let e = p.post(&Bytes::from_static(b"3")).await.unwrap_err();
        assert!(e.contains("closed"), "{e}");
        assert_eq!(conns(&mut rx, 2), [2, 3]);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_kept_connection_closed_after_part_of_an_answer_is_not_tried_again() {
        let (url, mut rx) = collector(vec![OK, b"HTTP/1.1 100 Continue\r\n\r\n<close>", OK]).await;
        let mut p = plain(&url, 2000);
        p.post(&Bytes::from_static(b"1")).await.unwrap();
        // Something of an answer came: the collector may have taken the export.
        let e = p.post(&Bytes::from_static(b"2")).await.unwrap_err();
        assert!(e.contains("closed"), "{e}");
        assert_eq!(conns(&mut rx, 2), [1, 1]);
        assert!(rx.try_recv().is_err(), "not sent again");
    }

    #[tokio::test]
    async fn a_hostile_collector_is_bounded() {
        // A head that never ends; a body longer than read; garbage; silence.
        let endless: &'static [u8] = Box::leak(
            [
                b"HTTP/1.1 200 OK\r\n".as_slice(),
                &b"X-A: b\r\n".repeat(20_000),
            ]
            .concat()
            .into_boxed_slice(),
        );
        let (url, _rx) = collector(vec![endless]).await;
        let e = plain(&url, 2000).post(&Bytes::new()).await.unwrap_err();
        assert!(e.contains("too large") || e.contains("malformed"), "{e}");

        let (url, mut rx) = collector(vec![
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n",
            OK,
        ])
        .await;
        let mut p = plain(&url, 2000);
        p.post(&Bytes::new()).await.unwrap();
        p.post(&Bytes::new()).await.unwrap();
        assert_eq!(rx.recv().await.unwrap().0, 1);
        assert_eq!(rx.recv().await.unwrap().0, 2, "an unread body: not kept");

        let (url, _rx) = collector(vec![b"SSH-2.0-OpenSSH\r\n\r\n"]).await;
        let e = plain(&url, 2000).post(&Bytes::new()).await.unwrap_err();
        assert!(e.contains("malformed"), "{e}");

        // Accepts, reads, never answers.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/traces", l.local_addr().unwrap());
        let held = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let _ = request(&mut s).await;
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let t = std::time::Instant::now();
        let e = plain(&url, 200).post(&Bytes::new()).await.unwrap_err();
        assert_eq!(e, "OTLP export timed out");
        assert!(t.elapsed() < Duration::from_secs(2));
        held.abort();
    }

    #[tokio::test]
    async fn nothing_listening_is_an_error_not_a_hang() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/metrics", l.local_addr().unwrap());
        drop(l);
        let e = plain(&url, 2000).post(&Bytes::new()).await.unwrap_err();
        assert!(e.starts_with("connecting to the collector"), "{e}");
    }

    #[tokio::test]
    async fn a_bad_length_fails_the_export() {
        for bad in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\nx"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
        ] {
            let (url, _rx) = collector(vec![Box::leak(bad.to_vec().into_boxed_slice())]).await;
            let e = plain(&url, 2000).post(&Bytes::new()).await.unwrap_err();
            assert!(e.contains("malformed"), "{e}");
        }
    }

    #[test]
    fn the_host_field_carries_no_credentials() {
        let p = Plain::new(
            &"http://user:secret@collector:4318/v1/traces"
                .parse()
                .unwrap(),
            &[],
            Duration::from_secs(1),
        )
        .unwrap();
        let head = String::from_utf8(p.head.clone()).unwrap();
        assert!(head.starts_with("POST /v1/traces HTTP/1.1\r\nHost: collector:4318\r\n"));
        assert!(!head.contains("secret"));
        assert_eq!(p.authority, "collector:4318");
    }

    #[test]
    fn only_cleartext_http_is_taken() {
        let none = |u: &str| Plain::new(&u.parse().unwrap(), &[], Duration::from_secs(1)).is_none();
        assert!(none("https://collector:4318/v1/traces"));
        assert!(!none("http://collector/v1/traces"));
        let p = Plain::new(
            &"http://[::1]:4318/v1/traces".parse().unwrap(),
            &[],
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!(p.authority, "[::1]:4318");
    }
}
