use super::config::settings;
use super::spans::Notes;
use crate::policy::OtlpCfg;
use std::collections::HashMap;
use std::time::Duration;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k: &str| m.get(k).cloned()
}

#[test]
fn off_without_an_endpoint_or_when_disabled() {
    let none = OtlpCfg::default();
    assert!(settings(&env(&[]), &none).unwrap().is_none());
    assert!(settings(&env(&[("OTEL_SERVICE_NAME", "x")]), &none)
        .unwrap()
        .is_none());
    let e = env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
        ("OTEL_SDK_DISABLED", "true"),
    ]);
    assert!(settings(&e, &none).unwrap().is_none());
}

#[test]
fn the_environment_wins_over_the_policy() {
    let p = OtlpCfg {
        endpoint: Some("http://from-policy:4318".into()),
        sample_ratio: Some(0.5),
        queue: Some(10),
        ..OtlpCfg::default()
    };
    let s = settings(&env(&[]), &p).unwrap().unwrap();
    assert_eq!(s.traces_endpoint, "http://from-policy:4318/v1/traces");
    assert_eq!((s.queue, s.batch, s.sample_ratio), (10, 10, Some(0.5)));
    let e = env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c.example:4318/"),
        ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://m:9/x"),
        ("OTEL_TRACES_SAMPLER", "always_off"),
        ("OTEL_BSP_SCHEDULE_DELAY", "250"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "100"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "1500"),
    ]);
    let s = settings(&e, &p).unwrap().unwrap();
    assert_eq!(s.traces_endpoint, "https://c.example:4318/v1/traces");
    assert_eq!(s.metrics_endpoint, "http://m:9/x");
    // The SDK reads OTEL_TRACES_SAMPLER itself: the policy's ratio stands aside.
    assert_eq!(s.sample_ratio, None);
    assert_eq!(s.schedule_delay, Duration::from_millis(250));
    assert_eq!(s.metric_interval, Duration::from_millis(1500));
    assert_eq!(s.queue, 100);
}

#[test]
fn bad_settings_are_errors() {
    let none = OtlpCfg::default();
    for pairs in [
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ],
        vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "c:4318")],
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_BSP_SCHEDULE_DELAY", "soon"),
        ],
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "0"),
        ],
    ] {
        assert!(settings(&env(&pairs), &none).is_err(), "{pairs:?}");
    }
}

#[test]
fn notes_read_model_finish_reasons_and_cached_tokens() {
    let mut n = Notes::default();
    n.scan(br#"{"id":"x","model": "gpt-4o-2024","choices":[{"index":0,"message":{"content":"say \"finish_reason\":\"evil\""},"finish_reason":"stop"},{"finish_reason":"length"}],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens": 7}}}"#);
    assert_eq!(n.model.as_deref(), Some("gpt-4o-2024"));
    assert_eq!(n.finish, ["stop", "length"]);
    assert_eq!(n.cached, Some(7));
    // Stream chunks: the first model stays, reasons are not repeated, null is skipped.
    n.scan(b"data: {\"model\":\"other\",\"choices\":[{\"delta\":{},\"finish_reason\":null}]}\n\n");
    n.scan(b"data: {\"choices\":[{\"finish_reason\":\"stop\"}]}\n\n");
    assert_eq!(n.model.as_deref(), Some("gpt-4o-2024"));
    assert_eq!(n.finish, ["stop", "length"]);
}
