//! Incremental splitting of native streams: lines (NDJSON) and SSE events, with input split
//! anywhere across body frames; and [`Split`], which drives a provider's per-unit translation
//! over a splitter as a [`StreamTranslator`].

use super::StreamTranslator;
use crate::stream::MAX_EVENT_BYTES;

/// Cuts a byte stream into units (lines, SSE event data).
pub trait Splitter: Default + Send + Sync {
    /// Appends `data` and calls `f` with every unit it completes.
    fn feed(&mut self, data: &[u8], f: impl FnMut(&[u8]));
    /// Calls `f` with a last unit that lacked its terminator.
    fn finish(&mut self, f: impl FnMut(&[u8]));
    /// A unit grew past [`MAX_EVENT_BYTES`]: the splitter dropped it and takes no more input.
    fn overflowed(&self) -> bool;
}

/// A provider's translation of one native unit (an SSE event's data, an NDJSON line).
pub trait NativeEvents: Send + Sync {
    fn on_event(&mut self, data: &[u8], out: &mut Vec<u8>);
    /// The native stream ended cleanly, after its last unit.
    fn on_end(&mut self, _out: &mut Vec<u8>) {}
    fn failed(&self) -> bool;
}

/// A [`StreamTranslator`] made of a splitter and a provider's per-unit translation.
#[derive(Debug, Default)]
pub struct Split<S, E> {
    split: S,
    events: E,
    /// The splitter overflowed and the error event was written.
    overflow: bool,
}

impl<S: Splitter + 'static, E: NativeEvents + 'static> Split<S, E> {
    pub fn boxed(events: E) -> Box<dyn StreamTranslator> {
        Box::new(Split {
            split: S::default(),
            events,
            overflow: false,
        })
    }
}

impl<S: Splitter, E: NativeEvents> StreamTranslator for Split<S, E> {
    fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) {
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

    fn finish(&mut self, out: &mut Vec<u8>) {
        if self.overflow {
            return;
        }
        let events = &mut self.events;
        self.split.finish(|d| events.on_event(d, out));
        self.events.on_end(out);
    }

    fn failed(&self) -> bool {
        self.overflow || self.events.failed()
    }
}

/// Yields complete lines (without `\n` / `\r\n`) from bytes split anywhere.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
    overflow: bool,
}

impl Splitter for LineSplitter {
    /// Appends `data` and calls `f` with every line completed by it.
    fn feed(&mut self, data: &[u8], mut f: impl FnMut(&[u8])) {
        if self.overflow {
            return;
        }
        let mut start = 0;
        for (i, &b) in data.iter().enumerate() {
            if b == b'\n' {
                if self.buf.is_empty() {
                    f(trim_cr(&data[start..i]));
                } else {
                    self.buf.extend_from_slice(&data[start..i]);
                    let line = std::mem::take(&mut self.buf);
                    f(trim_cr(&line));
                }
                start = i + 1;
            }
        }
        let rest = &data[start..];
        if self.buf.len().saturating_add(rest.len()) > MAX_EVENT_BYTES {
            self.overflow = true;
            self.buf = Vec::new();
            return;
        }
        self.buf.extend_from_slice(rest);
    }

    fn overflowed(&self) -> bool {
        self.overflow
    }

    /// The last line, when the stream ended without a newline.
    fn finish(&mut self, mut f: impl FnMut(&[u8])) {
        if !self.overflow && !self.buf.is_empty() {
            let line = std::mem::take(&mut self.buf);
            f(trim_cr(&line));
        }
    }
}

fn trim_cr(l: &[u8]) -> &[u8] {
    l.strip_suffix(b"\r").unwrap_or(l)
}

/// Yields the `data` of complete SSE events (multi-line data joined with `\n`); `event:`,
/// `id:` and comment lines are dropped — the providers here name the type inside the data.
#[derive(Debug, Default)]
pub struct EventSplitter {
    lines: LineSplitter,
    data: Vec<u8>,
    has_data: bool,
    /// The data of one event passed [`MAX_EVENT_BYTES`] (many `data:` lines, no blank line).
    overflow: bool,
}

impl Splitter for EventSplitter {
    fn feed(&mut self, bytes: &[u8], mut f: impl FnMut(&[u8])) {
        let Self {
            lines,
            data,
            has_data,
            overflow,
        } = self;
        if *overflow {
            return;
        }
        lines.feed(bytes, |line| {
            if !*overflow {
                on_line(line, data, has_data, &mut f);
                if data.len() > MAX_EVENT_BYTES {
                    *overflow = true;
                    *data = Vec::new();
                    *has_data = false;
                }
            }
        });
    }

    fn overflowed(&self) -> bool {
        self.overflow || self.lines.overflowed()
    }

    /// Dispatches a last event that lacked its blank line.
    fn finish(&mut self, mut f: impl FnMut(&[u8])) {
        let Self {
            lines,
            data,
            has_data,
            overflow,
        } = self;
        if *overflow {
            return;
        }
        lines.finish(|line| on_line(line, data, has_data, &mut f));
        if *has_data {
            f(data);
            data.clear();
            *has_data = false;
        }
    }
}

fn on_line(line: &[u8], data: &mut Vec<u8>, has_data: &mut bool, f: &mut impl FnMut(&[u8])) {
    if line.is_empty() {
        if *has_data {
            f(data);
            data.clear();
            *has_data = false;
        }
        return;
    }
    if let Some(rest) = line.strip_prefix(b"data:") {
        if *has_data {
            data.push(b'\n');
        }
        data.extend_from_slice(rest.strip_prefix(b" ").unwrap_or(rest));
        *has_data = true;
    }
}
