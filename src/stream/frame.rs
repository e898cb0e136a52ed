//! The one framer of streamed bodies: SSE events and NDJSON lines, cut out of bytes split
//! anywhere across body frames, with the size cap ([`MAX_EVENT_BYTES`]) that stops a unit that
//! never ends. The SSE meter forwards the raw events it cuts; the providers' translators read
//! the `data` of each event ([`EventSplitter`]) or each line ([`LineSplitter`]).

use super::MAX_EVENT_BYTES;

/// Cuts a byte stream into units (lines, SSE event data).
pub trait Splitter: Default + Send + Sync {
    /// Appends `data` and calls `f` with every unit it completes.
    fn feed(&mut self, data: &[u8], f: impl FnMut(&[u8]));
    /// Calls `f` with a last unit that lacked its terminator.
    fn finish(&mut self, f: impl FnMut(&[u8]));
    /// A unit grew past [`MAX_EVENT_BYTES`]: the splitter dropped it and takes no more input.
    fn overflowed(&self) -> bool;
}

/// The end of the first SSE event in `b` (just past its blank line): `"\n\n"`, `"\r\n\r\n"`,
/// or the mixed `"\n\r\n"` / `"\r\n\n"`.
fn find_event_end(b: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(p) = memchr::memchr(b'\n', &b[from..]) {
        let i = from + p;
        match b.get(i + 1) {
            Some(b'\n') => return Some(i + 2),
            Some(b'\r') if b.get(i + 2) == Some(&b'\n') => return Some(i + 3),
            _ => from = i + 1,
        }
    }
    None
}

/// Cuts raw SSE events (every line of the event, through its blank line) out of bytes split
/// anywhere. An event that arrives whole inside one input is handed out without a copy; only
/// an unfinished event is held, and its scan resumes where the previous one stopped, so an
/// event arriving in many frames is scanned once. An unfinished event past
/// [`MAX_EVENT_BYTES`] is dropped and the framer takes no more input.
#[derive(Debug, Default)]
pub struct SseFramer {
    /// Bytes of an event not yet complete.
    pending: Vec<u8>,
    /// How much of `pending` was already scanned for an event end.
    scanned: usize,
    overflow: bool,
}

impl SseFramer {
    /// Appends `data` and calls `f` with every raw event it completes, in order.
    pub fn feed(&mut self, data: &[u8], mut f: impl FnMut(&[u8])) {
        if self.overflow {
            return;
        }
        if self.pending.is_empty() {
            let mut start = 0;
            while let Some(end) = find_event_end(&data[start..]) {
                f(&data[start..start + end]);
                start += end;
            }
            self.hold(&data[start..]);
            return;
        }
        self.pending.extend_from_slice(data);
        // Less the two bytes a terminator may straddle.
        let mut from = self.scanned.saturating_sub(2);
        let mut start = 0;
        while let Some(end) = find_event_end(&self.pending[from..]) {
            let stop = from + end;
            f(&self.pending[start..stop]);
            start = stop;
            from = stop;
        }
        if start == self.pending.len() {
            self.pending.clear();
            self.scanned = 0;
        } else {
            self.pending.drain(..start);
            self.check_cap();
        }
    }

    /// Keeps `rest` (the start of an unfinished event) when `pending` is empty.
    fn hold(&mut self, rest: &[u8]) {
        if rest.len() > MAX_EVENT_BYTES {
            self.overflow();
            return;
        }
        self.pending.extend_from_slice(rest);
        self.scanned = self.pending.len();
    }

    fn check_cap(&mut self) {
        if self.pending.len() > MAX_EVENT_BYTES {
            self.overflow();
        } else {
            self.scanned = self.pending.len();
        }
    }

    fn overflow(&mut self) {
        self.overflow = true;
        self.pending = Vec::new();
        self.scanned = 0;
    }

    /// No unfinished event is held.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// An unfinished event passed [`MAX_EVENT_BYTES`]: it was dropped, and so is all input since.
    pub fn overflowed(&self) -> bool {
        self.overflow
    }

    /// What is left when the stream ends: an event without its blank line (maybe empty).
    pub fn take_rest(&mut self) -> Vec<u8> {
        self.scanned = 0;
        std::mem::take(&mut self.pending)
    }
}

/// The `data` of a raw SSE event: its `data:` lines (one leading space dropped) joined with
/// `\n`; `None` when it has no `data:` line. `event:`, `id:` and comment lines are dropped.
/// One data line is returned in place; several are joined in `buf`.
pub fn event_data<'a>(raw: &'a [u8], buf: &'a mut Vec<u8>) -> Option<&'a [u8]> {
    let mut first: Option<&'a [u8]> = None;
    let mut joined = false;
    for line in raw.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(rest) = line.strip_prefix(b"data:") else {
            continue;
        };
        let value = rest.strip_prefix(b" ").unwrap_or(rest);
        match first {
            None => first = Some(value),
            Some(f) => {
                if !joined {
                    buf.clear();
                    buf.extend_from_slice(f);
                    joined = true;
                }
                buf.push(b'\n');
                buf.extend_from_slice(value);
            }
        }
    }
    if joined {
        Some(&buf[..])
    } else {
        first
    }
}

/// Yields the `data` of complete SSE events (multi-line data joined with `\n`); `event:`,
/// `id:` and comment lines are dropped — the providers here name the type inside the data.
/// Events are cut by [`SseFramer`]; an event whose data passes [`MAX_EVENT_BYTES`] overflows
/// the splitter too.
#[derive(Debug, Default)]
pub struct EventSplitter {
    frames: SseFramer,
    /// Where multi-line data is joined.
    buf: Vec<u8>,
    overflow: bool,
}

impl EventSplitter {
    fn on_event(raw: &[u8], buf: &mut Vec<u8>, overflow: &mut bool, f: &mut impl FnMut(&[u8])) {
        if *overflow {
            return;
        }
        if let Some(data) = event_data(raw, buf) {
            if data.len() > MAX_EVENT_BYTES {
                *overflow = true;
                *buf = Vec::new();
            } else {
                f(data);
            }
        }
    }
}

impl Splitter for EventSplitter {
    fn feed(&mut self, bytes: &[u8], mut f: impl FnMut(&[u8])) {
        let Self {
            frames,
            buf,
            overflow,
        } = self;
        if *overflow {
            return;
        }
        frames.feed(bytes, |raw| Self::on_event(raw, buf, overflow, &mut f));
    }

    fn overflowed(&self) -> bool {
        self.overflow || self.frames.overflowed()
    }

    /// Dispatches a last event that lacked its blank line.
    fn finish(&mut self, mut f: impl FnMut(&[u8])) {
        if self.overflowed() {
            return;
        }
        let rest = self.frames.take_rest();
        Self::on_event(&rest, &mut self.buf, &mut self.overflow, &mut f);
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
