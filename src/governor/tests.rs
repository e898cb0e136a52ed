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
