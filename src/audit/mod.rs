//! The audit trail: one record per governed request, written by a background thread
//! through a bounded queue. When the queue is full the request waits — records are never
//! dropped. Records hold ids, counts and reasons; never a key, a prompt or a response.
//!
//! Sinks: JSONL (the full decision record), or the usage log (`row`) in SQLite (`sqlite`)
//! or Postgres (`postgres`); `report` reads the usage log back for `tollgate usage`.

mod line;
pub mod postgres;
pub mod report;
mod retention;
mod rotate;
pub mod row;
mod spill;
pub mod sqlite;

pub use retention::{prune_postgres, prune_sqlite, Retention};
pub use rotate::{jsonl_files, open_jsonl, Rotation};

pub use row::{usage_row, valid_table, UsageRow};
use spill::{spill, spill_at_shutdown, SpillFile};

use crate::governor::Record;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use tokio::sync::mpsc;

/// How long the writer lets records gather after writing a batch (bounds the audit lag).
const BATCH_PAUSE: std::time::Duration = std::time::Duration::from_millis(5);
/// Most usage rows written in one transaction / statement.
const MAX_BATCH: usize = 1000;

/// Why a sink could not start.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("cannot open the audit file: {0}")]
    Io(#[from] std::io::Error),
    #[error("audit.table `{0}` is not a plain SQL name")]
    Table(String),
    #[error("sqlite usage log: {0}")]
    Sqlite(String),
    #[error("postgres usage log: {0}")]
    Postgres(String),
}

/// One audit line: the decision record plus when and where.
#[derive(Debug, Serialize)]
pub struct Entry {
    pub ts: String,
    pub endpoint: &'static str,
    /// The client's dialect (`openai`, `anthropic`, `gemini`, `ollama`, `responses`).
    pub api: &'static str,
    /// Wall time of the whole request in the sidecar, ms.
    pub latency_ms: f64,
    #[serde(flatten)]
    pub record: Record,
}

/// Waiting for room in a full audit queue (see [`Audit::queue`]).
pub type QueueWait = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// The sending side, cloned into every request.
#[derive(Debug, Clone)]
pub struct Audit {
    tx: Option<mpsc::Sender<Entry>>,
}

/// Owns the writer thread; `finish` drains the queue and flushes.
#[derive(Debug)]
pub struct AuditWriter {
    thread: Option<std::thread::JoinHandle<()>>,
    stats: std::sync::Arc<Stats>,
    retention: Option<Retention>,
}

/// What a database sink went through: how an outage shows.
#[derive(Debug, Default)]
pub struct Stats {
    /// Failed batch writes (each one is retried).
    pub failures: std::sync::atomic::AtomicU64,
    /// Rows written to the spill file while the database was away.
    pub spilled: std::sync::atomic::AtomicU64,
}

impl Audit {
    /// An audit that writes nothing (`audit.sink: off`, tests).
    pub fn off() -> Self {
        Audit { tx: None }
    }

    /// Starts a JSONL writer appending to `path`, never rotating it.
    pub fn jsonl(path: PathBuf, queue: usize) -> std::io::Result<(Audit, AuditWriter)> {
        Audit::jsonl_with(path, queue, Rotation::NEVER)
    }

    /// Starts a JSONL writer appending to `path` (`-`: standard output, never rotated),
    /// rotating it by size as `rotation` says.
    pub fn jsonl_with(
        path: PathBuf,
        queue: usize,
        rotation: Rotation,
    ) -> std::io::Result<(Audit, AuditWriter)> {
        let mut out = if path.as_os_str() == "-" {
            JsonlOut::Stdout(Vec::with_capacity(256 * 1024))
        } else {
            JsonlOut::File(Box::new(rotate::RotatingFile::open(path, rotation)?))
        };
        let (tx, mut rx) = mpsc::channel::<Entry>(queue.max(1));
        let thread = std::thread::Builder::new()
            .name("tollgate-audit".into())
            .spawn(move || {
                let mut line = Vec::with_capacity(2048);
                while let Some(e) = rx.blocking_recv() {
                    out.write(&mut line, &e);
                    // Drain what is queued, then flush once: batched writes under load.
                    while let Ok(e) = rx.try_recv() {
                        out.write(&mut line, &e);
                    }
                    if let Err(err) = out.flush() {
                        tracing::error!(%err, "audit flush failed");
                    }
                    // Under load, let records gather for a moment instead of waking this
                    // thread once per request; when idle, the next record wakes it at once.
                    std::thread::sleep(BATCH_PAUSE);
                }
                let _ = out.flush();
                if let JsonlOut::File(f) = &mut out {
                    f.wait_chores();
                }
            })?;
        Ok((
            Audit { tx: Some(tx) },
            AuditWriter {
                thread: Some(thread),
                stats: Default::default(),
                retention: None,
            },
        ))
    }

    /// Queues a record; waits while the queue is full.
    pub async fn record(&self, e: Entry) {
        if let Some(wait) = self.queue(e) {
            wait.await;
        }
    }

    /// Queues a record without waiting when the queue has room (the common case: no future
    /// holding the record lives in the request's state); when it is full, the returned
    /// future waits for room and must be awaited — records are never dropped.
    pub fn queue(&self, e: Entry) -> Option<QueueWait> {
        let tx = self.tx.as_ref()?;
        match tx.try_send(e) {
            Ok(()) => None,
            Err(mpsc::error::TrySendError::Full(e)) => {
                let tx = tx.clone();
                Some(Box::pin(async move {
                    if tx.send(e).await.is_err() {
                        tracing::error!("audit writer is gone; record not written");
                    }
                }))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                tracing::error!("audit writer is gone; record not written");
                None
            }
        }
    }
}

/// Where the JSONL writer puts lines.
enum JsonlOut {
    File(Box<rotate::RotatingFile>),
    /// Lines of the current batch: written under one lock of stdout, so the process's own
    /// log lines (also on stdout) never land inside an audit line.
    Stdout(Vec<u8>),
}

impl JsonlOut {
    fn write(&mut self, line: &mut Vec<u8>, e: &Entry) {
        line.clear();
        let res = line::write(&mut *line, e).and_then(|()| match self {
            JsonlOut::File(f) => f.write_line(line),
            JsonlOut::Stdout(batch) => {
                batch.extend_from_slice(line);
                Ok(())
            }
        });
        if let Err(err) = res {
            tracing::error!(%err, "audit write failed");
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            JsonlOut::File(f) => f.flush(),
            JsonlOut::Stdout(batch) => {
                let mut out = std::io::stdout().lock();
                let res = out.write_all(batch).and_then(|()| out.flush());
                batch.clear();
                res
            }
        }
    }
}

impl AuditWriter {
    /// Failed (and retried) batch writes since start; 0 for JSONL.
    pub fn failures(&self) -> u64 {
        self.stats
            .failures
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Rows spilled to the local file while the database was away, since start.
    pub fn spilled(&self) -> u64 {
        self.stats
            .spilled
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Deletes the usage log's old rows now and then, off the request path, until `finish`.
    pub fn with_retention(mut self, r: Retention) -> Self {
        self.retention = Some(r);
        self
    }

    /// Waits until every queued record is written (all `Audit` senders must be dropped).
    pub fn finish(mut self) {
        if let Some(r) = self.retention.take() {
            r.stop();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
