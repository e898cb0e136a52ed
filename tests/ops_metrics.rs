//! Metrics and the admin API over real HTTP: the real sidecar on port 0, in-process mock
//! upstreams, `/metrics` scraped after traffic and compared value by value with what the
//! mocks reported and the audit trail recorded.
//!
//! The Prometheus recorder is process-wide, so the tests of this binary that compare
//! counters take a lock and compare deltas (before/after), and each uses its own backend ids.

mod common;
mod ops_support;

use common::mock::{Answer, MockUpstream};
use common::sidecar::Sidecar;
use common::{get, post_json};
use ops_support::{post_reload, scrape, status};
use serde_json::{json as j, Value};
use std::collections::BTreeMap;
use std::time::Duration;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn chat(content: &str) -> Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": content}], "max_tokens": 50})
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn policy(a: &MockUpstream, b: &MockUpstream) -> String {
    format!(
        r#"version: ops-m-1
backends:
  - {{id: m1a, kind: openai, base_url: "{a}", price_per_1k: {{input: 0, output: 0}},
     circuit: {{failure_threshold: 3, recovery_timeout: 60s, half_open_max_calls: 1}}}}
  - {{id: m1b, kind: openai, base_url: "{b}", price_per_1k: {{input: 1.0, output: 2.0}}}}
routes:
  - model: chat
    chain: [{{backend: m1a, model: up-a}}, {{backend: m1b, model: up-b}}]
retry: {{max_attempts_per_job: 4, same_backend_retries: 0, retry_on: [500, 502, 503, 504]}}
quotas:
  - {{name: m1b-daily, scope: backend, match: m1b, window: day, limit_tokens: 1000, alert_at: [0.9]}}
budgets:
  - {{name: m1-monthly, scope: global, window: month, hard_usd: 10}}
audit: {{sink: jsonl}}
"#,
        a = a.base_url(),
        b = b.base_url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_traffic_have_names_labels_and_values() {
    let _serial = SERIAL.lock().await;
    // m1a always fails with 503; m1b answers with known usage, the last time as a stream.
    let a = MockUpstream::start_with_default(vec![], Answer::status(503)).await;
    let b = MockUpstream::start(vec![
        Answer::ok_chat("one", 10, 5),
        Answer::ok_chat("two", 10, 5),
        Answer::ok_chat("three", 10, 5),
        Answer::sse_chat(&["x", "y"], Some((7, 3)), Duration::from_millis(5)),
    ])
    .await;
    let sc = Sidecar::start(&policy(&a, &b)).await;
    let admin = sc.running.admin_addr;
    let before = scrape(admin).await;

    let mut ids = Vec::new();
    for i in 0..3 {
        let (code, h, _) = post_json(&sc.chat_url(), &chat(&format!("hello {i}")), &[]).await;
        assert_eq!(code, 200);
        ids.push(h["x-tollgate-request-id"].to_str().unwrap().to_string());
    }
    let mut body = chat("stream please");
    body["stream"] = j!(true);
    let s = common::post_json_frames(&sc.chat_url(), &body, &[]).await;
    assert_eq!(s.status, 200, "{}", s.text());
    // The stream's record is written when it settles (after the body ended).
    let mut audits = Vec::new();
    for id in &ids {
        audits.push(sc.audit(id).await);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while sc.audit_text().lines().count() < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "stream record missing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lines: Vec<Value> = sc
        .audit_text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();

    let after = scrape(admin).await;
    let d =
        |name: &str, labels: &[(&str, &str)]| after.get(name, labels) - before.get(name, labels);

    // Tokens: exactly the mock's usage sums (3×(10,5) buffered + (7,3) streamed).
    let tin = d(
        "ai_tokens_total",
        &[
            ("provider", "m1b"),
            ("model", "up-b"),
            ("direction", "input"),
        ],
    );
    let tout = d(
        "ai_tokens_total",
        &[
            ("provider", "m1b"),
            ("model", "up-b"),
            ("direction", "output"),
        ],
    );
    assert_eq!((tin, tout), (37.0, 18.0), "{}", after.text);
    // Attempts: m1a failed 3 times with 5xx, then its circuit opened (threshold 3) and the
    // stream went straight to m1b; m1b answered 4 times.
    assert_eq!(
        d(
            "ai_requests_total",
            &[("provider", "m1a"), ("outcome", "failure")]
        ),
        3.0
    );
    assert_eq!(
        d(
            "ai_requests_failed_total",
            &[("provider", "m1a"), ("class", "5xx")]
        ),
        3.0
    );
    assert_eq!(
        d(
            "ai_requests_total",
            &[("provider", "m1b"), ("outcome", "success")]
        ),
        4.0
    );
    assert_eq!(
        d(
            "ai_requests_total",
            &[("provider", "m1a"), ("outcome", "success")]
        ),
        0.0
    );
    assert_eq!(a.hits(), 3);
    // Cost: (10×1 + 5×2)/1000 × 3 + (7×1 + 3×2)/1000 = 0.073 USD, the audit's sum.
    let audit_cost: f64 = lines.iter().map(|v| v["cost_usd"].as_f64().unwrap()).sum();
    assert!(close(audit_cost, 0.073), "audit cost {audit_cost}");
    assert!(
        close(
            after.get("ai_cost_usd_total", &[("provider", "m1b")]),
            0.073
        ),
        "{}",
        after.text
    );
    assert_eq!(
        after.types.get("ai_cost_usd_total").map(String::as_str),
        Some("counter")
    );
    // Durations: one observation per attempt; overhead: one per buffered request.
    assert_eq!(
        d("ai_request_duration_seconds_count", &[("provider", "m1b")]),
        4.0
    );
    assert_eq!(
        d("ai_request_duration_seconds_count", &[("provider", "m1a")]),
        3.0
    );
    assert_eq!(d("tollgate_overhead_seconds_count", &[]), 3.0);
    // Decisions: one per request, labelled as the audit says.
    let mut by: BTreeMap<(String, String), f64> = BTreeMap::new();
    for v in &lines {
        let k = (
            v["final_action"].as_str().unwrap().to_string(),
            v["reason_class"].as_str().unwrap().to_string(),
        );
        *by.entry(k).or_default() += 1.0;
    }
    for ((action, reason), n) in &by {
        let got = d(
            "tollgate_decisions_total",
            &[("action", action), ("reason", reason)],
        );
        assert_eq!(got, *n, "decisions {action}/{reason}");
    }
    // Gauges computed at scrape time.
    assert_eq!(
        after.get("tollgate_circuit_state", &[("backend", "m1a")]),
        2.0
    );
    assert_eq!(
        after.get("tollgate_circuit_state", &[("backend", "m1b")]),
        0.0
    );
    let q = after
        .find("tollgate_quota_used_ratio", &[("quota", "m1b-daily")])
        .unwrap();
    assert!(close(q, 55.0 / 1000.0), "quota ratio {q}");
    let bu = after
        .find("tollgate_budget_used_ratio", &[("budget", "m1-monthly")])
        .unwrap();
    assert!(close(bu, 0.073 / 10.0), "budget ratio {bu}");
    assert_eq!(after.get("tollgate_reserved_tokens", &[]), 0.0);
    assert_eq!(
        after.get("tollgate_policy_info", &[("version", "ops-m-1")]),
        1.0
    );

    // Every name of OPERATIONS.md is there, with help text.
    for name in [
        "ai_tokens_total",
        "ai_requests_failed_total",
        "ai_requests_total",
        "ai_cost_usd_total",
        "ai_request_duration_seconds",
        "tollgate_overhead_seconds",
        "tollgate_decisions_total",
        "tollgate_circuit_state",
        "tollgate_quota_used_ratio",
        "tollgate_budget_used_ratio",
        "tollgate_reserved_tokens",
        "tollgate_policy_info",
    ] {
        assert!(after.help.contains_key(name), "no HELP for {name}");
    }
    assert_eq!(after.types["ai_request_duration_seconds"], "histogram");
    assert_eq!(after.types["tollgate_overhead_seconds"], "histogram");
    // Bounded labels: no request id, path or message anywhere.
    for id in &ids {
        assert!(
            !after.text.contains(id.as_str()),
            "request id {id} in metrics"
        );
    }
    assert!(!after.text.contains("/v1/"), "a path in metrics");
    assert!(!after.text.contains("hello"), "content in metrics");

    // The status JSON agrees with the same traffic.
    let st = status(admin).await;
    assert_eq!(st["policy"]["version"], "ops-m-1");
    assert_eq!(st["tokens_today"]["m1b"], 55);
    assert_eq!(st["tokens_today"]["m1a"], 0);
    assert!(close(st["cost_month_usd"].as_f64().unwrap(), 0.073), "{st}");
    let be: BTreeMap<&str, &Value> = st["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (b["id"].as_str().unwrap(), b))
        .collect();
    assert_eq!(be["m1a"]["circuit"], "OPEN");
    assert_eq!(be["m1a"]["health"], "red");
    assert_eq!(be["m1a"]["requests"], 3);
    assert_eq!(be["m1a"]["success_rate"], 0.0);
    assert_eq!(be["m1b"]["health"], "green");
    assert_eq!(be["m1b"]["requests"], 4);
    assert_eq!(be["m1b"]["success_rate"], 1.0);
    assert!(be["m1b"]["avg_latency_ms"].as_f64().is_some());
    assert_eq!(st["open_circuits"], j!(["m1a"]));
    let limits = st["limits"].as_array().unwrap();
    let quota = limits.iter().find(|l| l["name"] == "m1b-daily").unwrap();
    assert_eq!(
        (quota["used"].as_u64(), quota["limit"].as_u64()),
        (Some(55), Some(1000))
    );
    assert_eq!(quota["alert_at"], j!([0.9]));
    assert_eq!(quota["state"], "ok");
    let budget = limits.iter().find(|l| l["name"] == "m1-monthly").unwrap();
    // Money in dollars (never micro-units), also as text.
    assert_eq!(
        (budget["dim"].as_str(), budget["used"].as_f64()),
        (Some("usd"), Some(0.073))
    );
    assert_eq!(budget["used_text"], "$0.073");

    sc.stop().await;
}

#[tokio::test]
async fn health_readiness_and_reload_auth() {
    let b = MockUpstream::start(vec![]).await;
    let yaml = format!(
        "version: ops-auth-1\nbackends:\n  - {{id: auth-b, kind: openai, base_url: \"{}\"}}\nroutes:\n  - model: chat\n    chain: [{{backend: auth-b, model: m}}]\n",
        b.base_url()
    );
    let sc = Sidecar::start(&yaml).await;
    let admin = sc.running.admin_addr;
    let (code, _, body) = get(&format!("http://{admin}/healthz")).await;
    assert_eq!((code, &body[..]), (200, &b"ok\n"[..]));
    let (code, _, _) = get(&format!("http://{admin}/readyz")).await;
    assert_eq!(code, 200);
    // A state store that does not answer makes the sidecar unready, with the reason.
    sc.running.ops.set_state_check(std::sync::Arc::new(|| {
        Box::pin(async { Err("connection refused".to_string()) })
    }));
    let (code, _, body) = get(&format!("http://{admin}/readyz")).await;
    assert_eq!(code, 503);
    assert!(String::from_utf8_lossy(&body).contains("connection refused"));
    sc.running
        .ops
        .set_state_check(std::sync::Arc::new(|| Box::pin(async { Ok(()) })));
    assert_eq!(get(&format!("http://{admin}/readyz")).await.0, 200);

    // No token configured: the mutating call is refused and says how to enable it.
    sc.running.ops.set_token(None);
    let (code, body) = post_reload(admin, Some("anything")).await;
    assert_eq!(code, 403);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("TOLLGATE_ADMIN_TOKEN"));
    // With a token: missing or wrong is 401, never echoing what was sent.
    sc.running.ops.set_token(Some("s3cret-admin-token".into()));
    let (code, _) = post_reload(admin, None).await;
    assert_eq!(code, 401);
    let (code, body) = post_reload(admin, Some("s3cret-admin-tokeX")).await;
    assert_eq!(code, 401);
    assert!(!body.to_string().contains("s3cret"));
    // Right token, but this sidecar has no policy path: a clear 409.
    let (code, body) = post_reload(admin, Some("s3cret-admin-token")).await;
    assert_eq!(code, 409, "{body}");
    // The status and dashboard never show the token.
    let st = status(admin).await;
    assert!(!st.to_string().contains("s3cret"));
    let (code, h, page) = get(&format!("http://{admin}/")).await;
    assert_eq!(code, 200);
    assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
    assert!(!String::from_utf8_lossy(&page).contains("s3cret"));
    assert_eq!(get(&format!("http://{admin}/nope")).await.0, 404);
    sc.stop().await;
}
