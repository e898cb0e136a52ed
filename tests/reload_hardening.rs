//! Reload hardening (issue 11 items 12-13): a reload that changes a start-only key is refused
//! whole and visibly, and policy files are read off the async workers, only when they are
//! regular files — a FIFO in place of the policy no longer freezes either port.

mod common;
mod ops_support;

use common::mock::MockUpstream;
use common::post_json;
use common::sidecar::Sidecar;
use ops_support::{post_reload, scrape, status};
use serde_json::{json as j, Value};
use std::time::Duration;

/// Reload counters are process-wide: tests that compare them run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn chat() -> Value {
    j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20})
}

fn policy(version: &str, extra: &str, upstream: &MockUpstream) -> String {
    format!(
        "version: {version}\nbackends:\n  - {{id: p, kind: openai, base_url: \"{}\"}}\nroutes:\n  - model: chat\n    chain: [{{backend: p, model: m}}]\n{extra}",
        upstream.base_url()
    )
}

async fn version_served(sc: &Sidecar) -> String {
    let (code, h, _) = post_json(&sc.chat_url(), &chat(), &[]).await;
    assert_eq!(code, 200);
    h["x-tollgate-policy-version"].to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_a_start_only_key_is_refused_whole() {
    let _serial = SERIAL.lock().await;
    let up = MockUpstream::start(vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let v1 = policy("so-1", "", &up);
    std::fs::write(&path, &v1).unwrap();
    let sc = Sidecar::start(&v1).await;
    sc.running.ops.set_policy_path(path.clone());
    sc.running.ops.set_token(Some("tok".into()));
    let admin = sc.running.admin_addr;
    let before = scrape(admin).await;

    for (n, extra, key) in [
        (2, "server: {listen: '127.0.0.1:1'}\n", "server.listen"),
        (
            3,
            "server: {admin_listen: '127.0.0.1:2'}\n",
            "server.admin_listen",
        ),
        (4, "state: {backend: memory, job_idle_ttl: 5m}\n", "state"),
        (5, "audit: {sink: jsonl, path: elsewhere.jsonl}\n", "audit"),
    ] {
        std::fs::write(&path, policy(&format!("so-{n}"), extra, &up)).unwrap();
        let (code, body) = post_reload(admin, Some("tok")).await;
        assert_eq!(code, 422, "{key}: {body}");
        let msg = body["error"]["message"].as_str().unwrap();
        assert!(msg.contains(key) && msg.contains("only at start"), "{msg}");
        assert_eq!(version_served(&sc).await, "so-1");
    }
    let st = status(admin).await;
    assert_eq!(st["policy"]["version"], "so-1");
    assert!(st["policy"]["last_error"]["message"]
        .as_str()
        .unwrap()
        .contains("audit"));
    let after = scrape(admin).await;
    let d = |r: &str| {
        after.get("tollgate_policy_reloads_total", &[("result", r)])
            - before.get("tollgate_policy_reloads_total", &[("result", r)])
    };
    assert_eq!((d("ok"), d("error")), (0.0, 4.0));

    // Reloadable keys still reload.
    std::fs::write(
        &path,
        policy("so-6", "server: {max_body_bytes: 5000}\n", &up),
    )
    .unwrap();
    assert_eq!(post_reload(admin, Some("tok")).await.0, 200);
    assert_eq!(version_served(&sc).await, "so-6");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_in_place_of_the_policy_is_refused_and_freezes_nothing() {
    let _serial = SERIAL.lock().await;
    let up = MockUpstream::start(vec![]).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let v1 = policy("fifo-1", "", &up);
    std::fs::write(&path, &v1).unwrap();
    let mut sc = Sidecar::start(&v1).await;
    sc.running.watch_policy(path.clone());
    sc.running.ops.set_token(Some("tok".into()));
    let admin = sc.running.admin_addr;

    std::fs::remove_file(&path).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&path)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    // The watcher polls the FIFO every second; the API reload reads it now. Neither blocks.
    for _ in 0..3 {
        let (code, body) =
            tokio::time::timeout(Duration::from_secs(5), post_reload(admin, Some("tok")))
                .await
                .expect("the reload answers instead of blocking on the FIFO");
        assert_eq!(code, 422, "{body}");
        let msg = body["error"]["message"].as_str().unwrap();
        assert!(msg.contains("not a regular file"), "{msg}");
        let served = tokio::time::timeout(Duration::from_secs(5), version_served(&sc))
            .await
            .expect("the data port answers");
        assert_eq!(served, "fifo-1");
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    assert_eq!(status(admin).await["policy"]["version"], "fifo-1");
    sc.stop().await;
}
