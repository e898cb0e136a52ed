//! The pure decision core. Plain functions over a request context, a policy snapshot, the
//! ledger and an injected clock, with the upstream call behind a trait: the proxy and
//! `tollgate test` run exactly this code. No sockets, no files, no wall clock in here.

pub mod circuit;
mod decide;
pub mod forecast;
pub mod limits;
pub mod plan;
pub mod record;
mod reserve;
mod settle;
pub mod upstream;

#[cfg(test)]
mod tests;

pub use crate::units::Usage;
pub use circuit::{Admission, Circuit, CircuitState};
pub use record::*;
pub use upstream::{
    CallResult, CallSpec, Clock, Failure, FailureClass, Skip, SystemClock, Upstream,
};

use crate::ledger::{Ledger, Reservation, SharedCounters, WindowSet};
use arc_swap::ArcSwapOption;
use dashmap::DashMap;
use plan::PartInfo;
use std::sync::Arc;

/// One governed request as the core sees it.
#[derive(Debug, Clone)]
pub struct RequestCtx {
    pub request_id: Arc<str>,
    pub job_id: Arc<str>,
    pub consumer: Arc<str>,
    /// The caller's team (from its virtual key); team-scoped bounds apply only with one.
    pub team: Option<Arc<str>>,
    /// Estimated prompt tokens (before any backend's `token_ratio`).
    pub input_tokens: u64,
    /// The client's output cap per choice; `None` = the policy default.
    pub max_output_tokens: Option<u64>,
    /// Choices asked for; output is charged across all of them.
    pub n: u32,
    /// Whether the route's static response may answer this request (not for embeddings).
    pub static_ok: bool,
}

impl RequestCtx {
    /// A job the app did not declare is this one request: its ledger ends with it, so
    /// undeclared jobs never pile up in memory.
    pub fn ephemeral_job(&self) -> bool {
        self.job_id == self.request_id
    }

    /// The key of this request's job ledger and job counters: (consumer, job).
    pub fn job_key(&self) -> Arc<str> {
        crate::ledger::job_key(&self.consumer, &self.job_id)
    }
}

/// A served call whose usage is not yet known: the reservation is still held. Dropping it
/// releases the worst case (the guard); [`Governor::settle`] commits the actual.
#[derive(Debug)]
pub struct Pending {
    reservation: Reservation,
    parts: Vec<PartInfo>,
    backend_index: usize,
    /// The price of the chain entry that served (its own, else its backend's).
    price: crate::policy::Price,
}

impl Pending {
    pub fn backend_index(&self) -> usize {
        self.backend_index
    }
    /// The worst case this call reserved (tokens, requests, micro-dollars).
    pub fn reserved(&self) -> crate::units::Amount {
        self.reservation.amount()
    }
}

/// What the handler must send back.
#[derive(Debug)]
pub enum Served<T> {
    /// An upstream answered; settle `pending` when its usage is known. Boxed: a `Served`
    /// is handed up through every poll of the governor's and the handler's futures (each a
    /// copy of the whole `Poll`), a pointer rather than the reservation's ~150 bytes.
    Upstream { payload: T, pending: Box<Pending> },
    /// The route's static response (DEGRADE).
    Static(Arc<str>),
    /// A client error from the upstream, passed through unchanged.
    Passthrough { payload: T },
    /// The sidecar answers itself with the record's status (DEFER / HARD_STOP).
    Refused,
}

#[derive(Debug)]
pub struct Outcome<T> {
    pub record: Record,
    pub served: Served<T>,
}

/// Circuits a thread keeps from its last look-ups ([`Governor::circuit`]): a chain's
/// backends, most often the first.
const NEAR_CIRCUITS_KEPT: usize = 4;

type KeptCircuit = (u64, Arc<str>, Arc<Circuit>);

thread_local! {
    static NEAR_CIRCUITS: std::cell::RefCell<Vec<KeptCircuit>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Shared, long-lived state of the core: the ledger and one circuit per backend id.
/// Both survive policy reloads.
#[derive(Debug)]
pub struct Governor {
    pub ledger: Arc<Ledger>,
    /// This governor among all made in the process (what a thread's kept circuits are of).
    instance: u64,
    circuits: DashMap<Arc<str>, Arc<Circuit>, foldhash::quality::RandomState>,
    /// The current windows, recomputed only when the minute turns (or the zone changes).
    windows: ArcSwapOption<(String, WindowSet)>,
    /// Counters shared with other replicas (`state.backend: redis`); `None` = the local ledger
    /// alone decides (memory, sqlite), with no await on the reservation path.
    shared: Option<Arc<dyn SharedCounters>>,
    /// Burn-rate samples and fired forecast alerts (read and written off the request path).
    forecasts: forecast::Forecasts,
}

impl Governor {
    pub fn new(ledger: Arc<Ledger>) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Governor {
            ledger,
            instance: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            circuits: DashMap::default(),
            windows: ArcSwapOption::empty(),
            shared: None,
            forecasts: forecast::Forecasts::default(),
        }
    }

    /// A governor whose hard limits are decided by a shared store; the local ledger mirrors
    /// its committed totals.
    pub fn with_shared(ledger: Arc<Ledger>, shared: Arc<dyn SharedCounters>) -> Self {
        Governor {
            shared: Some(shared),
            ..Governor::new(ledger)
        }
    }

    /// The calendar windows at `now` in the policy's zone, cached until the minute turns.
    pub fn windows_at(
        &self,
        cfg: &crate::policy::WindowsCfg,
        now: crate::units::Millis,
    ) -> WindowSet {
        if let Some(c) = &*self.windows.load() {
            if c.0 == cfg.timezone_name && c.1.holds_at(now) {
                return c.1;
            }
        }
        let set = WindowSet::at(&cfg.timezone, now);
        self.windows
            .store(Some(Arc::new((cfg.timezone_name.clone(), set))));
        set
    }

    /// The circuit of a backend, created CLOSED on first use. The last few a thread found are
    /// kept with their id (held, so an equal pointer is the same id) and this governor's
    /// number: the map's look-up takes its shard's lock, a write to a line every connection
    /// worker shares, on every request.
    pub fn circuit(&self, backend_id: &Arc<str>) -> Arc<Circuit> {
        let me = self.instance;
        let kept = NEAR_CIRCUITS
            .try_with(|n| {
                n.borrow()
                    .iter()
                    .find(|(g, id, _)| *g == me && Arc::ptr_eq(id, backend_id))
                    .map(|(_, _, c)| c.clone())
            })
            .ok()
            .flatten();
        if let Some(c) = kept {
            return c;
        }
        let c = self.circuit_in_map(backend_id);
        let _ = NEAR_CIRCUITS.try_with(|n| {
            let mut n = n.borrow_mut();
            if n.len() == NEAR_CIRCUITS_KEPT {
                n.remove(0);
            }
            n.push((me, backend_id.clone(), c.clone()));
        });
        c
    }

    fn circuit_in_map(&self, backend_id: &Arc<str>) -> Arc<Circuit> {
        if let Some(c) = self.circuits.get(backend_id) {
            return c.clone();
        }
        self.circuits.entry(backend_id.clone()).or_default().clone()
    }

    /// All circuits by backend id (status pages, persistence).
    pub fn circuits(&self) -> Vec<(Arc<str>, Arc<Circuit>)> {
        self.circuits
            .iter()
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect()
    }

    /// Drops circuits of backends no longer in the policy (after a reload). A thread's kept
    /// look-up of a dropped one is keyed by the old policy's id, which the new policy's
    /// requests do not carry.
    pub fn retain_circuits(&self, keep: impl Fn(&str) -> bool) {
        self.circuits.retain(|k, _| keep(k));
    }
}
