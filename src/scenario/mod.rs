//! `tollgate test`: plays scenario files through the same governor the proxy runs, with a
//! scripted upstream, a fixed clock and a fresh in-memory ledger, and diffs the decision.

mod file;
mod script;

pub use file::ScenarioFile;
pub use script::{classify, FixedClock, ScriptedUpstream};

use crate::estimate::{self, Endpoint};
use crate::governor::{
    CircuitState, Governor, Outcome, Record, RequestCtx, Served, Usage, UsageEvidence,
};
use crate::ledger::{job_key, window_at, window_end, CounterKey, Ledger};
use crate::policy::{self, Policy};
use crate::units::{usd_to_micros, Amount, Scope};
use file::{Expect, UsageSeed};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A scenario that could not be run (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("{file}: cannot read: {err}")]
    Read { file: String, err: std::io::Error },
    #[error("{file}: {msg}")]
    Parse { file: String, msg: String },
    #[error("{file}: invalid policy:\n{msg}")]
    Policy { file: String, msg: String },
}

/// One field that differs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Mismatch {
    pub field: String,
    pub expected: String,
    pub got: String,
}

#[derive(Debug, serde::Serialize)]
pub struct ScenarioResult {
    pub file: String,
    pub name: String,
    pub record: Record,
    pub mismatches: Vec<Mismatch>,
}

fn parse_err(file: &str, msg: impl std::fmt::Display) -> ScenarioError {
    ScenarioError::Parse {
        file: file.to_string(),
        msg: msg.to_string(),
    }
}

fn parse_time(file: &str, key: &str, s: &str) -> Result<i64, ScenarioError> {
    s.parse::<jiff::Timestamp>()
        .map(|t| t.as_millisecond())
        .map_err(|e| parse_err(file, format!("{key}: not an RFC 3339 time ({s}): {e}")))
}

fn load_policy(
    file: &str,
    dir: &Path,
    v: serde_norway::Value,
    text: &str,
) -> Result<Policy, ScenarioError> {
    let res = match &v {
        serde_norway::Value::String(rel) => policy::load(&dir.join(rel)),
        _ => policy::from_value(v, file, Some(text)),
    };
    res.map_err(|e| ScenarioError::Policy {
        file: file.to_string(),
        msg: e.to_string(),
    })
}

/// The request's own ids, which seeds without an `id` refer to.
struct SeedIds<'a> {
    consumer: &'a str,
    team: Option<&'a str>,
    job_id: &'a str,
}

fn seed_key(policy: &Policy, s: &UsageSeed, ids: &SeedIds<'_>, now: i64) -> (CounterKey, i64) {
    let now =
        s.at.as_deref()
            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
            .map_or(now, |t| t.as_millisecond());
    let id: Arc<str> = match (s.scope, &s.id) {
        (Scope::Global, _) => Arc::from("global"),
        // Job counters belong to (consumer, job), like the job ledgers.
        (Scope::Job, id) => job_key(ids.consumer, id.as_deref().unwrap_or(ids.job_id)),
        (_, Some(id)) => Arc::from(id.as_str()),
        (Scope::Consumer, None) => Arc::from(ids.consumer),
        (Scope::Team, None) => Arc::from(ids.team.unwrap_or("")),
        (_, None) => Arc::from(ids.job_id),
    };
    let tz = &policy.windows.timezone;
    let window = s.window.map(|w| window_at(tz, w, now));
    let expires = window.map_or(i64::MAX, |k| window_end(tz, k));
    (
        CounterKey {
            scope: s.scope,
            id,
            window,
        },
        expires,
    )
}

fn seed_amount(s: &UsageSeed) -> Amount {
    Amount {
        tokens: s.tokens,
        requests: s.requests,
        usd: usd_to_micros(s.usd),
    }
}

/// Reads and runs one scenario file.
pub async fn run_file(path: &Path) -> Result<ScenarioResult, ScenarioError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|err| ScenarioError::Read {
        file: file.clone(),
        err,
    })?;
    let sc: ScenarioFile = serde_norway::from_str(&text).map_err(|e| {
        let at = e
            .location()
            .map(|l| format!("line {}: ", l.line()))
            .unwrap_or_default();
        parse_err(&file, format!("{at}{e}"))
    })?;
    let dir = path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let policy = load_policy(&file, &dir, sc.policy.clone(), &text)?;
    run(&file, sc, &policy).await
}

/// Runs a parsed scenario against a policy.
pub async fn run(
    file: &str,
    sc: ScenarioFile,
    policy: &Policy,
) -> Result<ScenarioResult, ScenarioError> {
    let now = parse_time(file, "now", &sc.now)?;
    let governor = Governor::new(Arc::new(Ledger::new()));
    let ledger = governor.ledger.clone();

    let req = &sc.request;
    let request_id: Arc<str> = Arc::from(req.id.as_deref().unwrap_or("scenario-request"));
    let job_id: Arc<str> = req
        .job
        .as_deref()
        .map(Arc::from)
        .unwrap_or_else(|| request_id.clone());
    let consumer: Arc<str> = req
        .consumer
        .as_deref()
        .map(Arc::from)
        .unwrap_or_else(|| policy.identity.default_consumer.clone());
    let team: Option<Arc<str>> = req.team.as_deref().map(Arc::from);
    let ids = SeedIds {
        consumer: &consumer,
        team: team.as_deref(),
        job_id: &job_id,
    };

    // Starting state.
    for s in &sc.state.usage {
        let (key, exp) = seed_key(policy, s, &ids, now);
        ledger.counter(&key, exp).add_committed(&seed_amount(s));
    }
    let mut held = Vec::new();
    for s in &sc.state.reserved {
        let (key, exp) = seed_key(policy, s, &ids, now);
        let part = crate::ledger::ReservePart {
            counter: ledger.counter(&key, exp),
            hard: [None; 3],
        };
        let r = ledger
            .reserve(&[part], seed_amount(s))
            .map_err(|_| parse_err(file, "state.reserved: cannot seed"))?;
        held.push(r);
    }
    for j in &sc.state.jobs {
        let owner = j.consumer.as_deref().unwrap_or(&*consumer);
        ledger.set_job(job_key(owner, &j.id), j.attempts, j.fallbacks, now);
    }
    for c in &sc.state.circuits {
        let state = CircuitState::parse(&c.state)
            .ok_or_else(|| parse_err(file, format!("state.circuits: unknown state {}", c.state)))?;
        let opened_at = match &c.opened_at {
            Some(t) => parse_time(file, "state.circuits.opened_at", t)?,
            None => now,
        };
        let recovery = policy
            .backend(&c.backend)
            .map(|b| b.circuit.recovery_timeout.as_millis() as i64)
            .unwrap_or(30_000);
        governor.circuit(&Arc::from(c.backend.as_str())).restore(
            state,
            c.consecutive_failures,
            opened_at,
            opened_at + recovery,
            c.probes_in_flight,
        );
    }

    // The request.
    let (model, input_tokens, max_out, n) = match &req.body {
        Some(body) => {
            let est = estimate::estimate(Endpoint::Chat, body, policy.estimate.tokenizer)
                .map_err(|e| parse_err(file, format!("request.body: {e}")))?;
            (
                est.model.clone(),
                est.input_tokens,
                est.max_output_tokens,
                est.n,
            )
        }
        None => (
            req.model
                .clone()
                .ok_or_else(|| parse_err(file, "request.model is required"))?,
            req.input_tokens
                .ok_or_else(|| parse_err(file, "request.input_tokens is required"))?,
            req.max_output_tokens,
            req.n.unwrap_or(1),
        ),
    };
    let route = policy
        .route(&model)
        .ok_or_else(|| parse_err(file, format!("request.model: no route for model `{model}`")))?;
    let ctx = RequestCtx {
        request_id,
        job_id: job_id.clone(),
        consumer: consumer.clone(),
        team: team.clone(),
        input_tokens,
        max_output_tokens: max_out,
        n,
        static_ok: true,
    };

    let up = ScriptedUpstream::new(sc.upstream.clone());
    let clock = FixedClock::new(now);
    let Outcome { mut record, served } = governor.govern(policy, route, &ctx, &up, &clock).await;
    if let Served::Upstream { payload, pending } = served {
        let (usage, evidence) = match payload.usage {
            Some(u) => (
                Usage {
                    input_tokens: u.input_tokens,
                    output_tokens: u.output_tokens,
                    cached_input_tokens: u.cached_input_tokens,
                    cache_write_tokens: u.cache_write_tokens,
                },
                UsageEvidence::Actual,
            ),
            None => {
                let out = payload
                    .text
                    .as_deref()
                    .map(|t| estimate::count_text(policy.estimate.tokenizer, t))
                    .unwrap_or(0);
                (Usage::new(input_tokens, out), UsageEvidence::Estimated)
            }
        };
        governor.settle(policy, &mut record, *pending, usage, evidence);
    }

    let mut mismatches = compare(&sc.expect, &record, &governor, &clock, policy, &ids, now);
    for b in up.unexpected() {
        mismatches.push(Mismatch {
            field: "upstream".into(),
            expected: format!("no further answer scripted for {b}"),
            got: format!("a call to {b}"),
        });
    }
    drop(held);
    Ok(ScenarioResult {
        file: file.to_string(),
        name: sc.name,
        record,
        mismatches,
    })
}

fn check<T: PartialEq + std::fmt::Debug>(
    out: &mut Vec<Mismatch>,
    field: &str,
    expected: Option<T>,
    got: T,
) {
    if let Some(e) = expected {
        if e != got {
            out.push(Mismatch {
                field: field.into(),
                expected: format!("{e:?}"),
                got: format!("{got:?}"),
            });
        }
    }
}

fn check_str(out: &mut Vec<Mismatch>, field: &str, expected: &Option<String>, got: &str) {
    if let Some(e) = expected {
        if e != got {
            out.push(Mismatch {
                field: field.into(),
                expected: e.clone(),
                got: got.to_string(),
            });
        }
    }
}

fn compare(
    e: &Expect,
    r: &Record,
    g: &Governor,
    clock: &FixedClock,
    policy: &Policy,
    ids: &SeedIds<'_>,
    start: i64,
) -> Vec<Mismatch> {
    use crate::governor::Clock;
    let mut out = Vec::new();
    check_str(
        &mut out,
        "budget_state",
        &e.budget_state,
        r.budget_state.as_str(),
    );
    check_str(
        &mut out,
        "quota_state",
        &e.quota_state,
        r.quota_state.as_str(),
    );
    check_str(
        &mut out,
        "circuit_state",
        &e.circuit_state,
        r.circuit_state.as_str(),
    );
    check_str(
        &mut out,
        "retry_state",
        &e.retry_state,
        r.retry_state.as_str(),
    );
    check_str(
        &mut out,
        "usage_evidence_state",
        &e.usage_evidence_state,
        r.usage_evidence_state.as_str(),
    );
    check_str(
        &mut out,
        "fallback_state",
        &e.fallback_state,
        r.fallback_state.as_str(),
    );
    check_str(
        &mut out,
        "final_action",
        &e.final_action,
        r.final_action.as_str(),
    );
    check_str(
        &mut out,
        "reason_class",
        &e.reason_class,
        r.reason_class.as_str(),
    );
    check(&mut out, "http_status", e.http_status, r.http_status);
    if e.retry_after.is_some() {
        check(
            &mut out,
            "retry_after",
            e.retry_after.map(Some),
            r.retry_after,
        );
    }
    let calls: Vec<String> = r.calls.iter().map(|c| c.to_string()).collect();
    check(&mut out, "calls", e.calls.clone(), calls);
    if e.upstream_max_tokens.is_some() {
        check(
            &mut out,
            "upstream_max_tokens",
            e.upstream_max_tokens.map(Some),
            r.upstream_max_tokens,
        );
    }
    check_str(&mut out, "backend", &e.backend, &r.backend);
    if let Some(map) = &e.circuit_after {
        let now = clock.now_ms();
        for (b, want) in map {
            let got = g.circuit(&Arc::from(b.as_str())).state_at(now);
            check_str(
                &mut out,
                &format!("circuit_after.{b}"),
                &Some(want.clone()),
                got.as_str(),
            );
        }
    }
    if let Some(list) = &e.committed {
        for s in list {
            let (key, _) = seed_key(policy, s, ids, start);
            let got = g
                .ledger
                .get(&key)
                .map(|c| c.committed())
                .unwrap_or_default();
            let label = format!("committed.{}.{}", s.scope, key.id);
            check(&mut out, &label, Some(seed_amount(s)), got);
        }
    }
    check(
        &mut out,
        "reserved_tokens",
        e.reserved_tokens,
        g.ledger.reserved_tokens(),
    );
    check(&mut out, "waited_ms", e.waited_ms, clock.waited_ms());
    let shadow: Vec<String> = r.shadow.iter().map(|l| l.name.to_string()).collect();
    check(&mut out, "shadow", e.shadow.clone(), shadow);
    out
}
