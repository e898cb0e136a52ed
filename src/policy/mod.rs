//! The policy: what an operator writes in YAML, checked whole and turned into one immutable,
//! typed snapshot (`Policy`) that the request path reads without further defaulting.
//!
//! Loading is all-or-nothing: a policy with any error is refused with every error, each
//! naming its file, line and key path, so the old policy stays in force on a bad reload. This
//! module reads files but never watches them, swaps snapshots or reads secrets: the values of
//! `api_key_env` variables are looked up only by name, by `backend_eligible`.

mod alerts;
mod backends;
mod bounds;
mod error;
mod identity;
mod locate;
mod raw;
mod sections;
mod source;
mod telemetry;
pub mod types;
mod validate;

#[cfg(test)]
mod tests;

pub use error::{PolicyError, PolicyErrors};
pub use raw::{parse_duration, DEFAULT_MAX_OPEN};
pub use sections::valid_table;
pub(crate) use source::policy_files;
pub use source::{read_policy_file, MAX_POLICY_FILE_BYTES};
pub use types::*;

use crate::units::Micros;
use serde::Deserialize;
use source::{Merged, Source};
use std::fmt::Write as _;
use std::path::Path;

/// Loads a policy file, or a directory of them (a Kubernetes ConfigMap mount): all visible
/// `*.yaml`/`*.yml` files sorted by name, list sections concatenated, other sections set once.
pub fn load(path: &Path) -> Result<Policy, PolicyErrors> {
    let sources = source::read_sources(path)?;
    build(&sources, &path.display().to_string())
}

/// Parses and validates policy text; `source_name` is used in errors and `Policy::source`.
pub fn from_str(src: &str, source_name: &str) -> Result<Policy, PolicyErrors> {
    let s = Source {
        name: source_name.to_owned(),
        text: Some(src.to_owned()),
        base: Vec::new(),
    };
    build(&[s], source_name)
}

/// Validates a policy already parsed as YAML, e.g. the inline `policy:` of a scenario file.
/// With `src_text` (the whole file the value came from), errors get line numbers; the
/// policy's place in it is guessed (a top-level `policy:` key unless the file is itself a
/// policy). Use `from_value_at` to give the place explicitly.
pub fn from_value(
    v: serde_norway::Value,
    source_name: &str,
    src_text: Option<&str>,
) -> Result<Policy, PolicyErrors> {
    let base = src_text.map(locate::guess_base).unwrap_or_default();
    from_value_in(v, source_name, src_text, base)
}

/// Like `from_value`, with the key path of the policy inside `src_text` given (`"policy"`,
/// `"cases[2].policy"`, or `""` for the root).
pub fn from_value_at(
    v: serde_norway::Value,
    source_name: &str,
    src_text: Option<&str>,
    base_path: &str,
) -> Result<Policy, PolicyErrors> {
    from_value_in(v, source_name, src_text, locate::parse_path(base_path))
}

fn from_value_in(
    v: serde_norway::Value,
    source_name: &str,
    src_text: Option<&str>,
    base: Vec<locate::Seg>,
) -> Result<Policy, PolicyErrors> {
    let src = Source {
        name: source_name.to_owned(),
        text: src_text.map(str::to_owned),
        base,
    };
    // Going through text again gives deserialization errors their key path (a `Value`
    // deserializer tracks none); the line then comes from `src_text`, not from this text.
    let parsed = match serde_norway::to_string(&v) {
        Ok(text) => serde_norway::from_str::<Option<raw::RawPolicy>>(&text),
        Err(_) => Option::<raw::RawPolicy>::deserialize(v),
    };
    let raw = parsed
        .map_err(|e| PolicyErrors::from(src.yaml_error(&e, false)))?
        .unwrap_or_default();
    let mut merged = Merged::default();
    let mut errs = Vec::new();
    let sources = [src];
    merged.add(0, raw, &sources, &mut errs);
    validate::validate(merged, &sources, source_name)
}

fn build(sources: &[Source], origin: &str) -> Result<Policy, PolicyErrors> {
    let mut merged = Merged::default();
    let mut errs = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        match source::parse_source(s) {
            Ok(raw) => merged.add(i, raw, sources, &mut errs),
            Err(e) => errs.push(e),
        }
    }
    // Validating after a file failed to parse would only add errors caused by its absence.
    if !errs.is_empty() {
        return Err(PolicyErrors(errs));
    }
    validate::validate(merged, sources, origin)
}

/// Whether a backend may be called at all: it needs no key, or its key variable is set and
/// non-empty. An ineligible backend is skipped, not an error (SPEC §4).
pub fn backend_eligible(b: &Backend) -> bool {
    match &b.api_key_env {
        None => true,
        Some(name) => std::env::var_os(name).is_some_and(|v| !v.is_empty()),
    }
}

/// Why a backend cannot be called (`key $X unset`), or `None` when it can: the same rule as
/// [`backend_eligible`], worded for `tollgate check`, the log and `/admin/status`.
pub fn ineligible_reason(b: &Backend) -> Option<String> {
    if backend_eligible(b) {
        return None;
    }
    b.api_key_env.as_deref().map(|k| format!("key ${k} unset"))
}

/// A short human-readable description of a policy, for `tollgate check` and the logs.
/// Names key variables and says whether they are set, but never prints their values (nor
/// URLs, which may hold passwords).
pub fn summary(p: &Policy) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "policy {} from {} (timezone {})",
        p.version, p.source, p.windows.timezone_name
    );
    let _ = writeln!(s, "backends:");
    for b in &p.backends {
        let key = b
            .api_key_env
            .as_deref()
            .map_or("none".to_owned(), |k| format!("${k}"));
        let _ = write!(
            s,
            "  {}: {} {} price {}/{} per 1k in/out, key {}",
            b.id,
            b.kind.as_str(),
            b.base_url,
            usd(b.price.input_per_1k),
            usd(b.price.output_per_1k),
            key
        );
        if b.token_ratio != 1.0 {
            let _ = write!(s, ", token_ratio {}", b.token_ratio);
        }
        if let Some(n) = b.max_in_flight {
            let _ = write!(s, ", max_in_flight {n}");
        }
        if b.responses_api {
            s.push_str(", responses_api");
        }
        if let Some(why) = ineligible_reason(b) {
            let _ = write!(s, " (ineligible: {why})");
        }
        s.push('\n');
    }
    identity_state_audit(&mut s, p);
    let _ = writeln!(s, "routes:");
    for r in &p.routes {
        let mut hops: Vec<String> = r
            .chain
            .iter()
            .map(|c| {
                format!(
                    "{}/{}",
                    p.backends.get(c.backend).map_or("?", |b| &*b.id),
                    c.model
                )
            })
            .collect();
        if r.static_response.is_some() {
            hops.push("static".to_owned());
        }
        let _ = writeln!(s, "  {}: {}", r.model, hops.join(" -> "));
    }
    let _ = writeln!(s, "limits:");
    for b in &p.bounds {
        let matcher = b.matcher.as_str();
        let window = b.window.map_or("none", |w| w.as_str());
        let _ = write!(
            s,
            "  {} {}: scope={} match={} window={}",
            b.class.as_str(),
            b.name,
            b.scope,
            matcher,
            window
        );
        let label = if b.class == BoundClass::Budget {
            " hard"
        } else {
            ""
        };
        limits(&mut s, label, &b.hard);
        if !b.soft.is_empty() {
            limits(&mut s, " soft", &b.soft);
        }
        if !b.alert_at.is_empty() {
            let a: Vec<String> = b.alert_at.iter().map(|f| f.to_string()).collect();
            let _ = write!(s, " alert_at=[{}]", a.join(","));
        }
        s.push('\n');
    }
    let _ = writeln!(
        s,
        "retry: {} attempts/job, {} same-backend; fallback: {}/job, amplification <= {}",
        p.retry.max_attempts_per_job,
        p.retry.same_backend_retries,
        p.fallback.max_fallbacks_per_job,
        p.fallback.max_amplification
    );
    s
}

/// The virtual keys whose `key_env` is unset or empty now: (consumer, variable name).
pub fn unset_key_envs(p: &Policy) -> Vec<(&str, &str)> {
    p.identity
        .virtual_keys
        .iter()
        .filter_map(|k| match &k.secret {
            types::KeySource::Env(env) => std::env::var_os(env)
                .is_none_or(|v| v.is_empty())
                .then_some((&*k.consumer, env.as_str())),
            types::KeySource::Sha256(_) => None,
        })
        .collect()
}

fn identity_state_audit(s: &mut String, p: &Policy) {
    let id = &p.identity;
    let _ = write!(
        s,
        "identity: consumer header {}, job header {}, default consumer {}",
        id.consumer_header, id.job_header, id.default_consumer
    );
    if id.virtual_keys.is_empty() {
        s.push_str(", no virtual keys\n");
    } else {
        let keys: Vec<String> = id
            .virtual_keys
            .iter()
            .map(|k| {
                let team = k
                    .team
                    .as_deref()
                    .map(|t| format!(" team {t}"))
                    .unwrap_or_default();
                match &k.secret {
                    types::KeySource::Env(v) => format!("{}{team} (${v})", k.consumer),
                    types::KeySource::Sha256(_) => format!("{}{team} (sha256)", k.consumer),
                }
            })
            .collect();
        let _ = writeln!(s, ", virtual keys: {}", keys.join(", "));
    }
    let st = &p.state;
    let _ = match st.backend {
        StateBackend::Memory => writeln!(s, "state: memory (counters lost on restart)"),
        StateBackend::Sqlite => writeln!(s, "state: sqlite {}", st.path),
        StateBackend::Redis => writeln!(s, "state: redis, namespace {}", st.namespace),
    };
    let a = &p.audit;
    let _ = match a.sink {
        AuditSink::Off => writeln!(s, "audit: off"),
        AuditSink::Jsonl => writeln!(s, "audit: jsonl {}", a.path),
        AuditSink::Sqlite => writeln!(s, "audit: sqlite {} table {}", st.path, a.table),
        AuditSink::Postgres => writeln!(s, "audit: postgres table {}", a.table),
    };
}

fn limits(s: &mut String, label: &str, l: &Limits) {
    s.push_str(label);
    if let Some(t) = l.tokens {
        let _ = write!(s, " tokens={t}");
    }
    if let Some(r) = l.requests {
        let _ = write!(s, " requests={r}");
    }
    if let Some(u) = l.usd {
        let _ = write!(s, " usd={}", usd(u));
    }
}

/// `$0.001` from micro-dollars, without float noise.
fn usd(m: Micros) -> String {
    let (whole, frac) = (m / 1_000_000, m % 1_000_000);
    if frac == 0 {
        format!("${whole}")
    } else {
        format!("${whole}.{}", format!("{frac:06}").trim_end_matches('0'))
    }
}
