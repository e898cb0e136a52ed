//! The wire, tried as an attacker and as a hostile upstream would, from raw sockets: a head
//! that never completes, an upstream that answers what no one asked, closes a pooled
//! connection as a request crosses it, splits a secret across reads, forges the sidecar's
//! fields, compresses unasked, or cuts its body short; requests without exactly one `Host`.

mod common;

use bytes::BytesMut;
use common::sidecar::Sidecar;
use common::{json, post_json, post_json_frames, try_post_json};
use serde_json::{json as j, Value};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const KEY_ENV: &str = "TOLLGATE_TEST_WIRE_KEY";
const SECRET: &str = "sk-wire-test-secret-0123456789abcdef";

/// An upstream whose every connection is served by `serve(stream, connection number)`.
struct Raw {
    addr: SocketAddr,
    conns: Arc<AtomicUsize>,
}

impl Raw {
    async fn start<F, Fut>(serve: F) -> Raw
    where
        F: Fn(TcpStream, usize) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let conns = Arc::new(AtomicUsize::new(0));
        let counted = conns.clone();
        let serve = Arc::new(serve);
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let n = counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(s, n));
            }
        });
        Raw { addr, conns }
    }

    fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

/// One request read off `s` (bytes past it stay in `buf`): its body as JSON; `None` at EOF.
async fn read_request(s: &mut TcpStream, buf: &mut BytesMut) -> Option<Value> {
    loop {
        let mut fields = [httparse::EMPTY_HEADER; 64];
        let mut r = httparse::Request::new(&mut fields);
        if let Ok(httparse::Status::Complete(n)) = r.parse(buf) {
            let len: usize = r
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .map_or(0, |h| {
                    std::str::from_utf8(h.value).unwrap().parse().unwrap()
                });
            while buf.len() < n + len {
                if s.read_buf(buf).await.ok()? == 0 {
                    return None;
                }
            }
            let _ = buf.split_to(n);
            let body = buf.split_to(len);
            return Some(serde_json::from_slice(&body).unwrap_or(Value::Null));
        }
        if s.read_buf(buf).await.ok()? == 0 {
            return None;
        }
    }
}

/// The user message's text of a chat request.
fn marker(req: &Value) -> String {
    req["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

fn completion(content: &str) -> String {
    j!({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}})
    .to_string()
}

/// A whole answer with a JSON body and `extra` header lines.
fn answer(body: &str, extra: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn policy(url: &str, extra: &str) -> String {
    format!(
        "version: wire\n{extra}backends:\n  - {{id: a, kind: openai, base_url: \"{url}\", api_key_env: {KEY_ENV}, circuit: {{failure_threshold: 3}}}}\nroutes:\n  - {{model: chat, chain: [{{backend: a, model: m}}]}}\nbudgets:\n  - {{name: all, scope: global, window: month, hard_tokens: 1000000}}\n"
    )
}

fn chat(text: &str, stream: bool) -> Value {
    j!({"model": "chat", "max_tokens": 20, "stream": stream,
        "messages": [{"role": "user", "content": text}]})
}

fn rid(h: &http::HeaderMap) -> String {
    h["x-tollgate-request-id"].to_str().unwrap().to_string()
}

async fn metrics(sc: &Sidecar) -> String {
    let (_, _, m) = common::get(&format!("http://{}/metrics", sc.running.admin_addr)).await;
    String::from_utf8_lossy(&m).into_owned()
}

/// Whether `s` is closed by the peer within `within` (EOF or reset; bytes read are ignored).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut sink = [0u8; 1024];
    let until = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(until, s.read(&mut sink)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

// Row 1: a head that never completes holds no connection past the header timeout.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_never_completes_is_closed_at_the_header_timeout() {
    std::env::set_var(KEY_ENV, SECRET);
    let up = Raw::start(|mut s, _| async move {
        let mut buf = BytesMut::new();
        while let Some(req) = read_request(&mut s, &mut buf).await {
            let _ = s.write_all(&answer(&completion(&marker(&req)), "")).await;
        }
    })
    .await;
    let yaml = policy(
        &up.url(),
        "server: {header_read_timeout: 300ms, max_connections: 3}\n",
    );
    let sc = Sidecar::start(&yaml).await;
    // Strict prefixes of the HTTP/2 preface, and of an HTTP/1 head, sent and never finished:
    // as many as the connection cap allows.
    let mut held = Vec::new();
    for prefix in [
        "P",
        "PRI * HTTP/2.0\r\n",
        "POST /v1/chat/completions HTTP/1.1\r\nHo",
    ] {
        let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
        s.write_all(prefix.as_bytes()).await.unwrap();
        held.push((prefix, s));
    }
    let t0 = Instant::now();
    for (prefix, s) in &mut held {
        assert!(
            closed_within(s, Duration::from_secs(5)).await,
            "{prefix:?} still open after {:?}",
            t0.elapsed()
        );
    }
    // The cap's slots are free again: a legitimate client is served.
    let (st, _, b) = post_json(&sc.chat_url(), &chat("after", false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    // The same after a request served on the connection.
    let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
    let body = chat("first", false).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = BytesMut::new();
    while !String::from_utf8_lossy(&got).contains("\"first\"") {
        assert!(
            s.read_buf(&mut got).await.unwrap() > 0,
            "closed before the answer"
        );
    }
    s.write_all(b"P").await.unwrap();
    assert!(
        closed_within(&mut s, Duration::from_secs(5)).await,
        "a `P` after a served request keeps the connection open"
    );
    assert!(metrics(&sc).await.contains("reason=\"slow_head\""));
    sc.stop().await;
}

// Row 2: an answer no request asked for is never read as the next caller's, and the
// upstream's connections are not reused while it is distrusted.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsolicited_answer_never_shifts_answers_between_callers() {
    std::env::set_var(KEY_ENV, SECRET);
    let up = Raw::start(|mut s, conn| async move {
        let mut buf = BytesMut::new();
        let mut n = 0;
        while let Some(req) = read_request(&mut s, &mut buf).await {
            if s.write_all(&answer(&completion(&marker(&req)), ""))
                .await
                .is_err()
            {
                return;
            }
            n += 1;
            if conn == 0 && n == 1 {
                // Just after the first answer's end: one answer nobody asked for.
                tokio::time::sleep(Duration::from_millis(2)).await;
                let _ = s.write_all(&answer(&completion("UNSOLICITED"), "")).await;
            }
        }
    })
    .await;
    let sc = Sidecar::start_workers(&policy(&up.url(), ""), 1).await;
    let mut wrong = Vec::new();
    for i in 0..40 {
        let who = if i % 2 == 0 { "alice" } else { "bob" };
        let text = format!("{who}-{i}");
        let (st, _, b) = post_json(&sc.chat_url(), &chat(&text, false), &[]).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        let got = json(&b)["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if got != text {
            wrong.push((text, got));
        }
    }
    // The one answer that came before anyone could tell it was unsolicited is the most that
    // can go wrong; never another caller's answer.
    assert!(wrong.len() <= 1, "{wrong:?}");
    assert!(
        wrong.iter().all(|(_, got)| got == "UNSOLICITED"),
        "{wrong:?}"
    );
    let m = metrics(&sc).await;
    assert!(m.contains("fault=\"unsolicited\""), "{m}");
    sc.stop().await;
}

// Row 3: a pooled connection the upstream closes as the next request arrives.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_as_the_request_crossed_it_is_retried_on_a_fresh_one() {
    std::env::set_var(KEY_ENV, SECRET);
    // Each connection answers one request; the next one it reads and closes unanswered (an
    // idle timeout that fired as the request arrived).
    let up = Raw::start(|mut s, _| async move {
        let mut buf = BytesMut::new();
        if let Some(req) = read_request(&mut s, &mut buf).await {
            let _ = s.write_all(&answer(&completion(&marker(&req)), "")).await;
        }
        let _ = read_request(&mut s, &mut buf).await;
    })
    .await;
    let sc = Sidecar::start_workers(&policy(&up.url(), ""), 1).await;
    for i in 0..12 {
        let text = format!("call-{i}");
        let (st, h, b) = post_json(&sc.chat_url(), &chat(&text, false), &[]).await;
        assert_eq!(st, 200, "call {i}: {}", String::from_utf8_lossy(&b));
        assert_eq!(json(&b)["choices"][0]["message"]["content"], text.as_str());
        // Sent again by the pool, not retried by the governor as a failed attempt.
        let a = sc.audit(&rid(&h)).await;
        assert_eq!(a["attempts"].as_array().unwrap().len(), 1, "{a}");
    }
    assert_eq!(
        sc.circuit("a").raw_state(),
        tollgate::governor::CircuitState::Closed
    );
    assert!(up.conns.load(Ordering::SeqCst) >= 12);
    assert!(metrics(&sc).await.contains("fault=\"closed_idle\""));
    sc.stop().await;
}

// Row 4: a secret split across two reads of a stream passed through as it comes.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_split_across_two_reads_of_a_stream_is_redacted() {
    std::env::set_var(KEY_ENV, SECRET);
    let up = Raw::start(|mut s, _| async move {
        let mut buf = BytesMut::new();
        if read_request(&mut s, &mut buf).await.is_none() {
            return;
        }
        let secret_piece = format!("{SECRET}!");
        let body = common::native::anthropic_stream_events(&["the key is ", &secret_piece], 7, 3)
            .concat();
        let split = body.find(SECRET).unwrap() + SECRET.len() / 2;
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        let chunk = |b: &str| format!("{:x}\r\n{b}\r\n", b.len());
        let _ = s
            .write_all(format!("{head}{}", chunk(&body[..split])).as_bytes())
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = s
            .write_all(format!("{}0\r\n\r\n", chunk(&body[split..])).as_bytes())
            .await;
    })
    .await;
    let yaml = format!(
        "version: wire\nbackends:\n  - {{id: a, kind: anthropic, base_url: \"http://{}\", api_key_env: {KEY_ENV}}}\nroutes:\n  - {{model: chat, chain: [{{backend: a, model: claude-x}}]}}\n",
        up.addr
    );
    let sc = Sidecar::start(&yaml).await;
    let url = format!("{}/messages", sc.base);
    let body = j!({"model": "chat", "max_tokens": 20, "stream": true,
                   "messages": [{"role": "user", "content": "hi"}]});
    let r = post_json_frames(&url, &body, &[]).await;
    assert_eq!(r.status, 200);
    let text = r.text();
    assert!(!text.contains(SECRET), "{text}");
    assert!(!text.contains(&SECRET[..SECRET.len() / 2]), "{text}");
    assert!(text.contains("[redacted]!"), "{text}");
    assert!(text.contains("message_stop"), "{text}");
    sc.stop().await;
}

// Row 7: fields for this hop only, forged decisions, and a coding never asked for.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_fields_forged_decisions_and_unasked_compression_are_not_handed_on() {
    std::env::set_var(KEY_ENV, SECRET);
    let up = Raw::start(|mut s, _| async move {
        let mut buf = BytesMut::new();
        while let Some(req) = read_request(&mut s, &mut buf).await {
            let body = completion(&marker(&req));
            let out = if marker(&req) == "gzip" {
                let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                std::io::Write::write_all(&mut z, body.as_bytes()).unwrap();
                let z = z.finish().unwrap();
                let mut out = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\ncontent-length: {}\r\n\r\n",
                    z.len()
                )
                .into_bytes();
                out.extend_from_slice(&z);
                out
            } else {
                answer(
                    &body,
                    "connection: x-hop-only\r\nx-hop-only: 1\r\nx-tollgate-shadow: forged\r\nx-tollgate-backend: forged\r\nx-kept: yes\r\n",
                )
            };
            if s.write_all(&out).await.is_err() {
                return;
            }
        }
    })
    .await;
    let sc = Sidecar::start(&policy(&up.url(), "")).await;
    let (st, h, b) = post_json(&sc.chat_url(), &chat("plain", false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(h["x-kept"], "yes");
    assert!(h.get("x-hop-only").is_none(), "{h:?}");
    assert!(h.get("x-tollgate-shadow").is_none(), "{h:?}");
    assert_eq!(h["x-tollgate-backend"], "a");
    let (st, h, b) = post_json(&sc.chat_url(), &chat("gzip", false), &[]).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert!(h.get("content-encoding").is_none(), "{h:?}");
    assert_eq!(json(&b)["choices"][0]["message"]["content"], "gzip");
    let a = sc.audit(&rid(&h)).await;
    assert_eq!(a["actual_output_tokens"], 3, "{a}");
    sc.stop().await;
}

// Row 9: the upstream took the call, its answer never came whole: never committed as 0.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_cut_short_commits_the_reserved_worst_case() {
    std::env::set_var(KEY_ENV, SECRET);
    let up = Raw::start(|mut s, _| async move {
        let mut buf = BytesMut::new();
        if read_request(&mut s, &mut buf).await.is_some() {
            let full = answer(&completion("cut"), "");
            let head_end = full.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
            let half = head_end + (full.len() - head_end) / 2;
            let _ = s.write_all(&full[..half]).await;
        }
    })
    .await;
    let sc = Sidecar::start(&policy(&up.url(), "")).await;
    let (st, h, b) = post_json(&sc.chat_url(), &chat("hi", false), &[]).await;
    assert_ne!(st, 200, "{}", String::from_utf8_lossy(&b));
    let a = sc.audit(&rid(&h)).await;
    let att = &a["attempts"][0];
    assert!(att["worst_tokens"].as_u64().unwrap() > 0, "{a}");
    assert_eq!(att["committed_tokens"], att["worst_tokens"], "{a}");
    let key = tollgate::ledger::CounterKey {
        scope: tollgate::units::Scope::Global,
        id: Arc::from("global"),
        window: Some(tollgate::ledger::window_at(
            &jiff::tz::TimeZone::UTC,
            tollgate::units::Window::Month,
            jiff::Timestamp::now().as_millisecond(),
        )),
    };
    assert_eq!(
        sc.committed(&key).tokens,
        att["worst_tokens"].as_u64().unwrap()
    );
    sc.stop().await;
}

// Row 10: exactly one Host, on both server paths.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_exactly_one_host_is_refused_on_both_paths() {
    std::env::set_var(KEY_ENV, SECRET);
    let up = Raw::start(|_, _| async {}).await;
    let sc = Sidecar::start(&policy(&up.url(), "")).await;
    let body = chat("hi", false).to_string();
    let heads = [
        // The own server's path.
        format!("POST /v1/chat/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n{body}", body.len()),
        format!("POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\ncontent-length: {}\r\n\r\n{body}", body.len()),
        // hyper's (a chunked body).
        format!("POST /v1/chat/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n", body.len()),
        // A bare LF.
        format!("POST /v1/chat/completions HTTP/1.1\nHost: a\r\ncontent-length: {}\r\n\r\n{body}", body.len()),
    ];
    for raw in heads {
        let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
        s.write_all(raw.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await;
        let got = String::from_utf8_lossy(&got);
        assert!(got.starts_with("HTTP/1.1 400"), "{raw:?} -> {got}");
        assert!(got.contains("malformed_request"), "{got}");
    }
    assert_eq!(up.conns.load(Ordering::SeqCst), 0);
    sc.stop().await;
}

// Row 5: a body of many small containers is refused before it is parsed.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_too_many_json_containers_is_refused_before_its_parse() {
    std::env::set_var(KEY_ENV, SECRET);
    let up = Raw::start(|_, _| async {}).await;
    let yaml = policy(&up.url(), "server: {max_body_bytes: 8388608}\n");
    let sc = Sidecar::start(&yaml).await;
    let part = j!({"role": "user", "content": [{"type": "text", "text": "x"}]});
    let body = j!({"model": "chat", "max_tokens": 5, "messages": vec![part; 30_000]});
    let (st, _, b) = post_json(&sc.chat_url(), &body, &[]).await;
    assert_eq!(st, 400, "{}", String::from_utf8_lossy(&b));
    assert!(
        String::from_utf8_lossy(&b).contains("JSON objects and arrays"),
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(up.conns.load(Ordering::SeqCst), 0);
    sc.stop().await;
}

// Row 8 (part): a client that stops reading is cut once its stream was settled.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_readers_socket_is_closed_after_its_stream_was_settled() {
    std::env::set_var(KEY_ENV, SECRET);
    let up = Raw::start(|mut s, _| async move {
        let mut buf = BytesMut::new();
        let Some(req) = read_request(&mut s, &mut buf).await else {
            return;
        };
        if req["stream"] != true {
            let _ = s.write_all(&answer(&completion(&marker(&req)), "")).await;
            return;
        }
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        if s.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let event = format!(
            "data: {}\n\n",
            j!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"content": "x".repeat(16 * 1024)}, "finish_reason": null}]})
        );
        let chunk = format!("{:x}\r\n{event}\r\n", event.len());
        // Far more than the sockets between hold; until the sidecar stops reading.
        for _ in 0..4000 {
            if s.write_all(chunk.as_bytes()).await.is_err() {
                return;
            }
        }
    })
    .await;
    let yaml = format!(
        "version: wire\nserver: {{header_read_timeout: 500ms, max_connections: 1}}\nbackends:\n  - {{id: a, kind: openai, base_url: \"{}\", api_key_env: {KEY_ENV}, timeouts: {{total: 1s}}}}\nroutes:\n  - {{model: chat, chain: [{{backend: a, model: m}}]}}\n",
        up.url()
    );
    let sc = Sidecar::start(&yaml).await;
    let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
    let body = chat("hi", true).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // Not read: the stream is ended at `timeouts.total` (1 s) and settled; its connection must
    // not wait for this client after that. With one connection allowed, the next client is
    // refused (a 503, or a reset when it comes before the request is read) until that one
    // is closed, then served.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match try_post_json(&sc.chat_url(), &chat("next", false), &[]).await {
            Ok((200, _, _)) => break,
            Ok((st, _, b)) => assert_eq!(st, 503, "{}", String::from_utf8_lossy(&b)),
            Err(_) => {}
        }
        assert!(
            Instant::now() < deadline,
            "the stalled reader's connection was never closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(s);
    sc.stop().await;
}

// Row 8: both server paths close a request's record at the same point, so a client that goes
// away while its answer is written, or before it, is recorded alike on each.

/// A request for `text` as the own server reads it (a length) or as hyper does (chunked).
fn raw_chat(text: &str, chunked: bool) -> String {
    let body = chat(text, false).to_string();
    if chunked {
        format!("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n", body.len())
    } else {
        format!("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len())
    }
}

/// The audit records whose user text was `text` (the mock echoes it), once there are `n`.
async fn records_of(sc: &Sidecar, n: usize) -> Vec<Value> {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let r: Vec<Value> = sc
            .audit_text()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if r.len() >= n || Instant::now() > until {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reset_during_the_write_is_disconnected_on_both_paths() {
    std::env::set_var(KEY_ENV, SECRET);
    // 16 MiB of answer: far more than the sockets between hold.
    let big = Arc::new(answer(&completion(&"y".repeat(16 << 20)), ""));
    let up = Raw::start(move |mut s, _| {
        let big = big.clone();
        async move {
            let mut buf = BytesMut::new();
            while read_request(&mut s, &mut buf).await.is_some() {
                if s.write_all(&big).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    let sc = Sidecar::start(&policy(&up.url(), "")).await;
    for chunked in [false, true] {
        let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
        s.write_all(raw_chat("big", chunked).as_bytes())
            .await
            .unwrap();
        let mut first = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut first))
            .await
            .expect("the answer starts")
            .unwrap();
        assert!(n > 0);
        // A reset, not a close: the sidecar's next write fails.
        #[allow(deprecated)] // a zero linger does not block: it resets at once
        s.set_linger(Some(Duration::ZERO)).unwrap();
        drop(s);
    }
    let recs = records_of(&sc, 2).await;
    assert_eq!(recs.len(), 2, "{recs:?}");
    for (r, path) in recs.iter().zip(["own server", "hyper"]) {
        assert_eq!(r["client_disconnected"], true, "{path}: {r}");
        assert_eq!(r["actual_output_tokens"], 3, "{path}: {r}");
    }
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_half_closes_is_recorded_alike_on_both_paths() {
    std::env::set_var(KEY_ENV, SECRET);
    let up = Raw::start(|mut s, _| async move {
        let mut buf = BytesMut::new();
        while let Some(req) = read_request(&mut s, &mut buf).await {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if s.write_all(&answer(&completion(&marker(&req)), ""))
                .await
                .is_err()
            {
                return;
            }
        }
    })
    .await;
    let sc = Sidecar::start(&policy(&up.url(), "")).await;
    for chunked in [false, true] {
        let mut s = TcpStream::connect(sc.running.addr).await.unwrap();
        s.write_all(raw_chat("half", chunked).as_bytes())
            .await
            .unwrap();
        s.shutdown().await.unwrap();
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
        let recs = records_of(&sc, if chunked { 2 } else { 1 }).await;
        let r = recs.last().unwrap();
        // The call the upstream served is committed and audited either way.
        assert_eq!(r["actual_output_tokens"], 3, "chunked={chunked}: {r}");
        assert_eq!(
            r["client_disconnected"], true,
            "chunked={chunked}: a closed sending side is a client gone: {r}"
        );
        assert!(
            got.is_empty(),
            "chunked={chunked}: {}",
            String::from_utf8_lossy(&got)
        );
    }
    sc.stop().await;
}
