//! SQLite state across restarts of the real binary: a consumer's daily quota used up before
//! a `kill -9` is still used up after the restart (the loss bound is one flush interval).

mod common;

use common::mock::{Answer, MockUpstream};
use common::process::{free_port, Serve};
use common::try_post_json;
use serde_json::json as j;
use std::time::{Duration, Instant};

const FLUSH_MS: u64 = 50;
const QUOTA: usize = 3;

fn policy(mock: &str, db: &std::path::Path, port: u16, admin: u16) -> String {
    format!(
        r#"
version: st-1
server: {{listen: "127.0.0.1:{port}", admin_listen: "127.0.0.1:{admin}"}}
backends:
  - {{id: primary, kind: openai, base_url: "{mock}"}}
routes:
  - model: chat
    chain: [{{backend: primary, model: small}}]
quotas:
  - {{name: daily, scope: consumer, match: "*", window: day, limit_requests: {QUOTA}}}
state: {{backend: sqlite, path: "{}", flush_interval: {FLUSH_MS}ms}}
audit: {{sink: "off"}}
"#,
        db.display()
    )
}

async fn chat(s: &Serve, consumer: &str) -> (u16, String) {
    let body =
        j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16});
    let (status, headers, _) =
        try_post_json(&s.chat_url(), &body, &[("x-tollgate-consumer", consumer)])
            .await
            .expect("request");
    let reason = headers
        .get("x-tollgate-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    (status, reason)
}

/// Requests committed to `consumer`'s counters in the state file (0 before the first flush).
fn committed_requests(db: &std::path::Path, consumer: &str) -> i64 {
    let Ok(c) =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return 0;
    };
    c.query_row(
        "SELECT COALESCE(SUM(requests), 0) FROM state_counters WHERE scope = 'consumer' AND id = ?1",
        [consumer],
        |r| r.get(0),
    )
    .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_keeps_the_days_quota() {
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat("ok", 5, 3)).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("state.db");
    let (port, admin) = (free_port(), free_port());
    let path = dir.path().join("policy.yaml");
    std::fs::write(&path, policy(&up.base_url(), &db, port, admin)).unwrap();
    let log = dir.path().join("serve.log");

    let mut s = Serve::start(&path, port, admin, &log).await;
    for i in 0..QUOTA {
        assert_eq!(chat(&s, "alice").await.0, 200, "request {i}");
    }
    assert_eq!(chat(&s, "alice").await, (403, "QUOTA_BLOCKED".into()));
    // Once the write-behind has committed alice's requests (one flush interval; polled, so a
    // loaded machine only makes it slower), no shutdown path at all.
    let t0 = Instant::now();
    while committed_requests(&db, "alice") < QUOTA as i64 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the write-behind never committed alice's usage"
        );
        tokio::time::sleep(Duration::from_millis(FLUSH_MS / 5)).await;
    }
    s.kill9();

    let s = Serve::start(&path, port, admin, &log).await;
    let (status, reason) = chat(&s, "alice").await;
    assert_eq!(
        (status, reason.as_str()),
        (403, "QUOTA_BLOCKED"),
        "the restarted sidecar must remember alice's day\n{}",
        s.log_text()
    );
    assert_eq!(chat(&s, "bob").await.0, 200, "another consumer is served");
    assert_eq!(up.hits(), QUOTA + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_stop_flushes_what_the_last_interval_had() {
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat("ok", 5, 3)).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("state.db");
    let (port, admin) = (free_port(), free_port());
    let path = dir.path().join("policy.yaml");
    // A long interval: only the flush on SIGTERM can have written the usage.
    let yaml = policy(&up.base_url(), &db, port, admin).replace(
        &format!("flush_interval: {FLUSH_MS}ms"),
        "flush_interval: 60s",
    );
    std::fs::write(&path, yaml).unwrap();
    let log = dir.path().join("serve.log");

    let mut s = Serve::start(&path, port, admin, &log).await;
    for _ in 0..QUOTA {
        assert_eq!(chat(&s, "carol").await.0, 200);
    }
    s.term();
    let s = Serve::start(&path, port, admin, &log).await;
    assert_eq!(chat(&s, "carol").await, (403, "QUOTA_BLOCKED".into()));
}
