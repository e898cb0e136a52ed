//! Unit tests of the ledger: reservation arithmetic, all-or-nothing refusal, settle-once
//! guards, job ledgers, sweeping, and calendar windows in UTC and in zones with DST.

use super::*;
use crate::units::{Dim, Window};
use jiff::tz::TimeZone;
use jiff::Timestamp;

// ---------------------------------------------------------------------------------------
// helpers

fn amt(tokens: u64, requests: u64, usd: u64) -> Amount {
    Amount {
        tokens,
        requests,
        usd,
    }
}

fn unlimited() -> [Option<u64>; 3] {
    [None; 3]
}

fn key(scope: Scope, id: &str) -> CounterKey {
    CounterKey {
        scope,
        id: Arc::from(id),
        window: None,
    }
}

fn wkey(scope: Scope, id: &str, start: i64) -> CounterKey {
    CounterKey {
        scope,
        id: Arc::from(id),
        window: Some(WindowKey {
            window: Window::Day,
            start,
        }),
    }
}

fn part(c: &Arc<Counter>, hard: [Option<u64>; 3]) -> ReservePart {
    ReservePart {
        counter: c.clone(),
        hard,
    }
}

fn fresh() -> Arc<Counter> {
    Arc::new(Counter::new(i64::MAX))
}

// ---------------------------------------------------------------------------------------
// reserve / commit / release arithmetic

#[test]
fn reserve_holds_worst_case_and_commit_replaces_it_with_actual() {
    let l = Ledger::new();
    let c = l.counter(&key(Scope::Consumer, "a"), i64::MAX);
    let hard = [Some(1_000), Some(10), Some(10_000)];

    let r = l.reserve(&[part(&c, hard)], amt(100, 1, 500)).unwrap();
    assert_eq!(r.amount(), amt(100, 1, 500));
    assert_eq!(c.used(), amt(100, 1, 500));
    assert_eq!(c.reserved(), amt(100, 1, 500));
    assert_eq!(c.committed(), Amount::ZERO);
    assert_eq!(l.reserved_tokens(), 100);

    let before = r.commit(amt(60, 1, 300));
    assert_eq!(before, vec![Amount::ZERO]);
    assert_eq!(c.committed(), amt(60, 1, 300));
    assert_eq!(c.used(), amt(60, 1, 300));
    assert_eq!(c.reserved(), Amount::ZERO);
    assert_eq!(l.reserved_tokens(), 0);

    // A second round sees the first commit as "before".
    let r = l.reserve(&[part(&c, hard)], amt(10, 1, 5)).unwrap();
    assert_eq!(c.used(), amt(70, 2, 305));
    assert_eq!(r.commit(amt(10, 1, 5)), vec![amt(60, 1, 300)]);
    assert_eq!(c.committed(), amt(70, 2, 305));
    assert_eq!(c.reserved(), Amount::ZERO);
}

#[test]
fn commit_less_than_reserved_gives_the_difference_back() {
    let l = Ledger::new();
    let c = fresh();
    let r = l
        .reserve(
            &[part(&c, [Some(500), None, Some(5_000)])],
            amt(400, 1, 4_000),
        )
        .unwrap();
    r.commit(amt(1, 0, 7));
    assert_eq!(c.committed(), amt(1, 0, 7));
    assert_eq!(c.used(), amt(1, 0, 7));
    assert_eq!(c.reserved(), Amount::ZERO);
    // The difference is available again.
    let r2 = l
        .reserve(
            &[part(&c, [Some(500), None, Some(5_000)])],
            amt(499, 1, 4_993),
        )
        .unwrap();
    assert_eq!(c.used(), amt(500, 1, 5_000));
    drop(r2);
    assert_eq!(c.used(), amt(1, 0, 7));
}

#[test]
fn commit_more_than_reserved_books_the_actual_even_past_the_limit() {
    let l = Ledger::new();
    let c = fresh();
    let hard = [Some(120), None, None];
    let r = l.reserve(&[part(&c, hard)], amt(100, 1, 10)).unwrap();
    let before = r.commit(amt(150, 2, 25));
    assert_eq!(before, vec![Amount::ZERO]);
    // What was spent is on the books, whatever the estimate said.
    assert_eq!(c.committed(), amt(150, 2, 25));
    assert_eq!(c.used(), amt(150, 2, 25));
    assert_eq!(c.reserved(), Amount::ZERO);
    assert_eq!(l.reserved_tokens(), 0);
    // Nothing more fits.
    let e = l.reserve(&[part(&c, hard)], amt(1, 0, 0)).unwrap_err();
    assert_eq!(
        e,
        Refusal {
            part: 0,
            refusal: DimRefusal {
                dim: Dim::Tokens,
                used: 150,
                hard: 120
            }
        }
    );
    assert_eq!(c.used(), amt(150, 2, 25));
}

#[test]
fn commit_reports_committed_before_for_every_counter_in_order() {
    let l = Ledger::new();
    let a = fresh();
    let b = fresh();
    a.add_committed(&amt(5, 1, 50));
    b.add_committed(&amt(7, 2, 70));
    let r = l
        .reserve(
            &[part(&a, unlimited()), part(&b, unlimited())],
            amt(10, 1, 100),
        )
        .unwrap();
    assert_eq!(r.commit(amt(3, 1, 30)), vec![amt(5, 1, 50), amt(7, 2, 70)]);
    assert_eq!(a.committed(), amt(8, 2, 80));
    assert_eq!(b.committed(), amt(10, 3, 100));
    assert_eq!(a.reserved(), Amount::ZERO);
    assert_eq!(b.reserved(), Amount::ZERO);
}

#[test]
fn release_gives_the_whole_reservation_back() {
    let l = Ledger::new();
    let c = fresh();
    c.add_committed(&amt(3, 1, 9));
    let r = l
        .reserve(&[part(&c, unlimited())], amt(100, 1, 500))
        .unwrap();
    assert_eq!(c.used(), amt(103, 2, 509));
    r.release();
    assert_eq!(c.used(), amt(3, 1, 9));
    assert_eq!(c.committed(), amt(3, 1, 9));
    assert_eq!(c.reserved(), Amount::ZERO);
    assert_eq!(l.reserved_tokens(), 0);
}

#[test]
fn dropping_a_reservation_releases_it_on_every_exit_path() {
    let l = Ledger::new();
    let c = fresh();

    // Plain scope end.
    {
        let _r = l.reserve(&[part(&c, unlimited())], amt(10, 1, 1)).unwrap();
        assert_eq!(c.reserved(), amt(10, 1, 1));
        assert_eq!(l.reserved_tokens(), 10);
    }
    assert_eq!(c.used(), Amount::ZERO);
    assert_eq!(l.reserved_tokens(), 0);

    // Early return through `?`.
    fn early(l: &Ledger, c: &Arc<Counter>) -> Result<(), &'static str> {
        let _r = l
            .reserve(&[part(c, [None; 3])], amt(10, 1, 1))
            .map_err(|_| "refused")?;
        Err("upstream failed")?;
        Ok(())
    }
    assert!(early(&l, &c).is_err());
    assert_eq!(c.used(), Amount::ZERO);

    // Unwinding.
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _r = l.reserve(&[part(&c, unlimited())], amt(10, 1, 1)).unwrap();
        panic!("boom");
    }));
    assert!(res.is_err());
    assert_eq!(c.used(), Amount::ZERO);
    assert_eq!(c.reserved(), Amount::ZERO);
    assert_eq!(l.reserved_tokens(), 0);
}

#[test]
fn commit_settles_once_and_the_guard_does_not_release_afterwards() {
    let l = Ledger::new();
    let c = fresh();
    let other = l.reserve(&[part(&c, unlimited())], amt(5, 1, 5)).unwrap();
    let r = l.reserve(&[part(&c, unlimited())], amt(10, 1, 1)).unwrap();
    r.commit(amt(10, 1, 1)); // consumes the guard; its Drop must not give anything back
    assert_eq!(c.committed(), amt(10, 1, 1));
    assert_eq!(c.used(), amt(15, 2, 6));
    assert_eq!(c.reserved(), amt(5, 1, 5));
    assert_eq!(l.reserved_tokens(), 5);
    drop(other);
    assert_eq!(c.used(), amt(10, 1, 1));
    assert_eq!(l.reserved_tokens(), 0);
}

// ---------------------------------------------------------------------------------------
// refusals and dimension limits

#[test]
fn refusal_on_the_third_part_leaves_nothing_reserved_anywhere() {
    let l = Ledger::new();
    let a = l.counter(&key(Scope::Consumer, "a"), i64::MAX);
    let b = l.counter(&key(Scope::Global, "*"), i64::MAX);
    let c = l.counter(&key(Scope::Model, "m"), i64::MAX);
    // Earlier state: a committed usage and an outstanding reservation must stay intact.
    a.add_committed(&amt(1, 1, 1));
    let held = l.reserve(&[part(&b, unlimited())], amt(2, 1, 2)).unwrap();
    c.add_committed(&amt(60, 0, 0));

    let parts = [
        part(&a, [Some(1_000), Some(10), Some(1_000)]),
        part(&b, [Some(1_000), Some(10), Some(1_000)]),
        part(&c, [Some(100), Some(10), Some(1_000)]),
    ];
    let e = l.reserve(&parts, amt(50, 1, 10)).unwrap_err();
    assert_eq!(
        e,
        Refusal {
            part: 2,
            refusal: DimRefusal {
                dim: Dim::Tokens,
                used: 60,
                hard: 100
            }
        }
    );

    assert_eq!(a.used(), amt(1, 1, 1));
    assert_eq!(a.reserved(), Amount::ZERO);
    assert_eq!(b.used(), amt(2, 1, 2));
    assert_eq!(b.reserved(), amt(2, 1, 2));
    assert_eq!(c.used(), amt(60, 0, 0));
    assert_eq!(c.reserved(), Amount::ZERO);
    assert_eq!(l.reserved_tokens(), 2);

    // Smaller amount fits everywhere.
    let r = l.reserve(&parts, amt(40, 1, 10)).unwrap();
    assert_eq!(c.used(), amt(100, 1, 10));
    drop(r);
    drop(held);
    for x in [&a, &b, &c] {
        assert_eq!(x.reserved(), Amount::ZERO);
    }
    assert_eq!(l.reserved_tokens(), 0);
}

#[test]
fn refusal_on_the_first_part_reports_part_zero() {
    let l = Ledger::new();
    let a = fresh();
    let b = fresh();
    let e = l
        .reserve(
            &[part(&a, [None, Some(0), None]), part(&b, unlimited())],
            amt(1, 1, 1),
        )
        .unwrap_err();
    assert_eq!(e.part, 0);
    assert_eq!(
        e.refusal,
        DimRefusal {
            dim: Dim::Requests,
            used: 0,
            hard: 0
        }
    );
    assert_eq!(a.used(), Amount::ZERO);
    assert_eq!(b.used(), Amount::ZERO);
}

#[test]
fn refusal_in_a_later_dimension_rolls_back_earlier_dimensions_of_the_counter() {
    let l = Ledger::new();
    let a = fresh();
    let b = fresh();
    // Tokens and requests fit on b, usd does not: b's tokens/requests must be rolled back,
    // and a (already reserved) released.
    let parts = [
        part(&a, unlimited()),
        part(&b, [Some(100), Some(5), Some(999)]),
    ];
    let e = l.reserve(&parts, amt(100, 5, 1_000)).unwrap_err();
    assert_eq!(
        e,
        Refusal {
            part: 1,
            refusal: DimRefusal {
                dim: Dim::Usd,
                used: 0,
                hard: 999
            }
        }
    );
    assert_eq!(a.used(), Amount::ZERO);
    assert_eq!(b.used(), Amount::ZERO);
    assert_eq!(l.reserved_tokens(), 0);
    // Direct counter API behaves the same.
    let e = b
        .try_reserve(&amt(100, 6, 1), &[Some(100), Some(5), None])
        .unwrap_err();
    assert_eq!(e.dim, Dim::Requests);
    assert_eq!(b.used(), Amount::ZERO);
}

#[test]
fn token_limit_is_inclusive_and_then_refuses() {
    let l = Ledger::new();
    let c = fresh();
    let hard = [Some(100), None, None];
    let r1 = l.reserve(&[part(&c, hard)], amt(60, 1, 0)).unwrap();
    let r2 = l.reserve(&[part(&c, hard)], amt(40, 1, 0)).unwrap(); // exactly at the limit
    let e = l.reserve(&[part(&c, hard)], amt(1, 1, 0)).unwrap_err();
    assert_eq!(
        e.refusal,
        DimRefusal {
            dim: Dim::Tokens,
            used: 100,
            hard: 100
        }
    );
    assert_eq!(c.used(), amt(100, 2, 0));
    r1.commit(amt(30, 1, 0));
    // 30 tokens came back.
    let r3 = l.reserve(&[part(&c, hard)], amt(30, 1, 0)).unwrap();
    assert_eq!(c.used(), amt(100, 3, 0));
    drop((r2, r3));
    assert_eq!(c.used(), amt(30, 1, 0));
}

#[test]
fn request_limit_counts_calls() {
    let l = Ledger::new();
    let c = fresh();
    let hard = [None, Some(2), None];
    let r1 = l.reserve(&[part(&c, hard)], amt(1_000_000, 1, 0)).unwrap();
    let r2 = l.reserve(&[part(&c, hard)], amt(1_000_000, 1, 0)).unwrap();
    let e = l.reserve(&[part(&c, hard)], amt(1, 1, 0)).unwrap_err();
    assert_eq!(
        e.refusal,
        DimRefusal {
            dim: Dim::Requests,
            used: 2,
            hard: 2
        }
    );
    r1.commit(amt(5, 1, 0));
    // A committed request still counts.
    assert_eq!(
        l.reserve(&[part(&c, hard)], amt(1, 1, 0))
            .unwrap_err()
            .refusal
            .used,
        2
    );
    r2.release();
    let r3 = l.reserve(&[part(&c, hard)], amt(1, 1, 0)).unwrap();
    assert_eq!(c.used().requests, 2);
    drop(r3);
}

#[test]
fn usd_limit_in_micro_dollars() {
    let l = Ledger::new();
    let c = fresh();
    let hard = [None, None, Some(crate::units::usd_to_micros(1.0))];
    let r1 = l.reserve(&[part(&c, hard)], amt(0, 1, 999_999)).unwrap();
    let e = l.reserve(&[part(&c, hard)], amt(0, 1, 2)).unwrap_err();
    assert_eq!(
        e.refusal,
        DimRefusal {
            dim: Dim::Usd,
            used: 999_999,
            hard: 1_000_000
        }
    );
    let r2 = l.reserve(&[part(&c, hard)], amt(0, 1, 1)).unwrap();
    assert_eq!(c.used().usd, 1_000_000);
    r1.commit(amt(0, 1, 250_000));
    r2.commit(amt(0, 1, 1));
    assert_eq!(c.committed().usd, 250_001);
    assert_eq!(c.reserved(), Amount::ZERO);
}

#[test]
fn no_limit_means_no_check_and_zero_amounts_are_never_refused() {
    let l = Ledger::new();
    let c = fresh();
    let r = l
        .reserve(
            &[part(&c, unlimited())],
            amt(u64::MAX / 4, 1_000, u64::MAX / 4),
        )
        .unwrap();
    drop(r);
    assert_eq!(c.used(), Amount::ZERO);
    // Over the token limit (actual past estimate), a call costing no tokens still fits.
    c.add_committed(&amt(200, 0, 0));
    let hard = [Some(100), Some(10), None];
    let r = l.reserve(&[part(&c, hard)], amt(0, 1, 0)).unwrap();
    assert_eq!(c.used(), amt(200, 1, 0));
    drop(r);
}

#[test]
fn the_same_counter_twice_in_one_reservation_is_charged_twice() {
    let l = Ledger::new();
    let c = fresh();
    let hard = [Some(100), None, None];
    let e = l
        .reserve(&[part(&c, hard), part(&c, hard)], amt(60, 1, 0))
        .unwrap_err();
    assert_eq!(e.part, 1);
    assert_eq!(c.used(), Amount::ZERO);
    let r = l
        .reserve(&[part(&c, hard), part(&c, hard)], amt(50, 1, 0))
        .unwrap();
    assert_eq!(c.used(), amt(100, 2, 0));
    r.commit(amt(10, 1, 0));
    assert_eq!(c.committed(), amt(20, 2, 0));
    assert_eq!(c.reserved(), Amount::ZERO);
}

#[test]
fn reserved_tokens_total_tracks_reservations_in_flight_and_returns_to_zero() {
    let l = Ledger::new();
    let a = l.counter(&key(Scope::Consumer, "a"), i64::MAX);
    let b = l.counter(&key(Scope::Consumer, "b"), i64::MAX);
    let g = l.counter(&key(Scope::Global, "*"), i64::MAX);
    let mut held = Vec::new();
    let mut expect = 0;
    for i in 1..=20u64 {
        let who = if i % 2 == 0 { &a } else { &b };
        let r = l
            .reserve(
                &[part(who, unlimited()), part(&g, unlimited())],
                amt(i * 10, 1, i),
            )
            .unwrap();
        expect += i * 10;
        held.push(r);
        // The total counts each reservation once, not once per counter.
        assert_eq!(l.reserved_tokens(), expect);
    }
    assert_eq!(g.reserved().tokens, expect);
    // A refused reservation does not touch the total.
    assert!(l
        .reserve(&[part(&g, [Some(1), None, None])], amt(5, 1, 0))
        .is_err());
    assert_eq!(l.reserved_tokens(), expect);
    for (i, r) in held.into_iter().enumerate() {
        let t = r.amount().tokens;
        match i % 3 {
            0 => assert_eq!(r.commit(amt(t / 2, 1, 0)).len(), 2),
            1 => r.release(),
            _ => drop(r),
        }
        expect -= t;
        assert_eq!(l.reserved_tokens(), expect);
    }
    assert_eq!(l.reserved_tokens(), 0);
    for c in [&a, &b, &g] {
        assert_eq!(c.reserved(), Amount::ZERO);
    }
    assert_eq!(
        g.committed(),
        amt(a.committed().tokens + b.committed().tokens, 7, 0)
    );
}

// ---------------------------------------------------------------------------------------
// the map: counters, snapshot

#[test]
fn counter_is_shared_per_key_and_expiry_is_set_on_creation_only() {
    let l = Ledger::new();
    let k = wkey(Scope::Consumer, "a", 100);
    let c1 = l.counter(&k, 5_000);
    let c2 = l.counter(&k, 9_000);
    assert!(Arc::ptr_eq(&c1, &c2));
    assert_eq!(c2.expires_at(), 5_000);
    assert!(Arc::ptr_eq(&l.get(&k).unwrap(), &c1));
    // Another window of the same consumer is another counter.
    let other = l.counter(&wkey(Scope::Consumer, "a", 200), 9_000);
    assert!(!Arc::ptr_eq(&c1, &other));
    assert_eq!(l.counter_count(), 2);
    l.remove(&k);
    assert!(l.get(&k).is_none());
    assert_eq!(l.counter_count(), 1);
}

#[test]
fn snapshot_lists_committed_and_reserved_per_key() {
    let l = Ledger::new();
    let ka = key(Scope::Consumer, "a");
    let kb = key(Scope::Backend, "b");
    let a = l.counter(&ka, i64::MAX);
    let b = l.counter(&kb, i64::MAX);
    a.add_committed(&amt(5, 1, 50));
    let _r = l.reserve(&[part(&b, unlimited())], amt(9, 1, 90)).unwrap();
    let mut snap = l.snapshot();
    snap.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        snap,
        vec![
            (ka, amt(5, 1, 50), Amount::ZERO),
            (kb, Amount::ZERO, amt(9, 1, 90))
        ]
    );
}

// ---------------------------------------------------------------------------------------
// job ledgers

#[test]
fn job_attempts_are_capped_and_never_given_back() {
    let j = JobLedger::new(0, 0, 0);
    assert!(j.try_take_attempt(3));
    assert!(j.try_take_attempt(3));
    assert!(j.try_take_attempt(3));
    assert!(!j.try_take_attempt(3));
    assert_eq!(j.attempts(), 3);
    // A larger cap (policy reload) allows more.
    assert!(j.try_take_attempt(4));
    assert!(!j.try_take_attempt(4));
    assert_eq!(j.attempts(), 4);
    // A cap of zero allows none.
    assert!(!JobLedger::new(0, 0, 0).try_take_attempt(0));
}

#[test]
fn job_fallbacks_are_capped_and_can_be_returned() {
    let j = JobLedger::new(0, 1, 0);
    assert!(j.try_take_fallback(2));
    assert!(!j.try_take_fallback(2));
    assert_eq!(j.fallbacks(), 2);
    j.return_fallback();
    assert_eq!(j.fallbacks(), 1);
    assert!(j.try_take_fallback(2));
    j.return_fallback();
    j.return_fallback();
    j.return_fallback(); // never below zero
    assert_eq!(j.fallbacks(), 0);
    assert_eq!(j.attempts(), 0);
}

#[test]
fn job_caps_hold_under_contention() {
    let j = Arc::new(JobLedger::new(0, 0, 0));
    let won: u32 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let j = j.clone();
                s.spawn(move || (0..1_000).filter(|_| j.try_take_attempt(1_500)).count() as u32)
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(won, 1_500);
    assert_eq!(j.attempts(), 1_500);
}

#[test]
fn ledger_job_is_created_once_seeded_and_touched() {
    let l = Ledger::new();
    let id: Arc<str> = Arc::from("job-1");
    let j = l.job(&id, 1_000);
    assert_eq!((j.attempts(), j.fallbacks(), j.last_seen()), (0, 0, 1_000));
    assert!(j.try_take_attempt(5));
    let j2 = l.job(&id, 2_000);
    assert!(Arc::ptr_eq(&j, &j2));
    assert_eq!(j2.attempts(), 1);
    assert_eq!(j.last_seen(), 2_000);
    // Touching with an older time does not move last_seen back.
    l.job(&id, 1_500);
    assert_eq!(j.last_seen(), 2_000);
    assert_eq!(l.job_count(), 1);

    l.set_job(Arc::from("job-2"), 3, 1, 500);
    let j3 = l.job(&Arc::from("job-2"), 600);
    assert_eq!((j3.attempts(), j3.fallbacks(), j3.last_seen()), (3, 1, 600));
    assert!(!j3.try_take_attempt(3));
    assert_eq!(l.job_count(), 2);
}

// ---------------------------------------------------------------------------------------
// sweep

#[test]
fn sweep_drops_ended_windows_and_keeps_current_ones() {
    let l = Ledger::new();
    let ended = wkey(Scope::Consumer, "a", 0);
    let ends_now = wkey(Scope::Consumer, "b", 0);
    let current = wkey(Scope::Consumer, "c", 0);
    let forever = key(Scope::Global, "*");
    l.counter(&ended, 1_000).add_committed(&amt(1, 1, 1));
    l.counter(&ends_now, 2_000);
    l.counter(&current, 2_001);
    l.counter(&forever, i64::MAX);
    l.sweep(2_000, 60_000);
    assert!(l.get(&ended).is_none());
    assert!(
        l.get(&ends_now).is_none(),
        "a window ending at `now` has ended"
    );
    assert!(l.get(&current).is_some());
    assert!(l.get(&forever).is_some());
    assert_eq!(l.counter_count(), 2);
}

#[test]
fn sweep_keeps_ended_counters_that_hold_a_reservation() {
    let l = Ledger::new();
    let k = wkey(Scope::Consumer, "a", 0);
    let c = l.counter(&k, 1_000);
    let r = l.reserve(&[part(&c, unlimited())], amt(10, 1, 1)).unwrap();
    l.sweep(5_000, 60_000);
    assert!(
        l.get(&k).is_some(),
        "a counter with a call in flight must survive the sweep"
    );
    r.commit(amt(4, 1, 1));
    assert_eq!(l.get(&k).unwrap().committed(), amt(4, 1, 1));
    l.sweep(5_000, 60_000);
    assert!(l.get(&k).is_none());
}

#[test]
fn sweep_drops_idle_jobs_with_their_counters() {
    let l = Ledger::new();
    let idle: Arc<str> = Arc::from("idle");
    let busy: Arc<str> = Arc::from("busy");
    l.job(&idle, 0);
    l.job(&busy, 0);
    l.counter(&key(Scope::Job, "idle"), i64::MAX)
        .add_committed(&amt(10, 1, 1));
    l.counter(&key(Scope::Job, "busy"), i64::MAX)
        .add_committed(&amt(10, 1, 1));
    l.job(&busy, 9_000);
    l.sweep(10_000, 5_000);
    assert_eq!(l.job_count(), 1);
    assert!(l.get(&key(Scope::Job, "idle")).is_none());
    assert!(l.get(&key(Scope::Job, "busy")).is_some());
    // Exactly at the ttl the job is still kept.
    l.sweep(14_000, 5_000);
    assert_eq!(l.job_count(), 1);
    l.sweep(14_001, 5_000);
    assert_eq!(l.job_count(), 0);
    assert_eq!(l.counter_count(), 0);
}

#[test]
fn sweep_keeps_an_idle_job_whose_counter_holds_a_reservation() {
    let l = Ledger::new();
    let id: Arc<str> = Arc::from("long-call");
    let k = key(Scope::Job, "long-call");
    l.job(&id, 0);
    let c = l.counter(&k, i64::MAX);
    let r = l.reserve(&[part(&c, unlimited())], amt(10, 1, 1)).unwrap();
    l.sweep(100_000, 5_000);
    assert!(l.get(&k).is_some());
    r.commit(amt(3, 1, 1));
    // Once settled, the next sweep drops the idle job and its counter: nothing leaks.
    l.sweep(100_000, 5_000);
    assert!(l.get(&k).is_none());
    assert_eq!(l.job_count(), 0);
    assert_eq!(l.counter_count(), 0);
}

#[test]
fn forget_job_drops_the_job_and_its_idle_counter() {
    let l = Ledger::new();
    let id: Arc<str> = Arc::from("one-shot");
    let k = key(Scope::Job, "one-shot");
    l.job(&id, 0);
    let c = l.counter(&k, i64::MAX);
    let r = l.reserve(&[part(&c, unlimited())], amt(10, 1, 1)).unwrap();
    r.commit(amt(4, 1, 1));
    l.forget_job(&id);
    assert_eq!(l.job_count(), 0);
    assert!(l.get(&k).is_none());
    // A reservation still held (a concurrent request reusing the id) keeps its own Arc of the
    // counter: the map entry goes at once, nothing is left behind, and the guard still settles.
    l.job(&id, 0);
    let c = l.counter(&k, i64::MAX);
    let r = l.reserve(&[part(&c, unlimited())], amt(10, 1, 1)).unwrap();
    l.forget_job(&id);
    assert!(l.get(&k).is_none());
    assert_eq!(l.reserved_tokens(), 10);
    drop(r);
    assert_eq!(l.reserved_tokens(), 0);
    assert_eq!(c.reserved(), Amount::ZERO);
}

// ---------------------------------------------------------------------------------------
// windows

fn tz(name: &str) -> TimeZone {
    TimeZone::get(name).unwrap()
}

/// Milliseconds of an RFC 3339 instant.
fn ms(s: &str) -> Millis {
    s.parse::<Timestamp>().unwrap().as_millisecond()
}

fn secs(s: &str) -> i64 {
    ms(s) / 1000
}

/// Asserts the window of kind `w` at `now` starts at `start` and ends at `end` (RFC 3339),
/// through all three entry points.
fn check(zone: &TimeZone, w: Window, now: &str, start: &str, end: &str) {
    let now = ms(now);
    let k = window_at(zone, w, now);
    assert_eq!(
        k,
        WindowKey {
            window: w,
            start: secs(start)
        },
        "start of {w} at {now}"
    );
    assert_eq!(window_end(zone, k), ms(end), "end of {w} at {now}");
    let set = WindowSet::at(zone, now);
    assert_eq!(set.key(w), k);
    assert_eq!(set.end(w), ms(end));
}

#[test]
fn utc_windows() {
    let z = TimeZone::UTC;
    let now = "2024-02-29T13:45:30.250Z";
    check(
        &z,
        Window::Minute,
        now,
        "2024-02-29T13:45:00Z",
        "2024-02-29T13:46:00Z",
    );
    check(
        &z,
        Window::Hour,
        now,
        "2024-02-29T13:00:00Z",
        "2024-02-29T14:00:00Z",
    );
    check(
        &z,
        Window::Day,
        now,
        "2024-02-29T00:00:00Z",
        "2024-03-01T00:00:00Z",
    );
    check(
        &z,
        Window::Month,
        now,
        "2024-02-01T00:00:00Z",
        "2024-03-01T00:00:00Z",
    );
    // Year rollover.
    check(
        &z,
        Window::Month,
        "2024-12-31T23:59:59.999Z",
        "2024-12-01T00:00:00Z",
        "2025-01-01T00:00:00Z",
    );
    check(
        &z,
        Window::Day,
        "2024-12-31T23:59:59.999Z",
        "2024-12-31T00:00:00Z",
        "2025-01-01T00:00:00Z",
    );
    // A boundary instant belongs to the window it starts.
    check(
        &z,
        Window::Hour,
        "2024-03-01T00:00:00Z",
        "2024-03-01T00:00:00Z",
        "2024-03-01T01:00:00Z",
    );
    check(
        &z,
        Window::Month,
        "2024-03-01T00:00:00Z",
        "2024-03-01T00:00:00Z",
        "2024-04-01T00:00:00Z",
    );
    check(
        &z,
        Window::Minute,
        "2024-03-01T00:00:59.999Z",
        "2024-03-01T00:00:00Z",
        "2024-03-01T00:01:00Z",
    );
    // Before the epoch too.
    check(
        &z,
        Window::Minute,
        "1969-12-31T23:59:30.5Z",
        "1969-12-31T23:59:00Z",
        "1970-01-01T00:00:00Z",
    );
}

#[test]
fn taipei_day_turns_over_at_1600_utc() {
    let z = tz("Asia/Taipei"); // UTC+8, no DST
    check(
        &z,
        Window::Day,
        "2024-05-10T15:59:59Z",
        "2024-05-09T16:00:00Z",
        "2024-05-10T16:00:00Z",
    );
    check(
        &z,
        Window::Day,
        "2024-05-10T16:00:00Z",
        "2024-05-10T16:00:00Z",
        "2024-05-11T16:00:00Z",
    );
    check(
        &z,
        Window::Hour,
        "2024-05-10T16:30:00Z",
        "2024-05-10T16:00:00Z",
        "2024-05-10T17:00:00Z",
    );
    check(
        &z,
        Window::Minute,
        "2024-05-10T16:30:10Z",
        "2024-05-10T16:30:00Z",
        "2024-05-10T16:31:00Z",
    );
    // The month turns over at local midnight of the 1st: 16:00 UTC on the last day.
    check(
        &z,
        Window::Month,
        "2024-05-31T16:00:00Z",
        "2024-05-31T16:00:00Z",
        "2024-06-30T16:00:00Z",
    );
    check(
        &z,
        Window::Month,
        "2024-05-31T15:59:59Z",
        "2024-04-30T16:00:00Z",
        "2024-05-31T16:00:00Z",
    );
    // A day key differs from the UTC day key on either side of 16:00 UTC.
    assert_ne!(
        window_at(&z, Window::Day, ms("2024-05-10T15:00:00Z")),
        window_at(&z, Window::Day, ms("2024-05-10T17:00:00Z"))
    );
    assert_eq!(
        window_at(&TimeZone::UTC, Window::Day, ms("2024-05-10T15:00:00Z")),
        window_at(&TimeZone::UTC, Window::Day, ms("2024-05-10T17:00:00Z"))
    );
}

#[test]
fn new_york_month_ends_at_local_midnight_in_either_offset() {
    let z = tz("America/New_York");
    // January (EST, -5) ends 2024-02-01 05:00 UTC.
    check(
        &z,
        Window::Month,
        "2024-01-31T23:00:00Z",
        "2024-01-01T05:00:00Z",
        "2024-02-01T05:00:00Z",
    );
    check(
        &z,
        Window::Month,
        "2024-02-01T04:59:59Z",
        "2024-01-01T05:00:00Z",
        "2024-02-01T05:00:00Z",
    );
    check(
        &z,
        Window::Month,
        "2024-02-01T05:00:00Z",
        "2024-02-01T05:00:00Z",
        "2024-03-01T05:00:00Z",
    );
    // March starts in EST and ends in EDT (-4): 31 days minus an hour.
    check(
        &z,
        Window::Month,
        "2024-03-15T12:00:00Z",
        "2024-03-01T05:00:00Z",
        "2024-04-01T04:00:00Z",
    );
    // November starts in EDT and ends in EST: 30 days plus an hour.
    check(
        &z,
        Window::Month,
        "2024-11-15T12:00:00Z",
        "2024-11-01T04:00:00Z",
        "2024-12-01T05:00:00Z",
    );
    // December ends at the new year's local midnight.
    check(
        &z,
        Window::Month,
        "2024-12-31T23:00:00Z",
        "2024-12-01T05:00:00Z",
        "2025-01-01T05:00:00Z",
    );
    check(
        &z,
        Window::Day,
        "2024-07-04T03:59:59Z",
        "2024-07-03T04:00:00Z",
        "2024-07-04T04:00:00Z",
    );
}

#[test]
fn berlin_dst_days_are_23_and_25_hours_long() {
    let z = tz("Europe/Berlin");
    // 2024-03-31: clocks go 02:00 CET -> 03:00 CEST. The day runs 23:00Z .. 22:00Z.
    let k = window_at(&z, Window::Day, ms("2024-03-31T12:00:00Z"));
    assert_eq!(k.start, secs("2024-03-30T23:00:00Z"));
    let end = window_end(&z, k);
    assert_eq!(end, ms("2024-03-31T22:00:00Z"));
    assert_eq!(end - k.start * 1000, 23 * 3_600_000);
    // 2024-10-27: clocks go 03:00 CEST -> 02:00 CET. The day is 25 hours long.
    let k = window_at(&z, Window::Day, ms("2024-10-27T12:00:00Z"));
    assert_eq!(k.start, secs("2024-10-26T22:00:00Z"));
    assert_eq!(window_end(&z, k) - k.start * 1000, 25 * 3_600_000);
    // An ordinary day is 24 hours.
    let k = window_at(&z, Window::Day, ms("2024-06-01T12:00:00Z"));
    assert_eq!(window_end(&z, k) - k.start * 1000, 24 * 3_600_000);
}

#[test]
fn berlin_hours_around_the_spring_gap() {
    let z = tz("Europe/Berlin");
    // 01:xx CET is 00:xx UTC and ends at the gap (02:00 CET == 03:00 CEST == 01:00Z).
    check(
        &z,
        Window::Hour,
        "2024-03-31T00:30:00Z",
        "2024-03-31T00:00:00Z",
        "2024-03-31T01:00:00Z",
    );
    // 03:xx CEST starts right after the gap.
    check(
        &z,
        Window::Hour,
        "2024-03-31T01:00:00Z",
        "2024-03-31T01:00:00Z",
        "2024-03-31T02:00:00Z",
    );
    check(
        &z,
        Window::Minute,
        "2024-03-31T00:59:30Z",
        "2024-03-31T00:59:00Z",
        "2024-03-31T01:00:00Z",
    );
    check(
        &z,
        Window::Minute,
        "2024-03-31T01:00:30Z",
        "2024-03-31T01:00:00Z",
        "2024-03-31T01:01:00Z",
    );
}

#[test]
fn new_york_fold_minutes_are_distinct_windows_that_contain_now() {
    // 2024-11-03: 01:59:59 EDT -> 01:00:00 EST; local 01:xx happens twice.
    let z = tz("America/New_York");
    // First pass (EDT, -4).
    check(
        &z,
        Window::Minute,
        "2024-11-03T05:30:10Z",
        "2024-11-03T05:30:00Z",
        "2024-11-03T05:31:00Z",
    );
    // Its last minute ends at the transition, not at the next civil 02:00.
    check(
        &z,
        Window::Minute,
        "2024-11-03T05:59:10Z",
        "2024-11-03T05:59:00Z",
        "2024-11-03T06:00:00Z",
    );
    // Second pass (EST, -5): the same civil minute is a new window, an hour later.
    check(
        &z,
        Window::Minute,
        "2024-11-03T06:30:10Z",
        "2024-11-03T06:30:00Z",
        "2024-11-03T06:31:00Z",
    );
    check(
        &z,
        Window::Minute,
        "2024-11-03T06:00:00Z",
        "2024-11-03T06:00:00Z",
        "2024-11-03T06:01:00Z",
    );
    // The civil hour 01:00 spans both passes: one window of two hours.
    check(
        &z,
        Window::Hour,
        "2024-11-03T05:10:00Z",
        "2024-11-03T05:00:00Z",
        "2024-11-03T07:00:00Z",
    );
    check(
        &z,
        Window::Hour,
        "2024-11-03T06:50:00Z",
        "2024-11-03T05:00:00Z",
        "2024-11-03T07:00:00Z",
    );
    // The day is 25 hours.
    check(
        &z,
        Window::Day,
        "2024-11-03T12:00:00Z",
        "2024-11-03T04:00:00Z",
        "2024-11-04T05:00:00Z",
    );
}

#[test]
fn half_hour_zones_and_odd_transitions() {
    // India: +05:30 all year, hours turn over at :30 UTC.
    let z = tz("Asia/Kolkata");
    check(
        &z,
        Window::Hour,
        "2024-01-01T10:29:59Z",
        "2024-01-01T09:30:00Z",
        "2024-01-01T10:30:00Z",
    );
    check(
        &z,
        Window::Day,
        "2024-01-01T18:29:59Z",
        "2023-12-31T18:30:00Z",
        "2024-01-01T18:30:00Z",
    );
    // Lord Howe: +10:30 <-> +11, a half-hour DST. On 2024-10-06 02:00 +10:30 -> 02:30 +11
    // (15:30Z); the civil hour 02:xx starts right after the gap and ends at 03:00 +11.
    let z = tz("Australia/Lord_Howe");
    check(
        &z,
        Window::Hour,
        "2024-10-05T15:45:00Z",
        "2024-10-05T15:30:00Z",
        "2024-10-05T16:00:00Z",
    );
    check(
        &z,
        Window::Hour,
        "2024-10-05T15:10:00Z",
        "2024-10-05T14:30:00Z",
        "2024-10-05T15:30:00Z",
    );
    // Samoa skipped 2011-12-30 entirely: the 29th is followed by the 31st.
    let z = tz("Pacific/Apia");
    let k = window_at(&z, Window::Day, ms("2011-12-30T09:00:00Z")); // 23:00 on the 29th (-10)
    let end = window_end(&z, k);
    let next = window_at(&z, Window::Day, end);
    assert_eq!(next.start * 1000, end);
    assert_eq!(window_end(&z, next) - end, 24 * 3_600_000);
}

/// Windows partition time: every instant lies in exactly one window, the window ending at
/// `end` is followed by one starting at `end`, and all entry points agree.
#[test]
fn windows_tile_time_across_dst_transitions() {
    let cases = [
        ("UTC", "2024-02-28T00:00:00Z"),
        ("Asia/Taipei", "2024-05-30T00:00:00Z"),
        ("Europe/Berlin", "2024-03-30T12:00:00Z"),
        ("Europe/Berlin", "2024-10-26T12:00:00Z"),
        ("America/New_York", "2024-03-09T12:00:00Z"),
        ("America/New_York", "2024-11-02T12:00:00Z"),
        ("Australia/Lord_Howe", "2024-04-06T00:00:00Z"),
        ("Australia/Lord_Howe", "2024-10-05T00:00:00Z"),
        ("America/Havana", "2024-11-02T12:00:00Z"), // 01:00 CDT -> 00:00 CST: midnight twice
        ("America/Sao_Paulo", "2018-11-03T12:00:00Z"), // 00:00 -> 01:00: midnight skipped
        ("America/Santiago", "2024-04-06T12:00:00Z"),
        ("Asia/Kathmandu", "2024-01-01T00:00:00Z"),
        ("Pacific/Apia", "2011-12-29T00:00:00Z"),
    ];
    for (name, from) in cases {
        let z = tz(name);
        let from = ms(from);
        // Every 7 minutes 13 seconds over 2 days, plus every boundary found on the way.
        let mut t = from;
        while t < from + 2 * 86_400_000 {
            let set = WindowSet::at(&z, t);
            for w in [Window::Minute, Window::Hour, Window::Day, Window::Month] {
                let k = window_at(&z, w, t);
                let end = window_end(&z, k);
                assert!(
                    k.start * 1000 <= t && t < end,
                    "{name} {w} at {t}: {k:?} .. {end}"
                );
                assert_eq!(set.key(w), k, "{name} {w} at {t}");
                assert_eq!(set.end(w), end, "{name} {w} at {t}");
                let next = window_at(&z, w, end);
                assert_eq!(
                    next.start * 1000,
                    end,
                    "{name} {w}: next window starts at the end"
                );
                assert_eq!(
                    window_at(&z, w, end - 1),
                    k,
                    "{name} {w}: last ms is still inside"
                );
                assert_eq!(
                    window_at(&z, w, k.start * 1000),
                    k,
                    "{name} {w}: first ms is inside"
                );
                let len = end - k.start * 1000;
                let (lo, hi) = match w {
                    Window::Minute => (1, 60_000),
                    Window::Hour => (1, 2 * 3_600_000),
                    Window::Day => (1, 26 * 3_600_000),
                    Window::Month => (27 * 86_400_000, 32 * 86_400_000),
                };
                assert!((lo..=hi).contains(&len), "{name} {w} at {t}: length {len}");
            }
            t += 433_000;
        }
    }
}

/// Every zone in the bundled database, around its transitions (modern and historical ones,
/// including odd offsets in seconds): windows contain the instant, follow each other without
/// gap or overlap, and agree between the three entry points.
#[test]
fn windows_tile_time_around_transitions_in_every_zone() {
    let names: Vec<String> = jiff::tz::db().available().map(|n| n.to_string()).collect();
    assert!(names.len() > 300, "bundled tz database expected");
    let mut checked = 0u64;
    for name in &names {
        let z = tz(name);
        let mut instants = Vec::new();
        for from in [
            "1900-01-01T00:00:00Z",
            "1975-01-01T00:00:00Z",
            "2024-01-01T00:00:00Z",
        ] {
            for t in z.following(from.parse().unwrap()).take(2) {
                let t = t.timestamp().as_millisecond();
                for d in [
                    -3_600_000, -60_000, -1_000, -1, 0, 1, 59_999, 1_800_000, 5_400_000,
                ] {
                    instants.push(t + d);
                }
            }
        }
        for t in instants {
            let set = WindowSet::at(&z, t);
            for w in [Window::Minute, Window::Hour, Window::Day, Window::Month] {
                let k = window_at(&z, w, t);
                let end = window_end(&z, k);
                assert!(
                    k.start * 1000 <= t && t < end,
                    "{name} {w} at {t}: {k:?} .. {end}"
                );
                assert_eq!((set.key(w), set.end(w)), (k, end), "{name} {w} at {t}");
                assert_eq!(
                    window_at(&z, w, end).start * 1000,
                    end,
                    "{name} {w} at {t}: next starts at end"
                );
                assert_eq!(
                    window_at(&z, w, end - 1),
                    k,
                    "{name} {w} at {t}: last ms inside"
                );
                assert_eq!(
                    window_at(&z, w, k.start * 1000),
                    k,
                    "{name} {w} at {t}: first ms inside"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 10_000);
}

#[test]
fn mirroring_shared_totals_keeps_local_reservations_counted() {
    let c = Counter::new(i64::MAX);
    c.add_committed(&amt(100, 2, 10));
    c.try_reserve(&amt(30, 1, 5), &unlimited()).unwrap();
    // Another replica committed more: the store reports 250.
    c.mirror_committed(&amt(250, 5, 40));
    assert_eq!(c.committed(), amt(250, 5, 40));
    assert_eq!(c.reserved(), amt(30, 1, 5), "the local hold is still there");
    // And a lower report (a fresh Redis) lowers it without touching the hold.
    c.mirror_committed(&amt(0, 0, 0));
    assert_eq!(c.committed(), Amount::ZERO);
    assert_eq!(c.used(), amt(30, 1, 5));
    c.commit(&amt(30, 1, 5), &amt(12, 1, 2));
    assert_eq!(c.committed(), amt(12, 1, 2));
    assert_eq!(c.reserved(), Amount::ZERO);
}

#[test]
fn job_keys_join_consumer_and_job_at_every_length() {
    for (c, j) in [
        ("", ""),
        ("team-a", "job-1"),
        ("ünï", "çødé"),
        (&*"c".repeat(63), &*"j".repeat(64)),
        (&*"c".repeat(64), &*"j".repeat(64)),
        (&*"c".repeat(500), "j"),
    ] {
        let k = crate::ledger::job_key(c, j);
        assert_eq!(&*k, format!("{c}#{j}"));
        assert_eq!(crate::ledger::job_of_key(&k), j);
    }
}
