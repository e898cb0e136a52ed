//! `audit.retention_days`: the usage log's rows older than the retention period are deleted
//! by a thread of their own, at start and then hourly, in small batches, so neither the
//! request path nor the usage-log writer ever waits on a large delete.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often old rows are looked for.
const EVERY: Duration = Duration::from_secs(3600);
/// Rows deleted per statement: short transactions, so the writer's inserts interleave.
const BATCH: i64 = 10_000;
/// A day in seconds.
const DAY: i64 = 86_400;

/// The pruning thread; `stop` ends it (it also ends when dropped with its owner).
#[derive(Debug)]
pub struct Retention {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Retention {
    /// Prunes `table` of the SQLite file `path`: rows older than `days`.
    pub fn sqlite(path: std::path::PathBuf, table: String, days: u32) -> std::io::Result<Self> {
        spawn("tollgate-audit-retention", move || {
            let res = rusqlite::Connection::open(&path).and_then(|conn| {
                conn.busy_timeout(Duration::from_secs(5))?;
                prune_sqlite(&conn, &table, days, jiff::Timestamp::now())
            });
            report(res.map_err(|e| e.to_string()), days);
        })
    }

    /// Prunes `table` of the Postgres database at `url`: rows older than `days`.
    pub fn postgres(url: &str, table: String, days: u32) -> std::io::Result<Self> {
        let cfg: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| std::io::Error::other(e.to_string()))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        spawn("tollgate-audit-retention", move || {
            let res = rt.block_on(async {
                let (client, conn) = tokio::time::timeout(
                    Duration::from_secs(10),
                    cfg.connect(tokio_postgres::NoTls),
                )
                .await
                .map_err(|_| "connect timed out".to_owned())?
                .map_err(|e| e.to_string())?;
                let task = tokio::spawn(conn);
                let res = prune_postgres(&client, &table, days).await;
                drop(client);
                let _ = task.await;
                res.map_err(|e| e.to_string())
            });
            report(res, days);
        })
    }

    /// Ends the thread (a prune under way finishes its current batch first).
    pub fn stop(self) {
        drop(self.stop);
        let _ = self.thread.join();
    }
}

fn spawn(name: &str, mut prune: impl FnMut() + Send + 'static) -> std::io::Result<Retention> {
    let (stop, stopped) = mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || loop {
            prune();
            match stopped.recv_timeout(EVERY) {
                Err(RecvTimeoutError::Timeout) => continue,
                _ => return,
            }
        })?;
    Ok(Retention { stop, thread })
}

fn report(res: Result<u64, String>, days: u32) {
    match res {
        Ok(0) => {}
        Ok(rows) => tracing::info!(rows, days, "usage log: rows past the retention deleted"),
        Err(err) => {
            tracing::warn!(%err, "usage log: retention could not delete old rows; trying again in an hour")
        }
    }
}

/// Deletes the rows of `table` created more than `days` before `now`, in batches; returns how
/// many. `created_at` is fixed-width UTC text, so text order is time order.
pub fn prune_sqlite(
    conn: &rusqlite::Connection,
    table: &str,
    days: u32,
    now: jiff::Timestamp,
) -> rusqlite::Result<u64> {
    if !super::valid_table(table) {
        return Err(rusqlite::Error::InvalidParameterName(table.to_owned()));
    }
    let cutoff = now
        .checked_sub(jiff::SignedDuration::from_secs(i64::from(days) * DAY))
        .unwrap_or(jiff::Timestamp::MIN);
    let cutoff = super::row::format_utc(cutoff);
    let sql = format!(
        "DELETE FROM {table} WHERE rowid IN \
         (SELECT rowid FROM {table} WHERE created_at < ?1 LIMIT {BATCH})"
    );
    let mut total = 0u64;
    loop {
        let n = conn.execute(&sql, [&cutoff])?;
        total = total.saturating_add(n as u64);
        if (n as i64) < BATCH {
            return Ok(total);
        }
    }
}

/// Deletes the rows of `table` created more than `days` ago (the database's clock), in
/// batches; returns how many.
pub async fn prune_postgres(
    client: &tokio_postgres::Client,
    table: &str,
    days: u32,
) -> Result<u64, tokio_postgres::Error> {
    if !super::valid_table(table) {
        // Never spliced into SQL unchecked; the policy validated it, so this is a bug.
        return Ok(0);
    }
    let days = i32::try_from(days).unwrap_or(i32::MAX);
    let sql = format!(
        "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} \
         WHERE created_at < now() - make_interval(days => $1) LIMIT {BATCH})"
    );
    let mut total = 0u64;
    loop {
        let n = client.execute(&sql, &[&days]).await?;
        total = total.saturating_add(n);
        if (n as i64) < BATCH {
            return Ok(total);
        }
    }
}
