//! The data port: the router, answers made locally (listings, `/api/show`), and each
//! governed request run in a task of its own as named phases over a per-request context
//! ([`phases`]): identify → read → estimate → route → govern (gates, reserve, call) →
//! reconcile → record.

use super::finish::{close, After, Origin, Sent};
use super::respond::{self, full, Body, Refusal};
use super::snapshot::Snapshot;
use super::transport::Transport;
use crate::audit::{Audit, QueueWait};
use crate::body::ReqBody;
use crate::dialect::{self, render::Meta, Dialect, Inbound, Op, Rendered, Routed};
use crate::estimate::Endpoint;
use crate::governor::{Governor, ReasonClass, Record};
use crate::telemetry::scope;
use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use serde::Deserialize;
use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

mod body;
mod phases;
mod usage;

/// Everything a request needs, shared by all connections.
pub struct App {
    pub snap: ArcSwap<Snapshot>,
    pub governor: Arc<Governor>,
    pub transport: Transport,
    pub audit: Audit,
    /// The governor's time (circuits, leases, waits) and the sweep's: the wall clock, or a
    /// test's [`super::ManualClock`].
    pub clock: super::AppClock,
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
pub async fn handle(app: Arc<App>, req: Request<ReqBody>) -> Result<Response<Body>, Infallible> {
    let t0 = Instant::now();
    let snap = app.snap.load_full();
    let routed = dialect::route(req.method(), req.uri().path(), req.uri().query());
    let routed = match routed {
        Some(Routed::Found(inb)) => {
            // Boxed as a `Send` future: rustc cannot otherwise prove the dialect path's
            // future Send for every lifetime (a known limitation, rust-lang/rust#110338).
            let fut: std::pin::Pin<Box<dyn std::future::Future<Output = Response<Body>> + Send>> =
                pin_in_place!(inbound(app, snap, inb, req, t0));
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
            wait(finish(&app, unknown(Dialect::OpenAi, t0), rec)).await;
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
            wait(finish(&app, unknown(d, t0), rec)).await;
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
    req: Request<ReqBody>,
    t0: Instant,
) -> Response<Body> {
    let op = inb.op;
    let local = match op {
        Op::List => Some(list(inb.dialect, &snap)),
        Op::Version => Some(serde_json::json!({"version": dialect::ollama::VERSION})),
        Op::Show => {
            let body = body::read(req.into_body(), 64 * 1024)
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
        crate::governor::record::none(),
        Arc::from(&path[..end]),
    )
    .refused_early(ReasonClass::BadRequest, status, "not governed".into())
}

/// Polls the governed work in place, in the connection's task (no hand-off to another task
/// on the common path). hyper drops the service future when the client hangs up; a call that
/// reached the upstream must still be reconciled (its usage committed, its hold released
/// then, its audit record written), so when this is dropped with the work unfinished, the
/// client is marked gone and the work moves, still pinned in its box, to a task of its own
/// that runs it to its end (bounded by the body read and upstream timeouts). A panic in the
/// work is caught and answered as an internal error.
struct Detach<F: Future + Send + 'static> {
    work: Option<Pin<Box<F>>>,
    gone: Arc<AtomicBool>,
}

impl<F: Future + Send + 'static> Future for Detach<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(w) = self.work.as_mut() else {
            // Polled after it finished: it never will be again.
            return Poll::Pending;
        };
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| w.as_mut().poll(cx)));
        match r {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => {
                self.work = None;
                Poll::Ready(Ok(v))
            }
            Err(panic) => {
                self.work = None;
                Poll::Ready(Err(panic))
            }
        }
    }
}

impl<F: Future + Send + 'static> Drop for Detach<F> {
    fn drop(&mut self) {
        if let Some(w) = self.work.take() {
            self.gone.store(true, Ordering::Release);
            // No runtime: the process is shutting down, and the work with it.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = w.await;
                });
            }
        }
    }
}

/// Runs one governed request to its end, whatever the client does (see [`Detach`]).
async fn governed(
    app: &Arc<App>,
    snap: Arc<Snapshot>,
    endpoint: Endpoint,
    inb: Inbound,
    req: Request<ReqBody>,
    t0: Instant,
) -> (Response<Body>, Meta) {
    let gone = Arc::new(AtomicBool::new(false));
    let app = app.clone();
    // The client-gone flag and the request's trace (when OTLP export is on, boxed) live in
    // the task scope of the work (see `scope::run`).
    let trace = crate::telemetry::otel::start(req.headers(), endpoint);
    let work = scope::run(gone.clone(), trace, async move {
        let mut meta = Meta::default();
        // Boxed: the work future, moved into its own box below, stays small (and the ~5 KB
        // of this one are not copied into their box: `pin_in_place`).
        let fut: Pin<Box<dyn Future<Output = Response<Body>> + Send + '_>> = pin_in_place!(
            phases::governed_here(&app, snap, endpoint, &inb, &mut meta, req, t0)
        );
        let resp = fut.await;
        // Boxed: the answer is handed up through every poll of the scope, the panic guard and
        // `Detach` (each a copy of the whole `Poll`, ready or not), a pointer rather than
        // ~200 bytes.
        Box::new((resp, meta))
    });
    let detached = Detach {
        work: Some(Box::pin(work)),
        gone,
    };
    match detached.await {
        Ok(r) => *r,
        Err(_) => {
            tracing::error!("the governed request panicked");
            let mut r = Response::new(full(Bytes::from_static(
                b"{\"error\":{\"message\":\"internal error\",\"type\":\"tollgate_error\",\"param\":null,\"code\":\"internal_error\"}}",
            )));
            *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            (r, Meta::default())
        }
    }
}

/// Where a request on a path not governed came in.
fn unknown(api: Dialect, at: Instant) -> Origin {
    Origin {
        endpoint: "unknown",
        api: api.as_str(),
        at,
    }
}

/// Records a request answered in one piece now (see [`after`]).
/// Synchronous while the audit queue has room (no future holds the record); the wait it
/// hands back when the queue is full must be awaited.
#[must_use = "a full audit queue's wait must be awaited"]
fn finish(app: &Arc<App>, origin: Origin, record: Record) -> Option<QueueWait> {
    after(app, origin, record).run(false)
}

/// The closing of a governed request answered in one piece, left for after its answer is
/// written (see [`After`]). What only the request's scope knows (a client gone, the trace) is
/// read now; the write's own failure is added when it runs.
fn after(app: &Arc<App>, origin: Origin, mut record: Record) -> After {
    if scope::client_gone() {
        record.client_disconnected = true;
    }
    let trace = crate::telemetry::otel::take();
    let app = app.clone();
    After::new(move |cut| {
        record.client_disconnected |= cut;
        let entry = close(
            &app.governor,
            &app.snap.load().policy,
            origin,
            record,
            Sent::Whole(trace),
        );
        app.audit.queue(entry)
    })
}

/// Awaits a full audit queue's wait, if there is one.
async fn wait(w: Option<QueueWait>) {
    if let Some(w) = w {
        w.await;
    }
}
