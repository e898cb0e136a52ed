//! One governed request, as named phases over a per-request context:
//! identify → read → estimate → route → govern (gates, reserve, call) → reconcile → record.

use super::encoding::{self, DecodeError};
use super::identity::{identify, IdentityError};
use super::redact;
use super::respond::{self, full, is_hop_by_hop, Body, Refusal};
use super::snapshot::Snapshot;
use super::stream;
use super::stream::StreamWire;
use super::transport::{Call, NativeBody, Transport, UpBody, UpstreamResponse};
use crate::audit::{Audit, Entry};
use crate::dialect::{self, render::Meta, Dialect, Inbound, Op, Rendered, Routed};
use crate::estimate::{self, Endpoint, Estimate};
use crate::governor::{
    Governor, Outcome, ReasonClass, Record, RequestCtx, Served, SystemClock, Usage, UsageEvidence,
};
use crate::providers::{self, NativeFormat, Wire};
use crate::stream::StreamUsage;
use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A slow client may not pin a connection: the whole body must arrive within this.
const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Everything a request needs, shared by all connections.
pub struct App {
    pub snap: ArcSwap<Snapshot>,
    pub governor: Arc<Governor>,
    pub transport: Transport,
    pub audit: Audit,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("version", &self.snap.load().policy.version)
            .finish()
    }
}

fn endpoint_name(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Chat => "chat.completions",
        Endpoint::Completions => "completions",
        Endpoint::Embeddings => "embeddings",
    }
}

/// The data port's router.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let t0 = Instant::now();
    let snap = app.snap.load_full();
    let routed = dialect::route(req.method(), req.uri().path(), req.uri().query());
    let routed = match routed {
        Some(Routed::Found(inb)) => {
            // Boxed as a `Send` future: rustc cannot otherwise prove the dialect path's
            // future Send for every lifetime (a known limitation, rust-lang/rust#110338).
            let fut: std::pin::Pin<Box<dyn std::future::Future<Output = Response<Body>> + Send>> =
                Box::pin(inbound(app, snap, inb, req, t0));
            return Ok(fut.await);
        }
        other => other,
    };
    let endpoint = match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/chat/completions") => Endpoint::Chat,
        (&Method::POST, "/v1/completions") => Endpoint::Completions,
        (&Method::POST, "/v1/embeddings") => Endpoint::Embeddings,
        (&Method::GET, "/v1/models") => {
            let mut r = Response::new(full(snap.models_body.clone()));
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return Ok(r);
        }
        (&Method::GET, super::limits_view::PATH) => {
            return Ok(super::limits_view::answer(&app, &snap, req.headers()));
        }
        (_, p @ super::limits_view::PATH) => {
            let rec = bare_record(&snap, p, 405);
            let resp = respond::refusal(&Refusal::MethodNotAllowed, &rec, &snap);
            finish_as(&app, "unknown", Dialect::OpenAi, rec, t0).await;
            return Ok(resp);
        }
        (_, p) => {
            // Not governed, but audited and counted like every other refusal, in the
            // shape of the dialect whose path prefix it used.
            let governed_path = matches!(
                p,
                "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" | "/v1/models"
            );
            let (d, r, status) = match routed {
                Some(Routed::MethodNotAllowed(d)) => (d, Refusal::MethodNotAllowed, 405),
                Some(Routed::NotFound(d) | Routed::Found(Inbound { dialect: d, .. })) => {
                    (d, Refusal::NotFound(p.to_string()), 404)
                }
                None if governed_path => (Dialect::OpenAi, Refusal::MethodNotAllowed, 405),
                None => (Dialect::OpenAi, Refusal::NotFound(p.to_string()), 404),
            };
            let rec = bare_record(&snap, p, status);
            let resp = respond::refusal_in(d, &r, &rec, &snap);
            finish_as(&app, "unknown", d, rec, t0).await;
            return Ok(resp);
        }
    };
    Ok(governed(&app, snap, endpoint, Inbound::openai(), req, t0)
        .await
        .0)
}

/// A request on another dialect's path: answered locally (listings) or governed in the
/// internal form and rendered back in the dialect.
async fn inbound(
    app: Arc<App>,
    snap: Arc<Snapshot>,
    inb: Inbound,
    req: Request<Incoming>,
    t0: Instant,
) -> Response<Body> {
    let op = inb.op;
    let local = match op {
        Op::List => Some(list(inb.dialect, &snap)),
        Op::Version => Some(serde_json::json!({"version": dialect::ollama::VERSION})),
        Op::Show => {
            let body = read_body(req.into_body(), 64 * 1024)
                .await
                .unwrap_or_default();
            return show(&body, &snap);
        }
        _ => None,
    };
    if let Some(v) = local {
        return local_json(v);
    }
    let endpoint = inb.endpoint();
    let (resp, meta) = governed(&app, snap, endpoint, inb.clone(), req, t0).await;
    Rendered::respond(inb, meta, resp).await
}

/// Ollama's `/api/show` of a route alias.
fn show(body: &[u8], snap: &Snapshot) -> Response<Body> {
    #[derive(Deserialize)]
    struct Show {
        #[serde(default)]
        model: String,
    }
    let model = serde_json::from_slice::<Show>(body)
        .map(|s| s.model)
        .unwrap_or_default();
    if snap.policy.route(&model).is_none() {
        let rec = bare_record(snap, "/api/show", 404);
        let r = Refusal::UnknownModel(model);
        return respond::refusal_in(Dialect::Ollama, &r, &rec, snap);
    }
    local_json(dialect::ollama::show(&model))
}

fn list(d: Dialect, snap: &Snapshot) -> serde_json::Value {
    let aliases: Vec<&str> = snap.policy.routes.iter().map(|r| &*r.model).collect();
    dialect::list_body(d, &aliases)
}

fn local_json(v: serde_json::Value) -> Response<Body> {
    let mut r = Response::new(full(v.to_string()));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// Longest path kept as the route of an unknown endpoint's record.
const MAX_PATH_KEPT: usize = 200;

fn bare_record(snap: &Snapshot, path: &str, status: u16) -> Record {
    let id = super::identity::new_request_id();
    let mut end = path.len().min(MAX_PATH_KEPT);
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    Record::new(
        snap.policy.version.clone(),
        id.clone(),
        id,
        Arc::from("none"),
        Arc::from(&path[..end]),
    )
    .refused_early(ReasonClass::BadRequest, status, "not governed".into())
}

/// `x-tollgate-output-cap: <n>`: the output cap per choice sent upstream, with `; injected`
/// when the client sent none (the route's or the policy's default) and `; clamped` when it
/// is below the client's own (a soft budget's degrade).
fn cap_header(resp: &mut Response<Body>, rec: &Record, endpoint: Endpoint, client: Option<u64>) {
    let Some(n) = rec
        .upstream_max_tokens
        .filter(|_| endpoint != Endpoint::Embeddings)
    else {
        return;
    };
    let v = match client {
        None => HeaderValue::from_str(&format!("{n}; injected")),
        Some(c) if n < c => HeaderValue::from_str(&format!("{n}; clamped")),
        Some(_) => Ok(HeaderValue::from(n)),
    };
    if let Ok(v) = v {
        resp.headers_mut().insert(H_OUTPUT_CAP, v);
    }
}

const H_OUTPUT_CAP: http::HeaderName = http::HeaderName::from_static("x-tollgate-output-cap");

tokio::task_local! {
    /// Set when the client of the request this task serves has gone away.
    static CLIENT_GONE: Arc<AtomicBool>;
}

/// Sets the flag when dropped armed: hyper dropped the service future (the client hung up).
struct Watch(Option<Arc<AtomicBool>>);

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f.store(true, Ordering::Release);
        }
    }
}

/// Runs one governed request in a task of its own. hyper drops the service future when the
/// client hangs up; a call that reached the upstream must still be reconciled (its usage
/// committed, its hold released then, its audit record written), so the work is not tied to
/// that future: it always runs to its end, bounded by the body read and upstream timeouts.
async fn governed(
    app: &Arc<App>,
    snap: Arc<Snapshot>,
    endpoint: Endpoint,
    inb: Inbound,
    req: Request<Incoming>,
    t0: Instant,
) -> (Response<Body>, Meta) {
    let gone = Arc::new(AtomicBool::new(false));
    let mut watch = Watch(Some(gone.clone()));
    let app = app.clone();
    // The request's trace (when OTLP export is on) lives in the task that does the work.
    let trace = crate::telemetry::otel::get().map(|o| o.start(req.headers(), endpoint));
    let work = CLIENT_GONE.scope(gone, async move {
        let mut meta = Meta::default();
        let fut: std::pin::Pin<Box<dyn std::future::Future<Output = Response<Body>> + Send + '_>> =
            Box::pin(governed_here(
                &app, snap, endpoint, &inb, &mut meta, req, t0,
            ));
        let resp = match trace {
            None => fut.await,
            Some(t) => crate::telemetry::otel::scope(t, fut).await,
        };
        (resp, meta)
    });
    let out = match tokio::spawn(work).await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "the governed request task failed");
            let mut r = Response::new(full(Bytes::from_static(
                b"{\"error\":{\"message\":\"internal error\",\"type\":\"tollgate_error\",\"param\":null,\"code\":\"internal_error\"}}",
            )));
            *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            (r, Meta::default())
        }
    };
    watch.0 = None;
    out
}

/// Whether the client of the request this task serves has gone away.
fn client_gone() -> bool {
    CLIENT_GONE
        .try_with(|g| g.load(Ordering::Acquire))
        .unwrap_or(false)
}

async fn governed_here(
    app: &App,
    snap: Arc<Snapshot>,
    endpoint: Endpoint,
    inb: &Inbound,
    meta: &mut Meta,
    req: Request<Incoming>,
    t0: Instant,
) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    let policy = &snap.policy;
    let site = Site {
        endpoint,
        api: inb.dialect,
    };
    // Dialects carry the key in their own header (or query): identify reads one bearer.
    if let Some(v) = inb
        .bearer(&parts.headers)
        .and_then(|b| HeaderValue::from_str(&b).ok())
    {
        parts.headers.insert(http::header::AUTHORIZATION, v);
    }

    // Identify.
    let who = match identify(&parts.headers, &snap) {
        Ok(w) => w,
        Err((rid, e)) => {
            let (reason, refusal) = match e {
                IdentityError::UnknownKey | IdentityError::MissingKey => (
                    ReasonClass::Unauthenticated,
                    Refusal::Unauthenticated(e.message()),
                ),
                IdentityError::BadHeader(_) => (
                    ReasonClass::BadRequest,
                    Refusal::BadRequest {
                        message: e.message(),
                        param: None,
                        code: "invalid_header",
                    },
                ),
            };
            let rec = Record::new(
                policy.version.clone(),
                rid.clone(),
                rid,
                Arc::from("none"),
                Arc::from(""),
            );
            return early(app, &snap, site, refusal, rec, reason, t0).await;
        }
    };
    let mut rec = Record::new(
        policy.version.clone(),
        who.request_id.clone(),
        who.job_id.clone(),
        who.consumer.clone(),
        Arc::from(""),
    );
    rec.team = who.team.clone();

    // Read the body, bounded; decoded (bounded) when compressed, never read past the limit
    // it declares to a client waiting for `100 Continue`.
    let limit = policy.server.max_body_bytes;
    let (coding, too_much) = (
        encoding::coding(&parts.headers),
        encoding::expects_too_much(&parts.headers, limit),
    );
    parts.headers.remove(http::header::CONTENT_ENCODING);
    let read = match coding {
        Err(c) => Err(BodyError::Encoding(c)),
        Ok(_) if too_much => Err(BodyError::TooLarge),
        Ok(c) => read_body(body, limit as usize).await.and_then(|b| {
            encoding::decode(c, b, limit as usize).map_err(|e| match e {
                DecodeError::TooLarge => BodyError::TooLarge,
                DecodeError::Corrupt(m) => BodyError::Corrupt(m),
            })
        }),
    };
    let bytes = match read {
        Ok(b) => b,
        Err(BodyError::Encoding(c)) => {
            let r = Refusal::UnsupportedEncoding(c);
            return early(app, &snap, site, r, rec, ReasonClass::BadRequest, t0).await;
        }
        Err(BodyError::Corrupt(m)) => {
            let r = Refusal::BadRequest {
                message: format!("the request body is not valid for its Content-Encoding: {m}"),
                param: None,
                code: "bad_content_encoding",
            };
            return early(app, &snap, site, r, rec, ReasonClass::BadRequest, t0).await;
        }
        Err(BodyError::TooLarge) => {
            return early(
                app,
                &snap,
                site,
                Refusal::TooLarge { limit },
                rec,
                ReasonClass::BadRequest,
                t0,
            )
            .await;
        }
        Err(BodyError::Timeout) => {
            let r = Refusal::BadRequest {
                message: format!(
                    "the request body was not received within {} s",
                    BODY_READ_TIMEOUT.as_secs()
                ),
                param: None,
                code: "body_timeout",
            };
            return early(app, &snap, site, r, rec, ReasonClass::BadRequest, t0).await;
        }
        Err(BodyError::Broken(e)) => {
            let r = Refusal::BadRequest {
                message: format!("cannot read the request body: {e}"),
                param: None,
                code: "bad_body",
            };
            return early(app, &snap, site, r, rec, ReasonClass::BadRequest, t0).await;
        }
    };

    // Parse and estimate.
    let parsed = match inb.dialect {
        Dialect::OpenAi => serde_json::from_slice(&bytes)
            .map_err(|e| format!("the request body is not a JSON object: {e}")),
        _ => inb.parse(&bytes),
    };
    let body: serde_json::Map<String, serde_json::Value> = match parsed {
        Ok(v) => v,
        Err(message) => {
            let r = Refusal::BadRequest {
                message,
                param: None,
                code: "invalid_json",
            };
            return early(app, &snap, site, r, rec, ReasonClass::BadRequest, t0).await;
        }
    };
    let est: Estimate = match estimate::estimate_object(endpoint, &body, policy.estimate.tokenizer)
    {
        Ok(e) => e,
        Err(e) => {
            let r = Refusal::BadRequest {
                message: e.to_string(),
                param: e.param().map(str::to_string),
                code: e.code(),
            };
            return early(app, &snap, site, r, rec, ReasonClass::BadRequest, t0).await;
        }
    };

    *meta = Meta {
        model: est.model.clone(),
        id: who.request_id.to_string(),
        created: jiff::Timestamp::now().as_second(),
        input_estimate: est.input_tokens,
        stream: est.stream,
        local: false,
        wire: Wire::Translated,
    };
    if inb.op == Op::Count {
        // Counting is answered from the estimate and never charged.
        meta.local = true;
        return local_json(dialect::count_body(inb.dialect, est.input_tokens));
    }

    // Route.
    let Some(route) = policy.route(&est.model) else {
        rec.route = Arc::from(est.model.as_str());
        return early(
            app,
            &snap,
            site,
            Refusal::UnknownModel(est.model.clone()),
            rec,
            ReasonClass::BadRequest,
            t0,
        )
        .await;
    };

    // The client's own body, kept for a chain entry that speaks its format (pass-through).
    let native_format = native_body(inb, route, policy);
    // Govern: gates, reservation, attempts.
    let ctx = RequestCtx {
        request_id: who.request_id,
        job_id: who.job_id,
        consumer: who.consumer,
        team: who.team,
        input_tokens: est.input_tokens,
        max_output_tokens: est.max_output_tokens,
        n: est.n,
        static_ok: endpoint != Endpoint::Embeddings,
    };
    let call = Call {
        transport: &app.transport,
        snap: &snap,
        endpoint,
        request_id: &ctx.request_id,
        body: &body,
        client_headers: &parts.headers,
        stream: est.stream,
        add_include_usage: est.stream && !est.include_usage && endpoint != Endpoint::Embeddings,
        untranslatable: inb.untranslatable(&body),
        native: native_format.map(|format| NativeBody {
            format,
            body: &bytes,
        }),
    };
    let Outcome { record, served } = app
        .governor
        .govern(policy, route, &ctx, &call, &SystemClock)
        .await;
    let mut rec = record;
    rec.team = ctx.team.clone();

    match served {
        Served::Upstream { payload, pending } => {
            let UpstreamResponse {
                status,
                headers,
                body,
                deadline,
                wire,
                internal,
                translate,
                permit,
            } = payload;
            meta.wire = wire;
            match body {
                UpBody::Buffered(b) => {
                    // A passed-through answer is metered from its internal form.
                    let internal = internal.as_ref().unwrap_or(&b);
                    crate::telemetry::otel::note_body(internal);
                    let (usage, evidence) =
                        buffered_usage(internal, &est, policy.estimate.tokenizer);
                    app.governor
                        .settle(policy, &mut rec, pending, usage, evidence);
                    let b = redact::bytes(&snap, b);
                    let mut resp = upstream_response(status, &headers, full(b), &rec, &snap);
                    cap_header(&mut resp, &rec, endpoint, est.max_output_tokens);
                    finish(app, site, rec, t0).await;
                    resp
                }
                UpBody::Stream(incoming) => {
                    // The usage chunk tollgate asked for (OpenAI) or a translated native stream
                    // always ends with is hidden unless the client asked for it.
                    let hide_usage = call.add_include_usage;
                    let tail = stream::Tail {
                        governor: app.governor.clone(),
                        snap: snap.clone(),
                        audit: app.audit.clone(),
                        endpoint: endpoint_name(endpoint),
                        api: site.api.as_str(),
                        pending,
                        record: rec.clone(),
                        input_tokens: est.input_tokens,
                        max_output_total: rec.upstream_max_tokens.unwrap_or(0)
                            * u64::from(est.n.max(1)),
                        hide_usage,
                        started: t0,
                        permit,
                        otel: crate::telemetry::otel::take(),
                    };
                    let wire = match (wire, translate) {
                        (_, None) => StreamWire::Internal,
                        (Wire::Translated, Some(t)) => StreamWire::Translated(t),
                        (Wire::PassThrough, Some(t)) => StreamWire::PassThrough(t, inb.dialect),
                    };
                    let body = stream::metered(incoming, wire, tail, deadline);
                    let mut resp = upstream_response(status, &headers, body, &rec, &snap);
                    cap_header(&mut resp, &rec, endpoint, est.max_output_tokens);
                    resp
                }
            }
        }
        Served::Passthrough { payload } => {
            meta.wire = payload.wire;
            let b = match payload.body {
                UpBody::Buffered(b) => b,
                UpBody::Stream(_) => Bytes::new(),
            };
            let b = redact::bytes(&snap, b);
            let resp = upstream_response(payload.status, &payload.headers, full(b), &rec, &snap);
            finish(app, site, rec, t0).await;
            resp
        }
        Served::Static(text) => {
            let resp =
                respond::static_answer(&text, endpoint, est.stream, est.include_usage, &rec, &snap);
            finish(app, site, rec, t0).await;
            resp
        }
        Served::Refused => {
            let resp = respond::refusal(&Refusal::Governed, &rec, &snap);
            finish(app, site, rec, t0).await;
            resp
        }
    }
}

/// The client's format, when it has a pass-through pair and some entry of the route's chain
/// speaks it (its attempts send the client's own bytes); `None`: every attempt translates.
fn native_body(
    inb: &Inbound,
    route: &crate::policy::Route,
    policy: &crate::policy::Policy,
) -> Option<NativeFormat> {
    let format = inb.native_format()?;
    route
        .chain
        .iter()
        .any(|e| {
            let b = &policy.backends[e.backend];
            providers::for_kind(b.kind).speaks(format, b)
        })
        .then_some(format)
}

enum BodyError {
    TooLarge,
    Timeout,
    Broken(hyper::Error),
    /// A `Content-Encoding` not decoded here.
    Encoding(String),
    /// Not valid data of its `Content-Encoding`.
    Corrupt(String),
}

/// What is read and thrown away of a body over the limit, so that a client still writing it
/// gets the 413 instead of a connection reset (RFC 9112 §9.6); past this the connection closes.
const DRAIN_BEYOND_LIMIT: usize = 16 * 1024 * 1024;

/// Reads the request body up to `limit` bytes within [`BODY_READ_TIMEOUT`]. A body over the
/// limit is drained (up to [`DRAIN_BEYOND_LIMIT`] more) before answering.
async fn read_body(mut body: Incoming, limit: usize) -> Result<Bytes, BodyError> {
    let deadline = tokio::time::Instant::now() + BODY_READ_TIMEOUT;
    let mut buf = bytes::BytesMut::new();
    let mut seen = 0usize;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) if seen > limit => return Err(BodyError::TooLarge),
            Err(_) => return Err(BodyError::Timeout),
            Ok(None) => break,
            Ok(Some(Err(e))) if seen > limit => {
                tracing::debug!(error = %e, "oversized body broke off while draining");
                return Err(BodyError::TooLarge);
            }
            Ok(Some(Err(e))) => return Err(BodyError::Broken(e)),
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen <= limit {
            buf.extend_from_slice(&data);
        } else if seen > limit.saturating_add(DRAIN_BEYOND_LIMIT) {
            break;
        }
    }
    if seen > limit {
        Err(BodyError::TooLarge)
    } else {
        Ok(buf.freeze())
    }
}

/// A refusal before the governor ran: no call, no reservation.
async fn early(
    app: &App,
    snap: &Snapshot,
    site: Site,
    r: Refusal,
    rec: Record,
    reason: ReasonClass,
    t0: Instant,
) -> Response<Body> {
    let status = r.status(&rec).as_u16();
    let rec = rec.refused_early(reason, status, format!("{r:?}"));
    let resp = respond::refusal(&r, &rec, snap);
    finish(app, site, rec, t0).await;
    resp
}

/// Where a request came in: the internal endpoint and the client's dialect.
#[derive(Debug, Clone, Copy)]
struct Site {
    endpoint: Endpoint,
    api: Dialect,
}

fn upstream_response(
    status: StatusCode,
    headers: &http::HeaderMap,
    body: Body,
    rec: &Record,
    snap: &Snapshot,
) -> Response<Body> {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    for (k, v) in headers {
        if !is_hop_by_hop(k) {
            h.append(k.clone(), v.clone());
        }
    }
    // The body may have been rewritten (redacted); hyper sets the length of a full body.
    h.remove(http::header::CONTENT_LENGTH);
    redact::headers(snap, h);
    respond::stamp(h, rec, snap);
    resp
}

async fn finish(app: &App, site: Site, record: Record, t0: Instant) {
    finish_as(app, endpoint_name(site.endpoint), site.api, record, t0).await
}

async fn finish_as(
    app: &App,
    endpoint: &'static str,
    api: Dialect,
    mut record: Record,
    t0: Instant,
) {
    if client_gone() {
        record.client_disconnected = true;
    }
    let now = jiff::Timestamp::now();
    let entry = Entry {
        ts: now.to_string(),
        endpoint,
        api: api.as_str(),
        latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
        record,
    };
    let snap = app.snap.load();
    let windows = app
        .governor
        .windows_at(&snap.policy.windows, now.as_millisecond());
    crate::telemetry::observe(&entry, windows, &snap.policy.alerts);
    crate::telemetry::otel::finish(&entry);
    app.audit.record(entry).await;
}

#[derive(Deserialize)]
struct UsageOnly {
    usage: Option<StreamUsage>,
}

#[derive(Deserialize)]
struct Choices {
    #[serde(default)]
    choices: Vec<Choice>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    message: Option<Message>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    content: Option<serde_json::Value>,
}

/// Usage of a buffered answer: the provider's, else the sidecar's own count.
fn buffered_usage(
    b: &Bytes,
    est: &Estimate,
    tok: crate::policy::Tokenizer,
) -> (Usage, UsageEvidence) {
    if let Ok(UsageOnly { usage: Some(u) }) = serde_json::from_slice::<UsageOnly>(b) {
        if let Some(u) = u.to_usage() {
            return (u, UsageEvidence::Actual);
        }
    }
    let mut out = 0;
    if let Ok(c) = serde_json::from_slice::<Choices>(b) {
        for ch in c.choices {
            if let Some(t) = ch.text {
                out += estimate::count_output_text(tok, &t);
            }
            match ch.message.and_then(|m| m.content) {
                Some(serde_json::Value::String(s)) => out += estimate::count_output_text(tok, &s),
                Some(other) => out += estimate::count_output_text(tok, &other.to_string()),
                None => {}
            }
        }
    }
    (Usage::new(est.input_tokens, out), UsageEvidence::Estimated)
}
