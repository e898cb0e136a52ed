//! Alerts (issue 7 §5): an `alert_at` crossing is delivered once to the webhook, retried with
//! backoff when the receiver fails, and never again for the same window.
//!
//! One test per binary: the alert sink is process-wide, configured by the last sidecar that
//! started or reloaded.

mod common;
mod ops_support;

use bytes::Bytes;
use common::mock::{Answer, MockUpstream};
use common::post_json;
use common::sidecar::Sidecar;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use ops_support::scrape;
use serde_json::{json as j, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An HTTP receiver that answers 500 to the first POST and 200 after; it keeps every body.
async fn receiver() -> (String, Arc<Mutex<Vec<(Instant, Value)>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook?k=1", listener.local_addr().unwrap());
    let got: Arc<Mutex<Vec<(Instant, Value)>>> = Arc::default();
    let g = got.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            let g = g.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let g = g.clone();
                    async move {
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                        let n = {
                            let mut g = g.lock().unwrap();
                            g.push((Instant::now(), v));
                            g.len()
                        };
                        let status = if n == 1 { 500 } else { 200 };
                        let mut r = hyper::Response::new(Full::new(Bytes::from_static(b"{}")));
                        *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                        Ok::<_, std::convert::Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (url, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_crossing_is_one_webhook_post_after_a_retry() {
    let (hook, got) = receiver().await;
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat("ok", 30, 30)).await;
    let yaml = format!(
        r#"version: alerts-1
backends:
  - {{id: al-b, kind: openai, base_url: "{}"}}
routes:
  - model: chat
    chain: [{{backend: al-b, model: m}}]
quotas:
  - {{name: al-daily, scope: backend, match: al-b, window: day, limit_tokens: 2000, alert_at: [0.025, 0.1]}}
alerts: {{webhook_url: "{hook}", timeout: 2s}}
"#,
        up.base_url()
    );
    let sc = Sidecar::start(&yaml).await;
    let before = scrape(sc.running.admin_addr).await;
    let body =
        j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100});
    // 60 tokens per request: the first crosses 2.5 % (50 tokens); the next two stay below 10 %.
    let t0 = Instant::now();
    for _ in 0..3 {
        let (code, _, _) = post_json(&sc.chat_url(), &body, &[]).await;
        assert_eq!(code, 200);
    }
    let answered = t0.elapsed();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.lock().unwrap().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "webhook not retried: {:?}",
            got.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Nothing more arrives for that crossing: one worker delivers alerts one at a time in
    // order, so once a later crossing (240 tokens, 10 %) is delivered, a repeat of the first
    // would have come before it.
    let (code, _, _) = post_json(&sc.chat_url(), &body, &[]).await;
    assert_eq!(code, 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.lock().unwrap().len() < 3 {
        assert!(
            Instant::now() < deadline,
            "the later crossing never arrived: {:?}",
            got.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = got.lock().unwrap().clone();
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(got[2].1["threshold"], 0.1, "{got:?}");
    assert_eq!(got[0].1, got[1].1, "the retry sends the same alert");
    let gap = got[1].0 - got[0].0;
    assert!(
        gap >= Duration::from_millis(150),
        "no backoff before the retry: {gap:?}"
    );
    // The requests did not wait for the webhook (its first answer was a failure + backoff).
    assert!(answered < Duration::from_secs(5));
    let a = &got[1].1;
    assert_eq!(a["bound"], "al-daily");
    assert_eq!(a["scope"], "backend");
    assert_eq!(a["id"], "al-b");
    assert_eq!(a["window"], "day");
    assert_eq!(a["threshold"], 0.025);
    assert_eq!(
        (a["used"].as_u64(), a["limit"].as_u64()),
        (Some(60), Some(2000))
    );
    assert_eq!(a["policy_version"], "alerts-1");
    assert!(
        a["ts"].as_str().unwrap().parse::<jiff::Timestamp>().is_ok(),
        "{a}"
    );
    // Two crossings, each delivered once; the counter moves once the webhook's answer is in.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let after = scrape(sc.running.admin_addr).await;
        let d = |o: &str| {
            after.get("tollgate_alerts_total", &[("outcome", o)])
                - before.get("tollgate_alerts_total", &[("outcome", o)])
        };
        let seen = (d("logged"), d("delivered"), d("dropped"));
        if seen.1 >= 2.0 || Instant::now() > deadline {
            assert_eq!(seen, (2.0, 2.0, 0.0));
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The audit record of the crossing request carries it too.
    let line = sc.audit_text().lines().next().unwrap().to_string();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["alerts"][0]["bound"], "al-daily");
    sc.stop().await;
}
