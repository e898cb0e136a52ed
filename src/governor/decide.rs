//! The governed request path: the gates of SPEC §1.3 in order, for each chain entry and each
//! retry, as named phases over one request's context ([`Request`]) and what its walk over the
//! chain has learned so far ([`Walk`]):
//!
//! 1. [`Request::open`]: the record, the windows, the request-wide counters, the output cap
//!    (lowered when a soft bound is crossed), the primary's worst case.
//! 2. Per chain entry, [`Request::admit_entry`]: can this backend be called at all.
//! 3. Per try on that entry ([`Request::one_try`]), each gate a function of its own:
//!    [`Walk::clear_of_request_block`], [`Request::reserve`] (gates 2–4: rate limits, quotas,
//!    hard budgets as one reservation), [`Request::admit_circuit`] (gate 6),
//!    [`Request::take_retry_budget`] (gate 7), then [`Request::attempt`]: the call, classified
//!    as served, passed through, skipped or failed.
//! 4. [`Request::conclude`]: nothing served — the static answer, DEFER or HARD_STOP.
//!
//! The walk ends in a served call (its reservation still held), a pass-through client error,
//! or [`Request::conclude`].

use super::circuit::{Admission, Circuit, CircuitState, ProbeSlot};
use super::limits;
use super::plan::{self, PartInfo, Who};
use super::record::*;
use super::reserve::ReserveError;
use super::upstream::{CallResult, CallSpec, Clock, Failure, FailureClass, Skip, Upstream};
use super::{Governor, Outcome, Pending, RequestCtx, Served};
use crate::ledger::{JobLedger, Refusal, Reservation, WindowSet};
use crate::policy::{Backend, BoundClass, ChainEntry, Policy, Price, Route};
use crate::units::{micros_to_usd, Amount, Dim, Millis, Scope};
use std::sync::Arc;

/// Retry-After given when the shared state store does not answer.
const STATE_RETRY_MS: i64 = 1000;

fn ceil_secs(ms: i64) -> u64 {
    ((ms.max(0) as u64).div_ceil(1000)).max(1)
}

fn backoff_ms(policy: &Policy, retry_no: u32) -> i64 {
    let initial = policy.retry.backoff_initial.as_millis() as i64;
    let max = policy.retry.backoff_max.as_millis() as i64;
    initial.saturating_mul(1i64 << retry_no.min(20)).min(max)
}

/// How the chain has fared so far. It only ever gets worse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
enum Trouble {
    /// No backend has let the request down yet.
    #[default]
    None,
    /// An entry was passed over (the primary ineligible or skipped, an entry's own bound,
    /// an open circuit): the answer needs a fallback.
    FallbackNeeded,
    /// An upstream call failed (which needs a fallback too).
    Failed,
}

/// A request-wide bound (request, job, consumer, team, global) refused: a later entry is
/// tried only if it asks for less in the refused dimension.
#[derive(Debug, Clone, Copy)]
struct RequestBlock {
    dim: Dim,
    asked: u64,
    /// A rate limit or quota (not a budget) refused: the payer is blocked, so no static
    /// answer hides that.
    payer: bool,
    /// A budget of whoever pays (consumer, team, job, global) refused: a spent budget, which
    /// the static answer does not disguise unless the route says `static_on_budget`.
    spend: bool,
    /// The bound is smaller than this request's own worst case: waiting cannot help, so it
    /// is never DEFER (SPEC §3.2).
    never_fits: bool,
}

/// Why the walk stopped before every entry was tried: no later entry can do better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Halt {
    /// The shared state store did not answer (fail closed; every entry needs it).
    StateUnavailable,
    /// The shared store's counters are being rebuilt after it lost them (fail closed).
    StateRebuilding,
    /// Gate 7: the amplification cap or the job's fallbacks.
    RetryBudget,
    /// Gate 7: the job's attempts are spent.
    AttemptsSpent,
}

/// How a walk without a served call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Every entry was tried or passed over.
    AllTried,
    Halted(Halt),
}

/// Where the walk goes when a try does not answer the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    /// The same entry again: with a clamped output cap, or after a backoff.
    Again,
    /// On to the next chain entry.
    NextEntry,
    Halt(Halt),
}

/// What trying one entry came to.
enum Tried<T> {
    /// The request is answered: an upstream served, or its client error passes through.
    Answered(Served<T>),
    NextEntry,
    Halt(Halt),
}

/// How a refusal without a served call is answered.
enum Conclusion {
    /// The route's static response (DEGRADE).
    Static(Arc<str>),
    /// DEFER: retry after this long.
    Defer {
        hint_ms: i64,
    },
    HardStop,
}

/// When waiting can turn a refusal with this reason into a served call (SPEC §3.2).
enum Waiting {
    Never,
    /// Once the refusing window turns, or when a hint says when.
    WindowTurns,
    /// Only when something said when (a Retry-After, an open circuit, a backoff).
    Hinted,
}

/// Every reason is named here: a new one must say whether it can be deferred.
fn waiting_helps(reason: ReasonClass) -> Waiting {
    match reason {
        ReasonClass::QuotaBlocked
        | ReasonClass::HardBudgetExceeded
        | ReasonClass::ModelIneligible => Waiting::Never,
        ReasonClass::RateLimited => Waiting::WindowTurns,
        ReasonClass::Ok
        | ReasonClass::Unauthenticated
        | ReasonClass::BadRequest
        | ReasonClass::StateUnavailable
        | ReasonClass::StateRebuilding
        | ReasonClass::FallbackOverBudget
        | ReasonClass::SoftBudgetExceeded
        | ReasonClass::CircuitOpen
        | ReasonClass::HalfOpenProbe
        | ReasonClass::RetryBudgetExhausted
        | ReasonClass::UpstreamFailure => Waiting::Hinted,
    }
}

/// One request's fixed context: what every phase reads.
struct Request<'a, U, C> {
    gov: &'a Governor,
    policy: &'a Policy,
    route: &'a Route,
    ctx: &'a RequestCtx,
    up: &'a U,
    clock: &'a C,
    windows: WindowSet,
    job: Arc<JobLedger>,
    /// The request-wide counters (request, job, consumer, team, global).
    parts: Vec<PartInfo>,
    /// Choices asked for (at least one); output is charged across all of them.
    n: u64,
    /// The output cap per choice, after the soft-bound degrade.
    per_choice: u64,
    /// The primary's worst case in tokens, and the cap on this request's attempts' sum.
    primary_worst: u64,
    amp_cap: u64,
    /// The primary's backend and circuit, found once for the record's circuit state and
    /// used again when the primary is admitted (one look-up in the circuits' map, not two).
    primary: (&'a Backend, Arc<Circuit>),
}

/// The record being written and the facts the walk has gathered for its end.
struct Walk {
    rec: Record,
    trouble: Trouble,
    request_block: Option<RequestBlock>,
    any_eligible: bool,
    /// A call was made after a failure.
    made_retry: bool,
    /// A gate (or a Retry-After too long to wait) stopped a retry after a failure.
    retry_blocked: bool,
    /// A failure that `retry.retry_on` does not retry (an upstream 401/403).
    not_retryable: bool,
    /// A hard budget refused an entry after the chain had needed a fallback.
    fallback_blocked_budget: bool,
    /// The output cap was lowered (soft bound, clamp) or a budget refused: DEGRADE if served.
    degraded: bool,
    /// The last failure was a 429, or a rate limit refused: DEFER answers 429, not 503.
    throttled: bool,
    /// A rate limit refused that the request fits once its window turns.
    fits_later: bool,
    /// Earliest time (ms from now) waiting could help, when known.
    wait_hint_ms: Option<i64>,
    /// Calls made (1-based numbering) and the sum of their worst cases in tokens.
    attempt_no: u32,
    sum_worst: u64,
}

/// A chain entry that can be called: its backend, its price and its own counters.
struct Entry<'a> {
    index: usize,
    chain: &'a ChainEntry,
    backend: &'a Backend,
    price: Price,
    parts: Vec<PartInfo>,
}

/// Where the tries on one entry stand.
struct Tries {
    /// Retries on this entry so far.
    count: u32,
    /// What was waited before the next call (backoff or Retry-After), ms.
    waited_ms: i64,
    /// The output cap per choice this entry is tried with (lowered by a clamp).
    per_choice: u64,
}

/// The try at hand: its worst case, the counters it reserves on, and when it started.
struct Ask<'p> {
    all: Vec<&'p PartInfo>,
    amount: Amount,
    now: Millis,
}

/// What a try holds once gates 2–4 let it through.
struct Held<'p> {
    ask: Ask<'p>,
    reservation: Reservation,
}

/// A call the circuit let through: its state before, and the probe slot if half-open.
struct Admitted {
    circuit: Arc<Circuit>,
    before: CircuitState,
    probe: Option<ProbeSlot>,
}

/// A call made: its audit line so far, when it ended, the circuit it went through.
struct Made {
    att: AttemptRecord,
    t1: Millis,
    admitted: Admitted,
}

impl Governor {
    /// Runs one request through the gates and the attempt loop.
    pub async fn govern<U: Upstream, C: Clock>(
        &self,
        policy: &Policy,
        route: &Route,
        ctx: &RequestCtx,
        up: &U,
        clock: &C,
    ) -> Outcome<U::Payload> {
        let (mut req, mut walk) = Request::open(self, policy, route, ctx, up, clock);
        let mut ending = Ending::AllTried;
        for (index, chain) in route.chain.iter().enumerate() {
            let Some(entry) = req.admit_entry(&mut walk, index, chain) else {
                continue;
            };
            match req.try_entry(&mut walk, &entry).await {
                Tried::Answered(mut served) => {
                    if let Served::Upstream { pending, .. } = &mut served {
                        // The counters the reservation holds: the request's, then the
                        // entry's (the order `one_try` reserved them in), moved, not cloned.
                        let mut parts = std::mem::take(&mut req.parts);
                        parts.extend(entry.parts);
                        pending.parts = parts;
                    }
                    return Outcome {
                        record: walk.rec,
                        served,
                    };
                }
                Tried::NextEntry => {}
                Tried::Halt(halt) => {
                    ending = Ending::Halted(halt);
                    break;
                }
            }
        }
        req.conclude(walk, ending)
    }
}

impl<'a, U: Upstream, C: Clock> Request<'a, U, C> {
    /// Phase 1: the record, the windows, the request-wide counters, the output cap and the
    /// primary's worst case.
    fn open(
        gov: &'a Governor,
        policy: &'a Policy,
        route: &'a Route,
        ctx: &'a RequestCtx,
        up: &'a U,
        clock: &'a C,
    ) -> (Self, Walk) {
        let mut rec = Record::new(
            policy.version.clone(),
            ctx.request_id.clone(),
            ctx.job_id.clone(),
            ctx.consumer.clone(),
            route.model.clone(),
        );
        rec.team = ctx.team.clone();
        let start = clock.now_ms();
        let windows = gov.windows_at(&policy.windows, start);
        // Job ledgers belong to (consumer, job): another consumer naming the same job id
        // has a ledger of its own.
        let ephemeral = ctx.ephemeral_job();
        let job_key = ctx.job_key();
        let who = Who {
            request_id: &ctx.request_id,
            job_key: &job_key,
            consumer: &ctx.consumer,
            team: ctx.team.as_ref(),
            ephemeral_job: ephemeral,
        };
        let parts = plan::request_parts(policy, &windows, &gov.ledger, &who);
        // An undeclared job is this request alone: its ledger (and its job-scoped counter,
        // `plan::request_parts`) are its own, kept out of the shared maps: no look-up, insert
        // or removal per request, and nothing another request could share.
        let job = if ephemeral {
            Arc::new(JobLedger::new(0, 0, start))
        } else {
            gov.ledger.job(&job_key, start)
        };
        let n = u64::from(ctx.n.max(1));

        let primary = &policy.backends[route.chain[0].backend];
        let primary_circuit = gov.circuit(&primary.id);
        rec.circuit_state = primary_circuit.state_at(start);
        rec.estimated_input_tokens = ctx.input_tokens;
        rec.client_max_tokens = ctx.max_output_tokens;
        rec.n = ctx.n;
        rec.retry_budget = policy.retry.max_attempts_per_job;
        let per_choice = output_cap(policy, route, ctx, &parts, n, &mut rec);

        let primary_worst = primary.worst_tokens(ctx.input_tokens, per_choice * n);
        rec.worst_case_tokens = primary_worst;
        let price = route.chain[0].price_on(primary);
        let worst = plan::worst_amount(primary, price, ctx.input_tokens, per_choice * n);
        rec.worst_case_usd = micros_to_usd(worst.usd);
        let amp_cap = (primary_worst as f64 * policy.fallback.max_amplification).floor() as u64;
        let req = Request {
            gov,
            policy,
            route,
            ctx,
            up,
            clock,
            windows,
            job,
            parts,
            n,
            per_choice,
            primary_worst,
            amp_cap,
            primary: (primary, primary_circuit),
        };
        (req, Walk::new(rec))
    }

    /// Phase 2: whether this entry's backend can be called at all for this request.
    fn admit_entry(
        &self,
        walk: &mut Walk,
        index: usize,
        chain: &'a ChainEntry,
    ) -> Option<Entry<'a>> {
        let backend = &self.policy.backends[chain.backend];
        if !self.up.eligible(chain.backend, backend) {
            if index == 0 {
                walk.needs_fallback();
            }
            return None;
        }
        walk.any_eligible = true;
        let parts = plan::entry_parts(
            self.policy,
            &self.windows,
            &self.gov.ledger,
            (backend, chain.backend),
            &chain.model,
        );
        Some(Entry {
            index,
            chain,
            backend,
            price: chain.price_on(backend),
            parts,
        })
    }

    /// Phase 3: tries one entry until it answers, or the walk moves on or stops.
    async fn try_entry(&self, walk: &mut Walk, entry: &Entry<'_>) -> Tried<U::Payload> {
        let mut tries = Tries {
            count: 0,
            waited_ms: 0,
            per_choice: self.per_choice,
        };
        loop {
            match self.one_try(walk, entry, &mut tries).await {
                Ok(served) => return Tried::Answered(served),
                Err(Flow::Again) => {}
                Err(Flow::NextEntry) => return Tried::NextEntry,
                Err(Flow::Halt(halt)) => return Tried::Halt(halt),
            }
        }
    }

    /// One try: the gates in SPEC §1.3 order, then the call.
    async fn one_try(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        tries: &mut Tries,
    ) -> Result<Served<U::Payload>, Flow> {
        let now = self.clock.now_ms();
        let amount = plan::worst_amount(
            entry.backend,
            entry.price,
            self.ctx.input_tokens,
            tries.per_choice * self.n,
        );
        walk.clear_of_request_block(amount)?;
        let all: Vec<&PartInfo> = self.parts.iter().chain(entry.parts.iter()).collect();
        let ask = Ask { all, amount, now };
        let reservation = self.reserve(walk, entry, tries, &ask).await?;
        let held = Held { ask, reservation };
        let admitted = self.admit_circuit(walk, entry, now)?;
        self.take_retry_budget(walk, entry, tries, amount)?;
        self.attempt(walk, entry, tries, held, admitted).await
    }

    /// Gates 2–4: rate limits, quotas, hard budgets — one all-or-nothing reservation.
    async fn reserve(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        tries: &mut Tries,
        ask: &Ask<'_>,
    ) -> Result<Reservation, Flow> {
        let (all, amount, now) = (&ask.all, ask.amount, ask.now);
        match self.gov.reserve_all(self.policy, all, amount, now).await {
            Ok(reservation) => {
                self.shadow_check(walk, ask);
                Ok(reservation)
            }
            // The shared store cannot say whether this fits: fail closed, and no other
            // entry can do better (they need the same store).
            Err(ReserveError::Unavailable) => Err(walk.halt(Halt::StateUnavailable)),
            Err(ReserveError::Rebuilding) => Err(walk.halt(Halt::StateRebuilding)),
            Err(ReserveError::Refused(refusal)) => {
                Err(self.refused(walk, entry, tries, ask, refusal))
            }
        }
    }

    /// Shadow bounds (SPEC §9): with this try's worst case now held, notes each one whose
    /// hard limit it crossed, with the `limit` object an enforced bound would have returned.
    /// Once per bound and id, however many tries the request makes.
    fn shadow_check(&self, walk: &mut Walk, ask: &Ask<'_>) {
        for part in &ask.all {
            for &bi in &part.bounds {
                let bound = &self.policy.bounds[bi];
                if !bound.is_shadow() {
                    continue;
                }
                let used = part.counter.used();
                for d in Dim::ALL {
                    let Some(limit) = bound.hard.get(d) else {
                        continue;
                    };
                    let (now, asked) = (used.get(d), ask.amount.get(d));
                    if now <= limit {
                        continue;
                    }
                    let rec = &mut walk.rec;
                    if rec
                        .shadow
                        .iter()
                        .any(|l| l.name == bound.name && l.id == part.key.id)
                    {
                        break;
                    }
                    let would = limits::Refused {
                        bound,
                        part,
                        dim: d,
                        used_total: now.saturating_sub(asked),
                        limit,
                        requested: asked,
                        never_fits: asked > limit,
                    };
                    rec.shadow
                        .push(limits::detail(self.policy, &self.windows, &would));
                    break;
                }
            }
        }
    }

    /// A bound refused the reservation: clamp the output cap if that fits, else note the
    /// refusal and move on.
    fn refused(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        tries: &mut Tries,
        ask: &Ask<'_>,
        refusal: Refusal,
    ) -> Flow {
        let (all, amount) = (&ask.all, ask.amount);
        let part = all[refusal.part];
        let r = refusal.refusal;
        let bound = &self.policy.bounds[part.hard_src[r.dim as usize].unwrap_or(0)];
        let asked = amount.get(r.dim);
        let refused = limits::Refused {
            bound,
            part,
            dim: r.dim,
            used_total: r.used,
            limit: r.hard,
            requested: asked,
            never_fits: self.never_fits(entry, r.dim, r.hard, asked),
        };
        walk.note_refusal(&refused, entry.backend.id.clone(), &self.windows, ask.now);
        if bound.class == BoundClass::Budget || asked > r.hard {
            if let Some(clamped) = self.clamp(entry, tries, all) {
                tries.per_choice = clamped;
                walk.degraded = true;
                return Flow::Again;
            }
        }
        let request_wide = !part.key.scope.is_entry_scoped();
        if walk.rec.limit.is_none() || (refused.never_fits && request_wide) {
            walk.rec.limit = Some(limits::detail(self.policy, &self.windows, &refused));
        }
        if request_wide {
            walk.block_request(&refused);
        } else {
            walk.needs_fallback();
        }
        walk.block_retry_after_failure();
        Flow::NextEntry
    }

    /// Larger than the bound's whole limit, and no allowed clamp would fit even an empty
    /// window: waiting can never help (SPEC §3.2).
    fn never_fits(&self, entry: &Entry<'_>, dim: Dim, hard: u64, asked: u64) -> bool {
        let clamp_min = self.policy.degrade.clamp_min_output_tokens.map(u64::from);
        asked > hard
            && !clamp_min.is_some_and(|min| {
                limits::max_output_within(
                    dim,
                    hard,
                    entry.backend,
                    entry.price,
                    self.ctx.input_tokens,
                )
                .is_some_and(|out| out / self.n >= min)
            })
    }

    /// A lower output cap per choice that fits every bound of this try, if the policy allows
    /// clamping and it is at least its minimum.
    fn clamp(&self, entry: &Entry<'_>, tries: &Tries, all: &[&PartInfo]) -> Option<u64> {
        let min = self.policy.degrade.clamp_min_output_tokens.map(u64::from)?;
        let total =
            plan::max_output_that_fits(all, entry.backend, entry.price, self.ctx.input_tokens)?;
        let clamped = total / self.n;
        (clamped >= min && clamped < tries.per_choice).then_some(clamped)
    }

    /// Gate 6: the circuit of this entry's backend.
    fn admit_circuit(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        now: Millis,
    ) -> Result<Admitted, Flow> {
        let circuit = if std::ptr::eq(entry.backend, self.primary.0) {
            self.primary.1.clone()
        } else {
            self.gov.circuit(&entry.backend.id)
        };
        let before = circuit.state_at(now);
        let probe = match circuit.admit(now, &entry.backend.circuit) {
            Admission::Normal => None,
            Admission::Probe(slot) => {
                walk.rec.reason_class.note(ReasonClass::HalfOpenProbe);
                Some(slot)
            }
            Admission::Rejected { retry_after_ms } => {
                walk.rec.reason_class.note(ReasonClass::CircuitOpen);
                walk.hint(retry_after_ms);
                walk.needs_fallback();
                walk.block_retry_after_failure();
                return Err(Flow::NextEntry);
            }
        };
        Ok(Admitted {
            circuit,
            before,
            probe,
        })
    }

    /// Gate 7: the retry and fallback budget (amplification cap, the job's fallbacks and
    /// attempts).
    fn take_retry_budget(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        tries: &Tries,
        amount: Amount,
    ) -> Result<(), Flow> {
        let is_fallback = entry.is_fallback(tries);
        if walk.attempt_no > 0 && walk.sum_worst.saturating_add(amount.tokens) > self.amp_cap {
            return Err(walk.halt(Halt::RetryBudget));
        }
        let fallbacks = self.policy.fallback.max_fallbacks_per_job;
        if is_fallback && !self.job.try_take_fallback(fallbacks) {
            return Err(walk.halt(Halt::RetryBudget));
        }
        let attempts = self.policy.retry.max_attempts_per_job;
        if !self.job.try_take_attempt(attempts) {
            if is_fallback {
                self.job.return_fallback();
            }
            return Err(walk.halt(Halt::AttemptsSpent));
        }
        Ok(())
    }

    /// The call, classified: served, a client error passed through, skipped, or failed.
    async fn attempt(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        tries: &mut Tries,
        held: Held<'_>,
        admitted: Admitted,
    ) -> Result<Served<U::Payload>, Flow> {
        let made_retry_before = walk.made_retry;
        let amount = held.ask.amount;
        let (result, made) = self.call(walk, entry, tries, amount, admitted).await;
        match result {
            CallResult::Served(payload) => Ok(self.served(walk, entry, held, made, payload)),
            CallResult::NotRetryable { payload, status } => {
                drop(held.reservation);
                Ok(self.passed_through(walk, entry, made, payload, status))
            }
            CallResult::Skipped(why) => {
                // No call was made: undo what making it took, and move on.
                drop(held.reservation);
                walk.made_retry = made_retry_before;
                Err(self.skipped(walk, entry, tries, amount, made, why))
            }
            CallResult::Failed(failure) => {
                let mut made = made;
                if failure.billed {
                    // The upstream took the call: what it may bill stays counted.
                    let worst = held.reservation.amount();
                    let _ = held.reservation.commit(worst);
                    made.att.committed_tokens = worst.tokens;
                } else {
                    drop(held.reservation);
                }
                let (circuit, t1) = self.failed(walk, entry, tries, made, failure);
                Err(self
                    .retry_or_move_on(walk, tries, (&circuit, t1), failure)
                    .await)
            }
        }
    }

    /// Makes the call and starts its audit line.
    async fn call(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        tries: &Tries,
        amount: Amount,
        admitted: Admitted,
    ) -> (CallResult<U::Payload>, Made) {
        walk.attempt_no += 1;
        walk.sum_worst = walk.sum_worst.saturating_add(amount.tokens);
        if walk.trouble == Trouble::Failed {
            walk.made_retry = true;
        }
        walk.rec.calls.push(entry.backend.id.clone());
        walk.rec.upstream_max_tokens = Some(tries.per_choice);
        let probe = admitted.probe.is_some();
        let spec = CallSpec {
            backend: entry.backend,
            backend_index: entry.chain.backend,
            model: &entry.chain.model,
            output_cap_field: entry.chain.output_cap_field,
            max_output_tokens: tries.per_choice,
            attempt: walk.attempt_no,
            probe,
        };
        let t0 = self.clock.now_ms();
        let result = self.up.call(spec).await;
        let t1 = self.clock.now_ms();
        let att = AttemptRecord {
            backend: entry.backend.id.clone(),
            model: entry.chain.model.clone(),
            attempt: walk.attempt_no,
            probe,
            worst_tokens: amount.tokens,
            worst_cost_usd: micros_to_usd(amount.usd),
            max_output_tokens: tries.per_choice,
            outcome: AttemptOutcome::Ok.as_str(),
            status: None,
            retry_after_ms: None,
            circuit_before: admitted.before,
            circuit_after: admitted.before,
            latency_ms: t1 - t0,
            waited_ms: tries.waited_ms,
            committed_tokens: 0,
        };
        let made = Made { att, t1, admitted };
        (result, made)
    }

    /// The upstream served: the record names it, and the reservation stays held until the
    /// usage is known.
    fn served(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        held: Held<'_>,
        made: Made,
        payload: U::Payload,
    ) -> Served<U::Payload> {
        let Made {
            mut att,
            t1,
            admitted,
        } = made;
        admitted.circuit.on_success(admitted.probe);
        att.circuit_after = admitted.circuit.state_at(t1);
        let rec = &mut walk.rec;
        rec.attempts.push(att);
        rec.set_served_by(ServedBy::Backend(entry.backend.id.clone()));
        rec.upstream_model = Some(entry.chain.model.clone());
        let Held { ask, reservation } = held;
        rec.worst_case_tokens = ask.amount.tokens;
        rec.worst_case_usd = micros_to_usd(ask.amount.usd);
        rec.token_limits = limits::token_limits(self.policy, &self.windows, &ask.all);
        rec.remaining_tokens = limits::tightest(&rec.token_limits).map(|l| l.remaining);
        if entry.index > 0 {
            rec.fallback_state = FallbackState::Used;
        }
        if walk.trouble == Trouble::Failed {
            rec.retry_state = RetryState::Retried;
        }
        if walk.degraded {
            degrade_note(rec);
        }
        self.count(walk);
        let pending = Box::new(Pending {
            reservation,
            // Filled by `govern`, which owns the parts `ask.all` borrows.
            parts: Vec::new(),
            backend_index: entry.chain.backend,
            price: entry.price,
        });
        Served::Upstream { payload, pending }
    }

    /// A client error from the upstream: passed through unchanged, never retried.
    fn passed_through(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        made: Made,
        payload: U::Payload,
        status: u16,
    ) -> Served<U::Payload> {
        let Made {
            mut att,
            t1,
            admitted,
        } = made;
        admitted.circuit.on_success(admitted.probe);
        att.outcome = AttemptOutcome::NotRetryable.as_str();
        att.status = Some(status);
        att.circuit_after = admitted.circuit.state_at(t1);
        let rec = &mut walk.rec;
        rec.attempts.push(att);
        rec.set_served_by(ServedBy::Backend(entry.backend.id.clone()));
        rec.retry_state = RetryState::NotRetryable;
        rec.reason_class.note(ReasonClass::UpstreamFailure);
        rec.http_status = status;
        self.count(walk);
        Served::Passthrough { payload }
    }

    /// No call was made (the backend is saturated, or cannot express the request): what
    /// making it took is given back, and the walk moves on.
    fn skipped(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        tries: &Tries,
        amount: Amount,
        made: Made,
        why: Skip,
    ) -> Flow {
        let Made {
            mut att, admitted, ..
        } = made;
        drop(admitted.probe);
        walk.rec.calls.pop();
        walk.attempt_no -= 1;
        walk.sum_worst = walk.sum_worst.saturating_sub(amount.tokens);
        self.job.return_attempt();
        if entry.is_fallback(tries) {
            self.job.return_fallback();
        }
        att.attempt = 0;
        att.outcome = AttemptOutcome::Skipped(why).as_str();
        walk.rec.attempts.push(att);
        match why {
            Skip::Saturated => {
                walk.rec.reason_class.note(ReasonClass::UpstreamFailure);
                walk.hint(backoff_ms(self.policy, 0));
            }
            Skip::Untranslatable => walk.rec.reason_class.note(ReasonClass::ModelIneligible),
        }
        if entry.index == 0 {
            walk.needs_fallback();
        }
        Flow::NextEntry
    }

    /// The call failed: the circuit counts it and the record notes it.
    fn failed(
        &self,
        walk: &mut Walk,
        entry: &Entry<'_>,
        tries: &Tries,
        made: Made,
        f: Failure,
    ) -> (Arc<Circuit>, Millis) {
        let Made {
            mut att,
            t1,
            admitted: Admitted { circuit, probe, .. },
        } = made;
        let cfg = &entry.backend.circuit;
        if f.long_outage {
            circuit.open_for(t1, cfg, probe, f.retry_after_ms.unwrap_or(0));
        } else {
            circuit.on_failure(t1, cfg, probe, f.retry_after_ms);
        }
        att.outcome = AttemptOutcome::Failed(f.class).as_str();
        att.status = f.status;
        att.retry_after_ms = f.retry_after_ms;
        att.circuit_after = circuit.state_at(t1);
        walk.rec.attempts.push(att);
        walk.rec.reason_class.note(ReasonClass::UpstreamFailure);
        walk.trouble = Trouble::Failed;
        walk.throttled = f.class == FailureClass::Throttled;
        let ra = f.retry_after_ms;
        walk.hint(ra.unwrap_or_else(|| backoff_ms(self.policy, tries.count)));
        walk.not_retryable |= !f.retryable(&self.policy.retry.retry_on);
        (circuit, t1)
    }

    /// After a failure: retry the same backend (after waiting) if the policy allows and the
    /// retry would be admitted, else move on.
    async fn retry_or_move_on(
        &self,
        walk: &mut Walk,
        tries: &mut Tries,
        (circuit, t1): (&Circuit, Millis),
        f: Failure,
    ) -> Flow {
        let retry = &self.policy.retry;
        let retryable = f.retryable(&retry.retry_on);
        if tries.count >= retry.same_backend_retries || !retryable {
            return Flow::NextEntry;
        }
        let ra = f.retry_after_ms;
        if ra.is_some_and(|ms| ms > retry.max_retry_after.as_millis() as i64) {
            // Retry-After says when; longer than we wait in-request: move on.
            walk.retry_blocked = true;
            return Flow::NextEntry;
        }
        let wait = ra
            .unwrap_or_else(|| backoff_ms(self.policy, tries.count))
            .max(0);
        // Would the retry be admitted at all? Check before waiting.
        if circuit.state_at(t1 + wait) == CircuitState::Open {
            // This failure opened it: the reason stays the failure.
            walk.hint(circuit.open_until() - t1);
            walk.retry_blocked = true;
            return Flow::NextEntry;
        }
        if self.job.attempts() >= retry.max_attempts_per_job {
            return walk.halt(Halt::AttemptsSpent);
        }
        self.clock.sleep_ms(wait as u64).await;
        tries.waited_ms = wait;
        tries.count += 1;
        Flow::Again
    }

    /// Phase 4: nothing served. The static answer where backends failed the request, else
    /// DEFER when waiting helps and the policy allows it, else HARD_STOP.
    fn conclude(self, mut walk: Walk, ending: Ending) -> Outcome<U::Payload> {
        // The request-wide token bounds still tell the client its room.
        let req_refs: Vec<&PartInfo> = self.parts.iter().collect();
        walk.rec.token_limits = limits::token_limits(self.policy, &self.windows, &req_refs);
        walk.rec.remaining_tokens = limits::tightest(&walk.rec.token_limits).map(|l| l.remaining);
        self.count(&mut walk);
        if !walk.any_eligible && walk.rec.reason_class == ReasonClass::Ok {
            walk.rec.reason_class = ReasonClass::ModelIneligible;
        }
        if let Some(state) = walk.retry_state(ending) {
            walk.rec.retry_state = state;
        }
        if let Some(state) = walk.fallback_state() {
            walk.rec.fallback_state = state;
        }
        let served = match self.conclusion(&walk) {
            Conclusion::Static(text) => {
                let rec = &mut walk.rec;
                rec.set_served_by(ServedBy::Static);
                rec.http_status = 200;
                degrade_note(rec);
                Served::Static(text)
            }
            Conclusion::Defer { hint_ms } => {
                let rec = &mut walk.rec;
                rec.final_action = FinalAction::Defer;
                rec.retry_after = Some(ceil_secs(hint_ms));
                let throttled = rec.reason_class == ReasonClass::RateLimited || walk.throttled;
                rec.http_status = if throttled { 429 } else { 503 };
                Served::Refused
            }
            Conclusion::HardStop => {
                let rec = &mut walk.rec;
                rec.final_action = FinalAction::HardStop;
                rec.http_status = 403;
                Served::Refused
            }
        };
        Outcome {
            record: walk.rec,
            served,
        }
    }

    /// How a request nothing served is answered.
    fn conclusion(&self, walk: &Walk) -> Conclusion {
        let backend_trouble = walk.trouble != Trouble::None || !walk.any_eligible;
        let block = walk.request_block;
        let payer_blocked = block.is_some_and(|b| b.payer);
        if backend_trouble && !payer_blocked && self.ctx.static_ok {
            if let Some(text) = &self.route.static_response {
                if !block.is_some_and(|b| b.spend) || self.route.static_on_budget {
                    return Conclusion::Static(text.clone());
                }
                // A spent budget is not an outage (SPEC §10): it is refused as what it is.
                // Not deferred: a route with a static answer does not make its clients wait.
                return Conclusion::HardStop;
            }
        }
        let hinted = walk.wait_hint_ms.is_some();
        let deferrable = !block.is_some_and(|b| b.never_fits)
            && match waiting_helps(walk.rec.reason_class) {
                Waiting::Never => false,
                Waiting::WindowTurns => walk.fits_later || hinted,
                Waiting::Hinted => hinted,
            };
        let policy = self.policy;
        let hint_ms = walk
            .wait_hint_ms
            .unwrap_or(policy.retry.backoff_initial.as_millis() as i64);
        let defer_cap = policy.defer.max_retry_after.as_millis() as i64;
        if deferrable && policy.defer.allowed && hint_ms <= defer_cap {
            Conclusion::Defer { hint_ms }
        } else {
            Conclusion::HardStop
        }
    }

    /// The job's counts and this request's amplification, for the record.
    fn count(&self, walk: &mut Walk) {
        let rec = &mut walk.rec;
        rec.job_attempts = self.job.attempts();
        rec.job_fallbacks = self.job.fallbacks();
        rec.amplification = if self.primary_worst == 0 {
            0.0
        } else {
            walk.sum_worst as f64 / self.primary_worst as f64
        };
    }
}

impl Entry<'_> {
    /// The first call on a later entry: it takes one of the job's fallbacks.
    fn is_fallback(&self, tries: &Tries) -> bool {
        self.index > 0 && tries.count == 0
    }
}

impl Walk {
    fn new(rec: Record) -> Walk {
        Walk {
            degraded: rec.final_action == FinalAction::Degrade,
            rec,
            trouble: Trouble::None,
            request_block: None,
            any_eligible: false,
            made_retry: false,
            retry_blocked: false,
            not_retryable: false,
            fallback_blocked_budget: false,
            throttled: false,
            fits_later: false,
            wait_hint_ms: None,
            attempt_no: 0,
            sum_worst: 0,
        }
    }

    fn hint(&mut self, ms: i64) {
        let ms = ms.max(0);
        self.wait_hint_ms = Some(self.wait_hint_ms.map_or(ms, |h| h.min(ms)));
    }

    fn needs_fallback(&mut self) {
        self.trouble = self.trouble.max(Trouble::FallbackNeeded);
    }

    /// A gate that passes over an entry after a failure blocks a retry.
    fn block_retry_after_failure(&mut self) {
        match self.trouble {
            Trouble::Failed => self.retry_blocked = true,
            Trouble::None | Trouble::FallbackNeeded => {}
        }
    }

    /// Stops the walk, noting why.
    fn halt(&mut self, halt: Halt) -> Flow {
        match halt {
            Halt::StateUnavailable => {
                self.rec.reason_class.note(ReasonClass::StateUnavailable);
                self.hint(STATE_RETRY_MS);
            }
            Halt::StateRebuilding => {
                self.rec.reason_class.note(ReasonClass::StateRebuilding);
                self.hint(STATE_RETRY_MS);
            }
            Halt::RetryBudget => {
                self.rec
                    .reason_class
                    .note(ReasonClass::RetryBudgetExhausted);
                self.retry_blocked = true;
            }
            Halt::AttemptsSpent => {
                self.rec
                    .reason_class
                    .note(ReasonClass::RetryBudgetExhausted);
            }
        }
        Flow::Halt(halt)
    }

    /// The request-block check: after a request-wide bound refused, an entry is tried only
    /// if it asks for less in the refused dimension.
    fn clear_of_request_block(&self, amount: Amount) -> Result<(), Flow> {
        match self.request_block {
            Some(b) if amount.get(b.dim) >= b.asked => Err(Flow::NextEntry),
            Some(_) | None => Ok(()),
        }
    }

    fn block_request(&mut self, r: &limits::Refused<'_>) {
        let (payer, spend, never_fits) = self
            .request_block
            .map_or((false, false, false), |b| (b.payer, b.spend, b.never_fits));
        let by_payer = match r.bound.class {
            BoundClass::RateLimit | BoundClass::Quota => true,
            BoundClass::Budget => false,
        };
        let by_spend = r.bound.class == BoundClass::Budget && r.bound.scope != Scope::Request;
        self.request_block = Some(RequestBlock {
            dim: r.dim,
            asked: r.requested,
            payer: payer || by_payer,
            spend: spend || by_spend,
            never_fits: never_fits || r.never_fits,
        });
    }

    /// Notes a refusal by a bound in the record's states and refusals.
    fn note_refusal(
        &mut self,
        r: &limits::Refused<'_>,
        backend: Arc<str>,
        windows: &WindowSet,
        now: Millis,
    ) {
        let bound = r.bound;
        let rec = &mut self.rec;
        match bound.class {
            BoundClass::RateLimit => {
                if rec.quota_state == QuotaState::Ok {
                    rec.quota_state = QuotaState::RateLimited;
                }
                rec.reason_class.note(ReasonClass::RateLimited);
                if !r.never_fits {
                    if let Some(w) = bound.window {
                        self.hint(windows.end(w) - now);
                    }
                    self.fits_later = true;
                }
                self.throttled = true;
            }
            BoundClass::Quota => {
                if rec.quota_state == QuotaState::Ok {
                    rec.quota_state = QuotaState::Exhausted;
                }
                rec.reason_class.note(ReasonClass::QuotaBlocked);
            }
            BoundClass::Budget => {
                rec.budget_state = BudgetState::HardExceeded;
                match self.trouble {
                    Trouble::FallbackNeeded | Trouble::Failed => {
                        rec.reason_class.note(ReasonClass::FallbackOverBudget);
                        self.fallback_blocked_budget = true;
                    }
                    Trouble::None => rec.reason_class.note(ReasonClass::HardBudgetExceeded),
                }
                self.degraded = true;
            }
        }
        self.rec.refusals.push(BoundNote {
            name: bound.name.clone(),
            class: bound.class.as_str(),
            scope: bound.scope.as_str(),
            id: r.part.key.id.clone(),
            window: bound.window.map(|w| w.as_str()),
            dim: r.dim.as_str(),
            used: r.used_total,
            limit: r.limit,
            asked: r.requested,
            backend,
        });
    }

    /// The retry state of a walk nothing served; `None` leaves NOT_NEEDED (no failure).
    fn retry_state(&self, ending: Ending) -> Option<RetryState> {
        match self.trouble {
            Trouble::None | Trouble::FallbackNeeded => return None,
            Trouble::Failed => {}
        }
        Some(match ending {
            Ending::Halted(Halt::AttemptsSpent) => RetryState::Exhausted,
            Ending::AllTried
            | Ending::Halted(Halt::StateUnavailable | Halt::StateRebuilding | Halt::RetryBudget) => {
                match (self.retry_blocked, self.made_retry, self.not_retryable) {
                    (false, true, _) => RetryState::Retried,
                    // Nothing blocked a retry: the failure (a 401) is not one to retry.
                    (false, false, true) => RetryState::NotRetryable,
                    (true, _, _) | (false, false, false) => RetryState::Blocked,
                }
            }
        })
    }

    /// The fallback state of a walk nothing served; `None` leaves NOT_NEEDED.
    fn fallback_state(&self) -> Option<FallbackState> {
        match self.trouble {
            Trouble::None => None,
            Trouble::FallbackNeeded | Trouble::Failed => Some(if self.fallback_blocked_budget {
                FallbackState::BlockedBudget
            } else {
                FallbackState::Exhausted
            }),
        }
    }
}

/// The output cap per choice: the client's, else the route's default. Soft bounds already
/// crossed change behaviour for later requests (SPEC §5): the cap may be lowered.
fn output_cap(
    policy: &Policy,
    route: &Route,
    ctx: &RequestCtx,
    parts: &[PartInfo],
    n: u64,
    rec: &mut Record,
) -> u64 {
    let mut per_choice = ctx
        .max_output_tokens
        .unwrap_or(u64::from(route.default_output_cap(&policy.estimate)));
    rec.requested_output_tokens = per_choice * n;
    if soft_crossed(policy, parts) {
        rec.budget_state = BudgetState::SoftExceeded;
        rec.reason_class.note(ReasonClass::SoftBudgetExceeded);
        if let Some(cap) = policy.degrade.soft_max_output_tokens {
            if per_choice > u64::from(cap) {
                per_choice = u64::from(cap);
                degrade_note(rec);
            }
        }
    }
    per_choice
}

fn degrade_note(rec: &mut Record) {
    rec.final_action = FinalAction::Degrade;
}

fn soft_crossed(policy: &Policy, parts: &[PartInfo]) -> bool {
    parts.iter().any(|p| {
        let committed = p.counter.committed();
        p.bounds.iter().any(|&b| {
            if policy.bounds[b].is_shadow() {
                return false;
            }
            let soft = policy.bounds[b].soft.as_array();
            Dim::ALL
                .iter()
                .any(|&d| soft[d as usize].is_some_and(|s| committed.get(d) > s))
        })
    })
}
