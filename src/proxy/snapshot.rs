//! What the request path reads, built once per policy load: the policy plus everything
//! derived from it that needs the environment (upstream keys, virtual keys) or would be
//! wasteful to compute per request. Swapped whole, atomically, on reload.

use crate::policy::{self, Policy};
use crate::providers;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use std::fmt;
use std::sync::Arc;

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

#[derive(Debug)]
pub struct Snapshot {
    pub policy: Policy,
    /// Per backend index: the key from `api_key_env`, when set.
    pub keys: Vec<Option<Secret>>,
    /// Per backend index: the auth headers its provider wants (values marked sensitive).
    pub auth: Vec<Vec<(HeaderName, HeaderValue)>>,
    /// Virtual keys: (key bytes, consumer id).
    pub virtual_keys: Vec<(Secret, Arc<str>)>,
    pub version_header: HeaderValue,
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
        let mut virtual_keys = Vec::new();
        for vk in &policy.identity.virtual_keys {
            match std::env::var(&vk.key_env) {
                Ok(k) if !k.is_empty() => {
                    virtual_keys.push((Secret(Arc::from(k)), vk.consumer.clone()))
                }
                _ => {
                    tracing::warn!(consumer = %vk.consumer, env = %vk.key_env, "virtual key env is unset: that consumer cannot authenticate")
                }
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
        Ok(Snapshot {
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
