//! Listeners and connections: HTTP/1.1 and h2c on the data port, bounded header reads,
//! graceful drain on shutdown. Also the admin port (`crate::admin`) and the policy watcher.

use super::conn;
use super::handler::{handle, App};
use super::snapshot::Snapshot;
use super::transport::Transport;
use crate::admin::{self, Ops};
use crate::audit::Audit;
use crate::governor::Governor;
use crate::ledger::Ledger;
use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Largest request head (and read buffer) a connection may fill.
const MAX_HEADER_BUF: usize = 64 * 1024;

/// Where to listen, overriding the policy (tests bind port 0).
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
}

/// A running sidecar.
#[derive(Debug)]
pub struct Running {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub app: Arc<App>,
    /// The admin state: reload path and status, admin token, readiness hook.
    pub ops: Arc<Ops>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

async fn bind(opt: Option<SocketAddr>, from_policy: &str) -> std::io::Result<TcpListener> {
    match opt {
        Some(a) => TcpListener::bind(a).await,
        None => TcpListener::bind(from_policy).await,
    }
}

/// Binds both ports and starts serving, with counters in memory.
pub async fn start(snap: Snapshot, audit: Audit, opts: Options) -> std::io::Result<Running> {
    let governor = Arc::new(Governor::new(Arc::new(Ledger::new())));
    start_with(snap, audit, opts, governor).await
}

/// Binds both ports and starts serving over `governor` (state loaded or shared: `persist`).
pub async fn start_with(
    snap: Snapshot,
    audit: Audit,
    opts: Options,
    governor: Arc<Governor>,
) -> std::io::Result<Running> {
    let data = bind(opts.listen, &snap.policy.server.listen).await?;
    let admin_l = bind(opts.admin_listen, &snap.policy.server.admin_listen).await?;
    let (addr, admin_addr) = (data.local_addr()?, admin_l.local_addr()?);
    crate::telemetry::global().configure(&snap.policy);
    let ops = Arc::new(Ops::new(snap.policy.version.clone()));
    let app = Arc::new(App {
        snap: ArcSwap::from_pointee(snap),
        governor,
        transport: Transport::new(),
        audit,
    });
    let (stop, stop_rx) = watch::channel(false);
    let a = app.clone();
    let data_task = tokio::spawn(serve(
        data,
        stop_rx.clone(),
        app.clone(),
        "data",
        move |req| handle(a.clone(), req),
    ));
    let (a, o) = (app.clone(), ops.clone());
    let admin_task = tokio::spawn(serve(
        admin_l,
        stop_rx.clone(),
        app.clone(),
        "admin",
        move |req| admin::handle(a.clone(), o.clone(), req),
    ));
    let sweeper = tokio::spawn(sweep(app.clone(), stop_rx));
    Ok(Running {
        addr,
        admin_addr,
        app,
        ops,
        stop,
        tasks: vec![data_task, admin_task, sweeper],
    })
}

impl Running {
    /// Reloads from `path` from now on (SIGHUP, `POST /admin/reload`) and watches it:
    /// a change on disk is loaded within about a second.
    pub fn watch_policy(&mut self, path: std::path::PathBuf) {
        self.ops.set_policy_path(path);
        let task = tokio::spawn(admin::watch(
            self.app.clone(),
            self.ops.clone(),
            self.stop.subscribe(),
        ));
        self.tasks.push(task);
    }

    /// Reloads from the path set by [`Running::watch_policy`] (same path as every trigger).
    pub async fn reload(&self, trigger: admin::Trigger) -> Result<Arc<str>, String> {
        self.ops
            .reload(&self.app, trigger)
            .await
            .map_err(|e| match e {
                admin::ReloadError::NoPath => "no policy path to reload from".to_string(),
                admin::ReloadError::Invalid(m) => m,
            })
    }

    /// Stops accepting, lets in-flight requests finish up to the policy's grace, and returns.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Drops idle job ledgers and ended windows once a minute.
async fn sweep(app: Arc<App>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(60));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let snap = app.snap.load();
                let ttl = snap.policy.state.job_idle_ttl.as_millis() as i64;
                app.governor.ledger.sweep(jiff::Timestamp::now().as_millisecond(), ttl);
                let backends = &snap.policy.backends;
                app.governor
                    .retain_circuits(|id| backends.iter().any(|b| &*b.id == id));
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

async fn serve<F, Fut>(
    listener: TcpListener,
    mut stop: watch::Receiver<bool>,
    app: Arc<App>,
    port: &'static str,
    svc: F,
) where
    F: Fn(hyper::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<
            Output = Result<hyper::Response<super::respond::Body>, std::convert::Infallible>,
        > + Send
        + 'static,
{
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
                let (header_timeout, max) = (server.header_read_timeout, server.max_connections);
                let Some(slot) = gate.enter(max as usize) else {
                    tokio::spawn(conn::refuse(stream, port));
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let svc = svc.clone();
                let watcher = graceful.watcher();
                let mut stopping = stop.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    // hyper's header timer starts with the first byte: a silent socket is
                    // closed here instead of sitting open forever, and at once on shutdown
                    // (it holds a watcher, so the drain would otherwise wait for it).
                    let spoke = tokio::select! {
                        spoke = conn::first_byte(&stream, header_timeout, port) => spoke,
                        _ = stopping.changed() => false,
                    };
                    if !spoke {
                        return;
                    }
                    let conn = builder(header_timeout)
                        .serve_connection(TokioIo::new(stream), service_fn(svc))
                        .into_owned();
                    let _ = watcher.watch(conn).await;
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
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
