//! Every response the sidecar makes itself, and the headers every governed response carries.
//! One exhaustive mapping from what went wrong to an HTTP status and an OpenAI error body.

use super::identity::IdentityError;
use super::snapshot::Snapshot;
use super::stamps::{Fields, Stamp};
use crate::dialect::Dialect;
use crate::estimate::{Endpoint, EstimateError};
use crate::governor::limits::LimitDetail;
use crate::governor::{FinalAction, ReasonClass, Record};
use crate::units::fmt_amount;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use serde_json::json;

pub use crate::body::{full, Body, BoxError};

/// Why the sidecar answers a request itself.
#[derive(Debug)]
pub enum Refusal {
    /// Not JSON, or not the shape the endpoint needs.
    BadRequest {
        message: String,
        param: Option<String>,
        code: &'static str,
    },
    /// Body over `server.max_body_bytes`.
    TooLarge {
        limit: u64,
    },
    /// No route for the `model`.
    UnknownModel(String),
    /// A bearer key that matches no virtual key, or an unusable identity header.
    Unauthenticated(String),
    /// Not an endpoint of the data port.
    NotFound(String),
    MethodNotAllowed,
    /// A request `Content-Encoding` the sidecar does not decode.
    UnsupportedEncoding(String),
    /// The governor said DEFER or HARD_STOP.
    Governed,
}

/// Why a request body could not be read: each becomes a [`Refusal`] (below), whose message
/// and code are fixed here.
#[derive(Debug)]
pub enum BodyError {
    /// Over `server.max_body_bytes` (`limit`), as sent, as declared, or once decoded.
    TooLarge { limit: u64 },
    /// Not received within the body read timeout.
    Timeout(std::time::Duration),
    /// The connection failed while the body was read.
    Broken(hyper::Error),
    /// A `Content-Encoding` not decoded here.
    Encoding(String),
    /// Not valid data of its `Content-Encoding`.
    Corrupt(String),
}

impl From<BodyError> for Refusal {
    fn from(e: BodyError) -> Self {
        match e {
            BodyError::TooLarge { limit } => Refusal::TooLarge { limit },
            BodyError::Encoding(c) => Refusal::UnsupportedEncoding(c),
            BodyError::Corrupt(m) => Refusal::BadRequest {
                message: format!("the request body is not valid for its Content-Encoding: {m}"),
                param: None,
                code: "bad_content_encoding",
            },
            BodyError::Timeout(t) => Refusal::BadRequest {
                message: format!("the request body was not received within {} s", t.as_secs()),
                param: None,
                code: "body_timeout",
            },
            BodyError::Broken(e) => Refusal::BadRequest {
                message: format!("cannot read the request body: {e}"),
                param: None,
                code: "bad_body",
            },
        }
    }
}

impl From<IdentityError> for Refusal {
    fn from(e: IdentityError) -> Self {
        match e {
            IdentityError::UnknownKey | IdentityError::MissingKey => {
                Refusal::Unauthenticated(e.message())
            }
            IdentityError::BadHeader(_) => Refusal::BadRequest {
                message: e.message(),
                param: None,
                code: "invalid_header",
            },
        }
    }
}

impl From<EstimateError> for Refusal {
    fn from(e: EstimateError) -> Self {
        Refusal::BadRequest {
            message: e.to_string(),
            param: e.param().map(str::to_string),
            code: e.code(),
        }
    }
}

impl Refusal {
    /// A body that does not parse as the endpoint's JSON (`message` says why).
    pub fn invalid_json(message: String) -> Self {
        Refusal::BadRequest {
            message,
            param: None,
            code: "invalid_json",
        }
    }

    /// An OpenAI-path body that does not parse as a JSON object.
    pub fn not_json_object(e: &serde_json::Error) -> Self {
        Refusal::invalid_json(format!("the request body is not a JSON object: {e}"))
    }

    /// The reason class of the record of a refusal.
    pub fn reason_class(&self, rec: &Record) -> ReasonClass {
        match self {
            Refusal::Unauthenticated(_) => ReasonClass::Unauthenticated,
            Refusal::BadRequest { .. }
            | Refusal::TooLarge { .. }
            | Refusal::UnknownModel(_)
            | Refusal::NotFound(_)
            | Refusal::MethodNotAllowed
            | Refusal::UnsupportedEncoding(_) => ReasonClass::BadRequest,
            Refusal::Governed => rec.reason_class,
        }
    }

    /// The record of a refusal made before the governor ran: HARD_STOP with this refusal's
    /// status and reason, nothing called or reserved.
    pub fn record_early(&self, rec: Record) -> Record {
        let status = self.status(&rec).as_u16();
        let reason = self.reason_class(&rec);
        rec.refused_early(reason, status, format!("{self:?}"))
    }

    pub fn status(&self, rec: &Record) -> StatusCode {
        match self {
            Refusal::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Refusal::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::UnknownModel(_) | Refusal::NotFound(_) => StatusCode::NOT_FOUND,
            Refusal::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Refusal::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Refusal::UnsupportedEncoding(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Refusal::Governed => {
                StatusCode::from_u16(rec.http_status).unwrap_or(StatusCode::FORBIDDEN)
            }
        }
    }

    /// (type, code, param, message) of the OpenAI error object.
    fn parts(&self, rec: &Record) -> (&'static str, String, Option<String>, String) {
        match self {
            Refusal::BadRequest {
                message,
                param,
                code,
            } => (
                "invalid_request_error",
                code.to_string(),
                param.clone(),
                message.clone(),
            ),
            Refusal::TooLarge { limit } => (
                "invalid_request_error",
                "request_too_large".into(),
                None,
                format!("request body is larger than the sidecar's limit of {limit} bytes"),
            ),
            Refusal::UnknownModel(m) => (
                "invalid_request_error",
                "model_not_found".into(),
                Some("model".into()),
                format!("the model `{m}` does not exist: no tollgate route has this alias"),
            ),
            Refusal::Unauthenticated(m) => (
                "authentication_error",
                "invalid_api_key".into(),
                None,
                m.clone(),
            ),
            Refusal::NotFound(p) => (
                "invalid_request_error",
                "unknown_url".into(),
                None,
                format!("unknown endpoint: {p}"),
            ),
            Refusal::MethodNotAllowed => (
                "invalid_request_error",
                "method_not_allowed".into(),
                None,
                "method not allowed".into(),
            ),
            Refusal::UnsupportedEncoding(c) => (
                "invalid_request_error",
                "unsupported_content_encoding".into(),
                None,
                format!("request Content-Encoding `{c}` is not supported: send gzip, deflate or identity"),
            ),
            Refusal::Governed => {
                let ty = match (rec.final_action, rec.http_status) {
                    (FinalAction::Defer, 429) => "rate_limit_exceeded",
                    (FinalAction::Defer, _) => "service_unavailable",
                    _ => "insufficient_quota",
                };
                (
                    ty,
                    rec.reason_class.as_str().to_ascii_lowercase(),
                    None,
                    explain(rec),
                )
            }
        }
    }
}

/// A one-line, secret-free explanation of a governed refusal.
pub fn explain(rec: &Record) -> String {
    let why = match rec.reason_class {
        ReasonClass::StateUnavailable => "the shared state store does not answer",
        ReasonClass::StateRebuilding => {
            "the shared counters are being rebuilt after the store lost them"
        }
        ReasonClass::RateLimited => "a rate limit is full",
        ReasonClass::QuotaBlocked => "a quota is used up",
        ReasonClass::HardBudgetExceeded => {
            "the worst case of this request would cross a hard budget"
        }
        ReasonClass::FallbackOverBudget => {
            "the primary failed and the fallback's worst case does not fit the budget"
        }
        ReasonClass::CircuitOpen => "the backends' circuits are open",
        ReasonClass::RetryBudgetExhausted => "the job's retry budget is used up",
        ReasonClass::UpstreamFailure => "the upstream backends failed",
        ReasonClass::ModelIneligible => "no backend of this route is configured",
        ReasonClass::HalfOpenProbe => "a recovering backend failed its probe",
        ReasonClass::SoftBudgetExceeded => "a soft budget is exceeded",
        ReasonClass::Unauthenticated => "unauthenticated",
        ReasonClass::BadRequest => "bad request",
        ReasonClass::Ok => "refused",
    };
    let never = rec.limit.as_ref().is_some_and(|l| l.never_fits);
    let why = if never {
        "this request is larger than a limit allows"
    } else {
        why
    };
    let mut s = format!("tollgate: {} ({})", why, rec.final_action);
    if let Some(l) = &rec.limit {
        s.push_str("; ");
        describe_limit(&mut s, l);
    }
    if let Some(ra) = rec.retry_after {
        s.push_str(&format!("; retry after {ra} s"));
    }
    s
}

/// `rate_limit `consumer-tpm` (consumer alice, per minute): 4,700 tokens of 5,000 tokens
/// used, this request needs 1,024 tokens; it resets at 2026-11-29T10:01:00+08:00`. Money in
/// dollars, the reset in the policy's time zone.
fn describe_limit(s: &mut String, l: &LimitDetail) {
    use std::fmt::Write;
    let f = |v: u64| fmt_amount(l.unit, v);
    let _ = write!(s, "{} `{}` ({}", l.kind, l.name, l.scope);
    if l.scope != "global" {
        let _ = write!(s, " {}", l.id);
    }
    if let Some(w) = l.window {
        let _ = write!(s, ", per {w}");
    }
    s.push_str("): ");
    if l.never_fits {
        let _ = write!(
            s,
            "this request needs {}, {} more than the whole limit of {}: it can never fit, \
             waiting will not help; lower max_tokens or shorten the input",
            f(l.requested),
            f(l.requested.saturating_sub(l.limit)),
            f(l.limit)
        );
        return;
    }
    if l.reserved > 0 {
        let _ = write!(
            s,
            "{} used and {} reserved by calls in flight, of {}",
            f(l.used),
            f(l.reserved),
            f(l.limit)
        );
    } else {
        let _ = write!(s, "{} of {} used", f(l.used), f(l.limit));
    }
    let _ = write!(s, ", this request needs {}", f(l.requested));
    if let Some(at) = &l.resets_at {
        let _ = write!(s, "; it resets at {at}");
    }
}

fn tollgate_object(rec: &Record) -> serde_json::Value {
    json!({
        "budget_state": rec.budget_state,
        "quota_state": rec.quota_state,
        "circuit_state": rec.circuit_state,
        "retry_state": rec.retry_state,
        "usage_evidence_state": rec.usage_evidence_state,
        "fallback_state": rec.fallback_state,
        "final_action": rec.final_action,
        "reason_class": rec.reason_class,
        "request_id": &*rec.request_id,
        "retry_after": rec.retry_after,
        "limit": rec.limit.as_ref().map(LimitDetail::to_json),
    })
}

/// Stamps an answer with the record: its own fields (decision, ids, readable limits; see
/// [`super::stamps`]) and `Retry-After`.
pub fn stamp<B>(resp: &mut Response<B>, rec: &Record, snap: &Snapshot) {
    let mut s = super::stamps::Stamps::with_capacity(384);
    fields(&mut s, rec, snap);
    resp.extensions_mut().insert(s);
    if let Some(ra) = rec.retry_after {
        resp.headers_mut()
            .insert(http::header::RETRY_AFTER, HeaderValue::from(ra));
    }
}

/// The record's own fields of an answer, into `f`.
pub fn fields(f: &mut impl Fields, rec: &Record, snap: &Snapshot) {
    f.put(Stamp::RequestId, rec.request_id.as_bytes());
    f.put_known(Stamp::Action, rec.final_action.as_str().as_bytes());
    f.put_known(Stamp::Reason, rec.reason_class.as_str().as_bytes());
    f.put(Stamp::Backend, rec.backend.as_bytes());
    f.put_known(Stamp::PolicyVersion, snap.version_header.as_bytes());
    super::limit_headers::stamp(f, &rec.token_limits);
    super::limit_headers::stamp_shadow(f, &rec.shadow);
    if let Some(l) = &rec.limit {
        f.put(Stamp::Limit, limit_field(l).as_bytes());
    }
}

/// The `x-tollgate-limit` value naming the bound that stopped a request, as a structured
/// field: `"team-monthly";kind="budget";scope="team";id="data";unit="usd"`. Only refusals and
/// static answers in their place carry it, so the one allocation is off the served path.
fn limit_field(l: &LimitDetail) -> String {
    let mut s = String::with_capacity(64 + l.name.len() + l.id.len());
    super::limit_headers::sf_string(&mut s, &l.name);
    for (k, v) in [
        ("kind", l.kind),
        ("scope", l.scope),
        ("id", &*l.id),
        ("unit", l.unit.as_str()),
    ] {
        s.push(';');
        s.push_str(k);
        s.push('=');
        super::limit_headers::sf_string(&mut s, v);
    }
    s
}

/// Stamps `x-tollgate-cost-usd` (micro-dollars, written as exact dollars) on an answer that
/// [`stamp`] stamped.
pub fn stamp_cost<B>(resp: &mut Response<B>, micros: u64) {
    if let Some(s) = resp.extensions_mut().get_mut::<super::stamps::Stamps>() {
        let mut b = [0u8; 28];
        s.put_known(
            Stamp::CostUsd,
            crate::units::usd_decimal(micros, &mut b).as_bytes(),
        );
    }
}

/// The OpenAI-style error response for a refusal, stamped with the record.
pub fn refusal(r: &Refusal, rec: &Record, snap: &Snapshot) -> Response<Body> {
    refusal_in(Dialect::OpenAi, r, rec, snap)
}

/// The error response for a refusal in the client's dialect (SPEC §3.1), stamped.
pub fn refusal_in(api: Dialect, r: &Refusal, rec: &Record, snap: &Snapshot) -> Response<Body> {
    let status = r.status(rec);
    let (ty, code, param, message) = r.parts(rec);
    // The decision sits beside `error` (SPEC §3) and inside it too: SDKs keep only the
    // `error` object as the exception's body (`e.body["tollgate"]` in the OpenAI SDKs).
    let t = tollgate_object(rec);
    let body = match api {
        Dialect::OpenAi | Dialect::Responses => json!({
            "error": {"message": message, "type": ty, "code": code, "param": param, "tollgate": t.clone()},
            "tollgate": t,
        }),
        d => crate::dialect::error_body(d, status.as_u16(), &message, Some(&t), rec.retry_after),
    };
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    stamp(&mut resp, rec, snap);
    resp
}

/// The route's static answer as a well-formed completion (or stream), usage zero.
pub fn static_answer(
    text: &str,
    endpoint: Endpoint,
    stream: bool,
    include_usage: bool,
    rec: &Record,
    snap: &Snapshot,
) -> Response<Body> {
    let created = jiff::Timestamp::now().as_second();
    let id = format!("tollgate-static-{}", rec.request_id);
    let model = &*rec.route;
    let usage = json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
    let (body, ctype) = match (endpoint, stream) {
        (Endpoint::Completions, false) => (
            json!({"id": id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": null}],
                   "usage": usage})
            .to_string(),
            "application/json",
        ),
        (Endpoint::Completions, true) => {
            let c = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": null}]});
            (format!("data: {c}\n\ndata: [DONE]\n\n"), "text/event-stream")
        }
        (_, false) => (
            json!({"id": id, "object": "chat.completion", "created": created, "model": model,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                "logprobs": null, "finish_reason": "stop"}],
                   "usage": usage})
            .to_string(),
            "application/json",
        ),
        (_, true) => {
            let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
                json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
            };
            let a = chunk(json!({"role": "assistant", "content": text}), serde_json::Value::Null);
            let b = chunk(json!({}), json!("stop"));
            let mut s = format!("data: {a}\n\ndata: {b}\n\n");
            if include_usage {
                let u = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": usage});
                s.push_str(&format!("data: {u}\n\n"));
            }
            s.push_str("data: [DONE]\n\n");
            (s, "text/event-stream")
        }
    };
    let mut resp = Response::new(full(body));
    resp.headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    stamp(&mut resp, rec, snap);
    stamp_cost(&mut resp, 0);
    resp
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and framing headers hyper recomputes.
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
            | "host"
    )
}

#[cfg(test)]
mod tests;
