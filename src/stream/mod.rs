//! Incremental parsing of streamed answers as they pass: SSE events and NDJSON lines split
//! anywhere across body frames (one framer, [`SseFramer`], cuts SSE events for the meter and
//! for the providers' translators), the last usage seen (providers may repeat running
//! totals), the text produced so far counted with the tokenizer, and the usage-only chunk
//! removed when the client did not ask for it. Pure: bytes in, bytes out; no I/O.

mod frame;
mod sse;

#[cfg(test)]
mod tests;

pub use frame::{event_data, EventSplitter, LineSplitter, Splitter, SseFramer};
pub use sse::{PromptDetails, SseMeter, StreamUsage, MAX_EVENT_BYTES};
