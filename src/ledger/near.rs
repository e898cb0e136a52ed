//! Each thread's memo of the counters it used last: a request touches the same few counters
//! as the one before it (its consumer's, its team's, the global ones, its backend's), and
//! finding each in the ledger's map costs a hash of its key, a shard's read lock and a probe
//! (~220 instructions a counter). A slot per bound (the caller says which) keeps the key and
//! the counter it resolved to; the next request with an equal key gets the counter with a
//! comparison.
//!
//! A counter the map lets go of (a window that ended, an idle job, a removal) is marked
//! evicted and never handed out from a slot again: the map is looked up anew, as before. A
//! slot also names its ledger by a process-unique id, so a counter of another ledger is never
//! returned. Nothing here is shared between threads: no lock, no atomic but the counter's
//! own reference count.

use super::{Counter, CounterKey, Ledger};
use std::cell::RefCell;
use std::sync::Arc;

/// Slots per thread: bounds past it are looked up in the map every time.
const SLOTS: usize = 256;

struct Slot {
    ledger: u64,
    key: CounterKey,
    counter: Arc<Counter>,
}

thread_local! {
    static NEAR: RefCell<Vec<Option<Slot>>> = const { RefCell::new(Vec::new()) };
}

/// The same id: the same `Arc` (a policy's or a key's string), or equal text.
fn same_id(a: &Arc<str>, b: &Arc<str>) -> bool {
    Arc::ptr_eq(a, b) || **a == **b
}

/// The counter of `key` in `ledger`: from this thread's slot `slot` when it holds that key's
/// counter and the map still does, else `lookup()`'s (which then takes the slot).
pub(super) fn counter(
    ledger: &Ledger,
    slot: usize,
    key: &CounterKey,
    lookup: impl FnOnce() -> Arc<Counter>,
) -> Arc<Counter> {
    if slot >= SLOTS {
        return lookup();
    }
    NEAR.with(|near| {
        let Ok(mut near) = near.try_borrow_mut() else {
            return lookup();
        };
        if let Some(Some(s)) = near.get(slot) {
            if s.ledger == ledger.id
                && s.key.scope == key.scope
                && s.key.window == key.window
                && same_id(&s.key.id, &key.id)
                && !s.counter.is_evicted()
            {
                return s.counter.clone();
            }
        }
        let c = lookup();
        if near.len() <= slot {
            near.resize_with(slot + 1, || None);
        }
        near[slot] = Some(Slot {
            ledger: ledger.id,
            key: key.clone(),
            counter: c.clone(),
        });
        c
    })
}

#[cfg(test)]
mod tests {
    use super::super::{CounterKey, Ledger, WindowKey};
    use crate::units::{Amount, Scope, Window};
    use std::sync::Arc;

    fn key(scope: Scope, id: &str, start: Option<i64>) -> CounterKey {
        CounterKey {
            scope,
            id: Arc::from(id),
            window: start.map(|start| WindowKey {
                window: Window::Minute,
                start,
            }),
        }
    }

    #[test]
    fn a_slot_hands_out_the_maps_counter_for_an_equal_key_only() {
        let l = Ledger::new();
        let a = key(Scope::Consumer, "a", Some(0));
        let c = l.counter_near(0, &a, 60_000);
        // An equal key in another `Arc`: the same counter, the one the map holds.
        let again = l.counter_near(0, &key(Scope::Consumer, "a", Some(0)), 60_000);
        assert!(Arc::ptr_eq(&c, &again));
        assert!(Arc::ptr_eq(&c, &l.get(&a).unwrap()));
        // Another id, scope or window in the same slot: its own counter.
        for other in [
            key(Scope::Consumer, "b", Some(0)),
            key(Scope::Team, "a", Some(0)),
            key(Scope::Consumer, "a", Some(60_000)),
            key(Scope::Consumer, "a", None),
        ] {
            let o = l.counter_near(0, &other, 60_000);
            assert!(!Arc::ptr_eq(&c, &o), "{other:?}");
            assert!(Arc::ptr_eq(&o, &l.get(&other).unwrap()));
        }
    }

    #[test]
    fn a_counter_the_map_let_go_of_is_never_handed_out_again() {
        let l = Ledger::new();
        let a = key(Scope::Consumer, "a", Some(0));
        let old = l.counter_near(3, &a, 60_000);
        old.add_committed(&Amount {
            tokens: 5,
            requests: 1,
            usd: 0,
        });
        // The window ended: the sweep drops it from the map.
        l.sweep(120_000, 1);
        assert!(l.get(&a).is_none());
        let new = l.counter_near(3, &a, 60_000);
        assert!(!Arc::ptr_eq(&old, &new));
        assert_eq!(new.committed(), Amount::ZERO);
        assert!(Arc::ptr_eq(&new, &l.get(&a).unwrap()));
        // Removed by key (state reset): the same.
        l.remove(&a);
        let newer = l.counter_near(3, &a, 60_000);
        assert!(!Arc::ptr_eq(&new, &newer));
        assert!(Arc::ptr_eq(&newer, &l.get(&a).unwrap()));
        // A forgotten job's counter too.
        let j = key(Scope::Job, "c\u{1f}j", None);
        let jc = l.counter_near(4, &j, i64::MAX);
        l.forget_job(&j.id);
        assert!(!Arc::ptr_eq(&jc, &l.counter_near(4, &j, i64::MAX)));
    }

    #[test]
    fn another_ledger_never_gets_this_ones_counter() {
        let (l1, l2) = (Ledger::new(), Ledger::new());
        let a = key(Scope::Global, "global", None);
        let c1 = l1.counter_near(0, &a, i64::MAX);
        let c2 = l2.counter_near(0, &a, i64::MAX);
        assert!(!Arc::ptr_eq(&c1, &c2));
        assert!(Arc::ptr_eq(&c2, &l2.get(&a).unwrap()));
        assert!(Arc::ptr_eq(&c1, &l1.counter_near(0, &a, i64::MAX)));
    }

    #[test]
    fn slots_past_the_last_are_plain_look_ups() {
        let l = Ledger::new();
        let a = key(Scope::Consumer, "a", None);
        let c = l.counter_near(super::SLOTS + 5, &a, i64::MAX);
        assert!(Arc::ptr_eq(&c, &l.get(&a).unwrap()));
    }
}
