//! OpenTelemetry export over real HTTP (issue 16): an in-process OTLP/HTTP receiver decodes
//! what the sidecar sends (protobuf, `opentelemetry-proto` types) and the tests check the
//! trace joined to the caller's, the per-attempt spans and their propagation upstream, the
//! GenAI attributes and metrics; a collector that never answers slows and fails nothing; with
//! export off the client's trace headers pass through as before.
//!
//! The exporter is process-wide: the tests take turns (`TURN`).

mod common;

use bytes::Bytes;
use common::mock::{Answer, MockUpstream};
use common::sidecar::Sidecar;
use common::{json, post_json};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{metric, HistogramDataPoint};
use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, Span};
use prost::Message;
use serde_json::json as j;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tollgate::telemetry::otel::{self, Settings};

static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// What the receiver got, decoded.
#[derive(Default)]
struct Got {
    spans: Vec<Span>,
    /// The `api-key` header of each export.
    keys: Vec<String>,
    metrics: Vec<ExportMetricsServiceRequest>,
}

struct Receiver {
    addr: SocketAddr,
    got: Arc<Mutex<Got>>,
    grpc: bool,
}

/// gRPC's five-byte message prefix: uncompressed, big-endian length.
fn grpc_message(b: Bytes) -> Bytes {
    assert_eq!(b[0], 0, "uncompressed");
    let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
    assert_eq!(len, b.len() - 5, "one whole message");
    b.slice(5..)
}

impl Receiver {
    async fn start() -> Receiver {
        Self::start_as(false, "0").await
    }

    /// An OTLP/gRPC receiver (h2c): the methods' paths, framed messages, `grpc-status` trailers.
    async fn start_grpc() -> Receiver {
        Self::start_as(true, "0").await
    }

    /// An OTLP/gRPC receiver that decodes every export and answers it with `grpc_status`.
    async fn start_as(grpc: bool, grpc_status: &'static str) -> Receiver {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let got = Arc::new(Mutex::new(Got::default()));
        let g = got.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let g = g.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let g = g.clone();
                        async move {
                            let path = req.uri().path().to_string();
                            let key = req
                                .headers()
                                .get("api-key")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_string();
                            if grpc {
                                assert_eq!(req.version(), http::Version::HTTP_2);
                                assert_eq!(
                                    req.headers().get("content-type").unwrap(),
                                    "application/grpc"
                                );
                            }
                            let mut body = req.into_body().collect().await.unwrap().to_bytes();
                            let path = match (grpc, path.as_str()) {
                                (true, "/opentelemetry.proto.collector.trace.v1.TraceService/Export") => {
                                    body = grpc_message(body);
                                    "/v1/traces".to_string()
                                }
                                (true, "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export") => {
                                    body = grpc_message(body);
                                    "/v1/metrics".to_string()
                                }
                                (true, p) => panic!("unexpected gRPC method {p}"),
                                (false, _) => path,
                            };
                            let mut got = g.lock().unwrap();
                            got.keys.push(key);
                            match path.as_str() {
                                "/v1/traces" => {
                                    let r = ExportTraceServiceRequest::decode(body).unwrap();
                                    for rs in r.resource_spans {
                                        for ss in rs.scope_spans {
                                            got.spans.extend(ss.spans);
                                        }
                                    }
                                }
                                "/v1/metrics" => got
                                    .metrics
                                    .push(ExportMetricsServiceRequest::decode(body).unwrap()),
                                p => panic!("unexpected OTLP path {p}"),
                            }
                            let resp = if grpc {
                                // An empty Export*ServiceResponse, then the grpc-status.
                                let mut trailers = http::HeaderMap::new();
                                trailers.insert(
                                    "grpc-status",
                                    http::HeaderValue::from_static(grpc_status),
                                );
                                let frames = vec![
                                    Ok::<_, std::convert::Infallible>(Frame::data(
                                        Bytes::from_static(&[0, 0, 0, 0, 0]),
                                    )),
                                    Ok(Frame::trailers(trailers)),
                                ];
                                let mut r = http::Response::new(
                                    StreamBody::new(futures_util::stream::iter(frames)).boxed(),
                                );
                                r.headers_mut().insert(
                                    "content-type",
                                    http::HeaderValue::from_static("application/grpc"),
                                );
                                r
                            } else {
                                let mut r = http::Response::new(Full::new(Bytes::new()).boxed());
                                r.headers_mut().insert(
                                    "content-type",
                                    http::HeaderValue::from_static("application/x-protobuf"),
                                );
                                r
                            };
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        Receiver { addr, got, grpc }
    }

    fn settings(&self) -> Settings {
        let base = format!("http://{}", self.addr);
        let mut s = if self.grpc {
            let env = |k: &str| match k {
                "OTEL_EXPORTER_OTLP_ENDPOINT" => Some(base.clone()),
                "OTEL_EXPORTER_OTLP_PROTOCOL" => Some("grpc".to_string()),
                _ => None,
            };
            otel::settings(&env, &Default::default()).unwrap().unwrap()
        } else {
            Settings::for_endpoint(&base).unwrap()
        };
        s.schedule_delay = Duration::from_millis(50);
        s.timeout = Duration::from_secs(5);
        s
    }
}

/// Now on the wall clock, Unix ns.
fn unix_ns() -> u64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    u64::try_from(d.as_nanos()).unwrap()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attr<'a>(attrs: &'a [KeyValue], k: &str) -> Option<&'a any_value::Value> {
    attrs
        .iter()
        .find(|kv| kv.key == k)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

fn s_attr(sp: &Span, k: &str) -> String {
    match attr(&sp.attributes, k) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        other => panic!("{} {k}: {other:?}", sp.name),
    }
}

fn i_attr(sp: &Span, k: &str) -> i64 {
    match attr(&sp.attributes, k) {
        Some(any_value::Value::IntValue(i)) => *i,
        other => panic!("{} {k}: {other:?}", sp.name),
    }
}

fn chain_yaml(a: &MockUpstream, b: &MockUpstream) -> String {
    format!(
        r#"
version: otel-1
backends:
  - {{id: first, kind: openai, base_url: {}}}
  - {{id: second, kind: openai, base_url: {}}}
routes:
  - model: chat
    chain:
      - {{backend: first, model: m-first}}
      - {{backend: second, model: m-second}}
retry: {{max_attempts_per_job: 3, same_backend_retries: 0}}
"#,
        a.base_url(),
        b.base_url()
    )
}

/// A one-line chat request carrying `traceparent`; its status.
async fn say_hi(sc: &Sidecar, traceparent: &str) -> u16 {
    let body = j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    post_json(&sc.chat_url(), &body, &[("traceparent", traceparent)])
        .await
        .0
}

/// Says hi under a request id; the answer's body (asserted 200).
async fn hi_with_id(sc: &Sidecar, id: &str) -> Vec<u8> {
    let (st, _, out) = post_json(
        &sc.chat_url(),
        &j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        &[("x-request-id", id)],
    )
    .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&out));
    out.to_vec()
}

/// `tollgate_otel_dropped_spans_total{reason}` now (process-wide: compare before and after).
fn dropped(reason: &str) -> f64 {
    tollgate::telemetry::global()
        .render()
        .lines()
        .find(|l| {
            l.starts_with("tollgate_otel_dropped_spans_total")
                && l.contains(&format!("reason=\"{reason}\""))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Histogram points of a metric in the last export that has it (cumulative: the totals).
fn points(got: &Got, name: &str) -> Vec<HistogramDataPoint> {
    let mut out = Vec::new();
    for r in got.metrics.iter().rev() {
        if !out.is_empty() {
            break;
        }
        for rm in &r.resource_metrics {
            for sm in &rm.scope_metrics {
                for m in sm.metrics.iter().filter(|m| m.name == name) {
                    if let Some(metric::Data::Histogram(h)) = &m.data {
                        out.extend(h.data_points.iter().cloned());
                    }
                }
            }
        }
    }
    out
}

fn p_attr(p: &HistogramDataPoint, k: &str) -> Option<String> {
    match attr(&p.attributes, k) {
        Some(any_value::Value::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_per_request_joined_to_the_callers_with_attempt_spans_and_genai_metrics() {
    let _turn = TURN.lock().await;
    let rx = Receiver::start().await;
    otel::install(&rx.settings()).expect("install");
    let a = MockUpstream::start(vec![Answer::status(503), Answer::status(503)]).await;
    let b = MockUpstream::start(vec![
        Answer::ok_chat("the served completion", 12, 7),
        Answer::sse_chat(&["str", "eamed"], Some((5, 2)), Duration::from_millis(5)),
    ])
    .await;
    let sc = Sidecar::start(&chain_yaml(&a, &b)).await;
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let prompt = "a secret prompt";
    let before = unix_ns();
    let body =
        j!({"model": "chat", "messages": [{"role": "user", "content": prompt}], "max_tokens": 50});
    let (s, _, out) = post_json(
        &sc.chat_url(),
        &body,
        &[
            ("traceparent", traceparent.as_str()),
            ("tracestate", "vendor=x"),
            ("x-request-id", "otel-1"),
        ],
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&out));
    assert_eq!(
        json(&out)["choices"][0]["message"]["content"],
        "the served completion"
    );
    // A stream: its server span ends with the stream, and the first chunk is timed.
    let mut sbody = body.clone();
    sbody["stream"] = j!(true);
    let (s, _, out) = post_json(
        &sc.chat_url(),
        &sbody,
        &[
            ("x-request-id", "otel-2"),
            ("x-tollgate-job", "agent-run-7"),
        ],
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&out));
    let after = unix_ns();
    // Each record (and its span) is closed just after its answer is written.
    sc.recorded(2).await;
    otel::flush(Duration::from_secs(10)).await;

    let got = std::mem::take(&mut *rx.got.lock().unwrap());
    let trace: Vec<&Span> = got
        .spans
        .iter()
        .filter(|s| hex(&s.trace_id) == CLIENT_TRACE)
        .collect();
    let server: Vec<&&Span> = trace
        .iter()
        .filter(|s| s.kind == SpanKind::Server as i32)
        .collect();
    assert_eq!(server.len(), 1, "one server span in the caller's trace");
    let server = *server[0];
    assert_eq!(
        hex(&server.parent_span_id),
        CLIENT_SPAN,
        "continues the caller's span"
    );
    assert_eq!(server.name, "chat chat");
    assert_eq!(s_attr(server, "gen_ai.operation.name"), "chat");
    assert_eq!(s_attr(server, "gen_ai.request.model"), "chat");
    assert_eq!(s_attr(server, "gen_ai.provider.name"), "openai");
    assert_eq!(s_attr(server, "gen_ai.response.model"), "m-second");
    assert_eq!(i_attr(server, "gen_ai.usage.input_tokens"), 12);
    assert_eq!(i_attr(server, "gen_ai.usage.output_tokens"), 7);
    assert_eq!(i_attr(server, "gen_ai.usage.cache_read.input_tokens"), 0);
    assert_eq!(i_attr(server, "gen_ai.request.max_tokens"), 50);
    assert_eq!(s_attr(server, "tollgate.final_action"), "ALLOW");
    assert_eq!(s_attr(server, "tollgate.reason_class"), "UPSTREAM_FAILURE");
    assert_eq!(s_attr(server, "tollgate.fallback_state"), "USED");
    assert_eq!(s_attr(server, "tollgate.consumer"), "default");
    assert_eq!(s_attr(server, "tollgate.route"), "chat");
    assert_eq!(s_attr(server, "tollgate.policy_version"), "otel-1");
    assert_eq!(s_attr(server, "tollgate.request_id"), "otel-1");
    // Without a job header the request is its own job.
    assert_eq!(s_attr(server, "tollgate.job_id"), "otel-1");
    match attr(&server.attributes, "gen_ai.response.finish_reasons") {
        Some(any_value::Value::ArrayValue(a)) => assert_eq!(
            a.values[0].value,
            Some(any_value::Value::StringValue("stop".into()))
        ),
        other => panic!("finish reasons: {other:?}"),
    }

    // One client span per attempt, children of the server span, in order.
    let mut attempts: Vec<&&Span> = trace
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .collect();
    attempts.sort_by_key(|s| i_attr(s, "tollgate.attempt"));
    assert_eq!(attempts.len(), 2);
    for s in &attempts {
        assert_eq!(s.parent_span_id, server.span_id);
    }
    let (first, second) = (attempts[0], attempts[1]);
    // Times: on the wall clock of the request, each attempt inside the request, in order.
    let times = |s: &Span| (s.start_time_unix_nano, s.end_time_unix_nano);
    let (start, end) = times(server);
    assert!(
        before <= start && start <= end && end <= after,
        "{before} {start} {end} {after}"
    );
    assert!(
        start <= first.start_time_unix_nano,
        "the first attempt starts in the request"
    );
    assert!(times(first).0 <= times(first).1 && times(first).1 <= times(second).0);
    assert!(times(second).0 <= times(second).1 && times(second).1 <= end);
    assert_eq!(first.name, "chat m-first");
    assert_eq!(s_attr(first, "error.type"), "5xx");
    assert_eq!(i_attr(first, "http.response.status_code"), 503);
    assert_eq!(s_attr(first, "tollgate.backend"), "first");
    assert_eq!(s_attr(second, "gen_ai.request.model"), "m-second");
    assert_eq!(s_attr(second, "gen_ai.response.model"), "m-second");
    assert_eq!(i_attr(second, "gen_ai.usage.output_tokens"), 7);
    assert_eq!(s_attr(second, "server.address"), "127.0.0.1");
    assert!(attr(&second.attributes, "error.type").is_none());

    // Each upstream request carried its own attempt's traceparent, and the caller's tracestate.
    for (mock, span) in [(&a, first), (&b, second)] {
        let req = &mock.requests()[0];
        let tp = req.header("traceparent").expect("traceparent upstream");
        assert_eq!(
            tp,
            format!("00-{CLIENT_TRACE}-{}-01", hex(&span.span_id)),
            "names the attempt span"
        );
        assert_eq!(req.header("tracestate"), Some("vendor=x"));
    }

    // The stream's request is a trace of its own, its server span ended with the stream.
    let streamed = got
        .spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32 && s_attr(s, "tollgate.request_id") == "otel-2")
        .expect("the stream's server span");
    assert_ne!(hex(&streamed.trace_id), CLIENT_TRACE);
    assert_eq!(s_attr(streamed, "tollgate.job_id"), "agent-run-7");
    assert_eq!(i_attr(streamed, "gen_ai.usage.output_tokens"), 2);
    let served = got
        .spans
        .iter()
        .find(|s| {
            s.trace_id == streamed.trace_id
                && s.kind == SpanKind::Client as i32
                && s_attr(s, "tollgate.backend") == "second"
        })
        .expect("the stream's served attempt span");
    let chunk = served
        .events
        .iter()
        .find(|e| e.name == "gen_ai.first_chunk")
        .expect("the first chunk's event");
    assert!(
        served.start_time_unix_nano <= chunk.time_unix_nano
            && chunk.time_unix_nano <= served.end_time_unix_nano
            && served.end_time_unix_nano <= streamed.end_time_unix_nano
            && streamed.end_time_unix_nano <= after,
        "{served:?}"
    );

    // Never a prompt, a completion or a key in any attribute.
    let all = format!("{:?}", got.spans);
    for secret in [prompt, "the served completion", "eamed", "Bearer"] {
        assert!(!all.contains(secret), "`{secret}` leaked into a span");
    }

    // GenAI metrics.
    let tokens = points(&got, "gen_ai.client.token.usage");
    let sum = |ty: &str| -> f64 {
        tokens
            .iter()
            .filter(|p| p_attr(p, "gen_ai.token.type").as_deref() == Some(ty))
            .map(|p| p.sum.unwrap_or(0.0))
            .sum()
    };
    assert_eq!((sum("input"), sum("output")), (17.0, 9.0), "{tokens:?}");
    let dur = points(&got, "gen_ai.client.operation.duration");
    let count = |err: Option<&str>| -> u64 {
        dur.iter()
            .filter(|p| p_attr(p, "error.type").as_deref() == err)
            .map(|p| p.count)
            .sum()
    };
    // Two requests, each failed once on `first` and served by `second`.
    assert_eq!((count(Some("5xx")), count(None)), (2, 2), "{dur:?}");
    let ttfc = points(&got, "gen_ai.client.operation.time_to_first_chunk");
    assert_eq!(ttfc.iter().map(|p| p.count).sum::<u64>(), 1, "{ttfc:?}");
    otel::shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsampled_trace_exports_no_span_but_still_counts_and_propagates_its_decision() {
    let _turn = TURN.lock().await;
    let rx = Receiver::start().await;
    let mut s = rx.settings();
    s.sampler = otel::Sampler::ParentBased(otel::Root::AlwaysOn);
    s.headers = vec![(
        http::HeaderName::from_static("api-key"),
        http::HeaderValue::from_static("collector-key"),
    )];
    otel::install(&s).expect("install");
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&chain_yaml(&up, &up)).await;
    // The caller did not sample its trace: the parent-based sampler follows it.
    let tp = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-00");
    assert_eq!(say_hi(&sc, &tp).await, 200);
    // Each record (and its span) is closed just after its answer is written.
    sc.recorded(1).await;
    otel::flush(Duration::from_secs(10)).await;
    let got = std::mem::take(&mut *rx.got.lock().unwrap());
    assert!(
        got.spans.iter().all(|s| hex(&s.trace_id) != CLIENT_TRACE),
        "an unsampled trace is not exported"
    );
    let dur = points(&got, "gen_ai.client.operation.duration");
    // One point per upstream attempt: usually one, two when a loaded machine made the first
    // fail (the audit says how many there were).
    let rec: serde_json::Value = sc
        .audit_text()
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("a record");
    let attempts = rec["attempts"].as_array().map_or(0, Vec::len) as u64;
    assert!(attempts >= 1, "{rec}");
    assert_eq!(
        dur.iter().map(|p| p.count).sum::<u64>(),
        attempts,
        "metrics count it: {dur:?} {rec}"
    );
    // Upstream, the attempt continues the caller's trace with the not-sampled flag.
    let sent = up.requests()[0].header("traceparent").unwrap().to_string();
    assert!(sent.starts_with(&format!("00-{CLIENT_TRACE}-")), "{sent}");
    assert!(
        sent.ends_with("-00") && !sent.contains(CLIENT_SPAN),
        "{sent}"
    );
    assert!(!got.keys.is_empty() && got.keys.iter().all(|k| k == "collector-key"));
    otel::shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_attempt_sends_only_its_own_trace_context() {
    let _turn = TURN.lock().await;
    let rx = Receiver::start().await;
    otel::install(&rx.settings()).expect("install");
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&chain_yaml(&up, &up)).await;
    // A malformed traceparent starts a trace of tollgate's own; the tracestate that came
    // with it belongs to no trace and is not passed on.
    let (st, _, out) = post_json(
        &sc.chat_url(),
        &j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        &[
            ("traceparent", "00-not-a-trace-01"),
            ("tracestate", "vendor=stale"),
        ],
    )
    .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&out));
    let seen = &up.requests()[0];
    let sent: Vec<_> = seen.headers.get_all("traceparent").iter().collect();
    assert_eq!(sent.len(), 1, "{sent:?}");
    let sent = sent[0].to_str().unwrap();
    assert!(
        sent.len() == 55 && sent.starts_with("00-") && sent.ends_with("-01"),
        "{sent}"
    );
    assert_eq!(seen.headers.get_all("tracestate").iter().count(), 0);
    // A tracestate alone (no traceparent at all) is left out too.
    let (st, _, out) = post_json(
        &sc.chat_url(),
        &j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        &[("tracestate", "vendor=alone")],
    )
    .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&out));
    let seen = &up.requests()[1];
    assert_eq!(seen.headers.get_all("traceparent").iter().count(), 1);
    assert_eq!(seen.headers.get_all("tracestate").iter().count(), 0);
    otel::shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_grpc_the_collector_gets_the_same_trace_and_metrics() {
    let _turn = TURN.lock().await;
    let rx = Receiver::start_grpc().await;
    otel::install(&rx.settings()).expect("install");
    let failed_before = dropped("export_failed");
    let up = MockUpstream::start(vec![Answer::ok_chat("hello", 12, 7)]).await;
    let sc = Sidecar::start(&chain_yaml(&up, &up)).await;
    let tp = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let (st, _, out) = post_json(
        &sc.chat_url(),
        &j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        &[("traceparent", tp.as_str()), ("x-request-id", "grpc-1")],
    )
    .await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&out));
    // Each record (and its span) is closed just after its answer is written.
    sc.recorded(1).await;
    otel::flush(Duration::from_secs(10)).await;
    let got = std::mem::take(&mut *rx.got.lock().unwrap());
    let server = got
        .spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("a server span over gRPC");
    assert_eq!(hex(&server.trace_id), CLIENT_TRACE);
    assert_eq!(hex(&server.parent_span_id), CLIENT_SPAN);
    assert_eq!(s_attr(server, "tollgate.request_id"), "grpc-1");
    assert_eq!(i_attr(server, "gen_ai.usage.output_tokens"), 7);
    assert!(got.spans.iter().any(|s| s.kind == SpanKind::Client as i32));
    let tokens = points(&got, "gen_ai.client.token.usage");
    assert_eq!(
        tokens.iter().map(|p| p.sum.unwrap_or(0.0)).sum::<f64>(),
        19.0
    );
    // Nothing was dropped: the gRPC status was read as a success.
    assert_eq!(dropped("export_failed"), failed_before);
    otel::shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_collector_answering_an_error_status_fails_no_request_and_counts_the_drops() {
    let _turn = TURN.lock().await;
    // 14 = UNAVAILABLE, in the trailers of an otherwise well-formed answer (HTTP 200).
    let rx = Receiver::start_as(true, "14").await;
    otel::install(&rx.settings()).expect("install");
    let failed_before = dropped("export_failed");
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&chain_yaml(&up, &up)).await;
    for i in 0..3 {
        hi_with_id(&sc, &format!("grpc-err-{i}")).await;
    }
    // Each record (and its span) is closed just after its answer is written.
    sc.recorded(3).await;
    otel::flush(Duration::from_secs(10)).await;
    // The collector got the spans (it decoded them) but refused them: counted as failed.
    assert!(!rx.got.lock().unwrap().spans.is_empty());
    let deadline = Instant::now() + Duration::from_secs(10);
    while dropped("export_failed") <= failed_before {
        assert!(
            Instant::now() < deadline,
            "a grpc-status 14 was not counted as a failed export:\n{}",
            tollgate::telemetry::global().render()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    otel::shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_slows_and_fails_nothing() {
    let _turn = TURN.lock().await;
    // Accepts connections and never answers: every export runs into its timeout.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = hole.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((s, _)) = hole.accept().await {
            conns.push(s);
        }
    });
    let mut s = Settings::for_endpoint(&format!("http://{addr}")).unwrap();
    s.schedule_delay = Duration::from_millis(20);
    s.timeout = Duration::from_millis(300);
    s.queue = 2;
    s.batch = 1;
    otel::install(&s).expect("install");
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&chain_yaml(&up, &up)).await;
    let n = 30;
    let t0 = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        let out = hi_with_id(&sc, &format!("down-{i}")).await;
        assert_eq!(
            json(&out)["choices"][0]["message"]["content"],
            "Hello from the mock upstream."
        );
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "request {i} took {:?} with the collector down",
            t.elapsed()
        );
    }
    // 30 requests against 300 ms export timeouts: had a request waited on an export, the
    // loop would take at least 9 s.
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    // Spans were dropped, and counted: the queue (2) overflowed, exports timed out.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if dropped("queue_full") > 0.0 && dropped("export_failed") > 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "drops not counted:\n{}",
            tollgate::telemetry::global().render()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    otel::shutdown(Duration::from_millis(500)).await;
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_the_clients_trace_headers_pass_through_unchanged() {
    let _turn = TURN.lock().await;
    otel::shutdown(Duration::from_millis(100)).await;
    assert!(!otel::enabled());
    let up = MockUpstream::start(vec![]).await;
    let sc = Sidecar::start(&chain_yaml(&up, &up)).await;
    let tp = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    assert_eq!(say_hi(&sc, &tp).await, 200);
    assert_eq!(up.requests()[0].header("traceparent"), Some(tp.as_str()));
}
