//! The governed proxy over real HTTP (issue 3, §9): the real sidecar in-process on port 0,
//! in-process mock upstreams, a plain hyper client.
//!
//! - the eight shared scenarios (tests/scenarios/shared) replayed over HTTP with the same
//!   expectations;
//! - bad input: each a clear OpenAI-style error, and the process keeps serving;
//! - the upstream request rewrite (model, output cap, our key, never the client's key);
//! - a non-retryable upstream 400/422 passed through unchanged, no other backend called;
//! - usage reconciliation (ACTUAL from the provider, ESTIMATED from our own count).
//!
//! Every test starts its own sidecar and mocks, so they run in parallel.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::mock::{Answer, MockUpstream};
use common::sidecar::Sidecar;
use common::{get, json, post_json};
use http::{HeaderMap, Method};
use serde_json::{json as j, Value};
use tollgate::estimate::{self, Endpoint, Tokenizer};
use tollgate::governor::CircuitState;
use tollgate::ledger::{window_at, window_end, CounterKey};
use tollgate::scenario::ScenarioFile;
use tollgate::units::{usd_to_micros, Amount, Scope};

fn now_ms() -> i64 {
    jiff::Timestamp::now().as_millisecond()
}

fn hdr<'a>(h: &'a HeaderMap, name: &str) -> &'a str {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("missing header {name}: {h:?}"))
}

/// The counter of `consumer`'s job `id` (job ledgers belong to a consumer).
fn job_key(consumer: &str, id: &str) -> CounterKey {
    CounterKey {
        scope: Scope::Job,
        id: tollgate::ledger::job_key(consumer, id),
        window: None,
    }
}

/// A chat body with one user message.
fn chat(content: &str, max_tokens: Option<u64>) -> Value {
    let mut v = j!({"model": "chat", "messages": [{"role": "user", "content": content}]});
    if let Some(m) = max_tokens {
        v["max_tokens"] = j!(m);
    }
    v
}

/// A chat body whose estimate (by the sidecar's own estimator) is exactly `target` tokens, so
/// a scenario's `input_tokens` is reproduced over HTTP.
fn chat_with_input_tokens(
    target: u64,
    max_tokens: Option<u64>,
    n: Option<u32>,
    tok: Tokenizer,
) -> Value {
    let mut words: i64 = target as i64 - 7;
    for _ in 0..50 {
        let content = vec!["hello"; words.max(1) as usize].join(" ");
        let mut body = chat(&content, max_tokens);
        if let Some(n) = n {
            body["n"] = j!(n);
        }
        let e = estimate::estimate(Endpoint::Chat, &body, tok)
            .expect("estimate")
            .input_tokens;
        if e == target {
            return body;
        }
        words += target as i64 - e as i64;
    }
    panic!("could not build a prompt of exactly {target} tokens");
}

/// The headers every governed response carries (SPEC §3).
fn assert_stamped(h: &HeaderMap, version: &str) {
    for n in [
        "x-tollgate-request-id",
        "x-tollgate-action",
        "x-tollgate-reason",
        "x-tollgate-backend",
    ] {
        assert!(h.contains_key(n), "missing {n}: {h:?}");
    }
    assert_eq!(hdr(h, "x-tollgate-policy-version"), version);
}

/// An OpenAI-style sidecar error: `error.{message,type,code,param}` and the `tollgate` object
/// with the eight fields and the request id.
fn assert_error_shape(v: &Value) {
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "error.message: {v}"
    );
    assert!(e["type"].is_string(), "error.type: {v}");
    assert!(e["code"].is_string(), "error.code: {v}");
    assert!(
        e.get("param").is_some(),
        "error.param present (maybe null): {v}"
    );
    let t = &v["tollgate"];
    for f in EIGHT {
        assert!(t[f].is_string(), "tollgate.{f}: {v}");
    }
    assert!(t["request_id"].is_string(), "tollgate.request_id: {v}");
}

const EIGHT: [&str; 8] = [
    "budget_state",
    "quota_state",
    "circuit_state",
    "retry_state",
    "usage_evidence_state",
    "fallback_state",
    "final_action",
    "reason_class",
];

// ---------------------------------------------------------------------------------------------
// 1. The eight shared scenarios over HTTP
// ---------------------------------------------------------------------------------------------

/// What a replay saw, for scenario-specific extra checks.
struct Replayed {
    sidecar: Sidecar,
    mocks: BTreeMap<String, MockUpstream>,
    status: u16,
    headers: HeaderMap,
    body: Bytes,
    audit: Value,
    elapsed: Duration,
    /// The estimate of the prompt sent (equal to the scenario's input_tokens).
    input_tokens: u64,
    job: String,
}

/// Plays a shared scenario file over HTTP:
/// - the inline policy, with every backend's `base_url` pointed at its own mock upstream;
/// - `upstream:` answers scripted on those mocks (200 + usage → a chat completion with that
///   usage; other statuses → an OpenAI error body; `retry_after` → a `retry-after` header);
/// - `state:` seeded into the running sidecar's ledger and circuits, times taken relative to
///   the real clock (a circuit opened 5 s before the scenario's `now` is opened 5 s ago);
/// - the request as a chat body whose estimate is exactly the scenario's `input_tokens`, with
///   `max_tokens` = `max_output_tokens` and the consumer / job headers;
/// - then every `expect:` field checked on the HTTP response: status, `x-tollgate-action` /
///   `x-tollgate-reason`, the `tollgate` object of a refusal, `Retry-After`, which mocks were
///   hit, circuit states after — and the eight fields in the audit record of the request.
async fn replay(name: &str) -> Replayed {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/scenarios/shared")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let sc: ScenarioFile = serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
    let scen_now = sc
        .now
        .parse::<jiff::Timestamp>()
        .expect("now")
        .as_millisecond();

    // Mocks, one per backend, scripted from `upstream:`.
    let mut policy_v = sc.policy.clone();
    let mut mocks = BTreeMap::new();
    let backends = policy_v
        .get_mut("backends")
        .and_then(|b| b.as_sequence_mut())
        .expect("inline policy with backends");
    for b in backends.iter_mut() {
        let id = b
            .get("id")
            .and_then(|v| v.as_str())
            .expect("backend id")
            .to_string();
        let script: Vec<Answer> = sc
            .upstream
            .get(&id)
            .map(|answers| {
                answers
                    .iter()
                    .map(|a| {
                        assert!(
                            a.error.is_none(),
                            "{name}: transport errors are not replayed here"
                        );
                        let status = a.status.unwrap_or(200);
                        let mut ans = if (200..300).contains(&status) {
                            match a.usage {
                                Some(u) => Answer::ok_chat(
                                    a.text.as_deref().unwrap_or("ok"),
                                    u.input_tokens,
                                    u.output_tokens,
                                ),
                                None => Answer::ok_chat_no_usage(a.text.as_deref().unwrap_or("ok")),
                            }
                        } else {
                            Answer::status(status)
                        };
                        if let Some(ra) = a.retry_after {
                            ans = ans.header("retry-after", &format!("{ra}"));
                        }
                        ans
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mock = MockUpstream::start(script).await;
        let m = b.as_mapping_mut().unwrap();
        m.insert("base_url".into(), mock.base_url().into());
        mocks.insert(id, mock);
    }
    let yaml = serde_norway::to_string(&policy_v).unwrap();
    let sidecar = Sidecar::start(&yaml).await;
    let policy = sidecar.running.app.snap.load_full();
    let policy = &policy.policy;
    let tz = &policy.windows.timezone;
    let gov = &sidecar.running.app.governor;

    // Seed the state relative to the real clock.
    let now = now_ms();
    let req = &sc.request;
    let job = req.job.clone().expect("scenario request has a job");
    assert!(
        sc.state.reserved.is_empty(),
        "{name}: reserved seeds are not replayed here"
    );
    for s in &sc.state.usage {
        assert!(s.at.is_none(), "{name}: `at` seeds are not replayed here");
        let owner = req.consumer.as_deref().unwrap_or("default");
        let id: Arc<str> = match (s.scope, &s.id) {
            (Scope::Global, _) => Arc::from("global"),
            (Scope::Job, id) => tollgate::ledger::job_key(owner, id.as_deref().unwrap_or(&job)),
            (_, Some(id)) => Arc::from(id.as_str()),
            (_, None) => Arc::from(job.as_str()),
        };
        let window = s.window.map(|w| window_at(tz, w, now));
        let expires = window.map_or(i64::MAX, |k| window_end(tz, k));
        gov.ledger
            .counter(
                &CounterKey {
                    scope: s.scope,
                    id,
                    window,
                },
                expires,
            )
            .add_committed(&Amount {
                tokens: s.tokens,
                requests: s.requests,
                usd: usd_to_micros(s.usd),
            });
    }
    for js in &sc.state.jobs {
        let owner = js
            .consumer
            .as_deref()
            .or(req.consumer.as_deref())
            .unwrap_or("default");
        gov.ledger.set_job(
            tollgate::ledger::job_key(owner, &js.id),
            js.attempts,
            js.fallbacks,
            now,
        );
    }
    for c in &sc.state.circuits {
        let state = match c.state.as_str() {
            "CLOSED" => CircuitState::Closed,
            "OPEN" => CircuitState::Open,
            "HALF_OPEN" => CircuitState::HalfOpen,
            other => panic!("{name}: circuit state {other}"),
        };
        let offset = c
            .opened_at
            .as_deref()
            .map(|t| t.parse::<jiff::Timestamp>().unwrap().as_millisecond() - scen_now)
            .unwrap_or(0);
        let opened_at = now + offset;
        let recovery = policy
            .backend(&c.backend)
            .unwrap()
            .circuit
            .recovery_timeout
            .as_millis() as i64;
        gov.circuit(&Arc::from(c.backend.as_str())).restore(
            state,
            c.consecutive_failures,
            opened_at,
            opened_at + recovery,
            c.probes_in_flight,
        );
    }

    // The request.
    assert!(
        req.body.is_none() && !req.stream,
        "{name}: only line-form requests are replayed"
    );
    let input_tokens = req.input_tokens.expect("input_tokens");
    let mut body = chat_with_input_tokens(
        input_tokens,
        req.max_output_tokens,
        req.n,
        policy.estimate.tokenizer,
    );
    body["model"] = j!(req.model.clone().expect("model"));
    let consumer = req.consumer.clone().unwrap_or_else(|| "default".into());
    let request_id = format!("replay-{}", &name[..2]);
    let t0 = Instant::now();
    let (status, headers, rbody) = post_json(
        &sidecar.chat_url(),
        &body,
        &[
            ("x-tollgate-consumer", consumer.as_str()),
            ("x-tollgate-job", job.as_str()),
            ("x-request-id", request_id.as_str()),
        ],
    )
    .await;
    let elapsed = t0.elapsed();
    let ctx = format!(
        "{name}: {status} {headers:?} {}",
        String::from_utf8_lossy(&rbody)
    );
    let e = &sc.expect;

    // The HTTP response.
    assert_stamped(&headers, &policy.version);
    assert_eq!(hdr(&headers, "x-tollgate-request-id"), request_id, "{ctx}");
    if let Some(s) = e.http_status {
        assert_eq!(status, s, "http_status: {ctx}");
    }
    if let Some(a) = &e.final_action {
        assert_eq!(
            hdr(&headers, "x-tollgate-action"),
            a,
            "x-tollgate-action: {ctx}"
        );
    }
    if let Some(r) = &e.reason_class {
        assert_eq!(
            hdr(&headers, "x-tollgate-reason"),
            r,
            "x-tollgate-reason: {ctx}"
        );
    }
    match e.retry_after {
        Some(ra) => assert_eq!(
            hdr(&headers, "retry-after"),
            ra.to_string(),
            "Retry-After: {ctx}"
        ),
        None if status == 200 => assert!(!headers.contains_key("retry-after"), "{ctx}"),
        None => {}
    }
    let audit = sidecar.audit(&request_id).await;
    let expected: [(&str, &Option<String>); 8] = [
        ("budget_state", &e.budget_state),
        ("quota_state", &e.quota_state),
        ("circuit_state", &e.circuit_state),
        ("retry_state", &e.retry_state),
        ("usage_evidence_state", &e.usage_evidence_state),
        ("fallback_state", &e.fallback_state),
        ("final_action", &e.final_action),
        ("reason_class", &e.reason_class),
    ];
    if status == 200 {
        let v = json(&rbody);
        assert_eq!(v["object"], "chat.completion", "{ctx}");
        assert!(
            v.get("tollgate").is_none(),
            "an upstream answer carries no tollgate object: {ctx}"
        );
    } else {
        // A refusal the sidecar made itself: OpenAI error body + the tollgate object.
        let v = json(&rbody);
        assert_error_shape(&v);
        let t = &v["tollgate"];
        for (f, want) in &expected {
            if let Some(w) = want {
                assert_eq!(t[*f], j!(w), "tollgate.{f}: {ctx}");
            }
        }
        assert_eq!(t["request_id"], request_id, "{ctx}");
        if let Some(ra) = e.retry_after {
            assert_eq!(t["retry_after"], j!(ra), "{ctx}");
        }
        let ty = v["error"]["type"].as_str().unwrap();
        match status {
            403 => assert_eq!(ty, "insufficient_quota", "{ctx}"),
            429 => assert_eq!(ty, "rate_limit_exceeded", "{ctx}"),
            503 => assert_eq!(ty, "service_unavailable", "{ctx}"),
            _ => {}
        }
    }
    for (f, want) in &expected {
        if let Some(w) = want {
            assert_eq!(audit[*f], j!(w), "audit {f}: {ctx}\naudit: {audit}");
        }
    }
    if let Some(calls) = &e.calls {
        assert_eq!(audit["calls"], j!(calls), "audit calls: {ctx}");
        for (id, m) in &mocks {
            let want = calls.iter().filter(|c| *c == id).count();
            assert_eq!(m.hits(), want, "{name}: hits on mock `{id}`");
        }
    }
    if let Some(map) = &e.circuit_after {
        for (b, want) in map {
            let got = gov.circuit(&Arc::from(b.as_str())).state_at(now_ms());
            assert_eq!(got.as_str(), want, "{name}: circuit_after.{b}");
        }
    }
    // Nothing stays reserved once the request is answered.
    assert_eq!(
        gov.ledger.reserved_tokens(),
        0,
        "{name}: reserved after the request"
    );
    Replayed {
        sidecar,
        mocks,
        status,
        headers,
        body: rbody,
        audit,
        elapsed,
        input_tokens,
        job,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_01_baseline_allowed() {
    let r = replay("01-baseline-allowed.yaml").await;
    assert_eq!(r.status, 200);
    assert_eq!(hdr(&r.headers, "x-tollgate-backend"), "primary");
    // The provider's usage (480 + 320) is what is committed, on the job and the consumer's day.
    assert_eq!(r.sidecar.committed(&job_key("alice", &r.job)).tokens, 800);
    let tz = r
        .sidecar
        .running
        .app
        .snap
        .load()
        .policy
        .windows
        .timezone
        .clone();
    let day = CounterKey {
        scope: Scope::Consumer,
        id: Arc::from("alice"),
        window: Some(window_at(&tz, tollgate::units::Window::Day, now_ms())),
    };
    assert_eq!(r.sidecar.committed(&day).tokens, 800);
    // A token limit applies (no rate limit here: the tightest token bound, the job's 30000
    // hard), counted after this buffered answer's actual usage of 480 + 320, not its worst case.
    assert_eq!(hdr(&r.headers, "x-ratelimit-remaining-tokens"), "29200");
    assert_eq!(hdr(&r.headers, "x-ratelimit-limit-tokens"), "30000");
    assert_eq!(r.audit["actual_input_tokens"], 480);
    assert_eq!(r.audit["actual_output_tokens"], 320);
    assert_eq!(r.input_tokens, 500);
    let sent = r.mocks["primary"].last_request().unwrap();
    assert_eq!(sent.model(), Some("small"));
    assert_eq!(sent.json.as_ref().unwrap()["max_tokens"], 500);
    assert_eq!(
        json(&r.body)["usage"]["total_tokens"],
        800,
        "the upstream body reaches the client unchanged"
    );
    r.sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_02_quota_exhausted_circuit_healthy() {
    let r = replay("02-quota-exhausted-circuit-healthy.yaml").await;
    assert_eq!(hdr(&r.headers, "x-tollgate-backend"), "none");
    let v = json(&r.body);
    assert_eq!(v["error"]["code"], "quota_blocked");
    // The same consumer retrying does not get around it.
    let again = chat_with_input_tokens(500, Some(500), None, r.sidecar.tokenizer());
    let (s, h, _) = post_json(
        &r.sidecar.chat_url(),
        &again,
        &[("x-tollgate-consumer", "alice"), ("x-tollgate-job", "J2b")],
    )
    .await;
    assert_eq!(s, 403);
    assert_eq!(hdr(&h, "x-tollgate-reason"), "QUOTA_BLOCKED");
    assert_eq!(r.mocks["primary"].hits(), 0);
    // Another consumer is not blocked by alice's quota.
    let (s, h, _) = post_json(
        &r.sidecar.chat_url(),
        &again,
        &[("x-tollgate-consumer", "bob")],
    )
    .await;
    assert_eq!(s, 200, "{h:?}");
    r.sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_03_retry_budget_exhausted_with_retry_after() {
    // The scenario's Retry-After (10 s) is kept as is: it is within max_retry_after (30 s), but
    // the job's attempt budget (2, one already used) is spent by the first call, so the sidecar
    // must not wait it out — it DEFERs at once with the upstream's Retry-After. Waiting would
    // show up as ≥ 10 s of latency, which the elapsed-time bound below rules out.
    let r = replay("03-retry-budget-exhausted-with-retry-after.yaml").await;
    assert!(
        r.elapsed < Duration::from_secs(5),
        "no in-request wait: took {:?}",
        r.elapsed
    );
    assert_eq!(r.audit["job_attempts"], 2);
    assert_eq!(r.mocks["primary"].hits(), 1);
    // The failed call consumed nothing: the job counter is back to its seed.
    assert_eq!(r.sidecar.committed(&job_key("alice", "J3")).tokens, 22000);
    assert_eq!(r.sidecar.reserved(&job_key("alice", "J3")).tokens, 0);
    r.sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_04_circuit_open() {
    // Seeded OPEN 5 s ago with a 30 s recovery: Retry-After is the 25 s left.
    let r = replay("04-circuit-open.yaml").await;
    assert_eq!(hdr(&r.headers, "x-tollgate-backend"), "none");
    assert_eq!(r.mocks["primary"].hits(), 0);
    r.sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_05_actual_crosses_soft_budget() {
    let r = replay("05-actual-crosses-soft-budget.yaml").await;
    // 19000 seeded + the actual 600 + 800.
    assert_eq!(r.sidecar.committed(&job_key("alice", "J5")).tokens, 20400);
    assert_eq!(hdr(&r.headers, "x-tollgate-backend"), "primary");
    r.sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_06_fallback_dearer_than_remaining_budget() {
    let r = replay("06-fallback-dearer-than-remaining-budget.yaml").await;
    assert_eq!(r.mocks["primary"].hits(), 1);
    assert_eq!(
        r.mocks["fallback"].hits(),
        0,
        "the fallback whose worst case does not fit is never called"
    );
    assert_eq!(
        r.sidecar.committed(&job_key("alice", "J6")).usd,
        usd_to_micros(0.024)
    );
    assert_eq!(r.sidecar.reserved(&job_key("alice", "J6")), Amount::ZERO);
    let v = json(&r.body);
    assert_eq!(v["error"]["code"], "fallback_over_budget");
    r.sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_07_worst_case_over_hard_budget() {
    let r = replay("07-worst-case-over-hard-budget.yaml").await;
    assert_eq!(r.mocks["primary"].hits(), 0);
    assert_eq!(r.sidecar.committed(&job_key("alice", "J7")).tokens, 27000);
    let v = json(&r.body);
    assert_eq!(v["error"]["code"], "hard_budget_exceeded");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("per-job"),
        "{v}"
    );
    r.sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_08_half_open_probe() {
    // Seeded OPEN 40 s ago with a 30 s recovery: HALF_OPEN now, one probe goes through.
    let r = replay("08-half-open-probe.yaml").await;
    assert_eq!(r.mocks["primary"].hits(), 1);
    assert_eq!(r.audit["attempts"][0]["probe"], true);
    // Closed again: the next request is a normal one.
    let body = chat("next", Some(10));
    let (s, h, _) = post_json(&r.sidecar.chat_url(), &body, &[]).await;
    assert_eq!(s, 200);
    assert_eq!(hdr(&h, "x-tollgate-reason"), "OK");
    r.sidecar.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 4. Bad input
// ---------------------------------------------------------------------------------------------

fn one_backend_policy(url: &str, extra: &str) -> String {
    format!(
        r#"
version: t-1
backends:
  - id: primary
    kind: openai
    base_url: {url}
routes:
  - model: chat
    chain: [{{backend: primary, model: small}}]
  - model: embed
    chain: [{{backend: primary, model: emb-small}}]
{extra}
"#
    )
}

/// 400 with an OpenAI-style body; returns the body.
fn assert_bad(status: u16, h: &HeaderMap, b: &[u8], want_status: u16) -> Value {
    assert_eq!(status, want_status, "{h:?} {}", String::from_utf8_lossy(b));
    assert_eq!(hdr(h, "content-type"), "application/json");
    assert_stamped(h, "t-1");
    let v = json(b);
    assert_error_shape(&v);
    assert_eq!(v["tollgate"]["usage_evidence_state"], "NONE");
    assert_eq!(hdr(h, "x-tollgate-backend"), "none");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_clear_error_and_the_process_keeps_serving() {
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&one_backend_policy(
        &up.base_url(),
        "server: {max_body_bytes: 65536}",
    ))
    .await;
    let url = sc.chat_url();

    // Invalid JSON.
    let (s, h, b) = common::try_post_raw(
        &url,
        Bytes::from_static(b"{\"model\": \"chat\", \"messages\": ["),
        &[],
    )
    .await
    .unwrap();
    let v = assert_bad(s, &h, &b, 400);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["code"], "invalid_json");
    assert_eq!(v["tollgate"]["reason_class"], "BAD_REQUEST");
    assert_eq!(hdr(&h, "x-tollgate-reason"), "BAD_REQUEST");

    // JSON, but not an object.
    let (s, h, b) = common::try_post_raw(&url, Bytes::from_static(b"[1,2,3]"), &[])
        .await
        .unwrap();
    assert_bad(s, &h, &b, 400);

    // Missing `messages`.
    let (s, h, b) = post_json(&url, &j!({"model": "chat"}), &[]).await;
    let v = assert_bad(s, &h, &b, 400);
    assert_eq!(v["error"]["param"], "messages");
    assert_eq!(v["error"]["type"], "invalid_request_error");

    // Wrong types.
    let (s, h, b) = post_json(
        &url,
        &j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}),
        &[],
    )
    .await;
    let v = assert_bad(s, &h, &b, 400);
    assert_eq!(v["error"]["param"], "max_tokens");
    let (s, h, b) = post_json(
        &url,
        &j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}),
        &[],
    )
    .await;
    let v = assert_bad(s, &h, &b, 400);
    assert_eq!(v["error"]["param"], "max_tokens");
    let (s, h, b) = post_json(&url, &j!({"model": "chat", "messages": []}), &[]).await;
    let v = assert_bad(s, &h, &b, 400);
    assert_eq!(v["error"]["param"], "messages");
    let (s, h, b) = post_json(
        &url,
        &j!({"model": "chat", "messages": [{"content": "no role"}]}),
        &[],
    )
    .await;
    let v = assert_bad(s, &h, &b, 400);
    assert_eq!(v["error"]["param"], "messages.[0].role");
    let (s, h, b) = post_json(&url, &j!({"model": "chat", "messages": "hi"}), &[]).await;
    let v = assert_bad(s, &h, &b, 400);
    assert_eq!(v["error"]["param"], "messages");
    let (s, h, b) = post_json(
        &url,
        &j!({"model": 7, "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    )
    .await;
    let v = assert_bad(s, &h, &b, 400);
    assert_eq!(v["error"]["param"], "model");

    // A body over `server.max_body_bytes` (64 KiB here; the 10 MB case against the default
    // 4 MiB limit has its own test below): 413, with a Content-Length ...
    let over =
        j!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(80 * 1024)}]});
    let over = Bytes::from(serde_json::to_vec(&over).unwrap());
    let (s, h, b) = common::try_post_raw(&url, over.clone(), &[])
        .await
        .expect("a 413 answer");
    let v = assert_bad(s, &h, &b, 413);
    assert_eq!(v["error"]["code"], "request_too_large");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // ... and chunked, without one (the limit is enforced while reading).
    let (s, b) = raw_chunked_post(sc.running.addr, "/v1/chat/completions", &over).await;
    assert_eq!(s, 413, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b)["error"]["code"], "request_too_large");
    // Just under the limit is fine.
    let (s, h, b) = post_json(&url, &chat(&"hello ".repeat(1000), Some(5)), &[]).await;
    assert_eq!(s, 200, "{h:?} {}", String::from_utf8_lossy(&b));

    // An unknown model.
    let (s, h, b) = post_json(
        &url,
        &j!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    )
    .await;
    let v = assert_bad(s, &h, &b, 404);
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["param"], "model");
    assert!(v["error"]["message"].as_str().unwrap().contains("gpt-9"));

    // An unusable identity header.
    let (s, h, b) = post_json(
        &url,
        &chat("hi", Some(5)),
        &[("x-tollgate-consumer", "has spaces!")],
    )
    .await;
    assert_bad(s, &h, &b, 400);

    // An unknown path, and a wrong method, on the data port.
    let (s, h, b) = get(&format!("{}/nope", sc.base)).await;
    let v = json(&b);
    assert_eq!(s, 404, "{h:?}");
    assert_eq!(v["error"]["code"], "unknown_url");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (s, _, b) = post_json(
        &format!("http://{}/v2/chat/completions", sc.running.addr),
        &chat("hi", None),
        &[],
    )
    .await;
    assert_eq!(s, 404);
    assert!(json(&b)["error"]["message"].is_string());
    let (s, _, _) = get(&url).await;
    assert_eq!(s, 405);

    // GET /v1/models lists the aliases.
    let (s, h, b) = get(&format!("{}/models", sc.base)).await;
    assert_eq!(s, 200);
    assert_eq!(hdr(&h, "content-type"), "application/json");
    let v = json(&b);
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["chat", "embed"]);
    assert!(v["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m["object"] == "model"));

    // No bad request reached the upstream, and the sidecar still serves.
    assert_eq!(up.hits(), 1, "only the under-the-limit request");
    let (s, h, b) = post_json(&url, &chat("still there?", Some(5)), &[]).await;
    assert_eq!(s, 200, "{h:?} {}", String::from_utf8_lossy(&b));
    assert_eq!(hdr(&h, "x-tollgate-action"), "ALLOW");
    assert_eq!(up.hits(), 2);
    assert_eq!(sc.ledger().reserved_tokens(), 0);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn virtual_keys_wrong_bearer_is_401_right_bearer_is_the_consumer() {
    const ENV: &str = "TOLLGATE_TEST_PROXY_HTTP_VK_WEB";
    const KEY: &str = "vk-web-0123456789abcdef";
    std::env::set_var(ENV, KEY);
    let up = MockUpstream::start(vec![]).await;
    let extra = format!(
        r#"
identity:
  virtual_keys:
    - {{consumer: web, key_env: {ENV}}}
quotas:
  - {{name: consumer-daily, scope: consumer, match: "*", window: day, limit_tokens: 100000}}
"#
    );
    let sc = Sidecar::start(&one_backend_policy(&up.base_url(), &extra)).await;
    let url = sc.chat_url();

    // Wrong bearer.
    let (s, h, b) = post_json(
        &url,
        &chat("hi", Some(5)),
        &[("authorization", "Bearer vk-web-wrong")],
    )
    .await;
    let v = assert_bad(s, &h, &b, 401);
    assert_eq!(v["error"]["type"], "authentication_error");
    assert_eq!(v["tollgate"]["reason_class"], "UNAUTHENTICATED");
    assert_eq!(hdr(&h, "x-tollgate-reason"), "UNAUTHENTICATED");
    assert!(
        !String::from_utf8_lossy(&b).contains(KEY),
        "the real key is never echoed"
    );
    // A key that is a prefix of the real one is not it either.
    let prefix = format!("Bearer {}", &KEY[..10]);
    let (s, _, _) = post_json(
        &url,
        &chat("hi", Some(5)),
        &[("authorization", prefix.as_str())],
    )
    .await;
    assert_eq!(s, 401);
    assert_eq!(up.hits(), 0);

    // Right bearer: consumer `web` (even when a consumer header says otherwise).
    let bearer = format!("Bearer {KEY}");
    let (s, h, b) = post_json(
        &url,
        &chat("hi", Some(5)),
        &[
            ("authorization", bearer.as_str()),
            ("x-tollgate-consumer", "mallory"),
            ("x-request-id", "vk-ok"),
        ],
    )
    .await;
    assert_eq!(s, 200, "{h:?} {}", String::from_utf8_lossy(&b));
    let a = sc.audit("vk-ok").await;
    assert_eq!(a["consumer_id"], "web");
    let tz = sc.running.app.snap.load().policy.windows.timezone.clone();
    let day = |who: &str| CounterKey {
        scope: Scope::Consumer,
        id: Arc::from(who),
        window: Some(window_at(&tz, tollgate::units::Window::Day, now_ms())),
    };
    assert!(sc.committed(&day("web")).tokens > 0);
    assert_eq!(sc.committed(&day("mallory")).tokens, 0);
    // The virtual key is ours, not the upstream's: it is not forwarded.
    let sent = up.last_request().unwrap();
    assert!(
        sent.headers.get("authorization").is_none(),
        "{:?}",
        sent.headers
    );
    assert!(
        !sc.audit_text().contains(KEY),
        "no secret in the audit trail"
    );
    sc.stop().await;
}

/// POST `body` with `Transfer-Encoding: chunked` (no Content-Length) over a raw socket and
/// `Connection: close`; returns the status and the (de-chunked if needed) response body.
async fn raw_chunked_post(addr: std::net::SocketAddr, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        // Write what the server takes; it may answer (and stop reading) before the end.
        let mut write_err = None;
        for chunk in body.chunks(8192) {
            let mut frame = format!("{:x}\r\n", chunk.len()).into_bytes();
            frame.extend_from_slice(chunk);
            frame.extend_from_slice(b"\r\n");
            if let Err(e) = s.write_all(&frame).await {
                write_err = Some(e);
                break;
            }
        }
        if write_err.is_none() {
            let _ = s.write_all(b"0\r\n\r\n").await;
        }
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        let text = String::from_utf8_lossy(&out).into_owned();
        let status: u16 = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no HTTP response (write error: {write_err:?}): {text:?}"));
        let (headers, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let body = if headers
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            let mut b = Vec::new();
            let mut r = rest;
            while let Some((len, tail)) = r.split_once("\r\n") {
                let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
                if n == 0 {
                    break;
                }
                b.extend_from_slice(&tail.as_bytes()[..n]);
                r = &tail[n + 2..];
            }
            b
        } else {
            rest.as_bytes().to_vec()
        };
        (status, body)
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .expect("raw POST timed out")
}

/// A 10 MB body against the default 4 MiB limit must get the OpenAI-style 413, and a client
/// that is still sending its body when the sidecar answers must be able to finish sending and
/// read that answer (RFC 9112 §9.6: close in stages, do not reset a client mid-request).
///
/// The client here is a raw socket so that the order of events is fixed: headers and the
/// first 1 MB, a pause (the sidecar may answer early, as soon as it sees the Content-Length),
/// then the other 9 MB, then read the answer. A reader runs all along.
///
/// Answering 413 without reading the rest of the body would make hyper close the connection
/// with unread bytes in the socket (RST): clients that write the whole body before reading
/// (httpx under the OpenAI SDK, hyper) would see a connection error — and retry it. The
/// sidecar drains an oversized body (bounded) before answering, so the 413 arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_megabyte_body_gets_a_413_not_a_reset() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&one_backend_policy(&up.base_url(), "")).await;
    let addr = sc.running.addr;
    let big = serde_json::to_vec(&j!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(10 * 1024 * 1024)}]})).unwrap();
    let total = big.len();

    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let reader = tokio::spawn(async move {
        // Read one whole response (head + content-length bytes): the connection stays open.
        let mut out = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(20), async {
            let mut buf = [0u8; 8192];
            loop {
                if response_complete(&out) {
                    return Ok(out.len());
                }
                match rd.read(&mut buf).await {
                    Ok(0) => return Ok(out.len()),
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                    Err(e) => return Err(e),
                }
            }
        })
        .await;
        (out, format!("{r:?}"))
    });
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {total}\r\n\r\n"
    );
    wr.write_all(head.as_bytes()).await.unwrap();
    const FIRST: usize = 1024 * 1024;
    let mut written = 0;
    let mut write_err = None;
    for (i, chunk) in big.chunks(64 * 1024).enumerate() {
        if i * 64 * 1024 == FIRST {
            // Give the sidecar time to answer early (it may; it may also wait for the body).
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        match tokio::time::timeout(Duration::from_secs(10), wr.write_all(chunk)).await {
            Ok(Ok(())) => written += chunk.len(),
            Ok(Err(e)) => {
                write_err = Some(e.to_string());
                break;
            }
            Err(_) => {
                write_err = Some("write stalled for 10 s".into());
                break;
            }
        }
    }
    // Keep the write half open while reading, as HTTP clients do: a half-close (FIN) is read
    // by the server as the client going away (which is how a disconnect cancels the upstream).
    let (out, read_result) = reader.await.unwrap();
    drop(wr);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status_line = text.lines().next().unwrap_or("").to_string();

    // The process keeps serving either way.
    let (s, _, _) = post_json(&sc.chat_url(), &chat("after the big one", Some(5)), &[]).await;
    assert_eq!(s, 200);
    assert_eq!(
        up.hits(),
        1,
        "the oversized request never reached the upstream"
    );

    assert!(
        status_line.starts_with("HTTP/1.1 413"),
        "no 413 for a 10 MB body; got {status_line:?} (read: {read_result}; write error: {write_err:?})"
    );
    assert!(
        text.contains("request_too_large"),
        "OpenAI-style 413 body: {text}"
    );
    assert!(
        write_err.is_none(),
        "the sidecar reset the connection while the client was still sending its body: {} after \
         {written} of {total} bytes (it had answered {status_line:?}); a client that writes its \
         whole body before reading never sees that 413",
        write_err.unwrap_or_default()
    );
    sc.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 5. The upstream request is rewritten
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_request_is_rewritten_for_the_chain_entry() {
    const ENV: &str = "TOLLGATE_TEST_PROXY_HTTP_UPSTREAM_KEY";
    const KEY: &str = "sk-upstream-secret-42";
    const CLIENT_KEY: &str = "sk-client-own-key-99";
    std::env::set_var(ENV, KEY);
    let up = MockUpstream::start(vec![]).await;
    let yaml = format!(
        r#"
version: t-rw
estimate: {{default_max_output_tokens: 77}}
backends:
  - id: primary
    kind: openai
    base_url: {}
    api_key_env: {ENV}
routes:
  - model: chat
    chain: [{{backend: primary, model: "llama3.1:8b"}}]
"#,
        up.base_url()
    );
    let sc = Sidecar::start(&yaml).await;
    let url = sc.chat_url();
    let body = j!({
        "model": "chat",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        "temperature": 0.25,
    });
    let client_auth = format!("Bearer {CLIENT_KEY}");
    let (s, h, b) = post_json(
        &url,
        &body,
        &[
            ("authorization", client_auth.as_str()),
            ("x-api-key", CLIENT_KEY),
            ("x-tollgate-consumer", "alice"),
            ("x-request-id", "rw-1"),
        ],
    )
    .await;
    assert_eq!(s, 200, "{h:?} {}", String::from_utf8_lossy(&b));
    let sent = up.last_request().expect("the mock was called");
    assert_eq!(sent.method, Method::POST);
    assert_eq!(sent.path, "/v1/chat/completions");
    let sj = sent.json.clone().expect("JSON upstream body");
    assert_eq!(sj["model"], "llama3.1:8b", "the chain entry's model");
    assert_eq!(
        sj["max_tokens"], 77,
        "the policy default when the client set none"
    );
    assert_eq!(sj["messages"], body["messages"], "the prompt is untouched");
    assert_eq!(sj["temperature"], 0.25);
    assert_eq!(
        sent.header("authorization"),
        Some(format!("Bearer {KEY}").as_str())
    );
    assert_eq!(sent.headers.get_all("authorization").iter().count(), 1);
    assert_eq!(sent.header("content-type"), Some("application/json"));
    for (n, v) in &sent.headers {
        let v = String::from_utf8_lossy(v.as_bytes());
        assert!(
            !v.contains(CLIENT_KEY),
            "the client's credential went upstream in {n}"
        );
        assert!(
            !n.as_str().starts_with("x-tollgate-"),
            "our own header {n} went upstream"
        );
    }
    // The response reaches the client with the served model as the upstream said it.
    assert_eq!(json(&b)["model"], "llama3.1:8b");
    let a = sc.audit("rw-1").await;
    assert_eq!(a["upstream_max_tokens"], 77);
    assert_eq!(a["upstream_model"], "llama3.1:8b");
    let audit = sc.audit_text();
    assert!(
        !audit.contains(KEY) && !audit.contains(CLIENT_KEY),
        "no key in the audit trail"
    );

    // The client's own cap is kept (and its spelling).
    let mut b2 = body.clone();
    b2["max_tokens"] = j!(33);
    let (s, _, _) = post_json(&url, &b2, &[]).await;
    assert_eq!(s, 200);
    assert_eq!(up.last_request().unwrap().json.unwrap()["max_tokens"], 33);
    let mut b3 = body.clone();
    b3["max_completion_tokens"] = j!(21);
    let (s, _, _) = post_json(&url, &b3, &[]).await;
    assert_eq!(s, 200);
    let sj = up.last_request().unwrap().json.unwrap();
    assert_eq!(sj["max_completion_tokens"], 21);
    assert!(sj.get("max_tokens").is_none(), "{sj}");
    assert_eq!(up.hits(), 3);
    sc.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 6. A non-retryable upstream error passes through unchanged
// ---------------------------------------------------------------------------------------------

fn two_backend_policy(a: &str, b: &str) -> String {
    format!(
        r#"
version: t-1
backends:
  - id: primary
    kind: openai
    base_url: {a}
  - id: secondary
    kind: openai
    base_url: {b}
routes:
  - model: chat
    chain: [{{backend: primary, model: small}}, {{backend: secondary, model: other}}]
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_retryable_upstream_400_passes_through_unchanged() {
    let err400 = r#"{"error":{"message":"Invalid value for 'temperature': 7 is greater than the maximum of 2","type":"invalid_request_error","param":"temperature","code":"invalid_value"}}"#;
    let err422 = "unprocessable: the model cannot take this input\n";
    let a = MockUpstream::start(vec![
        Answer::raw(400, "application/json", err400).header("x-upstream-trace", "t-400"),
        Answer::raw(422, "text/plain", err422),
    ])
    .await;
    let b = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&two_backend_policy(&a.base_url(), &b.base_url())).await;

    let (s, h, body) = post_json(
        &sc.chat_url(),
        &chat("hi", Some(10)),
        &[("x-request-id", "pt-1")],
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(&body[..], err400.as_bytes(), "same bytes");
    assert_eq!(hdr(&h, "content-type"), "application/json");
    assert_eq!(
        hdr(&h, "x-upstream-trace"),
        "t-400",
        "upstream headers pass through"
    );
    assert_stamped(&h, "t-1");
    assert_eq!(hdr(&h, "x-tollgate-backend"), "primary");
    assert_eq!(hdr(&h, "x-tollgate-reason"), "UPSTREAM_FAILURE");
    let au = sc.audit("pt-1").await;
    assert_eq!(au["retry_state"], "NOT_RETRYABLE");
    assert_eq!(au["usage_evidence_state"], "NONE");
    assert_eq!(au["calls"], j!(["primary"]));
    assert_eq!(au["http_status"], 400);

    let (s, h, body) = post_json(&sc.chat_url(), &chat("hi", Some(10)), &[]).await;
    assert_eq!(s, 422);
    assert_eq!(&body[..], err422.as_bytes());
    assert_eq!(hdr(&h, "content-type"), "text/plain");

    assert_eq!(a.hits(), 2);
    assert_eq!(b.hits(), 0, "no other backend is called");
    // A client error is not a backend failure: the circuit is untouched.
    let c = sc.running.app.governor.circuit(&Arc::from("primary"));
    assert_eq!(c.raw_state(), CircuitState::Closed);
    assert_eq!(c.consecutive_failures(), 0);
    assert_eq!(sc.ledger().reserved_tokens(), 0);
    sc.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 7. Usage reconciliation
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_reconciliation_actual_and_estimated() {
    const REPLY: &str = "The quick brown fox jumps over the lazy dog, twice and then once more.";
    let up = MockUpstream::start(vec![
        Answer::ok_chat("counted by the provider", 123, 45),
        Answer::ok_chat_no_usage(REPLY),
    ])
    .await;
    let extra = "budgets:\n  - {name: per-job, scope: job, hard_tokens: 100000}\n";
    let sc = Sidecar::start(&one_backend_policy(&up.base_url(), extra)).await;
    let tok = sc.tokenizer();

    // ACTUAL: the provider's usage is committed, the rest of the worst case released.
    let body = chat("Tell me a story about a fox.", Some(400));
    let (s, h, b) = post_json(
        &sc.chat_url(),
        &body,
        &[("x-tollgate-job", "R1"), ("x-request-id", "rec-1")],
    )
    .await;
    assert_eq!(s, 200, "{h:?}");
    assert_eq!(
        json(&b)["usage"]["total_tokens"],
        168,
        "the body reaches the client unchanged"
    );
    assert_eq!(
        sc.committed(&job_key("default", "R1")),
        Amount {
            tokens: 168,
            requests: 1,
            usd: 0
        }
    );
    assert_eq!(sc.reserved(&job_key("default", "R1")), Amount::ZERO);
    let a = sc.audit("rec-1").await;
    assert_eq!(a["usage_evidence_state"], "ACTUAL");
    assert_eq!(a["actual_input_tokens"], 123);
    assert_eq!(a["actual_output_tokens"], 45);

    // ESTIMATED: no usage in the answer → our prompt estimate + our count of the reply.
    let est = estimate::estimate(Endpoint::Chat, &body, tok)
        .unwrap()
        .input_tokens;
    let out = estimate::count_output_text(tok, REPLY);
    assert!(out > 0);
    let (s, _, b) = post_json(
        &sc.chat_url(),
        &body,
        &[("x-tollgate-job", "R2"), ("x-request-id", "rec-2")],
    )
    .await;
    assert_eq!(s, 200);
    assert!(
        json(&b).get("usage").is_none(),
        "the sidecar does not invent a usage object"
    );
    assert_eq!(
        sc.committed(&job_key("default", "R2")),
        Amount {
            tokens: est + out,
            requests: 1,
            usd: 0
        }
    );
    assert_eq!(sc.reserved(&job_key("default", "R2")), Amount::ZERO);
    let a = sc.audit("rec-2").await;
    assert_eq!(a["usage_evidence_state"], "ESTIMATED");
    assert_eq!(a["actual_input_tokens"], est);
    assert_eq!(a["actual_output_tokens"], out);
    assert_eq!(sc.ledger().reserved_tokens(), 0);
    sc.stop().await;
}

/// Whether `raw` holds a whole HTTP/1.1 response with a content-length body.
fn response_complete(raw: &[u8]) -> bool {
    let text = String::from_utf8_lossy(raw);
    let Some(end) = text.find("\r\n\r\n") else {
        return false;
    };
    let len = text[..end]
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_string())
        })
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    raw.len() >= end + 4 + len
}
