//! Reconciliation: the actual usage replaces the reserved worst case; soft bounds and alert
//! thresholds are judged on what was really spent.

use super::record::{AlertNote, BudgetState, ReasonClass, Record, UsageEvidence};
use super::{Governor, Pending};
use crate::policy::{Billed, Policy};
use crate::units::{micros_to_usd, Amount, Dim, Usage};

impl Governor {
    /// Commits the actual usage of a served call and finishes its record.
    pub fn settle(
        &self,
        policy: &Policy,
        rec: &mut Record,
        pending: Pending,
        usage: Usage,
        evidence: UsageEvidence,
    ) {
        let Pending {
            reservation,
            parts,
            backend_index: _,
            price,
        } = pending;
        let actual = Amount {
            tokens: usage.input_tokens.saturating_add(usage.output_tokens),
            requests: 1,
            usd: price.cost_billed(Billed {
                input: usage.input_tokens,
                cached: usage.cached_input_tokens,
                cache_write: usage.cache_write_tokens,
                output: usage.output_tokens,
            }),
        };
        // A provider that bills past the cap it was sent (or reports nonsense): booked as
        // reported, saturating, and flagged for the audit and the metric.
        let reserved = reservation.amount();
        rec.usage_over_reservation = actual.tokens > reserved.tokens || actual.usd > reserved.usd;
        let before = reservation.commit(actual);
        // `govern` moves the reserved parts into the pending call, in reservation order.
        debug_assert_eq!(parts.len(), before.len(), "pending parts not filled in");
        // The headers of a buffered answer count what this call really used.
        super::limits::recount(&mut rec.token_limits, &parts);
        rec.remaining_tokens = super::limits::tightest(&rec.token_limits).map(|l| l.remaining);
        rec.usage_evidence_state = evidence;
        rec.actual_input_tokens = usage.input_tokens;
        rec.actual_output_tokens = usage.output_tokens;
        rec.actual_cached_input_tokens = usage.cached_input_tokens.min(usage.input_tokens);
        rec.actual_cache_write_tokens = usage.cache_write_tokens;
        rec.cost_usd = micros_to_usd(actual.usd);

        let mut soft = false;
        for (part, prev) in parts.iter().zip(before) {
            let now = Amount::from_array(std::array::from_fn(|i| {
                prev.as_array()[i].saturating_add(actual.as_array()[i])
            }));
            for &bi in &part.bounds {
                let b = &policy.bounds[bi];
                // Most bounds have neither a soft limit nor alerts: nothing to look at.
                if b.soft.is_empty() && b.alert_at.is_empty() {
                    continue;
                }
                for d in Dim::ALL {
                    if !b.is_shadow() && b.soft.get(d).is_some_and(|s| now.get(d) > s) {
                        soft = true;
                    }
                    if b.alert_at.is_empty() {
                        continue;
                    }
                    if let Some(limit) = b.hard.get(d) {
                        for &a in &b.alert_at {
                            let at = (limit as f64 * a).ceil() as u64;
                            if prev.get(d) < at && now.get(d) >= at {
                                rec.alerts.push(AlertNote {
                                    bound: b.name.clone(),
                                    class: b.class.as_str(),
                                    scope: part.key.scope.as_str(),
                                    id: part.key.id.clone(),
                                    window: part.key.window.map(|w| w.window.as_str()),
                                    window_start: part.key.window.map(|w| w.start),
                                    dim: d.as_str(),
                                    threshold: a,
                                    used: now.get(d),
                                    limit,
                                });
                            }
                        }
                    }
                }
            }
        }
        if soft {
            if rec.budget_state == BudgetState::Ok {
                rec.budget_state = BudgetState::SoftExceeded;
            }
            rec.reason_class.note(ReasonClass::SoftBudgetExceeded);
        }
    }
}
