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
