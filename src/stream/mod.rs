//! Incremental parsing of streamed answers as they pass: SSE events split anywhere across
//! body frames, the last usage seen (providers may repeat running totals), the text produced
//! so far counted with the tokenizer, and the usage-only chunk removed when the client did not
//! ask for it. Pure: bytes in, bytes out; no I/O.

mod sse;

#[cfg(test)]
mod tests;

pub use sse::{SseMeter, StreamUsage, MAX_EVENT_BYTES};
