//! What replay found: every request's old and new decision folded into totals per bound and
//! per team and consumer, and rendered as tables.

use super::read::Recorded;
use serde::Serialize;
use std::collections::BTreeMap;

/// How many changed requests the table lists one by one (`--json` lists them all).
const CHANGES_SHOWN: usize = 20;

/// One decision, old or new.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    pub action: String,
    pub reason: String,
    /// Who answered: a backend id, `static` or `none`.
    pub backend: String,
    pub cost_usd: f64,
    /// The bounds that refused an attempt (by name, once each), with their class.
    #[serde(skip)]
    pub refused_by: Vec<(String, String)>,
}

impl Decision {
    /// Served (ALLOW or DEGRADE), as opposed to refused (DEFER or HARD_STOP).
    pub fn admitted(&self) -> bool {
        matches!(self.action.as_str(), "ALLOW" | "DEGRADE")
    }

    /// The same decision: action, reason and who answered (the cost may differ).
    fn same(&self, o: &Decision) -> bool {
        self.action == o.action && self.reason == o.reason && self.backend == o.backend
    }

    pub fn recorded(r: &Recorded) -> Decision {
        let mut refused_by: Vec<(String, String)> = Vec::new();
        for n in &r.refusals {
            if !refused_by.iter().any(|(name, _)| *name == n.name) {
                refused_by.push((n.name.clone(), n.class.clone()));
            }
        }
        Decision {
            action: r.final_action.clone(),
            reason: r.reason_class.clone(),
            backend: r.backend.clone(),
            cost_usd: r.cost_usd(),
            refused_by,
        }
    }
}

/// How a request's decision changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    AllowedToRefused,
    RefusedToAllowed,
    /// Still served (or still refused), but differently: another action, reason or backend.
    Other,
}

impl ChangeKind {
    fn label(self) -> &'static str {
        match self {
            ChangeKind::AllowedToRefused => "allowed -> refused",
            ChangeKind::RefusedToAllowed => "refused -> allowed",
            ChangeKind::Other => "changed",
        }
    }
}

/// One request whose decision changed.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    /// The record's `ts`.
    pub ts: String,
    pub request_id: String,
    pub consumer: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    pub kind: ChangeKind,
    pub old: Decision,
    pub new: Decision,
    /// The bounds behind the change: those that refused under the new policy (allowed →
    /// refused), under the old one (refused → allowed).
    pub bounds: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct BoundRow {
    pub name: String,
    /// `rate_limit`, `quota` or `budget` (empty when unknown).
    pub class: String,
    /// Requests the bound refused an attempt of, as recorded and as replayed.
    pub refused_old: u64,
    pub refused_new: u64,
    pub allowed_to_refused: u64,
    pub refused_to_allowed: u64,
    /// The `ts` of the first request the bound refused, as recorded and as replayed.
    pub first_refusal_old: Option<String>,
    pub first_refusal_new: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct WhoRow {
    /// A team (`-`: requests with none) or a consumer.
    pub name: String,
    pub requests: u64,
    pub changed: u64,
    pub allowed_to_refused: u64,
    pub refused_to_allowed: u64,
    pub spend_old_usd: f64,
    pub spend_new_usd: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// The candidate policy: its source and version.
    pub policy: String,
    pub policy_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// Governed requests in the period, replayed and compared.
    pub requests: u64,
    /// Requests before `from`, replayed only to rebuild the counters of the windows.
    pub earlier: u64,
    /// Records of requests refused before any decision (bad key, bad request): not replayed.
    pub not_governed: u64,
    /// Lines that were not audit records.
    pub skipped_lines: u64,
    pub changed: u64,
    pub allowed_to_refused: u64,
    pub refused_to_allowed: u64,
    pub spend_old_usd: f64,
    pub spend_new_usd: f64,
    pub bounds: Vec<BoundRow>,
    pub teams: Vec<WhoRow>,
    pub consumers: Vec<WhoRow>,
    pub changes: Vec<Change>,
}

/// Folds decisions into a [`Report`].
#[derive(Debug, Default)]
pub struct Tally {
    pub report: Report,
    bounds: BTreeMap<String, BoundRow>,
    teams: BTreeMap<String, WhoRow>,
    consumers: BTreeMap<String, WhoRow>,
}

fn who<'a>(map: &'a mut BTreeMap<String, WhoRow>, name: &str) -> &'a mut WhoRow {
    map.entry(name.to_string()).or_insert_with(|| WhoRow {
        name: name.to_string(),
        ..WhoRow::default()
    })
}

impl Tally {
    fn bound(&mut self, name: &str, class: &str) -> &mut BoundRow {
        let row = self
            .bounds
            .entry(name.to_string())
            .or_insert_with(|| BoundRow {
                name: name.to_string(),
                ..BoundRow::default()
            });
        if row.class.is_empty() {
            row.class = class.to_string();
        }
        row
    }

    /// One request in the period: its recorded and replayed decisions.
    pub fn add(&mut self, r: &Recorded, old: Decision, new: Decision) {
        let kind = match (old.admitted(), new.admitted()) {
            _ if old.same(&new) => None,
            (true, false) => Some(ChangeKind::AllowedToRefused),
            (false, true) => Some(ChangeKind::RefusedToAllowed),
            _ => Some(ChangeKind::Other),
        };
        let rep = &mut self.report;
        rep.requests += 1;
        rep.spend_old_usd += old.cost_usd;
        rep.spend_new_usd += new.cost_usd;
        for (name, class) in &old.refused_by {
            let b = self.bound(name, class);
            b.refused_old += 1;
            b.first_refusal_old.get_or_insert_with(|| r.ts.clone());
        }
        for (name, class) in &new.refused_by {
            let b = self.bound(name, class);
            b.refused_new += 1;
            b.first_refusal_new.get_or_insert_with(|| r.ts.clone());
        }
        let team = r.team.as_deref().unwrap_or("-");
        for row in [
            who(&mut self.teams, team),
            who(&mut self.consumers, &r.consumer_id),
        ] {
            row.requests += 1;
            row.spend_old_usd += old.cost_usd;
            row.spend_new_usd += new.cost_usd;
            match kind {
                None => {}
                Some(k) => {
                    row.changed += 1;
                    match k {
                        ChangeKind::AllowedToRefused => row.allowed_to_refused += 1,
                        ChangeKind::RefusedToAllowed => row.refused_to_allowed += 1,
                        ChangeKind::Other => {}
                    }
                }
            }
        }
        let Some(kind) = kind else {
            return;
        };
        let behind = match kind {
            ChangeKind::AllowedToRefused => &new.refused_by,
            ChangeKind::RefusedToAllowed => &old.refused_by,
            ChangeKind::Other => &new.refused_by,
        };
        let bounds: Vec<String> = behind.iter().map(|(n, _)| n.clone()).collect();
        let rep = &mut self.report;
        rep.changed += 1;
        match kind {
            ChangeKind::AllowedToRefused => rep.allowed_to_refused += 1,
            ChangeKind::RefusedToAllowed => rep.refused_to_allowed += 1,
            ChangeKind::Other => {}
        }
        for (name, class) in behind.clone() {
            let b = self.bound(&name, &class);
            match kind {
                ChangeKind::AllowedToRefused => b.allowed_to_refused += 1,
                ChangeKind::RefusedToAllowed => b.refused_to_allowed += 1,
                ChangeKind::Other => {}
            }
        }
        self.report.changes.push(Change {
            ts: r.ts.clone(),
            request_id: r.request_id.clone(),
            consumer: r.consumer_id.clone(),
            team: r.team.clone(),
            kind,
            old,
            new,
            bounds,
        });
    }

    pub fn finish(mut self) -> Report {
        self.report.bounds = self.bounds.into_values().collect();
        self.report.teams = self.teams.into_values().collect();
        self.report.consumers = self.consumers.into_values().collect();
        self.report
    }
}

/// Columns padded to their widest cell.
fn table(out: &mut String, head: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, c) in row.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
        let mut first = true;
        for (i, c) in cells.enumerate() {
            if !first {
                out.push_str("  ");
            }
            first = false;
            out.push_str(&format!("{c:<width$}", width = w[i]));
        }
        let trimmed = out.trim_end_matches(' ').len();
        out.truncate(trimmed);
        out.push('\n');
    };
    line(out, &mut head.iter().copied());
    for row in rows {
        line(out, &mut row.iter().map(String::as_str));
    }
}

fn usd(v: f64) -> String {
    format!("{v:.6}")
}

/// The report as text tables.
pub fn render(r: &Report) -> String {
    let mut s = format!("replay under {} (version {})", r.policy, r.policy_version);
    match (&r.from, &r.to) {
        (None, None) => {}
        (f, t) => s.push_str(&format!(
            ", from {} to {}",
            f.as_deref().unwrap_or("the start"),
            t.as_deref().unwrap_or("the end")
        )),
    }
    s.push('\n');
    s.push_str(&format!(
        "{} requests replayed: {} changed ({} allowed -> refused, {} refused -> allowed); \
         spend {} -> {} USD\n",
        r.requests,
        r.changed,
        r.allowed_to_refused,
        r.refused_to_allowed,
        usd(r.spend_old_usd),
        usd(r.spend_new_usd)
    ));
    if r.changed == 0 {
        s.push_str("no decision changes\n");
    }
    if !r.bounds.is_empty() {
        s.push('\n');
        let rows: Vec<Vec<String>> = r
            .bounds
            .iter()
            .map(|b| {
                vec![
                    b.name.clone(),
                    b.class.clone(),
                    b.allowed_to_refused.to_string(),
                    b.refused_to_allowed.to_string(),
                    format!("{} -> {}", b.refused_old, b.refused_new),
                    b.first_refusal_new.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        let head = [
            "bound",
            "class",
            "allowed->refused",
            "refused->allowed",
            "refused old->new",
            "first refusal (new)",
        ];
        table(&mut s, &head, &rows);
    }
    for (title, list) in [("team", &r.teams), ("consumer", &r.consumers)] {
        if list.is_empty() {
            continue;
        }
        s.push('\n');
        let rows: Vec<Vec<String>> = list
            .iter()
            .map(|w| {
                vec![
                    w.name.clone(),
                    w.requests.to_string(),
                    w.allowed_to_refused.to_string(),
                    w.refused_to_allowed.to_string(),
                    w.changed.to_string(),
                    usd(w.spend_old_usd),
                    usd(w.spend_new_usd),
                ]
            })
            .collect();
        let head = [
            title,
            "requests",
            "allowed->refused",
            "refused->allowed",
            "changed",
            "spend old USD",
            "spend new USD",
        ];
        table(&mut s, &head, &rows);
    }
    if !r.changes.is_empty() {
        s.push('\n');
        let rows: Vec<Vec<String>> = r
            .changes
            .iter()
            .take(CHANGES_SHOWN)
            .map(|c| {
                vec![
                    c.ts.clone(),
                    c.request_id.clone(),
                    c.consumer.clone(),
                    c.kind.label().to_string(),
                    format!("{} {} {}", c.old.action, c.old.reason, c.old.backend),
                    format!("{} {} {}", c.new.action, c.new.reason, c.new.backend),
                    c.bounds.join(","),
                ]
            })
            .collect();
        let head = [
            "ts", "request", "consumer", "change", "old", "new", "bounds",
        ];
        table(&mut s, &head, &rows);
        if r.changes.len() > CHANGES_SHOWN {
            s.push_str(&format!(
                "... and {} more (--json lists them all)\n",
                r.changes.len() - CHANGES_SHOWN
            ));
        }
    }
    s
}
