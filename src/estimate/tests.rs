//! Unit tests for the estimator: exact counts, the cookbook arithmetic, images, tools, the
//! request fields, every error, and the fast pre-tokenizer against the library's regex.

use super::count::{json_chars, CHARS_PER_TOKEN};
use super::images::{high_detail_tokens, IMAGE_MAX_HIGH_DETAIL_TOKENS, IMAGE_UNKNOWN_SIZE_TOKENS};
use super::pretok::AsciiSplit;
use super::*;
use serde_json::{json, Value};

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
    assert!(std::ptr::eq(bpe_openai::o200k_base(), bpe_openai::o200k_base()));
    assert!(std::ptr::eq(bpe_openai::cl100k_base(), bpe_openai::cl100k_base()));
}

/// A tiny deterministic generator, so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 16) as usize
    }
    fn text(&mut self, alphabet: &[&str], max_len: usize) -> String {
        let len = self.next() % max_len;
        (0..len).map(|_| alphabet[self.next() % alphabet.len()]).collect()
    }
}

const TRICKY: &[&str] = &[
    "a", "b", "Z", "Q", "e", "s", "l", "L", "r", "E", "t", "D", "0", "7", "42", " ", " ", "  ",
    "\t", "\n", "\r", "\r\n", "\x0B", "\x0C", "\x1C", "\x00", "\x7F", "'", "'s", "'LL", "'re", "'Ve",
    "'d", "'M", ".", ",", "!", "/", "//", "-", "_", "(", "\"", "#", "$", "...", "?\n", " ,", "Hello",
    "world", "HTTP", "don't", "I'm", "ABCdef", "aBC", "x1",
];
const NON_ASCII: &[&str] = &["é", "日本", "—", "’s", "\u{a0}", "\u{2028}", "😀", "ß", "Ünï"];

fn lib(tok: Tokenizer) -> &'static bpe_openai::Tokenizer {
    if tok == O {
        bpe_openai::o200k_base()
    } else {
        bpe_openai::cl100k_base()
    }
}

#[test]
fn ascii_pretokenizer_matches_the_library_regex() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let all_ascii: Vec<String> = (0u8..128).map(|b| char::from(b).to_string()).collect();
    let mut alphabet: Vec<&str> = all_ascii.iter().map(String::as_str).collect();
    alphabet.extend_from_slice(TRICKY);
    for tok in [O, C] {
        for i in 0..6000 {
            let s = rng.text(if i % 2 == 0 { TRICKY } else { &alphabet }, 40);
            let ours: Vec<&str> = AsciiSplit::new(tok, &s).collect();
            let theirs: Vec<&str> = lib(tok).split(&s).collect();
            assert_eq!(ours, theirs, "{tok:?} split of {s:?}");
        }
    }
}

#[test]
fn fast_count_equals_library_count_on_mixed_text() {
    let mut rng = Rng(12345);
    let mut alphabet: Vec<&str> = TRICKY.to_vec();
    alphabet.extend_from_slice(NON_ASCII);
    alphabet.extend_from_slice(&[" word", " Word", "x ", " y"]);
    for tok in [O, C] {
        for max in [60, 3000] {
            for _ in 0..300 {
                let s = rng.text(&alphabet, max);
                assert_eq!(count_text(tok, &s), lib(tok).count(s.as_str()) as u64, "{tok:?} {s:?}");
            }
        }
    }
}

#[test]
fn long_text_with_cache_equals_library_count() {
    let para = "The quick brown fox jumps over the lazy dog's back; it's 2024, naïve café. ";
    let text = para.repeat(200);
    for tok in [O, C] {
        assert_eq!(count_text(tok, &text), lib(tok).count(text.as_str()) as u64);
    }
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
    assert_eq!(estimate(Endpoint::Chat, &body, O).map(|e| e.input_tokens), Ok(124));
    assert_eq!(estimate(Endpoint::Chat, &body, C).map(|e| e.input_tokens), Ok(129));
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
    assert_eq!(chat(body.clone()).input_tokens, base + 7 + count_text(O, "ping:Ping") + 12);
    // A nested property costs at least its flat line plus the JSON of `items`.
    let items = json!({"type": "object", "properties": {"a": {"type": "string"}}});
    body["functions"] = json!([{"name": "f", "parameters": {"properties": {"xs": {"type": "array", "items": items}}}}]);
    let flat = 7 + count_text(O, "f:") + 3 + 3 + count_text(O, "xs:array:") + 12;
    let extra = count_text(O, "items") + count_text(O, &items.to_string());
    assert_eq!(chat(body.clone()).input_tokens, base + flat + extra);
    // A hosted tool is priced by its JSON.
    body["functions"] = Value::Null;
    body["tools"] = json!([{"type": "web_search"}]);
    assert_eq!(chat(body).input_tokens, base + count_text(O, r#"{"type":"web_search"}"#) + 12);
}

#[test]
fn tool_calls_tool_results_and_response_schema() {
    let body = json!({"model": "m", "messages": [
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}});
    let expected = (3 + count_text(O, "assistant") + count_text(O, "get_weather") + count_text(O, "{\"city\":\"Paris\"}"))
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
    assert_eq!(chat(user(parts)).input_tokens, one_message(count_text(O, "hello") + count_text(O, " world")));
    assert_eq!(chat(user(json!([img(json!("low"))]))).input_tokens, one_message(85));
    assert_eq!(chat(user(json!([img(json!("high"))]))).input_tokens, one_message(765));
    assert_eq!(chat(user(json!([img(json!("auto"))]))).input_tokens, one_message(765));
    assert_eq!(chat(user(json!([img(Value::Null)]))).input_tokens, one_message(765));
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
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    while out.len() % 4 != 0 {
        out.push('=');
    }
    out
}

#[test]
fn data_url_images_use_their_real_size() {
    let png = [b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".as_slice(), &600u32.to_be_bytes(), &400u32.to_be_bytes(), &[8, 6, 0, 0, 0]].concat();
    let gif = [b"GIF89a".as_slice(), &100u16.to_le_bytes(), &30u16.to_le_bytes(), &[0; 20]].concat();
    let mut jpeg = vec![0xFF, 0xD8, 0xFF, 0xE0, 0, 16];
    jpeg.extend_from_slice(b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0");
    jpeg.extend_from_slice(&[0xFF, 0xC0, 0, 17, 8, 0x01, 0x90, 0x02, 0x58, 3]); // 600 wide, 400 high
    let mut webp = b"RIFF\0\0\0\0WEBPVP8X\x0a\0\0\0\0\0\0\0".to_vec();
    webp.extend_from_slice(&[0x57, 0x02, 0x00, 0x8F, 0x01, 0x00]); // 600x400, stored minus one
    for (mime, bytes, expected) in [("png", png, 425), ("gif", gif, 255), ("jpeg", jpeg, 425), ("webp", webp, 425)] {
        let url = format!("data:image/{mime};base64,{}", b64(&bytes));
        let body = user(json!([{"type": "image_url", "image_url": {"url": url}}]));
        assert_eq!(chat(body).input_tokens, one_message(expected), "{mime}");
    }
    let junk = user(json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]));
    assert_eq!(chat(junk).input_tokens, one_message(765));
}

#[test]
fn audio_and_unknown_parts_fall_back_to_json_length() {
    let part = json!({"type": "input_audio", "input_audio": {"data": "AAAAAAAA", "format": "wav"}});
    let expected = json_chars(&part).div_ceil(4);
    assert_eq!(json_chars(&part), part.to_string().chars().count() as u64);
    assert_eq!(chat(user(json!([part]))).input_tokens, one_message(expected));
}

// ---- request fields ----

#[test]
fn output_cap_n_stream_and_usage() {
    let e = chat(user(json!("x")));
    assert_eq!((e.max_output_tokens, e.n, e.stream, e.include_usage, e.model.as_str()), (None, 1, false, false, "gpt-4o"));
    let mut body = user(json!("x"));
    body["max_tokens"] = json!(100);
    assert_eq!(chat(body.clone()).max_output_tokens, Some(100));
    body["max_completion_tokens"] = json!(50);
    assert_eq!(chat(body.clone()).max_output_tokens, Some(50));
    body["max_completion_tokens"] = Value::Null;
    assert_eq!(chat(body.clone()).max_output_tokens, Some(100));
    body["n"] = json!(3);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let e = chat(body);
    assert_eq!((e.n, e.stream, e.include_usage), (3, true, true));
}

#[test]
fn chat_errors_name_their_param() {
    use Endpoint::Chat;
    let m = |msgs: Value| json!({"model": "m", "messages": msgs});
    let with = |key: &str, v: Value| {
        let mut b = user(json!("x"));
        b[key] = v;
        b
    };
    let cases: Vec<(Value, Option<&str>, &str)> = vec![
        (json!([1]), None, "invalid_json"),
        (json!({"messages": []}), Some("model"), "missing_required_parameter"),
        (json!({"model": 4, "messages": []}), Some("model"), "invalid_type"),
        (json!({"model": "", "messages": []}), Some("model"), "invalid_type"),
        (json!({"model": "m"}), Some("messages"), "missing_required_parameter"),
        (m(json!("hi")), Some("messages"), "invalid_type"),
        (m(json!([])), Some("messages"), "invalid_value"),
        (m(json!(["hi"])), Some("messages.[0]"), "invalid_type"),
        (m(json!([{"content": "hi"}])), Some("messages.[0].role"), "missing_required_parameter"),
        (m(json!([{"role": 1}])), Some("messages.[0].role"), "invalid_type"),
        (m(json!([{"role": "user", "content": 5}])), Some("messages.[0].content"), "invalid_type"),
        (m(json!([{"role": "user", "content": {"text": "x"}}])), Some("messages.[0].content"), "invalid_type"),
        (m(json!([{"role": "user", "content": ["x"]}])), Some("messages.[0].content.[0]"), "invalid_type"),
        (m(json!([{"role": "user", "content": [{"text": "x"}]}])), Some("messages.[0].content.[0].type"), "missing_required_parameter"),
        (m(json!([{"role": "user", "content": [{"type": "text"}]}])), Some("messages.[0].content.[0].text"), "missing_required_parameter"),
        (m(json!([{"role": "user", "content": [{"type": "text", "text": 1}]}])), Some("messages.[0].content.[0].text"), "invalid_type"),
        (m(json!([{"role": "user", "content": [{"type": "image_url"}]}])), Some("messages.[0].content.[0].image_url"), "missing_required_parameter"),
        (m(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])), Some("messages.[0].content.[0].image_url.url"), "missing_required_parameter"),
        (m(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": 1}}]}])), Some("messages.[0].content.[0].image_url.detail"), "invalid_type"),
        (m(json!([{"role": "user", "name": 7, "content": "x"}])), Some("messages.[0].name"), "invalid_type"),
        (m(json!([{"role": "assistant", "tool_calls": {}}])), Some("messages.[0].tool_calls"), "invalid_type"),
        (with("max_tokens", json!(-1)), Some("max_tokens"), "invalid_value"),
        (with("max_tokens", json!(1.5)), Some("max_tokens"), "invalid_type"),
        (with("max_tokens", json!("10")), Some("max_tokens"), "invalid_type"),
        (with("max_completion_tokens", json!(-5)), Some("max_completion_tokens"), "invalid_value"),
        (with("n", json!(0)), Some("n"), "invalid_value"),
        (with("n", json!(129)), Some("n"), "invalid_value"),
        (with("n", json!(-1)), Some("n"), "invalid_value"),
        (with("n", json!(2.5)), Some("n"), "invalid_type"),
        (with("stream", json!("yes")), Some("stream"), "invalid_type"),
        (with("stream_options", json!(true)), Some("stream_options"), "invalid_type"),
        (with("stream_options", json!({"include_usage": 1})), Some("stream_options.include_usage"), "invalid_type"),
        (with("tools", json!({})), Some("tools"), "invalid_type"),
        (with("tools", json!([3])), Some("tools.[0]"), "invalid_type"),
    ];
    for (body, param, code) in cases {
        let e = err(Chat, body.clone());
        assert_eq!((e.param(), e.code()), (param, code), "{body}");
        if let Some(p) = param {
            assert!(e.to_string().contains(p), "message {e} should name {p}");
        }
    }
    assert_eq!(with("n", json!(128))["n"], 128);
    assert_eq!(chat(with("n", json!(128))).n, 128);
}

// ---- completions ----

fn completions(body: Value) -> Result<Estimate, EstimateError> {
    estimate(Endpoint::Completions, &body, O)
}

#[test]
fn completions_prompt_shapes_and_choices() {
    let e = completions(json!({"model": "m", "prompt": "hello world", "max_tokens": 7})).expect("ok");
    assert_eq!((e.input_tokens, e.max_output_tokens, e.n), (2, Some(7), 1));
    let e = completions(json!({"model": "m", "prompt": ["hello world", "hello"], "n": 2})).expect("ok");
    assert_eq!((e.input_tokens, e.max_output_tokens, e.n), (3, None, 4));
    let e = completions(json!({"model": "m", "prompt": [1, 2, 3], "best_of": 5, "n": 2})).expect("ok");
    assert_eq!((e.input_tokens, e.n), (3, 5));
    let e = completions(json!({"model": "m", "prompt": [[1, 2], [3]], "suffix": "hello world"})).expect("ok");
    assert_eq!((e.input_tokens, e.n), (3 + 2 * 2, 2));
    let e = completions(json!({"model": "m", "stream": true, "stream_options": {"include_usage": true}})).expect("ok");
    assert_eq!((e.input_tokens, e.stream, e.include_usage), (1, true, true));
}

#[test]
fn completions_errors() {
    let cases = [
        (json!({"prompt": "x"}), "model"),
        (json!({"model": "m", "prompt": 5}), "prompt"),
        (json!({"model": "m", "prompt": {"a": 1}}), "prompt"),
        (json!({"model": "m", "prompt": ["a", 1]}), "prompt.[1]"),
        (json!({"model": "m", "prompt": [1, "a"]}), "prompt.[1]"),
        (json!({"model": "m", "prompt": [1, -2]}), "prompt.[1]"),
        (json!({"model": "m", "prompt": [[1], 2]}), "prompt.[1]"),
        (json!({"model": "m", "prompt": [[1], [0.5]]}), "prompt.[1].[0]"),
        (json!({"model": "m", "prompt": "x", "suffix": 3}), "suffix"),
        (json!({"model": "m", "prompt": "x", "best_of": 0}), "best_of"),
        (json!({"model": "m", "prompt": "x", "max_tokens": -3}), "max_tokens"),
        (json!({"model": "m", "prompt": "x", "n": 200}), "n"),
    ];
    for (body, param) in cases {
        assert_eq!(err(Endpoint::Completions, body.clone()).param(), Some(param), "{body}");
    }
}

// ---- embeddings ----

#[test]
fn embeddings_input_shapes() {
    let emb = |input: Value| estimate(Endpoint::Embeddings, &json!({"model": "e", "input": input, "stream": true}), C);
    for (input, tokens) in [
        (json!("hello world"), 2),
        (json!(["hello world", "hello"]), 3),
        (json!([5, 6, 7]), 3),
        (json!([[5, 6], [7], []]), 3),
    ] {
        let e = emb(input).expect("ok");
        assert_eq!((e.input_tokens, e.max_output_tokens, e.n, e.stream, e.include_usage), (tokens, Some(0), 1, false, false));
    }
    for (body, param) in [
        (json!({"model": "e"}), "input"),
        (json!({"model": "e", "input": 3}), "input"),
        (json!({"model": "e", "input": []}), "input"),
        (json!({"model": "e", "input": [true]}), "input"),
        (json!({"model": "e", "input": ["a", ["b"]]}), "input.[1]"),
        (json!({"input": "x"}), "model"),
    ] {
        assert_eq!(err(Endpoint::Embeddings, body.clone()).param(), Some(param), "{body}");
    }
}
