//! The Postgres usage log against the real server on 127.0.0.1:5432 (issue 6 items 2 and 4):
//! a load run leaves exactly one row per request, and so does a load run during which
//! Postgres is restarted (`pg_ctlcluster ... restart`; where that is impossible, every
//! connection of the writer is killed with `pg_terminate_backend` over and over instead).
//! Each test uses its own table; the two run one at a time since one restarts the server.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mock::{Answer, MockUpstream};
use common::sidecar::Sidecar;
use common::try_post_json;
use serde_json::{json as j, Value};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tollgate::audit::Audit;

const URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const PROMPT: u64 = 9;
const COMPLETION: u64 = 4;

/// One test at a time: the restart test takes the server away from everyone in this binary.
static SERIAL: Mutex<()> = Mutex::const_new(());

fn table(tag: &str) -> String {
    format!(
        "usage_{tag}_{}_{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

fn policy(upstream: &str, table: &str) -> String {
    format!(
        r#"
version: pg-1
backends:
  - {{id: primary, kind: openai, base_url: {upstream}, price_per_1k: {{input: 1.0, output: 1.0}}}}
routes:
  - model: chat
    chain: [{{backend: primary, model: small-1}}]
state: {{backend: memory}}
audit: {{sink: postgres, postgres_url: "{URL}", table: {table}}}
"#
    )
}

/// A fresh connection per call (the server may have been restarted in between); `None` while
/// it is unreachable.
async fn client() -> Option<tokio_postgres::Client> {
    let (c, conn) = tokio_postgres::connect(URL, tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(conn);
    Some(c)
}

async fn request_ids(table: &str) -> Option<Vec<String>> {
    let c = client().await?;
    let rows = c
        .query(&format!("SELECT request_id FROM {table}"), &[])
        .await
        .ok()?;
    Some(rows.iter().map(|r| r.get(0)).collect())
}

/// Waits (bounded) until `table` holds `n` rows, then returns every row's request id.
async fn wait_rows(table: &str, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ids = request_ids(table).await.unwrap_or_default();
        if ids.len() >= n || Instant::now() > deadline {
            return ids;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every sent request id has exactly one row, and there is no other row.
fn assert_one_row_each(ids: &[String], sent: &HashSet<String>) {
    let mut seen = HashSet::new();
    let dups: Vec<&String> = ids.iter().filter(|i| !seen.insert(*i)).collect();
    assert!(dups.is_empty(), "duplicated rows: {dups:?}");
    let missing: Vec<&String> = sent.iter().filter(|i| !seen.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "{} requests have no row: {missing:?}",
        missing.len()
    );
    assert_eq!(ids.len(), sent.len(), "rows that belong to no request");
}

async fn drop_table(table: &str) {
    if let Some(c) = client().await {
        let _ = c
            .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
            .await;
    }
}

/// Sends `n` chat requests with ids `{tag}-{i}`, `conc` at a time, counting answers in `done`. Returns the ids sent.
async fn load(
    url: String,
    tag: &'static str,
    n: usize,
    conc: usize,
    done: Arc<AtomicUsize>,
) -> HashSet<String> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (url, next, done) = (url.clone(), next.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let body = j!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20});
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return;
                }
                let rid = format!("{tag}-{i}");
                let (status, _, _) = try_post_json(&url, &body, &[("x-request-id", &rid), ("x-tollgate-consumer", "loader")])
                    .await
                    .unwrap_or_else(|e| panic!("{rid}: {e}"));
                assert_eq!(status, 200, "{rid}");
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.expect("load task");
    }
    (0..n).map(|i| format!("{tag}-{i}")).collect()
}

async fn start(
    tag: &str,
    table: &str,
    delay: Duration,
) -> (
    MockUpstream,
    Sidecar,
    tollgate::audit::AuditWriter,
    std::path::PathBuf,
) {
    let up = MockUpstream::start_with_default(
        vec![],
        Answer::ok_chat("ok", PROMPT, COMPLETION).delay(delay),
    )
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let spill = dir.path().join(format!("{tag}-spill.jsonl"));
    let (audit, writer) = Audit::postgres(URL, table, 256, spill.clone()).expect("postgres audit");
    let sc = Sidecar::start_with_audit(&policy(&up.base_url(), table), audit, dir).await;
    (up, sc, writer, spill)
}

async fn stop(sc: Sidecar, writer: tollgate::audit::AuditWriter) {
    sc.stop().await;
    tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || writer.finish()),
    )
    .await
    .expect("the writer finishes")
    .expect("join");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_usage_log_has_one_row_per_request_of_a_load_run() {
    let _serial = SERIAL.lock().await;
    const N: usize = 300;
    let table = table("load");
    let (_up, sc, writer, spill) = start("load", &table, Duration::ZERO).await;
    let t0 = Instant::now();
    let sent = load(sc.chat_url(), "load", N, 16, Arc::new(AtomicUsize::new(0))).await;
    let ids = wait_rows(&table, N).await;
    eprintln!(
        "load: {N} requests answered and logged in {:?}",
        t0.elapsed()
    );
    assert_one_row_each(&ids, &sent);
    assert_eq!(writer.failures(), 0);

    // The row's columns, and `tollgate usage --postgres` over the same table.
    let c = client().await.expect("postgres up");
    let row = c
        .query_one(
            &format!("SELECT provider, model, input_tokens, output_tokens, success, consumer, provenance, action, http_status, cost_usd FROM {table} WHERE request_id = 'load-7'"),
            &[],
        )
        .await
        .expect("row");
    assert_eq!(row.get::<_, String>(0), "primary");
    assert_eq!(row.get::<_, Option<String>>(1).as_deref(), Some("small-1"));
    assert_eq!(
        (row.get::<_, i64>(2), row.get::<_, i64>(3)),
        (PROMPT as i64, COMPLETION as i64)
    );
    assert!(row.get::<_, bool>(4));
    assert_eq!(row.get::<_, String>(5), "loader");
    assert_eq!(row.get::<_, String>(6), "ACTUAL");
    assert_eq!(row.get::<_, String>(7), "ALLOW");
    assert_eq!(row.get::<_, i32>(8), 200);
    assert!((row.get::<_, f64>(9) - 0.013).abs() < 1e-9);

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "usage",
            "--policy",
            "policies/default.yaml",
            "--postgres",
            URL,
            "--table",
            &table,
            "--json",
        ])
        .env_remove("TOLLGATE_POLICY")
        .output()
        .expect("run tollgate usage");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    let p = &v["providers"][0];
    assert_eq!(p["name"], "primary");
    assert_eq!(p["requests_today"], N as i64);
    assert_eq!(p["input_tokens_today"], (N as u64 * PROMPT) as i64);
    assert_eq!(p["output_tokens_today"], (N as u64 * COMPLETION) as i64);
    assert!((p["cost_usd_month"].as_f64().unwrap() - 0.013 * N as f64).abs() < 1e-6);
    assert_eq!(v["consumers"][0]["name"], "loader");
    // The URL from the environment instead (a password kept out of argv): the same answer.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "usage",
            "--policy",
            "policies/default.yaml",
            "--table",
            &table,
            "--json",
        ])
        .env_remove("TOLLGATE_POLICY")
        .env("TOLLGATE_USAGE_POSTGRES_URL", URL)
        .output()
        .expect("run tollgate usage");
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(serde_json::from_slice::<Value>(&out.stdout).unwrap(), v);

    stop(sc, writer).await;
    assert!(
        !spill.exists(),
        "nothing spilled when the database is healthy"
    );
    drop_table(&table).await;
}

/// Restarts the local cluster; `false` when this machine cannot (no pg_ctlcluster, no rights).
fn restart_postgres() -> bool {
    let Some(version) = std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).next())
    else {
        return false;
    };
    std::process::Command::new("pg_ctlcluster")
        .arg("--skip-systemctl-redirect")
        .arg(&version)
        .args(["main", "restart"])
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts the cluster if it is down (the test must leave Postgres up whatever happens).
fn ensure_postgres_up() {
    if let Some(version) = std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).next())
    {
        let _ = std::process::Command::new("pg_ctlcluster")
            .arg("--skip-systemctl-redirect")
            .arg(&version)
            .args(["main", "start"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

struct KeepPostgresUp;
impl Drop for KeepPostgresUp {
    fn drop(&mut self) {
        ensure_postgres_up();
    }
}

/// Whether the load `run` has sent fewer than `n` requests: it is still going. Fails after
/// two minutes, and returns false when the run ended early (awaiting it shows why).
fn still_short_of<T>(done: &AtomicUsize, n: usize, run: &JoinHandle<T>, t0: Instant) -> bool {
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "the load stalled at {} of {n} requests",
        done.load(Ordering::Relaxed)
    );
    done.load(Ordering::Relaxed) < n && !run.is_finished()
}

/// Terminates the audit writer's backends every 20 ms until `done` reaches `n` (or the load
/// `run` ends); returns how many were killed.
async fn kill_writers_until<T>(done: &AtomicUsize, n: usize, run: &JoinHandle<T>) -> usize {
    let mut kills = 0;
    let t0 = Instant::now();
    while still_short_of(done, n, run, t0) {
        if let Some(c) = client().await {
            if let Ok(r) = c
                .query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE application_name = 'tollgate-audit' AND pid <> pg_backend_pid()",
                    &[],
                )
                .await
            {
                kills += r.len();
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    kills
}

async fn postmaster_start() -> Option<String> {
    let c = client().await?;
    let r = c
        .query_one("SELECT pg_postmaster_start_time()::text", &[])
        .await
        .ok()?;
    Some(r.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_usage_log_loses_no_row_when_postgres_restarts_mid_run() {
    let _serial = SERIAL.lock().await;
    let _up_guard = KeepPostgresUp;
    const N: usize = 600;
    let table = table("restart");
    // 25 ms per upstream call, 4 at a time: the run lasts about 4 s and the restart (about
    // 2.5 s here) starts a quarter in, so rows are queued before, during and after the outage.
    let (_up, sc, writer, spill) = start("restart", &table, Duration::from_millis(25)).await;
    let before = postmaster_start()
        .await
        .expect("postgres up before the test");
    let done = Arc::new(AtomicUsize::new(0));
    let run = tokio::spawn(load(sc.chat_url(), "restart", N, 4, done.clone()));
    let t0 = Instant::now();
    while still_short_of(&done, N / 4, &run, t0) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let at = done.load(Ordering::Relaxed);
    let restarted = tokio::task::spawn_blocking(restart_postgres)
        .await
        .expect("join");
    let mut kills = 0;
    if !restarted {
        // No restart possible here: kill the writer's connections until the run ends.
        eprintln!("pg_ctlcluster restart unavailable; terminating the writer's backends instead");
        kills = kill_writers_until(&done, N, &run).await;
    }
    let after_restart = done.load(Ordering::Relaxed);
    let sent = run.await.expect("load run");
    let ids = wait_rows(&table, N).await;
    let after = postmaster_start()
        .await
        .expect("postgres up after the test");
    eprintln!(
        "restart={restarted} (kills={kills}): restart began after {at} answers and ended after \
         {after_restart}; postmaster {before} -> {after}; rows {}",
        ids.len()
    );
    let failures = writer.failures();
    eprintln!(
        "writer: {failures} failed batch writes, each retried; {} rows spilled and loaded back",
        writer.spilled()
    );
    assert!(failures > 0, "the outage reached the writer");
    if restarted {
        assert_ne!(before, after, "the server really restarted");
        assert!(writer.spilled() > 0, "rows arrived during the outage");
        assert!(
            after_restart < N,
            "the restart happened while the run was going on"
        );
    } else {
        assert!(kills > 0, "the writer's connections were killed");
    }
    assert_one_row_each(&ids, &sent);
    stop(sc, writer).await;
    assert!(
        !spill.exists(),
        "nothing spilled: Postgres was back before shutdown"
    );
    drop_table(&table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_usage_log_loses_no_row_when_its_connections_are_killed() {
    let _serial = SERIAL.lock().await;
    const N: usize = 400;
    let table = table("kill");
    let (_up, sc, writer, spill) = start("kill", &table, Duration::from_millis(5)).await;
    let done = Arc::new(AtomicUsize::new(0));
    let run = tokio::spawn(load(sc.chat_url(), "kill", N, 4, done.clone()));
    let kills = kill_writers_until(&done, N, &run).await;
    let sent = run.await.expect("load run");
    let ids = wait_rows(&table, N).await;
    eprintln!(
        "kill: {kills} writer connections terminated, {} failed batch writes retried, rows {}",
        writer.failures(),
        ids.len()
    );
    assert!(
        kills > 0 && writer.failures() > 0,
        "the writer lost connections"
    );
    assert_one_row_each(&ids, &sent);
    stop(sc, writer).await;
    assert!(!spill.exists());
    drop_table(&table).await;
}

/// The same batch inserted twice (a retry after a commit whose answer was lost) adds its rows
/// once: ids are made before the first try.
#[tokio::test]
async fn a_retried_batch_is_not_duplicated() {
    use tollgate::audit::postgres::{ddl, insert, insert_sql};
    use tollgate::audit::{usage_row, Entry};
    let _serial = SERIAL.lock().await;
    let table = table("idem");
    let c = client().await.expect("postgres up");
    c.batch_execute(&ddl(&table)).await.expect("ddl");
    let st = c.prepare(&insert_sql(&table)).await.expect("prepare");
    let rows: Vec<_> = (0..50)
        .map(|i| {
            let rec = tollgate::governor::Record::new(
                "v".into(),
                format!("idem-{i}").into(),
                "j".into(),
                "c".into(),
                "chat".into(),
            );
            usage_row(&Entry {
                ts: jiff::Timestamp::now().to_string(),
                endpoint: "chat.completions",
                api: "openai",
                latency_ms: 1.0,
                record: rec,
            })
        })
        .collect();
    assert_eq!(insert(&c, &st, &rows[..30]).await.expect("first"), 30);
    assert_eq!(
        insert(&c, &st, &rows).await.expect("retry"),
        20,
        "only the new rows"
    );
    let ids = request_ids(&table).await.expect("read");
    let sent: HashSet<String> = (0..50).map(|i| format!("idem-{i}")).collect();
    assert_one_row_each(&ids, &sent);
    drop_table(&table).await;
}

/// Postgres unreachable for a whole run: requests do not wait on it (rows go to the spill
/// file), shutdown does not hang, and the next start loads the spill file into the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_spilled_while_postgres_is_down_are_loaded_at_the_next_start() {
    use tollgate::audit::Entry;
    let dir = tempfile::tempdir().expect("tempdir");
    let spill = dir.path().join("spill.jsonl");
    // Port 1 on loopback: connection refused at once.
    let (audit, writer) = Audit::postgres(
        "postgres://postgres@127.0.0.1:1/test",
        "t",
        8,
        spill.clone(),
    )
    .expect("start");
    for i in 0..20 {
        let rec = tollgate::governor::Record::new(
            "v".into(),
            format!("spill-{i}").into(),
            "j".into(),
            "c".into(),
            "chat".into(),
        );
        let e = Entry {
            ts: jiff::Timestamp::now().to_string(),
            endpoint: "chat.completions",
            api: "openai",
            latency_ms: 1.0,
            record: rec,
        };
        // The queue holds 8; with the writer spilling, none of these waits for long.
        tokio::time::timeout(Duration::from_secs(5), audit.record(e))
            .await
            .expect("a record is taken while the database is down");
    }
    drop(audit);
    let t0 = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || writer.finish()),
    )
    .await
    .expect("shutdown does not hang")
    .expect("join");
    let text = std::fs::read_to_string(&spill).expect("spill file");
    let ids: Vec<String> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).expect("json line")["request_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    let sent: HashSet<String> = (0..20).map(|i| format!("spill-{i}")).collect();
    eprintln!(
        "spill: {} rows after {:?}, {} bytes per row",
        ids.len(),
        t0.elapsed(),
        text.len() / ids.len().max(1)
    );
    assert_one_row_each(&ids, &sent);

    // The next start, with Postgres reachable, loads the file and removes it.
    let _serial = SERIAL.lock().await;
    let table = table("spill");
    let (audit, writer) = Audit::postgres(URL, &table, 8, spill.clone()).expect("start");
    let ids = wait_rows(&table, 20).await;
    assert_one_row_each(&ids, &sent);
    drop(audit);
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .expect("join");
    assert!(!spill.exists(), "the spill file is removed once loaded");
    drop_table(&table).await;
}

#[test]
fn the_table_name_is_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = Audit::postgres(URL, "bad-name", 8, dir.path().join("s"));
    assert!(r.is_err());
    let r = Audit::postgres(
        "postgres://user:s3cret@127.0.0.1:99999999/x",
        "t",
        8,
        dir.path().join("s"),
    );
    let e = r.expect_err("an out-of-range port is refused").to_string();
    assert!(!e.contains("s3cret"), "error echoes the password: {e}");
}

/// A usage log created by an older build (no cache split, no dialect) gains the new columns
/// when the writer connects, and rows keep the cached / cache-write split and the dialect.
#[tokio::test]
async fn an_older_table_gains_the_cache_split_and_dialect_columns() {
    use tollgate::audit::postgres::{ddl, insert, insert_sql};
    use tollgate::audit::{usage_row, Entry};
    let _serial = SERIAL.lock().await;
    let table = table("mig");
    let c = client().await.expect("postgres up");
    // The DDL without its added columns: what an older build created.
    let old = ddl(&table);
    let old = &old[..old.find("ALTER TABLE").expect("the DDL adds columns")];
    c.batch_execute(old).await.expect("old ddl");
    c.batch_execute(&ddl(&table))
        .await
        .expect("ddl twice is fine");
    c.batch_execute(&ddl(&table))
        .await
        .expect("ddl is idempotent");
    let st = c.prepare(&insert_sql(&table)).await.expect("prepare");
    let mut rec = tollgate::governor::Record::new(
        "v".into(),
        "mig-1".into(),
        "j".into(),
        "c".into(),
        "chat".into(),
    );
    rec.actual_input_tokens = 100;
    rec.actual_cached_input_tokens = 60;
    rec.actual_cache_write_tokens = 25;
    let row = usage_row(&Entry {
        ts: jiff::Timestamp::now().to_string(),
        endpoint: "chat.completions",
        api: "anthropic",
        latency_ms: 1.0,
        record: rec,
    });
    assert_eq!(insert(&c, &st, &[row]).await.expect("insert"), 1);
    let r = c
        .query_one(
            &format!("SELECT cached_input_tokens, cache_write_tokens, api FROM {table}"),
            &[],
        )
        .await
        .expect("read");
    assert_eq!(r.get::<_, i64>(0), 60);
    assert_eq!(r.get::<_, i64>(1), 25);
    assert_eq!(r.get::<_, String>(2), "anthropic");
    drop_table(&table).await;
}

/// `tollgate usage --by team` against Postgres (issue 52): a table written before the `team`
/// column existed reads as team `-`; once the writer's DDL adds it, rows carry their team and
/// money is summed in exact micro-dollars.
#[tokio::test]
async fn usage_by_team_reads_postgres_before_and_after_the_team_column() {
    use tollgate::audit::postgres::{ddl, insert, insert_sql};
    use tollgate::audit::{usage_row, Entry};
    let _serial = SERIAL.lock().await;
    let table = table("teams");
    let c = client().await.expect("postgres up");
    let entry = |i: usize, team: Option<&str>, cost: f64| {
        let mut rec = tollgate::governor::Record::new(
            "v".into(),
            format!("t-{i}").into(),
            "j".into(),
            "carol".into(),
            "chat".into(),
        );
        rec.backend = "primary".into();
        rec.actual_input_tokens = 10;
        rec.actual_output_tokens = 2;
        rec.cost_usd = cost;
        rec.team = team.map(Into::into);
        usage_row(&Entry {
            ts: jiff::Timestamp::now().to_string(),
            endpoint: "chat.completions",
            api: "openai",
            latency_ms: 1.0,
            record: rec,
        })
    };
    // An older build's table: the DDL up to its added columns, and a row of its own.
    let full = ddl(&table);
    let old = &full[..full.find("ALTER TABLE").expect("the DDL adds columns")];
    c.batch_execute(old).await.expect("old ddl");
    c.execute(
        &format!(
            "INSERT INTO {table} (id, created_at, provider, model, input_tokens, output_tokens,
                latency_ms, success, consumer, request_id, job_id, tried, route, policy_version,
                estimated_input_tokens, requested_output_tokens, provenance, cost_usd, action,
                reason, http_status, endpoint)
             VALUES ('00000000-0000-4000-8000-000000000001', now(), 'primary', 'small-1', 10, 2,
                1, true, 'alice', 'old', 'old', 'primary', 'chat', 'v0', 10, 5, 'ACTUAL', 0.25,
                'ALLOW', 'OK', 200, 'chat.completions')"
        ),
        &[],
    )
    .await
    .expect("old row");
    let usage = |table: String| async move {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args([
                "usage",
                "--postgres",
                URL,
                "--table",
                &table,
                "--by",
                "team",
                "--json",
            ])
            .env_remove("TOLLGATE_POLICY")
            .output()
            .await
            .expect("run tollgate");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (serde_json::from_str::<Value>(&text).expect("json"), text)
    };
    let (v, _) = usage(table.clone()).await;
    assert_eq!(
        v["teams"],
        j!([{"name": "-", "requests_today": 1, "input_tokens_today": 10,
            "output_tokens_today": 2, "cost_usd_month": 0.25}])
    );

    c.batch_execute(&full).await.expect("new ddl adds team");
    let st = c.prepare(&insert_sql(&table)).await.expect("prepare");
    let rows: Vec<_> = (0..3)
        .map(|i| entry(i, Some("team-b"), 0.000032))
        .chain([entry(3, Some("team-a"), 1.5), entry(4, None, 0.0)])
        .collect();
    assert_eq!(insert(&c, &st, &rows).await.expect("insert"), 5);
    let (v, text) = usage(table.clone()).await;
    let teams: Vec<(String, i64)> = v["teams"]
        .as_array()
        .expect("teams")
        .iter()
        .map(|t| {
            (
                t["name"].as_str().expect("name").to_owned(),
                t["requests_today"].as_i64().expect("n"),
            )
        })
        .collect();
    assert_eq!(
        teams,
        [("-".into(), 2), ("team-a".into(), 1), ("team-b".into(), 3)]
    );
    assert!(
        text.contains("\"cost_usd_month\": 0.000096"),
        "an exact decimal:\n{text}"
    );
    drop_table(&table).await;
}
