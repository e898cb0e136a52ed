//! The teams policy (`policies/teams.yaml`) on a real sidecar with a mock upstream: keys say
//! who pays, each team has its own budget, each developer its own token rate, a glob scope
//! gets one counter per matching team, and `GET /tollgate/v1/limits` shows a caller its own.

mod common;

use common::mock::MockUpstream;
use common::{get_with, json, post_json};
use serde_json::{json as j, Value};
use std::sync::Arc;
use tollgate::audit::Audit;
use tollgate::ledger::{window_at, window_end, CounterKey};
use tollgate::proxy::Snapshot;
use tollgate::sidecar::{self, Options, Running};
use tollgate::units::{Amount, Scope, Window};

const ALICE: &str = "tg-test-key-alice-5b9d";
const BOB: &str = "tg-test-key-bob-0e4f";
const CAROL: &str = "tg-test-key-carol-91aa";
/// Erin's key is known to the policy only by its SHA-256 (keys.yaml below).
const ERIN: &str = "tg-test-key-dana-7c1e";
const ERIN_SHA256: &str = "b19c05415f6255f9b14289d9f5633fcd98be7bb0fbd3adb712e8ec69b5e706bc";
const OLGA: &str = "tg-test-key-olga-33c2";

struct Teams {
    running: Running,
    base: String,
    dir: tempfile::TempDir,
}

impl Teams {
    /// policies/teams.yaml pointed at the mock, plus a second file with more keys (one by
    /// digest, one of a team the `team-*` glob does not match), loaded as a directory.
    async fn start(up: &MockUpstream) -> Teams {
        Teams::start_with(up, None).await
    }

    /// As `start`, with the Anthropic fallback pointed at `claude` (and its key set) when given.
    async fn start_with(up: &MockUpstream, claude: Option<&MockUpstream>) -> Teams {
        for (env, key) in [
            ("TOLLGATE_KEY_ALICE", ALICE),
            ("TOLLGATE_KEY_BOB", BOB),
            ("TOLLGATE_KEY_CAROL", CAROL),
            ("TEAMS_TEST_KEY_OLGA", OLGA),
            ("OPENAI_API_KEY", "sk-upstream-test"),
        ] {
            std::env::set_var(env, key);
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(root.join("policies/teams.yaml")).unwrap();
        assert!(text.contains("https://api.openai.com/v1"));
        let text = text.replace("https://api.openai.com/v1", &up.base_url());
        let text = match claude {
            Some(c) => {
                std::env::set_var("TEAMS_TEST_ANTHROPIC_KEY", "sk-ant-upstream-test");
                text.replace("https://api.anthropic.com", &common::native::root(c))
                    .replace("ANTHROPIC_API_KEY", "TEAMS_TEST_ANTHROPIC_KEY")
            }
            // The fallback stays in the chain but is ineligible (its key is unset).
            None => text.replace("ANTHROPIC_API_KEY", "TEAMS_TEST_UNSET_ANTHROPIC_KEY"),
        };
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("teams.yaml"), text).unwrap();
        let keys = format!(
            "identity:\n  virtual_keys:\n    - {{consumer: erin, team: team-b, key_sha256: {ERIN_SHA256}}}\n    - {{consumer: olga, team: ops, key_env: TEAMS_TEST_KEY_OLGA}}\n"
        );
        std::fs::write(dir.path().join("keys.yaml"), keys).unwrap();
        let policy = tollgate::policy::load(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let (audit, _writer) = Audit::jsonl(dir.path().join("audit.jsonl"), 1024).unwrap();
        let running = sidecar::start(
            Snapshot::build(policy).unwrap(),
            audit,
            Options {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                admin_listen: Some("127.0.0.1:0".parse().unwrap()),
                workers: None,
            },
        )
        .await
        .expect("start sidecar");
        let base = format!("http://{}", running.addr);
        Teams { running, base, dir }
    }

    fn chat_url(&self) -> String {
        format!("{}/v1/chat/completions", self.base)
    }

    fn key(&self, scope: Scope, id: &str, w: Window) -> (CounterKey, i64) {
        let tz = self.running.app.snap.load().policy.windows.timezone.clone();
        let k = window_at(&tz, w, now_ms());
        let key = CounterKey {
            scope,
            id: Arc::from(id),
            window: Some(k),
        };
        (key, window_end(&tz, k))
    }

    fn committed(&self, scope: Scope, id: &str, w: Window) -> Amount {
        let (key, _) = self.key(scope, id, w);
        let ledger = &self.running.app.governor.ledger;
        ledger.get(&key).map(|c| c.committed()).unwrap_or_default()
    }

    /// Seeds committed usage on a counter of the current window (state from earlier requests).
    fn seed(&self, scope: Scope, id: &str, w: Window, amount: Amount) -> CounterKey {
        let (key, end) = self.key(scope, id, w);
        let ledger = &self.running.app.governor.ledger;
        ledger.counter(&key, end).add_committed(&amount);
        key
    }

    async fn chat(&self, headers: &[(&str, &str)]) -> (u16, Value) {
        let body = j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20});
        let (s, _, b) = post_json(&self.chat_url(), &body, headers).await;
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }
}

fn now_ms() -> i64 {
    jiff::Timestamp::now().as_millisecond()
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_decide_who_pays_and_keyless_requests_are_refused() {
    let up = MockUpstream::start(vec![]).await;
    let t = Teams::start(&up).await;

    // No key, a Basic credential, an empty bearer: 401 in OpenAI's error shape, no call made.
    for h in [
        vec![],
        vec![("authorization", "Basic YWxpY2U6c2VjcmV0")],
        vec![("authorization", "Bearer ")],
        vec![("x-tollgate-consumer", "alice")],
    ] {
        let (s, v) = t.chat(&h).await;
        assert_eq!(s, 401, "{h:?}: {v}");
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
        assert_eq!(v["tollgate"]["reason_class"], "UNAUTHENTICATED", "{v}");
    }
    assert_eq!(up.hits(), 0, "nothing key-less reached the upstream");

    // Alice's key with a header naming bob: alice and team A pay, bob does not.
    let alice = bearer(ALICE);
    let (s, v) = t
        .chat(&[("authorization", &alice), ("x-tollgate-consumer", "bob")])
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        t.committed(Scope::Consumer, "alice", Window::Minute)
            .requests,
        1
    );
    assert_eq!(
        t.committed(Scope::Consumer, "bob", Window::Minute).requests,
        0
    );
    assert_eq!(
        t.committed(Scope::Team, "team-a", Window::Month).requests,
        1
    );
    assert!(t.committed(Scope::Team, "team-a", Window::Month).usd > 0);

    // The scheme word is case-insensitive.
    let lower = format!("bearer {CAROL}");
    let (s, v) = t.chat(&[("authorization", &lower)]).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        t.committed(Scope::Team, "team-b", Window::Month).requests,
        1
    );

    // A key known only by its SHA-256 digest works (here sent as x-api-key).
    let (s, v) = t.chat(&[("x-api-key", ERIN)]).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        t.committed(Scope::Consumer, "erin", Window::Minute)
            .requests,
        1
    );
    assert_eq!(
        t.committed(Scope::Team, "team-b", Window::Month).requests,
        2
    );
    // A wrong key is 401, whatever it is close to.
    let (s, _) = t
        .chat(&[("authorization", &bearer(&ERIN[..ERIN.len() - 1]))])
        .await;
    assert_eq!(s, 401);

    // The glob `team-*` gives team-a and team-b a counter each; team `ops` has none.
    let (s, v) = t.chat(&[("authorization", &bearer(OLGA))]).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        t.committed(Scope::Consumer, "olga", Window::Minute)
            .requests,
        1
    );
    let (ops, _) = t.key(Scope::Team, "ops", Window::Month);
    assert!(t.running.app.governor.ledger.get(&ops).is_none());
    t.running.shutdown().await;

    // The audit record names the team the key gave; key-less refusals name none.
    // (The writer flushes in the background: wait for the last served request's line.)
    let path = t.dir.path().join("audit.jsonl");
    let mut audit = String::new();
    for _ in 0..100 {
        audit = std::fs::read_to_string(&path).unwrap_or_default();
        if audit.contains("\"consumer_id\":\"olga\"") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let lines: Vec<Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let team_of = |consumer: &str| -> Vec<Value> {
        lines
            .iter()
            .filter(|l| l["consumer_id"] == consumer)
            .map(|l| l["team"].clone())
            .collect()
    };
    assert_eq!(team_of("alice"), vec![Value::from("team-a")], "{audit}");
    assert_eq!(team_of("erin"), vec![Value::from("team-b")], "{audit}");
    assert!(
        lines
            .iter()
            .filter(|l| l["http_status"] == 401)
            .all(|l| l.get("team").is_none()),
        "{audit}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn team_budgets_are_separate_and_developer_tpm_is_per_developer() {
    let up = MockUpstream::start(vec![]).await;
    let t = Teams::start(&up).await;
    let (alice, bob, carol) = (bearer(ALICE), bearer(BOB), bearer(CAROL));

    // Alice has used her 20k tokens this minute; Bob (same team) and Carol are not held back.
    // A minute that turns between the seed and the request empties her counter: try again.
    let mut refused = false;
    for _ in 0..3 {
        let before = t.key(Scope::Consumer, "alice", Window::Minute).0;
        t.seed(
            Scope::Consumer,
            "alice",
            Window::Minute,
            Amount {
                tokens: 19_990,
                requests: 0,
                usd: 0,
            },
        );
        let (s, v) = t.chat(&[("authorization", &alice)]).await;
        if before != t.key(Scope::Consumer, "alice", Window::Minute).0 {
            continue;
        }
        assert_eq!(s, 429, "{v}");
        assert_eq!(v["tollgate"]["reason_class"], "RATE_LIMITED", "{v}");
        refused = true;
        break;
    }
    assert!(refused);
    let (s, v) = t.chat(&[("authorization", &bob)]).await;
    assert_eq!(s, 200, "bob has his own rate: {v}");

    // Team A's month is spent: Bob is stopped, Carol (team B) is served and only B pays.
    t.seed(
        Scope::Team,
        "team-a",
        Window::Month,
        Amount {
            tokens: 0,
            requests: 0,
            usd: 49_999_990,
        },
    );
    let (s, v) = t.chat(&[("authorization", &bob)]).await;
    assert_eq!(s, 403, "{v}");
    assert_eq!(v["tollgate"]["reason_class"], "HARD_BUDGET_EXCEEDED", "{v}");
    let a_before = t.committed(Scope::Team, "team-a", Window::Month);
    let (s, v) = t.chat(&[("authorization", &carol)]).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        t.committed(Scope::Team, "team-b", Window::Month).requests,
        1
    );
    assert_eq!(t.committed(Scope::Team, "team-a", Window::Month), a_before);
    t.running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limits_view_shows_the_caller_its_own_limits_only() {
    let up = MockUpstream::start(vec![]).await;
    let t = Teams::start(&up).await;
    let url = format!("{}/tollgate/v1/limits", t.base);

    let (s, _, b) = get_with(&url, &[]).await;
    assert_eq!(s, 401, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b)["error"]["type"], "authentication_error");

    let carol = bearer(CAROL);
    let (s, v) = t.chat(&[("authorization", &carol)]).await;
    assert_eq!(s, 200, "{v}");
    t.seed(
        Scope::Team,
        "team-a",
        Window::Month,
        Amount {
            tokens: 0,
            requests: 0,
            usd: 12_000_000,
        },
    );
    t.seed(
        Scope::Team,
        "team-b",
        Window::Month,
        Amount {
            tokens: 0,
            requests: 0,
            usd: 45_000_000,
        },
    );

    let (s, h, b) = get_with(&url, &[("authorization", &carol)]).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(h["content-type"], "application/json");
    let v = json(&b);
    assert_eq!(v["consumer"], "carol");
    assert_eq!(v["team"], "team-b");
    let text = v.to_string();
    for other in ["alice", "bob", "team-a", "erin", "olga"] {
        assert!(!text.contains(other), "{other} leaked: {text}");
    }
    let limits = v["limits"].as_array().unwrap();
    let find = |name: &str| {
        limits
            .iter()
            .find(|l| l["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    let tpm = find("developer-tpm");
    assert_eq!(tpm["kind"], "rate_limit");
    assert_eq!(tpm["scope"], "consumer");
    assert_eq!(tpm["id"], "carol");
    assert_eq!(tpm["unit"], "tokens");
    assert_eq!(tpm["limit"], 20_000);
    let used = t.committed(Scope::Consumer, "carol", Window::Minute).tokens;
    assert!(used > 0);
    // The minute may have turned since the call; then the view shows a fresh window.
    assert!(tpm["used"] == used || tpm["used"] == 0, "{tpm}");
    assert!(
        tpm["resets_at"].as_str().unwrap().ends_with("+00:00"),
        "{tpm}"
    );

    let team = find("team-monthly");
    assert_eq!(team["kind"], "budget");
    assert_eq!(team["scope"], "team");
    assert_eq!(team["id"], "team-b");
    assert_eq!(team["unit"], "usd");
    assert_eq!(team["limit"], 50.0);
    assert_eq!(team["soft"], 40.0);
    let used_usd = team["used"].as_f64().unwrap();
    assert!(used_usd > 45.0 && used_usd < 45.01, "{team}");
    assert!(
        (team["remaining"].as_f64().unwrap() - (50.0 - used_usd)).abs() < 1e-9,
        "{team}"
    );
    assert_eq!(team["state"], "soft_exceeded");
    assert!(
        team["text"].as_str().unwrap().contains("of $50.00"),
        "{team}"
    );
    t.running.shutdown().await;
}

/// The chain as written: OpenAI first, the Anthropic fallback when OpenAI fails; the team
/// still pays (at the fallback's price), and the answer says who served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_primary_falls_back_to_anthropic_and_the_team_pays() {
    let up = MockUpstream::start(vec![
        common::mock::Answer::status(503),
        common::mock::Answer::status(503),
    ])
    .await;
    let claude = MockUpstream::start(vec![common::native::anthropic_message(
        "Claude answers.",
        (40, 8, 0, 0),
    )])
    .await;
    let t = Teams::start_with(&up, Some(&claude)).await;
    let body =
        j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20});
    let (s, h, b) = post_json(&t.chat_url(), &body, &[("authorization", &bearer(CAROL))]).await;
    let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        h.get("x-tollgate-backend").and_then(|v| v.to_str().ok()),
        Some("anthropic"),
        "{v}"
    );
    assert_eq!(
        v["choices"][0]["message"]["content"], "Claude answers.",
        "{v}"
    );
    assert_eq!(claude.hits(), 1);
    let req = claude.last_request().expect("claude called");
    assert_eq!(req.header("x-api-key"), Some("sk-ant-upstream-test"));
    // Carol's team pays the fallback's actual usage at the fallback's price:
    // 40 input x $0.0008/1k + 8 output x $0.004/1k = $0.000064 = 64 micro-dollars.
    let team = t.committed(Scope::Team, "team-b", Window::Month);
    assert_eq!(team.requests, 1);
    assert_eq!(team.usd, 64, "{team:?}");
    assert_eq!(
        t.committed(Scope::Team, "team-a", Window::Month).requests,
        0
    );
    t.running.shutdown().await;
}
