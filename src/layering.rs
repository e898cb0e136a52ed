//! The module graph points down (docs/layout.md): each top-level module may use only the
//! modules after it in [`ORDER`]. Read from the sources, so a new upward import fails here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Top to bottom; a module may use any module after it.
const ORDER: &[&str] = &[
    "cli",
    "sidecar",
    "admin",
    "proxy",
    "telemetry",
    "audit",
    "replay",
    "scenario",
    "dialect",
    "providers",
    "governor",
    "state",
    "stream",
    "policy",
    "ledger",
    "estimate",
    "units",
    "wire",
    "tls",
    "body",
    "jscan",
];

fn files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_dir() {
        for e in std::fs::read_dir(p).unwrap() {
            files(&e.unwrap().path(), out);
        }
    } else if p.is_file() && p.extension().is_some_and(|e| e == "rs") {
        out.push(p.to_path_buf());
    }
}

/// The `crate::<module>` names the module's code (not its comments) refers to.
fn uses(module: &str) -> BTreeSet<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut fs = Vec::new();
    files(&src.join(module), &mut fs);
    files(&src.join(format!("{module}.rs")), &mut fs);
    assert!(!fs.is_empty(), "no sources for module {module}");
    let mut out = BTreeSet::new();
    for f in fs {
        for line in std::fs::read_to_string(&f).unwrap().lines() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            for (i, _) in code.match_indices("crate::") {
                let name: String = code[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if name != module && !name.is_empty() {
                    out.insert(name);
                }
            }
        }
    }
    out
}

#[test]
fn imports_point_down() {
    let mut wrong = Vec::new();
    for (i, m) in ORDER.iter().enumerate() {
        for used in uses(m) {
            match ORDER.iter().position(|o| *o == used) {
                Some(j) if j > i => {}
                Some(_) => wrong.push(format!("{m} uses {used}, which is above it")),
                None => wrong.push(format!("{m} uses {used}, which is not in ORDER")),
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_module_is_placed() {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    for line in lib.lines() {
        if let Some(m) = line.strip_prefix("pub mod ") {
            let m = m.trim_end_matches(';');
            assert!(ORDER.contains(&m), "module {m} has no place in ORDER");
        }
    }
}
