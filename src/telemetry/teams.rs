//! Spend per team: `tollgate_team_tokens_total{team,direction}` and
//! `tollgate_team_cost_usd_total{team}`. The label takes only the teams of the configured
//! virtual keys, `none` (a request with no team) and `other` (a team no key names), so a
//! caller can never grow the series. The counter sets are built when a policy is adopted;
//! the request path finds its team's by comparing names in a short list, without a lock or
//! an allocation.

use super::names::*;
use super::shard::{header, Counts, Sharded};
use super::stats::escape;
use arc_swap::ArcSwap;
use std::sync::Arc;

/// The label of a request that has no team (no virtual key, or a key without a team).
pub const NO_TEAM: &str = "none";
/// The label of a team that no configured key names (a policy reloaded since).
pub const OTHER_TEAM: &str = "other";

/// Input tokens, output tokens, micro-dollars.
type Spend = Sharded<Counts<3>>;

/// Every team's counters: [`NO_TEAM`] first, [`OTHER_TEAM`] second, then the configured
/// teams in the order first seen. Teams are added by each policy adopted and never removed,
/// so a counter never goes back.
pub struct TeamSpend {
    list: ArcSwap<Vec<(Arc<str>, Arc<Spend>)>>,
}

impl Default for TeamSpend {
    fn default() -> Self {
        let fixed = [NO_TEAM, OTHER_TEAM].map(|n| (Arc::from(n), Arc::new(Spend::default())));
        TeamSpend {
            list: ArcSwap::from_pointee(fixed.into()),
        }
    }
}

impl std::fmt::Debug for TeamSpend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self
            .list
            .load()
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        f.debug_struct("TeamSpend").field("teams", &names).finish()
    }
}

impl TeamSpend {
    /// Adds counters for `teams` not seen before (a team named `none` or `other` shares
    /// those labels' counters).
    pub fn configure<'a>(&self, teams: impl IntoIterator<Item = &'a Arc<str>>) {
        let teams: Vec<&Arc<str>> = teams.into_iter().collect();
        self.list.rcu(|l| {
            let mut l = (**l).clone();
            for t in &teams {
                if !l.iter().any(|(n, _)| n == *t) {
                    l.push(((*t).clone(), Arc::new(Spend::default())));
                }
            }
            l
        });
    }

    /// Committed usage of a served call by `team`.
    pub fn add(&self, team: Option<&str>, input: u64, output: u64, micros: u64) {
        let l = self.list.load();
        let i = match team {
            None => 0,
            Some(t) => l
                .iter()
                .skip(2)
                .position(|(n, _)| &**n == t)
                .map_or(1, |p| p + 2),
        };
        if let Some((_, s)) = l.get(i) {
            let s = s.here();
            s.add(0, input);
            s.add(1, output);
            s.add(2, micros);
        }
    }

    /// The two metrics in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let l = self.list.load();
        header(
            out,
            TOLLGATE_TEAM_TOKENS_TOTAL,
            "counter",
            TOLLGATE_TEAM_TOKENS_TOTAL_HELP,
        );
        for (n, s) in l.iter() {
            let t = escape(n);
            for (i, dir) in ["input", "output"].iter().enumerate() {
                let v = s.sum(|c| c.get(i));
                let _ = writeln!(
                    out,
                    "{TOLLGATE_TEAM_TOKENS_TOTAL}{{team=\"{t}\",direction=\"{dir}\"}} {v}"
                );
            }
        }
        header(
            out,
            TOLLGATE_TEAM_COST_USD_TOTAL,
            "counter",
            TOLLGATE_TEAM_COST_USD_TOTAL_HELP,
        );
        for (n, s) in l.iter() {
            let usd = s.sum(|c| c.get(2)) as f64 / 1e6;
            let _ = writeln!(
                out,
                "{TOLLGATE_TEAM_COST_USD_TOTAL}{{team=\"{}\"}} {usd}",
                escape(n)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_configured_teams_get_a_label_of_their_own() {
        let s = TeamSpend::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("team-a"), Arc::from("team-b"));
        s.configure([&a, &b]);
        s.configure([&a]); // a reload naming a known team adds nothing
        s.add(Some("team-a"), 10, 5, 96);
        s.add(Some("team-a"), 1, 1, 4);
        s.add(Some("intruder-1"), 7, 7, 1_000_000);
        s.add(Some("intruder-2"), 1, 0, 0);
        s.add(None, 2, 3, 0);
        let mut out = String::new();
        s.render(&mut out);
        let series: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            series,
            [
                "tollgate_team_tokens_total{team=\"none\",direction=\"input\"} 2",
                "tollgate_team_tokens_total{team=\"none\",direction=\"output\"} 3",
                "tollgate_team_tokens_total{team=\"other\",direction=\"input\"} 8",
                "tollgate_team_tokens_total{team=\"other\",direction=\"output\"} 7",
                "tollgate_team_tokens_total{team=\"team-a\",direction=\"input\"} 11",
                "tollgate_team_tokens_total{team=\"team-a\",direction=\"output\"} 6",
                "tollgate_team_tokens_total{team=\"team-b\",direction=\"input\"} 0",
                "tollgate_team_tokens_total{team=\"team-b\",direction=\"output\"} 0",
                "tollgate_team_cost_usd_total{team=\"none\"} 0",
                "tollgate_team_cost_usd_total{team=\"other\"} 1",
                "tollgate_team_cost_usd_total{team=\"team-a\"} 0.0001",
                "tollgate_team_cost_usd_total{team=\"team-b\"} 0",
            ],
            "{out}"
        );
    }
}
