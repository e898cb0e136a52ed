//! Validation of the identity section: headers, the default consumer, `require_key` and the
//! virtual keys (consumer, team, and exactly one of `key_env` / `key_sha256`).

use super::raw::*;
use super::source::{At, Item, Merged};
use super::types::*;
use super::validate::V;
use std::sync::Arc;

impl V<'_> {
    pub(super) fn header(&mut self, at: Option<&At<String>>, key: &str, default: &str) -> String {
        let Some(at) = at else {
            return default.to_owned();
        };
        let h = at.v.trim();
        let tchar = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        if h.is_empty() || !h.chars().all(tchar) {
            return self.err(
                at.file,
                format!("identity.{key}"),
                format!("`{h}` is not a valid HTTP header name"),
            );
        }
        h.to_ascii_lowercase()
    }

    pub(super) fn identity(&mut self, m: &Merged) -> IdentityCfg {
        let consumer_header = self.header(
            m.consumer_header.as_ref(),
            "consumer_header",
            DEFAULT_CONSUMER_HEADER,
        );
        let job_header = self.header(m.job_header.as_ref(), "job_header", DEFAULT_JOB_HEADER);
        if job_header == consumer_header && !job_header.is_empty() {
            let file = m
                .job_header
                .as_ref()
                .or(m.consumer_header.as_ref())
                .map_or(0, |a| a.file);
            let msg = "must differ from identity.consumer_header";
            self.err::<()>(file, "identity.job_header", msg);
        }
        let default_consumer = match &m.default_consumer {
            Some(at) => self.required(at.file, "identity.default_consumer".into(), Some(&at.v.0)),
            None => DEFAULT_CONSUMER.to_owned(),
        };
        let virtual_keys: Vec<VirtualKey> =
            m.virtual_keys.iter().map(|k| self.virtual_key(k)).collect();
        self.unique(
            &m.virtual_keys,
            "identity.virtual_keys",
            "key_env",
            "virtual key env",
            |k| k.key_env.as_ref().map(|s| s.trim().to_owned()),
        );
        self.unique(
            &m.virtual_keys,
            "identity.virtual_keys",
            "key_sha256",
            "virtual key digest",
            |k| k.key_sha256.as_ref().map(|s| s.trim().to_ascii_lowercase()),
        );
        // Once keys exist, a request without one is refused unless the policy says otherwise.
        let require_key = match &m.require_key {
            Some(at) => at.v,
            None => !virtual_keys.is_empty(),
        };
        IdentityCfg {
            consumer_header,
            job_header,
            default_consumer: default_consumer.into(),
            require_key,
            virtual_keys,
        }
    }

    fn virtual_key(&mut self, k: &Item<RawVirtualKey>) -> VirtualKey {
        let p = |f: &str| format!("identity.virtual_keys[{}].{f}", k.index);
        let consumer = self.required(
            k.file,
            p("consumer"),
            k.v.consumer.as_ref().map(|t| t.0.as_str()),
        );
        self.key_id(k.file, p("consumer"), &consumer);
        let team = k.v.team.as_ref().map(|t| {
            let team = self.required(k.file, p("team"), Some(t.0.as_str()));
            self.key_id(k.file, p("team"), &team);
            Arc::<str>::from(team)
        });
        let secret = match (&k.v.key_env, &k.v.key_sha256) {
            (Some(env), None) => {
                KeySource::Env(self.required(k.file, p("key_env"), Some(env.as_str())))
            }
            (None, Some(hex)) => match parse_sha256(hex.trim()) {
                Some(d) => KeySource::Sha256(d),
                None => self.err(
                    k.file,
                    p("key_sha256"),
                    "must be the SHA-256 digest of the key as 64 hex digits",
                ),
            },
            (Some(_), Some(_)) => self.err(
                k.file,
                p("key_sha256"),
                "give key_env or key_sha256, not both",
            ),
            (None, None) => self.err(
                k.file,
                p("key_env"),
                "is required (or key_sha256: the key's SHA-256 digest in hex)",
            ),
        };
        VirtualKey {
            consumer: consumer.into(),
            team,
            secret,
        }
    }

    /// Consumer and team ids of a key: the same alphabet as ids from headers.
    fn key_id(&mut self, file: usize, path: String, id: &str) {
        if !id.is_empty() && !crate::units::valid_id(id) {
            self.err::<()>(
                file,
                path,
                format!("`{id}` is not a valid id (1-128 of A-Z a-z 0-9 - _ . : @ /)"),
            );
        }
    }
}

/// 64 hex digits (either case) to 32 bytes.
fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let b = hex.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let nib = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = nib(b[2 * i])? << 4 | nib(b[2 * i + 1])?;
    }
    Some(out)
}

#[cfg(test)]
#[path = "identity_tests.rs"]
mod tests;
