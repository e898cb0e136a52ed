//! Token counts of texts seen before, process-wide: chat clients resend the whole history on
//! every turn and most applications send the same system prompt with every request, so most
//! of a prompt's text was counted already.
//!
//! A direct-mapped table of atomic words, no lock: a slot holds a 40-bit tag of the last text
//! that hashed to it and that text's count (24 bits; larger counts are not kept). The hash is
//! SipHash-1-3 under keys drawn at random per process (std's `RandomState`), so a client
//! cannot craft a text that collides with another one it has not seen the key of; an
//! accidental match needs 54 bits of hash to agree. A collision in a slot only evicts: the
//! memo answers a text only when its tag matches, and otherwise the text is counted.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Texts shorter than this are counted directly (hashing them costs about what counting does).
pub const MIN_TEXT: usize = 16;
const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

pub struct Memo {
    slots: Box<[AtomicU64]>,
    keys: std::collections::hash_map::RandomState,
}

impl Memo {
    /// A memo of `slots` entries (a power of two).
    pub fn new(slots: usize) -> Self {
        assert!(slots.is_power_of_two());
        Memo {
            slots: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            keys: Default::default(),
        }
    }

    fn hash(&self, salt: u8, text: &[u8]) -> u64 {
        let mut h = self.keys.build_hasher();
        h.write_u8(salt);
        h.write(text);
        h.finish()
    }

    /// (slot, the word a hit holds without its count) for a text.
    fn place(&self, salt: u8, text: &[u8]) -> (usize, u64) {
        let h = self.hash(salt, text);
        let slot = (h as usize) & (self.slots.len() - 1);
        (slot, h & !COUNT_MASK)
    }

    /// The count of `text` under `count`, from the memo or counted (and then kept).
    pub fn count(&self, salt: u8, text: &[u8], count: impl FnOnce() -> u64) -> u64 {
        let (slot, tag) = self.place(salt, text);
        let cell = &self.slots[slot];
        let word = cell.load(Ordering::Relaxed);
        if word != 0 && word & !COUNT_MASK == tag {
            return word & COUNT_MASK;
        }
        let n = count();
        if n > 0 && n <= COUNT_MASK {
            cell.store(tag | n, Ordering::Relaxed);
        }
        n
    }
}

impl Memo {
    /// Empties every slot.
    pub fn clear(&self) {
        for s in self.slots.iter() {
            s.store(0, Ordering::Relaxed);
        }
    }
}

/// The process's memo: 16,384 slots, 128 KB.
pub fn memo() -> &'static Memo {
    static MEMO: OnceLock<Memo> = OnceLock::new();
    MEMO.get_or_init(|| Memo::new(1 << 14))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn a_text_is_counted_once_then_answered_from_the_memo() {
        let m = Memo::new(64);
        let calls = Cell::new(0);
        let count = || {
            calls.set(calls.get() + 1);
            42
        };
        assert_eq!(m.count(1, b"You are a helpful assistant.", count), 42);
        assert_eq!(
            m.count(1, b"You are a helpful assistant.", || unreachable!()),
            42
        );
        assert_eq!(calls.get(), 1);
        // Another salt (tokenizer) is another text.
        assert_eq!(m.count(2, b"You are a helpful assistant.", || 7), 7);
    }

    #[test]
    fn texts_sharing_a_slot_never_take_each_others_counts() {
        // One slot: every text lands in it; each lookup of the other text must count.
        let m = Memo::new(1);
        for i in 0..200u64 {
            let a = format!("first text number {i}");
            let b = format!("second text number {i}");
            assert_eq!(m.count(0, a.as_bytes(), || i + 1), i + 1);
            assert_eq!(m.count(0, b.as_bytes(), || i + 1000), i + 1000);
            assert_eq!(m.count(0, a.as_bytes(), || i + 1), i + 1);
        }
    }

    #[test]
    fn counts_beyond_the_field_are_not_kept() {
        let m = Memo::new(8);
        let big = COUNT_MASK + 1;
        assert_eq!(m.count(0, b"a very long text indeed", || big), big);
        assert_eq!(m.count(0, b"a very long text indeed", || big), big);
        let calls = Cell::new(0);
        m.count(0, b"a very long text indeed", || {
            calls.set(1);
            big
        });
        assert_eq!(calls.get(), 1, "never answered from the memo");
    }

    #[test]
    fn concurrent_writers_never_tear_a_count() {
        let m = std::sync::Arc::new(Memo::new(4));
        let texts: Vec<String> = (0..64)
            .map(|i| format!("text {i} of some length"))
            .collect();
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (m, texts) = (m.clone(), texts.clone());
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        for (i, t) in texts.iter().enumerate() {
                            let want = i as u64 + 1;
                            assert_eq!(m.count(0, t.as_bytes(), || want), want);
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}
