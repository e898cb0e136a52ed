//! The attempt loop: the gates of SPEC §1.3 in order, for each chain entry and each retry,
//! ending in a served call (with its reservation still held), a static answer, a
//! pass-through client error, or a refusal with DEGRADE / DEFER / HARD_STOP.

use super::circuit::{Admission, CircuitState};
use super::limits;
use super::plan::{self, PartInfo, Who};
use super::record::*;
use super::reserve::ReserveError;
use super::upstream::{CallResult, CallSpec, Clock, FailureClass, Skip, Upstream};
use super::{Governor, Outcome, Pending, RequestCtx, Served};
use crate::ledger::WindowSet;
use crate::policy::{BoundClass, Policy, Route};
use crate::units::{micros_to_usd, Dim};
use std::sync::Arc;

/// Facts gathered while walking the chain, turned into the record at the end.
#[derive(Default)]
struct Walk {
    any_failure: bool,
    made_retry: bool,
    gate_blocked: bool,
    attempts_exhausted: bool,
    fallback_needed: bool,
    fallback_blocked_budget: bool,
    degraded: bool,
    any_eligible: bool,
    /// A request-wide bound refused: later entries are tried only if cheaper there.
    request_block: Option<(Dim, u64)>,
    /// A request-wide rate limit or quota refused: no static answer hides that.
    payer_blocked: bool,
    /// A request-wide bound is smaller than this request's own worst case: waiting cannot
    /// help, so it is never DEFER (SPEC §3.2).
    never_fits: bool,
    /// A rate limit refused that the request fits once its window turns.
    fits_later: bool,
    /// Earliest time (ms from now) waiting could help, when known.
    wait_hint_ms: Option<i64>,
    throttled: bool,
    /// A failure that `retry.retry_on` does not retry (an upstream 401/403).
    not_retryable: bool,
}

impl Walk {
    fn hint(&mut self, ms: i64) {
        let ms = ms.max(0);
        self.wait_hint_ms = Some(self.wait_hint_ms.map_or(ms, |h| h.min(ms)));
    }
}

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
        let mut rec = Record::new(
            policy.version.clone(),
            ctx.request_id.clone(),
            ctx.job_id.clone(),
            ctx.consumer.clone(),
            route.model.clone(),
        );
        let start = clock.now_ms();
        let windows = self.windows_at(&policy.windows, start);
        // Job ledgers belong to (consumer, job): another consumer naming the same job id
        // has a ledger of its own.
        let job_key = ctx.job_key();
        let who = Who {
            request_id: &ctx.request_id,
            job_key: &job_key,
            consumer: &ctx.consumer,
            team: ctx.team.as_ref(),
        };
        let req_parts = plan::request_parts(policy, &windows, &self.ledger, &who);
        let job = self.ledger.job(&job_key, start);
        let n = u64::from(ctx.n.max(1));

        let primary_backend = &policy.backends[route.chain[0].backend];
        rec.circuit_state = self.circuit(&primary_backend.id).state_at(start);
        rec.estimated_input_tokens = ctx.input_tokens;
        rec.retry_budget = policy.retry.max_attempts_per_job;

        // Output cap per choice: the client's, else the policy default.
        let mut per_choice = ctx
            .max_output_tokens
            .unwrap_or(u64::from(route.default_output_cap(&policy.estimate)));
        rec.requested_output_tokens = per_choice * n;

        // Soft bounds already crossed change behaviour for later requests (SPEC §5).
        if soft_crossed(policy, &req_parts) {
            rec.budget_state = BudgetState::SoftExceeded;
            rec.reason_class.note(ReasonClass::SoftBudgetExceeded);
            if let Some(cap) = policy.degrade.soft_max_output_tokens {
                if per_choice > u64::from(cap) {
                    per_choice = u64::from(cap);
                    degrade_note(&mut rec);
                }
            }
        }

        let primary_worst = primary_backend.worst_tokens(ctx.input_tokens, per_choice * n);
        rec.worst_case_tokens = primary_worst;
        let primary_price = route.chain[0].price_on(primary_backend);
        rec.worst_case_usd = micros_to_usd(
            plan::worst_amount(
                primary_backend,
                primary_price,
                ctx.input_tokens,
                per_choice * n,
            )
            .usd,
        );
        let amp_cap = (primary_worst as f64 * policy.fallback.max_amplification).floor() as u64;
        let mut sum_worst: u64 = 0;
        let mut walk = Walk {
            degraded: rec.final_action == FinalAction::Degrade,
            ..Walk::default()
        };
        let mut attempt_no: u32 = 0;

        'chain: for (ei, entry) in route.chain.iter().enumerate() {
            let backend = &policy.backends[entry.backend];
            if !up.eligible(entry.backend, backend) {
                if ei == 0 {
                    walk.fallback_needed = true;
                }
                continue;
            }
            walk.any_eligible = true;
            let price = entry.price_on(backend);
            let entry_parts =
                plan::entry_parts(policy, &windows, &self.ledger, backend, &entry.model);
            let mut tries_here: u32 = 0;
            let mut waited_ms: i64 = 0;
            let mut entry_per_choice = per_choice;
            loop {
                let now = clock.now_ms();
                let amount =
                    plan::worst_amount(backend, price, ctx.input_tokens, entry_per_choice * n);
                if let Some((dim, asked)) = walk.request_block {
                    if amount.get(dim) >= asked {
                        continue 'chain;
                    }
                }
                // Gates 2–4: rate limits, quotas, hard budgets — one all-or-nothing reservation.
                let all: Vec<&PartInfo> = req_parts.iter().chain(entry_parts.iter()).collect();
                let reservation = match self.reserve_all(policy, &all, amount, now).await {
                    Ok(r) => r,
                    Err(ReserveError::Unavailable) => {
                        // The shared store cannot say whether this fits: fail closed, and
                        // no other entry can do better (they need the same store).
                        rec.reason_class.note(ReasonClass::StateUnavailable);
                        walk.hint(STATE_RETRY_MS);
                        break 'chain;
                    }
                    Err(ReserveError::Refused(refusal)) => {
                        let part = all[refusal.part];
                        let r = refusal.refusal;
                        let dim = r.dim;
                        let bidx = part.hard_src[dim as usize].unwrap_or(0);
                        let bound = &policy.bounds[bidx];
                        let asked = amount.get(dim);
                        let clamp_min = policy.degrade.clamp_min_output_tokens.map(u64::from);
                        // Larger than the bound's whole limit, and no allowed clamp would fit
                        // even an empty window: waiting can never help (SPEC §3.2).
                        let never_fits = asked > r.hard
                            && !clamp_min.is_some_and(|min| {
                                limits::max_output_within(
                                    dim,
                                    r.hard,
                                    backend,
                                    price,
                                    ctx.input_tokens,
                                )
                                .is_some_and(|out| out / n >= min)
                            });
                        note_refusal(
                            &mut rec,
                            &mut walk,
                            bound,
                            part,
                            r,
                            asked,
                            backend.id.clone(),
                            &windows,
                            now,
                            never_fits,
                        );
                        let request_wide = !part.key.scope.is_entry_scoped();
                        if bound.class == BoundClass::Budget || asked > r.hard {
                            if let Some(min) = clamp_min {
                                if let Some(total) = plan::max_output_that_fits(
                                    &all,
                                    backend,
                                    price,
                                    ctx.input_tokens,
                                ) {
                                    let clamped = total / n;
                                    if clamped >= min && clamped < entry_per_choice {
                                        entry_per_choice = clamped;
                                        walk.degraded = true;
                                        continue;
                                    }
                                }
                            }
                        }
                        if rec.limit.is_none() || (never_fits && request_wide) {
                            let refused = limits::Refused {
                                bound,
                                part,
                                dim,
                                used_total: r.used,
                                limit: r.hard,
                                requested: asked,
                                never_fits,
                            };
                            rec.limit = Some(limits::detail(policy, &windows, &refused));
                        }
                        if request_wide {
                            walk.request_block = Some((dim, asked));
                            walk.never_fits |= never_fits;
                            if bound.class != BoundClass::Budget {
                                walk.payer_blocked = true;
                            }
                        } else {
                            walk.fallback_needed = true;
                        }
                        if walk.any_failure {
                            walk.gate_blocked = true;
                        }
                        continue 'chain;
                    }
                };

                // Gate 6: the circuit of this backend.
                let circuit = self.circuit(&backend.id);
                let before = circuit.state_at(now);
                let probe = match circuit.admit(now, &backend.circuit) {
                    Admission::Normal => None,
                    Admission::Probe(slot) => {
                        rec.reason_class.note(ReasonClass::HalfOpenProbe);
                        Some(slot)
                    }
                    Admission::Rejected { retry_after_ms } => {
                        drop(reservation);
                        rec.reason_class.note(ReasonClass::CircuitOpen);
                        walk.hint(retry_after_ms);
                        walk.fallback_needed = true;
                        if walk.any_failure {
                            walk.gate_blocked = true;
                        }
                        continue 'chain;
                    }
                };

                // Gate 7: the retry and fallback budget.
                let is_fallback = ei > 0 && tries_here == 0;
                if attempt_no > 0 && sum_worst.saturating_add(amount.tokens) > amp_cap {
                    rec.reason_class.note(ReasonClass::RetryBudgetExhausted);
                    walk.gate_blocked = true;
                    break 'chain;
                }
                if is_fallback && !job.try_take_fallback(policy.fallback.max_fallbacks_per_job) {
                    rec.reason_class.note(ReasonClass::RetryBudgetExhausted);
                    walk.gate_blocked = true;
                    break 'chain;
                }
                if !job.try_take_attempt(policy.retry.max_attempts_per_job) {
                    if is_fallback {
                        job.return_fallback();
                    }
                    rec.reason_class.note(ReasonClass::RetryBudgetExhausted);
                    walk.attempts_exhausted = true;
                    break 'chain;
                }

                // The call.
                attempt_no += 1;
                sum_worst = sum_worst.saturating_add(amount.tokens);
                let made_retry_before = walk.made_retry;
                if walk.any_failure {
                    walk.made_retry = true;
                }
                rec.calls.push(backend.id.clone());
                rec.upstream_max_tokens = Some(entry_per_choice);
                let spec = CallSpec {
                    backend,
                    backend_index: entry.backend,
                    model: &entry.model,
                    output_cap_field: entry.output_cap_field,
                    max_output_tokens: entry_per_choice,
                    attempt: attempt_no,
                    probe: probe.is_some(),
                };
                let was_probe = probe.is_some();
                let t0 = clock.now_ms();
                let result = up.call(spec).await;
                let t1 = clock.now_ms();
                let mut att = AttemptRecord {
                    backend: backend.id.clone(),
                    model: entry.model.clone(),
                    attempt: attempt_no,
                    probe: was_probe,
                    worst_tokens: amount.tokens,
                    worst_cost_usd: micros_to_usd(amount.usd),
                    max_output_tokens: entry_per_choice,
                    outcome: "ok",
                    status: None,
                    retry_after_ms: None,
                    circuit_before: before,
                    circuit_after: before,
                    latency_ms: t1 - t0,
                    waited_ms,
                };
                match result {
                    CallResult::Served(payload) => {
                        circuit.on_success(probe);
                        att.circuit_after = circuit.state_at(t1);
                        rec.attempts.push(att);
                        rec.backend = backend.id.clone();
                        rec.upstream_model = Some(entry.model.clone());
                        rec.worst_case_tokens = amount.tokens;
                        rec.worst_case_usd = micros_to_usd(amount.usd);
                        rec.token_limits = limits::token_limits(policy, &windows, &all);
                        rec.remaining_tokens =
                            limits::tightest(&rec.token_limits).map(|l| l.remaining);
                        if ei > 0 {
                            rec.fallback_state = FallbackState::Used;
                        }
                        if walk.any_failure {
                            rec.retry_state = RetryState::Retried;
                        }
                        if walk.degraded {
                            degrade_note(&mut rec);
                        }
                        self.finish_counts(&mut rec, &job, sum_worst, primary_worst);
                        let parts = all.into_iter().cloned().collect();
                        let forget_job = ctx.ephemeral_job().then(|| job_key.clone());
                        let pending = Pending {
                            reservation,
                            parts,
                            backend_index: entry.backend,
                            price,
                            forget_job,
                        };
                        return Outcome {
                            record: rec,
                            served: Served::Upstream { payload, pending },
                        };
                    }
                    CallResult::NotRetryable { payload, status } => {
                        circuit.on_success(probe);
                        drop(reservation);
                        att.outcome = "not_retryable";
                        att.status = Some(status);
                        att.circuit_after = circuit.state_at(t1);
                        rec.attempts.push(att);
                        rec.backend = backend.id.clone();
                        rec.retry_state = RetryState::NotRetryable;
                        rec.reason_class.note(ReasonClass::UpstreamFailure);
                        rec.http_status = status;
                        self.finish_counts(&mut rec, &job, sum_worst, primary_worst);
                        self.end_job(ctx, &job_key);
                        return Outcome {
                            record: rec,
                            served: Served::Passthrough { payload },
                        };
                    }
                    CallResult::Skipped(why) => {
                        // No call was made: undo what making it took, and move on.
                        drop(reservation);
                        drop(probe);
                        rec.calls.pop();
                        walk.made_retry = made_retry_before;
                        attempt_no -= 1;
                        sum_worst = sum_worst.saturating_sub(amount.tokens);
                        job.return_attempt();
                        if is_fallback {
                            job.return_fallback();
                        }
                        att.attempt = 0;
                        att.outcome = why.as_str();
                        rec.attempts.push(att);
                        match why {
                            Skip::Saturated => {
                                rec.reason_class.note(ReasonClass::UpstreamFailure);
                                walk.hint(backoff_ms(policy, 0));
                            }
                            Skip::Untranslatable => {
                                rec.reason_class.note(ReasonClass::ModelIneligible)
                            }
                        }
                        if ei == 0 {
                            walk.fallback_needed = true;
                        }
                        continue 'chain;
                    }
                    CallResult::Failed(f) => {
                        drop(reservation);
                        if f.long_outage {
                            let hold = f.retry_after_ms.unwrap_or(0);
                            circuit.open_for(t1, &backend.circuit, probe, hold);
                        } else {
                            circuit.on_failure(t1, &backend.circuit, probe, f.retry_after_ms);
                        }
                        att.outcome = f.class.as_str();
                        att.status = f.status;
                        att.retry_after_ms = f.retry_after_ms;
                        att.circuit_after = circuit.state_at(t1);
                        rec.attempts.push(att);
                        rec.reason_class.note(ReasonClass::UpstreamFailure);
                        walk.any_failure = true;
                        walk.fallback_needed = true;
                        walk.throttled = f.class == FailureClass::Throttled;
                        let ra = f.retry_after_ms;
                        walk.hint(ra.unwrap_or_else(|| backoff_ms(policy, tries_here)));
                        let ra_ok = ra
                            .is_none_or(|ms| ms <= policy.retry.max_retry_after.as_millis() as i64);
                        let retryable = f.retryable(&policy.retry.retry_on);
                        walk.not_retryable |= !retryable;
                        if tries_here < policy.retry.same_backend_retries && retryable {
                            if !ra_ok {
                                // Retry-After says when; longer than we wait in-request: move on.
                                walk.gate_blocked = true;
                                continue 'chain;
                            }
                            let wait = ra.unwrap_or_else(|| backoff_ms(policy, tries_here)).max(0);
                            // Would the retry be admitted at all? Check before waiting.
                            if circuit.state_at(t1 + wait) == CircuitState::Open {
                                // This failure opened it: the reason stays the failure.
                                walk.hint(circuit.open_until() - t1);
                                walk.gate_blocked = true;
                                continue 'chain;
                            }
                            if job.attempts() >= policy.retry.max_attempts_per_job {
                                rec.reason_class.note(ReasonClass::RetryBudgetExhausted);
                                walk.attempts_exhausted = true;
                                break 'chain;
                            }
                            clock.sleep_ms(wait as u64).await;
                            waited_ms = wait;
                            tries_here += 1;
                            continue;
                        }
                        continue 'chain;
                    }
                }
            }
        }

        // Nothing served. The request-wide token bounds still tell the client its room.
        let req_refs: Vec<&PartInfo> = req_parts.iter().collect();
        rec.token_limits = limits::token_limits(policy, &windows, &req_refs);
        rec.remaining_tokens = limits::tightest(&rec.token_limits).map(|l| l.remaining);
        self.finish_counts(&mut rec, &job, sum_worst, primary_worst);
        self.end_job(ctx, &job_key);
        if !walk.any_eligible && rec.reason_class == ReasonClass::Ok {
            rec.reason_class = ReasonClass::ModelIneligible;
        }
        if walk.any_failure {
            rec.retry_state = if walk.attempts_exhausted {
                RetryState::Exhausted
            } else if walk.made_retry && !walk.gate_blocked {
                RetryState::Retried
            } else if walk.not_retryable && !walk.made_retry && !walk.gate_blocked {
                // Nothing blocked a retry: the failure (a 401) is not one to retry.
                RetryState::NotRetryable
            } else {
                RetryState::Blocked
            };
        }
        if walk.fallback_needed || walk.any_failure {
            rec.fallback_state = if walk.fallback_blocked_budget {
                FallbackState::BlockedBudget
            } else {
                FallbackState::Exhausted
            };
        }
        let backend_trouble = walk.fallback_needed || walk.any_failure || !walk.any_eligible;
        if backend_trouble && !walk.payer_blocked && ctx.static_ok {
            if let Some(text) = &route.static_response {
                rec.backend = Arc::from("static");
                rec.http_status = 200;
                degrade_note(&mut rec);
                return Outcome {
                    record: rec,
                    served: Served::Static(text.clone()),
                };
            }
        }
        let deferrable = !walk.never_fits
            && match rec.reason_class {
                ReasonClass::QuotaBlocked
                | ReasonClass::HardBudgetExceeded
                | ReasonClass::ModelIneligible => false,
                ReasonClass::RateLimited => walk.fits_later || walk.wait_hint_ms.is_some(),
                _ => walk.wait_hint_ms.is_some(),
            };
        let hint = walk
            .wait_hint_ms
            .unwrap_or(policy.retry.backoff_initial.as_millis() as i64);
        let defer_cap = policy.defer.max_retry_after.as_millis() as i64;
        if deferrable && policy.defer.allowed && hint <= defer_cap {
            rec.final_action = FinalAction::Defer;
            rec.retry_after = Some(ceil_secs(hint));
            let throttled = rec.reason_class == ReasonClass::RateLimited || walk.throttled;
            rec.http_status = if throttled { 429 } else { 503 };
        } else {
            rec.final_action = FinalAction::HardStop;
            rec.http_status = 403;
        }
        Outcome {
            record: rec,
            served: Served::Refused,
        }
    }

    fn end_job(&self, ctx: &RequestCtx, job_key: &Arc<str>) {
        if ctx.ephemeral_job() {
            self.ledger.forget_job(job_key);
        }
    }

    fn finish_counts(
        &self,
        rec: &mut Record,
        job: &crate::ledger::JobLedger,
        sum_worst: u64,
        primary_worst: u64,
    ) {
        rec.job_attempts = job.attempts();
        rec.job_fallbacks = job.fallbacks();
        rec.amplification = if primary_worst == 0 {
            0.0
        } else {
            sum_worst as f64 / primary_worst as f64
        };
    }
}

fn degrade_note(rec: &mut Record) {
    rec.final_action = FinalAction::Degrade;
}

fn soft_crossed(policy: &Policy, parts: &[PartInfo]) -> bool {
    parts.iter().any(|p| {
        let committed = p.counter.committed();
        p.bounds.iter().any(|&b| {
            let soft = policy.bounds[b].soft.as_array();
            Dim::ALL
                .iter()
                .any(|&d| soft[d as usize].is_some_and(|s| committed.get(d) > s))
        })
    })
}

#[allow(clippy::too_many_arguments)]
fn note_refusal(
    rec: &mut Record,
    walk: &mut Walk,
    bound: &crate::policy::Bound,
    part: &PartInfo,
    r: crate::ledger::DimRefusal,
    asked: u64,
    backend: Arc<str>,
    windows: &WindowSet,
    now: i64,
    never_fits: bool,
) {
    match bound.class {
        BoundClass::RateLimit => {
            if rec.quota_state == QuotaState::Ok {
                rec.quota_state = QuotaState::RateLimited;
            }
            rec.reason_class.note(ReasonClass::RateLimited);
            if !never_fits {
                if let Some(w) = bound.window {
                    walk.hint(windows.end(w) - now);
                }
                walk.fits_later = true;
            }
            walk.throttled = true;
        }
        BoundClass::Quota => {
            if rec.quota_state == QuotaState::Ok {
                rec.quota_state = QuotaState::Exhausted;
            }
            rec.reason_class.note(ReasonClass::QuotaBlocked);
        }
        BoundClass::Budget => {
            rec.budget_state = BudgetState::HardExceeded;
            if walk.any_failure || walk.fallback_needed {
                rec.reason_class.note(ReasonClass::FallbackOverBudget);
                walk.fallback_blocked_budget = true;
            } else {
                rec.reason_class.note(ReasonClass::HardBudgetExceeded);
            }
            walk.degraded = true;
        }
    }
    rec.refusals.push(BoundNote {
        name: bound.name.clone(),
        class: bound.class.as_str(),
        scope: bound.scope.as_str(),
        id: part.key.id.clone(),
        window: bound.window.map(|w| w.as_str()),
        dim: r.dim.as_str(),
        used: r.used,
        limit: r.hard,
        asked,
        backend,
    });
}
