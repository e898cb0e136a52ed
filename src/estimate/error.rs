//! Why a request body could not be estimated.
//!
//! The estimator is the first code that looks inside a request body, so it is also where a
//! malformed body is caught. Each error carries a message fit to show the client and the
//! OpenAI-style `param` path it refers to (`messages.[2].content`), so the proxy can answer with
//! an OpenAI-shaped `invalid_request_error` without knowing anything about the body itself.

use std::fmt;

/// A request body the estimator cannot price. `Display` is the client-facing message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EstimateError {
    /// The body is not a JSON object at all.
    #[error("the request body must be a JSON object")]
    NotAnObject,
    /// A required parameter is absent (or `null`).
    #[error("you must provide a '{param}' parameter")]
    Missing {
        /// OpenAI-style parameter path, e.g. `messages` or `messages.[0].role`.
        param: String,
    },
    /// A parameter is present but has the wrong JSON type or shape.
    #[error("invalid type for '{param}': expected {expected}")]
    WrongType {
        /// OpenAI-style parameter path.
        param: String,
        /// What was expected, phrased for a human ("an integer", "an array of strings").
        expected: &'static str,
    },
    /// A parameter has the right type but an unacceptable value.
    #[error("invalid value for '{param}': expected {expected}, but got {got}")]
    OutOfRange {
        /// OpenAI-style parameter path.
        param: String,
        /// The accepted range, phrased for a human ("a value between 1 and 128").
        expected: &'static str,
        /// The offending value as the client sent it (JSON text, possibly shortened).
        got: String,
    },
}

impl EstimateError {
    /// The parameter the error is about, for the `param` field of an OpenAI error body.
    /// `None` when the body as a whole is at fault.
    pub fn param(&self) -> Option<&str> {
        match self {
            EstimateError::NotAnObject => None,
            EstimateError::Missing { param }
            | EstimateError::WrongType { param, .. }
            | EstimateError::OutOfRange { param, .. } => Some(param),
        }
    }

    /// A machine-readable code in the spirit of OpenAI's `error.code`.
    pub fn code(&self) -> &'static str {
        match self {
            EstimateError::NotAnObject => "invalid_json",
            EstimateError::Missing { .. } => "missing_required_parameter",
            EstimateError::WrongType { .. } => "invalid_type",
            EstimateError::OutOfRange { .. } => "invalid_value",
        }
    }

    pub(crate) fn missing(param: impl fmt::Display) -> Self {
        EstimateError::Missing {
            param: param.to_string(),
        }
    }

    pub(crate) fn wrong_type(param: impl fmt::Display, expected: &'static str) -> Self {
        EstimateError::WrongType {
            param: param.to_string(),
            expected,
        }
    }

    pub(crate) fn out_of_range(
        param: impl fmt::Display,
        expected: &'static str,
        got: &serde_json::Value,
    ) -> Self {
        EstimateError::OutOfRange {
            param: param.to_string(),
            expected,
            got: shorten(got),
        }
    }
}

/// Where in the body a value sits, as a linked list on the stack: building one costs nothing,
/// and it is only rendered (`messages.[2].content.[0].text`, OpenAI's style) for an error.
#[derive(Clone, Copy)]
pub(crate) struct Param<'a> {
    parent: Option<&'a Param<'a>>,
    seg: Seg<'a>,
}

#[derive(Clone, Copy)]
enum Seg<'a> {
    Key(&'a str),
    Index(usize),
}

impl<'a> Param<'a> {
    /// A top-level body field.
    pub(crate) const fn root(key: &'a str) -> Self {
        Param {
            parent: None,
            seg: Seg::Key(key),
        }
    }

    /// A field of the object at `self`.
    pub(crate) fn key(&'a self, key: &'a str) -> Param<'a> {
        Param {
            parent: Some(self),
            seg: Seg::Key(key),
        }
    }

    /// An element of the array at `self`.
    pub(crate) fn index(&'a self, i: usize) -> Param<'a> {
        Param {
            parent: Some(self),
            seg: Seg::Index(i),
        }
    }
}

impl fmt::Display for Param<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(parent) = self.parent {
            write!(f, "{parent}.")?;
        }
        match self.seg {
            Seg::Key(k) => f.write_str(k),
            Seg::Index(i) => write!(f, "[{i}]"),
        }
    }
}

/// The JSON text of `v`, cut to a length that is safe to echo back in an error message.
fn shorten(v: &serde_json::Value) -> String {
    const MAX_CHARS: usize = 64;
    let s = v.to_string();
    if s.chars().count() <= MAX_CHARS {
        s
    } else {
        let mut out: String = s.chars().take(MAX_CHARS).collect();
        out.push('…');
        out
    }
}
