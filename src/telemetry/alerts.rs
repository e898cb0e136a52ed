//! Alert delivery. Each `alert_at` crossing (the governor finds them at settle time; committed
//! usage only grows within a window, so a crossing happens once per counter and window) is a
//! structured log event on target `tollgate::alert`, and — with `alerts.webhook_url` — a JSON
//! POST sent by a background task through a bounded queue, retried with exponential backoff.
//!
//! Never blocks the request path: a full queue drops the alert with a warning and counts it
//! in `tollgate_alerts_total{outcome="dropped"}` (the log event was still written).

use super::names::TOLLGATE_ALERTS_TOTAL;
use crate::governor::Record;
use crate::policy::AlertsCfg;
use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// First retry delay; doubles per attempt up to [`BACKOFF_MAX`].
const BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Where alerts go now; replaced when a reload changes the `alerts` section.
#[derive(Default)]
pub struct Alerts {
    sink: ArcSwapOption<Sink>,
}

struct Sink {
    cfg: AlertsCfg,
    /// `None` when no webhook is configured (log only).
    tx: Option<mpsc::Sender<Bytes>>,
}

impl Alerts {
    /// Adopts a policy's `alerts` section. A changed webhook gets a fresh queue and worker;
    /// the old worker finishes what it holds, then ends when its queue closes.
    pub fn configure(&self, cfg: &AlertsCfg) {
        if self.sink.load().as_ref().is_some_and(|s| &s.cfg == cfg) {
            return;
        }
        let tx = match (&cfg.webhook_url, tokio::runtime::Handle::try_current()) {
            (None, _) => None,
            (Some(url), Ok(rt)) => {
                let (tx, rx) = mpsc::channel(cfg.queue);
                rt.spawn(deliver(url.clone(), cfg.timeout, cfg.max_attempts, rx));
                Some(tx)
            }
            (Some(_), Err(_)) => {
                tracing::error!("alerts: no async runtime to deliver webhooks from; logging only");
                None
            }
        };
        self.sink.store(Some(Arc::new(Sink {
            cfg: cfg.clone(),
            tx,
        })));
    }

    /// Logs every crossing of `rec` and queues its webhook POSTs without waiting, to where
    /// `cfg` (the alert settings of the policy in force) says: a reload that changed them
    /// takes effect here, with the snapshot swap, and nowhere else. Returns how many were
    /// dropped because the queue was full.
    pub fn emit(&self, cfg: &AlertsCfg, rec: &Record, ts: &str) -> usize {
        self.configure(cfg);
        let sink = self.sink.load();
        let mut dropped = 0;
        for a in &rec.alerts {
            tracing::warn!(
                target: "tollgate::alert",
                bound = %a.bound,
                class = a.class,
                scope = a.scope,
                id = %a.id,
                window = a.window.unwrap_or("none"),
                dim = a.dim,
                threshold = a.threshold,
                used = %text(a.dim, a.used),
                limit = %text(a.dim, a.limit),
                policy_version = %rec.policy_version,
                "alert threshold crossed"
            );
            metrics::counter!(TOLLGATE_ALERTS_TOTAL, "outcome" => "logged").increment(1);
            let Some(tx) = sink.as_ref().and_then(|s| s.tx.as_ref()) else {
                continue;
            };
            let body = alert_body(a, rec, ts);
            if tx.try_send(Bytes::from(body.to_string())).is_err() {
                dropped += 1;
                metrics::counter!(TOLLGATE_ALERTS_TOTAL, "outcome" => "dropped").increment(1);
                tracing::warn!(
                    target: "tollgate::alert",
                    bound = %a.bound,
                    "alert webhook queue is full: this alert is dropped (it was logged)"
                );
            }
        }
        dropped
    }
}

/// A `forecast` alert (SPEC §9): at its trailing burn rate, a bound's hard limit is hit
/// before its window turns. Sent once per bound, counter and window (the governor marks it).
#[derive(Debug, Clone)]
pub struct ForecastAlert<'a> {
    pub bound: &'a str,
    pub class: &'static str,
    pub scope: &'static str,
    pub id: &'a str,
    pub window: Option<&'static str>,
    pub window_start: Option<i64>,
    pub dim: &'static str,
    pub used: u64,
    pub limit: u64,
    /// Units per hour over the trailing hour and day.
    pub per_hour_1h: Option<f64>,
    pub per_hour_24h: Option<f64>,
    /// RFC 3339 and seconds from now.
    pub exhausts_at: String,
    pub projected_exhaustion_seconds: u64,
    pub resets_at: String,
}

impl Alerts {
    /// Logs a forecast alert and queues its webhook POST without waiting; `false` when the
    /// queue was full (it was still logged).
    pub fn emit_forecast(
        &self,
        cfg: &AlertsCfg,
        f: &ForecastAlert<'_>,
        policy_version: &str,
        ts: &str,
    ) -> bool {
        self.configure(cfg);
        tracing::warn!(
            target: "tollgate::alert",
            alert = "forecast",
            bound = f.bound,
            class = f.class,
            scope = f.scope,
            id = f.id,
            window = f.window.unwrap_or("none"),
            dim = f.dim,
            used = %text(f.dim, f.used),
            limit = %text(f.dim, f.limit),
            exhausts_at = %f.exhausts_at,
            projected_exhaustion_seconds = f.projected_exhaustion_seconds,
            resets_at = %f.resets_at,
            policy_version,
            "bound projected to run out before its window turns"
        );
        metrics::counter!(TOLLGATE_ALERTS_TOTAL, "outcome" => "logged").increment(1);
        let sink = self.sink.load();
        let Some(tx) = sink.as_ref().and_then(|s| s.tx.as_ref()) else {
            return true;
        };
        let num = |v: u64| match f.dim {
            "usd" => serde_json::json!(crate::units::micros_to_usd(v)),
            _ => serde_json::json!(v),
        };
        let rate = |r: Option<f64>| match f.dim {
            "usd" => serde_json::json!(r.map(|r| r / 1e6)),
            _ => serde_json::json!(r),
        };
        let body = serde_json::json!({
            "alert": "forecast",
            "bound": f.bound,
            "class": f.class,
            "scope": f.scope,
            "id": f.id,
            "window": f.window,
            "window_start": f.window_start,
            "dim": f.dim,
            "used": num(f.used),
            "limit": num(f.limit),
            "used_text": text(f.dim, f.used),
            "limit_text": text(f.dim, f.limit),
            "burn_per_hour_1h": rate(f.per_hour_1h),
            "burn_per_hour_24h": rate(f.per_hour_24h),
            "exhausts_at": f.exhausts_at,
            "projected_exhaustion_seconds": f.projected_exhaustion_seconds,
            "resets_at": f.resets_at,
            "policy_version": policy_version,
            "ts": ts,
        });
        if tx.try_send(Bytes::from(body.to_string())).is_err() {
            metrics::counter!(TOLLGATE_ALERTS_TOTAL, "outcome" => "dropped").increment(1);
            tracing::warn!(target: "tollgate::alert", bound = f.bound, "alert webhook queue is full: this forecast alert is dropped (it was logged)");
            return false;
        }
        true
    }
}

type HttpsClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

fn client() -> HttpsClient {
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(crate::tls::client_config())
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new()).build(https)
}

/// The webhook worker: one alert at a time, in order, each retried with backoff.
async fn deliver(url: String, timeout: Duration, attempts: u32, mut rx: mpsc::Receiver<Bytes>) {
    let client = client();
    while let Some(body) = rx.recv().await {
        let mut delay = BACKOFF_INITIAL;
        for attempt in 1..=attempts.max(1) {
            match post(&client, &url, body.clone(), timeout).await {
                Ok(()) => {
                    metrics::counter!(TOLLGATE_ALERTS_TOTAL, "outcome" => "delivered").increment(1);
                    break;
                }
                Err(e) if attempt < attempts => {
                    tracing::warn!(target: "tollgate::alert", attempt, error = %e, retry_in_ms = delay.as_millis() as u64, "alert webhook failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(BACKOFF_MAX);
                }
                Err(e) => {
                    metrics::counter!(TOLLGATE_ALERTS_TOTAL, "outcome" => "failed").increment(1);
                    tracing::error!(target: "tollgate::alert", attempts, error = %e, "alert webhook failed; giving up on this alert");
                }
            }
        }
    }
}

async fn post(
    client: &HttpsClient,
    url: &str,
    body: Bytes,
    timeout: Duration,
) -> Result<(), String> {
    let req = http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::USER_AGENT, "tollgate-alerts")
        .body(Full::new(body))
        .map_err(|e| format!("bad request: {e}"))?;
    let resp = tokio::time::timeout(timeout, async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        // Read the (small) answer so the connection can be reused.
        let _ = resp.into_body().collect().await;
        Ok::<_, String>(status)
    })
    .await
    .map_err(|_| format!("no answer within {} ms", timeout.as_millis()))??;
    if resp.is_success() {
        Ok(())
    } else {
        Err(format!("HTTP {}", resp.as_u16()))
    }
}

/// An amount as people read it: dollars for usd (`$49.45`), counts otherwise.
fn text(dim: &str, v: u64) -> String {
    match dim {
        "usd" => crate::units::fmt_usd(v),
        _ => crate::units::group_thousands(v),
    }
}

/// The webhook's JSON for one crossing. Money is in dollars (never micro-units), with the
/// amounts also as text (`used_text`, `limit_text`).
pub fn alert_body(a: &crate::governor::AlertNote, rec: &Record, ts: &str) -> serde_json::Value {
    let num = |v: u64| match a.dim {
        "usd" => serde_json::json!(crate::units::micros_to_usd(v)),
        _ => serde_json::json!(v),
    };
    serde_json::json!({
        "bound": a.bound,
        "class": a.class,
        "scope": a.scope,
        "id": a.id,
        "window": a.window,
        "window_start": a.window_start,
        "dim": a.dim,
        "threshold": a.threshold,
        "used": num(a.used),
        "limit": num(a.limit),
        "used_text": text(a.dim, a.used),
        "limit_text": text(a.dim, a.limit),
        "policy_version": rec.policy_version,
        "ts": ts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::governor::AlertNote;

    fn record(n: usize) -> Record {
        let mut r = Record::new(
            Arc::from("v1"),
            Arc::from("r"),
            Arc::from("r"),
            Arc::from("c"),
            Arc::from("chat"),
        );
        for i in 0..n {
            r.alerts.push(AlertNote {
                bound: Arc::from(format!("b{i}").as_str()),
                class: "quota",
                scope: "global",
                id: Arc::from("global"),
                window: Some("day"),
                window_start: Some(0),
                dim: "tokens",
                threshold: 0.5,
                used: 5,
                limit: 10,
            });
        }
        r
    }

    #[tokio::test]
    async fn a_full_queue_drops_instead_of_waiting() {
        // Nothing listens on port 9 of localhost: the worker retries its first alert for a
        // while, so the queue (1) fills and later alerts are dropped, never awaited.
        let a = Alerts::default();
        let cfg = AlertsCfg {
            webhook_url: Some("http://127.0.0.1:9/hook".into()),
            timeout: Duration::from_millis(100),
            queue: 1,
            max_attempts: 50,
        };
        a.configure(&cfg);
        tokio::task::yield_now().await;
        let dropped = a.emit(&cfg, &record(5), "2026-01-01T00:00:00Z");
        assert!(dropped >= 3, "dropped {dropped}");
    }

    #[test]
    fn money_alerts_read_in_dollars() {
        let mut r = record(1);
        r.alerts[0].dim = "usd";
        r.alerts[0].used = 40_000_000;
        r.alerts[0].limit = 50_000_000;
        let b = alert_body(&r.alerts[0], &r, "t");
        assert_eq!(b["used"], 40.0);
        assert_eq!(b["limit"], 50.0);
        assert_eq!(b["used_text"], "$40.00");
        assert_eq!(b["limit_text"], "$50.00");
        let t = alert_body(&record(1).alerts[0], &r, "t");
        assert_eq!(
            (t["used"].as_u64(), t["limit_text"].as_str()),
            (Some(5), Some("10"))
        );
    }

    #[tokio::test]
    async fn without_a_webhook_alerts_are_only_logged() {
        let a = Alerts::default();
        let cfg = AlertsCfg {
            webhook_url: None,
            timeout: Duration::from_secs(1),
            queue: 1,
            max_attempts: 1,
        };
        assert_eq!(a.emit(&cfg, &record(3), "t"), 0);
        // The settings emit is given are the ones in force: no separate configure step.
        assert!(a.sink.load().as_ref().is_some_and(|s| s.cfg == cfg));
    }
}
