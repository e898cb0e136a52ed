//! Which counters a request touches and with which hard limits. Bounds that share a key
//! (scope, id, window) share one counter; their limits merge to the tightest per dimension.

use crate::ledger::{Counter, CounterKey, Ledger, ReservePart, WindowSet};
use crate::policy::{Backend, Bound, Policy, Price};
use crate::units::{Amount, Dim, Scope};
use std::sync::Arc;

/// One counter of a request with the bounds attached to it.
#[derive(Debug, Clone)]
pub struct PartInfo {
    pub key: CounterKey,
    pub counter: Arc<Counter>,
    pub hard: [Option<u64>; 3],
    /// Index (into `Policy::bounds`) of the bound that set `hard` per dimension.
    pub hard_src: [Option<usize>; 3],
    /// Every bound attached to this counter (soft limits and alerts are read from them):
    /// one or two as a rule, kept inline (no allocation per counter per request).
    pub bounds: smallvec::SmallVec<[usize; 2]>,
    /// The counter lives with the request only (request scope, or an undeclared job's):
    /// never shared, never persisted.
    pub ephemeral: bool,
}

impl PartInfo {
    pub fn reserve_part(&self) -> ReservePart {
        ReservePart {
            counter: self.counter.clone(),
            hard: self.hard,
        }
    }

    /// Room left under the hard limit in a dimension, now.
    pub fn remaining(&self, d: Dim) -> Option<u64> {
        self.hard[d as usize].map(|h| h.saturating_sub(self.counter.used().get(d)))
    }
}

/// Identities of one request, as the plan needs them.
pub struct Who<'a> {
    pub request_id: &'a Arc<str>,
    /// The job's ledger key: consumer and job id ([`crate::ledger::job_key`]).
    pub job_key: &'a Arc<str>,
    pub consumer: &'a Arc<str>,
    /// `None`: team-scoped bounds do not apply (no key, or a key without a team).
    pub team: Option<&'a Arc<str>>,
    /// The job is this request alone (the app declared none): its job-scoped counter lives
    /// with the request, out of the ledger's map, like a request-scoped one.
    pub ephemeral_job: bool,
}

/// The id of the global counters: one shared string (a clone is a count, not an allocation).
fn global_id() -> Arc<str> {
    static ID: std::sync::OnceLock<Arc<str>> = std::sync::OnceLock::new();
    ID.get_or_init(|| Arc::from("global")).clone()
}

fn add(
    parts: &mut Vec<PartInfo>,
    idx: usize,
    b: &Bound,
    key: CounterKey,
    ephemeral: bool,
    make: impl FnOnce() -> Arc<Counter>,
) {
    let pos = parts.iter().position(|p| p.key == key);
    let part = match pos {
        Some(i) => &mut parts[i],
        None => {
            parts.push(PartInfo {
                counter: make(),
                key,
                hard: [None; 3],
                hard_src: [None; 3],
                bounds: smallvec::SmallVec::new(),
                ephemeral,
            });
            let last = parts.len() - 1;
            &mut parts[last]
        }
    };
    part.bounds.push(idx);
    // A shadow bound shares the counter (it counts the same traffic) but not the limits
    // the reservation is judged against: it never refuses.
    if b.is_shadow() {
        return;
    }
    for (i, lim) in b.hard.as_array().into_iter().enumerate() {
        if let Some(l) = lim {
            if part.hard[i].is_none_or(|cur| l < cur) {
                part.hard[i] = Some(l);
                part.hard_src[i] = Some(idx);
            }
        }
    }
}

fn key_for(b: &Bound, id: Arc<str>, windows: &WindowSet) -> (CounterKey, i64) {
    let (window, expires) = match b.window {
        Some(w) => (Some(windows.key(w)), windows.end(w)),
        None => (None, i64::MAX),
    };
    (
        CounterKey {
            scope: b.scope,
            id,
            window,
        },
        expires,
    )
}

/// Counters of bounds that decide for the whole request (request, job, consumer, team,
/// global). A request counts against its consumer's and its team's bounds at once.
pub fn request_parts(
    policy: &Policy,
    windows: &WindowSet,
    ledger: &Ledger,
    who: &Who<'_>,
) -> Vec<PartInfo> {
    let mut parts = Vec::with_capacity(policy.bounds.len());
    for (idx, b) in policy.bounds.iter().enumerate() {
        let id = match b.scope {
            Scope::Request => who.request_id.clone(),
            Scope::Job => who.job_key.clone(),
            Scope::Consumer => who.consumer.clone(),
            Scope::Team => match who.team {
                Some(t) => t.clone(),
                None => continue,
            },
            Scope::Global => global_id(),
            Scope::Backend | Scope::Model => continue,
        };
        // A job bound's match is read against the job id the app sent, not the ledger key.
        let matched = match b.scope {
            Scope::Global => true,
            // (The job id is only looked for in the key when the bound names one.)
            Scope::Job => b.matcher.is_any() || b.matcher.matches(crate::ledger::job_of_key(&id)),
            _ => b.matcher.matches(&id),
        };
        if !matched {
            continue;
        }
        let (key, expires) = key_for(b, id, windows);
        if b.scope == Scope::Request || (b.scope == Scope::Job && who.ephemeral_job) {
            // A request's counter (an undeclared job's too) lives only as long as the
            // request: keep it out of the map.
            add(&mut parts, idx, b, key, true, || {
                Arc::new(Counter::new(i64::MAX))
            });
        } else {
            add(&mut parts, idx, b, key.clone(), false, || {
                ledger.counter_near(near_slot(idx, 0), &key, expires)
            });
        }
    }
    parts
}

/// This thread's memo slot for bound `idx`'s counter ([`Ledger::counter_near`]): four per
/// bound, so a backend- or model-scoped bound matching several chain entries keeps one
/// counter per entry's backend (up to four) instead of each replacing the other's.
fn near_slot(idx: usize, backend: usize) -> usize {
    idx.saturating_mul(4).saturating_add(backend % 4)
}

/// Counters of bounds scoped to one chain entry (its backend, `backend_index` in the
/// policy's list, and its upstream model).
pub fn entry_parts(
    policy: &Policy,
    windows: &WindowSet,
    ledger: &Ledger,
    (backend, backend_index): (&Backend, usize),
    model: &Arc<str>,
) -> Vec<PartInfo> {
    let mut parts = Vec::with_capacity(policy.bounds.len());
    for (idx, b) in policy.bounds.iter().enumerate() {
        let id = match b.scope {
            Scope::Backend => backend.id.clone(),
            Scope::Model => model.clone(),
            _ => continue,
        };
        if !b.matcher.matches(&id) {
            continue;
        }
        let (key, expires) = key_for(b, id, windows);
        add(&mut parts, idx, b, key.clone(), false, || {
            ledger.counter_near(near_slot(idx, backend_index), &key, expires)
        });
    }
    parts
}

/// The worst case of one attempt on `backend`, in all three dimensions.
pub fn worst_amount(
    backend: &Backend,
    price: Price,
    input_tokens: u64,
    output_total: u64,
) -> Amount {
    Amount {
        tokens: backend.worst_tokens(input_tokens, output_total),
        requests: 1,
        usd: price.cost(backend.scaled_input(input_tokens), output_total),
    }
}

/// The largest total output that fits every hard limit of `parts` on `backend`, if any.
pub fn max_output_that_fits(
    parts: &[&PartInfo],
    backend: &Backend,
    price: Price,
    input_tokens: u64,
) -> Option<u64> {
    let mut best = u64::MAX;
    for p in parts {
        for d in Dim::ALL {
            if let Some(rem) = p.remaining(d) {
                let out = super::limits::max_output_within(d, rem, backend, price, input_tokens)?;
                best = best.min(out);
            }
        }
    }
    Some(best)
}
