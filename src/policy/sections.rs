//! Validation of the single-valued sections: server, estimate, windows, retry,
//! fallback, degrade, defer, state and audit. Absent keys take the defaults of `raw`.

use super::raw::*;
use super::source::Merged;
use super::types::*;
use super::validate::V;
use std::collections::HashSet;
use std::time::Duration;

/// Reads `$opt` from an optional section `$sec`.
macro_rules! get {
    ($sec:expr, $field:ident) => {
        $sec.as_ref().and_then(|s| s.v.$field.as_ref())
    };
}

impl V<'_> {
    pub(super) fn server(&mut self, m: &Merged) -> ServerCfg {
        let f = m.server.as_ref().map_or(0, |s| s.file);
        let listen = |v: &mut Self, key: &str, val: Option<&String>, default: &str| {
            let s = val.map_or(default, |s| s.as_str()).trim().to_owned();
            let ok = s
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
            if !ok {
                v.err::<()>(
                    f,
                    format!("server.{key}"),
                    format!("`{s}` is not a host:port address"),
                );
            }
            s
        };
        ServerCfg {
            listen: listen(self, "listen", get!(m.server, listen), DEFAULT_LISTEN),
            admin_listen: listen(
                self,
                "admin_listen",
                get!(m.server, admin_listen),
                DEFAULT_ADMIN_LISTEN,
            ),
            max_body_bytes: self.nonzero(
                f,
                "server.max_body_bytes".into(),
                get!(m.server, max_body_bytes),
                DEFAULT_MAX_BODY_BYTES,
            ),
            header_read_timeout: self.dur(
                f,
                "server.header_read_timeout".into(),
                get!(m.server, header_read_timeout),
                DEFAULT_HEADER_READ_TIMEOUT,
                true,
            ),
            shutdown_grace: self.dur(
                f,
                "server.shutdown_grace".into(),
                get!(m.server, shutdown_grace),
                DEFAULT_SHUTDOWN_GRACE,
                false,
            ),
            max_connections: self.nonzero(
                f,
                "server.max_connections".into(),
                get!(m.server, max_connections),
                DEFAULT_MAX_CONNECTIONS,
            ),
        }
    }

    pub(super) fn estimate(&mut self, m: &Merged) -> EstimateCfg {
        let f = m.estimate.as_ref().map_or(0, |s| s.file);
        let name = get!(m.estimate, tokenizer).map_or(DEFAULT_TOKENIZER, |s| s.as_str());
        let opts = [
            ("o200k", Tokenizer::O200k),
            ("cl100k", Tokenizer::Cl100k),
            ("chars", Tokenizer::Chars),
        ];
        EstimateCfg {
            tokenizer: self
                .one_of(f, "estimate.tokenizer", name, &opts)
                .unwrap_or(Tokenizer::O200k),
            default_max_output_tokens: self.nonzero(
                f,
                "estimate.default_max_output_tokens".into(),
                get!(m.estimate, default_max_output_tokens),
                DEFAULT_MAX_OUTPUT_TOKENS,
            ),
        }
    }

    pub(super) fn windows(&mut self, m: &Merged) -> WindowsCfg {
        let f = m.windows.as_ref().map_or(0, |s| s.file);
        let name = get!(m.windows, timezone)
            .map_or(DEFAULT_TIMEZONE, |s| s.as_str())
            .trim()
            .to_owned();
        let timezone = match jiff::tz::TimeZone::get(&name) {
            Ok(tz) => tz,
            Err(_) => {
                self.err::<()>(
                    f,
                    "windows.timezone",
                    format!("unknown IANA time zone `{name}`"),
                );
                jiff::tz::TimeZone::UTC
            }
        };
        WindowsCfg {
            timezone_name: name,
            timezone,
        }
    }

    pub(super) fn retry(&mut self, m: &Merged) -> RetryCfg {
        let f = m.retry.as_ref().map_or(0, |s| s.file);
        let mut retry_on: Vec<RetryOn> = match get!(m.retry, retry_on) {
            Some(list) => list.iter().map(|r| r.0).collect(),
            None => DEFAULT_RETRY_ON.to_vec(),
        };
        let mut seen = HashSet::new();
        retry_on.retain(|r| seen.insert(*r));
        RetryCfg {
            max_attempts_per_job: self.nonzero(
                f,
                "retry.max_attempts_per_job".into(),
                get!(m.retry, max_attempts_per_job),
                DEFAULT_MAX_ATTEMPTS_PER_JOB,
            ),
            same_backend_retries: get!(m.retry, same_backend_retries)
                .copied()
                .unwrap_or(DEFAULT_SAME_BACKEND_RETRIES),
            retry_on,
            backoff_initial: self.dur(
                f,
                "retry.backoff.initial".into(),
                get!(m.retry, backoff).and_then(|b| b.initial.as_ref()),
                DEFAULT_BACKOFF_INITIAL,
                false,
            ),
            backoff_max: self.dur(
                f,
                "retry.backoff.max".into(),
                get!(m.retry, backoff).and_then(|b| b.max.as_ref()),
                DEFAULT_BACKOFF_MAX,
                false,
            ),
            max_retry_after: self.dur(
                f,
                "retry.max_retry_after".into(),
                get!(m.retry, max_retry_after),
                DEFAULT_MAX_RETRY_AFTER,
                false,
            ),
        }
    }

    pub(super) fn fallback(&mut self, m: &Merged) -> FallbackCfg {
        let f = m.fallback.as_ref().map_or(0, |s| s.file);
        let max_amplification = match get!(m.fallback, max_amplification) {
            Some(&a) if !(a.is_finite() && a >= 1.0) => {
                self.err(f, "fallback.max_amplification", "must be at least 1.0")
            }
            Some(&a) => a,
            None => DEFAULT_MAX_AMPLIFICATION,
        };
        FallbackCfg {
            max_fallbacks_per_job: get!(m.fallback, max_fallbacks_per_job)
                .copied()
                .unwrap_or(DEFAULT_MAX_FALLBACKS_PER_JOB),
            max_amplification,
        }
    }

    pub(super) fn degrade(&mut self, m: &Merged) -> DegradeCfg {
        let f = m.degrade.as_ref().map_or(0, |s| s.file);
        let opt = |v: &mut Self, set: bool, key: &str, n: Option<&u32>| match (set, n) {
            (false, _) => None,
            (true, None) => v.err::<Option<u32>>(f, key, "is required"),
            (true, Some(n)) => Some(v.nonzero(f, key.into(), Some(n), *n)),
        };
        let clamp = get!(m.degrade, clamp_max_tokens);
        let soft = get!(m.degrade, on_soft_exceeded);
        DegradeCfg {
            clamp_min_output_tokens: opt(
                self,
                clamp.is_some(),
                "degrade.clamp_max_tokens.min_output_tokens",
                clamp.and_then(|c| c.min_output_tokens.as_ref()),
            ),
            soft_max_output_tokens: opt(
                self,
                soft.is_some(),
                "degrade.on_soft_exceeded.max_output_tokens",
                soft.and_then(|c| c.max_output_tokens.as_ref()),
            ),
        }
    }

    pub(super) fn defer(&mut self, m: &Merged) -> DeferCfg {
        let f = m.defer.as_ref().map_or(0, |s| s.file);
        DeferCfg {
            allowed: get!(m.defer, allowed)
                .copied()
                .unwrap_or(DEFAULT_DEFER_ALLOWED),
            max_retry_after: self.dur(
                f,
                "defer.max_retry_after".into(),
                get!(m.defer, max_retry_after),
                DEFAULT_DEFER_MAX_RETRY_AFTER,
                false,
            ),
        }
    }

    pub(super) fn state(&mut self, m: &Merged) -> StateCfg {
        let f = m.state.as_ref().map_or(0, |s| s.file);
        let name = get!(m.state, backend).map_or(DEFAULT_STATE_BACKEND, |s| s.as_str());
        let opts = [
            ("memory", StateBackend::Memory),
            ("sqlite", StateBackend::Sqlite),
            ("redis", StateBackend::Redis),
        ];
        let backend = self
            .one_of(f, "state.backend", name, &opts)
            .unwrap_or(StateBackend::Sqlite);
        let redis_url = get!(m.state, redis_url).map(|s| s.trim().to_owned());
        match (&redis_url, backend) {
            (None, StateBackend::Redis) => self.err::<()>(
                f,
                "state.redis_url",
                "is required when state.backend is redis",
            ),
            (Some(u), _) if !(u.starts_with("redis://") || u.starts_with("rediss://")) => {
                self.err::<()>(f, "state.redis_url", "must be a redis:// or rediss:// URL")
            }
            _ => (),
        }
        let redis_urls: Vec<String> = get!(m.state, redis_urls)
            .map(|v| v.iter().map(|s| s.trim().to_owned()).collect())
            .unwrap_or_default();
        if !redis_urls.is_empty() && redis_url.is_none() {
            self.err::<()>(
                f,
                "state.redis_urls",
                "needs state.redis_url (the extra seeds come after it)",
            );
        }
        if redis_urls.len() > 64 {
            self.err::<()>(f, "state.redis_urls", "must name at most 64 seed nodes");
        }
        for (i, u) in redis_urls.iter().enumerate() {
            if !(u.starts_with("redis://") || u.starts_with("rediss://")) {
                // Never echo the URL (it may hold a password).
                self.err::<()>(
                    f,
                    &format!("state.redis_urls[{i}]"),
                    "must be a redis:// or rediss:// URL",
                );
            }
        }
        let shards = self.nonzero(f, "state.shards".into(), get!(m.state, shards), 1);
        if shards > 64 {
            self.err::<()>(f, "state.shards", "must be at most 64");
        }
        let path = match get!(m.state, path) {
            Some(s) => self.required(f, "state.path".into(), Some(s)),
            None => DEFAULT_STATE_PATH.to_owned(),
        };
        let job_idle_ttl = self.dur(
            f,
            "state.job_idle_ttl".into(),
            get!(m.state, job_idle_ttl),
            DEFAULT_JOB_IDLE_TTL,
            true,
        );
        let ou = get!(m.state, on_unavailable).map_or(DEFAULT_STATE_ON_UNAVAILABLE, |s| s.as_str());
        let on_unavailable = self
            .one_of(
                f,
                "state.on_unavailable",
                ou,
                &[
                    ("deny", OnUnavailable::Deny),
                    ("local", OnUnavailable::Local),
                ],
            )
            .unwrap_or(OnUnavailable::Deny);
        let flush_interval = self.dur(
            f,
            "state.flush_interval".into(),
            get!(m.state, flush_interval),
            DEFAULT_STATE_FLUSH_INTERVAL,
            true,
        );
        if flush_interval > Duration::from_secs(60) {
            self.err::<()>(
                f,
                "state.flush_interval",
                "must be at most 60s (it bounds what a crash loses)",
            );
        }
        let lease = self.dur(
            f,
            "state.lease".into(),
            get!(m.state, lease),
            DEFAULT_STATE_LEASE,
            true,
        );
        if lease < Duration::from_secs(1) {
            self.err::<()>(
                f,
                "state.lease",
                "must be at least 1s (it must outlast a call)",
            );
        }
        let namespace = match get!(m.state, namespace) {
            Some(s) => {
                let n = self.required(f, "state.namespace".into(), Some(s));
                if n.contains(['{', '}']) || n.chars().any(char::is_whitespace) {
                    self.err::<()>(
                        f,
                        "state.namespace",
                        "must not contain braces or spaces (it is a Redis hash tag)",
                    );
                }
                n
            }
            None => DEFAULT_STATE_NAMESPACE.to_owned(),
        };
        let slices = get!(m.state, slices).copied().unwrap_or(false);
        if slices && backend != StateBackend::Redis {
            self.err::<()>(f, "state.slices", "needs state.backend: redis");
        }
        if slices && shards > 1 {
            // A slice lives in the counters' one hash tag; spread counters are not sliced yet.
            self.err::<()>(
                f,
                "state.slices",
                "cannot be combined with state.shards above 1 yet",
            );
        }
        StateCfg {
            slices,
            backend,
            path,
            redis_url,
            redis_urls,
            shards,
            job_idle_ttl,
            on_unavailable,
            flush_interval,
            lease,
            namespace,
        }
    }

    pub(super) fn audit(&mut self, m: &Merged) -> AuditCfg {
        let f = m.audit.as_ref().map_or(0, |s| s.file);
        let name = get!(m.audit, sink).map_or(DEFAULT_AUDIT_SINK, |s| s.as_str());
        let opts = [
            ("jsonl", AuditSink::Jsonl),
            ("sqlite", AuditSink::Sqlite),
            ("postgres", AuditSink::Postgres),
            ("off", AuditSink::Off),
        ];
        let sink = self
            .one_of(f, "audit.sink", name, &opts)
            .unwrap_or(AuditSink::Jsonl);
        let postgres_url = match get!(m.audit, postgres_url) {
            Some(s) => Some(self.required(f, "audit.postgres_url".into(), Some(s))),
            None if sink == AuditSink::Postgres => self.err(
                f,
                "audit.postgres_url",
                "is required when audit.sink is postgres",
            ),
            None => None,
        };
        let path = match get!(m.audit, path) {
            Some(s) => self.required(f, "audit.path".into(), Some(s)),
            None => DEFAULT_AUDIT_PATH.to_owned(),
        };
        let queue = self.nonzero(
            f,
            "audit.queue".into(),
            get!(m.audit, queue),
            DEFAULT_AUDIT_QUEUE,
        );
        let table = match get!(m.audit, table) {
            Some(t) if valid_table(t) => t.clone(),
            Some(t) => self.err(
                f,
                "audit.table",
                format!("`{t}` is not a plain SQL name (a letter or _, then letters, digits or _; at most 63)"),
            ),
            None => DEFAULT_AUDIT_TABLE.to_owned(),
        };
        let max_bytes = get!(m.audit, max_bytes)
            .copied()
            .unwrap_or(DEFAULT_AUDIT_MAX_BYTES);
        let keep = match get!(m.audit, keep) {
            Some(&k) if k > MAX_AUDIT_KEEP => self.err(
                f,
                "audit.keep",
                format!("{k} is more than {MAX_AUDIT_KEEP} rotated files"),
            ),
            Some(&k) => k,
            None => DEFAULT_AUDIT_KEEP,
        };
        let compress = get!(m.audit, compress).copied().unwrap_or(false);
        if path == "-" && sink != AuditSink::Jsonl {
            self.err::<()>(
                f,
                "audit.path",
                "`-` (standard output) is only for audit.sink: jsonl",
            );
        }
        let retention_days = match get!(m.audit, retention_days) {
            Some(&0) => self.err(f, "audit.retention_days", "must be greater than zero"),
            Some(&d) if d > MAX_RETENTION_DAYS => self.err(
                f,
                "audit.retention_days",
                format!("{d} is more than {MAX_RETENTION_DAYS} days"),
            ),
            Some(&d) if matches!(sink, AuditSink::Sqlite | AuditSink::Postgres) => Some(d),
            Some(_) => self.err(
                f,
                "audit.retention_days",
                "applies to the usage log only (audit.sink: sqlite or postgres); the JSONL \
                 audit is bounded by max_bytes and keep",
            ),
            None => None,
        };
        AuditCfg {
            sink,
            path,
            postgres_url,
            queue,
            table,
            max_bytes,
            keep,
            compress,
            retention_days,
        }
    }
}

/// `true` for a name that is safe to splice into SQL: `[A-Za-z_][A-Za-z0-9_]{0,62}` (the
/// audit and usage-log table names a policy may set).
pub fn valid_table(t: &str) -> bool {
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}
