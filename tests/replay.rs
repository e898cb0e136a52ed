//! `tollgate replay`: traffic recorded by a real sidecar (refusals, a fallback, streams) is
//! decided again under a candidate policy. The same policy changes nothing; a tighter team
//! budget refuses exactly the request past it, a looser quota admits the one it refused.
//! Plus the replay of hand-written records, and the command's exit codes.

mod common;

use common::mock::{Answer, MockUpstream};
use common::post_json;
use common::sidecar::Sidecar;
use serde_json::{json as j, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tollgate::replay::{self, Period, Traffic};

const ALICE: &str = "tg-replay-test-key-alice";
const BOB: &str = "tg-replay-test-key-bob";

/// The recorded policy: alice may make five requests a day; teams have a roomy budget.
/// `{quota}` and `{team_b}` are what the candidate policies change.
fn policy(a: &str, b: &str, version: &str, alice_requests: u32, team_b: &str) -> String {
    format!(
        r#"
version: {version}
identity:
  virtual_keys:
    - {{consumer: alice, team: team-a, key_env: REPLAY_TEST_KEY_ALICE}}
    - {{consumer: bob, team: team-b, key_env: REPLAY_TEST_KEY_BOB}}
backends:
  - {{id: primary, kind: openai, base_url: {a}, price_per_1k: {{input: 0.001, output: 0.002}}}}
  - {{id: backup, kind: openai, base_url: {b}, price_per_1k: {{input: 0.003, output: 0.006}}}}
routes:
  - model: chat
    chain: [{{backend: primary, model: m1}}, {{backend: backup, model: m2}}]
retry: {{same_backend_retries: 0}}
quotas:
  - {{name: alice-daily, scope: consumer, match: alice, window: day, limit_requests: {alice_requests}}}
budgets:
  - {{name: team-monthly, scope: team, match: "team-*", window: month, hard_tokens: 1000000}}
{team_b}
"#
    )
}

fn chat(stream: bool) -> Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 40, "stream": stream})
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
}

/// Runs `tollgate replay` and returns (exit code, stdout, stderr).
fn run(args: &[&str]) -> (i32, String, String) {
    let out = bin().arg("replay").args(args).output().expect("run");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn read(paths: &[&Path]) -> Traffic {
    replay::read_all(paths).expect("read the audit")
}

fn load(yaml: &str) -> tollgate::policy::Policy {
    tollgate::policy::from_str(yaml, "candidate.yaml").unwrap_or_else(|e| panic!("{e}"))
}

struct Recorded {
    dir: tempfile::TempDir,
    audit: PathBuf,
    a: String,
    b: String,
}

/// Real traffic on a real sidecar: alice's five requests (a stream, one served by the
/// fallback after a 503) and a sixth refused by her quota; bob's three (one a stream).
async fn record() -> Recorded {
    std::env::set_var("REPLAY_TEST_KEY_ALICE", ALICE);
    std::env::set_var("REPLAY_TEST_KEY_BOB", BOB);
    let a = MockUpstream::start_with_default(
        vec![
            Answer::ok_chat("one", 10, 5),
            Answer::sse_chat(&["two", " pieces"], Some((11, 6)), Duration::ZERO),
            Answer::status(503),
            Answer::ok_chat("bob one", 8, 3),
            Answer::ok_chat("four", 9, 4),
            Answer::sse_chat(&["bob", " two"], Some((12, 7)), Duration::ZERO),
        ],
        Answer::ok_chat("more", 9, 4),
    )
    .await;
    let b = MockUpstream::start_with_default(vec![], Answer::ok_chat("backup", 10, 7)).await;
    let yaml = policy(&a.base_url(), &b.base_url(), "rp-1", 5, "");
    let sc = Sidecar::start(&yaml).await;
    let alice = format!("Bearer {ALICE}");
    let bob = format!("Bearer {BOB}");
    let mut n = 0;
    let mut send = |who: &str, id: &str, stream: bool| {
        n += 1;
        let (url, who, id) = (sc.chat_url(), who.to_string(), id.to_string());
        async move {
            let h = [
                ("authorization", who.as_str()),
                ("x-request-id", id.as_str()),
            ];
            let (s, _, b) = post_json(&url, &chat(stream), &h).await;
            assert!(s == 200 || s == 403, "{s} {}", String::from_utf8_lossy(&b));
            s
        }
    };
    assert_eq!(send(&alice, "alice-1", false).await, 200);
    assert_eq!(send(&alice, "alice-2", true).await, 200);
    assert_eq!(send(&alice, "alice-3", false).await, 200);
    assert_eq!(send(&bob, "bob-1", false).await, 200);
    assert_eq!(send(&alice, "alice-4", false).await, 200);
    assert_eq!(send(&bob, "bob-2", true).await, 200);
    assert_eq!(send(&alice, "alice-5", false).await, 200);
    assert_eq!(send(&alice, "alice-6", false).await, 403);
    assert_eq!(send(&bob, "bob-3", false).await, 200);
    sc.recorded(n).await;
    // What was recorded is what this test is about.
    let fell_back = sc.audit("alice-3").await;
    assert_eq!(fell_back["backend"], "backup");
    assert_eq!(fell_back["fallback_state"], "USED");
    assert_eq!(fell_back["attempts"][0]["outcome"], "5xx");
    assert_eq!(sc.audit("alice-6").await["reason_class"], "QUOTA_BLOCKED");
    assert_eq!(sc.audit("bob-2").await["usage_evidence_state"], "ACTUAL");
    assert_eq!(sc.audit("alice-1").await["client_max_tokens"], 40);
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    std::fs::write(&audit, sc.audit_text()).unwrap();
    sc.stop().await;
    Recorded {
        dir,
        audit,
        a: a.base_url(),
        b: b.base_url(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_traffic_replays_unchanged_under_its_own_policy_and_changes_under_another() {
    let rec = record().await;
    let same = policy(&rec.a, &rec.b, "rp-1", 5, "");
    let audit = read(&[&rec.audit]);
    assert_eq!(audit.records.len(), 9);
    assert_eq!(audit.skipped, 0);

    // The policy that produced the audit: every decision and every cost as recorded.
    let r = replay::replay(&load(&same), &audit, Period::default()).await;
    assert_eq!(r.requests, 9);
    assert_eq!(r.changed, 0, "{:#?}", r.changes);
    assert!(
        (r.spend_old_usd - r.spend_new_usd).abs() < 1e-9,
        "{} vs {}",
        r.spend_old_usd,
        r.spend_new_usd
    );
    assert!(r.spend_old_usd > 0.0);
    let quota = r.bounds.iter().find(|b| b.name == "alice-daily").unwrap();
    assert_eq!((quota.refused_old, quota.refused_new), (1, 1));
    assert_eq!(quota.first_refusal_old, quota.first_refusal_new);

    // Team B may make two requests, alice ten: bob's third is refused, alice's sixth served.
    let tight_b =
        "  - {name: team-b-tight, scope: team, match: team-b, window: month, hard_requests: 2}";
    let other = policy(&rec.a, &rec.b, "rp-2", 10, tight_b);
    let r = replay::replay(&load(&other), &audit, Period::default()).await;
    assert_eq!(r.changed, 2, "{:#?}", r.changes);
    assert_eq!((r.allowed_to_refused, r.refused_to_allowed), (1, 1));
    let to_refused: Vec<_> = r
        .changes
        .iter()
        .filter(|c| c.kind == replay::report::ChangeKind::AllowedToRefused)
        .collect();
    assert_eq!(to_refused.len(), 1);
    assert_eq!(to_refused[0].request_id, "bob-3");
    assert_eq!(to_refused[0].new.reason, "HARD_BUDGET_EXCEEDED");
    assert_eq!(to_refused[0].bounds, vec!["team-b-tight".to_string()]);
    let bob3_ts = audit
        .records
        .iter()
        .find(|x| x.request_id == "bob-3")
        .unwrap()
        .ts
        .clone();
    let tight = r.bounds.iter().find(|b| b.name == "team-b-tight").unwrap();
    assert_eq!(tight.first_refusal_new.as_deref(), Some(bob3_ts.as_str()));
    assert_eq!((tight.allowed_to_refused, tight.refused_old), (1, 0));
    let quota = r.bounds.iter().find(|b| b.name == "alice-daily").unwrap();
    assert_eq!((quota.refused_to_allowed, quota.refused_new), (1, 0));
    let bob = r.consumers.iter().find(|w| w.name == "bob").unwrap();
    assert_eq!((bob.requests, bob.allowed_to_refused), (3, 1));
    assert!(bob.spend_new_usd < bob.spend_old_usd);
    let team_a = r.teams.iter().find(|w| w.name == "team-a").unwrap();
    assert_eq!(team_a.refused_to_allowed, 1);
    // The request served now was never made: charged its worst case.
    assert!(team_a.spend_new_usd > team_a.spend_old_usd);

    // From the command line, as CI would gate a change.
    let same_file = rec.dir.path().join("same.yaml");
    let other_file = rec.dir.path().join("other.yaml");
    std::fs::write(&same_file, &same).unwrap();
    std::fs::write(&other_file, &other).unwrap();
    let a = rec.audit.to_str().unwrap();
    let (code, out, err) = run(&[
        "--policy",
        same_file.to_str().unwrap(),
        "--fail-on-change",
        a,
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("no decision changes"), "{out}");
    let (code, out, err) = run(&[
        "--policy",
        other_file.to_str().unwrap(),
        "--fail-on-change",
        a,
    ]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("team-b-tight"), "{out}");
    assert!(out.contains("bob-3"), "{out}");
    assert!(err.contains("2 decision(s) change"), "{err}");
    // Without the flag a change is a report, not a failure.
    let (code, out, _) = run(&["--policy", other_file.to_str().unwrap(), "--json", a]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["allowed_to_refused"], 1);
    assert_eq!(v["changes"].as_array().unwrap().len(), 2);

    // Rotated and compressed: the audit split in two, the older half gzip'd, a torn line.
    let text = std::fs::read_to_string(&rec.audit).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let old = rec.dir.path().join("audit.jsonl.1.gz");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, (lines[..4].join("\n") + "\n").as_bytes()).unwrap();
    std::fs::write(&old, gz.finish().unwrap()).unwrap();
    let new = rec.dir.path().join("audit.jsonl.now");
    std::fs::write(&new, lines[4..].join("\n") + "\n{\"ts\": \"2026-").unwrap();
    let (code, out, err) = run(&[
        "--policy",
        other_file.to_str().unwrap(),
        "--json",
        new.to_str().unwrap(),
        old.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("skipped 1 line"), "{err}");
    let w: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(w["requests"], 9);
    assert_eq!(w["changes"], v["changes"]);

    // --from (bob's third came in then): only later requests are reported; earlier ones still count in the windows, so
    // bob's third is still over the team's two requests.
    let bob3_start = audit
        .records
        .iter()
        .find(|x| x.request_id == "bob-3")
        .unwrap()
        .start_ns;
    let from = &jiff::Timestamp::from_nanosecond(bob3_start)
        .unwrap()
        .to_string();
    let (code, out, err) = run(&[
        "--policy",
        other_file.to_str().unwrap(),
        "--json",
        "--from",
        from,
        a,
    ]);
    assert_eq!(code, 0, "{err}");
    let f: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(f["requests"], 1);
    assert_eq!(f["earlier"], 8);
    assert_eq!(f["allowed_to_refused"], 1);
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let pol = dir.path().join("p.yaml");
    std::fs::write(
        &pol,
        "version: v\nbackends: [{id: b, kind: openai, base_url: 'http://127.0.0.1:9'}]\nroutes: [{model: chat, chain: [{backend: b, model: m}]}]\n",
    )
    .unwrap();
    let missing = dir.path().join("nope.jsonl");
    let (code, _, err) = run(&["--policy", pol.to_str().unwrap(), missing.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("nope.jsonl"), "{err}");
    let junk = dir.path().join("junk.jsonl");
    std::fs::write(&junk, "not json\n{\"a\": 1}\n").unwrap();
    let (code, _, err) = run(&["--policy", pol.to_str().unwrap(), junk.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("skipped 2 line(s)"), "{err}");
    assert!(err.contains("no audit records"), "{err}");
    let (code, _, err) = run(&[
        "--policy",
        pol.to_str().unwrap(),
        "--from",
        "yesterday",
        junk.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("--from"), "{err}");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "backends: 3\n").unwrap();
    let (code, _, _) = run(&["--policy", bad.to_str().unwrap(), junk.to_str().unwrap()]);
    assert_eq!(code, 2);
}

/// A hand-written record line: `extra` is merged over a served request of consumer `c`.
fn line(id: &str, ts: &str, extra: Value) -> String {
    let mut v = j!({
        "ts": ts, "endpoint": "chat.completions", "api": "openai", "latency_ms": 5.0,
        "budget_state": "OK", "quota_state": "OK", "circuit_state": "CLOSED",
        "retry_state": "NOT_NEEDED", "usage_evidence_state": "ACTUAL",
        "fallback_state": "NOT_NEEDED", "final_action": "ALLOW", "reason_class": "OK",
        "http_status": 200, "calls": ["p"], "policy_version": "h-1", "request_id": id,
        "job_id": id, "consumer_id": "c", "route": "chat", "backend": "p",
        "estimated_input_tokens": 10, "requested_output_tokens": 20, "client_max_tokens": 20,
        "worst_case_tokens": 30, "worst_case_usd": 0.0, "actual_input_tokens": 10,
        "actual_output_tokens": 20, "actual_cached_input_tokens": 0,
        "actual_cache_write_tokens": 0, "cost_usd": 0.0, "job_attempts": 1, "retry_budget": 3,
        "job_fallbacks": 0, "amplification": 1.0, "refusals": []
    });
    v["attempts"] = j!([{"backend": "p", "model": "m", "attempt": 1, "probe": false,
        "worst_tokens": 30, "worst_cost_usd": 0.0, "max_output_tokens": 20,
        "outcome": "ok", "circuit_before": "CLOSED", "circuit_after": "CLOSED",
        "latency_ms": 4, "waited_ms": 0}]);
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v.to_string()
}

#[tokio::test]
async fn hand_written_records_are_replayed_through_the_decision_core() {
    let yaml = |limit: u32| {
        format!(
            r#"
version: h-1
backends:
  - {{id: p, kind: openai, base_url: "http://127.0.0.1:9"}}
  - {{id: q, kind: openai, base_url: "http://127.0.0.1:9"}}
routes:
  - model: chat
    chain: [{{backend: p, model: m}}, {{backend: q, model: m}}]
retry: {{same_backend_retries: 0}}
rate_limits:
  - {{name: c-tpm, scope: consumer, match: c, window: minute, limit_tokens: {limit}}}
"#
        )
    };
    let failover = j!({"backend": "q", "calls": ["p", "q"], "fallback_state": "USED",
        "retry_state": "RETRIED", "reason_class": "UPSTREAM_FAILURE",
        "attempts": [
            {"backend": "p", "model": "m", "attempt": 1, "outcome": "5xx", "status": 503,
             "circuit_before": "CLOSED", "circuit_after": "CLOSED", "latency_ms": 3, "waited_ms": 0,
             "probe": false, "worst_tokens": 30, "worst_cost_usd": 0.0, "max_output_tokens": 20},
            {"backend": "q", "model": "m", "attempt": 2, "outcome": "ok",
             "circuit_before": "CLOSED", "circuit_after": "CLOSED", "latency_ms": 3, "waited_ms": 0,
             "probe": false, "worst_tokens": 30, "worst_cost_usd": 0.0, "max_output_tokens": 20}]});
    // Written out of order, with a torn line: replay sorts by time and skips the line.
    let text = [
        line("r3", "2026-03-01T10:00:30Z", j!({})),
        line("r1", "2026-03-01T10:00:10Z", j!({})),
        "{\"ts\":\"2026-03-01T10:00:4".to_string(),
        line("r2", "2026-03-01T10:00:20Z", failover),
        line(
            "r4",
            "2026-03-01T10:01:05Z",
            j!({"reason_class": "UNAUTHENTICATED", "final_action": "HARD_STOP"}),
        ),
    ]
    .join("\n");
    let mut audit = Traffic::default();
    replay::read::read_lines(text.as_bytes(), &mut audit).unwrap();
    audit.records.sort_by_key(|r| r.start_ns);
    assert_eq!(audit.skipped, 1);
    let ids: Vec<&str> = audit
        .records
        .iter()
        .map(|r| r.request_id.as_str())
        .collect();
    assert_eq!(ids, ["r1", "r2", "r3", "r4"]);

    // Room for all three in the minute: as recorded, the failover included.
    let r = replay::replay(&load(&yaml(1000)), &audit, Period::default()).await;
    assert_eq!(
        (r.requests, r.not_governed, r.changed),
        (3, 1, 0),
        "{:#?}",
        r.changes
    );

    // 70 tokens a minute: two calls' usage (30 each) leave 10, less than the third's worst
    // case of 30: the third is deferred by the rate limit, first refusing at 10:00:30.
    let r = replay::replay(&load(&yaml(70)), &audit, Period::default()).await;
    assert_eq!(r.allowed_to_refused, 1, "{:#?}", r.changes);
    let c = &r.changes[0];
    assert_eq!(c.request_id, "r3");
    assert_eq!(
        (c.new.action.as_str(), c.new.reason.as_str()),
        ("DEFER", "RATE_LIMITED")
    );
    let b = &r.bounds[0];
    assert_eq!(b.name, "c-tpm");
    assert_eq!(b.first_refusal_new.as_deref(), Some("2026-03-01T10:00:30Z"));

    // The next minute is a fresh window: a record there is not refused (a period that
    // starts after the others, which still fill the counters).
    let later = line("r5", "2026-03-01T10:01:10Z", j!({}));
    replay::read::read_lines(later.as_bytes(), &mut audit).unwrap();
    let from: jiff::Timestamp = "2026-03-01T10:01:00Z".parse().unwrap();
    let period = Period {
        from: Some(from),
        to: None,
    };
    let r = replay::replay(&load(&yaml(70)), &audit, period).await;
    assert_eq!((r.requests, r.earlier, r.changed), (1, 3, 0));
}
