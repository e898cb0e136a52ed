//! Turning text into a token count.
//!
//! Every estimate bottoms out here: a string and a [`Tokenizer`] in, a token count out. Counts
//! for `o200k_base` and `cl100k_base` are tiktoken's `encode_ordinary` counts exactly (special-
//! token text such as `<|endoftext|>` is counted as plain text); tests check them against the
//! `bpe-openai` library on random input. Each tokenizer's tables (`tables`: the vocabulary in
//! `ranks` and the pre-tokenizer regex) are built at most once per process, on first use, and
//! only for the tokenizer asked for; [`warm_up_for`] moves that cost to start-up.
//!
//! The library's own `count` runs a regex per piece and a full BPE per piece; we produce the
//! identical count several times faster on English by splitting ASCII text by hand (`pretok`),
//! answering whole-token pieces with one table lookup (`ranks`), and remembering pieces' counts
//! per thread across texts (`Words`).

use super::ranks::{Ranks, Recent};
use super::tables::{tables, Tables};
use super::{memo, pretok, vocab};
use crate::estimate::Tokenizer;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Characters per token assumed by [`Tokenizer::Chars`] and by the JSON-length fallback.
pub const CHARS_PER_TOKEN: u64 = 4;

/// Number of tokens `s` encodes to under `tok`.
///
/// * `O200k` / `Cl100k`: the exact tiktoken count for `o200k_base` / `cl100k_base`.
/// * `Chars`: `ceil(chars / 4)`, where `chars` counts Unicode scalar values. The usual rule of
///   thumb for English; for models whose tokenizer we do not ship. It under-counts CJK and
///   other scripts that take more than one token per character.
///
/// A prompt's texts are remembered process-wide (`memo`): one seen before is hashed, not
/// counted again.
pub fn count_text(tok: Tokenizer, s: &str) -> u64 {
    count(tok, s, true)
}

fn count(tok: Tokenizer, s: &str, remember: bool) -> u64 {
    if s.is_empty() {
        return 0;
    }
    match tok {
        Tokenizer::O200k | Tokenizer::Cl100k => match tables(tok) {
            Some(t) if remember && s.len() >= memo::MIN_TEXT => {
                memo::memo().count(tok as u8, s.as_bytes(), || bpe_count_here(t, tok, s))
            }
            Some(t) => role_count(t, tok, s).unwrap_or_else(|| bpe_count_here(t, tok, s)),
            None => chars_to_tokens(to_u64(s.chars().count())),
        },
        Tokenizer::Chars => chars_to_tokens(to_u64(s.chars().count())),
    }
}

/// The role names of chat messages: every message carries one, and a text this short is
/// counted each time (the memo is for longer ones), at ~350 instructions a role.
const ROLES: [&str; 6] = [
    "system",
    "user",
    "assistant",
    "tool",
    "developer",
    "function",
];

/// A role name's count, counted once per process and tokenizer (`None`: not a role name).
fn role_count(t: &'static Tables, tok: Tokenizer, s: &str) -> Option<u64> {
    static COUNTS: [std::sync::OnceLock<[u64; ROLES.len()]>; 2] =
        [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    let i = ROLES.iter().position(|r| *r == s)?;
    let slot = &COUNTS[usize::from(tok == Tokenizer::Cl100k)];
    Some(slot.get_or_init(|| ROLES.map(|r| bpe_count(t, tok, r)))[i])
}

/// [`bpe_count`], off the async worker for a large text ([`offloads`]).
fn bpe_count_here(t: &'static Tables, kind: Tokenizer, s: &str) -> u64 {
    if offloads(s.len()) {
        tokio::task::block_in_place(|| bpe_count(t, kind, s))
    } else {
        bpe_count(t, kind, s)
    }
}

/// Forgets every count the process-wide memo holds, so the next estimates count from scratch
/// (benchmarks of the first sight of a text).
#[doc(hidden)]
pub fn forget_counts() {
    memo::memo().clear();
}

/// Number of tokens in response text, for when a provider reports no `usage` (an interrupted
/// stream, a provider that omits it). The same count as [`count_text`]; a separate name so call
/// sites say which side of the exchange they are pricing. An answer is rarely seen twice, so
/// it is counted without the memo (it would only evict prompts' counts).
pub fn count_output_text(tok: Tokenizer, s: &str) -> u64 {
    count(tok, s, false)
}

/// Builds both BPE tokenizers' tables now instead of on the first request that needs them.
/// Idempotent and cheap after the first call.
pub fn warm_up() {
    warm_up_for(Tokenizer::O200k);
    warm_up_for(Tokenizer::Cl100k);
}

/// Builds only the tokenizer `tok` needs (nothing for `Chars`); for a sidecar whose policy
/// names a single tokenizer and wants to spare the memory of the other.
pub fn warm_up_for(tok: Tokenizer) {
    // Counting forces the tables' construction; the non-ASCII string also touches the
    // pre-tokenizer regex so its lazy caches are populated.
    let _ = count_text(tok, "warm up");
    let _ = count_text(tok, "warm up, naïve café");
}

/// Texts at least this long are counted with `tokio::task::block_in_place` when on a
/// multi-threaded runtime: counting is linear in the text (on the order of a millisecond per
/// 100 KB), so a multi-megabyte prompt would hold the worker for many milliseconds; the runtime
/// hands this worker's other tasks to another thread meanwhile instead of stalling them.
pub const OFFLOAD_BYTES: usize = 32 * 1024;

/// Whether counting `len` bytes here moves off the async worker: a large text, inside a
/// multi-threaded tokio runtime (`block_in_place` panics on a current-thread runtime, and
/// outside a runtime there is nothing to stall).
pub(crate) fn offloads(len: usize) -> bool {
    len >= OFFLOAD_BYTES && on_runtime(tokio::runtime::RuntimeFlavor::MultiThread)
}

/// Whether this thread runs inside a Tokio runtime of flavor `f`.
fn on_runtime(f: tokio::runtime::RuntimeFlavor) -> bool {
    tokio::runtime::Handle::try_current().is_ok_and(|h| h.runtime_flavor() == f)
}

/// Whether a body of `len` bytes is estimated on the blocking pool: a large one, on a
/// single-threaded runtime (a connection worker, where [`offloads`] cannot move the count
/// off the thread and the worker's other connections would wait for it).
pub fn offload_whole(len: usize) -> bool {
    len >= OFFLOAD_BYTES && on_runtime(tokio::runtime::RuntimeFlavor::CurrentThread)
}

/// The vocabulary of `tok` (`None` for `Chars`); built on first use.
#[cfg(test)]
pub(crate) fn ranks_for(tok: Tokenizer) -> Option<&'static Ranks> {
    tables(tok).map(|t| &t.ranks)
}

/// The library's `Tokenizer::count(s)`, exactly (tested), faster and in a fraction of its
/// memory: ASCII runs are split by [`pretok::AsciiSplit`] instead of the regex, pieces are
/// counted by [`Ranks`] through this thread's [`Words`]. (Neither tokenizer normalizes its
/// input.)
fn bpe_count(t: &'static Tables, kind: Tokenizer, s: &str) -> u64 {
    WORDS.with(|w| {
        // (Not reentrant, and never reached from within itself.)
        if let Ok(mut w) = w.try_borrow_mut() {
            if let Some((table, recent)) = w.table(kind) {
                return count_pieces(t, kind, s, table, recent);
            }
        }
        // No table for this thread (too many threads have one): a memo for this text only.
        count_pieces(t, kind, s, &mut Words::for_one_text(s.len()), &mut [])
    })
}

fn count_pieces(
    t: &'static Tables,
    kind: Tokenizer,
    s: &str,
    words: &mut [Word],
    recent: &mut [Recent],
) -> u64 {
    let mut total: u64 = 0;
    for (chunk, ascii) in pretok::chunks(s) {
        if ascii {
            for piece in pretok::AsciiSplit::new(kind, chunk) {
                total = total.saturating_add(count_piece(&t.ranks, words, recent, piece));
            }
        } else if let Some(split) = &t.split {
            for piece in split.split(chunk) {
                total =
                    total.saturating_add(count_piece(&t.ranks, words, recent, piece.as_bytes()));
            }
        } else {
            total = total.saturating_add(count_piece(&t.ranks, words, recent, chunk.as_bytes()));
        }
    }
    total
}

/// One slot of [`Words`]: a piece of at most [`Word::MAX`] bytes and its token count.
#[derive(Clone, Copy)]
struct Word {
    key: [u8; Word::MAX],
    len: u8,
    count: u8,
}

impl Word {
    /// Longest piece remembered (English words with their leading space are far shorter).
    const MAX: usize = 22;
    const EMPTY: Word = Word {
        key: [0; Word::MAX],
        len: 0,
        count: 0,
    };
}

/// Pieces' counts, remembered per thread and per tokenizer across texts and requests: English
/// repeats its words within a prompt and from one prompt to the next, so most pieces of a new
/// text are answered by one lookup here instead of a vocabulary lookup or a run of BPE
/// merges. Direct-mapped and keyed by the piece's bytes (compared exactly, not by hash): a slot
/// holds the last piece that hashed to it, so a collision (accidental or crafted) only costs a
/// miss, never a wrong count. Per thread, so no lock and no sharing: each runtime worker keeps
/// its own ([`Words::SLOTS`] × 24 bytes, 384 KiB, and 64 KiB of [`Recent`] span look-ups, per
/// tokenizer it has counted with). At most
/// [`Words::MAX_TABLES`] exist at once, whatever the number of threads (`block_in_place` hands
/// a worker's tasks to new threads): a thread past that counts each text with a memo of its
/// own, as before the tables were kept.
struct Words {
    tables: [Vec<Word>; 2],
    /// The merges' recent span look-ups, per tokenizer, beside its table.
    recent: [Vec<Recent>; 2],
}

/// Tables alive, process-wide.
static TABLES: AtomicUsize = AtomicUsize::new(0);

impl Words {
    const SLOTS: usize = 16384;
    const MAX_TABLES: usize = 16;
    /// A thread's tables before it has counted anything.
    const NONE: Words = Words {
        tables: [Vec::new(), Vec::new()],
        recent: [Vec::new(), Vec::new()],
    };

    fn is_empty(&self) -> bool {
        self.tables.iter().all(Vec::is_empty)
    }

    /// This thread's table for `kind`, made on first use if the process has room for it.
    fn table(&mut self, kind: Tokenizer) -> Option<(&mut [Word], &mut [Recent])> {
        let k = usize::from(kind == Tokenizer::Cl100k);
        let (t, r) = (&mut self.tables[k], &mut self.recent[k]);
        if t.is_empty() {
            if TABLES.fetch_add(1, Ordering::Relaxed) >= Self::MAX_TABLES {
                TABLES.fetch_sub(1, Ordering::Relaxed);
                return None;
            }
            *t = vec![Word::EMPTY; Self::SLOTS];
            *r = vec![Recent::default(); Recent::SLOTS];
        }
        Some((t, r))
    }

    /// A memo for one text of `len` bytes: none for a short one, else one slot per 16 bytes
    /// (512 to [`Words::SLOTS`]).
    fn for_one_text(len: usize) -> Vec<Word> {
        if len < 2048 {
            return Vec::new();
        }
        let n = (len / 16).next_power_of_two().clamp(512, Self::SLOTS);
        vec![Word::EMPTY; n]
    }

    fn release(&mut self) {
        for (t, r) in self.tables.iter_mut().zip(&mut self.recent) {
            if !t.is_empty() {
                *t = Vec::new();
                *r = Vec::new();
                TABLES.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Words {
    fn drop(&mut self) {
        self.release();
    }
}

thread_local! {
    static WORDS: std::cell::RefCell<Words> = const { std::cell::RefCell::new(Words::NONE) };
}

/// Tables lent to threads that count only now and then: the blocking pool's threads, which
/// estimate the large bodies of the connection workers ([`offload_whole`]). Such a thread
/// is new whenever the pool has had none idle (tokio ends an idle one after 10 s, and starts
/// one per body counted at once), and a new thread's first 100 KB text took ~1.15 ms
/// against ~0.7 ms with a table that has seen texts before (docs/performance.md). At most
/// [`SPARES`] are kept, the last returned lent first (the warmest in cache). A lock, on
/// this path only: it is taken twice per large body, never on a request's way through a
/// worker.
static SPARE: std::sync::Mutex<Vec<Words>> = std::sync::Mutex::new(Vec::new());
const SPARES: usize = 2;

/// Runs `f` (which counts a large text) with this thread's tables of pieces lent from the
/// spare ones when the thread has none of its own, and hands them back afterwards, so the
/// next thread that counts a large body starts warm. For threads that count now and then;
/// the connection workers keep their own.
pub fn with_spare_words<R>(f: impl FnOnce() -> R) -> R {
    let lock_spares = || {
        SPARE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    WORDS.with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            if w.is_empty() {
                if let Some(lent) = lock_spares().pop() {
                    *w = lent;
                }
            }
        }
    });
    let out = f();
    WORDS.with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            if !w.is_empty() {
                let mut spares = lock_spares();
                if spares.len() < SPARES {
                    spares.push(std::mem::replace(&mut *w, Words::NONE));
                }
            }
        }
    });
    out
}

/// Forgets the pieces' counts this thread remembers (benchmarks of a cold start).
#[doc(hidden)]
pub fn forget_words() {
    WORDS.with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            w.release();
        }
    });
}

/// The count of one piece, from `words` when it is there; counted by [`Ranks`] (a whole-token
/// lookup, else the BPE merges) and remembered when it is not.
#[inline]
fn count_piece(ranks: &Ranks, words: &mut [Word], recent: &mut [Recent], piece: &[u8]) -> u64 {
    let n = piece.len();
    if n > Word::MAX || words.is_empty() {
        return to_u64(ranks.count_with(piece, recent));
    }
    let i = vocab::hash_piece(piece) as usize & (words.len() - 1);
    let Some(w) = words.get_mut(i) else {
        return to_u64(ranks.count_with(piece, recent));
    };
    if usize::from(w.len) == n && vocab::same_bytes(&w.key[..n], piece) {
        return u64::from(w.count);
    }
    let c = ranks.count_with(piece, recent);
    if let Ok(count) = u8::try_from(c) {
        w.key[..n].copy_from_slice(piece);
        // `n` ≤ `Word::MAX`.
        w.len = n as u8;
        w.count = count;
    }
    to_u64(c)
}

/// `ceil(chars / 4)`.
pub(crate) fn chars_to_tokens(chars: u64) -> u64 {
    chars.div_ceil(CHARS_PER_TOKEN)
}

/// Conservative token count for a JSON value we do not understand (audio, files, unknown
/// parts): the length of its compact serialization in characters, divided by four, rounded up.
pub(crate) fn json_fallback_tokens(v: &serde_json::Value) -> u64 {
    chars_to_tokens(json_chars(v))
}

/// Tokens of the compact JSON serialization of `v` under `tok` (for schema fragments that are
/// rendered into the prompt more or less verbatim).
pub(crate) fn json_tokens(tok: Tokenizer, v: &serde_json::Value) -> u64 {
    match v {
        serde_json::Value::String(s) => count_text(tok, s),
        other => count_text(tok, &other.to_string()),
    }
}

/// Characters in the compact JSON serialization of `v`, counted without building the string.
pub(crate) fn json_chars(v: &serde_json::Value) -> u64 {
    let mut counter = CharCounter(0);
    // Writing a `Value` into an infallible writer cannot fail; if it somehow did, the count so
    // far is still a usable (lower) estimate.
    let _ = serde_json::to_writer(&mut counter, v);
    counter.0
}

/// An `io::Write` that only counts UTF-8 characters (bytes that are not continuation bytes).
struct CharCounter(u64);

impl std::io::Write for CharCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let chars = buf.iter().filter(|b| (**b & 0xC0) != 0x80).count();
        self.0 = self.0.saturating_add(to_u64(chars));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `usize` → `u64` without a cast that could silently truncate on exotic targets.
pub(crate) fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lib(tok: Tokenizer) -> &'static bpe_openai::Tokenizer {
        if tok == Tokenizer::O200k {
            bpe_openai::o200k_base()
        } else {
            bpe_openai::cl100k_base()
        }
    }

    #[test]
    fn pieces_that_share_a_slot_keep_their_own_counts() {
        // Single pieces (as the splitter cuts them) that land in the same slot of the thread's
        // table and count differently: a table that trusted its slot would get one wrong.
        let mask = Words::SLOTS - 1;
        let o200k = lib(Tokenizer::O200k);
        let mut by_slot: std::collections::HashMap<usize, String> = Default::default();
        let mut pairs = Vec::new();
        for i in 0..40_000u32 {
            // A space and letters only: one piece each.
            let mut w = String::from(" q");
            let mut n = i;
            while n > 0 {
                w.push(char::from(b'a' + (n % 26) as u8));
                n /= 26;
            }
            let slot = vocab::hash_piece(w.as_bytes()) as usize & mask;
            match by_slot.get(&slot) {
                Some(other) if pairs.len() < 20 && o200k.count(other) != o200k.count(&w) => {
                    pairs.push((other.clone(), w));
                }
                Some(_) => {}
                None => {
                    by_slot.insert(slot, w);
                }
            }
        }
        assert!(pairs.len() >= 10, "{}", pairs.len());
        for tok in [Tokenizer::O200k, Tokenizer::Cl100k] {
            for (a, b) in &pairs {
                for s in [a, b, a, b, a] {
                    // (Output counting skips the memo of texts: every call reaches the table.)
                    assert_eq!(
                        count_output_text(tok, s),
                        lib(tok).count(s.as_str()) as u64,
                        "{tok:?} {s:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn threads_past_the_cap_count_without_a_table_of_their_own() {
        // Many threads at once, each holding its table while the others make theirs: no more
        // than the cap are made, and the counts are the same with a table or without.
        let text = "The quarterly revenue analysis is important, however. ".repeat(60);
        let want = lib(Tokenizer::O200k).count(text.as_str()) as u64;
        let barrier = std::sync::Barrier::new(Words::MAX_TABLES + 8);
        std::thread::scope(|sc| {
            for _ in 0..Words::MAX_TABLES + 8 {
                sc.spawn(|| {
                    assert_eq!(count_output_text(Tokenizer::O200k, &text), want);
                    // Every thread has counted and still lives.
                    barrier.wait();
                    assert!(TABLES.load(Ordering::Relaxed) <= Words::MAX_TABLES);
                    assert_eq!(count_output_text(Tokenizer::O200k, &text), want);
                });
            }
        });
    }

    #[test]
    fn remembered_counts_equal_fresh_ones_from_one_text_to_the_next() {
        let texts = [
            "The quarterly revenue analysis is important, however the deployment is late.",
            "However, the deployment's quarterly analysis: revenue is important (approximately).",
            " unpredictable reconstructions re-evaluate well-known kubernetes migrations 2024 42",
        ];
        for tok in [Tokenizer::O200k, Tokenizer::Cl100k] {
            forget_words();
            let cold: Vec<u64> = texts.iter().map(|t| count_output_text(tok, t)).collect();
            let warm: Vec<u64> = texts.iter().map(|t| count_output_text(tok, t)).collect();
            let want: Vec<u64> = texts.iter().map(|t| lib(tok).count(t) as u64).collect();
            assert_eq!(cold, want, "{tok:?}");
            assert_eq!(warm, want, "{tok:?}");
        }
    }

    /// Whether this thread's table for `tok` remembers `piece`'s count.
    fn remembers(tok: Tokenizer, piece: &str) -> bool {
        let n = piece.len();
        WORDS.with(|w| {
            let w = w.borrow();
            let table = &w.tables[usize::from(tok == Tokenizer::Cl100k)];
            let i = vocab::hash_piece(piece.as_bytes()) as usize & table.len().wrapping_sub(1);
            table
                .get(i)
                .is_some_and(|s| usize::from(s.len) == n && &s.key[..n] == piece.as_bytes())
        })
    }

    #[test]
    fn a_thread_that_counts_now_and_then_starts_with_a_table_lent_warm() {
        // A piece no other test counts.
        let piece = " zqxwvutsrq";
        let text = format!("The{piece} is new here.");
        let want = lib(Tokenizer::O200k).count(text.as_str()) as u64;
        // A first thread counts it and ends: its table goes back to the spares.
        std::thread::spawn({
            let text = text.clone();
            move || {
                with_spare_words(|| {
                    assert_eq!(count_output_text(Tokenizer::O200k, &text), want);
                    assert!(remembers(Tokenizer::O200k, piece));
                });
                // Handed back: this thread holds no table any more.
                assert!(WORDS.with(|w| w.borrow().is_empty()));
            }
        })
        .join()
        .unwrap();
        // A new thread starts with that table, and counts the same.
        std::thread::spawn(move || {
            assert!(!remembers(Tokenizer::O200k, piece));
            with_spare_words(|| {
                assert!(remembers(Tokenizer::O200k, piece));
                assert_eq!(count_output_text(Tokenizer::O200k, &text), want);
            });
            // And hands it back in turn.
            assert!(WORDS.with(|w| w.borrow().is_empty()));
        })
        .join()
        .unwrap();
    }

    /// A role's count from the table is the library's count of it, and a text that only
    /// resembles a role is counted as itself.
    #[test]
    fn role_names_count_as_the_library_counts_them() {
        for tok in [Tokenizer::O200k, Tokenizer::Cl100k] {
            for r in ROLES
                .iter()
                .copied()
                .chain(["User", "users", " user", "toolbox", "système"])
            {
                let want = lib(tok).count(r) as u64;
                assert_eq!(count_text(tok, r), want, "{tok:?} {r}");
                assert_eq!(count_output_text(tok, r), want, "{tok:?} {r}");
            }
        }
    }
}
