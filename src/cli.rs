//! The command line: `serve`, `check`, `test`, `usage`. Each command returns an exit code:
//! 0 ok, 1 a scenario mismatch or an unreadable usage log, 2 invalid input.

use crate::policy;
use crate::scenario::{self, ScenarioResult};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

pub const EXIT_OK: u8 = 0;
pub const EXIT_MISMATCH: u8 = 1;
/// A command that could not do its work (an unreadable usage log).
pub const EXIT_FAILURE: u8 = 1;
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
    /// Today's tokens and month-to-date cost per provider and consumer, from the usage log.
    Usage(UsageArgs),
}

#[derive(Debug, clap::Args)]
pub struct UsageArgs {
    /// Policy file or directory: gives the timezone, and the log's location unless
    /// --db/--postgres is given.
    #[arg(long, env = "TOLLGATE_POLICY", default_value = "policies/default.yaml")]
    pub policy: PathBuf,
    /// Read this SQLite file (default: the policy's state.path).
    #[arg(long, conflicts_with = "postgres")]
    pub db: Option<PathBuf>,
    /// Read Postgres at this URL (default: the policy's audit.postgres_url when audit.sink is
    /// postgres). From the environment, a password stays out of `ps` and shell history.
    #[arg(long, env = "TOLLGATE_USAGE_POSTGRES_URL", hide_env_values = true)]
    pub postgres: Option<String>,
    /// The usage-log table (default: the policy's audit.table).
    #[arg(long)]
    pub table: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
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

/// `serve`: run the sidecar until SIGTERM/SIGINT; SIGHUP, a change on disk and
/// `POST /admin/reload` reload the policy.
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
    // OTLP export when configured (`OTEL_*` or telemetry.otlp; read once, at start).
    crate::telemetry::otel::init(&snap.policy);
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
    let mut running =
        match crate::proxy::start_with(snap, audit, opts, state.governor.clone()).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("cannot listen: {e}");
                state.finish().await;
                return EXIT_INVALID;
            }
        };
    tracing::info!(addr = %running.addr, admin = %running.admin_addr, %version, "tollgate serving");
    running.watch_policy(path.to_path_buf());
    if let Some(store) = state.redis.clone() {
        running.ops.set_state_check(std::sync::Arc::new(move || {
            let store = store.clone();
            Box::pin(async move { store.ready().await })
        }));
    }
    wait_for_signals(&running).await;
    tracing::info!("shutting down: draining in-flight requests");
    let app = running.app.clone();
    running.shutdown().await;
    crate::telemetry::otel::shutdown(std::time::Duration::from_secs(5)).await;
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
) -> Result<(crate::audit::Audit, Option<crate::audit::AuditWriter>), crate::audit::AuditError> {
    use crate::audit::{Audit, AuditError};
    use crate::policy::AuditSink;
    let a = &p.audit;
    // For the database sinks, `<audit.path>.spill` takes rows (JSON lines) while the database
    // is away; the writer loads it back once it answers. Its own name, so an old JSONL audit
    // file is never mistaken for spilled rows.
    let spill = std::path::PathBuf::from(format!("{}.spill", a.path));
    let (audit, writer) = match a.sink {
        AuditSink::Off => return Ok((Audit::off(), None)),
        AuditSink::Jsonl => Audit::jsonl(a.path.clone().into(), a.queue)?,
        AuditSink::Sqlite => Audit::sqlite(
            std::path::Path::new(&p.state.path),
            &a.table,
            a.queue,
            spill,
        )?,
        AuditSink::Postgres => {
            let url = a
                .postgres_url
                .as_deref()
                .ok_or_else(|| AuditError::Postgres("audit.postgres_url is required".into()))?;
            Audit::postgres(url, &a.table, a.queue, spill)?
        }
    };
    Ok((audit, Some(writer)))
}

/// `usage`: print today's tokens and month-to-date cost per provider and consumer.
/// Exit 0 printed, 1 the log cannot be read, 2 bad policy or arguments.
pub async fn usage(args: &UsageArgs) -> u8 {
    use crate::audit::report;
    let p = match policy::load(&args.policy) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return EXIT_INVALID;
        }
    };
    let table = args.table.as_deref().unwrap_or(&p.audit.table);
    if !crate::audit::valid_table(table) {
        eprintln!("--table: `{table}` is not a plain SQL name");
        return EXIT_INVALID;
    }
    let tz = &p.windows.timezone;
    let tz_name = &p.windows.timezone_name;
    let now = jiff::Timestamp::now();
    let pg = args.postgres.clone().or_else(|| {
        (args.db.is_none() && p.audit.sink == crate::policy::AuditSink::Postgres)
            .then(|| p.audit.postgres_url.clone())
            .flatten()
    });
    let res = match pg {
        Some(url) => report::from_postgres(&url, table, tz_name, tz, now).await,
        None => {
            let db = args
                .db
                .clone()
                .unwrap_or_else(|| PathBuf::from(&p.state.path));
            report::from_sqlite(&db, table, tz_name, tz, now)
        }
    };
    let text = match res {
        Ok(r) if args.json => match serde_json::to_string_pretty(&r) {
            Ok(s) => s + "\n",
            Err(e) => {
                eprintln!("usage: {e}");
                return EXIT_FAILURE;
            }
        },
        Ok(r) => report::render(&r),
        Err(e) => {
            eprintln!("usage: cannot read the usage log: {e}");
            return EXIT_FAILURE;
        }
    };
    // A closed pipe (`| head`) is not an error worth a panic.
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    EXIT_OK
}

#[cfg(unix)]
async fn wait_for_signals(running: &crate::proxy::Running) {
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
            // Logged, counted and kept for /admin/status by the one reload path.
            _ = hup.recv() => { let _ = running.reload(crate::admin::Trigger::Signal).await; }
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signals(_running: &crate::proxy::Running) {
    let _ = tokio::signal::ctrl_c().await;
}
