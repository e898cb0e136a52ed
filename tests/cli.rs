//! The `tollgate` binary's commands and exit codes, run as a user would run them.

use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scenario_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("scenario dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    v.sort();
    v
}

#[test]
fn the_eight_shared_scenarios_pass() {
    let files = scenario_files(&root().join("tests/scenarios/shared"));
    assert_eq!(files.len(), 8);
    let out = bin().arg("test").args(&files).output().expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("8 passed, 0 failed"), "{stdout}");
}

#[test]
fn our_scenarios_pass() {
    let files = scenario_files(&root().join("tests/scenarios"));
    assert!(
        files.len() >= 20,
        "at least twenty scenarios of our own, found {}",
        files.len()
    );
    let out = bin().arg("test").args(&files).output().expect("run");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_wrong_expectation_exits_1_with_a_diff() {
    let out = bin()
        .args(["test", "tests/fixtures/wrong-expect.yaml"])
        .current_dir(root())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("final_action: expected HARD_STOP, got ALLOW"),
        "{err}"
    );
    assert!(err.contains("http_status: expected 403, got 200"), "{err}");
}

#[test]
fn json_prints_every_record() {
    let out = bin()
        .args([
            "test",
            "--json",
            "tests/scenarios/shared/01-baseline-allowed.yaml",
        ])
        .current_dir(root())
        .output()
        .expect("run");
    assert!(out.status.success());
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(line.trim()).expect("one JSON line");
    assert_eq!(v["record"]["final_action"], "ALLOW");
    assert_eq!(v["record"]["usage_evidence_state"], "ACTUAL");
    assert_eq!(v["pass"], true);
}

#[test]
fn a_missing_or_unparsable_scenario_exits_2() {
    let out = bin()
        .args(["test", "tests/fixtures/does-not-exist.yaml"])
        .current_dir(root())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let out = bin()
        .args(["test", "tests/fixtures/unknown-key.yaml"])
        .current_dir(root())
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(2),
        "a policy file is not a scenario"
    );
}

#[test]
fn check_names_an_unknown_key_and_its_line() {
    let out = bin()
        .args(["check", "tests/fixtures/unknown-key.yaml"])
        .current_dir(root())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("colour"), "{err}");
    assert!(
        err.contains(":6:") || err.contains("line 6"),
        "names line 6: {err}"
    );
}

#[test]
fn check_names_a_dangling_backend_and_its_line() {
    let out = bin()
        .args(["check", "tests/fixtures/dangling-backend.yaml"])
        .current_dir(root())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gemnii"), "{err}");
    // The ids that do exist, so the typo is obvious.
    assert!(err.contains("(backends: primary)"), "{err}");
    assert!(err.contains("routes[0].chain[1].backend"), "{err}");
    assert!(
        err.contains(":10:") || err.contains("line 10"),
        "names line 10: {err}"
    );
}

#[test]
fn check_accepts_the_default_policy_and_summarises_it() {
    let out = bin()
        .args(["check", "policies/default.yaml"])
        .current_dir(root())
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("chat: ollama/llama3.1:8b -> gemini/gemini-2.0-flash -> claude/claude-3-5-haiku-latest -> static"), "{s}");
}

#[test]
fn check_says_tabs_are_not_allowed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("tabs.yaml");
    std::fs::write(
        &p,
        "version: v\nbackends:\n\t- {id: a, kind: openai, base_url: 'http://a'}\n",
    )
    .expect("write");
    let out = bin().arg("check").arg(&p).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tabs are not allowed"), "{err}");
    assert!(err.contains("tabs.yaml:3"), "{err}");
}

#[test]
fn usage_with_the_audit_off_names_the_setting_to_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("p.yaml");
    std::fs::write(&p, "version: v\naudit: {sink: off}\n").expect("write");
    let out = bin()
        .args(["usage", "--policy"])
        .arg(&p)
        .current_dir(dir.path())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("audit.sink is off"), "{err}");
    assert!(
        err.contains("set audit.sink to jsonl, sqlite or postgres"),
        "{err}"
    );
}

#[test]
fn usage_of_a_missing_jsonl_audit_names_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = bin()
        .args(["usage", "--jsonl", "never-written.jsonl"])
        .current_dir(dir.path())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1), "a missing file cannot be read");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("never-written.jsonl"), "{err}");
}
