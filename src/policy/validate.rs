//! Turns a merged raw policy into the typed `Policy`, or into every reason it cannot be one.
//!
//! A policy is validated whole before it replaces the running one (SPEC §4), so this must
//! never substitute a default for an invalid value and carry on: each problem becomes an
//! error with its file, key path and line, checking continues to find the rest, and a policy
//! with any error is refused. Defaults apply only to keys that are absent.
//!
//! The checks live next to what they check: `sections` (the single-valued sections),
//! `backends` (backends and routes) and `bounds` (rate limits, quotas, budgets); this file
//! holds the order they run in and the helpers they share.

use super::bounds::Known;
use super::error::{PolicyError, PolicyErrors};
use super::raw::RawDuration;
use super::source::{Item, Merged, Source};
use super::types::*;
use crate::units::{usd_to_micros, Micros};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// Validates `m` (built from `sources`); `origin` becomes `Policy::source`.
pub(crate) fn validate(
    m: Merged,
    sources: &[Source],
    origin: &str,
) -> Result<Policy, PolicyErrors> {
    let mut v = V {
        sources,
        errs: Vec::new(),
    };
    let version = match &m.version {
        Some(at) if !at.v.0.trim().is_empty() => at.v.0.trim().to_owned(),
        Some(at) => v.err(at.file, "version", "must be a non-empty string"),
        None => v.err(
            0,
            "version",
            "is required (a string stamped on every decision)",
        ),
    };
    let server = v.server(&m);
    let identity = v.identity(&m);
    let estimate = v.estimate(&m);
    let windows = v.windows(&m);
    let backends: Vec<Backend> = m.backends.iter().map(|b| v.backend(b)).collect();
    v.unique(&m.backends, "backends", "id", "backend id", |b| {
        b.id.as_ref().map(|t| t.0.trim().to_owned())
    });
    let by_id: HashMap<&str, usize> = backends
        .iter()
        .enumerate()
        .rev()
        .map(|(i, b)| (&*b.id, i))
        .collect();
    let kinds: Vec<BackendKind> = backends.iter().map(|b| b.kind).collect();
    let routes: Vec<Route> = m
        .routes
        .iter()
        .map(|r| v.route(r, &by_id, &kinds))
        .collect();
    v.unique(&m.routes, "routes", "model", "route alias", |r| {
        r.model.as_ref().map(|t| t.0.trim().to_owned())
    });
    let models: HashSet<&str> = routes
        .iter()
        .flat_map(|r| r.chain.iter().map(|c| &*c.model))
        .collect();
    let known = Known {
        backends: &by_id,
        models: &models,
        people: super::bounds::People::of(&identity),
    };
    let mut bounds = Vec::new();
    for (list, class) in [
        (&m.rate_limits, BoundClass::RateLimit),
        (&m.quotas, BoundClass::Quota),
    ] {
        bounds.extend(list.iter().map(|l| v.limit(l, class, &known)));
    }
    bounds.extend(m.budgets.iter().map(|b| v.budget(b, &known)));
    v.unique_bound_names(&m);
    v.priced_where_budgeted(&m, &backends, &routes, &bounds);
    let (retry, fallback, degrade, defer) =
        (v.retry(&m), v.fallback(&m), v.degrade(&m), v.defer(&m));
    let (state, audit) = (v.state(&m), v.audit(&m));
    let alerts = v.alerts_cfg(&m);
    let telemetry = v.telemetry_cfg(&m);
    // A shared hold must outlive the call it covers, or other replicas could spend it twice.
    if state.backend == StateBackend::Redis {
        if let Some((i, b)) = backends
            .iter()
            .enumerate()
            .max_by_key(|(_, b)| b.timeouts.total)
        {
            if state.lease <= b.timeouts.total {
                let f = m.state.as_ref().map_or(0, |s| s.file);
                v.err::<()>(
                    f,
                    "state.lease",
                    format!(
                        "must be longer than the longest call (backends[{i}].timeouts.total = {:?}): a call must not outlive its hold",
                        b.timeouts.total
                    ),
                );
            }
        }
    }
    if !v.errs.is_empty() {
        return Err(PolicyErrors(v.errs));
    }
    let route_index = routes
        .iter()
        .enumerate()
        .map(|(i, r)| (r.model.to_string(), i))
        .collect();
    Ok(Policy {
        version: version.into(),
        source: origin.to_owned(),
        server,
        identity,
        estimate,
        windows,
        backends,
        routes,
        bounds,
        retry,
        fallback,
        degrade,
        defer,
        state,
        audit,
        alerts,
        telemetry,
        route_index,
    })
}

impl V<'_> {
    /// A dollar bound on a call to an entry without a price would count it as $0 (SPEC §10):
    /// an error, unless the backend is a local kind that costs nothing (`ollama`).
    fn priced_where_budgeted(
        &mut self,
        m: &Merged,
        backends: &[Backend],
        routes: &[Route],
        bounds: &[Bound],
    ) {
        let usd_bounds: Vec<&Bound> = bounds
            .iter()
            .filter(|b| b.hard.usd.is_some() || b.soft.usd.is_some())
            .collect();
        if usd_bounds.is_empty() {
            return;
        }
        for (ri, r) in routes.iter().enumerate() {
            for (ci, c) in r.chain.iter().enumerate() {
                let Some(b) = backends.get(c.backend) else {
                    continue;
                };
                let priced = c.price.is_some()
                    || m.backends
                        .get(c.backend)
                        .is_some_and(|raw| raw.v.price_per_1k.is_some());
                if priced || b.kind == BackendKind::Ollama {
                    continue;
                }
                let applies = usd_bounds.iter().find(|u| match u.scope {
                    crate::units::Scope::Backend => u.matcher.matches(&b.id),
                    crate::units::Scope::Model => u.matcher.matches(&c.model),
                    _ => true,
                });
                if let Some(u) = applies {
                    let (f, at) = m.routes.get(ri).map_or((0, ri), |i| (i.file, i.index));
                    let msg = format!(
                        "no price for backend `{}` (model `{}`), but the dollar bound `{}` applies to it: give the backend or this entry a price_per_1k (`{{input: 0, output: 0}}` if it is free), or the call would count as $0",
                        b.id, c.model, u.name
                    );
                    self.err::<()>(f, format!("routes[{at}].chain[{ci}]"), msg);
                }
            }
        }
    }
}

/// The validator: where errors point, and the errors found so far.
pub(super) struct V<'a> {
    pub(super) sources: &'a [Source],
    pub(super) errs: Vec<PolicyError>,
}

impl V<'_> {
    /// Records an error and returns a placeholder so checking can go on.
    pub(super) fn err<T: Default>(
        &mut self,
        file: usize,
        path: impl AsRef<str>,
        msg: impl Into<String>,
    ) -> T {
        let e = match self.sources.get(file) {
            Some(s) => s.error(path.as_ref(), msg),
            None => PolicyError::new("<policy>", None, path.as_ref(), msg),
        };
        self.errs.push(e);
        T::default()
    }

    pub(super) fn nonzero<T: Copy + Default + PartialEq>(
        &mut self,
        file: usize,
        path: String,
        v: Option<&T>,
        default: T,
    ) -> T {
        match v {
            Some(x) if *x == T::default() => self.err(file, path, "must be greater than zero"),
            Some(x) => *x,
            None => default,
        }
    }

    pub(super) fn dur(
        &mut self,
        file: usize,
        path: String,
        v: Option<&RawDuration>,
        default: Duration,
        nonzero: bool,
    ) -> Duration {
        match v {
            Some(d) if nonzero && d.0.is_zero() => self.err(file, path, "must be longer than zero"),
            Some(d) => d.0,
            None => default,
        }
    }

    pub(super) fn usd(&mut self, file: usize, path: String, v: f64, positive: bool) -> Micros {
        if !v.is_finite() || v < 0.0 {
            return self.err(file, path, format!("{v} is not a valid amount in USD"));
        }
        let m = usd_to_micros(v);
        if positive && m == 0 {
            return self.err(file, path, "must be at least one micro-dollar (0.000001)");
        }
        m
    }

    /// A required non-empty string.
    pub(super) fn required(&mut self, file: usize, path: String, v: Option<&str>) -> String {
        match v.map(str::trim) {
            Some(s) if !s.is_empty() => s.to_owned(),
            Some(_) => self.err(file, path, "must not be empty"),
            None => self.err(file, path, "is required"),
        }
    }

    /// One of a fixed set of names; `None` (and an error) otherwise.
    pub(super) fn one_of<T: Copy>(
        &mut self,
        file: usize,
        path: &str,
        v: &str,
        opts: &[(&str, T)],
    ) -> Option<T> {
        let found = opts.iter().find(|(n, _)| *n == v.trim()).map(|(_, t)| *t);
        if found.is_none() {
            let names: Vec<&str> = opts.iter().map(|(n, _)| *n).collect();
            self.err::<()>(
                file,
                path,
                format!("unknown value `{v}`: expected one of {}", names.join(", ")),
            );
        }
        found
    }

    pub(super) fn unique<T>(
        &mut self,
        items: &[Item<T>],
        list: &str,
        key: &str,
        what: &str,
        get: impl Fn(&T) -> Option<String>,
    ) {
        let mut seen: HashMap<String, (usize, String)> = HashMap::new();
        for it in items {
            let Some(name) = get(&it.v).filter(|n| !n.is_empty()) else {
                continue;
            };
            let path = format!("{list}[{}].{key}", it.index);
            if let Some((file, first)) = seen.get(&name) {
                let at = self.sources[*file].place(first);
                self.err::<()>(
                    it.file,
                    &path,
                    format!("duplicate {what} `{name}` (first at {at})"),
                );
            } else {
                seen.insert(name, (it.file, path));
            }
        }
    }
}
