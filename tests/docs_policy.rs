//! `docs/policy.md` documents every key the policy loader accepts, and documents no key it
//! refuses.
//!
//! The accepted keys are not listed by hand: they are asked of the loader itself. Every
//! section denies unknown fields, and serde's refusal of one names every field the section
//! has (`unknown field `x`, expected one of `a`, `b``); a field given a mapping (or a list of
//! one mapping) with an unknown key answers the same way when it is a section itself. Walking
//! that from the top gives every key path, so a field added to `src/policy/raw.rs` without a
//! line in the page fails here.

use std::collections::BTreeSet;

const PROBE: &str = "zz_probe_key";

/// What the loader says when given `yaml`: its error text, or `None` when it accepts it.
fn load(yaml: &str) -> Option<String> {
    tollgate::policy::from_str(yaml, "probe.yaml")
        .err()
        .map(|e| e.to_string())
}

/// The fields serde lists in an "unknown field `zz_probe_key`" error, if that is the error.
fn fields_named(err: &str) -> Option<Vec<String>> {
    let at = err.find(&format!("unknown field `{PROBE}`"))?;
    let rest = &err[at..];
    let line = rest.lines().next().unwrap_or(rest);
    if line.contains("there are no fields") {
        return Some(Vec::new());
    }
    let list = line.split_once(", expected ")?.1;
    let list = list.strip_prefix("one of ").unwrap_or(list);
    Some(
        list.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect(),
    )
}

/// YAML setting `path` (`a`, `b[]`, `c`: a list of one mapping at `b`) to `1`, beside
/// `version`.
fn yaml_at(path: &[String]) -> String {
    let mut v = serde_json::json!(1);
    for seg in path.iter().rev() {
        let (name, list) = match seg.strip_suffix("[]") {
            Some(n) => (n, true),
            None => (seg.as_str(), false),
        };
        let inner = if list { serde_json::json!([v]) } else { v };
        v = serde_json::json!({ name: inner });
    }
    if let Some(m) = v.as_object_mut() {
        m.entry("version").or_insert(serde_json::json!("probe"));
    }
    serde_norway::to_string(&v).expect("yaml")
}

/// The fields of the section at `path` (the root when empty), if it is a section.
fn section_fields(path: &[String]) -> Option<Vec<String>> {
    let mut probe = path.to_vec();
    probe.push(PROBE.to_owned());
    let err = load(&yaml_at(&probe))?;
    fields_named(&err)
}

/// Every key path the loader accepts, `[]` marking a list of sections (`routes[].chain[].model`).
fn accepted_keys() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut todo: Vec<Vec<String>> = vec![Vec::new()];
    while let Some(path) = todo.pop() {
        let fields = section_fields(&path)
            .unwrap_or_else(|| panic!("{path:?} is not a section; the probe cannot walk it"));
        for f in fields {
            let mut child = path.clone();
            child.push(f.clone());
            if section_fields(&child).is_some() {
                todo.push(child);
                continue;
            }
            let mut as_list = path.clone();
            as_list.push(format!("{f}[]"));
            if section_fields(&as_list).is_some() {
                todo.push(as_list);
                continue;
            }
            out.insert(child.join("."));
        }
    }
    out
}

/// The page split at its `### ` headings: (heading text, body).
fn sections(page: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in page.lines() {
        if let Some(h) = line.strip_prefix("### ") {
            out.push((h.trim().to_owned(), String::new()));
        } else if line.starts_with("## ") {
            out.push((String::new(), String::new()));
        } else if let Some((_, body)) = out.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

/// Every `code` span of `text`, with `[]` taken out (`chain[].model` → `chain.model`).
fn code_spans(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(|s| s.replace("[]", ""))
        .collect()
}

fn policy_page() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/policy.md"))
        .expect("read docs/policy.md")
}

/// `backends[].circuit.max_open` → (`backends`, `circuit.max_open`).
fn split_top(key: &str) -> (String, String) {
    let plain = key.replace("[]", "");
    match plain.split_once('.') {
        Some((top, rest)) => (top.to_owned(), rest.to_owned()),
        None => (plain.clone(), plain),
    }
}

/// The page's sections whose heading names `top` (`### rate_limits, quotas, budgets` covers
/// three).
fn bodies_for<'a>(secs: &'a [(String, String)], top: &str) -> Vec<&'a str> {
    secs.iter()
        .filter(|(h, _)| h.split([',', ' ']).any(|w| w == top))
        .map(|(_, b)| b.as_str())
        .collect()
}

#[test]
fn the_probe_sees_known_keys_and_the_walk_finds_nested_ones() {
    let keys = accepted_keys();
    // A sample across depths and lists; the walk must not be silently empty or shallow.
    for k in [
        "version",
        "server.listen",
        "identity.virtual_keys[].key_sha256",
        "backends[].circuit.max_open",
        "backends[].price_per_1k.cached_input",
        "routes[].chain[].price_per_1k.cache_write",
        "rate_limits[].match",
        "telemetry.otlp.endpoint",
        "audit.max_bytes",
    ] {
        assert!(keys.contains(k), "{k} not found; the walk found {keys:#?}");
    }
    assert!(
        !keys.iter().any(|k| k.contains(PROBE)),
        "the probe key leaked into {keys:?}"
    );
    // And the probe is a real probe: an unknown key is refused at every depth.
    assert!(load(&yaml_at(&["backends[]".into(), "colour".into()])).is_some());
}

#[test]
fn every_key_the_loader_accepts_is_documented_in_its_section() {
    let page = policy_page();
    let secs = sections(&page);
    let mut missing = Vec::new();
    for key in accepted_keys() {
        let (top, rest) = split_top(&key);
        let bodies = bodies_for(&secs, &top);
        let documented = bodies.iter().any(|b| code_spans(b).contains(&rest));
        if !documented {
            missing.push(format!(
                "{key}: no `{rest}` in a `### {top}` section of docs/policy.md"
            ));
        }
    }
    assert!(
        missing.is_empty(),
        "keys the loader accepts but docs/policy.md does not document:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_key_in_the_reference_tables_is_one_the_loader_accepts() {
    // A key's enclosing sections (`chain`, `circuit`) may have rows of their own.
    let mut keys: BTreeSet<(String, String)> = BTreeSet::new();
    for k in accepted_keys() {
        let (top, rest) = split_top(&k);
        let mut prefix = String::new();
        for part in rest.split('.') {
            if !prefix.is_empty() {
                prefix.push('.');
            }
            prefix.push_str(part);
            keys.insert((top.clone(), prefix.clone()));
        }
    }
    let page = policy_page();
    let mut unknown = Vec::new();
    for (heading, body) in sections(&page) {
        let tops: Vec<&str> = heading
            .split([',', ' '])
            .filter(|w| !w.is_empty())
            .collect();
        if tops.is_empty() {
            continue;
        }
        // The first cell of a table row whose header is `| key |`: the key it documents.
        let mut in_key_table = false;
        for line in body.lines() {
            if line.starts_with("| key |") {
                in_key_table = true;
                continue;
            }
            if !line.starts_with('|') {
                in_key_table = false;
                continue;
            }
            if !in_key_table || line.starts_with("| ---") {
                continue;
            }
            let cell = line.split('|').nth(1).unwrap_or("").trim();
            for key in code_spans(cell) {
                let known = tops
                    .iter()
                    .any(|t| keys.contains(&(t.to_string(), key.clone())));
                if !known {
                    unknown.push(format!("### {heading}: `{key}`"));
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "docs/policy.md documents keys the loader refuses:\n{}",
        unknown.join("\n")
    );
}
