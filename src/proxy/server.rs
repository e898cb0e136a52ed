//! Listeners and connections: HTTP/1.1 and h2c, bounded header reads, graceful drain on
//! shutdown; the periodic sweep; the policy swap. `crate::sidecar` starts the ports.

use super::conn;
use super::handler::App;
use super::snapshot::Snapshot;
use crate::governor::Clock;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Largest request head (and read buffer) a connection may fill.
const MAX_HEADER_BUF: usize = crate::wire::MAX_HEAD;

/// Drops idle job ledgers and ended windows once a minute.
pub async fn sweep(app: Arc<App>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(60));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let snap = app.snap.load();
                let ttl = snap.policy.state.job_idle_ttl.as_millis() as i64;
                app.governor.ledger.sweep(app.clock.now_ms(), ttl);
                let backends = &snap.policy.backends;
                app.governor
                    .retain_circuits(|id| backends.iter().any(|b| &*b.id == id));
            }
            _ = stop.changed() => return,
        }
    }
}

/// How often the burn-rate forecasts are sampled and judged (off the request path).
pub const FORECAST_EVERY: Duration = Duration::from_secs(10);

/// Samples the windowed quotas' and budgets' counters, sends `forecast` alerts and sets the
/// projected-exhaustion gauges (SPEC §9).
pub async fn forecast(app: Arc<App>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(FORECAST_EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let snap = app.snap.load();
                let now = jiff::Timestamp::now().as_millisecond();
                let found = app.governor.forecast_tick(&snap.policy, now);
                crate::telemetry::publish_forecasts(&snap.policy, &found, now);
            }
            _ = stop.changed() => return,
        }
    }
}

/// The connection settings of a port, read from the policy in force at each accept (so a
/// reload changes them for new connections).
fn builder(header_timeout: Duration) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(MAX_HEADER_BUF)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)));
    builder
}

/// A port's request handler: a function from a request to its response's future.
pub trait Handler: Clone + Send + Sync + 'static {
    type Answer: std::future::Future<
            Output = Result<hyper::Response<super::respond::Body>, std::convert::Infallible>,
        > + Send
        + 'static;
    fn call(&self, req: hyper::Request<crate::body::ReqBody>) -> Self::Answer;
}

impl<F, Fut> Handler for F
where
    F: Fn(hyper::Request<crate::body::ReqBody>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<
            Output = Result<hyper::Response<super::respond::Body>, std::convert::Infallible>,
        > + Send
        + 'static,
{
    type Answer = Fut;
    fn call(&self, req: hyper::Request<crate::body::ReqBody>) -> Fut {
        self(req)
    }
}

/// Serves `listener` until `stop`, then drains. With `workers`, each accepted connection is
/// served on the least busy connection worker ([`super::workers`]); without, on the runtime
/// this runs on.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    mut stop: watch::Receiver<bool>,
    app: Arc<App>,
    port: &'static str,
    workers: Option<super::workers::Workers>,
    svc: H,
) {
    let gate = conn::Gate::default();
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let server = &app.snap.load().policy.server;
                let bounds = super::front::Bounds {
                    header_timeout: server.header_read_timeout,
                    max_body: server.max_body_bytes,
                };
                let max = server.max_connections;
                let Some(slot) = gate.enter(max as usize) else {
                    tokio::spawn(conn::refuse(stream, port));
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let svc = svc.clone();
                let watcher = graceful.watcher();
                let stopping = stop.clone();
                let Some(workers) = workers.as_ref() else {
                    tokio::spawn(connection(stream, slot, bounds, port, stopping, watcher, svc));
                    continue;
                };
                // The socket leaves this runtime's reactor for the worker's.
                let Ok(std) = stream.into_std() else { continue };
                let (worker, open) = workers.pick();
                worker.spawn(async move {
                    let _open = open;
                    let Ok(stream) = tokio::net::TcpStream::from_std(std) else { return };
                    connection(stream, slot, bounds, port, stopping, watcher, svc).await;
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    // The workers stop once the drain is over (dropped at the end of this function).
    let _workers = workers;
    // In-flight requests finish (up to `server.shutdown_grace`); idle keep-alive connections
    // close.
    let grace = app.snap.load().policy.server.shutdown_grace;
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(grace) => tracing::warn!(
            grace_ms = grace.as_millis() as u64,
            "shutdown grace ran out with connections open"
        ),
    }
}

/// One connection, from its first byte to its close (or the drain's end).
async fn connection<H: Handler>(
    stream: tokio::net::TcpStream,
    slot: conn::Slot,
    bounds: super::front::Bounds,
    port: &'static str,
    mut stopping: watch::Receiver<bool>,
    watcher: hyper_util::server::graceful::Watcher,
    svc: H,
) {
    let _slot = slot;
    // hyper's header timer starts with the first byte: a silent socket is closed here
    // instead of sitting open forever, and at once on shutdown (it holds a watcher, so the
    // drain would otherwise wait for it).
    let spoke = tokio::select! {
        spoke = conn::first_byte(&stream, bounds.header_timeout, port) => spoke,
        _ = stopping.changed() => false,
    };
    if !spoke {
        return;
    }
    // Served here while its requests are the common kind; the rest of it goes to hyper.
    let mut stream = stream;
    let first = match super::front::serve(&mut stream, bounds, port, &stopping, &svc).await {
        super::front::End::Closed => return,
        super::front::End::HandOver(first) => first,
    };
    let conn = builder(bounds.header_timeout)
        .serve_connection(
            TokioIo::new(conn::Shaped::new(
                super::front::Rewind::new(first, stream),
                port,
            )),
            service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                // RFC 9112 §3.2: exactly one Host on HTTP/1.1 (the fast path checks its own).
                let hosts = req.headers().get_all(http::header::HOST).iter().count();
                let answer = (req.version() != http::Version::HTTP_11 || hosts == 1)
                    .then(|| svc.call(req.map(crate::body::ReqBody::Hyper)));
                async move {
                    let Some(answer) = answer else {
                        return Ok(host_refusal(port)
                            .map(|body| super::finish::Finishing::new(body, None)));
                    };
                    let mut resp = answer.await?;
                    // hyper writes the answer from its map: the stamped fields go in there.
                    super::stamps::into_headers(&mut resp);
                    // The record is closed as hyper takes the body's last piece, or as cut
                    // when hyper drops the body unwritten (see `Finishing`).
                    let after = resp.extensions_mut().remove::<super::finish::After>();
                    Ok::<_, std::convert::Infallible>(
                        resp.map(|body| super::finish::Finishing::new(body, after)),
                    )
                }
            }),
        )
        .into_owned();
    let _ = watcher.watch(conn).await;
}

/// The 400 to an HTTP/1.1 request without exactly one `Host`, served by hyper.
fn host_refusal(port: &'static str) -> hyper::Response<super::respond::Body> {
    conn::count_refused(port, "malformed");
    let (status, body) = conn::error_body(conn::Malformed::Host);
    let mut resp = hyper::Response::new(crate::body::full(body));
    *resp.status_mut() = http::StatusCode::from_bytes(&status.as_bytes()[..3])
        .unwrap_or(http::StatusCode::BAD_REQUEST);
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    h.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    resp
}

/// Loads the policy at `path` and swaps it in whole; the old one stays on any error.
/// The bare swap: `Running::reload` / `admin::Ops::reload` wrap it with metrics, status and
/// logging, and every trigger goes through them.
pub fn reload(app: &App, path: &std::path::Path) -> Result<Arc<str>, String> {
    let snap = super::snapshot::load(path)?;
    apply(app, snap)
}

/// Swaps in a prepared snapshot, unless it changes a key that only takes effect at start.
pub fn apply(app: &App, snap: Snapshot) -> Result<Arc<str>, String> {
    start_only_unchanged(&app.snap.load().policy, &snap.policy)?;
    let version = snap.policy.version.clone();
    // One swap: everything derived from the policy is in the snapshot or read from it where
    // it is used (alert settings when an alert is emitted). Circuits of backends the new
    // policy no longer has are unreachable from it and pruned by the next sweep.
    app.snap.store(Arc::new(snap));
    Ok(version)
}

/// Refuses a reload that changes what is bound or opened once at start: the listeners and
/// the state and audit stores. Applying the rest would leave the sidecar half on each policy.
fn start_only_unchanged(
    old: &crate::policy::Policy,
    new: &crate::policy::Policy,
) -> Result<(), String> {
    let mut changed = Vec::new();
    if old.server.listen != new.server.listen {
        changed.push("server.listen");
    }
    if old.server.admin_listen != new.server.admin_listen {
        changed.push("server.admin_listen");
    }
    if old.state != new.state {
        changed.push("state");
    }
    if old.audit != new.audit {
        changed.push("audit");
    }
    if changed.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{} changed: server.listen, server.admin_listen, state.* and audit.* take effect only \
         at start; restart the sidecar to change them (reload refused, the old policy stays in force)",
        changed.join(", ")
    ))
}
