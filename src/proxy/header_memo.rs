//! Header values that repeat from answer to answer, kept per thread: the last value made for a
//! key is handed out again (a clone of its shared bytes) while the key stays the same, instead
//! of being formatted, validated and allocated anew on every answer. [`listed`] keeps a few
//! keys' values at once, for pieces that alternate (upstream URLs, bound names).

use http::HeaderValue;
use std::cell::RefCell;
use std::thread::LocalKey;

/// One memo: the last key and the value made for it.
pub(crate) type Slot<K> = RefCell<Option<(K, HeaderValue)>>;

/// The value for the key `same` accepts: the memo's when its key is accepted, else `make`'s
/// (a key and its value; `None`: no value), which the memo then keeps.
pub(crate) fn value<K: 'static>(
    slot: &'static LocalKey<Slot<K>>,
    same: impl Fn(&K) -> bool,
    make: impl FnOnce() -> Option<(K, HeaderValue)>,
) -> Option<HeaderValue> {
    let hit = slot
        .try_with(|s| match &*s.borrow() {
            Some((k, v)) if same(k) => Some(v.clone()),
            _ => None,
        })
        .ok()
        .flatten();
    if hit.is_some() {
        return hit;
    }
    let (k, v) = make()?;
    let _ = slot.try_with(|s| *s.borrow_mut() = Some((k, v.clone())));
    Some(v)
}

/// A thread's short list of keys and the values made from them ([`listed`]).
pub(crate) type List<K, V> = RefCell<Vec<(K, V)>>;

/// `read` of the value kept for the key `same` accepts; else `make`'s key and value (an error
/// is returned as it is), kept in the list (which starts over past `max` entries) and read.
/// A thread past its locals, or a list already in use, makes and reads without keeping.
pub(crate) fn listed<K: 'static, V: 'static, R, E>(
    list: &'static LocalKey<List<K, V>>,
    max: usize,
    same: impl Fn(&K) -> bool,
    make: impl FnOnce() -> Result<(K, V), E>,
    mut read: impl FnMut(&V) -> R,
) -> Result<R, E> {
    let kept = list
        .try_with(|l| {
            let l = l.try_borrow().ok()?;
            l.iter().find(|(k, _)| same(k)).map(|(_, v)| read(v))
        })
        .ok()
        .flatten();
    if let Some(r) = kept {
        return Ok(r);
    }
    let (k, v) = make()?;
    let r = read(&v);
    let _ = list.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            if l.len() >= max {
                l.clear();
            }
            l.push((k, v));
        }
    });
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::{listed, value, List, Slot};
    use http::HeaderValue;
    use std::cell::Cell;

    thread_local! {
        static S: Slot<u64> = const { std::cell::RefCell::new(None) };
    }

    #[test]
    fn a_value_is_made_again_only_when_its_key_changes() {
        let made = Cell::new(0);
        let get = |n: u64| {
            value(
                &S,
                |k| *k == n,
                || {
                    made.set(made.get() + 1);
                    Some((n, HeaderValue::from(n)))
                },
            )
        };
        assert_eq!(get(5).unwrap(), "5");
        assert_eq!(get(5).unwrap(), "5");
        assert_eq!(made.get(), 1);
        assert_eq!(get(7).unwrap(), "7");
        assert_eq!(get(5).unwrap(), "5");
        assert_eq!(made.get(), 3);
        // No value: nothing kept, the last one still there.
        assert!(value(&S, |k| *k == 9, || None).is_none());
        assert_eq!(get(5).unwrap(), "5");
        assert_eq!(made.get(), 3);
    }

    thread_local! {
        static L: List<u64, String> = const { std::cell::RefCell::new(Vec::new()) };
    }

    #[test]
    fn a_list_keeps_a_few_values_and_starts_over_past_its_bound() {
        let made = Cell::new(0);
        let get = |n: u64| -> Result<String, ()> {
            listed(
                &L,
                3,
                |k| *k == n,
                || {
                    made.set(made.get() + 1);
                    if n == 99 {
                        return Err(());
                    }
                    Ok((n, n.to_string()))
                },
                String::clone,
            )
        };
        for n in [1, 2, 3, 1, 2, 3] {
            assert_eq!(get(n).unwrap(), n.to_string());
        }
        assert_eq!(made.get(), 3, "three keys alternate: each made once");
        // A fourth key starts the list over: the first ones are made again.
        assert_eq!(get(4).unwrap(), "4");
        assert_eq!(get(1).unwrap(), "1");
        assert_eq!(made.get(), 5);
        // An error is handed back and nothing is kept for it.
        assert_eq!(get(99), Err(()));
        assert_eq!(get(99), Err(()));
        assert_eq!(made.get(), 7);
    }
}
