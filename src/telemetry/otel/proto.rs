//! A protobuf writer for the OTLP messages the span export sends, written straight from the
//! compact span records into one reused buffer (no intermediate message structs, no size
//! pass). The field numbers are those of `opentelemetry/proto/{common,resource,trace}/v1`;
//! the tests decode the output with the `opentelemetry-proto` types.

/// Wire types.
const LEN: u32 = 2;
const I64: u32 = 1;
const VARINT: u32 = 0;
const I32: u32 = 5;

pub(crate) struct Writer<'a>(pub &'a mut Vec<u8>);

fn varint(b: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        b.push((v as u8) | 0x80);
        v >>= 7;
    }
    b.push(v as u8);
}

fn varint_len(v: u64) -> usize {
    // 1 byte per 7 bits, at least one.
    ((64 - (v | 1).leading_zeros() as usize) + 6) / 7
}

impl Writer<'_> {
    #[inline]
    fn key(&mut self, field: u32, wire: u32) {
        varint(self.0, u64::from(field << 3 | wire));
    }

    pub fn bytes(&mut self, field: u32, v: &[u8]) {
        self.key(field, LEN);
        varint(self.0, v.len() as u64);
        self.0.extend_from_slice(v);
    }

    pub fn string(&mut self, field: u32, v: &str) {
        self.bytes(field, v.as_bytes());
    }

    pub fn uint(&mut self, field: u32, v: u64) {
        self.key(field, VARINT);
        varint(self.0, v);
    }

    /// `int64` (two's complement as a varint, as protobuf encodes it).
    pub fn int(&mut self, field: u32, v: i64) {
        self.uint(field, v as u64);
    }

    pub fn fixed64(&mut self, field: u32, v: u64) {
        self.key(field, I64);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub fn fixed32(&mut self, field: u32, v: u32) {
        self.key(field, I32);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub fn double(&mut self, field: u32, v: f64) {
        self.fixed64(field, v.to_bits());
    }

    /// A nested message: its bytes are written in place, then its length is put in front
    /// (one byte reserved; longer lengths move the message up).
    pub fn message(&mut self, field: u32, body: impl FnOnce(&mut Writer<'_>)) {
        self.key(field, LEN);
        let at = self.0.len();
        self.0.push(0);
        body(&mut Writer(self.0));
        let len = self.0.len() - at - 1;
        let n = varint_len(len as u64);
        if n > 1 {
            let end = self.0.len();
            self.0.resize(end + n - 1, 0);
            self.0.copy_within(at + 1..end, at + n);
        }
        let mut l = len as u64;
        for i in 0..n {
            let more = if i + 1 < n { 0x80 } else { 0 };
            self.0[at + i] = (l as u8 & 0x7f) | more;
            l >>= 7;
        }
    }

    // `common.v1.KeyValue { key = 1; value = 2 }`, `AnyValue { string = 1; bool = 2;
    // int = 3; double = 4; array = 5 }`, `ArrayValue { values = 1 }`.

    pub fn attr_str(&mut self, field: u32, k: &str, v: &str) {
        self.message(field, |w| {
            w.string(1, k);
            w.message(2, |w| w.string(1, v));
        });
    }

    pub fn attr_int(&mut self, field: u32, k: &str, v: i64) {
        self.message(field, |w| {
            w.string(1, k);
            w.message(2, |w| w.int(3, v));
        });
    }

    pub fn attr_bool(&mut self, field: u32, k: &str, v: bool) {
        self.message(field, |w| {
            w.string(1, k);
            w.message(2, |w| w.uint(2, u64::from(v)));
        });
    }

    pub fn attr_double(&mut self, field: u32, k: &str, v: f64) {
        self.message(field, |w| {
            w.string(1, k);
            w.message(2, |w| w.double(4, v));
        });
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
}
