//! `tollgate usage`: today's tokens and month-to-date cost per group — provider (backend)
//! and consumer by default, or team, consumer, backend or model (`--by`) — read back from the
//! SQLite or Postgres usage log, or from the JSONL audit. "Today" and "this month" are
//! calendar periods of `windows.timezone`, the same boundaries the quotas turn over at.
//!
//! Money is summed in whole micro-dollars (each row's cost rounded once), never as floats, so
//! a month of small calls does not print as `9.599999999999998e-05`: JSON carries it as an
//! exact decimal number, the table in dollars for people.

use super::row::format_utc;
use crate::units::{usd_to_micros, Micros, Window};
use jiff::{civil::Date, tz::TimeZone, Timestamp};
use serde::ser::{Error as _, SerializeMap};
use serde::{Serialize, Serializer};
use std::path::Path;

/// What the rows are grouped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    Team,
    Consumer,
    /// The backend id that served (`provider` in the log and the metrics).
    Backend,
    /// The upstream model.
    Model,
}

impl By {
    /// What `usage` shows without `--by` (its output before `--by` existed).
    pub const DEFAULT: [By; 2] = [By::Backend, By::Consumer];

    /// The name `--by` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            By::Team => "team",
            By::Consumer => "consumer",
            By::Backend => "backend",
            By::Model => "model",
        }
    }

    /// The report's key for this grouping (`providers` and `consumers` as before `--by`).
    fn key(self) -> &'static str {
        match self {
            By::Team => "teams",
            By::Consumer => "consumers",
            By::Backend => "providers",
            By::Model => "models",
        }
    }

    /// The table's first column title.
    fn title(self) -> &'static str {
        match self {
            By::Team => "team",
            By::Consumer => "consumer",
            By::Backend => "provider",
            By::Model => "model",
        }
    }

    /// The SQL expression of the group's name; a missing team or model reads `-`.
    fn sql(self, has_team: bool) -> &'static str {
        match self {
            By::Team if has_team => "COALESCE(NULLIF(team, ''), '-')",
            By::Team => "'-'",
            By::Consumer => "consumer",
            By::Backend => "provider",
            By::Model => "COALESCE(NULLIF(model, ''), '-')",
        }
    }
}

impl std::str::FromStr for By {
    type Err = String;
    fn from_str(s: &str) -> Result<By, String> {
        match s {
            "team" => Ok(By::Team),
            "consumer" => Ok(By::Consumer),
            "backend" | "provider" => Ok(By::Backend),
            "model" => Ok(By::Model),
            _ => Err(format!("`{s}`: expected team, consumer, backend or model")),
        }
    }
}

/// Totals for one group.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Totals {
    pub name: String,
    pub requests_today: i64,
    pub input_tokens_today: i64,
    pub output_tokens_today: i64,
    /// Micro-dollars; serialised as dollars, an exact decimal.
    #[serde(serialize_with = "usd_number")]
    pub cost_usd_month: Micros,
}

impl Totals {
    fn new(name: String) -> Totals {
        Totals {
            name,
            requests_today: 0,
            input_tokens_today: 0,
            output_tokens_today: 0,
            cost_usd_month: 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub timezone: String,
    pub day: String,
    pub month_start: String,
    /// One list per grouping asked for, in the order asked.
    pub groups: Vec<(By, Vec<Totals>)>,
}

impl Report {
    /// The rows of one grouping (empty when it was not asked for).
    pub fn of(&self, by: By) -> &[Totals] {
        self.groups
            .iter()
            .find(|(b, _)| *b == by)
            .map_or(&[], |(_, t)| t.as_slice())
    }
}

impl Serialize for Report {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(4 + self.groups.len()))?;
        m.serialize_entry("timezone", &self.timezone)?;
        m.serialize_entry("day", &self.day)?;
        m.serialize_entry("month_start", &self.month_start)?;
        let by: Vec<&str> = self.groups.iter().map(|(b, _)| b.as_str()).collect();
        m.serialize_entry("by", &by)?;
        for (b, rows) in &self.groups {
            m.serialize_entry(b.key(), rows)?;
        }
        m.end()
    }
}

/// Micro-dollars as dollars in exact decimal: `96` is `0.000096`, `340000` is `0.34`.
pub fn usd_decimal(m: Micros) -> String {
    let (whole, frac) = (m / 1_000_000, m % 1_000_000);
    if frac == 0 {
        return whole.to_string();
    }
    let mut f = format!("{frac:06}");
    while f.ends_with('0') {
        f.pop();
    }
    format!("{whole}.{f}")
}

/// Serialises micro-dollars as a JSON number written in plain decimal (no float rounding,
/// no exponent).
fn usd_number<S: Serializer>(m: &Micros, s: S) -> Result<S::Ok, S::Error> {
    serde_json::value::RawValue::from_string(usd_decimal(*m))
        .map_err(S::Error::custom)?
        .serialize(s)
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

fn report(tz_name: &str, day: Date, groups: Vec<(By, Vec<Totals>)>) -> Report {
    Report {
        timezone: tz_name.to_owned(),
        day: day.to_string(),
        month_start: day.first_of_month().to_string(),
        groups,
    }
}

/// Each row's cost rounded to whole micro-dollars, then summed as integers (SQL).
const MICROS_SQL: &str = "CAST(ROUND(cost_usd * 1000000) AS BIGINT)";

/// Reads the SQLite usage log at `path` (read-only; a missing file is an error, not created).
/// A log written before the `team` column existed reads as team `-`.
pub fn from_sqlite(
    path: &Path,
    table: &str,
    by: &[By],
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
    let err = |e: rusqlite::Error| format!("{}: {e}", path.display());
    let has_team = {
        let mut st = conn
            .prepare(&format!("PRAGMA table_info({table})"))
            .map_err(err)?;
        let cols: Vec<String> = st
            .query_map([], |r| r.get::<_, String>(1))
            .map_err(err)?
            .filter_map(Result::ok)
            .collect();
        cols.iter().any(|c| c == "team")
    };
    let (d, m) = (format_utc(day0), format_utc(month0));
    let group = |b: By| -> Result<Vec<Totals>, String> {
        let col = b.sql(has_team);
        let sql = format!(
            "SELECT {col} AS g,
                    SUM(CASE WHEN created_at >= ?1 THEN 1 ELSE 0 END),
                    SUM(CASE WHEN created_at >= ?1 THEN input_tokens ELSE 0 END),
                    SUM(CASE WHEN created_at >= ?1 THEN output_tokens ELSE 0 END),
                    SUM(MAX(0, {MICROS_SQL}))
             FROM {table} WHERE created_at >= ?2 GROUP BY g ORDER BY g"
        );
        let mut st = conn.prepare(&sql).map_err(err)?;
        let rows = st
            .query_map([&d, &m], |r| {
                Ok(Totals {
                    name: r.get(0)?,
                    requests_today: r.get(1)?,
                    input_tokens_today: r.get(2)?,
                    output_tokens_today: r.get(3)?,
                    cost_usd_month: u64::try_from(r.get::<_, i64>(4)?).unwrap_or(0),
                })
            })
            .map_err(err)?;
        rows.collect::<Result<Vec<_>, _>>().map_err(err)
    };
    let groups = by
        .iter()
        .map(|b| Ok((*b, group(*b)?)))
        .collect::<Result<Vec<_>, String>>()?;
    Ok(report(tz_name, day, groups))
}

/// Reads the JSONL audit at `path` (the default sink): every line is one decision record.
/// Lines that are not records (a torn last line after a crash) are skipped and counted in the
/// returned number.
pub fn from_jsonl(
    path: &Path,
    by: &[By],
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
        team: Option<String>,
        #[serde(default)]
        upstream_model: Option<String>,
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
    let mut maps: Vec<BTreeMap<String, Totals>> = vec![BTreeMap::new(); by.len()];
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
        let micros = if l.cost_usd.is_finite() {
            usd_to_micros(l.cost_usd)
        } else {
            0
        };
        for (map, b) in maps.iter_mut().zip(by) {
            let name = match b {
                By::Team => l.team.as_deref().filter(|t| !t.is_empty()).unwrap_or("-"),
                By::Consumer => &l.consumer_id,
                By::Backend => &l.backend,
                By::Model => l
                    .upstream_model
                    .as_deref()
                    .filter(|m| !m.is_empty())
                    .unwrap_or("-"),
            };
            let t = match map.get_mut(name) {
                Some(t) => t,
                None => map
                    .entry(name.to_owned())
                    .or_insert_with(|| Totals::new(name.to_owned())),
            };
            t.cost_usd_month = t.cost_usd_month.saturating_add(micros);
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
    let groups = by
        .iter()
        .zip(maps)
        .map(|(b, m)| (*b, m.into_values().collect()))
        .collect();
    Ok((report(tz_name, day, groups), skipped))
}

/// Reads the Postgres usage log at `url`. A table written before the `team` column existed
/// reads as team `-`.
pub async fn from_postgres(
    url: &str,
    table: &str,
    by: &[By],
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
    let res = pg_groups(&client, table, by, day0, month0).await;
    drop(client);
    let _ = conn_task.await;
    Ok(report(tz_name, day, res?))
}

async fn pg_groups(
    client: &tokio_postgres::Client,
    table: &str,
    by: &[By],
    day0: Timestamp,
    month0: Timestamp,
) -> Result<Vec<(By, Vec<Totals>)>, String> {
    // Unquoted names fold to lower case in Postgres.
    let has_team = client
        .query_opt(
            "SELECT 1 FROM information_schema.columns
             WHERE table_name = $1 AND column_name = 'team' LIMIT 1",
            &[&table.to_ascii_lowercase()],
        )
        .await
        .map_err(|e| e.to_string())?
        .is_some();
    let (d, m) = (format_utc(day0), format_utc(month0));
    let mut out = Vec::new();
    for b in by {
        let col = b.sql(has_team);
        let sql = format!(
            "SELECT {col} AS g,
                    COUNT(*) FILTER (WHERE created_at >= $1::text::timestamptz),
                    COALESCE(SUM(input_tokens) FILTER (WHERE created_at >= $1::text::timestamptz), 0)::bigint,
                    COALESCE(SUM(output_tokens) FILTER (WHERE created_at >= $1::text::timestamptz), 0)::bigint,
                    COALESCE(SUM(GREATEST(0, {MICROS_SQL})), 0)::bigint
             FROM {table} WHERE created_at >= $2::text::timestamptz GROUP BY g ORDER BY g"
        );
        let rows = client
            .query(&sql, &[&d, &m])
            .await
            .map_err(|e| e.to_string())?;
        let totals = rows
            .iter()
            .map(|r| Totals {
                name: r.get(0),
                requests_today: r.get(1),
                input_tokens_today: r.get(2),
                output_tokens_today: r.get(3),
                cost_usd_month: u64::try_from(r.get::<_, i64>(4)).unwrap_or(0),
            })
            .collect();
        out.push((*b, totals));
    }
    Ok(out)
}

/// Every line of one audit file (`.gz` too); a file that cannot be opened is one error.
fn read_lines(f: &Path) -> Box<dyn Iterator<Item = (&Path, std::io::Result<String>)> + '_> {
    use std::io::BufRead;
    match super::open_jsonl(f) {
        Ok(r) => Box::new(r.lines().map(move |l| (f, l))),
        Err(e) => Box::new(std::iter::once((f, Err(e)))),
    }
}

/// The report as aligned text tables; money in dollars as people read it (`$0.000096`,
/// `$12.35`).
pub fn render(r: &Report) -> String {
    let mut s = format!(
        "today {} and month to date from {} ({})\n",
        r.day, r.month_start, r.timezone
    );
    for (by, rows) in &r.groups {
        s.push('\n');
        let head = [
            by.title(),
            "requests today",
            "input tokens today",
            "output tokens today",
            "cost month",
        ];
        let body: Vec<[String; 5]> = rows
            .iter()
            .map(|t| {
                [
                    t.name.clone(),
                    t.requests_today.to_string(),
                    t.input_tokens_today.to_string(),
                    t.output_tokens_today.to_string(),
                    crate::units::fmt_usd(t.cost_usd_month),
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
    fn jsonl_audit_is_summed_per_group() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("audit.jsonl");
        let line = |ts: &str,
                    backend: &str,
                    consumer: &str,
                    team: Option<&str>,
                    i: u64,
                    o: u64,
                    c: f64| {
            let mut v = serde_json::json!({"ts": ts, "endpoint": "chat.completions", "backend": backend,
                "consumer_id": consumer, "actual_input_tokens": i, "actual_output_tokens": o,
                "cost_usd": c, "final_action": "ALLOW"});
            if let Some(t) = team {
                v["team"] = t.into();
                v["upstream_model"] = "m-1".into();
            }
            v.to_string()
        };
        let text = [
            line(
                "2026-11-30T10:00:00Z",
                "gemini",
                "alice",
                Some("team-a"),
                10,
                5,
                0.25,
            ),
            line("2026-11-30T11:00:00Z", "static", "bob", None, 0, 0, 0.0),
            line(
                "2026-11-29T23:00:00Z",
                "gemini",
                "alice",
                Some("team-a"),
                100,
                50,
                0.5,
            ), // yesterday
            line(
                "2026-10-31T23:00:00Z",
                "gemini",
                "alice",
                Some("team-a"),
                1,
                1,
                9.0,
            ), // last month
            // Three tiny costs whose float sum is noisy (0.000032 × 3 = 9.599999999999998e-05).
            line(
                "2026-11-30T11:00:00Z",
                "gemini",
                "carol",
                Some("team-b"),
                1,
                1,
                0.000032,
            ),
            line(
                "2026-11-30T11:00:01Z",
                "gemini",
                "carol",
                Some("team-b"),
                1,
                1,
                0.000032,
            ),
            line(
                "2026-11-30T11:00:02Z",
                "gemini",
                "carol",
                Some("team-b"),
                1,
                1,
                0.000032,
            ),
            "{\"ts\": \"2026-11-30T1".to_owned(), // a torn last line
        ]
        .join("\n");
        std::fs::write(&path, text).expect("write");
        let now: Timestamp = "2026-11-30T12:00:00Z".parse().expect("ts");
        let (r, skipped) =
            from_jsonl(&path, &By::DEFAULT, "UTC", &TimeZone::UTC, now).expect("report");
        assert_eq!(skipped, 1);
        let g = &r.of(By::Backend)[0];
        assert_eq!(
            (
                g.name.as_str(),
                g.requests_today,
                g.input_tokens_today,
                g.output_tokens_today,
                g.cost_usd_month,
            ),
            ("gemini", 4, 13, 8, 750_096)
        );
        assert_eq!(r.of(By::Backend)[1].name, "static");
        let names: Vec<&str> = r.of(By::Consumer).iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["alice", "bob", "carol"]);
        assert_eq!(r.day, "2026-11-30");
        assert!(r.of(By::Team).is_empty(), "not asked for");

        let (r, _) =
            from_jsonl(&path, &[By::Team, By::Model], "UTC", &TimeZone::UTC, now).expect("report");
        let teams: Vec<(&str, i64, Micros)> = r
            .of(By::Team)
            .iter()
            .map(|t| (t.name.as_str(), t.requests_today, t.cost_usd_month))
            .collect();
        assert_eq!(
            teams,
            [("-", 1, 0), ("team-a", 1, 750_000), ("team-b", 3, 96)]
        );
        let json = serde_json::to_string(&r).expect("json");
        assert!(json.contains(r#""by":["team","model"]"#), "{json}");
        assert!(json.contains(r#""name":"team-b","requests_today":3,"input_tokens_today":3,"output_tokens_today":3,"cost_usd_month":0.000096}"#), "{json}");
        assert!(!json.contains("e-"), "no exponent or float noise: {json}");
        assert!(!json.contains("\"providers\""), "{json}");
        let models: Vec<&str> = r.of(By::Model).iter().map(|t| t.name.as_str()).collect();
        assert_eq!(models, ["-", "m-1"]);
    }

    #[test]
    fn dollars_are_exact_decimals() {
        assert_eq!(usd_decimal(0), "0");
        assert_eq!(usd_decimal(96), "0.000096");
        assert_eq!(usd_decimal(340_000), "0.34");
        assert_eq!(usd_decimal(12_000_000), "12");
        assert_eq!(usd_decimal(u64::MAX), "18446744073709.551615");
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&Totals::new("x".into())).expect("json"))
                .expect("parses");
        assert_eq!(v["cost_usd_month"], 0);
        assert_eq!("provider".parse::<By>(), Ok(By::Backend));
        assert!("teams".parse::<By>().is_err());
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
            groups: vec![
                (
                    By::Backend,
                    vec![t("gemini", 3, 120, 45, 500_000), t("static", 10, 0, 0, 96)],
                ),
                (By::Consumer, vec![]),
            ],
        };
        let text = render(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[2].len(), lines[3].len(), "{text}");
        assert_eq!(lines[3].len(), lines[4].len(), "{text}");
        assert!(lines[3].starts_with("gemini "), "{text}");
        assert!(lines[3].ends_with("$0.50"), "{text}");
        assert!(lines[4].ends_with("$0.000096"), "{text}");
        assert!(text.contains("(no rows)"), "{text}");
    }
}
