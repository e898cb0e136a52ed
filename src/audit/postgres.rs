//! `audit.sink: postgres`: usage rows inserted in batches by a writer thread with its own
//! single-threaded runtime (the proxy's workers never wait on the database). One statement
//! per batch: `INSERT ... SELECT FROM UNNEST(arrays) ON CONFLICT (id) DO NOTHING`, prepared
//! once per connection and good for any batch size.
//!
//! Outages: a batch that fails is kept, the connection is dropped, and the writer reconnects
//! with backoff and inserts the same batch again. Row ids are made before the first try, so
//! a batch whose commit landed just before the connection died is not duplicated. Rows that
//! arrive during the outage are appended to a local spill file (JSON lines) instead of
//! filling the queue, so requests do not wait on the database; once it is back, the file is
//! loaded (idempotently) and removed. At shutdown the writer tries `SHUTDOWN_TRIES` more
//! rounds, then spills what it holds; the next start loads it.

use super::row::{usage_row, UsageRow, ADDED_COLUMNS, COLUMNS};
use super::{
    spill, spill_at_shutdown, Audit, AuditError, AuditWriter, Entry, SpillFile, BATCH_PAUSE,
    MAX_BATCH,
};
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Statement};

const RETRY_MIN: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// Bounds one connect or one batch insert, so a silent network drop cannot stall the writer.
const OP_TIMEOUT: Duration = Duration::from_secs(10);
/// Failed rounds after shutdown began before the rest is spilled to the JSONL file.
const SHUTDOWN_TRIES: u32 = 5;

/// The DDL run on every (re)connect; idempotent.
pub fn ddl(t: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {t} (
            id uuid PRIMARY KEY,
            created_at timestamptz NOT NULL,
            provider text NOT NULL,
            model text,
            input_tokens bigint NOT NULL,
            output_tokens bigint NOT NULL,
            latency_ms bigint NOT NULL,
            success boolean NOT NULL,
            error_message text,
            consumer text NOT NULL,
            request_id text NOT NULL,
            job_id text NOT NULL,
            tried text NOT NULL,
            route text NOT NULL,
            policy_version text NOT NULL,
            estimated_input_tokens bigint NOT NULL,
            requested_output_tokens bigint NOT NULL,
            provenance text NOT NULL,
            cost_usd double precision NOT NULL,
            action text NOT NULL,
            reason text NOT NULL,
            http_status integer NOT NULL,
            endpoint text NOT NULL
        );
        CREATE INDEX IF NOT EXISTS {t}_created_at ON {t} (created_at);
        CREATE INDEX IF NOT EXISTS {t}_request_id ON {t} (request_id);{added}",
        added = ADDED_COLUMNS
            .iter()
            .map(|(c, _, ty)| format!(
                "\n        ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {c} {ty};"
            ))
            .collect::<String>()
    )
}

/// The batch insert for `t` (prepare once per connection).
pub fn insert_sql(t: &str) -> String {
    // Arrays of text for id/created_at, cast in the SELECT: the client sends plain text.
    let types = [
        "text", "text", "text", "text", "int8", "int8", "int8", "bool", "text", "text", "text",
        "text", "text", "text", "text", "int8", "int8", "text", "float8", "text", "text", "int4",
        "text", "int8", "int8", "text", "text",
    ];
    let args: Vec<String> = types
        .iter()
        .enumerate()
        .map(|(i, ty)| format!("${}::{ty}[]", i + 1))
        .collect();
    let select: Vec<String> = COLUMNS
        .iter()
        .map(|c| match *c {
            "id" => "u.id::uuid".to_owned(),
            "created_at" => "u.created_at::timestamptz".to_owned(),
            c => format!("u.{c}"),
        })
        .collect();
    format!(
        "INSERT INTO {t} ({cols}) SELECT {select} FROM UNNEST({args}) AS u({cols}) \
         ON CONFLICT (id) DO NOTHING",
        cols = COLUMNS.join(","),
        select = select.join(","),
        args = args.join(","),
    )
}

/// Inserts `rows` with one statement (atomic on its own); returns the rows actually added.
pub async fn insert(
    c: &Client,
    st: &Statement,
    rows: &[UsageRow],
) -> Result<u64, tokio_postgres::Error> {
    macro_rules! col {
        ($f:ident) => {
            rows.iter().map(|r| r.$f.clone()).collect::<Vec<_>>()
        };
    }
    let (id, created_at, provider, model) =
        (col!(id), col!(created_at), col!(provider), col!(model));
    let (input, output, latency, success) = (
        col!(input_tokens),
        col!(output_tokens),
        col!(latency_ms),
        col!(success),
    );
    let (error, consumer, request_id, job_id) = (
        col!(error_message),
        col!(consumer),
        col!(request_id),
        col!(job_id),
    );
    let (tried, route, version) = (col!(tried), col!(route), col!(policy_version));
    let (est_in, req_out, provenance, cost) = (
        col!(estimated_input_tokens),
        col!(requested_output_tokens),
        col!(provenance),
        col!(cost_usd),
    );
    let (action, reason, status, endpoint) = (
        col!(action),
        col!(reason),
        col!(http_status),
        col!(endpoint),
    );
    let (cached, cache_write, api, team) = (
        col!(cached_input_tokens),
        col!(cache_write_tokens),
        col!(api),
        col!(team),
    );
    let params: [&(dyn ToSql + Sync); 27] = [
        &id,
        &created_at,
        &provider,
        &model,
        &input,
        &output,
        &latency,
        &success,
        &error,
        &consumer,
        &request_id,
        &job_id,
        &tried,
        &route,
        &version,
        &est_in,
        &req_out,
        &provenance,
        &cost,
        &action,
        &reason,
        &status,
        &endpoint,
        &cached,
        &cache_write,
        &api,
        &team,
    ];
    c.execute(st, &params).await
}

/// A live connection with the insert prepared.
struct Conn {
    client: Client,
    insert: Statement,
}

async fn connect(cfg: &tokio_postgres::Config, table: &str) -> Result<Conn, String> {
    let (client, connection) = cfg.connect(NoTls).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        if let Err(err) = connection.await {
            tracing::warn!(%err, "usage log: postgres connection closed");
        }
    });
    client
        .batch_execute(&ddl(table))
        .await
        .map_err(|e| e.to_string())?;
    let insert = client
        .prepare(&insert_sql(table))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Conn { client, insert })
}

/// One attempt at `rows`: (re)connects when needed.
async fn try_insert(
    conn: &mut Option<Conn>,
    cfg: &tokio_postgres::Config,
    table: &str,
    rows: &[UsageRow],
) -> Result<(), String> {
    if conn.is_none() {
        let c = tokio::time::timeout(OP_TIMEOUT, connect(cfg, table))
            .await
            .map_err(|_| "connect timed out".to_owned())??;
        tracing::info!("usage log: connected to postgres");
        *conn = Some(c);
    }
    let Some(c) = conn.as_ref() else {
        return Err("no connection".into());
    };
    match tokio::time::timeout(OP_TIMEOUT, insert(&c.client, &c.insert, rows)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("insert timed out".into()),
    }
}

impl Audit {
    /// Starts the Postgres writer. The URL is checked here (a malformed one fails `serve` at
    /// start); an unreachable server is not an error: the writer keeps retrying.
    pub fn postgres(
        url: &str,
        table: &str,
        queue: usize,
        spill_path: PathBuf,
    ) -> Result<(Audit, AuditWriter), AuditError> {
        if !super::valid_table(table) {
            return Err(AuditError::Table(table.to_owned()));
        }
        // The parse error never echoes the URL (it may hold a password).
        let mut cfg: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| AuditError::Postgres(e.to_string()))?;
        cfg.connect_timeout(OP_TIMEOUT);
        cfg.application_name("tollgate-audit");
        let table = table.to_owned();
        let (tx, rx) = mpsc::channel::<Entry>(queue.max(1));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| AuditError::Postgres(e.to_string()))?;
        let stats = std::sync::Arc::new(super::Stats::default());
        let failed = stats.clone();
        let thread = std::thread::Builder::new()
            .name("tollgate-audit-pg".into())
            .spawn(move || rt.block_on(run(rx, cfg, table, spill_path, failed)))
            .map_err(|e| AuditError::Postgres(e.to_string()))?;
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

async fn run(
    mut rx: mpsc::Receiver<Entry>,
    cfg: tokio_postgres::Config,
    table: String,
    spill_path: PathBuf,
    failed: std::sync::Arc<super::Stats>,
) {
    let mut conn: Option<Conn> = None;
    let mut batch: Vec<UsageRow> = Vec::new();
    // Rows spilled by an earlier run (an outage, or a shutdown with the database away) are
    // loaded first; ids make the replay idempotent.
    let mut spilled = spill_path.exists();
    loop {
        if batch.is_empty() && !spilled {
            match rx.recv().await {
                Some(e) => batch.push(usage_row(&e)),
                None => return,
            }
        }
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(e) => batch.push(usage_row(&e)),
                Err(_) => break,
            }
        }
        let mut pause = RETRY_MIN;
        let mut failed_after_close = 0u32;
        loop {
            let err = match try_insert(&mut conn, &cfg, &table, &batch).await {
                Ok(()) if !spilled => break,
                Ok(()) => match replay(&mut conn, &cfg, &table, &spill_path).await {
                    Ok(n) => {
                        tracing::info!(rows = n, "usage log: spilled rows loaded into postgres");
                        spilled = false;
                        break;
                    }
                    Err(e) => e,
                },
                Err(e) => e,
            };
            conn = None;
            failed
                .failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(%err, rows = batch.len(), "usage log: postgres write failed; reconnecting");
            if rx.is_closed() {
                failed_after_close += 1;
                if failed_after_close >= SHUTDOWN_TRIES {
                    spill_at_shutdown(&mut rx, &mut batch, &spill_path);
                    return;
                }
            }
            // Until the retry, rows that arrive go to the spill file: requests never wait
            // on an outage (the file is loaded, in order, once the database is back).
            let until = tokio::time::Instant::now() + pause;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => break,
                    e = rx.recv() => {
                        let Some(e) = e else {
                            // Shutting down: still wait out the pause before the next try.
                            tokio::time::sleep_until(until).await;
                            break;
                        };
                        let mut more = vec![usage_row(&e)];
                        while let Ok(e) = rx.try_recv() {
                            more.push(usage_row(&e));
                        }
                        if spill(&spill_path, &more) {
                            failed
                                .spilled
                                .fetch_add(more.len() as u64, std::sync::atomic::Ordering::Relaxed);
                            spilled = true;
                        } else {
                            batch.extend(more);
                        }
                    }
                }
            }
            pause = (pause * 2).min(RETRY_MAX);
        }
        batch.clear();
        tokio::time::sleep(BATCH_PAUSE).await;
    }
}

/// Loads the spill file into the table in batches, then removes it (ids make it idempotent).
async fn replay(
    conn: &mut Option<Conn>,
    cfg: &tokio_postgres::Config,
    table: &str,
    path: &std::path::Path,
) -> Result<u64, String> {
    let Some(mut file) = SpillFile::open(path)? else {
        return Ok(0);
    };
    let mut n = 0u64;
    for rows in &mut file {
        let rows = rows?;
        try_insert(conn, cfg, table, &rows).await?;
        n += rows.len() as u64;
    }
    file.done(path)?;
    Ok(n)
}
