//! Sums that restart when their window turns over, lock-free: one atomic start tag and N
//! atomic values. The request path does one load and N `fetch_add`s; only the first add of a
//! new window takes the (spinning, once per window) roll path.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

/// N sums over the window that starts at `start` (any monotone key: Unix seconds of a
/// calendar day, a minute number).
#[derive(Debug)]
pub struct Windowed<const N: usize> {
    start: AtomicI64,
    values: [AtomicU64; N],
    rolling: AtomicBool,
}

impl<const N: usize> Default for Windowed<N> {
    fn default() -> Self {
        Windowed {
            start: AtomicI64::new(i64::MIN),
            values: std::array::from_fn(|_| AtomicU64::new(0)),
            rolling: AtomicBool::new(false),
        }
    }
}

impl<const N: usize> Windowed<N> {
    /// Adds `v` to the sums of window `start`. An add for a window older than the current
    /// one is dropped (it belongs to a window nobody reads any more). At the instant of a
    /// turnover an add that read the old tag may land in the new window: a boundary blur of
    /// microseconds, accepted so that the common path takes no lock.
    pub fn add(&self, start: i64, v: [u64; N]) {
        let cur = self.start.load(Ordering::Acquire);
        if cur != start {
            if start < cur {
                return;
            }
            self.roll(start);
        }
        for (slot, x) in self.values.iter().zip(v) {
            if x != 0 {
                slot.fetch_add(x, Ordering::AcqRel);
            }
        }
    }

    fn roll(&self, start: i64) {
        loop {
            if self.start.load(Ordering::Acquire) >= start {
                return;
            }
            if self
                .rolling
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                if self.start.load(Ordering::Acquire) < start {
                    for s in &self.values {
                        s.store(0, Ordering::Release);
                    }
                    // Zero first, then publish: whoever sees the new tag adds to zeroed sums.
                    self.start.store(start, Ordering::Release);
                }
                self.rolling.store(false, Ordering::Release);
                return;
            }
            std::hint::spin_loop();
        }
    }

    /// The sums of window `start` (zeros when that is not the window held).
    pub fn get(&self, start: i64) -> [u64; N] {
        if self.start.load(Ordering::Acquire) == start {
            std::array::from_fn(|i| self.values[i].load(Ordering::Acquire))
        } else {
            [0; N]
        }
    }
}

/// The last `M` minutes as a ring of one-minute windows (recent success rate and latency).
#[derive(Debug)]
pub struct Recent<const N: usize, const M: usize> {
    slots: [Windowed<N>; M],
}

impl<const N: usize, const M: usize> Default for Recent<N, M> {
    fn default() -> Self {
        Recent {
            slots: std::array::from_fn(|_| Windowed::default()),
        }
    }
}

impl<const N: usize, const M: usize> Recent<N, M> {
    pub fn add(&self, minute: i64, v: [u64; N]) {
        self.slots[minute.rem_euclid(M as i64) as usize].add(minute, v);
    }

    /// Sums over the `M` minutes ending with `minute` (the current, partial one included).
    pub fn sum(&self, minute: i64) -> [u64; N] {
        let mut out = [0; N];
        for m in (minute - M as i64 + 1)..=minute {
            let v = self.slots[m.rem_euclid(M as i64) as usize].get(m);
            for i in 0..N {
                out[i] += v[i];
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn sums_restart_when_the_window_turns() {
        let w = Windowed::<2>::default();
        w.add(10, [1, 2]);
        w.add(10, [3, 0]);
        assert_eq!(w.get(10), [4, 2]);
        w.add(20, [5, 5]);
        assert_eq!((w.get(20), w.get(10)), ([5, 5], [0, 0]));
        w.add(10, [100, 100]); // late add for a past window: dropped
        assert_eq!(w.get(20), [5, 5]);
    }

    #[test]
    fn concurrent_adds_are_all_counted() {
        let w = Arc::new(Windowed::<1>::default());
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let w = w.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        w.add(7, [1]);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(w.get(7), [40_000]);
    }

    #[test]
    fn recent_minutes_forget_old_ones() {
        let r = Recent::<1, 5>::default();
        r.add(100, [1]);
        r.add(103, [2]);
        assert_eq!(r.sum(104), [3]);
        assert_eq!(r.sum(105), [2]); // minute 100 fell out
        r.add(108, [4]); // reuses minute 103's slot
        assert_eq!(r.sum(108), [4]);
    }
}
