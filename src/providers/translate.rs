//! Native streams turned into OpenAI chunks: [`Split`] drives a provider's per-unit
//! translation ([`NativeEvents`]) over a framer of [`crate::stream`], and [`Translator`] is the
//! closed set of those translators, one arm per native stream format (enum dispatch).

use super::{anthropic, gemini, ollama, responses};
use crate::stream::{EventSplitter, LineSplitter, Splitter};

/// A provider's translation of one native unit (an SSE event's data, an NDJSON line).
pub trait NativeEvents {
    fn on_event(&mut self, data: &[u8], out: &mut Vec<u8>);
    /// The native stream ended cleanly, after its last unit.
    fn on_end(&mut self, _out: &mut Vec<u8>) {}
    fn failed(&self) -> bool;
}

/// A stream translator made of a framer and a provider's per-unit translation.
#[derive(Debug, Default)]
pub struct Split<S, E> {
    split: S,
    events: E,
    /// The splitter overflowed and the error event was written.
    overflow: bool,
}

impl<S: Splitter, E: NativeEvents> Split<S, E> {
    pub fn new(events: E) -> Self {
        Split {
            split: S::default(),
            events,
            overflow: false,
        }
    }

    /// Native bytes in (split anywhere); OpenAI SSE bytes appended to `out`.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.overflow {
            return;
        }
        let events = &mut self.events;
        self.split.feed(data, |d| events.on_event(d, out));
        if self.split.overflowed() {
            self.overflow = true;
            let v = serde_json::json!({"error": {
                "message": "the upstream sent a stream event larger than tollgate accepts",
                "type": "upstream_error", "code": "upstream_event_too_large", "param": null}});
            out.extend_from_slice(b"data: ");
            let _ = serde_json::to_writer(&mut *out, &v);
            out.extend_from_slice(b"\n\n");
        }
    }

    /// The native body ended without a transport error: emit what completes the stream.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        if self.overflow {
            return;
        }
        let events = &mut self.events;
        self.split.finish(|d| events.on_event(d, out));
        self.events.on_end(out);
    }

    /// The provider reported an error inside the stream (after its 200), or a unit passed its
    /// cap; an OpenAI error event has already been written.
    pub fn failed(&self) -> bool {
        self.overflow || self.events.failed()
    }
}

/// Turns a native stream into OpenAI `chat.completion.chunk` SSE events, frame by frame: one
/// arm per native stream format. The translation always ends with the usage chunk
/// (`choices: []`) and `data: [DONE]` when the native stream completed; the SSE meter
/// downstream hides the usage chunk from a client that did not ask for it, exactly as for an
/// OpenAI upstream.
#[derive(Debug)]
pub enum Translator {
    /// Anthropic Messages SSE.
    Anthropic(Split<EventSplitter, anthropic::MessagesStream>),
    /// Gemini `streamGenerateContent?alt=sse`.
    Gemini(Split<EventSplitter, gemini::GenerateStream>),
    /// Ollama NDJSON.
    Ollama(Split<LineSplitter, ollama::ChatStream>),
    /// OpenAI Responses SSE (read for usage when passed through).
    Responses(Split<EventSplitter, responses::EventsStream>),
}

impl Translator {
    /// Native bytes in (split anywhere); OpenAI SSE bytes appended to `out`.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) {
        match self {
            Translator::Anthropic(t) => t.feed(data, out),
            Translator::Gemini(t) => t.feed(data, out),
            Translator::Ollama(t) => t.feed(data, out),
            Translator::Responses(t) => t.feed(data, out),
        }
    }

    /// The native body ended without a transport error: emit what completes the stream.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        match self {
            Translator::Anthropic(t) => t.finish(out),
            Translator::Gemini(t) => t.finish(out),
            Translator::Ollama(t) => t.finish(out),
            Translator::Responses(t) => t.finish(out),
        }
    }

    /// The provider reported an error inside the stream (after its 200); an OpenAI error
    /// event has already been written.
    pub fn failed(&self) -> bool {
        match self {
            Translator::Anthropic(t) => t.failed(),
            Translator::Gemini(t) => t.failed(),
            Translator::Ollama(t) => t.failed(),
            Translator::Responses(t) => t.failed(),
        }
    }
}
