//! `tollgate replay`: what a candidate policy would have done to recorded traffic. Each
//! audited request is decided again, in time order, by the same governor the proxy runs, over
//! a fresh in-memory ledger the replayed traffic fills (so counters are rebuilt from what
//! the new policy would have let through), with a clock set to the request's own time and an
//! upstream that answers as the record says it did. No network, no upstream.

pub mod read;
pub mod report;
pub mod script;

pub use read::{read_all, Recorded, Traffic};
pub use report::{render, Report};

use crate::governor::{Governor, Outcome, Record, RequestCtx, Served};
use crate::ledger::Ledger;
use crate::policy::Policy;
use report::{Decision, Tally};
use script::{Played, ReplayClock};
use std::sync::Arc;

/// The period reported on, by when requests came in. Requests before `from` are still
/// replayed (they fill the windows' counters) but not reported; requests at or after `to`
/// are left out.
#[derive(Debug, Clone, Copy, Default)]
pub struct Period {
    pub from: Option<jiff::Timestamp>,
    pub to: Option<jiff::Timestamp>,
}

/// Records refused before the governor ran: nothing in them is a decision a policy makes.
fn governed(r: &Recorded) -> bool {
    !matches!(r.reason_class.as_str(), "UNAUTHENTICATED" | "BAD_REQUEST")
}

/// Replays `read`'s records (already in time order) under `policy`.
pub async fn replay(policy: &Policy, read: &Traffic, period: Period) -> Report {
    let gov = Governor::new(Arc::new(Ledger::new()));
    let from = period.from.map(|t| t.as_nanosecond());
    let to = period.to.map(|t| t.as_nanosecond());
    let mut tally = Tally::default();
    tally.report.skipped_lines = read.skipped as u64;
    for r in &read.records {
        // By when the request came in: the order it is replayed in. (A record's `ts` is
        // when it was closed, which may come after the next request was answered.)
        if to.is_some_and(|to| r.start_ns >= to) {
            continue;
        }
        let reported = from.is_none_or(|f| r.start_ns >= f);
        if !governed(r) {
            tally.report.not_governed += u64::from(reported);
            continue;
        }
        let new = decide(&gov, policy, r).await;
        if reported {
            tally.add(r, Decision::recorded(r), new);
        } else {
            tally.report.earlier += 1;
        }
    }
    let mut rep = tally.finish();
    rep.policy = policy.source.to_string();
    rep.policy_version = policy.version.to_string();
    rep.from = period.from.map(|t| t.to_string());
    rep.to = period.to.map(|t| t.to_string());
    rep
}

/// One recorded request decided again, its served call settled with the recorded usage.
pub async fn decide(gov: &Governor, policy: &Policy, r: &Recorded) -> Decision {
    let Some(route) = policy.route(&r.route) else {
        // The candidate policy has no route for the model: the proxy answers 404.
        return Decision {
            action: "HARD_STOP".into(),
            reason: "BAD_REQUEST".into(),
            backend: "none".into(),
            cost_usd: 0.0,
            refused_by: vec![("(no route)".into(), String::new())],
        };
    };
    let n = r.n.unwrap_or(1);
    let ctx = RequestCtx {
        request_id: Arc::from(r.request_id.as_str()),
        job_id: Arc::from(r.job_id.as_str()),
        consumer: Arc::from(r.consumer_id.as_str()),
        team: r.team.as_deref().map(Arc::from),
        input_tokens: r.estimated_input_tokens,
        max_output_tokens: r.client_max_tokens,
        n,
        static_ok: r.endpoint != "embeddings",
    };
    let clock = ReplayClock::new(r.start_ms);
    let up = Played::new(r, &clock);
    let Outcome { mut record, served } = gov.govern(policy, route, &ctx, &up, &clock).await;
    if let Served::Upstream { payload, pending } = served {
        let (usage, evidence) = up.usage(payload, n);
        gov.settle(policy, &mut record, *pending, usage, evidence);
    }
    replayed(&record)
}

fn replayed(rec: &Record) -> Decision {
    let mut refused_by: Vec<(String, String)> = Vec::new();
    for b in &rec.refusals {
        if !refused_by.iter().any(|(name, _)| **name == *b.name) {
            refused_by.push((b.name.to_string(), b.class.to_string()));
        }
    }
    Decision {
        action: rec.final_action.as_str().into(),
        reason: rec.reason_class.as_str().into(),
        backend: rec.backend.to_string(),
        cost_usd: if rec.cost_usd.is_finite() {
            rec.cost_usd
        } else {
            0.0
        },
        refused_by,
    }
}
