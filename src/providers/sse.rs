//! Incremental splitting of native streams: lines (NDJSON) and SSE events, with input split
//! anywhere across body frames.

/// Yields complete lines (without `\n` / `\r\n`) from bytes split anywhere.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
}

impl LineSplitter {
    /// Appends `data` and calls `f` with every line completed by it.
    pub fn feed(&mut self, data: &[u8], mut f: impl FnMut(&[u8])) {
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
        self.buf.extend_from_slice(&data[start..]);
    }

    /// The last line, when the stream ended without a newline.
    pub fn finish(&mut self, mut f: impl FnMut(&[u8])) {
        if !self.buf.is_empty() {
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
}

impl EventSplitter {
    pub fn feed(&mut self, bytes: &[u8], mut f: impl FnMut(&[u8])) {
        let Self {
            lines,
            data,
            has_data,
        } = self;
        lines.feed(bytes, |line| on_line(line, data, has_data, &mut f));
    }

    /// Dispatches a last event that lacked its blank line.
    pub fn finish(&mut self, mut f: impl FnMut(&[u8])) {
        let Self {
            lines,
            data,
            has_data,
        } = self;
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
