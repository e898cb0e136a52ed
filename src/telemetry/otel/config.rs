//! Export settings: the standard `OTEL_*` variables, over the policy's `telemetry.otlp`
//! section (the environment wins, as the operator's last word on a deployment).

use crate::policy::OtlpCfg;
use opentelemetry::KeyValue;
use opentelemetry_sdk::trace::Sampler;
use opentelemetry_sdk::Resource;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    HttpProtobuf,
}

/// Everything the exporter needs, resolved once at start.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Full URLs (`…/v1/traces`, `…/v1/metrics`).
    pub traces_endpoint: String,
    pub metrics_endpoint: String,
    pub protocol: Protocol,
    /// `service.name` when neither `OTEL_SERVICE_NAME` nor `OTEL_RESOURCE_ATTRIBUTES` names it.
    pub service_name: String,
    /// A `parentbased_traceidratio` ratio from the policy; `None`: the SDK reads
    /// `OTEL_TRACES_SAMPLER`/`_ARG` (default parent-based always-on).
    pub sample_ratio: Option<f64>,
    /// Bounded span queue (`OTEL_BSP_MAX_QUEUE_SIZE`, default 2048).
    pub queue: usize,
    /// Spans per export (`OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, default 512).
    pub batch: usize,
    /// Longest a span waits in the queue (`OTEL_BSP_SCHEDULE_DELAY`, ms, default 5000).
    pub schedule_delay: Duration,
    /// One export, retries included (`OTEL_EXPORTER_OTLP_TIMEOUT`, ms, default 10000).
    pub timeout: Duration,
    /// Metric export interval (`OTEL_METRIC_EXPORT_INTERVAL`, ms, default 60000).
    pub metric_interval: Duration,
}

const DEFAULT_QUEUE: usize = 2048;
const DEFAULT_BATCH: usize = 512;
const DEFAULT_DELAY: Duration = Duration::from_millis(5000);
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(10_000);
const DEFAULT_METRIC_INTERVAL: Duration = Duration::from_millis(60_000);
/// Largest queue the settings accept (spans are a few hundred bytes to a few KiB each).
const MAX_QUEUE: usize = 1 << 20;

/// Resolves the settings; `Ok(None)` when export is off (no endpoint, or `OTEL_SDK_DISABLED`).
pub fn settings(
    env: &dyn Fn(&str) -> Option<String>,
    policy: &OtlpCfg,
) -> Result<Option<Settings>, String> {
    let var = |k: &str| {
        env(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let base = var("OTEL_EXPORTER_OTLP_ENDPOINT").or_else(|| policy.endpoint.clone());
    let traces = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    let metrics = var("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT");
    if base.is_none() && traces.is_none() && metrics.is_none() {
        return Ok(None);
    }
    let protocol = var("OTEL_EXPORTER_OTLP_PROTOCOL").or_else(|| policy.protocol.clone());
    let protocol = match protocol.as_deref() {
        None | Some("http/protobuf") => Protocol::HttpProtobuf,
        Some(p) => {
            return Err(format!(
                "OTLP protocol `{p}` is not built in: use http/protobuf (the collector's port 4318)"
            ))
        }
    };
    let base = base.unwrap_or_else(|| "http://localhost:4318".into());
    let join = |path: &str| format!("{}/{path}", base.trim_end_matches('/'));
    let traces_endpoint = traces.unwrap_or_else(|| join("v1/traces"));
    let metrics_endpoint = metrics.unwrap_or_else(|| join("v1/metrics"));
    for u in [&traces_endpoint, &metrics_endpoint] {
        check_url(u)?;
    }
    let ms = |k: &str, default: Duration| -> Result<Duration, String> {
        match var(k) {
            None => Ok(default),
            Some(v) => v
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .map(Duration::from_millis)
                .ok_or_else(|| format!("{k}=`{v}` is not a positive number of milliseconds")),
        }
    };
    let count = |k: &str, default: usize| -> Result<usize, String> {
        match var(k) {
            None => Ok(default),
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=MAX_QUEUE).contains(n))
                .ok_or_else(|| format!("{k}=`{v}` is not a count in 1..={MAX_QUEUE}")),
        }
    };
    let queue = count(
        "OTEL_BSP_MAX_QUEUE_SIZE",
        policy.queue.unwrap_or(DEFAULT_QUEUE),
    )?;
    let batch = count("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_BATCH)?.min(queue);
    Ok(Some(Settings {
        traces_endpoint,
        metrics_endpoint,
        protocol,
        service_name: policy
            .service_name
            .clone()
            .unwrap_or_else(|| "tollgate".into()),
        sample_ratio: if var("OTEL_TRACES_SAMPLER").is_some() {
            None
        } else {
            policy.sample_ratio
        },
        queue,
        batch,
        schedule_delay: ms("OTEL_BSP_SCHEDULE_DELAY", DEFAULT_DELAY)?,
        timeout: ms("OTEL_EXPORTER_OTLP_TIMEOUT", DEFAULT_TIMEOUT)?,
        metric_interval: ms("OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_METRIC_INTERVAL)?,
    }))
}

fn check_url(u: &str) -> Result<(), String> {
    let ok = (u.starts_with("http://") || u.starts_with("https://"))
        && u.parse::<http::Uri>().is_ok_and(|x| x.host().is_some());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "OTLP endpoint `{u}` is not an http(s) URL with a host"
        ))
    }
}

impl Settings {
    /// Settings for an endpoint (tests, benches): every other knob at its default.
    pub fn for_endpoint(base: &str) -> Result<Settings, String> {
        let cfg = OtlpCfg {
            endpoint: Some(base.to_string()),
            ..OtlpCfg::default()
        };
        settings(&|_| None, &cfg)?.ok_or_else(|| "no endpoint".to_string())
    }

    /// The SDK's resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, telemetry.sdk.*),
    /// named `service_name` unless the environment names it.
    pub(super) fn resource(&self) -> Resource {
        let env_names = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
            || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| v.contains("service.name="));
        let b = Resource::builder()
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
        if env_names {
            b.build()
        } else {
            b.with_service_name(self.service_name.clone()).build()
        }
    }

    pub(super) fn sampler(&self) -> Option<Sampler> {
        self.sample_ratio
            .map(|r| Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(r))))
    }
}
