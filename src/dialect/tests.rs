use super::render::{Meta, StreamRender};
use super::*;
use serde_json::json;

fn found(method: Method, path: &str, query: Option<&str>) -> Inbound {
    match route(&method, path, query) {
        Some(Routed::Found(i)) => i,
        other => panic!("{path}: {other:?}"),
    }
}

fn meta() -> Meta {
    Meta {
        model: "chat".into(),
        id: "r1".into(),
        created: 1,
        input_estimate: 9,
        stream: true,
        local: false,
        wire: Default::default(),
    }
}

/// The OpenAI SSE a governed stream produces: two text deltas, finish, usage, [DONE].
fn openai_stream() -> Vec<u8> {
    let mut s = String::new();
    for d in [
        json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "He"}, "finish_reason": null}]}),
        json!({"choices": [{"index": 0, "delta": {"content": "llo"}, "finish_reason": null}]}),
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        json!({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}),
    ] {
        s.push_str(&format!("data: {d}\n\n"));
    }
    s.push_str("data: [DONE]\n\n");
    s.into_bytes()
}

/// Feeds the stream split at every byte (frames split anywhere) through a renderer.
fn render_split(inb: &Inbound) -> String {
    use crate::stream::{EventSplitter, Splitter};
    let mut r = StreamRender::new(inb, meta()).unwrap();
    let mut split = EventSplitter::default();
    let mut out = Vec::new();
    for b in openai_stream() {
        split.feed(&[b], |ev| r.feed(ev, &mut out));
    }
    r.end(&mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn routes_each_dialect_and_refuses_the_rest_of_its_prefix() {
    assert_eq!(
        found(Method::POST, "/v1/messages", None).dialect,
        Dialect::Anthropic
    );
    let g = found(
        Method::POST,
        "/v1beta/models/my-alias:streamGenerateContent",
        Some("alt=sse&key=k1"),
    );
    assert_eq!(
        (g.dialect, g.op, g.path_stream, g.sse),
        (Dialect::Gemini, Op::Generate, true, true)
    );
    assert_eq!(g.path_model.as_deref(), Some("my-alias"));
    assert_eq!(g.query_key.as_deref(), Some("k1"));
    assert_eq!(found(Method::GET, "/api/tags", None).op, Op::List);
    assert_eq!(
        found(Method::POST, "/v1/responses", None).dialect,
        Dialect::Responses
    );
    assert!(matches!(
        route(&Method::POST, "/api/pull", None),
        Some(Routed::NotFound(Dialect::Ollama))
    ));
    assert!(matches!(
        route(&Method::GET, "/v1/messages", None),
        Some(Routed::MethodNotAllowed(Dialect::Anthropic))
    ));
    assert!(matches!(
        route(&Method::POST, "/v1beta/models/x:predict", None),
        Some(Routed::NotFound(Dialect::Gemini))
    ));
    assert!(route(&Method::POST, "/v2/other", None).is_none());
}

#[test]
fn anthropic_request_becomes_internal_chat() {
    let inb = found(Method::POST, "/v1/messages", None);
    let body = json!({"model": "chat", "max_tokens": 10, "system": "S", "stop_sequences": ["X"],
        "stream": true,
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
          {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]});
    let o = inb.parse(body.to_string().as_bytes()).unwrap();
    assert_eq!(o["messages"][0], json!({"role": "system", "content": "S"}));
    assert_eq!(
        o["messages"][1]["content"][1]["image_url"]["url"],
        "data:image/png;base64,AAAA"
    );
    assert_eq!(
        o["messages"][2]["tool_calls"][0]["function"]["arguments"],
        "{\"a\":1}"
    );
    assert_eq!(o["messages"][3]["role"], "tool");
    assert_eq!(o["stop"], json!(["X"]));
    assert_eq!(
        o["tools"][0]["function"]["parameters"],
        json!({"type": "object"})
    );
    assert_eq!(o["stream_options"]["include_usage"], true);
}

#[test]
fn anthropic_stream_is_the_full_event_sequence() {
    let out = render_split(&found(Method::POST, "/v1/messages", None));
    let names: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert!(
        out.contains(r#""usage":{"input_tokens":7,"output_tokens":2}"#),
        "{out}"
    );
}

#[test]
fn gemini_array_stream_is_valid_json_and_sse_is_not_an_array() {
    let mut inb = found(
        Method::POST,
        "/v1beta/models/chat:streamGenerateContent",
        None,
    );
    let out = render_split(&inb);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let arr = v.as_array().unwrap();
    assert_eq!(
        arr.last().unwrap()["usageMetadata"]["candidatesTokenCount"],
        2
    );
    inb.sse = true;
    let out = render_split(&inb);
    assert!(out.starts_with("data: "), "{out}");
}

#[test]
fn ollama_stream_ends_with_done_and_counts() {
    let out = render_split(&found(Method::POST, "/api/chat", None));
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(
        (
            last["prompt_eval_count"].as_u64(),
            last["eval_count"].as_u64()
        ),
        (Some(7), Some(2))
    );
}

#[test]
fn responses_stream_completes_with_usage_and_stateful_is_flagged() {
    let inb = found(Method::POST, "/v1/responses", None);
    let out = render_split(&inb);
    let last = out
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(v["type"], "response.completed");
    assert_eq!(v["response"]["output"][0]["content"][0]["text"], "Hello");
    assert_eq!(v["response"]["usage"]["output_tokens"], 2);
    let b = inb
        .parse(br#"{"model":"chat","input":"hi","previous_response_id":"resp_1"}"#)
        .unwrap();
    assert!(inb.untranslatable(&b.into()).is_some());
    let b = inb.parse(br#"{"model":"chat","input":"hi"}"#).unwrap();
    assert!(inb.untranslatable(&b.into()).is_none());
}

#[test]
fn error_shapes_keep_the_tollgate_object() {
    let t = json!({"final_action": "DEFER"});
    let a = error_body(Dialect::Anthropic, 429, "m", Some(&t), Some(3));
    assert_eq!(a["error"]["type"], "rate_limit_error");
    assert_eq!(a["tollgate"], t);
    let g = error_body(Dialect::Gemini, 429, "m", Some(&t), Some(3));
    assert_eq!(g["error"]["status"], "RESOURCE_EXHAUSTED");
    assert_eq!(g["error"]["details"][0]["retryDelay"], "3s");
    let o = error_body(Dialect::Ollama, 403, "m", Some(&t), None);
    assert_eq!(o["error"], "m");
    assert_eq!(o["tollgate"], t);
}

#[test]
fn a_responses_refusal_keeps_the_chat_code() {
    let chat = json!({"error": {"message": "m", "type": "insufficient_quota",
                     "code": "hard_budget_exceeded", "param": null, "tollgate": {"final_action": "HARD_STOP"}}});
    let body = chat.to_string();
    let r = render::reshape_error(Dialect::Responses, 403, body.as_bytes(), None);
    assert_eq!(r["error"]["code"], "hard_budget_exceeded", "{r}");
    assert_eq!(r["tollgate"]["final_action"], "HARD_STOP");
    // An error without a code stays without one.
    let r = render::reshape_error(
        Dialect::Responses,
        400,
        br#"{"error":{"message":"x"}}"#,
        None,
    );
    assert!(r["error"]["code"].is_null());
}
