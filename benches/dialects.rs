//! Inbound dialect translation costs (issue 13): one request parsed into the internal form per
//! dialect (against plain JSON parsing of the same-sized OpenAI body, the cost an OpenAI
//! request already pays), and one stream event rendered per dialect.
//!   cargo bench --bench dialects

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use http::Method;
use serde_json::{json, Value};
use tollgate::dialect::render::Meta;
use tollgate::dialect::{route, Inbound, Routed, StreamRender};

fn inbound(method: Method, path: &str) -> Inbound {
    match route(&method, path, None) {
        Some(Routed::Found(i)) => i,
        _ => unreachable!("bench paths are dialect endpoints"),
    }
}

fn history() -> Vec<(String, String)> {
    (0..20)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            (
                role.to_string(),
                format!("message {i}: {}", "lorem ipsum dolor sit amet ".repeat(8)),
            )
        })
        .collect()
}

/// The same 21-message conversation in each dialect's request shape.
fn bodies() -> Vec<(&'static str, Inbound, Vec<u8>)> {
    let h = history();
    let chat: Vec<Value> = h
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c}))
        .collect();
    let gemini: Vec<Value> = h
        .iter()
        .map(|(r, c)| json!({"role": if r == "assistant" { "model" } else { "user" }, "parts": [{"text": c}]}))
        .collect();
    let items: Vec<Value> = h
        .iter()
        .map(|(r, c)| json!({"role": r, "content": [{"type": if r == "user" { "input_text" } else { "output_text" }, "text": c}]}))
        .collect();
    let mut openai_msgs = vec![json!({"role": "system", "content": "Be brief."})];
    openai_msgs.extend(chat.clone());
    vec![
        ("openai", Inbound::openai(), json!({"model": "chat", "messages": openai_msgs, "max_tokens": 256}).to_string().into_bytes()),
        ("anthropic", inbound(Method::POST, "/v1/messages"),
         json!({"model": "chat", "system": "Be brief.", "messages": chat, "max_tokens": 256}).to_string().into_bytes()),
        ("gemini", inbound(Method::POST, "/v1beta/models/chat:generateContent"),
         json!({"systemInstruction": {"parts": [{"text": "Be brief."}]}, "contents": gemini,
                "generationConfig": {"maxOutputTokens": 256}}).to_string().into_bytes()),
        ("ollama", inbound(Method::POST, "/api/chat"),
         json!({"model": "chat", "messages": openai_msgs_clone(&chat), "options": {"num_predict": 256}}).to_string().into_bytes()),
        ("responses", inbound(Method::POST, "/v1/responses"),
         json!({"model": "chat", "instructions": "Be brief.", "input": items, "max_output_tokens": 256}).to_string().into_bytes()),
    ]
}

fn openai_msgs_clone(chat: &[Value]) -> Vec<Value> {
    let mut v = vec![json!({"role": "system", "content": "Be brief."})];
    v.extend(chat.iter().cloned());
    v
}

fn bench_requests(c: &mut Criterion) {
    let mut g = c.benchmark_group("dialect_request");
    for (name, inb, body) in bodies() {
        g.throughput(Throughput::Elements(1));
        g.bench_function(name, |b| b.iter(|| inb.parse(std::hint::black_box(&body))));
    }
    g.finish();
}

fn bench_stream_events(c: &mut Criterion) {
    let chunk = json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "hello world "}, "finish_reason": null}]})
    .to_string()
    .into_bytes();
    let meta = Meta {
        model: "chat".into(),
        id: "bench".into(),
        created: 1,
        input_estimate: 100,
        stream: true,
        local: false,
        wire: Default::default(),
    };
    let mut g = c.benchmark_group("dialect_stream_event");
    g.throughput(Throughput::Elements(1));
    for (name, path) in [
        ("anthropic", "/v1/messages"),
        ("gemini", "/v1beta/models/chat:streamGenerateContent"),
        ("ollama", "/api/chat"),
        ("responses", "/v1/responses"),
    ] {
        let inb = inbound(Method::POST, path);
        let mut r = StreamRender::new(&inb, meta.clone()).expect("a dialect renderer");
        let mut out = Vec::with_capacity(4096);
        g.bench_function(name, |b| {
            b.iter(|| {
                out.clear();
                r.feed(std::hint::black_box(&chunk), &mut out);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_requests, bench_stream_events);
criterion_main!(benches);
