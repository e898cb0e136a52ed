//! The official OpenAI Python SDK pointed at the real sidecar (issues 3 and 4).
//!
//! Each test starts in-process mock upstream(s) and the sidecar on port 0, then runs one script
//! of `tests/sdk/` with the Python named by `TOLLGATE_SDK_PYTHON` (`scripts/test` creates the
//! venv and sets it). The script prints one JSON object describing what the SDK saw; the
//! assertions are here.
//!
//! Without `TOLLGATE_SDK_PYTHON` the tests print a note and pass, so that a plain `cargo test`
//! works without the venv; under CI (`CI` set) they fail instead, pointing at `scripts/test`.
//! `TOLLGATE_SDK_DUMP=1` prints each script's JSON (run with `--nocapture`).

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::mock::{Answer, MockUpstream};
use common::native::*;
use serde_json::Value;
use tollgate::audit::Audit;
use tollgate::ledger::{window_at, window_end, CounterKey};
use tollgate::proxy::Snapshot;
use tollgate::sidecar::{self, Options, Running};
use tollgate::units::{Amount, Scope, Window};

/// Longest a script may run.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(60);

/// The SDK's Python, or None (after printing a note) when it is not configured and this is
/// not CI. Under CI a missing SDK is a failure: the tests would otherwise pass vacuously.
fn sdk_python(test: &str) -> Option<PathBuf> {
    match std::env::var_os("TOLLGATE_SDK_PYTHON").filter(|v| !v.is_empty()) {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(
                p.exists(),
                "TOLLGATE_SDK_PYTHON={} does not exist: run scripts/test to create the SDK venv",
                p.display()
            );
            Some(p)
        }
        None if std::env::var_os("CI").is_some() => panic!(
            "{test}: TOLLGATE_SDK_PYTHON is not set, so the OpenAI SDK tests cannot run. \
             Run scripts/test (it creates .venv-sdk with `pip install openai` and sets it)."
        ),
        None => {
            eprintln!(
                "note: {test} skipped: TOLLGATE_SDK_PYTHON is not set (run scripts/test to include the OpenAI SDK tests)"
            );
            None
        }
    }
}

/// Runs `tests/sdk/<script>` with the sidecar's base URL (and `extra` env), returns the JSON it
/// printed. Panics on a timeout, a non-zero exit or output that is not one JSON object.
async fn run_script(
    python: &PathBuf,
    script: &str,
    base_url: &str,
    extra: &[(&str, &str)],
) -> Value {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("sdk");
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(dir.join(script))
        .current_dir(&dir)
        .env("OPENAI_BASE_URL", base_url)
        .env("OPENAI_API_KEY", "sk-dummy")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONIOENCODING", "utf-8")
        // Loopback only: no proxy from the environment may sit between the SDK and us.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .kill_on_drop(true);
    for k in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "OPENAI_ORG_ID",
        "OPENAI_PROJECT_ID",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let t0 = Instant::now();
    let out = match tokio::time::timeout(SCRIPT_TIMEOUT, cmd.output()).await {
        Ok(r) => r.unwrap_or_else(|e| panic!("cannot run {} {script}: {e}", python.display())),
        Err(_) => panic!("{script} did not finish within {SCRIPT_TIMEOUT:?}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} exited with {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| {
        panic!("{script} printed no JSON object ({e})\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    });
    eprintln!(
        "{script}: {:.2} s (openai {})",
        t0.elapsed().as_secs_f64(),
        v["sdk_version"]
    );
    if std::env::var_os("TOLLGATE_SDK_DUMP").is_some() {
        eprintln!(
            "{script} saw: {}",
            serde_json::to_string_pretty(&v).unwrap()
        );
    }
    v
}

/// Starts the sidecar on `yaml` (ports 0, no audit).
async fn sidecar(yaml: &str) -> Running {
    let policy =
        tollgate::policy::from_str(yaml, "sdk-test.yaml").unwrap_or_else(|e| panic!("policy: {e}"));
    let snap = Snapshot::build(policy).expect("snapshot");
    let opts = Options {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin_listen: Some("127.0.0.1:0".parse().unwrap()),
        workers: None,
    };
    sidecar::start(snap, Audit::off(), opts)
        .await
        .expect("sidecar starts")
}

fn base_url(r: &Running) -> String {
    format!("http://{}/v1", r.addr)
}

/// Marks `tokens` as already committed for `(scope, id)` in the current `window` and the next
/// one, so that the test does not depend on which side of a boundary the request lands.
fn seed(running: &Running, scope: Scope, id: &str, window: Window, tokens: u64) {
    let snap = running.app.snap.load();
    let tz = &snap.policy.windows.timezone;
    let now = jiff::Timestamp::now().as_millisecond();
    let this = window_at(tz, window, now);
    let next = window_at(tz, window, window_end(tz, this));
    for w in [this, next] {
        let key = CounterKey {
            scope,
            id: id.into(),
            window: Some(w),
        };
        running
            .app
            .governor
            .ledger
            .counter(&key, window_end(tz, w))
            .add_committed(&Amount {
                tokens,
                requests: 0,
                usd: 0,
            });
    }
}

/// A one-backend, one-route policy (`chat` → backend `mock`, upstream model `gpt-mock`) plus
/// `extra` top-level YAML.
fn policy(upstream_base: &str, extra: &str) -> String {
    format!(
        r#"version: sdk-test
backends:
  - {{id: mock, kind: openai, base_url: "{upstream_base}"}}
routes:
  - {{model: chat, chain: [{{backend: mock, model: gpt-mock}}]}}
  - {{model: embed, chain: [{{backend: mock, model: embed-mock}}]}}
{extra}"#
    )
}

fn header<'a>(v: &'a Value, name: &str) -> &'a str {
    v["headers"][name]
        .as_str()
        .unwrap_or_else(|| panic!("no {name} header in {}", v["headers"]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_chat_completion_round_trips() {
    let Some(py) = sdk_python("sdk_chat_completion_round_trips") else {
        return;
    };
    let up = MockUpstream::start(vec![Answer::ok_chat("Hello from the mock.", 21, 5)]).await;
    let running = sidecar(&policy(&up.base_url(), "")).await;

    let v = run_script(&py, "chat.py", &base_url(&running), &[]).await;
    assert_eq!(v["type"], "ChatCompletion", "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["content"], "Hello from the mock.");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"], 21);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], 26);
    // The model as the mock returned it: it echoes the upstream model the sidecar sent.
    assert_eq!(v["model"], "gpt-mock");
    assert_eq!(v["id"], "chatcmpl-mock-1");
    assert_eq!(header(&v, "x-tollgate-action"), "ALLOW");
    assert_eq!(header(&v, "x-tollgate-reason"), "OK");
    assert_eq!(header(&v, "x-tollgate-backend"), "mock");
    assert_eq!(header(&v, "x-tollgate-policy-version"), "sdk-test");
    assert!(!header(&v, "x-tollgate-request-id").is_empty());

    assert_eq!(up.hits(), 1);
    let req = up.last_request().unwrap();
    assert_eq!(req.path, "/v1/chat/completions");
    assert_eq!(req.model(), Some("gpt-mock"));
    assert_eq!(
        req.json.as_ref().unwrap()["max_tokens"],
        50,
        "the client's cap goes upstream"
    );
    assert_ne!(
        req.header("authorization"),
        Some("Bearer sk-dummy"),
        "the client's key must not reach the upstream"
    );
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_embedding_round_trips() {
    let Some(py) = sdk_python("sdk_embedding_round_trips") else {
        return;
    };
    let up = MockUpstream::start_with_default(vec![], Answer::ok_embedding(8, 2)).await;
    let running = sidecar(&policy(&up.base_url(), "")).await;

    let v = run_script(&py, "embedding.py", &base_url(&running), &[]).await;
    assert_eq!(v["type"], "CreateEmbeddingResponse", "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "embed-mock");
    assert_eq!(v["count"], 2);
    assert_eq!(v["indices"], serde_json::json!([0, 1]));
    // The mock's vectors: element j of vector i is ((i + j) % 17 - 8) / 16.
    for i in 0..2usize {
        let want: Vec<f64> = (0..8usize)
            .map(|j| (((i + j) % 17) as f64 - 8.0) / 16.0)
            .collect();
        let got: Vec<f64> = v["embeddings"][i]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(got, want, "embedding {i}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    assert_eq!(v["usage"]["total_tokens"], 2);
    assert_eq!(header(&v, "x-tollgate-action"), "ALLOW");
    assert_eq!(header(&v, "x-tollgate-backend"), "mock");

    assert_eq!(up.hits(), 1);
    let req = up.last_request().unwrap();
    assert_eq!(req.path, "/v1/embeddings");
    assert_eq!(req.model(), Some("embed-mock"));
    assert_eq!(
        req.json.as_ref().unwrap()["input"],
        serde_json::json!(["a", "b"])
    );
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_quota_stop_is_permission_denied_with_reason() {
    let Some(py) = sdk_python("sdk_quota_stop_is_permission_denied_with_reason") else {
        return;
    };
    let up = MockUpstream::start(vec![]).await;
    let extra = r#"quotas:
  - {name: consumer-daily, scope: consumer, match: "*", window: day, limit_tokens: 1000}
"#;
    let running = sidecar(&policy(&up.base_url(), extra)).await;
    seed(&running, Scope::Consumer, "alice", Window::Day, 1000);

    let v = run_script(&py, "quota.py", &base_url(&running), &[]).await;
    let a = &v["alice"];
    assert_eq!(a["raised"], "PermissionDeniedError", "alice: {a}");
    assert_eq!(a["is_permission_denied"], true);
    assert_eq!(a["status"], 403);
    // The SDK keeps only the `error` object in `e.body`: the decision is inside it as well as
    // beside it (SPEC §3), so `e.body["tollgate"]` works.
    assert_eq!(
        a["body"]["tollgate"], a["response_json"]["tollgate"],
        "alice: {a}"
    );
    let t = &a["body"]["tollgate"];
    assert_eq!(t["reason_class"], "QUOTA_BLOCKED", "alice: {a}");
    assert_eq!(t["final_action"], "HARD_STOP");
    assert_eq!(t["quota_state"], "EXHAUSTED");
    assert_eq!(t["circuit_state"], "CLOSED");
    assert_eq!(t["usage_evidence_state"], "NONE");
    assert!(t["request_id"].as_str().is_some_and(|s| !s.is_empty()));
    assert_eq!(
        a["body"]["type"], "insufficient_quota",
        "the OpenAI error object: {}",
        a["body"]
    );
    assert!(a["body"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("quota")));
    assert_eq!(header(a, "x-tollgate-action"), "HARD_STOP");
    assert_eq!(header(a, "x-tollgate-reason"), "QUOTA_BLOCKED");
    assert!(
        a["headers"].get("retry-after").is_none(),
        "a quota stop is not a DEFER: {}",
        a["headers"]
    );

    // Another consumer is not affected, and only its call reached the upstream.
    assert_eq!(v["bob"]["raised"], Value::Null, "bob: {}", v["bob"]);
    assert_eq!(v["bob"]["content"], "Hello from the mock upstream.");
    assert_eq!(up.hits(), 1);
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_defer_is_rate_limit_error_with_retry_after() {
    let Some(py) = sdk_python("sdk_defer_is_rate_limit_error_with_retry_after") else {
        return;
    };
    // Only bob's request reaches the upstream, which throttles it for longer than the sidecar
    // waits in-request (retry.max_retry_after defaults to 10 s).
    let up = MockUpstream::start(vec![Answer::status(429).header("retry-after", "120")]).await;
    let extra = r#"rate_limits:
  - {name: tpm, scope: consumer, match: alice, window: minute, limit_tokens: 100}
"#;
    let running = sidecar(&policy(&up.base_url(), extra)).await;
    // Alice's minute window is full: any request is over what remains, yet well under the limit,
    // so waiting for the next window helps (DEFER, not HARD_STOP).
    seed(&running, Scope::Consumer, "alice", Window::Minute, 100);

    let v = run_script(&py, "defer.py", &base_url(&running), &[]).await;

    let a = &v["rate_limited"];
    assert_eq!(a["raised"], "RateLimitError", "rate_limited: {a}");
    assert_eq!(a["is_rate_limit_error"], true);
    assert_eq!(a["status"], 429);
    let ra: u64 = a["retry_after"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("retry-after: {a}"));
    assert!(
        (1..=60).contains(&ra),
        "Retry-After {ra} s: until the minute window turns"
    );
    let t = &a["response_json"]["tollgate"];
    assert_eq!(t["reason_class"], "RATE_LIMITED", "{a}");
    assert_eq!(t["final_action"], "DEFER");
    assert_eq!(t["quota_state"], "RATE_LIMITED");
    assert_eq!(t["retry_after"], ra);
    assert_eq!(header(a, "x-tollgate-action"), "DEFER");
    assert_eq!(header(a, "x-tollgate-reason"), "RATE_LIMITED");

    let b = &v["upstream_429"];
    assert_eq!(b["raised"], "RateLimitError", "upstream_429: {b}");
    assert_eq!(b["status"], 429);
    assert_eq!(
        b["retry_after"], "120",
        "the upstream's Retry-After is carried: {b}"
    );
    let t = &b["response_json"]["tollgate"];
    assert_eq!(t["final_action"], "DEFER", "{b}");
    assert_eq!(t["reason_class"], "UPSTREAM_FAILURE");
    assert_eq!(header(b, "x-tollgate-action"), "DEFER");
    // Generous for a loaded machine; waiting out the 120 s would blow far past it.
    assert!(
        b["elapsed_s"].as_f64().unwrap() < 30.0,
        "a 120 s Retry-After is not waited out: {b}"
    );

    assert_eq!(
        up.hits(),
        1,
        "alice never reached the upstream; bob's 429 was not retried"
    );
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_streaming_matches_direct() {
    let Some(py) = sdk_python("sdk_streaming_matches_direct") else {
        return;
    };
    let up = MockUpstream::start_with_default(
        vec![],
        Answer::sse_chat(
            &["Hel", "lo", " world"],
            Some((8, 3)),
            Duration::from_millis(50),
        ),
    )
    .await;
    let running = sidecar(&policy(&up.base_url(), "")).await;

    let v = run_script(
        &py,
        "stream.py",
        &base_url(&running),
        &[
            ("MOCK_BASE_URL", &up.base_url()),
            ("UPSTREAM_MODEL", "gpt-mock"),
        ],
    )
    .await;

    for k in [
        "direct_plain",
        "sidecar_plain",
        "direct_usage",
        "sidecar_usage",
    ] {
        assert_eq!(v[k]["content"], "Hello world", "{k}: {}", v[k]);
    }
    // Without stream_options the SDK sees no usage chunk, although the sidecar asked upstream.
    for k in ["direct_plain", "sidecar_plain"] {
        assert_eq!(
            v[k]["usage_chunks"],
            serde_json::json!([]),
            "{k}: a usage chunk the client did not ask for"
        );
        assert_eq!(v[k]["last_usage"], Value::Null, "{k}");
    }
    // With it, the last chunk carries the usage.
    for k in ["direct_usage", "sidecar_usage"] {
        let u = &v[k]["last_usage"];
        assert_eq!(u["prompt_tokens"], 8, "{k}: {}", v[k]);
        assert_eq!(u["completion_tokens"], 3, "{k}");
        assert_eq!(u["total_tokens"], 11, "{k}");
        assert_eq!(v[k]["usage_chunks"].as_array().unwrap().len(), 1, "{k}");
    }
    // Identical to a direct call, chunk for chunk (keys present on the wire included).
    assert_eq!(v["sidecar_plain"]["pieces"], v["direct_plain"]["pieces"]);
    assert_eq!(v["sidecar_usage"]["pieces"], v["direct_usage"]["pieces"]);
    assert_eq!(v["sidecar_plain"]["count"], v["direct_plain"]["count"]);
    assert_eq!(v["sidecar_usage"]["count"], v["direct_usage"]["count"]);
    assert_eq!(
        v["direct_usage"]["count"].as_u64().unwrap(),
        v["direct_plain"]["count"].as_u64().unwrap() + 1
    );
    assert_eq!(
        v["sidecar_plain"]["chunks"], v["direct_plain"]["chunks"],
        "without stream_options"
    );
    assert_eq!(
        v["sidecar_usage"]["chunks"], v["direct_usage"]["chunks"],
        "with stream_options"
    );

    for k in ["sidecar_plain", "sidecar_usage"] {
        let h = &v[k]["headers"];
        assert!(
            h["content-type"]
                .as_str()
                .unwrap()
                .starts_with("text/event-stream"),
            "{k}: {h}"
        );
        assert_eq!(h["x-tollgate-action"], "ALLOW", "{k}: {h}");
        assert_eq!(h["x-tollgate-backend"], "mock", "{k}: {h}");
        // Chunks 50 ms apart upstream arrive spread out, not buffered into one burst.
        let times: Vec<f64> = v[k]["times"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_f64().unwrap())
            .collect();
        let spread = times.last().unwrap() - times.first().unwrap();
        assert!(
            spread >= 0.12,
            "{k}: chunks arrived within {spread:.3} s: buffered? {times:?}"
        );
    }

    // The mock's log, in the script's order: direct plain, sidecar plain, direct usage, sidecar usage.
    let reqs = up.requests();
    assert_eq!(reqs.len(), 4);
    assert!(!reqs[0].include_usage());
    assert!(
        reqs[1].include_usage(),
        "the sidecar asks the upstream for usage"
    );
    assert_eq!(reqs[1].model(), Some("gpt-mock"));
    assert!(reqs[2].include_usage() && reqs[3].include_usage());
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_static_response_when_no_backend() {
    let Some(py) = sdk_python("sdk_static_response_when_no_backend") else {
        return;
    };
    // Port 9 (discard) on loopback: connection refused.
    let yaml = r#"version: sdk-static
backends:
  - {id: down, kind: openai, base_url: "http://127.0.0.1:9/v1"}
routes:
  - {model: chat, chain: [{backend: down, model: m}], static_response: "unavailable"}
"#;
    let running = sidecar(yaml).await;

    let v = run_script(&py, "static.py", &base_url(&running), &[]).await;
    assert_eq!(v["type"], "ChatCompletion", "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["status"], 200);
    assert_eq!(v["content"], "unavailable");
    assert_eq!(v["finish_reason"], "stop");
    assert_eq!(v["model"], "chat");
    assert_eq!(
        v["usage"],
        serde_json::json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
    );
    assert_eq!(header(&v, "x-tollgate-backend"), "static");
    assert_eq!(header(&v, "x-tollgate-action"), "DEGRADE");

    let s = &v["stream"];
    assert_eq!(s["content"], "unavailable", "static stream: {s}");
    assert_eq!(s["types"], serde_json::json!(["chat.completion.chunk"]));
    assert!(
        s["finish_reasons"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("stop")),
        "{s}"
    );
    let s = &v["stream_usage"];
    assert_eq!(
        s["content"], "unavailable",
        "static stream with include_usage: {s}"
    );
    // SPEC §3: the static answer has usage zero; a stream that asked for usage ends with it.
    assert_eq!(s["last_usage"]["total_tokens"], 0, "{s}");
    running.shutdown().await;
}

/// `policies/default.yaml` with its three backends pointed at mocks.
fn default_policy_at(ollama: &str, gemini: &str, claude: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("policies/default.yaml");
    let text = std::fs::read_to_string(path).expect("policies/default.yaml");
    let out = text
        .replace("http://127.0.0.1:11434", ollama)
        .replace("https://generativelanguage.googleapis.com/v1beta", gemini)
        .replace("https://api.anthropic.com", claude);
    assert_eq!(
        out.matches("http://127.0.0.1:").count(),
        3,
        "all three backends re-pointed"
    );
    out
}

/// What the SDK saw of one buffered completion and two streams served by `backend`.
fn assert_native_run(v: &Value, backend: &str, text: &str, usage: (u64, u64)) {
    let chat = &v["chat"];
    assert_eq!(chat["type"], "ChatCompletion", "{v}");
    assert_eq!(chat["backend"], backend, "{v}");
    assert_eq!(chat["content"], text);
    assert_eq!(chat["finish_reason"], "stop");
    assert_eq!(chat["usage"]["prompt_tokens"], usage.0);
    assert_eq!(chat["usage"]["completion_tokens"], usage.1);
    assert_eq!(chat["usage"]["total_tokens"], usage.0 + usage.1);
    for s in ["stream", "stream_usage"] {
        assert_eq!(v[s]["backend"], backend, "{s}: {v}");
        assert_eq!(v[s]["content"], "Hello world", "{s}: {v}");
        assert_eq!(
            v[s]["objects"],
            serde_json::json!(["chat.completion.chunk"])
        );
        assert_eq!(v[s]["finish"], serde_json::json!(["stop"]), "{s}: {v}");
    }
    assert_eq!(
        v["stream"]["usage_chunks"],
        serde_json::json!([]),
        "not asked for: hidden"
    );
    let u = &v["stream_usage"]["usage_chunks"];
    assert_eq!(u.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(u[0]["prompt_tokens"], 17);
    assert_eq!(u[0]["completion_tokens"], 9);
}

/// Issue 5's "done when": the default policy pointed at the three native mocks; the SDK gets
/// answers, streams and usage from each kind, and the ADR chain fails over across kinds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_default_policy_over_native_backends() {
    let Some(py) = sdk_python("sdk_default_policy_over_native_backends") else {
        return;
    };
    std::env::set_var("GEMINI_API_KEY", "AIza-sdk-test");
    std::env::set_var("ANTHROPIC_API_KEY", "sk-ant-sdk-test");

    // Ollama serves.
    let ollama = MockUpstream::start(vec![
        ollama_chat("Hello from Ollama.", 21, 5),
        ollama_stream(&["Hello", " world"], 17, 9),
        ollama_stream(&["Hello", " world"], 17, 9),
    ])
    .await;
    let r = sidecar(&default_policy_at(
        &root(&ollama),
        &closed_port(),
        &closed_port(),
    ))
    .await;
    let v = run_script(&py, "native.py", &base_url(&r), &[]).await;
    assert_native_run(&v, "ollama", "Hello from Ollama.", (21, 5));
    assert_eq!(
        ollama.requests()[0].json.as_ref().unwrap()["options"]["num_predict"],
        50
    );
    r.shutdown().await;

    // Ollama down: Gemini serves.
    let gemini = MockUpstream::start(vec![
        gemini_response("Hello from Gemini.", 21, 3, 2),
        gemini_stream(&["Hello", " world"], 17, 9),
        gemini_stream(&["Hello", " world"], 17, 9),
    ])
    .await;
    let r = sidecar(&default_policy_at(
        &closed_port(),
        &format!("{}/v1beta", root(&gemini)),
        &closed_port(),
    ))
    .await;
    let v = run_script(&py, "native.py", &base_url(&r), &[]).await;
    assert_native_run(&v, "gemini", "Hello from Gemini.", (21, 5));
    assert_eq!(
        gemini.requests()[0].header("x-goog-api-key"),
        Some("AIza-sdk-test")
    );
    r.shutdown().await;

    // The ADR chain: Ollama down → Gemini 429 with RetryInfo → Claude serves.
    let gemini = MockUpstream::start_with_default(vec![], gemini_429("22s", false)).await;
    let claude = MockUpstream::start(vec![
        anthropic_message("Hello from Claude.", (15, 5, 4, 2)),
        anthropic_stream(&["Hello", " world"], 17, 9),
        anthropic_stream(&["Hello", " world"], 17, 9),
    ])
    .await;
    let r = sidecar(&default_policy_at(
        &closed_port(),
        &format!("{}/v1beta", root(&gemini)),
        &root(&claude),
    ))
    .await;
    let v = run_script(&py, "native.py", &base_url(&r), &[]).await;
    assert_native_run(&v, "claude", "Hello from Claude.", (21, 5));
    assert_eq!(
        gemini.hits(),
        3,
        "Gemini was tried (and said 429) for each request"
    );
    let first = &claude.requests()[0];
    assert_eq!(first.header("x-api-key"), Some("sk-ant-sdk-test"));
    assert_eq!(first.json.as_ref().unwrap()["system"], "be brief");
    r.shutdown().await;
}
