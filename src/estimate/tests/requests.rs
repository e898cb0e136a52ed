//! Request-field tests: output caps, `n`, streaming flags, every error case, and the
//! completions and embeddings input shapes.

use super::*;

// ---- request fields ----

#[test]
fn output_cap_n_stream_and_usage() {
    let e = chat(user(json!("x")));
    assert_eq!(
        (
            e.max_output_tokens,
            e.n,
            e.stream,
            e.include_usage,
            e.model.as_str()
        ),
        (None, 1, false, false, "gpt-4o")
    );
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
        (
            json!({"messages": []}),
            Some("model"),
            "missing_required_parameter",
        ),
        (
            json!({"model": 4, "messages": []}),
            Some("model"),
            "invalid_type",
        ),
        (
            json!({"model": "", "messages": []}),
            Some("model"),
            "invalid_type",
        ),
        (
            json!({"model": "m"}),
            Some("messages"),
            "missing_required_parameter",
        ),
        (m(json!("hi")), Some("messages"), "invalid_type"),
        (m(json!([])), Some("messages"), "invalid_value"),
        (m(json!(["hi"])), Some("messages.[0]"), "invalid_type"),
        (
            m(json!([{"content": "hi"}])),
            Some("messages.[0].role"),
            "missing_required_parameter",
        ),
        (
            m(json!([{"role": 1}])),
            Some("messages.[0].role"),
            "invalid_type",
        ),
        (
            m(json!([{"role": "user", "content": 5}])),
            Some("messages.[0].content"),
            "invalid_type",
        ),
        (
            m(json!([{"role": "user", "content": {"text": "x"}}])),
            Some("messages.[0].content"),
            "invalid_type",
        ),
        (
            m(json!([{"role": "user", "content": ["x"]}])),
            Some("messages.[0].content.[0]"),
            "invalid_type",
        ),
        (
            m(json!([{"role": "user", "content": [{"text": "x"}]}])),
            Some("messages.[0].content.[0].type"),
            "missing_required_parameter",
        ),
        (
            m(json!([{"role": "user", "content": [{"type": "text"}]}])),
            Some("messages.[0].content.[0].text"),
            "missing_required_parameter",
        ),
        (
            m(json!([{"role": "user", "content": [{"type": "text", "text": 1}]}])),
            Some("messages.[0].content.[0].text"),
            "invalid_type",
        ),
        (
            m(json!([{"role": "user", "content": [{"type": "image_url"}]}])),
            Some("messages.[0].content.[0].image_url"),
            "missing_required_parameter",
        ),
        (
            m(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])),
            Some("messages.[0].content.[0].image_url.url"),
            "missing_required_parameter",
        ),
        (
            m(
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": 1}}]}]),
            ),
            Some("messages.[0].content.[0].image_url.detail"),
            "invalid_type",
        ),
        (
            m(json!([{"role": "user", "name": 7, "content": "x"}])),
            Some("messages.[0].name"),
            "invalid_type",
        ),
        (
            m(json!([{"role": "assistant", "tool_calls": {}}])),
            Some("messages.[0].tool_calls"),
            "invalid_type",
        ),
        (
            with("max_tokens", json!(-1)),
            Some("max_tokens"),
            "invalid_value",
        ),
        (
            with("max_tokens", json!(1.5)),
            Some("max_tokens"),
            "invalid_type",
        ),
        (
            with("max_tokens", json!("10")),
            Some("max_tokens"),
            "invalid_type",
        ),
        (
            with("max_completion_tokens", json!(-5)),
            Some("max_completion_tokens"),
            "invalid_value",
        ),
        (with("n", json!(0)), Some("n"), "invalid_value"),
        (with("n", json!(129)), Some("n"), "invalid_value"),
        (with("n", json!(-1)), Some("n"), "invalid_value"),
        (with("n", json!(2.5)), Some("n"), "invalid_type"),
        (with("stream", json!("yes")), Some("stream"), "invalid_type"),
        (
            with("stream_options", json!(true)),
            Some("stream_options"),
            "invalid_type",
        ),
        (
            with("stream_options", json!({"include_usage": 1})),
            Some("stream_options.include_usage"),
            "invalid_type",
        ),
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
    let e =
        completions(json!({"model": "m", "prompt": "hello world", "max_tokens": 7})).expect("ok");
    assert_eq!((e.input_tokens, e.max_output_tokens, e.n), (2, Some(7), 1));
    let e =
        completions(json!({"model": "m", "prompt": ["hello world", "hello"], "n": 2})).expect("ok");
    assert_eq!((e.input_tokens, e.max_output_tokens, e.n), (3, None, 4));
    let e =
        completions(json!({"model": "m", "prompt": [1, 2, 3], "best_of": 5, "n": 2})).expect("ok");
    assert_eq!((e.input_tokens, e.n), (3, 5));
    let e = completions(json!({"model": "m", "prompt": [[1, 2], [3]], "suffix": "hello world"}))
        .expect("ok");
    assert_eq!((e.input_tokens, e.n), (3 + 2 * 2, 2));
    let e = completions(
        json!({"model": "m", "stream": true, "stream_options": {"include_usage": true}}),
    )
    .expect("ok");
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
        (
            json!({"model": "m", "prompt": [[1], [0.5]]}),
            "prompt.[1].[0]",
        ),
        (json!({"model": "m", "prompt": "x", "suffix": 3}), "suffix"),
        (
            json!({"model": "m", "prompt": "x", "best_of": 0}),
            "best_of",
        ),
        (
            json!({"model": "m", "prompt": "x", "max_tokens": -3}),
            "max_tokens",
        ),
        (json!({"model": "m", "prompt": "x", "n": 200}), "n"),
    ];
    for (body, param) in cases {
        assert_eq!(
            err(Endpoint::Completions, body.clone()).param(),
            Some(param),
            "{body}"
        );
    }
}

// ---- embeddings ----

#[test]
fn embeddings_input_shapes() {
    let emb = |input: Value| {
        estimate(
            Endpoint::Embeddings,
            &json!({"model": "e", "input": input, "stream": true}),
            C,
        )
    };
    for (input, tokens) in [
        (json!("hello world"), 2),
        (json!(["hello world", "hello"]), 3),
        (json!([5, 6, 7]), 3),
        (json!([[5, 6], [7], []]), 3),
    ] {
        let e = emb(input).expect("ok");
        assert_eq!(
            (
                e.input_tokens,
                e.max_output_tokens,
                e.n,
                e.stream,
                e.include_usage
            ),
            (tokens, Some(0), 1, false, false)
        );
    }
    for (body, param) in [
        (json!({"model": "e"}), "input"),
        (json!({"model": "e", "input": 3}), "input"),
        (json!({"model": "e", "input": []}), "input"),
        (json!({"model": "e", "input": [true]}), "input"),
        (json!({"model": "e", "input": ["a", ["b"]]}), "input.[1]"),
        (json!({"input": "x"}), "model"),
    ] {
        assert_eq!(
            err(Endpoint::Embeddings, body.clone()).param(),
            Some(param),
            "{body}"
        );
    }
}
