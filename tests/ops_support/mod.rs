//! Helpers for the operations tests: scrape and parse `/metrics`, read `/admin/status`,
//! POST to the admin API.
#![allow(dead_code)]

use crate::common::{client, get, try_send_with};
use http::Method;
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::SocketAddr;

/// One parsed Prometheus text exposition: series -> value, plus HELP/TYPE lines by name.
#[derive(Debug, Default)]
pub struct Metrics {
    pub series: Vec<(String, BTreeMap<String, String>, f64)>,
    pub help: BTreeMap<String, String>,
    pub types: BTreeMap<String, String>,
    pub text: String,
}

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        let mut m = Metrics {
            text: text.to_string(),
            ..Default::default()
        };
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
                m.help.insert(name.into(), help.into());
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, t) = rest.split_once(' ').unwrap_or((rest, ""));
                m.types.insert(name.into(), t.into());
                continue;
            }
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("series value");
            let value: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("bad value: {line}"));
            let (name, labels) = match series.split_once('{') {
                None => (series.to_string(), BTreeMap::new()),
                Some((n, l)) => (n.to_string(), parse_labels(l.trim_end_matches('}'))),
            };
            m.series.push((name, labels, value));
        }
        m
    }

    /// The value of the series with exactly these labels (0 when absent: counters start there).
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.find(name, labels).unwrap_or(0.0)
    }

    pub fn find(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.series
            .iter()
            .find(|(n, l, _)| n == name && *l == want)
            .map(|(_, _, v)| *v)
    }

    /// Every series of `name`.
    pub fn all(&self, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
        self.series
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, l, v)| (l.clone(), *v))
            .collect()
    }
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (k, after) = rest.split_once("=\"").expect("label");
        let mut val = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        val.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => val.push(c),
            }
        }
        out.insert(k.trim_start_matches(',').to_string(), val);
        rest = after[end..].trim_start_matches(',');
    }
    out
}

pub async fn scrape(admin: SocketAddr) -> Metrics {
    let (status, _, body) = get(&format!("http://{admin}/metrics")).await;
    assert_eq!(status, 200);
    Metrics::parse(std::str::from_utf8(&body).expect("utf-8"))
}

pub async fn status(admin: SocketAddr) -> Value {
    let (code, _, body) = get(&format!("http://{admin}/admin/status")).await;
    assert_eq!(code, 200);
    crate::common::json(&body)
}

/// POST /admin/reload with an optional bearer token: (status, body).
pub async fn post_reload(admin: SocketAddr, token: Option<&str>) -> (u16, Value) {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    let (code, _, body) = try_send_with(
        &client(),
        Method::POST,
        &format!("http://{admin}/admin/reload"),
        None,
        &headers,
    )
    .await
    .expect("reload call");
    (code, serde_json::from_slice(&body).unwrap_or(Value::Null))
}
