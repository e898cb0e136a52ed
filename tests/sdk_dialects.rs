//! The real client libraries of every inbound dialect against the sidecar (issue 13): the
//! Anthropic SDK, google-genai, the ollama client and the OpenAI SDK's Responses API, each
//! plain, with a cross-kind fallback, and over a hard budget (their own error classes).
//!
//! Like tests/sdk.rs: the scripts in tests/sdk/ run with `TOLLGATE_SDK_PYTHON` (scripts/test
//! makes the venv); without it the tests print a note and pass, under CI they fail.

mod common;

use common::mock::{Answer, MockUpstream};
use common::native::*;
use common::sidecar::Sidecar;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

const SCRIPT_TIMEOUT: Duration = Duration::from_secs(60);
const ANTHROPIC_KEY: &str = "TOLLGATE_TEST_SDKD_ANTHROPIC_KEY";
const GEMINI_KEY: &str = "TOLLGATE_TEST_SDKD_GEMINI_KEY";

fn sdk_python(test: &str) -> Option<PathBuf> {
    match std::env::var_os("TOLLGATE_SDK_PYTHON").filter(|v| !v.is_empty()) {
        Some(p) => Some(PathBuf::from(p)),
        None if std::env::var_os("CI").is_some() => panic!(
            "{test}: TOLLGATE_SDK_PYTHON is not set, so the dialect SDK tests cannot run. \
             Run scripts/test (it creates .venv-sdk with openai, anthropic, google-genai, ollama)."
        ),
        None => {
            eprintln!("note: {test} skipped: TOLLGATE_SDK_PYTHON is not set");
            None
        }
    }
}

/// Runs `tests/sdk/<script> <mode>` against the sidecar's root URL; the JSON it printed.
async fn run(py: &PathBuf, script: &str, mode: &str, sc: &Sidecar) -> Value {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("sdk");
    let root = sc.base.trim_end_matches("/v1").to_string();
    let mut cmd = tokio::process::Command::new(py);
    cmd.arg(dir.join(script))
        .arg(mode)
        .current_dir(&dir)
        .env("TG_ROOT", &root)
        .env("PYTHONDONTWRITEBYTECODE", "1")
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
        "OLLAMA_HOST",
        "GOOGLE_API_KEY",
        "GEMINI_API_KEY",
        "ANTHROPIC_BASE_URL",
        "OPENAI_BASE_URL",
    ] {
        cmd.env_remove(k);
    }
    let out = tokio::time::timeout(SCRIPT_TIMEOUT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{script} {mode} timed out"))
        .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} {mode} failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("{script} printed no JSON ({e})\n{stdout}\n{stderr}"))
}

fn policy(base: &str, extra: &str) -> String {
    format!(
        r#"version: sdk-dialects
backends:
  - {{id: mock, kind: openai, base_url: "{base}"}}
routes:
  - {{model: chat, chain: [{{backend: mock, model: gpt-mock}}]}}
  - {{model: embed, chain: [{{backend: mock, model: embed-mock}}]}}
{extra}"#
    )
}

/// A budget no request fits: every governed call is a HARD_STOP (403).
const HARD: &str = "budgets:\n  - {name: per-request, scope: request, hard_tokens: 5}\n";

/// Anthropic primary (overloaded) → Gemini fallback.
fn fallback_policy(claude: &str, gemini: &str) -> String {
    std::env::set_var(ANTHROPIC_KEY, "sk-ant-test");
    std::env::set_var(GEMINI_KEY, "AIza-test");
    format!(
        r#"version: sdk-dialects-fallback
backends:
  - {{id: claude, kind: anthropic, base_url: "{claude}", api_key_env: {ANTHROPIC_KEY}}}
  - {{id: gem, kind: gemini, base_url: "{gemini}", api_key_env: {GEMINI_KEY}}}
routes:
  - {{model: chat, chain: [{{backend: claude, model: claude-x}}, {{backend: gem, model: gemini-x}}]}}
retry:
  same_backend_retries: 0
  max_attempts_per_job: 4
  backoff: {{initial: 1ms, max: 2ms}}
"#
    )
}

/// Runs `script`'s `error` mode against a sidecar whose hard budget no request fits; nothing
/// may reach the upstream.
async fn over_hard_budget(py: &PathBuf, script: &str) -> Value {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&policy(&up.base_url(), HARD)).await;
    let v = run(py, script, "error", &sc).await;
    assert_eq!(
        up.hits(),
        0,
        "{script}: nothing reaches the upstream over a hard budget"
    );
    v
}

/// Runs `script`'s `fallback` mode: the Anthropic primary is overloaded and Gemini answers
/// (one buffered answer, then one stream).
async fn via_fallback(py: &PathBuf, script: &str) -> Value {
    let claude = MockUpstream::start_with_default(vec![], anthropic_overloaded()).await;
    let gemini = MockUpstream::start(vec![
        gemini_response("From Gemini.", 12, 4, 0),
        gemini_stream(&["Gem", "ini"], 12, 3),
    ])
    .await;
    let sc = Sidecar::start(&fallback_policy(&root(&claude), &root(&gemini))).await;
    run(py, script, "fallback", &sc).await
}

async fn ok_upstream(extra: Vec<Answer>) -> MockUpstream {
    let mut v = vec![
        Answer::ok_chat("Hello from the mock.", 21, 5),
        Answer::sse_chat(&["Hel", "lo"], Some((17, 2)), Duration::from_millis(1)),
    ];
    v.extend(extra);
    MockUpstream::start(v).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_anthropic_create_stream_count_and_errors() {
    let Some(py) = sdk_python("sdk_anthropic") else {
        return;
    };
    let up = ok_upstream(vec![]).await;
    let sc = Sidecar::start(&policy(&up.base_url(), "")).await;
    let v = run(&py, "dialect_anthropic.py", "ok", &sc).await;
    assert_eq!(v["create"]["type"], "Message", "{v}");
    assert_eq!(v["create"]["text"], "Hello from the mock.");
    assert_eq!(v["create"]["stop_reason"], "end_turn");
    assert_eq!(
        (
            v["create"]["input"].as_u64(),
            v["create"]["output"].as_u64()
        ),
        (Some(21), Some(5))
    );
    assert_eq!(v["stream"]["text"], "Hello");
    assert_eq!(
        (
            v["stream"]["input"].as_u64(),
            v["stream"]["output"].as_u64()
        ),
        (Some(17), Some(2))
    );
    assert!(v["count"].as_u64().unwrap() > 0, "{v}");

    let v = over_hard_budget(&py, "dialect_anthropic.py").await;
    assert_eq!(v["raised"], "PermissionDeniedError", "{v}");
    assert_eq!(v["status"], 403);
    assert_eq!(v["body"]["tollgate"]["final_action"], "HARD_STOP");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_anthropic_falls_back_to_gemini() {
    let Some(py) = sdk_python("sdk_anthropic_fallback") else {
        return;
    };
    let v = via_fallback(&py, "dialect_anthropic.py").await;
    assert_eq!(v["create"]["text"], "From Gemini.", "{v}");
    assert_eq!(
        (
            v["create"]["input"].as_u64(),
            v["create"]["output"].as_u64()
        ),
        (Some(12), Some(4))
    );
    assert_eq!(v["stream"]["text"], "Gemini");
    assert_eq!(v["stream"]["output"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_gemini_generate_stream_count_and_errors() {
    let Some(py) = sdk_python("sdk_gemini") else {
        return;
    };
    let up = ok_upstream(vec![]).await;
    let sc = Sidecar::start(&policy(&up.base_url(), "")).await;
    let v = run(&py, "dialect_gemini.py", "ok", &sc).await;
    assert_eq!(v["generate"]["text"], "Hello from the mock.", "{v}");
    assert_eq!(v["generate"]["prompt"], 21);
    assert_eq!(v["generate"]["candidates"], 5);
    assert_eq!(v["stream"]["text"], "Hello");
    assert_eq!(v["stream"]["candidates"], 2);
    assert!(v["count"].as_u64().unwrap() > 0, "{v}");

    let v = over_hard_budget(&py, "dialect_gemini.py").await;
    assert_eq!(v["raised"], "ClientError", "{v}");
    assert_eq!(v["code"], 403);
    assert_eq!(v["status"], "PERMISSION_DENIED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_gemini_client_falls_back_from_anthropic() {
    let Some(py) = sdk_python("sdk_gemini_fallback") else {
        return;
    };
    let v = via_fallback(&py, "dialect_gemini.py").await;
    assert_eq!(v["generate"]["text"], "From Gemini.", "{v}");
    assert_eq!(v["stream"]["text"], "Gemini");
    assert_eq!(v["stream"]["candidates"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_ollama_chat_stream_generate_embed_list_and_errors() {
    let Some(py) = sdk_python("sdk_ollama") else {
        return;
    };
    let up = ok_upstream(vec![
        Answer::ok_chat("Generated.", 7, 2),
        Answer::ok_embedding(3, 2),
    ])
    .await;
    let sc = Sidecar::start(&policy(&up.base_url(), "")).await;
    let v = run(&py, "dialect_ollama.py", "ok", &sc).await;
    assert_eq!(v["chat"]["text"], "Hello from the mock.", "{v}");
    assert_eq!(v["chat"]["done"], true);
    assert_eq!(
        (
            v["chat"]["prompt_eval_count"].as_u64(),
            v["chat"]["eval_count"].as_u64()
        ),
        (Some(21), Some(5))
    );
    assert_eq!(v["stream"]["text"], "Hello");
    assert_eq!(v["stream"]["eval_count"], 2);
    assert_eq!(v["generate"], "Generated.");
    assert_eq!(v["embed_dims"], 3);
    assert_eq!(v["models"], serde_json::json!(["chat", "embed"]));

    let v = over_hard_budget(&py, "dialect_ollama.py").await;
    assert_eq!(v["raised"], "ResponseError", "{v}");
    assert_eq!(v["status"], 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_ollama_client_falls_back_from_anthropic() {
    let Some(py) = sdk_python("sdk_ollama_fallback") else {
        return;
    };
    let v = via_fallback(&py, "dialect_ollama.py").await;
    assert_eq!(v["chat"]["text"], "From Gemini.", "{v}");
    assert_eq!(v["stream"]["text"], "Gemini");
    assert_eq!(v["stream"]["eval_count"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_responses_create_stream_and_errors() {
    let Some(py) = sdk_python("sdk_responses") else {
        return;
    };
    let up = ok_upstream(vec![]).await;
    let sc = Sidecar::start(&policy(&up.base_url(), "")).await;
    let v = run(&py, "dialect_responses.py", "ok", &sc).await;
    assert_eq!(v["create"]["type"], "Response", "{v}");
    assert_eq!(v["create"]["text"], "Hello from the mock.");
    assert_eq!(
        (
            v["create"]["input"].as_u64(),
            v["create"]["output"].as_u64()
        ),
        (Some(21), Some(5))
    );
    assert_eq!(v["stream"]["text"], "Hello");
    assert_eq!(v["stream"]["final_text"], "Hello");
    assert_eq!(v["stream"]["output"], 2);
    assert_eq!(v["stream"]["types"][0], "response.created");

    let v = over_hard_budget(&py, "dialect_responses.py").await;
    assert_eq!(v["raised"], "PermissionDeniedError", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_responses_falls_back_from_anthropic() {
    let Some(py) = sdk_python("sdk_responses_fallback") else {
        return;
    };
    let v = via_fallback(&py, "dialect_responses.py").await;
    assert_eq!(v["create"]["text"], "From Gemini.", "{v}");
    assert_eq!(v["stream"]["text"], "Gemini");
    assert_eq!(v["stream"]["output"], 3);
}
