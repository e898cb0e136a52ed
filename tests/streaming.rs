//! Streaming through the real sidecar: pass-through timing, byte-for-byte bodies, usage read
//! from the stream, disconnects, mid-stream failures and the mid-stream guard.

mod common;

use common::mock::{Answer, MockUpstream};
use common::{post_json_frames, Streamed};
use http_body_util::BodyExt;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tollgate::audit::Audit;
use tollgate::ledger::CounterKey;
use tollgate::proxy::Snapshot;
use tollgate::sidecar::{self, Options, Running};
use tollgate::units::Scope;

async fn sidecar(yaml: &str) -> Running {
    let policy = tollgate::policy::from_str(yaml, "test.yaml").expect("policy");
    let snap = Snapshot::build(policy).expect("snapshot");
    let opts = Options {
        listen: Some("127.0.0.1:0".parse().expect("addr")),
        admin_listen: Some("127.0.0.1:0".parse().expect("addr")),
        workers: None,
    };
    sidecar::start(snap, Audit::off(), opts)
        .await
        .expect("start")
}

fn policy(backends: &[(&str, &str)], extra: &str) -> String {
    let mut y = String::from("version: stream-test\nbackends:\n");
    for (id, url) in backends {
        y.push_str(&format!("  - {{id: {id}, kind: openai, base_url: \"{url}\", circuit: {{failure_threshold: 5}}}}\n"));
    }
    y.push_str("routes:\n  - model: chat\n    chain:\n");
    for (id, _) in backends {
        y.push_str(&format!("      - {{backend: {id}, model: m-{id}}}\n"));
    }
    y.push_str("    static_response: \"unavailable\"\n");
    y.push_str("budgets:\n  - {name: per-job, scope: job, hard_tokens: 100000}\n");
    y.push_str(extra);
    y
}

/// Committed tokens on the job counter of the default consumer's job `job`.
fn job_committed(r: &Running, job: &str) -> u64 {
    let key = CounterKey {
        scope: Scope::Job,
        id: tollgate::ledger::job_key("default", job),
        window: None,
    };
    r.app
        .governor
        .ledger
        .get(&key)
        .map(|c| c.committed().tokens)
        .unwrap_or(0)
}

async fn wait_reserved_zero(r: &Running) -> u64 {
    for _ in 0..200 {
        if r.app.governor.ledger.reserved_tokens() == 0 {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    r.app.governor.ledger.reserved_tokens()
}

fn chat(stream_opts: bool) -> serde_json::Value {
    let mut b = json!({"model": "chat", "messages": [{"role": "user", "content": "Say hello world"}],
                       "max_tokens": 50, "stream": true});
    if stream_opts {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

const PIECES: [&str; 10] = [
    "Hel", "lo", " wor", "ld", ",", " how", " are", " you", " to", "day",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_chunk_arrives_long_before_the_last() {
    let every = Duration::from_millis(50);
    let mock =
        MockUpstream::start_with_default(vec![], Answer::sse_chat(&PIECES, Some((9, 10)), every))
            .await;
    let r = sidecar(&policy(&[("a", &mock.base_url())], "")).await;
    let through: Streamed = post_json_frames(
        &format!("http://{}/v1/chat/completions", r.addr),
        &chat(false),
        &[],
    )
    .await;
    let direct: Streamed =
        post_json_frames(&mock.url("/chat/completions"), &chat(false), &[]).await;
    assert_eq!(through.status, 200);
    let (first, last) = (
        through.frames[0].0,
        through.frames.last().expect("frames").0,
    );
    assert!(
        through.frames.len() >= 10,
        "frames arrive separately: {}",
        through.frames.len()
    );
    assert!(
        last - first >= Duration::from_millis(400),
        "spread over the stream: {first:?}..{last:?}"
    );
    assert!(
        first < Duration::from_millis(200),
        "first chunk not held back: {first:?}"
    );
    let ttfb_added = first.saturating_sub(direct.frames[0].0);
    assert!(
        ttfb_added < Duration::from_millis(100),
        "added TTFB {ttfb_added:?}"
    );
    assert_eq!(
        through
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    assert_eq!(
        through
            .headers
            .get("x-tollgate-action")
            .and_then(|v| v.to_str().ok()),
        Some("ALLOW")
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_is_byte_for_byte_with_and_without_include_usage() {
    let every = Duration::from_millis(5);
    let mock =
        MockUpstream::start_with_default(vec![], Answer::sse_chat(&PIECES, Some((9, 10)), every))
            .await;
    let r = sidecar(&policy(&[("a", &mock.base_url())], "")).await;
    let url = format!("http://{}/v1/chat/completions", r.addr);
    for (opts, job) in [(true, "J-with"), (false, "J-without")] {
        // The direct call names the upstream model the sidecar would send.
        let mut direct_body = chat(opts);
        direct_body["model"] = json!("m-a");
        let direct = post_json_frames(&mock.url("/chat/completions"), &direct_body, &[]).await;
        let through = post_json_frames(&url, &chat(opts), &[("x-tollgate-job", job)]).await;
        assert_eq!(through.text(), direct.text(), "include_usage={opts}");
        let has_usage_chunk = through
            .sse_data()
            .iter()
            .any(|d| d.contains("\"choices\":[]"));
        assert_eq!(has_usage_chunk, opts, "usage chunk only when asked for");
        // Usage was read from the stream either way (the sidecar asked for it upstream).
        assert!(mock.last_request().expect("request").include_usage());
        assert_eq!(
            job_committed(&r, job),
            19,
            "9 prompt + 10 completion committed as ACTUAL"
        );
    }
    assert_eq!(wait_reserved_zero(&r).await, 0);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_usage_in_stream_is_counted_by_the_tokenizer() {
    let mock = MockUpstream::start_with_default(
        vec![],
        Answer::sse_chat(&PIECES, None, Duration::from_millis(1)),
    )
    .await;
    let r = sidecar(&policy(&[("a", &mock.base_url())], "")).await;
    let url = format!("http://{}/v1/chat/completions", r.addr);
    let s = post_json_frames(&url, &chat(false), &[("x-tollgate-job", "J-est")]).await;
    assert_eq!(s.status, 200);
    let committed = job_committed(&r, "J-est");
    let est = tollgate::estimate::estimate(
        tollgate::estimate::Endpoint::Chat,
        &chat(false),
        tollgate::policy::Tokenizer::O200k,
    )
    .expect("estimate");
    assert!(
        committed > est.input_tokens,
        "input estimate plus counted output: {committed}"
    );
    assert!(committed <= est.input_tokens + 20, "{committed}");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_disconnects_leave_no_reservation() {
    let mock = MockUpstream::start_with_default(
        vec![],
        Answer::sse_chat(&PIECES, Some((9, 10)), Duration::from_millis(15)),
    )
    .await;
    let r = sidecar(&policy(&[("a", &mock.base_url())], "")).await;
    let url = format!("http://{}/v1/chat/completions", r.addr);
    let mut tasks = Vec::new();
    for i in 0..100u64 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let client = common::client();
            let req = http::Request::post(&url)
                .header("content-type", "application/json")
                .header("x-tollgate-job", format!("D{i}"))
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    chat(false).to_string(),
                )))
                .expect("request");
            let resp = client.request(req).await.expect("response");
            let mut body = resp.into_body();
            // Read a pseudo-random number of frames (0..6), then hang up.
            for _ in 0..(i * 7919 % 6) {
                if body.frame().await.is_none() {
                    break;
                }
            }
            drop(body);
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(
        wait_reserved_zero(&r).await,
        0,
        "every reservation returned"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mid_stream_failure_ends_with_an_error_event_and_counts_against_the_circuit() {
    let broken = Answer::sse_chat(&PIECES, None, Duration::from_millis(5)).abort_body();
    let mock = MockUpstream::start(vec![broken]).await;
    let r = sidecar(&policy(&[("a", &mock.base_url())], "")).await;
    let url = format!("http://{}/v1/chat/completions", r.addr);
    let s = post_json_frames(&url, &chat(false), &[("x-tollgate-job", "J-broken")]).await;
    assert_eq!(s.status, 200, "headers were already sent");
    let last = s.sse_data().last().cloned().unwrap_or_default();
    assert!(
        last.contains("\"error\""),
        "ends with an error event: {last}"
    );
    assert_eq!(mock.hits(), 1, "no fallback after bytes were sent");
    assert!(
        job_committed(&r, "J-broken") > 0,
        "what was seen is committed (PARTIAL)"
    );
    assert_eq!(
        r.app
            .governor
            .circuit(&Arc::from("a"))
            .consecutive_failures(),
        1
    );
    assert_eq!(wait_reserved_zero(&r).await, 0);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_past_the_reservation_is_stopped() {
    // A provider that ignores max_tokens: 400 words for a cap of 5 tokens, no usage.
    let words: Vec<String> = (0..400).map(|i| format!(" word{i}")).collect();
    let pieces: Vec<&str> = words.iter().map(String::as_str).collect();
    let mock = MockUpstream::start(vec![Answer::sse_chat(
        &pieces,
        None,
        Duration::from_millis(1),
    )])
    .await;
    let r = sidecar(&policy(&[("a", &mock.base_url())], "")).await;
    let url = format!("http://{}/v1/chat/completions", r.addr);
    let mut body = chat(false);
    body["max_tokens"] = json!(5);
    let s = post_json_frames(&url, &body, &[("x-tollgate-job", "J-guard")]).await;
    let data = s.sse_data();
    let last = data.last().cloned().unwrap_or_default();
    assert!(
        last.contains("hard_budget_exceeded"),
        "stopped with an error event: {last}"
    );
    assert!(
        data.len() < 100,
        "stopped early, not after 400 chunks: {}",
        data.len()
    );
    assert_eq!(wait_reserved_zero(&r).await, 0);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_before_the_first_byte_fails_over() {
    let down = MockUpstream::start_with_default(vec![], Answer::status(503)).await;
    let up = MockUpstream::start_with_default(
        vec![],
        Answer::sse_chat(&PIECES, Some((9, 10)), Duration::from_millis(1)),
    )
    .await;
    let r = sidecar(&policy(
        &[("a", &down.base_url()), ("b", &up.base_url())],
        "retry: {same_backend_retries: 0}\n",
    ))
    .await;
    let s = post_json_frames(
        &format!("http://{}/v1/chat/completions", r.addr),
        &chat(false),
        &[],
    )
    .await;
    assert_eq!(s.status, 200);
    assert_eq!(
        s.headers
            .get("x-tollgate-backend")
            .and_then(|v| v.to_str().ok()),
        Some("b")
    );
    assert!(s.text().contains("day"));
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_answer_streams_and_refusals_are_plain_json() {
    let r = sidecar(&policy(
        &[("a", "http://127.0.0.1:9/v1")],
        "retry: {same_backend_retries: 0}\n",
    ))
    .await;
    let url = format!("http://{}/v1/chat/completions", r.addr);
    let s = post_json_frames(&url, &chat(false), &[]).await;
    assert_eq!(s.status, 200);
    assert_eq!(
        s.headers.get("content-type").and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    assert_eq!(
        s.headers
            .get("x-tollgate-backend")
            .and_then(|v| v.to_str().ok()),
        Some("static")
    );
    let data = s.sse_data();
    assert!(data[0].contains("unavailable"));
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));

    // A refusal before the first byte is a JSON error, not a stream.
    let mut big = chat(false);
    big["max_tokens"] = json!(200_000);
    let s = post_json_frames(&url, &big, &[]).await;
    assert_eq!(s.status, 403);
    assert_eq!(
        s.headers.get("content-type").and_then(|v| v.to_str().ok()),
        Some("application/json")
    );
    let v = common::json(&s.body());
    assert_eq!(v["tollgate"]["reason_class"], "HARD_BUDGET_EXCEEDED");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_prior_knowledge_is_served() {
    let mock = MockUpstream::start_with_default(vec![], Answer::ok_chat("over h2", 5, 2)).await;
    let r = sidecar(&policy(&[("a", &mock.base_url())], "")).await;
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    let req = http::Request::post(format!("http://{}/v1/chat/completions", r.addr))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("request");
    let resp = client.request(req).await.expect("h2c response");
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let b = resp.into_body().collect().await.expect("body").to_bytes();
    assert!(String::from_utf8_lossy(&b).contains("over h2"));
    r.shutdown().await;
}
