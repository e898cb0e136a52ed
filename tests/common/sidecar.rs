//! A real sidecar on port 0 with a JSONL audit trail in a temp dir, for integration tests.
#![allow(dead_code)]

use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate::audit::Audit;
use tollgate::estimate::Tokenizer;
use tollgate::ledger::CounterKey;
use tollgate::proxy::{AppClock, ManualClock, Snapshot};
use tollgate::sidecar::{self, Options, Running};
use tollgate::units::Amount;

/// A running sidecar with a JSONL audit trail in a temp dir (the audit is how the eight fields
/// of a *successful* response are checked: a served answer carries no `tollgate` object).
pub struct Sidecar {
    pub running: Running,
    pub base: String,
    pub audit_path: PathBuf,
    /// Set by [`Sidecar::start_manual_clock`]: the governor's time, moved by hand.
    clock: Option<&'static ManualClock>,
    _dir: tempfile::TempDir,
    /// The state `start_shared` opened, finished at `stop` as `tollgate serve` does.
    state: Option<tollgate::proxy::persist::State>,
}

impl Sidecar {
    pub async fn start(yaml: &str) -> Sidecar {
        let dir = tempfile::tempdir().expect("tempdir");
        let audit_path = dir.path().join("audit.jsonl");
        let (audit, _writer) = Audit::jsonl(audit_path.clone(), 4096).expect("audit");
        Sidecar::start_with_audit(yaml, audit, dir).await
    }

    /// A sidecar whose data port has `workers` connection workers (0: served on the test's
    /// runtime).
    pub async fn start_workers(yaml: &str, workers: usize) -> Sidecar {
        let dir = tempfile::tempdir().expect("tempdir");
        let audit_path = dir.path().join("audit.jsonl");
        let (audit, _writer) = Audit::jsonl(audit_path.clone(), 4096).expect("audit");
        Sidecar::start_inner(yaml, audit, dir, Some(workers), None).await
    }

    /// A sidecar whose governor reads a [`ManualClock`]: [`Sidecar::advance`] moves it past a
    /// circuit's recovery or a lease at once, where a test would otherwise sleep through it.
    pub async fn start_manual_clock(yaml: &str) -> Sidecar {
        let dir = tempfile::tempdir().expect("tempdir");
        let audit_path = dir.path().join("audit.jsonl");
        let (audit, _writer) = Audit::jsonl(audit_path.clone(), 4096).expect("audit");
        let clock = ManualClock::leaked();
        Sidecar::start_inner(yaml, audit, dir, None, Some(clock)).await
    }

    /// Moves the governor's clock `by` ahead (a sidecar from [`Sidecar::start_manual_clock`]).
    pub fn advance(&self, by: Duration) {
        self.clock
            .expect("advance needs Sidecar::start_manual_clock")
            .advance(by);
    }

    /// A sidecar writing to the given audit (any sink); `dir` is kept alive with it and
    /// `audit_path` points at `dir/audit.jsonl` (empty unless the audit writes there).
    pub async fn start_with_audit(yaml: &str, audit: Audit, dir: tempfile::TempDir) -> Sidecar {
        Sidecar::start_inner(yaml, audit, dir, None, None).await
    }

    async fn start_inner(
        yaml: &str,
        audit: Audit,
        dir: tempfile::TempDir,
        workers: Option<usize>,
        clock: Option<&'static ManualClock>,
    ) -> Sidecar {
        let policy = tollgate::policy::from_str(yaml, "test.yaml")
            .unwrap_or_else(|e| panic!("policy: {e}\n{yaml}"));
        let snap = Snapshot::build(policy).expect("snapshot");
        let audit_path = dir.path().join("audit.jsonl");
        let governor = Arc::new(tollgate::governor::Governor::new(Arc::new(
            tollgate::ledger::Ledger::new(),
        )));
        let running = sidecar::start_clocked(
            snap,
            audit,
            Options {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                admin_listen: Some("127.0.0.1:0".parse().unwrap()),
                workers,
            },
            governor,
            clock.map_or(AppClock::SYSTEM, AppClock::manual),
        )
        .await
        .expect("start sidecar");
        let base = format!("http://{}/v1", running.addr);
        Sidecar {
            running,
            base,
            audit_path,
            clock,
            _dir: dir,
            state: None,
        }
    }

    /// A sidecar over the state its policy names (`state.backend: redis`: counters shared
    /// through Redis, with the readiness probe, `/admin/status` state and the monitor, as
    /// `tollgate serve` wires them).
    pub async fn start_shared(yaml: &str) -> Sidecar {
        let dir = tempfile::tempdir().expect("tempdir");
        let audit_path = dir.path().join("audit.jsonl");
        let (audit, _writer) = Audit::jsonl(audit_path.clone(), 4096).expect("audit");
        let policy = tollgate::policy::from_str(yaml, "test.yaml")
            .unwrap_or_else(|e| panic!("policy: {e}\n{yaml}"));
        let state = tollgate::proxy::persist::State::open(&policy).expect("state");
        let snap = Snapshot::build(policy).expect("snapshot");
        let running = sidecar::start_with(
            snap,
            audit,
            Options {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                admin_listen: Some("127.0.0.1:0".parse().unwrap()),
                workers: None,
            },
            state.governor.clone(),
        )
        .await
        .expect("start sidecar");
        if let Some(store) = state.redis.clone() {
            store.start_monitor();
            let s = store.clone();
            running.ops.set_state_status(Arc::new(move || s.status()));
            running.ops.set_state_check(Arc::new(move || {
                let store = store.clone();
                Box::pin(async move { store.ready().await })
            }));
        }
        let base = format!("http://{}/v1", running.addr);
        Sidecar {
            running,
            base,
            audit_path,
            clock: None,
            _dir: dir,
            state: Some(state),
        }
    }

    pub fn chat_url(&self) -> String {
        format!("{}/chat/completions", self.base)
    }

    pub fn ledger(&self) -> &tollgate::ledger::Ledger {
        &self.running.app.governor.ledger
    }

    pub fn tokenizer(&self) -> Tokenizer {
        self.running.app.snap.load().policy.estimate.tokenizer
    }

    /// Committed amount on a counter (zero when it does not exist).
    pub fn committed(&self, key: &CounterKey) -> Amount {
        self.ledger()
            .get(key)
            .map(|c| c.committed())
            .unwrap_or_default()
    }

    pub fn reserved(&self, key: &CounterKey) -> Amount {
        self.ledger()
            .get(key)
            .map(|c| c.reserved())
            .unwrap_or_default()
    }

    pub fn audit_text(&self) -> String {
        let mut text = std::fs::read_to_string(&self.audit_path).unwrap_or_default();
        // Only whole lines: the writer thread may be half-way through the last one.
        let whole = text.rfind('\n').map_or(0, |i| i + 1);
        text.truncate(whole);
        text
    }

    /// Waits (bounded) until `n` requests are recorded in the audit. A whole answer's record is
    /// closed (metrics, span, audit) just after the answer is written, so a test that reads
    /// what the closing produced right after its answer waits for this first.
    #[allow(dead_code)]
    pub async fn recorded(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.audit_text().lines().count() < n {
            assert!(
                Instant::now() < deadline,
                "{n} audit records expected:\n{}",
                self.audit_text()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The audit record of `request_id`, waiting (bounded) for the writer thread to flush it.
    pub async fn audit(&self, request_id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            for line in self.audit_text().lines() {
                if let Ok(v) = serde_json::from_str::<Value>(line) {
                    if v["request_id"] == request_id {
                        return v;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "no audit record for {request_id}:\n{}",
                self.audit_text()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn circuit(&self, id: &str) -> Arc<tollgate::governor::Circuit> {
        self.running.app.governor.circuit(&Arc::from(id))
    }

    pub async fn stop(self) {
        tokio::time::timeout(Duration::from_secs(10), self.running.shutdown())
            .await
            .expect("sidecar shuts down");
        if let Some(state) = self.state {
            tokio::time::timeout(Duration::from_secs(10), state.finish())
                .await
                .expect("state finishes");
        }
    }
}
