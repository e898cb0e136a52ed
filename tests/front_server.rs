//! The sidecar's own HTTP/1.1 server on the client's connection (and its hand-over to hyper
//! for everything else), seen from raw sockets: pipelined requests answered in order,
//! `Connection: close` honoured, bodies that come in pieces, answers framed by length or in
//! chunks, and the unusual requests (pieces of a head, `Expect`, chunked bodies, HTTP/1.0)
//! still answered on the same connection by hyper.

mod common;

use bytes::{Buf, BytesMut};
use common::mock::{Answer, MockUpstream};
use common::sidecar::Sidecar;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn policy(mock: &MockUpstream) -> String {
    format!(
        "version: front-1\nbackends:\n  - {{id: a, kind: openai, base_url: \"{}\"}}\nroutes:\n  - {{model: chat, chain: [{{backend: a, model: m}}]}}\n",
        mock.base_url()
    )
}

fn body(stream: bool) -> String {
    json!({"model": "chat", "stream": stream, "max_tokens": 20,
           "messages": [{"role": "user", "content": "hi"}]})
    .to_string()
}

fn request(extra: &str, body: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One answer read off `s`: status, lower-cased head, body (de-chunked).
struct Answered {
    status: u16,
    head: String,
    body: String,
}

impl Answered {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// Reads one answer from `s` (bytes past it stay in `buf`), within 10 s.
async fn answer(s: &mut TcpStream, buf: &mut BytesMut) -> Answered {
    tokio::time::timeout(Duration::from_secs(10), read_answer(s, buf))
        .await
        .expect("an answer within 10 s")
}

async fn fill(s: &mut TcpStream, buf: &mut BytesMut) {
    let n = s.read_buf(buf).await.expect("read");
    assert!(
        n > 0,
        "closed early; have {:?}",
        String::from_utf8_lossy(buf)
    );
}

async fn read_answer(s: &mut TcpStream, buf: &mut BytesMut) -> Answered {
    let (status, head_len, head) = loop {
        let mut fields = [httparse::EMPTY_HEADER; 64];
        let mut r = httparse::Response::new(&mut fields);
        if let httparse::Status::Complete(n) = r.parse(buf).expect("an HTTP answer") {
            let head = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
            break (r.code.expect("status"), n, head);
        }
        fill(s, buf).await;
    };
    buf.advance(head_len);
    let mut body = Vec::new();
    if let Some(v) = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
    {
        let n: usize = v.trim().parse().expect("length");
        while buf.len() < n {
            fill(s, buf).await;
        }
        body.extend_from_slice(&buf.split_to(n));
    } else if head.contains("transfer-encoding: chunked") {
        loop {
            let line_end = loop {
                if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                    break i;
                }
                fill(s, buf).await;
            };
            let size = std::str::from_utf8(&buf[..line_end]).expect("size line");
            let n = usize::from_str_radix(size.trim(), 16).expect("hex size");
            while buf.len() < line_end + 2 + n + 2 {
                fill(s, buf).await;
            }
            buf.advance(line_end + 2);
            body.extend_from_slice(&buf.split_to(n));
            assert_eq!(&buf[..2], b"\r\n", "a chunk ends its line");
            buf.advance(2);
            if n == 0 {
                break;
            }
        }
    } else if status != 100 {
        panic!("an answer without framing: {head}");
    }
    Answered {
        status,
        head,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

async fn start() -> (MockUpstream, Sidecar) {
    let mock = MockUpstream::start_with_default(vec![], Answer::ok_chat("fine", 5, 6)).await;
    let sc = Sidecar::start(&policy(&mock)).await;
    (mock, sc)
}

/// A connection to `sc` that has had one plain request answered (served by the own server).
async fn after_one_answer(sc: &Sidecar) -> (TcpStream, BytesMut) {
    let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
    let mut buf = BytesMut::new();
    s.write_all(request("", &body(false)).as_bytes())
        .await
        .unwrap();
    assert_eq!(answer(&mut s, &mut buf).await.status, 200);
    (s, buf)
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_with_their_own_records() {
    // Pipelined requests are served one after the other: the script's answers come in order.
    let sse = || Answer::sse_chat(&["fi", "ne"], Some((5, 6)), Duration::from_millis(5));
    let ok = || Answer::ok_chat("fine", 5, 6);
    let mock = MockUpstream::start(vec![ok(), sse(), ok(), ok(), sse(), ok()]).await;
    // Served on the shared runtime, then on a connection worker.
    for workers in [0, 1] {
        let sc = Sidecar::start_workers(&policy(&mock), workers).await;
        let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
        let three = [
            request("", &body(false)),
            request("", &body(true)),
            request("", &body(false)),
        ]
        .concat();
        s.write_all(three.as_bytes()).await.unwrap();
        let mut buf = BytesMut::new();
        let mut ids = Vec::new();
        for i in 0..3 {
            let a = answer(&mut s, &mut buf).await;
            assert_eq!(a.status, 200, "{}", a.body);
            assert!(a.head.contains("date: "), "{}", a.head);
            assert!(!a.head.contains("connection: close"), "{}", a.head);
            if i == 1 {
                assert!(a.head.contains("transfer-encoding: chunked"), "{}", a.head);
                assert!(a.body.contains("data: [DONE]"), "{}", a.body);
            } else {
                assert!(a.head.contains("content-length: "), "{}", a.head);
                assert_eq!(a.json()["choices"][0]["message"]["content"], "fine");
            }
            let id = a
                .head
                .lines()
                .find_map(|l| l.strip_prefix("x-tollgate-request-id: ").map(str::to_owned));
            ids.push(id.expect("a request id"));
        }
        ids.dedup();
        assert_eq!(ids.len(), 3, "three requests, three ids");
        sc.stop().await;
    }
}

#[tokio::test]
async fn connection_close_is_honoured() {
    let (_mock, sc) = start().await;
    let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
    s.write_all(request("Connection: close\r\n", &body(false)).as_bytes())
        .await
        .unwrap();
    let mut buf = BytesMut::new();
    let a = answer(&mut s, &mut buf).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.head.contains("connection: close"), "{}", a.head);
    let n = tokio::time::timeout(Duration::from_secs(5), s.read_buf(&mut buf))
        .await
        .expect("closed")
        .unwrap_or(0);
    assert_eq!(n, 0, "nothing after the answer but the close");
    sc.stop().await;
}

#[tokio::test]
async fn a_body_that_comes_in_pieces_is_waited_for() {
    let (_mock, sc) = start().await;
    let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
    let req = request("", &body(false));
    let cut = req.len() - 10;
    let mut buf = BytesMut::new();
    for _ in 0..2 {
        s.write_all(&req.as_bytes()[..cut]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.write_all(&req.as_bytes()[cut..]).await.unwrap();
        let a = answer(&mut s, &mut buf).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    sc.stop().await;
}

#[tokio::test]
async fn unusual_requests_are_still_answered_on_the_same_connection() {
    let (mock, sc) = start().await;
    // A plain one first (served here), then a head in two pieces (hyper from there on).
    let (mut s, mut buf) = after_one_answer(&sc).await;
    let req = request("", &body(false));
    s.write_all(&req.as_bytes()[..20]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(&req.as_bytes()[20..]).await.unwrap();
    let a = answer(&mut s, &mut buf).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // hyper writes the sidecar's own fields too (put into its map from the answer's lines).
    for field in [
        "x-tollgate-action: allow",
        "x-tollgate-request-id: ",
        "x-tollgate-policy-version: front-1",
    ] {
        assert_eq!(a.head.matches(field).count(), 1, "{field} in {}", a.head);
    }
    // Expect: 100-continue, answered 100 then the answer.
    let b = body(false);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        b.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    assert_eq!(answer(&mut s, &mut buf).await.status, 100);
    s.write_all(b.as_bytes()).await.unwrap();
    assert_eq!(answer(&mut s, &mut buf).await.status, 200);
    // A chunked request body.
    let chunked = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
        b.len()
    );
    s.write_all(chunked.as_bytes()).await.unwrap();
    let a = answer(&mut s, &mut buf).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(mock.hits(), 4);
    // HTTP/1.0 on a connection of its own: answered, then closed.
    let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
    let old = request("", &b).replacen("HTTP/1.1", "HTTP/1.0", 1);
    s.write_all(old.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("closed")
        .unwrap();
    let out = String::from_utf8_lossy(&out);
    assert!(
        out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200"),
        "{out}"
    );
    assert!(out.contains("\"fine\""), "{out}");
    sc.stop().await;
}

#[tokio::test]
async fn a_malformed_request_after_a_good_one_gets_the_shaped_400() {
    let (_mock, sc) = start().await;
    let (mut s, mut buf) = after_one_answer(&sc).await;
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nBad Name: x\r\n\r\n")
        .await
        .unwrap();
    let a = answer(&mut s, &mut buf).await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert_eq!(a.json()["error"]["code"], "malformed_request", "{}", a.body);
    sc.stop().await;
}

#[tokio::test]
async fn an_idle_connection_is_closed_at_shutdown_and_a_busy_one_after_its_answer() {
    let mock = MockUpstream::start_with_default(
        vec![],
        Answer::ok_chat("late", 5, 6).delay(Duration::from_millis(500)),
    )
    .await;
    let sc = Sidecar::start(&policy(&mock)).await;
    let mut buf = BytesMut::new();
    // Idle: one answer taken, then nothing sent.
    let mut idle = TcpStream::connect(sc.running.addr).await.unwrap();
    idle.write_all(request("", &body(false)).as_bytes())
        .await
        .unwrap();
    assert_eq!(answer(&mut idle, &mut buf).await.status, 200);
    // Busy at the stop.
    let mut busy = TcpStream::connect(sc.running.addr).await.unwrap();
    busy.write_all(request("", &body(false)).as_bytes())
        .await
        .unwrap();
    assert_eq!(mock.wait_for_hits(2, Duration::from_secs(5)).await, 2);
    let stopping = tokio::spawn(sc.stop());
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), idle.read_to_end(&mut rest))
        .await
        .expect("the idle connection closed")
        .unwrap_or(0);
    assert_eq!(n, 0, "{:?}", String::from_utf8_lossy(&rest));
    let mut buf = BytesMut::new();
    let a = answer(&mut busy, &mut buf).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.head.contains("connection: close"), "{}", a.head);
    stopping.await.unwrap();
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_the_header_timeout() {
    let mock = MockUpstream::start_with_default(vec![], Answer::ok_chat("fine", 5, 6)).await;
    let yaml = policy(&mock).replacen(
        "backends:",
        "server: {header_read_timeout: 400ms}\nbackends:",
        1,
    );
    let sc = Sidecar::start(&yaml).await;
    let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
    let mut buf = BytesMut::new();
    // Busy connections are not cut: three answers, each well inside the timeout of the last.
    for _ in 0..3 {
        s.write_all(request("", &body(false)).as_bytes())
            .await
            .unwrap();
        assert_eq!(answer(&mut s, &mut buf).await.status, 200);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let idle_from = std::time::Instant::now();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read_buf(&mut buf))
        .await
        .expect("closed within 5 s")
        .unwrap_or(0);
    assert_eq!(n, 0, "{:?}", String::from_utf8_lossy(&buf));
    // 400 ms from the last answer, of which 250 ms had passed.
    assert!(
        idle_from.elapsed() >= Duration::from_millis(100),
        "closed after {:?}",
        idle_from.elapsed()
    );
    sc.stop().await;
}
