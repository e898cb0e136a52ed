use super::circuit::*;
use super::record::ReasonClass;
use crate::policy::CircuitCfg;
use std::time::Duration;

fn cfg(threshold: u32, probes: u32) -> CircuitCfg {
    CircuitCfg {
        failure_threshold: threshold,
        recovery_timeout: Duration::from_secs(30),
        half_open_max_calls: probes,
        accept_retry_after: true,
        max_open: std::time::Duration::from_secs(86_400),
    }
}

#[test]
fn opens_after_threshold_and_rejects_until_recovery() {
    let c = Circuit::new();
    let k = cfg(3, 1);
    assert!(!c.on_failure(0, &k, None, None));
    assert!(!c.on_failure(0, &k, None, None));
    assert!(c.on_failure(1_000, &k, None, None));
    assert_eq!(c.state_at(1_000), CircuitState::Open);
    match c.admit(11_000, &k) {
        Admission::Rejected { retry_after_ms } => assert_eq!(retry_after_ms, 20_000),
        other => panic!("expected rejection, got {other:?}"),
    }
    assert_eq!(c.state_at(31_000), CircuitState::HalfOpen);
}

#[test]
fn success_resets_consecutive_failures() {
    let c = Circuit::new();
    let k = cfg(2, 1);
    c.on_failure(0, &k, None, None);
    c.on_success(None);
    assert!(!c.on_failure(0, &k, None, None));
    assert_eq!(c.raw_state(), CircuitState::Closed);
}

#[test]
fn half_open_admits_limited_probes_and_probe_success_closes() {
    let c = Circuit::new();
    let k = cfg(1, 2);
    c.on_failure(0, &k, None, None);
    let p1 = match c.admit(30_000, &k) {
        Admission::Probe(p) => p,
        other => panic!("expected probe, got {other:?}"),
    };
    let p2 = match c.admit(30_000, &k) {
        Admission::Probe(p) => p,
        other => panic!("expected probe, got {other:?}"),
    };
    assert!(matches!(c.admit(30_000, &k), Admission::Rejected { .. }));
    drop(p2); // a cancelled probe frees its slot without changing the state
    assert_eq!(c.raw_state(), CircuitState::HalfOpen);
    assert_eq!(c.probes_in_flight(), 1);
    c.on_success(Some(p1));
    assert_eq!(c.raw_state(), CircuitState::Closed);
    assert_eq!(c.probes_in_flight(), 0);
}

#[test]
fn probe_failure_reopens_and_retry_after_extends_the_trip() {
    let c = Circuit::new();
    let k = cfg(1, 1);
    c.on_failure(0, &k, None, Some(90_000));
    assert_eq!(
        c.open_until(),
        90_000,
        "Retry-After longer than recovery holds it open"
    );
    let p = match c.admit(90_000, &k) {
        Admission::Probe(p) => p,
        other => panic!("expected probe, got {other:?}"),
    };
    assert!(c.on_failure(90_500, &k, Some(p), None));
    assert_eq!(c.state_at(90_500), CircuitState::Open);
    assert_eq!(c.open_until(), 120_500);
    assert_eq!(c.probes_in_flight(), 0);
}

#[test]
fn retry_after_ignored_when_not_accepted() {
    let c = Circuit::new();
    let mut k = cfg(1, 1);
    k.accept_retry_after = false;
    c.on_failure(0, &k, None, Some(90_000));
    assert_eq!(c.open_until(), 30_000);
}

#[test]
fn reason_precedence_follows_gate_order() {
    let mut r = ReasonClass::Ok;
    r.note(ReasonClass::UpstreamFailure);
    r.note(ReasonClass::FallbackOverBudget);
    assert_eq!(r, ReasonClass::FallbackOverBudget);
    r.note(ReasonClass::CircuitOpen);
    assert_eq!(r, ReasonClass::FallbackOverBudget);
    r.note(ReasonClass::QuotaBlocked);
    assert_eq!(r, ReasonClass::QuotaBlocked);
}

/// The audit log, the metrics and the `x-tollgate-backend` header read the record's
/// `backend` as a string: `ServedBy` must write exactly the strings they know.
#[test]
fn served_by_writes_the_audited_backend_strings() {
    use super::record::{Record, ServedBy};
    use std::sync::Arc;
    let mut rec = Record::new(
        Arc::from("v1"),
        Arc::from("r1"),
        Arc::from("r1"),
        Arc::from("alice"),
        Arc::from("chat"),
    );
    let json = |rec: &Record| serde_json::to_value(rec).unwrap()["backend"].clone();
    assert_eq!(json(&rec), "none", "nobody served a fresh record");
    rec.set_served_by(ServedBy::Static);
    assert_eq!(json(&rec), "static");
    rec.set_served_by(ServedBy::Backend(Arc::from("openai-eu")));
    assert_eq!(json(&rec), "openai-eu");
    rec.set_served_by(ServedBy::None);
    assert_eq!(&*rec.backend, "none");
}

/// `attempts[].outcome`: telemetry counts every outcome but `ok` and `not_retryable` as a
/// backend failure, so no failure or skip may be spelled like those two.
#[test]
fn attempt_outcomes_name_the_audited_strings() {
    use super::record::AttemptOutcome;
    use super::upstream::{FailureClass, Skip};
    assert_eq!(AttemptOutcome::Ok.as_str(), "ok");
    assert_eq!(AttemptOutcome::NotRetryable.as_str(), "not_retryable");
    let failures = [
        (FailureClass::Throttled, "429"),
        (FailureClass::Server, "5xx"),
        (FailureClass::Timeout, "timeout"),
        (FailureClass::Connect, "connect"),
        (FailureClass::Auth, "auth"),
    ];
    for (class, s) in failures {
        assert_eq!(AttemptOutcome::Failed(class).as_str(), s);
    }
    let skips = [
        (Skip::Saturated, "saturated"),
        (Skip::Untranslatable, "untranslatable"),
    ];
    for (why, s) in skips {
        assert_eq!(AttemptOutcome::Skipped(why).as_str(), s);
    }
}

/// Undeclared jobs (the job id is the request id): the job's ledger and job-scoped counter
/// live with the request, so the job bound still holds within it, the shared maps never see
/// it, and a declared job whose id another request takes as its request id is not shared.
mod undeclared_jobs {
    use super::fakes::{At, Ok200};
    use crate::governor::Usage;
    use crate::governor::{FinalAction, Governor, RequestCtx, Served};
    use crate::ledger::Ledger;
    use crate::policy::Policy;
    use crate::units::Scope;
    use std::sync::Arc;

    fn policy() -> Policy {
        crate::policy::from_str(
            "version: j-1
backends: [{id: primary, kind: openai, base_url: 'http://127.0.0.1:9/v1'}]
routes: [{model: chat, chain: [{backend: primary, model: small}]}]
budgets:
  - {name: per-job, scope: job, hard_tokens: 100}
",
            "j.yaml",
        )
        .unwrap()
    }

    fn ctx(request_id: &str, job_id: &str, max_output: u64) -> RequestCtx {
        RequestCtx {
            request_id: Arc::from(request_id),
            job_id: Arc::from(job_id),
            consumer: Arc::from("alice"),
            team: None,
            input_tokens: 10,
            max_output_tokens: Some(max_output),
            n: 1,
            static_ok: false,
        }
    }

    /// Governs and settles one request with 10 tokens in and 20 out.
    async fn call(g: &Governor, p: &Policy, c: &RequestCtx) -> FinalAction {
        let route = p.route("chat").unwrap().clone();
        let out = g.govern(p, &route, c, &Ok200, &At(1_800_000_000_000)).await;
        let action = out.record.final_action;
        if let Served::Upstream { pending, .. } = out.served {
            let mut rec = out.record;
            g.settle(
                p,
                &mut rec,
                *pending,
                Usage::new(10, 20),
                crate::governor::UsageEvidence::Actual,
            );
        }
        action
    }

    fn job_counters(g: &Governor) -> Vec<(Arc<str>, u64)> {
        g.ledger
            .snapshot()
            .into_iter()
            .filter(|(k, _, _)| k.scope == Scope::Job)
            .map(|(k, committed, _)| (k.id, committed.tokens))
            .collect()
    }

    #[tokio::test]
    async fn the_job_bound_holds_within_the_request_and_nothing_is_kept() {
        let (g, p) = (Governor::new(Arc::new(Ledger::new())), policy());
        // Worst case 10 + 200 does not fit the job's 100 tokens.
        assert_ne!(
            call(&g, &p, &ctx("r1", "r1", 200)).await,
            FinalAction::Allow
        );
        assert_eq!(call(&g, &p, &ctx("r2", "r2", 50)).await, FinalAction::Allow);
        assert_eq!(g.ledger.job_count(), 0);
        assert!(job_counters(&g).is_empty());
    }

    #[tokio::test]
    async fn a_request_id_naming_a_declared_job_does_not_share_it() {
        let (g, p) = (Governor::new(Arc::new(Ledger::new())), policy());
        // A declared job spends 30 of its 100 tokens.
        assert_eq!(call(&g, &p, &ctx("r1", "j1", 50)).await, FinalAction::Allow);
        let declared = job_counters(&g);
        assert_eq!(declared.len(), 1);
        assert_eq!(declared[0].1, 30);
        // Another request whose own id is "j1" and which declares no job: its job is itself.
        assert_eq!(call(&g, &p, &ctx("j1", "j1", 50)).await, FinalAction::Allow);
        assert_eq!(job_counters(&g), declared, "the declared job is untouched");
        assert_eq!(g.ledger.job_count(), 1);
    }
}

/// An upstream and a clock for governor tests.
pub(super) mod fakes {
    use crate::governor::upstream::{CallResult, CallSpec, Clock, Upstream};
    use crate::policy::Backend;
    use std::future::Future;

    /// Every call served at once.
    pub struct Ok200;
    impl Upstream for Ok200 {
        type Payload = ();
        fn eligible(&self, _i: usize, _b: &Backend) -> bool {
            true
        }
        fn call(&self, _s: CallSpec<'_>) -> impl Future<Output = CallResult<()>> + Send {
            std::future::ready(CallResult::Served(()))
        }
    }

    /// A clock stopped at the given ms; sleeps return at once.
    pub struct At(pub i64);
    impl Clock for At {
        fn now_ms(&self) -> i64 {
            self.0
        }
        fn sleep_ms(&self, _ms: u64) -> impl Future<Output = ()> + Send {
            std::future::ready(())
        }
    }
}

/// Shadow bounds (SPEC §9): counted on the same counter as an enforced bound, never refusing,
/// noting the `limit` object an enforced one would have answered with.
mod shadow {
    use super::fakes::{At, Ok200};
    use crate::governor::{FinalAction, Governor, Record, RequestCtx, Served, Usage};
    use crate::ledger::Ledger;
    use crate::policy::Policy;
    use crate::units::Scope;
    use std::sync::Arc;

    /// A consumer quota of 100 tokens a day; with `soft`, also a budget whose soft limit
    /// the first request crosses.
    fn policy(enforce: &str, soft: bool) -> Policy {
        let soft = if soft {
            format!(
                "budgets:
  - {{name: soft-spend, scope: consumer, window: day, hard_tokens: 1000, soft_tokens: 1, enforce: {enforce}}}
degrade: {{on_soft_exceeded: {{max_output_tokens: 5}}}}
"
            )
        } else {
            String::new()
        };
        crate::policy::from_str(
            &format!(
                "version: s-1
backends: [{{id: primary, kind: openai, base_url: 'http://127.0.0.1:9/v1'}}]
routes: [{{model: chat, chain: [{{backend: primary, model: small}}]}}]
quotas:
  - {{name: daily, scope: consumer, match: '*', window: day, limit_tokens: 100, enforce: {enforce}}}
{soft}"
            ),
            "s.yaml",
        )
        .unwrap()
    }

    fn ctx(id: &str) -> RequestCtx {
        RequestCtx {
            request_id: Arc::from(id),
            job_id: Arc::from(id),
            consumer: Arc::from("alice"),
            team: None,
            input_tokens: 10,
            max_output_tokens: Some(50),
            n: 1,
            static_ok: false,
        }
    }

    /// Governs (worst case 60 tokens) and settles 30 actual tokens when served.
    async fn call(g: &Governor, p: &Policy, id: &str) -> Record {
        let route = p.route("chat").unwrap().clone();
        let out = g
            .govern(p, &route, &ctx(id), &Ok200, &At(1_800_000_000_000))
            .await;
        let mut rec = out.record;
        if let Served::Upstream { pending, .. } = out.served {
            let evidence = crate::governor::UsageEvidence::Actual;
            g.settle(p, &mut rec, *pending, Usage::new(10, 20), evidence);
        }
        rec
    }

    fn consumer_tokens(g: &Governor) -> u64 {
        g.ledger
            .snapshot()
            .into_iter()
            .filter(|(k, _, _)| k.scope == Scope::Consumer)
            .map(|(_, committed, _)| committed.tokens)
            .sum()
    }

    #[tokio::test]
    async fn a_shadow_bound_counts_and_notes_what_an_enforced_one_refuses() {
        let (hard, hp) = (
            Governor::new(Arc::new(Ledger::new())),
            policy("hard", false),
        );
        let (shadow, sp) = (
            Governor::new(Arc::new(Ledger::new())),
            policy("shadow", false),
        );
        for id in ["r1", "r2"] {
            // 0 + 60 and 30 + 60 fit the 100 tokens.
            assert!(call(&shadow, &sp, id).await.shadow.is_empty());
            call(&hard, &hp, id).await;
        }
        // 60 committed + 60 worst case: the enforced quota refuses, the shadow one lets it pass.
        let refused = call(&hard, &hp, "r3").await;
        assert_eq!(refused.final_action, FinalAction::HardStop);
        let passed = call(&shadow, &sp, "r3").await;
        assert_eq!(passed.final_action, FinalAction::Allow);
        assert_eq!(passed.http_status, 200);
        assert_eq!(passed.shadow.len(), 1);
        let (would, did) = (&passed.shadow[0], refused.limit.as_ref().unwrap());
        assert_eq!(would.to_json(), did.to_json(), "the same limit object");
        assert_eq!((&*would.name, would.used, would.limit), ("daily", 60, 100));
        // Counted like the enforced one, and past its limit: it is only a shadow.
        assert_eq!(consumer_tokens(&shadow), 90);
        assert!(call(&shadow, &sp, "r4").await.shadow.len() == 1);
        assert_eq!(consumer_tokens(&shadow), 120);
    }

    #[tokio::test]
    async fn a_shadow_bound_changes_no_cap_and_no_header() {
        let (g, p) = (
            Governor::new(Arc::new(Ledger::new())),
            policy("shadow", true),
        );
        call(&g, &p, "r1").await;
        // Past the shadow budget's soft limit: an enforced one would lower the cap to 5.
        let rec = call(&g, &p, "r2").await;
        assert_eq!(rec.final_action, FinalAction::Allow);
        assert_eq!(rec.requested_output_tokens, 50);
        assert_eq!(rec.worst_case_tokens, 60);
        assert!(rec.token_limits.is_empty(), "{:?}", rec.token_limits);
        let enforced = policy("hard", true);
        let g2 = Governor::new(Arc::new(Ledger::new()));
        call(&g2, &enforced, "r1").await;
        let rec = call(&g2, &enforced, "r2").await;
        assert_eq!(rec.final_action, FinalAction::Degrade);
        assert!(!rec.token_limits.is_empty());
    }
}

/// Burn-rate forecasts on a fixed clock: no sleeps, the sampler's ticks are called by hand.
mod forecast {
    use super::fakes::{At, Ok200};
    use crate::governor::{Governor, RequestCtx, Served, Usage};
    use crate::ledger::{window_at, window_end, Ledger};
    use crate::policy::Policy;
    use crate::units::{Dim, Window};
    use std::sync::Arc;

    const HOUR: i64 = 3_600_000;

    fn policy() -> Policy {
        crate::policy::from_str(
            "version: f-1
backends: [{id: primary, kind: openai, base_url: 'http://127.0.0.1:9/v1'}]
routes: [{model: chat, chain: [{backend: primary, model: small}]}]
quotas:
  - {name: daily, scope: backend, match: primary, window: day, limit_tokens: 1000}
rate_limits:
  - {name: tpm, scope: consumer, window: minute, limit_tokens: 100000}
",
            "f.yaml",
        )
        .unwrap()
    }

    /// One served call at `now` using `tokens` (half in, half out).
    async fn spend(g: &Governor, p: &Policy, now: i64, tokens: u64) {
        let route = p.route("chat").unwrap().clone();
        let c = RequestCtx {
            request_id: Arc::from(format!("r{now}").as_str()),
            job_id: Arc::from(format!("r{now}").as_str()),
            consumer: Arc::from("alice"),
            team: None,
            input_tokens: 1,
            max_output_tokens: Some(10),
            n: 1,
            static_ok: false,
        };
        let out = g.govern(p, &route, &c, &Ok200, &At(now)).await;
        let mut rec = out.record;
        let Served::Upstream { pending, .. } = out.served else {
            panic!("not served: {rec:?}");
        };
        let usage = Usage::new(tokens / 2, tokens - tokens / 2);
        g.settle(
            p,
            &mut rec,
            *pending,
            usage,
            crate::governor::UsageEvidence::Actual,
        );
    }

    #[tokio::test]
    async fn a_fast_burn_fires_once_per_window_and_a_slow_one_never() {
        let (g, p) = (Governor::new(Arc::new(Ledger::new())), policy());
        let tz = &p.windows.timezone;
        let day = window_at(tz, Window::Day, 1_800_000_000_000);
        let start = day.start * 1000;
        let end = window_end(tz, day);
        // Slow: 10 tokens in the first 12 hours, nowhere near 1000 by midnight.
        spend(&g, &p, start + HOUR, 10).await;
        assert!(g.forecast_tick(&p, start + 12 * HOUR).is_empty());
        // Fast: 300 more in the next hour. The trailing hour burns 300/h: 690 left last
        // 2.3 h, well before midnight.
        let t = start + 12 * HOUR;
        for i in 1..=60 {
            spend(&g, &p, t + i * 60_000, 5).await;
            g.forecast_tick(&p, t + i * 60_000);
        }
        let now = t + HOUR;
        let f = g.forecast_tick(&p, now);
        // Every earlier minute's tick already saw the burn: the alert went out then, once.
        assert_eq!(f.len(), 1, "{f:?}");
        assert!(!f[0].alert, "fired once, on an earlier tick");
        let (fc, b) = (&f[0], &p.bounds[f[0].bound]);
        assert_eq!(
            (&*b.name, fc.dim, fc.used, fc.limit),
            ("daily", Dim::Tokens, 310, 1000)
        );
        assert_eq!(fc.projection.per_hour_1h, Some(300.0));
        let secs = fc.projection.seconds_from(now).unwrap();
        assert_eq!(secs, 690 * 12, "690 tokens at 300/h");
        assert_eq!(fc.window_end_ms, end);

        // A fresh governor fed the same traffic fires on the first tick that sees it.
        let g2 = Governor::new(Arc::new(Ledger::new()));
        spend(&g2, &p, start + HOUR, 10).await;
        g2.forecast_tick(&p, start + 12 * HOUR - 1);
        spend(&g2, &p, now - 1, 300).await;
        let first = g2.forecast_tick(&p, now);
        assert_eq!(first.iter().filter(|f| f.alert).count(), 1, "{first:?}");
        assert!(g2.forecast_tick(&p, now + 60_000).iter().all(|f| !f.alert));
        // The next day is a new window: its counter starts at zero, nothing to forecast.
        spend(&g2, &p, end + HOUR, 10).await;
        assert!(g2.forecast_tick(&p, end + 2 * HOUR).is_empty());
    }
}
