//! Connection workers: the data port's connections are served by a few OS threads, each
//! running a single-threaded Tokio runtime of its own (one per core by default), the way
//! nginx runs one event loop per worker process. A connection stays on the worker that took
//! it, and so does everything its requests start (the upstream call, a stream's pump): no
//! work stealing, no cross-thread wake-ups, and the runtime's per-batch bookkeeping of the
//! shared scheduler is gone (~5,800 instructions a request, docs/performance.md).
//!
//! Accepting stays on the shared runtime, which also keeps the background work (audit
//! writer, OTLP export, policy watcher, admin port). An accepted socket moves to the worker
//! with the fewest open connections.
//!
//! Each worker has a lane number ([`lane`]): the upstream connection pools keep one queue
//! per lane, so a pooled connection is only reused by the worker whose runtime drives it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

pub use crate::wire::lane;

/// Most connection workers (lanes beyond it share the last pool queue).
pub const MAX_WORKERS: usize = crate::wire::MAX_LANES;

/// How many connection workers `TOLLGATE_WORKER_THREADS` asks for: unset, one per core; `0`,
/// none (connections are served on the shared runtime); at most [`MAX_WORKERS`].
pub fn count_from_env() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match std::env::var("TOLLGATE_WORKER_THREADS") {
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) => n.min(MAX_WORKERS),
            Err(_) => {
                tracing::warn!(value = %v, "TOLLGATE_WORKER_THREADS is not a number: one worker per core");
                cores.min(MAX_WORKERS)
            }
        },
        Err(_) => cores.min(MAX_WORKERS),
    }
}

/// Period of a timer each worker keeps armed. Tokio wakes its own driver (an `eventfd`
/// write, then an extra `epoll_wait` that returns at once) whenever a timer is armed that is
/// due before every timer the driver last went to sleep with. hyper arms its header-read
/// timer as it starts reading each request head; on a worker with few connections, that timer
/// was the earliest, so every request paid a write and a wake-up on its critical path (one
/// `write` to the worker's `eventfd` per request at one connection, seen with `perf`). With a
/// timer due within this period always armed, the header timer (seconds away) never is the
/// earliest. Costs four wake-ups a second per worker.
pub const NEAR_TIMER: std::time::Duration = std::time::Duration::from_millis(250);

struct Worker {
    handle: Handle,
    /// Connections this worker serves now.
    open: Arc<AtomicUsize>,
    /// Dropped (or sent) to stop the worker's thread.
    _stop: oneshot::Sender<()>,
}

/// The running workers. Dropping it stops them: each thread ends its runtime, which drops
/// what it still runs (the connections' tasks have finished by then on a graceful shutdown).
pub struct Workers {
    workers: Vec<Worker>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("count", &self.workers.len())
            .finish()
    }
}

/// Counts a connection against its worker while it is open.
pub struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Workers {
    /// Starts `n` workers (`n ≥ 1`).
    pub fn start(n: usize) -> std::io::Result<Workers> {
        let mut workers = Vec::with_capacity(n);
        for i in 0..n.clamp(1, MAX_WORKERS) {
            // IO and timers only: signals (and child processes) are the shared runtime's.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()?;
            let handle = rt.handle().clone();
            let (stop, stopped) = oneshot::channel::<()>();
            std::thread::Builder::new()
                .name(format!("tollgate-worker-{i}"))
                .spawn(move || {
                    crate::wire::set_lane(i + 1);
                    // Runs the connections' tasks until told to stop (or the sender is gone),
                    // with a near timer always armed (see [`NEAR_TIMER`]).
                    rt.block_on(async {
                        let near = async {
                            let mut tick = tokio::time::interval(NEAR_TIMER);
                            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                            loop {
                                tick.tick().await;
                            }
                        };
                        tokio::select! {
                            _ = stopped => {}
                            () = near => {}
                        }
                    });
                    // Whatever is left (idle pooled upstream connections) is dropped here.
                    drop(rt);
                })?;
            workers.push(Worker {
                handle,
                open: Arc::new(AtomicUsize::new(0)),
                _stop: stop,
            });
        }
        Ok(Workers { workers })
    }

    /// The worker with the fewest open connections (the first of equals), its runtime and
    /// the guard that counts the connection until dropped.
    pub fn pick(&self) -> (&Handle, Open) {
        let w = self
            .workers
            .iter()
            .min_by_key(|w| w.open.load(Ordering::Relaxed))
            .expect("at least one worker");
        w.open.fetch_add(1, Ordering::Relaxed);
        (&w.handle, Open(w.open.clone()))
    }

    /// Open connections per worker (tests, status).
    pub fn open(&self) -> Vec<usize> {
        self.workers
            .iter()
            .map(|w| w.open.load(Ordering::Relaxed))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_goes_to_the_least_busy_worker_and_leaves_when_done() {
        let w = Workers::start(2).unwrap();
        let (_, a) = w.pick();
        let (_, b) = w.pick();
        assert_eq!(w.open(), vec![1, 1]);
        drop(a);
        assert_eq!(w.open(), vec![0, 1]);
        let (_, c) = w.pick();
        assert_eq!(w.open(), vec![1, 1]);
        drop((b, c));
        assert_eq!(w.open(), vec![0, 0]);
    }

    #[test]
    fn tasks_on_a_worker_see_its_lane_and_a_single_threaded_runtime() {
        let w = Workers::start(3).unwrap();
        let mut lanes = Vec::new();
        let mut held = Vec::new();
        for _ in 0..3 {
            let (h, open) = w.pick();
            held.push(open);
            let (tx, rx) = std::sync::mpsc::channel();
            h.spawn(async move {
                let flavor = Handle::current().runtime_flavor();
                let _ = tx.send((lane(), flavor));
            });
            lanes.push(rx.recv().unwrap());
        }
        assert!(lanes
            .iter()
            .all(|(_, f)| *f == tokio::runtime::RuntimeFlavor::CurrentThread));
        // Each connection held went to the next idle worker: lanes 1, 2, 3.
        assert_eq!(
            lanes.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert_eq!(lane(), 0, "the test's own thread is no worker");
    }

    #[test]
    fn dropping_the_workers_ends_their_threads() {
        let w = Workers::start(2).unwrap();
        let (h, _open) = w.pick();
        let h = h.clone();
        drop(w);
        // The runtime shuts down once its thread leaves block_on: spawning then fails.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            drop(h.spawn(async move {
                let _ = tx.send(());
            }));
            if rx
                .recv_timeout(std::time::Duration::from_millis(50))
                .is_err()
            {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the worker kept running"
            );
        }
    }
}
