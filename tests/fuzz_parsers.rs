//! Fuzz-style properties for every parser that reads bytes from the network: the SSE and
//! NDJSON splitters, the SSE meter, Retry-After and rate-limit headers, the estimator's walk
//! of a request body, each provider's response, error and stream translators, and the policy
//! loader. Each must never panic, keep its output bounded by its input, and give the same
//! result however the input is chunked. Modest case counts keep the suite fast.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use serde_json::Value;
use tollgate::estimate::{self, Endpoint, Tokenizer};
use tollgate::policy::BackendKind;
use tollgate::providers::{self, Envelope};
use tollgate::stream::{EventSplitter, LineSplitter, Splitter, SseFramer, SseMeter};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/fuzz_parsers.txt",
        ))),
        ..ProptestConfig::default()
    }
}

/// Bytes that look like streams: SSE and NDJSON punctuation, JSON pieces and noise.
fn stream_bytes() -> impl Strategy<Value = Vec<u8>> {
    const FIXED: &[&[u8]] = &[
        b"data: ",
        b"data:",
        b"\n",
        b"\r\n",
        b"\n\n",
        b"event: x\n",
        b": comment\n",
        b"[DONE]",
        br#"{"choices":[{"delta":{"content":"hi"}}]}"#,
        br#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":18446744073709551615}}"#,
        br#"{"type":"message_start","message":{"usage":{"input_tokens":5}}}"#,
        br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}"#,
        br#"{"type":"message_stop"}"#,
        br#"{"candidates":[{"content":{"parts":[{"text":"y"}]},"finishReason":"STOP"}]}"#,
        br#"{"message":{"content":"z"},"done":false}"#,
        br#"{"done":true,"prompt_eval_count":4,"eval_count":9}"#,
        br#"{"error":{"message":"boom"}}"#,
    ];
    let piece = prop_oneof![
        3 => prop::sample::select(FIXED).prop_map(<[u8]>::to_vec),
        1 => prop::collection::vec(any::<u8>(), 0..16),
    ];
    prop::collection::vec(piece, 0..40).prop_map(|v| v.concat())
}

/// Cut points for splitting an input into frames.
fn cuts() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0usize..4096, 0..12)
}

fn chunks<'a>(data: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
    at.push(0);
    at.push(data.len());
    at.sort_unstable();
    at.dedup();
    at.windows(2).map(|w| &data[w[0]..w[1]]).collect()
}

/// SSE read line by line, as the spec describes it (and as the providers' splitter did before
/// it shared the meter's framer): `data:` lines joined with `\n`, an event dispatched at a blank
/// line (or at the end of the stream), every other line ignored.
fn events_by_lines(data: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut cur: Vec<u8> = Vec::new();
    let mut has = false;
    let pieces: Vec<&[u8]> = data.split(|&b| b == b'\n').collect();
    let n = pieces.len();
    for (i, piece) in pieces.into_iter().enumerate() {
        if i + 1 == n && piece.is_empty() {
            break; // the input ended with its newline: no last line
        }
        let line = piece.strip_suffix(b"\r").unwrap_or(piece);
        if line.is_empty() {
            if has {
                out.push(std::mem::take(&mut cur));
                has = false;
            }
        } else if let Some(rest) = line.strip_prefix(b"data:") {
            if has {
                cur.push(b'\n');
            }
            cur.extend_from_slice(rest.strip_prefix(b" ").unwrap_or(rest));
            has = true;
        }
    }
    if has {
        out.push(cur);
    }
    out
}

fn split_all<S: Splitter>(parts: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut s = S::default();
    let mut units = Vec::new();
    for p in parts {
        s.feed(p, |u| units.push(u.to_vec()));
    }
    s.finish(|u| units.push(u.to_vec()));
    units
}

fn envelope(endpoint: Endpoint) -> Envelope {
    Envelope {
        id: "chatcmpl-fuzz".into(),
        model: "m".into(),
        created: 1,
        endpoint,
        usage_nulls: false,
    }
}

const KINDS: [BackendKind; 4] = [
    BackendKind::Openai,
    BackendKind::Anthropic,
    BackendKind::Gemini,
    BackendKind::Ollama,
];

/// Arbitrary JSON, small and nested.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[a-z_ ]{0,12}".prop_map(Value::from),
        prop::sample::select(
            &[
                "user",
                "assistant",
                "system",
                "tool",
                "text",
                "image_url",
                "data:image/png;base64,iVBORw0KGgo=",
                "auto",
                "m",
            ][..]
        )
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        prop::sample::select(
                            &[
                                "model",
                                "messages",
                                "role",
                                "content",
                                "type",
                                "text",
                                "image_url",
                                "url",
                                "detail",
                                "tools",
                                "function",
                                "parameters",
                                "max_tokens",
                                "n",
                                "input",
                                "prompt",
                                "stream",
                                "name",
                            ][..]
                        )
                        .prop_map(String::from),
                        "[a-z]{1,6}",
                    ],
                    inner,
                ),
                0..6,
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn line_splitter_reassembles_however_chunked(
        text in prop::collection::vec(prop_oneof![Just(b'\n'), Just(b'a'), Just(b'{'), any::<u8>().prop_filter("no cr", |b| *b != b'\r')], 0..512),
        cuts in cuts(),
    ) {
        let whole = split_all::<LineSplitter>(&[&text]);
        let chunked = split_all::<LineSplitter>(&chunks(&text, &cuts));
        prop_assert_eq!(&whole, &chunked);
        // Joined with the newlines they were cut at, the lines are the input.
        let mut joined = whole.join(&b'\n');
        if text.last() == Some(&b'\n') {
            joined.push(b'\n');
        }
        prop_assert_eq!(joined, text);
    }

    #[test]
    fn event_splitter_gives_the_same_events_however_chunked(data in stream_bytes(), cuts in cuts()) {
        let whole = split_all::<EventSplitter>(&[&data]);
        let chunked = split_all::<EventSplitter>(&chunks(&data, &cuts));
        prop_assert_eq!(&whole, &chunked);
        let total: usize = whole.iter().map(Vec::len).sum();
        prop_assert!(total <= data.len());
    }

    #[test]
    fn event_splitter_reads_events_as_the_sse_line_rules_do(data in stream_bytes(), cuts in cuts()) {
        let chunked = split_all::<EventSplitter>(&chunks(&data, &cuts));
        prop_assert_eq!(chunked, events_by_lines(&data));
    }

    #[test]
    fn sse_framer_cuts_every_byte_into_the_same_events_however_chunked(
        data in stream_bytes(),
        cuts in cuts(),
    ) {
        let run = |parts: &[&[u8]]| {
            let mut f = SseFramer::default();
            let mut events: Vec<Vec<u8>> = Vec::new();
            for p in parts {
                f.feed(p, |ev| events.push(ev.to_vec()));
            }
            (events, f.take_rest())
        };
        let whole = run(&[&data]);
        let chunked = run(&chunks(&data, &cuts));
        prop_assert_eq!(&whole, &chunked);
        // Every event ends at its first blank line, and together with the rest they are the input.
        for ev in &whole.0 {
            let first = (0..ev.len()).find(|&i| {
                ev[i] == b'\n'
                    && (ev.get(i + 1) == Some(&b'\n')
                        || (ev.get(i + 1) == Some(&b'\r') && ev.get(i + 2) == Some(&b'\n')))
            });
            let end = first.map(|i| if ev[i + 1] == b'\n' { i + 2 } else { i + 3 });
            prop_assert_eq!(end, Some(ev.len()));
        }
        let mut joined = whole.0.concat();
        joined.extend_from_slice(&whole.1);
        prop_assert_eq!(joined, data);
    }

    #[test]
    fn sse_meter_passes_every_byte_and_meters_the_same_however_chunked(
        data in stream_bytes(),
        cuts in cuts(),
        hide in any::<bool>(),
    ) {
        let run = |parts: &[&[u8]]| {
            let mut m = SseMeter::new(Tokenizer::Chars, hide);
            let mut out = Vec::new();
            for p in parts {
                out.extend_from_slice(&m.feed(&Bytes::copy_from_slice(p)));
            }
            out.extend_from_slice(&m.flush());
            (out, m.usage, m.counted_output, m.done, m.events)
        };
        let whole = run(&[&data]);
        let chunked = run(&chunks(&data, &cuts));
        prop_assert_eq!(&whole, &chunked);
        if hide {
            prop_assert!(whole.0.len() <= data.len());
        } else {
            // Pass-through: the stream reassembles to the input.
            prop_assert_eq!(&whole.0, &data);
        }
    }

    #[test]
    fn stream_translators_never_panic_and_stay_bounded(
        data in stream_bytes(),
        cuts in cuts(),
        k in 0usize..4,
    ) {
        let p = providers::for_kind(KINDS[k]);
        let run = |parts: &[&[u8]]| {
            let mut tr = p.stream(envelope(Endpoint::Chat))?;
            let mut out = Vec::new();
            for part in parts {
                tr.feed(part, &mut out);
            }
            tr.finish(&mut out);
            Some((out, tr.failed()))
        };
        let whole = run(&[&data]);
        let chunked = run(&chunks(&data, &cuts));
        prop_assert_eq!(&whole, &chunked);
        if let Some((out, _)) = whole {
            // Each unit becomes at most a few chunks: output is linear in the input.
            prop_assert!(out.len() <= 64 * data.len() + 4096, "{} from {}", out.len(), data.len());
        }
    }

    #[test]
    fn response_and_error_translators_never_panic(
        body in prop_oneof![
            json_value().prop_map(|v| serde_json::to_vec(&v).unwrap_or_default()),
            prop::collection::vec(any::<u8>(), 0..256),
        ],
        k in 0usize..4,
        status in 100u16..600,
        embeddings in any::<bool>(),
    ) {
        let p = providers::for_kind(KINDS[k]);
        let ep = if embeddings { Endpoint::Embeddings } else { Endpoint::Chat };
        if let Ok(Some(out)) = p.response(&body, &envelope(ep)) {
            prop_assert!(out.len() <= 64 * body.len() + 4096);
        }
        let _ = p.error_hint(status, &body, 1_700_000_000_000);
        if let Some(out) = p.error_body(status, &body) {
            prop_assert!(out.len() <= 4 * body.len() + 4096);
        }
        let _ = providers::validate::openai_answer_ok(ep, &body);
        let _ = providers::retry_after::from_gemini_body(&body);
    }

    #[test]
    fn retry_after_and_rate_limit_headers_never_panic(
        values in prop::collection::vec(
            prop_oneof![
                "[0-9]{0,25}",
                "-?[0-9]{0,6}(\\.[0-9]{0,4})?(ms|s|m|h|us|ns)?",
                "([0-9]{1,4}(h|m|s|ms)){0,5}",
                "(Mon|Sun), [0-9]{2} (Jan|Feb) [0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2} GMT",
                "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z",
                "[ -~]{0,30}",
            ],
            7,
        ),
        now in any::<i64>(),
    ) {
        const NAMES: [&str; 7] = [
            "retry-after", "retry-after-ms", "x-ms-retry-after-ms",
            "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens",
            "anthropic-ratelimit-requests-reset", "anthropic-ratelimit-tokens-reset",
        ];
        let mut h = HeaderMap::new();
        for (n, v) in NAMES.iter().zip(&values) {
            if let Ok(v) = HeaderValue::from_str(v) {
                h.insert(HeaderName::from_static(n), v);
            }
            let _ = providers::retry_after::parse_retry_after(v, now);
            let _ = providers::retry_after::parse_go_duration(v);
        }
        let _ = providers::retry_after::from_headers(&h, now);
        let _ = providers::retry_after::from_azure_header(&h);
        let _ = providers::retry_after::from_openai_ratelimit(&h);
        let _ = providers::retry_after::from_anthropic_ratelimit(&h, now);
        for k in KINDS {
            let _ = providers::for_kind(k).header_delay(&h, now);
        }
    }

    #[test]
    fn the_estimator_walks_any_body_without_panicking(v in json_value(), e in 0usize..3) {
        let ep = [Endpoint::Chat, Endpoint::Completions, Endpoint::Embeddings][e];
        let mut body = match v {
            Value::Object(m) => m,
            other => {
                let mut m = serde_json::Map::new();
                m.insert("messages".into(), other.clone());
                m.insert("input".into(), other.clone());
                m.insert("prompt".into(), other);
                m
            }
        };
        body.entry("model").or_insert_with(|| Value::from("m"));
        if let Ok(est) = estimate::estimate_object(ep, &body, Tokenizer::Chars) {
            prop_assert!(est.input_tokens < u64::MAX);
        }
    }

    #[test]
    fn the_policy_loader_rejects_or_accepts_but_never_panics(
        edits in prop::collection::vec((0usize..2048, "[ -~\n]{0,6}", 0usize..6), 0..6),
    ) {
        let mut text = BASE_POLICY.to_string();
        for (at, ins, del) in edits {
            let mut at = at % (text.len() + 1);
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            let mut end = (at + del).min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.replace_range(at..end, &ins);
        }
        let _ = tollgate::policy::from_str(&text, "fuzz.yaml");
    }

    #[test]
    fn the_policy_loader_survives_noise(text in "[ -~\n\t]{0,400}") {
        let _ = tollgate::policy::from_str(&text, "fuzz.yaml");
    }
}

const BASE_POLICY: &str = r#"version: fuzz
backends:
  - {id: a, kind: openai, base_url: "http://127.0.0.1:9", timeouts: {connect: 1s, first_byte: 2s, total: 10s}, price: {input_per_1k: 0.5, output_per_1k: 1.5}}
  - {id: b, kind: anthropic, base_url: "http://127.0.0.1:9", api_key_env: FUZZ_KEY, max_in_flight: 4}
routes:
  - model: chat
    chain:
      - {backend: a, model: m-a}
      - {backend: b, model: m-b}
    static_response: "unavailable"
budgets:
  - {name: g, scope: global, window: day, hard_tokens: 1000, soft_tokens: 800, alert_at: [0.5, 0.9]}
  - {name: j, scope: job, hard_usd: 2.5}
"#;

#[test]
fn oversized_units_stop_the_splitters_without_growing_their_buffers() {
    let cap = tollgate::stream::MAX_EVENT_BYTES;
    let frame = vec![b'x'; 64 * 1024];
    let mut lines = LineSplitter::default();
    let mut events = EventSplitter::default();
    let mut meter = SseMeter::new(Tokenizer::Chars, false);
    let mut n = 0;
    for _ in 0..(cap / frame.len() + 2) {
        lines.feed(&frame, |_| n += 1);
        events.feed(b"data: ", |_| n += 1);
        events.feed(&frame, |_| n += 1);
        events.feed(b"\n", |_| n += 1);
        let _ = meter.feed(&Bytes::from(frame.clone()));
    }
    assert_eq!(n, 0);
    assert!(lines.overflowed());
    assert!(events.overflowed());
    assert!(meter.oversized);
    // Every translator ends with an error event and fails.
    for k in KINDS {
        let Some(mut tr) = providers::for_kind(k).stream(envelope(Endpoint::Chat)) else {
            continue;
        };
        let mut out = Vec::new();
        for _ in 0..(cap / frame.len() + 2) {
            tr.feed(b"data: ", &mut out);
            tr.feed(&frame, &mut out);
        }
        assert!(tr.failed(), "{k:?}");
        assert!(String::from_utf8_lossy(&out).contains("upstream_event_too_large"));
    }
}
