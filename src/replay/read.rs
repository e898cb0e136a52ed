//! Reading the JSONL audit back: plain or gzip'd files (rotated ones too), each line one
//! decision record. A line that is not one (torn by a crash, another program's output) is
//! counted and skipped, never an error: one bad line must not hide a month of records.

use serde::Deserialize;
use std::io::{BufRead, Read};
use std::path::Path;

/// The longest wall time a record is believed to have taken: a larger (or absurd)
/// `latency_ms` read from a file is clamped, so it cannot move a request out of its day.
const MAX_LATENCY_MS: f64 = 86_400_000.0;

/// What replay needs of one audit record.
#[derive(Debug, Clone, Deserialize)]
pub struct Recorded {
    pub ts: String,
    #[serde(default)]
    pub endpoint: String,
    #[serde(default)]
    latency_ms: Option<f64>,
    pub final_action: String,
    pub reason_class: String,
    pub request_id: String,
    pub job_id: String,
    pub consumer_id: String,
    #[serde(default)]
    pub team: Option<String>,
    pub route: String,
    pub backend: String,
    #[serde(default)]
    pub usage_evidence_state: String,
    #[serde(default)]
    pub estimated_input_tokens: u64,
    #[serde(default)]
    pub requested_output_tokens: u64,
    #[serde(default)]
    pub client_max_tokens: Option<u64>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub actual_input_tokens: u64,
    #[serde(default)]
    pub actual_output_tokens: u64,
    #[serde(default)]
    pub actual_cached_input_tokens: u64,
    #[serde(default)]
    pub actual_cache_write_tokens: u64,
    #[serde(default)]
    cost_usd: Option<f64>,
    #[serde(default)]
    pub attempts: Vec<RecordedAttempt>,
    #[serde(default)]
    pub refusals: Vec<RecordedRefusal>,
    /// When the request came in (`ts` − `latency_ms`: when its reservation was made), Unix
    /// ns: sequential requests through a fast sidecar often share a millisecond, and `ts`
    /// (when the record was closed) may come after the next request's.
    #[serde(skip)]
    pub start_ns: i128,
    /// `start_ns` in ms, the governor's clock.
    #[serde(skip)]
    pub start_ms: i64,
}

impl Recorded {
    /// What the request cost, as recorded (a non-finite or negative figure counts as 0).
    pub fn cost_usd(&self) -> f64 {
        self.cost_usd
            .filter(|c| c.is_finite() && *c > 0.0)
            .unwrap_or(0.0)
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct RecordedAttempt {
    pub backend: String,
    #[serde(default)]
    pub outcome: String,
    #[serde(default)]
    pub status: Option<u16>,
    #[serde(default)]
    pub retry_after_ms: Option<i64>,
    #[serde(default)]
    pub latency_ms: i64,
    #[serde(default)]
    pub committed_tokens: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RecordedRefusal {
    pub name: String,
    #[serde(default)]
    pub class: String,
}

/// Records read from the audit files, in time order (by when each request came in; equal
/// times keep the files' order), and how many lines were not audit records.
#[derive(Debug, Default)]
pub struct Traffic {
    pub records: Vec<Recorded>,
    pub skipped: usize,
}

/// Reads every file; `.gz` files are decompressed. An unreadable file is an error (exit 2).
pub fn read_all(paths: &[impl AsRef<Path>]) -> Result<Traffic, String> {
    let mut out = Traffic::default();
    for p in paths {
        let p = p.as_ref();
        let file = std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
        let input: Box<dyn Read> = if p.extension().is_some_and(|e| e == "gz") {
            Box::new(flate2::read::MultiGzDecoder::new(file))
        } else {
            Box::new(file)
        };
        read_lines(std::io::BufReader::new(input), &mut out)
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    out.records.sort_by_key(|r| r.start_ns);
    Ok(out)
}

/// Parses the lines of one file into `out`.
pub fn read_lines(mut input: impl BufRead, out: &mut Traffic) -> std::io::Result<()> {
    let mut line = Vec::new();
    loop {
        line.clear();
        if input.read_until(b'\n', &mut line)? == 0 {
            return Ok(());
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match parse(&line) {
            Some(r) => out.records.push(r),
            None => out.skipped += 1,
        }
    }
}

/// One audit line, or `None` when it is not one.
pub fn parse(line: &[u8]) -> Option<Recorded> {
    let mut r: Recorded = serde_json::from_slice(line).ok()?;
    let at = r.ts.parse::<jiff::Timestamp>().ok()?;
    let latency = r
        .latency_ms
        .filter(|l| l.is_finite())
        .unwrap_or(0.0)
        .clamp(0.0, MAX_LATENCY_MS);
    r.start_ns = at.as_nanosecond() - (latency * 1e6) as i128;
    r.start_ms = i64::try_from(r.start_ns.div_euclid(1_000_000)).ok()?;
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = r#"{"ts":"2026-03-01T10:00:10Z","final_action":"ALLOW","reason_class":"OK","request_id":"r","job_id":"r","consumer_id":"c","route":"chat","backend":"p","latency_ms":LAT}"#;

    #[test]
    fn a_record_starts_its_latency_before_its_ts_and_absurd_numbers_are_bounded() {
        let at = jiff::Timestamp::from_second(1_772_359_210)
            .unwrap()
            .as_millisecond();
        let start = |lat: &str| parse(LINE.replace("LAT", lat).as_bytes()).map(|r| r.start_ms);
        assert_eq!(start("1500.5"), Some(at - 1501));
        // Negative, absurd or missing latencies: no time travel past a day.
        assert_eq!(start("-5"), Some(at));
        assert_eq!(start("null"), Some(at));
        assert_eq!(start("1e300"), Some(at - 86_400_000));
        // A count that is not a u64 makes the line not a record, never a wrapped number.
        let neg = LINE.replace("LAT", "1").replace(
            r#""backend":"p""#,
            r#""backend":"p","actual_output_tokens":-1"#,
        );
        assert!(parse(neg.as_bytes()).is_none());
        assert!(parse(b"{\"ts\":\"yesterday\"}").is_none());
    }
}
