//! SQLite persistence: WAL mode, `synchronous=NORMAL`, a write-behind thread.
//!
//! The request path never touches SQLite and gains no lock or flag: every `flush_interval`
//! the thread scans the ledger in place (`for_each_counter`, `for_each_job`) and the
//! circuits, compares each against what it last wrote, and writes only what changed (upserts,
//! and deletes of what is gone from memory) in ONE transaction. On a graceful stop it flushes once more.
//!
//! Loss bound after `kill -9`: commits made after the last flush's scan, i.e. at most one
//! `flush_interval` plus one flush's duration. With WAL and `synchronous=NORMAL` a committed
//! transaction survives the process dying (it is in the WAL file); only an OS crash or power
//! loss may also lose the last transactions. Reservations in flight are never persisted
//! (they were not committed), so calls in flight at a crash are not counted.

use super::{CircuitRow, StateError};
use crate::ledger::{CounterKey, Ledger, WindowKey};
use crate::units::{Amount, Millis, Scope, Window};
use rusqlite::{params, Connection};
use std::collections::HashMap;
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS state_counters (
    scope TEXT NOT NULL, id TEXT NOT NULL, window TEXT NOT NULL, start INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    tokens INTEGER NOT NULL, requests INTEGER NOT NULL, usd_micros INTEGER NOT NULL,
    PRIMARY KEY (scope, id, window, start)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS state_jobs (
    id TEXT PRIMARY KEY, attempts INTEGER NOT NULL, fallbacks INTEGER NOT NULL,
    last_seen INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS state_circuits (
    backend TEXT PRIMARY KEY, state TEXT NOT NULL, failures INTEGER NOT NULL,
    opened_at INTEGER NOT NULL, open_until INTEGER NOT NULL
) WITHOUT ROWID;
";

fn err(e: impl std::fmt::Display) -> StateError {
    StateError(e.to_string())
}

/// Window columns of a key: a counter without a window is stored as (`''`, 0).
fn window_cols(k: &CounterKey) -> (&'static str, i64) {
    match k.window {
        Some(w) => (w.window.as_str(), w.start),
        None => ("", 0),
    }
}

/// What was last written, to find what changed.
#[derive(Debug, Default)]
struct Written {
    counters: HashMap<CounterKey, Amount>,
    jobs: HashMap<Arc<str>, (u32, u32, Millis)>,
    circuits: HashMap<String, CircuitRow>,
}

/// What one flush wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlushStats {
    pub upserts: usize,
    pub deletes: usize,
}

/// An open state database.
#[derive(Debug)]
pub struct SqliteStore {
    conn: Connection,
    written: Written,
}

impl SqliteStore {
    pub fn open(path: &Path) -> Result<SqliteStore, StateError> {
        let conn =
            Connection::open(path).map_err(|e| StateError(format!("{}: {e}", path.display())))?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(err)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(err)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StateError(format!(
                "{}: cannot switch to WAL mode (got {mode})",
                path.display()
            )));
        }
        conn.execute_batch("PRAGMA synchronous=NORMAL;")
            .map_err(err)?;
        conn.execute_batch(SCHEMA).map_err(err)?;
        Ok(SqliteStore {
            conn,
            written: Written::default(),
        })
    }

    /// Deletes ended windows and idle jobs, then loads the rest into `ledger`; returns the
    /// circuits for the caller to restore. Rows that do not parse are skipped with a warning.
    pub fn load(
        &mut self,
        ledger: &Ledger,
        now: Millis,
        job_idle_ttl_ms: i64,
    ) -> Result<Vec<CircuitRow>, StateError> {
        let tx = self.conn.transaction().map_err(err)?;
        tx.execute("DELETE FROM state_counters WHERE expires_at <= ?1", [now])
            .map_err(err)?;
        tx.execute(
            "DELETE FROM state_jobs WHERE last_seen < ?1",
            [now.saturating_sub(job_idle_ttl_ms)],
        )
        .map_err(err)?;
        // A job counter goes with its job ledger (the sweep only finds it through the job).
        tx.execute(
            "DELETE FROM state_counters WHERE scope = 'job' AND id NOT IN (SELECT id FROM state_jobs)",
            [],
        )
        .map_err(err)?;
        tx.commit().map_err(err)?;

        let mut st = self
            .conn
            .prepare("SELECT scope, id, window, start, expires_at, tokens, requests, usd_micros FROM state_counters")
            .map_err(err)?;
        let rows = st
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, i64>(4)?,
                    [
                        r.get::<_, i64>(5)?,
                        r.get::<_, i64>(6)?,
                        r.get::<_, i64>(7)?,
                    ],
                ))
            })
            .map_err(err)?;
        for row in rows {
            let (scope, id, window, start, expires, amt) = row.map_err(err)?;
            let Some(scope) = Scope::parse(&scope) else {
                tracing::warn!(%scope, "state: skipping a counter with an unknown scope");
                continue;
            };
            let window = if window.is_empty() {
                None
            } else if let Some(w) = Window::parse(&window) {
                Some(WindowKey { window: w, start })
            } else {
                tracing::warn!(%window, "state: skipping a counter with an unknown window");
                continue;
            };
            let key = CounterKey {
                scope,
                id: Arc::from(id),
                window,
            };
            let amount = Amount::from_array(amt.map(|v| v.max(0) as u64));
            ledger.counter(&key, expires).add_committed(&amount);
            self.written.counters.insert(key, amount);
        }
        drop(st);

        let mut st = self
            .conn
            .prepare("SELECT id, attempts, fallbacks, last_seen FROM state_jobs")
            .map_err(err)?;
        let rows = st
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, u32>(1)?,
                    r.get::<_, u32>(2)?,
                    r.get::<_, i64>(3)?,
                ))
            })
            .map_err(err)?;
        for row in rows {
            let (id, a, f, seen) = row.map_err(err)?;
            let id: Arc<str> = Arc::from(id);
            ledger.set_job(id.clone(), a, f, seen);
            self.written.jobs.insert(id, (a, f, seen));
        }
        drop(st);

        let mut st = self
            .conn
            .prepare("SELECT backend, state, failures, opened_at, open_until FROM state_circuits")
            .map_err(err)?;
        let circuits = st
            .query_map([], |r| {
                Ok(CircuitRow {
                    backend: r.get(0)?,
                    state: r.get(1)?,
                    failures: r.get(2)?,
                    opened_at: r.get(3)?,
                    open_until: r.get(4)?,
                })
            })
            .map_err(err)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        drop(st);
        for c in &circuits {
            self.written.circuits.insert(c.backend.clone(), c.clone());
        }
        Ok(circuits)
    }

    /// Writes what changed since the last flush in one transaction. On an error nothing is
    /// marked written, so the next flush tries the same changes again.
    pub fn flush(
        &mut self,
        ledger: &Ledger,
        circuits: Vec<CircuitRow>,
    ) -> Result<FlushStats, StateError> {
        // Scanned in place: only changed keys are cloned.
        let mut up_c = Vec::new();
        ledger.for_each_counter(|key, c| {
            let committed = c.committed();
            let changed = match self.written.counters.get(key) {
                Some(a) => *a != committed,
                None => committed != Amount::ZERO,
            };
            if changed {
                up_c.push((key.clone(), committed, c.expires_at()));
            }
        });
        let del_c: Vec<CounterKey> = self
            .written
            .counters
            .keys()
            .filter(|k| ledger.get(k).is_none())
            .cloned()
            .collect();

        let mut up_j = Vec::new();
        ledger.for_each_job(|id, a, f, seen| {
            if self.written.jobs.get(id) != Some(&(a, f, seen)) {
                up_j.push((id.clone(), a, f, seen));
            }
        });
        let del_j: Vec<Arc<str>> = self
            .written
            .jobs
            .keys()
            .filter(|k| !ledger.has_job(k))
            .cloned()
            .collect();

        let up_circ: Vec<CircuitRow> = circuits
            .iter()
            .filter(|c| self.written.circuits.get(&c.backend) != Some(c))
            .cloned()
            .collect();
        let del_circ: Vec<String> = self
            .written
            .circuits
            .keys()
            .filter(|k| !circuits.iter().any(|c| &c.backend == *k))
            .cloned()
            .collect();

        let stats = FlushStats {
            upserts: up_c.len() + up_j.len() + up_circ.len(),
            deletes: del_c.len() + del_j.len() + del_circ.len(),
        };
        if stats == FlushStats::default() {
            return Ok(stats);
        }
        let tx = self.conn.transaction().map_err(err)?;
        {
            let mut ins = tx
                .prepare_cached(
                    "INSERT INTO state_counters (scope, id, window, start, expires_at, tokens, requests, usd_micros)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                     ON CONFLICT (scope, id, window, start) DO UPDATE SET
                       expires_at = excluded.expires_at, tokens = excluded.tokens,
                       requests = excluded.requests, usd_micros = excluded.usd_micros",
                )
                .map_err(err)?;
            for (k, a, exp) in &up_c {
                let (w, s) = window_cols(k);
                ins.execute(params![
                    k.scope.as_str(),
                    &*k.id,
                    w,
                    s,
                    exp,
                    sql_int(a.tokens),
                    sql_int(a.requests),
                    sql_int(a.usd)
                ])
                .map_err(err)?;
            }
            let mut del = tx
                .prepare_cached(
                    "DELETE FROM state_counters WHERE scope = ?1 AND id = ?2 AND window = ?3 AND start = ?4",
                )
                .map_err(err)?;
            for k in &del_c {
                let (w, s) = window_cols(k);
                del.execute(params![k.scope.as_str(), &*k.id, w, s])
                    .map_err(err)?;
            }
            let mut ins = tx
                .prepare_cached(
                    "INSERT INTO state_jobs (id, attempts, fallbacks, last_seen) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (id) DO UPDATE SET attempts = excluded.attempts,
                       fallbacks = excluded.fallbacks, last_seen = excluded.last_seen",
                )
                .map_err(err)?;
            for (id, a, f, seen) in &up_j {
                ins.execute(params![&**id, a, f, seen]).map_err(err)?;
            }
            let mut del = tx
                .prepare_cached("DELETE FROM state_jobs WHERE id = ?1")
                .map_err(err)?;
            for id in &del_j {
                del.execute([&**id]).map_err(err)?;
            }
            let mut ins = tx
                .prepare_cached(
                    "INSERT INTO state_circuits (backend, state, failures, opened_at, open_until)
                     VALUES (?1, ?2, ?3, ?4, ?5)
                     ON CONFLICT (backend) DO UPDATE SET state = excluded.state,
                       failures = excluded.failures, opened_at = excluded.opened_at,
                       open_until = excluded.open_until",
                )
                .map_err(err)?;
            for c in &up_circ {
                ins.execute(params![
                    c.backend,
                    c.state,
                    c.failures,
                    c.opened_at,
                    c.open_until
                ])
                .map_err(err)?;
            }
            let mut del = tx
                .prepare_cached("DELETE FROM state_circuits WHERE backend = ?1")
                .map_err(err)?;
            for b in &del_circ {
                del.execute([b]).map_err(err)?;
            }
        }
        tx.commit().map_err(err)?;

        for (k, a, _) in up_c {
            self.written.counters.insert(k, a);
        }
        for k in del_c {
            self.written.counters.remove(&k);
        }
        for (id, a, f, seen) in up_j {
            self.written.jobs.insert(id, (a, f, seen));
        }
        for id in del_j {
            self.written.jobs.remove(&id);
        }
        for c in up_circ {
            self.written.circuits.insert(c.backend.clone(), c);
        }
        for b in del_circ {
            self.written.circuits.remove(&b);
        }
        Ok(stats)
    }

    /// Starts the write-behind thread. `circuits` reads the governor's circuits (the caller
    /// owns that conversion: the governor sits above this module).
    pub fn spawn(
        mut self,
        ledger: Arc<Ledger>,
        circuits: Box<dyn Fn() -> Vec<CircuitRow> + Send>,
        interval: Duration,
    ) -> std::io::Result<Persister> {
        let (stop, rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("tollgate-state".into())
            .spawn(move || {
                let mut failing = false;
                loop {
                    let last = !matches!(
                        rx.recv_timeout(interval),
                        Err(mpsc::RecvTimeoutError::Timeout)
                    );
                    let t0 = Instant::now();
                    match self.flush(&ledger, circuits()) {
                        Ok(s) => {
                            if failing {
                                tracing::info!("state: flushing to SQLite works again");
                                failing = false;
                            }
                            if s.upserts + s.deletes > 0 {
                                tracing::trace!(upserts = s.upserts, deletes = s.deletes, took_us = t0.elapsed().as_micros() as u64, "state flushed");
                            }
                        }
                        Err(e) => {
                            if !failing {
                                tracing::error!(error = %e, "state: flush to SQLite failed; retrying every flush_interval");
                            }
                            failing = true;
                        }
                    }
                    if last {
                        return;
                    }
                }
            })?;
        Ok(Persister {
            stop,
            thread: Some(thread),
        })
    }
}

/// The running write-behind thread.
#[derive(Debug)]
pub struct Persister {
    stop: mpsc::Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Persister {
    /// Flushes once more and stops (blocking: call from a blocking context).
    pub fn finish(mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// SQLite integers are signed: a counter past `i64::MAX` is stored saturated, never as a
/// negative number that would load back as zero.
fn sql_int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::{Scope, Window};

    fn key(scope: Scope, id: &str, window: Option<(Window, i64)>) -> CounterKey {
        CounterKey {
            scope,
            id: Arc::from(id),
            window: window.map(|(window, start)| WindowKey { window, start }),
        }
    }

    fn amt(t: u64, r: u64, u: u64) -> Amount {
        Amount {
            tokens: t,
            requests: r,
            usd: u,
        }
    }

    fn rows(path: &Path, table: &str) -> i64 {
        let c = Connection::open(path).unwrap();
        c.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn team_counters_and_per_consumer_jobs_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let now: Millis = 1_800_000_000_000;
        let team = key(Scope::Team, "team-a", Some((Window::Month, 1_798_761_600)));
        let (ja, jb) = (
            crate::ledger::job_key("alice", "jobX"),
            crate::ledger::job_key("bob", "jobX"),
        );
        let ledger = Ledger::new();
        ledger
            .counter(&team, now + 3_600_000)
            .add_committed(&amt(0, 2, 49_000_000));
        ledger
            .counter(&key(Scope::Job, &ja, None), i64::MAX)
            .add_committed(&amt(9, 1, 0));
        ledger.set_job(ja.clone(), 1, 0, now);
        ledger.set_job(jb.clone(), 3, 0, now);
        SqliteStore::open(&path)
            .unwrap()
            .flush(&ledger, Vec::new())
            .unwrap();

        let fresh = Ledger::new();
        SqliteStore::open(&path)
            .unwrap()
            .load(&fresh, now + 5, 3_600_000)
            .unwrap();
        assert_eq!(fresh.get(&team).unwrap().committed(), amt(0, 2, 49_000_000));
        let job_counter = fresh.get(&key(Scope::Job, &ja, None)).unwrap();
        assert_eq!(job_counter.committed(), amt(9, 1, 0));
        assert_eq!(fresh.job(&ja, now).attempts(), 1, "alice's jobX is hers");
        assert_eq!(fresh.job(&jb, now).attempts(), 3, "bob's jobX is his");
    }

    #[test]
    fn flush_and_load_round_trip_drops_ended_windows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let now: Millis = 1_800_000_000_000;
        let day = key(Scope::Consumer, "alice", Some((Window::Day, 1_799_971_200)));
        let minute = key(
            Scope::Consumer,
            "alice",
            Some((Window::Minute, 1_799_999_940)),
        );
        let job = key(Scope::Job, "job-1", None);
        let idle = key(
            Scope::Backend,
            "gemini",
            Some((Window::Month, 1_798_761_600)),
        );

        let ledger = Ledger::new();
        ledger
            .counter(&day, now + 3_600_000)
            .add_committed(&amt(120, 3, 4_500));
        // Ends 1 ms after `now`: flushed now, ended by the time we load.
        ledger
            .counter(&minute, now + 1)
            .add_committed(&amt(50, 1, 10));
        ledger.counter(&job, i64::MAX).add_committed(&amt(7, 1, 0));
        // A counter with only a reservation and nothing committed is not written.
        let held = ledger.counter(&idle, now + 3_600_000);
        held.try_reserve(&amt(500, 1, 0), &[None; 3]).unwrap();
        assert_eq!(held.reserved(), amt(500, 1, 0));
        let _ = ledger.job(&Arc::from("job-1"), now);
        ledger.set_job(Arc::from("job-1"), 2, 1, now);
        let circuits = vec![CircuitRow {
            backend: "gemini".into(),
            state: "OPEN".into(),
            failures: 5,
            opened_at: now - 10,
            open_until: now + 30_000,
        }];

        let mut store = SqliteStore::open(&path).unwrap();
        let s = store.flush(&ledger, circuits.clone()).unwrap();
        assert_eq!(s.upserts, 5, "3 counters, 1 job, 1 circuit");
        // Nothing changed: nothing written.
        assert_eq!(
            store.flush(&ledger, circuits.clone()).unwrap(),
            FlushStats::default()
        );
        // A change is written, and only it.
        ledger.get(&day).unwrap().add_committed(&amt(30, 1, 500));
        let s = store.flush(&ledger, circuits.clone()).unwrap();
        assert_eq!(
            s,
            FlushStats {
                upserts: 1,
                deletes: 0
            }
        );
        drop(store);
        assert_eq!(rows(&path, "state_counters"), 3);

        // Restart later: the minute window has ended.
        let fresh = Ledger::new();
        let mut store = SqliteStore::open(&path).unwrap();
        let loaded = store.load(&fresh, now + 5, 3_600_000).unwrap();
        assert_eq!(loaded, circuits);
        assert_eq!(fresh.get(&day).unwrap().committed(), amt(150, 4, 5_000));
        assert_eq!(fresh.get(&day).unwrap().expires_at(), now + 3_600_000);
        assert_eq!(fresh.get(&job).unwrap().committed(), amt(7, 1, 0));
        assert!(
            fresh.get(&minute).is_none(),
            "an ended window must not come back"
        );
        assert!(fresh.get(&idle).is_none());
        assert_eq!(
            rows(&path, "state_counters"),
            2,
            "the ended window is deleted"
        );
        let jobs = fresh.jobs_snapshot();
        assert_eq!(jobs.len(), 1);
        assert_eq!((jobs[0].1, jobs[0].2), (2, 1));

        // What disappears from memory (a forgotten job) disappears from the file.
        fresh.forget_job(&Arc::from("job-1"));
        let s = store.flush(&fresh, Vec::new()).unwrap();
        assert_eq!(
            s,
            FlushStats {
                upserts: 0,
                deletes: 3
            },
            "job counter, job, circuit"
        );
        assert_eq!(rows(&path, "state_counters"), 1);
        assert_eq!(rows(&path, "state_jobs"), 0);
        assert_eq!(rows(&path, "state_circuits"), 0);
    }

    #[test]
    fn idle_jobs_are_not_loaded_and_wal_is_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let ledger = Ledger::new();
        ledger.set_job(Arc::from("old"), 1, 0, 1_000);
        ledger.set_job(Arc::from("new"), 1, 0, 9_000);
        for id in ["old", "new"] {
            ledger
                .counter(&key(Scope::Job, id, None), i64::MAX)
                .add_committed(&amt(5, 1, 0));
        }
        let mut store = SqliteStore::open(&path).unwrap();
        store.flush(&ledger, Vec::new()).unwrap();
        drop(store);
        let fresh = Ledger::new();
        SqliteStore::open(&path)
            .unwrap()
            .load(&fresh, 10_000, 5_000)
            .unwrap();
        let ids: Vec<String> = fresh
            .jobs_snapshot()
            .iter()
            .map(|j| j.0.to_string())
            .collect();
        assert_eq!(ids, vec!["new".to_string()]);
        assert!(
            fresh.get(&key(Scope::Job, "old", None)).is_none(),
            "goes with its job"
        );
        assert!(fresh.get(&key(Scope::Job, "new", None)).is_some());
        let c = Connection::open(&path).unwrap();
        let mode: String = c
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
    }

    #[test]
    fn the_thread_flushes_on_its_interval_and_on_finish() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let ledger = Arc::new(Ledger::new());
        let k = key(Scope::Global, "global", Some((Window::Day, 0)));
        let store = SqliteStore::open(&path).unwrap();
        let p = store
            .spawn(
                ledger.clone(),
                Box::new(Vec::new),
                Duration::from_millis(20),
            )
            .unwrap();
        ledger
            .counter(&k, i64::MAX - 1)
            .add_committed(&amt(1, 1, 1));
        let deadline = Instant::now() + Duration::from_secs(5);
        while rows(&path, "state_counters") == 0 {
            assert!(Instant::now() < deadline, "not flushed within 5 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        // A change right before finish() is not lost.
        ledger.get(&k).unwrap().add_committed(&amt(1, 1, 1));
        p.finish();
        let c = Connection::open(&path).unwrap();
        let t: i64 = c
            .query_row("SELECT tokens FROM state_counters", [], |r| r.get(0))
            .unwrap();
        assert_eq!(t, 2);
    }
}
