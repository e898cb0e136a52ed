//! Provider translation costs (issue 5): an OpenAI request rewritten for each kind, a native
//! buffered answer turned into a `chat.completion`, and a 200-event native stream turned into
//! OpenAI chunks.
//!   cargo bench --bench providers

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use serde_json::{json, Map, Value};
use tollgate::estimate::Endpoint;
use tollgate::policy::BackendKind;
use tollgate::providers::{for_kind, BuildCtx, Envelope};

fn body() -> Map<String, Value> {
    let history: Vec<Value> = (0..20)
        .map(|i| {
            json!({"role": if i % 2 == 0 { "user" } else { "assistant" },
                   "content": format!("message {i}: {}", "lorem ipsum dolor sit amet ".repeat(8))})
        })
        .collect();
    let mut messages = vec![json!({"role": "system", "content": "Be brief."})];
    messages.extend(history);
    json!({"model": "chat", "messages": messages, "max_tokens": 256, "temperature": 0.7, "stop": ["\n\n"]})
        .as_object()
        .cloned()
        .unwrap()
}

fn env() -> Envelope {
    Envelope {
        id: "chatcmpl-bench".into(),
        model: "m".into(),
        created: 1,
        endpoint: Endpoint::Chat,
        // The common case: the client did not ask for the usage chunk.
        usage_nulls: false,
    }
}

fn anthropic_stream(n: usize) -> Vec<u8> {
    let mut s = String::from("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n");
    for i in 0..n {
        s.push_str(&format!("event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"word{i} \"}}}}\n\n"));
    }
    s.push_str("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":200}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    s.into_bytes()
}

fn gemini_stream(n: usize) -> Vec<u8> {
    let mut s = String::new();
    for i in 0..n {
        s.push_str(&format!("data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"word{i} \"}}],\"role\":\"model\"}},\"index\":0}}],\"usageMetadata\":{{\"promptTokenCount\":9,\"candidatesTokenCount\":{i},\"totalTokenCount\":{}}}}}\r\n\r\n", i + 9));
    }
    s.into_bytes()
}

fn ollama_stream(n: usize) -> Vec<u8> {
    let mut s = String::new();
    for i in 0..n {
        s.push_str(&format!("{{\"model\":\"m\",\"message\":{{\"role\":\"assistant\",\"content\":\"word{i} \"}},\"done\":false}}\n"));
    }
    s.push_str("{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,\"done_reason\":\"stop\",\"prompt_eval_count\":26,\"eval_count\":200}\n");
    s.into_bytes()
}

fn requests(c: &mut Criterion) {
    let b = tollgate::providers::RequestBody::from(body());
    let mut g = c.benchmark_group("request");
    for kind in [
        BackendKind::Openai,
        BackendKind::Anthropic,
        BackendKind::Gemini,
        BackendKind::Ollama,
    ] {
        let p = for_kind(kind);
        g.bench_function(kind.as_str(), |bench| {
            bench.iter(|| {
                p.request(&BuildCtx {
                    base_url: "http://up",
                    endpoint: Endpoint::Chat,
                    body: &b,
                    raw: None,
                    model: "m",
                    max_output_tokens: 256,
                    output_cap_field: None,
                    stream: false,
                    add_include_usage: false,
                })
                .unwrap()
            })
        });
    }
    g.finish();
}

fn responses(c: &mut Criterion) {
    let text = "lorem ipsum ".repeat(50);
    let cases = [
        (
            BackendKind::Anthropic,
            json!({"content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "usage": {"input_tokens": 10, "output_tokens": 100}}),
        ),
        (
            BackendKind::Gemini,
            json!({"candidates": [{"content": {"parts": [{"text": text}], "role": "model"}, "finishReason": "STOP"}], "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 100}}),
        ),
        (
            BackendKind::Ollama,
            json!({"message": {"role": "assistant", "content": text}, "done": true, "prompt_eval_count": 10, "eval_count": 100}),
        ),
    ];
    let mut g = c.benchmark_group("response");
    for (kind, v) in cases {
        let bytes = v.to_string().into_bytes();
        let p = for_kind(kind);
        g.bench_function(kind.as_str(), |bench| {
            bench.iter(|| p.response(&bytes, &env()).unwrap())
        });
    }
    g.finish();
}

fn streams(c: &mut Criterion) {
    let mut g = c.benchmark_group("stream_200_events");
    g.throughput(Throughput::Elements(200));
    for (kind, native) in [
        (BackendKind::Anthropic, anthropic_stream(200)),
        (BackendKind::Gemini, gemini_stream(200)),
        (BackendKind::Ollama, ollama_stream(200)),
    ] {
        let p = for_kind(kind);
        // Frames of ~1 KB, as a provider's stream arrives.
        g.bench_function(kind.as_str(), |bench| {
            bench.iter_batched(
                || p.stream(env()).unwrap(),
                |mut t| {
                    let mut out = Vec::with_capacity(native.len() * 2);
                    for frame in native.chunks(1024) {
                        t.feed(frame, &mut out);
                    }
                    t.finish(&mut out);
                    out
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, requests, responses, streams);
criterion_main!(benches);
