//! Clients that go away or stop reading never get around the governor: a call that reached
//! the upstream is always reconciled (usage committed, hold released, audit record written
//! with the disconnect noted), and a stalled reader is ended at the backend's total timeout.

mod common;

use common::mock::{Answer, MockUpstream};
use common::sidecar::Sidecar;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CLIENTS: usize = 25;

fn policy(mock: &str, total: &str) -> String {
    format!(
        r#"version: disconnect-test
backends:
  - {{id: a, kind: openai, base_url: "{mock}", timeouts: {{connect: 1s, first_byte: 10s, total: {total}}}}}
routes:
  - {{model: chat, chain: [{{backend: a, model: m-a}}]}}
budgets:
  - {{name: all, scope: global, window: month, hard_tokens: 2000}}
"#
    )
}

fn raw_request(body: &Value) -> Vec<u8> {
    let b = body.to_string();
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: tollgate\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
        b.len()
    )
    .into_bytes()
}

fn chat(stream: bool) -> Value {
    json!({"model": "chat", "max_tokens": 60, "stream": stream,
           "messages": [{"role": "user", "content": "hi"}]})
}

/// Audit records written so far.
fn records(sc: &Sidecar) -> Vec<Value> {
    sc.audit_text()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

async fn wait_records(sc: &Sidecar, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = records(sc);
        if r.len() >= n || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// `CLIENTS` clients send a request and hang up while the upstream still works on it.
async fn hang_up_early(sc: &Sidecar, mock: &MockUpstream, stream: bool) {
    let mut socks = Vec::new();
    for _ in 0..CLIENTS {
        let mut s = TcpStream::connect(sc.running.addr).await.expect("connect");
        s.write_all(&raw_request(&chat(stream)))
            .await
            .expect("write");
        socks.push(s);
    }
    assert_eq!(
        mock.wait_for_hits(CLIENTS, Duration::from_secs(15)).await,
        CLIENTS,
        "every call reached the upstream"
    );
    drop(socks);
}

async fn assert_reconciled(sc: &Sidecar, mock: &MockUpstream, evidence: &str) {
    let recs = wait_records(sc, CLIENTS).await;
    assert_eq!(recs.len(), CLIENTS, "one audit record per call");
    for r in &recs {
        assert_eq!(r["client_disconnected"], true, "{r}");
        assert_eq!(r["usage_evidence_state"], evidence, "{r}");
        assert_eq!(r["actual_input_tokens"], 50, "{r}");
        assert_eq!(r["actual_output_tokens"], 51, "{r}");
    }
    assert_eq!(sc.ledger().reserved_tokens(), 0, "every hold released");
    // 25 × 101 tokens were spent against a 2,000-token budget: the next call is refused.
    let (st, _, b) = common::post_json(&sc.chat_url(), &chat(false), &[]).await;
    let text = String::from_utf8_lossy(&b);
    assert_ne!(st, 200, "{text}");
    assert!(text.contains("budget"), "{text}");
    assert_eq!(
        mock.hits(),
        CLIENTS,
        "the refused call never reached the upstream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_calls_of_clients_that_hung_up_are_committed_and_audited() {
    let mock = MockUpstream::start_with_default(
        vec![],
        Answer::ok_chat("late", 50, 51).delay(Duration::from_secs(2)),
    )
    .await;
    let sc = Sidecar::start(&policy(&mock.base_url(), "20s")).await;
    hang_up_early(&sc, &mock, false).await;
    assert_reconciled(&sc, &mock, "ACTUAL").await;
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_whose_clients_hung_up_before_the_first_byte_are_read_for_their_usage() {
    let mock = MockUpstream::start_with_default(
        vec![],
        Answer::sse_chat(
            &["late", " answer"],
            Some((50, 51)),
            Duration::from_millis(5),
        )
        .delay(Duration::from_secs(2)),
    )
    .await;
    let sc = Sidecar::start(&policy(&mock.base_url(), "20s")).await;
    hang_up_early(&sc, &mock, true).await;
    assert_reconciled(&sc, &mock, "ACTUAL").await;
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_ended_at_the_total_timeout() {
    // An endless stream of comment events (no output to count, so the mid-stream guard never
    // trips): only the total timeout can end it once the client stops reading.
    let pad = format!(": {}\n\n", "x".repeat(16 * 1024));
    let mock = MockUpstream::start_with_default(
        vec![],
        Answer::sse_repeat(pad, 1_000_000, Duration::ZERO),
    )
    .await;
    let sc = Sidecar::start(&policy(&mock.base_url(), "1500ms")).await;
    let mut s = TcpStream::connect(sc.running.addr).await.expect("connect");
    s.write_all(&raw_request(&chat(true))).await.expect("write");
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.expect("status line");
    assert_eq!(&head, b"HTTP/1.1 200");
    // Stop reading (the socket stays open): the reservation must not outlive `total`.
    let started = Instant::now();
    let recs = wait_records(&sc, 1).await;
    assert_eq!(recs.len(), 1, "the stalled call was settled and audited");
    let r = &recs[0];
    assert_eq!(r["usage_evidence_state"], "PARTIAL", "{r}");
    // Ended by the pump (the client's window stayed full) or by the stream's own deadline.
    let err = r["error"].as_str().unwrap_or("");
    assert!(
        err.contains("stopped reading") || err.contains("total timeout"),
        "{r}"
    );
    // Nothing was seen of the usage: the reserved worst case (60 output tokens) is committed.
    assert_eq!(r["actual_output_tokens"], 60, "{r}");
    assert_eq!(sc.ledger().reserved_tokens(), 0);
    assert!(started.elapsed() < Duration::from_secs(15));
    drop(s);
    sc.stop().await;
}
