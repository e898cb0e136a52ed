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
#[command(
    name = "tollgate",
    version,
    about = "A reverse-proxy sidecar that governs what AI calls cost"
)]
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

/// `serve`: run the sidecar until SIGTERM/SIGINT; SIGHUP reloads the policy.
pub async fn serve(path: &std::path::Path) -> u8 {
    init_tracing();
    let snap = match crate::proxy::snapshot::load(path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return EXIT_INVALID;
        }
    };
    crate::estimate::warm_up_for(snap.policy.estimate.tokenizer);
    let state = match crate::proxy::persist::State::open(&snap.policy) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return EXIT_INVALID;
        }
    };
    let (audit, writer) = match start_audit(&snap.policy) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("audit: {e}");
            return EXIT_INVALID;
        }
    };
    let version = snap.policy.version.clone();
    let opts = crate::proxy::Options::default();
    let running = match crate::proxy::start_with(snap, audit, opts, state.governor.clone()).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot listen: {e}");
            state.finish().await;
            return EXIT_INVALID;
        }
    };
    tracing::info!(addr = %running.addr, admin = %running.admin_addr, %version, "tollgate serving");
    wait_for_signals(&running, path).await;
    tracing::info!("shutting down: draining in-flight requests");
    let app = running.app.clone();
    running.shutdown().await;
    drop(app);
    state.finish().await;
    if let Some(w) = writer {
        let _ = tokio::task::spawn_blocking(move || w.finish()).await;
    }
    tracing::info!("stopped");
    EXIT_OK
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TOLLGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init();
}

fn start_audit(
    p: &crate::policy::Policy,
) -> std::io::Result<(crate::audit::Audit, Option<crate::audit::AuditWriter>)> {
    use crate::policy::AuditSink;
    match p.audit.sink {
        AuditSink::Off => Ok((crate::audit::Audit::off(), None)),
        AuditSink::Jsonl => {
            let (a, w) = crate::audit::Audit::jsonl(p.audit.path.clone().into(), p.audit.queue)?;
            Ok((a, Some(w)))
        }
        AuditSink::Sqlite | AuditSink::Postgres => Err(std::io::Error::other(
            "audit.sink sqlite/postgres is not available in this build; use jsonl or off",
        )),
    }
}

#[cfg(unix)]
async fn wait_for_signals(running: &crate::proxy::Running, path: &std::path::Path) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::error!("cannot install signal handlers");
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    loop {
        tokio::select! {
            _ = term.recv() => return,
            _ = int.recv() => return,
            _ = hup.recv() => match crate::proxy::reload(&running.app, path) {
                Ok(v) => tracing::info!(version = %v, "policy reloaded"),
                Err(e) => tracing::error!(error = %e, "policy reload rejected; the old policy stays in force"),
            },
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signals(_running: &crate::proxy::Running, _path: &std::path::Path) {
    let _ = tokio::signal::ctrl_c().await;
}
