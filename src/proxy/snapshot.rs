//! What the request path reads, built once per policy load: the policy plus everything
//! derived from it that needs the environment (upstream keys, virtual keys) or would be
//! wasteful to compute per request. Swapped whole, atomically, on reload.

use crate::policy::{self, KeySource, Policy};
use crate::providers;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use sha2::{Digest, Sha256};
use std::fmt;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// A secret read from the environment. Its `Debug` never shows it.
#[derive(Clone)]
pub struct Secret(Arc<str>);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Whom a virtual key identifies.
#[derive(Debug, Clone)]
pub struct KeyOwner {
    pub consumer: Arc<str>,
    pub team: Option<Arc<str>>,
}

/// The virtual keys of a policy: keys read from the environment and SHA-256 digests.
#[derive(Debug, Default)]
pub struct VirtualKeys {
    pub plain: Vec<(Secret, KeyOwner)>,
    pub hashed: Vec<([u8; 32], KeyOwner)>,
}

impl VirtualKeys {
    /// The owner of `key`. Every key and digest is compared in constant time, whatever
    /// matched, so timing says nothing about which key (or how much of one) was right.
    pub fn lookup(&self, key: &str) -> Option<&KeyOwner> {
        let mut found = None;
        for (secret, owner) in &self.plain {
            if bool::from(secret.expose().as_bytes().ct_eq(key.as_bytes())) {
                found = Some(owner);
            }
        }
        if !self.hashed.is_empty() {
            let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
            for (d, owner) in &self.hashed {
                if bool::from(d[..].ct_eq(&digest[..])) {
                    found = Some(owner);
                }
            }
        }
        found
    }
}

#[derive(Debug)]
pub struct Snapshot {
    pub policy: Policy,
    /// Per backend index: the key from `api_key_env`, when set.
    pub keys: Vec<Option<Secret>>,
    /// Per backend index: the auth headers its provider wants (values marked sensitive).
    pub auth: Vec<Vec<(HeaderName, HeaderValue)>>,
    /// Virtual keys, by secret or by digest.
    pub virtual_keys: VirtualKeys,
    pub version_header: HeaderValue,
    /// `identity.consumer_header` and `identity.job_header`, parsed once per load (`None`:
    /// not a header name, so never present).
    pub consumer_header: Option<HeaderName>,
    pub job_header: Option<HeaderName>,
    /// The `/v1/models` body.
    pub models_body: Bytes,
}

impl Snapshot {
    pub fn build(policy: Policy) -> Result<Snapshot, String> {
        let mut keys = Vec::with_capacity(policy.backends.len());
        let mut auth = Vec::with_capacity(policy.backends.len());
        for b in &policy.backends {
            let key = b
                .api_key_env
                .as_ref()
                .and_then(|name| std::env::var(name).ok())
                .filter(|k| !k.is_empty());
            let headers = match &key {
                Some(k) => providers::for_kind(b.kind)
                    .auth_headers(k)
                    .map_err(|e| format!("backend {}: api_key_env: {e}", b.id))?,
                None => Vec::new(),
            };
            if let (None, Some(env)) = (&key, &b.api_key_env) {
                // Once per backend and load (start, every reload): calls skip it silently.
                tracing::warn!(backend = %b.id, env = %env, "backend ineligible: key ${env} unset; its chain entries are skipped");
            }
            keys.push(key.map(|k| Secret(Arc::from(k))));
            auth.push(headers);
        }
        let mut virtual_keys = VirtualKeys::default();
        for vk in &policy.identity.virtual_keys {
            let owner = KeyOwner {
                consumer: vk.consumer.clone(),
                team: vk.team.clone(),
            };
            match &vk.secret {
                KeySource::Sha256(d) => virtual_keys.hashed.push((*d, owner)),
                KeySource::Env(env) => match std::env::var(env) {
                    Ok(k) if !k.is_empty() => {
                        virtual_keys.plain.push((Secret(Arc::from(k)), owner))
                    }
                    _ => {
                        tracing::warn!(consumer = %vk.consumer, env = %env, "virtual key env is unset: that consumer cannot authenticate")
                    }
                },
            }
        }
        let version_header = HeaderValue::from_str(&policy.version)
            .map_err(|_| "version: not a valid header value".to_string())?;
        let data: Vec<_> = policy
            .routes
            .iter()
            .map(|r| serde_json::json!({"id": &*r.model, "object": "model", "created": 0, "owned_by": "tollgate"}))
            .collect();
        let models_body =
            Bytes::from(serde_json::json!({"object": "list", "data": data}).to_string());
        let name = |n: &str| HeaderName::from_bytes(n.as_bytes()).ok();
        Ok(Snapshot {
            consumer_header: name(&policy.identity.consumer_header),
            job_header: name(&policy.identity.job_header),
            policy,
            keys,
            auth,
            virtual_keys,
            version_header,
            models_body,
        })
    }

    /// Whether the backend at `idx` can be called: its key, if it needs one, is set.
    pub fn eligible(&self, idx: usize) -> bool {
        let b = &self.policy.backends[idx];
        b.api_key_env.is_none() || self.keys[idx].is_some()
    }
}

/// Loads and prepares a snapshot from a policy path: every fallible step happens here.
pub fn load(path: &std::path::Path) -> Result<Snapshot, String> {
    let p = policy::load(path).map_err(|e| e.to_string())?;
    Snapshot::build(p)
}
