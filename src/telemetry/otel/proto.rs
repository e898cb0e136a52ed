//! A protobuf writer for the OTLP messages the span export sends, written straight from the
//! compact span records into one reused buffer (no intermediate message structs, no size
//! pass). The field numbers are those of `opentelemetry/proto/{common,resource,trace}/v1`;
//! the tests decode the output with the `opentelemetry-proto` types.

/// Wire types.
const LEN: u32 = 2;
const I64: u32 = 1;
const VARINT: u32 = 0;

pub(crate) struct Writer<'a>(pub &'a mut Vec<u8>);

#[inline]
fn varint(b: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        b.push((v as u8) | 0x80);
        v >>= 7;
    }
    b.push(v as u8);
}

/// Writes `v` as a varint at `b[at..]` (room for 10 bytes), returning the end.
#[inline(always)]
pub(crate) fn put_varint(b: &mut [u8], mut at: usize, mut v: u64) -> usize {
    while v >= 0x80 {
        b[at] = (v as u8) | 0x80;
        v >>= 7;
        at += 1;
    }
    b[at] = v as u8;
    at + 1
}

pub(crate) fn varint_len(v: u64) -> usize {
    // 1 byte per 7 bits, at least one.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

impl Writer<'_> {
    #[inline(always)]
    fn key(&mut self, field: u32, wire: u32) {
        varint(self.0, u64::from(field << 3 | wire));
    }

    #[inline(always)]
    pub fn bytes(&mut self, field: u32, v: &[u8]) {
        self.key(field, LEN);
        varint(self.0, v.len() as u64);
        self.0.extend_from_slice(v);
    }

    #[inline(always)]
    pub fn string(&mut self, field: u32, v: &str) {
        self.bytes(field, v.as_bytes());
    }

    /// A string field holding `a`, a space and `b`.
    pub fn string_pair(&mut self, field: u32, a: &str, b: &str) {
        self.key(field, LEN);
        varint(self.0, (a.len() + 1 + b.len()) as u64);
        self.0.extend_from_slice(a.as_bytes());
        self.0.push(b' ');
        self.0.extend_from_slice(b.as_bytes());
    }

    #[inline(always)]
    pub fn uint(&mut self, field: u32, v: u64) {
        self.key(field, VARINT);
        varint(self.0, v);
    }

    #[inline(always)]
    pub fn fixed64(&mut self, field: u32, v: u64) {
        self.key(field, I64);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub fn double(&mut self, field: u32, v: f64) {
        self.fixed64(field, v.to_bits());
    }

    /// A nested message: its bytes are written in place, then its length is put in front
    /// (one byte reserved; longer lengths move the message up).
    pub fn message(&mut self, field: u32, body: impl FnOnce(&mut Writer<'_>)) {
        self.nested(field, 1, body);
    }

    /// A nested message expected to be 128 to 16,383 bytes long (a span): two bytes are
    /// reserved for its length, so only a message outside that range is moved.
    pub fn message_2(&mut self, field: u32, body: impl FnOnce(&mut Writer<'_>)) {
        self.nested(field, 2, body);
    }

    /// Writes `body` after `reserved` bytes, then its length into them, moving the body when
    /// the length's varint takes more or fewer bytes.
    fn nested(&mut self, field: u32, reserved: usize, body: impl FnOnce(&mut Writer<'_>)) {
        self.key(field, LEN);
        let at = self.0.len();
        self.0.resize(at + reserved, 0);
        body(&mut Writer(self.0));
        let end = self.0.len();
        let len = end - at - reserved;
        let n = varint_len(len as u64);
        if n < reserved {
            self.0.copy_within(at + reserved..end, at + n);
            self.0.truncate(end - (reserved - n));
        } else if n > reserved {
            self.0.resize(end + n - reserved, 0);
            self.0.copy_within(at + reserved..end, at + n);
        }
        let mut l = len as u64;
        for i in 0..n {
            let more = if i + 1 < n { 0x80 } else { 0 };
            self.0[at + i] = (l as u8 & 0x7f) | more;
            l >>= 7;
        }
    }

    // `common.v1.KeyValue { key = 1; value = 2 }`, `AnyValue { string = 1; bool = 2;
    // int = 3; double = 4; array = 5 }`, `ArrayValue { values = 1 }`. The small messages
    // are written with their lengths computed first: no moves, one capacity check.

    /// A `KeyValue` whose `AnyValue` body is `any` (`any_len` bytes in all, with `tail`
    /// bytes after it, a string's text). The key, lengths and `any` are laid out on the
    /// stack and appended at once (pushing byte by byte cost a capacity check each).
    #[inline(always)]
    fn kv(&mut self, field: u32, k: &str, any: &[u8], tail: &[u8]) {
        let any_len = any.len() + tail.len();
        let kv_len =
            1 + varint_len(k.len() as u64) + k.len() + 1 + varint_len(any_len as u64) + any_len;
        let mut head = [0u8; 128];
        // At most 26 bytes of tags and varints around the key and `any`.
        if k.len() + any.len() > head.len() - 32 {
            return self.kv_long(field, k, any, tail, kv_len);
        }
        let mut n = put_varint(&mut head, 0, u64::from(field << 3 | LEN));
        n = put_varint(&mut head, n, kv_len as u64);
        head[n] = 1 << 3 | LEN as u8;
        n = put_varint(&mut head, n + 1, k.len() as u64);
        head[n..n + k.len()].copy_from_slice(k.as_bytes());
        n += k.len();
        head[n] = 2 << 3 | LEN as u8;
        n = put_varint(&mut head, n + 1, any_len as u64);
        head[n..n + any.len()].copy_from_slice(any);
        n += any.len();
        let b = &mut *self.0;
        b.reserve(n + tail.len());
        b.extend_from_slice(&head[..n]);
        b.extend_from_slice(tail);
    }

    #[cold]
    fn kv_long(&mut self, field: u32, k: &str, any: &[u8], tail: &[u8], kv_len: usize) {
        let b = &mut *self.0;
        varint(b, u64::from(field << 3 | LEN));
        varint(b, kv_len as u64);
        b.push(1 << 3 | LEN as u8);
        varint(b, k.len() as u64);
        b.extend_from_slice(k.as_bytes());
        b.push(2 << 3 | LEN as u8);
        varint(b, (any.len() + tail.len()) as u64);
        b.extend_from_slice(any);
        b.extend_from_slice(tail);
    }

    #[inline(always)]
    pub fn attr_str(&mut self, field: u32, k: &str, v: &str) {
        let mut any = [0u8; 11];
        any[0] = 1 << 3 | LEN as u8;
        let n = put_varint(&mut any, 1, v.len() as u64);
        self.kv(field, k, &any[..n], v.as_bytes());
    }

    #[inline(always)]
    pub fn attr_int(&mut self, field: u32, k: &str, v: i64) {
        let mut any = [0u8; 11];
        any[0] = 3 << 3 | VARINT as u8;
        let n = put_varint(&mut any, 1, v as u64);
        self.kv(field, k, &any[..n], &[]);
    }

    #[inline(always)]
    pub fn attr_bool(&mut self, field: u32, k: &str, v: bool) {
        self.kv(field, k, &[2 << 3 | VARINT as u8, u8::from(v)], &[]);
    }

    #[inline(always)]
    pub fn attr_double(&mut self, field: u32, k: &str, v: f64) {
        let mut any = [0u8; 9];
        any[0] = 4 << 3 | I64 as u8;
        any[1..].copy_from_slice(&v.to_bits().to_le_bytes());
        self.kv(field, k, &any, &[]);
    }

    pub fn attr_strs<'s>(&mut self, field: u32, k: &str, vs: impl Iterator<Item = &'s str>) {
        self.message(field, |w| {
            w.string(1, k);
            w.message(2, |w| {
                w.message(5, |w| {
                    for v in vs {
                        w.message(1, |w| w.string(1, v));
                    }
                })
            });
        });
    }
}

/// The bytes of a length-delimited field's key and length (`field`, `len`), for writing a
/// message's head in front of a body that is already encoded.
pub(crate) fn head(field: u32, len: usize) -> ([u8; 16], usize) {
    let mut out = [0u8; 16];
    let mut n = 0;
    for mut v in [u64::from(field << 3 | LEN), len as u64] {
        while v >= 0x80 {
            out[n] = (v as u8) | 0x80;
            v >>= 7;
            n += 1;
        }
        out[n] = v as u8;
        n += 1;
    }
    (out, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_lengths() {
        for (v, n) in [
            (0u64, 1),
            (127, 1),
            (128, 2),
            (16_383, 2),
            (16_384, 3),
            (u64::MAX, 10),
        ] {
            let mut b = Vec::new();
            varint(&mut b, v);
            assert_eq!((b.len(), varint_len(v)), (n, n), "{v}");
        }
    }

    #[test]
    fn two_byte_reserved_messages_of_every_length_decode() {
        use opentelemetry_proto::tonic::common::v1::KeyValue;
        use prost::Message;
        for len in [0usize, 1, 100, 127, 128, 5000, 16_383, 16_384, 70_000] {
            let v = "y".repeat(len);
            let mut b = vec![7u8];
            let mut w = Writer(&mut b);
            w.message_2(1, |w| {
                w.string(1, &v);
            });
            let mut rest = &b[2..];
            let n = prost::encoding::decode_varint(&mut rest).unwrap() as usize;
            assert_eq!(n, rest.len(), "{len}");
            assert_eq!(KeyValue::decode(rest).unwrap().key.len(), len);
        }
    }

    #[test]
    fn nested_messages_of_every_length_class_decode() {
        use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
        use prost::Message;
        for len in [0usize, 1, 120, 127, 128, 200, 16_383, 16_384, 70_000] {
            let v = "x".repeat(len);
            let mut b = Vec::new();
            let mut w = Writer(&mut b);
            // As a repeated field 1 of some message: decode the KeyValue itself.
            w.attr_str(1, "k", &v);

            // Strip the outer key and length to get the KeyValue's bytes.
            let mut rest = &b[1..];
            let n = prost::encoding::decode_varint(&mut rest).unwrap() as usize;
            assert_eq!(n, rest.len());
            let kv = KeyValue::decode(rest).unwrap();
            assert_eq!(kv.key, "k");
            match kv.value.unwrap().value.unwrap() {
                any_value::Value::StringValue(s) => assert_eq!(s.len(), len),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn keys_of_every_length_decode_with_every_value_kind() {
        use opentelemetry_proto::tonic::common::v1::any_value::Value;
        use opentelemetry_proto::tonic::resource::v1::Resource;
        use prost::Message;
        // Around the stack layout's limit (96 bytes of key and value head) and far past it.
        for klen in [
            0usize, 1, 80, 85, 86, 87, 88, 95, 96, 97, 127, 128, 300, 20_000,
        ] {
            let k = "k".repeat(klen);
            let mut b = Vec::new();
            let mut w = Writer(&mut b);
            w.attr_int(1, &k, i64::MIN);
            w.attr_double(1, &k, -1.5);
            w.attr_bool(1, &k, false);
            w.attr_str(1, &k, &"v".repeat(klen / 2));
            let r = Resource::decode(&b[..]).unwrap();
            let got: Vec<Value> = r
                .attributes
                .into_iter()
                .map(|kv| {
                    assert_eq!(kv.key.len(), klen);
                    kv.value.unwrap().value.unwrap()
                })
                .collect();
            assert_eq!(
                got,
                [
                    Value::IntValue(i64::MIN),
                    Value::DoubleValue(-1.5),
                    Value::BoolValue(false),
                    Value::StringValue("v".repeat(klen / 2)),
                ],
                "{klen}"
            );
        }
    }

    #[test]
    fn every_value_kind_decodes_as_the_official_type() {
        use opentelemetry_proto::tonic::common::v1::any_value::Value;
        use opentelemetry_proto::tonic::resource::v1::Resource;
        use prost::Message;
        let mut b = Vec::new();
        let mut w = Writer(&mut b);
        // Resource.attributes = 1
        w.attr_int(1, "neg", -5);
        w.attr_int(1, "big", i64::MAX);
        w.attr_bool(1, "yes", true);
        w.attr_double(1, "d", 0.25);
        w.attr_str(1, "s", "naïve");
        w.attr_strs(1, "a", ["stop", "length"].into_iter());
        let r = Resource::decode(&b[..]).unwrap();
        let v: Vec<(String, Value)> = r
            .attributes
            .into_iter()
            .map(|kv| (kv.key, kv.value.unwrap().value.unwrap()))
            .collect();
        assert_eq!(v[0], ("neg".into(), Value::IntValue(-5)));
        assert_eq!(v[1], ("big".into(), Value::IntValue(i64::MAX)));
        assert_eq!(v[2], ("yes".into(), Value::BoolValue(true)));
        assert_eq!(v[3], ("d".into(), Value::DoubleValue(0.25)));
        assert_eq!(v[4], ("s".into(), Value::StringValue("naïve".into())));
        match &v[5].1 {
            Value::ArrayValue(a) => assert_eq!(a.values.len(), 2),
            other => panic!("{other:?}"),
        }
        let (h, n) = head(2, 300);
        assert_eq!(&h[..n], &[0x12, 0xac, 0x02]);
    }
}
