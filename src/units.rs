//! Small value types shared by the policy, the ledger and the governor.
//!
//! They live at the bottom of the module graph so that `policy` and `ledger` can both use
//! them without importing each other.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Money in whole micro-dollars (1 USD = 1_000_000). Never floating point on the books.
pub type Micros = u64;

/// Converts a USD amount from a policy or scenario to micro-dollars, rounding to nearest.
pub fn usd_to_micros(usd: f64) -> Micros {
    (usd * 1_000_000.0).round().max(0.0) as Micros
}

/// Converts micro-dollars to USD for display and audit.
pub fn micros_to_usd(m: Micros) -> f64 {
    m as f64 / 1_000_000.0
}

/// Longest id accepted for a consumer, team or job.
pub const MAX_ID: usize = 128;

/// Whether `s` can be a consumer, team or job id: 1-128 of `A-Z a-z 0-9 - _ . : @ /`.
pub fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID
        && s.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'@' | b'/')
        })
}

/// Who a counter belongs to (SPEC §4 "Scopes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Request,
    Job,
    Consumer,
    /// The team a virtual key names (SPEC §4): counted beside the consumer's own bounds.
    Team,
    Backend,
    Model,
    Global,
}

impl Scope {
    pub const ALL: [Scope; 7] = [
        Scope::Request,
        Scope::Job,
        Scope::Consumer,
        Scope::Team,
        Scope::Backend,
        Scope::Model,
        Scope::Global,
    ];

    /// The inverse of [`Scope::as_str`].
    pub fn parse(s: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|x| x.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Request => "request",
            Scope::Job => "job",
            Scope::Consumer => "consumer",
            Scope::Team => "team",
            Scope::Backend => "backend",
            Scope::Model => "model",
            Scope::Global => "global",
        }
    }

    /// Backend- and model-scoped bounds only make the chain entries they cover ineligible;
    /// every other scope decides for the whole request (SPEC §5).
    pub fn is_entry_scoped(self) -> bool {
        matches!(self, Scope::Backend | Scope::Model)
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A calendar window in `windows.timezone`, or none (request and job counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Window {
    Minute,
    Hour,
    Day,
    Month,
}

impl Window {
    pub const ALL: [Window; 4] = [Window::Minute, Window::Hour, Window::Day, Window::Month];

    /// The inverse of [`Window::as_str`].
    pub fn parse(s: &str) -> Option<Window> {
        Window::ALL.into_iter().find(|x| x.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Window::Minute => "minute",
            Window::Hour => "hour",
            Window::Day => "day",
            Window::Month => "month",
        }
    }
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The three dimensions every counter holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dim {
    Tokens = 0,
    Requests = 1,
    Usd = 2,
}

impl Dim {
    pub const ALL: [Dim; 3] = [Dim::Tokens, Dim::Requests, Dim::Usd];
    pub fn as_str(self) -> &'static str {
        match self {
            Dim::Tokens => "tokens",
            Dim::Requests => "requests",
            Dim::Usd => "usd",
        }
    }
}

/// An amount in all three dimensions (tokens, requests, micro-dollars).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Amount {
    pub tokens: u64,
    pub requests: u64,
    pub usd: Micros,
}

impl Amount {
    pub const ZERO: Amount = Amount {
        tokens: 0,
        requests: 0,
        usd: 0,
    };

    pub fn get(&self, d: Dim) -> u64 {
        match d {
            Dim::Tokens => self.tokens,
            Dim::Requests => self.requests,
            Dim::Usd => self.usd,
        }
    }

    pub fn as_array(&self) -> [u64; 3] {
        [self.tokens, self.requests, self.usd]
    }

    pub fn from_array(a: [u64; 3]) -> Self {
        Amount {
            tokens: a[0],
            requests: a[1],
            usd: a[2],
        }
    }
}

/// Milliseconds since the Unix epoch: the only notion of "now" the core knows.
pub type Millis = i64;
