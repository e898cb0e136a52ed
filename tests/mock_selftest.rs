//! Self-test of the in-process mock upstream in tests/common.

mod common;

use std::time::{Duration, Instant};

use common::mock::{Answer, MockUpstream};
use common::{get, json, post_json, post_json_frames, try_post_json};
use serde_json::json as j;

fn chat_req(model: &str) -> serde_json::Value {
    j!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test]
async fn scripted_order_then_default() {
    let up = MockUpstream::start(vec![
        Answer::ok_chat("first", 3, 4),
        Answer::status(500),
        Answer::ok_completion("legacy", 5, 6),
    ])
    .await;
    let url = format!("{}/chat/completions", up.base_url());

    let (s, h, b) = post_json(&url, &chat_req("gpt-4o"), &[]).await;
    assert_eq!(s, 200);
    assert_eq!(h["content-type"], "application/json");
    let v = json(&b);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "gpt-4o", "model echoes the request");
    assert_eq!(v["choices"][0]["message"]["content"], "first");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["usage"]["total_tokens"], 7);

    let (s, _, b) = post_json(&url, &chat_req("gpt-4o"), &[]).await;
    assert_eq!(s, 500);
    assert_eq!(json(&b)["error"]["type"], "server_error");

    let (s, _, b) = post_json(&url, &j!({"model": "davinci-002", "prompt": "x"}), &[]).await;
    assert_eq!(s, 200);
    let v = json(&b);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "legacy");
    assert_eq!(v["usage"]["total_tokens"], 11);

    for _ in 0..2 {
        let (s, _, b) = post_json(&url, &chat_req("gpt-4.1-mini"), &[]).await;
        assert_eq!(s, 200);
        let v = json(&b);
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["model"], "gpt-4.1-mini");
        assert!(v["usage"]["total_tokens"].as_u64().unwrap() > 0);
    }
    assert_eq!(up.hits(), 5);
    assert_eq!(up.remaining_script(), 0);
}

#[tokio::test]
async fn custom_default_and_no_usage() {
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat_no_usage("x")).await;
    let (s, _, b) = post_json(
        &format!("{}/chat/completions", up.base_url()),
        &chat_req("m"),
        &[],
    )
    .await;
    assert_eq!(s, 200);
    let v = json(&b);
    assert_eq!(v["choices"][0]["message"]["content"], "x");
    assert!(v.get("usage").is_none());
}

#[tokio::test]
async fn headers_and_status() {
    let up = MockUpstream::start(vec![
        Answer::status(429)
            .header("retry-after", "2")
            .header("x-ratelimit-remaining-requests", "0"),
        Answer::json(418, j!({"teapot": true}))
            .header("x-a", "1")
            .header("x-a", "2"),
        Answer::raw(200, "application/json", "{not json").header("content-type", "text/plain"),
        Answer::insufficient_quota(),
    ])
    .await;
    let url = format!("{}/chat/completions", up.base_url());

    let (s, h, b) = post_json(&url, &chat_req("m"), &[]).await;
    assert_eq!(s, 429);
    assert_eq!(h["retry-after"], "2");
    assert_eq!(h["x-ratelimit-remaining-requests"], "0");
    let v = json(&b);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert!(v["error"]["message"].is_string());

    let (s, h, b) = post_json(&url, &chat_req("m"), &[]).await;
    assert_eq!(s, 418);
    assert_eq!(json(&b), j!({"teapot": true}));
    let xa: Vec<_> = h
        .get_all("x-a")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(xa, ["1", "2"]);

    let (s, h, b) = post_json(&url, &chat_req("m"), &[]).await;
    assert_eq!(s, 200);
    assert_eq!(h.get_all("content-type").iter().count(), 1);
    assert_eq!(h["content-type"], "text/plain");
    assert_eq!(&b[..], b"{not json");

    let (s, _, b) = post_json(&url, &chat_req("m"), &[]).await;
    assert_eq!(s, 429);
    assert_eq!(json(&b)["error"]["type"], "insufficient_quota");
}

#[tokio::test]
async fn delay_waits_and_request_is_recorded_first() {
    let up = MockUpstream::start(vec![
        Answer::ok_chat("slow", 1, 1).delay(Duration::from_millis(400))
    ])
    .await;
    let url = format!("{}/chat/completions", up.base_url());
    let t0 = Instant::now();
    let call = tokio::spawn(async move { post_json(&url, &chat_req("m"), &[]).await });
    assert_eq!(up.wait_for_hits(1, Duration::from_secs(5)).await, 1);
    assert!(
        t0.elapsed() < Duration::from_millis(400),
        "recorded before the delay ends"
    );
    assert!(!call.is_finished());
    let (s, _, b) = call.await.unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(400));
    assert_eq!(s, 200);
    assert_eq!(json(&b)["choices"][0]["message"]["content"], "slow");
}

#[tokio::test]
async fn reset_gives_a_client_error_then_server_keeps_working() {
    let up = MockUpstream::start(vec![Answer::reset()]).await;
    let url = format!("{}/chat/completions", up.base_url());
    let t0 = Instant::now();
    let r = try_post_json(&url, &chat_req("m"), &[]).await;
    let err = r.expect_err("expected a connection error");
    eprintln!("reset error: {err}");
    assert!(err.starts_with("request error"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    let (s, _, _) = post_json(&url, &chat_req("m"), &[]).await;
    assert_eq!(s, 200);
    assert_eq!(up.hits(), 2);
}

#[tokio::test]
async fn sse_frames_arrive_over_time() {
    let events: Vec<String> = (0..4).map(|i| format!("data: {{\"n\":{i}}}\n\n")).collect();
    let up = MockUpstream::start(vec![Answer::sse(
        events.clone(),
        Duration::from_millis(150),
    )])
    .await;
    let st = post_json_frames(
        &format!("{}/chat/completions", up.base_url()),
        &chat_req("m"),
        &[],
    )
    .await;
    assert_eq!(st.status, 200);
    assert_eq!(st.headers["content-type"], "text/event-stream");
    assert!(st.error.is_none());
    assert_eq!(st.text(), events.concat());
    assert!(st.frames.len() >= 4, "frames: {:?}", st.frames);
    let first = st.frames.first().unwrap().0;
    let last = st.frames.last().unwrap().0;
    assert!(
        last - first >= Duration::from_millis(400),
        "first {first:?} last {last:?}"
    );
}

#[tokio::test]
async fn sse_chat_with_and_without_usage() {
    let up = MockUpstream::start(vec![
        Answer::sse_chat(&["Hel", "lo"], Some((8, 4)), Duration::from_millis(10)),
        Answer::sse_chat(&["Hel", "lo"], Some((8, 4)), Duration::from_millis(10)),
    ])
    .await;
    let url = format!("{}/chat/completions", up.base_url());

    let mut req = chat_req("gpt-4o");
    req["stream"] = j!(true);
    req["stream_options"] = j!({"include_usage": true});
    let st = post_json_frames(&url, &req, &[]).await;
    let data = st.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| json(d.as_bytes()))
        .collect();
    assert_eq!(chunks.len(), 5, "role, 2 pieces, finish, usage");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "stop");
    assert!(chunks[..4]
        .iter()
        .all(|c| c["usage"].is_null() && c.get("usage").is_some()));
    assert_eq!(chunks[4]["choices"], j!([]));
    assert_eq!(chunks[4]["usage"]["prompt_tokens"], 8);
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 4);
    assert_eq!(chunks[4]["model"], "gpt-4o");
    assert!(st.frames.len() >= 6);

    req.as_object_mut().unwrap().remove("stream_options");
    let st = post_json_frames(&url, &req, &[]).await;
    let data = st.sse_data();
    assert_eq!(data.len(), 5, "role, 2 pieces, finish, [DONE]: {data:?}");
    assert!(data.iter().all(|d| !d.contains("\"usage\"")));
}

#[tokio::test]
async fn aborted_stream_reports_body_error() {
    let up = MockUpstream::start(vec![Answer::sse_chat(
        &["a"],
        Some((1, 1)),
        Duration::from_millis(5),
    )
    .abort_body()])
    .await;
    let st = post_json_frames(
        &format!("{}/chat/completions", up.base_url()),
        &chat_req("m"),
        &[],
    )
    .await;
    assert_eq!(st.status, 200);
    assert!(st.error.is_some(), "expected a body error");
    assert!(st.text().contains("[DONE]"));
}

#[tokio::test]
async fn request_recording() {
    let up = MockUpstream::start(vec![Answer::ok_embedding(4, 9)]).await;
    let body = j!({"model": "text-embedding-3-small", "input": ["a", "b", "c"]});
    let (s, _, b) = post_json(
        &format!("{}/embeddings", up.base_url()),
        &body,
        &[
            ("authorization", "Bearer sk-test"),
            ("x-tollgate-job", "j1"),
        ],
    )
    .await;
    assert_eq!(s, 200);
    let v = json(&b);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().unwrap().len(), 3);
    assert_eq!(v["data"][2]["embedding"].as_array().unwrap().len(), 4);
    assert_eq!(v["usage"], j!({"prompt_tokens": 9, "total_tokens": 9}));

    let (s, _, _) = get(&up.url("/v1/models?limit=2")).await;
    assert_eq!(s, 200);

    let reqs = up.requests();
    assert_eq!(reqs.len(), 2);
    let r = &reqs[0];
    assert_eq!(r.method, http::Method::POST);
    assert_eq!(r.path, "/v1/embeddings");
    assert_eq!(r.header("authorization"), Some("Bearer sk-test"));
    assert_eq!(r.header("x-tollgate-job"), Some("j1"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.json.as_ref(), Some(&body));
    assert_eq!(r.model(), Some("text-embedding-3-small"));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&r.body).unwrap(),
        body
    );
    let last = up.last_request().unwrap();
    assert_eq!(last.method, http::Method::GET);
    assert_eq!(last.path, "/v1/models");
    assert_eq!(last.query.as_deref(), Some("limit=2"));
    assert!(last.json.is_none());
    assert!(last.body.is_empty());
}

#[tokio::test]
async fn keep_alive_reuses_the_connection() {
    let up = MockUpstream::start(vec![]).await;
    let c = common::client();
    let url = format!("{}/chat/completions", up.base_url());
    for _ in 0..3 {
        let (s, _, _) =
            common::try_send_with(&c, http::Method::POST, &url, Some(&chat_req("m")), &[])
                .await
                .unwrap();
        assert_eq!(s, 200);
    }
    let conns: Vec<usize> = up.requests().iter().map(|r| r.conn).collect();
    assert_eq!(conns, [1, 1, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_consume_the_script_once_each() {
    let n = 16;
    let script: Vec<Answer> = (0..n)
        .map(|i| Answer::ok_chat(&format!("a{i}"), 1, 1).delay(Duration::from_millis(50)))
        .collect();
    let up = MockUpstream::start(script).await;
    let url = format!("{}/chat/completions", up.base_url());
    let mut tasks = Vec::new();
    for _ in 0..n {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            post_json(&url, &chat_req("m"), &[]).await
        }));
    }
    let t0 = Instant::now();
    let mut got = Vec::new();
    for t in tasks {
        let (s, _, b) = t.await.unwrap();
        assert_eq!(s, 200);
        got.push(
            json(&b)["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    assert!(
        t0.elapsed() < Duration::from_millis(50 * n as u64),
        "served concurrently"
    );
    got.sort();
    let mut want: Vec<String> = (0..n).map(|i| format!("a{i}")).collect();
    want.sort();
    assert_eq!(got, want);
    assert_eq!(up.hits(), n);
}

#[tokio::test]
async fn shutdown_closes_the_listener() {
    let up = MockUpstream::start(vec![]).await;
    let addr = up.addr();
    up.shutdown().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
