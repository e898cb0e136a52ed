//! A running sidecar: both ports bound and served (the data port by `proxy`, the admin port
//! by `admin`), the sweep, and the policy watcher. The one module that wires the two ports,
//! so neither imports the other's side.

use crate::admin::{self, Ops};
use crate::audit::Audit;
use crate::governor::Governor;
use crate::ledger::Ledger;
use crate::proxy::handler::{handle, App};
use crate::proxy::server::{forecast, serve, sweep};
use crate::proxy::transport::Transport;
use crate::proxy::{AppClock, Snapshot};
use arc_swap::ArcSwap;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Where to listen, overriding the policy (tests bind port 0).
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub listen: Option<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    /// Connection workers of the data port (`None`: `TOLLGATE_WORKER_THREADS`, else one per
    /// core; `Some(0)`: connections are served on the calling runtime).
    pub workers: Option<usize>,
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
    start_clocked(snap, audit, opts, governor, AppClock::SYSTEM).await
}

/// [`start_with`] on a given clock: tests pass a [`crate::proxy::ManualClock`] to move past
/// a circuit's recovery or a lease instead of sleeping through it.
pub async fn start_clocked(
    snap: Snapshot,
    audit: Audit,
    opts: Options,
    governor: Arc<Governor>,
    clock: AppClock,
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
        clock,
    });
    let n = opts
        .workers
        .unwrap_or_else(crate::proxy::workers::count_from_env);
    let workers = match n {
        0 => None,
        n => Some(crate::proxy::workers::Workers::start(n)?),
    };
    let (stop, stop_rx) = watch::channel(false);
    let a = app.clone();
    let data_task = tokio::spawn(serve(
        data,
        stop_rx.clone(),
        app.clone(),
        "data",
        workers,
        move |req| handle(a.clone(), req),
    ));
    let (a, o) = (app.clone(), ops.clone());
    let admin_task = tokio::spawn(serve(
        admin_l,
        stop_rx.clone(),
        app.clone(),
        "admin",
        None,
        move |req| admin::handle(a.clone(), o.clone(), req),
    ));
    let forecaster = tokio::spawn(forecast(app.clone(), stop_rx.clone()));
    let sweeper = tokio::spawn(sweep(app.clone(), stop_rx));
    Ok(Running {
        addr,
        admin_addr,
        app,
        ops,
        stop,
        tasks: vec![data_task, admin_task, sweeper, forecaster],
    })
}

impl Running {
    /// Reloads from `path` from now on (SIGHUP, `POST /admin/reload`) and watches it:
    /// a change on disk is loaded within about a second.
    pub fn watch_policy(&mut self, path: std::path::PathBuf) {
        self.ops.set_policy_path(path);
        self.ops.prime_fingerprint();
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
