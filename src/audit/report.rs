//! `tollgate usage`: today's tokens and month-to-date cost per provider and per consumer,
//! read back from the SQLite or Postgres usage log, or from the JSONL audit. "Today" and
//! "this month" are calendar periods of `windows.timezone`, the same boundaries the quotas
//! turn over at.

use super::row::format_utc;
use crate::units::Window;
use jiff::{civil::Date, tz::TimeZone, Timestamp};
use serde::Serialize;
use std::path::Path;

/// Totals for one provider or consumer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Totals {
    pub name: String,
    pub requests_today: i64,
    pub input_tokens_today: i64,
    pub output_tokens_today: i64,
    pub cost_usd_month: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub timezone: String,
    pub day: String,
    pub month_start: String,
    pub providers: Vec<Totals>,
    pub consumers: Vec<Totals>,
}

/// The start of `now`'s day and month in `tz`, as instants (the quotas' own windows), and
/// the local date.
pub fn periods(now: Timestamp, tz: &TimeZone) -> Result<(Timestamp, Timestamp, Date), String> {
    let start = |w: Window| {
        let k = crate::ledger::window_at(tz, w, now.as_millisecond());
        Timestamp::from_second(k.start).map_err(|e| e.to_string())
    };
    let day = now.to_zoned(tz.clone()).date();
    Ok((start(Window::Day)?, start(Window::Month)?, day))
}

fn report(tz_name: &str, day: Date, providers: Vec<Totals>, consumers: Vec<Totals>) -> Report {
    Report {
        timezone: tz_name.to_owned(),
        day: day.to_string(),
        month_start: day.first_of_month().to_string(),
        providers,
        consumers,
    }
}

/// Reads the SQLite usage log at `path` (read-only; a missing file is an error, not created).
pub fn from_sqlite(
    path: &Path,
    table: &str,
    tz_name: &str,
    tz: &TimeZone,
    now: Timestamp,
) -> Result<Report, String> {
    use rusqlite::{Connection, OpenFlags};
    if !super::valid_table(table) {
        return Err(format!("`{table}` is not a plain SQL name"));
    }
    let (day0, month0, day) = periods(now, tz)?;
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let _ = conn.busy_timeout(std::time::Duration::from_secs(5));
    let (d, m) = (format_utc(day0), format_utc(month0));
    let by = |col: &str| -> Result<Vec<Totals>, String> {
        let sql = format!(
            "SELECT {col},
                    SUM(CASE WHEN created_at >= ?1 THEN 1 ELSE 0 END),
                    SUM(CASE WHEN created_at >= ?1 THEN input_tokens ELSE 0 END),
                    SUM(CASE WHEN created_at >= ?1 THEN output_tokens ELSE 0 END),
                    SUM(cost_usd)
             FROM {table} WHERE created_at >= ?2 GROUP BY {col} ORDER BY {col}"
        );
        let mut st = conn
            .prepare(&sql)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let rows = st
            .query_map([&d, &m], |r| {
                Ok(Totals {
                    name: r.get(0)?,
                    requests_today: r.get(1)?,
                    input_tokens_today: r.get(2)?,
                    output_tokens_today: r.get(3)?,
                    cost_usd_month: r.get(4)?,
                })
            })
            .map_err(|e| e.to_string())?;
        rows.collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())
    };
    Ok(report(tz_name, day, by("provider")?, by("consumer")?))
}

/// Reads the JSONL audit at `path` (the default sink): every line is one decision record.
/// Lines that are not records (a torn last line after a crash) are skipped and counted in the
/// returned number.
pub fn from_jsonl(
    path: &Path,
    tz_name: &str,
    tz: &TimeZone,
    now: Timestamp,
) -> Result<(Report, usize), String> {
    use std::collections::BTreeMap;
    #[derive(serde::Deserialize)]
    struct Line {
        ts: String,
        backend: String,
        consumer_id: String,
        #[serde(default)]
        actual_input_tokens: u64,
        #[serde(default)]
        actual_output_tokens: u64,
        #[serde(default)]
        cost_usd: f64,
    }
    let (day0, month0, day) = periods(now, tz)?;
    // The current file and its rotated (maybe gzipped) siblings, oldest first.
    let mut files = super::jsonl_files(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if files.is_empty() {
        files.push(path.to_path_buf());
    }
    let mut by: [BTreeMap<String, Totals>; 2] = Default::default();
    let mut skipped = 0usize;
    for (file, line) in files.iter().flat_map(|f| read_lines(f)) {
        let line = line.map_err(|e| format!("{}: {e}", file.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<Line>(&line)
            .ok()
            .and_then(|l| Some((l.ts.parse::<Timestamp>().ok()?, l)));
        let Some((ts, l)) = parsed else {
            skipped += 1;
            continue;
        };
        if ts < month0 {
            continue;
        }
        for (map, name) in by.iter_mut().zip([&l.backend, &l.consumer_id]) {
            let t = map.entry(name.clone()).or_insert_with(|| Totals {
                name: name.clone(),
                requests_today: 0,
                input_tokens_today: 0,
                output_tokens_today: 0,
                cost_usd_month: 0.0,
            });
            t.cost_usd_month += l.cost_usd;
            if ts >= day0 {
                let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                t.requests_today = t.requests_today.saturating_add(1);
                t.input_tokens_today = t
                    .input_tokens_today
                    .saturating_add(n(l.actual_input_tokens));
                t.output_tokens_today = t
                    .output_tokens_today
                    .saturating_add(n(l.actual_output_tokens));
            }
        }
    }
    let [providers, consumers] = by.map(|m| m.into_values().collect::<Vec<_>>());
    Ok((report(tz_name, day, providers, consumers), skipped))
}

/// Reads the Postgres usage log at `url`.
pub async fn from_postgres(
    url: &str,
    table: &str,
    tz_name: &str,
    tz: &TimeZone,
    now: Timestamp,
) -> Result<Report, String> {
    if !super::valid_table(table) {
        return Err(format!("`{table}` is not a plain SQL name"));
    }
    let (day0, month0, day) = periods(now, tz)?;
    let mut cfg: tokio_postgres::Config = url
        .parse()
        .map_err(|e: tokio_postgres::Error| e.to_string())?;
    cfg.connect_timeout(std::time::Duration::from_secs(10));
    let (client, connection) = cfg
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(|e| e.to_string())?;
    let conn_task = tokio::spawn(connection);
    let (d, m) = (format_utc(day0), format_utc(month0));
    let mut out = Vec::new();
    for col in ["provider", "consumer"] {
        let sql = format!(
            "SELECT {col},
                    COUNT(*) FILTER (WHERE created_at >= $1::text::timestamptz),
                    COALESCE(SUM(input_tokens) FILTER (WHERE created_at >= $1::text::timestamptz), 0)::bigint,
                    COALESCE(SUM(output_tokens) FILTER (WHERE created_at >= $1::text::timestamptz), 0)::bigint,
                    SUM(cost_usd)
             FROM {table} WHERE created_at >= $2::text::timestamptz GROUP BY {col} ORDER BY {col}"
        );
        let rows = client
            .query(&sql, &[&d, &m])
            .await
            .map_err(|e| e.to_string())?;
        out.push(
            rows.iter()
                .map(|r| Totals {
                    name: r.get(0),
                    requests_today: r.get(1),
                    input_tokens_today: r.get(2),
                    output_tokens_today: r.get(3),
                    cost_usd_month: r.get(4),
                })
                .collect::<Vec<_>>(),
        );
    }
    drop(client);
    let _ = conn_task.await;
    let consumers = out.pop().unwrap_or_default();
    let providers = out.pop().unwrap_or_default();
    Ok(report(tz_name, day, providers, consumers))
}

/// The report as aligned text tables.
/// Every line of one audit file (`.gz` too); a file that cannot be opened is one error.
fn read_lines(f: &Path) -> Box<dyn Iterator<Item = (&Path, std::io::Result<String>)> + '_> {
    use std::io::BufRead;
    match super::open_jsonl(f) {
        Ok(r) => Box::new(r.lines().map(move |l| (f, l))),
        Err(e) => Box::new(std::iter::once((f, Err(e)))),
    }
}

pub fn render(r: &Report) -> String {
    let mut s = format!(
        "today {} and month to date from {} ({})\n",
        r.day, r.month_start, r.timezone
    );
    for (title, rows) in [("provider", &r.providers), ("consumer", &r.consumers)] {
        s.push('\n');
        let head = [
            title,
            "requests today",
            "input tokens today",
            "output tokens today",
            "cost USD month",
        ];
        let body: Vec<[String; 5]> = rows
            .iter()
            .map(|t| {
                [
                    t.name.clone(),
                    t.requests_today.to_string(),
                    t.input_tokens_today.to_string(),
                    t.output_tokens_today.to_string(),
                    format!("{:.6}", t.cost_usd_month),
                ]
            })
            .collect();
        let mut w = head.map(str::len);
        for row in &body {
            for (i, c) in row.iter().enumerate() {
                w[i] = w[i].max(c.len());
            }
        }
        let line = |cells: [&str; 5]| {
            let mut l = format!("{:<w0$}", cells[0], w0 = w[0]);
            for i in 1..5 {
                l.push_str(&format!("  {:>w$}", cells[i], w = w[i]));
            }
            l.push('\n');
            l
        };
        s.push_str(&line(head));
        if body.is_empty() {
            s.push_str("(no rows)\n");
        }
        for row in &body {
            s.push_str(&line([&row[0], &row[1], &row[2], &row[3], &row[4]]));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_follow_the_local_calendar() {
        let tz = TimeZone::get("Asia/Taipei").expect("tz");
        // 2026-12-01 01:30 in Taipei is still 2026-11-30 in UTC.
        let now: Timestamp = "2026-11-30T17:30:00Z".parse().expect("ts");
        let (d, m, day) = periods(now, &tz).expect("periods");
        assert_eq!(day.to_string(), "2026-12-01");
        assert_eq!(format_utc(d), "2026-11-30T16:00:00.000000Z");
        assert_eq!(format_utc(m), "2026-11-30T16:00:00.000000Z");
        let now: Timestamp = "2026-11-15T03:00:00Z".parse().expect("ts");
        let (d, m, _) = periods(now, &tz).expect("periods");
        assert_eq!(format_utc(d), "2026-11-14T16:00:00.000000Z");
        assert_eq!(format_utc(m), "2026-10-31T16:00:00.000000Z");
    }

    #[test]
    fn jsonl_audit_is_summed_per_provider_and_consumer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("audit.jsonl");
        let line = |ts: &str, backend: &str, consumer: &str, i: u64, o: u64, c: f64| {
            serde_json::json!({"ts": ts, "endpoint": "chat.completions", "backend": backend,
                "consumer_id": consumer, "actual_input_tokens": i, "actual_output_tokens": o,
                "cost_usd": c, "final_action": "ALLOW"})
            .to_string()
        };
        let text = [
            line("2026-11-30T10:00:00Z", "gemini", "alice", 10, 5, 0.25),
            line("2026-11-30T11:00:00Z", "static", "bob", 0, 0, 0.0),
            line("2026-11-29T23:00:00Z", "gemini", "alice", 100, 50, 0.5), // yesterday
            line("2026-10-31T23:00:00Z", "gemini", "alice", 1, 1, 9.0),    // last month
            "{\"ts\": \"2026-11-30T1".to_owned(),                          // a torn last line
        ]
        .join("\n");
        std::fs::write(&path, text).expect("write");
        let now: Timestamp = "2026-11-30T12:00:00Z".parse().expect("ts");
        let (r, skipped) = from_jsonl(&path, "UTC", &TimeZone::UTC, now).expect("report");
        assert_eq!(skipped, 1);
        let g = &r.providers[0];
        assert_eq!(
            (
                g.name.as_str(),
                g.requests_today,
                g.input_tokens_today,
                g.output_tokens_today
            ),
            ("gemini", 1, 10, 5)
        );
        assert!((g.cost_usd_month - 0.75).abs() < 1e-9, "{g:?}");
        assert_eq!(r.providers[1].name, "static");
        let names: Vec<&str> = r.consumers.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["alice", "bob"]);
        assert_eq!(r.day, "2026-11-30");
    }

    #[test]
    fn render_aligns_columns() {
        let t = |n: &str, r, i, o, c| Totals {
            name: n.into(),
            requests_today: r,
            input_tokens_today: i,
            output_tokens_today: o,
            cost_usd_month: c,
        };
        let r = Report {
            timezone: "UTC".into(),
            day: "2026-11-30".into(),
            month_start: "2026-11-01".into(),
            providers: vec![t("gemini", 3, 120, 45, 0.5), t("static", 10, 0, 0, 0.0)],
            consumers: vec![],
        };
        let text = render(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[2].len(), lines[3].len(), "{text}");
        assert_eq!(lines[3].len(), lines[4].len(), "{text}");
        assert!(lines[3].starts_with("gemini "), "{text}");
        assert!(lines[3].ends_with("0.500000"), "{text}");
        assert!(text.contains("(no rows)"), "{text}");
    }
}
