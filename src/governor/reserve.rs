//! Gates 2–4 as one all-or-nothing reservation: on the local ledger alone (memory, sqlite),
//! or on a shared store first (redis) with the local ledger mirroring it.

use super::plan::PartInfo;
use super::Governor;
use crate::ledger::{Refusal, Reservation, SharedCounters, SharedPart, SharedReply};
use crate::policy::{OnUnavailable, Policy};
use crate::units::{Amount, Millis, Scope};

/// Why no reservation was made.
pub(super) enum ReserveError {
    /// A hard limit would be crossed.
    Refused(Refusal),
    /// The shared store did not answer and `state.on_unavailable` is `deny`.
    Unavailable,
}

impl Governor {
    /// Reserves `amount` on every part of `all`. Without a shared store this is the local
    /// ledger's lock-free reservation and nothing else (no await, no extra allocation).
    pub(super) async fn reserve_all(
        &self,
        policy: &Policy,
        all: &[&PartInfo],
        amount: Amount,
        now: Millis,
    ) -> Result<Reservation, ReserveError> {
        let reserve: Vec<_> = all.iter().map(|p| p.reserve_part()).collect();
        let Some(shared) = &self.shared else {
            return self
                .ledger
                .reserve(&reserve, amount)
                .map_err(ReserveError::Refused);
        };
        // Boxed so that the local path's future does not carry the shared path's state.
        Box::pin(self.reserve_shared(&**shared, policy, all, reserve, amount, now)).await
    }

    async fn reserve_shared(
        &self,
        shared: &dyn SharedCounters,
        policy: &Policy,
        all: &[&PartInfo],
        mut reserve: Vec<crate::ledger::ReservePart>,
        amount: Amount,
        now: Millis,
    ) -> Result<Reservation, ReserveError> {
        // A request's own counter lives and dies with the request: it stays local.
        let idx: Vec<usize> = (0..all.len())
            .filter(|&i| all[i].key.scope != Scope::Request)
            .collect();
        if idx.is_empty() {
            return self
                .ledger
                .reserve(&reserve, amount)
                .map_err(ReserveError::Refused);
        }
        let parts: Vec<SharedPart<'_>> = idx
            .iter()
            .map(|&i| SharedPart {
                key: &all[i].key,
                hard: all[i].hard,
                expires_at: all[i].counter.expires_at(),
            })
            .collect();
        let mirror = |committed: &[Amount]| {
            for (&i, c) in idx.iter().zip(committed) {
                all[i].counter.mirror_committed(c);
            }
        };
        match shared.reserve(&parts, amount, now).await {
            Ok(SharedReply::Held { hold, committed }) => {
                mirror(&committed);
                // The store has judged the shared limits; locally they are only mirrored.
                for &i in &idx {
                    reserve[i].hard = [None; 3];
                }
                match self.ledger.reserve(&reserve, amount) {
                    Ok(mut r) => {
                        r.attach(hold);
                        Ok(r)
                    }
                    // A request-scoped limit refused: dropping `hold` releases it.
                    Err(refusal) => Err(ReserveError::Refused(refusal)),
                }
            }
            Ok(SharedReply::Refused {
                part,
                refusal,
                committed,
            }) => {
                mirror(&committed);
                Err(ReserveError::Refused(Refusal {
                    part: idx[part],
                    refusal,
                }))
            }
            Err(_) => match policy.state.on_unavailable {
                OnUnavailable::Local => self
                    .ledger
                    .reserve(&reserve, amount)
                    .map_err(ReserveError::Refused),
                OnUnavailable::Deny => Err(ReserveError::Unavailable),
            },
        }
    }
}
