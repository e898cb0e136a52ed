//! Validation of backends and routes: kinds, URLs, prices, timeouts, circuits, and route
//! chains whose every entry must name a defined backend.

use super::raw::*;
use super::source::Item;
use super::types::*;
use super::validate::V;
use std::collections::HashMap;
use std::sync::Arc;

impl V<'_> {
    pub(super) fn backend(&mut self, it: &Item<RawBackend>) -> Backend {
        let (f, b) = (it.file, &it.v);
        let p = |k: &str| format!("backends[{}].{k}", it.index);
        let id = self.required(f, p("id"), b.id.as_ref().map(|t| t.0.as_str()));
        let kind = match &b.kind {
            Some(k) => self.one_of(f, &p("kind"), k, &KINDS),
            None => self.err(
                f,
                p("kind"),
                "is required (openai, anthropic, gemini or ollama)",
            ),
        }
        .unwrap_or(BackendKind::Openai);
        let mut base_url = self.required(f, p("base_url"), b.base_url.as_deref());
        if !base_url.is_empty() {
            let host = base_url
                .strip_prefix("https://")
                .or_else(|| base_url.strip_prefix("http://"));
            let authority = host.map(|h| h.split(['/', '?', '#']).next().unwrap_or(""));
            if authority.is_some_and(|a| a.contains('@')) {
                // Never echoed: the part before `@` is a credential.
                self.err::<()>(
                    f,
                    p("base_url"),
                    "must not carry credentials (`user:password@host`): they would be sent to \
                     the upstream in clear and printed by `check`; put the key in api_key_env"
                        .to_string(),
                );
                base_url = String::new();
            } else if !host.is_some_and(|h| {
                !h.is_empty() && !h.starts_with('/') && !h.contains(char::is_whitespace)
            }) {
                self.err::<()>(
                    f,
                    p("base_url"),
                    format!("`{base_url}` must be an http:// or https:// URL"),
                );
            }
            base_url = base_url.trim_end_matches('/').to_owned();
        }
        let api_key_env = match b.api_key_env.as_deref().map(str::trim) {
            Some("") => self.err(
                f,
                p("api_key_env"),
                "must be an environment variable name or null",
            ),
            other => other.map(str::to_owned),
        };
        let token_ratio = match b.token_ratio {
            Some(r) if !(r.is_finite() && r > 0.0) => {
                self.err(f, p("token_ratio"), "must be greater than zero")
            }
            Some(r) => r,
            None => DEFAULT_TOKEN_RATIO,
        };
        let price = self.price(f, &p("price_per_1k"), b.price_per_1k.as_ref());
        let t = b.timeouts.as_ref();
        let timeouts = Timeouts {
            connect: self.dur(
                f,
                p("timeouts.connect"),
                t.and_then(|t| t.connect.as_ref()),
                DEFAULT_CONNECT_TIMEOUT,
                true,
            ),
            first_byte: self.dur(
                f,
                p("timeouts.first_byte"),
                t.and_then(|t| t.first_byte.as_ref()),
                DEFAULT_FIRST_BYTE_TIMEOUT,
                true,
            ),
            total: self.dur(
                f,
                p("timeouts.total"),
                t.and_then(|t| t.total.as_ref()),
                DEFAULT_TOTAL_TIMEOUT,
                true,
            ),
        };
        let c = b.circuit.as_ref();
        let circuit = CircuitCfg {
            failure_threshold: self.nonzero(
                f,
                p("circuit.failure_threshold"),
                c.and_then(|c| c.failure_threshold.as_ref()),
                DEFAULT_FAILURE_THRESHOLD,
            ),
            recovery_timeout: self.dur(
                f,
                p("circuit.recovery_timeout"),
                c.and_then(|c| c.recovery_timeout.as_ref()),
                DEFAULT_RECOVERY_TIMEOUT,
                true,
            ),
            half_open_max_calls: self.nonzero(
                f,
                p("circuit.half_open_max_calls"),
                c.and_then(|c| c.half_open_max_calls.as_ref()),
                DEFAULT_HALF_OPEN_MAX_CALLS,
            ),
            accept_retry_after: c
                .and_then(|c| c.accept_retry_after)
                .unwrap_or(DEFAULT_ACCEPT_RETRY_AFTER),
            max_open: self.dur(
                f,
                p("circuit.max_open"),
                c.and_then(|c| c.max_open.as_ref()),
                DEFAULT_MAX_OPEN,
                true,
            ),
        };
        if circuit.max_open < circuit.recovery_timeout {
            self.err::<()>(
                f,
                p("circuit.max_open"),
                "must not be shorter than circuit.recovery_timeout",
            );
        }
        let max_in_flight = b
            .max_in_flight
            .map(|n| self.nonzero(f, p("max_in_flight"), Some(&n), n));
        let responses_api = b.responses_api.unwrap_or(false);
        if responses_api && kind != BackendKind::Openai {
            self.err::<()>(
                f,
                p("responses_api"),
                format!(
                    "applies to `kind: openai` backends only (this one is `{}`)",
                    kind.as_str()
                ),
            );
        }
        Backend {
            id: id.into(),
            kind,
            base_url: base_url.into(),
            api_key_env,
            token_ratio,
            price,
            timeouts,
            circuit,
            max_in_flight,
            responses_api,
        }
    }

    /// A `price_per_1k` block: missing input/output cost nothing; missing cache rates are
    /// the input rate (so a policy written before them costs the same).
    fn price(&mut self, f: usize, at: &str, pr: Option<&RawPrice>) -> Price {
        let mut side =
            |v: Option<f64>, k: &str| v.map(|u| self.usd(f, format!("{at}.{k}"), u, false));
        let input = side(pr.and_then(|x| x.input), "input").unwrap_or(0);
        let output = side(pr.and_then(|x| x.output), "output").unwrap_or(0);
        let cached = side(pr.and_then(|x| x.cached_input), "cached_input").unwrap_or(input);
        let write = side(pr.and_then(|x| x.cache_write), "cache_write").unwrap_or(input);
        let mut price = Price {
            input_per_1k: input,
            output_per_1k: output,
            cached_input_per_1k: cached,
            cache_write_per_1k: write,
            tiers: [None; MAX_PRICE_TIERS],
        };
        let raw_tiers = pr.and_then(|x| x.tiers.as_deref()).unwrap_or_default();
        if raw_tiers.len() > MAX_PRICE_TIERS {
            let msg = format!("at most {MAX_PRICE_TIERS} tiers");
            self.err::<()>(f, format!("{at}.tiers"), msg);
        }
        let mut last = 0;
        for (i, t) in raw_tiers.iter().take(MAX_PRICE_TIERS).enumerate() {
            let tp = |k: &str| format!("{at}.tiers[{i}].{k}");
            let above = match t.above_input_tokens {
                Some(n) if n > last => n,
                Some(_) => self.err(
                    f,
                    tp("above_input_tokens"),
                    "must be above 0 and above the tier before it (tiers ascend)",
                ),
                None => self.err(
                    f,
                    tp("above_input_tokens"),
                    "is required: the input tokens above which this tier's prices apply",
                ),
            };
            last = above.max(last);
            // A side the tier does not give is the base's; cache rates default to the
            // tier's input, as in the base price.
            let mut side = |v: Option<f64>, k: &str| v.map(|u| self.usd(f, tp(k), u, false));
            let t_in = side(t.input, "input").unwrap_or(input);
            let t_out = side(t.output, "output").unwrap_or(output);
            let t_cached = side(t.cached_input, "cached_input").unwrap_or(t_in);
            let t_write = side(t.cache_write, "cache_write").unwrap_or(t_in);
            price.tiers[i] = Some(PriceTier {
                above_input_tokens: above,
                input_per_1k: t_in,
                output_per_1k: t_out,
                cached_input_per_1k: t_cached,
                cache_write_per_1k: t_write,
            });
        }
        price
    }

    pub(super) fn route(
        &mut self,
        it: &Item<RawRoute>,
        by_id: &HashMap<&str, usize>,
        kinds: &[BackendKind],
    ) -> Route {
        let (f, r) = (it.file, &it.v);
        let p = |k: &str| format!("routes[{}].{k}", it.index);
        let model = self.required(f, p("model"), r.model.as_ref().map(|t| t.0.as_str()));
        let raw_chain = r.chain.as_deref().unwrap_or_default();
        if raw_chain.is_empty() {
            self.err::<()>(
                f,
                p("chain"),
                "must list at least one {backend, model} entry",
            );
        }
        let mut chain: Vec<ChainEntry> = Vec::new();
        let mut seen: HashMap<(String, String), usize> = HashMap::new();
        for (i, e) in raw_chain.iter().enumerate() {
            let q = |k: &str| p(&format!("chain[{i}].{k}"));
            let bid = self.required(f, q("backend"), e.backend.as_ref().map(|t| t.0.as_str()));
            let m = self.required(f, q("model"), e.model.as_ref().map(|t| t.0.as_str()));
            let backend = match by_id.get(bid.as_str()) {
                Some(&b) => b,
                None if bid.is_empty() => 0,
                None => self.err(f, q("backend"), no_backend(&bid, by_id)),
            };
            let output_cap_field = e.output_cap_field.as_deref().and_then(|v| {
                let field = self.one_of(f, &q("output_cap_field"), v, &CAP_FIELDS);
                let kind = kinds.get(backend).copied();
                if field.is_some() && kind.is_some_and(|k| k != BackendKind::Openai) {
                    self.err::<()>(
                        f,
                        q("output_cap_field"),
                        format!(
                            "applies to `kind: openai` backends only (`{bid}` is `{}`)",
                            kind.map_or("?", |k| k.as_str())
                        ),
                    );
                }
                field
            });
            if let Some(first) = seen.insert((bid.clone(), m.clone()), i) {
                self.err::<()>(
                    f,
                    p(&format!("chain[{i}]")),
                    format!("duplicate chain entry {bid}/{m} (same as chain[{first}])"),
                );
            }
            let price = e
                .price_per_1k
                .as_ref()
                .map(|raw| self.price(f, &q("price_per_1k"), Some(raw)));
            chain.push(ChainEntry {
                backend,
                model: m.into(),
                price,
                output_cap_field,
            });
        }
        let static_response = match r.static_response.as_deref() {
            Some(s) if s.trim().is_empty() => self.err(
                f,
                p("static_response"),
                "must not be empty (omit it instead)",
            ),
            other => other.map(Arc::from),
        };
        if r.static_on_budget == Some(true) && r.static_response.is_none() {
            self.err::<()>(
                f,
                p("static_on_budget"),
                "needs a static_response to answer with",
            );
        }
        let default_max_output_tokens = r
            .default_max_output_tokens
            .map(|n| self.nonzero(f, p("default_max_output_tokens"), Some(&n), n));
        Route {
            model: model.into(),
            chain,
            static_response,
            static_on_budget: r.static_on_budget.unwrap_or(false),
            default_max_output_tokens,
        }
    }
}

const CAP_FIELDS: [(&str, OutputCapField); 2] = [
    ("max_tokens", OutputCapField::MaxTokens),
    ("max_completion_tokens", OutputCapField::MaxCompletionTokens),
];

/// `no backend with id `x`` plus the ids that exist, so a typo is spotted at once.
pub(super) fn no_backend(id: &str, by_id: &HashMap<&str, usize>) -> String {
    let mut ids: Vec<&str> = by_id.keys().copied().collect();
    ids.sort_unstable();
    if ids.is_empty() {
        format!("no backend with id `{id}` (no backends are defined)")
    } else {
        format!("no backend with id `{id}` (backends: {})", ids.join(", "))
    }
}

const KINDS: [(&str, BackendKind); 4] = [
    ("openai", BackendKind::Openai),
    ("anthropic", BackendKind::Anthropic),
    ("gemini", BackendKind::Gemini),
    ("ollama", BackendKind::Ollama),
];
