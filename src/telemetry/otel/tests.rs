use super::config::settings;
use super::context::{Root, Sampler};
use super::notes::Notes;
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
    assert_eq!((s.queue, s.batch), (10, 10));
    assert_eq!(s.sampler, Sampler::ParentBased(Root::Ratio(0.5)));
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
    // OTEL_TRACES_SAMPLER wins over the policy's ratio.
    assert_eq!(s.sampler, Sampler::AlwaysOff);
    assert_eq!(s.schedule_delay, Duration::from_millis(250));
    assert_eq!(s.metric_interval, Duration::from_millis(1500));
    assert_eq!(s.queue, 100);
}

#[test]
fn headers_resource_attributes_and_samplers_come_from_the_standard_variables() {
    let none = OtlpCfg::default();
    let e = env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
        (
            "OTEL_EXPORTER_OTLP_HEADERS",
            "api-key=s3cr%20t, x-team = payments",
        ),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "service.name=from-attrs,deployment.environment=prod",
        ),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", "0.1"),
    ]);
    let s = settings(&e, &none).unwrap().unwrap();
    assert_eq!(s.headers.len(), 2);
    assert_eq!(s.headers[0].0.as_str(), "api-key");
    assert_eq!(s.headers[0].1.to_str().unwrap(), "s3cr t");
    assert!(
        s.headers[0].1.is_sensitive(),
        "a collector key is never logged"
    );
    assert_eq!(s.headers[1].1.to_str().unwrap(), "payments");
    assert_eq!(s.sampler, Sampler::ParentBased(Root::Ratio(0.1)));
    assert_eq!(s.service_name, "from-attrs");
    let r = s.resource();
    assert!(r.contains(&("service.name".into(), "from-attrs".into())));
    assert!(r.contains(&("deployment.environment".into(), "prod".into())));
    // OTEL_SERVICE_NAME wins over the list's service.name.
    let e = env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
        ("OTEL_SERVICE_NAME", "named"),
        ("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs"),
    ]);
    assert_eq!(settings(&e, &none).unwrap().unwrap().service_name, "named");
    // A malformed header list is an error that does not echo the entry (it may hold a key).
    let e = env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "Bearer-sk-live-123"),
    ]);
    let err = settings(&e, &none).unwrap_err();
    assert!(!err.contains("sk-live"), "{err}");
}

#[test]
fn grpc_endpoints_name_the_collector_and_the_method_is_the_path() {
    let none = OtlpCfg::default();
    let e = env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317/"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
    ]);
    let s = settings(&e, &none).unwrap().unwrap();
    assert_eq!(s.protocol, super::Protocol::Grpc);
    assert_eq!(
        s.traces_endpoint,
        "http://c:4317/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    );
    assert_eq!(
        s.metrics_endpoint,
        "http://c:4317/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
    );
}

#[test]
fn bad_settings_are_errors() {
    let none = OtlpCfg::default();
    for pairs in [
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
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
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_TRACES_SAMPLER", "jaeger_remote"),
        ],
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_RESOURCE_ATTRIBUTES", "k=%zz"),
        ],
    ] {
        assert!(settings(&env(&pairs), &none).is_err(), "{pairs:?}");
    }
}

#[test]
fn notes_read_model_finish_reasons_and_cached_tokens() {
    let mut n = Notes::default();
    n.scan(br#"{"id":"x","model": "gpt-4o-2024","choices":[{"index":0,"message":{"content":"say \"finish_reason\":\"evil\""},"finish_reason":"stop"},{"finish_reason":"length"}],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens": 7}}}"#, true);
    assert_eq!(n.model.as_deref(), Some("gpt-4o-2024"));
    assert_eq!(n.finish, ["stop", "length"]);
    assert_eq!(n.cached, Some(7));
    // Stream chunks: the first model stays, reasons are not repeated, null is skipped.
    n.scan(
        b"data: {\"model\":\"other\",\"choices\":[{\"delta\":{},\"finish_reason\":null}]}\n\n",
        true,
    );
    n.scan(
        b"data: {\"choices\":[{\"finish_reason\":\"stop\"}]}\n\n",
        true,
    );
    // Unsampled: only the model is read (the metrics' response model).
    let mut u = Notes::default();
    u.scan(br#"{"model":"m","choices":[{"finish_reason":"stop"}],"usage":{"prompt_tokens_details":{"cached_tokens":3}}}"#, false);
    assert_eq!(u.model.as_deref(), Some("m"));
    assert!(u.finish.is_empty() && u.cached.is_none());
    assert_eq!(n.model.as_deref(), Some("gpt-4o-2024"));
    assert_eq!(n.finish, ["stop", "length"]);
}

/// Cost of the span path for one governed request with export on: server span, one attempt
/// span with its `traceparent`, the answer's notes, the end of both spans with their protobuf
/// encoding and the three metric records, and (on the same thread) the export task's turns. A
/// measurement, not a check: `cargo test --lib otel_cost -- --ignored --nocapture`.
#[tokio::test(flavor = "current_thread")]
#[ignore]
async fn otel_cost() {
    use crate::audit::Entry;
    use crate::governor::{CallResult, CallSpec, Record, UsageEvidence};
    use std::sync::Arc;
    let p = crate::policy::from_str(
        "version: v\nbackends:\n  - {id: b, kind: openai, base_url: 'http://127.0.0.1:9/v1'}\nroutes:\n  - model: chat\n    chain: [{backend: b, model: m}]\n",
        "p.yaml",
    )
    .unwrap();
    let backend = &p.backends[0];
    let mut rec = Record::test_chat("b");
    rec.upstream_model = Some(Arc::from("m"));
    rec.usage_evidence_state = UsageEvidence::Actual;
    rec.actual_input_tokens = 10;
    rec.actual_output_tokens = 5;
    let entry = Entry {
        ts: "2026-01-01T00:00:00Z".into(),
        endpoint: "chat.completions",
        api: "openai",
        latency_ms: 3.2,
        record: rec,
    };
    let body = br#"{"id":"x","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":0}}}"#;
    let mut headers = http::HeaderMap::new();
    headers.insert(
        "traceparent",
        http::HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    );
    // Nothing listens on port 9: exports fail at once (encoding done, no network wait).
    let mut s = super::Settings::for_endpoint("http://127.0.0.1:9").unwrap();
    s.queue = 1 << 16;
    super::install(&s).unwrap();
    let one = || async {
        let t = super::start(&headers, crate::estimate::Endpoint::Chat).unwrap();
        let gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
        crate::telemetry::scope::run(gone, Some(t), async {
            let model: Arc<str> = Arc::from("m");
            let spec = CallSpec {
                backend,
                backend_index: 0,
                model: &model,
                max_output_tokens: 50,
                attempt: 1,
                probe: false,
                output_cap_field: None,
            };
            let a = super::attempt(&spec).unwrap();
            let mut h = http::HeaderMap::new();
            a.inject(&mut h);
            a.end(&CallResult::<()>::Served(()));
            super::note_body(body);
            super::finish(&entry);
        })
        .await;
    };
    for _ in 0..2000 {
        one().await;
    }
    let n = 50_000;
    let t0 = std::time::Instant::now();
    for i in 0..n {
        one().await;
        if i % 256 == 0 {
            // Let the export task run on this thread: its CPU counts too.
            tokio::task::yield_now().await;
        }
    }
    super::flush(std::time::Duration::from_secs(5)).await;
    let on = t0.elapsed().as_nanos() as f64 / n as f64;
    super::shutdown(std::time::Duration::from_millis(200)).await;
    let t0 = std::time::Instant::now();
    let mut hits = 0u32;
    for _ in 0..n {
        if std::hint::black_box(super::start(&headers, crate::estimate::Endpoint::Chat)).is_some() {
            hits += 1;
        }
    }
    let off = t0.elapsed().as_nanos() as f64 / n as f64;
    eprintln!("otel on: {on:.0} ns per request (spans + metrics + export encoding); off: {off:.1} ns ({hits})");
}

/// The caller's trace context is found among a few headers (by comparing names) and among
/// many (by the map's look-up), wherever it sits, and its absence starts a trace of its own.
#[test]
fn the_callers_trace_context_is_found_among_few_or_many_headers() {
    use super::context::Sampler;
    use super::spans::RequestTrace;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for others in [0usize, 3, 31, 32, 33, 60] {
        for at in [0, others / 2, others] {
            let mut h = http::HeaderMap::new();
            for i in 0..others {
                if i == at {
                    h.insert("traceparent", tp.parse().unwrap());
                    h.insert("tracestate", "k=v".parse().unwrap());
                }
                h.insert(
                    http::HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap(),
                    "1".parse().unwrap(),
                );
            }
            if at == others {
                h.insert("traceparent", tp.parse().unwrap());
                h.insert("tracestate", "k=v".parse().unwrap());
            }
            let t = RequestTrace::start(Sampler::AlwaysOn, &h, "/v1/chat/completions", "chat");
            let want: [u8; 16] = [
                0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e,
                0x47, 0x36,
            ];
            assert_eq!(t.f.ids.trace_id, want, "{others} headers, at {at}");
            assert_eq!(
                t.f.parent,
                Some([0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7])
            );
            assert_eq!(t.f.ids.tracestate.as_ref().unwrap(), "k=v");
            h.remove("traceparent");
            let t = RequestTrace::start(Sampler::AlwaysOn, &h, "/v1/chat/completions", "chat");
            assert_ne!(t.f.ids.trace_id, want, "{others} headers, none");
            assert!(t.f.parent.is_none() && t.f.ids.tracestate.is_none());
        }
    }
}

/// Finish reasons compare as the lists they are, whichever codes they were kept as.
#[test]
fn finish_reason_lists_compare_by_their_reasons() {
    use super::notes::Finish;
    let list = |rs: &[&str]| {
        let mut f = Finish::default();
        for r in rs {
            f.add(r);
        }
        f
    };
    assert_eq!(list(&["stop", "odd"]), list(&["stop", "odd", "stop"]));
    assert_ne!(list(&["stop", "odd"]), list(&["odd", "stop"]));
    assert_ne!(list(&["odd"]), list(&["other"]));
    assert_ne!(list(&["stop"]), list(&["stop", "length"]));
    let mut reused = list(&["odd", "length"]);
    reused.clear();
    reused.add("stop");
    assert_eq!(reused, list(&["stop"]));
    assert_eq!(list(&[]), Finish::default());
}
