//! tollgate's entry point: parse the command line, run one command, exit with its code.

use clap::Parser;
use std::process::ExitCode;
use tollgate::cli::{self, Cli, Command};

mod alloc;

// mimalloc instead of glibc malloc: the request path allocates a few dozen times per request
// (see docs/performance.md for what it buys, and src/alloc.rs for how it is called).
#[global_allocator]
static GLOBAL: alloc::Mimalloc = alloc::Mimalloc;

fn main() -> ExitCode {
    let args = Cli::parse();
    // The shared runtime: accepting, the admin port and the background work (audit, OTLP
    // export, the policy watcher). The data port's connections are served by their own
    // single-threaded workers (src/proxy/workers.rs, `TOLLGATE_WORKER_THREADS`).
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate: cannot start the runtime: {e}");
            return ExitCode::from(cli::EXIT_INVALID);
        }
    };
    let code = match args.command {
        Command::Serve(args) => rt.block_on(cli::serve(&args)),
        Command::Check {
            policy,
            print_default,
        } => cli::check(policy.as_deref(), print_default),
        Command::Test { files, json } => rt.block_on(cli::test(&files, json)),
        Command::Usage(args) => rt.block_on(cli::usage(&args)),
        Command::Replay(args) => rt.block_on(cli::replay(&args)),
    };
    ExitCode::from(code)
}
