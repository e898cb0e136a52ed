//! The command line: `serve`, `check`, `test`, `usage`, `replay`. Each command returns an exit
//! code: 0 ok, 1 a scenario mismatch, an unreadable usage log or (`replay --fail-on-change`) a
//! changed decision, 2 invalid input.

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

/// The default policy, compiled in: `serve` runs it when no policy is given, and
/// `check --print-default` prints it for copying.
pub const DEFAULT_POLICY: &str = include_str!("../policies/default.yaml");
/// How the embedded default is named in errors, the summary and `/admin/status`.
pub const DEFAULT_POLICY_NAME: &str = "(embedded default policy)";

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the sidecar.
    Serve(ServeArgs),
    /// Validate a policy (file or directory) and print a summary.
    Check {
        /// Policy file or directory (default: the embedded default policy).
        policy: Option<PathBuf>,
        /// Print the embedded default policy (YAML) and exit.
        #[arg(long, conflicts_with = "policy")]
        print_default: bool,
    },
    /// Run policy scenario files through the decision core.
    Test {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Print every decision record as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Today's tokens and month-to-date cost per provider and consumer (or per team,
    /// consumer, backend or model with --by), from the usage log or the JSONL audit.
    Usage(UsageArgs),
    /// Re-decide recorded traffic (JSONL audit files) under a candidate policy.
    Replay(ReplayArgs),
}

#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// The candidate policy (file or directory).
    #[arg(long)]
    pub policy: PathBuf,
    /// JSONL audit files, rotated ones and `.gz` included, in any order.
    #[arg(required = true)]
    pub audit: Vec<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 when any decision changes (to gate a policy change in CI).
    #[arg(long)]
    pub fail_on_change: bool,
    /// Report on requests that came in from this time on (RFC 3339); earlier ones still fill
    /// the counters.
    #[arg(long)]
    pub from: Option<String>,
    /// Leave out requests that came in at or after this time (RFC 3339).
    #[arg(long)]
    pub to: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Policy file or directory (default: the embedded default policy).
    #[arg(long, env = "TOLLGATE_POLICY")]
    pub policy: Option<PathBuf>,
    /// Data port address, instead of the policy's server.listen (a container: 0.0.0.0:8787).
    #[arg(long, env = "TOLLGATE_LISTEN")]
    pub listen: Option<std::net::SocketAddr>,
    /// Admin port address, instead of the policy's server.admin_listen.
    #[arg(long, env = "TOLLGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<std::net::SocketAddr>,
    /// Log lines as text (coloured only on a terminal) or json (one object per line).
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, clap::Args)]
pub struct UsageArgs {
    /// Policy file or directory: gives the timezone, and the log's location unless
    /// --db/--postgres/--jsonl is given (default: the embedded default policy).
    #[arg(long, env = "TOLLGATE_POLICY")]
    pub policy: Option<PathBuf>,
    /// Read this SQLite file (default: the policy's state.path).
    #[arg(long, conflicts_with_all = ["postgres", "jsonl"])]
    pub db: Option<PathBuf>,
    /// Read this JSONL audit file (default: the policy's audit.path when audit.sink is jsonl).
    #[arg(long, conflicts_with = "postgres")]
    pub jsonl: Option<PathBuf>,
    /// Read Postgres at this URL (default: the policy's audit.postgres_url when audit.sink is
    /// postgres). From the environment, a password stays out of `ps` and shell history.
    #[arg(long, env = "TOLLGATE_USAGE_POSTGRES_URL", hide_env_values = true)]
    pub postgres: Option<String>,
    /// The usage-log table (default: the policy's audit.table).
    #[arg(long)]
    pub table: Option<String>,
    /// Group by team, consumer, backend or model (default: providers and consumers).
    #[arg(long, value_name = "team|consumer|backend|model")]
    pub by: Option<crate::audit::report::By>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// The policy at `path`, or the embedded default when there is none.
pub fn load_policy(path: Option<&std::path::Path>) -> Result<policy::Policy, policy::PolicyErrors> {
    match path {
        Some(p) => policy::load(p),
        None => policy::from_str(DEFAULT_POLICY, DEFAULT_POLICY_NAME),
    }
}

pub fn check(path: Option<&std::path::Path>, print_default: bool) -> u8 {
    if print_default {
        use std::io::Write;
        let _ = std::io::stdout()
            .lock()
            .write_all(DEFAULT_POLICY.as_bytes());
        return EXIT_OK;
    }
    match load_policy(path) {
        Ok(p) => {
            println!("{}", policy::summary(&p));
            // Where the policy is checked (CI) its keys are often not set: a warning, not a
            // failure. Only the variable's name is printed, never its value.
            for (consumer, env) in policy::unset_key_envs(&p) {
                eprintln!(
                    "warning: identity.virtual_keys: ${env} (consumer {consumer}) is unset or empty: that consumer cannot authenticate"
                );
            }
            println!("ok: {}", p.source);
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
/// `POST /admin/reload` reload the policy (not the embedded default: it has no file).
pub async fn serve(args: &ServeArgs) -> u8 {
    init_tracing(args.log_format);
    // Before anything is served: a SIGTERM that arrives as soon as the first answers have
    // gone out must already find the handlers (else its default action kills the process
    // without the drain).
    let signals = Signals::install();
    let path = args.policy.as_deref();
    let snap = match load_policy(path)
        .map_err(|e| e.to_string())
        .and_then(crate::proxy::snapshot::Snapshot::build)
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return EXIT_INVALID;
        }
    };
    if path.is_none() {
        tracing::info!(
            "no --policy and no $TOLLGATE_POLICY: serving the embedded default policy \
             (`tollgate check --print-default` prints it)"
        );
    }
    // The servers TLS calls trust: the compiled-in roots and `SSL_CERT_FILE`'s certificates.
    match crate::tls::init() {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            certificates = n,
            "trusting the certificates of ${} besides the compiled-in roots",
            crate::tls::CA_FILE_VAR
        ),
        Err(e) => {
            eprintln!("{e}");
            return EXIT_INVALID;
        }
    }
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
    let opts = crate::sidecar::Options {
        listen: args.listen,
        admin_listen: args.admin_listen,
        workers: None,
    };
    let mut running =
        match crate::sidecar::start_with(snap, audit, opts, state.governor.clone()).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("cannot listen: {e}");
                state.finish().await;
                return EXIT_INVALID;
            }
        };
    tracing::info!(addr = %running.addr, admin = %running.admin_addr, %version, "tollgate serving");
    if let Some(p) = path {
        running.watch_policy(p.to_path_buf());
    }
    if let Some(store) = state.redis.clone() {
        store.start_monitor();
        let s = store.clone();
        running
            .ops
            .set_state_status(std::sync::Arc::new(move || s.status()));
        running.ops.set_state_check(std::sync::Arc::new(move || {
            let store = store.clone();
            Box::pin(async move { store.ready().await })
        }));
    }
    signals.wait(&running).await;
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

/// Logs go to stdout: coloured text only when stdout is a terminal (a cluster's log
/// collector gets plain lines), or one JSON object per line.
fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("TOLLGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::stdout().is_terminal())
            .try_init(),
    };
}

fn start_audit(
    p: &crate::policy::Policy,
) -> Result<(crate::audit::Audit, Option<crate::audit::AuditWriter>), crate::audit::AuditError> {
    use crate::audit::{Audit, AuditError, Retention};
    use crate::policy::AuditSink;
    let a = &p.audit;
    // For the database sinks, `<audit.path>.spill` takes rows (JSON lines) while the database
    // is away; the writer loads it back once it answers. Its own name, so an old JSONL audit
    // file is never mistaken for spilled rows.
    let spill = std::path::PathBuf::from(format!("{}.spill", a.path));
    let (audit, writer) = match a.sink {
        AuditSink::Off => return Ok((Audit::off(), None)),
        AuditSink::Jsonl => {
            let rotation = crate::audit::Rotation {
                max_bytes: a.max_bytes,
                keep: a.keep,
                compress: a.compress,
            };
            Audit::jsonl_with(a.path.clone().into(), a.queue, rotation)?
        }
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
    let writer = match (a.retention_days, a.sink) {
        (Some(days), AuditSink::Sqlite) => writer.with_retention(Retention::sqlite(
            p.state.path.clone().into(),
            a.table.clone(),
            days,
        )?),
        (Some(days), AuditSink::Postgres) => {
            let url = a.postgres_url.as_deref().unwrap_or_default();
            writer.with_retention(Retention::postgres(url, a.table.clone(), days)?)
        }
        _ => writer,
    };
    Ok((audit, Some(writer)))
}

/// `usage`: print today's tokens and month-to-date cost per provider and consumer, or per
/// the one grouping `--by` names.
/// Exit 0 printed, 1 the log cannot be read, 2 bad policy or arguments.
pub async fn usage(args: &UsageArgs) -> u8 {
    use crate::audit::report;
    use crate::policy::AuditSink;
    let p = match load_policy(args.policy.as_deref()) {
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
    let by: &[report::By] = match &args.by {
        Some(b) => std::slice::from_ref(b),
        None => &report::By::DEFAULT,
    };
    let pg = args.postgres.clone().or_else(|| {
        (args.db.is_none() && args.jsonl.is_none() && p.audit.sink == AuditSink::Postgres)
            .then(|| p.audit.postgres_url.clone())
            .flatten()
    });
    let res = match (pg, &args.jsonl) {
        (Some(url), _) => report::from_postgres(&url, table, by, tz_name, tz, now).await,
        (None, Some(file)) => jsonl_report(file, by, tz_name, tz, now),
        (None, None) if args.db.is_none() && p.audit.sink == AuditSink::Jsonl => {
            jsonl_report(std::path::Path::new(&p.audit.path), by, tz_name, tz, now)
        }
        (None, None) if args.db.is_none() && p.audit.sink == AuditSink::Off => {
            eprintln!(
                "usage: {}: audit.sink is off, so nothing was logged; set audit.sink to \
                 jsonl, sqlite or postgres",
                p.source
            );
            return EXIT_FAILURE;
        }
        (None, None) => {
            let db = args
                .db
                .clone()
                .unwrap_or_else(|| PathBuf::from(&p.state.path));
            report::from_sqlite(&db, table, by, tz_name, tz, now)
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

/// The JSONL audit as a usage report; torn lines are skipped with a note on stderr.
fn jsonl_report(
    file: &std::path::Path,
    by: &[crate::audit::report::By],
    tz_name: &str,
    tz: &jiff::tz::TimeZone,
    now: jiff::Timestamp,
) -> Result<crate::audit::report::Report, String> {
    if file.as_os_str() == "-" {
        return Err(
            "audit.path is `-` (standard output): there is no file to read; \
                    give the collected lines with --jsonl FILE"
                .into(),
        );
    }
    let (r, skipped) = crate::audit::report::from_jsonl(file, by, tz_name, tz, now)?;
    if skipped > 0 {
        eprintln!(
            "usage: {}: skipped {skipped} line(s) that are not audit records",
            file.display()
        );
    }
    Ok(r)
}

/// `replay`: print what the candidate policy would have decided for the recorded requests.
/// Exit 0 printed, 1 a decision changed under `--fail-on-change`, 2 bad policy, file or time.
pub async fn replay(args: &ReplayArgs) -> u8 {
    use crate::replay;
    let p = match policy::load(&args.policy) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return EXIT_INVALID;
        }
    };
    let time = |flag: &str, v: &Option<String>| -> Result<Option<jiff::Timestamp>, String> {
        v.as_deref()
            .map(|s| {
                s.parse::<jiff::Timestamp>()
                    .map_err(|e| format!("replay: {flag}: not an RFC 3339 time ({s}): {e}"))
            })
            .transpose()
    };
    let period = match (time("--from", &args.from), time("--to", &args.to)) {
        (Ok(from), Ok(to)) => replay::Period { from, to },
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("{e}");
            return EXIT_INVALID;
        }
    };
    let read = match replay::read_all(&args.audit) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("replay: cannot read the audit: {e}");
            return EXIT_INVALID;
        }
    };
    if read.skipped > 0 {
        eprintln!(
            "replay: skipped {} line(s) that are not audit records",
            read.skipped
        );
    }
    if read.records.is_empty() && read.skipped > 0 {
        eprintln!("replay: no audit records in the given files");
        return EXIT_INVALID;
    }
    let report = replay::replay(&p, &read, period).await;
    let text = if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => s + "\n",
            Err(e) => {
                eprintln!("replay: {e}");
                return EXIT_FAILURE;
            }
        }
    } else {
        replay::render(&report)
    };
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    if args.fail_on_change && report.changed > 0 {
        eprintln!(
            "replay: {} decision(s) change under {}",
            report.changed, p.source
        );
        return EXIT_MISMATCH;
    }
    EXIT_OK
}

/// SIGTERM, SIGINT and SIGHUP, listened for from start-up on.
struct Signals {
    #[cfg(unix)]
    streams: Option<[tokio::signal::unix::Signal; 3]>,
}

impl Signals {
    #[cfg(unix)]
    fn install() -> Signals {
        use tokio::signal::unix::{signal, SignalKind};
        let streams = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        ) {
            (Ok(t), Ok(i), Ok(h)) => Some([t, i, h]),
            _ => {
                tracing::error!("cannot install signal handlers");
                None
            }
        };
        Signals { streams }
    }

    #[cfg(not(unix))]
    fn install() -> Signals {
        Signals {}
    }

    /// Until SIGTERM or SIGINT; each SIGHUP reloads the policy.
    #[cfg(unix)]
    async fn wait(self, running: &crate::sidecar::Running) {
        let Some([mut term, mut int, mut hup]) = self.streams else {
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
    async fn wait(self, _running: &crate::sidecar::Running) {
        let _ = tokio::signal::ctrl_c().await;
    }
}
