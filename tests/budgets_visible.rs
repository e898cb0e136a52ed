//! Budgets people can see (issue 52): a spent budget is answered as the refusal it is, never
//! as the route's static "unavailable" answer; every served answer says what it cost; dollar
//! bounds show in the limit headers.

mod common;

use common::mock::{Answer, MockUpstream};
use common::post_json;
use common::sidecar::Sidecar;
use serde_json::json as j;
use std::sync::Arc;
use tollgate::ledger::{window_at, window_end, CounterKey};
use tollgate::units::{Amount, Scope, Window};

const DATA_KEY: &str = "tg-test-key-data-budgets-visible";

/// The issue's setup: a free local backend that is down, a paid cloud fallback, a static
/// answer at the end of the chain, and team `data` with a monthly dollar budget.
fn policy(local: &str, cloud: &str, static_on_budget: bool) -> String {
    let extra = if static_on_budget {
        "\n    static_on_budget: true"
    } else {
        ""
    };
    format!(
        r#"
version: "bv-1"
identity:
  virtual_keys:
    - {{consumer: dan, team: data, key_env: BV_TEST_KEY_DATA}}
backends:
  - {{id: local, kind: openai, base_url: "{local}", price_per_1k: {{input: 0, output: 0}}}}
  - {{id: cloud, kind: openai, base_url: "{cloud}", price_per_1k: {{input: 0.001, output: 0.002}}}}
routes:
  - model: chat
    chain: [{{backend: local, model: llama}}, {{backend: cloud, model: flash}}]
    static_response: "AI is unavailable right now; try again in a few minutes"{extra}
budgets:
  - {{name: team-monthly, scope: team, match: data, window: month, hard_usd: 1}}
retry: {{same_backend_retries: 0}}
"#
    )
}

/// Spends team `data`'s month: committed usage equal to the whole budget.
fn spend_month(sc: &Sidecar) {
    let tz = sc.running.app.snap.load().policy.windows.timezone.clone();
    let now = tollgate::units::now_ms();
    let w = window_at(&tz, Window::Month, now);
    let key = CounterKey {
        scope: Scope::Team,
        id: Arc::from("data"),
        window: Some(w),
    };
    let spent = Amount {
        tokens: 0,
        requests: 0,
        usd: 1_000_000,
    };
    sc.ledger()
        .counter(&key, window_end(&tz, w))
        .add_committed(&spent);
}

async fn chat(sc: &Sidecar) -> (u16, http::HeaderMap, serde_json::Value) {
    let body =
        j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20});
    let auth = format!("Bearer {DATA_KEY}");
    let (s, h, b) = post_json(&sc.chat_url(), &body, &[("authorization", &auth)]).await;
    (s, h, serde_json::from_slice(&b).unwrap_or_default())
}

#[tokio::test]
async fn a_spent_team_budget_is_refused_not_disguised_as_an_outage() {
    std::env::set_var("BV_TEST_KEY_DATA", DATA_KEY);
    let local = MockUpstream::start(vec![Answer::status(503)]).await;
    let cloud = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&policy(&local.base_url(), &cloud.base_url(), false)).await;
    spend_month(&sc);
    let (status, h, body) = chat(&sc).await;
    assert_eq!(status, 403, "{h:?} {body}");
    assert_ne!(h["x-tollgate-backend"], "static");
    let limit = &body["error"]["tollgate"]["limit"];
    assert_eq!(limit["name"], "team-monthly", "{body}");
    assert_eq!(limit["scope"], "team");
    assert_eq!(limit["id"], "data");
    assert_eq!(limit["unit"], "usd");
    assert_eq!(cloud.hits(), 0, "the paid fallback was never called");
    sc.stop().await;
}

#[tokio::test]
async fn static_on_budget_keeps_the_static_answer_but_names_the_bound() {
    std::env::set_var("BV_TEST_KEY_DATA", DATA_KEY);
    let local = MockUpstream::start(vec![Answer::status(503)]).await;
    let cloud = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&policy(&local.base_url(), &cloud.base_url(), true)).await;
    spend_month(&sc);
    let (status, h, body) = chat(&sc).await;
    assert_eq!(status, 200, "{h:?} {body}");
    assert_eq!(h["x-tollgate-backend"], "static");
    assert_eq!(h["x-tollgate-reason"], "FALLBACK_OVER_BUDGET");
    let named = h["x-tollgate-limit"].to_str().unwrap();
    assert!(
        named.contains("team-monthly") && named.contains("data"),
        "{named}"
    );
    assert_eq!(h["x-tollgate-budget-remaining-usd"], "0");
    sc.stop().await;
}

#[tokio::test]
async fn a_provider_outage_still_gets_the_static_answer() {
    std::env::set_var("BV_TEST_KEY_DATA", DATA_KEY);
    let local = MockUpstream::start(vec![Answer::status(503)]).await;
    let cloud = MockUpstream::start(vec![Answer::status(503)]).await;
    let sc = Sidecar::start(&policy(&local.base_url(), &cloud.base_url(), false)).await;
    let (status, h, _) = chat(&sc).await;
    assert_eq!(status, 200);
    assert_eq!(h["x-tollgate-backend"], "static");
    assert!(!h.contains_key("x-tollgate-limit"));
    assert_eq!(h["x-tollgate-cost-usd"], "0");
    sc.stop().await;
}

async fn chat_body(sc: &Sidecar, body: serde_json::Value) -> (u16, http::HeaderMap, bytes::Bytes) {
    let auth = format!("Bearer {DATA_KEY}");
    post_json(&sc.chat_url(), &body, &[("authorization", &auth)]).await
}

#[tokio::test]
async fn a_buffered_answer_says_what_it_cost_and_the_dollars_left() {
    std::env::set_var("BV_TEST_KEY_DATA", DATA_KEY);
    let local = MockUpstream::start(vec![Answer::status(503)]).await;
    // 1,000 in at $0.001/1k and 500 out at $0.002/1k: $0.002.
    let cloud = MockUpstream::start(vec![Answer::ok_chat("hello", 1000, 500)]).await;
    let sc = Sidecar::start(&policy(&local.base_url(), &cloud.base_url(), false)).await;
    let body =
        j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20});
    let (status, h, _) = chat_body(&sc, body).await;
    assert_eq!(status, 200, "{h:?}");
    assert_eq!(h["x-tollgate-backend"], "cloud");
    assert_eq!(h["x-tollgate-cost-usd"], "0.002");
    // The team's $1 less what this answer really cost.
    assert_eq!(h["x-tollgate-budget-remaining-usd"], "0.998");
    let policy = h["ratelimit-policy"].to_str().unwrap();
    assert!(
        policy.contains(r#""team-monthly";q=1000000;qu="usd-micros";w=2592000"#),
        "{policy}"
    );
    let state = h["ratelimit"].to_str().unwrap();
    assert!(state.contains(r#""team-monthly";r=998000;t="#), "{state}");
    assert!(!h.contains_key("x-tollgate-limit"));
    sc.stop().await;
}

#[tokio::test]
async fn a_stream_says_its_reserved_worst_case_and_the_audit_the_actual() {
    std::env::set_var("BV_TEST_KEY_DATA", DATA_KEY);
    let local = MockUpstream::start(vec![Answer::status(503)]).await;
    let cloud = MockUpstream::start(vec![Answer::sse_chat(
        &["hel", "lo"],
        Some((10, 2)),
        std::time::Duration::ZERO,
    )])
    .await;
    let sc = Sidecar::start(&policy(&local.base_url(), &cloud.base_url(), false)).await;
    let body = j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 20, "stream": true});
    let (status, h, _) = chat_body(&sc, body).await;
    assert_eq!(status, 200, "{h:?}");
    let header: f64 = h["x-tollgate-cost-usd"].to_str().unwrap().parse().unwrap();
    let id = h["x-tollgate-request-id"].to_str().unwrap();
    let rec = sc.audit(id).await;
    assert_eq!(header, rec["worst_case_usd"].as_f64().unwrap(), "{rec}");
    // 10 in, 2 out: $0.000014, below the reserved worst case.
    assert_eq!(rec["cost_usd"].as_f64().unwrap(), 0.000014);
    assert!(header > 0.000014);
    sc.stop().await;
}

/// `tollgate check` on `yaml` (written to a temp file) with `env` set: (rc, stdout, stderr).
fn check(yaml: &str, env: &[(&str, &str)]) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    std::fs::write(&path, yaml).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.arg("check").arg(&path);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run tollgate check");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn keyed_policy(budgets: &str) -> String {
    format!(
        r#"
version: "bv-check"
identity:
  virtual_keys:
    - {{consumer: dan, team: data, key_env: BV_CHECK_KEY_DAN}}
    - {{consumer: sue, team: storefront, key_sha256: "b19c05415f6255f9b14289d9f5633fcd98be7bb0fbd3adb712e8ec69b5e706bc"}}
backends:
  - {{id: cloud, kind: openai, base_url: "http://127.0.0.1:9/v1", price_per_1k: {{input: 0.001, output: 0.002}}}}
routes:
  - {{model: chat, chain: [{{backend: cloud, model: flash}}]}}
budgets:
{budgets}
"#
    )
}

#[test]
fn a_typo_in_a_team_match_fails_check_naming_the_known_teams() {
    let yaml = keyed_policy(
        "  - {name: data-monthly, scope: team, match: dta, window: month, hard_usd: 10}",
    );
    let (rc, _, err) = check(&yaml, &[("BV_CHECK_KEY_DAN", "k")]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("budgets[0].match"), "{err}");
    assert!(err.contains("`dta`"), "{err}");
    assert!(err.contains("`data`, `storefront`"), "{err}");
    // A consumer typo and a glob that matches no team fail the same way.
    for (bound, named) in [
        (
            "  - {name: dan-day, scope: consumer, match: dna, window: day, hard_usd: 1}",
            "`dan`, `sue`",
        ),
        (
            "  - {name: teams, scope: team, match: \"team-*\", window: month, hard_usd: 1}",
            "`data`, `storefront`",
        ),
    ] {
        let (rc, _, err) = check(&keyed_policy(bound), &[("BV_CHECK_KEY_DAN", "k")]);
        assert_eq!(rc, 2, "{bound}: {err}");
        assert!(err.contains(named), "{err}");
    }
    // Real ids, a glob matching one, `*`: accepted.
    let ok = "  - {name: a, scope: team, match: data, window: month, hard_usd: 10}\n  - {name: b, scope: team, match: \"store*\", window: month, hard_usd: 10}\n  - {name: c, scope: consumer, match: \"*\", window: day, hard_usd: 1}";
    let (rc, _, err) = check(&keyed_policy(ok), &[("BV_CHECK_KEY_DAN", "k")]);
    assert_eq!(rc, 0, "{err}");
}

#[test]
fn without_keys_consumer_ids_come_from_headers_and_are_not_checked() {
    let yaml = r#"
version: "bv-nokeys"
backends:
  - {id: cloud, kind: openai, base_url: "http://127.0.0.1:9/v1", price_per_1k: {input: 0.001, output: 0.002}}
routes:
  - {model: chat, chain: [{backend: cloud, model: flash}]}
budgets:
  - {name: web-day, scope: consumer, match: web, window: day, hard_usd: 1}
"#;
    let (rc, _, err) = check(yaml, &[]);
    assert_eq!(rc, 0, "{err}");
}

#[test]
fn an_unset_virtual_key_variable_is_flagged_by_check_without_its_value() {
    let yaml = keyed_policy("  - {name: a, scope: team, match: data, window: month, hard_usd: 10}");
    let (rc, out, err) = check(&yaml, &[]);
    assert_eq!(rc, 0, "a warning, not a failure: {err}");
    assert!(
        err.contains("$BV_CHECK_KEY_DAN") && err.contains("dan"),
        "{err}"
    );
    assert!(out.contains("ok:"), "{out}");
    let secret = "tg-secret-value-never-printed";
    let (rc, out, err) = check(&yaml, &[("BV_CHECK_KEY_DAN", secret)]);
    assert_eq!(rc, 0);
    assert!(!err.contains("BV_CHECK_KEY_DAN"), "set: no warning: {err}");
    assert!(!out.contains(secret) && !err.contains(secret));
}
