//! What an `image_url` content part costs in prompt tokens.
//!
//! OpenAI prices images by detail level, not by URL length: `low` is a flat 85 tokens; `high`
//! (and `auto`, which we treat as `high` to stay on the safe side) is 85 + 170 per 512-px tile
//! after scaling the image to fit 2048x2048 and then its shortest side down to 768 px. These are
//! the GPT-4o/4.1 constants; other model families multiply them, which is a pricing matter.
//!
//! The size of a remote image is unknown without downloading it, which a sidecar must not do, so
//! an `http(s)` image is assumed to be a square of at least 768 px: 4 tiles, 765 tokens
//! ([`IMAGE_UNKNOWN_SIZE_TOKENS`]). That is the common case, not an upper bound: a long thin
//! image (2048x768) costs 8 tiles, 1445 tokens ([`IMAGE_MAX_HIGH_DETAIL_TOKENS`]). For inline
//! `data:` URLs we read the real width and height from the PNG, GIF, WebP or JPEG header, which
//! only needs a small prefix of the base64 payload decoded.

use super::error::{EstimateError, Param};
use serde_json::{Map, Value};

/// Flat cost of a `detail: "low"` image.
pub const IMAGE_LOW_DETAIL_TOKENS: u64 = 85;
/// Base cost of a high-detail image, paid once on top of the tiles.
pub const IMAGE_BASE_TOKENS: u64 = 85;
/// Cost of each 512x512 tile of a high-detail image.
pub const IMAGE_TILE_TOKENS: u64 = 170;
/// Assumed high-detail cost of an image whose size we cannot see: a 2048x2048 image scaled by
/// OpenAI's rules (fit 2048x2048, shortest side to 768) is 768x768, 4 tiles, 85 + 4 * 170.
pub const IMAGE_UNKNOWN_SIZE_TOKENS: u64 = high_detail_tokens(2048, 2048);
/// The most a single high-detail image can cost: 2048x768 after scaling, 4 x 2 tiles.
pub const IMAGE_MAX_HIGH_DETAIL_TOKENS: u64 = high_detail_tokens(2048, 768);

/// Longest side allowed after the first scaling step.
const FIT_BOX: u64 = 2048;
/// Shortest side after the second scaling step.
const SHORT_SIDE: u64 = 768;
/// Tile edge.
const TILE: u64 = 512;
/// How much of a decoded data URL we are willing to scan looking for a JPEG frame header.
const MAX_SCAN_BYTES: usize = 1 << 20;

/// High-detail token cost of a `width` x `height` image under OpenAI's scaling rules. A zero
/// dimension is treated as unknown and costs [`IMAGE_UNKNOWN_SIZE_TOKENS`]. Images are only
/// ever scaled down, never up.
pub const fn high_detail_tokens(width: u64, height: u64) -> u64 {
    if width == 0 || height == 0 {
        return high_detail_tokens(2048, 2048);
    }
    let (mut w, mut h) = (width, height);
    // Fit inside 2048x2048, keeping the aspect ratio.
    let longest = if w > h { w } else { h };
    if longest > FIT_BOX {
        w = ceil_div(w.saturating_mul(FIT_BOX), longest);
        h = ceil_div(h.saturating_mul(FIT_BOX), longest);
    }
    // Then bring the shortest side down to 768.
    let shortest = if w < h { w } else { h };
    if shortest > SHORT_SIDE {
        w = ceil_div(w.saturating_mul(SHORT_SIDE), shortest);
        h = ceil_div(h.saturating_mul(SHORT_SIDE), shortest);
    }
    let tiles = ceil_div(w, TILE).saturating_mul(ceil_div(h, TILE));
    IMAGE_BASE_TOKENS.saturating_add(tiles.saturating_mul(IMAGE_TILE_TOKENS))
}

const fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Tokens for one `{"type":"image_url","image_url":{"url":..,"detail":..}}` part; `param` is
/// the path of the part itself, for error messages.
pub(crate) fn image_part_tokens(
    part: &Map<String, Value>,
    param: Param<'_>,
) -> Result<u64, EstimateError> {
    let image_param = param.key("image_url");
    let image = match part.get("image_url") {
        None | Some(Value::Null) => return Err(EstimateError::missing(image_param)),
        Some(Value::Object(image)) => image,
        Some(_) => {
            return Err(EstimateError::wrong_type(
                image_param,
                "an object with a 'url' string",
            ))
        }
    };
    let url = match image.get("url") {
        None | Some(Value::Null) => return Err(EstimateError::missing(image_param.key("url"))),
        Some(Value::String(url)) => url.as_str(),
        Some(_) => {
            return Err(EstimateError::wrong_type(
                image_param.key("url"),
                "a string",
            ))
        }
    };
    let low = match image.get("detail") {
        None | Some(Value::Null) => false,
        Some(Value::String(d)) => d == "low",
        Some(_) => {
            return Err(EstimateError::wrong_type(
                image_param.key("detail"),
                "one of 'low', 'high' or 'auto'",
            ))
        }
    };
    if low {
        return Ok(IMAGE_LOW_DETAIL_TOKENS);
    }
    Ok(match data_url_dimensions(url) {
        Some((w, h)) => high_detail_tokens(w, h),
        None => IMAGE_UNKNOWN_SIZE_TOKENS,
    })
}

/// Width and height of a base64 `data:` URL image, when its header says so.
pub(crate) fn data_url_dimensions(url: &str) -> Option<(u64, u64)> {
    let rest = url.strip_prefix("data:")?;
    let comma = rest.find(',')?;
    if !rest[..comma].ends_with(";base64") {
        return None;
    }
    let mut bytes = Base64Bytes::new(&rest[comma + 1..]).take(MAX_SCAN_BYTES);
    let head: Vec<u8> = bytes.by_ref().take(30).collect();
    image_header_dimensions(&head).or_else(|| {
        if head.starts_with(&[0xFF, 0xD8]) {
            jpeg_dimensions(
                head.get(2..)
                    .unwrap_or_default()
                    .iter()
                    .copied()
                    .chain(bytes),
            )
        } else {
            None
        }
    })
}

/// PNG, GIF and WebP keep their size within the first 30 bytes.
fn image_header_dimensions(h: &[u8]) -> Option<(u64, u64)> {
    let be32 = |i: usize| {
        Some(u64::from(u32::from_be_bytes(
            h.get(i..i + 4)?.try_into().ok()?,
        )))
    };
    let le16 = |i: usize| {
        Some(u64::from(u16::from_le_bytes(
            h.get(i..i + 2)?.try_into().ok()?,
        )))
    };
    let le24 = |i: usize| match h.get(i..i + 3)? {
        &[a, b, c] => Some(u64::from(a) | u64::from(b) << 8 | u64::from(c) << 16),
        _ => None,
    };
    if h.starts_with(b"\x89PNG\r\n\x1a\n") && h.get(12..16) == Some(b"IHDR") {
        return Some((be32(16)?, be32(20)?));
    }
    if h.starts_with(b"GIF87a") || h.starts_with(b"GIF89a") {
        return Some((le16(6)?, le16(8)?));
    }
    if h.starts_with(b"RIFF") && h.get(8..12) == Some(b"WEBP") {
        return match h.get(12..16)? {
            b"VP8X" => Some((le24(24)? + 1, le24(27)? + 1)),
            b"VP8L" if h.get(20) == Some(&0x2F) => {
                let bits = u32::from_le_bytes(h.get(21..25)?.try_into().ok()?);
                Some((
                    u64::from(bits & 0x3FFF) + 1,
                    u64::from((bits >> 14) & 0x3FFF) + 1,
                ))
            }
            b"VP8 " if h.get(23..26) == Some(&[0x9D, 0x01, 0x2A]) => {
                Some((le16(26)? & 0x3FFF, le16(28)? & 0x3FFF))
            }
            _ => None,
        };
    }
    None
}

/// Walks JPEG segments (starting just after the SOI marker) to the first frame header.
fn jpeg_dimensions(mut it: impl Iterator<Item = u8>) -> Option<(u64, u64)> {
    loop {
        if it.next()? != 0xFF {
            return None;
        }
        let mut marker = it.next()?;
        while marker == 0xFF {
            marker = it.next()?; // fill bytes
        }
        match marker {
            0x01 | 0xD0..=0xD8 => continue, // standalone markers
            0xD9 | 0xDA => return None,     // end of image / start of scan before any frame
            _ => {}
        }
        let len = usize::from(u16::from_be_bytes([it.next()?, it.next()?]));
        let is_frame = matches!(marker, 0xC0..=0xCF) && !matches!(marker, 0xC4 | 0xC8 | 0xCC);
        if is_frame {
            let _precision = it.next()?;
            let h = u16::from_be_bytes([it.next()?, it.next()?]);
            let w = u16::from_be_bytes([it.next()?, it.next()?]);
            return Some((u64::from(w), u64::from(h)));
        }
        if len < 2 {
            return None;
        }
        if len > 2 {
            it.nth(len - 3)?;
        }
    }
}

/// Lazily decodes standard or URL-safe base64, stopping at padding or the first invalid byte.
struct Base64Bytes<'a> {
    src: std::slice::Iter<'a, u8>,
    acc: u32,
    bits: u32,
}

impl<'a> Base64Bytes<'a> {
    fn new(s: &'a str) -> Self {
        Base64Bytes {
            src: s.as_bytes().iter(),
            acc: 0,
            bits: 0,
        }
    }
}

impl Iterator for Base64Bytes<'_> {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        while self.bits < 8 {
            let c = *self.src.next()?;
            let v = match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' | b'-' => 62,
                b'/' | b'_' => 63,
                b'\r' | b'\n' | b' ' | b'\t' => continue,
                _ => return None,
            };
            self.acc = (self.acc << 6) | u32::from(v);
            self.bits += 6;
        }
        self.bits -= 8;
        let byte = (self.acc >> self.bits) as u8;
        self.acc &= (1 << self.bits) - 1;
        Some(byte)
    }
}
