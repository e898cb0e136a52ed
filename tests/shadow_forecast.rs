//! Shadow bounds and burn-rate forecasts (SPEC §9) on a real sidecar: a shadow quota that
//! would refuse lets the request through and says so in the header, the audit and the metric;
//! a global budget burning fast is forecast to run out before midnight in the limits view,
//! the admin status, the gauge and one `forecast` webhook.

mod common;
mod ops_support;

use bytes::Bytes;
use common::mock::{Answer, MockUpstream};
use common::sidecar::Sidecar;
use common::{get, get_with, post_json};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use ops_support::{scrape, status};
use serde_json::{json as j, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An HTTP receiver that answers 200 and keeps every JSON body.
async fn receiver() -> (String, Arc<Mutex<Vec<Value>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let got: Arc<Mutex<Vec<Value>>> = Arc::default();
    let g = got.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let g = g.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let g = g.clone();
                    async move {
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        g.lock()
                            .unwrap()
                            .push(serde_json::from_slice(&body).unwrap_or(Value::Null));
                        let r = hyper::Response::new(Full::new(Bytes::from_static(b"{}")));
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
async fn a_shadow_quota_that_would_refuse_serves_and_says_so() {
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat("ok", 30, 30)).await;
    let yaml = format!(
        r#"version: shadow-1
backends:
  - {{id: sh-b, kind: openai, base_url: "{}"}}
routes:
  - model: chat
    chain: [{{backend: sh-b, model: m}}]
quotas:
  # Every request's worst case (its prompt and 200 output tokens) is larger than 100.
  - {{name: sh-daily, scope: consumer, match: "*", window: day, limit_tokens: 100, enforce: shadow}}
  - {{name: sh-roomy, scope: consumer, match: "*", window: day, limit_tokens: 100000, enforce: shadow}}
"#,
        up.base_url()
    );
    let sc = Sidecar::start(&yaml).await;
    let before = scrape(sc.running.admin_addr).await;
    let body =
        j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200});
    let hdr = [("x-tollgate-consumer", "sh-alice")];
    for _ in 0..2 {
        let (code, h, _) = post_json(&sc.chat_url(), &body, &hdr).await;
        assert_eq!(code, 200, "a shadow bound never refuses");
        assert_eq!(
            h["x-tollgate-shadow"], "sh-daily",
            "only the bound that would refuse"
        );
        let id = h["x-tollgate-request-id"].to_str().unwrap().to_string();
        let rec = sc.audit(&id).await;
        assert_eq!(rec["final_action"], "ALLOW");
        let would = &rec["shadow"][0];
        assert_eq!(
            (
                &would["name"],
                &would["kind"],
                &would["scope"],
                &would["limit"]
            ),
            (&j!("sh-daily"), &j!("quota"), &j!("consumer"), &j!(100)),
            "{rec}"
        );
        assert!(would["requested"].as_u64().unwrap() > 100, "{would}");
        assert_eq!(rec["shadow"].as_array().unwrap().len(), 1, "{rec}");
    }
    // Counted like an enforced quota: both requests' 60 tokens, past its limit of 100.
    let (_, _, b) = get_with(
        &format!("http://{}/tollgate/v1/limits", sc.running.addr),
        &hdr,
    )
    .await;
    let v = common::json(&b);
    let row = v["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "sh-daily")
        .unwrap_or_else(|| panic!("{v}"))
        .clone();
    assert_eq!(
        (&row["used"], &row["enforce"]),
        (&j!(120), &j!("shadow")),
        "{row}"
    );
    let after = scrape(sc.running.admin_addr).await;
    let n = |m: &ops_support::Metrics, b: &str| {
        m.get("tollgate_shadow_refusals_total", &[("bound", b)])
    };
    assert_eq!(n(&after, "sh-daily") - n(&before, "sh-daily"), 2.0);
    assert_eq!(n(&after, "sh-roomy"), 0.0);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_burning_budget_is_forecast_and_alerted_once() {
    let (hook, got) = receiver().await;
    // One call reports 999 tokens of the day's 1000.
    let up = MockUpstream::start_with_default(vec![], Answer::ok_chat("ok", 500, 499)).await;
    let yaml = format!(
        r#"version: forecast-1
backends:
  - {{id: fc-b, kind: openai, base_url: "{}"}}
routes:
  - model: chat
    chain: [{{backend: fc-b, model: m}}]
budgets:
  - {{name: fc-daily, scope: global, window: day, hard_tokens: 1000}}
alerts: {{webhook_url: "{hook}", timeout: 2s}}
"#,
        up.base_url()
    );
    let sc = Sidecar::start(&yaml).await;
    let body =
        j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20});
    let (code, _, _) = post_json(&sc.chat_url(), &body, &[]).await;
    assert_eq!(code, 200);
    // At the day's average rate so far (999 tokens since midnight UTC) the last token goes in
    // about elapsed/999 s: before midnight unless the test runs in the day's first minute
    // (too short for a rate) or its last few (the window turns first).
    let now = jiff::Timestamp::now().as_second();
    let into_day = now.rem_euclid(86_400);
    let expect = into_day > 120 && into_day + into_day / 999 + 120 < 86_400;

    let (_, _, b) = get(&format!("http://{}/tollgate/v1/limits", sc.running.addr)).await;
    let v = common::json(&b);
    let row = v["limits"][0].clone();
    assert_eq!(row["name"], "fc-daily", "{v}");
    assert!(
        row["burn_per_hour_24h"].is_number() || into_day <= 120,
        "{row}"
    );
    let secs = row["projected_exhaustion_seconds"].as_u64();
    let st = status(sc.running.admin_addr).await;
    let srow = st["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "fc-daily")
        .unwrap()
        .clone();
    if !expect {
        eprintln!("too near a day boundary for a forecast: only the shape is checked");
        assert!(row.get("exhausts_at").is_some() && srow.get("exhausts_at").is_some());
        sc.stop().await;
        return;
    }
    let secs = secs.unwrap_or_else(|| panic!("no forecast: {row}"));
    assert!(secs <= into_day as u64 / 999 + 2, "{secs} s: {row}");
    let at: jiff::Timestamp = row["exhausts_at"].as_str().unwrap().parse().unwrap();
    assert!(
        at.as_second() >= now && at.as_second() < now - into_day + 86_400,
        "{row}"
    );
    assert!(srow["exhausts_at"].is_string(), "{srow}");

    // The forecast timer (every 10 s) sends the alert once and sets the gauge.
    let deadline = Instant::now() + Duration::from_secs(25);
    while got.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "no forecast alert");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let a = got.lock().unwrap()[0].clone();
    assert_eq!(
        (&a["alert"], &a["bound"], &a["scope"], &a["dim"]),
        (
            &j!("forecast"),
            &j!("fc-daily"),
            &j!("global"),
            &j!("tokens")
        ),
        "{a}"
    );
    assert_eq!(
        (a["used"].as_u64(), a["limit"].as_u64()),
        (Some(999), Some(1000))
    );
    let m = scrape(sc.running.admin_addr).await;
    let g = m.get(
        "tollgate_bound_projected_exhaustion_seconds",
        &[("bound", "fc-daily")],
    );
    assert!(g >= 0.0 && g <= secs as f64 + 20.0, "gauge {g}");
    // Later ticks of the same window send nothing more.
    let next = Instant::now() + Duration::from_secs(11);
    while Instant::now() < next {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(got.lock().unwrap().len(), 1, "{:?}", got.lock().unwrap());
    sc.stop().await;
}
