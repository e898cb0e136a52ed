//! Property tests of the ledger: random interleavings of reserve / commit / release / drop
//! against 1–4 counters with random hard limits, checked step by step against a model.
//!
//! After every step, for every counter: `committed + reserved <= hard` in every limited
//! dimension, `reserved` equals the sum of the outstanding reservations on it, `committed`
//! equals the sum of what was committed on it, and `reserved_tokens()` equals the tokens of
//! the outstanding reservations. A reservation must succeed exactly when the model says it
//! fits on every part, and a refusal must name the first part and dimension that does not.

#![allow(clippy::needless_range_loop)] // per-dimension loops over [u64; 3] read best indexed

use proptest::prelude::*;
use std::sync::Arc;
use tollgate::ledger::*;
use tollgate::units::*;

const MAX_COUNTERS: usize = 4;

#[derive(Debug, Clone)]
enum Op {
    /// Reserve `amount` on the distinct counters named (in this order).
    Reserve { parts: Vec<usize>, amount: [u64; 3] },
    /// Commit outstanding reservation `pick % len`, actual = reserved * frac / 1000 per dim.
    Commit { pick: usize, frac: [u64; 3] },
    /// `Reservation::release` on outstanding reservation `pick % len`.
    Release { pick: usize },
    /// Drop outstanding reservation `pick % len` (the guard's release path).
    Drop { pick: usize },
}

#[derive(Debug, Clone)]
struct Setup {
    hard: Vec<[Option<u64>; 3]>,
    /// Committed usage booked before the run, as thousandths of the hard limit (or absolute
    /// when unlimited).
    seed: Vec<[u64; 3]>,
}

fn hard_limit(max: u64) -> impl Strategy<Value = Option<u64>> {
    prop_oneof![1 => Just(None), 4 => (0..=max).prop_map(Some)]
}

fn setup() -> impl Strategy<Value = Setup> {
    (1..=MAX_COUNTERS).prop_flat_map(|n| {
        let hard =
            prop::collection::vec([hard_limit(10_000), hard_limit(12), hard_limit(20_000)], n);
        let seed = prop::collection::vec([0..=600u64, 0..=600u64, 0..=600u64], n);
        (hard, seed).prop_map(|(hard, seed)| Setup { hard, seed })
    })
}

fn op() -> impl Strategy<Value = Op> {
    let parts = prop::collection::vec(0..MAX_COUNTERS, 1..=3).prop_map(|mut v| {
        let mut seen = [false; MAX_COUNTERS];
        v.retain(|&i| !std::mem::replace(&mut seen[i], true));
        v
    });
    // Mostly small amounts, sometimes zero in a dimension, sometimes large.
    let dim = |small: u64, big: u64| prop_oneof![1 => Just(0u64), 6 => 0..=small, 1 => 0..=big];
    let amount = [dim(1_500, 12_000), dim(2, 15), dim(3_000, 25_000)];
    prop_oneof![
        5 => (parts, amount).prop_map(|(parts, amount)| Op::Reserve { parts, amount }),
        2 => (any::<usize>(), [0..=1000u64, 0..=1000u64, 0..=1000u64])
            .prop_map(|(pick, frac)| Op::Commit { pick, frac }),
        1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Drop { pick }),
    ]
}

/// Model of one counter.
#[derive(Debug, Clone, Copy, Default)]
struct Model {
    committed: [u64; 3],
    reserved: [u64; 3],
}

struct Outstanding {
    res: Reservation,
    parts: Vec<usize>,
    amount: [u64; 3],
}

struct World {
    ledger: Ledger,
    counters: Vec<Arc<Counter>>,
    hard: Vec<[Option<u64>; 3]>,
    model: Vec<Model>,
    out: Vec<Outstanding>,
}

impl World {
    fn new(s: &Setup) -> Self {
        let ledger = Ledger::new();
        let n = s.hard.len();
        let mut counters = Vec::new();
        let mut model = vec![Model::default(); n];
        for i in 0..n {
            let key = CounterKey {
                scope: Scope::Consumer,
                id: Arc::from(format!("c{i}")),
                window: None,
            };
            let c = ledger.counter(&key, i64::MAX);
            let seed: [u64; 3] = std::array::from_fn(|d| match s.hard[i][d] {
                Some(h) => h * s.seed[i][d] / 1000,
                None => s.seed[i][d],
            });
            c.add_committed(&Amount::from_array(seed));
            model[i].committed = seed;
            counters.push(c);
        }
        World {
            ledger,
            counters,
            hard: s.hard.clone(),
            model,
            out: Vec::new(),
        }
    }

    /// The refusal the model predicts for `amount` on `parts`, if any.
    fn predict(&self, parts: &[usize], amount: [u64; 3]) -> Option<Refusal> {
        for (pi, &ci) in parts.iter().enumerate() {
            let m = &self.model[ci];
            for (d, dim) in Dim::ALL.iter().enumerate() {
                let used = m.committed[d] + m.reserved[d];
                if amount[d] == 0 {
                    continue;
                }
                if let Some(h) = self.hard[ci][d] {
                    if used + amount[d] > h {
                        return Some(Refusal {
                            part: pi,
                            refusal: DimRefusal {
                                dim: *dim,
                                used,
                                hard: h,
                            },
                        });
                    }
                }
            }
        }
        None
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Reserve { parts, amount } => {
                let parts: Vec<usize> = parts
                    .iter()
                    .copied()
                    .filter(|&i| i < self.counters.len())
                    .collect();
                if parts.is_empty() {
                    return Ok(());
                }
                let rp: Vec<ReservePart> = parts
                    .iter()
                    .map(|&i| ReservePart {
                        counter: self.counters[i].clone(),
                        hard: self.hard[i],
                    })
                    .collect();
                let expect = self.predict(&parts, *amount);
                match (
                    self.ledger.reserve(&rp, Amount::from_array(*amount)),
                    expect,
                ) {
                    (Ok(res), None) => {
                        prop_assert_eq!(res.amount(), Amount::from_array(*amount));
                        for &i in &parts {
                            for d in 0..3 {
                                self.model[i].reserved[d] += amount[d];
                            }
                        }
                        self.out.push(Outstanding {
                            res,
                            parts,
                            amount: *amount,
                        });
                    }
                    (Err(got), Some(want)) => prop_assert_eq!(got, want),
                    (Ok(_), Some(want)) => {
                        prop_assert!(false, "reserved although {want:?} expected")
                    }
                    (Err(got), None) => {
                        prop_assert!(false, "refused with {got:?} although it fits")
                    }
                }
            }
            Op::Commit { pick, frac } => {
                if self.out.is_empty() {
                    return Ok(());
                }
                let o = self.out.swap_remove(pick % self.out.len());
                let actual: [u64; 3] = std::array::from_fn(|d| o.amount[d] * frac[d] / 1000);
                let want_before: Vec<Amount> = o
                    .parts
                    .iter()
                    .map(|&i| Amount::from_array(self.model[i].committed))
                    .collect();
                let before = o.res.commit(Amount::from_array(actual));
                prop_assert_eq!(before, want_before);
                for &i in &o.parts {
                    for d in 0..3 {
                        self.model[i].reserved[d] -= o.amount[d];
                        self.model[i].committed[d] += actual[d];
                    }
                }
            }
            Op::Release { pick } | Op::Drop { pick } => {
                if self.out.is_empty() {
                    return Ok(());
                }
                let o = self.out.swap_remove(pick % self.out.len());
                if matches!(op, Op::Release { .. }) {
                    o.res.release();
                } else {
                    drop(o.res);
                }
                for &i in &o.parts {
                    for d in 0..3 {
                        self.model[i].reserved[d] -= o.amount[d];
                    }
                }
            }
        }
        self.check()
    }

    fn check(&self) -> Result<(), TestCaseError> {
        for (i, c) in self.counters.iter().enumerate() {
            let (used, committed, reserved) = (c.used(), c.committed(), c.reserved());
            // reserved equals the sum of the outstanding reservations on this counter.
            let mut sum = [0u64; 3];
            for o in self.out.iter().filter(|o| o.parts.contains(&i)) {
                for d in 0..3 {
                    sum[d] += o.amount[d];
                }
            }
            prop_assert_eq!(reserved.as_array(), sum, "counter {} reserved", i);
            prop_assert_eq!(reserved.as_array(), self.model[i].reserved);
            prop_assert_eq!(
                committed.as_array(),
                self.model[i].committed,
                "counter {} committed",
                i
            );
            for d in 0..3 {
                prop_assert_eq!(
                    used.as_array()[d],
                    committed.as_array()[d] + reserved.as_array()[d]
                );
                if let Some(h) = self.hard[i][d] {
                    prop_assert!(
                        used.as_array()[d] <= h,
                        "counter {} dim {} used {:?} > hard {}",
                        i,
                        d,
                        used,
                        h
                    );
                }
            }
        }
        let tokens: u64 = self.out.iter().map(|o| o.amount[0]).sum();
        prop_assert_eq!(self.ledger.reserved_tokens(), tokens);
        Ok(())
    }
}

proptest! {
    // Failures are persisted next to this file: tests/ledger_props.proptest-regressions.
    #![proptest_config(ProptestConfig {
        cases: 1024,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    })]

    #[test]
    fn interleaved_operations_keep_the_books(
        setup in setup(),
        ops in prop::collection::vec(op(), 1..80),
        finish in prop::collection::vec((any::<bool>(), [0..=1000u64, 0..=1000u64, 0..=1000u64]), 80),
    ) {
        let mut w = World::new(&setup);
        w.check()?;
        for op in &ops {
            w.step(op)?;
        }
        // Settle everything still outstanding: commit or release, in random order.
        let mut k = 0;
        while !w.out.is_empty() {
            let (commit, frac) = finish[k % finish.len()];
            let pick = k * 7 + 3;
            let op = if commit { Op::Commit { pick, frac } } else { Op::Release { pick } };
            w.step(&op)?;
            k += 1;
        }
        for c in &w.counters {
            prop_assert_eq!(c.reserved(), Amount::ZERO);
            prop_assert_eq!(c.used(), c.committed());
        }
        prop_assert_eq!(w.ledger.reserved_tokens(), 0);
    }
}
