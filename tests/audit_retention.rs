//! Audit retention: the JSONL audit rotated by size under concurrent writers loses and splits
//! no record, compressed rotated files read back, `tollgate usage` sums across rotations, and
//! the usage log's old rows are deleted by the retention (SQLite and Postgres).

use std::collections::HashSet;
use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::audit::{jsonl_files, open_jsonl, Audit, Entry, Rotation};
use tollgate::governor::Record;

fn entry(ts: &str, request_id: &str, consumer: &str) -> Entry {
    let mut rec = Record::new(
        "v1".into(),
        request_id.into(),
        request_id.into(),
        consumer.into(),
        "chat".into(),
    );
    rec.backend = Arc::from("primary");
    rec.actual_input_tokens = 3;
    rec.actual_output_tokens = 2;
    Entry {
        ts: ts.to_owned(),
        endpoint: "chat.completions",
        api: "openai",
        latency_ms: 1.0,
        record: rec,
    }
}

fn now() -> String {
    jiff::Timestamp::now().to_string()
}

/// Every line of every file of the audit at `path`, parsed.
fn read_back(path: &Path) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for f in jsonl_files(path).expect("list") {
        for line in open_jsonl(&f).expect("open").lines() {
            let line = line.expect("read");
            let v = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("{}: a torn record {line:?}: {e}", f.display()));
            out.push(v);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rotation_under_concurrent_writers_keeps_every_record_whole_and_once() {
    const TASKS: usize = 8;
    const EACH: usize = 400;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("audit.jsonl");
    let rotation = Rotation {
        max_bytes: 16 * 1024,
        keep: 1000,
        compress: true,
    };
    // A small queue, so writers also wait for room while files are rotated.
    let (audit, writer) = Audit::jsonl_with(path.clone(), 16, rotation).expect("start");
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let audit = audit.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..EACH {
                audit
                    .record(entry(&now(), &format!("t{t}-{i}"), "alice"))
                    .await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    drop(audit);
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .expect("finish");

    let files = jsonl_files(&path).expect("list");
    assert!(files.len() > 10, "expected many rotations, got {files:?}");
    let gz = files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "gz"))
        .count();
    assert_eq!(
        gz,
        files.len() - 1,
        "every rotated file is gzipped: {files:?}"
    );
    for f in &files[..files.len() - 1] {
        let plain: u64 = open_jsonl(f)
            .unwrap()
            .lines()
            .map(|l| l.unwrap().len() as u64 + 1)
            .sum();
        assert!(
            plain <= rotation.max_bytes,
            "{} holds {plain} bytes",
            f.display()
        );
    }
    let records = read_back(&path);
    let ids: Vec<String> = records
        .iter()
        .map(|r| r["request_id"].as_str().expect("request_id").to_owned())
        .collect();
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!(ids.len(), TASKS * EACH, "records written");
    assert_eq!(unique.len(), TASKS * EACH, "each record once");
}

#[tokio::test]
async fn only_the_newest_rotated_files_are_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("audit.jsonl");
    let rotation = Rotation {
        max_bytes: 1,
        keep: 3,
        compress: false,
    };
    let (audit, writer) = Audit::jsonl_with(path.clone(), 1, rotation).expect("start");
    for i in 0..20 {
        audit.record(entry(&now(), &format!("r{i}"), "bob")).await;
    }
    drop(audit);
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .unwrap();
    let files = jsonl_files(&path).unwrap();
    assert_eq!(
        files.len(),
        4,
        "three rotated and the current one: {files:?}"
    );
    let ids: Vec<String> = read_back(&path)
        .iter()
        .map(|r| r["request_id"].as_str().unwrap().to_owned())
        .collect();
    // One record a file (each is larger than max_bytes): the last four, in order.
    assert_eq!(ids, ["r16", "r17", "r18", "r19"]);
}

#[tokio::test]
async fn usage_reads_the_rotated_and_compressed_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("audit.jsonl");
    let rotation = Rotation {
        max_bytes: 4096,
        keep: 100,
        compress: true,
    };
    let (audit, writer) = Audit::jsonl_with(path.clone(), 64, rotation).expect("start");
    for i in 0..30 {
        audit.record(entry(&now(), &format!("u{i}"), "carol")).await;
    }
    drop(audit);
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .unwrap();
    assert!(jsonl_files(&path).unwrap().len() > 2, "rotated");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["usage", "--json", "--jsonl"])
        .arg(&path)
        .env_remove("TOLLGATE_POLICY")
        .output()
        .expect("run usage");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    let carol = v["consumers"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["name"] == "carol"))
        .unwrap_or_else(|| panic!("no carol in {v:#}"));
    assert_eq!(carol["requests_today"], 30, "{v:#}");
    assert_eq!(carol["input_tokens_today"], 90, "{v:#}");
}

#[test]
fn retention_and_rotation_keys_are_checked() {
    let base = "version: r\n";
    let bad = [
        (
            "audit: {sink: jsonl, retention_days: 30}",
            "audit.retention_days",
        ),
        (
            "audit: {sink: sqlite, retention_days: 0}",
            "audit.retention_days",
        ),
        (
            "audit: {sink: sqlite, retention_days: 40000}",
            "audit.retention_days",
        ),
        ("audit: {sink: sqlite, path: '-'}", "audit.path"),
        ("audit: {keep: 5000}", "audit.keep"),
        ("audit: {max_bytes: -1}", "audit.max_bytes"),
    ];
    for (yaml, key) in bad {
        let err = tollgate::policy::from_str(&format!("{base}{yaml}\n"), "p.yaml")
            .expect_err(yaml)
            .to_string();
        assert!(err.contains(key), "{yaml}: {err}");
    }
    let p = tollgate::policy::from_str(
        &format!("{base}audit: {{path: '-', max_bytes: 0, keep: 0, compress: true}}\n"),
        "p.yaml",
    )
    .expect("valid");
    assert_eq!(
        (
            p.audit.path.as_str(),
            p.audit.max_bytes,
            p.audit.keep,
            p.audit.compress
        ),
        ("-", 0, 0, true)
    );
    let p = tollgate::policy::from_str(base, "p.yaml").expect("defaults");
    assert_eq!(
        (
            p.audit.max_bytes,
            p.audit.keep,
            p.audit.compress,
            p.audit.retention_days
        ),
        (100 * 1024 * 1024, 5, false, None)
    );
}

#[tokio::test]
async fn sqlite_retention_deletes_only_rows_past_the_period() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("usage.db");
    let (audit, writer) =
        Audit::sqlite(&db, "ret_test", 64, dir.path().join("spill")).expect("start");
    let old = jiff::Timestamp::now() - jiff::SignedDuration::from_hours(24 * 40);
    for i in 0..25 {
        audit
            .record(entry(&old.to_string(), &format!("old{i}"), "a"))
            .await;
        audit.record(entry(&now(), &format!("new{i}"), "a")).await;
    }
    drop(audit);
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .unwrap();
    let conn = rusqlite::Connection::open(&db).unwrap();
    let count = |c: &rusqlite::Connection| -> i64 {
        c.query_row("SELECT COUNT(*) FROM ret_test", [], |r| r.get(0))
            .unwrap()
    };
    assert_eq!(count(&conn), 50);
    let now = jiff::Timestamp::now();
    assert_eq!(
        tollgate::audit::prune_sqlite(&conn, "ret_test", 60, now).unwrap(),
        0
    );
    assert_eq!(
        tollgate::audit::prune_sqlite(&conn, "ret_test", 30, now).unwrap(),
        25
    );
    assert_eq!(count(&conn), 25);
    let left: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM ret_test WHERE request_id LIKE 'new%'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(left, 25, "the recent rows stay");
}

#[tokio::test]
async fn sqlite_retention_thread_prunes_at_start_and_stops_on_finish() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("usage.db");
    let (audit, writer) =
        Audit::sqlite(&db, "ret_thread", 64, dir.path().join("spill")).expect("start");
    let old = jiff::Timestamp::now() - jiff::SignedDuration::from_hours(24 * 10);
    audit.record(entry(&old.to_string(), "old", "a")).await;
    audit.record(entry(&now(), "new", "a")).await;
    drop(audit);
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .unwrap();
    // A second run with a retention: its first pass runs at once.
    let (audit, writer) =
        Audit::sqlite(&db, "ret_thread", 64, dir.path().join("spill")).expect("restart");
    let retention =
        tollgate::audit::Retention::sqlite(db.clone(), "ret_thread".into(), 7).expect("retention");
    let writer = writer.with_retention(retention);
    let conn = rusqlite::Connection::open(&db).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 = conn
            .query_row("SELECT COUNT(*) FROM ret_thread", [], |r| r.get(0))
            .unwrap();
        if n == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "old row not pruned: {n} rows");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(audit);
    let finished = tokio::task::spawn_blocking(move || writer.finish());
    tokio::time::timeout(Duration::from_secs(10), finished)
        .await
        .expect("finish does not wait out the hourly pause")
        .unwrap();
}

#[tokio::test]
async fn postgres_retention_deletes_only_rows_past_the_period() {
    const URL: &str = "postgres://postgres@127.0.0.1:5432/test";
    let table = format!(
        "ret_pg_{}_{:08x}",
        std::process::id(),
        rand::random::<u32>()
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let client = loop {
        match tokio_postgres::connect(URL, tokio_postgres::NoTls).await {
            Ok((c, conn)) => {
                tokio::spawn(conn);
                break c;
            }
            Err(e) if Instant::now() > deadline => panic!("postgres at {URL}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    client
        .batch_execute(&tollgate::audit::postgres::ddl(&table))
        .await
        .expect("ddl");
    let insert = format!(
        "INSERT INTO {table} (id, created_at, provider, input_tokens, output_tokens, latency_ms, \
         success, consumer, request_id, job_id, tried, route, policy_version, \
         estimated_input_tokens, requested_output_tokens, provenance, cost_usd, action, reason, \
         http_status, endpoint) \
         VALUES (gen_random_uuid(), now() - make_interval(days => $1), 'p', 0, 0, 0, true, 'c', \
         $2, 'j', '', 'r', 'v', 0, 0, 'NONE', 0, 'ALLOW', 'OK', 200, 'chat')"
    );
    for (days, id) in [(40, "old1"), (31, "old2"), (29, "new1"), (0, "new2")] {
        client
            .execute(&insert, &[&days, &id])
            .await
            .expect("insert");
    }
    let n = tollgate::audit::prune_postgres(&client, &table, 30)
        .await
        .expect("prune");
    let left: Vec<String> = client
        .query(
            &format!("SELECT request_id FROM {table} ORDER BY request_id"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    client
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .ok();
    assert_eq!(n, 2);
    assert_eq!(left, ["new1", "new2"]);
}
