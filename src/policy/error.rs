//! Errors from loading a policy.
//!
//! An operator fixing a rejected policy needs to know where to look, so every error names the
//! file, the line and the key path (`FILE:LINE: routes[0].chain[1].backend: message`), and a
//! load reports every problem it found rather than stopping at the first.

use std::fmt;

/// One problem in a policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", Render(self))]
pub struct PolicyError {
    /// The file (or scenario, or other source name) the problem is in.
    pub file: String,
    /// 1-based line, when it could be found.
    pub line: Option<usize>,
    /// Key path such as `routes[0].chain[1].backend`; empty for whole-file problems.
    pub path: String,
    pub message: String,
}

struct Render<'a>(&'a PolicyError);

impl fmt::Display for Render<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = self.0;
        f.write_str(&e.file)?;
        if let Some(line) = e.line {
            write!(f, ":{line}")?;
        }
        if !e.path.is_empty() {
            write!(f, ": {}", e.path)?;
        }
        write!(f, ": {}", e.message)
    }
}

impl PolicyError {
    pub fn new(
        file: impl Into<String>,
        line: Option<usize>,
        path: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        PolicyError {
            file: file.into(),
            line,
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Every problem found in one load, in file order. Never empty.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", RenderAll(&self.0))]
pub struct PolicyErrors(pub Vec<PolicyError>);

struct RenderAll<'a>(&'a [PolicyError]);

impl fmt::Display for RenderAll<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl PolicyErrors {
    pub fn iter(&self) -> std::slice::Iter<'_, PolicyError> {
        self.0.iter()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<PolicyError> for PolicyErrors {
    fn from(e: PolicyError) -> Self {
        PolicyErrors(vec![e])
    }
}

impl<'a> IntoIterator for &'a PolicyErrors {
    type Item = &'a PolicyError;
    type IntoIter = std::slice::Iter<'a, PolicyError>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// What a serde_norway error says, split into its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct YamlProblem {
    /// 1-based line from the parser, when it knows it.
    pub line: Option<usize>,
    /// Key path; for an unknown field, the path of the unknown key itself.
    pub path: String,
    pub message: String,
}

/// Splits a serde_norway error into line, key path and message. The deserializer prefixes its
/// message with the path of the value it was reading (`routes[0]: unknown field ...`) and
/// appends ` at line L column C`; both are taken off the message and kept separately.
pub(crate) fn split_yaml_error(err: &serde_norway::Error) -> YamlProblem {
    let line = err.location().map(|l| l.line());
    let mut text = err.to_string();
    if let Some(at) = text.rfind(" at line ") {
        let tail = &text[at + " at line ".len()..];
        if tail
            .split(' ')
            .next()
            .is_some_and(|n| n.parse::<usize>().is_ok())
        {
            // libyaml errors continue after the location (`..., while parsing a flow node`).
            let rest = tail
                .split_once(", ")
                .map(|(_, r)| format!(", {r}"))
                .unwrap_or_default();
            text = format!("{}{rest}", &text[..at]);
        }
    }
    let (mut path, message) = match text.split_once(": ") {
        Some((p, m)) if looks_like_path(p) => (p.trim_end_matches(".?").to_owned(), m.to_owned()),
        _ => (String::new(), text.clone()),
    };
    if let Some(field) = quoted_after(&message, "unknown field `") {
        path = if path.is_empty() {
            field
        } else {
            format!("{path}.{field}")
        };
    }
    YamlProblem {
        line,
        path,
        message,
    }
}

fn looks_like_path(p: &str) -> bool {
    !p.is_empty()
        && p.chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '[' | ']' | '?'))
}

fn quoted_after(message: &str, prefix: &str) -> Option<String> {
    let start = message.find(prefix)? + prefix.len();
    let len = message[start..].find('`')?;
    Some(message[start..start + len].to_owned())
}
