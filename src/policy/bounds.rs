//! Validation of rate limits, quotas and budgets into one list of `Bound`s: scope, match,
//! window (none for request and job scopes, required for all others) and limits.

use super::raw::*;
use super::source::{Item, Merged};
use super::types::*;
use super::validate::V;
use crate::units::{Scope, Window};
use std::collections::{HashMap, HashSet};

/// Pattern syntax other than `*` that `match` refuses rather than read as a literal.
const GLOB_RESERVED: &[char] = &[
    '?', '[', ']', '{', '}', '(', ')', '+', '^', '$', '|', '\\', '!',
];

/// What bound `match`es may refer to.
pub(super) struct Known<'a> {
    pub(super) backends: &'a HashMap<&'a str, usize>,
    pub(super) models: &'a HashSet<&'a str>,
    /// The consumers and teams the virtual keys name, sorted; `None` without keys (ids then
    /// come from headers, so any id may turn up).
    pub(super) people: Option<People<'a>>,
}

/// The consumers and teams virtual keys name.
pub(super) struct People<'a> {
    pub(super) consumers: Vec<&'a str>,
    pub(super) teams: Vec<&'a str>,
}

impl<'a> People<'a> {
    pub(super) fn of(identity: &'a IdentityCfg) -> Option<People<'a>> {
        if identity.virtual_keys.is_empty() {
            return None;
        }
        let mut consumers: Vec<&str> = identity.virtual_keys.iter().map(|k| &*k.consumer).collect();
        // An unkeyed request (require_key: false) is the default consumer's.
        if !identity.require_key {
            consumers.push(&identity.default_consumer);
        }
        let mut teams: Vec<&str> = identity
            .virtual_keys
            .iter()
            .filter_map(|k| k.team.as_deref())
            .collect();
        for v in [&mut consumers, &mut teams] {
            v.sort_unstable();
            v.dedup();
        }
        Some(People { consumers, teams })
    }

    /// A message when `m` on a `scope` bound names nobody a key names, else `None`.
    fn nobody(&self, scope: Scope, m: &Match) -> Option<String> {
        let (what, known) = match scope {
            Scope::Consumer => ("consumer", &self.consumers),
            Scope::Team => ("team", &self.teams),
            _ => return None,
        };
        if known.iter().any(|id| m.matches(id)) {
            return None;
        }
        let list = if known.is_empty() {
            "none".to_string()
        } else {
            known
                .iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        Some(format!(
            "`{}` names no {what} of the virtual keys, so this bound would apply to nobody; the keys' {what}s: {list}",
            m.as_str()
        ))
    }
}

/// The keys every bound has, borrowed from a `RawLimit` or `RawBudget`.
struct Head<'a> {
    name: &'a Option<Text>,
    scope: &'a Option<String>,
    matcher: &'a Option<Text>,
    window: &'a Option<String>,
}

impl V<'_> {
    pub(super) fn unique_bound_names(&mut self, m: &Merged) {
        let mut seen: HashMap<String, String> = HashMap::new();
        let names = m
            .rate_limits
            .iter()
            .map(|i| (i.file, format!("rate_limits[{}]", i.index), &i.v.name));
        let names = names.chain(
            m.quotas
                .iter()
                .map(|i| (i.file, format!("quotas[{}]", i.index), &i.v.name)),
        );
        let budgets = m
            .budgets
            .iter()
            .map(|i| (i.file, format!("budgets[{}]", i.index), &i.v.name));
        for (file, path, name) in names.chain(budgets) {
            let Some(name) = name.as_ref().map(|t| t.0.trim().to_owned()) else {
                continue;
            };
            let path = format!("{path}.name");
            if let Some(first) = seen.get(&name) {
                let msg = format!("duplicate bound name `{name}` (first at {first})");
                self.err::<()>(file, &path, msg);
            } else {
                seen.insert(name, self.sources[file].place(&path));
            }
        }
    }

    /// Name, scope, match and window, shared by all three kinds of bound.
    fn head(
        &mut self,
        f: usize,
        path: &str,
        h: Head<'_>,
        known: &Known,
    ) -> (String, Scope, Match, Option<Window>) {
        let p = |k: &str| format!("{path}.{k}");
        let name = self.required(f, p("name"), h.name.as_ref().map(|t| t.0.as_str()));
        let scope = match h.scope {
            Some(s) => self.one_of(f, &p("scope"), s, &Scope::ALL.map(|x| (x.as_str(), x))),
            None => self.err(
                f,
                p("scope"),
                "is required (request, job, consumer, team, backend, model or global)",
            ),
        };
        let pattern = h.matcher.as_ref().map_or(MATCH_ANY, |t| t.0.trim());
        let matcher = match pattern {
            "" => {
                self.err::<()>(
                    f,
                    p("match"),
                    "must be an id, \"*\" or a glob like \"team-*\"",
                );
                Match::Any
            }
            MATCH_ANY => Match::Any,
            pat if pat.contains(|c: char| GLOB_RESERVED.contains(&c)) => {
                let msg = format!(
                    "`{pat}`: only `*` is a wildcard in match; `?`, `[`, `{{`, regex and other pattern syntax is not supported"
                );
                self.err::<()>(f, p("match"), msg);
                Match::Any
            }
            pat if pat.contains('*') => {
                let m = Match::Glob(pat.into());
                self.names_somebody(f, &p("match"), scope, &m, known);
                m
            }
            id => {
                self.names_somebody(f, &p("match"), scope, &Match::Id(id.into()), known);
                if scope == Some(Scope::Backend) && !known.backends.contains_key(id) {
                    self.err::<()>(
                        f,
                        p("match"),
                        super::backends::no_backend(id, known.backends),
                    );
                } else if scope == Some(Scope::Model) && !known.models.contains(id) {
                    self.err::<()>(
                        f,
                        p("match"),
                        format!("no route chain uses the model `{id}`"),
                    );
                }
                Match::Id(id.into())
            }
        };
        let window = match (h.window, scope) {
            (_, None) => None,
            (Some(_), Some(s @ (Scope::Request | Scope::Job))) => self.err(f, p("window"), format!("a {s}-scoped bound has no window: its counter lives as long as the job")),
            (None, Some(Scope::Request | Scope::Job)) => None,
            (None, Some(s)) => self.err(f, p("window"), format!("a {s}-scoped bound needs a window (minute, hour, day or month); only request and job bounds have none")),
            (Some(w), Some(_)) => self.one_of(f, &p("window"), w, &Window::ALL.map(|x| (x.as_str(), x))),
        };
        (name, scope.unwrap_or(Scope::Global), matcher, window)
    }

    /// A `match` on a consumer or team bound must name an id a virtual key names (SPEC §10):
    /// a typo must not make a budget apply to nobody.
    fn names_somebody(
        &mut self,
        f: usize,
        path: &str,
        scope: Option<Scope>,
        m: &Match,
        known: &Known,
    ) {
        let (Some(scope), Some(people)) = (scope, &known.people) else {
            return;
        };
        if let Some(msg) = people.nobody(scope, m) {
            self.err::<()>(f, path, msg);
        }
    }

    pub(super) fn alerts(&mut self, f: usize, path: String, v: &Option<Vec<f64>>) -> Vec<f64> {
        let mut out = Vec::new();
        for &a in v.iter().flatten() {
            if a.is_finite() && a > 0.0 && a <= 1.0 {
                out.push(a);
            } else {
                self.err::<()>(f, &path, format!("{a} is not a fraction in (0, 1]"));
            }
        }
        out.sort_by(f64::total_cmp);
        out.dedup();
        out
    }

    /// `enforce`: `hard` (the default) or `shadow`.
    fn enforce(&mut self, f: usize, path: String, v: &Option<String>) -> Enforce {
        match v {
            None => Enforce::Hard,
            Some(s) => self
                .one_of(f, &path, s, &Enforce::ALL.map(|e| (e.as_str(), e)))
                .unwrap_or_default(),
        }
    }

    pub(super) fn limit(&mut self, it: &Item<RawLimit>, class: BoundClass, known: &Known) -> Bound {
        let (f, l) = (it.file, &it.v);
        let path = format!(
            "{}[{}]",
            if class == BoundClass::Quota {
                "quotas"
            } else {
                "rate_limits"
            },
            it.index
        );
        let (name, scope, matcher, window) = self.head(
            f,
            &path,
            Head {
                name: &l.name,
                scope: &l.scope,
                matcher: &l.matcher,
                window: &l.window,
            },
            known,
        );
        let p = |k: &str| format!("{path}.{k}");
        let hard = Limits {
            tokens: l
                .limit_tokens
                .map(|n| self.nonzero(f, p("limit_tokens"), Some(&n), n)),
            requests: l
                .limit_requests
                .map(|n| self.nonzero(f, p("limit_requests"), Some(&n), n)),
            usd: l.limit_usd.map(|u| self.usd(f, p("limit_usd"), u, true)),
        };
        if hard.is_empty() {
            self.err::<()>(
                f,
                &path,
                "needs at least one of limit_tokens, limit_requests, limit_usd",
            );
        }
        let alert_at = self.alerts(f, p("alert_at"), &l.alert_at);
        let enforce = self.enforce(f, p("enforce"), &l.enforce);
        Bound {
            name: name.into(),
            class,
            scope,
            matcher,
            window,
            hard,
            soft: Limits::default(),
            alert_at,
            enforce,
        }
    }

    pub(super) fn budget(&mut self, it: &Item<RawBudget>, known: &Known) -> Bound {
        let (f, b) = (it.file, &it.v);
        let path = format!("budgets[{}]", it.index);
        let (name, scope, matcher, window) = self.head(
            f,
            &path,
            Head {
                name: &b.name,
                scope: &b.scope,
                matcher: &b.matcher,
                window: &b.window,
            },
            known,
        );
        let p = |k: &str| format!("{path}.{k}");
        let count =
            |v: &mut Self, key: &str, n: Option<u64>| n.map(|n| v.nonzero(f, p(key), Some(&n), n));
        let hard = Limits {
            tokens: count(self, "hard_tokens", b.hard_tokens),
            requests: count(self, "hard_requests", b.hard_requests),
            usd: b.hard_usd.map(|u| self.usd(f, p("hard_usd"), u, true)),
        };
        let soft = Limits {
            tokens: count(self, "soft_tokens", b.soft_tokens),
            requests: count(self, "soft_requests", b.soft_requests),
            usd: b.soft_usd.map(|u| self.usd(f, p("soft_usd"), u, true)),
        };
        if hard.is_empty() {
            self.err::<()>(
                f,
                &path,
                "needs at least one hard limit (hard_tokens, hard_requests or hard_usd)",
            );
        }
        for (dim, h, s) in [
            ("tokens", hard.tokens, soft.tokens),
            ("requests", hard.requests, soft.requests),
            ("usd", hard.usd, soft.usd),
        ] {
            if let (Some(h), Some(s)) = (h, s) {
                if s > h {
                    self.err::<()>(
                        f,
                        p(&format!("soft_{dim}")),
                        format!("soft_{dim} must not exceed hard_{dim}"),
                    );
                }
            }
        }
        let alert_at = self.alerts(f, p("alert_at"), &b.alert_at);
        let enforce = self.enforce(f, p("enforce"), &b.enforce);
        Bound {
            name: name.into(),
            class: BoundClass::Budget,
            scope,
            matcher,
            window,
            hard,
            soft,
            alert_at,
            enforce,
        }
    }
}
