//! The own keep-alive pool and HTTP/1 client of cleartext upstreams (`tollgate::wire::pool`),
//! against a raw TCP upstream that counts its connections, can close them behind the pool's
//! back, and can answer in every framing (or in none).

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tollgate::wire::pool::{Pools, SendError, UpstreamBody};

const ANSWER: &str = "{\"ok\":true}";

/// How the upstream treats a connection after each answer.
#[derive(Clone, Copy)]
enum After {
    KeepAlive,
    /// Closes it without saying so (no `Connection: close`): the idle connection goes stale.
    SilentClose,
    /// Sends the body in two writes some time apart (a slow body).
    SlowBody,
    /// Answers in chunks, one write each, some time apart (a stream).
    Chunked,
    /// Answers with these bytes, then closes.
    Raw(&'static str),
    /// Answers with these bytes one byte a write, then closes.
    Trickle(&'static str),
    /// Answers with the length of the request body it read (and keeps the connection).
    EchoLength,
}

struct Upstream {
    addr: std::net::SocketAddr,
    accepted: Arc<AtomicUsize>,
}

async fn upstream(after: After) -> Upstream {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    // One request: its head and its Content-Length body.
                    let Some(end) = find(&buf, b"\r\n\r\n") else {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while buf.len() < end + 4 + len {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    assert!(head.contains("\r\nhost: 127.0.0.1:"), "{head}");
                    assert!(
                        head.starts_with("post /v1/chat/completions http/1.1"),
                        "{head}"
                    );
                    buf.drain(..end + 4 + len);
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        ANSWER.len()
                    );
                    match after {
                        After::EchoLength => {
                            let n = len.to_string();
                            let answer = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{n}",
                                n.len()
                            );
                            let _ = s.write_all(answer.as_bytes()).await;
                        }
                        After::Trickle(bytes) => {
                            for b in bytes.as_bytes() {
                                let _ = s.write_all(&[*b]).await;
                                let _ = s.flush().await;
                            }
                            return;
                        }
                        After::Raw(bytes) => {
                            let _ = s.write_all(bytes.as_bytes()).await;
                            return;
                        }
                        After::Chunked => {
                            let _ = s
                                .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                                .await;
                            for piece in ANSWER.as_bytes().chunks(3) {
                                let chunk = format!(
                                    "{:x}\r\n{}\r\n",
                                    piece.len(),
                                    std::str::from_utf8(piece).unwrap()
                                );
                                let _ = s.write_all(chunk.as_bytes()).await;
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            let _ = s.write_all(b"0\r\n\r\n").await;
                        }
                        After::SlowBody => {
                            let (a, b) = ANSWER.split_at(4);
                            let _ = s.write_all(format!("{head}{a}").as_bytes()).await;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            let _ = s.write_all(b.as_bytes()).await;
                        }
                        _ => {
                            let _ = s.write_all(format!("{head}{ANSWER}").as_bytes()).await;
                        }
                    }
                    if let After::SilentClose = after {
                        return;
                    }
                }
            });
        }
    });
    Upstream { addr, accepted }
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

fn request(addr: std::net::SocketAddr) -> Request<Bytes> {
    Request::post(format!("http://{addr}/v1/chat/completions"))
        .body(Bytes::from_static(b"{\"model\":\"m\"}"))
        .unwrap()
}

async fn call(pools: &Pools, addr: std::net::SocketAddr) -> Bytes {
    let resp = pools
        .send(request(addr), Duration::from_secs(2))
        .await
        .expect("an answer");
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap().to_bytes()
}

#[tokio::test]
async fn sequential_requests_share_one_connection() {
    let up = upstream(After::KeepAlive).await;
    let pools = Pools::default();
    for _ in 0..20 {
        assert_eq!(call(&pools, up.addr).await, ANSWER);
    }
    assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(pools.idle(&up.addr.to_string()), 1);
}

#[tokio::test]
async fn concurrent_requests_open_at_most_one_connection_each_and_all_come_back() {
    let up = upstream(After::KeepAlive).await;
    let pools = Arc::new(Pools::default());
    for _round in 0..3 {
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let pools = pools.clone();
                tokio::spawn(async move { call(&pools, up.addr).await })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap(), ANSWER);
        }
    }
    let accepted = up.accepted.load(Ordering::SeqCst);
    assert!((1..=8).contains(&accepted), "{accepted} connections");
    assert_eq!(pools.idle(&up.addr.to_string()), accepted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_connection_worker_reuses_only_the_connections_it_dialed() {
    use tollgate::proxy::workers::Workers;
    let up = upstream(After::KeepAlive).await;
    let pools = Arc::new(Pools::default());
    let workers = Workers::start(2).unwrap();
    // Runs a few calls on the worker that takes the next connection; `held` keeps the
    // previous picks counted, so each pick goes to the other worker in turn.
    let mut held = Vec::new();
    let on_next_worker = |held: &mut Vec<_>, calls: usize| {
        let (rt, open) = workers.pick();
        held.push(open);
        let (pools, addr) = (pools.clone(), up.addr);
        rt.spawn(async move {
            for _ in 0..calls {
                assert_eq!(call(&pools, addr).await, ANSWER);
            }
            tollgate::proxy::workers::lane()
        })
    };
    let first = on_next_worker(&mut held, 3).await.unwrap();
    assert_eq!(
        up.accepted.load(Ordering::SeqCst),
        1,
        "one connection, reused"
    );
    // The other worker does not drive the first one's connection: it dials its own.
    let second = on_next_worker(&mut held, 3).await.unwrap();
    assert_ne!(first, second);
    assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(pools.idle(&up.addr.to_string()), 2);
    held.clear();
    // Back on the first worker (both idle again: the first is picked): its own is reused.
    assert_eq!(on_next_worker(&mut held, 3).await.unwrap(), first);
    assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_connection_the_upstream_closed_is_not_reused() {
    let up = upstream(After::SilentClose).await;
    let pools = Pools::default();
    for i in 1..=5 {
        assert_eq!(call(&pools, up.addr).await, ANSWER);
        // Give the runtime's reactor time to see the close.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(up.accepted.load(Ordering::SeqCst), i);
    }
}

/// A request to a slow-bodied upstream, its answer's head in hand and its body still arriving.
async fn slow_answer() -> (Upstream, Pools, http::Response<UpstreamBody>) {
    answer(After::SlowBody).await
}

/// One request to a new upstream that behaves as `after`: its answer's head in hand.
async fn answer(after: After) -> (Upstream, Pools, http::Response<UpstreamBody>) {
    let up = upstream(after).await;
    let pools = Pools::default();
    let resp = pools
        .send(request(up.addr), Duration::from_secs(2))
        .await
        .unwrap();
    (up, pools, resp)
}

#[tokio::test]
async fn a_connection_comes_back_once_its_body_is_read_to_the_end() {
    let (up, pools, resp) = slow_answer().await;
    assert_eq!(pools.idle(&up.addr.to_string()), 0);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, ANSWER);
    assert_eq!(pools.idle(&up.addr.to_string()), 1);
    assert_eq!(call(&pools, up.addr).await, ANSWER);
    assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_that_came_with_its_head_is_taken_whole_and_one_still_coming_is_not() {
    let up = upstream(After::KeepAlive).await;
    let pools = Pools::default();
    let mut body = pools
        .send(request(up.addr), Duration::from_secs(2))
        .await
        .unwrap()
        .into_body();
    // Over the limit: left to be read (and refused) the slow way.
    assert_eq!(body.arrived(ANSWER.len() - 1), None);
    assert_eq!(body.arrived(ANSWER.len()).unwrap(), ANSWER);
    assert_eq!(pools.idle(&up.addr.to_string()), 1);
    let (_up, _pools, resp) = slow_answer().await;
    let mut body = resp.into_body();
    assert_eq!(body.arrived(1 << 20), None);
    assert_eq!(body.collect().await.unwrap().to_bytes(), ANSWER);
}

#[tokio::test]
async fn request_bodies_small_and_large_are_written_whole_on_one_connection() {
    let up = upstream(After::EchoLength).await;
    let pools = Pools::default();
    // Past 256 KiB the body is written after the head instead of in the same buffer.
    for size in [0, 1, 4096, 256 * 1024, 256 * 1024 + 1, 3 << 20] {
        let req = Request::post(format!("http://{}/v1/chat/completions", up.addr))
            .body(Bytes::from(vec![b'x'; size]))
            .unwrap();
        let resp = pools.send(req, Duration::from_secs(2)).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, size.to_string());
    }
    assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_dropped_unread_closes_its_connection() {
    let (up, pools, resp) = slow_answer().await;
    drop(resp);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(pools.idle(&up.addr.to_string()), 0);
    assert_eq!(call(&pools, up.addr).await, ANSWER);
    assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_chunked_answer_arrives_piece_by_piece_and_its_connection_is_reused() {
    let (up, pools, resp) = answer(After::Chunked).await;
    let mut body = resp.into_body();
    let mut pieces = Vec::new();
    while let Some(f) = body.frame().await {
        pieces.push(f.unwrap().into_data().unwrap());
    }
    // Each chunk is handed on as it comes, not gathered.
    assert!(pieces.len() >= 3, "{pieces:?}");
    assert_eq!(pieces.concat(), ANSWER.as_bytes());
    assert_eq!(pools.idle(&up.addr.to_string()), 1);
    assert_eq!(call(&pools, up.addr).await, ANSWER);
    assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_read_to_the_close_is_whole_and_its_connection_not_reused() {
    let (up, pools, resp) = answer(After::Raw(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it",
    ))
    .await;
    assert_eq!(resp.headers()["content-type"], "text/plain");
    assert_eq!(
        resp.into_body().collect().await.unwrap().to_bytes(),
        "all of it"
    );
    assert_eq!(pools.idle(&up.addr.to_string()), 0);
}

#[tokio::test]
async fn a_head_that_trickles_in_a_byte_at_a_time_is_read() {
    let (_up, _pools, resp) = answer(After::Trickle(
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nx-a: 1\r\ncontent-length: 2\r\n\r\nok",
    ))
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-a"], "1");
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
}

#[tokio::test]
async fn interim_answers_are_skipped() {
    let (_up, _pools, resp) = answer(After::Raw(
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    ))
    .await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("link").is_none());
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
}

/// An upstream that answers with `bytes` and closes: the answer is refused or its body fails,
/// never read as something it is not, and the connection is never pooled.
async fn hostile(bytes: &'static str) -> Result<Bytes, &'static str> {
    let up = upstream(After::Raw(bytes)).await;
    let pools = Pools::default();
    let r = match pools.send(request(up.addr), Duration::from_secs(2)).await {
        Err(SendError::Broken) => Err("no head"),
        Err(SendError::Connect) => panic!("connected"),
        Ok(resp) => match resp.into_body().collect().await {
            Ok(b) => Ok(b.to_bytes()),
            Err(_) => Err("broken body"),
        },
    };
    assert_eq!(pools.idle(&up.addr.to_string()), 0, "{bytes:?}");
    r
}

#[tokio::test]
async fn hostile_upstreams_get_an_error_never_a_wrong_answer() {
    let huge: &'static str = Box::leak(
        format!(
            "HTTP/1.1 200 OK\r\nx-big: {}\r\n\r\n",
            "a".repeat(70 * 1024)
        )
        .into_boxed_str(),
    );
    let endless_interim: &'static str =
        Box::leak("HTTP/1.1 100 Continue\r\n\r\n".repeat(40).into_boxed_str());
    for (bytes, expect) in [
        ("", Err("no head")),
        ("HTTP/1.1 200 OK\r\ncontent-len", Err("no head")),
        ("not http at all\r\n\r\n", Err("no head")),
        (huge, Err("no head")),
        (endless_interim, Err("no head")),
        ("HTTP/1.1 101 Switching Protocols\r\n\r\n", Err("no head")),
        (
            "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab",
            Err("no head"),
        ),
        (
            "HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort",
            Err("broken body"),
        ),
        (
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
            Err("broken body"),
        ),
        (
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nfffffffffffffffff\r\n",
            Err("broken body"),
        ),
        (
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nokXX0\r\n\r\n",
            Err("broken body"),
        ),
        // More than the length said: the body is the length, and the connection not reused.
        (
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA",
            Ok(Bytes::from_static(b"ok")),
        ),
    ] {
        assert_eq!(
            hostile(bytes).await,
            expect,
            "{:?}",
            &bytes[..bytes.len().min(80)]
        );
    }
}

#[tokio::test]
async fn nothing_listening_is_a_connect_error() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let pools = Pools::default();
    let r = pools.send(request(addr), Duration::from_secs(1)).await;
    assert!(matches!(r, Err(tollgate::wire::pool::SendError::Connect)));
}

/// On a connection worker, a read that drains the socket clears its readiness without a
/// system call: a close that comes while the connection is idle must still be seen before
/// reuse (tokio keeps a close in the readiness through a clear), and a body that comes in
/// pieces must still wake its reader for each piece (a readiness lost would hang it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_worker_a_drained_socket_still_sees_the_next_piece_and_the_close() {
    use tollgate::proxy::workers::Workers;
    let workers = Workers::start(1).unwrap();
    let (rt, _open) = workers.pick();
    let run = rt.spawn(async {
        assert_ne!(tollgate::proxy::workers::lane(), 0, "on a worker");
        // Closed behind the pool's back after each answer: never reused.
        let up = upstream(After::SilentClose).await;
        let pools = Pools::default();
        for i in 1..=4 {
            assert_eq!(call(&pools, up.addr).await, ANSWER);
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(up.accepted.load(Ordering::SeqCst), i);
        }
        // Pieces some time apart (each read drains the socket), then reuse.
        for after in [After::Chunked, After::SlowBody] {
            let up = upstream(after).await;
            let pools = Pools::default();
            for _ in 0..3 {
                assert_eq!(call(&pools, up.addr).await, ANSWER);
            }
            assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
        }
        // Kept alive: one connection for many calls.
        let up = upstream(After::KeepAlive).await;
        let pools = Pools::default();
        for _ in 0..20 {
            assert_eq!(call(&pools, up.addr).await, ANSWER);
        }
        assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
    });
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("no read waits forever")
        .unwrap();
}
