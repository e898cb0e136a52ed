//! HTTP/1.1 on the wire, in one place: the request head the sidecar's own server reads
//! ([`request`]), the client side of a cleartext connection with its answer-head parser and
//! body decoder ([`h1`]), and the keep-alive pool of upstream connections ([`pool`]). The
//! upstream calls (`proxy`) and the OTLP exporter (`telemetry`) speak through the same
//! [`h1::Conn`]; hyper serves and calls everything else.
//!
//! Every bound on what is read from the network is here: [`MAX_HEAD`] for a head in either
//! direction, the field counts, the chunk-size line and trailers (`h1`).

use std::cell::Cell;

pub mod h1;
pub mod pool;
pub mod request;

/// Largest head read, a request's or an answer's (hyper's bound is the same).
pub const MAX_HEAD: usize = 64 * 1024;

/// Most connection lanes (lanes beyond it share the last pool queue).
pub const MAX_LANES: usize = 64;

thread_local! {
    /// This thread's lane: 0 off the connection workers, `1 + index` on a worker.
    static LANE: Cell<usize> = const { Cell::new(0) };
}

/// The lane of the calling thread (0 outside the connection workers): the upstream pools keep
/// one queue per lane, so a pooled connection is only reused by the runtime that drives it.
#[inline]
pub fn lane() -> usize {
    LANE.with(Cell::get)
}

/// Makes the calling thread lane `lane` (a connection worker, at its start).
pub fn set_lane(lane: usize) {
    LANE.with(|l| l.set(lane));
}
