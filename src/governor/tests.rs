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
