//! Persistence and sharing of ledger state (ARCHITECTURE.md: `state/` sits above `ledger/`).
//!
//! * `memory`: nothing here; the ledger alone.
//! * `sqlite` ([`sqlite`]): a write-behind thread persists committed counters, job ledgers
//!   and circuit states in one transaction per `state.flush_interval`, loaded at start.
//! * `redis` ([`redis`]): counters shared by replicas through server-side scripts, behind
//!   the governor's [`crate::ledger::SharedCounters`] seam.
//!
//! Circuits belong to the governor, which sits above this module, so they cross the seam as
//! plain [`CircuitRow`]s that the caller converts.

pub mod redis;
pub mod slices;
pub mod sqlite;

pub use redis::RedisStore;
pub use slices::SlicedStore;
pub use sqlite::{Persister, SqliteStore};

/// A circuit breaker's persisted state (the governor's `Circuit` in plain values).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CircuitRow {
    pub backend: String,
    /// `CLOSED`, `HALF_OPEN` or `OPEN`.
    pub state: String,
    pub failures: u32,
    pub opened_at: i64,
    pub open_until: i64,
}

/// A failure to open, load or write the state store.
#[derive(Debug, thiserror::Error)]
#[error("state: {0}")]
pub struct StateError(pub String);
