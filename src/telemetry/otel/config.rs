//! Export settings: the standard `OTEL_*` variables, over the policy's `telemetry.otlp`
//! section (the environment wins, as the operator's last word on a deployment).

use super::context::{Root, Sampler};
use crate::policy::OtlpCfg;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP/HTTP with protobuf bodies (the collector's port 4318).
    HttpProtobuf,
    /// OTLP/gRPC over HTTP/2 (the collector's port 4317; cleartext `http://` is h2c).
    Grpc,
}

/// The gRPC methods the exports call (appended to the endpoint, as the OTLP spec says).
const GRPC_TRACES: &str = "opentelemetry.proto.collector.trace.v1.TraceService/Export";
const GRPC_METRICS: &str = "opentelemetry.proto.collector.metrics.v1.MetricsService/Export";

/// Everything the exporter needs, resolved once at start.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Full URLs (`…/v1/traces`, `…/v1/metrics`).
    pub traces_endpoint: String,
    pub metrics_endpoint: String,
    pub protocol: Protocol,
    /// `service.name`: `OTEL_SERVICE_NAME`, else `OTEL_RESOURCE_ATTRIBUTES`' own, else the
    /// policy's `service_name`, else `tollgate`.
    pub service_name: String,
    /// The other resource attributes (`OTEL_RESOURCE_ATTRIBUTES`, percent-decoded).
    pub resource_attributes: Vec<(String, String)>,
    /// `OTEL_TRACES_SAMPLER`/`_ARG`, else the policy's `sample_ratio` (parent-based), else
    /// parent-based always-on.
    pub sampler: Sampler,
    /// `OTEL_EXPORTER_OTLP_HEADERS` (and the per-signal variables' are not read): sent with
    /// every export, marked sensitive, never logged.
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// Most spans waiting for the sender, in whole batches (`OTEL_BSP_MAX_QUEUE_SIZE`, default
    /// 2048); each thread's batch being filled is on top of it.
    pub queue: usize,
    /// Spans per export (`OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, default 512).
    pub batch: usize,
    /// Longest a span waits in its thread's batch (`OTEL_BSP_SCHEDULE_DELAY`, ms, default 5000).
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
/// Each slot holds a finished request's record (a few hundred bytes), allocated up front.
const MAX_QUEUE: usize = 1 << 16;

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
        Some("grpc") => Protocol::Grpc,
        Some(p) => {
            return Err(format!(
                "OTLP protocol `{p}` is not built in: use http/protobuf (the collector's port \
                 4318) or grpc (4317)"
            ))
        }
    };
    let join = |base: &str, path: &str| format!("{}/{path}", base.trim_end_matches('/'));
    let (traces_endpoint, metrics_endpoint) = match protocol {
        Protocol::HttpProtobuf => {
            let base = base.unwrap_or_else(|| "http://localhost:4318".into());
            (
                traces.unwrap_or_else(|| join(&base, "v1/traces")),
                metrics.unwrap_or_else(|| join(&base, "v1/metrics")),
            )
        }
        // gRPC endpoints name the collector only; the method is the path.
        Protocol::Grpc => {
            let base = base.unwrap_or_else(|| "http://localhost:4317".into());
            (
                join(traces.as_deref().unwrap_or(&base), GRPC_TRACES),
                join(metrics.as_deref().unwrap_or(&base), GRPC_METRICS),
            )
        }
    };
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
    let sampler = match var("OTEL_TRACES_SAMPLER") {
        Some(name) => Sampler::from_env(&name, var("OTEL_TRACES_SAMPLER_ARG").as_deref())?,
        None => match policy.sample_ratio {
            Some(r) if (0.0..=1.0).contains(&r) => Sampler::ParentBased(Root::Ratio(r)),
            Some(r) => return Err(format!("telemetry.otlp.sample_ratio {r} is not in 0..=1")),
            None => Sampler::ParentBased(Root::AlwaysOn),
        },
    };
    let mut resource_attributes = match var("OTEL_RESOURCE_ATTRIBUTES") {
        Some(v) => pairs("OTEL_RESOURCE_ATTRIBUTES", &v)?,
        None => Vec::new(),
    };
    let from_attrs = resource_attributes
        .iter()
        .position(|(k, _)| k == "service.name")
        .map(|i| resource_attributes.remove(i).1);
    let service_name = var("OTEL_SERVICE_NAME")
        .or(from_attrs)
        .or_else(|| policy.service_name.clone())
        .unwrap_or_else(|| "tollgate".into());
    let mut headers = Vec::new();
    if let Some(v) = var("OTEL_EXPORTER_OTLP_HEADERS") {
        for (k, v) in pairs("OTEL_EXPORTER_OTLP_HEADERS", &v)? {
            let name = http::HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| format!("OTEL_EXPORTER_OTLP_HEADERS: `{k}` is not a header name"))?;
            let mut value = http::HeaderValue::from_str(&v).map_err(|_| {
                format!("OTEL_EXPORTER_OTLP_HEADERS: the value of `{k}` is not a header value")
            })?;
            value.set_sensitive(true);
            headers.push((name, value));
        }
    }
    Ok(Some(Settings {
        traces_endpoint,
        metrics_endpoint,
        protocol,
        service_name,
        resource_attributes,
        sampler,
        headers,
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

    /// The resource's attributes, in export order: `service.name`, `service.version`, the
    /// `telemetry.sdk.*` trio, then `OTEL_RESOURCE_ATTRIBUTES`' others.
    pub(super) fn resource(&self) -> Vec<(String, String)> {
        let mut out = vec![
            ("service.name".to_string(), self.service_name.clone()),
            (
                "service.version".to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            ),
            ("telemetry.sdk.name".to_string(), "tollgate".to_string()),
            ("telemetry.sdk.language".to_string(), "rust".to_string()),
            (
                "telemetry.sdk.version".to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            ),
        ];
        for (k, v) in &self.resource_attributes {
            match out.iter_mut().find(|(ok, _)| ok == k) {
                Some(slot) => slot.1 = v.clone(),
                None => out.push((k.clone(), v.clone())),
            }
        }
        out
    }
}

/// `k=v,k2=v2` (the W3C Baggage-like list the OTel spec uses for `OTEL_RESOURCE_ATTRIBUTES`
/// and `OTEL_EXPORTER_OTLP_HEADERS`): keys trimmed, values trimmed and percent-decoded.
fn pairs(var: &str, v: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for item in v.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, val) = item
            .split_once('=')
            // Not echoed: a header entry may hold a key.
            .ok_or_else(|| format!("{var}: an entry is not key=value"))?;
        let k = k.trim();
        if k.is_empty() {
            return Err(format!("{var}: an entry has an empty key"));
        }
        let val = percent_decode(val.trim())
            .ok_or_else(|| format!("{var}: the value of `{k}` is not valid percent-encoding"))?;
        out.push((k.to_string(), val));
    }
    Ok(out)
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = b.get(i + 1..i + 3)?;
            let h = std::str::from_utf8(h).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}
