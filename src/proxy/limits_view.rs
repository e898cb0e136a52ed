//! `GET /tollgate/v1/limits` (SPEC §3.2): the caller's own view of every limit that applies
//! to it, read from the ledger's live counters. The caller is identified exactly as for a
//! governed request (its key when keys are configured), so nobody sees anyone else's counters.

use super::handler::App;
use super::identity::{self, IdentityError};
use super::respond::{self, full, Body, Refusal};
use super::snapshot::Snapshot;
use crate::governor::Record;
use crate::ledger::{job_key, CounterKey, WindowSet};
use crate::policy::{Bound, Policy};
use crate::units::{micros_to_usd, Amount, Dim, Scope};
use http::{HeaderMap, HeaderValue, Response};
use serde_json::{json, Value};
use std::sync::Arc;

pub const PATH: &str = "/tollgate/v1/limits";

/// Answers the limits view for the caller of `headers`.
pub fn answer(app: &App, snap: &Snapshot, headers: &HeaderMap) -> Response<Body> {
    let (consumer, team) = match identity::caller(headers, snap) {
        Ok(c) => c,
        Err(e) => return refused(snap, e),
    };
    let job = headers
        .get(snap.policy.identity.job_header.as_str())
        .and_then(|v| v.to_str().ok())
        .filter(|j| crate::units::valid_id(j));
    let policy = &snap.policy;
    let now = jiff::Timestamp::now().as_millisecond();
    let windows = app.governor.windows_at(&policy.windows, now);
    let caller = Caller {
        consumer: &consumer,
        team: team.as_ref(),
        job,
    };
    let mut limits = Vec::new();
    for b in &policy.bounds {
        for (shown, key) in counters_of(policy, b, &caller, &windows) {
            let counter = key.as_ref().and_then(|k| app.governor.ledger.get(k));
            let (used, reserved) = match &counter {
                Some(c) => (c.committed(), c.reserved()),
                None => (Amount::ZERO, Amount::ZERO),
            };
            let resets_at = b.window.map(|w| rfc3339(policy, windows.end(w)));
            for d in Dim::ALL {
                let (hard, soft) = (b.hard.as_array()[d as usize], b.soft.as_array()[d as usize]);
                if hard.is_none() && soft.is_none() {
                    continue;
                }
                let mut e = entry(b, &shown, d, used, reserved, hard, soft, &resets_at);
                let projection = key
                    .as_ref()
                    .zip(counter.as_deref())
                    .and_then(|kc| app.governor.forecast(policy, b, kc, d, now));
                forecast_fields(&mut e, policy, b, d, projection, now);
                limits.push(e);
            }
        }
    }
    let body = json!({"consumer": &*consumer, "team": team.as_deref(), "limits": limits});
    let mut r = Response::new(full(body.to_string()));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    r
}

struct Caller<'a> {
    consumer: &'a Arc<str>,
    team: Option<&'a Arc<str>>,
    job: Option<&'a str>,
}

/// The ids a bound has for this caller, each with its counter key (`None`: a counter that
/// only exists while a request runs, so nothing is used yet).
fn counters_of(
    policy: &Policy,
    b: &Bound,
    who: &Caller<'_>,
    windows: &WindowSet,
) -> Vec<(Option<Arc<str>>, Option<CounterKey>)> {
    let key = |id: Arc<str>| CounterKey {
        scope: b.scope,
        id,
        window: b.window.map(|w| windows.key(w)),
    };
    let one = |id: &Arc<str>| {
        if b.matcher.matches(id) {
            vec![(Some(id.clone()), Some(key(id.clone())))]
        } else {
            Vec::new()
        }
    };
    match b.scope {
        Scope::Request => vec![(None, None)],
        Scope::Job => match who.job {
            Some(j) if b.matcher.matches(j) => {
                vec![(Some(Arc::from(j)), Some(key(job_key(who.consumer, j))))]
            }
            Some(_) => Vec::new(),
            None => vec![(None, None)],
        },
        Scope::Consumer => one(who.consumer),
        Scope::Team => who.team.map(one).unwrap_or_default(),
        Scope::Global => vec![(Some(Arc::from("global")), Some(key(Arc::from("global"))))],
        Scope::Backend => policy.backends.iter().flat_map(|be| one(&be.id)).collect(),
        Scope::Model => {
            let mut models: Vec<&Arc<str>> = Vec::new();
            for c in policy.routes.iter().flat_map(|r| &r.chain) {
                if !models.contains(&&c.model) {
                    models.push(&c.model);
                }
            }
            models.into_iter().flat_map(one).collect()
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn entry(
    b: &Bound,
    id: &Option<Arc<str>>,
    d: Dim,
    used: Amount,
    reserved: Amount,
    hard: Option<u64>,
    soft: Option<u64>,
    resets_at: &Option<String>,
) -> Value {
    let (u, r) = (used.get(d), reserved.get(d));
    let remaining = hard.map(|h| h.saturating_sub(u.saturating_add(r)));
    let state = match (hard, soft) {
        (Some(h), _) if u >= h => "exhausted",
        (_, Some(s)) if u >= s => "soft_exceeded",
        _ => "ok",
    };
    let n = |v: u64| -> Value {
        match d {
            Dim::Usd => json!(micros_to_usd(v)),
            _ => json!(v),
        }
    };
    let of = hard.or(soft).unwrap_or(0);
    let text = match d {
        Dim::Usd => format!("{} of {} used", dollars(u), dollars(of)),
        _ => format!("{u} of {of} {} used", d.as_str()),
    };
    json!({
        "name": &*b.name,
        "kind": b.class.as_str(),
        "scope": b.scope.as_str(),
        "id": id.as_deref(),
        "match": b.matcher.as_str(),
        "window": b.window.map(|w| w.as_str()),
        "unit": d.as_str(),
        "used": n(u),
        "reserved": n(r),
        "limit": hard.map(n),
        "soft": soft.map(n),
        "remaining": remaining.map(n),
        "resets_at": resets_at,
        "state": state,
        "text": text,
    })
}

/// `enforce`, and for a windowed quota or budget its burn-rate forecast (SPEC §9): the
/// hourly burn over the trailing hour and day, and when, at the faster, the hard limit is hit
/// (`exhausts_at`, `projected_exhaustion_seconds`; null when the window turns first or
/// nothing burns).
pub fn forecast_fields(
    e: &mut Value,
    policy: &Policy,
    b: &Bound,
    d: Dim,
    p: Option<crate::governor::forecast::Projection>,
    now: i64,
) {
    let Some(o) = e.as_object_mut() else {
        return;
    };
    o.insert("enforce".into(), json!(b.enforce.as_str()));
    if !crate::governor::forecast::forecast_applies(b) || b.hard.get(d).is_none() {
        return;
    }
    let rate = |r: Option<f64>| match d {
        Dim::Usd => json!(r.map(|r| r / 1e6)),
        _ => json!(r),
    };
    let p = p.unwrap_or(crate::governor::forecast::Projection {
        per_hour_1h: None,
        per_hour_24h: None,
        exhausts_at_ms: None,
    });
    o.insert("burn_per_hour_1h".into(), rate(p.per_hour_1h));
    o.insert("burn_per_hour_24h".into(), rate(p.per_hour_24h));
    let at = p.exhausts_at_ms.map(|ms| rfc3339(policy, ms));
    o.insert("exhausts_at".into(), json!(at));
    o.insert(
        "projected_exhaustion_seconds".into(),
        json!(p.seconds_from(now)),
    );
}

/// Micro-dollars as people read them (`$1,234.57`, `$0.000096`): below a dollar every
/// non-zero digit is kept, so $0.000096 of $0.0001 never reads as "$0.01 of $0.01".
pub fn dollars(micros: u64) -> String {
    crate::units::fmt_usd(micros)
}

/// A window end as RFC 3339 with the policy zone's offset.
fn rfc3339(policy: &Policy, ms: i64) -> String {
    match jiff::Timestamp::from_millisecond(ms) {
        Ok(t) => {
            let offset = policy.windows.timezone.to_offset(t);
            t.display_with_offset(offset).to_string()
        }
        Err(_) => String::new(),
    }
}

fn refused(snap: &Snapshot, e: IdentityError) -> Response<Body> {
    let id = identity::new_request_id();
    let r = Refusal::from(e);
    let rec = Record::new(
        snap.policy.version.clone(),
        id.clone(),
        id,
        Arc::from("none"),
        Arc::from(PATH),
    );
    let rec = r.record_early(rec);
    respond::refusal(&r, &rec, snap)
}

#[cfg(test)]
mod tests {
    use super::dollars;

    #[test]
    fn dollars_are_grouped_and_small_amounts_keep_their_digits() {
        assert_eq!(dollars(0), "$0.00");
        assert_eq!(dollars(1), "$0.000001");
        assert_eq!(dollars(96), "$0.000096");
        assert_eq!(dollars(100), "$0.0001");
        assert_eq!(dollars(49_450_000), "$49.45");
        assert_eq!(dollars(1_234_567_890_000), "$1,234,567.89");
        assert_eq!(dollars(50_000_000), "$50.00");
    }
}
