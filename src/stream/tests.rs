use super::*;
use crate::estimate::Tokenizer;
use bytes::Bytes;

fn chunk(content: &str, usage_null: bool) -> String {
    let u = if usage_null { ",\"usage\":null" } else { "" };
    format!(
        "data: {{\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}},\"finish_reason\":null}}]{u}}}\n\n"
    )
}

const USAGE: &str = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":4,\"total_tokens\":12}}\n\n";
const DONE: &str = "data: [DONE]\n\n";

fn run(m: &mut SseMeter, frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        out.extend_from_slice(&m.feed(&Bytes::copy_from_slice(f)));
    }
    out.extend_from_slice(&m.flush());
    out
}

#[test]
fn pass_through_is_byte_for_byte_and_reads_usage() {
    let whole = format!(
        "{}{}{}{}",
        chunk("Hel", true),
        chunk("lo", true),
        USAGE,
        DONE
    );
    let mut m = SseMeter::new(Tokenizer::O200k, false);
    // Split at every 7 bytes: events and UTF-8 both cross frames.
    let frames: Vec<&[u8]> = whole.as_bytes().chunks(7).collect();
    let out = run(&mut m, &frames);
    assert_eq!(out, whole.as_bytes());
    assert_eq!(
        m.usage
            .and_then(|u| u.to_usage())
            .map(|u| (u.input_tokens, u.output_tokens)),
        Some((8, 4))
    );
    assert!(m.done);
    assert!(m.counted_output >= 2);
}

#[test]
fn hiding_removes_the_usage_chunk_and_null_usage_fields() {
    let upstream = format!("{}{}{}{}", chunk("Hi", true), chunk("!", true), USAGE, DONE);
    let client_would_get = format!("{}{}{}", chunk("Hi", false), chunk("!", false), DONE);
    for split in [1usize, 3, 10, 64, 4096] {
        let mut m = SseMeter::new(Tokenizer::O200k, true);
        let frames: Vec<&[u8]> = upstream.as_bytes().chunks(split).collect();
        let out = run(&mut m, &frames);
        assert_eq!(
            String::from_utf8_lossy(&out),
            client_would_get,
            "split {split}"
        );
        assert_eq!(
            m.usage.and_then(|u| u.to_usage()).map(|u| u.output_tokens),
            Some(4)
        );
    }
}

#[test]
fn running_totals_keep_the_last() {
    let a = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"total_tokens\":6}}\n\n";
    let b = "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":9}}\n\n";
    let mut m = SseMeter::new(Tokenizer::O200k, false);
    run(&mut m, &[a.as_bytes(), b.as_bytes()]);
    let u = m.usage.and_then(|u| u.to_usage()).unwrap_or_default();
    assert_eq!(
        (u.input_tokens, u.output_tokens),
        (5, 4),
        "thinking counted only in the total"
    );
}

#[test]
fn no_usage_counts_the_text_and_utf8_split_is_safe() {
    let text = "你好，世界";
    let ev = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n{DONE}");
    let mut m = SseMeter::new(Tokenizer::O200k, true);
    let bytes = ev.as_bytes();
    // Split inside a multi-byte character.
    let out = run(&mut m, &[&bytes[..20], &bytes[20..]]);
    assert_eq!(out, bytes);
    let (u, actual) = m.usage_or_count(11);
    assert!(!actual);
    assert_eq!(u.input_tokens, 11);
    assert_eq!(
        u.output_tokens,
        crate::estimate::count_text(Tokenizer::O200k, text)
    );
}

#[test]
fn crlf_events_and_error_payloads() {
    let s = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\n\r\ndata: {\"error\":{\"message\":\"boom\"}}\r\n\r\n";
    let mut m = SseMeter::new(Tokenizer::O200k, false);
    run(&mut m, &[s.as_bytes()]);
    assert_eq!(m.events, 2);
    assert!(m.upstream_error);
}

#[test]
fn event_data_reads_data_lines_only() {
    let mut buf = Vec::new();
    assert_eq!(
        event_data(b"event: x\r\ndata: a\r\n: c\r\ndata:b\r\n\r\n", &mut buf),
        Some(&b"a\nb"[..])
    );
    let mut buf = Vec::new();
    assert_eq!(event_data(b"data: one\n\n", &mut buf), Some(&b"one"[..]));
    assert!(buf.is_empty(), "one data line is read in place");
    assert_eq!(event_data(b"id: 1\nevent: ping\n\n", &mut buf), None);
    assert_eq!(event_data(b"data:\n\n", &mut buf), Some(&b""[..]));
}

/// A whole event larger than the cap, in one frame: the meter (which caps only what it must
/// hold) forwards it, while the providers' splitter (which caps an event's data) stops.
#[test]
fn a_whole_event_past_the_cap_stops_the_splitter_not_the_meter() {
    let big = format!("data: {}\n\n", "x".repeat(MAX_EVENT_BYTES + 1));
    let mut m = SseMeter::new(Tokenizer::Chars, false);
    let frame = Bytes::from(big.clone());
    assert_eq!(m.feed(&frame), frame);
    assert!(!m.oversized);
    let mut s = EventSplitter::default();
    let mut n = 0;
    s.feed(big.as_bytes(), |_| n += 1);
    assert_eq!(n, 0);
    assert!(s.overflowed());
    // Held across frames, the same event stops both.
    let (head, tail) = big.split_at(big.len() - 2);
    let mut m = SseMeter::new(Tokenizer::Chars, false);
    assert!(m.feed(&Bytes::copy_from_slice(head.as_bytes())).is_empty());
    assert!(m.oversized);
    assert!(m.feed(&Bytes::copy_from_slice(tail.as_bytes())).is_empty());
    let mut s = EventSplitter::default();
    s.feed(head.as_bytes(), |_| n += 1);
    s.feed(tail.as_bytes(), |_| n += 1);
    assert_eq!(n, 0);
    assert!(s.overflowed());
}
