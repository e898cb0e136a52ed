//! The SQLite usage log through a real sidecar (issue 6 items 2-3): every request leaves one
//! row with the right columns, and `tollgate usage` sums them per provider and consumer.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::mock::{Answer, MockUpstream};
use common::post_json;
use common::sidecar::Sidecar;
use serde_json::{json as j, Value};
use tollgate::audit::Audit;

const ALICE: usize = 12;
const BOB: usize = 8;
const UNKNOWN_MODEL: usize = 3;
/// What the mock reports for every call.
const PROMPT: i64 = 7;
const COMPLETION: i64 = 5;

fn policy(upstream: &str, db: &Path) -> String {
    format!(
        r#"
version: usage-1
windows: {{timezone: Asia/Taipei}}
backends:
  - {{id: primary, kind: openai, base_url: {upstream}, price_per_1k: {{input: 1.0, output: 2.0}}}}
routes:
  - model: chat
    chain: [{{backend: primary, model: small-1}}]
state: {{backend: memory, path: {db}}}
audit: {{sink: sqlite, table: usage_test}}
"#,
        db = db.display()
    )
}

fn count_rows(db: &Path) -> i64 {
    let Ok(c) =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return 0;
    };
    c.query_row("SELECT COUNT(*) FROM usage_test", [], |r| r.get(0))
        .unwrap_or(0)
}

fn tollgate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .env_remove("TOLLGATE_POLICY")
        .output()
        .expect("run tollgate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn totals<'a>(v: &'a Value, list: &str, name: &str) -> &'a Value {
    v[list]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["name"] == name))
        .unwrap_or_else(|| panic!("no {list} entry {name}: {v:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_usage_log_round_trip_and_usage_command() {
    let up = MockUpstream::start_with_default(
        vec![],
        Answer::ok_chat("ok", PROMPT as u64, COMPLETION as u64),
    )
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("tollgate.db");
    let yaml = policy(&up.base_url(), &db);
    let policy_file = dir.path().join("policy.yaml");
    std::fs::write(&policy_file, &yaml).expect("write policy");
    let spill = dir.path().join("audit.jsonl");
    let (audit, writer) = Audit::sqlite(&db, "usage_test", 64, spill.clone()).expect("sqlite");
    let sc = Sidecar::start_with_audit(&yaml, audit, dir).await;

    let body =
        j!({"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50});
    for i in 0..ALICE + BOB {
        let who = if i < ALICE { "alice" } else { "bob" };
        let rid = format!("u-{i}");
        let (status, _, _) = post_json(
            &sc.chat_url(),
            &body,
            &[("x-tollgate-consumer", who), ("x-request-id", &rid)],
        )
        .await;
        assert_eq!(status, 200);
    }
    let bad = j!({"model": "no-such-route", "messages": [{"role": "user", "content": "x"}]});
    for _ in 0..UNKNOWN_MODEL {
        let (status, _, _) =
            post_json(&sc.chat_url(), &bad, &[("x-tollgate-consumer", "bob")]).await;
        assert!(
            status >= 400,
            "unknown route answers an error, got {status}"
        );
    }

    let want = (ALICE + BOB + UNKNOWN_MODEL) as i64;
    let deadline = Instant::now() + Duration::from_secs(10);
    while count_rows(&db) < want {
        assert!(
            Instant::now() < deadline,
            "rows: {} of {want}",
            count_rows(&db)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(count_rows(&db), want, "one row per request");

    // One served row, column by column.
    let c = rusqlite::Connection::open(&db).expect("open");
    let col = |name: &str| -> Value {
        c.query_row(
            &format!("SELECT {name} FROM usage_test WHERE request_id = 'u-3'"),
            [],
            |r| {
                Ok(match r.get_ref(0)? {
                    rusqlite::types::ValueRef::Null => Value::Null,
                    rusqlite::types::ValueRef::Integer(i) => j!(i),
                    rusqlite::types::ValueRef::Real(f) => j!(f),
                    rusqlite::types::ValueRef::Text(t) => j!(String::from_utf8_lossy(t)),
                    rusqlite::types::ValueRef::Blob(_) => Value::Null,
                })
            },
        )
        .unwrap_or_else(|e| panic!("{name} of u-3: {e}"))
    };
    for (name, want) in [
        ("provider", j!("primary")),
        ("model", j!("small-1")),
        ("input_tokens", j!(PROMPT)),
        ("output_tokens", j!(COMPLETION)),
        ("success", j!(1)),
        ("consumer", j!("alice")),
        ("job_id", j!("u-3")),
        ("tried", j!("primary")),
        ("provenance", j!("ACTUAL")),
        ("policy_version", j!("usage-1")),
        ("action", j!("ALLOW")),
        ("reason", j!("OK")),
        ("http_status", j!(200)),
        ("endpoint", j!("chat.completions")),
        ("error_message", Value::Null),
    ] {
        assert_eq!(col(name), want, "column {name}");
    }
    let cost = col("cost_usd").as_f64().expect("cost");
    assert!((cost - 0.017).abs() < 1e-9, "cost {cost}");
    // A refused one: not a success, no provider, an error message, no tokens.
    let (provider, success, err, tokens): (String, bool, Option<String>, i64) = c
        .query_row(
            "SELECT provider, success, error_message, input_tokens + output_tokens \
             FROM usage_test WHERE http_status >= 400 LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .expect("refused row");
    assert_eq!((&*provider, success, tokens), ("none", false, 0));
    assert!(err.is_some_and(|e| !e.is_empty()));
    let prompts: i64 = c
        .query_row(
            "SELECT COUNT(*) FROM usage_test WHERE error_message LIKE '%hello%'",
            [],
            |r| r.get(0),
        )
        .expect("query");
    assert_eq!(prompts, 0, "no prompt text in the log");

    // `tollgate usage --json`, the log located through the policy's state.path.
    let pf = policy_file.to_str().expect("utf8 path");
    let (code, out, errs) = tollgate(&["usage", "--policy", pf, "--json"]);
    assert_eq!(code, 0, "stderr: {errs}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["timezone"], "Asia/Taipei");
    let p = totals(&v, "providers", "primary");
    let served = (ALICE + BOB) as i64;
    assert_eq!(p["requests_today"], served);
    assert_eq!(p["input_tokens_today"], served * PROMPT);
    assert_eq!(p["output_tokens_today"], served * COMPLETION);
    assert!((p["cost_usd_month"].as_f64().unwrap() - 0.017 * served as f64).abs() < 1e-9);
    let none = totals(&v, "providers", "none");
    assert_eq!(none["requests_today"], UNKNOWN_MODEL as i64);
    assert_eq!(none["input_tokens_today"], 0);
    let a = totals(&v, "consumers", "alice");
    assert_eq!(a["requests_today"], ALICE as i64);
    assert_eq!(a["input_tokens_today"], ALICE as i64 * PROMPT);
    assert!((a["cost_usd_month"].as_f64().unwrap() - 0.017 * ALICE as f64).abs() < 1e-9);
    let b = totals(&v, "consumers", "bob");
    assert_eq!(b["requests_today"], (BOB + UNKNOWN_MODEL) as i64);
    assert_eq!(b["output_tokens_today"], BOB as i64 * COMPLETION);

    // The table form, and --db naming the file directly.
    let dbs = db.to_str().expect("utf8 path");
    let (code, out, errs) = tollgate(&["usage", "--policy", pf, "--db", dbs]);
    assert_eq!(code, 0, "stderr: {errs}");
    let line = out
        .lines()
        .find(|l| l.starts_with("primary "))
        .unwrap_or_else(|| panic!("no provider line:\n{out}"));
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cells, ["primary", "20", "140", "100", "$0.34"], "{out}");

    // Failures: a missing file is 1 (and is not created); conflicting flags are 2.
    let missing = dbs.replace("tollgate.db", "missing.db");
    let (code, _, errs) = tollgate(&["usage", "--policy", pf, "--db", &missing]);
    assert_eq!(code, 1, "{errs}");
    assert!(!Path::new(&missing).exists());
    let (code, _, _) = tollgate(&[
        "usage",
        "--policy",
        pf,
        "--db",
        dbs,
        "--postgres",
        "postgres://x/y",
    ]);
    assert_eq!(code, 2);
    let (code, _, _) = tollgate(&["usage", "--policy", pf, "--table", "x;drop"]);
    assert_eq!(code, 2);

    sc.stop().await;
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .expect("writer joins");
    assert!(
        !spill.exists(),
        "nothing spilled when the database is healthy"
    );
}

fn spilled_row(i: usize) -> tollgate::audit::UsageRow {
    tollgate::audit::UsageRow {
        id: format!("spilled-{i}"),
        created_at: format!("2026-11-29T23:{:02}:{:02}.000000Z", i / 60 % 60, i % 60),
        provider: "primary".into(),
        model: Some("small-1".into()),
        input_tokens: PROMPT,
        output_tokens: COMPLETION,
        latency_ms: 3,
        success: true,
        error_message: None,
        consumer: "carol".into(),
        request_id: format!("spilled-{i}"),
        job_id: format!("spilled-{i}"),
        tried: "primary".into(),
        route: "chat".into(),
        policy_version: "usage-1".into(),
        estimated_input_tokens: PROMPT,
        requested_output_tokens: 50,
        provenance: "ACTUAL".into(),
        cost_usd: 0.017,
        action: "ALLOW".into(),
        reason: "OK".into(),
        http_status: 200,
        endpoint: "chat".into(),
        cached_input_tokens: 0,
        cache_write_tokens: 0,
        api: "openai".into(),
        team: String::new(),
    }
}

/// Rows an earlier run spilled at shutdown (the database refused them) are loaded into the
/// table when the next writer starts — more than one batch, in order, with unreadable lines
/// (a torn write) kept aside in `<spill>.bad` — and loading the same rows twice adds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_loads_the_spill_of_an_earlier_run_at_start() {
    const ROWS: usize = 1500;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("tollgate.db");
    let spill = dir.path().join("audit.jsonl.spill");
    let bad = dir.path().join("audit.jsonl.spill.bad");
    let mut text = String::new();
    for i in 0..ROWS {
        text.push_str(&serde_json::to_string(&spilled_row(i)).unwrap());
        text.push('\n');
        if i == 700 {
            text.push_str("{\"id\":\"garbled\n\n");
        }
    }
    let torn = serde_json::to_string(&spilled_row(ROWS)).unwrap();
    text.push_str(&torn[..torn.len() / 2]);
    std::fs::write(&spill, &text).unwrap();
    let again = text.clone();

    let (audit, writer) = Audit::sqlite(&db, "usage_test", 64, spill.clone()).expect("sqlite");
    let deadline = Instant::now() + Duration::from_secs(20);
    while spill.exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!spill.exists(), "the spill file was not loaded");
    assert_eq!(count_rows(&db), ROWS as i64);
    let kept = std::fs::read_to_string(&bad).expect("unreadable lines kept");
    assert_eq!(
        kept,
        format!("{{\"id\":\"garbled\n{}\n", &torn[..torn.len() / 2])
    );
    let c = rusqlite::Connection::open(&db).unwrap();
    let (first, last, consumer): (String, String, String) = c
        .query_row(
            "SELECT MIN(id), MAX(created_at), MIN(consumer) FROM usage_test",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(first, "spilled-0");
    assert_eq!(last, spilled_row(ROWS - 1).created_at);
    assert_eq!(consumer, "carol");
    drop(audit);
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .expect("writer joins");

    // The same spill again (say the removal was lost in a crash): no row twice.
    std::fs::write(&spill, again).unwrap();
    let (audit, writer) = Audit::sqlite(&db, "usage_test", 64, spill.clone()).expect("sqlite");
    drop(audit);
    tokio::task::spawn_blocking(move || writer.finish())
        .await
        .expect("writer joins");
    assert!(!spill.exists());
    assert_eq!(count_rows(&db), ROWS as i64);
}

/// A row of now for `team` (empty: none) costing `cost` dollars.
fn team_row(i: usize, team: &str, consumer: &str, cost: f64) -> tollgate::audit::UsageRow {
    let mut r = spilled_row(i);
    r.id = format!("team-{i}");
    r.created_at = tollgate::audit::row::format_utc(jiff::Timestamp::now());
    r.team = team.into();
    r.consumer = consumer.into();
    r.cost_usd = cost;
    r
}

/// `usage --by team` (issue 52): a log written before the `team` column existed is read as it
/// is (team `-`, the file untouched); the writer's next start adds the column and keeps the
/// old rows; teams are summed in exact micro-dollars (three $0.000032 calls are $0.000096,
/// not `9.599999999999998e-05`).
#[test]
fn usage_by_team_reads_an_old_sqlite_log_and_the_migrated_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("old.db");
    let dbs = db.to_str().expect("utf8 path");
    // The DDL of a build before the team column.
    let c = rusqlite::Connection::open(&db).expect("open");
    c.execute_batch(
        "CREATE TABLE old_log (id TEXT PRIMARY KEY, created_at TEXT NOT NULL,
            provider TEXT NOT NULL, model TEXT, input_tokens INTEGER NOT NULL,
            output_tokens INTEGER NOT NULL, latency_ms INTEGER NOT NULL, success INTEGER NOT NULL,
            error_message TEXT, consumer TEXT NOT NULL, request_id TEXT NOT NULL,
            job_id TEXT NOT NULL, tried TEXT NOT NULL, route TEXT NOT NULL,
            policy_version TEXT NOT NULL, estimated_input_tokens INTEGER NOT NULL,
            requested_output_tokens INTEGER NOT NULL, provenance TEXT NOT NULL,
            cost_usd REAL NOT NULL, action TEXT NOT NULL, reason TEXT NOT NULL,
            http_status INTEGER NOT NULL, endpoint TEXT NOT NULL,
            cached_input_tokens INTEGER NOT NULL DEFAULT 0,
            cache_write_tokens INTEGER NOT NULL DEFAULT 0, api TEXT NOT NULL DEFAULT '')",
    )
    .expect("old ddl");
    let now = tollgate::audit::row::format_utc(jiff::Timestamp::now());
    c.execute(
        "INSERT INTO old_log (id, created_at, provider, model, input_tokens, output_tokens,
            latency_ms, success, consumer, request_id, job_id, tried, route, policy_version,
            estimated_input_tokens, requested_output_tokens, provenance, cost_usd, action,
            reason, http_status, endpoint)
         VALUES ('old-1', ?1, 'primary', 'small-1', 7, 5, 3, 1, 'alice', 'old-1', 'old-1',
            'primary', 'chat', 'v0', 7, 50, 'ACTUAL', 0.25, 'ALLOW', 'OK', 200, 'chat')",
        [&now],
    )
    .expect("old row");
    drop(c);
    let usage = |by: &str| -> Value {
        let (code, out, errs) = tollgate(&[
            "usage", "--db", dbs, "--table", "old_log", "--by", by, "--json",
        ]);
        assert_eq!(code, 0, "stderr: {errs}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
    };
    let v = usage("team");
    assert_eq!(v["by"], j!(["team"]));
    assert_eq!(
        v["teams"],
        j!([{"name": "-", "requests_today": 1, "input_tokens_today": 7,
        "output_tokens_today": 5, "cost_usd_month": 0.25}])
    );
    assert!(v.get("providers").is_none(), "{v:#}");
    let cols = |db: &Path| -> Vec<String> {
        let c = rusqlite::Connection::open(db).expect("open");
        let mut st = c.prepare("PRAGMA table_info(old_log)").expect("pragma");
        let v = st
            .query_map([], |r| r.get::<_, String>(1))
            .expect("cols")
            .map(|c| c.expect("col"))
            .collect();
        v
    };
    assert!(
        !cols(&db).contains(&"team".to_owned()),
        "reading migrates nothing"
    );

    // The writer's start adds the column; new rows carry their team.
    let mut conn = tollgate::audit::sqlite::open(&db, "old_log").expect("migrate");
    assert!(cols(&db).contains(&"team".to_owned()));
    let rows = [
        team_row(1, "team-b", "carol", 0.000032),
        team_row(2, "team-b", "carol", 0.000032),
        team_row(3, "team-b", "dave", 0.000032),
        team_row(4, "team-a", "bob", 1.5),
    ];
    tollgate::audit::sqlite::insert(&mut conn, "old_log", &rows).expect("insert");
    drop(conn);
    let v = usage("team");
    let names: Vec<&str> = v["teams"]
        .as_array()
        .expect("teams")
        .iter()
        .map(|t| t["name"].as_str().expect("name"))
        .collect();
    assert_eq!(names, ["-", "team-a", "team-b"]);
    let b = totals(&v, "teams", "team-b");
    assert_eq!(b["requests_today"], 3);
    assert_eq!(b["input_tokens_today"], 3 * PROMPT);
    let (_, out, _) = tollgate(&[
        "usage", "--db", dbs, "--table", "old_log", "--by", "team", "--json",
    ]);
    assert!(
        out.contains("\"cost_usd_month\": 0.000096"),
        "an exact decimal:\n{out}"
    );
    assert_eq!(totals(&v, "teams", "team-a")["cost_usd_month"], 1.5);
    let m = usage("model");
    assert_eq!(totals(&m, "models", "small-1")["requests_today"], 5);
    let c = usage("consumer");
    assert_eq!(totals(&c, "consumers", "carol")["requests_today"], 2);
    let p = usage("backend");
    assert_eq!(totals(&p, "providers", "primary")["requests_today"], 5);

    // The table: one line per team, dollars for people.
    let (code, out, errs) = tollgate(&["usage", "--db", dbs, "--table", "old_log", "--by", "team"]);
    assert_eq!(code, 0, "{errs}");
    let line = out
        .lines()
        .find(|l| l.starts_with("team-b "))
        .unwrap_or_else(|| panic!("no team-b line:\n{out}"));
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cells, ["team-b", "3", "21", "15", "$0.000096"], "{out}");
    assert!(out.contains("\nteam "), "the column is titled team:\n{out}");
    // A grouping that does not exist is a usage error.
    let (code, _, errs) = tollgate(&["usage", "--db", dbs, "--table", "old_log", "--by", "teams"]);
    assert_eq!(code, 2, "{errs}");
}
