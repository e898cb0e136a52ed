//! Calendar windows: minute, hour, day and month turn over at local boundaries of the
//! policy's time zone (a day quota resets at local midnight, not at UTC midnight).
//!
//! A window is a maximal stretch of time during which the local clock floored to the window
//! kind stays the same, so windows tile time without gap or overlap even across DST: a day
//! can be 23 or 25 hours, the minutes of a repeated hour are new windows, and a boundary that
//! falls in a DST gap is the end of the gap.

use crate::units::{Millis, Window};
use jiff::civil::DateTime;
use jiff::tz::{Offset, TimeZone};
use jiff::{Timestamp, ToSpan};

/// A concrete window: its kind and its start in Unix seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WindowKey {
    pub window: Window,
    pub start: i64,
}

fn floor(dt: DateTime, w: Window) -> DateTime {
    let (y, mo, d, h, mi) = (dt.year(), dt.month(), dt.day(), dt.hour(), dt.minute());
    match w {
        Window::Minute => jiff::civil::datetime(y, mo, d, h, mi, 0, 0),
        Window::Hour => jiff::civil::datetime(y, mo, d, h, 0, 0, 0),
        Window::Day => jiff::civil::datetime(y, mo, d, 0, 0, 0, 0),
        Window::Month => jiff::civil::datetime(y, mo, 1, 0, 0, 0, 0),
    }
}

fn step(dt: DateTime, w: Window) -> DateTime {
    let r = match w {
        Window::Minute => dt.checked_add(1.minute()),
        Window::Hour => dt.checked_add(1.hour()),
        Window::Day => dt.checked_add(1.day()),
        Window::Month => dt.checked_add(1.month()),
    };
    r.unwrap_or(dt)
}

fn ts(secs: i64) -> Timestamp {
    Timestamp::from_second(secs).unwrap_or(if secs < 0 {
        Timestamp::MIN
    } else {
        Timestamp::MAX
    })
}

/// Seconds since the epoch as read on a UTC clock showing `dt` ("local seconds").
fn local_secs(dt: DateTime) -> i64 {
    Offset::UTC
        .to_timestamp(dt)
        .map(|t| t.as_second())
        .unwrap_or(0)
}

fn offset_at(tz: &TimeZone, secs: i64) -> i64 {
    i64::from(tz.to_offset(ts(secs)).seconds())
}

fn floor_at(tz: &TimeZone, w: Window, secs: i64) -> DateTime {
    floor(
        Offset::UTC.to_datetime(ts(secs.saturating_add(offset_at(tz, secs)))),
        w,
    )
}

/// Latest transition at or before `secs`.
fn prev_transition(tz: &TimeZone, secs: i64) -> Option<i64> {
    tz.preceding(ts(secs.saturating_add(1)))
        .next()
        .map(|t| t.timestamp().as_second())
}

/// First transition strictly after `secs`.
fn next_transition(tz: &TimeZone, secs: i64) -> Option<i64> {
    tz.following(ts(secs))
        .next()
        .map(|t| t.timestamp().as_second())
}

/// Bound on offset transitions looked at around one window (a handful at most in practice).
const MAX_HOPS: usize = 16;

/// An instant with its offset and the transitions around it, looked up once and shared by
/// the four window kinds.
#[derive(Debug, Clone, Copy)]
struct Here {
    secs: i64,
    off: i64,
    /// Latest transition at or before `secs`.
    prev: Option<i64>,
    /// First transition after `secs`.
    next: Option<i64>,
}

impl Here {
    fn at(tz: &TimeZone, secs: i64) -> Self {
        Here {
            secs,
            off: offset_at(tz, secs),
            prev: prev_transition(tz, secs),
            next: next_transition(tz, secs),
        }
    }

    fn floor(&self, w: Window) -> DateTime {
        floor(
            Offset::UTC.to_datetime(ts(self.secs.saturating_add(self.off))),
            w,
        )
    }
}

/// A window is a maximal stretch of time during which the local clock's floor to the window
/// kind (`f`) stays the same. Its start is the first instant of that stretch, found from an
/// instant inside it walking back over offset transitions. Going by the clock and not by
/// resolving `f` once matters when clocks are set back: the minute 01:30 occurs twice in a
/// fold and each occurrence is its own window; a day or (with a one-hour fold) an hour stays
/// one longer window. A boundary in a DST gap starts at the end of the gap.
fn start_of(tz: &TimeZone, w: Window, f: DateTime, h: Here) -> i64 {
    let f_ls = local_secs(f);
    let (mut off, mut prev) = (h.off, h.prev);
    for _ in 0..MAX_HOPS {
        let cand = f_ls - off;
        match prev {
            Some(p) if cand <= p => {
                if floor_at(tz, w, p - 1) != f {
                    return p;
                }
                off = offset_at(tz, p - 1);
                prev = prev_transition(tz, p - 1);
            }
            _ => return cand,
        }
    }
    f_ls - off
}

/// The first instant after `h` (inside the window with floor `f`) at which the local
/// clock's floor is no longer `f`, walking forward over offset transitions.
fn end_of(tz: &TimeZone, w: Window, f: DateTime, h: Here) -> i64 {
    let next_ls = local_secs(step(f, w));
    let (mut off, mut next) = (h.off, h.next);
    for _ in 0..MAX_HOPS {
        let cand = next_ls - off;
        match next {
            Some(n) if cand >= n => {
                if floor_at(tz, w, n) != f {
                    return n;
                }
                off = offset_at(tz, n);
                next = next_transition(tz, n);
            }
            _ => return cand,
        }
    }
    next_ls - off
}

/// The window of kind `w` containing `h` and its end in ms; `start <= now < end` always.
fn resolve(tz: &TimeZone, w: Window, h: Here) -> (WindowKey, Millis) {
    let f = h.floor(w);
    let start = start_of(tz, w, f, h);
    let end = end_of(tz, w, f, h);
    (WindowKey { window: w, start }, end.saturating_mul(1000))
}

/// The window of kind `w` that contains `now`.
pub fn window_at(tz: &TimeZone, w: Window, now: Millis) -> WindowKey {
    resolve(tz, w, Here::at(tz, now.div_euclid(1000))).0
}

/// When window `k` ends (the next one starts), in ms since epoch.
pub fn window_end(tz: &TimeZone, k: WindowKey) -> Millis {
    let h = Here::at(tz, k.start);
    end_of(tz, k.window, h.floor(k.window), h).saturating_mul(1000)
}

/// The four current windows at one instant, computed once per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSet {
    keys: [WindowKey; 4],
    ends: [Millis; 4],
}

impl WindowSet {
    pub fn at(tz: &TimeZone, now: Millis) -> Self {
        let ws = [Window::Minute, Window::Hour, Window::Day, Window::Month];
        let h = Here::at(tz, now.div_euclid(1000));
        let both = ws.map(|w| resolve(tz, w, h));
        WindowSet {
            keys: both.map(|b| b.0),
            ends: both.map(|b| b.1),
        }
    }

    fn idx(w: Window) -> usize {
        match w {
            Window::Minute => 0,
            Window::Hour => 1,
            Window::Day => 2,
            Window::Month => 3,
        }
    }

    pub fn key(&self, w: Window) -> WindowKey {
        self.keys[Self::idx(w)]
    }

    /// Whether this set still describes `now` (no window has turned over).
    pub fn holds_at(&self, now: Millis) -> bool {
        now >= self.keys[0].start.saturating_mul(1000) && now < self.ends[0]
    }

    /// End of the current window of kind `w`, ms since epoch.
    pub fn end(&self, w: Window) -> Millis {
        self.ends[Self::idx(w)]
    }
}
