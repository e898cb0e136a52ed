//! Multi-threaded stress of the lock-free ledger: 8 threads reserve against one shared hard
//! budget and a counter of their own, then commit (actual <= reserved) or release at random,
//! while a watcher samples the shared counter and asserts it never crosses its hard limits.
//!
//! 8 x 100_000 reservations; debug builds run them too (about a second or two on 2 cores).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tollgate::ledger::*;
use tollgate::units::*;

const THREADS: usize = 8;
const PER_THREAD: u64 = 100_000;
/// Shared budget: filled about half way through so that refusals and contention at the
/// limit are both exercised.
/// Reservations each thread may hold at once.
const HELD: usize = 4;
const HARD_TOKENS: u64 = 70_000_000;
const HARD_USD: u64 = 40_000_000;

/// Each thread's own counter limits requests, differently per thread, so that the first
/// threads are refused by their own counter (part 1: the shared part, already reserved, must
/// be rolled back under contention) while the others fill the shared budget.
fn own_request_limit(t: usize) -> u64 {
    PER_THREAD / 10 + t as u64 * (PER_THREAD * 6 / 100)
}

/// xorshift64*: deterministic per thread, no shared state.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct ThreadTotals {
    committed: [u64; 3],
    reserved_ok: u64,
    refused_shared: u64,
    refused_own: u64,
}

#[test]
fn eight_threads_never_cross_the_shared_hard_limit() {
    let started = std::time::Instant::now();
    let ledger = Ledger::new();
    let shared_key = CounterKey {
        scope: Scope::Global,
        id: Arc::from("*"),
        window: None,
    };
    let shared = ledger.counter(&shared_key, i64::MAX);
    let shared_hard = [Some(HARD_TOKENS), None, Some(HARD_USD)];
    let own: Vec<Arc<Counter>> = (0..THREADS)
        .map(|i| {
            let key = CounterKey {
                scope: Scope::Consumer,
                id: Arc::from(format!("t{i}")),
                window: None,
            };
            ledger.counter(&key, i64::MAX)
        })
        .collect();

    let done = AtomicBool::new(false);
    let samples = AtomicU64::new(0);
    let max_seen = AtomicU64::new(0);

    let totals: Vec<ThreadTotals> = std::thread::scope(|s| {
        // Watcher: samples `used` of the shared counter (and the per-thread ones) until the
        // workers are done; it must never see a hard limit crossed.
        s.spawn(|| {
            let mut n = 0u64;
            loop {
                let finished = done.load(Ordering::Acquire);
                let u = shared.used();
                assert!(
                    u.tokens <= HARD_TOKENS,
                    "shared used {} tokens > hard {}",
                    u.tokens,
                    HARD_TOKENS
                );
                assert!(
                    u.usd <= HARD_USD,
                    "shared used {} usd > hard {}",
                    u.usd,
                    HARD_USD
                );
                max_seen.fetch_max(u.tokens, Ordering::Relaxed);
                for (t, c) in own.iter().enumerate() {
                    assert!(c.used().requests <= own_request_limit(t));
                }
                n += 1;
                if finished {
                    break;
                }
                std::hint::spin_loop();
                if n.is_multiple_of(64) {
                    std::thread::yield_now();
                }
            }
            samples.store(n, Ordering::Relaxed);
        });

        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (ledger, shared, mine) = (&ledger, shared.clone(), own[t].clone());
                s.spawn(move || {
                    let mut rng =
                        Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) * 0x1234_5678_9ABC_DEF1));
                    let mut tot = ThreadTotals::default();
                    let parts = [
                        ReservePart {
                            counter: shared,
                            hard: shared_hard,
                        },
                        ReservePart {
                            counter: mine,
                            hard: [None, Some(own_request_limit(t)), None],
                        },
                    ];
                    // Up to HELD reservations in flight per thread; a new one settles a
                    // random held one first, so that many are in flight near the limit.
                    let mut held: Vec<Reservation> = Vec::with_capacity(HELD);
                    let settle = |r: Reservation, rng: &mut Rng, tot: &mut ThreadTotals| {
                        let amount = r.amount();
                        match rng.below(4) {
                            0 => r.release(),
                            1 => drop(r),
                            _ => {
                                let actual = Amount {
                                    tokens: rng.below(amount.tokens + 1),
                                    requests: 1,
                                    usd: rng.below(amount.usd + 1),
                                };
                                let before = r.commit(actual);
                                assert_eq!(before.len(), 2);
                                tot.committed[0] += actual.tokens;
                                tot.committed[1] += actual.requests;
                                tot.committed[2] += actual.usd;
                            }
                        }
                    };
                    for _ in 0..PER_THREAD {
                        if held.len() == HELD || (!held.is_empty() && rng.below(2) == 0) {
                            let i = rng.below(held.len() as u64) as usize;
                            let r = held.swap_remove(i);
                            settle(r, &mut rng, &mut tot);
                        }
                        let amount = Amount {
                            tokens: 1 + rng.below(1_500),
                            requests: 1,
                            usd: rng.below(800),
                        };
                        match ledger.reserve(&parts, amount) {
                            Ok(r) => {
                                tot.reserved_ok += 1;
                                // Right after winning is when a racy check would show.
                                let u = parts[0].counter.used();
                                assert!(u.tokens <= HARD_TOKENS && u.usd <= HARD_USD, "{u:?}");
                                held.push(r);
                            }
                            Err(Refusal { part: 0, .. }) => tot.refused_shared += 1,
                            Err(Refusal { part: 1, refusal }) => {
                                assert_eq!(refusal.dim, Dim::Requests);
                                tot.refused_own += 1;
                            }
                            Err(e) => panic!("unexpected refusal {e:?}"),
                        }
                    }
                    while let Some(r) = held.pop() {
                        settle(r, &mut rng, &mut tot);
                    }
                    tot
                })
            })
            .collect();
        // Stop the watcher whatever the workers did, then fail on any worker's panic.
        let results: Vec<_> = workers.into_iter().map(|h| h.join()).collect();
        done.store(true, Ordering::Release);
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });

    let sum: [u64; 3] = std::array::from_fn(|d| totals.iter().map(|t| t.committed[d]).sum::<u64>());
    let committed = shared.committed();
    assert!(committed.tokens <= HARD_TOKENS);
    assert!(committed.usd <= HARD_USD);
    assert_eq!(
        committed.as_array(),
        sum,
        "shared committed equals what the threads committed"
    );
    assert_eq!(shared.reserved(), Amount::ZERO);
    assert_eq!(shared.used(), committed);
    for (i, (c, t)) in own.iter().zip(&totals).enumerate() {
        assert_eq!(c.committed().as_array(), t.committed);
        assert_eq!(c.reserved(), Amount::ZERO);
        assert!(c.committed().requests <= own_request_limit(i));
    }
    assert_eq!(ledger.reserved_tokens(), 0);

    let ok: u64 = totals.iter().map(|t| t.reserved_ok).sum();
    let refused_shared: u64 = totals.iter().map(|t| t.refused_shared).sum();
    let refused_own: u64 = totals.iter().map(|t| t.refused_own).sum();
    assert_eq!(
        ok + refused_shared + refused_own,
        THREADS as u64 * PER_THREAD
    );
    // The run must actually have pushed against the shared limit.
    assert!(refused_shared > 0, "the shared budget was never reached");
    assert!(refused_own > 0, "no thread reached its own limit");
    eprintln!(
        "stress: {} reservations in {:?}: {ok} granted, {refused_shared} refused by the shared \
         budget, {refused_own} by a thread's own limit; committed {committed:?}; \
         watcher took {} samples, max used {} of {HARD_TOKENS} tokens",
        THREADS as u64 * PER_THREAD,
        started.elapsed(),
        samples.load(Ordering::Relaxed),
        max_seen.load(Ordering::Relaxed),
    );
}
