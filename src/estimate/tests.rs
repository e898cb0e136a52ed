//! Unit tests for the estimator: exact counts, the cookbook arithmetic, images and tools here;
//! request fields, every error, completions and embeddings in `tests/requests.rs`. The fast
//! counting path is checked against the library in `pretok.rs`.

use super::count::{self, json_chars, CHARS_PER_TOKEN};
use super::images::{high_detail_tokens, IMAGE_MAX_HIGH_DETAIL_TOKENS, IMAGE_UNKNOWN_SIZE_TOKENS};
use super::*;
use serde_json::{json, Value};

mod requests;

const O: Tokenizer = Tokenizer::O200k;
const C: Tokenizer = Tokenizer::Cl100k;

fn chat(body: Value) -> Estimate {
    match estimate(Endpoint::Chat, &body, O) {
        Ok(e) => e,
        Err(e) => panic!("unexpected error {e:?} for {body}"),
    }
}

fn err(endpoint: Endpoint, body: Value) -> EstimateError {
    match estimate(endpoint, &body, O) {
        Ok(e) => panic!("expected an error for {body}, got {e:?}"),
        Err(e) => e,
    }
}

fn user(content: Value) -> Value {
    json!({"model": "gpt-4o", "messages": [{"role": "user", "content": content}]})
}

/// Prompt tokens of a one-user-message chat whose content costs `content` tokens.
fn one_message(content: u64) -> u64 {
    TOKENS_PER_MESSAGE + count_text(O, "user") + content + REPLY_PRIMING_TOKENS
}

// ---- counting text ----

#[test]
fn known_counts() {
    assert_eq!(count_text(O, "hello world"), 2);
    assert_eq!(count_text(C, "hello world"), 2);
    assert_eq!(count_text(O, "Hello, world!"), 4);
    assert_eq!(count_text(C, "tollgate"), 3);
    assert_eq!(count_text(O, ""), 0);
    assert_eq!(count_output_text(O, "hello world"), 2);
}

#[test]
fn chars_mode_is_ceil_of_chars_over_four() {
    let ch = Tokenizer::Chars;
    assert_eq!(CHARS_PER_TOKEN, 4);
    assert_eq!(count_text(ch, ""), 0);
    assert_eq!(count_text(ch, "abcd"), 1);
    assert_eq!(count_text(ch, "abcde"), 2);
    assert_eq!(count_text(ch, "héllo"), 2); // 5 chars, 6 bytes
    assert_eq!(count_text(ch, "日本語"), 1);
    let e = estimate(Endpoint::Chat, &user(json!("abcdefgh")), ch).expect("estimate");
    assert_eq!(e.input_tokens, 3 + 1 + 2 + 3);
}

#[test]
fn warm_up_builds_each_tokenizer_once() {
    warm_up();
    warm_up();
    warm_up_for(Tokenizer::Chars);
    let (o, c) = (count::ranks_for(O), count::ranks_for(C));
    assert!(o.is_some_and(|r| std::ptr::eq(r, count::ranks_for(O).unwrap_or(r))));
    assert!(c.is_some_and(|r| r.len() == 100_256));
    assert!(o.is_some_and(|r| r.len() == 199_998));
    assert!(count::ranks_for(Tokenizer::Chars).is_none());
}

/// A large text, as in a 100 KB prompt.
fn large_text() -> String {
    "The quick brown fox jumps over the lazy dog; naïve café, 2024. ".repeat(2000)
}

#[test]
fn large_texts_are_counted_off_the_worker_only_on_a_multi_threaded_runtime() {
    let text = large_text();
    let want = count_text(O, &text);
    assert!(
        !count::offloads(text.len()),
        "no runtime: nothing to offload"
    );
    let current = tokio::runtime::Builder::new_current_thread().build();
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build();
    let (Ok(current), Ok(multi)) = (current, multi) else {
        panic!("runtimes")
    };
    // A current-thread runtime counts in place (block_in_place would panic there): the
    // proxy moves a body this large to the blocking pool as a whole instead.
    let got = current.block_on(async { (count::offloads(text.len()), count_text(O, &text)) });
    assert_eq!(got, (false, want));
    let whole = current.block_on(async {
        (
            count::offload_whole(text.len()),
            count::offload_whole(count::OFFLOAD_BYTES - 1),
        )
    });
    assert_eq!(whole, (true, false));
    assert!(
        !count::offload_whole(text.len()),
        "no runtime: nothing to offload"
    );
    let t = text.clone();
    let got = multi.block_on(async move {
        tokio::spawn(async move {
            (
                count::offloads(t.len()),
                count::offloads(count::OFFLOAD_BYTES - 1),
                count_text(O, &t),
                count::offload_whole(t.len()),
            )
        })
        .await
    });
    assert_eq!(got.ok(), Some((true, false, want, false)));
}

// ---- chat: the cookbook arithmetic ----

#[test]
fn message_overhead_arithmetic() {
    let e = chat(user(json!("hello world")));
    assert_eq!(e.input_tokens, 3 + 1 + 2 + 3);
    let named = chat(json!({"model": "m", "messages": [
        {"role": "system", "content": "hello world"},
        {"role": "user", "name": "tollgate", "content": "hello world"},
    ]}));
    assert_eq!(named.input_tokens, (3 + 1 + 2) + (3 + 1 + 2 + 3 + 1) + 3);
}

#[test]
fn cookbook_example_messages_count_124_with_o200k_and_129_with_cl100k() {
    let body = json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English."},
        {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
        {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
        {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage."},
        {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to do better."},
        {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client deliverable."},
    ]});
    assert_eq!(
        estimate(Endpoint::Chat, &body, O).map(|e| e.input_tokens),
        Ok(124)
    );
    assert_eq!(
        estimate(Endpoint::Chat, &body, C).map(|e| e.input_tokens),
        Ok(129)
    );
}

#[test]
fn cookbook_tools_example_counts_101() {
    let body = json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": "You are a helpful assistant that can answer to questions about the weather."},
        {"role": "user", "content": "What's the weather like in San Francisco?"},
    ], "tools": [{"type": "function", "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "unit": {"type": "string", "description": "The unit of temperature to return", "enum": ["celsius", "fahrenheit"]},
        }, "required": ["location"]},
    }}]});
    assert_eq!(chat(body).input_tokens, 101);
}

#[test]
fn tools_functions_and_nested_schemas() {
    let base = chat(user(json!("hi"))).input_tokens;
    let mut body = user(json!("hi"));
    body["functions"] = json!([{"name": "ping", "description": "Ping."}]);
    assert_eq!(
        chat(body.clone()).input_tokens,
        base + 7 + count_text(O, "ping:Ping") + 12
    );
    // A nested property costs at least its flat line plus the JSON of `items`.
    let items = json!({"type": "object", "properties": {"a": {"type": "string"}}});
    body["functions"] = json!([{"name": "f", "parameters": {"properties": {"xs": {"type": "array", "items": items}}}}]);
    let flat = 7 + count_text(O, "f:") + 3 + 3 + count_text(O, "xs:array:") + 12;
    let extra = count_text(O, "items") + count_text(O, &items.to_string());
    assert_eq!(chat(body.clone()).input_tokens, base + flat + extra);
    // A hosted tool is priced by its JSON.
    body["functions"] = Value::Null;
    body["tools"] = json!([{"type": "web_search"}]);
    assert_eq!(
        chat(body).input_tokens,
        base + count_text(O, r#"{"type":"web_search"}"#) + 12
    );
}

#[test]
fn tool_calls_tool_results_and_response_schema() {
    let body = json!({"model": "m", "messages": [
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}});
    let expected = (3
        + count_text(O, "assistant")
        + count_text(O, "get_weather")
        + count_text(O, "{\"city\":\"Paris\"}"))
        + (3 + count_text(O, "tool") + count_text(O, "call_1") + count_text(O, "sunny"))
        + 3
        + count_text(O, r#"{"name":"w","schema":{"type":"object"}}"#);
    assert_eq!(chat(body).input_tokens, expected);
}

// ---- chat: content parts and images ----

#[test]
fn text_parts_and_image_details() {
    let text = |t: &str| json!({"type": "text", "text": t});
    let img = |detail: Value| json!({"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": detail}});
    let parts = json!([text("hello"), text(" world")]);
    assert_eq!(
        chat(user(parts)).input_tokens,
        one_message(count_text(O, "hello") + count_text(O, " world"))
    );
    assert_eq!(
        chat(user(json!([img(json!("low"))]))).input_tokens,
        one_message(85)
    );
    assert_eq!(
        chat(user(json!([img(json!("high"))]))).input_tokens,
        one_message(765)
    );
    assert_eq!(
        chat(user(json!([img(json!("auto"))]))).input_tokens,
        one_message(765)
    );
    assert_eq!(
        chat(user(json!([img(Value::Null)]))).input_tokens,
        one_message(765)
    );
    assert_eq!(IMAGE_UNKNOWN_SIZE_TOKENS, 765);
}

#[test]
fn image_scaling_rules() {
    assert_eq!(high_detail_tokens(1024, 1024), 765);
    assert_eq!(high_detail_tokens(2048, 4096), 1105); // OpenAI's worked example
    assert_eq!(high_detail_tokens(512, 512), 255);
    assert_eq!(high_detail_tokens(100, 30), 255);
    assert_eq!(high_detail_tokens(600, 400), 85 + 2 * 170);
    assert_eq!(high_detail_tokens(0, 10), 765);
    assert_eq!(IMAGE_MAX_HIGH_DETAIL_TOKENS, 1445);
}

fn b64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    while !out.len().is_multiple_of(4) {
        out.push('=');
    }
    out
}

#[test]
fn data_url_images_use_their_real_size() {
    let png = [
        b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".as_slice(),
        &600u32.to_be_bytes(),
        &400u32.to_be_bytes(),
        &[8, 6, 0, 0, 0],
    ]
    .concat();
    let gif = [
        b"GIF89a".as_slice(),
        &100u16.to_le_bytes(),
        &30u16.to_le_bytes(),
        &[0; 20],
    ]
    .concat();
    let mut jpeg = vec![0xFF, 0xD8, 0xFF, 0xE0, 0, 16];
    jpeg.extend_from_slice(b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0");
    jpeg.extend_from_slice(&[0xFF, 0xC0, 0, 17, 8, 0x01, 0x90, 0x02, 0x58, 3]); // 600 wide, 400 high
    let mut webp = b"RIFF\0\0\0\0WEBPVP8X\x0a\0\0\0\0\0\0\0".to_vec();
    webp.extend_from_slice(&[0x57, 0x02, 0x00, 0x8F, 0x01, 0x00]); // 600x400, stored minus one
    for (mime, bytes, expected) in [
        ("png", png, 425),
        ("gif", gif, 255),
        ("jpeg", jpeg, 425),
        ("webp", webp, 425),
    ] {
        let url = format!("data:image/{mime};base64,{}", b64(&bytes));
        let body = user(json!([{"type": "image_url", "image_url": {"url": url}}]));
        assert_eq!(chat(body).input_tokens, one_message(expected), "{mime}");
    }
    let junk =
        user(json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]));
    assert_eq!(chat(junk).input_tokens, one_message(765));
}

#[test]
fn audio_and_unknown_parts_fall_back_to_json_length() {
    let part = json!({"type": "input_audio", "input_audio": {"data": "AAAAAAAA", "format": "wav"}});
    let expected = json_chars(&part).div_ceil(4);
    assert_eq!(json_chars(&part), part.to_string().chars().count() as u64);
    assert_eq!(
        chat(user(json!([part]))).input_tokens,
        one_message(expected)
    );
}
