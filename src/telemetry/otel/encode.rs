//! Span encoding: a finished request's server span and one client span per attempt, written
//! straight into an OTLP `ScopeSpans.spans` buffer, with the GenAI attributes and the decision.
//! The attributes that repeat from request to request (consumer, team, route, states, backend)
//! are copied from a memo of encoded blocks ([`Blocks`]).

use super::notes::Finish;
use super::proto::Writer;
use super::spans::{Finished, Outcome, States, Wall, STATE_KEYS};
use std::collections::HashMap;
use std::sync::Arc;

/// `server.address` and `server.port` of a base URL (`scheme://host[:port]/…`).
fn host_port(url: &str) -> Option<(&str, u16)> {
    let (default, rest) = if let Some(r) = url.strip_prefix("https://") {
        (443, r)
    } else if let Some(r) = url.strip_prefix("http://") {
        (80, r)
    } else {
        return None;
    };
    let auth = rest.split(['/', '?', '#']).next()?;
    let auth = auth.rsplit('@').next()?;
    if let Some(v6) = auth.strip_prefix('[') {
        let (h, after) = v6.split_once(']')?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None => default,
        };
        return Some((h, port));
    }
    match auth.rsplit_once(':') {
        Some((h, p)) => Some((h, p.parse().ok()?)),
        None => Some((auth, default)),
    }
}

/// What tells one span from another in its head: the rest comes from the request.
struct Head<'a> {
    span_id: &'a [u8; 8],
    parent: Option<&'a [u8; 8]>,
    remote_parent: bool,
    /// Start and end, Unix ns.
    times: (u64, u64),
}

/// A span's name 5 (`"{0} {1}"`, or `"{0}"`) and kind 6 (SERVER 2, CLIENT 3): both follow
/// from what the memo blocks are keyed by, and are encoded in them.
fn name_and_kind(w: &mut Writer<'_>, name: (&str, &str), kind: u64) {
    let (a, b) = name;
    if b.is_empty() {
        w.string(5, a);
    } else {
        w.string_pair(5, a, b);
    }
    w.uint(6, kind);
}

/// A span's fields, shared by both kinds, but for its name and kind: ids (1, 2),
/// `trace_state` 3, parent 4, times 7 and 8, and `flags` 16 (the W3C flags, and whether the
/// parent is remote).
fn head(w: &mut Writer<'_>, f: &Finished, h: Head<'_>) {
    // The fixed-size fields are laid out in place and appended at once.
    let mut ids = [0u8; 28];
    ids[0] = 1 << 3 | 2; // trace_id, bytes
    ids[1] = 16;
    ids[2..18].copy_from_slice(&f.ids.trace_id);
    ids[18] = 2 << 3 | 2; // span_id, bytes
    ids[19] = 8;
    ids[20..28].copy_from_slice(h.span_id);
    w.0.extend_from_slice(&ids);
    if let Some(ts) = &f.ids.tracestate {
        w.bytes(3, ts.as_bytes());
    }
    if let Some(p) = h.parent {
        let mut b = [0u8; 10];
        b[0] = 4 << 3 | 2; // parent_span_id, bytes
        b[1] = 8;
        b[2..].copy_from_slice(p);
        w.0.extend_from_slice(&b);
    }
    // SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE (0x100) | IS_REMOTE (0x200) | sampled (0x01).
    let flags: u32 = 0x101 | if h.remote_parent { 0x200 } else { 0 };
    let mut t = [0u8; 24];
    t[0] = 7 << 3 | 1; // start_time_unix_nano, fixed64
    t[1..9].copy_from_slice(&h.times.0.to_le_bytes());
    t[9] = 8 << 3 | 1; // end_time_unix_nano, fixed64
    t[10..18].copy_from_slice(&h.times.1.to_le_bytes());
    t[18] = 0x85; // flags = 16, fixed32: key 133 as a two-byte varint
    t[19] = 0x01;
    t[20..24].copy_from_slice(&flags.to_le_bytes());
    w.0.extend_from_slice(&t);
}

/// `Status { message 2, code 3 }`, code 2 = ERROR.
fn error_status(w: &mut Writer<'_>, message: &str) {
    w.message(15, |w| {
        w.string(2, message);
        w.uint(3, 2);
    });
}

/// Attribute field of `Span`.
const A: u32 = 9;

/// Counts are u64 in the record; OTLP integers are i64.
fn sat(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The answer's GenAI attributes: the response model and finish reasons (`said`, from
/// [`Said::update`]), then the usage and cache counts.
fn answer_attrs(w: &mut Writer<'_>, f: &Finished, said: &[u8]) {
    let d = f.decision();
    w.0.extend_from_slice(said);
    if let Some((i, o)) = d.usage {
        w.attr_int(A, "gen_ai.usage.input_tokens", sat(i));
        w.attr_int(A, "gen_ai.usage.output_tokens", sat(o));
    }
    if let Some(c) = f.notes.cached {
        w.attr_int(A, "gen_ai.usage.cache_read.input_tokens", sat(c));
    }
    if d.cache_write_tokens > 0 {
        w.attr_int(
            A,
            "gen_ai.usage.cache_creation.input_tokens",
            sat(d.cache_write_tokens),
        );
    }
}

/// The last answer's response model and finish reasons, encoded: both spans of a served
/// request carry them, and consecutive answers mostly say the same.
#[derive(Debug, Default)]
struct Said {
    model: Option<Arc<str>>,
    finish: Finish,
    block: Vec<u8>,
}

impl Said {
    /// Makes [`Said::block`] that of `f`'s answer, encoding it only when it differs from the
    /// last one.
    fn update(&mut self, f: &Finished) {
        let model = f
            .notes
            .model
            .as_ref()
            .or(f.decision().upstream_model.as_ref());
        if !self.block.is_empty()
            && self.model.as_deref() == model.map(|m| &**m)
            && self.finish == f.notes.finish
        {
            return;
        }
        self.block.clear();
        let mut w = Writer(&mut self.block);
        if let Some(m) = model {
            w.attr_str(A, "gen_ai.response.model", m);
        }
        if !f.notes.finish.is_empty() {
            w.attr_strs(A, "gen_ai.response.finish_reasons", f.notes.finish.iter());
        }
        self.model = model.cloned();
        self.finish.clone_from(&f.notes.finish);
    }
}

/// Attributes that repeat from request to request, encoded once per distinct set and copied
/// after that, with the span's name and kind: on the server span, operation, method, path,
/// route, provider, the eight states, consumer, team, policy version and backend (17 of its
/// ~30); on a client span, operation, provider, model, backend, probe and the backend's
/// address (9 of its ~15).
#[derive(Debug, Default)]
pub(crate) struct Blocks {
    server: Memo<ServerKey>,
    client: Memo<ClientKey>,
    said: Said,
    /// The server span's small numbers (output cap, attempts, status), as last encoded.
    server_ints: Last<(u64, usize, u16)>,
    /// A served attempt's small numbers (output cap, attempt, status), as last encoded.
    client_ints: Last<(u64, u32, u16)>,
    /// The served answer's attributes of the request being encoded (both spans carry them).
    answer: Vec<u8>,
}

/// A block of attributes whose values mostly repeat from one request to the next (an output
/// cap, an attempt number, a status): encoded again only when they differ from the last.
#[derive(Debug)]
struct Last<K> {
    key: Option<K>,
    block: Vec<u8>,
}

impl<K> Default for Last<K> {
    fn default() -> Self {
        Last {
            key: None,
            block: Vec::new(),
        }
    }
}

impl<K: PartialEq> Last<K> {
    /// Appends the block of `key`, encoding it with `encode` when it is not the last one.
    fn write(&mut self, out: &mut Vec<u8>, key: K, encode: impl FnOnce(&mut Writer<'_>)) {
        if self.key.as_ref() != Some(&key) {
            self.block.clear();
            encode(&mut Writer(&mut self.block));
            self.key = Some(key);
        }
        out.extend_from_slice(&self.block);
    }
}

/// Most distinct sets kept per kind (a consumer id per caller could make many): past it, the
/// memo starts over.
const MAX_BLOCKS: usize = 1024;

/// Encoded blocks by the hash of what they were encoded from; a hash whose key differs (a
/// collision) is encoded afresh and replaces the entry. The block used last is kept aside
/// too: consecutive requests mostly share it, and it is found by a plain comparison, without
/// hashing.
#[derive(Debug)]
struct Memo<K> {
    map: HashMap<u64, (K, Vec<u8>), foldhash::fast::RandomState>,
    last: Option<(K, Vec<u8>)>,
}

impl<K> Default for Memo<K> {
    fn default() -> Self {
        Memo {
            map: HashMap::default(),
            last: None,
        }
    }
}

impl<K: Clone> Memo<K> {
    /// Appends the block of the key that `same` accepts, trying the last one first (the hash
    /// is only computed when the key changed).
    fn write(
        &mut self,
        out: &mut Vec<u8>,
        same: impl Fn(&K) -> bool,
        hash: impl FnOnce() -> u64,
        key: impl FnOnce() -> K,
        encode: impl FnOnce(&mut Writer<'_>),
    ) {
        if let Some((k, block)) = &self.last {
            if same(k) {
                out.extend_from_slice(block);
                return;
            }
        }
        let h = hash();
        if let Some((k, block)) = self.map.get(&h) {
            if same(k) {
                out.extend_from_slice(block);
                self.last = Some((k.clone(), block.clone()));
                return;
            }
        }
        let mut block = Vec::with_capacity(640);
        encode(&mut Writer(&mut block));
        out.extend_from_slice(&block);
        if self.map.len() >= MAX_BLOCKS {
            self.map.clear();
        }
        let k = key();
        self.last = Some((k.clone(), block.clone()));
        self.map.insert(h, (k, block));
    }
}

/// The same text: the same `Arc` (the policy's, mostly), or equal bytes (a per-request id).
fn same_text(a: &Arc<str>, b: &Arc<str>) -> bool {
    Arc::ptr_eq(a, b) || **a == **b
}

/// `&'static str`s are compared by address (equal addresses are equal strings; unequal ones at
/// worst cost a second entry), the others by content.
fn static_id(s: &'static str) -> (usize, usize) {
    (s.as_ptr() as usize, s.len())
}

fn hasher() -> impl std::hash::Hasher {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x746f_6c6c).build_hasher()
}

#[derive(Debug, Clone)]
struct ServerKey {
    statics: [(usize, usize); 3],
    states: States,
    strs: [Arc<str>; 4],
    team: Option<Arc<str>>,
}

#[derive(Debug, Clone)]
struct ClientKey {
    statics: [(usize, usize); 2],
    probe: bool,
    model: Arc<str>,
    backend: Arc<str>,
    base_url: Arc<str>,
}

fn served_provider(f: &Finished) -> &'static str {
    f.served().map_or("", |a| a.provider)
}

impl Blocks {
    fn server(&mut self, w: &mut Writer<'_>, f: &Finished) {
        use std::hash::{Hash, Hasher};
        let d = f.decision();
        let statics = [
            static_id(f.op),
            static_id(f.path),
            static_id(served_provider(f)),
        ];
        let strs = [&d.route, &d.consumer, &d.policy_version, &d.backend];
        self.server.write(
            w.0,
            |k| {
                k.statics == statics
                    && k.states == d.states
                    && k.strs.iter().zip(strs).all(|(a, b)| same_text(a, b))
                    && match (&k.team, &d.team) {
                        (None, None) => true,
                        (Some(a), Some(b)) => same_text(a, b),
                        _ => false,
                    }
            },
            || {
                let mut h = hasher();
                statics.hash(&mut h);
                d.states.hash(&mut h);
                for s in strs {
                    s.hash(&mut h);
                }
                d.team.hash(&mut h);
                h.finish()
            },
            || ServerKey {
                statics,
                states: d.states,
                strs: strs.map(Arc::clone),
                team: d.team.clone(),
            },
            |w| {
                name_and_kind(w, (f.op, &d.route), 2); // SERVER
                w.attr_str(A, "gen_ai.operation.name", f.op);
                w.attr_str(A, "http.request.method", "POST");
                w.attr_str(A, "url.path", f.path);
                if !d.route.is_empty() {
                    w.attr_str(A, "gen_ai.request.model", &d.route);
                }
                if f.served().is_some() {
                    w.attr_str(A, "gen_ai.provider.name", served_provider(f));
                }
                for (k, v) in STATE_KEYS.iter().zip(d.states.strs()) {
                    w.attr_str(A, k, v);
                }
                w.attr_str(A, "tollgate.consumer", &d.consumer);
                if let Some(t) = &d.team {
                    w.attr_str(A, "tollgate.team", t);
                }
                w.attr_str(A, "tollgate.route", &d.route);
                w.attr_str(A, "tollgate.policy_version", &d.policy_version);
                w.attr_str(A, "tollgate.backend", &d.backend);
            },
        );
    }

    fn client(&mut self, w: &mut Writer<'_>, f: &Finished, a: &super::spans::AttemptDone) {
        use std::hash::{Hash, Hasher};
        let statics = [static_id(f.op), static_id(a.provider)];
        self.client.write(
            w.0,
            |k| {
                k.statics == statics
                    && k.probe == a.probe
                    && same_text(&k.model, &a.model)
                    && same_text(&k.backend, &a.backend)
                    && same_text(&k.base_url, &a.base_url)
            },
            || {
                let mut h = hasher();
                statics.hash(&mut h);
                a.probe.hash(&mut h);
                a.model.hash(&mut h);
                a.backend.hash(&mut h);
                a.base_url.hash(&mut h);
                h.finish()
            },
            || ClientKey {
                statics,
                probe: a.probe,
                model: a.model.clone(),
                backend: a.backend.clone(),
                base_url: a.base_url.clone(),
            },
            |w| {
                name_and_kind(w, (f.op, &a.model), 3); // CLIENT
                w.attr_str(A, "gen_ai.operation.name", f.op);
                w.attr_str(A, "gen_ai.provider.name", a.provider);
                w.attr_str(A, "gen_ai.request.model", &a.model);
                w.attr_str(A, "tollgate.backend", &a.backend);
                w.attr_bool(A, "tollgate.probe", a.probe);
                if let Some((h, p)) = host_port(&a.base_url) {
                    w.attr_str(A, "server.address", h);
                    w.attr_int(A, "server.port", i64::from(p));
                }
            },
        );
    }
}

/// An attempt's output cap and number.
fn attempt_ints(w: &mut Writer<'_>, a: &super::spans::AttemptDone) {
    w.attr_int(A, "gen_ai.request.max_tokens", sat(a.max_tokens));
    w.attr_int(A, "tollgate.attempt", i64::from(a.attempt));
}

/// Appends one span (`ScopeSpans.spans = 2`) to `out`.
fn span(out: &mut Vec<u8>, body: impl FnOnce(&mut Writer<'_>)) {
    Writer(out).message_2(2, body);
}

/// Appends a finished request's spans (`ScopeSpans.spans = 2`) to `out`: the server span,
/// then one client span per attempt.
/// `wall` places the record's monotonic instants on the wall clock.
pub(crate) fn encode_spans(blocks: &mut Blocks, out: &mut Vec<u8>, f: &Finished, wall: &Wall) {
    let d = f.decision();
    let mut status = itoa::Buffer::new();
    let mut answer = std::mem::take(&mut blocks.answer);
    answer.clear();
    if f.served().is_some() {
        blocks.said.update(f);
        answer_attrs(&mut Writer(&mut answer), f, &blocks.said.block);
    }
    span(out, |w| {
        head(
            w,
            f,
            Head {
                span_id: &f.span_id,
                parent: f.parent.as_ref(),
                remote_parent: f.parent.is_some(),
                times: (wall.ns(f.start), wall.ns(f.end)),
            },
        );
        blocks.server(w, f);
        if f.served().is_some() {
            w.0.extend_from_slice(&answer);
        }
        w.attr_str(A, "tollgate.request_id", &d.request_id);
        w.attr_str(A, "tollgate.job_id", &d.job_id);
        w.attr_double(A, "tollgate.cost_usd", d.cost_usd);
        if d.http_status >= 400 {
            w.attr_int(A, "http.response.status_code", i64::from(d.http_status));
            w.attr_str(A, "error.type", d.reason());
            if d.http_status >= 500 {
                error_status(w, d.reason());
            }
        }
        let key = (d.requested_output_tokens, d.attempts, d.http_status);
        blocks.server_ints.write(w.0, key, |w| {
            if d.requested_output_tokens > 0 {
                w.attr_int(
                    A,
                    "gen_ai.request.max_tokens",
                    sat(d.requested_output_tokens),
                );
            }
            w.attr_int(A, "tollgate.attempts", sat(d.attempts as u64));
            if d.http_status < 400 {
                w.attr_int(A, "http.response.status_code", i64::from(d.http_status));
            }
        });
    });
    for a in f.attempts.iter() {
        span(out, |w| {
            head(
                w,
                f,
                Head {
                    span_id: &a.span_id,
                    parent: Some(&f.span_id),
                    remote_parent: false,
                    times: (wall.ns(a.start), wall.ns(a.end)),
                },
            );
            blocks.client(w, f, a);
            let error: Option<&str> = match a.outcome {
                Outcome::Served => {
                    w.0.extend_from_slice(&answer);
                    let key = (a.max_tokens, a.attempt, d.http_status);
                    blocks.client_ints.write(w.0, key, |w| {
                        w.attr_int(A, "gen_ai.request.max_tokens", sat(a.max_tokens));
                        w.attr_int(A, "tollgate.attempt", i64::from(a.attempt));
                        w.attr_int(A, "http.response.status_code", i64::from(d.http_status));
                    });
                    None
                }
                Outcome::Failed(class, st) => {
                    attempt_ints(w, a);
                    if let Some(st) = st {
                        w.attr_int(A, "http.response.status_code", i64::from(st));
                    }
                    Some(class)
                }
                Outcome::Status(st) => {
                    attempt_ints(w, a);
                    w.attr_int(A, "http.response.status_code", i64::from(st));
                    Some(status.format(st))
                }
                Outcome::Skipped(why) => {
                    attempt_ints(w, a);
                    w.attr_str(A, "tollgate.skipped", why);
                    Some("skipped")
                }
            };
            if let Some(at) = a.first_chunk {
                // Span.events = 11: Event { time 1, name 2 }
                w.message(11, |w| {
                    w.fixed64(1, wall.ns(at));
                    w.string(2, "gen_ai.first_chunk");
                });
            }
            if let Some(e) = error {
                w.attr_str(A, "error.type", e);
                error_status(w, e);
            }
        });
    }
    blocks.answer = answer;
}

#[cfg(test)]
mod tests {
    use super::super::notes::Notes;
    use super::super::spans::{
        AttemptDone, Attempts, Decision, Finished, Outcome, States, TraceIds,
    };
    use super::host_port;
    use super::{encode_spans, Blocks, Wall};
    use crate::governor::{FinalAction, ReasonClass, UsageEvidence};
    use std::sync::Arc;

    fn finished(consumer: &str, team: Option<&str>, model: &str) -> Finished {
        Finished {
            ids: TraceIds {
                trace_id: [1; 16],
                sampled: true,
                tracestate: None,
            },
            span_id: [2; 8],
            parent: None,
            start: 1,
            end: 2,
            op: "chat",
            path: "/v1/chat/completions",
            notes: Notes::default(),
            attempts: Attempts::from(vec![AttemptDone {
                span_id: [3; 8],
                start: 1,
                end: 2,
                backend: Arc::from("b"),
                provider: "openai",
                model: Arc::from(model),
                base_url: "http://h:1/v1".into(),
                max_tokens: 9,
                attempt: 1,
                probe: false,
                first_chunk: None,
                outcome: Outcome::Served,
            }]),
            decision: Some(Decision {
                states: States {
                    usage_evidence: UsageEvidence::Actual,
                    ..States::default()
                },
                http_status: 200,
                route: Arc::from("chat"),
                consumer: Arc::from(consumer),
                team: team.map(Arc::from),
                policy_version: Arc::from("v1"),
                backend: Arc::from("b"),
                request_id: Arc::from("r"),
                job_id: Arc::from("j"),
                upstream_model: None,
                requested_output_tokens: 9,
                usage: Some((1, 2)),
                cache_write_tokens: 0,
                cost_usd: 0.0,
                attempts: 1,
            }),
        }
    }

    /// The spans of one encoded request, decoded with the official types.
    fn decode(b: &[u8]) -> Vec<opentelemetry_proto::tonic::trace::v1::Span> {
        use prost::Message;
        opentelemetry_proto::tonic::trace::v1::ScopeSpans::decode(b)
            .unwrap()
            .spans
    }

    fn attr(sp: &opentelemetry_proto::tonic::trace::v1::Span, k: &str) -> Option<String> {
        use opentelemetry_proto::tonic::common::v1::any_value::Value;
        sp.attributes.iter().find(|kv| kv.key == k).and_then(|kv| {
            match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => Some(s.clone()),
                other => Some(format!("{other:?}")),
            }
        })
    }

    #[test]
    fn repeated_attributes_come_from_the_memo_and_differing_ones_do_not() {
        let mut blocks = Blocks::default();
        let cases = [
            ("alice", None, "m1"),
            ("alice", None, "m1"),
            ("bob", Some("payments"), "m1"),
            ("alice", None, "m2"),
            ("alice", Some("payments"), "m1"),
        ];
        for (consumer, team, model) in cases {
            let mut out = Vec::new();
            encode_spans(
                &mut blocks,
                &mut out,
                &finished(consumer, team, model),
                &Wall::now(),
            );
            let spans = decode(&out);
            assert_eq!(spans.len(), 2);
            let (server, client) = (&spans[0], &spans[1]);
            assert_eq!(attr(server, "tollgate.consumer").as_deref(), Some(consumer));
            assert_eq!(attr(server, "tollgate.team").as_deref(), team);
            assert_eq!(
                attr(server, "tollgate.final_action").as_deref(),
                Some("ALLOW")
            );
            assert_eq!(attr(client, "gen_ai.request.model").as_deref(), Some(model));
            assert_eq!(attr(client, "server.address").as_deref(), Some("h"));
            assert_eq!(client.name, format!("chat {model}"));
            // No attribute twice.
            let mut keys: Vec<&str> = server.attributes.iter().map(|kv| kv.key.as_str()).collect();
            let n = keys.len();
            keys.sort_unstable();
            keys.dedup();
            assert_eq!(keys.len(), n, "{keys:?}");
        }
        assert_eq!(blocks.server.map.len(), 3);
        assert_eq!(blocks.client.map.len(), 2);
        // A decision that differs in one state only has a block of its own.
        let mut f = finished("alice", None, "m1");
        if let Some(d) = f.decision.as_mut() {
            d.states.final_action = FinalAction::HardStop;
            d.states.reason_class = ReasonClass::HardBudgetExceeded;
        }
        let mut out = Vec::new();
        encode_spans(&mut blocks, &mut out, &f, &Wall::now());
        let server = &decode(&out)[0];
        assert_eq!(
            attr(server, "tollgate.final_action").as_deref(),
            Some("HARD_STOP")
        );
        assert_eq!(
            attr(server, "tollgate.reason_class").as_deref(),
            Some("HARD_BUDGET_EXCEEDED")
        );
        assert_eq!(blocks.server.map.len(), 4);
    }

    #[test]
    fn each_answer_carries_its_own_response_model_and_finish_reasons() {
        let mut blocks = Blocks::default();
        let cases: [(Option<&str>, &[&'static str]); 5] = [
            (Some("resp-1"), &["stop"]),
            (Some("resp-1"), &["stop"]),
            (Some("resp-2"), &["stop"]),
            (Some("resp-2"), &["length", "tool_calls"]),
            (None, &[]),
        ];
        for (model, finish) in cases {
            let mut f = finished("alice", None, "m1");
            f.notes.model = model.map(Arc::from);
            f.notes.finish.clear();
            for r in finish {
                f.notes.finish.add(r);
            }
            let mut out = Vec::new();
            encode_spans(&mut blocks, &mut out, &f, &Wall::now());
            for sp in decode(&out) {
                assert_eq!(attr(&sp, "gen_ai.response.model").as_deref(), model);
                let reasons = attr(&sp, "gen_ai.response.finish_reasons");
                if finish.is_empty() {
                    assert_eq!(reasons, None);
                } else {
                    let r = reasons.unwrap();
                    for want in finish {
                        assert!(r.contains(want), "{r}");
                    }
                }
                assert_eq!(
                    attr(&sp, "gen_ai.usage.output_tokens").as_deref(),
                    Some("IntValue(2)")
                );
            }
        }
    }

    #[test]
    fn host_and_port_of_base_urls() {
        assert_eq!(
            host_port("http://127.0.0.1:8080/v1"),
            Some(("127.0.0.1", 8080))
        );
        assert_eq!(
            host_port("https://api.openai.com/v1"),
            Some(("api.openai.com", 443))
        );
        assert_eq!(host_port("http://ollama"), Some(("ollama", 80)));
        assert_eq!(host_port("http://[::1]:11434/api"), Some(("::1", 11434)));
        assert_eq!(host_port("http://u:p@h:9/x"), Some(("h", 9)));
        assert_eq!(host_port("ftp://h"), None);
        assert_eq!(host_port("http://h:notaport/"), None);
    }
}
