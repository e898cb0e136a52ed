//! One governed request, as named phases over a per-request context:
//! identify → read → estimate → route → govern (gates, reserve, call) → reconcile → record.

use super::identity::{identify, IdentityError};
use super::respond::{self, full, is_hop_by_hop, Body, Refusal};
use super::snapshot::Snapshot;
use super::stream;
use super::transport::{Call, Transport, UpBody, UpstreamResponse};
use crate::audit::{Audit, Entry};
use crate::dialect::{self, render::Meta, Dialect, Inbound, Op, Rendered, Routed};
use crate::estimate::{self, Endpoint, Estimate};
use crate::governor::{
    Governor, Outcome, ReasonClass, Record, RequestCtx, Served, SystemClock, Usage, UsageEvidence,
};
use crate::stream::StreamUsage;
use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use std::convert::Infallible;
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
        (_, p @ ("/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" | "/v1/models")) => {
            let rec = bare_record(&snap, p);
            return Ok(respond::refusal(&Refusal::MethodNotAllowed, &rec, &snap));
        }
        (_, p) => {
            let (d, r) = match routed {
                Some(Routed::MethodNotAllowed(d)) => (d, Refusal::MethodNotAllowed),
                Some(Routed::NotFound(d) | Routed::Found(Inbound { dialect: d, .. })) => {
                    (d, Refusal::NotFound(p.to_string()))
                }
                None => (Dialect::OpenAi, Refusal::NotFound(p.to_string())),
            };
            let rec = bare_record(&snap, p);
            return Ok(respond::refusal_in(d, &r, &rec, &snap));
        }
    };
    let inb = Inbound::openai();
    Ok(governed(&app, snap, endpoint, &inb, &mut Meta::default(), req, t0).await)
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
    let mut meta = Meta::default();
    let fut: std::pin::Pin<Box<dyn std::future::Future<Output = Response<Body>> + Send + '_>> =
        Box::pin(governed(
            &app,
            snap,
            inb.endpoint(),
            &inb,
            &mut meta,
            req,
            t0,
        ));
    let resp = fut.await;
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
        let rec = bare_record(snap, "/api/show");
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

fn bare_record(snap: &Snapshot, route: &str) -> Record {
    let id = super::identity::new_request_id();
    Record::new(
        snap.policy.version.clone(),
        id.clone(),
        id,
        Arc::from("none"),
        Arc::from(route),
    )
    .refused_early(ReasonClass::BadRequest, 404, "not governed".into())
}

async fn governed(
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
                IdentityError::UnknownKey => (
                    ReasonClass::Unauthenticated,
                    Refusal::Unauthenticated("the bearer key is not a known virtual key".into()),
                ),
                IdentityError::BadHeader(h) => (
                    ReasonClass::BadRequest,
                    Refusal::BadRequest {
                        message: format!(
                            "the {h} is not a valid id (1-128 of A-Z a-z 0-9 - _ . : @ /)"
                        ),
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

    // Read the body, bounded.
    let limit = policy.server.max_body_bytes;
    let bytes = match read_body(body, limit as usize).await {
        Ok(b) => b,
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

    // Govern: gates, reservation, attempts.
    let ctx = RequestCtx {
        request_id: who.request_id,
        job_id: who.job_id,
        consumer: who.consumer,
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
    };
    let Outcome { record, served } = app
        .governor
        .govern(policy, route, &ctx, &call, &SystemClock)
        .await;
    let mut rec = record;

    match served {
        Served::Upstream { payload, pending } => {
            let UpstreamResponse {
                status,
                headers,
                body,
                deadline,
                translate,
                permit,
            } = payload;
            match body {
                UpBody::Buffered(b) => {
                    let (usage, evidence) = buffered_usage(&b, &est, policy.estimate.tokenizer);
                    app.governor
                        .settle(policy, &mut rec, pending, usage, evidence);
                    let resp = upstream_response(status, &headers, full(b), &rec, &snap);
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
                    };
                    let body = stream::metered(incoming, translate, tail, deadline);
                    upstream_response(status, &headers, body, &rec, &snap)
                }
            }
        }
        Served::Passthrough { payload } => {
            let b = match payload.body {
                UpBody::Buffered(b) => b,
                UpBody::Stream(_) => Bytes::new(),
            };
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

enum BodyError {
    TooLarge,
    Timeout,
    Broken(hyper::Error),
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
    respond::stamp(h, rec, snap);
    resp
}

async fn finish(app: &App, site: Site, record: Record, t0: Instant) {
    let now = jiff::Timestamp::now();
    let entry = Entry {
        ts: now.to_string(),
        endpoint: endpoint_name(site.endpoint),
        api: site.api.as_str(),
        latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
        record,
    };
    let windows = app
        .governor
        .windows_at(&app.snap.load().policy.windows, now.as_millisecond());
    crate::telemetry::observe(&entry, windows);
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
    (
        Usage {
            input_tokens: est.input_tokens,
            output_tokens: out,
        },
        UsageEvidence::Estimated,
    )
}
