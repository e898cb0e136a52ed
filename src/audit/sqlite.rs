//! `audit.sink: sqlite`: the usage log as a table in the state database (`state.path`). The
//! writer is its own connection in WAL mode beside the state store's, so its transactions
//! never block the counters' readers; a busy timeout rides out the other writer's commits.

use super::row::{usage_row, UsageRow, COLUMNS};
use super::{spill_at_shutdown, Audit, AuditWriter, Entry, SpillFile, BATCH_PAUSE, MAX_BATCH};
use rusqlite::{params, Connection};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;

/// How long a statement waits for the other writer's lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Backoff bounds when a batch cannot be committed (disk full, locked for long).
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// Failed tries after shutdown began before the rest is spilled to the JSONL file.
const SHUTDOWN_TRIES: u32 = 5;

/// Opens `path`, sets WAL and the busy timeout, and creates `table` with its index.
pub fn open(path: &Path, table: &str) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.execute_batch(&ddl(table))?;
    add_missing_columns(&conn, table)?;
    Ok(conn)
}

/// Adds the columns a log created by an older build lacks (the DDL only creates new tables).
fn add_missing_columns(conn: &Connection, table: &str) -> rusqlite::Result<()> {
    let mut have = Vec::new();
    {
        let mut st = conn.prepare(&format!("PRAGMA table_info({table})"))?;
        let mut rows = st.query([])?;
        while let Some(r) = rows.next()? {
            have.push(r.get::<_, String>(1)?);
        }
    }
    for (col, ty, _) in super::row::ADDED_COLUMNS {
        if !have.iter().any(|h| h == col) {
            conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {col} {ty}"))?;
        }
    }
    Ok(())
}

fn ddl(t: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {t} (
            id TEXT PRIMARY KEY,
            created_at TEXT NOT NULL,
            provider TEXT NOT NULL,
            model TEXT,
            input_tokens INTEGER NOT NULL,
            output_tokens INTEGER NOT NULL,
            latency_ms INTEGER NOT NULL,
            success INTEGER NOT NULL,
            error_message TEXT,
            consumer TEXT NOT NULL,
            request_id TEXT NOT NULL,
            job_id TEXT NOT NULL,
            tried TEXT NOT NULL,
            route TEXT NOT NULL,
            policy_version TEXT NOT NULL,
            estimated_input_tokens INTEGER NOT NULL,
            requested_output_tokens INTEGER NOT NULL,
            provenance TEXT NOT NULL,
            cost_usd REAL NOT NULL,
            action TEXT NOT NULL,
            reason TEXT NOT NULL,
            http_status INTEGER NOT NULL,
            endpoint TEXT NOT NULL,
            cached_input_tokens INTEGER NOT NULL DEFAULT 0,
            cache_write_tokens INTEGER NOT NULL DEFAULT 0,
            api TEXT NOT NULL DEFAULT '',
            team TEXT NOT NULL DEFAULT ''
        );
        CREATE INDEX IF NOT EXISTS {t}_created_at ON {t} (created_at);
        CREATE INDEX IF NOT EXISTS {t}_request_id ON {t} (request_id);"
    )
}

/// Inserts `rows` in one transaction (ids already present are skipped).
pub fn insert(conn: &mut Connection, table: &str, rows: &[UsageRow]) -> rusqlite::Result<()> {
    let marks = vec!["?"; COLUMNS.len()].join(",");
    let sql = format!(
        "INSERT OR IGNORE INTO {table} ({}) VALUES ({marks})",
        COLUMNS.join(",")
    );
    let tx = conn.transaction()?;
    {
        let mut st = tx.prepare_cached(&sql)?;
        for r in rows {
            st.execute(params![
                r.id,
                r.created_at,
                r.provider,
                r.model,
                r.input_tokens,
                r.output_tokens,
                r.latency_ms,
                r.success,
                r.error_message,
                r.consumer,
                r.request_id,
                r.job_id,
                r.tried,
                r.route,
                r.policy_version,
                r.estimated_input_tokens,
                r.requested_output_tokens,
                r.provenance,
                r.cost_usd,
                r.action,
                r.reason,
                r.http_status,
                r.endpoint,
                r.cached_input_tokens,
                r.cache_write_tokens,
                r.api,
                r.team,
            ])?;
        }
    }
    tx.commit()
}

/// Loads the spill file of an earlier run (rows refused at its shutdown) into the table,
/// then removes it; ids make a repeated load harmless.
fn replay(conn: &mut Connection, table: &str, path: &Path) -> Result<u64, String> {
    let Some(mut file) = SpillFile::open(path)? else {
        return Ok(0);
    };
    let mut n = 0u64;
    for rows in &mut file {
        let rows = rows?;
        insert(conn, table, &rows).map_err(|e| e.to_string())?;
        n += rows.len() as u64;
    }
    file.done(path)?;
    Ok(n)
}

/// Tries to load the spill file; `true` while it is still there to load later.
fn load_spill(conn: &mut Connection, table: &str, path: &Path) -> bool {
    match replay(conn, table, path) {
        Ok(0) => false,
        Ok(n) => {
            tracing::info!(rows = n, "usage log: spilled rows loaded into sqlite");
            false
        }
        Err(err) => {
            tracing::warn!(%err, "usage log: spilled rows not loaded yet; will retry");
            true
        }
    }
}

impl Audit {
    /// Starts a writer thread inserting usage rows into `table` of the SQLite file `path`.
    /// The table is created here, so a bad path fails `serve` at start. Rows that still
    /// cannot be committed at shutdown go to `spill_path` as JSON lines, loaded back at the
    /// next start.
    pub fn sqlite(
        path: &Path,
        table: &str,
        queue: usize,
        spill_path: PathBuf,
    ) -> Result<(Audit, AuditWriter), super::AuditError> {
        if !super::valid_table(table) {
            return Err(super::AuditError::Table(table.to_owned()));
        }
        let mut conn = open(path, table).map_err(|e| super::AuditError::Sqlite(e.to_string()))?;
        let table = table.to_owned();
        let (tx, mut rx) = mpsc::channel::<Entry>(queue.max(1));
        let stats = std::sync::Arc::new(super::Stats::default());
        let failed = stats.clone();
        let thread = std::thread::Builder::new()
            .name("tollgate-audit-sqlite".into())
            .spawn(move || {
                let mut batch: Vec<UsageRow> = Vec::new();
                // Rows an earlier run spilled are loaded first (and after any later commit
                // while the load keeps failing).
                let mut spilled = load_spill(&mut conn, &table, &spill_path);
                while let Some(e) = rx.blocking_recv() {
                    batch.push(usage_row(&e));
                    while batch.len() < MAX_BATCH {
                        match rx.try_recv() {
                            Ok(e) => batch.push(usage_row(&e)),
                            Err(_) => break,
                        }
                    }
                    // Keep the batch until it commits: a failure waits and retries, and the
                    // queue behind it makes requests wait rather than lose rows.
                    let mut pause = RETRY_MIN;
                    let mut failed_after_close = 0u32;
                    while let Err(err) = insert(&mut conn, &table, &batch) {
                        failed.failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::error!(%err, rows = batch.len(), "usage log: sqlite insert failed; retrying");
                        if rx.is_closed() {
                            failed_after_close += 1;
                            if failed_after_close >= SHUTDOWN_TRIES {
                                spill_at_shutdown(&mut rx, &mut batch, &spill_path);
                                return;
                            }
                        }
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(RETRY_MAX);
                    }
                    batch.clear();
                    if spilled {
                        spilled = load_spill(&mut conn, &table, &spill_path);
                    }
                    std::thread::sleep(BATCH_PAUSE);
                }
            })
            .map_err(|e| super::AuditError::Sqlite(e.to_string()))?;
        Ok((
            Audit { tx: Some(tx) },
            AuditWriter {
                thread: Some(thread),
                stats,
                retention: None,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log created by an older build gains the cache split and dialect columns at open, and
    /// rows keep them.
    #[test]
    fn an_older_log_gains_the_added_columns() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("usage.db");
        {
            let conn = Connection::open(&path).expect("open");
            let old = ddl("ai_usage_logs")
                .replace(
                    ",\n            cached_input_tokens INTEGER NOT NULL DEFAULT 0",
                    "",
                )
                .replace(
                    ",\n            cache_write_tokens INTEGER NOT NULL DEFAULT 0",
                    "",
                )
                .replace(",\n            api TEXT NOT NULL DEFAULT ''", "");
            assert!(!old.contains("cached_input_tokens"), "{old}");
            conn.execute_batch(&old).expect("old ddl");
        }
        let mut conn = open(&path, "ai_usage_logs").expect("open migrates");
        let mut rec = crate::governor::Record::new(
            "v".into(),
            "r1".into(),
            "j".into(),
            "c".into(),
            "chat".into(),
        );
        rec.actual_input_tokens = 100;
        rec.actual_cached_input_tokens = 60;
        rec.actual_cache_write_tokens = 25;
        let row = super::super::row::usage_row(&super::super::Entry {
            ts: "2026-12-01T00:00:00Z".into(),
            endpoint: "chat.completions",
            api: "gemini",
            latency_ms: 1.0,
            record: rec,
        });
        insert(&mut conn, "ai_usage_logs", &[row]).expect("insert");
        let (cached, write, api): (i64, i64, String) = conn
            .query_row(
                "SELECT cached_input_tokens, cache_write_tokens, api FROM ai_usage_logs",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .expect("read");
        assert_eq!((cached, write, api.as_str()), (60, 25, "gemini"));
        // Opening again is a no-op.
        drop(conn);
        open(&path, "ai_usage_logs").expect("reopen");
    }
}
