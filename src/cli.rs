//! The command line: `serve`, `check`, `test`. Each command returns an exit code:
//! 0 ok, 1 a scenario mismatch, 2 invalid input.

use crate::policy;
use crate::scenario::{self, ScenarioResult};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

pub const EXIT_OK: u8 = 0;
pub const EXIT_MISMATCH: u8 = 1;
pub const EXIT_INVALID: u8 = 2;

#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about = "A reverse-proxy sidecar that governs what AI calls cost")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the sidecar.
    Serve {
        /// Policy file or directory.
        #[arg(long, env = "TOLLGATE_POLICY", default_value = "policies/default.yaml")]
        policy: PathBuf,
    },
    /// Validate a policy (file or directory) and print a summary.
    Check { policy: PathBuf },
    /// Run policy scenario files through the decision core.
    Test {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Print every decision record as JSON.
        #[arg(long)]
        json: bool,
    },
}

pub fn check(path: &std::path::Path) -> u8 {
    match policy::load(path) {
        Ok(p) => {
            println!("{}", policy::summary(&p));
            println!("ok: {}", path.display());
            EXIT_OK
        }
        Err(e) => {
            eprintln!("{e}");
            EXIT_INVALID
        }
    }
}

pub async fn test(files: &[PathBuf], json: bool) -> u8 {
    let mut code = EXIT_OK;
    let (mut passed, mut failed, mut invalid) = (0usize, 0usize, 0usize);
    for f in files {
        match scenario::run_file(f).await {
            Ok(r) => {
                if json {
                    match serde_json::to_string(&json_line(&r)) {
                        Ok(s) => println!("{s}"),
                        Err(e) => eprintln!("{}: cannot print record: {e}", r.file),
                    }
                }
                if r.mismatches.is_empty() {
                    passed += 1;
                    if !json {
                        println!("PASS {} ({})", r.file, r.name);
                    }
                } else {
                    failed += 1;
                    code = code.max(EXIT_MISMATCH);
                    eprintln!("FAIL {} ({})", r.file, r.name);
                    for m in &r.mismatches {
                        eprintln!("  {}: expected {}, got {}", m.field, m.expected, m.got);
                    }
                }
            }
            Err(e) => {
                invalid += 1;
                code = EXIT_INVALID;
                eprintln!("ERROR {e}");
            }
        }
    }
    let summary = format!("scenarios: {passed} passed, {failed} failed, {invalid} invalid");
    if json {
        eprintln!("{summary}");
    } else {
        println!("{summary}");
    }
    code
}

fn json_line(r: &ScenarioResult) -> serde_json::Value {
    serde_json::json!({
        "file": r.file,
        "name": r.name,
        "pass": r.mismatches.is_empty(),
        "mismatches": r.mismatches,
        "record": r.record,
    })
}

/// `serve`: until the proxy lands, load and validate the policy and report it.
pub async fn serve(path: &std::path::Path) -> u8 {
    match policy::load(path) {
        Ok(p) => {
            println!("{}", policy::summary(&p));
            EXIT_OK
        }
        Err(e) => {
            eprintln!("{e}");
            EXIT_INVALID
        }
    }
}
