//! The seam to a store that shares counters between replicas (Redis). The governor talks to
//! it only through this trait, so it stays free of sockets; the store lives in `state/`.
//!
//! A shared reservation is one round trip: every counter of the request is checked against its
//! hard limits and held, all or nothing, on the store's side. The returned [`SharedHold`] is
//! attached to the local [`super::Reservation`] and settled or released with it.

use super::{CounterKey, DimRefusal};
use crate::units::{Amount, Millis};
use std::future::Future;
use std::pin::Pin;

/// One counter of a shared reservation.
#[derive(Debug, Clone)]
pub struct SharedPart<'a> {
    pub key: &'a CounterKey,
    pub hard: [Option<u64>; 3],
    /// When the counter's window ends (ms); `i64::MAX` for counters without a window.
    pub expires_at: Millis,
}

/// What the store answered to a reservation.
#[derive(Debug)]
pub enum SharedReply {
    /// Held on every counter. `committed` is each counter's committed total (input order).
    Held {
        hold: Box<dyn SharedHold>,
        committed: Vec<Amount>,
    },
    /// Nothing held: part `part` (input order) would cross its hard limit in one dimension.
    /// `committed` is each counter's committed total (input order) where the store read it
    /// (`None`: not read, e.g. a shard the reservation did not reach).
    Refused {
        part: usize,
        refusal: DimRefusal,
        committed: Vec<Option<Amount>>,
    },
    /// Nothing held: the store lost its counters (its epoch marker is gone) and they are
    /// being rebuilt from the replicas' journals; no hard bound can be judged until then.
    Rebuilding,
}

/// The store did not answer (down, timed out, or recently failed and not retried yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreUnavailable;

pub type ReserveFuture<'a> =
    Pin<Box<dyn Future<Output = Result<SharedReply, StoreUnavailable>> + Send + 'a>>;

/// Counters shared by replicas.
pub trait SharedCounters: Send + Sync + std::fmt::Debug {
    /// Reserves `amount` on every part, all or nothing, in one round trip.
    fn reserve<'a>(
        &'a self,
        parts: &'a [SharedPart<'a>],
        amount: Amount,
        now: Millis,
    ) -> ReserveFuture<'a>;

    /// For a request the replica admits on its own while the store is away
    /// (`state.on_unavailable: local`): a hold that holds nothing, but whose settlement is
    /// owed to the store and written there once it answers again, so usage counted alone
    /// still reaches the shared counters. `None` (the default) keeps such usage local.
    fn offline_hold(&self, _parts: &[SharedPart<'_>], _now: Millis) -> Option<Box<dyn SharedHold>> {
        None
    }

    /// Whether this store bounds what a replica admits while the store is away (slices:
    /// only what it holds). Then `state.on_unavailable: local` refuses past it instead of
    /// counting alone.
    fn bounded_offline(&self) -> bool {
        false
    }
}

/// A reservation held in the shared store. Dropping it releases the hold (in the background);
/// [`SharedHold::settle`] commits the actual usage instead. If neither reaches the store (the
/// replica dies), the hold expires with its lease.
pub trait SharedHold: Send + Sync + std::fmt::Debug {
    fn settle(self: Box<Self>, actual: Amount);
}
