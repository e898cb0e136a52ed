//! The spill file of the database sinks: rows that could not reach their database are
//! appended here as JSON lines (synced), and loaded back in batches once it answers again —
//! by the Postgres writer after an outage, by both writers at the next start.

use super::row::{usage_row, UsageRow};
use super::{Entry, MAX_BATCH};
use std::io::{BufRead, Write};
use std::path::Path;
use tokio::sync::mpsc;

/// Shutting down with the log's database away: takes what is still queued into `batch` and
/// spills it all to `path` instead of hanging (the next start loads the file).
pub(super) fn spill_at_shutdown(
    rx: &mut mpsc::Receiver<Entry>,
    batch: &mut Vec<UsageRow>,
    path: &Path,
) {
    while let Ok(e) = rx.try_recv() {
        batch.push(usage_row(&e));
    }
    if !spill(path, batch) {
        tracing::error!(rows = batch.len(), "usage log: rows lost at shutdown");
    }
}

/// Appends usage rows that could not reach their database to `path` as JSON lines, synced;
/// `false` when that failed too (the caller keeps the rows).
pub(super) fn spill(path: &Path, rows: &[UsageRow]) -> bool {
    let res = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|f| {
            let mut out = std::io::BufWriter::new(f);
            for r in rows {
                serde_json::to_writer(&mut out, r)?;
                out.write_all(b"\n")?;
            }
            out.flush()?;
            out.into_inner().map_err(|e| e.into_error())?.sync_all()
        });
    match res {
        Ok(()) => {
            tracing::warn!(
                rows = rows.len(),
                path = %path.display(),
                "usage log: database unreachable; rows spilled to the JSON lines file"
            );
            true
        }
        Err(err) => {
            tracing::error!(%err, rows = rows.len(), "usage log: cannot spill rows");
            false
        }
    }
}

/// A spill file being loaded back: batches of rows in file order; lines that do not parse (a
/// torn last line after a crash) are set aside for `<spill>.bad` instead of being dropped.
pub(super) struct SpillFile {
    lines: std::io::Lines<std::io::BufReader<std::fs::File>>,
    bad: Vec<String>,
}

/// Batches of up to `MAX_BATCH` rows, in file order, until the end of the file.
impl Iterator for SpillFile {
    type Item = Result<Vec<UsageRow>, String>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut rows = Vec::new();
        // Leaves early only when the batch is full: an empty batch means the end of the file.
        while rows.len() < MAX_BATCH {
            let line = match self.lines.next() {
                None => break,
                Some(Ok(line)) => line,
                Some(Err(e)) => return Some(Err(e.to_string())),
            };
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<UsageRow>(&line) {
                Ok(r) => rows.push(r),
                Err(_) => self.bad.push(line),
            }
        }
        (!rows.is_empty()).then_some(Ok(rows))
    }
}

impl SpillFile {
    /// Opens `path`; `None` when there is no spill file.
    pub(super) fn open(path: &Path) -> Result<Option<SpillFile>, String> {
        match std::fs::File::open(path) {
            Ok(f) => Ok(Some(SpillFile {
                lines: std::io::BufReader::new(f).lines(),
                bad: Vec::new(),
            })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }

    /// Every row is in the database: keeps the unreadable lines in `<path>.bad`, then
    /// removes `path`.
    pub(super) fn done(self, path: &Path) -> Result<(), String> {
        if !self.bad.is_empty() {
            let mut b = path.as_os_str().to_owned();
            b.push(".bad");
            let mut text = self.bad.join("\n");
            text.push('\n');
            let res = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&b)
                .and_then(|mut f| f.write_all(text.as_bytes()));
            if let Err(e) = res {
                return Err(format!(
                    "cannot keep {} unreadable spilled lines: {e}",
                    self.bad.len()
                ));
            }
            tracing::error!(
                lines = self.bad.len(),
                "usage log: unreadable spilled lines kept in the .bad file"
            );
        }
        std::fs::remove_file(path).map_err(|e| e.to_string())
    }
}
