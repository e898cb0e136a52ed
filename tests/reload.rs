//! Policy reload (what SIGHUP does): a valid policy is swapped in whole, an invalid one is
//! rejected with file/line/key while the old one stays in force, and counters survive.

mod common;

use common::mock::MockUpstream;
use common::post_json;
use common::sidecar::Sidecar;
use serde_json::json;

fn policy(version: &str, url: &str, extra: &str) -> String {
    format!(
        "version: {version}\nbackends:\n  - {{id: a, kind: openai, base_url: \"{url}\"}}\nroutes:\n  - {{model: chat, chain: [{{backend: a, model: m}}]}}\nbudgets:\n  - {{name: g, scope: global, window: day, hard_tokens: 1000000}}\n{extra}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_swaps_valid_policies_and_keeps_the_old_on_error() {
    let up = MockUpstream::start(vec![]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("policy.yaml");
    let v1 = policy("v1", &up.base_url(), "");
    std::fs::write(&path, &v1).expect("write");
    let sc = Sidecar::start(&v1).await;
    let body =
        json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5});

    let (s, h, _) = post_json(&sc.chat_url(), &body, &[]).await;
    assert_eq!(s, 200);
    assert_eq!(h["x-tollgate-policy-version"], "v1");
    let used = |sc: &Sidecar| -> u64 {
        sc.ledger()
            .snapshot()
            .iter()
            .filter(|(k, _, _)| &*k.id == "global")
            .map(|(_, c, _)| c.tokens)
            .sum()
    };
    let before = used(&sc);
    assert!(before > 0);

    // A valid new version is swapped in; counters survive.
    std::fs::write(&path, policy("v2", &up.base_url(), "")).expect("write");
    assert_eq!(
        tollgate::proxy::reload(&sc.running.app, &path).as_deref(),
        Ok("v2")
    );
    let (s, h, _) = post_json(&sc.chat_url(), &body, &[]).await;
    assert_eq!(s, 200);
    assert_eq!(h["x-tollgate-policy-version"], "v2");
    assert!(
        used(&sc) > before,
        "the day's usage carried over the reload"
    );

    // An invalid one is rejected, naming file, line and key; v2 stays in force.
    std::fs::write(
        &path,
        policy("v3", &up.base_url(), "retry: {max_attempts: 3}\n"),
    )
    .expect("write");
    let err = tollgate::proxy::reload(&sc.running.app, &path).expect_err("invalid policy");
    assert!(err.contains("policy.yaml:"), "{err}");
    assert!(err.contains("max_attempts"), "{err}");
    let (s, h, _) = post_json(&sc.chat_url(), &body, &[]).await;
    assert_eq!(s, 200);
    assert_eq!(h["x-tollgate-policy-version"], "v2");
    sc.stop().await;
}
