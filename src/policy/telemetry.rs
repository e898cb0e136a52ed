//! Validation of the `telemetry` section: `otlp`, the OpenTelemetry export's defaults.

use super::source::Merged;
use super::types::{OtlpCfg, TelemetryCfg};
use super::validate::V;

/// Largest span queue accepted (the same bound as `OTEL_BSP_MAX_QUEUE_SIZE`).
/// Each slot holds a finished request's record (a few hundred bytes), allocated up front.
const MAX_QUEUE: usize = 1 << 16;

impl V<'_> {
    pub(super) fn telemetry_cfg(&mut self, m: &Merged) -> TelemetryCfg {
        let sec = m.telemetry.as_ref();
        let f = sec.map_or(0, |s| s.file);
        let Some(raw) = sec.and_then(|s| s.v.otlp.as_ref()) else {
            return TelemetryCfg::default();
        };
        let endpoint = match raw.endpoint.as_deref().map(str::trim) {
            None => None,
            Some(u) => {
                let ok = (u.starts_with("http://") || u.starts_with("https://"))
                    && u.parse::<http::Uri>().is_ok_and(|x| x.host().is_some());
                if ok {
                    Some(u.to_owned())
                } else {
                    self.err(
                        f,
                        "telemetry.otlp.endpoint",
                        format!("`{u}` must be an http:// or https:// URL with a host"),
                    )
                }
            }
        };
        let protocol = match raw.protocol.as_deref() {
            None => None,
            Some(p @ ("http/protobuf" | "grpc")) => Some(p.to_owned()),
            Some(p) => self.err(
                f,
                "telemetry.otlp.protocol",
                format!("`{p}` is not supported: use http/protobuf or grpc"),
            ),
        };
        let service_name = match raw.service_name.as_deref().map(str::trim) {
            Some("") => self.err(f, "telemetry.otlp.service_name", "must not be empty"),
            s => s.map(str::to_owned),
        };
        let sample_ratio = match raw.sample_ratio {
            Some(r) if !(0.0..=1.0).contains(&r) => self.err(
                f,
                "telemetry.otlp.sample_ratio",
                format!("{r} must be between 0 and 1"),
            ),
            r => r,
        };
        let queue = match raw.queue {
            Some(q) if q == 0 || q > MAX_QUEUE => self.err(
                f,
                "telemetry.otlp.queue",
                format!("{q} must be between 1 and {MAX_QUEUE}"),
            ),
            q => q,
        };
        TelemetryCfg {
            otlp: OtlpCfg {
                endpoint,
                protocol,
                service_name,
                sample_ratio,
                queue,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::from_str;

    const BASE: &str = "version: a-1
backends:
  - {id: primary, kind: openai, base_url: 'http://127.0.0.1:9/v1'}
routes:
  - model: chat
    chain: [{backend: primary, model: small}]
";

    #[test]
    fn absent_or_empty_is_off() {
        let p = from_str(BASE, "p.yaml").unwrap();
        assert_eq!(p.telemetry.otlp.endpoint, None);
        let p = from_str(&format!("{BASE}telemetry:\n  otlp: {{}}\n"), "p.yaml").unwrap();
        assert_eq!(p.telemetry, Default::default());
    }

    #[test]
    fn reads_every_key() {
        let y = format!(
            "{BASE}telemetry:\n  otlp: {{endpoint: 'http://collector:4318', protocol: http/protobuf, service_name: gw, sample_ratio: 0.25, queue: 64}}\n"
        );
        let o = from_str(&y, "p.yaml").unwrap().telemetry.otlp;
        assert_eq!(o.endpoint.as_deref(), Some("http://collector:4318"));
        assert_eq!(o.protocol.as_deref(), Some("http/protobuf"));
        assert_eq!(o.service_name.as_deref(), Some("gw"));
        assert_eq!((o.sample_ratio, o.queue), (Some(0.25), Some(64)));
    }

    #[test]
    fn bad_values_are_errors_with_their_path() {
        for (kv, path) in [
            ("endpoint: 'collector:4318'", "telemetry.otlp.endpoint"),
            ("protocol: http/json", "telemetry.otlp.protocol"),
            ("sample_ratio: 1.5", "telemetry.otlp.sample_ratio"),
            ("queue: 0", "telemetry.otlp.queue"),
            ("service_name: ''", "telemetry.otlp.service_name"),
            ("endpoints: x", "endpoints"),
        ] {
            let y = format!("{BASE}telemetry:\n  otlp: {{{kv}}}\n");
            let e = from_str(&y, "p.yaml").unwrap_err().to_string();
            assert!(e.contains(path), "{kv}: {e}");
        }
    }
}
