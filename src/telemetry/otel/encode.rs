//! Span encoding: a finished request's server span and one client span per attempt, written
//! straight into an OTLP `ScopeSpans.spans` buffer, with the GenAI attributes and the decision.
//! The attributes that repeat from request to request (consumer, team, route, states, backend)
//! are copied from a memo of encoded blocks ([`Blocks`]), and a span shaped like the last one
//! of its kind is copied from it whole, its own values written over ([`Template`]).

use super::notes::Finish;
use super::proto::{put_varint, varint_len, Writer};
use super::spans::{Decision, Finished, Outcome, States, Wall, STATE_KEYS};
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

/// A span head's fixed-size fields, laid out as they are written: the ids, the parent's id
/// and the times with the flags. They differ from one request to the next; the rest of a
/// span mostly does not (see [`Template`]).
struct HeadParts {
    ids: [u8; 28],
    parent: Option<[u8; 10]>,
    times: [u8; 24],
}

impl HeadParts {
    #[inline(always)]
    fn of(f: &Finished, h: &Head<'_>) -> HeadParts {
        let mut ids = [0u8; 28];
        ids[0] = 1 << 3 | 2; // trace_id, bytes
        ids[1] = 16;
        ids[2..18].copy_from_slice(&f.ids.trace_id);
        ids[18] = 2 << 3 | 2; // span_id, bytes
        ids[19] = 8;
        ids[20..28].copy_from_slice(h.span_id);
        let parent = h.parent.map(|p| {
            let mut b = [0u8; 10];
            b[0] = 4 << 3 | 2; // parent_span_id, bytes
            b[1] = 8;
            b[2..].copy_from_slice(p);
            b
        });
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
        HeadParts {
            ids,
            parent,
            times: t,
        }
    }

    /// Writes the head: ids (1, 2), `trace_state` 3 (the caller's), parent 4, times 7 and 8,
    /// and `flags` 16, noting in `at` where the parts went.
    fn write(&self, w: &mut Writer<'_>, f: &Finished, at: &mut Spots) {
        at.ids = w.0.len();
        w.0.extend_from_slice(&self.ids);
        if let Some(ts) = &f.ids.tracestate {
            w.bytes(3, ts.as_bytes());
        }
        at.parent = w.0.len();
        if let Some(p) = &self.parent {
            w.0.extend_from_slice(p);
        }
        at.times = w.0.len();
        w.0.extend_from_slice(&self.times);
    }
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

/// The answer's counts, as their attributes carry them: input and output tokens, cache reads
/// and cache writes (each when the answer has it).
fn counts(f: &Finished, d: &Decision<'_>) -> [Option<u64>; 4] {
    [
        d.usage.map(|(i, _)| sat(i) as u64),
        d.usage.map(|(_, o)| sat(o) as u64),
        f.notes.cached.map(|c| sat(c) as u64),
        (d.cache_write_tokens > 0).then(|| sat(d.cache_write_tokens) as u64),
    ]
}

/// The names of [`counts`], in order.
const COUNT_KEYS: [&str; 4] = [
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.cache_read.input_tokens",
    "gen_ai.usage.cache_creation.input_tokens",
];

/// The answer's GenAI attributes: the response model and finish reasons (`said`, from
/// [`Said::update`]), then the counts. Returns where each count's varint starts in `w`.
fn answer_attrs(w: &mut Writer<'_>, said: &[u8], counts: &[Option<u64>; 4]) -> [usize; 4] {
    w.0.extend_from_slice(said);
    let mut at = [0; 4];
    for ((k, c), at) in COUNT_KEYS.iter().zip(counts).zip(&mut at) {
        if let Some(c) = *c {
            w.attr_int(A, k, c as i64);
            *at = w.0.len() - varint_len(c);
        }
    }
    at
}

/// The last answer's response model and finish reasons, encoded: both spans of a served
/// request carry them, and consecutive answers mostly say the same.
#[derive(Debug, Default)]
struct Said {
    model: Option<Arc<str>>,
    finish: Finish,
    block: Vec<u8>,
    /// Bumped whenever the block is encoded again (see [`Template`]).
    generation: u64,
}

impl Said {
    /// Makes [`Said::block`] that of `f`'s answer, encoding it only when it differs from the
    /// last one.
    fn update(&mut self, f: &Finished, d: &Decision<'_>) {
        let model = f.notes.model.as_ref().or(d.upstream_model);
        if self.generation > 0
            && same_opt_text(self.model.as_ref(), model)
            && self.finish == f.notes.finish
        {
            return;
        }
        self.block.clear();
        self.generation += 1;
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
    /// The last server span and served attempt's span encoded in full.
    server_tmpl: Template<ServerShape>,
    client_tmpl: Template<ClientShape>,
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
    /// Bumped whenever `last` changes: a span template made with the last block holds it.
    generation: u64,
}

impl<K> Default for Memo<K> {
    fn default() -> Self {
        Memo {
            map: HashMap::default(),
            last: None,
            generation: 0,
        }
    }
}

impl<K: Clone> Memo<K> {
    /// Whether the block used last is the one of the key that `same` accepts.
    fn last_is(&self, same: impl Fn(&K) -> bool) -> bool {
        self.last.as_ref().is_some_and(|(k, _)| same(k))
    }

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
                self.generation += 1;
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
        self.generation += 1;
        self.map.insert(h, (k, block));
    }
}

/// The same text: the same `Arc` (the policy's, mostly), or equal bytes (a per-request id).
fn same_text(a: &Arc<str>, b: &Arc<str>) -> bool {
    Arc::ptr_eq(a, b) || **a == **b
}

/// [`same_text`] of two optional texts (both absent is the same).
fn same_opt_text(a: Option<&Arc<str>>, b: Option<&Arc<str>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => same_text(a, b),
        _ => false,
    }
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

/// What a server span's memo block is keyed by, as the request has it.
struct ServerProbe<'a> {
    statics: [(usize, usize); 3],
    strs: [&'a Arc<str>; 4],
    states: States,
    team: Option<&'a Arc<str>>,
}

impl<'a> ServerProbe<'a> {
    fn of(f: &'a Finished, d: &Decision<'a>) -> ServerProbe<'a> {
        ServerProbe {
            statics: [
                static_id(f.op),
                static_id(f.path),
                static_id(served_provider(f)),
            ],
            strs: [d.route, d.consumer, d.policy_version, d.backend],
            states: d.states,
            team: d.team,
        }
    }

    fn same(&self, k: &ServerKey) -> bool {
        k.statics == self.statics
            && k.states == self.states
            && k.strs.iter().zip(self.strs).all(|(a, b)| same_text(a, b))
            && same_opt_text(k.team.as_ref(), self.team)
    }
}

/// What a client span's memo block is keyed by, as the attempt has it.
fn client_same(k: &ClientKey, f: &Finished, a: &super::spans::AttemptDone) -> bool {
    k.statics == [static_id(f.op), static_id(a.provider)]
        && k.probe == a.probe
        && same_text(&k.model, &a.model)
        && same_text(&k.backend, &a.backend)
        && same_text(&k.base_url, &a.base_url)
}

impl Blocks {
    fn server(&mut self, w: &mut Writer<'_>, f: &Finished, d: &Decision<'_>) {
        use std::hash::{Hash, Hasher};
        let probe = ServerProbe::of(f, d);
        self.server.write(
            w.0,
            |k| probe.same(k),
            || {
                let mut h = hasher();
                probe.statics.hash(&mut h);
                d.states.hash(&mut h);
                for s in probe.strs {
                    s.hash(&mut h);
                }
                d.team.hash(&mut h);
                h.finish()
            },
            || ServerKey {
                statics: probe.statics,
                states: d.states,
                strs: probe.strs.map(Arc::clone),
                team: d.team.cloned(),
            },
            |w| {
                name_and_kind(w, (f.op, d.route), 2); // SERVER
                w.attr_str(A, "gen_ai.operation.name", f.op);
                w.attr_str(A, "http.request.method", "POST");
                w.attr_str(A, "url.path", f.path);
                if !d.route.is_empty() {
                    w.attr_str(A, "gen_ai.request.model", d.route);
                }
                if f.served().is_some() {
                    w.attr_str(A, "gen_ai.provider.name", served_provider(f));
                }
                for (k, v) in STATE_KEYS.iter().zip(d.states.strs()) {
                    w.attr_str(A, k, v);
                }
                w.attr_str(A, "tollgate.consumer", d.consumer);
                if let Some(t) = &d.team {
                    w.attr_str(A, "tollgate.team", t);
                }
                w.attr_str(A, "tollgate.route", d.route);
                w.attr_str(A, "tollgate.policy_version", d.policy_version);
                w.attr_str(A, "tollgate.backend", d.backend);
            },
        );
    }

    fn client(&mut self, w: &mut Writer<'_>, f: &Finished, a: &super::spans::AttemptDone) {
        use std::hash::{Hash, Hasher};
        let statics = [static_id(f.op), static_id(a.provider)];
        self.client.write(
            w.0,
            |k| client_same(k, f, a),
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

/// The last span of one kind encoded in full, copied for the next request of the same
/// shape. Most of a span repeats from one request to the next (the memo blocks, the answer's
/// model and finish reasons, the small numbers); what does not (the head's ids and times, the
/// answer's counts, the request's ids and cost, a stream's first-chunk time) mostly keeps its
/// length. A request of the template's shape copies it at once and writes its own values
/// over the template's, at the places the full encoding noted; any other request is encoded
/// in full, and its span becomes the template.
#[derive(Debug)]
struct Template<S> {
    shape: Option<S>,
    bytes: Vec<u8>,
    at: Spots,
    /// Spans copied from it (the tests check the copies are taken).
    #[cfg(test)]
    copies: usize,
}

impl<S> Default for Template<S> {
    fn default() -> Self {
        Template {
            shape: None,
            bytes: Vec::new(),
            at: Spots::default(),
            #[cfg(test)]
            copies: 0,
        }
    }
}

/// Where a span's own values are, from its first byte (as the full encoding noted them).
#[derive(Debug, Default, Clone, Copy)]
struct Spots {
    /// The head's ids, its parent's id, its times (see [`HeadParts`]).
    ids: usize,
    parent: usize,
    times: usize,
    /// Each count's varint (see [`counts`]).
    counts: [usize; 4],
    /// The text of `tollgate.request_id` and `tollgate.job_id`, and the bits of
    /// `tollgate.cost_usd` (server span).
    request_id: usize,
    job_id: usize,
    cost: usize,
    /// The first-chunk event's time (client span).
    first_chunk: usize,
}

impl Spots {
    /// The spots from the span's first byte. A spot the span has no value for was never set
    /// (0) and stays 0: the template's shape says the value is absent, so it is never written.
    fn relative_to(self, start: usize) -> Spots {
        Spots {
            ids: self.ids - start,
            parent: self.parent - start,
            times: self.times - start,
            counts: self.counts.map(|c| c.saturating_sub(start)),
            request_id: self.request_id.saturating_sub(start),
            job_id: self.job_id.saturating_sub(start),
            cost: self.cost.saturating_sub(start),
            first_chunk: self.first_chunk.saturating_sub(start),
        }
    }
}

/// A span's own values, written over a template's.
struct Own<'a> {
    head: &'a HeadParts,
    counts: &'a [Option<u64>; 4],
    /// Server span: the request's ids and cost.
    ids_cost: Option<(&'a [u8], &'a [u8], f64)>,
    /// Client span: the first chunk's time.
    first_chunk: Option<u64>,
}

impl<S: PartialEq> Template<S> {
    /// Copies the template to `out` with the request's own values written over its own, when
    /// the request's span has the template's shape; `false` (nothing written) otherwise.
    fn apply(&mut self, out: &mut Vec<u8>, shape: &S, own: &Own<'_>) -> bool {
        if self.shape.as_ref() != Some(shape) {
            return false;
        }
        let at = &self.at;
        let start = out.len();
        out.extend_from_slice(&self.bytes);
        let o = &mut out[start..];
        o[at.ids..][..own.head.ids.len()].copy_from_slice(&own.head.ids);
        if let Some(p) = &own.head.parent {
            o[at.parent..][..p.len()].copy_from_slice(p);
        }
        o[at.times..][..own.head.times.len()].copy_from_slice(&own.head.times);
        for (c, &at) in own.counts.iter().zip(&at.counts) {
            if let Some(c) = *c {
                put_varint(o, at, c);
            }
        }
        if let Some((request_id, job_id, cost)) = own.ids_cost {
            o[at.request_id..][..request_id.len()].copy_from_slice(request_id);
            o[at.job_id..][..job_id.len()].copy_from_slice(job_id);
            o[at.cost..][..8].copy_from_slice(&cost.to_bits().to_le_bytes());
        }
        if let Some(t) = own.first_chunk {
            o[at.first_chunk..][..8].copy_from_slice(&t.to_le_bytes());
        }
        #[cfg(test)]
        {
            self.copies += 1;
        }
        true
    }

    /// Keeps the span just encoded at `out[start..]` (its values at `at`) as the template of
    /// `shape`, unless its length took other than the two bytes reserved for it (the body
    /// was moved after the places were noted: rare, and not worth a template).
    fn keep(&mut self, out: &[u8], start: usize, at: Spots, shape: S) {
        let two_byte_len =
            out.len() > start + 3 && out[start + 1] & 0x80 != 0 && out[start + 2] & 0x80 == 0;
        if !two_byte_len {
            self.shape = None;
            return;
        }
        self.bytes.clear();
        self.bytes.extend_from_slice(&out[start..]);
        self.at = at.relative_to(start);
        self.shape = Some(shape);
    }
}

/// The varint lengths of the counts (0: absent).
fn count_lens(counts: &[Option<u64>; 4]) -> [u8; 4] {
    counts.map(|c| c.map_or(0, |c| varint_len(c) as u8))
}

/// What a server span's template stands for: its memo block (the one used last, at this
/// generation), whether it has a parent, the answer's model and finish reasons (at this
/// generation) and its counts' lengths, the lengths of the request's ids, and the small
/// numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ServerShape {
    memo: u64,
    parent: bool,
    said: Option<u64>,
    counts: [u8; 4],
    ids: (usize, usize),
    ints: (u64, usize, u16),
}

/// What a served attempt's span template stands for (see [`ServerShape`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct ClientShape {
    memo: u64,
    said: u64,
    counts: [u8; 4],
    ints: (u64, u32, u16),
    first_chunk: bool,
}

/// Appends a finished request's spans (`ScopeSpans.spans = 2`) to `out`: the server span,
/// then one client span per attempt.
/// `wall` places the record's monotonic instants on the wall clock.
pub(crate) fn encode_spans(
    blocks: &mut Blocks,
    out: &mut Vec<u8>,
    f: &Finished,
    d: &Decision<'_>,
    wall: &Wall,
) {
    let served = f.served().is_some();
    if served {
        blocks.said.update(f, d);
    }
    let counts = if served { counts(f, d) } else { [None; 4] };
    // The answer's attributes (both spans of a served request carry them), encoded only for a
    // span encoded in full.
    let mut bytes = std::mem::take(&mut blocks.answer);
    bytes.clear();
    let mut answer = Answer {
        bytes: &mut bytes,
        counts: &counts,
        at: None,
    };
    let head = HeadParts::of(
        f,
        &Head {
            span_id: &f.span_id,
            parent: f.parent.as_ref(),
            remote_parent: f.parent.is_some(),
            times: (wall.ns(f.start), wall.ns(f.end)),
        },
    );
    // Templates are kept for the plain case: no `tracestate` (its length is the caller's),
    // no error attributes.
    let plain = f.ids.tracestate.is_none() && d.http_status < 400;
    let shape = ServerShape {
        memo: blocks.server.generation,
        parent: head.parent.is_some(),
        said: served.then_some(blocks.said.generation),
        counts: count_lens(&counts),
        ids: (d.request_id.len(), d.job_id().len()),
        ints: (d.requested_output_tokens, d.attempts, d.http_status),
    };
    let own = Own {
        head: &head,
        counts: &counts,
        ids_cost: Some((d.request_id.as_bytes(), d.job_id().as_bytes(), d.cost_usd)),
        first_chunk: None,
    };
    let probe = ServerProbe::of(f, d);
    let copied = plain
        && blocks.server.last_is(|k| probe.same(k))
        && blocks.server_tmpl.apply(out, &shape, &own);
    if !copied {
        let start = out.len();
        let mut at = Spots::default();
        span(out, |w| {
            head.write(w, f, &mut at);
            blocks.server(w, f, d);
            if served {
                at.counts = answer.write(w, &blocks.said.block);
            }
            w.attr_str(A, "tollgate.request_id", d.request_id);
            at.request_id = w.0.len() - d.request_id.len();
            w.attr_str(A, "tollgate.job_id", d.job_id());
            at.job_id = w.0.len() - d.job_id().len();
            w.attr_double(A, "tollgate.cost_usd", d.cost_usd);
            at.cost = w.0.len() - 8;
            if d.http_status >= 400 {
                w.attr_int(A, "http.response.status_code", i64::from(d.http_status));
                w.attr_str(A, "error.type", d.reason());
                if d.http_status >= 500 {
                    error_status(w, d.reason());
                }
            }
            blocks.server_ints.write(w.0, shape.ints, |w| {
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
        if plain {
            let shape = ServerShape {
                memo: blocks.server.generation,
                ..shape
            };
            blocks.server_tmpl.keep(out, start, at, shape);
        }
    }
    for a in f.attempts.iter() {
        client_span(blocks, out, f, d, a, &mut answer, wall);
    }
    blocks.answer = bytes;
}

/// A served answer's attributes, encoded once for the spans of its request encoded in full.
struct Answer<'a> {
    bytes: &'a mut Vec<u8>,
    counts: &'a [Option<u64>; 4],
    /// Where the counts' varints start in `bytes`, once encoded.
    at: Option<[usize; 4]>,
}

impl Answer<'_> {
    /// Appends the answer's attributes to `w`, returning where its counts' varints are.
    fn write(&mut self, w: &mut Writer<'_>, said: &[u8]) -> [usize; 4] {
        let rel = *self
            .at
            .get_or_insert_with(|| answer_attrs(&mut Writer(self.bytes), said, self.counts));
        let base = w.0.len();
        w.0.extend_from_slice(self.bytes);
        rel.map(|r| base + r)
    }
}

/// Appends one attempt's client span to `out`.
fn client_span(
    blocks: &mut Blocks,
    out: &mut Vec<u8>,
    f: &Finished,
    d: &Decision<'_>,
    a: &super::spans::AttemptDone,
    answer: &mut Answer<'_>,
    wall: &Wall,
) {
    let head = HeadParts::of(
        f,
        &Head {
            span_id: &a.span_id,
            parent: Some(&f.span_id),
            remote_parent: false,
            times: (wall.ns(a.start), wall.ns(a.end)),
        },
    );
    let first_chunk = a.first_chunk.map(|t| wall.ns(t));
    let served = a.outcome == Outcome::Served;
    let plain = served && f.ids.tracestate.is_none();
    let shape = ClientShape {
        memo: blocks.client.generation,
        said: blocks.said.generation,
        counts: count_lens(answer.counts),
        ints: (a.max_tokens, a.attempt, d.http_status),
        first_chunk: first_chunk.is_some(),
    };
    let own = Own {
        head: &head,
        counts: answer.counts,
        ids_cost: None,
        first_chunk,
    };
    if plain
        && blocks.client.last_is(|k| client_same(k, f, a))
        && blocks.client_tmpl.apply(out, &shape, &own)
    {
        return;
    }
    let start = out.len();
    let mut at = Spots::default();
    let mut status = itoa::Buffer::new();
    span(out, |w| {
        head.write(w, f, &mut at);
        blocks.client(w, f, a);
        let error: Option<&str> = match a.outcome {
            Outcome::Served => {
                at.counts = answer.write(w, &blocks.said.block);
                blocks.client_ints.write(w.0, shape.ints, |w| {
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
        if let Some(t) = first_chunk {
            // Span.events = 11: Event { time 1, name 2 }
            w.message(11, |w| {
                w.fixed64(1, t);
                at.first_chunk = w.0.len() - 8;
                w.string(2, "gen_ai.first_chunk");
            });
        }
        if let Some(e) = error {
            w.attr_str(A, "error.type", e);
            error_status(w, e);
        }
    });
    if plain {
        let shape = ClientShape {
            memo: blocks.client.generation,
            ..shape
        };
        blocks.client_tmpl.keep(out, start, at, shape);
    }
}

#[cfg(test)]
mod tests {
    use super::super::notes::Notes;
    use super::super::spans::{AttemptDone, Attempts, Finished, Outcome, States, TraceIds};
    use super::host_port;
    use super::{encode_spans, Blocks, Decision, Wall};
    use crate::governor::{FinalAction, ReasonClass, UsageEvidence};
    use std::sync::Arc;

    /// The decision's fields, owned (the export borrows them from the record).
    struct Owned {
        states: States,
        http_status: u16,
        route: Arc<str>,
        consumer: Arc<str>,
        team: Option<Arc<str>>,
        policy_version: Arc<str>,
        backend: Arc<str>,
        request_id: Arc<str>,
        job_id: Option<Arc<str>>,
        upstream_model: Option<Arc<str>>,
        requested_output_tokens: u64,
        usage: Option<(u64, u64)>,
        cache_write_tokens: u64,
        cost_usd: f64,
        attempts: usize,
    }

    impl Owned {
        fn view(&self) -> Decision<'_> {
            Decision {
                states: self.states,
                http_status: self.http_status,
                route: &self.route,
                consumer: &self.consumer,
                team: self.team.as_ref(),
                policy_version: &self.policy_version,
                backend: &self.backend,
                request_id: &self.request_id,
                job_id: self.job_id.as_ref(),
                upstream_model: self.upstream_model.as_ref(),
                requested_output_tokens: self.requested_output_tokens,
                usage: self.usage,
                cache_write_tokens: self.cache_write_tokens,
                cost_usd: self.cost_usd,
                attempts: self.attempts,
            }
        }
    }

    /// A finished request with its decision.
    struct Req {
        f: Finished,
        decision: Option<Owned>,
    }

    impl std::ops::Deref for Req {
        type Target = Finished;
        fn deref(&self) -> &Finished {
            &self.f
        }
    }

    impl std::ops::DerefMut for Req {
        fn deref_mut(&mut self) -> &mut Finished {
            &mut self.f
        }
    }

    fn encode(blocks: &mut Blocks, out: &mut Vec<u8>, r: &Req, wall: &Wall) {
        let d = r.decision.as_ref().map(Owned::view);
        encode_spans(blocks, out, &r.f, d.as_ref().unwrap(), wall);
    }

    fn finished(consumer: &str, team: Option<&str>, model: &str) -> Req {
        Req {
            f: Finished {
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
            },
            decision: Some(Owned {
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
                job_id: Some(Arc::from("j")),
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
            encode(
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
        encode(&mut blocks, &mut out, &f, &Wall::now());
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
            encode(&mut blocks, &mut out, &f, &Wall::now());
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

    /// A copy of the last span with this request's values written over it must be the very
    /// bytes a full encoding of this request gives: every request of a varied run is encoded
    /// once with the kept templates and once with none, and the two compared. What changes
    /// a span's shape changes every ten requests; its own values change with every request.
    #[test]
    fn a_span_copied_from_the_template_is_the_span_encoded_in_full() {
        use super::super::spans::Outcome;
        let mut kept = Blocks::default();
        for i in 0u64..600 {
            let g = i / 10;
            let mut f = finished(
                if g % 7 == 3 { "bob" } else { "alice" },
                (g % 11 == 5).then_some("payments"),
                if g % 13 == 6 { "m2" } else { "m1" },
            );
            f.ids.trace_id = [(i % 251) as u8; 16];
            f.span_id = [(i * 7 % 256) as u8; 8];
            f.start = 1_000 + i;
            f.end = 5_000 + i * 3;
            if g % 5 == 1 {
                f.parent = Some([(i % 256) as u8; 8]);
            }
            if g % 17 == 8 {
                f.ids.tracestate = Some(http::HeaderValue::from_static("k=v"));
            }
            f.notes.cached = (g % 9 == 2).then_some(1_000 + i);
            if g % 8 == 4 {
                f.notes.model = Some(Arc::from(format!("resp-{}", g % 3)));
            }
            if let Some(d) = f.decision.as_mut() {
                // Ids of one length, then of another; counts of one to three varint bytes.
                d.request_id = Arc::from(format!("req-{i:0w$}", w = if g < 30 { 6 } else { 9 }));
                d.job_id = Some(Arc::from(format!("job-{}", i % 3)));
                d.cost_usd = i as f64 * 0.001;
                d.usage = (g % 19 != 7).then_some(match g % 3 {
                    0 => (200 + i % 10, 20 + i % 10),
                    1 => (20 + i % 10, 300 + i),
                    _ => (20_000 + i, 3 + i % 7),
                });
                d.cache_write_tokens = if g % 23 == 9 { 5 + i % 4 } else { 0 };
                d.requested_output_tokens = if g % 29 == 10 { 100 } else { 9 };
                d.http_status = match g % 31 {
                    11 => 503,
                    12 => 429,
                    _ => 200,
                };
                if d.http_status >= 400 {
                    d.states.final_action = FinalAction::HardStop;
                }
            }
            let first = f.attempts.iter().next().map(|a| {
                (
                    a.backend.clone(),
                    a.provider,
                    a.model.clone(),
                    a.base_url.clone(),
                )
            });
            if let Some((backend, provider, model, base_url)) = first {
                let mut served = AttemptDone {
                    span_id: [(i % 256) as u8; 8],
                    start: 2_000 + i,
                    end: 4_000 + i,
                    backend,
                    provider,
                    model,
                    base_url,
                    max_tokens: 9,
                    attempt: 1,
                    probe: false,
                    first_chunk: (g % 3 == 0).then_some(3_000 + i),
                    outcome: Outcome::Served,
                };
                let mut all = Vec::new();
                if g % 37 == 13 {
                    // A failed attempt first.
                    all.push(AttemptDone {
                        span_id: [1; 8],
                        start: 1_500 + i,
                        end: 1_900 + i,
                        backend: Arc::from("other"),
                        provider: "openai",
                        model: Arc::from("m0"),
                        base_url: "http://o:2/v1".into(),
                        max_tokens: 9,
                        attempt: 1,
                        probe: false,
                        first_chunk: None,
                        outcome: Outcome::Failed("5xx", Some(503)),
                    });
                    served.attempt = 2;
                }
                all.push(served);
                f.attempts = Attempts::from(all);
            }
            let wall = Wall::now();
            let mut with = Vec::new();
            encode(&mut kept, &mut with, &f, &wall);
            let mut fresh = Vec::new();
            encode(&mut Blocks::default(), &mut fresh, &f, &wall);
            assert_eq!(with, fresh, "request {i}");
            assert_eq!(decode(&with).len(), 1 + f.attempts.len());
        }
        // Most spans were copies (a shape's first request of ten is encoded in full).
        let (server, client) = (kept.server_tmpl.copies, kept.client_tmpl.copies);
        assert!(server > 400 && client > 400, "{server} {client}");
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
