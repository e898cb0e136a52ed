//! The BPE vocabularies, small: every token's bytes and rank, and tiktoken's merge rule.
//!
//! `bpe-openai` ships each tokenizer as a 15-32 MB serialized automaton set that decodes into
//! ~40 MB of tables, and both stay resident (the serialized bytes as file pages of the binary):
//! about 70 MB for `o200k_base` alone, most of a sidecar's memory. Counting needs far less: the
//! rank of a byte string, if it is a token. [`Ranks`] keeps the token bytes where the binary
//! has them (`data/*.tokens`, a one-byte length and the bytes of each token in rank order,
//! made from tiktoken's rank files by `scripts/tiktoken-to-tokens.py`) and one open-addressing
//! table of ranks: ~1.6 + 4 MB for `o200k_base`, built in a few milliseconds on first use.
//!
//! [`Ranks::count_with`] is tiktoken's `byte_pair_merge`: merge the adjacent pair whose merged bytes
//! have the lowest rank (leftmost on ties) until no pair is a token. Short pieces run it in
//! place on the stack; longer ones (rare: long runs of spaces, digits, symbols) use a heap of
//! candidate pairs, so a crafted 1 MB "word" costs O(n log n), not O(n²). Tests check both
//! against the `bpe-openai` library on random input.

use super::vocab::{hash_piece, load4, same_bytes};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Pieces up to this length are merged with the quadratic scan, without allocating.
const SHORT: usize = 32;
const EMPTY: u32 = u32::MAX;

/// A table slot: in its low half, the token's rank in the low 18 bits and 14 bits of its hash
/// and length above them, so most probes that pass a different piece are rejected from the
/// slot alone, without reading the token's bytes; in its high half, where the token's
/// length byte is in the vocabulary's bytes, so a match is checked with one more read (not
/// two: the rank's offset, then the bytes). [`FREE`] marks an empty slot. (`o200k_base` has
/// 200,000 tokens, under 2^18, in 1.6 MB of bytes; its table is 4 MB.)
const RANK_BITS: u32 = 18;
const RANK_MASK: u32 = (1 << RANK_BITS) - 1;
const FREE: u64 = u64::MAX;

/// One slot of a thread's cache of recent span look-ups ([`Ranks::count_with`]): a span of
/// three to eight bytes (`key`, its bytes little-endian, zero above them), and its rank
/// ([`EMPTY`]: not a token). Words of a language share their stems and endings, so the merges
/// of a text's new words mostly look up spans looked up a moment before; this answers them
/// from a few dozen KiB that stay in cache instead of a multi-MiB table (two cache misses
/// for a token: its slot and its bytes). The key is the span's bytes themselves,
/// compared whole: a slot holds the last span that landed in it, never a wrong rank.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Recent {
    key: u64,
    rank: u32,
    /// 0: an empty slot (no span is that short).
    len: u32,
}

impl Recent {
    /// Slots in a thread's cache (16 bytes each: 64 KiB).
    pub(crate) const SLOTS: usize = 4096;

    /// The bytes of a span of 3 to 8 bytes as one integer (two overlapping loads).
    #[inline]
    fn key(s: &[u8]) -> u64 {
        let n = s.len();
        if n < 4 {
            return s.iter().rev().fold(0u64, |k, b| k << 8 | u64::from(*b));
        }
        load4(s, 0) | load4(s, n - 4) << (8 * (n - 4))
    }
}

/// The slot's tag for a piece of `len` bytes with hash `h` (everything but the rank).
#[inline]
fn tag(h: u64, len: usize) -> u32 {
    (((h >> 50) as u32) ^ (len as u32).wrapping_mul(0x9E37)) << RANK_BITS
}

/// A vocabulary: token bytes by rank and a hash table from bytes to rank.
pub(crate) struct Ranks {
    data: &'static [u8],
    /// Offset in `data` of each token's length byte, by rank.
    starts: Vec<u32>,
    /// Open addressing, linear probing; see [`tag`] and [`FREE`].
    table: Vec<u64>,
    mask: usize,
    /// The rank of every two-byte token, indexed by its bytes (`EMPTY` where the pair is not
    /// a token): the first round of every merge looks up only pairs.
    pairs: Vec<u32>,
}

impl Ranks {
    /// Indexes `data` (length-prefixed tokens in rank order). A truncated tail is ignored, and
    /// so are ranks from 2^18 - 1 on (no shipped vocabulary has that many).
    pub(crate) fn parse(data: &'static [u8]) -> Self {
        let mut starts = Vec::new();
        let mut at = 0usize;
        while let Some(&len) = data.get(at) {
            let end = at + 1 + usize::from(len);
            if len == 0 || end > data.len() || starts.len() >= RANK_MASK as usize {
                break;
            }
            starts.push(u32::try_from(at).unwrap_or(u32::MAX));
            at = end;
        }
        starts.shrink_to_fit();
        let slots = (starts.len() * 2).next_power_of_two().max(16);
        let mut ranks = Ranks {
            data,
            starts,
            table: vec![FREE; slots],
            mask: slots - 1,
            pairs: vec![EMPTY; 1 << 16],
        };
        for rank in 0..ranks.starts.len() {
            let Ok(rank) = u32::try_from(rank) else { break };
            let token = ranks.token(rank);
            if let [a, b] = token {
                if let Some(p) = ranks.pairs.get_mut(usize::from(*a) << 8 | usize::from(*b)) {
                    if *p == EMPTY {
                        *p = rank;
                    }
                }
            }
            let h = hash_piece(token);
            let mut i = h as usize & ranks.mask;
            let at = u64::from(ranks.starts.get(rank as usize).copied().unwrap_or(0));
            while let Some(slot) = ranks.table.get_mut(i) {
                if *slot == FREE {
                    *slot = at << 32 | u64::from(tag(h, token.len()) | rank);
                    break;
                }
                i = (i + 1) & ranks.mask;
            }
        }
        ranks
    }

    /// Number of tokens.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.starts.len()
    }

    /// The bytes of token `rank` (empty for an unknown rank).
    pub(crate) fn token(&self, rank: u32) -> &'static [u8] {
        self.starts
            .get(rank as usize)
            .map_or(&[], |&at| self.token_at(at as usize))
    }

    /// The bytes of the token whose length byte is at `at` in the vocabulary's bytes.
    #[inline]
    fn token_at(&self, at: usize) -> &'static [u8] {
        let data: &'static [u8] = self.data;
        let len = data.get(at).map_or(0, |l| usize::from(*l));
        data.get(at + 1..at + 1 + len).unwrap_or(&[])
    }

    /// The rank of `piece` if it is a token.
    #[inline]
    pub(crate) fn rank(&self, piece: &[u8]) -> Option<u32> {
        if piece.len() > usize::from(u8::MAX) {
            return None;
        }
        let h = hash_piece(piece);
        let want = tag(h, piece.len());
        let mut i = h as usize & self.mask;
        loop {
            let slot = *self.table.get(i)?;
            if slot == FREE {
                return None;
            }
            let low = slot as u32;
            if low & !RANK_MASK == want && same_bytes(self.token_at((slot >> 32) as usize), piece) {
                return Some(low & RANK_MASK);
            }
            i = (i + 1) & self.mask;
        }
    }

    fn rank_or_max(&self, piece: &[u8]) -> u32 {
        if let [a, b] = piece {
            return self.pair(*a, *b);
        }
        self.rank(piece).unwrap_or(EMPTY)
    }

    /// Tokens `piece` encodes to (tiktoken's merge rule; a token counts 1).
    #[cfg(test)]
    pub(crate) fn count(&self, piece: &[u8]) -> usize {
        self.count_with(piece, &mut [])
    }

    /// Tokens `piece` encodes to (tiktoken's merge rule; a token counts 1), the merges' look-ups
    /// of short spans answered from `recent` when they were made before (an empty `recent`:
    /// every look-up goes to the table).
    pub(crate) fn count_with(&self, piece: &[u8], recent: &mut [Recent]) -> usize {
        if piece.is_empty() {
            return 0;
        }
        if self.rank(piece).is_some() {
            return 1;
        }
        if piece.len() <= SHORT {
            self.count_short(piece, recent)
        } else {
            self.count_long(piece)
        }
    }

    /// The rank of the span `s` of a piece being merged ([`EMPTY`] when it is not a token):
    /// a two-byte span from the table of pairs; one of three to eight bytes from `recent` when
    /// it holds it, else from the table, and then remembered there.
    #[inline]
    fn span_rank(&self, s: &[u8], recent: &mut [Recent]) -> u32 {
        let n = s.len();
        if n == 2 || n > 8 || recent.is_empty() {
            return self.rank_or_max(s);
        }
        let key = Recent::key(s);
        let i = (key ^ n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        let Some(slot) = recent.get_mut(i as usize & (recent.len() - 1)) else {
            return self.rank_or_max(s);
        };
        if slot.len == n as u32 && slot.key == key {
            return slot.rank;
        }
        let r = self.rank_or_max(s);
        *slot = Recent {
            key,
            rank: r,
            len: n as u32,
        };
        r
    }

    /// tiktoken's `byte_pair_merge`, on the stack: part `i` of the piece starts at `start[i]`
    /// (the last entry is the piece's end), and `rank[i]` is the rank of merging parts `i`
    /// and `i + 1` ([`EMPTY`]: no token). Two flat arrays, set up by one copy and one fill,
    /// and the first round's ranks read from the table of pairs by the bytes themselves.
    fn count_short(&self, piece: &[u8], recent: &mut [Recent]) -> usize {
        /// 0, 1, 2, ...: every byte its own part.
        const IOTA: [u8; SHORT + 1] = {
            let mut a = [0u8; SHORT + 1];
            let mut i = 0;
            while i < a.len() {
                a[i] = i as u8;
                i += 1;
            }
            a
        };
        let n = piece.len().min(SHORT);
        let mut start = IOTA;
        let mut rank = [EMPTY; SHORT + 1];
        for (r, w) in rank.iter_mut().zip(piece.windows(2)) {
            *r = self.pair(w[0], w[1]);
        }
        // Entries: the parts and the end.
        let mut len = n + 1;
        loop {
            // The lowest rank, leftmost on ties (a strict `<` keeps the first).
            let (mut i, mut r) = (0, EMPTY);
            for (at, &x) in rank[..len - 1].iter().enumerate() {
                if x < r {
                    (i, r) = (at, x);
                }
            }
            if r == EMPTY {
                break;
            }
            if i > 0 {
                rank[i - 1] = if i + 2 < len {
                    self.part_rank(piece, &start, i - 1, i + 2, recent)
                } else {
                    EMPTY
                };
            }
            rank[i] = if i + 3 < len {
                self.part_rank(piece, &start, i, i + 3, recent)
            } else {
                EMPTY
            };
            start.copy_within(i + 2..len, i + 1);
            rank.copy_within(i + 2..len, i + 1);
            len -= 1;
        }
        len - 1
    }

    /// The rank of the two-byte token `a b` ([`EMPTY`]: none).
    #[inline]
    fn pair(&self, a: u8, b: u8) -> u32 {
        self.pairs
            .get(usize::from(a) << 8 | usize::from(b))
            .copied()
            .unwrap_or(EMPTY)
    }

    /// The rank of the span of `piece` from part `a`'s start to part `b`'s.
    #[inline]
    fn part_rank(
        &self,
        piece: &[u8],
        start: &[u8],
        a: usize,
        b: usize,
        recent: &mut [Recent],
    ) -> u32 {
        match (start.get(a), start.get(b)) {
            (Some(&a), Some(&b)) => piece
                .get(usize::from(a)..usize::from(b))
                .map_or(EMPTY, |s| self.span_rank(s, recent)),
            _ => EMPTY,
        }
    }

    /// The same merges with a heap of candidate pairs: O(n log n) for long pieces.
    fn count_long(&self, piece: &[u8]) -> usize {
        let n = piece.len();
        // Parts as a doubly linked list over byte positions; `end[i]` is where part i ends.
        let mut end: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::with_capacity(n);
        let push = |heap: &mut BinaryHeap<_>, end: &[usize], i: usize| {
            let Some(&mid) = end.get(i) else { return };
            let Some(&stop) = end.get(mid) else { return };
            let r = piece.get(i..stop).map_or(EMPTY, |s| self.rank_or_max(s));
            if r != EMPTY {
                heap.push(Reverse((r, i, stop)));
            }
        };
        for i in 0..n {
            push(&mut heap, &end, i);
        }
        let mut parts = n;
        while let Some(Reverse((_, i, stop))) = heap.pop() {
            // Stale unless part i is alive and still spans, with its neighbour, to `stop`.
            let mid = end[i];
            if !alive[i] || end.get(mid) != Some(&stop) {
                continue;
            }
            alive[mid] = false;
            end[i] = stop;
            if let Some(p) = prev.get_mut(stop) {
                *p = i;
            }
            parts -= 1;
            push(&mut heap, &end, i);
            if let Some(&p) = prev.get(i) {
                if p != usize::MAX {
                    push(&mut heap, &end, p);
                }
            }
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::Tokenizer;

    fn lib_piece(tok: Tokenizer, piece: &[u8]) -> usize {
        let lib = if tok == Tokenizer::O200k {
            bpe_openai::o200k_base()
        } else {
            bpe_openai::cl100k_base()
        };
        lib.bpe.count(piece)
    }

    fn ours(tok: Tokenizer) -> &'static Ranks {
        match super::super::count::ranks_for(tok) {
            Some(r) => r,
            None => panic!("no ranks for {tok:?}"),
        }
    }

    #[test]
    fn ranks_are_the_library_token_ids() {
        for tok in [Tokenizer::O200k, Tokenizer::Cl100k] {
            let lib = if tok == Tokenizer::O200k {
                bpe_openai::o200k_base()
            } else {
                bpe_openai::cl100k_base()
            };
            let r = ours(tok);
            assert_eq!(r.len(), lib.bpe.num_tokens());
            // Every token, through the hash table.
            for id in 0..r.len() as u32 {
                assert_eq!(r.token(id), lib.bpe.token_bytes(id));
                assert_eq!(r.rank(lib.bpe.token_bytes(id)), Some(id));
            }
            assert_eq!(r.rank(b"\xFF\xFEnot a token at all"), None);
            assert_eq!(r.rank(b"\xFF\xFE\xFD"), None);
            assert_eq!(r.rank(b""), None);
        }
    }

    #[test]
    fn merge_counts_equal_the_library_short_and_long() {
        let mut s: u64 = 0x2545_F491_4F6C_DD1D;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        const BYTES: &[u8] = b"aeiou tnrsl-=_.0123456789xyzQ\xC3\xA9\x80";
        for tok in [Tokenizer::O200k, Tokenizer::Cl100k] {
            let r = ours(tok);
            let mut tiny = [Recent::default(); 2];
            let mut kept = vec![Recent::default(); Recent::SLOTS];
            for i in 0..4000 {
                let len = 2 + (next() % if i % 10 == 0 { 300 } else { 40 }) as usize;
                let piece: Vec<u8> = (0..len)
                    .map(|_| BYTES[(next() % BYTES.len() as u64) as usize])
                    .collect();
                let want = lib_piece(tok, &piece);
                assert_eq!(r.count(&piece), want, "{tok:?} {piece:?}");
                // Through a cache of recent look-ups as small as can be (two slots, shared by
                // every span, so spans keep evicting each other) and a thread-sized one that
                // keeps them from piece to piece: a cache that trusted its slot, or kept a
                // rank under the wrong bytes, would miscount.
                assert_eq!(r.count_with(&piece, &mut tiny), want, "{tok:?} {piece:?}");
                assert_eq!(r.count_with(&piece, &mut kept), want, "{tok:?} {piece:?}");
                if piece.len() > 1 && r.rank(&piece).is_none() {
                    assert_eq!(r.count_long(&piece), want, "heap path {tok:?} {piece:?}");
                }
            }
        }
    }

    #[test]
    fn two_byte_pieces_rank_the_same_from_the_pair_table_and_the_hash_table() {
        for tok in [Tokenizer::O200k, Tokenizer::Cl100k] {
            let r = ours(tok);
            // Every pair of bytes, token or not, answers alike from both tables.
            for a in 0..=255u8 {
                for b in 0..=255u8 {
                    let t = [a, b];
                    assert_eq!(r.rank_or_max(&t), r.rank(&t).unwrap_or(EMPTY), "{t:?}");
                }
            }
            assert_eq!(r.rank(&[b'x'; 256]), None);
        }
    }

    #[test]
    fn a_huge_piece_is_counted_in_n_log_n() {
        let r = ours(Tokenizer::O200k);
        let piece = "ab1-".repeat(50_000);
        let start = std::time::Instant::now();
        let n = r.count(piece.as_bytes());
        assert_eq!(n, lib_piece(Tokenizer::O200k, piece.as_bytes()));
        // The quadratic scan would take tens of seconds here.
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn a_recent_span_is_keyed_by_all_of_its_bytes() {
        let bytes = b"\x01\x80the quick brown\xFF";
        for n in 3..=8 {
            for at in 0..=bytes.len() - n {
                let s = &bytes[at..at + n];
                let mut padded = [0u8; 8];
                padded[..n].copy_from_slice(s);
                assert_eq!(Recent::key(s), u64::from_le_bytes(padded), "{s:?}");
            }
        }
    }
}
