//! OTLP/HTTP to a cleartext collector (`http://`, the sidecar's usual `localhost:4318`): one
//! kept-alive HTTP/1.1 connection per endpoint, owned by the sender task and driven by it (no
//! connection task, no channel, no pool). Each export is one prepared head (written once per
//! endpoint, only the length added per post) and the body, written together; the answer's
//! head parsed with `httparse`. An `https://` collector and gRPC go through hyper instead
//! ([`super::export`]).
//!
//! Everything read from the collector is bounded: the head (64 KiB, 64 fields, 8 interim
//! answers) and the body (64 KiB; a longer one is not read, and its connection is not kept).
//! A connection is kept only after an answer framed by `Content-Length` that did not ask to
//! close; any other answer, an error or a timeout drops it, and the next export dials anew.

use bytes::Bytes;
use http::Uri;
use std::io;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest answer head read.
const MAX_HEAD: usize = 64 * 1024;
/// Largest answer body read (a collector answers a small protobuf status).
const MAX_BODY: usize = 64 * 1024;
/// Most fields in an answer head.
const MAX_FIELDS: usize = 64;
/// Most interim (1xx) answers before the final one.
const MAX_INTERIM: usize = 8;

/// One endpoint (`http://host:port/path`) and the connection to it, if one is kept.
pub(super) struct Plain {
    authority: String,
    /// The request head up to the length's value: request line, `Host`, `Content-Type`, the
    /// configured headers, then `Content-Length: `.
    head: Vec<u8>,
    conn: Option<TcpStream>,
    /// What was read from the collector (an answer's head and body).
    buf: Vec<u8>,
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
            buf: Vec::new(),
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
    /// once; a new connection's failure is final.
    async fn exchange(&mut self, body: &Bytes) -> Result<u16, String> {
        if let Some(c) = self.conn.take().filter(idle_and_open) {
            let mut answered = false;
            match self.send_on(c, body, &mut answered).await {
                Err(_) if !answered => {}
                r => return r,
            }
        }
        let c = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| format!("connecting to the collector: {}", e.kind()))?;
        let _ = c.set_nodelay(true);
        self.send_on(c, body, &mut false).await
    }

    /// Writes the request on `conn` and reads the answer; keeps `conn` when the answer allows.
    /// `answered`: set once any byte of an answer arrived.
    async fn send_on(
        &mut self,
        mut conn: TcpStream,
        body: &Bytes,
        answered: &mut bool,
    ) -> Result<u16, String> {
        self.buf.clear();
        self.out.clear();
        self.out.extend_from_slice(&self.head);
        self.out
            .extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
        self.out.extend_from_slice(b"\r\n\r\n");
        // Head and body in one write when the body is small; else two (no copy of a batch).
        if body.len() <= 16 * 1024 {
            self.out.extend_from_slice(body);
            conn.write_all(&self.out).await.map_err(broken)?;
        } else {
            conn.write_all(&self.out).await.map_err(broken)?;
            conn.write_all(body).await.map_err(broken)?;
        }
        let (status, keep) = read_answer(&mut conn, &mut self.buf, answered).await?;
        if keep {
            self.conn = Some(conn);
        }
        Ok(status)
    }
}

fn broken(e: io::Error) -> String {
    format!("writing to the collector: {}", e.kind())
}

/// Whether a kept connection can carry the next export: nothing arrived on it since the last
/// answer (neither the collector's close nor bytes it had no business sending).
fn idle_and_open(c: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(c.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// Reads one final answer (interim 1xx answers skipped) and, when it is framed by
/// `Content-Length` within [`MAX_BODY`], its body; its status, and whether the connection can
/// be kept.
async fn read_answer(
    conn: &mut TcpStream,
    buf: &mut Vec<u8>,
    answered: &mut bool,
) -> Result<(u16, bool), String> {
    let mut interim = 0;
    loop {
        // Bytes already known not to end the head: a head that trickles in is parsed again
        // only when a line end arrives, not once per read (a whole head holds one).
        let mut seen = 0;
        let head = loop {
            if buf[seen..].contains(&b'\n') {
                if let Some(head) = parse_head(buf)? {
                    break head;
                }
            }
            seen = buf.len();
            if buf.len() >= MAX_HEAD {
                return Err("the collector's answer head is too large".into());
            }
            fill(conn, buf, MAX_HEAD).await?;
            *answered = true;
        };
        buf.drain(..head.len);
        let status = head.status;
        if (100..200).contains(&status) {
            interim += 1;
            if status == 101 || interim > MAX_INTERIM {
                return Err("the collector's answer is malformed".into());
            }
            continue;
        }
        // 204 and 304 have no body whatever their fields say.
        let body = if matches!(status, 204 | 304) {
            Some(0)
        } else {
            head.body
        };
        let keep = match body {
            Some(n) if n <= MAX_BODY as u64 => {
                let n = n as usize;
                while buf.len() < n {
                    fill(conn, buf, n).await?;
                }
                // Bytes past the body are not the start of anything asked for.
                head.keep && buf.len() == n
            }
            // Chunked, to the close, or too long: the status is enough; not read further.
            _ => false,
        };
        return Ok((status, keep));
    }
}

/// Reads more into `buf`, up to `cap` bytes in all; `Err` at the connection's end. Reads into
/// the buffer's spare room (not zeroed first).
async fn fill(conn: &mut TcpStream, buf: &mut Vec<u8>, cap: usize) -> Result<(), String> {
    let room = cap.saturating_sub(buf.len()).clamp(1, 8 * 1024);
    buf.reserve(room);
    match conn
        .read_buf(&mut bytes::BufMut::limit(&mut *buf, room))
        .await
    {
        Ok(0) | Err(_) => Err("the collector closed the connection before answering".into()),
        Ok(_) => Ok(()),
    }
}

/// What an answer's head says.
struct Head {
    status: u16,
    /// The head's own length in the buffer.
    len: usize,
    /// The body's length, when `Content-Length` frames it (and no `Transfer-Encoding` does).
    body: Option<u64>,
    /// The connection can carry another export after this answer's body.
    keep: bool,
}

/// A complete answer head at the front of `buf`; `None` when more is needed.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, String> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
    let mut r = httparse::Response::new(&mut fields);
    let len = match r.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err("the collector's answer is malformed".into()),
    };
    let status = r.code.ok_or("the collector's answer has no status")?;
    let mut keep = r.version == Some(1);
    let mut length = None;
    let mut chunked = false;
    for f in r.headers.iter() {
        if f.name.eq_ignore_ascii_case("content-length") {
            let n = crate::body::content_length(f.value.trim_ascii())
                .ok_or("the collector's answer has a bad Content-Length")?;
            if length.is_some_and(|m| m != n) {
                return Err("the collector's answer has two lengths".into());
            }
            length = Some(n);
        } else if f.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = true;
        } else if f.name.eq_ignore_ascii_case("connection") {
            let v = f.value.to_ascii_lowercase();
            if v.split(|b| *b == b',').any(|t| t.trim_ascii() == b"close") {
                keep = false;
            }
        }
    }
    if chunked {
        length = None;
    }
    Ok(Some(Head {
        status,
        len,
        body: length,
        keep,
    }))
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
        // Chunked: the status counts, the connection is not kept.
        p.post(&Bytes::from_static(b"a")).await.unwrap();
        // HTTP/1.0 without keep-alive: not kept either.
        p.post(&Bytes::from_static(b"b")).await.unwrap();
        p.post(&Bytes::from_static(b"c")).await.unwrap();
        assert_eq!(conns(&mut rx, 3), [1, 2, 3]);
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
            assert!(e.contains("Content-Length") || e.contains("lengths"), "{e}");
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
