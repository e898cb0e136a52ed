//! Wiring of `state.backend` at start: build the governor over the chosen store, load
//! persisted state before the listener opens, and flush it on shutdown.
//! (Lives in `proxy/` because it joins the governor's circuits with `state/`, which sits
//! below the governor.)

use crate::governor::{CircuitState, Governor};
use crate::ledger::Ledger;
use crate::policy::{Policy, StateBackend};
use crate::state::{CircuitRow, Persister, RedisStore, SqliteStore, StateError};
use std::sync::Arc;

/// The state behind a running sidecar.
#[derive(Debug)]
pub struct State {
    pub governor: Arc<Governor>,
    persister: Option<Persister>,
    /// The shared store, for the readiness probe.
    pub redis: Option<RedisStore>,
    /// The leased slices (`state.slices`), given back at shutdown.
    sliced: Option<Arc<crate::state::SlicedStore>>,
}

/// How long a stopping replica tries to give its slices back: what it cannot return is
/// freed by Redis when the lease ends.
const GIVE_BACK_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

impl State {
    /// Opens the state the policy asks for. SQLite: loads counters (ended windows dropped),
    /// job ledgers and circuits, and starts the write-behind thread.
    pub fn open(policy: &Policy) -> Result<State, StateError> {
        let cfg = &policy.state;
        let ledger = Arc::new(Ledger::new());
        match cfg.backend {
            StateBackend::Memory => Ok(State {
                governor: Arc::new(Governor::new(ledger)),
                persister: None,
                redis: None,
                sliced: None,
            }),
            StateBackend::Sqlite => {
                let mut store = SqliteStore::open(std::path::Path::new(&cfg.path))?;
                let now = jiff::Timestamp::now().as_millisecond();
                let circuits = store.load(&ledger, now, cfg.job_idle_ttl.as_millis() as i64)?;
                let governor = Arc::new(Governor::new(ledger.clone()));
                for c in &circuits {
                    restore_circuit(&governor, c, policy, now);
                }
                tracing::info!(
                    path = %cfg.path,
                    counters = ledger.counter_count(),
                    jobs = ledger.job_count(),
                    circuits = circuits.len(),
                    flush_ms = cfg.flush_interval.as_millis() as u64,
                    "state: SQLite loaded"
                );
                let g = governor.clone();
                let persister = store
                    .spawn(
                        ledger,
                        Box::new(move || circuit_rows(&g)),
                        cfg.flush_interval,
                    )
                    .map_err(|e| StateError(format!("cannot start the state thread: {e}")))?;
                Ok(State {
                    governor,
                    persister: Some(persister),
                    redis: None,
                    sliced: None,
                })
            }
            StateBackend::Redis => {
                let store = RedisStore::new(cfg)?;
                tracing::info!(
                    prefix = %store.prefix(),
                    on_unavailable = ?cfg.on_unavailable,
                    lease_ms = cfg.lease.as_millis() as u64,
                    "state: counters shared through Redis"
                );
                let sliced = cfg.slices.then(|| {
                    tracing::info!("state: slices on (docs/scale-out-slices.md)");
                    Arc::new(crate::state::SlicedStore::new(store.clone()))
                });
                let shared: Arc<dyn crate::ledger::SharedCounters> = match &sliced {
                    Some(s) => s.clone(),
                    None => Arc::new(store.clone()),
                };
                Ok(State {
                    governor: Arc::new(Governor::with_shared(ledger, shared)),
                    persister: None,
                    redis: Some(store),
                    sliced,
                })
            }
        }
    }

    /// After the listeners have drained: gives leased slices back (requests in flight have
    /// settled by now, and the rest of the fleet can spend them at once instead of after the
    /// lease), then flushes and stops the write-behind thread.
    pub async fn finish(self) {
        if let Some(s) = self.sliced {
            if s.give_back_all(GIVE_BACK_WITHIN).await {
                tracing::info!("state: every slice given back");
            } else {
                tracing::warn!(
                    left = s.slices(),
                    "state: slices not given back (Redis did not answer); freed when their lease ends"
                );
            }
        }
        if let Some(p) = self.persister {
            let _ = tokio::task::spawn_blocking(move || p.finish()).await;
        }
    }
}

fn circuit_rows(g: &Governor) -> Vec<CircuitRow> {
    g.circuits()
        .into_iter()
        .map(|(id, c)| CircuitRow {
            backend: id.to_string(),
            state: c.raw_state().as_str().to_owned(),
            failures: c.consecutive_failures(),
            opened_at: c.opened_at(),
            open_until: c.open_until(),
        })
        .collect()
}

/// Seeds one persisted circuit, its hold capped at `now + circuit.max_open` of its backend
/// (the default cap for a backend no longer in the policy).
fn restore_circuit(g: &Governor, c: &CircuitRow, policy: &Policy, now: i64) {
    let state = CircuitState::parse(&c.state).unwrap_or(CircuitState::Closed);
    let max_open = policy
        .backend(&c.backend)
        .map_or(crate::policy::DEFAULT_MAX_OPEN, |b| b.circuit.max_open);
    let cap = now.saturating_add(i64::try_from(max_open.as_millis()).unwrap_or(i64::MAX));
    // Probes in flight died with the old process.
    g.circuit(&Arc::from(c.backend.as_str())).restore(
        state,
        c.failures,
        c.opened_at,
        c.open_until.min(cap),
        0,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::CircuitCfg;
    use std::time::Duration;

    #[tokio::test]
    async fn circuits_and_counters_come_back_through_open() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let yaml = format!(
            "version: p-1
backends: [{{id: primary, kind: openai, base_url: 'http://127.0.0.1:9/v1'}}]
routes: [{{model: chat, chain: [{{backend: primary, model: small}}]}}]
state: {{backend: sqlite, path: '{}', flush_interval: 10s}}
",
            db.display()
        );
        let policy = crate::policy::from_str(&yaml, "p.yaml").unwrap();

        let first = State::open(&policy).unwrap();
        let now = jiff::Timestamp::now().as_millisecond();
        let cfg = CircuitCfg {
            failure_threshold: 1,
            recovery_timeout: Duration::from_secs(600),
            half_open_max_calls: 1,
            accept_retry_after: true,
            max_open: std::time::Duration::from_secs(86_400),
        };
        assert!(first
            .governor
            .circuit(&Arc::from("primary"))
            .on_failure(now, &cfg, None, None));
        let day = crate::ledger::CounterKey {
            scope: crate::units::Scope::Consumer,
            id: Arc::from("alice"),
            window: Some(crate::ledger::window_at(
                &jiff::tz::TimeZone::UTC,
                crate::units::Window::Day,
                now,
            )),
        };
        let used = crate::units::Amount {
            tokens: 42,
            requests: 1,
            usd: 7,
        };
        first
            .governor
            .ledger
            .counter(&day, now + 3_600_000)
            .add_committed(&used);
        // The flush on finish (the interval is far away) writes it.
        first.finish().await;

        let second = State::open(&policy).unwrap();
        let c = second.governor.circuit(&Arc::from("primary"));
        assert_eq!(c.state_at(now + 1), CircuitState::Open);
        assert_eq!(c.open_until(), now + 600_000);
        assert_eq!(c.consecutive_failures(), 1);
        let back = second
            .governor
            .ledger
            .get(&day)
            .expect("the counter came back");
        assert_eq!(back.committed(), used);
        second.finish().await;
    }

    #[tokio::test]
    async fn a_persisted_hold_of_years_comes_back_capped_at_max_open() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("s.db");
        let yaml = format!(
            "version: p-1
backends: [{{id: primary, kind: openai, base_url: 'http://127.0.0.1:9/v1', circuit: {{max_open: 1h}}}}]
routes: [{{model: chat, chain: [{{backend: primary, model: small}}]}}]
state: {{backend: sqlite, path: '{}', flush_interval: 10s}}
",
            db.display()
        );
        let policy = crate::policy::from_str(&yaml, "p.yaml").unwrap();
        let first = State::open(&policy).unwrap();
        let now = jiff::Timestamp::now().as_millisecond();
        let years = now + 99_999_999_000;
        first
            .governor
            .circuit(&Arc::from("primary"))
            .restore(CircuitState::Open, 1, now, years, 0);
        first.finish().await;

        let second = State::open(&policy).unwrap();
        let until = second.governor.circuit(&Arc::from("primary")).open_until();
        assert!(until <= jiff::Timestamp::now().as_millisecond() + 3_600_000);
        assert!(until >= now + 3_600_000 - 1);
        second.finish().await;
    }
}
