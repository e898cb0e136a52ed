//! Shared by the criterion benches.

use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Runs `op` `iters` times split over two threads started together; wall time (inverse
/// throughput: per-thread latency is about twice that).
pub fn two_threads<S: Sync>(iters: u64, state: &S, op: impl Fn(&S) + Sync) -> Duration {
    let barrier = Barrier::new(3);
    let half = iters / 2;
    std::thread::scope(|s| {
        for n in [half, iters - half] {
            let (barrier, op) = (&barrier, &op);
            s.spawn(move || {
                barrier.wait();
                for _ in 0..n {
                    op(state);
                }
            });
        }
        barrier.wait();
        // Leaving the scope joins both threads.
        Instant::now()
    })
    .elapsed()
}
