//! Server and operations hardening (issue 11 items 9-11, admin half of 11.1): silent
//! connections, the connection cap, the shutdown grace, the circuit hold cap and reset, a
//! case-insensitive admin bearer, `Expect: 100-continue` past the limit, compressed bodies.

mod common;
mod ops_support;

use bytes::Bytes;
use common::mock::{Answer, MockUpstream};
use common::sidecar::Sidecar;
use common::{post_json, try_post_raw, try_send_with};
use http::Method;
use ops_support::{scrape, status};
use serde_json::{json as j, Value};
use std::io::Write as _;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate::governor::CircuitState;

fn chat() -> Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20})
}

fn policy(upstream: &MockUpstream, server: &str, circuit: &str) -> String {
    format!(
        "version: h-1\nserver: {{{server}}}\nbackends:\n  - {{id: primary, kind: openai, base_url: \"{}\", circuit: {{{circuit}}}}}\nroutes:\n  - model: chat\n    chain: [{{backend: primary, model: m}}]\n",
        upstream.base_url()
    )
}

/// Everything the peer sends until it closes (bounded in time).
async fn read_to_close(s: &mut TcpStream, within: Duration) -> Result<String, String> {
    let mut out = Vec::new();
    match tokio::time::timeout(within, s.read_to_end(&mut out)).await {
        Ok(Ok(_)) => Ok(String::from_utf8_lossy(&out).into_owned()),
        // A reset is a close too.
        Ok(Err(_)) => Ok(String::from_utf8_lossy(&out).into_owned()),
        Err(_) => Err(format!("still open after {within:?}")),
    }
}

#[tokio::test]
async fn a_silent_connection_is_closed_at_header_read_timeout() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&policy(&up, "header_read_timeout: 300ms", "")).await;
    let t0 = Instant::now();
    let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
    let got = read_to_close(&mut s, Duration::from_secs(5)).await;
    assert!(got.is_ok(), "a connection that never sent a byte: {got:?}");
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t0.elapsed()
    );
    // The admin port too.
    let mut a = TcpStream::connect(sc.running.admin_addr).await.unwrap();
    assert!(read_to_close(&mut a, Duration::from_secs(5)).await.is_ok());
    // Real requests still work.
    let (code, _, _) = post_json(&sc.chat_url(), &chat(), &[]).await;
    assert_eq!(code, 200);
    sc.stop().await;
}

#[tokio::test]
async fn past_max_connections_new_ones_get_a_503_and_are_closed() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&policy(
        &up,
        "max_connections: 2, header_read_timeout: 10s",
        "",
    ))
    .await;
    let a = TcpStream::connect(sc.running.addr).await.unwrap();
    let _b = TcpStream::connect(sc.running.addr).await.unwrap();
    let mut c = TcpStream::connect(sc.running.addr).await.unwrap();
    let got = read_to_close(&mut c, Duration::from_secs(5)).await.unwrap();
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(
        got.to_ascii_lowercase().contains("connection: close"),
        "{got}"
    );
    let body: Value = serde_json::from_str(got.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "too_many_connections");
    // A slot freed is a slot for a real request.
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok((200, _, _)) = common::try_post_json(&sc.chat_url(), &chat(), &[]).await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no request got through after a slot freed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = scrape(sc.running.admin_addr).await;
    let refused = m.get(
        "tollgate_connections_refused_total",
        &[("port", "data"), ("reason", "limit")],
    );
    assert!(refused >= 1.0, "refusals counted: {refused}");
    sc.stop().await;
}

#[tokio::test]
async fn shutdown_waits_only_for_the_policys_grace() {
    let up = MockUpstream::start(vec![
        Answer::ok_chat("late", 5, 5).delay(Duration::from_secs(20))
    ])
    .await;
    let sc = Sidecar::start(&policy(&up, "shutdown_grace: 300ms", "")).await;
    let url = sc.chat_url();
    let slow = tokio::spawn(async move { common::try_post_json(&url, &chat(), &[]).await });
    assert_eq!(up.wait_for_hits(1, Duration::from_secs(5)).await, 1);
    let t0 = Instant::now();
    sc.stop().await;
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "drain took {:?}",
        t0.elapsed()
    );
    slow.abort();
}

#[tokio::test]
async fn a_huge_retry_after_holds_the_circuit_no_longer_than_max_open() {
    let up = MockUpstream::start(vec![Answer::status(429).header("retry-after", "99999999")]).await;
    let sc = Sidecar::start(&policy(&up, "", "failure_threshold: 1, max_open: 1h")).await;
    let before = jiff::Timestamp::now().as_millisecond();
    let _ = post_json(&sc.chat_url(), &chat(), &[]).await;
    let c = sc.circuit("primary");
    assert_eq!(c.state_at(before + 1), CircuitState::Open);
    let after = jiff::Timestamp::now().as_millisecond();
    assert!(
        c.open_until() <= after + 3_600_000,
        "held until {}",
        c.open_until()
    );
    sc.stop().await;
}

async fn admin_post(sc: &Sidecar, path: &str, auth: Option<&str>) -> (u16, Value) {
    let headers: Vec<(&str, &str)> = auth.map(|a| vec![("authorization", a)]).unwrap_or_default();
    let url = format!("http://{}{path}", sc.running.admin_addr);
    let (code, _, body) = try_send_with(&common::client(), Method::POST, &url, None, &headers)
        .await
        .expect("admin call");
    (code, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[tokio::test]
async fn the_admin_api_resets_a_circuit_with_a_lowercase_bearer() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&policy(&up, "", "")).await;
    sc.running.ops.set_token(Some("adm-tok".into()));
    let now = jiff::Timestamp::now().as_millisecond();
    sc.circuit("primary")
        .restore(CircuitState::Open, 9, now, now + 99_999_999_000, 0);
    let st = status(sc.running.admin_addr).await;
    assert_eq!(st["backends"][0]["circuit"], "OPEN");

    let path = "/admin/circuits/primary/reset";
    assert_eq!(admin_post(&sc, path, None).await.0, 401);
    assert_eq!(admin_post(&sc, path, Some("bearer wrong")).await.0, 401);
    let (code, body) = admin_post(&sc, "/admin/circuits/nope/reset", Some("bearer adm-tok")).await;
    assert_eq!(code, 404, "{body}");
    let (code, body) = admin_post(&sc, path, Some("bearer adm-tok")).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["before"], "OPEN");

    let st = status(sc.running.admin_addr).await;
    assert_eq!(st["backends"][0]["circuit"], "CLOSED");
    assert_eq!(st["open_circuits"], j!([]));
    let (code, _, _) = post_json(&sc.chat_url(), &chat(), &[]).await;
    assert_eq!(code, 200);
    // The reload endpoint takes the lowercase scheme as well (no path: 409, not 401).
    let (code, _) = admin_post(&sc, "/admin/reload", Some("BEARER adm-tok")).await;
    assert_eq!(code, 409);
    sc.stop().await;
}

#[tokio::test]
async fn expect_continue_past_the_limit_is_answered_413_not_100() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&policy(&up, "max_body_bytes: 1000", "")).await;
    let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 50000\r\nexpect: 100-continue\r\n\r\n",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("an answer without sending the body")
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(head.contains("request_too_large"), "{head}");
    assert_eq!(up.hits(), 0);
    sc.stop().await;
}

/// Requests hyper cannot parse get their status with an error body in OpenAI's shape (not an
/// empty answer), are never forwarded, and close the connection.
#[tokio::test]
async fn protocol_rejections_carry_an_error_body() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&policy(&up, "", "")).await;
    let many: String = (0..150).map(|i| format!("x-h{i}: v\r\n")).collect();
    let cases: Vec<(Vec<u8>, &str, &str)> = vec![
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}".to_vec(),
            "HTTP/1.1 400",
            "malformed_request",
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-a: a\x00b\r\ncontent-length: 2\r\n\r\n{}".to_vec(),
            "HTTP/1.1 400",
            "malformed_request",
        ),
        (
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{many}content-length: 2\r\n\r\n{{}}").into_bytes(),
            "HTTP/1.1 431",
            "headers_too_large",
        ),
    ];
    for (raw, status, code) in cases {
        let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
        s.write_all(&raw).await.unwrap();
        let got = read_to_close(&mut s, Duration::from_secs(5)).await.unwrap();
        assert!(got.starts_with(status), "{got}");
        let (head, body) = got.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("content-type: application/json"), "{head}");
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {got}"));
        assert_eq!(v["error"]["code"], code, "{got}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{got}");
    }
    assert_eq!(up.hits(), 0, "nothing unparsable reaches the upstream");
    // The port still serves.
    let (code, _, _) = post_json(&sc.chat_url(), &chat(), &[]).await;
    assert_ne!(code, 0);
    sc.stop().await;
}

fn gzip(data: &[u8]) -> Bytes {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    Bytes::from(e.finish().unwrap())
}

#[tokio::test]
async fn a_gzip_body_is_decoded_and_its_encoding_never_goes_upstream() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&policy(&up, "max_body_bytes: 100000", "")).await;
    let body = gzip(chat().to_string().as_bytes());
    let h = [
        ("content-type", "application/json"),
        ("content-encoding", "gzip"),
    ];
    let (code, _, resp) = try_post_raw(&sc.chat_url(), body, &h).await.unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&resp));
    let got = up.last_request().unwrap();
    assert_eq!(got.header("content-encoding"), None);
    assert_eq!(got.model(), Some("m"));

    // A bomb: small on the wire, past the limit decoded.
    let mut big = chat();
    big["messages"][0]["content"] = Value::String("a".repeat(500_000));
    let bomb = gzip(big.to_string().as_bytes());
    assert!(bomb.len() < 100_000);
    let (code, _, resp) = try_post_raw(&sc.chat_url(), bomb, &h).await.unwrap();
    assert_eq!(code, 413, "{}", String::from_utf8_lossy(&resp));

    // A coding not decoded here: 415 in the OpenAI error shape.
    let h = [
        ("content-type", "application/json"),
        ("content-encoding", "br"),
    ];
    let (code, _, resp) = try_post_raw(&sc.chat_url(), Bytes::from_static(b"xx"), &h)
        .await
        .unwrap();
    assert_eq!(code, 415);
    let v: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(v["error"]["code"], "unsupported_content_encoding");
    assert_eq!(up.hits(), 1);
    sc.stop().await;
}
