//! Where policy text comes from, and how several files become one raw policy.
//!
//! Kubernetes mounts a ConfigMap as a directory whose visible files are symlinks into a
//! hidden `..data` directory, and teams like to keep backends, routes and limits in separate
//! keys. So a directory is read as all its visible `*.yaml`/`*.yml` files in name order, list
//! sections are concatenated, and any other section may be set by only one file. Every item
//! remembers its file and its index there, so errors point into the file the operator edits.

use super::error::{split_yaml_error, PolicyError, PolicyErrors};
use super::locate::{locate, parse_path, path_to_string, Seg};
use super::raw::*;
use std::path::Path;

/// One piece of policy text and how to point into it.
#[derive(Debug, Clone)]
pub(crate) struct Source {
    /// Shown in errors.
    pub name: String,
    /// The text, for finding lines; `None` when the policy came from a value without text.
    pub text: Option<String>,
    /// Where the policy sits inside `text` (`policy` in a scenario file).
    pub base: Vec<Seg>,
}

impl Source {
    /// An error at `path` (relative to the policy), with its line found in the text.
    pub fn error(&self, path: &str, message: impl Into<String>) -> PolicyError {
        let line = self
            .text
            .as_deref()
            .and_then(|t| locate(t, &self.base, &parse_path(path)));
        PolicyError::new(&self.name, line, self.shown_path(path), message)
    }

    /// A deserialization error. `own_lines`: the error's line refers to `self.text` (false
    /// when the YAML was re-serialized from a value, so only its key path is meaningful).
    pub fn yaml_error(&self, err: &serde_norway::Error, own_lines: bool) -> PolicyError {
        let p = split_yaml_error(err);
        let message = p
            .message
            .replace("struct RawPolicy", "a mapping of policy sections");
        let mut e = self.error(&p.path, message);
        if own_lines && p.line.is_some() {
            e.line = p.line;
        }
        e
    }

    /// `FILE:LINE` of a path, for messages that refer to another place.
    pub fn place(&self, path: &str) -> String {
        let e = self.error(path, "");
        match e.line {
            Some(l) => format!("{}:{l}", self.name),
            None => self.name.clone(),
        }
    }

    fn shown_path(&self, path: &str) -> String {
        match (self.base.is_empty(), path.is_empty()) {
            (true, _) => path.to_owned(),
            (false, true) => path_to_string(&self.base),
            (false, false) => format!("{}.{path}", path_to_string(&self.base)),
        }
    }
}

/// The policy files of a directory: every visible `*.yaml`/`*.yml` (following symlinks:
/// ConfigMap keys are links into `..data/`), as (name, path), sorted by name. The one rule
/// both the loader and the reload watcher use.
pub(crate) fn policy_files(dir: &Path) -> std::io::Result<Vec<(String, std::path::PathBuf)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        if is_yaml && !name.starts_with('.') && entry.path().is_file() {
            files.push((name, entry.path()));
        }
    }
    files.sort();
    Ok(files)
}

/// The largest policy file read (a policy is a few KB; a huge one stalls every reload).
pub const MAX_POLICY_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// Reads one policy file: only a regular file (after following symlinks — a FIFO would block
/// the reader forever, `/dev/zero` would never end), at most [`MAX_POLICY_FILE_BYTES`].
/// Blocking: callers on the async runtime run it in `spawn_blocking`.
pub fn read_policy_file(path: &Path) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind, Read};
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "not a regular file (a policy must be a file or a directory of *.yaml files)",
        ));
    }
    let too_big = || {
        Error::new(
            ErrorKind::InvalidData,
            format!("larger than the {MAX_POLICY_FILE_BYTES}-byte limit for a policy file"),
        )
    };
    if meta.len() > MAX_POLICY_FILE_BYTES {
        return Err(too_big());
    }
    // The file may grow between the look and the read: the read is capped too.
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_POLICY_FILE_BYTES + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX_POLICY_FILE_BYTES {
        return Err(too_big());
    }
    Ok(text)
}

/// Reads a policy file, or every visible `*.yaml`/`*.yml` in a directory, sorted by name.
pub(crate) fn read_sources(path: &Path) -> Result<Vec<Source>, PolicyErrors> {
    let shown = path.display().to_string();
    let io_err = |file: &str, e: std::io::Error| PolicyError::new(file, None, "", e.to_string());
    if !path.is_dir() {
        let text = read_policy_file(path).map_err(|e| io_err(&shown, e))?;
        return Ok(vec![Source {
            name: shown,
            text: Some(text),
            base: Vec::new(),
        }]);
    }
    let files = policy_files(path).map_err(|e| io_err(&shown, e))?;
    if files.is_empty() {
        return Err(
            PolicyError::new(shown, None, "", "no *.yaml or *.yml files in directory").into(),
        );
    }
    let mut out = Vec::new();
    let mut errs = Vec::new();
    for (_, p) in files {
        let name = p.display().to_string();
        match read_policy_file(&p) {
            Ok(text) => out.push(Source {
                name,
                text: Some(text),
                base: Vec::new(),
            }),
            Err(e) => errs.push(io_err(&name, e)),
        }
    }
    if errs.is_empty() {
        Ok(out)
    } else {
        Err(PolicyErrors(errs))
    }
}

/// Parses one source's text. Empty or comment-only files are an empty policy fragment.
pub(crate) fn parse_source(src: &Source) -> Result<RawPolicy, PolicyError> {
    let text = src.text.as_deref().unwrap_or("");
    match serde_norway::from_str::<Option<RawPolicy>>(text) {
        Ok(raw) => Ok(raw.unwrap_or_default()),
        Err(e) => {
            let mut err = src.yaml_error(&e, true);
            if tab_at(text, err.line) {
                err.message = "tabs are not allowed in YAML: indent with spaces".into();
            }
            Err(err)
        }
    }
}

/// Whether a YAML error at `line` (1-based) is about a tab: libyaml's message ("found
/// character that cannot start any token") does not say so. The error may be reported on
/// the line after the tab, so both are looked at.
fn tab_at(text: &str, line: Option<usize>) -> bool {
    let Some(line) = line else { return false };
    let tab_lead = |l: &str| {
        l.chars()
            .take_while(|c| c.is_whitespace())
            .any(|c| c == '\t')
            || l.contains(": \t")
            || l.contains("-\t")
    };
    text.lines()
        .skip(line.saturating_sub(2))
        .take(2)
        .any(tab_lead)
}

/// A section and the file that set it.
#[derive(Debug)]
pub(crate) struct At<T> {
    pub file: usize,
    pub v: T,
}

/// A list item, its file and its index in that file's list.
#[derive(Debug)]
pub(crate) struct Item<T> {
    pub file: usize,
    pub index: usize,
    pub v: T,
}

/// All fragments of a policy put together, each part remembering where it came from.
#[derive(Debug, Default)]
pub(crate) struct Merged {
    pub version: Option<At<Text>>,
    pub server: Option<At<RawServer>>,
    pub consumer_header: Option<At<String>>,
    pub job_header: Option<At<String>>,
    pub default_consumer: Option<At<Text>>,
    pub require_key: Option<At<bool>>,
    pub virtual_keys: Vec<Item<RawVirtualKey>>,
    pub estimate: Option<At<RawEstimate>>,
    pub windows: Option<At<RawWindows>>,
    pub backends: Vec<Item<RawBackend>>,
    pub routes: Vec<Item<RawRoute>>,
    pub rate_limits: Vec<Item<RawLimit>>,
    pub quotas: Vec<Item<RawLimit>>,
    pub budgets: Vec<Item<RawBudget>>,
    pub retry: Option<At<RawRetry>>,
    pub fallback: Option<At<RawFallback>>,
    pub degrade: Option<At<RawDegrade>>,
    pub defer: Option<At<RawDefer>>,
    pub state: Option<At<RawState>>,
    pub audit: Option<At<RawAudit>>,
    pub alerts: Option<At<RawAlerts>>,
    pub telemetry: Option<At<RawTelemetry>>,
}

impl Merged {
    /// Adds the fragment of `sources[file]`. Identity's single-valued keys merge key by key,
    /// so one file may hold the headers and others only `virtual_keys`.
    pub fn add(
        &mut self,
        file: usize,
        raw: RawPolicy,
        sources: &[Source],
        errs: &mut Vec<PolicyError>,
    ) {
        let mut m = Merger {
            file,
            sources,
            errs,
        };
        m.one(&mut self.version, raw.version, "version");
        m.one(&mut self.server, raw.server, "server");
        if let Some(id) = raw.identity {
            m.one(
                &mut self.consumer_header,
                id.consumer_header,
                "identity.consumer_header",
            );
            m.one(&mut self.job_header, id.job_header, "identity.job_header");
            m.one(
                &mut self.default_consumer,
                id.default_consumer,
                "identity.default_consumer",
            );
            m.one(
                &mut self.require_key,
                id.require_key,
                "identity.require_key",
            );
            m.many(&mut self.virtual_keys, id.virtual_keys);
        }
        m.one(&mut self.estimate, raw.estimate, "estimate");
        m.one(&mut self.windows, raw.windows, "windows");
        m.many(&mut self.backends, raw.backends);
        m.many(&mut self.routes, raw.routes);
        m.many(&mut self.rate_limits, raw.rate_limits);
        m.many(&mut self.quotas, raw.quotas);
        m.many(&mut self.budgets, raw.budgets);
        m.one(&mut self.retry, raw.retry, "retry");
        m.one(&mut self.fallback, raw.fallback, "fallback");
        m.one(&mut self.degrade, raw.degrade, "degrade");
        m.one(&mut self.defer, raw.defer, "defer");
        m.one(&mut self.state, raw.state, "state");
        m.one(&mut self.audit, raw.audit, "audit");
        m.one(&mut self.alerts, raw.alerts, "alerts");
        m.one(&mut self.telemetry, raw.telemetry, "telemetry");
    }
}

struct Merger<'a> {
    file: usize,
    sources: &'a [Source],
    errs: &'a mut Vec<PolicyError>,
}

impl Merger<'_> {
    fn one<T>(&mut self, slot: &mut Option<At<T>>, new: Option<T>, key: &str) {
        let Some(v) = new else { return };
        match slot {
            Some(prev) => {
                let first = self.sources[prev.file].place(key);
                self.errs.push(self.sources[self.file].error(
                    key,
                    format!(
                        "`{key}` is already set in {first}; only backends, routes, rate_limits, \
                         quotas, budgets and identity.virtual_keys may be split across files"
                    ),
                ));
            }
            None => *slot = Some(At { file: self.file, v }),
        }
    }

    fn many<T>(&mut self, list: &mut Vec<Item<T>>, new: Option<Vec<T>>) {
        let file = self.file;
        list.extend(
            new.into_iter()
                .flatten()
                .enumerate()
                .map(|(index, v)| Item { file, index, v }),
        );
    }
}
