//! The OpenAI SSE meter.

use super::frame::{event_data, SseFramer};
use crate::estimate::{count_output_text, Tokenizer};
use crate::units::Usage;
use bytes::{Bytes, BytesMut};
use serde::Deserialize;

/// OpenAI's usage object (also what OpenAI-compatible providers send).
#[derive(Debug, Deserialize, Default, Clone, Copy, PartialEq, Eq)]
pub struct StreamUsage {
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    #[serde(default)]
    pub completion_tokens: Option<u64>,
    #[serde(default)]
    pub total_tokens: Option<u64>,
    /// `prompt_tokens_details.cached_tokens`: input read from the prompt cache.
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptDetails>,
    /// Input written to the prompt cache, under Anthropic's name (the sidecar's translated
    /// answers and OpenAI-compatible gateways carry it here).
    #[serde(default)]
    pub cache_creation_input_tokens: Option<u64>,
}

#[derive(Debug, Deserialize, Default, Clone, Copy, PartialEq, Eq)]
pub struct PromptDetails {
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

impl StreamUsage {
    /// Provider usage as input/output. Some providers (Gemini's OpenAI endpoint) count
    /// thinking only in `total_tokens`: output is never less than total − prompt.
    pub fn to_usage(self) -> Option<Usage> {
        let input = self.prompt_tokens?;
        let completion = self.completion_tokens.unwrap_or(0);
        let from_total = self.total_tokens.map_or(0, |t| t.saturating_sub(input));
        let cached = self.prompt_tokens_details.and_then(|d| d.cached_tokens);
        Some(Usage {
            input_tokens: input,
            output_tokens: completion.max(from_total),
            cached_input_tokens: cached.unwrap_or(0).min(input),
            cache_write_tokens: self.cache_creation_input_tokens.unwrap_or(0).min(input),
        })
    }
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Option<Vec<ChunkChoice>>,
    #[serde(default)]
    usage: Option<StreamUsage>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Option<Delta>,
    /// Legacy completions stream.
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    function: Option<FnDelta>,
}

#[derive(Deserialize)]
struct FnDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

/// Taps an SSE stream. In pass-through mode every input frame is forwarded as is; in hiding
/// mode only complete events are forwarded (an event split across frames waits for its end)
/// so that the usage-only chunk the client did not ask for can be dropped. Events are cut by
/// the stream framer ([`SseFramer`]).
#[derive(Debug)]
pub struct SseMeter {
    tok: Tokenizer,
    hide_usage: bool,
    /// Cuts the events; holds the bytes of one not yet complete.
    frames: SseFramer,
    /// An event passed [`MAX_EVENT_BYTES`]: the stream must end (as an upstream failure).
    pub oversized: bool,
    /// The last usage seen.
    pub usage: Option<StreamUsage>,
    /// Output tokens counted from the text seen so far.
    pub counted_output: u64,
    /// `data: [DONE]` was seen.
    pub done: bool,
    /// An `error` payload was seen after the 200.
    pub upstream_error: bool,
    /// Events parsed.
    pub events: u64,
}

/// Largest SSE event (or NDJSON line) a stream may carry: 4 MiB, far above any real chunk.
/// Past it the stream ends as an upstream failure instead of growing a buffer without bound.
pub const MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

impl SseMeter {
    pub fn new(tok: Tokenizer, hide_usage: bool) -> Self {
        SseMeter {
            tok,
            hide_usage,
            frames: SseFramer::default(),
            oversized: false,
            usage: None,
            counted_output: 0,
            done: false,
            upstream_error: false,
            events: 0,
        }
    }

    /// Feeds one body frame; returns the bytes to send to the client now. Once an event
    /// grows past [`MAX_EVENT_BYTES`] the meter stops ([`SseMeter::oversized`]) and returns
    /// nothing more.
    pub fn feed(&mut self, frame: &Bytes) -> Bytes {
        if self.oversized {
            return Bytes::new();
        }
        let zero_copy = self.frames.is_empty();
        let mut out = BytesMut::new();
        let mut all_kept_unchanged = true;
        let hide = self.hide_usage;
        let mut frames = std::mem::take(&mut self.frames);
        frames.feed(frame, |ev| match self.inspect(ev) {
            Keep::Unchanged => {
                if hide {
                    out.extend_from_slice(ev);
                }
            }
            Keep::Rewritten(b) => {
                all_kept_unchanged = false;
                out.extend_from_slice(&b);
            }
            Keep::Drop => all_kept_unchanged = false,
        });
        self.frames = frames;
        if self.frames.overflowed() {
            // An event that never ends: stop here rather than hold it without bound.
            self.oversized = true;
            return Bytes::new();
        }
        // Pass-through mode forwards every frame as it is; hiding mode complete events only.
        if !hide || (zero_copy && all_kept_unchanged && self.frames.is_empty()) {
            return frame.clone();
        }
        out.freeze()
    }

    /// Whatever is left when the upstream ends (an event without its blank line).
    pub fn flush(&mut self) -> Bytes {
        let rest = self.frames.take_rest();
        if !rest.is_empty() {
            self.inspect(&rest);
        }
        if self.hide_usage {
            Bytes::from(rest)
        } else {
            Bytes::new()
        }
    }

    /// The usage to commit: the provider's last, else the sidecar's count (`input` estimated).
    pub fn usage_or_count(&self, input_estimate: u64) -> (Usage, bool) {
        match self.usage.and_then(StreamUsage::to_usage) {
            Some(u) => (u, true),
            None => (Usage::new(input_estimate, self.counted_output), false),
        }
    }

    fn inspect(&mut self, ev: &[u8]) -> Keep {
        let mut buf = Vec::new();
        // The meter has always read data with its leading empty `data:` lines dropped.
        let data = event_data(ev, &mut buf).map_or(&[][..], |d| {
            let lead = d.iter().take_while(|&&b| b == b'\n').count();
            &d[lead..]
        });
        if data.is_empty() {
            return Keep::Unchanged;
        }
        self.events += 1;
        if data == b"[DONE]" {
            self.done = true;
            return Keep::Unchanged;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
            return Keep::Unchanged;
        };
        if chunk.error.is_some() {
            self.upstream_error = true;
        }
        if let Some(u) = chunk.usage {
            self.usage = Some(u);
        }
        let mut empty_choices = true;
        for c in chunk.choices.iter().flatten() {
            empty_choices = false;
            if let Some(t) = &c.text {
                self.counted_output += count_output_text(self.tok, t);
            }
            if let Some(d) = &c.delta {
                for s in [&d.content, &d.reasoning_content].into_iter().flatten() {
                    self.counted_output += count_output_text(self.tok, s);
                }
                for tc in d.tool_calls.iter().flatten() {
                    if let Some(f) = &tc.function {
                        for s in [&f.name, &f.arguments].into_iter().flatten() {
                            self.counted_output += count_output_text(self.tok, s);
                        }
                    }
                }
            }
        }
        if !self.hide_usage {
            return Keep::Unchanged;
        }
        if chunk.usage.is_some() && empty_choices && chunk.choices.is_some() {
            return Keep::Drop;
        }
        // The client did not ask for usage: drop the `"usage":null` the upstream added.
        const NULL_USAGE: &[u8] = b",\"usage\":null";
        if let Some(pos) = ev.windows(NULL_USAGE.len()).position(|w| w == NULL_USAGE) {
            let mut b = BytesMut::with_capacity(ev.len());
            b.extend_from_slice(&ev[..pos]);
            b.extend_from_slice(&ev[pos + NULL_USAGE.len()..]);
            return Keep::Rewritten(b.freeze());
        }
        Keep::Unchanged
    }
}

enum Keep {
    Unchanged,
    Rewritten(Bytes),
    Drop,
}
