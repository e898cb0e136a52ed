//! How long a pre-flight estimate takes: the budget is under 1 ms for a 100 KB chat prompt,
//! since every request pays it before being forwarded. Kept short (3 s per case) so the whole
//! bench finishes in well under 30 s.

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tollgate::estimate::count::{forget_counts, forget_words};
use tollgate::estimate::{chat_plain, estimate, warm_up, with_spare_words, Endpoint, Tokenizer};

#[rustfmt::skip]
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been",
    "if", "more", "when", "will", "would", "who", "so", "no", "budget", "request", "latency",
    "throughput", "configuration", "deployment", "customer", "invoice", "quarterly", "revenue",
    "analysis", "summarize", "following", "document", "important", "however", "therefore",
    "approximately", "kubernetes", "database", "migration", "performance", "January", "London",
    "Paris", "OpenAI", "API", "JSON", "HTTP", "2024", "42", "3.14", "don't", "it's", "we'll",
    "e-mail", "co-operate", "well-known", "re-evaluate",
];

/// Morphemes for the open-ended tail of the vocabulary: prefix + root + suffix gives ~11k
/// English-looking words ("unpredictable", "reconstructions"), so a 100 KB text has rare words
/// that tokenize into several tokens, as real prose does.
#[rustfmt::skip]
const PREFIXES: &[&str] = &[
    "", "", "", "un", "re", "pre", "dis", "over", "inter", "mis", "non", "sub",
];
#[rustfmt::skip]
const ROOTS: &[&str] = &[
    "act", "build", "calcul", "charg", "claim", "compil", "connect", "construct", "contract",
    "count", "cover", "deploy", "design", "direct", "estimat", "form", "govern", "grant", "host",
    "invest", "judg", "limit", "load", "measur", "migrat", "model", "monitor", "negotiat", "operat",
    "order", "pay", "permit", "plan", "pric", "process", "produc", "program", "project", "quot",
    "rat", "record", "regulat", "report", "request", "rout", "scal", "schedul", "serv", "sett",
    "ship", "sign", "spend", "structur", "support", "system", "test", "track", "trad", "train",
    "valu",
];
#[rustfmt::skip]
const SUFFIXES: &[&str] = &[
    "", "e", "ed", "es", "ing", "ion", "ions", "able", "er", "ers", "ment", "ments", "ive", "ively",
    "ure",
];

/// Deterministic English-like prose of exactly `bytes` bytes (ASCII): sentences of 6–20
/// words with capitals, commas, full stops and paragraph breaks. Nine words in ten come from a
/// list of common words; the rest are composed from morphemes. Calibrated against real English
/// (the Vim user manual, crate READMEs): there 6-12% of pre-tokenizer pieces are several tokens,
/// ~700-900 of them distinct per 100 KB; here ~10% and ~1,300, so if anything this is harder.
fn prose(bytes: usize, seed: u64) -> String {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    let mut out = String::with_capacity(bytes + 32);
    let mut word = String::new();
    while out.len() < bytes {
        let len = 6 + next() % 15;
        for i in 0..len {
            word.clear();
            if next() % 10 == 0 {
                word.push_str(PREFIXES[next() % PREFIXES.len()]);
                word.push_str(ROOTS[next() % ROOTS.len()]);
                word.push_str(SUFFIXES[next() % SUFFIXES.len()]);
            } else {
                word.push_str(WORDS[next() % WORDS.len()]);
            }
            if i == 0 {
                let mut c = word.chars();
                if let Some(f) = c.next() {
                    out.extend(f.to_uppercase());
                    out.push_str(c.as_str());
                }
            } else {
                out.push(' ');
                out.push_str(&word);
            }
            if i + 1 < len && next() % 9 == 0 {
                out.push(',');
            }
        }
        out.push_str(if next() % 7 == 0 { ".\n\n" } else { ". " });
    }
    out.truncate(bytes);
    out
}

/// A chat body whose message contents add up to `bytes`: system, user, assistant, user.
fn chat_body(bytes: usize) -> Value {
    chat_body_seeded(bytes, 1)
}

/// [`chat_body`] with texts of their own: a different `seed` gives different sentences from
/// the same words (another document in the same language).
fn chat_body_seeded(bytes: usize, seed: u64) -> Value {
    let seed = seed.wrapping_mul(4);
    let sys = bytes / 20;
    let user1 = bytes / 2;
    let asst = bytes / 5;
    let user2 = bytes - sys - user1 - asst;
    json!({
        "model": "gpt-4o",
        "max_completion_tokens": 1024,
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [
            {"role": "system", "content": prose(sys, seed + 1)},
            {"role": "user", "content": prose(user1, seed + 2)},
            {"role": "assistant", "content": prose(asst, seed + 3)},
            {"role": "user", "content": [{"type": "text", "text": prose(user2, seed + 4)}]},
        ]
    })
}

fn bench(c: &mut Criterion) {
    warm_up();
    let big = chat_body(100 * 1024);
    let small = json!({
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": prose(200 - 26, 5)},
        ]
    });

    // A text never seen before, in a language this thread has counted before: each iteration
    // a new body (new sentences from the same words); the memo of texts is emptied, the
    // thread's table of pieces stays warm from the bodies before it (as on a serving worker).
    let mut g = c.benchmark_group("chat_100KB");
    g.throughput(Throughput::Bytes(100 * 1024));
    for (name, tok) in [
        ("o200k", Tokenizer::O200k),
        ("cl100k", Tokenizer::Cl100k),
        ("chars", Tokenizer::Chars),
    ] {
        let mut seed = 100;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    forget_counts();
                    seed += 1;
                    chat_body_seeded(100 * 1024, seed)
                },
                |body| estimate(Endpoint::Chat, black_box(&body), tok),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();

    // The worst case: a fresh thread's first text (no memo, no remembered pieces).
    let mut g = c.benchmark_group("chat_100KB_cold");
    g.throughput(Throughput::Bytes(100 * 1024));
    for (name, tok) in [("o200k", Tokenizer::O200k), ("cl100k", Tokenizer::Cl100k)] {
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    forget_counts();
                    forget_words();
                },
                |()| estimate(Endpoint::Chat, black_box(&big), tok),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();

    // A new text on a thread that has never counted, as the blocking pool's threads count
    // the connection workers' large bodies: each iteration a new thread, which borrows the
    // spare table of words the last one handed back (`with_spare_words`). Only the estimate
    // is timed, not the thread's start.
    let mut g = c.benchmark_group("chat_100KB_new_thread");
    g.throughput(Throughput::Bytes(100 * 1024));
    for (name, tok) in [("o200k", Tokenizer::O200k), ("cl100k", Tokenizer::Cl100k)] {
        let mut seed = 10_000;
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut took = Duration::ZERO;
                for _ in 0..iters {
                    forget_counts();
                    seed += 1;
                    let body = chat_body_seeded(100 * 1024, seed);
                    took += std::thread::spawn(move || {
                        with_spare_words(|| {
                            let t = Instant::now();
                            let _ = black_box(estimate(Endpoint::Chat, black_box(&body), tok));
                            t.elapsed()
                        })
                    })
                    .join()
                    .expect("the estimate's thread");
                }
                took
            })
        });
    }
    g.finish();

    // The same body again (a chat's history resent): the texts' counts come from the memo.
    let mut g = c.benchmark_group("chat_100KB_seen");
    g.throughput(Throughput::Bytes(100 * 1024));
    for (name, tok) in [("o200k", Tokenizer::O200k), ("cl100k", Tokenizer::Cl100k)] {
        g.bench_function(name, |b| {
            b.iter(|| estimate(Endpoint::Chat, black_box(&big), tok))
        });
    }
    g.finish();

    // For comparison: the library's own `count` over the same message texts (no JSON walk).
    let texts: Vec<&str> = big["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            m["content"]
                .as_str()
                .or_else(|| m["content"][0]["text"].as_str())
        })
        .collect();
    let mut g = c.benchmark_group("library_count_100KB");
    g.throughput(Throughput::Bytes(100 * 1024));
    for (name, lib) in [
        ("o200k", bpe_openai::o200k_base()),
        ("cl100k", bpe_openai::cl100k_base()),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                texts
                    .iter()
                    .map(|t| lib.count(black_box(*t)))
                    .sum::<usize>()
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("chat_200B");
    for (name, tok) in [("o200k", Tokenizer::O200k), ("cl100k", Tokenizer::Cl100k)] {
        g.bench_function(name, |b| {
            b.iter_batched(
                forget_counts,
                |()| estimate(Endpoint::Chat, black_box(&small), tok),
                BatchSize::PerIteration,
            )
        });
        g.bench_function(format!("{name}_seen"), |b| {
            b.iter(|| estimate(Endpoint::Chat, black_box(&small), tok))
        });
    }
    g.finish();

    // The request as it comes, bytes: parsed into a `Value` tree and estimated, against the
    // plain body's estimate read straight from the bytes (what the proxy does for a plain
    // OpenAI chat body). Counts from the memo, as for a resent system prompt.
    let bytes = serde_json::to_vec(&small).unwrap();
    let mut g = c.benchmark_group("chat_200B_from_bytes");
    g.bench_function("value_tree", |b| {
        b.iter(|| {
            let v: Value = serde_json::from_slice(black_box(&bytes)).unwrap();
            estimate(Endpoint::Chat, &v, Tokenizer::O200k)
        })
    });
    g.bench_function("plain", |b| {
        b.iter(|| chat_plain(black_box(&bytes), Tokenizer::O200k))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20)
        .nresamples(10_000)
        .without_plots();
    targets = bench
}
criterion_main!(benches);
