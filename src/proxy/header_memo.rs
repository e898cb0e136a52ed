//! Header values that repeat from answer to answer, kept per thread: the last value made for a
//! key is handed out again (a clone of its shared bytes) while the key stays the same, instead
//! of being formatted, validated and allocated anew on every answer.

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

/// A number as a header value, in one allocation (`HeaderValue::from(u64)` makes two: a
/// growing buffer, then its conversion).
pub(crate) fn int(n: u64) -> HeaderValue {
    HeaderValue::from_str(itoa::Buffer::new().format(n)).unwrap_or_else(|_| HeaderValue::from(n))
}

#[cfg(test)]
mod tests {
    use super::{int, value, Slot};
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

    #[test]
    fn numbers_read_as_http_writes_them() {
        for n in [0, 7, 256, 99_999_999_960, u64::MAX] {
            assert_eq!(int(n), HeaderValue::from(n));
        }
    }
}
