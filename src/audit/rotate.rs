//! The JSONL audit's retention: the file is rotated by size, rotated files are numbered
//! `<path>.<n>` (higher is newer), optionally gzipped to `<path>.<n>.gz`, and only the newest
//! `keep` are kept. Readers (`tollgate usage`) use [`jsonl_files`] and [`open_jsonl`] to see
//! the rotated files and the current one as one log.
//!
//! Only the single writer thread writes and rotates, and it rotates between whole lines, so a
//! record is never split across files and none is lost by a rotation. Compressing and pruning
//! run on a helper thread, so a large file being gzipped never holds up the queue.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// Size-based rotation of the JSONL audit (`audit.max_bytes`, `audit.keep`, `audit.compress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    /// Rotate before a record would take the file past this size; 0 = never rotate.
    pub max_bytes: u64,
    /// Rotated files kept; older ones are deleted.
    pub keep: u32,
    /// Gzip rotated files.
    pub compress: bool,
}

impl Rotation {
    /// The file only grows (the behaviour before rotation existed).
    pub const NEVER: Rotation = Rotation {
        max_bytes: 0,
        keep: 0,
        compress: false,
    };
}

/// The files of the JSONL audit at `path`, oldest first: its rotated siblings (`<path>.<n>`
/// and `<path>.<n>.gz`, by `n`), then `path` itself if it exists. When a rotated file exists
/// both plain and gzipped (a compression caught half done), the plain one is listed.
pub fn jsonl_files(path: &Path) -> io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = rotated(path)?.into_iter().map(|(_, p)| p).collect();
    if path.is_file() {
        files.push(path.to_path_buf());
    }
    Ok(files)
}

/// Opens one audit file for reading lines; a `.gz` file is decompressed on the fly.
pub fn open_jsonl(path: &Path) -> io::Result<Box<dyn BufRead + Send>> {
    let file = File::open(path)?;
    if path.extension().is_some_and(|e| e == "gz") {
        Ok(Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(
            file,
        ))))
    } else {
        Ok(Box::new(BufReader::new(file)))
    }
}

/// The rotated siblings of `path` with their numbers, ascending.
fn rotated(path: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Ok(Vec::new());
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out: Vec<(u64, bool, PathBuf)> = Vec::new();
    for entry in entries {
        let entry = entry?;
        let file_name = entry.file_name();
        let Some(f) = file_name.to_str() else {
            continue;
        };
        let Some(rest) = f.strip_prefix(name).and_then(|r| r.strip_prefix('.')) else {
            continue;
        };
        let (digits, gz) = match rest.strip_suffix(".gz") {
            Some(d) => (d, true),
            None => (rest, false),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(n) = digits.parse::<u64>() else {
            continue;
        };
        out.push((n, gz, entry.path()));
    }
    // Plain before gzipped for the same number, so the dedup below keeps the plain one.
    out.sort_by_key(|(n, gz, _)| (*n, *gz));
    out.dedup_by_key(|(n, _, _)| *n);
    Ok(out.into_iter().map(|(n, _, p)| (n, p)).collect())
}

/// `<path>.<n>`, zero-padded so a directory listing sorts in order too.
fn rotated_name(path: &Path, n: u64) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{n:06}"));
    PathBuf::from(s)
}

/// The writer's file: appends whole lines and rotates between them.
pub(super) struct RotatingFile {
    path: PathBuf,
    out: BufWriter<File>,
    size: u64,
    rotation: Rotation,
    next: u64,
    chores: Option<JoinHandle<()>>,
}

impl RotatingFile {
    pub(super) fn open(path: PathBuf, rotation: Rotation) -> io::Result<RotatingFile> {
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        let size = file.metadata()?.len();
        let next = rotated(&path)?
            .last()
            .map_or(1, |(n, _)| n.saturating_add(1));
        Ok(RotatingFile {
            path,
            out: BufWriter::with_capacity(256 * 1024, file),
            size,
            rotation,
            next,
            chores: None,
        })
    }

    /// Appends one whole line (with its newline), rotating first when it would not fit. A
    /// line longer than `max_bytes` goes alone into a fresh file rather than being cut.
    pub(super) fn write_line(&mut self, line: &[u8]) -> io::Result<()> {
        let len = line.len() as u64;
        let max = self.rotation.max_bytes;
        if max > 0 && self.size > 0 && self.size.saturating_add(len) > max {
            if let Err(err) = self.rotate() {
                // Keep writing to the current file (nothing is lost) and try again only after
                // another `max_bytes`, not on every record.
                tracing::error!(%err, path = %self.path.display(), "audit rotation failed; still writing to the current file");
                self.size = 0;
            }
        }
        self.out.write_all(line)?;
        self.size = self.size.saturating_add(len);
        Ok(())
    }

    pub(super) fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    fn rotate(&mut self) -> io::Result<()> {
        self.out.flush()?;
        let to = rotated_name(&self.path, self.next);
        fs::rename(&self.path, &to)?;
        self.next = self.next.saturating_add(1);
        // Records already flushed are in `to`; the rest start the new file.
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.out = BufWriter::with_capacity(256 * 1024, file);
        self.size = 0;
        // One helper at a time: pruning must not race the previous file's compression.
        self.wait_chores();
        let path = self.path.clone();
        let rotation = self.rotation;
        self.chores = std::thread::Builder::new()
            .name("tollgate-audit-rotate".into())
            .spawn(move || chores(&path, &to, rotation))
            .map_err(|err| tracing::error!(%err, "cannot start the audit rotation helper"))
            .ok();
        Ok(())
    }

    /// Waits for the last rotation's compression and pruning (at shutdown, and in tests).
    pub(super) fn wait_chores(&mut self) {
        if let Some(h) = self.chores.take() {
            let _ = h.join();
        }
    }
}

/// After a rotation: gzip the rotated file (if asked), then delete all but the newest `keep`.
fn chores(path: &Path, rotated_file: &Path, rotation: Rotation) {
    if rotation.compress {
        if let Err(err) = gzip(rotated_file) {
            tracing::warn!(%err, file = %rotated_file.display(), "cannot compress a rotated audit file; it stays plain");
        }
    }
    let files = match rotated(path) {
        Ok(f) => f,
        Err(err) => {
            tracing::warn!(%err, "cannot list rotated audit files; none pruned");
            return;
        }
    };
    let excess = files.len().saturating_sub(rotation.keep as usize);
    for (n, _) in files.into_iter().take(excess) {
        for p in [rotated_name(path, n), gz_name(&rotated_name(path, n))] {
            match fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(err) => {
                    tracing::warn!(%err, file = %p.display(), "cannot delete an old audit file")
                }
            }
        }
    }
}

fn gz_name(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".gz");
    PathBuf::from(s)
}

/// `file` → `file.gz`, through `file.gz.tmp` so a reader never sees half a `.gz`; the plain
/// file is removed only once the compressed one is complete and in place.
fn gzip(file: &Path) -> io::Result<()> {
    let gz = gz_name(file);
    let mut tmp = gz.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut input = File::open(file)?;
    let out = File::create(&tmp)?;
    let mut enc = flate2::write::GzEncoder::new(BufWriter::new(out), flate2::Compression::fast());
    io::copy(&mut input, &mut enc)?;
    let out = enc.finish()?;
    out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    fs::rename(&tmp, &gz)?;
    fs::remove_file(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(path: &Path) -> Vec<String> {
        let mut lines = Vec::new();
        for f in jsonl_files(path).expect("list") {
            for l in open_jsonl(&f).expect("open").lines() {
                lines.push(l.expect("line"));
            }
        }
        lines
    }

    #[test]
    fn rotates_between_lines_and_keeps_the_newest_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.jsonl");
        let rot = Rotation {
            max_bytes: 25,
            keep: 2,
            compress: false,
        };
        let mut f = RotatingFile::open(path.clone(), rot).expect("open");
        for i in 0..10 {
            f.write_line(format!("line-{i:04}\n").as_bytes())
                .expect("write");
            f.wait_chores();
        }
        f.flush().expect("flush");
        // 10 bytes a line, two a file: files hold 0-1, 2-3, ... 8-9; the current one and two
        // rotated ones survive.
        assert_eq!(
            read_all(&path),
            (4..10).map(|i| format!("line-{i:04}")).collect::<Vec<_>>()
        );
        let names: Vec<String> = jsonl_files(&path)
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["a.jsonl.000003", "a.jsonl.000004", "a.jsonl"]);
    }

    #[test]
    fn compressed_files_read_back_and_numbering_continues_after_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.jsonl");
        let rot = Rotation {
            max_bytes: 1,
            keep: 10,
            compress: true,
        };
        for run in 0..2 {
            let mut f = RotatingFile::open(path.clone(), rot).expect("open");
            for i in 0..3 {
                f.write_line(format!("{run}-{i}\n").as_bytes()).unwrap();
            }
            f.flush().unwrap();
            f.wait_chores();
        }
        assert_eq!(read_all(&path), ["0-0", "0-1", "0-2", "1-0", "1-1", "1-2"]);
        let gz = jsonl_files(&path)
            .unwrap()
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "gz"))
            .count();
        assert_eq!(gz, 5, "every rotated file is compressed");
    }

    #[test]
    fn a_half_done_compression_is_read_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.jsonl");
        fs::write(rotated_name(&path, 1), "one\n").unwrap();
        fs::write(gz_name(&rotated_name(&path, 1)), "not gzip").unwrap();
        fs::write(dir.path().join("a.jsonl.000002.gz.tmp"), "x").unwrap();
        fs::write(dir.path().join("a.jsonl.bak"), "x").unwrap();
        fs::write(&path, "two\n").unwrap();
        assert_eq!(read_all(&path), ["one", "two"]);
    }
}
