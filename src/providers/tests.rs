use super::*;
use crate::estimate::Endpoint;
use serde_json::json;

/// A test body as the providers read it.
fn rb(m: &Map<String, Value>) -> RequestBody {
    RequestBody::from(m.clone())
}

fn ctx<'a>(body: &'a RequestBody, stream: bool) -> BuildCtx<'a> {
    BuildCtx {
        base_url: "http://up/",
        endpoint: Endpoint::Chat,
        body,
        raw: None,
        model: "native-model",
        max_output_tokens: 321,
        output_cap_field: None,
        stream,
        add_include_usage: false,
    }
}

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap()
}

fn env() -> Envelope {
    Envelope {
        id: "chatcmpl-r1".into(),
        model: "native-model".into(),
        created: 7,
        endpoint: Endpoint::Chat,
        usage_nulls: true,
    }
}

const PNG: &str = "data:image/png;base64,iVBORw0KGgo=";

/// A conversation with everything that needs translating: system and developer messages, an
/// image, a tool the model called, the tool's result and a follow-up.
fn conversation() -> Map<String, Value> {
    obj(json!({
        "model": "chat",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture, and the weather?"},
                {"type": "image_url", "image_url": {"url": PNG}}
            ]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Taipei\"}"}},
                {"id": "call_b", "type": "function", "function": {"name": "time", "arguments": ""}}
            ]},
            {"role": "tool", "tool_call_id": "call_a", "content": "{\"temp\":21}"},
            {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
            {"role": "user", "content": "Thanks"}
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather by city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "required",
        "stop": "END",
        "temperature": 1.7,
        "max_tokens": 5000
    }))
}

/// Feeds a native stream one byte at a time and whole; both must give the same OpenAI events.
fn run_stream(mk: impl Fn() -> Translator, native: &str) -> (Vec<Value>, bool, bool) {
    let mut whole = Vec::new();
    let mut t = mk();
    t.feed(native.as_bytes(), &mut whole);
    t.finish(&mut whole);
    let mut bytewise = Vec::new();
    let mut t2 = mk();
    for b in native.as_bytes() {
        t2.feed(std::slice::from_ref(b), &mut bytewise);
    }
    t2.finish(&mut bytewise);
    assert_eq!(
        String::from_utf8_lossy(&whole),
        String::from_utf8_lossy(&bytewise),
        "splitting the input changed the output"
    );
    let text = String::from_utf8(whole).unwrap();
    let mut done = false;
    let mut events = Vec::new();
    for ev in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = ev
            .strip_prefix("data: ")
            .expect("every event is a data event");
        if data == "[DONE]" {
            done = true;
        } else {
            events.push(serde_json::from_str(data).unwrap());
        }
    }
    (events, done, t.failed())
}

fn streamed_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect()
}

fn usage_chunk(events: &[Value]) -> Option<&Value> {
    events
        .iter()
        .find(|e| e["choices"].as_array().is_some_and(|c| c.is_empty()))
        .map(|e| &e["usage"])
}

// ---- Anthropic ---------------------------------------------------------------------------

#[test]
fn anthropic_request_hoists_system_and_translates_tools_images_and_results() {
    let body = conversation();
    let r = anthropic::Anthropic
        .request(&ctx(&rb(&body), false))
        .unwrap();
    assert_eq!(r.url, "http://up/v1/messages");
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["model"], "native-model");
    assert_eq!(
        v["max_tokens"], 321,
        "the reserved cap, not the client's 5000"
    );
    assert_eq!(v["system"], "Be brief.\n\nUse tools.");
    assert_eq!(v["stop_sequences"], json!(["END"]));
    assert_eq!(v["temperature"], 1.0, "clamped to Anthropic's 0..1");
    assert_eq!(v["tool_choice"], json!({"type": "any"}));
    assert_eq!(v["tools"][0]["name"], "weather");
    assert_eq!(
        v["tools"][0]["input_schema"]["properties"]["city"]["type"],
        "string"
    );
    assert!(v.get("stream").is_none());
    let m = v["messages"].as_array().unwrap();
    let roles: Vec<_> = m.iter().map(|x| x["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "user"], "turns alternate");
    assert_eq!(
        m[0]["content"][1]["source"],
        json!({"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="})
    );
    assert_eq!(
        m[1]["content"][0],
        json!({"type": "tool_use", "id": "call_a", "name": "weather", "input": {"city": "Taipei"}})
    );
    assert_eq!(m[1]["content"][1]["input"], json!({}));
    // Both tool results and the follow-up share one user turn.
    let last = m[2]["content"].as_array().unwrap();
    assert_eq!(
        last[0],
        json!({"type": "tool_result", "tool_use_id": "call_a", "content": "{\"temp\":21}"})
    );
    assert_eq!(last[1]["tool_use_id"], "call_b");
    assert_eq!(last[2], json!({"type": "text", "text": "Thanks"}));

    let s = anthropic::Anthropic
        .request(&ctx(&rb(&body), true))
        .unwrap();
    let v: Value = serde_json::from_slice(&s.body).unwrap();
    assert_eq!(v["stream"], true);
}

#[test]
fn anthropic_refuses_what_it_cannot_express() {
    let body = obj(json!({"model": "m", "n": 2, "messages": [{"role": "user", "content": "x"}]}));
    assert!(anthropic::Anthropic
        .request(&ctx(&rb(&body), false))
        .is_err());
    let bad_args = obj(json!({"model": "m", "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{not json"}}]}]}));
    assert!(anthropic::Anthropic
        .request(&ctx(&rb(&bad_args), false))
        .is_err());
}

#[test]
fn anthropic_response_becomes_a_chat_completion_with_all_input_counted() {
    let native = json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Taipei"}}
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 10, "output_tokens": 20, "cache_creation_input_tokens": 3, "cache_read_input_tokens": 5}
    });
    let out = anthropic::Anthropic
        .response(native.to_string().as_bytes(), &env())
        .unwrap()
        .unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["id"], "chatcmpl-r1");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["content"], "Let me check.");
    let tc = &c["message"]["tool_calls"][0];
    assert_eq!(tc["id"], "toolu_1");
    assert_eq!(tc["function"]["name"], "weather");
    let args: Value = serde_json::from_str(tc["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Taipei"}));
    assert_eq!(
        v["usage"]["prompt_tokens"], 18,
        "input + cache creation + cache read"
    );
    assert_eq!(v["usage"]["completion_tokens"], 20);
    assert_eq!(v["usage"]["total_tokens"], 38);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 5);

    for (stop, finish) in [
        ("end_turn", "stop"),
        ("max_tokens", "length"),
        ("stop_sequence", "stop"),
    ] {
        let n = json!({"content": [{"type": "text", "text": "x"}], "stop_reason": stop, "usage": {"input_tokens": 1, "output_tokens": 1}});
        let out = anthropic::Anthropic
            .response(n.to_string().as_bytes(), &env())
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], finish, "{stop}");
    }
}

/// A tool call made by Claude, sent back by the client with its result, is the same call.
#[test]
fn anthropic_tool_call_round_trip() {
    let native = json!({"content": [{"type": "tool_use", "id": "toolu_9", "name": "weather", "input": {"city": "Oslo", "days": 2}}],
        "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 1}});
    let out = anthropic::Anthropic
        .response(native.to_string().as_bytes(), &env())
        .unwrap()
        .unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    let assistant = v["choices"][0]["message"].clone();
    let body = obj(json!({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        assistant,
        {"role": "tool", "tool_call_id": "toolu_9", "content": "sunny"}
    ]}));
    let r = anthropic::Anthropic
        .request(&ctx(&rb(&body), false))
        .unwrap();
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["messages"][1]["content"][0], native["content"][0]);
    assert_eq!(v["messages"][2]["content"][0]["tool_use_id"], "toolu_9");
}

const ANTHROPIC_STREAM: &str = "event: message_start\n\
data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":25,\"cache_read_input_tokens\":5,\"output_tokens\":1}}}\n\n\
event: ping\ndata: {\"type\":\"ping\"}\n\n\
event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" world\"}}\n\n\
event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"weather\",\"input\":{}}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"city\\\": \"}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\\\"Paris\\\"}\"}}\n\n\
event: something_new\ndata: {\"type\":\"something_new\",\"x\":1}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\"},\"usage\":{\"output_tokens\":9}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{},\"usage\":{\"output_tokens\":12}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

#[test]
fn anthropic_stream_becomes_openai_chunks_with_the_last_cumulative_usage() {
    let (events, done, failed) = run_stream(
        || anthropic::Anthropic.stream(env()).unwrap(),
        ANTHROPIC_STREAM,
    );
    assert!(done && !failed);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(events
        .iter()
        .all(|e| e["object"] == "chat.completion.chunk" && e["id"] == "chatcmpl-r1"));
    assert_eq!(streamed_text(&events), "Hello world");
    let args: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(args, "{\"city\": \"Paris\"}");
    let first_tool = events
        .iter()
        .find(|e| e["choices"][0]["delta"]["tool_calls"][0]["id"].is_string())
        .unwrap();
    assert_eq!(
        first_tool["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
        "weather"
    );
    assert!(events
        .iter()
        .any(|e| e["choices"][0]["finish_reason"] == "tool_calls"));
    let u = usage_chunk(&events).expect("a usage chunk");
    assert_eq!(u["prompt_tokens"], 30);
    assert_eq!(
        u["completion_tokens"], 12,
        "cumulative: the last, not the sum"
    );
}

#[test]
fn anthropic_error_event_after_200_fails_the_stream() {
    let native = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n\
event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
    let (events, done, failed) = run_stream(|| anthropic::Anthropic.stream(env()).unwrap(), native);
    assert!(failed && !done);
    assert_eq!(events.last().unwrap()["error"]["type"], "overloaded_error");
    assert!(usage_chunk(&events).is_none());
}

#[test]
fn anthropic_error_bodies_become_openai_errors() {
    let b = br#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: too big"}}"#;
    let out = anthropic::Anthropic.error_body(400, b).unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["error"]["message"], "max_tokens: too big");
    assert_eq!(v["error"]["type"], "invalid_request_error");
}

// ---- Gemini ------------------------------------------------------------------------------

#[test]
fn gemini_request_uses_contents_roles_system_instruction_and_generation_config() {
    let body = conversation();
    let r = gemini::Gemini.request(&ctx(&rb(&body), false)).unwrap();
    assert_eq!(r.url, "http://up/models/native-model:generateContent");
    let s = gemini::Gemini.request(&ctx(&rb(&body), true)).unwrap();
    assert_eq!(
        s.url,
        "http://up/models/native-model:streamGenerateContent?alt=sse"
    );
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        v["systemInstruction"]["parts"],
        json!([{"text": "Be brief."}, {"text": "Use tools."}])
    );
    let g = &v["generationConfig"];
    assert_eq!(g["maxOutputTokens"], 321);
    assert_eq!(g["stopSequences"], json!(["END"]));
    assert_eq!(g["temperature"], 1.7);
    assert_eq!(v["tools"][0]["functionDeclarations"][0]["name"], "weather");
    assert_eq!(v["toolConfig"]["functionCallingConfig"]["mode"], "ANY");
    let c = v["contents"].as_array().unwrap();
    let roles: Vec<_> = c.iter().map(|x| x["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "model", "user"]);
    assert_eq!(
        c[0]["parts"][1],
        json!({"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}})
    );
    assert_eq!(
        c[1]["parts"][0],
        json!({"functionCall": {"name": "weather", "args": {"city": "Taipei"}}})
    );
    assert_eq!(
        c[2]["parts"][0],
        json!({"functionResponse": {"name": "weather", "response": {"temp": 21}}})
    );
    assert_eq!(
        c[2]["parts"][1],
        json!({"functionResponse": {"name": "time", "response": {"content": "noon"}}})
    );
    assert_eq!(c[2]["parts"][2], json!({"text": "Thanks"}));
}

#[test]
fn gemini_response_counts_thoughts_as_output_and_maps_blocked_prompts() {
    let native = json!({
        "candidates": [{"content": {"role": "model", "parts": [
            {"text": "thinking...", "thought": true}, {"text": "Hi "}, {"text": "there"}]},
            "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 11, "candidatesTokenCount": 4, "thoughtsTokenCount": 30, "totalTokenCount": 45}
    });
    let out = gemini::Gemini
        .response(native.to_string().as_bytes(), &env())
        .unwrap()
        .unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hi there");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"], 11);
    assert_eq!(v["usage"]["completion_tokens"], 34, "candidates + thoughts");
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        30
    );

    let blocked = json!({"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": {"promptTokenCount": 7, "totalTokenCount": 7}});
    let out = gemini::Gemini
        .response(blocked.to_string().as_bytes(), &env())
        .unwrap()
        .unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "content_filter");
    assert_eq!(v["choices"][0]["message"]["content"], "");
    assert_eq!(v["usage"]["prompt_tokens"], 7);

    let call = json!({"candidates": [{"content": {"parts": [{"functionCall": {"name": "weather", "args": {"city": "Rome"}}}]}, "finishReason": "STOP"}]});
    let out = gemini::Gemini
        .response(call.to_string().as_bytes(), &env())
        .unwrap()
        .unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Rome\"}"
    );
}

#[test]
fn gemini_stream_keeps_the_last_running_total_and_ends_without_done_marker() {
    let native = "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"One\"}],\"role\":\"model\"},\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":9,\"candidatesTokenCount\":1,\"totalTokenCount\":10}}\r\n\r\n\
data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\" two\"}],\"role\":\"model\"},\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":9,\"candidatesTokenCount\":2,\"totalTokenCount\":11}}\r\n\r\n\
data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\" three\"}],\"role\":\"model\"},\"finishReason\":\"STOP\",\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":9,\"candidatesTokenCount\":3,\"thoughtsTokenCount\":5,\"totalTokenCount\":17}}\r\n\r\n";
    let (events, done, failed) = run_stream(|| gemini::Gemini.stream(env()).unwrap(), native);
    assert!(done && !failed);
    assert_eq!(streamed_text(&events), "One two three");
    // The client asked for usage: content chunks carry `"usage": null`, as OpenAI's do;
    // otherwise they carry no usage key at all, and only the final chunk has usage.
    let content = &events[1];
    assert!(content["usage"].is_null() && content.get("usage").is_some());
    let quiet = Envelope {
        usage_nulls: false,
        ..env()
    };
    let (bare, _, _) = run_stream(|| gemini::Gemini.stream(quiet.clone()).unwrap(), native);
    assert_eq!(streamed_text(&bare), "One two three");
    assert!(bare[..bare.len() - 1]
        .iter()
        .all(|e| e.get("usage").is_none()));
    assert_eq!(usage_chunk(&bare), usage_chunk(&events));
    let u = usage_chunk(&events).unwrap();
    assert_eq!(u["prompt_tokens"], 9);
    assert_eq!(
        u["completion_tokens"], 8,
        "last running total: 3 candidates + 5 thoughts"
    );

    // Cut before any finish reason: no usage chunk, no [DONE] (the meter calls it partial).
    let cut: String = native
        .split("\r\n\r\n")
        .take(2)
        .collect::<Vec<_>>()
        .join("\r\n\r\n");
    let (events, done, _) = run_stream(|| gemini::Gemini.stream(env()).unwrap(), &cut);
    assert!(!done);
    assert!(usage_chunk(&events).is_none());
}

#[test]
fn gemini_errors_give_retry_info_and_per_day_quota_is_a_long_outage() {
    let per_minute = br#"{"error":{"code":429,"message":"Resource exhausted","status":"RESOURCE_EXHAUSTED","details":[
        {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier"}]},
        {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"22.5s"}]}}"#;
    let h = gemini::Gemini.error_hint(429, per_minute, 0);
    assert_eq!(
        h,
        ErrorHint {
            delay_ms: Some(22_500),
            long_outage: false
        }
    );

    let per_day = br#"{"error":{"code":429,"message":"Resource exhausted","status":"RESOURCE_EXHAUSTED","details":[
        {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier"}]},
        {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"40s"}]}}"#;
    // 2026-11-30T20:00:00Z is 12:00 in Los Angeles: twelve hours to the reset.
    let now = jiff::Timestamp::from_second(1_796_155_200)
        .unwrap()
        .as_millisecond();
    let h = gemini::Gemini.error_hint(429, per_day, now);
    assert!(h.long_outage);
    assert_eq!(h.delay_ms, Some(12 * 3_600_000));
}

#[test]
fn anthropic_and_ollama_bodies_are_not_read_with_geminis_parser() {
    let per_day = br#"{"error":{"code":429,"details":[
        {"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaId":"RequestsPerDay"}]},
        {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"40s"}]}}"#;
    assert!(gemini::Gemini.error_hint(429, per_day, 0).long_outage);
    assert_eq!(
        anthropic::Anthropic.error_hint(429, per_day, 0),
        ErrorHint::default()
    );
    assert_eq!(
        ollama::Ollama.error_hint(429, per_day, 0),
        ErrorHint::default()
    );
}

// ---- Ollama ------------------------------------------------------------------------------

#[test]
fn ollama_request_always_caps_and_states_stream() {
    let body = conversation();
    let r = ollama::Ollama.request(&ctx(&rb(&body), false)).unwrap();
    assert_eq!(r.url, "http://up/api/chat");
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["stream"], false, "Ollama streams unless told not to");
    assert_eq!(
        v["options"]["num_predict"], 321,
        "Ollama's default is unlimited"
    );
    assert_eq!(v["options"]["stop"], json!(["END"]));
    assert_eq!(v["options"]["temperature"], 1.7);
    let m = v["messages"].as_array().unwrap();
    assert_eq!(m[1]["role"], "system", "developer is system for Ollama");
    assert_eq!(m[2]["images"], json!(["iVBORw0KGgo="]));
    assert_eq!(
        m[3]["tool_calls"][0]["function"]["arguments"],
        json!({"city": "Taipei"})
    );
    assert_eq!(m[4]["role"], "tool");
    assert_eq!(v["tools"][0]["function"]["name"], "weather");
    let s = ollama::Ollama.request(&ctx(&rb(&body), true)).unwrap();
    let v: Value = serde_json::from_slice(&s.body).unwrap();
    assert_eq!(v["stream"], true);
}

#[test]
fn ollama_response_and_ndjson_stream() {
    let native = json!({"model": "llama3.2", "message": {"role": "assistant", "content": "Hey"},
        "done": true, "done_reason": "length", "prompt_eval_count": 26, "eval_count": 282});
    let out = ollama::Ollama
        .response(native.to_string().as_bytes(), &env())
        .unwrap()
        .unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hey");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 26);
    assert_eq!(v["usage"]["completion_tokens"], 282);

    let stream = "{\"model\":\"llama3.2\",\"message\":{\"role\":\"assistant\",\"content\":\"The\"},\"done\":false}\n\
{\"model\":\"llama3.2\",\"message\":{\"role\":\"assistant\",\"content\":\" sky\"},\"done\":false}\n\
{\"model\":\"llama3.2\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,\"done_reason\":\"stop\",\"prompt_eval_count\":26,\"eval_count\":2,\"total_duration\":488358}\n";
    let (events, done, failed) = run_stream(|| ollama::Ollama.stream(env()).unwrap(), stream);
    assert!(done && !failed);
    assert_eq!(streamed_text(&events), "The sky");
    assert!(events
        .iter()
        .any(|e| e["choices"][0]["finish_reason"] == "stop"));
    let u = usage_chunk(&events).unwrap();
    assert_eq!(
        (u["prompt_tokens"].as_u64(), u["completion_tokens"].as_u64()),
        (Some(26), Some(2))
    );

    let broken =
        "{\"message\":{\"content\":\"a\"},\"done\":false}\n{\"error\":\"model runner crashed\"}\n";
    let (events, done, failed) = run_stream(|| ollama::Ollama.stream(env()).unwrap(), broken);
    assert!(failed && !done);
    assert_eq!(
        events.last().unwrap()["error"]["message"],
        "model runner crashed"
    );
}

#[test]
fn ollama_missing_model_is_an_openai_404() {
    let out = ollama::Ollama
        .error_body(404, br#"{"error":"model 'x' not found"}"#)
        .unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["message"], "model 'x' not found");
}

// ---- OpenAI ------------------------------------------------------------------------------

#[test]
fn openai_keeps_the_body_and_sets_model_and_cap() {
    let body = obj(
        json!({"model": "chat", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9000, "seed": 1}),
    );
    let r = openai::OpenAi.request(&ctx(&rb(&body), false)).unwrap();
    assert_eq!(r.url, "http://up/chat/completions");
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["model"], "native-model");
    assert_eq!(v["max_completion_tokens"], 321);
    assert_eq!(v["seed"], 1);
    assert!(openai::OpenAi.stream(env()).is_none());
    assert!(openai::OpenAi.response(b"{}", &env()).unwrap().is_none());
}

#[test]
fn data_uris_parse() {
    assert_eq!(parse_data_uri(PNG), Some(("image/png", "iVBORw0KGgo=")));
    assert_eq!(parse_data_uri("https://x/y.png"), None);
    assert_eq!(parse_data_uri("data:text/plain,hello"), None);
}

#[test]
fn ollama_embeddings_translate_both_ways() {
    let body = rb(&obj(
        json!({"model": "embed", "input": ["alpha", "beta"], "dimensions": 3}),
    ));
    let mut c = ctx(&body, false);
    c.endpoint = Endpoint::Embeddings;
    let r = ollama::Ollama.request(&c).unwrap();
    assert_eq!(r.url, "http://up/api/embed");
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        v,
        json!({"model": "native-model", "input": ["alpha", "beta"], "dimensions": 3})
    );

    let tokens = rb(&obj(json!({"model": "embed", "input": [[1, 2, 3]]})));
    let mut c = ctx(&tokens, false);
    c.endpoint = Endpoint::Embeddings;
    assert!(
        ollama::Ollama.request(&c).is_err(),
        "token arrays are not text"
    );

    let native =
        json!({"model": "nomic", "embeddings": [[0.1, 0.2], [0.3, 0.4]], "prompt_eval_count": 6});
    let mut e = env();
    e.endpoint = Endpoint::Embeddings;
    let out = ollama::Ollama
        .response(native.to_string().as_bytes(), &e)
        .unwrap()
        .unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(
        v["data"][1],
        json!({"object": "embedding", "index": 1, "embedding": [0.3, 0.4]})
    );
    assert_eq!(v["usage"], json!({"prompt_tokens": 6, "total_tokens": 6}));
}

// ---- Same-format pass-through ------------------------------------------------------------

fn backend(kind: BackendKind, responses_api: bool) -> Backend {
    let mut p = crate::policy::from_str(
        "version: t\nbackends:\n  - {id: b, kind: openai, base_url: 'http://up'}\nroutes:\n  - {model: m, chain: [{backend: b, model: x}]}\n",
        "t.yaml",
    )
    .expect("policy");
    let mut b = p.backends.remove(0);
    b.kind = kind;
    b.responses_api = responses_api;
    b
}

fn pass(format: NativeFormat, raw: &[u8], stream: bool) -> PassCtx<'_> {
    PassCtx {
        base_url: "http://up",
        format,
        raw,
        model: "native-model",
        max_output_tokens: 321,
        stream,
    }
}

fn bytes(v: Value) -> Vec<u8> {
    serde_json::to_vec(&v).unwrap()
}

fn sent(r: &NativeRequest) -> Value {
    serde_json::from_slice(&r.body).unwrap()
}

#[test]
fn each_kind_speaks_only_its_own_format() {
    use NativeFormat::*;
    let formats = [
        AnthropicMessages,
        GeminiGenerate,
        OllamaChat,
        OllamaGenerate,
        OllamaEmbed,
        OpenAiResponses,
    ];
    let speaks = |kind, responses_api| {
        let b = backend(kind, responses_api);
        formats
            .into_iter()
            .filter(|f| for_kind(kind).speaks(*f, &b))
            .collect::<Vec<_>>()
    };
    assert_eq!(speaks(BackendKind::Anthropic, false), [AnthropicMessages]);
    assert_eq!(speaks(BackendKind::Gemini, false), [GeminiGenerate]);
    assert_eq!(
        speaks(BackendKind::Ollama, false),
        [OllamaChat, OllamaGenerate, OllamaEmbed]
    );
    assert!(speaks(BackendKind::Openai, false).is_empty());
    assert_eq!(speaks(BackendKind::Openai, true), [OpenAiResponses]);
}

#[test]
fn pass_through_changes_only_model_and_cap() {
    let body = bytes(
        json!({"model": "chat", "max_tokens": 10, "metadata": {"user_id": "u"},
        "x": {"a": [1, {"b": "c"}]}, "messages": [{"role": "user", "content": "hi"}]}),
    );
    let r = anthropic::Anthropic
        .pass_through(&pass(NativeFormat::AnthropicMessages, &body, false))
        .unwrap();
    assert_eq!(r.url, "http://up/v1/messages");
    let mut want: Value = serde_json::from_slice(&body).unwrap();
    want["model"] = json!("native-model");
    want["max_tokens"] = json!(321);
    assert_eq!(sent(&r), want);

    let body = bytes(json!({"contents": [], "generationConfig": {"temperature": 0.1}, "x": 1}));
    let r = gemini::Gemini
        .pass_through(&pass(NativeFormat::GeminiGenerate, &body, true))
        .unwrap();
    assert_eq!(
        r.url,
        "http://up/models/native-model:streamGenerateContent?alt=sse"
    );
    assert_eq!(
        sent(&r),
        json!({"contents": [], "generationConfig": {"temperature": 0.1, "maxOutputTokens": 321}, "x": 1})
    );

    let body = bytes(json!({"model": "chat", "prompt": "p", "options": {"seed": 3}}));
    let r = ollama::Ollama
        .pass_through(&pass(NativeFormat::OllamaGenerate, &body, true))
        .unwrap();
    assert_eq!(r.url, "http://up/api/generate");
    assert_eq!(
        sent(&r),
        json!({"model": "native-model", "prompt": "p", "options": {"seed": 3, "num_predict": 321}})
    );
    let body = bytes(json!({"model": "chat", "input": ["a"], "truncate": false}));
    let r = ollama::Ollama
        .pass_through(&pass(NativeFormat::OllamaEmbed, &body, false))
        .unwrap();
    assert_eq!(r.url, "http://up/api/embed");
    assert_eq!(
        sent(&r),
        json!({"model": "native-model", "input": ["a"], "truncate": false})
    );

    let body = bytes(json!({"model": "chat", "input": "hi", "store": true}));
    let r = openai::OpenAi
        .pass_through(&pass(NativeFormat::OpenAiResponses, &body, false))
        .unwrap();
    assert_eq!(r.url, "http://up/responses");
    assert_eq!(
        sent(&r),
        json!({"model": "native-model", "input": "hi", "store": true, "max_output_tokens": 321})
    );
    // The members the edit does not name keep their bytes: key order, number spelling.
    let raw = br#"{"model":"chat","x_custom": {"z": 1, "a": [2.50, 1e3]},"max_tokens":9}"#;
    let r = anthropic::Anthropic
        .pass_through(&pass(NativeFormat::AnthropicMessages, raw, false))
        .unwrap();
    assert_eq!(
        std::str::from_utf8(&r.body).unwrap(),
        r#"{"model":"native-model","x_custom":{"z": 1, "a": [2.50, 1e3]},"max_tokens":321}"#
    );
}

#[test]
fn a_responses_answer_and_stream_are_read_for_usage() {
    let answer = json!({"object": "response", "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi."}]}],
        "usage": {"input_tokens": 11, "output_tokens": 7,
                  "input_tokens_details": {"cached_tokens": 4}}});
    let b = openai::OpenAi
        .pass_answer(
            NativeFormat::OpenAiResponses,
            answer.to_string().as_bytes(),
            &env(),
        )
        .unwrap();
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hi.");
    assert_eq!(v["usage"]["prompt_tokens"], 11);
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 4);

    let ev = |v: Value| format!("event: {}\ndata: {v}\n\n", v["type"].as_str().unwrap());
    let mut native = ev(json!({"type": "response.created", "response": {}}));
    native += &ev(json!({"type": "response.output_text.delta", "delta": "He"}));
    native += &ev(json!({"type": "response.output_text.delta", "delta": "y"}));
    let cut = native.clone();
    native += &ev(
        json!({"type": "response.completed", "response": {"usage": {"input_tokens": 5, "output_tokens": 2}}}),
    );
    let mk = || {
        openai::OpenAi
            .pass_stream(NativeFormat::OpenAiResponses, env())
            .unwrap()
    };
    let (events, done, failed) = run_stream(mk, &native);
    assert!(done && !failed);
    assert_eq!(streamed_text(&events), "Hey");
    let u = usage_chunk(&events).unwrap();
    assert_eq!(
        (u["prompt_tokens"].as_u64(), u["completion_tokens"].as_u64()),
        (Some(5), Some(2))
    );
    // Cut before `response.completed`: a failed stream (PARTIAL, an upstream failure).
    let (_, done, failed) = run_stream(mk, &cut);
    assert!(!done && failed);
}
