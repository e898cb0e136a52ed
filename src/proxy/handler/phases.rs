//! One governed request as named phases over a per-request context ([`Ctx`]):
//! `identify` → `read_body` → `parse_and_estimate` → (`count`) → `route` → `govern` →
//! `reconcile`. Each phase before the governor hands the next its input or a [`Refusal`];
//! every refusal returns through [`Ctx::early`], every answer made whole through
//! [`Ctx::finish`], and a streamed answer through the stream's own end (both record it with
//! [`finish::close`](super::super::finish::close)).

use super::super::identity::{self, Identity};
use super::super::redact;
use super::super::respond::{self, full, is_hop_by_hop, Body, Refusal};
use super::super::snapshot::Snapshot;
use super::super::stream::{self, StreamWire};
use super::super::transport::{Call, NativeBody, UpBody, UpstreamResponse};
use super::{after, body, endpoint_name, local_json, usage, App, Origin};
use crate::body::ReqBody;
use crate::dialect::{self, render::Meta, Dialect, Inbound, Op};
use crate::estimate::{self, Endpoint, Estimate};
use crate::governor::{Outcome, Pending, Record, RequestCtx, Served};
use crate::policy::{Policy, Route};
use crate::providers::{self, NativeFormat, RequestBody, Wire};
use crate::units::usd_to_micros;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use std::sync::Arc;
use std::time::Instant;

/// Runs the phases of one governed request.
pub(super) async fn governed_here(
    app: &Arc<App>,
    snap: Arc<Snapshot>,
    endpoint: Endpoint,
    inb: &Inbound,
    meta: &mut Meta,
    req: Request<ReqBody>,
    t0: Instant,
) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    let (rec, who) = identify(inb, &mut parts.headers, &snap);
    let mut cx = Ctx {
        app,
        snap: &snap,
        inb,
        endpoint,
        t0,
        meta,
        rec,
    };
    let ready = match cx.prepare(who, &mut parts.headers, body).await {
        Ok(Next::Govern(ready)) => ready,
        Ok(Next::Answered(resp)) => return resp,
        Err(refusal) => return cx.early(refusal),
    };
    let (served, est) = cx.govern(ready, &parts.headers).await;
    // The record is closed once the answer is written (see `After`).
    cx.reconcile(served, &est)
}

/// An answer in one piece, carrying its record's closing ([`After`]), or a stream (which
/// closes its record when it ends).
type Answer = Response<Body>;

/// What one request carries from phase to phase.
struct Ctx<'a> {
    app: &'a Arc<App>,
    /// The policy snapshot the request started under; it keeps it to the end.
    snap: &'a Arc<Snapshot>,
    inb: &'a Inbound,
    endpoint: Endpoint,
    t0: Instant,
    /// What the dialect renders its answer with (model, id, input estimate, wire).
    meta: &'a mut Meta,
    /// The decision record: the caller's from `identify`, the governor's from `govern`.
    rec: Record,
}

/// Where the phases before the governor lead.
enum Next<'a> {
    /// To the governor, with what it needs.
    Govern(Ready<'a>),
    /// Answered locally, never charged nor recorded (token counting).
    Answered(Response<Body>),
}

/// A request ready for the governor: identified, read, estimated, routed.
struct Ready<'a> {
    who: Identity,
    bytes: Bytes,
    body: RequestBody,
    est: Estimate,
    route: &'a Route,
}

/// Identify: the caller and the request's ids. Dialects carry the key in their own header
/// (or query): it is copied to the one bearer `identify` reads. The request's record either
/// way: the caller's, or one under the request id alone for a refusal.
fn identify(
    inb: &Inbound,
    headers: &mut HeaderMap,
    snap: &Snapshot,
) -> (Record, Result<Identity, Refusal>) {
    if let Some(v) = inb
        .bearer(headers)
        .and_then(|b| HeaderValue::from_str(&b).ok())
    {
        headers.insert(http::header::AUTHORIZATION, v);
    }
    let version = snap.policy.version.clone();
    match identity::identify(headers, snap) {
        Ok(who) => {
            let mut rec = Record::new(
                version,
                who.request_id.clone(),
                who.job_id.clone(),
                who.consumer.clone(),
                crate::governor::record::empty(),
            );
            rec.team = who.team.clone();
            (rec, Ok(who))
        }
        Err((rid, e)) => {
            let rec = Record::new(
                version,
                rid.clone(),
                rid,
                crate::governor::record::none(),
                crate::governor::record::empty(),
            );
            (rec, Err(e.into()))
        }
    }
}

/// Parses `bytes` into the internal form and estimates it. A plain OpenAI chat body is
/// estimated from its bytes; its map is parsed only if a provider asks for it (an
/// OpenAI-compatible backend never does).
fn estimate_body(
    inb: &Inbound,
    endpoint: Endpoint,
    tokenizer: estimate::Tokenizer,
    bytes: &Bytes,
) -> Result<(RequestBody, Estimate), Refusal> {
    let plain = match (inb.dialect, endpoint) {
        (Dialect::OpenAi, Endpoint::Chat) => estimate::chat_plain(bytes, tokenizer),
        _ => None,
    };
    Ok(match plain {
        Some(p) => (
            RequestBody::lazy(bytes.clone(), p.max_completion_tokens_key, p.members),
            p.est,
        ),
        None => {
            // Parsed, each container costs far more than its bytes (60,000 messages took
            // ~88 MB): the count is capped before the parse.
            if crate::jscan::containers(bytes, MAX_JSON_CONTAINERS) > MAX_JSON_CONTAINERS {
                return Err(Refusal::invalid_json(format!(
                    "the request body has more than {MAX_JSON_CONTAINERS} JSON objects and \
                     arrays; split the conversation or send fewer content parts"
                )));
            }
            let body = match inb.dialect {
                Dialect::OpenAi => {
                    serde_json::from_slice(bytes).map_err(|e| Refusal::not_json_object(&e))
                }
                _ => inb.parse(bytes).map_err(Refusal::invalid_json),
            }?;
            let est = estimate::estimate_object(endpoint, &body, tokenizer)?;
            (RequestBody::parsed(body), est)
        }
    })
}

/// Most JSON objects and arrays in a request body that is parsed whole (a chat of a few
/// thousand turns with tool calls has a few tens of thousands at most).
pub const MAX_JSON_CONTAINERS: usize = 50_000;

impl<'a> Ctx<'a> {
    /// The phases before the governor, in order.
    async fn prepare(
        &mut self,
        who: Result<Identity, Refusal>,
        headers: &mut HeaderMap,
        body: ReqBody,
    ) -> Result<Next<'a>, Refusal> {
        let who = who?;
        let bytes = self.read_body(headers, body).await?;
        let (body, est) = self.parse_and_estimate(&bytes).await?;
        if let Some(answer) = self.count(&est) {
            return Ok(Next::Answered(answer));
        }
        let route = self.route(&est)?;
        Ok(Next::Govern(Ready {
            who,
            bytes,
            body,
            est,
            route,
        }))
    }

    /// Read the body, bounded and decoded.
    async fn read_body(&self, headers: &mut HeaderMap, b: ReqBody) -> Result<Bytes, Refusal> {
        let limit = self.snap.policy.server.max_body_bytes;
        Ok(body::read_decoded(headers, b, limit).await?)
    }

    /// Parse the body into the internal form and estimate it; the answer's meta is known now.
    async fn parse_and_estimate(
        &mut self,
        bytes: &Bytes,
    ) -> Result<(RequestBody, Estimate), Refusal> {
        let tokenizer = self.snap.policy.estimate.tokenizer;
        let (body, est) = if estimate::offload_whole(bytes.len()) {
            // A large body on a connection worker (a single-threaded runtime, where
            // `block_in_place` is not available): estimated on the blocking pool, so the
            // worker's other connections go on meanwhile; with a table of words lent warm
            // (the pool's threads come and go).
            let (inb, endpoint, b) = (self.inb.clone(), self.endpoint, bytes.clone());
            match tokio::task::spawn_blocking(move || {
                estimate::with_spare_words(|| estimate_body(&inb, endpoint, tokenizer, &b))
            })
            .await
            {
                Ok(r) => r?,
                // A panic goes on in this task, as it would have here; a cancellation only
                // happens when the runtime is going away with the task.
                Err(e) => std::panic::resume_unwind(match e.try_into_panic() {
                    Ok(p) => p,
                    Err(_) => Box::new("the estimate was cancelled"),
                }),
            }
        } else {
            estimate_body(self.inb, self.endpoint, tokenizer, bytes)?
        };
        // The model and id are what another dialect's answer is rendered with; an OpenAI
        // client's answer goes out as it is (`Rendered::respond`), so they are not copied.
        let renders = self.inb.dialect != Dialect::OpenAi;
        *self.meta = Meta {
            model: if renders {
                est.model.clone()
            } else {
                String::new()
            },
            id: if renders {
                self.rec.request_id.to_string()
            } else {
                String::new()
            },
            created: crate::units::now_ms().div_euclid(1000),
            input_estimate: est.input_tokens,
            stream: est.stream,
            local: false,
            wire: Wire::Translated,
        };
        Ok((body, est))
    }

    /// Counting is answered from the estimate and never charged.
    fn count(&mut self, est: &Estimate) -> Option<Response<Body>> {
        if self.inb.op != Op::Count {
            return None;
        }
        self.meta.local = true;
        Some(local_json(dialect::count_body(
            self.inb.dialect,
            est.input_tokens,
        )))
    }

    /// The route of the request's model alias.
    fn route(&mut self, est: &Estimate) -> Result<&'a Route, Refusal> {
        let snap: &'a Arc<Snapshot> = self.snap;
        snap.policy.route(&est.model).ok_or_else(|| {
            self.rec.route = Arc::from(est.model.as_str());
            Refusal::UnknownModel(est.model.clone())
        })
    }

    /// Govern: gates, reservation, attempts (`Governor::govern`). The record becomes the
    /// governor's.
    async fn govern(
        &mut self,
        ready: Ready<'a>,
        headers: &HeaderMap,
    ) -> (Served<Box<UpstreamResponse>>, Estimate) {
        let Ready {
            who,
            bytes,
            body,
            est,
            route,
        } = ready;
        let (app, snap, endpoint) = (self.app, self.snap, self.endpoint);
        let policy = &snap.policy;
        // The client's own body, kept for a chain entry that speaks its format (pass-through).
        let native_format = native_format(self.inb, route, policy);
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
            snap,
            endpoint,
            request_id: &ctx.request_id,
            body: &body,
            raw: (self.inb.dialect == Dialect::OpenAi).then_some(&bytes[..]),
            client_headers: headers,
            stream: est.stream,
            add_include_usage: adds_include_usage(endpoint, &est),
            untranslatable: self.inb.untranslatable(&body),
            native: native_format.map(|format| NativeBody {
                format,
                body: &bytes,
            }),
        };
        let Outcome { record, served } = app
            .governor
            .govern(policy, route, &ctx, &call, &app.clock)
            .await;
        self.rec = record;
        (served, est)
    }

    /// Reconcile what the governor served: settle the call with its usage and answer.
    fn reconcile(self, served: Served<Box<UpstreamResponse>>, est: &Estimate) -> Answer {
        match served {
            Served::Upstream {
                mut payload,
                pending,
            } => {
                self.meta.wire = payload.wire;
                // The body goes its own way (buffered or streamed); the rest stays.
                match std::mem::replace(&mut payload.body, UpBody::Buffered(Bytes::new())) {
                    UpBody::Buffered(b) => self.buffered(payload, b, *pending, est),
                    UpBody::Stream(s) => self.streamed(payload, s, pending, est),
                }
            }
            Served::Passthrough { payload } => {
                self.meta.wire = payload.wire;
                let b = match payload.body {
                    UpBody::Buffered(b) => b,
                    UpBody::Stream(_) => Bytes::new(),
                };
                let b = redact::bytes(self.snap, b);
                let resp = upstream_response(
                    payload.status,
                    payload.headers,
                    full(b),
                    &self.rec,
                    self.snap,
                );
                self.finish(resp)
            }
            Served::Static(text) => {
                let resp = respond::static_answer(
                    &text,
                    self.endpoint,
                    est.stream,
                    est.include_usage,
                    &self.rec,
                    self.snap,
                );
                self.finish(resp)
            }
            Served::Refused => {
                let resp = respond::refusal(&Refusal::Governed, &self.rec, self.snap);
                self.finish(resp)
            }
        }
    }

    /// A buffered answer: metered (a passed-through one from its internal form), settled,
    /// redacted, recorded.
    fn buffered(
        mut self,
        mut up: Box<UpstreamResponse>,
        b: Bytes,
        pending: Pending,
        est: &Estimate,
    ) -> Answer {
        let policy = &self.snap.policy;
        let internal = up.internal.as_ref().unwrap_or(&b);
        crate::telemetry::otel::note_body(internal);
        let (usage, evidence) =
            usage::buffered_usage(internal, up.usage, est, policy.estimate.tokenizer);
        self.app
            .governor
            .settle(policy, &mut self.rec, pending, usage, evidence);
        let b = redact::bytes(self.snap, b);
        let mut resp = upstream_response(
            up.status,
            std::mem::take(&mut up.headers),
            full(b),
            &self.rec,
            self.snap,
        );
        cap_header(&mut resp, &self.rec, self.endpoint, est.max_output_tokens);
        respond::stamp_cost(&mut resp, usd_to_micros(self.rec.cost_usd));
        self.finish(resp)
    }

    /// A streamed answer: metered on the way; the stream settles and records the call when
    /// it ends (see [`stream::metered`]).
    fn streamed(
        self,
        mut up: Box<UpstreamResponse>,
        incoming: super::super::transport::AnswerBody,
        pending: Box<Pending>,
        est: &Estimate,
    ) -> Response<Body> {
        // The usage chunk tollgate asked for (OpenAI) or a translated native stream always
        // ends with is hidden unless the client asked for it.
        let hide_usage = adds_include_usage(self.endpoint, est);
        let tail = stream::Tail {
            governor: self.app.governor.clone(),
            snap: self.snap.clone(),
            audit: self.app.audit.clone(),
            origin: self.origin(),
            pending,
            record: self.rec.clone(),
            input_tokens: est.input_tokens,
            max_output_total: self.rec.upstream_max_tokens.unwrap_or(0) * u64::from(est.n.max(1)),
            hide_usage,
            permit: up.permit,
            otel: crate::telemetry::otel::take(),
        };
        let wire = match (up.wire, up.translate) {
            (_, None) => StreamWire::Internal,
            (Wire::Translated, Some(t)) => StreamWire::Translated(t),
            (Wire::PassThrough, Some(t)) => StreamWire::PassThrough(t, self.inb.dialect),
        };
        let body = stream::metered(incoming, wire, tail, up.deadline);
        let mut resp = upstream_response(
            up.status,
            std::mem::take(&mut up.headers),
            body,
            &self.rec,
            self.snap,
        );
        cap_header(&mut resp, &self.rec, self.endpoint, est.max_output_tokens);
        // The actual is known only once the stream ends (it is in the audit): the header
        // says the reserved worst case.
        respond::stamp_cost(&mut resp, usd_to_micros(self.rec.worst_case_usd));
        resp
    }

    /// A refusal before the governor ran: no call, no reservation.
    fn early(self, r: Refusal) -> Answer {
        let origin = self.origin();
        let rec = r.record_early(self.rec);
        let resp = respond::refusal(&r, &rec, self.snap);
        closed_after(resp, self.app, origin, rec)
    }

    /// Hands back the answer (everything but a stream) with its record's closing.
    fn finish(self, resp: Response<Body>) -> Answer {
        let origin = self.origin();
        closed_after(resp, self.app, origin, self.rec)
    }

    fn origin(&self) -> Origin {
        Origin {
            endpoint: endpoint_name(self.endpoint),
            api: self.inb.dialect.as_str(),
            at: self.t0,
        }
    }
}

/// Whether tollgate asks a stream for its usage chunk the client did not ask for.
fn adds_include_usage(endpoint: Endpoint, est: &Estimate) -> bool {
    est.stream && !est.include_usage && endpoint != Endpoint::Embeddings
}

/// The client's format, when it has a pass-through pair and some entry of the route's chain
/// speaks it (its attempts send the client's own bytes); `None`: every attempt translates.
fn native_format(inb: &Inbound, route: &Route, policy: &Policy) -> Option<NativeFormat> {
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
    let note = match client {
        None => "; injected",
        Some(c) if n < c => "; clamped",
        Some(_) => "",
    };
    // The cap and its note mostly repeat from one answer to the next.
    let v = super::super::header_memo::value(
        &CAP_VALUE,
        |&(k, kn)| k == n && kn == note,
        || {
            let mut s = String::with_capacity(20);
            s.push_str(itoa::Buffer::new().format(n));
            s.push_str(note);
            Some(((n, note), HeaderValue::from_str(&s).ok()?))
        },
    );
    if let Some(v) = v {
        resp.headers_mut().insert(H_OUTPUT_CAP, v);
    }
}

thread_local! {
    /// The last `x-tollgate-output-cap` value this thread wrote, by its cap and note.
    static CAP_VALUE: super::super::header_memo::Slot<(u64, &'static str)> =
        const { std::cell::RefCell::new(None) };
}

const H_OUTPUT_CAP: http::HeaderName = http::HeaderName::from_static("x-tollgate-output-cap");

/// The answer handed on: the upstream's status and headers (its own map, the hop-by-hop
/// fields taken out in place: no copy of the others), then the sidecar's own.
fn upstream_response(
    status: StatusCode,
    mut headers: HeaderMap,
    body: Body,
    rec: &Record,
    snap: &Snapshot,
) -> Response<Body> {
    // Not handed on: hop-by-hop fields, the fields the upstream's `Connection` names (RFC
    // 9110 §7.6.1), and the sidecar's own names (an upstream cannot forge a decision).
    let mut drop: smallvec::SmallVec<[http::HeaderName; 4]> = headers
        .keys()
        .filter(|k| is_hop_by_hop(k) || k.as_str().starts_with("x-tollgate-"))
        .cloned()
        .collect();
    for v in headers.get_all(http::header::CONNECTION) {
        let tokens = v.as_bytes().split(|&b| b == b',').map(<[u8]>::trim_ascii);
        drop.extend(tokens.filter_map(|t| http::HeaderName::from_bytes(t).ok()));
    }
    for k in drop {
        headers.remove(k);
    }
    // Room for the sidecar's headers (decision, ids, limits) at once, instead of growing the
    // map as they are added (an answer from the own client was made with it).
    headers.reserve(crate::wire::h1::ROOM_FOR_STAMPS);
    // `Content-Length` is one of them: the body may have been rewritten (redacted), and
    // hyper sets the length of a full body.
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    redact::headers(snap, resp.headers_mut());
    respond::stamp(&mut resp, rec, snap);
    resp
}

/// `resp` with the closing of its record, run once it is written (see [`After`]).
fn closed_after(mut resp: Response<Body>, app: &Arc<App>, origin: Origin, rec: Record) -> Answer {
    resp.extensions_mut().insert(after(app, origin, rec));
    resp
}
